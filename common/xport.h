/* xport.h - one-sided puts and counting signals between the nodes of a group: the interface that
 * the scale-out protocol (cpu/xnode.h) runs over, and that a network transport implements.
 *
 * Every rank of a group is an endpoint of the transport. Each endpoint owns a window (window_bytes
 * of memory that peers write into) and num_counters 64-bit counters (that peers add to). A peer
 * never reads a remote window; it only writes:
 *
 *   put(src, dst, off, data, len)   writes len bytes at offset off of dst's window
 *   signal(src, dst, counter, add)  adds add to counter `counter` of dst
 *
 * Both calls return once the transport has captured the caller's bytes: the source buffer may be
 * reused at once. Every put lands exactly once and every signal adds exactly once, eventually;
 * the calls never fail for a valid request (an endpoint or range outside the transport is a bug
 * of the caller and returns -1).
 *
 * The owner of a window reads it with load() and its counters with counter(); these are the only
 * ways the protocol looks at what peers wrote, so a transport may deliver from any thread.
 *
 * What the receiver may conclude from what it observes depends on `ordered`:
 *
 *   ordered (InfiniBand RC, NVLink stores followed by a release):
 *     the operations that one source issues to one destination land in the order they were
 *     issued. Once dst observes the effect of a signal from src, it observes every byte of every
 *     put that src issued to dst before that signal. Nothing is promised across different
 *     sources.
 *
 *   unordered (AWS EFA SRD, and multi-path networks in general):
 *     no order at all, even from one source to one destination: a signal may be observed before
 *     the puts issued ahead of it, a later put may land before an earlier one, and the bytes of
 *     one put may land in pieces, in any order, over time. A window byte that a pending put
 *     covers holds its old value or its new value. The only promises are exactly-once delivery
 *     and that a counter's value never decreases. The receiver must therefore prove from the
 *     bytes themselves that a put has landed completely (cpu/xnode.c: an in-band header with
 *     the op's tag and a checksum) and may use counting signals only to know how many puts were
 *     issued.
 *
 * A protocol correct over an unordered transport is correct over an ordered one; the converse is
 * false, which tests/unit/unit_xnode.c demonstrates.
 *
 * Threading: put and signal may be called from any thread, concurrently; load and counter from
 * the window's owner, concurrently with deliveries to it.
 */
#ifndef EPD_COMMON_XPORT_H
#define EPD_COMMON_XPORT_H

#include <stddef.h>
#include <stdint.h>

struct xport;

struct xport_ops {
        int (*put)(struct xport *xp, uint32_t src, uint32_t dst, uint64_t off, const void *data,
                   uint64_t len);
        int (*signal)(struct xport *xp, uint32_t src, uint32_t dst, uint32_t counter,
                      uint64_t add);
        /* Copies len bytes at off of endpoint ep's own window into out. */
        void (*load)(struct xport *xp, uint32_t ep, uint64_t off, void *out, uint64_t len);
        /* The current value of counter `counter` of endpoint ep (with acquire semantics: on an
         * ordered transport, puts from a source that precede the signals counted are visible to
         * a following load). */
        uint64_t (*counter)(struct xport *xp, uint32_t ep, uint32_t counter);
};

struct xport {
        const struct xport_ops *ops;
        int ordered;            /* 1: ordered, 0: unordered (see the file comment) */
        uint32_t endpoints;     /* ranks of the group */
        uint64_t window_bytes;  /* per endpoint */
        uint32_t num_counters;  /* per endpoint */
};

static inline int xport_put(struct xport *xp, uint32_t src, uint32_t dst, uint64_t off,
                            const void *data, uint64_t len)
{
        if (src >= xp->endpoints || dst >= xp->endpoints || off > xp->window_bytes ||
            len > xp->window_bytes - off)
                return -1;
        return xp->ops->put(xp, src, dst, off, data, len);
}

static inline int xport_signal(struct xport *xp, uint32_t src, uint32_t dst, uint32_t counter,
                               uint64_t add)
{
        if (src >= xp->endpoints || dst >= xp->endpoints || counter >= xp->num_counters)
                return -1;
        return xp->ops->signal(xp, src, dst, counter, add);
}

static inline void xport_load(struct xport *xp, uint32_t ep, uint64_t off, void *out,
                              uint64_t len)
{
        xp->ops->load(xp, ep, off, out, len);
}

static inline uint64_t xport_counter(struct xport *xp, uint32_t ep, uint32_t counter)
{
        return xp->ops->counter(xp, ep, counter);
}

#endif
