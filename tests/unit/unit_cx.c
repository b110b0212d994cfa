/* unit_cx.c - client-executed ops on the CPU (cpu/cx.c) over the layout of common/cx_layout.h.
 *
 * R ranks run as threads of one process, each on its own buffer, every buffer visible to every
 * thread as the daemon's mappings would be. Every layout and dtype is compared bitwise with the
 * independent reference (tests/lib/reference.h); failures are checked to be collective and to
 * write nothing; waits are checked to end with PEER_LOST when the abort word is set and TIMEOUT
 * when a rank never arrives; and a long run of ops without any join in between checks that the
 * parity-double-buffered slots are reused correctly. Rank threads record their first failure and
 * the test's own thread asserts, so a failure names the rank, op and field.
 */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cx.h"
#include "cx_case.h"
#include "cx_layout.h"
#include "fp8.h"
#include "reference.h"
#include "testdata.h"

#define MAX_R 8u
#define POISON 0xA5u

/* ---- one group of R ranks in this process ---- */

struct group {
        struct cx_layout l;
        uint32_t R;
        uint8_t *bufs[MAX_R];
};

static void group_init(struct group *g, const struct cx_shape *shape)
{
        enum cx_shape_error e = cx_layout_compute(shape, &g->l);

        ck_assert_msg(e == CX_SHAPE_OK, "shape refused: %s", cx_shape_error_str(e));
        g->R = shape->world_size;
        for (uint32_t r = 0; r < g->R; r++) {
                g->bufs[r] = aligned_alloc(CX_ALIGN, g->l.total_bytes);
                ck_assert_ptr_nonnull(g->bufs[r]);
                memset(g->bufs[r], 0, g->l.metadata_bytes);
                memset(g->bufs[r] + g->l.metadata_bytes, POISON,
                       g->l.total_bytes - g->l.metadata_bytes);
                cx_buffer_init(g->bufs[r], &g->l, r, 7);
        }
}

static void group_free(struct group *g)
{
        for (uint32_t r = 0; r < g->R; r++)
                free(g->bufs[r]);
}

/* ---- a scenario: rounds of ops on every rank's thread ---- */

struct scenario {
        const struct cx_case *c;
        struct group g;
        struct cx_case_data *rounds;
        uint64_t timeout_ns;
};

struct rank_ctx {
        struct scenario *sc;
        uint32_t rank;
        char msg[512];
        int failed;
        uint64_t ops;
};

static int rank_fail(struct rank_ctx *rc, const char *fmt, ...)
        __attribute__((format(printf, 2, 3)));

static int rank_fail(struct rank_ctx *rc, const char *fmt, ...)
{
        va_list ap;

        if (rc->failed++)
                return 1;
        va_start(ap, fmt);
        vsnprintf(rc->msg, sizeof(rc->msg), fmt, ap);
        va_end(ap);
        return 1;
}

static int check_dispatch_out(struct rank_ctx *rc, const struct ref_dispatch *ref,
                              uint32_t handle, uint32_t round)
{
        uint8_t *own = rc->sc->g.bufs[rc->rank];
        char msg[400];

        if (cx_case_check_dispatch(rc->sc->c, &rc->sc->g.l, own, handle, own, ref, rc->rank, msg,
                                   sizeof(msg)))
                return rank_fail(rc, "%s round %u: dispatch: %s", rc->sc->c->name, round, msg);
        return 0;
}

static int run_combine(struct rank_ctx *rc, struct cx_case_data *rd,
                       const struct ref_dispatch *ref, uint32_t handle, uint32_t round)
{
        const struct cx_case *c = rc->sc->c;
        const struct cx_layout *l = &rc->sc->g.l;
        const uint32_t me = rc->rank, n = rd->n[me];
        uint8_t *own = rc->sc->g.bufs[me];
        struct cx_rank r = { l, me, rc->sc->g.bufs, rc->sc->timeout_ns };
        uint16_t *combined = malloc((size_t)n * c->H * 2 + 2);
        float *cw = malloc((size_t)n * c->K * 4 + 4);
        struct cx_combine_args a = {
                .handle = handle,
                .recv_weights = c->recv_weights,
                .apply_weights = c->apply_weights,
                .source_weights = c->source_weights ? rd->sw[me] : NULL,
                .bias = { c->nbias > 0 ? rd->bias[me][0] : NULL,
                          c->nbias > 1 ? rd->bias[me][1] : NULL },
                .combined = combined,
                .combined_topk_weights = cw,
        };
        char msg[400];
        int ret;

        /* The expert's output goes where its peers read it: this rank's y area. */
        memcpy(own + l->y, rd->y[me], (size_t)l->recv_rows * c->H * 2);
        if (c->recv_weights)
                memcpy(own + l->y_weights, rd->yw[me], (size_t)l->recv_rows * c->K * 4);
        ret = cx_combine(&r, &a, NULL, msg, sizeof(msg));
        if (ret)
                rank_fail(rc, "%s round %u: combine returned %d: %s", c->name, round, ret, msg);
        else if (cx_case_check_combine(c, rd, ref, me, combined, cw, msg, sizeof(msg)))
                rank_fail(rc, "%s round %u: combine: %s", c->name, round, msg);
        rc->ops++;
        free(combined);
        free(cw);
        return rc->failed;
}

