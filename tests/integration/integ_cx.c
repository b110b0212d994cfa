/* integ_cx.c - client-executed groups end to end on the host backend: a real daemon allocates
 * and exports the buffers, R worker processes run dispatch and combine through libepd's
 * epd_cx_* calls (docs/client-execution.md).
 *
 * - Every case of tests/lib/cx_case.h (every layout and dtype cpu/cx.c supports: NON_EXPAND,
 *   EXPAND, fixed expert blocks, cached dispatch, quantizing dispatch, combine with bias,
 *   source_weights and recv_weights) at R = 2 and R = 4, bitwise against the reference, with
 *   outputs and y in the buffers and again in client memory registered with the group.
 * - Registered memory misused (unregistered, rows or y memory too small, ranks naming different
 *   registrations, memory outside any region): INVALID_ARGUMENT everywhere, naming it, nothing
 *   written.
 * - A rank SIGKILLed while its peers wait in an op: every peer ends PEER_LOST within 100 ms, later
 *   launches fail at once, and after a new process binds the rank the group runs again from op 0.
 * - A peer that never launches: TIMEOUT after the group's op timeout, naming the rank.
 * - A capacity failure: CAPACITY_EXCEEDED on every rank, nothing written.
 * - Mode mismatches, bad shapes, resize and drain of a client-executed group, and the statistics
 *   the daemon reads from the buffers.
 */
#include <check.h>
#include <grp.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cx_case.h"
#include "cx_layout.h"
#include "epd.h"
#include "harness.h"
#include "testdata.h"

#define MAX_R 4u
#define POISON 0xA5u
#define PEER_LOST_BOUND_MS 100

struct shared {
        struct h_daemon d;
        struct cx_case c;             /* the case, with R set */
        char name[64];
        uint32_t op_timeout_ms;
        uint64_t seed;
        atomic_int launching;         /* peers about to wait in the op the victim never joins */
        atomic_int failed_twice;      /* peers saw their later launch fail at once */
        atomic_int rejoined;          /* the replacement rank is bound */
        atomic_int busy;              /* drain under load: ranks well into their ops */
        atomic_int refused;           /* ranks that saw ABORTED */
        atomic_int undrained;         /* the parent undrained the group */
        uint64_t refused_at[MAX_R];   /* the op number each rank was refused at */
        int registered;               /* rows and y in memory registered with the group */
        int older_args;               /* dispatch args sized as before round_scale existed */
        uint32_t recv_rows;           /* the group's receive rows; 0: the shape's worst case */
        int short_rows;               /* the group has fewer receive rows than the op needs */
        long long kill_ms;
        int status[MAX_R];
        long long done_ms[MAX_R];
        char msg[MAX_R][512];
};

static struct shared *shared_new(void)
{
        struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);

        ck_assert_msg(sh != MAP_FAILED, "mmap of the shared state failed");
        memset(sh, 0, sizeof(*sh));
        return sh;
}

static void shared_free(struct shared *sh)
{
        ck_assert_int_eq(h_daemon_stop(&sh->d, 5000), 0);
        munmap(sh, sizeof(*sh));
}

/* Starts the daemon with this process as an admin (root, or through admin_group). */
static void daemon_start(struct shared *sh)
{
        char conf[PATH_MAX] = "";
        const char *args[3] = { NULL, NULL, NULL };

        if (geteuid() != 0) {
                struct group *gr = getgrgid(getegid());
                FILE *f;

                ck_assert_ptr_nonnull(gr);
                snprintf(conf, sizeof(conf), "/tmp/epd-cx-%d.conf", (int)getpid());
                f = fopen(conf, "we");
                ck_assert_ptr_nonnull(f);
                fprintf(f, "[daemon]\nadmin_group = %s\n", gr->gr_name);
                fclose(f);
                args[0] = "--config";
                args[1] = conf;
        }
        ck_assert_int_eq(h_daemon_start(&sh->d, args), 0);
        if (conf[0])
                unlink(conf);
}

/* The group of the case, entered as rank `rank`. NULL with msg set on failure. */
static struct epd_group *enter(struct shared *sh, struct epd_client *cl, uint32_t rank,
                               char *msg, size_t len)
{
        struct epd_group_config cfg;
        struct epd_group *g = NULL;
        int rc;

        cx_case_group_config(&sh->c, sh->op_timeout_ms, &cfg);
        cfg.recv_rows = sh->recv_rows;
        rc = h_group_enter(cl, sh->name, rank, &cfg, &g);
        if (rc)
                snprintf(msg, len, "rank %u: enter returned %d: %s", rank, rc,
                         epd_client_last_error(cl));
        return rc ? NULL : g;
}

/* ---- one rank's rounds through the public API ---- */

struct worker {
        struct shared *sh;
        uint32_t me;
        struct epd_group *g;
        struct epd_client *cl;
        struct cx_layout l;
        struct epd_cx_buffers b;
        uint8_t *base;                /* this rank's buffer, from epd_cx_buffers */
        uint64_t ops;
        uint64_t dispatches_ok;       /* epd_cx_status's count of this rank's OK dispatches */
        uint64_t dispatch_ns;         /* and their phase times, summed */
        int stats_known;              /* the two above read once */
        /* sh->registered: registered memory (epd_cx_register) for the rows (recv_mem, id 1)
         * and for y (y_mem, id 2); recv_base is where check_dispatch finds the rows. */
        uint8_t *recv_mem, *y_mem, *recv_base;
        uint32_t recv_id, y_id;
};

/* Records the worker's failure where the test process reads it; returns 1. */
#define worker_fail(w, ...) \
        h_fail((w)->sh->msg[(w)->me], sizeof((w)->sh->msg[(w)->me]), __VA_ARGS__)

/* Registers memory of an epd_region_alloc region for the rows and for y, and poisons the
 * buffer's own receive area, which no op may write then. */
static int worker_register(struct worker *w)
{
        const uint64_t rb = (w->b.recv_area_bytes + 63) / 64 * 64, yb = w->b.y_area_bytes;
        uint64_t region;
        void *p;

        if (rb < cx_recv_area_bytes(&w->l) || yb != cx_y_area_bytes(&w->l))
                return worker_fail(w, "rank %u: epd_cx_buffers gives area bytes %" PRIu64 ", %"
                                   PRIu64 "; the layout %" PRIu64 ", %" PRIu64, w->me,
                                   w->b.recv_area_bytes, yb, cx_recv_area_bytes(&w->l),
                                   cx_y_area_bytes(&w->l));
        if (epd_region_alloc(w->cl, rb + yb + 4096, &p, &region))
                return worker_fail(w, "rank %u: epd_region_alloc: %s", w->me,
                                   epd_client_last_error(w->cl));
        /* Offsets inside the region, so the peers map it at an offset that is not a page's. */
        w->recv_mem = (uint8_t *)p + 64;
        w->y_mem = w->recv_mem + rb;
        if (epd_cx_register(w->g, w->recv_mem, w->b.recv_area_bytes, &w->recv_id) ||
            epd_cx_register(w->g, w->y_mem, yb, &w->y_id) || w->recv_id != 1 || w->y_id != 2)
                return worker_fail(w, "rank %u: epd_cx_register gave %u, %u: %s", w->me,
                                   w->recv_id, w->y_id, epd_client_last_error(w->cl));
        memset(w->recv_mem, POISON, w->b.recv_area_bytes);
        memset(w->base + w->l.recv_x, POISON, cx_recv_area_bytes(&w->l));
        w->recv_base = w->recv_mem - w->l.recv_x;
        return 0;
}

