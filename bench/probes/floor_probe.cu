/* floor_probe.cu - epd-floor-probe: what the bytes of a small op cost on this GPU with nothing of
 * epd around them, so that the decode targets can be set against a measured floor rather
 * than against the op's bytes at the copy ceiling (docs/performance.md, "Decode floors").
 *
 * The data are epd-bench's (the same seed, generators and order: bench/epd_bench.c, make_inputs),
 * so the routing is the one the daemon's decode op sees: R ranks of T tokens, H = 7168, top-8
 * of 256 experts, fp8 rows with 56 fp32 scales, int64 topk. The host routes the op (rows in
 * docs/semantics.md §2.1's order: ascending source, then token) and uploads a plan, one destination
 * row per (token, rank). What each kernel does with it:
 *
 *   empty     an empty kernel of one warp, and one with the one-launch dispatch's shape (clusters
 *             of 8 blocks of 1024 threads, as many clusters as fit): the launch and the drain
 *             that every event-timed op pays;
 *   store     the dispatch's output bytes (x, scales, localised topk, weights of every received
 *             row) stored from registers, nothing loaded but the plan: the store floor;
 *   copy      the dispatch with its routing known: a warp per (token, slice) loads the slice once
 *             and stores it to every destination, then slice 0 moves the scales and writes the
 *             metadata (copy_token.cuh's shape, without epd's descriptors or workspace);
 *   memset    cudaMemsetAsync of the dispatch's output bytes, and of 1 GiB (the write ceiling);
 *   reduce    the combine with its routing known: a warp per (token, slice) adds the token's bf16
 *             rows from the received buffer in fp32 and stores the bf16 sum, loads plain or with
 *             the L2 evict-first hint (combine.cu's small-op loads);
 *   stream    the reduce's bytes with neither routing nor imbalance: every warp sums the same
 *             number of output chunks of 5 or 6 input chunks each, optionally after one
 *             dependent load (the combine's workspace round trip), with the combine's weights
 *             (a multiply before each addition), in 512-byte chunks at 32 warps per
 *             multiprocessor, or two chunks in flight: what the combine's traffic costs when
 *             every warp ends together;
 *   epd       epd's own combine kernel (epd_k_combine) on the same routing, its workspace filled
 *             by the host as the dispatch leaves it: the kernel without the daemon around it; with
 *             its descriptors in device memory, and without weights;
 *   and the empty kernel and the 2-slice reduce again with an unused parameter block as large as
 *   epd's combine launch carries (FP_PAD_BYTES).
 *
 * Each is timed three ways around the GPU's state before it: Fresh (docs/benchmarks.md, "Time": 256 MB written,
 * which leaves the L2 full of dirty lines, then the stream synchronised so the GPU is idle), clean
 * (256 MB read by a kernel: the L2 holds clean lines) and warm (nothing between launches). And two
 * ways around the launch: `event` records an event, launches, records another on an idle GPU, as
 * epd's kernel time is taken (so the host's launch call falls inside); `gated` queues the same
 * behind a one-warp kernel spinning on a pinned word that the host sets once everything is queued,
 * so the figure is the GPU's alone; `graph` captures the two events and the launch as one CUDA graph
 * and launches that, so they reach the GPU in one submission. Median and p99 over --reps launches after one untimed one.
 * The copy, reduce, stream and epd outputs are checked bitwise against the host once, so a floor is
 * never taken from a kernel that skipped its work.
 *
 * Usage: epd-floor-probe [--ranks R] [--tokens T] [--reps N] [--seed S] [--device D] [--idle-us U]
 *        [--json]
 * (--json: one JSON object per figure on stdout, the table on stderr, as epd-bench does.)
 * Exit 77 without a usable GPU, 1 on a failure or a mismatch, 2 on bad arguments.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <getopt.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "bf16.h"
#include "mps_state.h"
#include "routing.h"
#include "testdata.h"
#include "util.h"
}
#include "epd_kernels.h"
#include "layout.h"

/* The docs/benchmarks.md model shape ("Workloads") (bench/epd_bench.c keeps the same numbers). */
#define FP_HIDDEN 7168u
#define FP_TOPK 8u
#define FP_EXPERTS 256u
#define FP_SCALE_BLOCK 128u
#define FP_FLUSH_BYTES (256ull << 20)
#define FP_WRITE_CEILING_BYTES (1ull << 30)
#define FP_THREADS 256
#define FP_MAX_RANKS 32 /* a plan row is read by one lane per rank */
/* a parameter block larger than epd's combine launch carries for 8 ranks (combine_hot and
 * combine_inl in kernels/combine.cu), so that the padded launches bound its cost from above */
#define FP_PAD_BYTES 1280

#define PROBE_NAME "epd-floor-probe"
#include "probe_check.cuh"

/* ---- kernels ------------------------------------------------------------------------------ */

/* The GPU's global timer in ns: the same clock on every multiprocessor, so stamps of different
 * warps compare. */
