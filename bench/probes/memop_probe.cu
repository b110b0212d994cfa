/* memop_probe.cu - what the stream memory operations that the daemon queues around an op cost
 * on the GPU (docs/performance.md, "Daemon overhead"): a doorbell write per rank after the op's
 * last kernel (cuStreamWriteValue64 into pinned host memory, as for the `completed` words of
 * common/doorbell.h) and, with stream ordering, a wait per rank before its first kernel
 * (cuStreamWaitValue64 on an `inputs_ready` word). Each is timed with CUDA events on one stream,
 * issued one call per operation and as one cuStreamBatchMemOp, for 1 and for N operations
 * (the ranks of a group), the waits on words that already hold their value. The stream is held
 * at a gate word until everything is queued, so the GPU figure is the operations' own time,
 * not the host's time issuing them.
 *
 * Usage: epd-memop-probe [N] [REPS]   (default 8 operations, 200 repetitions; prints the median
 * GPU microseconds of each variant, and the host microseconds of issuing it).
 * Exit 77 without a usable GPU.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern "C" {
#include "cudrv.h"
}

#define PROBE_NAME "epd-memop-probe"
#include "probe_check.cuh"
#define CU(x)                                                                                 \
        do {                                                                                  \
                CUresult r_ = (x);                                                            \
                if (r_ != CUDA_SUCCESS) {                                                     \
                        fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #x,     \
                                (int)r_);                                                     \
                        exit(1);                                                              \
                }                                                                             \
        } while (0)

static double now_us(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
        const double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

enum variant { WRITES_EACH, WRITES_BATCH, WAITS_EACH, WAITS_BATCH };

static void issue(const struct epd_cudrv *cu, CUstream s, enum variant v, CUdeviceptr *words,
                  unsigned n, uint64_t value)
{
        CUstreamBatchMemOpParams ops[64];

        for (unsigned i = 0; i < n; i++) {
                memset(&ops[i], 0, sizeof(ops[i]));
                if (v == WRITES_EACH)
                        CU(cu->StreamWriteValue64(s, words[i], value, 0));
                else if (v == WAITS_EACH)
                        CU(cu->StreamWaitValue64(s, words[i], 1, CU_STREAM_WAIT_VALUE_GEQ));
                else if (v == WRITES_BATCH) {
                        ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
                        ops[i].writeValue.address = words[i];
                        ops[i].writeValue.value64 = value;
                } else {
                        ops[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
                        ops[i].waitValue.address = words[i];
                        ops[i].waitValue.value64 = 1;
                        ops[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
                }
        }
        if (v == WRITES_BATCH || v == WAITS_BATCH)
                CU(cu->StreamBatchMemOp(s, n, ops, 0));
}

int main(int argc, char **argv)
{
        static const char *const names[] = { "write-value, one call each",
                                             "write-value, one batch",
                                             "wait-value (satisfied), one call each",
                                             "wait-value (satisfied), one batch" };
        unsigned n = argc > 1 ? (unsigned)atoi(argv[1]) : 8;
        int reps = argc > 2 ? atoi(argv[2]) : 200;
        int ndev = 0;

        if (n < 1 || n > 64 || reps < 1) {
                fprintf(stderr, "usage: %s [N 1..64] [REPS >= 1]\n", argv[0]);
                return 2;
        }
        if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
                printf("SKIP: no CUDA device\n");
                return 77;
        }
        CK(cudaSetDevice(0));
        CK(cudaFree(NULL));
        const struct epd_cudrv *cu = epd_cudrv();
        if (cu == NULL) {
                fprintf(stderr, "the CUDA driver lacks a function epd needs\n");
                return 1;
        }
        /* One 4 KiB page per word, as the doorbell pages are, all holding 1. */
        uint8_t *host = NULL;
        CK(cudaHostAlloc((void **)&host, 4096ull * 65, cudaHostAllocMapped));
        CUdeviceptr words[64];
        for (unsigned i = 0; i < 64; i++) {
                *(volatile uint64_t *)(host + 4096ull * i) = 1;
                void *dptr = NULL;
                CK(cudaHostGetDevicePointer(&dptr, host + 4096ull * i, 0));
                words[i] = (CUdeviceptr)(uintptr_t)dptr;
        }
        volatile uint64_t *gate = (volatile uint64_t *)(host + 4096ull * 64);
        CUdeviceptr gate_dev;
        {
                void *dptr = NULL;
                *gate = 0;
                CK(cudaHostGetDevicePointer(&dptr, (void *)gate, 0));
                gate_dev = (CUdeviceptr)(uintptr_t)dptr;
        }
        uint64_t gate_value = 0;
        cudaStream_t s;
        cudaEvent_t e0, e1;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        double *gpu = (double *)malloc(sizeof(double) * reps);
        double *cpu = (double *)malloc(sizeof(double) * reps);
        printf("stream memory operations on GPU 0, median of %d repetitions\n", reps);
        for (unsigned count = 1; count <= n; count = count == n ? n + 1 : n) {
                for (int v = 0; v < 4; v++) {
                        for (int r = -1; r < reps; r++) { /* r -1: warm-up */
                                gate_value++;
                                CU(cu->StreamWaitValue64((CUstream)s, gate_dev, gate_value,
                                                         CU_STREAM_WAIT_VALUE_GEQ));
                                CK(cudaEventRecord(e0, s));
                                const double h0 = now_us();
                                issue(cu, (CUstream)s, (enum variant)v, words, count, 1);
                                const double h1 = now_us();
                                CK(cudaEventRecord(e1, s));
                                __atomic_store_n(gate, gate_value, __ATOMIC_RELEASE);
                                CK(cudaEventSynchronize(e1));
                                float ms = 0;
                                CK(cudaEventElapsedTime(&ms, e0, e1));
                                if (r >= 0) {
                                        gpu[r] = ms * 1e3;
                                        cpu[r] = h1 - h0;
                                }
                        }
                        qsort(gpu, reps, sizeof(double), cmp_double);
                        qsort(cpu, reps, sizeof(double), cmp_double);
                        printf("  %2u x %-40s GPU %6.2f us, host %6.2f us\n", count, names[v],
                               gpu[reps / 2], cpu[reps / 2]);
                }
        }
        free(gpu);
        free(cpu);
        return 0;
}
