/* epd_bench.c - epd-bench: dispatch and combine bandwidth and latency of epd, driven through real
 * client processes and reported as docs/BENCHMARKS.md defines.
 *
 * The parent process measures the host memcpy ceiling, starts a daemon (unless --socket names a
 * running one), generates every rank's inputs into shared memfds, builds the independent
 * reference once, and forks one worker process per rank. Workers inherit the mappings: each
 * registers only its own rank's memfds with the daemon, but can read every rank's inputs and y,
 * which the bitwise check of the first iteration needs. Workers write their per-iteration samples
 * into a shared anonymous mapping; the parent turns them into the table and JSON lines once every
 * worker has exited.
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
 * of exactly the rows the reference says the rank receives: the CUDA backend's arena is host
 * memory) with cudaMalloc on device rank % --devices, registers them with
 * epd_region_register_device and uploads its inputs once. Iteration 0 is downloaded and checked
 * bitwise as in host mode. The op time is the reply's kernel_ns (the daemon runs every rank of
 * the group in one exec, so it is the device figure). The ceiling is the device-to-device copy
 * (cudaMemcpyAsync of 2 GiB within the GPU, bytes read + written, event-timed), measured in a
 * forked child before the workers start and in another after they are done: CUDA is never
 * initialised in the parent, which forks the workers. --flush-l2 (default for decode) writes
 * 256 MB on the GPU before every op (Fresh mode); --completion stream (--stream-order) orders
 * each op on the worker's CUDA stream: inputs marked ready on the stream, epd_op_stream_wait,
 * then an event whose completion ends the client-observed time.
 *
 * Several GPUs (--backend cuda --devices N, N >= 2): the same two children also measure the
 * peer-to-peer store ceiling of BENCHMARKS.md (bench/p2p_store.cu), which bounds the bytes an op
 * moves between GPUs. Every ordered pair: a kernel on the source GPU stores 16-byte vectors
 * grid-stride into 1 GiB of the target GPU's memory (peer access; a grid of resident blocks per
 * SM x SMs), one untimed launch, then P2P_REPS launches timed with events on the source. And
 * every GPU at once, GPU d storing to GPU (d + 1) % N: the aggregate is every GPU's bytes over
 * the slowest GPU's time. Bytes counted = bytes stored; each figure is the MEDIAN of the timed
 * launches before and after the workers. The ops' cross-GPU floor bytes are the part of the
 * floor that must cross a link: dispatch, every received row whose source rank is on another
 * GPU than its destination rank, at the floor's row bytes (x + scales + metadata); combine, the
 * bf16 y row (2 x H bytes) of every such row, which goes back from the rank that received it to
 * the token's source. Issue 5's target "dispatch and combine move their cross-GPU floor bytes at
 * >= 85% of the measured P2P store bandwidth" reads cross_gpu_fraction_of_p2p >= 0.85. JSON
 * fields of this part, each null on the host backend and with --devices 1:
 *   p2p_store_pairs            [{src, dst, gbps, before_gbps, after_gbps, error}] per ordered
 *                              pair of GPUs: GB/s stored (median of the launches before and
 *                              after the workers, and of each set); gbps null and error set when
 *                              the pair could not be measured (no peer access, a CUDA error)
 *   p2p_store_concurrent_gbps  aggregate GB/s of every GPU storing to the next at once (median)
 *   p2p_store_concurrent_device_gbps  [N] each GPU's own GB/s in that measurement
 *   p2p_store_bytes            bytes one launch stores (per GPU)
 *   cross_gpu_floor_bytes      the op's cross-GPU floor bytes (above)
 *   cross_gpu_floor_gbps       cross_gpu_floor_bytes / the op's kernel time p50 (the time the
 *                              other GB/s figures use)
 *   cross_gpu_fraction_of_p2p  cross_gpu_floor_gbps / p2p_store_concurrent_gbps
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef EPD_BENCH_CUDA
#include <cuda_runtime_api.h>

/* bench/p2p_store.cu (its comments say what they measure; keep these declarations in step). */
#define EPD_BENCH_P2P_NO_PEER 1 /* the pair cannot reach each other's memory: skipped */
int epd_bench_p2p_store(int src_dev, int dst_dev, uint64_t bytes, int reps, double *rates,
                        double *gbps, char *err, size_t err_len);
int epd_bench_p2p_store_ring(int num_devices, uint64_t bytes, int reps, double *rates,
                             double *device_rates, double *gbps, double *device_gbps,
                             int *serialized, char *err, size_t err_len);
#endif

#include "epd.h"
#include "harness.h"
#include "layout.h"
#include "mps_state.h"
#include "reference.h"
#include "testdata.h"
#include "util.h"

/* The BENCHMARKS.md model shape, common to every workload. */
#define BENCH_HIDDEN 7168u
#define BENCH_TOPK 8u
#define BENCH_EXPERTS 256u
#define BENCH_SCALE_BLOCK 128u

/* The memcpy ceiling: BENCHMARKS.md asks for buffers of at least 1 GiB. CEILING_REPS copies
 * before the workers start, then about CEILING_PROBES more spread over the measured iterations. */
#define CEILING_BYTES (1ull << 30)
#define CEILING_REPS 5
#define CEILING_PROBES 10

#define OP_DISPATCH 0
#define OP_COMBINE 1

/* CUDA mode: the L2 flush of Fresh mode, and the device-to-device copy ceiling (2 GiB copied,
 * D2D_REPS timed copies per device in each of the two measuring children). */
#define FLUSH_BYTES (256ull << 20)
#define D2D_BYTES (2ull << 30)
#define D2D_REPS 10
#define D2D_MAX_DEVICES 16
/* CUDA mode with --devices >= 2: the peer-to-peer store ceiling (bench/p2p_store.cu), 1 GiB
 * stored per launch, P2P_REPS timed launches per pair and per all-at-once round, in each of the
 * two measuring children. */
#define P2P_BYTES (1ull << 30)
#define P2P_REPS 10
#define DAEMON_START_MS 60000   /* a CUDA daemon initialises every GPU before it listens */
#define SPIN_TIMEOUT_NS (180ull * 1000000000ull)

/* How a worker learns that an op completed (BENCHMARKS.md's client-observed time ends there). */
enum completion {
        COMPLETION_HOST = 0,    /* epd_op_wait: the reply reached the client */
        COMPLETION_STREAM = 1,  /* a CUDA event recorded after epd_op_stream_wait completed */
        COMPLETION_BOTH = 2,    /* a host-wait phase, then a stream-ordered phase */
};
#define MAX_PHASES 2

struct workload_spec {
        const char *name;
        uint32_t tokens;        /* nominal T */
        enum epd_dtype dtype;
        int descending;         /* rank r sends T - r tokens */
};

static const struct workload_spec workloads[] = {
        { "prefill", 4096, EPD_DTYPE_FP8_E4M3, 1 },
        { "prefill-bf16", 4096, EPD_DTYPE_BF16, 1 },
        { "decode", 128, EPD_DTYPE_FP8_E4M3, 0 },
        { "tiny", 8, EPD_DTYPE_BF16, 0 },
};

struct options {
        uint32_t poll_us;       /* --poll-us: the started daemon's poll_us (poll_us_set) */
        int poll_us_set;
        const struct workload_spec *wl;
        uint32_t ranks;
        uint32_t iters;
        uint32_t warmup;
        uint32_t tokens;        /* 0: the workload's nominal T */
        uint32_t threads;       /* 0: CPUs */
        uint64_t seed;
        enum epd_layout layout;
        int use_arena;
        int outputs_given;      /* --outputs was on the command line */
        int json;
        const char *socket;     /* NULL: start our own daemon */
        int cuda;               /* --backend cuda */
        int device_memory;      /* -1: default (on with --backend cuda) */
        int cumem;              /* --alloc cumem (default with device memory, -1 until then):
                                 * worker memory from epd_device_alloc; 0: cudaMalloc */
        uint32_t devices;       /* GPUs the ranks spread over: rank r on device r % devices */
        int flush_l2;           /* -1: default (on for decode with --backend cuda) */
        enum completion completion;
        uint32_t extra_regions; /* --extra-regions: unused regions each worker holds */
};

/* A MAP_SHARED memfd made before fork, so that every worker sees it at the same address. */
struct shm_buf {
        int fd;
        uint8_t *ptr;
        uint64_t bytes;
};

struct rank_data {
        uint32_t num_tokens;
        struct shm_buf in;      /* x, scales, topk_idx (int64), weights, 64-byte aligned */
        uint8_t *x;
        float *scales;
        int64_t *topk;
        float *weights;
        struct shm_buf y;       /* bf16 [rows, H]: the combine input of this rank */
        int64_t rows;           /* rows this rank receives in the dispatch layout */
};

/* One op as one worker saw it. */
struct sample {
        uint64_t submit_ns;     /* CLOCK_MONOTONIC just before submit */
        uint64_t done_ns;       /* just after epd_op_wait returned */
        uint64_t exec_ns;       /* the backend's execution time of the whole op */
        uint64_t kernel_ns;     /* GPU time of the op's kernels (cuda backend), else 0 */
        uint64_t queue_ns;      /* from this rank's submission to launch, per the daemon */
        struct epd_op_timeline tl; /* where the time went (epd_op_timeline) */
};

struct bench {
        struct options opt;
        uint32_t R, T, H, K, E, scale_cols, cpus, threads;
        uint64_t row_bytes;     /* bytes of one x row */
        struct rank_data *ranks;
        struct ref_dispatch *ref;
        char socket[PATH_MAX];
        char group_name[64];
        uint64_t arena_bytes;
        uint32_t total_iters;
        uint32_t probe_every;   /* measured iterations between ceiling probes */
        /* The op time of BENCHMARKS.md: the GPU kernel time when the backend reports it for
         * every measured op, else (host backend) the backend's execution time. */
        int kernel_time;
        /* Phases of the run, each warmup + iters iterations: phase_stream[p] says whether its
         * ops complete through the stream (COMPLETION_STREAM) or the host. Iteration 0 of
         * phase 0 is the verified one. */
        uint32_t num_phases, per_phase;
        int phase_stream[MAX_PHASES];
        int host_probes;        /* the parent probes the host memcpy ceiling at sync points */
        int worker_cuda;        /* workers initialise CUDA (device memory, flush or stream) */
        struct sample *samples; /* MAP_SHARED with the workers: [R][total_iters][2] */
        size_t samples_bytes;
        int (*to_parent)[2];    /* [R] pipes: a worker says it reached a sync point */
        int (*from_parent)[2];  /* [R] pipes: the parent lets it go on */
};

/* For the signal handler: what to take down if the user interrupts the run. */
static volatile pid_t g_daemon_pid;
static const struct h_daemon *volatile g_daemon;
static volatile pid_t *g_worker_pids;
static volatile uint32_t g_num_workers;
#ifdef EPD_BENCH_CUDA
static volatile pid_t g_probe_pid;      /* the ceiling child */
#endif

static uint64_t now_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t align64(uint64_t v)
{
        return (v + 63) / 64 * 64;
}

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

/* ---- machine facts ---- */

/* The last-level cache in bytes, from sysfs (index3 is L3 on x86 and most arm64), else sysconf;
 * 0 when unknown. */
static uint64_t llc_bytes(void)
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

struct copy_job {
        uint8_t *dst;
        const uint8_t *src;
        size_t bytes;
};

static void *copy_thread(void *arg)
{
        struct copy_job *j = arg;

        memcpy(j->dst, j->src, j->bytes);
        return NULL;
}

/* Two 1 GiB buffers and the threads' slices of them, kept for the whole run. */
struct ceiling {
        uint8_t *src, *dst;
        uint64_t bytes;
        unsigned threads;
        pthread_t *tids;
        struct copy_job *jobs;
        double *rates;          /* every timed copy, in GB/s */
        unsigned num_rates, max_rates;
};

static void ceiling_free(struct ceiling *c)
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

static int ceiling_init(struct ceiling *c, unsigned threads, uint64_t bytes, unsigned max_rates)
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
static double ceiling_copy(struct ceiling *c, int record)
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

/* ---- inputs, reference, sizes ---- */

static int shm_alloc(struct shm_buf *b, uint64_t bytes)
{
        void *p;

        /* Never zero bytes: a region needs a size, and ranks may receive no rows. */
        b->bytes = bytes < 4096 ? 4096 : bytes;
        if (epd_memfd_alloc(b->bytes, &b->fd, &p) < 0) {
                fprintf(stderr, "epd-bench: cannot create a %llu-byte memfd: %s\n",
                        (unsigned long long)b->bytes, strerror(errno));
                b->fd = -1;
                return -1;
        }
        b->ptr = p;
        return 0;
}

static void shm_free(struct shm_buf *b)
{
        if (b->fd < 0 || !b->ptr)
                return;
        munmap(b->ptr, b->bytes);
        close(b->fd);
        b->fd = -1;
        b->ptr = NULL;
}

static uint32_t tokens_of(const struct bench *b, uint32_t r)
{
        if (!b->opt.wl->descending)
                return b->T;
        return b->T > r ? b->T - r : 0;
}

/* Generates every rank's inputs (seeded by the run seed and the rank, BENCHMARKS.md routing:
 * uniform random top-k without repeats) into shared memfds. Payloads are finite normals: a
 * benchmark has no business timing denormal arithmetic. */
