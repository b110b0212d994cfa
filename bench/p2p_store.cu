/* p2p_store.cu - epd-bench's peer-to-peer store ceiling (docs/benchmarks.md, "Ceilings"): a
 * kernel on one GPU storing into a buffer of at least 1 GiB in another GPU's memory, the way
 * dispatch and combine push rows over NVLink (or PCIe). Two measurements:
 *
 *   epd_bench_p2p_store       one ordered pair, src_dev storing to dst_dev, the other GPUs idle;
 *   epd_bench_p2p_store_ring  every device d storing to device (d + 1) % n at the same time: the
 *                             aggregate is what the links carry when every GPU pushes at once,
 *                             as in an op whose ranks span the GPUs.
 *
 * Plain C entry points: epd_bench.c (C) calls them in the forked child that measures the
 * ceilings, since the parent never initialises CUDA. epd_bench.c declares them itself (the bench
 * has no header of its own); keep the two in step.
 *
 * Every timed figure is a store kernel bracketed by CUDA events on the source device's stream:
 * one untimed launch first (it faults in the remote mapping and the peer's pages and brings the
 * clocks up), then `reps` timed launches, each its own event pair. The caller gets every timed
 * launch's rate and their MEDIAN: one slow launch (another tenant, a clock dip) moves a median
 * little, while a best-of would reward an outlier; epd_bench.c does the same for the copy
 * ceiling. Bytes counted = bytes stored (no read side: the kernel reads nothing), 1e9 B/s.
 */
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Returned (besides 0 and -1) when the two devices cannot reach each other's memory
 * (cudaDeviceCanAccessPeer says no): the pair is skipped, err says so. */
#define EPD_BENCH_P2P_NO_PEER 1

#define P2P_THREADS 256
#define P2P_MAX_DEVICES 64

/* Stores 16 bytes per thread per step, grid-stride, to a buffer of n int4 on a peer GPU. The
 * value depends on the index and the launch, so that no two vectors of one launch and no two
 * launches write the same bytes (no link or memory compression can shortcut a constant). */
__global__ void p2p_store_kernel(int4 *__restrict__ dst, uint64_t n, uint32_t salt)
{
        const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;

        for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
                uint32_t lo = (uint32_t)i, hi = (uint32_t)(i >> 32);
                dst[i] = make_int4((int)(lo ^ salt), (int)(hi + salt), (int)~lo,
                                   (int)(lo * 2654435761u));
        }
}

static void say(char *err, size_t len, const char *fmt, ...)
{
        va_list ap;

        if (!err || !len)
                return;
        va_start(ap, fmt);
        vsnprintf(err, len, fmt, ap);
        va_end(ap);
}

/* Records the first CUDA failure in err and jumps to the caller's cleanup. */
#define P2P_TRY(call, what)                                                             \
        do {                                                                            \
                cudaError_t e_ = (call);                                                \
                if (e_ != cudaSuccess) {                                                \
                        say(err, err_len, "%s: %s (%s)", (what), cudaGetErrorString(e_), \
                            cudaGetErrorName(e_));                                      \
                        goto out;                                                       \
                }                                                                       \
        } while (0)

static int cmp_double(const void *a, const void *b)
{
        double x = *(const double *)a, y = *(const double *)b;

        return x < y ? -1 : x > y;
}

static double median(const double *v, int n)
{
        double *c;
        double m;

        if (n <= 0)
                return 0;
        c = (double *)malloc((size_t)n * sizeof(double));
        if (!c)
                return 0;
        memcpy(c, v, (size_t)n * sizeof(double));
        qsort(c, (size_t)n, sizeof(double), cmp_double);
        m = c[n / 2];
        free(c);
        return m;
}

/* Lets the current device (src) reach dst's memory. *enabled says whether this call enabled it,
 * so that the caller disables only what it enabled. Returns 0, EPD_BENCH_P2P_NO_PEER or -1. */
