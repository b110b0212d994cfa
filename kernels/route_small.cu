/* route_small.cu - the routing of a small NON_EXPAND op in one block: count, prefix and place in
 * one launch, for a group whose ranks all live on the launching GPU.
 *
 * The step sequence (route.cu) spreads a large op over many blocks and pays for it with three
 * dependent launches and, inside each step, phases that wait on global memory: about 40 us for a
 * decode-sized op (8 ranks x 128 tokens), twice the copy that follows. A small op fits one
 * block: its tokens are taken 1024 at a time in the local flat order (source-major, then
 * token), one thread per token. The token's top-k row is validated and normalised in registers;
 * its destinations (first position per rank, SEMANTICS.md 2) are a bit mask. Because the flat
 * order is source-major, the row of (s, t) at destination d is the number of earlier tokens of
 * the flat order going to d:
 *     rank_prefix[d][s] + #{t' < t of s going to d}  =  #{(s', t') before (s, t) going to d}
 * which a warp ballot per destination and a scan of the 32 warp totals give directly. The counts
 * (tok_count, sel_count) are shared-memory integer additions, the prefixes and expert bases
 * small loops over them, and the verdict the same write_verdict as the prefix step, so the
 * workspace ends up exactly as after count + prefix + place (tests/gpu compares every array):
 * combine, cached dispatch and the copy step read it the same way. Only the chunk arrays and
 * `local`, which nothing after place reads, are left unwritten.
 *
 * While the block routes, it asks L2 for the op's source rows (cp.async.bulk.prefetch.L2, a
 * hint that changes no result) when they fit in a quarter of it, so that the copy step after it
 * reads them from L2 and only its stores go to memory.
 *
 * Memory ordering: one block does everything; each phase that reads what other threads wrote
 * (shared counters, the rank_prefix the capacity check reads back) follows a __syncthreads(),
 * which orders shared and global memory among the block's threads. The verdict is published
 * last with a .sys release (write_verdict); the copy kernel runs after this one on the same
 * stream, and the kernel boundary makes every store here visible to it.
 */
#include <stdint.h>

#include "route_steps.cuh"

#define SMALL_THREADS 1024
#define SMALL_WARPS (SMALL_THREADS / 32)
#define SMALL_MAX_RANKS 64 /* destinations are bits of a 64-bit mask */

static __device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes)
{
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(p), "r"(bytes)
                     : "memory");
}

/* Dynamic shared memory, int32: sel[R][E], tok[R][R], ecount[E], wtot[SMALL_WARPS][R],
 * carry[R]. */
static __host__ __device__ uint64_t small_smem_bytes(uint32_t world_size, uint32_t num_experts)
{
        return 4ull * ((uint64_t)world_size * num_experts + (uint64_t)world_size * world_size +
                       num_experts + (uint64_t)(SMALL_WARPS + 1) * world_size);
}

/* Asks L2 for every local source row (x, and scales for fp8); rows that are not 16-byte aligned
 * and sized are skipped. */
static __device__ void prefetch_sources(const struct epd_k_dispatch_args &a)
{
        for (uint32_t g = threadIdx.x; g < a.local_tokens; g += blockDim.x) {
                const uint32_t i = epd__k_find_local(a.local, a.num_local, g);
                const struct epd_k_dispatch_rank *src = &a.ranks[a.local[i].rank];
                const uint32_t t = g - a.local[i].token_offset;
                if (src->num_tokens > a.max_tokens)
                        continue;
                const uint8_t *x = src->x.ptr + (uint64_t)t * src->x.stride;
                if ((((uintptr_t)x | a.row_bytes) & 15) == 0)
                        prefetch_l2(x, (uint32_t)a.row_bytes);
                if (a.scale_bytes != 0 && src->scales.ptr != NULL) {
                        const uint8_t *sc = src->scales.ptr + (uint64_t)t * src->scales.stride;
                        if ((((uintptr_t)sc | a.scale_bytes) & 15) == 0)
                                prefetch_l2(sc, (uint32_t)a.scale_bytes);
                }
        }
}

