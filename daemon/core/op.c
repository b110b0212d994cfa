/* op.c - per-group op sequencing (docs/architecture.md, "Objects" and "Ops and sequencing"): op n
 * is collected from every rank, checked (prep.c), handed to the backend, and answered on every rank
 * with one status (reply.c). A rank that never submits turns into TIMEOUT, a lost rank into
 * PEER_LOST; no op waits on a GPU for a rank that is not there. Handles live in handle.c,
 * statistics in opstats.c. Loop thread only.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "backend.h"
#include "core.h"
#include "log.h"
#include "util.h"

static void op_free_cb(uv_handle_t *handle)
{
        struct epdd_op *op = handle->data;

        free(op);
}



static void op_destroy(struct epdd_op *op)
{
        uint32_t R = op->group->cfg.world_size;

        epd_list_del(&op->link);
        for (uint32_t r = 0; r < R; r++)
                (void)epd_op_reply_page(op, r); /* a rank that got no reply: its mailbox is free */
        free(op->subs);
        op->subs = NULL;
        if (op->timer_active)
                uv_timer_stop(&op->timer);
        uv_close((uv_handle_t *)&op->timer, op_free_cb);
}

void epd_op_destroy_all(struct epdd_group *g)
{
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &g->ops)
        {
                struct epdd_op *op = epd_list_entry(pos, struct epdd_op, link);
                if (op->state != EPD_OP_EXECUTING)
                        op_destroy(op);
        }
}

static void reply_error(struct epdd_op *op, uint32_t rank)
{
        struct epdd_submission *sub = &op->subs[rank];

        if (sub->conn) {
                sub->conn->outstanding_ops--;
                epd_reply_op_status(sub->conn, epd_op_reply_page(op, rank), sub->req.kind,
                                         sub->request_id, op->status, "%s", op->message);
        }
        sub->conn = NULL;
}

/* Ends an op that did not run: every rank that arrived gets the status now, later arrivals get
 * it on arrival (the op stays FINISHED until every rank has passed it). */
