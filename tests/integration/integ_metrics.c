/* integ_metrics.c - the Prometheus endpoint and `epctl top` while a load runs, against the real
 * epd binary (docs/architecture.md, "Seeing where time goes"). One mode per CTest test:
 *
 *   integ_metrics exposition  GET /metrics twice while a worker loops dispatch and combine: the
 *                             page is well-formed text exposition 0.0.4 (HELP and TYPE for every
 *                             family, families contiguous, histograms cumulative with +Inf equal
 *                             to _count, label values escaped) and every op counter grew.
 *   integ_metrics promtool    `promtool check metrics` accepts the page. promtool comes with
 *                             Debian's prometheus package: as root the test installs it when it
 *                             is missing; where it cannot, it skips (exit 77).
 *   integ_metrics top         `epctl top` runs in a tmux pane; two captures of the pane about
 *                             2 s apart show the DISPATCH counter of the loaded group growing.
 *                             Skips (77) without tmux.
 *
 * The daemon listens for metrics on 127.0.0.1:0 and logs the port it got; the test reads it from
 * the daemon's log. Exit status: 0 passed, 1 failed, 77 skipped.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "workload.h"

#define SKIP 77
/* A group name that needs every escape of the text format but a line feed. */
#define LOAD_GROUP "load \"q\" \\ \xc3\xbc"
#define LOAD_GROUP_LABEL "group=\"load \\\"q\\\" \\\\ \xc3\xbc\""
#define TOP_GROUP "topload"

static struct h_daemon daemon_proc;
static pid_t loader_pid;
static char tmux_server[64];

static void cleanup(void)
{
        if (tmux_server[0]) {
                pid_t pid = fork();
                if (pid == 0) {
                        int null = open("/dev/null", O_WRONLY);
                        dup2(null, STDOUT_FILENO);
                        dup2(null, STDERR_FILENO);
                        execlp("tmux", "tmux", "-L", tmux_server, "kill-server", (char *)NULL);
                        _exit(127);
                }
                if (pid > 0)
                        waitpid(pid, NULL, 0);
                tmux_server[0] = '\0';
        }
        if (loader_pid > 0) {
                kill(loader_pid, SIGKILL);
                waitpid(loader_pid, NULL, 0);
                loader_pid = 0;
        }
        if (daemon_proc.pid > 0)
                h_daemon_stop(&daemon_proc, 5000);
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int fail(const char *fmt, ...)
{
        va_list ap;

        fprintf(stderr, "FAIL: ");
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fprintf(stderr, "\n");
        if (daemon_proc.pid > 0)
                h_daemon_dump_log(&daemon_proc);
        cleanup();
        return 1;
}

/* ---- the load: one rank looping dispatch and combine, checked against the reference ---- */

static const struct wl_case load_case = {
        .name = "metrics-load",
        .seed = 601,
        .world_size = 1,
        .num_experts = 8,
        .hidden = 64,
        .max_tokens = 16,
        .num_topk = 2,
        .dtype = EPD_DTYPE_BF16,
        .topk_dtype = EPD_DTYPE_INT64,
        .layout = EPD_LAYOUT_NON_EXPAND,
        .expert_alignment = 1,
        .has_weights = 1,
        .routing = TD_ROUTING_UNIFORM,
        .tokens = WL_TOKENS_FULL,
        .use_arena = 1,
        .steps = 1000000, /* until killed */
};

static int loader_main(void *arg, int index)
{
        (void)index;
        return wl_worker(&load_case, daemon_proc.socket, arg, 0, NULL);
}

static void start_loader(const char *group)
{
        loader_pid = h_spawn(loader_main, (void *)group, 0);
}

/* ---- HTTP ---- */

struct http_reply {
        int status;
        char content_type[128];
        char *body;                   /* malloc'ed, NUL-terminated */
};

/* GET path from 127.0.0.1:port with HTTP/1.0 (the server closes after the reply). */
static int http_get(unsigned port, const char *path, struct http_reply *r)
{
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
        char req[256];
        size_t used = 0, cap = 1 << 16;
        char *buf = malloc(cap);
        int fd;

        memset(r, 0, sizeof(*r));
        if (!buf)
                return -1;
        inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                fprintf(stderr, "connect 127.0.0.1:%u: %s\n", port, strerror(errno));
                if (fd >= 0)
                        close(fd);
                free(buf);
                return -1;
        }
        snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
        if (write(fd, req, strlen(req)) != (ssize_t)strlen(req)) {
                close(fd);
                free(buf);
                return -1;
        }
        for (;;) {
                if (used + 1 == cap) {
                        char *n = realloc(buf, cap * 2);
                        if (!n)
                                break;
                        buf = n;
                        cap *= 2;
                }
                ssize_t n = read(fd, buf + used, cap - used - 1);
                if (n <= 0)
                        break;
                used += (size_t)n;
        }
        close(fd);
        buf[used] = '\0';
        char *body = strstr(buf, "\r\n\r\n");
        if (sscanf(buf, "HTTP/1.%*d %d", &r->status) != 1 || !body) {
                fprintf(stderr, "not an HTTP reply: %.200s\n", buf);
                free(buf);
                return -1;
        }
        *body = '\0';
        for (char *h = strstr(buf, "\r\n"); h; h = strstr(h + 2, "\r\n"))
                if (strncasecmp(h + 2, "Content-Type:", 13) == 0)
                        sscanf(h + 2 + 13, " %127[^\r\n]", r->content_type);
        r->body = strdup(body + 4);
        free(buf);
        return r->body ? 0 : -1;
}

