/* cx.c - client-executed dispatch and combine on the CPU (see cx.h and docs/client-execution.md).
 *
 * Each rank's thread runs its own ops; ranks meet only through words in the buffers of
 * common/cx_layout.h. The placement math is cpu/plan.c's, fed with every source's counts from the
 * count records, and the data movement is cpu/exec.c's, restricted to this rank's tokens (and,
 * for EXPAND padding, this rank's own rows), so rows and combined values are bit for bit the host
 * backend's.
 *
 * Memory ordering (C11 atomics on words of the shared buffers; the rest is plain memory):
 * - A signal slot's body (count record, y record) is written with plain stores, then its tag with
 *   a release store. A reader acquire-loads the tag and, once it equals the op's tag, reads the
 *   body: the release/acquire pair makes the body visible. Nothing weaker suffices, nothing
 *   stronger is needed: the only cross-thread fact is "the body is complete".
 * - Done flags: a release store after this source's row writes to a destination; the destination's
 *   acquire of every source's flag makes all rows visible before the dispatch returns.
 * - Acks: a release store after this rank's reads of a peer's y. Release orders earlier loads as
 *   well as stores, so the peer, acquiring every ack before its combine returns, knows no read of
 *   its y is still in flight and may rewrite it.
 * - Slot reuse (parity) needs no further ordering: each op acquires a word from every rank, so a
 *   rank writing a slot for op n + 2 has acquired the peer's word of op n + 1, which the peer
 *   released after its last read of that slot for op n.
 * - The abort and drain words, the epoch and the statistics are read or written relaxed: their
 *   value alone matters and no data hangs off them. The op counter is touched only by this rank's
 *   thread, so relaxed suffices there too.
 * - A status ring entry is written with its tag last (release), so another thread of the client
 *   that acquires the tag of op n reads that op's status.
 */
#include <inttypes.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cx.h"
#include "fp8.h"
#include "exec.h"
#include "plan.h"

#define DEFAULT_TIMEOUT_NS 10000000000ull

static uint64_t load_acquire(const uint64_t *p)
{
        return atomic_load_explicit((_Atomic uint64_t *)p, memory_order_acquire);
}

static void store_release(uint64_t *p, uint64_t v)
{
        atomic_store_explicit((_Atomic uint64_t *)p, v, memory_order_release);
}

static uint64_t load_relaxed64(const uint64_t *p)
{
        return atomic_load_explicit((_Atomic uint64_t *)p, memory_order_relaxed);
}

static void store_relaxed64(uint64_t *p, uint64_t v)
{
        atomic_store_explicit((_Atomic uint64_t *)p, v, memory_order_relaxed);
}

static uint32_t load_relaxed32(const uint32_t *p)
{
        return atomic_load_explicit((_Atomic uint32_t *)p, memory_order_relaxed);
}

static void add_relaxed64(uint64_t *p, uint64_t v)
{
        atomic_fetch_add_explicit((_Atomic uint64_t *)p, v, memory_order_relaxed);
}

static uint64_t now_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- buffers ---- */

void cx_buffer_init(uint8_t *buf, const struct cx_layout *l, uint32_t rank, uint64_t epoch)
{
        struct cx_header *h = cx_header_of(buf, l);

        h->magic = CX_MAGIC;
        h->version = CX_VERSION;
        h->rank = rank;
        h->world_size = l->shape.world_size;
        h->total_bytes = l->total_bytes;
        cx_buffer_reform(buf, l, epoch);
}

void cx_buffer_reform(uint8_t *buf, const struct cx_layout *l, uint64_t epoch)
{
        struct cx_header *h = cx_header_of(buf, l);

        /* The group is quiet (no op of the old epoch runs), and the clients learn of the new
         * epoch through the control plane, which orders these stores before their next op. */
        store_relaxed64(&h->op_counter, 0);
        store_relaxed64(&h->drain_op, 0);
        h->sticky_status = 0;
        h->sticky_epoch = 0;
        h->launch_seq = 0;
        atomic_store_explicit((_Atomic uint32_t *)&h->abort_word, 0, memory_order_relaxed);
        for (uint32_t i = 0; i < l->shape.num_handles; i++)
                cx_handle_at(buf, l, i)->tag = 0;
        store_relaxed64(&h->epoch, epoch);
}

void cx_buffer_abort(uint8_t *buf, const struct cx_layout *l)
{
        atomic_store_explicit((_Atomic uint32_t *)&cx_header_of(buf, l)->abort_word, 1,
                              memory_order_relaxed);
}

