/* oracle.c - expected dispatch and combine outputs from the CPU executor (see oracle.h).
 *
 * A destination's expected dispatch is the executor's own run, restricted to that destination: a
 * copy of the plan whose rows for other destinations are -1, so that the executor's token items
 * write only destination d's rows, plus d's padding items. Only one destination's outputs are in
 * memory at a time, which the benchmark's workers (one per rank, each checking itself) need.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exec.h"
#include "oracle.h"
#include "routing.h"

static size_t topk_size(const struct oracle *o)
{
        return o->p.topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
}

int oracle_new(const struct oracle_params *p, const struct oracle_src *src, struct oracle **out,
               char *err, size_t err_len)
{
        struct oracle *o;
        uint32_t *num_tokens;
        int rc = EPD_INTERNAL;

        *out = NULL;
        if (p->world_size == 0 || p->num_experts % p->world_size != 0 ||
            (p->dtype != EPD_DTYPE_BF16 && p->dtype != EPD_DTYPE_FP8_E4M3) ||
            (p->topk_dtype != EPD_DTYPE_INT32 && p->topk_dtype != EPD_DTYPE_INT64)) {
                snprintf(err, err_len, "invalid parameters");
                return EPD_INVALID_ARGUMENT;
        }
        o = calloc(1, sizeof(*o));
        num_tokens = calloc(p->world_size, sizeof(*num_tokens));
        if (!o || !num_tokens)
                goto fail;
        o->p = *p;
        if (!o->p.scale_block)
                o->p.scale_block = 128;
        if (!o->p.expert_alignment)
                o->p.expert_alignment = 1;
        o->row_bytes = (uint64_t)p->hidden * epd_dtype_size(p->dtype);
        o->scale_bytes = p->dtype == EPD_DTYPE_FP8_E4M3
                                 ? (uint64_t)(p->hidden / o->p.scale_block) * 4
                                 : 0;
        o->has_weights = 1;
        o->src = calloc(p->world_size, sizeof(*o->src));
        if (!o->src)
                goto fail;
        for (uint32_t s = 0; s < p->world_size; s++) {
                o->src[s] = src[s];
                num_tokens[s] = src[s].num_tokens;
                if (!src[s].weights)
                        o->has_weights = 0;
        }
        o->plan = epd_plan_new(p->world_size, p->num_experts, p->max_tokens, p->num_topk,
                               o->p.expert_alignment, p->layout, num_tokens);
        if (!o->plan) {
                snprintf(err, err_len, "cannot build a plan for these dimensions");
                rc = EPD_INVALID_ARGUMENT;
                goto fail;
        }
        for (uint32_t s = 0; s < p->world_size; s++) {
                rc = epd_plan_count_source(o->plan, s, src[s].topk_idx, p->topk_dtype, 0, err,
                                           err_len);
                if (rc < 0)
                        goto fail;
        }
        epd_plan_finish(o->plan);
        for (uint32_t s = 0; s < p->world_size; s++)
                epd_plan_place_source(o->plan, s);
        free(num_tokens);
        *out = o;
        return 0;
fail:
        if (rc == EPD_INTERNAL)
                snprintf(err, err_len, "out of memory");
        free(num_tokens);
        oracle_free(o);
        return rc;
}

struct oracle *oracle_free(struct oracle *o)
{
        if (!o)
                return NULL;
        epd_plan_free(o->plan);
        free(o->src);
        free(o);
        return NULL;
}

int64_t oracle_rows(const struct oracle *o, uint32_t d)
{
        return epd_plan_rows(o->plan, d);
}

/* The executor's view of source s's inputs (packed rows). */
static struct epd_dispatch_src_io src_io(const struct oracle *o, uint32_t s)
{
        const struct oracle_src *in = &o->src[s];

        return (struct epd_dispatch_src_io){
                .x = { (uint8_t *)in->x, o->row_bytes },
                .scales = { (uint8_t *)in->scales, o->scale_bytes },
                .weights = { (uint8_t *)in->weights, (uint64_t)o->p.num_topk * 4 },
        };
}

