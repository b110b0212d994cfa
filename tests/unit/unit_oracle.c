/* unit_oracle.c - the expected outputs of epd-bench and epd-demo (bench/oracle.c) against the
 * independent reference, and its checks catching what they must.
 *
 * Each case builds every rank's inputs from a printed seed. For every destination, the oracle's
 * expected dispatch outputs must pass the reference's bitwise check, and the oracle's own check
 * must accept them, and reject them after one byte of a data row's payload or metadata is
 * flipped (but not a byte of padding payload that is never written). Its count check must accept
 * the reference's counts and reject a changed one. For every source, the oracle's combine over
 * random y must pass the reference's combine check, and its own check must reject a flipped bit.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "oracle.h"
#include "reference.h"
#include "testdata.h"

#define MAX_R 4u

struct oc_case {
        const char *name;
        uint32_t R, E, H, T, K;
        enum epd_layout layout;
        enum epd_dtype dtype;
        uint32_t align;
        int zero_padding;
        enum epd_dtype topk_dtype;
        int has_weights;
};

static const struct oc_case cases[] = {
        { "r1_ne_bf16", 1, 8, 64, 16, 2, EPD_LAYOUT_NON_EXPAND, EPD_DTYPE_BF16, 1, 0,
          EPD_DTYPE_INT64, 1 },
        { "r2_ex_fp8_a16_zp", 2, 16, 256, 24, 4, EPD_LAYOUT_EXPAND, EPD_DTYPE_FP8_E4M3, 16, 1,
          EPD_DTYPE_INT64, 1 },
        { "r3_ex_bf16_a8_nozp", 3, 24, 128, 20, 4, EPD_LAYOUT_EXPAND, EPD_DTYPE_BF16, 8, 0,
          EPD_DTYPE_INT32, 1 },
        { "r4_ne_fp8_noweights", 4, 32, 256, 12, 8, EPD_LAYOUT_NON_EXPAND, EPD_DTYPE_FP8_E4M3, 1,
          0, EPD_DTYPE_INT32, 0 },
};

struct oc_inputs {
        uint32_t n[MAX_R];
        uint8_t *x[MAX_R];
        float *scales[MAX_R];
        void *topk[MAX_R];
        float *weights[MAX_R];
};

static void make_inputs(const struct oc_case *c, uint64_t seed, struct oc_inputs *in)
{
        const uint64_t row_bytes = (uint64_t)c->H * epd_dtype_size(c->dtype);
        const uint32_t scale_cols = c->dtype == EPD_DTYPE_FP8_E4M3 ? c->H / 128 : 0;

        memset(in, 0, sizeof(*in));
        for (uint32_t s = 0; s < c->R; s++) {
                struct td_rng rng;
                struct td_routing_args ra = {
                        .world_size = c->R, .num_experts = c->E, .num_topk = c->K,
                        .mode = TD_ROUTING_UNIFORM, .minus_one_prob = 0.1,
                        .dtype = c->topk_dtype,
                };
                /* Rank s sends T - s tokens: the sources differ in size. */
                uint32_t n = c->T - s;

                td_rng_seed(&rng, td_mix_seed(seed, s));
                in->n[s] = ra.num_tokens = n;
                in->x[s] = malloc(n * row_bytes + 1);
                in->scales[s] = malloc((size_t)n * scale_cols * 4 + 4);
                in->topk[s] = malloc((size_t)n * c->K * 8 + 8);
                in->weights[s] = malloc((size_t)n * c->K * 4 + 4);
                ck_assert(in->x[s] && in->scales[s] && in->topk[s] && in->weights[s]);
                if (c->dtype == EPD_DTYPE_BF16)
                        td_fill_bf16(&rng, in->x[s], n, c->H, 0, 0.01);
                else
                        td_fill_bytes(&rng, in->x[s], n, row_bytes, 0);
                if (scale_cols)
                        td_fill_f32(&rng, in->scales[s], n, scale_cols, 0, 0.5f, 2.0f);
                td_gen_topk(&rng, &ra, in->topk[s]);
                td_fill_f32(&rng, in->weights[s], n, c->K, 0, 0.0f, 1.0f);
        }
}

