/* soak_hostile.c - epd-soak-hostile: what a bystander feels while another tenant attacks the
 * daemon, and how fast a rank's death reaches its peers. Run by `make soak-hostile`; not part of
 * `make test` (integ_hostile asserts the outcomes there; this measures).
 *
 * Part 1, per attack of tests/lib/attacks.h (and "quiet", no attack): a fresh daemon (host
 * backend), a warm-up run of the bystander group (2 worker processes, verified MoE steps), the
 * attack started, the bystander run again for --steps steps, and its dispatch latency as each
 * worker saw it (submit to completion) reported as p50 and p99, beside the quiet figures of the
 * same run, with the ratio of p99s. The daemon's fds return to their baseline after each attack,
 * or the run fails.
 *
 * Part 2, --kills N: a 2-rank group whose rank 1 is a process killed N times with SIGKILL, each
 * time at one of three points, in turn: while the survivor's op waits for it (before it
 * submitted), right after both submitted a large dispatch (during execution), and after it
 * submitted alone (the survivor submits after the kill). Reported: the time from kill(2) to the
 * survivor's op ending with PEER_LOST, as p50, p99 and max per point and overall, and the
 * daemon's fds and regions after the last kill against their baseline (a leak fails the run).
 *
 * Output: a table on stdout, or with --json one JSON object per line. Exit 0 unless a bystander
 * step failed, an attack did not start, a kill did not give PEER_LOST, or something leaked.
 */
#include <getopt.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "attacks.h"
#include "epd.h"
#include "harness.h"
#include "workload.h"

struct opts {
        int steps;
        int kills;
        int json;
        int only;                /* an attack, or -1 for all */
};

/* The daemon's poll_us (--poll-us), or NULL for its default. */
static const char *poll_us;

static const struct wl_case bystander = {
        "bystander", 4401, 2, 8, 256, 32, 2, EPD_DTYPE_BF16, EPD_DTYPE_INT64,
        EPD_LAYOUT_EXPAND, 4, 1, 1, TD_ROUTING_UNIFORM, 0.05, WL_TOKENS_DESCENDING, 1, 1, 1, 1,
        1, 0, 0, 0,
};

static uint64_t now_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

static double pct_us(uint64_t *v, size_t n, double q)
{
        size_t i;

        if (n == 0)
                return 0;
        qsort(v, n, sizeof(*v), cmp_u64);
        i = (size_t)(q / 100.0 * (double)(n - 1) + 0.5);
        return (double)v[i] / 1e3;
}

static void daemon_start_open(struct h_daemon *d, char *config_path)
{
        const char *args[] = { "--config", config_path, "--socket-mode", "0666",
                               poll_us ? "--poll-us" : NULL, poll_us, NULL };
        const char *text = "[limits]\nmax_clients = 64\nmax_clients_per_uid = 16\n"
                           "handshake_timeout_ms = 2000\nmax_regions_per_uid = 4096\n";
        int fd = mkstemp(config_path);
        FILE *f;

        if (fd < 0 || !(f = fdopen(fd, "w"))) {
                perror("config");
                exit(1);
        }
        fputs(text, f);
        fclose(f);
        if (h_daemon_start(d, args) != 0)
                exit(1);
        chmod(d->dir, 0755);
}

/* The daemon's fd count once it stopped changing (clients that just left are closed). */
static int settled_fds(const struct h_daemon *d)
{
        int last = -2, now = h_proc_fd_count(d->pid);

        for (int i = 0; i < 100 && now != last; i++) {
                usleep(50000);
                last = now;
                now = h_proc_fd_count(d->pid);
        }
        return now;
}

/* ---- part 1: the bystander beside each attack ---- */

struct run_shared {
        const char *socket;
        struct wl_case c;
        uint64_t *lat;           /* [2][steps], shared with the workers */
};

