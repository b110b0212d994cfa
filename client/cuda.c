/* cuda.c - libepd: registering GPU memory of the client process with the daemon
 * (docs/architecture.md, "Objects": a device pointer registered through the cache).
 *
 * epd_region_register_device finds the CUDA allocation a device pointer belongs to and shares
 * the whole allocation, because that is what the daemon can import: a cuMem allocation created
 * with the POSIX-fd handle type travels as an fd (CUMEM_FD; the daemon imports it with
 * cuMemImportFromShareableHandle and maps it), memory from cudaMalloc as a CUDA IPC handle of
 * the allocation's base (CUDA_IPC; the daemon opens it with cudaIpcOpenMemHandle). Either way
 * the region is [base, base + size) with offset 0, and the local region table holds base and
 * size, so epd_tensor_at resolves any device pointer inside it and later registrations of
 * pointers inside it are answered from the table.
 *
 * A cache entry is validated on every hit against the allocation CUDA reports now (base, size
 * and the process-unique buffer id): memory that was freed and reallocated at the same address
 * gets a fresh registration instead of the daemon's mapping of the old allocation.
 *
 * epd_device_alloc makes memory of the first kind on purpose, because the daemon's kernels reach
 * it at full speed (epd.h): cuMemCreate with the POSIX-fd handle type, mapped at an address range
 * of its own and registered through epd_region_register_device. The client keeps a record of
 * each allocation (client_internal.h) until epd_device_free or epd_client_free.
 *
 * CUDA is touched only here and only when a function is called: connecting never initialises
 * it. Compiled only with EPD_HAVE_CUDA (client/client_cuda.cmake); client.c has the stub that
 * answers EPD_UNAVAILABLE otherwise. Any thread: the context the work needs is pushed and popped
 * again, so the calling thread's current device is left as it was.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client_internal.h"
#include "cudrv.h"

/* What CUDA says about the allocation holding a pointer. */
struct dev_alloc {
        CUdeviceptr base;
        size_t size;
        int ordinal;                 /* CUDA device ordinal in this process */
        unsigned long long buffer_id; /* 0 when the driver does not report it */
        char uuid[64];               /* "GPU-...", as the daemon names its devices */
};

static const char *cu_name(CUresult r)
{
        const char *s = NULL;

        if (epd_cudrv()->GetErrorName(r, &s) != CUDA_SUCCESS || !s)
                return "CUDA_ERROR_UNKNOWN";
        return s;
}

static void uuid_format(const CUuuid *id, char *out, size_t len)
{
        const unsigned char *u = (const unsigned char *)id->bytes;

        /* The daemon's format (daemon/backend/backend_cuda.c), so the two compare as strings. */
        snprintf(out, len,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                 u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
                 u[13], u[14], u[15]);
}

/* Makes a context that can see ptr current on this thread (pushed; pop_context undoes it):
 * the allocation's own context when it has one (cudaMalloc, cuMemAlloc), else the device's
 * primary context (cuMem allocations belong to no context). *ordinal is the device. */