static int make_inputs(struct bench *b)
{
        for (uint32_t r = 0; r < b->R; r++) {
                struct rank_data *rd = &b->ranks[r];
                uint32_t n = tokens_of(b, r);
                uint64_t x_bytes = align64((uint64_t)n * b->row_bytes);
                uint64_t s_bytes = align64((uint64_t)n * b->scale_cols * 4);
                uint64_t k_bytes = align64((uint64_t)n * b->K * 8);
                uint64_t w_bytes = align64((uint64_t)n * b->K * 4);
                struct td_rng rng;

                rd->num_tokens = n;
                if (shm_alloc(&rd->in, x_bytes + s_bytes + k_bytes + w_bytes) < 0)
                        return -1;
                rd->x = rd->in.ptr;
                rd->scales = (float *)(rd->in.ptr + x_bytes);
                rd->topk = (int64_t *)(rd->in.ptr + x_bytes + s_bytes);
                rd->weights = (float *)(rd->in.ptr + x_bytes + s_bytes + k_bytes);
                td_rng_seed(&rng, td_mix_seed(b->opt.seed, r));
                if (b->opt.wl->dtype == EPD_DTYPE_BF16)
                        td_fill_bf16(&rng, rd->x, n, b->H, 0, 0.0);
                else
                        td_fill_bytes(&rng, rd->x, n, b->row_bytes, 0);
                if (b->scale_cols)
                        td_fill_f32(&rng, rd->scales, n, b->scale_cols, 0, 0.5f, 2.0f);
                struct td_routing_args ra = {
                        .world_size = b->R, .num_experts = b->E, .num_tokens = n,
                        .num_topk = b->K, .mode = TD_ROUTING_UNIFORM, .dtype = EPD_DTYPE_INT64,
                };
                td_gen_topk(&rng, &ra, rd->topk);
                td_fill_f32(&rng, rd->weights, n, b->K, 0, 0.0f, 1.0f);
        }
        return 0;
}

static int build_reference(struct bench *b)
{
        struct ref_params p = {
                .world_size = b->R, .num_experts = b->E, .hidden = b->H, .max_tokens = b->T,
                .num_topk = b->K, .dtype = b->opt.wl->dtype, .scale_block = BENCH_SCALE_BLOCK,
                .topk_dtype = EPD_DTYPE_INT64, .layout = b->opt.layout, .expert_alignment = 1,
                .zero_padding = 0, .has_weights = 1,
        };
        struct ref_src *src = calloc(b->R, sizeof(*src));
        char err[512];
        int rc;

        if (!src)
                return -1;
        for (uint32_t r = 0; r < b->R; r++) {
                const struct rank_data *rd = &b->ranks[r];
                src[r] = (struct ref_src){
                        .num_tokens = rd->num_tokens,
                        .x = { rd->x, 0 },
                        .scales = { b->scale_cols ? rd->scales : NULL, 0 },
                        .topk_idx = { rd->topk, 0 },
                        .weights = { rd->weights, 0 },
                };
        }
        rc = ref_dispatch_new(&p, src, &b->ref, err, sizeof(err));
        free(src);
        if (rc < 0) {
                fprintf(stderr, "epd-bench: reference: %s\n", err);
                return -1;
        }
        for (uint32_t r = 0; r < b->R; r++)
                b->ranks[r].rows = b->ref->dst[r].rows;
        return 0;
}

/* The y buffers (combine inputs). For bf16 the worker copies its received rows in after the
 * first dispatch, so y is the identity expert; fp8 rows are not bf16, so y is seeded bf16. */
static int make_y(struct bench *b)
{
        for (uint32_t r = 0; r < b->R; r++) {
                struct rank_data *rd = &b->ranks[r];

                if (shm_alloc(&rd->y, (uint64_t)rd->rows * b->H * 2) < 0)
                        return -1;
                if (b->opt.wl->dtype != EPD_DTYPE_BF16) {
                        struct td_rng rng;
                        td_rng_seed(&rng, td_mix_seed(b->opt.seed, 1000000 + r));
                        td_fill_bf16(&rng, rd->y.ptr, (uint64_t)rd->rows, b->H, 0, 0.0);
                }
        }
        return 0;
}

/* Bytes of the metadata a received row carries, BENCHMARKS.md's logical definition: NON_EXPAND
 * rows carry recv_topk_idx (counted as int64) and recv_topk_weights (fp32) for all K_op
 * positions. EXPAND rows carry one weight (fp32) and one top-k slot, counted as int64 like
 * topk_idx. */
static uint64_t meta_bytes(const struct bench *b)
{
        return b->opt.layout == EPD_LAYOUT_EXPAND ? 8 + 4 : (uint64_t)b->K * (8 + 4);
}

/* fp32 weights a row carries back in combine: [K_op] per NON_EXPAND row, one per EXPAND row. */
static uint64_t combine_weight_bytes(const struct bench *b)
{
        return b->opt.layout == EPD_LAYOUT_EXPAND ? 4 : (uint64_t)b->K * 4;
}

struct byte_counts {
        uint64_t rows;          /* received rows, every destination, own tokens included */
        uint64_t tokens;        /* source tokens, every rank */
        uint64_t logical[2];    /* [OP_DISPATCH], [OP_COMBINE] */
        uint64_t floor[2];
        /* Each distinct byte read or written once: dispatch reads a source token once however
         * many destinations it goes to, which the floor counts once per destination (a host
         * backend copies a token to all its destinations from cache, so its floor fraction can
         * pass 100%). For combine it equals the floor. */
        uint64_t unique[2];
        uint64_t data;          /* = unique[OP_DISPATCH], compared with the LLC */
        /* CUDA mode with --devices >= 2 (cross_valid): the part of the floor that crosses
         * between GPUs (rank r on device r % devices). cross_rows: received rows whose source
         * rank is on another GPU than their destination rank. Dispatch writes each of them over
         * a link once at the floor's row bytes (x + scales + metadata); combine brings each one's
         * bf16 y row (2 x H) back from the rank that received it to the token's source rank. */
        int cross_valid;
        uint64_t cross_rows;
        uint64_t cross[2];
};

static void count_bytes(const struct bench *b, struct byte_counts *c)
{
        uint64_t row = b->row_bytes + (uint64_t)b->scale_cols * 4 + meta_bytes(b);

        memset(c, 0, sizeof(*c));
        for (uint32_t r = 0; r < b->R; r++) {
                c->rows += (uint64_t)b->ranks[r].rows;
                c->tokens += b->ranks[r].num_tokens;
        }
        c->logical[OP_DISPATCH] = c->rows * row;
        /* Every received row is read once at its source and written once at its destination. */
        c->floor[OP_DISPATCH] = 2 * c->rows * row;
        c->logical[OP_COMBINE] = c->rows * ((uint64_t)b->H * 2 + combine_weight_bytes(b));
        /* Every contributed y row read once; every combined row (and its combined_topk_weights,
         * which the benchmark requests) written once. */
        c->floor[OP_COMBINE] = c->rows * (uint64_t)b->H * 2 +
                               c->tokens * ((uint64_t)b->H * 2 + (uint64_t)b->K * 4);
        c->unique[OP_DISPATCH] = c->tokens * (b->row_bytes + (uint64_t)b->scale_cols * 4 +
                                              (uint64_t)b->K * 12) +
                                 c->rows * row;
        c->unique[OP_COMBINE] = c->floor[OP_COMBINE];
        c->data = c->unique[OP_DISPATCH];
        if (!b->opt.cuda || b->opt.devices < 2)
                return;
        /* The reference's own row lists say where each received row came from: the routing the
         * first iteration is verified against, so these are the rows the ops move. */
        c->cross_valid = 1;
        for (uint32_t d = 0; d < b->R; d++) {
                const struct ref_dst *rd = &b->ref->dst[d];

                for (int64_t i = 0; i < rd->rows; i++)
                        if (rd->row_kind[i] == REF_ROW_DATA && rd->row_src[i] >= 0 &&
                            (uint32_t)rd->row_src[i] % b->opt.devices != d % b->opt.devices)
                                c->cross_rows++;
        }
        c->cross[OP_DISPATCH] = c->cross_rows * row;
        c->cross[OP_COMBINE] = c->cross_rows * (uint64_t)b->H * 2;
}

/* The arena a rank needs for its outputs: every field rounded up as the daemon places them. */
static uint64_t arena_need(const struct bench *b, uint64_t rows)
{
        int expand = b->opt.layout == EPD_LAYOUT_EXPAND;
        uint64_t f[6] = {
                rows * b->row_bytes,
                rows * b->scale_cols * 4,
                expand ? 0 : rows * b->K * 8,
                rows * (expand ? 1 : b->K) * 4,
                rows * 8,
                expand ? rows * 4 : 0,
        };
        uint64_t total = 0;

        for (int i = 0; i < 6; i++)
                total += (f[i] + 4095) / 4096 * 4096;
        return total + (1u << 20);
}

/* ---- the worker ---- */

#define WFAIL(...)                                                                      \
        do {                                                                            \
                fprintf(stderr, "epd-bench rank %u (seed %llu): ", rank,                \
                        (unsigned long long)b->opt.seed);                               \
                fprintf(stderr, __VA_ARGS__);                                           \
                fprintf(stderr, "\n");                                                  \
                goto out;                                                               \
        } while (0)

static int enter_group(const struct bench *b, struct epd_client *client, uint32_t rank,
                       struct epd_group **out)
{
        unsigned char secret[16];
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = b->R, .num_experts = b->E, .hidden = b->H,
                .max_tokens_per_rank = b->T, .max_topk = b->K,
                .dispatch_dtype = b->opt.wl->dtype, .scale_block = BENCH_SCALE_BLOCK,
                .op_timeout_ms = 120000, .arena_bytes = b->arena_bytes,
        };
        struct epd_group_args ga = {
                .size = sizeof(ga), .name = b->group_name, .secret = secret,
                .secret_len = sizeof(secret), .rank = rank, .device = rank % b->opt.devices,
                .config = &cfg,
        };

        h_secret(b->group_name, secret);
        if (rank == 0)
                return epd_group_create(client, &ga, out);
        /* Rank 0 may not have created the group yet: retry for up to 20 s. */
        for (int attempt = 0; attempt < 4000; attempt++) {
                int rc = epd_group_join(client, &ga, out);
                if (rc != EPD_NOT_FOUND)
                        return rc;
                usleep(5000);
        }
        return EPD_NOT_FOUND;
}

/* A tensor at ptr inside one of this client's registered regions. */
static int tensor(struct epd_client *c, const void *ptr, enum epd_dtype dt, uint64_t rows,
                  uint64_t cols, struct epd_tensor *out)
{
        uint64_t sizes[2] = { rows, cols };

        return epd_tensor_at(c, ptr, dt, cols ? 2 : 1, sizes, out);
}

/* Whether the workers meet the parent after iteration `it`: after the verified iteration 0, so
 * that no rank's next op waits for a slower peer's check, and at the measured-iteration
 * boundaries where the parent probes the ceiling (*probe). Both sides call it, so they agree. */
static int sync_after(const struct bench *b, uint32_t it, int *probe)
{
        uint32_t done = it % b->per_phase + 1, w = b->opt.warmup;
        int mark = done >= w && ((done - w) % b->probe_every == 0 || done == b->per_phase);

        /* Without host probes (CUDA mode) the workers still meet at the start and end of every
         * phase's measured iterations, so that each phase starts together. */
        *probe = b->host_probes && mark;
        return it == 0 || mark;
}

/* The phase of iteration it (each phase is warmup + iters iterations). */
static uint32_t phase_of(const struct bench *b, uint32_t it)
{
        return it / b->per_phase;
}

/* Tells the parent this worker is at a sync point and blocks until it says go on. */
static int worker_sync(const struct bench *b, uint32_t rank)
{
        char c = 's';

        if (write(b->to_parent[rank][1], &c, 1) != 1)
                return -1;
        return read(b->from_parent[rank][0], &c, 1) == 1 ? 0 : -1;
}

/* ---- the worker's CUDA side (CUDA mode) ----
 *
 * Only workers call these, after fork: the parent never initialises CUDA. Each returns 0, or -1
 * with the reason in err. */

enum { COPY_H2D, COPY_D2H, COPY_D2D };

struct wcuda {
        int on;
        uint32_t device;        /* CUDA ordinal = the daemon's device index (same machine) */
#ifdef EPD_BENCH_CUDA
        cudaStream_t stream;
        cudaEvent_t ev;
#endif
        uint8_t *flush;         /* FLUSH_BYTES, Fresh mode only */
        uint8_t *d_in, *d_y, *d_out, *d_comb; /* --device-memory */
        int cumem;              /* --alloc cumem: the four above come from epd_device_alloc */
};