static void *rank_main(void *arg)
{
        struct rank_ctx *rc = arg;
        struct scenario *sc = rc->sc;
        const struct cx_case *c = sc->c;
        const uint32_t me = rc->rank;
        struct cx_rank r = { &sc->g.l, me, sc->g.bufs, sc->timeout_ns };
        char msg[400];

        for (uint32_t i = 0; i < c->rounds && !rc->failed; i++) {
                struct cx_case_data *rd = &sc->rounds[i];
                uint32_t handle = i % sc->g.l.shape.num_handles;
                struct cx_dispatch_args a = {
                        .num_tokens = rd->n[me], .x = rd->x[me], .scales = rd->scales[me],
                        .topk_idx = rd->topk[me], .topk_dtype = c->topk_dtype,
                        .num_topk = c->K, .weights = c->has_weights ? rd->weights[me] : NULL,
                        .layout = c->layout, .expert_alignment = c->align,
                        .zero_padding = c->zero_padding, .expert_block_rows = c->block_rows,
                        .quantize = c->quantize, .round_scale = c->round_scale,
                        .scale_format = cx_case_scale_format(c), .handle = handle,
                };
                uint64_t op = 0;
                int ret = cx_dispatch(&r, &a, &op, msg, sizeof(msg));

                if (ret) {
                        rank_fail(rc, "%s round %u: dispatch returned %d: %s", c->name, i, ret,
                                  msg);
                        break;
                }
                if (op != rc->ops)
                        rank_fail(rc, "%s: op number %" PRIu64 ", expected %" PRIu64, c->name,
                                  op, rc->ops);
                rc->ops++;
                if (check_dispatch_out(rc, rd->ref, handle, i) ||
                    run_combine(rc, rd, rd->ref, handle, i))
                        break;
                if (!c->cached)
                        continue;
                a.cached = 1;
                a.topk_idx = NULL;
                a.weights = c->has_weights ? rd->weights2[me] : NULL;
                ret = cx_dispatch(&r, &a, &op, msg, sizeof(msg));
                if (ret) {
                        rank_fail(rc, "%s round %u: cached dispatch returned %d: %s", c->name, i,
                                  ret, msg);
                        break;
                }
                rc->ops++;
                if (check_dispatch_out(rc, rd->ref2, handle, i) ||
                    run_combine(rc, rd, rd->ref2, handle, i))
                        break;
        }
        return NULL;
}

static void run_scenario(const struct cx_case *c, uint64_t seed)
{
        struct scenario sc = { .c = c, .timeout_ns = 20000000000ull };
        struct cx_shape shape;
        struct rank_ctx rc[MAX_R];
        pthread_t th[MAX_R];
        char err[256];

        cx_case_shape(c, &shape);
        group_init(&sc.g, &shape);
        sc.rounds = calloc(c->rounds, sizeof(*sc.rounds));
        ck_assert_ptr_nonnull(sc.rounds);
        for (uint32_t i = 0; i < c->rounds; i++)
                ck_assert_msg(cx_case_data_make(c, sc.g.l.recv_rows, td_mix_seed(seed, i),
                                                &sc.rounds[i], err, sizeof(err)) == 0,
                              "%s: %s", c->name, err);
        for (uint32_t r = 0; r < c->R; r++) {
                memset(&rc[r], 0, sizeof(rc[r]));
                rc[r].sc = &sc;
                rc[r].rank = r;
                ck_assert_int_eq(pthread_create(&th[r], NULL, rank_main, &rc[r]), 0);
        }
        for (uint32_t r = 0; r < c->R; r++)
                pthread_join(th[r], NULL);
        for (uint32_t r = 0; r < c->R; r++) {
                struct cx_header *h = cx_header_of(sc.g.bufs[r], &sc.g.l);
                uint64_t expect_ops = (uint64_t)c->rounds * (c->cached ? 4 : 2);

                ck_assert_msg(!rc[r].failed, "rank %u (seed 0x%016" PRIx64 "): %s", r, seed,
                              rc[r].msg);
                ck_assert_uint_eq(h->op_counter, expect_ops);
                ck_assert_uint_eq(h->stats.ops, expect_ops);
                ck_assert_uint_eq(h->stats.failures, 0);
                /* The status ring holds the last op's end under its own tag. */
                ck_assert_uint_eq(h->status[(expect_ops - 1) % CX_STATUS_RING].tag,
                                  cx_tag(7, expect_ops - 1));
                ck_assert_int_eq(h->status[(expect_ops - 1) % CX_STATUS_RING].status, 0);
        }
        for (uint32_t i = 0; i < c->rounds; i++)
                cx_case_data_free(c, &sc.rounds[i]);
        free(sc.rounds);
        group_free(&sc.g);
}


START_TEST(test_bitwise)
{
        const struct cx_case *c = &cx_cases[_i];

        run_scenario(c, td_mix_seed(0xC0FFEEull, (uint64_t)_i));
}
END_TEST

/* 100 rounds of dispatch and combine (200 ops) with no join between them: ranks drift apart
 * by up to an op, so the parity slots, tags and acks are exercised as in production. */
START_TEST(test_many_ops)
{
        static const struct cx_case c = { "r3_many_ops", 3, 12, 64, 5, 3, BF16, 0, EX, 2, 1, 0,
                                          1, I64, 1, 1, 0, 0, 0, 100, 0, 0 };

        run_scenario(&c, 0x5107ull);
}
END_TEST

