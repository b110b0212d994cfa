/* internal.cuh - what the kernel files share: device helpers and the launchers' host helpers.
 * Not installed, not included by C code.
 */
#ifndef EPD_KERNELS_INTERNAL_CUH
#define EPD_KERNELS_INTERNAL_CUH

#include <stdint.h>
#include <string.h>

#include "epd_kernels.h"
#include "layout.h"
#include "ordering.cuh"
#include "routing.h"

#define EPD_K_FULL_MASK 0xffffffffu

/* ---- host side (launch.cu) ---- */

/* Records err as this thread's last CUDA error and converts it: errors that say the device is
 * gone or unusable are EPD_UNAVAILABLE, everything else EPD_INTERNAL. */
int epd__k_cuda_status(cudaError_t err);
/* cudaGetLastError after a launch, converted. */
int epd__k_launch_status(void);
/* Checks the dims and the op fields of a dispatch; fills the workspace layout. */
int epd__k_check_dispatch(const struct epd_k_dispatch_args *a, struct epd_ws_layout *l);
int epd__k_check_combine(const struct epd_k_combine_args *a, struct epd_ws_layout *l);
/* Blocks for a grid-stride kernel on the current device: the resident maximum (occupancy times
 * multiprocessors), capped at what the work can use. */
int epd__k_grid_blocks(const void *kernel, int threads, size_t smem, uint64_t work_blocks,
                       int *blocks);

/* The shared memory a block of the current device may opt in to. */
int epd__k_smem_optin(int *optin);

/* Makes `kernel` launchable with `smem` bytes of dynamic shared memory on the current device:
 * raises its limit when its static shared memory plus smem passes the 48 KB default (a launch
 * over the limit fails with cudaErrorInvalidValue). EPD_INVALID_ARGUMENT when static + dynamic
 * exceed what a block may opt in to. */
int epd__k_dynamic_smem(const void *kernel, size_t smem);

/* How to cut each of `rows` work rows of `total` units (bytes or values) into slices for a
 * grid-stride kernel with a warp per (row, slice): enough slices for about `warps_per_sm` items
 * on each multiprocessor of the current device, so that a small op keeps as many loads in
 * flight as a large one; large ops get one slice (whole rows per warp). *len is a multiple of
 * `unit` (and covers the row when *slices is 1); *slices = ceil(total / *len) >= 1. */
int epd__k_slicing(uint64_t rows, uint64_t total, uint64_t unit, uint64_t warps_per_sm,
                   uint64_t *len, uint32_t *slices);
/* Items per multiprocessor that small ops are cut for: 3/4 of Hopper's 64 warps (the copy). */
#define EPD_K_SLICE_WARPS 48

/* A launch, described: what cudaLaunchKernelExC takes, or a graph's kernel node. params[i]
 * points at the kernel's i-th parameter, which must stay alive until the launch call returns. */
#define EPD_K_LAUNCH_MAX_PARAMS 8
struct epd__k_launch {
        const void *func;
        dim3 grid, block;
        size_t smem;
        unsigned cluster; /* blocks per cluster; 0: no cluster dimension */
        const void *params[EPD_K_LAUNCH_MAX_PARAMS];
};
/* l's configuration for cudaLaunchKernelExC or an occupancy query, on stream; *attr holds its
 * cluster dimension (launch.cu). */
cudaLaunchConfig_t epd__k_launch_config(const struct epd__k_launch *l, cudaLaunchAttribute *attr,
                                        cudaStream_t stream);
/* Launches l on stream (launch.cu). */
int epd__k_launch_direct(const struct epd__k_launch *l, cudaStream_t stream);
/* Launches l between events t0 and t1 on stream, as one graph when t allows (timed.cu). */
int epd__k_launch_timed(struct epd_k_timed *t, const struct epd__k_launch *l, cudaEvent_t t0,
                        cudaEvent_t t1, cudaStream_t stream);

/* Descriptors inside a kernel's parameters (ranks_host, local_host of the args): a
 * __grid_constant__ parameter of this type lets the kernel read them through a pointer into the
 * parameter space, which the launch itself brings, instead of from device memory. */
template <typename Rank> struct epd__k_inline {
        Rank ranks[EPD_K_INLINE_RANKS];
        struct epd_k_local local[EPD_K_INLINE_RANKS + 1];
        uint32_t used; /* 0: the kernel reads args.ranks and args.local */
};

/* Fills *in from a's host copies when there are some and they fit; otherwise in->used = 0. */
template <typename Args, typename Rank>
static inline void epd__k_inline_fill(struct epd__k_inline<Rank> *in, const Args *a)
{
        memset(in, 0, sizeof(*in));
        if (a->ranks_host == NULL || a->local_host == NULL ||
            a->world_size > EPD_K_INLINE_RANKS || a->num_local > EPD_K_INLINE_RANKS)
                return;
        memcpy(in->ranks, a->ranks_host, sizeof(Rank) * a->world_size);
        memcpy(in->local, a->local_host, sizeof(struct epd_k_local) * (a->num_local + 1));
        in->used = 1;
}

/* The descriptors a kernel reads: the inline copies, or device memory. */
template <typename Rank>
static __device__ __forceinline__ const Rank *epd__k_ranks(const struct epd__k_inline<Rank> &in,
                                                           const Rank *global)
{
        return in.used ? in.ranks : global;
}
template <typename Rank>
static __device__ __forceinline__ const struct epd_k_local *
epd__k_locals(const struct epd__k_inline<Rank> &in, const struct epd_k_local *global)
{
        return in.used ? in.local : global;
}

