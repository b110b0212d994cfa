/* routing.h - the routing and placement primitives of docs/semantics.md section 2, in one place.
 *
 * Every function here is a pure function of its arguments and compiles both as C (host backend,
 * daemon sizing, tests' production side) and as CUDA (kernels), so host sizing and device
 * addressing cannot drift. Expert ids are int32 here: E <= 2048, and callers normalise int64
 * topk_idx before using these helpers.
 */
#ifndef EPD_COMMON_ROUTING_H
#define EPD_COMMON_ROUTING_H

#include <stdint.h>

#if defined(__CUDACC__)
#define EPD_HD static __host__ __device__ __forceinline__
#else
#define EPD_HD static inline
#endif

/* Limits of docs/semantics.md section 1. */
#define EPD_MAX_WORLD_SIZE 1024u
#define EPD_MAX_EXPERTS 2048u
#define EPD_MAX_LOCAL_EXPERTS 256u
#define EPD_MAX_TOPK 32u
#define EPD_DEFAULT_SCALE_BLOCK 128u

/* Expert e lives on rank e / L with local id e % L. */
EPD_HD uint32_t epd_route_expert_rank(int32_t expert, uint32_t num_local_experts)
{
        return (uint32_t)expert / num_local_experts;
}

/* Division by a per-op constant without a divide instruction, for kernels that divide many
 * small numbers by it: with m = epd_udiv_magic(d) = ceil(2^32 / d),
 * epd_udiv_by_magic(x, m) == x / d for every x with x * d < 2^32.
 * Why: write m = (2^32 + r) / d with 0 <= r < d, and x = q d + f with 0 <= f < d. Then
 * x m / 2^32 = q + f / d + x r / (d 2^32), and the last two terms stay below 1 because
 * f <= d - 1 and x r < x d < 2^32. tests/unit/unit_plan.c checks it for every d <= 256. */
EPD_HD uint64_t epd_udiv_magic(uint32_t divisor)
{
        return ((1ull << 32) + divisor - 1) / divisor;
}

EPD_HD uint32_t epd_udiv_by_magic(uint32_t x, uint64_t magic)
{
        return (uint32_t)(((uint64_t)x * magic) >> 32);
}

/* epd_route_expert_rank with magic = epd_udiv_magic(L): exact for every expert id, since
 * E * L <= 2048 * 256 < 2^32. */
EPD_HD uint32_t epd_route_expert_rank_magic(int32_t expert, uint64_t magic)
{
        return epd_udiv_by_magic((uint32_t)expert, magic);
}

EPD_HD uint32_t epd_route_expert_local(int32_t expert, uint32_t num_local_experts)
{
        return (uint32_t)expert % num_local_experts;
}

EPD_HD uint64_t epd_route_align_up(uint64_t count, uint32_t alignment)
{
        return (count + alignment - 1) / alignment * alignment;
}

/* Whether top-k position k of one token's row is the first position whose expert lives on the
 * same rank as row[k]. Deduplication is per (token, destination): a NON_EXPAND token is sent to
 * (and combined from) destination d once, at that first position. row[k] must be valid (>= 0). */
EPD_HD int epd_route_is_first_for_rank(const int32_t *row, uint32_t k, uint32_t num_local_experts)
{
        uint32_t rank = epd_route_expert_rank(row[k], num_local_experts);
        for (uint32_t j = 0; j < k; j++)
                if (row[j] >= 0 && epd_route_expert_rank(row[j], num_local_experts) == rank)
                        return 0;
        return 1;
}

/* The global source index of docs/semantics.md §2.1 (recv_src). */
EPD_HD int64_t epd_route_global_src(uint32_t src_rank, uint32_t max_tokens_per_rank, uint32_t token)
{
        return (int64_t)src_rank * max_tokens_per_rank + token;
}

/* Worst-case output rows per rank (docs/semantics.md section 5). */
EPD_HD uint64_t epd_route_max_rows_non_expand(uint32_t world_size, uint32_t max_tokens_per_rank)
{
        return (uint64_t)world_size * max_tokens_per_rank;
}

EPD_HD uint64_t epd_route_max_rows_expand(uint32_t world_size, uint32_t max_tokens_per_rank,
                                          uint32_t max_topk, uint32_t num_local_experts,
                                          uint32_t expert_alignment)
{
        uint32_t per_token = max_topk < num_local_experts ? max_topk : num_local_experts;
        return (uint64_t)world_size * max_tokens_per_rank * per_token +
               (uint64_t)num_local_experts * (expert_alignment - 1);
}

#endif