static __device__ __forceinline__ uint64_t fp_globaltimer_ns(void)
{
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

/* A 16-byte read-only load with the L2 evict-first hint, as epd's combine issues for rows it
 * reads once (the probe measures that load, so it issues the same instructions). */
static __device__ __forceinline__ int4 fp_ldg_evict_first(const int4 *p)
{
        uint64_t policy;
        int4 v;
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        asm("ld.global.nc.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p), "l"(policy));
        return v;
}

__global__ void fp_empty(void)
{
}

/* The gate: one warp spins until the host stores `value` into the pinned word. The volatile
 * load goes to system memory each time; the host's store becomes visible to it eventually,
 * which is all a gate needs. */
__global__ void fp_gate(const volatile uint32_t *word, uint32_t value)
{
        while (*word != value)
                __nanosleep(200);
}

/* The clean flush: reads n int4 and stores one word only when an impossible sum appears, so the
 * loads cannot be dropped. */
__global__ void fp_read_flush(const int4 *__restrict__ p, uint64_t n, int *__restrict__ sink)
{
        const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
        int acc = 0;

        for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
                const int4 v = __ldg(p + i);
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        if (acc == 0x7fffffff)
                *sink = acc;
}

struct fp_copy_args {
        const uint8_t *x;      /* [N][row_bytes] every source's rows, flat token order */
        const uint8_t *scales; /* [N][scale_bytes] */
        const int64_t *topk;   /* [N][K] */
        const float *weights;  /* [N][K] */
        const int32_t *plan;   /* [N][R]: global received row of the token at rank d, or -1 */
        uint8_t *recv_x;       /* [rows][row_bytes], every destination's rows one after another */
        uint8_t *recv_scales;  /* [rows][scale_bytes] */
        int64_t *recv_topk;    /* [rows][K] */
        float *recv_weights;   /* [rows][K] */
        uint32_t tokens, ranks, local_experts, slices;
        uint32_t row_bytes, scale_bytes;
};

/* A synthetic 16-byte value for the store-only kernel: distinct per (token, vector) so that no
 * compression shortcuts it. */
static __device__ __forceinline__ int4 fp_synth(uint32_t g, uint32_t i)
{
        return make_int4((int)(g * 2654435761u ^ i), (int)(i * 40503u + g), (int)~g, (int)(i ^ 0x5bd1e995u));
}

/* One item (token g, slice) by a warp. LOAD false: the store floor (x and scales synthesised,
 * the metadata from the token index). MAXV: 16-byte vectors per lane that hold a whole slice
 * (the last slice takes the remainder). */
template <bool LOAD, int MAXV>
static __device__ __forceinline__ void fp_copy_item(const struct fp_copy_args &a, uint32_t g,
                                                    uint32_t slice, uint32_t lane)
{
        const int32_t r = lane < a.ranks ? a.plan[(uint64_t)g * a.ranks + lane] : -1;
        const uint32_t mask = __ballot_sync(0xffffffffu, r >= 0);
        const uint32_t nvec = a.row_bytes / 16, v0 = slice * (nvec / a.slices);
        const uint32_t svec = slice + 1 == a.slices ? nvec - v0 : nvec / a.slices;
        const int4 *src = (const int4 *)(a.x + (uint64_t)g * a.row_bytes) + v0;
        int4 v[MAXV];

#pragma unroll
        for (int u = 0; u < MAXV; u++) {
                const uint32_t i = u * 32 + lane;
                if (i < svec)
                        v[u] = LOAD ? __ldg(src + i) : fp_synth(g, v0 + i);
        }
        for (uint32_t m = mask; m != 0; m &= m - 1) {
                const int j = __ffs(m) - 1;
                const int32_t rr = __shfl_sync(0xffffffffu, r, j);
                int4 *dst = (int4 *)(a.recv_x + (uint64_t)rr * a.row_bytes) + v0;
#pragma unroll
                for (int u = 0; u < MAXV; u++) {
                        const uint32_t i = u * 32 + lane;
                        if (i < svec)
                                dst[i] = v[u];
                }
        }
        if (slice != 0)
                return;
        /* Scales: one 16-byte vector per lane (scale_bytes <= 512). */
        const uint32_t sv = a.scale_bytes / 16;
        int4 s = make_int4(0, 0, 0, 0);
        if (lane < sv)
                s = LOAD ? __ldg((const int4 *)(a.scales + (uint64_t)g * a.scale_bytes) + lane)
                         : fp_synth(g, nvec + lane);
        /* Metadata: lane k < K holds entry k. */
        int64_t e = -1;
        float w = 0.0f;
        if (lane < FP_TOPK) {
                e = LOAD ? a.topk[(uint64_t)g * FP_TOPK + lane]
                         : (int64_t)((g * 7u + lane * 31u) % (a.ranks * a.local_experts));
                w = LOAD ? a.weights[(uint64_t)g * FP_TOPK + lane] : 0.5f;
        }
        for (uint32_t m = mask; m != 0; m &= m - 1) {
                const int j = __ffs(m) - 1;
                const int32_t rr = __shfl_sync(0xffffffffu, r, j);
                if (lane < sv)
                        ((int4 *)(a.recv_scales + (uint64_t)rr * a.scale_bytes))[lane] = s;
                if (lane < FP_TOPK) {
                        const int on = e >= 0 && epd_route_expert_rank((int32_t)e, a.local_experts) == (uint32_t)j;
                        a.recv_topk[(uint64_t)rr * FP_TOPK + lane] = on ? e - (int64_t)j * a.local_experts : -1;
                        a.recv_weights[(uint64_t)rr * FP_TOPK + lane] = on ? w : 0.0f;
                }
        }
}

/* An item per warp, blocks of FP_THREADS. */
template <bool LOAD, int MAXV> __global__ void __launch_bounds__(FP_THREADS) fp_copy(struct fp_copy_args a)
{
        const uint32_t item = (blockIdx.x * FP_THREADS + threadIdx.x) / 32;

        if (item / a.slices < a.tokens)
                fp_copy_item<LOAD, MAXV>(a, item / a.slices, item % a.slices, threadIdx.x % 32);
}

/* The one-launch dispatch's copy shape: one block of 1024 threads per multiprocessor on a
 * given number of them, items dealt to the blocks in turn (item i to block i % blocks), so that
 * every block has about as many. */
template <int MAXV> __global__ void __launch_bounds__(1024, 1) fp_copy_wide(struct fp_copy_args a)
{
        const uint32_t items = a.tokens * a.slices;

        for (uint32_t item = threadIdx.x / 32 * gridDim.x + blockIdx.x; item < items;
             item += gridDim.x * 32)
                fp_copy_item<true, MAXV>(a, item / a.slices, item % a.slices, threadIdx.x % 32);
}

struct fp_reduce_args {
        const uint8_t *y;     /* [rows][row_bytes] bf16: every destination's received rows */
        const int32_t *plan;  /* as fp_copy_args.plan */
        uint8_t *out;         /* [N][row_bytes] bf16 */
        uint32_t tokens, ranks, slices, row_bytes;
};

/* Item = (token, slice) per warp; each step loads VEC 16-byte vectors of every contribution
 * (up to 8, ascending rank) before adding them in fp32, then stores the bf16 sum. EF: loads with
 * the L2 evict-first hint. */
/* The stream's weight of input c of a chunk (WEIGHTED streams only). */
static __host__ __device__ __forceinline__ float fp_stream_weight(uint32_t c)
{
        return 0.5f + 0.0625f * (float)c;
}

/* Vector u of the first n contributions of a step, summed in fp32 in ascending order (each first
 * multiplied by fp_stream_weight(c) when WEIGHTED) and rounded once to bf16: the reduce's and the
 * stream's one addition. */
template <int VEC, bool WEIGHTED>
static __device__ __forceinline__ int4 fp_sum(const int4 (&buf)[8][VEC], uint32_t n, int u)
{
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; q++)
                acc[q] = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++) {
                if ((uint32_t)c >= n)
                        break;
                const uint32_t wv[4] = { (uint32_t)buf[c][u].x, (uint32_t)buf[c][u].y,
                                         (uint32_t)buf[c][u].z, (uint32_t)buf[c][u].w };
#pragma unroll
                for (int q = 0; q < 4; q++) {
                        float lo = __uint_as_float(wv[q] << 16), hi = __uint_as_float(wv[q] & 0xffff0000u);
                        if (WEIGHTED) {
                                lo = __fmul_rn(lo, fp_stream_weight(c));
                                hi = __fmul_rn(hi, fp_stream_weight(c));
                        }
                        acc[2 * q] = __fadd_rn(acc[2 * q], lo);
                        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], hi);
                }
        }
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 4; q++)
                o[q] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * q])) |
                       (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * q + 1])) << 16;
        return make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]);
}

/* The traced reduce's stamps, per warp: entry, plan row back, end (global timer, ns) and its
 * contributions. */
#define FP_TRACE_WARPS 8192
static __device__ uint64_t fp_rtrace[FP_TRACE_WARPS * 4];

template <bool EF, int VEC, bool TR = false>
static __device__ __forceinline__ void fp_reduce_body(const struct fp_reduce_args &a)
{
        const uint32_t lane = threadIdx.x % 32;
        const uint32_t item = (blockIdx.x * FP_THREADS + threadIdx.x) / 32;
        const uint32_t g = item / a.slices, slice = item % a.slices;
        const uint64_t tr_entry = TR ? fp_globaltimer_ns() : 0;

        if (g >= a.tokens)
                return;
        const int32_t r = lane < a.ranks ? a.plan[(uint64_t)g * a.ranks + lane] : -1;
        const uint32_t mask = __ballot_sync(0xffffffffu, r >= 0);
        const uint32_t n = __popc(mask);
        const uint64_t tr_plan = TR ? fp_globaltimer_ns() : 0;
        const uint32_t nvec = a.row_bytes / 16, svec = nvec / a.slices;
        const uint32_t v0 = slice * svec, v1 = slice + 1 == a.slices ? nvec : v0 + svec;
        const int4 *rows[8];
        {
                uint32_t m = mask;
#pragma unroll
                for (int c = 0; c < 8; c++) {
                        const int j = m != 0 ? __ffs(m) - 1 : 0;
                        const int32_t rr = __shfl_sync(0xffffffffu, r, j);
                        rows[c] = (const int4 *)(a.y + (uint64_t)(rr < 0 ? 0 : rr) * a.row_bytes);
                        if (m != 0)
                                m &= m - 1;
                }
        }
        for (uint32_t base = v0; base < v1; base += 32 * VEC) {
                int4 buf[8][VEC];
#pragma unroll
                for (int c = 0; c < 8; c++)
#pragma unroll
                        for (int u = 0; u < VEC; u++) {
                                const uint32_t i = base + u * 32 + lane;
                                buf[c][u] = make_int4(0, 0, 0, 0);
                                if ((uint32_t)c < n && i < v1)
                                        buf[c][u] = EF ? fp_ldg_evict_first(rows[c] + i)
                                                       : __ldg(rows[c] + i);
                        }
#pragma unroll
                for (int u = 0; u < VEC; u++) {
                        const uint32_t i = base + u * 32 + lane;
                        const int4 o = fp_sum<VEC, false>(buf, n, u);
                        if (i < v1)
                                ((int4 *)(a.out + (uint64_t)g * a.row_bytes))[i] = o;
                }
        }
        if (TR && lane == 0 && item < FP_TRACE_WARPS) {
                fp_rtrace[item * 4 + 0] = tr_entry;
                fp_rtrace[item * 4 + 1] = tr_plan;
                fp_rtrace[item * 4 + 2] = fp_globaltimer_ns();
                fp_rtrace[item * 4 + 3] = n;
        }
}

__global__ void __launch_bounds__(FP_THREADS) fp_reduce_traced(struct fp_reduce_args a)
{
        fp_reduce_body<true, 2, true>(a);
}

template <bool EF, int VEC> __global__ void __launch_bounds__(FP_THREADS) fp_reduce(struct fp_reduce_args a)
{
        fp_reduce_body<EF, VEC>(a);
}

/* Parameters as large as epd's combine launch carries (its arguments, the workspace layout and
 * the inline rank descriptors), unused: what the parameter block costs a launch by itself. */
struct fp_pad {
        uint8_t b[FP_PAD_BYTES];
};

__global__ void fp_empty_pad(const __grid_constant__ struct fp_pad pad)
{
        (void)pad;
}

__global__ void __launch_bounds__(FP_THREADS) fp_reduce_pad(struct fp_reduce_args a,
                                                            const __grid_constant__ struct fp_pad pad)
{
        (void)pad;
        fp_reduce_body<true, 2>(a);
}

/* The reduce's bytes with no routing and no imbalance: the combine's reads and writes cut into
 * output chunks of one warp step (VEC 16-byte vectors per lane: VEC * 512 bytes), chunk j the sum
 * in fp32 of input chunks [j * in / out, (j + 1) * in / out) of y (5 or 6 of them for decode),
 * every warp the same number of chunks, dealt as chunk w + s * warps so that each step's loads
 * spread over y as the combine's do. Loads with the evict-first hint, all of a step's issued
 * before the first is added (combine.cu's small-op loop).
 *   WEIGHTED  each input multiplied by a weight first (__fmul_rn, then __fadd_rn), as the
 *             combine does: the weight of input c of any chunk is fp_stream_weight(c);
 *   PIPE      two steps in flight: the next chunk's loads are issued before this one's additions;
 *   first     each warp first loads its base from a table in device memory (all zeros), one
 *             dependent round trip as the combine's workspace entries are. */
