/* Sockets that change hands (issue 36): a server whose primary process hands sockets to
 * forked workers over AF_UNIX socketpairs (SCM_RIGHTS), a listener inherited across exec,
 * and a client that checks every echo byte for byte.
 *
 * Every exchange is a message: an 8-byte header (length and sequence number, big-endian)
 * and LENGTH payload bytes; the server answers each with the same message.
 *
 *   handover conn PORT N W         the primary forks W workers (each with a socketpair),
 *                                  listens on 127.0.0.1:PORT, accepts N connections and
 *                                  sends each to a worker in turn (sendmsg, SCM_RIGHTS),
 *                                  closing its copy once sent; workers serve them
 *   handover listener PORT N       the primary forks one worker, listens, sends the listener
 *                                  to it and closes its copy; the worker accepts N
 *   handover established PORT N W  as conn, but the primary first serves each connection's
 *                                  first message itself, then sends it to a worker, which
 *                                  serves the rest
 *   handover exec PORT N           listens, moves the listener to fd 3 and execs itself as
 *                                  `handover fd 3 N` (with HANDOVER_PLAIN_EXEC=execl, execle
 *                                  or execlp: by that call, without LD_PRELOAD, with
 *                                  LISTEN_FDS=1: an image that does not run the library)
 *   handover worker FD N           a worker on socketpair end FD (with HANDOVER_PLAIN_WORKERS
 *                                  set, conn and listener exec their workers this way,
 *                                  without LD_PRELOAD: workers that do not run the library;
 *                                  HANDOVER_EXEC_DELAY_MS: after that long a pause)
 *   handover fd FD N               serves what FD is: a listener (N connections accepted on
 *                                  it) or a connection (served alone); with LISTEN_FDS set
 *                                  (systemd's protocol) it checks LISTEN_PID first
 *   handover client HOST PORT N SIZE MSGS
 *                                  N connections at once, each MSGS messages of SIZE bytes;
 *                                  prints "ECHOED n", then holds every connection open until
 *                                  a line (or EOF) on stdin, closes them, prints "OK n"
 *
 * Servers print "PRIMARY pid", "WORKER pid", "READY" once they listen, "SERVED …" per
 * process at the end, and "ERROR pid what: message (ERRNO)" for anything that failed; they
 * exit 0 only if nothing failed. Every process ends by SIGALRM after 90 s at the latest: a
 * hang is a failure, never a stuck test.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* Per-operation bound on every socket of the program: a peer that never answers is an
 * error within seconds. */
#define IO_TIMEOUT_S 10
#define MAX_MSG (4u << 20)

static char *self_path;

static const char *errname(int e) {
    const char *n = strerrorname_np(e);
    return n ? n : "?";
}

static void report(const char *what) {
    int e = errno;
    printf("ERROR %d %s: %s (%s)\n", (int)getpid(), what, strerror(e), errname(e));
}

static void die(const char *what) {
    report(what);
    exit(1);
}