static int worker_main(void *arg, int index)
{
        struct run_shared *rs = arg;
        struct wl_timing t = { .dispatch_step_ns = rs->lat + (size_t)index * rs->c.steps };

        return wl_worker(&rs->c, rs->socket, "bystander", (uint32_t)index, &t);
}

/* Runs the bystander for `steps` steps; fills lat. 0 or -1. */
static int bystander_run(const struct h_daemon *d, int steps, uint64_t *lat)
{
        struct run_shared rs = { d->socket, bystander, lat };
        pid_t pids[2];

        rs.c.steps = steps;
        for (int i = 0; i < 2; i++)
                pids[i] = h_spawn(worker_main, &rs, i);
        return h_wait_all(pids, 2, 600000) == 0 ? 0 : -1;
}

struct attack_result {
        double p50, p99;
        double idle_cpu_pct;    /* the daemon's CPU use in the second after the bystander ended,
                                 * the attack going on alone, % of one core */
        int ok;
};

static struct attack_result measure_attack(enum attack a, int steps)
{
        struct attack_result res = { 0 };
        size_t n = 2 * (size_t)steps;
        uint64_t *lat = mmap(NULL, n * sizeof(uint64_t), PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        char config[] = "/tmp/epd-soak-hostile-XXXXXX";
        struct attack_run run;
        struct h_daemon d;
        int fds0, fds1 = -1;

        if (lat == MAP_FAILED)
                return res;
        daemon_start_open(&d, config);
        if (bystander_run(&d, 8, lat) < 0)
                goto out;
        fds0 = settled_fds(&d);
        if (attack_start(&run, a, &d, "bystander") < 0) {
                fprintf(stderr, "attack %s did not start\n", attack_name(a));
                goto out;
        }
        if (bystander_run(&d, steps, lat) < 0 || !attack_active(&run)) {
                fprintf(stderr, "attack %s: the bystander failed or the attack ended early\n",
                        attack_name(a));
                attack_stop(&run);
                goto out;
        }
        {
                double cpu0 = h_proc_cpu_seconds(d.pid);
                long long t0 = h_now_ms();

                usleep(1000000);
                res.idle_cpu_pct = (h_proc_cpu_seconds(d.pid) - cpu0) * 1e5 /
                                   (double)(h_now_ms() - t0);
        }
        attack_stop(&run);
        for (int i = 0; i < 500 && (fds1 = h_proc_fd_count(d.pid)) > fds0; i++)
                usleep(20000);
        if (fds1 > fds0) {
                fprintf(stderr, "attack %s: the daemon holds %d fds after it, %d before\n",
                        attack_name(a), fds1, fds0);
                goto out;
        }
        res.p50 = pct_us(lat, n, 50);
        res.p99 = pct_us(lat, n, 99);
        res.ok = 1;
out:
        h_daemon_stop(&d, 10000);
        unlink(config);
        munmap(lat, n * sizeof(uint64_t));
        return res;
}

/* ---- part 2: kills ---- */

enum kill_point { KILL_BEFORE_SUBMIT, KILL_DURING_EXEC, KILL_AFTER_SUBMIT, KILL_POINTS };
static const char *const point_names[KILL_POINTS] = { "before-submit", "during-execution",
                                                       "after-submit" };

#define KILL_T 2048
#define KILL_H 4096

struct rank_io {
        struct epd_client *c;
        struct epd_group *g;
        struct epd_dispatch_args da;
};

static int rank_setup(struct rank_io *io, const struct h_daemon *d, uint32_t rank, int create)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = 2, .num_experts = 8, .hidden = KILL_H,
                .max_tokens_per_rank = KILL_T, .max_topk = 2, .dispatch_dtype = EPD_DTYPE_BF16,
                .op_timeout_ms = 30000, .arena_bytes = 256ull << 20,
        };
        uint64_t xs[2] = { KILL_T, KILL_H }, ks[2] = { KILL_T, 2 }, region;
        size_t xbytes = (size_t)KILL_T * KILL_H * 2;
        int64_t *topk;
        uint8_t *p;

        io->c = h_connect(d, rank ? "victim" : "survivor");
        if (!io->c || wl_enter_group(io->c, "killed", rank, create ? &cfg : NULL, &io->g) != 0)
                return -1;
        if (epd_region_alloc(io->c, xbytes + (size_t)KILL_T * 16, (void **)&p, &region) != 0)
                return -1;
        memset(p, 0x3c, xbytes);
        topk = (int64_t *)(p + xbytes);
        for (uint32_t t = 0; t < KILL_T; t++) {
                topk[2 * t] = t % 8;
                topk[2 * t + 1] = (t + 3) % 8;
        }
        memset(&io->da, 0, sizeof(io->da));
        io->da.size = sizeof(io->da);
        io->da.num_tokens = KILL_T;
        io->da.use_arena = 1;
        if (epd_tensor_at(io->c, p, EPD_DTYPE_BF16, 2, xs, &io->da.x) != 0 ||
            epd_tensor_at(io->c, topk, EPD_DTYPE_INT64, 2, ks, &io->da.topk_idx) != 0)
                return -1;
        return 0;
}

