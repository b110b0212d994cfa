/* op.c - per-group op sequencing (DESIGN.md sections 3 and 4): op n is collected from every
 * rank, checked for consistency across ranks, resolved against the submitters' regions, handed
 * to the backend, and answered on every rank with one status. A rank that never submits turns
 * into TIMEOUT, a lost rank into PEER_LOST; no op waits on a GPU for a rank that is not there.
 * Loop thread only.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "backend.h"
#include "daemon.h"
#include "log.h"
#include "mailbox.h"
#include "resize.h"
#include "tensor.h"
#include "util.h"

static void op_free_cb(uv_handle_t *handle)
{
        struct epd_op *op = handle->data;

        free(op);
}

/* The doorbell page that rank r's reply to the op goes into: the rank's page when its request
 * asked for it and the binding that sent it still holds the rank, else NULL (the socket). */
static struct epd_doorbell *sub_page(const struct epd_op *op, uint32_t r)
{
        const struct epd_submission *sub = &op->subs[r];
        const struct epd_rank *rk = &op->group->ranks[r];

        if (!sub->mailbox || rk->mailbox_id != sub->request_id || rk->conn != sub->conn)
                return NULL;
        return rk->doorbell;
}

/* sub_page for the reply being sent now: the rank's mailbox is free again once it is out. */
static struct epd_doorbell *reply_mailbox(struct epd_op *op, uint32_t r)
{
        struct epd_doorbell *page = sub_page(op, r);

        /* (mailbox_id is set only while the rank has a page, and cleared with it.) */
        if (page)
                op->group->ranks[r].mailbox_id = 0;
        op->subs[r].mailbox = 0;
        return page;
}

static void op_destroy(struct epd_op *op)
{
        uint32_t R = op->group->cfg.world_size;

        epd_list_del(&op->link);
        for (uint32_t r = 0; r < R; r++)
                (void)reply_mailbox(op, r); /* a rank that got no reply: its mailbox is free */
        free(op->subs);
        op->subs = NULL;
        if (op->timer_active)
                uv_timer_stop(&op->timer);
        uv_close((uv_handle_t *)&op->timer, op_free_cb);
}

void epd_op_destroy_all(struct epd_group *g)
{
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &g->ops)
        {
                struct epd_op *op = epd_list_entry(pos, struct epd_op, link);
                if (op->state != EPD_OP_EXECUTING)
                        op_destroy(op);
        }
}

static void reply_error(struct epd_op *op, uint32_t rank)
{
        struct epd_submission *sub = &op->subs[rank];

        if (sub->conn) {
                sub->conn->outstanding_ops--;
                epd_conn_reply_op_status(sub->conn, reply_mailbox(op, rank), sub->req.kind,
                                         sub->request_id, op->status, "%s", op->message);
        }
        sub->conn = NULL;
}

/* Ends an op that did not run: every rank that arrived gets the status now, later arrivals get
 * it on arrival (the op stays FINISHED until every rank has passed it). */
static int op_finish(struct epd_op *op, int status, const char *message)
{
        struct epd_group *g = op->group;
        uint32_t R = g->cfg.world_size;

        op->status = status;
        snprintf(op->message, sizeof(op->message), "%s", message);
        op->state = EPD_OP_FINISHED;
        if (op->timer_active) {
                uv_timer_stop(&op->timer);
                op->timer_active = 0;
        }
        g->stats.ops_failed++;
        g->daemon->stats.ops_failed++;
        for (uint32_t r = 0; r < R; r++) {
                if (op->subs[r].arrived && op->subs[r].conn) {
                        epd_op_stats_record(&g->ranks[r].stats.kind[op->kind - 1], status, 0, 0);
                        epd_group_rank_op_finished(g, r, op->subs[r].seq);
                        reply_error(op, r);
                }
        }
        if (op->arrived == R) {
                op_destroy(op);
                return 1;
        }
        return 0;
}

void epd_op_fail_pending(struct epd_group *g, int status, const char *fmt, ...)
{
        struct epd_list *pos, *tmp;
        char message[512];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(message, sizeof(message), fmt, ap);
        va_end(ap);
        epd_list_for_each_safe(pos, tmp, &g->ops)
        {
                struct epd_op *op = epd_list_entry(pos, struct epd_op, link);
                if (op->state == EPD_OP_COLLECTING || op->state == EPD_OP_QUEUED) {
                        char full[600];
                        snprintf(full, sizeof(full), "op %llu: %s", (unsigned long long)op->number,
                                 message);
                        if (!op_finish(op, status, full))
                                op_destroy(op);
                } else if (op->state == EPD_OP_FINISHED) {
                        /* Nobody will pass this op any more: the group re-forms at op 0. */
                        op_destroy(op);
                } else if (op->state == EPD_OP_EXECUTING && op->exec) {
                        /* Still queued in the backend (waiting for inputs or its turn): it
                         * ends with this status instead of running. */
                        epd_exec_abort(op->exec, status);
                }
        }
}

static void on_op_timeout(uv_timer_t *timer)
{
        struct epd_op *op = timer->data;
        struct epd_group *g = op->group;
        char missing[256] = "";
        size_t len = 0;
        char message[512];

        op->timer_active = 0;
        if (op->state != EPD_OP_COLLECTING)
                return;
        for (uint32_t r = 0; r < g->cfg.world_size && len < sizeof(missing) - 16; r++)
                if (!op->subs[r].arrived)
                        len += (size_t)snprintf(missing + len, sizeof(missing) - len, "%s%u",
                                                len ? "," : "", r);
        snprintf(message, sizeof(message),
                 "group '%s' op %llu: rank(s) %s did not submit within %u ms", g->name,
                 (unsigned long long)op->number, missing, g->cfg.op_timeout_ms);
        log_notice("op timeout group=%s op=%llu missing=%s", g->name,
                   (unsigned long long)op->number, missing);
        op_finish(op, EPD_TIMEOUT, message);
}