/* ---- one op's frame ---- */

struct op_ctx {
        const struct cx_rank *r;
        const struct cx_layout *l;
        uint8_t *own;
        struct cx_header *hdr;
        uint64_t epoch, op, tag, deadline;
        uint32_t parity;
        int kind;                   /* 0 dispatch, 1 combine */
        uint64_t t[CX_PHASES + 1];  /* the phases' bounds (cx_layout.h), ns; 0: not reached */
};

static void status_clear(struct cx_op_status *st)
{
        memset(st, 0, sizeof(*st));
        st->rank = st->token = st->pos = -1;
}

static void status_set(struct cx_op_status *st, int32_t status, int32_t reason, int32_t rank)
{
        status_clear(st);
        st->status = status;
        st->reason = reason;
        st->rank = rank;
}

/* Takes the next op number and decides whether the op may run. Returns 0, or the op's status in
 * st (drain: the op is refused and takes no number, *numbered = 0). */
static int op_begin(const struct cx_rank *r, int kind, struct op_ctx *c,
                    struct cx_op_status *st, int *numbered)
{
        uint64_t drain;

        c->r = r;
        c->l = r->layout;
        c->own = r->bufs[r->rank];
        c->hdr = cx_header_of(c->own, c->l);
        c->epoch = load_relaxed64(&c->hdr->epoch);
        c->op = load_relaxed64(&c->hdr->op_counter);
        c->tag = cx_tag(c->epoch, c->op);
        c->parity = (uint32_t)(c->op & 1u);
        c->kind = kind;
        memset(c->t, 0, sizeof(c->t));
        c->t[0] = now_ns();
        c->deadline = c->t[0] + (r->timeout_ns ? r->timeout_ns : DEFAULT_TIMEOUT_NS);
        status_clear(st);
        *numbered = 0;

        drain = load_relaxed64(&c->hdr->drain_op);
        if (drain && c->op >= drain - 1) {
                status_set(st, EPD_ABORTED, CX_REASON_DRAIN, (int32_t)r->rank);
                return st->status;
        }
        store_relaxed64(&c->hdr->op_counter, c->op + 1);
        *numbered = 1;
        if (c->hdr->sticky_status != 0 && c->hdr->sticky_epoch == c->epoch) {
                *st = c->hdr->sticky;
                st->reason = CX_REASON_STICKY;
                st->status = c->hdr->sticky_status;
                return st->status;
        }
        if (load_relaxed32(&c->hdr->abort_word)) {
                status_set(st, EPD_PEER_LOST, CX_REASON_ABORT, -1);
                return st->status;
        }
        return 0;
}

/* Records the op's end: the status ring entry, the sticky failure, the statistics. */
static int op_end(struct op_ctx *c, struct cx_op_status *st, int numbered, uint64_t rows,
                  uint64_t bytes)
{
        struct cx_op_status *slot;

        if (!numbered)
                return st->status;
        c->t[CX_PHASES] = now_ns();
        st->start_ns = c->t[0];
        st->end_ns = c->t[CX_PHASES];
        if (st->status == 0) {
                add_relaxed64(&c->hdr->stats.ops, 1);
                add_relaxed64(&c->hdr->stats.rows, rows);
                add_relaxed64(&c->hdr->stats.bytes, bytes);
                if (c->t[CX_PHASE_MOVE] && c->t[CX_PHASE_FINISH]) {
                        add_relaxed64(&c->hdr->stats.kind_ops[c->kind], 1);
                        for (int i = 0; i < CX_PHASES; i++)
                                add_relaxed64(&c->hdr->stats.phase_ns[c->kind][i],
                                              c->t[i + 1] - c->t[i]);
                }
        } else {
                add_relaxed64(&c->hdr->stats.failures, 1);
                if (c->hdr->sticky_status == 0 || c->hdr->sticky_epoch != c->epoch) {
                        c->hdr->sticky = *st;
                        c->hdr->sticky_epoch = c->epoch;
                        c->hdr->sticky_status = st->status;
                }
        }
        slot = &cx_header_of(c->own, c->l)->status[c->op % CX_STATUS_RING];
        memcpy((uint8_t *)slot + sizeof(slot->tag), (const uint8_t *)st + sizeof(st->tag),
               sizeof(*st) - sizeof(st->tag));
        store_release(&slot->tag, c->tag);
        return st->status;
}

/* Waits until *word == the op's tag. Returns 0, PEER_LOST once the abort word is set, or TIMEOUT
 * at the op's deadline; st names the peer. Spins briefly, then yields, then sleeps, so that more
 * ranks than cores still make progress. */