/* Whether the buffer's own receive area still holds only the poison. */
static int own_area_untouched(const struct worker *w)
{
        const uint8_t *a = w->base + w->l.recv_x;

        for (uint64_t i = 0; i < cx_recv_area_bytes(&w->l); i++)
                if (a[i] != POISON)
                        return 0;
        return 1;
}

static int worker_open(struct worker *w, struct shared *sh, uint32_t me)
{
        struct cx_shape shape;

        memset(w, 0, sizeof(*w));
        w->sh = sh;
        w->me = me;
        w->cl = h_connect(&sh->d, "cx-worker");
        if (!w->cl)
                return worker_fail(w, "rank %u: connect failed", me);
        w->g = enter(sh, w->cl, me, sh->msg[me], sizeof(sh->msg[me]));
        if (!w->g)
                return 1;
        cx_case_shape(&sh->c, &shape);
        shape.recv_rows = sh->recv_rows;
        if (cx_layout_compute(&shape, &w->l) != CX_SHAPE_OK)
                return worker_fail(w, "rank %u: shape refused", me);
        w->b.size = sizeof(w->b);
        if (epd_cx_buffers(w->g, &w->b))
                return worker_fail(w, "rank %u: epd_cx_buffers: %s", me,
                                   epd_client_last_error(w->cl));
        if (w->b.bytes_per_rank != w->l.total_bytes || w->b.recv_rows != w->l.recv_rows)
                return worker_fail(w, "rank %u: buffer of %" PRIu64 " bytes, %u rows; the layout "
                                   "says %" PRIu64 ", %u", me, w->b.bytes_per_rank,
                                   w->b.recv_rows, w->l.total_bytes, w->l.recv_rows);
        w->base = (uint8_t *)w->b.recv_x - w->l.recv_x;
        w->recv_base = w->base;
        return sh->registered ? worker_register(w) : 0;
}

static void worker_close(struct worker *w)
{
        epd_group_leave(w->g);
        epd_client_free(w->cl);
}

static struct epd_cx_dispatch_args dispatch_args(const struct cx_case *c,
                                                 const struct cx_case_data *rd, uint32_t me,
                                                 uint32_t handle)
{
        return (struct epd_cx_dispatch_args){
                .size = sizeof(struct epd_cx_dispatch_args), .num_tokens = rd->n[me],
                .num_topk = c->K, .x = rd->x[me], .scales = rd->scales[me],
                .topk_idx = rd->topk[me], .topk_dtype = c->topk_dtype,
                .topk_weights = c->has_weights ? rd->weights[me] : NULL, .layout = c->layout,
                .expert_alignment = c->align, .zero_padding = c->zero_padding,
                .expert_block_rows = c->block_rows, .quantize = c->quantize, .handle = handle,
                .round_scale = c->round_scale,
                .scale_format = (enum epd_scale_format)cx_case_scale_format(c),
        };
}

/* Checks a dispatch's outputs and counts, then runs and checks its combine. */
static int check_and_combine(struct worker *w, const struct cx_case_data *rd,
                             const struct ref_dispatch *ref, uint32_t handle, uint32_t round)
{
        const struct cx_case *c = &w->sh->c;
        const uint32_t me = w->me, n = rd->n[me];
        struct epd_cx_counts counts = { .size = sizeof(counts) };
        uint16_t *combined = malloc((size_t)n * c->H * 2 + 2);
        float *cw = malloc((size_t)n * c->K * 4 + 4);
        struct epd_cx_combine_args a = {
                .size = sizeof(a), .handle = handle, .recv_weights = c->recv_weights,
                .apply_weights = c->apply_weights,
                .source_weights = c->source_weights ? rd->sw[me] : NULL,
                .num_bias = (uint32_t)c->nbias,
                .bias = { c->nbias > 0 ? rd->bias[me][0] : NULL,
                          c->nbias > 1 ? rd->bias[me][1] : NULL },
                .combined = combined, .combined_topk_weights = cw, .y_memory = w->y_id,
        };
        uint16_t *y = w->y_mem ? (uint16_t *)w->y_mem : w->b.y;
        float *yw = w->y_mem ? (float *)(w->y_mem + (w->l.y_weights - w->l.y)) : w->b.y_weights;
        char msg[400];
        int rc, failed = 0;

        if (cx_case_check_dispatch(c, &w->l, w->base, handle, w->recv_base, ref, me, msg,
                                   sizeof(msg)))
                failed = worker_fail(w, "%s round %u rank %u: dispatch: %s", c->name, round, me,
                                     msg);
        else if (w->recv_mem && !own_area_untouched(w))
                failed = worker_fail(w, "%s round %u rank %u: a dispatch into registered memory "
                                     "wrote the buffer's receive area", c->name, round, me);
        else if (epd_cx_counts(w->g, handle, &counts) ||
                 counts.num_recv_tokens != cx_handle_at(w->base, &w->l, handle)->num_recv_tokens ||
                 counts.rank_prefix[c->R] != counts.num_recv_tokens)
                failed = worker_fail(w, "%s round %u rank %u: epd_cx_counts disagrees with the "
                                     "handle slot", c->name, round, me);
        if (!failed) {
                memcpy(y, rd->y[me], (size_t)w->l.recv_rows * c->H * 2);
                if (c->recv_weights)
                        memcpy(yw, rd->yw[me], (size_t)w->l.recv_rows * c->K * 4);
                rc = epd_cx_combine(w->g, &a, NULL);
                w->ops++;
                if (rc)
                        failed = worker_fail(w, "%s round %u rank %u: combine returned %d: %s",
                                             c->name, round, me, rc,
                                             epd_client_last_error(w->cl));
                else if (cx_case_check_combine(c, rd, ref, me, combined, cw, msg, sizeof(msg)))
                        failed = worker_fail(w, "%s round %u rank %u: combine: %s", c->name,
                                             round, me, msg);
        }
        free(combined);
        free(cw);
        return failed;
}