struct fp_stream_args {
        const uint8_t *y;     /* in_chunks chunks */
        uint8_t *out;         /* out_chunks chunks */
        const int32_t *first; /* [warps], zeros; NULL: no first load */
        uint64_t in_chunks, out_chunks;
};

template <int VEC> struct fp_step {
        int4 v[8][VEC];
        uint32_t n;
};

template <int VEC>
static __device__ __forceinline__ void fp_stream_load(const struct fp_stream_args &a, int64_t base,
                                                      uint64_t j, uint32_t lane, fp_step<VEC> &st)
{
        const uint64_t k0 = j * a.in_chunks / a.out_chunks + base;
        st.n = (uint32_t)((j + 1) * a.in_chunks / a.out_chunks + base - k0);
#pragma unroll
        for (int c = 0; c < 8; c++)
#pragma unroll
                for (int u = 0; u < VEC; u++)
                        st.v[c][u] = (uint32_t)c < st.n
                                             ? fp_ldg_evict_first((const int4 *)(a.y + (k0 + c) * (512 * VEC)) +
                                                                      u * 32 + lane)
                                             : make_int4(0, 0, 0, 0);
}

template <int VEC, bool WEIGHTED>
static __device__ __forceinline__ void fp_stream_store(const struct fp_stream_args &a, uint64_t j,
                                                       uint32_t lane, const fp_step<VEC> &st)
{
#pragma unroll
        for (int u = 0; u < VEC; u++)
                ((int4 *)(a.out + j * (512 * VEC)))[u * 32 + lane] = fp_sum<VEC, WEIGHTED>(st.v, st.n, u);
}

template <int VEC, bool WEIGHTED, bool PIPE>
__global__ void __launch_bounds__(FP_THREADS, VEC == 2 || PIPE ? 2 : 3) fp_stream(struct fp_stream_args a)
{
        const uint32_t lane = threadIdx.x % 32;
        const uint64_t w = (blockIdx.x * (uint64_t)FP_THREADS + threadIdx.x) / 32;
        const uint64_t warps = (uint64_t)gridDim.x * FP_THREADS / 32;
        const int64_t base = a.first != NULL ? a.first[w] : 0;
        fp_step<VEC> s0, s1;

        if (!PIPE) {
                for (uint64_t j = w; j < a.out_chunks; j += warps) {
                        fp_stream_load<VEC>(a, base, j, lane, s0);
                        fp_stream_store<VEC, WEIGHTED>(a, j, lane, s0);
                }
                return;
        }
        uint64_t j = w;
        if (j >= a.out_chunks)
                return;
        fp_stream_load<VEC>(a, base, j, lane, s0);
        for (;;) {
                const uint64_t j1 = j + warps;
                if (j1 < a.out_chunks)
                        fp_stream_load<VEC>(a, base, j1, lane, s1);
                fp_stream_store<VEC, WEIGHTED>(a, j, lane, s0);
                if (j1 >= a.out_chunks)
                        break;
                j = j1 + warps;
                if (j < a.out_chunks)
                        fp_stream_load<VEC>(a, base, j, lane, s0);
                fp_stream_store<VEC, WEIGHTED>(a, j1, lane, s1);
                if (j >= a.out_chunks)
                        break;
        }
}

/* ---- host --------------------------------------------------------------------------------- */

struct fp_options {
        uint32_t ranks, tokens, reps, device;
        uint32_t idle_us; /* the GPU left idle this long after each preparation, before the launch */
        uint64_t seed;
        int json;
};

enum fp_mode { MODE_FRESH, MODE_CLEAN, MODE_WARM };
static const char *const mode_names[] = { "fresh", "clean", "warm" };

struct fp_state {
        struct fp_options o;
        cudaStream_t stream;
        cudaEvent_t e0, e1;
        uint8_t *flush;
        int *sink;
        volatile uint32_t *gate_host;
        uint32_t *gate_dev;
        uint32_t gate_value;
        double *samples;
        char device_name[256];
        char mps[16], mps_detail[320];
};

/* What one probe launches: a callback and its bytes. */
struct fp_probe {
        const char *name;
        const char *variant;
        uint64_t bytes_read, bytes_written;
        void (*launch)(const struct fp_probe *p, cudaStream_t s);
        const void *ctx;
};

static int cmp_double(const void *a, const void *b)
{
        const double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static void prepare(struct fp_state *st, enum fp_mode mode, uint32_t salt)
{
        if (mode == MODE_FRESH)
                CK(cudaMemsetAsync(st->flush, (int)(salt % 251) + 1, FP_FLUSH_BYTES, st->stream));
        else if (mode == MODE_CLEAN)
                fp_read_flush<<<1024, 256, 0, st->stream>>>((const int4 *)st->flush,
                                                            FP_FLUSH_BYTES / 16, st->sink);
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(st->stream));
        /* Through the daemon the GPU idles about 200 us between a client's flush and the op
         * (MPS off); here only for the launch, unless --idle-us asks for longer. */
        if (st->o.idle_us) {
                const uint64_t until = epd__now_ns() + (uint64_t)st->o.idle_us * 1000;
                while (epd__now_ns() < until)
                        ;
        }
}

enum fp_launch { LAUNCH_EVENT, LAUNCH_GATED, LAUNCH_GRAPH };
static const char *const launch_names[] = { "event", "gated", "graph" };

/* The events and the launch of p captured as one CUDA graph: t0, the kernel and t1 reach the GPU
 * in one submission, as a daemon that keeps an instantiated graph per op shape would send them. */