static int wait_tag(struct op_ctx *c, const uint64_t *word, uint32_t peer,
                    struct cx_op_status *st)
{
        for (uint32_t spins = 0;; spins++) {
                if (load_acquire(word) == c->tag)
                        return 0;
                if (load_relaxed32(&c->hdr->abort_word)) {
                        status_set(st, EPD_PEER_LOST, CX_REASON_ABORT, (int32_t)peer);
                        return st->status;
                }
                if (spins < 64)
                        continue;
                if (now_ns() > c->deadline) {
                        status_set(st, EPD_TIMEOUT, CX_REASON_TIMEOUT, (int32_t)peer);
                        return st->status;
                }
                if (spins < 1024) {
                        sched_yield();
                } else {
                        struct timespec ts = { 0, 20000 };
                        nanosleep(&ts, NULL);
                }
        }
}

/* Releases tag into slot [parity][this rank] of part in every rank's buffer. */
static void signal_all(struct op_ctx *c, uint64_t part)
{
        for (uint32_t d = 0; d < c->l->shape.world_size; d++)
                store_release(&cx_flag_at(c->r->bufs[d], part, c->l, c->parity, c->r->rank)->tag,
                              c->tag);
}

/* Waits for slot [parity][s] of part in this rank's buffer, for every s. */
static int wait_all(struct op_ctx *c, uint64_t part, struct cx_op_status *st)
{
        for (uint32_t s = 0; s < c->l->shape.world_size; s++)
                if (wait_tag(c, &cx_flag_at(c->own, part, c->l, c->parity, s)->tag, s, st))
                        return st->status;
        return 0;
}

void cx_format_status(const struct cx_op_status *st, uint32_t rank, uint64_t op, char *msg,
                      size_t len)
{
        if (!msg || !len)
                return;
        switch (st->reason) {
        case CX_REASON_CAPACITY:
                snprintf(msg, len, "rank %u op %" PRIu64 ": capacity exceeded: rank %d needs "
                         "%" PRId64 " rows, capacity %" PRId64 " (%d rank(s) short)", rank, op,
                         st->rank,
                         st->value, st->capacity, st->num_short);
                break;
        case CX_REASON_BLOCK:
                snprintf(msg, len, "rank %u op %" PRIu64 ": capacity exceeded: rank %d local "
                         "expert %d needs more than expert_block_rows %" PRId64
                         " (%d rank(s) short)",
                         rank, op, st->rank, st->pos, st->capacity, st->num_short);
                break;
        case CX_REASON_MISMATCH:
                snprintf(msg, len, "rank %u op %" PRIu64 ": invalid argument: rank %d's op differs "
                         "from rank 0's in kind, layout, options, handle, weights or registered "
                         "memory", rank, op,
                         st->rank);
                break;
        case CX_REASON_BAD_EXPERT:
        case CX_REASON_DUP_EXPERT:
        case CX_REASON_BAD_ARGS:
                snprintf(msg, len, "rank %u op %" PRIu64 ": invalid argument on rank %d", rank, op,
                         st->rank);
                break;
        case CX_REASON_ABORT:
                snprintf(msg, len, "rank %u op %" PRIu64 ": peer lost (abort word set)", rank, op);
                break;
        case CX_REASON_TIMEOUT:
                snprintf(msg, len, "rank %u op %" PRIu64 ": timeout waiting for rank %d", rank, op,
                         st->rank);
                break;
        case CX_REASON_STICKY:
                snprintf(msg, len, "rank %u op %" PRIu64 ": an earlier op of this group failed "
                         "(status %d); the group must be formed again", rank, op, st->status);
                break;
        case CX_REASON_DRAIN:
                snprintf(msg, len, "rank %u: the group is drained at op %" PRIu64, rank, op);
                break;
        default:
                snprintf(msg, len, "rank %u op %" PRIu64 ": status %d", rank, op, st->status);
                break;
        }
}

static int finish(struct op_ctx *c, struct cx_op_status *st, int numbered, uint64_t rows,
                  uint64_t bytes, const char *detail, uint64_t *op, char *err, size_t err_len)
{
        int ret = op_end(c, st, numbered, rows, bytes);

        if (op)
                *op = c->op;
        if (ret && err && err_len) {
                cx_format_status(st, c->r->rank, c->op, err, err_len);
                if (detail && detail[0]) {
                        size_t n = strlen(err);
                        snprintf(err + n, err_len - n, ": %s", detail);
                }
        }
        return ret;
}

/* ---- dispatch ---- */

