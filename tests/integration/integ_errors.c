/* integ_errors.c - every error path of the dispatch/combine contract, against the real epd binary
 * with one worker process per rank (docs/semantics.md §1, §2.4, 2.5 and 4).
 *
 * Each test starts its own daemon, spawns the ranks' workers and stops the daemon expecting a
 * clean exit. Every worker checks on its own rank that a failing op ends with the expected status
 * (so no rank reports a partial result as OK) and a message that names the group, the op number
 * and the numbers involved; that no output byte was written when the op failed; and that the next
 * op on the group succeeds and matches the independent reference (tests/lib/reference.h). Covered:
 * - CAPACITY_EXCEEDED with client outputs (one rank short by one row; two ranks short through
 *   one output each, EXPAND padding included) and with an output arena that is too small;
 * - a mismatch across ranks: op kind, layout, expert_alignment, zero_padding, weights present,
 *   top-k width, topk_idx dtype, combine handle ids, apply_weights; apply_weights without an
 *   EXPAND dispatch that carried weights;
 * - invalid routing on one rank: an expert id >= E, an id < -1, an expert twice in a row;
 * - TIMEOUT after the group's op timeout and after the daemon's default (--op-timeout-ms);
 * - PEER_LOST when a rank's client is killed during an op, re-forming the group at op 0, and
 *   handles from before the break being gone;
 * - cached dispatch with another token count, an unknown handle or another layout;
 * - combine and cached dispatch naming a handle that one rank released;
 * - combine's weight inputs: recv_weights after an EXPAND dispatch, of the wrong width, or given
 *   by one rank only; source_weights of the wrong dtype or row count; combined_topk_weights with
 *   neither dispatch weights nor recv_weights; a caller's struct that ends before the weight
 *   inputs (size versioning) and one too short for the oldest layout.
 *
 * Workers share a small anonymous shared mapping with the test (barriers, flags, the kill time);
 * each test prints its case's seed, and every failure message repeats it.
 */
#include <check.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "workload.h"

#define BF EPD_DTYPE_BF16
#define I32 EPD_DTYPE_INT32
#define I64 EPD_DTYPE_INT64
#define NE EPD_LAYOUT_NON_EXPAND
#define EX EPD_LAYOUT_EXPAND
#define UNI TD_ROUTING_UNIFORM

#define MAX_RANKS 4
#define GROUP_NAME "errors"
#define REGION_BYTES (16u << 20) /* per worker: every op's inputs and outputs, never reused */
#define SENTINEL 0x5A            /* pre-fill of every output: a failed op must leave it */
#define COMBINED_FILL 0xEE       /* pre-fill of combined outputs */
#define WAIT_MS 10000            /* longest an op may take before the worker calls it a hang */
#define HUNG 1000                /* "status" of an op that did not complete within WAIT_MS */
#define SMALL_ARENA 4096u        /* arena bytes of the arena-capacity test */

/* ---- state shared between the test and its workers ---- */

struct shared {
        char socket[320];
        struct wl_case c;        /* the group's shape and the inputs' seed */
        int variant;             /* scenario variant */
        uint32_t op_timeout_ms;  /* group config; 0: the daemon's default */
        uint64_t arena_bytes;    /* group config; 0: a small 64 KiB arena (unused) */
        atomic_int barrier[8];
        atomic_int flag[8];
        atomic_llong kill_ms;    /* PEER_LOST: when the test killed the victim */
        atomic_ullong old_handle;
};

/* Flags of the PEER_LOST and op-kind scenarios. */
enum { FLAG_VICTIM_READY, FLAG_SUBMITTED, FLAG_REJOINED, FLAG_COMBINE_SUBMITTED };

/* Every one of n processes calls it once per barrier index. */
static int barrier(struct shared *sh, int index, int n)
{
        atomic_fetch_add(&sh->barrier[index], 1);
        return h_flag_wait(&sh->barrier[index], n, WAIT_MS);
}

/* ---- one rank's worker state ---- */

struct rank {
        struct shared *sh;
        uint32_t idx;            /* this worker's rank */
        struct epd_client *client;
        struct epd_group *group;
        uint8_t *base;           /* the worker's one registered region */
        uint64_t used, region_id;
        char msg[1024];          /* the message of the last op */
};

/* One dispatch's inputs of every rank, and its reference. The reference borrows the inputs. */
struct step {
        const struct wl_case *c;
        struct wl_inputs ins[MAX_RANKS];
        struct ref_dispatch *ref;
};

/* Client output tensors of one dispatch. */
enum out_field { OF_X, OF_TOPK_IDX, OF_WEIGHTS, OF_SRC, OF_TOPK_SLOT, OF_COUNT };

struct outputs {
        uint8_t *ptr[OF_COUNT]; /* NULL: not given */
        uint64_t bytes[OF_COUNT];
};

static int failf(const struct rank *rk, int line, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

static int failf(const struct rank *rk, int line, const char *fmt, ...)
{
        char detail[1536];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(detail, sizeof(detail), fmt, ap);
        va_end(ap);
        /* One write per line: the ranks' workers share stderr. */
        fprintf(stderr, "[%s variant=%d seed=%llu rank=%u line=%d] %s\n", rk->sh->c.name,
                rk->sh->variant, (unsigned long long)rk->sh->c.seed, rk->idx, line, detail);
        fflush(stderr);
        return 1;
}

/* Inside worker functions (a struct rank *rk in scope); they return 0 or non-zero. */
#define CHECK(cond, ...)                                                  \
        do {                                                              \
                if (!(cond))                                              \
                        return failf(rk, __LINE__, __VA_ARGS__);          \
        } while (0)
#define TRY(expr)                                                         \
        do {                                                              \
                if ((expr) != 0)                                          \
                        return 1;                                         \
        } while (0)

static struct epd_group_config group_config(const struct shared *sh)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = sh->c.world_size,
                .num_experts = sh->c.num_experts, .hidden = sh->c.hidden,
                .max_tokens_per_rank = sh->c.max_tokens, .max_topk = sh->c.num_topk,
                .dispatch_dtype = sh->c.dtype, .op_timeout_ms = sh->op_timeout_ms,
                .arena_bytes = sh->arena_bytes ? sh->arena_bytes : 64u << 10,
        };
        return cfg;
}

/* Connects, enters the group as rank idx (waiting while a lost client of the same rank is still
 * bound) and registers the worker's region. */
static int rank_open(struct rank *rk, struct shared *sh, uint32_t idx)
{
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = sh->socket,
                                       .client_name = sh->c.name, .timeout_ms = 20000 };
        struct epd_group_config cfg = group_config(sh);
        char err[512];
        void *base;
        int rc;

        memset(rk, 0, sizeof(*rk));
        rk->sh = sh;
        rk->idx = idx;
        rc = epd_client_connect(&ca, &rk->client, err, sizeof(err));
        CHECK(rc == 0, "connect: %s: %s", epd_status_name(rc), err);
        for (int attempt = 0; attempt < 500; attempt++) {
                rc = wl_enter_group(rk->client, GROUP_NAME, idx, &cfg, &rk->group);
                if (rc != EPD_ALREADY_EXISTS || idx == 0)
                        break;
                usleep(10000);
        }
        CHECK(rc == 0, "enter group as rank %u: %s: %s", idx, epd_status_name(rc),
              epd_client_last_error(rk->client));
        rc = epd_region_alloc(rk->client, REGION_BYTES, &base, &rk->region_id);
        CHECK(rc == 0, "region alloc: %s", epd_client_last_error(rk->client));
        rk->base = base;
        return 0;
}

static int rank_close(struct rank *rk)
{
        int rc = epd_group_leave(rk->group);

        rk->group = NULL;
        CHECK(rc == 0, "leave: %s", epd_client_last_error(rk->client));
        epd_client_free(rk->client);
        rk->client = NULL;
        return 0;
}

/* A bump allocator over the worker's region; sizing it is the test's own arithmetic. */
static void *take(struct rank *rk, uint64_t bytes)
{
        uint64_t off = (rk->used + 63) / 64 * 64;

        if (off + bytes > REGION_BYTES) {
                fprintf(stderr, "integ_errors: the worker region of %u bytes is exhausted\n",
                        REGION_BYTES);
                abort();
        }
        rk->used = off + bytes;
        return rk->base + off;
}

static struct epd_tensor tensor(const struct rank *rk, const void *ptr, enum epd_dtype dtype,
                                uint64_t rows, uint64_t cols)
{
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        t.dtype = dtype;
        t.ndim = cols ? 2 : 1;
        t.sizes[0] = rows;
        t.sizes[1] = cols;
        t.region_id = rk->region_id;
        t.offset = (uint64_t)((const uint8_t *)ptr - rk->base);
        return t;
}

static void step_free(struct step *st)
{
        st->ref = ref_dispatch_free(st->ref);
        for (int s = 0; s < MAX_RANKS; s++)
                wl_inputs_free(&st->ins[s]);
}

/* Generates every rank's inputs of case c at `step` (weights_variant picks the weights), keeps
 * the first num_tokens tokens of each rank (0: all) and, when with_ref, builds the reference. */
