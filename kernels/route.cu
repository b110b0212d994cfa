/* route.cu - the routing steps of a dispatch: count, prefix, recheck and place.
 *
 * These kernels compute, on the GPU, exactly what cpu/plan.c computes on the host: the same
 * counts, prefixes, expert bases and rows, in the same index order (common/layout.h), with the
 * primitives of common/routing.h. Nothing here uses atomics whose order could change a result:
 * shared-memory atomics only add integers, OR bits or take a minimum (commutative), and the
 * ordering of entries that share a key comes from explicit prefix scans over the source's own
 * tokens: inside a chunk of 256 tokens (count), then over the chunks (prefix).
 */
#include <stdint.h>

#include "internal.cuh"
#include "verdict.cuh"

#define PREFIX_THREADS 1024
#define PLACE_THREADS 256

/* ---- count ---- */

/* Which entries of a normalised topk row are keys, as a bit per top-k position. NON_EXPAND keys
 * are destination ranks, at the first position for each rank only (deduplication per token and
 * destination, docs/semantics.md §2); EXPAND keys are the experts of every valid entry. */
static __device__ __forceinline__ uint32_t row_valid_bits(const int32_t *trow, uint32_t num_topk)
{
        uint32_t bits = 0;
        for (uint32_t k = 0; k < num_topk; k++)
                if (trow[k] >= 0)
                        bits |= 1u << k;
        return bits;
}

static __device__ __forceinline__ uint32_t row_first_bits(const int32_t *trow, uint32_t valid,
                                                          uint32_t num_local_experts)
{
        uint32_t bits = 0;
        for (uint32_t m = valid; m != 0; m &= m - 1) {
                uint32_t k = __ffs(m) - 1;
                if (epd_route_is_first_for_rank(trow, k, num_local_experts))
                        bits |= 1u << k;
        }
        return bits;
}

static __device__ __forceinline__ uint32_t entry_key(int32_t expert, enum epd_layout layout,
                                                     uint32_t num_local_experts)
{
        if (layout == EPD_LAYOUT_EXPAND)
                return (uint32_t)expert;
        return epd_route_expert_rank(expert, num_local_experts);
}

/* Dynamic shared memory of the count kernel: token totals [R], selection totals [E], and per warp
 * a counter and a lane mask for each key. */
static __host__ __device__ __forceinline__ uint64_t count_smem_bytes(uint32_t world_size, uint32_t num_experts, uint32_t num_keys,
                                 uint32_t warps)
{
        return 4ull * (world_size + num_experts) + 8ull * warps * num_keys;
}

/* One chunk of EPD_WS_CHUNK_TOKENS tokens of a local source, by one whole block: item b is chunk
 * b % C of local source b / C. Every chunk's counts and error slot are written, also when the
 * chunk holds no tokens, so the prefix step never reads stale values.
 *
 * Pass A (thread per entry): validate topk_idx, write the normalised copy into the workspace and
 * count selections per expert. The chunk's first bad entry (lowest t*K_op + k) is found with an
 * atomicMin in shared memory, so the recorded error does not depend on scheduling.
 *
 * Passes B and C give every key entry its rank among the chunk's entries with the same key, in
 * token order; the prefix step adds the counts of earlier chunks (chunk_base), which makes the
 * "#{t' < t of s ...}" term of plan.h's formulas. The chunk's tokens are cut into one contiguous
 * segment per warp. B counts each warp's keys; an exclusive scan over warps turns those counts
 * into each segment's starting rank. C walks each segment in batches of 32 tokens (lane = token):
 * each lane ORs its bit into the mask of each of its keys, so the entries with the same key
 * inside the batch are the set bits of that mask and an entry's rank is the segment's running
 * counter plus the bits below its lane. The highest lane of a mask then advances the counter.
 * Each key occurs at most once per token (EXPAND: duplicates are invalid and normalised away;
 * NON_EXPAND: first position per rank only), so exactly one lane advances it.
 *
 * Memory ordering: the block writes its chunk's slices of the workspace (topk, local,
 * chunk_count, chunk_error) and reads back only what it wrote itself, after __syncthreads(),
 * which orders global memory within a block. The prefix step reads these slices after a kernel
 * boundary ordered by a CUDA event or the same stream, which makes the stores visible to it on
 * any GPU, so plain stores suffice.
 */
