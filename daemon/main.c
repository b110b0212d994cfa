/* main.c - epd: configuration, start-up, signals, systemd notification and watchdog, and the
 * orderly shutdown that drains in-flight ops. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "admission.h"
#include "backend.h"
#include "budget.h"
#include "daemon.h"
#include "frame.h"
#include "log.h"
#include "metrics.h"
#include "util.h"

#define DRAIN_LIMIT_MS 30000

static void usage(FILE *f)
{
        fprintf(f,
                "Usage: epd [OPTIONS]\n"
                "The epd expert-parallel daemon: serves MoE dispatch/combine to local workers.\n\n"
                "  -c, --config PATH        configuration file (default %s)\n"
                "  -s, --socket PATH        Unix socket to listen on (default %s)\n"
                "  -b, --backend NAME       auto, host or cuda (default auto)\n"
                "      --socket-mode MODE   octal mode of the socket (default 0660)\n"
                "      --op-timeout-ms MS   default op timeout of new groups\n"
                "      --arena-bytes N      default per-rank output arena (K/M/G suffixes)\n"
                "      --host-devices N     virtual devices of the host backend\n"
                "      --host-threads N     copy threads of the host backend (0: CPUs)\n"
                "      --metrics-listen A:P serve Prometheus metrics on this address\n"
                "      --log-level LEVEL    error, warning, notice, info or debug\n"
                "      --poll-us US         poll this long after an op before sleeping\n"
                "      --cuda-graphs on|off send one-kernel ops as CUDA graphs (default on)\n"
                "  -h, --help               this text\n"
                "  -V, --version            print the version\n",
                EPD_CONFIG_PATH_DEFAULT, EPD_SOCKET_PATH_DEFAULT);
}

/* The top level's own handles: signals, the drain tick of a shutdown, the watchdog. */
static struct {
        uv_signal_t sig_term, sig_int, sig_hup;
        uv_timer_t watchdog_timer;
        uv_timer_t drain_timer;
} top;

struct flag_override {
        const char *section, *name, *value;
        const char *flag; /* as given, for messages */
};

/* The command line's keys, applied over the file at start and again over every reload: a flag
 * outranks the file for the daemon's whole life. */
static struct flag_override overrides[32];
static uv_timer_t log_flush_timer;
static unsigned num_overrides;

static int apply_overrides(struct epdd_config *cfg, char *err, size_t err_len)
{
        char why[192];

        for (unsigned i = 0; i < num_overrides; i++) {
                if (epd_config_set(cfg, overrides[i].section, overrides[i].name,
                                   overrides[i].value, why, sizeof(why)) < 0) {
                        snprintf(err, err_len, "option --%s: %s", overrides[i].flag, why);
                        return -EINVAL;
                }
        }
        return epd_config_validate(cfg, err, err_len);
}

static void on_drain_tick(uv_timer_t *timer)
{
        struct epdd_daemon *d = timer->data;
        struct epd_list *pos, *tmp;
        int busy = 0;
        uint64_t waited_ms = (epd__now_ns() - d->drain_start_ns) / 1000000;

        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                busy |= g->executing != NULL;
        }
        if (busy && waited_ms < DRAIN_LIMIT_MS)
                return;
        if (busy)
                log_warning("ops still executing after %d ms; stopping anyway", DRAIN_LIMIT_MS);
        /* Nothing runs any more: answer what waits, then close every client. */
        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                epd_op_fail_pending(g, EPD_ABORTED, "daemon shutting down");
        }
        epd_list_for_each_safe(pos, tmp, &d->conns)
                epd_conn_close(epd_list_entry(pos, struct epdd_conn, cl.link), "daemon shutting down");
        uv_timer_stop(timer);
        uv_stop(d->loop);
}

static void begin_shutdown(struct epdd_daemon *d, const char *why)
{
        if (d->shutting_down)
                return;
        d->shutting_down = 1;
        log_info("shutting down reason=%s: draining in-flight ops", why);
        /* Ops in the backend end now with ABORTED, those waiting for a client's inputs
         * included. */
        {
                struct epd_list *pos;
                epd_list_for_each(pos, &d->groups)
                        epd_op_abort_executing(epd_list_entry(pos, struct epdd_group, link),
                                               EPD_ABORTED);
        }
        sd_notify(0, "STOPPING=1\nSTATUS=draining in-flight ops");
        epd_server_close(d);
        d->drain_start_ns = epd__now_ns();
        uv_timer_start(&top.drain_timer, on_drain_tick, 0, 10);
}

