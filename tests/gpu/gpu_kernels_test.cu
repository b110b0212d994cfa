/* gpu_kernels_test.cu - the CUDA dispatch/combine kernels against the host backend, bit for bit.
 *
 * A standalone binary (no Check, no CTest at run time). For each case of a matrix (ranks 1..16
 * co-located on GPU 0, and spread over GPUs when there are several with peer access; both
 * layouts; bf16 and fp8 with scales; alignments; zero padding; weights; -1 entries; int32/int64
 * topk_idx; strided rows; 0/1/2 biases; apply_weights; cached dispatch; capacity and validation
 * failures; one realistic prefill-sized case) it generates seeded inputs, computes the reference
 * with cpu/plan.c + cpu/exec.c, runs the kernels with the daemon-mode sequencing of
 * epd_kernels.h (count, event, prefix, event, place + copy), and compares every output buffer over
 * its whole capacity, so bytes that must stay untouched are checked too (outputs start as a
 * sentinel on both sides). Each case runs twice and the two runs must give identical bits.
 *
 * Exit: 0 when every case passes, 1 on any failure, 77 when no GPU is present (CTest skip).
 * Options: --quick (skip the realistic case), --case N (only case N), --seed S (base seed),
 *          --no-timing, --list. Environment EPD_KTEST_MATCH=S: only the cases whose name
 *          contains S (and not the ordering checks).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

extern "C" {
#include "exec.h"
#include "plan.h"
}
#include "epd_kernels.h"
#include "layout.h"
#include "ordering.cuh"

#define MAX_DEV 8
#define SENTINEL 0xA5
#define WS_GARBAGE_1 0xCD
#define WS_GARBAGE_2 0x5A

/* ---- small utilities ---- */

