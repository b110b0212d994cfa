/* xport_test.c - the ordered and hostile test transports (xport_test.h).
 *
 * The hostile transport's queue, windows and random generator are guarded by one mutex: load
 * copies under it, so a reader sees every piece delivered so far and none half-copied, which
 * keeps the test transport free of data races (ThreadSanitizer) while a chunk may still be torn
 * across pieces. Counters are atomics, read without the mutex.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testdata.h"
#include "xport_test.h"

struct item {
        int is_signal;
        uint32_t src, dst, counter;
        uint64_t off, len, add;
        uint64_t seq;           /* issue order of the (src, dst) pair */
        uint8_t *data;          /* owned piece bytes */
};

struct test_xport {
        struct xport base;      /* first: the struct xport * is this */
        int hostile;
        uint8_t **win;
        _Atomic uint64_t *ctr;  /* [endpoints * num_counters] */
        struct xport_hostile_opts o;

        pthread_mutex_t lock;
        pthread_cond_t more, drained;
        pthread_t thread;
        int stop;
        struct td_rng rng;
        struct item *q;
        size_t nq, cap;
        uint64_t *issued, *delivered_max;       /* [endpoints^2] */
        struct xport_test_stats stats;
};

static struct test_xport *tx_of(struct xport *xp)
{
        return (struct test_xport *)xp;
}

/* ---- ordered ---- */

static int ord_put(struct xport *xp, uint32_t src, uint32_t dst, uint64_t off, const void *data,
                   uint64_t len)
{
        struct test_xport *t = tx_of(xp);

        (void)src;
        memcpy(t->win[dst] + off, data, len);
        return 0;
}

static int ord_signal(struct xport *xp, uint32_t src, uint32_t dst, uint32_t counter,
                      uint64_t add)
{
        struct test_xport *t = tx_of(xp);

        (void)src;
        atomic_fetch_add_explicit(&t->ctr[(size_t)dst * xp->num_counters + counter], add,
                                  memory_order_release);
        return 0;
}

static void ord_load(struct xport *xp, uint32_t ep, uint64_t off, void *out, uint64_t len)
{
        memcpy(out, tx_of(xp)->win[ep] + off, len);
}

static uint64_t any_counter(struct xport *xp, uint32_t ep, uint32_t counter)
{
        return atomic_load_explicit(&tx_of(xp)->ctr[(size_t)ep * xp->num_counters + counter],
                                    memory_order_acquire);
}

static const struct xport_ops ordered_ops = { ord_put, ord_signal, ord_load, any_counter };

/* ---- hostile ---- */

static int enqueue(struct test_xport *t, struct item it)
{
        if (t->nq == t->cap) {
                size_t cap = t->cap ? t->cap * 2 : 256;
                struct item *q = realloc(t->q, cap * sizeof(*q));

                if (!q)
                        return -1;
                t->q = q;
                t->cap = cap;
        }
        it.seq = t->issued[(size_t)it.src * t->base.endpoints + it.dst]++;
        t->q[t->nq++] = it;
        pthread_cond_signal(&t->more);
        return 0;
}

static int hos_put(struct xport *xp, uint32_t src, uint32_t dst, uint64_t off, const void *data,
                   uint64_t len)
{
        struct test_xport *t = tx_of(xp);
        uint32_t max_piece = t->o.max_piece ? t->o.max_piece : 256;
        int ret = 0;

        pthread_mutex_lock(&t->lock);
        t->stats.puts++;
        for (uint64_t done = 0; done < len && !ret;) {
                uint64_t n = 1 + td_rng_below(&t->rng, max_piece);
                struct item it = { .src = src, .dst = dst, .off = off + done };

                if (n > len - done)
                        n = len - done;
                it.len = n;
                it.data = malloc(n);
                if (!it.data) {
                        ret = -1;
                        break;
                }
                memcpy(it.data, (const uint8_t *)data + done, n);
                ret = enqueue(t, it);
                if (ret)
                        free(it.data);
                t->stats.pieces++;
                done += n;
        }
        pthread_mutex_unlock(&t->lock);
        return ret;
}

static int hos_signal(struct xport *xp, uint32_t src, uint32_t dst, uint32_t counter,
                      uint64_t add)
{
        struct test_xport *t = tx_of(xp);
        struct item it = { .is_signal = 1, .src = src, .dst = dst, .counter = counter,
                           .add = add };
        int ret;

        pthread_mutex_lock(&t->lock);
        t->stats.signals++;
        ret = enqueue(t, it);
        pthread_mutex_unlock(&t->lock);
        return ret;
}

static void hos_load(struct xport *xp, uint32_t ep, uint64_t off, void *out, uint64_t len)
{
        struct test_xport *t = tx_of(xp);

        pthread_mutex_lock(&t->lock);
        memcpy(out, t->win[ep] + off, len);
        pthread_mutex_unlock(&t->lock);
}

static const struct xport_ops hostile_ops = { hos_put, hos_signal, hos_load, any_counter };

/* Picks the next item: a pending signal first when signals_first, else any, at random. */
static size_t pick(struct test_xport *t)
{
        size_t start = td_rng_below(&t->rng, (uint32_t)(t->nq < UINT32_MAX ? t->nq : UINT32_MAX));

        if (t->o.signals_first)
                for (size_t i = 0; i < t->nq; i++) {
                        size_t j = (start + i) % t->nq;

                        if (t->q[j].is_signal)
                                return j;
                }
        return start;
}

