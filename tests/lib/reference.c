/* reference.c - the naive reference of docs/semantics.md §2 and §3 (see reference.h).
 *
 * Everything here is written from the contract's wording, not from the production code: rows are
 * found by enumerating (destination, source, token) or (destination, local expert, source, token,
 * position) in the order the contract lists them, and combine walks the top-k positions of a token
 * exactly as the pseudo-code in section 3 does.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"

/* ---- bf16 ---- */

float ref_bf16_to_float(uint16_t value)
{
        uint32_t bits = (uint32_t)value * 65536u;
        float f;

        memcpy(&f, &bits, sizeof(f));
        return f;
}

uint16_t ref_float_to_bf16(float value)
{
        uint32_t bits, upper, lower;

        if (isnan(value))
                return 0x7FFF;
        memcpy(&bits, &value, sizeof(bits));
        upper = bits >> 16;
        lower = bits & 0xFFFFu;
        /* Round to nearest, ties to even. A carry out of the mantissa correctly bumps the
         * exponent, and the largest finite floats round up to infinity as IEEE says. */
        if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u)))
                upper++;
        return (uint16_t)upper;
}

/* ---- fp8 e4m3 (docs/semantics.md §2.7) ---- */

/* The value of an e4m3 encoding without its sign: 4 exponent bits (bias 7), 3 mantissa bits,
 * exponent 0 subnormal. */
static double e4m3_value(unsigned code)
{
        unsigned e = code >> 3 & 15u, m = code & 7u;

        if (e == 0)
                return ldexp((double)m, -9);
        return ldexp(1.0 + m / 8.0, (int)e - 7);
}

uint8_t ref_float_to_e4m3(float value)
{
        uint8_t sign = signbit(value) ? 0x80 : 0x00;
        double a = fabs((double)value), best_diff = INFINITY;
        unsigned best = 0;

        if (isnan(value))
                return 0x7F;
        if (a >= 448.0)
                return (uint8_t)(sign | 0x7E);
        /* 0x7E is 448, the largest finite value; 0x7F is NaN. */
        for (unsigned code = 0; code <= 0x7E; code++) {
                double diff = fabs(e4m3_value(code) - a);

                if (diff < best_diff || (diff == best_diff && (code & 1u) == 0)) {
                        best_diff = diff;
                        best = code;
                }
        }
        return (uint8_t)(sign | best);
}

/* round_scale: the power of two 2^e with e = ceil(log2 m), m = amax * 0x1.24924ap-9f (fp32). m is
 * normal or infinite (amax >= 1e-4); frexpf gives m = f * 2^x with f in [0.5, 1), which is 2^(x-1)
 * exactly when f is 0.5. */
static int ref_scale_exponent(float amax)
{
        float m = amax * 0x1.24924ap-9f;
        int x;
        float f;

        if (isinf(m))
                return 128;
        f = frexpf(m, &x);
        return f == 0.5f ? x - 1 : x;
}

void ref_quantize_row(const uint16_t *x, uint32_t hidden, int round_scale, int ue8m0, uint8_t *q,
                      void *scales)
{
        for (uint32_t b = 0; b < hidden / 128; b++) {
                float amax = 0.0f, scale, recv;
                int e = 0;

                for (uint32_t c = 0; c < 128; c++) {
                        float v = ref_bf16_to_float(x[b * 128 + c]);

                        if (!isnan(v) && fabsf(v) > amax)
                                amax = fabsf(v);
                }
                amax = amax > 1e-4f ? amax : 1e-4f;
                if (round_scale) {
                        e = ref_scale_exponent(amax);
                        scale = ldexpf(1.0f, -e);
                        recv = ldexpf(1.0f, e); /* +infinity for e = 128 */
                } else {
                        scale = 448.0f / amax;
                        recv = amax * 0x1.24924ap-9f;
                }
                for (uint32_t c = 0; c < 128; c++)
                        q[b * 128 + c] = ref_float_to_e4m3(ref_bf16_to_float(x[b * 128 + c]) *
                                                           scale);
                if (ue8m0)
                        ((uint8_t *)scales)[b] = (uint8_t)(e + 127);
                else
                        memcpy((uint8_t *)scales + b * 4, &recv, 4);
        }
}

/* ---- helpers ---- */

