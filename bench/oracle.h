/* oracle.h - the expected outputs of a dispatch and its combine, computed by the CPU executor
 * (cpu/: the placement plan and the executor), and bitwise comparison of an op's real outputs
 * against them. epd-bench checks its first iteration with it and epd-demo every step.
 *
 * Inputs and outputs are packed row-major arrays (each row right after the previous one), as the
 * daemon's output arena and the benchmark's client regions lay them out. Input pointers are
 * borrowed: everything given to oracle_new must stay alive and unchanged until oracle_free.
 *
 * Messages: a mismatch is described as "rank 2 row 17 field recv_x byte 34: expected 0x12, got
 * 0x13" in msg.
 */
#ifndef EPD_BENCH_ORACLE_H
#define EPD_BENCH_ORACLE_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"
#include "plan.h"

/* The shape and options of one dispatch (and of the combine that uses its handle). */
struct oracle_params {
        uint32_t world_size;        /* R */
        uint32_t num_experts;       /* E, a multiple of R */
        uint32_t hidden;            /* H */
        uint32_t max_tokens;        /* T */
        uint32_t num_topk;          /* K_op */
        enum epd_dtype dtype;       /* EPD_DTYPE_BF16 or EPD_DTYPE_FP8_E4M3 */
        uint32_t scale_block;       /* fp8: channels per scale; 0 means 128 */
        enum epd_dtype topk_dtype;  /* EPD_DTYPE_INT32 or EPD_DTYPE_INT64 */
        enum epd_layout layout;
        uint32_t expert_alignment;  /* >= 1; 0 means 1 */
        int zero_padding;           /* EXPAND only */
};

/* One source rank's dispatch inputs (borrowed). */
struct oracle_src {
        uint32_t num_tokens;        /* N_s <= T */
        const void *x;              /* [N_s, H] bf16 or fp8 bytes */
        const float *scales;        /* [N_s, H / scale_block], fp8 only */
        const void *topk_idx;       /* [N_s, K_op] in topk_dtype */
        const float *weights;       /* [N_s, K_op], or NULL */
};

struct oracle {
        struct oracle_params p;
        struct epd_plan *plan;      /* placed for every source */
        uint64_t row_bytes;         /* bytes of one x row */
        uint64_t scale_bytes;       /* bytes of one scales row, 0 for bf16 */
        int has_weights;
        struct oracle_src *src;     /* [R] copy of the caller's descriptors */
};

/* Builds the plan of one dispatch from every rank's inputs (src[R]). Returns 0, or
 * EPD_INVALID_ARGUMENT with a message in err (invalid routing or params), or EPD_INTERNAL when
 * out of memory. On success *out is the caller's (oracle_free). */
int oracle_new(const struct oracle_params *p, const struct oracle_src *src, struct oracle **out,
               char *err, size_t err_len);
/* Releases it; NULL is accepted. Returns NULL. */
struct oracle *oracle_free(struct oracle *o);

/* Rows destination d receives in the layout (padding included). */
int64_t oracle_rows(const struct oracle *o, uint32_t d);

/* Dispatch outputs of one destination, packed; NULL for a field that is absent. */
struct oracle_dispatch_out {
        void *recv_x;
        void *recv_scales;          /* fp8 */
        void *recv_topk_idx;        /* NON_EXPAND, topk_dtype [rows, K_op] */
        void *recv_weights;         /* with weights: NON_EXPAND [rows, K_op], EXPAND [rows] */
        void *recv_src;             /* int64 [rows] */
        void *recv_topk_slot;       /* EXPAND int32 [rows] */
};

/* Runs destination d's part of the dispatch on the CPU into newly allocated outputs: every field
 * of the layout. Returns 0 or EPD_INTERNAL (out of memory); free with oracle_dispatch_out_free. */
int oracle_dispatch_expected(const struct oracle *o, uint32_t d, struct oracle_dispatch_out *out);
void oracle_dispatch_out_free(struct oracle_dispatch_out *out);

/* Compares the counts of destination d's dispatch result, then its outputs (recv_x, recv_src and,
 * in EXPAND, recv_topk_slot are required; other absent fields are not compared; payload of
 * padding rows without zero_padding is skipped). Returns 0 when equal, 1 at the first mismatch
 * (described in msg), or -1 when a required output is missing or memory ran out. */
int oracle_check_counts(const struct oracle *o, uint32_t d, const struct epd_dispatch_result *dr,
                        char *msg, size_t msg_len);
int oracle_check_dispatch(const struct oracle *o, uint32_t d,
                          const struct oracle_dispatch_out *actual, char *msg, size_t msg_len);

/* Runs source s's combine on the CPU: y[R] are every destination's y (bf16, packed rows in the
 * dispatch's layout; padding rows are never read); combined is [N_s, H] bf16, cw [N_s, K_op]
 * fp32 or NULL. apply_weights needs EXPAND and weights. Returns 0 or EPD_INVALID_ARGUMENT. */
int oracle_combine_expected(const struct oracle *o, uint32_t s, const void *const *y,
                            int apply_weights, uint16_t *combined, float *cw);
/* Compares source s's combined ([N_s, H] bf16) and, when not NULL, combined_topk_weights
 * ([N_s, K_op] fp32) against oracle_combine_expected. Returns like oracle_check_dispatch, or
 * EPD_INVALID_ARGUMENT. */
int oracle_check_combine(const struct oracle *o, uint32_t s, const void *const *y,
                         int apply_weights, const void *combined, const void *cw, char *msg,
                         size_t msg_len);

#endif
