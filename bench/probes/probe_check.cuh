/* probe_check.cuh - how the GPU probes under bench/probes/ (epd-floor-probe, epd-memop-probe,
 * epd-param-probe, epd-touch-probe) stop on a CUDA runtime error: CK(call) prints the probe's
 * name (PROBE_NAME, defined before this header is included), the place, the call and CUDA's
 * message, then exits 1.
 * A probe has nothing to clean up or recover: a failed call makes every later figure meaningless.
 */
#ifndef EPD_BENCH_PROBE_CHECK_CUH
#define EPD_BENCH_PROBE_CHECK_CUH

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef PROBE_NAME
#error "define PROBE_NAME before including probe_check.cuh"
#endif

#define CK(x)                                                                                 \
        do {                                                                                  \
                cudaError_t e_ = (x);                                                         \
                if (e_ != cudaSuccess) {                                                      \
                        fprintf(stderr, PROBE_NAME ": %s:%d: %s: %s\n", __FILE__, __LINE__, #x, \
                                cudaGetErrorString(e_));                                      \
                        exit(1);                                                              \
                }                                                                             \
        } while (0)

#endif
