/* main.c - epd-bench: dispatch and combine bandwidth and latency of epd, driven through real
 * client processes and reported as docs/benchmarks.md defines.
 *
 * The parent process measures the host memcpy ceiling, starts a daemon (unless --socket names a
 * running one), generates every rank's inputs into shared memfds, plans their dispatch once with
 * the CPU executor (bench/oracle.h), and forks one worker process per rank. Workers inherit the
 * mappings: each registers only its own rank's memfds with the daemon, but can read every rank's
 * inputs and y, which the bitwise check of the first iteration needs. Workers write their
 * per-iteration samples into a shared anonymous mapping; the parent turns them into the table and
 * JSON lines once every worker has exited.
 *
 * The ceiling is measured in the same run, interleaved with the ops: at sync points (after the
 * verified iteration, at the start of the measured iterations, every few of them, and at the end)
 * every worker reports over its pipe and blocks reading the next; the parent copies 1 GiB while
 * they are all blocked, then releases them. On a shared machine the memory system's speed drifts
 * by a factor of two within a minute, and ops and ceiling probes sampled over the same span keep
 * the fraction meaningful.
 *
 * While an op runs every worker is blocked in epd_op_wait (poll on its socket), so the daemon's
 * executor and copy threads have the CPUs to themselves.
 *
 * CUDA mode (--backend cuda): the daemon runs the CUDA backend, and by default (--device-memory)
 * every worker allocates its inputs, y, combine outputs and dispatch outputs (client-registered,
 * of exactly the rows the plan says the rank receives: the CUDA backend's arena is host memory)
 * on device rank % --devices (--alloc: epd_device_alloc or cudaMalloc), registers them with the
 * daemon and uploads its inputs once. Iteration 0 is downloaded and checked bitwise as in host
 * mode. The op time is the reply's kernel_ns (the daemon runs every rank of the group in one
 * exec, so it is the device figure). The ceiling is the device-to-device copy (ceilings.c),
 * measured in a forked child before the workers start and in another after they are done: CUDA
 * is never initialised in the parent, which forks the workers. --flush-l2 (default for decode)
 * writes 256 MB on the GPU before every op (Fresh mode); --completion stream (--stream-order)
 * orders each op on the worker's CUDA stream: inputs marked ready on the stream,
 * epd_op_stream_wait, then an event whose completion ends the client-observed time.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "daemon_proc.h"
#include "epd.h"
#include "layout.h"
#include "mps_state.h"
#include "oracle.h"

volatile pid_t g_daemon_pid;
const struct daemon_proc *volatile g_daemon;
volatile pid_t *g_worker_pids;
volatile uint32_t g_num_workers;

/* Workers first, so that the daemon has no op to drain and exits at once; then its temporary
 * directory. Only async-signal-safe calls. */
static void on_signal(int sig)
{
        for (uint32_t i = 0; g_worker_pids && i < g_num_workers; i++)
                if (g_worker_pids[i] > 0)
                        kill(g_worker_pids[i], SIGKILL);
        if (g_daemon_pid > 0) {
                kill(g_daemon_pid, SIGTERM);
                waitpid(g_daemon_pid, NULL, 0);
                if (g_daemon) {
                        unlink(g_daemon->socket);
                        unlink(g_daemon->log);
                        rmdir(g_daemon->dir);
                }
        }
        _exit(128 + sig);
}

/* Connects once to learn the backend and its devices, and closes again before any fork. */
static int daemon_info(const char *socket, struct run_info *ri)
{
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = socket,
                                       .client_name = "epd-bench" };
        struct epd_client *c = NULL;
        struct epd_daemon_info info;
        char err[512];
        int rc = epd_client_connect(&ca, &c, err, sizeof(err));

        if (rc < 0) {
                fprintf(stderr, "epd-bench: connect to %s: %s: %s\n", socket, epd_status_name(rc),
                        err);
                return -1;
        }
        rc = epd_client_daemon_info(c, &info);
        if (rc == 0) {
                snprintf(ri->backend, sizeof(ri->backend), "%s", info.backend);
                ri->devices = info.num_devices;
                if (info.num_devices > 0)
                        snprintf(ri->device_name, sizeof(ri->device_name), "%s",
                                 info.devices[0].name);
        }
        epd_client_free(c);
        return rc < 0 ? -1 : 0;
}

/* Closes every pipe end but worker `rank`'s own two (rank -1: the parent's, which keeps the read
 * end from and the write end to every worker), so that a worker's death reaches the parent as
 * end-of-file and the parent's as end-of-file in every worker. */
