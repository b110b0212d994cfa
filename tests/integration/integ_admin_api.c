/* integ_admin_api.c - libepd's administration calls (include/epd.h, "administration") against
 * the real epd binary, with no epctl in between.
 *
 * Covered:
 * - the status, group list, client list and statistics snapshots describe what the test set up
 *   (groups with their config and rank bindings, named clients with their bindings, the op
 *   counts of a dispatch) and agree with Welcome;
 * - epd_drain holds a group's collected op (the op stays pending), a second drain counts it as
 *   waiting, epd_undrain launches it; the group's id names it as well as its name; draining the
 *   daemon does the same for every group and epd_daemon_status_get says so;
 * - epd_resize grows and shrinks every rank's arena, and the group list and statistics show the
 *   new size;
 * - epd_evict drops a client: its peer's pending op gets PEER_LOST and the client list no
 *   longer has it;
 * - bad arguments give EPD_INVALID_ARGUMENT (or the daemon's NOT_FOUND) with a message that
 *   says what was wrong, and a client without admin rights gets EPD_PERMISSION_DENIED for every
 *   verb while reading stays open (root only: the child switches to nobody).
 *
 * Run as root, the test process is an admin; run as another user, the daemon's admin_group is
 * its group.
 */
#include <check.h>
#include <grp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "epd.h"
#include "harness.h"
#include "workload.h"

#define NUM_EXPERTS 8
#define HIDDEN 64
#define MAX_TOKENS 16
#define MAX_TOPK 2
#define ARENA_BYTES (1u << 20)
#define NOBODY 65534

/* ---- daemon and groups ---- */

/* Starts a daemon in which this process is an admin (as root by itself, otherwise through an
 * admin_group naming its group). */
static void daemon_start(struct h_daemon *d)
{
        char conf[PATH_MAX] = "";
        const char *args[4];
        int n = 0;

        if (geteuid() != 0) {
                struct group *gr = getgrgid(getegid());
                FILE *f;
                ck_assert_msg(gr != NULL, "no name for group %u", (unsigned)getegid());
                snprintf(conf, sizeof(conf), "/tmp/epd-admin-api-%d.conf", (int)getpid());
                f = fopen(conf, "we");
                ck_assert_msg(f != NULL, "cannot write %s", conf);
                fprintf(f, "[daemon]\nadmin_group = %s\n", gr->gr_name);
                fclose(f);
                args[n++] = "--config";
                args[n++] = conf;
        }
        args[n] = NULL;
        ck_assert_int_eq(h_daemon_start(d, args), 0);
        if (conf[0])
                unlink(conf);
}

static struct epd_group *enter(struct epd_client *c, const char *name, uint32_t world_size,
                               uint32_t rank)
{
        const struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = world_size, .num_experts = NUM_EXPERTS,
                .hidden = HIDDEN, .max_tokens_per_rank = MAX_TOKENS, .max_topk = MAX_TOPK,
                .dispatch_dtype = EPD_DTYPE_BF16, .op_timeout_ms = 60000,
                .arena_bytes = ARENA_BYTES,
        };
        struct epd_group *g = NULL;
        int rc = wl_enter_group(c, name, rank, &cfg, &g);

        ck_assert_msg(rc == EPD_OK, "%s rank %u: %s: %s", name, rank, epd_status_name(rc),
                      epd_client_last_error(c));
        return g;
}

/* Submits a dispatch of 4 zero tokens, each to experts t and t+1, with outputs in the arena. */
static struct epd_op *dispatch_submit(struct epd_client *c, struct epd_group *g)
{
        const uint64_t x_sizes[2] = { 4, HIDDEN }, k_sizes[2] = { 4, MAX_TOPK };
        struct epd_dispatch_args a = {
                .size = sizeof(a), .num_tokens = 4, .use_arena = 1,
        };
        struct epd_op *op = NULL;
        uint64_t region_id;
        uint8_t *base;