#ifdef EPD_BENCH_CUDA
static int cu_ok(cudaError_t e, const char *what, char *err, size_t len)
{
        if (e == cudaSuccess)
                return 0;
        snprintf(err, len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
        return -1;
}
#define CU_TRY(call, what)                                      \
        do {                                                    \
                if (cu_ok((call), (what), err, len) < 0)        \
                        return -1;                              \
        } while (0)
#endif

static void *wc_stream(const struct wcuda *wc)
{
#ifdef EPD_BENCH_CUDA
        return (void *)wc->stream;
#else
        (void)wc;
        return NULL;
#endif
}

static int wcuda_init(struct wcuda *wc, const struct bench *b, uint32_t rank, char *err,
                      size_t len)
{
#ifdef EPD_BENCH_CUDA
        wc->device = rank % b->opt.devices;
        wc->cumem = b->opt.cumem;
        CU_TRY(cudaSetDevice((int)wc->device), "cudaSetDevice");
        CU_TRY(cudaFree(NULL), "CUDA context creation");
        CU_TRY(cudaStreamCreateWithFlags(&wc->stream, cudaStreamNonBlocking), "cudaStreamCreate");
        CU_TRY(cudaEventCreateWithFlags(&wc->ev, cudaEventDisableTiming), "cudaEventCreate");
        wc->on = 1;
        if (b->opt.flush_l2) {
                CU_TRY(cudaMalloc((void **)&wc->flush, FLUSH_BYTES),
                       "cudaMalloc of the L2 flush buffer");
                CU_TRY(cudaMemset(wc->flush, 1, FLUSH_BYTES), "cudaMemset");
                CU_TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        }
        return 0;
#else
        (void)wc;
        (void)b;
        (void)rank;
        snprintf(err, len, "epd-bench was built without CUDA");
        return -1;
#endif
}

static void wcuda_fini(struct wcuda *wc)
{
#ifdef EPD_BENCH_CUDA
        /* --alloc cumem memory was given back with epd_device_free already (NULL here). */
        uint8_t *bufs[5] = { wc->d_in, wc->d_y, wc->d_out, wc->d_comb, wc->flush };

        if (!wc->on)
                return;
        for (int i = 0; i < 5; i++)
                if (bufs[i])
                        cudaFree(bufs[i]);
        cudaEventDestroy(wc->ev);
        cudaStreamDestroy(wc->stream);
#endif
        memset(wc, 0, sizeof(*wc));
}

/* Device memory of `bytes` (at least 4096) on the worker's GPU, registered with the daemon.
 * *out is set as soon as the memory exists, so that the caller frees it on any failure. */
static int dev_alloc_register(struct epd_client *c, struct wcuda *wc, uint64_t bytes,
                              uint8_t **out, uint64_t *region, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        void *p = NULL;
        int rc;

        bytes = bytes < 4096 ? 4096 : bytes;
        if (wc->cumem) {
                /* cuMem through libepd: the daemon maps the allocation itself. */
                rc = epd_device_alloc(c, wc->device, bytes, &p, region);
                if (rc < 0) {
                        snprintf(err, len, "epd_device_alloc(%llu bytes on device %u): %s: %s",
                                 (unsigned long long)bytes, wc->device, epd_status_name(rc),
                                 epd_client_last_error(c));
                        return -1;
                }
                *out = p;
                return 0;
        }
        CU_TRY(cudaMalloc(&p, bytes), "cudaMalloc");
        *out = p;
        rc = epd_region_register_device(c, p, bytes, wc->device, region);
        if (rc < 0) {
                snprintf(err, len, "epd_region_register_device(%llu bytes on device %u): %s: %s",
                         (unsigned long long)bytes, wc->device, epd_status_name(rc),
                         epd_client_last_error(c));
                return -1;
        }
        return 0;
#else
        (void)c;
        (void)wc;
        (void)bytes;
        (void)out;
        (void)region;
        snprintf(err, len, "epd-bench was built without CUDA");
        return -1;
#endif
}

/* A synchronous copy: cudaMemcpy may return before a device-side copy lands, and the daemon
 * reads this memory from another process, so the device is synchronised after it. */
static int dev_copy(void *dst, const void *src, uint64_t bytes, int kind, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        static const enum cudaMemcpyKind kinds[3] = { cudaMemcpyHostToDevice,
                                                      cudaMemcpyDeviceToHost,
                                                      cudaMemcpyDeviceToDevice };
        if (bytes)
                CU_TRY(cudaMemcpy(dst, src, bytes, kinds[kind]), "cudaMemcpy");
        CU_TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize after a copy");
        return 0;
#else
        (void)dst;
        (void)src;
        (void)bytes;
        (void)kind;
        snprintf(err, len, "epd-bench was built without CUDA");
        return -1;
#endif
}

static int dev_fill(void *dst, int value, uint64_t bytes, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        CU_TRY(cudaMemset(dst, value, bytes), "cudaMemset");
        CU_TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize after a fill");
        return 0;
#else
        (void)dst;
        (void)value;
        (void)bytes;
        snprintf(err, len, "epd-bench was built without CUDA");
        return -1;
#endif
}

/* Fresh mode: 256 MB written on the GPU and finished before the op is submitted, so that the
 * op's kernels find an L2 holding none of their data (BENCHMARKS.md). The value changes every
 * time. */
static int dev_flush(struct wcuda *wc, uint32_t seq, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        CU_TRY(cudaMemsetAsync(wc->flush, (int)(seq % 251) + 1, FLUSH_BYTES, wc->stream),
               "cudaMemsetAsync (L2 flush)");
        CU_TRY(cudaStreamSynchronize(wc->stream), "cudaStreamSynchronize (L2 flush)");
        return 0;
#else
        (void)wc;
        (void)seq;
        snprintf(err, len, "epd-bench was built without CUDA");
        return -1;
#endif
}

/* Stream-ordered completion: the worker's stream waits for the op's doorbell, an event is
 * recorded after the wait, and the host spins on the event: the op is complete for the client
 * when work queued behind it could start. */
static int stream_complete(struct wcuda *wc, struct epd_op *op, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        uint64_t start = now_ns();
        unsigned spins = 0;
        cudaError_t e;
        int rc = epd_op_stream_wait(op, wc->stream);

        if (rc < 0) {
                snprintf(err, len, "epd_op_stream_wait: %s", epd_status_name(rc));
                return -1;
        }
        CU_TRY(cudaEventRecord(wc->ev, wc->stream), "cudaEventRecord");
        while ((e = cudaEventQuery(wc->ev)) == cudaErrorNotReady) {
                if ((++spins & 1023) == 0 && now_ns() - start > SPIN_TIMEOUT_NS) {
                        snprintf(err, len, "the stream wait did not complete within %llu s",
                                 (unsigned long long)(SPIN_TIMEOUT_NS / 1000000000ull));
                        return -1;
                }
        }
        return cu_ok(e, "cudaEventQuery", err, len);
#else
        (void)wc;
        (void)op;
        snprintf(err, len, "epd-bench was built without CUDA");
        return -1;
#endif
}

/* Submits one op, dispatch (da) or combine (cb), and waits for it as the phase says. t0 is taken
 * just before submit (after the L2 flush), t1 when completion is visible to the client. */
static int run_op(struct epd_group *group, struct wcuda *wc, int strm,
                  struct epd_dispatch_args *da, struct epd_combine_args *cb, struct epd_op **op,
                  uint64_t *t0, uint64_t *t1, char *err, size_t len)
{
        uint64_t seq = 0;
        int rc;

        *t0 = now_ns();
        if (strm) {
                rc = epd_group_mark_inputs_ready(group, wc_stream(wc), &seq);
                if (rc < 0) {
                        snprintf(err, len, "epd_group_mark_inputs_ready: %s", epd_status_name(rc));
                        return rc;
                }
        }
        if (da) {
                da->wait_inputs = seq;
                rc = epd_dispatch_submit(group, da, op);
        } else {
                cb->wait_inputs = seq;
                rc = epd_combine_submit(group, cb, op);
        }
        if (rc < 0) {
                snprintf(err, len, "submit: %s", epd_status_name(rc));
                return rc;
        }
        if (strm) {
                if (stream_complete(wc, *op, err, len) < 0)
                        return EPD_INTERNAL;
                *t1 = now_ns();
                rc = epd_op_wait(*op, -1);
        } else {
                rc = epd_op_wait(*op, -1);
                *t1 = now_ns();
        }
        if (rc < 0)
                snprintf(err, len, "%s: %s", epd_status_name(rc), epd_op_error(*op));
        return rc;
}

static int worker_run(struct bench *b, uint32_t rank)
{
        struct rank_data *me = &b->ranks[rank];
        const int expand = b->opt.layout == EPD_LAYOUT_EXPAND;
        const int dev = b->opt.device_memory;
        const enum epd_dtype dt = b->opt.wl->dtype;
        const uint32_t n = me->num_tokens, H = b->H, K = b->K;
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = b->socket,
                                       .client_name = "epd-bench", .timeout_ms = 120000 };
        struct epd_client *client = NULL;
        struct epd_group *group = NULL;
        struct epd_op *op = NULL;
        struct ref_buf *ybufs = calloc(b->R, sizeof(*ybufs));
        struct wcuda wc;
        /* Device memory regions (in, y, outputs, combined), released before the memory is
         * freed; host copies of iteration 0's device outputs. */
        uint64_t dregion[4] = { 0, 0, 0, 0 };
        uint8_t *h_out = NULL, *h_comb = NULL;
        uint64_t region_id, out_total = 0;
        char err[1024];
        int rc, status = 1;

        memset(&wc, 0, sizeof(wc));
        if (!ybufs)
                WFAIL("out of memory");
        for (uint32_t d = 0; d < b->R; d++)
                ybufs[d] = (struct ref_buf){ b->ranks[d].y.ptr, 0 };
        rc = epd_client_connect(&ca, &client, err, sizeof(err));
        if (rc < 0)
                WFAIL("connect to %s: %s: %s", b->socket, epd_status_name(rc), err);
        /* The group first (rank 0 creates it at once), then CUDA, whose context creation in
         * several processes at once may take a while. */
        rc = enter_group(b, client, rank, &group);
        if (rc < 0)
                WFAIL("enter group %s: %s: %s", b->group_name, epd_status_name(rc),
                      epd_client_last_error(client));
        if (b->worker_cuda && wcuda_init(&wc, b, rank, err, sizeof(err)) < 0)
                WFAIL("CUDA on device %u: %s", rank % b->opt.devices, err);

        /* Regions the ops never use, registered first (--extra-regions). */
        for (uint32_t i = 0; i < b->opt.extra_regions; i++) {
                void *p;
                rc = epd_region_alloc(client, 4096, &p, &region_id);
                if (rc < 0)
                        WFAIL("extra region %u: %s", i, epd_client_last_error(client));
        }

        /* Inputs and y: the shared memfds themselves, or device copies of them uploaded once.
         * The device copies keep the memfd's layout, so in_base + (p - me->in.ptr) maps. */
        uint8_t *in_base = me->in.ptr, *y_base = me->y.ptr;
        if (dev) {
                if (dev_alloc_register(client, &wc, me->in.bytes, &wc.d_in, &dregion[0], err,
                                       sizeof(err)) < 0 ||
                    dev_alloc_register(client, &wc, me->y.bytes, &wc.d_y, &dregion[1], err,
                                       sizeof(err)) < 0 ||
                    dev_copy(wc.d_in, me->in.ptr, me->in.bytes, COPY_H2D, err, sizeof(err)) < 0 ||
                    dev_copy(wc.d_y, me->y.ptr, me->y.bytes, COPY_H2D, err, sizeof(err)) < 0)
                        WFAIL("device inputs: %s", err);
                in_base = wc.d_in;
                y_base = wc.d_y;
        } else {
                rc = epd_region_register_fd(client, EPD_REGION_HOST_MEMFD, me->in.fd, me->in.bytes,
                                            0, me->in.ptr, &region_id);
                if (rc >= 0)
                        rc = epd_region_register_fd(client, EPD_REGION_HOST_MEMFD, me->y.fd,
                                                    me->y.bytes, 0, me->y.ptr, &region_id);
                if (rc < 0)
                        WFAIL("register inputs: %s", epd_client_last_error(client));
        }
#define IN_PTR(p) (in_base + ((const uint8_t *)(p) - me->in.ptr))

        /* Combine outputs: combined [N, H] bf16 and combined_topk_weights [N, K] fp32. cbase is
         * where the daemon writes them, h_cbase where this process reads them. */
        uint64_t comb_x = align64((uint64_t)n * H * 2);
        uint64_t comb_bytes = comb_x + (uint64_t)n * K * 4 + 4096;
        uint8_t *cbase, *h_cbase;
        if (dev) {
                h_comb = malloc(comb_bytes);
                if (!h_comb)
                        WFAIL("out of memory");
                if (dev_alloc_register(client, &wc, comb_bytes, &wc.d_comb, &dregion[3], err,
                                       sizeof(err)) < 0 ||
                    dev_fill(wc.d_comb, 0xEE, comb_bytes, err, sizeof(err)) < 0)
                        WFAIL("combined device region: %s", err);
                cbase = wc.d_comb;
                h_cbase = h_comb;
        } else {
                void *p;
                rc = epd_region_alloc(client, comb_bytes, &p, &region_id);
                if (rc < 0)
                        WFAIL("combined region: %s", epd_client_last_error(client));
                cbase = h_cbase = p;
        }

        struct epd_dispatch_args da = {
                .size = sizeof(da), .num_tokens = n, .num_topk = K, .layout = b->opt.layout,
                .expert_alignment = 1, .use_arena = b->opt.use_arena,
        };
        rc = tensor(client, IN_PTR(me->x), dt, n, H, &da.x);
        if (rc >= 0 && b->scale_cols)
                rc = tensor(client, IN_PTR(me->scales), EPD_DTYPE_FP32, n, b->scale_cols,
                            &da.scales);
        if (rc >= 0)
                rc = tensor(client, IN_PTR(me->topk), EPD_DTYPE_INT64, n, K, &da.topk_idx);
        if (rc >= 0)
                rc = tensor(client, IN_PTR(me->weights), EPD_DTYPE_FP32, n, K, &da.topk_weights);
        if (rc < 0)
                WFAIL("input tensors: %s", epd_client_last_error(client));
#undef IN_PTR

        /* Client-registered outputs of exactly the rows this rank receives (the capacity check of
         * SEMANTICS.md 2.5 is then tight), laid out in one region: host memory, or device memory
         * poisoned before the verified iteration and downloaded after it. */
        struct ref_dispatch_actual act;
        memset(&act, 0, sizeof(act));
        if (!b->opt.use_arena) {
                uint64_t cap = me->rows > 0 ? (uint64_t)me->rows : 1;
                uint64_t sz[6] = {
                        align64(cap * b->row_bytes), align64(cap * b->scale_cols * 4),
                        expand ? 0 : align64(cap * K * 8), align64(cap * (expand ? 1 : K) * 4),
                        align64(cap * 8), expand ? align64(cap * 4) : 0,
                };
                uint8_t *p, *hp;

                for (int i = 0; i < 6; i++)
                        out_total += sz[i];
                out_total += 4096;
                if (dev) {
                        h_out = malloc(out_total);
                        if (!h_out)
                                WFAIL("out of memory");
                        if (dev_alloc_register(client, &wc, out_total, &wc.d_out, &dregion[2], err,
                                               sizeof(err)) < 0 ||
                            dev_fill(wc.d_out, 0xAB, out_total, err, sizeof(err)) < 0)
                                WFAIL("output device region: %s", err);
                        p = wc.d_out;
                        hp = h_out;
                } else {
                        void *obase;
                        rc = epd_region_alloc(client, out_total, &obase, &region_id);
                        if (rc < 0)
                                WFAIL("output region: %s", epd_client_last_error(client));
                        p = hp = obase;
                }
                rc = tensor(client, p, dt, cap, H, &da.recv_x);
                act.recv_x = (struct ref_buf){ hp, 0 };
                p += sz[0];
                hp += sz[0];
                if (rc >= 0 && b->scale_cols) {
                        rc = tensor(client, p, EPD_DTYPE_FP32, cap, b->scale_cols, &da.recv_scales);
                        act.recv_scales = (struct ref_buf){ hp, 0 };
                }
                p += sz[1];
                hp += sz[1];
                if (rc >= 0 && !expand) {
                        rc = tensor(client, p, EPD_DTYPE_INT64, cap, K, &da.recv_topk_idx);
                        act.recv_topk_idx = (struct ref_buf){ hp, 0 };
                }
                p += sz[2];
                hp += sz[2];
                if (rc >= 0) {
                        rc = tensor(client, p, EPD_DTYPE_FP32, cap, expand ? 0 : K, &da.recv_weights);
                        act.recv_weights = (struct ref_buf){ hp, 0 };
                }
                p += sz[3];
                hp += sz[3];
                if (rc >= 0) {
                        rc = tensor(client, p, EPD_DTYPE_INT64, cap, 0, &da.recv_src);
                        act.recv_src = (struct ref_buf){ hp, 0 };
                }
                p += sz[4];
                hp += sz[4];
                if (rc >= 0 && expand) {
                        rc = tensor(client, p, EPD_DTYPE_INT32, cap, 0, &da.recv_topk_slot);
                        act.recv_topk_slot = (struct ref_buf){ hp, 0 };
                }
                if (rc < 0)
                        WFAIL("output tensors: %s", epd_client_last_error(client));
        }

        struct epd_combine_args cb = {
                .size = sizeof(cb), .apply_weights = expand, .num_bias = 0,
        };
        rc = tensor(client, y_base, EPD_DTYPE_BF16, (uint64_t)me->rows, H, &cb.y);
        if (rc >= 0)
                rc = tensor(client, cbase, EPD_DTYPE_BF16, n, H, &cb.combined);
        if (rc >= 0)
                rc = tensor(client, cbase + comb_x, EPD_DTYPE_FP32, n, K, &cb.combined_topk_weights);
        if (rc < 0)
                WFAIL("combine tensors: %s", epd_client_last_error(client));

        for (uint32_t it = 0; it < b->total_iters; it++) {
                struct sample *smp = &b->samples[((size_t)rank * b->total_iters + it) * 2];
                int strm = b->phase_stream[phase_of(b, it)];
                struct epd_dispatch_result dr;
                struct epd_combine_result cr;
                uint64_t t0 = 0, t1 = 0;

                if (b->opt.flush_l2 && dev_flush(&wc, 2 * it, err, sizeof(err)) < 0)
                        WFAIL("L2 flush before dispatch %u: %s", it, err);
                rc = run_op(group, &wc, strm, &da, NULL, &op, &t0, &t1, err, sizeof(err));
                if (rc < 0)
                        WFAIL("dispatch %u: %s%s%s", it, err, op ? "" : ": ",
                              op ? "" : epd_client_last_error(client));
                rc = epd_op_dispatch_result(op, &dr);
                if (rc < 0)
                        WFAIL("dispatch %u result: %s", it, epd_status_name(rc));
                smp[OP_DISPATCH] = (struct sample){ t0, t1, dr.exec_ns, dr.kernel_ns, dr.queue_ns,
                                                    { .size = sizeof(struct epd_op_timeline) } };
                if (epd_op_timeline(op, &smp[OP_DISPATCH].tl) < 0)
                        WFAIL("dispatch %u timeline", it);

                if (it == 0) {
                        struct ref_counts_actual counts = {
                                dr.num_recv_tokens, dr.num_expanded_rows,
                                dr.num_recv_tokens_per_expert,
                                dr.num_recv_tokens_per_expert_aligned, dr.rank_prefix,
                        };
                        if (b->opt.use_arena) {
                                act.recv_x = (struct ref_buf){ dr.recv_x_ptr, 0 };
                                act.recv_scales = (struct ref_buf){ dr.recv_scales_ptr, 0 };
                                act.recv_topk_idx = (struct ref_buf){ dr.recv_topk_idx_ptr, 0 };
                                act.recv_weights = (struct ref_buf){ dr.recv_weights_ptr, 0 };
                                act.recv_src = (struct ref_buf){ dr.recv_src_ptr, 0 };
                                act.recv_topk_slot = (struct ref_buf){ dr.recv_topk_slot_ptr, 0 };
                                if (me->rows > 0 && !dr.recv_x_ptr)
                                        WFAIL("dispatch reply names no arena placement");
                        }
                        if (dev && dev_copy(h_out, wc.d_out, out_total, COPY_D2H, err,
                                            sizeof(err)) < 0)
                                WFAIL("download of the dispatch outputs: %s", err);
                        if (ref_check_counts(b->ref, rank, &counts, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: dispatch counts: %s", err);
                        if (ref_check_dispatch(b->ref, rank, &act, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: dispatch outputs: %s", err);
                        /* The identity expert: y is the received rows, outside the timing. The
                         * shared host copy is what the other ranks' combine checks read. */
                        if (dt == EPD_DTYPE_BF16 && me->rows > 0) {
                                memcpy(me->y.ptr, act.recv_x.ptr, (size_t)me->rows * b->row_bytes);
                                if (dev && dev_copy(wc.d_y, wc.d_out,
                                                    (uint64_t)me->rows * b->row_bytes, COPY_D2D,
                                                    err, sizeof(err)) < 0)
                                        WFAIL("y from recv_x: %s", err);
                        }
                }
                cb.handle_id = dr.handle_id;
                epd_op_free(op);
                op = NULL;

                if (b->opt.flush_l2 && dev_flush(&wc, 2 * it + 1, err, sizeof(err)) < 0)
                        WFAIL("L2 flush before combine %u: %s", it, err);
                rc = run_op(group, &wc, strm, NULL, &cb, &op, &t0, &t1, err, sizeof(err));
                if (rc < 0)
                        WFAIL("combine %u: %s%s%s", it, err, op ? "" : ": ",
                              op ? "" : epd_client_last_error(client));
                rc = epd_op_combine_result(op, &cr);
                if (rc < 0)
                        WFAIL("combine %u result: %s", it, epd_status_name(rc));
                smp[OP_COMBINE] = (struct sample){ t0, t1, cr.exec_ns, cr.kernel_ns, cr.queue_ns,
                                                   { .size = sizeof(struct epd_op_timeline) } };
                if (epd_op_timeline(op, &smp[OP_COMBINE].tl) < 0)
                        WFAIL("combine %u timeline", it);
                epd_op_free(op);
                op = NULL;

                if (it == 0) {
                        /* Every rank wrote its y before submitting the combine, and the combine
                         * completed only after every rank submitted: all y are in place. */
                        struct ref_combine_in cin = { ybufs, cb.apply_weights };
                        struct ref_buf bias[2] = { { NULL, 0 }, { NULL, 0 } };
                        if (dev && dev_copy(h_comb, wc.d_comb, comb_bytes, COPY_D2H, err,
                                            sizeof(err)) < 0)
                                WFAIL("download of the combine outputs: %s", err);
                        if (ref_check_combine(b->ref, &cin, rank, bias,
                                              (struct ref_buf){ h_cbase, 0 },
                                              (struct ref_buf){ h_cbase + comb_x, 0 }, err,
                                              sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: combine outputs: %s", err);
                        /* The host copies are needed no more. */
                        free(h_out);
                        free(h_comb);
                        h_out = h_comb = NULL;
                }
                rc = epd_handle_release(group, cb.handle_id);
                if (rc < 0)
                        WFAIL("handle release: %s", epd_client_last_error(client));
                int probe;
                if (sync_after(b, it, &probe) && worker_sync(b, rank) < 0)
                        WFAIL("lost the parent at the sync point after iteration %u", it);
        }
        status = 0;
out:
        epd_op_free(op);
        epd_group_leave(group);
        /* The clean order: the daemon lets go of the device memory before it is freed.
         * epd_device_free does both for --alloc cumem (dregion[] follows d_in, d_y, d_out,
         * d_comb). */
        if (wc.cumem) {
                uint8_t **bufs[4] = { &wc.d_in, &wc.d_y, &wc.d_out, &wc.d_comb };
                for (int i = 0; i < 4; i++) {
                        if (*bufs[i])
                                epd_device_free(client, *bufs[i]);
                        *bufs[i] = NULL;
                        dregion[i] = 0;
                }
        }
        for (int i = 0; i < 4; i++)
                if (dregion[i])
                        epd_region_release(client, dregion[i]);
        epd_client_free(client);
        wcuda_fini(&wc);
        free(h_out);
        free(h_comb);
        free(ybufs);
        return status;
}

/* ---- statistics ---- */

static int cmp_double(const void *a, const void *b)
{
        double x = *(const double *)a, y = *(const double *)b;

        return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted v[n]. */
static double pct(const double *v, size_t n, double p)
{
        size_t i;

        if (n == 0)
                return NAN;
        i = (size_t)ceil(p / 100.0 * (double)n);
        if (i > 0)
                i--;
        return v[i < n ? i : n - 1];
}

/* The op time of a sample, in ns (see bench.kernel_time). */
static uint64_t op_ns(const struct bench *b, const struct sample *s)
{
        return b->kernel_time ? s->kernel_ns : s->exec_ns;
}

/* Steps of the op timeline that the last submitter's overhead is split into (tl_step_names). */
#define TL_STEPS 9

struct op_stats {
        double exec_p50, exec_p99;       /* us: the op time (kernel or backend execution) */
        double e2e_p50, e2e_p99, e2e_max; /* us: client-observed, every rank's samples */
        double ovh_p50, ovh_p99;         /* us: e2e minus op time of the same op, every rank */
        double last_ovh_p50, last_ovh_p99; /* us: the same for the rank that submitted last */
        double queue_p50;                /* us: submission to launch, every rank */
        /* The last submitter's overhead, split (us, p50 of each part): arrival at the daemon to
         * the executor starting the op (queue_ns), executor time beyond the GPU time (launch
         * calls, waiting for completion: exec_ns - kernel_ns), and the rest (the request and
         * reply through the socket and the loop thread: e2e - queue_ns - exec_ns). */
        double last_queue_p50, last_host_exec_p50, last_rest_p50;
        /* The same overhead along the op's timeline (epd_op_timeline; us, p50 of each step, so
         * the steps need not add up exactly): TL_STEPS steps, named in tl_step_names. */
        double last_tl_p50[TL_STEPS];
        double exec_spread_max;          /* us: largest difference of op time between ranks */
        /* us: from the last rank's submission to the last rank's completion, less the op time:
         * what the group as a whole waits beyond the op, whichever rank is served last. */
        double group_ovh_p50, group_ovh_p99;
        double replies_in_doorbell;      /* fraction of the replies that came in the page */
        double requests_in_doorbell;     /* fraction of the requests posted in the page */
};

/* The last submitter's overhead along the op's timeline: each step's time in us. The GPU
 * window (kernel_ns) is the op time and left out; for the host backend the whole execution
 * is. Stream-ordered ops end when the worker's stream passes the doorbell, which may come
 * before the reply: their last steps are then negative. */
static const char *const tl_step_names[TL_STEPS] = {
        "request_build",     /* the call to libepd sending the request */
        "request",           /* sent to the daemon reading it */
        "loop_to_executor",  /* read to handed to the executor (queue_ns) */
        "executor_pickup",   /* handed to begun */
        "executor_host",     /* the executor's time outside the GPU window */
        "completion_pickup", /* executor done to the loop taking the completion */
        "reply_build",       /* completion taken to this reply built (replies to other ranks
                              * built first included) */
        "reply_transit",     /* reply built to libepd reading it */
        "client_return",     /* reply read to the call returning (host-waited) */
};

static void tl_steps(const struct sample *s, double *out)
{
        const struct epd_op_timeline *t = &s->tl;
        const double host = (double)(s->kernel_ns ? s->exec_ns - s->kernel_ns : 0);

        out[0] = ((double)t->submitted_ns - (double)s->submit_ns) / 1e3;
        out[1] = ((double)t->received_ns - (double)t->submitted_ns) / 1e3;
        out[2] = ((double)t->launched_ns - (double)t->received_ns) / 1e3;
        out[3] = ((double)t->exec_start_ns - (double)t->launched_ns) / 1e3;
        out[4] = host / 1e3;
        out[5] = ((double)t->completed_ns - (double)(t->exec_start_ns + t->exec_ns)) / 1e3;
        out[6] = ((double)t->replied_ns - (double)t->completed_ns) / 1e3;
        out[7] = ((double)t->reply_read_ns - (double)t->replied_ns) / 1e3;
        out[8] = ((double)s->done_ns - (double)t->reply_read_ns) / 1e3;
}

static void op_stats(const struct bench *b, uint32_t phase, int kind, struct op_stats *st)
{
        uint32_t R = b->R, iters = b->opt.iters, w = phase * b->per_phase + b->opt.warmup;
        size_t ns = (size_t)R * iters;
        double *exec = calloc(iters, sizeof(double));
        double *e2e = calloc(ns, sizeof(double)), *ovh = calloc(ns, sizeof(double));
        double *last = calloc(iters, sizeof(double)), *queue = calloc(ns, sizeof(double));
        double *lq = calloc(iters, sizeof(double)), *lx = calloc(iters, sizeof(double));
        double *lr = calloc(iters, sizeof(double));
        double *ltl = calloc((size_t)iters * TL_STEPS, sizeof(double));
        double *grp = calloc(iters, sizeof(double));
        size_t in_page = 0, req_in_page = 0;
        size_t k = 0;

        memset(st, 0, sizeof(*st));
        if (!exec || !e2e || !ovh || !last || !queue || !lq || !lx || !lr || !ltl || !grp)
                goto out;
        for (uint32_t i = 0; i < iters; i++) {
                uint64_t emax = 0, emin = UINT64_MAX, last_submit = 0, last_done = 0;
                double last_ovh = 0;

                for (uint32_t r = 0; r < R; r++) {
                        const struct sample *s =
                                &b->samples[((size_t)r * b->total_iters + w + i) * 2 + kind];
                        emax = op_ns(b, s) > emax ? op_ns(b, s) : emax;
                        emin = op_ns(b, s) < emin ? op_ns(b, s) : emin;
                }
                for (uint32_t r = 0; r < R; r++) {
                        const struct sample *s =
                                &b->samples[((size_t)r * b->total_iters + w + i) * 2 + kind];
                        double t = (double)(s->done_ns - s->submit_ns) / 1e3;
                        e2e[k] = t;
                        ovh[k] = t - (double)op_ns(b, s) / 1e3;
                        queue[k] = (double)s->queue_ns / 1e3;
                        k++;
                        in_page += s->tl.reply_in_doorbell != 0;
                        req_in_page += s->tl.request_in_doorbell != 0;
                        last_done = s->done_ns > last_done ? s->done_ns : last_done;
                        if (s->submit_ns >= last_submit) {
                                last_submit = s->submit_ns;
                                last_ovh = t - (double)op_ns(b, s) / 1e3;
                                lq[i] = (double)s->queue_ns / 1e3;
                                lx[i] = s->kernel_ns && s->exec_ns > s->kernel_ns
                                                ? (double)(s->exec_ns - s->kernel_ns) / 1e3
                                                : 0;
                                lr[i] = t - (double)(s->queue_ns + s->exec_ns) / 1e3;
                                double steps[TL_STEPS];
                                tl_steps(s, steps);
                                for (int j = 0; j < TL_STEPS; j++)
                                        ltl[(size_t)j * iters + i] = steps[j];
                        }
                }
                /* One exec serves every rank: its time is the device figure. */
                exec[i] = (double)emax / 1e3;
                last[i] = last_ovh;
                grp[i] = ((double)last_done - (double)last_submit - (double)emax) / 1e3;
                if ((double)(emax - emin) / 1e3 > st->exec_spread_max)
                        st->exec_spread_max = (double)(emax - emin) / 1e3;
        }
        qsort(exec, iters, sizeof(double), cmp_double);
        qsort(e2e, ns, sizeof(double), cmp_double);
        qsort(ovh, ns, sizeof(double), cmp_double);
        qsort(last, iters, sizeof(double), cmp_double);
        qsort(queue, ns, sizeof(double), cmp_double);
        st->exec_p50 = pct(exec, iters, 50);
        st->exec_p99 = pct(exec, iters, 99);
        st->e2e_p50 = pct(e2e, ns, 50);
        st->e2e_p99 = pct(e2e, ns, 99);
        st->e2e_max = pct(e2e, ns, 100);
        st->ovh_p50 = pct(ovh, ns, 50);
        st->ovh_p99 = pct(ovh, ns, 99);
        st->last_ovh_p50 = pct(last, iters, 50);
        st->last_ovh_p99 = pct(last, iters, 99);
        st->queue_p50 = pct(queue, ns, 50);
        qsort(lq, iters, sizeof(double), cmp_double);
        qsort(lx, iters, sizeof(double), cmp_double);
        qsort(lr, iters, sizeof(double), cmp_double);
        st->last_queue_p50 = pct(lq, iters, 50);
        st->last_host_exec_p50 = pct(lx, iters, 50);
        st->last_rest_p50 = pct(lr, iters, 50);
        for (int j = 0; j < TL_STEPS; j++) {
                qsort(ltl + (size_t)j * iters, iters, sizeof(double), cmp_double);
                st->last_tl_p50[j] = pct(ltl + (size_t)j * iters, iters, 50);
        }
        qsort(grp, iters, sizeof(double), cmp_double);
        st->group_ovh_p50 = pct(grp, iters, 50);
        st->group_ovh_p99 = pct(grp, iters, 99);
        st->replies_in_doorbell = ns ? (double)in_page / (double)ns : 0;
        st->requests_in_doorbell = ns ? (double)req_in_page / (double)ns : 0;
out:
        free(grp);
        free(ltl);
        free(lq);
        free(lx);
        free(lr);
        free(exec);
        free(e2e);
        free(ovh);
        free(last);
        free(queue);
}

/* ---- command line ---- */

static void usage(FILE *f)
{
        fprintf(f,
                "Usage: epd-bench --workload prefill|prefill-bf16|decode|tiny --ranks N --iters N\n"
                "                 [--json] [--socket PATH] [--tokens T] [--layout non-expand|expand]\n"
                "                 [--seed S] [--warmup N] [--threads N] [--outputs arena|regions]\n"
                "                 [--backend host|cuda] [--device-memory|--host-memory]\n"
                "                 [--alloc cudamalloc|cumem] [--devices N] [--flush-l2|--no-flush-l2]\n"
                "                 [--completion host|stream|both] [--stream-order]\n\n"
                "Measures dispatch and combine through real client processes, one per rank, as\n"
                "docs/BENCHMARKS.md defines. Without --socket it starts build/bin/epd (host backend,\n"
                "or the CUDA backend with --backend cuda) on a temporary socket and stops it at the\n"
                "end.\n\n"
                "  --workload NAME   prefill (fp8, T=4096, rank r sends T-r), prefill-bf16, decode\n"
                "                    (fp8, T=128), tiny (bf16, T=8; --tokens 1 for the 1-token case)\n"
                "  --ranks N         world size (1..64)\n"
                "  --iters N         measured iterations of dispatch -> combine (default 200)\n"
                "  --warmup N        unmeasured iterations first (default 5, at least 1); iteration\n"
                "                    0 is verified bitwise against the reference\n"
                "  --tokens T        tokens per rank; below the workload's T the run is 'scaled'\n"
                "  --layout L        non-expand (default) or expand\n"
                "  --seed S          data and routing seed (default 1)\n"
                "  --threads N       host backend threads (daemon --host-threads) and memcpy-ceiling\n"
                "                    threads; default: the number of CPUs\n"
                "  --outputs O       arena (default in host memory): outputs in the daemon's output\n"
                "                    arena; regions: client-registered outputs of exact capacity\n"
                "  --socket PATH     use a running daemon instead of starting one (else the\n"
                "                    one started is $EPD_BENCH_DAEMON if set, or epd beside\n"
                "                    epd-bench)\n"
                "  --json            one JSON object per line per result on stdout (table on stderr)\n"
                "\nCUDA mode:\n"
                "  --backend B       host (default) or cuda: the daemon's backend; with --socket the\n"
                "                    running daemon must have it\n"
                "  --device-memory   (default with cuda) inputs and outputs in each worker's GPU\n"
                "                    memory (see --alloc); outputs are\n"
                "                    client-registered regions (the CUDA backend's arena is host\n"
                "                    memory); the ceiling is the device-to-device copy\n"
                "  --host-memory     host memfds on the CUDA backend instead\n"
                "  --alloc A         device memory from cumem (default: epd_device_alloc, cuMem\n"
                "                    shared as POSIX fds, which the daemon maps itself) or\n"
                "                    cudamalloc (shared as CUDA IPC handles; the daemon's kernels\n"
                "                    reach it at about half speed, docs/performance.md)\n"
                "  --devices N       GPUs to spread the ranks over: rank r on device r %% N (default 1).\n"
                "                    With N >= 2 the run also measures the peer-to-peer store\n"
                "                    ceiling (a kernel storing 16-byte vectors into 1 GiB of the\n"
                "                    other GPU, 10 event-timed launches; median of those before and\n"
                "                    after the workers) for every ordered pair and with every GPU\n"
                "                    d storing to GPU (d + 1) %% N at once (aggregate: all bytes\n"
                "                    over the slowest GPU's time), and each op's cross-GPU floor\n"
                "                    bytes: rows whose source and destination ranks are on\n"
                "                    different GPUs, at the floor's row bytes (dispatch) or the\n"
                "                    bf16 y row (combine). JSON fields, null with N = 1 or the host\n"
                "                    backend:\n"
                "                      p2p_store_pairs [{src, dst, gbps, before_gbps, after_gbps,\n"
                "                        error}]: GB/s stored per ordered pair; gbps null and error\n"
                "                        set when a pair could not be measured\n"
                "                      p2p_store_concurrent_gbps: the all-at-once aggregate\n"
                "                      p2p_store_concurrent_device_gbps: [N] each GPU's own rate\n"
                "                      p2p_store_bytes: bytes stored per launch and GPU\n"
                "                      cross_gpu_floor_bytes, cross_gpu_floor_gbps (the bytes over\n"
                "                        the kernel time p50), cross_gpu_fraction_of_p2p (that\n"
                "                        over p2p_store_concurrent_gbps; issue 5 asks >= 0.85)\n"
                "  --flush-l2        Fresh mode: write 256 MB on the GPU before every op (in each\n"
                "                    worker, before submit, synchronised); default for decode\n"
                "  --no-flush-l2     never flush\n"
                "  --poll-us N       start the daemon with --poll-us N (0..100000; default: the\n"
                "                    daemon's own default)\n"
                "  --extra-regions N each worker registers N small regions (0..1000) before its\n"
                "                    own and keeps them, as a long-lived process holds many: the\n"
                "                    daemon looks up every tensor of every op among them\n"
                "  --completion C    host (default): the client waits for the reply (epd_op_wait);\n"
                "                    stream: inputs marked ready on the worker's stream, then\n"
                "                    epd_op_stream_wait and an event whose completion ends the\n"
                "                    client-observed time; both: a host phase, then a stream phase\n"
                "                    (each with its own warm-up), reported separately\n"
                "  --stream-order    the same as --completion stream\n");
}

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
        char *end;
        unsigned long v;

        errno = 0;
        v = strtoul(s, &end, 0);
        if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi)
                return -1;
        *out = (uint32_t)v;
        return 0;
}

static int parse_args(int argc, char **argv, struct options *o)
{
        static const struct option longopts[] = {
                { "workload", required_argument, NULL, 'w' },
                { "ranks", required_argument, NULL, 'r' },
                { "iters", required_argument, NULL, 'i' },
                { "warmup", required_argument, NULL, 'W' },
                { "tokens", required_argument, NULL, 't' },
                { "layout", required_argument, NULL, 'l' },
                { "seed", required_argument, NULL, 's' },
                { "threads", required_argument, NULL, 'T' },
                { "outputs", required_argument, NULL, 'o' },
                { "socket", required_argument, NULL, 'S' },
                { "json", no_argument, NULL, 'j' },
                { "backend", required_argument, NULL, 'B' },
                { "device-memory", no_argument, NULL, 'D' },
                { "host-memory", no_argument, NULL, 'M' },
                { "devices", required_argument, NULL, 'n' },
                { "alloc", required_argument, NULL, 'A' },
                { "flush-l2", no_argument, NULL, 'F' },
                { "no-flush-l2", no_argument, NULL, 'f' },
                { "completion", required_argument, NULL, 'C' },
                { "stream-order", no_argument, NULL, 'O' },
                { "poll-us", required_argument, NULL, 'P' },
                { "extra-regions", required_argument, NULL, 'X' },
                { "help", no_argument, NULL, 'h' },
                { NULL, 0, NULL, 0 },
        };
        int c;

        memset(o, 0, sizeof(*o));
        o->iters = 200;
        o->warmup = 5;
        o->seed = 1;
        o->use_arena = 1;
        o->layout = EPD_LAYOUT_NON_EXPAND;
        o->device_memory = -1;
        o->cumem = -1;
        o->flush_l2 = -1;
        o->devices = 1;
        while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
                switch (c) {
                case 'w':
                        for (size_t i = 0; i < sizeof(workloads) / sizeof(workloads[0]); i++)
                                if (strcmp(optarg, workloads[i].name) == 0)
                                        o->wl = &workloads[i];
                        if (!o->wl) {
                                fprintf(stderr, "epd-bench: unknown workload '%s'\n", optarg);
                                return -1;
                        }
                        break;
                case 'r':
                        if (parse_u32(optarg, 1, 64, &o->ranks) < 0)
                                goto bad;
                        break;
                case 'i':
                        if (parse_u32(optarg, 1, 10000000, &o->iters) < 0)
                                goto bad;
                        break;
                case 'W':
                        /* At least 1: iteration 0 is verified and faults the outputs in. */
                        if (parse_u32(optarg, 1, 10000000, &o->warmup) < 0)
                                goto bad;
                        break;
                case 't':
                        if (parse_u32(optarg, 1, 1u << 20, &o->tokens) < 0)
                                goto bad;
                        break;
                case 'T':
                        if (parse_u32(optarg, 1, 256, &o->threads) < 0)
                                goto bad;
                        break;
                case 'l':
                        if (strcmp(optarg, "non-expand") == 0)
                                o->layout = EPD_LAYOUT_NON_EXPAND;
                        else if (strcmp(optarg, "expand") == 0)
                                o->layout = EPD_LAYOUT_EXPAND;
                        else
                                goto bad;
                        break;
                case 'o':
                        if (strcmp(optarg, "arena") == 0)
                                o->use_arena = 1;
                        else if (strcmp(optarg, "regions") == 0)
                                o->use_arena = 0;
                        else
                                goto bad;
                        o->outputs_given = 1;
                        break;
                case 'B':
                        if (strcmp(optarg, "host") == 0)
                                o->cuda = 0;
                        else if (strcmp(optarg, "cuda") == 0)
                                o->cuda = 1;
                        else
                                goto bad;
                        break;
                case 'D':
                        o->device_memory = 1;
                        break;
                case 'M':
                        o->device_memory = 0;
                        break;
                case 'A':
                        if (strcmp(optarg, "cudamalloc") == 0)
                                o->cumem = 0;
                        else if (strcmp(optarg, "cumem") == 0)
                                o->cumem = 1;
                        else
                                goto bad;
                        break;
                case 'n':
                        if (parse_u32(optarg, 1, D2D_MAX_DEVICES, &o->devices) < 0)
                                goto bad;
                        break;
                case 'F':
                        o->flush_l2 = 1;
                        break;
                case 'P':
                        if (parse_u32(optarg, 0, 100000, &o->poll_us) < 0)
                                goto bad;
                        o->poll_us_set = 1;
                        break;
                case 'f':
                        o->flush_l2 = 0;
                        break;
                case 'X':
                        if (parse_u32(optarg, 0, 1000, &o->extra_regions) < 0)
                                goto bad;
                        break;
                case 'C':
                        if (strcmp(optarg, "host") == 0)
                                o->completion = COMPLETION_HOST;
                        else if (strcmp(optarg, "stream") == 0)
                                o->completion = COMPLETION_STREAM;
                        else if (strcmp(optarg, "both") == 0)
                                o->completion = COMPLETION_BOTH;
                        else
                                goto bad;
                        break;
                case 'O':
                        o->completion = COMPLETION_STREAM;
                        break;
                case 's': {
                        char *end;
                        errno = 0;
                        o->seed = strtoull(optarg, &end, 0);
                        if (errno || end == optarg || *end)
                                goto bad;
                        break;
                }
                case 'S':
                        o->socket = optarg;
                        break;
                case 'j':
                        o->json = 1;
                        break;
                case 'h':
                        usage(stdout);
                        exit(0);
                default:
                        usage(stderr);
                        return -1;
                }
                continue;
bad:
                fprintf(stderr, "epd-bench: bad value '%s'\n", optarg);
                return -1;
        }
        if (optind < argc || !o->wl || !o->ranks) {
                fprintf(stderr, "epd-bench: --workload and --ranks are required\n");
                usage(stderr);
                return -1;
        }
        if (!o->cuda) {
                if (o->device_memory == 1 || o->flush_l2 == 1 || o->devices != 1 ||
                    o->cumem >= 0 || o->completion != COMPLETION_HOST) {
                        fprintf(stderr, "epd-bench: --device-memory, --alloc, --flush-l2, --devices and "
                                        "stream completion need --backend cuda\n");
                        return -1;
                }
                o->device_memory = 0;
                o->cumem = 0;
                o->flush_l2 = 0;
                return 0;
        }
#ifndef EPD_BENCH_CUDA
        fprintf(stderr, "epd-bench: --backend cuda: this epd-bench was built without CUDA "
                        "(configure with -DEPD_CUDA=ON on a machine with the CUDA toolkit)\n");
        return -1;
#else
        if (o->device_memory < 0)
                o->device_memory = 1;
        if (o->flush_l2 < 0)
                o->flush_l2 = strcmp(o->wl->name, "decode") == 0;
        if (o->cumem < 0)
                o->cumem = o->device_memory;
        if (o->cumem && !o->device_memory) {
                fprintf(stderr, "epd-bench: --alloc cumem allocates device memory; it does not "
                                "go with --host-memory\n");
                return -1;
        }
        if (o->device_memory) {
                /* The CUDA backend's output arena is host memory: device outputs are regions. */
                if (o->outputs_given && o->use_arena) {
                        fprintf(stderr, "epd-bench: --outputs arena puts outputs in host memory; "
                                        "--device-memory uses client-registered device outputs "
                                        "(--outputs regions, implied)\n");
                        return -1;
                }
                o->use_arena = 0;
        }
        return 0;
#endif
}

/* ---- output ---- */

static const char *dtype_name(enum epd_dtype d)
{
        return d == EPD_DTYPE_BF16 ? "bf16" : "fp8_e4m3";
}

/* One P2P store figure of the run, GB/s of bytes stored (see struct run_info). */
struct p2p_figure {
        int ok;                 /* measured before or after the workers, or both */
        int before_ok, after_ok;
        double gbps;            /* the median of every timed launch of the sets that succeeded */
        double before, after;   /* the median of each set */
        char why[256];          /* what failed: !ok, or one of the two sets */
};

struct run_info {
        char backend[16];
        uint32_t devices;       /* the daemon's */
        char device_name[128];  /* device 0 as the daemon names it (CUDA mode) */
        int scaled;
        uint64_t llc;           /* host last-level cache; in CUDA mode the GPU's L2 */
        /* Host mode: GB/s of the 1 GiB memcpy: the median of the probes interleaved with the
         * ops (the ceiling the fractions use), of the copies before the workers started, and
         * the extremes of all of them. CUDA mode: the device-to-device copy: the median of every
         * timed copy (before and after the workers; with several devices, the slowest device's
         * median), the medians before and after, and the extremes. */
        double ceiling, ceiling_initial, ceiling_min, ceiling_best;
        double d2d_after;
        unsigned num_probes;
        char mps[16];           /* "on", "off", "unknown"; "n/a" on the host backend */
        char mps_detail[320];
        uint64_t ws_bytes;      /* the daemon's workspace of one live dispatch handle */
        /* CUDA mode with --devices >= 2 (p2p): the peer-to-peer store ceiling, per ordered pair
         * [src][dst] and with every GPU storing to the next at once (ring: the aggregate over the
         * GPUs; ring_dev: each GPU's own median), from the launches before and after the
         * workers. ring_serialized: timed rounds whose kernels did not overlap. */
        int p2p;
        struct p2p_figure pair[D2D_MAX_DEVICES][D2D_MAX_DEVICES];
        struct p2p_figure ring;
        double ring_dev[D2D_MAX_DEVICES];
        int ring_serialized, ring_rounds;
        struct byte_counts bytes;
        struct op_stats st[MAX_PHASES][2];
};

static const char *phase_name(const struct bench *b, uint32_t p)
{
        return b->phase_stream[p] ? "stream" : "host";
}

/* One P2P figure for the table: the median of both sets, each set's, or why it is missing. */
static void print_p2p_figure(const struct p2p_figure *p, FILE *f)
{
        if (!p->ok) {
                fprintf(f, "NOT MEASURED: %s\n", p->why);
                return;
        }
        fprintf(f, "%.2f GB/s (before the workers ", p->gbps);
        if (p->before_ok)
                fprintf(f, "%.2f", p->before);
        else
                fprintf(f, "FAILED");
        fprintf(f, ", after ");
        if (p->after_ok)
                fprintf(f, "%.2f", p->after);
        else
                fprintf(f, "FAILED");
        fprintf(f, ")%s%s\n", p->why[0] ? ": " : "", p->why);
}

/* --devices >= 2: the P2P store ceiling, one line per ordered pair and the all-at-once one. */
static void print_p2p(const struct bench *b, const struct run_info *ri, FILE *f)
{
        uint32_t n = b->opt.devices;

        fprintf(f, "  peer-to-peer store ceiling (a kernel on the source GPU storing 16-byte "
                   "vectors into %.0f MiB on the target, bytes stored, event-timed; median of "
                   "%d launches before and %d after the workers):\n",
                (double)P2P_BYTES / 1048576.0, P2P_REPS, P2P_REPS);
        for (uint32_t s = 0; s < n; s++) {
                for (uint32_t d = 0; d < n; d++) {
                        if (s == d)
                                continue;
                        fprintf(f, "    GPU %u -> GPU %u: ", s, d);
                        print_p2p_figure(&ri->pair[s][d], f);
                }
        }
        fprintf(f, "    all at once, GPU d -> GPU (d + 1) %% %u, aggregate (every GPU's bytes over "
                   "the slowest GPU's time): ", n);
        print_p2p_figure(&ri->ring, f);
        if (ri->ring.ok) {
                fprintf(f, "      per GPU in it:");
                for (uint32_t d = 0; d < n; d++)
                        fprintf(f, " GPU %u %.2f GB/s%s", d, ri->ring_dev[d], d + 1 < n ? "," : "");
                fprintf(f, "\n");
        }
        if (ri->ring_serialized)
                fprintf(f, "      WARNING: in %d of %d timed rounds the GPUs' kernels did not "
                           "overlap (the round took over 1.25 x the slowest GPU's kernel): the "
                           "aggregate above is too high\n",
                        ri->ring_serialized, ri->ring_rounds);
}

/* --devices >= 2: the ops' cross-GPU floor bytes against the all-at-once P2P store ceiling. */
static void print_cross(const struct bench *b, const struct run_info *ri, FILE *f)
{
        static const char *names[2] = { "dispatch", "combine" };
        const struct byte_counts *bc = &ri->bytes;

        fprintf(f, "  cross-GPU floor bytes (%llu of %llu received rows have their source and "
                   "destination ranks on different GPUs; dispatch: the floor's row bytes, "
                   "combine: the bf16 y row), against the all-at-once P2P store ceiling%s:\n",
                (unsigned long long)bc->cross_rows, (unsigned long long)bc->rows,
                ri->ring.ok ? "" : " (NOT MEASURED, so no fraction)");
        for (uint32_t p = 0; p < b->num_phases; p++) {
                for (int k = 0; k < 2; k++) {
                        const struct op_stats *st = &ri->st[p][k];
                        double g = (double)bc->cross[k] / (st->exec_p50 * 1e3);

                        fprintf(f, "    %s [%s]: %.1f MB = %.2f GB/s at the kernel p50", names[k],
                                phase_name(b, p), (double)bc->cross[k] / 1e6, g);
                        if (ri->ring.ok)
                                fprintf(f, ", %.1f%% of %.2f GB/s", 100.0 * g / ri->ring.gbps,
                                        ri->ring.gbps);
                        fprintf(f, "\n");
                }
        }
}

static void print_table(const struct bench *b, const struct run_info *ri, FILE *f)
{
        static const char *names[2] = { "dispatch", "combine" };
        const struct byte_counts *bc = &ri->bytes;
        const int cuda = b->opt.cuda;

        fprintf(f, "\nepd-bench %s: %u ranks, T=%u%s, H=%u, top-k %u of %u experts, %s, %s, "
                   "%s outputs, seed %llu\n",
                b->opt.wl->name, b->R, b->T,
                ri->scaled ? " (SCALED)" : "", b->H, b->K, b->E,
                dtype_name(b->opt.wl->dtype),
                b->opt.layout == EPD_LAYOUT_EXPAND ? "expand" : "non-expand",
                b->opt.use_arena ? "arena" : "client-region", (unsigned long long)b->opt.seed);
        if (ri->scaled)
                fprintf(f, "  SCALED: %u tokens per rank instead of the workload's %u (--tokens)\n",
                        b->T, b->opt.wl->tokens);
        if (cuda)
                fprintf(f, "  backend %s on %s, ranks on %u device(s) (rank r on r %% %u; the "
                           "daemon has %u), %s memory, MPS %s (%s), rev %s\n",
                        ri->backend, ri->device_name, b->opt.devices, b->opt.devices,
                        ri->devices,
                        !b->opt.device_memory ? "host (memfd)"
                        : b->opt.cumem        ? "device (cuMem, epd_device_alloc)"
                                              : "device (cudaMalloc, CUDA IPC)",
                        ri->mps,
                        ri->mps_detail, epd_git_rev);
        else
                fprintf(f, "  backend %s, every rank on device 0 (the daemon has %u), MPS %s, %u "
                           "host threads, %u CPUs, rev %s\n",
                        ri->backend, ri->devices, ri->mps, b->threads, b->cpus, epd_git_rev);
        fprintf(f, "  %u measured iterations after %u warm-up per phase (%s); iteration 0 "
                   "verified bitwise%s\n",
                b->opt.iters, b->opt.warmup,
                b->num_phases == 2 ? "host-wait, then stream-ordered"
                                   : b->phase_stream[0] ? "stream-ordered" : "host-wait",
                cuda ? (b->opt.flush_l2 ? "; Fresh mode: 256 MB written on the GPU before "
                                          "every op"
                                        : "; no L2 flush (warm L2)")
                     : "");
        fprintf(f, "  data per dispatch %.1f MiB (inputs + outputs); %s %.1f MiB%s\n",
                (double)bc->data / 1048576.0, cuda ? "GPU L2" : "last-level cache",
                (double)ri->llc / 1048576.0,
                ri->llc == 0 ? " (unknown)" : bc->data > ri->llc ? ": data is larger"
                                                                 : ": DATA FITS IN THE CACHE");
        if (cuda) {
                fprintf(f, "  device-to-device copy ceiling (cudaMemcpyAsync of %.0f MiB, bytes "
                           "read + written, event-timed): %.2f GB/s = median of %u copies; %.2f "
                           "before the workers, %.2f after; all copies %.2f .. %.2f\n",
                        (double)D2D_BYTES / 1048576.0, ri->ceiling, ri->num_probes,
                        ri->ceiling_initial, ri->d2d_after, ri->ceiling_min, ri->ceiling_best);
                if (ri->p2p)
                        print_p2p(b, ri, f);
                fprintf(f, "  daemon workspace: %.2f MiB per live dispatch handle of the group "
                           "= %.2f MiB per rank (device memory); output arena %.2f MiB per rank "
                           "(host memory%s)\n",
                        (double)ri->ws_bytes / 1048576.0,
                        (double)ri->ws_bytes / b->R / 1048576.0,
                        (double)b->arena_bytes / 1048576.0,
                        b->opt.use_arena ? "" : ", unused: outputs are client regions");
        } else {
                fprintf(f, "  host memcpy ceiling (2 x %.0f MiB buffers, %u threads, bytes read + "
                           "written): %.2f GB/s = median of %u probes between the measured "
                           "iterations; %.2f before the workers started (median of %d); all "
                           "copies %.2f .. %.2f\n",
                        (double)CEILING_BYTES / 1048576.0, b->threads, ri->ceiling,
                        ri->num_probes, ri->ceiling_initial, CEILING_REPS, ri->ceiling_min,
                        ri->ceiling_best);
        }
        if (b->kernel_time)
                fprintf(f, "  time = the GPU time of the op's kernels as the daemon reports it "
                           "(kernel_ns, one exec for every rank: the device figure)%s; GB = 1e9 "
                           "bytes\n\n",
                        cuda ? "" : "; the ceiling above is the HOST memcpy, not the device copy "
                                    "a GPU run is bounded by");
        else
                fprintf(f, "  time = the backend's exec time of the whole op (the host backend runs "
                           "all ranks in one exec: the device figure); GB = 1e9 bytes\n\n");
        fprintf(f, "%-16s %9s %11s %11s %10s %9s %9s %8s %10s %10s %10s %9s %9s %9s %9s\n",
                "op", "rows", "logical MB", "floor MB", cuda ? "kernel p50" : "exec p50",
                "logic", "floor", "floor/", "e2e p50", "e2e p99", "e2e max", "ovh p50",
                "ovh p99", "last-sub", "last-sub");
        fprintf(f, "%-16s %9s %11s %11s %10s %9s %9s %8s %10s %10s %10s %9s %9s %9s %9s\n",
                "", "", "", "", "us", "GB/s", "GB/s", "ceiling", "us", "us", "us", "us", "us",
                "ovh p50", "ovh p99");
        for (uint32_t p = 0; p < b->num_phases; p++) {
                for (int k = 0; k < 2; k++) {
                        const struct op_stats *st = &ri->st[p][k];
                        double lg = (double)bc->logical[k] / (st->exec_p50 * 1e3);
                        double fl = (double)bc->floor[k] / (st->exec_p50 * 1e3);
                        char label[32];

                        snprintf(label, sizeof(label), "%s%s%s%s", names[k],
                                 cuda ? " [" : "", cuda ? phase_name(b, p) : "", cuda ? "]" : "");
                        fprintf(f, "%-16s %9llu %11.1f %11.1f %10.1f %9.2f %9.2f %7.1f%% %10.1f "
                                   "%10.1f %10.1f %9.1f %9.1f %9.1f %9.1f\n",
                                label, (unsigned long long)bc->rows,
                                (double)bc->logical[k] / 1e6, (double)bc->floor[k] / 1e6,
                                st->exec_p50, lg, fl, 100.0 * fl / ri->ceiling, st->e2e_p50,
                                st->e2e_p99, st->e2e_max, st->ovh_p50, st->ovh_p99,
                                st->last_ovh_p50, st->last_ovh_p99);
                }
        }
        fprintf(f, "\n  logical bytes (DeepEP): received rows x (x + scales + topk_idx as int64 + "
                   "fp32 weights); combine: rows sent x (bf16 row + fp32 weights)\n"
                   "  floor bytes: dispatch 2 x rows x row bytes; combine y rows read once + "
                   "combined rows (and weights) written once\n"
                   "  ovh = daemon overhead: client-observed (just before submit to completion "
                   "visible: %s) minus %s, over every rank's samples; last-sub = the same for "
                   "the rank that submitted last\n",
                cuda ? "[host] the reply in epd_op_wait, [stream] the event after "
                       "epd_op_stream_wait"
                     : "the reply in epd_op_wait",
                b->kernel_time ? "kernel time" : "exec");
        for (uint32_t p = 0; p < b->num_phases; p++) {
                for (int k = 0; k < 2; k++) {
                        const struct op_stats *st = &ri->st[p][k];
                        fprintf(f, "  last-sub overhead, %s%s%s%s, p50 per step (us):", names[k],
                                cuda ? " [" : "", cuda ? phase_name(b, p) : "",
                                cuda ? "]" : "");
                        for (int j = 0; j < TL_STEPS; j++)
                                fprintf(f, " %s %.1f", tl_step_names[j], st->last_tl_p50[j]);
                        fprintf(f, "\n    group overhead (last submission to last completion, "
                                   "less the op) p50 %.1f p99 %.1f us; requests / replies in "
                                   "doorbell pages %.0f%% / %.0f%%\n",
                                st->group_ovh_p50, st->group_ovh_p99,
                                100.0 * st->requests_in_doorbell,
                                100.0 * st->replies_in_doorbell);
                }
        }
        for (int k = 0; k < 2; k++) {
                double u = (double)bc->unique[k] / (ri->st[0][k].exec_p50 * 1e3);
                double fl = (double)bc->floor[k] / (ri->st[0][k].exec_p50 * 1e3);
                fprintf(f, "  %s: floor %.1f%% of the best single copy (%.2f GB/s); unique bytes "
                           "(each distinct byte read or written once) %.1f MB = %.2f GB/s, %.1f%% "
                           "of the ceiling\n",
                        names[k], 100.0 * fl / ri->ceiling_best, ri->ceiling_best,
                        (double)bc->unique[k] / 1e6, u, 100.0 * u / ri->ceiling);
        }
        if (ri->p2p && bc->cross_valid)
                print_cross(b, ri, f);
}

static json_t *json_real_or_null(double v, int present)
{
        return present ? json_real(v) : json_null();
}

/* p2p_store_pairs: one object per ordered pair of GPUs (see the file comment). */
static json_t *p2p_pairs_json(const struct bench *b, const struct run_info *ri)
{
        json_t *a = json_array();

        for (uint32_t s = 0; s < b->opt.devices; s++) {
                for (uint32_t d = 0; d < b->opt.devices; d++) {
                        const struct p2p_figure *p = &ri->pair[s][d];
                        json_t *o;

                        if (s == d)
                                continue;
                        o = json_object();
                        json_object_set_new(o, "src", json_integer(s));
                        json_object_set_new(o, "dst", json_integer(d));
                        json_object_set_new(o, "gbps", json_real_or_null(p->gbps, p->ok));
                        json_object_set_new(o, "before_gbps",
                                            json_real_or_null(p->before, p->before_ok));
                        json_object_set_new(o, "after_gbps",
                                            json_real_or_null(p->after, p->after_ok));
                        json_object_set_new(o, "error", p->why[0] ? json_string(p->why)
                                                                  : json_null());
                        json_array_append_new(a, o);
                }
        }
        return a;
}

/* One JSON line: op k of phase p. */
static void print_json_one(const struct bench *b, const struct run_info *ri, uint32_t p, int k)
{
        static const char *names[2] = { "dispatch", "combine" };
        const int cuda = b->opt.cuda;
        const struct op_stats *st = &ri->st[p][k];
        double lg = (double)ri->bytes.logical[k] / (st->exec_p50 * 1e3);
        double fl = (double)ri->bytes.floor[k] / (st->exec_p50 * 1e3);
        double un = (double)ri->bytes.unique[k] / (st->exec_p50 * 1e3);
        json_t *o = json_object();
        char *s;

        json_object_set_new(o, "bench", json_string("epd-bench"));
        json_object_set_new(o, "op", json_string(names[k]));
        json_object_set_new(o, "workload", json_string(b->opt.wl->name));
        json_object_set_new(o, "ranks", json_integer(b->R));
        /* The GPUs the ranks use (host backend: every rank binds device 0); the device
         * figure is the whole op either way: one exec serves every rank. */
        json_object_set_new(o, "devices", json_integer(cuda ? b->opt.devices : 1));
        json_object_set_new(o, "daemon_devices", json_integer(ri->devices));
        json_object_set_new(o, "backend", json_string(ri->backend));
        json_object_set_new(o, "mps", json_string(ri->mps));
        json_object_set_new(o, "mps_detail", json_string(ri->mps_detail));
        json_object_set_new(o, "device_name", json_string(ri->device_name));
        json_object_set_new(o, "memory", json_string(b->opt.device_memory ? "device"
                                                                           : "host"));
        json_object_set_new(o, "alloc", json_string(!b->opt.device_memory ? "memfd"
                                                    : b->opt.cumem ? "cumem" : "cudamalloc"));
        json_object_set_new(o, "completion", json_string(b->phase_stream[p]
                                                                ? "stream" : "host"));
        json_object_set_new(o, "flush_l2", json_boolean(b->opt.flush_l2));
        if (b->opt.poll_us_set)
                json_object_set_new(o, "daemon_poll_us", json_integer(b->opt.poll_us));
        else
                json_object_set_new(o, "daemon_poll_us", json_string("default"));
        /* libepd's settings as the workers saw them (unset: libepd's defaults). */
        const char *reply_env = getenv("EPD_CLIENT_REPLY");
        const char *request_env = getenv("EPD_CLIENT_REQUEST");
        const char *poll_env = getenv("EPD_CLIENT_POLL_US");
        const char *spin_env = getenv("EPD_CLIENT_SPIN_US");
        json_object_set_new(o, "client_reply", json_string(reply_env ? reply_env : "default"));
        json_object_set_new(o, "client_request",
                            json_string(request_env ? request_env : "default"));
        json_object_set_new(o, "client_poll_us", json_string(poll_env ? poll_env : "default"));
        json_object_set_new(o, "client_spin_us", json_string(spin_env ? spin_env : "default"));
        json_object_set_new(o, "extra_regions", json_integer(b->opt.extra_regions));
        json_object_set_new(o, "git_rev", json_string(epd_git_rev));
        json_object_set_new(o, "tokens", json_integer(b->T));
        json_object_set_new(o, "nominal_tokens", json_integer(b->opt.wl->tokens));
        json_object_set_new(o, "scaled", json_boolean(ri->scaled));
        json_object_set_new(o, "hidden", json_integer(b->H));
        json_object_set_new(o, "topk", json_integer(b->K));
        json_object_set_new(o, "experts", json_integer(b->E));
        json_object_set_new(o, "dtype", json_string(dtype_name(b->opt.wl->dtype)));
        json_object_set_new(o, "layout", json_string(b->opt.layout == EPD_LAYOUT_EXPAND
                                                             ? "expand" : "non-expand"));
        json_object_set_new(o, "outputs", json_string(b->opt.use_arena ? "arena"
                                                                       : "regions"));
        json_object_set_new(o, "seed", json_integer((json_int_t)b->opt.seed));
        json_object_set_new(o, "iters", json_integer(b->opt.iters));
        json_object_set_new(o, "warmup", json_integer(b->opt.warmup));
        json_object_set_new(o, "host_threads", json_integer(b->threads));
        json_object_set_new(o, "cpus", json_integer(b->cpus));
        json_object_set_new(o, "verified", json_true());
        json_object_set_new(o, "rows", json_integer((json_int_t)ri->bytes.rows));
        json_object_set_new(o, "logical_bytes", json_integer((json_int_t)ri->bytes.logical[k]));
        json_object_set_new(o, "floor_bytes", json_integer((json_int_t)ri->bytes.floor[k]));
        json_object_set_new(o, "data_bytes", json_integer((json_int_t)ri->bytes.data));
        json_object_set_new(o, cuda ? "gpu_l2_bytes" : "llc_bytes",
                            json_integer((json_int_t)ri->llc));
        json_object_set_new(o, "time_basis", json_string(b->kernel_time ? "kernel_ns"
                                                                         : "exec_ns"));
        json_object_set_new(o, "kernel_time_p50_us", json_real(st->exec_p50));
        json_object_set_new(o, "kernel_time_p99_us", json_real(st->exec_p99));
        json_object_set_new(o, "e2e_p50_us", json_real(st->e2e_p50));
        json_object_set_new(o, "e2e_p99_us", json_real(st->e2e_p99));
        json_object_set_new(o, "e2e_max_us", json_real(st->e2e_max));
        json_object_set_new(o, "daemon_overhead_p50_us", json_real(st->ovh_p50));
        json_object_set_new(o, "daemon_overhead_p99_us", json_real(st->ovh_p99));
        json_object_set_new(o, "daemon_overhead_last_submitter_p50_us",
                            json_real(st->last_ovh_p50));
        json_object_set_new(o, "daemon_overhead_last_submitter_p99_us",
                            json_real(st->last_ovh_p99));
        json_object_set_new(o, "daemon_overhead_group_p50_us", json_real(st->group_ovh_p50));
        json_object_set_new(o, "daemon_overhead_group_p99_us", json_real(st->group_ovh_p99));
        json_object_set_new(o, "replies_in_doorbell", json_real(st->replies_in_doorbell));
        json_object_set_new(o, "requests_in_doorbell", json_real(st->requests_in_doorbell));
        json_object_set_new(o, "queue_p50_us", json_real(st->queue_p50));
        json_object_set_new(o, "last_submitter_queue_p50_us", json_real(st->last_queue_p50));
        json_object_set_new(o, "last_submitter_host_exec_p50_us",
                            json_real(st->last_host_exec_p50));
        json_object_set_new(o, "last_submitter_socket_loop_p50_us", json_real(st->last_rest_p50));
        json_t *tl = json_object();
        for (int j = 0; j < TL_STEPS; j++)
                json_object_set_new(tl, tl_step_names[j], json_real(st->last_tl_p50[j]));
        json_object_set_new(o, "last_submitter_timeline_p50_us", tl);
        json_object_set_new(o, "logical_gbps", json_real(lg));
        json_object_set_new(o, "floor_gbps", json_real(fl));
        json_object_set_new(o, "floor_fraction_of_ceiling", json_real(fl / ri->ceiling));
        json_object_set_new(o, "ceiling_kind", json_string(cuda ? "d2d_copy"
                                                                : "host_memcpy"));
        json_object_set_new(o, "unique_bytes", json_integer((json_int_t)ri->bytes.unique[k]));
        json_object_set_new(o, "unique_gbps", json_real(un));
        json_object_set_new(o, "unique_fraction_of_ceiling", json_real(un / ri->ceiling));
        json_object_set_new(o, "ceiling_memcpy_gbps", json_real_or_null(ri->ceiling, !cuda));
        json_object_set_new(o, "ceiling_memcpy_probes",
                            cuda ? json_null() : json_integer(ri->num_probes));
        json_object_set_new(o, "ceiling_memcpy_initial_gbps",
                            json_real_or_null(ri->ceiling_initial, !cuda));
        json_object_set_new(o, "ceiling_memcpy_min_gbps",
                            json_real_or_null(ri->ceiling_min, !cuda));
        json_object_set_new(o, "ceiling_memcpy_best_gbps",
                            json_real_or_null(ri->ceiling_best, !cuda));
        json_object_set_new(o, "floor_fraction_of_best_ceiling",
                            json_real(fl / ri->ceiling_best));
        json_object_set_new(o, "ceiling_buffer_bytes",
                            json_integer((json_int_t)(cuda ? D2D_BYTES : CEILING_BYTES)));
        json_object_set_new(o, "ceiling_threads", cuda ? json_null()
                                                       : json_integer(b->threads));
        json_object_set_new(o, "ceiling_d2d_gbps", json_real_or_null(ri->ceiling, cuda));
        json_object_set_new(o, "ceiling_d2d_before_gbps",
                            json_real_or_null(ri->ceiling_initial, cuda));
        json_object_set_new(o, "ceiling_d2d_after_gbps",
                            json_real_or_null(ri->d2d_after, cuda));
        json_object_set_new(o, "ceiling_d2d_min_gbps",
                            json_real_or_null(ri->ceiling_min, cuda));
        json_object_set_new(o, "ceiling_d2d_best_gbps",
                            json_real_or_null(ri->ceiling_best, cuda));
        json_object_set_new(o, "ceiling_d2d_copies",
                            cuda ? json_integer(ri->num_probes) : json_null());
        json_object_set_new(o, "daemon_workspace_bytes",
                            cuda ? json_integer((json_int_t)ri->ws_bytes) : json_null());
        json_object_set_new(o, "daemon_workspace_bytes_per_rank",
                            cuda ? json_integer((json_int_t)(ri->ws_bytes / b->R))
                                 : json_null());
        json_object_set_new(o, "arena_bytes_per_rank",
                            json_integer((json_int_t)b->arena_bytes));
        /* --devices >= 2 in CUDA mode: the P2P store ceiling and the op's cross-GPU floor bytes
         * (the file comment); null otherwise, and a fraction only with a concurrent figure. */
        {
                const int p2p = ri->p2p && ri->bytes.cross_valid;
                const int timed = st->exec_p50 > 0;
                double cg = timed ? (double)ri->bytes.cross[k] / (st->exec_p50 * 1e3) : 0;
                json_t *dev = NULL;

                if (p2p && ri->ring.ok) {
                        dev = json_array();
                        for (uint32_t d = 0; d < b->opt.devices; d++)
                                json_array_append_new(dev, json_real(ri->ring_dev[d]));
                }
                json_object_set_new(o, "p2p_store_pairs", p2p ? p2p_pairs_json(b, ri)
                                                              : json_null());
                json_object_set_new(o, "p2p_store_concurrent_gbps",
                                    json_real_or_null(ri->ring.gbps, p2p && ri->ring.ok));
                json_object_set_new(o, "p2p_store_concurrent_device_gbps",
                                    dev ? dev : json_null());
                json_object_set_new(o, "p2p_store_bytes",
                                    p2p ? json_integer((json_int_t)P2P_BYTES) : json_null());
                json_object_set_new(o, "cross_gpu_floor_bytes",
                                    p2p ? json_integer((json_int_t)ri->bytes.cross[k])
                                        : json_null());
                json_object_set_new(o, "cross_gpu_floor_gbps", json_real_or_null(cg, p2p && timed));
                json_object_set_new(o, "cross_gpu_fraction_of_p2p",
                                    json_real_or_null(ri->ring.gbps > 0 ? cg / ri->ring.gbps : 0,
                                                      p2p && timed && ri->ring.ok &&
                                                              ri->ring.gbps > 0));
        }
        s = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (s)
                printf("%s\n", s);
        free(s);
        json_decref(o);
}

static void print_json(const struct bench *b, const struct run_info *ri)
{
        for (uint32_t p = 0; p < b->num_phases; p++)
                for (int k = 0; k < 2; k++)
                        print_json_one(b, ri, p, k);
        fflush(stdout);
}

/* ---- main ---- */

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

/* Starts build/bin/epd as tests/lib/harness.c does, but waits up to timeout_ms for its socket: the
 * CUDA backend creates a context on every GPU and loads the kernels before it listens. The
 * struct is h_daemon_stop's. */
static int daemon_start(struct h_daemon *d, const char *const *extra, int timeout_ms)
{
        char epd[PATH_MAX];
        const char *argv[32];
        int argc = 0;
        uint64_t deadline;

        memset(d, 0, sizeof(*d));
        snprintf(d->dir, sizeof(d->dir), "/tmp/epd-bench-XXXXXX");
        if (!mkdtemp(d->dir)) {
                fprintf(stderr, "epd-bench: mkdtemp: %s\n", strerror(errno));
                return -1;
        }
        snprintf(d->socket, sizeof(d->socket), "%s/epd.sock", d->dir);
        snprintf(d->log, sizeof(d->log), "%s/epd.log", d->dir);
        /* EPD_BENCH_DAEMON: another epd binary, for comparing two daemons on one machine. */
        if (getenv("EPD_BENCH_DAEMON") != NULL)
                snprintf(epd, sizeof(epd), "%s", getenv("EPD_BENCH_DAEMON"));
        else
                snprintf(epd, sizeof(epd), "%s/epd", h_bin_dir());
        argv[argc++] = epd;
        argv[argc++] = "--socket";
        argv[argc++] = d->socket;
        argv[argc++] = "--config";
        argv[argc++] = "/dev/null";
        for (int i = 0; extra[i] && argc < 31; i++)
                argv[argc++] = extra[i];
        argv[argc] = NULL;
        d->pid = fork();
        if (d->pid < 0) {
                fprintf(stderr, "epd-bench: fork: %s\n", strerror(errno));
                rmdir(d->dir);
                return -1;
        }
        if (d->pid == 0) {
                int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
                if (fd >= 0) {
                        dup2(fd, STDERR_FILENO);
                        dup2(fd, STDOUT_FILENO);
                }
                unsetenv("JOURNAL_STREAM");
                unsetenv("NOTIFY_SOCKET");
                unsetenv("LISTEN_FDS");
                execv(epd, (char *const *)argv);
                _exit(127);
        }
        deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
        while (now_ns() < deadline) {
                struct sockaddr_un sa;
                int status, fd;

                if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
                        fprintf(stderr, "epd-bench: %s exited during start-up (%s %d)\n", epd,
                                WIFEXITED(status) ? "exit status" : "signal",
                                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
                        h_daemon_dump_log(d);
                        d->pid = 0;
                        unlink(d->log);
                        unlink(d->socket);
                        rmdir(d->dir);
                        return -1;
                }
                memset(&sa, 0, sizeof(sa));
                sa.sun_family = AF_UNIX;
                snprintf(sa.sun_path, sizeof(sa.sun_path), "%.107s", d->socket);
                fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0); /* as epd listens */
                if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
                        close(fd);
                        return 0;
                }
                if (fd >= 0)
                        close(fd);
                usleep(10000);
        }
        fprintf(stderr, "epd-bench: %s did not accept connections within %d ms\n", epd,
                timeout_ms);
        h_daemon_dump_log(d);
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
        d->pid = 0;
        unlink(d->log);
        unlink(d->socket);
        rmdir(d->dir);
        return -1;
}

/* ---- CUDA mode: the device-to-device copy ceiling and the GPU probe, in a forked child ---- */

/* What the child reports, through a shared anonymous mapping. */
struct d2d_report {
        int status;             /* 0: every measurement made; else err says why */
        char err[512];
        int device_count;
        char name[128];         /* device 0 */
        uint64_t l2_bytes;      /* device 0 */
        uint32_t num_devices;   /* measured */
        double rates[D2D_MAX_DEVICES][D2D_REPS]; /* GB/s, bytes read + written */
        /* --devices >= 2 (p2p_tried): the peer-to-peer store ceiling, GB/s of bytes stored, every
         * timed launch. Status per ordered pair [src][dst] and of the all-at-once ring: 0
         * measured, EPD_BENCH_P2P_NO_PEER (no peer access) or -1 (a CUDA failure), with the
         * reason in *_err. A failure here is reported, not fatal: the ops do not need it. */
        int p2p_tried;
        int p2p_status[D2D_MAX_DEVICES][D2D_MAX_DEVICES];
        char p2p_err[D2D_MAX_DEVICES][D2D_MAX_DEVICES][160];
        double p2p_rates[D2D_MAX_DEVICES][D2D_MAX_DEVICES][P2P_REPS];
        int ring_status;
        char ring_err[256];
        int ring_serialized;    /* timed rounds whose kernels did not overlap */
        double ring_rates[P2P_REPS]; /* the aggregate of each round */
        double ring_dev_rates[D2D_MAX_DEVICES][P2P_REPS];
};

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
static int d2d_run(uint32_t num_devices, struct d2d_report *out)
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

static double median_of(const double *v, unsigned n);

/* The ceiling from the copies before and after the workers: per device the median of all its
 * copies, the slowest device's median the ceiling (ranks on one GPU are bounded by it). */
static void d2d_summary(const struct d2d_report *before, const struct d2d_report *after,
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
static void p2p_summary(const struct d2d_report *before, const struct d2d_report *after,
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
static void p2p_log_before(const struct d2d_report *rep, uint32_t num_devices)
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

/* MPS: a CUDA client runs under MPS when the control daemon answers on the pipe directory
 * ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps) of its environment; the workers and the daemon
 * inherit this process's environment. Asking the control daemon for its server list is the
 * test (the named pipe `control` alone may be stale). */
static void detect_mps(struct run_info *ri)
{
        epd_bench_mps_state(ri->mps, sizeof(ri->mps), ri->mps_detail, sizeof(ri->mps_detail));
}

static double median_of(const double *v, unsigned n)
{
        double *c = malloc((n ? n : 1) * sizeof(double)), m;

        if (!c || n == 0) {
                free(c);
                return 0;
        }
        memcpy(c, v, n * sizeof(double));
        qsort(c, n, sizeof(double), cmp_double);
        m = c[n / 2];
        free(c);
        return m;
}

/* Summarises the ceiling: the first CEILING_REPS copies ran before the workers started, the
 * rest interleaved with the ops. */
static void ceiling_summary(const struct ceiling *c, struct run_info *ri)
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
        struct h_daemon daemon;
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
        fprintf(stderr, "epd-bench: generating inputs and the reference\n");
        if (make_inputs(&b) < 0 || build_reference(&b) < 0 || make_y(&b) < 0)
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
        b.samples_bytes = (size_t)b.R * b.total_iters * 2 * sizeof(struct sample);
        b.samples = mmap(NULL, b.samples_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
        if (b.samples == MAP_FAILED) {
                b.samples = NULL;
                goto out;
        }

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
                        fprintf(stderr, "epd-bench: starting %s/epd --backend cuda\n", h_bin_dir());
                else
                        fprintf(stderr, "epd-bench: starting %s/epd --backend host "
                                        "--host-threads %u\n", h_bin_dir(), b.threads);
                if (daemon_start(&daemon, b.opt.cuda ? cuda_args : host_args,
                                 DAEMON_START_MS) < 0)
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
                detect_mps(&ri);
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
                        h_daemon_dump_log(&daemon);
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
                int rc = h_daemon_stop(&daemon, 30000);
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
        ref_dispatch_free(b.ref);
        free(b.ranks);
        free(b.to_parent);
        free(b.from_parent);
        free(pids);
        return status;
}