struct victim_arg {
        const struct h_daemon *d;
        enum kill_point point;
        int ready_fd;
};

/* Rank 1: joins, then (unless before-submit) submits, says so, and waits to be killed. */
static int victim_main(void *arg, int index)
{
        struct victim_arg *va = arg;
        struct rank_io io;
        struct epd_op *op;

        (void)index;
        if (rank_setup(&io, va->d, 1, 0) < 0)
                return 2;
        if (va->point != KILL_BEFORE_SUBMIT && epd_dispatch_submit(io.g, &io.da, &op) != 0)
                return 3;
        if (write(va->ready_fd, "r", 1) != 1)
                return 4;
        for (;;)
                pause();
}

struct kill_result {
        uint64_t *lat[KILL_POINTS];
        size_t n[KILL_POINTS];
        int failures, leaked_fds, leaked_regions, completed_before_kill;
};

static long long regions_of(const struct h_daemon *d)
{
        static char out[64 * 1024];
        const char *args[] = { "--socket", d->socket, "status", "--json", NULL };
        json_t *st = NULL;
        long long n = -1;

        if (h_run_tool("epctl", args, out, sizeof(out)) == 0)
                st = json_loads(out, 0, NULL);
        else
                fprintf(stderr, "epctl status failed\n");
        if (st) {
                n = json_integer_value(json_object_get(st, "regions"));
                json_decref(st);
        }
        return n;
}