static int step_make(struct rank *rk, struct step *st, const struct wl_case *c, int step,
                     int weights_variant, uint32_t num_tokens, int with_ref)
{
        struct ref_src srcs[MAX_RANKS];
        struct ref_params params;
        char err[512];
        int rc;

        step_free(st);
        st->c = c;
        for (uint32_t s = 0; s < c->world_size; s++) {
                struct wl_inputs *in = &st->ins[s];
                CHECK(wl_inputs_make(c, s, step, weights_variant, in) == 0, "out of memory");
                if (num_tokens && num_tokens < in->num_tokens)
                        in->num_tokens = num_tokens;
                srcs[s] = (struct ref_src){
                        .num_tokens = in->num_tokens,
                        .x = { in->x, in->x_stride },
                        .topk_idx = { in->topk, 0 },
                        .weights = { c->has_weights ? in->weights : NULL, 0 },
                };
        }
        if (!with_ref)
                return 0;
        wl_ref_params(c, &params);
        rc = ref_dispatch_new(&params, srcs, &st->ref, err, sizeof(err));
        CHECK(rc == 0, "reference: %s", err);
        return 0;
}

static int64_t ref_rows(const struct step *st, uint32_t d)
{
        return st->ref->dst[d].rows;
}

/* Sets topk_idx[t][k] of an input in the case's dtype. */
static void topk_set(const struct wl_case *c, void *topk, uint32_t t, uint32_t k, int64_t value)
{
        if (c->topk_dtype == I64)
                ((int64_t *)topk)[(size_t)t * c->num_topk + k] = value;
        else
                ((int32_t *)topk)[(size_t)t * c->num_topk + k] = (int32_t)value;
}

/* Describes this rank's dispatch of st's inputs, copied into the region. With cap, the outputs
 * are client tensors of cap[f] rows each, filled with SENTINEL; without, they go to the arena. */
static void build_dispatch(struct rank *rk, const struct step *st, const uint64_t *cap,
                           struct epd_dispatch_args *da, struct outputs *o)
{
        const struct wl_case *c = st->c;
        const struct wl_inputs *in = &st->ins[rk->idx];
        uint32_t n = in->num_tokens, K = c->num_topk, H = c->hidden;
        uint64_t row_bytes = (uint64_t)H * epd_dtype_size(c->dtype);
        size_t te = epd_dtype_size(c->topk_dtype);
        int expand = c->layout == EX;
        uint8_t *x = take(rk, n * row_bytes);
        void *topk = take(rk, (uint64_t)n * K * te);

        memset(da, 0, sizeof(*da));
        da->size = sizeof(*da);
        da->num_tokens = n;
        da->num_topk = K;
        da->layout = c->layout;
        da->expert_alignment = c->expert_alignment;
        da->zero_padding = c->zero_padding;
        for (uint32_t t = 0; t < n; t++)
                memcpy(x + t * row_bytes, in->x + t * in->x_stride, row_bytes);
        da->x = tensor(rk, x, c->dtype, n, H);
        memcpy(topk, in->topk, (size_t)n * K * te);
        da->topk_idx = tensor(rk, topk, c->topk_dtype, n, K);
        if (c->has_weights) {
                float *w = take(rk, (uint64_t)n * K * 4);
                memcpy(w, in->weights, (size_t)n * K * 4);
                da->topk_weights = tensor(rk, w, EPD_DTYPE_FP32, n, K);
        }
        if (o)
                memset(o, 0, sizeof(*o));
        if (!cap) {
                da->use_arena = 1;
                return;
        }
        const struct {
                int present;
                struct epd_tensor *slot;
                enum epd_dtype dtype;
                uint64_t cols;
        } f[OF_COUNT] = {
                [OF_X] = { 1, &da->recv_x, c->dtype, H },
                [OF_TOPK_IDX] = { !expand, &da->recv_topk_idx, c->topk_dtype, K },
                [OF_WEIGHTS] = { c->has_weights, &da->recv_weights, EPD_DTYPE_FP32,
                                 expand ? 0 : K },
                [OF_SRC] = { 1, &da->recv_src, I64, 0 },
                [OF_TOPK_SLOT] = { expand, &da->recv_topk_slot, I32, 0 },
        };
        for (int i = 0; i < OF_COUNT; i++) {
                if (!f[i].present)
                        continue;
                o->bytes[i] = cap[i] * (f[i].cols ? f[i].cols : 1) * epd_dtype_size(f[i].dtype);
                o->ptr[i] = take(rk, o->bytes[i]);
                memset(o->ptr[i], SENTINEL, o->bytes[i]);
                *f[i].slot = tensor(rk, o->ptr[i], f[i].dtype, cap[i], f[i].cols);
        }
}

static void caps_all(uint64_t *cap, uint64_t rows)
{
        for (int i = 0; i < OF_COUNT; i++)
                cap[i] = rows;
}

/* The most rows any rank can receive: big enough for every case of this file. */
static uint64_t caps_worst(const struct wl_case *c)
{
        uint32_t L = c->num_experts / c->world_size;
        uint32_t a = c->expert_alignment ? c->expert_alignment : 1;

        return (uint64_t)c->world_size * c->max_tokens * c->num_topk + (uint64_t)L * a;
}

static int bytes_are(struct rank *rk, const char *what, const uint8_t *p, uint64_t bytes,
                     uint8_t value)
{
        for (uint64_t i = 0; i < bytes; i++)
                CHECK(p[i] == value, "%s byte %llu is 0x%02x after a failed op, expected 0x%02x",
                      what, (unsigned long long)i, p[i], value);
        return 0;
}

static int outputs_untouched(struct rank *rk, const struct outputs *o)
{
        static const char *const names[OF_COUNT] = { "recv_x", "recv_topk_idx", "recv_weights",
                                                     "recv_src", "recv_topk_slot" };

        for (int i = 0; i < OF_COUNT; i++)
                if (o->ptr[i])
                        TRY(bytes_are(rk, names[i], o->ptr[i], o->bytes[i], SENTINEL));
        return 0;
}

/* Waits for an op; returns its status, or HUNG when it did not complete within WAIT_MS. The
 * message goes to rk->msg. A hung op is leaked: freeing it would wait for it. */
static int op_finish(struct rank *rk, struct epd_op *op, struct epd_op **out)
{
        int rc = epd_op_wait(op, WAIT_MS), status = epd_op_status(op);

        /* epd_op_status tells a completed op from a wait that itself ran out. */
        if (rc == EPD_TIMEOUT && status == EPD_UNAVAILABLE) {
                snprintf(rk->msg, sizeof(rk->msg), "no completion within %d ms", WAIT_MS);
                return HUNG;
        }
        snprintf(rk->msg, sizeof(rk->msg), "%s", epd_op_error(op));
        if (out && status == EPD_OK)
                *out = op;
        else
                epd_op_free(op);
        return status;
}

static int dispatch_run(struct rank *rk, const struct epd_dispatch_args *da, struct epd_op **out)
{
        struct epd_op *op = NULL;
        int rc = epd_dispatch_submit(rk->group, da, &op);

        if (rc < 0) {
                snprintf(rk->msg, sizeof(rk->msg), "submit: %s", epd_client_last_error(rk->client));
                return rc;
        }
        return op_finish(rk, op, out);
}

static int combine_run(struct rank *rk, const struct epd_combine_args *cb,
                       struct epd_combine_result *res)
{
        struct epd_op *op = NULL;
        int rc = epd_combine_submit(rk->group, cb, &op), status;

        if (rc < 0) {
                snprintf(rk->msg, sizeof(rk->msg), "submit: %s", epd_client_last_error(rk->client));
                return rc;
        }
        status = op_finish(rk, op, &op);
        if (status == EPD_OK) {
                rc = epd_op_combine_result(op, res);
                epd_op_free(op);
                if (rc < 0)
                        return rc;
        }
        return status;
}

static const char *status_text(int status)
{
        return status == HUNG ? "HUNG" : epd_status_name(status);
}

/* The message names op number `number`: "op N" followed by a non-digit. */
static int mentions_op(const char *msg, uint64_t number)
{
        char needle[32];
        size_t len = (size_t)snprintf(needle, sizeof(needle), "op %llu", (unsigned long long)number);

        for (const char *p = strstr(msg, needle); p; p = strstr(p + 1, needle))
                if (p[len] < '0' || p[len] > '9')
                        return 1;
        return 0;
}

/* Op `number` ended with status `want` (never OK: this is a failure), and its message names the
 * group, the op number and contains every needle (a NULL-terminated list), docs/semantics.md §4. */
static int expect_fail(struct rank *rk, const char *what, int status, int want, uint64_t number,
                       ...)
{
        const char *needle;
        va_list ap;
        int missing = 0;

        CHECK(status == want, "%s (op %llu) gave %s, expected %s: '%s'", what,
              (unsigned long long)number, status_text(status), epd_status_name(want), rk->msg);
        CHECK(strstr(rk->msg, "group '" GROUP_NAME "'"), "%s: the message does not name the group: '%s'",
              what, rk->msg);
        CHECK(mentions_op(rk->msg, number), "%s: the message does not name op %llu: '%s'", what,
              (unsigned long long)number, rk->msg);
        va_start(ap, number);
        while ((needle = va_arg(ap, const char *)) != NULL) {
                if (!strstr(rk->msg, needle)) {
                        failf(rk, __LINE__, "%s: the message lacks '%s': '%s'", what, needle,
                              rk->msg);
                        missing = 1;
                }
        }
        va_end(ap);
        return missing;
}