#define CK(call)                                                                           \
        do {                                                                               \
                cudaError_t e_ = (call);                                                   \
                if (e_ != cudaSuccess) {                                                   \
                        fprintf(stderr, "    CUDA error %s at %s:%d: %s\n",                \
                                cudaGetErrorName(e_), __FILE__, __LINE__, #call);          \
                        return -1;                                                         \
                }                                                                          \
        } while (0)

#define CKS(call)                                                                          \
        do {                                                                               \
                int s_ = (call);                                                           \
                if (s_ != 0) {                                                             \
                        fprintf(stderr, "    launcher failed at %s:%d: %s -> %d (cuda %s)\n", \
                                __FILE__, __LINE__, #call, s_,                             \
                                cudaGetErrorName(epd_k_last_cuda_error()));                \
                        return -1;                                                         \
                }                                                                          \
        } while (0)

static const char *status_name(int status)
{
        switch (status) {
        case 0: return "OK";
        case EPD_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
        case EPD_CAPACITY_EXCEEDED: return "CAPACITY_EXCEEDED";
        case EPD_TIMEOUT: return "TIMEOUT";
        case EPD_ABORTED: return "ABORTED";
        case EPD_INTERNAL: return "INTERNAL";
        case EPD_UNAVAILABLE: return "UNAVAILABLE";
        default: return "OTHER";
        }
}

static double now_s(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct rng {
        uint64_t s;
};

static uint64_t rng_next(struct rng *r)
{
        uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static uint32_t rng_below(struct rng *r, uint32_t n)
{
        return n ? (uint32_t)(rng_next(r) % n) : 0;
}

static double rng_unit(struct rng *r)
{
        return (rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static void fill_random(struct rng *r, uint8_t *p, uint64_t n)
{
        uint64_t i = 0;
        for (; i + 8 <= n; i += 8) {
                uint64_t v = rng_next(r);
                memcpy(p + i, &v, 8);
        }
        for (; i < n; i++)
                p[i] = (uint8_t)rng_next(r);
}

/* bf16 values, four per draw: mostly finite and of moderate magnitude (so sums stay
 * meaningful), and 1 in 256 any 16-bit pattern (NaN, Inf, subnormals). */
static void fill_bf16(struct rng *r, uint16_t *p, uint64_t n)
{
        for (uint64_t i = 0; i < n; i += 4) {
                uint64_t v = rng_next(r);
                for (uint64_t j = 0; j < 4 && i + j < n; j++) {
                        uint32_t u = (uint32_t)(v >> (16 * j)) & 0xffff;
                        if ((u & 0xff) == 0x5a) {
                                /* 1 in 256: a raw pattern (NaN, Inf, subnormal, anything). */
                                p[i + j] = (uint16_t)(u ^ (uint32_t)(v >> 48));
                                continue;
                        }
                        uint32_t sign = u >> 15, expo = 112 + ((u >> 7) & 31), mant = u & 0x7f;
                        p[i + j] = (uint16_t)(sign << 15 | expo << 7 | mant);
                }
        }
}

/* A weight: mostly in (-2, 2), sometimes a subnormal, rarely NaN or Inf. */
static float random_weight(struct rng *r)
{
        uint64_t v = rng_next(r);
        float f;
        if ((v & 0x3ff) == 0) {
                uint32_t bits = (v & 0x400) ? 0x7fc00001u : 0x7f800000u;
                memcpy(&f, &bits, 4);
                return f;
        }
        if ((v & 0x3f) == 1) {
                uint32_t bits = (uint32_t)(v >> 40) & 0x007fffffu;
                memcpy(&f, &bits, 4);
                return f;
        }
        return (float)(rng_unit(r) * 4.0 - 2.0);
}

/* ---- host thread pool for the reference ---- */

struct pool_job {
        uint64_t n;
        uint64_t next;
        void (*fn)(const void *op, uint64_t item);
        const void *op;
};

static void *pool_worker(void *arg)
{
        struct pool_job *j = (struct pool_job *)arg;
        for (;;) {
                uint64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
                if (i >= j->n)
                        return NULL;
                j->fn(j->op, i);
        }
}

static void run_items(uint64_t n, void (*fn)(const void *, uint64_t), const void *op)
{
        struct pool_job job = { n, 0, fn, op };
        pthread_t th[32];
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        int nt = cpus < 1 ? 1 : cpus > 32 ? 32 : (int)cpus, started = 0;

        if (n < 64)
                nt = 1;
        for (int i = 1; i < nt; i++)
                if (pthread_create(&th[started], NULL, pool_worker, &job) == 0)
                        started++;
        pool_worker(&job);
        for (int i = 0; i < started; i++)
                pthread_join(th[i], NULL);
}

static void host_dispatch_fn(const void *op, uint64_t i)
{
        epd_host_dispatch_item((const struct epd_dispatch_exec *)op, i);
}

static void host_combine_fn(const void *op, uint64_t i)
{
        epd_host_combine_item((const struct epd_combine_exec *)op, i);
}

/* ---- cases ---- */

struct tcase {
        const char *name;
        uint32_t R, E, T, K, KO, H; /* K: group max_topk; KO: the op's K_op */
        enum epd_dtype dtype;       /* BF16 or FP8_E4M3 */
        uint32_t scale_block;
        enum epd_layout layout;
        uint32_t align;
        int zero_padding;
        int has_weights;
        enum epd_dtype topk_dtype;
        double neg_frac;            /* probability of a -1 entry */
        int num_bias;
        int apply_weights;
        int spread;                 /* ranks over all GPUs */
        int short_rank;             /* >= 0: this rank's capacity is one row short */
        int invalid;                /* 1: an id out of range (and a later duplicate); 2: a duplicate */
        int worst_case_capacity;    /* outputs sized for the worst case instead of exact + slack */
        int strided;                /* padded row strides for inputs and outputs */
        uint32_t y_pad;             /* bytes added to y's row stride (2: most rows of y off
                                     * 16-byte alignment) */
        int skew;                   /* 1: every token prefers rank 0's experts */
        int empty_rank;             /* a rank with no tokens */
        uint32_t empty_mask;        /* more ranks without tokens: bit s for rank s */
        int cached;                 /* also run a cached dispatch with new weights */
        int big;                    /* the realistic case: timed, skipped by --quick */
        uint64_t seed;
        /* combine's weight inputs (docs/semantics.md §3): source_weights (w(t, k) of
         * apply_weights) on every source (1) or on even sources only (2, with dispatch
         * weights); every destination's recv_weights (NON_EXPAND) */
        int source_weights;
        int recv_weights;
};

#define MAX_CASES 128
static struct tcase cases[MAX_CASES];
static int num_cases;

static struct tcase *add_case(const char *name)
{
        struct tcase *c = &cases[num_cases++];
        memset(c, 0, sizeof(*c));
        c->name = name;
        c->R = 2;
        c->E = 16;
        c->T = 96;
        c->K = 4;
        c->KO = 4;
        c->H = 256;
        c->dtype = EPD_DTYPE_BF16;
        c->scale_block = 128;
        c->layout = EPD_LAYOUT_NON_EXPAND;
        c->align = 1;
        c->topk_dtype = EPD_DTYPE_INT64;
        c->short_rank = -1;
        return c;
}

static void build_cases(void)
{
        static const uint32_t ranks[] = { 1, 2, 4, 8 };
        int idx = 0;

        /* The matrix: ranks x layout x dtype, with the other knobs rotating. */
        for (int ri = 0; ri < 4; ri++) {
                for (int lay = 0; lay < 2; lay++) {
                        for (int dt = 0; dt < 2; dt++, idx++) {
                                struct tcase *c = add_case("matrix");
                                c->R = ranks[ri];
                                c->E = ranks[ri] * (idx % 3 == 0 ? 4 : 8);
                                c->T = 64 + 37 * (uint32_t)idx;
                                c->K = 8;
                                c->KO = (idx % 4 == 3) ? 6 : 8;
                                if (c->KO > c->E)
                                        c->KO = c->E;
                                c->H = dt ? 384 : 256 + 64 * (uint32_t)(idx % 3);
                                c->dtype = dt ? EPD_DTYPE_FP8_E4M3 : EPD_DTYPE_BF16;
                                c->layout = lay ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND;
                                c->align = (lay && idx % 2 == 0) ? 128 : (lay ? 8 : 1);
                                c->zero_padding = lay && (idx / 2) % 2 == 0;
                                c->has_weights = idx % 4 != 1;
                                c->topk_dtype = idx % 2 ? EPD_DTYPE_INT32 : EPD_DTYPE_INT64;
                                c->neg_frac = idx % 3 == 1 ? 0.25 : 0.0;
                                c->num_bias = idx % 3;
                                c->apply_weights = lay && c->has_weights && idx % 2 == 0;
                                c->strided = idx % 5 == 2;
                                c->cached = idx % 6 == 5;
                                c->seed = 0x1000 + idx;
                        }
                }
        }

        struct tcase *c;
        c = add_case("alignment 1 expand, no weights, all -1 rows common");
        c->R = 4; c->E = 32; c->T = 200; c->KO = c->K = 4; c->layout = EPD_LAYOUT_EXPAND;
        c->neg_frac = 0.6; c->num_bias = 2; c->seed = 0x2001;
        c = add_case("max experts 2048, L 256, expand align 128 zero padding");
        c->R = 8; c->E = 2048; c->T = 128; c->K = 8; c->KO = 8; c->layout = EPD_LAYOUT_EXPAND;
        c->align = 128; c->zero_padding = 1; c->has_weights = 1; c->apply_weights = 1;
        c->seed = 0x2002;
        c = add_case("max experts 2048 non-expand");
        c->R = 8; c->E = 2048; c->T = 128; c->K = 8; c->KO = 8; c->has_weights = 1;
        c->seed = 0x2003;
        c = add_case("top-k 32");
        c->R = 4; c->E = 64; c->T = 77; c->K = 32; c->KO = 32; c->has_weights = 1;
        c->neg_frac = 0.1; c->topk_dtype = EPD_DTYPE_INT32; c->seed = 0x2004;
        c = add_case("top-k 32 expand");
        c->R = 4; c->E = 64; c->T = 77; c->K = 32; c->KO = 32; c->has_weights = 1;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 4; c->apply_weights = 1; c->seed = 0x2005;
        c = add_case("16 ranks co-located");
        c->R = 16; c->E = 64; c->T = 150; c->K = 8; c->KO = 8; c->has_weights = 1;
        c->num_bias = 1; c->seed = 0x2006;
        c = add_case("16 ranks expand");
        c->R = 16; c->E = 64; c->T = 150; c->K = 8; c->KO = 8; c->has_weights = 1;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 16; c->zero_padding = 1; c->seed = 0x2007;
        c = add_case("skew: every token to rank 0, empty rank");
        c->R = 4; c->E = 32; c->T = 300; c->K = 4; c->KO = 4; c->skew = 1; c->empty_rank = 1;
        c->has_weights = 1; c->seed = 0x2008;
        c = add_case("skew expand, worst-case capacity, strided");
        c->R = 4; c->E = 32; c->T = 300; c->K = 4; c->KO = 4; c->skew = 1;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 32; c->worst_case_capacity = 1;
        c->strided = 1; c->has_weights = 1; c->seed = 0x2009;
        c = add_case("fp8 odd scale row (12 bytes), strided");
        c->R = 2; c->E = 8; c->T = 120; c->H = 384; c->dtype = EPD_DTYPE_FP8_E4M3;
        c->strided = 1; c->has_weights = 1; c->layout = EPD_LAYOUT_EXPAND; c->align = 2;
        c->zero_padding = 1; c->seed = 0x200a;
        c = add_case("cached dispatch non-expand");
        c->R = 4; c->E = 16; c->T = 100; c->has_weights = 1; c->cached = 1; c->seed = 0x200b;
        c = add_case("cached dispatch expand apply_weights");
        c->R = 4; c->E = 16; c->T = 100; c->has_weights = 1; c->cached = 1;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 4; c->apply_weights = 1; c->seed = 0x200c;
        c = add_case("capacity: rank 2 one row short");
        c->R = 4; c->E = 16; c->T = 100; c->has_weights = 1; c->short_rank = 2; c->seed = 0x3001;
        c = add_case("capacity expand: rank 1 short (padding counts)");
        c->R = 4; c->E = 16; c->T = 100; c->has_weights = 1; c->short_rank = 1;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 64; c->zero_padding = 1; c->seed = 0x3002;
        c = add_case("validation: id out of range (int64 beyond int32), later chunk wins over "
                     "a later rank");
        c->R = 4; c->E = 16; c->T = 700; c->invalid = 1; c->seed = 0x3003;
        c = add_case("validation: id out of range int32 expand");
        c->R = 4; c->E = 16; c->T = 100; c->invalid = 1; c->topk_dtype = EPD_DTYPE_INT32;
        c->layout = EPD_LAYOUT_EXPAND; c->seed = 0x3004;
        c = add_case("validation: duplicate expert");
        c->R = 2; c->E = 16; c->T = 100; c->invalid = 2; c->seed = 0x3005;
        c = add_case("small op in many chunks of the small-op routing (3996 tokens)");
        c->R = 4; c->E = 32; c->T = 1000; c->K = 6; c->KO = 5; c->has_weights = 1;
        c->neg_frac = 0.2; c->topk_dtype = EPD_DTYPE_INT32; c->strided = 1; c->cached = 1;
        c->seed = 0x3006;
        c = add_case("small op, ranks 0, 2, 3 and 7 without tokens (prefixes of empty sources)");
        c->R = 8; c->E = 64; c->T = 300; c->K = 8; c->KO = 8; c->has_weights = 1;
        c->empty_mask = 1u << 0 | 1u << 2 | 1u << 3 | 1u << 7; c->seed = 0x3007;
        c = add_case("small op, no rank with tokens (an empty op)");
        c->R = 8; c->E = 64; c->T = 64; c->K = 8; c->KO = 8; c->has_weights = 1;
        c->empty_mask = 0xff; c->seed = 0x300a;
        c = add_case("small op top-1, int32 ids");
        c->R = 8; c->E = 64; c->T = 200; c->K = 2; c->KO = 1; c->has_weights = 1;
        c->neg_frac = 0.1; c->topk_dtype = EPD_DTYPE_INT32; c->seed = 0x3008;
        c = add_case("small op top-2 with -1 entries, duplicate expert (lanes in pairs)");
        c->R = 4; c->E = 32; c->T = 150; c->K = 2; c->KO = 2; c->invalid = 2; c->neg_frac = 0.25;
        c->seed = 0x3009;

        {
                for (int ri = 1; ri < 4; ri++) {
                        for (int lay = 0; lay < 2; lay++) {
                                c = add_case("spread over GPUs");
                                c->R = ranks[ri]; c->E = 8 * ranks[ri]; c->T = 200; c->K = 8;
                                c->KO = 8; c->H = 512; c->has_weights = 1; c->num_bias = 1;
                                c->dtype = lay ? EPD_DTYPE_BF16 : EPD_DTYPE_FP8_E4M3;
                                c->layout = lay ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND;
                                c->align = lay ? 128 : 1; c->zero_padding = lay;
                                c->apply_weights = lay; c->spread = 1; c->cached = 1;
                                c->seed = 0x4000 + ri * 2 + lay;
                        }
                }
                c = add_case("spread capacity failure");
                c->R = 4; c->E = 16; c->T = 100; c->short_rank = 3; c->spread = 1; c->seed = 0x4101;
                c = add_case("spread validation failure");
                c->R = 4; c->E = 16; c->T = 100; c->invalid = 1; c->spread = 1; c->seed = 0x4102;
        }

        c = add_case("realistic prefill: R 8, T 4096, H 7168, top-8 of 256, fp8");
        c->R = 8; c->E = 256; c->T = 4096; c->K = 8; c->KO = 8; c->H = 7168;
        c->dtype = EPD_DTYPE_FP8_E4M3; c->has_weights = 1; c->num_bias = 0; c->big = 1;
        c->seed = 0x5001;
        c = add_case("realistic decode: R 8, T 128, H 7168, top-8 of 256, fp8 (warm L2)");
        c->R = 8; c->E = 256; c->T = 128; c->K = 8; c->KO = 8; c->H = 7168;
        c->dtype = EPD_DTYPE_FP8_E4M3; c->has_weights = 1; c->num_bias = 0; c->big = 1;
        c->seed = 0x5004;
        c = add_case("realistic tiny: R 8, T 1, H 7168, top-8 of 256, bf16");
        c->R = 8; c->E = 256; c->T = 1; c->K = 8; c->KO = 8; c->H = 7168;
        c->has_weights = 1; c->num_bias = 0; c->big = 1; c->seed = 0x5005;
        c = add_case("realistic prefill bf16 expand, align 128");
        c->R = 8; c->E = 256; c->T = 4096; c->K = 8; c->KO = 8; c->H = 7168;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 128; c->has_weights = 1; c->apply_weights = 1;
        c->big = 1; c->seed = 0x5002;
        {
                c = add_case("realistic prefill spread over GPUs, fp8");
                c->R = 8; c->E = 256; c->T = 4096; c->K = 8; c->KO = 8; c->H = 7168;
                c->dtype = EPD_DTYPE_FP8_E4M3; c->has_weights = 1; c->big = 1; c->spread = 1;
                c->seed = 0x5003;
        }

        /* Small ops with rows long enough to be cut into slices (combine's evict-first
         * kernel and its bulk-copy path). */
        c = add_case("small op, sliced combine: expand, apply_weights, two biases, -1 entries");
        c->R = 4; c->E = 32; c->T = 40; c->K = 8; c->KO = 8; c->H = 2048; c->has_weights = 1;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 4; c->apply_weights = 1; c->num_bias = 2;
        c->neg_frac = 0.25; c->seed = 0x6001;
        c = add_case("small op, sliced combine: y rows off 16-byte alignment (scalar path), bias");
        c->R = 8; c->E = 64; c->T = 30; c->K = 8; c->KO = 7; c->H = 1536; c->has_weights = 1;
        c->num_bias = 1; c->y_pad = 2; c->strided = 1; c->cached = 1; c->seed = 0x6002;
        c = add_case("small op, sliced combine: top-10 over 8 ranks, H not a multiple of 1024");
        c->R = 8; c->E = 64; c->T = 24; c->K = 10; c->KO = 10; c->H = 1920; c->has_weights = 1;
        c->dtype = EPD_DTYPE_FP8_E4M3; c->seed = 0x6003;
        c = add_case("small op, sliced combine: top-12 expand");
        c->R = 4; c->E = 48; c->T = 40; c->K = 12; c->KO = 12; c->H = 1024; c->has_weights = 1;
        c->layout = EPD_LAYOUT_EXPAND; c->align = 2; c->apply_weights = 1; c->num_bias = 1;
        c->seed = 0x6004;
        /* The copy's scale stores (copy_token_rows): rows of up to 256 bytes go out two
         * destinations per instruction, 272 to 512 one, longer ones after the x bytes. */
        /* combine's weight inputs, which take the launch from device descriptors */
        c = add_case("weight inputs: recv_weights without dispatch weights, -1 entries, bias");
        c->R = 4; c->E = 32; c->T = 120; c->K = 8; c->KO = 8; c->neg_frac = 0.2;
        c->num_bias = 1; c->recv_weights = 1; c->seed = 0x7001;
        c = add_case("weight inputs: recv_weights over dispatch weights, fp8, strided, cached");
        c->R = 8; c->E = 64; c->T = 150; c->K = 8; c->KO = 6; c->dtype = EPD_DTYPE_FP8_E4M3;
        c->H = 384; c->has_weights = 1; c->strided = 1; c->recv_weights = 1;
        c->cached = 1; c->seed = 0x7002;
        c = add_case("weight inputs: recv_weights, sliced small op, y off 16-byte alignment");
        c->R = 8; c->E = 64; c->T = 30; c->K = 8; c->KO = 8; c->H = 1536; c->y_pad = 2;
        c->has_weights = 1; c->recv_weights = 1; c->neg_frac = 0.1; c->seed = 0x7003;
        c = add_case("weight inputs: source_weights, expand apply_weights without dispatch weights");
        c->R = 4; c->E = 32; c->T = 100; c->K = 8; c->KO = 8; c->layout = EPD_LAYOUT_EXPAND;
        c->align = 4; c->zero_padding = 1; c->apply_weights = 1; c->source_weights = 1;
        c->num_bias = 2; c->neg_frac = 0.1; c->seed = 0x7004;
        c = add_case("weight inputs: source_weights over dispatch weights, expand fp8, sliced");
        c->R = 4; c->E = 32; c->T = 40; c->K = 8; c->KO = 8; c->H = 2048;
        c->dtype = EPD_DTYPE_FP8_E4M3; c->layout = EPD_LAYOUT_EXPAND; c->align = 2;
        c->has_weights = 1; c->apply_weights = 1; c->source_weights = 1; c->strided = 1;
        c->empty_rank = 1; c->seed = 0x7005;
        c = add_case("weight inputs: source_weights on even ranks only, dispatch weights else");
        c->R = 4; c->E = 32; c->T = 90; c->K = 8; c->KO = 5; c->layout = EPD_LAYOUT_EXPAND;
        c->has_weights = 1; c->apply_weights = 1; c->source_weights = 2; c->num_bias = 1;
        c->seed = 0x7006;
        c = add_case("small op, fp8 scale rows of 288 bytes (one destination per scale store)");
        c->R = 4; c->E = 32; c->T = 40; c->K = 8; c->KO = 8; c->H = 9216; c->has_weights = 1;
        c->dtype = EPD_DTYPE_FP8_E4M3; c->seed = 0x6005;
        c = add_case("small op, fp8 scale rows of 576 bytes (copied after the x bytes)");
        c->R = 4; c->E = 32; c->T = 40; c->K = 8; c->KO = 8; c->H = 4608; c->has_weights = 1;
        c->dtype = EPD_DTYPE_FP8_E4M3; c->scale_block = 32; c->seed = 0x6006;
}

/* ---- per-case state ---- */

enum { O_X, O_SCALES, O_TOPK, O_W, O_SRC, O_SLOT, O_NUM };
static const char *const out_names[O_NUM] = { "recv_x", "recv_scales", "recv_topk_idx",
                                              "recv_weights", "recv_src", "recv_topk_slot" };

/* One buffer with a host reference, a device copy and the readbacks of two runs. */
struct buf {
        int present;
        uint64_t stride;
        uint64_t bytes;
        uint8_t *ref;
        uint8_t *dev;
        uint8_t *got;
};

struct rank_data {
        int dev;
        uint32_t n;
        /* inputs (host + device) */
        uint64_t x_stride, sc_stride, w_stride, topk_stride; /* topk stride in elements */
        uint8_t *x, *sc, *w, *w2, *topk;
        uint8_t *d_x, *d_sc, *d_w, *d_w2, *d_topk;
        /* dispatch outputs */
        uint64_t rows, cap;
        struct buf out[O_NUM];
        /* combine */
        uint64_t y_rows, y_stride;
        uint8_t *y, *d_y;
        uint8_t *bias[2], *d_bias[2];
        struct buf comb, comb_w;
        /* combine's weight inputs: source_weights [n, KO], recv_weights [y_rows, KO] */
        uint64_t sw_stride, rw_stride;
        uint8_t *sw, *d_sw, *rw, *d_rw;
};

#define MAX_ALLOCS 4096

struct ctx {
        const struct tcase *c;
        uint32_t R, E, L, T, K, KO, H;
        uint64_t row_bytes, scale_bytes, esize;
        int ndev;                 /* devices used */
        struct rank_data *rk;
        struct epd_plan *plan;
        struct epd_ws_layout lay;
        uint8_t *ws;              /* device 0 */
        uint8_t *reply;           /* pinned host copy of the reply block */
        cudaStream_t stream[MAX_DEV];
        cudaEvent_t ev_count[MAX_DEV], ev_prefix, ev_t0[MAX_DEV], ev_t1[MAX_DEV];
        struct epd_k_dispatch_rank *dr_host;
        struct epd_k_combine_rank *cr_host;
        struct epd_k_dispatch_rank *dr_dev[MAX_DEV];
        struct epd_k_combine_rank *cr_dev[MAX_DEV];
        struct epd_k_local *local_dev[MAX_DEV];
        struct epd_k_local *local_host[MAX_DEV]; /* the same lists on the host */
        uint32_t num_local[MAX_DEV], local_tokens[MAX_DEV];
        void *dallocs[MAX_ALLOCS];
        int ndallocs;
        void *hallocs[MAX_ALLOCS];
        int nhallocs;
        int failures;
};

static void *halloc(struct ctx *x, uint64_t bytes)
{
        void *p = calloc(1, bytes ? bytes : 1);
        if (p == NULL) {
                fprintf(stderr, "    host allocation of %llu bytes failed\n",
                        (unsigned long long)bytes);
                exit(1);
        }
        if (x->nhallocs < MAX_ALLOCS)
                x->hallocs[x->nhallocs++] = p;
        return p;
}

static int dalloc(struct ctx *x, int dev, uint64_t bytes, uint8_t **out)
{
        void *p = NULL;
        /* Never 0 bytes: a NULL pointer means "absent" to the kernels. */
        CK(cudaSetDevice(dev));
        CK(cudaMalloc(&p, bytes < 256 ? 256 : bytes));
        if (x->ndallocs < MAX_ALLOCS)
                x->dallocs[x->ndallocs++] = p;
        *out = (uint8_t *)p;
        return 0;
}

static int upload(struct ctx *x, int dev, const void *host, uint64_t bytes, uint8_t **out)
{
        if (dalloc(x, dev, bytes, out) < 0)
                return -1;
        if (bytes)
                CK(cudaMemcpy(*out, host, bytes, cudaMemcpyHostToDevice));
        return 0;
}

static void ctx_free(struct ctx *x)
{
        for (int i = 0; i < x->ndallocs; i++)
                cudaFree(x->dallocs[i]);
        for (int i = 0; i < x->nhallocs; i++)
                free(x->hallocs[i]);
        if (x->reply)
                cudaFreeHost(x->reply);
        for (int d = 0; d < x->ndev; d++) {
                cudaSetDevice(d);
                if (x->stream[d])
                        cudaStreamDestroy(x->stream[d]);
                if (x->ev_count[d])
                        cudaEventDestroy(x->ev_count[d]);
                if (x->ev_t0[d])
                        cudaEventDestroy(x->ev_t0[d]);
                if (x->ev_t1[d])
                        cudaEventDestroy(x->ev_t1[d]);
        }
        cudaSetDevice(0);
        if (x->ev_prefix)
                cudaEventDestroy(x->ev_prefix);
        epd_plan_free(x->plan);
        x->plan = NULL;
}

static void failf(struct ctx *x, const char *fmt, ...)
{
        va_list ap;
        if (x->failures++ > 20)
                return;
        fprintf(stdout, "    FAIL: ");
        va_start(ap, fmt);
        vfprintf(stdout, fmt, ap);
        va_end(ap);
        fputc('\n', stdout);
}

/* Compares a readback with its reference byte for byte and names the first difference. */
static int compare_buf(struct ctx *x, const char *what, uint32_t rank, const uint8_t *want,
                       const uint8_t *got, uint64_t bytes, uint64_t stride)
{
        if (memcmp(want, got, bytes) == 0)
                return 0;
        uint64_t i = 0, diffs = 0;
        while (i < bytes && want[i] == got[i])
                i++;
        for (uint64_t j = i; j < bytes; j++)
                diffs += want[j] != got[j];
        failf(x, "%s of rank %u differs: %llu bytes, first at byte %llu (row %llu, byte %llu of "
              "the row): want 0x%02x got 0x%02x",
              what, rank, (unsigned long long)diffs, (unsigned long long)i,
              (unsigned long long)(stride ? i / stride : 0),
              (unsigned long long)(stride ? i % stride : i), want[i], got[i]);
        return -1;
}

/* ---- inputs ---- */

static int64_t topk_get(const struct ctx *x, const struct rank_data *r, uint32_t t, uint32_t k)
{
        uint64_t i = (uint64_t)t * r->topk_stride + k;
        if (x->c->topk_dtype == EPD_DTYPE_INT64)
                return ((const int64_t *)r->topk)[i];
        return ((const int32_t *)r->topk)[i];
}

static void topk_set(const struct ctx *x, struct rank_data *r, uint32_t t, uint32_t k, int64_t v)
{
        uint64_t i = (uint64_t)t * r->topk_stride + k;
        if (x->c->topk_dtype == EPD_DTYPE_INT64)
                ((int64_t *)r->topk)[i] = v;
        else
                ((int32_t *)r->topk)[i] = (int32_t)v;
}

static void gen_inputs(struct ctx *x, struct rng *g)
{
        const struct tcase *c = x->c;

        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                uint32_t n;

                if (c->big && x->T > x->R)
                        n = x->T - s; /* docs/benchmarks.md prefill: rank r sends T - r */
                else if (c->big)
                        n = x->T; /* tiny: every rank sends T */
                else
                        n = x->T - rng_below(g, x->T / 3 + 1);
                if ((c->empty_rank && s == x->R - 1) || (c->empty_mask >> s & 1))
                        n = 0;
                r->n = n;
                r->x_stride = x->row_bytes + (c->strided ? 48 : 0);
                r->sc_stride = x->scale_bytes + (c->strided ? 20 : 0);
                r->w_stride = 4ull * x->KO + (c->strided ? 12 : 0);
                r->topk_stride = x->KO + (c->strided ? 3 : 0);
                r->x = (uint8_t *)halloc(x, (uint64_t)n * r->x_stride);
                fill_random(g, r->x, (uint64_t)n * r->x_stride);
                if (x->scale_bytes) {
                        r->sc = (uint8_t *)halloc(x, (uint64_t)n * r->sc_stride);
                        fill_random(g, r->sc, (uint64_t)n * r->sc_stride);
                }
                if (c->has_weights) {
                        r->w = (uint8_t *)halloc(x, (uint64_t)n * r->w_stride);
                        r->w2 = (uint8_t *)halloc(x, (uint64_t)n * r->w_stride);
                        for (uint64_t i = 0; i < (uint64_t)n * r->w_stride / 4; i++) {
                                ((float *)r->w)[i] = random_weight(g);
                                ((float *)r->w2)[i] = random_weight(g);
                        }
                }
                r->topk = (uint8_t *)halloc(x, (uint64_t)n * r->topk_stride * x->esize);
                /* Stride padding holds garbage the kernels must not read as entries. */
                fill_random(g, r->topk, (uint64_t)n * r->topk_stride * x->esize);
                for (uint32_t t = 0; t < n; t++) {
                        for (uint32_t k = 0; k < x->KO; k++) {
                                int64_t e = -1;
                                if (rng_unit(g) >= c->neg_frac) {
                                        for (int tries = 0; tries < 1000; tries++) {
                                                uint32_t pool = c->skew && rng_unit(g) < 0.9
                                                                        ? x->L
                                                                        : x->E;
                                                int64_t cand = rng_below(g, pool);
                                                int dup = 0;
                                                for (uint32_t j = 0; j < k; j++)
                                                        dup |= topk_get(x, r, t, j) == cand;
                                                if (!dup) {
                                                        e = cand;
                                                        break;
                                                }
                                        }
                                }
                                topk_set(x, r, t, k, e);
                        }
                }
        }

        /* Planted validation errors. */
        if (c->invalid == 1) {
                uint32_t s1 = x->R > 1 ? 1 : 0;
                struct rank_data *r = &x->rk[s1];
                if (r->n > 2) {
                        int64_t bad = c->topk_dtype == EPD_DTYPE_INT64 ? (int64_t)1 << 40
                                                                       : (int64_t)x->E;
                        topk_set(x, r, r->n / 2, x->KO - 1, bad);
                        topk_set(x, r, r->n - 1, 0, -7);
                }
                struct rank_data *r2 = &x->rk[x->R - 1];
                if (r2->n > 4 && x->KO > 1) {
                        topk_set(x, r2, 2, 0, 3);
                        topk_set(x, r2, 2, 1, 3);
                }
        } else if (c->invalid == 2) {
                struct rank_data *r = &x->rk[0];
                if (r->n > 4 && x->KO > 1) {
                        topk_set(x, r, 3, 0, 5);
                        topk_set(x, r, 3, x->KO - 1, 5);
                }
        }
}

/* The verdict the kernels must write, derived here independently of plan.c. */
struct verdict {
        int status;
        int reason;
        int rank;
        int token;
        int pos;
        int64_t value;
        int num_short;
        int64_t capacity;
};

static void expected_validation(const struct ctx *x, struct verdict *v)
{
        memset(v, 0, sizeof(*v));
        for (uint32_t s = 0; s < x->R; s++) {
                const struct rank_data *r = &x->rk[s];
                for (uint32_t t = 0; t < r->n; t++) {
                        for (uint32_t k = 0; k < x->KO; k++) {
                                int64_t e = topk_get(x, r, t, k);
                                int reason = 0;
                                if (e < -1 || e >= (int64_t)x->E)
                                        reason = EPD_WS_REASON_BAD_EXPERT;
                                for (uint32_t j = 0; j < k && !reason && e >= 0; j++)
                                        if (topk_get(x, r, t, j) == e)
                                                reason = EPD_WS_REASON_DUP_EXPERT;
                                if (reason) {
                                        v->status = EPD_INVALID_ARGUMENT;
                                        v->reason = reason;
                                        v->rank = (int)s;
                                        v->token = (int)t;
                                        v->pos = (int)k;
                                        v->value = e;
                                        return;
                                }
                        }
                }
        }
}

/* ---- GPU plumbing ---- */

static void base_dispatch_args(const struct ctx *x, struct epd_k_dispatch_args *a)
{
        memset(a, 0, sizeof(*a));
        a->world_size = x->R;
        a->num_experts = x->E;
        a->max_tokens = x->T;
        a->max_topk = x->K;
        a->num_topk = x->KO;
        a->expert_alignment = x->c->align;
        a->layout = x->c->layout;
        a->topk_dtype = x->c->topk_dtype;
        a->has_weights = x->c->has_weights;
        a->zero_padding = x->c->zero_padding;
        a->row_bytes = x->row_bytes;
        a->scale_bytes = x->scale_bytes;
        a->workspace = x->ws;
}

static void dev_dispatch_args(const struct ctx *x, int dev, struct epd_k_dispatch_args *a)
{
        base_dispatch_args(x, a);
        a->ranks = x->dr_dev[dev];
        a->local = x->local_dev[dev];
        a->num_local = x->num_local[dev];
        a->local_tokens = x->local_tokens[dev];
}

/* Builds and uploads the per-rank descriptors (one copy per device, so that descriptor reads
 * stay local) and each device's local list. use_w2 selects the second weights (cached
 * dispatch). */
static int upload_dispatch_desc(struct ctx *x, int use_w2)
{
        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                struct epd_k_dispatch_rank *d = &x->dr_host[s];
                memset(d, 0, sizeof(*d));
                d->num_tokens = r->n;
                d->topk_idx = r->d_topk;
                d->topk_stride = r->topk_stride;
                d->in.x.ptr = r->d_x;
                d->in.x.stride = r->x_stride;
                d->in.scales.ptr = r->d_sc;
                d->in.scales.stride = r->sc_stride;
                d->in.weights.ptr = use_w2 ? r->d_w2 : r->d_w;
                d->in.weights.stride = r->w_stride;
                struct epd_mat *outs[O_NUM] = { &d->out.recv_x, &d->out.recv_scales,
                                                &d->out.recv_topk_idx, &d->out.recv_weights,
                                                &d->out.recv_src, &d->out.recv_topk_slot };
                for (int o = 0; o < O_NUM; o++) {
                        outs[o]->ptr = r->out[o].present ? r->out[o].dev : NULL;
                        outs[o]->stride = r->out[o].stride;
                }
                d->capacity_rows = r->cap;
        }
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaMemcpy(x->dr_dev[dev], x->dr_host, sizeof(*x->dr_host) * x->R,
                              cudaMemcpyHostToDevice));
        }
        return 0;
}

static int upload_locals(struct ctx *x)
{
        for (int dev = 0; dev < x->ndev; dev++) {
                struct epd_k_local *loc =
                        (struct epd_k_local *)halloc(x, sizeof(*loc) * (x->R + 1));
                uint32_t n = 0, off = 0;
                for (uint32_t s = 0; s < x->R; s++) {
                        if (x->rk[s].dev != dev)
                                continue;
                        loc[n].rank = s;
                        loc[n].token_offset = off;
                        off += x->rk[s].n;
                        n++;
                }
                loc[n].rank = 0;
                loc[n].token_offset = off;
                x->num_local[dev] = n;
                x->local_tokens[dev] = off;
                x->local_host[dev] = loc;
                if (upload(x, dev, loc, sizeof(*loc) * (n + 1), (uint8_t **)&x->local_dev[dev]) < 0)
                        return -1;
        }
        return 0;
}

static int reset_outputs(struct ctx *x)
{
        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                CK(cudaSetDevice(r->dev));
                for (int o = 0; o < O_NUM; o++)
                        if (r->out[o].present)
                                CK(cudaMemset(r->out[o].dev, SENTINEL, r->out[o].bytes));
        }
        return 0;
}