static void free_inputs(struct oc_inputs *in)
{
        for (uint32_t s = 0; s < MAX_R; s++) {
                free(in->x[s]);
                free(in->scales[s]);
                free(in->topk[s]);
                free(in->weights[s]);
        }
}

/* Flips one bit of the first byte of row r of a packed field and checks that the oracle's
 * dispatch check reports exactly that field (or accepts it, where want_reject is 0). */
static void expect_flip(const struct oracle *o, uint32_t d, struct oracle_dispatch_out *out,
                        uint8_t *field, uint64_t row_size, int64_t r, const char *name,
                        int want_reject)
{
        char msg[512] = "";
        char want[128];
        int rc;

        field[(uint64_t)r * row_size] ^= 0x10;
        rc = oracle_check_dispatch(o, d, out, msg, sizeof(msg));
        field[(uint64_t)r * row_size] ^= 0x10;
        if (!want_reject) {
                ck_assert_msg(rc == 0, "rank %u row %lld %s: a flip in unwritten padding was "
                              "reported: %s", d, (long long)r, name, msg);
                return;
        }
        snprintf(want, sizeof(want), "rank %u row %lld field %s byte 0:", d, (long long)r, name);
        ck_assert_msg(rc == 1, "rank %u row %lld %s: a flipped bit was not caught (rc %d)", d,
                      (long long)r, name, rc);
        ck_assert_msg(strstr(msg, want) != NULL, "message '%s' does not say '%s'", msg, want);
}

/* The first row of destination d that holds a selection, and the first padding row (-1: none). */
static void find_rows(const struct ref_dispatch *ref, uint32_t d, int64_t *data, int64_t *pad)
{
        *data = *pad = -1;
        for (int64_t i = 0; i < ref->dst[d].rows; i++) {
                if (*data < 0 && ref->dst[d].row_kind[i] == REF_ROW_DATA)
                        *data = i;
                if (*pad < 0 && ref->dst[d].row_kind[i] != REF_ROW_DATA)
                        *pad = i;
        }
}

