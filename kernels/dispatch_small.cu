/* dispatch_small.cu - a whole small NON_EXPAND dispatch in one launch, with no communication
 * between blocks: every block routes the entire op, then copies its own share of the tokens.
 *
 * Why. A decode-sized op (8 ranks x 128 tokens, K = 8) has 8192 entries. Routing them through a
 * grid-wide exchange (route_small.cu: blocks that wait on each other's flags, then a copy kernel
 * that waits for the routing grid to end) costs a chain of dependent global-memory round trips,
 * about 19 us before the first row moves, for a copy of about 20 us. Routing the op once per
 * block instead costs each block a pass over 64 KB of ids (L2-resident after the first block
 * touches them) and a few shared-memory scans: a few microseconds, and no block ever waits for
 * another. Every block sees the same inputs and computes the same verdict, so "no output byte
 * is written unless every rank's capacity holds and every row is valid" (SEMANTICS.md 2.5) holds
 * block by block, without a grid-wide barrier.
 *
 * Scope: what route_small takes (NON_EXPAND, every rank on the launching device in ascending
 * rank order, at most EPD_K_SMALL_MAX_TOKENS local tokens), outputs in client memory (the
 * daemon's arena placement needs the counts on the host before the copy, so it keeps
 * route_small -> copy).
 *
 * A block of DS_THREADS threads, one per multiprocessor:
 *   0. Each warp asks L2 for the source bytes of its first copy item, so that they arrive while
 *      the block routes.
 *   1. Rounds of DS_THREADS flat tokens (source-major, as the host builds `local`): each thread
 *      validates its token (route_token, the same function route_small uses), records the
 *      first bad entry, and a ballot per destination gives each warp's count. A token owned by
 *      this block (flat index g with g % gridDim == blockIdx) keeps its normalised row in a
 *      slot. Block d < R also counts the selections of destination d's experts per source.
 *   2. A scan of the warp counts per destination: the row of (g, d) is the number of earlier
 *      flat tokens going to d (SEMANTICS.md 2.1: ascending source, then token), the totals are
 *      each destination's rows, and the prefix at a source's first token is rank_prefix.
 *   3. The workspace: each owned token's topk and rows, rank_prefix and tok_count (block 0),
 *      destination d's expert counts, aligned counts, bases and per-source prefixes (block d),
 *      the first bad entry's error record and the verdict (block 0). So the workspace ends up
 *      as after count + prefix + place, and combine and cached dispatch follow unchanged
 *      (tests/gpu compares every array they read). chunk_count, chunk_base, `local` and the
 *      error records of chunks without an error are not written: nothing after place reads
 *      them.
 *   4. If the op is valid and fits, the block's warps copy its owned tokens, a (token, slice)
 *      item per warp (copy_token_rows, as the copy step does).
 *
 * Memory ordering. The blocks never read what another block writes: the inputs (topk_idx, x,
 * scales, weights, descriptors) are read-only for the whole op, and every workspace word and
 * output byte has exactly one writer (the owner of its token, block 0, or block d for
 * destination d's experts). Inside a block, __syncthreads() orders the shared-memory phases,
 * and block 0's rank_prefix stores before the __syncthreads() that precedes write_verdict,
 * which reads them back (CTA scope suffices: same block). The verdict's status is stored last
 * with a .sys release (write_verdict), for the host, which copies the reply block after the
 * kernel completes on the stream. Combine and cached dispatch read the workspace after a kernel
 * boundary. The daemon's stream order (or its event) after the kernel publishes the outputs to
 * the clients.
 */
#include <stdint.h>
#include <stdlib.h>

#include "copy_token.cuh"
#include "internal.cuh"
#include "route_token.cuh"
#include "verdict.cuh"

#define DS_THREADS 1024
#define DS_WARPS (DS_THREADS / 32)
#define DS_MAX_ROUNDS ((EPD_K_SMALL_MAX_TOKENS + DS_THREADS - 1) / DS_THREADS)
/* A K_op that divides 32 and is at most this routes a warp's tokens with a lane per entry
 * (ds_route_lanes); ds_load_rows loads this many ids per lane at a time. */
#define DS_LANE_TOPK 8

