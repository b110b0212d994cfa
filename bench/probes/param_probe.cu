/* param_probe.cu - epd-param-probe: what the start of a kernel costs. First, its reads of its
 * own parameters, by how many 64-byte lines of the parameter block they touch and how they are
 * read. The decode combine's warps take about 0.6 us from their entry until they have the
 * parameters that their first workspace load needs (docs/performance.md), while a reduce whose
 * parameters fit one line has its plan row back in that time. Each warp of a grid shaped like the
 * combine's (2 blocks of 256 threads per multiprocessor) reads one 4-byte word from each of N lines
 * of a 2 KiB __grid_constant__ parameter block and stamps the global timer before the first read
 * and after the last value has arrived:
 *
 *   constant     word i * 16, a compile-time offset: constant-bank operands, independent reads
 *   dependent    the same words, each offset depending on the previous value (always 0): a
 *                chain of constant loads with register offsets, each waiting for the one before
 *   generic      the same words through a generic pointer to the block (the path loads through
 *                a pointer of unknown address space take: L1 and L2, like device memory)
 *   per lane     lane l reads line l % N with a register offset: one divergent constant load
 *
 * after the benchmark's L2 flush (256 MB written, the GPU then idle) and warm (no flush). Printed:
 * the median over launches of the warps' median and maximum nanoseconds. The first read may be
 * issued before the first stamp (one line reads 0 ns in every mode), so a row's figure is what
 * the lines after the first add.
 *
 * A second table times the launch itself by the size of the parameter block and the grid's shape:
 * a graph of an event, a kernel whose warps read the block's first and last words, and an event,
 * the way the daemon times an op (timed.cu: the kernel node's parameters set again before each
 * launch); the median event time over the launches, after the flush and warm.
 *
 * A third times a warp's first pass through straight-line code of 1 to 32 KiB, after the flush,
 * after the flush and another kernel of the same size, and warm: whether the instruction caches
 * make a kernel's first microsecond longer after the flush.
 *
 * Usage: epd-param-probe [REPS]   (default 100). Exit 77 without a usable GPU, 1 on a CUDA error.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROBE_NAME "epd-param-probe"
#include "probe_check.cuh"

#define PP_FLUSH_BYTES (256ull << 20)
#define PP_WORDS 512 /* 2 KiB of parameters: 32 lines of 64 bytes */
#define PP_THREADS 256
#define PP_MAX_WARPS 8192

struct pp_params {
        uint32_t w[PP_WORDS];
};

enum pp_mode { PP_CONSTANT, PP_DEPENDENT, PP_GENERIC, PP_PER_LANE, PP_MODES };
static const char *const pp_mode_names[PP_MODES] = { "constant", "dependent", "generic",
                                                     "per lane" };

static __device__ __forceinline__ uint64_t pp_timer_after(uint32_t v)
{
        uint64_t t;
        /* volatile with v as an input: the timer is read once v has arrived */
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(v) : "memory");
        return t;
}

template <int LINES, int MODE>
__global__ void __launch_bounds__(PP_THREADS) pp_kernel(const __grid_constant__ struct pp_params p,
                                                       uint64_t *out)
{
        const uint32_t lane = threadIdx.x % 32;
        const uint32_t warp = (blockIdx.x * PP_THREADS + threadIdx.x) / 32;
        uint64_t t0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0) : : "memory");
        uint32_t acc = 0;
        if (MODE == PP_CONSTANT) {
#pragma unroll
                for (int i = 0; i < LINES; i++)
                        acc += p.w[i * 16];
        } else if (MODE == PP_DEPENDENT) {
#pragma unroll
                for (int i = 0; i < LINES; i++)
                        acc += p.w[i * 16 + (acc & 1)];
        } else if (MODE == PP_GENERIC) {
                const uint32_t *g;
                /* hide the address space: the loads go through a generic pointer */
                asm("mov.b64 %0, %1;" : "=l"(g) : "l"(p.w));
#pragma unroll
                for (int i = 0; i < LINES; i++)
                        acc += g[i * 16];
        } else {
                acc = p.w[(lane % LINES) * 16];
        }
        const uint64_t t1 = pp_timer_after(acc);
        if (lane == 0 && warp < PP_MAX_WARPS)
                out[warp] = (t1 - t0) | (uint64_t)(acc != 0) << 63; /* acc is always 0 */
}