/* One round: dispatch -> combine, and with a cached case, cached dispatch -> combine. */
static int run_round(struct worker *w, uint32_t round)
{
        const struct cx_case *c = &w->sh->c;
        struct cx_case_data rd;
        uint32_t handle = round % w->b.num_handle_slots;
        struct epd_cx_dispatch_args a;
        struct epd_cx_status st = { .size = sizeof(st) };
        char err[256];
        uint64_t t0, t1;
        int rc, failed = 0;

        if (cx_case_data_make(c, w->l.recv_rows, td_mix_seed(w->sh->seed, round), &rd, err,
                              sizeof(err)))
                return worker_fail(w, "%s: %s", c->name, err);
        a = dispatch_args(c, &rd, w->me, handle);
        a.recv_memory = w->recv_id;
        if (w->sh->older_args) {
                /* A caller built against the header before the scale options: what lies past
                 * its size is not its own and must not be read. */
                a.size = offsetof(struct epd_cx_dispatch_args, round_scale);
                a.round_scale = 1;
                a.scale_format = EPD_SCALE_FORMAT_UE8M0;
        }
        t0 = h_now_ms();
        rc = epd_cx_dispatch(w->g, &a, NULL);
        t1 = h_now_ms();
        if (rc) {
                failed = worker_fail(w, "%s round %u rank %u: dispatch returned %d: %s", c->name,
                                     round, w->me, rc, epd_client_last_error(w->cl));
        } else if (epd_cx_status(w->g, &st) || st.op != w->ops || st.status != 0) {
                failed = worker_fail(w, "%s round %u rank %u: epd_cx_status op %" PRIu64
                                     " status %d, expected op %" PRIu64 " OK", c->name, round,
                                     w->me, st.op, st.status, w->ops);
        } else {
                /* The phase times (counted since the buffer was made, earlier formations
                 * included): from the second round on, one more OK dispatch, and its phases
                 * within the call. */
                uint64_t sum = st.phase_ns[0][0] + st.phase_ns[0][1] + st.phase_ns[0][2];

                w->dispatches_ok = w->stats_known ? w->dispatches_ok + 1 : st.kind_ops[0];
                if (!w->stats_known)
                        w->dispatch_ns = sum - 1;
                w->stats_known = 1;
                if (st.kind_ops[0] != w->dispatches_ok || sum <= w->dispatch_ns ||
                    sum - w->dispatch_ns > (t1 - t0 + 2) * 1000000ull)
                        failed = worker_fail(w, "%s round %u rank %u: %" PRIu64 " OK dispatches "
                                             "(expected %" PRIu64 "), phases %" PRIu64 " ns "
                                             "after %" PRIu64 ", the call took %" PRIu64 " ms",
                                             c->name, round, w->me, st.kind_ops[0],
                                             w->dispatches_ok, sum, w->dispatch_ns, t1 - t0);
                w->dispatch_ns = sum;
                /* The op's window is on CLOCK_MONOTONIC (host backend), within the call. */
                if (!failed && (st.start_ns > st.end_ns || st.start_ns / 1000000 < t0 ||
                                st.end_ns / 1000000 > t1))
                        failed = worker_fail(w, "%s round %u rank %u: the op's window %" PRIu64
                                             " .. %" PRIu64 " ns is not within the call, %" PRIu64
                                             " .. %" PRIu64 " ms", c->name, round, w->me,
                                             st.start_ns, st.end_ns, t0, t1);
        }
        w->ops++;
        if (!failed)
                failed = check_and_combine(w, &rd, rd.ref, handle, round);
        if (!failed && c->cached) {
                a.cached = 1;
                a.topk_idx = NULL;
                a.topk_weights = c->has_weights ? rd.weights2[w->me] : NULL;
                rc = epd_cx_dispatch(w->g, &a, NULL);
                w->ops++;
                if (rc) {
                        failed = worker_fail(w, "%s round %u rank %u: cached dispatch returned "
                                             "%d: %s", c->name, round, w->me, rc,
                                             epd_client_last_error(w->cl));
                } else if (epd_cx_status(w->g, &st) || st.kind_ops[0] != ++w->dispatches_ok) {
                        failed = worker_fail(w, "%s round %u rank %u: %" PRIu64 " OK dispatches "
                                             "after the cached one (expected %" PRIu64 ")",
                                             c->name, round, w->me, st.kind_ops[0],
                                             w->dispatches_ok);
                } else {
                        w->dispatch_ns = st.phase_ns[0][0] + st.phase_ns[0][1] +
                                         st.phase_ns[0][2];
                        failed = check_and_combine(w, &rd, rd.ref2, handle, round);
                }
        }
        cx_case_data_free(c, &rd);
        return failed;
}

static int bitwise_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w;
        int failed = worker_open(&w, sh, (uint32_t)index);

        for (uint32_t i = 0; !failed && i < sh->c.rounds; i++)
                failed = run_round(&w, i);
        if (w.g)
                worker_close(&w);
        return failed;
}

static void run_workers(struct shared *sh, int (*fn)(void *, int))
{
        pid_t pids[MAX_R];
        int bad;

        for (uint32_t r = 0; r < sh->c.R; r++)
                pids[r] = h_spawn(fn, sh, (int)r);
        bad = h_wait_all(pids, (int)sh->c.R, 120000);
        for (uint32_t r = 0; r < sh->c.R; r++)
                if (sh->msg[r][0])
                        fprintf(stderr, "%s\n", sh->msg[r]);
        ck_assert_msg(bad == 0, "%s at R = %u: %d worker(s) failed: %s", sh->c.name, sh->c.R,
                      bad, sh->msg[0][0] ? sh->msg[0] : sh->msg[1]);
}

/* The case of index i with R ranks, or 0 when its expert count does not divide. */
static int case_at(size_t i, uint32_t R, struct cx_case *out)
{
        *out = cx_cases[i];
        out->R = R;
        return out->E % R == 0 && out->E / R <= 256;
}

/* Once its last rank left, a group and its buffers are gone from the daemon's statistics. */
static void check_group_gone(struct shared *sh)
{
        struct epd_client *cl = h_connect_ok(&sh->d, "cx-stats");
        struct epd_stats *st;
        const struct epd_admin_daemon_stats *ds;
        int found = 0;

        ck_assert_int_eq(epd_stats_get(cl, &st), 0);
        ds = epd_stats_daemon(st);
        for (uint32_t i = 0; i < ds->num_groups; i++) {
                const struct epd_admin_group_stats *gs = &ds->groups[i];

                if (strcmp(gs->name, sh->name) != 0)
                        continue;
                found = 1;
        }
        epd_stats_free(st);
        epd_client_free(cl);
        ck_assert_msg(!found, "group %s outlived its ranks", sh->name);
}

/* Whether every round's data of the case fits it: fixed expert blocks were sized for the
 * case's own R, and routing at another R may need more rows than a block holds. */
static int data_fits(const struct shared *sh)
{
        struct cx_shape shape;
        struct cx_layout l;
        struct cx_case_data rd;
        char err[256];

        cx_case_shape(&sh->c, &shape);
        ck_assert_int_eq(cx_layout_compute(&shape, &l), CX_SHAPE_OK);
        for (uint32_t i = 0; i < sh->c.rounds; i++) {
                int bad = cx_case_data_make(&sh->c, l.recv_rows, td_mix_seed(sh->seed, i),
                                            &rd, err, sizeof(err));

                cx_case_data_free(&sh->c, &rd); /* also what a failed make left */
                if (bad)
                        return 0;
        }
        return 1;
}

/* Every case at R = 2 and 4, with outputs in the buffers or (registered) in client memory. */
static void bitwise_all(int registered)
{
        struct shared *sh = shared_new();
        unsigned ran = 0;

        sh->registered = registered;
        daemon_start(sh);
        for (uint32_t R = 2; R <= MAX_R; R += 2) {
                for (size_t i = 0; i < cx_num_cases; i++) {
                        if (!case_at(i, R, &sh->c))
                                continue;
                        snprintf(sh->name, sizeof(sh->name), "cx-%s-r%u%s", sh->c.name, R,
                                 registered ? "-reg" : "");
                        sh->op_timeout_ms = 20000;
                        sh->seed = td_mix_seed(0xC0FFEEull, i * 8 + R);
                        if (!data_fits(sh))
                                continue;
                        memset(sh->msg, 0, sizeof(sh->msg));
                        run_workers(sh, bitwise_worker);
                        check_group_gone(sh);
                        ran++;
                }
        }
        fprintf(stderr, "integ_cx: %u case(s) bitwise at R = 2 and 4%s\n", ran,
                registered ? ", into registered memory" : "");
        /* Every case runs at R = 2 or R = 4 or both. */
        ck_assert_uint_ge(ran, cx_num_cases + 4);
        h_assert_daemon_alive(&sh->d, "after the bitwise cases");
        shared_free(sh);
}

START_TEST(test_bitwise)
{
        bitwise_all(0);
}
END_TEST

START_TEST(test_bitwise_registered)
{
        bitwise_all(1);
}
END_TEST

/* A dispatch struct of the size before round_scale and scale_format existed, with set bytes past
 * its end: libepd reads neither, so the rows are the plain §2.7 quantization, bit for bit. */
