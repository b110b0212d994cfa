/* combine.cu - combine: gather every token's rows back and reduce them (docs/semantics.md §3).
 *
 * One kernel per device covers every source (the combine's receiver) on that device. A warp owns
 * one token: lane k reads top-k position k's expert, row and weight from the handle's workspace,
 * a ballot gives the contributing positions, and the warp walks the hidden dimension, 16 bf16
 * values per lane per step, adding the contributions in ascending k with one fp32 rounding per
 * operation. The loads of up to 8 contributions of a step are issued before the first is added,
 * and each contribution's loads of the next step right after its additions (combine_vec).
 *
 * Floating point: __fmul_rn and __fadd_rn are never contracted into an FMA, and the library is
 * built with --fmad=false -ftz=false as well; bf16 -> fp32 is a shift; fp32 -> bf16 is
 * __float2bfloat16_rn (cvt.rn.bf16.f32: round to nearest even, subnormals kept, and a NaN input
 * gives the canonical 0x7FFF), and NaN is mapped to 0x7FFF explicitly as well, so the bits match
 * common/bf16.h's epd__float_to_bf16 whatever the conversion does with NaN payloads.
 */
#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>

#include "internal.cuh"

#define COMBINE_THREADS 256
#define COMBINE_MIN_BLOCKS 1
#define COMBINE_VEC 2 /* 16-byte vectors per lane per step: 16 bf16 values */
/* Slices of hidden values (small ops) are multiples of one step of a warp on the 16-byte path,
 * so every slice starts on a step boundary. */
#define COMBINE_SLICE_UNIT (8 * 32 * COMBINE_VEC)

static __device__ __forceinline__ float bf16_lo(uint32_t word)
{
        return __uint_as_float(word << 16);
}

static __device__ __forceinline__ float bf16_hi(uint32_t word)
{
        return __uint_as_float(word & 0xffff0000u);
}