static void *deliver_thread(void *arg)
{
        struct test_xport *t = arg;

        pthread_mutex_lock(&t->lock);
        for (;;) {
                struct item it;
                uint64_t *max;
                uint32_t pause = 0;
                size_t i;

                while (t->nq == 0 && !t->stop) {
                        pthread_cond_broadcast(&t->drained);
                        pthread_cond_wait(&t->more, &t->lock);
                }
                if (t->nq == 0)
                        break;
                i = pick(t);
                it = t->q[i];
                t->q[i] = t->q[--t->nq];
                max = &t->delivered_max[(size_t)it.src * t->base.endpoints + it.dst];
                if (it.seq < *max)
                        t->stats.overtakes++;
                else
                        *max = it.seq;
                if (it.is_signal) {
                        atomic_fetch_add_explicit(
                                &t->ctr[(size_t)it.dst * t->base.num_counters + it.counter],
                                it.add, memory_order_release);
                } else {
                        memcpy(t->win[it.dst] + it.off, it.data, it.len);
                        free(it.data);
                }
                if (t->o.max_delay_us && td_rng_below(&t->rng, 16) == 0)
                        pause = td_rng_below(&t->rng, t->o.max_delay_us + 1);
                if (pause) {
                        struct timespec ts = { 0, (long)pause * 1000 };

                        pthread_mutex_unlock(&t->lock);
                        nanosleep(&ts, NULL);
                        pthread_mutex_lock(&t->lock);
                }
        }
        pthread_cond_broadcast(&t->drained);
        pthread_mutex_unlock(&t->lock);
        return NULL;
}

/* ---- both ---- */

static struct test_xport *tx_new(uint32_t endpoints, uint64_t window_bytes, uint32_t num_counters)
{
        struct test_xport *t = calloc(1, sizeof(*t));

        if (!t)
                return NULL;
        pthread_mutex_init(&t->lock, NULL);
        pthread_cond_init(&t->more, NULL);
        pthread_cond_init(&t->drained, NULL);
        t->base.endpoints = endpoints;
        t->base.window_bytes = window_bytes;
        t->base.num_counters = num_counters;
        t->win = calloc(endpoints, sizeof(*t->win));
        t->ctr = calloc((size_t)endpoints * num_counters + 1, sizeof(*t->ctr));
        t->issued = calloc((size_t)endpoints * endpoints, sizeof(*t->issued));
        t->delivered_max = calloc((size_t)endpoints * endpoints, sizeof(*t->delivered_max));
        if (!t->win || !t->ctr || !t->issued || !t->delivered_max) {
                xport_test_free(&t->base);
                return NULL;
        }
        for (uint32_t e = 0; e < endpoints; e++) {
                t->win[e] = calloc(window_bytes ? window_bytes : 1, 1);
                if (!t->win[e]) {
                        xport_test_free(&t->base);
                        return NULL;
                }
        }
        return t;
}

struct xport *xport_test_ordered_new(uint32_t endpoints, uint64_t window_bytes,
                                     uint32_t num_counters)
{
        struct test_xport *t = tx_new(endpoints, window_bytes, num_counters);

        if (!t)
                return NULL;
        t->base.ops = &ordered_ops;
        t->base.ordered = 1;
        return &t->base;
}

struct xport *xport_test_hostile_new(uint32_t endpoints, uint64_t window_bytes,
                                     uint32_t num_counters, const struct xport_hostile_opts *o)
{
        struct test_xport *t = tx_new(endpoints, window_bytes, num_counters);

        if (!t)
                return NULL;
        t->base.ops = &hostile_ops;
        t->base.ordered = 0;
        t->hostile = 1;
        if (o)
                t->o = *o;
        td_rng_seed(&t->rng, t->o.seed);
        if (pthread_create(&t->thread, NULL, deliver_thread, t)) {
                t->hostile = 0;
                xport_test_free(&t->base);
                return NULL;
        }
        return &t->base;
}

void xport_test_quiesce(struct xport *xp)
{
        struct test_xport *t = tx_of(xp);

        if (!t->hostile)
                return;
        pthread_mutex_lock(&t->lock);
        while (t->nq)
                pthread_cond_wait(&t->drained, &t->lock);
        pthread_mutex_unlock(&t->lock);
}

uint8_t *xport_test_window(struct xport *xp, uint32_t ep)
{
        return tx_of(xp)->win[ep];
}

void xport_test_stats(struct xport *xp, struct xport_test_stats *out)
{
        struct test_xport *t = tx_of(xp);

        pthread_mutex_lock(&t->lock);
        *out = t->stats;
        pthread_mutex_unlock(&t->lock);
}

void xport_test_free(struct xport *xp)
{
        struct test_xport *t = tx_of(xp);

        if (!xp)
                return;
        if (t->hostile) {
                pthread_mutex_lock(&t->lock);
                t->stop = 1;
                pthread_cond_signal(&t->more);
                pthread_mutex_unlock(&t->lock);
                pthread_join(t->thread, NULL);
        }
        pthread_mutex_destroy(&t->lock);
        pthread_cond_destroy(&t->more);
        pthread_cond_destroy(&t->drained);
        for (uint32_t e = 0; t->win && e < xp->endpoints; e++)
                free(t->win[e]);
        for (size_t i = 0; i < t->nq; i++)
                free(t->q[i].data);
        free(t->q);
        free(t->win);
        free((void *)t->ctr);
        free(t->issued);
        free(t->delivered_max);
        free(t);
}