/* Bytes per row of each output field in the layout; 0 for a field the layout does not have. */
static void field_sizes(const struct oracle *o, uint64_t sz[6])
{
        const int expand = o->p.layout == EPD_LAYOUT_EXPAND;
        const uint64_t K = o->p.num_topk;

        sz[0] = o->row_bytes;
        sz[1] = o->scale_bytes;
        sz[2] = expand ? 0 : K * topk_size(o);
        sz[3] = o->has_weights ? (expand ? 4 : K * 4) : 0;
        sz[4] = 8;
        sz[5] = expand ? 4 : 0;
}

static void **out_field(struct oracle_dispatch_out *out, int i)
{
        void **f[6] = { &out->recv_x,       &out->recv_scales, &out->recv_topk_idx,
                        &out->recv_weights, &out->recv_src,    &out->recv_topk_slot };
        return f[i];
}

static const char *const field_names[6] = {
        "recv_x", "recv_scales", "recv_topk_idx", "recv_weights", "recv_src", "recv_topk_slot",
};

void oracle_dispatch_out_free(struct oracle_dispatch_out *out)
{
        for (int i = 0; i < 6; i++) {
                free(*out_field(out, i));
                *out_field(out, i) = NULL;
        }
}

int oracle_dispatch_expected(const struct oracle *o, uint32_t d, struct oracle_dispatch_out *out)
{
        const uint32_t R = o->p.world_size, K = o->p.num_topk, L = o->plan->num_local_experts;
        const int64_t rows = oracle_rows(o, d);
        struct epd_plan masked = *o->plan;
        struct epd_dispatch_src_io *src = calloc(R, sizeof(*src));
        struct epd_dispatch_dst_io *dst = calloc(R, sizeof(*dst));
        int32_t **row = calloc(R, sizeof(*row));
        struct epd_dispatch_exec ex;
        uint64_t sz[6], token_items;
        int rc = EPD_INTERNAL;

        memset(out, 0, sizeof(*out));
        field_sizes(o, sz);
        if (!src || !dst || !row)
                goto out;
        for (uint32_t s = 0; s < R; s++) {
                const size_t n = (size_t)o->plan->num_tokens[s] * K;

                src[s] = src_io(o, s);
                row[s] = malloc((n ? n : 1) * sizeof(int32_t));
                if (!row[s])
                        goto out;
                for (size_t i = 0; i < n; i++) {
                        int32_t sel = o->plan->topk[s][i];
                        row[s][i] = sel >= 0 && epd_route_expert_rank(sel, L) == d
                                            ? o->plan->row[s][i]
                                            : -1;
                }
        }
        masked.row = row;
        for (int i = 0; i < 6; i++) {
                if (!sz[i])
                        continue;
                /* Unwritten padding payload (no zero_padding) stays zero here; it is not
                 * compared. */
                *out_field(out, i) = calloc(rows > 0 ? (size_t)rows : 1, sz[i]);
                if (!*out_field(out, i))
                        goto out;
        }
        dst[d] = (struct epd_dispatch_dst_io){
                .recv_x = { out->recv_x, sz[0] },
                .recv_scales = { out->recv_scales, sz[1] },
                .recv_topk_idx = { out->recv_topk_idx, sz[2] },
                .recv_weights = { out->recv_weights, sz[3] },
                .recv_src = { out->recv_src, sz[4] },
                .recv_topk_slot = { out->recv_topk_slot, sz[5] },
        };
        ex = (struct epd_dispatch_exec){
                .plan = &masked, .row_bytes = o->row_bytes, .scale_bytes = o->scale_bytes,
                .topk_dtype = o->p.topk_dtype, .has_weights = o->has_weights,
                .zero_padding = o->p.zero_padding, .src = src, .dst = dst,
        };
        /* Token items first (R sources x chunks), then one padding item per (destination, local
         * expert) in EXPAND: d's are d * L .. d * L + L - 1 after the token items. */
        token_items = epd_host_dispatch_items(&ex);
        if (o->p.layout == EPD_LAYOUT_EXPAND)
                token_items -= (uint64_t)R * L;
        for (uint64_t i = 0; i < token_items; i++)
                epd_host_dispatch_item(&ex, i);
        if (o->p.layout == EPD_LAYOUT_EXPAND)
                for (uint32_t l = 0; l < L; l++)
                        epd_host_dispatch_item(&ex, token_items + (uint64_t)d * L + l);
        rc = 0;
out:
        for (uint32_t s = 0; row && s < R; s++)
                free(row[s]);
        free(row);
        free(src);
        free(dst);
        if (rc < 0)
                oracle_dispatch_out_free(out);
        return rc;
}