static __device__ __forceinline__ void epd__k_count_chunk(const struct epd_k_dispatch_args &a,
                                                          const struct epd_ws_layout &l,
                                                          uint32_t num_keys, uint32_t item)
{
        extern __shared__ int32_t smem[];
        __shared__ uint32_t first_bad;
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        const uint32_t K = a.num_topk, C = l.num_chunks, warps = blockDim.x / 32;
        const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        int32_t *tot_tok = smem;                       /* [R] */
        int32_t *tot_sel = tot_tok + R;                /* [E] */
        int32_t *wcnt = tot_sel + E;                   /* [warps][num_keys] */
        uint32_t *wmask = (uint32_t *)(wcnt + (uint64_t)warps * num_keys);

        const uint32_t s = a.local[item / C].rank, chunk = item % C;
        const struct epd_k_dispatch_rank *src = &a.ranks[s];
        int32_t *topk = epd_ws_i32(a.workspace, l.topk) + epd_ws_entry(&l, s, 0, K, 0);
        int32_t *local = epd_ws_i32(a.workspace, l.local) + epd_ws_entry(&l, s, 0, K, 0);
        /* A zero stride means packed rows, as in epd_plan_count_source. */
        const uint64_t stride = src->topk_stride != 0 ? src->topk_stride : K;

        /* A source claiming more than T tokens would overrun its workspace slice: reject it
         * as an invalid argument (reported by chunk 0) rather than trust it. */
        uint32_t n = src->num_tokens;
        const int too_many = n > a.max_tokens;
        if (too_many)
                n = 0;
        const uint32_t first_tok = min(n, chunk * EPD_WS_CHUNK_TOKENS);
        const uint32_t end_tok = min(n, first_tok + EPD_WS_CHUNK_TOKENS);

        for (uint64_t i = threadIdx.x; i < (uint64_t)R + E + 2ull * warps * num_keys;
             i += blockDim.x)
                smem[i] = 0;
        if (threadIdx.x == 0)
                first_bad = UINT32_MAX;
        __syncthreads();

        /* Pass A. */
        const uint64_t first_entry = (uint64_t)first_tok * K, end_entry = (uint64_t)end_tok * K;
        for (uint64_t idx = first_entry + threadIdx.x; idx < end_entry; idx += blockDim.x) {
                uint32_t t = (uint32_t)(idx / K), k = (uint32_t)(idx % K);
                uint64_t row0 = (uint64_t)t * stride;
                int64_t v = epd__k_load_topk(src->topk_idx, a.topk_dtype, row0 + k);
                int32_t norm = -1;

                if (v >= 0 && v < (int64_t)E) {
                        norm = (int32_t)v;
                        for (uint32_t j = 0; j < k; j++) {
                                if (epd__k_load_topk(src->topk_idx, a.topk_dtype, row0 + j) ==
                                    v) {
                                        norm = -1;
                                        atomicMin(&first_bad, (uint32_t)idx);
                                        break;
                                }
                        }
                        if (norm >= 0)
                                atomicAdd(&tot_sel[norm], 1);
                } else if (v != -1) {
                        atomicMin(&first_bad, (uint32_t)idx);
                }
                topk[idx] = norm;
        }
        __syncthreads();

        /* Pass B. */
        const uint32_t seg = (end_tok - first_tok + warps - 1) / warps;
        const uint32_t begin = min(end_tok, first_tok + warp * seg);
        const uint32_t end = min(end_tok, begin + seg);
        int32_t *my_cnt = wcnt + (uint64_t)warp * num_keys;
        uint32_t *my_mask = wmask + (uint64_t)warp * num_keys;

        for (uint32_t t = begin + lane; t < end; t += 32) {
                const int32_t *trow = topk + (uint64_t)t * K;
                uint32_t valid = row_valid_bits(trow, K);
                uint32_t first = row_first_bits(trow, valid, L);
                uint32_t keys = a.layout == EPD_LAYOUT_EXPAND ? valid : first;

                for (uint32_t m = first; m != 0; m &= m - 1)
                        atomicAdd(&tot_tok[epd_route_expert_rank(trow[__ffs(m) - 1], L)], 1);
                for (uint32_t m = keys; m != 0; m &= m - 1)
                        atomicAdd(&my_cnt[entry_key(trow[__ffs(m) - 1], a.layout, L)], 1);
        }
        __syncthreads();

        for (uint32_t key = threadIdx.x; key < num_keys; key += blockDim.x) {
                int32_t run = 0;
                for (uint32_t w = 0; w < warps; w++) {
                        int32_t c = wcnt[(uint64_t)w * num_keys + key];
                        wcnt[(uint64_t)w * num_keys + key] = run;
                        run += c;
                }
        }
        int32_t *counts = epd_ws_i32(a.workspace, l.chunk_count) +
                          ((uint64_t)s * C + chunk) * (R + E);
        for (uint32_t i = threadIdx.x; i < R + E; i += blockDim.x)
                counts[i] = smem[i]; /* tot_tok then tot_sel, adjacent in smem as in memory */
        if (threadIdx.x == 0)
                write_chunk_error(&a, &l, s, chunk, too_many && chunk == 0, first_bad);
        __syncthreads();

        /* Pass C. The loop bounds are warp-uniform, so every lane reaches every __syncwarp. */
        const uint32_t lane_below = (1u << lane) - 1;
        for (uint32_t b = begin; b < end; b += 32) {
                const uint32_t t = b + lane;
                const int32_t *trow = topk + (uint64_t)t * K;
                uint32_t keys = 0, last = 0;

                if (t < end) {
                        uint32_t valid = row_valid_bits(trow, K);
                        keys = a.layout == EPD_LAYOUT_EXPAND ? valid
                                                             : row_first_bits(trow, valid, L);
                }
                for (uint32_t m = keys; m != 0; m &= m - 1)
                        atomicOr(&my_mask[entry_key(trow[__ffs(m) - 1], a.layout, L)],
                                 1u << lane);
                __syncwarp();
                if (t < end) {
                        for (uint32_t k = 0; k < K; k++) {
                                int32_t rank = -1;
                                if (keys & (1u << k)) {
                                        uint32_t key = entry_key(trow[k], a.layout, L);
                                        uint32_t mask = my_mask[key];
                                        rank = my_cnt[key] + __popc(mask & lane_below);
                                        if ((mask >> lane) == 1u)
                                                last |= 1u << k;
                                }
                                local[(uint64_t)t * K + k] = rank;
                        }
                }
                __syncwarp();
                for (uint32_t m = last; m != 0; m &= m - 1) {
                        uint32_t key = entry_key(trow[__ffs(m) - 1], a.layout, L);
                        my_cnt[key] += __popc(my_mask[key]);
                        my_mask[key] = 0;
                }
                __syncwarp();
        }
}