/* ---- failures ---- */

struct fail_ctx {
        struct group *g;
        uint32_t rank;
        struct cx_dispatch_args a;
        uint64_t timeout_ns;
        int ret;
        uint64_t op;
        uint64_t elapsed_ns;
        char msg[256];
};

static uint64_t mono_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *fail_main(void *arg)
{
        struct fail_ctx *f = arg;
        struct cx_rank r = { &f->g->l, f->rank, f->g->bufs, f->timeout_ns };
        uint64_t t0 = mono_ns();

        f->ret = cx_dispatch(&r, &f->a, &f->op, f->msg, sizeof(f->msg));
        f->elapsed_ns = mono_ns() - t0;
        return NULL;
}

/* A small group whose every token of every rank selects experts 0 and 1 (both on rank 0). */
struct fixture {
        struct group g;
        uint32_t R;
        struct fail_ctx f[MAX_R];
        uint16_t x[MAX_R][8 * 128];
        int32_t topk[MAX_R][8 * 2];
};

static void fixture_args(struct fixture *fx, enum epd_layout layout, uint32_t block_rows)
{
        for (uint32_t r = 0; r < fx->R; r++) {
                for (uint32_t i = 0; i < 8 * 128; i++)
                        fx->x[r][i] = (uint16_t)(0x3F80 + r + i);
                for (uint32_t t = 0; t < 8; t++) {
                        fx->topk[r][t * 2] = 0;
                        fx->topk[r][t * 2 + 1] = 1;
                }
                memset(&fx->f[r], 0, sizeof(fx->f[r]));
                fx->f[r].a = (struct cx_dispatch_args){
                        .num_tokens = 8, .x = fx->x[r], .topk_idx = fx->topk[r],
                        .topk_dtype = I32, .num_topk = 2, .layout = layout,
                        .expert_block_rows = block_rows, .zero_padding = 1,
                };
        }
}

static struct fixture *fixture_new_shape(uint32_t R, enum epd_layout layout,
                                         uint32_t block_rows, int quantize)
{
        struct fixture *fx = calloc(1, sizeof(*fx));
        struct cx_shape shape = { .world_size = R, .num_experts = 4 * R,
                                  .hidden = quantize ? 128 : 64, .max_tokens = 8, .max_topk = 2,
                                  .dtype = BF16, .quantize = (uint32_t)quantize,
                                  .expert_block_rows = block_rows };

        ck_assert_ptr_nonnull(fx);
        fx->R = R;
        group_init(&fx->g, &shape);
        fixture_args(fx, layout, block_rows);
        return fx;
}

static struct fixture *fixture_new(uint32_t R, enum epd_layout layout, uint32_t block_rows)
{
        return fixture_new_shape(R, layout, block_rows, 0);
}

static void fixture_free(struct fixture *fx)
{
        group_free(&fx->g);
        free(fx);
}

/* Runs one dispatch on the ranks in mask (others never arrive), all in parallel. */
static void fixture_run(struct fixture *fx, uint32_t mask, uint64_t timeout_ns)
{
        pthread_t th[MAX_R];

        for (uint32_t r = 0; r < fx->R; r++) {
                fx->f[r].g = &fx->g;
                fx->f[r].rank = r;
                fx->f[r].timeout_ns = timeout_ns;
                if (mask >> r & 1u)
                        ck_assert_int_eq(pthread_create(&th[r], NULL, fail_main, &fx->f[r]), 0);
        }
        for (uint32_t r = 0; r < fx->R; r++)
                if (mask >> r & 1u)
                        pthread_join(th[r], NULL);
}

/* Ranks 0 .. count-1 ended with status and a message containing text. */
static void fixture_expect(const struct fixture *fx, uint32_t count, int status, const char *text)
{
        for (uint32_t r = 0; r < count; r++) {
                ck_assert_msg(fx->f[r].ret == status, "rank %u: %d, expected %d: %s", r,
                              fx->f[r].ret, status, fx->f[r].msg);
                ck_assert_msg(strstr(fx->f[r].msg, text) != NULL, "rank %u: \"%s\" lacks \"%s\"",
                              r, fx->f[r].msg, text);
        }
}

static int receive_areas_untouched(const struct fixture *fx)
{
        for (uint32_t r = 0; r < fx->R; r++)
                for (uint64_t i = fx->g.l.metadata_bytes; i < fx->g.l.total_bytes; i++)
                        if (fx->g.bufs[r][i] != POISON)
                                return 0;
        return 1;
}

/* A fixed expert block too small for rank 0's expert 0: CAPACITY_EXCEEDED on every rank with the
 * same verdict, nothing written anywhere, later ops fail fast, and a re-formed group works. */
