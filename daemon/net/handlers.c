/* handlers.c - one function per request type: argument checks, the fd accounting of each
 * request, the decoding of its protobuf into the core's native arguments, and the reply.
 * Collective ops are decoded from their op records (common/oprec.h) and handed to the core
 * (core/op.c); admin verbs and statistics go to the top level's hook. Loop thread only.
 *
 * Ownership: epd_handle_request owns `req` and frees it; the op keeps a copy of the decoded
 * record. fds[] entries a handler uses are taken (set to -1); the caller closes the rest.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "budget.h"
#include "admission.h"
#include "arena.h"
#include "backend.h"
#include "net.h"
#include "log.h"
#include "routing.h"
#include "reply.h"
#include "util.h"

#define EPD_MIN_SECRET_BYTES 16

static void reply(struct epdd_conn *c, Epd__V1__Response *resp, const int *fds, unsigned num_fds)
{
        resp->status = EPD__V1__STATUS_CODE__OK;
        if (!resp->message)
                resp->message = "";
        (void)epd_conn_send(c, resp, fds, num_fds);
}

static void fill_devices(struct epdd_daemon *d, Epd__V1__Device *devs, Epd__V1__Device **ptrs)
{
        struct epdd_backend *b = d->backend;

        for (unsigned i = 0; i < b->num_devices; i++) {
                epd__v1__device__init(&devs[i]);
                devs[i].index = b->devices[i].index;
                devs[i].uuid = b->devices[i].uuid;
                devs[i].name = b->devices[i].name;
                devs[i].kind = b->devices[i].kind;
                devs[i].memory_bytes = b->devices[i].memory_bytes;
                ptrs[i] = &devs[i];
        }
}

static int handle_hello(struct epdd_conn *c, const Epd__V1__Request *req)
{
        struct epdd_daemon *d = c->cl.daemon;
        const Epd__V1__Hello *h = req->hello;
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__Welcome w = EPD__V1__WELCOME__INIT;
        Epd__V1__Limits limits = EPD__V1__LIMITS__INIT;
        Epd__V1__Device devs[64], *ptrs[64];

        if (c->hello_done) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT, "Hello sent twice");
                return -1;
        }
        if (h->protocol_version != EPD_PROTOCOL_VERSION) {
                epd_conn_reply_status(c, req->id, EPD_VERSION_MISMATCH,
                                      "client speaks protocol %u, daemon speaks %u",
                                      h->protocol_version, EPD_PROTOCOL_VERSION);
                return -1;
        }
        c->hello_done = 1;
        c->cl.cuda_capable = (h->capabilities & EPD__V1__CAPABILITY__CAP_CUDA_REGIONS) != 0;
        snprintf(c->cl.name, sizeof(c->cl.name), "%s", h->client_name ? h->client_name : "");
        limits.max_frame_bytes = d->cfg.max_frame_bytes;
        limits.max_fds_per_frame = d->cfg.max_fds_per_frame;
        limits.max_regions_per_client = d->cfg.max_regions_per_client;
        limits.max_region_bytes_per_client = d->cfg.max_region_bytes_per_client;
        limits.max_outstanding_ops_per_client = d->cfg.max_outstanding_ops_per_client;
        limits.max_groups = d->cfg.max_groups;
        limits.max_clients = d->cfg.max_clients;
        w.protocol_version = EPD_PROTOCOL_VERSION;
        w.capabilities = EPD__V1__CAPABILITY__CAP_HOST_REGIONS |
                         EPD__V1__CAPABILITY__CAP_OUTPUT_ARENA |
                         EPD__V1__CAPABILITY__CAP_REPLY_MAILBOX |
                         EPD__V1__CAPABILITY__CAP_REQUEST_MAILBOX |
                         (c->cl.admin ? EPD__V1__CAPABILITY__CAP_ADMIN : 0);
        if (strcmp(d->backend->ops->name, "cuda") == 0)
                w.capabilities |= EPD__V1__CAPABILITY__CAP_CUDA_REGIONS;
        w.limits = &limits;
        w.daemon_epoch = d->epoch;
        w.client_id = c->cl.id;
        w.backend = (char *)d->backend->ops->name;
        w.version = EPD_VERSION_STRING;
        fill_devices(d, devs, ptrs);
        w.n_devices = d->backend->num_devices;
        w.devices = ptrs;
        resp.id = req->id;
        resp.body_case = EPD__V1__RESPONSE__BODY_WELCOME;
        resp.welcome = &w;
        reply(c, &resp, NULL, 0);
        return 0;
}

static int resolve_device(struct epdd_daemon *d, uint32_t index, const char *uuid,
                          uint32_t *out, char *err, size_t err_len)
{
        struct epdd_backend *b = d->backend;

        if (uuid && uuid[0]) {
                for (unsigned i = 0; i < b->num_devices; i++) {
                        if (strcmp(b->devices[i].uuid, uuid) == 0) {
                                *out = i;
                                return 0;
                        }
                }
                snprintf(err, err_len, "no device with UUID %s", uuid);
                return EPD_NOT_FOUND;
        }
        if (index >= b->num_devices) {
                snprintf(err, err_len, "device %u does not exist (the daemon has %u)", index,
                         b->num_devices);
                return EPD_INVALID_ARGUMENT;
        }
        *out = index;
        return 0;
}

static void reply_joined(struct epdd_conn *c, uint64_t request_id, struct epdd_group *g,
                         uint32_t rank)
{
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__GroupJoined j = EPD__V1__GROUP_JOINED__INIT;
        Epd__V1__GroupConfig cfg;
        struct epdd_rank *r = &g->ranks[rank];
        unsigned num_segs = r->arena ? r->arena->num_segs : 0;
        Epd__V1__ArenaSegment *segs = calloc(num_segs + 1, sizeof(*segs));
        Epd__V1__ArenaSegment **seg_ptrs = calloc(num_segs + 1, sizeof(*seg_ptrs));
        int fds[2];
        unsigned num_fds = 0;

        if (!segs || !seg_ptrs) {
                epd_conn_reply_status(c, request_id, EPD_INTERNAL, "out of memory");
                goto out;
        }
        epd_group_cfg_to_wire(&g->cfg, &cfg);
        j.group_id = g->id;
        j.config = &cfg;
        j.rank = rank;
        j.device = r->device;
        /* The doorbell page first, then the arena's first segment (proto/epd.proto,
         * GroupJoined); the client fetches further segments with ArenaSegments. */
        j.doorbell_bytes = EPD_DOORBELL_BYTES;
        fds[num_fds++] = r->doorbell_fd;
        if (r->arena)
                fds[num_fds++] = epd_wire_fill_joined(r, &j, segs, seg_ptrs);
        else if (g->cx) {
                /* A client-executed group has no arena; its buffers take the second fd. */
                j.cx_bytes_per_rank = g->cx->layout.total_bytes;
                j.cx_stride = g->cx->stride;
                j.cx_kind = (Epd__V1__RegionKind)g->cx->kind;
                j.cx_total_bytes = g->cx->bytes;
                fds[num_fds++] = g->cx->fd;
        }
        resp.id = request_id;
        resp.body_case = EPD__V1__RESPONSE__BODY_GROUP_JOINED;
        resp.group_joined = &j;
        reply(c, &resp, fds, num_fds);
