/* cx_layout.h - one rank's communication buffer in client-executed mode, defined once.
 *
 * In client-executed mode (docs/client-execution.md) every rank of a group owns one buffer, sized
 * from the group's shape, that every other rank maps. Ranks meet through words in those buffers and
 * write rows straight into their final place in the destination's buffer. The CPU executor
 * (cpu/cx.c), the CUDA kernels (kernels/cx_*.cu) and the daemon that allocates and exports the
 * buffers all address it through this header, so sizing and addressing cannot drift (STYLE.md:
 * one __host__ __device__ definition of every memory layout).
 *
 * Order, offsets in bytes from the buffer's base, every part CX_ALIGN-aligned:
 *
 *   metadata (at most CX_METADATA_MAX bytes; cx_layout_compute refuses shapes that need more)
 *     header        struct cx_header: magic, version, epoch, abort and drain words, the op
 *                   counter, the sticky status, statistics, the device grid barrier, the per-op
 *                   status ring
 *     count records [2][R] records of cx_count_rec_bytes: slot [p][s] is written by source s for
 *                   its dispatch with op parity p: struct cx_count_rec, then int32 tok_count[R],
 *                   then int32 sel_count[E]
 *     done flags    [2][R] struct cx_flag: slot [p][s], written by s once its rows to this rank
 *                   are in place
 *     y records     [2][R] struct cx_flag: slot [p][d], written by d once its y is ready for this
 *                   rank's combine to read (signature and status beside the tag)
 *     acks          [2][R] struct cx_flag: slot [p][s], written by s once it has read this
 *                   rank's y, so that y may be rewritten
 *     handles       [num_handles] slots of handle_bytes: struct cx_handle, then the rank's
 *                   counts as a destination (per_expert[L], per_expert_aligned[L], rank_prefix
 *                   [R + 1], expert_base[L + 1]), then per (token, top-k position) of the rank's
 *                   own tokens: int32 topk[T*K], int32 row[T*K], fp32 weights[T*K]
 *     scratch       int32 [R + E]: the device dispatch's working totals (per expert at [R + e])
 *   receive area (rows of the dispatches this rank receives, in their final place)
 *     recv_x        [recv_rows][x_row_bytes]; rows are packed at the op's row size
 *     recv_scales   fp32 [recv_rows][num_scales] (fp8 groups and quantizing groups); a ue8m0
 *                   dispatch packs its rows at num_scales bytes (cx_op_scale_bytes)
 *     recv_topk_idx [recv_rows][K_op] of the op's index dtype (area: K * 8 bytes a row)
 *     recv_weights  fp32, NON_EXPAND [recv_rows][K_op], EXPAND [recv_rows]
 *     recv_src      int64 [recv_rows]
 *     recv_topk_slot int32 [recv_rows]
 *   y area (this rank's combine input, read by its peers)
 *     y             bf16 [recv_rows][H]
 *     y_weights     fp32 [recv_rows][K]: combine's recv_weights, packed by K_op
 *
 * Tags: a signal slot holds cx_tag(epoch, op) = epoch << 40 | op. A slot is used by op n only at
 * parity n & 1, and every op waits for a word from every rank before it completes, so no rank can
 * be two ops ahead of another: a slot that op n + 2 writes was last read by op n, which every
 * reader has finished. A stale tag from op n - 2, or from an earlier epoch, never equals op n's.
 */
#ifndef EPD_COMMON_CX_LAYOUT_H
#define EPD_COMMON_CX_LAYOUT_H

#include <stdint.h>

#include "epd.h"
#include "routing.h"

#define CX_MAGIC 0x31584345u /* "ECX1" little-endian */
#define CX_VERSION 1u
#define CX_MAX_RANKS 64u
/* Client memories a rank may register with a group (epd_cx_register). */
#define CX_MAX_MEMORY 16u
#define CX_MAX_HANDLES 8u
#define CX_DEFAULT_HANDLES 2u
#define CX_STATUS_RING 64u
#define CX_METADATA_MAX (2ull << 20)
#define CX_ALIGN 256u
#define CX_OP_BITS 40u
#define CX_OP_MASK ((1ull << CX_OP_BITS) - 1)
#define CX_QUANT_BLOCK 128u /* docs/semantics.md §2.7: channels per scale of a quantizing dispatch */
#define CX_MAX_BLOCKS 256u  /* blocks of one rank's kernel (its SM budget) */

