/* cx_case.h - client-executed test cases: one case's shape, seeded inputs of every rank, their
 * reference, and bitwise checks of a rank's buffer against it.
 *
 * Shared by the CPU protocol test (tests/unit/unit_cx.c) and the kernel test
 * (tests/gpu/gpu_cx_test.cu), so both run the same cases against the same oracle. Host memory only;
 * the GPU test uploads what it needs.
 */
#ifndef EPD_TESTS_CX_CASE_H
#define EPD_TESTS_CX_CASE_H

#include <stddef.h>
#include <stdint.h>

#include "cx_layout.h"
#include "epd.h"
#include "reference.h"

#define CX_CASE_MAX_R 8u
#define CX_CASE_SCALE_BLOCK 64u /* fp8 groups' scale block */

/* Short names for case tables. */
#define BF16 EPD_DTYPE_BF16
#define FP8 EPD_DTYPE_FP8_E4M3
#define I32 EPD_DTYPE_INT32
#define I64 EPD_DTYPE_INT64
#define NE EPD_LAYOUT_NON_EXPAND
#define EX EPD_LAYOUT_EXPAND


struct cx_case {
        const char *name;
        uint32_t R, E, H, T, K;
        enum epd_dtype dtype;
        int quantize;              /* bf16 group, fp8 rows (docs/semantics.md §2.7) */
        enum epd_layout layout;
        uint32_t align;
        int zero_padding;
        uint32_t block_rows;       /* C of 2.6 */
        int has_weights;
        enum epd_dtype topk_dtype;
        int nbias;                 /* 0..2 */
        int apply_weights;         /* EXPAND */
        int source_weights;        /* combine's source_weights */
        int recv_weights;          /* NON_EXPAND: combine's recv_weights (the y_weights area) */
        int cached;                /* a cached dispatch and its combine follow */
        uint32_t rounds;           /* the CPU test: rounds of ops without a join */
        int round_scale;           /* quantize: power-of-two scales (2.7) */
        int ue8m0;                 /* quantize with round_scale: scale_format UE8M0 */
};

/* One round's inputs of every rank and their references. y and yw are each destination's combine
 * input, recv_rows rows (padding rows of y hold NaN, so reading one shows). */
struct cx_case_data {
        uint32_t n[CX_CASE_MAX_R];
        uint8_t *x[CX_CASE_MAX_R];
        float *scales[CX_CASE_MAX_R];
        uint8_t *topk[CX_CASE_MAX_R];
        float *weights[CX_CASE_MAX_R];
        float *weights2[CX_CASE_MAX_R];    /* the cached dispatch's new weights */
        float *sw[CX_CASE_MAX_R];          /* source_weights */
        uint16_t *bias[CX_CASE_MAX_R][2];
        uint16_t *y[CX_CASE_MAX_R];
        float *yw[CX_CASE_MAX_R];
        struct ref_dispatch *ref, *ref2;   /* ref2: the cached dispatch's (weights2) */
};

/* The cases both tests run. */
extern const struct cx_case cx_cases[];
extern const size_t cx_num_cases;

void cx_case_shape(const struct cx_case *c, struct cx_shape *shape);
/* The client-executed group config (epd.h) of the case's shape, with the op timeout given. */
void cx_case_group_config(const struct cx_case *c, uint32_t op_timeout_ms,
                          struct epd_group_config *cfg);
uint64_t cx_case_x_row_bytes(const struct cx_case *c);
uint32_t cx_case_num_scales(const struct cx_case *c);
/* The case's scale_format (enum epd_scale_format). */
uint32_t cx_case_scale_format(const struct cx_case *c);
size_t cx_case_topk_size(const struct cx_case *c);

/* Allocates and fills d from seed (N: T, T - 1, 0, T, ... by rank; R = 1 sends T). Returns 0, or
 * -1 with a message in err. cx_case_data_free releases it. */
int cx_case_data_make(const struct cx_case *c, uint32_t recv_rows, uint64_t seed,
                      struct cx_case_data *d, char *err, size_t err_len);
void cx_case_data_free(const struct cx_case *c, struct cx_case_data *d);
/* The most rows the round of seed sends one rank (its reference's), or 0 if it cannot be made. */
uint32_t cx_case_rows_needed(const struct cx_case *c, uint64_t seed);

/* Compares rank d's dispatch outputs with ref: the receive area at the layout's offsets from
 * recv_base (the rank's buffer or a copy of it) and, when own is not NULL, the counts in handle
 * slot `handle` of own. Returns 0, or 1 with the first mismatch in msg. */
int cx_case_check_dispatch(const struct cx_case *c, const struct cx_layout *l, const uint8_t *own,
                           uint32_t handle, const uint8_t *recv_base,
                           const struct ref_dispatch *ref, uint32_t d, char *msg, size_t msg_len);

/* Compares source s's combined [N, H] and combined_topk_weights [N, K] with ref over the round's
 * y. Returns 0, or 1 with the first mismatch in msg. */
int cx_case_check_combine(const struct cx_case *c, const struct cx_case_data *data,
                          const struct ref_dispatch *ref, uint32_t s, const uint16_t *combined,
                          const float *cw, char *msg, size_t msg_len);

#endif
