/* A program that listens (so the library has a runtime and a stats area), then runs a command
 * the way posix shells, JVMs and CPython may: vfork, then exec in the child. Prints how many
 * stats areas of its pid are in STATS_DIR before and after: the child's exec must not remove
 * the parent's. */
#define _GNU_SOURCE
#include <dirent.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static int areas(const char *dir) {
    char prefix[32];
    snprintf(prefix, sizeof prefix, "%d-", (int)getpid());
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
    closedir(d);
    return n;
}

int main(void) {
    const char *dir = getenv("SMCR_STATS_DIR");
    if (!dir) return 2;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 1)) return 3;
    int before = areas(dir);
    pid_t p = vfork();
    if (p == 0) {
        execl("/bin/true", "true", (char *)NULL);
        _exit(127);
    }
    int st = 0;
    if (p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return 4;
    printf("%d %d\n", before, areas(dir));
    return 0;
}