static __device__ __forceinline__ uint32_t to_bf16(float v)
{
        if (v != v)
                return 0x7fffu;
        return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

static __device__ __forceinline__ void add_word(float *acc, uint32_t word, int weighted, float w)
{
        float lo = bf16_lo(word), hi = bf16_hi(word);
        if (weighted) {
                lo = __fmul_rn(lo, w);
                hi = __fmul_rn(hi, w);
        }
        acc[0] = __fadd_rn(acc[0], lo);
        acc[1] = __fadd_rn(acc[1], hi);
}

static __device__ __forceinline__ void add_vec(float *acc, int4 v, int weighted, float w)
{
        add_word(acc + 0, (uint32_t)v.x, weighted, w);
        add_word(acc + 2, (uint32_t)v.y, weighted, w);
        add_word(acc + 4, (uint32_t)v.z, weighted, w);
        add_word(acc + 6, (uint32_t)v.w, weighted, w);
}

/* A 16-byte load of a contribution or bias row; STREAM: with the L2 evict-first hint. */
template <bool STREAM> static __device__ __forceinline__ int4 comb_ld(const int4 *p)
{
        return STREAM ? epd__k_ldg_evict_first(p) : epd__k_ldg(p);
}

/* comb_ld when on != 0, zeros otherwise, as one predicated load. */
template <bool STREAM> static __device__ __forceinline__ int4 comb_ld_if(uint32_t on, const int4 *p)
{
        return STREAM ? epd__k_ldg_evict_first_if(on, p) : epd__k_ldg_if(on, p);
}

/* Items per multiprocessor that a small op is cut for (epd__k_slicing), against 16 resident
 * warps (121 registers). Below 16, a decode op (1024 tokens on 132 multiprocessors) is cut in
 * two slices of 7 steps, one item per warp; more items per multiprocessor (24, 48, 96) cut it
 * finer, so that most warps do two items, and each extra item costs its steps and a second
 * routing preamble: slower in every L2 state (docs/performance.md, "Design choices and their
 * measured effect"). */
#define COMBINE_SLICE_WARPS 14

#define COMBINE_AHEAD 8 /* contributions whose loads are issued together */

/* A token's contributions, in ascending top-k position: rows[c] is the c-th contribution's row
 * and weights[c] its weight, c < n. They sit in the warp's slots of shared memory
 * (combine_slots), written once per item, so that a step reads its row addresses with
 * broadcast loads at fixed offsets that do not wait for each other. The AHEAD slots after the
 * last are never dereferenced: a step reads them and predicates their loads off. */
struct combine_slots {
        const uint8_t *rows[32 + COMBINE_AHEAD];
        float weights[32 + COMBINE_AHEAD];
};

/* Contribution c's loads of the step at vector base (zeros where c >= n or past nvec). */
template <bool STREAM>
static __device__ __forceinline__ void combine_load(int4 *buf, const struct combine_slots *sl,
                                                    uint32_t c, uint32_t n, uint32_t base,
                                                    uint32_t nvec, uint32_t lane)
{
        const int4 *p = (const int4 *)sl->rows[c];
#pragma unroll
        for (int u = 0; u < COMBINE_VEC; u++) {
                const uint32_t i = base + u * 32 + lane;
                buf[u] = comb_ld_if<STREAM>(c < n && i < nvec, p + i);
        }
}

/* Contribution c's additions to the step's sums (none when c >= n). */
static __device__ __forceinline__ void combine_add(float *acc, const int4 *buf,
                                                   const struct combine_slots *sl, uint32_t c,
                                                   uint32_t n, int weighted)
{
        if (c < n) {
                const float w = sl->weights[c];
#pragma unroll
                for (int u = 0; u < COMBINE_VEC; u++)
                        add_vec(acc + 8 * u, buf[u], weighted, w);
        }
}

/* A step's epilogue: the biases added to the sums, which are then rounded to bf16 and stored. */
template <bool STREAM>
static __device__ __forceinline__ void combine_store(float *acc, const uint8_t *bias0,
                                                     const uint8_t *bias1, uint8_t *out,
                                                     uint32_t base, uint32_t nvec, uint32_t lane)
{
#pragma unroll
        for (int u = 0; u < COMBINE_VEC; u++) {
                uint32_t i = base + u * 32 + lane;
                if (i >= nvec)
                        continue;
                float *a = acc + 8 * u;
                if (bias0 != NULL)
                        add_vec(a, comb_ld<STREAM>((const int4 *)bias0 + i), 0, 0.0f);
                if (bias1 != NULL)
                        add_vec(a, comb_ld<STREAM>((const int4 *)bias1 + i), 0, 0.0f);
                int4 o;
                o.x = (int)(to_bf16(a[0]) | to_bf16(a[1]) << 16);
                o.y = (int)(to_bf16(a[2]) | to_bf16(a[3]) << 16);
                o.z = (int)(to_bf16(a[4]) | to_bf16(a[5]) << 16);
                o.w = (int)(to_bf16(a[6]) | to_bf16(a[7]) << 16);
                ((int4 *)out)[i] = o;
        }
}

/* The 16-byte path: every row address and 2H are multiples of 16. The loads of up to
 * COMBINE_AHEAD contributions of a step are issued together before any is added, so a step
 * waits about one load latency rather than one per contribution; the additions keep the
 * ascending order. The step's row addresses come from the slots and its loads are predicated
 * (comb_ld_if), so the warp issues them back to back: with the addresses shuffled from the
 * owner lanes and a branch per contribution, each load waited for its own shuffle, and warps of
 * 8 contributions ended well after a reduce with its row addresses in registers
 * (epd-floor-probe's traces). Against loading one contribution ahead, 8 in flight is faster for
 * decode and prefill alike despite 121 registers (16 warps per multiprocessor) against 63; 4
 * ahead and 16-byte vectors of 1 per lane fall between (docs/performance.md, "Design choices
 * and their measured effect"). */
template <bool STREAM>
static __device__ void combine_vec(const struct combine_slots *sl, uint32_t n, int weighted,
                                   const uint8_t *bias0, const uint8_t *bias1, uint8_t *out,
                                   uint32_t v0, uint32_t nvec, uint32_t lane)
{
        if (n <= COMBINE_AHEAD) {
                /* Rolling: contribution c's loads for the next step are issued as soon as its
                 * additions for this step have read its registers, so the next step's data
                 * travels while this step's other contributions are added, with no register
                 * more than a whole step's loads take (loading the whole next step ahead needs
                 * a second buffer, and was no faster). The order of the additions is
                 * unchanged. */
                int4 buf[COMBINE_AHEAD][COMBINE_VEC];
#pragma unroll
                for (int c = 0; c < COMBINE_AHEAD; c++)
                        combine_load<STREAM>(buf[c], sl, c, n, v0, nvec, lane);
                for (uint32_t base = v0; base < nvec; base += 32 * COMBINE_VEC) {
                        float acc[8 * COMBINE_VEC];
#pragma unroll
                        for (int i = 0; i < 8 * COMBINE_VEC; i++)
                                acc[i] = 0.0f;
#pragma unroll
                        for (int c = 0; c < COMBINE_AHEAD; c++) {
                                combine_add(acc, buf[c], sl, c, n, weighted);
                                combine_load<STREAM>(buf[c], sl, c, n, base + 32 * COMBINE_VEC,
                                                     nvec, lane);
                        }
                        combine_store<STREAM>(acc, bias0, bias1, out, base, nvec, lane);
                }
                return;
        }
        for (uint32_t base = v0; base < nvec; base += 32 * COMBINE_VEC) {
                float acc[8 * COMBINE_VEC];
#pragma unroll
                for (int i = 0; i < 8 * COMBINE_VEC; i++)
                        acc[i] = 0.0f;
                for (uint32_t c0 = 0; c0 < n; c0 += COMBINE_AHEAD) {
                        int4 buf[COMBINE_AHEAD][COMBINE_VEC];
#pragma unroll
                        for (int c = 0; c < COMBINE_AHEAD; c++)
                                combine_load<STREAM>(buf[c], sl, c0 + c, n, base, nvec, lane);
#pragma unroll
                        for (int c = 0; c < COMBINE_AHEAD; c++)
                                combine_add(acc, buf[c], sl, c0 + c, n, weighted);
                }
                combine_store<STREAM>(acc, bias0, bias1, out, base, nvec, lane);
        }
}

/* Any alignment: one bf16 value per lane per step, same order of operations. */
static __device__ void combine_scalar(const struct combine_slots *sl, uint32_t n, int weighted,
                                      const uint8_t *bias0, const uint8_t *bias1, uint8_t *out,
                                      uint32_t h0, uint32_t hidden, uint32_t lane)
{
        for (uint32_t base = h0; base < hidden; base += 32) {
                uint32_t h = base + lane;
                float acc = 0.0f;
                for (uint32_t c = 0; c < n; c++) {
                        const uint16_t *p = (const uint16_t *)sl->rows[c];
                        if (h < hidden) {
                                float v = __uint_as_float((uint32_t)p[h] << 16);
                                if (weighted)
                                        v = __fmul_rn(v, sl->weights[c]);
                                acc = __fadd_rn(acc, v);
                        }
                }
                if (h >= hidden)
                        continue;
                if (bias0 != NULL)
                        acc = __fadd_rn(acc, __uint_as_float((uint32_t)((const uint16_t *)bias0)[h]
                                                             << 16));
                if (bias1 != NULL)
                        acc = __fadd_rn(acc, __uint_as_float((uint32_t)((const uint16_t *)bias1)[h]
                                                             << 16));
                ((uint16_t *)out)[h] = (uint16_t)to_bf16(acc);
        }
}

static __device__ __forceinline__ const uint8_t *mat_row(const struct epd_mat *m, uint64_t row)
{
        return m->ptr == NULL ? NULL : m->ptr + row * m->stride;
}


/* combined_topk_weights with recv_weights (docs/semantics.md §3), by the warp of a token's
 * first slice: for every k, +0.0f plus, in ascending destination rank d, d's recv_weights at the
 * token's row there, position k, each addition rounded on its own; a NaN sum is 0x7FFFFFFF. The contributing lanes (row >=
 * 0: NON_EXPAND sets one per destination the token went to) place their destinations' weight rows
 * in the warp's slots in ascending d; lane k then adds column k of them in that order. The slots
 * are free here: the previous item's reads of them end before the first __syncwarp, and the
 * caller's next writes come after its own __syncwarp, after these reads. */
static __device__ __forceinline__ void
combine_recv_weights(struct combine_slots *sl, const struct epd_k_combine_args *p, int32_t expert,
                     int32_t row, uint32_t n, uint32_t K, uint32_t L, uint32_t lane, float *out)
{
        const uint32_t dest = row >= 0 ? epd_route_expert_rank(expert, L) : UINT32_MAX;
        uint32_t pos = 0;

        /* this lane's place among the contributions: how many go to a lower rank (lanes without
         * a row carry UINT32_MAX and never count) */
        for (uint32_t j = 0; j < K; j++)
                pos += __shfl_sync(EPD_K_FULL_MASK, dest, j) < dest;
        __syncwarp();
        if (row >= 0)
                sl->rows[pos] = p->ranks[dest].recv_weights.ptr +
                                (uint64_t)row * p->ranks[dest].recv_weights.stride;
        __syncwarp();
        if (lane < K) {
                float acc = 0.0f;
                for (uint32_t c = 0; c < n; c++)
                        acc = __fadd_rn(acc, ((const float *)sl->rows[c])[lane]);
                /* the canonical NaN, which the additions give already (cpu/exec.c stores it) */
                out[lane] = acc != acc ? __uint_as_float(0x7fffffffu) : acc;
        }
}

/* combine_hot.flags */
#define COMBINE_WEIGHTED 1u /* multiply each contribution by its weight (apply_weights) */
/* Launches from device descriptors only (the launcher takes no INL path with them): */
#define COMBINE_SOURCE_WEIGHTS 4u /* a source's source_weights, when given, is w(t, k) */
#define COMBINE_RECV_WEIGHTS 8u   /* combined_topk_weights reduces the destinations'
                                   * recv_weights (docs/semantics.md §3) */
/* INL launches only: every row the op reads or writes (every rank's y, the local ranks' biases
 * and outputs) is 16-byte aligned with a 16-byte stride, 2H is a multiple of 16, and every local
 * rank with tokens has an output, as the launcher checked on its host copies; the warps then
 * skip the per-item check, whose output and bias descriptors the first loads would wait for. */
#define COMBINE_ALIGNED 2u

/* The parameters a warp reads before its first row load, adjacent and first in the launch's
 * parameters: 112 bytes, which from the sm_90 parameter base (constant bank offset 0x210) lie
 * in two 64-byte lines of the constant cache. A warp's reads of different parameter lines are
 * served one line after the other, whether or not they depend on each other (epd-param-probe),
 * so the first workspace load must not need more lines than these two; spread over the
 * arguments, the layout and the inline descriptors it would wait for six. */
struct combine_hot {
        const int32_t *topk, *row;  /* the workspace's topk and row fields */
        const float *weights;       /* its weights field; NULL when the dispatch carried none */
        uint32_t src_entries;       /* epd_ws_src_entries of the layout */
        uint32_t num_topk, slices, slice_values, local_tokens, num_local;
        uint32_t num_local_experts, world_size, hidden, flags; /* COMBINE_* */
        /* INL launches: the local ranks (args.local[i].token_offset and .rank) */
        uint32_t token_offset[EPD_K_INLINE_RANKS];
        uint16_t rank[EPD_K_INLINE_RANKS];
};
static_assert(sizeof(struct combine_hot) == 112, "combine_hot fills two constant-cache lines");

/* What an INL launch passes of the ranks' descriptors, packed: the whole parameter block is hot
 * and one of these, 496 or 752 bytes, where hot, the arguments and every rank's full descriptor
 * would take 1112. The parameter block's size is paid inside the kernel time: after the benchmark's
 * flush a kernel with a large block takes longer than one with a small block, whether or not it
 * reads them (epd-param-probe), presumably because the launch writes the block to memory before
 * the first block starts and each new line displaces a dirty one (docs/performance.md, "Design
 * choices and their measured effect"). */
struct combine_y {              /* rank r's y: lane r reads it while the entries come back */
        const uint8_t *ptr;
        uint32_t stride, rows;      /* the launcher takes INL only when both fit */
};
struct combine_mine {           /* local rank i's outputs (hot.rank[i]'s descriptor) */
        struct epd_mat combined, combined_topk_weights;
};
struct combine_inl {
        struct combine_y y[EPD_K_INLINE_RANKS];
        struct combine_mine mine[EPD_K_INLINE_RANKS];
};
struct combine_inl_bias {       /* for ops whose local ranks have biases */
        struct combine_y y[EPD_K_INLINE_RANKS];
        struct combine_mine mine[EPD_K_INLINE_RANKS];
        struct epd_mat bias[EPD_K_INLINE_RANKS][2];
};
static_assert(sizeof(struct combine_inl) == 384, "combine_inl: 6 constant-cache lines");

/* Which descriptors a combine_kernel<STREAM, P> reads, by its second parameter's type. */
template <typename P> struct combine_mode {
        static constexpr bool inl = true, bias = false;
};
template <> struct combine_mode<struct epd_k_combine_args> {
        static constexpr bool inl = false, bias = true;
};
template <> struct combine_mode<struct combine_inl_bias> {
        static constexpr bool inl = true, bias = true;
};

/* Grid-stride over work items, a warp per item: item = (token, slice), where a slice is
 * slice_values consecutive hidden values (the last one shorter) and a token has `slices` of
 * them (1 for large ops; more when the op has too few tokens to fill the GPU, so that small ops
 * keep enough loads in flight). Each output value is still computed by one lane
 * with the same operations in the same order, so the bits do not depend on the slicing.
 *
 * STREAM (small ops, those cut into slices): the rows are loaded with the L2 evict-first hint.
 * A small op's rows are read once and are few against the L2, whose other lines (someone's
 * working set, or the dirty lines of whatever ran before) it then leaves in place, which makes
 * the decode combine faster after a flush of either kind. A large op streams far more than the
 * L2 holds whatever the hint, and the hint makes prefill combine slower, so large ops load
 * plainly (docs/performance.md, "Design choices and their measured effect").
 *
 * P: the ranks' descriptors. combine_inl and combine_inl_bias (INL: the launcher had host copies
 * of the descriptors, at most EPD_K_INLINE_RANKS ranks): the local ranks come from hot and the
 * descriptors from p, as constant-bank loads; a type rather than a run-time flag so that the
 * compiler knows their address space (through a pointer of unknown space they would be generic
 * loads that travel the memory path). epd_k_combine_args: both come from device memory
 * (args.local, args.ranks).
 *
 * Memory ordering: everything it reads (the handle's rows, topk and weights; every rank's y,
 * recv_weights and source_weights; the biases) was written before the launch by kernels or
 * copies that the host orders before it with events (the clients' inputs as y is, through the
 * inputs_ready wait), so plain and read-only (epd__k_ldg) loads are correct: nothing written
 * during this kernel is read by it. Each output element has one writer: combined_topk_weights
 * row t is written by the warp of (t, slice 0) alone. */
template <bool STREAM, typename P>
static __global__ void __launch_bounds__(COMBINE_THREADS, COMBINE_MIN_BLOCKS)
        combine_kernel(const __grid_constant__ struct combine_hot hot, const __grid_constant__ P p)
{
        constexpr bool INL = combine_mode<P>::inl;
        const uint32_t L = hot.num_local_experts, K = hot.num_topk, slices = hot.slices;
        const uint32_t lane = threadIdx.x % 32;
        /* launched with COMBINE_THREADS threads a block (combine_describe): the constant saves
         * the first row load waiting for the constant line that holds blockDim */
        const uint64_t warp = ((uint64_t)blockIdx.x * COMBINE_THREADS + threadIdx.x) / 32;
        const uint64_t warps = (uint64_t)gridDim.x * COMBINE_THREADS / 32;
        const int weighted = (hot.flags & COMBINE_WEIGHTED) != 0;
        const bool aligned = INL && (hot.flags & COMBINE_ALIGNED) != 0;
        const uint64_t items = (uint64_t)hot.local_tokens * slices;
        __shared__ struct combine_slots slots[COMBINE_THREADS / 32];
        struct combine_slots *sl = &slots[threadIdx.x / 32];

        for (uint64_t item = warp; item < items; item += warps) {
                const uint64_t g = item / slices;
                const uint32_t slice = (uint32_t)(item % slices);
                const uint32_t h0 = slice * hot.slice_values;
                const uint32_t h1 = min(hot.hidden, h0 + hot.slice_values);
                uint32_t i, s, t;
                if constexpr (INL) {
                        /* independent comparisons instead of a binary search whose every step
                         * waits for the previous one's load */
                        i = 0;
#pragma unroll
                        for (uint32_t j = 1; j < EPD_K_INLINE_RANKS; j++)
                                i += (j < hot.num_local) & (hot.token_offset[j] <= (uint32_t)g);
                        s = hot.rank[i];
                        t = (uint32_t)g - hot.token_offset[i];
                } else {
                        i = epd__k_find_local(p.local, hot.num_local, (uint32_t)g);
                        s = p.local[i].rank;
                        t = (uint32_t)g - p.local[i].token_offset;
                }
                const uint64_t ent = epd_ws_entry_at(hot.src_entries, s, t, K, 0);
                int32_t expert = -1, row = -1;
                float weight = 0.0f;

                if (lane < K) {
                        expert = hot.topk[ent + lane];
                        row = hot.row[ent + lane];
                        if (hot.weights != NULL)
                                weight = hot.weights[ent + lane];
                }
                /* INL: while the entries come back, lane r reads rank r's y descriptor, and each
                 * lane takes its contribution's from the owner lane below, so no descriptor load
                 * waits behind the entries (world_size <= EPD_K_INLINE_RANKS here). */
                const uint8_t *lane_y = NULL;
                uint32_t lane_stride = 0, lane_rows = 0;
                if constexpr (INL) {
                        if (lane < hot.world_size) {
                                lane_y = p.y[lane].ptr;
                                lane_stride = p.y[lane].stride;
                                lane_rows = p.y[lane].rows;
                        }
                }
                const struct epd_mat *ctw, *combined;
                if constexpr (INL) {
                        ctw = &p.mine[i].combined_topk_weights;
                        combined = &p.mine[i].combined;
                } else {
                        ctw = &p.ranks[s].combined_topk_weights;
                        combined = &p.ranks[s].combined;
                }
                if (lane < K) {
                        /* The dispatch's weights, masked to 0.0f where topk_idx held -1;
                         * nothing to route back when the dispatch carried none, and the
                         * reduction below instead with recv_weights. */
                        if (slice == 0 && hot.weights != NULL && ctw->ptr != NULL &&
                            (hot.flags & COMBINE_RECV_WEIGHTS) == 0)
                                ((float *)mat_row(ctw, t))[lane] = expert >= 0 ? weight : 0.0f;
                }
                if constexpr (!INL) {
                        /* w(t, k) of apply_weights: the source's own weights when it gave them
                         * (read once per item, like the workspace's) */
                        if ((hot.flags & COMBINE_SOURCE_WEIGHTS) != 0 && lane < K) {
                                const float *sw =
                                        (const float *)mat_row(&p.ranks[s].source_weights, t);
                                if (sw != NULL)
                                        weight = sw[lane];
                        }
                }
                /* NON_EXPAND rows are set only at each destination's first position, EXPAND rows
                 * at every selection: a row >= 0 is exactly a contribution. */
                const uint8_t *my_row = NULL;
                if constexpr (INL) {
                        const uint32_t dr = row >= 0 ? epd_route_expert_rank(expert, L) : 0;
                        const uint8_t *dy = (const uint8_t *)__shfl_sync(
                                EPD_K_FULL_MASK, (unsigned long long)lane_y, dr);
                        const uint32_t ds = __shfl_sync(EPD_K_FULL_MASK, lane_stride, dr);
                        const uint32_t dn = __shfl_sync(EPD_K_FULL_MASK, lane_rows, dr);
                        if (row >= 0 && (uint32_t)row < dn)
                                my_row = dy + (uint64_t)row * ds;
                        else
                                row = -1;
                } else if (row >= 0) {
                        const struct epd_k_combine_rank *d =
                                &p.ranks[epd_route_expert_rank(expert, L)];
                        if ((uint64_t)row < d->y_rows)
                                my_row = d->y.ptr + (uint64_t)row * d->y.stride;
                        else
                                row = -1;
                }
                const uint32_t mask = __ballot_sync(EPD_K_FULL_MASK, row >= 0);
                const uint32_t n = __popc(mask);
                if constexpr (!INL) {
                        if ((hot.flags & COMBINE_RECV_WEIGHTS) != 0 && slice == 0 &&
                            ctw->ptr != NULL)
                                combine_recv_weights(sl, &p, expert, row, n, K, L, lane,
                                                     (float *)mat_row(ctw, t));
                }
                /* the previous item's reads of the slots are done before they are rewritten, and
                 * these writes are visible to the warp's reads below (__syncwarp orders the
                 * warp's shared memory accesses) */
                __syncwarp();
                if (row >= 0) {
                        const uint32_t c = __popc(mask & ((1u << lane) - 1u));
                        sl->rows[c] = my_row;
                        sl->weights[c] = weight;
                }
                __syncwarp();
                const uint8_t *bias0 = NULL, *bias1 = NULL;
                if constexpr (combine_mode<P>::bias) {
                        const struct epd_mat *b;
                        if constexpr (INL)
                                b = p.bias[i];
                        else
                                b = p.ranks[s].bias;
                        bias0 = mat_row(&b[0], t);
                        bias1 = mat_row(&b[1], t);
                }
                uint8_t *out = (uint8_t *)mat_row(combined, t);
                if (aligned) {
                        combine_vec<STREAM>(sl, n, weighted, bias0, bias1, out, h0 / 8, h1 / 8,
                                            lane);
                        continue;
                }
                if (out == NULL)
                        continue;
                uint32_t bits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)my_row) |
                                (uint32_t)(uintptr_t)bias0 | (uint32_t)(uintptr_t)bias1 |
                                (uint32_t)(uintptr_t)out | (hot.hidden * 2u);
                if ((bits & 15) == 0)
                        combine_vec<STREAM>(sl, n, weighted, bias0, bias1, out, h0 / 8, h1 / 8,
                                            lane);
                else
                        combine_scalar(sl, n, weighted, bias0, bias1, out, h0, h1, lane);
        }
}