/* The group's shape, fixed at creation. Zero fields take the defaults named. */
struct cx_shape {
        uint32_t world_size;        /* R, 1 .. CX_MAX_RANKS */
        uint32_t num_experts;       /* E, a multiple of R */
        uint32_t hidden;            /* H */
        uint32_t max_tokens;        /* T */
        uint32_t max_topk;          /* K */
        enum epd_dtype dtype;       /* the group's dispatch dtype: BF16 or FP8_E4M3 */
        uint32_t scale_block;       /* fp8: channels per scale; 0: 128 */
        uint32_t quantize;          /* bf16 groups: reserve room for quantizing dispatch (2.7) */
        uint32_t max_alignment;     /* the largest expert_alignment an op may use; 0: 1 */
        uint32_t expert_block_rows; /* the largest C of 2.6 the receive area must hold; 0: none */
        uint32_t num_handles;       /* handle slots; 0: CX_DEFAULT_HANDLES */
        uint32_t recv_rows;         /* rows of the receive and y areas; 0: the shape's worst
                                     * case (cx_layout.worst_rows), the most any op can need */
};

enum cx_shape_error {
        CX_SHAPE_OK = 0,
        CX_SHAPE_RANKS,         /* R outside 1 .. 64 */
        CX_SHAPE_EXPERTS,       /* E outside 1 .. 2048, E % R != 0, or E / R > 256 */
        CX_SHAPE_TOPK,          /* K outside 1 .. 32 */
        CX_SHAPE_TOKENS,        /* T == 0 or hidden == 0 */
        CX_SHAPE_DTYPE,         /* dtype not bf16 or fp8, or quantize on an fp8 group */
        CX_SHAPE_SCALE_BLOCK,   /* H not a multiple of the scale block (or of 128 to quantize) */
        CX_SHAPE_ROW_BYTES,     /* dispatch row bytes not a multiple of 16 */
        CX_SHAPE_ALIGNMENT,     /* expert_block_rows not a multiple of max_alignment */
        CX_SHAPE_HANDLES,       /* num_handles above CX_MAX_HANDLES */
        CX_SHAPE_ROWS,          /* the worst-case rows do not fit int32 */
        CX_SHAPE_METADATA,      /* metadata above CX_METADATA_MAX */
        CX_SHAPE_RECV_ROWS,     /* recv_rows above the worst case, or below L * expert_block_rows */
};

/* Statistics the rank's executor counts; the daemon reads them for epctl and /metrics. */
/* The phases of an op as its rank sees them: from its start to the verdict (every rank's count
 * or y record exchanged, so mostly the wait for the last peer to start), to every row moved or
 * reduced (the grid barrier after the copy), to its end (every peer's done flags or acks). */
enum { CX_PHASE_EXCHANGE, CX_PHASE_MOVE, CX_PHASE_FINISH, CX_PHASES };

/* Dispatch's first phase on the GPU (block 0), in parts, each up to: this rank's inputs checked
 * and counted; its count record sent to every rank; every rank's record here; the verdict; the
 * rows placed; the handle's counts written. The host backend does not split it. */
enum { CX_FIRST_CHECK, CX_FIRST_PUBLISH, CX_FIRST_WAIT, CX_FIRST_VERDICT, CX_FIRST_PLACE,
       CX_FIRST_COUNTS, CX_FIRST_PARTS };

struct cx_stats {
        uint64_t ops;           /* ops that ended OK */
        uint64_t rows;          /* rows this rank received (dispatch) or reduced (combine) */
        uint64_t bytes;         /* payload bytes this rank wrote to destinations */
        uint64_t failures;      /* ops that ended with another status */
        uint64_t kind_ops[2];   /* of ops: dispatches, combines */
        uint64_t phase_ns[2][CX_PHASES]; /* their time in each phase, summed, ns */
        uint64_t first_ns[CX_FIRST_PARTS]; /* OK dispatches on the GPU: their first phase's
                                            * parts, summed, ns */
};

/* The end of one op, in the status ring at op % CX_STATUS_RING, and the sticky failure. tag is
 * written last (release), so a reader that sees the op's tag sees the rest. */
struct cx_op_status {
        uint64_t tag;           /* cx_tag(epoch, op) of the op this entry describes */
        int32_t status;         /* 0 or a negative enum epd_status */
        int32_t reason;         /* enum cx_reason */
        int32_t rank;           /* the rank the failure names (source, short destination, peer) */
        int32_t num_short;      /* capacity: how many destinations are short */
        int32_t token;          /* validation: token of the bad entry */
        int32_t pos;            /* validation: its top-k position; capacity: the short expert */
        int64_t value;          /* validation: the id; capacity: rows needed */
        int64_t capacity;       /* capacity: rows available */
        /* The op's window on its executor's clock (cuda: the GPU's %globaltimer, shared by every
         * process on that GPU; host: CLOCK_MONOTONIC): block 0's start and its end. */
        uint64_t start_ns;
        uint64_t end_ns;
};

