/* fp8.h - the fp8 e4m3 conversion and the block quantization of docs/semantics.md §2.7, host and
 * device.
 *
 * One definition for the CPU executor and the kernels, so a quantizing dispatch gives the same
 * bytes everywhere. Everything is integer bit work plus single fp32 multiplies and one division,
 * which IEEE fixes exactly when the build keeps fused multiply-add, flush-to-zero and approximate
 * division off (CMakeLists.txt, cmake/EpdCuda.cmake).
 */
#ifndef EPD_COMMON_FP8_H
#define EPD_COMMON_FP8_H

#include <stdint.h>
#include <string.h>

#include "routing.h"

EPD_HD uint32_t epd_f32_bits(float v)
{
        uint32_t b;
        memcpy(&b, &v, sizeof(b));
        return b;
}

EPD_HD float epd_f32_from_bits(uint32_t b)
{
        float v;
        memcpy(&v, &b, sizeof(v));
        return v;
}

/* e4m3(v) of docs/semantics.md §2.7: nearest e4m3 value, ties to even, subnormals included; finite
 * values beyond +-448 and infinities saturate to +-448; NaN becomes 0x7F. The same as CUDA's
 * __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3). */
EPD_HD uint8_t epd_fp8_e4m3_from_float(float v)
{
        uint32_t bits = epd_f32_bits(v), mag = bits & 0x7FFFFFFFu;
        uint8_t sign = (uint8_t)(bits >> 24 & 0x80u);
        uint32_t q, rest;

        if (mag > 0x7F800000u)
                return 0x7F;
        if (mag >= 0x43E00000u) /* 448.0f and above, infinity included */
                return (uint8_t)(sign | 0x7Eu);
        if (mag < 0x3C800000u) {
                /* Below the smallest normal 2^-6: a multiple of 2^-9. |v| * 512 is exact (a
                 * power-of-two scale of a value far from the fp32 limits) and below 8; its
                 * rounded integer is the encoding, and 8 is the smallest normal, 0x08. */
                float scaled = epd_f32_from_bits(mag) * 512.0f;
                float whole;

                q = (uint32_t)scaled;
                whole = (float)q;
                if (scaled - whole > 0.5f || (scaled - whole == 0.5f && (q & 1u)))
                        q++;
                return (uint8_t)(sign | q);
        }
        /* Normal: rebias the exponent (127 -> 7) and keep 3 of the 23 mantissa bits, rounding the
         * 20 dropped bits to nearest even; a carry into the exponent is the correct result, and
         * nothing below 448 rounds past 0x7E. */
        q = ((mag >> 23) - 127u + 7u) << 3 | (mag >> 20 & 7u);
        rest = mag & 0xFFFFFu;
        if (rest > 0x80000u || (rest == 0x80000u && (q & 1u)))
                q++;
        return (uint8_t)(sign | q);
}

/* The power of two 2^e as an fp32, exact for -149 <= e <= 127 (subnormal below -126); e above 127
 * gives +infinity. */
EPD_HD float epd_f32_pow2(int32_t e)
{
        if (e > 127)
                return epd_f32_from_bits(0x7F800000u);
        if (e >= -126)
                return epd_f32_from_bits((uint32_t)(e + 127) << 23);
        return epd_f32_from_bits(1u << (e + 149));
}

/* round_scale of docs/semantics.md §2.7: with m = amax * 0x1.24924ap-9f (fp32, rounded to nearest
 * even), e = exponent(m) + (mantissa bits of m != 0), read from m's fp32 bits: ceil(log2 m) for a
 * normal m. amax is at least 1e-4 and never NaN, so m is normal or +infinity (an infinite amax
 * gives e = 128). */
EPD_HD int32_t epd_fp8_scale_exponent(float amax)
{
        uint32_t b = epd_f32_bits(amax * 0x1.24924ap-9f);

        return (int32_t)(b >> 23 & 0xFFu) - 127 + ((b & 0x7FFFFFu) != 0);
}

/* scale_format ue8m0 (2.7): the byte e + 127 of a power-of-two scale 2^e with e >= -126, which is
 * its fp32 exponent field (255 for the +infinity of e = 128). */
EPD_HD uint8_t epd_ue8m0_from_pow2(float scale)
{
        return (uint8_t)(epd_f32_bits(scale) >> 23 & 0xFFu);
}

/* Quantizes one block of n bf16 channels (n = 128 in 2.7) into e4m3 bytes and returns its fp32
 * recv_scales entry: amax over |x| ignoring NaN, at least 1e-4; without round_scale each channel
 * times 448 / amax and the entry amax times the fp32 nearest to 1/448; with round_scale each
 * channel times 2^-e and the entry 2^e (epd_fp8_scale_exponent), both exact. */
EPD_HD float epd_fp8_quantize_block(const uint16_t *x, uint32_t n, uint8_t *out, int round_scale)
{
        float amax = 0.0f, scale, recv;

        for (uint32_t c = 0; c < n; c++) {
                float a = epd_f32_from_bits(((uint32_t)x[c] << 16) & 0x7FFFFFFFu);

                if (a > amax) /* false for NaN, which is thereby ignored */
                        amax = a;
        }
        if (amax < 1e-4f)
                amax = 1e-4f;
        if (round_scale) {
                int32_t e = epd_fp8_scale_exponent(amax);

                scale = epd_f32_pow2(-e);
                recv = epd_f32_pow2(e);
        } else {
                scale = 448.0f / amax;
                recv = amax * 0x1.24924ap-9f;
        }
        for (uint32_t c = 0; c < n; c++)
                out[c] = epd_fp8_e4m3_from_float(epd_f32_from_bits((uint32_t)x[c] << 16) * scale);
        return recv;
}

#endif
