/* Built with -O2 -D_FORTIFY_SOURCE=2: the reads become __read_chk / __recv_chk /
 * __recvfrom_chk calls, which glibc serves without going through read/recv/recvfrom. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void echo(int fd, const char *msg, int how) {
    char buf[64], tmp[64];
    size_t want = strlen(msg), got = 0;
    if (write(fd, msg, want) != (ssize_t)want) { perror("write"); exit(1); }
    while (got < want) {
        ssize_t n;
        size_t room = want - got; /* not a constant: the fortified call checks it */
        if (how == 0) n = read(fd, tmp, room);
        else if (how == 1) n = recv(fd, tmp, room, 0);
        else n = recvfrom(fd, tmp, room, 0, NULL, NULL);
        if (n <= 0) { perror("read"); exit(1); }
        memcpy(buf + got, tmp, n);
        got += n;
    }
    if (memcmp(buf, msg, want) != 0) { fprintf(stderr, "echo differs\n"); exit(1); }
}

int main(int argc, char **argv) {
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(atoi(argv[2]));
    inet_pton(AF_INET, argv[1], &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) { perror("connect"); return 1; }
    echo(fd, "through __read_chk", 0);
    echo(fd, "through __recv_chk", 1);
    echo(fd, "through __recvfrom_chk", 2);
    close(fd);
    puts("OK");
    return 0;
}
