/* reference.h - an independent, naive reference of dispatch and combine, written straight from
 * docs/semantics.md, and bitwise comparison of real outputs against it.
 *
 * It shares no code with the production path (plan.h, routing.h, exec.h, bf16.h): it
 * enumerates rows in the order the contract states them, with plain loops, so that a shared
 * misreading cannot make both sides agree. It is deliberately slow (about E * R * T * K steps to
 * build) and meant for tests, `make demo` and the benchmark's verification.
 *
 * Payloads are not copied: the reference remembers the caller's input pointers and compares
 * recv_x / recv_scales directly against the source rows. Every input given to ref_dispatch_new
 * must therefore stay alive and unchanged until ref_dispatch_free.
 *
 * Messages: the check functions describe the first mismatch as
 * "rank 2 row 17 field recv_x byte 34: expected 0x12, got 0x13". It goes to msg when msg is not
 * NULL, otherwise to stderr.
 */
#ifndef EPD_TESTS_REFERENCE_H
#define EPD_TESTS_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

/* A strided buffer: row i starts at ptr + i * stride bytes. stride 0 means rows are packed (the
 * row size of the field it describes). ptr NULL means absent. */
struct ref_buf {
        const void *ptr;
        uint64_t stride;
};

/* The shape and options of one dispatch (and of the combine that uses its handle). */
struct ref_params {
        uint32_t world_size;        /* R */
        uint32_t num_experts;       /* E, a multiple of R */
        uint32_t hidden;            /* H */
        uint32_t max_tokens;        /* T, for recv_src = s * T + t */
        uint32_t num_topk;          /* K_op */
        enum epd_dtype dtype;       /* EPD_DTYPE_BF16 or EPD_DTYPE_FP8_E4M3 */
        uint32_t scale_block;       /* fp8: channels per scale; 0 means 128 */
        enum epd_dtype topk_dtype;  /* EPD_DTYPE_INT32 or EPD_DTYPE_INT64 */
        enum epd_layout layout;
        uint32_t expert_alignment;  /* >= 1; 0 means 1 */
        int zero_padding;           /* EXPAND only */
        int has_weights;            /* topk_weights given */
        uint32_t expert_block_rows; /* EXPAND: C of docs/semantics.md §2.6, 0 for packed */
        int quantize;               /* bf16 x sent as fp8 rows with scales (2.7) */
        int round_scale;            /* quantize: power-of-two scales (2.7) */
        int scale_ue8m0;            /* quantize with round_scale: recv_scales bytes e + 127 */
};

/* One source rank's dispatch inputs. Pointers are borrowed (see the file comment). */
struct ref_src {
        uint32_t num_tokens;        /* N_s <= T */
        struct ref_buf x;           /* [N_s, H] bf16 or fp8 bytes */
        struct ref_buf scales;      /* fp32 [N_s, H / scale_block], fp8 only */
        struct ref_buf topk_idx;    /* [N_s, K_op] in topk_dtype */
        struct ref_buf weights;     /* fp32 [N_s, K_op] when has_weights */
};

/* What a row of a destination's output holds. */
enum ref_row_kind {
        REF_ROW_DATA = 0,        /* a token (NON_EXPAND) or a selection (EXPAND) */
        REF_ROW_PAD_ZERO = 1,    /* EXPAND padding with zero_padding: payload is zero */
        REF_ROW_PAD_UNWRITTEN = 2, /* EXPAND padding without zero_padding: payload not written */
};

/* The expected outputs of one destination rank. Metadata is materialised; payload rows refer to
 * the source's input (row_src / row_token). Arrays are owned by the struct ref_dispatch. */
struct ref_dst {
        /* Counts of docs/semantics.md §2.3; both layouts' row counts are always computed. */
        int32_t num_recv_tokens;
        int32_t num_expanded_rows;
        int32_t *per_expert;          /* [L] raw selections per local expert */
        int32_t *per_expert_aligned;  /* [L] rounded up to expert_alignment */
        int32_t *rank_prefix;         /* [R + 1] */
        int32_t *expert_base;         /* [L + 1] first EXPAND row per local expert; [L] = rows */

