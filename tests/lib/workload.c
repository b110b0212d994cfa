/* workload.c - see workload.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "workload.h"

#define FAIL(...)                                                                       \
        do {                                                                            \
                fprintf(stderr, "[%s seed=%llu rank=%u step=%d] ", c->name,             \
                        (unsigned long long)c->seed, rank, step);                       \
                fprintf(stderr, __VA_ARGS__);                                           \
                fprintf(stderr, "\n");                                                  \
                goto fail;                                                              \
        } while (0)

static uint64_t now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint32_t wl_num_tokens(const struct wl_case *c, uint32_t s)
{
        uint32_t T = c->max_tokens;

        switch (c->tokens) {
        case WL_TOKENS_DESCENDING:
                return T > s ? T - s : 0;
        case WL_TOKENS_SOME_ZERO:
                return (s % 2) ? 0 : (T > s ? T - s : 0);
        default:
                return T;
        }
}

static size_t esize(enum epd_dtype d)
{
        return epd_dtype_size(d);
}

static uint32_t scale_cols(const struct wl_case *c)
{
        return c->dtype == EPD_DTYPE_FP8_E4M3 ? c->hidden / WL_SCALE_BLOCK : 0;
}

int wl_inputs_make(const struct wl_case *c, uint32_t s, int step, int weights_variant,
                   struct wl_inputs *in)
{
        struct td_rng rng;
        uint32_t n = wl_num_tokens(c, s), K = c->num_topk;
        uint64_t row_bytes = (uint64_t)c->hidden * esize(c->dtype);

        memset(in, 0, sizeof(*in));
        in->num_tokens = n;
        in->x_stride = row_bytes + (uint64_t)c->row_padding * esize(c->dtype);
        in->x = malloc(in->x_stride * n + 1);
        in->topk = malloc((size_t)n * K * esize(c->topk_dtype) + 1);
        in->weights = malloc((size_t)n * K * sizeof(float) + 1);
        in->scales = malloc((size_t)n * scale_cols(c) * sizeof(float) + 1);
        if (!in->x || !in->topk || !in->weights || !in->scales) {
                wl_inputs_free(in);
                return -1;
        }
        td_rng_seed(&rng, td_mix_seed(c->seed, (uint64_t)s * 1000 + (uint64_t)step));
        if (c->dtype == EPD_DTYPE_BF16)
                td_fill_bf16(&rng, in->x, n, c->hidden, in->x_stride, 0.01);
        else
                td_fill_bytes(&rng, in->x, n, row_bytes, in->x_stride);
        if (scale_cols(c))
                td_fill_f32(&rng, in->scales, n, scale_cols(c), 0, 0.5f, 2.0f);
        struct td_routing_args ra = {
                .world_size = c->world_size,
                .num_experts = c->num_experts,
                .num_tokens = n,
                .num_topk = K,
                .mode = c->routing,
                .hot_rank = (uint32_t)step % c->world_size,
                .minus_one_prob = c->minus_one_prob,
                .empty_row_prob = c->minus_one_prob > 0 ? 0.05 : 0.0,
                .dtype = c->topk_dtype,
        };
        td_gen_topk(&rng, &ra, in->topk);
        td_rng_seed(&rng, td_mix_seed(c->seed, 7000000 + (uint64_t)s * 1000 + (uint64_t)step * 10 +
                                                       (uint64_t)weights_variant));
        td_fill_f32(&rng, in->weights, n, K, 0, 0.0f, 1.0f);
        return 0;
}

void wl_inputs_free(struct wl_inputs *in)
{
        free(in->x);
        free(in->topk);
        free(in->weights);
        free(in->scales);
        memset(in, 0, sizeof(*in));
}

void wl_ref_params(const struct wl_case *c, struct ref_params *p)
{
        memset(p, 0, sizeof(*p));
        p->world_size = c->world_size;
        p->num_experts = c->num_experts;
        p->hidden = c->hidden;
        p->max_tokens = c->max_tokens;
        p->num_topk = c->num_topk;
        p->dtype = c->dtype;
        p->scale_block = WL_SCALE_BLOCK;
        p->topk_dtype = c->topk_dtype;
        p->layout = c->layout;
        p->expert_alignment = c->expert_alignment ? c->expert_alignment : 1;
        p->zero_padding = c->zero_padding;
        p->has_weights = c->has_weights;
}

/* The group's secret, derived from its name. */
static void group_secret(const char *name, unsigned char secret[16])
{
        for (int i = 0; i < 16; i++)
                secret[i] = (unsigned char)(name[i % (strlen(name) ? strlen(name) : 1)] * 31 + i);
}