START_TEST(test_older_args)
{
        struct shared *sh = shared_new();
        size_t i;

        daemon_start(sh);
        for (i = 0; i < cx_num_cases; i++)
                if (cx_cases[i].quantize && !cx_cases[i].round_scale && cx_cases[i].R > 1)
                        break;
        ck_assert_uint_lt(i, cx_num_cases);
        ck_assert(case_at(i, 2, &sh->c));
        sh->older_args = 1;
        snprintf(sh->name, sizeof(sh->name), "cx-older-args");
        sh->op_timeout_ms = 20000;
        sh->seed = td_mix_seed(0x01DA5ull, i);
        memset(sh->msg, 0, sizeof(sh->msg));
        run_workers(sh, bitwise_worker);
        shared_free(sh);
}
END_TEST

/* Misuse of registered memory, each in a group of its own (a failed op sticks): memory outside
 * any registered region, a dispatch naming a registration that does not exist, one whose memory
 * of rank 1 is too small, ranks naming different registrations, and a combine whose y memory of
 * rank 1 is too small. Each op fails
 * INVALID_ARGUMENT on every rank with a message naming the fault, and writes nothing. */
enum { REG_UNREGISTERED, REG_TOO_SMALL, REG_MISMATCH, REG_Y_TOO_SMALL, REG_CASES };

static int register_error_worker(void *arg, int index)
{
        static const char *const want[REG_CASES] = {
                [REG_UNREGISTERED] = "recv_memory 1 is not registered with the group",
                [REG_TOO_SMALL] = "recv_memory 1 of rank 1 has",
                [REG_MISMATCH] = "rank 1",
                [REG_Y_TOO_SMALL] = "y_memory 1 of rank 1 has",
        };
        struct shared *sh = arg;
        struct worker w;
        struct cx_case_data rd;
        struct epd_cx_dispatch_args a;
        uint32_t id = 0, id2 = 0;
        char err[256];
        void *p = NULL, *loose = NULL;
        uint64_t region;
        int rc;

        if (worker_open(&w, sh, (uint32_t)index))
                return 1;
        if (cx_case_data_make(&sh->c, w.l.recv_rows, 3, &rd, err, sizeof(err)))
                return worker_fail(&w, "%s", err);
        if (posix_memalign(&loose, 64, 4096) ||
            epd_cx_register(w.g, loose, 4096, &id) != EPD_INVALID_ARGUMENT ||
            !strstr(epd_client_last_error(w.cl), "not inside a host memfd region"))
                return worker_fail(&w, "rank %u: registering malloc memory: %s", w.me,
                                   epd_client_last_error(w.cl));
        free(loose);
        if (sh->refused != REG_UNREGISTERED) {
                uint64_t bytes = sh->refused == REG_Y_TOO_SMALL ? w.b.y_area_bytes
                                                                 : w.b.recv_area_bytes;

                if (epd_region_alloc(w.cl, 2 * bytes + 128, &p, &region))
                        return worker_fail(&w, "rank %u: epd_region_alloc: %s", w.me,
                                           epd_client_last_error(w.cl));
                if (epd_cx_register(w.g, (uint8_t *)p + 1, bytes, &id) != EPD_INVALID_ARGUMENT)
                        return worker_fail(&w, "rank %u: an unaligned pointer was registered",
                                           w.me);
                if ((sh->refused == REG_TOO_SMALL || sh->refused == REG_Y_TOO_SMALL) &&
                    w.me == 1)
                        bytes -= 64;
                if (epd_cx_register(w.g, p, bytes, &id) ||
                    epd_cx_register(w.g, (uint8_t *)p + (bytes + 127) / 64 * 64, bytes, &id2))
                        return worker_fail(&w, "rank %u: epd_cx_register: %s", w.me,
                                           epd_client_last_error(w.cl));
                memset(p, POISON, 2 * bytes + 128);
        }
        a = dispatch_args(&sh->c, &rd, w.me, 0);
        if (sh->refused == REG_Y_TOO_SMALL) {
                /* rows into the buffers, then a combine from too small y memory */
                uint16_t *combined = malloc((size_t)rd.n[w.me] * sh->c.H * 2 + 2);
                struct epd_cx_combine_args cb = {
                        .size = sizeof(cb), .handle = 0, .combined = combined, .y_memory = 1,
                };

                rc = epd_cx_dispatch(w.g, &a, NULL);
                if (rc)
                        return worker_fail(&w, "rank %u: dispatch returned %d: %s", w.me, rc,
                                           epd_client_last_error(w.cl));
                memset(combined, POISON, (size_t)rd.n[w.me] * sh->c.H * 2);
                rc = epd_cx_combine(w.g, &cb, NULL);
                for (uint64_t i = 0; i < (uint64_t)rd.n[w.me] * sh->c.H * 2; i++)
                        if (((const uint8_t *)combined)[i] != POISON)
                                return worker_fail(&w, "rank %u: the failed combine wrote "
                                                   "byte %" PRIu64 " of combined", w.me, i);
                free(combined);
                p = NULL; /* nothing below to check in the y memory */
                goto check;
        }
        memset(w.base + w.l.recv_x, POISON, cx_recv_area_bytes(&w.l));
        a.recv_memory = sh->refused == REG_MISMATCH && w.me == 1 ? 2 : 1;
        rc = epd_cx_dispatch(w.g, &a, NULL);
check:
        if (rc != EPD_INVALID_ARGUMENT || !strstr(epd_client_last_error(w.cl), want[sh->refused]))
                return worker_fail(&w, "case %d rank %u: the op returned %d: %s, expected "
                                   "INVALID_ARGUMENT naming '%s'", sh->refused, w.me, rc,
                                   epd_client_last_error(w.cl), want[sh->refused]);
        if (sh->refused != REG_Y_TOO_SMALL && !own_area_untouched(&w))
                return worker_fail(&w, "case %d rank %u: the failed dispatch wrote the receive "
                                   "area", sh->refused, w.me);
        for (uint64_t i = 0; p && i < w.b.recv_area_bytes - 64; i++)
                if (((const uint8_t *)p)[i] != POISON)
                        return worker_fail(&w, "case %d rank %u: the failed dispatch wrote byte "
                                           "%" PRIu64 " of the registered memory", sh->refused,
                                           w.me, i);
        fprintf(stderr, "integ_cx: rank %u: %s\n", w.me, epd_client_last_error(w.cl));
        cx_case_data_free(&sh->c, &rd);
        worker_close(&w);
        return 0;
}

START_TEST(test_register_errors)
{
        struct shared *sh = shared_new();

        daemon_start(sh);
        ck_assert(case_at(0, 2, &sh->c));
        sh->op_timeout_ms = 20000;
        for (int k = 0; k < REG_CASES; k++) {
                snprintf(sh->name, sizeof(sh->name), "cx-register-%d", k);
                sh->refused = k; /* the case, read by the workers */
                memset(sh->msg, 0, sizeof(sh->msg));
                run_workers(sh, register_error_worker);
        }
        h_assert_daemon_alive(&sh->d, "after the registration errors");
        shared_free(sh);
}
END_TEST

/* ---- a rank killed while its peers wait ---- */

static int victim_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w;

        if (worker_open(&w, sh, (uint32_t)index) || run_round(&w, 0))
                return 1;
        atomic_fetch_add(&sh->launching, 1);
        for (;;)
                pause(); /* never launches op 2; SIGKILLed */
}