static cudaGraphExec_t capture(struct fp_state *st, const struct fp_probe *p)
{
        cudaGraph_t graph;
        cudaGraphExec_t exec;

        CK(cudaStreamBeginCapture(st->stream, cudaStreamCaptureModeThreadLocal));
        CK(cudaEventRecordWithFlags(st->e0, st->stream, cudaEventRecordExternal));
        p->launch(p, st->stream);
        CK(cudaEventRecordWithFlags(st->e1, st->stream, cudaEventRecordExternal));
        CK(cudaStreamEndCapture(st->stream, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        CK(cudaGraphDestroy(graph));
        return exec;
}

/* One timed launch of p after the mode's preparation; microseconds. */
static double time_once(struct fp_state *st, const struct fp_probe *p, enum fp_mode mode,
                        enum fp_launch launch, cudaGraphExec_t exec, uint32_t salt)
{
        const int gated = launch == LAUNCH_GATED;
        float ms = 0;

        prepare(st, mode, salt);
        if (launch == LAUNCH_GRAPH) {
                CK(cudaGraphLaunch(exec, st->stream));
                CK(cudaEventSynchronize(st->e1));
                CK(cudaEventElapsedTime(&ms, st->e0, st->e1));
                return ms * 1e3;
        }
        if (gated) {
                st->gate_value++;
                fp_gate<<<1, 32, 0, st->stream>>>(st->gate_dev, st->gate_value);
                CK(cudaGetLastError());
        }
        CK(cudaEventRecord(st->e0, st->stream));
        p->launch(p, st->stream);
        CK(cudaGetLastError());
        CK(cudaEventRecord(st->e1, st->stream));
        if (gated)
                __atomic_store_n(st->gate_host, st->gate_value, __ATOMIC_RELEASE);
        CK(cudaEventSynchronize(st->e1));
        CK(cudaEventElapsedTime(&ms, st->e0, st->e1));
        return ms * 1e3;
}


/* FP_TRACE_LAUNCHES Fresh-mode graph launches of p, each followed by the traced reduce's
 * per-warp stamps: where in the launch its warps entered, had their routing and ended, and the
 * ends by the token's contributions, each averaged over the launches. */
#define FP_TRACE_LAUNCHES 20
static void trace_report(struct fp_state *st, const struct fp_probe *p, uint32_t warps, FILE *tf)
{
        static uint64_t w[FP_TRACE_WARPS * 4];
        cudaGraphExec_t exec = capture(st, p);
        /* per launch: the means and maxima of entry, routing and end */
        double sum[3] = { 0, 0, 0 }, max[3] = { 0, 0, 0 }, us = 0;
        double nsum[33] = { 0 }, nmax[33] = { 0 };
        uint32_t nl[33] = { 0 }, nw[33] = { 0 }, launches = 0;

        if (warps > FP_TRACE_WARPS)
                warps = FP_TRACE_WARPS;
        time_once(st, p, MODE_FRESH, LAUNCH_GRAPH, exec, 0);
        for (uint32_t r = 0; r < FP_TRACE_LAUNCHES; r++) {
                const double t = time_once(st, p, MODE_FRESH, LAUNCH_GRAPH, exec, r + 1);
                CK(cudaMemcpyFromSymbol(w, fp_rtrace, (size_t)warps * 32));
                uint64_t t0 = UINT64_MAX;
                for (uint32_t i = 0; i < warps; i++)
                        t0 = w[i * 4] != 0 && w[i * 4] < t0 ? w[i * 4] : t0;
                double s[3] = { 0, 0, 0 }, m[3] = { 0, 0, 0 };
                double ns[33] = { 0 }, nm[33] = { 0 };
                uint32_t cnt = 0, nc[33] = { 0 };
                for (uint32_t i = 0; i < warps; i++) {
                        const uint64_t *e = &w[i * 4];
                        if (e[0] < t0 || e[1] < e[0] || e[2] < e[1] || e[2] - t0 > 1000000)
                                continue; /* not stamped by this launch */
                        for (int q = 0; q < 3; q++) {
                                s[q] += (double)(e[q] - t0);
                                m[q] = (double)(e[q] - t0) > m[q] ? (double)(e[q] - t0) : m[q];
                        }
                        const uint32_t n = (uint32_t)(e[3] % 33);
                        ns[n] += (double)(e[2] - t0);
                        nm[n] = (double)(e[2] - t0) > nm[n] ? (double)(e[2] - t0) : nm[n];
                        nc[n]++;
                        cnt++;
                }
                if (cnt == 0)
                        continue;
                for (int q = 0; q < 3; q++) {
                        sum[q] += s[q] / cnt;
                        max[q] += m[q];
                }
                us += t;
                for (uint32_t n = 0; n < 33; n++)
                        if (nc[n]) {
                                nsum[n] += ns[n] / nc[n];
                                nmax[n] += nm[n];
                                nl[n]++;
                                nw[n] = nc[n];
                        }
                launches++;
        }
        CK(cudaGraphExecDestroy(exec));
        if (launches == 0) {
                fprintf(tf, "  trace %s %s: no stamps\n", p->name, p->variant);
                return;
        }
        fprintf(tf, "  trace %s %s (%u fresh graph launches, %.2f us on average; ns from the first "
                    "warp's entry): entry mean %.0f max %.0f, routing back mean %.0f max %.0f, "
                    "end mean %.0f max %.0f\n",
                p->name, p->variant, launches, us / launches, sum[0] / launches, max[0] / launches,
                sum[1] / launches, max[1] / launches, sum[2] / launches, max[2] / launches);
        for (uint32_t n = 0; n < 33; n++)
                if (nl[n])
                        fprintf(tf, "  trace %s %s: %u contributions, %u warps, end mean %.0f max %.0f\n",
                                p->name, p->variant, n, nw[n], nsum[n] / nl[n], nmax[n] / nl[n]);
}

static void run_probe(struct fp_state *st, const struct fp_probe *p, json_t *rows, FILE *tf)
{
        cudaGraphExec_t exec = capture(st, p);

        for (int mode = MODE_FRESH; mode <= MODE_WARM; mode++)
                for (int launch = LAUNCH_EVENT; launch <= LAUNCH_GRAPH; launch++) {
                        const uint32_t n = st->o.reps;
                        const enum fp_launch l = (enum fp_launch)launch;
                        time_once(st, p, (enum fp_mode)mode, l, exec, 0); /* untimed */
                        for (uint32_t i = 0; i < n; i++)
                                st->samples[i] = time_once(st, p, (enum fp_mode)mode, l, exec, i + 1);
                        qsort(st->samples, n, sizeof(double), cmp_double);
                        const double p50 = st->samples[n / 2];
                        const double p99 = st->samples[(uint32_t)((n - 1) * 0.99)];
                        const double gbps = (double)(p->bytes_read + p->bytes_written) / (p50 * 1e3);
                        fprintf(tf, "  %-8s %-22s %-6s %-6s p50 %8.2f us  p99 %8.2f us  %7.1f GB/s (read %.2f MB, written %.2f MB)\n",
                               p->name, p->variant, mode_names[mode], launch_names[launch],
                               p50, p99, gbps, p->bytes_read / 1e6, p->bytes_written / 1e6);
                        json_t *o = json_object();
                        json_object_set_new(o, "bench", json_string("floor-probe"));
                        json_object_set_new(o, "kernel", json_string(p->name));
                        json_object_set_new(o, "variant", json_string(p->variant));
                        json_object_set_new(o, "mode", json_string(mode_names[mode]));
                        json_object_set_new(o, "launch", json_string(launch_names[launch]));
                        json_object_set_new(o, "p50_us", json_real(p50));
                        json_object_set_new(o, "p99_us", json_real(p99));
                        json_object_set_new(o, "min_us", json_real(st->samples[0]));
                        json_object_set_new(o, "bytes_read", json_integer((json_int_t)p->bytes_read));
                        json_object_set_new(o, "bytes_written", json_integer((json_int_t)p->bytes_written));
                        json_object_set_new(o, "gbps", json_real(gbps));
                        json_array_append_new(rows, o);
                }
        CK(cudaGraphExecDestroy(exec));
}

/* ---- the probes' launches ----------------------------------------------------------------- */

struct fp_empty_ctx {
        int cluster; /* 0: one warp */
        uint32_t blocks;
        int pad; /* one warp with an unused parameter block of FP_PAD_BYTES */
};

static void launch_empty(const struct fp_probe *p, cudaStream_t s)
{
        const struct fp_empty_ctx *c = (const struct fp_empty_ctx *)p->ctx;
        if (c->pad) {
                static struct fp_pad pad;
                fp_empty_pad<<<1, 32, 0, s>>>(pad);
                return;
        }
        if (!c->cluster) {
                fp_empty<<<1, 32, 0, s>>>();
                return;
        }
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = (unsigned)c->cluster;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.gridDim = dim3(c->blocks);
        cfg.blockDim = dim3(1024);
        cfg.stream = s;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, fp_empty));
}

struct fp_copy_ctx {
        struct fp_copy_args a;
        int load;
        unsigned wide_blocks; /* 0: an item per warp; else blocks of 1024 threads */
};

static void launch_copy(const struct fp_probe *p, cudaStream_t s)
{
        const struct fp_copy_ctx *c = (const struct fp_copy_ctx *)p->ctx;
        const uint64_t warps = (uint64_t)c->a.tokens * c->a.slices;
        const unsigned blocks = (unsigned)((warps * 32 + FP_THREADS - 1) / FP_THREADS);
        const uint32_t per_lane = (c->a.row_bytes / 16 / c->a.slices + c->a.slices + 31) / 32;

        if (c->wide_blocks)
                fp_copy_wide<8><<<c->wide_blocks, 1024, 0, s>>>(c->a);
        else if (!c->load)
                fp_copy<false, 8><<<blocks, FP_THREADS, 0, s>>>(c->a);
        else if (per_lane <= 4)
                fp_copy<true, 4><<<blocks, FP_THREADS, 0, s>>>(c->a);
        else if (per_lane <= 8)
                fp_copy<true, 8><<<blocks, FP_THREADS, 0, s>>>(c->a);
        else
                fp_copy<true, 16><<<blocks, FP_THREADS, 0, s>>>(c->a);
}

struct fp_memset_ctx {
        uint8_t *ptr;
        uint64_t bytes;
};

static void launch_memset(const struct fp_probe *p, cudaStream_t s)
{
        const struct fp_memset_ctx *c = (const struct fp_memset_ctx *)p->ctx;
        CK(cudaMemsetAsync(c->ptr, 0x5a, c->bytes, s));
}

struct fp_reduce_ctx {
        struct fp_reduce_args a;
        int evict_first; /* 2: evict-first, with the unused parameter block; 3: traced */
};

static void launch_reduce(const struct fp_probe *p, cudaStream_t s)
{
        const struct fp_reduce_ctx *c = (const struct fp_reduce_ctx *)p->ctx;
        const uint64_t warps = (uint64_t)c->a.tokens * c->a.slices;
        const unsigned blocks = (unsigned)((warps * 32 + FP_THREADS - 1) / FP_THREADS);

        if (c->evict_first == 3) {
                fp_reduce_traced<<<blocks, FP_THREADS, 0, s>>>(c->a);
        } else if (c->evict_first == 2) {
                static struct fp_pad pad;
                fp_reduce_pad<<<blocks, FP_THREADS, 0, s>>>(c->a, pad);
        } else if (c->evict_first)
                fp_reduce<true, 2><<<blocks, FP_THREADS, 0, s>>>(c->a);
        else
                fp_reduce<false, 2><<<blocks, FP_THREADS, 0, s>>>(c->a);
}

struct fp_stream_ctx {
        struct fp_stream_args a;
        unsigned blocks;
        int vec, weighted, pipe;
};

static const void *stream_kernel(const struct fp_stream_ctx *c)
{
        if (c->vec == 2)
                return c->weighted ? (const void *)fp_stream<2, true, false> : (const void *)fp_stream<2, false, false>;
        if (c->pipe)
                return c->weighted ? (const void *)fp_stream<1, true, true> : (const void *)fp_stream<1, false, true>;
        return c->weighted ? (const void *)fp_stream<1, true, false> : (const void *)fp_stream<1, false, false>;
}

static void launch_stream(const struct fp_probe *p, cudaStream_t s)
{
        const struct fp_stream_ctx *c = (const struct fp_stream_ctx *)p->ctx;
        void *args[] = { (void *)&c->a };
        CK(cudaLaunchKernel(stream_kernel(c), dim3(c->blocks), dim3(FP_THREADS), args, 0, s));
}