enum cx_reason {
        CX_REASON_NONE = 0,
        CX_REASON_BAD_EXPERT,   /* an id outside [0, E) other than -1 */
        CX_REASON_DUP_EXPERT,   /* an expert twice in one row */
        CX_REASON_BAD_ARGS,     /* a local argument is invalid (value names which, see cx.c) */
        CX_REASON_MISMATCH,     /* ranks disagree on what must match (docs/semantics.md §1) */
        CX_REASON_CAPACITY,     /* a destination needs more rows than it has */
        CX_REASON_BLOCK,        /* 2.6: an expert's aligned count exceeds C */
        CX_REASON_ABORT,        /* the abort word was set (PEER_LOST) */
        CX_REASON_TIMEOUT,      /* a peer did not arrive in time (rank names it) */
        CX_REASON_STICKY,       /* an earlier op of this epoch failed */
        CX_REASON_DRAIN,        /* the group is drained at this op boundary */
};

struct cx_header {
        uint32_t magic;         /* CX_MAGIC, written by the buffer's owner at allocation */
        uint32_t version;       /* CX_VERSION */
        uint32_t rank;
        uint32_t world_size;
        uint64_t total_bytes;
        uint64_t epoch;         /* written by the daemon when the group forms; < 2^24 */
        uint32_t abort_word;    /* non-zero: a member is lost, every wait ends PEER_LOST */
        uint32_t reserved0;
        uint64_t drain_op;      /* non-zero: ops numbered >= drain_op - 1 are refused (ABORTED)
                                 * without advancing op_counter or touching a peer */
        uint64_t op_counter;    /* the next op number; advanced only by the rank's executor */
        int32_t sticky_status;  /* the first failure of epoch sticky_epoch */
        uint32_t reserved1;
        uint64_t sticky_epoch;
        int32_t verdict;        /* a device op's verdict, from block 0 to the other blocks */
        uint32_t reserved2;
        uint64_t launch_seq;    /* device kernels launched on this buffer, refused ones included */
        uint64_t reserved3[3];
        struct cx_stats stats;
        struct cx_op_status sticky;                  /* details of the sticky failure */
        struct cx_op_status status[CX_STATUS_RING];  /* the last ops' ends, by op number */
        /* The device kernels' grid barrier: block b's last arrival, keyed by epoch, launch and
         * barrier (kernels/cx_sync.cuh), so no reset is ever needed, even after a failed op. */
        uint64_t grid_arrive[CX_MAX_BLOCKS];
};

/* A 64-byte signal slot, so that slots written by different ranks share no cache line. */
struct cx_flag {
        uint64_t tag;           /* written last, with release */
        uint32_t sig[4];        /* combine's y record: the op's signature */
        int32_t status;         /* y record: the writer's local verdict, 0 or negative */
        int32_t reason;
        int64_t value;
        uint64_t reserved[3];
};

/* The head of a count record. The body follows: int32 tok_count[R] (tokens of the source that go
 * to each destination), then int32 sel_count[E] (selections of each expert). */
struct cx_count_rec {
        uint64_t tag;           /* written last, with release */
        uint32_t sig[4];        /* the op's signature (cx_dispatch_sig); must match everywhere */
        int32_t status;         /* the source's own verdict on its inputs: 0 or INVALID_ARGUMENT */
        int32_t reason;
        int32_t token;
        int32_t pos;
        int64_t value;
        uint32_t num_tokens;    /* N_s */
        uint32_t capacity_rows; /* the rows this rank can receive as a destination */
        uint64_t reserved[2];
        char text[128];         /* the source's description of its invalid input, or empty */
};

/* A handle slot's head: the routing of the dispatch that wrote it, for combine and cached
 * dispatch. Local to the rank: only its own executor reads or writes it. */
struct cx_handle {
        uint64_t tag;           /* cx_tag of the dispatch that filled it; 0: empty */
        uint32_t layout;        /* enum epd_layout */
        uint32_t num_topk;      /* K_op */
        uint32_t num_tokens;    /* N of this rank */
        uint32_t has_weights;
        uint32_t alignment;
        uint32_t block_rows;    /* C of 2.6, 0 for packed EXPAND */
        uint32_t quantize;
        uint32_t zero_padding;
        int32_t num_recv_tokens;
        int32_t num_expanded_rows;
        uint32_t topk_dtype;    /* enum epd_dtype of the dispatch's topk_idx */
        uint32_t reserved0;
        uint64_t reserved[1];
};