/* The launch of a combine, described; its parameters point at *args and *g (which it fills).
 * An op without local tokens has nothing to launch: 1. */
struct combine_geometry {
        struct combine_hot hot;
        struct combine_inl_bias inl; /* its first sizeof(combine_inl) bytes are a combine_inl */
};
static_assert(offsetof(struct combine_inl_bias, mine) == offsetof(struct combine_inl, mine),
              "combine_inl is a prefix of combine_inl_bias");

static int mat_aligned(const struct epd_mat *m)
{
        return ((uintptr_t)m->ptr | m->stride) % 16 == 0;
}

/* COMBINE_ALIGNED's conditions, on the host copies of the descriptors. */
static int combine_all_aligned(const struct epd_k_combine_args *args)
{
        if ((uint64_t)args->hidden * 2 % 16 != 0)
                return 0;
        for (uint32_t r = 0; r < args->world_size; r++)
                if (!mat_aligned(&args->ranks_host[r].y))
                        return 0;
        for (uint32_t i = 0; i < args->num_local; i++) {
                const struct epd_k_combine_rank *me = &args->ranks_host[args->local_host[i].rank];
                if (me->num_tokens > 0 && me->combined.ptr == NULL)
                        return 0;
                if (!mat_aligned(&me->combined) || !mat_aligned(&me->bias[0]) ||
                    !mat_aligned(&me->bias[1]))
                        return 0;
        }
        return 1;
}