/* The daemon-mode sequencing of epd_kernels.h: count on every device, prefix on the
 * workspace's device after all counts, then place + copy on every device after the prefix.
 * cached: recheck instead of count/prefix/place. */
static int gpu_dispatch(struct ctx *x, int cached)
{
        struct epd_k_dispatch_args a;

        if (!cached) {
                for (int dev = 0; dev < x->ndev; dev++) {
                        CK(cudaSetDevice(dev));
                        dev_dispatch_args(x, dev, &a);
                        CKS(epd_k_dispatch_count(&a, x->stream[dev]));
                        CK(cudaEventRecord(x->ev_count[dev], x->stream[dev]));
                }
        }
        CK(cudaSetDevice(0));
        for (int dev = 0; dev < x->ndev; dev++)
                if (!cached)
                        CK(cudaStreamWaitEvent(x->stream[0], x->ev_count[dev], 0));
        base_dispatch_args(x, &a);
        a.ranks = x->dr_dev[0];
        if (cached)
                CKS(epd_k_dispatch_recheck(&a, x->stream[0]));
        else
                CKS(epd_k_dispatch_prefix(&a, x->stream[0]));
        CK(cudaEventRecord(x->ev_prefix, x->stream[0]));
        CK(cudaMemcpyAsync(x->reply, x->ws, x->lay.reply_bytes, cudaMemcpyDeviceToHost,
                           x->stream[0]));
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaStreamWaitEvent(x->stream[dev], x->ev_prefix, 0));
                dev_dispatch_args(x, dev, &a);
                if (!cached)
                        CKS(epd_k_dispatch_place(&a, x->stream[dev]));
                CKS(epd_k_dispatch_copy(&a, x->stream[dev]));
        }
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaStreamSynchronize(x->stream[dev]));
        }
        return 0;
}

/* Whether the small-op routing (kernels/route_small.cu; one_launch 0) or the one-launch small
 * dispatch (kernels/dispatch_small.cu; one_launch 1) takes this case. */