static int bad_args(struct cx_count_rec *rec, const char *why)
{
        rec->status = EPD_INVALID_ARGUMENT;
        rec->reason = CX_REASON_BAD_ARGS;
        snprintf(rec->text, sizeof(rec->text), "%s", why);
        return rec->status;
}

/* This rank's own checks of its arguments; the result travels in its count record, so a bad
 * argument on one rank fails the op on every rank. */
static int check_dispatch(const struct op_ctx *c, const struct cx_dispatch_args *a,
                          const struct cx_handle *h, struct cx_count_rec *rec)
{
        const struct cx_shape *s = &c->l->shape;
        uint32_t A = a->expert_alignment ? a->expert_alignment : 1;

        if (a->arg_error)
                return bad_args(rec, a->arg_error);
        if (a->num_tokens > s->max_tokens)
                return bad_args(rec, "num_tokens above max_tokens");
        if (a->num_topk < 1 || a->num_topk > s->max_topk)
                return bad_args(rec, "num_topk outside 1 .. max_topk");
        if (a->handle >= s->num_handles)
                return bad_args(rec, "handle slot outside the group's handles");
        if (a->layout != EPD_LAYOUT_NON_EXPAND && a->layout != EPD_LAYOUT_EXPAND)
                return bad_args(rec, "unknown layout");
        if (a->expert_block_rows && (a->layout != EPD_LAYOUT_EXPAND ||
                                     a->expert_block_rows % A != 0 ||
                                     (uint64_t)a->expert_block_rows * c->l->num_local_experts >
                                             c->l->recv_rows))
                return bad_args(rec, "expert_block_rows needs EXPAND, a multiple of "
                                     "expert_alignment, and L * C rows within the receive area");
        if (a->quantize && !s->quantize)
                return bad_args(rec, "quantize on a group created without it");
        if ((a->round_scale || a->scale_format) && !a->quantize)
                return bad_args(rec, "round_scale and scale_format need quantize");
        if (a->scale_format != EPD_SCALE_FORMAT_FP32 && a->scale_format != EPD_SCALE_FORMAT_UE8M0)
                return bad_args(rec, "scale_format must be FP32 or UE8M0");
        if (a->scale_format == EPD_SCALE_FORMAT_UE8M0 && !a->round_scale)
                return bad_args(rec, "scale_format UE8M0 needs round_scale");
        if (a->num_tokens && !a->x)
                return bad_args(rec, "x missing");
        if (a->num_tokens && s->dtype == EPD_DTYPE_FP8_E4M3 && !a->scales)
                return bad_args(rec, "scales missing for an fp8 group");
        if (a->cached) {
                if (h->tag == 0 || h->tag >> CX_OP_BITS != c->epoch)
                        return bad_args(rec, "cached dispatch names an empty or stale handle");
                if (h->num_tokens != a->num_tokens || h->layout != (uint32_t)a->layout ||
                    h->num_topk != a->num_topk || h->alignment != A ||
                    h->block_rows != a->expert_block_rows || h->quantize != (uint32_t)!!a->quantize)
                        return bad_args(rec, "cached dispatch differs from its handle's dispatch");
                return 0;
        }
        if (a->topk_dtype != EPD_DTYPE_INT32 && a->topk_dtype != EPD_DTYPE_INT64)
                return bad_args(rec, "topk_idx dtype must be int32 or int64");
        if (a->num_tokens && !a->topk_idx)
                return bad_args(rec, "topk_idx missing");
        return 0;
}

/* The source's fp8 rows and their recv_scales rows of scale_bytes (docs/semantics.md §2.7),
 * converted once per token. */
static int quantize_rows(const struct cx_layout *l, const struct cx_dispatch_args *a,
                         uint32_t scale_bytes, uint8_t **q, uint8_t **scales)
{
        const uint32_t H = l->shape.hidden, nb = H / CX_QUANT_BLOCK;
        const int ue8m0 = a->scale_format == EPD_SCALE_FORMAT_UE8M0;
        uint64_t stride = a->x_stride ? a->x_stride : (uint64_t)H * 2;

        *q = malloc((size_t)a->num_tokens * H + 1);
        *scales = malloc((size_t)a->num_tokens * scale_bytes + 1);
        if (!*q || !*scales)
                return -1;
        for (uint32_t t = 0; t < a->num_tokens; t++) {
                const uint16_t *x = (const uint16_t *)((const uint8_t *)a->x + t * stride);
                uint8_t *srow = *scales + (size_t)t * scale_bytes;

                for (uint32_t b = 0; b < nb; b++) {
                        float s = epd_fp8_quantize_block(x + (size_t)b * CX_QUANT_BLOCK,
                                                         CX_QUANT_BLOCK,
                                                         *q + (size_t)t * H +
                                                                 (size_t)b * CX_QUANT_BLOCK,
                                                         a->round_scale);

                        if (ue8m0)
                                srow[b] = epd_ue8m0_from_pow2(s);
                        else
                                memcpy(srow + (size_t)b * 4, &s, 4);
                }
        }
        return 0;
}