/* epd's own combine (kernels/combine.cu, epd_k_combine), fed the same routing through a
 * workspace the host fills as the dispatch leaves it, one rank descriptor per destination over
 * the same y, and the descriptors in the parameters as the daemon passes them. */
struct fp_epd_ctx {
        struct epd_k_combine_args a;
};

static void launch_epd(const struct fp_probe *p, cudaStream_t s)
{
        const struct fp_epd_ctx *c = (const struct fp_epd_ctx *)p->ctx;
        const int ret = epd_k_combine(&c->a, s);
        if (ret != 0) {
                fprintf(stderr, "epd-floor-probe: epd_k_combine: %d\n", ret);
                exit(1);
        }
}

/* ---- data --------------------------------------------------------------------------------- */

struct fp_host {
        uint32_t R, T, N, L, rows, scale_bytes;
        uint8_t *x, *scales;   /* [N][...] */
        int64_t *topk;
        float *weights;
        int32_t *plan;         /* [N][R] */
        uint32_t *base;        /* [R] */
        uint8_t *y;            /* [rows][2H] bf16 */
};

static void *xmalloc(size_t n)
{
        void *p = malloc(n ? n : 1);
        if (!p) {
                fprintf(stderr, "epd-floor-probe: out of host memory (%zu bytes)\n", n);
                exit(1);
        }
        return p;
}

/* epd-bench's inputs, rank by rank in the same generator order (bench/epd_bench.c,
 * make_inputs), then the host routing. */
static void make_host(const struct fp_options *o, struct fp_host *h)
{
        const uint32_t scale_cols = FP_HIDDEN / FP_SCALE_BLOCK;

        h->R = o->ranks;
        h->T = o->tokens;
        h->N = h->R * h->T;
        h->L = FP_EXPERTS / h->R;
        h->scale_bytes = scale_cols * 4;
        h->x = (uint8_t *)xmalloc((size_t)h->N * FP_HIDDEN);
        h->scales = (uint8_t *)xmalloc((size_t)h->N * h->scale_bytes);
        h->topk = (int64_t *)xmalloc((size_t)h->N * FP_TOPK * 8);
        h->weights = (float *)xmalloc((size_t)h->N * FP_TOPK * 4);
        for (uint32_t r = 0; r < h->R; r++) {
                const uint64_t g0 = (uint64_t)r * h->T;
                struct td_rng rng;
                td_rng_seed(&rng, td_mix_seed(o->seed, r));
                td_fill_bytes(&rng, h->x + g0 * FP_HIDDEN, h->T, FP_HIDDEN, 0);
                td_fill_f32(&rng, h->scales + g0 * h->scale_bytes, h->T, scale_cols, 0, 0.5f, 2.0f);
                struct td_routing_args ra = {};
                ra.world_size = h->R;
                ra.num_experts = FP_EXPERTS;
                ra.num_tokens = h->T;
                ra.num_topk = FP_TOPK;
                ra.mode = TD_ROUTING_UNIFORM;
                ra.dtype = EPD_DTYPE_INT64;
                td_gen_topk(&rng, &ra, h->topk + g0 * FP_TOPK);
                td_fill_f32(&rng, h->weights + g0 * FP_TOPK, h->T, FP_TOPK, 0, 0.0f, 1.0f);
        }
        /* Rows per destination in flat (source, token) order, then global rows. */
        uint32_t *count = (uint32_t *)calloc(h->R, sizeof(uint32_t));
        h->plan = (int32_t *)xmalloc((size_t)h->N * h->R * 4);
        h->base = (uint32_t *)xmalloc((size_t)h->R * 4);
        for (uint32_t g = 0; g < h->N; g++)
                for (uint32_t d = 0; d < h->R; d++) {
                        int to = 0;
                        for (uint32_t k = 0; k < FP_TOPK; k++) {
                                const int64_t e = h->topk[(uint64_t)g * FP_TOPK + k];
                                to |= e >= 0 && epd_route_expert_rank((int32_t)e, h->L) == d;
                        }
                        h->plan[(uint64_t)g * h->R + d] = to ? (int32_t)count[d]++ : -1;
                }
        h->rows = 0;
        for (uint32_t d = 0; d < h->R; d++) {
                h->base[d] = h->rows;
                h->rows += count[d];
        }
        for (uint32_t g = 0; g < h->N; g++)
                for (uint32_t d = 0; d < h->R; d++)
                        if (h->plan[(uint64_t)g * h->R + d] >= 0)
                                h->plan[(uint64_t)g * h->R + d] += (int32_t)h->base[d];
        free(count);
        h->y = (uint8_t *)xmalloc((size_t)h->rows * FP_HIDDEN * 2);
        struct td_rng rng;
        td_rng_seed(&rng, td_mix_seed(o->seed, 2000000));
        td_fill_bf16(&rng, h->y, h->rows, FP_HIDDEN, 0, 0.0);
}

template <typename V> static V *dev_copy(const V *host, size_t n)
{
        V *d = NULL;
        CK(cudaMalloc((void **)&d, n * sizeof(V)));
        if (host)
                CK(cudaMemcpy(d, host, n * sizeof(V), cudaMemcpyHostToDevice));
        return d;
}