static void measure_kills(int kills, struct kill_result *kr)
{
        char config[] = "/tmp/epd-soak-hostile-XXXXXX";
        struct rank_io surv;
        struct h_daemon d;
        int fds0 = -1, fds1;
        long long regions0 = -1, regions1;

        memset(kr, 0, sizeof(*kr));
        for (int p = 0; p < KILL_POINTS; p++)
                kr->lat[p] = calloc((size_t)kills + 1, sizeof(uint64_t));
        daemon_start_open(&d, config);
        if (rank_setup(&surv, &d, 0, 1) < 0) {
                kr->failures++;
                goto out;
        }
        for (int k = 0; k < kills; k++) {
                enum kill_point point = (enum kill_point)(k % KILL_POINTS);
                struct victim_arg va = { &d, point, -1 };
                struct epd_op *op = NULL;
                int pipefd[2], status, rc;
                uint64_t t_kill;
                char byte;
                pid_t pid;

                if (pipe(pipefd) < 0)
                        break;
                va.ready_fd = pipefd[1];
                pid = h_spawn(victim_main, &va, 0);
                close(pipefd[1]);
                if (read(pipefd[0], &byte, 1) != 1) {
                        close(pipefd[0]);
                        waitpid(pid, &status, 0);
                        kr->failures++;
                        continue;
                }
                close(pipefd[0]);
                if (point != KILL_AFTER_SUBMIT && epd_dispatch_submit(surv.g, &surv.da, &op) != 0) {
                        kr->failures++;
                        kill(pid, SIGKILL);
                        waitpid(pid, &status, 0);
                        continue;
                }
                if (point == KILL_DURING_EXEC)
                        usleep(200); /* both submitted: the op is executing */
                t_kill = now_ns();
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                if (point == KILL_AFTER_SUBMIT && epd_dispatch_submit(surv.g, &surv.da, &op) != 0) {
                        kr->failures++;
                        continue;
                }
                rc = epd_op_wait(op, 10000);
                uint64_t t_end = now_ns();
                if (rc == EPD_OK) {
                        /* The op finished before the kill landed: not a sample. */
                        struct epd_dispatch_result dr;
                        kr->completed_before_kill++;
                        if (epd_op_dispatch_result(op, &dr) == 0)
                                epd_handle_release(surv.g, dr.handle_id);
                } else if (rc == EPD_PEER_LOST) {
                        kr->lat[point][kr->n[point]++] = t_end - t_kill;
                } else {
                        fprintf(stderr, "kill %d (%s): the survivor's op gave %s: %s\n", k,
                                point_names[point], epd_status_name(rc), epd_op_error(op));
                        kr->failures++;
                }
                epd_op_free(op);
                if (k == 0) {
                        fds0 = settled_fds(&d);
                        regions0 = regions_of(&d);
                }
        }
        /* The last victim's connection is gone once the daemon saw the kill. */
        fds1 = settled_fds(&d);
        regions1 = regions_of(&d);
        kr->leaked_fds = fds1 - fds0;
        kr->leaked_regions = (int)(regions1 - regions0);
out:
        h_daemon_stop(&d, 10000);
        unlink(config);
}

/* ---- main ---- */

static void usage(FILE *f)
{
        fprintf(f, "usage: epd-soak-hostile [--steps N] [--kills N] [--attack NAME] [--json]\n"
                   "  --steps N     bystander steps under each attack (default 2000)\n"
                   "  --kills N     rank kills for the PEER_LOST latency (default 1100; 0: none)\n"
                   "  --attack NAME only this attack (quiet, stall, idle-connections,\n"
                   "                wrong-secret, bindings, regions); default: all\n"
                   "  --poll-us US  the daemon's poll_us (default: its own)\n"
                   "  --json        one JSON object per line instead of the table\n"
                   "Beside each attack: the bystander's dispatch latency, and the daemon's CPU use\n"
                   "in the second after the bystander ended, the attack going on alone.\n");
}

