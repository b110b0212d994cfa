/* bench.h - epd-bench's internals, shared by its files: the run's options and state, the shapes
 * of its measurements, and each file's entry points. Nothing outside bench/ includes it.
 *
 *   main.c          the parent process: data, daemon, workers, sync points, results
 *   options.c       the command line
 *   data.c          every rank's inputs in shared memfds, the plan, byte counts
 *   ceilings.c      the host memcpy, device-to-device copy and P2P store ceilings
 *   cuda_util.c     a worker's CUDA side (device memory, L2 flush, stream completion)
 *   worker.c        one rank's process: group, regions, ops, the check of iteration 0
 *   worker_cx.c     the same for --execution client: the rank runs its own ops (epd_cx_*)
 *   stats.c         percentiles and the per-op statistics of the samples
 *   report_table.c  the table (stdout, or stderr with --json)
 *   report_json.c   the JSON lines
 */
#ifndef EPD_BENCH_BENCH_H
#define EPD_BENCH_BENCH_H

#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <time.h>

#ifdef EPD_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "epd.h"

struct oracle;
struct daemon_proc;

/* The model shape of docs/benchmarks.md, common to every workload. */
#define BENCH_HIDDEN 7168u
#define BENCH_TOPK 8u
#define BENCH_EXPERTS 256u
#define BENCH_SCALE_BLOCK 128u

/* The memcpy ceiling: docs/benchmarks.md asks for buffers of at least 1 GiB. CEILING_REPS copies
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

/* How a worker learns that an op completed (docs/benchmarks.md's client-observed time
 * ends there). */
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
        enum epd_execution execution; /* --execution: who runs the ops */
        int start_given;
        int start_free;         /* --start free: client-executed ranks on one GPU launch each
                                 * op when they get to it, with no start gate */
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
        /* --execution client on cuda: the kernel's start on the GPU's %globaltimer (kernel_ns is
         * its length), so that the windows of ranks on one GPU compare; else 0. */
        uint64_t gpu_start_ns;
};

/* --execution client on cuda: the start gate every rank's stream waits on before each op, so
 * that the op starts on every rank at once, after every rank's L2 flush, however late the
 * processes' launches are (docs/benchmarks.md), and what each rank reports at its end. One page
 * of the shared samples mapping, registered with CUDA by each worker. */
#define GATE_RANKS 64u /* ranks whose reports fit the gate's page (--ranks is at most 64) */
#define FIRST_PARTS (sizeof(((struct epd_cx_status *)0)->dispatch_first_ns) / sizeof(uint64_t))

struct cx_gate {
        uint64_t armed;         /* launches made, every rank, every op (atomic) */
        uint64_t pad[7];
        uint64_t open;          /* the ops let start: op s (from 1) waits for open >= s */
        uint64_t pad2[7];
        /* Each rank's launch floor (bench/launch_floor.cu), us, measured after its ops. */
        double launch_floor_us[GATE_RANKS];
        /* Each rank's mean time per OK dispatch in each part of its first phase
         * (epd_cx_status.dispatch_first_ns), us. */
        double first_us[GATE_RANKS][FIRST_PARTS];
};
_Static_assert(sizeof(struct cx_gate) <= 4096, "the gate is one page of the samples mapping");

struct bench {
        struct options opt;
        uint32_t R, T, H, K, E, scale_cols, cpus, threads;
        uint64_t row_bytes;     /* bytes of one x row */
        struct rank_data *ranks;
        struct oracle *oracle;  /* the plan of the run's dispatch, for the check of iteration 0 */
        char socket[PATH_MAX];
        char group_name[64];
        unsigned char secret[16]; /* the group's, drawn at random by the parent */
        uint64_t arena_bytes;
        uint32_t total_iters;
        uint32_t probe_every;   /* measured iterations between ceiling probes */
        /* The op time of docs/benchmarks.md: the GPU kernel time when the backend reports it for
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
        /* --execution client: each rank's mean time per op in the phases of
         * epd_cx_status (records exchanged, rows moved, end signals), us; [R][op][phase],
         * MAP_SHARED with the workers (part of the samples mapping). */
        double (*cx_phase_us)[2][3];
        struct cx_gate *gate;   /* page-aligned, in the samples mapping */
        /* Client-executed on cuda with every rank on one GPU: the workers start each op at the
         * gate and report their kernels' windows on that GPU's clock. */
        int cx_one_gpu;
        /* The op time of a measured op is the device figure: the first rank's start to the last
         * rank's end on the GPU's clock (cx_one_gpu, and every window reported). */
        int device_window;
        int (*to_parent)[2];    /* [R] pipes: a worker says it reached a sync point */
        int (*from_parent)[2];  /* [R] pipes: the parent lets it go on */
};

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

