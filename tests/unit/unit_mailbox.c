/* unit_mailbox.c - the daemon's side of the reply mailbox (daemon/net/mailbox.c, common/doorbell.h).
 *
 * Covers: a reply posted into a page decodes to the same reply record (common/oprec.h), with
 * reply_id, reply_len and reply_seq published; a reply too large for the page is not written but
 * announced
 * (EPD_MAILBOX_ON_SOCKET, -EMSGSIZE) with the page's previous bytes left alone; a reply that
 * fills the page exactly still goes in; a thread sleeping on reply_seq's futex under the client's
 * protocol (waiting flag, re-check, FUTEX_WAIT) is woken by a post, so no wake-up is lost; the
 * nudge at an op's start moves reply_seq, wakes a client that polls after wake-ups and leaves
 * one that does not asleep until its reply; the `completed` word is never lowered by a store
 * that lags another writer's.
 * Request mailbox (the client's half in common/doorbell.h): a posted request is copied out and
 * the slot emptied; a length of 0 or beyond the box is refused and the slot emptied; a request
 * posted after the daemon stopped looking is taken back; the box is closed while the daemon
 * does not look, while a request is in it, and while the daemon has not read the client's
 * socket up to its last frame; and two threads playing client and daemon, the daemon starting
 * and stopping its polling at random, never lose or duplicate a request.
 * Each test runs in its own process (fork mode).
 */
#include <check.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mailbox.h"

static struct epd_doorbell *page_new(void)
{
        void *p = mmap(NULL, EPD_DOORBELL_BYTES, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        ck_assert_ptr_ne(p, MAP_FAILED);
        return p;
}

/* A failed op's reply whose message has `len` characters. */
static void reply_with(struct epd_op_reply *r, char *msg, size_t len, uint64_t id)
{
        memset(r, 0, sizeof(*r));
        memset(msg, 'm', len);
        msg[len] = '\0';
        r->id = id;
        r->kind = EPD_OPREC_COMBINE;
        r->status = EPD_INVALID_ARGUMENT;
        r->message = msg;
}

START_TEST(test_post_and_decode)
{
        struct epd_doorbell *db = page_new();
        struct epd_op_reply r, u;
        char msg[128], err[160];

        reply_with(&r, msg, 100, 42);
        ck_assert_int_eq(epd_mailbox_post(db, &r), 0);
        ck_assert_uint_eq(db->reply_id, 42);
        ck_assert_uint_eq(db->reply_seq, 1);
        ck_assert_uint_eq(db->reply_len, EPD_OPREC_REPLY_HEADER_BYTES + 101);
        ck_assert_int_eq(epd_oprec_reply_decode(db->reply, db->reply_len, &u, err, sizeof(err)),
                         0);
        ck_assert_uint_eq(u.id, 42);
        ck_assert_int_eq(u.status, EPD_INVALID_ARGUMENT);
        ck_assert_str_eq(u.message, msg);
        /* The next reply replaces it. */
        reply_with(&r, msg, 3, 43);
        ck_assert_int_eq(epd_mailbox_post(db, &r), 0);
        ck_assert_uint_eq(db->reply_id, 43);
        ck_assert_uint_eq(db->reply_seq, 2);
        ck_assert_int_eq(epd_oprec_reply_decode(db->reply, db->reply_len, &u, err, sizeof(err)),
                         0);
        ck_assert_str_eq(u.message, "mmm");
}
END_TEST

START_TEST(test_too_large_goes_to_socket)
{
        struct epd_doorbell *db = page_new();
        const size_t cap = EPD_MAILBOX_CAPACITY(EPD_DOORBELL_BYTES);
        /* A dispatch reply of one rank with L local experts carries 2 L + 2 counts: the L that
         * fills the page exactly. */
        const uint32_t L = (uint32_t)((cap - EPD_OPREC_REPLY_HEADER_BYTES) / 4 - 2) / 2;
        int32_t *counts = calloc(2 * (size_t)L + 8, sizeof(int32_t));
        struct epd_op_reply r;

        ck_assert_ptr_nonnull(counts);
        ck_assert_uint_gt(cap, 8192);
        memset(&r, 0, sizeof(r));
        r.kind = EPD_OPREC_DISPATCH;
        r.id = 7;
        r.num_local_experts = L;
        r.world_size = 1;
        r.per_expert = counts;
        r.per_expert_aligned = counts;
        r.rank_prefix = counts;
        ck_assert_uint_eq(epd_oprec_reply_bytes(&r), cap);
        ck_assert_int_eq(epd_mailbox_post(db, &r), 0);
        ck_assert_uint_eq(db->reply_len, cap);
        ck_assert_uint_eq(db->reply_id, 7);
        uint8_t last = db->reply[cap - 1];

        /* One expert more does not fit: announced, nothing written. */
        r.id = 8;
        r.num_local_experts = L + 1;
        for (uint32_t i = 0; i < 2 * L + 8; i++)
                counts[i] = 0x78787878; /* would show in the page if it were copied */
        ck_assert_int_eq(epd_mailbox_post(db, &r), -EMSGSIZE);
        ck_assert_uint_eq(db->reply_len, EPD_MAILBOX_ON_SOCKET);
        ck_assert_uint_eq(db->reply_id, 8);
        ck_assert_uint_eq(db->reply_seq, 2);
        ck_assert_uint_eq(db->reply[cap - 1], last);
        ck_assert_ptr_null(memchr(db->reply, 0x78, cap));
        free(counts);
}
END_TEST

struct sleeper {
        struct epd_doorbell *db;
        uint64_t id;
        int woken;     /* saw the reply */
        int slept;     /* entered FUTEX_WAIT at least once */
};

/* The client's sleep protocol (client/ops.c, mailbox_wait), with 10 s naps: a lost wake-up
 * shows as a test timeout. */
static void *sleeper_main(void *arg)
{
        struct sleeper *s = arg;
        struct epd_doorbell *db = s->db;

        while (__atomic_load_n(&db->reply_id, __ATOMIC_ACQUIRE) != s->id) {
                const uint32_t seq = __atomic_load_n(&db->reply_seq, __ATOMIC_ACQUIRE);
                __atomic_store_n(&db->waiting, EPD_MAILBOX_WAKE_AT_REPLY, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&db->reply_id, __ATOMIC_SEQ_CST) != s->id) {
                        struct timespec ts = { 10, 0 };
                        __atomic_store_n(&s->slept, 1, __ATOMIC_SEQ_CST);
                        (void)syscall(SYS_futex, &db->reply_seq, FUTEX_WAIT, seq, &ts, NULL, 0);
                }
                __atomic_store_n(&db->waiting, 0, __ATOMIC_RELAXED);
        }
        s->woken = 1;
        return NULL;
}

