/* cx_dispatch.cu - the client-executed dispatch: one kernel per rank, the protocol of cpu/cx.c.
 *
 * Phases, separated by grid barriers (cx_sync.cuh):
 * 1. Block 0 only: admit the op (cx_op.cuh); validate and normalise topk_idx into the handle slot
 *    (or take the handle's routing for a cached dispatch); count tokens per destination and
 *    selections per expert (shared-memory atomics: counts do not depend on the order); publish
 *    the count record to every rank and wait for every rank's; reach the verdict every rank reaches
 *    (cx_dispatch_verdict); place this rank's rows: one thread per destination (NON_EXPAND) or
 *    expert (EXPAND) scans the tokens in order, so each row is a pure function of topk_idx and no
 *    atomic decides an order; write the counts.
 * 2. Every block: a token per block at a time, converted once to fp8 when quantizing, written
 *    straight to its rows in the destinations' receive areas with its metadata; then this rank's
 *    own EXPAND padding rows.
 * 3. Block 0: raise the done flag at every destination, wait for every source's, record the end.
 * Nothing is written to a receive area unless the verdict is OK.
 */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "cx_layout.h"
#include "cx_op.cuh"
#include "cx_sync.cuh"
#include "epd_cx.h"
#include "fp8.h"
#include "routing.h"

#define CX_THREADS 512
#define CX_COPY_UNROLL 8

static __device__ __forceinline__ int64_t load_topk(const void *p, enum epd_dtype dtype,
                                                    uint64_t i)
{
        if (dtype == EPD_DTYPE_INT64)
                return ((const int64_t *)p)[i];
        return ((const int32_t *)p)[i];
}

/* Thread 0: this rank's checks of its own arguments (cpu/cx.c check_dispatch), into the record
 * head. */
static __device__ void check_args(const struct epd_cx_group *g,
                                  const struct epd_cxk_dispatch_args *a, uint64_t epoch,
                                  struct cx_count_rec *head)
{
        const struct cx_layout *l = &g->layout;
        const struct cx_handle *h;
        uint32_t A = a->expert_alignment ? a->expert_alignment : 1;

        head->status = EPD_INVALID_ARGUMENT;
        head->reason = CX_REASON_BAD_ARGS;
        if (a->num_tokens > l->shape.max_tokens || a->num_topk < 1 ||
            a->num_topk > l->shape.max_topk || a->handle >= l->shape.num_handles ||
            (a->layout != EPD_LAYOUT_NON_EXPAND && a->layout != EPD_LAYOUT_EXPAND))
                return;
        if (a->expert_block_rows && (a->layout != EPD_LAYOUT_EXPAND ||
                                     a->expert_block_rows % A != 0 ||
                                     (uint64_t)a->expert_block_rows * l->num_local_experts >
                                             l->recv_rows))
                return;
        if ((a->quantize && !l->shape.quantize) || (a->num_tokens && !a->x) ||
            (a->num_tokens && l->shape.dtype == EPD_DTYPE_FP8_E4M3 && !a->quantize && !a->scales))
                return;
        if (((a->round_scale || a->scale_format) && !a->quantize) ||
            (a->scale_format != EPD_SCALE_FORMAT_FP32 &&
             a->scale_format != EPD_SCALE_FORMAT_UE8M0) ||
            (a->scale_format == EPD_SCALE_FORMAT_UE8M0 && !a->round_scale))
                return;
        h = cx_handle_at(g->bufs[g->rank], l, a->handle);
        if (a->cached) {
                if (h->tag == 0 || h->tag >> CX_OP_BITS != epoch ||
                    h->num_tokens != a->num_tokens || h->layout != (uint32_t)a->layout ||
                    h->num_topk != a->num_topk ||
                    h->alignment != A || h->block_rows != a->expert_block_rows ||
                    h->quantize != (a->quantize ? 1u : 0u))
                        return;
        } else if ((a->topk_dtype != EPD_DTYPE_INT32 && a->topk_dtype != EPD_DTYPE_INT64) ||
                   (a->num_tokens && !a->topk_idx)) {
                return;
        }
        head->status = 0;
        head->reason = CX_REASON_NONE;
}