static int push_context(struct epd_client *c, const void *ptr, int *ordinal, CUdevice *dev,
                        int *retained)
{
        struct cudaPointerAttributes pa;
        CUcontext ctx = NULL;
        cudaError_t ce;
        CUresult r;

        *retained = 0;
        /* The runtime initialises the driver (and its primary context) on first use. */
        ce = cudaPointerGetAttributes(&pa, ptr);
        if (ce != cudaSuccess) {
                (void)cudaGetLastError();
                return epd__client_fail(c, ce == cudaErrorInvalidValue ? EPD_INVALID_ARGUMENT
                                                                       : EPD_UNAVAILABLE,
                                        "cudaPointerGetAttributes(%p): %s", ptr,
                                        cudaGetErrorString(ce));
        }
        switch (pa.type) {
        case cudaMemoryTypeDevice:
                break;
        case cudaMemoryTypeManaged:
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "%p is managed memory, which cannot be shared with the daemon",
                                        ptr);
        case cudaMemoryTypeHost:
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "%p is host memory; share host memory with epd_region_alloc or epd_region_register_fd",
                                        ptr);
        default:
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "%p is not CUDA device memory of this process", ptr);
        }
        *ordinal = pa.device;
        r = epd_cudrv()->DeviceGet(dev, pa.device);
        if (r != CUDA_SUCCESS)
                return epd__client_fail(c, EPD_UNAVAILABLE, "cuDeviceGet(%d): %s", pa.device,
                                        cu_name(r));
        if (epd_cudrv()->PointerGetAttribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT,
                                  (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS)
                ctx = NULL;
        if (!ctx) {
                r = epd_cudrv()->DevicePrimaryCtxRetain(&ctx, *dev);
                if (r != CUDA_SUCCESS)
                        return epd__client_fail(c, EPD_UNAVAILABLE,
                                                "cuDevicePrimaryCtxRetain(%d): %s", pa.device,
                                                cu_name(r));
                *retained = 1;
        }
        r = epd_cudrv()->CtxPushCurrent(ctx);
        if (r != CUDA_SUCCESS) {
                if (*retained)
                        epd_cudrv()->DevicePrimaryCtxRelease(*dev);
                *retained = 0;
                return epd__client_fail(c, EPD_UNAVAILABLE, "cuCtxPushCurrent: %s", cu_name(r));
        }
        return 0;
}

static void pop_context(CUdevice dev, int retained)
{
        CUcontext popped;

        epd_cudrv()->CtxPopCurrent(&popped);
        if (retained)
                epd_cudrv()->DevicePrimaryCtxRelease(dev);
}

/* Fills *a for the allocation holding [ptr, ptr + bytes); a context that sees it is current. */
static int alloc_query(struct epd_client *c, const void *ptr, size_t bytes, CUdevice dev,
                       struct dev_alloc *a)
{
        CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
        CUuuid uuid;
        CUresult r;

        /* For cuMem memory this is the mapped range around ptr (one allocation handle), not
         * the whole reserved address range. */
        r = epd_cudrv()->MemGetAddressRange(&a->base, &a->size, p);
        if (r != CUDA_SUCCESS)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT, "cuMemGetAddressRange(%p): %s",
                                        ptr, cu_name(r));
        if (bytes > a->size - (size_t)(p - a->base))
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "%zu bytes at %p run past the end of their CUDA allocation (base 0x%llx, %zu bytes)",
                                        bytes, ptr, (unsigned long long)a->base, a->size);
        a->buffer_id = 0;
        if (epd_cudrv()->PointerGetAttribute(&a->buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, p) !=
            CUDA_SUCCESS)
                a->buffer_id = 0;
        r = epd_cudrv()->DeviceGetUuid(&uuid, dev);
        if (r != CUDA_SUCCESS)
                return epd__client_fail(c, EPD_UNAVAILABLE, "cuDeviceGetUuid: %s", cu_name(r));
        uuid_format(&uuid, a->uuid, sizeof(a->uuid));
        return 0;
}

/* The daemon device for the allocation: `want`, checked by UUID where the daemon listed it,
 * or found by UUID for EPD_DEVICE_AUTO. */
static int daemon_device(struct epd_client *c, const struct dev_alloc *a, uint32_t want,
                         uint32_t *out)
{
        const struct epd_daemon_info *info = &c->info;
        uint32_t listed = info->num_devices < 16 ? info->num_devices : 16;

        if (want == EPD_DEVICE_AUTO) {
                for (uint32_t i = 0; i < listed; i++) {
                        if (strcmp(info->devices[i].uuid, a->uuid) == 0) {
                                *out = i;
                                return 0;
                        }
                }
                return epd__client_fail(c, EPD_NOT_FOUND,
                                        "the memory lives on %s (CUDA device %d of this process), which is not among the daemon's %u devices",
                                        a->uuid, a->ordinal, info->num_devices);
        }
        if (want < listed && info->devices[want].uuid[0] &&
            strcmp(info->devices[want].uuid, a->uuid) != 0)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "the memory lives on %s (CUDA device %d of this process), but daemon device %u is %s",
                                        a->uuid, a->ordinal, want, info->devices[want].uuid);
        *out = want;
        return 0;
}