/* Writes the handle: routing, weights and options, for combine and cached dispatch. */
static void write_handle(struct op_ctx *c, const struct cx_dispatch_args *a,
                         const struct epd_plan *plan)
{
        const struct cx_layout *l = c->l;
        struct cx_handle *h = cx_handle_at(c->own, l, a->handle);
        size_t n = (size_t)a->num_tokens * a->num_topk;
        uint32_t me = c->r->rank;

        memcpy(cx_handle_i32(c->own, l, a->handle, l->h_topk), plan->topk[me], n * 4);
        memcpy(cx_handle_i32(c->own, l, a->handle, l->h_row), plan->row[me], n * 4);
        if (a->weights)
                memcpy(cx_handle_i32(c->own, l, a->handle, l->h_weights), a->weights, n * 4);
        h->layout = (uint32_t)a->layout;
        h->num_topk = a->num_topk;
        h->num_tokens = a->num_tokens;
        h->has_weights = a->weights != NULL;
        h->alignment = a->expert_alignment ? a->expert_alignment : 1;
        h->block_rows = a->expert_block_rows;
        h->quantize = !!a->quantize;
        h->zero_padding = a->layout == EPD_LAYOUT_EXPAND && a->zero_padding;
        if (!a->cached)
                h->topk_dtype = (uint32_t)a->topk_dtype;
        h->tag = c->tag;
}

/* Moves this rank's rows into the destinations and writes its own padding rows. */
static void move_rows(struct op_ctx *c, const struct cx_dispatch_args *a, struct epd_plan *plan,
                      const uint8_t *x, uint64_t x_stride, const void *scales,
                      uint64_t scales_stride, uint64_t row_bytes, uint32_t scale_bytes,
                      enum epd_dtype topk_dtype)
{
        const struct cx_layout *l = c->l;
        const uint32_t R = l->shape.world_size, L = l->num_local_experts, K = a->num_topk;
        const uint32_t me = c->r->rank;
        const int expand = a->layout == EPD_LAYOUT_EXPAND;
        const uint64_t esz = topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        struct epd_dispatch_src_io src[CX_MAX_RANKS];
        struct epd_dispatch_dst_io dst[CX_MAX_RANKS];
        struct epd_dispatch_exec exec = {
                .plan = plan,
                .row_bytes = row_bytes,
                .scale_bytes = scale_bytes,
                .topk_dtype = topk_dtype,
                .has_weights = a->weights != NULL,
                .zero_padding = expand && a->zero_padding,
                .src = src,
                .dst = dst,
        };
        uint64_t items, per_src;

        memset(src, 0, sizeof(src));
        memset(dst, 0, sizeof(dst));
        src[me].x = (struct epd_mat){ (uint8_t *)x, x_stride };
        src[me].scales = (struct epd_mat){ (uint8_t *)scales, scales_stride };
        src[me].weights = (struct epd_mat){ (uint8_t *)a->weights, (uint64_t)K * 4 };
        for (uint32_t d = 0; d < R; d++) {
                /* b + l->recv_x is rank d's receive area, in its buffer or registered memory */
                uint8_t *b = a->recv_area ? a->recv_area[d] - l->recv_x : c->r->bufs[d];

                dst[d].recv_x = (struct epd_mat){ b + l->recv_x, row_bytes };
                if (scale_bytes)
                        dst[d].recv_scales = (struct epd_mat){ b + l->recv_scales, scale_bytes };
                dst[d].recv_weights = (struct epd_mat){ b + l->recv_weights,
                                                        expand ? 4 : (uint64_t)K * 4 };
                dst[d].recv_src = (struct epd_mat){ b + l->recv_src, 8 };
                if (expand)
                        dst[d].recv_topk_slot = (struct epd_mat){ b + l->recv_topk_slot, 4 };
                else
                        dst[d].recv_topk_idx = (struct epd_mat){ b + l->recv_topk_idx, K * esz };
        }
        items = epd_host_dispatch_items(&exec);
        per_src = (items - (expand ? (uint64_t)R * L : 0)) / R;
        for (uint64_t i = me * per_src; i < (me + 1) * per_src; i++)
                epd_host_dispatch_item(&exec, i);
        for (uint32_t j = 0; expand && j < L; j++)
                epd_host_dispatch_item(&exec, R * per_src + (uint64_t)me * L + j);
}

