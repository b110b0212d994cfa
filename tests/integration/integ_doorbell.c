/* integ_doorbell.c - the doorbell page through the real daemon (host backend): `completed`
 * counts a rank's finished ops in order, a request with wait_inputs is held until the client
 * marks its inputs ready, and a mark that never comes turns into TIMEOUT instead of a hang.
 * The reply mailbox: replies (results and failures) come through the page by default and are
 * counted by the daemon, each op nudges the page when it starts, EPD_CLIENT_REPLY=socket turns
 * it off and a bad value is refused, a second op submitted while the first still waits for its
 * page reply gets its reply on the socket, a client that asks for a second page reply anyway is
 * refused with a clear error, a wait on the page times out and resumes, and a daemon killed
 * during such a wait fails it promptly instead of hanging it.
 * The request mailbox: while the daemon polls, requests go through the page, are counted, and
 * give the same results as on the socket; EPD_CLIENT_REQUEST=socket turns it off and a bad value
 * is refused; a frame sent on the socket while a request waits in the page is handled after it;
 * and a page holding garbage, an oversized length, a protobuf message, an op record of another
 * rank, or a record that fails its checks (short, unknown kind, version or flags, too many dims,
 * an unused bias slot) closes that client's connection with a clear error while the daemon goes
 * on. Reply records say the same through the page as on the socket. */
#include <check.h>
#include <jansson.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "doorbell.h"
#include "client_internal.h"
#include "harness.h"
#include "oprec.h"
#include "workload.h"

static const struct wl_case base_case = {
        "doorbell", 301, 1, 8, 64, 16, 2, EPD_DTYPE_BF16, EPD_DTYPE_INT64, EPD_LAYOUT_NON_EXPAND,
        1, 0, 1, TD_ROUTING_UNIFORM, 0.0, WL_TOKENS_FULL, 0, 0, 1, 0, 1, 0, 0, 0,
};

struct setup {
        struct h_daemon d;
        struct epd_client *c;
        struct epd_group *g;
        struct wl_inputs in;
        struct epd_dispatch_args da;
        int64_t *topk_ptr;
        uint8_t *base;                /* the region of x and top-k, with room for outputs */
};

