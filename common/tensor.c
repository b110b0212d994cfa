/* tensor.c - tensor descriptor conversion between the C API and the wire. */
#include <string.h>

#include "tensor.h"

void epd__tensor_to_wire(const struct epd_tensor *tensor, Epd__V1__TensorRef *ref)
{
        int has_strides = 0;

        epd__v1__tensor_ref__init(ref);
        ref->region_id = tensor->region_id;
        ref->offset = tensor->offset;
        ref->dtype = (Epd__V1__DType)tensor->dtype;
        ref->n_sizes = tensor->ndim;
        ref->sizes = (uint64_t *)tensor->sizes;
        for (uint32_t i = 0; i < tensor->ndim; i++)
                has_strides |= tensor->strides[i] != 0;
        if (has_strides) {
                ref->n_strides = tensor->ndim;
                ref->strides = (uint64_t *)tensor->strides;
        }
}

int epd__tensor_from_wire(const Epd__V1__TensorRef *ref, struct epd_tensor *out)
{
        memset(out, 0, sizeof(*out));
        if (!ref || ref->region_id == 0)
                return 0;
        if (ref->n_sizes > EPD_TENSOR_MAX_DIMS || ref->n_sizes == 0)
                return EPD_INVALID_ARGUMENT;
        if (ref->n_strides != 0 && ref->n_strides != ref->n_sizes)
                return EPD_INVALID_ARGUMENT;
        out->region_id = ref->region_id;
        out->offset = ref->offset;
        out->dtype = (enum epd_dtype)ref->dtype;
        out->ndim = (uint32_t)ref->n_sizes;
        for (size_t i = 0; i < ref->n_sizes; i++)
                out->sizes[i] = ref->sizes[i];
        for (size_t i = 0; i < ref->n_strides; i++)
                out->strides[i] = ref->strides[i];
        return 0;
}