static int peer_worker(void *arg, int index)
{
        struct shared *sh = arg;
        const struct cx_case *c = &sh->c;
        struct worker w;
        struct cx_case_data rd;
        struct epd_cx_dispatch_args a;
        struct epd_cx_status st = { .size = sizeof(st) };
        char err[256];
        long long t0;
        int rc, failed;

        if (worker_open(&w, sh, (uint32_t)index) || run_round(&w, 0))
                return 1;
        if (cx_case_data_make(c, w.l.recv_rows, td_mix_seed(sh->seed, 1), &rd, err, sizeof(err)))
                return worker_fail(&w, "%s", err);
        a = dispatch_args(c, &rd, w.me, 1);
        atomic_fetch_add(&sh->launching, 1);
        rc = epd_cx_dispatch(w.g, &a, NULL);
        sh->done_ms[w.me] = h_now_ms();
        sh->status[w.me] = rc;
        if (rc != EPD_PEER_LOST)
                return worker_fail(&w, "rank %u: the op its peer never joined returned %d: %s",
                                   w.me, rc, epd_client_last_error(w.cl));
        if (epd_cx_status(w.g, &st) || st.status != EPD_PEER_LOST || !strstr(st.message, "peer"))
                return worker_fail(&w, "rank %u: epd_cx_status %d '%s'", w.me, st.status,
                                   st.message);
        /* Broken: a later launch fails at once without waiting for anyone. */
        t0 = h_now_ms();
        rc = epd_cx_dispatch(w.g, &a, NULL);
        if (rc != EPD_PEER_LOST || h_now_ms() - t0 > 1000)
                return worker_fail(&w, "rank %u: a launch in the broken group returned %d after "
                                   "%lld ms", w.me, rc, h_now_ms() - t0);
        cx_case_data_free(c, &rd);
        atomic_fetch_add(&sh->failed_twice, 1);
        /* The group re-forms when the rank is bound again; then ops restart at 0. */
        if (h_flag_wait(&sh->rejoined, 1, 30000))
                return worker_fail(&w, "rank %u: the replacement never joined", w.me);
        w.ops = 0;
        failed = run_round(&w, 2) || run_round(&w, 3);
        worker_close(&w);
        return failed;
}

static int replacement_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w;
        int failed;

        if (worker_open(&w, sh, (uint32_t)index))
                return 1;
        atomic_store(&sh->rejoined, 1);
        failed = run_round(&w, 2) || run_round(&w, 3);
        worker_close(&w);
        return failed;
}

/* The PEER_LOST bound to assert: 100 ms (docs/client-execution.md), or 1 s on a machine whose
 * load average exceeds its CPUs, where the daemon and the peers wait for a core that long (the
 * op timeout, 20 s here, is what a missed abort would show). */
static long long peer_lost_bound_ms(void)
{
        double load = 0;
        FILE *f = fopen("/proc/loadavg", "re");

        if (f) {
                if (fscanf(f, "%lf", &load) != 1)
                        load = 0;
                fclose(f);
        }
        if (load > (double)sysconf(_SC_NPROCESSORS_ONLN)) {
                fprintf(stderr, "integ_cx: load average %.1f: PEER_LOST bound 1000 ms\n", load);
                return 1000;
        }
        return PEER_LOST_BOUND_MS;
}

START_TEST(test_peer_lost)
{
        struct shared *sh = shared_new();
        const uint32_t R = 4, victim = 3;
        long long bound = peer_lost_bound_ms();
        pid_t pids[MAX_R];
        int bad;

        daemon_start(sh);
        ck_assert(case_at(1, R, &sh->c)); /* NON_EXPAND bf16 with recv_weights, cached */
        snprintf(sh->name, sizeof(sh->name), "cx-peer-lost");
        sh->op_timeout_ms = 20000;
        sh->seed = 0x5EEDull;
        for (uint32_t r = 0; r < R; r++)
                pids[r] = h_spawn(r == victim ? victim_worker : peer_worker, sh, (int)r);
        ck_assert_msg(h_flag_wait(&sh->launching, (int)R, 30000) == 0,
                      "the ranks did not reach the second op: %s", sh->msg[0]);
        usleep(50000); /* the peers now wait for the victim's count record */
        sh->kill_ms = h_now_ms();
        kill(pids[victim], SIGKILL);
        waitpid(pids[victim], NULL, 0);
        ck_assert_msg(h_flag_wait(&sh->failed_twice, (int)R - 1, 30000) == 0,
                      "the peers did not fail: %s | %s | %s", sh->msg[0], sh->msg[1], sh->msg[2]);
        for (uint32_t r = 0; r < R; r++) {
                if (r == victim)
                        continue;
                ck_assert_int_eq(sh->status[r], EPD_PEER_LOST);
                fprintf(stderr, "integ_cx: rank %u saw PEER_LOST %lld ms after the kill\n", r,
                        sh->done_ms[r] - sh->kill_ms);
                ck_assert_msg(sh->done_ms[r] - sh->kill_ms <= bound,
                              "rank %u saw PEER_LOST %lld ms after the kill (bound %lld ms)", r,
                              sh->done_ms[r] - sh->kill_ms, bound);
        }
        pids[victim] = h_spawn(replacement_worker, sh, (int)victim);
        bad = h_wait_all(pids, (int)R, 60000);
        for (uint32_t r = 0; r < R; r++)
                if (sh->msg[r][0])
                        fprintf(stderr, "%s\n", sh->msg[r]);
        ck_assert_msg(bad == 0, "%d worker(s) failed after the re-bind", bad);
        ck_assert_msg(h_daemon_log_contains(&sh->d, "group re-formed group=cx-peer-lost"),
                      "the daemon did not re-form the group");
        h_assert_daemon_alive(&sh->d, "after the kill");
        shared_free(sh);
}
END_TEST

/* ---- one process, ranks on several connections ---- */

static struct epd_group *enter_local(struct shared *sh, struct epd_client *cl, uint32_t rank)
{
        char msg[512];
        struct epd_group *g = enter(sh, cl, rank, msg, sizeof(msg));

        ck_assert_msg(g != NULL, "%s", msg);
        return g;
}

/* A peer that never launches: TIMEOUT after the group's op timeout, naming it. */
START_TEST(test_timeout)
{
        struct shared *sh = shared_new();
        struct epd_client *c0, *c1;
        struct epd_group *g0, *g1;
        struct worker w = { 0 };
        struct cx_case_data rd;
        struct epd_cx_dispatch_args a;
        char err[256];
        long long t0, dt;
        int rc;

        daemon_start(sh);
        ck_assert(case_at(0, 2, &sh->c));
        snprintf(sh->name, sizeof(sh->name), "cx-timeout");
        sh->op_timeout_ms = 300;
        c0 = h_connect_ok(&sh->d, "r0");
        c1 = h_connect_ok(&sh->d, "r1");
        g0 = enter_local(sh, c0, 0);
        g1 = enter_local(sh, c1, 1);
        w.b.size = sizeof(w.b);
        ck_assert_int_eq(epd_cx_buffers(g0, &w.b), 0);
        ck_assert_int_eq(cx_case_data_make(&sh->c, w.b.recv_rows, 1, &rd, err, sizeof(err)), 0);
        a = dispatch_args(&sh->c, &rd, 0, 0);
        t0 = h_now_ms();
        rc = epd_cx_dispatch(g0, &a, NULL);
        dt = h_now_ms() - t0;
        ck_assert_int_eq(rc, EPD_TIMEOUT);
        ck_assert_msg(dt >= 290 && dt < 5000, "TIMEOUT after %lld ms, op timeout 300", dt);
        ck_assert_msg(strstr(epd_client_last_error(c0), "waiting for rank 1"), "%s",
                      epd_client_last_error(c0));
        cx_case_data_free(&sh->c, &rd);
        epd_group_leave(g1);
        epd_group_leave(g0);
        epd_client_free(c1);
        epd_client_free(c0);
        shared_free(sh);
}
END_TEST

