/* unit_exec.c - host dispatch/combine (cpu/exec.c) bitwise against the reference.
 *
 * Each case builds every rank's inputs from a printed seed, plans with cpu/plan.c, runs every
 * dispatch item (forward, reverse, shuffled or from two threads), compares every destination with
 * the independent reference, then fills y on every destination, runs every combine item the same
 * way and compares every source's combined rows and weights. Outputs are poisoned beforehand, so
 * the test also catches writes outside a row, into stride gaps, past the last row, or into padding
 * payload that must stay unwritten without zero_padding. Padding rows of y hold NaN, so a combine
 * that read them would change the result.
 *
 * A second test case pins the bf16 helpers of common/bf16.h (RNE, NaN -> 0x7FFF, infinities) to
 * the reference's own conversion.
 */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exec.h"
#include "plan.h"
#include "reference.h"
#include "testdata.h"

#define POISON 0xA5u
#define EXTRA_ROWS 2u
#define MAX_R 8u

enum tokens_mode { TOK_FULL, TOK_MINUS_R, TOK_ZERO_SOME, TOK_ALL_ZERO };
enum run_order { ORDER_FORWARD, ORDER_REVERSE, ORDER_SHUFFLED, ORDER_THREADS };

struct hx_case {
        const char *name;
        uint32_t R, E, H, T, K;
        enum tokens_mode tokens;
        enum td_routing routing;
        double neg, empty;          /* -1 probabilities per entry and per row */
        enum epd_layout layout;
        enum epd_dtype dtype;
        uint32_t scale_block;       /* fp8 */
        uint32_t align;
        int zero_padding;
        int nbias;                  /* 0, 1, 2, or 3: rank s has s % 3 biases */
        int has_weights;
        int apply_weights;          /* used only with EXPAND and weights */
        int want_cw;                /* request combined_topk_weights (with weights) */
        enum epd_dtype topk_dtype;
        int strided;                /* gaps between rows of inputs and outputs */
        enum run_order order;
        double special;             /* bf16 specials in x/y/bias, and special weights */
        /* docs/semantics.md §3's weight inputs of combine: source_weights 1 on every source,
         * 2 on even sources only (w(t, k) of apply_weights, also without dispatch weights);
         * recv_weights on every destination (NON_EXPAND: combined_topk_weights is their
         * reduction). */
        int source_weights;
        int recv_weights;
};

#define BF16 EPD_DTYPE_BF16
#define FP8 EPD_DTYPE_FP8_E4M3
#define I32 EPD_DTYPE_INT32
#define I64 EPD_DTYPE_INT64
#define NE EPD_LAYOUT_NON_EXPAND
#define EX EPD_LAYOUT_EXPAND