static int small_ok(const struct ctx *x, int one_launch)
{
        struct epd_k_dispatch_args a;

        if (x->ndev != 1)
                return 0;
        dev_dispatch_args(x, 0, &a);
        return one_launch ? epd_k_dispatch_small_ok(&a) : epd_k_dispatch_route_small_ok(&a);
}

/* The same dispatch with the small-op routing step instead of count, prefix and place, and the
 * copy overlapping it (programmatic dependent launch). */
static int gpu_dispatch_small(struct ctx *x)
{
        struct epd_k_dispatch_args a;

        CK(cudaSetDevice(0));
        dev_dispatch_args(x, 0, &a);
        CKS(epd_k_dispatch_route_small(&a, x->stream[0]));
        a.flags = EPD_K_COPY_OVERLAP; /* the copy overlaps the routing, as in the daemon */
        CKS(epd_k_dispatch_copy(&a, x->stream[0]));
        CK(cudaMemcpyAsync(x->reply, x->ws, x->lay.reply_bytes, cudaMemcpyDeviceToHost,
                           x->stream[0]));
        CK(cudaStreamSynchronize(x->stream[0]));
        return 0;
}

/* Timed launches (kernels/timed.cu) as the daemon makes them: one object and one pair of events
 * per kind for the whole run on device 0, so that every case after the first updates the graph
 * the previous one left (other buffers, grids and shared memory), and a change of kernel
 * (K_op above 8) or cluster shape rebuilds it. A stale parameter would write the previous case's
 * buffers and leave this one's poisoned. */
static struct {
        struct epd_k_timed *obj[2]; /* 0: one-launch dispatch, 1: combine */
        struct epd_k_timed *off[2]; /* the same with graphs off (cuda_graphs = off) */
        cudaEvent_t t0, t1;
        int launches[2], direct[2], off_launches[2];
} timed;

/* How a one-device kernel is launched: directly, through the timed launch (one graph, as the
 * daemon does), or through the timed launch with graphs off (record, launch, record: a daemon
 * with cuda_graphs = off, or after a graph failed). */
enum { LAUNCH_DIRECT, LAUNCH_TIMED, LAUNCH_TIMED_NO_GRAPH };

static int timed_init(void)
{
        CK(cudaSetDevice(0));
        CK(cudaEventCreate(&timed.t0));
        CK(cudaEventCreate(&timed.t1));
        for (int k = 0; k < 2; k++) {
                if (epd_k_timed_create(&timed.obj[k]) < 0 ||
                    epd_k_timed_create(&timed.off[k]) < 0)
                        return -1;
                epd_k_timed_set_graphs(timed.off[k], 0);
        }
        return 0;
}

static struct epd_k_timed *timed_obj(int k, int mode)
{
        return mode == LAUNCH_TIMED_NO_GRAPH ? timed.off[k] : timed.obj[k];
}

/* After a timed launch of kind k has completed: whether it went through a graph. The graph is
 * what the daemon's kernel time relies on, so a silent fallback on this device is a failure. */
static void timed_check(struct ctx *x, int k, int mode, const char *what)
{
        if (mode == LAUNCH_TIMED_NO_GRAPH) {
                /* No graph, by request (not a failure), and the two events still bound the
                 * kernel. */
                float ms = -1.0f;
                timed.off_launches[k]++;
                if (epd_k_timed_uses_graph(timed.off[k]) ||
                    epd_k_timed_fallback_error(timed.off[k]) != cudaSuccess)
                        failf(x, "%s with graphs off: uses a graph %d, error %s", what,
                              epd_k_timed_uses_graph(timed.off[k]),
                              cudaGetErrorString(epd_k_timed_fallback_error(timed.off[k])));
                if (cudaEventElapsedTime(&ms, timed.t0, timed.t1) != cudaSuccess || !(ms > 0.0f))
                        failf(x, "%s with graphs off: no time between its events (%g ms)", what,
                              (double)ms);
                return;
        }
        timed.launches[k]++;
        if (!epd_k_timed_uses_graph(timed.obj[k])) {
                timed.direct[k]++;
                failf(x, "%s: the timed launch fell back to a direct launch (%s)", what,
                      cudaGetErrorString(epd_k_timed_fallback_error(timed.obj[k])));
        }
}

/* The same dispatch in one launch (kernels/dispatch_small.cu), as the daemon runs a small op
 * whose outputs are in client memory, with the reply block written by the kernel into the pinned
 * host copy (no copy after it); mode: LAUNCH_TIMED through the timed launch (graph), as the
 * daemon does. */
static int gpu_dispatch_fused(struct ctx *x, int mode)
{
        struct epd_k_dispatch_args a;

        CK(cudaSetDevice(0));
        dev_dispatch_args(x, 0, &a);
        /* The kernel fills the pinned reply copy itself, as in the daemon; poison it first so
         * that a value it does not write shows. */
        memset(x->reply, 0xA5, x->lay.reply_bytes);
        a.reply_copy = x->reply;
        if (mode != LAUNCH_DIRECT) {
                /* As the daemon: host copies of the descriptors too, which the launcher passes
                 * in the kernel's parameters when the group is small enough. */
                struct epd_k_small_plan p;
                a.ranks_host = x->dr_host;
                a.local_host = x->local_host[0];
                CKS(epd_k_dispatch_small_plan(&a, &p));
                CKS(epd_k_dispatch_small_timed(&a, &p, timed_obj(0, mode), timed.t0, timed.t1,
                                               x->stream[0]));
                CK(cudaStreamSynchronize(x->stream[0]));
                timed_check(x, 0, mode, "one-launch small dispatch");
                return 0;
        }
        CKS(epd_k_dispatch_small(&a, x->stream[0]));
        CK(cudaStreamSynchronize(x->stream[0]));
        return 0;
}

static int readback_outputs(struct ctx *x)
{
        for (uint32_t s = 0; s < x->R; s++)
                for (int o = 0; o < O_NUM; o++)
                        if (x->rk[s].out[o].present)
                                CK(cudaMemcpy(x->rk[s].out[o].got, x->rk[s].out[o].dev,
                                              x->rk[s].out[o].bytes, cudaMemcpyDeviceToHost));
        return 0;
}

static void compare_outputs(struct ctx *x, const char *when, int against_ref, uint8_t **prev)
{
        char what[128];
        int p = 0;
        for (uint32_t s = 0; s < x->R; s++) {
                for (int o = 0; o < O_NUM; o++) {
                        struct buf *b = &x->rk[s].out[o];
                        if (!b->present)
                                continue;
                        snprintf(what, sizeof(what), "%s %s", when, out_names[o]);
                        if (against_ref)
                                compare_buf(x, what, s, b->ref, b->got, b->bytes, b->stride);
                        else
                                compare_buf(x, what, s, prev[p], b->got, b->bytes, b->stride);
                        p++;
                }
        }
}

/* Saves the first run's readbacks so the second run can be compared with them. */
static uint8_t **save_outputs(struct ctx *x)
{
        uint8_t **saved = (uint8_t **)halloc(x, sizeof(uint8_t *) * x->R * O_NUM);
        int p = 0;
        for (uint32_t s = 0; s < x->R; s++) {
                for (int o = 0; o < O_NUM; o++) {
                        struct buf *b = &x->rk[s].out[o];
                        if (!b->present)
                                continue;
                        saved[p] = (uint8_t *)halloc(x, b->bytes);
                        memcpy(saved[p], b->got, b->bytes);
                        p++;
                }
        }
        return saved;
}

static void check_verdict(struct ctx *x, const struct verdict *want)
{
        const struct epd_ws_error *got = epd_ws_error_rec(x->reply, &x->lay);

        if (got->status != want->status) {
                failf(x, "verdict %s (reason %d rank %d), want %s", status_name(got->status),
                      got->reason, got->rank, status_name(want->status));
                return;
        }
        if (want->status == 0)
                return;
        if (got->reason != want->reason || got->rank != want->rank) {
                failf(x, "verdict reason %d rank %d, want reason %d rank %d", got->reason,
                      got->rank, want->reason, want->rank);
                return;
        }
        if (want->status == EPD_INVALID_ARGUMENT &&
            (got->token != want->token || got->pos != want->pos || got->value != want->value))
                failf(x, "validation detail token %d pos %d value %lld, want %d %d %lld",
                      got->token, got->pos, (long long)got->value, want->token, want->pos,
                      (long long)want->value);
        if (want->status == EPD_CAPACITY_EXCEEDED &&
            (got->num_short != want->num_short || got->value != want->value ||
             got->capacity != want->capacity))
                failf(x, "capacity detail short %d needs %lld cap %lld, want %d %lld %lld",
                      got->num_short, (long long)got->value, (long long)got->capacity,
                      want->num_short, (long long)want->value, (long long)want->capacity);
}

/* The reply block and the rows of the workspace against the plan, entry for entry. */
static int check_routing(struct ctx *x)
{
        const struct epd_plan *p = x->plan;
        const uint32_t R = x->R, E = x->E, L = x->L;
        void *rep = x->reply;

        if (memcmp(epd_ws_i32(rep, x->lay.rank_prefix), p->rank_prefix,
                   4ull * R * (R + 1)) != 0)
                failf(x, "rank_prefix differs from the plan");
        if (memcmp(epd_ws_i32(rep, x->lay.expert_count), p->expert_count, 4ull * E) != 0)
                failf(x, "expert_count differs from the plan");
        if (memcmp(epd_ws_i32(rep, x->lay.expert_aligned), p->expert_aligned, 4ull * E) != 0)
                failf(x, "expert_aligned differs from the plan");
        if (memcmp(epd_ws_i32(rep, x->lay.expert_base), p->expert_base, 4ull * R * (L + 1)) != 0)
                failf(x, "expert_base differs from the plan");

        struct {
                const char *name;
                uint64_t off, n;
                const int32_t *want;
        } arr[3] = { { "tok_count", x->lay.tok_count, (uint64_t)R * R, p->tok_count },
                     { "sel_count", x->lay.sel_count, (uint64_t)R * E, p->sel_count },
                     { "expert_src_prefix", x->lay.expert_src_prefix, (uint64_t)E * R,
                       p->expert_src_prefix } };
        for (int i = 0; i < 3; i++) {
                int32_t *got = (int32_t *)halloc(x, 4 * arr[i].n);
                CK(cudaMemcpy(got, x->ws + arr[i].off, 4 * arr[i].n, cudaMemcpyDeviceToHost));
                if (memcmp(got, arr[i].want, 4 * arr[i].n) != 0)
                        failf(x, "%s differs from the plan", arr[i].name);
        }

        uint64_t entries = (uint64_t)R * x->T * x->K;
        int32_t *rows = (int32_t *)halloc(x, 4 * entries);
        CK(cudaMemcpy(rows, x->ws + x->lay.row, 4 * entries, cudaMemcpyDeviceToHost));
        for (uint32_t s = 0; s < R; s++) {
                const int32_t *got = rows + epd_ws_entry(&x->lay, s, 0, x->KO, 0);
                for (uint64_t i = 0; i < (uint64_t)x->rk[s].n * x->KO; i++) {
                        if (got[i] != p->row[s][i]) {
                                failf(x, "row[%u][%llu] = %d, plan says %d", s,
                                      (unsigned long long)i, got[i], p->row[s][i]);
                                break;
                        }
                }
        }
        return 0;
}

/* ---- combine ---- */

/* A combine weight input, fp32 [rows, KO] with `pad` bytes after each row: random weights on
 * the host, and their copy on device `dev`. */
static int weights_make(struct ctx *x, struct rng *g, int dev, uint64_t rows, uint64_t pad,
                        uint64_t *stride, uint8_t **host, uint8_t **devp)
{
        *stride = 4ull * x->KO + pad;
        *host = (uint8_t *)halloc(x, rows * *stride);
        for (uint64_t i = 0; i < rows * *stride / 4; i++)
                ((float *)*host)[i] = random_weight(g);
        return upload(x, dev, *host, rows * *stride, devp);
}

