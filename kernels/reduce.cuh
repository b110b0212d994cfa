/* reduce.cuh - the arithmetic of combine (SEMANTICS.md 3) and the per-token preamble, shared by
 * the register combine (combine.cu) and the bulk-copy combine (combine_bulk.cu), so that both
 * compute every output value with the same operations in the same order.
 *
 * Floating point: __fmul_rn and __fadd_rn are never contracted into an FMA, and the library is
 * built with --fmad=false -ftz=false as well; bf16 -> fp32 is a shift; fp32 -> bf16 is
 * __float2bfloat16_rn (cvt.rn.bf16.f32: round to nearest even, subnormals kept, and a NaN input
 * gives the canonical 0x7FFF), and NaN is mapped to 0x7FFF explicitly as well, so the bits match
 * common/bf16.h's epd__float_to_bf16 whatever the conversion does with NaN payloads.
 */
#ifndef EPD_KERNELS_REDUCE_CUH
#define EPD_KERNELS_REDUCE_CUH

#include <stdint.h>

#include <cuda_bf16.h>

#include "internal.cuh"

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

/* Adds 8 bf16 values (one 16-byte vector), optionally weighted, to acc[0..7]. */
static __device__ __forceinline__ void add_vec(float *acc, int4 v, int weighted, float w)
{
        add_word(acc + 0, (uint32_t)v.x, weighted, w);
        add_word(acc + 2, (uint32_t)v.y, weighted, w);
        add_word(acc + 4, (uint32_t)v.z, weighted, w);
        add_word(acc + 6, (uint32_t)v.w, weighted, w);
}

/* acc[0..7] rounded to 8 bf16 values, one rounding each. */
static __device__ __forceinline__ int4 pack_vec(const float *acc)
{
        int4 o;
        o.x = (int)(to_bf16(acc[0]) | to_bf16(acc[1]) << 16);
        o.y = (int)(to_bf16(acc[2]) | to_bf16(acc[3]) << 16);
        o.z = (int)(to_bf16(acc[4]) | to_bf16(acc[5]) << 16);
        o.w = (int)(to_bf16(acc[6]) | to_bf16(acc[7]) << 16);
        return o;
}

/* A 16-byte load of a contribution or bias row; STREAM: with the L2 evict-first hint. */
template <bool STREAM> static __device__ __forceinline__ int4 comb_ld(const int4 *p)
{
        return STREAM ? epd__k_ldg_evict_first(p) : epd__k_ldg(p);
}

/* Any alignment: one bf16 value per lane per step, same order of operations, for hidden values
 * [h0, h1). my_row: this lane's contribution row (position `lane`), mask the contributing
 * positions, my_weight position `lane`'s weight. */
static __device__ void combine_scalar(const uint8_t *my_row, uint32_t mask, float my_weight,
                                      int weighted, const uint8_t *bias0, const uint8_t *bias1,
                                      uint8_t *out, uint32_t h0, uint32_t h1, uint32_t lane)
{
        for (uint32_t base = h0; base < h1; base += 32) {
                uint32_t h = base + lane;
                float acc = 0.0f;
                for (uint32_t m = mask; m != 0; m &= m - 1) {
                        int j = __ffs(m) - 1;
                        const uint16_t *p = (const uint16_t *)__shfl_sync(
                                EPD_K_FULL_MASK, (unsigned long long)my_row, j);
                        float w = __shfl_sync(EPD_K_FULL_MASK, my_weight, j);
                        if (h < h1) {
                                float v = __uint_as_float((uint32_t)p[h] << 16);
                                if (weighted)
                                        v = __fmul_rn(v, w);
                                acc = __fadd_rn(acc, v);
                        }
                }
                if (h >= h1)
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

static __device__ __forceinline__ const uint8_t *comb_row(const struct epd_k_mat *m, uint64_t row)
{
        return m->ptr == NULL ? NULL : m->ptr + row * m->stride;
}

/* One token of a combine as a warp sees it (every lane calls comb_token_load with the same g):
 * lane k < K_op holds top-k position k. */
struct comb_token {
        const uint8_t *my_row; /* position `lane`'s contribution row; NULL when it has none */
        float weight;          /* position `lane`'s weight (0.0f without weights) */
        uint32_t mask;         /* the contributing positions */
        const uint8_t *bias0, *bias1; /* the token's bias rows; NULL when absent */
        uint8_t *out;          /* its combined row; NULL when the source has no output */
        uint32_t align_bits;   /* every address above and 2H ORed (low 32 bits) */
};

/* Local flat token g: its positions' experts, rows and weights from the handle's workspace, its
 * rows in y, biases and output. first_slice: this warp also routes the dispatch's weights back
 * (combined_topk_weights), which one item per token does. */
static __device__ __forceinline__ struct comb_token
comb_token_load(const struct epd_k_combine_args &a, const struct epd_ws_layout &l,
                const struct epd_k_combine_rank *ranks, const struct epd_k_local *local,
                uint32_t g, int first_slice, uint32_t lane)
{
        const uint32_t L = l.num_local_experts, K = a.num_topk;
        void *ws = (void *)a.workspace; /* epd_ws_* take a mutable base; only read here */
        const uint32_t i = epd__k_find_local(local, a.num_local, g);
        const uint32_t s = local[i].rank, t = g - local[i].token_offset;
        const struct epd_k_combine_rank *me = &ranks[s];
        const uint64_t ent = epd_ws_entry(&l, s, t, K, 0);
        struct comb_token ct;
        int32_t expert = -1, row = -1;

        ct.weight = 0.0f;
        if (lane < K) {
                expert = epd_ws_i32(ws, l.topk)[ent + lane];
                row = epd_ws_i32(ws, l.row)[ent + lane];
                if (a.has_weights)
                        ct.weight = epd_ws_f32(ws, l.weights)[ent + lane];
                /* The dispatch's weights, masked to 0.0f where topk_idx held -1; nothing to
                 * route back when the dispatch carried none. */
                if (first_slice && a.has_weights && me->combined_topk_weights.ptr != NULL)
                        ((float *)comb_row(&me->combined_topk_weights, t))[lane] =
                                expert >= 0 ? ct.weight : 0.0f;
        }
        /* NON_EXPAND rows are set only at each destination's first position, EXPAND rows at
         * every selection: a row >= 0 is exactly a contribution. */
        ct.my_row = NULL;
        if (row >= 0) {
                const struct epd_k_combine_rank *d = &ranks[epd_route_expert_rank(expert, L)];
                if ((uint64_t)row < d->y_rows)
                        ct.my_row = d->y.ptr + (uint64_t)row * d->y.stride;
                else
                        row = -1;
        }
        ct.mask = __ballot_sync(EPD_K_FULL_MASK, row >= 0);
        ct.bias0 = comb_row(&me->bias[0], t);
        ct.bias1 = comb_row(&me->bias[1], t);
        ct.out = (uint8_t *)comb_row(&me->combined, t);
        ct.align_bits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)ct.my_row) |
                        (uint32_t)(uintptr_t)ct.bias0 | (uint32_t)(uintptr_t)ct.bias1 |
                        (uint32_t)(uintptr_t)ct.out | (a.hidden * 2u);
        return ct;
}

#endif