#define MAX_STALE 8

/* Looks the allocation up in the local region table. Returns 1 with *region_id on a hit, 0 on a
 * miss, or a negative status; entries overlapping it that describe another (freed) allocation
 * are listed in stale either way. */
static int cache_lookup(struct epd_client *c, const struct dev_alloc *a, uint32_t device,
                        uint64_t *region_id, uint64_t *stale, unsigned *num_stale)
{
        const uint8_t *base = (const uint8_t *)(uintptr_t)a->base;
        uint32_t other_device = 0;
        int hit = 0;

        *num_stale = 0;
        pthread_mutex_lock(&c->lock);
        for (unsigned i = 0; i < c->num_regions; i++) {
                const struct epd__local_region *r = &c->regions[i];
                if (!r->device_mem || r->ptr >= base + a->size || base >= r->ptr + r->bytes)
                        continue;
                if (r->ptr == base && r->bytes == a->size &&
                    (!r->buffer_id || !a->buffer_id || r->buffer_id == a->buffer_id)) {
                        /* The same allocation, registered before. */
                        if (r->device != device && !hit) {
                                hit = -1;
                                other_device = r->device;
                        } else if (r->device == device && hit <= 0) {
                                *region_id = r->id;
                                hit = 1;
                        }
                } else if (*num_stale < MAX_STALE) {
                        stale[(*num_stale)++] = r->id;
                }
        }
        pthread_mutex_unlock(&c->lock);
        if (hit < 0)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "the allocation at 0x%llx is already registered as daemon device %u, not %u",
                                        (unsigned long long)a->base, other_device, device);
        return hit;
}

/* Exports the allocation and registers it; the new local entry is marked as device memory. */
static int share(struct epd_client *c, const struct dev_alloc *a, uint32_t device,
                 uint64_t *region_id)
{
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp prop;
        cudaIpcMemHandle_t ipc;
        cudaError_t ce;
        CUresult r;
        int cumem_without_fd = 0, rc, fd = -1;
        uint64_t id;

        /* A cuMem allocation answers cuMemRetainAllocationHandle; cudaMalloc memory does not. */
        r = epd_cudrv()->MemRetainAllocationHandle(&h, (void *)(uintptr_t)a->base);
        if (r == CUDA_SUCCESS) {
                memset(&prop, 0, sizeof(prop));
                r = epd_cudrv()->MemGetAllocationPropertiesFromHandle(&prop, h);
                if (r == CUDA_SUCCESS &&
                    (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
                        r = epd_cudrv()->MemExportToShareableHandle(&fd, h,
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                         0);
                        epd_cudrv()->MemRelease(h);
                        if (r != CUDA_SUCCESS)
                                return epd__client_fail(c, EPD_UNAVAILABLE,
                                                        "cuMemExportToShareableHandle: %s",
                                                        cu_name(r));
                        (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
                        rc = epd__client_region_register(c, EPD_REGION_CUMEM_FD, fd, NULL, 0,
                                                         a->size, 0, device,
                                                         (void *)(uintptr_t)a->base, &id);
                        close(fd);
                        goto registered;
                }
                epd_cudrv()->MemRelease(h);
                /* Without the fd handle type only legacy IPC is left, which cuMem memory does
                 * not support; trust the driver's verdict where it gives one. */
                unsigned long long ipc_capable = 1;
                if (epd_cudrv()->PointerGetAttribute(&ipc_capable,
                                          CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                          a->base) != CUDA_SUCCESS)
                        ipc_capable = 1;
                if (!ipc_capable)
                        return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                                "0x%llx is a cuMem allocation created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, so the daemon cannot import it",
                                                (unsigned long long)a->base);
                cumem_without_fd = 1;
        }
        ce = cudaIpcGetMemHandle(&ipc, (void *)(uintptr_t)a->base);
        if (ce != cudaSuccess) {
                (void)cudaGetLastError();
                if (cumem_without_fd)
                        return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                                "0x%llx is a cuMem allocation created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, so the daemon cannot import it",
                                                (unsigned long long)a->base);
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "cudaIpcGetMemHandle(0x%llx): %s (memory from cudaMallocAsync pools cannot be shared this way)",
                                        (unsigned long long)a->base, cudaGetErrorString(ce));
        }
        rc = epd__client_region_register(c, EPD_REGION_CUDA_IPC, -1, &ipc, sizeof(ipc), a->size,
                                         0, device, (void *)(uintptr_t)a->base, &id);
