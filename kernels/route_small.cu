/* route_small.cu - the routing of a small NON_EXPAND op in one block: count, prefix and place in
 * one launch, for a group whose ranks all live on the launching GPU.
 *
 * The step sequence (route.cu) spreads a large op over many blocks and pays for it with three
 * dependent launches and, inside each step, phases that wait on global memory: about 40 us for a
 * decode-sized op (8 ranks x 128 tokens), twice the copy that follows. A small op fits one
 * block: its tokens are taken 1024 at a time in the local flat order (source-major, then
 * token), one thread per token. The token's top-k row is validated and normalised in one pass;
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
 * The copy step can overlap it: launched as this kernel's programmatic dependent (args.flags
 * EPD_K_COPY_OVERLAP), its blocks start on the other multiprocessors at once and pull their
 * first source rows into L2 while this one block routes (an earlier version prefetched from
 * this block with cp.async.bulk.prefetch.L2 and took 74-78 us instead of 44: one SM's
 * bulk-copy unit cannot fetch a whole op's rows quickly).
 *
 * Memory ordering: one block does everything; each phase that reads what other threads wrote
 * (shared counters, the rank_prefix the capacity check reads back) follows a __syncthreads(),
 * which orders shared and global memory among the block's threads. The verdict is published
 * last with a .sys release (write_verdict). The copy kernel after it on the same stream reads
 * nothing written here before this grid has completed: a kernel boundary, or, when it overlaps
 * this kernel, its griddepcontrol.wait, which returns only once this grid has completed and
 * its stores are visible.
 */
#include <stdint.h>

#include "internal.cuh"
#include "verdict.cuh"

#define SMALL_THREADS 1024
#define SMALL_WARPS (SMALL_THREADS / 32)
#define SMALL_MAX_RANKS 64 /* destinations are bits of a 64-bit mask */

/* Each thread's normalised top-k row lives in shared memory at a stride of num_topk rounded up
 * to odd, so that a warp's threads reading the same position hit 32 different banks (an
 * earlier version kept it in local memory: 44 us against 42 us with shared memory; the one-pass
 * token loop below then took it to 29 us). */
static __host__ __device__ uint32_t small_row_stride(uint32_t num_topk)
{
        return num_topk | 1u;
}

/* Dynamic shared memory, int32: sel[R][E], tok[R][R], ecount[E], wtot[SMALL_WARPS][R],
 * carry[R], rows[SMALL_THREADS][stride]. */
static __host__ __device__ uint64_t small_smem_bytes(uint32_t world_size, uint32_t num_experts,
                                                    uint32_t num_topk)
{
        return 4ull * ((uint64_t)world_size * num_experts + (uint64_t)world_size * world_size +
                       num_experts + (uint64_t)(SMALL_WARPS + 1) * world_size +
                       (uint64_t)SMALL_THREADS * small_row_stride(num_topk));
}

/* One token (flat index g, when g < local_tokens): validates and normalises its top-k row into
 * the workspace and into nrow (this thread's shared row, each valid entry packed as
 * expert | destination << 16, -1 otherwise), adds its selections and destinations to the shared
 * counts, and returns its destination mask; *first gets the first-position bits and *ent its
 * first entry.
 *
 * One pass does what the count step does in three, because a lone block is limited by the
 * instructions it issues and their latency (ncu: an earlier version that divided by L in nested
 * loops executed 153k warp instructions in 42 us; this one 81k in 29 us): an id repeats an earlier raw id exactly when it equals an
 * earlier normalised one (the first occurrence of an in-range id is never normalised away), so
 * the raw row need not be kept; and a valid position is the first for its destination exactly
 * when no earlier valid position has that destination (epd_route_is_first_for_rank), which a
 * running mask of the destinations seen answers with one division per entry. */
/* What the tokens of one local source need, copied to shared memory once per op, so that a
 * token's only global load on the way to its rows is its top-k row. */