/* Entries of topk_idx staged in shared memory at a time by the EXPAND placement. */
#define CX_PLACE_TILE 2048u

struct phase1_smem {
        int32_t tok[CX_MAX_RANKS];
        int32_t sel[EPD_MAX_EXPERTS];
        int32_t wcnt[CX_THREADS / 32][CX_MAX_RANKS]; /* NON_EXPAND: per warp, then its base */
        int32_t tile[CX_PLACE_TILE];                 /* EXPAND: a tile of topk_idx */
        int64_t need[CX_MAX_RANKS];                  /* the verdict's rows per destination */
        int32_t short_expert[CX_MAX_RANKS];
        struct cx_count_rec head;
        struct cx_op_status st;
        int bad;
        int early;
        unsigned long long sent;
};

/* Block 0: everything up to the placed rows. Returns the op's status so far, which sm->st
 * describes. */
static __device__ int phase1(const struct epd_cx_group *g, const struct epd_cxk_dispatch_args *a,
                             struct cx_dev_op *o, struct phase1_smem *sm)
{
        const struct cx_layout *l = &g->layout;
        const uint32_t R = l->shape.world_size, E = l->shape.num_experts;
        const uint32_t L = l->num_local_experts, me = g->rank;
        const uint32_t A = a->expert_alignment ? a->expert_alignment : 1;
        const uint32_t N = a->num_tokens, K = a->num_topk, C = a->expert_block_rows;
        uint8_t *own = g->bufs[me];
        const uint32_t handle = a->handle < l->shape.num_handles ? a->handle : 0;
        int32_t *htopk = cx_handle_i32(own, l, handle, l->h_topk);
        int32_t *hrow = cx_handle_i32(own, l, handle, l->h_row);
        int32_t *scratch = (int32_t *)(own + l->scratch);
        int32_t who;

        if (threadIdx.x == 0) {
                sm->early = cx_op_admit(g, o, &sm->st);
                memset(&sm->head, 0, sizeof(sm->head));
                sm->head.token = sm->head.pos = -1;
                cx_dispatch_sig(sm->head.sig, (uint32_t)a->layout, A, C, a->handle,
                                a->cached ? 1u : 0u, a->quantize ? 1u : 0u, a->weights != NULL,
                                a->layout == EPD_LAYOUT_EXPAND && a->zero_padding,
                                a->round_scale ? 1u : 0u, a->scale_format);
                sm->head.num_tokens = N;
                sm->head.capacity_rows = a->capacity_rows && a->capacity_rows < l->recv_rows
                                                 ? (uint32_t)a->capacity_rows
                                                 : l->recv_rows;
                if (!sm->early)
                        check_args(g, a, o->epoch, &sm->head);
                sm->bad = INT_MAX;
                sm->sent = 0;
                /* A dispatch that fails leaves no half-written handle behind. */
                if (!sm->early && sm->head.status == 0 && !a->cached)
                        cx_handle_at(own, l, handle)->tag = 0;
        }
        for (uint32_t i = threadIdx.x; i < R + E; i += blockDim.x) {
                if (i < R)
                        sm->tok[i] = 0;
                else
                        sm->sel[i - R] = 0;
        }
        __syncthreads();
        if (sm->early)
                return sm->early; /* cx_op_admit described it in sm->st */