out:
        free(seg_ptrs);
        free(segs);
}

static void handle_group_create(struct epdd_conn *c, const Epd__V1__Request *req)
{
        struct epdd_daemon *d = c->cl.daemon;
        const Epd__V1__GroupCreate *m = req->group_create;
        struct epdd_group_cfg cfg;
        struct epdd_group *g;
        uint32_t device = 0;
        char err[256];
        int rc;

        if (m->secret.len < EPD_MIN_SECRET_BYTES) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "group secret must have at least %d bytes (128 random bits)",
                                      EPD_MIN_SECRET_BYTES);
                return;
        }
        rc = epd_group_cfg_from_wire(d, m->config, &cfg, err, sizeof(err));
        if (rc == 0)
                rc = resolve_device(d, m->device, m->device_uuid, &device, err, sizeof(err));
        if (rc == 0 && m->rank >= cfg.world_size) {
                snprintf(err, sizeof(err), "rank %u outside 0..%u", m->rank, cfg.world_size - 1);
                rc = EPD_INVALID_ARGUMENT;
        }
        if (rc == 0)
                rc = epd_budget_group(d, &c->cl, err, sizeof(err));
        if (rc == 0)
                rc = epd_group_new(d, c->cl.uid, m->name ? m->name : "", m->secret.data,
                                   m->secret.len, &cfg, &g, err, sizeof(err));
        if (rc < 0) {
                epd_conn_reply_status(c, req->id, rc, "group create: %s", err);
                return;
        }
        rc = epd_group_bind(g, &c->cl, m->rank, device, m->mps_enabled, err, sizeof(err));
        if (rc < 0) {
                epd_conn_reply_status(c, req->id, rc, "group create: %s", err);
                epd_group_maybe_free(g);
                return;
        }
        reply_joined(c, req->id, g, m->rank);
}