static int peer_on(int src, int dst, int *enabled, char *err, size_t err_len)
{
        int can = 0;
        cudaError_t e = cudaDeviceCanAccessPeer(&can, src, dst);

        *enabled = 0;
        if (e != cudaSuccess) {
                say(err, err_len, "cudaDeviceCanAccessPeer(%d, %d): %s (%s)", src, dst,
                    cudaGetErrorString(e), cudaGetErrorName(e));
                return -1;
        }
        if (!can) {
                say(err, err_len, "GPU %d cannot access GPU %d's memory (no peer access: "
                    "cudaDeviceCanAccessPeer says no)", src, dst);
                return EPD_BENCH_P2P_NO_PEER;
        }
        e = cudaDeviceEnablePeerAccess(dst, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
                /* Not sticky, but it stays the last error: clear it, or the next launch check
                 * would report it. */
                (void)cudaGetLastError();
                return 0;
        }
        if (e != cudaSuccess) {
                (void)cudaGetLastError();
                say(err, err_len, "cudaDeviceEnablePeerAccess(GPU %d -> GPU %d): %s (%s)", src,
                    dst, cudaGetErrorString(e), cudaGetErrorName(e));
                return -1;
        }
        *enabled = 1;
        return 0;
}

/* Blocks of P2P_THREADS that fill the current device: resident blocks per SM times SMs, so that
 * every SM keeps as many stores in flight as it can. */
static int fill_grid(int dev, unsigned *blocks, char *err, size_t err_len)
{
        int sms = 0, per_sm = 0;

        P2P_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
                "cudaDeviceGetAttribute(SM count)");
        P2P_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, p2p_store_kernel,
                                                              P2P_THREADS, 0),
                "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
        *blocks = (unsigned)(sms > 0 ? sms : 1) * (unsigned)(per_sm > 0 ? per_sm : 1);
        return 0;
out:
        return -1;
}

/* One ordered pair: src_dev stores `bytes` (rounded down to 16) into a buffer on dst_dev, once
 * untimed and then `reps` times, each launch timed with its own events on src_dev. rates[reps]
 * (may be NULL) gets every timed launch's GB/s in launch order, *gbps their median. Returns 0,
 * EPD_BENCH_P2P_NO_PEER (the pair cannot be measured; nothing was allocated) or -1 (a CUDA
 * failure), with the reason in err. Everything allocated is freed, peer access enabled here is
 * disabled again, and the current device is src_dev afterwards. */