static double now_s(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + ts.tv_nsec / 1e9;
}

START_TEST(test_sleeper_is_woken)
{
        for (int round = 0; round < 200; round++) {
                struct epd_doorbell *db = page_new();
                struct sleeper s = { db, 1000 + (uint64_t)round, 0, 0 };
                struct epd_op_reply r;
                char msg[8];
                pthread_t th;

                ck_assert_int_eq(pthread_create(&th, NULL, sleeper_main, &s), 0);
                /* Half the rounds post while the sleeper is (most likely) asleep, half race
                 * with it going to sleep. */
                if (round % 2 == 0)
                        while (!__atomic_load_n(&s.slept, __ATOMIC_SEQ_CST))
                                usleep(100);
                reply_with(&r, msg, 4, s.id);
                const double t0 = now_s();
                ck_assert_int_eq(epd_mailbox_post(db, &r), 0);
                ck_assert_int_eq(pthread_join(th, NULL), 0);
                ck_assert_int_eq(s.woken, 1);
                /* Well under the sleeper's 10 s nap: the post woke it. */
                ck_assert_msg(now_s() - t0 < 5.0, "round %d: the sleeper was not woken", round);
                munmap(db, EPD_DOORBELL_BYTES);
        }
}
END_TEST

struct napper {
        struct epd_doorbell *db;
        uint32_t level;
        int asleep;    /* about to call FUTEX_WAIT */
        int returned;  /* FUTEX_WAIT returned */
};