/* One block for the whole group (every loop strides by blockDim.x). Reads every chunk's counts and error slot; writes the per-source
 * totals (tok_count, sel_count), the chunk bases, the reply block (prefixes, expert counts and
 * bases), expert_src_prefix and the verdict. Its work grows as R * C * (R + E) + R * (R + E)
 * loads spread over 1024 threads: tens of microseconds for a node-sized group.
 *
 * Memory ordering: the counts were written by count steps on possibly several GPUs; the host
 * orders this step after all of them with events, and a kernel boundary publishes their stores
 * to every later kernel ordered after it, so plain loads are correct. Inside the block, phases
 * that read what other threads wrote are separated by __syncthreads(), which orders global
 * memory among the block's threads. */
static __device__ __forceinline__ void epd__k_prefix_block(const struct epd_k_dispatch_args &a,
                                                           const struct epd_ws_layout &l)
{
        __shared__ uint32_t first_bad_chunk, num_short, first_short;
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        const uint32_t C = l.num_chunks;
        const int32_t *chunk_count = epd_ws_i32(a.workspace, l.chunk_count);
        int32_t *chunk_base = epd_ws_i32(a.workspace, l.chunk_base);
        int32_t *tok_count = epd_ws_i32(a.workspace, l.tok_count);
        int32_t *sel_count = epd_ws_i32(a.workspace, l.sel_count);
        int32_t *rank_prefix = epd_ws_i32(a.workspace, l.rank_prefix);
        int32_t *expert_count = epd_ws_i32(a.workspace, l.expert_count);
        int32_t *expert_aligned = epd_ws_i32(a.workspace, l.expert_aligned);
        int32_t *expert_base = epd_ws_i32(a.workspace, l.expert_base);
        int32_t *src_prefix = epd_ws_i32(a.workspace, l.expert_src_prefix);
        const struct epd_ws_src_error *chunk_err = epd_ws_chunk_errors(a.workspace, &l);

        if (threadIdx.x == 0) {
                first_bad_chunk = UINT32_MAX;
                num_short = 0;
                first_short = UINT32_MAX;
        }
        __syncthreads();

        /* Chunks are numbered s * C + c, so the lowest bad chunk holds the lowest source's
         * first bad entry. */
        for (uint32_t i = threadIdx.x; i < R * C; i += blockDim.x)
                if (chunk_err[i].reason != EPD_WS_REASON_NONE)
                        atomicMin(&first_bad_chunk, i);

        /* Per (source, key): sum the chunks into the source's totals, and for the layout's key
         * space record each chunk's exclusive prefix (its chunk base). Keys [0, R) are
         * destinations, [R, R + E) experts. */
        const uint32_t keys = R + E;
        const uint32_t base_lo = a.layout == EPD_LAYOUT_EXPAND ? R : 0;
        const uint32_t base_hi = a.layout == EPD_LAYOUT_EXPAND ? R + E : R;
        for (uint64_t i = threadIdx.x; i < (uint64_t)R * keys; i += blockDim.x) {
                uint32_t s = (uint32_t)(i / keys), key = (uint32_t)(i % keys);
                const int32_t *cc = chunk_count + (uint64_t)s * C * keys + key;
                int32_t run = 0;
                if (key >= base_lo && key < base_hi) {
                        int32_t *cb = chunk_base + (uint64_t)s * C * E + (key - base_lo);
                        for (uint32_t c = 0; c < C; c++) {
                                cb[(uint64_t)c * E] = run;
                                run += cc[(uint64_t)c * keys];
                        }
                } else {
                        for (uint32_t c = 0; c < C; c++)
                                run += cc[(uint64_t)c * keys];
                }
                if (key < R)
                        tok_count[(uint64_t)s * R + key] = run;
                else
                        sel_count[(uint64_t)s * E + (key - R)] = run;
        }
        __syncthreads();

        /* rank_prefix[d][s] = sum over s' < s of tok_count[s'][d]. */
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                int32_t run = 0;
                for (uint32_t s = 0; s < R; s++) {
                        rank_prefix[(uint64_t)d * (R + 1) + s] = run;
                        run += tok_count[(uint64_t)s * R + d];
                }
                rank_prefix[(uint64_t)d * (R + 1) + R] = run;
        }
        /* expert_src_prefix[e][s] = sum over s' < s of sel_count[s'][e]; the total is the
         * expert's count at its rank (expert e is rank e / L's local expert e % L, so the flat
         * [R][L] index of expert_count is e itself). */
        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
                int32_t run = 0;
                for (uint32_t s = 0; s < R; s++) {
                        src_prefix[(uint64_t)e * R + s] = run;
                        run += sel_count[(uint64_t)s * E + e];
                }
                expert_count[e] = run;
        }
        __syncthreads();

        /* expert_base[d][l] = sum over l' < l of align_up(count, alignment). */
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                int32_t run = 0;
                for (uint32_t le = 0; le < L; le++) {
                        uint64_t i = (uint64_t)d * L + le;
                        int32_t aligned =
                                (int32_t)epd_route_align_up(expert_count[i], a.expert_alignment);
                        expert_aligned[i] = aligned;
                        expert_base[(uint64_t)d * (L + 1) + le] = run;
                        run += aligned;
                }
                expert_base[(uint64_t)d * (L + 1) + L] = run;
        }
        __syncthreads();

        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x)
                check_capacity(&a, &l, d, &num_short, &first_short);
        __syncthreads();
        if (threadIdx.x == 0) {
                uint32_t bad_src = first_bad_chunk == UINT32_MAX ? UINT32_MAX
                                                                 : first_bad_chunk / C;
                write_verdict(&a, &l, bad_src, first_bad_chunk, num_short, first_short);
        }
}