START_TEST(test_oracle_case)
{
        const struct oc_case *c = &cases[_i];
        const uint64_t seed = td_mix_seed(0x0AC1Eull, (uint64_t)_i);
        const uint64_t row_bytes = (uint64_t)c->H * epd_dtype_size(c->dtype);
        const int expand = c->layout == EPD_LAYOUT_EXPAND;
        struct oracle_params op = {
                .world_size = c->R, .num_experts = c->E, .hidden = c->H, .max_tokens = c->T,
                .num_topk = c->K, .dtype = c->dtype, .topk_dtype = c->topk_dtype,
                .layout = c->layout, .expert_alignment = c->align,
                .zero_padding = c->zero_padding,
        };
        struct ref_params rp = {
                .world_size = c->R, .num_experts = c->E, .hidden = c->H, .max_tokens = c->T,
                .num_topk = c->K, .dtype = c->dtype, .topk_dtype = c->topk_dtype,
                .layout = c->layout, .expert_alignment = c->align,
                .zero_padding = c->zero_padding, .has_weights = c->has_weights,
        };
        struct oracle_src osrc[MAX_R];
        struct ref_src rsrc[MAX_R];
        struct oc_inputs in;
        struct oracle *o = NULL;
        struct ref_dispatch *ref = NULL;
        uint16_t *y[MAX_R];
        const void *yc[MAX_R];
        struct ref_buf yb[MAX_R];
        char msg[512];

        fprintf(stderr, "unit_oracle %s: seed %llu\n", c->name, (unsigned long long)seed);
        make_inputs(c, seed, &in);
        for (uint32_t s = 0; s < c->R; s++) {
                float *w = c->has_weights ? in.weights[s] : NULL;
                float *sc = c->dtype == EPD_DTYPE_FP8_E4M3 ? in.scales[s] : NULL;

                osrc[s] = (struct oracle_src){ in.n[s], in.x[s], sc, in.topk[s], w };
                rsrc[s] = (struct ref_src){ in.n[s], { in.x[s], 0 }, { sc, 0 }, { in.topk[s], 0 },
                                            { w, 0 } };
        }
        ck_assert_int_eq(oracle_new(&op, osrc, &o, msg, sizeof(msg)), 0);
        ck_assert_int_eq(ref_dispatch_new(&rp, rsrc, &ref, msg, sizeof(msg)), 0);

        for (uint32_t d = 0; d < c->R; d++) {
                const struct ref_dst *rd = &ref->dst[d];
                const uint32_t L = c->E / c->R;
                struct oracle_dispatch_out want;
                struct epd_dispatch_result dr;
                int64_t data_row, pad_row;
                int32_t saved;

                ck_assert_int_eq(oracle_rows(o, d), rd->rows);
                ck_assert_int_eq(oracle_dispatch_expected(o, d, &want), 0);
                struct ref_dispatch_actual act = {
                        .recv_x = { want.recv_x, 0 },
                        .recv_scales = { want.recv_scales, 0 },
                        .recv_topk_idx = { want.recv_topk_idx, 0 },
                        .recv_weights = { want.recv_weights, 0 },
                        .recv_src = { want.recv_src, 0 },
                        .recv_topk_slot = { want.recv_topk_slot, 0 },
                };
                ck_assert_msg(ref_check_dispatch(ref, d, &act, msg, sizeof(msg)) == 0,
                              "%s rank %u: the oracle disagrees with the reference: %s", c->name,
                              d, msg);
                ck_assert_int_eq(oracle_check_dispatch(o, d, &want, msg, sizeof(msg)), 0);

                /* Counts: the reference's pass, one changed entry does not. */
                memset(&dr, 0, sizeof(dr));
                dr.num_recv_tokens = rd->num_recv_tokens;
                dr.num_expanded_rows = rd->num_expanded_rows;
                dr.num_recv_tokens_per_expert = rd->per_expert;
                dr.num_recv_tokens_per_expert_aligned = rd->per_expert_aligned;
                dr.rank_prefix = rd->rank_prefix;
                ck_assert_msg(oracle_check_counts(o, d, &dr, msg, sizeof(msg)) == 0, "%s", msg);
                saved = rd->per_expert[L - 1];
                rd->per_expert[L - 1] = saved + 1;
                ck_assert_int_eq(oracle_check_counts(o, d, &dr, msg, sizeof(msg)), 1);
                rd->per_expert[L - 1] = saved;
                ck_assert_msg(strstr(msg, "num_recv_tokens_per_expert[") != NULL, "%s", msg);

                /* Flipped bits in a data row are caught, field by field. */
                find_rows(ref, d, &data_row, &pad_row);
                if (data_row >= 0) {
                        expect_flip(o, d, &want, want.recv_x, row_bytes, data_row, "recv_x", 1);
                        expect_flip(o, d, &want, want.recv_src, 8, data_row, "recv_src", 1);
                        if (expand)
                                expect_flip(o, d, &want, want.recv_topk_slot, 4, data_row,
                                            "recv_topk_slot", 1);
                        else
                                expect_flip(o, d, &want, want.recv_topk_idx,
                                            (uint64_t)c->K * epd_dtype_size(c->topk_dtype),
                                            data_row, "recv_topk_idx", 1);
                        if (c->has_weights)
                                expect_flip(o, d, &want, want.recv_weights,
                                            expand ? 4 : (uint64_t)c->K * 4, data_row,
                                            "recv_weights", 1);
                }
                /* Padding payload: checked (zero) with zero_padding, never written without. */
                if (pad_row >= 0)
                        expect_flip(o, d, &want, want.recv_x, row_bytes, pad_row, "recv_x",
                                    c->zero_padding);
                /* A missing required output is an error, not a pass. */
                if (rd->rows > 0) {
                        void *x = want.recv_x;
                        want.recv_x = NULL;
                        ck_assert_int_eq(oracle_check_dispatch(o, d, &want, msg, sizeof(msg)),
                                         -1);
                        want.recv_x = x;
                }
                oracle_dispatch_out_free(&want);
        }

        /* Combine over random y (padding rows hold NaN: a combine that read them would show). */
        for (uint32_t d = 0; d < c->R; d++) {
                struct td_rng rng;
                const struct ref_dst *rd = &ref->dst[d];

                td_rng_seed(&rng, td_mix_seed(seed, 100 + d));
                y[d] = calloc((size_t)rd->rows * c->H + 1, 2);
                ck_assert_ptr_nonnull(y[d]);
                td_fill_bf16(&rng, y[d], (uint64_t)rd->rows, c->H, 0, 0.0);
                for (int64_t i = 0; i < rd->rows; i++)
                        if (rd->row_kind[i] != REF_ROW_DATA)
                                for (uint32_t h = 0; h < c->H; h++)
                                        y[d][(size_t)i * c->H + h] = 0x7FC1;
                yc[d] = y[d];
                yb[d] = (struct ref_buf){ y[d], 0 };
        }
        for (uint32_t s = 0; s < c->R; s++) {
                const int apply = expand && c->has_weights;
                const uint32_t n = in.n[s];
                uint16_t *comb = calloc((size_t)n * c->H + 1, 2);
                float *cw = calloc((size_t)n * c->K + 1, 4);
                struct ref_combine_in cin = { yb, apply };
                struct ref_buf nobias[2] = { { NULL, 0 }, { NULL, 0 } };

                ck_assert(comb && cw);
                ck_assert_int_eq(oracle_combine_expected(o, s, yc, apply, comb, cw), 0);
                ck_assert_msg(ref_check_combine(ref, &cin, s, nobias, (struct ref_buf){ comb, 0 },
                                                (struct ref_buf){ c->has_weights ? cw : NULL, 0 },
                                                msg, sizeof(msg)) == 0,
                              "%s source %u: the oracle's combine disagrees with the reference: "
                              "%s", c->name, s, msg);
                ck_assert_int_eq(oracle_check_combine(o, s, yc, apply, comb, cw, msg, sizeof(msg)),
                                 0);
                if (n > 0) {
                        comb[(size_t)(n - 1) * c->H] ^= 1;
                        ck_assert_int_eq(oracle_check_combine(o, s, yc, apply, comb, cw, msg,
                                                              sizeof(msg)),
                                         1);
                        ck_assert_msg(strstr(msg, "field combined byte") != NULL, "%s", msg);
                        comb[(size_t)(n - 1) * c->H] ^= 1;
                }
                if (!expand)
                        ck_assert_int_eq(oracle_combine_expected(o, s, yc, 1, comb, cw),
                                         EPD_INVALID_ARGUMENT);
                free(comb);
                free(cw);
        }
        for (uint32_t d = 0; d < c->R; d++)
                free(y[d]);
        ref_dispatch_free(ref);
        oracle_free(o);
        free_inputs(&in);
}
END_TEST

