/* Ordering across connections, as programs rely on it over loopback TCP: a client writes on
 * connection A, then on connection B; the server's event loop (epoll) must see A's bytes no
 * later than B's.
 *
 *   order server PORT ROUNDS [lt|et]   level- (default) or edge-triggered epoll; prints "order ROUNDS rounds, V out of order", then stays
 *                              until its stdin closes
 *   order client PORT ROUNDS   ends when the server has gone
 *
 * Per round the client writes 'a' on A and 'b' on B, then waits for the server's ack on A.
 * The server handles events in the order epoll_wait returns them; a round is out of order if
 * it reads B's byte before A's. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void read_exact(int fd, char *b, size_t n) {
    while (n) {
        ssize_t r = read(fd, b, n);
        if (r <= 0)
            die("read");
        b += r;
        n -= (size_t)r;
    }
}

static int server(int port, long rounds, int et) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (void *)&a, sizeof a) || listen(l, 8))
        die("listen");
    int c[2] = {-1, -1};
    for (int i = 0; i < 2; i++) {
        int s = accept(l, 0, 0);
        char who;
        if (s < 0)
            die("accept");
        read_exact(s, &who, 1);
        c[who == 'B'] = s;
    }
    setsockopt(c[0], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int ep = epoll_create1(0);
    for (int i = 0; i < 2; i++) {
        struct epoll_event ev = {.events = EPOLLIN | (et ? EPOLLET : 0), .data.u32 = (unsigned)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, c[i], &ev))
            die("epoll_ctl");
    }
    long bad = 0;
    for (long r = 0; r < rounds; r++) {
        int got[2] = {0, 0}, first = -1;
        while (!(got[0] && got[1])) {
            struct epoll_event evs[4];
            int n = epoll_wait(ep, evs, 4, -1);
            if (n < 0)
                die("epoll_wait");
            if (first < 0 && getenv("ORDER_DEBUG") && n > 0 && evs[0].data.u32 != 0)
                fprintf(stderr, "round %ld: %d events, first %u\n", r, n, evs[0].data.u32);
            for (int k = 0; k < n; k++) {
                int i = (int)evs[k].data.u32;
                char b;
                if (got[i])
                    continue;
                read_exact(c[i], &b, 1);
                got[i] = 1;
                if (first < 0)
                    first = i;
            }
        }
        bad += first != 0;
        if (write(c[0], "k", 1) != 1)
            die("ack");
    }
    printf("order %ld rounds, %ld out of order\n", rounds, bad);
    fflush(stdout);
    /* Stay (connections open, for smc-stat) until stdin closes. */
    char x;
    while (read(0, &x, 1) > 0)
        ;
    return 0;
}

static int conn(int port, char who) {
    int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(s, (void *)&a, sizeof a))
        die("connect");
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (write(s, &who, 1) != 1)
        die("hello");
    return s;
}

static int client(int port, long rounds) {
    int a = conn(port, 'A');
    int b = conn(port, 'B');
    for (long r = 0; r < rounds; r++) {
        char k;
        if (write(a, "a", 1) != 1 || write(b, "b", 1) != 1)
            die("write");
        read_exact(a, &k, 1);
    }
    /* Until the server goes. */
    char x;
    while (read(a, &x, 1) > 0)
        ;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4)
        return 2;
    int port = atoi(argv[2]);
    long rounds = atol(argv[3]);
    int et = argc > 4 && strcmp(argv[4], "et") == 0;
    return strcmp(argv[1], "server") == 0 ? server(port, rounds, et) : client(port, rounds);
}