int wl_join_group_on(struct epd_client *client, const char *name, uint32_t rank, uint32_t device,
                     struct epd_group **out)
{
        unsigned char secret[16];
        struct epd_group_args ga = {
                .size = sizeof(ga), .name = name, .secret = secret, .secret_len = sizeof(secret),
                .rank = rank, .device = device,
        };

        group_secret(name, secret);
        return epd_group_join(client, &ga, out);
}

int wl_enter_group(struct epd_client *client, const char *name, uint32_t rank,
                   const struct epd_group_config *cfg, struct epd_group **out)
{
        unsigned char secret[16];
        struct epd_group_args ga = {
                .size = sizeof(ga), .name = name, .secret = secret, .secret_len = sizeof(secret),
                .rank = rank, .config = cfg,
        };

        group_secret(name, secret);
        if (rank == 0)
                return epd_group_create(client, &ga, out);
        for (int attempt = 0; attempt < 2000; attempt++) {
                int rc = epd_group_join(client, &ga, out);
                if (rc != EPD_NOT_FOUND)
                        return rc;
                usleep(2000);
        }
        return EPD_NOT_FOUND;
}

/* An op's timeline (epd_op_timeline) must be in order and inside the caller's own submit and
 * return times t0 and t1 (one clock on one host): libepd sent the request, the daemon read it,
 * launched the op, its executor began and ended it, the loop took the completion and built the
 * reply, and libepd read it. */
static int check_timeline(const struct epd_op *op, uint64_t t0, uint64_t t1, char *err,
                          size_t len)
{
        struct epd_op_timeline tl = { .size = sizeof(tl) };
        int rc = epd_op_timeline(op, &tl);

        if (rc < 0) {
                snprintf(err, len, "epd_op_timeline: %s", epd_status_name(rc));
                return -1;
        }
        const uint64_t seq[] = { t0, tl.submitted_ns, tl.received_ns, tl.launched_ns,
                                 tl.exec_start_ns, tl.exec_start_ns + tl.exec_ns,
                                 tl.completed_ns, tl.replied_ns, tl.reply_read_ns, t1 };
        static const char *const names[] = { "call", "submitted", "received", "launched",
                                             "exec_start", "exec_end", "completed", "replied",
                                             "reply_read", "return" };
        for (size_t i = 1; i < sizeof(seq) / sizeof(seq[0]); i++) {
                if (seq[i] < seq[i - 1] || seq[i] == 0) {
                        snprintf(err, len, "%s (%llu) before %s (%llu), or unknown", names[i],
                                 (unsigned long long)seq[i], names[i - 1],
                                 (unsigned long long)seq[i - 1]);
                        return -1;
                }
        }
        if (tl.kernel_ns > tl.exec_ns) {
                snprintf(err, len, "kernel_ns %llu above exec_ns %llu",
                         (unsigned long long)tl.kernel_ns, (unsigned long long)tl.exec_ns);
                return -1;
        }
        return 0;
}

/* A bump allocator over one registered region. */
struct slab {
        uint8_t *base;
        uint64_t bytes, used, region_id;
};