static void handle_group_join(struct epdd_conn *c, const Epd__V1__Request *req)
{
        struct epdd_daemon *d = c->cl.daemon;
        const Epd__V1__GroupJoin *m = req->group_join;
        const char *name = m->name ? m->name : "";
        uint32_t device;
        char err[256];
        int rc, named;
        struct epdd_group *g = epd_group_find_for_join(d, c->cl.uid, name, m->secret.data,
                                                       m->secret.len, &named);

        if (!g && !named) {
                epd_conn_reply_status(c, req->id, EPD_NOT_FOUND, "group '%s' does not exist",
                                      name);
                return;
        }
        if (!g) {
                /* Guessing costs the connection after a few tries. */
                c->cl.wrong_secrets++;
                log_notice("wrong group secret group=%s client=%llu pid=%d uid=%u tries=%u", name,
                           (unsigned long long)c->cl.id, (int)c->cl.pid, (unsigned)c->cl.uid,
                           c->cl.wrong_secrets);
                epd_conn_reply_status(c, req->id, EPD_PERMISSION_DENIED,
                                      "wrong secret for group '%s'%s", name,
                                      c->cl.wrong_secrets >= EPD_MAX_WRONG_SECRETS
                                              ? ": too many wrong secrets, closing the connection"
                                              : "");
                if (c->cl.wrong_secrets >= EPD_MAX_WRONG_SECRETS) {
                        epd_conn_close_later(c, "too many wrong group secrets");
                        if (!c->cl.admin)
                                epd_admission_penalize(d, c->cl.uid);
                }
                return;
        }
        rc = resolve_device(d, m->device, m->device_uuid, &device, err, sizeof(err));
        if (rc == 0)
                rc = epd_group_bind(g, &c->cl, m->rank, device, m->mps_enabled, err,
                                    sizeof(err));
        if (rc < 0) {
                epd_conn_reply_status(c, req->id, rc, "group join: %s", err);
                return;
        }
        reply_joined(c, req->id, g, m->rank);
}

/* The group and rank named by a request, if this client holds that rank. op_kind: the request
 * is an op record of that kind, whose refusal is a reply record; 0 for a control message. */
static struct epdd_group *bound_group(struct epdd_conn *c, uint64_t request_id, uint64_t group_id,
                                     uint32_t rank, uint32_t op_kind)
{
        struct epdd_group *g = epd_group_find(c->cl.daemon, group_id);
        char why[160];
        int status;

        if (!g) {
                status = EPD_NOT_FOUND;
                snprintf(why, sizeof(why), "group %llu does not exist",
                         (unsigned long long)group_id);
        } else if (rank >= g->cfg.world_size || g->ranks[rank].conn != &c->cl) {
                status = EPD_PERMISSION_DENIED;
                snprintf(why, sizeof(why), "rank %u of group '%s' is not bound to this client",
                         rank, g->name);
        } else {
                return g;
        }
        if (op_kind)
                epd_reply_op_status(&c->cl, NULL, op_kind, request_id, status, "%s", why);
        else
                epd_conn_reply_status(c, request_id, status, "%s", why);
        return NULL;
}

void epd_handle_op(struct epdd_conn *c, const struct epd_op_request *req)
{
        struct epdd_group *g;

        if (c->cl.daemon->shutting_down) {
                epd_reply_op_status(&c->cl, NULL, req->kind, req->id, EPD_UNAVAILABLE,
                                         "daemon is shutting down");
                return;
        }
        g = bound_group(c, req->id, req->group_id, req->rank, req->kind);
        if (g && g->cx) {
                epd_reply_op_status(&c->cl, NULL, req->kind, req->id, EPD_INVALID_ARGUMENT,
                                    "group '%s' is client-executed: run its ops with "
                                    "epd_cx_dispatch and epd_cx_combine", g->name);
                return;
        }
        if (g)
                epd_op_submit(g, req->rank, &c->cl, req);
}

/* An op record on the socket: decoded here, at the edge. A malformed record is a protocol
 * error, as in the doorbell page. */
