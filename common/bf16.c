/* bf16.c - the exported bf16 helpers of epd.h, over the inline definitions of bf16.h. */
#include "bf16.h"
#include "epd.h"

float epd_bf16_to_float(uint16_t value)
{
        return epd__bf16_to_float(value);
}

uint16_t epd_float_to_bf16(float value)
{
        return epd__float_to_bf16(value);
}
