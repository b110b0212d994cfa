/* cb_trace.h - the per-warp stamps of DS_TRACE builds of the combine (kernels/combine.cu), read
 * by epd-floor-probe and gpu_kernels_test. Four 64-bit words per warp:
 *   [0] global timer at the warp's entry (ns)
 *   [1] ... once its first item's routing was done (the slots written)
 *   [2] ... after its last item
 *   [3] what it did and when, packed as below: its last item's contributions, its items, and
 *       the ns from its entry until it had the parameters its first workspace load needs, until
 *       its workspace entries had arrived, and until its lane 0 had rank 0's y descriptor, each
 *       capped at 65535.
 */
#ifndef EPD_KERNELS_CB_TRACE_H
#define EPD_KERNELS_CB_TRACE_H

#include <stdint.h>

#include "routing.h" /* EPD_HD */

EPD_HD uint64_t epd_cb_trace_pack(uint32_t contributions, uint32_t items, uint32_t pre_ns,
                                         uint32_t back_ns, uint32_t desc_ns)
{
#define EPD_CB_CAP16(v) ((uint64_t)((v) < 65535u ? (v) : 65535u))
        return (uint64_t)(contributions & 0xff) | (uint64_t)(items < 255u ? items : 255u) << 8 |
               EPD_CB_CAP16(desc_ns) << 16 | EPD_CB_CAP16(pre_ns) << 32 |
               EPD_CB_CAP16(back_ns) << 48;
#undef EPD_CB_CAP16
}

EPD_HD uint32_t epd_cb_trace_contributions(uint64_t w)
{
        return (uint32_t)(w & 0xff);
}
EPD_HD uint32_t epd_cb_trace_pre_ns(uint64_t w)
{
        return (uint32_t)(w >> 32 & 0xffff);
}
EPD_HD uint32_t epd_cb_trace_back_ns(uint64_t w)
{
        return (uint32_t)(w >> 48);
}
EPD_HD uint32_t epd_cb_trace_desc_ns(uint64_t w)
{
        return (uint32_t)(w >> 16 & 0xffff);
}

#endif