/* Checks a completed dispatch against st's reference: op number, counts and every output (the
 * client outputs o, or the arena placement named in the reply when o is NULL). */
static int dispatch_check(struct rank *rk, const struct step *st, struct epd_op *op,
                          const struct outputs *o, uint64_t number, uint64_t *handle)
{
        struct epd_dispatch_result dr;
        struct ref_dispatch_actual act;
        char err[1024];
        int rc = epd_op_dispatch_result(op, &dr);

        CHECK(rc == 0, "dispatch result: %s", epd_status_name(rc));
        CHECK(dr.op_number == number, "the dispatch reply names op %llu, expected %llu",
              (unsigned long long)dr.op_number, (unsigned long long)number);
        struct ref_counts_actual counts = {
                dr.num_recv_tokens, dr.num_expanded_rows, dr.num_recv_tokens_per_expert,
                dr.num_recv_tokens_per_expert_aligned, dr.rank_prefix,
        };
        CHECK(ref_check_counts(st->ref, rk->idx, &counts, err, sizeof(err)) == 0, "counts: %s",
              err);
        memset(&act, 0, sizeof(act));
        if (o) {
                act.recv_x = (struct ref_buf){ o->ptr[OF_X], 0 };
                act.recv_topk_idx = (struct ref_buf){ o->ptr[OF_TOPK_IDX], 0 };
                act.recv_weights = (struct ref_buf){ o->ptr[OF_WEIGHTS], 0 };
                act.recv_src = (struct ref_buf){ o->ptr[OF_SRC], 0 };
                act.recv_topk_slot = (struct ref_buf){ o->ptr[OF_TOPK_SLOT], 0 };
        } else {
                act.recv_x = (struct ref_buf){ dr.recv_x_ptr, 0 };
                act.recv_topk_idx = (struct ref_buf){ dr.recv_topk_idx_ptr, 0 };
                act.recv_weights = (struct ref_buf){ dr.recv_weights_ptr, 0 };
                act.recv_src = (struct ref_buf){ dr.recv_src_ptr, 0 };
                act.recv_topk_slot = (struct ref_buf){ dr.recv_topk_slot_ptr, 0 };
        }
        CHECK(ref_check_dispatch(st->ref, rk->idx, &act, err, sizeof(err)) == 0,
              "dispatch outputs: %s", err);
        if (handle)
                *handle = dr.handle_id;
        return 0;
}

/* A dispatch of st with exactly enough client rows that must succeed as op `number`. */
static int dispatch_ok(struct rank *rk, const struct step *st, uint64_t number, uint64_t *handle)
{
        struct epd_dispatch_args da;
        struct outputs o;
        struct epd_op *op = NULL;
        uint64_t cap[OF_COUNT];
        int status;

        caps_all(cap, (uint64_t)ref_rows(st, rk->idx));
        build_dispatch(rk, st, cap, &da, &o);
        status = dispatch_run(rk, &da, &op);
        CHECK(status == EPD_OK, "dispatch (op %llu) gave %s: %s", (unsigned long long)number,
              status_text(status), rk->msg);
        int rc = dispatch_check(rk, st, op, &o, number, handle);
        epd_op_free(op);
        return rc;
}

/* The y rows of destination d: a seeded bf16 function of (seed, d, tag), the same in every
 * worker. */
static uint16_t *y_make(const struct wl_case *c, uint32_t d, int64_t rows, int tag)
{
        uint16_t *y = malloc((size_t)rows * c->hidden * 2 + 2);
        struct td_rng rng;

        if (!y)
                abort();
        td_rng_seed(&rng, td_mix_seed(c->seed, 9000000 + (uint64_t)d * 100 + (uint64_t)tag));
        td_fill_bf16(&rng, y, (uint64_t)rows, c->hidden, 0, 0.0);
        return y;
}

/* Describes this rank's combine of `handle` (dispatched from st) with y tag `tag`; the combined
 * outputs are filled with COMBINED_FILL and returned in *combined / *cw. */
static void build_combine(struct rank *rk, const struct step *st, uint64_t handle,
                          int apply_weights, int tag, struct epd_combine_args *cb,
                          uint16_t **combined, float **cw)
{
        const struct wl_case *c = st->c;
        uint32_t n = st->ins[rk->idx].num_tokens, H = c->hidden, K = c->num_topk;
        int64_t rows = ref_rows(st, rk->idx);
        uint16_t *y = y_make(c, rk->idx, rows, tag);
        uint16_t *yr = take(rk, (uint64_t)rows * H * 2);

        memcpy(yr, y, (size_t)rows * H * 2);
        free(y);
        memset(cb, 0, sizeof(*cb));
        cb->size = sizeof(*cb);
        cb->handle_id = handle;
        cb->apply_weights = apply_weights;
        cb->y = tensor(rk, yr, BF, (uint64_t)rows, H);
        *combined = take(rk, (uint64_t)n * H * 2);
        memset(*combined, COMBINED_FILL, (size_t)n * H * 2);
        cb->combined = tensor(rk, *combined, BF, n, H);
        *cw = NULL;
        if (c->has_weights) {
                *cw = take(rk, (uint64_t)n * K * 4);
                memset(*cw, COMBINED_FILL, (size_t)n * K * 4);
                cb->combined_topk_weights = tensor(rk, *cw, EPD_DTYPE_FP32, n, K);
        }
}

/* A combine of `handle` that must succeed as op `number` and match the reference. */
static int combine_ok(struct rank *rk, const struct step *st, uint64_t handle, int apply_weights,
                      int tag, uint64_t number)
{
        const struct wl_case *c = st->c;
        uint32_t R = c->world_size;
        struct epd_combine_args cb;
        struct epd_combine_result res;
        struct ref_buf ybufs[MAX_RANKS];
        uint16_t *ys[MAX_RANKS], *combined;
        struct ref_buf bias[2] = { { NULL, 0 }, { NULL, 0 } };
        char err[1024];
        float *cw;
        int status, rc;

        build_combine(rk, st, handle, apply_weights, tag, &cb, &combined, &cw);
        status = combine_run(rk, &cb, &res);
        CHECK(status == EPD_OK, "combine of handle %llu (op %llu) gave %s: %s",
              (unsigned long long)handle, (unsigned long long)number, status_text(status),
              rk->msg);
        CHECK(res.op_number == number, "the combine reply names op %llu, expected %llu",
              (unsigned long long)res.op_number, (unsigned long long)number);
        for (uint32_t d = 0; d < R; d++) {
                ys[d] = y_make(c, d, ref_rows(st, d), tag);
                ybufs[d] = (struct ref_buf){ ys[d], 0 };
        }
        struct ref_combine_in cin = { ybufs, apply_weights };
        rc = ref_check_combine(st->ref, &cin, rk->idx, bias, (struct ref_buf){ combined, 0 },
                               (struct ref_buf){ cw, 0 }, err, sizeof(err));
        for (uint32_t d = 0; d < R; d++)
                free(ys[d]);
        CHECK(rc == 0, "combine outputs: %s", err);
        return 0;
}

/* A combine that must fail; its combined outputs must stay untouched. */
static int combine_fails(struct rank *rk, const struct step *st, uint64_t handle,
                         int apply_weights, int want, uint64_t number, const char *n1,
                         const char *n2)
{
        struct epd_combine_args cb;
        struct epd_combine_result res;
        uint16_t *combined;
        float *cw;
        uint32_t n = st->ins[rk->idx].num_tokens;
        int status;

        build_combine(rk, st, handle, apply_weights, 0, &cb, &combined, &cw);
        status = combine_run(rk, &cb, &res);
        TRY(expect_fail(rk, "combine", status, want, number, n1, n2, NULL));
        TRY(bytes_are(rk, "combined", (const uint8_t *)combined, (uint64_t)n * st->c->hidden * 2,
                      COMBINED_FILL));
        if (cw)
                TRY(bytes_are(rk, "combined_topk_weights", (const uint8_t *)cw,
                              (uint64_t)n * st->c->num_topk * 4, COMBINED_FILL));
        return 0;
}

static int handle_release(struct rank *rk, uint64_t handle)
{
        int rc = epd_handle_release(rk->group, handle);

        CHECK(rc == 0, "release of handle %llu: %s: %s", (unsigned long long)handle,
              epd_status_name(rc), epd_client_last_error(rk->client));
        return 0;
}

/* ---- the test side ---- */

static struct shared *shared_new(const struct h_daemon *d, const struct wl_case *c, int variant)
{
        struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);

        ck_assert_msg(sh != MAP_FAILED, "mmap of the shared state failed");
        memset(sh, 0, sizeof(*sh));
        snprintf(sh->socket, sizeof(sh->socket), "%s", d->socket);
        sh->c = *c;
        sh->variant = variant;
        sh->op_timeout_ms = 10000;
        return sh;
}

static void announce(const struct wl_case *c, int variant, const char *what)
{
        printf("%s: case %s variant %d seed=%llu ranks=%u\n", what, c->name, variant,
               (unsigned long long)c->seed, c->world_size);
        fflush(stdout);
}

