/* verdict.cuh - the error records, the capacity check and the verdict of a dispatch, shared by
 * the count, prefix and recheck steps (route.cu) and the small-op routing (route_small.cu).
 */
#ifndef EPD_KERNELS_VERDICT_CUH
#define EPD_KERNELS_VERDICT_CUH

#include <stdint.h>

#include "internal.cuh"

/* Writes chunk `chunk` of source s's error record: BAD_TOKENS (value: the claimed num_tokens)
 * when bad_tokens, else the chunk's first bad entry first_bad = t * K_op + k (UINT32_MAX: none),
 * whose id is read again from topk_idx to tell a repeat from an id out of range. */
static __device__ void write_chunk_error(const struct epd_k_dispatch_args *a,
                                         const struct epd_ws_layout *l, uint32_t s,
                                         uint32_t chunk, int bad_tokens, uint32_t first_bad)
{
        const struct epd_k_dispatch_rank *src = &a->ranks[s];
        struct epd_ws_src_error *rec =
                epd_ws_chunk_errors(a->workspace, l) + (uint64_t)s * l->num_chunks + chunk;

        rec->reason = EPD_WS_REASON_NONE;
        rec->token = 0;
        rec->pos = 0;
        rec->reserved = 0;
        rec->value = 0;
        if (bad_tokens) {
                rec->reason = EPD_WS_REASON_BAD_TOKENS;
                rec->value = src->num_tokens;
        } else if (first_bad != UINT32_MAX) {
                const uint32_t K = a->num_topk, t = first_bad / K, k = first_bad % K;
                const uint64_t stride = src->topk_stride != 0 ? src->topk_stride : K;
                const int64_t v = epd__k_load_topk(src->topk_idx, a->topk_dtype,
                                                   (uint64_t)t * stride + k);
                rec->reason = v >= 0 && v < (int64_t)a->num_experts ? EPD_WS_REASON_DUP_EXPERT
                                                                     : EPD_WS_REASON_BAD_EXPERT;
                rec->token = (int32_t)t;
                rec->pos = (int32_t)k;
                rec->value = v;
        }
}

/* Capacity of every destination against its rows; returns through shared counters. */
static __device__ void check_capacity(const struct epd_k_dispatch_args *a,
                                      const struct epd_ws_layout *l, uint32_t d,
                                      uint32_t *num_short, uint32_t *first_short)
{
        int64_t rows = a->layout == EPD_LAYOUT_EXPAND
                               ? epd_ws_num_expanded_rows(a->workspace, l, d)
                               : epd_ws_num_recv_tokens(a->workspace, l, d);

        if ((uint64_t)rows > a->ranks[d].capacity_rows) {
                atomicAdd(num_short, 1u);
                atomicMin(first_short, d);
        }
}

/* Writes the verdict: details first, status last with a .sys release, so that whoever acquires
 * a non-zero status (the data kernels of every device, the host through its copy of the reply
 * block after the stream completes) also sees the details. */
static __device__ void write_verdict(const struct epd_k_dispatch_args *a,
                                     const struct epd_ws_layout *l, uint32_t first_bad_src,
                                     uint32_t first_bad_chunk, uint32_t num_short,
                                     uint32_t first_short)
{
        struct epd_ws_error *rec = epd_ws_error_rec(a->workspace, l);
        int32_t status = 0;

        rec->reason = EPD_WS_REASON_NONE;
        rec->rank = 0;
        rec->num_short = 0;
        rec->token = 0;
        rec->pos = 0;
        rec->value = 0;
        rec->capacity = 0;
        if (first_bad_src != UINT32_MAX) {
                const struct epd_ws_src_error *se =
                        epd_ws_chunk_errors(a->workspace, l) + first_bad_chunk;
                status = EPD_INVALID_ARGUMENT;
                rec->reason = se->reason;
                rec->rank = (int32_t)first_bad_src;
                rec->token = se->token;
                rec->pos = se->pos;
                rec->value = se->value;
        } else if (num_short != 0) {
                status = EPD_CAPACITY_EXCEEDED;
                rec->reason = EPD_WS_REASON_CAPACITY;
                rec->rank = (int32_t)first_short;
                rec->num_short = (int32_t)num_short;
                rec->value = a->layout == EPD_LAYOUT_EXPAND
                                     ? epd_ws_num_expanded_rows(a->workspace, l, first_short)
                                     : epd_ws_num_recv_tokens(a->workspace, l, first_short);
                rec->capacity = (int64_t)a->ranks[first_short].capacity_rows;
        }
        epd_st_release_sys_s32(&rec->status, status);
}

#endif
