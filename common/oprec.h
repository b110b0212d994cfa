/* oprec.h - the op record: the one encoding of a dispatch or combine request and of its reply
 * (docs/architecture.md, "Op records"). A record is fixed-layout, versioned and little-endian,
 * like io_uring's SQE and CQE: a request is always EPD_OPREC_REQUEST_BYTES, a reply is
 * EPD_OPREC_REPLY_HEADER_BYTES followed by the dispatch's count arrays and the error message,
 * whose lengths the header states. The same bytes travel in the rank's doorbell page
 * (common/doorbell.h) and, on the socket, inside the protobuf wrapper OpRecord
 * (proto/epd.proto). Control messages stay protobuf.
 *
 * The structs below are the native form that libepd fills and the daemon works on; the byte
 * layout is defined only by the offsets in oprec.c, never by a C struct's layout, so a compiler
 * or ABI cannot change the wire. Library code: no logging, no allocation. */
#ifndef EPD_COMMON_OPREC_H
#define EPD_COMMON_OPREC_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

/* The record format's own version, at offset 0 of every record. */
#define EPD_OPREC_VERSION 1u

/* kind: which op a request asks for, or a reply answers. */
#define EPD_OPREC_DISPATCH 1u
#define EPD_OPREC_COMBINE 2u

/* Request flags. */
#define EPD_OPREC_ZERO_PADDING 1u      /* dispatch: docs/semantics.md §2 */
#define EPD_OPREC_USE_ARENA 2u         /* dispatch: outputs in the rank's output arena */
#define EPD_OPREC_APPLY_WEIGHTS 4u     /* combine */
#define EPD_OPREC_REPLY_IN_DOORBELL 8u /* the reply goes into the rank's doorbell page */
#define EPD_OPREC_DISPATCH_FLAGS (EPD_OPREC_ZERO_PADDING | EPD_OPREC_USE_ARENA | \
                                  EPD_OPREC_REPLY_IN_DOORBELL)
#define EPD_OPREC_COMBINE_FLAGS (EPD_OPREC_APPLY_WEIGHTS | EPD_OPREC_REPLY_IN_DOORBELL)

/* The tensor slots of a request, by kind. An absent tensor has region_id 0. */
enum epd_oprec_dispatch_slot {
        EPD_OPREC_X, EPD_OPREC_SCALES, EPD_OPREC_TOPK_IDX, EPD_OPREC_TOPK_WEIGHTS,
        EPD_OPREC_RECV_X, EPD_OPREC_RECV_SCALES, EPD_OPREC_RECV_TOPK_IDX,
        EPD_OPREC_RECV_WEIGHTS, EPD_OPREC_RECV_SRC, EPD_OPREC_RECV_TOPK_SLOT,
        EPD_OPREC_TENSORS
};
enum epd_oprec_combine_slot {
        EPD_OPREC_Y, EPD_OPREC_BIAS0, EPD_OPREC_BIAS1, EPD_OPREC_COMBINED,
        EPD_OPREC_COMBINED_TOPK_WEIGHTS,
        /* docs/semantics.md §3's weight inputs: slots a combine left empty before, so the record's
         * layout and version are unchanged (a daemon without them refuses a record that uses
         * them: "tensor slot 5 is not used by this combine"). */
        EPD_OPREC_COMBINE_RECV_WEIGHTS, EPD_OPREC_SOURCE_WEIGHTS,
        EPD_OPREC_COMBINE_TENSORS
};
_Static_assert((int)EPD_OPREC_COMBINE_TENSORS <= (int)EPD_OPREC_TENSORS, "combine slots fit the record");

/* The output fields of a dispatch reply (arena placements), in placement order. */
enum epd_oprec_output_field {
        EPD_OPREC_OUT_RECV_X, EPD_OPREC_OUT_RECV_SCALES, EPD_OPREC_OUT_RECV_TOPK_IDX,
        EPD_OPREC_OUT_RECV_WEIGHTS, EPD_OPREC_OUT_RECV_SRC, EPD_OPREC_OUT_RECV_TOPK_SLOT,
        EPD_OPREC_OUTPUTS
};

#define EPD_OPREC_HEADER_BYTES 16u
#define EPD_OPREC_TENSOR_BYTES 96u
#define EPD_OPREC_REQUEST_BYTES (72u + EPD_OPREC_TENSORS * EPD_OPREC_TENSOR_BYTES)
#define EPD_OPREC_OUTPUT_BYTES 32u
#define EPD_OPREC_REPLY_HEADER_BYTES (152u + EPD_OPREC_OUTPUTS * EPD_OPREC_OUTPUT_BYTES)
/* The longest error message a reply carries, its terminating NUL included. */
#define EPD_OPREC_MESSAGE_MAX 1024u
/* Counts a dispatch reply may carry: 2 L + R + 1 of them, L local experts and R ranks. */
#define EPD_OPREC_MAX_COUNTS (1u << 20)

