/* unit_xnode.c - dispatch and combine across nodes over a transport (cpu/xnode.c), bitwise
 * against the independent reference (tests/lib/reference.h).
 *
 * A group of N nodes x G ranks runs as R threads of one process. Every rank runs several rounds of
 * dispatch and combine back to back (no join between ops, so slots and counters are reused), and
 * the test's thread compares every output of every round with the reference afterwards. The
 * transports are tests/lib/xport_test.h's: in-order immediate, and hostile (reordered, delayed,
 * torn puts; signals ahead of their data). The ordered protocol over the hostile transport must
 * go wrong, which shows that the checks can fail and that the unordered protocol is needed; a run
 * whose routing repeats in every round leaves the previous op's chunks, complete and valid for
 * that op, in the slots that the next op of the same parity reads, and none may be consumed.
 */
#include <check.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"
#include "testdata.h"
#include "xnode.h"
#include "xport_test.h"

#define MAX_R 16u
#define MAX_ROUNDS 4u
#define H_ 64u
#define T_ 12u
#define K_ 4u
#define L_ 2u
#define SCALE_BLOCK 32u
#define ALIGN_EXPAND 4u
#define POISON 0xA5u

enum xp_kind { XP_ORDERED, XP_HOSTILE };

struct tcase {
        uint32_t N, G;
        enum epd_layout layout;
        enum epd_dtype dtype;
        enum xp_kind xp;
        enum xnode_completion completion;
        int signals_first;          /* hostile: signals overtake their data */
        int same_routing;           /* every round routes the same tokens the same way */
        uint32_t rounds;
        uint64_t timeout_ns;
        uint32_t bad_rank_plus1;    /* 1 + a rank whose first token names expert E (invalid) */
};

/* One rank's inputs and outputs of one round. */
struct rank_round {
        uint32_t n;
        uint8_t *x;
        float *scales;
        uint8_t *topk;
        float *w;
        uint16_t *y;
        uint16_t *bias[2];
        uint8_t *recv_x, *recv_topk_idx;
        float *recv_scales, *recv_weights;
        int64_t *recv_src;
        int32_t *recv_topk_slot;
        int32_t per_expert[L_], per_expert_aligned[L_], rank_prefix[MAX_R + 1];
        struct xnode_counts counts;
        uint16_t *combined;
        float *cw;
        int st_dispatch, st_combine;
        char msg[256];
};

struct world {
        const struct tcase *tc;
        struct xnode_shape shape;
        uint32_t R, E, K_op;
        uint64_t row_bytes, rows;
        uint32_t nscales;
        enum epd_dtype topk_dtype;
        struct xport *xp;
        struct xnode_node *node[MAX_R];
        struct xnode_rank *rank[MAX_R];
        struct rank_round rr[MAX_ROUNDS][MAX_R];
        struct ref_dispatch *ref[MAX_ROUNDS];
};

struct outcome {
        uint32_t failures;          /* (round, rank) pairs with a bad status or a mismatch */
        char first[512];
        int st_dispatch[MAX_R];     /* round 0's dispatch status of every rank */
        struct xnode_stats stats;   /* summed over ranks */
        struct xport_test_stats xstats;
};

static void *rank_main(void *arg);

struct rank_arg {
        struct world *w;
        uint32_t r;
};

static uint32_t tokens_of(uint32_t s, uint32_t R)
{
        if (s == 1 && R > 2)
                return 0;
        return s == 0 ? T_ : T_ - s % 3;
}