static int handle_op_record(struct epdd_conn *c, const Epd__V1__Request *req)
{
        const ProtobufCBinaryData *rec = &req->op->record;
        struct epd_op_request q;
        char why[160];

        if (epd_oprec_request_decode(rec->data, rec->len, &q, why, sizeof(why)) < 0) {
                c->cl.daemon->stats.protocol_errors++;
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "protocol error: malformed op record: %s", why);
                return -1;
        }
        if (q.id != req->id) {
                c->cl.daemon->stats.protocol_errors++;
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "protocol error: op record id %llu in request %llu",
                                      (unsigned long long)q.id, (unsigned long long)req->id);
                return -1;
        }
        epd_handle_op(c, &q);
        return 0;
}

static void handle_group_leave(struct epdd_conn *c, const Epd__V1__Request *req)
{
        const Epd__V1__GroupLeave *m = req->group_leave;
        struct epdd_group *g = bound_group(c, req->id, m->group_id, m->rank, 0);

        if (!g)
                return;
        epd_group_unbind(g, m->rank, 0);
        epd_group_maybe_free(g);
        epd_conn_reply_status(c, req->id, EPD_OK, "%s", "");
}

static int handle_region_register(struct epdd_conn *c, const Epd__V1__Request *req, int *fds,
                                  unsigned num_fds)
{
        const Epd__V1__RegionRegister *m = req->region_register;
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__RegionRegistered rr = EPD__V1__REGION_REGISTERED__INIT;
        unsigned want_fds;
        char err[256] = "";
        int fd = -1, rc;

        switch (m->kind) {
        case EPD__V1__REGION_KIND__HOST_MEMFD:
        case EPD__V1__REGION_KIND__CUMEM_FD:
                want_fds = 1;
                break;
        case EPD__V1__REGION_KIND__CUDA_IPC:
                want_fds = 0;
                break;
        default:
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT, "unknown region kind %d",
                                      (int)m->kind);
                return 0;
        }
        if (num_fds != want_fds) {
                /* The frame's fd accounting is part of the protocol: close the connection. */
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "protocol error: region kind %d needs %u fd(s), frame has %u",
                                      (int)m->kind, want_fds, num_fds);
                return -1;
        }
        if (want_fds) {
                fd = fds[0];
                fds[0] = -1;
        }
        const struct epdd_region_args ra = {
                .kind = (enum epd_region_kind)m->kind,
                .size = m->size,
                .device = m->device,
                .ipc_handle = m->ipc_handle.data,
                .ipc_len = m->ipc_handle.len,
                .offset = m->offset,
        };
        rc = epd_region_register(&c->cl, &ra, fd, &rr.region_id, err, sizeof(err));
        if (rc < 0) {
                epd_conn_reply_status(c, req->id, rc, "region register: %s", err);
                return 0;
        }
        resp.id = req->id;
        resp.body_case = EPD__V1__RESPONSE__BODY_REGION_REGISTERED;
        resp.region_registered = &rr;
        reply(c, &resp, NULL, 0);
        return 0;
}

static void handle_region_release(struct epdd_conn *c, const Epd__V1__Request *req)
{
        int rc = epd_region_release_id(&c->cl, req->region_release->region_id);

        if (rc == EPD_NOT_FOUND)
                epd_conn_reply_status(c, req->id, rc, "region %llu is not registered by this client",
                                      (unsigned long long)req->region_release->region_id);
        else if (rc < 0)
                epd_conn_reply_status(c, req->id, rc,
                                      "region %llu is a group's output arena; it goes with the rank binding",
                                      (unsigned long long)req->region_release->region_id);
        else
                epd_conn_reply_status(c, req->id, EPD_OK, "%s", "");
}

static uint64_t outputs_bytes(const struct epdd_group_cfg *cfg, uint64_t rows, int expand)
{
        /* Every arena field at full width, each rounded to the arena alignment. */
        uint64_t row = cfg->row_bytes + cfg->scale_cols * 4 + (uint64_t)cfg->max_topk * 8 +
                       (expand ? 4 : (uint64_t)cfg->max_topk * 4) + 8 + (expand ? 4 : 0);
        return rows * row + EPD_OUT_FIELDS * EPD_ARENA_ALIGN;
}