/* Fills g->hot's local ranks and g->inl from the host copies: 0, or 1 with biases; -1 when
 * the descriptors must come from device memory (no host copies, too many ranks, or a y stride
 * or row count past 32 bits). */
static int combine_fill_inl(const struct epd_k_combine_args *args, struct combine_geometry *g)
{
        if (args->ranks_host == NULL || args->local_host == NULL ||
            args->world_size > EPD_K_INLINE_RANKS || args->num_local > EPD_K_INLINE_RANKS)
                return -1;
        memset(&g->inl, 0, sizeof(g->inl));
        for (uint32_t r = 0; r < args->world_size; r++) {
                const struct epd_k_combine_rank *d = &args->ranks_host[r];
                if (d->y.stride > UINT32_MAX || d->y_rows > UINT32_MAX)
                        return -1;
                g->inl.y[r] = (struct combine_y){ d->y.ptr, (uint32_t)d->y.stride,
                                                  (uint32_t)d->y_rows };
        }
        int bias = 0;
        for (uint32_t i = 0; i < args->num_local; i++) {
                const struct epd_k_combine_rank *me = &args->ranks_host[args->local_host[i].rank];
                g->hot.token_offset[i] = args->local_host[i].token_offset;
                g->hot.rank[i] = (uint16_t)args->local_host[i].rank;
                g->inl.mine[i] = (struct combine_mine){ me->combined, me->combined_topk_weights };
                g->inl.bias[i][0] = me->bias[0];
                g->inl.bias[i][1] = me->bias[1];
                bias |= me->bias[0].ptr != NULL || me->bias[1].ptr != NULL;
        }
        return bias;
}