typedef void (*pp_fn)(struct pp_params, uint64_t *);

#define PP_ROW(lines)                                                                              \
        { lines, { pp_kernel<lines, PP_CONSTANT>, pp_kernel<lines, PP_DEPENDENT>,                  \
                   pp_kernel<lines, PP_GENERIC>, pp_kernel<lines, PP_PER_LANE> } }
static const struct {
        int lines;
        pp_fn fn[PP_MODES];
} pp_rows[] = { PP_ROW(1), PP_ROW(2), PP_ROW(4), PP_ROW(8), PP_ROW(16), PP_ROW(32) };

/* The launch window by parameter bytes. */
template <int BYTES> struct pp_sized {
        uint32_t w[BYTES / 4];
};

template <int BYTES>
__global__ void __launch_bounds__(2 * PP_THREADS)
        pp_sized_kernel(const __grid_constant__ struct pp_sized<BYTES> p, uint64_t *out)
{
        const uint32_t v = p.w[0] + p.w[BYTES / 4 - 1]; /* always 0 */
        if (v != 0 && threadIdx.x % 32 == 0)
                out[0] = v; /* never: keeps the reads */
}

/* The first pass through a kernel's code: every warp runs KB KiB of straight-line code once
 * (64 dependent 16-byte IMADs per KiB, whose factor comes from the parameters so that nothing
 * folds) between two timer reads. ALT builds a second copy of the same size, so that running it
 * between two launches of the first puts other code in the instruction caches. */
template <int KB, int ALT>
__global__ void __launch_bounds__(PP_THREADS) pp_code_kernel(uint32_t f, uint64_t *out)
{
        const uint32_t warp = (blockIdx.x * PP_THREADS + threadIdx.x) / 32;
        uint64_t t0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0) : : "memory");
        uint32_t x = threadIdx.x + ALT;
#pragma unroll
        for (int i = 0; i < KB * 64; i++)
                asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(f), "r"(i + 1));
        const uint64_t t1 = pp_timer_after(x);
        if (threadIdx.x % 32 == 0 && warp < PP_MAX_WARPS)
                out[warp] = (t1 - t0) | (uint64_t)(x == 0x9e3779b9u) << 63; /* keeps x */
}

static int cmp_float(const void *a, const void *b)
{
        const float x = *(const float *)a, y = *(const float *)b;
        return x < y ? -1 : x > y;
}

/* Median ms of event -> kernel -> event over reps launches, after the flush or warm. */
template <int BYTES>
static float pp_window(int blocks, int threads, int fresh, int reps, uint8_t *flush, uint64_t *out,
                       cudaStream_t s, float *ms)
{
        static struct pp_sized<BYTES> p; /* zeros */
        void *params[2] = { &p, &out };
        cudaKernelNodeParams kp = {};
        kp.func = (void *)pp_sized_kernel<BYTES>;
        kp.gridDim = dim3((unsigned)blocks);
        kp.blockDim = dim3((unsigned)threads);
        kp.kernelParams = params;
        cudaGraph_t g;
        cudaGraphExec_t x;
        cudaGraphNode_t n0, nk, n1;
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaGraphCreate(&g, 0));
        CK(cudaGraphAddEventRecordNode(&n0, g, NULL, 0, e0));
        CK(cudaGraphAddKernelNode(&nk, g, &n0, 1, &kp));
        CK(cudaGraphAddEventRecordNode(&n1, g, &nk, 1, e1));
        CK(cudaGraphInstantiate(&x, g, 0));
        for (int i = -1; i < reps; i++) {
                if (fresh)
                        CK(cudaMemsetAsync(flush, (i + 2) % 251, PP_FLUSH_BYTES, s));
                CK(cudaStreamSynchronize(s));
                CK(cudaGraphExecKernelNodeSetParams(x, nk, &kp));
                CK(cudaGraphLaunch(x, s));
                CK(cudaStreamSynchronize(s));
                if (i >= 0)
                        CK(cudaEventElapsedTime(&ms[i], e0, e1));
        }
        CK(cudaGraphExecDestroy(x));
        CK(cudaGraphDestroy(g));
        CK(cudaEventDestroy(e0));
        CK(cudaEventDestroy(e1));
        qsort(ms, (size_t)reps, sizeof(float), cmp_float);
        return ms[reps / 2];
}

