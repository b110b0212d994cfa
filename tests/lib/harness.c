/* harness.c - see harness.h. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

static long long ms_now(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

const char *h_bin_dir(void)
{
        static char dir[PATH_MAX];

        if (!dir[0]) {
                ssize_t n = readlink("/proc/self/exe", dir, sizeof(dir) - 1);
                if (n <= 0) {
                        snprintf(dir, sizeof(dir), ".");
                } else {
                        dir[n] = '\0';
                        char *slash = strrchr(dir, '/');
                        if (slash)
                                *slash = '\0';
                }
        }
        return dir;
}

static int socket_ready(const char *path)
{
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0), rc;

        if (fd < 0 || strlen(path) >= sizeof(sa.sun_path)) {
                if (fd >= 0)
                        close(fd);
                return 0;
        }
        memcpy(sa.sun_path, path, strlen(path) + 1);
        rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
        close(fd);
        return rc == 0;
}

void h_daemon_dump_log(const struct h_daemon *d)
{
        char buf[4096];
        FILE *f = fopen(d->log, "r");
        size_t n;

        if (!f)
                return;
        fprintf(stderr, "---- epd log %s ----\n", d->log);
        while ((n = fread(buf, 1, sizeof(buf), f)) > 0)
                fwrite(buf, 1, n, stderr);
        fprintf(stderr, "---- end of log ----\n");
        fclose(f);
}

int h_daemon_log_contains(const struct h_daemon *d, const char *text)
{
        char line[1024];
        FILE *f = fopen(d->log, "re");
        int found = 0;

        if (!f)
                return 0;
        while (!found && fgets(line, sizeof(line), f))
                found = strstr(line, text) != NULL;
        fclose(f);
        return found;
}

int h_daemon_start(struct h_daemon *d, const char *const *extra_args)
{
        char epd[PATH_MAX];
        const char *argv[64];
        int argc = 0;
        long long deadline;

        memset(d, 0, sizeof(*d));
        snprintf(d->dir, sizeof(d->dir), "/tmp/epd-test-XXXXXX");
        if (!mkdtemp(d->dir))
                return -1;
        snprintf(d->socket, sizeof(d->socket), "%s/epd.sock", d->dir);
        snprintf(d->log, sizeof(d->log), "%s/epd.log", d->dir);
        snprintf(epd, sizeof(epd), "%s/epd", h_bin_dir());
        argv[argc++] = epd;
        argv[argc++] = "--backend";
        /* EPD_TEST_BACKEND=cuda runs the same integration tests against the GPU backend. */
        argv[argc++] = getenv("EPD_TEST_BACKEND") ? getenv("EPD_TEST_BACKEND") : "host";
        argv[argc++] = "--socket";
        argv[argc++] = d->socket;
        argv[argc++] = "--config";
        argv[argc++] = "/dev/null";
        for (int i = 0; extra_args && extra_args[i] && argc < 62; i++)
                argv[argc++] = extra_args[i];
        argv[argc] = NULL;
        d->pid = fork();
        if (d->pid < 0)
                return -1;
        if (d->pid == 0) {
                int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
                if (fd >= 0) {
                        dup2(fd, STDERR_FILENO);
                        dup2(fd, STDOUT_FILENO);
                }
                /* Not in the journal: plain timestamps. */
                unsetenv("JOURNAL_STREAM");
                unsetenv("NOTIFY_SOCKET");
                unsetenv("LISTEN_FDS");
                execv(epd, (char *const *)argv);
                _exit(127);
        }
        deadline = ms_now() + 5000;
        while (ms_now() < deadline) {
                int status;
                if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
                        fprintf(stderr, "epd exited during start-up (status %d)\n", status);
                        h_daemon_dump_log(d);
                        d->pid = 0;
                        return -1;
                }
                if (socket_ready(d->socket))
                        return 0;
                usleep(5000);
        }
        fprintf(stderr, "epd did not become ready within 5 s\n");
        h_daemon_dump_log(d);
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
        d->pid = 0;
        return -1;
}

static void remove_dir(const char *dir)
{
        char path[PATH_MAX];
        const char *names[] = { "epd.sock", "epd.log", NULL };

        for (int i = 0; names[i]; i++) {
                snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
                unlink(path);
        }
        rmdir(dir);
}