/* Cached dispatch: the routing is the handle's, the outputs and their capacities are new. Same
 * ordering argument as the prefix kernel; it reads only the reply block that the handle's own
 * prefix step wrote, long before. */
static __device__ __forceinline__ void epd__k_recheck_block(const struct epd_k_dispatch_args &a,
                                                            const struct epd_ws_layout &l)
{
        __shared__ uint32_t num_short, first_short;

        if (threadIdx.x == 0) {
                num_short = 0;
                first_short = UINT32_MAX;
        }
        __syncthreads();
        for (uint32_t d = threadIdx.x; d < a.world_size; d += blockDim.x)
                check_capacity(&a, &l, d, &num_short, &first_short);
        __syncthreads();
        if (threadIdx.x == 0)
                write_verdict(&a, &l, UINT32_MAX, UINT32_MAX, num_short, first_short);
}

/* The row of entry (s, t, k) at its destination, or -1 when the entry is not a key (an invalid
 * or -1 selection, or a NON_EXPAND repeat of a destination): prefix + chunk base + rank in
 * chunk, the formulas of plan.h. `ent` is epd_ws_entry(l, s, t, K, k). Reads only what the
 * count and prefix steps wrote. */
static __device__ __forceinline__ int32_t epd__k_place_entry(const struct epd_k_dispatch_args &a,
                                                            const struct epd_ws_layout &l,
                                                            uint32_t s, uint32_t t, uint64_t ent)
{
        const uint32_t R = a.world_size, L = l.num_local_experts;
        const int32_t rank = epd_ws_i32(a.workspace, l.local)[ent];

        if (rank < 0)
                return -1;
        const int32_t e = epd_ws_i32(a.workspace, l.topk)[ent];
        const uint32_t d = epd_route_expert_rank(e, L);
        const int32_t *cb = epd_ws_i32(a.workspace, l.chunk_base) +
                            ((uint64_t)s * l.num_chunks + t / EPD_WS_CHUNK_TOKENS) * a.num_experts;
        if (a.layout == EPD_LAYOUT_EXPAND)
                return epd_ws_i32(a.workspace, l.expert_base)[(uint64_t)d * (L + 1) +
                                                             epd_route_expert_local(e, L)] +
                       epd_ws_i32(a.workspace, l.expert_src_prefix)[(uint64_t)e * R + s] +
                       cb[e] + rank;
        return epd_ws_i32(a.workspace, l.rank_prefix)[(uint64_t)d * (R + 1) + s] + cb[d] + rank;
}