/* Dynamic shared memory, int32 words, one definition for the launcher and the kernel:
 *   nrow  [DS_THREADS][stride]       each thread's token's row: its ids, loaded by its warp and
 *                                    normalised (by the thread, or by ds_route_lanes)
 *   tdm   [DS_THREADS] (2 words each)  ds_route_lanes: each token's destination mask
 *   tfb   [DS_THREADS]               ds_route_lanes: its first-position bits
 *   tbad  [DS_THREADS]               ds_route_lanes: its first bad position
 *   wcnt  [rounds][DS_WARPS][R]      tokens of each warp going to each destination, then, after
 *                                    the scan, the rows before that warp
 *   total [R]                        rows of each destination
 *   pfx   [R + 1][R]                 rows before source s's first token, at each destination
 *   hist  [R][L]                     block d: selections of d's local experts from each source
 *   algn  [L]                        block d: their aligned totals
 *   sexp  [slots][K_op]              owned tokens: normalised experts
 *   srow  [slots][K_op]              owned tokens: rows of first positions, -1 elsewhere
 *   pre   [DS_WARPS][COPY_SLICE_UNIT bytes]  each warp's first slice, loaded ahead (only when
 *                                    `preload`; 16-byte aligned) */
struct ds_smem {
        uint32_t nrow, tdm, tfb, tbad, wcnt, total, pfx, hist, algn, sexp, srow, pre, words;
};

static __host__ __device__ struct ds_smem ds_smem_layout(uint32_t R, uint32_t E, uint32_t K,
                                                         uint32_t rounds, uint32_t slots,
                                                         int preload)
{
        struct ds_smem m;
        uint32_t w = 0;

        m.nrow = w;
        w += DS_THREADS * small_row_stride(K);
        w = (w + 1) / 2 * 2; /* 8 bytes */
        m.tdm = w;
        w += 2 * DS_THREADS;
        m.tfb = w;
        w += DS_THREADS;
        m.tbad = w;
        w += DS_THREADS;
        m.wcnt = w;
        w += rounds * DS_WARPS * R;
        m.total = w;
        w += R;
        m.pfx = w;
        w += (R + 1) * R;
        m.hist = w;
        w += E; /* R x L */
        m.algn = w;
        w += E / R;
        m.sexp = w;
        w += slots * K;
        m.srow = w;
        w += slots * K;
        w = (w + 3) / 4 * 4; /* 16 bytes */
        m.pre = w;
        if (preload)
                w += DS_WARPS * COPY_SLICE_UNIT / 4;
        m.words = w;
        return m;
}

/* A local source as the block needs it: what its descriptor holds for the routing and for
 * the loads ahead, in shared memory so that no load waits on a descriptor load. */
struct ds_src {
        const void *topk_idx;
        uint64_t topk_stride; /* elements; 0 replaced by K_op */
        uint32_t num_tokens;  /* above T: BAD_TOKENS, and its tokens are skipped */
        uint32_t offset;      /* first flat token */
        uint32_t rank;
        uint32_t reserved;
        struct epd_k_mat x, weights;
};

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

/* DS_TRACE builds (experiments only) stamp each block's phases with the global timer into the
 * workspace's `local` area, which this kernel does not otherwise use. */
#ifdef DS_TRACE
#define DS_STAMP(i)                                                                              \
        do {                                                                                     \
                if (threadIdx.x == 0)                                                            \
                        ((uint64_t *)((uint8_t *)a.workspace + l.local))[b * 8 + (i)] =     \
                                epd_globaltimer_ns();                                            \
        } while (0)
#else
#define DS_STAMP(i) ((void)0)
#endif

/* One round of one warp, K_op > DS_LANE_TOPK or not dividing 32: the ids of the warp's 32
 * tokens into their rows (classified, route_classify), to be normalised per thread. Entry f =
 * (token tw, position k) of the warp goes to lane f % 32, so consecutive lanes read consecutive
 * ids (one source with rows K_op apart is one contiguous range). Each lane knows its own token
 * (my_*); the others take it by shuffle. DS_LANE_TOPK loads per lane go out together, classified in
 * registers, before any shared-memory store (a store between them would order the loads one after
 * another: the compiler cannot tell the row stores from the source table). */