static double now_ms(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The completed op's timeline. */
static struct epd_op_timeline timeline_of(const struct epd_op *op)
{
        struct epd_op_timeline tl = { .size = sizeof(tl) };

        ck_assert_int_eq(epd_op_timeline(op, &tl), 0);
        return tl;
}

/* Whether the op's reply, and its request, went through the doorbell page. */
static int via_page(const struct epd_op *op)
{
        return (int)timeline_of(op).reply_in_doorbell;
}

/* 1: the request went through the page, 0: on the socket. */
static int request_via_page(const struct epd_op *op)
{
        return (int)timeline_of(op).request_in_doorbell;
}

/* One of the daemon's counters (epctl stats --json): mailbox_replies, mailbox_requests,
 * protocol_errors. */
static long long stat_of(const struct h_daemon *d, const char *name)
{
        json_t *j = h_epctl_json(d, "stats");
        json_t *v = json_object_get(j, name);
        ck_assert_msg(json_is_integer(v), "epctl stats --json has no %s", name);
        long long n = json_integer_value(v);
        json_decref(j);
        return n;
}

/* With name=value in the environment, a connect fails with a message naming the variable;
 * the variable is unset afterwards. */
static void refuse_bad_env(const struct h_daemon *d, const char *name, const char *value)
{
        struct epd_connect_args args = { .size = sizeof(args), .socket_path = d->socket,
                                         .client_name = "bad-env", .timeout_ms = 5000 };
        struct epd_client *c = NULL;
        char err[512] = "";

        setenv(name, value, 1);
        ck_assert_int_eq(epd_client_connect(&args, &c, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(err, name) != NULL, "message: %s", err);
        unsetenv(name);
}

static void setup_group_with(struct setup *s, uint32_t timeout_ms, const char *const *daemon_args)
{
        const struct wl_case *c = &base_case;
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = 1, .num_experts = c->num_experts,
                .hidden = c->hidden, .max_tokens_per_rank = c->max_tokens, .max_topk = c->num_topk,
                .dispatch_dtype = EPD_DTYPE_BF16, .op_timeout_ms = timeout_ms,
                .arena_bytes = 1 << 20,
        };
        void *p;
        uint64_t region;

        ck_assert_int_eq(h_daemon_start(&s->d, daemon_args), 0);
        s->c = h_connect(&s->d, "doorbell");
        ck_assert_ptr_nonnull(s->c);
        ck_assert_int_eq(wl_enter_group(s->c, "db", 0, &cfg, &s->g), 0);
        ck_assert_int_eq(wl_inputs_make(c, 0, 0, 0, &s->in), 0);
        ck_assert_int_eq(epd_region_alloc(s->c, 1 << 16, &p, &region), 0);
        memcpy(p, s->in.x, (size_t)c->max_tokens * c->hidden * 2);
        memcpy((uint8_t *)p + 32768, s->in.topk, (size_t)c->max_tokens * c->num_topk * 8);
        s->topk_ptr = (int64_t *)((uint8_t *)p + 32768);
        s->base = p;
        uint64_t xs[2] = { c->max_tokens, c->hidden }, ks[2] = { c->max_tokens, c->num_topk };
        memset(&s->da, 0, sizeof(s->da));
        s->da.size = sizeof(s->da);
        s->da.num_tokens = c->max_tokens;
        s->da.use_arena = 1;
        ck_assert_int_eq(epd_tensor_at(s->c, p, EPD_DTYPE_BF16, 2, xs, &s->da.x), 0);
        ck_assert_int_eq(epd_tensor_at(s->c, (uint8_t *)p + 32768, EPD_DTYPE_INT64, 2, ks,
                                       &s->da.topk_idx), 0);
}

static void setup_group(struct setup *s, uint32_t timeout_ms)
{
        setup_group_with(s, timeout_ms, NULL);
}

/* The daemon's loop thread polls 100 ms after each op, so the next op's request may go through
 * the page. */
static const char *const polling_daemon[] = { "--poll-us", "100000", NULL };

static void teardown(struct setup *s)
{
        wl_inputs_free(&s->in);
        epd_group_leave(s->g);
        epd_client_free(s->c);
        ck_assert_int_eq(h_daemon_stop(&s->d, 10000), 0);
}

START_TEST(test_completed_counts_ops)
{
        struct setup s;
        const volatile uint64_t *completed;
        struct epd_op *op;

        setup_group(&s, 5000);
        ck_assert_int_eq(epd_group_doorbell(s.g, &completed, NULL), 0);
        ck_assert_uint_eq(*completed, 0);
        for (uint64_t i = 1; i <= 3; i++) {
                ck_assert_int_eq(epd_dispatch(s.g, &s.da, &op), 0);
                ck_assert_uint_eq(epd_op_sequence(op), i);
                ck_assert_int_eq(via_page(op), 1);
                /* reply_seq moved twice per op: the nudge when it started, then the reply. */
                const struct epd_doorbell *db =
                        (const struct epd_doorbell *)((const uint8_t *)completed -
                                                      offsetof(struct epd_doorbell, completed));
                ck_assert_uint_eq(__atomic_load_n(&db->reply_seq, __ATOMIC_ACQUIRE), 2 * i);
                /* The reply follows the doorbell store, so it is visible by now. */
                ck_assert_uint_eq(__atomic_load_n(completed, __ATOMIC_ACQUIRE), i);
                struct epd_dispatch_result dr;
                ck_assert_int_eq(epd_op_dispatch_result(op, &dr), 0);
                ck_assert_int_eq(epd_handle_release(s.g, dr.handle_id), 0);
                epd_op_free(op);
        }
        /* A failed op finishes too: a bad top-k id. */
        int64_t *topk = s.topk_ptr;
        topk[0] = 9999;
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &op), 0);
        ck_assert_int_eq(epd_op_wait(op, 5000), EPD_INVALID_ARGUMENT);
        ck_assert_uint_eq(__atomic_load_n(completed, __ATOMIC_ACQUIRE), 4);
        /* The failure came through the page too, with its message. */
        ck_assert_int_eq(via_page(op), 1);
        ck_assert_msg(strstr(epd_op_error(op), "9999") != NULL, "message: %s", epd_op_error(op));
        epd_op_free(op);
        ck_assert_int_eq(stat_of(&s.d, "mailbox_replies"), 4);
        teardown(&s);
}
END_TEST