static const struct hx_case fixed_cases[] = {
        { "r1_basic", 1, 8, 64, 16, 2, TOK_FULL, TD_ROUTING_UNIFORM, 0, 0, NE, BF16, 0, 1, 0, 0,
          0, 0, 0, I64, 0, ORDER_FORWARD, 0, 0, 0 },
        { "r1_expand", 1, 8, 64, 16, 2, TOK_FULL, TD_ROUTING_UNIFORM, 0.1, 0, EX, BF16, 0, 3, 0,
          1, 1, 1, 1, I32, 0, ORDER_REVERSE, 0, 0, 0 },
        { "r2_ex_fp8_a128_zp", 2, 16, 256, 40, 8, TOK_MINUS_R, TD_ROUTING_SKEWED, 0.1, 0, EX, FP8,
          128, 128, 1, 2, 1, 1, 1, I64, 1, ORDER_SHUFFLED, 0, 0, 0 },
        { "r3_e48_ne_strided", 3, 48, 128, 50, 8, TOK_FULL, TD_ROUTING_UNIFORM, 0.2, 0.1, NE,
          BF16, 0, 1, 0, 1, 1, 0, 1, I32, 1, ORDER_THREADS, 0.02, 0, 0 },
        { "r3_e48_ex_a128_nozp", 3, 48, 128, 50, 8, TOK_MINUS_R, TD_ROUTING_UNIFORM, 0, 0, EX,
          BF16, 0, 128, 0, 3, 1, 1, 1, I32, 1, ORDER_REVERSE, 0, 0, 0 },
        { "r3_e48_ex_fp8_onerank", 3, 48, 256, 30, 2, TOK_ZERO_SOME, TD_ROUTING_ONE_RANK, 0.2, 0,
          EX, FP8, 64, 4, 1, 1, 1, 1, 1, I64, 1, ORDER_THREADS, 0, 0, 0 },
        { "r4_k1_ne", 4, 32, 64, 33, 1, TOK_ZERO_SOME, TD_ROUTING_UNIFORM, 0.3, 0, NE, BF16, 0, 1,
          0, 0, 1, 0, 1, I64, 0, ORDER_FORWARD, 0, 0, 0 },
        { "r4_k1_ex", 4, 32, 64, 33, 1, TOK_ZERO_SOME, TD_ROUTING_UNIFORM, 0.3, 0, EX, BF16, 0, 4,
          1, 1, 1, 1, 1, I32, 1, ORDER_SHUFFLED, 0, 0, 0 },
        { "r4_k2_ex_noweights", 4, 16, 64, 20, 2, TOK_MINUS_R, TD_ROUTING_SKEWED, 0.1, 0, EX, BF16,
          0, 1, 0, 1, 0, 0, 0, I64, 0, ORDER_THREADS, 0, 0, 0 },
        { "r4_k32", 4, 64, 64, 24, 32, TOK_FULL, TD_ROUTING_UNIFORM, 0.1, 0.05, EX, BF16, 0, 2, 1,
          2, 1, 1, 1, I32, 1, ORDER_SHUFFLED, 0, 0, 0 },
        { "r4_k32_ne", 4, 64, 64, 24, 32, TOK_FULL, TD_ROUTING_UNIFORM, 0.1, 0.05, NE, FP8, 32, 1,
          0, 2, 1, 0, 1, I64, 1, ORDER_THREADS, 0, 0, 0 },
        { "r4_all_zero_tokens", 4, 16, 64, 8, 2, TOK_ALL_ZERO, TD_ROUTING_UNIFORM, 0, 0, EX, BF16,
          0, 128, 1, 2, 1, 1, 1, I64, 0, ORDER_FORWARD, 0, 0, 0 },
        { "r8_onerank_ex_fp8", 8, 64, 64, 20, 8, TOK_MINUS_R, TD_ROUTING_ONE_RANK, 0, 0, EX, FP8,
          32, 1, 0, 2, 1, 1, 1, I64, 0, ORDER_THREADS, 0, 0, 0 },
        { "r8_onerank_ne", 8, 64, 64, 20, 8, TOK_MINUS_R, TD_ROUTING_ONE_RANK, 0.2, 0, NE, BF16, 0,
          1, 0, 1, 1, 0, 1, I32, 1, ORDER_THREADS, 0, 0, 0 },
        { "r8_skewed_ne_fp8", 8, 256, 128, 64, 8, TOK_FULL, TD_ROUTING_SKEWED, 0, 0, NE, FP8, 128,
          1, 0, 3, 1, 0, 1, I32, 1, ORDER_SHUFFLED, 0, 0, 0 },
        { "r8_skewed_ex_a128", 8, 256, 128, 64, 8, TOK_FULL, TD_ROUTING_SKEWED, 0, 0, EX, BF16, 0,
          128, 0, 2, 1, 1, 1, I64, 0, ORDER_THREADS, 0, 0, 0 },
        { "r2_empty_rows", 2, 8, 64, 40, 2, TOK_FULL, TD_ROUTING_UNIFORM, 0.5, 0.5, EX, BF16, 0, 2,
          1, 2, 1, 1, 1, I64, 1, ORDER_FORWARD, 0.05, 0, 0 },
        { "r2_specials_ne", 2, 8, 64, 40, 8, TOK_FULL, TD_ROUTING_UNIFORM, 0, 0, NE, BF16, 0, 1,
          0, 2, 1, 0, 1, I32, 0, ORDER_REVERSE, 0.1, 0, 0 },
        { "r2_specials_ex", 2, 8, 64, 40, 8, TOK_FULL, TD_ROUTING_UNIFORM, 0.1, 0, EX, BF16, 0, 1,
          0, 2, 1, 1, 1, I32, 1, ORDER_THREADS, 0.1, 0, 0 },
        { "r2_wide_h_ne", 2, 4, 4104, 20, 2, TOK_FULL, TD_ROUTING_UNIFORM, 0, 0, NE, BF16, 0, 1, 0,
          1, 1, 0, 1, I64, 1, ORDER_FORWARD, 0.01, 0, 0 },
        { "r2_wide_h_ex", 2, 4, 4104, 20, 2, TOK_MINUS_R, TD_ROUTING_UNIFORM, 0, 0, EX, BF16, 0, 8,
          0, 2, 1, 1, 1, I32, 0, ORDER_THREADS, 0, 0, 0 },
        /* The weight inputs of combine: recv_weights (NON_EXPAND, with and without dispatch
         * weights), source_weights with apply_weights (EXPAND, with and without). */
        { "r4_ne_recv_weights_fp8", 4, 32, 128, 33, 8, TOK_ZERO_SOME, TD_ROUTING_SKEWED, 0.2, 0.1,
          NE, FP8, 64, 1, 0, 2, 1, 0, 1, I64, 1, ORDER_THREADS, 0.05, 0, 1 },
        { "r3_e48_ne_recv_weights_noweights", 3, 48, 64, 40, 8, TOK_FULL, TD_ROUTING_UNIFORM, 0.3,
          0, NE, BF16, 0, 1, 0, 1, 0, 0, 1, I32, 0, ORDER_SHUFFLED, 0, 0, 1 },
        { "r4_ex_source_weights", 4, 16, 128, 30, 4, TOK_MINUS_R, TD_ROUTING_UNIFORM, 0.1, 0, EX,
          BF16, 0, 4, 1, 2, 1, 1, 1, I32, 1, ORDER_REVERSE, 0.05, 1, 0 },
        { "r3_e48_ex_source_weights_even_ranks", 3, 48, 64, 30, 8, TOK_FULL, TD_ROUTING_SKEWED,
          0.1, 0, EX, BF16, 0, 1, 0, 1, 1, 1, 1, I64, 0, ORDER_THREADS, 0, 2, 0 },
        { "r2_ex_fp8_source_weights_noweights", 2, 16, 256, 40, 8, TOK_FULL, TD_ROUTING_SKEWED,
          0.1, 0, EX, FP8, 128, 2, 0, 1, 0, 1, 1, I64, 1, ORDER_THREADS, 0.05, 1, 0 },
        /* At the benchmark's row size, T >= 512, both layouts. */
        { "big_ne_bf16", 4, 32, 7168, 512, 8, TOK_MINUS_R, TD_ROUTING_UNIFORM, 0.02, 0, NE, BF16,
          0, 1, 0, 1, 1, 0, 1, I64, 1, ORDER_THREADS, 0, 0, 0 },
        { "big_ne_fp8", 2, 16, 7168, 512, 8, TOK_FULL, TD_ROUTING_SKEWED, 0, 0, NE, FP8, 128, 1,
          0, 2, 1, 0, 1, I32, 0, ORDER_SHUFFLED, 0, 0, 0 },
        { "big_ex_fp8_a128_zp", 2, 16, 7168, 512, 8, TOK_FULL, TD_ROUTING_UNIFORM, 0, 0, EX, FP8,
          128, 128, 1, 2, 1, 1, 1, I32, 0, ORDER_THREADS, 0, 0, 0 },
        { "big_ex_bf16", 2, 16, 7168, 512, 8, TOK_MINUS_R, TD_ROUTING_SKEWED, 0.05, 0, EX, BF16, 0,
          1, 0, 0, 1, 1, 0, I64, 1, ORDER_REVERSE, 0, 0, 0 },
};
#define NUM_FIXED (int)(sizeof(fixed_cases) / sizeof(fixed_cases[0]))
#define NUM_RANDOM 150
#define BASE_SEED 0x40E7E5EEDull

