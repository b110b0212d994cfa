/* exec.c - the data movement of dispatch and combine on the CPU (host backend).
 *
 * Dispatch is a push: each item takes a chunk of one source's tokens and copies every token to the
 * rows the plan assigned it, writing the metadata beside it. Rows of different items never
 * overlap, because the plan gives every (token, destination) or selection its own row; padding
 * rows of EXPAND belong to separate items, one per (destination, local expert). A client may
 * still point an output at its own inputs (or register one memfd twice); its results are then
 * unspecified, so client-to-client copies use memmove, which stays defined when they overlap.
 *
 * Combine is a pull: each item takes a chunk of one source's tokens and, per token, sums the
 * contributing rows in top-k order into an fp32 accumulator on the stack, then rounds once to
 * bf16 (docs/semantics.md section 3). The accumulator covers a block of columns at a time, so it
  * stays in L1 and needs no allocation however wide the hidden size is.
 *
 * A dispatch that moves more data than the last-level cache holds writes its recv_x rows with
 * non-temporal stores: the lines would be evicted before the client reads them anyway, and a
 * regular store first reads the line it is about to overwrite (read for ownership), a third of a
 * copy's memory traffic; on a 2-core EPYC guest this cut an 8-rank bf16 prefill dispatch
 * (T = 1024) from about 40 ms to 25 ms. Smaller ops keep regular stores, which leave their
 * outputs in cache for the client. The bytes written are the same either way. Combine keeps
 * regular stores: its output is a sixth of its traffic, and streaming it (through an L1 staging
 * block) measured 10% slower.
 *
 * Runs on the host backend's worker threads; items share nothing writable.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "bf16.h"
#include "exec.h"
#include "routing.h"

/* The combine kernels are compute-bound with SSE2 (the x86-64 baseline); an AVX2 clone, picked at
 * load time by the CPU, runs about a third faster. The results are identical: the same IEEE
 * multiplies and adds in the same order, and -ffp-contract=off keeps FMA out of every clone. */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EPD_NO_CLONES /* ThreadSanitizer instruments the ifunc resolver, which runs before it is set up */
#endif
#endif
#if defined(__x86_64__) && defined(__has_attribute) && !defined(EPD_NO_CLONES)
#if __has_attribute(target_clones)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef VECTOR_CLONES
#define VECTOR_CLONES
#endif

/* Tokens per item: enough work to amortise the item's bookkeeping, small enough that a 4096-token
 * source splits into many items for load balancing across threads. */
#define CHUNK_TOKENS 32u
/* Columns of the combine accumulator: 8 KiB of fp32, well inside L1. */
#define ACC_COLS 2048u

/* ---- streaming stores ---- */

uint64_t epd_host_stream_min_bytes;

/* The last-level cache of this CPU in bytes, read once from sysfs (sysconf's figure is the whole
 * package's, or a hypervisor's invention); 32 MiB when sysfs does not say. */
static uint64_t llc_bytes(void)
{
        static _Atomic uint64_t cached;
        uint64_t v = atomic_load_explicit(&cached, memory_order_relaxed);
        unsigned long long size;
        char unit = 0;
        FILE *f;

        if (v)
                return v;
        v = 32ull << 20;
        f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "re");
        if (f) {
                if (fscanf(f, "%llu%c", &size, &unit) >= 1 && size > 0)
                        v = unit == 'K' ? size << 10 : unit == 'M' ? size << 20 : size;
                fclose(f);
        }
        /* Threads that race here compute the same value. */
        atomic_store_explicit(&cached, v, memory_order_relaxed);
        return v;
}

/* Whether a dispatch that reads and writes `bytes` in all streams its recv_x rows. */
static int use_streaming(uint64_t bytes)
{
        uint64_t min = epd_host_stream_min_bytes ? epd_host_stream_min_bytes : llc_bytes();

        return bytes >= min;
}

/* memmove whose 16-byte-aligned body goes out with non-temporal stores (x86-64; elsewhere plain
 * memmove). The caller issues stream_fence() before its writes may be read by another thread. */
static void copy_streaming(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__x86_64__)
        size_t head = (size_t)(-(uintptr_t)dst & 15);

        if (head > n)
                head = n;
        memmove(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
                __m128i a = _mm_loadu_si128((const __m128i *)src);
                __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
                __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
                __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
                _mm_stream_si128((__m128i *)dst, a);
                _mm_stream_si128((__m128i *)(dst + 16), b);
                _mm_stream_si128((__m128i *)(dst + 32), c);
                _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        for (; n >= 16; n -= 16, dst += 16, src += 16)
                _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
#endif
        memmove(dst, src, n);
}

