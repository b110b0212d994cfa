/* daemon_proc.c - child processes: the daemon, workers, tools (see daemon_proc.h). Runs on the
 * caller's thread. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon_proc.h"

static uint64_t now_ms(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}

const char *daemon_proc_bin_dir(void)
{
        static char dir[PATH_MAX];

        if (!dir[0]) {
                ssize_t n = readlink("/proc/self/exe", dir, sizeof(dir) - 1);
                char *slash;

                if (n <= 0) {
                        snprintf(dir, sizeof(dir), ".");
                        return dir;
                }
                dir[n] = '\0';
                slash = strrchr(dir, '/');
                if (slash)
                        *slash = '\0';
        }
        return dir;
}

void daemon_proc_dump_log(const struct daemon_proc *d)
{
        char buf[4096];
        FILE *f = fopen(d->log, "re");
        size_t n;

        if (!f)
                return;
        fprintf(stderr, "---- epd log %s ----\n", d->log);
        while ((n = fread(buf, 1, sizeof(buf), f)) > 0)
                fwrite(buf, 1, n, stderr);
        fprintf(stderr, "---- end of log ----\n");
        fclose(f);
}

static void remove_dir(struct daemon_proc *d)
{
        unlink(d->log);
        unlink(d->socket);
        rmdir(d->dir);
}

/* Whether the daemon accepts a connection on its socket (a SOCK_SEQPACKET one, as it listens). */
static int socket_ready(const char *path)
{
        struct sockaddr_un sa;
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0), ok;

        if (fd < 0)
                return 0;
        memset(&sa, 0, sizeof(sa));
        sa.sun_family = AF_UNIX;
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%.107s", path);
        ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        close(fd);
        return ok;
}

int daemon_proc_start(struct daemon_proc *d, const char *prog, const char *epd,
                      const char *const *args, int timeout_ms)
{
        char path[PATH_MAX];
        const char *argv[32];
        int argc = 0;
        uint64_t deadline;

        memset(d, 0, sizeof(*d));
        snprintf(d->dir, sizeof(d->dir), "/tmp/%s-XXXXXX", prog);
        if (!mkdtemp(d->dir)) {
                fprintf(stderr, "%s: mkdtemp: %s\n", prog, strerror(errno));
                return -1;
        }
        snprintf(d->socket, sizeof(d->socket), "%s/epd.sock", d->dir);
        snprintf(d->log, sizeof(d->log), "%s/epd.log", d->dir);
        if (epd)
                snprintf(path, sizeof(path), "%s", epd);
        else
                snprintf(path, sizeof(path), "%s/epd", daemon_proc_bin_dir());
        argv[argc++] = path;
        argv[argc++] = "--socket";
        argv[argc++] = d->socket;
        argv[argc++] = "--config";
        argv[argc++] = "/dev/null";
        for (int i = 0; args && args[i] && argc < 31; i++)
                argv[argc++] = args[i];
        argv[argc] = NULL;
        d->pid = fork();
        if (d->pid < 0) {
                fprintf(stderr, "%s: fork: %s\n", prog, strerror(errno));
                d->pid = 0;
                rmdir(d->dir);
                return -1;
        }
        if (d->pid == 0) {
                int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);

                if (fd >= 0) {
                        dup2(fd, STDERR_FILENO);
                        dup2(fd, STDOUT_FILENO);
                }
                /* Not under systemd: plain log lines, no readiness notification, no sockets. */
                unsetenv("JOURNAL_STREAM");
                unsetenv("NOTIFY_SOCKET");
                unsetenv("LISTEN_FDS");
                execv(path, (char *const *)argv);
                _exit(127);
        }
        deadline = now_ms() + (uint64_t)timeout_ms;
        while (now_ms() < deadline) {
                int status;

                if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
                        fprintf(stderr, "%s: %s exited during start-up (%s %d)\n", prog, path,
                                WIFEXITED(status) ? "exit status" : "signal",
                                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
                        daemon_proc_dump_log(d);
                        d->pid = 0;
                        remove_dir(d);
                        return -1;
                }
                if (socket_ready(d->socket))
                        return 0;
                usleep(10000);
        }
        fprintf(stderr, "%s: %s did not accept connections within %d ms\n", prog, path,
                timeout_ms);
        daemon_proc_dump_log(d);
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
        d->pid = 0;
        remove_dir(d);
        return -1;
}

int daemon_proc_stop(struct daemon_proc *d, int timeout_ms)
{
        uint64_t deadline = now_ms() + (uint64_t)timeout_ms;
        int status, rc = -1;

        if (d->pid <= 0)
                return -1;
        kill(d->pid, SIGTERM);
        while (now_ms() < deadline) {
                if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
                        rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                        break;
                }
                usleep(2000);
        }
        if (rc == -1) {
                kill(d->pid, SIGKILL);
                waitpid(d->pid, NULL, 0);
        }
        if (rc != 0)
                daemon_proc_dump_log(d);
        d->pid = 0;
        remove_dir(d);
        return rc;
}

int daemon_proc_wait_children(const pid_t *pids, int n, int timeout_ms)
{
        uint64_t deadline = now_ms() + (uint64_t)timeout_ms;
        int failures = 0, left = n;
        char *done = calloc((size_t)(n > 0 ? n : 1), 1);

        if (!done)
                return n;
        while (left > 0 && now_ms() < deadline) {
                for (int i = 0; i < n; i++) {
                        int status;

                        if (done[i] || waitpid(pids[i], &status, WNOHANG) != pids[i])
                                continue;
                        done[i] = 1;
                        left--;
                        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                                fprintf(stderr, "process %d (index %d) failed: status %d\n",
                                        (int)pids[i], i, status);
                                failures++;
                        }
                }
                if (left)
                        usleep(2000);
        }
        for (int i = 0; i < n; i++) {
                if (done[i])
                        continue;
                fprintf(stderr, "process %d (index %d) timed out; killing it\n", (int)pids[i], i);
                kill(pids[i], SIGKILL);
                waitpid(pids[i], NULL, 0);
                failures++;
        }
        free(done);
        return failures;
}

int daemon_proc_run_tool(const char *tool, const char *const *args, char *out, size_t out_len)
{
        char path[PATH_MAX];
        const char *argv[32];
        int pipefd[2], argc = 0, status;
        size_t used = 0;
        pid_t pid;

        snprintf(path, sizeof(path), "%s/%s", daemon_proc_bin_dir(), tool);
        argv[argc++] = path;
        for (int i = 0; args && args[i] && argc < 31; i++)
                argv[argc++] = args[i];
        argv[argc] = NULL;
        if (out_len == 0 || pipe2(pipefd, O_CLOEXEC) < 0)
                return -1;
        pid = fork();
        if (pid < 0) {
                close(pipefd[0]);
                close(pipefd[1]);
                return -1;
        }
        if (pid == 0) {
                dup2(pipefd[1], STDOUT_FILENO);
                execv(path, (char *const *)argv);
                _exit(127);
        }
        close(pipefd[1]);
        for (;;) {
                char sink[256];
                ssize_t n;

                /* Past out_len the rest is read and dropped, so the tool never blocks. */
                if (used + 1 >= out_len)
                        n = read(pipefd[0], sink, sizeof(sink));
                else if ((n = read(pipefd[0], out + used, out_len - used - 1)) > 0)
                        used += (size_t)n;
                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0)
                        break;
        }
        out[used] = '\0';
        close(pipefd[0]);
        if (waitpid(pid, &status, 0) < 0)
                return -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