        ck_assert_int_eq(epd_region_alloc(c, 4096, (void **)&base, &region_id), EPD_OK);
        memset(base, 0, 4096);
        int32_t *topk = (int32_t *)(base + 2048);
        for (int t = 0; t < 4; t++)
                for (int k = 0; k < MAX_TOPK; k++)
                        topk[t * MAX_TOPK + k] = (t + k) % NUM_EXPERTS;
        ck_assert_int_eq(epd_tensor_at(c, base, EPD_DTYPE_BF16, 2, x_sizes, &a.x), EPD_OK);
        ck_assert_int_eq(epd_tensor_at(c, topk, EPD_DTYPE_INT32, 2, k_sizes, &a.topk_idx),
                         EPD_OK);
        ck_assert_int_eq(epd_dispatch_submit(g, &a, &op), EPD_OK);
        return op;
}

static uint64_t client_id(const struct epd_client *c)
{
        struct epd_daemon_info info;

        ck_assert_int_eq(epd_client_daemon_info(c, &info), EPD_OK);
        return info.client_id;
}

/* Asserts rc is `want` and the client's message contains `text`. */
#define ASSERT_FAILS(c, rc, want, text)                                                      \
        do {                                                                                 \
                int rc_ = (rc);                                                              \
                ck_assert_msg(rc_ == (want), "%s: %s (%s), want %s", #rc,                    \
                              epd_status_name(rc_), epd_client_last_error(c),               \
                              epd_status_name(want));                                        \
                ck_assert_msg(strstr(epd_client_last_error(c), (text)),                      \
                              "%s: message '%s' does not say '%s'", #rc,                     \
                              epd_client_last_error(c), (text));                             \
        } while (0)

/* The state of group `name` as epd_group_list_get reports it ("" when absent). */
static const char *group_state(struct epd_client *c, const char *name)
{
        static char state[32];
        struct epd_group_list *list;

        state[0] = '\0';
        ck_assert_int_eq(epd_group_list_get(c, &list), EPD_OK);
        for (size_t i = 0; i < epd_group_list_count(list); i++) {
                const struct epd_group_info *g = epd_group_list_at(list, i);
                if (strcmp(g->name, name) == 0)
                        snprintf(state, sizeof(state), "%s", g->state);
        }
        epd_group_list_free(list);
        return state;
}

static int daemon_draining(struct epd_client *c)
{
        struct epd_daemon_status *st;
        int draining;

        ck_assert_int_eq(epd_daemon_status_get(c, &st), EPD_OK);
        draining = epd_daemon_status_info(st)->draining;
        epd_daemon_status_free(st);
        return draining;
}

static const struct epd_client_info *find_client(const struct epd_client_list *list, uint64_t id)
{
        for (size_t i = 0; i < epd_client_list_count(list); i++)
                if (epd_client_list_at(list, i)->id == id)
                        return epd_client_list_at(list, i);
        return NULL;
}

/* ---- tests ---- */

