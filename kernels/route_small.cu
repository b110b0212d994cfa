/* route_small.cu - the routing of a small NON_EXPAND op in one launch: count, prefix and place,
 * for a group whose ranks all live on the launching GPU.
 *
 * The step sequence (route.cu) pays three dependent launches and, inside each step, phases that
 * wait on global memory: for a decode-sized op (8 ranks x 128 tokens), about twice as long as
 * the copy that follows. Here one block takes one chunk of EPD_WS_CHUNK_TOKENS tokens of one
 * source, one thread per token, and the blocks meet through flags in the workspace instead of
 * kernel boundaries.
 *
 * The chunks are numbered in the local flat order (source-major, then token; sources ascending
 * by rank, as the daemon builds `local`), and block j takes chunk j. For every counter x of a
 * chunk (tokens going to each destination, then selections of each expert) the prefix over
 * the chunks before chunk j is what the prefix step computes:
 *     rows:  row of (s, t) at d = pre_j[d] + (earlier warps of the chunk) + (earlier lanes)
 *            = #{(s', t') before (s, t) in the flat order going to d}
 *     the first chunk of source s:  rank_prefix[d][s] = pre[d], expert_src_prefix[e][s] = pre[R+e]
 *     the last chunk of source s:   tok_count[s][*], sel_count[s][*] = pre + own - pre(first chunk)
 *     the last chunk of all:        the totals: rank_prefix[d][R], expert_count, expert_aligned,
 *                                   expert_base, the capacity check and the verdict
 *
 *   1. Each thread validates and normalises its token's top-k row (the count step's pass A),
 *      writes topk and row = -1 for its entries, and forms its destination mask (the first
 *      position per rank, docs/semantics.md §2). A ballot per destination gives each warp's count;
 *      the chunk's counters and first bad entry go to chunk_count / chunk_error exactly as the
 *      count step writes them, and the chunk's flag is raised.
 *   2. The block waits for the flags of every earlier chunk, adds up their counters (all loads
 *      independent, so they are in flight together), writes the row of each first position and
 *      the prefixes and counts its chunk is responsible for (above; a source without chunks
 *      gets its zero counts and its prefixes from the next source's first chunk, or from the
 *      last chunk when none follows).
 *   3. The last block to finish puts the flags and the counter back to zero for the next op on
 *      this workspace.
 * So the workspace ends up as after count + prefix + place (tests/gpu compares every array the
 * copy, combine and cached dispatch read); chunk_base and `local`, which nothing after place
 * reads, are left unwritten.
 *
 * Waits go only to lower block indices, as in CUB's single-pass scan: blocks are dispatched in
 * index order, so a block that waits has every block it waits for resident or next in line, and
 * those never wait for it. The copy kernel launched after it as its programmatic dependent
 * (args.flags EPD_K_COPY_OVERLAP) starts only once every block here has started, so it cannot
 * take the multiprocessors a waited-for block needs; it pulls its first source rows into L2
 * while the routing runs.
 *
 * Memory ordering (all words live in the launching GPU's workspace and every reader is a block
 * of this grid or a later kernel on this GPU, hence .gpu scope):
 *   - chunk counters and error: written by the chunk's threads; __syncthreads(), then thread
 *     0's fence.acq_rel.gpu and st.release.gpu of the chunk flag publish them (the fence is
 *     cumulative over what bar.sync ordered before it). Threads of a reader block acquire the
 *     flags with ld.acquire.gpu, then __syncthreads() extends the acquires to the whole block
 *     before any thread loads those chunks' counters.
 *   - the reset: every block counts itself done (__syncthreads(), fence, atomicAdd) after its
 *     last read of a flag; the block that draws the last count resets them. The next kernel on
 *     this workspace runs after this grid has completed (stream or event order), a kernel
 *     boundary that makes the resets visible.
 *   - the verdict is published last with a .sys release (write_verdict). The copy kernel reads
 *     nothing written here before this grid has completed: a kernel boundary, or, when it
 *     overlaps this kernel, its griddepcontrol.wait, which returns only once this grid has
 *     completed and its stores are visible.
 */