static __device__ void ds_load_rows(const struct epd_k_dispatch_args *a, const struct ds_src *srcs,
                                    uint32_t warp, uint32_t lane, uint32_t my_i, uint32_t my_t,
                                    int my_ok, uint64_t kmagic, uint32_t stride, int32_t *wrow)
{
        const uint32_t K = a->num_topk;

        for (uint32_t u0 = 0; u0 < K; u0 += DS_LANE_TOPK) {
                int32_t c[DS_LANE_TOPK];
                uint32_t tw[DS_LANE_TOPK];
#pragma unroll
                for (uint32_t u = 0; u < DS_LANE_TOPK; u++) {
                        const uint32_t f = (u0 + u) * 32 + lane;
                        tw[u] = epd_udiv_by_magic(f, kmagic);
                        const uint32_t ei = __shfl_sync(EPD_K_FULL_MASK, my_i, tw[u] % 32);
                        const uint32_t et = __shfl_sync(EPD_K_FULL_MASK, my_t, tw[u] % 32);
                        const int eok = __shfl_sync(EPD_K_FULL_MASK, my_ok, tw[u] % 32);
                        c[u] = -1;
                        if (u0 + u < K && eok)
                                c[u] = route_classify(
                                        epd__k_load_topk(srcs[ei].topk_idx, a->topk_dtype,
                                                         (uint64_t)et * srcs[ei].topk_stride +
                                                                 f - tw[u] * K),
                                        a->num_experts);
                }
#pragma unroll
                for (uint32_t u = 0; u < DS_LANE_TOPK; u++) {
                        const uint32_t f = (u0 + u) * 32 + lane;
                        if (u0 + u < K && tw[u] < 32)
                                wrow[(warp * 32 + tw[u]) * stride + f - tw[u] * K] = c[u];
                }
        }
}

/* One round of one warp with K_op dividing 32 and at most KMAX: the whole routing of the warp's
 * 32 tokens with a lane per entry instead of a thread per token (route_normalize's loops cost a
 * thread per token a few hundred instructions; here a warp spends a few dozen per 32 entries).
 * Entry (token tw, position k) sits at lane (tw % (32 / K_op)) * K_op + k of iteration
 * tw / (32 / K_op), so a token's K_op entries are K_op adjacent lanes of one iteration, and:
 *   - a valid id repeats an earlier one of its token exactly when a lower lane of its group
 *     holds the same id (K_op - 1 shuffles within the group): such entries and ids outside
 *     [0, E) other than -1 are bad and normalised to -1 (route_normalize's rule);
 *   - a valid entry is its token's first for its destination exactly when no lower lane of its
 *     group has that destination: an OR-scan of the destinations over the group;
 *   - the token's destination mask is the scan's value at the group's last lane.
 * (__match_any_sync would do the comparisons in one instruction each, but measured on the H200
 * it made the routing twice as slow as a thread per token.)
 * Writes each token's normalised row to wrow (as route_normalize leaves it), its mask, first
 * bits and first bad position to tdm/tfb/tbad, and, in block d < R, counts destination d's
 * selections per source into hist. */