/* The metrics port the daemon logged ("metrics listening address=127.0.0.1:PORT"). */
static unsigned metrics_port(void)
{
        long long deadline = h_now_ms() + 5000;

        while (h_now_ms() < deadline) {
                char line[1024];
                FILE *f = fopen(daemon_proc.log, "re");
                unsigned port = 0;
                while (f && !port && fgets(line, sizeof(line), f)) {
                        const char *p = strstr(line, "metrics listening address=127.0.0.1:");
                        if (p)
                                port = (unsigned)strtoul(p + strlen("metrics listening address=127.0.0.1:"),
                                                         NULL, 10);
                }
                if (f)
                        fclose(f);
                if (port)
                        return port;
                usleep(20000);
        }
        return 0;
}

static int scrape(unsigned port, char **body)
{
        struct http_reply r;

        if (http_get(port, "/metrics", &r) < 0)
                return fail("GET /metrics failed");
        if (r.status != 200) {
                free(r.body);
                return fail("GET /metrics: HTTP %d", r.status);
        }
        if (strncmp(r.content_type, "text/plain; version=0.0.4", 25) != 0) {
                free(r.body);
                return fail("GET /metrics: Content-Type '%s'", r.content_type);
        }
        *body = r.body;
        return 0;
}

/* ---- reading the exposition ---- */

/* Sum of the samples of `name` whose label set contains every one of the `labels` (each
 * 'key="value"'); -1 when there is none. */
static double metric_sum(const char *page, const char *name, const char *const *labels)
{
        size_t name_len = strlen(name);
        double sum = -1;

        for (const char *line = page; *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : "") {
                const char *end = strchr(line, '\n');
                size_t len = end ? (size_t)(end - line) : strlen(line);
                char copy[2048];
                int match = 1;

                if (line[0] == '#' || len >= sizeof(copy) || strncmp(line, name, name_len) != 0 ||
                    (line[name_len] != '{' && line[name_len] != ' '))
                        continue;
                memcpy(copy, line, len);
                copy[len] = '\0';
                for (int i = 0; labels && labels[i]; i++)
                        match &= strstr(copy, labels[i]) != NULL;
                if (!match)
                        continue;
                sum = (sum < 0 ? 0 : sum) + strtod(strrchr(copy, ' ') + 1, NULL);
        }
        return sum;
}