static void handle_size_hint(struct epdd_conn *c, const Epd__V1__Request *req)
{
        const Epd__V1__SizeHint *m = req->size_hint;
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__SizeHintReply sh = EPD__V1__SIZE_HINT_REPLY__INIT;
        struct epdd_group_cfg cfg;
        uint32_t align = m->expert_alignment ? m->expert_alignment : 1;
        char err[256];
        int rc = epd_group_cfg_from_wire(c->cl.daemon, m->config, &cfg, err, sizeof(err));

        if (rc < 0) {
                epd_conn_reply_status(c, req->id, rc, "size hint: %s", err);
                return;
        }
        sh.max_rows_non_expand = epd_route_max_rows_non_expand(cfg.world_size, cfg.max_tokens);
        sh.max_rows_expand = epd_route_max_rows_expand(cfg.world_size, cfg.max_tokens,
                                                       cfg.max_topk, cfg.num_local_experts, align);
        sh.arena_bytes_non_expand = outputs_bytes(&cfg, sh.max_rows_non_expand, 0);
        sh.arena_bytes_expand = outputs_bytes(&cfg, sh.max_rows_expand, 1);
        /* The host backend keeps only the handle's routing (int32 per top-k entry and row) and
         * the arena; it has no staging buffers. */
        sh.daemon_bytes_per_rank = cfg.arena_bytes + (uint64_t)cfg.max_tokens * cfg.max_topk * 12;
        /* A client-executed group: each rank's buffer holds its outputs, signals and routing. */
        sh.client_buffer_bytes_per_rank = cfg.cx_bytes;
        if (cfg.execution == EPD_EXECUTION_CLIENT)
                sh.daemon_bytes_per_rank = cfg.cx_bytes;
        resp.id = req->id;
        resp.body_case = EPD__V1__RESPONSE__BODY_SIZE_HINT;
        resp.size_hint = &sh;
        reply(c, &resp, NULL, 0);
}

static void handle_status(struct epdd_conn *c, const Epd__V1__Request *req)
{
        struct epdd_daemon *d = c->cl.daemon;
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__StatusReply st = EPD__V1__STATUS_REPLY__INIT;
        Epd__V1__Device devs[64], *ptrs[64];
        struct epd_list *pos;

        st.version = EPD_VERSION_STRING;
        st.backend = (char *)d->backend->ops->name;
        st.daemon_epoch = d->epoch;
        st.uptime_ms = (epd__now_ns() - d->start_ns) / 1000000;
        fill_devices(d, devs, ptrs);
        st.n_devices = d->backend->num_devices;
        st.devices = ptrs;
        st.num_groups = d->num_groups;
        st.num_clients = d->num_conns;
        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_client *o = epd_list_entry(pos, struct epdd_client, link);
                st.num_regions += o->num_regions;
                st.region_bytes += o->region_bytes;
        }
        st.ops_completed = d->stats.ops_completed;
        st.ops_failed = d->stats.ops_failed;
        st.pid = (int32_t)getpid();
        st.draining = d->draining || d->shutting_down;
        resp.id = req->id;
        resp.body_case = EPD__V1__RESPONSE__BODY_STATUS_REPLY;
        resp.status_reply = &st;
        reply(c, &resp, NULL, 0);
}

