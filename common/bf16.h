/* bf16.h - inline bf16 conversion for hot loops; the same arithmetic as bf16.c. */
#ifndef EPD_COMMON_BF16_H
#define EPD_COMMON_BF16_H

#include <stdint.h>
#include <string.h>

static inline float epd__bf16_to_float(uint16_t value)
{
        uint32_t bits = (uint32_t)value << 16;
        float f;
        memcpy(&f, &bits, sizeof(f));
        return f;
}

static inline uint16_t epd__float_to_bf16(float value)
{
        uint32_t bits;
        memcpy(&bits, &value, sizeof(bits));
        if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0)
                return 0x7FFF;
        bits += 0x7FFFu + ((bits >> 16) & 1u);
        return (uint16_t)(bits >> 16);
}

#endif