/* Non-temporal stores are weakly ordered: make them visible before the item ends, so the pool's
 * completion (and the reply after it) cannot overtake them. */
static void stream_fence(void)
{
#if defined(__x86_64__)
        _mm_sfence();
#endif
}

static uint64_t chunks_per_source(const struct epd_plan *plan)
{
        return ((uint64_t)plan->max_tokens + CHUNK_TOKENS - 1) / CHUNK_TOKENS;
}

static inline uint8_t *mat_row(const struct epd_mat *m, int64_t row)
{
        return m->ptr + (uint64_t)row * m->stride;
}

/* ---- dispatch ---- */

uint64_t epd_host_dispatch_items(const struct epd_dispatch_exec *op)
{
        const struct epd_plan *plan = op->plan;
        uint64_t items = (uint64_t)plan->world_size * chunks_per_source(plan);

        if (plan->layout == EPD_LAYOUT_EXPAND)
                items += (uint64_t)plan->world_size * plan->num_local_experts;
        return items;
}

/* Writes the NON_EXPAND metadata of token t of source s at row r of destination d. */
static void put_non_expand_meta(const struct epd_dispatch_exec *op,
                                const struct epd_dispatch_dst_io *dst, uint32_t s, uint32_t t,
                                uint32_t d, int32_t r)
{
        const struct epd_plan *plan = op->plan;
        const uint32_t K = plan->num_topk, L = plan->num_local_experts;
        const int32_t *sel = plan->topk[s] + (size_t)t * K;
        const int32_t first = (int32_t)(d * L), last = first + (int32_t)L;

        if (dst->recv_topk_idx.ptr) {
                uint8_t *out = mat_row(&dst->recv_topk_idx, r);

                if (op->topk_dtype == EPD_DTYPE_INT64) {
                        for (uint32_t k = 0; k < K; k++) {
                                int64_t v = sel[k] >= first && sel[k] < last ? sel[k] - first : -1;
                                memcpy(out + (size_t)k * sizeof(v), &v, sizeof(v));
                        }
                } else {
                        for (uint32_t k = 0; k < K; k++) {
                                int32_t v = sel[k] >= first && sel[k] < last ? sel[k] - first : -1;
                                memcpy(out + (size_t)k * sizeof(v), &v, sizeof(v));
                        }
                }
        }
        if (op->has_weights && dst->recv_weights.ptr) {
                const uint8_t *w = mat_row(&op->src[s].weights, t);
                uint8_t *out = mat_row(&dst->recv_weights, r);
                const uint32_t zero = 0;

                /* Weights move as bits, so a NaN payload survives exactly as in the input. */
                for (uint32_t k = 0; k < K; k++) {
                        int on_d = sel[k] >= first && sel[k] < last;
                        memmove(out + (size_t)k * 4,
                                on_d ? w + (size_t)k * 4 : (const uint8_t *)&zero, 4);
                }
        }
        if (dst->recv_src.ptr) {
                int64_t g = epd_route_global_src(s, plan->max_tokens, t);
                memcpy(mat_row(&dst->recv_src, r), &g, sizeof(g));
        }
}

/* Writes the EXPAND metadata of selection (s, t, k) at row r of destination d. */
static void put_expand_meta(const struct epd_dispatch_exec *op,
                            const struct epd_dispatch_dst_io *dst, uint32_t s, uint32_t t,
                            uint32_t k, int32_t r)
{
        if (op->has_weights && dst->recv_weights.ptr)
                memmove(mat_row(&dst->recv_weights, r),
                        mat_row(&op->src[s].weights, t) + (size_t)k * 4, 4);
        if (dst->recv_src.ptr) {
                int64_t g = epd_route_global_src(s, op->plan->max_tokens, t);
                memcpy(mat_row(&dst->recv_src, r), &g, sizeof(g));
        }
        if (dst->recv_topk_slot.ptr) {
                int32_t slot = (int32_t)k;
                memcpy(mat_row(&dst->recv_topk_slot, r), &slot, sizeof(slot));
        }
}

/* Bytes a dispatch reads and writes in all: every source row once, every output row once. */
static uint64_t dispatch_bytes(const struct epd_dispatch_exec *op)
{
        const struct epd_plan *plan = op->plan;
        uint64_t rows = 0;

        for (uint32_t r = 0; r < plan->world_size; r++)
                rows += plan->num_tokens[r] + (uint64_t)epd_plan_rows(plan, r);
        return rows * (op->row_bytes + op->scale_bytes);
}