/* A capacity failure on one rank: CAPACITY_EXCEEDED everywhere, no byte of any receive area
 * written, and the failure sticks. */
static int capacity_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w;
        struct cx_case_data rd;
        struct epd_cx_dispatch_args a;
        uint64_t area;
        char err[256];
        int rc;

        if (worker_open(&w, sh, (uint32_t)index))
                return 1;
        if (cx_case_data_make(&sh->c, w.l.recv_rows, 9, &rd, err, sizeof(err)))
                return worker_fail(&w, "%s", err);
        area = (uint64_t)w.l.recv_rows * w.l.x_row_bytes;
        memset(w.b.recv_x, POISON, area);
        a = dispatch_args(&sh->c, &rd, w.me, 0);
        if (w.me == 1)
                a.capacity_rows = 1;
        rc = epd_cx_dispatch(w.g, &a, NULL);
        if (rc != EPD_CAPACITY_EXCEEDED ||
            !strstr(epd_client_last_error(w.cl), "rank 1 needs"))
                return worker_fail(&w, "rank %u: returned %d: %s", w.me, rc,
                                   epd_client_last_error(w.cl));
        for (uint64_t i = 0; i < area; i++)
                if (((const uint8_t *)w.b.recv_x)[i] != POISON)
                        return worker_fail(&w, "rank %u: byte %" PRIu64 " of recv_x written by a "
                                           "failed op", w.me, i);
        a.capacity_rows = 0;
        rc = epd_cx_dispatch(w.g, &a, NULL);
        if (rc != EPD_CAPACITY_EXCEEDED)
                return worker_fail(&w, "rank %u: the op after the failure returned %d", w.me, rc);
        cx_case_data_free(&sh->c, &rd);
        worker_close(&w);
        return 0;
}

START_TEST(test_capacity)
{
        struct shared *sh = shared_new();

        daemon_start(sh);
        ck_assert(case_at(1, 2, &sh->c));
        snprintf(sh->name, sizeof(sh->name), "cx-capacity");
        sh->op_timeout_ms = 20000;
        run_workers(sh, capacity_worker);
        shared_free(sh);
}
END_TEST

static int create_status(struct epd_client *cl, const char *name,
                         const struct epd_group_config *cfg, struct epd_group **g)
{
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = name, .secret = secret,
                                     .secret_len = sizeof(secret), .config = cfg };

        h_secret(name, secret);
        *g = NULL;
        return epd_group_create(cl, &ga, g);
}

/* A group with fewer receive rows than its shape's worst case: exactly the rows round 0 needs
 * (every rank's op is bitwise, then its combine), or one fewer (CAPACITY_EXCEEDED, naming the
 * short rank and the group's rows, and no row written). */
static int recv_rows_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w;
        struct cx_case_data rd;
        struct epd_cx_dispatch_args a;
        char err[256], want[64];
        uint64_t area;
        int rc;

        if (worker_open(&w, sh, (uint32_t)index))
                return 1;
        if (w.b.recv_rows != sh->recv_rows)
                return worker_fail(&w, "rank %u: %u receive rows, the group asked for %u", w.me,
                                   w.b.recv_rows, sh->recv_rows);
        if (!sh->short_rows) {
                rc = run_round(&w, 0);
                worker_close(&w);
                return rc;
        }
        if (cx_case_data_make(&sh->c, w.l.recv_rows, td_mix_seed(sh->seed, 0), &rd, err,
                              sizeof(err)))
                return worker_fail(&w, "%s", err);
        area = (uint64_t)w.l.recv_rows * w.l.x_row_bytes;
        memset(w.b.recv_x, POISON, area);
        a = dispatch_args(&sh->c, &rd, w.me, 0);
        rc = epd_cx_dispatch(w.g, &a, NULL);
        cx_case_data_free(&sh->c, &rd);
        snprintf(want, sizeof(want), "capacity %u", sh->recv_rows);
        if (rc != EPD_CAPACITY_EXCEEDED || !strstr(epd_client_last_error(w.cl), want))
                return worker_fail(&w, "rank %u: returned %d: %s (expected \"%s\")", w.me, rc,
                                   epd_client_last_error(w.cl), want);
        for (uint64_t i = 0; i < area; i++)
                if (((const uint8_t *)w.b.recv_x)[i] != POISON)
                        return worker_fail(&w, "rank %u: byte %" PRIu64 " of recv_x written by a "
                                           "failed op", w.me, i);
        worker_close(&w);
        return 0;
}

START_TEST(test_recv_rows)
{
        struct shared *sh = shared_new();
        struct epd_client *cl;
        struct epd_group_config cfg;
        struct epd_size_hint hint;
        struct epd_group *bad = NULL;
        struct cx_shape shape;
        struct cx_layout full, small;
        uint32_t need;

        daemon_start(sh);
        ck_assert(case_at(2, 2, &sh->c)); /* EXPAND, alignment 4, zero padding */
        sh->op_timeout_ms = 20000;
        sh->seed = td_mix_seed(0x5EEDull, 7);
        cx_case_shape(&sh->c, &shape);
        ck_assert_int_eq(cx_layout_compute(&shape, &full), CX_SHAPE_OK);
        need = cx_case_rows_needed(&sh->c, td_mix_seed(sh->seed, 0));
        ck_assert_uint_gt(need, 1);
        ck_assert_uint_lt(need, full.recv_rows);

        sh->recv_rows = need;
        snprintf(sh->name, sizeof(sh->name), "cx-recv-rows");
        run_workers(sh, recv_rows_worker);
        sh->recv_rows = need - 1;
        sh->short_rows = 1;
        snprintf(sh->name, sizeof(sh->name), "cx-recv-rows-short");
        run_workers(sh, recv_rows_worker);

        /* The size hint counts the smaller buffers; bounds are refused, naming them. */
        cl = h_connect_ok(&sh->d, "recv-rows");
        cx_case_shape(&sh->c, &shape);
        shape.recv_rows = sh->recv_rows;
        ck_assert_int_eq(cx_layout_compute(&shape, &small), CX_SHAPE_OK);
        ck_assert_uint_lt(small.total_bytes, full.total_bytes);
        cx_case_group_config(&sh->c, 0, &cfg);
        cfg.recv_rows = sh->recv_rows;
        ck_assert_int_eq(epd_size_hint(cl, &cfg, 1, &hint), 0);
        ck_assert_uint_eq(hint.client_buffer_bytes_per_rank, small.total_bytes);
        cfg.recv_rows = full.recv_rows + 1;
        ck_assert_int_eq(create_status(cl, "cx-rows-big", &cfg, &bad), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "recv_rows"), "%s",
                      epd_client_last_error(cl));
        cfg.execution = EPD_EXECUTION_DAEMON;
        cfg.max_expert_alignment = 0;
        cfg.recv_rows = 8;
        ck_assert_int_eq(create_status(cl, "cx-rows-daemon", &cfg, &bad), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "client-executed groups only"), "%s",
                      epd_client_last_error(cl));
        epd_client_free(cl);
        shared_free(sh);
}
END_TEST

/* Drain under load: the ranks run dispatch -> combine back to back; a drain stops every rank at
 * the same op number (ABORTED, nothing else), and after the undrain they go on from there. */
#define DRAIN_OPS 400u

