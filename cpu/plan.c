/* plan.c - the placement plan of one dispatch (docs/semantics.md §2.1-2.3), computed on the host.
 *
 * Three phases, so that the per-source work can run on several threads:
 * 1. epd_plan_count_source (per source, concurrent): normalise topk_idx to int32, validate it, and
 *    count tokens per destination and selections per expert.
 * 2. epd_plan_finish (once): prefix sums over sources, which fix where every source's rows start
 *    at every destination, and the aligned expert bases of EXPAND.
 * 3. epd_plan_place_source (per source, concurrent): a sequential scan over the source's tokens
 *    that hands out consecutive rows from those starting points. Because the scan visits tokens in
 *    ascending order, rows come out ordered by source, then token, as docs/semantics.md requires.
 *
 * All rank/expert arithmetic goes through routing.h so the CUDA kernels place rows identically.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "routing.h"

/* calloc that never returns NULL for a zero count, so "absent" and "empty" are not confused. */
static void *alloc_zeroed(size_t count, size_t size)
{
        return calloc(count ? count : 1, size);
}

struct epd_plan *epd_plan_new(uint32_t world_size, uint32_t num_experts, uint32_t max_tokens,
                              uint32_t num_topk, uint32_t expert_alignment,
                              enum epd_layout layout, const uint32_t *num_tokens)
{
        struct epd_plan *plan;
        uint32_t num_local;
        uint64_t max_rows;

        if (world_size < 1 || world_size > EPD_MAX_WORLD_SIZE || num_experts < 1 ||
            num_experts > EPD_MAX_EXPERTS || num_experts % world_size != 0)
                return NULL;
        num_local = num_experts / world_size;
        if (num_local > EPD_MAX_LOCAL_EXPERTS || num_topk < 1 || num_topk > EPD_MAX_TOPK ||
            expert_alignment < 1 || max_tokens < 1 || num_tokens == NULL)
                return NULL;
        if (layout != EPD_LAYOUT_NON_EXPAND && layout != EPD_LAYOUT_EXPAND)
                return NULL;
        /* Rows and counts are int32 (the wire and device formats of docs/semantics.md §2.3), so the
         * worst case of either layout must fit. */
        max_rows = epd_route_max_rows_expand(world_size, max_tokens, num_topk, num_local,
                                             expert_alignment);
        if (max_rows > INT32_MAX ||
            epd_route_max_rows_non_expand(world_size, max_tokens) > INT32_MAX)
                return NULL;
        for (uint32_t s = 0; s < world_size; s++)
                if (num_tokens[s] > max_tokens)
                        return NULL;

        plan = calloc(1, sizeof(*plan));
        if (!plan)
                return NULL;
        plan->world_size = world_size;
        plan->num_experts = num_experts;
        plan->num_local_experts = num_local;
        plan->max_tokens = max_tokens;
        plan->num_topk = num_topk;
        plan->expert_alignment = expert_alignment;
        plan->layout = layout;

        plan->num_tokens = alloc_zeroed(world_size, sizeof(*plan->num_tokens));
        plan->topk = alloc_zeroed(world_size, sizeof(*plan->topk));
        plan->row = alloc_zeroed(world_size, sizeof(*plan->row));
        plan->tok_count = alloc_zeroed((size_t)world_size * world_size, sizeof(int32_t));
        plan->sel_count = alloc_zeroed((size_t)world_size * num_experts, sizeof(int32_t));
        plan->rank_prefix = alloc_zeroed((size_t)world_size * (world_size + 1), sizeof(int32_t));
        plan->expert_count = alloc_zeroed((size_t)world_size * num_local, sizeof(int32_t));
        plan->expert_aligned = alloc_zeroed((size_t)world_size * num_local, sizeof(int32_t));
        plan->expert_base = alloc_zeroed((size_t)world_size * (num_local + 1), sizeof(int32_t));
        plan->expert_src_prefix = alloc_zeroed((size_t)num_experts * world_size, sizeof(int32_t));
        if (!plan->num_tokens || !plan->topk || !plan->row || !plan->tok_count ||
            !plan->sel_count || !plan->rank_prefix || !plan->expert_count ||
            !plan->expert_aligned || !plan->expert_base || !plan->expert_src_prefix)
                return epd_plan_free(plan);

