/* doorbell.h - the per-rank doorbell page, daemon-owned host memory shared with the rank's
 * client: 64-bit sequence words that order the client's CUDA stream and the daemon's streams
 * without a host round trip (docs/architecture.md, "Stream ordering: doorbell pages"), and a reply
  * mailbox.
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
 *   reply mailbox a request whose op record asks for it (EPD_OPREC_REPLY_IN_DOORBELL) gets its
 *                 reply record (common/oprec.h) here instead of on the socket: the loop thread
 *                 writes the record into `reply`, stores its length, then the request id into
 *                 reply_id (release), then adds 1 to reply_seq, and wakes reply_seq's futex when
 *                 the client says it is sleeping (`waiting`). When an op starts, the daemon also
 *                 adds 1 to reply_seq and wakes a client that asked for it
 *                 (EPD_MAILBOX_WAKE_AT_START), which then polls for its reply. A client that
 *                 polls sees reply_id change without any system call on either side; a sleeping
 *                 one waits on reply_seq. A reply too large for the page is sent on the socket,
 *                 announced by reply_len = EPD_MAILBOX_ON_SOCKET. A rank has at most one such
 *                 request pending (the daemon refuses a second), so the daemon never overwrites
 *                 a reply its client has not read. The daemon reads nothing from the page but
 *                 `waiting`, and only to decide whether to wake.
 *
 *   request mailbox the last EPD_REQUEST_AREA_BYTES of the page (struct epd_request_box). While
 *                 the daemon's loop thread polls (it says so in `polling`), a client may put the
 *                 op record of a dispatch or combine of this rank there instead of sending it on
 *                 the socket: it copies the bytes and their length, then moves `state` from EMPTY
 *                 to POSTED. The loop thread claims it (POSTED -> TAKEN, compare-and-swap),
 *                 copies it out, and empties the slot (release) before it decodes the copy. A
 *                 client that then reads `polling` as 0 takes its request back (POSTED -> EMPTY)
 *                 and sends it on the socket; the loop thread, after it stores `polling` = 0,
 *                 looks at every slot once more, so a request is either taken or taken back,
 *                 never left behind. Order with the socket: a client posts only when the daemon
 *                 has read every frame it sent (`socket_read_id`, the id of the last request the
 *                 loop thread read from this client's socket), and the loop thread takes a
 *                 client's posted requests before it handles the next frame from its socket.
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

/* The request box of a page of page_bytes, or NULL when the page has no room for one. */
static inline struct epd_request_box *epd_doorbell_request_box(void *page, uint64_t page_bytes)
{
        if (page_bytes < sizeof(struct epd_doorbell) + EPD_REQUEST_AREA_BYTES)
                return 0;
        return (struct epd_request_box *)((uint8_t *)page + page_bytes - EPD_REQUEST_AREA_BYTES);
}

/* The client's half of the request mailbox (the daemon's is daemon/net/mailbox.c, which argues the
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

/* Bytes of a reply record that fit in a doorbell page of page_bytes: from the header to the
 * request box. */
#define EPD_MAILBOX_CAPACITY(page_bytes)                                                 \
        ((page_bytes) > sizeof(struct epd_doorbell) + EPD_REQUEST_AREA_BYTES                \
                 ? (page_bytes) - sizeof(struct epd_doorbell) - EPD_REQUEST_AREA_BYTES      \
                 : 0)

#endif