/* Compares n bytes; at the first difference describes it and returns 1. */
static int cmp_bytes(const uint8_t *want, const uint8_t *got, uint64_t n, uint32_t rank,
                     int64_t row, const char *field, char *msg, size_t msg_len)
{
        if (memcmp(want, got, n) == 0)
                return 0;
        for (uint64_t i = 0; i < n; i++) {
                if (want[i] != got[i]) {
                        snprintf(msg, msg_len,
                                 "rank %u row %lld field %s byte %llu: expected 0x%02x, got 0x%02x",
                                 rank, (long long)row, field, (unsigned long long)i,
                                 want[i], got[i]);
                        break;
                }
        }
        return 1;
}

static int cmp_counts(const int32_t *want, const int32_t *got, uint32_t n, uint32_t rank,
                      const char *what, char *msg, size_t msg_len)
{
        for (uint32_t i = 0; got && i < n; i++) {
                if (want[i] != got[i]) {
                        snprintf(msg, msg_len, "rank %u %s[%u]: expected %d, got %d", rank, what,
                                 i, want[i], got[i]);
                        return 1;
                }
        }
        return 0;
}

int oracle_check_counts(const struct oracle *o, uint32_t d, const struct epd_dispatch_result *dr,
                        char *msg, size_t msg_len)
{
        const struct epd_plan *plan = o->plan;
        const uint32_t R = o->p.world_size, L = plan->num_local_experts;
        const int32_t recv = epd_plan_num_recv_tokens(plan, d);
        const int32_t expanded = epd_plan_num_expanded_rows(plan, d);

        if (dr->num_recv_tokens != recv || dr->num_expanded_rows != expanded) {
                snprintf(msg, msg_len,
                         "rank %u num_recv_tokens %d num_expanded_rows %d: expected %d and %d", d,
                         dr->num_recv_tokens, dr->num_expanded_rows, recv, expanded);
                return 1;
        }
        if (cmp_counts(plan->expert_count + (size_t)d * L, dr->num_recv_tokens_per_expert, L, d,
                       "num_recv_tokens_per_expert", msg, msg_len) ||
            cmp_counts(plan->expert_aligned + (size_t)d * L,
                       dr->num_recv_tokens_per_expert_aligned, L, d,
                       "num_recv_tokens_per_expert_aligned", msg, msg_len) ||
            cmp_counts(plan->rank_prefix + (size_t)d * (R + 1), dr->rank_prefix, R + 1, d,
                       "rank_prefix", msg, msg_len))
                return 1;
        return 0;
}

/* Whether row r of destination d is EXPAND padding (after a local expert's selections). */
static int is_padding(const struct oracle *o, uint32_t d, int64_t r)
{
        const struct epd_plan *plan = o->plan;
        const uint32_t L = plan->num_local_experts;
        const int32_t *base = plan->expert_base + (size_t)d * (L + 1);

        if (o->p.layout != EPD_LAYOUT_EXPAND)
                return 0;
        for (uint32_t l = 0; l < L; l++)
                if (r >= base[l] && r < base[l + 1])
                        return r >= base[l] + plan->expert_count[(size_t)d * L + l];
        return 0;
}

