/* wire.c - the core's objects in protobuf, for the handlers: a group configuration both ways, a
 * rank's arena in GroupJoined, and the ArenaSegments request. Loop thread only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "net.h"

/* Segment fds per ArenaSegmentsReply: what one queued reply can carry (net.h,
 * struct epdd_out_msg); the client asks again for the rest. */
#define SEGMENT_FDS_PER_REPLY 2u

int epd_group_cfg_from_wire(const struct epdd_daemon *d, const Epd__V1__GroupConfig *w,
                            struct epdd_group_cfg *cfg, char *err, size_t err_len)
{
        if (!w) {
                snprintf(err, err_len, "group config missing");
                return EPD_INVALID_ARGUMENT;
        }
        memset(cfg, 0, sizeof(*cfg));
        cfg->world_size = w->world_size;
        cfg->num_experts = w->num_experts;
        cfg->hidden = w->hidden;
        cfg->max_tokens = w->max_tokens_per_rank;
        cfg->max_topk = w->max_topk;
        cfg->dtype = (enum epd_dtype)w->dispatch_dtype;
        cfg->scale_block = w->scale_block;
        cfg->op_timeout_ms = w->op_timeout_ms;
        cfg->arena_bytes = w->arena_bytes;
        cfg->execution = (enum epd_execution)w->execution;
        cfg->max_alignment = w->max_expert_alignment;
        cfg->block_rows = w->expert_block_rows;
        cfg->quantize = w->quantize ? 1u : 0u;
        cfg->num_handles = w->num_handle_slots;
        cfg->sms_per_rank = w->sms_per_rank;
        cfg->recv_rows = w->recv_rows;
        return epd_group_cfg_check(d, cfg, err, err_len);
}

void epd_group_cfg_to_wire(const struct epdd_group_cfg *cfg, Epd__V1__GroupConfig *w)
{
        epd__v1__group_config__init(w);
        w->world_size = cfg->world_size;
        w->num_experts = cfg->num_experts;
        w->hidden = cfg->hidden;
        w->max_tokens_per_rank = cfg->max_tokens;
        w->max_topk = cfg->max_topk;
        w->dispatch_dtype = (Epd__V1__DType)cfg->dtype;
        w->scale_block = cfg->scale_block;
        w->op_timeout_ms = cfg->op_timeout_ms;
        w->arena_bytes = cfg->arena_bytes;
        w->execution = (Epd__V1__Execution)cfg->execution;
        if (cfg->execution == EPD_EXECUTION_CLIENT) {
                w->max_expert_alignment = cfg->max_alignment;
                w->expert_block_rows = cfg->block_rows;
                w->quantize = cfg->quantize != 0;
                w->num_handle_slots = cfg->num_handles;
                w->sms_per_rank = cfg->sms_per_rank;
                w->recv_rows = cfg->recv_rows;
        }
}

static void segment_to_wire(const struct epdd_arena_segment *s, Epd__V1__ArenaSegment *w)
{
        epd__v1__arena_segment__init(w);
        w->offset = s->off;
        w->bytes = s->bytes;
        w->serial = s->serial;
}

int epd_wire_fill_joined(const struct epdd_rank *r, Epd__V1__GroupJoined *j,
                           Epd__V1__ArenaSegment *segs, Epd__V1__ArenaSegment **ptrs)
{
        const struct epdd_arena *a = r->arena;

        if (!a)
                return -1;
        j->arena_bytes = a->bytes;
        j->arena_kind = (Epd__V1__RegionKind)a->kind;
        j->arena_region_id = r->arena_region_id;
        j->arena_reserved_bytes = a->reserved;
        j->arena_generation = a->generation;
        for (unsigned i = 0; i < a->num_segs; i++) {
                segment_to_wire(&a->segs[i], &segs[i]);
                ptrs[i] = &segs[i];
        }
        j->n_arena_segments = a->num_segs;
        j->arena_segments = ptrs;
        return a->segs[0].fd;
}