struct small_src {
        const void *topk_idx;
        uint64_t topk_stride;        /* elements; 0 replaced by K_op */
        uint32_t num_tokens;
        uint32_t rank;
};

static __device__ uint64_t small_token(const struct epd_k_dispatch_args &a,
                                       const struct epd_ws_layout &l, uint32_t g,
                                       const struct epd_k_local *loc,
                                       const struct small_src *srcs, int32_t *sel,
                                       int32_t *tok, unsigned long long *first_bad,
                                       int32_t *nrow, uint32_t *first, uint64_t *ent)
{
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        const uint32_t K = a.num_topk;
        uint64_t dmask = 0;

        *first = 0;
        if (g >= a.local_tokens)
                return 0;
        const uint32_t i = epd__k_find_local(loc, a.num_local, g);
        const struct small_src *src = &srcs[i];
        const uint32_t s = src->rank, t = g - loc[i].token_offset;
        if (src->num_tokens > a.max_tokens)
                return 0;

        const uint64_t row0 = (uint64_t)t * src->topk_stride;
        int32_t *topk = epd_ws_i32(a.workspace, l.topk), *row = epd_ws_i32(a.workspace, l.row);
        uint32_t bad = UINT32_MAX;

        *ent = epd_ws_entry(&l, s, t, K, 0);
        /* The loads first, all in flight together: each id as -1, in range, or -2 (bad). */
        for (uint32_t k = 0; k < K; k++) {
                const int64_t v = epd__k_load_topk(src->topk_idx, a.topk_dtype, row0 + k);
                nrow[k] = v >= 0 && v < (int64_t)E ? (int32_t)v : v == -1 ? -1 : -2;
        }
        /* The count step's pass A: ids outside [0, E) other than -1, and repeats, are bad and
         * normalised to -1. */
        for (uint32_t k = 0; k < K; k++) {
                const int32_t v = nrow[k];
                int32_t norm = -1;
                if (v >= 0) {
                        norm = v;
                        for (uint32_t j = 0; j < k; j++) {
                                if (nrow[j] >= 0 && (nrow[j] & 0xffff) == norm) {
                                        norm = -1;
                                        bad = min(bad, k);
                                        break;
                                }
                        }
                } else if (v != -1) {
                        bad = min(bad, k);
                }
                topk[*ent + k] = norm;
                row[*ent + k] = -1; /* first positions get theirs in the caller */
                nrow[k] = -1;
                if (norm < 0)
                        continue;
                const uint32_t d = epd_route_expert_rank(norm, L);
                nrow[k] = norm | (int32_t)(d << 16);
                atomicAdd(&sel[(uint64_t)s * E + norm], 1);
                if (!((dmask >> d) & 1)) {
                        dmask |= 1ull << d;
                        *first |= 1u << k;
                        atomicAdd(&tok[(uint64_t)s * R + d], 1);
                }
        }
        if (bad != UINT32_MAX)
                atomicMin(first_bad, (unsigned long long)s << 32 | (t * K + bad));
        return dmask;
}