START_TEST(test_capacity_blocks)
{
        struct fixture *fx = fixture_new(3, EX, 16); /* expert 0 gets 3 * 8 = 24 > 16 */

        fixture_run(fx, 7u, 5000000000ull);
        fixture_expect(fx, 3, EPD_CAPACITY_EXCEEDED, "rank 0 local expert 0");
        ck_assert(receive_areas_untouched(fx));
        for (uint32_t r = 0; r < fx->R; r++) {
                struct cx_header *h = cx_header_of(fx->g.bufs[r], &fx->g.l);

                ck_assert_int_eq(h->status[0].status, EPD_CAPACITY_EXCEEDED);
                ck_assert_int_eq(h->status[0].rank, 0);
                ck_assert_int_eq(h->status[0].pos, 0);
                ck_assert_uint_eq(cx_handle_at(fx->g.bufs[r], &fx->g.l, 0)->tag, 0);
                ck_assert_uint_eq(h->stats.failures, 1);
        }
        /* Sticky: the next op fails at once with the same status, waiting for nobody. */
        fixture_run(fx, 2u, 5000000000ull);
        ck_assert_int_eq(fx->f[1].ret, EPD_CAPACITY_EXCEEDED);
        ck_assert_uint_lt(fx->f[1].elapsed_ns, 1000000000ull);
        ck_assert_uint_eq(fx->f[1].op, 1);
        /* Re-formed (a new epoch, op numbers from 0), the packed layout succeeds. */
        for (uint32_t r = 0; r < fx->R; r++)
                cx_buffer_reform(fx->g.bufs[r], &fx->g.l, 8);
        fixture_args(fx, EX, 0);
        fixture_run(fx, 7u, 5000000000ull);
        fixture_expect(fx, 3, 0, "");
        for (uint32_t r = 0; r < fx->R; r++)
                ck_assert_uint_eq(fx->f[r].op, 0);
        ck_assert_int_eq(cx_handle_at(fx->g.bufs[0], &fx->g.l, 0)->num_expanded_rows, 48);
        fixture_free(fx);
}
END_TEST

/* NON_EXPAND with one rank accepting fewer rows than it needs: the verdict names it, its need and
 * its capacity, on every rank, and no row moves. */
START_TEST(test_capacity_rows)
{
        struct fixture *fx = fixture_new(2, NE, 0);

        fx->f[0].a.capacity_rows = 15; /* rank 0 receives 16 tokens */
        fixture_run(fx, 3u, 5000000000ull);
        fixture_expect(fx, 2, EPD_CAPACITY_EXCEEDED, "rank 0 needs 16 rows, capacity 15");
        ck_assert(receive_areas_untouched(fx));
        fixture_free(fx);
}
END_TEST

/* An invalid expert on one rank, or ranks that disagree on the layout: INVALID_ARGUMENT on every
 * rank, naming the rank at fault. */
START_TEST(test_invalid_collective)
{
        struct fixture *fx = fixture_new(3, NE, 0);

        fx->topk[2][5] = 12; /* token 2 position 1 of rank 2: outside [0, E) */
        fixture_run(fx, 7u, 5000000000ull);
        fixture_expect(fx, 3, EPD_INVALID_ARGUMENT, "invalid argument on rank 2");
        fixture_expect(fx, 3, EPD_INVALID_ARGUMENT, "token 2");
        for (uint32_t r = 0; r < fx->R; r++)
                cx_buffer_reform(fx->g.bufs[r], &fx->g.l, 9);
        fixture_args(fx, NE, 0);
        fx->f[1].a.layout = EX;
        fixture_run(fx, 7u, 5000000000ull);
        fixture_expect(fx, 3, EPD_INVALID_ARGUMENT, "rank 1's op differs");
        fixture_free(fx);
}
END_TEST

/* 2.7's scale options on a quantizing group: UE8M0 without round_scale, either option without
 * quantize, or an unknown format on one rank is INVALID_ARGUMENT on every rank naming the field
 * and the rank, with nothing written; ranks that disagree on an option fail as a mismatch. */
START_TEST(test_scale_options_invalid)
{
        static const struct {
                int quantize, round_scale;
                uint32_t format;
                const char *text;
        } bad[] = {
                { 1, 0, EPD_SCALE_FORMAT_UE8M0, "scale_format UE8M0 needs round_scale" },
                { 0, 1, EPD_SCALE_FORMAT_FP32, "round_scale and scale_format need quantize" },
                { 0, 1, EPD_SCALE_FORMAT_UE8M0, "round_scale and scale_format need quantize" },
                { 1, 1, 7, "scale_format must be FP32 or UE8M0" },
        };

        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                struct fixture *fx = fixture_new_shape(2, NE, 0, 1);

                for (uint32_t r = 0; r < 2; r++) {
                        fx->f[r].a.quantize = bad[i].quantize;
                        fx->f[r].a.round_scale = bad[i].round_scale;
                        fx->f[r].a.scale_format = bad[i].format;
                }
                fixture_run(fx, 3u, 5000000000ull);
                fixture_expect(fx, 2, EPD_INVALID_ARGUMENT, "invalid argument on rank 0");
                fixture_expect(fx, 2, EPD_INVALID_ARGUMENT, bad[i].text);
                ck_assert(receive_areas_untouched(fx));
                fixture_free(fx);
        }
        {
                struct fixture *fx = fixture_new_shape(2, NE, 0, 1);

                for (uint32_t r = 0; r < 2; r++) {
                        fx->f[r].a.quantize = 1;
                        fx->f[r].a.round_scale = 1;
                }
                fx->f[1].a.scale_format = EPD_SCALE_FORMAT_UE8M0;
                fixture_run(fx, 3u, 5000000000ull);
                fixture_expect(fx, 2, EPD_INVALID_ARGUMENT, "rank 1's op differs");
                fixture_free(fx);
        }
        {
                /* The same options everywhere are accepted. */
                struct fixture *fx = fixture_new_shape(2, NE, 0, 1);

                for (uint32_t r = 0; r < 2; r++) {
                        fx->f[r].a.quantize = 1;
                        fx->f[r].a.round_scale = 1;
                        fx->f[r].a.scale_format = EPD_SCALE_FORMAT_UE8M0;
                }
                fixture_run(fx, 3u, 5000000000ull);
                fixture_expect(fx, 2, 0, "");
                fixture_free(fx);
        }
}
END_TEST