/* combine_kernel<STREAM, P> for a mode of combine_fill_inl. */
template <bool STREAM> static const void *combine_kernel_for(int inl)
{
        return inl < 0 ? (const void *)combine_kernel<STREAM, struct epd_k_combine_args>
               : inl   ? (const void *)combine_kernel<STREAM, struct combine_inl_bias>
                       : (const void *)combine_kernel<STREAM, struct combine_inl>;
}

static int combine_describe(const struct epd_k_combine_args *args, struct combine_geometry *g,
                            struct epd__k_launch *d)
{
        struct epd_ws_layout l;
        int blocks, ret = epd__k_check_combine(args, &l);

        if (ret < 0)
                return ret;
        if (args->num_local == 0 || args->local_tokens == 0)
                return 1;
        const uint64_t warps_per_block = COMBINE_THREADS / 32;
        uint64_t slice_values;
        uint32_t slices;
        ret = epd__k_slicing(args->local_tokens, args->hidden, COMBINE_SLICE_UNIT,
                             COMBINE_SLICE_WARPS, &slice_values, &slices);
        if (ret < 0)
                return ret;
        struct combine_hot *h = &g->hot;
        memset(h, 0, sizeof(*h));
        void *ws = (void *)args->workspace; /* only read */
        h->topk = epd_ws_i32(ws, l.topk);
        h->row = epd_ws_i32(ws, l.row);
        h->weights = args->has_weights ? epd_ws_f32(ws, l.weights) : NULL;
        h->src_entries = (uint32_t)epd_ws_src_entries(&l); /* < 2^31: epd__k_check_combine */
        h->num_topk = args->num_topk;
        h->slices = slices;
        h->slice_values = (uint32_t)slice_values;
        h->local_tokens = args->local_tokens;
        h->num_local = args->num_local;
        h->num_local_experts = l.num_local_experts;
        h->world_size = args->world_size;
        h->hidden = args->hidden;
        h->flags = args->apply_weights != 0 ? COMBINE_WEIGHTED : 0;
        /* The weight inputs are read from the device descriptors: such an op takes no INL
         * launch, whose parameter block stays as measured. */
        const int weight_inputs = args->source_weights != 0 || args->recv_weights != 0;
        h->flags |= (args->source_weights != 0 ? COMBINE_SOURCE_WEIGHTS : 0) |
                    (args->recv_weights != 0 ? COMBINE_RECV_WEIGHTS : 0);
        const int inl = weight_inputs ? -1 : combine_fill_inl(args, g);
        if (inl >= 0 && combine_all_aligned(args))
                h->flags |= COMBINE_ALIGNED;
        const uint64_t items = (uint64_t)args->local_tokens * slices;
        const void *kernel = slices > 1 ? combine_kernel_for<true>(inl)
                                        : combine_kernel_for<false>(inl);
        ret = epd__k_grid_blocks(kernel, COMBINE_THREADS, 0,
                                 (items + warps_per_block - 1) / warps_per_block, &blocks);
        if (ret < 0)
                return ret;
        *d = (struct epd__k_launch){};
        d->func = kernel;
        d->grid = dim3((unsigned)blocks);
        d->block = dim3(COMBINE_THREADS);
        d->params[0] = &g->hot;
        d->params[1] = inl < 0 ? (const void *)args : (const void *)&g->inl;
        return 0;
}