START_TEST(test_oracle_bad_routing)
{
        int64_t topk[2] = { 3, 3 }; /* an expert repeated in a row */
        uint16_t x[16] = { 0 };
        struct oracle_params op = {
                .world_size = 1, .num_experts = 8, .hidden = 16, .max_tokens = 1, .num_topk = 2,
                .dtype = EPD_DTYPE_BF16, .topk_dtype = EPD_DTYPE_INT64,
                .layout = EPD_LAYOUT_NON_EXPAND,
        };
        struct oracle_src src = { 1, x, NULL, topk, NULL };
        struct oracle *o = NULL;
        char msg[256] = "";

        ck_assert_int_eq(oracle_new(&op, &src, &o, msg, sizeof(msg)), EPD_INVALID_ARGUMENT);
        ck_assert_ptr_null(o);
        ck_assert_msg(msg[0] != '\0', "no message");
        /* A payload dtype dispatch does not move. */
        op.dtype = EPD_DTYPE_FP32;
        ck_assert_int_eq(oracle_new(&op, &src, &o, msg, sizeof(msg)), EPD_INVALID_ARGUMENT);
        ck_assert_ptr_null(oracle_free(NULL));
}
END_TEST

static Suite *oracle_suite(void)
{
        Suite *s = suite_create("oracle");
        TCase *tc = tcase_create("oracle");

        tcase_set_timeout(tc, 60);
        tcase_add_loop_test(tc, test_oracle_case, 0, (int)(sizeof(cases) / sizeof(cases[0])));
        tcase_add_test(tc, test_oracle_bad_routing);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(oracle_suite());
        int failed;

        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? 1 : 0;
}