static int setup_combine(struct ctx *x, struct rng *g)
{
        const struct tcase *c = x->c;
        const uint64_t hb = 2ull * x->H;
        const int recv_weights = c->recv_weights && c->layout == EPD_LAYOUT_NON_EXPAND;

        for (uint32_t d = 0; d < x->R; d++) {
                struct rank_data *r = &x->rk[d];
                r->y_rows = r->rows;
                r->y_stride = hb + (c->strided ? 32 : 0) + c->y_pad;
                /* One guard row of NaN past the y_rows that combine is told of, so that a read
                 * past them shows (combine_row_bound). */
                r->y = (uint8_t *)halloc(x, (r->y_rows + 1) * r->y_stride);
                fill_bf16(g, (uint16_t *)r->y, r->y_rows * r->y_stride / 2);
                for (uint64_t h = 0; h < r->y_stride / 2; h++)
                        ((uint16_t *)(r->y + r->y_rows * r->y_stride))[h] = 0x7fc1;
                /* Padding rows of EXPAND are never read: poison them with NaN so a read shows. */
                if (c->layout == EPD_LAYOUT_EXPAND) {
                        const int32_t *cnt = x->plan->expert_count + (uint64_t)d * x->L;
                        const int32_t *base = x->plan->expert_base + (uint64_t)d * (x->L + 1);
                        for (uint32_t le = 0; le < x->L; le++)
                                for (int32_t row = base[le] + cnt[le]; row < base[le + 1]; row++)
                                        for (uint64_t h = 0; h < x->H; h++)
                                                ((uint16_t *)(r->y + row * r->y_stride))[h] =
                                                        0x7fc1;
                }
                if (upload(x, r->dev, r->y, (r->y_rows + 1) * r->y_stride, &r->d_y) < 0)
                        return -1;
                if (recv_weights && weights_make(x, g, r->dev, r->y_rows, c->strided ? 8 : 0,
                                                 &r->rw_stride, &r->rw, &r->d_rw) < 0)
                        return -1;
        }
        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                uint64_t stride = hb + (c->strided ? 16 : 0);
                for (int b = 0; b < c->num_bias; b++) {
                        r->bias[b] = (uint8_t *)halloc(x, r->n * stride);
                        fill_bf16(g, (uint16_t *)r->bias[b], r->n * stride / 2);
                        if (upload(x, r->dev, r->bias[b], r->n * stride, &r->d_bias[b]) < 0)
                                return -1;
                }
                r->comb.present = 1;
                r->comb.stride = stride;
                r->comb.bytes = r->n * stride;
                if ((c->source_weights == 1 || (c->source_weights == 2 && s % 2 == 0)) &&
                    weights_make(x, g, r->dev, r->n, c->strided ? 12 : 0, &r->sw_stride, &r->sw,
                                 &r->d_sw) < 0)
                        return -1;
                r->comb_w.present = c->has_weights || recv_weights;
                r->comb_w.stride = 4ull * x->KO + (c->strided ? 4 : 0);
                r->comb_w.bytes = r->n * r->comb_w.stride;
                struct buf *bs[2] = { &r->comb, &r->comb_w };
                for (int i = 0; i < 2; i++) {
                        if (!bs[i]->present)
                                continue;
                        bs[i]->ref = (uint8_t *)halloc(x, bs[i]->bytes);
                        bs[i]->got = (uint8_t *)halloc(x, bs[i]->bytes);
                        memset(bs[i]->ref, SENTINEL, bs[i]->bytes);
                        if (dalloc(x, r->dev, bs[i]->bytes, &bs[i]->dev) < 0)
                                return -1;
                }
        }
        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                struct epd_k_combine_rank *cr = &x->cr_host[s];
                memset(cr, 0, sizeof(*cr));
                cr->num_tokens = r->n;
                cr->y.ptr = r->d_y;
                cr->y.stride = r->y_stride;
                cr->y_rows = r->y_rows;
                for (int b = 0; b < c->num_bias; b++) {
                        cr->bias[b].ptr = r->d_bias[b];
                        cr->bias[b].stride = r->comb.stride;
                }
                cr->combined.ptr = r->comb.dev;
                cr->combined.stride = r->comb.stride;
                if (r->comb_w.present) {
                        cr->combined_topk_weights.ptr = r->comb_w.dev;
                        cr->combined_topk_weights.stride = r->comb_w.stride;
                }
                cr->source_weights.ptr = r->d_sw;
                cr->source_weights.stride = r->sw_stride;
                cr->recv_weights.ptr = r->d_rw;
                cr->recv_weights.stride = r->rw_stride;
        }
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaMemcpy(x->cr_dev[dev], x->cr_host, sizeof(*x->cr_host) * x->R,
                              cudaMemcpyHostToDevice));
        }
        return 0;
}

static void dev_combine_args(const struct ctx *x, int dev, struct epd_k_combine_args *a)
{
        memset(a, 0, sizeof(*a));
        a->world_size = x->R;
        a->num_experts = x->E;
        a->max_tokens = x->T;
        a->max_topk = x->K;
        a->num_topk = x->KO;
        a->layout = x->c->layout;
        a->hidden = x->H;
        a->apply_weights = x->c->apply_weights;
        a->has_weights = x->c->has_weights;
        a->source_weights = x->c->source_weights;
        a->recv_weights = x->c->recv_weights && x->c->layout == EPD_LAYOUT_NON_EXPAND;
        a->workspace = x->ws;
        a->ranks = x->cr_dev[dev];
        a->local = x->local_dev[dev];
        a->num_local = x->num_local[dev];
        a->local_tokens = x->local_tokens[dev];
}

/* mode LAUNCH_TIMED: a one-device combine through the timed launch (a graph), as the daemon
 * runs it; LAUNCH_TIMED_NO_GRAPH: the same with graphs off. */
static int gpu_combine(struct ctx *x, int mode)
{
        struct epd_k_combine_args a;

        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                CK(cudaSetDevice(r->dev));
                CK(cudaMemset(r->comb.dev, SENTINEL, r->comb.bytes));
                if (r->comb_w.present)
                        CK(cudaMemset(r->comb_w.dev, SENTINEL, r->comb_w.bytes));
        }
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaDeviceSynchronize());
        }
        uint32_t launched_tokens = 0;
        const int use_timed = mode != LAUNCH_DIRECT && x->ndev == 1;
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                dev_combine_args(x, dev, &a);
                launched_tokens += a.local_tokens;
                if (use_timed) {
                        a.ranks_host = x->cr_host; /* as the daemon: see gpu_dispatch_fused */
                        a.local_host = x->local_host[dev];
                        CKS(epd_k_combine_timed(&a, timed_obj(1, mode), timed.t0, timed.t1,
                                                x->stream[dev]));
                }
                else
                        CKS(epd_k_combine(&a, x->stream[dev]));
        }
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaStreamSynchronize(x->stream[dev]));
        }
        if (use_timed && launched_tokens != 0) /* else there was no kernel to launch */
                timed_check(x, 1, mode, "combine");
        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                CK(cudaMemcpy(r->comb.got, r->comb.dev, r->comb.bytes, cudaMemcpyDeviceToHost));
                if (r->comb_w.present)
                        CK(cudaMemcpy(r->comb_w.got, r->comb_w.dev, r->comb_w.bytes,
                                      cudaMemcpyDeviceToHost));
        }
        return 0;
}

static void host_combine(struct ctx *x, int use_w2)
{
        struct epd_mat *y = (struct epd_mat *)halloc(x, sizeof(*y) * x->R);
        struct epd_mat *rw = (struct epd_mat *)halloc(x, sizeof(*rw) * x->R);
        struct epd_combine_src_io *src =
                (struct epd_combine_src_io *)halloc(x, sizeof(*src) * x->R);
        struct epd_combine_exec op;

        for (uint32_t d = 0; d < x->R; d++) {
                y[d].ptr = x->rk[d].y;
                y[d].stride = x->rk[d].y_stride;
                rw[d].ptr = x->rk[d].rw;
                rw[d].stride = x->rk[d].rw_stride;
        }
        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                for (int b = 0; b < 2; b++) {
                        src[s].bias[b].ptr = b < x->c->num_bias ? r->bias[b] : NULL;
                        src[s].bias[b].stride = r->comb.stride;
                }
                src[s].combined.ptr = r->comb.ref;
                src[s].combined.stride = r->comb.stride;
                src[s].combined_topk_weights.ptr = r->comb_w.present ? r->comb_w.ref : NULL;
                src[s].combined_topk_weights.stride = r->comb_w.stride;
                src[s].source_weights.ptr = r->sw;
                src[s].source_weights.stride = r->sw_stride;
                src[s].weights = NULL;
                if (x->c->has_weights) {
                        /* cpu/exec.h wants packed [N * K_op] weights. */
                        float *w = (float *)halloc(x, 4ull * r->n * x->KO);
                        const uint8_t *from = use_w2 ? r->w2 : r->w;
                        for (uint32_t t = 0; t < r->n; t++)
                                memcpy(w + (uint64_t)t * x->KO, from + t * r->w_stride,
                                       4ull * x->KO);
                        src[s].weights = w;
                }
        }
        op.plan = x->plan;
        op.hidden = x->H;
        op.apply_weights = x->c->apply_weights;
        op.y = y;
        op.src = src;
        op.recv_weights = x->c->recv_weights && x->c->layout == EPD_LAYOUT_NON_EXPAND ? rw : NULL;
        run_items(epd_host_combine_items(&op), host_combine_fn, &op);
}

static int combine_row_bound(struct ctx *x)
{
        for (uint32_t s = 0; s < x->R; s++) {
                for (uint64_t e = 0; e < (uint64_t)x->rk[s].n * x->KO; e++) {
                        int32_t *prow = &x->plan->row[s][e];
                        if (*prow < 0)
                                continue;
                        const uint32_t t = (uint32_t)(e / x->KO), k = (uint32_t)(e % x->KO);
                        const uint32_t d = (uint32_t)x->plan->topk[s][e] / x->L;
                        const int32_t keep = *prow, past = (int32_t)x->rk[d].y_rows;
                        int32_t *wrow = (int32_t *)(x->ws + x->lay.row) +
                                        epd_ws_entry(&x->lay, s, t, x->K, 0) + k;
                        *prow = -1;
                        for (uint32_t r = 0; r < x->R; r++) {
                                memset(x->rk[r].comb.ref, SENTINEL, x->rk[r].comb.bytes);
                                if (x->rk[r].comb_w.present)
                                        memset(x->rk[r].comb_w.ref, SENTINEL,
                                               x->rk[r].comb_w.bytes);
                        }
                        host_combine(x, 0);
                        *prow = keep;
                        CK(cudaSetDevice(0));
                        CK(cudaMemcpy(wrow, &past, 4, cudaMemcpyHostToDevice));
                        int rc = gpu_combine(x, LAUNCH_DIRECT);
                        CK(cudaSetDevice(0));
                        CK(cudaMemcpy(wrow, &keep, 4, cudaMemcpyHostToDevice));
                        if (rc < 0)
                                return -1;
                        char what[96];
                        snprintf(what, sizeof(what), "combine with entry (%u, %u, %u) past y",
                                 s, t, k);
                        for (uint32_t r = 0; r < x->R; r++)
                                compare_buf(x, what, r, x->rk[r].comb.ref, x->rk[r].comb.got,
                                            x->rk[r].comb.bytes, x->rk[r].comb.stride);
                        printf("    combine skipped row %d of rank %u (past its y): same outputs "
                               "as without that entry\n", past, d);
                        return 0;
                }
        }
        return 0;
}

static void host_dispatch(struct ctx *x, int use_w2)
{
        struct epd_dispatch_src_io *src =
                (struct epd_dispatch_src_io *)halloc(x, sizeof(*src) * x->R);
        struct epd_dispatch_dst_io *dst =
                (struct epd_dispatch_dst_io *)halloc(x, sizeof(*dst) * x->R);
        struct epd_dispatch_exec op;

        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                src[s].x.ptr = r->x;
                src[s].x.stride = r->x_stride;
                src[s].scales.ptr = r->sc;
                src[s].scales.stride = r->sc_stride;
                src[s].weights.ptr = use_w2 ? r->w2 : r->w;
                src[s].weights.stride = r->w_stride;
                struct epd_mat *outs[O_NUM] = { &dst[s].recv_x, &dst[s].recv_scales,
                                                &dst[s].recv_topk_idx, &dst[s].recv_weights,
                                                &dst[s].recv_src, &dst[s].recv_topk_slot };
                for (int o = 0; o < O_NUM; o++) {
                        outs[o]->ptr = r->out[o].present ? r->out[o].ref : NULL;
                        outs[o]->stride = r->out[o].stride;
                }
        }
        op.plan = x->plan;
        op.row_bytes = x->row_bytes;
        op.scale_bytes = x->scale_bytes;
        op.topk_dtype = x->c->topk_dtype;
        op.has_weights = x->c->has_weights;
        op.zero_padding = x->c->zero_padding;
        op.src = src;
        op.dst = dst;
        run_items(epd_host_dispatch_items(&op), host_dispatch_fn, &op);
}

/* ---- timing ---- */


static int time_ceiling(double *gbps)
{
        const uint64_t bytes = 2ull << 30;
        void *a = NULL, *b = NULL;
        cudaEvent_t e0, e1;
        float ms;

        CK(cudaSetDevice(0));
        CK(cudaMalloc(&a, bytes));
        CK(cudaMalloc(&b, bytes));
        CK(cudaMemset(a, 1, bytes));
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e0, 0));
        for (int i = 0; i < 5; i++)
                CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        *gbps = 2.0 * bytes * 5 / (ms * 1e-3) / 1e9;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaFree(a);
        cudaFree(b);
        return 0;
}

/* Times `iters` back-to-back launches of the copy (what == 0) or combine (what == 1) step on
 * every device; returns the slowest device's mean milliseconds. */
static int time_step(struct ctx *x, int what, int iters, double *ms_out)
{
        double worst = 0;
        for (int dev = 0; dev < x->ndev; dev++) {
                struct epd_k_dispatch_args da;
                struct epd_k_combine_args ca;
                CK(cudaSetDevice(dev));
                dev_dispatch_args(x, dev, &da);
                dev_combine_args(x, dev, &ca);
                /* warm-up */
                if (what == 0)
                        CKS(epd_k_dispatch_copy(&da, x->stream[dev]));
                else
                        CKS(epd_k_combine(&ca, x->stream[dev]));
                CK(cudaEventRecord(x->ev_t0[dev], x->stream[dev]));
                for (int i = 0; i < iters; i++) {
                        if (what == 0)
                                CKS(epd_k_dispatch_copy(&da, x->stream[dev]));
                        else
                                CKS(epd_k_combine(&ca, x->stream[dev]));
                }
                CK(cudaEventRecord(x->ev_t1[dev], x->stream[dev]));
        }
        for (int dev = 0; dev < x->ndev; dev++) {
                float ms;
                CK(cudaSetDevice(dev));
                CK(cudaEventSynchronize(x->ev_t1[dev]));
                CK(cudaEventElapsedTime(&ms, x->ev_t0[dev], x->ev_t1[dev]));
                if (ms / iters > worst)
                        worst = ms / iters;
        }
        *ms_out = worst;
        return 0;
}

/* One device: the mean time of each dispatch step over `iters` back-to-back chains, with events
 * between the steps (count, prefix, place, copy). */