/* One token (flat index g, when g < local_tokens): validates and normalises its top-k row into
 * nrow and the workspace, adds its selections and destinations to the shared counts, and
 * returns its destination mask; *first gets the first-position bits and *ent its first entry. */
static __device__ uint64_t small_token(const struct epd_k_dispatch_args &a,
                                       const struct epd_ws_layout &l, uint32_t g, int32_t *sel,
                                       int32_t *tok, unsigned long long *first_bad,
                                       int32_t *nrow, uint32_t *first, uint64_t *ent)
{
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        const uint32_t K = a.num_topk;
        uint64_t dmask = 0;

        *first = 0;
        if (g >= a.local_tokens)
                return 0;
        const uint32_t i = epd__k_find_local(a.local, a.num_local, g);
        const uint32_t s = a.local[i].rank, t = g - a.local[i].token_offset;
        const struct epd_k_dispatch_rank *src = &a.ranks[s];
        if (src->num_tokens > a.max_tokens)
                return 0;

        const uint64_t stride = src->topk_stride != 0 ? src->topk_stride : K;
        const uint64_t row0 = (uint64_t)t * stride;
        int64_t raw[EPD_MAX_TOPK];
        uint32_t bad = UINT32_MAX, valid = 0;

        *ent = epd_ws_entry(&l, s, t, K, 0);
        for (uint32_t k = 0; k < K; k++)
                raw[k] = epd__k_load_topk(src->topk_idx, a.topk_dtype, row0 + k);
        /* The count step's pass A: ids outside [0, E) other than -1, and repeats, are bad and
         * normalised to -1. */
        for (uint32_t k = 0; k < K; k++) {
                const int64_t v = raw[k];
                int32_t norm = -1;
                if (v >= 0 && v < (int64_t)E) {
                        norm = (int32_t)v;
                        for (uint32_t j = 0; j < k; j++) {
                                if (raw[j] == v) {
                                        norm = -1;
                                        bad = min(bad, k);
                                        break;
                                }
                        }
                } else if (v != -1) {
                        bad = min(bad, k);
                }
                nrow[k] = norm;
                epd_ws_i32(a.workspace, l.topk)[*ent + k] = norm;
                epd_ws_i32(a.workspace, l.row)[*ent + k] = -1; /* keys get theirs below */
                if (norm >= 0) {
                        valid |= 1u << k;
                        atomicAdd(&sel[(uint64_t)s * E + norm], 1);
                }
        }
        if (bad != UINT32_MAX)
                atomicMin(first_bad, (unsigned long long)s << 32 | (t * K + bad));
        *first = row_first_bits(nrow, valid, L);
        for (uint32_t m = *first; m != 0; m &= m - 1) {
                const uint32_t d = epd_route_expert_rank(nrow[__ffs(m) - 1], L);
                dmask |= 1ull << d;
                atomicAdd(&tok[(uint64_t)s * R + d], 1);
        }
        return dmask;
}

