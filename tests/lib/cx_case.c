/* cx_case.c - client-executed test cases (see cx_case.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cx_case.h"
#include "testdata.h"

/* Every layout and dtype at R = 1, 2, 3 and 8; fixed blocks leave room for skewed routing. */
const struct cx_case cx_cases[] = {
        /* name R E H T K dtype q layout align zp C w topk bias aw sw rw cached rounds
         * [round_scale ue8m0] */
        { "r1_ne_bf16", 1, 8, 64, 12, 2, BF16, 0, NE, 1, 0, 0, 1, I64, 1, 0, 0, 0, 0, 1, 0, 0 },
        { "r2_ne_bf16_recvw", 2, 16, 64, 20, 4, BF16, 0, NE, 1, 0, 0, 1, I32, 2, 0, 0, 1, 1,
          2, 0, 0 },
        { "r3_ex_bf16_a4_zp", 3, 24, 128, 17, 4, BF16, 0, EX, 4, 1, 0, 1, I64, 1, 1, 0, 0,
          1, 2, 0, 0 },
        { "r3_ex_fp8_nozp", 3, 24, 128, 17, 3, FP8, 0, EX, 2, 0, 0, 1, I32, 0, 1, 1, 0, 0,
          2, 0, 0 },
        { "r8_ne_fp8", 8, 32, 64, 9, 4, FP8, 0, NE, 1, 0, 0, 1, I64, 2, 0, 0, 0, 1, 2, 0, 0 },
        { "r8_ex_bf16_a2", 8, 64, 64, 7, 6, BF16, 0, EX, 2, 1, 0, 1, I32, 1, 1, 1, 0, 0, 2, 0, 0 },
        { "r2_ex_blocks", 2, 8, 64, 10, 3, BF16, 0, EX, 2, 1, 16, 1, I64, 1, 1, 0, 0, 1, 2, 0, 0 },
        { "r8_ex_blocks_nozp", 8, 16, 64, 5, 2, BF16, 0, EX, 1, 0, 20, 0, I32, 0, 1, 1, 0,
          0, 2, 0, 0 },
        { "r1_ne_quant", 1, 4, 256, 6, 2, BF16, 1, NE, 1, 0, 0, 1, I64, 1, 0, 0, 1, 0, 1, 0, 0 },
        { "r3_ne_quant", 3, 12, 256, 9, 3, BF16, 1, NE, 1, 0, 0, 0, I32, 1, 0, 0, 0, 1, 2, 0, 0 },
        { "r8_ex_quant_blocks", 8, 16, 128, 6, 2, BF16, 1, EX, 2, 1, 24, 1, I64, 2, 1, 0, 0,
          1, 1, 0, 0 },
        { "r2_ex_nowt_sw", 2, 8, 64, 8, 2, BF16, 0, EX, 1, 1, 0, 0, I32, 0, 1, 1, 0, 0, 2, 0, 0 },
        /* 2.7's round_scale and ue8m0 scales: whole 32-bit words of blocks (H = 512) and rows
         * of 3 blocks, so ue8m0 rows start at every byte offset. */
        { "r2_ne_quant_round", 2, 8, 256, 7, 2, BF16, 1, NE, 1, 0, 0, 1, I64, 1, 0, 0, 1, 1, 2,
          1, 0 },
        { "r3_ex_quant_ue8m0", 3, 12, 512, 9, 3, BF16, 1, EX, 2, 1, 0, 1, I32, 1, 1, 0, 0, 1, 2,
          1, 1 },
        { "r4_ne_quant_ue8m0_h384", 4, 16, 384, 6, 4, BF16, 1, NE, 1, 0, 0, 0, I64, 0, 0, 0, 0,
          1, 2, 1, 1 },
        { "r2_ex_quant_ue8m0_nozp", 2, 8, 384, 5, 2, BF16, 1, EX, 4, 0, 0, 1, I32, 0, 1, 1, 0, 0,
          2, 1, 1 },
};

const size_t cx_num_cases = sizeof(cx_cases) / sizeof(cx_cases[0]);

