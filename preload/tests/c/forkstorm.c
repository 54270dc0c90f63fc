/* A threaded program that forks while its threads open and close SMC-R connections (as a
 * threaded server that runs subprocesses does). Each child closes an inherited SMC-R
 * descriptor and, every 8th, makes a connection of its own, then exits; a child that is
 * not done within 5 s (a lock of ours it inherited held) is killed and counted as hung.
 *
 *   forkstorm server ADDR PORT          echo server, a thread per connection
 *   forkstorm client ADDR PORT SECONDS  prints "FORKS n HUNG h FAILED f ECHOES e"
 */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static struct sockaddr_in peer;
static volatile int stop;
static long echoes[2];

static int echo_once(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -1;
    if (connect(s, (struct sockaddr *)&peer, sizeof peer) != 0) { close(s); return -1; }
    char out[64], in[64];
    memset(out, 'x', sizeof out);
    size_t got = 0;
    if (write(s, out, sizeof out) != (ssize_t)sizeof out) { close(s); return -1; }
    while (got < sizeof in) {
        ssize_t n = read(s, in + got, sizeof in - got);
        if (n <= 0) { close(s); return -1; }
        got += (size_t)n;
    }
    close(s);
    return memcmp(in, out, sizeof in) == 0 ? 0 : -1;
}

static void *churn(void *arg) {
    long *count = arg;
    while (!stop)
        if (echo_once() == 0) (*count)++;
    return NULL;
}

static void *serve(void *arg) {
    int c = (int)(long)arg;
    char buf[4096];
    ssize_t n;
    while ((n = read(c, buf, sizeof buf)) > 0)
        if (write(c, buf, (size_t)n) != n) break;
    close(c);
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    memset(&peer, 0, sizeof peer);
    peer.sin_family = AF_INET;
    peer.sin_port = htons((unsigned short)atoi(argv[3]));
    inet_pton(AF_INET, argv[2], &peer.sin_addr);
    if (strcmp(argv[1], "server") == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (struct sockaddr *)&peer, sizeof peer) || listen(l, 128)) { perror("listen"); return 1; }
        printf("READY\n");
        fflush(stdout);
        for (;;) {
            int c = accept(l, NULL, NULL);
            if (c < 0) { if (errno == EINTR) continue; perror("accept"); return 1; }
            pthread_t t;
            pthread_create(&t, NULL, serve, (void *)(long)c);
            pthread_detach(t);
        }
    }
    double secs = argc > 4 ? atof(argv[4]) : 3;
    /* An SMC-R connection the children inherit and close. */
    int keep = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(keep, (struct sockaddr *)&peer, sizeof peer) != 0) { perror("connect"); return 1; }
    char b[8] = "1234567";
    if (write(keep, b, 8) != 8 || read(keep, b, 8) != 8) { perror("keep"); return 1; }
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, churn, &echoes[i]);
    long forks = 0, hung = 0, failed = 0;
    double end = now() + secs;
    while (now() < end) {
        pid_t p = fork();
        if (p < 0) { perror("fork"); failed++; continue; }
        if (p == 0) {
            alarm(5);
            int bad = close(keep) != 0;
            if (forks % 8 == 0) bad |= echo_once() != 0;
            _exit(bad);
        }
        forks++;
        int st;
        while (waitpid(p, &st, 0) < 0 && errno == EINTR) {}
        if (WIFSIGNALED(st)) hung++;
        else if (WEXITSTATUS(st) != 0) failed++;
    }
    stop = 1;
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    printf("FORKS %ld HUNG %ld FAILED %ld ECHOES %ld\n", forks, hung, failed, echoes[0] + echoes[1]);
    close(keep);
    return 0;
}