static void make_round(struct world *w, uint32_t round, uint64_t seed)
{
        const uint32_t R = w->R, K = w->K_op, H = H_;
        struct ref_src src[MAX_R];
        struct ref_params p = {
                .world_size = R, .num_experts = w->E, .hidden = H, .max_tokens = T_,
                .num_topk = K, .dtype = w->tc->dtype, .scale_block = SCALE_BLOCK,
                .topk_dtype = w->topk_dtype, .layout = w->tc->layout,
                .expert_alignment = w->tc->layout == EPD_LAYOUT_EXPAND ? ALIGN_EXPAND : 1,
                .zero_padding = w->tc->dtype == EPD_DTYPE_FP8_E4M3, .has_weights = 1,
        };
        const size_t tsz = w->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        char err[256];

        for (uint32_t s = 0; s < R; s++) {
                struct rank_round *rr = &w->rr[round][s];
                struct td_rng rng, route;
                struct td_routing_args ra = {
                        .world_size = R, .num_experts = w->E, .num_topk = K,
                        .mode = TD_ROUTING_UNIFORM, .minus_one_prob = 0.15,
                        .empty_row_prob = 0.1, .dtype = w->topk_dtype,
                };

                td_rng_seed(&rng, td_mix_seed(seed, round * 64 + s));
                td_rng_seed(&route, td_mix_seed(w->tc->same_routing ? seed : seed + round,
                                                1000 + s));
                rr->n = tokens_of(s, R);
                ra.num_tokens = rr->n;
                rr->x = malloc(T_ * w->row_bytes);
                rr->scales = malloc((size_t)T_ * w->nscales * 4 + 4);
                rr->topk = malloc(T_ * K * tsz);
                rr->w = malloc((size_t)T_ * K * 4);
                rr->y = malloc(w->rows * H * 2);
                rr->bias[0] = malloc((size_t)T_ * H * 2);
                rr->bias[1] = malloc((size_t)T_ * H * 2);
                rr->recv_x = malloc(w->rows * w->row_bytes);
                rr->recv_scales = malloc(w->rows * w->nscales * 4 + 4);
                rr->recv_topk_idx = malloc(w->rows * K * tsz);
                rr->recv_weights = malloc(w->rows * K * 4);
                rr->recv_src = malloc(w->rows * 8);
                rr->recv_topk_slot = malloc(w->rows * 4);
                rr->combined = malloc((size_t)T_ * H * 2);
                rr->cw = malloc((size_t)T_ * K * 4);
                ck_assert(rr->x && rr->scales && rr->topk && rr->w && rr->y && rr->bias[0] &&
                          rr->bias[1] && rr->recv_x && rr->recv_scales && rr->recv_topk_idx &&
                          rr->recv_weights && rr->recv_src && rr->recv_topk_slot &&
                          rr->combined && rr->cw);
                td_gen_topk(&route, &ra, rr->topk);
                if (w->tc->bad_rank_plus1 == s + 1 && rr->n) {
                        int64_t bad64 = w->E;
                        int32_t bad32 = (int32_t)w->E;

                        memcpy(rr->topk, tsz == 8 ? (void *)&bad64 : (void *)&bad32, tsz);
                }
                if (w->tc->dtype == EPD_DTYPE_BF16)
                        td_fill_bf16(&rng, rr->x, T_, H, 0, 0.02);
                else
                        td_fill_bytes(&rng, rr->x, T_, w->row_bytes, 0);
                if (w->nscales)
                        td_fill_f32(&rng, rr->scales, T_, w->nscales, 0, 0.01f, 4.0f);
                td_fill_f32(&rng, rr->w, T_, K, 0, -1.0f, 1.0f);
                td_fill_bf16(&rng, rr->y, w->rows, H, 0, 0.01);
                td_fill_bf16(&rng, rr->bias[0], T_, H, 0, 0.0);
                td_fill_bf16(&rng, rr->bias[1], T_, H, 0, 0.0);
                td_fill_pattern(rr->recv_x, w->rows, w->row_bytes, 0, POISON);
                td_fill_pattern(rr->recv_scales, w->rows, w->nscales * 4, 0, POISON);
                td_fill_pattern(rr->recv_topk_idx, w->rows, K * tsz, 0, POISON);
                td_fill_pattern(rr->recv_weights, w->rows, K * 4, 0, POISON);
                td_fill_pattern(rr->recv_src, w->rows, 8, 0, POISON);
                td_fill_pattern(rr->recv_topk_slot, w->rows, 4, 0, POISON);
                td_fill_pattern(rr->combined, T_, H * 2, 0, POISON);
                td_fill_pattern(rr->cw, T_, K * 4, 0, POISON);
                rr->counts = (struct xnode_counts){ .per_expert = rr->per_expert,
                                                    .per_expert_aligned = rr->per_expert_aligned,
                                                    .rank_prefix = rr->rank_prefix };
                src[s] = (struct ref_src){
                        .num_tokens = rr->n, .x = { rr->x, w->row_bytes },
                        .scales = { w->nscales ? rr->scales : NULL, (uint64_t)w->nscales * 4 },
                        .topk_idx = { rr->topk, K * tsz }, .weights = { rr->w, K * 4 },
                };
        }
        if (w->tc->bad_rank_plus1)
                return; /* the reference refuses it too; the test checks statuses only */
        ck_assert_msg(ref_dispatch_new(&p, src, &w->ref[round], err, sizeof(err)) == 0,
                      "reference: %s", err);
}

