/* integ_proto.c - the daemon's protocol and failure handling, against the real epd binary.
 *
 * Every test starts its own daemon on a temporary socket and stops it again, expecting a clean
 * exit. Covered (docs/architecture.md, "Failure model"; docs/semantics.md §1 and §4):
 * - protocol version mismatch, in Hello and in the frame header, from an older client (version
 *   1, whose ops were protobuf messages) and a newer one;
 * - op records (common/oprec.h) on the socket: a well-formed one is answered with a reply record
 *   inside an OpRecord, a malformed one (each check of the record) closes the connection with a
 *   message naming the fault, and a record whose id is not its frame's is refused too;
 * - group secrets: a wrong or short secret is refused, the right one admitted;
 * - region references past a region's end, or into another client's region, fail the request
 *   without hurting the connection; registration checks the fd against the claimed size;
 * - GPU memory calls (epd_device_alloc/free, epd_region_register_device) with a daemon that
 *   cannot import GPU memory, or a libepd without CUDA: argument checks, then UNAVAILABLE;
 * - malformed frames (oversized, truncated, garbled, bad magic, fd accounting) close that one
 *   connection, close every fd that came with them, and leave other clients working;
 * - a client killed with SIGKILL loses its regions and bindings, and its peers see PEER_LOST;
 * - SIGTERM with clients attached: a clean exit, pending ops ABORTED, later calls UNAVAILABLE;
 * - requests before Hello are refused;
 * - a rank that never submits turns into TIMEOUT on the ranks that did.
 *
 * Raw frames are built with common/frame.h and the generated protobuf-c code, so the tests can
 * send what libepd never would.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "frame.h"
#include "harness.h"
#include "oprec.h"
#include "util.h"

/* The group shape every test uses: small, so arenas and regions stay tiny. */
#define NUM_EXPERTS 8
#define HIDDEN 64
#define MAX_TOKENS 16
#define MAX_TOPK 2
#define ARENA_BYTES (1u << 20)
/* The input region: x at offset 0, topk_idx at TOPK_OFFSET. */
#define REGION_BYTES 4096u
#define TOPK_OFFSET 2048u
#define NUM_TOKENS 4u

/* Large enough for every reply the daemon sends in these tests. */
#define RAW_MAX_BODY H_RAW_MAX_BODY
/* Appended to the failure message when the daemon died. */
#define BAD_FRAME " after a client's bad frame"

/* ---- daemon and client helpers ---- */

static void daemon_start(struct h_daemon *d)
{
        ck_assert_int_eq(h_daemon_start(d, NULL), 0);
}

/* Stops the daemon and expects a clean exit well inside the 5 s that systemd would grant. */
static void daemon_stop_clean(struct h_daemon *d)
{
        ck_assert_int_eq(h_daemon_stop(d, 5000), 0);
}

static struct epd_group_config group_config(uint32_t world_size, uint32_t op_timeout_ms)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg),
                .world_size = world_size,
                .num_experts = NUM_EXPERTS,
                .hidden = HIDDEN,
                .max_tokens_per_rank = MAX_TOKENS,
                .max_topk = MAX_TOPK,
                .dispatch_dtype = EPD_DTYPE_BF16,
                .op_timeout_ms = op_timeout_ms,
                .arena_bytes = ARENA_BYTES,
        };
        return cfg;
}

static int group_enter(struct epd_client *c, int create, const char *name, const void *secret,
                       size_t secret_len, uint32_t rank, const struct epd_group_config *cfg,
                       struct epd_group **out)
{
        struct epd_group_args args = {
                .size = sizeof(args),
                .name = name,
                .secret = secret,
                .secret_len = secret_len,
                .rank = rank,
                .config = cfg,
        };

        return create ? epd_group_create(c, &args, out) : epd_group_join(c, &args, out);
}

static struct epd_group *create_ok(struct epd_client *c, const char *name, uint32_t rank,
                                   const struct epd_group_config *cfg)
{
        unsigned char secret[16];
        struct epd_group *g = NULL;
        int rc;

        h_secret(name, secret);
        rc = group_enter(c, 1, name, secret, sizeof(secret), rank, cfg, &g);
        ck_assert_msg(rc == EPD_OK, "create %s: %s: %s", name, epd_status_name(rc),
                      epd_client_last_error(c));
        return g;
}

static struct epd_group *join_ok(struct epd_client *c, const char *name, uint32_t rank)
{
        unsigned char secret[16];
        struct epd_group *g = NULL;
        int rc;

        h_secret(name, secret);
        rc = group_enter(c, 0, name, secret, sizeof(secret), rank, NULL, &g);
        ck_assert_msg(rc == EPD_OK, "join %s rank %u: %s: %s", name, rank, epd_status_name(rc),
                      epd_client_last_error(c));
        return g;
}

/* A request that needs no group: proof that a connection still gets answers. */
static int size_hint(struct epd_client *c)
{
        struct epd_group_config cfg = group_config(1, 0);
        struct epd_size_hint hint;

        return epd_size_hint(c, &cfg, 1, &hint);
}

/* Dispatch inputs in one registered region: x [NUM_TOKENS, HIDDEN] bf16 at offset 0 and
 * topk_idx [NUM_TOKENS, MAX_TOPK] int64 at TOPK_OFFSET, routing token t to experts t and t+1. */
struct inputs {
        uint8_t *base;
        uint64_t region_id;
        struct epd_tensor x, topk_idx;
};

static void inputs_make(struct epd_client *c, struct inputs *in)
{
        uint64_t x_sizes[2] = { NUM_TOKENS, HIDDEN }, k_sizes[2] = { NUM_TOKENS, MAX_TOPK };
        void *base;
        uint16_t *x;
        int64_t *topk;
        int rc;

        rc = epd_region_alloc(c, REGION_BYTES, &base, &in->region_id);
        ck_assert_msg(rc == EPD_OK, "region alloc: %s", epd_client_last_error(c));
        in->base = base;
        x = base;
        topk = (int64_t *)(in->base + TOPK_OFFSET);
        for (uint32_t i = 0; i < NUM_TOKENS * HIDDEN; i++)
                x[i] = epd_float_to_bf16((float)(i % 251));
        for (uint32_t t = 0; t < NUM_TOKENS; t++)
                for (uint32_t k = 0; k < MAX_TOPK; k++)
                        topk[t * MAX_TOPK + k] = (t + k) % NUM_EXPERTS;
        ck_assert_int_eq(epd_tensor_at(c, x, EPD_DTYPE_BF16, 2, x_sizes, &in->x), EPD_OK);
        ck_assert_int_eq(epd_tensor_at(c, topk, EPD_DTYPE_INT64, 2, k_sizes, &in->topk_idx),
                         EPD_OK);
}

static struct epd_dispatch_args dispatch_args(const struct inputs *in)
{
        struct epd_dispatch_args a = {
                .size = sizeof(a),
                .num_tokens = NUM_TOKENS,
                .x = in->x,
                .topk_idx = in->topk_idx,
                .use_arena = 1,
        };
        return a;
}

/* Whether msg names `number` as a number of its own (not as part of a longer one). */
static int mentions_number(const char *msg, unsigned number)
{
        char digits[16];
        size_t n = (size_t)snprintf(digits, sizeof(digits), "%u", number);

        for (const char *p = strstr(msg, digits); p; p = strstr(p + 1, digits)) {
                int before = p > msg && p[-1] >= '0' && p[-1] <= '9';
                int after = p[n] >= '0' && p[n] <= '9';
                if (!before && !after)
                        return 1;
        }
        return 0;
}

/* ---- epctl ---- */

static json_t *find_client(json_t *clients, pid_t pid)
{
        size_t i;
        json_t *c;

        json_array_foreach(clients, i, c)
                if (json_integer_value(json_object_get(c, "pid")) == pid)
                        return c;
        return NULL;
}

static json_t *find_group(json_t *groups, const char *name)
{
        size_t i;
        json_t *g;

        json_array_foreach(groups, i, g) {
                const char *n = json_string_value(json_object_get(g, "name"));
                if (n && strcmp(n, name) == 0)
                        return g;
        }
        return NULL;
}

static int has_binding(json_t *client, const char *binding)
{
        size_t i;
        json_t *b;

        json_array_foreach(json_object_get(client, "bindings"), i, b)
                if (json_string_value(b) && strcmp(json_string_value(b), binding) == 0)
                        return 1;
        return 0;
}

