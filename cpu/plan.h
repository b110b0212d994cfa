/* plan.h - the placement plan of one dispatch (docs/semantics.md §2.1-2.3), computed on the host.
 *
 * The plan is the host-side implementation of the routing math of routing.h: per-source counts,
 * per-destination prefixes and expert bases, and the destination row of every (source, token,
 * top-k position). It is the routing state a handle keeps for combine and cached dispatch. Used by
 * the host backend and by the CUDA launchers' host side; tests never call it for their reference.
 *
 * Lifetime: epd_plan_new allocates everything for the given dims; epd_plan_free releases it.
 * Threading: epd_plan_count_source and epd_plan_place_source touch only source s's rows and may run
 * concurrently for different s; epd_plan_finish runs after every count and before any place.
 */
#ifndef EPD_CPU_PLAN_H
#define EPD_CPU_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

struct epd_plan {
        uint32_t world_size;        /* R */
        uint32_t num_experts;       /* E */
        uint32_t num_local_experts; /* L = E / R */
        uint32_t max_tokens;        /* T */
        uint32_t num_topk;          /* K_op */
        uint32_t expert_alignment;  /* >= 1 */
        enum epd_layout layout;

        uint32_t *num_tokens;       /* [R] N_s */
        int32_t **topk;             /* [R] -> [N_s * K_op] normalised expert ids (owned) */

        int32_t *tok_count;         /* [R src * R dst] tokens from s that go to d */
        int32_t *sel_count;         /* [R src * E] selections of expert e by s */

        int32_t *rank_prefix;       /* [R dst * (R+1)] first NON_EXPAND row of each source at d */
        int32_t *expert_count;      /* [R dst * L] raw selections per local expert */
        int32_t *expert_aligned;    /* [R dst * L] expert_count rounded up to the alignment */
        int32_t *expert_base;       /* [R dst * (L+1)] first EXPAND row of each local expert;
                                     * [L] is num_expanded_rows */
        int32_t *expert_src_prefix; /* [E * R] selections of e by sources < s */

        /* [R] -> [N_s * K_op]: destination row of (s, t, k) in the layout's output.
         * NON_EXPAND: the token's row at rank(topk[t][k]) at the first position for that rank,
         * -1 at other positions and at -1 entries. EXPAND: the selection's row, -1 at -1
         * entries. */
        int32_t **row;
};

/* Allocates a plan for R ranks (E, T, K_op, alignment, layout); num_tokens[s] gives N_s. Returns
 * NULL on allocation failure or when the dims break docs/semantics.md section 1 limits. */
struct epd_plan *epd_plan_new(uint32_t world_size, uint32_t num_experts, uint32_t max_tokens,
                              uint32_t num_topk, uint32_t expert_alignment,
                              enum epd_layout layout, const uint32_t *num_tokens);
/* Releases a plan; NULL is accepted. Returns NULL. */
struct epd_plan *epd_plan_free(struct epd_plan *plan);

/* Copies source s's topk_idx (int32 or int64 elements; row_stride in elements, 0 meaning K_op)
 * into plan->topk[s], validates it and counts it. topk_idx may be NULL when N_s is 0. An int64 id
 * is range-checked before it is narrowed, so 2^32 + 3 is rejected rather than read as 3. Returns 0,
  * or EPD_INVALID_ARGUMENT with a message in err naming the token, position and value (an id
  * outside [0,E) other than -1, or an expert repeated in a row). */
int epd_plan_count_source(struct epd_plan *plan, uint32_t s, const void *topk_idx,
                          enum epd_dtype dtype, uint64_t row_stride, char *err, size_t err_len);
/* Computes prefixes and expert bases from the counts of every source. */
void epd_plan_finish(struct epd_plan *plan);
/* Fills plan->row[s]: the deterministic prefix scan over source s's tokens. */
void epd_plan_place_source(struct epd_plan *plan, uint32_t s);

/* Rows the layout writes at destination d (NON_EXPAND rows or EXPAND rows with padding). */
int64_t epd_plan_rows(const struct epd_plan *plan, uint32_t d);
int32_t epd_plan_num_recv_tokens(const struct epd_plan *plan, uint32_t d);
int32_t epd_plan_num_expanded_rows(const struct epd_plan *plan, uint32_t d);

#endif
