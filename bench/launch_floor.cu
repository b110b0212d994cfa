/* launch_floor.cu - the floor under "what the last rank waits" (docs/benchmarks.md): an empty
 * kernel, launched and synchronised on the worker's stream. A client-executed op cannot be seen
 * complete sooner than this round trip after its launch, whatever its kernel does;
 * cuda_util.c's wc_launch_floor times it and epd-bench reports it beside the wait.
 */
#include <cuda_runtime.h>

__global__ void launch_floor_kernel(void)
{
}

/* One launch of the empty kernel on stream, synchronised. 0, or -1 on a CUDA failure. */
extern "C" int epd_bench_empty_round_trip(void *stream)
{
        launch_floor_kernel<<<1, 32, 0, (cudaStream_t)stream>>>();
        return cudaStreamSynchronize((cudaStream_t)stream) == cudaSuccess ? 0 : -1;
}