static void timeouts(int fd) {
    struct timeval tv = {.tv_sec = IO_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* 1: all read; 0: EOF before the first byte; -1: error or EOF midway (errno ECONNABORTED). */
static int read_full(int fd, void *buf, size_t len) {
    size_t off = 0;
    while (off < len) {
        ssize_t r = read(fd, (char *)buf + off, len - off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) {
            if (off == 0) return 0;
            errno = ECONNABORTED;
            return -1;
        }
        off += (size_t)r;
    }
    return 1;
}

static int write_full(int fd, const void *buf, size_t len) {
    size_t off = 0;
    while (off < len) {
        ssize_t r = write(fd, (const char *)buf + off, len - off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        off += (size_t)r;
    }
    return 0;
}

/* Serves one message on `fd`: 1 served, 0 the peer closed, -1 failed (reported). */
static int serve_msg(int fd, unsigned long long *bytes) {
    uint32_t h[2];
    int r = read_full(fd, h, sizeof h);
    if (r == 0) return 0;
    if (r < 0) {
        report("read header");
        return -1;
    }
    uint32_t len = ntohl(h[0]);
    if (len > MAX_MSG) {
        /* 0xE2D4C3D9 is "SMCR" in EBCDIC: the eye catcher of a CLC message (the peer's
         * Proposal reached the program). */
        printf("ERROR %d bad header: %08x%s (not our protocol)\n", (int)getpid(), len,
               len == 0xE2D4C3D9u ? " = CLC eye catcher SMCR: a CLC message reached the program"
                                   : "");
        return -1;
    }
    char *buf = malloc(sizeof h + len);
    memcpy(buf, h, sizeof h);
    if (read_full(fd, buf + sizeof h, len) != 1) {
        report("read payload");
        free(buf);
        return -1;
    }
    if (write_full(fd, buf, sizeof h + len) != 0) {
        report("write answer");
        free(buf);
        return -1;
    }
    free(buf);
    *bytes += len;
    return 1;
}

/* ---- what a server process counts */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long conns_served, msgs_served, failures;
static unsigned long long bytes_served;

static void count(unsigned long msgs, unsigned long long bytes, int failed) {
    pthread_mutex_lock(&mu);
    conns_served++;
    msgs_served += msgs;
    bytes_served += bytes;
    failures += failed != 0;
    pthread_mutex_unlock(&mu);
}

/* Serves a connection to its end (the peer's close), then closes it. */
static void *serve_conn(void *arg) {
    int fd = (int)(intptr_t)arg;
    unsigned long msgs = 0;
    unsigned long long bytes = 0;
    int r;
    timeouts(fd);
    while ((r = serve_msg(fd, &bytes)) == 1) msgs++;
    close(fd);
    count(msgs, bytes, r < 0);
    return NULL;
}

struct threads {
    pthread_t *t;
    size_t n, cap;
};

static void spawn_serve(struct threads *ts, int fd) {
    if (ts->n == ts->cap) {
        ts->cap = ts->cap ? ts->cap * 2 : 16;
        ts->t = realloc(ts->t, ts->cap * sizeof *ts->t);
    }
    if (pthread_create(&ts->t[ts->n], NULL, serve_conn, (void *)(intptr_t)fd) != 0)
        die("pthread_create");
    ts->n++;
}

static void join_all(struct threads *ts) {
    for (size_t i = 0; i < ts->n; i++) pthread_join(ts->t[i], NULL);
    ts->n = 0;
}

/* "SERVED conns C msgs M bytes B" and the exit status. */
static int finish(const char *who) {
    printf("%s %d SERVED conns %lu msgs %lu bytes %llu failures %lu\n", who, (int)getpid(),
           conns_served, msgs_served, bytes_served, failures);
    return failures ? 1 : 0;
}

/* ---- SCM_RIGHTS */

static void send_fd(int unix_fd, int fd) {
    char byte = 'F';
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                       .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(unix_fd, &m, 0) != 1) die("sendmsg SCM_RIGHTS");
}

/* The next descriptor sent over `unix_fd`; -1 at EOF. */
static int recv_fd(int unix_fd) {
    char byte;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                       .msg_controllen = sizeof u.buf};
    ssize_t r;
    do r = recvmsg(unix_fd, &m, MSG_CMSG_CLOEXEC);
    while (r < 0 && errno == EINTR);
    if (r < 0) die("recvmsg");
    if (r == 0) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
        printf("ERROR %d recvmsg: no descriptor in the message\n", (int)getpid());
        exit(1);
    }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* ---- servers */

static int listen_on(int port) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    if (ls < 0) die("socket");
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) != 0) die("bind");
    if (listen(ls, 128) != 0) die("listen");
    return ls;
}

static int accept_one(int ls) {
    int c;
    do c = accept(ls, NULL, NULL);
    while (c < 0 && errno == EINTR);
    if (c < 0) die("accept");
    return c;
}

