/* cx.h - client-executed dispatch and combine on the CPU, over shared memory.
 *
 * The protocol of docs/client-execution.md on the layout of common/cx_layout.h: each rank runs its
 * own ops on its own thread (in libepd: the calling thread) over buffers that every rank maps.
 * Dispatch pushes: each source publishes a count record to every rank, every rank reads all of
 * them and reaches the same verdict (CAPACITY_EXCEEDED before any row moves), then each source
 * writes its rows straight into the destinations' receive areas at rows that are a pure function
 * of topk_idx (cpu/plan.c) and raises a done flag at each. Combine pulls: each rank publishes its y
 * record, each source reduces its tokens from its peers' y areas in docs/semantics.md section 3's
  * order (cpu/exec.c, so the bits equal the host backend's), and acknowledges, so y is reusable.
 *
 * Op numbers come from the rank's own op counter in its buffer, never from the caller. Every wait
 * is bounded by the rank's timeout and polls the abort word. A failure is sticky for the epoch.
 *
 * Threading: one thread per rank at a time (the rank's ops are a sequence); ranks run on any
 * threads or processes. No allocation beyond one op's plan and, for a quantizing dispatch, the
 * source's converted rows.
 */
#ifndef EPD_CPU_CX_H
#define EPD_CPU_CX_H

#include <stddef.h>
#include <stdint.h>

#include "cx_layout.h"
#include "epd.h"

/* One rank's view of its group. Borrowed pointers: the layout and every mapping outlive it. */
struct cx_rank {
        const struct cx_layout *layout;
        uint32_t rank;
        uint8_t *const *bufs;       /* [R] every rank's buffer as mapped here; bufs[rank] is own */
        uint64_t timeout_ns;        /* bound of every wait of one op; 0: 10 s */
};

/* Writes the header of a freshly allocated, zeroed buffer (what the daemon does at allocation). */
void cx_buffer_init(uint8_t *buf, const struct cx_layout *l, uint32_t rank, uint64_t epoch);

/* Re-forms the group on this buffer: a new epoch, op numbering from 0, no sticky failure, empty
 * handles. The daemon does it for every rank, once no op of the old epoch is running. */
void cx_buffer_reform(uint8_t *buf, const struct cx_layout *l, uint64_t epoch);

/* Writes the abort word of a buffer (the daemon, when a member dies). */
void cx_buffer_abort(uint8_t *buf, const struct cx_layout *l);

struct cx_dispatch_args {
        uint32_t num_tokens;        /* N of this rank, <= T */
        const void *x;              /* [N, H] of the group dtype (bf16 when quantizing) */
        uint64_t x_stride;          /* bytes; 0: packed */
        const float *scales;        /* fp8 groups: [N, H / scale_block] */
        uint64_t scales_stride;     /* bytes; 0: packed */
        const void *topk_idx;       /* [N, K_op] int32 or int64; ignored when cached */
        enum epd_dtype topk_dtype;
        uint32_t num_topk;          /* K_op <= K */
        const float *weights;       /* [N, K_op] packed, optional */
        enum epd_layout layout;
        uint32_t expert_alignment;  /* 0: 1 */
        int zero_padding;           /* EXPAND */
        uint32_t expert_block_rows; /* EXPAND: C of docs/semantics.md §2.6, 0 for packed */
        int quantize;               /* bf16 groups: send fp8 rows and scales (2.7) */
        int round_scale;            /* quantize: power-of-two scales (2.7) */
        uint32_t scale_format;      /* quantize: enum epd_scale_format (UE8M0 needs round_scale) */
        uint32_t handle;            /* the handle slot it fills, or reuses when cached */
        int cached;                 /* reuse the routing of the handle's dispatch (2.4) */
        uint64_t capacity_rows;     /* rows this rank accepts; 0: the receive area */
        /* Destinations in registered client memory: recv_area[d] is where rank d's receive area
         * (cx_recv_area_bytes, the layout's offsets from recv_x) lives as mapped here; NULL: the
         * buffers' own receive areas. recv_mem names the registration (part of the op's
         * signature, so every rank must name the same one); arg_error, when set, is this rank's
         * verdict that its registration cannot be used (a collective INVALID_ARGUMENT). */
        uint8_t *const *recv_area;
        uint32_t recv_mem;
        const char *arg_error;
};

struct cx_combine_args {
        uint32_t handle;            /* the handle slot of the dispatch whose layout y uses */
        int recv_weights;           /* NON_EXPAND: y_weights area holds [rows, K_op] weights */
        int apply_weights;          /* EXPAND: multiply by w(t, k) */
        const float *source_weights; /* [N, K_op] packed, optional (w(t, k) when given) */
        const uint16_t *bias[2];    /* [N, H] packed, optional */
        uint16_t *combined;         /* [N, H] packed, written */
        float *combined_topk_weights; /* [N, K_op] packed, optional, written */
        /* y in registered client memory: y_area[d] is rank d's y area (cx_y_area_bytes, the
         * layout's offsets from y) as mapped here; NULL: the buffers' own. y_mem and arg_error as
         * recv_mem and arg_error of a dispatch. */
        uint8_t *const *y_area;
        uint32_t y_mem;
        const char *arg_error;
};

/* Runs one dispatch of rank r. Inputs stay the caller's; outputs land in the receive areas and,
 * for counts, in the handle slot of the caller's buffer (cx_counts_*). Returns 0 or a negative
 * enum epd_status, the same on every rank for a collective failure; *op (may be NULL) gets the
 * op's number. err (may be NULL) gets a message naming the rank, op and numbers involved. */
int cx_dispatch(const struct cx_rank *r, const struct cx_dispatch_args *a, uint64_t *op,
                char *err, size_t err_len);

/* Runs one combine of rank r. y (and, with recv_weights, its weights) must be in the caller's y
 * area (cx_y_area) before the call; it may be rewritten once the call returns. */
int cx_combine(const struct cx_rank *r, const struct cx_combine_args *a, uint64_t *op,
               char *err, size_t err_len);

/* Describes a status entry as docs/semantics.md section 4 asks ("rank 3 needs 9123 rows, capacity
 * 8192"). */
void cx_format_status(const struct cx_op_status *st, uint32_t rank, uint64_t op, char *msg,
                      size_t len);

#endif
