/* randstep.c - see randstep.h. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "randstep.h"

/* Seed tags: one independent stream per kind of data. */
enum { TAG_PLAN = 1, TAG_X, TAG_TOPK, TAG_WEIGHTS, TAG_Y, TAG_BIAS, TAG_CAP };

uint64_t rs_now_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void seed_rng(struct td_rng *rng, const struct rs_shape *sh, uint64_t gen, uint64_t index,
                     uint64_t tag, uint64_t a, uint64_t b)
{
        uint64_t k = td_mix_seed(sh->seed, gen);

        k = td_mix_seed(k, index);
        k = td_mix_seed(k, tag);
        k = td_mix_seed(k, a);
        td_rng_seed(rng, td_mix_seed(k, b));
}

static uint32_t scale_cols(const struct rs_shape *sh)
{
        return sh->dtype == EPD_DTYPE_FP8_E4M3 ? sh->hidden / RS_SCALE_BLOCK : 0;
}

/* ---- plans ---- */

void rs_plan_make(const struct rs_shape *sh, uint64_t gen, uint64_t index, int big,
                  struct rs_plan *p)
{
        static const uint32_t alignments[] = { 1, 1, 2, 4, 16, 128 };
        static const double minus_one[] = { 0.0, 0.05, 0.3 };
        const uint32_t R = sh->world_size;
        struct td_rng rng;

        memset(p, 0, sizeof(*p));
        seed_rng(&rng, sh, gen, index, TAG_PLAN, 0, 0);
        p->big = big;
        if (big) {
                p->num_topk = sh->max_topk;
                p->topk_dtype = EPD_DTYPE_INT64;
                p->layout = EPD_LAYOUT_NON_EXPAND;
                p->expert_alignment = 1;
                p->has_weights = 1;
                p->routing = TD_ROUTING_UNIFORM;
                for (uint32_t r = 0; r < R; r++)
                        p->num_tokens[r] = sh->max_tokens;
                p->num_ops = 2;
                return;
        }
        p->num_topk = 1 + td_rng_below(&rng, sh->max_topk);
        p->topk_dtype = td_rng_below(&rng, 2) ? EPD_DTYPE_INT32 : EPD_DTYPE_INT64;
        p->layout = td_rng_below(&rng, 2) ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND;
        p->expert_alignment = alignments[td_rng_below(&rng, 6)];
        p->zero_padding = p->layout == EPD_LAYOUT_EXPAND && td_rng_below(&rng, 2);
        p->has_weights = td_rng_below(&rng, 4) != 0;
        p->apply_weights = p->layout == EPD_LAYOUT_EXPAND && p->has_weights &&
                           td_rng_below(&rng, 2);
        p->cached = td_rng_below(&rng, 5) == 0;
        p->combined_weights = p->has_weights && td_rng_below(&rng, 2);
        p->routing = (enum td_routing)td_rng_below(&rng, 3);
        p->hot_rank = td_rng_below(&rng, R);
        p->minus_one_prob = minus_one[td_rng_below(&rng, 3)];
        p->empty_row_prob = td_rng_below(&rng, 4) == 0 ? 0.1 : 0.0;
        for (uint32_t r = 0; r < R; r++) {
                p->num_tokens[r] = td_rng_below(&rng, 8) == 0
                                           ? 0
                                           : td_rng_below(&rng, sh->step_tokens + 1);
                p->num_bias[r] = td_rng_below(&rng, 3);
                p->use_arena[r] = td_rng_below(&rng, 2);
                p->y_in_arena[r] = p->use_arena[r] && sh->dtype == EPD_DTYPE_BF16 &&
                                   td_rng_below(&rng, 2);
                p->row_padding[r] = td_rng_below(&rng, 3) == 0 ? 8 : 0;
        }
        p->num_ops = p->cached ? 3 : 2;
}

const char *rs_plan_describe(const struct rs_plan *p, uint32_t world_size, char *buf,
                             size_t len)
{
        size_t n = (size_t)snprintf(
                buf, len,
                "%s%s K_op=%u topk=%s align=%u zero_pad=%d weights=%d apply=%d cached=%d "
                "routing=%d hot=%u minus1=%.2f empty=%.2f tokens=",
                p->big ? "big " : "", p->layout == EPD_LAYOUT_EXPAND ? "EXPAND" : "NON_EXPAND",
                p->num_topk, p->topk_dtype == EPD_DTYPE_INT32 ? "i32" : "i64",
                p->expert_alignment, p->zero_padding, p->has_weights, p->apply_weights, p->cached,
                (int)p->routing, p->hot_rank, p->minus_one_prob, p->empty_row_prob);
        for (uint32_t r = 0; r < world_size && n < len; r++)
                n += (size_t)snprintf(buf + n, len - n, "%s%u%s%s", r ? "," : "",
                                      p->num_tokens[r], p->use_arena[r] ? "a" : "",
                                      p->row_padding[r] ? "p" : "");
        return buf;
}

struct epd_group_config rs_group_config(const struct rs_shape *sh, uint32_t op_timeout_ms,
                                        uint64_t arena_bytes)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = sh->world_size,
                .num_experts = sh->num_experts, .hidden = sh->hidden,
                .max_tokens_per_rank = sh->max_tokens, .max_topk = sh->max_topk,
                .dispatch_dtype = sh->dtype, .op_timeout_ms = op_timeout_ms,
                .arena_bytes = arena_bytes,
        };
        return cfg;
}