static int time_chain(struct ctx *x, int iters, double *steps)
{
        cudaEvent_t ev[5];
        struct epd_k_dispatch_args a;
        float ms;

        CK(cudaSetDevice(0));
        dev_dispatch_args(x, 0, &a);
        for (int i = 0; i < 5; i++)
                CK(cudaEventCreate(&ev[i]));
        for (int i = 0; i < 4; i++)
                steps[i] = 0;
        for (int it = 0; it <= iters; it++) {
                CK(cudaEventRecord(ev[0], x->stream[0]));
                CKS(epd_k_dispatch_count(&a, x->stream[0]));
                CK(cudaEventRecord(ev[1], x->stream[0]));
                CKS(epd_k_dispatch_prefix(&a, x->stream[0]));
                CK(cudaEventRecord(ev[2], x->stream[0]));
                CKS(epd_k_dispatch_place(&a, x->stream[0]));
                CK(cudaEventRecord(ev[3], x->stream[0]));
                CKS(epd_k_dispatch_copy(&a, x->stream[0]));
                CK(cudaEventRecord(ev[4], x->stream[0]));
                CK(cudaEventSynchronize(ev[4]));
                for (int i = 0; i < 4 && it > 0; i++) { /* iteration 0 warms up */
                        CK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
                        steps[i] += ms / iters;
                }
        }
        for (int i = 0; i < 5; i++)
                cudaEventDestroy(ev[i]);
        return 0;
}

/* One device: the mean GPU time of the small-op routing step alone (with_copy 0), of the
 * routing followed by the overlapped copy (with_copy 1), of the one-launch small dispatch
 * (with_copy 2), or of the one-launch small dispatch writing the reply block into pinned host
 * memory as the daemon has it do (with_copy 3), over `iters` back-to-back launches after one
 * warm-up. host_us, when not NULL, gets the mean host time of one launch call. */
static int time_route_small(struct ctx *x, int with_copy, int iters, double *ms_out,
                            double *host_us)
{
        struct epd_k_dispatch_args a;
        void *pinned = NULL;
        double host_ns = 0;
        float ms;

        CK(cudaSetDevice(0));
        dev_dispatch_args(x, 0, &a);
        if (with_copy == 3) {
                CK(cudaMallocHost(&pinned, x->lay.reply_bytes));
                a.reply_copy = pinned;
        }
        for (int i = 0; i <= iters; i++) {
                if (i == 1)
                        CK(cudaEventRecord(x->ev_t0[0], x->stream[0]));
                a.flags = 0;
                if (with_copy >= 2) {
                        const double h0 = now_s();
                        CKS(epd_k_dispatch_small(&a, x->stream[0]));
                        if (i > 0)
                                host_ns += (now_s() - h0) * 1e9;
                        continue;
                }
                CKS(epd_k_dispatch_route_small(&a, x->stream[0]));
                a.flags = EPD_K_COPY_OVERLAP;
                if (with_copy)
                        CKS(epd_k_dispatch_copy(&a, x->stream[0]));
        }
        CK(cudaEventRecord(x->ev_t1[0], x->stream[0]));
        CK(cudaEventSynchronize(x->ev_t1[0]));
        CK(cudaEventElapsedTime(&ms, x->ev_t0[0], x->ev_t1[0]));
        *ms_out = ms / iters;
        if (host_us != NULL)
                *host_us = host_ns / iters / 1e3;
        if (pinned != NULL)
                CK(cudaFreeHost(pinned));
        return 0;
}

/* Reads a buffer, leaving the L2 full of clean lines: the flush without the write-back debt. */
static __global__ void read_flush_kernel(const int4 *p, uint64_t n, int *sink)
{
        int acc = 0;
        for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
             i += (uint64_t)gridDim.x * blockDim.x) {
                const int4 v = p[i];
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        if (acc == 0x7fffffff)
                *sink = acc; /* practically never: keeps the loads */
}

/* One device, docs/benchmarks.md's Fresh mode as the daemon's benchmark sees it: 256 MB written on
 * the stream before each launch (which leaves the L2 full of dirty lines; read_flush 1 reads
 * them instead, which leaves it full of clean ones), then the mean GPU time between events
 * around the launch alone, over `iters` launches after one warm-up: the one-launch small
 * dispatch writing its reply into pinned host memory (what 0, as the daemon runs it) or combine
 * (what 1). The launch is queued while the flush still runs, so no host time falls inside the
 * window. as_daemon: as the daemon instead: the flush completes (the GPU is idle, as
 * docs/benchmarks.md's Fresh mode says), then the timed launch (events and kernel in one graph)
  * with the descriptors in the kernel's parameters. */
static int time_fresh(struct ctx *x, int what, int read_flush, int as_daemon, int iters,
                      double *ms_out)
{
        const size_t flush_bytes = 256u << 20;
        struct epd_k_dispatch_args da;
        struct epd_k_combine_args ca;
        void *flush = NULL, *pinned = NULL;
        double total = 0;
        float ms;

        CK(cudaSetDevice(0));
        dev_dispatch_args(x, 0, &da);
        dev_combine_args(x, 0, &ca);
        CK(cudaMalloc(&flush, flush_bytes));
        CK(cudaMallocHost(&pinned, x->lay.reply_bytes));
        da.reply_copy = pinned;
        struct epd_k_small_plan plan;
        if (as_daemon) {
                da.ranks_host = x->dr_host;
                da.local_host = x->local_host[0];
                ca.ranks_host = x->cr_host;
                ca.local_host = x->local_host[0];
                CKS(epd_k_dispatch_small_plan(&da, &plan));
        }
        CK(cudaMemset(flush, 1, flush_bytes));
        for (int i = 0; i <= iters; i++) {
                if (read_flush)
                        read_flush_kernel<<<1024, 512, 0, x->stream[0]>>>(
                                (const int4 *)flush, flush_bytes / 16, (int *)flush);
                else
                        CK(cudaMemsetAsync(flush, i % 251 + 1, flush_bytes, x->stream[0]));
                if (as_daemon) {
                        CK(cudaStreamSynchronize(x->stream[0]));
                        if (what == 0)
                                CKS(epd_k_dispatch_small_timed(&da, &plan, timed.obj[0],
                                                               timed.t0, timed.t1,
                                                               x->stream[0]));
                        else
                                CKS(epd_k_combine_timed(&ca, timed.obj[1], timed.t0, timed.t1,
                                                        x->stream[0]));
                        CK(cudaEventSynchronize(timed.t1));
                        CK(cudaEventElapsedTime(&ms, timed.t0, timed.t1));
                        if (i > 0)
                                total += ms;
                        continue;
                }
                CK(cudaEventRecord(x->ev_t0[0], x->stream[0]));
                if (what == 0)
                        CKS(epd_k_dispatch_small(&da, x->stream[0]));
                else
                        CKS(epd_k_combine(&ca, x->stream[0]));
                CK(cudaEventRecord(x->ev_t1[0], x->stream[0]));
                CK(cudaEventSynchronize(x->ev_t1[0]));
                CK(cudaEventElapsedTime(&ms, x->ev_t0[0], x->ev_t1[0]));
                if (i > 0)
                        total += ms;
        }
        *ms_out = total / iters;
        CK(cudaFreeHost(pinned));
        CK(cudaFree(flush));
        return 0;
}

static int report_timing(struct ctx *x, double ceiling)
{
        double ms_copy, ms_comb;
        uint64_t contrib = 0, tokens = 0;
        const uint64_t meta = (x->c->layout == EPD_LAYOUT_NON_EXPAND ? x->esize * x->KO : 4) +
                              (x->c->has_weights ? (x->c->layout == EPD_LAYOUT_NON_EXPAND
                                                            ? 4ull * x->KO
                                                            : 4)
                                                 : 0) +
                              8;

        /* Rows moved: one per entry with a row (NON_EXPAND rows sit at each destination's
         * first position, EXPAND rows at every selection); padding is not payload. The same
         * rows are what combine reads back. */
        for (uint32_t s = 0; s < x->R; s++) {
                tokens += x->rk[s].n;
                for (uint64_t i = 0; i < (uint64_t)x->rk[s].n * x->KO; i++)
                        contrib += x->plan->row[s][i] >= 0;
        }
        const uint64_t rows = contrib;
        uint64_t sent_tokens = 0; /* tokens that go somewhere: read once by the copy kernel */
        for (uint32_t s = 0; s < x->R; s++)
                for (uint32_t t = 0; t < x->rk[s].n; t++)
                        for (uint32_t k = 0; k < x->KO; k++)
                                if (x->plan->row[s][(uint64_t)t * x->KO + k] >= 0) {
                                        sent_tokens++;
                                        break;
                                }
        if (time_step(x, 0, 10, &ms_copy) < 0 || time_step(x, 1, 10, &ms_comb) < 0)
                return -1;
        double steps[4], ms_small = 0, ms_small_copy = 0, ms_fused = 0;
        if (x->ndev == 1 && time_chain(x, 10, steps) < 0)
                return -1;
        if (small_ok(x, 0) && (time_route_small(x, 0, 20, &ms_small, NULL) < 0 ||
                                  time_route_small(x, 1, 20, &ms_small_copy, NULL) < 0))
                return -1;
        double ms_fused_reply = 0, us_fused_host = 0, fresh[2][2] = { { 0 } }, daemon[2] = { 0 };
        if (small_ok(x, 1) && (time_route_small(x, 2, 20, &ms_fused, &us_fused_host) < 0 ||
                               time_route_small(x, 3, 20, &ms_fused_reply, NULL) < 0))
                return -1;
        for (int what = 0; what < 2 && small_ok(x, 1); what++)
                for (int rf = 0; rf < 2; rf++)
                        if (time_fresh(x, what, rf, 0, 20, &fresh[what][rf]) < 0)
                                return -1;
        for (int what = 0; what < 2 && small_ok(x, 1); what++)
                if (time_fresh(x, what, 0, 1, 20, &daemon[what]) < 0)
                        return -1;
        double disp_floor = 2.0 * rows * (x->row_bytes + x->scale_bytes);
        double disp_meta = 2.0 * rows * (x->row_bytes + x->scale_bytes + meta);
        double comb_floor = (double)(contrib + tokens * (1 + x->c->num_bias)) * 2.0 * x->H;
        printf("    timing (%d device%s, slowest device): D2D cudaMemcpyAsync ceiling %.0f GB/s "
               "(read + write)\n",
               x->ndev, x->ndev > 1 ? "s" : "", ceiling);
        printf("    dispatch copy kernel: %.3f ms, %llu rows; floor bytes (2 x rows x (x + "
               "scales)) %.0f GB/s = %.1f%% of ceiling; with metadata %.0f GB/s\n",
               ms_copy, (unsigned long long)rows, disp_floor / (ms_copy * 1e-3) / 1e9,
               100.0 * disp_floor / (ms_copy * 1e-3) / 1e9 / ceiling,
               disp_meta / (ms_copy * 1e-3) / 1e9);
        double actual = (double)(sent_tokens + rows) * (x->row_bytes + x->scale_bytes);
        printf("    dispatch copy kernel, bytes actually moved (each sent token read once, "
               "%llu tokens, + rows written): %.0f GB/s = %.1f%% of ceiling\n",
               (unsigned long long)sent_tokens, actual / (ms_copy * 1e-3) / 1e9,
               100.0 * actual / (ms_copy * 1e-3) / 1e9 / ceiling);
        if (x->ndev == 1)
                printf("    whole dispatch chain %.3f ms: count %.3f, prefix %.3f, place %.3f, "
                       "copy %.3f ms\n",
                       steps[0] + steps[1] + steps[2] + steps[3], steps[0], steps[1], steps[2],
                       steps[3]);
        if (ms_small > 0)
                printf("    small-op routing %.3f ms (replaces count + prefix + place); with the "
                       "overlapped copy %.3f ms: floor bytes %.0f GB/s = %.1f%% of ceiling\n",
                       ms_small, ms_small_copy, disp_floor / (ms_small_copy * 1e-3) / 1e9,
                       100.0 * disp_floor / (ms_small_copy * 1e-3) / 1e9 / ceiling);
        if (ms_fused > 0)
                printf("    one-launch small dispatch %.4f ms: floor bytes %.0f GB/s = %.1f%% of "
                       "ceiling; writing the reply into pinned host memory too %.4f ms; host "
                       "time of one launch call %.1f us\n",
                       ms_fused, disp_floor / (ms_fused * 1e-3) / 1e9,
                       100.0 * disp_floor / (ms_fused * 1e-3) / 1e9 / ceiling, ms_fused_reply,
                       us_fused_host);
        if (fresh[0][0] > 0)
                printf("    Fresh mode (256 MB written before each launch, events around the "
                       "launch): one-launch small dispatch with the reply copy %.4f ms, combine "
                       "%.4f ms; 256 MB read instead (clean L2): %.4f ms, %.4f ms\n",
                       fresh[0][0], fresh[1][0], fresh[0][1], fresh[1][1]);
        if (daemon[0] > 0)
                printf("    Fresh mode as the daemon (256 MB written, GPU idle, events and kernel as "
                       "one graph, descriptors in the parameters): one-launch small dispatch "
                       "%.4f ms, combine %.4f ms\n",
                       daemon[0], daemon[1]);
        printf("    combine kernel: %.4f ms, %llu rows read, %llu rows written; floor %.0f GB/s "
               "= %.1f%% of ceiling\n",
               ms_comb, (unsigned long long)contrib, (unsigned long long)tokens,
               comb_floor / (ms_comb * 1e-3) / 1e9,
               100.0 * comb_floor / (ms_comb * 1e-3) / 1e9 / ceiling);
        return 0;
}

/* ---- one case ---- */