static void daemon_start(struct h_daemon *d, const char *const *extra_args)
{
        ck_assert_msg(h_daemon_start(d, extra_args) == 0, "epd did not start");
}

static void daemon_stop_clean(struct h_daemon *d)
{
        int rc = h_daemon_stop(d, 10000);

        ck_assert_msg(rc == 0, "epd exited with %d", rc);
}

/* Spawns one worker per rank and waits for all of them. */
static void workers_run(struct h_daemon *d, struct shared *sh, int (*worker)(void *, int))
{
        pid_t pids[MAX_RANKS];
        int failures;

        for (uint32_t r = 0; r < sh->c.world_size; r++)
                pids[r] = h_spawn(worker, sh, (int)r);
        failures = h_wait_all(pids, (int)sh->c.world_size, 30000);
        if (failures)
                h_daemon_dump_log(d);
        ck_assert_msg(failures == 0, "case %s variant %d (seed %llu): %d worker(s) failed",
                      sh->c.name, sh->variant, (unsigned long long)sh->c.seed, failures);
}

/* One case from start to clean stop: a daemon (with extra_args), the shared state (adjusted by
 * `setup` when not NULL), one `worker` per rank. */
static void run_case(const struct wl_case *c, int variant, const char *what,
                     const char *const *extra_args, void (*setup)(struct shared *),
                     int (*worker)(void *, int))
{
        struct h_daemon d;
        struct shared *sh;

        announce(c, variant, what);
        daemon_start(&d, extra_args);
        sh = shared_new(&d, c, variant);
        if (setup)
                setup(sh);
        workers_run(&d, sh, worker);
        munmap(sh, sizeof(*sh));
        daemon_stop_clean(&d);
}

/* name, seed, R, E, H, T, K, dtype, topk dtype, layout, align, zero_pad, weights, routing,
 * -1 probability, tokens, biases, apply_weights, arena, cached, steps, row padding, arena bytes
 * (only the group shape, the inputs' options and the seed matter here) */
static const struct wl_case capacity_cases[] = {
        { "capacity_ne", 301, 3, 12, 64, 16, 4, BF, I64, NE, 1, 0, 1, UNI, 0.1, WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 },
        { "capacity_ex_a4", 302, 3, 12, 64, 16, 4, BF, I32, EX, 4, 1, 1, UNI, 0.1,
          WL_TOKENS_DESCENDING, 0, 0, 0, 0, 1, 0, 0, 0 },
};

/* ---- 1. CAPACITY_EXCEEDED ---- */

/* Which output of rank d is one row short: variant 0 every output of rank 1; variant 1
 * recv_topk_slot of rank 1 and recv_x of rank 2 (a rank's capacity is its smallest output's).
 * -1: none; OF_COUNT: all. */
static int short_field(int variant, uint32_t d)
{
        if (variant == 0)
                return d == 1 ? OF_COUNT : -1;
        return d == 1 ? OF_TOPK_SLOT : d == 2 ? OF_X : -1;
}