#include <stdint.h>

#include "internal.cuh"
#include "route_token.cuh"
#include "verdict.cuh"

#define SMALL_THREADS EPD_WS_CHUNK_TOKENS /* one thread per token of a chunk */
#define SMALL_WARPS (SMALL_THREADS / 32)

/* Dynamic shared memory, int32: bsel[E], wtot[SMALL_WARPS][R], own[R] (the chunk's destination
 * counts), pre[R + E], spre[R + E], aligned[E], then rows[SMALL_THREADS][stride]. */
static __host__ __device__ uint64_t small_smem_bytes(uint32_t world_size, uint32_t num_experts,
                                                    uint32_t num_topk)
{
        return 4ull * (4ull * num_experts + (uint64_t)(SMALL_WARPS + 3) * world_size +
                       (uint64_t)SMALL_THREADS * small_row_stride(num_topk));
}

/* Chunks of a small op at most: ceil(N_s / chunk) summed over the sources. */
#define SMALL_MAX_CHUNKS (EPD_K_SMALL_MAX_TOKENS / SMALL_THREADS + SMALL_MAX_RANKS)

/* What the tokens of one local source need, copied to shared memory once per block. */
struct small_src {
        const void *topk_idx;
        uint64_t topk_stride;        /* elements; 0 replaced by K_op */
        uint32_t num_tokens;         /* 0 chunks when above T (BAD_TOKENS) */
        uint32_t rank;
};

/* One token t of source src (rank s): validates and normalises its top-k row (route_token) into
 * the workspace and into nrow (this thread's shared row), adds its selections to bsel, and
 * returns its destination mask; *first gets the first-position bits and *ent its first entry.
 * The chunk's first bad entry (lowest t*K_op + k) goes to *first_bad. */
static __device__ uint64_t small_token(const struct epd_k_dispatch_args &a,
                                       const struct epd_ws_layout &l, const struct small_src *src,
                                       uint32_t t, int32_t *bsel, uint32_t *first_bad,
                                       int32_t *nrow, uint32_t *first, uint64_t *ent)
{
        const uint32_t K = a.num_topk;
        int32_t *topk = epd_ws_i32(a.workspace, l.topk), *row = epd_ws_i32(a.workspace, l.row);
        uint32_t bad;

        *ent = epd_ws_entry(&l, src->rank, t, K, 0);
        const uint64_t dmask = route_token(src->topk_idx, a.topk_dtype,
                                           (uint64_t)t * src->topk_stride, K, a.num_experts,
                                           epd_udiv_magic(l.num_local_experts), nrow,
                                           first, &bad);
        for (uint32_t k = 0; k < K; k++) {
                const int32_t v = nrow[k];
                topk[*ent + k] = v >= 0 ? v & 0xffff : -1;
                row[*ent + k] = -1; /* first positions get theirs in phase 2 */
                if (v >= 0)
                        atomicAdd(&bsel[v & 0xffff], 1);
        }
        if (bad != UINT32_MAX)
                atomicMin(first_bad, t * K + bad);
        return dmask;
}

/* The local source holding flat chunk j: the last i with chunk_off[i] <= j (sources without
 * chunks have chunk_off[i] == chunk_off[i + 1] and are skipped). */
static __device__ __forceinline__ uint32_t small_source_of(const uint32_t *chunk_off,
                                                          uint32_t num_local, uint32_t j)
{
        uint32_t lo = 0, hi = num_local;

        while (hi - lo > 1) {
                const uint32_t mid = (lo + hi) / 2;
                if (chunk_off[mid] <= j)
                        lo = mid;
                else
                        hi = mid;
        }
        return lo;
}

/* Prefixes and zero counts of local sources [i0, i1), which have no chunks: their rows, had
 * they any, would start at pre. */