/* Accepts `n` connections on `ls`, each served on a thread of this process. */
static int accept_and_serve(int ls, int n, const char *who) {
    struct threads ts = {0};
    for (int i = 0; i < n; i++) spawn_serve(&ts, accept_one(ls));
    join_all(&ts);
    return finish(who);
}

/* A worker: serves every descriptor that comes over `unix_fd` (connections, or a listener to
 * accept `n` connections on) until the primary closes its end. */
static int worker(int unix_fd, int n) {
    printf("WORKER %d\n", (int)getpid());
    struct threads ts = {0};
    int fd;
    while ((fd = recv_fd(unix_fd)) >= 0) {
        int listening = 0;
        socklen_t l = sizeof listening;
        if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &l) != 0) die("getsockopt");
        if (listening) {
            for (int i = 0; i < n; i++) spawn_serve(&ts, accept_one(fd));
            close(fd);
        } else {
            /* `established` sends its connections non-blocking; a descriptor that arrives
             * otherwise changed on the way. */
            int fl = fcntl(fd, F_GETFL);
            if (getenv("HANDOVER_ESTABLISHED") && !(fl & O_NONBLOCK))
                printf("ERROR %d connection arrived blocking, sent non-blocking\n", (int)getpid());
            if (fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) die("fcntl");
            spawn_serve(&ts, fd);
        }
    }
    join_all(&ts);
    return finish("WORKER");
}

/* Forks `w` workers, each with its own socketpair; their ends in `socks`, pids in `pids`. */
static void fork_workers(int w, int n, int *socks, pid_t *pids) {
    for (int i = 0; i < w; i++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) die("socketpair");
        fflush(stdout);
        pid_t p = fork();
        if (p < 0) die("fork");
        if (p == 0) {
            close(sv[0]);
            for (int j = 0; j < i; j++) close(socks[j]);
            if (getenv("HANDOVER_PLAIN_WORKERS")) {
                /* A worker that does not run the library: the same program, exec'd without
                 * LD_PRELOAD, keeping its end of the socketpair. */
                char fd_s[16], n_s[16];
                snprintf(fd_s, sizeof fd_s, "%d", sv[1]);
                snprintf(n_s, sizeof n_s, "%d", n);
                if (fcntl(sv[1], F_SETFD, 0) != 0) die("fcntl");
                /* HANDOVER_EXEC_DELAY_MS: the worker stays the primary's image that long
                 * before its exec (the primary sends it the socket meanwhile). */
                const char *delay = getenv("HANDOVER_EXEC_DELAY_MS");
                if (delay && atoi(delay) > 0) usleep((useconds_t)atoi(delay) * 1000);
                unsetenv("LD_PRELOAD");
                execl(self_path, self_path, "worker", fd_s, n_s, (char *)NULL);
                die("execl");
            }
            exit(worker(sv[1], n));
        }
        close(sv[1]);
        socks[i] = sv[0];
        pids[i] = p;
    }
}

/* Closes the workers' socketpairs (they finish their connections and exit) and waits. */
static int reap(int w, int *socks, pid_t *pids) {
    int bad = 0;
    for (int i = 0; i < w; i++) close(socks[i]);
    for (int i = 0; i < w; i++) {
        int st;
        if (waitpid(pids[i], &st, 0) < 0) die("waitpid");
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("ERROR %d worker %d ended with status %#x\n", (int)getpid(), (int)pids[i], st);
            bad = 1;
        }
    }
    return bad;
}

/* conn and established: the primary accepts; `first` serves the first message itself. */
static int primary_conns(int port, int n, int w, int first) {
    int socks[64];
    pid_t pids[64];
    if (w < 1 || w > 64) w = 1;
    printf("PRIMARY %d\n", (int)getpid());
    fork_workers(w, n, socks, pids);
    int ls = listen_on(port);
    printf("READY\n");
    for (int i = 0; i < n; i++) {
        int c = accept_one(ls);
        if (first) {
            unsigned long long bytes = 0;
            timeouts(c);
            int r = serve_msg(c, &bytes);
            if (r != 1) {
                if (r == 0) printf("ERROR %d connection %d closed before its first message\n",
                                   (int)getpid(), i);
                count(0, 0, 1);
                close(c);
                continue;
            }
            count(1, bytes, 0);
            /* Sent non-blocking: the worker must get it so (it checks, then blocks). */
            if (fcntl(c, F_SETFL, fcntl(c, F_GETFL) | O_NONBLOCK) != 0) die("fcntl");
        }
        send_fd(socks[i % w], c);
        close(c);
    }
    close(ls);
    int bad = reap(w, socks, pids);
    return finish("PRIMARY") | bad;
}

