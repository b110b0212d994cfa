/* unit_plan.c - the placement plan (cpu/plan.c) against the independent reference.
 *
 * Covers: dimension limits, topk validation (out-of-range ids, duplicates, -1 anywhere, int64 ids
 * that would alias a valid id if truncated), and for many seeded routings the counts, rank
 * prefixes, expert bases (alignment 1 and 128) and every row of both layouts. Each case prints its
 * seed; rerun a single one with CK_RUN_CASE / CK_RUN_SUITE and the printed seed.
 */
#include <check.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "routing.h"
#include "reference.h"
#include "testdata.h"

/* ---- helpers ---- */

/* Counts one source's int32 topk into a fresh plan and returns the status and message. */
static int count_one(const int32_t *topk, uint32_t n, uint32_t K, uint32_t E, char *err,
                     size_t err_len)
{
        uint32_t num_tokens[1] = { n };
        struct epd_plan *plan = epd_plan_new(1, E, n ? n : 1, K, 1, EPD_LAYOUT_NON_EXPAND,
                                             num_tokens);
        int r;

        ck_assert_ptr_nonnull(plan);
        r = epd_plan_count_source(plan, 0, topk, EPD_DTYPE_INT32, K, err, err_len);
        epd_plan_free(plan);
        return r;
}

/* The reference's verdict for the same single-source routing. */
static int ref_verdict(const int32_t *topk, uint32_t n, uint32_t K, uint32_t E)
{
        struct ref_params p = {
                .world_size = 1, .num_experts = E, .hidden = 8, .max_tokens = n ? n : 1,
                .num_topk = K, .dtype = EPD_DTYPE_BF16, .topk_dtype = EPD_DTYPE_INT32,
                .layout = EPD_LAYOUT_NON_EXPAND, .expert_alignment = 1,
        };
        uint16_t x[8] = { 0 };
        struct ref_src src = { .num_tokens = n, .x = { x, 0 }, .topk_idx = { topk, 0 } };
        struct ref_dispatch *ref = NULL;
        char err[256];
        int r = ref_dispatch_new(&p, &src, &ref, err, sizeof(err));

        ref_dispatch_free(ref);
        return r;
}

/* ---- limits ---- */

START_TEST(test_new_limits)
{
        uint32_t n[8] = { 4, 4, 4, 4, 4, 4, 4, 4 };
        uint32_t big[1024];
        struct epd_plan *p;

        for (int i = 0; i < 1024; i++)
                big[i] = 1;
        p = epd_plan_new(4, 16, 4, 2, 1, EPD_LAYOUT_NON_EXPAND, n);
        ck_assert_ptr_nonnull(p);
        ck_assert_uint_eq(p->num_local_experts, 4);
        epd_plan_free(p);
        epd_plan_free(NULL);

        ck_assert_ptr_null(epd_plan_new(0, 16, 4, 2, 1, EPD_LAYOUT_NON_EXPAND, n));
        ck_assert_ptr_null(epd_plan_new(3, 16, 4, 2, 1, EPD_LAYOUT_NON_EXPAND, n));  /* E % R */
        ck_assert_ptr_null(epd_plan_new(4, 16, 4, 0, 1, EPD_LAYOUT_NON_EXPAND, n));  /* K = 0 */
        ck_assert_ptr_null(epd_plan_new(4, 16, 4, 33, 1, EPD_LAYOUT_NON_EXPAND, n)); /* K > 32 */
        ck_assert_ptr_null(epd_plan_new(4, 16, 4, 2, 0, EPD_LAYOUT_NON_EXPAND, n));  /* align 0 */
        ck_assert_ptr_null(epd_plan_new(4, 16, 3, 2, 1, EPD_LAYOUT_NON_EXPAND, n));  /* N > T */
        ck_assert_ptr_null(epd_plan_new(1, 257, 4, 2, 1, EPD_LAYOUT_NON_EXPAND, n)); /* L > 256 */
        ck_assert_ptr_null(epd_plan_new(4, 4096, 4, 2, 1, EPD_LAYOUT_NON_EXPAND, n)); /* E */
        ck_assert_ptr_null(epd_plan_new(4, 16, 4, 2, 1, (enum epd_layout)7, n));
        ck_assert_ptr_null(epd_plan_new(4, 16, 4, 2, 1, EPD_LAYOUT_NON_EXPAND, NULL));
        /* Row counts must fit int32. */
        ck_assert_ptr_null(epd_plan_new(1024, 2048, 1u << 20, 32, 1, EPD_LAYOUT_EXPAND, big));
        p = epd_plan_new(1024, 2048, 1, 2, 1, EPD_LAYOUT_EXPAND, big);
        ck_assert_ptr_nonnull(p);
        epd_plan_free(p);
}
END_TEST