/* Checks the text format rules Prometheus relies on. Returns 0 or fails with a message. */
static int check_exposition(const char *page)
{
        char families[256][96], types[256][16], helped[256];
        int num_families = 0, current = -1;
        char hist_series[1024] = "";
        double hist_prev = -1;
        int line_no = 0;

        memset(helped, 0, sizeof(helped));
        for (const char *line = page; *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : "") {
                const char *end = strchr(line, '\n');
                size_t len = end ? (size_t)(end - line) : strlen(line);
                char l[2048], name[128], fam[96];

                line_no++;
                if (!end)
                        return fail("line %d does not end in a line feed", line_no);
                if (len >= sizeof(l))
                        return fail("line %d is too long", line_no);
                memcpy(l, line, len);
                l[len] = '\0';
                if (strncmp(l, "# HELP ", 7) == 0 || strncmp(l, "# TYPE ", 7) == 0) {
                        char kind[16] = "";
                        if (sscanf(l + 7, "%95s %15s", fam, kind) < 1)
                                return fail("line %d: bad comment: %s", line_no, l);
                        int f;
                        for (f = 0; f < num_families; f++)
                                if (strcmp(families[f], fam) == 0)
                                        break;
                        if (f == num_families) {
                                if (num_families == 256)
                                        return fail("too many families");
                                snprintf(families[f], sizeof(families[f]), "%s", fam);
                                types[f][0] = '\0';
                                num_families++;
                        } else if (f != current) {
                                return fail("line %d: family %s declared twice", line_no, fam);
                        }
                        current = f;
                        if (l[2] == 'H')
                                helped[f] = 1;
                        else
                                snprintf(types[f], sizeof(types[f]), "%s", kind);
                        continue;
                }
                if (l[0] == '#')
                        continue;
                if (sscanf(l, "%127[a-zA-Z0-9_:]", name) != 1)
                        return fail("line %d: no metric name: %s", line_no, l);
                if (current < 0)
                        return fail("line %d: sample before any TYPE: %s", line_no, l);
                const char *fname = families[current];
                size_t flen = strlen(fname);
                int is_hist = strcmp(types[current], "histogram") == 0;
                if (strcmp(name, fname) != 0 &&
                    !(is_hist && strncmp(name, fname, flen) == 0 &&
                      (!strcmp(name + flen, "_bucket") || !strcmp(name + flen, "_sum") ||
                       !strcmp(name + flen, "_count"))))
                        return fail("line %d: sample %s outside its family (%s)", line_no, name,
                                    fname);
                if (!helped[current] || !types[current][0])
                        return fail("family %s lacks HELP or TYPE", fname);
                /* Label values: no raw quote or line feed inside; escapes are valid. */
                const char *brace = strchr(l, '{');
                if (brace && brace - l == (long)strlen(name)) {
                        const char *p = brace + 1;
                        while (*p && *p != '}') {
                                const char *eq = strchr(p, '=');
                                if (!eq || eq[1] != '"')
                                        return fail("line %d: bad label: %s", line_no, l);
                                p = eq + 2;
                                while (*p && *p != '"') {
                                        if (*p == '\\') {
                                                if (p[1] != '\\' && p[1] != '"' && p[1] != 'n')
                                                        return fail("line %d: bad escape: %s", line_no, l);
                                                p++;
                                        }
                                        p++;
                                }
                                if (*p != '"')
                                        return fail("line %d: unterminated label: %s", line_no, l);
                                p++;
                                if (*p == ',')
                                        p++;
                        }
                        if (*p != '}')
                                return fail("line %d: unterminated labels: %s", line_no, l);
                }
                double v = strtod(strrchr(l, ' ') + 1, NULL);
                if (v < 0)
                        return fail("line %d: negative value: %s", line_no, l);
                /* Histogram series: buckets cumulative, +Inf equal to _count. */
                if (is_hist) {
                        char series[1024];
                        const char *le = strstr(l, ",le=\"");
                        if (strcmp(name + flen, "_bucket") == 0) {
                                if (!le)
                                        return fail("line %d: bucket without le: %s", line_no, l);
                                snprintf(series, sizeof(series), "%.*s", (int)(le - l), l);
                                if (strcmp(series, hist_series) != 0) {
                                        snprintf(hist_series, sizeof(hist_series), "%s", series);
                                        hist_prev = -1;
                                }
                                if (v < hist_prev)
                                        return fail("line %d: buckets not cumulative: %s", line_no, l);
                                hist_prev = v;
                        } else if (strcmp(name + flen, "_count") == 0) {
                                if (hist_prev < 0)
                                        return fail("line %d: _count without buckets", line_no);
                                if (v != hist_prev)
                                        return fail("line %d: _count %g differs from the +Inf bucket %g",
                                                    line_no, v, hist_prev);
                        }
                }
        }
        for (int f = 0; f < num_families; f++)
                if (!helped[f] || !types[f][0])
                        return fail("family %s lacks HELP or TYPE", families[f]);
        if (num_families < 20)
                return fail("only %d metric families", num_families);
        return 0;
}

