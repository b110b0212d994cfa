/* cx_combine.cu - the client-executed combine: one kernel per rank, the protocol of cpu/cx.c.
 *
 * 1. Block 0: admit the op; publish this rank's y record (its y, written by earlier work on the
 *    stream, becomes readable by every peer); wait for every rank's; the verdict
 *    (cx_combine_verdict).
 * 2. Every block: a token per block at a time, its contributions pulled from the peers' y areas and
 * reduced in fp32 in top-k order, biases last, one rounding to bf16 (docs/semantics.md section 3;
  * no FMA: cmake/EpdCuda.cmake builds with --fmad=false), and combined_topk_weights. 3. Block 0:
  * acknowledge every peer's y, wait for every peer's ack of this rank's y (so y may be rewritten
  * after the kernel), record the end.
 */
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cx_layout.h"
#include "cx_op.cuh"
#include "cx_sync.cuh"
#include "epd_cx.h"
#include "routing.h"

#define CX_THREADS 512
#define CX_COMBINE_BATCH 8

/* Thread 0: this rank's checks of its own arguments (cpu/cx.c check_combine). */
static __device__ int32_t check_args(const struct epd_cx_group *g,
                                     const struct epd_cxk_combine_args *a, uint64_t epoch)
{
        const struct cx_layout *l = &g->layout;
        const struct cx_handle *h;

        if (a->handle >= l->shape.num_handles)
                return EPD_INVALID_ARGUMENT;
        h = cx_handle_at(g->bufs[g->rank], l, a->handle);
        if (h->tag == 0 || h->tag >> CX_OP_BITS != epoch)
                return EPD_INVALID_ARGUMENT;
        if (a->apply_weights && (h->layout != EPD_LAYOUT_EXPAND ||
                                 (!a->source_weights && !h->has_weights)))
                return EPD_INVALID_ARGUMENT;
        if (a->recv_weights && h->layout != EPD_LAYOUT_NON_EXPAND)
                return EPD_INVALID_ARGUMENT;
        if (h->num_tokens && !a->combined)
                return EPD_INVALID_ARGUMENT;
        return 0;
}

/* Block 0: admit, exchange y records, verdict. Returns the status; st describes it. */
static __device__ int phase1(const struct epd_cx_group *g, const struct epd_cxk_combine_args *a,
                             struct cx_dev_op *o, struct cx_op_status *st)
{
        __shared__ int s_status;
        const struct cx_layout *l = &g->layout;
        const uint32_t R = l->shape.world_size, me = g->rank;
        int32_t who;
        int r;

        if (threadIdx.x == 0)
                s_status = cx_op_admit(g, o, st);
        __syncthreads();
        if (s_status)
                return s_status;
        if (threadIdx.x == 0) {
                int32_t local = check_args(g, a, o->epoch);

                /* The y record's body, then (after a fence at the group's scope, which also
                 * publishes y as earlier kernels on this stream wrote it) its tag. */
                for (uint32_t d = 0; d < R; d++) {
                        struct cx_flag *f = cx_flag_at(g->bufs[d], l->yrec, l, o->parity, me);

                        cx_combine_sig(f->sig, a->handle, a->apply_weights ? 1u : 0u,
                                       a->recv_weights ? 1u : 0u);
                        f->status = local;
                        f->reason = local ? CX_REASON_BAD_ARGS : CX_REASON_NONE;
                        f->value = me;
                }
                cx_fence_group(g);
                for (uint32_t d = 0; d < R; d++)
                        cx_signal(g, d, &cx_flag_at(g->bufs[d], l->yrec, l, o->parity, me)->tag,
                                  o->tag);
        }
        r = cx_wait_all(g, l->yrec, sizeof(struct cx_flag), o->parity, o->tag, &who);
        if (threadIdx.x == 0) {
                if (r)
                        cx_status_set(st, r,
                                      r == EPD_PEER_LOST ? CX_REASON_ABORT : CX_REASON_TIMEOUT,
                                      who);
                else
                        cx_combine_verdict(g->bufs[me], l, o->parity, st);
                s_status = st->status;
        }
        __syncthreads();
        return s_status;
}