/* ---- the kernels: one block per chunk (count), one for the group (prefix, recheck), a
 * thread per entry (place) ---- */

static __global__ void __launch_bounds__(EPD_WS_CHUNK_TOKENS)
        count_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                     const __grid_constant__ struct epd_ws_layout l, uint32_t num_keys)
{
        epd__k_count_chunk(a, l, num_keys, blockIdx.x);
}

extern "C" int epd_k_dispatch_count(const struct epd_k_dispatch_args *args, cudaStream_t stream)
{
        struct epd_ws_layout l;
        int optin, ret;

        ret = epd__k_check_dispatch(args, &l);
        if (ret < 0)
                return ret;
        if (args->num_local == 0)
                return 0;

        uint32_t keys = args->layout == EPD_LAYOUT_EXPAND ? args->num_experts : args->world_size;
        ret = epd__k_smem_optin(&optin);
        if (ret < 0)
                return ret;

        /* One warp per 32 tokens of a chunk (8), fewer if shared memory is short: the per-warp
         * counters and masks cost 8 bytes per key. A kilobyte stays free for the static shared
         * memory. */
        int64_t room = (int64_t)optin - 1024 - 4ll * (args->world_size + args->num_experts);
        int64_t warps = room / (8ll * keys);
        if (warps > (int64_t)(EPD_WS_CHUNK_TOKENS / 32))
                warps = EPD_WS_CHUNK_TOKENS / 32;
        if (warps < 1)
                return EPD_INVALID_ARGUMENT; /* cannot happen inside docs/semantics.md's limits */
        size_t smem = count_smem_bytes(args->world_size, args->num_experts, keys,
                                       (uint32_t)warps);
        ret = epd__k_dynamic_smem((const void *)count_kernel, smem);
        if (ret < 0)
                return ret;
        uint64_t blocks = (uint64_t)args->num_local * l.num_chunks;
        if (blocks > INT32_MAX)
                return EPD_INVALID_ARGUMENT;
        count_kernel<<<(unsigned)blocks, (unsigned)(warps * 32), smem, stream>>>(*args, l, keys);
        return epd__k_launch_status();
}