static void close_foreign_pipes(const struct bench *b, int rank)
{
        for (uint32_t r = 0; r < b->R; r++) {
                if (rank < 0) {
                        close(b->to_parent[r][1]);
                        close(b->from_parent[r][0]);
                        continue;
                }
                close(b->to_parent[r][0]);
                close(b->from_parent[r][1]);
                if ((uint32_t)rank != r) {
                        close(b->to_parent[r][1]);
                        close(b->from_parent[r][0]);
                }
        }
}

/* The parent's side of the run: meets the workers at every sync point, probes the ceiling at
 * those that ask for it, and returns 0, or -1 when a worker went away (it then stops the rest). */
static int parent_loop(struct bench *b, struct ceiling *c, const pid_t *pids)
{
        for (uint32_t it = 0; it < b->total_iters; it++) {
                int probe;
                char ch = 'g';

                if (!sync_after(b, it, &probe))
                        continue;
                for (uint32_t r = 0; r < b->R; r++) {
                        if (read(b->to_parent[r][0], &ch, 1) != 1) {
                                fprintf(stderr, "epd-bench: rank %u stopped before the sync "
                                                "point after iteration %u\n", r, it);
                                goto fail;
                        }
                }
                /* Every worker is blocked in read(): the copy has the machine to itself. */
                if (probe)
                        ceiling_copy(c, 1);
                for (uint32_t r = 0; r < b->R; r++)
                        if (write(b->from_parent[r][1], &ch, 1) != 1)
                                goto fail;
        }
        return 0;
fail:
        for (uint32_t r = 0; r < b->R; r++)
                if (pids[r] > 0)
                        kill(pids[r], SIGKILL);
        return -1;
}