/* The copy's outputs against the host: every received row's x, scales, topk and weights. */
static int check_copy(const struct fp_host *h, const struct fp_copy_args *a)
{
        const size_t xb = (size_t)h->rows * FP_HIDDEN, sb = (size_t)h->rows * h->scale_bytes;
        uint8_t *rx = (uint8_t *)xmalloc(xb), *rs = (uint8_t *)xmalloc(sb);
        int64_t *rt = (int64_t *)xmalloc((size_t)h->rows * FP_TOPK * 8);
        float *rw = (float *)xmalloc((size_t)h->rows * FP_TOPK * 4);
        int bad = 0;

        CK(cudaMemcpy(rx, a->recv_x, xb, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(rs, a->recv_scales, sb, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(rt, a->recv_topk, (size_t)h->rows * FP_TOPK * 8, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(rw, a->recv_weights, (size_t)h->rows * FP_TOPK * 4, cudaMemcpyDeviceToHost));
        for (uint32_t g = 0; g < h->N && !bad; g++)
                for (uint32_t d = 0; d < h->R && !bad; d++) {
                        const int32_t r = h->plan[(uint64_t)g * h->R + d];
                        if (r < 0)
                                continue;
                        bad |= memcmp(rx + (size_t)r * FP_HIDDEN, h->x + (size_t)g * FP_HIDDEN, FP_HIDDEN) != 0;
                        bad |= memcmp(rs + (size_t)r * h->scale_bytes, h->scales + (size_t)g * h->scale_bytes,
                                      h->scale_bytes) != 0;
                        for (uint32_t k = 0; k < FP_TOPK; k++) {
                                const int64_t e = h->topk[(uint64_t)g * FP_TOPK + k];
                                const int on = e >= 0 && epd_route_expert_rank((int32_t)e, h->L) == d;
                                bad |= rt[(size_t)r * FP_TOPK + k] != (on ? e - (int64_t)d * h->L : -1);
                                bad |= rw[(size_t)r * FP_TOPK + k] != (on ? h->weights[(uint64_t)g * FP_TOPK + k] : 0.0f);
                        }
                        if (bad)
                                fprintf(stderr, "epd-floor-probe: copy output wrong at token %u, rank %u\n", g, d);
                }
        free(rx);
        free(rs);
        free(rt);
        free(rw);
        return bad ? -1 : 0;
}

/* The reduce's output against the host's fp32 sums, ascending rank, one rounding to bf16. */
static int check_reduce(const struct fp_host *h, const uint8_t *out_dev)
{
        const size_t ob = (size_t)h->N * FP_HIDDEN * 2;
        uint16_t *out = (uint16_t *)xmalloc(ob);
        const uint16_t *y = (const uint16_t *)h->y;

        CK(cudaMemcpy(out, out_dev, ob, cudaMemcpyDeviceToHost));
        for (uint32_t g = 0; g < h->N; g++)
                for (uint32_t c = 0; c < FP_HIDDEN; c++) {
                        float acc = 0.0f;
                        for (uint32_t d = 0; d < h->R; d++) {
                                const int32_t r = h->plan[(uint64_t)g * h->R + d];
                                if (r >= 0)
                                        acc = acc + epd__bf16_to_float(y[(size_t)r * FP_HIDDEN + c]);
                        }
                        const uint16_t want = epd__float_to_bf16(acc);
                        const uint16_t got = out[(size_t)g * FP_HIDDEN + c];
                        if (want != got && !(acc != acc && (got & 0x7fc0) == 0x7fc0)) {
                                fprintf(stderr, "epd-floor-probe: reduce output wrong at token %u, column %u: 0x%04x, want 0x%04x\n",
                                        g, c, got, want);
                                free(out);
                                return -1;
                        }
                }
        free(out);
        return 0;
}

/* The stream's output against the host: chunk j, value v, the fp32 sum of value v of its input
 * chunks in ascending order (each first multiplied by its weight when weighted), rounded once. */
static int check_stream(const struct fp_host *h, const struct fp_stream_ctx *c)
{
        const struct fp_stream_args *a = &c->a;
        const uint64_t values = 256u * c->vec; /* bf16 values per chunk */
        const size_t ob = a->out_chunks * values * 2;
        uint16_t *out = (uint16_t *)xmalloc(ob);
        const uint16_t *y = (const uint16_t *)h->y;

        CK(cudaMemcpy(out, a->out, ob, cudaMemcpyDeviceToHost));
        for (uint64_t j = 0; j < a->out_chunks; j++) {
                const uint64_t k0 = j * a->in_chunks / a->out_chunks, k1 = (j + 1) * a->in_chunks / a->out_chunks;
                for (uint64_t v = 0; v < values; v++) {
                        float acc = 0.0f;
                        for (uint64_t k = k0; k < k1; k++) {
                                float x = epd__bf16_to_float(y[k * values + v]);
                                if (c->weighted)
                                        x = x * fp_stream_weight((uint32_t)(k - k0));
                                acc = acc + x;
                        }
                        const uint16_t want = epd__float_to_bf16(acc), got = out[j * values + v];
                        if (want != got && !(acc != acc && (got & 0x7fc0) == 0x7fc0)) {
                                fprintf(stderr, "epd-floor-probe: stream output wrong at chunk %llu, value %llu: 0x%04x, want 0x%04x\n",
                                        (unsigned long long)j, (unsigned long long)v, got, want);
                                free(out);
                                return -1;
                        }
                }
        }
        free(out);
        return 0;
}

/* A stream of the op's bytes in one wave: chunks of vec steps, as few steps per warp as the
 * kernel's resident warps allow, then as few warps as those steps need. */
static struct fp_stream_ctx stream_ctx(const uint8_t *y, uint8_t *out, uint64_t in_bytes,
                                       uint64_t out_bytes, int vec, int weighted, int pipe, int first,
                                       int sms, char *name, size_t name_len)
{
        struct fp_stream_ctx c = {};
        int per_sm = 0;
        c.a.y = y;
        c.a.out = out;
        c.a.in_chunks = in_bytes / (512u * vec);
        c.a.out_chunks = out_bytes / (512u * vec);
        c.vec = vec;
        c.weighted = weighted;
        c.pipe = pipe;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_kernel(&c), FP_THREADS, 0));
        const uint64_t slots = (uint64_t)per_sm * sms * (FP_THREADS / 32);
        const uint64_t steps = (c.a.out_chunks + slots - 1) / slots;
        const uint64_t warps = (c.a.out_chunks + steps - 1) / steps;
        c.blocks = (unsigned)((warps * 32 + FP_THREADS - 1) / FP_THREADS);
        if (first) {
                const size_t n = (size_t)c.blocks * FP_THREADS / 32;
                c.a.first = dev_copy<int32_t>(NULL, n);
                CK(cudaMemset((void *)c.a.first, 0, n * 4));
        }
        snprintf(name, name_len, "%s%s%s, %llu warps", weighted ? "weighted" : "balanced",
                 vec == 2 ? "" : " 512B", pipe ? " 2-deep" : "", (unsigned long long)warps);
        if (first)
                snprintf(name + strlen(name), name_len - strlen(name), ", load first");
        return c;
}

/* epd's combine set up over the probe's data: the workspace entries as the dispatch writes them
 * for a NON_EXPAND op (each token's expert, its row in the destination's y at the first position
 * that goes there and -1 at the others, its weight), the outputs and the combined weights. */
struct fp_epd_bufs {
        struct epd_k_combine_rank ranks[FP_MAX_RANKS];
        struct epd_k_local local[FP_MAX_RANKS + 1];
        uint8_t *out;
        float *ctw;
};

static struct fp_epd_ctx epd_ctx(const struct fp_host *h, const uint8_t *y_dev, struct fp_epd_bufs *b)
{
        struct fp_epd_ctx c = {};
        struct epd_ws_layout l;
        const uint32_t K = FP_TOPK;
        const uint64_t ws_bytes = epd_k_workspace_bytes(h->R, FP_EXPERTS, h->T, K);

        epd_ws_layout_init(&l, h->R, FP_EXPERTS, h->T, K);
        uint8_t *ws = (uint8_t *)xmalloc(ws_bytes);
        memset(ws, 0, ws_bytes);
        for (uint32_t s = 0; s < h->R; s++)
                for (uint32_t t = 0; t < h->T; t++) {
                        const uint64_t g = (uint64_t)s * h->T + t;
                        uint32_t seen = 0;
                        for (uint32_t k = 0; k < K; k++) {
                                const uint64_t ent = epd_ws_entry(&l, s, t, K, k);
                                const int32_t e = (int32_t)h->topk[g * K + k];
                                int32_t row = -1;
                                if (e >= 0) {
                                        const uint32_t d = epd_route_expert_rank(e, h->L);
                                        if (!(seen & 1u << d))
                                                row = h->plan[g * h->R + d] - (int32_t)h->base[d];
                                        seen |= 1u << d;
                                }
                                epd_ws_i32(ws, l.topk)[ent] = e;
                                epd_ws_i32(ws, l.row)[ent] = row;
                                epd_ws_f32(ws, l.weights)[ent] = h->weights[g * K + k];
                        }
                }
        b->out = dev_copy<uint8_t>(NULL, (size_t)h->N * FP_HIDDEN * 2);
        b->ctw = dev_copy<float>(NULL, (size_t)h->N * K);
        for (uint32_t d = 0; d < h->R; d++) {
                struct epd_k_combine_rank *r = &b->ranks[d];
                memset(r, 0, sizeof(*r));
                r->num_tokens = h->T;
                r->y.ptr = (uint8_t *)y_dev + (uint64_t)h->base[d] * FP_HIDDEN * 2;
                r->y.stride = FP_HIDDEN * 2;
                r->y_rows = (d + 1 < h->R ? h->base[d + 1] : h->rows) - h->base[d];
                r->combined.ptr = b->out + (uint64_t)d * h->T * FP_HIDDEN * 2;
                r->combined.stride = FP_HIDDEN * 2;
                r->combined_topk_weights.ptr = (uint8_t *)(b->ctw + (uint64_t)d * h->T * K);
                r->combined_topk_weights.stride = K * 4;
                b->local[d].rank = d;
                b->local[d].token_offset = d * h->T;
        }
        b->local[h->R].rank = 0;
        b->local[h->R].token_offset = h->N;
        c.a.world_size = h->R;
        c.a.num_experts = FP_EXPERTS;
        c.a.max_tokens = h->T;
        c.a.max_topk = K;
        c.a.num_topk = K;
        c.a.layout = EPD_LAYOUT_NON_EXPAND;
        c.a.hidden = FP_HIDDEN;
        c.a.apply_weights = 0;
        c.a.has_weights = 1;
        c.a.workspace = dev_copy(ws, ws_bytes);
        c.a.ranks = dev_copy(b->ranks, h->R);
        c.a.local = dev_copy(b->local, h->R + 1);
        c.a.ranks_host = b->ranks;
        c.a.local_host = b->local;
        c.a.num_local = h->R;
        c.a.local_tokens = h->N;
        free(ws);
        return c;
}

/* epd's combine against the host: each token's rows in ascending top-k position (docs/semantics.md
 * §3), the fp32 sum rounded once, and the combined weights. */
static int check_epd(const struct fp_host *h, const struct fp_epd_bufs *b, int has_weights)
{
        const uint32_t K = FP_TOPK;
        const size_t ob = (size_t)h->N * FP_HIDDEN * 2;
        uint16_t *out = (uint16_t *)xmalloc(ob);
        float *ctw = (float *)xmalloc((size_t)h->N * K * 4);
        const uint16_t *y = (const uint16_t *)h->y;
        int bad = 0;

        CK(cudaMemcpy(out, b->out, ob, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ctw, b->ctw, (size_t)h->N * K * 4, cudaMemcpyDeviceToHost));
        for (uint32_t g = 0; g < h->N && !bad; g++) {
                int32_t rows[FP_TOPK];
                uint32_t n = 0, seen = 0;
                for (uint32_t k = 0; k < K; k++) {
                        const int32_t e = (int32_t)h->topk[(uint64_t)g * K + k];
                        if (has_weights && ctw[(uint64_t)g * K + k] != (e >= 0 ? h->weights[(uint64_t)g * K + k] : 0.0f)) {
                                fprintf(stderr, "epd-floor-probe: epd combine's weights wrong at token %u\n", g);
                                bad = 1;
                        }
                        if (e < 0)
                                continue;
                        const uint32_t d = epd_route_expert_rank(e, h->L);
                        if (!(seen & 1u << d))
                                rows[n++] = h->plan[(uint64_t)g * h->R + d];
                        seen |= 1u << d;
                }
                for (uint32_t c = 0; c < FP_HIDDEN && !bad; c++) {
                        float acc = 0.0f;
                        for (uint32_t i = 0; i < n; i++)
                                acc = acc + epd__bf16_to_float(y[(size_t)rows[i] * FP_HIDDEN + c]);
                        const uint16_t want = epd__float_to_bf16(acc), got = out[(size_t)g * FP_HIDDEN + c];
                        if (want != got && !(acc != acc && (got & 0x7fc0) == 0x7fc0)) {
                                fprintf(stderr, "epd-floor-probe: epd combine wrong at token %u, column %u: 0x%04x, want 0x%04x\n",
                                        g, c, got, want);
                                bad = 1;
                        }
                }
        }
        free(out);
        free(ctw);
        return bad ? -1 : 0;
}

static void usage(FILE *f)
{
        fprintf(f, "Usage: epd-floor-probe [--ranks R] [--tokens T] [--reps N] [--seed S] [--device D] [--idle-us U] [--json]\n"
                   "  Times the decode workload's bytes with the routing known in advance (empty,\n"
                   "  store, copy, memset, reduce kernels), in Fresh, clean and warm L2 states, with\n"
                   "  the launch inside the events, gated and as a graph. Defaults: 8 ranks, 128 tokens (decode),\n"
                   "  200 repetitions, seed 1 (epd-bench's), device 0. --idle-us: the GPU left idle U us after\n"
                   "  each flush before the launch (default 0).\n");
}

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
        char *end = NULL;
        unsigned long v = strtoul(s, &end, 0);
        if (!*s || *end || v < lo || v > hi)
                return -1;
        *out = (uint32_t)v;
        return 0;
}