void cx_case_shape(const struct cx_case *c, struct cx_shape *shape)
{
        *shape = (struct cx_shape){
                .world_size = c->R, .num_experts = c->E, .hidden = c->H, .max_tokens = c->T,
                .max_topk = c->K, .dtype = c->dtype, .scale_block = CX_CASE_SCALE_BLOCK,
                .quantize = (uint32_t)c->quantize, .max_alignment = c->align,
                .expert_block_rows = c->block_rows,
        };
}

void cx_case_group_config(const struct cx_case *c, uint32_t op_timeout_ms,
                          struct epd_group_config *cfg)
{
        *cfg = (struct epd_group_config){
                .size = sizeof(*cfg), .world_size = c->R, .num_experts = c->E, .hidden = c->H,
                .max_tokens_per_rank = c->T, .max_topk = c->K, .dispatch_dtype = c->dtype,
                .scale_block = c->dtype == EPD_DTYPE_FP8_E4M3 ? CX_CASE_SCALE_BLOCK : 0,
                .op_timeout_ms = op_timeout_ms, .execution = EPD_EXECUTION_CLIENT,
                .max_expert_alignment = c->align, .expert_block_rows = c->block_rows,
                .quantize = (uint32_t)c->quantize,
        };
}

uint64_t cx_case_x_row_bytes(const struct cx_case *c)
{
        return (uint64_t)c->H * (c->dtype == EPD_DTYPE_BF16 ? 2 : 1);
}

uint32_t cx_case_num_scales(const struct cx_case *c)
{
        return c->dtype == EPD_DTYPE_FP8_E4M3 ? c->H / CX_CASE_SCALE_BLOCK : 0;
}

uint32_t cx_case_scale_format(const struct cx_case *c)
{
        return c->ue8m0 ? EPD_SCALE_FORMAT_UE8M0 : EPD_SCALE_FORMAT_FP32;
}

size_t cx_case_topk_size(const struct cx_case *c)
{
        return c->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
}

static int make_ref(const struct cx_case *c, struct cx_case_data *d, float **weights,
                    struct ref_dispatch **out, char *err, size_t err_len)
{
        struct ref_src src[CX_CASE_MAX_R];
        struct ref_params p = {
                .world_size = c->R, .num_experts = c->E, .hidden = c->H, .max_tokens = c->T,
                .num_topk = c->K, .dtype = c->dtype, .scale_block = CX_CASE_SCALE_BLOCK,
                .topk_dtype = c->topk_dtype, .layout = c->layout, .expert_alignment = c->align,
                .zero_padding = c->zero_padding, .has_weights = c->has_weights,
                .expert_block_rows = c->block_rows, .quantize = c->quantize,
                .round_scale = c->round_scale, .scale_ue8m0 = c->ue8m0,
        };

        for (uint32_t s = 0; s < c->R; s++)
                src[s] = (struct ref_src){
                        .num_tokens = d->n[s],
                        .x = { d->x[s], 0 },
                        .scales = { d->scales[s], 0 },
                        .topk_idx = { d->topk[s], 0 },
                        .weights = { c->has_weights ? weights[s] : NULL, 0 },
                };
        return ref_dispatch_new(&p, src, out, err, err_len) ? -1 : 0;
}

int cx_case_data_make(const struct cx_case *c, uint32_t recv_rows, uint64_t seed,
                      struct cx_case_data *d, char *err, size_t err_len)
{
        const uint32_t K = c->K, H = c->H, nsc = cx_case_num_scales(c);
        struct td_rng rng;