/* One sleep on reply_seq with `waiting` at the given level, 10 s at most. */
static void *napper_main(void *arg)
{
        struct napper *n = arg;
        const uint32_t seq = __atomic_load_n(&n->db->reply_seq, __ATOMIC_ACQUIRE);
        struct timespec ts = { 10, 0 };

        __atomic_store_n(&n->db->waiting, n->level, __ATOMIC_SEQ_CST);
        __atomic_store_n(&n->asleep, 1, __ATOMIC_SEQ_CST);
        (void)syscall(SYS_futex, &n->db->reply_seq, FUTEX_WAIT, seq, &ts, NULL, 0);
        __atomic_store_n(&n->returned, 1, __ATOMIC_SEQ_CST);
        return NULL;
}

START_TEST(test_nudge_wakes_only_pollers)
{
        struct epd_doorbell *db = page_new();
        struct epd_op_reply r;
        char msg[8];
        pthread_t th;

        /* Nobody sleeps: the sequence moves, the reply slot does not. */
        epd_mailbox_nudge(db);
        ck_assert_uint_eq(db->reply_seq, 1);
        ck_assert_uint_eq(db->reply_id, 0);

        /* A client that polls after a wake-up is woken when its op starts. */
        struct napper a = { db, EPD_MAILBOX_WAKE_AT_START, 0, 0 };
        ck_assert_int_eq(pthread_create(&th, NULL, napper_main, &a), 0);
        while (!__atomic_load_n(&a.asleep, __ATOMIC_SEQ_CST))
                usleep(100);
        usleep(50000);
        const double t0 = now_s();
        epd_mailbox_nudge(db);
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        ck_assert_msg(now_s() - t0 < 5.0, "the polling client was not woken at the start");

        /* One that does not poll sleeps on until its reply. */
        struct napper b = { db, EPD_MAILBOX_WAKE_AT_REPLY, 0, 0 };
        ck_assert_int_eq(pthread_create(&th, NULL, napper_main, &b), 0);
        while (!__atomic_load_n(&b.asleep, __ATOMIC_SEQ_CST))
                usleep(100);
        usleep(50000);
        epd_mailbox_nudge(db);
        usleep(300000);
        ck_assert_msg(!__atomic_load_n(&b.returned, __ATOMIC_SEQ_CST),
                      "a client that does not poll was woken at the start");
        reply_with(&r, msg, 4, 99);
        ck_assert_int_eq(epd_mailbox_post(db, &r), 0);
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        ck_assert_int_eq(b.returned, 1);
        munmap(db, EPD_DOORBELL_BYTES);
}
END_TEST

/* `completed` has two writers (the CUDA executor at an op's end event, the loop thread when it
 * takes the completion or counts a refused submission): a lagging store must not lower it. */
START_TEST(test_completed_never_lowers)
{
        struct epd_doorbell *db = page_new();

        epd_doorbell_advance(&db->completed, 5);
        ck_assert_uint_eq(db->completed, 5);
        epd_doorbell_advance(&db->completed, 4); /* the loop's count, behind the executor's */
        ck_assert_uint_eq(db->completed, 5);
        epd_doorbell_advance(&db->completed, 5);
        ck_assert_uint_eq(db->completed, 5);
        epd_doorbell_advance(&db->completed, 6);
        ck_assert_uint_eq(db->completed, 6);
        munmap(db, EPD_DOORBELL_BYTES);
}
END_TEST

static struct epd_request_box *box_of(struct epd_doorbell *db)
{
        struct epd_request_box *box = epd_doorbell_request_box(db, EPD_DOORBELL_BYTES);
        ck_assert_ptr_nonnull(box);
        /* The reply area ends where the box begins. */
        ck_assert_ptr_eq(db->reply + EPD_MAILBOX_CAPACITY(EPD_DOORBELL_BYTES), (void *)box);
        return box;
}

/* The client's side: writes n bytes of `fill` and publishes them. */
static int client_post(struct epd_request_box *box, uint32_t n, uint8_t fill)
{
        memset(box->bytes, fill, n);
        box->len = n;
        return epd_request_publish(box);
}