static void on_signal(uv_signal_t *handle, int signum)
{
        struct epdd_daemon *d = handle->data;

        if (signum == SIGHUP) {
                struct epdd_config fresh;
                char err[256];
                int rc;
                epd_config_defaults(&fresh);
                /* Only a missing default file means "defaults"; a file with an error keeps
                 * the running configuration rather than applying the keys before the error. */
                rc = epd_config_load(&fresh, d->cfg.config_path, err, sizeof(err));
                if (rc < 0 && (rc != -ENOENT || d->cfg.config_path_set)) {
                        log_warning("reload failed: %s, keeping the running configuration", err);
                        return;
                }
                if (apply_overrides(&fresh, err, sizeof(err)) < 0) {
                        log_warning("reload refused: %s, keeping the running configuration", err);
                        return;
                }
                epd_config_apply_hot(&d->cfg, &fresh);
                epd_log_set_level(d->cfg.log_level);
                epd_conn_close_disallowed(d);
                log_info("configuration reloaded path=%s", d->cfg.config_path);
                return;
        }
        begin_shutdown(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void on_log_flush(uv_timer_t *timer)
{
        (void)timer;
        epd_log_flush_suppressed();
}

static void on_watchdog(uv_timer_t *timer)
{
        struct epdd_daemon *d = timer->data;
        char status[128];

        /* This timer firing proves the loop thread runs; the backend vouches for its threads. */
        if (d->backend->ops->check_alive(d->backend) < 0) {
                log_error("backend thread stuck; withholding the watchdog ping");
                return;
        }
        snprintf(status, sizeof(status), "STATUS=%u clients, %u groups, %llu ops",
                 d->num_conns, d->num_groups, (unsigned long long)d->stats.ops_completed);
        sd_notify(0, status);
        sd_notify(0, "WATCHDOG=1");
}

int main(int argc, char **argv)
{
        static const struct option options[] = {
                { "config", required_argument, NULL, 'c' },
                { "socket", required_argument, NULL, 's' },
                { "backend", required_argument, NULL, 'b' },
                { "socket-mode", required_argument, NULL, 1 },
                { "op-timeout-ms", required_argument, NULL, 2 },
                { "arena-bytes", required_argument, NULL, 3 },
                { "host-devices", required_argument, NULL, 4 },
                { "host-threads", required_argument, NULL, 5 },
                { "metrics-listen", required_argument, NULL, 6 },
                { "log-level", required_argument, NULL, 7 },
                { "poll-us", required_argument, NULL, 8 },
                { "cuda-graphs", required_argument, NULL, 9 },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },
                { NULL, 0, NULL, 0 },
        };
        static struct epdd_daemon daemon_state;
        struct epdd_daemon *d = &daemon_state;
        struct epdd_metrics *metrics = NULL;
        char metrics_status[160] = "";
        char err[512];
        int opt, rc;
        uint64_t watchdog_usec = 0;

        epd_log_init();
        epd_config_defaults(&d->cfg);
        int li = -1;
        while ((opt = getopt_long(argc, argv, "c:s:b:hV", options, &li)) != -1) {
                struct flag_override *o = &overrides[num_overrides];
                const char *flag = li >= 0 ? options[li].name : opt == 's' ? "socket" : "backend";
                li = -1;
                if (num_overrides >= EPD_ARRAY_SIZE(overrides)) {
                        fprintf(stderr, "epd: too many options\n");
                        return 2;
                }
                switch (opt) {
                case 'c':
                        snprintf(d->cfg.config_path, sizeof(d->cfg.config_path), "%s", optarg);
                        d->cfg.config_path_set = 1;
                        continue;
                case 's': *o = (struct flag_override){ "daemon", "socket", optarg, NULL }; break;
                case 'b': *o = (struct flag_override){ "daemon", "backend", optarg, NULL }; break;
                case 1: *o = (struct flag_override){ "daemon", "socket_mode", optarg, NULL }; break;
                case 2: *o = (struct flag_override){ "daemon", "op_timeout_ms", optarg, NULL }; break;
                case 3: *o = (struct flag_override){ "daemon", "arena_bytes", optarg, NULL }; break;
                case 4: *o = (struct flag_override){ "host", "devices", optarg, NULL }; break;
                case 5: *o = (struct flag_override){ "host", "threads", optarg, NULL }; break;
                case 6: *o = (struct flag_override){ "daemon", "metrics_listen", optarg, NULL }; break;
                case 7: *o = (struct flag_override){ "daemon", "log_level", optarg, NULL }; break;
                case 8: *o = (struct flag_override){ "daemon", "poll_us", optarg, NULL }; break;
                case 9: *o = (struct flag_override){ "daemon", "cuda_graphs", optarg, NULL }; break;
                case 'h':
                        usage(stdout);
                        return 0;
                case 'V':
                        printf("epd %s (%s)\n", EPD_VERSION_STRING, epd_git_rev);
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
                o->flag = flag;
                num_overrides++;
        }
        if (optind < argc) {
                fprintf(stderr, "epd: unexpected argument '%s'\n", argv[optind]);
                return 2;
        }
        rc = epd_config_load(&d->cfg, d->cfg.config_path, err, sizeof(err));
        if (rc < 0 && (rc != -ENOENT || d->cfg.config_path_set)) {
                fprintf(stderr, "epd: %s\n", err);
                return 2;
        }
        if (apply_overrides(&d->cfg, err, sizeof(err)) < 0) {
                fprintf(stderr, "epd: %s\n", err);
                return 2;
        }
        epd_log_set_level(d->cfg.log_level);
        signal(SIGPIPE, SIG_IGN);
        epd_budget_init(d);

        rc = epd_daemon_init(d, uv_default_loop(), err, sizeof(err));
        if (rc < 0) {
                log_error("cannot start: %s", err);
                return 1;
        }
        rc = epd_server_listen(d, err, sizeof(err));
        if (rc < 0) {
                log_error("cannot listen: %s", err);
                epd_backend_close(d->backend);
                uv_run(d->loop, UV_RUN_NOWAIT);
                return 1;
        }
        if (d->cfg.metrics_listen[0]) {
                rc = epd_metrics_start(d, d->cfg.metrics_listen, &metrics, err, sizeof(err));
                if (rc < 0) {
                        log_error("cannot serve metrics: %s", err);
                        epd_server_close(d);
                        epd_backend_close(d->backend);
                        uv_run(d->loop, UV_RUN_NOWAIT);
                        return 1;
                }
                /* Tests and operators find the real port (with port 0) here. */
                log_info("metrics listening address=%s url=http://%s/metrics",
                         epd_metrics_address(metrics), epd_metrics_address(metrics));
                if (strncmp(epd_metrics_address(metrics), "127.", 4) != 0 &&
                    strncmp(epd_metrics_address(metrics), "[::1]", 5) != 0)
                        log_warning("metrics address=%s is not loopback: the endpoint has no authentication",
                                    epd_metrics_address(metrics));
                snprintf(metrics_status, sizeof(metrics_status), "; metrics on http://%s/metrics",
                         epd_metrics_address(metrics));
        }
        uv_signal_init(d->loop, &top.sig_term);
        uv_signal_init(d->loop, &top.sig_int);
        uv_signal_init(d->loop, &top.sig_hup);
        top.sig_term.data = top.sig_int.data = top.sig_hup.data = d;
        uv_signal_start(&top.sig_term, on_signal, SIGTERM);
        uv_signal_start(&top.sig_int, on_signal, SIGINT);
        uv_signal_start(&top.sig_hup, on_signal, SIGHUP);
        uv_timer_init(d->loop, &top.drain_timer);
        top.drain_timer.data = d;
        uv_timer_init(d->loop, &top.watchdog_timer);
        top.watchdog_timer.data = d;
        epd_admission_init(d);
        uv_timer_init(d->loop, &log_flush_timer);
        uv_timer_start(&log_flush_timer, on_log_flush, 1000, 1000);
        uv_unref((uv_handle_t *)&log_flush_timer);
        if (sd_watchdog_enabled(0, &watchdog_usec) > 0 && watchdog_usec > 0) {
                uint64_t period_ms = watchdog_usec / 2000;
                uv_timer_start(&top.watchdog_timer, on_watchdog, 0, period_ms ? period_ms : 1);
        }
        log_info("epd %s ready socket=%s backend=%s devices=%u pid=%d", EPD_VERSION_STRING,
                 d->net->listen_fd_activated ? "(activated)" : d->cfg.socket_path,
                 d->backend->ops->name, d->backend->num_devices, (int)getpid());
        sd_notifyf(0, "READY=1\nSTATUS=serving on %s with the %s backend%s\nMAINPID=%d",
                   d->net->listen_fd_activated ? "the activated socket" : d->cfg.socket_path,
                   d->backend->ops->name, metrics_status, (int)getpid());

        uv_run(d->loop, UV_RUN_DEFAULT);

        uv_timer_stop(&top.watchdog_timer);
        uv_close((uv_handle_t *)&top.watchdog_timer, NULL);
        uv_close((uv_handle_t *)&log_flush_timer, NULL);
        epd_admission_close(d);
        epd_log_flush_suppressed();
        uv_close((uv_handle_t *)&top.drain_timer, NULL);
        uv_close((uv_handle_t *)&top.sig_term, NULL);
        uv_close((uv_handle_t *)&top.sig_int, NULL);
        uv_close((uv_handle_t *)&top.sig_hup, NULL);
        epd_server_close(d);
        epd_metrics_stop(metrics);
        epd_backend_close(d->backend);
        uv_run(d->loop, UV_RUN_DEFAULT);
        uv_loop_close(d->loop);
        epd_net_free(d);
        log_info("epd stopped");
        return 0;
}
