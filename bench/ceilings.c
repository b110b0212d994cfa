/* ceilings.c - what the op bandwidths are measured against (docs/benchmarks.md).
 *
 * Host backend: the host memcpy ceiling, 1 GiB copied by every thread at once, before the workers
 * start and at the sync points between measured iterations (the parent runs it while every worker
 * is blocked).
 *
 * CUDA mode: the device-to-device copy ceiling (cudaMemcpyAsync of 2 GiB within each GPU, bytes
 * read + written, event-timed), measured in a forked child before the workers start and in another
 * after they are done: CUDA is never initialised in the parent, which forks the workers.
 *
 * Several GPUs (--backend cuda --devices N, N >= 2): the same two children also measure the
 * peer-to-peer store ceiling (bench/p2p_store.cu), which bounds the bytes an op moves between
 * GPUs. Every ordered pair: a kernel on the source GPU stores 16-byte vectors grid-stride into
 * 1 GiB of the target GPU's memory (peer access; a grid of resident blocks per SM x SMs), one
 * untimed launch, then P2P_REPS launches timed with events on the source. And every GPU at once,
 * GPU d storing to GPU (d + 1) % N: the aggregate is every GPU's bytes over the slowest GPU's
 * time. Bytes counted = bytes stored; each figure is the MEDIAN of the timed launches before and
 * after the workers. The ops' cross-GPU floor bytes (data.c) are set against the aggregate: a
 * run moves them at cross_gpu_fraction_of_p2p of it (report_json.c).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

#ifdef EPD_BENCH_CUDA
/* The ceiling child, for the signal handler (through g_worker_pids) while it runs. */
static volatile pid_t g_probe_pid;
#endif

/* ---- machine facts ---- */

/* The last-level cache in bytes, from sysfs (index3 is L3 on x86 and most arm64), else sysconf;
 * 0 when unknown. */
uint64_t llc_bytes(void)
{
        FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
        unsigned long long v = 0;
        char unit = 0;
        long sc;

        if (f) {
                int n = fscanf(f, "%llu%c", &v, &unit);
                fclose(f);
                if (n >= 1) {
                        if (unit == 'K')
                                v <<= 10;
                        else if (unit == 'M')
                                v <<= 20;
                        return v;
                }
        }
        sc = sysconf(_SC_LEVEL3_CACHE_SIZE);
        return sc > 0 ? (uint64_t)sc : 0;
}

/* ---- the host memcpy ceiling ---- */

static void *copy_thread(void *arg)
{
        struct copy_job *j = arg;

        memcpy(j->dst, j->src, j->bytes);
        return NULL;
}

void ceiling_free(struct ceiling *c)
{
        if (c->src && c->src != MAP_FAILED)
                munmap(c->src, c->bytes);
        if (c->dst && c->dst != MAP_FAILED)
                munmap(c->dst, c->bytes);
        free(c->tids);
        free(c->jobs);
        free(c->rates);
        memset(c, 0, sizeof(*c));
}

int ceiling_init(struct ceiling *c, unsigned threads, uint64_t bytes, unsigned max_rates)
{
        memset(c, 0, sizeof(*c));
        c->bytes = bytes;
        c->threads = threads;
        c->max_rates = max_rates;
        c->src = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        c->dst = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        c->tids = calloc(threads, sizeof(*c->tids));
        c->jobs = calloc(threads, sizeof(*c->jobs));
        c->rates = calloc(max_rates, sizeof(*c->rates));
        if (c->src == MAP_FAILED || c->dst == MAP_FAILED || !c->tids || !c->jobs || !c->rates) {
                fprintf(stderr, "epd-bench: cannot allocate 2 x %llu bytes for the memcpy ceiling\n",
                        (unsigned long long)bytes);
                ceiling_free(c);
                return -1;
        }
        /* The workers never touch these: do not copy their page tables into every fork. */
        madvise(c->src, bytes, MADV_DONTFORK);
        madvise(c->dst, bytes, MADV_DONTFORK);
        /* Real pages on both sides: an untouched source would read the shared zero page. */
        memset(c->src, 0x5A, bytes);
        memset(c->dst, 0, bytes);
        for (unsigned i = 0; i < threads; i++) {
                uint64_t lo = bytes * i / threads / 4096 * 4096;
                uint64_t hi = i + 1 == threads ? bytes : bytes * (i + 1) / threads / 4096 * 4096;
                c->jobs[i] = (struct copy_job){ c->dst + lo, c->src + lo, hi - lo };
        }
        return 0;
}