struct cx_layout {
        struct cx_shape shape;      /* normalised: defaults filled in */
        uint32_t num_local_experts; /* L */
        uint32_t num_scales;        /* scales per received row (0: none) */
        uint32_t x_row_bytes;       /* the largest received x row */
        uint32_t recv_rows;         /* rows of the receive and y areas */
        uint32_t worst_rows;        /* the most rows one op of the shape can send a rank */
        uint64_t count_rec_bytes;   /* one count record, head and body */
        uint64_t handle_bytes;      /* one handle slot */
        /* Offsets of the parts. */
        uint64_t header;
        uint64_t count_recs;
        uint64_t done;
        uint64_t yrec;
        uint64_t ack;
        uint64_t handles;
        uint64_t scratch;
        uint64_t metadata_bytes;
        uint64_t recv_x;
        uint64_t recv_scales;
        uint64_t recv_topk_idx;
        uint64_t recv_weights;
        uint64_t recv_src;
        uint64_t recv_topk_slot;
        uint64_t y;
        uint64_t y_weights;
        uint64_t total_bytes;
        /* Offsets inside a handle slot. */
        uint64_t h_per_expert;
        uint64_t h_per_expert_aligned;
        uint64_t h_rank_prefix;
        uint64_t h_expert_base;
        uint64_t h_rank_matrix;  /* int32 [R][R]: [s][d] the tokens of sources 0..s sent to d */
        uint64_t h_topk;
        uint64_t h_row;
        uint64_t h_weights;
};

EPD_HD uint64_t cx_align(uint64_t v)
{
        return (v + CX_ALIGN - 1) / CX_ALIGN * CX_ALIGN;
}

/* The scales per row an op sends: an fp8 group's, a quantizing op's (§2.7), none for bf16 rows
 * (a quantize group reserves scale room that a non-quantizing op leaves unused). */
EPD_HD uint32_t cx_op_num_scales(const struct cx_layout *l, int quantize)
{
        if (quantize)
                return l->shape.hidden / CX_QUANT_BLOCK;
        return l->shape.dtype == EPD_DTYPE_FP8_E4M3 ? l->num_scales : 0;
}

/* The bytes of one row of recv_scales an op writes, the one definition of each scale format's
 * size: an fp32 per scale, or for a quantizing dispatch with scale_format ue8m0 one byte per block
 * (§2.7: bytes e + 127, blocks in order, so four blocks fill a little-endian 32-bit word). Rows are
 * packed at this size; the area reserves the fp32 size, which is never smaller. */
EPD_HD uint32_t cx_op_scale_bytes(const struct cx_layout *l, int quantize, uint32_t scale_format)
{
        uint32_t n = cx_op_num_scales(l, quantize);

        return quantize && scale_format == EPD_SCALE_FORMAT_UE8M0 ? n : n * 4;
}

EPD_HD uint64_t cx_tag(uint64_t epoch, uint64_t op)
{
        return epoch << CX_OP_BITS | (op & CX_OP_MASK);
}

/* Fills *l for the shape. Returns CX_SHAPE_OK, or the first reason the shape is impossible
 * (then *l is unspecified, but for CX_SHAPE_RECV_ROWS, which leaves l->worst_rows set). */
