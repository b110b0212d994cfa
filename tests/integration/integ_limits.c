/* integ_limits.c - every configured limit of the daemon (README "Limits"), against the real epd
 * binary: exceeding one gives a clear status (or closes the offending connection), and the daemon
 * keeps serving its other clients.
 *
 * Each test writes a small configuration file, starts its own daemon with `--config FILE` (the
 * harness passes `--config /dev/null` first; the last --config wins) and stops it again, expecting
 * a clean exit. Covered:
 * - max_clients: the connection over the limit is refused with UNAVAILABLE and a message naming
 *   the limit; a slot that frees up is usable again; refusals are counted;
 * - admin_reserved_clients: root still connects (epctl answers) when idle connections fill
 *   max_clients, up to the reserve;
 * - handshake_timeout_ms: a connection that never sends Hello is closed, and its slot freed;
 * - running out of descriptors: accept() failing with EMFILE pauses accepting (bounded CPU and
 *   log lines, unfinished handshakes closed first) and the daemon serves again afterwards;
 * - the budgets per uid and per daemon (max_bindings_per_client, max_bindings, max_groups_per_uid,
 *   max_regions): the request over one fails with UNAVAILABLE naming it, for whichever client
 *   of the uid (or of the daemon) asks, and freeing makes room;
 * - max_groups, max_regions_per_client, max_region_bytes_per_client: the request over the limit
 *   fails with UNAVAILABLE naming the limit, nothing is left behind (a refused region's fd is
 *   closed), the limit is per client where it should be, and freeing makes room again;
 * - max_outstanding_ops_per_client: the async op over the limit fails at once with UNAVAILABLE
 *   without using up an op number; the ops in flight complete normally;
 * - max_handles_per_group: a dispatch that would make one live handle more fails with
 *   UNAVAILABLE naming the limit; a cached dispatch is still served, and a release makes room;
 * - max_frame_bytes: announced in Welcome; a frame of exactly the limit is served, one byte more
 *   closes that connection; libepd refuses to send a request over the limit;
 * - max_fds_per_frame: announced in Welcome; a frame with more fds closes that connection and
 *   every fd is closed;
 * - max_output_queue_bytes and max_output_queue_bytes_total: a client that floods requests and
 *   never reads its replies is disconnected once its queued replies (or all clients' together)
 *   exceed the limit, with a log line naming it.
 *
 * Raw frames are built with common/frame.h and the generated protobuf-c code.
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
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "frame.h"
#include "harness.h"
#include "util.h"

#define NUM_EXPERTS 8
#define HIDDEN 64
#define MAX_TOKENS 16
#define MAX_TOPK 2
#define NUM_TOKENS 4u
#define REGION_BYTES 4096u
#define TOPK_OFFSET 2048u

/* ---- daemon with a configuration file ---- */

struct limits_daemon {
        struct h_daemon d;
        char config[64];
};

static void daemon_start_with(struct limits_daemon *ld, const char *config_text)
{
        const char *extra[] = { "--config", ld->config, NULL };
        int fd;

        snprintf(ld->config, sizeof(ld->config), "/tmp/epd-limits-XXXXXX");
        fd = mkstemp(ld->config);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, config_text, strlen(config_text)), (ssize_t)strlen(config_text));
        close(fd);
        printf("config:\n%s", config_text);
        fflush(stdout);
        ck_assert_msg(h_daemon_start(&ld->d, extra) == 0, "epd did not start with:\n%s",
                      config_text);
}

static void daemon_stop_clean(struct limits_daemon *ld)
{
        int rc = h_daemon_stop(&ld->d, 5000);

        unlink(ld->config);
        ck_assert_int_eq(rc, 0);
}

static struct epd_group_config group_config(uint32_t world_size)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = world_size, .num_experts = NUM_EXPERTS,
                .hidden = HIDDEN, .max_tokens_per_rank = MAX_TOKENS, .max_topk = MAX_TOPK,
                .dispatch_dtype = EPD_DTYPE_BF16, .op_timeout_ms = 10000,
                .arena_bytes = 1u << 20,
        };
        return cfg;
}

static int group_enter(struct epd_client *c, int create, const char *name, uint32_t rank,
                       const struct epd_group_config *cfg, struct epd_group **out)
{
        unsigned char secret[16];
        struct epd_group_args args = {
                .size = sizeof(args), .name = name, .secret = secret,
                .secret_len = sizeof(secret), .rank = rank, .config = cfg,
        };

        h_secret(name, secret);
        return create ? epd_group_create(c, &args, out) : epd_group_join(c, &args, out);
}

/* A request that needs nothing: proof that a connection is served. */
static int size_hint(struct epd_client *c)
{
        struct epd_group_config cfg = group_config(1);
        struct epd_size_hint hint;

        return epd_size_hint(c, &cfg, 1, &hint);
}

static long long json_field(const struct h_daemon *d, const char *command, const char *field)
{
        json_t *j = h_epctl_json(d, command);
        json_t *v = json_object_get(j, field);
        long long n;

        ck_assert_msg(json_is_integer(v), "epctl %s --json has no integer '%s'", command, field);
        n = json_integer_value(v);
        json_decref(j);
        return n;
}

/* ---- raw frames ---- */

/* Sends one record: the header says body_len bytes and num_fds fds. Returns 0 or -errno. */
static int raw_send(int sock, const void *body, size_t body_len, const int *fds,
                    unsigned num_fds, int flags)
{
        struct epd_frame_header h = h_good_header(body_len, num_fds);

        return h_raw_send(sock, &h, body, body_len, fds, num_fds, flags);
}

static size_t pack_status_request(uint8_t *buf, uint64_t id)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__StatusRequest sr = EPD__V1__STATUS_REQUEST__INIT;

        req.id = id;
        req.body_case = EPD__V1__REQUEST__BODY_STATUS;
        req.status = &sr;
        return epd__v1__request__pack(&req, buf);
}

