/* workload.h - one MoE step (dispatch, stand-in expert, combine) driven through the real daemon
 * by one worker process per rank, with every output checked bitwise against the independent
 * reference. Shared by the integration tests, `make demo` and the benchmark's verification.
 *
 * Every rank regenerates every rank's inputs from the case seed (they are a pure function of it),
 * so each worker can build the reference on its own without talking to the others.
 */
#ifndef EPD_TESTS_WORKLOAD_H
#define EPD_TESTS_WORKLOAD_H

#include <stdint.h>

#include "epd.h"
#include "reference.h"
#include "testdata.h"

#define WL_SCALE_BLOCK 128 /* fp8 channels per scale: the group default */

enum wl_tokens {
        WL_TOKENS_FULL = 0,      /* N_s = T on every rank */
        WL_TOKENS_DESCENDING = 1,/* N_s = T - s */
        WL_TOKENS_SOME_ZERO = 2, /* odd ranks send nothing, even ranks T - s */
};

struct wl_case {
        const char *name;
        uint64_t seed;
        uint32_t world_size, num_experts, hidden, max_tokens, num_topk;
        enum epd_dtype dtype;
        enum epd_dtype topk_dtype;
        enum epd_layout layout;
        uint32_t expert_alignment;
        int zero_padding;
        int has_weights;
        enum td_routing routing;
        double minus_one_prob;
        enum wl_tokens tokens;
        uint32_t num_bias;
        int apply_weights;
        int use_arena;
        int cached;             /* also run a cached dispatch (new weights) and a second combine */
        int steps;              /* MoE steps to run (>= 1) */
        int row_padding;        /* extra elements of row stride on inputs and outputs */
        uint64_t arena_bytes;   /* group arena; 0: sized from the case */
        uint32_t combine_weights; /* WL_COMBINE_* bits: combine's weight inputs */
};

/* combine_weights (docs/semantics.md §3): every destination gives recv_weights (NON_EXPAND;
 * seeded, so they differ from the dispatch's) and asks for combined_topk_weights, with or without
 * dispatch weights; every source gives source_weights (the w(t, k) of apply_weights). */
#define WL_COMBINE_RECV_WEIGHTS 1u
#define WL_COMBINE_SOURCE_WEIGHTS 2u

/* Per-rank timing of the last step, filled by wl_worker when not NULL. */
struct wl_timing {
        uint64_t dispatch_ns, combine_ns;         /* client-observed, submit to completion */
        uint64_t dispatch_exec_ns, combine_exec_ns; /* backend execution time */
        uint64_t *dispatch_step_ns;   /* optional [steps]: every step's dispatch_ns */
};

/* Generates source s's inputs. Buffers are allocated and owned by *in (wl_inputs_free). */
struct wl_inputs {
        uint32_t num_tokens;
        uint8_t *x;             /* [N, H] (row stride x_stride bytes) */
        uint64_t x_stride;
        float *scales;          /* [N, H/128] */
        void *topk;             /* [N, K] */
        float *weights;         /* [N, K] */
};

uint32_t wl_num_tokens(const struct wl_case *c, uint32_t s);
int wl_inputs_make(const struct wl_case *c, uint32_t s, int step, int weights_variant,
                   struct wl_inputs *in);
void wl_inputs_free(struct wl_inputs *in);
/* Fills ref_params from a case. */
void wl_ref_params(const struct wl_case *c, struct ref_params *p);

/* The worker body of rank `rank`: joins group `group_name` on the daemon at socket_path, runs
 * the case and checks every output. Returns 0 on success, 1 on a mismatch or error (described on
 * stderr together with the seed). */
int wl_worker(const struct wl_case *c, const char *socket_path, const char *group_name,
              uint32_t rank, struct wl_timing *timing);

/* Joins (rank > 0) or creates (rank 0) a group, retrying joins until the creator has made it. */
int wl_enter_group(struct epd_client *client, const char *name, uint32_t rank,
                   const struct epd_group_config *cfg, struct epd_group **out);
/* Joins an existing group (any rank, rank 0 too: a rank bound again) on `device`, once. */
int wl_join_group_on(struct epd_client *client, const char *name, uint32_t rank, uint32_t device,
                     struct epd_group **out);

#endif