template <uint32_t KMAX>
static __device__ void ds_route_lanes(const struct epd_k_dispatch_args *a,
                                      const struct ds_src *srcs, uint32_t b, uint32_t warp,
                                      uint32_t lane, uint32_t my_i, uint32_t my_t, int my_ok,
                                      uint64_t lmagic, uint32_t stride, int32_t *wrow,
                                      uint64_t *tdm, uint32_t *tfb, uint32_t *tbad, int32_t *hist)
{
        const uint32_t K = a->num_topk, L = a->num_experts / a->world_size;
        const uint32_t lk = 31 - __clz(K), grp = lane >> lk, k = lane & (K - 1);
        const uint32_t gshift = grp << lk, kbits = (1u << K) - 1;
        int32_t c[KMAX];

#pragma unroll
        for (uint32_t u = 0; u < KMAX; u++) {
                const uint32_t tw = (u * (32 >> lk) + grp) % 32; /* < 32 for u < K */
                const uint32_t ei = __shfl_sync(EPD_K_FULL_MASK, my_i, tw);
                const uint32_t et = __shfl_sync(EPD_K_FULL_MASK, my_t, tw);
                const int eok = __shfl_sync(EPD_K_FULL_MASK, my_ok, tw);
                c[u] = -1;
                if (u < K && eok)
                        c[u] = route_classify(epd__k_load_topk(srcs[ei].topk_idx, a->topk_dtype,
                                                               (uint64_t)et *
                                                                               srcs[ei].topk_stride +
                                                                       k),
                                              a->num_experts);
        }
#pragma unroll
        for (uint32_t u = 0; u < KMAX; u++) {
                if (u >= K) /* warp-uniform */
                        break;
                const uint32_t tw = u * (32 >> lk) + grp, row = warp * 32 + tw;
                const uint32_t ei = __shfl_sync(EPD_K_FULL_MASK, my_i, tw);
                const int32_t v = c[u];
                /* A repeat of a lower lane's valid id (shuffles within the group: lane k gets
                 * lane k - o's id; lanes with k < o get their own back and ignore it). */
                int dup = 0;
#pragma unroll
                for (uint32_t o = 1; o < KMAX; o++) {
                        const int32_t ov = __shfl_up_sync(EPD_K_FULL_MASK, v, o, K);
                        dup |= o < K && k >= o && v >= 0 && ov == v;
                }
                const int32_t norm = v >= 0 && !dup ? v : -1;
                const uint32_t d = norm >= 0 ? epd_route_expert_rank_magic(norm, lmagic) : 0;
                /* Destinations of the lower lanes of the group: an exclusive OR-scan. */
                const uint64_t mine = norm >= 0 ? 1ull << d : 0;
                uint64_t incl = mine;
#pragma unroll
                for (uint32_t o = 1; o < KMAX; o <<= 1) {
                        const uint64_t on = __shfl_up_sync(EPD_K_FULL_MASK, incl, o, K);
                        if (o < K && k >= o)
                                incl |= on;
                }
                const uint64_t lower = __shfl_up_sync(EPD_K_FULL_MASK, incl, 1, K);
                const int first = norm >= 0 && !(k >= 1 && ((lower >> d) & 1));
                const uint32_t bf = (__ballot_sync(EPD_K_FULL_MASK, first) >> gshift) & kbits;
                const uint32_t bb =
                        (__ballot_sync(EPD_K_FULL_MASK, v == -2 || dup) >> gshift) & kbits;
                /* The token's mask: the last lane of the group's inclusive OR. */
                const uint64_t tm = __shfl_sync(EPD_K_FULL_MASK, incl, K - 1, K);
                wrow[row * stride + k] = norm >= 0 ? norm | (int32_t)(d << 16) : -1;
                if (k == 0) {
                        tdm[row] = tm;
                        tfb[row] = bf;
                        tbad[row] = bb != 0 ? __ffs(bb) - 1 : UINT32_MAX;
                }
                if (b < a->world_size && norm >= 0 && d == b)
                        atomicAdd(&hist[ei * L + norm - b * L], 1);
        }
}