        memset(d, 0, sizeof(*d));
        if (c->R > CX_CASE_MAX_R) {
                snprintf(err, err_len, "%s: more than %u ranks", c->name, CX_CASE_MAX_R);
                return -1;
        }
        td_rng_seed(&rng, seed);
        for (uint32_t s = 0; s < c->R; s++) {
                uint32_t n = c->R == 1 ? c->T : c->T - (s % 3 == 2 ? c->T : s % 3);
                struct td_routing_args ra = {
                        .world_size = c->R, .num_experts = c->E, .num_tokens = n,
                        .num_topk = K, .mode = s % 2 ? TD_ROUTING_SKEWED : TD_ROUTING_UNIFORM,
                        .hot_rank = c->R - 1, .minus_one_prob = 0.1, .empty_row_prob = 0.05,
                        .dtype = c->topk_dtype,
                };

                d->n[s] = n;
                d->x[s] = malloc((size_t)c->T * cx_case_x_row_bytes(c) + 16);
                d->scales[s] = malloc((size_t)c->T * nsc * 4 + 16);
                d->topk[s] = malloc((size_t)c->T * K * cx_case_topk_size(c) + 16);
                d->weights[s] = malloc((size_t)c->T * K * 4 + 16);
                d->weights2[s] = malloc((size_t)c->T * K * 4 + 16);
                d->sw[s] = malloc((size_t)c->T * K * 4 + 16);
                for (int b = 0; b < 2; b++)
                        d->bias[s][b] = malloc((size_t)c->T * H * 2 + 16);
                if (!d->x[s] || !d->scales[s] || !d->topk[s] || !d->weights[s] ||
                    !d->weights2[s] || !d->sw[s] || !d->bias[s][0] || !d->bias[s][1]) {
                        snprintf(err, err_len, "out of memory");
                        return -1;
                }
                if (c->dtype == EPD_DTYPE_BF16)
                        td_fill_bf16(&rng, d->x[s], n, H, 0, 0.01);
                else
                        td_fill_bytes(&rng, d->x[s], n, H, 0);
                td_fill_f32(&rng, d->scales[s], n, nsc, 0, 0.01f, 4.0f);
                td_gen_topk(&rng, &ra, d->topk[s]);
                td_fill_f32(&rng, d->weights[s], n, K, 0, -1.0f, 1.0f);
                td_fill_f32(&rng, d->weights2[s], n, K, 0, -1.0f, 1.0f);
                td_fill_f32(&rng, d->sw[s], n, K, 0, -1.0f, 1.0f);
                for (int b = 0; b < 2; b++)
                        td_fill_bf16(&rng, d->bias[s][b], n, H, 0, 0.0);
        }
        if (make_ref(c, d, d->weights, &d->ref, err, err_len) ||
            (c->cached && make_ref(c, d, d->weights2, &d->ref2, err, err_len)))
                return -1;
        for (uint32_t r = 0; r < c->R; r++) {
                const struct ref_dst *dst = &d->ref->dst[r];

                d->y[r] = malloc((size_t)recv_rows * H * 2 + 16);
                d->yw[r] = malloc((size_t)recv_rows * K * 4 + 16);
                if (!d->y[r] || !d->yw[r]) {
                        snprintf(err, err_len, "out of memory");
                        return -1;
                }
                td_fill_bf16(&rng, d->y[r], recv_rows, H, 0, 0.01);
                td_fill_f32(&rng, d->yw[r], recv_rows, K, 0, -2.0f, 2.0f);
                /* A round that overfills recv_rows (a capacity test) pads what fits. */
                for (int64_t i = 0; i < dst->rows && i < (int64_t)recv_rows; i++)
                        if (dst->row_kind[i] != REF_ROW_DATA)
                                for (uint32_t h = 0; h < H; h++)
                                        d->y[r][(size_t)i * H + h] = 0x7FC0;
        }
        return 0;
}

uint32_t cx_case_rows_needed(const struct cx_case *c, uint64_t seed)
{
        struct cx_shape shape;
        struct cx_layout l;
        struct cx_case_data d;
        uint32_t need = 0;
        char err[256];

        memset(&d, 0, sizeof(d));
        cx_case_shape(c, &shape);
        if (cx_layout_compute(&shape, &l) == CX_SHAPE_OK &&
            cx_case_data_make(c, l.recv_rows, seed, &d, err, sizeof(err)) == 0)
                for (uint32_t r = 0; r < c->R; r++)
                        if (d.ref->dst[r].rows > (int64_t)need)
                                need = (uint32_t)d.ref->dst[r].rows;
        cx_case_data_free(c, &d);
        return need;
}

