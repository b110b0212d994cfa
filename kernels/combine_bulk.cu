/* combine_bulk.cu - combine of a small op through the bulk-copy engine (SEMANTICS.md 3; the
 * arithmetic is reduce.cuh's, shared with combine.cu, so the bits are the same).
 *
 * Why. A decode combine (1024 tokens, 5.3 contributions of 14 KB each) is bound by how many
 * bytes each multiprocessor keeps in flight. The register kernel (combine.cu) holds a step's
 * loads in registers: 121 of them per thread for 8 contributions x 32 bytes per lane, 16 warps
 * per multiprocessor, and every warp waits a full load latency per step, 7 steps in a row. Here
 * the copy engine moves each contribution's chunk into shared memory (one cp.async.bulk per
 * contribution per item, issued by the lane that holds it), so the bytes in flight are bounded
 * by shared memory, and each warp keeps CB_STAGES items in flight while it adds the oldest.
 *
 * Work: item = (token, chunk of CB_CHUNK bytes of each contribution row); each warp owns a
 * contiguous run of items in token-major order, so it loads a token's workspace entries once
 * per run. Per warp, in its own slice of shared memory: CB_STAGES stages of `slots` chunks (the
 * most contributions a token can have: min(K_op, R) for NON_EXPAND, K_op for EXPAND), a
 * transaction barrier per stage, and the stage's item (cb_meta). Issue item -> stage: lane 0
 * writes the item, each contributing lane its row and weight in slot order (ascending top-k
 * position, the order of SEMANTICS.md's sum), lane 0 announces the bytes on the stage's
 * barrier, then each contributing lane starts its copy. Consume: every lane waits for the
 * stage's phase, adds its 16-byte vectors of every slot in order, then the biases (global
 * loads) and stores the rounded result. An item whose rows are not 16-byte aligned, or with
 * more contributions than slots (a client rewrote its workspace), is reduced at issue by
 * combine_scalar from global memory and its stage carries nothing.
 *
 * Memory ordering. Inputs (the handle's workspace, y, biases) are written before the launch and
 * ordered by the stream or events: read-only for the kernel, through the generic proxy (the
 * workspace, biases) or the async proxy (the bulk copies of y). Inside a warp: a stage's cb_meta
 * is written by the issuing lanes before a __syncwarp() and read after the stage's barrier wait,
 * which follows at least that __syncwarp(); the chunk bytes are written by the copy engine and
 * read after the barrier phase completes (mbarrier try_wait: acquire at CTA scope, every lane
 * waits itself). A stage is reissued only after every lane has added its values (the values are
 * consumed into the stored result before the __syncwarp() that precedes the reissue), then
 * bulk_fence_proxy orders those generic reads before the async writes. Warps share nothing, so
 * there is no block barrier. Each output element has one writer.
 */
#include <stdint.h>

#include "bulk.cuh"
#include "reduce.cuh"

#ifndef CB_WARPS
#define CB_WARPS 4 /* warps per block */
#endif
#ifndef CB_CHUNK
#define CB_CHUNK 1024 /* bytes of one contribution row per item (512 hidden values) */
#endif
#ifndef CB_STAGES
#define CB_STAGES 2 /* items in flight per warp */
#endif
static_assert(CB_CHUNK % 512 == 0, "a chunk is whole 16-byte vectors of every lane");
#define CB_VPL (CB_CHUNK / 16 / 32) /* 16-byte vectors per lane per contribution */

/* A staged item. */
struct cb_meta {
        const uint8_t *bias0, *bias1;
        uint8_t *out;
        float w[EPD_K_BULK_SLOTS]; /* the contributions' weights, in slot order */
        uint32_t n;            /* contributions in the stage; UINT32_MAX: nothing to add */
        uint32_t h0, h1;       /* the item's hidden values */
        uint32_t reserved;
};

/* Shared memory of one warp: chunk data, then barriers, then items. One definition for the
 * launcher and the kernel. */
