/* cx_cuda.c - client-executed groups on the cuda backend in libepd (docs/client-execution.md).
 *
 * The daemon allocates a group's buffers as one cuMem allocation on the group's GPU and exports
 * it as a POSIX fd at join. This file imports it once, maps it for this process's CUDA device of
 * the same UUID, and launches the kernels of kernels/epd_cx.h on the caller's stream: no daemon
 * message and no system call per op, so a sequence of launches can be captured in a CUDA graph
 * (the op number lives in the rank's buffer and advances on the device).
 *
 * Compiled only with EPD_HAVE_CUDA. The current CUDA device of the calling thread is never
 * changed: mapping runs in the device's primary context, pushed and popped.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client_internal.h"
#include "cudrv.h"
#include "cx_layout.h"
#include "epd_cx.h"

struct epd__cx_dev {
        int ordinal;
        CUdevice dev;
        CUdeviceptr va;
        size_t size;
        uint32_t num_blocks;          /* the group's sms_per_rank */
        struct epd_cx_group desc;     /* what every launch takes, by value */
};

static int cx_cu_fail(struct epd_client *c, const char *what, CUresult r)
{
        const char *name = "unknown";

        if (epd_cudrv()->GetErrorName)
                epd_cudrv()->GetErrorName(r, &name);
        return epd__client_fail(c, EPD_UNAVAILABLE, "client-executed group: %s: %s", what,
                                name);
}