template <uint32_t KMAX>
static __global__ void __launch_bounds__(DS_THREADS, 1)
        dispatch_small_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                              const __grid_constant__ struct epd_ws_layout l, uint32_t slots,
                              uint32_t slices, uint64_t slice_bytes, int preload)
{
        extern __shared__ int32_t smem[];
        __shared__ struct ds_src srcs[SMALL_MAX_RANKS];
        __shared__ uint64_t cap[SMALL_MAX_RANKS];
        __shared__ unsigned long long bad_key; /* source << 32 | t * K_op + k; lowest wins */
        __shared__ uint32_t num_short, first_short;
        const uint32_t R = a.world_size, E = a.num_experts, K = a.num_topk, T = a.max_tokens;
        const uint32_t L = l.num_local_experts, nl = a.num_local, n = a.local_tokens;
        const uint32_t B = gridDim.x, b = blockIdx.x;
        const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const uint32_t below = (1u << lane) - 1;
        const uint32_t rounds = (n + DS_THREADS - 1) / DS_THREADS;
        const uint64_t lmagic = epd_udiv_magic(L), kmagic = epd_udiv_magic(K);
        const uint32_t stride = small_row_stride(K);
        const struct ds_smem m = ds_smem_layout(R, E, K, rounds, slots, preload & 1);
        int32_t *wrow = smem + m.nrow; /* every thread's row, DS_THREADS x stride */
        int32_t *nrow = wrow + threadIdx.x * small_row_stride(K);
        int32_t *wcnt = smem + m.wcnt, *total = smem + m.total, *pfx = smem + m.pfx;
        int32_t *hist = smem + m.hist, *algn = smem + m.algn;
        int32_t *sexp = smem + m.sexp, *srow = smem + m.srow;
        uint64_t *tdm = (uint64_t *)(smem + m.tdm);
        uint32_t *tfb = (uint32_t *)(smem + m.tfb), *tbad = (uint32_t *)(smem + m.tbad);
        /* Tokens this block owns: g = b + j * B for j < owned. */
        const uint32_t owned = b < n ? (n - b + B - 1) / B : 0;
        void *ws = a.workspace;
        DS_STAMP(0);

        if (threadIdx.x < nl) {
                const struct epd_k_dispatch_rank *r = &a.ranks[a.local[threadIdx.x].rank];
                srcs[threadIdx.x] = (struct ds_src){
                        r->topk_idx, r->topk_stride != 0 ? r->topk_stride : K, r->num_tokens,
                        a.local[threadIdx.x].token_offset, a.local[threadIdx.x].rank, 0, r->x,
                        r->weights };
                cap[threadIdx.x] = a.ranks[threadIdx.x].capacity_rows;
        }
        if (threadIdx.x == 0) {
                bad_key = ~0ull;
                num_short = 0;
                first_short = UINT32_MAX;
        }
        for (uint32_t x = threadIdx.x; x < E; x += blockDim.x)
                hist[x] = 0;
        __syncthreads();
        DS_STAMP(1);
        if (threadIdx.x < nl && srcs[threadIdx.x].num_tokens > T)
                atomicMin(&bad_key, (unsigned long long)threadIdx.x << 32);

        /* 0: each warp's first copy item, source bytes and weights, into registers: the loads
         * complete while the block routes. */
        struct copy_pre pre;
        int have_pre = 0;
        pre.buf = (int4 *)(smem + m.pre) + warp * (COPY_SLICE_UNIT / 16);
        if ((preload & 1) && warp < owned * slices) { /* warp-uniform */
                const uint32_t j = warp / slices, g = b + j * B;
                const uint32_t i = ds_source_of(srcs, nl, g);
                have_pre = srcs[i].num_tokens <= T;
                if (have_pre)
                        copy_preload(&a, &srcs[i].x, &srcs[i].weights, g - srcs[i].offset,
                                     warp % slices, slice_bytes, lane, &pre);
        }

        DS_STAMP(2);
        /* 1: every token of the op, a thread per token per round. */
        uint64_t dm[DS_MAX_ROUNDS];
        uint32_t fb[DS_MAX_ROUNDS];
#pragma unroll
        for (uint32_t r = 0; r < DS_MAX_ROUNDS; r++) {
                dm[r] = 0;
                fb[r] = 0;
                if (r >= rounds)
                        continue;
                const uint32_t g = r * DS_THREADS + threadIdx.x;
                /* This lane's token: its source, index and whether the source is valid. */
                uint32_t my_i = 0, my_t = 0, bad = UINT32_MAX;
                int my_ok = 0;
                if (g < n) {
                        my_i = ds_source_of(srcs, nl, g);
                        my_t = g - srcs[my_i].offset;
                        my_ok = srcs[my_i].num_tokens <= T;
                }
                if constexpr (KMAX != 0)
                        ds_route_lanes<KMAX>(&a, srcs, b, warp, lane, my_i, my_t, my_ok, lmagic,
                                             stride, wrow, tdm, tfb, tbad, hist);
                else
                        ds_load_rows(&a, srcs, warp, lane, my_i, my_t, my_ok, kmagic, stride,
                                     wrow);
                __syncwarp();
                if (my_ok) {
                        const uint32_t i = my_i, t = my_t;
                        if constexpr (KMAX != 0) {
                                dm[r] = tdm[threadIdx.x];
                                fb[r] = tfb[threadIdx.x];
                                bad = tbad[threadIdx.x];
                        } else {
                                dm[r] = route_normalize<0>(K, lmagic, nrow, &fb[r], &bad);
                        }
                        if (r == 0)
                                DS_STAMP(3);
                        if (bad != UINT32_MAX)
                                atomicMin(&bad_key, (unsigned long long)i << 32 | (t * K + bad));
                        if (g % B == b) {
                                const uint32_t j = g / B;
                                for (uint32_t k = 0; k < K; k++) {
                                        const int32_t v = nrow[k];
                                        sexp[j * K + k] = v >= 0 ? v & 0xffff : -1;
                                        srow[j * K + k] = -1;
                                }
                        }
                        if (KMAX == 0 && b < R) { /* the lane-parallel path counted already */
                                for (uint32_t k = 0; k < K; k++) {
                                        const int32_t v = nrow[k];
                                        if (v >= 0 && (uint32_t)v >> 16 == b)
                                                atomicAdd(&hist[i * L + (v & 0xffff) - b * L], 1);
                                }
                        }
                }
                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t bl = __ballot_sync(EPD_K_FULL_MASK, (dm[r] >> d) & 1);
                        if (lane == 0)
                                wcnt[(r * DS_WARPS + warp) * R + d] = __popc(bl);
                }
        }
        __syncthreads();
        DS_STAMP(4);

        /* 2: per destination, the rows before each warp of each round, and the totals. */
        for (uint32_t d = warp; d < R; d += DS_WARPS) {
                int32_t carry = 0;
                for (uint32_t q0 = 0; q0 < rounds * DS_WARPS; q0 += 32) {
                        int32_t *w = &wcnt[(q0 + lane) * R + d];
                        const int32_t v = *w;
                        const int32_t incl = warp_inclusive_scan(v);
                        *w = carry + incl - v;
                        carry += __shfl_sync(EPD_K_FULL_MASK, incl, 31);
                }
                if (lane == 0)
                        total[d] = carry;
        }
        __syncthreads();
        int32_t *ws_topk = epd_ws_i32(ws, l.topk), *ws_row = epd_ws_i32(ws, l.row);
