/* mps_state.h - the MPS state of this machine for benchmark records (mps_state.c). */
#ifndef EPD_BENCH_MPS_STATE_H
#define EPD_BENCH_MPS_STATE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* state gets "on", "off" or "unknown"; detail one line saying why. */
void epd_bench_mps_state(char *state, size_t state_len, char *detail, size_t detail_len);

#ifdef __cplusplus
}
#endif

#endif