/* Hello/Welcome on a raw connection; returns the announced limits through the pointers. */
static void raw_hello(int sock, uint32_t *max_frame, uint32_t *max_fds)
{
        static uint8_t body[4096];
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Hello hello = EPD__V1__HELLO__INIT;
        Epd__V1__Response *resp = NULL;
        size_t len;

        hello.protocol_version = EPD_PROTOCOL_VERSION;
        hello.client_name = "integ_limits raw";
        req.id = 1;
        req.body_case = EPD__V1__REQUEST__BODY_HELLO;
        req.hello = &hello;
        len = epd__v1__request__pack(&req, body);
        ck_assert_int_eq(raw_send(sock, body, len, NULL, 0, 0), 0);
        ck_assert_int_eq(h_raw_recv(sock, 2000, &resp), 1);
        ck_assert_int_eq(resp->status, EPD__V1__STATUS_CODE__OK);
        ck_assert_int_eq(resp->body_case, EPD__V1__RESPONSE__BODY_WELCOME);
        if (max_frame)
                *max_frame = resp->welcome->limits->max_frame_bytes;
        if (max_fds)
                *max_fds = resp->welcome->limits->max_fds_per_frame;
        epd__v1__response__free_unpacked(resp, NULL);
}

/* ---- max_clients ---- */