EPD_HD enum cx_shape_error cx_layout_compute(const struct cx_shape *shape, struct cx_layout *l)
{
        struct cx_shape s = *shape;
        uint64_t R, E, T, K, L, off, rows, x_elem;

        if (s.world_size < 1 || s.world_size > CX_MAX_RANKS)
                return CX_SHAPE_RANKS;
        if (s.num_experts < 1 || s.num_experts > EPD_MAX_EXPERTS ||
            s.num_experts % s.world_size != 0 ||
            s.num_experts / s.world_size > EPD_MAX_LOCAL_EXPERTS)
                return CX_SHAPE_EXPERTS;
        if (s.max_topk < 1 || s.max_topk > EPD_MAX_TOPK)
                return CX_SHAPE_TOPK;
        if (s.max_tokens < 1 || s.hidden < 1)
                return CX_SHAPE_TOKENS;
        if ((s.dtype != EPD_DTYPE_BF16 && s.dtype != EPD_DTYPE_FP8_E4M3) ||
            (s.quantize && s.dtype != EPD_DTYPE_BF16))
                return CX_SHAPE_DTYPE;
        if (s.scale_block == 0)
                s.scale_block = EPD_DEFAULT_SCALE_BLOCK;
        if (s.max_alignment == 0)
                s.max_alignment = 1;
        if (s.num_handles == 0)
                s.num_handles = CX_DEFAULT_HANDLES;
        if (s.num_handles > CX_MAX_HANDLES)
                return CX_SHAPE_HANDLES;
        if ((s.dtype == EPD_DTYPE_FP8_E4M3 && s.hidden % s.scale_block != 0) ||
            (s.quantize && s.hidden % CX_QUANT_BLOCK != 0))
                return CX_SHAPE_SCALE_BLOCK;
        x_elem = s.dtype == EPD_DTYPE_BF16 ? 2 : 1;
        if (s.hidden * x_elem % 16 != 0 || (s.quantize && s.hidden % 16 != 0))
                return CX_SHAPE_ROW_BYTES;
        if (s.expert_block_rows % s.max_alignment != 0)
                return CX_SHAPE_ALIGNMENT;

        R = s.world_size;
        E = s.num_experts;
        T = s.max_tokens;
        K = s.max_topk;
        L = E / R;
        rows = epd_route_max_rows_expand(s.world_size, s.max_tokens, s.max_topk, (uint32_t)L,
                                         s.max_alignment);
        if (epd_route_max_rows_non_expand(s.world_size, s.max_tokens) > rows)
                rows = epd_route_max_rows_non_expand(s.world_size, s.max_tokens);
        if (L * s.expert_block_rows > rows)
                rows = L * s.expert_block_rows;
        if (rows > INT32_MAX || T * K > INT32_MAX)
                return CX_SHAPE_ROWS;
        l->worst_rows = (uint32_t)rows;
        /* A smaller receive area: ops whose rows do not fit end CAPACITY_EXCEEDED before any
         * row moves, as with an op's own capacity_rows. Fixed expert blocks need all of theirs. */
        if (s.recv_rows) {
                if (s.recv_rows > rows || (uint64_t)s.recv_rows < L * s.expert_block_rows)
                        return CX_SHAPE_RECV_ROWS;
                rows = s.recv_rows;
        }

        l->shape = s;
        l->num_local_experts = (uint32_t)L;
        l->num_scales = s.dtype == EPD_DTYPE_FP8_E4M3 ? s.hidden / s.scale_block
                        : s.quantize                 ? s.hidden / CX_QUANT_BLOCK
                                                     : 0;
        l->x_row_bytes = (uint32_t)(s.hidden * x_elem);
        l->recv_rows = (uint32_t)rows;

        off = 0;
        l->header = off;
        off = cx_align(off + sizeof(struct cx_header));
        l->count_rec_bytes = cx_align(sizeof(struct cx_count_rec) + 4 * (R + E));
        l->count_recs = off;
        off += 2 * R * l->count_rec_bytes;
        l->done = off;
        off = cx_align(off + 2 * R * sizeof(struct cx_flag));
        l->yrec = off;
        off = cx_align(off + 2 * R * sizeof(struct cx_flag));
        l->ack = off;
        off = cx_align(off + 2 * R * sizeof(struct cx_flag));

        l->h_per_expert = cx_align(sizeof(struct cx_handle));
        l->h_per_expert_aligned = l->h_per_expert + 4 * L;
        l->h_rank_prefix = l->h_per_expert_aligned + 4 * L;
        l->h_expert_base = l->h_rank_prefix + 4 * (R + 1);
        l->h_rank_matrix = l->h_expert_base + 4 * (L + 1);
        l->h_topk = cx_align(l->h_rank_matrix + 4 * R * R);
        l->h_row = cx_align(l->h_topk + 4 * T * K);
        l->h_weights = cx_align(l->h_row + 4 * T * K);
        l->handle_bytes = cx_align(l->h_weights + 4 * T * K);
        l->handles = off;
        off += s.num_handles * l->handle_bytes;
        l->scratch = off;
        off = cx_align(off + 4 * (R + E));
        l->metadata_bytes = off;
        if (off > CX_METADATA_MAX)
                return CX_SHAPE_METADATA;

        l->recv_x = off;
        off = cx_align(off + rows * l->x_row_bytes);
        l->recv_scales = off;
        off = cx_align(off + rows * 4 * l->num_scales);
        l->recv_topk_idx = off;
        off = cx_align(off + rows * 8 * K);
        l->recv_weights = off;
        off = cx_align(off + rows * 4 * K);
        l->recv_src = off;
        off = cx_align(off + rows * 8);
        l->recv_topk_slot = off;
        off = cx_align(off + rows * 4);
        l->y = off;
        off = cx_align(off + rows * 2 * s.hidden);
        l->y_weights = off;
        off = cx_align(off + rows * 4 * K);
        l->total_bytes = off;
        return CX_SHAPE_OK;
}

/* ---- addressing; base is a rank's buffer as mapped by the caller ---- */

/* The receive area ([recv_x, y): recv_x, recv_scales, recv_topk_idx, recv_weights, recv_src,
 * recv_topk_slot) and the y area ([y, end): y, y_weights) are each one piece. Client memory
 * registered with the group as a destination or as y holds the same piece at the same offsets,
 * counted from the area's start. */
EPD_HD uint64_t cx_recv_area_bytes(const struct cx_layout *l)
{
        return l->y - l->recv_x;
}

EPD_HD uint64_t cx_y_area_bytes(const struct cx_layout *l)
{
        return l->total_bytes - l->y;
}

