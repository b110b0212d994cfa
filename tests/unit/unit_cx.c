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
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cx.h"
#include "cx_layout.h"
#include "fp8.h"
#include "reference.h"
#include "testdata.h"

#define MAX_R 8u
#define POISON 0xA5u

#define BF16 EPD_DTYPE_BF16
#define FP8 EPD_DTYPE_FP8_E4M3
#define I32 EPD_DTYPE_INT32
#define I64 EPD_DTYPE_INT64
#define NE EPD_LAYOUT_NON_EXPAND
#define EX EPD_LAYOUT_EXPAND

struct cx_case {
        const char *name;
        uint32_t R, E, H, T, K;
        enum epd_dtype dtype;
        int quantize;
        enum epd_layout layout;
        uint32_t align;
        int zero_padding;
        uint32_t block_rows;       /* C of 2.6 */
        int has_weights;
        enum epd_dtype topk_dtype;
        int nbias;                 /* 0..2 */
        int apply_weights;         /* EXPAND */
        int source_weights;        /* combine's source_weights (apply_weights: w(t, k)) */
        int recv_weights;          /* NON_EXPAND: combine's recv_weights */
        int cached;                /* a cached dispatch and its combine follow each round */
        uint32_t rounds;           /* dispatch + combine (+ cached pair) per round */
};

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

/* ---- inputs of one round ---- */

struct round {
        uint32_t n[MAX_R];
        uint8_t *x[MAX_R];
        float *scales[MAX_R];
        uint8_t *topk[MAX_R];
        float *weights[MAX_R];
        float *weights2[MAX_R];    /* the cached dispatch's new weights */
        float *sw[MAX_R];          /* source_weights */
        uint16_t *bias[MAX_R][2];
        uint16_t *y[MAX_R];        /* [recv rows][H] per destination, NaN in padding */
        float *yw[MAX_R];          /* [rows][K] recv_weights per destination */
        struct ref_dispatch *ref, *ref2;
};

struct scenario {
        const struct cx_case *c;
        struct group g;
        struct round *rounds;
        uint64_t timeout_ns;
};

struct rank_ctx {
        struct scenario *sc;
        uint32_t rank;
        char msg[512];
        int failed;
        uint64_t ops;
};

static uint64_t x_row_bytes(const struct cx_case *c)
{
        return (uint64_t)c->H * (c->dtype == BF16 ? 2 : 1);
}

static uint32_t num_scales(const struct cx_case *c)
{
        return c->dtype == FP8 ? c->H / 64 : 0; /* fp8 cases use scale_block 64 */
}

static void fill_y(struct td_rng *rng, const struct cx_case *c, const struct ref_dispatch *ref,
                   uint32_t d, uint32_t rows_alloc, uint16_t *y, float *yw)
{
        td_fill_bf16(rng, y, rows_alloc, c->H, 0, 0.01);
        td_fill_f32(rng, yw, rows_alloc, c->K, 0, -2.0f, 2.0f);
        /* Padding rows hold NaN: a combine that read one would change its token. */
        for (int64_t i = 0; i < ref->dst[d].rows; i++)
                if (ref->dst[d].row_kind[i] != REF_ROW_DATA)
                        for (uint32_t h = 0; h < c->H; h++)
                                y[(size_t)i * c->H + h] = 0x7FC0;
}

static struct ref_dispatch *make_ref(const struct cx_case *c, struct round *rd, float **weights)
{
        struct ref_src src[MAX_R];
        struct ref_dispatch *ref = NULL;
        char err[256];
        struct ref_params p = {
                .world_size = c->R, .num_experts = c->E, .hidden = c->H, .max_tokens = c->T,
                .num_topk = c->K, .dtype = c->dtype, .scale_block = 64,
                .topk_dtype = c->topk_dtype, .layout = c->layout, .expert_alignment = c->align,
                .zero_padding = c->zero_padding, .has_weights = c->has_weights,
                .expert_block_rows = c->block_rows, .quantize = c->quantize,
        };