static struct epd_op *op_get(struct epd_group *g, uint64_t number, enum epd_op_kind kind)
{
        struct epd_list *pos;
        struct epd_op *op;

        epd_list_for_each(pos, &g->ops)
        {
                op = epd_list_entry(pos, struct epd_op, link);
                if (op->number == number)
                        return op;
        }
        op = calloc(1, sizeof(*op));
        if (!op)
                return NULL;
        op->subs = calloc(g->cfg.world_size, sizeof(*op->subs));
        if (!op->subs) {
                free(op);
                return NULL;
        }
        op->group = g;
        op->number = number;
        op->kind = kind;
        op->state = EPD_OP_COLLECTING;
        uv_timer_init(g->daemon->loop, &op->timer);
        op->timer.data = op;
        /* Keep the list sorted by number: ops are created in submission order per rank, and a
         * rank's numbers grow, so an op is newer than every op already listed unless another
         * rank is ahead. */
        struct epd_list *at = &g->ops;
        epd_list_for_each(pos, &g->ops)
        {
                struct epd_op *o = epd_list_entry(pos, struct epd_op, link);
                if (o->number > number) {
                        at = pos;
                        break;
                }
        }
        epd_list_add_tail(at, &op->link);
        return op;
}

void epd_op_submit(struct epd_group *g, uint32_t rank, struct epd_conn *c,
                   const struct epd_op_request *req)
{
        struct epd_daemon *d = g->daemon;
        const enum epd_op_kind kind = req->kind == EPD_OPREC_DISPATCH ? EPD_OP_DISPATCH
                                                                      : EPD_OP_COMBINE;
        struct epd_op *op;
        struct epd_submission *sub;

        if (g->state == EPD_GROUP_BROKEN) {
                epd_group_rank_refused(g, rank);
                epd_conn_reply_op_status(c, NULL, req->kind, req->id, EPD_PEER_LOST,
                                         "group '%s' is broken: a rank was lost; it is usable again once every rank is bound",
                                         g->name);
                return;
        }
        if (c->outstanding_ops >= d->cfg.max_outstanding_ops_per_client) {
                epd_group_rank_refused(g, rank);
                epd_conn_reply_op_status(c, NULL, req->kind, req->id, EPD_UNAVAILABLE,
                                         "client has %u outstanding ops, the limit max_outstanding_ops_per_client",
                                         c->outstanding_ops);
                return;
        }
        const int mailbox = (req->flags & EPD_OPREC_REPLY_IN_DOORBELL) != 0;
        if (mailbox && g->ranks[rank].mailbox_id != 0) {
                epd_group_rank_refused(g, rank);
                epd_conn_reply_op_status(c, NULL, req->kind, req->id, EPD_INVALID_ARGUMENT,
                                         "group '%s' rank %u: request %llu still waits for its reply in the doorbell page; reply_in_doorbell allows one such request per rank at a time",
                                         g->name, rank,
                                         (unsigned long long)g->ranks[rank].mailbox_id);
                return;
        }
        op = op_get(g, g->ranks[rank].next_op, kind);
        if (!op) {
                epd_group_rank_refused(g, rank);
                epd_conn_reply_op_status(c, NULL, req->kind, req->id, EPD_INTERNAL,
                                         "out of memory");
                return;
        }
        g->ranks[rank].next_op++;
        c->outstanding_ops++;
        c->stats.ops++;
        sub = &op->subs[rank];
        sub->arrived = 1;
        sub->request_id = req->id;
        sub->conn = c;
        sub->submitted_ns = epd__now_ns();
        sub->seq = epd_group_rank_submitted(g, rank);
        sub->req = *req;
        sub->mailbox = mailbox && g->ranks[rank].doorbell != NULL;
        if (sub->mailbox)
                g->ranks[rank].mailbox_id = req->id;
        op->arrived++;
        if (op->state == EPD_OP_FINISHED) {
                epd_op_stats_record(&g->ranks[rank].stats.kind[kind - 1], op->status, 0, 0);
                epd_group_rank_op_finished(g, rank, sub->seq);
                reply_error(op, rank);
                if (op->arrived == g->cfg.world_size)
                        op_destroy(op);
                return;
        }
        if (op->arrived == 1 && g->cfg.world_size > 1) {
                uv_timer_start(&op->timer, on_op_timeout, g->cfg.op_timeout_ms, 0);
                op->timer_active = 1;
                /* Its other ranks may post their requests in their pages. */
                epd_backend_poll_window(d->backend);
        }
        if (op->arrived == g->cfg.world_size) {
                if (op->timer_active) {
                        uv_timer_stop(&op->timer);
                        op->timer_active = 0;
                }
                op->state = EPD_OP_QUEUED;
                epd_op_kick(g);
        }
}

/* ---- preparing an exec: consistency across ranks and region resolution ---- */

struct prep {
        struct epd_op *op;
        struct epd_exec *ex;
        struct epd_region **refs;     /* regions referenced by the exec */
        unsigned num_refs, cap_refs;
        char err[512];
        int status;
};