static __global__ void __launch_bounds__(SMALL_THREADS, 1)
        route_small_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                           const __grid_constant__ struct epd_ws_layout l, int prefetch)
{
        extern __shared__ int32_t smem[];
        __shared__ unsigned long long first_bad; /* (source << 32) | t * K_op + k; lowest wins */
        __shared__ uint32_t num_short, first_short;
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        const uint32_t K = a.num_topk, C = l.num_chunks;
        const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        int32_t *sel = smem;                          /* [R][E] */
        int32_t *tok = sel + (uint64_t)R * E;         /* [R][R] */
        int32_t *ecount = tok + (uint64_t)R * R;      /* [E] */
        int32_t *wtot = ecount + E;                   /* [SMALL_WARPS][R] */
        int32_t *carry = wtot + (uint64_t)SMALL_WARPS * R; /* [R] */
        void *ws = a.workspace;

        for (uint64_t i = threadIdx.x; i < small_smem_bytes(R, E) / 4; i += blockDim.x)
                smem[i] = 0;
        if (threadIdx.x == 0) {
                first_bad = ~0ull;
                num_short = 0;
                first_short = UINT32_MAX;
        }
        __syncthreads();
        /* A source claiming more than T tokens is rejected (BAD_TOKENS, as the count step
         * does) and contributes nothing; having no entries, its key (s, 0) is its own. */
        if (threadIdx.x < R && a.ranks[threadIdx.x].num_tokens > a.max_tokens)
                atomicMin(&first_bad, (unsigned long long)threadIdx.x << 32);
        if (prefetch)
                prefetch_sources(a);

        /* Rounds of SMALL_THREADS tokens in flat order; carry[d] holds the tokens of earlier
         * rounds going to d. */
        for (uint32_t base = 0; base < a.local_tokens; base += SMALL_THREADS) {
                int32_t nrow[EPD_MAX_TOPK];
                uint32_t first;
                uint64_t ent = 0;
                const uint64_t dmask = small_token(a, l, base + threadIdx.x, sel, tok,
                                                   &first_bad, nrow, &first, &ent);

                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t b = __ballot_sync(EPD_K_FULL_MASK, (dmask >> d) & 1);
                        if (lane == 0)
                                wtot[(uint64_t)warp * R + d] = __popc(b);
                }
                __syncthreads();
                for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                        int32_t run = carry[d];
                        for (uint32_t w = 0; w < SMALL_WARPS; w++) {
                                const int32_t c = wtot[(uint64_t)w * R + d];
                                wtot[(uint64_t)w * R + d] = run;
                                run += c;
                        }
                        carry[d] = run;
                }
                __syncthreads();
                /* row = earlier warps and rounds + earlier lanes of this warp. */
                const uint32_t below = (1u << lane) - 1;
                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t b = __ballot_sync(EPD_K_FULL_MASK, (dmask >> d) & 1);
                        if (!((dmask >> d) & 1))
                                continue;
                        const int32_t row = wtot[(uint64_t)warp * R + d] + __popc(b & below);
                        for (uint32_t m = first; m != 0; m &= m - 1) {
                                const uint32_t k = __ffs(m) - 1;
                                if (epd_route_expert_rank(nrow[k], L) == d)
                                        epd_ws_i32(ws, l.row)[ent + k] = row;
                        }
                }
                __syncthreads(); /* wtot is rewritten by the next round */
        }

        /* The counts and prefixes of the prefix step, from the shared counts. */
        for (uint32_t i = threadIdx.x; i < R * R; i += blockDim.x)
                epd_ws_i32(ws, l.tok_count)[i] = tok[i];
        for (uint64_t i = threadIdx.x; i < (uint64_t)R * E; i += blockDim.x)
                epd_ws_i32(ws, l.sel_count)[i] = sel[i];
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                int32_t *rp = epd_ws_i32(ws, l.rank_prefix) + (uint64_t)d * (R + 1);
                int32_t run = 0;
                for (uint32_t s = 0; s < R; s++) {
                        rp[s] = run;
                        run += tok[(uint64_t)s * R + d];
                }
                rp[R] = run;
        }
        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
                int32_t *sp = epd_ws_i32(ws, l.expert_src_prefix) + (uint64_t)e * R;
                int32_t run = 0;
                for (uint32_t s = 0; s < R; s++) {
                        sp[s] = run;
                        run += sel[(uint64_t)s * E + e];
                }
                ecount[e] = run;
                epd_ws_i32(ws, l.expert_count)[e] = run;
        }
        __syncthreads();
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                int32_t *eb = epd_ws_i32(ws, l.expert_base) + (uint64_t)d * (L + 1);
                int32_t run = 0;
                for (uint32_t le = 0; le < L; le++) {
                        const int32_t aligned = (int32_t)epd_route_align_up(
                                ecount[(uint64_t)d * L + le], a.expert_alignment);
                        epd_ws_i32(ws, l.expert_aligned)[(uint64_t)d * L + le] = aligned;
                        eb[le] = run;
                        run += aligned;
                }
                eb[L] = run;
        }
        __syncthreads(); /* check_capacity reads rank_prefix and expert_base back */
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x)
                check_capacity(&a, &l, d, &num_short, &first_short);
        __syncthreads();
        if (threadIdx.x != 0)
                return;
        if (first_bad == ~0ull) {
                write_verdict(&a, &l, UINT32_MAX, UINT32_MAX, num_short, first_short);
                return;
        }
        /* The details of the first bad entry, in chunk 0's error slot of its source, where
         * write_verdict reads them. */
        const uint32_t s = (uint32_t)(first_bad >> 32), idx = (uint32_t)first_bad;
        const struct epd_k_dispatch_rank *src = &a.ranks[s];
        struct epd_ws_src_error *rec = epd_ws_chunk_errors(ws, &l) + (uint64_t)s * C;
        rec->reserved = 0;
        if (src->num_tokens > a.max_tokens) {
                rec->reason = EPD_WS_REASON_BAD_TOKENS;
                rec->token = 0;
                rec->pos = 0;
                rec->value = src->num_tokens;
        } else {
                const uint32_t t = idx / K, k = idx % K;
                const uint64_t stride = src->topk_stride != 0 ? src->topk_stride : K;
                const int64_t v = epd__k_load_topk(src->topk_idx, a.topk_dtype,
                                                   (uint64_t)t * stride + k);
                rec->reason = (v >= 0 && v < (int64_t)E) ? EPD_WS_REASON_DUP_EXPERT
                                                         : EPD_WS_REASON_BAD_EXPERT;
                rec->token = (int32_t)t;
                rec->pos = (int32_t)k;
                rec->value = v;
        }
        write_verdict(&a, &l, s, s * C, num_short, first_short);
}