static uint64_t max_rows(const struct rs_shape *sh, uint32_t tokens, uint32_t align)
{
        uint32_t L = sh->num_experts / sh->world_size;
        uint32_t K = sh->max_topk < L ? sh->max_topk : L;

        return (uint64_t)sh->world_size * tokens * K + (uint64_t)L * (align - 1);
}

uint64_t rs_arena_bytes(const struct rs_shape *sh)
{
        uint64_t row = (uint64_t)sh->hidden * epd_dtype_size(sh->dtype) + scale_cols(sh) * 4 +
                       (uint64_t)sh->max_topk * 12 + 16;

        return (max_rows(sh, sh->step_tokens, 128) * row) / 4 * 5 + (1u << 20);
}

/* ---- data: every row a pure function of its coordinates ---- */

struct src_data {
        uint32_t n;
        uint8_t *x;           /* [n, row_bytes], packed */
        float *scales;        /* [n, scale_cols] */
        uint8_t *have;        /* [n]: row t of x/scales generated */
        void *topk;           /* [n, K_op] */
        float *weights[2];    /* [n, K_op]: first and cached dispatch */
};

static void gen_x_row(const struct rs_shape *sh, uint64_t gen, uint64_t index, uint32_t s,
                      uint32_t t, struct src_data *sd)
{
        uint64_t row_bytes = (uint64_t)sh->hidden * epd_dtype_size(sh->dtype);
        struct td_rng rng;

        if (sd->have[t])
                return;
        seed_rng(&rng, sh, gen, index, TAG_X, s, t);
        if (sh->dtype == EPD_DTYPE_BF16)
                td_fill_bf16(&rng, sd->x + t * row_bytes, 1, sh->hidden, 0, 0.01);
        else
                td_fill_bytes(&rng, sd->x + t * row_bytes, 1, row_bytes, 0);
        if (scale_cols(sh))
                td_fill_f32(&rng, sd->scales + (size_t)t * scale_cols(sh), 1, scale_cols(sh), 0,
                            0.5f, 2.0f);
        sd->have[t] = 1;
}

static void gen_y_row(const struct rs_shape *sh, uint64_t gen, uint64_t index, uint32_t d,
                      uint64_t i, int pass, uint16_t *out)
{
        struct td_rng rng;

        seed_rng(&rng, sh, gen, index, TAG_Y, d, i * 2 + (uint64_t)pass);
        td_fill_bf16(&rng, out, 1, sh->hidden, 0, 0.002);
}

static void src_free(struct src_data *sd)
{
        free(sd->x);
        free(sd->scales);
        free(sd->have);
        free(sd->topk);
        free(sd->weights[0]);
        free(sd->weights[1]);
        memset(sd, 0, sizeof(*sd));
}

static int src_make(const struct rs_shape *sh, const struct rs_plan *p, uint64_t gen,
                    uint64_t index, uint32_t s, int all_rows, struct src_data *sd)
{
        uint32_t n = p->num_tokens[s], K = p->num_topk;
        uint64_t row_bytes = (uint64_t)sh->hidden * epd_dtype_size(sh->dtype);
        struct td_rng rng;

        memset(sd, 0, sizeof(*sd));
        sd->n = n;
        sd->x = calloc((size_t)n * row_bytes + 1, 1);
        sd->scales = calloc((size_t)n * scale_cols(sh) + 1, sizeof(float));
        sd->have = calloc((size_t)n + 1, 1);
        sd->topk = calloc((size_t)n * K + 1, 8);
        sd->weights[0] = calloc((size_t)n * K + 1, sizeof(float));
        sd->weights[1] = calloc((size_t)n * K + 1, sizeof(float));
        if (!sd->x || !sd->scales || !sd->have || !sd->topk || !sd->weights[0] || !sd->weights[1])
                return -1;
        for (uint32_t t = 0; all_rows && t < n; t++)
                gen_x_row(sh, gen, index, s, t, sd);
        struct td_routing_args ra = {
                .world_size = sh->world_size, .num_experts = sh->num_experts, .num_tokens = n,
                .num_topk = K, .mode = p->routing, .hot_rank = p->hot_rank,
                .minus_one_prob = p->minus_one_prob, .empty_row_prob = p->empty_row_prob,
                .dtype = p->topk_dtype,
        };
        seed_rng(&rng, sh, gen, index, TAG_TOPK, s, 0);
        td_gen_topk(&rng, &ra, sd->topk);
        for (int v = 0; v < 2; v++) {
                seed_rng(&rng, sh, gen, index, TAG_WEIGHTS, s, (uint64_t)v);
                td_fill_f32(&rng, sd->weights[v], n, K, 0, 0.0f, 1.0f);
        }
        return 0;
}

/* ---- the work region ---- */

void rs_worker_init(struct rs_worker *w, const struct rs_shape *sh, uint32_t rank,
                    struct epd_client *client, struct epd_group *group)
{
        memset(w, 0, sizeof(*w));
        w->shape = sh;
        w->rank = rank;
        w->client = client;
        w->group = group;
        w->check = RS_CHECK_FULL;
        w->sample_rows = 16;
        w->wait_ms = 60000;
        td_rng_seed(&w->sample_rng, td_mix_seed(sh->seed ^ 0x5A5A5A5Aull, rank));
}