static int capacity_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        struct step st = { 0 };
        struct epd_dispatch_args da;
        struct outputs o;
        uint64_t cap[OF_COUNT], handle;
        char need[128];
        int status, sf;

        TRY(rank_open(rk, sh, (uint32_t)index));
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 1));
        for (uint32_t d = 0; d < sh->c.world_size; d++)
                CHECK(short_field(sh->variant, d) < 0 || ref_rows(&st, d) >= 1,
                      "test data: rank %u receives no rows, it cannot be short", d);

        /* Every output exactly as large as needed, except the short ones: one row less. */
        caps_all(cap, (uint64_t)ref_rows(&st, rk->idx));
        sf = short_field(sh->variant, rk->idx);
        for (int f = 0; f < OF_COUNT; f++)
                if (sf == OF_COUNT || sf == f)
                        cap[f]--;
        build_dispatch(rk, &st, cap, &da, &o);
        status = dispatch_run(rk, &da, NULL);
        TRY(expect_fail(rk, "short dispatch", status, EPD_CAPACITY_EXCEEDED, 0, NULL));
        for (uint32_t d = 0; d < sh->c.world_size; d++) {
                if (short_field(sh->variant, d) >= 0) {
                        snprintf(need, sizeof(need), "rank %u needs %lld rows, capacity %lld", d,
                                 (long long)ref_rows(&st, d), (long long)ref_rows(&st, d) - 1);
                        CHECK(strstr(rk->msg, need), "the message lacks '%s': '%s'", need, rk->msg);
                } else {
                        snprintf(need, sizeof(need), "rank %u needs", d);
                        CHECK(!strstr(rk->msg, need), "rank %u has room but is listed: '%s'", d,
                              rk->msg);
                }
        }
        TRY(outputs_untouched(rk, &o));

        /* The group is still usable: exactly enough rows succeed (op 1), and combine (op 2). */
        TRY(dispatch_ok(rk, &st, 1, &handle));
        TRY(combine_ok(rk, &st, handle, 0, 0, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return rank_close(rk);
}

START_TEST(test_capacity_client_outputs)
{
        run_case(&capacity_cases[_i], _i, "capacity, client outputs", NULL, NULL,
                 capacity_worker);
}
END_TEST

/* The output arena holds SMALL_ARENA bytes: too small for the full op on every rank (its recv_x
 * alone is larger), large enough for two tokens per rank. */
static const struct wl_case arena_case = { "capacity_arena", 303, 3, 12, 64, 16, 4, BF, I64, NE,
                                           1, 0, 1, UNI, 0.0, WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 };

static int arena_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        struct step st = { 0 };
        struct epd_dispatch_args da;
        struct epd_op *op = NULL;
        uint64_t arena_bytes = 0, handle, row_bytes = sh->c.hidden * 2ull;
        uint8_t *arena;
        char need[128];
        int status;

        TRY(rank_open(rk, sh, (uint32_t)index));
        arena = epd_group_arena(rk->group, &arena_bytes);
        CHECK(arena && arena_bytes == SMALL_ARENA, "the rank's arena has %llu bytes, expected %u",
              (unsigned long long)arena_bytes, SMALL_ARENA);
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 1));
        for (uint32_t d = 0; d < sh->c.world_size; d++)
                CHECK((uint64_t)ref_rows(&st, d) * row_bytes > arena_bytes,
                      "test data: rank %u needs only %lld rows, which may fit the arena", d,
                      (long long)ref_rows(&st, d));
        memset(arena, SENTINEL, arena_bytes);
        build_dispatch(rk, &st, NULL, &da, NULL);
        status = dispatch_run(rk, &da, NULL);
        TRY(expect_fail(rk, "arena dispatch", status, EPD_CAPACITY_EXCEEDED, 0, NULL));
        for (uint32_t d = 0; d < sh->c.world_size; d++) {
                snprintf(need, sizeof(need), "rank %u needs %lld rows, its output arena", d,
                         (long long)ref_rows(&st, d));
                CHECK(strstr(rk->msg, need), "the message lacks '%s': '%s'", need, rk->msg);
        }
        TRY(bytes_are(rk, "arena", arena, arena_bytes, SENTINEL));

        /* Two tokens per rank fit: op 1 succeeds, its outputs in the arena. */
        TRY(step_make(rk, &st, &sh->c, 0, 0, 2, 1));
        build_dispatch(rk, &st, NULL, &da, NULL);
        status = dispatch_run(rk, &da, &op);
        CHECK(status == EPD_OK, "small arena dispatch gave %s: %s", status_text(status), rk->msg);
        struct epd_dispatch_result dr;
        CHECK(epd_op_dispatch_result(op, &dr) == 0, "dispatch result");
        CHECK(ref_rows(&st, rk->idx) == 0 ||
                      ((uint8_t *)dr.recv_x_ptr >= arena &&
                       (uint8_t *)dr.recv_x_ptr + ref_rows(&st, rk->idx) * row_bytes <=
                               arena + arena_bytes),
              "recv_x is not inside the rank's arena");
        TRY(dispatch_check(rk, &st, op, NULL, 1, &handle));
        epd_op_free(op);
        TRY(combine_ok(rk, &st, handle, 0, 0, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return rank_close(rk);
}

static void small_arena(struct shared *sh)
{
        sh->arena_bytes = SMALL_ARENA;
}

START_TEST(test_capacity_arena)
{
        run_case(&arena_case, 0, "capacity, output arena", NULL, small_arena, arena_worker);
}
END_TEST

/* ---- 2. a mismatch across ranks ---- */

enum mismatch {
        MM_KIND,                     /* rank 0 dispatches while rank 1 combines */
        MM_LAYOUT,                   /* rank 1 NON_EXPAND, rank 0 EXPAND */
        MM_ALIGNMENT,                /* expert_alignment 4 on rank 1, 1 on rank 0 */
        MM_ZERO_PADDING,             /* zero_padding on rank 1 only */
        MM_WEIGHTS,                  /* topk_weights on rank 0 only */
        MM_TOPK_WIDTH,               /* K_op 2 on rank 1, 4 on rank 0 */
        MM_TOPK_DTYPE,               /* int32 topk_idx on rank 1, int64 on rank 0 */
        MM_COMBINE_HANDLE,           /* combine naming different handles */
        MM_APPLY_WEIGHTS_DIFFER,     /* apply_weights on rank 0 only */
        MM_APPLY_WEIGHTS_NON_EXPAND, /* apply_weights after a NON_EXPAND dispatch */
        MM_APPLY_WEIGHTS_NO_WEIGHTS, /* apply_weights after a dispatch without weights */
        MM_COUNT
};

static const char *const mismatch_names[MM_COUNT] = {
        "mismatch_kind", "mismatch_layout", "mismatch_alignment", "mismatch_zero_padding",
        "mismatch_weights", "mismatch_topk_width", "mismatch_topk_dtype",
        "mismatch_combine_handle", "mismatch_apply_weights", "apply_weights_non_expand",
        "apply_weights_no_weights",
};

static const struct wl_case mismatch_case = { "mismatch", 311, 2, 8, 64, 16, 4, BF, I64, EX, 1,
                                              0, 1, UNI, 0.1, WL_TOKENS_DESCENDING, 0, 0, 0, 0, 1, 0, 0, 0 };

/* Rank 1's case for a dispatch-field mismatch; returns what the message must say. */
static const char *mismatch_bad_case(int variant, struct wl_case *bad)
{
        switch (variant) {
        case MM_LAYOUT:
                bad->layout = NE;
                return "layout/expert_alignment/zero_padding differ from rank 0's";
        case MM_ALIGNMENT:
                bad->expert_alignment = 4;
                return "layout/expert_alignment/zero_padding differ from rank 0's";
        case MM_ZERO_PADDING:
                bad->zero_padding = 1;
                return "layout/expert_alignment/zero_padding differ from rank 0's";
        case MM_WEIGHTS:
                bad->has_weights = 0;
                return "topk_weights absent but present on rank 0";
        case MM_TOPK_WIDTH:
                bad->num_topk = 2;
                return "top-k width 2 differs from rank 0's 4";
        default:
                bad->topk_dtype = I32;
                return "topk_idx dtype differs from rank 0's";
        }
}

static int mismatch_dispatch(struct rank *rk)
{
        const struct shared *sh = rk->sh;
        struct wl_case bad = sh->c;
        const char *detail = mismatch_bad_case(sh->variant, &bad);
        const struct wl_case *mine = rk->idx == 1 ? &bad : &sh->c;
        struct step st = { 0 };
        struct epd_dispatch_args da;
        struct outputs o;
        struct epd_op *op = NULL;
        uint64_t cap[OF_COUNT], handle;
        int status;

        TRY(step_make(rk, &st, mine, 0, 0, 0, 0));
        caps_all(cap, caps_worst(mine));
        build_dispatch(rk, &st, cap, &da, &o);
        status = dispatch_run(rk, &da, NULL);
        TRY(expect_fail(rk, "mismatched dispatch", status, EPD_INVALID_ARGUMENT, 0, "rank 1",
                        detail, NULL));
        TRY(outputs_untouched(rk, &o));

        /* Op 1 agrees and succeeds. expert_alignment 0 means 1: rank 0 passes 0, rank 1 1. */
        TRY(step_make(rk, &st, &sh->c, 1, 0, 0, 1));
        caps_all(cap, (uint64_t)ref_rows(&st, rk->idx));
        build_dispatch(rk, &st, cap, &da, &o);
        if (sh->variant == MM_ALIGNMENT)
                da.expert_alignment = rk->idx == 0 ? 0 : 1;
        status = dispatch_run(rk, &da, &op);
        CHECK(status == EPD_OK, "dispatch after the mismatch gave %s: %s", status_text(status),
              rk->msg);
        TRY(dispatch_check(rk, &st, op, &o, 1, &handle));
        epd_op_free(op);
        TRY(combine_ok(rk, &st, handle, 0, 1, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return 0;
}

static int mismatch_kind(struct rank *rk)
{
        const char *detail = "rank 1 submitted a combine, rank 0 a dispatch";
        struct step st = { 0 }, st2 = { 0 };
        uint64_t handle, cap[OF_COUNT];
        int status;

        TRY(step_make(rk, &st, &rk->sh->c, 0, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 0, &handle));
        if (rk->idx == 1) {
                /* Rank 1 submits its combine first, so op 1 starts out as a combine. */
                struct epd_combine_args cb;
                struct epd_op *op = NULL;
                uint16_t *combined;
                float *cw;

                build_combine(rk, &st, handle, 0, 0, &cb, &combined, &cw);
                CHECK(epd_combine_submit(rk->group, &cb, &op) == 0, "combine submit: %s",
                      epd_client_last_error(rk->client));
                atomic_store(&rk->sh->flag[FLAG_COMBINE_SUBMITTED], 1);
                status = op_finish(rk, op, NULL);
                TRY(expect_fail(rk, "combine against a dispatch", status, EPD_INVALID_ARGUMENT,
                                1, detail, NULL));
                TRY(bytes_are(rk, "combined", (const uint8_t *)combined,
                              (uint64_t)st.ins[1].num_tokens * st.c->hidden * 2, COMBINED_FILL));
        } else {
                struct epd_dispatch_args da;
                struct outputs o;

                CHECK(h_flag_wait(&rk->sh->flag[FLAG_COMBINE_SUBMITTED], 1, WAIT_MS) == 0,
                      "rank 1 did not submit its combine");
                usleep(50000);
                TRY(step_make(rk, &st2, &rk->sh->c, 1, 0, 0, 0));
                caps_all(cap, caps_worst(st2.c));
                build_dispatch(rk, &st2, cap, &da, &o);
                status = dispatch_run(rk, &da, NULL);
                TRY(expect_fail(rk, "dispatch against a combine", status, EPD_INVALID_ARGUMENT, 1,
                                detail, NULL));
                TRY(outputs_untouched(rk, &o));
                step_free(&st2);
        }
        /* The handle is intact: op 2, its combine, succeeds on both ranks. */
        TRY(combine_ok(rk, &st, handle, 0, 0, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return 0;
}

static int mismatch_combine_handle(struct rank *rk)
{
        struct step st1 = { 0 }, st2 = { 0 };
        uint64_t h1, h2;
        char detail[128];

        TRY(step_make(rk, &st1, &rk->sh->c, 0, 0, 0, 1));
        TRY(dispatch_ok(rk, &st1, 0, &h1));
        TRY(step_make(rk, &st2, &rk->sh->c, 1, 0, 0, 1));
        TRY(dispatch_ok(rk, &st2, 1, &h2));
        CHECK(h1 != h2, "two dispatches returned the same handle %llu", (unsigned long long)h1);
        snprintf(detail, sizeof(detail), "handle %llu differs from rank 0's %llu",
                 (unsigned long long)h2, (unsigned long long)h1);
        TRY(combine_fails(rk, rk->idx == 0 ? &st1 : &st2, rk->idx == 0 ? h1 : h2, 0,
                          EPD_INVALID_ARGUMENT, 2, "rank 1", detail));
        TRY(combine_ok(rk, &st2, h2, 0, 0, 3));
        TRY(combine_ok(rk, &st1, h1, 0, 1, 4));
        TRY(handle_release(rk, h1));
        TRY(handle_release(rk, h2));
        step_free(&st1);
        step_free(&st2);
        return 0;
}

static int mismatch_apply_weights(struct rank *rk)
{
        int differ = rk->sh->variant == MM_APPLY_WEIGHTS_DIFFER;
        struct step st = { 0 };
        uint64_t handle;

        TRY(step_make(rk, &st, &rk->sh->c, 0, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 0, &handle));
        if (differ)
                TRY(combine_fails(rk, &st, handle, rk->idx == 0, EPD_INVALID_ARGUMENT, 1,
                                  "rank 1", "apply_weights differs from rank 0's"));
        else
                TRY(combine_fails(rk, &st, handle, 1, EPD_INVALID_ARGUMENT, 1,
                                  rk->sh->variant == MM_APPLY_WEIGHTS_NON_EXPAND
                                          ? "apply_weights needs an EXPAND dispatch"
                                          : "apply_weights needs source_weights, fp32 [",
                                  NULL));
        /* Op 2 agrees (with weights applied where they exist) and succeeds. */
        TRY(combine_ok(rk, &st, handle, differ, 0, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return 0;
}

static int mismatch_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;

        TRY(rank_open(rk, sh, (uint32_t)index));
        switch (sh->variant) {
        case MM_KIND:
                TRY(mismatch_kind(rk));
                break;
        case MM_COMBINE_HANDLE:
                TRY(mismatch_combine_handle(rk));
                break;
        case MM_APPLY_WEIGHTS_DIFFER:
        case MM_APPLY_WEIGHTS_NON_EXPAND:
        case MM_APPLY_WEIGHTS_NO_WEIGHTS:
                TRY(mismatch_apply_weights(rk));
                break;
        default:
                TRY(mismatch_dispatch(rk));
                break;
        }
        return rank_close(rk);
}

START_TEST(test_mismatch)
{
        struct wl_case c = mismatch_case;

        c.name = mismatch_names[_i];
        if (_i == MM_APPLY_WEIGHTS_NON_EXPAND)
                c.layout = NE;
        if (_i == MM_APPLY_WEIGHTS_NO_WEIGHTS)
                c.has_weights = 0;
        run_case(&c, _i, "mismatch across ranks", NULL, NULL, mismatch_worker);
}
END_TEST

/* ---- 3. invalid routing on one rank ---- */

enum bad_route { ROUTE_TOO_LARGE, ROUTE_BELOW_MINUS_ONE, ROUTE_DUPLICATE, ROUTE_COUNT };

#define BAD_RANK 1u
#define BAD_TOKEN 3u

static const struct wl_case route_cases[ROUTE_COUNT] = {
        { "route_id_E", 321, 3, 12, 64, 16, 4, BF, I64, NE, 1, 0, 1, UNI, 0.1, WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 },
        { "route_id_minus_2", 322, 3, 12, 64, 16, 4, BF, I32, EX, 1, 0, 1, UNI, 0.1,
          WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 },
        { "route_duplicate", 323, 3, 12, 64, 16, 4, BF, I64, NE, 1, 0, 0, UNI, 0.1,
          WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 },
};

/* Corrupts token BAD_TOKEN of rank BAD_RANK in st; returns what the message must say. */
static const char *route_corrupt(struct step *st, int variant, char *detail, size_t len)
{
        const struct wl_case *c = st->c;
        void *topk = st->ins[BAD_RANK].topk;

        switch (variant) {
        case ROUTE_TOO_LARGE:
                topk_set(c, topk, BAD_TOKEN, 0, c->num_experts);
                snprintf(detail, len, "expert id %u outside", c->num_experts);
                break;
        case ROUTE_BELOW_MINUS_ONE:
                topk_set(c, topk, BAD_TOKEN, 0, -2);
                snprintf(detail, len, "expert id -2 outside");
                break;
        default:
                topk_set(c, topk, BAD_TOKEN, 0, 5);
                topk_set(c, topk, BAD_TOKEN, 1, 5);
                snprintf(detail, len, "token %d: expert 5 selected twice, again at topk position 1",
                         BAD_TOKEN);
                break;
        }
        return detail;
}

static int route_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        struct step st = { 0 };
        struct epd_dispatch_args da;
        struct outputs o;
        struct ref_dispatch *ref = NULL;
        struct ref_src srcs[MAX_RANKS];
        struct ref_params params;
        uint64_t cap[OF_COUNT], handle;
        char detail[128], where[64], err[256];
        int status;

        TRY(rank_open(rk, sh, (uint32_t)index));
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 0));
        route_corrupt(&st, sh->variant, detail, sizeof(detail));
        /* The reference agrees that the routing is invalid. */
        for (uint32_t s = 0; s < sh->c.world_size; s++)
                srcs[s] = (struct ref_src){ .num_tokens = st.ins[s].num_tokens,
                                            .x = { st.ins[s].x, st.ins[s].x_stride },
                                            .topk_idx = { st.ins[s].topk, 0 },
                                            .weights = { st.ins[s].weights, 0 } };
        wl_ref_params(&sh->c, &params);
        CHECK(ref_dispatch_new(&params, srcs, &ref, err, sizeof(err)) == EPD_INVALID_ARGUMENT,
              "the reference accepts the corrupted routing");

        caps_all(cap, caps_worst(&sh->c));
        build_dispatch(rk, &st, cap, &da, &o);
        status = dispatch_run(rk, &da, NULL);
        snprintf(where, sizeof(where), "rank %u token %u", BAD_RANK, BAD_TOKEN);
        TRY(expect_fail(rk, "dispatch with invalid routing", status, EPD_INVALID_ARGUMENT, 0,
                        where, detail, NULL));
        TRY(outputs_untouched(rk, &o));

        TRY(step_make(rk, &st, &sh->c, 1, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 1, &handle));
        TRY(combine_ok(rk, &st, handle, 0, 0, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return rank_close(rk);
}

START_TEST(test_invalid_routing)
{
        run_case(&route_cases[_i], _i, "invalid routing", NULL, NULL, route_worker);
}
END_TEST

/* ---- 4. TIMEOUT ---- */

#define DAEMON_OP_TIMEOUT_MS 200u

/* Rank 2 submits op 0 only after ranks 0 and 1 timed out. Variant 0: the group's op timeout
 * (300 ms); variant 1: the daemon's default (--op-timeout-ms 200, group config 0). */
static const struct wl_case timeout_case = { "timeout", 331, 3, 12, 64, 8, 2, BF, I64, NE, 1, 0,
                                             0, UNI, 0.0, WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 };

static int timeout_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        uint32_t timeout_ms = sh->op_timeout_ms ? sh->op_timeout_ms : DAEMON_OP_TIMEOUT_MS;
        struct step st = { 0 };
        struct epd_dispatch_args da;
        struct outputs o;
        uint64_t cap[OF_COUNT], handle;
        char detail[128];
        long long t0, elapsed;
        int status;

        TRY(rank_open(rk, sh, (uint32_t)index));
        CHECK(epd_group_config(rk->group)->op_timeout_ms == timeout_ms,
              "the group's op timeout is %u ms, expected %u",
              epd_group_config(rk->group)->op_timeout_ms, timeout_ms);
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 1));
        caps_all(cap, (uint64_t)ref_rows(&st, rk->idx));
        snprintf(detail, sizeof(detail), "rank(s) 2 did not submit within %u ms", timeout_ms);
        CHECK(barrier(sh, 0, 3) == 0, "not every rank joined");
        if (rk->idx < 2) {
                build_dispatch(rk, &st, cap, &da, &o);
                t0 = h_now_ms();
                status = dispatch_run(rk, &da, NULL);
                elapsed = h_now_ms() - t0;
                TRY(expect_fail(rk, "dispatch without rank 2", status, EPD_TIMEOUT, 0, detail,
                                NULL));
                CHECK(elapsed >= (long long)timeout_ms - 50 && elapsed <= 2000,
                      "TIMEOUT after %lld ms with an op timeout of %u ms", elapsed, timeout_ms);
                TRY(outputs_untouched(rk, &o));
        }
        CHECK(barrier(sh, 1, 3) == 0, "ranks 0 and 1 did not finish op 0");
        if (rk->idx == 2) {
                /* The late rank's op 0 ends the same way (docs/semantics.md §4), at once. */
                build_dispatch(rk, &st, cap, &da, &o);
                t0 = h_now_ms();
                status = dispatch_run(rk, &da, NULL);
                elapsed = h_now_ms() - t0;
                TRY(expect_fail(rk, "late dispatch", status, EPD_TIMEOUT, 0, detail, NULL));
                CHECK(elapsed < 1000, "the late op 0 took %lld ms to fail", elapsed);
                TRY(outputs_untouched(rk, &o));
        }
        /* Op 1 with every rank succeeds. */
        TRY(dispatch_ok(rk, &st, 1, &handle));
        TRY(combine_ok(rk, &st, handle, 0, 0, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return rank_close(rk);
}

/* Variant 0: the group sets its own timeout; variant 1: the daemon's default applies. */
static void group_timeout(struct shared *sh)
{
        sh->op_timeout_ms = sh->variant ? 0 : 300;
}

START_TEST(test_timeout)
{
        static const char *const daemon_args[] = { "--op-timeout-ms", "200", NULL };

        run_case(&timeout_case, _i, _i ? "timeout, daemon default" : "timeout, group config",
                 _i ? daemon_args : NULL, group_timeout, timeout_worker);
}
END_TEST

/* ---- 5. PEER_LOST ---- */

/* Op 0 succeeds on all three ranks; ranks 0 and 1 submit op 1 and the test SIGKILLs rank 2's
 * process before it submits. A new process binds rank 2 again and the group restarts at op 0. */
static const struct wl_case peer_case = { "peer_lost", 341, 3, 12, 64, 16, 4, BF, I64, EX, 4, 1,
                                          1, UNI, 0.1, WL_TOKENS_DESCENDING, 0, 0, 0, 0, 1, 0, 0, 0 };

/* Every rank after the group re-formed: op 0 is a fresh dispatch, the old handle is gone (op
 * 1), and the new one combines (op 2). */
static int peer_after_rejoin(struct rank *rk, uint64_t old_handle)
{
        struct step st = { 0 };
        uint64_t handle;
        char detail[128];
        int rc;

        TRY(step_make(rk, &st, &rk->sh->c, 2, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 0, &handle));
        CHECK(handle != old_handle, "the re-formed group reused handle id %llu",
              (unsigned long long)handle);
        snprintf(detail, sizeof(detail), "handle %llu does not exist",
                 (unsigned long long)old_handle);
        TRY(combine_fails(rk, &st, old_handle, 0, EPD_NOT_FOUND, 1, detail, NULL));
        TRY(combine_ok(rk, &st, handle, 1, 0, 2));
        TRY(handle_release(rk, handle));
        /* Releasing a handle that the break invalidated is harmless cleanup. */
        rc = epd_handle_release(rk->group, old_handle);
        CHECK(rc == 0, "release of the invalidated handle: %s", epd_client_last_error(rk->client));
        step_free(&st);
        return rank_close(rk);
}

static int peer_first_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        struct step st = { 0 };
        struct epd_dispatch_args da;
        struct outputs o;
        struct epd_op *op = NULL;
        uint64_t cap[OF_COUNT], old_handle;
        long long done, killed;
        int status;

        TRY(rank_open(rk, sh, (uint32_t)index));
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 0, &old_handle));
        if (rk->idx == 0)
                atomic_store(&sh->old_handle, old_handle);
        if (rk->idx == 2) {
                /* The victim: killed before it submits op 1. */
                atomic_store(&sh->flag[FLAG_VICTIM_READY], 1);
                for (;;)
                        pause();
        }
        TRY(step_make(rk, &st, &sh->c, 1, 0, 0, 0));
        caps_all(cap, caps_worst(&sh->c));
        build_dispatch(rk, &st, cap, &da, &o);
        CHECK(epd_dispatch_submit(rk->group, &da, &op) == 0, "submit: %s",
              epd_client_last_error(rk->client));
        atomic_fetch_add(&sh->flag[FLAG_SUBMITTED], 1);
        status = op_finish(rk, op, NULL);
        done = h_now_ms();
        killed = atomic_load(&sh->kill_ms);
        TRY(expect_fail(rk, "dispatch while rank 2 dies", status, EPD_PEER_LOST, 1, "rank 2",
                        NULL));
        CHECK(killed > 0 && done >= killed, "op 1 ended before rank 2 was killed");
        CHECK(done - killed <= 1000, "PEER_LOST came %lld ms after the kill", done - killed);
        TRY(outputs_untouched(rk, &o));
        step_free(&st);
        CHECK(h_flag_wait(&sh->flag[FLAG_REJOINED], 1, WAIT_MS) == 0, "rank 2 did not re-join");
        return peer_after_rejoin(rk, old_handle);
}

static int peer_rejoin_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;

        TRY(rank_open(rk, sh, (uint32_t)index));
        atomic_store(&sh->flag[FLAG_REJOINED], 1);
        return peer_after_rejoin(rk, atomic_load(&sh->old_handle));
}

