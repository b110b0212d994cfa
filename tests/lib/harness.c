/* harness.c - see harness.h. */
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon_proc.h"
#include "harness.h"

/* The daemon itself is started and stopped by bench/daemon_proc.c, as epd-bench and epd-demo do;
 * struct h_daemon carries the same fields for the tests. */
static void to_proc(const struct h_daemon *d, struct daemon_proc *p)
{
        memset(p, 0, sizeof(*p));
        p->pid = d->pid;
        snprintf(p->dir, sizeof(p->dir), "%s", d->dir);
        snprintf(p->socket, sizeof(p->socket), "%s", d->socket);
        snprintf(p->log, sizeof(p->log), "%s", d->log);
}

static void from_proc(const struct daemon_proc *p, struct h_daemon *d)
{
        memset(d, 0, sizeof(*d));
        d->pid = p->pid;
        snprintf(d->dir, sizeof(d->dir), "%s", p->dir);
        snprintf(d->socket, sizeof(d->socket), "%s", p->socket);
        snprintf(d->log, sizeof(d->log), "%s", p->log);
}

const char *h_bin_dir(void)
{
        return daemon_proc_bin_dir();
}

void h_daemon_dump_log(const struct h_daemon *d)
{
        struct daemon_proc p;

        to_proc(d, &p);
        daemon_proc_dump_log(&p);
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
        const char *args[64];
        struct daemon_proc p;
        int argc = 0, rc;

        args[argc++] = "--backend";
        /* EPD_TEST_BACKEND=cuda runs the same integration tests against the GPU backend. */
        args[argc++] = getenv("EPD_TEST_BACKEND") ? getenv("EPD_TEST_BACKEND") : "host";
        for (int i = 0; extra_args && extra_args[i] && argc < 63; i++)
                args[argc++] = extra_args[i];
        args[argc] = NULL;
        rc = daemon_proc_start(&p, "epd-test", NULL, args, 5000);
        from_proc(&p, d);
        return rc;
}

int h_daemon_stop(struct h_daemon *d, int timeout_ms)
{
        struct daemon_proc p;
        int rc;

        to_proc(d, &p);
        rc = daemon_proc_stop(&p, timeout_ms);
        d->pid = 0;
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
        return daemon_proc_wait_children(pids, n, timeout_ms);
}

int h_run_tool(const char *tool, const char *const *args, char *out, size_t out_len)
{
        return daemon_proc_run_tool(tool, args, out, out_len);
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

double h_proc_cpu_seconds(pid_t pid)
{
        char path[64], buf[1024], *p;
        unsigned long utime = 0, stime = 0;
        FILE *f;

        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        f = fopen(path, "re");
        if (!f)
                return -1;
        p = fgets(buf, sizeof(buf), f);
        fclose(f);
        /* Fields 14 and 15 (utime, stime) follow the command name's closing parenthesis. */
        if (!p || !(p = strrchr(buf, ')')) ||
            sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &utime,
                   &stime) != 2)
                return -1;
        return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
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

int h_group_enter(struct epd_client *cl, const char *name, uint32_t rank,
                  const struct epd_group_config *cfg, struct epd_group **out)
{
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = name, .secret = secret,
                                     .secret_len = sizeof(secret), .rank = rank,
                                     .config = cfg };
        long long until = h_now_ms() + 10000;
        int rc;

        h_secret(name, secret);
        do {
                rc = rank == 0 ? epd_group_create(cl, &ga, out) : epd_group_join(cl, &ga, out);
                if (rc == EPD_NOT_FOUND)
                        usleep(2000);
        } while (rc == EPD_NOT_FOUND && h_now_ms() < until);
        return rc;
}

int h_fail(char *msg, size_t len, const char *fmt, ...)
{
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(msg, len, fmt, ap);
        va_end(ap);
        return 1;
}
