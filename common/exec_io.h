/* exec_io.h - the per-rank tensors of a dispatch or combine as checked pointers and row
 * strides: what the daemon's core resolves from a request and every executor (the host's,
 * cpu/host_exec.h, and the CUDA backend's) reads. Kept apart from any executor so that the
 * daemon's backend interface (daemon/backend/backend.h) need not include one. */
#ifndef EPD_COMMON_EXEC_IO_H
#define EPD_COMMON_EXEC_IO_H

#include <stdint.h>

/* A row-major matrix: row i starts at ptr + i * stride bytes. ptr NULL means absent. */
struct epd_mat {
        uint8_t *ptr;
        uint64_t stride;
};

struct epd_dispatch_src_io { /* inputs of one source rank */
        struct epd_mat x;        /* row_bytes per row */
        struct epd_mat scales;   /* fp32 [N, H/scale_block], fp8 only */
        struct epd_mat weights;  /* fp32 [N, K_op], optional */
};

struct epd_dispatch_dst_io { /* outputs of one destination rank */
        struct epd_mat recv_x;
        struct epd_mat recv_scales;
        struct epd_mat recv_topk_idx;  /* NON_EXPAND; element dtype = topk_dtype */
        struct epd_mat recv_weights;   /* NON_EXPAND [rows, K_op]; EXPAND [rows] (stride 4) */
        struct epd_mat recv_src;       /* int64 [rows] */
        struct epd_mat recv_topk_slot; /* EXPAND int32 [rows] */
};

struct epd_combine_src_io { /* inputs and outputs of one source rank (the combine's receiver) */
        struct epd_mat bias[2];                 /* bf16 [N, H]; ptr NULL when absent */
        struct epd_mat combined;                /* bf16 [N, H] */
        struct epd_mat combined_topk_weights;   /* fp32 [N, K_op], optional */
        const float *weights;                   /* [N * K_op] the dispatch's weights, or NULL */
};

#endif