registered:
        if (rc < 0)
                return rc;
        pthread_mutex_lock(&c->lock);
        for (unsigned i = 0; i < c->num_regions; i++) {
                if (c->regions[i].id != id)
                        continue;
                c->regions[i].device_mem = 1;
                c->regions[i].device = device;
                c->regions[i].buffer_id = a->buffer_id;
        }
        pthread_mutex_unlock(&c->lock);
        *region_id = id;
        return 0;
}

int epd_region_register_device(struct epd_client *client, const void *dev_ptr, size_t bytes,
                               uint32_t device, uint64_t *region_id)
{
        struct dev_alloc a;
        uint64_t stale[MAX_STALE], id = 0;
        unsigned num_stale = 0;
        uint32_t dev_index = 0;
        CUdevice dev = 0;
        int retained = 0, rc;

        if (!client)
                return EPD_INVALID_ARGUMENT;
        if (!dev_ptr || !bytes || !region_id)
                return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                        "epd_region_register_device needs a pointer, a size and region_id");
        /* Checked before CUDA is touched: a host-backend daemon cannot import GPU memory. */
        if (!(client->daemon_caps & EPD__V1__CAPABILITY__CAP_CUDA_REGIONS))
                return epd__client_fail(client, EPD_UNAVAILABLE,
                                        "the daemon's '%s' backend cannot import GPU memory",
                                        client->info.backend);
        if (!epd_cudrv())
                return epd__client_fail(client, EPD_UNAVAILABLE,
                                        "no usable CUDA driver in this process");
        memset(&a, 0, sizeof(a));
        rc = push_context(client, dev_ptr, &a.ordinal, &dev, &retained);
        if (rc < 0)
                return rc;
        rc = alloc_query(client, dev_ptr, bytes, dev, &a);
        if (rc == 0)
                rc = daemon_device(client, &a, device, &dev_index);
        if (rc == 0)
                rc = cache_lookup(client, &a, dev_index, &id, stale, &num_stale);
        /* The stale entries' memory was freed; the daemon's mappings of it must go too. */
        for (unsigned i = 0; i < num_stale; i++)
                (void)epd_region_release(client, stale[i]);
        if (rc == 0)
                rc = share(client, &a, dev_index, &id);
        else if (rc == 1)
                rc = 0;
        pop_context(dev, retained);
        if (rc < 0)
                return rc;
        *region_id = id;
        return 0;
}

/* ---- epd_device_alloc ---- */

/* Collects (up to max) the ids of device-memory entries of the local region table that overlap
 * [base, base + bytes), and with forget drops them from the table. */
static unsigned overlapping_regions(struct epd_client *c, uint64_t base, uint64_t bytes,
                                    int forget, uint64_t *ids, unsigned max)
{
        const uint8_t *lo = (const uint8_t *)(uintptr_t)base;
        unsigned n = 0;

        pthread_mutex_lock(&c->lock);
        for (unsigned i = 0; i < c->num_regions;) {
                const struct epd__local_region *r = &c->regions[i];
                if (!r->device_mem || r->ptr >= lo + bytes || lo >= r->ptr + r->bytes) {
                        i++;
                        continue;
                }
                if (n < max)
                        ids[n++] = r->id;
                if (forget)
                        epd__client_region_remove_at(c, i);
                else
                        i++;
        }
        pthread_mutex_unlock(&c->lock);
        return n;
}

/* Unmaps and frees the address range of an allocation and lets go of its primary context. The
 * mapping held the last local reference to the physical memory; the daemon's import, if any,
 * holds its own. */