static long long status_field(const struct h_daemon *d, const char *field)
{
        json_t *st = h_epctl_json(d, "status");
        json_t *v = json_object_get(st, field);
        long long n;

        ck_assert_msg(json_is_integer(v), "epctl status --json has no integer '%s'", field);
        n = json_integer_value(v);
        json_decref(st);
        return n;
}

/* ---- raw frames ---- */

/* Packs req into buf (RAW_MAX_BODY bytes) and returns its length. */
static size_t pack_request(const Epd__V1__Request *req, uint8_t *buf)
{
        size_t len = epd__v1__request__get_packed_size(req);

        ck_assert_uint_le(len, RAW_MAX_BODY);
        return epd__v1__request__pack(req, buf);
}

static void init_status_request(Epd__V1__Request *req, Epd__V1__StatusRequest *sr, uint64_t id)
{
        epd__v1__request__init(req);
        epd__v1__status_request__init(sr);
        req->id = id;
        req->body_case = EPD__V1__REQUEST__BODY_STATUS;
        req->status = sr;
}

static void init_hello(Epd__V1__Request *req, Epd__V1__Hello *hello, uint64_t id)
{
        epd__v1__request__init(req);
        epd__v1__hello__init(hello);
        hello->protocol_version = EPD_PROTOCOL_VERSION;
        hello->client_name = "integ_proto raw";
        req->id = id;
        req->body_case = EPD__V1__REQUEST__BODY_HELLO;
        req->hello = hello;
}

static void init_region_register(Epd__V1__Request *req, Epd__V1__RegionRegister *rr, uint64_t id,
                                 Epd__V1__RegionKind kind)
{
        epd__v1__request__init(req);
        epd__v1__region_register__init(rr);
        rr->kind = kind;
        rr->size = REGION_BYTES;
        req->id = id;
        req->body_case = EPD__V1__REQUEST__BODY_REGION_REGISTER;
        req->region_register = rr;
}

/* Hello/Welcome on a raw connection, so that the next frame is judged on its own. */
static void raw_hello(int sock)
{
        uint8_t body[RAW_MAX_BODY];
        Epd__V1__Request req;
        Epd__V1__Hello hello;
        Epd__V1__Response *resp = NULL;
        size_t len;

        init_hello(&req, &hello, 1);
        len = pack_request(&req, body);
        struct epd_frame_header h = h_good_header(len, 0);
        ck_assert_int_eq(h_raw_send(sock, &h, body, len, NULL, 0, 0), 0);
        ck_assert_int_eq(h_raw_recv(sock, 2000, &resp), 1);
        ck_assert_int_eq(resp->id, 1);
        ck_assert_int_eq(resp->status, EPD__V1__STATUS_CODE__OK);
        ck_assert_int_eq(resp->body_case, EPD__V1__RESPONSE__BODY_WELCOME);
        epd__v1__response__free_unpacked(resp, NULL);
}

/* Asserts that the daemon closes sock within 2 s, after at most one reply, and that such a
 * reply is an error. */
static void expect_closed(int sock, struct h_close_result *out)
{
        h_expect_closed(sock, out);
        ck_assert_msg(out->replies <= 1, "more than one reply before the close");
        ck_assert_msg(out->errors == out->replies, "the reply before the close is not an error");
}

/* ---- 1. protocol version ---- */

START_TEST(test_version_mismatch_hello)
{
        struct h_daemon d;
        struct epd_connect_args args = { .size = sizeof(args), .client_name = "v99",
                                         .protocol_version = 99, .timeout_ms = 5000 };
        struct epd_client *c = NULL;
        char err[512] = "";
        int rc;

        daemon_start(&d);
        args.socket_path = d.socket;
        rc = epd_client_connect(&args, &c, err, sizeof(err));
        ck_assert_msg(rc == EPD_VERSION_MISMATCH, "connect with protocol 99 gave %s: %s",
                      epd_status_name(rc), err);
        ck_assert_ptr_null(c);
        /* docs/semantics.md §4: the message names the numbers involved. */
        ck_assert_msg(mentions_number(err, 99), "message does not name version 99: '%s'", err);
        /* The daemon is unaffected: a client speaking its version still connects. */
        c = h_connect_ok(&d, "v1");
        ck_assert_int_eq(size_hint(c), EPD_OK);
        epd_client_free(c);
        daemon_stop_clean(&d);
}
END_TEST

/* libepd's EPD_CLIENT_POLL_US: a value that is not a number of microseconds in [0, 100000]
 * fails the connect with a message naming the variable; valid values (no polling, the largest)
 * connect and make requests. */
START_TEST(test_client_poll_env)
{
        static const char *const vars[] = { "EPD_CLIENT_POLL_US", "EPD_CLIENT_SPIN_US" };
        static const char *const bad[] = { "abc", "-1", "100001", "12x", "",
                                           "99999999999999999999" };
        struct h_daemon d;
        struct epd_connect_args args = { .size = sizeof(args), .client_name = "poll",
                                         .timeout_ms = 5000 };
        struct epd_client *c = NULL;
        char err[512];
        int rc;

        daemon_start(&d);
        args.socket_path = d.socket;
        for (size_t v = 0; v < EPD_ARRAY_SIZE(vars); v++) {
                for (size_t i = 0; i < EPD_ARRAY_SIZE(bad); i++) {
                        err[0] = '\0';
                        setenv(vars[v], bad[i], 1);
                        rc = epd_client_connect(&args, &c, err, sizeof(err));
                        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "%s='%s' gave %s: %s", vars[v],
                                      bad[i], epd_status_name(rc), err);
                        ck_assert_ptr_null(c);
                        ck_assert_msg(strstr(err, vars[v]) != NULL,
                                      "message does not name the variable: '%s'", err);
                }
                const char *good[] = { "0", "100000", "25" };
                for (size_t i = 0; i < EPD_ARRAY_SIZE(good); i++) {
                        setenv(vars[v], good[i], 1);
                        rc = epd_client_connect(&args, &c, err, sizeof(err));
                        ck_assert_msg(rc == 0, "%s='%s' gave %s: %s", vars[v], good[i],
                                      epd_status_name(rc), err);
                        ck_assert_int_eq(size_hint(c), EPD_OK);
                        epd_client_free(c);
                        c = NULL;
                }
                unsetenv(vars[v]);
        }
        daemon_stop_clean(&d);
}
END_TEST

START_TEST(test_version_mismatch_frame)
{
        /* A client of protocol version 1, and one newer than the daemon. */
        const uint16_t versions[2] = { 1, EPD_PROTOCOL_VERSION + 1 };
        struct h_daemon d;

        daemon_start(&d);
        for (int i = 0; i < 2; i++) {
                uint8_t body[RAW_MAX_BODY];
                Epd__V1__Request req;
                Epd__V1__Hello hello;
                Epd__V1__Response *resp = NULL;
                size_t len;
                int sock = h_raw_connect(&d);

                /* A valid Hello claiming that version, in the body and the frame header. */
                init_hello(&req, &hello, 1);
                hello.protocol_version = versions[i];
                len = pack_request(&req, body);
                struct epd_frame_header h = h_good_header(len, 0);
                h.version = versions[i];
                ck_assert_int_eq(h_raw_send(sock, &h, body, len, NULL, 0, 0), 0);
                ck_assert_msg(h_raw_recv(sock, 2000, &resp) == 1, "no reply to a version-%u frame",
                              versions[i]);
                ck_assert_int_eq(resp->status, EPD__V1__STATUS_CODE__VERSION_MISMATCH);
                ck_assert_msg(resp->message && mentions_number(resp->message, versions[i]) &&
                                      mentions_number(resp->message, EPD_PROTOCOL_VERSION),
                              "VERSION_MISMATCH does not name both versions: '%s'",
                              resp->message ? resp->message : "");
                epd__v1__response__free_unpacked(resp, NULL);
                resp = NULL;
                ck_assert_msg(h_raw_recv(sock, 2000, &resp) == 0,
                              "the connection stays open after VERSION_MISMATCH");
                close(sock);
        }
        h_assert_daemon_alive(&d, BAD_FRAME);
        daemon_stop_clean(&d);
}
END_TEST

/* ---- 2. group secrets ---- */