static int prep_fail(struct prep *p, int status, uint32_t rank, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

static int prep_fail(struct prep *p, int status, uint32_t rank, const char *fmt, ...)
{
        char detail[400];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(detail, sizeof(detail), fmt, ap);
        va_end(ap);
        snprintf(p->err, sizeof(p->err), "group '%s' op %llu rank %u: %s", p->op->group->name,
                 (unsigned long long)p->op->number, rank, detail);
        p->status = status;
        return status;
}

static int prep_ref(struct prep *p, struct epd_region *r)
{
        if (p->num_refs == p->cap_refs) {
                unsigned cap = p->cap_refs ? p->cap_refs * 2 : 16;
                struct epd_region **n = realloc(p->refs, cap * sizeof(*n));
                if (!n)
                        return EPD_INTERNAL;
                p->refs = n;
                p->cap_refs = cap;
        }
        epd_region_ref(r);
        p->refs[p->num_refs++] = r;
        return 0;
}

/* Whether the group's ranks live on more than one device. */
static int group_spans_devices(const struct epd_group *g)
{
        for (uint32_t r = 1; r < g->cfg.world_size; r++)
                if (g->ranks[r].device != g->ranks[0].device)
                        return 1;
        return 0;
}

/* Checks dtype and shape [rows, cols] (cols 0: one-dimensional [rows]) and resolves the tensor.
 * exact_rows: sizes[0] must equal rows; else sizes[0] >= rows and the whole declared extent is
 * resolved (outputs: sizes[0] is the capacity). */
static int prep_tensor(struct prep *p, uint32_t rank, const char *what,
                       const struct epd_tensor *ref, enum epd_dtype dtype, uint64_t rows,
                       uint64_t cols, int exact_rows, struct epd_mat *out, uint64_t *capacity)
{
        struct epd_conn *c = p->op->subs[rank].conn;
        const struct epd_tensor t = *ref;
        struct epd_region *r;
        char err[256];
        int rc;

        memset(out, 0, sizeof(*out));
        if (!epd__tensor_present(&t))
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: absent", what);
        if (t.dtype != dtype)
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: dtype %d, expected %d", what,
                                 (int)t.dtype, (int)dtype);
        if (t.ndim != (cols ? 2u : 1u))
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: %u dims, expected %u", what,
                                 t.ndim, cols ? 2u : 1u);
        if (cols && t.sizes[1] != cols)
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank,
                                 "%s: %llu columns, expected %llu", what,
                                 (unsigned long long)t.sizes[1], (unsigned long long)cols);
        if (exact_rows ? t.sizes[0] != rows : t.sizes[0] < rows)
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: %llu rows, expected %s%llu",
                                 what, (unsigned long long)t.sizes[0], exact_rows ? "" : "at least ",
                                 (unsigned long long)rows);
        rc = epd_region_resolve(c, &t, t.sizes[0], cols ? cols : 1, &r, &out->ptr, &out->stride,
                                err, sizeof(err));
        if (rc < 0)
                return prep_fail(p, rc, rank, "%s: %s", what, err);
        /* A CUDA IPC import is mapped for its own GPU only (the daemon opens it once, on the
         * device the memory lives on), so a kernel of another GPU of the group would fault on
         * it and take the daemon's context down with every group on it (seen on two H200s).
         * Until imports are opened per device, such a group needs cuMem memory. */
        if (r->kind == EPD_REGION_CUDA_IPC && group_spans_devices(p->op->group))
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank,
                                 "%s: cudaMalloc memory (a CUDA IPC region) cannot be used by a "
                                 "group spread over several GPUs; allocate it with "
                                 "epd_device_alloc or another cuMem allocator (PyTorch: "
                                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", what);
        if (capacity)
                *capacity = t.sizes[0];
        return prep_ref(p, r);
}

static uint32_t dispatch_topk(const struct epd_op_request *m)
{
        const struct epd_tensor *topk_idx = &m->t[EPD_OPREC_TOPK_IDX];

        if (m->num_topk)
                return m->num_topk;
        return epd__tensor_present(topk_idx) && topk_idx->ndim == 2 ? (uint32_t)topk_idx->sizes[1]
                                                                    : 0;
}