        for (uint32_t s = 0; s < c->R; s++)
                src[s] = (struct ref_src){
                        .num_tokens = rd->n[s],
                        .x = { rd->x[s], 0 },
                        .scales = { rd->scales[s], 0 },
                        .topk_idx = { rd->topk[s], 0 },
                        .weights = { c->has_weights ? weights[s] : NULL, 0 },
                };
        ck_assert_msg(ref_dispatch_new(&p, src, &ref, err, sizeof(err)) == 0, "%s: %s", c->name,
                      err);
        return ref;
}

static void round_make(struct scenario *sc, struct round *rd, uint64_t seed)
{
        const struct cx_case *c = sc->c;
        struct td_rng rng;
        size_t esz = c->topk_dtype == I64 ? 8 : 4;

        td_rng_seed(&rng, seed);
        for (uint32_t s = 0; s < c->R; s++) {
                uint32_t n = c->T - (s % 3 == 2 ? c->T : s % 3); /* T, T - 1, 0, T, ... */
                struct td_routing_args ra = {
                        .world_size = c->R, .num_experts = c->E, .num_tokens = n,
                        .num_topk = c->K, .mode = s % 2 ? TD_ROUTING_SKEWED : TD_ROUTING_UNIFORM,
                        .hot_rank = c->R - 1, .minus_one_prob = 0.1, .empty_row_prob = 0.05,
                        .dtype = c->topk_dtype,
                };

                if (c->R == 1)
                        n = ra.num_tokens = c->T;
                rd->n[s] = n;
                rd->x[s] = malloc((size_t)n * x_row_bytes(c) + 1);
                rd->scales[s] = malloc((size_t)n * num_scales(c) * 4 + 1);
                rd->topk[s] = malloc((size_t)n * c->K * esz + 1);
                rd->weights[s] = malloc((size_t)n * c->K * 4 + 1);
                rd->weights2[s] = malloc((size_t)n * c->K * 4 + 1);
                rd->sw[s] = malloc((size_t)n * c->K * 4 + 1);
                for (int b = 0; b < 2; b++)
                        rd->bias[s][b] = malloc((size_t)n * c->H * 2 + 1);
                if (c->dtype == BF16)
                        td_fill_bf16(&rng, rd->x[s], n, c->H, 0, 0.01);
                else
                        td_fill_bytes(&rng, rd->x[s], n, c->H, 0);
                td_fill_f32(&rng, rd->scales[s], n, num_scales(c), 0, 0.01f, 4.0f);
                td_gen_topk(&rng, &ra, rd->topk[s]);
                td_fill_f32(&rng, rd->weights[s], n, c->K, 0, -1.0f, 1.0f);
                td_fill_f32(&rng, rd->weights2[s], n, c->K, 0, -1.0f, 1.0f);
                td_fill_f32(&rng, rd->sw[s], n, c->K, 0, -1.0f, 1.0f);
                for (int b = 0; b < 2; b++)
                        td_fill_bf16(&rng, rd->bias[s][b], n, c->H, 0, 0.0);
        }
        rd->ref = make_ref(c, rd, rd->weights);
        rd->ref2 = c->cached ? make_ref(c, rd, rd->weights2) : NULL;
        for (uint32_t d = 0; d < c->R; d++) {
                uint32_t rows = sc->g.l.recv_rows;

                rd->y[d] = malloc((size_t)rows * c->H * 2);
                rd->yw[d] = malloc((size_t)rows * c->K * 4);
                fill_y(&rng, c, rd->ref, d, rows, rd->y[d], rd->yw[d]);
        }
}

static void round_free(const struct cx_case *c, struct round *rd)
{
        for (uint32_t s = 0; s < c->R; s++) {
                free(rd->x[s]);
                free(rd->scales[s]);
                free(rd->topk[s]);
                free(rd->weights[s]);
                free(rd->weights2[s]);
                free(rd->sw[s]);
                free(rd->bias[s][0]);
                free(rd->bias[s][1]);
                free(rd->y[s]);
                free(rd->yw[s]);
        }
        ref_dispatch_free(rd->ref);
        ref_dispatch_free(rd->ref2);
}

/* ---- what one rank thread does ---- */