START_TEST(test_peer_lost)
{
        struct h_daemon d;
        struct shared *sh;
        pid_t pids[3];
        int status, failures;

        announce(&peer_case, 0, "peer lost");
        daemon_start(&d, NULL);
        sh = shared_new(&d, &peer_case, 0);
        for (int r = 0; r < 3; r++)
                pids[r] = h_spawn(peer_first_worker, sh, r);
        if (h_flag_wait(&sh->flag[FLAG_VICTIM_READY], 1, WAIT_MS) < 0 ||
            h_flag_wait(&sh->flag[FLAG_SUBMITTED], 2, WAIT_MS) < 0) {
                for (int r = 0; r < 3; r++)
                        kill(pids[r], SIGKILL);
                h_wait_all(pids, 3, 1000);
                h_daemon_dump_log(&d);
                ck_abort_msg("op 0 did not complete or op 1 was not submitted (seed %llu)",
                             (unsigned long long)peer_case.seed);
        }
        usleep(100000); /* the daemon holds both submissions of op 1 */
        atomic_store(&sh->kill_ms, h_now_ms());
        ck_assert_int_eq(kill(pids[2], SIGKILL), 0);
        ck_assert_int_eq(waitpid(pids[2], &status, 0), pids[2]);
        pids[2] = h_spawn(peer_rejoin_worker, sh, 2);
        failures = h_wait_all(pids, 3, 30000);
        if (failures)
                h_daemon_dump_log(&d);
        ck_assert_msg(failures == 0, "peer lost (seed %llu): %d worker(s) failed",
                      (unsigned long long)peer_case.seed, failures);
        munmap(sh, sizeof(*sh));
        daemon_stop_clean(&d);
}
END_TEST