static __global__ void __launch_bounds__(PREFIX_THREADS, 1)
        prefix_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                      const __grid_constant__ struct epd_ws_layout l)
{
        epd__k_prefix_block(a, l);
}

extern "C" int epd_k_dispatch_prefix(const struct epd_k_dispatch_args *args, cudaStream_t stream)
{
        struct epd_ws_layout l;
        int ret = epd__k_check_dispatch(args, &l);

        if (ret < 0)
                return ret;
        prefix_kernel<<<1, PREFIX_THREADS, 0, stream>>>(*args, l);
        return epd__k_launch_status();
}

static __global__ void __launch_bounds__(PREFIX_THREADS)
        recheck_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                       const __grid_constant__ struct epd_ws_layout l)
{
        epd__k_recheck_block(a, l);
}

extern "C" int epd_k_dispatch_recheck(const struct epd_k_dispatch_args *args,
                                      cudaStream_t stream)
{
        struct epd_ws_layout l;
        int ret = epd__k_check_dispatch(args, &l);

        if (ret < 0)
                return ret;
        recheck_kernel<<<1, PREFIX_THREADS, 0, stream>>>(*args, l);
        return epd__k_launch_status();
}

/* ---- place ---- */

/* Thread per local entry: row = epd__k_place_entry.
 *
 * Memory ordering: reads the verdict with a .sys acquire (epd_block_read_verdict) and does
 * nothing on an error; everything else it reads was written by earlier kernels ordered by
 * events. It writes only its own sources' row slices, which the copy kernel of the same device
 * reads after it on the same stream. */
static __global__ void __launch_bounds__(PLACE_THREADS)
        place_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                     const __grid_constant__ struct epd_ws_layout l)
{
        const struct epd_ws_error *rec = epd_ws_error_rec(a.workspace, &l);
        if (epd_block_read_verdict(&rec->status) != 0)
                return;

        const uint32_t K = a.num_topk;
        int32_t *row = epd_ws_i32(a.workspace, l.row);
        const uint64_t total = (uint64_t)a.local_tokens * K;

        for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
             idx += (uint64_t)gridDim.x * blockDim.x) {
                uint32_t g = (uint32_t)(idx / K), k = (uint32_t)(idx % K);
                uint32_t i = epd__k_find_local(a.local, a.num_local, g);
                uint32_t s = a.local[i].rank, t = g - a.local[i].token_offset;
                uint64_t ent = epd_ws_entry(&l, s, t, K, k);
                row[ent] = epd__k_place_entry(a, l, s, t, ent);
        }
}

extern "C" int epd_k_dispatch_place(const struct epd_k_dispatch_args *args, cudaStream_t stream)
{
        struct epd_ws_layout l;
        int blocks, ret = epd__k_check_dispatch(args, &l);

        if (ret < 0)
                return ret;
        uint64_t total = (uint64_t)args->local_tokens * args->num_topk;
        if (args->num_local == 0 || total == 0)
                return 0;
        ret = epd__k_grid_blocks((const void *)place_kernel, PLACE_THREADS, 0,
                                 (total + PLACE_THREADS - 1) / PLACE_THREADS, &blocks);
        if (ret < 0)
                return ret;
        place_kernel<<<blocks, PLACE_THREADS, 0, stream>>>(*args, l);
        return epd__k_launch_status();
}

int epd__k_preload_route(void)
{
        struct cudaFuncAttributes attr;
        cudaError_t err = cudaFuncGetAttributes(&attr, count_kernel);
        if (err == cudaSuccess)
                err = cudaFuncGetAttributes(&attr, prefix_kernel);
        if (err == cudaSuccess)
                err = cudaFuncGetAttributes(&attr, recheck_kernel);
        if (err == cudaSuccess)
                err = cudaFuncGetAttributes(&attr, place_kernel);
        return epd__k_cuda_status(err);
}
