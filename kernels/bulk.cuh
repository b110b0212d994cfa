/* bulk.cuh - Hopper's bulk-copy engine (cp.async.bulk, "TMA" without a tensor map) and the
 * shared-memory transaction barriers (mbarrier) that track it, in one audited place.
 *
 * A bulk copy moves a contiguous run of bytes (16-byte aligned at both ends, a multiple of 16
 * long) from global into this block's shared memory. One thread issues it; the copy engine does
 * the transfer, so the bytes in flight are bounded by shared memory, not by registers. Its
 * completion is counted in bytes on an mbarrier in shared memory:
 *   - one thread arrives on the barrier and announces the bytes to come (arrive.expect_tx);
 *   - every copy names the barrier and, as its bytes land, decrements the announced count
 *     (complete_tx);
 *   - the phase completes when the arrival and every announced byte are in. A thread that waits
 *     on the phase (try_wait.parity, acquire at CTA scope by default) then sees the copied bytes.
 * Reusing a buffer: the async proxy (the copy engine) writes it, the generic proxy (ld.shared)
 * reads it. The readers finish their loads before the issuer starts the next copy into it (a
 * __syncwarp or __syncthreads between them, with the loaded values already consumed), which is
 * the order CUTLASS's pipelines rely on; bulk_fence_proxy makes the handover explicit.
 */
#ifndef EPD_KERNELS_BULK_CUH
#define EPD_KERNELS_BULK_CUH

#include <stdint.h>

static __device__ __forceinline__ uint32_t bulk_smem_addr(const void *p)
{
        return (uint32_t)__cvta_generic_to_shared(p);
}

/* One thread initialises a barrier for `count` arrivals per phase, then makes the
 * initialisation visible to the copy engine and to the block (the caller syncs after). */
static __device__ __forceinline__ void bulk_bar_init(uint64_t *bar, uint32_t count)
{
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bulk_smem_addr(bar)),
                     "r"(count)
                     : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* Arrives on bar and announces `bytes` of bulk copies that will complete on its current
 * phase. */
static __device__ __forceinline__ void bulk_bar_arrive_expect(uint64_t *bar, uint32_t bytes)
{
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                             bulk_smem_addr(bar)),
                     "r"(bytes)
                     : "memory");
}

/* Waits until the phase of parity `parity` of bar has completed (acquire, CTA scope). */
static __device__ __forceinline__ void bulk_bar_wait(uint64_t *bar, uint32_t parity)
{
        const uint32_t addr = bulk_smem_addr(bar);
        uint32_t done;
        do {
                asm volatile("{\n\t.reg .pred p;\n\t"
                             "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                             "selp.u32 %0, 1, 0, p;\n\t}"
                             : "=r"(done)
                             : "r"(addr), "r"(parity)
                             : "memory");
        } while (!done);
}

/* Generic-proxy accesses to shared memory before it, async-proxy ones after it. */
static __device__ __forceinline__ void bulk_fence_proxy(void)
{
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* The L2 evict-first policy (as epd__k_ldg_evict_first uses) for bulk loads. */
static __device__ __forceinline__ uint64_t bulk_policy_evict_first(void)
{
        uint64_t policy;
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        return policy;
}

/* Copies `bytes` from global src to shared dst, completing on bar; with an L2 cache policy.
 * src, dst and bytes are multiples of 16. The copy reads src through the async proxy: src must
 * not be written while the copy is in flight (combine's inputs are read-only for the launch). */
static __device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes,
                                                 uint64_t *bar, uint64_t policy)
{
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                     ".L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(bulk_smem_addr(dst)),
                     "l"(src), "r"(bytes), "r"(bulk_smem_addr(bar)), "l"(policy)
                     : "memory");
}

#endif