struct abort_ctx {
        struct group *g;
        uint64_t delay_ns;
};

static void *abort_main(void *arg)
{
        struct abort_ctx *a = arg;
        struct timespec ts = { (time_t)(a->delay_ns / 1000000000ull),
                               (long)(a->delay_ns % 1000000000ull) };

        nanosleep(&ts, NULL);
        for (uint32_t r = 0; r < a->g->R; r++)
                cx_buffer_abort(a->g->bufs[r], &a->g->l);
        return NULL;
}

/* Rank 1 never arrives; the daemon's abort word ends rank 0's wait with PEER_LOST long before its
 * 30 s timeout, and later ops fail fast. */
START_TEST(test_abort)
{
        struct fixture *fx = fixture_new(2, NE, 0);
        struct abort_ctx ac = { &fx->g, 50000000ull };
        pthread_t th;

        ck_assert_int_eq(pthread_create(&th, NULL, abort_main, &ac), 0);
        fixture_run(fx, 1u, 30000000000ull);
        pthread_join(th, NULL);
        fixture_expect(fx, 1, EPD_PEER_LOST, "peer lost");
        ck_assert_uint_ge(fx->f[0].elapsed_ns, 40000000ull);
        ck_assert_uint_lt(fx->f[0].elapsed_ns, 2000000000ull);
        fixture_run(fx, 1u, 30000000000ull);
        fixture_expect(fx, 1, EPD_PEER_LOST, "an earlier op of this group failed");
        ck_assert_uint_lt(fx->f[0].elapsed_ns, 100000000ull);
        fixture_free(fx);
}
END_TEST

/* Rank 2 never arrives: ranks 0 and 1 end with TIMEOUT after the op timeout, naming rank 2. */
START_TEST(test_timeout)
{
        struct fixture *fx = fixture_new(3, NE, 0);

        fixture_run(fx, 3u, 200000000ull);
        fixture_expect(fx, 2, EPD_TIMEOUT, "waiting for rank 2");
        for (uint32_t r = 0; r < 2; r++) {
                ck_assert_uint_ge(fx->f[r].elapsed_ns, 200000000ull);
                ck_assert_uint_lt(fx->f[r].elapsed_ns, 5000000000ull);
        }
        fixture_free(fx);
}
END_TEST

/* The drain word refuses ops at its boundary without consuming an op number. */
START_TEST(test_drain)
{
        struct fixture *fx = fixture_new(2, NE, 0);

        for (uint32_t r = 0; r < fx->R; r++)
                cx_header_of(fx->g.bufs[r], &fx->g.l)->drain_op = 1; /* stop before op 0 */
        fixture_run(fx, 3u, 5000000000ull);
        fixture_expect(fx, 2, EPD_ABORTED, "drained at op 0");
        for (uint32_t r = 0; r < fx->R; r++) {
                ck_assert_uint_eq(cx_header_of(fx->g.bufs[r], &fx->g.l)->op_counter, 0);
                cx_header_of(fx->g.bufs[r], &fx->g.l)->drain_op = 0;
        }
        fixture_run(fx, 3u, 5000000000ull);
        fixture_expect(fx, 2, 0, "");
        for (uint32_t r = 0; r < fx->R; r++)
                ck_assert_uint_eq(fx->f[r].op, 0);
        fixture_free(fx);
}
END_TEST

/* ---- layout ---- */

static void check_layout_parts(const struct cx_layout *l)
{
        const uint64_t parts[] = { l->header, l->count_recs, l->done, l->yrec, l->ack,
                                   l->handles, l->scratch, l->metadata_bytes, l->recv_x,
                                   l->recv_scales, l->recv_topk_idx, l->recv_weights,
                                   l->recv_src, l->recv_topk_slot, l->y, l->y_weights,
                                   l->total_bytes };

        for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
                ck_assert_uint_eq(parts[i] % CX_ALIGN, 0);
                if (i)
                        ck_assert_uint_le(parts[i - 1], parts[i]);
        }
        ck_assert_uint_ge(l->count_recs - l->header, sizeof(struct cx_header));
        ck_assert_uint_ge(l->count_rec_bytes, sizeof(struct cx_count_rec) +
                                                      4ull * (l->shape.world_size +
                                                              l->shape.num_experts));
        ck_assert_uint_ge(l->done - l->count_recs, 2ull * l->shape.world_size * l->count_rec_bytes);
        ck_assert_uint_ge(l->scratch - l->handles, l->shape.num_handles * l->handle_bytes);
        ck_assert_uint_ge(l->handle_bytes - l->h_weights,
                          4ull * l->shape.max_tokens * l->shape.max_topk);
        ck_assert_uint_le(l->metadata_bytes, CX_METADATA_MAX);
        ck_assert_uint_ge(l->recv_scales - l->recv_x, (uint64_t)l->recv_rows * l->x_row_bytes);
        ck_assert_uint_ge(l->total_bytes - l->y_weights, 4ull * l->recv_rows * l->shape.max_topk);
}