int main(int argc, char **argv)
{
        static const struct option options[] = {
                { "steps", required_argument, NULL, 's' }, { "kills", required_argument, NULL, 'k' },
                { "attack", required_argument, NULL, 'a' }, { "json", no_argument, NULL, 'j' },
                { "poll-us", required_argument, NULL, 'p' },
                { "help", no_argument, NULL, 'h' },        { NULL, 0, NULL, 0 },
        };
        struct opts o = { 2000, 1100, 0, -1 };
        struct attack_result quiet = { 0 };
        int opt, failed = 0;

        while ((opt = getopt_long(argc, argv, "", options, NULL)) != -1) {
                switch (opt) {
                case 's': o.steps = atoi(optarg); break;
                case 'k': o.kills = atoi(optarg); break;
                case 'a':
                        o.only = attack_parse(optarg);
                        if (o.only < 0) {
                                fprintf(stderr, "epd-soak-hostile: unknown attack '%s'\n", optarg);
                                return 2;
                        }
                        break;
                case 'j': o.json = 1; break;
                case 'p': poll_us = optarg; break;
                case 'h': usage(stdout); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (o.steps < 1 || o.kills < 0) {
                usage(stderr);
                return 2;
        }
        signal(SIGPIPE, SIG_IGN);
        if (!o.json)
                printf("%-18s %12s %12s %14s %16s\n", "attack", "p50 us", "p99 us",
                       "p99 / quiet", "attack alone, daemon CPU %");
        fflush(stdout);
        for (int a = 0; a < ATTACK_COUNT; a++) {
                struct attack_result r;
                if (o.only >= 0 && a != o.only && a != ATTACK_NONE)
                        continue;
                r = measure_attack((enum attack)a, o.steps);
                if (a == ATTACK_NONE)
                        quiet = r;
                failed |= !r.ok;
                double ratio = quiet.p99 > 0 ? r.p99 / quiet.p99 : 0;
                if (o.json) {
                        json_t *j = json_pack("{s:s,s:s,s:i,s:b,s:f,s:f,s:f,s:f,s:f}",
                                              "kind", "bystander_dispatch", "attack",
                                              attack_name((enum attack)a), "steps", o.steps,
                                              "ok", r.ok, "p50_us", r.p50, "p99_us", r.p99,
                                              "quiet_p99_us", quiet.p99, "p99_ratio", ratio,
                                              "idle_daemon_cpu_pct", r.idle_cpu_pct);
                        char *s = json_dumps(j, JSON_COMPACT);
                        printf("%s\n", s);
                        free(s);
                        json_decref(j);
                } else {
                        printf("%-18s %12.1f %12.1f %14.2f %28.1f%s\n",
                               attack_name((enum attack)a), r.p50, r.p99, ratio, r.idle_cpu_pct,
                               r.ok ? "" : "  FAILED");
                }
                fflush(stdout);
        }
        if (o.kills > 0) {
                struct kill_result kr;
                uint64_t *all = calloc((size_t)o.kills + 1, sizeof(uint64_t));
                size_t n_all = 0;

                measure_kills(o.kills, &kr);
                if (!o.json)
                        printf("\nPEER_LOST after a kill (ms)\n%-18s %8s %10s %10s %10s\n",
                               "point", "kills", "p50", "p99", "max");
                for (int p = 0; p < KILL_POINTS; p++) {
                        size_t n = kr.n[p];
                        memcpy(all + n_all, kr.lat[p], n * sizeof(uint64_t));
                        n_all += n;
                        double p50 = pct_us(kr.lat[p], n, 50) / 1e3;
                        double p99 = pct_us(kr.lat[p], n, 99) / 1e3;
                        double mx = n ? (double)kr.lat[p][n - 1] / 1e6 : 0;
                        if (o.json)
                                printf("{\"kind\":\"peer_lost\",\"point\":\"%s\",\"kills\":%zu,"
                                       "\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"max_ms\":%.3f}\n",
                                       point_names[p], n, p50, p99, mx);
                        else
                                printf("%-18s %8zu %10.2f %10.2f %10.2f\n", point_names[p], n,
                                       p50, p99, mx);
                }
                double p99 = pct_us(all, n_all, 99) / 1e3;
                double mx = n_all ? (double)all[n_all - 1] / 1e6 : 0;
                if (o.json)
                        printf("{\"kind\":\"peer_lost\",\"point\":\"all\",\"kills\":%zu,"
                               "\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"max_ms\":%.3f,"
                               "\"completed_before_kill\":%d,\"failures\":%d,"
                               "\"leaked_fds\":%d,\"leaked_regions\":%d}\n",
                               n_all, pct_us(all, n_all, 50) / 1e3, p99, mx,
                               kr.completed_before_kill, kr.failures, kr.leaked_fds,
                               kr.leaked_regions);
                else
                        printf("%-18s %8zu %10.2f %10.2f %10.2f\n"
                               "ops that completed before the kill landed: %d; failures: %d; "
                               "leaked fds: %d, regions: %d\n",
                               "all", n_all, pct_us(all, n_all, 50) / 1e3, p99, mx,
                               kr.completed_before_kill, kr.failures, kr.leaked_fds,
                               kr.leaked_regions);
                failed |= kr.failures > 0 || kr.leaked_fds != 0 || kr.leaked_regions != 0;
                free(all);
        }
        return failed ? 1 : 0;
}