        /* Validate and normalise, then count, in one pass with a thread per token and its row
         * in registers: the first bad entry (lowest t * K + k: an id out of range, or one its
         * token chose at an earlier position) is the verdict's, as the host plan reports it.
         * The counts of a token with a bad entry are wrong but never published: a failed op
         * sends zeros. */
        if (sm->head.status == 0) {
                for (uint32_t t = threadIdx.x; t < N; t += blockDim.x) {
                        int32_t row[32]; /* max_topk is at most 32 (cx_shape_check) */
                        int first_bad = -1;

                        for (uint32_t k = 0; k < K; k++) {
                                uint64_t i = (uint64_t)t * K + k;
                                int64_t v = a->cached ? htopk[i]
                                                      : load_topk(a->topk_idx, a->topk_dtype, i);
                                int ok = v >= -1 && v < (int64_t)E;

                                row[k] = ok ? (int32_t)v : -1;
                                if (!a->cached)
                                        htopk[i] = row[k];
                                if (!ok && first_bad < 0)
                                        first_bad = (int)k;
                                if (!ok || v < 0)
                                        continue;
                                for (uint32_t j = 0; j < k && first_bad < 0; j++)
                                        if (row[j] == (int32_t)v)
                                                first_bad = (int)k;
                                atomicAdd(&sm->sel[v], 1);
                                if (epd_route_is_first_for_rank(row, k, L))
                                        atomicAdd(&sm->tok[epd_route_expert_rank((int32_t)v, L)],
                                                  1);
                        }
                        if (first_bad >= 0)
                                atomicMin(&sm->bad, (int)(t * K + (uint32_t)first_bad));
                }
                __syncthreads();
                if (sm->bad != INT_MAX && threadIdx.x == 0) {
                        int64_t v = a->cached ? htopk[sm->bad]
                                              : load_topk(a->topk_idx, a->topk_dtype, sm->bad);

                        sm->head.status = EPD_INVALID_ARGUMENT;
                        sm->head.reason = v < -1 || v >= (int64_t)E ? CX_REASON_BAD_EXPERT
                                                                    : CX_REASON_DUP_EXPERT;
                        sm->head.token = sm->bad / (int)K;
                        sm->head.pos = sm->bad % (int)K;
                        sm->head.value = v;
                }
        }
        __syncthreads();
        cx_first_stamp(o, CX_FIRST_CHECK);

        /* The count record to every rank: body, then (after a fence at the group's scope) the
         * tag, released at each reader's scope. */
        {
                /* The head but its tag (which readers are polling), in 8-byte words spread over
                 * the block, where a memcpy by one thread compiled to a byte-by-byte copy to
                 * every rank in turn. */
                const uint32_t W = (uint32_t)((sizeof(struct cx_count_rec) - 8) / 8);
                const uint64_t *head = (const uint64_t *)&sm->head + 1;
                const int ok = sm->head.status == 0;

                static_assert(sizeof(struct cx_count_rec) % 8 == 0 &&
                                      offsetof(struct cx_count_rec, tag) == 0,
                              "the record head copies as 8-byte words after its tag");
                for (uint32_t i = threadIdx.x; i < R * W; i += blockDim.x)
                        ((uint64_t *)cx_count_rec_at(g->bufs[i / W], l, o->parity, me))[1 + i % W] =
                                head[i % W];
                for (uint32_t d = 0; d < R; d++) {
                        struct cx_count_rec *rec = cx_count_rec_at(g->bufs[d], l, o->parity, me);

                        for (uint32_t i = threadIdx.x; i < R + E; i += blockDim.x)
                                cx_count_tok(rec)[i] =
                                        !ok ? 0 : i < R ? sm->tok[i] : sm->sel[i - R];
                }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
                cx_fence_group(g);
                for (uint32_t d = 0; d < R; d++)
                        cx_signal(g, d, &cx_count_rec_at(g->bufs[d], l, o->parity, me)->tag,
                                  o->tag);
        }
        cx_first_stamp(o, CX_FIRST_PUBLISH);
        {
                int r = cx_wait_all(g, l->count_recs, l->count_rec_bytes, o->parity, o->tag, &who);

                if (r) {
                        if (threadIdx.x == 0)
                                cx_status_set(&sm->st, r, r == EPD_PEER_LOST ? CX_REASON_ABORT
                                                                             : CX_REASON_TIMEOUT,
                                              who);
                        __syncthreads();
                        return r;
                }
        }
        cx_first_stamp(o, CX_FIRST_WAIT);