/* One copy of the whole buffer by every thread at once, each its own contiguous slice; records
 * and returns the rate in GB/s, bytes read plus bytes written, 1e9 B/s. */
double ceiling_copy(struct ceiling *c, int record)
{
        uint64_t t0 = now_ns(), t1;
        double rate;

        for (unsigned i = 0; i < c->threads; i++)
                pthread_create(&c->tids[i], NULL, copy_thread, &c->jobs[i]);
        for (unsigned i = 0; i < c->threads; i++)
                pthread_join(c->tids[i], NULL);
        t1 = now_ns();
        rate = 2.0 * (double)c->bytes / (double)(t1 - t0);
        if (record && c->num_rates < c->max_rates)
                c->rates[c->num_rates++] = rate;
        return rate;
}

/* Summarises the ceiling: the first CEILING_REPS copies ran before the workers started, the
 * rest interleaved with the ops. */
void ceiling_summary(const struct ceiling *c, struct run_info *ri)
{
        unsigned np = c->num_rates > CEILING_REPS ? c->num_rates - CEILING_REPS : 0;
        const double *probes = c->rates + CEILING_REPS;

        ri->ceiling_initial = median_of(c->rates, c->num_rates < CEILING_REPS ? c->num_rates
                                                                              : CEILING_REPS);
        ri->num_probes = np;
        ri->ceiling = np ? median_of(probes, np) : ri->ceiling_initial;
        ri->ceiling_min = ri->ceiling_best = c->num_rates ? c->rates[0] : 0;
        for (unsigned i = 0; i < c->num_rates; i++) {
                if (c->rates[i] > ri->ceiling_best)
                        ri->ceiling_best = c->rates[i];
                if (c->rates[i] < ri->ceiling_min)
                        ri->ceiling_min = c->rates[i];
        }
}

/* ---- CUDA mode: the device-to-device copy and P2P store ceilings, in a forked child ---- */

#ifdef EPD_BENCH_CUDA
/* In the child, after the copy ceiling (its buffers are freed): the P2P store ceiling of every
 * ordered pair, each alone, then every GPU storing to the next at once. */
static void p2p_measure(struct d2d_report *rep, uint32_t num_devices)
{
        double gbps, dev_gbps[D2D_MAX_DEVICES];

        rep->p2p_tried = 1;
        for (uint32_t s = 0; s < num_devices; s++)
                for (uint32_t d = 0; d < num_devices; d++)
                        if (s != d)
                                rep->p2p_status[s][d] = epd_bench_p2p_store(
                                        (int)s, (int)d, P2P_BYTES, P2P_REPS, rep->p2p_rates[s][d],
                                        &gbps, rep->p2p_err[s][d], sizeof(rep->p2p_err[s][d]));
        /* ring_dev_rates rows are P2P_REPS long: device d's rates at [d * P2P_REPS + i]. */
        rep->ring_status = epd_bench_p2p_store_ring((int)num_devices, P2P_BYTES, P2P_REPS,
                                                    rep->ring_rates, &rep->ring_dev_rates[0][0],
                                                    &gbps, dev_gbps, &rep->ring_serialized,
                                                    rep->ring_err, sizeof(rep->ring_err));
}

