/* ordering.cuh - the memory-ordering primitives of epd's kernels, in one audited place.
 *
 * The scope of an ordering operation follows who can observe the word.
 *   .gpu  producer and consumer run on the same GPU. That includes ranks co-located on one GPU:
 *         they are different ranks but the same device, so every thread that can touch the word
 *         is inside the .gpu scope, and .gpu is the cheapest scope that makes a release on one
 *         SM visible to an acquire on another.
 *   .sys  the other side is on another GPU (peer memory over NVLink/PCIe) or is the CPU (pinned
 *         host memory, a doorbell the daemon writes). .gpu would order only the accesses of this
 *         GPU's threads; another GPU's writes through the fabric are ordered only at .sys.
 * When a caller cannot know which case holds (a word in a group workspace that may sit on a
 * peer GPU), it uses .sys: correct in both cases, and a few extra cycles on a word read once per
 * block is noise.
 *
 * Nothing here traps. A wait is bounded by a deadline read from %globaltimer and by an abort
 * word that the daemon owns; on either it returns a status that the caller records before it
 * exits (docs/architecture.md, "Failure model": a trapped context would take every worker of the
 * GPU down).
 *
 * Lazy loading: CUDA loads a module's kernels on first use by default, and loading can have to
 * wait for the kernels already running. A kernel spinning here on a flag that a not-yet-loaded
 * kernel will set therefore never sees it (seen on an H200: a waiter timed out after 2 s while
 * its signaller, launched on another stream, could not start). Every process that launches
 * waiting kernels calls epd_k_preload (epd_kernels.h) per device first; the bounded wait turns a
 * forgotten preload into EPD_TIMEOUT instead of a hang.
 *
 * Daemon-executed mode orders the steps of an op with CUDA events, so its kernels do not need
 * flags; they still read the op's verdict with an acquire (epd_ld_acquire_sys_s32) so that the
 * same kernels stay correct when client-executed mode chains the steps with flags instead.
 */
#ifndef EPD_KERNELS_ORDERING_CUH
#define EPD_KERNELS_ORDERING_CUH

#include <stdint.h>

#include "epd.h"

/* ---- acquire loads ---- */

/* Same-GPU producer: a release store (or a kernel boundary) on this GPU happens before. */
static __device__ __forceinline__ uint32_t epd_ld_acquire_gpu_u32(const uint32_t *p)
{
        uint32_t v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
}

/* Producer on another GPU or the CPU: only .sys orders writes arriving through the fabric. */
static __device__ __forceinline__ uint32_t epd_ld_acquire_sys_u32(const uint32_t *p)
{
        uint32_t v;
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
}

static __device__ __forceinline__ int32_t epd_ld_acquire_sys_s32(const int32_t *p)
{
        return (int32_t)epd_ld_acquire_sys_u32((const uint32_t *)p);
}

static __device__ __forceinline__ uint64_t epd_ld_acquire_gpu_u64(const uint64_t *p)
{
        uint64_t v;
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
}

static __device__ __forceinline__ uint64_t epd_ld_acquire_sys_u64(const uint64_t *p)
{
        uint64_t v;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
}

/* A relaxed read for polling words whose value alone matters (abort words): it must not be
 * cached across iterations (volatile asm, .relaxed is a strong access) but orders nothing. .sys
 * because the daemon's CPU threads write abort words. */
static __device__ __forceinline__ uint32_t epd_ld_relaxed_sys_u32(const uint32_t *p)
{
        uint32_t v;
        asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
}

/* ---- release stores ---- */