void cx_case_data_free(const struct cx_case *c, struct cx_case_data *d)
{
        for (uint32_t s = 0; s < c->R && s < CX_CASE_MAX_R; s++) {
                free(d->x[s]);
                free(d->scales[s]);
                free(d->topk[s]);
                free(d->weights[s]);
                free(d->weights2[s]);
                free(d->sw[s]);
                free(d->bias[s][0]);
                free(d->bias[s][1]);
                free(d->y[s]);
                free(d->yw[s]);
        }
        d->ref = ref_dispatch_free(d->ref);
        d->ref2 = ref_dispatch_free(d->ref2);
}

int cx_case_check_dispatch(const struct cx_case *c, const struct cx_layout *l, const uint8_t *own,
                           uint32_t handle, const uint8_t *recv_base,
                           const struct ref_dispatch *ref, uint32_t d, char *msg, size_t msg_len)
{
        const int expand = c->layout == EPD_LAYOUT_EXPAND;
        struct ref_dispatch_actual act = {
                .recv_x = { recv_base + l->recv_x, 0 },
                .recv_scales = { recv_base + l->recv_scales, 0 },
                .recv_topk_idx = { recv_base + l->recv_topk_idx, c->K * cx_case_topk_size(c) },
                .recv_weights = { recv_base + l->recv_weights, expand ? 4 : (uint64_t)c->K * 4 },
                .recv_src = { recv_base + l->recv_src, 8 },
                .recv_topk_slot = { recv_base + l->recv_topk_slot, 4 },
        };

        if (own) {
                uint8_t *base = (uint8_t *)own;
                const struct cx_handle *h = cx_handle_at(base, l, handle);
                struct ref_counts_actual counts = {
                        .num_recv_tokens = h->num_recv_tokens,
                        .num_expanded_rows = h->num_expanded_rows,
                        .per_expert = cx_handle_i32(base, l, handle, l->h_per_expert),
                        .per_expert_aligned = cx_handle_i32(base, l, handle,
                                                            l->h_per_expert_aligned),
                        .rank_prefix = cx_handle_i32(base, l, handle, l->h_rank_prefix),
                };

                const int32_t *matrix = cx_handle_i32(base, l, handle, l->h_rank_matrix);

                if (ref_check_counts(ref, d, &counts, msg, msg_len))
                        return 1;
                /* Every rank's counts: [s][e] the tokens of sources 0..s sent to rank e. */
                for (uint32_t s = 0; s < c->R; s++)
                        for (uint32_t e = 0; e < c->R; e++)
                                if (matrix[s * c->R + e] != ref->dst[e].rank_prefix[s + 1]) {
                                        snprintf(msg, msg_len,
                                                 "rank prefix matrix [%u][%u] is %d, not %d", s,
                                                 e, matrix[s * c->R + e],
                                                 ref->dst[e].rank_prefix[s + 1]);
                                        return 1;
                                }
        }
        return ref_check_dispatch(ref, d, &act, msg, msg_len) ? 1 : 0;
}

int cx_case_check_combine(const struct cx_case *c, const struct cx_case_data *data,
                          const struct ref_dispatch *ref, uint32_t s, const uint16_t *combined,
                          const float *cw, char *msg, size_t msg_len)
{
        struct ref_buf y[CX_CASE_MAX_R], sw[CX_CASE_MAX_R], rw[CX_CASE_MAX_R], bias[2];
        struct ref_combine_in cin = { .y = y, .apply_weights = c->apply_weights };
        struct ref_combine_weights w = {
                .source_weights = c->source_weights ? sw : NULL,
                .recv_weights = c->recv_weights ? rw : NULL,
        };

        for (uint32_t d = 0; d < c->R; d++) {
                y[d] = (struct ref_buf){ data->y[d], 0 };
                sw[d] = (struct ref_buf){ data->sw[d], 0 };
                rw[d] = (struct ref_buf){ data->yw[d], 0 };
        }
        for (int b = 0; b < 2; b++)
                bias[b] = (struct ref_buf){ b < c->nbias ? data->bias[s][b] : NULL, 0 };
        return ref_check_combine_w(ref, &cin, &w, s, bias, (struct ref_buf){ combined, 0 },
                                   (struct ref_buf){ (c->has_weights || c->recv_weights)
                                                             ? cw
                                                             : NULL,
                                                     0 },
                                   msg, msg_len)
                       ? 1
                       : 0;
}