static void free_round(struct world *w, uint32_t round)
{
        for (uint32_t s = 0; s < w->R; s++) {
                struct rank_round *rr = &w->rr[round][s];

                free(rr->x);
                free(rr->scales);
                free(rr->topk);
                free(rr->w);
                free(rr->y);
                free(rr->bias[0]);
                free(rr->bias[1]);
                free(rr->recv_x);
                free(rr->recv_scales);
                free(rr->recv_topk_idx);
                free(rr->recv_weights);
                free(rr->recv_src);
                free(rr->recv_topk_slot);
                free(rr->combined);
                free(rr->cw);
        }
        ref_dispatch_free(w->ref[round]);
}

static void *rank_main(void *arg)
{
        struct rank_arg *ra = arg;
        struct world *w = ra->w;
        const uint32_t me = ra->r, K = w->K_op;
        const size_t tsz = w->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        const int expand = w->tc->layout == EPD_LAYOUT_EXPAND;

        for (uint32_t round = 0; round < w->tc->rounds; round++) {
                struct rank_round *rr = &w->rr[round][me];
                struct xnode_dispatch_args da = {
                        .num_tokens = rr->n,
                        .x = { rr->x, w->row_bytes },
                        .scales = { w->nscales ? (uint8_t *)rr->scales : NULL,
                                    (uint64_t)w->nscales * 4 },
                        .topk_idx = rr->topk, .topk_dtype = w->topk_dtype, .num_topk = K,
                        .weights = rr->w, .layout = w->tc->layout,
                        .expert_alignment = expand ? ALIGN_EXPAND : 1,
                        .zero_padding = w->tc->dtype == EPD_DTYPE_FP8_E4M3,
                        .out = {
                                .recv_x = { rr->recv_x, w->row_bytes },
                                .recv_scales = { w->nscales ? (uint8_t *)rr->recv_scales : NULL,
                                                 (uint64_t)w->nscales * 4 },
                                .recv_topk_idx = { expand ? NULL : rr->recv_topk_idx, K * tsz },
                                .recv_weights = { (uint8_t *)rr->recv_weights,
                                                  expand ? 4 : (uint64_t)K * 4 },
                                .recv_src = { (uint8_t *)rr->recv_src, 8 },
                                .recv_topk_slot = { expand ? (uint8_t *)rr->recv_topk_slot : NULL,
                                                    4 },
                        },
                };
                struct xnode_combine_args ca = {
                        .y = { (uint8_t *)rr->y, H_ * 2 },
                        .apply_weights = expand,
                        .bias = { { (uint8_t *)rr->bias[0], H_ * 2 },
                                  { (uint8_t *)rr->bias[1], H_ * 2 } },
                        .combined = { (uint8_t *)rr->combined, H_ * 2 },
                        .combined_topk_weights = { (uint8_t *)rr->cw, (uint64_t)K * 4 },
                };
                char msg[256] = "";

                rr->st_dispatch = xnode_dispatch(w->rank[me], &da, &rr->counts, msg,
                                                 sizeof(msg));
                if (rr->st_dispatch)
                        snprintf(rr->msg, sizeof(rr->msg), "dispatch %d: %s", rr->st_dispatch,
                                 msg);
                rr->st_combine = xnode_combine(w->rank[me], &ca, msg, sizeof(msg));
                if (rr->st_combine && !rr->st_dispatch)
                        snprintf(rr->msg, sizeof(rr->msg), "combine %d: %s", rr->st_combine,
                                 msg);
        }
        return NULL;
}

