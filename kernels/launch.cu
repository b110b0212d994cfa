/* launch.cu - the host side shared by the launchers: sizing, argument checks, CUDA error
 * conversion and grid sizing. Runs on whichever host thread calls a launcher; keeps no state
 * except the calling thread's last CUDA error and a cache of occupancy answers.
 */
#include <mutex>
#include <stdint.h>

#include "internal.cuh"

static thread_local cudaError_t last_cuda_error = cudaSuccess;

extern "C" cudaError_t epd_k_last_cuda_error(void)
{
        return last_cuda_error;
}

extern "C" int epd_k_preload(void)
{
        int ret = epd__k_preload_route();
        if (ret == 0)
                ret = epd__k_preload_dispatch();
        if (ret == 0)
                ret = epd__k_preload_combine();
        if (ret == 0)
                ret = epd__k_preload_route_small();
        if (ret == 0)
                ret = epd__k_preload_dispatch_small();

        return ret;
}

int epd__k_cuda_status(cudaError_t err)
{
        if (err == cudaSuccess)
                return 0;
        last_cuda_error = err;
        switch (err) {
        case cudaErrorNoDevice:
        case cudaErrorInvalidDevice:
        case cudaErrorDevicesUnavailable:
        case cudaErrorInsufficientDriver:
        case cudaErrorSystemNotReady:
        case cudaErrorDeviceUninitialized:
        case cudaErrorCudartUnloading:
        case cudaErrorNoKernelImageForDevice:
                return EPD_UNAVAILABLE;
        default:
                return EPD_INTERNAL;
        }
}

int epd__k_launch_status(void)
{
        return epd__k_cuda_status(cudaGetLastError());
}

cudaLaunchConfig_t epd__k_launch_config(const struct epd__k_launch *l, cudaLaunchAttribute *attr,
                                        cudaStream_t stream)
{
        cudaLaunchConfig_t cfg = {};

        cfg.gridDim = l->grid;
        cfg.blockDim = l->block;
        cfg.dynamicSmemBytes = l->smem;
        cfg.stream = stream;
        if (l->cluster != 0) {
                attr->id = cudaLaunchAttributeClusterDimension;
                attr->val.clusterDim.x = l->cluster;
                attr->val.clusterDim.y = 1;
                attr->val.clusterDim.z = 1;
                cfg.attrs = attr;
                cfg.numAttrs = 1;
        }
        return cfg;
}

int epd__k_launch_direct(const struct epd__k_launch *l, cudaStream_t stream)
{
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = epd__k_launch_config(l, &attr, stream);

        return epd__k_cuda_status(cudaLaunchKernelExC(&cfg, l->func, (void **)l->params));
}

/* The limits of the group dims (docs/semantics.md §1). */
static int dims_ok(uint32_t world_size, uint32_t num_experts, uint32_t max_tokens,
                   uint32_t max_topk)
{
        if (world_size < 1 || world_size > EPD_MAX_WORLD_SIZE)
                return 0;
        if (num_experts < 1 || num_experts > EPD_MAX_EXPERTS || num_experts % world_size != 0)
                return 0;
        if (num_experts / world_size > EPD_MAX_LOCAL_EXPERTS)
                return 0;
        if (max_topk < 1 || max_topk > EPD_MAX_TOPK)
                return 0;
        /* Rows and flat token indices are int32 (docs/semantics.md §2.3: counts are int32). */
        if (max_tokens < 1 || (uint64_t)world_size * max_tokens * max_topk > INT32_MAX)
                return 0;
        return 1;
}

extern "C" uint64_t epd_k_workspace_bytes(uint32_t world_size, uint32_t num_experts,
                                          uint32_t max_tokens, uint32_t max_topk)
{
        struct epd_ws_layout l;

        if (!dims_ok(world_size, num_experts, max_tokens, max_topk))
                return 0;
        epd_ws_layout_init(&l, world_size, num_experts, max_tokens, max_topk);
        return l.total_bytes;
}

extern "C" uint64_t epd_k_reply_bytes(uint32_t world_size, uint32_t num_experts)
{
        struct epd_ws_layout l;

        if (!dims_ok(world_size, num_experts, 1, 1))
                return 0;
        epd_ws_layout_init(&l, world_size, num_experts, 1, 1);
        return l.reply_bytes;
}