/* In the child: on each of the first num_devices GPUs, two D2D_BYTES buffers, one untimed copy,
 * then D2D_REPS copies timed with events on a stream of their own. */
static int d2d_measure(struct d2d_report *rep, uint32_t num_devices)
{
        char *err = rep->err;
        size_t len = sizeof(rep->err);
        struct cudaDeviceProp prop;
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);

        if (e != cudaSuccess || n == 0) {
                snprintf(err, len, "no usable GPU (cudaGetDeviceCount: %s)",
                         e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
                return -1;
        }
        rep->device_count = n;
        CU_TRY(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
        snprintf(rep->name, sizeof(rep->name), "%.127s", prop.name);
        rep->l2_bytes = (uint64_t)prop.l2CacheSize;
        if ((int)num_devices > n) {
                snprintf(err, len, "--devices %u, but only %d GPU(s) are visible", num_devices, n);
                return -1;
        }
        for (uint32_t d = 0; d < num_devices; d++) {
                void *src = NULL, *dst = NULL;
                cudaStream_t st;
                cudaEvent_t e0, e1;

                CU_TRY(cudaSetDevice((int)d), "cudaSetDevice");
                CU_TRY(cudaMalloc(&src, D2D_BYTES), "cudaMalloc of the copy ceiling's source");
                CU_TRY(cudaMalloc(&dst, D2D_BYTES), "cudaMalloc of the copy ceiling's target");
                CU_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
                CU_TRY(cudaEventCreate(&e0), "cudaEventCreate");
                CU_TRY(cudaEventCreate(&e1), "cudaEventCreate");
                /* Real pages, not zeros, on both sides. */
                CU_TRY(cudaMemsetAsync(src, 0x5A, D2D_BYTES, st), "cudaMemset");
                CU_TRY(cudaMemsetAsync(dst, 0xA5, D2D_BYTES, st), "cudaMemset");
                CU_TRY(cudaMemcpyAsync(dst, src, D2D_BYTES, cudaMemcpyDeviceToDevice, st),
                       "cudaMemcpyAsync");
                CU_TRY(cudaStreamSynchronize(st), "cudaStreamSynchronize");
                for (int i = 0; i < D2D_REPS; i++) {
                        float ms = 0;
                        CU_TRY(cudaEventRecord(e0, st), "cudaEventRecord");
                        CU_TRY(cudaMemcpyAsync(dst, src, D2D_BYTES, cudaMemcpyDeviceToDevice, st),
                               "cudaMemcpyAsync");
                        CU_TRY(cudaEventRecord(e1, st), "cudaEventRecord");
                        CU_TRY(cudaEventSynchronize(e1), "cudaEventSynchronize");
                        CU_TRY(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
                        rep->rates[d][i] = ms > 0 ? 2.0 * (double)D2D_BYTES / (ms * 1e6) : 0;
                }
                cudaEventDestroy(e0);
                cudaEventDestroy(e1);
                cudaStreamDestroy(st);
                cudaFree(src);
                cudaFree(dst);
                rep->num_devices = d + 1;
        }
        if (num_devices >= 2)
                p2p_measure(rep, num_devices);
        return 0;
}
#endif

/* Runs d2d_measure in a forked child (CUDA stays out of this process, which forks the
 * workers). Returns 0, or -1 with the reason in rep->err. */
int d2d_run(uint32_t num_devices, struct d2d_report *out)
{
        memset(out, 0, sizeof(*out));
#ifndef EPD_BENCH_CUDA
        (void)num_devices;
        snprintf(out->err, sizeof(out->err), "epd-bench was built without CUDA");
        return -1;
#else
        struct d2d_report *rep;
        pid_t pid;
        int ws;

        rep = mmap(NULL, sizeof(*rep), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (rep == MAP_FAILED) {
                snprintf(out->err, sizeof(out->err), "mmap: %s", strerror(errno));
                return -1;
        }
        memset(rep, 0, sizeof(*rep));
        rep->status = -1;
        snprintf(rep->err, sizeof(rep->err), "the measuring process exited early");
        fflush(stdout);
        fflush(stderr);
        pid = fork();
        if (pid == 0) {
                signal(SIGINT, SIG_DFL);
                signal(SIGTERM, SIG_DFL);
                rep->status = d2d_measure(rep, num_devices);
                _exit(rep->status == 0 ? 0 : 1);
        }
        if (pid < 0) {
                snprintf(out->err, sizeof(out->err), "fork: %s", strerror(errno));
                munmap(rep, sizeof(*rep));
                return -1;
        }
        g_worker_pids = &g_probe_pid;
        g_probe_pid = pid;
        g_num_workers = 1;
        if (waitpid(pid, &ws, 0) != pid)
                ws = -1;
        g_num_workers = 0;
        g_worker_pids = NULL;
        g_probe_pid = 0;
        *out = *rep;
        munmap(rep, sizeof(*rep));
        if (out->status == 0 && !(WIFEXITED(ws) && WEXITSTATUS(ws) == 0)) {
                out->status = -1;
                snprintf(out->err, sizeof(out->err), "the measuring process failed (status %d)",
                         ws);
        }
        return out->status == 0 ? 0 : -1;
#endif
}

/* The ceiling from the copies before and after the workers: per device the median of all its
 * copies, the slowest device's median the ceiling (ranks on one GPU are bounded by it). */
void d2d_summary(const struct d2d_report *before, const struct d2d_report *after,
                        uint32_t num_devices, struct run_info *ri)
{
        double all[2 * D2D_REPS], lo = 0, hi = 0;
        double ceil_all = 0, ceil_before = 0, ceil_after = 0;
        int first = 1;

        ri->num_probes = 0;
        for (uint32_t d = 0; d < num_devices; d++) {
                unsigned na = 0;
                double m_all, m_before, m_after;

                for (int i = 0; i < D2D_REPS; i++) {
                        all[na++] = before->rates[d][i];
                        all[na++] = after->rates[d][i];
                }
                m_all = median_of(all, na);
                m_before = median_of(before->rates[d], D2D_REPS);
                m_after = median_of(after->rates[d], D2D_REPS);
                for (unsigned i = 0; i < na; i++) {
                        if (first || all[i] < lo)
                                lo = all[i];
                        if (first || all[i] > hi)
                                hi = all[i];
                        first = 0;
                }
                if (d == 0 || m_all < ceil_all)
                        ceil_all = m_all;
                if (d == 0 || m_before < ceil_before)
                        ceil_before = m_before;
                if (d == 0 || m_after < ceil_after)
                        ceil_after = m_after;
                ri->num_probes += na;
        }
        ri->ceiling = ceil_all;
        ri->ceiling_initial = ceil_before;
        ri->d2d_after = ceil_after;
        ri->ceiling_min = lo;
        ri->ceiling_best = hi;
}

/* One P2P figure from the two sets of timed launches; a set that failed (status != 0, or never
 * tried) contributes nothing and leaves its reason. */
static void p2p_figure_of(struct p2p_figure *f, int st_before, const double *before,
                          const char *why_before, int st_after, const double *after,
                          const char *why_after)
{
        double all[2 * P2P_REPS];
        unsigned n = 0;

        memset(f, 0, sizeof(*f));
        f->before_ok = st_before == 0;
        f->after_ok = st_after == 0;
        if (f->before_ok) {
                f->before = median_of(before, P2P_REPS);
                memcpy(all + n, before, P2P_REPS * sizeof(double));
                n += P2P_REPS;
        }
        if (f->after_ok) {
                f->after = median_of(after, P2P_REPS);
                memcpy(all + n, after, P2P_REPS * sizeof(double));
                n += P2P_REPS;
        }
        f->ok = n > 0;
        f->gbps = median_of(all, n);
        if (!f->before_ok)
                snprintf(f->why, sizeof(f->why), "%s", why_before);
        else if (!f->after_ok)
                snprintf(f->why, sizeof(f->why), "%s", why_after);
}

/* The P2P store ceiling of the run (--devices >= 2) from the children before and after the
 * workers. */
void p2p_summary(const struct d2d_report *before, const struct d2d_report *after,
                        uint32_t num_devices, struct run_info *ri)
{
        static const char *untried = "not measured (the measuring process stopped before)";
        int sb, sa;

        ri->p2p = 1;
        for (uint32_t s = 0; s < num_devices; s++) {
                for (uint32_t d = 0; d < num_devices; d++) {
                        if (s == d)
                                continue;
                        sb = before->p2p_tried ? before->p2p_status[s][d] : -1;
                        sa = after->p2p_tried ? after->p2p_status[s][d] : -1;
                        p2p_figure_of(&ri->pair[s][d], sb, before->p2p_rates[s][d],
                                      before->p2p_tried ? before->p2p_err[s][d] : untried, sa,
                                      after->p2p_rates[s][d],
                                      after->p2p_tried ? after->p2p_err[s][d] : untried);
                }
        }
        sb = before->p2p_tried ? before->ring_status : -1;
        sa = after->p2p_tried ? after->ring_status : -1;
        p2p_figure_of(&ri->ring, sb, before->ring_rates,
                      before->p2p_tried ? before->ring_err : untried, sa, after->ring_rates,
                      after->p2p_tried ? after->ring_err : untried);
        ri->ring_serialized = (sb == 0 ? before->ring_serialized : 0) +
                              (sa == 0 ? after->ring_serialized : 0);
        ri->ring_rounds = (sb == 0 ? P2P_REPS : 0) + (sa == 0 ? P2P_REPS : 0);
        for (uint32_t d = 0; d < num_devices; d++) {
                double all[2 * P2P_REPS];
                unsigned n = 0;

                if (sb == 0) {
                        memcpy(all + n, before->ring_dev_rates[d], P2P_REPS * sizeof(double));
                        n += P2P_REPS;
                }
                if (sa == 0) {
                        memcpy(all + n, after->ring_dev_rates[d], P2P_REPS * sizeof(double));
                        n += P2P_REPS;
                }
                ri->ring_dev[d] = median_of(all, n);
        }
}

/* Progress on stderr after the first child: the P2P figures before the workers, and at once
 * which pairs cannot be measured. */
void p2p_log_before(const struct d2d_report *rep, uint32_t num_devices)
{
        if (!rep->p2p_tried) {
                fprintf(stderr, "epd-bench: P2P store ceiling: not measured\n");
                return;
        }
        for (uint32_t s = 0; s < num_devices; s++) {
                for (uint32_t d = 0; d < num_devices; d++) {
                        if (s == d)
                                continue;
                        if (rep->p2p_status[s][d] == 0)
                                fprintf(stderr, "epd-bench: P2P store GPU %u -> GPU %u: %.1f GB/s "
                                                "(median of %d)\n",
                                        s, d, median_of(rep->p2p_rates[s][d], P2P_REPS),
                                        P2P_REPS);
                        else
                                fprintf(stderr, "epd-bench: P2P store GPU %u -> GPU %u: NOT "
                                                "MEASURED: %s\n", s, d, rep->p2p_err[s][d]);
                }
        }
        if (rep->ring_status == 0)
                fprintf(stderr, "epd-bench: P2P store, every GPU to the next at once: %.1f GB/s "
                                "aggregate (median of %d)%s\n",
                        median_of(rep->ring_rates, P2P_REPS), P2P_REPS,
                        rep->ring_serialized ? "; WARNING: some rounds did not overlap" : "");
        else
                fprintf(stderr, "epd-bench: P2P store, every GPU to the next at once: NOT "
                                "MEASURED: %s\n", rep->ring_err);
}