EPD_HD struct cx_header *cx_header_of(uint8_t *base, const struct cx_layout *l)
{
        return (struct cx_header *)(base + l->header);
}

/* Count record slot [parity][src] in the buffer at base. */
EPD_HD struct cx_count_rec *cx_count_rec_at(uint8_t *base, const struct cx_layout *l,
                                            uint32_t parity, uint32_t src)
{
        return (struct cx_count_rec *)(base + l->count_recs +
                                       ((uint64_t)parity * l->shape.world_size + src) *
                                               l->count_rec_bytes);
}

EPD_HD int32_t *cx_count_tok(struct cx_count_rec *rec)
{
        return (int32_t *)(rec + 1);
}

EPD_HD int32_t *cx_count_sel(struct cx_count_rec *rec, const struct cx_layout *l)
{
        return cx_count_tok(rec) + l->shape.world_size;
}

EPD_HD struct cx_flag *cx_flag_at(uint8_t *base, uint64_t part, const struct cx_layout *l,
                                  uint32_t parity, uint32_t rank)
{
        return (struct cx_flag *)(base + part) + (uint64_t)parity * l->shape.world_size + rank;
}

EPD_HD uint8_t *cx_handle_base(uint8_t *base, const struct cx_layout *l, uint32_t handle)
{
        return base + l->handles + (uint64_t)handle * l->handle_bytes;
}

EPD_HD struct cx_handle *cx_handle_at(uint8_t *base, const struct cx_layout *l, uint32_t handle)
{
        return (struct cx_handle *)cx_handle_base(base, l, handle);
}

EPD_HD int32_t *cx_handle_i32(uint8_t *base, const struct cx_layout *l, uint32_t handle,
                              uint64_t field)
{
        return (int32_t *)(cx_handle_base(base, l, handle) + field);
}

/* ---- what every rank computes alike from the count records ---- */

/* Selections of destination d's local expert j from every source, in the records of parity
 * p. */
EPD_HD int32_t cx_expert_selections(uint8_t *base, const struct cx_layout *l, uint32_t parity,
                                    uint32_t d, uint32_t j)
{
        const uint32_t R = l->shape.world_size, L = l->num_local_experts;
        int32_t n = 0;

        for (uint32_t s = 0; s < R; s++)
                n += cx_count_sel(cx_count_rec_at(base, l, parity, s), l)[d * L + j];
        return n;
}

/* The rows destination d needs for a dispatch of the given layout, alignment and block rows,
 * from the count records in recs (slot [parity][0 .. R-1] of any rank's buffer: every source
 * writes the same record to every rank). With block rows C, *short_expert is the first local
 * expert whose aligned count exceeds C (-1 when none) and the rows are L * C. */
EPD_HD int64_t cx_rows_needed(uint8_t *base, const struct cx_layout *l, uint32_t parity,
                              uint32_t d, uint32_t layout, uint32_t alignment,
                              uint32_t block_rows, int32_t *short_expert)
{
        const uint32_t R = l->shape.world_size, L = l->num_local_experts;
        int64_t rows = 0;

        *short_expert = -1;
        if (layout == EPD_LAYOUT_NON_EXPAND) {
                for (uint32_t s = 0; s < R; s++)
                        rows += cx_count_tok(cx_count_rec_at(base, l, parity, s))[d];
                return rows;
        }
        for (uint32_t j = 0; j < L; j++) {
                int64_t n = cx_expert_selections(base, l, parity, d, j);

                n = (int64_t)epd_route_align_up((uint64_t)n, alignment);
                if (block_rows && n > block_rows && *short_expert < 0)
                        *short_expert = (int32_t)j;
                rows += n;
        }
        return block_rows ? (int64_t)L * block_rows : rows;
}

/* The first row of local expert j at a destination: 2.6's fixed block when block_rows is set,
 * else the packed base the caller computed (2.2). */
EPD_HD int32_t cx_block_base(uint32_t j, uint32_t block_rows, int32_t packed_base)
{
        return block_rows ? (int32_t)(j * block_rows) : packed_base;
}

/* The counts of docs/semantics.md §2.3 for destination d into handle slot h of base (d's own
 * buffer), from the count records of parity p in the same buffer, in two parts so that a GPU
 * block can spread the first over its threads: cx_write_counts_cols writes column e of the rank
 * prefix matrix and local expert j's counts for e, j = first, first + step, ...; then, once
 * every column is written, cx_write_counts_bases writes the rank prefix, the expert bases and
 * the totals. cx_write_counts does both. */
