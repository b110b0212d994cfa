/* layout.h - the group workspace of the CUDA dispatch and combine kernels, defined once.
 *
 * The workspace is one block of device memory per group (per live handle, when handles must
 * survive later dispatches) that every device hosting a rank of the group can address. The host
 * sizes it and copies its reply block with these functions; the kernels address it with the same
 * functions, so host sizing and device addressing cannot drift (STYLE.md: one __host__ __device__
 * definition of every memory layout).
 *
 * Order, all offsets in bytes from the workspace base and 256-byte aligned:
 *
 *   reply block (the host copies [0, reply_bytes) to pinned memory after the prefix step)
 *     error             struct epd_ws_error                 the op's verdict, written by prefix
 *     rank_prefix       int32 [R dst][R + 1]                as struct epd_plan
 *     expert_count      int32 [R dst][L] (= [E])            as struct epd_plan
 *     expert_aligned    int32 [R dst][L] (= [E])            as struct epd_plan
 *     expert_base       int32 [R dst][L + 1]                as struct epd_plan
 *   counts, written by prefix from the chunk counts
 *     tok_count         int32 [R src][R dst]                as struct epd_plan
 *     sel_count         int32 [R src][E]                    as struct epd_plan
 *     expert_src_prefix int32 [E][R src]                    as struct epd_plan
 *   per chunk of EPD_WS_CHUNK_TOKENS tokens of a source (C = ceil(T / chunk) chunks a source)
 *     chunk_count       int32 [R src][C][R + E]   written by count (or the small routing):
 *                               tokens of the chunk going to each destination, then selections
 *                               of each expert
 *     chunk_base        int32 [R src][C][E]       written by prefix: for the op layout's key
 *                               (NON_EXPAND: destination d at [d]; EXPAND: expert e at [e]),
 *                               the source's entries with that key in earlier chunks
 *     chunk_error       struct epd_ws_src_error [R src][C]   written by count (or the small
 *                               routing): the chunk's first bad entry
 *   small_sync          struct epd_ws_small_sync, then uint32 flag[R * C]: the small routing's
 *                               block counter and chunk flags (kernels/route_small.cu). Zero when
 *                               the workspace is allocated (epd_k_workspace_init); the kernel
 *                               leaves it zero again.
 *   per (source, token, top-k position); source s owns entries [s*T*K, (s+1)*T*K) and entry
 *   (t, k) of it sits at t*K_op + k, packed by the op's K_op like struct epd_plan's rows
 *     topk              int32    normalised expert ids (-1 for none)
 *     local             int32    rank of the entry among the entries of its chunk with the same
 *                               key (NON_EXPAND: destination, first position only; EXPAND: expert)
 *     row               int32    destination row, exactly struct epd_plan's row[s][t*K_op + k]
 *     weights           float    the dispatch's topk_weights, kept for combine
 *
 * Cutting a source into chunks lets the count step use many blocks per source; the prefix step
 * turns chunk counts into chunk bases, so that a row is prefix + chunk base + rank in chunk.
 *
 * rank_prefix, expert_* and row hold the same numbers as struct epd_plan (docs/semantics.md
  * §2.1-2.3), in the same index order, so tests compare them entry for entry.
 */
#ifndef EPD_COMMON_LAYOUT_H
#define EPD_COMMON_LAYOUT_H

#include <stdint.h>

#include "routing.h"

/* Why an op failed, as recorded in the workspace. */
enum epd_ws_reason {
        EPD_WS_REASON_NONE = 0,
        EPD_WS_REASON_BAD_EXPERT = 1, /* an id outside [0, E) other than -1 */
        EPD_WS_REASON_DUP_EXPERT = 2, /* the same expert twice in one row */
        EPD_WS_REASON_CAPACITY = 3,   /* some destination needs more rows than its capacity */
        EPD_WS_REASON_BAD_TOKENS = 4, /* a source's num_tokens exceeds T (value: num_tokens) */
};