START_TEST(test_group_secret)
{
        struct h_daemon d;
        struct epd_group_config cfg = group_config(2, 0);
        unsigned char secret[16], wrong[16], longer[17];
        struct epd_group *ga = NULL, *gb = NULL, *gs = NULL;
        struct epd_client *a, *b;
        int rc;

        daemon_start(&d);
        a = h_connect_ok(&d, "a");
        b = h_connect_ok(&d, "b");
        h_secret("g", secret);
        h_secret("not g", wrong);
        ga = create_ok(a, "g", 0, &cfg);

        rc = group_enter(b, 0, "g", wrong, sizeof(wrong), 1, NULL, &gb);
        ck_assert_msg(rc == EPD_PERMISSION_DENIED, "join with a wrong secret: %s",
                      epd_status_name(rc));
        ck_assert_ptr_null(gb);
        ck_assert_msg(epd_client_last_error(b)[0], "PERMISSION_DENIED without a message");
        /* A prefix or an extension of the right secret is a different secret. */
        rc = group_enter(b, 0, "g", secret, sizeof(secret) - 1, 1, NULL, &gb);
        ck_assert_msg(rc == EPD_PERMISSION_DENIED, "join with a 15-byte prefix: %s",
                      epd_status_name(rc));
        memcpy(longer, secret, sizeof(secret));
        longer[16] = 0;
        rc = group_enter(b, 0, "g", longer, sizeof(longer), 1, NULL, &gb);
        ck_assert_msg(rc == EPD_PERMISSION_DENIED, "join with the secret plus a byte: %s",
                      epd_status_name(rc));
        /* The refused attempts left rank 1 free: the right secret binds it. */
        gb = join_ok(b, "g", 1);

        /* A secret shorter than 16 bytes is refused on create. */
        struct epd_group_config one = group_config(1, 0);
        rc = group_enter(a, 1, "short", secret, 15, 0, &one, &gs);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "create with a 15-byte secret: %s",
                      epd_status_name(rc));
        ck_assert_ptr_null(gs);
        rc = group_enter(a, 1, "empty", NULL, 0, 0, &one, &gs);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "create without a secret: %s",
                      epd_status_name(rc));

        /* No group was left behind by the refused creates. */
        json_t *groups = h_epctl_json(&d, "groups");
        ck_assert_int_eq(json_array_size(groups), 1);
        ck_assert_ptr_nonnull(find_group(groups, "g"));
        json_decref(groups);

        ck_assert_int_eq(epd_group_leave(gb), EPD_OK);
        ck_assert_int_eq(epd_group_leave(ga), EPD_OK);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&d);
}
END_TEST

/* ---- 3. region references ---- */

static void expect_dispatch_fails(struct epd_group *g, const struct epd_dispatch_args *args,
                                  int want, const char *what)
{
        struct epd_op *op = NULL;
        int rc = epd_dispatch(g, args, &op);

        ck_assert_msg(rc == want, "%s: dispatch gave %s, expected %s", what,
                      epd_status_name(rc), epd_status_name(want));
        ck_assert_ptr_null(op);
}

START_TEST(test_region_out_of_bounds)
{
        struct h_daemon d;
        struct epd_group_config cfg = group_config(1, 0);
        struct epd_dispatch_result res;
        struct epd_dispatch_args args;
        struct epd_client *c;
        struct epd_group *g;
        struct epd_op *op = NULL;
        struct inputs in;
        const char *msg;
        int rc;

        daemon_start(&d);
        c = h_connect_ok(&d, "oob");
        g = create_ok(c, "g", 0, &cfg);
        inputs_make(c, &in);

        /* x [4, 64] bf16 is 512 bytes; at offset size-256 it runs 256 bytes past the end. */
        args = dispatch_args(&in);
        args.x.offset = REGION_BYTES - 256;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT, "x past the region's end");
        msg = epd_client_last_error(c);
        ck_assert_msg(strstr(msg, "region"), "the message does not mention the region: '%s'", msg);
        ck_assert_msg(mentions_number(msg, (unsigned)in.region_id),
                      "the message does not name region %llu: '%s'",
                      (unsigned long long)in.region_id, msg);

        /* The same connection is served on: a size hint and a valid dispatch succeed. */
        ck_assert_int_eq(size_hint(c), EPD_OK);
        args = dispatch_args(&in);
        rc = epd_dispatch(g, &args, &op);
        ck_assert_msg(rc == EPD_OK, "valid dispatch after a rejected one: %s: %s",
                      epd_status_name(rc), epd_client_last_error(c));
        ck_assert_int_eq(epd_op_dispatch_result(op, &res), EPD_OK);
        ck_assert_int_eq(res.num_recv_tokens, NUM_TOKENS);
        ck_assert_ptr_nonnull(res.recv_x_ptr);
        ck_assert_msg(memcmp(res.recv_x_ptr, in.base, NUM_TOKENS * HIDDEN * 2) == 0,
                      "the dispatch after the rejected one moved the wrong bytes");
        ck_assert_int_eq(epd_handle_release(g, res.handle_id), EPD_OK);
        epd_op_free(op);

        /* Other ways past the end: an offset beyond the region, an offset whose sum with the
         * extent wraps around 2^64, and an input whose rows end exactly at the region's end
         * plus one stride. */
        args = dispatch_args(&in);
        args.x.offset = REGION_BYTES + 64;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT, "x offset beyond the region");
        args = dispatch_args(&in);
        args.x.offset = UINT64_MAX - 100;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT, "x offset near 2^64");
        args = dispatch_args(&in);
        args.topk_idx.offset = REGION_BYTES - NUM_TOKENS * MAX_TOPK * 8 + 8;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT, "topk_idx 8 bytes past the end");
        args = dispatch_args(&in);
        args.x.strides[0] = HIDDEN * 4; /* rows spaced out: 3 strides + 1 row = 1664 bytes */
        args.x.strides[1] = 1;
        args.x.offset = REGION_BYTES - 1600;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT, "strided x past the end");

        /* Outputs are checked too: recv_x declared with a capacity the region cannot hold. */
        args = dispatch_args(&in);
        args.use_arena = 0;
        args.recv_x = in.x;
        args.recv_x.sizes[0] = MAX_TOKENS; /* 16 rows of 128 bytes from offset 2048+ */
        args.recv_x.offset = TOPK_OFFSET + 128;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT, "recv_x capacity past the end");
        msg = epd_client_last_error(c);
        ck_assert_msg(strstr(msg, "region"), "the message does not mention the region: '%s'", msg);

        /* Still served after all of that. */
        args = dispatch_args(&in);
        op = NULL;
        ck_assert_int_eq(epd_dispatch(g, &args, &op), EPD_OK);
        ck_assert_int_eq(epd_op_dispatch_result(op, &res), EPD_OK);
        ck_assert_int_eq(epd_handle_release(g, res.handle_id), EPD_OK);
        epd_op_free(op);

        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(c);
        daemon_stop_clean(&d);
}
END_TEST

START_TEST(test_region_of_other_client)
{
        struct h_daemon d;
        struct epd_group_config cfg = group_config(1, 0);
        struct epd_dispatch_args args;
        struct epd_client *a, *b;
        struct epd_group *g;
        struct epd_op *op = NULL;
        struct inputs in;
        void *b_ptr;
        uint64_t b_region;
        const char *msg;

        daemon_start(&d);
        a = h_connect_ok(&d, "a");
        b = h_connect_ok(&d, "b");
        g = create_ok(a, "g", 0, &cfg);
        inputs_make(a, &in);
        ck_assert_int_eq(epd_region_alloc(b, REGION_BYTES, &b_ptr, &b_region), EPD_OK);
        ck_assert_uint_ne(b_region, in.region_id);
        /* B's bytes are a valid input in every respect but their owner. */
        memcpy(b_ptr, in.base, REGION_BYTES);

        args = dispatch_args(&in);
        args.x.region_id = b_region;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT, "x in another client's region");
        msg = epd_client_last_error(a);
        ck_assert_msg(strstr(msg, "region"), "the message does not mention the region: '%s'", msg);

        args = dispatch_args(&in);
        args.use_arena = 0;
        args.recv_x = in.x;
        args.recv_x.region_id = b_region;
        args.recv_x.offset = 0;
        expect_dispatch_fails(g, &args, EPD_INVALID_ARGUMENT,
                              "recv_x in another client's region");

        /* Nor can A release B's region. */
        ck_assert_int_eq(epd_region_release(a, b_region), EPD_NOT_FOUND);

        /* A's own region still works, and B still owns its region. */
        args = dispatch_args(&in);
        ck_assert_int_eq(epd_dispatch(g, &args, &op), EPD_OK);
        epd_op_free(op);
        ck_assert_int_eq(epd_region_release(b, b_region), EPD_OK);

        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&d);
}
END_TEST

/* epd_tensor_at among many regions, whose mappings lie wherever the kernel put them: every
 * pointer resolves to a region that holds the whole tensor, at the right offset, or to
 * NOT_FOUND when none does; so after a scattered half of them is released. The expected answer
 * is worked out by scanning the test's own list. */
