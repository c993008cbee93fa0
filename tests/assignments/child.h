/* tests/assignments/child.h: a piece of a checker run in a child process
   (check_zero3.c, and the schedule checkers through schedules.h), so
   that a student's code that crashes, loops, or makes the library stop
   the program with its one-line error is a failed test with that line,
   not the checker's end.
   defines: run_in_a_child */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Runs body(arg) in a child process, its standard error read through a
   pipe, and ends it after `seconds` (SIGALRM). The child ends with
   _exit(0) after body returns; body may end it sooner with an exit
   status of its own. Writes into line (room for size bytes) the
   library's error line from what the child wrote to standard error, or
   else that text's first line; returns the child's wait status. */
static int run_in_a_child(void (*body)(void *arg), void *arg, unsigned seconds, char *line, size_t size) {
    int fds[2];
    if (pipe(fds) != 0) { perror("pipe"); exit(2); }
    mgpu_synchronize_all(); /* (the child starts with nothing in flight) */
    fflush(stdout), fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) { perror("fork"); exit(2); }
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        alarm(seconds);
        body(arg);
        fflush(stdout), fflush(stderr);
        _exit(0);
    }
    close(fds[1]);
    char err[2048];
    size_t len = 0;
    ssize_t r;
    while ((r = read(fds[0], err + len, sizeof err - 1 - len)) > 0) len += (size_t)r;
    err[len] = 0;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    char *said = strstr(err, "mgpu: error: ");
    if (!said) said = err;
    if (strchr(said, '\n')) *strchr(said, '\n') = 0;
    snprintf(line, size, "%s", said);
    return status;
}