/* What a decode found wrong, also the negative return of the decoders. */
enum epd_oprec_error {
        EPD_OPREC_OK = 0,
        EPD_OPREC_TRUNCATED = -1,      /* shorter than its header or its stated size */
        EPD_OPREC_BAD_VERSION = -2,    /* a record format this build does not know */
        EPD_OPREC_BAD_SIZE = -3,       /* the stated size is not the size its fields need */
        EPD_OPREC_BAD_ENUM = -4,       /* kind, layout, dtype or status outside its enum */
        EPD_OPREC_OUT_OF_RANGE = -5,   /* flags, dims, bias count, unused slot, message */
};

/* A dispatch or combine request. Slots and fields that the kind does not use are zero. */
struct epd_op_request {
        uint64_t id;                   /* the client's request id; the reply carries it */
        uint32_t kind;                 /* EPD_OPREC_DISPATCH or EPD_OPREC_COMBINE */
        uint32_t rank;
        uint64_t group_id;
        uint64_t handle_id;            /* dispatch: non-zero reuses that handle; combine: its */
        uint64_t wait_inputs;          /* non-zero: wait for inputs_ready >= this */
        uint32_t flags;                /* EPD_OPREC_* flags of the kind */
        uint32_t num_tokens;           /* dispatch */
        uint32_t num_topk;             /* dispatch: K_op; 0 takes topk_idx's width */
        uint32_t expert_alignment;     /* dispatch: 0 means 1 */
        enum epd_layout layout;        /* dispatch */
        enum epd_dtype topk_idx_dtype; /* dispatch, informational: topk_idx's dtype rules */
        uint32_t num_bias;             /* combine: bias slots in use, 0 to 2 */
        struct epd_tensor t[EPD_OPREC_TENSORS]; /* by epd_oprec_*_slot */
};

/* An arena placement in a dispatch reply: sizes [rows, cols], or [rows] when cols is 0. */
struct epd_oprec_output {
        enum epd_dtype dtype;          /* EPD_DTYPE_INVALID: the field is absent */
        uint64_t offset;               /* bytes from the arena's start */
        uint64_t rows, cols;
};

/* The reply to a request: its status, and on success what the op produced. */
struct epd_op_reply {
        uint64_t id;                   /* the request's id */
        uint32_t kind;
        int status;                    /* EPD_OK or a negative enum epd_status */
        uint64_t op_number;
        uint64_t handle_id;            /* dispatch */
        int64_t num_tokens;            /* dispatch: received tokens; combine: tokens */
        int64_t num_expanded_rows;     /* dispatch */
        uint64_t exec_ns, queue_ns, kernel_ns;
        /* The op's timeline on the daemon's CLOCK_MONOTONIC (epd_op_timeline). */
        uint64_t received_ns, launched_ns, exec_start_ns, completed_ns, replied_ns;
        /* Dispatch with use_arena: the arena in the client's region space, its generation and
         * usable bytes when the reply was made, and where each output went. */
        uint64_t arena_region_id, arena_generation, arena_bytes;
        struct epd_oprec_output out[EPD_OPREC_OUTPUTS];
        /* Dispatch: L per expert, L aligned per expert, R + 1 rank prefix. Encode reads them;
         * decode points them into the record. */
        uint32_t num_local_experts, world_size;
        const int32_t *per_expert, *per_expert_aligned, *rank_prefix;
        /* NUL-terminated, or NULL when there is none; decode points it into the record. */
        const char *message;
};

/* Request: checks req and writes its record into buf (at least EPD_OPREC_REQUEST_BYTES).
 * Returns the record's length, or an enum epd_oprec_error with the reason in err. */
int epd_oprec_request_encode(const struct epd_op_request *req, uint8_t *buf, size_t buf_len,
                             char *err, size_t err_len);
/* Reads and checks the record of len bytes at buf into out (written only on success). Returns
 * 0 or an enum epd_oprec_error with the reason in err. */
int epd_oprec_request_decode(const uint8_t *buf, size_t len, struct epd_op_request *out,
                             char *err, size_t err_len);

/* Reply: the bytes rep encodes to (its message cut to EPD_OPREC_MESSAGE_MAX), 0 when its counts
 * exceed EPD_OPREC_MAX_COUNTS. */
size_t epd_oprec_reply_bytes(const struct epd_op_reply *rep);
/* Writes rep's record into buf; returns its length, or EPD_OPREC_BAD_SIZE when buf is too
 * short, EPD_OPREC_OUT_OF_RANGE when the counts are too many. */
int epd_oprec_reply_encode(const struct epd_op_reply *rep, uint8_t *buf, size_t buf_len);
/* Reads and checks the reply record of len bytes at buf, which must be 4-byte aligned and
 * outlive out: its counts and message point into it. 0 or an enum epd_oprec_error. */
int epd_oprec_reply_decode(const uint8_t *buf, size_t len, struct epd_op_reply *out, char *err,
                           size_t err_len);

/* "dispatch" or "combine". */
const char *epd_oprec_kind_name(uint32_t kind);

#endif