static void unmap_alloc(const struct epd__device_alloc *a)
{
        CUcontext popped;
        CUdevice dev;
        int pushed;

        pushed = epd_cudrv()->CtxPushCurrent((CUcontext)a->ctx) == CUDA_SUCCESS;
        (void)epd_cudrv()->MemUnmap((CUdeviceptr)a->base, (size_t)a->bytes);
        (void)epd_cudrv()->MemAddressFree((CUdeviceptr)a->base, (size_t)a->bytes);
        if (pushed)
                epd_cudrv()->CtxPopCurrent(&popped);
        if (epd_cudrv()->DeviceGet(&dev, a->ordinal) == CUDA_SUCCESS)
                epd_cudrv()->DevicePrimaryCtxRelease(dev);
}

/* CUDA's verdict on a cuMem call as a status: the device or the driver refused. */
static int cumem_fail(struct epd_client *c, const char *what, CUresult r, int ordinal,
                      uint64_t bytes)
{
        const char *hint = "";

        if (r == CUDA_ERROR_OUT_OF_MEMORY)
                hint = " (out of device memory)";
        else if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_DEVICE)
                hint = " (the device or driver has no cuMem allocations with POSIX fds)";
        return epd__client_fail(c, EPD_UNAVAILABLE, "%s for %llu bytes on CUDA device %d: %s%s",
                                what, (unsigned long long)bytes, ordinal, cu_name(r), hint);
}

/* cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess on device `ordinal`, the
 * size rounded up to the recommended granularity. Fills a->base and a->bytes; on failure
 * nothing is left. The device's primary context is current. */
static int map_alloc(struct epd_client *c, int ordinal, uint64_t bytes,
                     struct epd__device_alloc *a)
{
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp prop;
        CUmemAccessDesc acc;
        CUdeviceptr va = 0;
        size_t gran = 0, size;
        CUresult r;

        memset(&prop, 0, sizeof(prop));
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        r = epd_cudrv()->MemGetAllocationGranularity(&gran, &prop,
                                                     CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        if (r != CUDA_SUCCESS || gran == 0)
                return cumem_fail(c, "cuMemGetAllocationGranularity", r, ordinal, bytes);
        if (bytes > SIZE_MAX - gran)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "%llu bytes cannot be allocated in this process",
                                        (unsigned long long)bytes);
        size = ((size_t)bytes + gran - 1) / gran * gran;
        r = epd_cudrv()->MemCreate(&h, size, &prop, 0);
        if (r != CUDA_SUCCESS)
                return cumem_fail(c, "cuMemCreate", r, ordinal, size);
        r = epd_cudrv()->MemAddressReserve(&va, size, gran, 0, 0);
        if (r != CUDA_SUCCESS) {
                epd_cudrv()->MemRelease(h);
                return cumem_fail(c, "cuMemAddressReserve", r, ordinal, size);
        }
        r = epd_cudrv()->MemMap(va, size, 0, h, 0);
        /* The mapping holds the allocation from here on: unmapping frees it. */
        epd_cudrv()->MemRelease(h);
        if (r != CUDA_SUCCESS) {
                epd_cudrv()->MemAddressFree(va, size);
                return cumem_fail(c, "cuMemMap", r, ordinal, size);
        }
        memset(&acc, 0, sizeof(acc));
        acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        acc.location.id = ordinal;
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        r = epd_cudrv()->MemSetAccess(va, size, &acc, 1);
        if (r != CUDA_SUCCESS) {
                epd_cudrv()->MemUnmap(va, size);
                epd_cudrv()->MemAddressFree(va, size);
                return cumem_fail(c, "cuMemSetAccess", r, ordinal, size);
        }
        a->base = (uint64_t)va;
        a->bytes = size;
        return 0;
}

static int record_add(struct epd_client *c, const struct epd__device_alloc *a)
{
        int rc = 0;

        pthread_mutex_lock(&c->lock);
        if (c->num_device_allocs == c->cap_device_allocs) {
                unsigned cap = c->cap_device_allocs ? c->cap_device_allocs * 2 : 8;
                struct epd__device_alloc *n = realloc(c->device_allocs, cap * sizeof(*n));
                if (n) {
                        c->device_allocs = n;
                        c->cap_device_allocs = cap;
                } else {
                        rc = EPD_INTERNAL;
                }
        }
        if (rc == 0)
                c->device_allocs[c->num_device_allocs++] = *a;
        pthread_mutex_unlock(&c->lock);
        return rc;
}