static void report(char *msg, size_t msg_len, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

static void report(char *msg, size_t msg_len, const char *fmt, ...)
{
        va_list ap;

        va_start(ap, fmt);
        if (msg && msg_len) {
                vsnprintf(msg, msg_len, fmt, ap);
        } else {
                vfprintf(stderr, fmt, ap);
                fputc('\n', stderr);
        }
        va_end(ap);
}

static const uint8_t *buf_row(struct ref_buf b, uint64_t packed_row_bytes, int64_t i)
{
        uint64_t stride = b.stride ? b.stride : packed_row_bytes;
        return (const uint8_t *)b.ptr + (uint64_t)i * stride;
}

static size_t topk_elem_size(enum epd_dtype dtype)
{
        return dtype == EPD_DTYPE_INT64 ? 8 : 4;
}

/* Compares n bytes; on a mismatch describes it and returns 1. */
static int cmp_bytes(const void *expected, const void *actual, size_t n, uint32_t rank, int64_t row,
                     const char *field, char *msg, size_t msg_len)
{
        const uint8_t *e = expected, *a = actual;

        for (size_t b = 0; b < n; b++) {
                if (e[b] != a[b]) {
                        report(msg, msg_len,
                               "rank %u row %lld field %s byte %zu: expected 0x%02x, got 0x%02x",
                               rank, (long long)row, field, b, e[b], a[b]);
                        return 1;
                }
        }
        return 0;
}

static int token_goes_to(const struct ref_dispatch *ref, uint32_t s, uint32_t t, uint32_t d)
{
        const uint32_t K = ref->p.num_topk, L = ref->num_local_experts;

        for (uint32_t k = 0; k < K; k++) {
                int32_t e = ref->topk[s][(size_t)t * K + k];
                if (e >= 0 && (uint32_t)e / L == d)
                        return 1;
        }
        return 0;
}

/* ---- building ---- */

static int check_params(const struct ref_params *p, char *err, size_t err_len)
{
        if (p->world_size < 1 || p->num_experts < 1 || p->num_experts % p->world_size != 0) {
                report(err, err_len, "bad world_size %u / num_experts %u", p->world_size,
                       p->num_experts);
                return EPD_INVALID_ARGUMENT;
        }
        if (p->num_topk < 1 || p->num_topk > 32 || p->hidden < 1 || p->max_tokens < 1) {
                report(err, err_len, "bad num_topk %u, hidden %u or max_tokens %u", p->num_topk,
                       p->hidden, p->max_tokens);
                return EPD_INVALID_ARGUMENT;
        }
        if (p->dtype != EPD_DTYPE_BF16 && p->dtype != EPD_DTYPE_FP8_E4M3) {
                report(err, err_len, "bad dispatch dtype %d", (int)p->dtype);
                return EPD_INVALID_ARGUMENT;
        }
        if (p->topk_dtype != EPD_DTYPE_INT32 && p->topk_dtype != EPD_DTYPE_INT64) {
                report(err, err_len, "bad topk dtype %d", (int)p->topk_dtype);
                return EPD_INVALID_ARGUMENT;
        }
        if (p->layout != EPD_LAYOUT_NON_EXPAND && p->layout != EPD_LAYOUT_EXPAND) {
                report(err, err_len, "bad layout %d", (int)p->layout);
                return EPD_INVALID_ARGUMENT;
        }
        if (p->expert_block_rows &&
            (p->layout != EPD_LAYOUT_EXPAND ||
             p->expert_block_rows % (p->expert_alignment ? p->expert_alignment : 1) != 0)) {
                report(err, err_len, "expert_block_rows %u needs EXPAND and a multiple of the "
                       "alignment", p->expert_block_rows);
                return EPD_INVALID_ARGUMENT;
        }
        if (p->quantize && (p->dtype != EPD_DTYPE_BF16 || p->hidden % 128 != 0)) {
                report(err, err_len, "quantize needs bf16 x and hidden a multiple of 128");
                return EPD_INVALID_ARGUMENT;
        }
        if ((p->round_scale || p->scale_ue8m0) && !p->quantize) {
                report(err, err_len, "round_scale and ue8m0 need quantize");
                return EPD_INVALID_ARGUMENT;
        }
        if (p->scale_ue8m0 && !p->round_scale) {
                report(err, err_len, "ue8m0 needs round_scale");
                return EPD_INVALID_ARGUMENT;
        }
        return 0;
}

/* Reads and validates every source's topk_idx (docs/semantics.md section 2, inputs). */
static int read_topk(struct ref_dispatch *ref, char *err, size_t err_len)
{
        const uint32_t R = ref->p.world_size, K = ref->p.num_topk, E = ref->p.num_experts;
        const size_t esz = topk_elem_size(ref->p.topk_dtype);

        for (uint32_t s = 0; s < R; s++) {
                const struct ref_src *src = &ref->src[s];

                ref->topk[s] = calloc((size_t)src->num_tokens * K + 1, sizeof(int32_t));
                if (!ref->topk[s])
                        return EPD_INTERNAL;
                for (uint32_t t = 0; t < src->num_tokens; t++) {
                        const uint8_t *row = buf_row(src->topk_idx, K * esz, t);

                        for (uint32_t k = 0; k < K; k++) {
                                long long v;

                                if (esz == 8) {
                                        int64_t v64;
                                        memcpy(&v64, row + k * 8, 8);
                                        v = v64;
                                } else {
                                        int32_t v32;
                                        memcpy(&v32, row + k * 4, 4);
                                        v = v32;
                                }
                                if (v != -1 && (v < 0 || v >= (long long)E)) {
                                        report(err, err_len,
                                               "rank %u token %u position %u: invalid expert %lld",
                                               s, t, k, v);
                                        return EPD_INVALID_ARGUMENT;
                                }
                                for (uint32_t j = 0; j < k && v != -1; j++) {
                                        if (ref->topk[s][(size_t)t * K + j] == v) {
                                                report(err, err_len,
                                                       "rank %u token %u: expert %lld repeated at "
                                                       "positions %u and %u", s, t, v, j, k);
                                                return EPD_INVALID_ARGUMENT;
                                        }
                                }
                                ref->topk[s][(size_t)t * K + k] = (int32_t)v;
                        }
                }
        }
        return 0;
}

static int alloc_rows(struct ref_dst *dst, int64_t rows, uint32_t K)
{
        size_t n = (size_t)rows + 1;

        dst->rows = rows;
        dst->row_src = calloc(n, sizeof(int32_t));
        dst->row_token = calloc(n, sizeof(int32_t));
        dst->row_slot = calloc(n, sizeof(int32_t));
        dst->row_kind = calloc(n, 1);
        dst->recv_src = calloc(n, sizeof(int64_t));
        dst->recv_topk_slot = calloc(n, sizeof(int32_t));
        dst->recv_topk_idx = calloc(n * K, sizeof(int64_t));
        dst->recv_weights = calloc(n * K, sizeof(uint32_t));
        if (!dst->row_src || !dst->row_token || !dst->row_slot || !dst->row_kind ||
            !dst->recv_src || !dst->recv_topk_slot || !dst->recv_topk_idx || !dst->recv_weights)
                return EPD_INTERNAL;
        return 0;
}

static uint32_t weight_bits(const struct ref_dispatch *ref, uint32_t s, uint32_t t, uint32_t k)
{
        uint32_t bits;

        if (!ref->p.has_weights)
                return 0;
        memcpy(&bits, buf_row(ref->src[s].weights, (uint64_t)ref->p.num_topk * 4, t) + k * 4, 4);
        return bits;
}

/* Counts (section 2.3) and the rows of destination d in the requested layout. */
static int build_dst(struct ref_dispatch *ref, uint32_t d)
{
        const uint32_t R = ref->p.world_size, K = ref->p.num_topk, L = ref->num_local_experts;
        const uint32_t T = ref->p.max_tokens, A = ref->p.expert_alignment;
        struct ref_dst *dst = &ref->dst[d];
        const uint32_t C = ref->p.expert_block_rows;
        int32_t count = 0;
        int64_t i;

        dst->per_expert = calloc(L, sizeof(int32_t));
        dst->per_expert_aligned = calloc(L, sizeof(int32_t));
        dst->rank_prefix = calloc(R + 1, sizeof(int32_t));
        dst->expert_base = calloc(L + 1, sizeof(int32_t));
        if (!dst->per_expert || !dst->per_expert_aligned || !dst->rank_prefix || !dst->expert_base)
                return EPD_INTERNAL;

        /* NON_EXPAND: one row per (s, t) going to d, ascending s then t. */
        for (uint32_t s = 0; s < R; s++) {
                dst->rank_prefix[s] = count;
                for (uint32_t t = 0; t < ref->src[s].num_tokens; t++)
                        if (token_goes_to(ref, s, t, d))
                                count++;
        }
        dst->rank_prefix[R] = count;
        dst->num_recv_tokens = count;

        /* EXPAND: selections per local expert, each group padded to the alignment. */
        count = 0;
        for (uint32_t l = 0; l < L; l++) {
                int32_t e = (int32_t)(d * L + l), n = 0;

                for (uint32_t s = 0; s < R; s++)
                        for (uint32_t t = 0; t < ref->src[s].num_tokens; t++)
                                for (uint32_t k = 0; k < K; k++)
                                        if (ref->topk[s][(size_t)t * K + k] == e)
                                                n++;
                dst->per_expert[l] = n;
                dst->per_expert_aligned[l] = (int32_t)((n + A - 1) / A * A);
                if (C && dst->per_expert_aligned[l] > (int32_t)C) {
                        ref->short_rank = (int32_t)d;
                        ref->short_expert = (int32_t)l;
                        return EPD_CAPACITY_EXCEEDED;
                }
                /* 2.6: fixed blocks of C rows, else the aligned prefix of 2.2. */
                dst->expert_base[l] = C ? (int32_t)(l * C) : count;
                count += dst->per_expert_aligned[l];
        }
        dst->expert_base[L] = C ? (int32_t)(L * C) : count;
        dst->num_expanded_rows = dst->expert_base[L];

        if (ref->p.layout == EPD_LAYOUT_NON_EXPAND) {
                if (alloc_rows(dst, dst->num_recv_tokens, K))
                        return EPD_INTERNAL;
                i = 0;
                for (uint32_t s = 0; s < R; s++) {
                        for (uint32_t t = 0; t < ref->src[s].num_tokens; t++) {
                                if (!token_goes_to(ref, s, t, d))
                                        continue;
                                dst->row_src[i] = (int32_t)s;
                                dst->row_token[i] = (int32_t)t;
                                dst->row_slot[i] = -1;
                                dst->row_kind[i] = REF_ROW_DATA;
                                dst->recv_src[i] = (int64_t)s * T + t;
                                for (uint32_t k = 0; k < K; k++) {
                                        int32_t e = ref->topk[s][(size_t)t * K + k];
                                        int on_d = e >= 0 && (uint32_t)e / L == d;

                                        dst->recv_topk_idx[(size_t)i * K + k] =
                                                on_d ? e - (int64_t)d * L : -1;
                                        dst->recv_weights[(size_t)i * K + k] =
                                                on_d ? weight_bits(ref, s, t, k) : 0;
                                }
                                i++;
                        }
                }
                return 0;
        }

        if (alloc_rows(dst, dst->num_expanded_rows, K))
                return EPD_INTERNAL;
        i = 0;
        for (uint32_t l = 0; l < L; l++) {
                int32_t e = (int32_t)(d * L + l);

                for (uint32_t s = 0; s < R; s++) {
                        for (uint32_t t = 0; t < ref->src[s].num_tokens; t++) {
                                for (uint32_t k = 0; k < K; k++) {
                                        if (ref->topk[s][(size_t)t * K + k] != e)
                                                continue;
                                        dst->row_src[i] = (int32_t)s;
                                        dst->row_token[i] = (int32_t)t;
                                        dst->row_slot[i] = (int32_t)k;
                                        dst->row_kind[i] = REF_ROW_DATA;
                                        dst->recv_src[i] = (int64_t)s * T + t;
                                        dst->recv_topk_slot[i] = (int32_t)k;
                                        dst->recv_weights[i] = weight_bits(ref, s, t, k);
                                        i++;
                                }
                        }
                }
                while (i < dst->expert_base[l + 1]) {
                        dst->row_src[i] = -1;
                        dst->row_token[i] = -1;
                        dst->row_slot[i] = -1;
                        dst->row_kind[i] = ref->p.zero_padding ? REF_ROW_PAD_ZERO
                                                                : REF_ROW_PAD_UNWRITTEN;
                        dst->recv_src[i] = -1;
                        dst->recv_topk_slot[i] = -1;
                        dst->recv_weights[i] = 0; /* +0.0f */
                        i++;
                }
        }
        return 0;
}

/* 2.7: every source token converted once; rows then compare against these bytes. */
static int quantize_sources(struct ref_dispatch *ref)
{
        const uint32_t R = ref->p.world_size, H = ref->p.hidden;

        ref->qx = calloc(R, sizeof(*ref->qx));
        ref->qscales = calloc(R, sizeof(*ref->qscales));
        if (!ref->qx || !ref->qscales)
                return EPD_INTERNAL;
        for (uint32_t s = 0; s < R; s++) {
                uint32_t n = ref->src[s].num_tokens;

                ref->qx[s] = calloc((size_t)n * H + 1, 1);
                ref->qscales[s] = calloc((size_t)n * ref->scale_bytes + 1, 1);
                if (!ref->qx[s] || !ref->qscales[s])
                        return EPD_INTERNAL;
                for (uint32_t t = 0; t < n; t++) {
                        uint16_t *row = malloc((size_t)H * 2);

                        if (!row)
                                return EPD_INTERNAL;
                        memcpy(row, buf_row(ref->src[s].x, (uint64_t)H * 2, t), (size_t)H * 2);
                        ref_quantize_row(row, H, ref->p.round_scale, ref->p.scale_ue8m0,
                                         ref->qx[s] + (size_t)t * H,
                                         ref->qscales[s] + (size_t)t * ref->scale_bytes);
                        free(row);
                }
        }
        return 0;
}

int ref_dispatch_new(const struct ref_params *p, const struct ref_src *src,
                     struct ref_dispatch **out, char *err, size_t err_len)
{
        struct ref_dispatch *ref;
        int r;

        r = check_params(p, err, err_len);
        if (r)
                return r;
        ref = calloc(1, sizeof(*ref));
        if (!ref)
                return EPD_INTERNAL;
        ref->p = *p;
        if (ref->p.scale_block == 0)
                ref->p.scale_block = 128;
        if (ref->p.expert_alignment == 0)
                ref->p.expert_alignment = 1;
        if (p->layout != EPD_LAYOUT_EXPAND)
                ref->p.zero_padding = 0;
        ref->num_local_experts = p->num_experts / p->world_size;
        if (p->quantize) {
                ref->row_bytes = p->hidden;
                ref->num_scales = p->hidden / 128;
        } else if (p->dtype == EPD_DTYPE_BF16) {
                ref->row_bytes = (uint64_t)p->hidden * 2;
                ref->num_scales = 0;
        } else {
                if (p->hidden % ref->p.scale_block != 0) {
                        report(err, err_len, "hidden %u not a multiple of scale_block %u",
                               p->hidden, ref->p.scale_block);
                        ref_dispatch_free(ref);
                        return EPD_INVALID_ARGUMENT;
                }
                ref->row_bytes = p->hidden;
                ref->num_scales = p->hidden / ref->p.scale_block;
        }
        ref->scale_bytes = (uint64_t)ref->num_scales * (p->scale_ue8m0 ? 1 : 4);
        ref->src = calloc(p->world_size, sizeof(*ref->src));
        ref->topk = calloc(p->world_size, sizeof(*ref->topk));
        ref->dst = calloc(p->world_size, sizeof(*ref->dst));
        if (!ref->src || !ref->topk || !ref->dst) {
                ref_dispatch_free(ref);
                return EPD_INTERNAL;
        }
        memcpy(ref->src, src, p->world_size * sizeof(*src));
        if (p->quantize && quantize_sources(ref)) {
                ref_dispatch_free(ref);
                return EPD_INTERNAL;
        }
        for (uint32_t s = 0; s < p->world_size; s++) {
                if (src[s].num_tokens > p->max_tokens) {
                        report(err, err_len, "rank %u: %u tokens > max_tokens %u", s,
                               src[s].num_tokens, p->max_tokens);
                        ref_dispatch_free(ref);
                        return EPD_INVALID_ARGUMENT;
                }
        }
        r = read_topk(ref, err, err_len);
        for (uint32_t d = 0; r == 0 && d < p->world_size; d++)
                r = build_dst(ref, d);
        if (r) {
                if (r == EPD_INTERNAL)
                        report(err, err_len, "out of memory");
                if (r == EPD_CAPACITY_EXCEEDED)
                        report(err, err_len, "rank %d local expert %d: more than %u rows",
                               ref->short_rank, ref->short_expert, p->expert_block_rows);
                ref_dispatch_free(ref);
                return r;
        }
        *out = ref;
        return 0;
}

struct ref_dispatch *ref_dispatch_free(struct ref_dispatch *ref)
{
        if (!ref)
                return NULL;
        for (uint32_t r = 0; r < ref->p.world_size; r++) {
                if (ref->topk)
                        free(ref->topk[r]);
                if (ref->dst) {
                        struct ref_dst *dst = &ref->dst[r];

                        free(dst->per_expert);
                        free(dst->per_expert_aligned);
                        free(dst->rank_prefix);
                        free(dst->expert_base);
                        free(dst->row_src);
                        free(dst->row_token);
                        free(dst->row_slot);
                        free(dst->row_kind);
                        free(dst->recv_src);
                        free(dst->recv_topk_slot);
                        free(dst->recv_topk_idx);
                        free(dst->recv_weights);
                }
        }
        for (uint32_t r = 0; r < ref->p.world_size; r++) {
                if (ref->qx)
                        free(ref->qx[r]);
                if (ref->qscales)
                        free(ref->qscales[r]);
        }
        free(ref->qx);
        free(ref->qscales);
        free(ref->topk);
        free(ref->dst);
        free(ref->src);
        free(ref);
        return NULL;
}

/* ---- lookups ---- */

const uint8_t *ref_expected_x(const struct ref_dispatch *ref, uint32_t d, int64_t i)
{
        const struct ref_dst *dst = &ref->dst[d];

        if (dst->row_kind[i] != REF_ROW_DATA)
                return NULL;
        if (ref->qx)
                return ref->qx[dst->row_src[i]] + (size_t)dst->row_token[i] * ref->row_bytes;
        return buf_row(ref->src[dst->row_src[i]].x, ref->row_bytes, dst->row_token[i]);
}

const uint8_t *ref_expected_scales(const struct ref_dispatch *ref, uint32_t d, int64_t i)
{
        const struct ref_dst *dst = &ref->dst[d];

        if (dst->row_kind[i] != REF_ROW_DATA || ref->num_scales == 0)
                return NULL;
        if (ref->qscales)
                return ref->qscales[dst->row_src[i]] +
                       (size_t)dst->row_token[i] * ref->scale_bytes;
        return buf_row(ref->src[dst->row_src[i]].scales, ref->scale_bytes, dst->row_token[i]);
}

/* Binary search for recv_src == key among rows [lo, hi), which are ascending in recv_src. */
static int64_t find_src(const struct ref_dst *dst, int64_t lo, int64_t hi, int64_t key)
{
        while (lo < hi) {
                int64_t mid = lo + (hi - lo) / 2;

                if (dst->recv_src[mid] == key)
                        return mid;
                if (dst->recv_src[mid] < key)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        return -1;
}

int64_t ref_non_expand_row(const struct ref_dispatch *ref, uint32_t d, uint32_t s, uint32_t t)
{
        const struct ref_dst *dst = &ref->dst[d];

        return find_src(dst, dst->rank_prefix[s], dst->rank_prefix[s + 1],
                        (int64_t)s * ref->p.max_tokens + t);
}

int64_t ref_expand_row(const struct ref_dispatch *ref, uint32_t s, uint32_t t, uint32_t k)
{
        const uint32_t K = ref->p.num_topk, L = ref->num_local_experts;
        int32_t e = ref->topk[s][(size_t)t * K + k];
        const struct ref_dst *dst;
        int64_t lo, hi;

        if (e < 0)
                return -1;
        dst = &ref->dst[(uint32_t)e / L];
        lo = dst->expert_base[(uint32_t)e % L];
        hi = lo + dst->per_expert[(uint32_t)e % L];
        return find_src(dst, lo, hi, (int64_t)s * ref->p.max_tokens + t);
}

/* ---- checks ---- */

int ref_check_counts(const struct ref_dispatch *ref, uint32_t d,
                     const struct ref_counts_actual *act, char *msg, size_t msg_len)
{
        const struct ref_dst *dst = &ref->dst[d];
        const uint32_t L = ref->num_local_experts, R = ref->p.world_size;

        if (act->num_recv_tokens != dst->num_recv_tokens) {
                report(msg, msg_len, "rank %u field num_recv_tokens: expected %d, got %d", d,
                       dst->num_recv_tokens, act->num_recv_tokens);
                return 1;
        }
        if (act->num_expanded_rows != dst->num_expanded_rows) {
                report(msg, msg_len, "rank %u field num_expanded_rows: expected %d, got %d", d,
                       dst->num_expanded_rows, act->num_expanded_rows);
                return 1;
        }
        for (uint32_t l = 0; act->per_expert && l < L; l++) {
                if (act->per_expert[l] != dst->per_expert[l]) {
                        report(msg, msg_len,
                               "rank %u field num_recv_tokens_per_expert[%u]: expected %d, got %d",
                               d, l, dst->per_expert[l], act->per_expert[l]);
                        return 1;
                }
        }
        for (uint32_t l = 0; act->per_expert_aligned && l < L; l++) {
                if (act->per_expert_aligned[l] != dst->per_expert_aligned[l]) {
                        report(msg, msg_len,
                               "rank %u field num_recv_tokens_per_expert_aligned[%u]: expected "
                               "%d, got %d", d, l, dst->per_expert_aligned[l],
                               act->per_expert_aligned[l]);
                        return 1;
                }
        }
        for (uint32_t s = 0; act->rank_prefix && s <= R; s++) {
                if (act->rank_prefix[s] != dst->rank_prefix[s]) {
                        report(msg, msg_len, "rank %u field rank_prefix[%u]: expected %d, got %d",
                               d, s, dst->rank_prefix[s], act->rank_prefix[s]);
                        return 1;
                }
        }
        return 0;
}

int ref_check_dispatch(const struct ref_dispatch *ref, uint32_t d,
                       const struct ref_dispatch_actual *act, char *msg, size_t msg_len)
{
        const struct ref_dst *dst = &ref->dst[d];
        const uint32_t K = ref->p.num_topk;
        const int expand = ref->p.layout == EPD_LAYOUT_EXPAND;
        const size_t esz = topk_elem_size(ref->p.topk_dtype);
        const uint64_t scale_bytes = ref->scale_bytes;
        const uint64_t weight_bytes = expand ? 4 : (uint64_t)K * 4;
        uint8_t zeros[256] = { 0 };
        uint8_t expect[32 * 8];

        if (!act->recv_x.ptr || !act->recv_src.ptr || (expand && !act->recv_topk_slot.ptr)) {
                report(msg, msg_len, "rank %u: a required dispatch output is missing", d);
                return -1;
        }
        for (int64_t i = 0; i < dst->rows; i++) {
                enum ref_row_kind kind = dst->row_kind[i];

                if (kind == REF_ROW_DATA) {
                        if (cmp_bytes(ref_expected_x(ref, d, i),
                                      buf_row(act->recv_x, ref->row_bytes, i), ref->row_bytes, d,
                                      i, "recv_x", msg, msg_len))
                                return 1;
                        if (scale_bytes && act->recv_scales.ptr &&
                            cmp_bytes(ref_expected_scales(ref, d, i),
                                      buf_row(act->recv_scales, scale_bytes, i), scale_bytes, d, i,
                                      "recv_scales", msg, msg_len))
                                return 1;
                } else if (kind == REF_ROW_PAD_ZERO) {
                        const uint8_t *a = buf_row(act->recv_x, ref->row_bytes, i);

                        for (uint64_t b = 0; b < ref->row_bytes; b += sizeof(zeros)) {
                                uint64_t n = ref->row_bytes - b;
                                n = n < sizeof(zeros) ? n : sizeof(zeros);
                                if (memcmp(zeros, a + b, n) != 0)
                                        return cmp_bytes(zeros, a + b, n, d, i, "recv_x (padding)",
                                                         msg, msg_len);
                        }
                        if (scale_bytes && act->recv_scales.ptr) {
                                const uint8_t *sa = buf_row(act->recv_scales, scale_bytes, i);
                                for (uint64_t b = 0; b < scale_bytes; b++)
                                        if (sa[b] != 0)
                                                return cmp_bytes(zeros, sa + b, 1, d, i,
                                                                 "recv_scales (padding)", msg,
                                                                 msg_len);
                        }
                }

                if (!expand && act->recv_topk_idx.ptr) {
                        for (uint32_t k = 0; k < K; k++) {
                                int64_t v = dst->recv_topk_idx[(size_t)i * K + k];
                                if (esz == 8) {
                                        memcpy(expect + k * 8, &v, 8);
                                } else {
                                        int32_t v32 = (int32_t)v;
                                        memcpy(expect + k * 4, &v32, 4);
                                }
                        }
                        if (cmp_bytes(expect, buf_row(act->recv_topk_idx, K * esz, i), K * esz, d,
                                      i, "recv_topk_idx", msg, msg_len))
                                return 1;
                }
                if (ref->p.has_weights && act->recv_weights.ptr &&
                    kind != REF_ROW_PAD_UNWRITTEN) {
                        const uint32_t *w = dst->recv_weights +
                                            (expand ? (size_t)i : (size_t)i * K);
                        if (cmp_bytes(w, buf_row(act->recv_weights, weight_bytes, i), weight_bytes,
                                      d, i, "recv_weights", msg, msg_len))
                                return 1;
                }
                if (cmp_bytes(&dst->recv_src[i], buf_row(act->recv_src, 8, i), 8, d, i,
                              "recv_src", msg, msg_len))
                        return 1;
                if (expand && cmp_bytes(&dst->recv_topk_slot[i], buf_row(act->recv_topk_slot, 4, i),
                                        4, d, i, "recv_topk_slot", msg, msg_len))
                        return 1;
        }
        return 0;
}

/* ---- combine ---- */

int ref_combine_row(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                    uint32_t s, const struct ref_buf bias[2], uint32_t t, uint16_t *out,
                    uint32_t *cw)
{
        return ref_combine_row_w(ref, in, NULL, s, bias, t, out, cw);
}

int ref_combine_row_w(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                      const struct ref_combine_weights *w, uint32_t s,
                      const struct ref_buf bias[2], uint32_t t, uint16_t *out, uint32_t *cw)
{
        /* source s's own weights, when it gave them (each source chooses for itself) */
        const struct ref_buf *source_weights =
                w && w->source_weights && w->source_weights[s].ptr ? &w->source_weights[s] : NULL;
        const struct ref_buf *recv_weights = w ? w->recv_weights : NULL;
        const uint32_t K = ref->p.num_topk, L = ref->num_local_experts, H = ref->p.hidden;
        const int expand = ref->p.layout == EPD_LAYOUT_EXPAND;
        const int32_t *sel = ref->topk[s] + (size_t)t * K;
        const uint8_t *rows[32];
        float weight[32];
        uint32_t n = 0;

        if (in->apply_weights && (!expand || (!ref->p.has_weights && !source_weights)))
                return EPD_INVALID_ARGUMENT;
        if (recv_weights && expand)
                return EPD_INVALID_ARGUMENT;

        /* The contributions of token t, in ascending top-k order. */
        for (uint32_t k = 0; k < K; k++) {
                uint32_t d;
                int64_t row;
                int first = 1;

                if (sel[k] < 0)
                        continue;
                d = (uint32_t)sel[k] / L;
                if (expand) {
                        row = ref_expand_row(ref, s, t, k);
                } else {
                        /* NON_EXPAND: d contributes once, at its first position. */
                        for (uint32_t j = 0; j < k; j++)
                                if (sel[j] >= 0 && (uint32_t)sel[j] / L == d)
                                        first = 0;
                        if (!first)
                                continue;
                        row = ref_non_expand_row(ref, d, s, t);
                }
                if (row < 0)
                        return EPD_INTERNAL; /* the reference contradicts itself */
                rows[n] = buf_row(in->y[d], (uint64_t)H * 2, row);
                if (in->apply_weights && source_weights) {
                        memcpy(&weight[n],
                               buf_row(*source_weights, (uint64_t)K * 4, t) + k * 4, 4);
                } else if (in->apply_weights) {
                        uint32_t bits = weight_bits(ref, s, t, k);
                        memcpy(&weight[n], &bits, 4);
                } else {
                        weight[n] = 1.0f; /* unused */
                }
                n++;
        }

        for (uint32_t h = 0; h < H; h++) {
                float acc = +0.0f;

                for (uint32_t j = 0; j < n; j++) {
                        uint16_t raw;
                        float v;

                        memcpy(&raw, rows[j] + (size_t)h * 2, 2);
                        v = ref_bf16_to_float(raw);
                        if (in->apply_weights)
                                v = v * weight[j];
                        acc = acc + v;
                }
                for (int b = 0; b < 2; b++) {
                        uint16_t raw;

                        if (!bias[b].ptr)
                                continue;
                        memcpy(&raw, buf_row(bias[b], (uint64_t)H * 2, t) + (size_t)h * 2, 2);
                        acc = acc + ref_bf16_to_float(raw);
                }
                out[h] = ref_float_to_bf16(acc);
        }

        if (cw && recv_weights) {
                /* Section 3 with recv_weights: for every k, the sum over the destinations that
                 * token t went to, ascending, of that destination's weight row of t. */
                for (uint32_t k = 0; k < K; k++) {
                        float acc = +0.0f;

                        for (uint32_t d = 0; d < ref->p.world_size; d++) {
                                int64_t row;
                                float wd;

                                if (!token_goes_to(ref, s, t, d))
                                        continue;
                                row = ref_non_expand_row(ref, d, s, t);
                                memcpy(&wd, buf_row(recv_weights[d], (uint64_t)K * 4, row) +
                                                   k * 4, 4);
                                acc = acc + wd;
                        }
                        /* a NaN sum is 0x7FFFFFFF, whatever the host's additions make of it */
                        if (acc != acc)
                                cw[k] = 0x7FFFFFFFu;
                        else
                                memcpy(&cw[k], &acc, 4);
                }
        } else if (cw) {
                for (uint32_t k = 0; k < K; k++)
                        cw[k] = sel[k] == -1 ? 0 : weight_bits(ref, s, t, k);
        }
        return 0;
}

int ref_combine_source(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                       uint32_t s, const struct ref_buf bias[2], uint16_t *combined,
                       uint32_t *cw)
{
        const uint32_t H = ref->p.hidden, K = ref->p.num_topk;

        for (uint32_t t = 0; t < ref->src[s].num_tokens; t++) {
                int r = ref_combine_row(ref, in, s, bias, t, combined + (size_t)t * H,
                                        cw ? cw + (size_t)t * K : NULL);
                if (r)
                        return r;
        }
        return 0;
}

int ref_check_combine(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                      uint32_t s, const struct ref_buf bias[2], struct ref_buf combined,
                      struct ref_buf combined_topk_weights, char *msg, size_t msg_len)
{
        return ref_check_combine_w(ref, in, NULL, s, bias, combined, combined_topk_weights, msg,
                                   msg_len);
}

int ref_check_combine_w(const struct ref_dispatch *ref, const struct ref_combine_in *in,
                        const struct ref_combine_weights *w, uint32_t s,
                        const struct ref_buf bias[2], struct ref_buf combined,
                        struct ref_buf combined_topk_weights, char *msg, size_t msg_len)
{
        const uint32_t H = ref->p.hidden, K = ref->p.num_topk;
        uint16_t *row = malloc((size_t)H * 2);
        uint32_t cw[32];
        int r = 0;

        if (!row)
                return EPD_INTERNAL;
        if (!combined.ptr) {
                report(msg, msg_len, "rank %u: combined output missing", s);
                free(row);
                return -1;
        }
        for (uint32_t t = 0; t < ref->src[s].num_tokens && r == 0; t++) {
                const uint8_t *a = buf_row(combined, (uint64_t)H * 2, t);

                r = ref_combine_row_w(ref, in, w, s, bias, t, row, cw);
                if (r) {
                        report(msg, msg_len, "rank %u: reference combine failed (%d)", s, r);
                        break;
                }
                if (memcmp(row, a, (size_t)H * 2) != 0) {
                        for (uint32_t h = 0; h < H; h++) {
                                uint16_t got;

                                memcpy(&got, a + (size_t)h * 2, 2);
                                if (got == row[h])
                                        continue;
                                report(msg, msg_len,
                                       "rank %u row %u field combined byte %zu (element %u): "
                                       "expected 0x%04x, got 0x%04x", s, t, (size_t)h * 2, h,
                                       row[h], got);
                                break;
                        }
                        r = 1;
                        break;
                }
                if (combined_topk_weights.ptr && (ref->p.has_weights || (w && w->recv_weights)) &&
                    cmp_bytes(cw, buf_row(combined_topk_weights, (uint64_t)K * 4, t), (size_t)K * 4,
                              s, t, "combined_topk_weights", msg, msg_len))
                        r = 1;
        }
        free(row);
        return r;
}