START_TEST(test_layout_sizes)
{
        struct cx_layout l;
        /* decode and prefill at the most ranks this mode takes, and the largest E. */
        struct cx_shape decode = { .world_size = 8, .num_experts = 256, .hidden = 7168,
                                   .max_tokens = 128, .max_topk = 8, .dtype = FP8 };
        struct cx_shape big = { .world_size = 64, .num_experts = 2048, .hidden = 7168,
                                .max_tokens = 4096, .max_topk = 8, .dtype = BF16,
                                .quantize = 1 };
        struct cx_shape blocks = { .world_size = 8, .num_experts = 64, .hidden = 4096,
                                   .max_tokens = 64, .max_topk = 8, .dtype = BF16,
                                   .max_alignment = 4, .expert_block_rows = 8 * 64 * 2 };

        ck_assert_int_eq(cx_layout_compute(&decode, &l), CX_SHAPE_OK);
        check_layout_parts(&l);
        ck_assert_uint_eq(l.recv_rows, 8 * 128 * 8);
        ck_assert_uint_eq(l.num_scales, 7168 / 128);
        ck_assert_uint_eq(l.shape.num_handles, CX_DEFAULT_HANDLES);
        ck_assert_int_eq(cx_layout_compute(&big, &l), CX_SHAPE_OK);
        check_layout_parts(&l);
        ck_assert_uint_eq(l.x_row_bytes, 7168 * 2);
        ck_assert_uint_eq(l.num_scales, 56);
        ck_assert_int_eq(cx_layout_compute(&blocks, &l), CX_SHAPE_OK);
        check_layout_parts(&l);
        ck_assert_uint_eq(l.recv_rows, 8 * 1024); /* L * C beats R * T * min(K, L) + L * 3 */

        /* A receive area below the worst case: the areas shrink with it, the metadata and
         * the worst case stay; its bounds are the worst case and L * C. */
        uint64_t full_bytes, full_meta;
        ck_assert_int_eq(cx_layout_compute(&decode, &l), CX_SHAPE_OK);
        full_bytes = l.total_bytes;
        full_meta = l.metadata_bytes;
        decode.recv_rows = 8 * 128; /* NON_EXPAND's worst case: R * T */
        ck_assert_int_eq(cx_layout_compute(&decode, &l), CX_SHAPE_OK);
        check_layout_parts(&l);
        ck_assert_uint_eq(l.recv_rows, 8 * 128);
        ck_assert_uint_eq(l.worst_rows, 8 * 128 * 8);
        ck_assert_uint_eq(l.metadata_bytes, full_meta);
        ck_assert_uint_eq(l.y - l.recv_x, cx_align(1024ull * 7168) + cx_align(1024ull * 4 * 56) +
                                                  cx_align(1024ull * 8 * 8) +
                                                  cx_align(1024ull * 4 * 8) +
                                                  cx_align(1024ull * 8) + cx_align(1024ull * 4));
        ck_assert_uint_lt(l.total_bytes, full_bytes / 6);
        decode.recv_rows = 8 * 128 * 8;
        ck_assert_int_eq(cx_layout_compute(&decode, &l), CX_SHAPE_OK);
        ck_assert_uint_eq(l.total_bytes, full_bytes);
        decode.recv_rows = 8 * 128 * 8 + 1;
        ck_assert_int_eq(cx_layout_compute(&decode, &l), CX_SHAPE_RECV_ROWS);
        decode.recv_rows = 0;
        blocks.recv_rows = 8 * 1024 - 1;
        ck_assert_int_eq(cx_layout_compute(&blocks, &l), CX_SHAPE_RECV_ROWS);
        ck_assert_str_ne(cx_shape_error_str(CX_SHAPE_RECV_ROWS), "unknown shape error");
        blocks.recv_rows = 0;

        /* Impossible shapes, each with its reason. */
        struct { struct cx_shape s; enum cx_shape_error e; } bad[] = {
                { { .world_size = 65, .num_experts = 65, .hidden = 64, .max_tokens = 1,
                    .max_topk = 1, .dtype = BF16 }, CX_SHAPE_RANKS },
                { { .world_size = 3, .num_experts = 8, .hidden = 64, .max_tokens = 1,
                    .max_topk = 1, .dtype = BF16 }, CX_SHAPE_EXPERTS },
                { { .world_size = 2, .num_experts = 8, .hidden = 64, .max_tokens = 1,
                    .max_topk = 33, .dtype = BF16 }, CX_SHAPE_TOPK },
                { { .world_size = 2, .num_experts = 8, .hidden = 64, .max_tokens = 0,
                    .max_topk = 1, .dtype = BF16 }, CX_SHAPE_TOKENS },
                { { .world_size = 2, .num_experts = 8, .hidden = 128, .max_tokens = 1,
                    .max_topk = 1, .dtype = FP8, .quantize = 1 }, CX_SHAPE_DTYPE },
                { { .world_size = 2, .num_experts = 8, .hidden = 192, .max_tokens = 1,
                    .max_topk = 1, .dtype = BF16, .quantize = 1 }, CX_SHAPE_SCALE_BLOCK },
                { { .world_size = 2, .num_experts = 8, .hidden = 12, .max_tokens = 1,
                    .max_topk = 1, .dtype = BF16 }, CX_SHAPE_ROW_BYTES },
                { { .world_size = 2, .num_experts = 8, .hidden = 64, .max_tokens = 1,
                    .max_topk = 1, .dtype = BF16, .max_alignment = 4,
                    .expert_block_rows = 6 }, CX_SHAPE_ALIGNMENT },
                { { .world_size = 2, .num_experts = 8, .hidden = 64, .max_tokens = 1,
                    .max_topk = 1, .dtype = BF16, .num_handles = 9 }, CX_SHAPE_HANDLES },
                { { .world_size = 64, .num_experts = 2048, .hidden = 64, .max_tokens = 8192,
                    .max_topk = 8, .dtype = BF16 }, CX_SHAPE_METADATA },
        };
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                enum cx_shape_error e = cx_layout_compute(&bad[i].s, &l);

                ck_assert_msg(e == bad[i].e, "case %zu: got %d (%s), expected %d", i, (int)e,
                              cx_shape_error_str(e), (int)bad[i].e);
                ck_assert_str_ne(cx_shape_error_str(e), "unknown shape error");
        }
        /* The largest T * K the 2 MiB bound admits at R = 64, E = 2048, found by doubling. */
        struct cx_shape probe = big;
        probe.max_tokens = 1;
        while (cx_layout_compute(&probe, &l) == CX_SHAPE_OK)
                probe.max_tokens *= 2;
        ck_assert_int_eq(cx_layout_compute(&probe, &l), CX_SHAPE_METADATA);
        ck_assert_uint_ge(probe.max_tokens, 8192); /* 4096 fits, as asserted above */
}
END_TEST