static int op_finish(struct epdd_op *op, int status, const char *message)
{
        struct epdd_group *g = op->group;
        uint32_t R = g->cfg.world_size;

        op->status = status;
        snprintf(op->message, sizeof(op->message), "%s", message);
        op->state = EPD_OP_FINISHED;
        if (op->timer_active) {
                uv_timer_stop(&op->timer);
                op->timer_active = 0;
        }
        epd_opstats_op_failed(g);
        for (uint32_t r = 0; r < R; r++) {
                if (op->subs[r].arrived && op->subs[r].conn) {
                        epd_opstats_rank_failed(g, r, op->kind, status);
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

void epd_op_fail_pending(struct epdd_group *g, int status, const char *fmt, ...)
{
        struct epd_list *pos, *tmp;
        char message[512];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(message, sizeof(message), fmt, ap);
        va_end(ap);
        epd_list_for_each_safe(pos, tmp, &g->ops)
        {
                struct epdd_op *op = epd_list_entry(pos, struct epdd_op, link);
                if (op->state == EPD_OP_COLLECTING || op->state == EPD_OP_QUEUED) {
                        char full[600];
                        snprintf(full, sizeof(full), "op %llu: %s", (unsigned long long)op->number,
                                 message);
                        if (!op_finish(op, status, full))
                                op_destroy(op);
                } else if (op->state == EPD_OP_FINISHED) {
                        /* Nobody will pass this op any more: the group re-forms at op 0. */
                        op_destroy(op);
                }
        }
        epd_op_abort_executing(g, status);
}

void epd_op_abort_executing(struct epdd_group *g, int status)
{
        /* In the backend: one still queued (waiting for inputs or its turn) ends with this
         * status instead of running; one running stops moving data where the backend can. */
        if (g->executing && g->executing->exec)
                epd_exec_abort(g->executing->exec, status);
}

static void on_op_timeout(uv_timer_t *timer)
{
        struct epdd_op *op = timer->data;
        struct epdd_group *g = op->group;
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

static struct epdd_op *op_get(struct epdd_group *g, uint64_t number, enum epdd_op_kind kind)
{
        struct epd_list *pos;
        struct epdd_op *op;

        epd_list_for_each(pos, &g->ops)
        {
                op = epd_list_entry(pos, struct epdd_op, link);
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
                struct epdd_op *o = epd_list_entry(pos, struct epdd_op, link);
                if (o->number > number) {
                        at = pos;
                        break;
                }
        }
        epd_list_add_tail(at, &op->link);
        return op;
}

void epd_op_submit(struct epdd_group *g, uint32_t rank, struct epdd_client *c,
                   const struct epd_op_request *req)
{
        struct epdd_daemon *d = g->daemon;
        const enum epdd_op_kind kind = req->kind == EPD_OPREC_DISPATCH ? EPD_OP_DISPATCH
                                                                      : EPD_OP_COMBINE;
        struct epdd_op *op;
        struct epdd_submission *sub;

        if (g->state == EPD_GROUP_BROKEN) {
                epd_group_rank_refused(g, rank);
                epd_reply_op_status(c, NULL, req->kind, req->id, EPD_PEER_LOST,
                                         "group '%s' is broken: a rank was lost; it is usable again once every rank is bound",
                                         g->name);
                return;
        }
        if (c->outstanding_ops >= d->cfg.max_outstanding_ops_per_client) {
                epd_group_rank_refused(g, rank);
                epd_reply_op_status(c, NULL, req->kind, req->id, EPD_UNAVAILABLE,
                                         "client has %u outstanding ops, the limit max_outstanding_ops_per_client",
                                         c->outstanding_ops);
                return;
        }
        const int mailbox = (req->flags & EPD_OPREC_REPLY_IN_DOORBELL) != 0;
        if (mailbox && g->ranks[rank].mailbox_id != 0) {
                epd_group_rank_refused(g, rank);
                epd_reply_op_status(c, NULL, req->kind, req->id, EPD_INVALID_ARGUMENT,
                                         "group '%s' rank %u: request %llu still waits for its reply in the doorbell page; reply_in_doorbell allows one such request per rank at a time",
                                         g->name, rank,
                                         (unsigned long long)g->ranks[rank].mailbox_id);
                return;
        }
        op = op_get(g, g->ranks[rank].next_op, kind);
        if (!op) {
                epd_group_rank_refused(g, rank);
                epd_reply_op_status(c, NULL, req->kind, req->id, EPD_INTERNAL,
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
                epd_opstats_rank_failed(g, rank, kind, op->status);
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









static void exec_free(struct epdd_exec *ex)
{
        if (!ex)
                return;
        if (ex->ranks) {
                free(ex->ranks[0].per_expert);
        }
        free(ex->ranks);
        free(ex);
}

static struct epdd_exec *exec_new(struct epdd_group *g)
{
        uint32_t R = g->cfg.world_size, L = g->cfg.num_local_experts;
        struct epdd_exec *ex = calloc(1, sizeof(*ex));
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
        return ex;
}

static int op_launch(struct epdd_op *op)
{
        struct epdd_group *g = op->group;
        struct epdd_daemon *d = g->daemon;
        uint32_t R = g->cfg.world_size;
        struct epdd_exec *ex;
        struct epdd_region **refs = NULL;
        unsigned num_refs = 0;
        char err[512];
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
        ex = exec_new(g);
        if (!ex) {
                op_finish(op, EPD_INTERNAL, "out of memory");
                return -1;
        }
        ex->kind = op->kind;
        rc = epd_op_prepare(op, ex, &refs, &num_refs, err, sizeof(err));
        if (rc < 0) {
                exec_free(ex);
                log_debug("op rejected: %s", err);
                op_finish(op, rc, err);
                return -1;
        }
        for (uint32_t r = 0; r < R; r++) {
                struct epdd_exec_rank *er = &ex->ranks[r];
                er->doorbell = g->ranks[r].doorbell;
                er->doorbell_dev = g->ranks[r].doorbell_dev;
                /* Ops of a group complete in order, so this one is the rank's next. */
                er->completed_value = g->ranks[r].completed + 1;
                er->wait_inputs = op->subs[r].req.wait_inputs;
        }
        ex->timeout_ns = (uint64_t)g->cfg.op_timeout_ms * 1000000ull;
        op->refs = refs;
        op->num_refs = num_refs;
        op->epoch = g->epoch;
        ex->owner = op;
        op->exec = ex;
        op->state = EPD_OP_EXECUTING;
        op->launch_ns = epd__now_ns();
        g->executing = op;
        epd_backend_submit(d->backend, ex);
        /* Ranks waiting in their doorbell page: wake the sleepers while the op runs, so that
         * they poll for their replies rather than being woken one after another when the
         * replies come (net/mailbox.c). */
        for (uint32_t r = 0; r < R; r++) {
                struct epd_doorbell *page = epd_op_rank_page(op, r);
                if (page && d->hooks.op_started)
                        d->hooks.op_started(page);
        }
        return 0;
}

void epd_op_kick(struct epdd_group *g)
{
        struct epdd_daemon *d = g->daemon;

        struct epd_list *pos, *tmp;

        if (g->executing || d->draining || g->state == EPD_GROUP_DRAINING || g->resize)
                return;
        epd_list_for_each_safe(pos, tmp, &g->ops)
        {
                struct epdd_op *op = epd_list_entry(pos, struct epdd_op, link);
                if (op->state == EPD_OP_FINISHED)
                        continue; /* waits only for late arrivals */
                if (op->state != EPD_OP_QUEUED || op_launch(op) == 0)
                        return;
                /* The op failed before launch; try the next one. */
                tmp = g->ops.next;
        }
}

/* ---- completion ---- */




/* Floor bytes of SEMANTICS/BENCHMARKS accounting are the benchmark's business; the statistics
 * count the bytes the op wrote to its outputs, which the backend reports in ex->bytes. */
void epd_op_complete(void *daemon_arg, struct epdd_exec *ex)
{
        struct epdd_op *op = ex->owner;
        struct epdd_group *g = op->group;
        struct epdd_daemon *d = daemon_arg;
        struct epdd_backend *b = d->backend;
        uint32_t R = g->cfg.world_size;
        struct epdd_handle *h = op->handle;
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
                                h = epd_handle_new(g, ex);
                                if (!h) {
                                        status = EPD_INTERNAL;
                                        snprintf(ex->message, sizeof(ex->message), "out of memory");
                                        b->ops->handle_free(b, ex->new_handle_state);
                                        epd_exec_release_new_arenas(ex);
                                }
                        }
                        if (h)
                                epd_handle_record(g, h, ex);
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
                struct epdd_submission *sub = &op->subs[r];
                if (!sub->conn)
                        continue;
                epd_group_rank_op_finished(g, r, sub->seq);
                if (status != EPD_OK && named) {
                        sub->conn->outstanding_ops--;
                        epd_reply_op_status(sub->conn, epd_op_reply_page(op, r), sub->req.kind,
                                                 sub->request_id, status, "%s", ex->message);
                } else if (status != EPD_OK) {
                        /* docs/semantics.md §4: the backend's message gets the group and op
                         * number. */
                        sub->conn->outstanding_ops--;
                        epd_reply_op_status(sub->conn, epd_op_reply_page(op, r), sub->req.kind,
                                                 sub->request_id, status,
                                                 "group '%s' op %llu: %s", g->name,
                                                 (unsigned long long)op->number, ex->message);
                } else {
                        sub->conn->outstanding_ops--;
                        if (op->kind == EPD_OP_DISPATCH)
                                epd_op_reply_dispatch(op, r, h);
                        else
                                epd_op_reply_combine(op, r);
                }
        }
        epd_opstats_completed(op, ex, status, now);
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
                if (d->hooks.group_idle)
                        d->hooks.group_idle(g); /* a resize waited for this op */
                epd_op_kick(g);
        }
}