void rs_worker_fini(struct rs_worker *w)
{
        if (w->region_id && w->client)
                epd_region_release(w->client, w->region_id);
        w->region_id = 0;
        w->base = NULL;
        w->bytes = 0;
}

static int failf(struct rs_worker *w, int code, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

static int failf(struct rs_worker *w, int code, const char *fmt, ...)
{
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(w->err, sizeof(w->err), fmt, ap);
        va_end(ap);
        return code;
}

static int region_ensure(struct rs_worker *w, uint64_t need)
{
        void *base;
        int rc;

        w->used = 0;
        if (need <= w->bytes)
                return 0;
        if (w->region_id) {
                rc = epd_region_release(w->client, w->region_id);
                if (rc < 0)
                        return failf(w, RS_ERROR, "region release: %s",
                                     epd_client_last_error(w->client));
                w->region_id = 0;
        }
        need = need / 4 * 5 + (1u << 20);
        rc = epd_region_alloc(w->client, need, &base, &w->region_id);
        if (rc < 0)
                return failf(w, RS_ERROR, "region alloc of %llu bytes: %s: %s",
                             (unsigned long long)need, epd_status_name(rc),
                             epd_client_last_error(w->client));
        w->base = base;
        w->bytes = need;
        w->regions_registered++;
        return 0;
}

static void *take(struct rs_worker *w, uint64_t bytes)
{
        uint64_t off = (w->used + 63) / 64 * 64;

        if (off + bytes > w->bytes) {
                fprintf(stderr, "randstep: work region of %llu bytes exhausted (test bug)\n",
                        (unsigned long long)w->bytes);
                abort();
        }
        w->used = off + bytes + 1; /* never the same address twice */
        return w->base + off;
}

static struct epd_tensor tensor2(const struct rs_worker *w, const void *ptr, enum epd_dtype dt,
                                 uint64_t rows, uint64_t cols, uint64_t stride_elems)
{
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        t.dtype = dt;
        t.ndim = cols ? 2 : 1;
        t.sizes[0] = rows;
        t.sizes[1] = cols;
        if (cols && stride_elems && stride_elems != cols) {
                t.strides[0] = stride_elems;
                t.strides[1] = 1;
        }
        t.region_id = w->region_id;
        t.offset = (uint64_t)((const uint8_t *)ptr - w->base);
        return t;
}

/* ---- latency ---- */

unsigned rs_lat_bucket(uint64_t ns)
{
        unsigned b = 0;
        uint64_t v = ns ? ns : 1;

        /* 16 buckets per power of two: the integer log2, then 4 fraction bits. */
        int lg = 63 - __builtin_clzll(v);
        uint64_t frac = lg >= 4 ? (v >> (lg - 4)) & 15 : (v << (4 - lg)) & 15;
        b = (unsigned)lg * 16 + (unsigned)frac;
        return b < RS_LAT_BUCKETS ? b : RS_LAT_BUCKETS - 1;
}

uint64_t rs_lat_quantile(const uint64_t *hist, double q)
{
        uint64_t total = 0, seen = 0;

        for (unsigned b = 0; b < RS_LAT_BUCKETS; b++)
                total += hist[b];
        if (!total)
                return 0;
        for (unsigned b = 0; b < RS_LAT_BUCKETS; b++) {
                seen += hist[b];
                if ((double)seen >= q * (double)total) {
                        unsigned lg = (b + 1) / 16, frac = (b + 1) % 16;
                        return ((uint64_t)(16 + frac) << lg) / 16;
                }
        }
        return 0;
}

/* ---- one op ---- */

/* Waits for op; RS_OK, RS_OP_FAILED (status recorded) or RS_ERROR (hang). */
static int op_finish(struct rs_worker *w, struct epd_op *op, uint64_t t0, unsigned op_in_step,
                     const char *what)
{
        int rc = epd_op_wait(op, w->wait_ms);
        uint64_t t1 = rs_now_ns();

        if (rc == EPD_TIMEOUT && strcmp(epd_op_error(op), "op not completed") == 0)
                return failf(w, RS_ERROR, "%s (op %u of the step) did not complete within %d ms",
                             what, op_in_step, w->wait_ms);
        if (rc < 0) {
                w->fail_status = rc;
                w->fail_ns = t1;
                w->fail_submit_ns = t0;
                w->fail_op_in_step = op_in_step;
                return failf(w, RS_OP_FAILED, "%s: %s: %s", what, epd_status_name(rc),
                             epd_op_error(op));
        }
        if (w->lat_hist)
                __atomic_fetch_add(&w->lat_hist[rs_lat_bucket(t1 - t0)], 1, __ATOMIC_RELAXED);
        w->ops_ok++;
        return RS_OK;
}

static int hook(struct rs_worker *w, enum rs_point pt, uint64_t index, unsigned op_in_step,
                unsigned num_ops)
{
        if (w->hook && w->hook(w->hook_ctx, pt, index, op_in_step, num_ops) != 0)
                return failf(w, RS_ERROR, "hook refused op %u of step %llu", op_in_step,
                             (unsigned long long)index);
        return 0;
}

/* ---- checks ---- */

static int cmp_row(struct rs_worker *w, const void *want, const void *got, size_t bytes,
                   int64_t row, const char *field)
{
        const uint8_t *a = want, *b = got;

        for (size_t i = 0; i < bytes; i++)
                if (a[i] != b[i])
                        return failf(w, RS_MISMATCH,
                                     "rank %u row %lld field %s byte %zu: expected 0x%02x, got 0x%02x",
                                     w->rank, (long long)row, field, i, a[i], b[i]);
        return 0;
}

static const uint8_t *row_at(struct ref_buf b, uint64_t packed, int64_t i)
{
        return (const uint8_t *)b.ptr + (uint64_t)i * (b.stride ? b.stride : packed);
}

/* SAMPLED: metadata of every row, zero padding, and the payload of sample_rows rows. */
static int check_dispatch_sampled(struct rs_worker *w, const struct ref_dispatch *ref,
                                  struct src_data *srcs, uint64_t gen, uint64_t index,
                                  const struct ref_dispatch_actual *act)
{
        const struct ref_dst *dst = &ref->dst[w->rank];
        const uint32_t K = ref->p.num_topk;
        const int expand = ref->p.layout == EPD_LAYOUT_EXPAND;
        const size_t esz = ref->p.topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        const uint64_t scale_bytes = ref->scale_bytes;
        uint8_t expect[32 * 8];

        for (int64_t i = 0; i < dst->rows; i++) {
                enum ref_row_kind kind = dst->row_kind[i];

                if (kind == REF_ROW_PAD_ZERO) {
                        const uint8_t *a = row_at(act->recv_x, ref->row_bytes, i);
                        for (uint64_t b = 0; b < ref->row_bytes; b++)
                                if (a[b])
                                        return failf(w, RS_MISMATCH,
                                                     "rank %u row %lld recv_x (zero padding) byte %llu is 0x%02x",
                                                     w->rank, (long long)i,
                                                     (unsigned long long)b, a[b]);
                }
                if (!expand && act->recv_topk_idx.ptr) {
                        for (uint32_t k = 0; k < K; k++) {
                                int64_t v = dst->recv_topk_idx[(size_t)i * K + k];
                                int32_t v32 = (int32_t)v;
                                if (esz == 8)
                                        memcpy(expect + k * 8, &v, 8);
                                else
                                        memcpy(expect + k * 4, &v32, 4);
                        }
                        if (cmp_row(w, expect, row_at(act->recv_topk_idx, K * esz, i), K * esz, i,
                                    "recv_topk_idx"))
                                return RS_MISMATCH;
                }
                if (ref->p.has_weights && act->recv_weights.ptr && kind != REF_ROW_PAD_UNWRITTEN &&
                    cmp_row(w, dst->recv_weights + (expand ? (size_t)i : (size_t)i * K),
                            row_at(act->recv_weights, expand ? 4 : (uint64_t)K * 4, i),
                            expand ? 4 : (size_t)K * 4, i, "recv_weights"))
                        return RS_MISMATCH;
                if (cmp_row(w, &dst->recv_src[i], row_at(act->recv_src, 8, i), 8, i, "recv_src"))
                        return RS_MISMATCH;
                if (expand && cmp_row(w, &dst->recv_topk_slot[i],
                                      row_at(act->recv_topk_slot, 4, i), 4, i, "recv_topk_slot"))
                        return RS_MISMATCH;
        }
        for (uint32_t n = 0; dst->rows > 0 && n < w->sample_rows; n++) {
                int64_t i = (int64_t)td_rng_below(&w->sample_rng, (uint32_t)dst->rows);
                uint32_t s, t;

                if (dst->row_kind[i] != REF_ROW_DATA)
                        continue;
                s = (uint32_t)dst->row_src[i];
                t = (uint32_t)dst->row_token[i];
                gen_x_row(w->shape, gen, index, s, t, &srcs[s]);
                if (cmp_row(w, ref_expected_x(ref, w->rank, i),
                            row_at(act->recv_x, ref->row_bytes, i), ref->row_bytes, i, "recv_x"))
                        return RS_MISMATCH;
                if (scale_bytes && act->recv_scales.ptr &&
                    cmp_row(w, ref_expected_scales(ref, w->rank, i),
                            row_at(act->recv_scales, scale_bytes, i), scale_bytes, i,
                            "recv_scales"))
                        return RS_MISMATCH;
                w->rows_checked++;
        }
        return 0;
}

/* The y rows that combined row t of source s reads, generated into ys. */
static void fill_y_for_token(struct rs_worker *w, const struct ref_dispatch *ref, uint64_t gen,
                             uint64_t index, int pass, uint32_t s, uint32_t t, uint16_t **ys,
                             uint8_t **have)
{
        const uint32_t K = ref->p.num_topk, L = ref->num_local_experts, H = ref->p.hidden;
        const int32_t *sel = ref->topk[s] + (size_t)t * K;

        for (uint32_t k = 0; k < K; k++) {
                uint32_t d;
                int64_t row;

                if (sel[k] < 0)
                        continue;
                d = (uint32_t)sel[k] / L;
                row = ref->p.layout == EPD_LAYOUT_EXPAND ? ref_expand_row(ref, s, t, k)
                                                         : ref_non_expand_row(ref, d, s, t);
                if (row < 0 || have[d][row])
                        continue;
                gen_y_row(w->shape, gen, index, d, (uint64_t)row, pass, ys[d] + (size_t)row * H);
                have[d][row] = 1;
        }
}

/* ---- a step ---- */

struct step_mem {
        struct src_data src[RS_MAX_RANKS];
        struct ref_src rsrc[RS_MAX_RANKS];
        uint16_t *y[RS_MAX_RANKS];
        uint8_t *y_have[RS_MAX_RANKS];
        struct ref_buf ybuf[RS_MAX_RANKS];
        struct ref_dispatch *ref;
        struct epd_op *op;
};

static void step_mem_free(struct step_mem *m, uint32_t R)
{
        for (uint32_t r = 0; r < R; r++) {
                src_free(&m->src[r]);
                free(m->y[r]);
                free(m->y_have[r]);
        }
        ref_dispatch_free(m->ref);
        epd_op_free(m->op);
        memset(m, 0, sizeof(*m));
}

static void ref_params_of(const struct rs_shape *sh, const struct rs_plan *p,
                          struct ref_params *rp)
{
        memset(rp, 0, sizeof(*rp));
        rp->world_size = sh->world_size;
        rp->num_experts = sh->num_experts;
        rp->hidden = sh->hidden;
        rp->max_tokens = sh->max_tokens;
        rp->num_topk = p->num_topk;
        rp->dtype = sh->dtype;
        rp->scale_block = RS_SCALE_BLOCK;
        rp->topk_dtype = p->topk_dtype;
        rp->layout = p->layout;
        rp->expert_alignment = p->expert_alignment;
        rp->zero_padding = p->zero_padding;
        rp->has_weights = p->has_weights;
}

static int build_ref(struct rs_worker *w, struct step_mem *m, const struct rs_plan *p, int wv)
{
        const struct rs_shape *sh = w->shape;
        uint64_t row_bytes = (uint64_t)sh->hidden * epd_dtype_size(sh->dtype);
        struct ref_params rp;
        char err[512];
        int rc;

        ref_params_of(sh, p, &rp);
        for (uint32_t s = 0; s < sh->world_size; s++)
                m->rsrc[s] = (struct ref_src){
                        .num_tokens = m->src[s].n,
                        .x = { m->src[s].x, row_bytes },
                        .scales = { scale_cols(sh) ? m->src[s].scales : NULL, 0 },
                        .topk_idx = { m->src[s].topk, 0 },
                        .weights = { p->has_weights ? m->src[s].weights[wv] : NULL, 0 },
                };
        m->ref = ref_dispatch_free(m->ref);
        rc = ref_dispatch_new(&rp, m->rsrc, &m->ref, err, sizeof(err));
        if (rc < 0)
                return failf(w, RS_ERROR, "reference: %s", err);
        return 0;
}

int rs_step_run(struct rs_worker *w, const struct rs_plan *p, uint64_t gen, uint64_t index)
{
        const struct rs_shape *sh = w->shape;
        const uint32_t R = sh->world_size, H = sh->hidden, K = p->num_topk, me = w->rank;
        const uint32_t sc = scale_cols(sh);
        const size_t xe = epd_dtype_size(sh->dtype), te = epd_dtype_size(p->topk_dtype);
        const int expand = p->layout == EPD_LAYOUT_EXPAND;
        const int full = w->check == RS_CHECK_FULL;
        const uint64_t row_bytes = (uint64_t)H * xe;
        const uint64_t xs = row_bytes + (uint64_t)p->row_padding[me] * xe;
        struct step_mem m;
        struct epd_dispatch_result dr;
        struct ref_dispatch_actual act;
        struct td_rng rng;
        char desc[512];
        uint64_t t0, handle = 0;
        int rc;

        memset(&m, 0, sizeof(m));
        memset(&act, 0, sizeof(act));
        for (uint32_t s = 0; s < R; s++)
                if (src_make(sh, p, gen, index, s, full || s == me, &m.src[s]) < 0) {
                        rc = failf(w, RS_ERROR, "out of memory");
                        goto out;
                }
        rc = build_ref(w, &m, p, 0);
        if (rc)
                goto out;

        const struct ref_dst *mine = &m.ref->dst[me];
        const int64_t rows = mine->rows;
        const uint32_t n = m.src[me].n;
        seed_rng(&rng, sh, gen, index, TAG_CAP, me, 0);
        const uint64_t cap = (uint64_t)rows + 1 + td_rng_below(&rng, 4);
        /* The arena is used only where this process can read it: a GPU backend gives a
         * CUDA-capable client a device arena, which libepd does not map. */
        uint64_t arena_bytes = 0;
        const int arena = p->use_arena[me] && epd_group_arena(w->group, &arena_bytes) != NULL;
        uint64_t need = (uint64_t)n * (xs + sc * 4 + K * (te + 4)) + (uint64_t)rows * H * 2 +
                        3ull * n * H * 2 + (uint64_t)n * K * 4 + 64 * 32;
        if (!arena)
                need += cap * (xs + sc * 4 + K * (te + 4) + 12);
        rc = region_ensure(w, need);
        if (rc)
                goto out;

        /* Inputs. */
        uint8_t *x = take(w, (uint64_t)n * xs);
        for (uint32_t t = 0; t < n; t++)
                memcpy(x + t * xs, m.src[me].x + t * row_bytes, row_bytes);
        float *scales = take(w, (uint64_t)n * sc * 4);
        memcpy(scales, m.src[me].scales, (size_t)n * sc * 4);
        void *topk = take(w, (uint64_t)n * K * te);
        memcpy(topk, m.src[me].topk, (size_t)n * K * te);
        float *weights = take(w, (uint64_t)n * K * 4);
        memcpy(weights, m.src[me].weights[0], (size_t)n * K * 4);

        struct epd_dispatch_args da = {
                .size = sizeof(da), .num_tokens = n, .num_topk = K, .layout = p->layout,
                .expert_alignment = p->expert_alignment, .zero_padding = p->zero_padding,
                .use_arena = arena,
        };
        /* A rank without tokens may leave x and scales out, but topk_idx (its dtype) and
         * topk_weights (their presence) are compared across ranks, so they are always given. */
        if (n > 0) {
                da.x = tensor2(w, x, sh->dtype, n, H, H + p->row_padding[me]);
                if (sc)
                        da.scales = tensor2(w, scales, EPD_DTYPE_FP32, n, sc, 0);
        }
        da.topk_idx = tensor2(w, topk, p->topk_dtype, n, K, 0);
        if (p->has_weights)
                da.topk_weights = tensor2(w, weights, EPD_DTYPE_FP32, n, K, 0);
        uint8_t *o_x = NULL, *o_scales = NULL, *o_topk = NULL, *o_w = NULL, *o_src = NULL,
                *o_slot = NULL;
        if (!arena) {
                o_x = take(w, cap * xs);
                memset(o_x, 0xAB, cap * xs);
                da.recv_x = tensor2(w, o_x, sh->dtype, cap, H, H + p->row_padding[me]);
                act.recv_x = (struct ref_buf){ o_x, xs };
                if (sc) {
                        o_scales = take(w, cap * sc * 4);
                        da.recv_scales = tensor2(w, o_scales, EPD_DTYPE_FP32, cap, sc, 0);
                        act.recv_scales = (struct ref_buf){ o_scales, 0 };
                }
                if (!expand) {
                        o_topk = take(w, cap * K * te);
                        da.recv_topk_idx = tensor2(w, o_topk, p->topk_dtype, cap, K, 0);
                        act.recv_topk_idx = (struct ref_buf){ o_topk, 0 };
                }
                if (p->has_weights) {
                        o_w = take(w, cap * (expand ? 1 : K) * 4);
                        da.recv_weights = tensor2(w, o_w, EPD_DTYPE_FP32, cap, expand ? 0 : K, 0);
                        act.recv_weights = (struct ref_buf){ o_w, 0 };
                }
                o_src = take(w, cap * 8);
                da.recv_src = tensor2(w, o_src, EPD_DTYPE_INT64, cap, 0, 0);
                act.recv_src = (struct ref_buf){ o_src, 0 };
                if (expand) {
                        o_slot = take(w, cap * 4);
                        da.recv_topk_slot = tensor2(w, o_slot, EPD_DTYPE_INT32, cap, 0, 0);
                        act.recv_topk_slot = (struct ref_buf){ o_slot, 0 };
                }
        }

        for (unsigned op_i = 0; op_i + 1 < p->num_ops; op_i++) {
                struct epd_dispatch_args cur = da;
                const char *what = op_i ? "cached dispatch" : "dispatch";

                if (op_i == 1) {
                        /* Cached dispatch: new weights on every rank, same routing; every output
                         * is rewritten, so poison them first. */
                        memcpy(weights, m.src[me].weights[1], (size_t)n * K * 4);
                        rc = build_ref(w, &m, p, 1);
                        if (rc)
                                goto out;
                        if (o_x) {
                                memset(o_x, 0xCD, cap * xs);
                                if (o_w)
                                        memset(o_w, 0xCD, cap * (expand ? 1 : K) * 4);
                                memset(o_src, 0xCD, cap * 8);
                        } else if (rows > 0 && dr.recv_x_ptr) {
                                memset(dr.recv_x_ptr, 0xCD, (size_t)rows * row_bytes);
                                if (dr.recv_weights_ptr)
                                        memset(dr.recv_weights_ptr, 0xCD,
                                               (size_t)rows * (expand ? 1 : K) * 4);
                        }
                        memset(&cur.topk_idx, 0, sizeof(cur.topk_idx));
                        cur.handle_id = handle;
                        epd_op_free(m.op);
                        m.op = NULL;
                }
                rc = hook(w, RS_BEFORE_SUBMIT, index, op_i, p->num_ops);
                if (rc)
                        goto out;
                t0 = rs_now_ns();
                rc = epd_dispatch_submit(w->group, &cur, &m.op);
                if (rc < 0) {
                        rc = failf(w, RS_ERROR, "%s submit: %s", what,
                                   epd_client_last_error(w->client));
                        goto out;
                }
                rc = hook(w, RS_AFTER_SUBMIT, index, op_i, p->num_ops);
                if (rc)
                        goto out;
                rc = op_finish(w, m.op, t0, op_i, what);
                if (rc) {
                        if (rc == RS_ERROR)
                                m.op = NULL; /* still pending: freeing it would wait */
                        goto out;
                }
                epd_op_dispatch_result(m.op, &dr);
                w->last_exec_ns = dr.exec_ns;
                if (op_i == 1 && dr.handle_id != handle) {
                        rc = failf(w, RS_MISMATCH, "cached dispatch returned handle %llu, not %llu",
                                   (unsigned long long)dr.handle_id, (unsigned long long)handle);
                        goto out;
                }
                handle = dr.handle_id;
                struct ref_counts_actual counts = {
                        dr.num_recv_tokens, dr.num_expanded_rows, dr.num_recv_tokens_per_expert,
                        dr.num_recv_tokens_per_expert_aligned, dr.rank_prefix,
                };
                char err[512];
                if (ref_check_counts(m.ref, me, &counts, err, sizeof(err)) != 0) {
                        rc = failf(w, RS_MISMATCH, "%s counts: %s", what, err);
                        goto out;
                }
                if (arena) {
                        act.recv_x = (struct ref_buf){ dr.recv_x_ptr, 0 };
                        act.recv_scales = (struct ref_buf){ dr.recv_scales_ptr, 0 };
                        act.recv_topk_idx = (struct ref_buf){ dr.recv_topk_idx_ptr, 0 };
                        act.recv_weights = (struct ref_buf){ dr.recv_weights_ptr, 0 };
                        act.recv_src = (struct ref_buf){ dr.recv_src_ptr, 0 };
                        act.recv_topk_slot = (struct ref_buf){ dr.recv_topk_slot_ptr, 0 };
                }
                if (rows == 0)
                        continue; /* nothing to compare; an empty arena reply has no tensors */
                if (full) {
                        if (ref_check_dispatch(m.ref, me, &act, err, sizeof(err)) != 0) {
                                rc = failf(w, RS_MISMATCH, "%s outputs: %s", what, err);
                                goto out;
                        }
                        w->rows_checked += (uint64_t)rows;
                } else {
                        if (!act.recv_x.ptr || !act.recv_src.ptr ||
                            (expand && !act.recv_topk_slot.ptr)) {
                                rc = failf(w, RS_MISMATCH, "%s: a required output is missing",
                                           what);
                                goto out;
                        }
                        rc = check_dispatch_sampled(w, m.ref, m.src, gen, index, &act);
                        if (rc) {
                                char tmp[sizeof(w->err)];
                                snprintf(tmp, sizeof(tmp), "%s", w->err);
                                rc = failf(w, RS_MISMATCH, "%s outputs: %s", what, tmp);
                                goto out;
                        }
                }
        }
        epd_op_free(m.op);
        m.op = NULL;

        /* Stand-in expert: y of destination d, row i, is seeded by (d, i); full checks make
         * every destination's y, sampled checks only the rows their samples read. */
        for (uint32_t d = 0; d < R; d++) {
                int64_t r_d = m.ref->dst[d].rows;
                m.y[d] = malloc((size_t)r_d * H * 2 + 2);
                m.y_have[d] = calloc((size_t)r_d + 1, 1);
                if (!m.y[d] || !m.y_have[d]) {
                        rc = failf(w, RS_ERROR, "out of memory");
                        goto out;
                }
                if (full || d == me) {
                        for (int64_t i = 0; i < r_d; i++)
                                gen_y_row(sh, gen, index, d, (uint64_t)i, p->cached,
                                          m.y[d] + (size_t)i * H);
                        memset(m.y_have[d], 1, (size_t)r_d);
                }
                m.ybuf[d] = (struct ref_buf){ m.y[d], 0 };
        }
        struct epd_combine_args cb = { .size = sizeof(cb), .handle_id = handle,
                                       .apply_weights = p->apply_weights,
                                       .num_bias = p->num_bias[me] };
        if (rows > 0) {
                if (p->y_in_arena[me] && arena && dr.recv_x_ptr) {
                        /* In place, as an expert would: y overwrites recv_x in the arena. */
                        memcpy(dr.recv_x_ptr, m.y[me], (size_t)rows * H * 2);
                        cb.y = dr.recv_x;
                        cb.y.dtype = EPD_DTYPE_BF16;
                } else {
                        uint16_t *y = take(w, (uint64_t)rows * H * 2);
                        memcpy(y, m.y[me], (size_t)rows * H * 2);
                        cb.y = tensor2(w, y, EPD_DTYPE_BF16, (uint64_t)rows, H, 0);
                }
        }
        struct ref_buf bias[2] = { { NULL, 0 }, { NULL, 0 } };
        for (uint32_t b = 0; b < p->num_bias[me]; b++) {
                uint16_t *bb = take(w, (uint64_t)n * H * 2 + 2);
                seed_rng(&rng, sh, gen, index, TAG_BIAS, me, b);
                td_fill_bf16(&rng, bb, n, H, 0, 0.0);
                if (n > 0)
                        cb.bias[b] = tensor2(w, bb, EPD_DTYPE_BF16, n, H, 0);
                bias[b] = (struct ref_buf){ bb, 0 };
        }
        uint16_t *combined = take(w, (uint64_t)n * H * 2 + 2);
        memset(combined, 0xEE, (size_t)n * H * 2);
        if (n > 0)
                cb.combined = tensor2(w, combined, EPD_DTYPE_BF16, n, H, 0);
        float *cw = NULL;
        if (p->combined_weights) {
                cw = take(w, (uint64_t)n * K * 4 + 4);
                memset(cw, 0xEE, (size_t)n * K * 4);
                if (n > 0)
                        cb.combined_topk_weights = tensor2(w, cw, EPD_DTYPE_FP32, n, K, 0);
        }
        unsigned op_c = p->num_ops - 1;
        rc = hook(w, RS_BEFORE_SUBMIT, index, op_c, p->num_ops);
        if (rc)
                goto out;
        t0 = rs_now_ns();
        rc = epd_combine_submit(w->group, &cb, &m.op);
        if (rc < 0) {
                rc = failf(w, RS_ERROR, "combine submit: %s", epd_client_last_error(w->client));
                goto out;
        }
        rc = hook(w, RS_AFTER_SUBMIT, index, op_c, p->num_ops);
        if (rc)
                goto out;
        rc = op_finish(w, m.op, t0, op_c, "combine");
        if (rc) {
                if (rc == RS_ERROR)
                        m.op = NULL;
                goto out;
        }
        struct ref_combine_in cin = { m.ybuf, p->apply_weights };
        char err[512];
        if (full) {
                if (ref_check_combine(m.ref, &cin, me, bias, (struct ref_buf){ combined, 0 },
                                      (struct ref_buf){ cw, 0 }, err, sizeof(err)) != 0) {
                        rc = failf(w, RS_MISMATCH, "combine outputs: %s", err);
                        goto out;
                }
                w->full_checks++;
        } else {
                uint16_t *row = malloc((size_t)H * 2 + 2);
                uint32_t cwr[32];
                for (uint32_t k = 0; row && n > 0 && k < w->sample_rows; k++) {
                        uint32_t t = td_rng_below(&w->sample_rng, n);
                        fill_y_for_token(w, m.ref, gen, index, p->cached, me, t, m.y, m.y_have);
                        if (ref_combine_row(m.ref, &cin, me, bias, t, row, cwr) != 0) {
                                free(row);
                                rc = failf(w, RS_ERROR, "reference combine of row %u failed", t);
                                goto out;
                        }
                        if (cmp_row(w, row, combined + (size_t)t * H, (size_t)H * 2, t,
                                    "combined") ||
                            (cw && p->has_weights &&
                             cmp_row(w, cwr, cw + (size_t)t * K, (size_t)K * 4, t,
                                     "combined_topk_weights"))) {
                                char tmp[sizeof(w->err)];
                                snprintf(tmp, sizeof(tmp), "%s", w->err);
                                free(row);
                                rc = failf(w, RS_MISMATCH, "combine outputs: %s", tmp);
                                goto out;
                        }
                }
                free(row);
                w->sampled_checks++;
        }
        epd_op_free(m.op);
        m.op = NULL;
        rc = epd_handle_release(w->group, handle);
        if (rc < 0) {
                rc = failf(w, RS_ERROR, "handle release: %s", epd_client_last_error(w->client));
                goto out;
        }
        w->steps_ok++;
        rc = RS_OK;
out:
        if (rc == RS_MISMATCH || rc == RS_ERROR) {
                char tmp[sizeof(w->err)];
                snprintf(tmp, sizeof(tmp), "%s", w->err);
                failf(w, rc, "[seed=%llu gen=%llu step=%llu rank=%u %s] %s",
                      (unsigned long long)sh->seed, (unsigned long long)gen,
                      (unsigned long long)index, me, rs_plan_describe(p, R, desc, sizeof(desc)),
                      tmp);
        }
        step_mem_free(&m, R);
        return rc;
}

int rs_enter_group(struct epd_client *c, const char *name, uint32_t rank,
                   const struct epd_group_config *cfg, struct epd_group **out, int timeout_ms)
{
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = name, .secret = secret,
                                     .secret_len = sizeof(secret), .rank = rank, .config = cfg };
        uint64_t deadline = rs_now_ns() + (uint64_t)timeout_ms * 1000000ull;
        uint64_t h = 1469598103934665603ull;
        int rc;

        for (const char *q = name; *q; q++)
                h = (h ^ (unsigned char)*q) * 1099511628211ull;
        for (int i = 0; i < 16; i++) {
                h = (h ^ (uint64_t)i) * 1099511628211ull;
                secret[i] = (unsigned char)(h >> 56);
        }
        for (;;) {
                int raced = 0;

                rc = epd_group_join(c, &ga, out);
                if (rc == EPD_NOT_FOUND) {
                        rc = epd_group_create(c, &ga, out);
                        raced = rc == EPD_ALREADY_EXISTS; /* another rank created it first */
                }
                if (rc != EPD_ALREADY_EXISTS)
                        return rc; /* done, or an error */
                /* Else the rank is still bound to a client the daemon has not yet seen die. */
                if (rs_now_ns() > deadline)
                        return rc;
                if (!raced)
                        usleep(2000);
        }
}