static int start_daemon_with_metrics(unsigned *port)
{
        const char *args[] = { "--metrics-listen", "127.0.0.1:0", NULL };

        if (h_daemon_start(&daemon_proc, args) < 0)
                return fail("the daemon did not start");
        *port = metrics_port();
        if (!*port)
                return fail("the daemon did not log its metrics port");
        return 0;
}

/* Waits until the load has completed a dispatch and a combine; returns the page then. */
static int wait_for_load(unsigned port, char **page)
{
        const char *ok[] = { LOAD_GROUP_LABEL, "kind=\"combine\"", "status=\"OK\"", NULL };
        long long deadline = h_now_ms() + 20000;

        while (h_now_ms() < deadline) {
                if (scrape(port, page))
                        return 1;
                if (metric_sum(*page, "epd_ops_total", ok) > 0)
                        return 0;
                free(*page);
                usleep(50000);
        }
        return fail("the load's ops never showed in /metrics");
}

/* ---- modes ---- */

static int mode_exposition(void)
{
        struct http_reply r;
        unsigned port;
        char *before, *a, *b;

        if (start_daemon_with_metrics(&port))
                return 1;
        if (scrape(port, &before) || check_exposition(before))
                return 1;
        if (metric_sum(before, "epd_up", NULL) != 1)
                return fail("epd_up is not 1");
        static const char *const completed[] = { "result=\"completed\"", NULL };
        if (metric_sum(before, "epd_collective_ops_total", completed) != 0)
                return fail("ops completed before any load");
        if (http_get(port, "/nope", &r) < 0 || r.status != 404)
                return fail("GET /nope: HTTP %d, expected 404", r.status);
        free(r.body);

        start_loader(LOAD_GROUP);
        if (wait_for_load(port, &a))
                return 1;
        usleep(500000);
        if (scrape(port, &b))
                return 1;
        if (check_exposition(a) || check_exposition(b))
                return 1;
        if (!strstr(a, LOAD_GROUP_LABEL))
                return fail("the group label is not escaped as %s", LOAD_GROUP_LABEL);

        /* Every counter the load drives grew between the two scrapes. */
        static const char *const dispatch_ok[] = { LOAD_GROUP_LABEL, "rank=\"0\"", "kind=\"dispatch\"", "status=\"OK\"", NULL };
        static const char *const combine_ok[] = { LOAD_GROUP_LABEL, "kind=\"combine\"", "status=\"OK\"", NULL };
        static const char *const dispatch[] = { LOAD_GROUP_LABEL, "kind=\"dispatch\"", NULL };
        static const char *const device[] = { "gpu=\"0\"", "UUID=\"", NULL };
        static const char *const ready[] = { LOAD_GROUP_LABEL, "state=\"READY\"", NULL };
        static const char *const stage_daemon[] = { LOAD_GROUP_LABEL, "kind=\"dispatch\"",
                                                    "stage=\"daemon\"", NULL };
        static const char *const stage_peers[] = { LOAD_GROUP_LABEL, "kind=\"combine\"",
                                                   "stage=\"peers\"", NULL };
        static const char *const stage_gpu[] = { LOAD_GROUP_LABEL, "stage=\"gpu\"", NULL };
        static const struct {
                const char *name;
                const char *const *labels;
        } grows[] = {
                { "epd_ops_total", dispatch_ok },
                { "epd_ops_total", combine_ok },
                { "epd_op_bytes_total", dispatch },
                { "epd_op_latency_seconds_count", dispatch },
                { "epd_op_latency_seconds_sum", dispatch },
                { "epd_device_ops_total", device },
                { "epd_device_bytes_total", device },
                { "epd_collective_ops_total", completed },
                { "epd_frames_received_total", NULL },
                { "epd_client_ops_total", NULL },
                { "epd_op_stage_seconds_count", stage_daemon },
                { "epd_op_stage_seconds_sum", stage_daemon },
                { "epd_op_stage_seconds_count", stage_peers },
        };
        for (size_t i = 0; i < sizeof(grows) / sizeof(grows[0]); i++) {
                double va = metric_sum(a, grows[i].name, grows[i].labels);
                double vb = metric_sum(b, grows[i].name, grows[i].labels);
                printf("%-32s %s: %.9g -> %.9g\n", grows[i].name,
                       grows[i].labels ? grows[i].labels[grows[i].labels[1] ? 1 : 0] : "",
                       va, vb);
                if (!(va > 0 && vb > va))
                        return fail("%s did not grow: %g then %g", grows[i].name, va, vb);
        }
        /* Within one page a rank's successful ops and its histogram count agree. */
        if (metric_sum(b, "epd_ops_total", dispatch_ok) !=
            metric_sum(b, "epd_op_latency_seconds_count", dispatch))
                return fail("epd_ops_total (OK) and the histogram's _count differ");
        /* The group's stages count each successful op once, as each rank's counters do; the
         * host backend has no GPU stage. */
        if (metric_sum(b, "epd_ops_total", dispatch_ok) !=
            metric_sum(b, "epd_op_stage_seconds_count", stage_daemon))
                return fail("rank 0's successful dispatches and the daemon stage's count differ");
        if (metric_sum(b, "epd_op_stage_seconds_count", stage_gpu) >= 0) /* -1: no line */
                return fail("a gpu stage on the host backend");
        if (metric_sum(b, "epd_group_state", ready) != 1)
                return fail("the loaded group is not READY in epd_group_state");
        /* Its memory, charged to the uid that created it (this one): at least its ranks'
         * arenas, and nothing else, as it has no client-executed buffers. */
        {
                char owner[48];
                const char *const mine[] = { LOAD_GROUP_LABEL, owner, NULL };
                const char *const group[] = { LOAD_GROUP_LABEL, NULL };
                double mem, arenas = metric_sum(b, "epd_arena_bytes", group);

                snprintf(owner, sizeof(owner), "owner_uid=\"%u\"", (unsigned)geteuid());
                mem = metric_sum(b, "epd_group_memory_bytes", mine);
                if (!(arenas > 0 && mem >= arenas && mem < arenas + 2 * 4096 * 64))
                        return fail("epd_group_memory_bytes %g for arenas of %g bytes", mem,
                                    arenas);
        }
        if (metric_sum(b, "epd_clients", NULL) < 1 || metric_sum(b, "epd_groups", NULL) != 1)
                return fail("epd_clients or epd_groups wrong");
        free(before);
        free(a);
        free(b);
        kill(loader_pid, SIGKILL);
        waitpid(loader_pid, NULL, 0);
        loader_pid = 0;
        if (h_daemon_stop(&daemon_proc, 5000) != 0)
                return fail("the daemon did not stop cleanly");
        printf("exposition: passed\n");
        return 0;
}

