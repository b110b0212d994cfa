/* xport_test.h - transports (common/xport.h) for tests, inside one process.
 *
 * ordered: every put is copied into the destination's window before it returns and every signal
 * is added with release, so operations land in issue order at once (InfiniBand RC at its most
 * polite).
 *
 * hostile: an unordered transport at its worst. put splits its bytes into pieces of random sizes
 * and queues them; signal queues its addition; a delivery thread of the transport applies the
 * queued operations one at a time in a random (seeded) order, pausing at random, so that pieces of
 * one put land out of order and interleaved with other puts, and signals overtake the puts issued
 * before them. With signals_first it always picks a pending signal before any piece, so every
 * signal is observed before the data it follows whenever the data was still queued.
 *
 * Windows and counters start at zero; xport_test_window gives a window's memory for poisoning or
 * planting while nothing is in flight (after xport_test_quiesce).
 */
#ifndef EPD_TESTS_XPORT_TEST_H
#define EPD_TESTS_XPORT_TEST_H

#include <stdint.h>

#include "xport.h"

struct xport_hostile_opts {
        uint64_t seed;
        uint32_t max_piece;         /* largest piece of a put in bytes; 0: 256 */
        uint32_t max_delay_us;      /* longest pause between deliveries; 0: none */
        int signals_first;
};

struct xport *xport_test_ordered_new(uint32_t endpoints, uint64_t window_bytes,
                                     uint32_t num_counters);
struct xport *xport_test_hostile_new(uint32_t endpoints, uint64_t window_bytes,
                                     uint32_t num_counters, const struct xport_hostile_opts *o);
/* Stops the delivery thread (after delivering what is queued) and releases everything. */
void xport_test_free(struct xport *xp);

/* Waits until every queued operation has been delivered. */
void xport_test_quiesce(struct xport *xp);
uint8_t *xport_test_window(struct xport *xp, uint32_t ep);

struct xport_test_stats {
        uint64_t puts, pieces, signals;
        /* Deliveries that overtook an operation issued earlier from the same source to the same
         * destination: proof that the order was broken. */
        uint64_t overtakes;
};

void xport_test_stats(struct xport *xp, struct xport_test_stats *out);

#endif