extern "C" int epd_k_combine(const struct epd_k_combine_args *args, cudaStream_t stream)
{
        struct combine_geometry g;
        struct epd__k_launch d;
        int ret = combine_describe(args, &g, &d);

        return ret != 0 ? (ret > 0 ? 0 : ret) : epd__k_launch_direct(&d, stream);
}

/* With nothing to launch, the two events still bound an (empty) kernel time. */
extern "C" int epd_k_combine_timed(const struct epd_k_combine_args *args, struct epd_k_timed *t,
                                   cudaEvent_t t0, cudaEvent_t t1, cudaStream_t stream)
{
        struct combine_geometry g;
        struct epd__k_launch d;
        int ret = combine_describe(args, &g, &d);

        if (ret < 0)
                return ret;
        if (ret > 0) {
                ret = epd__k_cuda_status(cudaEventRecord(t0, stream));
                return ret < 0 ? ret : epd__k_cuda_status(cudaEventRecord(t1, stream));
        }
        return epd__k_launch_timed(t, &d, t0, t1, stream);
}

int epd__k_preload_combine(void)
{
        struct cudaFuncAttributes attr;
        const void *kernels[] = { combine_kernel_for<false>(-1), combine_kernel_for<false>(0),
                                  combine_kernel_for<false>(1),  combine_kernel_for<true>(-1),
                                  combine_kernel_for<true>(0),   combine_kernel_for<true>(1) };
        int ret = 0;
        for (size_t k = 0; ret == 0 && k < sizeof(kernels) / sizeof(kernels[0]); k++)
                ret = epd__k_cuda_status(cudaFuncGetAttributes(&attr, kernels[k]));
        return ret;
}