/* ---- strided test buffers ---- */

struct tbuf {
        uint8_t *ptr;
        uint64_t rows;       /* rows in use */
        uint64_t alloc_rows; /* rows allocated (outputs have EXTRA_ROWS more) */
        uint64_t row_bytes;
        uint64_t stride;
};

static void tbuf_alloc(struct tbuf *b, uint64_t rows, uint64_t extra, uint64_t row_bytes,
                       uint64_t gap)
{
        b->rows = rows;
        b->alloc_rows = rows + extra;
        b->row_bytes = row_bytes;
        b->stride = row_bytes + gap;
        b->ptr = malloc(b->alloc_rows * b->stride + 1);
        ck_assert_ptr_nonnull(b->ptr);
        memset(b->ptr, POISON, b->alloc_rows * b->stride + 1);
}

static void tbuf_free(struct tbuf *b)
{
        free(b->ptr);
        memset(b, 0, sizeof(*b));
}

static struct epd_mat tbuf_mat(const struct tbuf *b)
{
        return (struct epd_mat){ b->ptr, b->stride };
}

static struct ref_buf tbuf_ref(const struct tbuf *b)
{
        return (struct ref_buf){ b->ptr, b->stride };
}

static int all_poison(const uint8_t *p, uint64_t n)
{
        for (uint64_t i = 0; i < n; i++)
                if (p[i] != POISON)
                        return 0;
        return 1;
}

/* The bytes no one may write: the gap after each row and every row past those in use. */
static void check_untouched(const struct tbuf *b, const char *what, uint32_t rank)
{
        if (!b->ptr)
                return;
        for (uint64_t r = 0; r < b->alloc_rows; r++) {
                const uint8_t *row = b->ptr + r * b->stride;

                if (r >= b->rows)
                        ck_assert_msg(all_poison(row, b->stride),
                                      "rank %u %s: row %" PRIu64 " past the end was written",
                                      rank, what, r);
                else
                        ck_assert_msg(all_poison(row + b->row_bytes, b->stride - b->row_bytes),
                                      "rank %u %s: stride gap of row %" PRIu64 " was written",
                                      rank, what, r);
        }
}

/* ---- running items ---- */

typedef void (*item_fn)(const void *op, uint64_t item);

struct worker {
        item_fn fn;
        const void *op;
        uint64_t count;
        atomic_uint_fast64_t *next;
};

static void *worker_main(void *arg)
{
        struct worker *w = arg;

        for (;;) {
                uint64_t i = atomic_fetch_add(w->next, 1);
                if (i >= w->count)
                        break;
                w->fn(w->op, i);
        }
        return NULL;
}

static void dispatch_item(const void *op, uint64_t item)
{
        epd_host_dispatch_item(op, item);
}

static void combine_item(const void *op, uint64_t item)
{
        epd_host_combine_item(op, item);
}

static void run_items(item_fn fn, const void *op, uint64_t count, enum run_order order,
                      struct td_rng *rng)
{
        switch (order) {
        case ORDER_FORWARD:
                for (uint64_t i = 0; i < count; i++)
                        fn(op, i);
                break;
        case ORDER_REVERSE:
                for (uint64_t i = count; i-- > 0;)
                        fn(op, i);
                break;
        case ORDER_SHUFFLED: {
                uint64_t *perm = malloc((count + 1) * sizeof(*perm));

                ck_assert_ptr_nonnull(perm);
                for (uint64_t i = 0; i < count; i++)
                        perm[i] = i;
                for (uint64_t i = count; i > 1; i--) {
                        uint64_t j = td_rng_next(rng) % i, tmp = perm[i - 1];
                        perm[i - 1] = perm[j];
                        perm[j] = tmp;
                }
                for (uint64_t i = 0; i < count; i++)
                        fn(op, perm[i]);
                free(perm);
                break;
        }
        case ORDER_THREADS: {
                atomic_uint_fast64_t next = 0;
                struct worker w = { fn, op, count, &next };
                pthread_t th[2];

                for (int i = 0; i < 2; i++)
                        ck_assert_int_eq(pthread_create(&th[i], NULL, worker_main, &w), 0);
                for (int i = 0; i < 2; i++)
                        pthread_join(th[i], NULL);
                break;
        }
        }
}