int main(int argc, char **argv)
{
        static const struct option longopts[] = {
                { "ranks", required_argument, NULL, 'r' }, { "tokens", required_argument, NULL, 't' },
                { "reps", required_argument, NULL, 'n' },  { "seed", required_argument, NULL, 's' },
                { "device", required_argument, NULL, 'd' }, { "json", no_argument, NULL, 'j' },
                { "idle-us", required_argument, NULL, 'i' },
                { "help", no_argument, NULL, 'h' },        { NULL, 0, NULL, 0 },
        };
        struct fp_state st = {};
        struct fp_options *o = &st.o;
        int c, ndev = 0;

        o->ranks = 8;
        o->tokens = 128;
        o->reps = 200;
        o->seed = 1;
        while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
                int bad = 0;
                switch (c) {
                case 'r':
                        bad = parse_u32(optarg, 1, FP_MAX_RANKS, &o->ranks) < 0 ||
                              FP_EXPERTS % o->ranks != 0;
                        break;
                case 't':
                        bad = parse_u32(optarg, 1, 65536, &o->tokens) < 0;
                        break;
                case 'n':
                        bad = parse_u32(optarg, 1, 100000, &o->reps) < 0;
                        break;
                case 'd':
                        bad = parse_u32(optarg, 0, 1024, &o->device) < 0;
                        break;
                case 's': {
                        char *end = NULL;
                        o->seed = strtoull(optarg, &end, 0);
                        bad = !*optarg || *end;
                        break;
                }
                case 'i':
                        bad = parse_u32(optarg, 0, 1000000, &o->idle_us) < 0;
                        break;
                case 'j':
                        o->json = 1;
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
                if (bad) {
                        size_t k = 0;
                        while (longopts[k].val != c)
                                k++;
                        fprintf(stderr, "epd-floor-probe: bad value for --%s: '%s' (ranks divide %u and are at most %u; idle at most 1000000 us)\n",
                                longopts[k].name, optarg, FP_EXPERTS, FP_MAX_RANKS);
                        return 2;
                }
        }
        if (optind != argc) {
                usage(stderr);
                return 2;
        }
        epd_bench_mps_state(st.mps, sizeof(st.mps), st.mps_detail, sizeof(st.mps_detail));
        if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
                printf("SKIP: no CUDA device\n");
                return 77;
        }
        if ((int)o->device >= ndev) {
                fprintf(stderr, "epd-floor-probe: --device %u, but %d device(s)\n", o->device, ndev);
                return 2;
        }
        CK(cudaSetDevice((int)o->device));
        cudaDeviceProp prop;
        CK(cudaGetDeviceProperties(&prop, (int)o->device));
        snprintf(st.device_name, sizeof(st.device_name), "%s", prop.name);

        struct fp_host h = {};
        make_host(o, &h);
        CK(cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking));
        CK(cudaEventCreate(&st.e0));
        CK(cudaEventCreate(&st.e1));
        CK(cudaMalloc((void **)&st.flush, FP_FLUSH_BYTES));
        CK(cudaMemset(st.flush, 1, FP_FLUSH_BYTES));
        CK(cudaMalloc((void **)&st.sink, sizeof(int)));
        CK(cudaHostAlloc((void **)&st.gate_host, 4096, cudaHostAllocMapped));
        *st.gate_host = 0;
        CK(cudaHostGetDevicePointer((void **)&st.gate_dev, (void *)st.gate_host, 0));
        st.samples = (double *)xmalloc(sizeof(double) * o->reps);

        /* Device data. */
        struct fp_copy_args ca = {};
        ca.x = dev_copy(h.x, (size_t)h.N * FP_HIDDEN);
        ca.scales = dev_copy(h.scales, (size_t)h.N * h.scale_bytes);
        ca.topk = dev_copy(h.topk, (size_t)h.N * FP_TOPK);
        ca.weights = dev_copy(h.weights, (size_t)h.N * FP_TOPK);
        ca.plan = dev_copy(h.plan, (size_t)h.N * h.R);
        ca.recv_x = dev_copy<uint8_t>(NULL, (size_t)h.rows * FP_HIDDEN);
        ca.recv_scales = dev_copy<uint8_t>(NULL, (size_t)h.rows * h.scale_bytes);
        ca.recv_topk = dev_copy<int64_t>(NULL, (size_t)h.rows * FP_TOPK);
        ca.recv_weights = dev_copy<float>(NULL, (size_t)h.rows * FP_TOPK);
        ca.tokens = h.N;
        ca.ranks = h.R;
        ca.local_experts = h.L;
        ca.row_bytes = FP_HIDDEN;
        ca.scale_bytes = h.scale_bytes;
        const uint64_t token_bytes = FP_HIDDEN + h.scale_bytes + FP_TOPK * 8 + FP_TOPK * 4;
        const uint64_t disp_read = (uint64_t)h.N * token_bytes + (uint64_t)h.N * h.R * 4;
        const uint64_t disp_written = (uint64_t)h.rows * token_bytes;

        struct fp_reduce_args ra = {};
        ra.y = dev_copy(h.y, (size_t)h.rows * FP_HIDDEN * 2);
        ra.plan = ca.plan;
        ra.out = dev_copy<uint8_t>(NULL, (size_t)h.N * FP_HIDDEN * 2);
        ra.tokens = h.N;
        ra.ranks = h.R;
        ra.row_bytes = FP_HIDDEN * 2;
        const uint64_t comb_read = (uint64_t)h.rows * FP_HIDDEN * 2 + (uint64_t)h.N * h.R * 4;
        const uint64_t comb_written = (uint64_t)h.N * FP_HIDDEN * 2;

        uint8_t *ceiling = NULL;
        CK(cudaMalloc((void **)&ceiling, FP_WRITE_CEILING_BYTES));

        /* The dispatch_small shape: clusters of 8 blocks of 1024 threads, as many as fit. */
        int clusters = 0;
        {
                cudaLaunchConfig_t cfg = {};
                cudaLaunchAttribute attr[1];
                attr[0].id = cudaLaunchAttributeClusterDimension;
                attr[0].val.clusterDim.x = 8;
                attr[0].val.clusterDim.y = 1;
                attr[0].val.clusterDim.z = 1;
                cfg.gridDim = dim3(8 * prop.multiProcessorCount);
                cfg.blockDim = dim3(1024);
                cfg.attrs = attr;
                cfg.numAttrs = 1;
                if (cudaOccupancyMaxActiveClusters(&clusters, fp_empty, &cfg) != cudaSuccess)
                        clusters = 0;
                cudaGetLastError();
        }

        FILE *tf = o->json ? stderr : stdout; /* the table; JSON lines go to stdout */
        fprintf(tf, "epd-floor-probe on %s (%d SMs, %.0f MiB L2), git %s, MPS %s (%s): %u ranks x %u "
               "tokens, %u received rows, median and p99 of %u launches, GPU idle %u us before each\n",
               st.device_name, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0, epd_git_rev,
               st.mps, st.mps_detail, h.R, h.T, h.rows, o->reps, o->idle_us);

        struct fp_empty_ctx e1 = { 0, 1, 0 }, e8 = { 8, (uint32_t)clusters * 8, 0 }, ep = { 0, 1, 1 };
        struct fp_copy_ctx cs = { ca, 0, 0 }, c1 = { ca, 1, 0 }, c2 = { ca, 1, 0 },
                           c3 = { ca, 1, 0 }, c4 = { ca, 1, 0 }, w120 = { ca, 1, 120 },
                           w132 = { ca, 1, (unsigned)prop.multiProcessorCount };
        cs.a.slices = 2;
        c1.a.slices = 1;
        c2.a.slices = 2;
        c3.a.slices = 3;
        c4.a.slices = 4;
        w120.a.slices = 3;
        w132.a.slices = 3;
        char w132name[64];
        snprintf(w132name, sizeof(w132name), "3 slices, %ux1024", w132.wide_blocks);
        struct fp_memset_ctx mo = { ceiling, disp_written }, mc = { ceiling, FP_WRITE_CEILING_BYTES };
        struct fp_reduce_ctx r7 = { ra, 1 }, r7p = { ra, 0 }, r4 = { ra, 1 }, r14 = { ra, 1 },
                             r2 = { ra, 1 };
        r2.a.slices = 2;
        struct fp_reduce_ctx r2p = r2, r2t = r2;
        r2p.evict_first = 2;
        r2t.evict_first = 3;
        r7.a.slices = 7;
        r7p.a.slices = 7;
        r4.a.slices = 4;
        r14.a.slices = 14;
        /* The streams: the combine's bytes, balanced, with no routing (stream_ctx). */
        const uint64_t stream_read = (uint64_t)h.rows * FP_HIDDEN * 2, stream_written = (uint64_t)h.N * FP_HIDDEN * 2;
        const int sms = prop.multiProcessorCount;
        char sn[6][96];
        struct fp_epd_bufs eb;
        const struct fp_epd_ctx ec = epd_ctx(&h, ra.y, &eb);
        struct fp_epd_ctx ecd = ec; /* the descriptors from device memory instead */
        ecd.a.ranks_host = NULL;
        ecd.a.local_host = NULL;
        struct fp_epd_ctx ecw = ec; /* no weights: no third entry load, no combined weights */
        ecw.a.has_weights = 0;
        fprintf(stderr, "epd-floor-probe: the pad %d bytes\n", FP_PAD_BYTES);
        struct fp_stream_ctx st_ctx[6] = {
                stream_ctx(ra.y, ra.out, stream_read, stream_written, 2, 0, 0, 0, sms, sn[0], sizeof(sn[0])),
                stream_ctx(ra.y, ra.out, stream_read, stream_written, 2, 0, 0, 1, sms, sn[1], sizeof(sn[1])),
                stream_ctx(ra.y, ra.out, stream_read, stream_written, 2, 1, 0, 1, sms, sn[2], sizeof(sn[2])),
                stream_ctx(ra.y, ra.out, stream_read, stream_written, 1, 1, 0, 1, sms, sn[3], sizeof(sn[3])),
                stream_ctx(ra.y, ra.out, stream_read, stream_written, 1, 1, 1, 1, sms, sn[4], sizeof(sn[4])),
                stream_ctx(ra.y, ra.out, stream_read, stream_written, 1, 0, 1, 1, sms, sn[5], sizeof(sn[5])),
        };
        char e8name[64];
        snprintf(e8name, sizeof(e8name), "%d clusters of 8x1024", clusters);
        const struct fp_probe probes[] = {
                { "empty", "1 warp", 0, 0, launch_empty, &e1 },
                { "empty", "1 warp, 1280 B params", 0, 0, launch_empty, &ep },
                { "empty", e8name, 0, 0, launch_empty, &e8 },
                { "store", "2 slices", 0, disp_written, launch_copy, &cs },
                { "copy", "1 slice", disp_read, disp_written, launch_copy, &c1 },
                { "copy", "2 slices", disp_read, disp_written, launch_copy, &c2 },
                { "copy", "3 slices", disp_read, disp_written, launch_copy, &c3 },
                { "copy", "4 slices", disp_read, disp_written, launch_copy, &c4 },
                { "copy", "3 slices, 120x1024", disp_read, disp_written, launch_copy, &w120 },
                { "copy", w132name, disp_read, disp_written, launch_copy, &w132 },
                { "memset", "dispatch output", 0, disp_written, launch_memset, &mo },
                { "memset", "1 GiB", 0, FP_WRITE_CEILING_BYTES, launch_memset, &mc },
                { "reduce", "7 slices, evict-first", comb_read, comb_written, launch_reduce, &r7 },
                { "reduce", "7 slices, plain", comb_read, comb_written, launch_reduce, &r7p },
                { "reduce", "4 slices, evict-first", comb_read, comb_written, launch_reduce, &r4 },
                { "reduce", "2 slices, evict-first", comb_read, comb_written, launch_reduce, &r2 },
                { "reduce", "2 slices, 1280 B params", comb_read, comb_written, launch_reduce, &r2p },
                { "reduce", "14 slices, evict-first", comb_read, comb_written, launch_reduce, &r14 },
                { "reduce", "2 slices, traced", comb_read, comb_written, launch_reduce, &r2t },
                { "epd", "combine", comb_read, comb_written, launch_epd, &ec },
                { "epd", "combine, descs in memory", comb_read, comb_written, launch_epd, &ecd },
                { "epd", "combine, no weights", comb_read, comb_written, launch_epd, &ecw },
                { "stream", sn[0], stream_read, stream_written, launch_stream, &st_ctx[0] },
                { "stream", sn[1], stream_read, stream_written, launch_stream, &st_ctx[1] },
                { "stream", sn[2], stream_read, stream_written, launch_stream, &st_ctx[2] },
                { "stream", sn[3], stream_read, stream_written, launch_stream, &st_ctx[3] },
                { "stream", sn[4], stream_read, stream_written, launch_stream, &st_ctx[4] },
                { "stream", sn[5], stream_read, stream_written, launch_stream, &st_ctx[5] },
        };
        const size_t nprobes = sizeof(probes) / sizeof(probes[0]);

        /* Correctness first: a floor from a kernel that skipped work would be worthless. */
        for (size_t i = 0; i < nprobes; i++) {
                if (probes[i].launch == launch_epd) {
                        CK(cudaMemset(eb.out, 0xee, (size_t)h.N * FP_HIDDEN * 2));
                        CK(cudaMemset(eb.ctw, 0xee, (size_t)h.N * FP_TOPK * 4));
                        probes[i].launch(&probes[i], st.stream);
                        CK(cudaGetLastError());
                        CK(cudaStreamSynchronize(st.stream));
                        if (check_epd(&h, &eb, ((const struct fp_epd_ctx *)probes[i].ctx)->a.has_weights)) {
                                fprintf(stderr, "epd-floor-probe: epd combine is wrong; no figures\n");
                                return 1;
                        }
                        continue;
                }
                if (probes[i].launch == launch_stream) {
                        CK(cudaMemset(ra.out, 0xee, stream_written));
                        probes[i].launch(&probes[i], st.stream);
                        CK(cudaGetLastError());
                        CK(cudaStreamSynchronize(st.stream));
                        if (check_stream(&h, (const struct fp_stream_ctx *)probes[i].ctx)) {
                                fprintf(stderr, "epd-floor-probe: stream (%s) is wrong; no figures\n",
                                        probes[i].variant);
                                return 1;
                        }
                        continue;
                }
                if (strcmp(probes[i].name, "copy") && strcmp(probes[i].name, "reduce"))
                        continue;
                CK(cudaMemset(probes[i].name[0] == 'c' ? ca.recv_x : ra.out, 0xee,
                              probes[i].name[0] == 'c' ? (size_t)h.rows * FP_HIDDEN : (size_t)h.N * FP_HIDDEN * 2));
                probes[i].launch(&probes[i], st.stream);
                CK(cudaGetLastError());
                CK(cudaStreamSynchronize(st.stream));
                if (probes[i].name[0] == 'c' ? check_copy(&h, &ca) : check_reduce(&h, ra.out)) {
                        fprintf(stderr, "epd-floor-probe: %s (%s) is wrong; no figures\n",
                                probes[i].name, probes[i].variant);
                        return 1;
                }
        }
        fprintf(tf, "  copy, reduce, stream and epd combine outputs match the host bitwise\n");

        json_t *rows = json_array();
        for (size_t i = 0; i < nprobes; i++) {
                if (probes[i].launch == launch_empty && ((const struct fp_empty_ctx *)probes[i].ctx)->cluster &&
                    clusters == 0) {
                        fprintf(tf, "  empty: no cluster launch fits this device; skipped\n");
                        continue;
                }
                run_probe(&st, &probes[i], rows, tf);
        }
        for (size_t i = 0; i < nprobes; i++) {
                if (probes[i].launch == launch_reduce &&
                    ((const struct fp_reduce_ctx *)probes[i].ctx)->evict_first == 3)
                        trace_report(&st, &probes[i], h.N * 2, tf);
        }
        if (o->json) {
                size_t i;
                json_t *row;
                json_array_foreach(rows, i, row) {
                        json_object_set_new(row, "device", json_string(st.device_name));
                        json_object_set_new(row, "mps", json_string(st.mps));
                        json_object_set_new(row, "mps_detail", json_string(st.mps_detail));
                        json_object_set_new(row, "ranks", json_integer(h.R));
                        json_object_set_new(row, "tokens", json_integer(h.T));
                        json_object_set_new(row, "rows", json_integer(h.rows));
                        json_object_set_new(row, "reps", json_integer(o->reps));
                        json_object_set_new(row, "seed", json_integer((json_int_t)o->seed));
                        json_object_set_new(row, "idle_us", json_integer(o->idle_us));
                        json_object_set_new(row, "git_rev", json_string(epd_git_rev));
                        char *s = json_dumps(row, JSON_COMPACT);
                        if (s)
                                printf("%s\n", s);
                        free(s);
                }
        }
        json_decref(rows);
        return 0;
}