static int cmp_u64(const void *a, const void *b)
{
        const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

/* One launch's figures, the median and the maximum of its warps' values (host is sorted). */
static void pp_launch_stats(uint64_t *host, uint32_t warps, uint64_t *med, uint64_t *mx)
{
        qsort(host, warps, sizeof(uint64_t), cmp_u64);
        *med = host[warps / 2];
        *mx = host[warps - 1];
}

/* The medians over the launches of both (med and mx are sorted). */
static void pp_over_launches(uint64_t *med, uint64_t *mx, int reps, uint64_t res[2])
{
        qsort(med, (size_t)reps, sizeof(uint64_t), cmp_u64);
        qsort(mx, (size_t)reps, sizeof(uint64_t), cmp_u64);
        res[0] = med[reps / 2];
        res[1] = mx[reps / 2];
}

int main(int argc, char **argv)
{
        const int reps = argc > 1 ? atoi(argv[1]) : 100;
        if (reps < 1 || reps > 100000) {
                fprintf(stderr, "usage: %s [REPS] (1..100000)\n", argv[0]);
                return 2;
        }
        int dev_count = 0;
        if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count < 1) {
                fprintf(stderr, PROBE_NAME ": no usable GPU\n");
                return 77;
        }
        cudaDeviceProp prop;
        CK(cudaGetDeviceProperties(&prop, 0));
        const int blocks = 2 * prop.multiProcessorCount;
        const uint32_t warps = (uint32_t)blocks * PP_THREADS / 32;
        uint8_t *flush;
        uint64_t *out, *host = (uint64_t *)calloc(warps, sizeof(uint64_t));
        uint64_t *med = (uint64_t *)calloc((size_t)reps, sizeof(uint64_t));
        uint64_t *mx = (uint64_t *)calloc((size_t)reps, sizeof(uint64_t));
        if (warps > PP_MAX_WARPS) {
                fprintf(stderr, PROBE_NAME ": %u warps, more than the %d this probe records\n",
                        warps, PP_MAX_WARPS);
                return 1;
        }
        if (host == NULL || med == NULL || mx == NULL) {
                fprintf(stderr, PROBE_NAME ": out of memory\n");
                return 1;
        }
        CK(cudaMalloc((void **)&flush, PP_FLUSH_BYTES));
        CK(cudaMalloc((void **)&out, warps * sizeof(uint64_t)));
        cudaStream_t s;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        struct pp_params p;
        memset(&p, 0, sizeof(p));

        printf(PROBE_NAME " on %s: %d blocks of %d threads, %d launches each; ns from a warp's "
               "first parameter read until its last value arrived, median over launches of the "
               "warps' median / maximum\n",
               prop.name, blocks, PP_THREADS, reps);
        printf("  %-10s %5s  %21s  %21s\n", "read", "lines", "after the flush", "warm");
        for (int m = 0; m < PP_MODES; m++)
                for (size_t r = 0; r < sizeof(pp_rows) / sizeof(pp_rows[0]); r++) {
                        uint64_t res[2][2];
                        for (int fresh = 1; fresh >= 0; fresh--) {
                                for (int i = -1; i < reps; i++) {
                                        if (fresh)
                                                CK(cudaMemsetAsync(flush, (i + 2) % 251, PP_FLUSH_BYTES, s));
                                        CK(cudaStreamSynchronize(s));
                                        pp_rows[r].fn[m]<<<blocks, PP_THREADS, 0, s>>>(p, out);
                                        CK(cudaGetLastError());
                                        CK(cudaMemcpyAsync(host, out, warps * sizeof(uint64_t),
                                                           cudaMemcpyDeviceToHost, s));
                                        CK(cudaStreamSynchronize(s));
                                        if (i < 0)
                                                continue; /* untimed */
                                        for (uint32_t w = 0; w < warps; w++)
                                                if (host[w] >> 63) {
                                                        fprintf(stderr, PROBE_NAME ": a parameter read returned the wrong value\n");
                                                        return 1;
                                                }
                                        pp_launch_stats(host, warps, &med[i], &mx[i]);
                                }
                                pp_over_launches(med, mx, reps, res[fresh]);
                        }
                        printf("  %-10s %5d  %9llu / %9llu  %9llu / %9llu\n", pp_mode_names[m],
                               pp_rows[r].lines, (unsigned long long)res[1][0],
                               (unsigned long long)res[1][1], (unsigned long long)res[0][0],
                               (unsigned long long)res[0][1]);
                }

        float *ms = (float *)calloc((size_t)reps, sizeof(float));
        if (ms == NULL) {
                fprintf(stderr, PROBE_NAME ": out of memory\n");
                return 1;
        }
        printf("launch window (event, kernel reading its first and last parameter words, event; "
               "one graph, parameters set before each launch), median us after the flush / warm\n");
        typedef float (*window_fn)(int, int, int, int, uint8_t *, uint64_t *, cudaStream_t, float *);
        const struct {
                int bytes;
                window_fn fn;
        } sizes[] = { { 16, pp_window<16> },     { 128, pp_window<128> },
                      { 512, pp_window<512> },   { 1024, pp_window<1024> },
                      { 1536, pp_window<1536> }, { 2048, pp_window<2048> },
                      { 4096, pp_window<4096> } };
        const struct {
                int blocks, threads;
        } shapes[] = { { blocks, PP_THREADS }, { blocks / 2, 2 * PP_THREADS }, { 1, 32 } };
        for (int pass = 0; pass < 2; pass++)
                for (size_t g = 0; g < sizeof(shapes) / sizeof(shapes[0]); g++)
                        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
                                if (g > 0 && sizes[i].bytes != 16 && sizes[i].bytes != 1024)
                                        continue;
                                const int b = shapes[g].blocks, t = shapes[g].threads;
                                const float f = sizes[i].fn(b, t, 1, reps, flush, out, s, ms);
                                const float w = sizes[i].fn(b, t, 0, reps, flush, out, s, ms);
                                printf("  pass %d  %4d x %4d threads  %5d bytes  %7.3f / %7.3f us\n",
                                       pass, b, t, sizes[i].bytes, 1000.0f * f, 1000.0f * w);
                        }

        printf("first pass through the code (every warp runs it once; median over launches of the "
               "warps' median / maximum ns): after the flush / after the flush and another kernel "
               "of the same size / warm\n");
        typedef void (*code_fn)(uint32_t, uint64_t *);
        const struct {
                int kb;
                code_fn fn, alt;
        } codes[] = { { 1, pp_code_kernel<1, 0>, pp_code_kernel<1, 1> },
                      { 4, pp_code_kernel<4, 0>, pp_code_kernel<4, 1> },
                      { 8, pp_code_kernel<8, 0>, pp_code_kernel<8, 1> },
                      { 16, pp_code_kernel<16, 0>, pp_code_kernel<16, 1> },
                      { 32, pp_code_kernel<32, 0>, pp_code_kernel<32, 1> } };
        for (size_t c = 0; c < sizeof(codes) / sizeof(codes[0]); c++) {
                uint64_t res[3][2];
                for (int mode = 0; mode < 3; mode++) {
                        for (int i = -1; i < reps; i++) {
                                if (mode < 2)
                                        CK(cudaMemsetAsync(flush, (i + 2) % 251, PP_FLUSH_BYTES, s));
                                if (mode == 1)
                                        codes[c].alt<<<blocks, PP_THREADS, 0, s>>>(3u, out);
                                CK(cudaStreamSynchronize(s));
                                codes[c].fn<<<blocks, PP_THREADS, 0, s>>>(3u, out);
                                CK(cudaGetLastError());
                                CK(cudaMemcpyAsync(host, out, warps * sizeof(uint64_t),
                                                   cudaMemcpyDeviceToHost, s));
                                CK(cudaStreamSynchronize(s));
                                if (i < 0)
                                        continue;
                                for (uint32_t w = 0; w < warps; w++)
                                        host[w] &= ~(1ull << 63);
                                pp_launch_stats(host, warps, &med[i], &mx[i]);
                        }
                        pp_over_launches(med, mx, reps, res[mode]);
                }
                printf("  %3d KiB  %7llu / %7llu  %7llu / %7llu  %7llu / %7llu\n", codes[c].kb,
                       (unsigned long long)res[0][0], (unsigned long long)res[0][1],
                       (unsigned long long)res[1][0], (unsigned long long)res[1][1],
                       (unsigned long long)res[2][0], (unsigned long long)res[2][1]);
        }
        return 0;
}