START_TEST(test_snapshots)
{
        struct h_daemon d;
        struct epd_daemon_info info;

        daemon_start(&d);
        struct epd_client *a = h_connect_ok(&d, "api-a");
        struct epd_client *b = h_connect_ok(&d, "api-b");
        struct epd_group *ga = enter(a, "pair", 2, 0);
        struct epd_group *gb = enter(b, "pair", 2, 1);
        struct epd_group *gs = enter(a, "solo", 1, 0);
        struct epd_op *op = dispatch_submit(a, gs);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        epd_op_free(op);
        ck_assert_int_eq(epd_client_daemon_info(a, &info), EPD_OK);

        /* Status: what Welcome said, and the counts of what is there. */
        struct epd_daemon_status *st;
        ck_assert_int_eq(epd_daemon_status_get(a, &st), EPD_OK);
        const struct epd_daemon_status_info *s = epd_daemon_status_info(st);
        ck_assert_str_eq(s->version, info.version);
        ck_assert_str_eq(s->backend, "host");
        ck_assert_uint_eq(s->daemon_epoch, info.daemon_epoch);
        ck_assert_int_eq(s->pid, d.pid);
        ck_assert_uint_eq(s->num_clients, 2);
        ck_assert_uint_eq(s->num_groups, 2);
        ck_assert_int_eq(s->draining, 0);
        ck_assert_uint_ge(s->ops_completed, 1);
        ck_assert_uint_eq(s->num_devices, info.num_devices);
        ck_assert_uint_ge(s->num_devices, 1);
        ck_assert_str_eq(s->devices[0].uuid, info.devices[0].uuid);
        ck_assert_str_eq(s->devices[0].kind, "host");
        epd_daemon_status_free(st);

        /* Groups: config and rank bindings. */
        struct epd_group_list *gl;
        const struct epd_group_info *pair = NULL, *solo = NULL;
        ck_assert_int_eq(epd_group_list_get(b, &gl), EPD_OK);
        ck_assert_uint_eq(epd_group_list_count(gl), 2);
        ck_assert_ptr_null(epd_group_list_at(gl, 2));
        for (size_t i = 0; i < epd_group_list_count(gl); i++) {
                const struct epd_group_info *g = epd_group_list_at(gl, i);
                if (strcmp(g->name, "pair") == 0)
                        pair = g;
                else if (strcmp(g->name, "solo") == 0)
                        solo = g;
        }
        ck_assert_ptr_nonnull(pair);
        ck_assert_ptr_nonnull(solo);
        ck_assert_uint_eq(pair->id, epd_group_id(ga));
        ck_assert_uint_eq(solo->id, epd_group_id(gs));
        ck_assert_str_eq(pair->state, "READY");
        ck_assert_uint_eq(pair->config.world_size, 2);
        ck_assert_uint_eq(pair->config.num_experts, NUM_EXPERTS);
        ck_assert_uint_eq(pair->config.hidden, HIDDEN);
        ck_assert_uint_eq(pair->config.max_tokens_per_rank, MAX_TOKENS);
        ck_assert_uint_eq(pair->config.max_topk, MAX_TOPK);
        ck_assert_int_eq(pair->config.dispatch_dtype, EPD_DTYPE_BF16);
        ck_assert_uint_eq(pair->config.arena_bytes, ARENA_BYTES);
        ck_assert_uint_eq(pair->num_ranks, 2);
        for (uint32_t r = 0; r < 2; r++) {
                ck_assert_uint_eq(pair->ranks[r].rank, r);
                ck_assert_int_eq(pair->ranks[r].bound, 1);
        }
        ck_assert_uint_eq(pair->ranks[0].client_id, client_id(a));
        ck_assert_uint_eq(pair->ranks[1].client_id, client_id(b));
        ck_assert_uint_eq(solo->config.world_size, 1);
        ck_assert_uint_eq(solo->ops_completed, 1);
        ck_assert_uint_eq(solo->ranks[0].next_op, 1);
        epd_group_list_free(gl);

        /* Clients: names, pids and bindings. */
        struct epd_client_list *cl;
        ck_assert_int_eq(epd_client_list_get(a, &cl), EPD_OK);
        ck_assert_uint_eq(epd_client_list_count(cl), 2);
        ck_assert_ptr_null(epd_client_list_at(cl, 2));
        const struct epd_client_info *ca = find_client(cl, client_id(a));
        const struct epd_client_info *cb = find_client(cl, client_id(b));
        ck_assert_ptr_nonnull(ca);
        ck_assert_ptr_nonnull(cb);
        ck_assert_str_eq(ca->name, "api-a");
        ck_assert_str_eq(cb->name, "api-b");
        ck_assert_int_eq(ca->pid, getpid());
        ck_assert_uint_eq(ca->uid, geteuid());
        ck_assert_uint_eq(ca->num_bindings, 2);
        ck_assert_msg((strcmp(ca->bindings[0], "pair/0") == 0 &&
                       strcmp(ca->bindings[1], "solo/0") == 0) ||
                              (strcmp(ca->bindings[0], "solo/0") == 0 &&
                               strcmp(ca->bindings[1], "pair/0") == 0),
                      "bindings of api-a: %s, %s", ca->bindings[0], ca->bindings[1]);
        ck_assert_uint_eq(cb->num_bindings, 1);
        ck_assert_str_eq(cb->bindings[0], "pair/1");
        ck_assert_uint_eq(ca->num_regions, 1); /* the dispatch's input region */
        epd_client_list_free(cl);

        /* Statistics: the one dispatch of "solo", none of "pair". */
        struct epd_stats *stats;
        ck_assert_int_eq(epd_stats_get(a, &stats), EPD_OK);
        const struct epd_admin_daemon_stats *ds = epd_stats_daemon(stats);
        ck_assert_str_eq(ds->backend, "host");
        ck_assert_uint_eq(ds->num_groups, 2);
        ck_assert_uint_eq(ds->num_clients, 2);
        ck_assert_uint_eq(ds->num_devices, info.num_devices);
        ck_assert_uint_ge(ds->clients_accepted, 2);
        for (uint32_t i = 0; i < ds->num_groups; i++) {
                const struct epd_admin_group_stats *g = &ds->groups[i];
                int is_solo = strcmp(g->name, "solo") == 0;
                ck_assert_uint_eq(g->num_ranks, g->world_size);
                ck_assert_uint_eq(g->ranks[0].dispatch->ops, is_solo ? 1 : 0);
                ck_assert_uint_eq(g->ranks[0].combine->ops, 0);
                ck_assert_uint_eq(g->ranks[0].arena_bytes, ARENA_BYTES);
                ck_assert_uint_eq(g->ranks[0].queue_depth, 0);
                if (is_solo) {
                        ck_assert_uint_eq(g->ranks[0].dispatch->latency_count, 1);
                        ck_assert_uint_gt(g->ranks[0].dispatch->latency_max_ns, 0);
                        ck_assert_uint_gt(g->ranks[0].arena_used_bytes, 0);
                        ck_assert_uint_ge(g->num_stages, 1);
                        ck_assert_str_eq(g->stages[0].op, "dispatch");
                        ck_assert_uint_eq(g->stages[0].latency->ops, 1);
                }
                for (uint32_t e = 1; e < g->ranks[0].dispatch->num_errors; e++)
                        ck_assert_uint_eq(g->ranks[0].dispatch->errors[e], 0);
        }
        epd_stats_free(stats);

        epd_group_leave(gs);
        epd_group_leave(gb);
        epd_group_leave(ga);
        epd_client_free(b);
        epd_client_free(a);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

START_TEST(test_drain_undrain)
{
        struct h_daemon d;
        struct epd_drain_result r;
        char id[32];

        daemon_start(&d);
        struct epd_client *a = h_connect_ok(&d, "worker");
        struct epd_client *admin = h_connect_ok(&d, "admin");
        struct epd_group *g = enter(a, "held", 1, 0);
        struct epd_group *gf = enter(a, "forming", 2, 0);

        ck_assert_int_eq(epd_drain(admin, "held", &r), EPD_OK);
        ck_assert_uint_eq(r.groups, 1);
        ck_assert_int_eq(r.daemon_draining, 0);
        ck_assert_str_eq(group_state(admin, "held"), "DRAINING");
        /* Draining twice changes nothing. */
        ck_assert_int_eq(epd_drain(admin, "held", &r), EPD_OK);
        ck_assert_uint_eq(r.groups, 0);

        /* A drained group collects the op but does not launch it. */
        struct epd_op *op = dispatch_submit(a, g);
        ck_assert_int_eq(epd_op_wait(op, 300), EPD_TIMEOUT);
        ck_assert_int_eq(epd_drain(admin, "held", &r), EPD_OK);
        ck_assert_uint_eq(r.waiting_ops, 1);
        ck_assert_int_eq(epd_op_wait(op, 100), EPD_TIMEOUT);
        ck_assert_int_eq(epd_undrain(admin, "held", &r), EPD_OK);
        ck_assert_uint_eq(r.groups, 1);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        epd_op_free(op);
        ck_assert_str_eq(group_state(admin, "held"), "READY");

        /* Its id names it too; out may be NULL. */
        snprintf(id, sizeof(id), "%llu", (unsigned long long)epd_group_id(g));
        ck_assert_int_eq(epd_drain(admin, id, NULL), EPD_OK);
        ck_assert_str_eq(group_state(admin, "held"), "DRAINING");
        ck_assert_int_eq(epd_undrain(admin, id, NULL), EPD_OK);
        ck_assert_str_eq(group_state(admin, "held"), "READY");

        /* The whole daemon, with a group drained on its own as well. */
        ck_assert_int_eq(epd_drain(admin, NULL, &r), EPD_OK);
        ck_assert_int_eq(r.daemon_draining, 1);
        ck_assert_int_eq(daemon_draining(admin), 1);
        ck_assert_str_eq(group_state(admin, "held"), "READY");
        op = dispatch_submit(a, g);
        ck_assert_int_eq(epd_op_wait(op, 300), EPD_TIMEOUT);
        ck_assert_int_eq(epd_drain(admin, "held", NULL), EPD_OK);
        ck_assert_int_eq(epd_undrain(admin, NULL, &r), EPD_OK);
        ck_assert_uint_eq(r.groups, 1);
        ck_assert_int_eq(r.daemon_draining, 0);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        epd_op_free(op);
        ck_assert_int_eq(daemon_draining(admin), 0);
        ck_assert_str_eq(group_state(admin, "held"), "READY");

        /* What cannot be drained. r stays as it was on failure. */
        r.groups = 77;
        ASSERT_FAILS(admin, epd_drain(admin, "no-such-group", &r), EPD_NOT_FOUND,
                     "no-such-group");
        ck_assert_uint_eq(r.groups, 77);
        ASSERT_FAILS(admin, epd_undrain(admin, "99999", &r), EPD_NOT_FOUND, "99999");
        ASSERT_FAILS(admin, epd_drain(admin, "forming", &r), EPD_INVALID_ARGUMENT, "FORMING");
        ASSERT_FAILS(admin, epd_drain(admin, "", &r), EPD_INVALID_ARGUMENT, "name a group");
        ck_assert_str_eq(group_state(admin, "forming"), "FORMING");

        epd_group_leave(gf);
        epd_group_leave(g);
        epd_client_free(admin);
        epd_client_free(a);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

/* The arena size of every rank of group `id` in the statistics; -1 when they differ. */
static long long stats_arena_bytes(struct epd_client *c, uint64_t id)
{
        struct epd_stats *stats;
        long long bytes = -2;

        ck_assert_int_eq(epd_stats_get(c, &stats), EPD_OK);
        const struct epd_admin_daemon_stats *s = epd_stats_daemon(stats);
        for (uint32_t i = 0; i < s->num_groups; i++) {
                if (s->groups[i].id != id)
                        continue;
                for (uint32_t r = 0; r < s->groups[i].num_ranks; r++) {
                        long long b = (long long)s->groups[i].ranks[r].arena_bytes;
                        bytes = bytes == -2 || bytes == b ? b : -1;
                }
        }
        epd_stats_free(stats);
        return bytes;
}

START_TEST(test_resize)
{
        struct h_daemon d;
        struct epd_resize_result *res = NULL;
        char id[32];

        daemon_start(&d);
        struct epd_client *a = h_connect_ok(&d, "rank0");
        struct epd_client *b = h_connect_ok(&d, "rank1");
        struct epd_group *ga = enter(a, "grow", 2, 0);
        struct epd_group *gb = enter(b, "grow", 2, 1);
        uint64_t gid = epd_group_id(ga);

        ck_assert_int_eq(epd_resize(a, "grow", 2 * ARENA_BYTES, &res), EPD_OK);
        const struct epd_resize_info *ri = epd_resize_result_info(res);
        ck_assert_uint_eq(ri->group_id, gid);
        ck_assert_uint_eq(ri->requested_bytes, 2 * ARENA_BYTES);
        ck_assert_uint_eq(ri->old_bytes, ARENA_BYTES);
        ck_assert_uint_eq(ri->new_bytes, 2 * ARENA_BYTES);
        ck_assert_uint_eq(ri->num_ranks, 2);
        for (uint32_t r = 0; r < 2; r++) {
                ck_assert_uint_eq(ri->ranks[r].rank, r);
                ck_assert_uint_eq(ri->ranks[r].old_bytes, ARENA_BYTES);
                ck_assert_uint_eq(ri->ranks[r].new_bytes, 2 * ARENA_BYTES);
                ck_assert_uint_ge(ri->ranks[r].segments, 1);
                ck_assert_uint_ge(ri->ranks[r].reserved_bytes, 2 * ARENA_BYTES);
        }
        epd_resize_result_free(res);
        ck_assert_int_eq(stats_arena_bytes(a, gid), 2 * ARENA_BYTES);

        /* Shrink by id, without a result. */
        snprintf(id, sizeof(id), "%llu", (unsigned long long)gid);
        ck_assert_int_eq(epd_resize(a, id, ARENA_BYTES / 2, NULL), EPD_OK);
        ck_assert_int_eq(stats_arena_bytes(a, gid), ARENA_BYTES / 2);
        struct epd_group_list *gl;
        ck_assert_int_eq(epd_group_list_get(a, &gl), EPD_OK);
        ck_assert_uint_eq(epd_group_list_at(gl, 0)->config.arena_bytes, ARENA_BYTES / 2);
        epd_group_list_free(gl);

        /* Refused: nothing changes and *out stays as it was. */
        res = NULL;
        ASSERT_FAILS(a, epd_resize(a, "grow", 0, &res), EPD_INVALID_ARGUMENT, "0 bytes");
        ASSERT_FAILS(a, epd_resize(a, NULL, ARENA_BYTES, &res), EPD_INVALID_ARGUMENT,
                     "name a group");
        ASSERT_FAILS(a, epd_resize(a, "no-such-group", ARENA_BYTES, &res), EPD_NOT_FOUND,
                     "no-such-group");
        ASSERT_FAILS(a, epd_resize(a, "grow", 1ull << 50, &res), EPD_INVALID_ARGUMENT,
                     "max_arena_bytes");
        ck_assert_ptr_null(res);
        ck_assert_int_eq(stats_arena_bytes(a, gid), ARENA_BYTES / 2);

        epd_group_leave(gb);
        epd_group_leave(ga);
        epd_client_free(b);
        epd_client_free(a);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

START_TEST(test_evict)
{
        struct h_daemon d;
        struct epd_client_list *cl;

        daemon_start(&d);
        struct epd_client *a = h_connect_ok(&d, "survivor");
        struct epd_client *b = h_connect_ok(&d, "victim");
        struct epd_group *ga = enter(a, "pair", 2, 0);
        struct epd_group *gb = enter(b, "pair", 2, 1);
        uint64_t victim = client_id(b);

        /* Rank 0's op waits for rank 1, which is evicted instead of submitting. */
        struct epd_op *op = dispatch_submit(a, ga);
        ck_assert_int_eq(epd_op_wait(op, 200), EPD_TIMEOUT);
        ck_assert_int_eq(epd_evict(a, victim), EPD_OK);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_PEER_LOST);
        epd_op_free(op);
        ck_assert_str_eq(group_state(a, "pair"), "BROKEN");

        ck_assert_int_eq(epd_client_list_get(a, &cl), EPD_OK);
        ck_assert_ptr_null(find_client(cl, victim));
        ck_assert_ptr_nonnull(find_client(cl, client_id(a)));
        epd_client_list_free(cl);
        /* The victim's connection is gone. */
        struct epd_daemon_status *st = NULL;
        ck_assert_int_ne(epd_daemon_status_get(b, &st), EPD_OK);
        ck_assert_ptr_null(st);
        ck_assert_str_ne(epd_client_last_error(b), "");

        ASSERT_FAILS(a, epd_evict(a, victim), EPD_NOT_FOUND, "not connected");
        ASSERT_FAILS(a, epd_evict(a, client_id(a)), EPD_INVALID_ARGUMENT, "itself");

        epd_group_leave(gb);
        epd_group_leave(ga);
        epd_client_free(b);
        epd_client_free(a);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

START_TEST(test_bad_arguments)
{
        struct h_daemon d;
        struct epd_daemon_status *st;
        struct epd_group_list *gl;
        struct epd_client_list *cl;
        struct epd_stats *stats;

        daemon_start(&d);
        struct epd_client *a = h_connect_ok(&d, "careless");

        /* No client: no message to keep. */
        ck_assert_int_eq(epd_daemon_status_get(NULL, &st), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_group_list_get(NULL, &gl), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_client_list_get(NULL, &cl), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_stats_get(NULL, &stats), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_drain(NULL, NULL, NULL), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_undrain(NULL, NULL, NULL), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_evict(NULL, 1), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_resize(NULL, "g", 1, NULL), EPD_INVALID_ARGUMENT);

        /* No place for the snapshot: the message names the call. */
        ASSERT_FAILS(a, epd_daemon_status_get(a, NULL), EPD_INVALID_ARGUMENT,
                     "epd_daemon_status_get: out is NULL");
        ASSERT_FAILS(a, epd_group_list_get(a, NULL), EPD_INVALID_ARGUMENT,
                     "epd_group_list_get");
        ASSERT_FAILS(a, epd_client_list_get(a, NULL), EPD_INVALID_ARGUMENT,
                     "epd_client_list_get");
        ASSERT_FAILS(a, epd_stats_get(a, NULL), EPD_INVALID_ARGUMENT, "epd_stats_get");
        ASSERT_FAILS(a, epd_evict(a, 0), EPD_NOT_FOUND, "client 0");

        /* Accessors and frees accept NULL. */
        ck_assert_ptr_null(epd_daemon_status_info(NULL));
        ck_assert_uint_eq(epd_group_list_count(NULL), 0);
        ck_assert_ptr_null(epd_group_list_at(NULL, 0));
        ck_assert_uint_eq(epd_client_list_count(NULL), 0);
        ck_assert_ptr_null(epd_client_list_at(NULL, 0));
        ck_assert_ptr_null(epd_stats_daemon(NULL));
        ck_assert_ptr_null(epd_resize_result_info(NULL));
        epd_daemon_status_free(NULL);
        epd_group_list_free(NULL);
        epd_client_list_free(NULL);
        epd_stats_free(NULL);
        epd_resize_result_free(NULL);

        /* The connection still works. */
        ck_assert_int_eq(epd_group_list_get(a, &gl), EPD_OK);
        ck_assert_uint_eq(epd_group_list_count(gl), 0);
        epd_group_list_free(gl);
        epd_client_free(a);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

/* As nobody: reading works, every verb is PERMISSION_DENIED. Exit status: 0 when so. */
static int non_admin_child(void *arg, int index)
{
        const struct h_daemon *d = arg;
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = d->socket,
                                       .client_name = "nobody" };
        struct epd_daemon_status *st;
        struct epd_client *c;
        char err[256];
        int rc, bad = 0;

        (void)index;
        if (setgroups(0, NULL) < 0 || setgid(NOBODY) < 0 || setuid(NOBODY) < 0)
                return 10;
        if ((rc = epd_client_connect(&ca, &c, err, sizeof(err))) < 0) {
                fprintf(stderr, "connect as nobody: %s: %s\n", epd_status_name(rc), err);
                return 11;
        }
        if ((epd_client_capabilities(c) & EPD_CAP_ADMIN) != 0)
                bad |= 1;
        if (epd_daemon_status_get(c, &st) != EPD_OK)
                bad |= 2;
        else
                epd_daemon_status_free(st);
        const int rcs[] = { epd_drain(c, "guarded", NULL), epd_drain(c, NULL, NULL),
                            epd_undrain(c, NULL, NULL), epd_evict(c, 1),
                            epd_resize(c, "guarded", 2 * ARENA_BYTES, NULL) };
        for (size_t i = 0; i < sizeof(rcs) / sizeof(rcs[0]); i++) {
                if (rcs[i] != EPD_PERMISSION_DENIED) {
                        fprintf(stderr, "verb %zu as nobody: %s\n", i, epd_status_name(rcs[i]));
                        bad |= 4;
                }
        }
        if (!strstr(epd_client_last_error(c), "admin"))
                bad |= 8;
        epd_client_free(c);
        return bad;
}

START_TEST(test_non_admin_denied)
{
        struct h_daemon d;

        if (geteuid() != 0) {
                printf("test_non_admin_denied: not root, nothing to switch to; passing\n");
                return;
        }
        /* No admin_group: only root is an admin. */
        const char *args[] = { "--socket-mode", "0666", NULL };
        ck_assert_int_eq(h_daemon_start(&d, args), 0);
        ck_assert_int_eq(chmod(d.dir, 0711), 0);
        struct epd_client *a = h_connect_ok(&d, "owner");
        struct epd_group *g = enter(a, "guarded", 1, 0);

        pid_t pid = h_spawn(non_admin_child, &d, 0);
        ck_assert_int_eq(h_wait_all(&pid, 1, 20000), 0);

        /* Nothing changed. */
        ck_assert_str_eq(group_state(a, "guarded"), "READY");
        ck_assert_int_eq(daemon_draining(a), 0);
        ck_assert_int_eq(stats_arena_bytes(a, epd_group_id(g)), ARENA_BYTES);
        ck_assert_msg(h_daemon_log_contains(&d, "admin request refused"),
                      "the daemon log does not name the refusal");
        epd_group_leave(g);
        epd_client_free(a);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

static Suite *admin_api_suite(void)
{
        Suite *s = suite_create("admin_api");
        TCase *tc = tcase_create("admin_api");

        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_snapshots);
        tcase_add_test(tc, test_drain_undrain);
        tcase_add_test(tc, test_resize);
        tcase_add_test(tc, test_evict);
        tcase_add_test(tc, test_bad_arguments);
        tcase_add_test(tc, test_non_admin_denied);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        return h_run_suite(admin_api_suite());
}