static int rank_fail(struct rank_ctx *rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

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
        const struct cx_case *c = rc->sc->c;
        const struct cx_layout *l = &rc->sc->g.l;
        uint8_t *own = rc->sc->g.bufs[rc->rank];
        const struct cx_handle *h = cx_handle_at(own, l, handle);
        size_t esz = c->topk_dtype == I64 ? 8 : 4;
        int expand = c->layout == EX;
        char msg[400];
        struct ref_counts_actual counts = {
                .num_recv_tokens = h->num_recv_tokens,
                .num_expanded_rows = h->num_expanded_rows,
                .per_expert = cx_handle_i32(own, l, handle, l->h_per_expert),
                .per_expert_aligned = cx_handle_i32(own, l, handle, l->h_per_expert_aligned),
                .rank_prefix = cx_handle_i32(own, l, handle, l->h_rank_prefix),
        };
        struct ref_dispatch_actual act = {
                .recv_x = { own + l->recv_x, 0 },
                .recv_scales = { own + l->recv_scales, 0 },
                .recv_topk_idx = { own + l->recv_topk_idx, c->K * esz },
                .recv_weights = { own + l->recv_weights, expand ? 4 : (uint64_t)c->K * 4 },
                .recv_src = { own + l->recv_src, 8 },
                .recv_topk_slot = { own + l->recv_topk_slot, 4 },
        };

        if (ref_check_counts(ref, rc->rank, &counts, msg, sizeof(msg)))
                return rank_fail(rc, "%s round %u: counts: %s", c->name, round, msg);
        if (ref_check_dispatch(ref, rc->rank, &act, msg, sizeof(msg)))
                return rank_fail(rc, "%s round %u: dispatch: %s", c->name, round, msg);
        return 0;
}

static int run_combine(struct rank_ctx *rc, struct round *rd, const struct ref_dispatch *ref,
                       uint32_t handle, uint32_t round)
{
        const struct cx_case *c = rc->sc->c;
        const struct cx_layout *l = &rc->sc->g.l;
        const uint32_t me = rc->rank, n = rd->n[me];
        uint8_t *own = rc->sc->g.bufs[me];
        struct cx_rank r = { l, me, rc->sc->g.bufs, rc->sc->timeout_ns };
        uint16_t *combined = malloc((size_t)n * c->H * 2 + 2);
        float *cw = malloc((size_t)n * c->K * 4 + 4);
        struct ref_buf ybufs[MAX_R], swbufs[MAX_R], rwbufs[MAX_R], bias[2];
        struct ref_combine_in cin = { .y = ybufs, .apply_weights = c->apply_weights };
        struct ref_combine_weights w = {
                .source_weights = c->source_weights ? swbufs : NULL,
                .recv_weights = c->recv_weights ? rwbufs : NULL,
        };
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

        for (uint32_t d = 0; d < c->R; d++) {
                ybufs[d] = (struct ref_buf){ rd->y[d], 0 };
                swbufs[d] = (struct ref_buf){ rd->sw[d], 0 };
                rwbufs[d] = (struct ref_buf){ rd->yw[d], 0 };
        }
        for (int b = 0; b < 2; b++)
                bias[b] = (struct ref_buf){ b < c->nbias ? rd->bias[me][b] : NULL, 0 };
        /* The expert's output goes where its peers read it: this rank's y area. */
        memcpy(own + l->y, rd->y[me], (size_t)l->recv_rows * c->H * 2);
        if (c->recv_weights)
                for (uint32_t i = 0; i < l->recv_rows; i++)
                        memcpy(own + l->y_weights + (size_t)i * c->K * 4,
                               rd->yw[me] + (size_t)i * c->K, (size_t)c->K * 4);
        ret = cx_combine(&r, &a, NULL, msg, sizeof(msg));
        if (ret)
                rank_fail(rc, "%s round %u: combine returned %d: %s", c->name, round, ret, msg);
        else if (ref_check_combine_w(ref, &cin, &w, me, bias, (struct ref_buf){ combined, 0 },
                                     (struct ref_buf){ (c->has_weights || c->recv_weights) ? cw
                                                                                         : NULL,
                                                       0 },
                                     msg, sizeof(msg)))
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
                struct round *rd = &sc->rounds[i];
                uint32_t handle = i % sc->g.l.shape.num_handles;
                struct cx_dispatch_args a = {
                        .num_tokens = rd->n[me], .x = rd->x[me], .scales = rd->scales[me],
                        .topk_idx = rd->topk[me], .topk_dtype = c->topk_dtype,
                        .num_topk = c->K, .weights = c->has_weights ? rd->weights[me] : NULL,
                        .layout = c->layout, .expert_alignment = c->align,
                        .zero_padding = c->zero_padding, .expert_block_rows = c->block_rows,
                        .quantize = c->quantize, .handle = handle,
                };
                uint64_t op = 0;
                int ret = cx_dispatch(&r, &a, &op, msg, sizeof(msg));

                if (ret) {
                        rank_fail(rc, "%s round %u: dispatch returned %d: %s", c->name, i, ret, msg);
                        break;
                }
                if (op != rc->ops)
                        rank_fail(rc, "%s: op number %" PRIu64 ", expected %" PRIu64, c->name, op,
                             rc->ops);
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
                        rank_fail(rc, "%s round %u: cached dispatch returned %d: %s", c->name, i, ret,
                             msg);
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
        struct cx_shape shape = {
                .world_size = c->R, .num_experts = c->E, .hidden = c->H, .max_tokens = c->T,
                .max_topk = c->K, .dtype = c->dtype, .scale_block = 64, .quantize = c->quantize,
                .max_alignment = c->align, .expert_block_rows = c->block_rows,
        };
        struct rank_ctx rc[MAX_R];
        pthread_t th[MAX_R];

        group_init(&sc.g, &shape);
        sc.rounds = calloc(c->rounds, sizeof(*sc.rounds));
        ck_assert_ptr_nonnull(sc.rounds);
        for (uint32_t i = 0; i < c->rounds; i++)
                round_make(&sc, &sc.rounds[i], td_mix_seed(seed, i));
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
                round_free(c, &sc.rounds[i]);
        free(sc.rounds);
        group_free(&sc.g);
}