        for (uint32_t s = 0; s < world_size; s++) {
                size_t n = (size_t)num_tokens[s] * num_topk;

                plan->num_tokens[s] = num_tokens[s];
                plan->topk[s] = alloc_zeroed(n, sizeof(int32_t));
                plan->row[s] = alloc_zeroed(n, sizeof(int32_t));
                if (!plan->topk[s] || !plan->row[s])
                        return epd_plan_free(plan);
        }
        return plan;
}

struct epd_plan *epd_plan_free(struct epd_plan *plan)
{
        if (!plan)
                return NULL;
        for (uint32_t s = 0; s < plan->world_size; s++) {
                if (plan->topk)
                        free(plan->topk[s]);
                if (plan->row)
                        free(plan->row[s]);
        }
        free(plan->num_tokens);
        free(plan->topk);
        free(plan->row);
        free(plan->tok_count);
        free(plan->sel_count);
        free(plan->rank_prefix);
        free(plan->expert_count);
        free(plan->expert_aligned);
        free(plan->expert_base);
        free(plan->expert_src_prefix);
        free(plan);
        return NULL;
}

/* Reads element k of a topk row of either integer dtype, widened so that an int64 value outside
 * int32 cannot alias a valid expert id. */
static int64_t topk_element(const void *row, enum epd_dtype dtype, uint32_t k)
{
        if (dtype == EPD_DTYPE_INT64) {
                int64_t v;
                memcpy(&v, (const uint8_t *)row + (size_t)k * sizeof(v), sizeof(v));
                return v;
        }
        int32_t v;
        memcpy(&v, (const uint8_t *)row + (size_t)k * sizeof(v), sizeof(v));
        return v;
}

int epd_plan_count_source(struct epd_plan *plan, uint32_t s, const void *topk_idx,
                          enum epd_dtype dtype, uint64_t row_stride, char *err, size_t err_len)
{
        const uint32_t R = plan->world_size, E = plan->num_experts, K = plan->num_topk;
        const uint32_t L = plan->num_local_experts, N = plan->num_tokens[s];
        int32_t *tok_count = plan->tok_count + (size_t)s * R;
        int32_t *sel_count = plan->sel_count + (size_t)s * E;
        size_t elem = dtype == EPD_DTYPE_INT64 ? sizeof(int64_t) : sizeof(int32_t);

        if (dtype != EPD_DTYPE_INT32 && dtype != EPD_DTYPE_INT64) {
                if (err && err_len)
                        snprintf(err, err_len, "topk_idx dtype must be int32 or int64");
                return EPD_INVALID_ARGUMENT;
        }
        if (row_stride == 0)
                row_stride = K;
        memset(tok_count, 0, (size_t)R * sizeof(*tok_count));
        memset(sel_count, 0, (size_t)E * sizeof(*sel_count));

        for (uint32_t t = 0; t < N; t++) {
                const uint8_t *in = (const uint8_t *)topk_idx + (size_t)t * row_stride * elem;
                int32_t *out = plan->topk[s] + (size_t)t * K;

                for (uint32_t k = 0; k < K; k++) {
                        int64_t v = topk_element(in, dtype, k);

                        if (v < -1 || v >= (int64_t)E) {
                                if (err && err_len)
                                        snprintf(err, err_len,
                                                 "rank %u token %u topk position %u: expert id "
                                                 "%" PRId64 " outside [0, %u) and not -1",
                                                 s, t, k, v, E);
                                return EPD_INVALID_ARGUMENT;
                        }
                        out[k] = (int32_t)v;
                        if (v < 0)
                                continue;
                        /* K <= 32, so a quadratic duplicate check is cheaper than clearing a
                         * bitmap of E bits per token. */
                        for (uint32_t j = 0; j < k; j++) {
                                if (out[j] == out[k]) {
                                        if (err && err_len)
                                                snprintf(err, err_len,
                                                         "rank %u token %u: expert %" PRId64
                                                         " selected twice, again at topk position %u",
                                                         s, t, v, k);
                                        return EPD_INVALID_ARGUMENT;
                                }
                        }
                        sel_count[v]++;
                        if (epd_route_is_first_for_rank(out, k, L))
                                tok_count[epd_route_expert_rank(out[k], L)]++;
                }
        }
        return 0;
}