static int primary_listener(int port, int n) {
    int sock;
    pid_t pid;
    printf("PRIMARY %d\n", (int)getpid());
    fork_workers(1, n, &sock, &pid);
    int ls = listen_on(port);
    send_fd(sock, ls);
    close(ls);
    printf("READY\n");
    int bad = reap(1, &sock, &pid);
    return finish("PRIMARY") | bad;
}

static int exec_listener(int port, int n) {
    printf("PRIMARY %d\n", (int)getpid());
    int ls = listen_on(port);
    if (ls != 3) {
        if (dup2(ls, 3) != 3) die("dup2");
        close(ls);
    }
    char nbuf[16];
    snprintf(nbuf, sizeof nbuf, "%d", n);
    fflush(stdout);
    const char *plain = getenv("HANDOVER_PLAIN_EXEC");
    if (plain) {
        /* The new image does not run the library: systemd's protocol names fd 3 its
         * listener. The variadic calls, each its own way of passing the environment. */
        char pid_s[32];
        snprintf(pid_s, sizeof pid_s, "LISTEN_PID=%d", (int)getpid());
        if (!strcmp(plain, "execle")) {
            char *env[] = {"LISTEN_FDS=1", pid_s, NULL};
            execle("/proc/self/exe", self_path, "fd", "3", nbuf, (char *)NULL, env);
        } else {
            unsetenv("LD_PRELOAD");
            unsetenv("HANDOVER_PLAIN_EXEC");
            setenv("LISTEN_FDS", "1", 1);
            setenv("LISTEN_PID", pid_s + strlen("LISTEN_PID="), 1);
            if (!strcmp(plain, "execlp"))
                execlp("/proc/self/exe", self_path, "fd", "3", nbuf, (char *)NULL);
            else
                execl("/proc/self/exe", self_path, "fd", "3", nbuf, (char *)NULL);
        }
        die("exec");
    }
    execl("/proc/self/exe", self_path, "fd", "3", nbuf, (char *)NULL);
    die("exec");
    return 1;
}

static int serve_fd(int fd, int n) {
    printf("SERVER %d\n", (int)getpid());
    const char *lf = getenv("LISTEN_FDS"), *lp = getenv("LISTEN_PID"), *pre = getenv("LD_PRELOAD");
    printf("LD_PRELOAD %s\n", pre && *pre ? pre : "(unset)");
    if (lf) {
        printf("LISTEN_FDS %s LISTEN_PID %s\n", lf, lp ? lp : "(unset)");
        if (!lp || atoi(lp) != (int)getpid()) {
            printf("ERROR %d LISTEN_PID is not ours\n", (int)getpid());
            return 1;
        }
    }
    int listening = 0;
    socklen_t l = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &l) != 0) die("getsockopt fd");
    if (!listening) {
        serve_conn((void *)(intptr_t)fd);
        return finish("SERVER");
    }
    printf("READY\n");
    return accept_and_serve(fd, n, "SERVER");
}

/* ---- client */

struct cconn {
    int id, fd, ok;
    const char *host;
    int port;
    size_t size;
    int msgs;
    char err[256];
};

static unsigned char pattern(int conn, int msg, size_t j) {
    return (unsigned char)(((uint32_t)j * 2654435761u >> 13) ^ (uint32_t)(conn * 73 + msg * 151));
}