/* ---- 7. cached dispatch errors ---- */

static const struct wl_case cached_case = { "cached", 351, 2, 8, 64, 16, 4, BF, I64, NE, 1, 0, 1,
                                            UNI, 0.1, WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 };

/* A cached dispatch of st's inputs naming `handle` (no topk_idx); outputs of cap rows. */
static void build_cached(struct rank *rk, const struct step *st, uint64_t handle, uint64_t rows,
                         struct epd_dispatch_args *da, struct outputs *o)
{
        uint64_t cap[OF_COUNT];

        caps_all(cap, rows);
        build_dispatch(rk, st, cap, da, o);
        memset(&da->topk_idx, 0, sizeof(da->topk_idx));
        da->handle_id = handle;
}

static int cached_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        struct wl_case expand = sh->c;
        struct step st = { 0 }, st2 = { 0 };
        struct epd_dispatch_args da;
        struct outputs o;
        struct epd_op *op = NULL;
        uint64_t handle, worst = caps_worst(&sh->c), T = sh->c.max_tokens, h2;
        char detail[128];
        int status;

        TRY(rank_open(rk, sh, (uint32_t)index));
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 0, &handle));

        /* Op 1: rank 1 names one token fewer than the handle holds. */
        TRY(step_make(rk, &st2, &sh->c, 0, 1, 0, 0));
        if (rk->idx == 1)
                st2.ins[1].num_tokens = (uint32_t)T - 1;
        build_cached(rk, &st2, handle, worst, &da, &o);
        status = dispatch_run(rk, &da, NULL);
        snprintf(detail, sizeof(detail), "cached dispatch with %llu tokens, the handle has %llu",
                 (unsigned long long)T - 1, (unsigned long long)T);
        TRY(expect_fail(rk, "cached dispatch with another N", status, EPD_INVALID_ARGUMENT, 1,
                        "rank 1", detail, NULL));
        TRY(outputs_untouched(rk, &o));

        /* Op 2: a handle that never existed. */
        TRY(step_make(rk, &st2, &sh->c, 0, 1, 0, 0));
        build_cached(rk, &st2, handle + 1000, worst, &da, &o);
        status = dispatch_run(rk, &da, NULL);
        snprintf(detail, sizeof(detail), "handle %llu does not exist",
                 (unsigned long long)handle + 1000);
        TRY(expect_fail(rk, "cached dispatch of an unknown handle", status, EPD_NOT_FOUND, 2,
                        detail, NULL));
        TRY(outputs_untouched(rk, &o));

        /* Op 3: the EXPAND layout for a NON_EXPAND handle. */
        expand.layout = EX;
        TRY(step_make(rk, &st2, &expand, 0, 1, 0, 0));
        build_cached(rk, &st2, handle, caps_worst(&expand), &da, &o);
        status = dispatch_run(rk, &da, NULL);
        TRY(expect_fail(rk, "cached dispatch with another layout", status, EPD_INVALID_ARGUMENT,
                        3, "cached dispatch must use the handle's layout", NULL));
        TRY(outputs_untouched(rk, &o));

        /* Op 4: a correct cached dispatch with new weights rewrites every output; op 5
         * combines. */
        TRY(step_make(rk, &st2, &sh->c, 0, 1, 0, 1));
        build_cached(rk, &st2, handle, (uint64_t)ref_rows(&st2, rk->idx), &da, &o);
        status = dispatch_run(rk, &da, &op);
        CHECK(status == EPD_OK, "cached dispatch gave %s: %s", status_text(status), rk->msg);
        TRY(dispatch_check(rk, &st2, op, &o, 4, &h2));
        epd_op_free(op);
        CHECK(h2 == handle, "the cached dispatch named handle %llu, expected %llu",
              (unsigned long long)h2, (unsigned long long)handle);
        TRY(combine_ok(rk, &st2, handle, 0, 0, 5));
        TRY(handle_release(rk, handle));
        step_free(&st);
        step_free(&st2);
        return rank_close(rk);
}

START_TEST(test_cached_dispatch_errors)
{
        run_case(&cached_case, 0, "cached dispatch errors", NULL, NULL, cached_worker);
}
END_TEST

/* ---- 8. a handle released by one rank ---- */

static const struct wl_case release_case = { "released", 361, 3, 12, 64, 16, 4, BF, I64, NE, 1,
                                             0, 1, UNI, 0.1, WL_TOKENS_DESCENDING, 0, 0, 0, 0, 1, 0, 0, 0 };

static int release_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        struct step st = { 0 }, st2 = { 0 };
        struct epd_dispatch_args da;
        struct outputs o;
        uint64_t handle, h2;
        char detail[128];
        int status;

        TRY(rank_open(rk, sh, (uint32_t)index));
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 0, &handle));
        /* Rank 0 releases before it submits op 1, so op 1 cannot start before the release. */
        if (rk->idx == 0)
                TRY(handle_release(rk, handle));
        snprintf(detail, sizeof(detail), "handle %llu was released by rank 0",
                 (unsigned long long)handle);
        TRY(combine_fails(rk, &st, handle, 0, EPD_NOT_FOUND, 1, detail, NULL));

        /* Op 2: a cached dispatch naming it fails the same way. */
        TRY(step_make(rk, &st2, &sh->c, 0, 1, 0, 0));
        build_cached(rk, &st2, handle, caps_worst(&sh->c), &da, &o);
        status = dispatch_run(rk, &da, NULL);
        TRY(expect_fail(rk, "cached dispatch of a released handle", status, EPD_NOT_FOUND, 2,
                        detail, NULL));
        TRY(outputs_untouched(rk, &o));

        /* The group carries on: ops 3 and 4. */
        TRY(step_make(rk, &st2, &sh->c, 1, 0, 0, 1));
        TRY(dispatch_ok(rk, &st2, 3, &h2));
        TRY(combine_ok(rk, &st2, h2, 0, 0, 4));
        TRY(handle_release(rk, h2));
        if (rk->idx != 0)
                TRY(handle_release(rk, handle));
        step_free(&st);
        step_free(&st2);
        return rank_close(rk);
}

