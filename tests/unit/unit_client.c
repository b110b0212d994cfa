/* unit_client.c - libepd against a fake daemon that answers with the wrong reply body.
 *
 * A reply's bodies share one oneof (proto/epd.proto): an OK reply carrying another body than the
 * request's (a daemon of another version, a bug) must fail the call with EPD_INTERNAL and a
 * message naming both, not be read as the expected body. An op's reply record
 * (common/oprec.h) of the other kind is refused the same way. The fake daemon is a thread on a Unix
 * SOCK_SEQPACKET socket speaking the real framing (common/frame.c): it answers Hello with a
 * Welcome, the request under test with the body the test chose, and the others correctly.
 * Covers connect (Hello), size hint, region registration, group creation, and the completion of
 * dispatch and combine, each also answered correctly as a control.
 * Each test runs in its own process (fork mode), so a crash fails only its own test.
 */
#include <check.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "frame.h"
#include "oprec.h"

#define MAX_BODY (64u * 1024u)

struct fake {
        char dir[64], path[108];
        int lfd;
        pthread_t thread;
        Epd__V1__Response__BodyCase hello_body; /* the answer to Hello */
        Epd__V1__Request__BodyCase target;      /* the request under test */
        Epd__V1__Response__BodyCase body;       /* its answer */
        uint32_t op_kind;                       /* an op answer's record kind; 0: the request's */
};

/* One OK reply to req with the given body, each body filled with recognisable values. */
static void answer(int fd, const Epd__V1__Request *req, Epd__V1__Response__BodyCase body,
                   uint32_t op_kind)
{
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__Welcome welcome = EPD__V1__WELCOME__INIT;
        Epd__V1__Empty empty = EPD__V1__EMPTY__INIT;
        Epd__V1__SizeHintReply hint = EPD__V1__SIZE_HINT_REPLY__INIT;
        Epd__V1__RegionRegistered reg = EPD__V1__REGION_REGISTERED__INIT;
        Epd__V1__ListGroupsReply groups = EPD__V1__LIST_GROUPS_REPLY__INIT;
        Epd__V1__GroupJoined joined = EPD__V1__GROUP_JOINED__INIT;
        Epd__V1__GroupConfig cfg = EPD__V1__GROUP_CONFIG__INIT;
        Epd__V1__OpRecord wrap = EPD__V1__OP_RECORD__INIT;
        struct epd_op_request q;
        struct epd_op_reply rep;
        int32_t counts[8] = { 1, 2, 3, 4, 5, 6, 7, 8 }, prefix[2] = { 0, 36 };
        uint8_t buf[4096], rec[1024];
        char err[160];

        resp.id = req->id;
        resp.status = EPD__V1__STATUS_CODE__OK;
        resp.message = "";
        resp.body_case = body;
        switch (body) {
        case EPD__V1__RESPONSE__BODY_WELCOME:
                welcome.protocol_version = EPD_PROTOCOL_VERSION;
                welcome.client_id = 7;
                welcome.backend = "fake";
                welcome.version = "fake";
                resp.welcome = &welcome;
                break;
        case EPD__V1__RESPONSE__BODY_SIZE_HINT:
                hint.daemon_bytes_per_rank = 12345;
                hint.max_rows_non_expand = 678;
                resp.size_hint = &hint;
                break;
        case EPD__V1__RESPONSE__BODY_REGION_REGISTERED:
                reg.region_id = 42;
                resp.region_registered = &reg;
                break;
        case EPD__V1__RESPONSE__BODY_GROUPS:
                resp.groups = &groups;
                break;
        case EPD__V1__RESPONSE__BODY_GROUP_JOINED:
                cfg.world_size = 1;
                cfg.num_experts = 8;
                cfg.hidden = 128;
                cfg.max_tokens_per_rank = 4;
                cfg.max_topk = 2;
                joined.group_id = 3;
                joined.rank = 0;
                joined.config = &cfg;
                resp.group_joined = &joined;
                break;
        case EPD__V1__RESPONSE__BODY_OP:
                /* The real record of the request, answered: dispatch op 5, combine op 6. */
                ck_assert_int_eq(req->body_case, EPD__V1__REQUEST__BODY_OP);
                ck_assert_int_eq(epd_oprec_request_decode(req->op->record.data,
                                                          req->op->record.len, &q, err,
                                                          sizeof(err)),
                                 0);
                ck_assert_uint_eq(q.id, req->id);
                memset(&rep, 0, sizeof(rep));
                rep.id = q.id;
                rep.kind = op_kind ? op_kind : q.kind;
                rep.op_number = q.kind == EPD_OPREC_DISPATCH ? 5 : 6;
                if (rep.kind == EPD_OPREC_DISPATCH) {
                        rep.num_local_experts = 8;
                        rep.world_size = 1;
                        rep.per_expert = counts;
                        rep.per_expert_aligned = counts;
                        rep.rank_prefix = prefix;
                }
                int n = epd_oprec_reply_encode(&rep, rec, sizeof(rec));
                ck_assert_int_gt(n, 0);
                wrap.record.data = rec;
                wrap.record.len = (size_t)n;
                resp.op = &wrap;
                break;
        default:
                resp.body_case = EPD__V1__RESPONSE__BODY_EMPTY;
                resp.empty = &empty;
                break;
        }
        size_t len = epd__v1__response__get_packed_size(&resp);
        ck_assert_uint_le(len, sizeof(buf));
        epd__v1__response__pack(&resp, buf);
        ck_assert_int_eq(epd_frame_send(fd, EPD_PROTOCOL_VERSION, buf, len, NULL, 0), 0);
}

