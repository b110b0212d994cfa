/* soak.c - epd-soak: a long run of randomised MoE steps through a real daemon, every op checked
 * against the independent reference, while the daemon's memory and file descriptors are watched.
 * Run by `make soak`; not part of `make test`.
 *
 * It starts epd (the binary next to it) on a temporary socket, or uses --socket, and runs one
 * group of --clients ranks, one worker process each. Every rank runs the same sequence of steps
 * (tests/lib/randstep.h), planned from --seed so that each client does at least --ops collective ops:
 * within the group config every step draws N_s <= T per rank, K_op <= K, the layout, the
 * alignment, zero padding, weights, apply_weights, the routing, biases per rank, arena or client
 * outputs per rank, padded strides, y in place in the arena, and sometimes a cached dispatch.
 *
 * What is verified, bitwise against the reference:
 * - every op: its status, the counts (num_recv_tokens, num_expanded_rows, per-expert counts
 *   raw and aligned, rank_prefix), the metadata of every output row (recv_src, recv_topk_idx,
 *   recv_weights, recv_topk_slot) and every zero-padding row; the payload (recv_x, recv_scales)
 *   of --sample-rows random rows of each dispatch; --sample-rows random combined rows with their
 *   combined_topk_weights;
 * - every --full-every'th step, everything: every row of every output and every combined row.
 * The test process samples the daemon's RSS (VmRSS, and its private part RssAnon, where a leak
 * would show) and fd count every --interval ms and reports the ops, mismatches, RSS (start,
 * warm, last under load, peak, after the clients left), fd counts and the op latency (submit
 * to completion as the client sees it, from a log-scale histogram, 4.4% resolution). The exit
 * status is 0 only with no mismatch, no error, and the daemon back to its fd baseline with no
 * client region left.
 */
#include <dirent.h>
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "randstep.h"

struct soak_shared {
        char socket[320];
        struct rs_shape shape;
        uint64_t steps;               /* steps every rank runs */
        uint32_t full_every, sample_rows;
        atomic_ullong ops[RS_MAX_RANKS], steps_done[RS_MAX_RANKS];
        atomic_ullong full_checks[RS_MAX_RANKS], rows_checked[RS_MAX_RANKS];
        atomic_ullong regions[RS_MAX_RANKS];
        atomic_int mismatches, errors;
        char first_error[2048];
        atomic_int have_error;
        uint64_t lat_hist[RS_LAT_BUCKETS];
};

static double secs(uint64_t ns)
{
        return (double)ns / 1e9;
}

static void report_error(struct soak_shared *sh, const char *msg)
{
        int expected = 0;

        fprintf(stderr, "epd-soak: %s\n", msg);
        if (atomic_compare_exchange_strong(&sh->have_error, &expected, 1))
                snprintf(sh->first_error, sizeof(sh->first_error), "%s", msg);
}

static int worker_main(void *arg, int rank)
{
        struct soak_shared *sh = arg;
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = sh->socket,
                                       .client_name = "epd-soak", .timeout_ms = 60000 };
        struct epd_group_config cfg = rs_group_config(&sh->shape, 60000,
                                                      rs_arena_bytes(&sh->shape));
        struct epd_client *c = NULL;
        struct epd_group *g = NULL;
        struct rs_worker w;
        char err[512];
        int rc;

        rc = epd_client_connect(&ca, &c, err, sizeof(err));
        if (rc < 0) {
                report_error(sh, err);
                atomic_fetch_add(&sh->errors, 1);
                return 1;
        }
        rc = rs_enter_group(c, "soak", (uint32_t)rank, &cfg, &g, 30000);
        if (rc < 0) {
                report_error(sh, epd_client_last_error(c));
                atomic_fetch_add(&sh->errors, 1);
                return 1;
        }
        rs_worker_init(&w, &sh->shape, (uint32_t)rank, c, g);
        w.lat_hist = sh->lat_hist;
        w.sample_rows = sh->sample_rows;
        for (uint64_t step = 0; step < sh->steps; step++) {
                struct rs_plan p;

                rs_plan_make(&sh->shape, 0, step, 0, &p);
                w.check = sh->full_every && step % sh->full_every == 0 ? RS_CHECK_FULL
                                                                        : RS_CHECK_SAMPLED;
                rc = rs_step_run(&w, &p, 0, step);
                if (rc != RS_OK) {
                        report_error(sh, w.err);
                        atomic_fetch_add(rc == RS_MISMATCH ? &sh->mismatches : &sh->errors, 1);
                        return 1; /* the other ranks then fail with PEER_LOST, and stop too */
                }
                atomic_store(&sh->ops[rank], w.ops_ok);
                atomic_store(&sh->steps_done[rank], w.steps_ok);
                atomic_store(&sh->full_checks[rank], w.full_checks);
                atomic_store(&sh->rows_checked[rank], w.rows_checked);
                atomic_store(&sh->regions[rank], w.regions_registered);
        }
        rs_worker_fini(&w);
        rc = epd_group_leave(g);
        epd_client_free(c);
        return rc < 0;
}