/* The op's verdict. status is written last, with release semantics, so a reader that acquires a
 * non-zero status also sees the details. Validation errors win over capacity errors (the counts
 * of an invalid op mean nothing); among validation errors the lowest source rank wins, and inside
 * a source the lowest entry index t*K_op + k, so the verdict is deterministic. */
struct epd_ws_error {
        int32_t status;    /* 0, EPD_INVALID_ARGUMENT or EPD_CAPACITY_EXCEEDED */
        int32_t reason;    /* enum epd_ws_reason */
        int32_t rank;      /* validation: source rank; capacity: the lowest short destination */
        int32_t num_short; /* capacity: how many destinations are short */
        int32_t token;     /* validation: token of the bad entry */
        int32_t pos;       /* validation: top-k position of the bad entry */
        int64_t value;     /* validation: the id as given; capacity: rows `rank` needs */
        int64_t capacity;  /* capacity: `rank`'s capacity in rows */
        int64_t reserved[3];
};

/* The first bad entry of one chunk of a source, written by that chunk's count block every op. */
struct epd_ws_src_error {
        int32_t reason; /* EPD_WS_REASON_NONE when the source's topk_idx is valid */
        int32_t token;
        int32_t pos;
        int32_t reserved;
        int64_t value;
};

/* The small routing's grid-wide counters (kernels/route_small.cu), followed by one flag per
 * chunk in the op's flat chunk order. */
struct epd_ws_small_sync {
        uint32_t done;   /* blocks that have finished */
        uint32_t reserved[3];
};

struct epd_ws_layout {
        uint32_t world_size;        /* R */
        uint32_t num_experts;       /* E */
        uint32_t num_local_experts; /* L = E / R */
        uint32_t max_tokens;        /* T */
        uint32_t max_topk;          /* K */
        uint32_t num_chunks;        /* C = ceil(T / EPD_WS_CHUNK_TOKENS) */
        uint64_t error;
        uint64_t rank_prefix;
        uint64_t expert_count;
        uint64_t expert_aligned;
        uint64_t expert_base;
        uint64_t reply_bytes;
        uint64_t tok_count;
        uint64_t sel_count;
        uint64_t expert_src_prefix;
        uint64_t chunk_count;
        uint64_t chunk_base;
        uint64_t chunk_error;
        uint64_t small_sync;
        uint64_t topk;
        uint64_t local;
        uint64_t row;
        uint64_t weights;
        uint64_t total_bytes;
};

#define EPD_WS_ALIGN 256u
/* Tokens of a source counted by one block of the count step. */
#define EPD_WS_CHUNK_TOKENS 256u

EPD_HD uint64_t epd_ws_align(uint64_t offset)
{
        return (offset + EPD_WS_ALIGN - 1) / EPD_WS_ALIGN * EPD_WS_ALIGN;
}

/* Fills the layout for a group of R ranks, E experts, T max tokens per rank and max top-k K.
 * The caller checks the dims against docs/semantics.md section 1 first (E % R == 0). */
EPD_HD void epd_ws_layout_init(struct epd_ws_layout *l, uint32_t world_size,
                               uint32_t num_experts, uint32_t max_tokens, uint32_t max_topk)
{
        uint64_t r = world_size, e = num_experts;
        uint64_t entries = r * max_tokens * max_topk;
        uint64_t off = 0;

        l->world_size = world_size;
        l->num_experts = num_experts;
        l->num_local_experts = world_size ? num_experts / world_size : 0;
        l->max_tokens = max_tokens;
        l->max_topk = max_topk;
        l->num_chunks = (max_tokens + EPD_WS_CHUNK_TOKENS - 1) / EPD_WS_CHUNK_TOKENS;

        l->error = off;
        off = epd_ws_align(off + sizeof(struct epd_ws_error));
        l->rank_prefix = off;
        off = epd_ws_align(off + 4 * r * (r + 1));
        l->expert_count = off;
        off = epd_ws_align(off + 4 * e);
        l->expert_aligned = off;
        off = epd_ws_align(off + 4 * e);
        l->expert_base = off;
        off = epd_ws_align(off + 4 * (e + r));
        l->reply_bytes = off;

        l->tok_count = off;
        off = epd_ws_align(off + 4 * r * r);
        l->sel_count = off;
        off = epd_ws_align(off + 4 * r * e);
        l->expert_src_prefix = off;
        off = epd_ws_align(off + 4 * e * r);
        l->chunk_count = off;
        off = epd_ws_align(off + 4 * r * l->num_chunks * (r + e));
        l->chunk_base = off;
        off = epd_ws_align(off + 4 * r * l->num_chunks * e);
        l->chunk_error = off;
        off = epd_ws_align(off + sizeof(struct epd_ws_src_error) * r * l->num_chunks);
        l->small_sync = off;
        off = epd_ws_align(off + sizeof(struct epd_ws_small_sync) + 4 * r * l->num_chunks);

        l->topk = off;
        off = epd_ws_align(off + 4 * entries);
        l->local = off;
        off = epd_ws_align(off + 4 * entries);
        l->row = off;
        off = epd_ws_align(off + 4 * entries);
        l->weights = off;
        off = epd_ws_align(off + 4 * entries);
        l->total_bytes = off;
}