static void *fake_main(void *arg)
{
        struct fake *f = arg;
        uint8_t *buf = malloc(EPD_FRAME_HEADER_BYTES + MAX_BODY + 1);
        int fd = accept(f->lfd, NULL, NULL);

        while (buf && fd >= 0) {
                struct epd_frame frame;
                const char *why = NULL;
                struct pollfd p = { .fd = fd, .events = POLLIN };
                if (poll(&p, 1, 10000) != 1 ||
                    epd_frame_recv(fd, buf, EPD_FRAME_HEADER_BYTES + MAX_BODY + 1, MAX_BODY,
                                   EPD_FRAME_MAX_FDS, &frame, &why) < 0)
                        break; /* the client went away (epd_frame_recv does not block) */
                epd_frame_close_fds(&frame);
                Epd__V1__Request *req =
                        epd__v1__request__unpack(NULL, frame.body_len, frame.body);
                if (!req)
                        break;
                /* The request under test gets the test's body; the others their own. */
                Epd__V1__Response__BodyCase body = EPD__V1__RESPONSE__BODY_EMPTY;
                if (req->body_case == EPD__V1__REQUEST__BODY_HELLO)
                        body = f->hello_body;
                else if (req->body_case == f->target)
                        body = f->body;
                else if (req->body_case == EPD__V1__REQUEST__BODY_GROUP_CREATE)
                        body = EPD__V1__RESPONSE__BODY_GROUP_JOINED;
                answer(fd, req, body, f->op_kind);
                epd__v1__request__free_unpacked(req, NULL);
        }
        if (fd >= 0)
                close(fd);
        free(buf);
        return NULL;
}

