/* exec.h - the data movement of dispatch and combine on the CPU (host backend).
 *
 * Pure compute over raw pointers that the caller has already bounds-checked against registered
 * regions: no daemon state, no locking, no allocation except a per-call fp32 accumulator. Work is
 * cut into independent items so that several threads can share one op: each item writes rows that
 * no other item writes.
 *
 * Floating point follows docs/semantics.md section 3 exactly; this file is compiled with
 * -ffp-contract=off and without fast-math.
 */
#ifndef EPD_CPU_EXEC_H
#define EPD_CPU_EXEC_H

#include <stdint.h>

#include "mat.h"
#include "plan.h"

/* A dispatch that reads and writes at least this many bytes in all writes its recv_x rows with
 * non-temporal stores on x86-64. 0, the default: the last-level cache size. Tests set it to 1 to
 * run the streaming path on small ops. */
extern uint64_t epd_host_stream_min_bytes;

struct epd_dispatch_exec {
        const struct epd_plan *plan;   /* placed (epd_plan_place_source done for every s) */
        uint64_t row_bytes;            /* bytes of one x row */
        uint64_t scale_bytes;          /* bytes of one scales row, 0 for bf16 */
        enum epd_dtype topk_dtype;     /* INT32 or INT64, for recv_topk_idx */
        int has_weights;
        int zero_padding;              /* EXPAND only */
        const struct epd_dispatch_src_io *src; /* [R] */
        const struct epd_dispatch_dst_io *dst; /* [R] */
};

/* Work items of a dispatch: R * ceil(T / 32) token chunks (chunks past N_s are empty), then, for
 * EXPAND, one padding item per (destination, local expert). Item i may run on any thread, in any
 * order, concurrently with other items. Optional outputs whose ptr is NULL are skipped. */
uint64_t epd_host_dispatch_items(const struct epd_dispatch_exec *op);
void epd_host_dispatch_item(const struct epd_dispatch_exec *op, uint64_t item);

struct epd_combine_exec {
        const struct epd_plan *plan;
        uint32_t hidden;
        int apply_weights;
        const struct epd_mat *y;                /* [R]: rank d's y (bf16 rows, layout of plan) */
        const struct epd_combine_src_io *src;   /* [R] */
        /* NULL, or [R]: rank d's recv_weights, fp32 [rows, K_op] in the NON_EXPAND layout of
         * plan (docs/semantics.md §3); combined_topk_weights is then their reduction over the
         * destinations. A rank without rows may have ptr NULL. */
        const struct epd_mat *recv_weights;
};

/* Work items of a combine: R * ceil(T / 32) token chunks. combined_topk_weights is written only
 * when it is given and recv_weights or weights are; apply_weights weighs with source_weights
 * when given, else weights, and without either is treated as unweighted (the caller rejects that
 * combination with INVALID_ARGUMENT first). Combine on x86-64 runs an
 * AVX2 clone of its kernels when the CPU has AVX2; the bits are the same either way. */
uint64_t epd_host_combine_items(const struct epd_combine_exec *op);
void epd_host_combine_item(const struct epd_combine_exec *op, uint64_t item);

#endif