static __global__ void __launch_bounds__(SMALL_THREADS, 1)
        route_small_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                           const __grid_constant__ struct epd_ws_layout l)
{
        extern __shared__ int32_t smem[];
        __shared__ unsigned long long first_bad; /* (source << 32) | t * K_op + k; lowest wins */
        __shared__ uint32_t num_short, first_short;
        __shared__ struct epd_k_local loc[SMALL_MAX_RANKS + 1];
        __shared__ struct small_src srcs[SMALL_MAX_RANKS];
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        const uint32_t K = a.num_topk, C = l.num_chunks;
        const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        int32_t *sel = smem;                          /* [R][E] */
        int32_t *tok = sel + (uint64_t)R * E;         /* [R][R] */
        int32_t *ecount = tok + (uint64_t)R * R;      /* [E] */
        int32_t *wtot = ecount + E;                   /* [SMALL_WARPS][R] */
        int32_t *carry = wtot + (uint64_t)SMALL_WARPS * R; /* [R] */
        int32_t *rows = carry + R;                    /* [SMALL_THREADS][stride] */
        int32_t *nrow = rows + (uint64_t)threadIdx.x * small_row_stride(K); /* this thread's */
        void *ws = a.workspace;

        /* The copy kernel may start now (when launched as this kernel's programmatic dependent):
         * its blocks take the other multiprocessors and pull their source rows into L2 while
         * this block routes; they wait for this grid's completion (griddepcontrol.wait) before
         * they read anything written here. */
        asm volatile("griddepcontrol.launch_dependents;" : : : "memory");

        /* The counters; each row is written before it is read. */
        for (uint64_t i = threadIdx.x; i < (uint64_t)(rows - smem); i += blockDim.x)
                smem[i] = 0;
        if (threadIdx.x == 0) {
                first_bad = ~0ull;
                num_short = 0;
                first_short = UINT32_MAX;
        }
        if (threadIdx.x <= a.num_local)
                loc[threadIdx.x] = a.local[threadIdx.x];
        if (threadIdx.x < a.num_local) {
                const uint32_t s = a.local[threadIdx.x].rank;
                const struct epd_k_dispatch_rank *r = &a.ranks[s];
                srcs[threadIdx.x] = (struct small_src){
                        r->topk_idx, r->topk_stride != 0 ? r->topk_stride : K, r->num_tokens, s };
        }
        __syncthreads();
        /* A source claiming more than T tokens is rejected (BAD_TOKENS, as the count step
         * does) and contributes nothing; having no entries, its key (s, 0) is its own. */
        if (threadIdx.x < a.num_local && srcs[threadIdx.x].num_tokens > a.max_tokens)
                atomicMin(&first_bad, (unsigned long long)srcs[threadIdx.x].rank << 32);

        /* Rounds of SMALL_THREADS tokens in flat order; carry[d] holds the tokens of earlier
         * rounds going to d. */
        for (uint32_t base = 0; base < a.local_tokens; base += SMALL_THREADS) {
                uint32_t first;
                uint64_t ent = 0;
                const uint64_t dmask = small_token(a, l, base + threadIdx.x, loc, srcs, sel,
                                                   tok, &first_bad, nrow, &first, &ent);

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
                                if ((uint32_t)nrow[k] >> 16 == d) {
                                        epd_ws_i32(ws, l.row)[ent + k] = row;
                                        break;
                                }
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
                      size_t *smem)
{
        int ret = epd__k_check_dispatch(args, l);

        if (ret < 0)
                return ret;
        if (args->layout != EPD_LAYOUT_NON_EXPAND || args->num_local != args->world_size ||
            args->world_size > SMALL_MAX_RANKS || args->local_tokens > EPD_K_SMALL_MAX_TOKENS)
                return EPD_INVALID_ARGUMENT;
        *smem = small_smem_bytes(args->world_size, args->num_experts, args->num_topk);
        /* Also raises the kernel's limit when needed: this is the launch's plan. */
        return epd__k_dynamic_smem((const void *)route_small_kernel, *smem);
}

extern "C" int epd_k_dispatch_route_small_ok(const struct epd_k_dispatch_args *args)
{
        struct epd_ws_layout l;
        size_t smem = 0;

        return small_plan(args, &l, &smem) == 0;
}

extern "C" int epd_k_dispatch_route_small(const struct epd_k_dispatch_args *args,
                                          cudaStream_t stream)
{
        struct epd_ws_layout l;
        size_t smem = 0;
        int ret = small_plan(args, &l, &smem);

        if (ret < 0)
                return ret;
        route_small_kernel<<<1, SMALL_THREADS, smem, stream>>>(*args, l);
        return epd__k_launch_status();
}

int epd__k_preload_route_small(void)
{
        struct cudaFuncAttributes attr;
        return epd__k_cuda_status(cudaFuncGetAttributes(&attr, route_small_kernel));
}