START_TEST(test_wait_inputs)
{
        struct setup s;
        struct epd_op *op;
        uint64_t seq;

        setup_group(&s, 5000);
        s.da.wait_inputs = 1;
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &op), 0);
        /* Held: the inputs are not marked ready. */
        ck_assert_int_eq(epd_op_wait(op, 200), EPD_TIMEOUT);
        ck_assert_int_eq(epd_group_mark_inputs_ready_host(s.g, &seq), 0);
        ck_assert_uint_eq(seq, 1);
        ck_assert_int_eq(epd_op_wait(op, 5000), 0);
        ck_assert_int_eq(via_page(op), 1); /* the timed-out wait resumed on the page */
        epd_op_free(op);
        teardown(&s);
}
END_TEST

START_TEST(test_wait_inputs_timeout)
{
        struct setup s;
        struct epd_op *op;

        setup_group(&s, 300);
        s.da.wait_inputs = 7;
        double t0 = now_ms();
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &op), 0);
        int rc = epd_op_wait(op, 5000);
        double dt = now_ms() - t0;
        ck_assert_int_eq(rc, EPD_TIMEOUT);
        ck_assert_msg(strstr(epd_op_error(op), "inputs") != NULL, "message: %s", epd_op_error(op));
        ck_assert_msg(dt >= 250 && dt < 3000, "timeout after %.0f ms", dt);
        epd_op_free(op);
        /* The group still works. */
        s.da.wait_inputs = 0;
        ck_assert_int_eq(epd_dispatch(s.g, &s.da, &op), 0);
        epd_op_free(op);
        teardown(&s);
}
END_TEST

START_TEST(test_mailbox_off_and_bad_env)
{
        struct setup s;
        struct epd_op *op;

        setenv("EPD_CLIENT_REPLY", "socket", 1);
        setup_group(&s, 5000);
        for (int i = 0; i < 2; i++) {
                ck_assert_int_eq(epd_dispatch(s.g, &s.da, &op), 0);
                ck_assert_int_eq(via_page(op), 0);
                epd_op_free(op);
        }
        ck_assert_int_eq(stat_of(&s.d, "mailbox_replies"), 0);

        unsetenv("EPD_CLIENT_REPLY");
        refuse_bad_env(&s.d, "EPD_CLIENT_REPLY", "pigeon");
        teardown(&s);
}
END_TEST

static int bf16_is_nan(uint16_t v)
{
        return (v & 0x7f80) == 0x7f80 && (v & 0x7f) != 0;
}

/* What a reply says, copied out of the op (test_reply_records). */
struct said {
        int32_t recv_tokens, expanded, per_expert[8], aligned[8], prefix[2];
        uint32_t experts, world, combined_tokens;
        uint64_t op_number, handle_id, exec_ns, kernel_ns;
        uint32_t dispatch_page, combine_page;  /* the reply came through the page */
        int dispatch_request, combine_request; /* request_via_page */
        int combined_ok;
};

/* Dispatch with outputs in the client's region (or the arena), then combine the rows back, and
 * record what the replies said and whether they came through the page. */