/* Entries per source rank in the per-entry arrays (topk, local, row, weights). */
EPD_HD uint64_t epd_ws_src_entries(const struct epd_ws_layout *l)
{
        return (uint64_t)l->max_tokens * l->max_topk;
}

/* Index of entry (s, t, k) in those arrays, given epd_ws_src_entries (for kernels that carry
 * that one number rather than the layout). */
EPD_HD uint64_t epd_ws_entry_at(uint64_t src_entries, uint32_t src_rank, uint32_t token,
                                uint32_t num_topk, uint32_t k)
{
        return (uint64_t)src_rank * src_entries + (uint64_t)token * num_topk + k;
}

/* Index of entry (s, t, k) in the per-entry arrays. */
EPD_HD uint64_t epd_ws_entry(const struct epd_ws_layout *l, uint32_t src_rank, uint32_t token,
                             uint32_t num_topk, uint32_t k)
{
        return epd_ws_entry_at(epd_ws_src_entries(l), src_rank, token, num_topk, k);
}

/* Typed views of one field. base is the workspace base (device or host copy). */
EPD_HD int32_t *epd_ws_i32(void *base, uint64_t offset)
{
        return (int32_t *)((uint8_t *)base + offset);
}

EPD_HD float *epd_ws_f32(void *base, uint64_t offset)
{
        return (float *)((uint8_t *)base + offset);
}

EPD_HD struct epd_ws_error *epd_ws_error_rec(void *base, const struct epd_ws_layout *l)
{
        return (struct epd_ws_error *)((uint8_t *)base + l->error);
}

/* The error slots of every chunk: source s's chunk c at [s * C + c]. */
EPD_HD struct epd_ws_src_error *epd_ws_chunk_errors(void *base, const struct epd_ws_layout *l)
{
        return (struct epd_ws_src_error *)((uint8_t *)base + l->chunk_error);
}

EPD_HD struct epd_ws_small_sync *epd_ws_small_sync(void *base, const struct epd_ws_layout *l)
{
        return (struct epd_ws_small_sync *)((uint8_t *)base + l->small_sync);
}

/* Flag of flat chunk j, after the counters. */
EPD_HD uint32_t *epd_ws_small_flags(void *base, const struct epd_ws_layout *l)
{
        return (uint32_t *)(epd_ws_small_sync(base, l) + 1);
}

/* Rows destination d receives in the layout, read from the reply block (host copy or device). */
EPD_HD int32_t epd_ws_num_recv_tokens(void *base, const struct epd_ws_layout *l, uint32_t d)
{
        return epd_ws_i32(base, l->rank_prefix)[(uint64_t)d * (l->world_size + 1) + l->world_size];
}

EPD_HD int32_t epd_ws_num_expanded_rows(void *base, const struct epd_ws_layout *l, uint32_t d)
{
        return epd_ws_i32(base, l->expert_base)[(uint64_t)d * (l->num_local_experts + 1) +
                                                l->num_local_experts];
}

#endif