static __host__ __device__ __forceinline__ uint32_t cb_data_bytes(uint32_t slots)
{
        return CB_STAGES * slots * CB_CHUNK;
}
static __host__ __device__ __forceinline__ uint32_t cb_warp_bytes(uint32_t slots)
{
        const uint32_t b = cb_data_bytes(slots) + CB_STAGES * 8 +
                           CB_STAGES * (uint32_t)sizeof(struct cb_meta);
        return (b + 127) / 128 * 128;
}

static __global__ void __launch_bounds__(CB_WARPS * 32)
        combine_bulk_kernel(const __grid_constant__ struct epd_k_combine_args a,
                            const __grid_constant__ struct epd_ws_layout l, uint32_t slots,
                            uint32_t chunks,
                            const __grid_constant__ struct epd__k_inline<struct epd_k_combine_rank> in)
{
        extern __shared__ __align__(128) uint8_t cb_smem[];
        const uint32_t lane = threadIdx.x % 32, wb = threadIdx.x / 32;
        const uint32_t below = (1u << lane) - 1;
        uint8_t *data = cb_smem + (uint64_t)wb * cb_warp_bytes(slots);
        uint64_t *bars = (uint64_t *)(data + cb_data_bytes(slots));
        struct cb_meta *meta = (struct cb_meta *)(bars + CB_STAGES);
        const uint64_t gw = (uint64_t)blockIdx.x * CB_WARPS + wb;
        const uint64_t nw = (uint64_t)gridDim.x * CB_WARPS;
        const uint64_t items = (uint64_t)a.local_tokens * chunks;
        const uint64_t i0 = items * gw / nw, i1 = items * (gw + 1) / nw;
        const uint32_t cv = CB_CHUNK / 2; /* hidden values per chunk */
        const struct epd_k_combine_rank *ranks = epd__k_ranks(in, a.ranks);
        const struct epd_k_local *local = epd__k_locals(in, a.local);
        const uint64_t policy = bulk_policy_evict_first();

        if (i0 >= i1) /* warp-uniform */
                return;
        if (lane == 0)
                for (uint32_t st = 0; st < CB_STAGES; st++)
                        bulk_bar_init(&bars[st], 1);
        __syncwarp();

        uint32_t ig = UINT32_MAX; /* the token whose entries ct holds */
        struct comb_token ct = {};
        /* Issue item `it` into stage st (whole warp). */
        auto issue = [&](uint64_t it, uint32_t st) {
                const uint32_t g = (uint32_t)(it / chunks), c = (uint32_t)(it % chunks);
                if (g != ig) { /* warp-uniform */
                        ct = comb_token_load(a, l, ranks, local, g, c == 0, lane);
                        ig = g;
                }
                const uint32_t h0 = c * cv, h1 = min(a.hidden, h0 + cv);
                const uint32_t n = __popc(ct.mask);
                const int staged = ct.out != NULL && (ct.align_bits & 15) == 0 && n <= slots;
                struct cb_meta *m = &meta[st];
                if (staged && ct.my_row != NULL)
                        m->w[__popc(ct.mask & below)] = ct.weight;
                if (lane == 0) {
                        m->bias0 = ct.bias0;
                        m->bias1 = ct.bias1;
                        m->out = ct.out;
                        m->n = staged ? n : UINT32_MAX;
                        m->h0 = h0;
                        m->h1 = h1;
                        bulk_bar_arrive_expect(&bars[st], staged ? n * (h1 - h0) * 2 : 0);
                }
                __syncwarp();
                if (staged && ct.my_row != NULL)
                        bulk_load(data + ((uint64_t)st * slots + __popc(ct.mask & below)) *
                                                 CB_CHUNK,
                                  ct.my_row + (uint64_t)h0 * 2, (h1 - h0) * 2, &bars[st],
                                  policy);
                else if (!staged && ct.out != NULL)
                        combine_scalar(ct.my_row, ct.mask, ct.weight, a.apply_weights, ct.bias0,
                                       ct.bias1, ct.out, h0, h1, lane);
        };

        for (uint32_t p = 0; p < CB_STAGES && i0 + p < i1; p++)
                issue(i0 + p, p);
        uint32_t parity = 0;
        for (uint64_t it = i0; it < i1; it++) {
                const uint32_t st = (uint32_t)((it - i0) % CB_STAGES);
                bulk_bar_wait(&bars[st], (parity >> st) & 1);
                parity ^= 1u << st;
                const struct cb_meta *m = &meta[st];
                const uint32_t n = m->n;
                if (n != UINT32_MAX) {
                        const uint32_t v0 = m->h0 / 8, nv = (m->h1 - m->h0) / 8;
                        const int4 *chunk = (const int4 *)(data + (uint64_t)st * slots * CB_CHUNK);
#pragma unroll
                        for (uint32_t u = 0; u < CB_VPL; u++) {
                                const uint32_t i = u * 32 + lane;
                                if (i >= nv)
                                        continue;
                                float acc[8];
#pragma unroll
                                for (int x = 0; x < 8; x++)
                                        acc[x] = 0.0f;
                                for (uint32_t r = 0; r < n; r++)
                                        add_vec(acc, chunk[r * (CB_CHUNK / 16) + i],
                                                a.apply_weights, m->w[r]);
                                if (m->bias0 != NULL)
                                        add_vec(acc, comb_ld<true>((const int4 *)m->bias0 + v0 + i),
                                                0, 0.0f);
                                if (m->bias1 != NULL)
                                        add_vec(acc, comb_ld<true>((const int4 *)m->bias1 + v0 + i),
                                                0, 0.0f);
                                ((int4 *)m->out)[v0 + i] = pack_vec(acc);
                        }
                }
                __syncwarp();
                bulk_fence_proxy();
                if (it + CB_STAGES < i1)
                        issue(it + CB_STAGES, st);
        }
}