static void dispatch_and_combine(struct setup *s, int use_arena, struct said *out)
{
        const struct wl_case *c = &base_case;
        const uint64_t xs[2] = { c->max_tokens, c->hidden }, src[1] = { c->max_tokens };
        struct epd_dispatch_result dr;
        struct epd_op *op;

        memset(out, 0, sizeof(*out));
        s->da.use_arena = use_arena;
        s->da.expert_alignment = 4; /* so that the two count arrays differ */
        memset(&s->da.recv_x, 0, sizeof(s->da.recv_x));
        memset(&s->da.recv_src, 0, sizeof(s->da.recv_src));
        if (!use_arena) {
                ck_assert_int_eq(epd_tensor_at(s->c, s->base + 4096, EPD_DTYPE_BF16, 2, xs,
                                               &s->da.recv_x), 0);
                ck_assert_int_eq(epd_tensor_at(s->c, s->base + 8192, EPD_DTYPE_INT64, 1, src,
                                               &s->da.recv_src), 0);
        }
        ck_assert_int_eq(epd_dispatch(s->g, &s->da, &op), 0);
        out->dispatch_page = via_page(op);
        out->dispatch_request = request_via_page(op);
        ck_assert_int_eq(epd_op_dispatch_result(op, &dr), 0);
        ck_assert_uint_eq(dr.num_local_experts, 8);
        ck_assert_uint_eq(dr.world_size, 1);
        out->recv_tokens = dr.num_recv_tokens;
        out->expanded = dr.num_expanded_rows;
        out->experts = dr.num_local_experts;
        out->world = dr.world_size;
        memcpy(out->per_expert, dr.num_recv_tokens_per_expert, sizeof(out->per_expert));
        memcpy(out->aligned, dr.num_recv_tokens_per_expert_aligned, sizeof(out->aligned));
        memcpy(out->prefix, dr.rank_prefix, sizeof(out->prefix));
        out->op_number = dr.op_number;
        out->handle_id = dr.handle_id;
        out->exec_ns = dr.exec_ns;
        out->kernel_ns = dr.kernel_ns;
        /* Only arena outputs are placed by the reply; the client knows its own. */
        ck_assert_int_eq(use_arena, dr.recv_x_ptr != NULL);

        struct epd_combine_args ca = { .size = sizeof(ca), .handle_id = dr.handle_id,
                                       .y = use_arena ? dr.recv_x : s->da.recv_x };
        const size_t x_bytes = (size_t)c->max_tokens * c->hidden * 2;
        memset(s->base + 16384, 0xff, x_bytes);
        const uint64_t cs[2] = { c->max_tokens, c->hidden };
        ck_assert_int_eq(epd_tensor_at(s->c, s->base + 16384, EPD_DTYPE_BF16, 2, cs,
                                       &ca.combined), 0);
        struct epd_op *cop;
        struct epd_combine_result cr;
        ck_assert_int_eq(epd_combine_submit(s->g, &ca, &cop), 0);
        ck_assert_int_eq(epd_op_wait(cop, 5000), 0);
        ck_assert_int_eq(epd_op_combine_result(cop, &cr), 0);
        out->combined_tokens = cr.num_tokens;
        out->combine_page = via_page(cop);
        out->combine_request = request_via_page(cop);
        /* One rank: each token was received once and comes back as itself (a NaN as some
         * NaN: the reduction need not keep its payload). */
        const uint16_t *got = (const uint16_t *)(s->base + 16384), *x = (const uint16_t *)s->base;
        int same = cr.num_tokens == c->max_tokens;
        for (size_t i = 0; same && i < x_bytes / 2; i++)
                same = bf16_is_nan(x[i]) ? bf16_is_nan(got[i]) : got[i] == x[i];
        out->combined_ok = same;
        epd_op_free(cop);
        epd_op_free(op);
        ck_assert_int_eq(epd_handle_release(s->g, dr.handle_id), 0);
}

/* A reply record says the same through the page as on the socket (EPD_CLIENT_REPLY=socket),
 * and an arena dispatch's record places its outputs. */
START_TEST(test_reply_records)
{
        struct setup s;
        struct said page, sock, arena;

        setup_group(&s, 5000);
        dispatch_and_combine(&s, 0, &page);
        dispatch_and_combine(&s, 1, &arena);
        ck_assert_int_eq(stat_of(&s.d, "mailbox_replies"), 4);
        teardown(&s);

        setenv("EPD_CLIENT_REPLY", "socket", 1);
        setup_group(&s, 5000);
        unsetenv("EPD_CLIENT_REPLY");
        dispatch_and_combine(&s, 0, &sock);
        ck_assert_int_eq(stat_of(&s.d, "mailbox_replies"), 0);
        teardown(&s);

        ck_assert_uint_eq(page.dispatch_page, 1);
        ck_assert_uint_eq(page.combine_page, 1);
        ck_assert_uint_eq(arena.dispatch_page, 1);
        ck_assert_uint_eq(arena.combine_page, 1);
        ck_assert_uint_eq(sock.dispatch_page, 0);
        ck_assert_uint_eq(sock.combine_page, 0);
        /* The same op on the same inputs: the same counts either way (times and numbers
         * aside: the arena run is the group's second op). */
        ck_assert_int_gt(page.recv_tokens, 0);
        ck_assert_int_ne(memcmp(page.per_expert, page.aligned, sizeof(page.aligned)), 0);
        ck_assert_int_gt(page.exec_ns, 0);
        ck_assert_uint_eq(page.op_number, sock.op_number);
        ck_assert_uint_eq(page.handle_id, sock.handle_id);
        const struct said *other[2] = { &sock, &arena };
        for (int i = 0; i < 2; i++) {
                const struct said *o = other[i];
                ck_assert_int_eq(page.recv_tokens, o->recv_tokens);
                ck_assert_int_eq(page.expanded, o->expanded);
                ck_assert_mem_eq(page.per_expert, o->per_expert, sizeof(o->per_expert));
                ck_assert_mem_eq(page.aligned, o->aligned, sizeof(o->aligned));
                ck_assert_mem_eq(page.prefix, o->prefix, sizeof(o->prefix));
                ck_assert_uint_eq(page.combined_tokens, o->combined_tokens);
                ck_assert_msg(o->combined_ok == 1, "run %d: combine did not return x", i);
        }
        ck_assert_int_eq(page.combined_ok, 1);
}
END_TEST