int h_daemon_stop(struct h_daemon *d, int timeout_ms)
{
        long long deadline = ms_now() + timeout_ms;
        int status, rc = -1;

        if (d->pid <= 0)
                return -1;
        kill(d->pid, SIGTERM);
        while (ms_now() < deadline) {
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
                h_daemon_dump_log(d);
        d->pid = 0;
        remove_dir(d->dir);
        return rc;
}

struct epd_client *h_connect(const struct h_daemon *d, const char *name)
{
        struct epd_connect_args args = {
                .size = sizeof(args), .socket_path = d->socket, .client_name = name,
                .timeout_ms = 20000,
        };
        struct epd_client *c = NULL;
        char err[512];
        int rc = epd_client_connect(&args, &c, err, sizeof(err));

        if (rc < 0) {
                fprintf(stderr, "connect %s: %s: %s\n", name, epd_status_name(rc), err);
                return NULL;
        }
        return c;
}

pid_t h_spawn(int (*fn)(void *arg, int index), void *arg, int index)
{
        pid_t pid = fork();

        if (pid == 0) {
                int rc = fn(arg, index);
                fflush(stdout);
                fflush(stderr);
                _exit(rc & 0xff);
        }
        return pid;
}

int h_wait_all(const pid_t *pids, int n, int timeout_ms)
{
        long long deadline = ms_now() + timeout_ms;
        int failures = 0, left = n;
        int *done = calloc((size_t)n, sizeof(int));

        while (left > 0 && ms_now() < deadline) {
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

int h_run_tool(const char *tool, const char *const *args, char *out, size_t out_len)
{
        char path[PATH_MAX];
        const char *argv[32];
        int pipefd[2], argc = 0, status;
        size_t used = 0;
        pid_t pid;

        snprintf(path, sizeof(path), "%s/%s", h_bin_dir(), tool);
        argv[argc++] = path;
        for (int i = 0; args && args[i] && argc < 31; i++)
                argv[argc++] = args[i];
        argv[argc] = NULL;
        if (pipe2(pipefd, O_CLOEXEC) < 0)
                return -1;
        pid = fork();
        if (pid == 0) {
                dup2(pipefd[1], STDOUT_FILENO);
                execv(path, (char *const *)argv);
                _exit(127);
        }
        close(pipefd[1]);
        for (;;) {
                ssize_t n;
                if (used + 1 >= out_len) {
                        char sink[256];
                        n = read(pipefd[0], sink, sizeof(sink));
                } else {
                        n = read(pipefd[0], out + used, out_len - used - 1);
                        if (n > 0)
                                used += (size_t)n;
                }
                if (n <= 0)
                        break;
        }
        out[used] = '\0';
        close(pipefd[0]);
        if (waitpid(pid, &status, 0) < 0)
                return -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void h_secret(const char *label, unsigned char secret[16])
{
        uint64_t h = 1469598103934665603ull;

        for (const char *p = label; *p; p++)
                h = (h ^ (unsigned char)*p) * 1099511628211ull;
        for (int i = 0; i < 16; i++) {
                h = (h ^ (uint64_t)i) * 1099511628211ull;
                secret[i] = (unsigned char)(h >> 56);
        }
}

long long h_now_ms(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

int h_flag_wait(atomic_int *flag, int value, int timeout_ms)
{
        long long deadline = h_now_ms() + timeout_ms;

        while (atomic_load(flag) < value) {
                if (h_now_ms() > deadline)
                        return -1;
                usleep(1000);
        }
        return 0;
}

int h_proc_fd_count(pid_t pid)
{
        char path[64];
        DIR *dir;
        struct dirent *e;
        int n = 0;

        snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
        dir = opendir(path);
        if (!dir)
                return -1;
        while ((e = readdir(dir)))
                n += e->d_name[0] != '.';
        closedir(dir);
        return n;
}

int h_proc_region_mappings(pid_t pid)
{
        char path[64], line[512];
        FILE *f;
        int n = 0;

        snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
        f = fopen(path, "re");
        if (!f)
                return -1;
        while (fgets(line, sizeof(line), f))
                n += strstr(line, "/memfd:epd-region") != NULL;
        fclose(f);
        return n;
}