static int prep_dispatch(struct prep *p)
{
        struct epd_op *op = p->op;
        struct epd_group *g = op->group;
        struct epd_exec *ex = p->ex;
        const struct epd_group_cfg *cfg = &g->cfg;
        const struct epd_op_request *m0 = &op->subs[0].req;
        struct epd_handle *h = NULL;
        uint32_t R = cfg->world_size;

        ex->layout = (enum epd_layout)m0->layout;
        ex->expert_alignment = m0->expert_alignment ? m0->expert_alignment : 1;
        ex->zero_padding = (m0->flags & EPD_OPREC_ZERO_PADDING) != 0;
        ex->has_weights = epd__tensor_present(&m0->t[EPD_OPREC_TOPK_WEIGHTS]);
        ex->num_topk = dispatch_topk(m0);
        /* The top-k dtype comes from the first rank that gives topk_idx: a rank without tokens
         * may leave it out. */
        ex->topk_dtype = EPD_DTYPE_INVALID;
        for (uint32_t r = 0; r < R && ex->topk_dtype == EPD_DTYPE_INVALID; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                if (epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX]))
                        ex->topk_dtype = m->t[EPD_OPREC_TOPK_IDX].dtype;
        }
        if (m0->handle_id) {
                h = epd_group_handle_find(g, m0->handle_id);
                if (!h)
                        return prep_fail(p, EPD_NOT_FOUND, 0, "handle %llu does not exist",
                                         (unsigned long long)m0->handle_id);
                /* As for combine: a rank that released the handle no longer has it. */
                for (uint32_t r = 0; r < R; r++)
                        if (h->ranks[r].released)
                                return prep_fail(p, EPD_NOT_FOUND, r,
                                                 "handle %llu was released by rank %u",
                                                 (unsigned long long)h->id, r);
                ex->handle_state = h->state;
                ex->topk_dtype = h->topk_dtype;
                if (!ex->num_topk)
                        ex->num_topk = h->num_topk;
        }
        /* A new dispatch makes a handle that lives until every rank releases it: a client
         * that never releases must not take the daemon's memory (each holds a workspace). */
        if (!h && g->num_handles >= g->daemon->cfg.max_handles_per_group) {
                snprintf(p->err, sizeof(p->err),
                         "group '%s' op %llu: the group holds %u live handles, the limit max_handles_per_group; every rank releases a handle (epd_handle_release) once no combine or cached dispatch needs it",
                         g->name, (unsigned long long)op->number, g->num_handles);
                p->status = EPD_UNAVAILABLE;
                return p->status;
        }
        /* SEMANTICS.md 1: what must match across ranks. */
        for (uint32_t r = 1; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                if (m->handle_id != m0->handle_id)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "handle %llu differs from rank 0's %llu",
                                         (unsigned long long)m->handle_id,
                                         (unsigned long long)m0->handle_id);
                /* expert_alignment 0 means 1 (epd.h): compare what the values mean. */
                if (m->layout != m0->layout ||
                    (m->expert_alignment ? m->expert_alignment : 1) != ex->expert_alignment ||
                    ((m->flags ^ m0->flags) & EPD_OPREC_ZERO_PADDING))
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "layout/expert_alignment/zero_padding differ from rank 0's");
                if (epd__tensor_present(&m->t[EPD_OPREC_TOPK_WEIGHTS]) != ex->has_weights)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "topk_weights %s but %s on rank 0",
                                         ex->has_weights ? "absent" : "present",
                                         ex->has_weights ? "present" : "absent");
                if ((dispatch_topk(m) ? dispatch_topk(m) : ex->num_topk) != ex->num_topk)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "top-k width %u differs from rank 0's %u",
                                         dispatch_topk(m), ex->num_topk);
                if (!h && epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX]) &&
                    m->t[EPD_OPREC_TOPK_IDX].dtype != ex->topk_dtype)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "topk_idx dtype differs from rank 0's");
        }
        if (ex->layout != EPD_LAYOUT_NON_EXPAND && ex->layout != EPD_LAYOUT_EXPAND)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "unknown layout %d", (int)ex->layout);
        if (ex->expert_alignment > 4096)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "expert_alignment %u exceeds 4096",
                                 ex->expert_alignment);
        if (ex->zero_padding && ex->layout != EPD_LAYOUT_EXPAND)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "zero_padding needs the EXPAND layout");
        if (ex->num_topk < 1 || ex->num_topk > cfg->max_topk)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "top-k width %u outside 1..%u",
                                 ex->num_topk, cfg->max_topk);
        if (h && (h->layout != ex->layout || h->num_topk != ex->num_topk))
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0,
                                 "cached dispatch must use the handle's layout and top-k width");
        if (!h && ex->topk_dtype != EPD_DTYPE_INT32 && ex->topk_dtype != EPD_DTYPE_INT64)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "topk_idx must be int32 or int64");

        int expand = ex->layout == EPD_LAYOUT_EXPAND;
        for (uint32_t r = 0; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                struct epd_exec_rank *er = &ex->ranks[r];
                uint32_t n = m->num_tokens;
                uint64_t cap = UINT64_MAX, c;
                int rc;

                er->num_tokens = n;
                er->device = g->ranks[r].device;
                if (n > cfg->max_tokens)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "num_tokens %u exceeds max_tokens_per_rank %u", n,
                                         cfg->max_tokens);
                if (h && h->ranks[r].num_tokens != n)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "cached dispatch with %u tokens, the handle has %u", n,
                                         h->ranks[r].num_tokens);
                if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_X])) {
                        rc = prep_tensor(p, r, "x", &m->t[EPD_OPREC_X], cfg->dtype, n, cfg->hidden, 1,
                                         &er->src.x, NULL);
                        if (rc < 0)
                                return rc;
                }
                if (cfg->dtype == EPD_DTYPE_FP8_E4M3) {
                        if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_SCALES])) {
                                rc = prep_tensor(p, r, "scales", &m->t[EPD_OPREC_SCALES], EPD_DTYPE_FP32, n,
                                                 cfg->scale_cols, 1, &er->src.scales, NULL);
                                if (rc < 0)
                                        return rc;
                        }
                } else if (epd__tensor_present(&m->t[EPD_OPREC_SCALES])) {
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r, "scales given for a bf16 group");
                }
                if (h) {
                        if (epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX]))
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "cached dispatch takes no topk_idx");
                } else if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX])) {
                        struct epd_mat topk;
                        rc = prep_tensor(p, r, "topk_idx", &m->t[EPD_OPREC_TOPK_IDX], ex->topk_dtype, n,
                                         ex->num_topk, 1, &topk, NULL);
                        if (rc < 0)
                                return rc;
                        er->topk_idx = topk.ptr;
                        er->topk_stride = topk.stride / epd_dtype_size(ex->topk_dtype);
                }
                if (ex->has_weights && (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_TOPK_WEIGHTS]))) {
                        rc = prep_tensor(p, r, "topk_weights", &m->t[EPD_OPREC_TOPK_WEIGHTS], EPD_DTYPE_FP32, n,
                                         ex->num_topk, 1, &er->src.weights, NULL);
                        if (rc < 0)
                                return rc;
                }
                /* Outputs. */
                er->use_arena = ((m->flags & EPD_OPREC_USE_ARENA) != 0);
                if (((m->flags & EPD_OPREC_USE_ARENA) != 0)) {
                        if (!g->ranks[r].arena)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "use_arena but the group has no output arena (arena_bytes 0)");
                        if (epd__tensor_present(&m->t[EPD_OPREC_RECV_X]) || epd__tensor_present(&m->t[EPD_OPREC_RECV_SRC]))
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "use_arena and output tensors are exclusive");
                        er->arena = g->ranks[r].arena;
                        er->capacity_rows = UINT64_MAX;
                        if (h && h->ranks[r].arena.used)
                                er->place = h->ranks[r].arena;
                        continue;
                }
                if (!epd__tensor_present(&m->t[EPD_OPREC_RECV_X]))
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "recv_x is required (or use_arena)");
                rc = prep_tensor(p, r, "recv_x", &m->t[EPD_OPREC_RECV_X], cfg->dtype, 0, cfg->hidden, 0,
                                 &er->dst.recv_x, &c);
                if (rc < 0)
                        return rc;
                cap = c;
                if (cfg->dtype == EPD_DTYPE_FP8_E4M3) {
                        if (!epd__tensor_present(&m->t[EPD_OPREC_RECV_SCALES]))
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "recv_scales is required for fp8");
                        rc = prep_tensor(p, r, "recv_scales", &m->t[EPD_OPREC_RECV_SCALES], EPD_DTYPE_FP32, 0,
                                         cfg->scale_cols, 0, &er->dst.recv_scales, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_TOPK_IDX])) {
                        if (expand)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "EXPAND has no recv_topk_idx");
                        rc = prep_tensor(p, r, "recv_topk_idx", &m->t[EPD_OPREC_RECV_TOPK_IDX], ex->topk_dtype,
                                         0, ex->num_topk, 0, &er->dst.recv_topk_idx, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_WEIGHTS]) && ex->has_weights) {
                        rc = prep_tensor(p, r, "recv_weights", &m->t[EPD_OPREC_RECV_WEIGHTS], EPD_DTYPE_FP32, 0,
                                         expand ? 0 : ex->num_topk, 0, &er->dst.recv_weights, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_SRC])) {
                        rc = prep_tensor(p, r, "recv_src", &m->t[EPD_OPREC_RECV_SRC], EPD_DTYPE_INT64, 0, 0, 0,
                                         &er->dst.recv_src, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_TOPK_SLOT])) {
                        if (!expand)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "NON_EXPAND has no recv_topk_slot");
                        rc = prep_tensor(p, r, "recv_topk_slot", &m->t[EPD_OPREC_RECV_TOPK_SLOT],
                                         EPD_DTYPE_INT32, 0, 0, 0, &er->dst.recv_topk_slot, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                er->capacity_rows = cap;
        }
        if (h) {
                h->busy = 1;
                op->handle = h;
        }
        return 0;
}