EPD_HD void cx_write_counts_cols(uint8_t *base, const struct cx_layout *l, uint32_t parity,
                                 uint32_t d, uint32_t handle, uint32_t alignment, uint32_t first,
                                 uint32_t step)
{
        const uint32_t R = l->shape.world_size, L = l->num_local_experts;
        int32_t *per = cx_handle_i32(base, l, handle, l->h_per_expert);
        int32_t *aligned = cx_handle_i32(base, l, handle, l->h_per_expert_aligned);
        int32_t *matrix = cx_handle_i32(base, l, handle, l->h_rank_matrix);

        /* Every source's record holds its tokens for every destination. */
        for (uint32_t e = first; e < R; e += step) {
                int32_t acc = 0;

                for (uint32_t s = 0; s < R; s++) {
                        acc += cx_count_tok(cx_count_rec_at(base, l, parity, s))[e];
                        matrix[s * R + e] = acc;
                }
        }
        for (uint32_t j = first; j < L; j += step) {
                int32_t n = cx_expert_selections(base, l, parity, d, j);

                per[j] = n;
                aligned[j] = (int32_t)epd_route_align_up((uint64_t)n, alignment);
        }
}

EPD_HD void cx_write_counts_bases(uint8_t *base, const struct cx_layout *l, uint32_t parity,
                                  uint32_t d, uint32_t handle, uint32_t block_rows)
{
        const uint32_t R = l->shape.world_size, L = l->num_local_experts;
        struct cx_handle *h = cx_handle_at(base, l, handle);
        const int32_t *aligned = cx_handle_i32(base, l, handle, l->h_per_expert_aligned);
        int32_t *prefix = cx_handle_i32(base, l, handle, l->h_rank_prefix);
        int32_t *ebase = cx_handle_i32(base, l, handle, l->h_expert_base);
        int32_t acc = 0;

        for (uint32_t s = 0; s < R; s++) {
                prefix[s] = acc;
                acc += cx_count_tok(cx_count_rec_at(base, l, parity, s))[d];
        }
        prefix[R] = acc;
        h->num_recv_tokens = acc;
        acc = 0;
        for (uint32_t j = 0; j < L; j++) {
                ebase[j] = cx_block_base(j, block_rows, acc);
                acc += aligned[j];
        }
        ebase[L] = cx_block_base(L, block_rows, acc);
        h->num_expanded_rows = ebase[L];
}

EPD_HD void cx_write_counts(uint8_t *base, const struct cx_layout *l, uint32_t parity,
                            uint32_t d, uint32_t handle, uint32_t alignment, uint32_t block_rows)
{
        cx_write_counts_cols(base, l, parity, d, handle, alignment, 0, 1);
        cx_write_counts_bases(base, l, parity, d, handle, block_rows);
}

/* The signature of an op: what docs/semantics.md section 1 says must match across ranks. */
EPD_HD void cx_dispatch_sig(uint32_t sig[4], uint32_t layout, uint32_t alignment,
                            uint32_t block_rows, uint32_t handle, uint32_t cached,
                            uint32_t quantize, uint32_t has_weights, uint32_t zero_padding,
                            uint32_t round_scale, uint32_t scale_format)
{
        sig[0] = 1u | layout << 2 | cached << 3 | quantize << 4 | has_weights << 5 |
                 zero_padding << 6 | handle << 8 | round_scale << 12 | scale_format << 13;
        sig[1] = alignment;
        sig[2] = block_rows;
        sig[3] = 0;
}

EPD_HD void cx_combine_sig(uint32_t sig[4], uint32_t handle, uint32_t apply_weights,
                           uint32_t recv_weights)
{
        sig[0] = 2u | apply_weights << 4 | recv_weights << 5 | handle << 8;
        sig[1] = sig[2] = sig[3] = 0;
}