/* ---- the daemon, from /proc ---- */

/* VmRSS, and the part of it that is private (RssAnon: the heap, where a leak would show; the
 * rest is mostly the shared memfds of arenas and client regions, which grow as pages are
 * first touched). KiB, -1 when unreadable. */
struct rss {
        long total, anon;
};

static struct rss rss_read(pid_t pid)
{
        char path[64], line[256];
        struct rss r = { -1, -1 };
        FILE *f;

        snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
        f = fopen(path, "re");
        if (!f)
                return r;
        while (fgets(line, sizeof(line), f)) {
                sscanf(line, "VmRSS: %ld kB", &r.total);
                sscanf(line, "RssAnon: %ld kB", &r.anon);
        }
        fclose(f);
        return r;
}

/* pid of the daemon behind a socket, from `epctl status --json` ("pid": N). */
static pid_t daemon_pid(const char *socket)
{
        static char out[65536];
        const char *args[] = { "--socket", socket, "status", "--json", NULL };
        const char *p;

        if (h_run_tool("epctl", args, out, sizeof(out)) != 0)
                return -1;
        p = strstr(out, "\"pid\":");
        return p ? (pid_t)atoi(p + 6) : -1;
}

static void usage(FILE *f)
{
        fprintf(f,
                "Usage: epd-soak [OPTIONS]\n"
                "Runs randomised, verified MoE steps through epd for a long time and watches the\n"
                "daemon's memory and file descriptors.\n\n"
                "  --ops N           collective ops per client (default 100000)\n"
                "  --clients N       ranks of the group, one process each (default 8)\n"
                "  --seed S          plan and data seed (default: from the time; printed)\n"
                "  --full-every N    verify everything every N steps (default 50; 0: never)\n"
                "  --sample-rows N   rows checked per op otherwise (default 16)\n"
                "  --experts E --hidden H --tokens T --topk K --dtype bf16|fp8\n"
                "                    the group (default 64, 512, 64, 8, bf16)\n"
                "  --interval MS     daemon sampling period (default 1000)\n"
                "  --socket PATH     use a running daemon instead of starting one\n");
}