static int prep_combine(struct prep *p)
{
        struct epd_op *op = p->op;
        struct epd_group *g = op->group;
        struct epd_exec *ex = p->ex;
        const struct epd_group_cfg *cfg = &g->cfg;
        const struct epd_op_request *m0 = &op->subs[0].req;
        uint32_t R = cfg->world_size;
        struct epd_handle *h;

        for (uint32_t r = 1; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                if (m->handle_id != m0->handle_id)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "handle %llu differs from rank 0's %llu",
                                         (unsigned long long)m->handle_id,
                                         (unsigned long long)m0->handle_id);
                if (((m->flags ^ m0->flags) & EPD_OPREC_APPLY_WEIGHTS))
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "apply_weights differs from rank 0's");
        }
        h = epd_group_handle_find(g, m0->handle_id);
        if (!h)
                return prep_fail(p, EPD_NOT_FOUND, 0, "handle %llu does not exist",
                                 (unsigned long long)m0->handle_id);
        for (uint32_t r = 0; r < R; r++)
                if (h->ranks[r].released)
                        return prep_fail(p, EPD_NOT_FOUND, r, "handle %llu was released by rank %u",
                                         (unsigned long long)h->id, r);
        ex->handle_state = h->state;
        ex->layout = h->layout;
        ex->num_topk = h->num_topk;
        ex->topk_dtype = h->topk_dtype;
        ex->has_weights = h->has_weights;
        ex->apply_weights = ((m0->flags & EPD_OPREC_APPLY_WEIGHTS) != 0);
        if (ex->apply_weights && (ex->layout != EPD_LAYOUT_EXPAND || !h->has_weights))
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0,
                                 "apply_weights needs an EXPAND dispatch that carried weights");
        for (uint32_t r = 0; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                struct epd_exec_rank *er = &ex->ranks[r];
                uint32_t n = h->ranks[r].num_tokens;
                int rc;

                er->num_tokens = n;
                er->device = g->ranks[r].device;
                er->y_rows = (uint64_t)h->ranks[r].rows;
                if (h->ranks[r].rows > 0 || epd__tensor_present(&m->t[EPD_OPREC_Y])) {
                        rc = prep_tensor(p, r, "y", &m->t[EPD_OPREC_Y], EPD_DTYPE_BF16, (uint64_t)h->ranks[r].rows,
                                         cfg->hidden, 0, &er->y, NULL);
                        if (rc < 0)
                                return rc;
                }
                /* (The record's decoder allows at most 2 biases.) A listed bias may be absent
                 * on a rank without tokens. */
                for (uint32_t b = 0; b < m->num_bias; b++) {
                        const struct epd_tensor *bias = &m->t[EPD_OPREC_BIAS0 + b];
                        if (!epd__tensor_present(bias) && n == 0)
                                continue;
                        rc = prep_tensor(p, r, b ? "bias[1]" : "bias[0]", bias,
                                         EPD_DTYPE_BF16, n, cfg->hidden, 1, &er->comb.bias[b],
                                         NULL);
                        if (rc < 0)
                                return rc;
                }
                if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_COMBINED])) {
                        rc = prep_tensor(p, r, "combined", &m->t[EPD_OPREC_COMBINED], EPD_DTYPE_BF16, n,
                                         cfg->hidden, 0, &er->comb.combined, NULL);
                        if (rc < 0)
                                return rc;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_COMBINED_TOPK_WEIGHTS])) {
                        if (!h->has_weights)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "combined_topk_weights needs a dispatch that carried weights");
                        rc = prep_tensor(p, r, "combined_topk_weights", &m->t[EPD_OPREC_COMBINED_TOPK_WEIGHTS],
                                         EPD_DTYPE_FP32, n, ex->num_topk, 0,
                                         &er->comb.combined_topk_weights, NULL);
                        if (rc < 0)
                                return rc;
                }
        }
        h->busy = 1;
        op->handle = h;
        return 0;
}

