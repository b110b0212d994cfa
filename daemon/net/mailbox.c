/* mailbox.c - see mailbox.h.
 *
 * Replies. Why. Replying on the socket costs the loop thread a sendmsg per rank, and each one
 * wakes a sleeping worker inside the sender's system call: about 2.5 us per reply on the H200
 * test machine's virtual machine, so the eighth rank of a group got its reply 17-27 us after the
 * op completed, and the wake-up of its thread took another 10 us (docs/performance.md, "Daemon
 * overhead"). Through the page, a reply is a copy into shared memory: a worker that spins sees it
 * at once, and one that sleeps costs a futex wake only when it said it sleeps. The wake-ups are
 * moved off the reply's path: when an op starts executing, the loop nudges every rank that waits
 * in its page and asked for it (waiting = EPD_MAILBOX_WAKE_AT_START), and libepd then polls for
 * its reply a while (EPD_CLIENT_SPIN_US), so the workers are awake when the replies come, without
 * spinning while the daemon reads their requests. A client that does not poll asks to be woken
 * only by its reply: waking it at the start would only take a CPU from the op.
 *
 * Ordering. The payload and its length are plain stores, published by the release store of
 * reply_id; the client's acquire load of reply_id (which it compares with its request id) makes
 * them visible. The futex protocol is the usual one with a waiter flag: the daemon stores
 * reply_id, increments reply_seq and then reads `waiting` (both sequentially consistent); the
 * client reads reply_seq, sets `waiting`, checks reply_id once more and sleeps only while
 * reply_seq still holds the value it read. Either the client's check sees the reply, or the
 * daemon's read sees the flag and wakes it, or the futex call finds reply_seq changed and
 * returns at once.
 *
 * Requests. Why. Eight ranks submit an op's requests at nearly the same time, and the loop thread
 * reads them one after another: an epoll_wait and a recvmsg each, about 2 us per request on the
 * H200 test machine's virtual machine, so the last submitter's request waited 17-27 us before the
 * loop read it (docs/performance.md). While the loop thread polls anyway (the backend's poll_us
 * window), it looks at the request boxes each turn instead, and a request there costs a copy.
 *
 * Ordering. The client's bytes and length are plain stores published by its release of
 * state = POSTED; the daemon's compare-and-swap to TAKEN (acquire) makes them visible, and it
 * copies them out before it stores EMPTY (release), after which the client may write the slot
 * again. The handshake that no request is left behind is Dekker's: the client stores POSTED and
 * then loads `polling`, the daemon stores `polling` = 0 and then loads each `state`, all
 * sequentially consistent, so at least one of them sees the other's store: either the daemon's
 * last look finds the request, or the client sees polling = 0 and takes it back, and the
 * compare-and-swap on `state` decides which of the two owns it. */
#include <errno.h>
#include <limits.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "mailbox.h"

/* Moves reply_seq and wakes a sleeper whose `waiting` is at least `level`. */
static void mailbox_wake(struct epd_doorbell *db, uint32_t level)
{
        __atomic_add_fetch(&db->reply_seq, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&db->waiting, __ATOMIC_SEQ_CST) >= level)
                (void)syscall(SYS_futex, &db->reply_seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void epd_mailbox_nudge(struct epd_doorbell *db)
{
        mailbox_wake(db, EPD_MAILBOX_WAKE_AT_START);
}

static void mailbox_ring(struct epd_doorbell *db, uint64_t id)
{
        __atomic_store_n(&db->reply_id, id, __ATOMIC_RELEASE);
        mailbox_wake(db, EPD_MAILBOX_WAKE_AT_REPLY);
}

_Static_assert(EPD_OPREC_REQUEST_BYTES <= EPD_REQUEST_CAPACITY,
               "a request record fits the request box");

int epd_mailbox_post(struct epd_doorbell *db, const struct epd_op_reply *rep)
{
        const size_t len = epd_oprec_reply_bytes(rep);

        if (len == 0 || len > EPD_MAILBOX_CAPACITY(EPD_DOORBELL_BYTES)) {
                db->reply_len = EPD_MAILBOX_ON_SOCKET;
                mailbox_ring(db, rep->id);
                return -EMSGSIZE;
        }
        (void)epd_oprec_reply_encode(rep, (uint8_t *)db->reply, len);
        db->reply_len = (uint32_t)len;
        mailbox_ring(db, rep->id);
        return 0;
}

static struct epd_request_box *request_box(struct epd_doorbell *db)
{
        return epd_doorbell_request_box(db, EPD_DOORBELL_BYTES);
}

void epd_mailbox_set_polling(struct epd_doorbell *db, int on)
{
        __atomic_store_n(&request_box(db)->polling, on ? 1u : 0u, __ATOMIC_SEQ_CST);
}

void epd_mailbox_set_read_id(struct epd_doorbell *db, uint64_t id)
{
        __atomic_store_n(&request_box(db)->socket_read_id, id, __ATOMIC_RELEASE);
}

int epd_mailbox_take(struct epd_doorbell *db, uint8_t *buf, size_t buf_len, size_t *len)
{
        struct epd_request_box *box = request_box(db);
        uint32_t expect = EPD_REQUEST_POSTED;

        if (__atomic_load_n(&box->state, __ATOMIC_SEQ_CST) != EPD_REQUEST_POSTED)
                return 0;
        if (!__atomic_compare_exchange_n(&box->state, &expect, EPD_REQUEST_TAKEN, 0,
                                         __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
                return 0; /* taken back by the client */
        /* Read the length once: the client may scribble on the slot, but what is copied is
         * bounded by what was checked. */
        const uint32_t n = __atomic_load_n(&box->len, __ATOMIC_RELAXED);
        int rc = 1;

        if (n == 0 || n > EPD_REQUEST_CAPACITY || n > buf_len) {
                *len = n;
                rc = -EMSGSIZE;
        } else {
                memcpy(buf, box->bytes, n);
                *len = n;
        }
        __atomic_store_n(&box->state, EPD_REQUEST_EMPTY, __ATOMIC_RELEASE);
        return rc;
}