struct held_region {
        uint8_t *base;
        uint64_t bytes, id;
        int held;
};

static void check_tensor_at(struct epd_client *c, const struct held_region *h, unsigned n,
                            const uint8_t *p, uint64_t len)
{
        struct epd_tensor t;
        const uint64_t sizes[1] = { len };
        int want = 0;

        for (unsigned i = 0; i < n; i++)
                want |= h[i].held && p >= h[i].base && p + len <= h[i].base + h[i].bytes;
        int rc = epd_tensor_at(c, p, EPD_DTYPE_FP8_E4M3, 1, sizes, &t);
        if (!want) {
                ck_assert_msg(rc == EPD_NOT_FOUND, "%p + %llu resolved (rc %d) outside every region",
                              (const void *)p, (unsigned long long)len, rc);
                return;
        }
        ck_assert_msg(rc == EPD_OK, "%p + %llu: %s", (const void *)p, (unsigned long long)len,
                      epd_client_last_error(c));
        for (unsigned i = 0; i < n; i++)
                if (h[i].held && h[i].id == t.region_id) {
                        ck_assert_ptr_eq(h[i].base + t.offset, p);
                        ck_assert_uint_le(t.offset + len, h[i].bytes);
                        return;
                }
        ck_assert_msg(0, "%p resolved to region %llu, not one of the held ones", (const void *)p,
                      (unsigned long long)t.region_id);
}

START_TEST(test_tensor_at_many_regions)
{
        enum { N = 300 };
        struct h_daemon d;
        struct held_region *h = calloc(N, sizeof(*h));
        struct epd_client *c;

        ck_assert_ptr_nonnull(h);
        daemon_start(&d);
        c = h_connect_ok(&d, "many");
        for (unsigned i = 0; i < N; i++) {
                void *p;
                h[i].bytes = 4096u * (1 + i % 3);
                ck_assert_int_eq(epd_region_alloc(c, h[i].bytes, &p, &h[i].id), EPD_OK);
                h[i].base = p;
                h[i].held = 1;
        }
        for (int round = 0; round < 2; round++) {
                for (unsigned i = 0; i < N; i++) {
                        const uint8_t *b = h[i].base;
                        check_tensor_at(c, h, N, b, 1);
                        check_tensor_at(c, h, N, b + h[i].bytes / 2, 64);
                        check_tensor_at(c, h, N, b + h[i].bytes - 8, 8);
                        check_tensor_at(c, h, N, b + h[i].bytes - 8, 16); /* runs past the end */
                        check_tensor_at(c, h, N, b, h[i].bytes);
                }
                /* Release a scattered half (held entries keep their addresses). */
                for (unsigned i = round; i < N; i += 2) {
                        if (!h[i].held || (i * 7) % 3 == 0)
                                continue;
                        ck_assert_int_eq(epd_region_release(c, h[i].id), EPD_OK);
                        h[i].held = 0;
                }
        }
        epd_client_free(c);
        free(h);
        daemon_stop_clean(&d);
}
END_TEST

/* Registration is where a region's bounds come from, so the daemon checks the fd it receives:
 * the claimed size must fit the file, and the file must be sealed against shrinking (else a
 * client could truncate it and make the daemon fault on a later access). */
START_TEST(test_region_register_checks)
{
        struct h_daemon d;
        struct epd_client *c;
        uint64_t id = 0;
        int fd, pipefd[2], rc;
        void *p;

        daemon_start(&d);
        c = h_connect_ok(&d, "registrar");

        /* A size larger than the memfd. */
        ck_assert_int_eq(epd_memfd_alloc(REGION_BYTES, &fd, &p), EPD_OK);
        rc = epd_region_register_fd(c, EPD_REGION_HOST_MEMFD, fd, 2 * REGION_BYTES, 0, p, &id);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "a region larger than its memfd: %s",
                      epd_status_name(rc));
        /* A size of 0. */
        rc = epd_region_register_fd(c, EPD_REGION_HOST_MEMFD, fd, 0, 0, p, &id);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "a region of 0 bytes: %s", epd_status_name(rc));
        /* The right size is accepted, and from then on the client cannot shrink the file. */
        rc = epd_region_register_fd(c, EPD_REGION_HOST_MEMFD, fd, REGION_BYTES, 0, p, &id);
        ck_assert_msg(rc == EPD_OK, "a valid region: %s: %s", epd_status_name(rc),
                      epd_client_last_error(c));
        ck_assert_msg(ftruncate(fd, 0) < 0 && errno == EPERM,
                      "a registered memfd can still be shrunk under the daemon");
        ck_assert_int_eq(epd_region_release(c, id), EPD_OK);
        munmap(p, REGION_BYTES);
        close(fd);

        /* A memfd that cannot be sealed. */
        fd = memfd_create("integ-unsealable", MFD_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(ftruncate(fd, REGION_BYTES), 0);
        rc = epd_region_register_fd(c, EPD_REGION_HOST_MEMFD, fd, REGION_BYTES, 0, NULL, &id);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "an unsealable memfd: %s",
                      epd_status_name(rc));
        ck_assert_msg(strstr(epd_client_last_error(c), "MFD_ALLOW_SEALING"),
                      "an unsealable memfd: '%s'", epd_client_last_error(c));
        close(fd);

        /* A sealable memfd reopened read-only: refused for being read-only, not for sealing. */
        {
                char path[64];
                int ro;

                ck_assert_int_eq(epd_memfd_alloc(REGION_BYTES, &fd, &p), EPD_OK);
                snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
                ro = open(path, O_RDONLY | O_CLOEXEC);
                ck_assert_int_ge(ro, 0);
                rc = epd_region_register_fd(c, EPD_REGION_HOST_MEMFD, ro, REGION_BYTES, 0, NULL,
                                            &id);
                ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "a read-only memfd: %s",
                              epd_status_name(rc));
                ck_assert_msg(strstr(epd_client_last_error(c), "O_RDWR"),
                              "a read-only memfd: '%s'", epd_client_last_error(c));
                close(ro);
                munmap(p, REGION_BYTES);
                close(fd);
        }

        /* Not a file at all; the daemon must still close the fd it was given. */
        ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
        rc = epd_region_register_fd(c, EPD_REGION_HOST_MEMFD, pipefd[1], REGION_BYTES, 0, NULL,
                                    &id);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "a pipe as a region: %s", epd_status_name(rc));
        close(pipefd[1]);
        h_expect_pipe_eof(pipefd[0]);
        close(pipefd[0]);

        /* None of that cost the connection, and nothing was left registered. */
        ck_assert_int_eq(size_hint(c), EPD_OK);
        ck_assert_int_eq(status_field(&d, "regions"), 0);
        ck_assert_int_eq(h_daemon_region_mappings(&d), 0);
        epd_client_free(c);
        daemon_stop_clean(&d);
}
END_TEST

/* GPU memory calls where the daemon cannot import GPU memory (a host daemon), and in a libepd
 * built without CUDA (the stubs in client/client.c): argument checks first, then
 * EPD_UNAVAILABLE with a message, before CUDA is touched; outputs untouched; the connection
 * unharmed. The same answers come from both builds. */
START_TEST(test_device_memory_unavailable)
{
        static const char *const host_args[] = { "--backend", "host", NULL };
        struct h_daemon d;
        struct epd_client *c;
        void *p = &d;
        uint64_t id = 77;
        int local = 0, rc;

        ck_assert_int_eq(h_daemon_start(&d, host_args), 0);
        c = h_connect_ok(&d, "device-memory");

        ck_assert_int_eq(epd_device_alloc(NULL, 0, 4096, &p, &id), EPD_INVALID_ARGUMENT);
        rc = epd_device_alloc(c, 0, 0, &p, &id);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "0 bytes: %s", epd_status_name(rc));
        ck_assert_msg(strstr(epd_client_last_error(c), "epd_device_alloc"),
                      "0 bytes: the message is '%s'", epd_client_last_error(c));
        ck_assert_int_eq(epd_device_alloc(c, 0, 4096, NULL, &id), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_device_alloc(c, 0, 4096, &p, NULL), EPD_INVALID_ARGUMENT);
        rc = epd_device_alloc(c, 0, 4096, &p, &id);
        ck_assert_msg(rc == EPD_UNAVAILABLE, "epd_device_alloc with a host daemon: %s",
                      epd_status_name(rc));
        ck_assert_msg(epd_client_last_error(c)[0], "EPD_UNAVAILABLE without a message");
        printf("epd_device_alloc: %s\n", epd_client_last_error(c));
        ck_assert_msg(p == (void *)&d && id == 77, "a failed epd_device_alloc wrote its outputs");

        ck_assert_int_eq(epd_device_free(c, NULL), EPD_OK);
        ck_assert_int_eq(epd_device_free(NULL, &local), EPD_INVALID_ARGUMENT);
        rc = epd_device_free(c, &local);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "freeing a foreign pointer: %s",
                      epd_status_name(rc));
        ck_assert_msg(strstr(epd_client_last_error(c), "epd_device_alloc"),
                      "freeing a foreign pointer: the message is '%s'", epd_client_last_error(c));

        rc = epd_region_register_device(c, &local, sizeof(local), 0, &id);
        ck_assert_msg(rc == EPD_UNAVAILABLE, "epd_region_register_device with a host daemon: %s",
                      epd_status_name(rc));
        ck_assert_msg(epd_client_last_error(c)[0], "EPD_UNAVAILABLE without a message");
        ck_assert_int_eq(id, 77);

        ck_assert_int_eq(size_hint(c), EPD_OK);
        ck_assert_int_eq(status_field(&d, "regions"), 0);
        epd_client_free(c);
        daemon_stop_clean(&d);
}
END_TEST