/* Runs argv (no shell), stdin from in_path (or /dev/null), stdout and stderr into out.
 * Returns the exit status, 127 when it cannot run. */
static int run(char *const argv[], const char *in_path, char *out, size_t out_len)
{
        int pipefd[2], status;
        size_t used = 0;
        pid_t pid;

        if (pipe2(pipefd, O_CLOEXEC) < 0)
                return 127;
        pid = fork();
        if (pid == 0) {
                int in = open(in_path ? in_path : "/dev/null", O_RDONLY);
                dup2(in, STDIN_FILENO);
                dup2(pipefd[1], STDOUT_FILENO);
                dup2(pipefd[1], STDERR_FILENO);
                setenv("DEBIAN_FRONTEND", "noninteractive", 1);
                execvp(argv[0], argv);
                _exit(127);
        }
        close(pipefd[1]);
        for (;;) {
                char sink[4096];
                ssize_t n = read(pipefd[0], used + 1 < out_len ? out + used : sink,
                                 used + 1 < out_len ? out_len - used - 1 : sizeof(sink));
                if (n <= 0)
                        break;
                if (used + 1 < out_len)
                        used += (size_t)n;
        }
        out[used] = '\0';
        close(pipefd[0]);
        if (waitpid(pid, &status, 0) < 0)
                return 127;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 127;
}

