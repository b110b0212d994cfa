/* epd_cx.h - the C interface of the client-executed kernels (docs/client-execution.md).
 *
 * One kernel per op per rank, launched on the rank's own stream: the protocol of cpu/cx.c on the
 * buffers of common/cx_layout.h, with every peer's buffer mapped into the launching process. The
 * op number is read from, and advanced in, the rank's buffer by the kernel itself, so a CUDA graph
 * that captured a launch issues a new op on every replay; every pointer and size is an argument
 * (a small descriptor passed by value), nothing is frozen at capture time but addresses.
 *
 * Co-residency: a rank's kernel waits for its peers' kernels and its own blocks meet at grid
 * barriers, so all blocks of every rank's kernel on a GPU must run at once. num_blocks is the
 * rank's SM budget (at most one block per SM of the budget); the caller keeps the sum of the
 * budgets of a GPU's ranks within its SMs, and ranks in different processes on one GPU need MPS.
 * A budget that breaks this turns into EPD_TIMEOUT, never a hang.
 *
 * Status: launchers return 0, EPD_INVALID_ARGUMENT for a descriptor that breaks a rule checked on
 * the host, or EPD_INTERNAL when CUDA refused the launch. The op's own status lands in the rank's
 * status ring (struct cx_header.status[op % CX_STATUS_RING]) when the kernel ends, and its counts
 * in the handle slot.
 *
 * Threading: launchers keep no state; any thread may call them.
 */
#ifndef EPD_KERNELS_CX_H
#define EPD_KERNELS_CX_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "cx_layout.h"
#include "epd.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One rank's view of its group, as mapped in the launching process. */
struct epd_cx_group {
        struct cx_layout layout;
        uint32_t rank;
        uint32_t reserved;
        uint64_t same_gpu_mask;         /* bit s: rank s's buffer and kernels are on this GPU */
        uint64_t timeout_ns;            /* bound of each wait */
        uint8_t *bufs[CX_MAX_RANKS];    /* every rank's buffer, addressable from this GPU */
};

/* Device pointers; the same meaning as struct cx_dispatch_args (cpu/cx.h). Not the public
 * struct epd_cx_dispatch_args of epd.h, which libepd turns into this. */
struct epd_cxk_dispatch_args {
        uint32_t num_tokens;
        uint32_t num_topk;
        const void *x;
        uint64_t x_stride;
        const float *scales;
        uint64_t scales_stride;
        const void *topk_idx;
        enum epd_dtype topk_dtype;
        enum epd_layout layout;
        const float *weights;
        uint32_t expert_alignment;
        uint32_t expert_block_rows;
        uint32_t zero_padding;
        uint32_t quantize;
        uint32_t handle;
        uint32_t cached;
        uint64_t capacity_rows;
        uint32_t round_scale;
        uint32_t scale_format;          /* enum epd_scale_format */
};

struct epd_cxk_combine_args {
        uint32_t handle;
        uint32_t recv_weights;
        uint32_t apply_weights;
        uint32_t reserved;
        const float *source_weights;
        const uint16_t *bias[2];
        uint16_t *combined;
        float *combined_topk_weights;
};

/* Loads both kernels on the current device (CUDA loads modules lazily, and a kernel that is not
 * loaded cannot start while its peers spin: ordering.cuh). Call once per device before the first
 * launch. Returns 0 or EPD_INTERNAL. */
int epd_cx_preload(void);

/* Queues rank g->rank's dispatch on stream with num_blocks blocks. */
int epd_cx_dispatch_launch(const struct epd_cx_group *g, const struct epd_cxk_dispatch_args *a,
                           uint32_t num_blocks, cudaStream_t stream);

/* Queues rank g->rank's combine; y (and recv_weights) must be in the rank's y area, written by
 * earlier work on the same stream. */
int epd_cx_combine_launch(const struct epd_cx_group *g, const struct epd_cxk_combine_args *a,
                          uint32_t num_blocks, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