START_TEST(test_request_take)
{
        struct epd_doorbell *db = page_new();
        struct epd_request_box *box = box_of(db);
        uint8_t buf[EPD_REQUEST_CAPACITY];
        size_t len = 0;

        epd_mailbox_set_polling(db, 1);
        ck_assert_int_eq(client_post(box, 100, 0xab), 1);
        ck_assert_uint_eq(box->state, EPD_REQUEST_POSTED);
        ck_assert_int_eq(epd_mailbox_take(db, buf, sizeof(buf), &len), 1);
        ck_assert_uint_eq(len, 100);
        for (int i = 0; i < 100; i++)
                ck_assert_uint_eq(buf[i], 0xab);
        ck_assert_uint_eq(box->state, EPD_REQUEST_EMPTY);
        ck_assert_int_eq(epd_mailbox_take(db, buf, sizeof(buf), &len), 0);
        /* The largest request fits exactly. */
        ck_assert_int_eq(client_post(box, EPD_REQUEST_CAPACITY, 0x11), 1);
        ck_assert_int_eq(epd_mailbox_take(db, buf, sizeof(buf), &len), 1);
        ck_assert_uint_eq(len, EPD_REQUEST_CAPACITY);
        ck_assert_uint_eq(buf[EPD_REQUEST_CAPACITY - 1], 0x11);
        munmap(db, EPD_DOORBELL_BYTES);
}
END_TEST

START_TEST(test_request_bad_length)
{
        struct epd_doorbell *db = page_new();
        struct epd_request_box *box = box_of(db);
        uint8_t buf[EPD_REQUEST_CAPACITY + 64];
        size_t len = 0;

        memset(buf, 0x5a, sizeof(buf));
        epd_mailbox_set_polling(db, 1);
        ck_assert_int_eq(client_post(box, 0, 0), 1);
        ck_assert_int_eq(epd_mailbox_take(db, buf, sizeof(buf), &len), -EMSGSIZE);
        ck_assert_uint_eq(len, 0);
        ck_assert_uint_eq(box->state, EPD_REQUEST_EMPTY);
        /* A length beyond the box: nothing copied, even into a larger buffer. */
        ck_assert_int_eq(client_post(box, 16, 0x77), 1);
        box->len = EPD_REQUEST_CAPACITY + 1;
        ck_assert_int_eq(epd_mailbox_take(db, buf, sizeof(buf), &len), -EMSGSIZE);
        ck_assert_uint_eq(len, EPD_REQUEST_CAPACITY + 1);
        ck_assert_uint_eq(buf[0], 0x5a);
        ck_assert_uint_eq(box->state, EPD_REQUEST_EMPTY);
        /* Or beyond the caller's buffer. */
        ck_assert_int_eq(client_post(box, 64, 0x77), 1);
        ck_assert_int_eq(epd_mailbox_take(db, buf, 32, &len), -EMSGSIZE);
        ck_assert_uint_eq(buf[0], 0x5a);
        munmap(db, EPD_DOORBELL_BYTES);
}
END_TEST

START_TEST(test_request_taken_back_and_open)
{
        struct epd_doorbell *db = page_new();
        struct epd_request_box *box = box_of(db);
        uint8_t buf[64];
        size_t len = 0;

        /* Not polling: closed, and a post that raced with the stop is taken back. */
        ck_assert_int_eq(epd_request_box_open(box, 0), 0);
        ck_assert_int_eq(client_post(box, 10, 1), 0);
        ck_assert_uint_eq(box->state, EPD_REQUEST_EMPTY);
        ck_assert_int_eq(epd_mailbox_take(db, buf, sizeof(buf), &len), 0);

        epd_mailbox_set_polling(db, 1);
        epd_mailbox_set_read_id(db, 7);
        ck_assert_int_eq(epd_request_box_open(box, 7), 1);
        /* A frame the daemon has not read yet (id 8) keeps the box closed: order. */
        ck_assert_int_eq(epd_request_box_open(box, 8), 0);
        epd_mailbox_set_read_id(db, 8);
        ck_assert_int_eq(epd_request_box_open(box, 8), 1);
        /* A request in the box keeps it closed until the daemon takes it. */
        ck_assert_int_eq(client_post(box, 10, 2), 1);
        ck_assert_int_eq(epd_request_box_open(box, 8), 0);
        ck_assert_int_eq(epd_mailbox_take(db, buf, sizeof(buf), &len), 1);
        ck_assert_int_eq(epd_request_box_open(box, 8), 1);
        munmap(db, EPD_DOORBELL_BYTES);
}
END_TEST