        /* Every thread reads the records once, after the acquires above (ordered before these
         * loads by cx_wait_all's bar.sync), so that the serial reads of thread 0 below hit this
         * SM's L1 instead of waiting on L2 one after another. */
        {
                const uint8_t *recs =
                        own + l->count_recs + (uint64_t)o->parity * R * l->count_rec_bytes;

                for (uint64_t i = threadIdx.x * 128u; i < R * l->count_rec_bytes;
                     i += blockDim.x * 128u)
                        epd_touch_l1(recs + i);
        }
        /* The verdict, the same on every rank; each destination's rows counted by its own
         * thread (the verdict's cx_rows_needed). */
        {
                const struct cx_count_rec *r0 = cx_count_rec_at(own, l, o->parity, 0);

                for (uint32_t d = threadIdx.x; d < R; d += blockDim.x)
                        sm->need[d] = cx_rows_needed(own, l, o->parity, d, r0->sig[0] >> 2 & 1u,
                                                     r0->sig[1], r0->sig[2],
                                                     &sm->short_expert[d]);
        }
        __syncthreads();
        if (threadIdx.x == 0)
                cx_dispatch_verdict(own, l, o->parity, sm->need, sm->short_expert, &sm->st);
        __syncthreads();
        cx_first_stamp(o, CX_FIRST_VERDICT);
        if (sm->st.status)
                return sm->st.status;

        /* Where this rank's rows start: per destination (NON_EXPAND) or per expert (EXPAND). */
        if (a->layout == EPD_LAYOUT_NON_EXPAND) {
                for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                        int32_t base = 0;

                        for (uint32_t s = 0; s < me; s++)
                                base += cx_count_tok(cx_count_rec_at(own, l, o->parity, s))[d];
                        sm->tok[d] = base;
                }
        } else {
                for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
                        int32_t cnt = 0, pre = 0;

                        for (uint32_t s = 0; s < R; s++) {
                                struct cx_count_rec *rec = cx_count_rec_at(own, l, o->parity, s);
                                int32_t n = cx_count_sel(rec, l)[e];

                                cnt += n;
                                pre += s < me ? n : 0;
                        }
                        scratch[R + e] = cnt;
                        sm->sel[e] = pre;
                }
                __syncthreads();
                for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                        int32_t base = 0;

                        for (uint32_t j = 0; j < L; j++) {
                                sm->sel[d * L + j] += cx_block_base(j, C, base);
                                base += (int32_t)epd_route_align_up(
                                        (uint64_t)scratch[R + d * L + j], A);
                        }
                }
        }
        for (uint32_t i = threadIdx.x; i < N * K; i += blockDim.x)
                hrow[i] = -1;
        __syncthreads();

        /* Rows, in token order (plan.c's placement), so that each is a pure function of
         * topk_idx. NON_EXPAND: a token's row at destination d is d's base plus the tokens before
         * it that go to d, counted a tile of blockDim.x tokens at a time with one ballot per
         * destination (warp counts scanned in shared memory). EXPAND: a selection's row is its
         * expert's base plus the earlier selections of that expert: one thread per expert scans
         * the entries, a tile at a time from shared memory. */
        if (a->layout == EPD_LAYOUT_NON_EXPAND) {
                const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
                const uint32_t nw = blockDim.x >> 5;

                for (uint32_t t0 = 0; t0 < N; t0 += blockDim.x) {
                        const uint32_t t = t0 + threadIdx.x;
                        uint64_t mask = 0;

                        if (t < N)
                                for (uint32_t k = 0; k < K; k++) {
                                        int32_t v = htopk[t * K + k];

                                        if (v >= 0)
                                                mask |= 1ull << epd_route_expert_rank(v, L);
                                }
                        for (uint32_t d = 0; d < R; d++) {
                                unsigned b = __ballot_sync(0xFFFFFFFFu, (unsigned)(mask >> d & 1));

                                if (lane == 0)
                                        sm->wcnt[warp][d] = __popc(b);
                        }
                        __syncthreads();
                        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                                int32_t run = sm->tok[d];

                                for (uint32_t w = 0; w < nw; w++) {
                                        int32_t c = sm->wcnt[w][d];

                                        sm->wcnt[w][d] = run;
                                        run += c;
                                }
                                sm->tok[d] = run;
                        }
                        __syncthreads();
                        for (uint32_t d = 0; d < R; d++) {
                                unsigned b = __ballot_sync(0xFFFFFFFFu, (unsigned)(mask >> d & 1));

                                if (!(mask >> d & 1))
                                        continue;
                                for (uint32_t k = 0; k < K; k++) {
                                        int32_t v = htopk[t * K + k];

                                        if (v >= 0 && epd_route_expert_rank(v, L) == d) {
                                                hrow[t * K + k] =
                                                        sm->wcnt[warp][d] +
                                                        __popc(b & ((1u << lane) - 1u));
                                                break;
                                        }
                                }
                        }
                        if (mask)
                                atomicAdd(&sm->sent, (unsigned long long)__popcll(mask));
                        __syncthreads(); /* wcnt is rewritten by the next tile */
                }
        } else {
                for (uint32_t i0 = 0; i0 < N * K; i0 += CX_PLACE_TILE) {
                        const uint32_t n = min(CX_PLACE_TILE, N * K - i0);
                        uint32_t used = 0;

                        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
                                sm->tile[i] = htopk[i0 + i];
                                used += sm->tile[i] >= 0;
                        }
                        if (used)
                                atomicAdd(&sm->sent, (unsigned long long)used);
                        __syncthreads();
                        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
                                int32_t cur = sm->sel[e];

                                for (uint32_t i = 0; i < n; i++)
                                        if (sm->tile[i] == (int32_t)e)
                                                hrow[i0 + i] = cur++;
                                sm->sel[e] = cur;
                        }
                        __syncthreads(); /* the tile is rewritten next */
                }
        }
        cx_first_stamp(o, CX_FIRST_PLACE);
        if (a->weights)
                for (uint32_t i = threadIdx.x; i < N * K; i += blockDim.x)
                        ((float *)cx_handle_i32(own, l, handle, l->h_weights))[i] = a->weights[i];
        cx_write_counts_cols(own, l, o->parity, me, handle, A, threadIdx.x, blockDim.x);
        __syncthreads();
        if (threadIdx.x == 0) {
                struct cx_handle *h = cx_handle_at(own, l, handle);

                cx_write_counts_bases(own, l, o->parity, me, handle, C);
                h->layout = (uint32_t)a->layout;
                h->num_topk = K;
                h->num_tokens = N;
                h->has_weights = a->weights != NULL;
                h->alignment = A;
                h->block_rows = C;
                h->quantize = a->quantize ? 1u : 0u;
                h->zero_padding = a->layout == EPD_LAYOUT_EXPAND && a->zero_padding;
                if (!a->cached)
                        h->topk_dtype = (uint32_t)a->topk_dtype;
                h->tag = o->tag;
        }
        __syncthreads();
        cx_first_stamp(o, CX_FIRST_COUNTS);
        return 0;
}