/* Publishes this thread's earlier writes to acquirers on the same GPU. */
static __device__ __forceinline__ void epd_st_release_gpu_u32(uint32_t *p, uint32_t v)
{
        asm volatile("st.release.gpu.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}

/* Publishes this thread's earlier writes to acquirers on any GPU or the CPU. */
static __device__ __forceinline__ void epd_st_release_sys_u32(uint32_t *p, uint32_t v)
{
        asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ void epd_st_release_sys_s32(int32_t *p, int32_t v)
{
        epd_st_release_sys_u32((uint32_t *)p, (uint32_t)v);
}

static __device__ __forceinline__ void epd_st_release_gpu_u64(uint64_t *p, uint64_t v)
{
        asm volatile("st.release.gpu.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ void epd_st_release_sys_u64(uint64_t *p, uint64_t v)
{
        asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

/* A release store publishes only the storing thread's own writes. When a whole block's writes
 * must be published by one thread: __syncthreads() (the block's writes happen before the
 * signalling thread continues), then this fence in that thread, then a relaxed or release store.
 * .sys for the same reason as the stores above. */
static __device__ __forceinline__ void epd_fence_acq_rel_sys(void)
{
        asm volatile("fence.acq_rel.sys;" : : : "memory");
}

static __device__ __forceinline__ void epd_fence_acq_rel_gpu(void)
{
        asm volatile("fence.acq_rel.gpu;" : : : "memory");
}

/* A weak load of the 128-byte line at p into this SM's L1, its value unused (volatile: kept).
 * Only after an acquire that orders the line's writers before it: the line then holds their
 * values, and later weak loads by the block (after bar.sync) may hit it. A performance hint
 * with no ordering of its own. */
static __device__ __forceinline__ void epd_touch_l1(const void *p)
{
        asm volatile("{ .reg .u32 t; ld.global.ca.u32 t, [%0]; }" : : "l"(p) : "memory");
}

/* Nanoseconds of the GPU's global timer. It ticks coarsely (about a microsecond) but is the same
 * clock on every SM, which is what a deadline needs. */
static __device__ __forceinline__ uint64_t epd_globaltimer_ns(void)
{
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

/* ---- bounded waits ---- */

enum epd_wait_scope {
        EPD_WAIT_GPU = 0, /* the signaller runs on this GPU */
        EPD_WAIT_SYS = 1, /* the signaller is another GPU or the CPU */
};

/* Waits until *word >= target (64-bit sequence doorbells only grow), acquiring at `scope` so
 * that the signaller's writes before its release are visible on return 0. Gives up with
 * EPD_ABORTED as soon as *abort_word (may be NULL) is non-zero, and with EPD_TIMEOUT once
 * timeout_ns have passed. Call it from one thread, then __syncthreads() to extend the
 * acquire to the block (bar.sync orders the block's later accesses after it). */
static __device__ __noinline__ int epd_wait_geq_u64(const uint64_t *word, uint64_t target,
                                                  enum epd_wait_scope scope,
                                                  const uint32_t *abort_word, uint64_t timeout_ns)
{
        uint64_t start = epd_globaltimer_ns();
        uint32_t backoff = 32;

        for (;;) {
                uint64_t v = scope == EPD_WAIT_SYS ? epd_ld_acquire_sys_u64(word)
                                                   : epd_ld_acquire_gpu_u64(word);
                if (v >= target)
                        return 0;
                if (abort_word != NULL && epd_ld_relaxed_sys_u32(abort_word) != 0)
                        return EPD_ABORTED;
                if (epd_globaltimer_ns() - start > timeout_ns)
                        return EPD_TIMEOUT;
                /* Back off so a spinning block does not steal issue slots and fabric bandwidth
                 * from the blocks doing the copy it waits for. */
                __nanosleep(backoff);
                if (backoff < 1024)
                        backoff *= 2;
        }
}

/* Reads the op's verdict word (struct epd_ws_error.status) once per block and broadcasts it:
 * thread 0 acquires at .sys (the workspace may live on a peer GPU and the verdict may come from
 * a kernel there), and __syncthreads() hands the value and the acquire's ordering to the block.
 * Every thread of the block must call it. */
static __device__ __forceinline__ int32_t epd_block_read_verdict(const int32_t *status_word)
{
        __shared__ int32_t verdict;

        if (threadIdx.x == 0)
                verdict = epd_ld_acquire_sys_s32(status_word);
        __syncthreads();
        return verdict;
}

#endif