static int run_case(struct ctx *x, int ndev_avail, int timing, double *ceiling)
{
        const struct tcase *c = x->c;
        struct rng g = { c->seed };
        struct verdict want;

        x->R = c->R;
        x->E = c->E;
        x->L = c->E / c->R;
        x->T = c->T;
        x->K = c->K;
        x->KO = c->KO;
        x->H = c->H;
        x->row_bytes = c->dtype == EPD_DTYPE_BF16 ? 2ull * c->H : c->H;
        x->scale_bytes = c->dtype == EPD_DTYPE_FP8_E4M3 ? 4ull * (c->H / c->scale_block) : 0;
        x->esize = c->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        x->ndev = c->spread ? (ndev_avail < (int)c->R ? ndev_avail : (int)c->R) : 1;
        if (x->ndev > MAX_DEV)
                x->ndev = MAX_DEV;
        x->rk = (struct rank_data *)halloc(x, sizeof(*x->rk) * x->R);
        for (uint32_t s = 0; s < x->R; s++)
                x->rk[s].dev = (int)(s % x->ndev);

        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaStreamCreateWithFlags(&x->stream[dev], cudaStreamNonBlocking));
                CK(cudaEventCreateWithFlags(&x->ev_count[dev], cudaEventDisableTiming));
                CK(cudaEventCreate(&x->ev_t0[dev]));
                CK(cudaEventCreate(&x->ev_t1[dev]));
        }
        CK(cudaSetDevice(0));
        CK(cudaEventCreateWithFlags(&x->ev_prefix, cudaEventDisableTiming));

        double t0 = now_s();
        gen_inputs(x, &g);

        /* The reference plan. */
        uint32_t *ntok = (uint32_t *)halloc(x, 4ull * x->R);
        for (uint32_t s = 0; s < x->R; s++)
                ntok[s] = x->rk[s].n;
        x->plan = epd_plan_new(x->R, x->E, x->T, x->KO, c->align, c->layout, ntok);
        if (x->plan == NULL) {
                failf(x, "epd_plan_new refused the case's dims");
                return -1;
        }
        expected_validation(x, &want);
        int host_invalid = 0;
        for (uint32_t s = 0; s < x->R; s++) {
                char err[256];
                int ret = epd_plan_count_source(x->plan, s, x->rk[s].topk, c->topk_dtype,
                                                x->rk[s].topk_stride, err, sizeof(err));
                if (ret != 0)
                        host_invalid = 1;
        }
        if (host_invalid != (want.status != 0))
                failf(x, "plan.c and the test disagree on validity (plan %d, test %d)",
                      host_invalid, want.status != 0);
        uint64_t max_rows = c->layout == EPD_LAYOUT_EXPAND
                                    ? epd_route_max_rows_expand(x->R, x->T, x->KO, x->L, c->align)
                                    : epd_route_max_rows_non_expand(x->R, x->T);
        if (!host_invalid) {
                epd_plan_finish(x->plan);
                for (uint32_t s = 0; s < x->R; s++)
                        epd_plan_place_source(x->plan, s);
        }
        for (uint32_t d = 0; d < x->R; d++) {
                struct rank_data *r = &x->rk[d];
                r->rows = host_invalid ? 0 : (uint64_t)epd_plan_rows(x->plan, d);
                if (host_invalid)
                        r->cap = 64;
                else if (c->worst_case_capacity)
                        r->cap = max_rows;
                else
                        r->cap = r->rows + 3; /* slack rows must stay untouched */
                if ((int)d == c->short_rank && r->rows > 0) {
                        r->cap = r->rows - 1;
                        if (want.status == 0) {
                                want.status = EPD_CAPACITY_EXCEEDED;
                                want.reason = EPD_WS_REASON_CAPACITY;
                                want.rank = (int)d;
                                want.num_short = 1;
                                want.value = (int64_t)r->rows;
                                want.capacity = (int64_t)r->cap;
                        }
                }
        }

        /* Inputs and outputs on the devices. */
        for (uint32_t s = 0; s < x->R; s++) {
                struct rank_data *r = &x->rk[s];
                uint64_t n = r->n;
                if (upload(x, r->dev, r->x, n * r->x_stride, &r->d_x) < 0 ||
                    upload(x, r->dev, r->topk, n * r->topk_stride * x->esize, &r->d_topk) < 0)
                        return -1;
                if (r->sc && upload(x, r->dev, r->sc, n * r->sc_stride, &r->d_sc) < 0)
                        return -1;
                if (r->w && (upload(x, r->dev, r->w, n * r->w_stride, &r->d_w) < 0 ||
                             upload(x, r->dev, r->w2, n * r->w_stride, &r->d_w2) < 0))
                        return -1;
                const int expand = c->layout == EPD_LAYOUT_EXPAND;
                const uint64_t pad = c->strided ? 16 : 0;
                uint64_t strides[O_NUM] = { x->row_bytes + pad * 2, x->scale_bytes + pad,
                                            x->esize * x->KO + pad,
                                            (expand ? 4 : 4ull * x->KO) + (c->strided ? 4 : 0),
                                            8ull + (c->strided ? 8 : 0), 4ull + (c->strided ? 4 : 0) };
                int present[O_NUM] = { 1, x->scale_bytes != 0, !expand, c->has_weights, 1,
                                       expand };
                for (int o = 0; o < O_NUM; o++) {
                        struct buf *b = &r->out[o];
                        b->present = present[o];
                        if (!b->present)
                                continue;
                        b->stride = strides[o];
                        b->bytes = r->cap * b->stride;
                        b->ref = (uint8_t *)halloc(x, b->bytes);
                        b->got = (uint8_t *)halloc(x, b->bytes);
                        memset(b->ref, SENTINEL, b->bytes);
                        if (dalloc(x, r->dev, b->bytes, &b->dev) < 0)
                                return -1;
                }
        }
        x->dr_host = (struct epd_k_dispatch_rank *)halloc(x, sizeof(*x->dr_host) * x->R);
        x->cr_host = (struct epd_k_combine_rank *)halloc(x, sizeof(*x->cr_host) * x->R);
        for (int dev = 0; dev < x->ndev; dev++) {
                if (dalloc(x, dev, sizeof(*x->dr_host) * x->R, (uint8_t **)&x->dr_dev[dev]) < 0 ||
                    dalloc(x, dev, sizeof(*x->cr_host) * x->R, (uint8_t **)&x->cr_dev[dev]) < 0)
                        return -1;
        }
        if (upload_locals(x) < 0 || upload_dispatch_desc(x, 0) < 0)
                return -1;

        uint64_t ws_bytes = epd_k_workspace_bytes(x->R, x->E, x->T, x->K);
        if (ws_bytes == 0) {
                failf(x, "epd_k_workspace_bytes refused the dims");
                return -1;
        }
        epd_ws_layout_init(&x->lay, x->R, x->E, x->T, x->K);
        if (ws_bytes != x->lay.total_bytes ||
            epd_k_reply_bytes(x->R, x->E) != x->lay.reply_bytes)
                failf(x, "workspace sizes disagree with layout.h");
        if (dalloc(x, 0, ws_bytes, &x->ws) < 0)
                return -1;
        CK(cudaMallocHost((void **)&x->reply, x->lay.reply_bytes));
        double t_setup = now_s() - t0;

        /* Reference. */
        t0 = now_s();
        if (want.status == 0)
                host_dispatch(x, 0);
        double t_host = now_s() - t0;

        /* Run 1, from a workspace full of garbage: the kernels must not rely on zeroed
         * memory. */
        CK(cudaSetDevice(0));
        CK(cudaMemset(x->ws, WS_GARBAGE_1, ws_bytes));
        if (reset_outputs(x) < 0)
                return -1;
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaDeviceSynchronize());
        }
        t0 = now_s();
        if (gpu_dispatch(x, 0) < 0)
                return -1;
        double t_gpu = now_s() - t0;
        check_verdict(x, &want);
        if (readback_outputs(x) < 0)
                return -1;
        compare_outputs(x, "run 1", 1, NULL);
        if (want.status == 0 && check_routing(x) < 0)
                return -1;
        uint8_t **first = save_outputs(x);

        /* Run 2: different garbage, same bits expected. */
        CK(cudaSetDevice(0));
        CK(cudaMemset(x->ws, WS_GARBAGE_2, ws_bytes));
        if (reset_outputs(x) < 0)
                return -1;
        for (int dev = 0; dev < x->ndev; dev++) {
                CK(cudaSetDevice(dev));
                CK(cudaDeviceSynchronize());
        }
        if (gpu_dispatch(x, 0) < 0)
                return -1;
        check_verdict(x, &want);
        if (readback_outputs(x) < 0)
                return -1;
        compare_outputs(x, "run 2 vs run 1", 0, first);

        /* Run 3: the small-op routing, from garbage again (its counters zeroed by
         * epd_k_workspace_init, as after an allocation), when the case qualifies: the same
         * verdict, outputs and workspace (rows, counts) as the step sequence. Run 4 repeats it
         * on what run 3 left (the kernel must put its counters back to zero, whatever the
         * verdict). Combine and cached dispatch below then run on what it left. */
        /* Runs 5 and 6: the one-launch small dispatch, from garbage (it needs no zeroed
         * counters), then again on what run 5 left, through the timed launch with the
         * descriptors in the parameters (as the daemon launches it); it must give the same
         * verdict, outputs and workspace. Run 7 repeats run 6 with graphs off (record, launch,
         * record). Combine and cached dispatch below run on what run 7 left, so they check the
         * workspace arrays this kernel writes for them. */
        const int small = small_ok(x, 0), fused = small && small_ok(x, 1);
        for (int run = 3; run <= 7; run++) {
                const int one_launch = run >= 5;
                const char *name = one_launch ? "one-launch small dispatch" : "small-op routing";
                char what[64];
                if (!(one_launch ? fused : small))
                        continue;
                CK(cudaSetDevice(0));
                if (run == 3 || run == 5)
                        CK(cudaMemset(x->ws, WS_GARBAGE_1, ws_bytes));
                if (run == 3)
                        CKS(epd_k_workspace_init(x->ws, x->R, x->E, x->T, x->K, 0));
                if (reset_outputs(x) < 0)
                        return -1;
                CK(cudaDeviceSynchronize());
                const int mode = run == 6   ? LAUNCH_TIMED
                                 : run == 7 ? LAUNCH_TIMED_NO_GRAPH
                                            : LAUNCH_DIRECT;
                if ((one_launch ? gpu_dispatch_fused(x, mode) : gpu_dispatch_small(x)) < 0)
                        return -1;
                check_verdict(x, &want);
                if (readback_outputs(x) < 0)
                        return -1;
                snprintf(what, sizeof(what), "%s run %d vs run 1", name, run);
                compare_outputs(x, what, 0, first);
                if (want.status == 0 && check_routing(x) < 0)
                        return -1;
                printf("    %s run %d: same verdict, rows and outputs as the step sequence\n",
                       name, run);
        }
        if (fused) {
                /* Leave the small routing's counters zero for any later route_small. */
                CKS(epd_k_workspace_init(x->ws, x->R, x->E, x->T, x->K, 0));
                CK(cudaDeviceSynchronize());
        }

        if (want.status != 0) {
                printf("    verdict %s as expected; no output byte written (%.2fs setup, "
                       "%.3fs gpu)\n",
                       status_name(want.status), t_setup, t_gpu);
                return 0;
        }

        /* Combine, three times: the second time through the timed launch (one device), the
         * third with graphs off. */
        if (setup_combine(x, &g) < 0)
                return -1;
        t0 = now_s();
        host_combine(x, 0);
        double t_hcomb = now_s() - t0;
        for (int run = 0; run < 3; run++) {
                char what[64];
                if (gpu_combine(x, run == 1   ? LAUNCH_TIMED
                                   : run == 2 ? LAUNCH_TIMED_NO_GRAPH
                                              : LAUNCH_DIRECT) < 0)
                        return -1;
                for (uint32_t s = 0; s < x->R; s++) {
                        struct rank_data *r = &x->rk[s];
                        snprintf(what, sizeof(what), "run %d combined", run + 1);
                        compare_buf(x, what, s, r->comb.ref, r->comb.got, r->comb.bytes,
                                    r->comb.stride);
                        if (r->comb_w.present) {
                                snprintf(what, sizeof(what), "run %d combined_topk_weights",
                                         run + 1);
                                compare_buf(x, what, s, r->comb_w.ref, r->comb_w.got,
                                            r->comb_w.bytes, r->comb_w.stride);
                        }
                }
        }

        /* A workspace row past the rows of y that prep checked (what a client rewriting its
         * topk_idx during the dispatch could leave): combine must skip that contribution,
         * neither reading past y nor faulting. The first contributing entry's row is set to its
         * destination's y_rows, and the reference drops the same entry. */
        if (combine_row_bound(x) < 0)
                return -1;

        /* Cached dispatch with new weights: recheck + copy, then combine with them. */
        if (c->cached) {
                for (uint32_t s = 0; s < x->R; s++)
                        for (int o = 0; o < O_NUM; o++)
                                if (x->rk[s].out[o].present)
                                        memset(x->rk[s].out[o].ref, SENTINEL,
                                               x->rk[s].out[o].bytes);
                host_dispatch(x, 1);
                if (reset_outputs(x) < 0 || upload_dispatch_desc(x, 1) < 0)
                        return -1;
                for (int dev = 0; dev < x->ndev; dev++) {
                        CK(cudaSetDevice(dev));
                        CK(cudaDeviceSynchronize());
                }
                if (gpu_dispatch(x, 1) < 0)
                        return -1;
                struct verdict ok;
                memset(&ok, 0, sizeof(ok));
                check_verdict(x, &ok);
                if (readback_outputs(x) < 0)
                        return -1;
                compare_outputs(x, "cached dispatch", 1, NULL);
                for (uint32_t s = 0; s < x->R; s++) {
                        memset(x->rk[s].comb.ref, SENTINEL, x->rk[s].comb.bytes);
                        if (x->rk[s].comb_w.present)
                                memset(x->rk[s].comb_w.ref, SENTINEL, x->rk[s].comb_w.bytes);
                }
                host_combine(x, 1);
                if (gpu_combine(x, LAUNCH_DIRECT) < 0)
                        return -1;
                for (uint32_t s = 0; s < x->R; s++) {
                        struct rank_data *r = &x->rk[s];
                        compare_buf(x, "combine after cached dispatch", s, r->comb.ref,
                                    r->comb.got, r->comb.bytes, r->comb.stride);
                        if (r->comb_w.present)
                                compare_buf(x, "combined_topk_weights after cached dispatch", s,
                                            r->comb_w.ref, r->comb_w.got, r->comb_w.bytes,
                                            r->comb_w.stride);
                }
        }
        printf("    rows per rank:");
        for (uint32_t d = 0; d < x->R && d < 16; d++)
                printf(" %llu", (unsigned long long)x->rk[d].rows);
        printf("  (%.2fs setup, %.2fs host dispatch, %.2fs host combine, %.3fs gpu dispatch)\n",
               t_setup, t_host, t_hcomb, t_gpu);

        if (c->big && timing && x->failures == 0) {
                if (*ceiling == 0 && time_ceiling(ceiling) < 0)
                        return -1;
                if (report_timing(x, *ceiling) < 0)
                        return -1;
        }
        return 0;
}