/* One source token's combined row, 8 channels (16 bytes) per thread: the contributions of up
 * to CX_COMBINE_BATCH top-k entries are loaded together (their loads in flight at once), then
 * added in top-k order, so each channel's sum is the one combine_token computes one channel at a
 * time: the same fp32 operations in the same order. w: the token's K weights, or NULL. Needs H a
 * multiple of 8 and 16-byte aligned y rows, output and biases (combine_vec8_ok). */
static __device__ void combine_token_vec8(struct cx_crew cr, const struct epd_cx_group *g,
                                          const struct epd_cxk_combine_args *a,
                                          const int32_t *sel, const int32_t *rows,
                                          const float *w, uint32_t K, uint32_t t)
{
        const struct cx_layout *l = &g->layout;
        const uint32_t L = l->num_local_experts, H8 = l->shape.hidden / 8;

        for (uint32_t c8 = cr.id; c8 < H8; c8 += cr.size) {
                float acc[8];

#pragma unroll
                for (int i = 0; i < 8; i++)
                        acc[i] = +0.0f;
                for (uint32_t k0 = 0; k0 < K; k0 += CX_COMBINE_BATCH) {
                        int4 q[CX_COMBINE_BATCH];

#pragma unroll
                        for (uint32_t j = 0; j < CX_COMBINE_BATCH; j++) {
                                uint32_t k = k0 + j;

                                if (k < K && rows[k] >= 0)
                                        q[j] = ((const int4 *)(g->bufs[epd_route_expert_rank(
                                                                       sel[k], L)] +
                                                               l->y))[(uint64_t)rows[k] * H8 + c8];
                        }
#pragma unroll
                        for (uint32_t j = 0; j < CX_COMBINE_BATCH; j++) {
                                uint32_t k = k0 + j;
                                const __nv_bfloat16 *e = (const __nv_bfloat16 *)&q[j];

                                if (k >= K || rows[k] < 0)
                                        continue;
#pragma unroll
                                for (int i = 0; i < 8; i++) {
                                        float v = __bfloat162float(e[i]);

                                        if (w)
                                                v = __fmul_rn(v, w[k]);
                                        acc[i] = __fadd_rn(acc[i], v);
                                }
                        }
                }
                for (int b = 0; b < 2; b++) {
                        const int4 *bias = (const int4 *)a->bias[b];
                        int4 q;
                        const __nv_bfloat16 *e = (const __nv_bfloat16 *)&q;

                        if (!bias)
                                continue;
                        q = bias[(uint64_t)t * H8 + c8];
#pragma unroll
                        for (int i = 0; i < 8; i++)
                                acc[i] = __fadd_rn(acc[i], __bfloat162float(e[i]));
                }
                {
                        int4 out;
                        __nv_bfloat16 *o = (__nv_bfloat16 *)&out;

#pragma unroll
                        for (int i = 0; i < 8; i++)
                                o[i] = __float2bfloat16_rn(acc[i]);
                        ((int4 *)a->combined)[(uint64_t)t * H8 + c8] = out;
                }
        }
}

/* Whether combine_token_vec8 may serve this op: H a multiple of 8, every rank's y area, the
 * output and the biases 16-byte aligned. */
static __device__ int combine_vec8_ok(const struct epd_cx_group *g,
                                      const struct epd_cxk_combine_args *a)
{
        const struct cx_layout *l = &g->layout;

        if (l->shape.hidden % 8 != 0 || (uintptr_t)a->combined % 16 != 0 ||
            (uintptr_t)a->bias[0] % 16 != 0 || (uintptr_t)a->bias[1] % 16 != 0)
                return 0;
        for (uint32_t d = 0; d < l->shape.world_size; d++)
                if ((uintptr_t)(g->bufs[d] + l->y) % 16 != 0)
                        return 0;
        return 1;
}