static void handle_list_groups(struct epdd_conn *c, const Epd__V1__Request *req)
{
        struct epdd_daemon *d = c->cl.daemon;
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__ListGroupsReply lg = EPD__V1__LIST_GROUPS_REPLY__INIT;
        Epd__V1__GroupInfo *infos = calloc(d->num_groups + 1, sizeof(*infos));
        Epd__V1__GroupInfo **iptrs = calloc(d->num_groups + 1, sizeof(*iptrs));
        Epd__V1__GroupConfig *cfgs = calloc(d->num_groups + 1, sizeof(*cfgs));
        Epd__V1__RankInfo **rank_blocks = calloc(d->num_groups + 1, sizeof(*rank_blocks));
        Epd__V1__RankInfo ***rank_ptrs = calloc(d->num_groups + 1, sizeof(*rank_ptrs));
        struct epd_list *pos;
        size_t n = 0;

        if (!infos || !iptrs || !cfgs || !rank_blocks || !rank_ptrs) {
                epd_conn_reply_status(c, req->id, EPD_INTERNAL, "out of memory");
                goto out;
        }
        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                Epd__V1__GroupInfo *gi = &infos[n];
                uint32_t R = g->cfg.world_size;
                struct epd_list *op_pos;
                unsigned pending = 0;

                if (n >= d->num_groups)
                        break;
                epd__v1__group_info__init(gi);
                gi->id = g->id;
                gi->name = g->name;
                gi->state = (char *)epd_group_state_name(g->state);
                epd_group_cfg_to_wire(&g->cfg, &cfgs[n]);
                gi->config = &cfgs[n];
                gi->ops_completed = g->stats.ops_completed;
                gi->ops_failed = g->stats.ops_failed;
                gi->num_handles = g->num_handles;
                gi->client_buffer_bytes_per_rank = g->cfg.cx_bytes;
                gi->owner_uid = (uint32_t)g->owner_uid;
                gi->memory_bytes = epd_budget_group_memory(g);
                epd_list_for_each(op_pos, &g->ops) pending++;
                gi->pending_ops = pending;
                rank_blocks[n] = calloc(R, sizeof(**rank_blocks));
                rank_ptrs[n] = calloc(R, sizeof(**rank_ptrs));
                if (!rank_blocks[n] || !rank_ptrs[n]) {
                        epd_conn_reply_status(c, req->id, EPD_INTERNAL, "out of memory");
                        n++;
                        goto out;
                }
                for (uint32_t r = 0; r < R; r++) {
                        Epd__V1__RankInfo *ri = &rank_blocks[n][r];
                        epd__v1__rank_info__init(ri);
                        ri->rank = r;
                        ri->bound = g->ranks[r].conn != NULL;
                        ri->client_id = g->ranks[r].conn ? g->ranks[r].conn->id : 0;
                        ri->device = g->ranks[r].device;
                        ri->next_op = g->ranks[r].next_op;
                        rank_ptrs[n][r] = ri;
                }
                gi->n_ranks = R;
                gi->ranks = rank_ptrs[n];
                iptrs[n] = gi;
                n++;
        }
        lg.n_groups = n;
        lg.groups = iptrs;
        resp.id = req->id;
        resp.body_case = EPD__V1__RESPONSE__BODY_GROUPS;
        resp.groups = &lg;
        reply(c, &resp, NULL, 0);
out:
        for (size_t i = 0; i < n && rank_blocks && rank_ptrs; i++) {
                free(rank_blocks[i]);
                free(rank_ptrs[i]);
        }
        free(rank_blocks);
        free(rank_ptrs);
        free(cfgs);
        free(iptrs);
        free(infos);
}

static void handle_list_clients(struct epdd_conn *c, const Epd__V1__Request *req)
{
        struct epdd_daemon *d = c->cl.daemon;
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__ListClientsReply lc = EPD__V1__LIST_CLIENTS_REPLY__INIT;
        unsigned cap = d->num_conns + 1;
        Epd__V1__ClientInfo *infos = calloc(cap, sizeof(*infos));
        Epd__V1__ClientInfo **iptrs = calloc(cap, sizeof(*iptrs));
        char ***names = calloc(cap, sizeof(*names));
        struct epd_list *pos;
        size_t n = 0;

        if (!infos || !iptrs || !names) {
                epd_conn_reply_status(c, req->id, EPD_INTERNAL, "out of memory");
                goto out;
        }
        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_client *o = epd_list_entry(pos, struct epdd_client, link);
                Epd__V1__ClientInfo *ci = &infos[n];
                struct epd_list *bpos;
                size_t nb = 0, i = 0;

                if (n >= cap)
                        break;
                epd__v1__client_info__init(ci);
                ci->id = o->id;
                ci->pid = o->pid;
                ci->uid = o->uid;
                ci->gid = o->gid;
                ci->name = o->name;
                ci->num_regions = o->num_regions;
                ci->region_bytes = o->region_bytes;
                ci->outstanding_ops = o->outstanding_ops;
                epd_list_for_each(bpos, &o->bindings) nb++;
                names[n] = calloc(nb + 1, sizeof(char *));
                if (!names[n])
                        continue;
                epd_list_for_each(bpos, &o->bindings)
                {
                        struct epdd_binding *b = epd_list_entry(bpos, struct epdd_binding, conn_link);
                        char buf[96];
                        snprintf(buf, sizeof(buf), "%s/%u", b->group->name, b->rank);
                        names[n][i++] = strdup(buf);
                }
                ci->n_bindings = i;
                ci->bindings = names[n];
                iptrs[n] = ci;
                n++;
        }
        lc.n_clients = n;
        lc.clients = iptrs;
        resp.id = req->id;
        resp.body_case = EPD__V1__RESPONSE__BODY_CLIENTS;
        resp.clients = &lc;
        reply(c, &resp, NULL, 0);