/* ---- 4. malformed frames ---- */

enum bad_kind {
        BAD_OVERSIZED,         /* body larger than max_frame_bytes */
        BAD_TRUNCATED,         /* header length larger than the body sent */
        BAD_PADDED,            /* header length smaller than the body sent */
        BAD_SHORT,             /* a record shorter than the header */
        BAD_GARBLED,           /* valid header, body that is not a Request */
        BAD_MAGIC,
        BAD_RESERVED,          /* reserved header field not zero */
        BAD_UNANNOUNCED_FD,    /* one fd attached, header says 0 */
        BAD_MISSING_FD,        /* header says 1 fd, none attached */
        BAD_REGION_NO_FD,      /* RegionRegister(HOST_MEMFD) without its fd */
        BAD_REGION_EXTRA_FD,   /* RegionRegister(CUDA_IPC), which takes no fd, with one */
        BAD_FD_ON_STATUS,      /* an announced fd on a request that takes none */
        BAD_TOO_MANY_FDS,      /* more fds than max_fds_per_frame (8 by default) */
        BAD_GARBLED_WITH_FD,
        BAD_OVERSIZED_WITH_FD,
        BAD_VERSION_WITH_FD,
};

struct bad_case {
        const char *name;
        enum bad_kind kind;
        unsigned fd_copies;    /* copies of a pipe's write end attached to the frame */
};

static const struct bad_case bad_cases[] = {
        { "oversized", BAD_OVERSIZED, 0 },
        { "truncated", BAD_TRUNCATED, 0 },
        { "padded", BAD_PADDED, 0 },
        { "short record", BAD_SHORT, 0 },
        { "garbled body", BAD_GARBLED, 0 },
        { "bad magic", BAD_MAGIC, 0 },
        { "reserved field", BAD_RESERVED, 0 },
        { "unannounced fd", BAD_UNANNOUNCED_FD, 1 },
        { "missing fd", BAD_MISSING_FD, 0 },
        { "region register without fd", BAD_REGION_NO_FD, 0 },
        { "region register with an extra fd", BAD_REGION_EXTRA_FD, 1 },
        { "fd on a status request", BAD_FD_ON_STATUS, 1 },
        { "too many fds", BAD_TOO_MANY_FDS, 9 },
        { "garbled body with fd", BAD_GARBLED_WITH_FD, 1 },
        { "oversized with fd", BAD_OVERSIZED_WITH_FD, 1 },
        { "newer version with fd", BAD_VERSION_WITH_FD, 1 },
};

/* Fills buf with seeded random bytes that protobuf-c refuses as a Request. */
static void garbled_body(uint8_t *buf, size_t len)
{
        uint64_t seed = 0x9e3779b97f4a7c15ull;

        for (int attempt = 0; attempt < 1000; attempt++) {
                for (size_t i = 0; i < len; i++) {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        buf[i] = (uint8_t)(seed >> 32);
                }
                Epd__V1__Request *req = epd__v1__request__unpack(NULL, len, buf);
                if (!req)
                        return;
                epd__v1__request__free_unpacked(req, NULL);
        }
        ck_abort_msg("no undecodable random body found");
}

/* Sends the bad frame of case k on sock, attaching fds. */
static void send_bad_frame(int sock, const struct bad_case *k, const int *fds)
{
        static uint8_t body[RAW_MAX_BODY];
        Epd__V1__Request req;
        Epd__V1__StatusRequest sr;
        Epd__V1__RegionRegister rr;
        struct epd_frame_header h;
        size_t len;
        unsigned nfds = k->fd_copies;
        int rc;

        init_status_request(&req, &sr, 2);
        len = pack_request(&req, body);
        h = h_good_header(len, nfds);
        switch (k->kind) {
        case BAD_OVERSIZED:
        case BAD_OVERSIZED_WITH_FD:
                /* The daemon must refuse on size alone, before decoding anything, so the
                 * body is plain filler. */
                len = EPD_DEFAULT_MAX_FRAME_BYTES + 4096;
                memset(body, 0, len);
                h.length = (uint32_t)len;
                break;
        case BAD_TRUNCATED:
                h.length = (uint32_t)len + 100;
                break;
        case BAD_PADDED:
                ck_assert_uint_gt(len, 1);
                h.length = (uint32_t)len - 1;
                break;
        case BAD_SHORT: {
                uint8_t header[EPD_FRAME_HEADER_BYTES];
                epd_frame_header_encode(&h, header);
                ck_assert_int_eq(send(sock, header, 8, MSG_NOSIGNAL), 8);
                return;
        }
        case BAD_GARBLED:
        case BAD_GARBLED_WITH_FD:
                len = 64;
                garbled_body(body, len);
                h.length = (uint32_t)len;
                break;
        case BAD_MAGIC:
                h.magic = 0x46445046u;
                break;
        case BAD_RESERVED:
                h.reserved = 1;
                break;
        case BAD_UNANNOUNCED_FD:
                h.num_fds = 0;
                break;
        case BAD_MISSING_FD:
                h.num_fds = 1;
                break;
        case BAD_REGION_NO_FD:
                init_region_register(&req, &rr, 2, EPD__V1__REGION_KIND__HOST_MEMFD);
                len = pack_request(&req, body);
                h = h_good_header(len, 0);
                break;
        case BAD_REGION_EXTRA_FD:
                init_region_register(&req, &rr, 2, EPD__V1__REGION_KIND__CUDA_IPC);
                len = pack_request(&req, body);
                h = h_good_header(len, nfds);
                break;
        case BAD_FD_ON_STATUS:
        case BAD_TOO_MANY_FDS:
                break;
        case BAD_VERSION_WITH_FD:
                h.version = EPD_PROTOCOL_VERSION + 1;
                break;
        }
        rc = h_raw_send(sock, &h, body, len, fds, nfds, 0);
        ck_assert_msg(rc == 0, "sending the '%s' frame: %s", k->name, strerror(-rc));
}

START_TEST(test_bad_frame)
{
        const struct bad_case *k = &bad_cases[_i];
        struct h_daemon d;
        struct epd_client *other;
        struct h_close_result cr;
        int pipefd[2] = { -1, -1 }, fds[16];
        int sock;

        daemon_start(&d);
        other = h_connect_ok(&d, "bystander");
        ck_assert_int_eq(size_hint(other), EPD_OK);
        sock = h_raw_connect(&d);
        raw_hello(sock);
        if (k->fd_copies) {
                ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
                for (unsigned i = 0; i < k->fd_copies; i++)
                        fds[i] = pipefd[1];
        }
        send_bad_frame(sock, k, fds);
        expect_closed(sock, &cr);
        if (cr.replies)
                ck_assert_msg(cr.status == EPD_INVALID_ARGUMENT ||
                                      (k->kind == BAD_VERSION_WITH_FD &&
                                       cr.status == EPD_VERSION_MISMATCH),
                              "'%s': the reply before the close is %s", k->name,
                              epd_status_name(cr.status));
        close(sock);
        if (k->fd_copies) {
                /* Every copy the daemon received must be closed with the rejected frame. */
                close(pipefd[1]);
                h_expect_pipe_eof(pipefd[0]);
                close(pipefd[0]);
        }

        /* The daemon and its other clients are unaffected. */
        h_assert_daemon_alive(&d, BAD_FRAME);
        ck_assert_msg(size_hint(other) == EPD_OK, "'%s': the bystander failed afterwards: %s",
                      k->name, epd_client_last_error(other));
        /* The bad connection is gone from the daemon's tables: the bystander and epctl remain. */
        ck_assert_int_eq(status_field(&d, "clients"), 2);
        epd_client_free(other);
        daemon_stop_clean(&d);
}
END_TEST

