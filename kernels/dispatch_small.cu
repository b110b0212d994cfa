/* dispatch_small.cu - a whole small NON_EXPAND dispatch in one launch: each cluster of blocks
 * routes the entire op, sharing the work through distributed shared memory, then each block copies
 * its own share of the tokens. Clusters never wait for each other.
 *
 * Why. A decode-sized op (8 ranks x 128 tokens, K = 8) has 8192 entries. Routing them through a
 * grid-wide exchange (route_small.cu: blocks that wait on each other's flags in global memory,
 * then a copy kernel that waits for the routing grid to end) is a chain of dependent global
 * round trips before the first row moves, as long as the copy itself. Routing the whole op in
 * every block instead removes every wait but costs each multiprocessor the instructions of all
 * 8192 entries, nearly as long again. A cluster of C
 * blocks (Hopper thread block clusters, C = 8 where the device fits it) splits that work C ways
 * and meets at hardware cluster barriers, a few hundred nanoseconds each; the grid's clusters
 * all compute the same routing, so each one knows every rank's row count and the validity of
 * every entry, and docs/semantics.md §2.5 ("no output byte is written unless every rank's capacity
 * holds and every row is valid") holds cluster by cluster without a grid-wide barrier.
 *
 * Scope: what route_small takes (NON_EXPAND, every rank on the launching device in ascending rank
 * order) with at most 1024 * C local tokens, and outputs whose addresses are known before the op
 * (client memory; the daemon's arena is placed from the counts, so it keeps route_small -> copy).
 *
 * Tokens are in the local flat order (source-major, as the host builds `local`) and cut into
 * groups of 32; block cr of a cluster routes groups q = w * C + cr with warp w, a thread per
 * token. Phases, with cluster barriers (cluster.sync()) between them:
 *   1. Each thread validates its token (route_token_regs / route_token, the functions route_small
 *      uses) and records its first bad entry in its block's bad key; a ballot per destination
 *      gives the group's counts, kept in the block's wcnt[q] (and the ballot in wbal[q]). Then
 *      cluster 0 alone, after barrier 1, counts the selections of each (source, expert) into
 *      the histogram of the block that writes that expert's destination (block d % C holds
 *      destination d), with atomics on that block's shared memory.
 *   2. Each block scans the counts per destination, reading each group's from the block that
 *      owns it, and takes the minimum of the blocks' bad keys: the row of (g, d) is the number
 *      of earlier flat tokens going to d (docs/semantics.md §2.1: ascending source, then token), the
 *      totals are each destination's rows. Each thread then knows its token's rows; in cluster
 *      0 the first token of each source stores the prefixes (rank_prefix) into block 0.
 *   3. The workspace: each copied token's topk and rows (by the lanes of the warp that routed
 *      it, a position each, in the cluster that copies it); rank_prefix, tok_count and the
 *      verdict (block 0 of cluster 0); destination d's expert counts, aligned counts, bases and
 *      per-source prefixes (block d % C of cluster 0). So the workspace ends up as after count +
 *      prefix + place, and combine and cached dispatch follow unchanged (tests/gpu compares
 *      every array they read). chunk_count, chunk_base, `local` and the error records of chunks
 *      without an error are not written: nothing after place reads them.
 *      Meanwhile the warps that do not scan ask the L2 for the source rows this block copies
 *      (ds_prefetch_rows).
 *   4. If the op is valid and fits, the block's warps copy the tokens it owns, a (token, slice)
 *      item per warp (copy_token_rows, as the copy step does). Token (group q, lane l) is copied
 *      by the block that routed q in copying cluster ((q / C) * 32 + l) % (number of copying
 *      clusters). With DS_SKIP0_CLUSTERS clusters or more, cluster 0 does not copy: its blocks
 *      finish phase 3 last. Dealing the tokens by rows or sorted by destinations makes the op
 *      slower (docs/performance.md, "Tried, and did not help"); a block ends with its slowest
 *      warp, so the token's scales and metadata are spread over its slices (copy_token_rows).
 *
 * Memory ordering. Every rank's descriptor is copied into the block's shared memory (sranks) by the
 * whole block before the setup's __syncthreads(); the copy reads it from there. In phase 3 a lane
 * reads the routing row (nsm) that another lane of its warp wrote in phase 1, and the prefixes
 * (wpre) the scanning warps wrote in phase 2: both were written before the __syncthreads() that
 * ends the scan, and read after it. Inside a cluster,
 * shared memory written before a cluster.sync() (barrier.cluster arrive.release / wait.acquire,
 * cluster scope) is visible to every block of the cluster after it: the zeroed histogram before a
 * peer adds to it (barrier 1), the group counts, bad keys and histogram before they are read
 * (barrier 2), the prefixes stored into block 0 before it reads them (barrier 3). Only cluster 0
 * writes into a peer before barrier 2, so only cluster 0 has barrier 1 (a cluster-uniform branch),
 * after its routing: until then every block touches only its own shared memory, and the routing's
 * loads start without waiting for the cluster's slowest block. Barrier 2 also guarantees, in every
 * cluster, that each block is running before a peer reads its shared memory. wbal never leaves its
 * block: lane 0 of the routing warp writes it in phase 1, the same warp's lanes read it in phase 3,
 * after barrier 2 (and, in cluster 0, 3). Barrier 3: cluster 0 passes it whole (cluster.sync()),
 * after its prefix stores into block 0, which reads them next. The copying clusters split it: every
 * thread arrives after its block's last access to a peer's shared memory (the scan's loads and the
 * bad keys, whose values it has used: a relaxed arrival, as nothing it wrote is read across blocks
 * after barrier 2), and waits only before it returns, so that no block's shared memory goes away
 * while a peer may still read it and no copy waits for the slower block of its cluster. Across
 * clusters nothing is shared: the inputs (topk_idx, x, scales, weights, descriptors) are read-only
 * for the whole op, and every workspace word and output byte has exactly one writer in the grid.
 * The L2 prefetch of the source rows after barrier 2 (ds_prefetch_rows) reads only those
 * read-only inputs and writes nothing, so it needs no ordering. Whatever it changes is what the
 * L2 holds.
 * Block 0's rank_prefix stores precede the __syncthreads() before write_verdict, which reads them
 * back (same block). The verdict's status is stored last with a .sys release (write_verdict), for
 * the host, which copies the reply block after the kernel completes on the stream, or, given
 * reply_copy, reads the copy this kernel writes into its pinned memory (each value by the thread
 * that writes the workspace's, the status last with a .sys release; the host reads after the stream
 * completes, which makes every store of the kernel visible to it); combine and cached dispatch read
 * the workspace after a kernel boundary, and the stream order (or event) after the kernel publishes
 * the outputs.
 */