static int local_ok(const struct epd_k_local *local, uint32_t num_local, uint32_t world_size)
{
        if (num_local > world_size)
                return 0;
        return num_local == 0 || local != NULL;
}

int epd__k_check_dispatch(const struct epd_k_dispatch_args *a, struct epd_ws_layout *l)
{
        if (a == NULL || !dims_ok(a->world_size, a->num_experts, a->max_tokens, a->max_topk))
                return EPD_INVALID_ARGUMENT;
        if (a->num_topk < 1 || a->num_topk > a->max_topk || a->expert_alignment < 1)
                return EPD_INVALID_ARGUMENT;
        if (a->layout != EPD_LAYOUT_NON_EXPAND && a->layout != EPD_LAYOUT_EXPAND)
                return EPD_INVALID_ARGUMENT;
        if (a->topk_dtype != EPD_DTYPE_INT32 && a->topk_dtype != EPD_DTYPE_INT64)
                return EPD_INVALID_ARGUMENT;
        if (a->workspace == NULL || a->ranks == NULL ||
            !local_ok(a->local, a->num_local, a->world_size))
                return EPD_INVALID_ARGUMENT;
        /* The worst-case EXPAND row count must fit the int32 row indices. */
        if (epd_route_max_rows_expand(a->world_size, a->max_tokens, a->max_topk,
                                      a->num_experts / a->world_size, a->expert_alignment) >
            INT32_MAX)
                return EPD_INVALID_ARGUMENT;
        epd_ws_layout_init(l, a->world_size, a->num_experts, a->max_tokens, a->max_topk);
        return 0;
}

int epd__k_check_combine(const struct epd_k_combine_args *a, struct epd_ws_layout *l)
{
        if (a == NULL || !dims_ok(a->world_size, a->num_experts, a->max_tokens, a->max_topk))
                return EPD_INVALID_ARGUMENT;
        if (a->num_topk < 1 || a->num_topk > a->max_topk || a->hidden < 1)
                return EPD_INVALID_ARGUMENT;
        if (a->layout != EPD_LAYOUT_NON_EXPAND && a->layout != EPD_LAYOUT_EXPAND)
                return EPD_INVALID_ARGUMENT;
        /* docs/semantics.md §3: apply_weights needs EXPAND and weights (the dispatch's or the
         * sources' own); recv_weights need NON_EXPAND. */
        if (a->apply_weights && (a->layout != EPD_LAYOUT_EXPAND ||
                                 (!a->has_weights && !a->source_weights)))
                return EPD_INVALID_ARGUMENT;
        if (a->recv_weights && a->layout != EPD_LAYOUT_NON_EXPAND)
                return EPD_INVALID_ARGUMENT;
        if (a->workspace == NULL || a->ranks == NULL ||
            !local_ok(a->local, a->num_local, a->world_size))
                return EPD_INVALID_ARGUMENT;
        epd_ws_layout_init(l, a->world_size, a->num_experts, a->max_tokens, a->max_topk);
        return 0;
}

/* Resident blocks per multiprocessor of (kernel, threads, shared memory, device), asked of the
 * runtime once: the occupancy query takes microseconds, and the daemon launches inside its op's
 * GPU time window. A small table; when it is full, queries are simply not cached. */
#define OCC_CACHE 64
static struct occ_entry {
        const void *kernel;
        int threads, device, per_sm, sms;
        size_t smem;
} occ_cache[OCC_CACHE];
static int occ_used;
static std::mutex occ_lock;

static int occ_lookup(const void *kernel, int threads, size_t smem, int device, int *per_sm,
                      int *sms)
{
        std::lock_guard<std::mutex> g(occ_lock);
        for (int i = 0; i < occ_used; i++) {
                const struct occ_entry *e = &occ_cache[i];
                if (e->kernel == kernel && e->threads == threads && e->smem == smem &&
                    e->device == device) {
                        *per_sm = e->per_sm;
                        *sms = e->sms;
                        return 1;
                }
        }
        return 0;
}

static void occ_store(const void *kernel, int threads, size_t smem, int device, int per_sm,
                      int sms)
{
        std::lock_guard<std::mutex> g(occ_lock);
        if (occ_used < OCC_CACHE)
                occ_cache[occ_used++] = (struct occ_entry){ kernel, threads, device, per_sm, sms,
                                                            smem };
}