static int have_tool(const char *name)
{
        char out[256];
        char *argv[] = { (char *)"sh", (char *)"-c", NULL, NULL };
        char cmd[128];

        snprintf(cmd, sizeof(cmd), "command -v %s", name);
        argv[2] = cmd;
        return run(argv, NULL, out, sizeof(out)) == 0;
}

/* promtool, installed from Debian's prometheus package when missing and we are root. */
static int ensure_promtool(void)
{
        static char out[64 * 1024];
        char *install[] = { "apt-get", "install", "-y", "-qq", "--no-install-recommends",
                            "prometheus", NULL };
        char *update[] = { "apt-get", "update", "-qq", NULL };

        if (have_tool("promtool"))
                return 0;
        if (geteuid() != 0 || !have_tool("apt-get")) {
                fprintf(stderr, "SKIP: promtool is not installed (Debian package prometheus)\n");
                return SKIP;
        }
        printf("promtool missing: installing Debian's prometheus package\n");
        fflush(stdout);
        if (run(install, NULL, out, sizeof(out)) != 0 &&
            (run(update, NULL, out, sizeof(out)) != 0 || run(install, NULL, out, sizeof(out)) != 0)) {
                fprintf(stderr, "%s\nSKIP: cannot install prometheus (promtool)\n", out);
                return SKIP;
        }
        if (!have_tool("promtool")) {
                fprintf(stderr, "SKIP: prometheus installed without promtool\n");
                return SKIP;
        }
        return 0;
}

static int mode_promtool(void)
{
        static char out[64 * 1024];
        char path[PATH_MAX];
        char *check[] = { "promtool", "check", "metrics", NULL };
        unsigned port;
        char *page;
        FILE *f;
        int rc = ensure_promtool();

        if (rc)
                return rc;
        if (start_daemon_with_metrics(&port))
                return 1;
        /* With a load running, so that every family (histograms included) has samples. */
        start_loader(LOAD_GROUP);
        if (wait_for_load(port, &page))
                return 1;
        snprintf(path, sizeof(path), "%s/metrics.txt", daemon_proc.dir);
        f = fopen(path, "we");
        if (!f || fputs(page, f) < 0 || fclose(f) != 0)
                return fail("cannot write %s", path);
        rc = run(check, path, out, sizeof(out));
        unlink(path);
        printf("promtool check metrics: exit %d\n%s", rc, out);
        if (rc != 0 || out[0]) {
                fprintf(stderr, "---- page ----\n%s---- end ----\n", page);
                free(page);
                return fail("promtool check metrics rejected the page (exit %d)", rc);
        }
        free(page);
        cleanup();
        printf("promtool: passed\n");
        return 0;
}

/* The DISPATCH column of group `group`'s rank-0 row in a capture of `epctl top`; -1 if absent.
 * *rate: the /s column next to it. */
static long long top_dispatch(const char *pane, const char *group, double *rate)
{
        for (const char *line = pane; *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : "") {
                char name[64];
                unsigned rank, dev;
                long long dispatch;
                double r;
                if (sscanf(line, "%63s %u %u %lld %lf", name, &rank, &dev, &dispatch, &r) == 5 &&
                    strcmp(name, group) == 0 && rank == 0) {
                        *rate = r;
                        return dispatch;
                }
        }
        return -1;
}