/* ---- one case ---- */

struct src_bufs {
        uint32_t n;
        struct tbuf x, scales, topk, weights, bias[2], combined, cw, sw;
        float *weights_dense;
};

struct dst_bufs {
        struct tbuf recv_x, recv_scales, recv_topk_idx, recv_weights, recv_src, recv_topk_slot;
        struct tbuf y, rw;
};

static uint32_t tokens_of(const struct hx_case *c, uint32_t s)
{
        switch (c->tokens) {
        case TOK_FULL:
                return c->T;
        case TOK_MINUS_R:
                return c->T > s ? c->T - s : 0;
        case TOK_ZERO_SOME:
                return s % 2 ? 0 : c->T;
        case TOK_ALL_ZERO:
                return 0;
        }
        return 0;
}

/* Turns some weights into specials; they are moved as bits and, with apply_weights, multiplied. */
static void special_weights(struct td_rng *rng, struct tbuf *w, uint32_t K, double prob)
{
        static const uint32_t specials[] = { 0x7FC00000u, 0x7F800000u, 0xFF800000u, 0x80000000u,
                                             0x00000001u, 0x7F7FFFFFu };

        for (uint64_t r = 0; r < w->rows; r++)
                for (uint32_t k = 0; k < K; k++)
                        if (td_rng_unit(rng) < prob)
                                memcpy(w->ptr + r * w->stride + k * 4,
                                       &specials[td_rng_below(rng, 6)], 4);
}