#pragma unroll
        for (uint32_t r = 0; r < DS_MAX_ROUNDS; r++) {
                if (r >= rounds)
                        continue;
                const uint32_t g = r * DS_THREADS + threadIdx.x;
                const uint32_t i = g < n ? ds_source_of(srcs, nl, g) : 0;
                const int head = g < n && g == srcs[i].offset && srcs[i].num_tokens <= T;
                const int mine = g < n && g % B == b && srcs[i].num_tokens <= T;
                const uint32_t j = g / B;
                for (uint32_t d = 0; d < R; d++) {
                        const uint32_t bl = __ballot_sync(EPD_K_FULL_MASK, (dm[r] >> d) & 1);
                        const int32_t before = wcnt[(r * DS_WARPS + warp) * R + d] +
                                               __popc(bl & below);
                        if (head)
                                pfx[i * R + d] = before;
                        if (!mine || !((dm[r] >> d) & 1))
                                continue;
                        for (uint32_t f = fb[r]; f != 0; f &= f - 1) {
                                const uint32_t k = __ffs(f) - 1;
                                if (epd_route_expert_rank_magic(sexp[j * K + k], lmagic) ==
                                    d) {
                                        srow[j * K + k] = before;
                                        break;
                                }
                        }
                }
                if (mine) {
                        const uint64_t ent = epd_ws_entry(&l, srcs[i].rank,
                                                          g - srcs[i].offset, K, 0);
                        for (uint32_t k = 0; k < K; k++) {
                                ws_topk[ent + k] = sexp[j * K + k];
                                ws_row[ent + k] = srow[j * K + k];
                        }
                }
        }
        __syncthreads();
        /* Sources without tokens of their own start where the next one does; the capacity. */
        for (uint32_t d = threadIdx.x; d < R; d += blockDim.x) {
                pfx[nl * R + d] = total[d];
                for (uint32_t i = nl; i-- > 0;)
                        if (srcs[i].num_tokens == 0 || srcs[i].num_tokens > T)
                                pfx[i * R + d] = pfx[(i + 1) * R + d];
                if ((uint64_t)total[d] > cap[d]) {
                        atomicAdd(&num_short, 1u);
                        atomicMin(&first_short, d);
                }
        }
        __syncthreads();
        DS_STAMP(5);

        /* 3: the workspace. Local index i is rank i (every rank is local, ascending). */
        if (b == 0) {
                for (uint32_t x = threadIdx.x; x < (R + 1) * R; x += blockDim.x) {
                        const uint32_t s = x / R, d = x % R;
                        epd_ws_i32(ws, l.rank_prefix)[(uint64_t)d * (R + 1) + s] = pfx[x];
                        if (s < R)
                                epd_ws_i32(ws, l.tok_count)[(uint64_t)s * R + d] =
                                        pfx[x + R] - pfx[x];
                }
        }
        if (b < R) { /* block-uniform: destination d = b (the grid has R blocks at least) */
                const uint32_t d = b;
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
                        epd_ws_i32(ws, l.expert_count)[e] = run;
                        epd_ws_i32(ws, l.expert_aligned)[e] = algn[le];
                }
                __syncthreads();
                if (warp == 0)
                        warp_exclusive_scan(algn, epd_ws_i32(ws, l.expert_base) +
                                                          (uint64_t)d * (L + 1),
                                            L);
        }
        const int ok = bad_key == ~0ull && num_short == 0;
        if (b == 0) {
                __syncthreads(); /* rank_prefix stored: write_verdict reads it back */
                if (threadIdx.x == 0) {
                        uint32_t s = UINT32_MAX, chunk = UINT32_MAX;
                        if (bad_key != ~0ull) {
                                const uint32_t i = (uint32_t)(bad_key >> 32);
                                const uint32_t first = (uint32_t)bad_key;
                                const int bad_tokens = srcs[i].num_tokens > T;
                                const uint32_t c =
                                        bad_tokens ? 0 : first / K / EPD_WS_CHUNK_TOKENS;
                                s = a.local[i].rank;
                                chunk = s * l.num_chunks + c;
                                write_chunk_error(&a, &l, s, c, bad_tokens, first);
                        }
                        write_verdict(&a, &l, s, chunk, num_short, first_short);
                }
        }
        if (!ok)
                return;