        int64_t rows;                 /* rows the layout writes */
        /* Per row: the source rank, token and top-k position it came from, -1 for padding
         * (row_slot is -1 for every NON_EXPAND row). */
        int32_t *row_src;
        int32_t *row_token;
        int32_t *row_slot;
        uint8_t *row_kind;            /* enum ref_row_kind */
        int64_t *recv_src;            /* [rows] */
        int32_t *recv_topk_slot;      /* [rows], EXPAND */
        int64_t *recv_topk_idx;       /* [rows * K_op], NON_EXPAND; value, stored wide */
        uint32_t *recv_weights;       /* bits; NON_EXPAND [rows * K_op], EXPAND [rows] */
};

struct ref_dispatch {
        struct ref_params p;
        uint32_t num_local_experts;   /* L */
        uint64_t row_bytes;           /* bytes of one x row */
        uint32_t num_scales;          /* scales per row, 0 for bf16 */
        uint64_t scale_bytes;         /* bytes of one recv_scales row: 4 or (ue8m0) 1 a scale */
        struct ref_src *src;          /* [R] copy of the caller's descriptors */
        int32_t **topk;               /* [R] -> [N_s * K_op] expert ids read from the input */
        struct ref_dst *dst;          /* [R] */
        uint8_t **qx;                 /* quantize: [R] -> [N_s * H] e4m3 rows */
        uint8_t **qscales;            /* quantize: [R] -> [N_s] rows of scale_bytes */
        int32_t short_rank;           /* CAPACITY_EXCEEDED: the first short rank and expert */
        int32_t short_expert;
};

/* Builds the reference of one dispatch from every rank's inputs (src[R]). Returns 0, or
 * EPD_INVALID_ARGUMENT with a message in err for invalid routing (an id outside [0,E) other than
 * -1, an expert repeated in a row) or invalid params, EPD_CAPACITY_EXCEEDED when an expert's
 * aligned count exceeds expert_block_rows (2.6), or EPD_INTERNAL when out of memory. On
 * success *out is owned by the caller (ref_dispatch_free). */
int ref_dispatch_new(const struct ref_params *p, const struct ref_src *src,
                     struct ref_dispatch **out, char *err, size_t err_len);
/* Releases it; NULL is accepted. Returns NULL. */
struct ref_dispatch *ref_dispatch_free(struct ref_dispatch *ref);

/* The expected payload of row i at destination d: the source row's bytes for a data row, NULL
 * for a padding row (zero or unwritten, see row_kind). */
const uint8_t *ref_expected_x(const struct ref_dispatch *ref, uint32_t d, int64_t i);
/* The expected recv_scales row (scale_bytes) of row i at d, NULL for padding. */
const uint8_t *ref_expected_scales(const struct ref_dispatch *ref, uint32_t d, int64_t i);

/* The row at which destination d holds (s, t) in NON_EXPAND, or -1 when t does not go to d.
 * The EXPAND row of selection (s, t, k), or -1 for a -1 entry. Both search the reference's own
 * row lists; usable with either layout's reference only for its own layout. */
int64_t ref_non_expand_row(const struct ref_dispatch *ref, uint32_t d, uint32_t s, uint32_t t);
int64_t ref_expand_row(const struct ref_dispatch *ref, uint32_t s, uint32_t t, uint32_t k);

/* Actual dispatch outputs of one destination; absent fields (ptr NULL) are not compared, except
 * that recv_x, recv_src and (EXPAND) recv_topk_slot are required. Strides are bytes. */
struct ref_dispatch_actual {
        struct ref_buf recv_x;
        struct ref_buf recv_scales;     /* fp8 */
        struct ref_buf recv_topk_idx;   /* NON_EXPAND, topk_dtype */
        struct ref_buf recv_weights;    /* has_weights; NON_EXPAND [rows, K], EXPAND [rows] */
        struct ref_buf recv_src;
        struct ref_buf recv_topk_slot;  /* EXPAND */
};

