/* mat.h - the tensor descriptors that every executor of an op reads: the CPU executor (cpu/), the
 * CUDA kernels (kernels/epd_kernels.h) and the backends that fill them, defined once.
 *
 * Plain C with fixed-width members only, so that the same bytes mean the same thing to gcc and
 * nvcc: the kernels' rank descriptors embed these structs and are copied to device memory (and
 * into kernel parameters) as they are.
 */
#ifndef EPD_COMMON_MAT_H
#define EPD_COMMON_MAT_H

#include <stdint.h>

/* A row-major matrix: row i starts at ptr + i * stride bytes. ptr NULL means absent. The GPU
 * moves rows with 16-byte accesses when ptr, stride and the row's bytes allow it, else with the
 * widest access they allow. */
struct epd_mat {
        uint8_t *ptr;
        uint64_t stride;
};

/* A dispatch's inputs on one source rank. */
struct epd_dispatch_src_io {
        struct epd_mat x;        /* [N_s] rows of row_bytes */
        struct epd_mat scales;   /* fp32 [N_s, H/scale_block], fp8 only */
        struct epd_mat weights;  /* fp32 [N_s, K_op], optional */
};

/* A dispatch's outputs on one destination rank. */
struct epd_dispatch_dst_io {
        struct epd_mat recv_x;
        struct epd_mat recv_scales;    /* fp8 only */
        struct epd_mat recv_topk_idx;  /* NON_EXPAND; element dtype = topk_dtype */
        struct epd_mat recv_weights;   /* NON_EXPAND [rows, K_op]; EXPAND [rows] (stride 4) */
        struct epd_mat recv_src;       /* int64 [rows] */
        struct epd_mat recv_topk_slot; /* EXPAND int32 [rows] */
};

/* A combine's inputs and outputs on one source rank (the combine's receiver). */
struct epd_combine_src_io {
        struct epd_mat bias[2];                 /* bf16 [N, H]; ptr NULL when absent */
        struct epd_mat combined;                /* bf16 [N, H] */
        struct epd_mat combined_topk_weights;   /* fp32 [N, K_op], optional */
        const float *weights;                   /* [N * K_op] the dispatch's weights, or NULL */
        /* fp32 [N, K_op], optional: w(t, k) of apply_weights in place of weights
         * (docs/semantics.md §3, source_weights). */
        struct epd_mat source_weights;
};

#endif