static void *client_conn(void *arg) {
    struct cconn *c = arg;
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c->port)};
    inet_pton(AF_INET, c->host, &a.sin_addr);
    if (connect(c->fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        snprintf(c->err, sizeof c->err, "connect: %s (%s)", strerror(e), errname(e));
        return NULL;
    }
    timeouts(c->fd);
    size_t total = 8 + c->size;
    unsigned char *out = malloc(total), *in = malloc(total);
    for (int m = 0; m < c->msgs; m++) {
        uint32_t h[2] = {htonl((uint32_t)c->size), htonl((uint32_t)m)};
        memcpy(out, h, 8);
        for (size_t j = 0; j < c->size; j++) out[8 + j] = pattern(c->id, m, j);
        if (write_full(c->fd, out, total) != 0) {
            int e = errno;
            snprintf(c->err, sizeof c->err, "message %d: write: %s (%s)", m, strerror(e),
                     errname(e));
            goto out;
        }
        int r = read_full(c->fd, in, total);
        if (r != 1) {
            int e = r == 0 ? ECONNABORTED : errno;
            snprintf(c->err, sizeof c->err, "message %d: read answer: %s (%s)%s", m, strerror(e),
                     errname(e), r == 0 ? " [closed by the server before answering]" : "");
            goto out;
        }
        if (memcmp(in, out, total) != 0) {
            size_t d = 0;
            while (in[d] == out[d]) d++;
            snprintf(c->err, sizeof c->err,
                     "message %d: answer differs at byte %zu of %zu (got %02x, sent %02x)", m, d,
                     total, in[d], out[d]);
            goto out;
        }
    }
    c->ok = 1;
out:
    free(out);
    free(in);
    return NULL;
}

static int client(const char *host, int port, int n, size_t size, int msgs) {
    struct cconn *cs = calloc((size_t)n, sizeof *cs);
    pthread_t *ts = calloc((size_t)n, sizeof *ts);
    for (int i = 0; i < n; i++) {
        cs[i] = (struct cconn){.id = i, .fd = -1, .host = host, .port = port, .size = size,
                               .msgs = msgs};
        if (pthread_create(&ts[i], NULL, client_conn, &cs[i]) != 0) die("pthread_create");
    }
    int ok = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(ts[i], NULL);
        if (cs[i].ok)
            ok++;
        else
            printf("ERROR client connection %d of %d: %s\n", i + 1, n, cs[i].err);
    }
    printf("ECHOED %d of %d\n", ok, n);
    fflush(stdout);
    /* Held open while the test looks at the sockets (smc-stat, ss). */
    char line[64];
    if (!fgets(line, sizeof line, stdin)) { /* EOF: the same */ }
    for (int i = 0; i < n; i++)
        if (cs[i].fd >= 0) close(cs[i].fd);
    if (ok == n) printf("OK %d\n", n);
    return ok == n ? 0 : 1;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    alarm(90);
    /* A write to a connection the peer reset is an error to report (EPIPE), not death. */
    signal(SIGPIPE, SIG_IGN);
    self_path = argv[0];
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "conn") && argc == 5)
        return primary_conns(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), 0);
    if (!strcmp(mode, "established") && argc == 5 && setenv("HANDOVER_ESTABLISHED", "1", 1) == 0)
        return primary_conns(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), 1);
    if (!strcmp(mode, "listener") && argc == 4) return primary_listener(atoi(argv[2]), atoi(argv[3]));
    if (!strcmp(mode, "exec") && argc == 4) return exec_listener(atoi(argv[2]), atoi(argv[3]));
    if (!strcmp(mode, "fd") && argc == 4) return serve_fd(atoi(argv[2]), atoi(argv[3]));
    if (!strcmp(mode, "worker") && argc == 4) return worker(atoi(argv[2]), atoi(argv[3]));
    if (!strcmp(mode, "client") && argc == 7)
        return client(argv[2], atoi(argv[3]), atoi(argv[4]), (size_t)atol(argv[5]), atoi(argv[6]));
    fprintf(stderr, "usage: see the comment at the top of handover.c\n");
    return 2;
}