extern "C" int epd_bench_p2p_store(int src_dev, int dst_dev, uint64_t bytes, int reps,
                                   double *rates, double *gbps, char *err, size_t err_len)
{
        const uint64_t n = bytes / sizeof(int4);
        int4 *buf = NULL;
        cudaStream_t st = NULL;
        cudaEvent_t e0 = NULL, e1 = NULL;
        double *r = NULL;
        unsigned blocks = 0;
        int enabled = 0, rc = -1;

        *gbps = 0;
        if (src_dev == dst_dev || n == 0 || reps < 1) {
                say(err, err_len, "P2P store: bad arguments (GPU %d -> GPU %d, %llu bytes, "
                    "%d reps)", src_dev, dst_dev, (unsigned long long)bytes, reps);
                return -1;
        }
        r = (double *)calloc((size_t)reps, sizeof(double));
        if (!r) {
                say(err, err_len, "P2P store: out of memory");
                return -1;
        }
        P2P_TRY(cudaSetDevice(src_dev), "cudaSetDevice(source)");
        rc = peer_on(src_dev, dst_dev, &enabled, err, err_len);
        if (rc != 0)
                goto out;
        rc = -1;
        /* The target buffer lives on dst_dev: allocate it there, then come back. */
        P2P_TRY(cudaSetDevice(dst_dev), "cudaSetDevice(target)");
        P2P_TRY(cudaMalloc((void **)&buf, n * sizeof(int4)), "cudaMalloc of the P2P target");
        P2P_TRY(cudaSetDevice(src_dev), "cudaSetDevice(source)");
        if (fill_grid(src_dev, &blocks, err, err_len) < 0)
                goto out;
        P2P_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
        P2P_TRY(cudaEventCreate(&e0), "cudaEventCreate");
        P2P_TRY(cudaEventCreate(&e1), "cudaEventCreate");
        p2p_store_kernel<<<blocks, P2P_THREADS, 0, st>>>(buf, n, 0x9E3779B9u);
        P2P_TRY(cudaGetLastError(), "P2P store kernel launch (warm-up)");
        P2P_TRY(cudaStreamSynchronize(st), "P2P store kernel (warm-up)");
        for (int i = 0; i < reps; i++) {
                float ms = 0;

                P2P_TRY(cudaEventRecord(e0, st), "cudaEventRecord");
                p2p_store_kernel<<<blocks, P2P_THREADS, 0, st>>>(buf, n, (uint32_t)i + 1);
                P2P_TRY(cudaGetLastError(), "P2P store kernel launch");
                P2P_TRY(cudaEventRecord(e1, st), "cudaEventRecord");
                P2P_TRY(cudaEventSynchronize(e1), "P2P store kernel");
                P2P_TRY(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
                if (ms <= 0) {
                        say(err, err_len, "P2P store GPU %d -> GPU %d: a launch timed %.6f ms",
                            src_dev, dst_dev, (double)ms);
                        goto out;
                }
                r[i] = (double)(n * sizeof(int4)) / ((double)ms * 1e6);
        }
        if (rates)
                memcpy(rates, r, (size_t)reps * sizeof(double));
        *gbps = median(r, reps);
        rc = 0;
out:
        if (e0)
                cudaEventDestroy(e0);
        if (e1)
                cudaEventDestroy(e1);
        if (st)
                cudaStreamDestroy(st);
        if (buf) {
                cudaSetDevice(dst_dev);
                cudaFree(buf);
        }
        cudaSetDevice(src_dev);
        if (enabled)
                cudaDeviceDisablePeerAccess(dst_dev);
        if (rc != 0)
                (void)cudaGetLastError();
        free(r);
        return rc;
}

/* Every device d in [0, num_devices) stores `bytes` into a buffer on device (d + 1) % num_devices
 * at the same time: the kernels are launched back to back from this thread (microseconds apart,
 * against milliseconds of run) and all waited for. Per launch round, each device's rate is its
 * bytes over its own event time, and the aggregate is every device's bytes over the SLOWEST
 * device's time (events of different devices cannot be compared, and the sum of per-device rates
 * would credit a device that finished early with the others' overlap). A host clock around each
 * round checks the overlap: a round that took more than 1.25 x the slowest device's time ran the
 * kernels partly one after another, and *serialized counts such rounds (the caller warns; the
 * aggregate is then too high).
 *
 * rates[reps] (may be NULL): the aggregate of every timed round; device_rates[num_devices * reps]
 * (may be NULL): device d's rate of round i at [d * reps + i]; *gbps the median aggregate;
 * device_gbps[num_devices] (may be NULL) each device's median. Returns 0, EPD_BENCH_P2P_NO_PEER
 * (some device cannot reach its successor) or -1, with the reason in err. Everything is freed
 * and peer access enabled here disabled again. */
extern "C" int epd_bench_p2p_store_ring(int num_devices, uint64_t bytes, int reps,
                                        double *rates, double *device_rates, double *gbps,
                                        double *device_gbps, int *serialized, char *err,
                                        size_t err_len)
{
        const uint64_t n = bytes / sizeof(int4);
        const int nd = num_devices;
        int4 *buf[P2P_MAX_DEVICES];
        cudaStream_t st[P2P_MAX_DEVICES];
        cudaEvent_t e0[P2P_MAX_DEVICES], e1[P2P_MAX_DEVICES];
        unsigned blocks[P2P_MAX_DEVICES];
        int enabled[P2P_MAX_DEVICES];
        double *agg = NULL, *dev = NULL;
        int rc = -1;

        *gbps = 0;
        if (serialized)
                *serialized = 0;
        if (nd < 2 || nd > P2P_MAX_DEVICES || n == 0 || reps < 1) {
                say(err, err_len, "P2P store ring: bad arguments (%d devices, %llu bytes, %d "
                    "reps)", nd, (unsigned long long)bytes, reps);
                return -1;
        }
        memset(buf, 0, sizeof(buf));
        memset(st, 0, sizeof(st));
        memset(e0, 0, sizeof(e0));
        memset(e1, 0, sizeof(e1));
        memset(enabled, 0, sizeof(enabled));
        agg = (double *)calloc((size_t)reps, sizeof(double));
        dev = (double *)calloc((size_t)nd * (size_t)reps, sizeof(double));
        if (!agg || !dev) {
                say(err, err_len, "P2P store ring: out of memory");
                goto out;
        }
        for (int d = 0; d < nd; d++) {
                int peer = (d + 1) % nd;

                P2P_TRY(cudaSetDevice(d), "cudaSetDevice");
                rc = peer_on(d, peer, &enabled[d], err, err_len);
                if (rc != 0)
                        goto out;
                rc = -1;
                if (fill_grid(d, &blocks[d], err, err_len) < 0)
                        goto out;
                P2P_TRY(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking),
                        "cudaStreamCreate");
                P2P_TRY(cudaEventCreate(&e0[d]), "cudaEventCreate");
                P2P_TRY(cudaEventCreate(&e1[d]), "cudaEventCreate");
                /* Device d's target is on its successor. */
                P2P_TRY(cudaSetDevice(peer), "cudaSetDevice(target)");
                P2P_TRY(cudaMalloc((void **)&buf[d], n * sizeof(int4)),
                        "cudaMalloc of a P2P ring target");
        }
        for (int i = -1; i < reps; i++) { /* round -1: the untimed warm-up */
                struct timespec h0, h1;
                double slowest = 0, host_ms;

                clock_gettime(CLOCK_MONOTONIC, &h0);
                for (int d = 0; d < nd; d++) {
                        P2P_TRY(cudaSetDevice(d), "cudaSetDevice");
                        P2P_TRY(cudaEventRecord(e0[d], st[d]), "cudaEventRecord");
                        p2p_store_kernel<<<blocks[d], P2P_THREADS, 0, st[d]>>>(
                                buf[d], n, (uint32_t)(i + 1) * 64u + (uint32_t)d);
                        P2P_TRY(cudaGetLastError(), "P2P ring store kernel launch");
                        P2P_TRY(cudaEventRecord(e1[d], st[d]), "cudaEventRecord");
                }
                for (int d = 0; d < nd; d++)
                        P2P_TRY(cudaEventSynchronize(e1[d]), "P2P ring store kernel");
                clock_gettime(CLOCK_MONOTONIC, &h1);
                if (i < 0)
                        continue;
                for (int d = 0; d < nd; d++) {
                        float ms = 0;

                        P2P_TRY(cudaEventElapsedTime(&ms, e0[d], e1[d]), "cudaEventElapsedTime");
                        if (ms <= 0) {
                                say(err, err_len, "P2P store ring: GPU %d's launch timed %.6f ms",
                                    d, (double)ms);
                                goto out;
                        }
                        dev[(size_t)d * reps + i] = (double)(n * sizeof(int4)) / ((double)ms * 1e6);
                        if (ms > slowest)
                                slowest = ms;
                }
                agg[i] = (double)nd * (double)(n * sizeof(int4)) / (slowest * 1e6);
                host_ms = (double)(h1.tv_sec - h0.tv_sec) * 1e3 +
                          (double)(h1.tv_nsec - h0.tv_nsec) / 1e6;
                if (serialized && host_ms > 1.25 * slowest)
                        (*serialized)++;
        }
        if (rates)
                memcpy(rates, agg, (size_t)reps * sizeof(double));
        if (device_rates)
                memcpy(device_rates, dev, (size_t)nd * (size_t)reps * sizeof(double));
        for (int d = 0; device_gbps && d < nd; d++)
                device_gbps[d] = median(dev + (size_t)d * reps, reps);
        *gbps = median(agg, reps);
        rc = 0;
out:
        for (int d = 0; d < nd; d++) {
                if (buf[d]) {
                        cudaSetDevice((d + 1) % nd);
                        cudaFree(buf[d]);
                }
                cudaSetDevice(d);
                if (e0[d])
                        cudaEventDestroy(e0[d]);
                if (e1[d])
                        cudaEventDestroy(e1[d]);
                if (st[d])
                        cudaStreamDestroy(st[d]);
                if (enabled[d])
                        cudaDeviceDisablePeerAccess((d + 1) % nd);
        }
        if (rc != 0)
                (void)cudaGetLastError();
        free(agg);
        free(dev);
        return rc;
}