void epd_handle_arena_segments(struct epdd_conn *c, const Epd__V1__Request *req)
{
        const Epd__V1__ArenaSegments *m = req->arena_segments;
        struct epdd_group *g = epd_group_find(c->cl.daemon, m->group_id);
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__ArenaSegmentsReply ar = EPD__V1__ARENA_SEGMENTS_REPLY__INIT;
        Epd__V1__ArenaSegment *segs;
        Epd__V1__ArenaSegment **ptrs;
        const struct epdd_arena *a;
        int fds[SEGMENT_FDS_PER_REPLY];
        unsigned n = 0;

        if (!g) {
                epd_conn_reply_status(c, req->id, EPD_NOT_FOUND, "group %llu does not exist",
                                      (unsigned long long)m->group_id);
                return;
        }
        if (m->rank >= g->cfg.world_size || g->ranks[m->rank].conn != &c->cl) {
                epd_conn_reply_status(c, req->id, EPD_PERMISSION_DENIED,
                                      "rank %u of group '%s' is not bound to this client", m->rank,
                                      g->name);
                return;
        }
        a = g->ranks[m->rank].arena;
        if (!a) {
                epd_conn_reply_status(c, req->id, EPD_NOT_FOUND,
                                      "rank %u of group '%s' has no output arena", m->rank,
                                      g->name);
                return;
        }
        segs = calloc(a->num_segs, sizeof(*segs));
        ptrs = calloc(a->num_segs, sizeof(*ptrs));
        if (!segs || !ptrs) {
                free(segs);
                free(ptrs);
                epd_conn_reply_status(c, req->id, EPD_INTERNAL, "out of memory");
                return;
        }
        for (unsigned i = 0; i < a->num_segs; i++) {
                segment_to_wire(&a->segs[i], &segs[i]);
                ptrs[i] = &segs[i];
        }
        for (unsigned i = m->first; i < a->num_segs && n < SEGMENT_FDS_PER_REPLY; i++)
                fds[n++] = a->segs[i].fd;
        ar.generation = a->generation;
        ar.arena_bytes = a->bytes;
        ar.reserved_bytes = a->reserved;
        ar.n_segments = a->num_segs;
        ar.segments = ptrs;
        ar.first = m->first;
        ar.num_fds = n;
        resp.id = req->id;
        resp.status = EPD__V1__STATUS_CODE__OK;
        resp.message = "";
        resp.body_case = EPD__V1__RESPONSE__BODY_ARENA_SEGMENTS;
        resp.arena_segments = &ar;
        (void)epd_conn_send(c, &resp, fds, n);
        free(ptrs);
        free(segs);
}

void epd_handle_cx_memory(struct epdd_conn *c, const Epd__V1__Request *req, int *fds,
                          unsigned num_fds)
{
        const Epd__V1__CxMemory *m = req->cx_memory;
        struct epdd_group *g = epd_group_find(c->cl.daemon, m->group_id);
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__CxMemoryReply mr = EPD__V1__CX_MEMORY_REPLY__INIT;
        const struct epdd_cx_mem *mem = NULL;
        uint32_t index = 0;
        char err[256] = "";
        int rc;

        if (!g) {
                epd_conn_reply_status(c, req->id, EPD_NOT_FOUND, "group %llu does not exist",
                                      (unsigned long long)m->group_id);
                return;
        }
        if (num_fds != (m->register_ ? 1u : 0u)) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "protocol error: CxMemory carries %u fds", num_fds);
                return;
        }
        rc = epd_group_cx_memory(g, &c->cl, m->register_, m->rank, m->index, m->peer,
                                 num_fds ? &fds[0] : NULL, m->offset, m->bytes, &index, &mem,
                                 err, sizeof(err));
        if (rc < 0) {
                epd_conn_reply_status(c, req->id, rc, "%s", err);
                return;
        }
        mr.index = index;
        mr.offset = mem->offset;
        mr.bytes = mem->bytes;
        mr.region_bytes = mem->fd_bytes;
        resp.id = req->id;
        resp.status = EPD__V1__STATUS_CODE__OK;
        resp.message = "";
        resp.body_case = EPD__V1__RESPONSE__BODY_CX_MEMORY;
        resp.cx_memory = &mr;
        if (m->register_)
                (void)epd_conn_send(c, &resp, NULL, 0);
        else
                (void)epd_conn_send(c, &resp, &mem->fd, 1);
}