EPD_HD int cx_sig_equal(const uint32_t a[4], const uint32_t b[4])
{
        return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* An OK status naming nothing. */
EPD_HD void cx_status_init(struct cx_op_status *out)
{
        out->status = 0;
        out->reason = CX_REASON_NONE;
        out->rank = -1;
        out->num_short = 0;
        out->token = out->pos = -1;
        out->value = out->capacity = 0;
}

/* The verdict of a dispatch, the same on every rank: every rank reads the same records. Checks in
 * a fixed order, so the first failure is deterministic: (1) signatures that differ from rank 0's
 * (INVALID_ARGUMENT, naming the lowest differing rank); (2) a source's own invalid inputs
 * (INVALID_ARGUMENT, the lowest such source, with its token, position and value); (3) capacity
 * (CAPACITY_EXCEEDED, naming the lowest short destination, its need and capacity, and how many
 * are short; with fixed expert blocks the short expert too). need_in and short_in, when not
 * NULL, hold cx_rows_needed's result for every destination, computed beforehand (in parallel on
 * the GPU). Returns out->status. */
EPD_HD int32_t cx_dispatch_verdict(uint8_t *base, const struct cx_layout *l, uint32_t parity,
                                   const int64_t *need_in, const int32_t *short_in,
                                   struct cx_op_status *out)
{
        const uint32_t R = l->shape.world_size;
        struct cx_count_rec *r0 = cx_count_rec_at(base, l, parity, 0);
        uint32_t layout = r0->sig[0] >> 2 & 1u, alignment = r0->sig[1], block = r0->sig[2];

        cx_status_init(out);
        for (uint32_t s = 1; s < R; s++) {
                if (!cx_sig_equal(cx_count_rec_at(base, l, parity, s)->sig, r0->sig)) {
                        out->status = EPD_INVALID_ARGUMENT;
                        out->reason = CX_REASON_MISMATCH;
                        out->rank = (int32_t)s;
                        return out->status;
                }
        }
        for (uint32_t s = 0; s < R; s++) {
                struct cx_count_rec *r = cx_count_rec_at(base, l, parity, s);

                if (r->status != 0) {
                        out->status = r->status;
                        out->reason = r->reason;
                        out->rank = (int32_t)s;
                        out->token = r->token;
                        out->pos = r->pos;
                        out->value = r->value;
                        return out->status;
                }
        }
        for (uint32_t d = 0; d < R; d++) {
                int32_t short_expert;
                int64_t need = need_in ? need_in[d]
                                       : cx_rows_needed(base, l, parity, d, layout, alignment,
                                                        block, &short_expert);

                if (need_in)
                        short_expert = short_in[d];
                int64_t cap = cx_count_rec_at(base, l, parity, d)->capacity_rows;

                if (need <= cap && short_expert < 0)
                        continue;
                if (out->num_short++ == 0) {
                        out->status = EPD_CAPACITY_EXCEEDED;
                        out->reason = short_expert >= 0 ? CX_REASON_BLOCK : CX_REASON_CAPACITY;
                        out->rank = (int32_t)d;
                        out->pos = short_expert;
                        out->value = need;
                        out->capacity = short_expert >= 0 ? block : cap;
                }
        }
        return out->status;
}

/* The verdict of a combine from the y records of parity p in base: signatures that differ from
 * rank 0's, then a rank's own invalid inputs, each naming the lowest rank. Returns out->status. */
EPD_HD int32_t cx_combine_verdict(uint8_t *base, const struct cx_layout *l, uint32_t parity,
                                  struct cx_op_status *out)
{
        const uint32_t R = l->shape.world_size;
        struct cx_flag *f0 = cx_flag_at(base, l->yrec, l, parity, 0);

        cx_status_init(out);
        for (uint32_t s = 0; s < R; s++) {
                struct cx_flag *f = cx_flag_at(base, l->yrec, l, parity, s);

                if (!cx_sig_equal(f->sig, f0->sig) || f->status != 0) {
                        out->status = EPD_INVALID_ARGUMENT;
                        out->reason = f->status != 0 ? f->reason : CX_REASON_MISMATCH;
                        out->rank = (int32_t)s;
                        out->value = f->value;
                        return out->status;
                }
        }
        return 0;
}

#ifndef __CUDA_ARCH__
/* Why a shape was refused, for messages (host only). */
static inline const char *cx_shape_error_str(enum cx_shape_error e)
{
        switch (e) {
        case CX_SHAPE_OK: return "ok";
        case CX_SHAPE_RANKS: return "world_size must be 1 to 64 in client-executed mode";
        case CX_SHAPE_EXPERTS: return "num_experts must be 1 to 2048, a multiple of world_size, "
                                      "with at most 256 local experts";
        case CX_SHAPE_TOPK: return "max_topk must be 1 to 32";
        case CX_SHAPE_TOKENS: return "max_tokens and hidden must be at least 1";
        case CX_SHAPE_DTYPE: return "dtype must be bf16 or fp8_e4m3, and quantize needs bf16";
        case CX_SHAPE_SCALE_BLOCK: return "hidden must be a multiple of the scale block "
                                          "(128 to quantize)";
        case CX_SHAPE_ROW_BYTES: return "dispatch row bytes must be a multiple of 16";
        case CX_SHAPE_ALIGNMENT: return "expert_block_rows must be a multiple of max_alignment";
        case CX_SHAPE_HANDLES: return "num_handles must be at most 8";
        case CX_SHAPE_ROWS: return "the worst-case rows do not fit in int32";
        case CX_SHAPE_METADATA: return "signals and metadata would exceed 2 MiB per rank "
                                       "(lower max_tokens * max_topk or num_handles)";
        case CX_SHAPE_RECV_ROWS: return "recv_rows must be at most the shape's worst case and "
                                        "at least num_local_experts * expert_block_rows";
        }
        return "unknown shape error";
}
#endif

#endif