int oracle_check_dispatch(const struct oracle *o, uint32_t d,
                          const struct oracle_dispatch_out *actual, char *msg, size_t msg_len)
{
        const int64_t rows = oracle_rows(o, d);
        const int expand = o->p.layout == EPD_LAYOUT_EXPAND;
        struct oracle_dispatch_out want, got = *actual;
        uint64_t sz[6];
        int rc = 0;

        if (rows > 0 && (!got.recv_x || !got.recv_src || (expand && !got.recv_topk_slot))) {
                snprintf(msg, msg_len, "rank %u: a required dispatch output is missing", d);
                return -1;
        }
        if (oracle_dispatch_expected(o, d, &want) < 0) {
                snprintf(msg, msg_len, "rank %u: out of memory", d);
                return -1;
        }
        field_sizes(o, sz);
        for (int64_t r = 0; r < rows && rc == 0; r++) {
                /* Payload of padding rows is written only with zero_padding. */
                const int skip_payload = !o->p.zero_padding && is_padding(o, d, r);

                for (int i = 0; i < 6 && rc == 0; i++) {
                        const uint8_t *w = *out_field(&want, i), *g = *out_field(&got, i);

                        if (!sz[i] || !g || (skip_payload && (i == 0 || i == 1 || i == 3)))
                                continue;
                        rc = cmp_bytes(w + (uint64_t)r * sz[i], g + (uint64_t)r * sz[i], sz[i], d,
                                       r, field_names[i], msg, msg_len);
                }
        }
        oracle_dispatch_out_free(&want);
        return rc;
}

int oracle_combine_expected(const struct oracle *o, uint32_t s, const void *const *y,
                            int apply_weights, uint16_t *combined, float *cw)
{
        const uint32_t R = o->p.world_size, H = o->p.hidden, K = o->p.num_topk;
        struct epd_mat *ym = calloc(R, sizeof(*ym));
        struct epd_combine_src_io *src = calloc(R, sizeof(*src));
        struct epd_combine_exec ex;
        uint64_t per_src;

        if (!ym || !src) {
                free(ym);
                free(src);
                return EPD_INTERNAL;
        }
        if (apply_weights && (o->p.layout != EPD_LAYOUT_EXPAND || !o->has_weights)) {
                free(ym);
                free(src);
                return EPD_INVALID_ARGUMENT;
        }
        for (uint32_t d = 0; d < R; d++)
                ym[d] = (struct epd_mat){ (uint8_t *)y[d], (uint64_t)H * 2 };
        src[s] = (struct epd_combine_src_io){
                .combined = { (uint8_t *)combined, (uint64_t)H * 2 },
                .combined_topk_weights = { (uint8_t *)cw, (uint64_t)K * 4 },
                .weights = o->src[s].weights,
        };
        ex = (struct epd_combine_exec){
                .plan = o->plan, .hidden = H, .apply_weights = apply_weights, .y = ym, .src = src,
        };
        /* Items are R sources x the same number of chunks: source s's are a contiguous run. */
        per_src = epd_host_combine_items(&ex) / R;
        for (uint64_t i = 0; i < per_src; i++)
                epd_host_combine_item(&ex, (uint64_t)s * per_src + i);
        free(ym);
        free(src);
        return 0;
}

int oracle_check_combine(const struct oracle *o, uint32_t s, const void *const *y,
                         int apply_weights, const void *combined, const void *cw, char *msg,
                         size_t msg_len)
{
        const uint32_t N = o->src[s].num_tokens, H = o->p.hidden, K = o->p.num_topk;
        const int with_cw = cw && o->has_weights;
        uint16_t *want = calloc((size_t)N * H + 1, sizeof(uint16_t));
        float *want_cw = with_cw ? calloc((size_t)N * K + 1, sizeof(float)) : NULL;
        int rc;

        if (!want || (with_cw && !want_cw)) {
                snprintf(msg, msg_len, "rank %u: out of memory", s);
                rc = -1;
                goto out;
        }
        rc = oracle_combine_expected(o, s, y, apply_weights, want, want_cw);
        if (rc < 0) {
                snprintf(msg, msg_len, "rank %u: %s", s, epd_status_name(rc));
                goto out;
        }
        for (uint32_t t = 0; t < N && rc == 0; t++) {
                rc = cmp_bytes((const uint8_t *)(want + (size_t)t * H),
                               (const uint8_t *)combined + (size_t)t * H * 2, (uint64_t)H * 2, s,
                               t, "combined", msg, msg_len);
                if (rc == 0 && with_cw)
                        rc = cmp_bytes((const uint8_t *)(want_cw + (size_t)t * K),
                                       (const uint8_t *)cw + (size_t)t * K * 4, (uint64_t)K * 4,
                                       s, t, "combined_topk_weights", msg, msg_len);
        }
out:
        free(want);
        free(want_cw);
        return rc;
}