#include <atomic>
#include <cooperative_groups.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "copy_token.cuh"
#include "internal.cuh"
#include "route_token.cuh"
#include "verdict.cuh"

namespace cg = cooperative_groups;

#define DS_THREADS 1024
#define DS_WARPS (DS_THREADS / 32)
/* Cluster sizes tried, largest first (8 is the portable maximum). */
#define DS_MAX_CLUSTER 8
/* From this many clusters on, cluster 0 leaves the copy to the others. */
#define DS_SKIP0_CLUSTERS 4
/* K_op up to this routes in registers (route_token_regs), larger ones in shared memory. */
#define DS_REG_TOPK 8

/* Dynamic shared memory, int32 words, one definition for the launcher and the kernel; G groups
 * of 32 tokens, nd = ceil(R / C) destinations per block:
 *   nrow  [DS_THREADS][stride]   each thread's normalised row (route_token's scratch, or a copy
 *                                of route_token_regs' registers for indexing by a variable k)
 *   wcnt  [G][R]                 tokens of group q going to each destination
 *   wbal  [G][R]                 this block's groups only: the ballot behind each count, the
 *                                lanes of q going to each destination
 *   wpre  [G][R]                 after the scan: rows before group q at each destination
 *   total [R]                    rows of each destination
 *   pfx   [R + 1][R]             block 0 of cluster 0: rows before source s's first token
 *   hist  [nd][R][L]             cluster 0: selections of local destination slot x's experts
 *                                (destination cr + C x) from each source
 *   algn  [L]                    their aligned totals
 *   sexp  [slots][K_op]          tokens this block copies: normalised experts
 *   srow  [slots][K_op]          their rows of first positions, -1 elsewhere */
struct ds_smem {
        uint32_t nrow, wcnt, wbal, wpre, total, pfx, hist, algn, sexp, srow, words;
};

static __host__ __device__ struct ds_smem ds_smem_layout(uint32_t R, uint32_t E, uint32_t K,
                                                         uint32_t G, uint32_t C, uint32_t slots)
{
        struct ds_smem m;
        uint32_t w = 0;

        m.nrow = w;
        w += DS_THREADS * small_row_stride(K);
        m.wcnt = w;
        w += G * R;
        m.wbal = w;
        w += G * R;
        m.wpre = w;
        w += G * R;
        m.total = w;
        w += R;
        m.pfx = w;
        w += (R + 1) * R;
        m.hist = w;
        w += (R + C - 1) / C * E; /* nd x R x L, R x L = E */
        m.algn = w;
        w += E / R;
        m.sexp = w;
        w += slots * K;
        m.srow = w;
        w += slots * K;
        m.words = w;
        return m;
}

/* A local source as the block needs it, in shared memory so that no load waits on a descriptor
 * load. */
struct ds_src {
        const void *topk_idx;
        uint64_t topk_stride; /* elements; 0 replaced by K_op */
        uint32_t num_tokens;  /* above T: BAD_TOKENS, and its tokens are skipped */
        uint32_t offset;      /* first flat token */
        uint32_t rank;
        uint32_t reserved;
};

/* The whole block copies the R rank descriptors (read-only for the launch) into shared memory,
 * in 8-byte words; the caller syncs the block before anyone reads the copy. */
static __device__ __forceinline__ void ds_copy_ranks(struct epd_k_dispatch_rank *dst,
                                                     const struct epd_k_dispatch_rank *src,
                                                     uint32_t R)
{
        static_assert(sizeof(*dst) % 8 == 0, "descriptors are copied in 8-byte words");
        const uint64_t *s = (const uint64_t *)src;
        uint64_t *d = (uint64_t *)dst;

        for (uint32_t x = threadIdx.x; x < R * sizeof(*dst) / 8; x += blockDim.x)
                d[x] = s[x];
}