static void note(struct outcome *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void note(struct outcome *o, const char *fmt, ...)
{
        va_list ap;

        if (o->failures++)
                return;
        va_start(ap, fmt);
        vsnprintf(o->first, sizeof(o->first), fmt, ap);
        va_end(ap);
}

static void check_round(struct world *w, uint32_t round, struct outcome *o)
{
        const uint32_t R = w->R, K = w->K_op;
        const size_t tsz = w->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        const int expand = w->tc->layout == EPD_LAYOUT_EXPAND;
        const struct ref_dispatch *ref = w->ref[round];
        struct ref_buf y[MAX_R];
        char msg[400];

        for (uint32_t d = 0; d < R; d++)
                y[d] = (struct ref_buf){ w->rr[round][d].y, H_ * 2 };
        for (uint32_t d = 0; d < R; d++) {
                struct rank_round *rr = &w->rr[round][d];
                struct ref_counts_actual ca = {
                        .num_recv_tokens = rr->counts.num_recv_tokens,
                        .num_expanded_rows = rr->counts.num_expanded_rows,
                        .per_expert = rr->per_expert,
                        .per_expert_aligned = rr->per_expert_aligned,
                        .rank_prefix = rr->rank_prefix,
                };
                struct ref_dispatch_actual da = {
                        .recv_x = { rr->recv_x, w->row_bytes },
                        .recv_scales = { w->nscales ? rr->recv_scales : NULL,
                                         (uint64_t)w->nscales * 4 },
                        .recv_topk_idx = { expand ? NULL : rr->recv_topk_idx, K * tsz },
                        .recv_weights = { rr->recv_weights, expand ? 4 : (uint64_t)K * 4 },
                        .recv_src = { rr->recv_src, 8 },
                        .recv_topk_slot = { expand ? rr->recv_topk_slot : NULL, 4 },
                };
                struct ref_combine_in in = { y, expand };
                struct ref_buf bias[2] = { { rr->bias[0], H_ * 2 }, { rr->bias[1], H_ * 2 } };

                if (rr->st_dispatch || rr->st_combine) {
                        note(o, "round %u rank %u: %s", round, d, rr->msg);
                        continue;
                }
                if (ref_check_counts(ref, d, &ca, msg, sizeof(msg)) ||
                    ref_check_dispatch(ref, d, &da, msg, sizeof(msg))) {
                        note(o, "round %u dispatch: %s", round, msg);
                        continue;
                }
                if (ref_check_combine(ref, &in, d, bias,
                                      (struct ref_buf){ rr->combined, H_ * 2 },
                                      (struct ref_buf){ rr->cw, (uint64_t)K * 4 }, msg,
                                      sizeof(msg)))
                        note(o, "round %u combine at rank %u: %s", round, d, msg);
        }
}

/* Runs tc's rounds on a fresh group and transport; the outcome says what went wrong, if
 * anything. */
static void run(const struct tcase *tc, uint64_t seed, struct outcome *o)
{
        struct world *w = calloc(1, sizeof(*w));
        pthread_t th[MAX_R];
        struct rank_arg ra[MAX_R];
        uint64_t window;
        uint32_t counters;
        char err[256];

        ck_assert_ptr_nonnull(w);
        ck_assert_uint_le(tc->rounds, MAX_ROUNDS);
        memset(o, 0, sizeof(*o));
        w->tc = tc;
        w->R = tc->N * tc->G;
        ck_assert_uint_le(w->R, MAX_R);
        w->E = w->R * L_;
        w->K_op = tc->layout == EPD_LAYOUT_EXPAND ? K_ - 1 : K_;
        w->topk_dtype = tc->dtype == EPD_DTYPE_BF16 ? EPD_DTYPE_INT64 : EPD_DTYPE_INT32;
        w->row_bytes = tc->dtype == EPD_DTYPE_BF16 ? H_ * 2 : H_;
        w->nscales = tc->dtype == EPD_DTYPE_FP8_E4M3 ? H_ / SCALE_BLOCK : 0;
        w->rows = tc->layout == EPD_LAYOUT_EXPAND
                          ? (uint64_t)w->R * T_ * (K_ < L_ ? K_ : L_) + L_ * (ALIGN_EXPAND - 1)
                          : (uint64_t)w->R * T_;
        w->shape = (struct xnode_shape){
                .nodes = tc->N, .ranks_per_node = tc->G, .num_experts = w->E, .hidden = H_,
                .max_tokens = T_, .max_topk = K_, .dtype = tc->dtype, .scale_block = SCALE_BLOCK,
                .chunk_tokens = 5, .completion = tc->completion,
        };
        ck_assert_msg(xnode_shape_check(&w->shape, err, sizeof(err)) == 0, "%s", err);
        window = xnode_window_bytes(&w->shape);
        counters = xnode_num_counters(&w->shape);
        if (tc->xp == XP_ORDERED) {
                w->xp = xport_test_ordered_new(w->R, window, counters);
        } else {
                struct xport_hostile_opts ho = { .seed = seed, .max_piece = 96,
                                                 .max_delay_us = 20,
                                                 .signals_first = tc->signals_first };

                w->xp = xport_test_hostile_new(w->R, window, counters, &ho);
        }
        ck_assert_ptr_nonnull(w->xp);
        /* Windows start as garbage, so that reading a slot before its data lands shows. */
        for (uint32_t r = 0; r < w->R; r++)
                memset(xport_test_window(w->xp, r), POISON, window);
        for (uint32_t b = 0; b < tc->N; b++) {
                w->node[b] = xnode_node_new(&w->shape, b, w->xp);
                ck_assert_ptr_nonnull(w->node[b]);
        }
        for (uint32_t r = 0; r < w->R; r++) {
                w->rank[r] = xnode_rank_new(w->node[r / tc->G], r, tc->timeout_ns);
                ck_assert_ptr_nonnull(w->rank[r]);
        }
        for (uint32_t round = 0; round < tc->rounds; round++)
                make_round(w, round, seed);

        for (uint32_t r = 0; r < w->R; r++) {
                ra[r] = (struct rank_arg){ w, r };
                ck_assert_int_eq(pthread_create(&th[r], NULL, rank_main, &ra[r]), 0);
        }
        for (uint32_t r = 0; r < w->R; r++)
                pthread_join(th[r], NULL);
        xport_test_quiesce(w->xp);

        for (uint32_t r = 0; r < w->R; r++)
                o->st_dispatch[r] = w->rr[0][r].st_dispatch;
        for (uint32_t round = 0; round < tc->rounds && !tc->bad_rank_plus1; round++)
                check_round(w, round, o);
        for (uint32_t r = 0; r < w->R; r++) {
                struct xnode_stats st;

                xnode_rank_stats(w->rank[r], &st);
                o->stats.bytes_sent += st.bytes_sent;
                o->stats.chunks_received += st.chunks_received;
                o->stats.incomplete += st.incomplete;
                o->stats.stale += st.stale;
                xnode_rank_free(w->rank[r]);
        }
        if (tc->xp == XP_HOSTILE)
                xport_test_stats(w->xp, &o->xstats);
        for (uint32_t b = 0; b < tc->N; b++)
                xnode_node_free(w->node[b]);
        xport_test_free(w->xp);
        for (uint32_t round = 0; round < tc->rounds; round++)
                free_round(w, round);
        free(w);
}

/* ---- the matrix: N = 2, 3, 4 nodes x G = 1, 2, 4 ranks x layout x dtype ---- */

static const uint32_t nodes_of[] = { 2, 3, 4 };
static const uint32_t gpn_of[] = { 1, 2, 4 };

static struct tcase matrix_case(int i, enum xp_kind xp)
{
        return (struct tcase){
                .N = nodes_of[i / 12], .G = gpn_of[i / 4 % 3],
                .layout = i / 2 % 2 ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND,
                .dtype = i % 2 ? EPD_DTYPE_FP8_E4M3 : EPD_DTYPE_BF16,
                .xp = xp, .rounds = 3, .timeout_ns = 60000000000ull,
        };
}

static void run_matrix_case(const struct tcase *tc, int i)
{
        struct outcome o;

        run(tc, td_mix_seed(0x5ca1e007u, (uint64_t)i), &o);
        ck_assert_msg(o.failures == 0, "%u x %u %s %s over %s%s: %u failures, first: %s", tc->N,
                      tc->G, tc->layout == EPD_LAYOUT_EXPAND ? "EXPAND" : "NON_EXPAND",
                      tc->dtype == EPD_DTYPE_BF16 ? "bf16" : "fp8",
                      tc->xp == XP_ORDERED ? "ordered" : "hostile",
                      tc->completion == XNODE_COMPLETION_UNORDERED ? ", unordered completion" : "",
                      o.failures, o.first);
        ck_assert_uint_gt(o.stats.bytes_sent, 0);
}

/* Cases 0-35 over the ordered transport with ordered completion, 36-71 over the hostile one with
 * unordered completion, 72-107 over the ordered one with unordered completion (the unordered
 * protocol is right on both). */
START_TEST(test_matrix)
{
        struct tcase tc = matrix_case(_i % 36, _i / 36 == 1 ? XP_HOSTILE : XP_ORDERED);

        if (_i / 36 == 2)
                tc.completion = XNODE_COMPLETION_UNORDERED;
        run_matrix_case(&tc, _i);
}
END_TEST

/* The ordered protocol trusts the signal after the data; over the hostile transport the signal
 * overtakes the data, and the outputs are wrong (or an op fails): the checks above can fail. The
 * unordered protocol over the same transport and seed is right. */
START_TEST(test_ordered_protocol_breaks_on_hostile)
{
        struct tcase tc = {
                .N = 2, .G = 2, .layout = EPD_LAYOUT_NON_EXPAND, .dtype = EPD_DTYPE_BF16,
                .xp = XP_HOSTILE, .completion = XNODE_COMPLETION_ORDERED, .signals_first = 1,
                .rounds = 3, .timeout_ns = 2000000000ull,
        };
        struct outcome o;

        run(&tc, 42, &o);
        ck_assert_msg(o.failures > 0, "the ordered protocol survived a transport that reorders "
                      "(%" PRIu64 " overtakes)", o.xstats.overtakes);

        tc.completion = XNODE_COMPLETION_UNORDERED;
        tc.timeout_ns = 60000000000ull;
        run(&tc, 42, &o);
        ck_assert_msg(o.failures == 0, "unordered: %u failures, first: %s", o.failures, o.first);
        ck_assert_uint_gt(o.xstats.overtakes, 0);
        ck_assert_uint_gt(o.stats.incomplete, 0);
}
END_TEST

/* Same routing in every round: the slot that op n + 2 reads holds op n's chunk of the same size,
 * whole and with a valid checksum for op n, until op n + 2's lands. It is seen and never
 * consumed: every round's outputs are right. */
START_TEST(test_stale_chunk_never_consumed)
{
        struct tcase tc = {
                .N = 3, .G = 2, .layout = EPD_LAYOUT_EXPAND, .dtype = EPD_DTYPE_BF16,
                .xp = XP_HOSTILE, .signals_first = 1, .same_routing = 1, .rounds = 4,
                .timeout_ns = 60000000000ull,
        };
        struct outcome o;

        run(&tc, 7, &o);
        ck_assert_msg(o.failures == 0, "%u failures, first: %s", o.failures, o.first);
        ck_assert_msg(o.stats.stale > 0, "no stale chunk was ever seen (%" PRIu64
                      " incomplete loads)", o.stats.incomplete);
}
END_TEST

/* One source's invalid routing fails the dispatch on every rank of every node, through the
 * verdict its count records carry, and nothing waits for a timeout. */
START_TEST(test_invalid_routing_everywhere)
{
        struct tcase tc = {
                .N = 3, .G = 2, .layout = EPD_LAYOUT_NON_EXPAND, .dtype = EPD_DTYPE_BF16,
                .xp = _i ? XP_HOSTILE : XP_ORDERED, .rounds = 1,
                .timeout_ns = 30000000000ull, .bad_rank_plus1 = 1 + 2,
        };
        struct outcome o;

        run(&tc, 11, &o);
        for (uint32_t r = 0; r < tc.N * tc.G; r++)
                ck_assert_msg(o.st_dispatch[r] == EPD_INVALID_ARGUMENT, "rank %u: status %d", r,
                              o.st_dispatch[r]);
}
END_TEST

START_TEST(test_shape_check)
{
        struct xnode_shape ok = { .nodes = 2, .ranks_per_node = 2, .num_experts = 8,
                                  .hidden = 64, .max_tokens = 4, .max_topk = 2,
                                  .dtype = EPD_DTYPE_BF16 };
        struct xnode_shape bad;
        char err[200];

        ck_assert_int_eq(xnode_shape_check(&ok, err, sizeof(err)), 0);
        bad = ok;
        bad.num_experts = 6;
        ck_assert_int_eq(xnode_shape_check(&bad, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_ptr_nonnull(strstr(err, "num_experts"));
        bad = ok;
        bad.hidden = 4;
        ck_assert_int_eq(xnode_shape_check(&bad, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_ptr_nonnull(strstr(err, "multiple of 16"));
        bad = ok;
        bad.nodes = 0;
        ck_assert_int_eq(xnode_shape_check(&bad, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_ptr_null(xnode_node_new(&bad, 0, NULL));
}
END_TEST

static Suite *xnode_suite(void)
{
        Suite *s = suite_create("xnode");
        TCase *tc = tcase_create("matrix");

        tcase_add_loop_test(tc, test_matrix, 0, 3 * 36);
        tcase_set_timeout(tc, 600);
        suite_add_tcase(s, tc);

        tc = tcase_create("protocol");
        tcase_add_test(tc, test_ordered_protocol_breaks_on_hostile);
        tcase_add_test(tc, test_stale_chunk_never_consumed);
        tcase_add_loop_test(tc, test_invalid_routing_everywhere, 0, 2);
        tcase_set_timeout(tc, 600);
        suite_add_tcase(s, tc);

        tc = tcase_create("shape");
        tcase_add_test(tc, test_shape_check);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(xnode_suite());
        int failed;

        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