int epd__k_combine_bulk_describe(const struct epd_k_combine_args *args,
                                 const struct epd_ws_layout *l, struct epd__k_combine_bulk *g,
                                 struct epd__k_launch *d)
{
        const uint32_t K = args->num_topk;
        const uint32_t slots = args->layout == EPD_LAYOUT_NON_EXPAND && args->world_size < K
                                       ? args->world_size
                                       : K;
        const void *kernel = (const void *)combine_bulk_kernel;
        int blocks, ret;

        if (slots > EPD_K_BULK_SLOTS || slots == 0)
                return 1;
        g->slots = slots;
        g->chunks = (uint32_t)(((uint64_t)args->hidden * 2 + CB_CHUNK - 1) / CB_CHUNK);
        const size_t smem = (size_t)CB_WARPS * cb_warp_bytes(slots);
        ret = epd__k_dynamic_smem(kernel, smem);
        if (ret == EPD_INVALID_ARGUMENT)
                return 1;
        if (ret < 0)
                return ret;
        const uint64_t items = (uint64_t)args->local_tokens * g->chunks;
        ret = epd__k_grid_blocks(kernel, CB_WARPS * 32, smem, (items + CB_WARPS - 1) / CB_WARPS,
                                 &blocks);
        if (ret < 0)
                return ret;
        *d = (struct epd__k_launch){};
        d->func = kernel;
        d->grid = dim3((unsigned)blocks);
        d->block = dim3(CB_WARPS * 32);
        d->smem = smem;
        d->params[0] = args;
        d->params[1] = l;
        d->params[2] = &g->slots;
        d->params[3] = &g->chunks;
        epd__k_inline_fill(&g->in, args);
        d->params[4] = &g->in;
        return 0;
}

int epd__k_preload_combine_bulk(void)
{
        struct cudaFuncAttributes attr;
        return epd__k_cuda_status(cudaFuncGetAttributes(&attr, combine_bulk_kernel));
}