static void exec_free(struct epd_exec *ex)
{
        if (!ex)
                return;
        if (ex->ranks) {
                free(ex->ranks[0].per_expert);
        }
        free(ex->ranks);
        free(ex);
}

static struct epd_exec *exec_new(struct epd_group *g)
{
        uint32_t R = g->cfg.world_size, L = g->cfg.num_local_experts;
        struct epd_exec *ex = calloc(1, sizeof(*ex));
        int32_t *counts;

        if (!ex)
                return NULL;
        ex->ranks = calloc(R, sizeof(*ex->ranks));
        /* One block for every rank's count arrays: [L] + [L] + [R+1] per rank. */
        counts = calloc((size_t)R * (2 * L + R + 1), sizeof(int32_t));
        if (!ex->ranks || !counts) {
                free(counts);
                exec_free(ex);
                return NULL;
        }
        for (uint32_t r = 0; r < R; r++) {
                int32_t *base = counts + (size_t)r * (2 * L + R + 1);
                ex->ranks[r].per_expert = base;
                ex->ranks[r].per_expert_aligned = base + L;
                ex->ranks[r].rank_prefix = base + 2 * L;
        }
        ex->cfg = g->cfg;
        ex->daemon = g->daemon;
        return ex;
}

static int op_launch(struct epd_op *op)
{
        struct epd_group *g = op->group;
        struct epd_daemon *d = g->daemon;
        uint32_t R = g->cfg.world_size;
        struct prep p = { .op = op };
        int rc;

        /* Every rank must submit what rank 0 submitted. (The op took its kind from whichever
         * rank arrived first, so rank 0 is the reference the message names.) */
        int dispatch0 = op->subs[0].req.kind == EPD_OPREC_DISPATCH;
        for (uint32_t r = 1; r < R; r++) {
                int is_dispatch = op->subs[r].req.kind == EPD_OPREC_DISPATCH;
                if (is_dispatch != dispatch0) {
                        char msg[256];
                        snprintf(msg, sizeof(msg),
                                 "group '%s' op %llu: rank %u submitted a %s, rank 0 a %s",
                                 g->name, (unsigned long long)op->number, r,
                                 is_dispatch ? "dispatch" : "combine",
                                 dispatch0 ? "dispatch" : "combine");
                        op_finish(op, EPD_INVALID_ARGUMENT, msg);
                        return -1;
                }
        }
        for (uint32_t r = 0; r < R; r++) {
                if (!op->subs[r].conn) {
                        char msg[256];
                        snprintf(msg, sizeof(msg), "group '%s' op %llu: rank %u was lost", g->name,
                                 (unsigned long long)op->number, r);
                        op_finish(op, EPD_PEER_LOST, msg);
                        return -1;
                }
        }
        p.ex = exec_new(g);
        if (!p.ex) {
                op_finish(op, EPD_INTERNAL, "out of memory");
                return -1;
        }
        p.ex->kind = op->kind;
        rc = op->kind == EPD_OP_DISPATCH ? prep_dispatch(&p) : prep_combine(&p);
        if (rc < 0) {
                for (unsigned i = 0; i < p.num_refs; i++)
                        epd_region_unref(d, p.refs[i]);
                free(p.refs);
                exec_free(p.ex);
                log_debug("op rejected: %s", p.err);
                op_finish(op, p.status, p.err);
                return -1;
        }
        for (uint32_t r = 0; r < R; r++) {
                struct epd_exec_rank *er = &p.ex->ranks[r];
                er->doorbell = g->ranks[r].doorbell;
                er->doorbell_dev = g->ranks[r].doorbell_dev;
                /* Ops of a group complete in order, so this one is the rank's next. */
                er->completed_value = g->ranks[r].completed + 1;
                er->wait_inputs = op->subs[r].req.wait_inputs;
        }
        p.ex->timeout_ns = (uint64_t)g->cfg.op_timeout_ms * 1000000ull;
        op->refs = p.refs;
        op->num_refs = p.num_refs;
        op->epoch = g->epoch;
        p.ex->op = op;
        op->exec = p.ex;
        op->state = EPD_OP_EXECUTING;
        op->launch_ns = epd__now_ns();
        g->executing = op;
        epd_backend_submit(d->backend, p.ex);
        /* Ranks waiting in their doorbell page: wake the sleepers while the op runs, so that
         * they poll for their replies rather than being woken one after another when the
         * replies come (daemon/mailbox.c). */
        for (uint32_t r = 0; r < R; r++) {
                struct epd_doorbell *page = sub_page(op, r);
                if (page)
                        epd_mailbox_nudge(page);
        }
        return 0;
}

void epd_op_kick(struct epd_group *g)
{
        struct epd_daemon *d = g->daemon;

        struct epd_list *pos, *tmp;

        if (g->executing || d->draining || g->state == EPD_GROUP_DRAINING || g->resize)
                return;
        epd_list_for_each_safe(pos, tmp, &g->ops)
        {
                struct epd_op *op = epd_list_entry(pos, struct epd_op, link);
                if (op->state == EPD_OP_FINISHED)
                        continue; /* waits only for late arrivals */
                if (op->state != EPD_OP_QUEUED || op_launch(op) == 0)
                        return;
                /* The op failed before launch; try the next one. */
                tmp = g->ops.next;
        }
}

/* ---- completion ---- */

/* The reply record of rank r's successful op: the fields both kinds share, the timeline
 * (replied_ns taken now). */