/* The local source of flat token g: the last i with offset <= g (empty sources skipped). */
static __device__ __forceinline__ uint32_t ds_source_of(const struct ds_src *srcs, uint32_t nl,
                                                       uint32_t g)
{
        uint32_t lo = 0, hi = nl;

        while (hi - lo > 1) {
                const uint32_t mid = (lo + hi) / 2;
                if (srcs[mid].offset <= g)
                        lo = mid;
                else
                        hi = mid;
        }
        return lo;
}

/* Copy item `it` of block cr of the copying cluster cc (of ncc): slice it % slices of the token
 * in slot it / slices, whose index among the tokens this block routes is slot * ncc + cc: group
 * (index / 32) * C + cr, lane index % 32. Returns its flat token, or UINT32_MAX when the slot is
 * past the op. */
static __device__ __forceinline__ uint32_t ds_item_token(uint32_t it, uint32_t slices,
                                                        uint32_t ncc, uint32_t cc, uint32_t C,
                                                        uint32_t cr, uint32_t G, uint32_t n)
{
        const uint32_t cb = it / slices * ncc + cc;
        const uint32_t q = cb / 32 * C + cr, g = q * 32 + cb % 32;
        return q < G && g < n ? g : UINT32_MAX;
}

/* The L2 prefetch of the copy's source rows.
 * After barrier 2, while the scan, barrier 3 and the workspace entries run (a stretch in which
 * the DRAM is otherwise idle), the warps that take no part in the scan (R <= warp < DS_WARPS - 1)
 * ask the L2 for the x row and the scales of each token this block will copy: one bulk prefetch
 * per row (epd__k_prefetch_l2_bulk), slot j by warp R + j modulo those warps. The copy's loads
 * then hit the L2. Issued by the bulk-copy engine, the prefetches sit in no warp's queue of
 * global accesses, so the scan's reads of its peers' shared memory do not wait behind them (loads
 * or cp.async issued there do), and issued after barrier 2 they do not compete with any block's
 * top-k loads; issued right after each warp's own routing they make the op slower than no
 * prefetch at all (docs/performance.md, "Design choices and their measured effect"). A hint:
 * nothing reads what it does, and it reads only bytes the copy reads. */
static __device__ __forceinline__ void ds_prefetch_rows(const struct epd_k_dispatch_args &a,
                                                        const struct epd_k_dispatch_rank *sranks,
                                                        const struct ds_src *srcs, uint32_t nl,
                                                        uint32_t slots, uint32_t slices,
                                                        uint32_t ncc, uint32_t cc, uint32_t C,
                                                        uint32_t cr, uint32_t G, uint32_t n,
                                                        uint32_t warp, uint32_t lane)
{
        const uint32_t R = a.world_size;
        if (warp < R || warp >= DS_WARPS - 1 || lane > 1)
                return;
        for (uint32_t j = warp - R; j < slots; j += DS_WARPS - 1 - R) {
                const uint32_t g = ds_item_token(j * slices, slices, ncc, cc, C, cr, G, n);
                if (g == UINT32_MAX)
                        continue;
                const uint32_t i = ds_source_of(srcs, nl, g), t = g - srcs[i].offset;
                if (srcs[i].num_tokens > a.max_tokens)
                        continue;
                const struct epd_k_dispatch_rank *src = &sranks[srcs[i].rank];
                if (lane == 0)
                        epd__k_prefetch_l2_bulk(src->in.x.ptr + (uint64_t)t * src->in.x.stride,
                                                a.row_bytes);
                else if (a.scale_bytes != 0 && src->in.scales.ptr != NULL)
                        epd__k_prefetch_l2_bulk(src->in.scales.ptr + (uint64_t)t * src->in.scales.stride,
                                                a.scale_bytes);
        }
}

/* An int32 of the reply block at byte offset off + 4 * i: into the workspace, and into the host's
 * copy when the launcher was given one (epd_k_dispatch_args.reply_copy). */
static __device__ __forceinline__ void ds_reply_i32(const struct epd_k_dispatch_args &a,
                                                    uint64_t off, uint64_t i, int32_t v)
{
        epd_ws_i32(a.workspace, off)[i] = v;
        if (a.reply_copy != NULL)
                epd_ws_i32(a.reply_copy, off)[i] = v;
}

/* The verdict that write_verdict stored into the workspace (this thread's own stores, read
 * back), copied into the host's copy of the reply block, the status last with a .sys release
 * like the original. */
static __device__ void ds_reply_verdict(const struct epd_k_dispatch_args &a,
                                        const struct epd_ws_layout &l)
{
        if (a.reply_copy == NULL)
                return;
        const struct epd_ws_error *src = epd_ws_error_rec(a.workspace, &l);
        struct epd_ws_error *dst = epd_ws_error_rec(a.reply_copy, &l);
        dst->reason = src->reason;
        dst->rank = src->rank;
        dst->num_short = src->num_short;
        dst->token = src->token;
        dst->pos = src->pos;
        dst->value = src->value;
        dst->capacity = src->capacity;
        epd_st_release_sys_s32(&dst->status, src->status);
}