int epd__cx_dev_enter(struct epd_group *g, const struct cx_layout *l, int fd, uint64_t total,
                      uint64_t stride, struct epd__cx_dev **out, uint8_t **base)
{
        struct epd_client *c = g->client;
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp prop;
        CUmemAccessDesc acc;
        CUcontext ctx = NULL, popped;
        struct epd__cx_dev *d;
        size_t gran = 0;
        CUresult r;
        int rc;

        if (!epd_cudrv())
                return epd__client_fail(c, EPD_UNAVAILABLE,
                                        "client-executed group on the cuda backend: the CUDA "
                                        "driver cannot be loaded");
        d = calloc(1, sizeof(*d));
        if (!d)
                return epd__client_fail(c, EPD_INTERNAL, "out of memory");
        rc = epd__cuda_ordinal(c, g->device, &d->ordinal);
        if (rc < 0)
                goto fail;
        r = epd_cudrv()->DeviceGet(&d->dev, d->ordinal);
        if (r == CUDA_SUCCESS)
                r = epd_cudrv()->DevicePrimaryCtxRetain(&ctx, d->dev);
        if (r == CUDA_SUCCESS)
                r = epd_cudrv()->CtxPushCurrent(ctx);
        if (r != CUDA_SUCCESS) {
                rc = cx_cu_fail(c, "the device's primary context", r);
                goto fail;
        }
        memset(&prop, 0, sizeof(prop));
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = d->ordinal;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        r = epd_cudrv()->MemGetAllocationGranularity(&gran, &prop,
                                                     CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        if (r == CUDA_SUCCESS && gran)
                r = epd_cudrv()->MemImportFromShareableHandle(
                        &h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (r != CUDA_SUCCESS || !gran) {
                rc = cx_cu_fail(c, "importing the group's buffers", r);
                goto pop;
        }
        d->size = (total + gran - 1) / gran * gran;
        r = epd_cudrv()->MemAddressReserve(&d->va, d->size, gran, 0, 0);
        if (r == CUDA_SUCCESS)
                r = epd_cudrv()->MemMap(d->va, d->size, 0, h, 0);
        epd_cudrv()->MemRelease(h); /* the mapping holds it */
        if (r == CUDA_SUCCESS) {
                memset(&acc, 0, sizeof(acc));
                acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                acc.location.id = d->ordinal;
                acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                r = epd_cudrv()->MemSetAccess(d->va, d->size, &acc, 1);
        }
        if (r != CUDA_SUCCESS) {
                if (d->va) {
                        epd_cudrv()->MemUnmap(d->va, d->size);
                        epd_cudrv()->MemAddressFree(d->va, d->size);
                }
                rc = cx_cu_fail(c, "mapping the group's buffers", r);
                goto pop;
        }
        /* Kernels load lazily, and one that is not loaded cannot start while its peers spin. */
        if (epd_cx_preload() < 0) {
                epd_cudrv()->MemUnmap(d->va, d->size);
                epd_cudrv()->MemAddressFree(d->va, d->size);
                rc = epd__client_fail(c, EPD_UNAVAILABLE,
                                      "client-executed group: the kernels cannot be loaded");
                goto pop;
        }
        d->desc.layout = *l;
        d->desc.rank = g->rank;
        /* Every rank's buffer and kernel is on this GPU (one GPU per group for now). */
        d->desc.same_gpu_mask = l->shape.world_size >= 64 ? ~0ull
                                                           : (1ull << l->shape.world_size) - 1;
        d->desc.timeout_ns = (uint64_t)g->config.op_timeout_ms * 1000000ull;
        for (uint32_t r2 = 0; r2 < l->shape.world_size; r2++)
                d->desc.bufs[r2] = (uint8_t *)(uintptr_t)(d->va + r2 * stride);
        d->num_blocks = g->config.sms_per_rank ? g->config.sms_per_rank : 1;
        *base = (uint8_t *)(uintptr_t)d->va;
        *out = d;
        rc = 0;
pop:
        epd_cudrv()->CtxPopCurrent(&popped);
        if (rc < 0)
                epd_cudrv()->DevicePrimaryCtxRelease(d->dev);
fail:
        close(fd);
        if (rc < 0)
                free(d);
        return rc;
}

void epd__cx_dev_leave(struct epd__cx_dev *d)
{
        CUcontext ctx, popped;

        if (!d)
                return;
        if (epd_cudrv()->DevicePrimaryCtxRetain(&ctx, d->dev) == CUDA_SUCCESS &&
            epd_cudrv()->CtxPushCurrent(ctx) == CUDA_SUCCESS) {
                epd_cudrv()->MemUnmap(d->va, d->size);
                epd_cudrv()->MemAddressFree(d->va, d->size);
                epd_cudrv()->CtxPopCurrent(&popped);
                epd_cudrv()->DevicePrimaryCtxRelease(d->dev);
        }
        epd_cudrv()->DevicePrimaryCtxRelease(d->dev); /* the retain of enter */
        free(d);
}

int epd__cx_dev_dispatch(struct epd_group *g, struct epd__cx_dev *d,
                         const struct epd_cx_dispatch_args *a, void *stream)
{
        struct epd_cxk_dispatch_args k = {
                .num_tokens = a->num_tokens, .num_topk = a->num_topk, .x = a->x,
                .x_stride = a->x_stride, .scales = a->scales, .scales_stride = a->scales_stride,
                .topk_idx = a->topk_idx, .topk_dtype = a->topk_dtype, .layout = a->layout,
                .weights = a->topk_weights, .expert_alignment = a->expert_alignment,
                .expert_block_rows = a->expert_block_rows,
                .zero_padding = (uint32_t)!!a->zero_padding, .quantize = (uint32_t)!!a->quantize,
                .handle = a->handle, .cached = (uint32_t)!!a->cached,
                .capacity_rows = a->capacity_rows, .round_scale = (uint32_t)!!a->round_scale,
                .scale_format = (uint32_t)a->scale_format,
        };
        int rc = epd_cx_dispatch_launch(&d->desc, &k, d->num_blocks, (cudaStream_t)stream);

        if (rc < 0)
                return epd__client_fail(g->client, rc, "epd_cx_dispatch: the launch failed "
                                        "(%s)", rc == EPD_INVALID_ARGUMENT
                                                        ? "its arguments break a rule of "
                                                          "kernels/epd_cx.h"
                                                        : "CUDA refused it");
        return 0;
}

int epd__cx_dev_combine(struct epd_group *g, struct epd__cx_dev *d,
                        const struct epd_cx_combine_args *a, void *stream)
{
        struct epd_cxk_combine_args k = {
                .handle = a->handle, .recv_weights = (uint32_t)!!a->recv_weights,
                .apply_weights = (uint32_t)!!a->apply_weights,
                .source_weights = a->source_weights,
                .bias = { a->num_bias > 0 ? a->bias[0] : NULL,
                          a->num_bias > 1 ? a->bias[1] : NULL },
                .combined = a->combined, .combined_topk_weights = a->combined_topk_weights,
        };
        int rc = epd_cx_combine_launch(&d->desc, &k, d->num_blocks, (cudaStream_t)stream);

        if (rc < 0)
                return epd__client_fail(g->client, rc, "epd_cx_combine: the launch failed (%s)",
                                        rc == EPD_INVALID_ARGUMENT
                                                ? "its arguments break a rule of "
                                                  "kernels/epd_cx.h"
                                                : "CUDA refused it");
        return 0;
}

int epd__cx_dev_read(struct epd__cx_dev *d, const void *src, void *dst, size_t bytes)
{
        CUcontext ctx, popped;
        cudaError_t ce;

        /* Synchronous: the caller has synchronised the stream its op ran on. */
        if (epd_cudrv()->DevicePrimaryCtxRetain(&ctx, d->dev) != CUDA_SUCCESS)
                return EPD_INTERNAL;
        epd_cudrv()->CtxPushCurrent(ctx);
        ce = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
        epd_cudrv()->CtxPopCurrent(&popped);
        epd_cudrv()->DevicePrimaryCtxRelease(d->dev);
        if (ce != cudaSuccess) {
                cudaGetLastError();
                return EPD_INTERNAL;
        }
        return 0;
}