static void *slab_take(struct slab *s, uint64_t bytes)
{
        uint64_t off = (s->used + 63) / 64 * 64;

        if (off + bytes > s->bytes) {
                /* Sizing the slab is the test's own arithmetic: a miss is a test bug. */
                fprintf(stderr, "workload: slab of %llu bytes exhausted\n",
                        (unsigned long long)s->bytes);
                abort();
        }
        s->used = off + bytes + 1; /* never hand out the same address twice */
        return s->base + off;
}

static struct epd_tensor tensor2(struct slab *s, const void *ptr, enum epd_dtype dt,
                                 uint64_t rows, uint64_t cols, uint64_t row_stride_elems)
{
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        t.dtype = dt;
        t.ndim = cols ? 2 : 1;
        t.sizes[0] = rows;
        t.sizes[1] = cols;
        if (cols && row_stride_elems && row_stride_elems != cols) {
                t.strides[0] = row_stride_elems;
                t.strides[1] = 1;
        }
        t.region_id = s->region_id;
        t.offset = (uint64_t)((const uint8_t *)ptr - s->base);
        return t;
}

int wl_worker(const struct wl_case *c, const char *socket_path, const char *group_name,
              uint32_t rank, struct wl_timing *timing)
{
        uint32_t R = c->world_size, K = c->num_topk, H = c->hidden;
        uint32_t L = c->num_experts / R;
        size_t xe = esize(c->dtype), te = esize(c->topk_dtype);
        uint64_t row_bytes = (uint64_t)H * xe, pad = (uint64_t)c->row_padding;
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = socket_path,
                                       .client_name = c->name, .timeout_ms = 60000 };
        struct epd_client *client = NULL;
        struct epd_group *group = NULL;
        struct wl_inputs *ins = calloc(R, sizeof(*ins));
        struct ref_src *srcs = calloc(R, sizeof(*srcs));
        uint16_t **ys = calloc(R, sizeof(*ys));
        struct ref_buf *ybufs = calloc(R, sizeof(*ybufs));
        /* combine_weights: every rank's recv_weights (wbufs[d]) and source_weights (wbufs[R + s]),
         * seeded, as each worker regenerates them for its reference */
        float **ws = calloc(2 * (size_t)R, sizeof(*ws));
        struct ref_buf *wbufs = calloc(2 * (size_t)R, sizeof(*wbufs));
        struct ref_dispatch *ref = NULL;
        struct epd_op *op = NULL;
        struct slab slab = { 0 };
        char err[1024];
        int step = 0, rc;

        if (!ins || !srcs || !ys || !ybufs || !ws || !wbufs)
                FAIL("out of memory");
        rc = epd_client_connect(&ca, &client, err, sizeof(err));
        if (rc < 0)
                FAIL("connect: %s: %s", epd_status_name(rc), err);
        struct epd_group_config gcfg = {
                .size = sizeof(gcfg), .world_size = R, .num_experts = c->num_experts,
                .hidden = H, .max_tokens_per_rank = c->max_tokens, .max_topk = K,
                .dispatch_dtype = c->dtype, .op_timeout_ms = 60000,
        };
        uint64_t max_rows = c->layout == EPD_LAYOUT_EXPAND
                                    ? (uint64_t)R * c->max_tokens * (K < L ? K : L) +
                                              (uint64_t)L * ((c->expert_alignment ? c->expert_alignment : 1) - 1)
                                    : (uint64_t)R * c->max_tokens;
        gcfg.arena_bytes = c->arena_bytes ? c->arena_bytes
                                          : max_rows * (row_bytes + scale_cols(c) * 4 + K * 12 + 16) +
                                                    (1u << 20);
        if (!c->use_arena)
                gcfg.arena_bytes = 1 << 20;
        rc = wl_enter_group(client, group_name, rank, &gcfg, &group);
        if (rc < 0)
                FAIL("enter group: %s: %s", epd_status_name(rc), epd_client_last_error(client));

        struct ref_params params;
        wl_ref_params(c, &params);
        for (step = 0; step < (c->steps ? c->steps : 1); step++) {
                for (uint32_t s = 0; s < R; s++) {
                        if (wl_inputs_make(c, s, step, 0, &ins[s]) < 0)
                                FAIL("out of memory");
                        srcs[s] = (struct ref_src){
                                .num_tokens = ins[s].num_tokens,
                                .x = { ins[s].x, ins[s].x_stride },
                                .scales = { scale_cols(c) ? ins[s].scales : NULL, 0 },
                                .topk_idx = { ins[s].topk, 0 },
                                .weights = { c->has_weights ? ins[s].weights : NULL, 0 },
                        };
                }
                rc = ref_dispatch_new(&params, srcs, &ref, err, sizeof(err));
                if (rc < 0)
                        FAIL("reference: %s", err);
                const struct ref_dst *me = &ref->dst[rank];
                const int64_t my_rows = me->rows; /* the cached pass rebuilds ref; rows stay */
                uint32_t n = ins[rank].num_tokens;
                uint64_t cap = (uint64_t)me->rows + 3;
                uint64_t xs = row_bytes + pad * xe; /* padded row stride, bytes */

                /* One region for this step: inputs, outputs, y, biases, combined. */
                slab.bytes = (uint64_t)n * (xs + scale_cols(c) * 4 + K * (te + 4)) +
                             cap * (xs + scale_cols(c) * 4 + K * (te + 4) + 16) +
                             2 * ((uint64_t)me->rows * H * 2 + 3ull * n * H * 2 +
                                  (uint64_t)n * K * 4) +
                             2 * ((uint64_t)me->rows + n) * K * 4 + (1 << 16);
                void *base;
                rc = epd_region_alloc(client, slab.bytes, &base, &slab.region_id);
                if (rc < 0)
                        FAIL("region alloc: %s", epd_client_last_error(client));
                slab.base = base;
                slab.used = 0;

                uint8_t *x = slab_take(&slab, (uint64_t)n * xs);
                for (uint32_t t = 0; t < n; t++)
                        memcpy(x + t * xs, ins[rank].x + t * ins[rank].x_stride, row_bytes);
                float *scales = slab_take(&slab, (uint64_t)n * scale_cols(c) * 4);
                memcpy(scales, ins[rank].scales, (size_t)n * scale_cols(c) * 4);
                void *topk = slab_take(&slab, (uint64_t)n * K * te);
                memcpy(topk, ins[rank].topk, (size_t)n * K * te);
                float *weights = slab_take(&slab, (uint64_t)n * K * 4);
                memcpy(weights, ins[rank].weights, (size_t)n * K * 4);

                struct epd_dispatch_args da = {
                        .size = sizeof(da), .num_tokens = n, .num_topk = K,
                        .layout = c->layout, .expert_alignment = c->expert_alignment,
                        .zero_padding = c->zero_padding, .use_arena = c->use_arena,
                };
                da.x = tensor2(&slab, x, c->dtype, n, H, H + pad);
                if (scale_cols(c))
                        da.scales = tensor2(&slab, scales, EPD_DTYPE_FP32, n, scale_cols(c), 0);
                da.topk_idx = tensor2(&slab, topk, c->topk_dtype, n, K, 0);
                if (c->has_weights)
                        da.topk_weights = tensor2(&slab, weights, EPD_DTYPE_FP32, n, K, 0);

                struct ref_dispatch_actual act;
                memset(&act, 0, sizeof(act));
                uint8_t *o_x = NULL;
                if (!c->use_arena) {
                        int expand = c->layout == EPD_LAYOUT_EXPAND;
                        o_x = slab_take(&slab, cap * xs);
                        memset(o_x, 0xAB, cap * xs);
                        da.recv_x = tensor2(&slab, o_x, c->dtype, cap, H, H + pad);
                        act.recv_x = (struct ref_buf){ o_x, xs };
                        if (scale_cols(c)) {
                                float *o = slab_take(&slab, cap * scale_cols(c) * 4);
                                da.recv_scales = tensor2(&slab, o, EPD_DTYPE_FP32, cap, scale_cols(c), 0);
                                act.recv_scales = (struct ref_buf){ o, 0 };
                        }
                        if (!expand) {
                                void *o = slab_take(&slab, cap * K * te);
                                da.recv_topk_idx = tensor2(&slab, o, c->topk_dtype, cap, K, 0);
                                act.recv_topk_idx = (struct ref_buf){ o, 0 };
                        }
                        if (c->has_weights) {
                                void *o = slab_take(&slab, cap * (expand ? 1 : K) * 4);
                                da.recv_weights = tensor2(&slab, o, EPD_DTYPE_FP32, cap,
                                                          expand ? 0 : K, 0);
                                act.recv_weights = (struct ref_buf){ o, 0 };
                        }
                        void *src = slab_take(&slab, cap * 8);
                        da.recv_src = tensor2(&slab, src, EPD_DTYPE_INT64, cap, 0, 0);
                        act.recv_src = (struct ref_buf){ src, 0 };
                        if (expand) {
                                void *o = slab_take(&slab, cap * 4);
                                da.recv_topk_slot = tensor2(&slab, o, EPD_DTYPE_INT32, cap, 0, 0);
                                act.recv_topk_slot = (struct ref_buf){ o, 0 };
                        }
                }

                uint64_t t0 = now_ns();
                rc = epd_dispatch(group, &da, &op);
                uint64_t t1 = now_ns();
                if (rc < 0)
                        FAIL("dispatch: %s: %s", epd_status_name(rc), epd_client_last_error(client));
                struct epd_dispatch_result dr;
                epd_op_dispatch_result(op, &dr);
                if (check_timeline(op, t0, t1, err, sizeof(err)) != 0)
                        FAIL("dispatch timeline: %s", err);
                if (timing) {
                        timing->dispatch_ns = t1 - t0;
                        timing->dispatch_exec_ns = dr.exec_ns;
                        if (timing->dispatch_step_ns)
                                timing->dispatch_step_ns[step] = t1 - t0;
                }
                struct ref_counts_actual counts = {
                        dr.num_recv_tokens, dr.num_expanded_rows, dr.num_recv_tokens_per_expert,
                        dr.num_recv_tokens_per_expert_aligned, dr.rank_prefix,
                };
                if (dr.num_local_experts != L || dr.world_size != R)
                        FAIL("reply has %u experts and %u ranks, expected %u and %u",
                             dr.num_local_experts, dr.world_size, L, R);
                if (ref_check_counts(ref, rank, &counts, err, sizeof(err)) != 0)
                        FAIL("counts: %s", err);
                if (c->use_arena) {
                        act.recv_x = (struct ref_buf){ dr.recv_x_ptr, 0 };
                        act.recv_scales = (struct ref_buf){ dr.recv_scales_ptr, 0 };
                        act.recv_topk_idx = (struct ref_buf){ dr.recv_topk_idx_ptr, 0 };
                        act.recv_weights = (struct ref_buf){ dr.recv_weights_ptr, 0 };
                        act.recv_src = (struct ref_buf){ dr.recv_src_ptr, 0 };
                        act.recv_topk_slot = (struct ref_buf){ dr.recv_topk_slot_ptr, 0 };
                        if (me->rows > 0 && !dr.recv_x_ptr)
                                FAIL("arena placement missing from the reply");
                }
                if (ref_check_dispatch(ref, rank, &act, err, sizeof(err)) != 0)
                        FAIL("dispatch outputs: %s", err);
                uint64_t handle = dr.handle_id;

                for (int pass = 0; pass < (c->cached ? 2 : 1); pass++) {
                        if (pass == 1) {
                                /* Cached dispatch: same routing, new weights; every output is
                                 * rewritten. Poison first so stale data cannot pass. */
                                ref = ref_dispatch_free(ref);
                                for (uint32_t s = 0; s < R; s++) {
                                        struct wl_inputs w2;
                                        if (wl_inputs_make(c, s, step, 1, &w2) < 0)
                                                FAIL("out of memory");
                                        memcpy(ins[s].weights, w2.weights,
                                               (size_t)ins[s].num_tokens * K * 4);
                                        wl_inputs_free(&w2);
                                }
                                memcpy(weights, ins[rank].weights, (size_t)n * K * 4);
                                rc = ref_dispatch_new(&params, srcs, &ref, err, sizeof(err));
                                if (rc < 0)
                                        FAIL("reference: %s", err);
                                if (o_x)
                                        memset(o_x, 0xCD, cap * xs);
                                struct epd_dispatch_args cd = da;
                                memset(&cd.topk_idx, 0, sizeof(cd.topk_idx));
                                cd.handle_id = handle;
                                epd_op_free(op);
                                op = NULL;
                                rc = epd_dispatch(group, &cd, &op);
                                if (rc < 0)
                                        FAIL("cached dispatch: %s: %s", epd_status_name(rc),
                                             epd_client_last_error(client));
                                epd_op_dispatch_result(op, &dr);
                                if (dr.handle_id != handle)
                                        FAIL("cached dispatch returned handle %llu, expected %llu",
                                             (unsigned long long)dr.handle_id,
                                             (unsigned long long)handle);
                                counts = (struct ref_counts_actual){
                                        dr.num_recv_tokens, dr.num_expanded_rows,
                                        dr.num_recv_tokens_per_expert,
                                        dr.num_recv_tokens_per_expert_aligned, dr.rank_prefix,
                                };
                                if (ref_check_counts(ref, rank, &counts, err, sizeof(err)) != 0)
                                        FAIL("cached counts: %s", err);
                                if (ref_check_dispatch(ref, rank, &act, err, sizeof(err)) != 0)
                                        FAIL("cached dispatch outputs: %s", err);
                        }
                        /* Stand-in expert: y of destination d is a seeded bf16 function of
                         * (seed, d, step, pass), regenerated by every worker for its reference. */
                        for (uint32_t d = 0; d < R; d++) {
                                struct td_rng rng;
                                int64_t rows = ref->dst[d].rows;
                                free(ys[d]);
                                ys[d] = malloc((size_t)rows * H * 2 + 2);
                                if (!ys[d])
                                        FAIL("out of memory");
                                td_rng_seed(&rng, td_mix_seed(c->seed, 9000000 + d * 100 +
                                                                              (uint64_t)step * 2 + pass));
                                td_fill_bf16(&rng, ys[d], (uint64_t)rows, H, 0, 0.0);
                                ybufs[d] = (struct ref_buf){ ys[d], 0 };
                        }
                        const int recv_w = (c->combine_weights & WL_COMBINE_RECV_WEIGHTS) != 0;
                        const int source_w = (c->combine_weights & WL_COMBINE_SOURCE_WEIGHTS) != 0;
                        for (uint32_t i = 0; i < 2 * R; i++) {
                                struct td_rng rng;
                                uint64_t rows = i < R ? (uint64_t)ref->dst[i].rows
                                                      : ins[i - R].num_tokens;
                                free(ws[i]);
                                ws[i] = malloc((size_t)rows * K * 4 + 4);
                                if (!ws[i])
                                        FAIL("out of memory");
                                td_rng_seed(&rng, td_mix_seed(c->seed, 7000000 + i * 100 +
                                                                              (uint64_t)step * 2 + pass));
                                td_fill_f32(&rng, ws[i], rows, K, 0, -1.0f, 2.0f);
                                wbufs[i] = (struct ref_buf){ ws[i], 0 };
                        }
                        struct epd_combine_args cb = { .size = sizeof(cb), .handle_id = handle,
                                                       .apply_weights = c->apply_weights,
                                                       .num_bias = c->num_bias };
                        if (recv_w) {
                                float *w = slab_take(&slab, (uint64_t)my_rows * K * 4 + 4);
                                memcpy(w, ws[rank], (size_t)my_rows * K * 4);
                                cb.recv_weights = tensor2(&slab, w, EPD_DTYPE_FP32,
                                                          (uint64_t)my_rows, K, 0);
                        }
                        if (source_w) {
                                float *w = slab_take(&slab, (uint64_t)n * K * 4 + 4);
                                memcpy(w, ws[R + rank], (size_t)n * K * 4);
                                cb.source_weights = tensor2(&slab, w, EPD_DTYPE_FP32, n, K, 0);
                        }
                        uint16_t *y = slab_take(&slab, (uint64_t)my_rows * H * 2 + 2);
                        memcpy(y, ys[rank], (size_t)my_rows * H * 2);
                        cb.y = tensor2(&slab, y, EPD_DTYPE_BF16, (uint64_t)my_rows, H, 0);
                        struct ref_buf bias[2] = { { NULL, 0 }, { NULL, 0 } };
                        for (uint32_t b = 0; b < c->num_bias; b++) {
                                struct td_rng rng;
                                uint16_t *bb = slab_take(&slab, (uint64_t)n * H * 2 + 2);
                                td_rng_seed(&rng, td_mix_seed(c->seed, 8000000 + rank * 10 + b +
                                                                              (uint64_t)step * 1000));
                                td_fill_bf16(&rng, bb, n, H, 0, 0.0);
                                cb.bias[b] = tensor2(&slab, bb, EPD_DTYPE_BF16, n, H, 0);
                                bias[b] = (struct ref_buf){ bb, 0 };
                        }
                        uint16_t *combined = slab_take(&slab, (uint64_t)n * H * 2 + 2);
                        memset(combined, 0xEE, (size_t)n * H * 2);
                        cb.combined = tensor2(&slab, combined, EPD_DTYPE_BF16, n, H, 0);
                        float *cw = NULL;
                        if (c->has_weights || recv_w) {
                                cw = slab_take(&slab, (uint64_t)n * K * 4 + 4);
                                cb.combined_topk_weights = tensor2(&slab, cw, EPD_DTYPE_FP32, n, K, 0);
                        }
                        struct epd_combine_result cr;
                        t0 = now_ns();
                        rc = epd_combine(group, &cb, &cr);
                        t1 = now_ns();
                        if (rc < 0)
                                FAIL("combine: %s: %s", epd_status_name(rc),
                                     epd_client_last_error(client));
                        if (timing) {
                                timing->combine_ns = t1 - t0;
                                timing->combine_exec_ns = cr.exec_ns;
                        }
                        struct ref_combine_in cin = { ybufs, c->apply_weights };
                        struct ref_combine_weights cws = {
                                .source_weights = source_w ? wbufs + R : NULL,
                                .recv_weights = recv_w ? wbufs : NULL,
                        };
                        if (ref_check_combine_w(ref, &cin, &cws, rank, bias,
                                                (struct ref_buf){ combined, 0 },
                                                (struct ref_buf){ cw, 0 }, err, sizeof(err)) != 0)
                                FAIL("combine outputs: %s", err);
                }
                epd_op_free(op);
                op = NULL;
                rc = epd_handle_release(group, handle);
                if (rc < 0)
                        FAIL("handle release: %s", epd_client_last_error(client));
                rc = epd_region_release(client, slab.region_id);
                if (rc < 0)
                        FAIL("region release: %s", epd_client_last_error(client));
                ref = ref_dispatch_free(ref);
                for (uint32_t s = 0; s < R; s++)
                        wl_inputs_free(&ins[s]);
        }
        rc = 0;
        goto out;
fail:
        rc = 1;
out:
        epd_op_free(op);
        ref_dispatch_free(ref);
        if (ins)
                for (uint32_t s = 0; s < R; s++)
                        wl_inputs_free(&ins[s]);
        for (uint32_t d = 0; ys && d < R; d++)
                free(ys[d]);
        for (uint32_t i = 0; ws && i < 2 * R; i++)
                free(ws[i]);
        free(ws);
        free(wbufs);
        free(ys);
        free(ybufs);
        free(ins);
        free(srcs);
        epd_group_leave(group);
        epd_client_free(client);
        return rc;
}