/* Destination d's expert counts, written by block d % C of cluster 0 from its histogram slot
 * (docs/semantics.md §2.3; the same numbers as the prefix step's): sel_count[s][e],
 * expert_src_prefix[e][s], expert_count, expert_aligned and expert_base[d]. Whole block. */
static __device__ void ds_expert_counts(const struct epd_k_dispatch_args &a,
                                        const struct epd_ws_layout &l, uint32_t d,
                                        const int32_t *hist, int32_t *algn)
{
        const uint32_t R = a.world_size, E = a.num_experts, L = l.num_local_experts;
        void *ws = a.workspace;

        for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) {
                const uint32_t e = d * L + le;
                int32_t run = 0;
                for (uint32_t s = 0; s < R; s++) {
                        const int32_t c = hist[s * L + le];
                        epd_ws_i32(ws, l.expert_src_prefix)[(uint64_t)e * R + s] = run;
                        epd_ws_i32(ws, l.sel_count)[(uint64_t)s * E + e] = c;
                        run += c;
                }
                algn[le] = (int32_t)epd_route_align_up(run, a.expert_alignment);
                ds_reply_i32(a, l.expert_count, e, run);
                ds_reply_i32(a, l.expert_aligned, e, algn[le]);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
                int32_t *base = epd_ws_i32(ws, l.expert_base) + (uint64_t)d * (L + 1);
                warp_exclusive_scan(algn, base, L);
                __syncwarp(); /* the other lanes' stores, for the host's copy */
                for (uint32_t x = threadIdx.x; a.reply_copy != NULL && x <= L; x += 32)
                        epd_ws_i32(a.reply_copy, l.expert_base)[(uint64_t)d * (L + 1) + x] =
                                base[x];
        }
        __syncthreads(); /* algn is reused for the next destination */
}