static void reply_common(const struct epd_op *op, uint32_t r, struct epd_op_reply *rep)
{
        const struct epd_submission *sub = &op->subs[r];

        memset(rep, 0, sizeof(*rep));
        rep->id = sub->request_id;
        rep->kind = op->kind == EPD_OP_DISPATCH ? EPD_OPREC_DISPATCH : EPD_OPREC_COMBINE;
        rep->status = EPD_OK;
        rep->op_number = op->number;
        rep->exec_ns = op->exec->exec_ns;
        rep->kernel_ns = op->exec->kernel_ns;
        rep->queue_ns = op->launch_ns - sub->submitted_ns;
        rep->received_ns = sub->submitted_ns;
        rep->launched_ns = op->launch_ns;
        rep->exec_start_ns = op->exec->exec_start_ns;
        rep->completed_ns = op->completed_ns;
        rep->replied_ns = epd__now_ns();
}

static void reply_dispatch(struct epd_op *op, uint32_t r, struct epd_handle *h)
{
        struct epd_group *g = op->group;
        struct epd_exec *ex = op->exec;
        struct epd_exec_rank *er = &ex->ranks[r];
        struct epd_op_reply rep;

        reply_common(op, r, &rep);
        rep.handle_id = h->id;
        rep.num_tokens = er->num_recv_tokens;
        rep.num_expanded_rows = er->num_expanded_rows;
        rep.num_local_experts = g->cfg.num_local_experts;
        rep.world_size = g->cfg.world_size;
        rep.per_expert = er->per_expert;
        rep.per_expert_aligned = er->per_expert_aligned;
        rep.rank_prefix = er->rank_prefix;
        if (er->use_arena && g->ranks[r].arena) {
                /* A generation newer than the client's: a resize changed the arena's segments
                 * (resize.c); the client maps them before it reads the outputs. */
                rep.arena_generation = g->ranks[r].arena->generation;
                rep.arena_bytes = g->ranks[r].arena->bytes;
        }
        if (er->use_arena) {
                const struct epd_arena_place *pl = &h->ranks[r].arena;
                const int expand = ex->layout == EPD_LAYOUT_EXPAND;
                const enum epd_dtype dt[EPD_OUT_FIELDS] = {
                        g->cfg.dtype, EPD_DTYPE_FP32, ex->topk_dtype,
                        EPD_DTYPE_FP32, EPD_DTYPE_INT64, EPD_DTYPE_INT32,
                };
                const uint64_t cols[EPD_OUT_FIELDS] = {
                        g->cfg.hidden, g->cfg.scale_cols, ex->num_topk,
                        expand ? 0 : ex->num_topk, 0, 0,
                };
                _Static_assert((int)EPD_OUT_FIELDS == (int)EPD_OPREC_OUTPUTS,
                               "one reply output per arena field");
                rep.arena_region_id = g->ranks[r].arena_region_id;
                for (int f = 0; f < EPD_OUT_FIELDS; f++) {
                        if (pl->off[f] == UINT64_MAX)
                                continue;
                        rep.out[f].dtype = dt[f];
                        rep.out[f].offset = pl->off[f];
                        rep.out[f].rows = (uint64_t)h->ranks[r].rows;
                        rep.out[f].cols = cols[f];
                }
        }
        (void)epd_conn_reply_op(op->subs[r].conn, reply_mailbox(op, r), &rep);
}

static void reply_combine(struct epd_op *op, uint32_t r)
{
        struct epd_op_reply rep;

        reply_common(op, r, &rep);
        rep.num_tokens = op->exec->ranks[r].num_tokens;
        (void)epd_conn_reply_op(op->subs[r].conn, reply_mailbox(op, r), &rep);
}

static struct epd_handle *handle_new(struct epd_group *g, struct epd_exec *ex)
{
        uint32_t R = g->cfg.world_size;
        struct epd_handle *h = calloc(1, sizeof(*h));

        if (!h || !(h->ranks = calloc(R, sizeof(*h->ranks)))) {
                free(h);
                return NULL;
        }
        h->id = g->next_handle_id++;
        h->layout = ex->layout;
        h->topk_dtype = ex->topk_dtype;
        h->num_topk = ex->num_topk;
        h->epoch = g->epoch;
        h->state = ex->new_handle_state;
        epd_list_add_tail(&g->handles, &h->link);
        g->num_handles++;
        return h;
}

static void handle_record(struct epd_group *g, struct epd_handle *h, struct epd_exec *ex)
{
        h->has_weights = ex->has_weights;
        for (uint32_t r = 0; r < g->cfg.world_size; r++) {
                struct epd_exec_rank *er = &ex->ranks[r];
                h->ranks[r].num_tokens = er->num_tokens;
                h->ranks[r].rows = ex->layout == EPD_LAYOUT_EXPAND ? er->num_expanded_rows
                                                                   : er->num_recv_tokens;
                if (er->use_arena)
                        h->ranks[r].arena = er->place;
        }
}

/* The group's stage statistics of a successful op (stats.h), once its replies are sent. */
static void record_stages(const struct epd_op *op, const struct epd_exec *ex)
{
        struct epd_latency_hist *st = op->group->stats.stage[op->kind - 1];
        uint64_t first = UINT64_MAX, last = 0;

        for (uint32_t r = 0; r < op->group->cfg.world_size; r++) {
                const uint64_t t = op->subs[r].submitted_ns;
                first = t < first ? t : first;
                last = t > last ? t : last;
        }
        const uint64_t replied = epd__now_ns();
        const uint64_t daemon = replied - last;
        epd_latency_record(&st[EPD_STAGE_PEERS], last - first);
        epd_latency_record(&st[EPD_STAGE_DAEMON],
                           daemon > ex->kernel_ns ? daemon - ex->kernel_ns : 0);
        if (ex->kernel_ns)
                epd_latency_record(&st[EPD_STAGE_GPU], ex->kernel_ns);
}