/* Request records of both kinds through the page, outputs in the client's tensors: the daemon
 * reads them as those on the socket (the same counts and the combined rows back), op after op. */
START_TEST(test_request_records)
{
        struct setup s;
        struct said first, now;
        int in_page[2] = { 0, 0 };

        setup_group_with(&s, 5000, polling_daemon);
        dispatch_and_combine(&s, 0, &first);
        ck_assert_int_eq(first.combined_ok, 1);
        for (int i = 0; i < 12; i++) {
                dispatch_and_combine(&s, 0, &now);
                in_page[0] += now.dispatch_request;
                in_page[1] += now.combine_request;
                ck_assert_int_eq(now.recv_tokens, first.recv_tokens);
                ck_assert_mem_eq(now.per_expert, first.per_expert, sizeof(now.per_expert));
                ck_assert_mem_eq(now.aligned, first.aligned, sizeof(now.aligned));
                ck_assert_uint_eq(now.combined_tokens, first.combined_tokens);
                ck_assert_int_eq(now.combined_ok, 1);
        }
        ck_assert_msg(in_page[0] >= 8 && in_page[1] >= 8,
                      "requests in the page: %d dispatches, %d combines of 12", in_page[0],
                      in_page[1]);
        teardown(&s);
}
END_TEST

/* Every rank releases a handle while an op that uses it runs (held here by its inputs): a
 * cached dispatch then has no handle to reply with and fails with NOT_FOUND naming it, while a
 * combine, which needs none in its reply, succeeds; the daemon carries on either way. (Found by
 * fuzz_request: the daemon used to read the freed handle.) */
START_TEST(test_handle_released_during_op)
{
        struct setup s;
        struct epd_op *op, *held;
        struct epd_dispatch_result dr;
        uint64_t seq;

        setup_group(&s, 5000);
        for (int kind = 0; kind < 2; kind++) {
                ck_assert_int_eq(epd_dispatch(s.g, &s.da, &op), 0);
                ck_assert_int_eq(epd_op_dispatch_result(op, &dr), 0);
                const uint64_t handle = dr.handle_id;
                struct epd_tensor y = dr.recv_x;
                if (kind == 0) {
                        struct epd_dispatch_args cached = s.da;
                        cached.handle_id = handle;
                        memset(&cached.topk_idx, 0, sizeof(cached.topk_idx));
                        cached.wait_inputs = 2 * (uint64_t)kind + 1;
                        ck_assert_int_eq(epd_dispatch_submit(s.g, &cached, &held), 0);
                } else {
                        const uint64_t cs[2] = { base_case.max_tokens, base_case.hidden };
                        struct epd_combine_args ca = { .size = sizeof(ca), .handle_id = handle,
                                                       .y = y };
                        ck_assert_int_eq(epd_tensor_at(s.c, s.base + 16384, EPD_DTYPE_BF16, 2,
                                                       cs, &ca.combined), 0);
                        ca.wait_inputs = 2;
                        ck_assert_int_eq(epd_combine_submit(s.g, &ca, &held), 0);
                }
                epd_op_free(op);
                ck_assert_int_eq(epd_op_wait(held, 100), EPD_TIMEOUT);
                ck_assert_int_eq(epd_handle_release(s.g, handle), 0);
                ck_assert_int_eq(epd_group_mark_inputs_ready_host(s.g, &seq), 0);
                const int rc = epd_op_wait(held, 5000);
                if (kind == 0) {
                        ck_assert_int_eq(rc, EPD_NOT_FOUND);
                        ck_assert_msg(strstr(epd_op_error(held), "released by every rank"),
                                      "message: %s", epd_op_error(held));
                } else {
                        ck_assert_msg(rc == 0, "combine: %s", epd_op_error(held));
                }
                epd_op_free(held);
                h_assert_daemon_alive(&s.d, "after a handle released during its op");
        }
        /* The group goes on. */
        ck_assert_int_eq(epd_dispatch(s.g, &s.da, &op), 0);
        epd_op_free(op);
        teardown(&s);
}
END_TEST