template <uint32_t KMAX>
static __global__ void __launch_bounds__(DS_THREADS, 1)
        dispatch_small_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                              const __grid_constant__ struct epd_ws_layout l, uint32_t slots,
                              uint32_t slices, uint64_t slice_bytes, uint32_t skip0,
                              const __grid_constant__ struct epd__k_inline<struct epd_k_dispatch_rank> in)
{
        extern __shared__ int32_t smem[];
        __shared__ struct ds_src srcs[SMALL_MAX_RANKS];
        __shared__ uint64_t cap[SMALL_MAX_RANKS];
        /* Every rank's descriptor, for the copy: the loads in front of each warp's first row
         * (the source's x, the destinations' outputs) then run on shared memory. */
        __shared__ struct epd_k_dispatch_rank sranks[SMALL_MAX_RANKS];
        __shared__ unsigned long long bad_key; /* source << 32 | t * K_op + k; lowest wins */
        __shared__ unsigned long long bad_all; /* the minimum over the cluster */
        __shared__ uint32_t num_short, first_short;
        cg::cluster_group cluster = cg::this_cluster();
        const uint32_t C = cluster.num_blocks(), cr = cluster.block_rank();
        const uint32_t ncl = gridDim.x / C, c = blockIdx.x / C;
        /* The clusters that copy: all, or (skip0) all but cluster 0, which has the expert
         * counts and the verdict to write; cc is this one's index among them. */
        const uint32_t ncc = ncl - skip0, cc = c - skip0;
        const uint32_t R = a.world_size, E = a.num_experts, K = a.num_topk, T = a.max_tokens;
        const uint32_t L = l.num_local_experts, nl = a.num_local, n = a.local_tokens;
        const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const uint32_t below = (1u << lane) - 1;
        const uint32_t G = (n + 31) / 32, nd = (R + C - 1) / C;
        const uint64_t lmagic = epd_udiv_magic(L);
        const struct ds_smem m = ds_smem_layout(R, E, K, G, C, slots);
        int32_t *wcnt = smem + m.wcnt, *wpre = smem + m.wpre, *total = smem + m.total;
        uint32_t *wbal = (uint32_t *)smem + m.wbal;
        int32_t *pfx = smem + m.pfx, *hist = smem + m.hist, *algn = smem + m.algn;
        int32_t *sexp = smem + m.sexp, *srow = smem + m.srow;
        int32_t *nsm = smem + m.nrow + threadIdx.x * small_row_stride(K);
        int32_t nreg[KMAX ? KMAX : 1];
        void *ws = a.workspace;
        /* The descriptors: in the parameters when the launcher had host copies, else device
         * memory. */
        const struct epd_k_dispatch_rank *ranks = epd__k_ranks(in, a.ranks);
        const struct epd_k_local *local = epd__k_locals(in, a.local);

        if (threadIdx.x < nl) {
                /* Local index s is rank s (small_op_check: every rank is local, ascending),
                 * so the descriptor's load does not wait for local[]'s. */
                const struct epd_k_dispatch_rank *r = &ranks[threadIdx.x];
                srcs[threadIdx.x] = (struct ds_src){
                        r->topk_idx, r->topk_stride != 0 ? r->topk_stride : K, r->num_tokens,
                        local[threadIdx.x].token_offset, local[threadIdx.x].rank, 0 };
                cap[threadIdx.x] = r->capacity_rows;
        }
        if (threadIdx.x == 0) {
                bad_key = ~0ull;
                num_short = 0;
                first_short = UINT32_MAX;
        }
        ds_copy_ranks(sranks, ranks, R);
        /* The histogram and the prefixes: cluster 0's only. */
        for (uint32_t x = threadIdx.x; c == 0 && x < nd * E; x += blockDim.x)
                hist[x] = 0;
        for (uint32_t x = threadIdx.x; c == 0 && x < (R + 1) * R; x += blockDim.x)
                pfx[x] = 0;
        __syncthreads();
        if (threadIdx.x < nl && srcs[threadIdx.x].num_tokens > T)
                atomicMin(&bad_key, (unsigned long long)threadIdx.x << 32);

        /* 1: this thread's token: group q = warp * C + cr, flat token g. Until barrier 1 (or
         * barrier 2 outside cluster 0) a block touches only its own shared memory, so the
         * routing's loads do not wait for the cluster's other blocks. */
        const uint32_t q = warp * C + cr, g = q * 32 + lane;
        uint64_t dmask = 0;
        uint32_t first = 0, i = 0, t = 0;
        int valid = 0;
        if (q < G) { /* warp-uniform */
                if (g < n) {
                        i = ds_source_of(srcs, nl, g);
                        t = g - srcs[i].offset;
                        valid = srcs[i].num_tokens <= T;
                }
                if (valid) {
                        const uint64_t row0 = (uint64_t)t * srcs[i].topk_stride;
                        uint32_t bad;
                        if constexpr (KMAX != 0) {
                                dmask = route_token_regs<KMAX>(srcs[i].topk_idx, a.topk_dtype,
                                                               row0, K, E, lmagic, nreg, &first,
                                                               &bad);
#pragma unroll
                                for (uint32_t k = 0; k < KMAX; k++)
                                        if (k < K)
                                                nsm[k] = nreg[k];
                        } else {
                                dmask = route_token(srcs[i].topk_idx, a.topk_dtype, row0, K, E,
                                                    lmagic, nsm, &first, &bad);
                        }
                        if (bad != UINT32_MAX)
                                atomicMin(&bad_key, (unsigned long long)i << 32 | (t * K + bad));
                }
                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t bl = __ballot_sync(EPD_K_FULL_MASK, (dmask >> d) & 1);
                        if (lane == 0) {
                                wcnt[q * R + d] = __popc(bl);
                                wbal[q * R + d] = bl;
                        }
                }
        }
        if (c == 0) { /* cluster-uniform */
                cluster.sync(); /* 1: every block's histogram is zero before a peer adds to it */
                /* Cluster 0's expert histogram, in the block of each entry's destination. */
                for (uint32_t k = 0; valid && k < K; k++) {
                        const int32_t v = nsm[k];
                        if (v < 0)
                                continue;
                        const uint32_t d = (uint32_t)v >> 16;
                        int32_t *h = cluster.map_shared_rank(hist, d % C);
                        atomicAdd(&h[((d / C) * R + i) * L + (v & 0xffff) - d * L], 1);
                }
        }
        cluster.sync(); /* 2: every group's counts, bad key and histogram entry are in place */
        if (c != 0 || !skip0)
                ds_prefetch_rows(a, sranks, srcs, nl, slots, slices, ncc, cc, C, cr, G, n, warp,
                                 lane);

        /* 2: the scan, reading each group's counts from the block that owns it, and the
         * cluster's bad key. Warp d scans destination d's column over every group (a lane per
         * group, for 32 groups at a time) and checks its total against the capacity; a warp
         * past the destinations (the last one, which scans too only when R >= DS_WARPS) takes
         * the minimum of the blocks' bad keys. Gathering the counts into this block first
         * would cost two more block barriers. */
        if (warp == DS_WARPS - 1) {
                unsigned long long k = ~0ull;
                if (lane < C)
                        k = *cluster.map_shared_rank(&bad_key, lane);
                for (uint32_t o = 16; o != 0; o >>= 1) {
                        const unsigned long long v = __shfl_xor_sync(EPD_K_FULL_MASK, k, o);
                        k = v < k ? v : k;
                }
                if (lane == 0)
                        bad_all = k;
        }
        for (uint32_t d = warp; d < R; d += DS_WARPS) {
                int32_t carry = 0;
                for (uint32_t q0 = 0; q0 < G; q0 += 32) {
                        const uint32_t qq = q0 + lane, owner = qq % C;
                        int32_t v = 0;
                        if (qq < G)
                                v = (owner == cr ? wcnt : cluster.map_shared_rank(wcnt, owner))
                                        [qq * R + d];
                        const int32_t incl = warp_inclusive_scan(v);
                        if (qq < G)
                                wpre[qq * R + d] = carry + incl - v;
                        carry += __shfl_sync(EPD_K_FULL_MASK, incl, 31);
                }
                if (lane == 0) {
                        total[d] = carry;
                        if ((uint64_t)carry > cap[d]) {
                                atomicAdd(&num_short, 1u);
                                atomicMin(&first_short, d);
                        }
                }
        }
        __syncthreads();
        /* The prefixes: in cluster 0, the first token of each source stores them into block 0
         * (the exclusive count at that token, whether or not it goes to d). */
        if (c == 0 && q < G) { /* warp-uniform */
                const int head = valid && t == 0;
                int32_t *pfx0 = cluster.map_shared_rank(pfx, 0);
                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t bl = __ballot_sync(EPD_K_FULL_MASK, (dmask >> d) & 1);
                        if (head)
                                pfx0[i * R + d] = wpre[q * R + d] + __popc(bl & below);
                }
        }
        /* 3: this block is done with its peers' shared memory (and, in cluster 0, has stored
         * the prefixes into block 0). Cluster 0 waits here: block 0 reads the prefixes next.
         * The copying clusters arrive now and wait only before they return, so that no block
         * leaves while a peer may still read its counts or bad key; the copy does not wait for
         * the slower block of the cluster. */
        if (c == 0) {
                cluster.sync();
        } else {
                /* Relaxed: the loads from the peers have returned their values, and this block
                 * has written nothing a peer reads after barrier 2. */
                asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
        }

        /* The workspace entries and the slot rows of the tokens this cluster copies, a warp per
         * token of its own (those of its lanes whose token this cluster copies: mine), lane k
         * taking position k. A first position's row: the destination's rows before group q,
         * plus the group's earlier lanes going there (the phase-1 ballot, this block's own).
         * One lane per token, looping over its positions, would keep a warp here for a few
         * dozen instructions in one dependent chain, whatever the order of its loads and
         * stores; spread over the lanes the chain is K times shorter (docs/performance.md,
         * "Design choices and their measured effect"). */
        const uint32_t jb = warp * 32 + lane; /* the token's index among this block's */
        const int mine = valid && (c != 0 || !skip0) && jb % ncc == cc;
        for (uint32_t mm = __ballot_sync(EPD_K_FULL_MASK, mine); mm != 0; mm &= mm - 1) {
                const uint32_t o = __ffs(mm) - 1; /* the token's lane */
                const uint32_t oi = __shfl_sync(EPD_K_FULL_MASK, i, o);
                const uint32_t ot = __shfl_sync(EPD_K_FULL_MASK, t, o);
                const uint32_t ofirst = __shfl_sync(EPD_K_FULL_MASK, first, o);
                const uint32_t oslot = (warp * 32 + o) / ncc, obelow = (1u << o) - 1;
                const int32_t *onsm = smem + m.nrow + (warp * 32 + o) * small_row_stride(K);
                const uint64_t ent = epd_ws_entry(&l, srcs[oi].rank, ot, K, 0);
                for (uint32_t k = lane; k < K; k += 32) {
                        const int32_t v = onsm[k];
                        const uint32_t d = (uint32_t)v >> 16;
                        const int32_t e = v >= 0 ? v & 0xffff : -1;
                        const int32_t r = (ofirst >> k) & 1 ? wpre[q * R + d] +
                                                                      __popc(wbal[q * R + d] &
                                                                             obelow)
                                                            : -1;
                        sexp[oslot * K + k] = e;
                        srow[oslot * K + k] = r;
                        epd_ws_i32(ws, l.topk)[ent + k] = e;
                        epd_ws_i32(ws, l.row)[ent + k] = r;
                }
        }


        /* 3: the workspace's counts and the verdict, by cluster 0. */
        const int ok = bad_all == ~0ull && num_short == 0;
        if (c == 0 && cr == 0) {
                /* Sources without tokens of their own start where the next one does. */
                for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                        pfx[nl * R + d] = total[d];
                        for (uint32_t s = nl; s-- > 0;)
                                if (srcs[s].num_tokens == 0 || srcs[s].num_tokens > T)
                                        pfx[s * R + d] = pfx[(s + 1) * R + d];
                }
                __syncthreads();
                /* Local index s is rank s (every rank is local, ascending). */
                for (uint32_t x = threadIdx.x; x < (R + 1) * R; x += blockDim.x) {
                        const uint32_t s = x / R, d = x % R;
                        ds_reply_i32(a, l.rank_prefix, (uint64_t)d * (R + 1) + s, pfx[x]);
                        if (s < R)
                                epd_ws_i32(ws, l.tok_count)[(uint64_t)s * R + d] =
                                        pfx[x + R] - pfx[x];
                }
                __syncthreads(); /* rank_prefix stored: write_verdict reads it back */
                if (threadIdx.x == 0) {
                        uint32_t s = UINT32_MAX, chunk = UINT32_MAX;
                        if (bad_all != ~0ull) {
                                const uint32_t bi = (uint32_t)(bad_all >> 32);
                                const uint32_t bfirst = (uint32_t)bad_all;
                                const int bad_tokens = srcs[bi].num_tokens > T;
                                const uint32_t bc =
                                        bad_tokens ? 0 : bfirst / K / EPD_WS_CHUNK_TOKENS;
                                s = srcs[bi].rank;
                                chunk = s * l.num_chunks + bc;
                                write_chunk_error(&a, &l, s, bc, bad_tokens, bfirst);
                        }
                        write_verdict(&a, &l, s, chunk, num_short, first_short);
                        ds_reply_verdict(a, l);
                }
        }
        if (c == 0) {
                for (uint32_t x = 0; x < nd && cr + C * x < R; x++) /* block-uniform */
                        ds_expert_counts(a, l, cr + C * x, hist + x * E, algn);
        }
        if (!ok) {
                if (c != 0)
                        cluster.barrier_wait(); /* 3, see above */
                return;
        }
        __syncthreads(); /* every slot's rows are in place (ds_expert_counts syncs only in
                          * cluster 0) */
        if (c == 0 && skip0)
                return;

        /* 4: the tokens this block copies. */
        for (uint32_t it = warp; it < slots * slices; it += DS_WARPS) {
                const uint32_t j = it / slices;
                const uint32_t cg_ = ds_item_token(it, slices, ncc, cc, C, cr, G, n);
                if (cg_ == UINT32_MAX) /* warp-uniform */
                        continue;
                const uint32_t ci = ds_source_of(srcs, nl, cg_), ct = cg_ - srcs[ci].offset;
                const uint32_t s = srcs[ci].rank;
                int32_t expert = -1, row = -1;
                if (lane < K) {
                        expert = sexp[j * K + lane];
                        row = srow[j * K + lane];
                }
                copy_token_rows(&a, sranks, &l, s, ct, epd_ws_entry(&l, s, ct, K, 0), expert,
                                row, it % slices, slices, slice_bytes, lane);
        }
        if (c != 0)
                cluster.barrier_wait(); /* 3, see above */
}