/* ---- 5. SIGKILL of a client ---- */

struct victim_args {
        const struct h_daemon *daemon;
        int ready_fd;
};

/* The victim: two regions and rank 0 of "g", then it waits to be killed. */
static int victim_main(void *arg, int index)
{
        struct victim_args *v = arg;
        struct epd_group_config cfg = group_config(2, 10000);
        struct epd_group_args ga = { .size = sizeof(ga), .name = "g", .rank = 0, .config = &cfg };
        unsigned char secret[16];
        struct epd_client *c;
        struct epd_group *g;
        uint64_t id;
        void *p;

        (void)index;
        c = h_connect(v->daemon, "victim");
        if (!c)
                return 1;
        if (epd_region_alloc(c, REGION_BYTES, &p, &id) < 0 ||
            epd_region_alloc(c, 2 * REGION_BYTES, &p, &id) < 0)
                return 2;
        h_secret("g", secret);
        ga.secret = secret;
        ga.secret_len = sizeof(secret);
        if (epd_group_create(c, &ga, &g) < 0) {
                fprintf(stderr, "victim: %s\n", epd_client_last_error(c));
                return 3;
        }
        if (write(v->ready_fd, "R", 1) != 1)
                return 4;
        for (;;)
                pause();
}

/* ---- op records on the socket ---- */

/* Sends the op record rec (len bytes) in an OpRecord of request id `id`. */
static void send_op_record(int sock, uint64_t id, const uint8_t *rec, size_t len)
{
        uint8_t body[RAW_MAX_BODY];
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__OpRecord wrap = EPD__V1__OP_RECORD__INIT;

        wrap.record.data = (uint8_t *)rec;
        wrap.record.len = len;
        req.id = id;
        req.body_case = EPD__V1__REQUEST__BODY_OP;
        req.op = &wrap;
        const size_t n = pack_request(&req, body);
        struct epd_frame_header h = h_good_header(n, 0);
        ck_assert_int_eq(h_raw_send(sock, &h, body, n, NULL, 0, 0), 0);
}

START_TEST(test_op_record_on_socket)
{
        struct h_daemon d;
        struct epd_op_request q = { .id = 2, .kind = EPD_OPREC_DISPATCH, .group_id = 77 };
        uint8_t rec[EPD_OPREC_REQUEST_BYTES];
        char err[160];
        Epd__V1__Response *resp = NULL;

        daemon_start(&d);
        int sock = h_raw_connect(&d);
        raw_hello(sock);
        /* A well-formed dispatch of a group that does not exist: a reply record says so. */
        ck_assert_int_eq(epd_oprec_request_encode(&q, rec, sizeof(rec), err, sizeof(err)),
                         (int)sizeof(rec));
        send_op_record(sock, 2, rec, sizeof(rec));
        ck_assert_int_eq(h_raw_recv(sock, 2000, &resp), 1);
        ck_assert_uint_eq(resp->id, 2);
        ck_assert_int_eq(resp->status, EPD__V1__STATUS_CODE__NOT_FOUND);
        ck_assert_int_eq(resp->body_case, EPD__V1__RESPONSE__BODY_OP);
        uint64_t aligned[(EPD_OPREC_REPLY_HEADER_BYTES + EPD_OPREC_MESSAGE_MAX) / 8];
        ck_assert_uint_le(resp->op->record.len, sizeof(aligned));
        memcpy(aligned, resp->op->record.data, resp->op->record.len);
        struct epd_op_reply rep;
        ck_assert_int_eq(epd_oprec_reply_decode((const uint8_t *)aligned, resp->op->record.len,
                                                &rep, err, sizeof(err)),
                         0);
        ck_assert_uint_eq(rep.id, 2);
        ck_assert_uint_eq(rep.kind, EPD_OPREC_DISPATCH);
        ck_assert_int_eq(rep.status, EPD_NOT_FOUND);
        ck_assert_msg(rep.message && strstr(rep.message, "group 77"), "message: %s",
                      rep.message ? rep.message : "(none)");
        epd__v1__response__free_unpacked(resp, NULL);
        close(sock);

        /* Malformed records close the connection with a message naming the fault; so does a
         * record whose id is not its frame's. */
        static const struct {
                const char *what, *words;
        } bad[] = {
                { "truncated", "shorter than" }, { "version", "version" },
                { "size", "states" },            { "kind", "kind" },
                { "layout", "layout" },          { "dims", "dims" },
                { "id", "op record id" },
        };
        for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                struct h_close_result res;
                size_t len = sizeof(rec);
                uint64_t id = 3;

                q.id = 3;
                ck_assert_int_gt(epd_oprec_request_encode(&q, rec, sizeof(rec), err, sizeof(err)),
                                 0);
                switch (i) {
                case 0: len = 10; break;
                case 1: rec[0] = 7; break;
                case 2: rec[4] = 0xff; break;          /* states more bytes than came */
                case 3: rec[2] = 3; break;
                case 4: rec[56] = 2; break;            /* layout */
                case 5: rec[72] = 1; rec[92] = 9; break; /* slot 0: present, 9 dims */
                case 6: id = 4; break;
                }
                sock = h_raw_connect(&d);
                raw_hello(sock);
                send_op_record(sock, id, rec, len);
                ck_assert_int_eq(h_raw_recv(sock, 2000, &resp), 1);
                ck_assert_int_eq(resp->status, EPD__V1__STATUS_CODE__INVALID_ARGUMENT);
                ck_assert_msg(resp->message && strstr(resp->message, "protocol error") &&
                                      strstr(resp->message, bad[i].words),
                              "%s: '%s'", bad[i].what, resp->message ? resp->message : "");
                epd__v1__response__free_unpacked(resp, NULL);
                resp = NULL;
                h_expect_closed(sock, &res);
                close(sock);
        }
        h_assert_daemon_alive(&d, "after malformed op records");
        daemon_stop_clean(&d);
}
END_TEST

START_TEST(test_sigkill_releases_client)
{
        struct h_daemon d;
        struct victim_args v;
        struct epd_dispatch_args args;
        struct pollfd pfd;
        struct epd_client *c;
        struct epd_group *g;
        struct epd_op *op = NULL;
        struct inputs in;
        json_t *clients, *groups, *entry, *grp, *ranks;
        int ready[2], status, rc;
        long long deadline, t0;
        pid_t pid;
        char byte;

        daemon_start(&d);
        ck_assert_int_eq(pipe2(ready, O_CLOEXEC), 0);
        v.daemon = &d;
        v.ready_fd = ready[1];
        /* Spawned before this process connects, so it inherits no connection of ours. */
        pid = h_spawn(victim_main, &v, 0);
        ck_assert_int_gt(pid, 0);
        close(ready[1]);
        pfd = (struct pollfd){ .fd = ready[0], .events = POLLIN };
        ck_assert_msg(poll(&pfd, 1, 5000) == 1 && read(ready[0], &byte, 1) == 1,
                      "the victim did not get ready");
        close(ready[0]);

        c = h_connect_ok(&d, "survivor");
        g = join_ok(c, "g", 1);
        inputs_make(c, &in);

        clients = h_epctl_json(&d, "clients");
        entry = find_client(clients, pid);
        ck_assert_msg(entry != NULL, "epctl clients does not list the victim pid %d", (int)pid);
        ck_assert_int_eq(json_integer_value(json_object_get(entry, "regions")), 2);
        ck_assert_msg(has_binding(entry, "g/0"), "the victim's binding g/0 is not listed");
        ck_assert_msg(has_binding(find_client(clients, getpid()), "g/1"),
                      "the survivor's binding g/1 is not listed");
        json_decref(clients);
        ck_assert_int_eq(status_field(&d, "regions"), 3);
        ck_assert_int_eq(h_daemon_region_mappings(&d), 3);

        /* An op waits for the victim when it dies: it must end with PEER_LOST, not hang. */
        args = dispatch_args(&in);
        ck_assert_int_eq(epd_dispatch_submit(g, &args, &op), EPD_OK);
        t0 = h_now_ms();
        ck_assert_int_eq(kill(pid, SIGKILL), 0);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        rc = epd_op_wait(op, 2000);
        ck_assert_msg(epd_op_status(op) == EPD_PEER_LOST,
                      "the pending op gave %s (wait %s) after its peer died: %s",
                      epd_status_name(epd_op_status(op)), epd_status_name(rc), epd_op_error(op));
        ck_assert_msg(strstr(epd_op_error(op), "rank 0"), "PEER_LOST does not name rank 0: '%s'",
                      epd_op_error(op));
        epd_op_free(op);

        /* The daemon forgets the victim within 2 s. */
        deadline = t0 + 2000;
        for (;;) {
                clients = h_epctl_json(&d, "clients");
                entry = find_client(clients, pid);
                json_decref(clients);
                if (!entry)
                        break;
                ck_assert_msg(h_now_ms() < deadline, "the killed client is still listed after 2 s");
                usleep(20000);
        }
        groups = h_epctl_json(&d, "groups");
        grp = find_group(groups, "g");
        ck_assert_msg(grp != NULL, "group g vanished although rank 1 is still bound");
        ranks = json_object_get(grp, "ranks");
        ck_assert_int_eq(json_array_size(ranks), 2);
        ck_assert_msg(json_is_false(json_object_get(json_array_get(ranks, 0), "bound")),
                      "rank 0 is still bound after its client was killed");
        ck_assert_msg(json_is_true(json_object_get(json_array_get(ranks, 1), "bound")),
                      "rank 1 lost its binding");
        ck_assert_str_eq(json_string_value(json_object_get(grp, "state")), "BROKEN");
        json_decref(groups);
        /* The victim's two regions are released; only the survivor's input region is left. */
        ck_assert_int_eq(status_field(&d, "regions"), 1);
        ck_assert_msg(h_daemon_region_mappings(&d) == 1,
                      "the daemon still maps %d client regions; only the survivor's one is live",
                      h_daemon_region_mappings(&d));

        /* A broken group answers at once rather than waiting for the dead rank. */
        op = NULL;
        rc = epd_dispatch_submit(g, &args, &op);
        ck_assert_int_eq(rc, EPD_OK);
        epd_op_wait(op, 2000);
        ck_assert_int_eq(epd_op_status(op), EPD_PEER_LOST);
        epd_op_free(op);

        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(c);
        daemon_stop_clean(&d);
}
END_TEST