/* One source token: its contributions in top-k order, reduced as docs/semantics.md section 3
 * says. */
static __device__ void combine_token(struct cx_crew cr, const struct epd_cx_group *g,
                                     const struct epd_cxk_combine_args *a,
                                     const struct cx_handle *h, const int32_t *htopk,
                                     const int32_t *hrow, const float *hw, uint32_t t, int vec8)
{
        const struct cx_layout *l = &g->layout;
        const uint32_t K = h->num_topk, L = l->num_local_experts, H = l->shape.hidden;
        const int32_t *sel = htopk + (uint64_t)t * K, *rows = hrow + (uint64_t)t * K;
        const float *w = a->source_weights ? a->source_weights : h->has_weights ? hw : NULL;
        const int weighted = a->apply_weights && w;

        if (vec8)
                combine_token_vec8(cr, g, a, sel, rows, weighted ? w + (uint64_t)t * K : NULL, K, t);
        for (uint32_t c = cr.id; c < H && !vec8; c += cr.size) {
                float acc = +0.0f;

                for (uint32_t k = 0; k < K; k++) {
                        const __nv_bfloat16 *y;
                        float v;

                        if (rows[k] < 0)
                                continue;
                        y = (const __nv_bfloat16 *)(g->bufs[epd_route_expert_rank(sel[k], L)] +
                                                    l->y);
                        v = __bfloat162float(y[(uint64_t)rows[k] * H + c]);
                        if (weighted)
                                v = __fmul_rn(v, w[(uint64_t)t * K + k]);
                        acc = __fadd_rn(acc, v);
                }
                for (int b = 0; b < 2; b++) {
                        const __nv_bfloat16 *bias = (const __nv_bfloat16 *)a->bias[b];

                        if (bias)
                                acc = __fadd_rn(acc, __bfloat162float(bias[(uint64_t)t * H + c]));
                }
                ((__nv_bfloat16 *)a->combined)[(uint64_t)t * H + c] = __float2bfloat16_rn(acc);
        }
        if (!a->combined_topk_weights)
                return;
        for (uint32_t k = cr.id; k < K; k += cr.size) {
                float out = 0.0f;

                if (a->recv_weights) {
                        /* For every k: the sum over the destinations token t went to, ascending,
                         * of that destination's weight row of t. */
                        out = +0.0f;
                        for (uint32_t d = 0; d < l->shape.world_size; d++) {
                                const float *yw = (const float *)(g->bufs[d] + l->y_weights);

                                for (uint32_t j = 0; j < K; j++) {
                                        if (rows[j] >= 0 && epd_route_expert_rank(sel[j], L) == d) {
                                                out = __fadd_rn(out, yw[(uint64_t)rows[j] * K + k]);
                                                break;
                                        }
                                }
                        }
                } else if (h->has_weights) {
                        out = sel[k] >= 0 ? hw[(uint64_t)t * K + k] : 0.0f;
                } else {
                        continue;
                }
                a->combined_topk_weights[(uint64_t)t * K + k] = out;
        }
}

