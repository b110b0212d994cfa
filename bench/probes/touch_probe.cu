/* touch_probe.cu - epd-touch-probe: what one warp's first loads cost right after the benchmark's
 * L2 flush (256 MB written, the GPU then idle), the state in which a decode combine's warps wait
 * 1.7 us for their workspace entries (docs/performance.md). One thread chases
 * a chain of dependent 4-byte loads (ld.global.cg: the L2, never L1) through two buffers and
 * times each with the SM's clock:
 *
 *   page A, line 0    the first touch of a 2 MiB page since the flush (translation and DRAM)
 *   page A, line 1    another line of the same page (DRAM; the translation is now cached)
 *   page A, line 0    the first line again (an L2 hit)
 *   page B, line 0    the first touch of a second page (translation and DRAM again)
 *   page B, line 1    another line of page B
 *   page B far        a line 1 MiB further into page B
 *
 * Each load's address is the previous address plus the loaded value (always 0), so no load
 * issues before the one before it has returned, and the clock is read after the value has been
 * stored to shared memory (a store cannot issue before its value has arrived). Printed: the
 * median and p90 cycles of each load over REPS flushes, and the SM clock, so that cycles read as
 * nanoseconds. The same chain without the flush (everything warm) is the reference.
 *
 * Usage: epd-touch-probe [REPS]   (default 200). Exit 77 without a usable GPU, 1 on a CUDA error.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define PROBE_NAME "epd-touch-probe"
#include "probe_check.cuh"

#define TP_FLUSH_BYTES (256ull << 20)
#define TP_PAGE (2ull << 20)
#define TP_LOADS 6

static const char *const tp_names[TP_LOADS] = {
        "page A, first line (first touch)", "page A, another line", "page A, first line again",
        "page B, first line (first touch)", "page B, another line", "page B, 1 MiB further",
};

/* The chain's byte offsets from the base of the two pages (A at 0, B at TP_PAGE). */
static const uint64_t tp_offsets[TP_LOADS] = {
        0, 4096, 0, TP_PAGE, TP_PAGE + 4096, TP_PAGE + (1ull << 20),
};

struct tp_chain {
        uint64_t off[TP_LOADS];
};

static __device__ __forceinline__ uint32_t tp_ld_cg(const uint8_t *p)
{
        uint32_t v;
        asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
}

static __device__ __forceinline__ long long tp_clock(void)
{
        long long c;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) : : "memory");
        return c;
}

/* One thread: load i's cycles into cycles[i]. */
__global__ void tp_chase(const uint8_t *base, struct tp_chain c, long long *cycles)
{
        /* The loaded value is stored to shared memory before the second clock read: issue is in
         * order, and the store cannot issue before the load has returned. (A register move alone
         * is folded away by ptxas, and the clock was then read 2 cycles after the load issued.) */
        __shared__ volatile uint32_t seen[TP_LOADS];
        uint64_t carry = 0;
        for (int i = 0; i < TP_LOADS; i++) {
                const uint8_t *p;
                asm volatile("add.u64 %0, %1, %2;" : "=l"(p) : "l"(base + c.off[i]), "l"(carry));
                const long long t0 = tp_clock();
                const uint32_t v = tp_ld_cg(p);
                seen[i] = v;
                carry = v;
                const long long t1 = tp_clock();
                cycles[i] = t1 - t0;
        }
}

static int cmp_ll(const void *a, const void *b)
{
        const long long x = *(const long long *)a, y = *(const long long *)b;
        return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
        int reps = 200, ndev = 0, clock_khz = 0;
        char *end = NULL;

        if (argc == 2) {
                const long v = strtol(argv[1], &end, 10);
                reps = *argv[1] && *end == '\0' && v >= 1 && v <= 1000000 ? (int)v : 0;
        }
        if (argc > 2 || reps < 1) {
                fprintf(stderr, "usage: epd-touch-probe [REPS]\n");
                return 2;
        }
        if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
                printf("SKIP: no CUDA device\n");
                return 77;
        }
        CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
        uint8_t *flush = NULL, *pages = NULL;
        long long *cycles = NULL;
        CK(cudaMalloc((void **)&flush, TP_FLUSH_BYTES));
        CK(cudaMalloc((void **)&pages, 2 * TP_PAGE + TP_PAGE)); /* room to align to a page */
        CK(cudaMalloc((void **)&cycles, sizeof(long long) * TP_LOADS));
        uint8_t *base = (uint8_t *)(((uintptr_t)pages + TP_PAGE - 1) / TP_PAGE * TP_PAGE);
        CK(cudaMemset(pages, 0, 3 * TP_PAGE));
        struct tp_chain c;
        for (int i = 0; i < TP_LOADS; i++)
                c.off[i] = tp_offsets[i];
        cudaStream_t s;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        long long *all = (long long *)calloc((size_t)reps * TP_LOADS, sizeof(long long));
        if (all == NULL) {
                fprintf(stderr, "epd-touch-probe: out of memory\n");
                return 1;
        }
        printf("epd-touch-probe: one thread's dependent ld.global.cg loads, SM clock %d MHz, %d "
               "repetitions; cycles median / p90\n", clock_khz / 1000, reps);
        for (int mode = 0; mode < 2; mode++) {
                for (int r = 0; r <= reps; r++) {
                        if (mode == 0)
                                CK(cudaMemsetAsync(flush, r % 251 + 1, TP_FLUSH_BYTES, s));
                        CK(cudaStreamSynchronize(s)); /* the GPU idle, as before a daemon op */
                        tp_chase<<<1, 1, 0, s>>>(base, c, cycles);
                        CK(cudaGetLastError());
                        CK(cudaStreamSynchronize(s));
                        if (r == 0)
                                continue; /* untimed: loads the module */
                        CK(cudaMemcpy(all + (size_t)(r - 1) * TP_LOADS, cycles,
                                      sizeof(long long) * TP_LOADS, cudaMemcpyDeviceToHost));
                }
                printf("  %s\n", mode == 0 ? "after a 256 MB write flush, GPU idle:"
                                           : "warm (no flush):");
                for (int i = 0; i < TP_LOADS; i++) {
                        long long *v = (long long *)malloc(sizeof(long long) * (size_t)reps);
                        if (v == NULL)
                                return 1;
                        for (int r = 0; r < reps; r++)
                                v[r] = all[(size_t)r * TP_LOADS + i];
                        qsort(v, (size_t)reps, sizeof(long long), cmp_ll);
                        const long long med = v[reps / 2], p90 = v[(reps - 1) * 9 / 10];
                        printf("    %-34s %7lld / %7lld cycles  (%.0f / %.0f ns)\n", tp_names[i],
                               med, p90, med * 1e6 / clock_khz, p90 * 1e6 / clock_khz);
                        free(v);
                }
        }
        free(all);
        return 0;
}
