/* randstep.h - randomised MoE steps through the real daemon, checked against the independent
 * reference: the step engine of the fault-injection test (integ_faults) and the soak (epd-soak).
 *
 * A step is dispatch, optionally a cached dispatch with new weights, then combine. Everything a
 * step does is a pure function of (shape seed, generation, step index), so every rank of a group
 * derives the same plan on its own, and any rank can rebuild any rank's inputs: x, scales, y and
 * biases are seeded per row, so a check can regenerate just the rows it samples. Within one group
 * config a plan varies N_s (per rank, <= step_tokens), K_op <= K, the topk_idx dtype, the layout,
 * expert_alignment, zero_padding, weights, apply_weights, the routing (uniform, skewed, one rank,
 * -1 entries, empty rows), biases (per rank), arena or client outputs (per rank), padded row
 * strides (per rank), and whether y is written in place into the arena.
 *
 * Checks (struct rs_worker.check):
 * - RS_CHECK_FULL: the counts; every row of every dispatch output, bitwise (ref_check_dispatch);
 *   every combined row and combined_topk_weights, bitwise (ref_check_combine).
 * - RS_CHECK_SAMPLED: the counts; every row's metadata (recv_src, recv_topk_idx, recv_weights,
 *   recv_topk_slot) and every zero-padding row; the payload (recv_x, recv_scales) of
 *   sample_rows random rows; sample_rows random combined rows and their combined_topk_weights.
 *   All bitwise against the same reference.
 */
#ifndef EPD_TESTS_RANDSTEP_H
#define EPD_TESTS_RANDSTEP_H

#include <stdint.h>

#include "epd.h"
#include "reference.h"
#include "testdata.h"

#define RS_MAX_RANKS 16
#define RS_SCALE_BLOCK 128

struct rs_shape {
        uint32_t world_size, num_experts, hidden, max_tokens, max_topk;
        enum epd_dtype dtype;     /* BF16 or FP8_E4M3 (scale block 128) */
        uint32_t step_tokens;     /* an ordinary step's N_s lies in [0, step_tokens] */
        uint64_t seed;
};

/* What every rank does in one step. */
struct rs_plan {
        int big;                  /* N_s = max_tokens on every rank, NON_EXPAND, K_op = K */
        uint32_t num_tokens[RS_MAX_RANKS];
        uint32_t num_topk;
        enum epd_dtype topk_dtype;
        enum epd_layout layout;
        uint32_t expert_alignment;
        int zero_padding, has_weights, apply_weights, cached, combined_weights;
        enum td_routing routing;
        uint32_t hot_rank;
        double minus_one_prob, empty_row_prob;
        uint32_t num_bias[RS_MAX_RANKS];
        int use_arena[RS_MAX_RANKS];
        int y_in_arena[RS_MAX_RANKS]; /* bf16 with the arena: y overwrites recv_x in place */
        uint32_t row_padding[RS_MAX_RANKS]; /* elements added to the x and recv_x row strides */
        unsigned num_ops;         /* 2, or 3 with a cached dispatch */
};

void rs_plan_make(const struct rs_shape *sh, uint64_t gen, uint64_t index, int big,
                  struct rs_plan *p);
/* One line describing the plan (for failure messages). */
const char *rs_plan_describe(const struct rs_plan *p, uint32_t world_size, char *buf,
                             size_t len);

/* The group config a shape implies (op_timeout_ms and arena_bytes given). */
struct epd_group_config rs_group_config(const struct rs_shape *sh, uint32_t op_timeout_ms,
                                        uint64_t arena_bytes);
/* Arena bytes that hold any ordinary step's outputs with room to spare. */
uint64_t rs_arena_bytes(const struct rs_shape *sh);

/* Points of a step where the hook runs. op_in_step: 0 is the dispatch, num_ops - 1 the combine
 * (1 is the cached dispatch when num_ops is 3). A non-zero return ends the step with RS_ERROR. */
enum rs_point { RS_BEFORE_SUBMIT, RS_AFTER_SUBMIT };
typedef int (*rs_hook_fn)(void *ctx, enum rs_point point, uint64_t index, unsigned op_in_step,
                          unsigned num_ops);

enum rs_check { RS_CHECK_FULL, RS_CHECK_SAMPLED };

/* Latency histogram: bucket b covers [2^(b/16), 2^((b+1)/16)) ns. */
#define RS_LAT_BUCKETS 640

struct rs_worker {
        const struct rs_shape *shape;
        uint32_t rank;
        struct epd_client *client;   /* borrowed */
        struct epd_group *group;     /* borrowed */
        /* The work region, registered by rs_step_run and grown when a step needs more. */
        uint8_t *base;
        uint64_t bytes, used, region_id;
        rs_hook_fn hook;
        void *hook_ctx;
        enum rs_check check;
        uint32_t sample_rows;
        int wait_ms;                 /* an op not done by then is a hang (RS_ERROR) */
        uint64_t *lat_hist;          /* optional [RS_LAT_BUCKETS], updated atomically */
        struct td_rng sample_rng;    /* which rows a sampled check looks at */
        /* Results. */
        uint64_t ops_ok, steps_ok, full_checks, sampled_checks, rows_checked;
        uint64_t regions_registered;
        uint64_t last_exec_ns;       /* backend time of the last successful dispatch */
        int fail_status;             /* RS_OP_FAILED: the op's status */
        unsigned fail_op_in_step;
        uint64_t fail_ns;            /* RS_OP_FAILED: CLOCK_MONOTONIC when the op returned */
        uint64_t fail_submit_ns;     /* RS_OP_FAILED: ... when it was submitted */
        char err[1536];
};

enum { RS_OK = 0, RS_OP_FAILED = 1, RS_MISMATCH = 2, RS_ERROR = 3 };

void rs_worker_init(struct rs_worker *w, const struct rs_shape *sh, uint32_t rank,
                    struct epd_client *client, struct epd_group *group);
/* Releases the work region (not the client or the group). */
void rs_worker_fini(struct rs_worker *w);
/* Runs step (gen, index) with plan p. RS_OK: every op succeeded and matched the reference;
 * RS_OP_FAILED: an op ended with a non-OK status (fail_*, err); RS_MISMATCH: an output differs
 * from the reference (err); RS_ERROR: anything else (err). */
int rs_step_run(struct rs_worker *w, const struct rs_plan *p, uint64_t gen, uint64_t index);

/* Joins group `name` as `rank`, creating it when it does not exist yet (whoever comes first
 * creates it; cfg is used then). Retries while the rank is still bound to a lost client or the
 * group is being created, up to timeout_ms. */
int rs_enter_group(struct epd_client *c, const char *name, uint32_t rank,
                   const struct epd_group_config *cfg, struct epd_group **out, int timeout_ms);

uint64_t rs_now_ns(void);
unsigned rs_lat_bucket(uint64_t ns);
/* The q-quantile (0..1) of a histogram, as the upper edge of its bucket; 0 when empty. */
uint64_t rs_lat_quantile(const uint64_t *hist, double q);

#endif