int epd_device_alloc(struct epd_client *client, uint32_t cuda_device, uint64_t bytes,
                     void **dev_ptr, uint64_t *region_id)
{
        struct epd__device_alloc a;
        uint64_t stale[MAX_STALE], id = 0;
        unsigned num_stale;
        CUcontext ctx = NULL, popped;
        CUdevice dev;
        cudaError_t ce;
        CUresult r;
        int count = 0, rc;

        if (!client)
                return EPD_INVALID_ARGUMENT;
        if (!dev_ptr || !region_id || !bytes)
                return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                        "epd_device_alloc needs a size above 0, dev_ptr and region_id");
        /* Checked before CUDA is touched, as in epd_region_register_device. */
        if (!(client->daemon_caps & EPD__V1__CAPABILITY__CAP_CUDA_REGIONS))
                return epd__client_fail(client, EPD_UNAVAILABLE,
                                        "the daemon's '%s' backend cannot import GPU memory",
                                        client->info.backend);
        if (!epd_cudrv())
                return epd__client_fail(client, EPD_UNAVAILABLE,
                                        "no usable CUDA driver in this process");
        /* The runtime initialises the driver, which cuDeviceGet needs, and knows the count. */
        ce = cudaGetDeviceCount(&count);
        if (ce != cudaSuccess) {
                (void)cudaGetLastError();
                return epd__client_fail(client, EPD_UNAVAILABLE, "no usable CUDA device: %s",
                                        cudaGetErrorString(ce));
        }
        if (cuda_device >= (uint32_t)count)
                return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                        "CUDA device %u does not exist (this process sees %d)",
                                        cuda_device, count);
        memset(&a, 0, sizeof(a));
        a.ordinal = (int)cuda_device;
        r = epd_cudrv()->DeviceGet(&dev, a.ordinal);
        if (r != CUDA_SUCCESS)
                return epd__client_fail(client, EPD_UNAVAILABLE, "cuDeviceGet(%d): %s",
                                        a.ordinal, cu_name(r));
        /* Retained until the memory is freed: cuMem allocations belong to no context, but the
         * device must stay initialised under them. */
        r = epd_cudrv()->DevicePrimaryCtxRetain(&ctx, dev);
        if (r != CUDA_SUCCESS)
                return epd__client_fail(client, EPD_UNAVAILABLE,
                                        "cuDevicePrimaryCtxRetain(%d): %s", a.ordinal,
                                        cu_name(r));
        a.ctx = ctx;
        r = epd_cudrv()->CtxPushCurrent(ctx);
        if (r != CUDA_SUCCESS) {
                epd_cudrv()->DevicePrimaryCtxRelease(dev);
                return epd__client_fail(client, EPD_UNAVAILABLE, "cuCtxPushCurrent: %s",
                                        cu_name(r));
        }
        rc = map_alloc(client, a.ordinal, bytes, &a);
        epd_cudrv()->CtxPopCurrent(&popped);
        if (rc < 0) {
                epd_cudrv()->DevicePrimaryCtxRelease(dev);
                return rc;
        }
        /* The range is new, so table entries overlapping it describe memory freed without a
         * release: they must not answer for it, and the daemon's mappings of it must go. */
        num_stale = overlapping_regions(client, a.base, a.bytes, 0, stale, MAX_STALE);
        for (unsigned i = 0; i < num_stale; i++)
                (void)epd_region_release(client, stale[i]);
        (void)overlapping_regions(client, a.base, a.bytes, 1, stale, 0);
        rc = epd_region_register_device(client, (void *)(uintptr_t)a.base, (size_t)a.bytes,
                                        EPD_DEVICE_AUTO, &id);
        if (rc == 0) {
                rc = record_add(client, &a);
                if (rc < 0) {
                        (void)epd_region_release(client, id);
                        rc = epd__client_fail(client, rc, "out of memory");
                }
        }
        if (rc < 0) {
                unmap_alloc(&a);
                return rc;
        }
        *dev_ptr = (void *)(uintptr_t)a.base;
        *region_id = id;
        return 0;
}

