/* stream.c - libepd's CUDA stream ordering over the rank's doorbell page (common/doorbell.h):
 * cuStreamWaitValue64 / cuStreamWriteValue64 on the page, registered with CUDA in this process.
 * Built only when libepd has CUDA. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stddef.h>

#include "client_internal.h"
#include "cudrv.h"

/* Registers the doorbell page with CUDA once; the page is host memory, so one device address
 * serves every device (portable). Caller holds the client lock. */
static int doorbell_device(struct epd_group *g)
{
        cudaError_t ce;

        if (g->doorbell_dev)
                return 0;
        if (!g->doorbell)
                return epd__client_fail(g->client, EPD_UNAVAILABLE, "the group has no doorbell");
        ce = cudaHostRegister(g->doorbell, g->doorbell_bytes,
                              cudaHostRegisterPortable | cudaHostRegisterMapped);
        if (ce == cudaSuccess)
                ce = cudaHostGetDevicePointer(&g->doorbell_dev, g->doorbell, 0);
        if (ce != cudaSuccess)
                return epd__client_fail(g->client, EPD_UNAVAILABLE,
                                        "cannot register the doorbell page with CUDA: %s",
                                        cudaGetErrorString(ce));
        return 0;
}

int epd_op_stream_wait(struct epd_op *op, void *stream)
{
        struct epd_group *g;
        uint64_t seq = epd_op_sequence(op);
        CUresult r;
        int rc;

        if (!op || !seq)
                return EPD_INVALID_ARGUMENT;
        /* The op's group is reachable through the public accessor's owner: ops keep it. */
        g = epd__op_group(op);
        pthread_mutex_lock(&g->client->lock);
        rc = doorbell_device(g);
        pthread_mutex_unlock(&g->client->lock);
        if (rc < 0)
                return rc;
        /* The daemon stores `completed` after the op's last kernel (its stream, or the host at
         * completion); waiting at system scope on host memory sees either writer. */
        if (!epd_cudrv())
                return epd__client_fail(g->client, EPD_UNAVAILABLE, "CUDA driver unavailable");
        r = epd_cudrv()->StreamWaitValue64((CUstream)stream,
                                (CUdeviceptr)(uintptr_t)g->doorbell_dev +
                                        offsetof(struct epd_doorbell, completed),
                                seq, CU_STREAM_WAIT_VALUE_GEQ);
        if (r != CUDA_SUCCESS)
                return epd__client_fail(g->client, EPD_UNAVAILABLE, "cuStreamWaitValue64 failed (%d)",
                                        (int)r);
        return 0;
}

int epd_group_mark_inputs_ready(struct epd_group *g, void *stream, uint64_t *seq)
{
        uint64_t v;
        CUresult r;
        int rc;

        if (!g)
                return EPD_INVALID_ARGUMENT;
        pthread_mutex_lock(&g->client->lock);
        rc = doorbell_device(g);
        v = ++g->inputs_marked;
        pthread_mutex_unlock(&g->client->lock);
        if (rc < 0)
                return rc;
        /* Stream memory writes are ordered after the stream's earlier work and flushed at system
         * scope by default, so the daemon's wait sees the inputs that preceded it. */
        if (!epd_cudrv())
                return epd__client_fail(g->client, EPD_UNAVAILABLE, "CUDA driver unavailable");
        r = epd_cudrv()->StreamWriteValue64((CUstream)stream,
                                 (CUdeviceptr)(uintptr_t)g->doorbell_dev +
                                         offsetof(struct epd_doorbell, inputs_ready),
                                 v, 0);
        if (r != CUDA_SUCCESS)
                return epd__client_fail(g->client, EPD_UNAVAILABLE,
                                        "cuStreamWriteValue64 failed (%d)", (int)r);
        if (seq)
                *seq = v;
        return 0;
}

void epd__group_stream_fini(struct epd_group *g)
{
        if (g->doorbell_dev)
                cudaHostUnregister(g->doorbell);
        g->doorbell_dev = NULL;
}