struct ref_counts_actual {
        int32_t num_recv_tokens;
        int32_t num_expanded_rows;
        const int32_t *per_expert;          /* [L], NULL: not compared */
        const int32_t *per_expert_aligned;  /* [L], NULL: not compared */
        const int32_t *rank_prefix;         /* [R + 1], NULL: not compared */
};

/* Compare bitwise; return 0 when equal, 1 at the first mismatch (described as the file comment
 * says), or -1 for a missing required buffer. Padding payload marked REF_ROW_PAD_UNWRITTEN is
 * skipped. */
int ref_check_counts(const struct ref_dispatch *ref, uint32_t d,
                     const struct ref_counts_actual *act, char *msg, size_t msg_len);
int ref_check_dispatch(const struct ref_dispatch *ref, uint32_t d,
                       const struct ref_dispatch_actual *act, char *msg, size_t msg_len);

/* Combine inputs: y[R] are the destinations' y buffers (bf16 rows in the dispatch's layout;
 * padding rows are never read); bias[2] are source s's biases (ptr NULL when absent). */
struct ref_combine_in {
        const struct ref_buf *y;    /* [R] */
        int apply_weights;          /* EXPAND with weights (or source_weights) only */
};

/* The optional weight inputs of combine (docs/semantics.md section 3), for the *_w functions. */
struct ref_combine_weights {
        /* [R] or NULL: source s's source_weights fp32 [N_s, K_op]; when given (ptr not NULL),
         * w(t, k) of apply_weights for source s. */
        const struct ref_buf *source_weights;
        /* [R] or NULL (NON_EXPAND): destination d's recv_weights fp32 [rows, K_op]; when given,
         * combined_topk_weights is their reduction over the destinations. */
        const struct ref_buf *recv_weights;
};

/* Computes combined row t of source s into out[H] and, when cw is not NULL, the combined top-k
 * weights into cw[K_op] (as bits). Returns 0 or EPD_INVALID_ARGUMENT (apply_weights with
 * NON_EXPAND or without weights). */
int ref_combine_row(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                    uint32_t s, const struct ref_buf bias[2], uint32_t t, uint16_t *out,
                    uint32_t *cw);
/* Computes source s's whole combine: combined[N_s * H] and, when not NULL, cw[N_s * K_op]. */
int ref_combine_source(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                       uint32_t s, const struct ref_buf bias[2], uint16_t *combined,
                       uint32_t *cw);
/* Compares source s's actual combined (bf16 [N_s, H]) and, when its ptr is not NULL,
 * combined_topk_weights (fp32 [N_s, K_op]) against the reference, row by row without
 * materialising the reference. Returns like ref_check_dispatch, or EPD_INVALID_ARGUMENT. */
int ref_check_combine(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                      uint32_t s, const struct ref_buf bias[2], struct ref_buf combined,
                      struct ref_buf combined_topk_weights, char *msg, size_t msg_len);
/* ref_combine_row and ref_check_combine with the weight inputs w (NULL: none). */
int ref_combine_row_w(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                      const struct ref_combine_weights *w, uint32_t s,
                      const struct ref_buf bias[2], uint32_t t, uint16_t *out, uint32_t *cw);
int ref_check_combine_w(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                        const struct ref_combine_weights *w, uint32_t s,
                        const struct ref_buf bias[2], struct ref_buf combined,
                        struct ref_buf combined_topk_weights, char *msg, size_t msg_len);

/* The reference's own bf16 conversions (docs/semantics.md section 3): exact widening, and round to
 * nearest even with every NaN mapped to 0x7FFF. */
float ref_bf16_to_float(uint16_t value);
uint16_t ref_float_to_bf16(float value);
/* e4m3 of docs/semantics.md §2.7, found by searching every e4m3 value for the nearest (ties to the
 * even encoding), saturating at +-448, NaN to 0x7F. */
uint8_t ref_float_to_e4m3(float value);
/* The 2.7 quantization of one bf16 row of H channels into q[H] and its recv_scales row: fp32
 * [H / 128], or with ue8m0 (which needs round_scale) bytes [H / 128]. */
void ref_quantize_row(const uint16_t *x, uint32_t hidden, int round_scale, int ue8m0, uint8_t *q,
                      void *scales);

#endif
