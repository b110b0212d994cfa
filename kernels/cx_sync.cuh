/* cx_sync.cuh - the signals of client-executed kernels: peer flags, bounded waits and the grid
 * barrier, each with the scope its observers need (DESIGN.md 5, 5a).
 *
 * Built on the audited primitives of ordering.cuh. Who writes and who reads each word:
 * - Peer slots (count records, done flags, y records, acks) live in the READER's buffer, on the
 *   reader's GPU, and are written by the peer. When the peer's rank shares this GPU
 *   (same_gpu bit set), .gpu orders everything both sides do; otherwise the write crosses the
 *   fabric and only .sys orders it. So the scope is chosen per peer, never .sys by default: a
 *   .sys fence where .gpu suffices is what cost DeepEP about 30% at EP16.
 * - The abort word is written by the daemon's CPU thread: a relaxed .sys load, value only.
 * - The grid barrier slots and the verdict word are in the rank's own buffer and touched only
 *   by this kernel's blocks: .gpu. A block's arrival, though, must also publish that block's row
 *   writes to peers on other GPUs before block 0 raises their done flags; the arrival therefore
 *   fences at .sys when any peer is remote (fence_scope below), once per block per barrier.
 */
#ifndef EPD_KERNELS_CX_SYNC_CUH
#define EPD_KERNELS_CX_SYNC_CUH

#include <stdint.h>

#include "cx_layout.h"
#include "epd_cx.h"
#include "ordering.cuh"

/* Whether rank s's kernels run on this GPU. */
static __device__ __forceinline__ int cx_same_gpu(const struct epd_cx_group *g, uint32_t s)
{
        return (int)(g->same_gpu_mask >> s & 1u);
}

/* Whether every rank of the group is on this GPU, so .gpu fences cover every observer. */
static __device__ __forceinline__ int cx_all_same_gpu(const struct epd_cx_group *g)
{
        uint32_t R = g->layout.shape.world_size;
        uint64_t all = R >= 64 ? ~0ull : (1ull << R) - 1;

        return (g->same_gpu_mask & all) == all;
}

/* A fence that publishes this thread's (and, after bar.sync, its block's) earlier writes to
 * every rank of the group: .gpu when all share this GPU, .sys otherwise. */
static __device__ __forceinline__ void cx_fence_group(const struct epd_cx_group *g)
{
        if (cx_all_same_gpu(g))
                epd_fence_acq_rel_gpu();
        else
                epd_fence_acq_rel_sys();
}

/* Raises a tag in a slot that rank `peer` will acquire-poll. Call after cx_fence_group when the
 * block's writes must be published too; the release then covers this thread's own. */
static __device__ __forceinline__ void cx_signal(const struct epd_cx_group *g, uint32_t peer,
                                                 uint64_t *slot, uint64_t tag)
{
        if (cx_same_gpu(g, peer))
                epd_st_release_gpu_u64(slot, tag);
        else
                epd_st_release_sys_u64(slot, tag);
}

/* Waits until a slot in this rank's buffer that rank `writer` signals reaches tag. Tags only grow
 * (epoch << 40 | op; a slot's next tag is two ops later and cannot come before this op ends), so
 * ordering.cuh's >= wait is exact. Returns 0, EPD_PEER_LOST or EPD_TIMEOUT. */
static __device__ __forceinline__ int cx_wait(const struct epd_cx_group *g, uint32_t writer,
                                              const uint64_t *slot, uint64_t tag)
{
        const struct cx_header *h = cx_header_of(g->bufs[g->rank], &g->layout);
        int r = epd_wait_geq_u64(slot, tag, cx_same_gpu(g, writer) ? EPD_WAIT_GPU : EPD_WAIT_SYS,
                                 &h->abort_word, g->timeout_ns);

        return r == EPD_ABORTED ? EPD_PEER_LOST : r;
}

/* Waits, one thread per rank, for slot [parity][s] of a part of this rank's buffer from every
 * rank s: slots of stride bytes starting at offset part, the tag their first word. Every thread of
 * the block calls it. Returns 0 or a failure (PEER_LOST or TIMEOUT); *who gets the lowest failing
 * rank. */
static __device__ __noinline__ int cx_wait_all(const struct epd_cx_group *g, uint64_t part,
                                               uint64_t stride, uint32_t parity, uint64_t tag,
                                               int32_t *who)
{
        __shared__ int s_ret, s_who;
        const uint32_t R = g->layout.shape.world_size;
        const uint8_t *slots = g->bufs[g->rank] + part + (uint64_t)parity * R * stride;

        if (threadIdx.x == 0) {
                s_ret = 0;
                s_who = CX_MAX_RANKS;
        }
        __syncthreads();
        for (uint32_t s = threadIdx.x; s < R; s += blockDim.x) {
                int r = cx_wait(g, s, (const uint64_t *)(slots + s * stride), tag);

                if (r) {
                        atomicMin(&s_who, (int)s);
                        s_ret = r; /* PEER_LOST wins over TIMEOUT only by chance; both fail */
                }
        }
        __syncthreads();
        *who = s_who;
        return s_ret;
}

/* The key of barrier k of launch seq in epoch: grows with every barrier of every launch of an
 * epoch, and with the epoch (16 bits of it, 40 of the launch count, 8 of the barrier). */
static __device__ __forceinline__ uint64_t cx_barrier_key(uint64_t epoch, uint64_t seq, uint32_t k)
{
        return (epoch & 0xFFFFu) << 48 | (seq & CX_OP_MASK) << 8 | (k & 0xFFu);
}

/* Grid barrier k of this launch: block b stores its key in grid_arrive[b], then waits until every
 * block's slot holds at least the key. Keys only grow, so a slot left by a failed launch can never
 * satisfy a later one, and nothing has to be reset. The slots are in the rank's own buffer and
 * only this kernel's blocks touch them: .gpu. Every thread of the block calls it. Returns 0,
 * EPD_PEER_LOST or EPD_TIMEOUT (bounded by twice the wait timeout: block 0 may itself be in a
 * peer wait of up to that long). */
static __device__ __noinline__ int cx_grid_barrier(const struct epd_cx_group *g, uint64_t key)
{
        __shared__ int s_ret;
        struct cx_header *h = cx_header_of(g->bufs[g->rank], &g->layout);

        __syncthreads();
        if (threadIdx.x == 0) {
                s_ret = 0;
                /* Publishes this block's writes to the other blocks (.gpu) and, before block 0
                 * signals them, to peers on other GPUs (.sys when any is remote). */
                cx_fence_group(g);
                epd_st_release_gpu_u64(&h->grid_arrive[blockIdx.x], key);
        }
        __syncthreads();
        for (uint32_t b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
                int r = epd_wait_geq_u64(&h->grid_arrive[b], key, EPD_WAIT_GPU, &h->abort_word,
                                         2 * g->timeout_ns);
                if (r)
                        s_ret = r == EPD_ABORTED ? EPD_PEER_LOST : r;
        }
        __syncthreads();
        return s_ret;
}

#endif