START_TEST(test_released_handle)
{
        run_case(&release_case, 0, "released handle", NULL, NULL, release_worker);
}
END_TEST

/* ---- 9. combine's weight inputs (docs/semantics.md §3) ---- */

enum combine_weights_variant {
        CW_RECV_EXPAND,      /* recv_weights after an EXPAND dispatch, on every rank */
        CW_RECV_WIDTH,       /* rank 1's recv_weights [rows, K + 1] */
        CW_RECV_ONE_RANK,    /* recv_weights on rank 0 only */
        CW_SOURCE_DTYPE,     /* rank 1's source_weights bf16 (apply_weights, EXPAND) */
        CW_SOURCE_ROWS,      /* rank 0's source_weights [N + 1, K] */
        CW_CTW_NO_WEIGHTS,   /* combined_topk_weights, no dispatch weights, no recv_weights */
        CW_OLD_SIZE,         /* size ends before recv_weights: they are ignored, the op is OK */
        CW_COUNT
};

static const char *const cw_names[CW_COUNT] = {
        "recv_weights_expand", "recv_weights_width", "recv_weights_one_rank",
        "source_weights_dtype", "source_weights_rows", "combined_topk_weights_no_weights",
        "combine_args_old_size",
};

static const struct wl_case cw_case = { "combine_weights", 371, 2, 8, 64, 16, 4, BF, I64, NE, 1,
                                        0, 1, UNI, 0.1, WL_TOKENS_FULL, 0, 0, 0, 0, 1, 0, 0, 0 };

/* An fp32 (or bf16) [rows, cols] tensor of the rank's region, filled with 0.5. */
static struct epd_tensor cw_tensor(struct rank *rk, enum epd_dtype dtype, uint64_t rows,
                                   uint64_t cols)
{
        float *p = take(rk, rows * cols * 4 + 4);

        for (uint64_t i = 0; i < rows * cols; i++)
                p[i] = 0.5f;
        return tensor(rk, p, dtype, rows, cols);
}

static int cw_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct rank rk_s, *rk = &rk_s;
        const int v = sh->variant;
        const uint32_t K = sh->c.num_topk;
        struct step st = { 0 };
        struct epd_combine_args cb;
        struct epd_combine_result res;
        struct epd_op *op = NULL;
        uint16_t *combined;
        float *cw;
        uint64_t handle;
        char detail[160];
        int status;

        TRY(rank_open(rk, sh, (uint32_t)index));
        TRY(step_make(rk, &st, &sh->c, 0, 0, 0, 1));
        TRY(dispatch_ok(rk, &st, 0, &handle));
        const uint32_t me = rk->idx, n = st.ins[me].num_tokens;
        const uint64_t rows = (uint64_t)ref_rows(&st, me);
        build_combine(rk, &st, handle, v == CW_SOURCE_DTYPE || v == CW_SOURCE_ROWS, 0, &cb,
                      &combined, &cw);
        detail[0] = 0;
        switch (v) {
        case CW_RECV_EXPAND:
                cb.recv_weights = cw_tensor(rk, EPD_DTYPE_FP32, rows, K);
                snprintf(detail, sizeof(detail), "recv_weights: the handle's dispatch is EXPAND");
                break;
        case CW_RECV_WIDTH:
                cb.recv_weights = cw_tensor(rk, EPD_DTYPE_FP32, rows, me == 1 ? K + 1 : K);
                snprintf(detail, sizeof(detail),
                         "rank 1: recv_weights (expected fp32 [%lld, %u]): %u columns, expected %u",
                         (long long)ref_rows(&st, 1), K, K + 1, K);
                break;
        case CW_RECV_ONE_RANK:
                if (me == 0)
                        cb.recv_weights = cw_tensor(rk, EPD_DTYPE_FP32, rows, K);
                snprintf(detail, sizeof(detail),
                         "rank 1: recv_weights absent but present on rank 0");
                break;
        case CW_SOURCE_DTYPE:
                cb.source_weights = cw_tensor(rk, me == 1 ? BF : EPD_DTYPE_FP32, n, K);
                snprintf(detail, sizeof(detail),
                         "rank 1: source_weights (expected fp32 [%u, %u]): dtype",
                         st.ins[1].num_tokens, K);
                break;
        case CW_SOURCE_ROWS:
                cb.source_weights = cw_tensor(rk, EPD_DTYPE_FP32, me == 0 ? n + 1 : n, K);
                snprintf(detail, sizeof(detail),
                         "rank 0: source_weights (expected fp32 [%u, %u]): %u rows, expected %u",
                         st.ins[0].num_tokens, K, st.ins[0].num_tokens + 1,
                         st.ins[0].num_tokens);
                break;
        case CW_CTW_NO_WEIGHTS:
                cw = take(rk, (uint64_t)n * K * 4 + 4);
                memset(cw, COMBINED_FILL, (size_t)n * K * 4);
                cb.combined_topk_weights = tensor(rk, cw, EPD_DTYPE_FP32, n, K);
                snprintf(detail, sizeof(detail),
                         "combined_topk_weights needs a dispatch that carried weights, or "
                         "recv_weights");
                break;
        default:
                /* A caller built before the weight inputs: its size ends at wait_inputs, and
                 * whatever lies past it is not read. One size shorter still is refused. */
                memset(&cb.recv_weights, 0x5C, sizeof(cb.recv_weights));
                memset(&cb.source_weights, 0x5C, sizeof(cb.source_weights));
                cb.size = offsetof(struct epd_combine_args, wait_inputs) + sizeof(uint64_t) - 1;
                status = epd_combine_submit(rk->group, &cb, &op);
                CHECK(status == EPD_INVALID_ARGUMENT && !op,
                      "a combine of size %zu gave %s", cb.size, status_text(status));
                CHECK(strstr(epd_client_last_error(rk->client), "epd_combine_args.size"),
                      "the message does not name the size: '%s'",
                      epd_client_last_error(rk->client));
                cb.size = offsetof(struct epd_combine_args, recv_weights);
                status = combine_run(rk, &cb, &res);
                CHECK(status == EPD_OK, "a combine of the oldest size gave %s: %s",
                      status_text(status), rk->msg);
                break;
        }
        if (v != CW_OLD_SIZE) {
                status = combine_run(rk, &cb, &res);
                TRY(expect_fail(rk, "combine", status, EPD_INVALID_ARGUMENT, 1, detail, NULL));
                TRY(bytes_are(rk, "combined", (const uint8_t *)combined,
                              (uint64_t)n * sh->c.hidden * 2, COMBINED_FILL));
                if (cw)
                        TRY(bytes_are(rk, "combined_topk_weights", (const uint8_t *)cw,
                                      (uint64_t)n * K * 4, COMBINED_FILL));
        }
        /* The handle is intact: op 2, a plain combine, matches the reference. */
        TRY(combine_ok(rk, &st, handle, v == CW_SOURCE_DTYPE || v == CW_SOURCE_ROWS, 1, 2));
        TRY(handle_release(rk, handle));
        step_free(&st);
        return rank_close(rk);
}

START_TEST(test_combine_weights)
{
        struct wl_case c = cw_case;

        c.name = cw_names[_i];
        if (_i == CW_RECV_EXPAND || _i == CW_SOURCE_DTYPE || _i == CW_SOURCE_ROWS)
                c.layout = EX;
        if (_i == CW_CTW_NO_WEIGHTS)
                c.has_weights = 0;
        run_case(&c, _i, "combine weight inputs", NULL, NULL, cw_worker);
}
END_TEST

static Suite *errors_suite(void)
{
        Suite *s = suite_create("integ_errors");
        TCase *tc;

        tc = tcase_create("capacity");
        tcase_set_timeout(tc, 30);
        tcase_add_loop_test(tc, test_capacity_client_outputs, 0,
                            (int)(sizeof(capacity_cases) / sizeof(capacity_cases[0])));
        tcase_add_test(tc, test_capacity_arena);
        suite_add_tcase(s, tc);

        tc = tcase_create("mismatch");
        tcase_set_timeout(tc, 30);
        tcase_add_loop_test(tc, test_mismatch, 0, MM_COUNT);
        suite_add_tcase(s, tc);

        tc = tcase_create("routing");
        tcase_set_timeout(tc, 30);
        tcase_add_loop_test(tc, test_invalid_routing, 0, ROUTE_COUNT);
        suite_add_tcase(s, tc);

        tc = tcase_create("lost_and_late");
        tcase_set_timeout(tc, 30);
        tcase_add_loop_test(tc, test_timeout, 0, 2);
        tcase_add_test(tc, test_peer_lost);
        suite_add_tcase(s, tc);

        tc = tcase_create("handles");
        tcase_set_timeout(tc, 30);
        tcase_add_test(tc, test_cached_dispatch_errors);
        tcase_add_test(tc, test_released_handle);
        tcase_add_loop_test(tc, test_combine_weights, 0, CW_COUNT);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        return h_run_suite(errors_suite());
}