int cx_dispatch(const struct cx_rank *r, const struct cx_dispatch_args *a, uint64_t *op,
                char *err, size_t err_len)
{
        struct op_ctx c;
        struct cx_op_status st;
        const struct cx_layout *l = r->layout;
        const uint32_t R = l->shape.world_size, E = l->shape.num_experts, me = r->rank;
        uint32_t num_tokens[CX_MAX_RANKS] = { 0 };
        uint32_t A = a->expert_alignment ? a->expert_alignment : 1;
        struct cx_count_rec head, *src_rec;
        struct epd_plan *plan = NULL;
        struct cx_handle *h;
        uint8_t *qx = NULL, *qs = NULL;
        const uint32_t scale_bytes = cx_op_scale_bytes(l, a->quantize, a->scale_format);
        char detail[sizeof(head.text)] = "";
        uint64_t rows = 0, bytes = 0;
        int numbered;

        if (op_begin(r, 0, &c, &st, &numbered))
                return finish(&c, &st, numbered, 0, 0, NULL, op, err, err_len);
        h = cx_handle_at(c.own, l, a->handle < l->shape.num_handles ? a->handle : 0);

        /* Count this rank's tokens into its record head and a plan of its own. */
        memset(&head, 0, sizeof(head));
        head.token = head.pos = -1;
        cx_dispatch_sig(head.sig, (uint32_t)a->layout, A, a->expert_block_rows, a->handle,
                        !!a->cached, !!a->quantize, a->weights != NULL,
                        a->layout == EPD_LAYOUT_EXPAND && a->zero_padding, !!a->round_scale,
                        a->scale_format);
        head.sig[3] = a->recv_mem;
        head.num_tokens = a->num_tokens;
        head.capacity_rows = a->capacity_rows && a->capacity_rows < l->recv_rows
                                     ? (uint32_t)a->capacity_rows
                                     : l->recv_rows;
        if (check_dispatch(&c, a, h, &head) == 0) {
                num_tokens[me] = a->num_tokens;
                plan = epd_plan_new(R, E, l->shape.max_tokens, a->num_topk, A, a->layout,
                                    num_tokens);
                /* Converted before the record goes out, so that a failure here is still this
                 * rank's verdict on its inputs, which every rank sees. */
                if (!plan || (a->quantize && quantize_rows(l, a, scale_bytes, &qx, &qs))) {
                        bad_args(&head, "out of memory for the dispatch plan or fp8 rows");
                } else if (a->cached) {
                        epd_plan_count_source(plan, me,
                                              cx_handle_i32(c.own, l, a->handle, l->h_topk),
                                              EPD_DTYPE_INT32, 0, NULL, 0);
                } else if (epd_plan_count_source(plan, me, a->topk_idx, a->topk_dtype, 0,
                                                 head.text, sizeof(head.text))) {
                        head.status = EPD_INVALID_ARGUMENT;
                        head.reason = CX_REASON_BAD_EXPERT;
                }
        }

        /* Publish the record to every rank: body first, then the tag with release. */
        for (uint32_t d = 0; d < R; d++) {
                struct cx_count_rec *rec = cx_count_rec_at(r->bufs[d], l, c.parity, me);

                memcpy((uint8_t *)rec + sizeof(rec->tag), (const uint8_t *)&head + sizeof(head.tag),
                       sizeof(head) - sizeof(head.tag));
                if (head.status == 0) {
                        memcpy(cx_count_tok(rec), plan->tok_count + (size_t)me * R, 4 * R);
                        memcpy(cx_count_sel(rec, l), plan->sel_count + (size_t)me * E, 4 * E);
                } else {
                        memset(cx_count_tok(rec), 0, 4 * ((size_t)R + E));
                }
                store_release(&rec->tag, c.tag);
        }
        for (uint32_t s = 0; s < R; s++)
                if (wait_tag(&c, &cx_count_rec_at(c.own, l, c.parity, s)->tag, s, &st))
                        goto out;

        /* Every rank reads the same records and reaches the same verdict, before any row moves. */
        if (cx_dispatch_verdict(c.own, l, c.parity, NULL, NULL, &st)) {
                if (st.rank >= 0 && st.reason != CX_REASON_CAPACITY &&
                    st.reason != CX_REASON_BLOCK && st.reason != CX_REASON_MISMATCH)
                        snprintf(detail, sizeof(detail), "%s",
                                 cx_count_rec_at(c.own, l, c.parity, (uint32_t)st.rank)->text);
                goto out;
        }
        c.t[CX_PHASE_MOVE] = now_ns();

        /* Place this rank's rows from every source's counts (cpu/plan.c). */
        for (uint32_t s = 0; s < R; s++) {
                src_rec = cx_count_rec_at(c.own, l, c.parity, s);
                memcpy(plan->tok_count + (size_t)s * R, cx_count_tok(src_rec), 4 * R);
                memcpy(plan->sel_count + (size_t)s * E, cx_count_sel(src_rec, l), 4 * E);
        }
        epd_plan_finish(plan);
        if (a->expert_block_rows) {
                const uint32_t L = l->num_local_experts;

                for (uint32_t d = 0; d < R; d++)
                        for (uint32_t j = 0; j <= L; j++)
                                plan->expert_base[(size_t)d * (L + 1) + j] =
                                        cx_block_base(j, a->expert_block_rows, 0);
        }
        epd_plan_place_source(plan, me);
        write_handle(&c, a, plan);
        cx_write_counts(c.own, l, c.parity, me, a->handle, A, a->expert_block_rows);

        {
                const uint8_t *x = a->x;
                const void *scales = a->scales;
                uint64_t row_bytes = l->x_row_bytes, x_stride, sc_stride;
                enum epd_dtype topk_dtype = (enum epd_dtype)h->topk_dtype;

                if (a->quantize) {
                        x = qx;
                        scales = qs;
                        row_bytes = l->shape.hidden;
                        x_stride = row_bytes;
                        sc_stride = scale_bytes;
                } else {
                        x_stride = a->x_stride ? a->x_stride : row_bytes;
                        sc_stride = a->scales_stride ? a->scales_stride : scale_bytes;
                }
                move_rows(&c, a, plan, x, x_stride, scales, sc_stride, row_bytes, scale_bytes,
                          topk_dtype);
                for (uint64_t i = 0; i < (uint64_t)a->num_tokens * a->num_topk; i++)
                        if (plan->row[me][i] >= 0)
                                bytes += row_bytes + scale_bytes;
        }

        /* Rows are in place: raise the done flag at every destination, then wait for every
         * source's rows to have arrived here. */
        c.t[CX_PHASE_FINISH] = now_ns();
        signal_all(&c, l->done);
        {
                struct cx_op_status wst;

                if (wait_all(&c, l->done, &wst) == 0)
                        rows = (uint64_t)epd_plan_rows(plan, me);
                else if (st.status == 0)
                        st = wst;
        }
out:
        free(qx);
        free(qs);
        epd_plan_free(plan);
        return finish(&c, &st, numbered, rows, bytes, detail, op, err, err_len);
}