/* ---- ceilings.c ---- */

struct copy_job {
        uint8_t *dst;
        const uint8_t *src;
        size_t bytes;
};

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

/* ---- stats.c ---- */

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

/* ---- cuda_util.c ---- */

enum { COPY_H2D, COPY_D2H, COPY_D2D };

struct wcuda {
        int on;
        uint32_t device;        /* CUDA ordinal = the daemon's device index (same machine) */
#ifdef EPD_BENCH_CUDA
        cudaStream_t stream;
        cudaEvent_t ev;
#endif
        uint8_t *flush;         /* FLUSH_BYTES, Fresh mode only */
        struct cx_gate *gate;   /* registered with CUDA (wc_gate_init), else NULL */
        uint64_t gate_dev;      /* its device address */
        uint8_t *d_in, *d_y, *d_out, *d_comb; /* --device-memory */
        int cumem;              /* --alloc cumem: the four above come from epd_device_alloc */
};


/* ---- main.c: what the signal handler takes down if the user interrupts the run ---- */

extern volatile pid_t g_daemon_pid;
extern const struct daemon_proc *volatile g_daemon;
extern volatile pid_t *g_worker_pids;
extern volatile uint32_t g_num_workers;

static inline uint64_t now_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t align64(uint64_t v)
{
        return (v + 63) / 64 * 64;
}

/* ---- options.c ---- */

void usage(FILE *f);
/* Fills *o from the command line: 0, or -1 after a message (exits 0 for --help). */
int parse_args(int argc, char **argv, struct options *o);

/* ---- data.c: before the workers are forked ---- */

int shm_alloc(struct shm_buf *b, uint64_t bytes);
void shm_free(struct shm_buf *b);
/* Every rank's inputs, the plan of their dispatch (b->oracle, and each rank's rows), the y
 * buffers; 0 or -1 after a message. */
int make_inputs(struct bench *b);
int build_oracle(struct bench *b);
int make_y(struct bench *b);
void count_bytes(const struct bench *b, struct byte_counts *c);
uint64_t arena_need(const struct bench *b, uint64_t rows);

/* ---- ceilings.c ---- */

uint64_t llc_bytes(void);
int ceiling_init(struct ceiling *c, unsigned threads, uint64_t bytes, unsigned max_rates);
double ceiling_copy(struct ceiling *c, int record);
void ceiling_free(struct ceiling *c);
void ceiling_summary(const struct ceiling *c, struct run_info *ri);
int d2d_run(uint32_t num_devices, struct d2d_report *out);
void d2d_summary(const struct d2d_report *before, const struct d2d_report *after,
                 uint32_t num_devices, struct run_info *ri);
void p2p_summary(const struct d2d_report *before, const struct d2d_report *after,
                 uint32_t num_devices, struct run_info *ri);
void p2p_log_before(const struct d2d_report *rep, uint32_t num_devices);

#ifdef EPD_BENCH_CUDA
/* bench/p2p_store.cu (its comments say what they measure; keep these declarations in step). */
#define EPD_BENCH_P2P_NO_PEER 1 /* the pair cannot reach each other's memory: skipped */
int epd_bench_p2p_store(int src_dev, int dst_dev, uint64_t bytes, int reps, double *rates,
                        double *gbps, char *err, size_t err_len);
int epd_bench_p2p_store_ring(int num_devices, uint64_t bytes, int reps, double *rates,
                             double *device_rates, double *gbps, double *device_gbps,
                             int *serialized, char *err, size_t err_len);
#endif

/* ---- cuda_util.c: in workers and the ceiling children only, never in the parent ----
 *
 * Each returns 0, or -1 with the reason in err. */

#ifdef EPD_BENCH_CUDA
int cu_ok(cudaError_t e, const char *what, char *err, size_t len);
/* In a function with char *err and size_t len: returns -1 when the call fails. */
#define CU_TRY(call, what)                                      \
        do {                                                    \
                if (cu_ok((call), (what), err, len) < 0)        \
                        return -1;                              \
        } while (0)