/* The shared e4m3 conversion against the reference's search over every e4m3 value. */
START_TEST(test_fp8_conversion)
{
        struct td_rng rng;
        const float specials[] = { 0.0f, -0.0f, 448.0f, 449.0f, 464.0f, -1e9f, 1.0f / 0.0f,
                                   0x1p-9f, 0x1p-10f, 0x3p-11f, 0x1.8p-9f, 0x1p-6f, 0x1.fp-7f,
                                   240.0f, 232.0f, 0.0f / 0.0f };

        for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); i++)
                ck_assert_uint_eq(epd_fp8_e4m3_from_float(specials[i]),
                                  ref_float_to_e4m3(specials[i]));
        td_rng_seed(&rng, 0xF8);
        for (uint32_t i = 0; i < 200000; i++) {
                uint32_t bits = (uint32_t)td_rng_next(&rng);
                float v;

                /* Mostly values in e4m3's range, some anywhere. */
                if (i % 4)
                        bits = (bits & 0x807FFFFFu) | ((110u + (bits >> 23) % 30u) << 23);
                memcpy(&v, &bits, 4);
                ck_assert_msg(epd_fp8_e4m3_from_float(v) == ref_float_to_e4m3(v),
                              "bits 0x%08x: got 0x%02x, expected 0x%02x", bits,
                              epd_fp8_e4m3_from_float(v), ref_float_to_e4m3(v));
        }
}
END_TEST

/* One block of 128 bf16 channels: v0 at channel 0, rest everywhere else. */
static void block_of(uint16_t *x, uint16_t v0, uint16_t rest)
{
        for (uint32_t c = 0; c < 128; c++)
                x[c] = c == 0 ? v0 : rest;
}

/* 2.7's round_scale and ue8m0 on hand-computed blocks. m = amax * 0x1.24924ap-9f is 1.0 for amax
 * 448 and 2.0 for 896 (powers of two: e = exponent), 0x1.24924ap-9 for amax 1 (mantissa bits set:
 * e = -9 + 1), 0x1.df595ap-23 for the floor 1e-4 (e = -22); NaN is ignored and an infinite amax
 * gives e = 128. */