/* ---- validation ---- */

START_TEST(test_validate_out_of_range)
{
        char err[256] = "";
        int32_t ok[6] = { 0, 7, -1, -1, 3, 5 };
        int32_t high[6] = { 0, 7, -1, 8, 3, 5 };   /* E = 8 is out of range */
        int32_t neg[6] = { 0, 7, -2, 1, 3, 5 };    /* only -1 is allowed below 0 */

        ck_assert_int_eq(count_one(ok, 3, 2, 8, err, sizeof(err)), 0);
        ck_assert_int_eq(ref_verdict(ok, 3, 2, 8), 0);

        ck_assert_int_eq(count_one(high, 3, 2, 8, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(err, "token 1") && strstr(err, "position 1") && strstr(err, "8"),
                      "message does not name token, position and value: %s", err);
        ck_assert_int_eq(ref_verdict(high, 3, 2, 8), EPD_INVALID_ARGUMENT);

        ck_assert_int_eq(count_one(neg, 3, 2, 8, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(err, "-2") != NULL, "message lacks the value: %s", err);
        ck_assert_int_eq(ref_verdict(neg, 3, 2, 8), EPD_INVALID_ARGUMENT);

        /* A NULL error buffer is allowed. */
        ck_assert_int_eq(count_one(high, 3, 2, 8, NULL, 0), EPD_INVALID_ARGUMENT);
}
END_TEST

START_TEST(test_validate_int64_wide)
{
        /* 2^32 + 3 truncates to the valid id 3: an int64 input must be rejected before it is
         * narrowed. */
        int64_t topk[4] = { 1, (int64_t)1 << 32 | 3, -1, 2 };
        uint32_t n[1] = { 2 };
        struct epd_plan *plan = epd_plan_new(1, 8, 2, 2, 1, EPD_LAYOUT_EXPAND, n);
        char err[256];

        ck_assert_ptr_nonnull(plan);
        ck_assert_int_eq(epd_plan_count_source(plan, 0, topk, EPD_DTYPE_INT64, 2, err,
                                               sizeof(err)), EPD_INVALID_ARGUMENT);
        topk[1] = 3;
        ck_assert_int_eq(epd_plan_count_source(plan, 0, topk, EPD_DTYPE_INT64, 2, err,
                                               sizeof(err)), 0);
        /* Not an index dtype. */
        ck_assert_int_eq(epd_plan_count_source(plan, 0, topk, EPD_DTYPE_FP32, 2, err,
                                               sizeof(err)), EPD_INVALID_ARGUMENT);
        epd_plan_free(plan);
}
END_TEST

START_TEST(test_validate_duplicates)
{
        char err[256] = "";
        int32_t dup[8] = { 1, 2, 3, 4,   5, -1, 6, 5 };
        int32_t dup_adjacent[4] = { 6, 6, -1, -1 };
        int32_t minus_ones[8] = { -1, -1, -1, -1,   -1, 3, -1, -1 }; /* -1 may repeat */

        ck_assert_int_eq(count_one(dup, 2, 4, 8, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(err, "token 1") && strstr(err, "5"), "bad message: %s", err);
        ck_assert_int_eq(ref_verdict(dup, 2, 4, 8), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(count_one(dup_adjacent, 1, 4, 8, err, sizeof(err)),
                         EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(ref_verdict(dup_adjacent, 1, 4, 8), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(count_one(minus_ones, 2, 4, 8, err, sizeof(err)), 0);
        ck_assert_int_eq(ref_verdict(minus_ones, 2, 4, 8), 0);
}
END_TEST

START_TEST(test_all_minus_one)
{
        /* Tokens that go nowhere receive no rows, and the plan says -1 everywhere. */
        int32_t topk[6] = { -1, -1, -1, 2, -1, -1 };
        uint32_t n[2] = { 3, 0 };
        struct epd_plan *plan = epd_plan_new(2, 4, 3, 2, 4, EPD_LAYOUT_EXPAND, n);
        char err[128];

        ck_assert_ptr_nonnull(plan);
        ck_assert_int_eq(epd_plan_count_source(plan, 0, topk, EPD_DTYPE_INT32, 2, err,
                                               sizeof(err)), 0);
        ck_assert_int_eq(epd_plan_count_source(plan, 1, NULL, EPD_DTYPE_INT32, 2, err,
                                               sizeof(err)), 0);
        epd_plan_finish(plan);
        epd_plan_place_source(plan, 0);
        epd_plan_place_source(plan, 1);
        ck_assert_int_eq(epd_plan_num_recv_tokens(plan, 0), 0);
        ck_assert_int_eq(epd_plan_num_recv_tokens(plan, 1), 1);
        ck_assert_int_eq(epd_plan_num_expanded_rows(plan, 0), 0);
        ck_assert_int_eq(epd_plan_num_expanded_rows(plan, 1), 4); /* 1 selection aligned to 4 */
        ck_assert_int_eq(epd_plan_rows(plan, 1), 4);
        for (int i = 0; i < 6; i++)
                ck_assert_int_eq(plan->row[0][i], i == 3 ? 0 : -1);
        epd_plan_free(plan);
}
END_TEST

/* ---- seeded cases against the reference ---- */

struct plan_case {
        uint32_t R, E, T, K, align;
        int tokens;                 /* 0: T on every rank, 1: T - r, 2: 0 on odd ranks */
        enum td_routing routing;
        double neg, empty;
        enum epd_dtype topk_dtype;
        uint32_t stride_extra;      /* extra elements per topk row */
};

static const struct plan_case fixed_cases[] = {
        { 1, 8, 16, 2, 1, 0, TD_ROUTING_UNIFORM, 0.0, 0.0, EPD_DTYPE_INT64, 0 },
        { 2, 16, 64, 8, 128, 1, TD_ROUTING_SKEWED, 0.1, 0.05, EPD_DTYPE_INT32, 3 },
        { 3, 48, 50, 8, 1, 1, TD_ROUTING_UNIFORM, 0.2, 0.1, EPD_DTYPE_INT64, 0 },
        { 3, 48, 50, 8, 128, 2, TD_ROUTING_ONE_RANK, 0.0, 0.0, EPD_DTYPE_INT32, 1 },
        { 4, 32, 40, 1, 1, 0, TD_ROUTING_UNIFORM, 0.3, 0.0, EPD_DTYPE_INT32, 0 },
        { 4, 4, 40, 8, 2, 0, TD_ROUTING_UNIFORM, 0.0, 0.0, EPD_DTYPE_INT64, 0 }, /* K > E */
        { 8, 64, 100, 8, 128, 1, TD_ROUTING_SKEWED, 0.0, 0.0, EPD_DTYPE_INT64, 2 },
        { 8, 256, 128, 8, 1, 1, TD_ROUTING_UNIFORM, 0.05, 0.02, EPD_DTYPE_INT32, 0 },
        { 8, 8, 33, 32, 1, 2, TD_ROUTING_ONE_RANK, 0.5, 0.0, EPD_DTYPE_INT32, 0 },
        { 4, 64, 77, 32, 128, 0, TD_ROUTING_UNIFORM, 0.1, 0.1, EPD_DTYPE_INT64, 0 },
};
#define NUM_FIXED (int)(sizeof(fixed_cases) / sizeof(fixed_cases[0]))
#define NUM_RANDOM 200
#define BASE_SEED 0x9A5E0123u

static struct plan_case random_case(struct td_rng *rng)
{
        static const uint32_t ranks[] = { 1, 2, 3, 4, 8 };
        static const uint32_t locals[] = { 1, 2, 3, 4, 16 };
        static const uint32_t topks[] = { 1, 2, 3, 8, 9 };
        static const uint32_t aligns[] = { 1, 2, 3, 128 };
        struct plan_case c;

        c.R = ranks[td_rng_below(rng, 5)];
        c.E = c.R * (c.R == 3 ? 16 : locals[td_rng_below(rng, 5)]);
        c.T = 1 + td_rng_below(rng, 70);
        c.K = topks[td_rng_below(rng, 5)];
        c.align = aligns[td_rng_below(rng, 4)];
        c.tokens = (int)td_rng_below(rng, 3);
        c.routing = (enum td_routing)td_rng_below(rng, 3);
        c.neg = td_rng_below(rng, 2) ? 0.15 : 0.0;
        c.empty = td_rng_below(rng, 3) == 0 ? 0.1 : 0.0;
        c.topk_dtype = td_rng_below(rng, 2) ? EPD_DTYPE_INT64 : EPD_DTYPE_INT32;
        c.stride_extra = td_rng_below(rng, 3);
        return c;
}

static void run_plan_case(const struct plan_case *c, uint64_t seed, enum epd_layout layout)
{
        const uint32_t R = c->R, K = c->K, L = c->E / c->R;
        const size_t esz = c->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        const uint64_t stride = K + c->stride_extra;
        uint32_t num_tokens[8];
        void *topk[8];
        struct ref_src src[8];
        uint16_t x[8] = { 0 };
        struct td_rng rng;
        struct epd_plan *plan;
        struct ref_dispatch *ref = NULL;
        char err[256];

        printf("plan case R=%u E=%u T=%u K=%u align=%u tokens=%d routing=%d layout=%d seed=0x%016"
               PRIx64 "\n", R, c->E, c->T, K, c->align, c->tokens, (int)c->routing, (int)layout,
               seed);
        fflush(stdout);
        td_rng_seed(&rng, seed);
        for (uint32_t s = 0; s < R; s++) {
                struct td_routing_args a = {
                        .world_size = R, .num_experts = c->E, .num_topk = K, .mode = c->routing,
                        .hot_rank = (uint32_t)(seed % R), .minus_one_prob = c->neg,
                        .empty_row_prob = c->empty, .dtype = c->topk_dtype, .row_stride = stride,
                };

                num_tokens[s] = c->tokens == 0 ? c->T :
                                c->tokens == 1 ? (c->T > s ? c->T - s : 0) :
                                (s % 2 ? 0 : c->T);
                a.num_tokens = num_tokens[s];
                topk[s] = calloc((size_t)num_tokens[s] * stride + 1, esz);
                ck_assert_ptr_nonnull(topk[s]);
                td_gen_topk(&rng, &a, topk[s]);
                src[s] = (struct ref_src){ .num_tokens = num_tokens[s], .x = { x, 0 },
                                           .topk_idx = { topk[s], stride * esz } };
        }

        struct ref_params p = {
                .world_size = R, .num_experts = c->E, .hidden = 1, .max_tokens = c->T,
                .num_topk = K, .dtype = EPD_DTYPE_BF16, .topk_dtype = c->topk_dtype,
                .layout = layout, .expert_alignment = c->align,
        };
        ck_assert_int_eq(ref_dispatch_new(&p, src, &ref, err, sizeof(err)), 0);

        plan = epd_plan_new(R, c->E, c->T, K, c->align, layout, num_tokens);
        ck_assert_ptr_nonnull(plan);
        /* Count and place in reverse source order: the result must not depend on the order in
         * which (possibly concurrent) per-source steps run. */
        for (uint32_t i = R; i-- > 0;)
                ck_assert_int_eq(epd_plan_count_source(plan, i, topk[i], c->topk_dtype, stride,
                                                       err, sizeof(err)), 0);
        epd_plan_finish(plan);
        for (uint32_t i = R; i-- > 0;)
                epd_plan_place_source(plan, i);

        for (uint32_t d = 0; d < R; d++) {
                const struct ref_dst *rd = &ref->dst[d];
                struct ref_counts_actual act = {
                        .num_recv_tokens = epd_plan_num_recv_tokens(plan, d),
                        .num_expanded_rows = epd_plan_num_expanded_rows(plan, d),
                        .per_expert = plan->expert_count + (size_t)d * L,
                        .per_expert_aligned = plan->expert_aligned + (size_t)d * L,
                        .rank_prefix = plan->rank_prefix + (size_t)d * (R + 1),
                };
                char msg[256];

                ck_assert_msg(ref_check_counts(ref, d, &act, msg, sizeof(msg)) == 0, "%s", msg);
                for (uint32_t l = 0; l <= L; l++)
                        ck_assert_int_eq(plan->expert_base[(size_t)d * (L + 1) + l],
                                         rd->expert_base[l]);
                ck_assert_int_eq(epd_plan_rows(plan, d), rd->rows);
        }

        /* Every row of the layout: the plan's row of (s, t, k) against the reference's lists. */
        for (uint32_t s = 0; s < R; s++) {
                for (uint32_t t = 0; t < num_tokens[s]; t++) {
                        const int32_t *sel = plan->topk[s] + (size_t)t * K;

                        for (uint32_t k = 0; k < K; k++) {
                                int32_t got = plan->row[s][(size_t)t * K + k];
                                int64_t want = -1;

                                ck_assert_int_eq(sel[k], ref->topk[s][(size_t)t * K + k]);
                                if (layout == EPD_LAYOUT_EXPAND) {
                                        want = ref_expand_row(ref, s, t, k);
                                } else if (sel[k] >= 0) {
                                        uint32_t d = (uint32_t)sel[k] / L;
                                        int first = 1;

                                        for (uint32_t j = 0; j < k; j++)
                                                if (sel[j] >= 0 && (uint32_t)sel[j] / L == d)
                                                        first = 0;
                                        if (first)
                                                want = ref_non_expand_row(ref, d, s, t);
                                }
                                ck_assert_msg(got == want,
                                              "seed 0x%016" PRIx64 " s=%u t=%u k=%u: plan row %d, "
                                              "reference %lld", seed, s, t, k, got,
                                              (long long)want);
                        }
                }
        }

        ref_dispatch_free(ref);
        epd_plan_free(plan);
        for (uint32_t s = 0; s < R; s++)
                free(topk[s]);
}

/* routing.h's division-free quotient equals e / L for every divisor up to 256 (local-expert
 * counts, top-k widths) and every dividend an expert id can be, and at the top of its range
 * (e * L < 2^32). */
START_TEST(test_rank_magic)
{
        uint64_t checked = 0;

        for (uint32_t L = 1; L <= EPD_MAX_LOCAL_EXPERTS; L++) {
                const uint64_t m = epd_udiv_magic(L);
                const uint32_t top = (uint32_t)(0xffffffffull / L);
                for (uint32_t e = 0; e < EPD_MAX_EXPERTS * 4; e++, checked++)
                        if (epd_route_expert_rank_magic((int32_t)e, m) != e / L)
                                ck_abort_msg("L %u e %u: %u, want %u", L, e,
                                             epd_route_expert_rank_magic((int32_t)e, m), e / L);
                for (uint32_t e = top > 4096 ? top - 4096 : 0; e < top; e++, checked++)
                        if (epd_route_expert_rank_magic((int32_t)e, m) != e / L)
                                ck_abort_msg("L %u e %u: %u, want %u", L, e,
                                             epd_route_expert_rank_magic((int32_t)e, m), e / L);
        }
        ck_assert_uint_gt(checked, 3000000);
}
END_TEST

START_TEST(test_fixed_cases)
{
        const struct plan_case *c = &fixed_cases[_i / 2];
        enum epd_layout layout = _i % 2 ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND;

        run_plan_case(c, td_mix_seed(BASE_SEED, (uint64_t)_i), layout);
}
END_TEST

START_TEST(test_random_cases)
{
        uint64_t seed = td_mix_seed(BASE_SEED + 1, (uint64_t)_i);
        struct td_rng rng;
        struct plan_case c;

        td_rng_seed(&rng, seed);
        c = random_case(&rng);
        run_plan_case(&c, seed, _i % 2 ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND);
}
END_TEST

/* A hand-computed example, so that the reference itself is pinned to the contract's wording. */
START_TEST(test_worked_example)
{
        /* R = 2, E = 4 (L = 2): experts 0,1 on rank 0; 2,3 on rank 1. K = 2. */
        int32_t t0[6] = { 2, 0,   3, 2,   -1, 1 };  /* rank 0, three tokens */
        int32_t t1[4] = { 1, 3,   0, -1 };          /* rank 1, two tokens */
        uint32_t n[2] = { 3, 2 };
        char err[64];
        struct epd_plan *ne = epd_plan_new(2, 4, 4, 2, 1, EPD_LAYOUT_NON_EXPAND, n);
        struct epd_plan *ex = epd_plan_new(2, 4, 4, 2, 4, EPD_LAYOUT_EXPAND, n);

        ck_assert_ptr_nonnull(ne);
        ck_assert_ptr_nonnull(ex);
        for (int i = 0; i < 2; i++) {
                struct epd_plan *p = i ? ex : ne;

                ck_assert_int_eq(epd_plan_count_source(p, 0, t0, EPD_DTYPE_INT32, 2, err, 64), 0);
                ck_assert_int_eq(epd_plan_count_source(p, 1, t1, EPD_DTYPE_INT32, 2, err, 64), 0);
                epd_plan_finish(p);
                epd_plan_place_source(p, 1);
                epd_plan_place_source(p, 0);
        }
        /* NON_EXPAND rank 0 gets (0,0) (0,2) (1,0) (1,1); rank 1 gets (0,0) (0,1) (1,0). */
        ck_assert_int_eq(epd_plan_num_recv_tokens(ne, 0), 4);
        ck_assert_int_eq(epd_plan_num_recv_tokens(ne, 1), 3);
        ck_assert_int_eq(ne->rank_prefix[0 * 3 + 1], 2);
        ck_assert_int_eq(ne->rank_prefix[1 * 3 + 1], 2);
        {
                /* Token (0,0) is row 0 at rank 1 (k0) and row 0 at rank 0 (k1); token (0,1)
                 * goes to rank 1 once, at k0. */
                const int32_t want0[6] = { 0, 0,   1, -1,   -1, 1 };
                const int32_t want1[4] = { 2, 2,   3, -1 };
                for (int i = 0; i < 6; i++)
                        ck_assert_int_eq(ne->row[0][i], want0[i]);
                for (int i = 0; i < 4; i++)
                        ck_assert_int_eq(ne->row[1][i], want1[i]);
        }
        /* EXPAND, alignment 4. Expert 0: (0,0,k1) (1,1,k0) -> rows 0,1, pad to 4.
         * Expert 1: (0,2,k1) (1,0,k0) -> rows 4,5, total 8.
         * Expert 2 (rank 1, local 0): (0,0,k0) (0,1,k1) -> rows 0,1. Expert 3: (0,1,k0) (1,0,k1)
         * -> rows 4,5. */
        {
                const int32_t want0[6] = { 0, 0,   4, 1,   -1, 4 };
                const int32_t want1[4] = { 5, 5,   1, -1 };
                for (int i = 0; i < 6; i++)
                        ck_assert_int_eq(ex->row[0][i], want0[i]);
                for (int i = 0; i < 4; i++)
                        ck_assert_int_eq(ex->row[1][i], want1[i]);
        }
        ck_assert_int_eq(epd_plan_num_expanded_rows(ex, 0), 8);
        ck_assert_int_eq(epd_plan_num_expanded_rows(ex, 1), 8);
        ck_assert_int_eq(ex->expert_count[0], 2);
        ck_assert_int_eq(ex->expert_aligned[0], 4);
        ck_assert_int_eq(ex->expert_base[0 * 3 + 1], 4);
        epd_plan_free(ne);
        epd_plan_free(ex);
}
END_TEST

static Suite *plan_suite(void)
{
        Suite *s = suite_create("plan");
        TCase *tc = tcase_create("validate");

        tcase_add_test(tc, test_new_limits);
        tcase_add_test(tc, test_validate_out_of_range);
        tcase_add_test(tc, test_validate_int64_wide);
        tcase_add_test(tc, test_validate_duplicates);
        tcase_add_test(tc, test_all_minus_one);
        tcase_add_test(tc, test_rank_magic);
        suite_add_tcase(s, tc);

        tc = tcase_create("place");
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_worked_example);
        tcase_add_loop_test(tc, test_fixed_cases, 0, 2 * NUM_FIXED);
        tcase_add_loop_test(tc, test_random_cases, 0, NUM_RANDOM);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(plan_suite());
        int failed;

        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