/* ---- 6. SIGTERM with clients attached ---- */

START_TEST(test_sigterm_with_clients)
{
        struct h_daemon d;
        struct epd_group_config cfg = group_config(2, 10000);
        struct epd_dispatch_args args;
        struct epd_client *a, *b, *late = NULL;
        struct epd_connect_args cargs = { .size = sizeof(cargs), .timeout_ms = 2000 };
        struct epd_group *g;
        struct epd_op *op = NULL;
        struct inputs in;
        char socket_path[sizeof(d.socket)], err[256];
        long long t0;
        int rc;

        daemon_start(&d);
        snprintf(socket_path, sizeof(socket_path), "%s", d.socket);
        a = h_connect_ok(&d, "bound");
        b = h_connect_ok(&d, "idle");
        g = create_ok(a, "g", 0, &cfg);
        inputs_make(a, &in);
        /* An op that waits for rank 1, which nobody holds. */
        args = dispatch_args(&in);
        ck_assert_int_eq(epd_dispatch_submit(g, &args, &op), EPD_OK);
        ck_assert_int_eq(size_hint(b), EPD_OK);

        t0 = h_now_ms();
        daemon_stop_clean(&d);
        ck_assert_int_lt(h_now_ms() - t0, 5000);

        /* The pending op was answered before the connection closed. */
        rc = epd_op_wait(op, 2000);
        ck_assert_msg(epd_op_status(op) == EPD_ABORTED,
                      "the pending op gave %s (wait %s) at shutdown: %s",
                      epd_status_name(epd_op_status(op)), epd_status_name(rc), epd_op_error(op));
        epd_op_free(op);

        /* Every later call fails at once with UNAVAILABLE. */
        t0 = h_now_ms();
        ck_assert_int_eq(size_hint(a), EPD_UNAVAILABLE);
        ck_assert_int_eq(size_hint(b), EPD_UNAVAILABLE);
        op = NULL;
        rc = epd_dispatch_submit(g, &args, &op);
        if (rc == EPD_OK) {
                rc = epd_op_wait(op, 2000);
                epd_op_free(op);
        }
        ck_assert_int_eq(rc, EPD_UNAVAILABLE);
        ck_assert_int_eq(epd_group_leave(g), EPD_UNAVAILABLE);
        ck_assert_int_lt(h_now_ms() - t0, 1000);
        cargs.socket_path = socket_path;
        ck_assert_int_eq(epd_client_connect(&cargs, &late, err, sizeof(err)), EPD_UNAVAILABLE);
        epd_client_free(b);
        epd_client_free(a);
}
END_TEST

/* ---- 7. requests before Hello ---- */

START_TEST(test_request_before_hello)
{
        struct h_daemon d;
        uint8_t body[RAW_MAX_BODY];
        Epd__V1__Request req;
        Epd__V1__StatusRequest sr;
        Epd__V1__RegionRegister rr;
        struct h_close_result cr;
        struct epd_client *other;
        struct epd_frame_header h;
        size_t len;
        int sock, pipefd[2], memfd;
        void *p;

        daemon_start(&d);
        other = h_connect_ok(&d, "bystander");

        sock = h_raw_connect(&d);
        init_status_request(&req, &sr, 7);
        len = pack_request(&req, body);
        h = h_good_header(len, 0);
        ck_assert_int_eq(h_raw_send(sock, &h, body, len, NULL, 0, 0), 0);
        expect_closed(sock, &cr);
        ck_assert_msg(cr.replies == 1, "no error reply to a StatusRequest before Hello");
        ck_assert_int_eq(cr.status, EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(cr.id, 7);
        ck_assert_msg(strstr(cr.message, "Hello"), "the message does not mention Hello: '%s'",
                      cr.message);
        close(sock);

        /* A region registration before Hello is refused the same way, and its fd is closed. */
        ck_assert_int_eq(epd_memfd_alloc(REGION_BYTES, &memfd, &p), EPD_OK);
        munmap(p, REGION_BYTES);
        ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
        sock = h_raw_connect(&d);
        init_region_register(&req, &rr, 8, EPD__V1__REGION_KIND__HOST_MEMFD);
        len = pack_request(&req, body);
        h = h_good_header(len, 1);
        ck_assert_int_eq(h_raw_send(sock, &h, body, len, &pipefd[1], 1, 0), 0);
        expect_closed(sock, &cr);
        ck_assert_int_eq(cr.replies, 1);
        ck_assert_int_eq(cr.status, EPD_INVALID_ARGUMENT);
        close(sock);
        close(memfd);
        close(pipefd[1]);
        h_expect_pipe_eof(pipefd[0]);
        close(pipefd[0]);

        h_assert_daemon_alive(&d, BAD_FRAME);
        ck_assert_int_eq(size_hint(other), EPD_OK);
        ck_assert_int_eq(status_field(&d, "regions"), 0);
        epd_client_free(other);
        daemon_stop_clean(&d);
}
END_TEST

/* ---- 8. a rank that never submits ---- */

/* Creates a group that must be refused with INVALID_ARGUMENT and a message holding `needle`. */
static void create_refused(struct epd_client *c, const char *name,
                           const struct epd_group_config *cfg, const char *needle)
{
        unsigned char secret[16];
        struct epd_group *g = NULL;
        int rc;

        h_secret(name, secret);
        rc = group_enter(c, 1, name, secret, sizeof(secret), 0, cfg, &g);
        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "create %s gave %s: %s", name,
                      epd_status_name(rc), epd_client_last_error(c));
        ck_assert_msg(strstr(epd_client_last_error(c), needle), "create %s: '%s' lacks '%s'",
                      name, epd_client_last_error(c), needle);
        ck_assert_ptr_null(g);
}

static void config_file_write(const char *path, const char *text)
{
        FILE *f = fopen(path, "w");

        ck_assert_ptr_nonnull(f);
        ck_assert_int_ge(fputs(text, f), 0);
        ck_assert_int_eq(fclose(f), 0);
}

/* Sends SIGHUP and waits until the daemon's log holds `line` `count` times. */
static void reload_and_wait(struct h_daemon *d, const char *line, int count)
{
        long long deadline = h_now_ms() + 5000;

        ck_assert_int_eq(kill(d->pid, SIGHUP), 0);
        while (h_daemon_log_contains(d, line) < count && h_now_ms() < deadline)
                usleep(10000);
        ck_assert_msg(h_daemon_log_contains(d, line) >= count,
                      "no '%s' in the log after SIGHUP", line);
}

