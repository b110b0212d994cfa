/* tensor.h - the shape rules every side checks on a struct epd_tensor. */
#ifndef EPD_COMMON_TENSOR_H
#define EPD_COMMON_TENSOR_H

#include "epd.h"

static inline int epd__tensor_present(const struct epd_tensor *t)
{
        return t->region_id != 0;
}

#endif