/* A launch (struct epd_k_small_plan, epd_kernels.h): cluster size, grid, copied-token slots per
 * block, slicing, shared memory. */
typedef struct epd_k_small_plan ds_launch;

static const void *ds_kernel(uint32_t num_topk)
{
        return num_topk <= DS_REG_TOPK ? (const void *)dispatch_small_kernel<DS_REG_TOPK>
                                       : (const void *)dispatch_small_kernel<0>;
}

/* Clusters of each size (1, 2, 4, 8) resident at once on each device, for each kernel, asked of
 * the runtime once: with DS_THREADS threads of 64 registers a block fills a multiprocessor
 * whatever its shared memory, so the answer depends on the device and the cluster size only.
 * 0: not asked yet; -1: this size cannot run. Benign races: every writer stores the same value. */
#define DS_MAX_DEVICES 64
static std::atomic<int> ds_clusters[2][DS_MAX_DEVICES][4];

static int ds_resident_clusters(const ds_launch *p, int regs_kernel, const void *kernel)
{
        int device = 0, log = 31 - __builtin_clz(p->cluster);
        if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= DS_MAX_DEVICES) {
                (void)cudaGetLastError();
                return -1;
        }
        std::atomic<int> *slot = &ds_clusters[regs_kernel][device][log];
        int v = slot->load(std::memory_order_relaxed);
        if (v != 0)
                return v;
        struct epd__k_launch one = {};
        one.func = kernel;
        one.grid = dim3(p->cluster);
        one.block = dim3(DS_THREADS);
        one.smem = p->smem;
        one.cluster = p->cluster;
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = epd__k_launch_config(&one, &attr, 0);
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
                (void)cudaGetLastError();
                clusters = 0;
        }
        v = clusters >= 1 ? clusters : -1;
        slot->store(v, std::memory_order_relaxed);
        return v;
}