static void dispatch_tokens(const struct epd_dispatch_exec *op, uint32_t s, uint32_t t0,
                            uint32_t t1, int stream)
{
        const struct epd_plan *plan = op->plan;
        const uint32_t K = plan->num_topk, L = plan->num_local_experts;
        const struct epd_dispatch_src_io *src = &op->src[s];
        const int expand = plan->layout == EPD_LAYOUT_EXPAND;

        for (uint32_t t = t0; t < t1; t++) {
                const int32_t *sel = plan->topk[s] + (size_t)t * K;
                const int32_t *rows = plan->row[s] + (size_t)t * K;
                const uint8_t *x = mat_row(&src->x, t);
                const uint8_t *scales = op->scale_bytes ? mat_row(&src->scales, t) : NULL;

                for (uint32_t k = 0; k < K; k++) {
                        int32_t r = rows[k];
                        uint32_t d;
                        const struct epd_dispatch_dst_io *dst;

                        if (r < 0)
                                continue;
                        d = epd_route_expert_rank(sel[k], L);
                        dst = &op->dst[d];
                        if (stream)
                                copy_streaming(mat_row(&dst->recv_x, r), x, op->row_bytes);
                        else
                                memmove(mat_row(&dst->recv_x, r), x, op->row_bytes);
                        if (scales)
                                memmove(mat_row(&dst->recv_scales, r), scales, op->scale_bytes);
                        if (expand)
                                put_expand_meta(op, dst, s, t, k, r);
                        else
                                put_non_expand_meta(op, dst, s, t, d, r);
                }
        }
}

/* The padding rows after local expert l's selections at destination d (EXPAND only). */
static void dispatch_padding(const struct epd_dispatch_exec *op, uint32_t d, uint32_t l)
{
        const struct epd_plan *plan = op->plan;
        const uint32_t L = plan->num_local_experts;
        const struct epd_dispatch_dst_io *dst = &op->dst[d];
        const int32_t *base = plan->expert_base + (size_t)d * (L + 1);
        int32_t first = base[l] + plan->expert_count[(size_t)d * L + l];
        const int64_t no_src = -1;
        const int32_t no_slot = -1;
        const float zero = 0.0f;

        for (int32_t r = first; r < base[l + 1]; r++) {
                if (dst->recv_src.ptr)
                        memcpy(mat_row(&dst->recv_src, r), &no_src, sizeof(no_src));
                if (dst->recv_topk_slot.ptr)
                        memcpy(mat_row(&dst->recv_topk_slot, r), &no_slot, sizeof(no_slot));
                if (!op->zero_padding)
                        continue;
                memset(mat_row(&dst->recv_x, r), 0, op->row_bytes);
                if (op->scale_bytes)
                        memset(mat_row(&dst->recv_scales, r), 0, op->scale_bytes);
                if (op->has_weights && dst->recv_weights.ptr)
                        memcpy(mat_row(&dst->recv_weights, r), &zero, sizeof(zero));
        }
}

void epd_host_dispatch_item(const struct epd_dispatch_exec *op, uint64_t item)
{
        const struct epd_plan *plan = op->plan;
        uint64_t per_src = chunks_per_source(plan);
        uint64_t token_items = (uint64_t)plan->world_size * per_src;

        if (item < token_items) {
                uint32_t s = (uint32_t)(item / per_src);
                uint64_t t0 = item % per_src * CHUNK_TOKENS;
                uint64_t t1 = t0 + CHUNK_TOKENS;

                if (t1 > plan->num_tokens[s])
                        t1 = plan->num_tokens[s];
                if (t0 < t1) {
                        int stream = use_streaming(dispatch_bytes(op));
                        dispatch_tokens(op, s, (uint32_t)t0, (uint32_t)t1, stream);
                        if (stream)
                                stream_fence();
                }
                return;
        }
        item -= token_items;
        dispatch_padding(op, (uint32_t)(item / plan->num_local_experts),
                         (uint32_t)(item % plan->num_local_experts));
}

/* ---- combine ---- */

uint64_t epd_host_combine_items(const struct epd_combine_exec *op)
{
        return (uint64_t)op->plan->world_size * chunks_per_source(op->plan);
}