#ifdef DS_TRACE
        if (preload & 2)
                return; /* experiments: the routing alone */
#endif

        DS_STAMP(6);
        /* 4: this block's tokens; a warp's first item is in its registers already. */
        for (uint32_t q = warp; q < owned * slices; q += DS_WARPS) {
                const uint32_t j = q / slices, g = b + j * B;
                const uint32_t i = ds_source_of(srcs, nl, g), t = g - srcs[i].offset;
                const uint32_t s = srcs[i].rank;
                const uint64_t ent = epd_ws_entry(&l, s, t, K, 0);
                int32_t expert = -1, row = -1;
                if (lane < K) {
                        expert = sexp[j * K + lane];
                        row = srow[j * K + lane];
                }
                if (q == warp && have_pre)
                        copy_token_rows(&a, &l, s, t, ent, expert, row, q % slices,
                                        slice_bytes, lane, &pre);
                else
                        copy_token_rows(&a, &l, s, t, ent, expert, row, q % slices,
                                        slice_bytes, lane, NULL);
        }
#ifdef DS_TRACE
        __syncthreads();
#endif
        DS_STAMP(7);
}

/* The kernel for a top-k width. */
static int ds_lanes(uint32_t num_topk)
{
        return num_topk <= DS_LANE_TOPK && 32 % num_topk == 0;
}

static const void *ds_kernel(uint32_t num_topk)
{
        return ds_lanes(num_topk) ? (const void *)dispatch_small_kernel<DS_LANE_TOPK>
                                  : (const void *)dispatch_small_kernel<0>;
}

/* A launch: grid, owned-token slots per block, slicing, shared memory, and whether each warp
 * loads its first slice ahead (when the buffers fit in shared memory). */
struct ds_launch {
        uint32_t blocks, slots, slices;
        uint64_t slice_bytes;
        size_t smem;
        int preload;
};

/* Whether an op qualifies, and its launch. */
static int ds_plan(const struct epd_k_dispatch_args *args, struct epd_ws_layout *l,
                   struct ds_launch *p)
{
        int ret = epd__k_check_dispatch(args, l), device, sms;