/* The launch of an op with clusters of p->cluster blocks: 0, 1 when this size cannot run, 2 when
 * neither can any smaller one, or an error. */
static int ds_plan_cluster(const struct epd_k_dispatch_args *args, uint32_t G, const void *kernel,
                           ds_launch *p)
{
        const uint32_t gpb = (G + p->cluster - 1) / p->cluster; /* groups per block */
        if (gpb > DS_WARPS)
                return 2; /* smaller clusters have more */
        /* Slots for the largest cluster count; fewer clusters only get more. */
        p->slots = gpb * 32;
        p->smem = 4ull * ds_smem_layout(args->world_size, args->num_experts,
                                        args->num_topk, G, p->cluster, p->slots)
                                 .words;
        /* Also raises the kernel's limit when needed: this is the launch's plan. */
        int ret = epd__k_dynamic_smem(kernel, p->smem);
        if (ret == EPD_INVALID_ARGUMENT)
                return 1;
        if (ret < 0)
                return ret;
        const int clusters =
                ds_resident_clusters(p, args->num_topk <= DS_REG_TOPK, kernel);
        if (clusters < 1)
                return 1;
        p->blocks = (uint32_t)clusters * p->cluster;
        /* Cluster 0 writes the expert counts and the verdict after the routing, which
         * makes its blocks the last to start copying, and a grid ends with its last
         * block; with enough clusters the others copy its share. */
        p->skip0 = clusters >= DS_SKIP0_CLUSTERS;
        /* Each block copies its share of gpb * 32 tokens, spread over the copying
         * clusters. */
        const uint32_t ncc = (uint32_t)clusters - p->skip0;
        p->slots = (gpb * 32 + ncc - 1) / ncc;
        p->smem = 4ull * ds_smem_layout(args->world_size, args->num_experts,
                                        args->num_topk, G, p->cluster, p->slots)
                                 .words;
        /* Slices: as many (token, slice) items as the block has warps, not more (a
         * warp with two items doubles the block's copy time), each slice a multiple of
         * 16 bytes so that every slice starts where the widest access may. */
        p->slices = 1;
        p->slice_bytes = args->row_bytes;
        if (p->slots != 0 && p->slots < DS_WARPS && args->row_bytes > 32 * 16) {
                uint64_t want = DS_WARPS / p->slots;
                p->slice_bytes = ((args->row_bytes + want - 1) / want + 15) / 16 * 16;
                p->slices = (uint32_t)((args->row_bytes + p->slice_bytes - 1) /
                                       p->slice_bytes);
        }
        return 0;
}

