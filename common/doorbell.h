/* doorbell.h - the per-rank doorbell page, daemon-owned host memory shared with the rank's
 * client: 64-bit sequence words that order the client's CUDA stream and the daemon's streams
 * without a host round trip (DESIGN.md section 2, "Stream ordering"), and a reply mailbox.
 *
 *   completed     written by the daemon: how many of this rank's ops (since it was bound) have
 *                 finished, successfully or not. The CUDA backend's executor stores it (release)
 *                 as soon as it sees the op's end event; the loop thread stores it again when it
 *                 takes the completion (the host backend's only store), and when a rank's client
 *                 dies the daemon completes every doorbell its peers wait on. A client stream
 *                 waits with cuStreamWaitValue64(completed >= n) for its n-th op, then reads the
 *                 status on the host when it needs it.
 *   inputs_ready  written by the client's stream (cuStreamWriteValue64) when the inputs of its
 *                 k-th request are ready; the daemon's streams wait for it before reading them.
 *                 When the client dies or the wait outlives the op timeout, the daemon stores
 *                 EPD_DOORBELL_RELEASED from the host so its own streams cannot hang.
 *
 *   reply mailbox (docs/design-notes.md, "Replies through the doorbell page") a request that asks
 *                 for it (Dispatch/Combine reply_in_doorbell) gets its reply here instead of on
 *                 the socket: the loop thread copies the packed Response into `reply`, stores its
 *                 length, then the request id into reply_id (release), then adds 1 to reply_seq,
 *                 and wakes reply_seq's futex when the client says it is sleeping (`waiting`).
 *                 When an op starts, the daemon also adds 1 to reply_seq and wakes a client that
 *                 asked for it (EPD_MAILBOX_WAKE_AT_START), which then polls for its reply. A
 *                 client that polls sees reply_id change without any system call on either side;
 *                 a sleeping one waits on reply_seq. A reply too large for the page is sent on
 *                 the socket, announced by reply_len = EPD_MAILBOX_ON_SOCKET. A rank has at most
 *                 one such request pending (the daemon refuses a second), so the daemon never
 *                 overwrites a reply its client has not read. The daemon reads nothing from the
 *                 page but `waiting`, and only to decide whether to wake.
 *
 *                 A request that also asks for a compact reply (compact_reply) may get, when
 *                 it succeeded and names no arena outputs, the fixed struct epd_compact_reply
 *                 below instead of a packed Response; reply_len then carries
 *                 EPD_MAILBOX_COMPACT (docs/design-notes.md, "Compact replies").
 *
 *   request mailbox (docs/design-notes.md, "Requests through the doorbell page") the last
 *                 EPD_REQUEST_AREA_BYTES of the page (struct epd_request_box). While the daemon's
 *                 loop thread polls (it says so in `polling`), a client may put a packed Dispatch
 *                 or Combine Request of this rank there instead of sending it on the socket: it
 *                 copies the bytes and their length, then moves `state` from EMPTY to POSTED. The
 *                 loop thread claims it (POSTED -> TAKEN, compare-and-swap), copies it out, and
 *                 empties the slot (release) before it decodes the copy. A client that then reads
 *                 `polling` as 0 takes its request back (POSTED -> EMPTY) and sends it on the
 *                 socket; the loop thread, after it stores `polling` = 0, looks at every slot once
 *                 more, so a request is either taken or taken back, never left behind. Order with
 *                 the socket: a client posts only when the daemon has read every frame it sent
 *                 (`socket_read_id`, the id of the last request the loop thread read from this
 *                 client's socket), and the loop thread takes a client's posted requests before
 *                 it handles the next frame from its socket. A request may also be posted as
 *                 the fixed struct epd_compact_request below (docs/design-notes.md, "Compact
 *                 requests"), its length or'ed with EPD_REQUEST_COMPACT.
 *
 * The sequence words live in host memory registered with CUDA in both processes: a CPU store and
 * a GPU stream memory operation on it are ordered at system scope, which is the scope that two
 * processes (and the CPU) share. Each writer's words have their own 64-byte line so that two
 * writers never share a cache line.
 */
#ifndef EPD_COMMON_DOORBELL_H
#define EPD_COMMON_DOORBELL_H

#include <stdint.h>

#define EPD_DOORBELL_BYTES 16384u
#define EPD_DOORBELL_RELEASED (UINT64_MAX / 2)
/* reply_len of a mailbox reply that went on the socket instead. */
#define EPD_MAILBOX_ON_SOCKET UINT32_MAX
/* `waiting`: the client sleeps and is to be woken by its reply, or already when its op starts
 * executing (it then polls for the reply). */
