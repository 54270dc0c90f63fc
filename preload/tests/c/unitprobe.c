/* What a program sees under a systemd unit's sandbox (preload/tests/hardened.rs checks that
 * scripts/unit-sandbox.py applies each setting it claims). Each argument is one check, run in
 * a child of its own (a check that is killed, or that changes namespaces, affects nothing
 * else); one line per check: "CHECK RESULT", where RESULT is "ok [VALUE]", an errno name
 * ("EROFS"), "error:MESSAGE" (dlopen), or "killed:SIGNAL".
 *
 *   id  umask  cwd  caps  env:NAME  rlimit:nofile|nproc|rtprio|memlock
 *   read:PATH  write:PATH  openw:PATH  ls:PATH  stat:PATH  exec:PATH  dlopen:PATH  ns:NAME
 *   socket:AF_INET|AF_INET6|AF_UNIX|AF_NETLINK|AF_PACKET
 *   mmap-wx  mprotect-x  unshare:user|net|mnt  sched-fifo  personality  chmod-suid:PATH
 *   sethostname  syslog  adjtimex  ioperm  i386-getpid  bpf  setrlimit  setaffinity  setuid
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/bpf.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/klog.h>
#include <sys/mman.h>
#include <sys/personality.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/timex.h>
#include <time.h>
#include <unistd.h>

static char out[8192];

static int err(void) {
    const char *n = strerrorname_np(errno);
    snprintf(out, sizeof out, "%s", n ? n : "E?");
    return 0;
}

static int ok(const char *fmt, ...) {
    int n = snprintf(out, sizeof out, "ok");
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        out[n++] = ' ';
        vsnprintf(out + n, sizeof out - n, fmt, ap);
        va_end(ap);
    }
    return 0;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int check(const char *c) {
    const char *arg = strchr(c, ':');
    arg = arg ? arg + 1 : "";
    if (!strcmp(c, "id")) {
        gid_t g[64];
        int n = getgroups(64, g), k = 0;
        char gs[512] = "";
        for (int i = 0; i < n; i++) k += snprintf(gs + k, sizeof gs - k, "%s%u", i ? "," : "", g[i]);
        return ok("uid=%u gid=%u euid=%u groups=%s", getuid(), getgid(), geteuid(), gs);
    }
    if (!strcmp(c, "umask")) {
        mode_t m = umask(0);
        return ok("%03o", m);
    }
    if (!strcmp(c, "cwd")) {
        char b[4096];
        return getcwd(b, sizeof b) ? ok("%s", b) : err();
    }
    if (!strncmp(c, "env:", 4)) {
        const char *v = getenv(arg);
        return v ? ok("%s", v) : ok("(unset)");
    }
    if (!strncmp(c, "rlimit:", 7)) {
        int r = !strcmp(arg, "nofile") ? RLIMIT_NOFILE : !strcmp(arg, "nproc") ? RLIMIT_NPROC
              : !strcmp(arg, "rtprio") ? RLIMIT_RTPRIO : RLIMIT_MEMLOCK;
        struct rlimit l;
        getrlimit(r, &l);
        return ok("%lld:%lld", (long long)l.rlim_cur, (long long)l.rlim_max);
    }
    if (!strcmp(c, "caps") || !strncmp(c, "read:", 5)) {
        const char *p = !strcmp(c, "caps") ? "/proc/self/status" : arg;
        FILE *f = fopen(p, "r");
        if (!f) return err();
        char line[512];
        int n = 0;
        while (fgets(line, sizeof line, f) && n < (int)sizeof out - 600) {
            if (!strcmp(c, "caps") && strncmp(line, "Cap", 3) && strncmp(line, "NoNewPrivs", 10) &&
                strncmp(line, "Seccomp", 7))
                continue;
            line[strcspn(line, "\n")] = 0;
            /* columns collapsed to single spaces, lines joined with ';' */
            char *s = line, *d = line;
            for (; *s; s++) {
                char ch = *s == '\t' ? ' ' : *s;
                if (ch == ' ' && (d == line || d[-1] == ' ')) continue;
                *d++ = ch;
            }
            *d = 0;
            n += snprintf(out + 3 + n, sizeof out - 3 - n, "%s%s", n ? ";" : "", line);
        }
        fclose(f);
        memcpy(out, "ok ", 3);
        return 0;
    }
    if (!strncmp(c, "write:", 6)) {
        int fd = open(arg, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) return err();
        if (write(fd, "x\n", 2) != 2) return err();
        close(fd);
        return ok(NULL);
    }
    if (!strncmp(c, "openw:", 6)) {
        /* Opened for writing, nothing written: safe on files a failing rig would let us change. */
        int fd = open(arg, O_WRONLY);
        if (fd < 0) return err();
        close(fd);
        return ok(NULL);
    }
    if (!strncmp(c, "ns:", 3)) {
        char p[64], b[128];
        snprintf(p, sizeof p, "/proc/self/ns/%s", arg);
        ssize_t n = readlink(p, b, sizeof b - 1);
        if (n < 0) return err();
        b[n] = 0;
        return ok("%s", b);
    }
    if (!strncmp(c, "ls:", 3)) {
        DIR *d = opendir(arg);
        if (!d) return err();
        char *names[512];
        int n = 0;
        struct dirent *e;
        while ((e = readdir(d)) && n < 512)
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) names[n++] = strdup(e->d_name);
        qsort(names, n, sizeof *names, cmp_str);
        int k = snprintf(out, sizeof out, "ok ");
        for (int i = 0; i < n && k < (int)sizeof out - 256; i++)
            k += snprintf(out + k, sizeof out - k, "%s%s", i ? "," : "", names[i]);
        return 0;
    }
    if (!strncmp(c, "stat:", 5)) {
        struct stat st;
        if (lstat(arg, &st)) return err();
        return ok("uid=%u gid=%u mode=%o", st.st_uid, st.st_gid, st.st_mode & 07777);
    }
    if (!strncmp(c, "exec:", 5)) {
        int p[2];
        if (pipe2(p, O_CLOEXEC)) return err();
        pid_t pid = fork();
        if (pid == 0) {
            int null = open("/dev/null", O_WRONLY);
            dup2(null, 1);
            dup2(null, 2);
            char *argv[] = {(char *)arg, "--version", NULL};
            execv(arg, argv);
            int e = errno;
            if (write(p[1], &e, sizeof e) < 0) _exit(2);
            _exit(1);
        }
        close(p[1]);
        int e = 0;
        ssize_t n = read(p[0], &e, sizeof e);
        waitpid(pid, NULL, 0);
        if (n == (ssize_t)sizeof e) {
            errno = e;
            return err();
        }
        return ok(NULL);
    }
    if (!strncmp(c, "dlopen:", 7)) {
        void *h = dlopen(arg, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(out, sizeof out, "error:%s", dlerror());
            return 0;
        }
        return ok(NULL);
    }
    if (!strncmp(c, "socket:", 7)) {
        int fam = !strcmp(arg, "AF_INET") ? AF_INET : !strcmp(arg, "AF_INET6") ? AF_INET6
                : !strcmp(arg, "AF_UNIX") ? AF_UNIX : !strcmp(arg, "AF_NETLINK") ? AF_NETLINK
                : AF_PACKET;
        int type = fam == AF_NETLINK ? SOCK_DGRAM : fam == AF_PACKET ? SOCK_RAW : SOCK_STREAM;
        int s = socket(fam, type, 0);
        return s < 0 ? err() : ok(NULL);
    }
    if (!strcmp(c, "mmap-wx")) {
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? err() : ok(NULL);
    }
    if (!strcmp(c, "mprotect-x")) {
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return err();
        return mprotect(p, 4096, PROT_READ | PROT_EXEC) ? err() : ok(NULL);
    }
    if (!strncmp(c, "unshare:", 8)) {
        int f = !strcmp(arg, "user") ? CLONE_NEWUSER : !strcmp(arg, "net") ? CLONE_NEWNET : CLONE_NEWNS;
        return unshare(f) ? err() : ok(NULL);
    }
    if (!strcmp(c, "sched-fifo")) {
        struct sched_param sp = {.sched_priority = 1};
        return sched_setscheduler(0, SCHED_FIFO, &sp) ? err() : ok(NULL);
    }
    if (!strcmp(c, "personality")) {
        return personality(PER_LINUX32) < 0 ? err() : ok(NULL);
    }
    if (!strncmp(c, "chmod-suid:", 11)) {
        int fd = open(arg, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) return err();
        close(fd);
        int r = chmod(arg, 04755);
        int e = errno;
        unlink(arg);
        errno = e;
        return r ? err() : ok(NULL);
    }
    if (!strcmp(c, "sethostname")) {
        char h[256];
        gethostname(h, sizeof h);
        return sethostname(h, strlen(h)) ? err() : ok(NULL);
    }
    if (!strcmp(c, "syslog")) {
        return klogctl(10 /* SYSLOG_ACTION_SIZE_BUFFER */, NULL, 0) < 0 ? err() : ok(NULL);
    }
    if (!strcmp(c, "adjtimex")) {
        /* Only reads the clock's state (modes 0), but @clock refuses it all the same. */
        struct timex t = {.modes = 0};
        return adjtimex(&t) < 0 ? err() : ok(NULL);
    }
    if (!strcmp(c, "ioperm")) {
        return ioperm(0x80, 1, 1) ? err() : ok(NULL);
    }
    if (!strcmp(c, "i386-getpid")) {
        long r;
        __asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "memory");
        return r < 0 ? (errno = -r, err()) : ok(NULL);
    }
    if (!strcmp(c, "bpf")) {
        /* What the library calls to open its option map (issue 35): in @privileged. */
        union bpf_attr a;
        memset(&a, 0, sizeof a);
        return syscall(SYS_bpf, BPF_OBJ_GET, &a, sizeof a) < 0 ? err() : ok(NULL);
    }
    if (!strcmp(c, "setrlimit")) {
        /* The raw syscall (in @resources); glibc's setrlimit() calls prlimit64, in @default. */
        struct rlimit l;
        getrlimit(RLIMIT_NOFILE, &l);
        return syscall(SYS_setrlimit, RLIMIT_NOFILE, &l) ? err() : ok(NULL);
    }
    if (!strcmp(c, "setaffinity")) {
        /* In @resources: a library pinning its threads would be killed. */
        cpu_set_t set;
        sched_getaffinity(0, sizeof set, &set);
        return sched_setaffinity(0, sizeof set, &set) ? err() : ok(NULL);
    }
    if (!strcmp(c, "setuid")) {
        /* In @privileged (and @setuid). */
        return setuid(getuid()) ? err() : ok(NULL);
    }
    snprintf(out, sizeof out, "unknown-check");
    return 0;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        int p[2];
        if (pipe(p)) return 1;
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            check(argv[i]);
            if (write(p[1], out, strlen(out)) < 0) _exit(2);
            _exit(0);
        }
        close(p[1]);
        char buf[8192];
        ssize_t n = 0, r;
        while ((r = read(p[0], buf + n, sizeof buf - 1 - n)) > 0) n += r;
        buf[n] = 0;
        close(p[0]);
        int st;
        waitpid(pid, &st, 0);
        if (WIFSIGNALED(st))
            printf("%s killed:%s\n", argv[i], sigabbrev_np(WTERMSIG(st)) ? sigabbrev_np(WTERMSIG(st)) : "?");
        else
            printf("%s %s\n", argv[i], buf);
    }
    return 0;
}