START_TEST(test_max_clients)
{
        struct limits_daemon ld;
        struct epd_connect_args args = { .size = sizeof(args), .client_name = "over",
                                         .timeout_ms = 5000 };
        struct epd_client *c[3], *late = NULL;
        char err[512];
        int rc;

        /* Without a reserve: the tests run as root, an administrator. */
        daemon_start_with(&ld, "[limits]\nmax_clients = 3\nadmin_reserved_clients = 0\n");
        args.socket_path = ld.d.socket;
        for (int i = 0; i < 3; i++)
                c[i] = h_connect_ok(&ld.d, "slot");
        /* Refused every time, with the same clear status; repeated to catch a refusal that the
         * client reads as a plain lost connection. */
        for (int i = 0; i < 50; i++) {
                late = NULL;
                err[0] = '\0';
                rc = epd_client_connect(&args, &late, err, sizeof(err));
                ck_assert_msg(rc == EPD_UNAVAILABLE, "connect over max_clients (attempt %d) gave %s: %s",
                              i, epd_status_name(rc), err);
                ck_assert_ptr_null(late);
                ck_assert_msg(strstr(err, "max_clients"),
                              "attempt %d: the refusal does not name max_clients: '%s'", i, err);
        }
        /* The clients holding the slots are unaffected. */
        for (int i = 0; i < 3; i++)
                ck_assert_int_eq(size_hint(c[i]), EPD_OK);
        /* A freed slot is usable again; epctl needs one too. */
        epd_client_free(c[2]);
        c[2] = NULL;
        for (int attempt = 0; attempt < 100 && !c[2]; attempt++) {
                rc = epd_client_connect(&args, &c[2], err, sizeof(err));
                if (rc < 0)
                        usleep(10000); /* the daemon has not yet seen the close */
        }
        ck_assert_msg(c[2] != NULL, "the freed slot was not reused: %s", err);
        ck_assert_int_eq(size_hint(c[2]), EPD_OK);
        epd_client_free(c[2]);
        usleep(50000);
        ck_assert_int_ge(json_field(&ld.d, "stats", "clients_refused"), 50);
        h_assert_daemon_alive(&ld.d, NULL);
        epd_client_free(c[1]);
        epd_client_free(c[0]);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- admin_reserved_clients and handshake_timeout_ms ---- */

/* Idle connections that never say Hello fill max_clients; root (an administrator) still gets
 * the reserve, epctl answers, and once the handshake deadline passes the idle ones are closed
 * and their slots are free again. */
START_TEST(test_idle_handshakes_and_admin_reserve)
{
        struct limits_daemon ld;
        struct epd_connect_args args = { .size = sizeof(args), .client_name = "reserve",
                                         .timeout_ms = 5000 };
        struct epd_client *admin[2], *over = NULL;
        struct h_close_result res;
        int idle[4];
        char err[512];
        long long t0;
        json_t *st;
        int rc;

        daemon_start_with(&ld, "[limits]\nmax_clients = 4\nadmin_reserved_clients = 2\n"
                               "handshake_timeout_ms = 3000\n");
        args.socket_path = ld.d.socket;
        t0 = h_now_ms();
        for (int i = 0; i < 4; i++) {
                idle[i] = h_raw_connect(&ld.d);
                ck_assert_int_ge(idle[i], 0);
        }
        /* max_clients is full of idle connections: the reserve admits two administrators. */
        for (int i = 0; i < 2; i++) {
                rc = epd_client_connect(&args, &admin[i], err, sizeof(err));
                ck_assert_msg(rc == EPD_OK, "administrator %d within the reserve: %s: %s", i,
                              epd_status_name(rc), err);
        }
        rc = epd_client_connect(&args, &over, err, sizeof(err));
        ck_assert_msg(rc == EPD_UNAVAILABLE && strstr(err, "reserve"),
                      "beyond the reserve: %s: %s", epd_status_name(rc), err);
        /* A guard on the setup, not a timing check: the checks above must have run before the
         * idle connections' deadline, with plenty of margin even under a sanitizer. */
        ck_assert_msg(h_now_ms() - t0 < 2500, "the deadline passed before the checks ran");
        /* The idle connections are closed at their deadline, not before (h_expect_closed waits
         * 2 s at most, so start waiting shortly before it). */
        while (h_now_ms() - t0 < 2500)
                usleep(20000);
        for (int i = 0; i < 4; i++) {
                h_expect_closed(idle[i], &res);
                close(idle[i]);
        }
        ck_assert_msg(h_now_ms() - t0 >= 2900, "idle connections closed after only %lld ms",
                      h_now_ms() - t0);
        ck_assert(h_daemon_log_contains(&ld.d, "no Hello within handshake_timeout_ms"));
        /* Their slots are free: epctl and new clients get in. */
        st = h_epctl_json(&ld.d, "status");
        ck_assert_ptr_nonnull(st);
        json_decref(st);
        for (int i = 0; i < 2; i++)
                ck_assert_int_eq(size_hint(admin[i]), EPD_OK);
        rc = epd_client_connect(&args, &over, err, sizeof(err));
        ck_assert_msg(rc == EPD_OK, "after the idle ones left: %s: %s", epd_status_name(rc), err);
        epd_client_free(over);
        for (int i = 0; i < 2; i++)
                epd_client_free(admin[i]);
        daemon_stop_clean(&ld);
}
END_TEST

/* CPU seconds (user + system) the process has used. */
static double proc_cpu_seconds(pid_t pid)
{
        double s = h_proc_cpu_seconds(pid);

        ck_assert_msg(s >= 0, "cannot read /proc/%d/stat", (int)pid);
        return s;
}

/* The daemon runs with few descriptors; connections that never finish their handshake use them
 * all. accept() then fails with EMFILE: the daemon must not spin on it (the listening socket
 * stays readable), must not flood its log, closes the unfinished handshakes and serves again. */
START_TEST(test_out_of_descriptors)
{
        struct limits_daemon ld;
        struct rlimit old, low;
        int socks[96], n = 0;
        double cpu0, cpu1;
        struct epd_client *c = NULL;
        struct epd_connect_args args = { .size = sizeof(args), .client_name = "after",
                                         .timeout_ms = 5000 };
        char err[512];
        FILE *f;
        char line[1024];
        int lines = 0, rc;

        daemon_start_with(&ld, "[limits]\nhandshake_timeout_ms = 3000\n");
        /* The daemon raised its soft limit at start; lower it from outside. */
        ck_assert_int_eq(prlimit(ld.d.pid, RLIMIT_NOFILE, NULL, &old), 0);
        low = old;
        low.rlim_cur = 48;
        ck_assert_int_eq(prlimit(ld.d.pid, RLIMIT_NOFILE, &low, NULL), 0);
        args.socket_path = ld.d.socket;

        /* More connections than the daemon has descriptors; those it cannot accept wait in
         * the listen backlog. */
        for (n = 0; n < 96; n++) {
                socks[n] = h_raw_connect(&ld.d);
                ck_assert_int_ge(socks[n], 0);
        }
        usleep(300000);
        cpu0 = proc_cpu_seconds(ld.d.pid);
        usleep(1000000);
        cpu1 = proc_cpu_seconds(ld.d.pid);
        ck_assert_msg(cpu1 - cpu0 < 0.3, "the daemon used %.2f CPU-seconds in 1 s while out of "
                      "descriptors", cpu1 - cpu0);
        ck_assert(h_daemon_log_contains(&ld.d, "not accepting for"));
        h_assert_daemon_alive(&ld.d, NULL);

        /* Once the clients give up, the daemon accepts again. */
        for (int i = 0; i < n; i++)
                close(socks[i]);
        for (int attempt = 0; attempt < 100 && !c; attempt++) {
                rc = epd_client_connect(&args, &c, err, sizeof(err));
                if (rc != EPD_OK)
                        usleep(50000);
        }
        ck_assert_msg(c != NULL, "no connection after the descriptors came back: %s", err);
        ck_assert_int_eq(size_hint(c), EPD_OK);
        epd_client_free(c);

        /* The log stayed small: a few lines per back-off, not one per failed accept. */
        f = fopen(ld.d.log, "re");
        ck_assert_ptr_nonnull(f);
        while (fgets(line, sizeof(line), f))
                lines++;
        fclose(f);
        ck_assert_msg(lines < 200, "%d log lines while out of descriptors", lines);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_groups ---- */

static void refused_naming(struct epd_client *c, int rc, const char *limit, const char *what)
{
        const char *msg = epd_client_last_error(c);

        ck_assert_msg(rc == EPD_UNAVAILABLE, "%s gave %s: %s", what, epd_status_name(rc), msg);
        ck_assert_msg(strstr(msg, limit), "%s: the message does not name %s: '%s'", what, limit,
                      msg);
}

/* Groups g0 (by a) and g1 (by b) of cfg fit; a third, g2, is refused naming `limit` until g1
 * leaves. Every group has left at the end. */
static void two_then_refused(struct epd_client *a, struct epd_client *b,
                             const struct epd_group_config *cfg, const char *limit,
                             const char *what)
{
        struct epd_group *g[3] = { NULL, NULL, NULL };

        ck_assert_int_eq(group_enter(a, 1, "g0", 0, cfg, &g[0]), EPD_OK);
        ck_assert_int_eq(group_enter(b, 1, "g1", 0, cfg, &g[1]), EPD_OK);
        refused_naming(a, group_enter(a, 1, "g2", 0, cfg, &g[2]), limit, what);
        ck_assert_ptr_null(g[2]);
        ck_assert_int_eq(epd_group_leave(g[1]), EPD_OK);
        ck_assert_int_eq(group_enter(a, 1, "g2", 0, cfg, &g[2]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[2]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[0]), EPD_OK);
}

START_TEST(test_budgets_per_uid_and_daemon)
{
        struct limits_daemon ld;
        struct epd_group_config cfg = group_config(1);
        struct epd_group *g[8] = { NULL };
        struct epd_client *a, *b, *c;
        uint64_t ids[4];
        void *p[4];

        daemon_start_with(&ld, "[limits]\nmax_bindings_per_client = 2\nmax_bindings = 4\n"
                               "max_groups_per_uid = 5\nmax_regions = 3\n");
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        c = h_connect_ok(&ld.d, "c");
        /* Per client. */
        ck_assert_int_eq(group_enter(a, 1, "a0", 0, &cfg, &g[0]), EPD_OK);
        ck_assert_int_eq(group_enter(a, 1, "a1", 0, &cfg, &g[1]), EPD_OK);
        refused_naming(a, group_enter(a, 1, "a2", 0, &cfg, &g[2]), "max_bindings_per_client",
                       "a third binding of one client");
        /* Per daemon: b takes the last two. */
        ck_assert_int_eq(group_enter(b, 1, "b0", 0, &cfg, &g[3]), EPD_OK);
        ck_assert_int_eq(group_enter(b, 1, "b1", 0, &cfg, &g[4]), EPD_OK);
        refused_naming(c, group_enter(c, 1, "c0", 0, &cfg, &g[5]), "max_bindings",
                       "a binding beyond the daemon's");
        /* Leaving makes room; then the uid's fifth group is its last. */
        ck_assert_int_eq(epd_group_leave(g[0]), EPD_OK);
        ck_assert_int_eq(group_enter(c, 1, "c0", 0, &cfg, &g[5]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[1]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[3]), EPD_OK);
        ck_assert_int_eq(group_enter(c, 1, "c1", 0, &cfg, &g[6]), EPD_OK);
        ck_assert_int_eq(group_enter(a, 1, "a3", 0, &cfg, &g[7]), EPD_OK);
        /* b1, c0, c1, a3: four groups of this uid, and four bindings in the daemon. */
        ck_assert_int_eq(epd_group_leave(g[7]), EPD_OK);
        ck_assert_int_eq(json_field(&ld.d, "status", "groups"), 3);

        /* Regions: the daemon's limit counts every client's. */
        ck_assert_int_eq(epd_region_alloc(a, 4096, &p[0], &ids[0]), EPD_OK);
        ck_assert_int_eq(epd_region_alloc(b, 4096, &p[1], &ids[1]), EPD_OK);
        ck_assert_int_eq(epd_region_alloc(c, 4096, &p[2], &ids[2]), EPD_OK);
        refused_naming(a, epd_region_alloc(a, 4096, &p[3], &ids[3]), "max_regions",
                       "a region beyond the daemon's");
        ck_assert_int_eq(epd_region_release(b, ids[1]), EPD_OK);
        ck_assert_int_eq(epd_region_alloc(a, 4096, &p[3], &ids[3]), EPD_OK);
        ck_assert_int_eq(size_hint(b), EPD_OK);

        for (int i = 4; i <= 6; i++)
                ck_assert_int_eq(epd_group_leave(g[i]), EPD_OK);
        epd_client_free(c);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&ld);
}
END_TEST

START_TEST(test_max_groups_per_uid)
{
        struct limits_daemon ld;
        struct epd_group_config cfg = group_config(1);
        struct epd_client *a, *b;

        daemon_start_with(&ld, "[limits]\nmax_groups_per_uid = 2\n");
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        /* The uid's, not a client's: both clients are root. */
        two_then_refused(a, b, &cfg, "max_groups_per_uid", "the uid's third group");
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&ld);
}
END_TEST