static int drain_load_worker(void *arg, int index)
{
        struct shared *sh = arg;
        const struct cx_case *c = &sh->c;
        struct worker w;
        struct cx_case_data rd;
        struct epd_cx_dispatch_args a;
        struct epd_cx_status st = { .size = sizeof(st) };
        uint16_t *combined;
        float *cw;
        char err[256];
        int refused = 0;

        if (worker_open(&w, sh, (uint32_t)index))
                return 1;
        if (cx_case_data_make(c, w.l.recv_rows, 5, &rd, err, sizeof(err)))
                return worker_fail(&w, "%s", err);
        combined = malloc((size_t)c->T * c->H * 2 + 2);
        cw = malloc((size_t)c->T * c->K * 4 + 4);
        a = dispatch_args(c, &rd, w.me, 0);
        memcpy(w.b.y, rd.y[w.me], (size_t)w.l.recv_rows * c->H * 2);
        for (uint32_t i = 0; i < DRAIN_OPS; i++) {
                struct epd_cx_combine_args cb = {
                        .size = sizeof(cb), .handle = 0, .combined = combined,
                        .combined_topk_weights = cw,
                };
                int rc = i % 2 ? epd_cx_combine(w.g, &cb, NULL) : epd_cx_dispatch(w.g, &a, NULL);

                if (i == 40)
                        atomic_fetch_add(&sh->busy, 1);
                if (rc == EPD_ABORTED && !refused) {
                        if (epd_cx_status(w.g, &st))
                                return worker_fail(&w, "rank %u: no status", w.me);
                        sh->refused_at[w.me] = st.op + 1;
                        refused = 1;
                        atomic_fetch_add(&sh->refused, 1);
                        if (h_flag_wait(&sh->undrained, 1, 30000))
                                return worker_fail(&w, "rank %u: never undrained", w.me);
                        i--; /* the same op again */
                        continue;
                }
                if (rc)
                        return worker_fail(&w, "rank %u op %u: %d: %s", w.me, i, rc,
                                           epd_client_last_error(w.cl));
        }
        if (!refused)
                return worker_fail(&w, "rank %u: the drain never stopped it", w.me);
        if (epd_cx_status(w.g, &st) || st.op != DRAIN_OPS - 1)
                return worker_fail(&w, "rank %u: last op %llu, expected %u", w.me,
                                   (unsigned long long)st.op, DRAIN_OPS - 1);
        w.ops = DRAIN_OPS;
        if (run_round(&w, 0))
                return 1;
        cx_case_data_free(c, &rd);
        free(combined);
        free(cw);
        worker_close(&w);
        return 0;
}

START_TEST(test_drain_load)
{
        struct shared *sh = shared_new();
        pid_t pids[MAX_R];
        struct epd_client *admin;
        int bad;

        daemon_start(sh);
        ck_assert(case_at(0, 4, &sh->c));
        snprintf(sh->name, sizeof(sh->name), "cx-drain-load");
        sh->op_timeout_ms = 20000;
        sh->seed = 11;
        admin = h_connect_ok(&sh->d, "admin");
        for (uint32_t r = 0; r < sh->c.R; r++)
                pids[r] = h_spawn(drain_load_worker, sh, (int)r);
        ck_assert_msg(h_flag_wait(&sh->busy, (int)sh->c.R, 30000) == 0, "%s", sh->msg[0]);
        ck_assert_int_eq(epd_drain(admin, "cx-drain-load", NULL), 0);
        ck_assert_msg(h_flag_wait(&sh->refused, (int)sh->c.R, 30000) == 0,
                      "not every rank was stopped: %s | %s", sh->msg[0], sh->msg[1]);
        for (uint32_t r = 1; r < sh->c.R; r++)
                ck_assert_msg(sh->refused_at[r] == sh->refused_at[0],
                              "rank %u stopped at op %llu, rank 0 at %llu", r,
                              (unsigned long long)sh->refused_at[r],
                              (unsigned long long)sh->refused_at[0]);
        ck_assert_int_eq(epd_undrain(admin, "cx-drain-load", NULL), 0);
        atomic_store(&sh->undrained, 1);
        bad = h_wait_all(pids, (int)sh->c.R, 120000);
        for (uint32_t r = 0; r < sh->c.R; r++)
                if (sh->msg[r][0])
                        fprintf(stderr, "%s\n", sh->msg[r]);
        ck_assert_int_eq(bad, 0);
        epd_client_free(admin);
        shared_free(sh);
}
END_TEST