static __device__ void small_empty_sources(const struct epd_k_dispatch_args &a,
                                           const struct epd_ws_layout &l,
                                           const struct small_src *srcs, uint32_t i0,
                                           uint32_t i1, const int32_t *pre)
{
        const uint32_t R = a.world_size, E = a.num_experts, W = R + E;
        void *ws = a.workspace;

        for (uint32_t i = i0; i < i1; i++) {
                const uint32_t s = srcs[i].rank;
                for (uint32_t x = threadIdx.x; x < W; x += blockDim.x) {
                        if (x < R) {
                                epd_ws_i32(ws, l.rank_prefix)[(uint64_t)x * (R + 1) + s] = pre[x];
                                epd_ws_i32(ws, l.tok_count)[(uint64_t)s * R + x] = 0;
                        } else {
                                epd_ws_i32(ws, l.expert_src_prefix)[(uint64_t)(x - R) * R + s] =
                                        pre[x];
                                epd_ws_i32(ws, l.sel_count)[(uint64_t)s * E + x - R] = 0;
                        }
                }
        }
}

/* The op's totals (tot[R + E]: every chunk's counters added up), by the block of the last chunk
 * (or block 0 when the op has no chunk): rank_prefix[d][R], expert_count, expert_aligned,
 * expert_base, the capacity check and the verdict. Every chunk's error record has been acquired
 * (the caller waited for every other chunk's flag). Whole block. */
static __device__ void small_finish(const struct epd_k_dispatch_args &a,
                                    const struct epd_ws_layout &l, const struct small_src *srcs,
                                    const uint32_t *chunk_off, const int32_t *tot,
                                    int32_t *aligned)
{
        __shared__ uint32_t bad_key, num_short, first_short;
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        const uint32_t C = l.num_chunks, nl = a.num_local;
        const uint32_t warp = threadIdx.x / 32;
        void *ws = a.workspace;

        if (threadIdx.x == 0) {
                bad_key = UINT32_MAX;
                num_short = 0;
                first_short = UINT32_MAX;
        }
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x)
                epd_ws_i32(ws, l.rank_prefix)[(uint64_t)d * (R + 1) + R] = tot[d];
        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
                aligned[e] = (int32_t)epd_route_align_up(tot[R + e], a.expert_alignment);
                epd_ws_i32(ws, l.expert_count)[e] = tot[R + e];
                epd_ws_i32(ws, l.expert_aligned)[e] = aligned[e];
        }
        __syncthreads(); /* aligned; bad_key and the capacity counters initialised */
        /* The first bad entry: lowest source, then lowest chunk (chunks hold ascending t). */
        for (uint32_t i = threadIdx.x; i < nl; i += blockDim.x) {
                const uint32_t s = srcs[i].rank, n = chunk_off[i + 1] - chunk_off[i];
                if (srcs[i].num_tokens > a.max_tokens) {
                        atomicMin(&bad_key, i << 16);
                        continue;
                }
                for (uint32_t c = 0; c < n; c++) {
                        if (epd_ws_chunk_errors(ws, &l)[(uint64_t)s * C + c].reason !=
                            EPD_WS_REASON_NONE) {
                                atomicMin(&bad_key, i << 16 | c);
                                break;
                        }
                }
        }
        /* expert_base[d][le]: a scan over the aligned counts of d's experts, one warp per d. */
        for (uint32_t d = warp; d < R; d += SMALL_WARPS)
                warp_exclusive_scan(aligned + (uint64_t)d * L,
                                    epd_ws_i32(ws, l.expert_base) + (uint64_t)d * (L + 1), L);
        __syncthreads(); /* check_capacity reads rank_prefix and expert_base back */
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x)
                check_capacity(&a, &l, d, &num_short, &first_short);
        __syncthreads();
        if (threadIdx.x != 0)
                return;
        if (bad_key == UINT32_MAX) {
                write_verdict(&a, &l, UINT32_MAX, UINT32_MAX, num_short, first_short);
                return;
        }
        const uint32_t i = bad_key >> 16, s = srcs[i].rank, c = bad_key & 0xffff;
        /* A BAD_TOKENS source has no chunks, so chunk 0's slot is free for its record. */
        if (srcs[i].num_tokens > a.max_tokens)
                write_chunk_error(&a, &l, s, 0, 1, UINT32_MAX);
        write_verdict(&a, &l, s, s * C + c, num_short, first_short);
}

