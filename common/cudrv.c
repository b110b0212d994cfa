/* cudrv.c - see cudrv.h. */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stddef.h>

#include "cudrv.h"

static struct epd_cudrv table;
static int table_ok;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static int resolve(const char *name, void **fn)
{
        enum cudaDriverEntryPointQueryResult st;

        /* 12000: the ABI of each symbol as of CUDA 12.0 (cuStreamWaitValue64 is _v2 there). */
        return cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &st) ==
                               cudaSuccess &&
                       st == cudaDriverEntryPointSuccess && *fn
                       ? 0
                       : -1;
}

static void load(void)
{
        struct {
                const char *name;
                void **slot;
        } syms[] = {
                { "cuGetErrorString", (void **)&table.GetErrorString },
                { "cuMemGetAddressRange", (void **)&table.MemGetAddressRange },
                { "cuMemImportFromShareableHandle", (void **)&table.MemImportFromShareableHandle },
                { "cuMemExportToShareableHandle", (void **)&table.MemExportToShareableHandle },
                { "cuMemRetainAllocationHandle", (void **)&table.MemRetainAllocationHandle },
                { "cuMemGetAllocationPropertiesFromHandle",
                  (void **)&table.MemGetAllocationPropertiesFromHandle },
                { "cuMemGetAllocationGranularity", (void **)&table.MemGetAllocationGranularity },
                { "cuMemAddressReserve", (void **)&table.MemAddressReserve },
                { "cuMemAddressFree", (void **)&table.MemAddressFree },
                { "cuMemMap", (void **)&table.MemMap },
                { "cuMemUnmap", (void **)&table.MemUnmap },
                { "cuMemSetAccess", (void **)&table.MemSetAccess },
                { "cuMemCreate", (void **)&table.MemCreate },
                { "cuMemRelease", (void **)&table.MemRelease },
                { "cuStreamWaitValue64", (void **)&table.StreamWaitValue64 },
                { "cuStreamWriteValue64", (void **)&table.StreamWriteValue64 },
                { "cuStreamBatchMemOp", (void **)&table.StreamBatchMemOp },
                { "cuGetErrorName", (void **)&table.GetErrorName },
                { "cuCtxPushCurrent", (void **)&table.CtxPushCurrent },
                { "cuCtxPopCurrent", (void **)&table.CtxPopCurrent },
                { "cuDeviceGet", (void **)&table.DeviceGet },
                { "cuDeviceGetUuid", (void **)&table.DeviceGetUuid },
                { "cuDevicePrimaryCtxRetain", (void **)&table.DevicePrimaryCtxRetain },
                { "cuDevicePrimaryCtxRelease", (void **)&table.DevicePrimaryCtxRelease },
                { "cuPointerGetAttribute", (void **)&table.PointerGetAttribute },
        };

        for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++)
                if (resolve(syms[i].name, syms[i].slot) < 0)
                        return;
        table_ok = 1;
}

const struct epd_cudrv *epd_cudrv(void)
{
        pthread_once(&once, load);
        return table_ok ? &table : NULL;
}