        if (ret < 0)
                return ret;
        if (args->layout != EPD_LAYOUT_NON_EXPAND || args->num_local != args->world_size ||
            args->world_size > SMALL_MAX_RANKS || args->local_tokens > EPD_K_SMALL_MAX_TOKENS)
                return EPD_INVALID_ARGUMENT;
        cudaError_t err = cudaGetDevice(&device);
        if (err == cudaSuccess)
                err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        if (err != cudaSuccess)
                return epd__k_cuda_status(err);
        /* One block per multiprocessor, and one per destination at least (block d writes d's
         * expert counts). The blocks never wait for each other, so any number is safe. */
        const uint32_t n = args->local_tokens;
        p->blocks = (uint32_t)sms > args->world_size ? (uint32_t)sms : args->world_size;
        p->slots = (n + p->blocks - 1) / p->blocks;
        /* Slices: enough (token, slice) items for every warp of a block, each slice a whole
         * number of copy steps. */
        p->slices = 1;
        p->slice_bytes = args->row_bytes;
        if (p->slots != 0 && p->slots < DS_WARPS && args->row_bytes > COPY_SLICE_UNIT) {
                const uint64_t want = (DS_WARPS + p->slots - 1) / p->slots;
                const uint64_t units = ((args->row_bytes + want - 1) / want + COPY_SLICE_UNIT -
                                        1) / COPY_SLICE_UNIT;
                p->slice_bytes = units * COPY_SLICE_UNIT;
                p->slices = (uint32_t)((args->row_bytes + p->slice_bytes - 1) / p->slice_bytes);
        }
        const uint32_t rounds = (n + DS_THREADS - 1) / DS_THREADS;
        /* Also raises the kernel's limit when needed: this is the launch's plan. */
#ifdef DS_TRACE
        if (getenv("DS_SKIP_COPY") != NULL) {
                p->smem = 4ull * ds_smem_layout(args->world_size, args->num_experts,
                                                args->num_topk, rounds, p->slots, 1)
                                         .words;
                p->preload = 3;
                return epd__k_dynamic_smem(ds_kernel(args->num_topk), p->smem);
        }
        if (getenv("DS_NO_PRELOAD") != NULL) {
                p->preload = 0;
                p->smem = 4ull * ds_smem_layout(args->world_size, args->num_experts,
                                                args->num_topk, rounds, p->slots, 0)
                                         .words;
                return epd__k_dynamic_smem(ds_kernel(args->num_topk), p->smem);
        }
#endif
        for (p->preload = 1; p->preload >= 0; p->preload--) {
                p->smem = 4ull * ds_smem_layout(args->world_size, args->num_experts,
                                                args->num_topk, rounds, p->slots, p->preload)
                                         .words;
                ret = epd__k_dynamic_smem(ds_kernel(args->num_topk), p->smem);
                if (ret != EPD_INVALID_ARGUMENT)
                        return ret;
        }
        return EPD_INVALID_ARGUMENT;
}

extern "C" int epd_k_dispatch_small_ok(const struct epd_k_dispatch_args *args)
{
        struct epd_ws_layout l;
        struct ds_launch p = {};

        return ds_plan(args, &l, &p) == 0;
}

extern "C" int epd_k_dispatch_small(const struct epd_k_dispatch_args *args, cudaStream_t stream)
{
        struct epd_ws_layout l;
        struct ds_launch p = {};
        int ret = ds_plan(args, &l, &p);

        if (ret < 0)
                return ret;
        if (ds_lanes(args->num_topk))
                dispatch_small_kernel<DS_LANE_TOPK><<<p.blocks, DS_THREADS, p.smem, stream>>>(
                        *args, l, p.slots, p.slices, p.slice_bytes, p.preload);
        else
                dispatch_small_kernel<0><<<p.blocks, DS_THREADS, p.smem, stream>>>(
                        *args, l, p.slots, p.slices, p.slice_bytes, p.preload);
        return epd__k_launch_status();
}

int epd__k_preload_dispatch_small(void)
{
        struct cudaFuncAttributes attr;
        int ret = epd__k_cuda_status(cudaFuncGetAttributes(&attr, ds_kernel(1)));
        return ret < 0 ? ret : epd__k_cuda_status(cudaFuncGetAttributes(&attr, ds_kernel(32)));
}