#define HANDSHAKE_REQUESTS 200000u

struct handshake {
        struct epd_doorbell *db;
        uint8_t *taken;       /* per request, by the daemon's thread: it took it */
        uint8_t *outcome;     /* by the client's: 1 publish kept it, 2 it was taken back */
        unsigned taken_total; /* the daemon's thread's count */
        unsigned back_total;  /* the client's count of requests taken back */
        int client_done;
        const char *failure;
};

/* Request i's 4 bytes, stored and read byte by byte with atomics: handshake_check_left peeks at
 * a box that the client may be refilling (it checks the state again afterwards), a race the
 * test makes on purpose and ThreadSanitizer must not report. */
static void racy_store_u32(uint8_t *p, uint32_t v)
{
        for (int k = 0; k < 4; k++)
                __atomic_store_n(p + k, (uint8_t)(v >> (8 * k)), __ATOMIC_RELAXED);
}

static uint32_t racy_load_u32(const uint8_t *p)
{
        uint32_t v = 0;

        for (int k = 0; k < 4; k++)
                v |= (uint32_t)__atomic_load_n(p + k, __ATOMIC_RELAXED) << (8 * k);
        return v;
}

/* The client posts request i as 4 bytes holding i whenever the box is empty, whether or not
 * the daemon polls (so that the take-back races with the daemon's last look). */
static void *handshake_client(void *arg)
{
        struct handshake *h = arg;
        struct epd_request_box *box = epd_doorbell_request_box(h->db, EPD_DOORBELL_BYTES);

        for (uint32_t i = 0;
             i < HANDSHAKE_REQUESTS && !__atomic_load_n(&h->failure, __ATOMIC_SEQ_CST); i++) {
                while (__atomic_load_n(&box->state, __ATOMIC_ACQUIRE) != EPD_REQUEST_EMPTY &&
                       !__atomic_load_n(&h->failure, __ATOMIC_SEQ_CST))
                        ;
                racy_store_u32(box->bytes, i);
                box->len = sizeof(i);
                const int kept = epd_request_publish(box);
                __atomic_store_n(&h->outcome[i], kept ? 1 : 2, __ATOMIC_SEQ_CST);
                if (!kept)
                        __atomic_add_fetch(&h->back_total, 1, __ATOMIC_SEQ_CST);
        }
        __atomic_store_n(&h->client_done, 1, __ATOMIC_SEQ_CST);
        return NULL;
}

static void handshake_take(struct handshake *h)
{
        uint8_t buf[16];
        size_t len;
        uint32_t i;

        if (epd_mailbox_take(h->db, buf, sizeof(buf), &len) == 1) {
                i = racy_load_u32(buf);
                h->taken[i]++;
                h->taken_total++;
        }
}

/* After the daemon's last look with polling = 0 nothing takes requests: one still posted once
 * its publish returned "kept" was left behind. */
static void handshake_check_left(struct handshake *h)
{
        struct epd_request_box *box = epd_doorbell_request_box(h->db, EPD_DOORBELL_BYTES);
        uint32_t i;

        if (__atomic_load_n(&box->state, __ATOMIC_SEQ_CST) != EPD_REQUEST_POSTED)
                return;
        i = racy_load_u32(box->bytes);
        if (i >= HANDSHAKE_REQUESTS)
                return;
        const double t0 = now_s();
        while (!__atomic_load_n(&h->outcome[i], __ATOMIC_SEQ_CST) && now_s() - t0 < 1.0)
                ;
        if (__atomic_load_n(&h->outcome[i], __ATOMIC_SEQ_CST) == 1 &&
            __atomic_load_n(&box->state, __ATOMIC_SEQ_CST) == EPD_REQUEST_POSTED &&
            racy_load_u32(box->bytes) == i)
                __atomic_store_n(&h->failure, "a request kept by publish was left in the box",
                                 __ATOMIC_SEQ_CST);
}

/* One run of the handshake race; every request must have exactly one owner. Counts the two
 * outcomes. */