/* Whether an op qualifies, and its shared memory. */
static int small_plan(const struct epd_k_dispatch_args *args, struct epd_ws_layout *l,
                      size_t *smem, int *prefetch)
{
        int device, optin, l2, ret;
        cudaError_t err;

        ret = epd__k_check_dispatch(args, l);
        if (ret < 0)
                return ret;
        if (args->layout != EPD_LAYOUT_NON_EXPAND || args->num_local != args->world_size ||
            args->world_size > SMALL_MAX_RANKS || args->local_tokens > EPD_K_SMALL_MAX_TOKENS)
                return EPD_INVALID_ARGUMENT;
        err = cudaGetDevice(&device);
        if (err == cudaSuccess)
                err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                             device);
        if (err == cudaSuccess)
                err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
        if (err != cudaSuccess)
                return epd__k_cuda_status(err);
        *smem = small_smem_bytes(args->world_size, args->num_experts);
        if (*smem + 1024 > (size_t)optin)
                return EPD_INVALID_ARGUMENT;
        const uint64_t src_bytes =
                (uint64_t)args->local_tokens * (args->row_bytes + args->scale_bytes);
        *prefetch = args->row_bytes <= UINT32_MAX && src_bytes <= (uint64_t)l2 / 4;
        return 0;
}

extern "C" int epd_k_dispatch_route_small_ok(const struct epd_k_dispatch_args *args)
{
        struct epd_ws_layout l;
        size_t smem = 0;
        int prefetch = 0;

        return small_plan(args, &l, &smem, &prefetch) == 0;
}

extern "C" int epd_k_dispatch_route_small(const struct epd_k_dispatch_args *args,
                                          cudaStream_t stream)
{
        struct epd_ws_layout l;
        size_t smem = 0;
        int prefetch = 0, ret = small_plan(args, &l, &smem, &prefetch);

        if (ret < 0)
                return ret;
        if (smem > 48 * 1024) {
                cudaError_t err = cudaFuncSetAttribute(
                        route_small_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
                if (err != cudaSuccess)
                        return epd__k_cuda_status(err);
        }
        route_small_kernel<<<1, SMALL_THREADS, smem, stream>>>(*args, l, prefetch);
        return epd__k_launch_status();
}

int epd__k_preload_route_small(void)
{
        struct cudaFuncAttributes attr;
        return epd__k_cuda_status(cudaFuncGetAttributes(&attr, route_small_kernel));
}