out:
        for (size_t i = 0; i < n && names; i++) {
                for (size_t j = 0; names[i] && names[i][j]; j++)
                        free(names[i][j]);
                free(names[i]);
        }
        free(names);
        free(iptrs);
        free(infos);
}

static void handle_handle_release(struct epdd_conn *c, const Epd__V1__Request *req)
{
        const Epd__V1__HandleRelease *m = req->handle_release;
        struct epdd_group *g = bound_group(c, req->id, m->group_id, m->rank, 0);
        char err[256];
        int rc;

        if (!g)
                return;
        rc = epd_handle_release_rank(g, m->rank, m->handle_id, err, sizeof(err));
        if (rc < 0)
                epd_conn_reply_status(c, req->id, rc, "%s", err);
        else
                epd_conn_reply_status(c, req->id, EPD_OK, "%s", "");
}

static epd_request_hook request_hook;

void epd_net_set_request_hook(epd_request_hook hook)
{
        request_hook = hook;
}

int epd_handle_request(struct epdd_conn *c, Epd__V1__Request *req, int *fds, unsigned num_fds)
{
        int rc = 0;

        if (!c->hello_done && req->body_case != EPD__V1__REQUEST__BODY_HELLO) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "protocol error: the first request must be Hello");
                epd__v1__request__free_unpacked(req, NULL);
                return -1;
        }
        if (num_fds && req->body_case != EPD__V1__REQUEST__BODY_REGION_REGISTER &&
            req->body_case != EPD__V1__REQUEST__BODY_CX_MEMORY) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "protocol error: this request carries no fds, frame has %u",
                                      num_fds);
                epd__v1__request__free_unpacked(req, NULL);
                return -1;
        }
        switch (req->body_case) {
        case EPD__V1__REQUEST__BODY_HELLO:
                rc = handle_hello(c, req);
                break;
        case EPD__V1__REQUEST__BODY_GROUP_CREATE:
                handle_group_create(c, req);
                break;
        case EPD__V1__REQUEST__BODY_GROUP_JOIN:
                handle_group_join(c, req);
                break;
        case EPD__V1__REQUEST__BODY_GROUP_LEAVE:
                handle_group_leave(c, req);
                break;
        case EPD__V1__REQUEST__BODY_REGION_REGISTER:
                rc = handle_region_register(c, req, fds, num_fds);
                break;
        case EPD__V1__REQUEST__BODY_REGION_RELEASE:
                handle_region_release(c, req);
                break;
        case EPD__V1__REQUEST__BODY_SIZE_HINT:
                handle_size_hint(c, req);
                break;
        case EPD__V1__REQUEST__BODY_STATUS:
                handle_status(c, req);
                break;
        case EPD__V1__REQUEST__BODY_LIST_GROUPS:
                handle_list_groups(c, req);
                break;
        case EPD__V1__REQUEST__BODY_LIST_CLIENTS:
                handle_list_clients(c, req);
                break;
        case EPD__V1__REQUEST__BODY_HANDLE_RELEASE:
                handle_handle_release(c, req);
                break;
        case EPD__V1__REQUEST__BODY_STATS:
        case EPD__V1__REQUEST__BODY_DRAIN:
        case EPD__V1__REQUEST__BODY_UNDRAIN:
        case EPD__V1__REQUEST__BODY_EVICT:
        case EPD__V1__REQUEST__BODY_RESIZE:
                if (request_hook)
                        request_hook(c, req); /* the top level: admin.c, report.c */
                else
                        epd_conn_reply_status(c, req->id, EPD_UNAVAILABLE,
                                              "this daemon does not serve %s",
                                              epd__request_body_name(req->body_case));
                break;
        case EPD__V1__REQUEST__BODY_ARENA_SEGMENTS:
                epd_handle_arena_segments(c, req); /* wire.c */
                break;
        case EPD__V1__REQUEST__BODY_CX_MEMORY:
                epd_handle_cx_memory(c, req, fds, num_fds); /* wire.c */
                break;
        case EPD__V1__REQUEST__BODY_OP:
                rc = handle_op_record(c, req);
                break;
        default:
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT, "unknown request type %d",
                                      (int)req->body_case);
                break;
        }
        epd__v1__request__free_unpacked(req, NULL);
        return rc;
}
