/* cudrv.h - the CUDA driver API functions epd uses, resolved at run time through the runtime's
 * cudaGetDriverEntryPointByVersion. Linking libcuda directly would make every binary fail to
 * start on a machine without an NVIDIA driver (CI, the host backend's home); the static
 * runtime loads the driver only when CUDA is first used. Shared by the daemon and libepd.
 */
#ifndef EPD_COMMON_CUDRV_H
#define EPD_COMMON_CUDRV_H

#include <cuda.h>

struct epd_cudrv {
        CUresult (*GetErrorString)(CUresult, const char **);
        CUresult (*MemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
        CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *,
                                                 CUmemAllocationHandleType);
        CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle,
                                               CUmemAllocationHandleType, unsigned long long);
        CUresult (*MemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
        CUresult (*MemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *,
                                                         CUmemGenericAllocationHandle);
        CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *,
                                                CUmemAllocationGranularity_flags);
        CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                      unsigned long long);
        CUresult (*MemAddressFree)(CUdeviceptr, size_t);
        CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                           unsigned long long);
        CUresult (*MemUnmap)(CUdeviceptr, size_t);
        CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
        CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
        CUresult (*MemRelease)(CUmemGenericAllocationHandle);
        CUresult (*StreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
        CUresult (*StreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
        CUresult (*StreamBatchMemOp)(CUstream, unsigned int, CUstreamBatchMemOpParams *,
                                     unsigned int);
        CUresult (*GetErrorName)(CUresult, const char **);
        CUresult (*CtxPushCurrent)(CUcontext);
        CUresult (*CtxPopCurrent)(CUcontext *);
        CUresult (*DeviceGet)(CUdevice *, int);
        CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
        CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
        CUresult (*DevicePrimaryCtxRelease)(CUdevice);
        CUresult (*PointerGetAttribute)(void *, CUpointer_attribute, CUdeviceptr);
};

/* The resolved table, loaded once (thread-safe); NULL when the driver or a symbol is missing. */
const struct epd_cudrv *epd_cudrv(void);

#endif