/* Copies one row of scale_bytes of recv_scales: in 32-bit words when it is a whole number of them
 * (every row then starts 4-byte aligned), else byte by byte (ue8m0 rows of H/128 bytes). */
static __device__ __forceinline__ void copy_scales(struct cx_crew c, uint8_t *dst,
                                                   const uint8_t *src, uint32_t scale_bytes)
{
        if (scale_bytes % 4 == 0) {
                for (uint32_t i = c.id; i < scale_bytes / 4; i += c.size)
                        ((uint32_t *)dst)[i] = ((const uint32_t *)src)[i];
        } else {
                for (uint32_t i = c.id; i < scale_bytes; i += c.size)
                        dst[i] = src[i];
        }
}

/* Moves one token to all its rows, by crew c. src/src_scales: the token's payload (the fp8 conversion in
 * shared memory when quantizing). row_bytes is a multiple of 16 and src 16-byte aligned;
 * src_scales holds one recv_scales row of sbytes (cx_op_scale_bytes). */
static __device__ void copy_token(struct cx_crew c, const struct epd_cx_group *g,
                                  const struct epd_cxk_dispatch_args *a, const struct cx_handle *h,
                                  const int32_t *htopk, const int32_t *hrow, uint32_t t,
                                  const uint8_t *src,
                                  const uint8_t *src_scales, uint32_t row_bytes, uint32_t sbytes)
{
        const struct cx_layout *l = &g->layout;
        const uint32_t K = a->num_topk, L = l->num_local_experts;
        const int expand = a->layout == EPD_LAYOUT_EXPAND;
        const uint32_t esz = h->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        const int32_t *sel = htopk + (uint64_t)t * K;

        /* The payload: each thread holds up to CX_COPY_UNROLL 16-byte pieces of the row in
         * registers, loaded once, and stores them to every row of the token, so that its loads
         * are in flight together and the source is read once, not once per row. */
        const uint32_t n16 = row_bytes / 16;

        for (uint32_t base = 0; base < n16; base += c.size * CX_COPY_UNROLL) {
                int4 v[CX_COPY_UNROLL];

#pragma unroll
                for (uint32_t j = 0; j < CX_COPY_UNROLL; j++) {
                        uint32_t i = base + c.id + j * c.size;

                        if (i < n16)
                                v[j] = ((const int4 *)src)[i];
                }
                for (uint32_t k = 0; k < K; k++) {
                        int32_t r = hrow[(uint64_t)t * K + k];
                        int4 *dst;

                        if (r < 0)
                                continue;
                        dst = (int4 *)(g->bufs[epd_route_expert_rank(sel[k], L)] + l->recv_x +
                                       (uint64_t)r * row_bytes);
#pragma unroll
                        for (uint32_t j = 0; j < CX_COPY_UNROLL; j++) {
                                uint32_t i = base + c.id + j * c.size;

                                if (i < n16)
                                        dst[i] = v[j];
                        }
                }
        }
        for (uint32_t k = 0; k < K; k++) {
                int32_t r = hrow[(uint64_t)t * K + k];
                uint32_t d;
                uint8_t *b;

                if (r < 0)
                        continue;
                d = epd_route_expert_rank(sel[k], L);
                b = g->bufs[d];
                copy_scales(c, b + l->recv_scales + (uint64_t)r * sbytes, src_scales, sbytes);
                if (c.id == 0)
                        ((int64_t *)(b + l->recv_src))[r] =
                                epd_route_global_src(g->rank, l->shape.max_tokens, t);
                if (expand) {
                        if (c.id == 0) {
                                ((int32_t *)(b + l->recv_topk_slot))[r] = (int32_t)k;
                                if (a->weights)
                                        ((float *)(b + l->recv_weights))[r] =
                                                a->weights[(uint64_t)t * K + k];
                        }
                        continue;
                }
                for (uint32_t j = c.id; j < K; j += c.size) {
                        int on_d = sel[j] >= 0 && epd_route_expert_rank(sel[j], L) == d;
                        int64_t v = on_d ? sel[j] - (int64_t)d * L : -1;
                        uint8_t *out = b + l->recv_topk_idx + ((uint64_t)r * K + j) * esz;

                        if (esz == 8)
                                *(int64_t *)out = v;
                        else
                                *(int32_t *)out = (int32_t)v;
                        if (a->weights)
                                ((float *)(b + l->recv_weights))[(uint64_t)r * K + j] =
                                        on_d ? a->weights[(uint64_t)t * K + j] : 0.0f;
                }
        }
}

