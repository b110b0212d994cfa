/* param_probe.cu - epd-param-probe: what a kernel's first reads of its own parameters cost, by
 * how many 64-byte lines of the parameter block they touch and how they are read. The decode
 * combine's warps take about 0.6 us from their entry until they have the parameters that their
 * first workspace load needs (docs/performance.md, twenty-second session), while a reduce whose
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

static int cmp_u64(const void *a, const void *b)
{
        const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
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
                                        qsort(host, warps, sizeof(uint64_t), cmp_u64);
                                        med[i] = host[warps / 2];
                                        mx[i] = host[warps - 1];
                                }
                                qsort(med, (size_t)reps, sizeof(uint64_t), cmp_u64);
                                qsort(mx, (size_t)reps, sizeof(uint64_t), cmp_u64);
                                res[fresh][0] = med[reps / 2];
                                res[fresh][1] = mx[reps / 2];
                        }
                        printf("  %-10s %5d  %9llu / %9llu  %9llu / %9llu\n", pp_mode_names[m],
                               pp_rows[r].lines, (unsigned long long)res[1][0],
                               (unsigned long long)res[1][1], (unsigned long long)res[0][0],
                               (unsigned long long)res[0][1]);
                }
        return 0;
}