#define EPD_MAILBOX_WAKE_AT_REPLY 1u
#define EPD_MAILBOX_WAKE_AT_START 2u

struct epd_doorbell {
        volatile uint64_t completed;
        uint64_t pad0[7];
        volatile uint64_t inputs_ready;
        uint64_t pad1[7];
        /* The reply mailbox: written by the daemon... */
        volatile uint64_t reply_id;
        volatile uint32_t reply_len;
        volatile uint32_t reply_seq;  /* futex word */
        uint64_t pad2[6];
        /* ...and by the client. */
        volatile uint32_t waiting;
        uint32_t pad3[15];
        uint8_t reply[];              /* up to the request box */
};

/* reply_len of a compact reply: this bit, or'ed with the struct's length in bytes. */
#define EPD_MAILBOX_COMPACT 0x80000000u
#define EPD_COMPACT_DISPATCH 1u
#define EPD_COMPACT_COMBINE 2u

/* A successful dispatch or combine reply as one fixed struct, the fields of DispatchReply or
 * CombineReply and of their OpTimeline (proto/epd.proto documents each). Written by the daemon's
 * loop thread, read by libepd, both on the same host and build, so native byte order. */
struct epd_compact_reply {
        uint64_t id;                  /* Response.id: the request's id */
        uint32_t kind;                /* EPD_COMPACT_DISPATCH or EPD_COMPACT_COMBINE */
        uint32_t num_local_experts;   /* dispatch: L, the length of both count arrays */
        uint32_t world_size;          /* dispatch: R; rank_prefix holds R + 1 entries */
        uint32_t pad;
        int64_t num_tokens;           /* dispatch: num_recv_tokens; combine: num_tokens */
        int64_t num_expanded_rows;    /* dispatch */
        uint64_t op_number, handle_id, exec_ns, queue_ns, kernel_ns;
        uint64_t received_ns, launched_ns, exec_start_ns, completed_ns, replied_ns;
        /* dispatch: L per expert, L aligned per expert, R + 1 rank prefix; combine: none */
        int32_t counts[];
};

/* Bytes of a compact reply with L local experts and R ranks (dispatch) or of a combine's; 0 when
 * the sizes overflow. */
static inline uint64_t epd_compact_reply_bytes(uint32_t kind, uint64_t L, uint64_t R)
{
        if (kind != EPD_COMPACT_DISPATCH)
                return sizeof(struct epd_compact_reply);
        if (L > UINT32_MAX || R > UINT32_MAX)
                return 0;
        return sizeof(struct epd_compact_reply) + (2 * L + R + 1) * sizeof(int32_t);
}

/* The request mailbox at the end of the page. */
#define EPD_REQUEST_AREA_BYTES 4096u
#define EPD_REQUEST_EMPTY 0u
#define EPD_REQUEST_POSTED 1u
#define EPD_REQUEST_TAKEN 2u

struct epd_request_box {
        /* Written by the daemon. */
        volatile uint32_t polling;        /* 1 while the loop thread looks at the slots */
        uint32_t pad0;
        volatile uint64_t socket_read_id; /* last request id read from the client's socket */
        uint64_t pad1[6];
        /* The slot: `state` moves by compare-and-swap on both sides, `len` and `bytes` are the
         * client's while the slot is EMPTY and the daemon's while it is POSTED or TAKEN. */
        volatile uint32_t state;
        volatile uint32_t len;
        uint64_t pad2[7];
        uint8_t bytes[];                  /* up to the page's end */
};

#define EPD_REQUEST_CAPACITY (EPD_REQUEST_AREA_BYTES - sizeof(struct epd_request_box))

/* A compact request (docs/design-notes.md, "Compact requests"): instead of a packed Request, a
 * client of a daemon that offers it (CAP_COMPACT_REQUEST) may post this fixed struct in the box,
 * with `len` = sizeof(struct epd_compact_request) | EPD_REQUEST_COMPACT. It carries the fields
 * of a Dispatch or Combine (proto/epd.proto documents each) and the Request's id; the daemon
 * checks its length, kind, flags and tensor ranks, then turns it into the same Request. */
#define EPD_REQUEST_COMPACT 0x80000000u
#define EPD_COMPACT_MAX_DIMS 4u
#define EPD_COMPACT_ZERO_PADDING 1u      /* Dispatch.zero_padding */
#define EPD_COMPACT_USE_ARENA 2u         /* Dispatch.use_arena */
#define EPD_COMPACT_APPLY_WEIGHTS 4u     /* Combine.apply_weights */
#define EPD_COMPACT_REPLY_IN_DOORBELL 8u /* reply_in_doorbell */
#define EPD_COMPACT_REPLY 16u            /* compact_reply */
#define EPD_COMPACT_FLAGS 31u

