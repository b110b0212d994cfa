/* tensor.h - struct epd_tensor <-> wire TensorRef, and the shape rules every side checks. */
#ifndef EPD_COMMON_TENSOR_H
#define EPD_COMMON_TENSOR_H

#include "epd.h"
#include "epd.pb-c.h"

/* Fills a TensorRef whose sizes/strides arrays point into the tensor (no allocation). The
 * tensor must outlive the message. */
void epd__tensor_to_wire(const struct epd_tensor *tensor, Epd__V1__TensorRef *ref);
/* Converts a received TensorRef; NULL or region 0 gives an absent tensor. Returns
 * EPD_INVALID_ARGUMENT when it has more than EPD_TENSOR_MAX_DIMS dims or inconsistent strides. */
int epd__tensor_from_wire(const Epd__V1__TensorRef *ref, struct epd_tensor *out);
static inline int epd__tensor_present(const struct epd_tensor *t)
{
        return t->region_id != 0;
}

#endif