/* __grid_constant__ parameters, as cx_dispatch_kernel's: no per-thread copy. */
__global__ void __launch_bounds__(CX_THREADS)
cx_combine_kernel(const __grid_constant__ struct epd_cx_group g,
                  const __grid_constant__ struct epd_cxk_combine_args a)
{
        __shared__ struct cx_op_status st;
        __shared__ int s_verdict;
        const struct cx_layout *l = &g.layout;
        uint8_t *own = g.bufs[g.rank];
        struct cx_header *hdr = cx_header_of(own, l);
        const uint32_t handle = a.handle < l->shape.num_handles ? a.handle : 0;
        struct cx_dev_op o;
        int32_t who;
        int r;

        cx_op_identity(&g, 1, &o);
        if (blockIdx.x == 0) {
                r = phase1(&g, &a, &o, &st);
                if (threadIdx.x == 0) {
                        o.t[CX_PHASE_MOVE] = epd_globaltimer_ns();
                        *(volatile int32_t *)&hdr->verdict = r;
                }
        }
        r = cx_grid_barrier(&g, cx_barrier_key(o.epoch, o.seq, 0));
        if (threadIdx.x == 0)
                s_verdict = r ? r : *(volatile int32_t *)&hdr->verdict;
        __syncthreads();
        if (s_verdict) {
                if (blockIdx.x == 0 && threadIdx.x == 0) {
                        if (r)
                                cx_status_set(&st, r, r == EPD_PEER_LOST ? CX_REASON_ABORT
                                                                         : CX_REASON_TIMEOUT, -1);
                        cx_op_end(&g, &o, &st, 0, 0);
                }
                return;
        }

        {
                const struct cx_handle *h = cx_handle_at(own, l, handle);
                const int32_t *htopk = cx_handle_i32(own, l, handle, l->h_topk);
                const int32_t *hrow = cx_handle_i32(own, l, handle, l->h_row);
                const float *hw = (const float *)cx_handle_i32(own, l, handle, l->h_weights);

                const int vec8 = combine_vec8_ok(&g, &a);

                const uint32_t size = cx_crew_size(h->num_tokens), crews = blockDim.x / size;

                /* A crew per token (cx_crew_size): a whole block for a few tokens, down to a
                 * warp each for many, with no block-wide step between tokens. */
                for (uint32_t t = blockIdx.x * crews + threadIdx.x / size; t < h->num_tokens;
                     t += gridDim.x * crews)
                        combine_token({ threadIdx.x % size, size }, &g, &a, h, htopk, hrow, hw,
                                      t, vec8);
        }

        /* Every block's reads of the peers' y are done (the barrier orders them before block 0
         * goes on; a release orders earlier loads as well as stores): acknowledge. */
        r = cx_grid_barrier(&g, cx_barrier_key(o.epoch, o.seq, 1));
        if (blockIdx.x != 0)
                return;
        if (threadIdx.x == 0)
                o.t[CX_PHASE_FINISH] = epd_globaltimer_ns();
        if (!r) {
                if (threadIdx.x == 0)
                        for (uint32_t d = 0; d < l->shape.world_size; d++)
                                cx_signal(&g, d,
                                          &cx_flag_at(g.bufs[d], l->ack, l, o.parity, g.rank)->tag,
                                          o.tag);
                r = cx_wait_all(&g, l->ack, sizeof(struct cx_flag), o.parity, o.tag, &who);
        } else {
                who = -1;
        }
        if (threadIdx.x == 0) {
                if (r)
                        cx_status_set(&st, r, r == EPD_PEER_LOST ? CX_REASON_ABORT
                                                                 : CX_REASON_TIMEOUT, who);
                cx_op_end(&g, &o, &st, r ? 0 : cx_handle_at(own, l, handle)->num_tokens, 0);
        }
}

extern "C" int epd_cx_combine_launch(const struct epd_cx_group *g,
                                     const struct epd_cxk_combine_args *a, uint32_t num_blocks,
                                     cudaStream_t stream)
{
        static_assert(sizeof(struct epd_cx_group) + sizeof(struct epd_cxk_combine_args) < 4000,
                      "kernel parameters must stay within 4 KiB");

        if (num_blocks < 1 || num_blocks > CX_MAX_BLOCKS ||
            g->rank >= g->layout.shape.world_size)
                return EPD_INVALID_ARGUMENT;
        cx_combine_kernel<<<num_blocks, CX_THREADS, 0, stream>>>(*g, *a);
        return cudaPeekAtLastError() == cudaSuccess ? 0 : EPD_INTERNAL;
}

/* Part of epd_cx_preload (cx_dispatch.cu), which loads both kernels. */
extern "C" int epd__cx_preload_combine(void)
{
        struct cudaFuncAttributes attr;

        return cudaFuncGetAttributes(&attr, cx_combine_kernel) == cudaSuccess ? 0 : EPD_INTERNAL;
}