/* One pass over a block of columns that adds m (1 to 4) contributions in order:
 * a = ((a + v0) + v1) + ... with v = float(y) or float(y) * w, each operation rounded on its own
 * (-ffp-contract=off). Folding several contributions into one pass keeps the running sum in a
 * register instead of storing and reloading the accumulator per contribution; the order of the
 * additions is exactly that of docs/semantics.md section 3. The first pass starts from +0.0f rather
  * than copying v0, so a -0.0 contribution becomes +0.0 as the contract's "acc = +0.0f" start
  * implies. Always inlined with constant m, first and weighted, so each combination becomes its own
  * straight-line, vectorised loop. */
static inline __attribute__((always_inline)) void
acc_pass(float *restrict acc, const uint16_t *const *rows, const float *weights, uint32_t m,
         int first, int weighted, uint32_t c0, uint32_t n)
{
        const uint16_t *restrict y0 = rows[0] + c0;
        const uint16_t *restrict y1 = m > 1 ? rows[1] + c0 : y0;
        const uint16_t *restrict y2 = m > 2 ? rows[2] + c0 : y0;
        const uint16_t *restrict y3 = m > 3 ? rows[3] + c0 : y0;
        const float w0 = weights[0], w1 = m > 1 ? weights[1] : 1.0f;
        const float w2 = m > 2 ? weights[2] : 1.0f, w3 = m > 3 ? weights[3] : 1.0f;

        for (uint32_t i = 0; i < n; i++) {
                float a = first ? 0.0f : acc[i];
                float v = epd__bf16_to_float(y0[i]);

                a = a + (weighted ? v * w0 : v);
                if (m > 1) {
                        v = epd__bf16_to_float(y1[i]);
                        a = a + (weighted ? v * w1 : v);
                }
                if (m > 2) {
                        v = epd__bf16_to_float(y2[i]);
                        a = a + (weighted ? v * w2 : v);
                }
                if (m > 3) {
                        v = epd__bf16_to_float(y3[i]);
                        a = a + (weighted ? v * w3 : v);
                }
                acc[i] = a;
        }
}

VECTOR_CLONES static void acc_contributions(float *restrict acc, const uint16_t *const *rows,
                              const float *weights, uint32_t count, int weighted, uint32_t c0,
                              uint32_t n)
{
        for (uint32_t j = 0; j < count;) {
                uint32_t m = count - j < 4 ? count - j : 4;
                int first = j == 0;

#define ACC_PASS(M, W) acc_pass(acc, rows + j, weights + j, M, first, W, c0, n)
                /* The first-pass flag stays a runtime value: the branch is loop-invariant and
                 * gcc unswitches it. */
                if (weighted) {
                        switch (m) {
                        case 1: ACC_PASS(1, 1); break;
                        case 2: ACC_PASS(2, 1); break;
                        case 3: ACC_PASS(3, 1); break;
                        default: ACC_PASS(4, 1); break;
                        }
                } else {
                        switch (m) {
                        case 1: ACC_PASS(1, 0); break;
                        case 2: ACC_PASS(2, 0); break;
                        case 3: ACC_PASS(3, 0); break;
                        default: ACC_PASS(4, 0); break;
                        }
                }
#undef ACC_PASS
                j += m;
        }
}

/* out = bf16(acc + bias0 + bias1): the biases are added last, then one rounding. */
VECTOR_CLONES static void acc_store(uint16_t *restrict out, const float *restrict acc,
                                    const uint16_t *b0, const uint16_t *b1, uint32_t n)
{
        if (b1) {
                for (uint32_t i = 0; i < n; i++) {
                        float a = acc[i] + epd__bf16_to_float(b0[i]);
                        out[i] = epd__float_to_bf16(a + epd__bf16_to_float(b1[i]));
                }
        } else if (b0) {
                for (uint32_t i = 0; i < n; i++)
                        out[i] = epd__float_to_bf16(acc[i] + epd__bf16_to_float(b0[i]));
        } else {
                for (uint32_t i = 0; i < n; i++)
                        out[i] = epd__float_to_bf16(acc[i]);
        }
}

/* combined_topk_weights with recv_weights (docs/semantics.md §3): for every k, +0.0f plus, for
 * each destination d that the token went to, in ascending d, d's recv_weights at the token's row
 * there, position k; a NaN sum is stored as 0x7FFFFFFF, the NaN that CUDA's fp32 additions give
 * (x86 keeps an input NaN's payload, and makes Inf + -Inf 0xFFC00000). sel and rows are the
 * token's plan entries: a NON_EXPAND row is set at the first position of each destination only,
 * so each row >= 0 names one destination. */