/* A TensorRef: absent when region_id is 0; n_strides is 0 (contiguous) or ndim. */
struct epd_compact_tensor {
        uint64_t region_id, offset;
        uint32_t dtype, ndim, n_strides, pad;
        uint64_t sizes[EPD_COMPACT_MAX_DIMS], strides[EPD_COMPACT_MAX_DIMS];
};

/* The tensors of a compact request, by kind. */
enum {
        EPD_CT_X, EPD_CT_SCALES, EPD_CT_TOPK_IDX, EPD_CT_TOPK_WEIGHTS, EPD_CT_RECV_X,
        EPD_CT_RECV_SCALES, EPD_CT_RECV_TOPK_IDX, EPD_CT_RECV_WEIGHTS, EPD_CT_RECV_SRC,
        EPD_CT_RECV_TOPK_SLOT, EPD_CT_DISPATCH_TENSORS
};
enum { EPD_CT_Y, EPD_CT_BIAS0, EPD_CT_BIAS1, EPD_CT_COMBINED, EPD_CT_COMBINED_TOPK_WEIGHTS };

struct epd_compact_request {
        uint64_t id;                  /* Request.id */
        uint32_t kind;                /* EPD_COMPACT_DISPATCH or EPD_COMPACT_COMBINE */
        uint32_t rank;
        uint64_t group_id, handle_id, wait_inputs;
        uint32_t num_tokens, num_topk;        /* dispatch */
        uint32_t layout, expert_alignment;    /* dispatch */
        uint32_t topk_idx_dtype, flags;       /* flags: EPD_COMPACT_* */
        uint32_t num_bias, pad;               /* combine: bias tensors given (0 to 2) */
        struct epd_compact_tensor t[EPD_CT_DISPATCH_TENSORS];
};

/* The request box of a page of page_bytes, or NULL when the page has no room for one. */
static inline struct epd_request_box *epd_doorbell_request_box(void *page, uint64_t page_bytes)
{
        if (page_bytes < sizeof(struct epd_doorbell) + EPD_REQUEST_AREA_BYTES)
                return 0;
        return (struct epd_request_box *)((uint8_t *)page + page_bytes - EPD_REQUEST_AREA_BYTES);
}

/* The client's half of the request mailbox (the daemon's is daemon/mailbox.c, which argues the
 * ordering). epd_request_box_open: whether a request may be posted now, given the id of the
 * last request the client sent on its socket. The client then writes `bytes` and `len`, and
 * epd_request_publish returns 1 when the daemon took or will take the request, 0 when the
 * daemon had stopped looking and the request was taken back (it is to go on the socket). */
static inline int epd_request_box_open(const struct epd_request_box *box, uint64_t last_socket_id)
{
        return __atomic_load_n(&box->polling, __ATOMIC_RELAXED) &&
               __atomic_load_n(&box->state, __ATOMIC_ACQUIRE) == EPD_REQUEST_EMPTY &&
               __atomic_load_n(&box->socket_read_id, __ATOMIC_ACQUIRE) >= last_socket_id;
}

static inline int epd_request_publish(struct epd_request_box *box)
{
        uint32_t expect = EPD_REQUEST_POSTED;

        __atomic_store_n(&box->state, EPD_REQUEST_POSTED, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&box->polling, __ATOMIC_SEQ_CST))
                return 1;
        return !__atomic_compare_exchange_n(&box->state, &expect, EPD_REQUEST_EMPTY, 0,
                                            __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* Raises a sequence word (`completed`) to value, never lowering it (release). Two threads
 * store it: the CUDA executor when it sees an op's end event, and the loop thread when it takes
 * the completion or counts a refused submission, whose count may lag the executor's. */
static inline void epd_doorbell_advance(volatile uint64_t *word, uint64_t value)
{
        uint64_t cur = __atomic_load_n(word, __ATOMIC_RELAXED);

        while (cur < value && !__atomic_compare_exchange_n(word, &cur, value, 0,
                                                           __ATOMIC_RELEASE, __ATOMIC_RELAXED))
                ;
}

/* Bytes of a packed reply that fit in a doorbell page of page_bytes: from the header to the
 * request box. */
#define EPD_MAILBOX_CAPACITY(page_bytes)                                                 \
        ((page_bytes) > sizeof(struct epd_doorbell) + EPD_REQUEST_AREA_BYTES                \
                 ? (page_bytes) - sizeof(struct epd_doorbell) - EPD_REQUEST_AREA_BYTES      \
                 : 0)

#endif