START_TEST(test_max_groups)
{
        struct limits_daemon ld;
        struct epd_group_config cfg = group_config(1);
        struct epd_group *g[3] = { NULL, NULL, NULL }, *extra = NULL;
        struct epd_client *a, *b;
        const char *msg;
        int rc;

        daemon_start_with(&ld, "[limits]\nmax_groups = 2\n");
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        ck_assert_int_eq(group_enter(a, 1, "g0", 0, &cfg, &g[0]), EPD_OK);
        ck_assert_int_eq(group_enter(b, 1, "g1", 0, &cfg, &g[1]), EPD_OK);
        /* The limit is the daemon's, not a client's: a third group fails for either client. */
        rc = group_enter(a, 1, "g2", 0, &cfg, &g[2]);
        msg = epd_client_last_error(a);
        ck_assert_msg(rc == EPD_UNAVAILABLE, "a third group gave %s: %s", epd_status_name(rc), msg);
        ck_assert_msg(strstr(msg, "max_groups"), "the message does not name max_groups: '%s'", msg);
        ck_assert_ptr_null(g[2]);
        rc = group_enter(b, 1, "g3", 0, &cfg, &extra);
        ck_assert_int_eq(rc, EPD_UNAVAILABLE);
        /* Joining an existing group is not creating one. */
        ck_assert_int_eq(json_field(&ld.d, "status", "groups"), 2);
        ck_assert_int_eq(size_hint(a), EPD_OK);
        /* A group that goes away makes room. */
        ck_assert_int_eq(epd_group_leave(g[0]), EPD_OK);
        ck_assert_int_eq(group_enter(b, 1, "g2", 0, &cfg, &g[2]), EPD_OK);
        ck_assert_int_eq(json_field(&ld.d, "status", "groups"), 2);
        ck_assert_int_eq(epd_group_leave(g[2]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[1]), EPD_OK);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&ld);
}
END_TEST

/* The memory the daemon makes for groups: output arenas (at a rank's binding, and a resize's
 * grow) and client-executed buffers (at the first binding), per creating uid and in the daemon. */
START_TEST(test_max_group_bytes)
{
        struct limits_daemon ld;
        struct epd_group_config cfg = group_config(1), cx = group_config(2);
        struct epd_group *g[4] = { NULL }, *bad = NULL;
        struct epd_resize_result *rr = NULL;
        struct epd_size_hint hint;
        struct epd_group_list *list;
        struct epd_client *a, *b;
        char conf[256];

        daemon_start_with(&ld, "[limits]\nmax_group_bytes_per_uid = 3M\n");
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        /* Three 1 MiB arenas fill the uid's 3 MiB, from either of its clients. */
        ck_assert_int_eq(group_enter(a, 1, "m0", 0, &cfg, &g[0]), EPD_OK);
        ck_assert_int_eq(group_enter(b, 1, "m1", 0, &cfg, &g[1]), EPD_OK);
        ck_assert_int_eq(group_enter(a, 1, "m2", 0, &cfg, &g[2]), EPD_OK);
        refused_naming(b, group_enter(b, 1, "m3", 0, &cfg, &g[3]), "max_group_bytes_per_uid",
                       "a fourth arena of the uid");
        ck_assert_ptr_null(g[3]);
        /* The group list shows what the budget counts, and whose it is. */
        ck_assert_int_eq(epd_group_list_get(a, &list), EPD_OK);
        ck_assert_uint_eq(epd_group_list_count(list), 3);
        for (size_t i = 0; i < 3; i++) {
                ck_assert_uint_eq(epd_group_list_at(list, i)->memory_bytes, 1u << 20);
                ck_assert_uint_eq(epd_group_list_at(list, i)->owner_uid, geteuid());
        }
        epd_group_list_free(list);
        /* A grow maps more on the group's ranks: refused, and the group runs on unchanged. */
        refused_naming(a, epd_resize(a, "m1", 2u << 20, &rr), "max_group_bytes_per_uid",
                       "a grow past the uid's group bytes");
        ck_assert_ptr_null(rr);
        ck_assert_int_eq(json_field(&ld.d, "status", "groups"), 3);
        ck_assert_int_eq(epd_group_list_get(a, &list), EPD_OK);
        for (size_t i = 0; i < epd_group_list_count(list); i++)
                ck_assert_uint_eq(epd_group_list_at(list, i)->memory_bytes, 1u << 20);
        epd_group_list_free(list);
        /* Leaving frees the arena; then a client-executed group's buffers count the same. */
        ck_assert_int_eq(epd_group_leave(g[0]), EPD_OK);
        cx.arena_bytes = 0;
        cx.execution = EPD_EXECUTION_CLIENT;
        ck_assert_int_eq(epd_size_hint(a, &cx, 1, &hint), EPD_OK);
        ck_assert_uint_le(2 * hint.client_buffer_bytes_per_rank, 1u << 20);
        ck_assert_int_eq(group_enter(a, 1, "m4", 0, &cx, &g[0]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[0]), EPD_OK);
        /* More tokens, until the buffers of the 2 ranks pass the 1 MiB left. */
        while (2 * hint.client_buffer_bytes_per_rank <= 1u << 20) {
                cx.max_tokens_per_rank *= 2;
                ck_assert_int_eq(epd_size_hint(a, &cx, 1, &hint), EPD_OK);
        }
        ck_assert_uint_le(2 * hint.client_buffer_bytes_per_rank, 3u << 20);
        refused_naming(a, group_enter(a, 1, "m5", 0, &cx, &bad), "max_group_bytes_per_uid",
                       "client-executed buffers past the uid's group bytes");
        ck_assert_int_eq(epd_group_leave(g[1]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[2]), EPD_OK);
        ck_assert_int_eq(group_enter(a, 1, "m5", 0, &cx, &g[0]), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g[0]), EPD_OK);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&ld);

        /* The daemon's limit counts every uid's groups (here one uid's, under a larger uid
         * limit). */
        snprintf(conf, sizeof(conf), "[limits]\nmax_group_bytes_per_uid = 1G\n"
                                     "max_group_bytes = 2M\n");
        daemon_start_with(&ld, conf);
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        two_then_refused(a, b, &cfg, "max_group_bytes=",
                         "an arena past the daemon's group bytes");
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_regions_per_client ---- */