static const struct cx_case cases[] = {
        /* name R E H T K dtype q layout align zp C w topk bias aw sw rw cached rounds */
        { "r1_ne_bf16", 1, 8, 64, 12, 2, BF16, 0, NE, 1, 0, 0, 1, I64, 1, 0, 0, 0, 0, 1 },
        { "r2_ne_bf16_recvw", 2, 16, 64, 20, 4, BF16, 0, NE, 1, 0, 0, 1, I32, 2, 0, 0, 1, 1, 2 },
        { "r3_ex_bf16_a4_zp", 3, 24, 128, 17, 4, BF16, 0, EX, 4, 1, 0, 1, I64, 1, 1, 0, 0, 1, 2 },
        { "r3_ex_fp8_nozp", 3, 24, 128, 17, 3, FP8, 0, EX, 2, 0, 0, 1, I32, 0, 1, 1, 0, 0, 2 },
        { "r8_ne_fp8", 8, 32, 64, 9, 4, FP8, 0, NE, 1, 0, 0, 1, I64, 2, 0, 0, 0, 1, 2 },
        { "r8_ex_bf16_a2", 8, 64, 64, 7, 6, BF16, 0, EX, 2, 1, 0, 1, I32, 1, 1, 1, 0, 0, 2 },
        { "r2_ex_blocks", 2, 8, 64, 10, 3, BF16, 0, EX, 2, 1, 16, 1, I64, 1, 1, 0, 0, 1, 2 },
        { "r8_ex_blocks_nozp", 8, 16, 64, 5, 2, BF16, 0, EX, 1, 0, 20, 0, I32, 0, 1, 1, 0, 0, 2 },
        { "r1_ne_quant", 1, 4, 256, 6, 2, BF16, 1, NE, 1, 0, 0, 1, I64, 1, 0, 0, 1, 0, 1 },
        { "r3_ne_quant", 3, 12, 256, 9, 3, BF16, 1, NE, 1, 0, 0, 0, I32, 1, 0, 0, 0, 1, 2 },
        { "r8_ex_quant_blocks", 8, 16, 128, 6, 2, BF16, 1, EX, 2, 1, 24, 1, I64, 2, 1, 0, 0, 1, 1 },
        { "r2_ex_nowt_sw", 2, 8, 64, 8, 2, BF16, 0, EX, 1, 1, 0, 0, I32, 0, 1, 1, 0, 0, 2 },
};

