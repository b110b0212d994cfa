/* reply.c - an op's replies, as native reply records (common/oprec.h): which page each rank's
 * reply goes to, what a success says, and the hand-over to the network layer's hook, which
 * encodes them. Loop thread only. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "arena.h"
#include "core.h"
#include "util.h"

/* The doorbell page that rank r's reply to the op goes into: the rank's page when its request
 * asked for it and the binding that sent it still holds the rank, else NULL (the socket). */
struct epd_doorbell *epd_op_rank_page(const struct epdd_op *op, uint32_t r)
{
        const struct epdd_submission *sub = &op->subs[r];
        const struct epdd_rank *rk = &op->group->ranks[r];

        if (!sub->mailbox || rk->mailbox_id != sub->request_id || rk->conn != sub->conn)
                return NULL;
        return rk->doorbell;
}

/* epd_op_rank_page for the reply being sent now: the rank's mailbox is free again once it is out. */
struct epd_doorbell *epd_op_reply_page(struct epdd_op *op, uint32_t r)
{
        struct epd_doorbell *page = epd_op_rank_page(op, r);

        /* (mailbox_id is set only while the rank has a page, and cleared with it.) */
        if (page)
                op->group->ranks[r].mailbox_id = 0;
        op->subs[r].mailbox = 0;
        return page;
}

/* The reply record of rank r's successful op: the fields both kinds share, the timeline
 * (replied_ns taken now). */
static void reply_common(const struct epdd_op *op, uint32_t r, struct epd_op_reply *rep)
{
        const struct epdd_submission *sub = &op->subs[r];

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

void epd_op_reply_dispatch(struct epdd_op *op, uint32_t r, struct epdd_handle *h)
{
        struct epdd_group *g = op->group;
        struct epdd_exec *ex = op->exec;
        struct epdd_exec_rank *er = &ex->ranks[r];
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
                 * (top-level resize.c); the client maps them before it reads the outputs. */
                rep.arena_generation = g->ranks[r].arena->generation;
                rep.arena_bytes = g->ranks[r].arena->bytes;
        }
        if (er->use_arena) {
                const struct epdd_arena_place *pl = &h->ranks[r].arena;
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
        epd_reply_op(op->subs[r].conn, epd_op_reply_page(op, r), &rep);
}

void epd_op_reply_combine(struct epdd_op *op, uint32_t r)
{
        struct epd_op_reply rep;

        reply_common(op, r, &rep);
        rep.num_tokens = op->exec->ranks[r].num_tokens;
        epd_reply_op(op->subs[r].conn, epd_op_reply_page(op, r), &rep);
}

void epd_reply_op(struct epdd_client *c, struct epd_doorbell *page, const struct epd_op_reply *rep)
{
        if (c->daemon->hooks.reply_op && !c->closing)
                c->daemon->hooks.reply_op(c, page, rep);
}

void epd_reply_op_status(struct epdd_client *c, struct epd_doorbell *page, uint32_t kind,
                         uint64_t request_id, int status, const char *fmt, ...)
{
        struct epd_op_reply rep;
        char message[EPD_OPREC_MESSAGE_MAX];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(message, sizeof(message), fmt, ap);
        va_end(ap);
        memset(&rep, 0, sizeof(rep));
        rep.id = request_id;
        rep.kind = kind;
        rep.status = status;
        rep.message = message;
        epd_reply_op(c, page, &rep);
}