int main(int argc, char **argv)
{
        struct bench b;
        struct run_info ri;
        struct daemon_proc daemon;
        struct ceiling ceil;
        struct d2d_report d2d_before, d2d_after;
        pid_t *pids = NULL;
        int own_daemon = 0, failures = 0, status = 1;
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        FILE *tf;

        memset(&b, 0, sizeof(b));
        memset(&ri, 0, sizeof(ri));
        memset(&daemon, 0, sizeof(daemon));
        memset(&ceil, 0, sizeof(ceil));
        memset(&d2d_before, 0, sizeof(d2d_before));
        memset(&d2d_after, 0, sizeof(d2d_after));
        if (parse_args(argc, argv, &b.opt) < 0)
                return 2;
        tf = b.opt.json ? stderr : stdout;
        b.R = b.opt.ranks;
        b.T = b.opt.tokens ? b.opt.tokens : b.opt.wl->tokens;
        b.H = BENCH_HIDDEN;
        b.K = BENCH_TOPK;
        b.E = BENCH_EXPERTS;
        b.cpus = cpus > 0 ? (uint32_t)cpus : 1;
        b.threads = b.opt.threads ? b.opt.threads : b.cpus;
        b.scale_cols = b.opt.wl->dtype == EPD_DTYPE_FP8_E4M3 ? b.H / BENCH_SCALE_BLOCK : 0;
        b.row_bytes = (uint64_t)b.H * epd_dtype_size(b.opt.wl->dtype);
        b.num_phases = b.opt.completion == COMPLETION_BOTH ? 2 : 1;
        b.phase_stream[0] = b.opt.completion == COMPLETION_STREAM;
        b.phase_stream[1] = 1;
        b.per_phase = b.opt.warmup + b.opt.iters;
        b.total_iters = b.num_phases * b.per_phase;
        b.probe_every = (b.opt.iters + CEILING_PROBES - 1) / CEILING_PROBES;
        b.host_probes = !b.opt.cuda;
        b.worker_cuda = b.opt.cuda && (b.opt.device_memory || b.opt.flush_l2 ||
                                       b.opt.completion != COMPLETION_HOST);
        /* tiny is defined for 1 and 8 tokens; everything else below the nominal T is scaled. */
        ri.scaled = strcmp(b.opt.wl->name, "tiny") == 0 ? (b.T != 1 && b.T != 8)
                                                        : b.T != b.opt.wl->tokens;
        ri.llc = llc_bytes();
        snprintf(ri.mps, sizeof(ri.mps), "n/a");
        snprintf(ri.mps_detail, sizeof(ri.mps_detail), "host backend");
        if (BENCH_EXPERTS % b.R) {
                fprintf(stderr, "epd-bench: %u experts do not divide over %u ranks\n",
                        BENCH_EXPERTS, b.R);
                return 2;
        }
        snprintf(b.group_name, sizeof(b.group_name), "epd-bench-%d-%llu", (int)getpid(),
                 (unsigned long long)(now_ns() % 1000000007ull));
        /* The group's secret: drawn here, inherited by every worker, known to no one else. */
        if (getrandom(b.secret, sizeof(b.secret), 0) != (ssize_t)sizeof(b.secret)) {
                fprintf(stderr, "epd-bench: getrandom: %s\n", strerror(errno));
                return 1;
        }
        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);
        signal(SIGPIPE, SIG_IGN);

        if (b.opt.cuda) {
                /* The GPU first: no inputs are generated for a machine without one. */
                fprintf(stderr, "epd-bench: probing the GPU and measuring the device-to-device "
                                "copy ceiling (2 x %.0f MiB, %d copies per device)\n",
                        (double)D2D_BYTES / 1048576.0, D2D_REPS);
                if (b.opt.devices >= 2)
                        fprintf(stderr, "epd-bench: and the P2P store ceiling (%.0f MiB per "
                                        "launch, %d launches per ordered pair of the %u GPUs and "
                                        "with all of them at once)\n",
                                (double)P2P_BYTES / 1048576.0, P2P_REPS, b.opt.devices);
                if (d2d_run(b.opt.devices, &d2d_before) < 0) {
                        fprintf(stderr, "epd-bench: --backend cuda: %s\n", d2d_before.err);
                        return 1;
                }
                ri.llc = d2d_before.l2_bytes;
                snprintf(ri.device_name, sizeof(ri.device_name), "%s", d2d_before.name);
                fprintf(stderr, "epd-bench: %d GPU(s), device 0 %s, L2 %.0f MiB; copy ceiling "
                                "%.1f GB/s (median, device 0)\n",
                        d2d_before.device_count, d2d_before.name,
                        (double)d2d_before.l2_bytes / 1048576.0,
                        median_of(d2d_before.rates[0], D2D_REPS));
                if (b.opt.devices >= 2)
                        p2p_log_before(&d2d_before, b.opt.devices);
        }

        b.ranks = calloc(b.R, sizeof(*b.ranks));
        b.to_parent = calloc(b.R, sizeof(*b.to_parent));
        b.from_parent = calloc(b.R, sizeof(*b.from_parent));
        pids = calloc(b.R, sizeof(*pids));
        if (!b.ranks || !b.to_parent || !b.from_parent || !pids)
                goto out;
        for (uint32_t r = 0; r < b.R; r++)
                b.ranks[r].in.fd = b.ranks[r].y.fd = -1;
        fprintf(stderr, "epd-bench: generating inputs and the plan\n");
        if (make_inputs(&b) < 0 || build_oracle(&b) < 0 || make_y(&b) < 0)
                goto out;
        count_bytes(&b, &ri.bytes);
        if (ri.scaled && ri.llc && ri.bytes.data <= ri.llc) {
                fprintf(stderr, "epd-bench: a scaled workload must be larger than the %s "
                                "(%llu bytes), this one moves %llu: raise --tokens\n",
                        b.opt.cuda ? "GPU's L2" : "last-level cache", (unsigned long long)ri.llc,
                        (unsigned long long)ri.bytes.data);
                status = 2;
                goto out;
        }
        if (!b.opt.cuda) {
                /* The first ceiling copies, before the daemon and the workers exist. */
                fprintf(stderr, "epd-bench: measuring the host memcpy ceiling (%u threads, "
                                "2 x 1 GiB)\n", b.threads);
                if (ceiling_init(&ceil, b.threads, CEILING_BYTES,
                                 CEILING_REPS + CEILING_PROBES + 4) < 0)
                        goto out;
                ceiling_copy(&ceil, 0); /* untimed: the first pass warms up */
                for (int i = 0; i < CEILING_REPS; i++)
                        ceiling_copy(&ceil, 1);
        }

        if (b.opt.use_arena) {
                for (uint32_t r = 0; r < b.R; r++) {
                        uint64_t need = arena_need(&b, (uint64_t)b.ranks[r].rows);
                        b.arena_bytes = need > b.arena_bytes ? need : b.arena_bytes;
                }
        } else {
                b.arena_bytes = 1u << 20; /* the group insists on some arena; unused */
        }
        {
                /* The CUDA backend's workspace of one dispatch handle (common/layout.h), in the
                 * memory of the group's first device; the benchmark keeps one handle alive. */
                struct epd_ws_layout wl;
                epd_ws_layout_init(&wl, b.R, b.E, b.T, b.K);
                ri.ws_bytes = wl.total_bytes;
        }
        b.samples_bytes = (size_t)b.R * b.total_iters * 2 * sizeof(struct sample) +
                          (size_t)b.R * sizeof(*b.cx_phase_us);
        b.samples_bytes = (b.samples_bytes + 4095) / 4096 * 4096 + 4096; /* the gate's page */
        b.samples = mmap(NULL, b.samples_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
        if (b.samples == MAP_FAILED) {
                b.samples = NULL;
                goto out;
        }
        b.cx_phase_us = (double (*)[2][3])(b.samples + (size_t)b.R * b.total_iters * 2);
        b.gate = (struct cx_gate *)((uint8_t *)b.samples + b.samples_bytes - 4096);
        b.cx_one_gpu = b.opt.cuda && b.opt.execution == EPD_EXECUTION_CLIENT &&
                       b.opt.devices == 1;

        if (b.opt.socket) {
                snprintf(b.socket, sizeof(b.socket), "%s", b.opt.socket);
        } else {
                char threads[16], poll[16];
                const char *host_args[] = { "--backend", "host", "--host-threads", threads,
                                            "--log-level", "warning", NULL, NULL, NULL };
                const char *cuda_args[] = { "--backend", "cuda", "--log-level", "warning", NULL,
                                            NULL, NULL };
                snprintf(threads, sizeof(threads), "%u", b.threads);
                snprintf(poll, sizeof(poll), "%u", b.opt.poll_us);
                if (b.opt.poll_us_set) {
                        host_args[6] = cuda_args[4] = "--poll-us";
                        host_args[7] = cuda_args[5] = poll;
                }
                if (b.opt.cuda)
                        fprintf(stderr, "epd-bench: starting %s/epd --backend cuda\n", daemon_proc_bin_dir());
                else
                        fprintf(stderr, "epd-bench: starting %s/epd --backend host "
                                        "--host-threads %u\n", daemon_proc_bin_dir(), b.threads);
                /* EPD_BENCH_DAEMON: another epd binary, for comparing two daemons on one
                 * machine. */
                if (daemon_proc_start(&daemon, "epd-bench", getenv("EPD_BENCH_DAEMON"),
                                      b.opt.cuda ? cuda_args : host_args, DAEMON_START_MS) < 0)
                        goto out;
                own_daemon = 1;
                g_daemon = &daemon;
                g_daemon_pid = daemon.pid;
                snprintf(b.socket, sizeof(b.socket), "%s", daemon.socket);
        }
        if (daemon_info(b.socket, &ri) < 0)
                goto out;
        if (b.opt.cuda) {
                if (strcmp(ri.backend, "cuda") != 0) {
                        fprintf(stderr, "epd-bench: --backend cuda, but the daemon at %s runs the "
                                        "'%s' backend\n", b.socket, ri.backend);
                        goto out;
                }
                if (ri.devices < b.opt.devices) {
                        fprintf(stderr, "epd-bench: --devices %u, but the daemon has %u\n",
                                b.opt.devices, ri.devices);
                        goto out;
                }
                /* After the daemon made its context: an MPS server runs by now if MPS is on. */
                epd_bench_mps_state(ri.mps, sizeof(ri.mps), ri.mps_detail,
                                    sizeof(ri.mps_detail));
                fprintf(stderr, "epd-bench: MPS %s (%s)\n", ri.mps, ri.mps_detail);
        }

        /* Pipes after the daemon started, so that it holds none of them. */
        for (uint32_t r = 0; r < b.R; r++) {
                if (pipe2(b.to_parent[r], O_CLOEXEC) < 0 || pipe2(b.from_parent[r], O_CLOEXEC) < 0) {
                        fprintf(stderr, "epd-bench: pipe: %s\n", strerror(errno));
                        goto out;
                }
        }
        if (b.opt.cuda)
                fprintf(stderr, "epd-bench: %u workers, %u phase(s) of %u + %u iterations, %s "
                                "memory, %s\n",
                        b.R, b.num_phases, b.opt.warmup, b.opt.iters,
                        b.opt.device_memory ? "device" : "host",
                        b.opt.flush_l2 ? "L2 flushed before every op" : "no L2 flush");
        else
                fprintf(stderr, "epd-bench: %u workers, %u + %u iterations, a ceiling probe every "
                                "%u\n", b.R, b.opt.warmup, b.opt.iters, b.probe_every);
        fflush(stdout);
        fflush(stderr);
        g_worker_pids = pids;
        for (uint32_t r = 0; r < b.R; r++) {
                pids[r] = fork();
                if (pids[r] == 0) {
                        int rc;
                        signal(SIGINT, SIG_DFL);
                        signal(SIGTERM, SIG_DFL);
                        close_foreign_pipes(&b, (int)r);
                        rc = worker_run(&b, r);
                        fflush(stderr);
                        _exit(rc);
                }
                if (pids[r] < 0) {
                        fprintf(stderr, "epd-bench: fork: %s\n", strerror(errno));
                        pids[r] = 0;
                        failures++;
                        for (uint32_t q = 0; q < r; q++)
                                kill(pids[q], SIGKILL);
                        break;
                }
                g_num_workers = r + 1;
        }
        close_foreign_pipes(&b, -1);
        if (!failures && parent_loop(&b, &ceil, pids) < 0)
                failures++;
        for (uint32_t r = 0; r < g_num_workers; r++) {
                int ws;

                if (waitpid(pids[r], &ws, 0) != pids[r])
                        continue;
                pids[r] = 0;
                if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0)
                        continue;
                fprintf(stderr, "epd-bench: worker of rank %u failed (%s %d)\n", r,
                        WIFEXITED(ws) ? "exit status" : "signal",
                        WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
                failures++;
        }
        g_num_workers = 0;
        g_worker_pids = NULL;
        for (uint32_t r = 0; r < b.R; r++) {
                close(b.to_parent[r][0]);
                close(b.from_parent[r][1]);
        }
        if (failures) {
                fprintf(stderr, "epd-bench: FAILED: the run did not complete; no results\n");
                if (own_daemon)
                        daemon_proc_dump_log(&daemon);
                goto out;
        }
        if (b.opt.cuda) {
                /* The workers are gone: the second set of copies, on the same idle GPUs. */
                fprintf(stderr, "epd-bench: measuring the device-to-device copy ceiling%s "
                                "again\n", b.opt.devices >= 2 ? " and the P2P store ceiling" : "");
                if (d2d_run(b.opt.devices, &d2d_after) < 0) {
                        fprintf(stderr, "epd-bench: the copy ceiling after the run: %s\n",
                                d2d_after.err);
                        goto out;
                }
                d2d_summary(&d2d_before, &d2d_after, b.opt.devices, &ri);
                if (b.opt.devices >= 2)
                        p2p_summary(&d2d_before, &d2d_after, b.opt.devices, &ri);
        } else {
                ceiling_summary(&ceil, &ri);
        }
        b.kernel_time = 1;
        for (size_t i = 0; i < (size_t)b.R * b.total_iters * 2; i++)
                if (i / 2 % b.total_iters % b.per_phase >= b.opt.warmup &&
                    b.samples[i].kernel_ns == 0)
                        b.kernel_time = 0;
        if (b.opt.cuda && !b.kernel_time)
                fprintf(stderr, "epd-bench: WARNING: the CUDA backend reported no kernel time for "
                                "some op; every op time falls back to exec_ns\n");
        b.device_window = b.kernel_time && b.cx_one_gpu;
        for (uint32_t p = 0; p < b.num_phases; p++) {
                op_stats(&b, p, OP_DISPATCH, &ri.st[p][OP_DISPATCH]);
                op_stats(&b, p, OP_COMBINE, &ri.st[p][OP_COMBINE]);
        }
        print_table(&b, &ri, tf);
        if (b.opt.json)
                print_json(&b, &ri);
        status = 0;
out:
        if (own_daemon) {
                int rc = daemon_proc_stop(&daemon, 30000);
                g_daemon_pid = 0;
                if (rc != 0) {
                        fprintf(stderr, "epd-bench: the daemon exited with status %d\n", rc);
                        if (status == 0)
                                status = 1;
                }
        }
        ceiling_free(&ceil);
        if (b.samples)
                munmap(b.samples, b.samples_bytes);
        for (uint32_t r = 0; b.ranks && r < b.R; r++) {
                shm_free(&b.ranks[r].in);
                shm_free(&b.ranks[r].y);
        }
        oracle_free(b.oracle);
        free(b.ranks);
        free(b.to_parent);
        free(b.from_parent);
        free(pids);
        return status;
}