static void run_case(const struct hx_case *c, uint64_t seed)
{
        const uint32_t R = c->R, K = c->K, H = c->H;
        const int expand = c->layout == EPD_LAYOUT_EXPAND;
        const int fp8 = c->dtype == EPD_DTYPE_FP8_E4M3;
        const uint32_t scale_block = fp8 ? c->scale_block : 0;
        const uint64_t row_bytes = fp8 ? H : (uint64_t)H * 2;
        const uint64_t scale_bytes = fp8 ? (uint64_t)(H / scale_block) * 4 : 0;
        const size_t esz = c->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        const int apply = c->apply_weights && expand && (c->has_weights || c->source_weights);
        const int recv_w = c->recv_weights && !expand;
        const int want_cw = c->want_cw && (c->has_weights || recv_w);
        const uint64_t g = c->strided ? 1 : 0; /* gap multiplier */
        struct src_bufs sb[MAX_R];
        struct dst_bufs db[MAX_R];
        struct epd_dispatch_src_io sio[MAX_R];
        struct epd_dispatch_dst_io dio[MAX_R];
        struct epd_combine_src_io cio[MAX_R];
        struct epd_mat ymat[MAX_R];
        struct ref_buf yref[MAX_R], swref[MAX_R], rwref[MAX_R];
        struct epd_mat rwmat[MAX_R];
        struct ref_src rsrc[MAX_R];
        uint32_t num_tokens[MAX_R];
        struct ref_dispatch *ref = NULL;
        struct epd_plan *plan;
        struct td_rng rng;
        char msg[512];

        ck_assert_uint_le(R, MAX_R);
        printf("exec case %s: R=%u E=%u H=%u T=%u K=%u layout=%s dtype=%s align=%u zp=%d "
               "bias=%d weights=%d apply=%d source_weights=%d recv_weights=%d topk=%s strided=%d "
               "order=%d seed=0x%016" PRIx64 "\n",
               c->name, R, c->E, H, c->T, K, expand ? "EXPAND" : "NON_EXPAND",
               fp8 ? "fp8" : "bf16", c->align, c->zero_padding, c->nbias, c->has_weights, apply,
               c->source_weights, recv_w, esz == 8 ? "int64" : "int32", c->strided, (int)c->order, seed);
        fflush(stdout);
        td_rng_seed(&rng, seed);
        memset(sb, 0, sizeof(sb));
        memset(db, 0, sizeof(db));

        /* Inputs of every source. */
        for (uint32_t s = 0; s < R; s++) {
                struct src_bufs *b = &sb[s];
                struct td_routing_args ra = {
                        .world_size = R, .num_experts = c->E, .num_topk = K, .mode = c->routing,
                        .hot_rank = (uint32_t)(seed % R), .minus_one_prob = c->neg,
                        .empty_row_prob = c->empty, .dtype = c->topk_dtype,
                        .row_stride = K + 3 * g,
                };
                int nbias = c->nbias == 3 ? (int)(s % 3) : c->nbias;

                b->n = num_tokens[s] = tokens_of(c, s);
                ra.num_tokens = b->n;
                tbuf_alloc(&b->x, b->n, 0, row_bytes, 48 * g);
                if (fp8)
                        td_fill_bytes(&rng, b->x.ptr, b->n, row_bytes, b->x.stride);
                else
                        td_fill_bf16(&rng, b->x.ptr, b->n, H, b->x.stride, c->special);
                if (fp8) {
                        tbuf_alloc(&b->scales, b->n, 0, scale_bytes, 12 * g);
                        td_fill_f32(&rng, b->scales.ptr, b->n, H / scale_block, b->scales.stride,
                                    0.001f, 4.0f);
                }
                tbuf_alloc(&b->topk, b->n, 0, K * esz, 3 * g * esz);
                td_gen_topk(&rng, &ra, b->topk.ptr);
                if (c->has_weights) {
                        tbuf_alloc(&b->weights, b->n, 0, (uint64_t)K * 4, 4 * g);
                        td_fill_f32(&rng, b->weights.ptr, b->n, K, b->weights.stride, -0.5f, 1.5f);
                        if (c->special > 0)
                                special_weights(&rng, &b->weights, K, c->special);
                        b->weights_dense = malloc((size_t)b->n * K * 4 + 4);
                        ck_assert_ptr_nonnull(b->weights_dense);
                        for (uint32_t t = 0; t < b->n; t++)
                                memcpy(b->weights_dense + (size_t)t * K,
                                       b->weights.ptr + t * b->weights.stride, (size_t)K * 4);
                }
                for (int i = 0; i < nbias; i++) {
                        tbuf_alloc(&b->bias[i], b->n, 0, (uint64_t)H * 2, 32 * g);
                        td_fill_bf16(&rng, b->bias[i].ptr, b->n, H, b->bias[i].stride,
                                     c->special);
                }
                sio[s] = (struct epd_dispatch_src_io){ tbuf_mat(&b->x), tbuf_mat(&b->scales),
                                                       tbuf_mat(&b->weights) };
                rsrc[s] = (struct ref_src){ .num_tokens = b->n, .x = tbuf_ref(&b->x),
                                            .scales = tbuf_ref(&b->scales),
                                            .topk_idx = tbuf_ref(&b->topk),
                                            .weights = tbuf_ref(&b->weights) };
        }

        /* The reference and the plan. */
        struct ref_params rp = {
                .world_size = R, .num_experts = c->E, .hidden = H, .max_tokens = c->T,
                .num_topk = K, .dtype = c->dtype, .scale_block = scale_block,
                .topk_dtype = c->topk_dtype, .layout = c->layout, .expert_alignment = c->align,
                .zero_padding = c->zero_padding, .has_weights = c->has_weights,
        };
        ck_assert_msg(ref_dispatch_new(&rp, rsrc, &ref, msg, sizeof(msg)) == 0, "%s", msg);
        plan = epd_plan_new(R, c->E, c->T, K, c->align, c->layout, num_tokens);
        ck_assert_ptr_nonnull(plan);
        for (uint32_t s = 0; s < R; s++)
                ck_assert_msg(epd_plan_count_source(plan, s, sb[s].topk.ptr, c->topk_dtype,
                                                    K + 3 * g, msg, sizeof(msg)) == 0, "%s", msg);
        epd_plan_finish(plan);
        for (uint32_t s = 0; s < R; s++)
                epd_plan_place_source(plan, s);

        /* Dispatch outputs, poisoned. */
        for (uint32_t d = 0; d < R; d++) {
                struct dst_bufs *b = &db[d];
                uint64_t rows = (uint64_t)epd_plan_rows(plan, d);

                ck_assert_int_eq((int64_t)rows, ref->dst[d].rows);
                tbuf_alloc(&b->recv_x, rows, EXTRA_ROWS, row_bytes, 32 * g);
                if (fp8)
                        tbuf_alloc(&b->recv_scales, rows, EXTRA_ROWS, scale_bytes, 4 * g);
                if (!expand)
                        tbuf_alloc(&b->recv_topk_idx, rows, EXTRA_ROWS, K * esz, esz * g);
                if (c->has_weights)
                        tbuf_alloc(&b->recv_weights, rows, EXTRA_ROWS, expand ? 4 : (uint64_t)K * 4,
                                   4 * g);
                tbuf_alloc(&b->recv_src, rows, EXTRA_ROWS, 8, 8 * g);
                if (expand)
                        tbuf_alloc(&b->recv_topk_slot, rows, EXTRA_ROWS, 4, 4 * g);
                dio[d] = (struct epd_dispatch_dst_io){
                        tbuf_mat(&b->recv_x), tbuf_mat(&b->recv_scales),
                        tbuf_mat(&b->recv_topk_idx), tbuf_mat(&b->recv_weights),
                        tbuf_mat(&b->recv_src), tbuf_mat(&b->recv_topk_slot),
                };
        }
        struct epd_dispatch_exec dop = {
                .plan = plan, .row_bytes = row_bytes, .scale_bytes = scale_bytes,
                .topk_dtype = c->topk_dtype, .has_weights = c->has_weights,
                .zero_padding = c->zero_padding, .src = sio, .dst = dio,
        };
        run_items(dispatch_item, &dop, epd_host_dispatch_items(&dop), c->order, &rng);

        for (uint32_t d = 0; d < R; d++) {
                struct dst_bufs *b = &db[d];
                const struct ref_dst *rd = &ref->dst[d];
                struct ref_dispatch_actual act = {
                        tbuf_ref(&b->recv_x), tbuf_ref(&b->recv_scales),
                        tbuf_ref(&b->recv_topk_idx), tbuf_ref(&b->recv_weights),
                        tbuf_ref(&b->recv_src), tbuf_ref(&b->recv_topk_slot),
                };

                ck_assert_msg(ref_check_dispatch(ref, d, &act, msg, sizeof(msg)) == 0,
                              "case %s seed 0x%016" PRIx64 ": %s", c->name, seed, msg);
                check_untouched(&b->recv_x, "recv_x", d);
                check_untouched(&b->recv_scales, "recv_scales", d);
                check_untouched(&b->recv_topk_idx, "recv_topk_idx", d);
                check_untouched(&b->recv_weights, "recv_weights", d);
                check_untouched(&b->recv_src, "recv_src", d);
                check_untouched(&b->recv_topk_slot, "recv_topk_slot", d);
                /* Without zero_padding the padding payload is "not written": still poison. */
                for (int64_t i = 0; i < rd->rows; i++) {
                        if (rd->row_kind[i] != REF_ROW_PAD_UNWRITTEN)
                                continue;
                        ck_assert_msg(all_poison(b->recv_x.ptr + i * b->recv_x.stride, row_bytes),
                                      "rank %u padding row %" PRId64 " recv_x written", d, i);
                        if (fp8)
                                ck_assert(all_poison(b->recv_scales.ptr + i * b->recv_scales.stride,
                                                     scale_bytes));
                        if (c->has_weights)
                                ck_assert(all_poison(b->recv_weights.ptr +
                                                     i * b->recv_weights.stride, 4));
                }
        }

        /* Combine: y on every destination in the dispatch's layout; padding rows hold NaN. */
        for (uint32_t d = 0; d < R; d++) {
                struct dst_bufs *b = &db[d];
                const struct ref_dst *rd = &ref->dst[d];
                const uint16_t nan = 0x7FC1;

                tbuf_alloc(&b->y, (uint64_t)rd->rows, 0, (uint64_t)H * 2, 16 * g);
                td_fill_bf16(&rng, b->y.ptr, b->y.rows, H, b->y.stride, c->special);
                for (int64_t i = 0; i < rd->rows; i++)
                        if (rd->row_kind[i] != REF_ROW_DATA)
                                for (uint32_t h = 0; h < H; h++)
                                        memcpy(b->y.ptr + i * b->y.stride + h * 2, &nan, 2);
                ymat[d] = tbuf_mat(&b->y);
                yref[d] = tbuf_ref(&b->y);
                if (recv_w) {
                        tbuf_alloc(&b->rw, (uint64_t)rd->rows, 0, (uint64_t)K * 4, 4 * g);
                        td_fill_f32(&rng, b->rw.ptr, b->rw.rows, K, b->rw.stride, -0.5f, 1.5f);
                        if (c->special > 0)
                                special_weights(&rng, &b->rw, K, c->special);
                }
                rwmat[d] = tbuf_mat(&b->rw);
                rwref[d] = tbuf_ref(&b->rw);
        }
        for (uint32_t s = 0; s < R; s++) {
                struct src_bufs *b = &sb[s];

                tbuf_alloc(&b->combined, b->n, EXTRA_ROWS, (uint64_t)H * 2, 64 * g);
                if (want_cw)
                        tbuf_alloc(&b->cw, b->n, EXTRA_ROWS, (uint64_t)K * 4, 8 * g);
                if (c->source_weights == 1 || (c->source_weights == 2 && s % 2 == 0)) {
                        tbuf_alloc(&b->sw, b->n, 0, (uint64_t)K * 4, 4 * g);
                        td_fill_f32(&rng, b->sw.ptr, b->n, K, b->sw.stride, -2.0f, 2.0f);
                        if (c->special > 0)
                                special_weights(&rng, &b->sw, K, c->special);
                }
                swref[s] = tbuf_ref(&b->sw);
                cio[s] = (struct epd_combine_src_io){
                        .bias = { tbuf_mat(&b->bias[0]), tbuf_mat(&b->bias[1]) },
                        .combined = tbuf_mat(&b->combined),
                        .combined_topk_weights = tbuf_mat(&b->cw),
                        .weights = b->weights_dense,
                        .source_weights = tbuf_mat(&b->sw),
                };
        }
        struct epd_combine_exec cop = {
                .plan = plan, .hidden = H, .apply_weights = apply, .y = ymat, .src = cio,
                .recv_weights = recv_w ? rwmat : NULL,
        };
        run_items(combine_item, &cop, epd_host_combine_items(&cop), c->order, &rng);

        struct ref_combine_in rin = { .y = yref, .apply_weights = apply };
        struct ref_combine_weights rcw = { .source_weights = c->source_weights ? swref : NULL,
                                           .recv_weights = recv_w ? rwref : NULL };
        for (uint32_t s = 0; s < R; s++) {
                struct src_bufs *b = &sb[s];
                struct ref_buf bias[2] = { tbuf_ref(&b->bias[0]), tbuf_ref(&b->bias[1]) };

                ck_assert_msg(ref_check_combine_w(ref, &rin, &rcw, s, bias,
                                                  tbuf_ref(&b->combined), tbuf_ref(&b->cw), msg,
                                                  sizeof(msg)) == 0,
                              "case %s seed 0x%016" PRIx64 ": %s", c->name, seed, msg);
                check_untouched(&b->combined, "combined", s);
                check_untouched(&b->cw, "combined_topk_weights", s);
        }

        for (uint32_t s = 0; s < R; s++) {
                struct src_bufs *b = &sb[s];

                tbuf_free(&b->x);
                tbuf_free(&b->scales);
                tbuf_free(&b->topk);
                tbuf_free(&b->weights);
                tbuf_free(&b->bias[0]);
                tbuf_free(&b->bias[1]);
                tbuf_free(&b->combined);
                tbuf_free(&b->cw);
                tbuf_free(&b->sw);
                free(b->weights_dense);
        }
        for (uint32_t d = 0; d < R; d++) {
                struct dst_bufs *b = &db[d];

                tbuf_free(&b->recv_x);
                tbuf_free(&b->recv_scales);
                tbuf_free(&b->recv_topk_idx);
                tbuf_free(&b->recv_weights);
                tbuf_free(&b->recv_src);
                tbuf_free(&b->recv_topk_slot);
                tbuf_free(&b->y);
                tbuf_free(&b->rw);
        }
        ref_dispatch_free(ref);
        epd_plan_free(plan);
}

