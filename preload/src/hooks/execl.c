/* The variadic exec calls, whose bodies stable Rust cannot write. The library's exported
 * execl, execlp and execle (exec.rs) jump here with the caller's registers and stack intact.
 * Each gathers its arguments into an array, as glibc's do, and goes through the library's own
 * execve/execvp hooks: glibc's execl* call its internal __execve and would pass no hook. The
 * calls' results and errno are libc's. */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>

extern char **environ;
int smcr_preload_execve(const char *path, char *const argv[], char *const envp[]);
int smcr_preload_execvp(const char *file, char *const argv[]);
int smcr_execl(const char *path, const char *arg, ...);
int smcr_execlp(const char *file, const char *arg, ...);
int smcr_execle(const char *path, const char *arg, ...);

/* The number of arguments from `arg` up to the NULL that ends them, or -1 (E2BIG). */
#define COUNT(argc, arg)                                                                      \
    do {                                                                                      \
        va_list ap_;                                                                          \
        va_start(ap_, arg);                                                                   \
        for (argc = 1; va_arg(ap_, const char *) != NULL; argc++) {                           \
            if (argc == INT_MAX) {                                                            \
                va_end(ap_);                                                                  \
                errno = E2BIG;                                                                \
                return -1;                                                                    \
            }                                                                                 \
        }                                                                                     \
        va_end(ap_);                                                                          \
    } while (0)

int smcr_execl(const char *path, const char *arg, ...) {
    ptrdiff_t argc;
    COUNT(argc, arg);
    char *argv[argc + 1];
    va_list ap;
    va_start(ap, arg);
    argv[0] = (char *)arg;
    for (ptrdiff_t i = 1; i <= argc; i++) argv[i] = va_arg(ap, char *);
    va_end(ap);
    return smcr_preload_execve(path, argv, environ);
}

int smcr_execlp(const char *file, const char *arg, ...) {
    ptrdiff_t argc;
    COUNT(argc, arg);
    char *argv[argc + 1];
    va_list ap;
    va_start(ap, arg);
    argv[0] = (char *)arg;
    for (ptrdiff_t i = 1; i <= argc; i++) argv[i] = va_arg(ap, char *);
    va_end(ap);
    return smcr_preload_execvp(file, argv);
}

int smcr_execle(const char *path, const char *arg, ...) {
    ptrdiff_t argc;
    COUNT(argc, arg);
    char *argv[argc + 1];
    char *const *envp;
    va_list ap;
    va_start(ap, arg);
    argv[0] = (char *)arg;
    for (ptrdiff_t i = 1; i <= argc; i++) argv[i] = va_arg(ap, char *);
    envp = va_arg(ap, char *const *);
    va_end(ap);
    return smcr_preload_execve(path, argv, envp);
}
