/* A server that forbids new threads once it listens, as hardened programs do (haproxy sets
 * RLIMIT_NPROC to 0 after binding; sandboxes filter clone), then serves echo connections
 * from one epoll loop with non-blocking sockets.
 *
 *   lockdown server ADDR PORT N HOW   echo server; after N connections closed prints
 *                                     "SERVED n BYTES b" (with nproc, then "THREADS
 *                                     refused" if it may create none) and exits 0
 *   lockdown client ADDR PORT N SIZE  opens N connections at once, then on each writes SIZE
 *                                     bytes and reads them back; prints "OK n"
 *
 * HOW, applied after listen(), before "READY":
 *   nproc            setrlimit(RLIMIT_NPROC, {0, 0})
 *   seccomp-prctl    prctl(PR_SET_SECCOMP) with a filter that kills the process on clone and
 *                    clone3 (this thread only, as prctl installs it)
 *   seccomp-syscall  the same filter through syscall(SYS_seccomp) with
 *                    SECCOMP_FILTER_FLAG_TSYNC (every thread, as libseccomp installs it)
 *   none             nothing
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __NR_clone3
#define __NR_clone3 435
#endif
#if defined(__x86_64__)
#define ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH AUDIT_ARCH_AARCH64
#else
#error "x86_64 or aarch64"
#endif

static void die(const char *what) {
    printf("FAIL %s: %s\n", what, strerror(errno));
    fflush(stdout);
    exit(1);
}

static void no_clone(int tsync) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1L, 0L, 0L, 0L) != 0) die("no_new_privs");
    if (tsync) {
        if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog) != 0)
            die("seccomp");
    } else if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0L, 0L) != 0) {
        die("prctl seccomp");
    }
}

static void *idle(void *arg) { return arg; }

struct conn {
    char buf[65536];
    size_t len, off;
};

static int server(struct sockaddr_in *a, int n, const char *how) {
    int l = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)a, sizeof *a) != 0) die("bind");
    if (listen(l, 128) != 0) die("listen");
    if (!strcmp(how, "nproc")) {
        struct rlimit r = {0, 0};
        if (setrlimit(RLIMIT_NPROC, &r) != 0) die("setrlimit");
    } else if (!strcmp(how, "seccomp-prctl")) {
        no_clone(0);
    } else if (!strcmp(how, "seccomp-syscall")) {
        no_clone(1);
    } else if (strcmp(how, "none")) {
        errno = EINVAL;
        die(how);
    }
    printf("READY\n");
    fflush(stdout);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = l};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev) != 0) die("epoll_ctl");
    struct conn *conns[4096] = {0};
    int served = 0;
    long bytes = 0;
    while (served < n) {
        struct epoll_event evs[64];
        int k = epoll_wait(ep, evs, 64, -1);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) die("epoll_wait");
        for (int i = 0; i < k; i++) {
            int fd = evs[i].data.fd;
            if (fd == l) {
                int c;
                while ((c = accept4(l, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    if (c >= 4096) die("too many");
                    conns[c] = calloc(1, sizeof(struct conn));
                    struct epoll_event e = {.events = EPOLLIN, .data.fd = c};
                    if (epoll_ctl(ep, EPOLL_CTL_ADD, c, &e) != 0) die("epoll_ctl conn");
                }
                continue;
            }
            struct conn *c = conns[fd];
            int closed = 0;
            for (;;) {
                if (c->off < c->len) {
                    ssize_t w = write(fd, c->buf + c->off, c->len - c->off);
                    if (w < 0 && errno == EAGAIN) break;
                    if (w < 0) { closed = 1; break; }
                    c->off += (size_t)w;
                    bytes += w;
                    continue;
                }
                c->off = c->len = 0;
                ssize_t r = read(fd, c->buf, sizeof c->buf);
                if (r < 0 && errno == EAGAIN) break;
                if (r <= 0) { closed = 1; break; }
                c->len = (size_t)r;
            }
            if (closed) {
                epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
                close(fd);
                free(c);
                conns[fd] = NULL;
                served++;
            } else {
                struct epoll_event e = {
                    .events = c->off < c->len ? EPOLLOUT : EPOLLIN, .data.fd = fd};
                epoll_ctl(ep, EPOLL_CTL_MOD, fd, &e);
            }
        }
    }
    printf("SERVED %d BYTES %ld\n", served, bytes);
    if (!strcmp(how, "nproc")) {
        /* The lock-down held: no thread of our own now (a thread the filter modes must not
         * try: it would kill the process). */
        pthread_t t;
        int e = pthread_create(&t, NULL, idle, NULL);
        printf("THREADS %s\n", e == 0 ? "allowed" : "refused");
        if (e == 0) pthread_join(t, NULL);
    }
    return 0;
}

static int client(struct sockaddr_in *a, int n, size_t size) {
    int *s = calloc((size_t)n, sizeof(int));
    char *out = malloc(size), *in = malloc(size);
    for (int i = 0; i < n; i++) {
        s[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(s[i], (struct sockaddr *)a, sizeof *a) != 0) die("connect");
    }
    for (int i = 0; i < n; i++) {
        for (size_t j = 0; j < size; j++) out[j] = (char)(j * 7 + (size_t)i);
        for (size_t done = 0; done < size;) {
            ssize_t w = write(s[i], out + done, size - done);
            if (w <= 0) die("write");
            done += (size_t)w;
        }
        for (size_t got = 0; got < size;) {
            ssize_t r = read(s[i], in + got, size - got);
            if (r <= 0) die("read");
            got += (size_t)r;
        }
        if (memcmp(in, out, size) != 0) {
            printf("FAIL echo %d differs\n", i);
            return 1;
        }
        close(s[i]);
    }
    printf("OK %d\n", n);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s server ADDR PORT N HOW | client ADDR PORT N SIZE\n", argv[0]);
        return 2;
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[3]))};
    inet_pton(AF_INET, argv[2], &a.sin_addr);
    int n = atoi(argv[4]);
    if (!strcmp(argv[1], "server")) return server(&a, n, argv[5]);
    return client(&a, n, (size_t)atol(argv[5]));
}