START_TEST(test_bitwise)
{
        const struct cx_case *c = &cases[_i];

        run_scenario(c, td_mix_seed(0xC0FFEEull, (uint64_t)_i));
}
END_TEST

/* 100 rounds of dispatch and combine (200 ops) with no join between them: ranks drift apart
 * by up to an op, so the parity slots, tags and acks are exercised as in production. */
START_TEST(test_many_ops)
{
        static const struct cx_case c = { "r3_many_ops", 3, 12, 64, 5, 3, BF16, 0, EX, 2, 1, 0,
                                          1, I64, 1, 1, 0, 0, 0, 100 };

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

/* Runs one dispatch on the ranks in mask (others never arrive), all in parallel. */
static void run_ranks(struct group *g, struct fail_ctx *f, uint32_t mask, uint64_t timeout_ns)
{
        pthread_t th[MAX_R];

        for (uint32_t r = 0; r < g->R; r++) {
                f[r].g = g;
                f[r].rank = r;
                f[r].timeout_ns = timeout_ns;
                if (mask >> r & 1u)
                        ck_assert_int_eq(pthread_create(&th[r], NULL, fail_main, &f[r]), 0);
        }
        for (uint32_t r = 0; r < g->R; r++)
                if (mask >> r & 1u)
                        pthread_join(th[r], NULL);
}

struct fixed_input {
        uint16_t x[MAX_R][8 * 64];
        int32_t topk[MAX_R][8 * 2];
};

/* Every token of every rank selects experts 0 and 1 (both on rank 0). */
static void fixed_args(struct fixed_input *in, struct fail_ctx *f, uint32_t R,
                       enum epd_layout layout, uint32_t block_rows)
{
        for (uint32_t r = 0; r < R; r++) {
                for (uint32_t i = 0; i < 8 * 64; i++)
                        in->x[r][i] = (uint16_t)(0x3F80 + r + i);
                for (uint32_t t = 0; t < 8; t++) {
                        in->topk[r][t * 2] = 0;
                        in->topk[r][t * 2 + 1] = 1;
                }
                memset(&f[r], 0, sizeof(f[r]));
                f[r].a = (struct cx_dispatch_args){
                        .num_tokens = 8, .x = in->x[r], .topk_idx = in->topk[r],
                        .topk_dtype = I32, .num_topk = 2, .layout = layout,
                        .expert_block_rows = block_rows, .zero_padding = 1,
                };
        }
}

static void small_group(struct group *g, uint32_t R, uint32_t block_rows)
{
        struct cx_shape shape = { .world_size = R, .num_experts = 4 * R, .hidden = 64,
                                  .max_tokens = 8, .max_topk = 2, .dtype = BF16,
                                  .expert_block_rows = block_rows };

        group_init(g, &shape);
}

static int region_is_poison(const uint8_t *p, uint64_t n)
{
        for (uint64_t i = 0; i < n; i++)
                if (p[i] != POISON)
                        return 0;
        return 1;
}

/* A fixed expert block too small for rank 0's expert 0: CAPACITY_EXCEEDED on every rank with the
 * same verdict, nothing written anywhere, later ops fail fast, and a re-formed group works. */
START_TEST(test_capacity_blocks)
{
        const uint32_t R = 3;
        struct group g;
        struct fail_ctx f[MAX_R];
        struct fixed_input *in = calloc(1, sizeof(*in));

        small_group(&g, R, 16);
        fixed_args(in, f, R, EX, 16);  /* expert 0 gets 3 * 8 = 24 selections > 16 */
        run_ranks(&g, f, (1u << R) - 1, 5000000000ull);
        for (uint32_t r = 0; r < R; r++) {
                struct cx_header *h = cx_header_of(g.bufs[r], &g.l);

                ck_assert_msg(f[r].ret == EPD_CAPACITY_EXCEEDED, "rank %u: %d %s", r, f[r].ret,
                              f[r].msg);
                ck_assert_msg(strstr(f[r].msg, "rank 0 local expert 0") != NULL, "%s", f[r].msg);
                ck_assert_int_eq(h->status[0].status, EPD_CAPACITY_EXCEEDED);
                ck_assert_int_eq(h->status[0].rank, 0);
                ck_assert_int_eq(h->status[0].pos, 0);
                ck_assert(region_is_poison(g.bufs[r] + g.l.metadata_bytes,
                                           g.l.total_bytes - g.l.metadata_bytes));
                ck_assert_uint_eq(cx_handle_at(g.bufs[r], &g.l, 0)->tag, 0);
                ck_assert_uint_eq(h->stats.failures, 1);
        }
        /* Sticky: the next op fails at once with the same status, waiting for nobody. */
        run_ranks(&g, f, 1u << 1, 5000000000ull);
        ck_assert_int_eq(f[1].ret, EPD_CAPACITY_EXCEEDED);
        ck_assert_uint_lt(f[1].elapsed_ns, 1000000000ull);
        ck_assert_uint_eq(f[1].op, 1);
        /* Re-formed (a new epoch, op numbers from 0), the packed layout succeeds. */
        for (uint32_t r = 0; r < R; r++) {
                cx_buffer_reform(g.bufs[r], &g.l, 8);
                f[r].a.expert_block_rows = 0;
        }
        run_ranks(&g, f, (1u << R) - 1, 5000000000ull);
        for (uint32_t r = 0; r < R; r++) {
                ck_assert_msg(f[r].ret == 0, "rank %u: %d %s", r, f[r].ret, f[r].msg);
                ck_assert_uint_eq(f[r].op, 0);
        }
        ck_assert_int_eq(cx_handle_at(g.bufs[0], &g.l, 0)->num_expanded_rows, 48);
        group_free(&g);
        free(in);
}
END_TEST

/* NON_EXPAND with one rank accepting fewer rows than it needs: the verdict names it, its need and
 * its capacity, on every rank, and no row moves. */
START_TEST(test_capacity_rows)
{
        const uint32_t R = 2;
        struct group g;
        struct fail_ctx f[MAX_R];
        struct fixed_input *in = calloc(1, sizeof(*in));

        small_group(&g, R, 0);
        fixed_args(in, f, R, NE, 0);
        f[0].a.capacity_rows = 15; /* rank 0 receives 16 tokens */
        run_ranks(&g, f, (1u << R) - 1, 5000000000ull);
        for (uint32_t r = 0; r < R; r++) {
                ck_assert_int_eq(f[r].ret, EPD_CAPACITY_EXCEEDED);
                ck_assert_msg(strstr(f[r].msg, "rank 0 needs 16 rows, capacity 15") != NULL, "%s",
                              f[r].msg);
                ck_assert(region_is_poison(g.bufs[r] + g.l.metadata_bytes,
                                           g.l.total_bytes - g.l.metadata_bytes));
        }
        group_free(&g);
        free(in);
}
END_TEST

/* An invalid expert on one rank, or ranks that disagree on the layout: INVALID_ARGUMENT on every
 * rank, naming the rank at fault. */
START_TEST(test_invalid_collective)
{
        const uint32_t R = 3;
        struct group g;
        struct fail_ctx f[MAX_R];
        struct fixed_input *in = calloc(1, sizeof(*in));

        small_group(&g, R, 0);
        fixed_args(in, f, R, NE, 0);
        in->topk[2][5] = 4 * (int32_t)R; /* token 2 position 1 of rank 2: outside [0, E) */
        run_ranks(&g, f, (1u << R) - 1, 5000000000ull);
        for (uint32_t r = 0; r < R; r++) {
                ck_assert_int_eq(f[r].ret, EPD_INVALID_ARGUMENT);
                ck_assert_msg(strstr(f[r].msg, "invalid argument on rank 2") != NULL &&
                                      strstr(f[r].msg, "token 2") != NULL,
                              "%s", f[r].msg);
        }
        for (uint32_t r = 0; r < R; r++)
                cx_buffer_reform(g.bufs[r], &g.l, 9);
        fixed_args(in, f, R, NE, 0);
        f[1].a.layout = EX;
        run_ranks(&g, f, (1u << R) - 1, 5000000000ull);
        for (uint32_t r = 0; r < R; r++) {
                ck_assert_int_eq(f[r].ret, EPD_INVALID_ARGUMENT);
                ck_assert_msg(strstr(f[r].msg, "rank 1's op differs") != NULL, "%s", f[r].msg);
        }
        group_free(&g);
        free(in);
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
        const uint32_t R = 2;
        struct group g;
        struct fail_ctx f[MAX_R];
        struct fixed_input *in = calloc(1, sizeof(*in));
        struct abort_ctx ac = { &g, 50000000ull };
        pthread_t th;

        small_group(&g, R, 0);
        fixed_args(in, f, R, NE, 0);
        ck_assert_int_eq(pthread_create(&th, NULL, abort_main, &ac), 0);
        run_ranks(&g, f, 1u, 30000000000ull);
        pthread_join(th, NULL);
        ck_assert_msg(f[0].ret == EPD_PEER_LOST, "%d %s", f[0].ret, f[0].msg);
        ck_assert_uint_ge(f[0].elapsed_ns, 40000000ull);
        ck_assert_uint_lt(f[0].elapsed_ns, 2000000000ull);
        run_ranks(&g, f, 1u, 30000000000ull);
        ck_assert_int_eq(f[0].ret, EPD_PEER_LOST);
        ck_assert_uint_lt(f[0].elapsed_ns, 100000000ull);
        group_free(&g);
        free(in);
}
END_TEST

/* Rank 2 never arrives: ranks 0 and 1 end with TIMEOUT after the op timeout, naming rank 2. */
START_TEST(test_timeout)
{
        const uint32_t R = 3;
        struct group g;
        struct fail_ctx f[MAX_R];
        struct fixed_input *in = calloc(1, sizeof(*in));

        small_group(&g, R, 0);
        fixed_args(in, f, R, NE, 0);
        run_ranks(&g, f, 3u, 200000000ull);
        for (uint32_t r = 0; r < 2; r++) {
                ck_assert_msg(f[r].ret == EPD_TIMEOUT, "%d %s", f[r].ret, f[r].msg);
                ck_assert_msg(strstr(f[r].msg, "waiting for rank 2") != NULL, "%s", f[r].msg);
                ck_assert_uint_ge(f[r].elapsed_ns, 200000000ull);
                ck_assert_uint_lt(f[r].elapsed_ns, 5000000000ull);
        }
        group_free(&g);
        free(in);
}
END_TEST

/* The drain word refuses ops at its boundary without consuming an op number. */
START_TEST(test_drain)
{
        const uint32_t R = 2;
        struct group g;
        struct fail_ctx f[MAX_R];
        struct fixed_input *in = calloc(1, sizeof(*in));

        small_group(&g, R, 0);
        fixed_args(in, f, R, NE, 0);
        for (uint32_t r = 0; r < R; r++)
                cx_header_of(g.bufs[r], &g.l)->drain_op = 1; /* stop before op 0 */
        run_ranks(&g, f, 3u, 5000000000ull);
        for (uint32_t r = 0; r < R; r++) {
                ck_assert_int_eq(f[r].ret, EPD_ABORTED);
                ck_assert_uint_eq(cx_header_of(g.bufs[r], &g.l)->op_counter, 0);
                cx_header_of(g.bufs[r], &g.l)->drain_op = 0;
        }
        run_ranks(&g, f, 3u, 5000000000ull);
        for (uint32_t r = 0; r < R; r++) {
                ck_assert_msg(f[r].ret == 0, "%d %s", f[r].ret, f[r].msg);
                ck_assert_uint_eq(f[r].op, 0);
        }
        group_free(&g);
        free(in);
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

static Suite *cx_suite(void)
{
        Suite *s = suite_create("cx");
        TCase *tc = tcase_create("bitwise");

        tcase_add_loop_test(tc, test_bitwise, 0, (int)(sizeof(cases) / sizeof(cases[0])));
        tcase_add_test(tc, test_many_ops);
        tcase_set_timeout(tc, 300);
        suite_add_tcase(s, tc);

        tc = tcase_create("failures");
        tcase_add_test(tc, test_capacity_blocks);
        tcase_add_test(tc, test_capacity_rows);
        tcase_add_test(tc, test_invalid_collective);
        tcase_add_test(tc, test_abort);
        tcase_add_test(tc, test_timeout);
        tcase_add_test(tc, test_drain);
        tcase_set_timeout(tc, 120);
        suite_add_tcase(s, tc);

        tc = tcase_create("layout");
        tcase_add_test(tc, test_layout_sizes);
        tcase_add_test(tc, test_fp8_conversion);
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