static int tmux(char *const *args, char *out, size_t out_len)
{
        char *argv[16];
        int n = 0;

        argv[n++] = "tmux";
        argv[n++] = "-L";
        argv[n++] = tmux_server;
        argv[n++] = "-f";
        argv[n++] = "/dev/null";
        for (int i = 0; args[i] && n < 15; i++)
                argv[n++] = args[i];
        argv[n] = NULL;
        return run(argv, NULL, out, out_len);
}

static int mode_top(void)
{
        static char pane[64 * 1024], first[64 * 1024];
        char command[PATH_MAX + 512];
        long long d1 = -1, d2 = -1;
        double rate1 = 0, rate2 = 0;

        if (!have_tool("tmux")) {
                fprintf(stderr, "SKIP: tmux is not installed (Debian package tmux)\n");
                return SKIP;
        }
        unsetenv("TMUX");
        if (!getenv("TERM"))
                setenv("TERM", "xterm", 1);
        if (h_daemon_start(&daemon_proc, NULL) < 0)
                return fail("the daemon did not start");
        start_loader(TOP_GROUP);
        snprintf(tmux_server, sizeof(tmux_server), "epd-test-top-%d", (int)getpid());
        snprintf(command, sizeof(command), "'%s/epctl' --socket '%s' top", h_bin_dir(),
                 daemon_proc.socket);
        char *new_session[] = { "new-session", "-d", "-x", "200", "-y", "50", "-s", "top",
                                command, NULL };
        if (tmux(new_session, pane, sizeof(pane)) != 0)
                return fail("tmux new-session failed: %s", pane);
        char *capture[] = { "capture-pane", "-p", "-t", "top", NULL };
        long long deadline = h_now_ms() + 20000;
        while (h_now_ms() < deadline) {
                if (tmux(capture, pane, sizeof(pane)) != 0)
                        return fail("tmux capture-pane failed: %s", pane);
                d1 = top_dispatch(pane, TOP_GROUP, &rate1);
                if (d1 > 0)
                        break;
                usleep(100000);
        }
        if (d1 <= 0)
                return fail("epctl top never showed ops of group %s; pane:\n%s", TOP_GROUP, pane);
        snprintf(first, sizeof(first), "%s", pane);
        usleep(2200000);
        if (tmux(capture, pane, sizeof(pane)) != 0)
                return fail("tmux capture-pane failed: %s", pane);
        d2 = top_dispatch(pane, TOP_GROUP, &rate2);
        printf("first capture:\n%s\nsecond capture:\n%s\n", first, pane);
        printf("DISPATCH %lld -> %lld, rate %.0f/s\n", d1, d2, rate2);
        if (d2 <= d1)
                return fail("the DISPATCH counter did not grow between captures (%lld, %lld)", d1,
                            d2);
        if (rate2 <= 0)
                return fail("epctl top shows no dispatch rate under load");
        /* The group's stage line: where its dispatches and combines spent their time. */
        if (!strstr(pane, "stages p50/p99[us]: dispatch peers ") ||
            !strstr(pane, " dispatch daemon ") || !strstr(pane, " combine daemon "))
                return fail("epctl top shows no stage line for the loaded group");
        cleanup();
        printf("top: passed\n");
        return 0;
}

int main(int argc, char **argv)
{
        int rc;

        setvbuf(stdout, NULL, _IOLBF, 0);
        signal(SIGPIPE, SIG_IGN);
        if (argc != 2) {
                fprintf(stderr, "usage: integ_metrics exposition|promtool|top\n");
                return 2;
        }
        if (strcmp(argv[1], "exposition") == 0)
                rc = mode_exposition();
        else if (strcmp(argv[1], "promtool") == 0)
                rc = mode_promtool();
        else if (strcmp(argv[1], "top") == 0)
                rc = mode_top();
        else
                return 2;
        cleanup();
        return rc;
}