START_TEST(test_mailbox_one_at_a_time)
{
        struct setup s;
        struct epd_op *a, *b;
        uint64_t seq;

        setup_group(&s, 5000);
        /* a is held by its inputs, so b is submitted while a's page reply is pending. */
        s.da.wait_inputs = 1;
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &a), 0);
        s.da.wait_inputs = 0;
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &b), 0);
        ck_assert_int_eq(epd_op_wait(b, 100), EPD_TIMEOUT); /* queued behind a */
        ck_assert_int_eq(epd_group_mark_inputs_ready_host(s.g, &seq), 0);
        /* b first: its reply is on the socket; a's waits in the page meanwhile. */
        ck_assert_int_eq(epd_op_wait(b, 5000), 0);
        ck_assert_int_eq(epd_op_wait(a, 5000), 0);
        ck_assert_int_eq(via_page(a), 1);
        ck_assert_int_eq(via_page(b), 0);
        epd_op_free(a);
        epd_op_free(b);
        /* The page is free again. */
        ck_assert_int_eq(epd_dispatch(s.g, &s.da, &a), 0);
        ck_assert_int_eq(via_page(a), 1);
        epd_op_free(a);
        ck_assert_int_eq(stat_of(&s.d, "mailbox_replies"), 2);
        teardown(&s);
}
END_TEST

/* A client that asks for a second reply in the page while the first is pending (libepd never
 * does: the test clears libepd's record of the pending one) is refused with a clear error on
 * the socket, which the wait in the page still picks up; the first op is unharmed. */
START_TEST(test_mailbox_second_refused)
{
        struct setup s;
        struct epd_op *a, *b;
        uint64_t seq;

        setup_group(&s, 5000);
        s.da.wait_inputs = 1;
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &a), 0);
        s.g->mailbox_id = 0; /* forget a: b asks for the page too */
        s.da.wait_inputs = 0;
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &b), 0);
        double t0 = now_ms();
        ck_assert_int_eq(epd_op_wait(b, 5000), EPD_INVALID_ARGUMENT);
        ck_assert_msg(now_ms() - t0 < 2000, "the refusal took %.0f ms", now_ms() - t0);
        ck_assert_msg(strstr(epd_op_error(b), "doorbell page") != NULL, "message: %s",
                      epd_op_error(b));
        ck_assert_int_eq(via_page(b), 0);
        ck_assert_int_eq(epd_group_mark_inputs_ready_host(s.g, &seq), 0);
        ck_assert_int_eq(epd_op_wait(a, 5000), 0);
        ck_assert_int_eq(via_page(a), 1);
        epd_op_free(a);
        epd_op_free(b);
        /* The rank goes on: the refused submission counts as finished. */
        ck_assert_int_eq(epd_dispatch(s.g, &s.da, &a), 0);
        ck_assert_int_eq(via_page(a), 1);
        epd_op_free(a);
        teardown(&s);
}
END_TEST

START_TEST(test_mailbox_daemon_killed)
{
        struct setup s;
        struct epd_op *op;

        setup_group(&s, 60000);
        s.da.wait_inputs = 1; /* never marked: the op waits until the daemon dies */
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &op), 0);
        ck_assert_int_eq(epd_op_wait(op, 300), EPD_TIMEOUT);
        ck_assert_int_eq(kill(s.d.pid, SIGKILL), 0);
        double t0 = now_ms();
        int rc = epd_op_wait(op, 30000);
        double dt = now_ms() - t0;
        ck_assert_int_eq(rc, EPD_UNAVAILABLE);
        /* Noticed at the next look at the socket (sleeps of at most 64 ms), not at the
         * wait's 30 s. */
        ck_assert_msg(dt < 2000, "the lost daemon was noticed after %.0f ms", dt);
        epd_op_free(op);
        wl_inputs_free(&s.in);
        epd_group_leave(s.g);
        epd_client_free(s.c);
        (void)h_daemon_stop(&s.d, 1000);
}
END_TEST

/* One dispatch; returns whether its request went through the page, checks its result against
 * the first op's (rows received) and releases its handle. */