/* ---- combine ---- */

static int check_combine(const struct op_ctx *c, const struct cx_combine_args *a,
                         struct cx_flag *rec)
{
        const struct cx_handle *h;

        rec->status = EPD_INVALID_ARGUMENT;
        rec->reason = CX_REASON_BAD_ARGS;
        if (a->arg_error)
                return rec->status;
        if (a->handle >= c->l->shape.num_handles)
                return rec->status;
        h = cx_handle_at(c->own, c->l, a->handle);
        if (h->tag == 0 || h->tag >> CX_OP_BITS != c->epoch)
                return rec->status;
        if (a->apply_weights && (h->layout != EPD_LAYOUT_EXPAND ||
                                 (!a->source_weights && !h->has_weights)))
                return rec->status;
        if (a->recv_weights && h->layout != EPD_LAYOUT_NON_EXPAND)
                return rec->status;
        if (h->num_tokens && !a->combined)
                return rec->status;
        rec->status = 0;
        rec->reason = 0;
        return 0;
}

int cx_combine(const struct cx_rank *r, const struct cx_combine_args *a, uint64_t *op,
               char *err, size_t err_len)
{
        struct op_ctx c;
        struct cx_op_status st;
        const struct cx_layout *l = r->layout;
        const uint32_t R = l->shape.world_size, me = r->rank;
        struct cx_flag head;
        const struct cx_handle *h;
        struct epd_plan *plan = NULL;
        uint64_t rows = 0;
        int numbered;

        if (op_begin(r, 1, &c, &st, &numbered))
                return finish(&c, &st, numbered, 0, 0, NULL, op, err, err_len);

        memset(&head, 0, sizeof(head));
        cx_combine_sig(head.sig, a->handle, !!a->apply_weights, !!a->recv_weights);
        head.sig[3] = a->y_mem;
        check_combine(&c, a, &head);
        head.value = me;
        /* The y record: this rank's y (written by the caller before the call, program order)
         * is published by the release of the tag. */
        for (uint32_t d = 0; d < R; d++) {
                struct cx_flag *f = cx_flag_at(r->bufs[d], l->yrec, l, c.parity, me);

                memcpy((uint8_t *)f + sizeof(f->tag), (const uint8_t *)&head + sizeof(head.tag),
                       sizeof(head) - sizeof(head.tag));
                store_release(&f->tag, c.tag);
        }
        if (wait_all(&c, l->yrec, &st) || cx_combine_verdict(c.own, l, c.parity, &st))
                goto out;
        c.t[CX_PHASE_MOVE] = now_ns();

        h = cx_handle_at(c.own, l, a->handle);
        {
                const uint32_t K = h->num_topk, N = h->num_tokens;
                const int32_t *topk = cx_handle_i32(c.own, l, a->handle, l->h_topk);
                const int32_t *row = cx_handle_i32(c.own, l, a->handle, l->h_row);
                const float *hw = (const float *)cx_handle_i32(c.own, l, a->handle, l->h_weights);
                uint32_t num_tokens[CX_MAX_RANKS] = { 0 };
                struct epd_mat y[CX_MAX_RANKS];
                struct epd_combine_src_io src[CX_MAX_RANKS];
                struct epd_mat rw[CX_MAX_RANKS];
                struct epd_combine_exec exec;
                uint64_t per_src;

                num_tokens[me] = N;
                plan = epd_plan_new(R, l->shape.num_experts, l->shape.max_tokens, K, 1,
                                    (enum epd_layout)h->layout, num_tokens);
                if (!plan) {
                        status_set(&st, EPD_INTERNAL, CX_REASON_BAD_ARGS, (int32_t)me);
                } else {
                        memcpy(plan->topk[me], topk, (size_t)N * K * 4);
                        memcpy(plan->row[me], row, (size_t)N * K * 4);
                        memset(src, 0, sizeof(src));
                        for (uint32_t d = 0; d < R; d++)
                                y[d] = (struct epd_mat){ a->y_area ? a->y_area[d]
                                                                   : r->bufs[d] + l->y,
                                                         (uint64_t)l->shape.hidden * 2 };
                        for (int b = 0; b < 2; b++)
                                src[me].bias[b] = (struct epd_mat){
                                        (uint8_t *)a->bias[b], (uint64_t)l->shape.hidden * 2 };
                        src[me].combined = (struct epd_mat){ (uint8_t *)a->combined,
                                                             (uint64_t)l->shape.hidden * 2 };
                        src[me].weights = h->has_weights ? hw : NULL;
                        src[me].source_weights = (struct epd_mat){
                                (uint8_t *)a->source_weights, (uint64_t)K * 4 };
                        src[me].combined_topk_weights = (struct epd_mat){
                                (uint8_t *)a->combined_topk_weights, (uint64_t)K * 4 };
                        /* recv_weights: every destination's y_weights area, [rows, K_op] */
                        for (uint32_t d = 0; d < R; d++)
                                rw[d] = (struct epd_mat){
                                        (a->y_area ? a->y_area[d] - l->y : r->bufs[d]) +
                                                l->y_weights,
                                                          (uint64_t)K * 4 };
                        exec = (struct epd_combine_exec){
                                .plan = plan,
                                .hidden = l->shape.hidden,
                                .apply_weights = a->apply_weights,
                                .y = y,
                                .src = src,
                                .recv_weights = a->recv_weights ? rw : NULL,
                        };
                        per_src = epd_host_combine_items(&exec) / R;
                        for (uint64_t i = me * per_src; i < (me + 1) * per_src; i++)
                                epd_host_combine_item(&exec, i);
                        rows = N;
                }
        }

        /* This rank has read every peer's y: acknowledge, then wait until every peer has read
         * this rank's y, so the caller may rewrite it once the call returns. */
        c.t[CX_PHASE_FINISH] = now_ns();
        signal_all(&c, l->ack);
        {
                struct cx_op_status wst;

                if (wait_all(&c, l->ack, &wst) && st.status == 0)
                        st = wst;
        }
out:
        epd_plan_free(plan);
        return finish(&c, &st, numbered, rows, 0, NULL, op, err, err_len);
}