int epd__k_grid_blocks(const void *kernel, int threads, size_t smem, uint64_t work_blocks,
                       int *blocks)
{
        int device, sms, per_sm;
        cudaError_t err;

        err = cudaGetDevice(&device);
        if (err != cudaSuccess)
                return epd__k_cuda_status(err);
        if (!occ_lookup(kernel, threads, smem, device, &per_sm, &sms)) {
                err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
                if (err == cudaSuccess)
                        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                             threads, smem);
                if (err != cudaSuccess)
                        return epd__k_cuda_status(err);
                occ_store(kernel, threads, smem, device, per_sm, sms);
        }
        if (per_sm < 1)
                per_sm = 1;
        uint64_t n = (uint64_t)sms * per_sm;
        if (work_blocks < n)
                n = work_blocks;
        *blocks = n < 1 ? 1 : (int)n;
        return 0;
}

int epd__k_slicing(uint64_t rows, uint64_t total, uint64_t unit, uint64_t warps_per_sm,
                   uint64_t *len, uint32_t *slices)
{
        int device, sms;
        cudaError_t err;

        *len = total < 1 ? 1 : total;
        *slices = 1;
        if (rows == 0 || total <= unit)
                return 0;
        err = cudaGetDevice(&device);
        if (err == cudaSuccess)
                err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        if (err != cudaSuccess)
                return epd__k_cuda_status(err);
        uint64_t want = ((uint64_t)sms * warps_per_sm + rows - 1) / rows;
        if (want <= 1)
                return 0;
        uint64_t len_units = ((total + want - 1) / want + unit - 1) / unit;
        *len = len_units * unit;
        *slices = (uint32_t)((total + *len - 1) / *len);
        return 0;
}

int epd__k_smem_optin(int *optin)
{
        int device;
        cudaError_t err = cudaGetDevice(&device);

        if (err == cudaSuccess)
                err = cudaDeviceGetAttribute(optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                             device);
        return epd__k_cuda_status(err);
}

/* epd__k_dynamic_smem's answers per kernel and device. A kernel's static shared memory and the
 * device's opt-in limit never change, and the kernel's dynamic limit changes only when this
 * function raises it, so the runtime is asked once: the one-launch dispatch plans every op, and
 * cudaFuncGetAttributes is a microsecond-scale call on the executor's path before the GPU
 * starts. */
struct smem_entry {
        const void *kernel;
        int device;
        int optin;
        size_t static_bytes, dynamic_max;
};
static struct smem_entry smem_cache[OCC_CACHE];
static int smem_used;
static std::mutex smem_lock;

int epd__k_dynamic_smem(const void *kernel, size_t smem)
{
        struct smem_entry e = { kernel, 0, 0, 0, 0 };
        int ret = epd__k_cuda_status(cudaGetDevice(&e.device)), found = 0;

        if (ret < 0)
                return ret;
        {
                std::lock_guard<std::mutex> g(smem_lock);
                for (int i = 0; i < smem_used && !found; i++)
                        if (smem_cache[i].kernel == kernel && smem_cache[i].device == e.device) {
                                e = smem_cache[i];
                                found = 1;
                        }
        }
        if (!found) {
                struct cudaFuncAttributes attr;
                ret = epd__k_cuda_status(cudaFuncGetAttributes(&attr, kernel));
                if (ret == 0)
                        ret = epd__k_smem_optin(&e.optin);
                if (ret < 0)
                        return ret;
                e.static_bytes = attr.sharedSizeBytes;
                e.dynamic_max = (size_t)attr.maxDynamicSharedSizeBytes;
        }
        if (e.static_bytes + smem > (size_t)e.optin)
                return EPD_INVALID_ARGUMENT;
        if (smem > e.dynamic_max) {
                ret = epd__k_cuda_status(cudaFuncSetAttribute(
                        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                if (ret < 0)
                        return ret;
                e.dynamic_max = smem;
        } else if (found) {
                return 0;
        }
        std::lock_guard<std::mutex> g(smem_lock);
        int i = 0;
        while (i < smem_used &&
               !(smem_cache[i].kernel == kernel && smem_cache[i].device == e.device))
                i++;
        if (i < smem_used)
                smem_cache[i].dynamic_max = e.dynamic_max > smem_cache[i].dynamic_max
                                                    ? e.dynamic_max
                                                    : smem_cache[i].dynamic_max;
        else if (smem_used < OCC_CACHE)
                smem_cache[smem_used++] = e;
        return 0;
}