START_TEST(test_max_regions)
{
        struct limits_daemon ld;
        struct epd_group_config cfg = group_config(1);
        struct epd_client *a, *b;
        struct epd_group *g;
        uint64_t ids[5], bid;
        void *p;
        const char *msg;
        int rc;

        daemon_start_with(&ld, "[limits]\nmax_regions_per_client = 4\n");
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        /* The group's output arena counts against no client limit. */
        ck_assert_int_eq(group_enter(a, 1, "g", 0, &cfg, &g), EPD_OK);
        for (int i = 0; i < 4; i++) {
                rc = epd_region_alloc(a, REGION_BYTES, &p, &ids[i]);
                ck_assert_msg(rc == EPD_OK, "region %d: %s", i, epd_client_last_error(a));
        }
        rc = epd_region_alloc(a, REGION_BYTES, &p, &ids[4]);
        msg = epd_client_last_error(a);
        ck_assert_msg(rc == EPD_UNAVAILABLE, "a fifth region gave %s: %s", epd_status_name(rc),
                      msg);
        ck_assert_msg(strstr(msg, "max_regions_per_client"),
                      "the message does not name max_regions_per_client: '%s'", msg);
        /* The refused region is not held: its fd was closed and not mapped. */
        ck_assert_int_eq(json_field(&ld.d, "status", "regions"), 4);
        ck_assert_int_eq(h_daemon_region_mappings(&ld.d), 4);
        /* The limit is per client. */
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(epd_region_alloc(b, REGION_BYTES, &p, &bid), EPD_OK);
        ck_assert_int_eq(epd_region_alloc(b, REGION_BYTES, &p, &bid), EPD_UNAVAILABLE);
        /* Releasing makes room; the connection was never hurt. */
        ck_assert_int_eq(epd_region_release(a, ids[0]), EPD_OK);
        ck_assert_int_eq(epd_region_alloc(a, REGION_BYTES, &p, &ids[0]), EPD_OK);
        ck_assert_int_eq(size_hint(a), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(b);
        epd_client_free(a);
        usleep(50000);
        ck_assert_int_eq(h_daemon_region_mappings(&ld.d), 0);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_region_bytes_per_client ---- */

START_TEST(test_max_region_bytes)
{
        struct limits_daemon ld;
        struct epd_client *a, *b;
        uint64_t id0, id1, id2;
        void *p;
        const char *msg;
        int rc;

        daemon_start_with(&ld, "[limits]\nmax_region_bytes_per_client = 1M\n");
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        ck_assert_int_eq(epd_region_alloc(a, 512u << 10, &p, &id0), EPD_OK);
        ck_assert_int_eq(epd_region_alloc(a, 512u << 10, &p, &id1), EPD_OK); /* exactly 1 MiB */
        rc = epd_region_alloc(a, 4096, &p, &id2);
        msg = epd_client_last_error(a);
        ck_assert_msg(rc == EPD_UNAVAILABLE, "4 KiB over 1 MiB gave %s: %s", epd_status_name(rc),
                      msg);
        ck_assert_msg(strstr(msg, "max_region_bytes_per_client") && strstr(msg, "1048576"),
                      "the message does not name the limit and its value: '%s'", msg);
        /* One region larger than the whole limit. */
        ck_assert_int_eq(epd_region_alloc(b, 2u << 20, &p, &id2), EPD_UNAVAILABLE);
        /* Per client: b still has its whole megabyte. */
        ck_assert_int_eq(epd_region_alloc(b, 1u << 20, &p, &id2), EPD_OK);
        ck_assert_int_eq(json_field(&ld.d, "status", "region_bytes"), 2 << 20);
        ck_assert_int_eq(epd_region_release(a, id1), EPD_OK);
        ck_assert_int_eq(epd_region_alloc(a, 4096, &p, &id2), EPD_OK);
        ck_assert_int_eq(size_hint(a), EPD_OK);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_outstanding_ops_per_client ---- */

struct inputs {
        uint8_t *base;
        uint64_t region_id;
        struct epd_tensor x, topk_idx;
};

static void inputs_make(struct epd_client *c, struct inputs *in)
{
        uint64_t x_sizes[2] = { NUM_TOKENS, HIDDEN }, k_sizes[2] = { NUM_TOKENS, MAX_TOPK };
        void *base;
        int64_t *topk;

        ck_assert_int_eq(epd_region_alloc(c, REGION_BYTES, &base, &in->region_id), EPD_OK);
        in->base = base;
        topk = (int64_t *)(in->base + TOPK_OFFSET);
        memset(base, 0x11, NUM_TOKENS * HIDDEN * 2);
        for (uint32_t t = 0; t < NUM_TOKENS; t++)
                for (uint32_t k = 0; k < MAX_TOPK; k++)
                        topk[t * MAX_TOPK + k] = (t + k) % NUM_EXPERTS;
        ck_assert_int_eq(epd_tensor_at(c, base, EPD_DTYPE_BF16, 2, x_sizes, &in->x), EPD_OK);
        ck_assert_int_eq(epd_tensor_at(c, topk, EPD_DTYPE_INT64, 2, k_sizes, &in->topk_idx),
                         EPD_OK);
}

static struct epd_dispatch_args dispatch_args(const struct inputs *in)
{
        struct epd_dispatch_args a = {
                .size = sizeof(a), .num_tokens = NUM_TOKENS, .x = in->x,
                .topk_idx = in->topk_idx, .use_arena = 1,
        };
        return a;
}

#define OPS_LIMIT 4

START_TEST(test_max_outstanding_ops)
{
        struct limits_daemon ld;
        struct epd_group_config cfg = group_config(2);
        struct epd_client *a, *b, *bystander;
        struct epd_group *ga, *gb, *gs;
        struct epd_op *opa[OPS_LIMIT + 1], *opb[OPS_LIMIT], *op;
        struct epd_dispatch_result res;
        struct epd_dispatch_args da, db, ds;
        struct inputs ina, inb, ins;
        struct epd_group_config one = group_config(1);
        int rc;

        daemon_start_with(&ld, "[limits]\nmax_outstanding_ops_per_client = 4\n");
        a = h_connect_ok(&ld.d, "a");
        b = h_connect_ok(&ld.d, "b");
        bystander = h_connect_ok(&ld.d, "bystander");
        ck_assert_int_eq(group_enter(a, 1, "g", 0, &cfg, &ga), EPD_OK);
        ck_assert_int_eq(group_enter(b, 0, "g", 1, NULL, &gb), EPD_OK);
        ck_assert_int_eq(group_enter(bystander, 1, "solo", 0, &one, &gs), EPD_OK);
        inputs_make(a, &ina);
        inputs_make(b, &inb);
        inputs_make(bystander, &ins);
        da = dispatch_args(&ina);
        db = dispatch_args(&inb);

        /* Rank 0 submits one op more than allowed while rank 1 submits nothing: the first
         * four wait for rank 1, the fifth fails at once. */
        for (int i = 0; i <= OPS_LIMIT; i++)
                ck_assert_int_eq(epd_dispatch_submit(ga, &da, &opa[i]), EPD_OK);
        rc = epd_op_wait(opa[OPS_LIMIT], 2000);
        ck_assert_msg(rc == EPD_UNAVAILABLE, "op %d over the limit gave %s: %s", OPS_LIMIT,
                      epd_status_name(rc), epd_op_error(opa[OPS_LIMIT]));
        ck_assert_msg(strstr(epd_op_error(opa[OPS_LIMIT]), "max_outstanding_ops_per_client"),
                      "the message does not name the limit: '%s'", epd_op_error(opa[OPS_LIMIT]));
        epd_op_free(opa[OPS_LIMIT]);
        for (int i = 0; i < OPS_LIMIT; i++)
                ck_assert_int_eq(epd_op_wait(opa[i], 0), EPD_TIMEOUT); /* still pending */
        ck_assert_int_eq(json_field(&ld.d, "status", "clients"), 4);
        /* Other clients are served meanwhile, ops included. */
        ck_assert_int_eq(size_hint(b), EPD_OK);
        ds = dispatch_args(&ins);
        op = NULL;
        rc = epd_dispatch(gs, &ds, &op);
        ck_assert_msg(rc == EPD_OK, "bystander dispatch: %s", epd_client_last_error(bystander));
        ck_assert_int_eq(epd_op_dispatch_result(op, &res), EPD_OK);
        ck_assert_int_eq(epd_handle_release(gs, res.handle_id), EPD_OK);
        epd_op_free(op);
        /* Rank 1 catches up: ops 0..3 complete on both ranks; the refused op used no number. */
        for (int i = 0; i < OPS_LIMIT; i++)
                ck_assert_int_eq(epd_dispatch_submit(gb, &db, &opb[i]), EPD_OK);
        for (int i = 0; i < OPS_LIMIT; i++) {
                rc = epd_op_wait(opa[i], 5000);
                ck_assert_msg(rc == EPD_OK, "rank 0 op %d: %s", i, epd_op_error(opa[i]));
                ck_assert_int_eq(epd_op_wait(opb[i], 5000), EPD_OK);
                ck_assert_int_eq(epd_op_dispatch_result(opa[i], &res), EPD_OK);
                ck_assert_uint_eq(res.op_number, (uint64_t)i);
                ck_assert_int_eq(epd_handle_release(ga, res.handle_id), EPD_OK);
                ck_assert_int_eq(epd_handle_release(gb, res.handle_id), EPD_OK);
                epd_op_free(opa[i]);
                epd_op_free(opb[i]);
        }
        /* The next op pairs up as op 4 on both ranks. */
        ck_assert_int_eq(epd_dispatch_submit(ga, &da, &opa[0]), EPD_OK);
        ck_assert_int_eq(epd_dispatch_submit(gb, &db, &opb[0]), EPD_OK);
        ck_assert_int_eq(epd_op_wait(opa[0], 5000), EPD_OK);
        ck_assert_int_eq(epd_op_wait(opb[0], 5000), EPD_OK);
        ck_assert_int_eq(epd_op_dispatch_result(opb[0], &res), EPD_OK);
        ck_assert_uint_eq(res.op_number, OPS_LIMIT);
        epd_op_free(opa[0]);
        epd_op_free(opb[0]);
        ck_assert_int_eq(epd_group_leave(gs), EPD_OK);
        ck_assert_int_eq(epd_group_leave(gb), EPD_OK);
        ck_assert_int_eq(epd_group_leave(ga), EPD_OK);
        epd_client_free(bystander);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_handles_per_group ---- */

START_TEST(test_max_handles)
{
        struct limits_daemon ld;
        struct epd_group_config cfg = group_config(1);
        struct epd_client *a;
        struct epd_group *g;
        struct epd_op *op;
        struct epd_dispatch_result res;
        struct epd_dispatch_args da, cached;
        struct inputs in;
        uint64_t handles[2];
        const char *msg;
        int rc;

        daemon_start_with(&ld, "[limits]\nmax_handles_per_group = 2\n");
        a = h_connect_ok(&ld.d, "a");
        ck_assert_int_eq(group_enter(a, 1, "g", 0, &cfg, &g), EPD_OK);
        inputs_make(a, &in);
        da = dispatch_args(&in);
        for (int i = 0; i < 2; i++) {
                ck_assert_int_eq(epd_dispatch(g, &da, &op), EPD_OK);
                ck_assert_int_eq(epd_op_dispatch_result(op, &res), EPD_OK);
                handles[i] = res.handle_id;
                epd_op_free(op);
        }
        /* A third live handle is refused with the limit named; the group goes on. */
        rc = epd_dispatch(g, &da, &op);
        msg = epd_client_last_error(a);
        ck_assert_msg(rc == EPD_UNAVAILABLE, "a third handle gave %s: %s", epd_status_name(rc),
                      msg);
        ck_assert_msg(strstr(msg, "max_handles_per_group") != NULL,
                      "the message does not name the limit: '%s'", msg);
        /* A cached dispatch makes no handle: it is served at the limit. */
        cached = da;
        cached.handle_id = handles[0];
        memset(&cached.topk_idx, 0, sizeof(cached.topk_idx));
        rc = epd_dispatch(g, &cached, &op);
        ck_assert_msg(rc == EPD_OK, "cached dispatch: %s", epd_client_last_error(a));
        epd_op_free(op);
        /* Releasing one makes room for a new one. */
        ck_assert_int_eq(epd_handle_release(g, handles[0]), EPD_OK);
        rc = epd_dispatch(g, &da, &op);
        ck_assert_msg(rc == EPD_OK, "after a release: %s", epd_client_last_error(a));
        epd_op_free(op);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(a);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_frame_bytes ---- */

#define FRAME_LIMIT 8192u

/* A StatusRequest padded with an unknown length-delimited field (number 1000, which protobuf-c
 * skips) to exactly `total` body bytes. */
static size_t padded_status_request(uint8_t *buf, uint64_t id, size_t total)
{
        size_t len = pack_status_request(buf, id);
        size_t payload = total - len - 4; /* 2-byte tag, 2-byte length */

        ck_assert_uint_ge(payload, 128);
        ck_assert_uint_lt(payload, 16384);
        buf[len++] = (uint8_t)(((1000u << 3) | 2u) & 0x7f) | 0x80;
        buf[len++] = (uint8_t)(((1000u << 3) | 2u) >> 7);
        buf[len++] = (uint8_t)(payload & 0x7f) | 0x80;
        buf[len++] = (uint8_t)(payload >> 7);
        memset(buf + len, 'p', payload);
        return len + payload;
}

START_TEST(test_max_frame_bytes)
{
        static uint8_t body[2 * FRAME_LIMIT];
        struct limits_daemon ld;
        struct epd_client *other, *c;
        struct epd_daemon_info info;
        struct epd_group_config cfg = group_config(1);
        struct epd_group *g = NULL;
        Epd__V1__Response *resp = NULL;
        char name[FRAME_LIMIT + 16];
        struct h_close_result cr;
        uint32_t max_frame = 0;
        size_t len;
        int sock, st;

        daemon_start_with(&ld, "[limits]\nmax_frame_bytes = 8K\n");
        other = h_connect_ok(&ld.d, "bystander");
        ck_assert_int_eq(epd_client_daemon_info(other, &info), EPD_OK);
        ck_assert_uint_eq(info.max_frame_bytes, FRAME_LIMIT);

        /* Exactly the limit: served. */
        sock = h_raw_connect(&ld.d);
        raw_hello(sock, &max_frame, NULL);
        ck_assert_uint_eq(max_frame, FRAME_LIMIT);
        len = padded_status_request(body, 2, FRAME_LIMIT);
        ck_assert_uint_eq(len, FRAME_LIMIT);
        ck_assert_int_eq(raw_send(sock, body, len, NULL, 0, 0), 0);
        ck_assert_int_eq(h_raw_recv(sock, 2000, &resp), 1);
        ck_assert_msg(resp->status == EPD__V1__STATUS_CODE__OK && resp->id == 2,
                      "a frame of exactly max_frame_bytes was refused: %s", resp->message);
        epd__v1__response__free_unpacked(resp, NULL);
        /* One byte more: the connection is closed. */
        len = padded_status_request(body, 3, FRAME_LIMIT + 1);
        ck_assert_int_eq(raw_send(sock, body, len, NULL, 0, 0), 0);
        h_expect_closed(sock, &cr);
        st = cr.status;
        ck_assert_msg(st == EPD_OK || st == EPD_INVALID_ARGUMENT,
                      "the reply before the close is %s", epd_status_name(st));
        close(sock);

        /* libepd knows the limit from Welcome and does not send an oversized request; the
         * connection stays usable. */
        c = h_connect_ok(&ld.d, "libepd");
        memset(name, 'n', sizeof(name) - 1);
        name[sizeof(name) - 1] = '\0';
        ck_assert_int_eq(epd_group_create(c, &(struct epd_group_args){
                                                  .size = sizeof(struct epd_group_args),
                                                  .name = name, .secret = "0123456789abcdef",
                                                  .secret_len = 16, .config = &cfg },
                                          &g),
                         EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(c), "frame limit"),
                      "libepd's message: '%s'", epd_client_last_error(c));
        ck_assert_int_eq(size_hint(c), EPD_OK);

        h_assert_daemon_alive(&ld.d, NULL);
        ck_assert_int_eq(size_hint(other), EPD_OK);
        ck_assert_int_eq(json_field(&ld.d, "status", "clients"), 3);
        epd_client_free(c);
        epd_client_free(other);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_fds_per_frame ---- */

START_TEST(test_max_fds_per_frame)
{
        static uint8_t body[4096];
        struct limits_daemon ld;
        struct epd_client *other;
        struct epd_daemon_info info;
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__RegionRegister rr = EPD__V1__REGION_REGISTER__INIT;
        Epd__V1__Response *resp = NULL;
        uint32_t max_fds = 0;
        int pipefd[2], fds[3], memfd, sock, st;
        struct h_close_result cr;
        size_t len;
        void *p;

        daemon_start_with(&ld, "[limits]\nmax_fds_per_frame = 2\n");
        other = h_connect_ok(&ld.d, "bystander");
        ck_assert_int_eq(epd_client_daemon_info(other, &info), EPD_OK);
        ck_assert_uint_eq(info.max_fds_per_frame, 2);

        sock = h_raw_connect(&ld.d);
        raw_hello(sock, NULL, &max_fds);
        ck_assert_uint_eq(max_fds, 2);
        /* A registration with its one fd is within the limit. */
        ck_assert_int_eq(epd_memfd_alloc(REGION_BYTES, &memfd, &p), EPD_OK);
        munmap(p, REGION_BYTES);
        rr.kind = EPD__V1__REGION_KIND__HOST_MEMFD;
        rr.size = REGION_BYTES;
        req.id = 2;
        req.body_case = EPD__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        len = epd__v1__request__pack(&req, body);
        ck_assert_int_eq(raw_send(sock, body, len, &memfd, 1, 0), 0);
        ck_assert_int_eq(h_raw_recv(sock, 2000, &resp), 1);
        ck_assert_msg(resp->status == EPD__V1__STATUS_CODE__OK, "registration: %s",
                      resp->message);
        epd__v1__response__free_unpacked(resp, NULL);
        close(memfd);
        /* Three fds: the frame is refused and the connection closed, every fd closed. */
        ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
        fds[0] = fds[1] = fds[2] = pipefd[1];
        req.id = 3;
        len = epd__v1__request__pack(&req, body);
        ck_assert_int_eq(raw_send(sock, body, len, fds, 3, 0), 0);
        h_expect_closed(sock, &cr);
        st = cr.status;
        ck_assert_msg(st == EPD_OK || st == EPD_INVALID_ARGUMENT,
                      "the reply before the close is %s", epd_status_name(st));
        close(sock);
        close(pipefd[1]);
        h_expect_pipe_eof(pipefd[0]);
        close(pipefd[0]);

        h_assert_daemon_alive(&ld.d, NULL);
        ck_assert_int_eq(size_hint(other), EPD_OK);
        /* The closed connection's region went with it. */
        ck_assert_int_eq(json_field(&ld.d, "status", "regions"), 0);
        ck_assert_int_eq(json_field(&ld.d, "status", "clients"), 2);
        epd_client_free(other);
        daemon_stop_clean(&ld);
}
END_TEST

/* ---- max_output_queue_bytes ---- */

/* _i 0: the client's own limit; 1: the daemon's total (max_output_queue_bytes_total), which
 * closes the client holding the most. */
START_TEST(test_output_queue_limit)
{
        static const char *const configs[] = {
                "[limits]\nmax_output_queue_bytes = 4K\n",
                "[limits]\nmax_output_queue_bytes = 1M\nmax_output_queue_bytes_total = 4K\n",
        };
        static const char *const reasons[] = { "output queue limit exceeded",
                                               "max_output_queue_bytes_total" };
        static uint8_t body[256];
        struct limits_daemon ld;
        struct epd_client *other;
        long long deadline;
        int sock, sent = 0, replies = 0, closed = 0;
        size_t len;

        daemon_start_with(&ld, configs[_i]);
        other = h_connect_ok(&ld.d, "bystander");
        sock = h_raw_connect(&ld.d);
        raw_hello(sock, NULL, NULL);
        /* Flood StatusRequests and read nothing. The socket's buffer takes the first few
         * hundred replies; after that the daemon queues them, and 4 KiB of queued replies are
         * its limit. */
        deadline = h_now_ms() + 10000;
        while (!closed && h_now_ms() < deadline) {
                len = pack_status_request(body, (uint64_t)sent + 2);
                int rc = raw_send(sock, body, len, NULL, 0, MSG_DONTWAIT);
                if (rc == 0) {
                        sent++;
                        continue;
                }
                if (rc == -EAGAIN) {
                        struct pollfd pfd = { .fd = sock, .events = POLLOUT };
                        poll(&pfd, 1, 100);
                        /* POLLHUP: the daemon closed it. */
                        if (pfd.revents & (POLLHUP | POLLERR))
                                closed = 1;
                        continue;
                }
                ck_assert_msg(rc == -EPIPE || rc == -ECONNRESET, "send: %s", strerror(-rc));
                closed = 1;
        }
        ck_assert_msg(closed, "the daemon did not close a client that read nothing after %d requests",
                      sent);
        /* What the socket buffer held can still be read, then the end of the stream. */
        for (;;) {
                Epd__V1__Response *resp = NULL;
                int rc = h_raw_recv(sock, 2000, &resp);
                ck_assert_msg(rc >= 0, "no end of stream after the close");
                if (rc == 0)
                        break;
                replies++;
                epd__v1__response__free_unpacked(resp, NULL);
        }
        close(sock);
        printf("flood: %d requests sent, %d replies read back, then the daemon closed it\n", sent,
               replies);
        ck_assert_int_lt(replies, sent);
        ck_assert_msg(h_daemon_log_contains(&ld.d, reasons[_i]),
                      "the daemon's log does not say why it closed the connection");
        h_assert_daemon_alive(&ld.d, NULL);
        ck_assert_int_eq(size_hint(other), EPD_OK);
        ck_assert_int_eq(json_field(&ld.d, "status", "clients"), 2);
        epd_client_free(other);
        daemon_stop_clean(&ld);
}
END_TEST

static Suite *limits_suite(void)
{
        Suite *s = suite_create("limits");
        TCase *tc = tcase_create("limits");

        tcase_set_timeout(tc, 30);
        tcase_add_test(tc, test_max_clients);
        tcase_add_test(tc, test_idle_handshakes_and_admin_reserve);
        tcase_add_test(tc, test_out_of_descriptors);
        tcase_add_test(tc, test_max_groups);
        tcase_add_test(tc, test_max_group_bytes);
        tcase_add_test(tc, test_budgets_per_uid_and_daemon);
        tcase_add_test(tc, test_max_groups_per_uid);
        tcase_add_test(tc, test_max_regions);
        tcase_add_test(tc, test_max_region_bytes);
        tcase_add_test(tc, test_max_outstanding_ops);
        tcase_add_test(tc, test_max_handles);
        tcase_add_test(tc, test_max_frame_bytes);
        tcase_add_test(tc, test_max_fds_per_frame);
        tcase_add_loop_test(tc, test_output_queue_limit, 0, 2);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        return h_run_suite(limits_suite());
}