static int dispatch_once(struct setup *s, uint64_t *rows)
{
        struct epd_op *op;
        struct epd_dispatch_result dr;

        ck_assert_int_eq(epd_dispatch(s->g, &s->da, &op), 0);
        ck_assert_int_eq(epd_op_dispatch_result(op, &dr), 0);
        if (*rows == UINT64_MAX)
                *rows = (uint64_t)dr.num_recv_tokens;
        ck_assert_uint_eq((uint64_t)dr.num_recv_tokens, *rows);
        ck_assert_int_eq(epd_handle_release(s->g, dr.handle_id), 0);
        const int page = request_via_page(op);
        epd_op_free(op);
        return page;
}

START_TEST(test_request_page)
{
        struct setup s;
        uint64_t rows = UINT64_MAX;
        int in_page = 0;

        setup_group_with(&s, 5000, polling_daemon);
        /* The first op finds the daemon asleep: socket. The next ones come within its 100 ms
         * of polling. */
        ck_assert_int_eq(dispatch_once(&s, &rows), 0);
        for (int i = 0; i < 20; i++)
                in_page += dispatch_once(&s, &rows);
        ck_assert_msg(in_page >= 15, "only %d of 20 requests went through the page", in_page);
        ck_assert_int_eq(stat_of(&s.d, "mailbox_requests"), in_page);
        teardown(&s);

        /* Off by the environment; a bad value is refused. */
        setenv("EPD_CLIENT_REQUEST", "socket", 1);
        setup_group_with(&s, 5000, polling_daemon);
        for (int i = 0; i < 5; i++)
                ck_assert_int_eq(dispatch_once(&s, &rows), 0);
        ck_assert_int_eq(stat_of(&s.d, "mailbox_requests"), 0);
        refuse_bad_env(&s.d, "EPD_CLIENT_REQUEST", "carrier");
        teardown(&s);
}
END_TEST

/* A request posted in the page, then one on the socket: the daemon handles them in that order.
 * The daemon does not poll here; the test holds the box open itself (as the daemon's flag reads
 * in the instant before it stops polling), so the page's request is seen only when the socket's
 * frame wakes the loop thread, which must take the page first. */
static const char *const sleeping_daemon[] = { "--poll-us", "0", NULL };

START_TEST(test_request_page_order)
{
        struct setup s;
        uint64_t rows = UINT64_MAX;
        struct epd_op *a, *b;

        setup_group_with(&s, 5000, sleeping_daemon);
        (void)dispatch_once(&s, &rows);
        struct epd_request_box *box = epd_doorbell_request_box(s.g->doorbell, s.g->doorbell_bytes);
        ck_assert_ptr_nonnull(box);
        ck_assert_uint_eq(box->polling, 0);
        __atomic_store_n(&box->polling, 1, __ATOMIC_SEQ_CST);
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &a), 0);
        ck_assert_int_eq(epd_dispatch_submit(s.g, &s.da, &b), 0);
        ck_assert_int_eq(epd_op_wait(a, 5000), 0);
        ck_assert_int_eq(epd_op_wait(b, 5000), 0);
        ck_assert_int_eq(request_via_page(a), 1);
        ck_assert_int_eq(request_via_page(b), 0); /* the box was full */
        ck_assert_msg(timeline_of(a).received_ns < timeline_of(b).received_ns,
                      "the socket's request was read first");
        ck_assert_uint_eq(epd_op_sequence(a) + 1, epd_op_sequence(b));
        struct epd_dispatch_result ra, rb;
        ck_assert_int_eq(epd_op_dispatch_result(a, &ra), 0);
        ck_assert_int_eq(epd_op_dispatch_result(b, &rb), 0);
        ck_assert_uint_eq((uint64_t)ra.num_recv_tokens, rows);
        ck_assert_uint_eq((uint64_t)rb.num_recv_tokens, rows);
        ck_assert_uint_lt(ra.op_number, rb.op_number);
        ck_assert_int_eq(epd_handle_release(s.g, ra.handle_id), 0);
        ck_assert_int_eq(epd_handle_release(s.g, rb.handle_id), 0);
        epd_op_free(a);
        epd_op_free(b);
        ck_assert_int_eq(stat_of(&s.d, "mailbox_requests"), 1);
        teardown(&s);
}
END_TEST

/* What a hostile client can put in its page: each closes its own connection with a message
 * naming the page, and the daemon serves others. */
