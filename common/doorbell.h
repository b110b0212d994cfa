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
        uint8_t reply[];              /* up to the page's end */
};

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

/* Bytes of a packed reply that fit in a doorbell page of page_bytes. */
#define EPD_MAILBOX_CAPACITY(page_bytes)                                                       \
        ((page_bytes) > sizeof(struct epd_doorbell) ? (page_bytes) - sizeof(struct epd_doorbell) \
                                                    : 0)

#endif