/* Loads each file's kernels into the current device's context (epd_k_preload). */
int epd__k_preload_route(void);
int epd__k_preload_dispatch(void);
int epd__k_preload_combine(void);
int epd__k_preload_route_small(void);
int epd__k_preload_dispatch_small(void);

/* ---- device side ---- */

/* The local index of flat token g of a device: the i with local[i].token_offset <= g <
 * local[i + 1].token_offset. Binary search; every lane of a warp asks for the same g, so the
 * loads are broadcasts. Empty ranks (equal offsets) are skipped because the search finds the
 * last i whose offset is <= g. */
static __device__ __forceinline__ uint32_t epd__k_find_local(const struct epd_k_local *local,
                                                            uint32_t num_local, uint32_t g)
{
        uint32_t lo = 0, hi = num_local; /* answer in [lo, hi) */

        while (hi - lo > 1) {
                uint32_t mid = (lo + hi) / 2;
                if (local[mid].token_offset <= g)
                        lo = mid;
                else
                        hi = mid;
        }
        return lo;
}

/* Reads one normalised-or-raw expert id from a topk_idx row of either dtype. */
static __device__ __forceinline__ int64_t epd__k_load_topk(const void *topk, enum epd_dtype dtype,
                                                          uint64_t index)
{
        if (dtype == EPD_DTYPE_INT64)
                return ((const int64_t *)topk)[index];
        return ((const int32_t *)topk)[index];
}

/* The widest power-of-two access (16, 8, 4, 2 or 1 bytes) that a set of addresses, strides and
 * sizes ORed together allows. */
static __device__ __forceinline__ uint32_t epd__k_access_width(uint64_t bits)
{
        if ((bits & 15) == 0)
                return 16;
        if ((bits & 7) == 0)
                return 8;
        if ((bits & 3) == 0)
                return 4;
        if ((bits & 1) == 0)
                return 2;
        return 1;
}

/* Read-only loads of inputs through the non-coherent path: the kernels never write what they
 * read this way while they run. */
static __device__ __forceinline__ int4 epd__k_ldg(const int4 *p)
{
        return __ldg(p);
}
static __device__ __forceinline__ uint2 epd__k_ldg(const uint2 *p)
{
        return __ldg(p);
}
static __device__ __forceinline__ unsigned int epd__k_ldg(const unsigned int *p)
{
        return __ldg(p);
}
/* The same load asking the L2 to evict the line first (createpolicy evict_first +
 * ld.global.nc.L2::cache_hint), for data read once by a small op: a streamed line then replaces
 * another streamed line rather than one that someone will use again, or a dirty one whose
 * write-back the op would wait for. It changes which line is replaced, never what is read. */
static __device__ __forceinline__ int4 epd__k_ldg_evict_first(const int4 *p)
{
        uint64_t policy;
        int4 v;
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        asm("ld.global.nc.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p), "l"(policy));
        return v;
}
/* The two loads above as one predicated instruction each: *p when on != 0, zeros otherwise (p is
 * not read then). A loop of loads guarded by a warp-uniform count compiles to a branch around
 * each load, and the loads after a branch issue only once everything before it has; predicated,
 * a warp issues them back to back. */
static __device__ __forceinline__ int4 epd__k_ldg_if(uint32_t on, const int4 *p)
{
        int4 v;
        asm("{\n\t.reg .pred q;\n\t"
            "setp.ne.u32 q, %4, 0;\n\t"
            "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
            "@q ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%5];\n\t}"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "r"(on), "l"(p));
        return v;
}
static __device__ __forceinline__ int4 epd__k_ldg_evict_first_if(uint32_t on, const int4 *p)
{
        uint64_t policy;
        int4 v;
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        asm("{\n\t.reg .pred q;\n\t"
            "setp.ne.u32 q, %4, 0;\n\t"
            "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
            "@q ld.global.nc.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%5], %6;\n\t}"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "r"(on), "l"(p), "l"(policy));
        return v;
}
/* Asks the L2 to fetch [p, p + bytes) from memory, through the bulk-copy engine: one instruction
 * for the whole range, no register or shared memory written, nothing to wait for. The range is
 * shrunk to 16-byte boundaries inside it (the instruction's rule), so it never touches a byte
 * outside [p, p + bytes), and to its first GiB. A hint: it changes what the L2 holds, never what
 * anything reads. */
static __device__ __forceinline__ void epd__k_prefetch_l2_bulk(const void *p, uint64_t bytes)
{
        const uint64_t a0 = ((uint64_t)(uintptr_t)p + 15) & ~15ull;
        const uint64_t a1 = ((uint64_t)(uintptr_t)p + bytes) & ~15ull;
        if (a1 > a0)
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                             :
                             : "l"(a0), "r"((uint32_t)min(a1 - a0, (uint64_t)1 << 30))
                             : "memory");
}
static __device__ __forceinline__ unsigned short epd__k_ldg(const unsigned short *p)
{
        return __ldg(p);
}
static __device__ __forceinline__ unsigned char epd__k_ldg(const unsigned char *p)
{
        return __ldg(p);
}

template <typename V> static __device__ __forceinline__ V epd__k_zero(void);
template <> __device__ __forceinline__ int4 epd__k_zero<int4>(void)
{
        return make_int4(0, 0, 0, 0);
}
template <> __device__ __forceinline__ uint2 epd__k_zero<uint2>(void)
{
        return make_uint2(0, 0);
}
template <> __device__ __forceinline__ unsigned int epd__k_zero<unsigned int>(void)
{
        return 0;
}
template <> __device__ __forceinline__ unsigned short epd__k_zero<unsigned short>(void)
{
        return 0;
}
template <> __device__ __forceinline__ unsigned char epd__k_zero<unsigned char>(void)
{
        return 0;
}

#endif