static __global__ void __launch_bounds__(SMALL_THREADS)
        route_small_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                           const __grid_constant__ struct epd_ws_layout l)
{
        extern __shared__ int32_t smem[];
        __shared__ struct small_src srcs[SMALL_MAX_RANKS];
        __shared__ uint32_t chunk_off[SMALL_MAX_RANKS + 1];
        __shared__ uint32_t chunk_row[SMALL_MAX_CHUNKS]; /* chunk j's counters: row of chunk_count */
        __shared__ uint32_t first_bad, last;
        const uint32_t R = a.world_size, E = a.num_experts, K = a.num_topk, C = l.num_chunks;
        const uint32_t W = R + E, nl = a.num_local;
        const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        int32_t *bsel = smem;                                 /* [E] */
        int32_t *wtot = bsel + E;                             /* [SMALL_WARPS][R] */
        int32_t *own = wtot + (uint64_t)SMALL_WARPS * R;      /* [R] */
        int32_t *pre = own + R;                               /* [R + E] */
        int32_t *spre = pre + W;                              /* [R + E] */
        int32_t *aligned = spre + W;                          /* [E] */
        int32_t *rows = aligned + E;                          /* [SMALL_THREADS][stride] */
        int32_t *nrow = rows + (uint64_t)threadIdx.x * small_row_stride(K); /* this thread's */
        void *ws = a.workspace;
        const int32_t *cc = epd_ws_i32(ws, l.chunk_count);
        uint32_t *flags = epd_ws_small_flags(ws, &l);

        /* The copy kernel may start once every block has passed this point (programmatic
         * dependent launch); it reads nothing written here before this grid completes. */
        asm volatile("griddepcontrol.launch_dependents;" : : : "memory");

        if (threadIdx.x == 0)
                first_bad = UINT32_MAX;
        for (uint32_t i = threadIdx.x; i < E + SMALL_WARPS * R; i += blockDim.x)
                smem[i] = 0;
        if (threadIdx.x < nl) {
                const uint32_t s = a.local[threadIdx.x].rank;
                const struct epd_k_dispatch_rank *r = &a.ranks[s];
                srcs[threadIdx.x] = (struct small_src){
                        r->topk_idx, r->topk_stride != 0 ? r->topk_stride : K, r->num_tokens, s };
        }
        __syncthreads();
        /* Chunk offsets of the local sources, in flat order. */
        if (warp == 0) {
                uint32_t carry = 0;
                for (uint32_t i0 = 0; i0 < nl; i0 += 32) {
                        const uint32_t i = i0 + lane;
                        const uint32_t n = i < nl ? srcs[i].num_tokens : 0;
                        const int32_t c = n <= a.max_tokens
                                                  ? (int32_t)((n + SMALL_THREADS - 1) /
                                                              SMALL_THREADS)
                                                  : 0;
                        const int32_t incl = warp_inclusive_scan(c);
                        if (i < nl)
                                chunk_off[i] = carry + (uint32_t)(incl - c);
                        carry += (uint32_t)__shfl_sync(EPD_K_FULL_MASK, incl, 31);
                }
                if (lane == 0)
                        chunk_off[nl] = carry;
        }
        __syncthreads();
        const uint32_t j = blockIdx.x, nch = chunk_off[nl];
        for (uint32_t p = threadIdx.x; p < nch && p <= j; p += blockDim.x) {
                const uint32_t pi = small_source_of(chunk_off, nl, p);
                chunk_row[p] = srcs[pi].rank * C + p - chunk_off[pi];
        }

        if (j < nch) { /* block-uniform */
                const uint32_t i = small_source_of(chunk_off, nl, j), c = j - chunk_off[i];
                const struct small_src *src = &srcs[i];
                const uint32_t s = src->rank, t = c * SMALL_THREADS + threadIdx.x;
                int32_t *my_cc = epd_ws_i32(ws, l.chunk_count) + ((uint64_t)s * C + c) * W;
                uint32_t first = 0;
                uint64_t ent = 0, dmask = 0;

                /* 1: the token, and the chunk's counters. */
                if (t < src->num_tokens)
                        dmask = small_token(a, l, src, t, bsel, &first_bad, nrow, &first, &ent);
                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t b = __ballot_sync(EPD_K_FULL_MASK, (dmask >> d) & 1);
                        if (lane == 0)
                                wtot[(uint64_t)warp * R + d] = __popc(b);
                }
                __syncthreads();
                for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                        int32_t run = 0;
                        for (uint32_t w = 0; w < SMALL_WARPS; w++) {
                                const int32_t n = wtot[(uint64_t)w * R + d];
                                wtot[(uint64_t)w * R + d] = run;
                                run += n;
                        }
                        own[d] = run;
                        my_cc[d] = run;
                }
                for (uint32_t e = threadIdx.x; e < E; e += blockDim.x)
                        my_cc[R + e] = bsel[e];
                if (threadIdx.x == 0)
                        write_chunk_error(&a, &l, s, c, 0, first_bad);
                __syncthreads();
                if (threadIdx.x == 0) {
                        epd_fence_acq_rel_gpu();
                        epd_st_release_gpu_u32(&flags[j], 1);
                }

                /* 2: the counters of every earlier chunk: pre over all of them, spre over
                 * those before this source's first chunk. */
                for (uint32_t p = threadIdx.x; p < j; p += blockDim.x)
                        while (epd_ld_acquire_gpu_u32(&flags[p]) == 0)
                                ;
                __syncthreads(); /* every flag acquired, by some thread of the block */
                const uint32_t j0 = chunk_off[i];
                for (uint32_t x = threadIdx.x; x < W; x += blockDim.x) {
                        int32_t sum = 0, ssum = 0;
#pragma unroll 4
                        for (uint32_t p = 0; p < j; p++) {
                                const int32_t v = cc[(uint64_t)chunk_row[p] * W + x];
                                sum += v;
                                ssum += p < j0 ? v : 0;
                        }
                        pre[x] = sum;
                        spre[x] = ssum;
                }
                __syncthreads();
                const uint32_t below = (1u << lane) - 1;
                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t b = __ballot_sync(EPD_K_FULL_MASK, (dmask >> d) & 1);
                        if (!((dmask >> d) & 1))
                                continue;
                        const int32_t row = pre[d] + wtot[(uint64_t)warp * R + d] +
                                            __popc(b & below);
                        for (uint32_t m = first; m != 0; m &= m - 1) {
                                const uint32_t k = __ffs(m) - 1;
                                if ((uint32_t)nrow[k] >> 16 == d) {
                                        epd_ws_i32(ws, l.row)[ent + k] = row;
                                        break;
                                }
                        }
                }
                if (c == 0) {
                        /* This source's prefixes, and those of the sources without chunks
                         * just before it (their rows would start at the same place). */
                        uint32_t i0 = i;
                        while (i0 > 0 && chunk_off[i0 - 1] == chunk_off[i])
                                i0--;
                        small_empty_sources(a, l, srcs, i0, i, pre);
                        for (uint32_t x = threadIdx.x; x < W; x += blockDim.x) {
                                if (x < R)
                                        epd_ws_i32(ws, l.rank_prefix)[(uint64_t)x * (R + 1) + s] =
                                                pre[x];
                                else
                                        epd_ws_i32(ws, l.expert_src_prefix)[(uint64_t)(x - R) * R +
                                                                            s] = pre[x];
                        }
                }
                /* From here on pre holds the totals up to and including this chunk. */
                __syncthreads();
                for (uint32_t x = threadIdx.x; x < W; x += blockDim.x)
                        pre[x] += x < R ? own[x] : bsel[x - R];
                __syncthreads();
                if (j + 1 == chunk_off[i + 1]) {
                        /* The last chunk of this source: its counts. */
                        for (uint32_t x = threadIdx.x; x < W; x += blockDim.x) {
                                const int32_t n = pre[x] - spre[x];
                                if (x < R)
                                        epd_ws_i32(ws, l.tok_count)[(uint64_t)s * R + x] = n;
                                else
                                        epd_ws_i32(ws, l.sel_count)[(uint64_t)s * E + x - R] = n;
                        }
                }
                if (j + 1 == nch) {
                        /* The last chunk: the sources without chunks after this one, and the
                         * totals. */
                        small_empty_sources(a, l, srcs, i + 1, nl, pre);
                        small_finish(a, l, srcs, chunk_off, pre, aligned);
                }
        } else if (j == 0 && nch == 0) {
                /* No chunk at all: every source is empty, every count zero. */
                for (uint32_t x = threadIdx.x; x < W; x += blockDim.x)
                        pre[x] = 0;
                __syncthreads();
                small_empty_sources(a, l, srcs, 0, nl, pre);
                small_finish(a, l, srcs, chunk_off, pre, aligned);
        }

        /* 3: the last block to finish resets the flags and the counter. */
        __syncthreads();
        struct epd_ws_small_sync *sync = epd_ws_small_sync(ws, &l);
        if (threadIdx.x == 0) {
                epd_fence_acq_rel_gpu();
                last = atomicAdd(&sync->done, 1u) == gridDim.x - 1;
        }
        __syncthreads();
        if (!last)
                return;
        for (uint32_t p = threadIdx.x; p < nch; p += blockDim.x)
                flags[p] = 0;
        if (threadIdx.x == 0)
                sync->done = 0;
}