int main(int argc, char **argv)
{
        static const struct option options[] = {
                { "ops", required_argument, NULL, 'o' },
                { "clients", required_argument, NULL, 'c' },
                { "seed", required_argument, NULL, 's' },
                { "full-every", required_argument, NULL, 'f' },
                { "sample-rows", required_argument, NULL, 'r' },
                { "experts", required_argument, NULL, 'E' },
                { "hidden", required_argument, NULL, 'H' },
                { "tokens", required_argument, NULL, 'T' },
                { "topk", required_argument, NULL, 'K' },
                { "dtype", required_argument, NULL, 'd' },
                { "interval", required_argument, NULL, 'i' },
                { "socket", required_argument, NULL, 'S' },
                { "help", no_argument, NULL, 'h' },
                { NULL, 0, NULL, 0 },
        };
        uint64_t ops_target = 100000, seed = (uint64_t)time(NULL);
        uint32_t clients = 8, experts = 64, hidden = 512, tokens = 64, topk = 8;
        uint32_t full_every = 50, sample_rows = 16, interval_ms = 1000;
        enum epd_dtype dtype = EPD_DTYPE_BF16;
        const char *socket = NULL;
        struct h_daemon d;
        struct soak_shared *sh;
        pid_t pids[RS_MAX_RANKS], dpid;
        int opt, started = 0, failures, rc = 0;

        while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
                switch (opt) {
                case 'o': ops_target = strtoull(optarg, NULL, 0); break;
                case 'c': clients = (uint32_t)atoi(optarg); break;
                case 's': seed = strtoull(optarg, NULL, 0); break;
                case 'f': full_every = (uint32_t)atoi(optarg); break;
                case 'r': sample_rows = (uint32_t)atoi(optarg); break;
                case 'E': experts = (uint32_t)atoi(optarg); break;
                case 'H': hidden = (uint32_t)atoi(optarg); break;
                case 'T': tokens = (uint32_t)atoi(optarg); break;
                case 'K': topk = (uint32_t)atoi(optarg); break;
                case 'd':
                        dtype = strcmp(optarg, "fp8") == 0 ? EPD_DTYPE_FP8_E4M3 : EPD_DTYPE_BF16;
                        break;
                case 'i': interval_ms = (uint32_t)atoi(optarg); break;
                case 'S': socket = optarg; break;
                case 'h': usage(stdout); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (clients < 1 || clients > RS_MAX_RANKS || experts % clients || topk < 1 || topk > 32 ||
            tokens < 1 || hidden < 1 || (dtype == EPD_DTYPE_FP8_E4M3 && hidden % 128)) {
                fprintf(stderr, "epd-soak: invalid group shape\n");
                return 2;
        }
        sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (sh == MAP_FAILED)
                return 1;
        memset(sh, 0, sizeof(*sh));
        sh->shape = (struct rs_shape){ .world_size = clients, .num_experts = experts,
                                       .hidden = hidden, .max_tokens = tokens, .max_topk = topk,
                                       .dtype = dtype, .step_tokens = tokens, .seed = seed };
        sh->full_every = full_every;
        sh->sample_rows = sample_rows;
        /* Enough steps for ops_target ops per client (a step is 2 or 3 ops). */
        for (uint64_t ops = 0; ops < ops_target; sh->steps++) {
                struct rs_plan p;
                rs_plan_make(&sh->shape, 0, sh->steps, 0, &p);
                ops += p.num_ops;
        }
        printf("epd-soak seed=%llu clients=%u ops/client>=%llu (%llu steps) E=%u H=%u T=%u K=%u %s; full check every %u steps, else %u sampled rows per op\n",
               (unsigned long long)seed, clients, (unsigned long long)ops_target,
               (unsigned long long)sh->steps, experts, hidden, tokens, topk,
               dtype == EPD_DTYPE_BF16 ? "bf16" : "fp8", full_every, sample_rows);
        if (socket) {
                snprintf(sh->socket, sizeof(sh->socket), "%s", socket);
                dpid = daemon_pid(socket);
        } else {
                if (h_daemon_start(&d, NULL) < 0)
                        return 1;
                started = 1;
                snprintf(sh->socket, sizeof(sh->socket), "%s", d.socket);
                dpid = d.pid;
        }
        if (dpid <= 0) {
                fprintf(stderr, "epd-soak: cannot find the daemon's pid\n");
                return 1;
        }
        struct rss rss0 = rss_read(dpid), rss_peak = rss0, rss_warm = { -1, -1 }, rss_last = rss0;
        int fd0 = h_proc_fd_count(dpid), fd_peak = fd0, fd_min = fd0, maps0 = h_proc_region_mappings(dpid);
        printf("daemon pid %d: RSS %ld KiB (anon %ld KiB), %d fds at the start\n", (int)dpid,
               rss0.total, rss0.anon, fd0);
        fflush(stdout);

        uint64_t t0 = rs_now_ns(), last_print = t0;
        for (uint32_t r = 0; r < clients; r++)
                pids[r] = h_spawn(worker_main, sh, (int)r);
        int left = (int)clients, exited[RS_MAX_RANKS] = { 0 };
        failures = 0;
        while (left > 0) {
                for (uint32_t r = 0; r < clients; r++) {
                        int status;
                        if (exited[r] || waitpid(pids[r], &status, WNOHANG) != pids[r])
                                continue;
                        exited[r] = 1;
                        left--;
                        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
                                failures++;
                }
                struct rss rss = rss_read(dpid);
                int fds = h_proc_fd_count(dpid);
                rss_peak.total = rss.total > rss_peak.total ? rss.total : rss_peak.total;
                rss_peak.anon = rss.anon > rss_peak.anon ? rss.anon : rss_peak.anon;
                if (left > 0)
                        rss_last = rss; /* the last sample under load */
                fd_peak = fds > fd_peak ? fds : fd_peak;
                fd_min = fds >= 0 && fds < fd_min ? fds : fd_min;
                uint64_t now = rs_now_ns(), ops = 0;
                for (uint32_t r = 0; r < clients; r++)
                        ops = atomic_load(&sh->ops[r]) > ops ? atomic_load(&sh->ops[r]) : ops;
                if (rss_warm.total < 0 && ops >= ops_target / 10)
                        rss_warm = rss; /* after the first tenth: arenas and pools are warm */
                if (now - last_print >= 10000000000ull || left == 0) {
                        printf("%7.1f s  ops/client %8llu  %7.0f ops/s  daemon RSS %ld KiB (anon %ld)  fds %d\n",
                               secs(now - t0), (unsigned long long)ops,
                               (double)ops / secs(now - t0), rss.total, rss.anon, fds);
                        fflush(stdout);
                        last_print = now;
                }
                if (left > 0)
                        usleep(interval_ms * 1000);
        }
        uint64_t wall = rs_now_ns() - t0;

        /* After everyone left: the fds and regions are back where they started. */
        int fd_end = -1, maps_end = -1;
        for (int i = 0; i < 100; i++) {
                fd_end = h_proc_fd_count(dpid);
                maps_end = h_proc_region_mappings(dpid);
                if (fd_end == fd0 && maps_end == maps0)
                        break;
                usleep(20000);
        }
        struct rss rss_end = rss_read(dpid);
        uint64_t ops = 0, steps = 0, full = 0, rows = 0, regions = 0;
        for (uint32_t r = 0; r < clients; r++) {
                ops = atomic_load(&sh->ops[r]) > ops ? atomic_load(&sh->ops[r]) : ops;
                steps += atomic_load(&sh->steps_done[r]);
                full += atomic_load(&sh->full_checks[r]);
                rows += atomic_load(&sh->rows_checked[r]);
                regions += atomic_load(&sh->regions[r]);
        }
        printf("\n==== epd-soak summary (seed %llu) ====\n", (unsigned long long)seed);
        printf("ops: %llu per client, %llu in total across %u clients, in %.1f s (%.0f collective ops/s)\n",
               (unsigned long long)ops, (unsigned long long)ops * clients, clients, secs(wall),
               (double)ops / secs(wall));
        printf("verified: %llu client-steps, %llu of them fully; %llu dispatch rows compared bitwise in full checks and samples; %llu region registrations\n",
               (unsigned long long)steps, (unsigned long long)full, (unsigned long long)rows,
               (unsigned long long)regions);
        printf("mismatches: %d  errors: %d  failed workers: %d\n", atomic_load(&sh->mismatches),
               atomic_load(&sh->errors), failures);
        if (atomic_load(&sh->have_error))
                printf("first error: %s\n", sh->first_error);
        printf("op latency (client, submit to completion): p50 %.1f us  p99 %.1f us  max <= %.1f us\n",
               rs_lat_quantile(sh->lat_hist, 0.50) / 1e3, rs_lat_quantile(sh->lat_hist, 0.99) / 1e3,
               rs_lat_quantile(sh->lat_hist, 1.0) / 1e3);
        printf("daemon RSS KiB (total / private anon): start %ld / %ld, after the first tenth %ld / %ld, last under load %ld / %ld, peak %ld / %ld, after the clients left %ld / %ld\n",
               rss0.total, rss0.anon, rss_warm.total, rss_warm.anon, rss_last.total,
               rss_last.anon, rss_peak.total, rss_peak.anon, rss_end.total, rss_end.anon);
        printf("daemon fds: start %d, min %d, peak %d, end %d; client memfd mappings start %d, end %d\n",
               fd0, fd_min, fd_peak, fd_end, maps0, maps_end);
        if (failures || atomic_load(&sh->mismatches) || atomic_load(&sh->errors) ||
            fd_end != fd0 || maps_end != maps0)
                rc = 1;
        if (started) {
                int st = h_daemon_stop(&d, 10000);
                if (st != 0) {
                        fprintf(stderr, "epd-soak: the daemon exited with %d\n", st);
                        rc = 1;
                }
        }
        printf("result: %s\n", rc ? "FAILED" : "OK");
        munmap(sh, sizeof(*sh));
        return rc;
}
