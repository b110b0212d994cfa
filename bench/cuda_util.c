/* cuda_util.c - a worker's CUDA side: its stream and event, device memory registered with the
 * daemon, synchronous copies, the L2 flush of Fresh mode, stream-ordered completion, and for
 * client-executed runs the start gate and the launch floor.
 *
 * Only workers call these, after fork (and the ceiling children cu_ok): the parent never
 * initialises CUDA. Each returns 0, or -1 with the reason in err. Without CUDA (EPD_BENCH_CUDA
 * unset) every call fails so; option parsing refuses --backend cuda before any is made.
 */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "bench.h"
#ifdef EPD_BENCH_CUDA
#include "cudrv.h"
#endif

#ifndef EPD_BENCH_CUDA
/* What every call answers in a build without CUDA. */
static int no_cuda(char *err, size_t len)
{
        snprintf(err, len, "epd-bench was built without CUDA");
        return -1;
}
#endif

#ifdef EPD_BENCH_CUDA
int cu_ok(cudaError_t e, const char *what, char *err, size_t len)
{
        if (e == cudaSuccess)
                return 0;
        snprintf(err, len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
        return -1;
}
#endif

void *wc_stream(const struct wcuda *wc)
{
#ifdef EPD_BENCH_CUDA
        return (void *)wc->stream;
#else
        (void)wc;
        return NULL;
#endif
}

int wcuda_init(struct wcuda *wc, const struct bench *b, uint32_t rank, char *err,
                      size_t len)
{
#ifdef EPD_BENCH_CUDA
        wc->device = rank % b->opt.devices;
        wc->cumem = b->opt.cumem;
        CU_TRY(cudaSetDevice((int)wc->device), "cudaSetDevice");
        CU_TRY(cudaFree(NULL), "CUDA context creation");
        CU_TRY(cudaStreamCreateWithFlags(&wc->stream, cudaStreamNonBlocking), "cudaStreamCreate");
        CU_TRY(cudaEventCreateWithFlags(&wc->ev, cudaEventDisableTiming), "cudaEventCreate");
        wc->on = 1;
        if (b->opt.flush_l2) {
                CU_TRY(cudaMalloc((void **)&wc->flush, FLUSH_BYTES),
                       "cudaMalloc of the L2 flush buffer");
                CU_TRY(cudaMemset(wc->flush, 1, FLUSH_BYTES), "cudaMemset");
                CU_TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        }
        return 0;
#else
        (void)wc;
        (void)b;
        (void)rank;
        return no_cuda(err, len);
#endif
}

void wcuda_fini(struct wcuda *wc)
{
#ifdef EPD_BENCH_CUDA
        /* --alloc cumem memory was given back with epd_device_free already (NULL here). */
        uint8_t *bufs[5] = { wc->d_in, wc->d_y, wc->d_out, wc->d_comb, wc->flush };

        if (!wc->on)
                return;
        if (wc->gate)
                cudaHostUnregister(wc->gate);
        for (int i = 0; i < 5; i++)
                if (bufs[i])
                        cudaFree(bufs[i]);
        cudaEventDestroy(wc->ev);
        cudaStreamDestroy(wc->stream);
#endif
        memset(wc, 0, sizeof(*wc));
}

/* Device memory of `bytes` (at least 4096) on the worker's GPU, registered with the daemon.
 * *out is set as soon as the memory exists, so that the caller frees it on any failure. */
int dev_alloc_register(struct epd_client *c, struct wcuda *wc, uint64_t bytes,
                              uint8_t **out, uint64_t *region, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        void *p = NULL;
        int rc;

        bytes = bytes < 4096 ? 4096 : bytes;
        if (wc->cumem) {
                /* cuMem through libepd: the daemon maps the allocation itself. */
                rc = epd_device_alloc(c, wc->device, bytes, &p, region);
                if (rc < 0) {
                        snprintf(err, len, "epd_device_alloc(%llu bytes on device %u): %s: %s",
                                 (unsigned long long)bytes, wc->device, epd_status_name(rc),
                                 epd_client_last_error(c));
                        return -1;
                }
                *out = p;
                return 0;
        }
        CU_TRY(cudaMalloc(&p, bytes), "cudaMalloc");
        *out = p;
        rc = epd_region_register_device(c, p, bytes, wc->device, region);
        if (rc < 0) {
                snprintf(err, len, "epd_region_register_device(%llu bytes on device %u): %s: %s",
                         (unsigned long long)bytes, wc->device, epd_status_name(rc),
                         epd_client_last_error(c));
                return -1;
        }
        return 0;
#else
        (void)c;
        (void)wc;
        (void)bytes;
        (void)out;
        (void)region;
        return no_cuda(err, len);
#endif
}

/* A synchronous copy: cudaMemcpy may return before a device-side copy lands, and the daemon
 * reads this memory from another process, so the device is synchronised after it. */
int dev_copy(void *dst, const void *src, uint64_t bytes, int kind, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        static const enum cudaMemcpyKind kinds[3] = { cudaMemcpyHostToDevice,
                                                      cudaMemcpyDeviceToHost,
                                                      cudaMemcpyDeviceToDevice };
        if (bytes)
                CU_TRY(cudaMemcpy(dst, src, bytes, kinds[kind]), "cudaMemcpy");
        CU_TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize after a copy");
        return 0;
#else
        (void)dst;
        (void)src;
        (void)bytes;
        (void)kind;
        return no_cuda(err, len);
#endif
}

int dev_fill(void *dst, int value, uint64_t bytes, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        CU_TRY(cudaMemset(dst, value, bytes), "cudaMemset");
        CU_TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize after a fill");
        return 0;
#else
        (void)dst;
        (void)value;
        (void)bytes;
        return no_cuda(err, len);
#endif
}

/* Fresh mode: 256 MB written on the GPU and finished before the op is submitted, so that the
 * op's kernels find an L2 holding none of their data (docs/benchmarks.md). The value changes every
 * time. */
int dev_flush(struct wcuda *wc, uint32_t seq, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        CU_TRY(cudaMemsetAsync(wc->flush, (int)(seq % 251) + 1, FLUSH_BYTES, wc->stream),
               "cudaMemsetAsync (L2 flush)");
        CU_TRY(cudaStreamSynchronize(wc->stream), "cudaStreamSynchronize (L2 flush)");
        return 0;
#else
        (void)wc;
        (void)seq;
        return no_cuda(err, len);
#endif
}

/* Stream-ordered completion: the worker's stream waits for the op's doorbell, an event is
 * recorded after the wait, and the host spins on the event: the op is complete for the client
 * when work queued behind it could start. */
int wc_sync(struct wcuda *wc, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        return cu_ok(cudaStreamSynchronize(wc->stream), "cudaStreamSynchronize", err, len);
#else
        (void)wc;
        return no_cuda(err, len);
#endif
}

int wc_gate_init(struct wcuda *wc, struct cx_gate *gate, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        void *dev = NULL;

        if (!epd_cudrv()) {
                snprintf(err, len, "the CUDA driver's stream memory operations are missing");
                return -1;
        }
        CU_TRY(cudaHostRegister(gate, sizeof(*gate), cudaHostRegisterMapped |
                                                         cudaHostRegisterPortable),
               "cudaHostRegister (the start gate)");
        wc->gate = gate;
        CU_TRY(cudaHostGetDevicePointer(&dev, gate, 0), "cudaHostGetDevicePointer (the gate)");
        wc->gate_dev = (uint64_t)(uintptr_t)dev;
        return 0;
#else
        (void)wc;
        (void)gate;
        return no_cuda(err, len);
#endif
}

int wc_gate_wait(struct wcuda *wc, uint64_t seq, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        CUresult r = epd_cudrv()->StreamWaitValue64(
                (CUstream)wc->stream, (CUdeviceptr)(wc->gate_dev + offsetof(struct cx_gate, open)),
                seq, CU_STREAM_WAIT_VALUE_GEQ);

        if (r != CUDA_SUCCESS) {
                snprintf(err, len, "cuStreamWaitValue64 (the start gate): error %d", (int)r);
                return -1;
        }
        return 0;
#else
        (void)wc;
        (void)seq;
        return no_cuda(err, len);
#endif
}

#ifdef EPD_BENCH_CUDA
int epd_bench_empty_round_trip(void *stream); /* launch_floor.cu */
#endif

int wc_launch_floor(struct wcuda *wc, unsigned n, double *p50_us, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        double *us = malloc((n ? n : 1) * sizeof(double));

        if (!us) {
                snprintf(err, len, "out of memory");
                return -1;
        }
        for (unsigned i = 0; i < 10 + n; i++) { /* 10 untimed first */
                uint64_t t0 = now_ns();

                if (epd_bench_empty_round_trip((void *)wc->stream) < 0) {
                        snprintf(err, len, "the launch floor: %s",
                                 cudaGetErrorString(cudaGetLastError()));
                        free(us);
                        return -1;
                }
                if (i >= 10)
                        us[i - 10] = (double)(now_ns() - t0) / 1e3;
        }
        *p50_us = median_of(us, n);
        free(us);
        return 0;
#else
        (void)wc;
        (void)n;
        (void)p50_us;
        return no_cuda(err, len);
#endif
}

int stream_complete(struct wcuda *wc, struct epd_op *op, char *err, size_t len)
{
#ifdef EPD_BENCH_CUDA
        uint64_t start = now_ns();
        unsigned spins = 0;
        cudaError_t e;
        int rc = epd_op_stream_wait(op, wc->stream);

        if (rc < 0) {
                snprintf(err, len, "epd_op_stream_wait: %s", epd_status_name(rc));
                return -1;
        }
        CU_TRY(cudaEventRecord(wc->ev, wc->stream), "cudaEventRecord");
        while ((e = cudaEventQuery(wc->ev)) == cudaErrorNotReady) {
                if ((++spins & 1023) == 0 && now_ns() - start > SPIN_TIMEOUT_NS) {
                        snprintf(err, len, "the stream wait did not complete within %llu s",
                                 (unsigned long long)(SPIN_TIMEOUT_NS / 1000000000ull));
                        return -1;
                }
        }
        return cu_ok(e, "cudaEventQuery", err, len);
#else
        (void)wc;
        (void)op;
        return no_cuda(err, len);
#endif
}