START_TEST(test_fixed)
{
        run_case(&fixed_cases[_i], td_mix_seed(BASE_SEED, (uint64_t)_i));
}
END_TEST

/* Random small cases over every option; each is a function of its printed seed. */
static struct hx_case random_case(struct td_rng *rng)
{
        static const uint32_t ranks[] = { 1, 2, 3, 4, 8 };
        static const uint32_t locals[] = { 1, 2, 4, 8 };
        static const uint32_t topks[] = { 1, 2, 3, 8 };
        static const uint32_t aligns[] = { 1, 2, 5, 128 };
        static const uint32_t blocks[] = { 16, 32, 64, 128 };
        struct hx_case c = { .name = "random" };

        c.R = ranks[td_rng_below(rng, 5)];
        c.E = c.R == 3 ? 48 : c.R * locals[td_rng_below(rng, 4)];
        c.K = topks[td_rng_below(rng, 4)];
        c.T = 1 + td_rng_below(rng, 48);
        c.tokens = (enum tokens_mode)td_rng_below(rng, 3);
        c.routing = (enum td_routing)td_rng_below(rng, 3);
        c.neg = td_rng_below(rng, 2) ? 0.2 : 0.0;
        c.empty = td_rng_below(rng, 4) == 0 ? 0.2 : 0.0;
        c.layout = td_rng_below(rng, 2) ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND;
        c.dtype = td_rng_below(rng, 2) ? EPD_DTYPE_FP8_E4M3 : EPD_DTYPE_BF16;
        c.scale_block = blocks[td_rng_below(rng, 4)];
        /* bf16 rows must be a multiple of 16 bytes; fp8 rows a multiple of the scale block. */
        c.H = c.dtype == EPD_DTYPE_BF16 ? 8 * (1 + td_rng_below(rng, 40))
                                        : c.scale_block * (1 + td_rng_below(rng, 4));
        c.align = aligns[td_rng_below(rng, 4)];
        c.zero_padding = (int)td_rng_below(rng, 2);
        c.nbias = (int)td_rng_below(rng, 4);
        c.has_weights = td_rng_below(rng, 4) != 0;
        c.apply_weights = (int)td_rng_below(rng, 2);
        c.want_cw = (int)td_rng_below(rng, 2);
        c.topk_dtype = td_rng_below(rng, 2) ? EPD_DTYPE_INT64 : EPD_DTYPE_INT32;
        c.strided = (int)td_rng_below(rng, 2);
        c.order = (enum run_order)td_rng_below(rng, 4);
        c.special = td_rng_below(rng, 4) == 0 ? 0.05 : 0.0;
        c.source_weights = (int)td_rng_below(rng, 4) / 2; /* with weights: mixed sources */
        if (c.source_weights == 2 && !c.has_weights)
                c.source_weights = 1;
        c.recv_weights = td_rng_below(rng, 3) == 0;
        return c;
}