/* Whether an op qualifies, and its launch: the cluster size whose clusters, as many as are
 * resident at once, occupy the most multiprocessors, the largest such size on a tie. On an H200
 * (132 multiprocessors) clusters of 8 and of 4 fill 120 and clusters of 2 fill all 132, and
 * clusters of 2 make decode dispatch faster (docs/performance.md, "Design choices and their
 * measured effect"). The copy is bound by the rows' stores, and more multiprocessors issue more
 * of them; the routing is the same per thread whatever the cluster size. */
static int ds_plan(const struct epd_k_dispatch_args *args, struct epd_ws_layout *l,
                   ds_launch *p)
{
        int ret = small_op_check(args, l);

        if (ret < 0)
                return ret;
        const uint32_t n = args->local_tokens, G = (n + 31) / 32;
        const void *kernel = ds_kernel(args->num_topk);
        ds_launch best = {}, cand;
        for (uint32_t c = DS_MAX_CLUSTER; c >= 1; c /= 2) {
                cand = (ds_launch){};
                cand.cluster = c;
                ret = ds_plan_cluster(args, G, kernel, &cand);
                if (ret < 0)
                        return ret;
                if (ret == 2)
                        break;
                if (ret == 0 && cand.blocks > best.blocks)
                        best = cand;
        }
        if (best.blocks == 0)
                return EPD_INVALID_ARGUMENT;
        *p = best;
        return 0;
}

extern "C" int epd_k_dispatch_small_ok(const struct epd_k_dispatch_args *args)
{
        struct epd_ws_layout l;
        ds_launch p = {};

        return ds_plan(args, &l, &p) == 0;
}

extern "C" int epd_k_dispatch_small_plan(const struct epd_k_dispatch_args *args,
                                         struct epd_k_small_plan *plan)
{
        struct epd_ws_layout l;

        memset(plan, 0, sizeof(*plan));
        return ds_plan(args, &l, plan);
}

/* The launch of plan p, described; its parameters point at *args, *l, *p and *in (which it
 * fills). */
static int ds_describe(const struct epd_k_dispatch_args *args, const struct epd_k_small_plan *p,
                       struct epd_ws_layout *l, struct epd__k_inline<struct epd_k_dispatch_rank> *in,
                       struct epd__k_launch *d)
{
        int ret = small_op_check(args, l);

        if (ret < 0)
                return ret;
        if (p->cluster == 0 || p->blocks == 0 || p->blocks % p->cluster != 0)
                return EPD_INVALID_ARGUMENT; /* not a plan of epd_k_dispatch_small_plan */
        *d = (struct epd__k_launch){};
        d->func = ds_kernel(args->num_topk);
        d->grid = dim3(p->blocks);
        d->block = dim3(DS_THREADS);
        d->smem = p->smem;
        d->cluster = p->cluster;
        d->params[0] = args;
        d->params[1] = l;
        d->params[2] = &p->slots;
        d->params[3] = &p->slices;
        d->params[4] = &p->slice_bytes;
        d->params[5] = &p->skip0;
        epd__k_inline_fill(in, args);
        d->params[6] = in;
        return 0;
}

extern "C" int epd_k_dispatch_small_launch(const struct epd_k_dispatch_args *args,
                                           const struct epd_k_small_plan *p, cudaStream_t stream)
{
        struct epd_ws_layout l;
        struct epd__k_inline<struct epd_k_dispatch_rank> in;
        struct epd__k_launch d;
        int ret = ds_describe(args, p, &l, &in, &d);

        return ret < 0 ? ret : epd__k_launch_direct(&d, stream);
}

extern "C" int epd_k_dispatch_small_timed(const struct epd_k_dispatch_args *args,
                                          const struct epd_k_small_plan *p, struct epd_k_timed *t,
                                          cudaEvent_t t0, cudaEvent_t t1, cudaStream_t stream)
{
        struct epd_ws_layout l;
        struct epd__k_inline<struct epd_k_dispatch_rank> in;
        struct epd__k_launch d;
        int ret = ds_describe(args, p, &l, &in, &d);

        return ret < 0 ? ret : epd__k_launch_timed(t, &d, t0, t1, stream);
}

extern "C" int epd_k_dispatch_small(const struct epd_k_dispatch_args *args, cudaStream_t stream)
{
        struct epd_k_small_plan p;
        int ret = epd_k_dispatch_small_plan(args, &p);

        return ret < 0 ? ret : epd_k_dispatch_small_launch(args, &p, stream);
}

int epd__k_preload_dispatch_small(void)
{
        struct cudaFuncAttributes attr;
        int ret = epd__k_cuda_status(cudaFuncGetAttributes(&attr, ds_kernel(1)));
        return ret < 0 ? ret : epd__k_cuda_status(cudaFuncGetAttributes(&attr, ds_kernel(32)));
}