/* ---- ordering primitives (kernels/ordering.cuh) ---- */

static __global__ void wait_kernel(const uint64_t *word, uint64_t target, int sys,
                                   const uint32_t *abort_word, uint64_t timeout_ns, int *result,
                                   const uint64_t *payload, uint64_t *seen)
{
        if (threadIdx.x != 0)
                return;
        int r = epd_wait_geq_u64(word, target, sys ? EPD_WAIT_SYS : EPD_WAIT_GPU, abort_word,
                                 timeout_ns);
        *result = r;
        if (r == 0)
                *seen = *(const volatile uint64_t *)payload;
}

static __global__ void signal_kernel(uint64_t *payload, uint64_t *word, uint64_t value)
{
        if (threadIdx.x != 0)
                return;
        /* Give the waiter time to start spinning first. */
        uint64_t start = epd_globaltimer_ns();
        while (epd_globaltimer_ns() - start < 2000000)
                __nanosleep(1000);
        *payload = 1000 + value;
        epd_st_release_gpu_u64(word, value);
}

struct host_signal {
        uint64_t *payload, *word;
        uint64_t value;
};

static void *host_signal_fn(void *arg)
{
        struct host_signal *h = (struct host_signal *)arg;
        usleep(20000);
        *(volatile uint64_t *)h->payload = 1000 + h->value;
        __atomic_store_n(h->word, h->value, __ATOMIC_RELEASE);
        return NULL;
}

/* The bounded wait must time out, honour the abort word, return at once when the word is
 * already there, and see a payload published with release semantics by another kernel (.gpu)
 * and by a host thread through pinned memory (.sys). Nothing may trap. */
static int test_ordering(int *failures)
{
        uint64_t *dword, *dpayload, *dseen, *hmem;
        uint32_t *dabort;
        int *dres, res;
        uint64_t seen;
        cudaStream_t s1, s2;
        int fails = 0;

        CK(cudaSetDevice(0));
        CK(cudaMalloc(&dword, 8));
        CK(cudaMalloc(&dpayload, 8));
        CK(cudaMalloc(&dseen, 8));
        CK(cudaMalloc(&dabort, 4));
        CK(cudaMalloc(&dres, 4));
        CK(cudaHostAlloc(&hmem, 16, cudaHostAllocMapped));
        CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));

        struct {
                const char *name;
                uint64_t word, target;
                uint32_t abort;
                int use_abort;
                int want;
        } t[3] = { { "timeout", 0, 1, 0, 0, EPD_TIMEOUT },
                   { "abort", 0, 1, 1, 1, EPD_ABORTED },
                   { "already there", 5, 5, 0, 1, 0 } };
        for (int i = 0; i < 3; i++) {
                CK(cudaMemcpy(dword, &t[i].word, 8, cudaMemcpyHostToDevice));
                CK(cudaMemcpy(dabort, &t[i].abort, 4, cudaMemcpyHostToDevice));
                double t0 = now_s();
                wait_kernel<<<1, 32, 0, s1>>>(dword, t[i].target, 1,
                                              t[i].use_abort ? dabort : NULL, 2000000, dres,
                                              dpayload, dseen);
                CK(cudaStreamSynchronize(s1));
                CK(cudaMemcpy(&res, dres, 4, cudaMemcpyDeviceToHost));
                printf("    wait %s: %s after %.1f ms\n", t[i].name, status_name(res),
                       (now_s() - t0) * 1e3);
                if (res != t[i].want) {
                        printf("    FAIL: wait %s returned %d, want %d\n", t[i].name, res,
                               t[i].want);
                        fails++;
                }
        }

        /* Kernel to kernel on one GPU, .gpu scope. Both kernels must be loaded before the
         * waiter spins (CUDA loads lazily, and a load can wait for running kernels: without
         * this the waiter times out), which is what epd_k_preload does for the library. */
        struct cudaFuncAttributes attr;
        CK(cudaFuncGetAttributes(&attr, signal_kernel));
        CK(cudaFuncGetAttributes(&attr, wait_kernel));
        uint64_t zero = 0;
        CK(cudaMemcpy(dword, &zero, 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dpayload, &zero, 8, cudaMemcpyHostToDevice));
        wait_kernel<<<1, 32, 0, s1>>>(dword, 7, 0, NULL, 2000000000ull, dres, dpayload, dseen);
        signal_kernel<<<1, 32, 0, s2>>>(dpayload, dword, 7);
        CK(cudaStreamSynchronize(s1));
        CK(cudaStreamSynchronize(s2));
        CK(cudaMemcpy(&res, dres, 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&seen, dseen, 8, cudaMemcpyDeviceToHost));
        printf("    wait for a kernel's release (.gpu): %s, payload %llu\n", status_name(res),
               (unsigned long long)seen);
        if (res != 0 || seen != 1007) {
                printf("    FAIL: want OK and payload 1007\n");
                fails++;
        }

        /* Host thread to kernel through pinned memory, .sys scope. */
        hmem[0] = 0;
        hmem[1] = 0;
        uint64_t *dh;
        CK(cudaHostGetDevicePointer((void **)&dh, hmem, 0));
        wait_kernel<<<1, 32, 0, s1>>>(dh, 9, 1, NULL, 2000000000ull, dres, dh + 1, dseen);
        struct host_signal hs = { &hmem[1], &hmem[0], 9 };
        pthread_t th;
        pthread_create(&th, NULL, host_signal_fn, &hs);
        CK(cudaStreamSynchronize(s1));
        pthread_join(th, NULL);
        CK(cudaMemcpy(&res, dres, 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&seen, dseen, 8, cudaMemcpyDeviceToHost));
        printf("    wait for a host thread's release (.sys): %s, payload %llu\n",
               status_name(res), (unsigned long long)seen);
        if (res != 0 || seen != 1009) {
                printf("    FAIL: want OK and payload 1009\n");
                fails++;
        }

        cudaStreamDestroy(s1);
        cudaStreamDestroy(s2);
        cudaFree(dword);
        cudaFree(dpayload);
        cudaFree(dseen);
        cudaFree(dabort);
        cudaFree(dres);
        cudaFreeHost(hmem);
        *failures += fails;
        return 0;
}

static int enable_peers(int ndev)
{
        for (int a = 0; a < ndev; a++) {
                for (int b = 0; b < ndev; b++) {
                        int ok = 0;
                        if (a == b)
                                continue;
                        if (cudaDeviceCanAccessPeer(&ok, a, b) != cudaSuccess || !ok)
                                return 0;
                        cudaSetDevice(a);
                        cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
                        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
                                return 0;
                        cudaGetLastError();
                }
        }
        return 1;
}

int main(int argc, char **argv)
{
        int quick = 0, only = -1, timing = 1, list = 0, ndev = 0;
        uint64_t seed_xor = 0;

        for (int i = 1; i < argc; i++) {
                if (!strcmp(argv[i], "--quick"))
                        quick = 1;
                else if (!strcmp(argv[i], "--no-timing"))
                        timing = 0;
                else if (!strcmp(argv[i], "--list"))
                        list = 1;
                else if (!strcmp(argv[i], "--case") && i + 1 < argc)
                        only = atoi(argv[++i]);
                else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
                        seed_xor = strtoull(argv[++i], NULL, 0);
                else {
                        fprintf(stderr, "usage: %s [--quick] [--case N] [--seed S] "
                                        "[--no-timing] [--list]\n",
                                argv[0]);
                        return 2;
                }
        }

        cudaError_t e = cudaGetDeviceCount(&ndev);
        if (!list && (e != cudaSuccess || ndev == 0)) {
                printf("SKIP: no CUDA device (%s)\n",
                       e != cudaSuccess ? cudaGetErrorString(e) : "count 0");
                return 77;
        }
        if (ndev > MAX_DEV)
                ndev = MAX_DEV;
        int have_spread = ndev >= 2 && enable_peers(ndev);
        if (!list) {
                for (int d = 0; d < ndev; d++) {
                        struct cudaDeviceProp p;
                        if (cudaGetDeviceProperties(&p, d) == cudaSuccess)
                                printf("GPU %d: %s, sm_%d%d, %d SMs, %.0f GiB\n", d, p.name,
                                       p.major, p.minor, p.multiProcessorCount,
                                       p.totalGlobalMem / 1073741824.0);
                }
                if (ndev >= 2 && !have_spread)
                        printf("note: %d GPUs without full peer access: spread cases skipped\n",
                               ndev);
                else if (ndev < 2)
                        printf("note: one GPU: spread-over-GPUs cases skipped\n");
        }
        build_cases();

        int failed = 0, ran = 0;
        double ceiling = 0;

        if (!list) {
                for (int d = 0; d < ndev; d++) {
                        cudaSetDevice(d);
                        int ret = epd_k_preload();
                        if (ret != 0) {
                                printf("epd_k_preload on GPU %d failed: %d (%s)\n", d, ret,
                                       cudaGetErrorString(epd_k_last_cuda_error()));
                                return 1;
                        }
                }
                cudaSetDevice(0);
                if (timed_init() < 0)
                        return 1;
        }
        const char *match = getenv("EPD_KTEST_MATCH");
        if (!list && only < 0 && !match) {
                int fails = 0;
                printf("ordering primitives:\n");
                int ret = test_ordering(&fails);
                ran++;
                printf("ordering primitives: %s\n", ret == 0 && fails == 0 ? "PASS" : "FAIL");
                if (ret != 0 || fails != 0)
                        failed++;
        }
        for (int i = 0; i < num_cases; i++) {
                struct tcase *c = &cases[i];
                c->seed ^= seed_xor;
                if (list) {
                        printf("%2d  %s (R %u, E %u, T %u, K_op %u, H %u)\n", i, c->name, c->R,
                               c->E, c->T, c->KO, c->H);
                        continue;
                }
                if ((only >= 0 && i != only) || (quick && c->big) ||
                    (match && !strstr(c->name, match)))
                        continue;
                if (c->spread && !have_spread) {
                        printf("case %2d seed 0x%llx: %s: SKIP (needs 2+ GPUs with peer "
                               "access)\n",
                               i, (unsigned long long)c->seed, c->name);
                        continue;
                }
                printf("case %2d seed 0x%llx: %s [R %u%s E %u T %u K %u/%u H %u %s %s align %u%s%s "
                       "topk %s neg %.2f bias %d%s%s%s%s%s%s]\n",
                       i, (unsigned long long)c->seed, c->name, c->R, c->spread ? " spread" : "",
                       c->E, c->T, c->KO, c->K, c->H,
                       c->dtype == EPD_DTYPE_BF16 ? "bf16" : "fp8",
                       c->layout == EPD_LAYOUT_EXPAND ? "EXPAND" : "NON_EXPAND", c->align,
                       c->zero_padding ? " zero-pad" : "", c->has_weights ? " weights" : "",
                       c->topk_dtype == EPD_DTYPE_INT64 ? "i64" : "i32", c->neg_frac,
                       c->num_bias, c->apply_weights ? " apply-weights" : "",
                       c->strided ? " strided" : "", c->cached ? " cached" : "",
                       c->worst_case_capacity ? " worst-cap" : "",
                       c->source_weights ? " source-weights" : "",
                       c->recv_weights ? " recv-weights" : "");
                fflush(stdout);
                struct ctx *x = (struct ctx *)calloc(1, sizeof(*x));
                x->c = c;
                int ret = run_case(x, ndev, timing, &ceiling);
                int ok = ret == 0 && x->failures == 0;
                if (ret < 0 && x->failures == 0)
                        printf("    FAIL: CUDA or setup error (see stderr)\n");
                ctx_free(x);
                free(x);
                ran++;
                printf("case %2d: %s\n", i, ok ? "PASS" : "FAIL");
                fflush(stdout);
                if (!ok)
                        failed++;
                /* A sticky CUDA error poisons every later case: stop and say so. */
                cudaError_t sticky = cudaDeviceSynchronize();
                if (sticky != cudaSuccess) {
                        printf("aborting: CUDA context is broken (%s)\n",
                               cudaGetErrorString(sticky));
                        failed++;
                        break;
                }
        }
        if (list)
                return 0;
        if (!list)
                printf("timed launches (graphs): %d one-launch dispatches, %d combines, %d and %d "
                       "of them direct; with graphs off: %d and %d\n",
                       timed.launches[0], timed.launches[1], timed.direct[0], timed.direct[1],
                       timed.off_launches[0], timed.off_launches[1]);
        printf("%d of %d cases passed\n", ran - failed, ran);
        fflush(stdout);
        return failed ? 1 : 0;
}