static void fake_start(struct fake *f, Epd__V1__Response__BodyCase hello_body,
                       Epd__V1__Request__BodyCase target, Epd__V1__Response__BodyCase body)
{
        struct sockaddr_un sa = { .sun_family = AF_UNIX };

        snprintf(f->dir, sizeof(f->dir), "/tmp/epd-unit-client-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(f->dir));
        snprintf(f->path, sizeof(f->path), "%s/s", f->dir);
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
        f->hello_body = hello_body;
        f->target = target;
        f->body = body;
        f->op_kind = 0;
        f->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(f->lfd, 0);
        ck_assert_int_eq(bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        ck_assert_int_eq(listen(f->lfd, 1), 0);
        ck_assert_int_eq(pthread_create(&f->thread, NULL, fake_main, f), 0);
}

static void fake_stop(struct fake *f)
{
        pthread_join(f->thread, NULL);
        close(f->lfd);
        unlink(f->path);
        rmdir(f->dir);
}

static struct epd_client *connect_to(struct fake *f)
{
        struct epd_connect_args a = { .size = sizeof(a), .socket_path = f->path,
                                      .timeout_ms = 5000 };
        struct epd_client *c = NULL;
        char err[256] = "";

        ck_assert_msg(epd_client_connect(&a, &c, err, sizeof(err)) == 0, "connect: %s", err);
        return c;
}

static const char test_secret[32] = "0123456789abcdef0123456789abcdef";

static const struct epd_group_config test_config = {
        .size = sizeof(struct epd_group_config),
        .world_size = 1,
        .num_experts = 8,
        .hidden = 128,
        .max_tokens_per_rank = 4,
        .max_topk = 2,
        .dispatch_dtype = EPD_DTYPE_BF16,
};

/* ---- Hello ---- */

START_TEST(hello_answered_with_empty)
{
        struct fake f;
        struct epd_connect_args a = { .size = sizeof(a), .timeout_ms = 5000 };
        struct epd_client *c = NULL;
        char err[256] = "";

        fake_start(&f, EPD__V1__RESPONSE__BODY_EMPTY, EPD__V1__REQUEST__BODY__NOT_SET,
                   EPD__V1__RESPONSE__BODY_EMPTY);
        a.socket_path = f.path;
        ck_assert_int_eq(epd_client_connect(&a, &c, err, sizeof(err)), EPD_INTERNAL);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(err, "answered hello with empty") != NULL, "message: %s", err);
        fake_stop(&f);
}
END_TEST

/* ---- size hint ---- */

static int size_hint_with(Epd__V1__Response__BodyCase body, struct epd_size_hint *out,
                          char *msg, size_t msg_len)
{
        struct fake f;
        int rc;

        fake_start(&f, EPD__V1__RESPONSE__BODY_WELCOME, EPD__V1__REQUEST__BODY_SIZE_HINT, body);
        struct epd_client *c = connect_to(&f);
        rc = epd_size_hint(c, &test_config, 1, out);
        snprintf(msg, msg_len, "%s", epd_client_last_error(c));
        epd_client_free(c);
        fake_stop(&f);
        return rc;
}

START_TEST(size_hint_answered_with_groups)
{
        struct epd_size_hint h;
        char msg[256];

        memset(&h, 0xab, sizeof(h));
        ck_assert_int_eq(size_hint_with(EPD__V1__RESPONSE__BODY_GROUPS, &h, msg, sizeof(msg)),
                         EPD_INTERNAL);
        ck_assert_msg(strstr(msg, "answered size_hint with groups") != NULL, "message: %s", msg);
}
END_TEST

START_TEST(size_hint_answered_right)
{
        struct epd_size_hint h;
        char msg[256];

        memset(&h, 0, sizeof(h));
        ck_assert_int_eq(size_hint_with(EPD__V1__RESPONSE__BODY_SIZE_HINT, &h, msg, sizeof(msg)),
                         0);
        ck_assert_uint_eq(h.daemon_bytes_per_rank, 12345);
        ck_assert_uint_eq(h.max_rows_non_expand, 678);
}
END_TEST

/* ---- region registration ---- */

static int register_with(Epd__V1__Response__BodyCase body, char *msg, size_t msg_len)
{
        struct fake f;
        void *ptr = NULL;
        int fd = -1, rc;

        uint64_t id = 0;

        fake_start(&f, EPD__V1__RESPONSE__BODY_WELCOME, EPD__V1__REQUEST__BODY_REGION_REGISTER,
                   body);
        struct epd_client *c = connect_to(&f);
        ck_assert_int_eq(epd_memfd_alloc(4096, &fd, &ptr), 0);
        rc = epd_region_register_fd(c, EPD_REGION_HOST_MEMFD, fd, 4096, 0, ptr, &id);
        if (rc == 0)
                ck_assert_uint_eq(id, 42);
        snprintf(msg, msg_len, "%s", epd_client_last_error(c));
        epd_client_free(c);
        fake_stop(&f);
        munmap(ptr, 4096);
        close(fd);
        return rc;
}

START_TEST(region_register_answered_with_empty)
{
        char msg[256];

        ck_assert_int_eq(register_with(EPD__V1__RESPONSE__BODY_EMPTY, msg, sizeof(msg)),
                         EPD_INTERNAL);
        ck_assert_msg(strstr(msg, "answered region_register with empty") != NULL, "message: %s",
                      msg);
}
END_TEST

START_TEST(region_register_answered_right)
{
        char msg[256];

        ck_assert_int_eq(
                register_with(EPD__V1__RESPONSE__BODY_REGION_REGISTERED, msg, sizeof(msg)), 0);
}
END_TEST

/* ---- group creation ---- */

static int create_with(Epd__V1__Response__BodyCase body, char *msg, size_t msg_len)
{
        struct fake f;
        struct epd_group *g = NULL;
        int rc;

        fake_start(&f, EPD__V1__RESPONSE__BODY_WELCOME, EPD__V1__REQUEST__BODY_GROUP_CREATE,
                   body);
        struct epd_client *c = connect_to(&f);
        struct epd_group_args a = { .size = sizeof(a), .name = "g", .secret = test_secret,
                                    .secret_len = sizeof(test_secret), .config = &test_config };
        rc = epd_group_create(c, &a, &g);
        snprintf(msg, msg_len, "%s", epd_client_last_error(c));
        if (rc == 0) {
                ck_assert_uint_eq(epd_group_id(g), 3);
                ck_assert_int_eq(epd_group_leave(g), 0); /* answered with Empty */
        }
        epd_client_free(c);
        fake_stop(&f);
        return rc;
}

START_TEST(group_create_answered_with_size_hint)
{
        char msg[256];

        ck_assert_int_eq(create_with(EPD__V1__RESPONSE__BODY_SIZE_HINT, msg, sizeof(msg)),
                         EPD_INTERNAL);
        ck_assert_msg(strstr(msg, "answered group_create with size_hint") != NULL,
                      "message: %s", msg);
}
END_TEST

START_TEST(group_create_answered_right)
{
        char msg[256];

        ck_assert_int_eq(create_with(EPD__V1__RESPONSE__BODY_GROUP_JOINED, msg, sizeof(msg)), 0);
}
END_TEST

/* ---- dispatch and combine (the op's completion, here through the socket: the fake daemon
 * gives no doorbell page) ---- */

static int op_with(uint32_t kind, Epd__V1__Response__BodyCase body, uint32_t reply_kind,
                   uint64_t *op_number, char *msg, size_t msg_len)
{
        struct fake f;
        struct epd_group *g = NULL;
        struct epd_op *op = NULL;
        int rc;

        fake_start(&f, EPD__V1__RESPONSE__BODY_WELCOME, EPD__V1__REQUEST__BODY_OP, body);
        f.op_kind = reply_kind;
        struct epd_client *c = connect_to(&f);
        struct epd_group_args a = { .size = sizeof(a), .name = "g", .secret = test_secret,
                                    .secret_len = sizeof(test_secret), .config = &test_config };
        ck_assert_int_eq(epd_group_create(c, &a, &g), 0);
        if (kind == EPD_OPREC_DISPATCH) {
                struct epd_dispatch_args d = { .size = sizeof(d) };
                ck_assert_int_eq(epd_dispatch_submit(g, &d, &op), 0);
        } else {
                struct epd_combine_args cb = { .size = sizeof(cb), .handle_id = 1 };
                ck_assert_int_eq(epd_combine_submit(g, &cb, &op), 0);
        }
        rc = epd_op_wait(op, 5000);
        snprintf(msg, msg_len, "%s", epd_client_last_error(c));
        if (rc == 0 && kind == EPD_OPREC_DISPATCH) {
                struct epd_dispatch_result r;
                ck_assert_int_eq(epd_op_dispatch_result(op, &r), 0);
                *op_number = r.op_number;
                /* The counts come out of the record as the fake wrote them. */
                ck_assert_uint_eq(r.num_local_experts, 8);
                ck_assert_uint_eq(r.world_size, 1);
                ck_assert_int_eq(r.num_recv_tokens_per_expert[7], 8);
                ck_assert_int_eq(r.rank_prefix[1], 36);
        } else if (rc == 0) {
                struct epd_combine_result r;
                ck_assert_int_eq(epd_op_combine_result(op, &r), 0);
                *op_number = r.op_number;
        }
        epd_op_free(op);
        ck_assert_int_eq(epd_group_leave(g), 0);
        epd_client_free(c);
        fake_stop(&f);
        return rc;
}

/* The op under test answered with another body or record kind: EPD_INTERNAL, and the message
 * names both. */
static void expect_op_refused(uint32_t kind, Epd__V1__Response__BodyCase body,
                              uint32_t reply_kind, const char *words)
{
        uint64_t n = 0;
        char msg[256];

        ck_assert_int_eq(op_with(kind, body, reply_kind, &n, msg, sizeof(msg)), EPD_INTERNAL);
        ck_assert_msg(strstr(msg, words) != NULL, "message: %s", msg);
}

/* The control: answered with its own record, the op succeeds with the fake's op number. */
static void expect_op_ok(uint32_t kind, uint64_t op_number)
{
        uint64_t n = 0;
        char msg[256];

        ck_assert_int_eq(op_with(kind, EPD__V1__RESPONSE__BODY_OP, 0, &n, msg, sizeof(msg)), 0);
        ck_assert_uint_eq(n, op_number);
}

START_TEST(dispatch_answered_with_combine)
{
        expect_op_refused(EPD_OPREC_DISPATCH, EPD__V1__RESPONSE__BODY_OP, EPD_OPREC_COMBINE,
                          "with a combine reply");
}
END_TEST

START_TEST(dispatch_answered_with_empty)
{
        expect_op_refused(EPD_OPREC_DISPATCH, EPD__V1__RESPONSE__BODY_EMPTY, 0,
                          "answered dispatch with empty");
}
END_TEST

START_TEST(dispatch_answered_right)
{
        expect_op_ok(EPD_OPREC_DISPATCH, 5);
}
END_TEST

START_TEST(combine_answered_with_dispatch)
{
        expect_op_refused(EPD_OPREC_COMBINE, EPD__V1__RESPONSE__BODY_OP, EPD_OPREC_DISPATCH,
                          "with a dispatch reply");
}
END_TEST

START_TEST(combine_answered_right)
{
        expect_op_ok(EPD_OPREC_COMBINE, 6);
}
END_TEST

static Suite *client_suite(void)
{
        Suite *s = suite_create("client");
        TCase *tc = tcase_create("reply bodies");

        tcase_set_timeout(tc, 30);
        tcase_add_test(tc, hello_answered_with_empty);
        tcase_add_test(tc, size_hint_answered_with_groups);
        tcase_add_test(tc, size_hint_answered_right);
        tcase_add_test(tc, region_register_answered_with_empty);
        tcase_add_test(tc, region_register_answered_right);
        tcase_add_test(tc, group_create_answered_with_size_hint);
        tcase_add_test(tc, group_create_answered_right);
        tcase_add_test(tc, dispatch_answered_with_combine);
        tcase_add_test(tc, dispatch_answered_with_empty);
        tcase_add_test(tc, dispatch_answered_right);
        tcase_add_test(tc, combine_answered_with_dispatch);
        tcase_add_test(tc, combine_answered_right);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(client_suite());
        int failed;

        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