void epd_plan_finish(struct epd_plan *plan)
{
        const uint32_t R = plan->world_size, E = plan->num_experts, L = plan->num_local_experts;

        /* NON_EXPAND: source s's rows at d start after every earlier source's rows at d. */
        for (uint32_t d = 0; d < R; d++) {
                int32_t *prefix = plan->rank_prefix + (size_t)d * (R + 1);
                int32_t acc = 0;

                for (uint32_t s = 0; s < R; s++) {
                        prefix[s] = acc;
                        acc += plan->tok_count[(size_t)s * R + d];
                }
                prefix[R] = acc;
        }

        /* EXPAND: per expert, the selections of earlier sources; per destination, the aligned
         * bases of its local experts. */
        for (uint32_t e = 0; e < E; e++) {
                int32_t *src_prefix = plan->expert_src_prefix + (size_t)e * R;
                int32_t acc = 0;

                for (uint32_t s = 0; s < R; s++) {
                        src_prefix[s] = acc;
                        acc += plan->sel_count[(size_t)s * E + e];
                }
                plan->expert_count[e] = acc; /* expert e is local id e % L of rank e / L */
        }
        for (uint32_t d = 0; d < R; d++) {
                int32_t *base = plan->expert_base + (size_t)d * (L + 1);
                int32_t acc = 0;

                for (uint32_t l = 0; l < L; l++) {
                        size_t e = (size_t)d * L + l;
                        int32_t aligned = (int32_t)epd_route_align_up(
                                (uint64_t)plan->expert_count[e], plan->expert_alignment);

                        plan->expert_aligned[e] = aligned;
                        base[l] = acc;
                        acc += aligned;
                }
                base[L] = acc;
        }
}

void epd_plan_place_source(struct epd_plan *plan, uint32_t s)
{
        const uint32_t R = plan->world_size, E = plan->num_experts, K = plan->num_topk;
        const uint32_t L = plan->num_local_experts, N = plan->num_tokens[s];
        const int32_t *topk = plan->topk[s];
        int32_t *row = plan->row[s];
        /* The next free row per destination (NON_EXPAND) or per expert (EXPAND). Both bounds are
         * small (R <= 1024, E <= 2048), so a stack array keeps this function allocation-free and
         * safe to run concurrently for different sources. */
        int32_t cursor[EPD_MAX_EXPERTS > EPD_MAX_WORLD_SIZE ? EPD_MAX_EXPERTS : EPD_MAX_WORLD_SIZE];

        if (plan->layout == EPD_LAYOUT_NON_EXPAND) {
                for (uint32_t d = 0; d < R; d++)
                        cursor[d] = plan->rank_prefix[(size_t)d * (R + 1) + s];
                for (uint32_t t = 0; t < N; t++) {
                        const int32_t *sel = topk + (size_t)t * K;
                        int32_t *out = row + (size_t)t * K;

                        for (uint32_t k = 0; k < K; k++) {
                                if (sel[k] >= 0 && epd_route_is_first_for_rank(sel, k, L))
                                        out[k] = cursor[epd_route_expert_rank(sel[k], L)]++;
                                else
                                        out[k] = -1;
                        }
                }
                return;
        }

        for (uint32_t e = 0; e < E; e++) {
                uint32_t d = epd_route_expert_rank((int32_t)e, L);
                uint32_t l = epd_route_expert_local((int32_t)e, L);

                cursor[e] = plan->expert_base[(size_t)d * (L + 1) + l] +
                            plan->expert_src_prefix[(size_t)e * R + s];
        }
        for (size_t i = 0; i < (size_t)N * K; i++)
                row[i] = topk[i] >= 0 ? cursor[topk[i]]++ : -1;
}

int64_t epd_plan_rows(const struct epd_plan *plan, uint32_t d)
{
        if (plan->layout == EPD_LAYOUT_EXPAND)
                return epd_plan_num_expanded_rows(plan, d);
        return epd_plan_num_recv_tokens(plan, d);
}

int32_t epd_plan_num_recv_tokens(const struct epd_plan *plan, uint32_t d)
{
        return plan->rank_prefix[(size_t)d * (plan->world_size + 1) + plan->world_size];
}

int32_t epd_plan_num_expanded_rows(const struct epd_plan *plan, uint32_t d)
{
        return plan->expert_base[(size_t)d * (plan->num_local_experts + 1) +
                                 plan->num_local_experts];
}
