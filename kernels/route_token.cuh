/* route_token.cuh - what the small-op kernels share (route_small.cu, which routes through flags
 * between blocks, and dispatch_small.cu, in which each cluster of blocks routes the whole op):
 * which ops are small, one token's top-k row, and the warp scans.
 */
#ifndef EPD_KERNELS_ROUTE_TOKEN_CUH
#define EPD_KERNELS_ROUTE_TOKEN_CUH

#include <stdint.h>

#include "internal.cuh"

/* Destinations of a small op are bits of a 64-bit mask. */
#define SMALL_MAX_RANKS 64

/* The arguments of a dispatch checked (epd__k_check_dispatch, which fills the layout), and
 * whether it is a small op for route_small.cu and dispatch_small.cu: NON_EXPAND, every rank on
 * the launching device, at most SMALL_MAX_RANKS ranks and EPD_K_SMALL_MAX_TOKENS local tokens.
 * 0, or EPD_INVALID_ARGUMENT for an op that is not small. */
static int small_op_check(const struct epd_k_dispatch_args *args, struct epd_ws_layout *l)
{
        const int ret = epd__k_check_dispatch(args, l);

        if (ret < 0)
                return ret;
        if (args->layout != EPD_LAYOUT_NON_EXPAND || args->num_local != args->world_size ||
            args->world_size > SMALL_MAX_RANKS || args->local_tokens > EPD_K_SMALL_MAX_TOKENS)
                return EPD_INVALID_ARGUMENT;
        return 0;
}

/* Each thread's normalised top-k row lives in shared memory at a stride of num_topk rounded up
 * to odd, so that a warp's threads reading the same position hit 32 different banks. */
static __host__ __device__ __forceinline__ uint32_t small_row_stride(uint32_t num_topk)
{
        return num_topk | 1u;
}

/* An id as loaded from topk_idx, classified: an expert in [0, E) stays itself, -1 stays -1, and
 * anything else becomes -2 (bad). */
static __device__ __forceinline__ int32_t route_classify(int64_t v, uint32_t E)
{
        return v >= 0 && v < (int64_t)E ? (int32_t)v : v == -1 ? -1 : -2;
}

/* Validates and normalises one token's classified top-k row in place: nrow[k] gets each valid
 * entry packed as expert | destination << 16 (E <= 2048, R <= 64), -1 otherwise. Returns the
 * token's destination mask; *first gets the first-position bits (docs/semantics.md §2: the first
 * position per destination) and *bad the first bad position (UINT32_MAX: none).
 * lmagic = epd_udiv_magic(L).
 *
 * KMAX 0: nrow is shared memory (int32_t *) and the loops run to K. KMAX > 0 (K <= KMAX): nrow
 * is a register array (int32_t[KMAX]) and every loop is unrolled, so no entry touches memory;
 * for the common K_op <= 8 this is several times fewer instructions.
 *
 * One pass does what the count step (route.cu) does in three, because a block is limited by the
 * instructions it issues and their latency (ncu: dividing by L in nested loops executes twice
 * the instructions): an id repeats an earlier raw id exactly when it equals
 * an earlier normalised one (the first occurrence of an in-range id is never normalised away),
 * so the raw row need not be kept; and a valid position is the first for its destination exactly
 * when no earlier valid position has that destination (epd_route_is_first_for_rank), which a
 * running mask of the destinations seen answers with one quotient per entry. */
template <uint32_t KMAX, typename Row>
static __device__ __forceinline__ uint64_t route_normalize(uint32_t K, uint64_t lmagic, Row &nrow,
                                                           uint32_t *first, uint32_t *bad)
{
        const uint32_t n = KMAX ? KMAX : K;
        uint64_t dmask = 0;

        *first = 0;
        *bad = UINT32_MAX;
        /* The count step's pass A: ids outside [0, E) other than -1, and repeats, are bad and
         * normalised to -1. */
#pragma unroll
        for (uint32_t k = 0; k < n; k++) {
                if (KMAX && k >= K)
                        break;
                const int32_t v = nrow[k];
                int32_t norm = -1;
                if (v >= 0) {
                        norm = v;
#pragma unroll
                        for (uint32_t j = 0; j < k; j++) {
                                if (nrow[j] >= 0 && (nrow[j] & 0xffff) == norm) {
                                        norm = -1;
                                        *bad = min(*bad, k);
                                        break;
                                }
                        }
                } else if (v != -1) {
                        *bad = min(*bad, k);
                }
                nrow[k] = -1;
                if (norm < 0)
                        continue;
                const uint32_t d = epd_route_expert_rank_magic(norm, lmagic);
                nrow[k] = norm | (int32_t)(d << 16);
                if (!((dmask >> d) & 1)) {
                        dmask |= 1ull << d;
                        *first |= 1u << k;
                }
        }
        return dmask;
}

/* One token's row loaded from element row0 of topk_idx into registers (K_op <= KMAX; the loads
 * are predicated, not branched around, so they are all in flight together), classified, then
 * route_normalize in registers: nrow gets the normalised row. */
template <uint32_t KMAX>
static __device__ __forceinline__ uint64_t route_token_regs(const void *topk_idx,
                                                            enum epd_dtype dtype, uint64_t row0,
                                                            uint32_t K, uint32_t E,
                                                            uint64_t lmagic,
                                                            int32_t (&nrow)[KMAX],
                                                            uint32_t *first, uint32_t *bad)
{
#pragma unroll
        for (uint32_t k = 0; k < KMAX; k++) {
                nrow[k] = -1;
                if (k < K)
                        nrow[k] = route_classify(epd__k_load_topk(topk_idx, dtype, row0 + k), E);
        }
        return route_normalize<KMAX>(K, lmagic, nrow, first, bad);
}

/* One token's row loaded from element row0 of topk_idx into shared memory (the loads first, all
 * in flight together), classified, then route_normalize. */
static __device__ uint64_t route_token(const void *topk_idx, enum epd_dtype dtype, uint64_t row0,
                                       uint32_t K, uint32_t E, uint64_t lmagic, int32_t *nrow,
                                       uint32_t *first, uint32_t *bad)
{
        for (uint32_t k = 0; k < K; k++)
                nrow[k] = route_classify(epd__k_load_topk(topk_idx, dtype, row0 + k), E);
        return route_normalize<0>(K, lmagic, nrow, first, bad);
}

static __device__ __forceinline__ int32_t warp_inclusive_scan(int32_t v)
{
        const uint32_t lane = threadIdx.x % 32;

        for (uint32_t o = 1; o < 32; o <<= 1) {
                const int32_t n = __shfl_up_sync(EPD_K_FULL_MASK, v, o);
                if (lane >= o)
                        v += n;
        }
        return v;
}

/* One warp: out[i] = in[0] + ... + in[i - 1] for i < n, and out[n] = the total. */
static __device__ void warp_exclusive_scan(const int32_t *in, int32_t *out, uint32_t n)
{
        const uint32_t lane = threadIdx.x % 32;
        int32_t carry = 0;

        for (uint32_t i0 = 0; i0 < n; i0 += 32) {
                const uint32_t i = i0 + lane;
                const int32_t v = i < n ? in[i] : 0;
                const int32_t incl = warp_inclusive_scan(v);
                if (i < n)
                        out[i] = carry + incl - v;
                carry += __shfl_sync(EPD_K_FULL_MASK, incl, 31);
        }
        if (lane == 0)
                out[n] = carry;
}

#endif