/* Floor bytes of SEMANTICS/BENCHMARKS accounting are the benchmark's business; the statistics
 * count the bytes the op wrote to its outputs, which the backend reports in ex->bytes. */
void epd_op_complete(struct epd_exec *ex)
{
        struct epd_op *op = ex->op;
        struct epd_group *g = op->group;
        struct epd_daemon *d = g->daemon;
        struct epd_backend *b = d->backend;
        uint32_t R = g->cfg.world_size;
        struct epd_handle *h = op->handle;
        uint64_t now = epd__now_ns();
        int status = ex->status;

        op->completed_ns = now;

        if (status == EPD_OK) {
                for (uint32_t r = 0; r < R; r++) {
                        if (!op->subs[r].conn || g->epoch != op->epoch) {
                                status = EPD_PEER_LOST;
                                snprintf(ex->message, sizeof(ex->message),
                                         "group '%s' op %llu: a rank was lost before the op completed on every rank",
                                         g->name, (unsigned long long)op->number);
                                break;
                        }
                }
        }
        if (op->kind == EPD_OP_DISPATCH) {
                if (status == EPD_OK) {
                        if (!h) {
                                h = handle_new(g, ex);
                                if (!h) {
                                        status = EPD_INTERNAL;
                                        snprintf(ex->message, sizeof(ex->message), "out of memory");
                                        b->ops->handle_free(b, ex->new_handle_state);
                                        epd_exec_release_new_arenas(ex);
                                }
                        }
                        if (h)
                                handle_record(g, h, ex);
                } else {
                        if (ex->new_handle_state)
                                b->ops->handle_free(b, ex->new_handle_state);
                        /* The backend placed outputs in the arenas and succeeded, but the op
                         * failed here (a rank was lost): no handle owns those extents. */
                        epd_exec_release_new_arenas(ex);
                }
        }
        if (op->handle) {
                op->handle->busy = 0;
                if (op->handle->epoch != g->epoch ||
                    epd_group_handle_all_released(g, op->handle)) {
                        if (h == op->handle) {
                                /* A cached dispatch whose handle every rank released while it
                                 * ran: the handle, and any arena space of its outputs, are gone
                                 * with it, so there is nothing left to reply with. */
                                h = NULL;
                                if (status == EPD_OK && op->kind == EPD_OP_DISPATCH) {
                                        status = EPD_NOT_FOUND;
                                        snprintf(ex->message, sizeof(ex->message),
                                                 "group '%s' op %llu: handle %llu was released by every rank while this cached dispatch ran",
                                                 g->name, (unsigned long long)op->number,
                                                 (unsigned long long)op->handle->id);
                                }
                        }
                        epd_group_handle_free(g, op->handle);
                } else {
                        /* Ranks that released during the op: free their arena space now. */
                        for (uint32_t r = 0; r < R; r++)
                                if (op->handle->ranks[r].released)
                                        epd_group_handle_release(g, op->handle, r);
                }
                op->handle = NULL;
        }
        /* Messages made here name the group already; the backend's do not. The replies go
         * first, the statistics after them: the ranks wait for the former. */
        int named = strncmp(ex->message, "group '", 7) == 0;
        for (uint32_t r = 0; r < R; r++) {
                struct epd_submission *sub = &op->subs[r];
                if (!sub->conn)
                        continue;
                epd_group_rank_op_finished(g, r, sub->seq);
                if (status != EPD_OK && named) {
                        sub->conn->outstanding_ops--;
                        epd_conn_reply_op_status(sub->conn, reply_mailbox(op, r), sub->req.kind,
                                                 sub->request_id, status, "%s", ex->message);
                } else if (status != EPD_OK) {
                        /* SEMANTICS.md 4: the backend's message gets the group and op number. */
                        sub->conn->outstanding_ops--;
                        epd_conn_reply_op_status(sub->conn, reply_mailbox(op, r), sub->req.kind,
                                                 sub->request_id, status,
                                                 "group '%s' op %llu: %s", g->name,
                                                 (unsigned long long)op->number, ex->message);
                } else {
                        sub->conn->outstanding_ops--;
                        if (op->kind == EPD_OP_DISPATCH)
                                reply_dispatch(op, r, h);
                        else
                                reply_combine(op, r);
                }
        }
        for (uint32_t r = 0; r < R; r++) {
                struct epd_op_stats *st = &g->ranks[r].stats.kind[op->kind - 1];
                epd_op_stats_record(st, status, ex->bytes / (R ? R : 1),
                                    now - op->subs[r].submitted_ns);
                if (status == EPD_OK && g->ranks[r].device < 64) {
                        d->stats.devices[g->ranks[r].device].ops++;
                        d->stats.devices[g->ranks[r].device].bytes += ex->bytes / (R ? R : 1);
                }
        }
        epd_op_stats_record(&g->stats.kind[op->kind - 1], status, ex->bytes,
                            now - op->launch_ns);
        if (status == EPD_OK) {
                record_stages(op, ex);
                g->stats.ops_completed++;
                d->stats.ops_completed++;
        } else {
                g->stats.ops_failed++;
                d->stats.ops_failed++;
        }
        for (unsigned i = 0; i < op->num_refs; i++)
                epd_region_unref(d, op->refs[i]);
        free(op->refs);
        op->refs = NULL;
        exec_free(ex);
        op->exec = NULL;
        g->executing = NULL;
        epd_group_free_retired(g);
        op->state = EPD_OP_FINISHED;
        op_destroy(op);
        if (g->state == EPD_GROUP_CLOSED || g->free_pending) {
                epd_group_maybe_free(g);
        } else {
                epd_resize_continue(g); /* a resize waited for this op */
                epd_op_kick(g);
        }
}