#endif
void *wc_stream(const struct wcuda *wc);
int wcuda_init(struct wcuda *wc, const struct bench *b, uint32_t rank, char *err, size_t len);
void wcuda_fini(struct wcuda *wc);
int dev_alloc_register(struct epd_client *c, struct wcuda *wc, uint64_t bytes, uint8_t **out,
                       uint64_t *region, char *err, size_t len);
int dev_copy(void *dst, const void *src, uint64_t bytes, int kind, char *err, size_t len);
int dev_fill(void *dst, int value, uint64_t bytes, char *err, size_t len);
int dev_flush(struct wcuda *wc, uint32_t seq, char *err, size_t len);
int stream_complete(struct wcuda *wc, struct epd_op *op, char *err, size_t len);

/* ---- worker.c ---- */

/* In a worker function with `rank`, `b` and an `out:` label: reports and leaves. */
#define WFAIL(...)                                                                      \
        do {                                                                            \
                fprintf(stderr, "epd-bench rank %u (seed %llu): ", rank,                \
                        (unsigned long long)b->opt.seed);                               \
                fprintf(stderr, __VA_ARGS__);                                           \
                fprintf(stderr, "\n");                                                  \
                goto out;                                                               \
        } while (0)

/* The clean order at a worker's end: the daemon lets go of device memory before it is freed
 * (epd_device_free does both for --alloc cumem; else the regions are released and
 * wcuda_fini frees the memory). bufs[i] and regions[i] belong together. */
void dev_release(struct epd_client *client, const struct wcuda *wc, uint8_t **const *bufs,
                 uint64_t *regions, int n);
/* A worker's start: every rank's y as the oracle reads it (*ybufs[R], the caller frees), its
 * connection, its group, then CUDA when the run needs it (*wc). 0, or -1 with the reason in err
 * (what was made is the caller's to free). */
int worker_start(const struct bench *b, uint32_t rank, const void ***ybufs,
                 struct epd_client **client, struct epd_group **group, struct wcuda *wc,
                 char *err, size_t len);
/* Creates (rank 0) or joins the run's group, in the run's execution mode. */
int enter_group(const struct bench *b, struct epd_client *client, uint32_t rank,
                struct epd_group **out);

/* Whether parent and workers meet after iteration it, and whether the parent then probes the
 * ceiling (*probe); the phase of iteration it. */
int sync_after(const struct bench *b, uint32_t it, int *probe);
uint32_t phase_of(const struct bench *b, uint32_t it);
/* The whole life of rank's worker process; its exit status. */
int worker_run(struct bench *b, uint32_t rank);
/* Tells the parent this worker is at a sync point and blocks until it says go on. */
int worker_sync(const struct bench *b, uint32_t rank);

/* ---- worker_cx.c ---- */

/* worker_run for --execution client. */
int worker_run_cx(struct bench *b, uint32_t rank);
/* CUDA mode: waits for the work queued on the worker's stream. */
int wc_sync(struct wcuda *wc, char *err, size_t len);
/* The start gate (struct cx_gate): registered once; then before each op the stream waits until
 * gate->open reaches seq. */
int wc_gate_init(struct wcuda *wc, struct cx_gate *gate, char *err, size_t len);
int wc_gate_wait(struct wcuda *wc, uint64_t seq, char *err, size_t len);
/* The median of n launch-to-synchronised round trips of an empty kernel on the worker's stream,
 * us (bench/launch_floor.cu). */
int wc_launch_floor(struct wcuda *wc, unsigned n, double *p50_us, char *err, size_t len);

/* ---- stats.c ---- */

extern const char *const tl_step_names[TL_STEPS];
int cmp_double(const void *a, const void *b);
double median_of(const double *v, unsigned n);
/* The median over the ranks of their launch floors (struct cx_gate), us. */
double launch_floor_us(const struct bench *b);
void op_stats(const struct bench *b, uint32_t phase, int kind, struct op_stats *st);

/* ---- report_table.c, report_json.c ---- */

const char *dtype_name(enum epd_dtype d);
const char *phase_name(const struct bench *b, uint32_t p);
void print_table(const struct bench *b, const struct run_info *ri, FILE *f);
void print_json(const struct bench *b, const struct run_info *ri);

#endif