START_TEST(test_round_scale_cases)
{
        static const struct {
                uint16_t v0, rest;   /* bf16 */
                int32_t e;           /* the exponent: scale 2^-e, recv_scales 2^e */
                uint8_t q0, q1;      /* e4m3 of channel 0 and of the others, round_scale */
                float plain;         /* recv_scales without round_scale */
                uint8_t plain_q1;
        } cases[] = {
                { 0x43E0, 0x43E0, 0, 0x7E, 0x7E, 1.0f, 0x7E },           /* all 448 */
                { 0x4460, 0x43E0, 1, 0x7E, 0x76, 2.0f, 0x76 },           /* 896; 448 / 2 = 224 */
                { 0x3F80, 0x3F80, -8, 0x78, 0x78, 0x1.24924ap-9f, 0x7E }, /* 1.0 * 2^8 = 256 */
                { 0x7FC0, 0x3F80, -8, 0x7F, 0x78, 0x1.24924ap-9f, 0x7E }, /* NaN ignored */
                { 0xBF80, 0x3F00, -8, 0xF8, 0x70, 0x1.24924ap-9f, 0x76 }, /* -1 and 0.5 */
                { 0x3580, 0x0000, -22, 0x48, 0x00, 0x1.df595ap-23f, 0x00 }, /* 2^-20: floor */
        };
        uint16_t x[128];
        uint8_t q[128];

        ck_assert_int_eq(epd_fp8_scale_exponent(448.0f), 0);
        ck_assert_int_eq(epd_fp8_scale_exponent(896.0f), 1);
        ck_assert_int_eq(epd_fp8_scale_exponent(1.0f), -8);
        ck_assert_int_eq(epd_fp8_scale_exponent(0.5f), -9);
        ck_assert_int_eq(epd_fp8_scale_exponent(1e-4f), -22);
        ck_assert_int_eq(epd_fp8_scale_exponent(57344.0f), 7);
        ck_assert_int_eq(epd_fp8_scale_exponent(1.0f / 0.0f), 128);
        ck_assert(epd_f32_pow2(-128) == 0x1p-128f && epd_f32_pow2(-126) == 0x1p-126f);
        ck_assert(epd_f32_pow2(127) == 0x1p127f && epd_f32_pow2(128) == 1.0f / 0.0f);
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                float s;

                block_of(x, cases[i].v0, cases[i].rest);
                s = epd_fp8_quantize_block(x, 128, q, 1);
                ck_assert_msg(s == ldexpf(1.0f, cases[i].e), "case %zu: recv %a, e %d", i,
                              (double)s, cases[i].e);
                ck_assert_uint_eq(epd_ue8m0_from_pow2(s), (uint32_t)(cases[i].e + 127));
                ck_assert_msg(q[0] == cases[i].q0 && q[1] == cases[i].q1,
                              "case %zu: q 0x%02x 0x%02x", i, q[0], q[1]);
                s = epd_fp8_quantize_block(x, 128, q, 0);
                ck_assert_msg(s == cases[i].plain, "case %zu: plain recv %a", i, (double)s);
                ck_assert_msg(q[1] == cases[i].plain_q1, "case %zu: plain q 0x%02x", i, q[1]);
        }
        /* +inf: e = 128, recv_scales +inf and byte 255; 1.0 * 2^-128 rounds to 0, inf saturates. */
        block_of(x, 0x7F80, 0x3F80);
        ck_assert(epd_fp8_quantize_block(x, 128, q, 1) == 1.0f / 0.0f);
        ck_assert_uint_eq(q[0], 0x7E);
        ck_assert_uint_eq(q[1], 0x00);
        ck_assert_uint_eq(epd_ue8m0_from_pow2(1.0f / 0.0f), 255);
}
END_TEST

/* The shared block quantization against the reference's, every option, on random rows with
 * specials (NaN, infinities, subnormals, huge values). */
START_TEST(test_quantize_block_reference)
{
        enum { H = 512, NB = H / 128 };
        struct td_rng rng;
        uint16_t x[H];
        uint8_t q[H], rq[H], rs[NB * 4];

        td_rng_seed(&rng, 0x2E8);
        for (uint32_t i = 0; i < 3000; i++) {
                int round_scale = (int)(i % 3 != 0), ue8m0 = (int)(i % 3 == 2);

                td_fill_bf16(&rng, x, 1, H, 0, i % 2 ? 0.02 : 0.0);
                if (i % 7 == 0)
                        for (uint32_t c = 0; c < H; c++)
                                x[c] = (uint16_t)(x[c] - (12u << 7)); /* amax near the floor */
                ref_quantize_row(x, H, round_scale, ue8m0, rq, rs);
                for (uint32_t b = 0; b < NB; b++) {
                        float s = epd_fp8_quantize_block(x + b * 128, 128, q + b * 128,
                                                         round_scale);

                        if (ue8m0) {
                                ck_assert_msg(epd_ue8m0_from_pow2(s) == rs[b],
                                              "row %u block %u: byte %u, expected %u", i, b,
                                              epd_ue8m0_from_pow2(s), rs[b]);
                        } else {
                                ck_assert_msg(memcmp(&s, rs + b * 4, 4) == 0,
                                              "row %u block %u: scale %a", i, b, (double)s);
                        }
                }
                ck_assert_msg(memcmp(q, rq, H) == 0, "row %u: fp8 bytes differ", i);
        }
}
END_TEST

static Suite *cx_suite(void)
{
        Suite *s = suite_create("cx");
        TCase *tc = tcase_create("bitwise");

        tcase_add_loop_test(tc, test_bitwise, 0, (int)cx_num_cases);
        tcase_add_test(tc, test_many_ops);
        tcase_set_timeout(tc, 300);
        suite_add_tcase(s, tc);

        tc = tcase_create("failures");
        tcase_add_test(tc, test_capacity_blocks);
        tcase_add_test(tc, test_capacity_rows);
        tcase_add_test(tc, test_invalid_collective);
        tcase_add_test(tc, test_scale_options_invalid);
        tcase_add_test(tc, test_abort);
        tcase_add_test(tc, test_timeout);
        tcase_add_test(tc, test_drain);
        tcase_set_timeout(tc, 120);
        suite_add_tcase(s, tc);

        tc = tcase_create("layout");
        tcase_add_test(tc, test_layout_sizes);
        tcase_add_test(tc, test_fp8_conversion);
        tcase_add_test(tc, test_round_scale_cases);
        tcase_add_test(tc, test_quantize_block_reference);
        tcase_set_timeout(tc, 120); /* 3,000 reference rows: seconds under the sanitizers */
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(cx_suite());
        int failed;

        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