START_TEST(test_random)
{
        uint64_t seed = td_mix_seed(BASE_SEED + 1, (uint64_t)_i);
        struct td_rng rng;
        struct hx_case c;

        td_rng_seed(&rng, seed);
        c = random_case(&rng);
        run_case(&c, seed);
}
END_TEST

/* The same cases with every dispatch taking the non-temporal store path that large dispatches
 * use, whatever its size: strided cases put rows at every alignment, which covers the path's
 * head and tail. */
START_TEST(test_fixed_streamed)
{
        epd_host_stream_min_bytes = 1;
        run_case(&fixed_cases[_i], td_mix_seed(BASE_SEED, (uint64_t)_i));
        epd_host_stream_min_bytes = 0;
}
END_TEST

START_TEST(test_random_streamed)
{
        uint64_t seed = td_mix_seed(BASE_SEED + 2, (uint64_t)_i);
        struct td_rng rng;
        struct hx_case c;

        td_rng_seed(&rng, seed);
        c = random_case(&rng);
        epd_host_stream_min_bytes = 1;
        run_case(&c, seed);
        epd_host_stream_min_bytes = 0;
}
END_TEST

/* ---- bf16 helpers ---- */

static float f_of(uint32_t bits)
{
        float f;
        memcpy(&f, &bits, 4);
        return f;
}