static void reduce_recv_weights(const struct epd_combine_exec *op, const int32_t *sel,
                                const int32_t *rows, float *out)
{
        const struct epd_plan *plan = op->plan;
        const uint32_t K = plan->num_topk, L = plan->num_local_experts;
        const float *wd[EPD_MAX_TOPK];
        uint32_t n = 0;

        for (uint32_t d = 0; d < plan->world_size && n < K; d++)
                for (uint32_t k = 0; k < K; k++)
                        if (rows[k] >= 0 && epd_route_expert_rank(sel[k], L) == d) {
                                wd[n++] = (const float *)mat_row(&op->recv_weights[d], rows[k]);
                                break;
                        }
        for (uint32_t k = 0; k < K; k++) {
                float acc = +0.0f;

                for (uint32_t j = 0; j < n; j++)
                        acc = acc + wd[j][k];
                if (acc != acc) {
                        const uint32_t nan = 0x7FFFFFFFu;

                        memcpy(&out[k], &nan, 4);
                } else {
                        out[k] = acc;
                }
        }
}

/* combined_topk_weights without recv_weights: the dispatch's weights as bits (a NaN's payload
 * included), +0.0f where topk_idx held -1. */
static void combine_copy_weights(uint32_t K, const int32_t *sel, const float *w, uint8_t *out)
{
        const float zero = 0.0f;

        for (uint32_t k = 0; k < K; k++)
                memcpy(out + (size_t)k * 4, sel[k] >= 0 ? (const void *)&w[k] : (const void *)&zero,
                       4);
}

static void combine_token(const struct epd_combine_exec *op, uint32_t s, uint32_t t)
{
        const struct epd_plan *plan = op->plan;
        const uint32_t K = plan->num_topk, L = plan->num_local_experts, H = op->hidden;
        const struct epd_combine_src_io *src = &op->src[s];
        const int32_t *sel = plan->topk[s] + (size_t)t * K;
        const int32_t *rows = plan->row[s] + (size_t)t * K;
        const int weighted = op->apply_weights && (src->source_weights.ptr || src->weights);
        const uint16_t *bias[2] = { NULL, NULL };
        const uint16_t *y[EPD_MAX_TOPK];
        float w[EPD_MAX_TOPK];
        uint32_t n = 0, nbias = 0;
        uint16_t *out = (uint16_t *)mat_row(&src->combined, t);
        float acc[ACC_COLS];

        /* The plan already encodes which positions contribute: NON_EXPAND rows are set only at a
         * destination's first position, EXPAND rows at every selection. */
        for (uint32_t k = 0; k < K; k++) {
                if (rows[k] < 0)
                        continue;
                y[n] = (const uint16_t *)mat_row(&op->y[epd_route_expert_rank(sel[k], L)],
                                                 rows[k]);
                w[n] = !weighted ? 1.0f
                       : src->source_weights.ptr
                               ? ((const float *)mat_row(&src->source_weights, t))[k]
                               : src->weights[(size_t)t * K + k];
                n++;
        }
        for (int b = 0; b < 2; b++)
                if (src->bias[b].ptr)
                        bias[nbias++] = (const uint16_t *)mat_row(&src->bias[b], t);

        for (uint32_t c0 = 0; c0 < H; c0 += ACC_COLS) {
                uint32_t cols = H - c0 < ACC_COLS ? H - c0 : ACC_COLS;

                if (n == 0)
                        memset(acc, 0, (size_t)cols * sizeof(float));
                else
                        acc_contributions(acc, y, w, n, weighted, c0, cols);
                acc_store(out + c0, acc, bias[0] ? bias[0] + c0 : NULL,
                          bias[1] ? bias[1] + c0 : NULL, cols);
        }

        if (src->combined_topk_weights.ptr && op->recv_weights)
                reduce_recv_weights(op, sel, rows, (float *)mat_row(&src->combined_topk_weights, t));
        else if (src->combined_topk_weights.ptr && src->weights)
                combine_copy_weights(K, sel, src->weights + (size_t)t * K,
                                     mat_row(&src->combined_topk_weights, t));
}

void epd_host_combine_item(const struct epd_combine_exec *op, uint64_t item)
{
        const struct epd_plan *plan = op->plan;
        uint64_t per_src = chunks_per_source(plan);
        uint32_t s = (uint32_t)(item / per_src);
        uint64_t t0 = item % per_src * CHUNK_TOKENS;
        uint64_t t1 = t0 + CHUNK_TOKENS;

        if (t1 > plan->num_tokens[s])
                t1 = plan->num_tokens[s];
        for (uint64_t t = t0; t < t1; t++)
                combine_token(op, s, (uint32_t)t);
}