/* This rank's EXPAND padding rows after local expert j's selections. */
static __device__ void write_padding(const struct epd_cx_group *g,
                                     const struct epd_cxk_dispatch_args *a, uint32_t handle,
                                     uint32_t j, uint32_t row_bytes, uint32_t sbytes)
{
        const struct cx_layout *l = &g->layout;
        uint8_t *own = g->bufs[g->rank];
        const int32_t *per = cx_handle_i32(own, l, handle, l->h_per_expert);
        const int32_t *base = cx_handle_i32(own, l, handle, l->h_expert_base);

        for (int32_t r = base[j] + per[j]; r < base[j + 1]; r++) {
                if (threadIdx.x == 0) {
                        ((int64_t *)(own + l->recv_src))[r] = -1;
                        ((int32_t *)(own + l->recv_topk_slot))[r] = -1;
                        if (a->zero_padding && a->weights)
                                ((float *)(own + l->recv_weights))[r] = 0.0f;
                }
                if (!a->zero_padding)
                        continue;
                for (uint32_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
                        ((int4 *)(own + l->recv_x + (uint64_t)r * row_bytes))[i] =
                                make_int4(0, 0, 0, 0);
                for (uint32_t i = threadIdx.x; i < sbytes; i += blockDim.x)
                        (own + l->recv_scales)[(uint64_t)r * sbytes + i] = 0;
        }
}

/* Both parameters are __grid_constant__: the kernel takes their addresses, which would otherwise
 * make every thread copy them (about 1 KiB) to its local memory before anything else. */
__global__ void __launch_bounds__(CX_THREADS)
cx_dispatch_kernel(const __grid_constant__ struct epd_cx_group g,
                   const __grid_constant__ struct epd_cxk_dispatch_args a)
{
        extern __shared__ int4 dyn[]; /* quantizing: the token's fp8 row, then its scales row */
        __shared__ struct phase1_smem sm;
        __shared__ int s_verdict;
        const struct cx_layout *l = &g.layout;
        uint8_t *own = g.bufs[g.rank];
        struct cx_header *hdr = cx_header_of(own, l);
        const uint32_t handle = a.handle < l->shape.num_handles ? a.handle : 0;
        const uint32_t row_bytes = a.quantize ? l->shape.hidden : l->x_row_bytes;
        const uint32_t nsc = cx_op_num_scales(l, a.quantize);
        const uint32_t sbytes = cx_op_scale_bytes(l, a.quantize, a.scale_format);
        struct cx_dev_op o;
        int verdict = 0, r;

        cx_op_identity(&g, 0, &o);
        if (blockIdx.x == 0) {
                verdict = phase1(&g, &a, &o, &sm);
                if (threadIdx.x == 0) {
                        o.t[CX_PHASE_MOVE] = epd_globaltimer_ns();
                        *(volatile int32_t *)&hdr->verdict = verdict;
                }
        }
        r = cx_grid_barrier(&g, cx_barrier_key(o.epoch, o.seq, 0));
        if (r) {
                if (blockIdx.x == 0 && threadIdx.x == 0) {
                        if (!verdict)
                                cx_status_set(&sm.st, r, r == EPD_PEER_LOST ? CX_REASON_ABORT
                                                                            : CX_REASON_TIMEOUT,
                                              -1);
                        cx_op_end(&g, &o, &sm.st, 0, 0);
                }
                return;
        }
        if (threadIdx.x == 0)
                s_verdict = *(volatile int32_t *)&hdr->verdict;
        __syncthreads();
        verdict = s_verdict;
        if (verdict) {
                if (blockIdx.x == 0 && threadIdx.x == 0)
                        cx_op_end(&g, &o, &sm.st, 0, 0);
                return;
        }

        {
                const struct cx_handle *h = cx_handle_at(own, l, handle);
                const int32_t *htopk = cx_handle_i32(own, l, handle, l->h_topk);
                const int32_t *hrow = cx_handle_i32(own, l, handle, l->h_row);
                const uint64_t xs = a.x_stride ? a.x_stride : l->x_row_bytes;
                const uint64_t ss = a.scales_stride ? a.scales_stride : sbytes;
                const int ue8m0 = a.scale_format == EPD_SCALE_FORMAT_UE8M0;
                uint8_t *qrow = (uint8_t *)dyn;
                uint8_t *qscales = qrow + (a.quantize ? row_bytes : 0);

                /* Without quantizing, a crew per token (cx_crew_size): down to a warp each when
                 * there are many, so that their loads are in flight at once, where a block per
                 * token would leave most of an fp8 row's block idle. */
                const uint32_t size = cx_crew_size(a.num_tokens), crews = blockDim.x / size;

                for (uint32_t t = blockIdx.x * crews + threadIdx.x / size;
                     !a.quantize && t < a.num_tokens; t += gridDim.x * crews)
                        copy_token({ threadIdx.x % size, size }, &g, &a, h, htopk, hrow, t,
                                   (const uint8_t *)a.x + t * xs,
                                   (const uint8_t *)a.scales + t * ss, row_bytes, sbytes);
                for (uint32_t t = blockIdx.x; a.quantize && t < a.num_tokens; t += gridDim.x) {
                        const uint8_t *x = (const uint8_t *)a.x + t * xs;
                        const uint8_t *src = x;
                        const uint8_t *src_scales = (const uint8_t *)a.scales + t * ss;

                        if (a.quantize) {
                                for (uint32_t b = threadIdx.x; b < nsc; b += blockDim.x) {
                                        float s = epd_fp8_quantize_block(
                                                (const uint16_t *)x + b * CX_QUANT_BLOCK,
                                                CX_QUANT_BLOCK, qrow + b * CX_QUANT_BLOCK,
                                                (int)a.round_scale);

                                        if (ue8m0)
                                                qscales[b] = epd_ue8m0_from_pow2(s);
                                        else
                                                ((float *)qscales)[b] = s;
                                }
                                __syncthreads();
                                src = qrow;
                                src_scales = qscales;
                        }
                        copy_token({ threadIdx.x, blockDim.x }, &g, &a, h, htopk, hrow, t, src,
                                   src_scales, row_bytes, sbytes);
                        __syncthreads(); /* the shared row is rewritten by the next token */
                }
                if (a.layout == EPD_LAYOUT_EXPAND)
                        for (uint32_t j = blockIdx.x; j < l->num_local_experts; j += gridDim.x)
                                write_padding(&g, &a, handle, j, row_bytes, sbytes);
        }

        r = cx_grid_barrier(&g, cx_barrier_key(o.epoch, o.seq, 1));
        if (blockIdx.x != 0)
                return;
        if (r) {
                if (threadIdx.x == 0) {
                        cx_status_set(&sm.st, r, r == EPD_PEER_LOST ? CX_REASON_ABORT
                                                                    : CX_REASON_TIMEOUT, -1);
                        cx_op_end(&g, &o, &sm.st, 0, 0);
                }
                return;
        }
        /* Every block's rows are published (the barrier fenced at the group's scope): raise the
         * done flags, then wait for every source's rows here. */
        if (threadIdx.x == 0)
                o.t[CX_PHASE_FINISH] = epd_globaltimer_ns();
        if (threadIdx.x == 0)
                for (uint32_t d = 0; d < l->shape.world_size; d++)
                        cx_signal(&g, d, &cx_flag_at(g.bufs[d], l->done, l, o.parity, g.rank)->tag,
                                  o.tag);
        {
                int32_t who;

                r = cx_wait_all(&g, l->done, sizeof(struct cx_flag), o.parity, o.tag, &who);
                if (threadIdx.x == 0) {
                        const struct cx_handle *h = cx_handle_at(own, l, handle);
                        uint64_t rows = a.layout == EPD_LAYOUT_EXPAND ? h->num_expanded_rows
                                                                      : h->num_recv_tokens;

                        if (r)
                                cx_status_set(&sm.st, r, r == EPD_PEER_LOST ? CX_REASON_ABORT
                                                                            : CX_REASON_TIMEOUT,
                                              who);
                        cx_op_end(&g, &o, &sm.st, r ? 0 : rows,
                                  r ? 0 : sm.sent * (uint64_t)(row_bytes + sbytes));
                }
        }
}

extern "C" int epd__cx_preload_combine(void);

extern "C" int epd_cx_preload(void)
{
        struct cudaFuncAttributes attr;

        if (cudaFuncGetAttributes(&attr, cx_dispatch_kernel) != cudaSuccess)
                return EPD_INTERNAL;
        return epd__cx_preload_combine();
}

extern "C" int epd_cx_dispatch_launch(const struct epd_cx_group *g,
                                      const struct epd_cxk_dispatch_args *a, uint32_t num_blocks,
                                      cudaStream_t stream)
{
        const struct cx_layout *l = &g->layout;
        size_t dyn = 0;

        if (num_blocks < 1 || num_blocks > CX_MAX_BLOCKS || g->rank >= l->shape.world_size ||
            ((uintptr_t)a->x % 16) != 0 || (a->x_stride % 16) != 0)
                return EPD_INVALID_ARGUMENT;
        if (a->quantize) {
                dyn = l->shape.hidden + (size_t)l->shape.hidden / CX_QUANT_BLOCK * 4;
                if (dyn > 48 * 1024 &&
                    cudaFuncSetAttribute(cx_dispatch_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)dyn) != cudaSuccess)
                        return EPD_INTERNAL;
        }
        cx_dispatch_kernel<<<num_blocks, CX_THREADS, dyn, stream>>>(*g, *a);
        return cudaPeekAtLastError() == cudaSuccess ? 0 : EPD_INTERNAL;
}