START_TEST(test_request_page_bad)
{
        for (int variant = 0; variant < 10; variant++) {
                struct setup s;
                struct epd_op *op;
                uint8_t buf[EPD_REQUEST_CAPACITY];
                size_t len = 0;

                setup_group_with(&s, 5000, sleeping_daemon); /* the page waits for a frame */
                struct epd_request_box *box =
                        epd_doorbell_request_box(s.g->doorbell, s.g->doorbell_bytes);
                ck_assert_ptr_nonnull(box);
                Epd__V1__Request req = EPD__V1__REQUEST__INIT;
                Epd__V1__StatusRequest st = EPD__V1__STATUS_REQUEST__INIT;
                struct epd_op_request q = { .id = 1000, .kind = EPD_OPREC_DISPATCH,
                                            .group_id = s.g->id };
                char err[160];
                req.id = 1000;
                if (variant == 9) {
                        q.kind = EPD_OPREC_COMBINE;
                        q.num_bias = 1;
                }
                if (variant == 3)
                        q.rank = 5;
                if (variant >= 3)
                        len = (size_t)epd_oprec_request_encode(&q, buf, sizeof(buf), err,
                                                               sizeof(err));
                uint8_t *slot = buf + 72; /* tensor slot 0 (common/oprec.c) */
                switch (variant) {
                case 0: /* not a record */
                        memset(buf, 0xff, 64);
                        len = 64;
                        break;
                case 1: /* a length beyond the box */
                        len = EPD_REQUEST_CAPACITY + 1;
                        break;
                case 2: /* a protobuf Request instead of a record */
                        req.body_case = EPD__V1__REQUEST__BODY_STATUS;
                        req.status = &st;
                        len = epd__v1__request__pack(&req, buf);
                        break;
                case 3: /* a dispatch of another rank */
                        break;
                case 4: /* a short record */
                        len -= 8;
                        break;
                case 5: /* an unknown kind */
                        buf[2] = 9;
                        break;
                case 6: /* a tensor of 5 dims */
                        slot[0] = 1;
                        slot[20] = 5;
                        break;
                case 7: /* unknown flags */
                        buf[29] = 1;
                        break;
                case 8: /* another record version */
                        buf[0] = 2;
                        break;
                case 9: /* a combine with a bias beyond its count */
                        slot += 2 * 96;
                        slot[0] = 1;
                        slot[20] = 2;
                        break;
                }
                if (len <= EPD_REQUEST_CAPACITY)
                        memcpy(box->bytes, buf, len);
                box->len = (uint32_t)len;
                __atomic_store_n(&box->state, EPD_REQUEST_POSTED, __ATOMIC_SEQ_CST);
                /* The next frame makes the daemon take the page first. */
                int rc = epd_dispatch_submit(s.g, &s.da, &op);
                if (rc == 0) {
                        rc = epd_op_wait(op, 5000);
                        epd_op_free(op);
                }
                ck_assert_int_ne(rc, 0);
                const char *msg = epd_client_last_error(s.c);
                ck_assert_msg(strstr(msg, "doorbell page") != NULL, "variant %d: %s", variant,
                              msg);
                h_assert_daemon_alive(&s.d, "after a bad request in a page");
                ck_assert_int_eq(stat_of(&s.d, "protocol_errors"), 1);
                ck_assert_int_eq(stat_of(&s.d, "mailbox_requests"), 0);
                struct epd_client *other = h_connect_ok(&s.d, "other");
                epd_client_free(other);
                teardown(&s);
        }
}
END_TEST

int main(void)
{
        Suite *su = suite_create("integ_doorbell");
        TCase *tc = tcase_create("doorbell");

        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_completed_counts_ops);
        tcase_add_test(tc, test_wait_inputs);
        tcase_add_test(tc, test_wait_inputs_timeout);
        tcase_add_test(tc, test_mailbox_off_and_bad_env);
        tcase_add_test(tc, test_reply_records);
        tcase_add_test(tc, test_request_records);
        tcase_add_test(tc, test_handle_released_during_op);
        tcase_add_test(tc, test_mailbox_one_at_a_time);
        tcase_add_test(tc, test_mailbox_second_refused);
        tcase_add_test(tc, test_mailbox_daemon_killed);
        tcase_add_test(tc, test_request_page);
        tcase_add_test(tc, test_request_page_order);
        tcase_add_test(tc, test_request_page_bad);
        suite_add_tcase(su, tc);
        return h_run_suite(su);
}
