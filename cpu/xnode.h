/* xnode.h - dispatch and combine for a group spread over several nodes, over a transport
 * (common/xport.h), on the CPU. docs/scale-out.md describes the design.
 *
 * The group has N nodes of G ranks each; rank r lives on node r / G with local index r % G. Ranks
 * of one node share memory (as GPUs of one node share NVLink); ranks of different nodes meet only
 * through the transport. The path is hierarchical: a token crosses the network once per
 * destination node, to the forwarding rank there with the source's local index, which copies it
 * to the node's destination ranks. Combine returns each token's rows the same way, once per node,
 * and the source reduces them in docs/semantics.md section 3's order with the host backend's code
 * (cpu/exec.c), so every output is bitwise equal to the host backend's.
 *
 * Completion: every op starts with a count exchange, so each receiver knows how many chunks each
 * source sends it. Over an ordered transport one signal after a source's chunks completes them;
 * over an unordered one every chunk carries a header (op tag, source, chunk index, length,
 * checksum), is counted by a signal of its own, and is consumed only once its header and checksum
 * prove it has landed whole for this op.
 *
 * Lifetime: a node (struct xnode_node) is created once per node and shared by its ranks; each
 * rank's ops run on one thread at a time, the ranks of a group on their own threads. Every rank
 * issues the same sequence of ops. Outputs are sized for the worst case (docs/semantics.md
 * section 5): the capacity rule, cached dispatch, quantizing dispatch and combine's recv_weights
 * are not part of this protocol.
 */
#ifndef EPD_CPU_XNODE_H
#define EPD_CPU_XNODE_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"
#include "mat.h"
#include "xport.h"

enum xnode_completion {
        XNODE_COMPLETION_AUTO = 0,      /* the transport's: ordered if xport.ordered */
        XNODE_COMPLETION_ORDERED,       /* one signal after the data; valid on ordered only */
        XNODE_COMPLETION_UNORDERED,     /* headers, checksums and counted chunks */
};

struct xnode_shape {
        uint32_t nodes;             /* N >= 1 */
        uint32_t ranks_per_node;    /* G >= 1; R = N * G <= EPD_MAX_WORLD_SIZE */
        uint32_t num_experts;       /* E, a multiple of R */
        uint32_t hidden;            /* H */
        uint32_t max_tokens;        /* T */
        uint32_t max_topk;          /* K */
        enum epd_dtype dtype;       /* BF16 or FP8_E4M3 */
        uint32_t scale_block;       /* fp8: channels per scale; 0: 128 */
        uint32_t chunk_tokens;      /* tokens per chunk on the network; 0: 32 */
        enum xnode_completion completion;
};

/* Checks a shape; returns 0 or EPD_INVALID_ARGUMENT with a message in err. */
int xnode_shape_check(const struct xnode_shape *s, char *err, size_t err_len);
/* The window bytes and counters that each endpoint of the transport needs for this shape. */
uint64_t xnode_window_bytes(const struct xnode_shape *s);
uint32_t xnode_num_counters(const struct xnode_shape *s);

struct xnode_node;

/* Creates node `node`'s shared state; the transport must have R endpoints with at least the
 * window and counters above. Returns NULL on a bad shape or when out of memory. */
struct xnode_node *xnode_node_new(const struct xnode_shape *s, uint32_t node, struct xport *xp);
/* Releases it once none of its ranks runs an op; NULL is accepted. */
void xnode_node_free(struct xnode_node *n);

/* One rank's executor state. */
struct xnode_rank;

/* Creates rank `rank` (on node rank / G, which n must be). timeout_ns bounds every wait of one op
 * (0: 10 s). Returns NULL when out of memory or when the rank is not on n. */
struct xnode_rank *xnode_rank_new(struct xnode_node *n, uint32_t rank, uint64_t timeout_ns);
void xnode_rank_free(struct xnode_rank *r);

struct xnode_dispatch_args {
        uint32_t num_tokens;            /* N of this rank, <= T */
        struct epd_mat x;               /* [N] rows of the group dtype */
        struct epd_mat scales;          /* fp8: fp32 [N, H / scale_block] */
        const void *topk_idx;           /* [N, K_op] packed, int32 or int64 */
        enum epd_dtype topk_dtype;
        uint32_t num_topk;              /* K_op <= K */
        const float *weights;           /* [N, K_op] packed, optional */
        enum epd_layout layout;
        uint32_t expert_alignment;      /* 0: 1 */
        int zero_padding;               /* EXPAND */
        /* Outputs, sized for the worst case of the layout; optional fields may be NULL. */
        struct epd_dispatch_dst_io out;
};

struct xnode_counts {
        int32_t num_recv_tokens;
        int32_t num_expanded_rows;
        int32_t *per_expert;            /* [L], written when not NULL */
        int32_t *per_expert_aligned;    /* [L], written when not NULL */
        int32_t *rank_prefix;           /* [R + 1], written when not NULL */
};

/* Runs one dispatch of this rank. Inputs stay the caller's and must not change until the op
 * returns on every rank of the group; the weights are kept for the combine that follows. Returns
 * 0, or a negative enum epd_status with a message in err: EPD_INVALID_ARGUMENT for this rank's
 * own bad arguments or routing, EPD_TIMEOUT when a peer's data does not arrive in time,
 * EPD_INTERNAL when a received record is inconsistent. A failure of any rank of a node fails the
 * op on every rank of that node. */
int xnode_dispatch(struct xnode_rank *r, const struct xnode_dispatch_args *a,
                   struct xnode_counts *counts, char *err, size_t err_len);

struct xnode_combine_args {
        struct epd_mat y;               /* this rank's expert outputs, bf16, the last dispatch's
                                         * layout; read by its node's ranks during the op */
        int apply_weights;              /* EXPAND: multiply by the dispatch's weights */
        struct epd_mat bias[2];         /* bf16 [N, H], optional */
        struct epd_mat combined;        /* bf16 [N, H], written */
        struct epd_mat combined_topk_weights; /* fp32 [N, K_op], optional, written */
};

/* Runs the combine of the last dispatch. Returns like xnode_dispatch. */
int xnode_combine(struct xnode_rank *r, const struct xnode_combine_args *a, char *err,
                  size_t err_len);

/* What a rank has seen so far, for tests and statistics. */
struct xnode_stats {
        uint64_t bytes_sent;        /* bytes put: chunks with their headers, count records */
        uint64_t chunks_received;   /* chunks and count records consumed */
        uint64_t incomplete;        /* unordered: loads of a chunk that had not landed whole */
        uint64_t stale;             /* unordered: of those, loads that found an earlier op's
                                     * chunk of the same kind in the slot (never consumed) */
};

void xnode_rank_stats(const struct xnode_rank *r, struct xnode_stats *out);

#endif