START_TEST(test_modes)
{
        struct shared *sh = shared_new();
        struct epd_client *cl;
        struct epd_group *gc, *gd, *bad;
        struct epd_group_config cfg;
        struct epd_cx_dispatch_args cxa = { .size = sizeof(cxa) };
        struct epd_dispatch_args da = { .size = sizeof(da) };
        struct epd_cx_buffers b = { .size = sizeof(b) };
        struct epd_size_hint hint;
        struct epd_group_list *list;
        struct epd_resize_result *rr = NULL;
        struct epd_op *op = NULL;
        int found = 0;

        daemon_start(sh);
        cl = h_connect_ok(&sh->d, "modes");
        ck_assert(case_at(0, 1, &sh->c));
        cx_case_group_config(&sh->c, 0, &cfg);
        ck_assert_int_eq(create_status(cl, "cx-client", &cfg, &gc), 0);
        ck_assert_ptr_eq(epd_group_arena(gc, NULL), NULL);
        ck_assert_int_eq(epd_group_config(gc)->execution, EPD_EXECUTION_CLIENT);

        /* A daemon-executed op on a client-executed group. */
        ck_assert_int_eq(epd_dispatch(gc, &da, &op), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "client-executed"), "%s",
                      epd_client_last_error(cl));
        epd_op_free(op);
        /* A stream on the host backend. */
        ck_assert_int_eq(epd_cx_dispatch(gc, &cxa, (void *)1), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "stream must be NULL"), "%s",
                      epd_client_last_error(cl));

        /* A client-executed op on a daemon-executed group. */
        cfg.execution = EPD_EXECUTION_DAEMON;
        cfg.max_expert_alignment = cfg.expert_block_rows = cfg.quantize = 0;
        ck_assert_int_eq(create_status(cl, "cx-daemon", &cfg, &gd), 0);
        ck_assert_int_eq(epd_cx_dispatch(gd, &cxa, NULL), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "daemon-executed"), "%s",
                      epd_client_last_error(cl));
        ck_assert_int_eq(epd_cx_buffers(gd, &b), EPD_INVALID_ARGUMENT);

        /* Shape options of client-executed groups on a daemon-executed one. */
        cfg.quantize = 1;
        ck_assert_int_eq(create_status(cl, "cx-bad1", &cfg, &bad), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "client-executed groups only"), "%s",
                      epd_client_last_error(cl));
        /* Quantizing needs H a multiple of 128 (H is 64 here). */
        cfg.execution = EPD_EXECUTION_CLIENT;
        ck_assert_int_eq(create_status(cl, "cx-bad2", &cfg, &bad), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "multiple of the scale block"), "%s",
                      epd_client_last_error(cl));
        cfg.quantize = 0;
        cfg.execution = (enum epd_execution)7;
        ck_assert_int_eq(create_status(cl, "cx-bad3", &cfg, &bad), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "neither daemon"), "%s",
                      epd_client_last_error(cl));
        cfg.execution = EPD_EXECUTION_CLIENT;
        cfg.max_tokens_per_rank = 32768; /* buffers far above max_arena_bytes */
        cfg.hidden = 1u << 20;
        ck_assert_int_eq(create_status(cl, "cx-bad5", &cfg, &bad), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(epd_client_last_error(cl), "max_arena_bytes"), "%s",
                      epd_client_last_error(cl));
        cfg.max_tokens_per_rank = sh->c.T;
        cfg.hidden = sh->c.H;
        cfg.num_handle_slots = 9;
        ck_assert_int_eq(create_status(cl, "cx-bad4", &cfg, &bad), EPD_INVALID_ARGUMENT);
        cfg.num_handle_slots = 0;

        /* The size hint, epctl groups' source and the buffer agree on the bytes per rank. */
        ck_assert_int_eq(epd_cx_buffers(gc, &b), 0);
        ck_assert_int_eq(epd_size_hint(cl, &cfg, 1, &hint), 0);
        ck_assert_uint_eq(hint.client_buffer_bytes_per_rank, b.bytes_per_rank);
        ck_assert_int_eq(epd_group_list_get(cl, &list), 0);
        for (size_t i = 0; i < epd_group_list_count(list); i++) {
                const struct epd_group_info *gi = epd_group_list_at(list, i);
                if (strcmp(gi->name, "cx-client") == 0) {
                        found = 1;
                        ck_assert_int_eq(gi->config.execution, EPD_EXECUTION_CLIENT);
                        ck_assert_uint_eq(gi->client_buffer_bytes_per_rank, b.bytes_per_rank);
                        ck_assert_uint_eq(gi->config.arena_bytes, 0);
                } else if (strcmp(gi->name, "cx-daemon") == 0) {
                        ck_assert_int_eq(gi->config.execution, EPD_EXECUTION_DAEMON);
                        ck_assert_uint_eq(gi->client_buffer_bytes_per_rank, 0);
                }
        }
        epd_group_list_free(list);
        ck_assert_int_eq(found, 1);
        /* epctl shows the same, and the stats of the group's rank. */
        json_t *groups = h_epctl_json(&sh->d, "groups"), *stats, *gj;
        size_t gi;
        found = 0;
        json_array_foreach(groups, gi, gj)
        {
                if (strcmp(json_string_value(json_object_get(gj, "name")), "cx-client") != 0)
                        continue;
                found = 1;
                ck_assert_str_eq(json_string_value(json_object_get(gj, "execution")), "client");
                ck_assert_uint_eq(json_integer_value(json_object_get(
                                          gj, "client_buffer_bytes_per_rank")),
                                  b.bytes_per_rank);
        }
        json_decref(groups);
        ck_assert_int_eq(found, 1);
        stats = h_epctl_json(&sh->d, "stats");
        json_array_foreach(json_object_get(stats, "groups"), gi, gj)
        {
                json_t *rank0 = json_array_get(json_object_get(gj, "ranks"), 0);
                int client = strcmp(json_string_value(json_object_get(gj, "name")),
                                    "cx-client") == 0;

                ck_assert_int_eq(json_object_get(rank0, "client") != NULL, client);
                if (client)
                        ck_assert_uint_eq(json_integer_value(json_object_get(
                                                  json_object_get(rank0, "client"),
                                                  "buffer_bytes")),
                                          b.bytes_per_rank);
        }
        ck_assert_uint_eq(json_array_size(json_object_get(stats, "groups")), 2);
        json_decref(stats);

        /* Resize of the buffers is refused, naming why. */
        ck_assert_int_eq(epd_resize(cl, "cx-client", 1 << 20, &rr), EPD_UNAVAILABLE);
        ck_assert_msg(strstr(epd_client_last_error(cl), "client-executed"), "%s",
                      epd_client_last_error(cl));
        epd_group_leave(gd);
        epd_group_leave(gc);
        epd_client_free(cl);
        shared_free(sh);
}
END_TEST

/* Drain: a launch fails fast with ABORTED and takes no op number; after the undrain the group
 * goes on from the same op. Statistics count the ops that ran. */
START_TEST(test_drain)
{
        struct shared *sh = shared_new();
        struct worker w;
        struct cx_case_data rd;
        struct epd_cx_dispatch_args a;
        struct epd_cx_status st = { .size = sizeof(st) };
        char err[256];
        long long t0;
        int found = 0;

        daemon_start(sh);
        ck_assert(case_at(0, 1, &sh->c));
        sh->c.rounds = 1;
        snprintf(sh->name, sizeof(sh->name), "cx-drain");
        sh->op_timeout_ms = 20000;
        sh->seed = 3;
        ck_assert_int_eq(worker_open(&w, sh, 0), 0);
        ck_assert_msg(run_round(&w, 0) == 0, "%s", sh->msg[0]);
        ck_assert_int_eq(epd_drain(w.cl, "cx-drain", NULL), 0);
        ck_assert_int_eq(cx_case_data_make(&sh->c, w.l.recv_rows, 4, &rd, err, sizeof(err)), 0);
        a = dispatch_args(&sh->c, &rd, 0, 0);
        t0 = h_now_ms();
        ck_assert_int_eq(epd_cx_dispatch(w.g, &a, NULL), EPD_ABORTED);
        ck_assert_int_lt(h_now_ms() - t0, 100);
        ck_assert_msg(strstr(epd_client_last_error(w.cl), "drained"), "%s",
                      epd_client_last_error(w.cl));
        ck_assert_int_eq(epd_cx_status(w.g, &st), 0);
        ck_assert_uint_eq(st.op, 1); /* the refused launch took no number */
        cx_case_data_free(&sh->c, &rd);
        ck_assert_int_eq(epd_undrain(w.cl, "cx-drain", NULL), 0);
        ck_assert_msg(run_round(&w, 1) == 0, "%s", sh->msg[0]);

        struct epd_stats *stats;
        ck_assert_int_eq(epd_stats_get(w.cl, &stats), 0);
        const struct epd_admin_daemon_stats *ds = epd_stats_daemon(stats);
        for (uint32_t i = 0; i < ds->num_groups; i++) {
                if (strcmp(ds->groups[i].name, "cx-drain") != 0)
                        continue;
                found = 1;
                ck_assert_uint_eq(ds->groups[i].ranks[0].client_ops, 4);
                ck_assert_uint_eq(ds->groups[i].ranks[0].client_failures, 0);
                ck_assert_uint_gt(ds->groups[i].ranks[0].client_rows, 0);
                ck_assert_uint_eq(ds->groups[i].ranks[0].client_buffer_bytes, w.b.bytes_per_rank);
                /* Two rounds of dispatch -> combine: two of each, with their phase times. */
                const struct epd_admin_rank_stats *rs = &ds->groups[i].ranks[0];
                ck_assert_uint_eq(rs->client_kind_ops[0], 2);
                ck_assert_uint_eq(rs->client_kind_ops[1], 2);
                for (int k = 0; k < 2; k++)
                        ck_assert_uint_gt(rs->client_phase_ns[k][0] + rs->client_phase_ns[k][1] +
                                                  rs->client_phase_ns[k][2],
                                          0);
        }
        epd_stats_free(stats);
        ck_assert_int_eq(found, 1);
        worker_close(&w);
        shared_free(sh);
}
END_TEST

static Suite *cx_suite(void)
{
        Suite *s = suite_create("integ_cx");
        TCase *tc = tcase_create("cx");

        tcase_set_timeout(tc, 600);
        tcase_add_test(tc, test_modes);
        tcase_add_test(tc, test_drain);
        tcase_add_test(tc, test_drain_load);
        tcase_add_test(tc, test_timeout);
        tcase_add_test(tc, test_capacity);
        tcase_add_test(tc, test_recv_rows);
        tcase_add_test(tc, test_peer_lost);
        tcase_add_test(tc, test_bitwise);
        tcase_add_test(tc, test_bitwise_registered);
        tcase_add_test(tc, test_older_args);
        tcase_add_test(tc, test_register_errors);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        return h_run_suite(cx_suite());
}