int epd_device_free(struct epd_client *client, void *dev_ptr)
{
        const uint64_t p = (uint64_t)(uintptr_t)dev_ptr;
        struct epd__device_alloc a;
        uint64_t ids[MAX_STALE];
        unsigned num_ids;
        int found = 0, inside = 0, rc = 0;

        if (!client)
                return EPD_INVALID_ARGUMENT;
        if (!dev_ptr)
                return 0;
        memset(&a, 0, sizeof(a));
        pthread_mutex_lock(&client->lock);
        for (unsigned i = 0; i < client->num_device_allocs; i++) {
                const struct epd__device_alloc *d = &client->device_allocs[i];
                if (d->base == p) {
                        a = *d;
                        client->device_allocs[i] =
                                client->device_allocs[--client->num_device_allocs];
                        found = 1;
                        break;
                }
                if (p > d->base && p - d->base < d->bytes)
                        inside = 1;
        }
        pthread_mutex_unlock(&client->lock);
        if (!found)
                return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                        inside ? "%p lies inside memory from epd_device_alloc; free it with the pointer epd_device_alloc returned"
                                               : "%p did not come from epd_device_alloc of this client, or was freed already",
                                        dev_ptr);
        /* Every region over the memory: the one epd_device_alloc made, or the one a later
         * registration made after the caller released that. */
        num_ids = overlapping_regions(client, a.base, a.bytes, 0, ids, MAX_STALE);
        for (unsigned i = 0; i < num_ids; i++) {
                int st = epd_region_release(client, ids[i]);
                if (st < 0 && st != EPD_NOT_FOUND && rc == 0)
                        rc = st;
        }
        /* Entries a failed release left must not outlive the mapping. */
        (void)overlapping_regions(client, a.base, a.bytes, 1, ids, 0);
        unmap_alloc(&a);
        return rc;
}

void epd__device_alloc_free_all(struct epd_client *c)
{
        for (unsigned i = 0; i < c->num_device_allocs; i++)
                unmap_alloc(&c->device_allocs[i]);
        c->num_device_allocs = 0;
}

/* ---- client-executed groups (cx_cuda.c) ---- */

int epd__cuda_ordinal(struct epd_client *c, uint32_t daemon_device, int *ordinal)
{
        const char *want;
        int count = 0;

        if (daemon_device >= c->info.num_devices || daemon_device >= 16)
                return epd__client_fail(c, EPD_NOT_FOUND,
                                        "daemon device %u is not among the devices it listed",
                                        daemon_device);
        want = c->info.devices[daemon_device].uuid;
        if (cudaGetDeviceCount(&count) != cudaSuccess) {
                cudaGetLastError();
                count = 0;
        }
        for (int d = 0; d < count; d++) {
                CUdevice dev;
                CUuuid id;
                char uuid[64];

                if (epd_cudrv()->DeviceGet(&dev, d) != CUDA_SUCCESS ||
                    epd_cudrv()->DeviceGetUuid(&id, dev) != CUDA_SUCCESS)
                        continue;
                uuid_format(&id, uuid, sizeof(uuid));
                if (strcmp(uuid, want) == 0) {
                        *ordinal = d;
                        return 0;
                }
        }
        return epd__client_fail(c, EPD_NOT_FOUND,
                                "the daemon's device %u (%s) is not visible to this process",
                                daemon_device, want);
}

int epd__cuda_mps_enabled(struct epd_client *c, uint32_t daemon_device)
{
        int ordinal, on = 0;
        char saved[sizeof(c->last_error)];

        /* A probe: a failure here only means "no MPS reported"; keep the client's message. */
        memcpy(saved, c->last_error, sizeof(saved));
        if (!epd_cudrv() || epd__cuda_ordinal(c, daemon_device, &ordinal) < 0) {
                memcpy(c->last_error, saved, sizeof(saved));
                return 0;
        }
        if (cudaDeviceGetAttribute(&on, cudaDevAttrMpsEnabled, ordinal) != cudaSuccess) {
                cudaGetLastError();
                on = 0;
        }
        return on != 0;
}