START_TEST(test_bf16_known)
{
        static const struct { uint32_t in; uint16_t out; } cases[] = {
                { 0x3F800000u, 0x3F80 },  /* 1.0 exact */
                { 0x3F808000u, 0x3F80 },  /* tie, even stays */
                { 0x3F818000u, 0x3F82 },  /* tie, odd rounds up */
                { 0x3F808001u, 0x3F81 },  /* above tie */
                { 0x3F807FFFu, 0x3F80 },  /* below tie */
                { 0xBF818000u, 0xBF82 },  /* negative tie, odd: away from zero in magnitude */
                { 0x00000000u, 0x0000 },
                { 0x80000000u, 0x8000 },  /* -0 keeps its sign */
                { 0x00008000u, 0x0000 },  /* subnormal tie to even */
                { 0x00018000u, 0x0002 },
                { 0x007FFFFFu, 0x0080 },  /* largest subnormal rounds to the smallest normal */
                { 0x7F800000u, 0x7F80 },  /* +inf */
                { 0xFF800000u, 0xFF80 },  /* -inf */
                { 0x7F7FFFFFu, 0x7F80 },  /* FLT_MAX rounds up to inf */
                { 0x7F7F7FFFu, 0x7F7F },
                { 0x7F7F8000u, 0x7F80 },  /* tie at the top, odd: to inf */
                { 0x7FC00000u, 0x7FFF },  /* quiet NaN */
                { 0xFFC00000u, 0x7FFF },  /* negative NaN */
                { 0x7F800001u, 0x7FFF },  /* signalling NaN that truncation would make inf */
                { 0x7FFFFFFFu, 0x7FFF },
                { 0xFF80FFFFu, 0x7FFF },
        };

        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                float f = f_of(cases[i].in);

                ck_assert_msg(epd__float_to_bf16(f) == cases[i].out,
                              "0x%08x -> 0x%04x, want 0x%04x", cases[i].in, epd__float_to_bf16(f),
                              cases[i].out);
                ck_assert_uint_eq(epd_float_to_bf16(f), cases[i].out);
                ck_assert_uint_eq(ref_float_to_bf16(f), cases[i].out);
        }
}
END_TEST

START_TEST(test_bf16_exhaustive)
{
        static const uint32_t lows[] = { 0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234 };

        for (uint32_t v = 0; v < 65536; v++) {
                float f = epd__bf16_to_float((uint16_t)v);
                uint32_t bits;

                /* Widening is exact: the bits land in the top half. */
                memcpy(&bits, &f, 4);
                ck_assert_uint_eq(bits, v << 16);
                ck_assert_uint_eq(epd_bf16_to_float((uint16_t)v) == f || isnan(f), 1);
                ck_assert(ref_bf16_to_float((uint16_t)v) == f || isnan(f));
                /* Narrowing every bf16 value with each interesting low half. */
                for (size_t j = 0; j < sizeof(lows) / sizeof(lows[0]); j++) {
                        float x = f_of(v << 16 | lows[j]);
                        if (epd__float_to_bf16(x) != ref_float_to_bf16(x))
                                ck_abort_msg("0x%08x: 0x%04x, reference 0x%04x", v << 16 | lows[j],
                                             epd__float_to_bf16(x), ref_float_to_bf16(x));
                }
                if (!isnan(f))
                        ck_assert_uint_eq(epd__float_to_bf16(f), v);
                else
                        ck_assert_uint_eq(epd__float_to_bf16(f), 0x7FFF);
        }
}
END_TEST

START_TEST(test_bf16_random)
{
        struct td_rng rng;
        uint64_t seed = 0xB16B00B5ull;

        printf("bf16 random seed=0x%016" PRIx64 "\n", seed);
        td_rng_seed(&rng, seed);
        for (int i = 0; i < 4000000; i++) {
                uint32_t bits = (uint32_t)td_rng_next(&rng);
                float x = f_of(bits);

                /* A plain test first: a Check assertion per iteration costs more than the
                 * conversion itself. */
                if (epd__float_to_bf16(x) != ref_float_to_bf16(x))
                        ck_abort_msg("0x%08x: 0x%04x, reference 0x%04x", bits,
                                     epd__float_to_bf16(x), ref_float_to_bf16(x));
        }
}
END_TEST

static Suite *exec_suite(void)
{
        Suite *s = suite_create("exec");
        TCase *tc = tcase_create("bf16");

        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_bf16_known);
        tcase_add_test(tc, test_bf16_exhaustive);
        tcase_add_test(tc, test_bf16_random);
        suite_add_tcase(s, tc);

        tc = tcase_create("fixed");
        tcase_set_timeout(tc, 300);
        tcase_add_loop_test(tc, test_fixed, 0, NUM_FIXED);
        suite_add_tcase(s, tc);

        tc = tcase_create("random");
        tcase_set_timeout(tc, 60);
        tcase_add_loop_test(tc, test_random, 0, NUM_RANDOM);
        suite_add_tcase(s, tc);

        tc = tcase_create("streamed");
        tcase_set_timeout(tc, 300);
        tcase_add_loop_test(tc, test_fixed_streamed, 0, NUM_FIXED);
        tcase_add_loop_test(tc, test_random_streamed, 0, NUM_RANDOM);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(exec_suite());
        int failed;

        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