static void handshake_run(unsigned seed, unsigned *kept_out, unsigned *back_out)
{
        struct handshake h = { page_new(), calloc(HANDSHAKE_REQUESTS, 1),
                               calloc(HANDSHAKE_REQUESTS, 1), 0, 0, 0, NULL };
        pthread_t th;

        ck_assert_ptr_nonnull(h.taken);
        ck_assert_ptr_nonnull(h.outcome);
        ck_assert_int_eq(pthread_create(&th, NULL, handshake_client, &h), 0);
        while (!__atomic_load_n(&h.client_done, __ATOMIC_SEQ_CST) &&
               !__atomic_load_n(&h.failure, __ATOMIC_SEQ_CST)) {
                /* Polling until a request was taken (or 20 ms) and a random while more, then
                 * stopping with the last look, as the loop thread does
                 * (daemon/backend/backend.c, daemon/net/conn.c); then not polling until the
                 * client took a request back (or 20 ms), so that both outcomes occur however
                 * the two threads are scheduled. */
                const unsigned t0 = h.taken_total;
                double until = now_s() + 0.02;
                epd_mailbox_set_polling(h.db, 1);
                while (h.taken_total == t0 && !__atomic_load_n(&h.client_done, __ATOMIC_SEQ_CST) &&
                       now_s() < until)
                        handshake_take(&h);
                for (unsigned k = rand_r(&seed) % 200; k > 0; k--)
                        handshake_take(&h);
                epd_mailbox_set_polling(h.db, 0);
                handshake_take(&h);
                if (rand_r(&seed) % 16 == 0)
                        handshake_check_left(&h);
                const unsigned b0 = __atomic_load_n(&h.back_total, __ATOMIC_SEQ_CST);
                until = now_s() + 0.02;
                while (__atomic_load_n(&h.back_total, __ATOMIC_SEQ_CST) == b0 &&
                       !__atomic_load_n(&h.client_done, __ATOMIC_SEQ_CST) && now_s() < until)
                        ;
        }
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        ck_assert_msg(h.failure == NULL, "%s", h.failure);
        handshake_take(&h);
        unsigned kept = 0, back = 0;
        for (uint32_t i = 0; i < HANDSHAKE_REQUESTS; i++) {
                /* Exactly one owner: the daemon took it, or the client took it back. */
                const int ok = (h.outcome[i] == 1 && h.taken[i] == 1) ||
                               (h.outcome[i] == 2 && h.taken[i] == 0);
                ck_assert_msg(ok, "request %u: publish said %s, the daemon took it %u times", i,
                              h.outcome[i] == 1 ? "kept" : "taken back", h.taken[i]);
                kept += h.outcome[i] == 1;
                back += h.outcome[i] == 2;
        }
        *kept_out = kept;
        *back_out = back;
        free(h.taken);
        free(h.outcome);
        munmap(h.db, EPD_DOORBELL_BYTES);
}

START_TEST(test_request_handshake)
{
        unsigned kept = 0, back = 0;

        /* Both outcomes must happen, so that the race is exercised; on a loaded machine one
         * run may see only one of them, so a few runs may be needed. */
        for (unsigned run = 0; run < 8 && (kept == 0 || back == 0); run++) {
                unsigned k, b;
                handshake_run(12345 + run, &k, &b);
                kept += k;
                back += b;
        }
        ck_assert_uint_gt(kept, 0);
        ck_assert_uint_gt(back, 0);
}
END_TEST

int main(void)
{
        Suite *su = suite_create("unit_mailbox");
        TCase *tc = tcase_create("mailbox");
        SRunner *sr;
        int failed;

        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_post_and_decode);
        tcase_add_test(tc, test_too_large_goes_to_socket);
        tcase_add_test(tc, test_sleeper_is_woken);
        tcase_add_test(tc, test_nudge_wakes_only_pollers);
        tcase_add_test(tc, test_completed_never_lowers);
        tcase_add_test(tc, test_request_take);
        tcase_add_test(tc, test_request_bad_length);
        tcase_add_test(tc, test_request_taken_back_and_open);
        tcase_add_test(tc, test_request_handshake);
        suite_add_tcase(su, tc);
        sr = srunner_create(su);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