/* Command-line flags outrank the file on every reload; the daemon's bound on op timeouts
 * refuses a group that asks for more, and a reload that would break the bound is refused
 * whole. Groups that could never run are refused at creation. */
START_TEST(test_config_bounds_and_reload)
{
        char path[] = "/tmp/epd-proto-conf-XXXXXX";
        const char *flags[] = { "--config", path, "--op-timeout-ms", "700", NULL };
        const char *bad_start[] = { "--config", "/dev/null", "--socket", "/tmp/epd-unused.sock",
                                    "--op-timeout-ms", "70000", NULL };
        struct epd_group_config cfg = group_config(1, 0);
        struct epd_group *g;
        struct epd_client *c;
        struct h_daemon d;
        char out[256];
        int fd;

        /* A default timeout beyond the (default) bound never starts. */
        ck_assert_int_eq(h_run_tool("epd", bad_start, out, sizeof(out)), 2);

        fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        close(fd);
        config_file_write(path, "[daemon]\nop_timeout_ms = 5000\n");
        ck_assert_int_eq(h_daemon_start(&d, flags), 0);
        c = h_connect_ok(&d, "bounds");
        g = create_ok(c, "flag-wins", 0, &cfg);
        ck_assert_uint_eq(epd_group_config(g)->op_timeout_ms, 700);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);

        /* The bound applies to every group's own timeout. */
        cfg.op_timeout_ms = 60001;
        create_refused(c, "too-long", &cfg, "max_op_timeout_ms 60000");
        cfg.op_timeout_ms = 4294967295u;
        create_refused(c, "far-too-long", &cfg, "max_op_timeout_ms 60000");

        /* The reload lowers the bound; the flag still sets the default timeout. */
        config_file_write(path, "[daemon]\nop_timeout_ms = 4000\n[limits]\nmax_op_timeout_ms = 2000\n");
        reload_and_wait(&d, "configuration reloaded", 1);
        cfg.op_timeout_ms = 0;
        g = create_ok(c, "flag-still-wins", 0, &cfg);
        ck_assert_uint_eq(epd_group_config(g)->op_timeout_ms, 700);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        cfg.op_timeout_ms = 2001;
        create_refused(c, "over-new-bound", &cfg, "max_op_timeout_ms 2000");

        /* A bound below the flag's timeout is refused whole: the bound stays 2000. */
        config_file_write(path, "[limits]\nmax_op_timeout_ms = 500\n");
        reload_and_wait(&d, "reload refused", 1);
        ck_assert(h_daemon_log_contains(&d, "op_timeout_ms 700 exceeds max_op_timeout_ms 500"));
        cfg.op_timeout_ms = 1500;
        g = create_ok(c, "bound-kept", 0, &cfg);
        ck_assert_uint_eq(epd_group_config(g)->op_timeout_ms, 1500);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);

        /* Shapes that could never run. */
        cfg = group_config(1, 0);
        cfg.max_tokens_per_rank = 0;
        create_refused(c, "no-tokens", &cfg, "max_tokens_per_rank 0");
        cfg = group_config(64, 0);
        cfg.num_experts = 64 * 4;
        cfg.max_tokens_per_rank = 1u << 24;
        cfg.max_topk = 4;
        create_refused(c, "rows-overflow", &cfg, "exceed 2^32");

        epd_client_free(c);
        daemon_stop_clean(&d);
        unlink(path);
}
END_TEST

START_TEST(test_op_timeout)
{
        struct h_daemon d;
        struct epd_group_config cfg = group_config(2, 300);
        struct epd_dispatch_args args0, args1;
        struct epd_dispatch_result res;
        struct epd_client *c0, *c1;
        struct epd_group *g0, *g1;
        struct epd_op *op0 = NULL, *op1 = NULL;
        struct inputs in0, in1;
        long long t0, elapsed;
        const char *msg;

        daemon_start(&d);
        c0 = h_connect_ok(&d, "rank0");
        c1 = h_connect_ok(&d, "rank1");
        g0 = create_ok(c0, "g", 0, &cfg);
        g1 = join_ok(c1, "g", 1);
        ck_assert_uint_eq(epd_group_config(g0)->op_timeout_ms, 300);
        inputs_make(c0, &in0);
        inputs_make(c1, &in1);
        args0 = dispatch_args(&in0);
        args1 = dispatch_args(&in1);

        /* Only rank 0 submits op 0. */
        t0 = h_now_ms();
        ck_assert_int_eq(epd_dispatch_submit(g0, &args0, &op0), EPD_OK);
        epd_op_wait(op0, 3000);
        elapsed = h_now_ms() - t0;
        /* epd_op_status tells a completed op from a wait that itself ran out. */
        ck_assert_msg(epd_op_status(op0) == EPD_TIMEOUT, "op 0 on rank 0 gave %s: %s",
                      epd_status_name(epd_op_status(op0)), epd_op_error(op0));
        ck_assert_msg(elapsed >= 250 && elapsed <= 1500,
                      "TIMEOUT after %lld ms with op_timeout_ms 300", elapsed);
        msg = epd_op_error(op0);
        ck_assert_msg(strstr(msg, "rank") && mentions_number(msg, 1),
                      "the message does not name the missing rank 1: '%s'", msg);
        epd_op_free(op0);

        /* docs/semantics.md §4: a collective failure has the same status on every rank, so the late
         * rank's op 0 ends with TIMEOUT too. */
        op1 = NULL;
        ck_assert_int_eq(epd_dispatch_submit(g1, &args1, &op1), EPD_OK);
        epd_op_wait(op1, 2000);
        ck_assert_msg(epd_op_status(op1) == EPD_TIMEOUT, "op 0 on rank 1 gave %s: %s",
                      epd_status_name(epd_op_status(op1)), epd_op_error(op1));
        epd_op_free(op1);

        /* The group carries on: op 1 with both ranks succeeds. */
        op0 = op1 = NULL;
        ck_assert_int_eq(epd_dispatch_submit(g0, &args0, &op0), EPD_OK);
        ck_assert_int_eq(epd_dispatch_submit(g1, &args1, &op1), EPD_OK);
        epd_op_wait(op0, 3000);
        epd_op_wait(op1, 3000);
        ck_assert_msg(epd_op_status(op0) == EPD_OK, "op 1 on rank 0: %s", epd_op_error(op0));
        ck_assert_msg(epd_op_status(op1) == EPD_OK, "op 1 on rank 1: %s", epd_op_error(op1));
        ck_assert_int_eq(epd_op_dispatch_result(op0, &res), EPD_OK);
        ck_assert_uint_eq(res.op_number, 1);
        epd_op_free(op0);
        epd_op_free(op1);

        ck_assert_int_eq(epd_group_leave(g1), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g0), EPD_OK);
        epd_client_free(c1);
        epd_client_free(c0);
        daemon_stop_clean(&d);
}
END_TEST

static Suite *proto_suite(void)
{
        Suite *s = suite_create("proto");
        TCase *tc;

        tc = tcase_create("version");
        tcase_set_timeout(tc, 20);
        tcase_add_test(tc, test_version_mismatch_hello);
        tcase_add_test(tc, test_version_mismatch_frame);
        tcase_add_test(tc, test_request_before_hello);
        tcase_add_test(tc, test_op_record_on_socket);
        tcase_add_test(tc, test_client_poll_env);
        suite_add_tcase(s, tc);

        tc = tcase_create("groups");
        tcase_set_timeout(tc, 20);
        tcase_add_test(tc, test_group_secret);
        tcase_add_test(tc, test_op_timeout);
        tcase_add_test(tc, test_config_bounds_and_reload);
        suite_add_tcase(s, tc);

        tc = tcase_create("regions");
        tcase_set_timeout(tc, 20);
        tcase_add_test(tc, test_region_out_of_bounds);
        tcase_add_test(tc, test_region_of_other_client);
        tcase_add_test(tc, test_tensor_at_many_regions);
        tcase_add_test(tc, test_region_register_checks);
        tcase_add_test(tc, test_device_memory_unavailable);
        suite_add_tcase(s, tc);

        tc = tcase_create("frames");
        tcase_set_timeout(tc, 20);
        tcase_add_loop_test(tc, test_bad_frame, 0, (int)EPD_ARRAY_SIZE(bad_cases));
        suite_add_tcase(s, tc);

        tc = tcase_create("lifecycle");
        tcase_set_timeout(tc, 20);
        tcase_add_test(tc, test_sigkill_releases_client);
        tcase_add_test(tc, test_sigterm_with_clients);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        return h_run_suite(proto_suite());
}