/* Whether an op qualifies; its shared memory and grid. */
static int small_plan(const struct epd_k_dispatch_args *args, struct epd_ws_layout *l,
                      size_t *smem, uint32_t *blocks)
{
        int ret = small_op_check(args, l);

        if (ret < 0)
                return ret;
        *smem = small_smem_bytes(args->world_size, args->num_experts, args->num_topk);
        /* At least sum over sources of ceil(N_s / chunk) (at most SMALL_MAX_CHUNKS): the blocks
         * beyond the op's chunks only count themselves done. */
        *blocks = args->local_tokens / SMALL_THREADS + args->num_local;
        /* Also raises the kernel's limit when needed: this is the launch's plan. */
        return epd__k_dynamic_smem((const void *)route_small_kernel, *smem);
}

extern "C" int epd_k_dispatch_route_small_ok(const struct epd_k_dispatch_args *args)
{
        struct epd_ws_layout l;
        size_t smem = 0;
        uint32_t blocks = 0;

        return small_plan(args, &l, &smem, &blocks) == 0;
}

extern "C" int epd_k_dispatch_route_small(const struct epd_k_dispatch_args *args,
                                          cudaStream_t stream)
{
        struct epd_ws_layout l;
        size_t smem = 0;
        uint32_t blocks = 0;
        int ret = small_plan(args, &l, &smem, &blocks);

        if (ret < 0)
                return ret;
        route_small_kernel<<<blocks, SMALL_THREADS, smem, stream>>>(*args, l);
        return epd__k_launch_status();
}

extern "C" int epd_k_workspace_init(void *workspace, uint32_t world_size, uint32_t num_experts,
                                    uint32_t max_tokens, uint32_t max_topk, cudaStream_t stream)
{
        struct epd_ws_layout l;
        const uint64_t bytes = epd_k_workspace_bytes(world_size, num_experts, max_tokens,
                                                     max_topk);

        if (workspace == NULL || bytes == 0)
                return EPD_INVALID_ARGUMENT;
        epd_ws_layout_init(&l, world_size, num_experts, max_tokens, max_topk);
        return epd__k_cuda_status(cudaMemsetAsync(
                (uint8_t *)workspace + l.small_sync, 0,
                sizeof(struct epd_ws_small_sync) + 4ull * world_size * l.num_chunks, stream));
}

int epd__k_preload_route_small(void)
{
        struct cudaFuncAttributes attr;
        return epd__k_cuda_status(cudaFuncGetAttributes(&attr, route_small_kernel));
}
