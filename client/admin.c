/* admin.c - libepd's administration calls (include/epd.h, "administration"): the daemon's
 * status, group and client lists and statistics as snapshots, and the admin verbs drain,
 * undrain, evict and resize. Each call is one request through epd__client_call; any thread.
 *
 * A snapshot keeps the daemon's reply and points into it: its strings and scalar arrays are the
 * reply's own, and the public structs that describe it live in blocks the snapshot frees with
 * the reply. So epd.h's structs never show a protobuf type, and nothing is copied twice.
 */
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* ---- snapshots ---- */

struct block {
        struct block *next;
        max_align_t data[];
};

/* The first member of every snapshot object below, so that one free serves them all. */
struct snapshot {
        Epd__V1__Response *resp;
        struct block *blocks;
};

struct epd_daemon_status {
        struct snapshot snap;
        struct epd_daemon_status_info info;
};

struct epd_group_list {
        struct snapshot snap;
        size_t count;
        struct epd_group_info *groups;
};

struct epd_client_list {
        struct snapshot snap;
        size_t count;
        struct epd_client_info *clients;
};

struct epd_stats {
        struct snapshot snap;
        struct epd_admin_daemon_stats daemon;
};

struct epd_resize_result {
        struct snapshot snap;
        struct epd_resize_info info;
};

/* Zeroed memory for n elements of `size` owned by the snapshot; NULL for n 0 or no memory
 * (the caller tells the two apart by n). */
static void *snap_alloc(struct snapshot *s, size_t n, size_t size)
{
        struct block *b;

        if (n == 0)
                return NULL;
        if (n > (SIZE_MAX - sizeof(*b)) / size)
                return NULL;
        b = calloc(1, sizeof(*b) + n * size);
        if (!b)
                return NULL;
        b->next = s->blocks;
        s->blocks = b;
        return b->data;
}

#define SNAP_ARRAY(s, ptr, n) ((ptr) = snap_alloc((s), (n), sizeof(*(ptr))), (n) == 0 || (ptr))

/* Frees a snapshot object (s is its first member) with all it holds; NULL does nothing. */
static void snap_free(struct snapshot *s)
{
        if (!s)
                return;
        while (s->blocks) {
                struct block *b = s->blocks;
                s->blocks = b->next;
                free(b);
        }
        if (s->resp)
                epd__v1__response__free_unpacked(s->resp, NULL);
        free(s);
}

/* Counts of repeated fields are size_t on the wire side; a reply fits one frame, so they fit
 * uint32_t. */
static uint32_t count32(size_t n)
{
        return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

/* A snapshot object of `size` bytes (a struct whose first member is its struct snapshot)
 * holding the reply to req, whose body case epd__client_call checked; NULL with *rc set on
 * failure. */
static void *snap_new(struct epd_client *c, size_t size, Epd__V1__Request *req, int *rc)
{
        struct snapshot *s = calloc(1, size);

        if (!s) {
                *rc = epd__client_fail(c, EPD_INTERNAL, "out of memory");
                return NULL;
        }
        if ((*rc = epd__client_call(c, req, NULL, 0, &s->resp, NULL)) < 0) {
                free(s);
                return NULL;
        }
        return s;
}

static int no_memory(struct epd_client *c, struct snapshot *s)
{
        snap_free(s);
        return epd__client_fail(c, EPD_INTERNAL, "out of memory for the daemon's reply");
}

static int check_out(struct epd_client *c, const void *out, const char *call)
{
        if (!c)
                return EPD_INVALID_ARGUMENT;
        if (!out)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT, "%s: out is NULL", call);
        return 0;
}

static const struct epd_admin_op_stats zero_op_stats;

/* The public form of an OpStats, zero when absent. NULL only when out of memory. */
static const struct epd_admin_op_stats *op_stats(struct snapshot *s, const Epd__V1__OpStats *o)
{
        struct epd_admin_op_stats *p;

        if (!o)
                return &zero_op_stats;
        if (!(p = snap_alloc(s, 1, sizeof(*p))))
                return NULL;
        p->ops = o->ops;
        p->bytes = o->bytes;
        p->num_errors = count32(o->n_errors);
        p->errors = o->errors;
        p->latency_p50_ns = o->latency_p50_ns;
        p->latency_p90_ns = o->latency_p90_ns;
        p->latency_p99_ns = o->latency_p99_ns;
        p->latency_max_ns = o->latency_max_ns;
        p->latency_count = o->latency_count;
        p->latency_sum_ns = o->latency_sum_ns;
        p->num_latency_buckets = count32(o->n_latency_buckets);
        p->latency_buckets = o->latency_buckets;
        return p;
}

/* ---- status ---- */

int epd_daemon_status_get(struct epd_client *client, struct epd_daemon_status **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__StatusRequest sr = EPD__V1__STATUS_REQUEST__INIT;
        struct epd_daemon_status *st;
        struct epd_admin_device *devs;
        int rc;

        if ((rc = check_out(client, out, "epd_daemon_status_get")) < 0)
                return rc;
        req.body_case = EPD__V1__REQUEST__BODY_STATUS;
        req.status = &sr;
        if (!(st = snap_new(client, sizeof(*st), &req, &rc)))
                return rc;
        const Epd__V1__StatusReply *r = st->snap.resp->status_reply;
        struct epd_daemon_status_info *i = &st->info;
        if (!SNAP_ARRAY(&st->snap, devs, r->n_devices))
                return no_memory(client, &st->snap);
        for (size_t k = 0; k < r->n_devices; k++) {
                const Epd__V1__Device *d = r->devices[k];
                devs[k] = (struct epd_admin_device){ .index = d->index, .uuid = d->uuid,
                                                     .name = d->name, .kind = d->kind,
                                                     .memory_bytes = d->memory_bytes };
        }
        i->version = r->version;
        i->backend = r->backend;
        i->daemon_epoch = r->daemon_epoch;
        i->uptime_ms = r->uptime_ms;
        i->pid = r->pid;
        i->draining = r->draining;
        i->num_groups = r->num_groups;
        i->num_clients = r->num_clients;
        i->num_regions = r->num_regions;
        i->region_bytes = r->region_bytes;
        i->ops_completed = r->ops_completed;
        i->ops_failed = r->ops_failed;
        i->num_devices = count32(r->n_devices);
        i->devices = devs;
        *out = st;
        return 0;
}

const struct epd_daemon_status_info *epd_daemon_status_info(const struct epd_daemon_status *st)
{
        return st ? &st->info : NULL;
}

void epd_daemon_status_free(struct epd_daemon_status *st)
{
        snap_free((struct snapshot *)st);
}

/* ---- groups ---- */

static int group_info(struct snapshot *s, const Epd__V1__GroupInfo *g, struct epd_group_info *o)
{
        struct epd_admin_rank *ranks;
        const Epd__V1__GroupConfig *cfg = g->config;

        if (!SNAP_ARRAY(s, ranks, g->n_ranks))
                return -1;
        for (size_t k = 0; k < g->n_ranks; k++) {
                const Epd__V1__RankInfo *ri = g->ranks[k];
                ranks[k] = (struct epd_admin_rank){ .rank = ri->rank, .bound = ri->bound,
                                                    .client_id = ri->client_id,
                                                    .device = ri->device,
                                                    .next_op = ri->next_op };
        }
        o->id = g->id;
        o->name = g->name;
        o->state = g->state;
        o->config.size = sizeof(o->config);
        if (cfg) {
                o->config.world_size = cfg->world_size;
                o->config.num_experts = cfg->num_experts;
                o->config.hidden = cfg->hidden;
                o->config.max_tokens_per_rank = cfg->max_tokens_per_rank;
                o->config.max_topk = cfg->max_topk;
                o->config.dispatch_dtype = (enum epd_dtype)cfg->dispatch_dtype;
                o->config.scale_block = cfg->scale_block;
                o->config.op_timeout_ms = cfg->op_timeout_ms;
                o->config.arena_bytes = cfg->arena_bytes;
                o->config.execution = (enum epd_execution)cfg->execution;
                o->config.max_expert_alignment = cfg->max_expert_alignment;
                o->config.expert_block_rows = cfg->expert_block_rows;
                o->config.quantize = cfg->quantize;
                o->config.num_handle_slots = cfg->num_handle_slots;
                o->config.sms_per_rank = cfg->sms_per_rank;
                o->config.recv_rows = cfg->recv_rows;
        }
        o->client_buffer_bytes_per_rank = g->client_buffer_bytes_per_rank;
        o->owner_uid = g->owner_uid;
        o->memory_bytes = g->memory_bytes;
        o->ops_completed = g->ops_completed;
        o->ops_failed = g->ops_failed;
        o->num_handles = g->num_handles;
        o->pending_ops = g->pending_ops;
        o->num_ranks = count32(g->n_ranks);
        o->ranks = ranks;
        return 0;
}

int epd_group_list_get(struct epd_client *client, struct epd_group_list **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__ListGroups lg = EPD__V1__LIST_GROUPS__INIT;
        struct epd_group_list *l;
        int rc;

        if ((rc = check_out(client, out, "epd_group_list_get")) < 0)
                return rc;
        req.body_case = EPD__V1__REQUEST__BODY_LIST_GROUPS;
        req.list_groups = &lg;
        if (!(l = snap_new(client, sizeof(*l), &req, &rc)))
                return rc;
        const Epd__V1__ListGroupsReply *r = l->snap.resp->groups;
        l->count = r->n_groups;
        if (!SNAP_ARRAY(&l->snap, l->groups, r->n_groups))
                return no_memory(client, &l->snap);
        for (size_t i = 0; i < r->n_groups; i++)
                if (group_info(&l->snap, r->groups[i], &l->groups[i]) < 0)
                        return no_memory(client, &l->snap);
        *out = l;
        return 0;
}

size_t epd_group_list_count(const struct epd_group_list *list)
{
        return list ? list->count : 0;
}

const struct epd_group_info *epd_group_list_at(const struct epd_group_list *list, size_t i)
{
        return list && i < list->count ? &list->groups[i] : NULL;
}

void epd_group_list_free(struct epd_group_list *list)
{
        snap_free((struct snapshot *)list);
}

/* ---- clients ---- */

int epd_client_list_get(struct epd_client *client, struct epd_client_list **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__ListClients lc = EPD__V1__LIST_CLIENTS__INIT;
        struct epd_client_list *l;
        int rc;

        if ((rc = check_out(client, out, "epd_client_list_get")) < 0)
                return rc;
        req.body_case = EPD__V1__REQUEST__BODY_LIST_CLIENTS;
        req.list_clients = &lc;
        if (!(l = snap_new(client, sizeof(*l), &req, &rc)))
                return rc;
        const Epd__V1__ListClientsReply *r = l->snap.resp->clients;
        l->count = r->n_clients;
        if (!SNAP_ARRAY(&l->snap, l->clients, r->n_clients))
                return no_memory(client, &l->snap);
        for (size_t i = 0; i < r->n_clients; i++) {
                const Epd__V1__ClientInfo *ci = r->clients[i];
                l->clients[i] = (struct epd_client_info){
                        .id = ci->id, .pid = ci->pid, .uid = ci->uid, .gid = ci->gid,
                        .name = ci->name, .num_regions = ci->num_regions,
                        .region_bytes = ci->region_bytes,
                        .outstanding_ops = ci->outstanding_ops,
                        .num_bindings = count32(ci->n_bindings),
                        .bindings = (const char *const *)ci->bindings,
                };
        }
        *out = l;
        return 0;
}

size_t epd_client_list_count(const struct epd_client_list *list)
{
        return list ? list->count : 0;
}

const struct epd_client_info *epd_client_list_at(const struct epd_client_list *list, size_t i)
{
        return list && i < list->count ? &list->clients[i] : NULL;
}

void epd_client_list_free(struct epd_client_list *list)
{
        snap_free((struct snapshot *)list);
}

/* ---- statistics ---- */

static int group_stats(struct snapshot *s, const Epd__V1__GroupStats *g,
                       struct epd_admin_group_stats *o)
{
        struct epd_admin_rank_stats *ranks;
        struct epd_admin_stage_stats *stages;

        if (!SNAP_ARRAY(s, ranks, g->n_ranks) || !SNAP_ARRAY(s, stages, g->n_stages))
                return -1;
        for (size_t k = 0; k < g->n_ranks; k++) {
                const Epd__V1__RankStats *rs = g->ranks[k];
                ranks[k] = (struct epd_admin_rank_stats){
                        .rank = rs->rank, .bound = rs->bound, .client_id = rs->client_id,
                        .device = rs->device, .dispatch = op_stats(s, rs->dispatch),
                        .combine = op_stats(s, rs->combine), .arena_bytes = rs->arena_bytes,
                        .arena_used_bytes = rs->arena_used_bytes,
                        .queue_depth = rs->queue_depth, .next_op = rs->next_op,
                        .client_ops = rs->client_ops, .client_rows = rs->client_rows,
                        .client_bytes = rs->client_bytes,
                        .client_failures = rs->client_failures,
                        .client_buffer_bytes = rs->client_buffer_bytes,
                };
                for (size_t i = 0; i < rs->n_client_kind_ops && i < 2; i++)
                        ranks[k].client_kind_ops[i] = rs->client_kind_ops[i];
                for (size_t i = 0; i < rs->n_client_phase_ns && i < 6; i++)
                        ranks[k].client_phase_ns[i / 3][i % 3] = rs->client_phase_ns[i];
                if (!ranks[k].dispatch || !ranks[k].combine)
                        return -1;
        }
        for (size_t k = 0; k < g->n_stages; k++) {
                const Epd__V1__OpStage *st = g->stages[k];
                stages[k] = (struct epd_admin_stage_stats){
                        .op = st->op, .stage = st->stage, .latency = op_stats(s, st->latency),
                };
                if (!stages[k].latency)
                        return -1;
        }
        *o = (struct epd_admin_group_stats){
                .id = g->id, .name = g->name, .state = g->state, .world_size = g->world_size,
                .dispatch = op_stats(s, g->dispatch), .combine = op_stats(s, g->combine),
                .pending_ops = g->pending_ops, .handles = g->handles,
                .num_ranks = count32(g->n_ranks), .ranks = ranks,
                .num_stages = count32(g->n_stages), .stages = stages,
        };
        return o->dispatch && o->combine ? 0 : -1;
}

int epd_stats_get(struct epd_client *client, struct epd_stats **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__StatsRequest sr = EPD__V1__STATS_REQUEST__INIT;
        struct epd_admin_group_stats *groups;
        struct epd_admin_client_stats *clients;
        struct epd_admin_device_stats *devices;
        struct epd_stats *st;
        int rc;

        if ((rc = check_out(client, out, "epd_stats_get")) < 0)
                return rc;
        req.body_case = EPD__V1__REQUEST__BODY_STATS;
        req.stats = &sr;
        if (!(st = snap_new(client, sizeof(*st), &req, &rc)))
                return rc;
        const Epd__V1__StatsReply *r = st->snap.resp->stats;
        struct snapshot *s = &st->snap;
        if (!SNAP_ARRAY(s, groups, r->n_groups) || !SNAP_ARRAY(s, clients, r->n_clients) ||
            !SNAP_ARRAY(s, devices, r->n_devices))
                return no_memory(client, s);
        for (size_t i = 0; i < r->n_groups; i++)
                if (group_stats(s, r->groups[i], &groups[i]) < 0)
                        return no_memory(client, s);
        for (size_t i = 0; i < r->n_clients; i++) {
                const Epd__V1__ClientStats *cs = r->clients[i];
                clients[i] = (struct epd_admin_client_stats){
                        .id = cs->id, .pid = cs->pid, .name = cs->name,
                        .requests = cs->requests, .ops = cs->ops,
                        .outstanding_ops = cs->outstanding_ops, .regions = cs->regions,
                        .region_bytes = cs->region_bytes,
                };
        }
        for (size_t i = 0; i < r->n_devices; i++) {
                const Epd__V1__DeviceStats *ds = r->devices[i];
                devices[i] = (struct epd_admin_device_stats){
                        .index = ds->index, .uuid = ds->uuid, .kind = ds->kind,
                        .ops = ds->ops, .bytes = ds->bytes, .ranks = ds->ranks,
                };
        }
        st->daemon = (struct epd_admin_daemon_stats){
                .backend = r->backend, .uptime_ms = r->uptime_ms,
                .ops_completed = r->ops_completed, .ops_failed = r->ops_failed,
                .frames_in = r->frames_in, .frames_out = r->frames_out,
                .protocol_errors = r->protocol_errors, .clients_accepted = r->clients_accepted,
                .clients_refused = r->clients_refused, .mailbox_replies = r->mailbox_replies,
                .mailbox_requests = r->mailbox_requests,
                .num_groups = count32(r->n_groups), .groups = groups,
                .num_clients = count32(r->n_clients), .clients = clients,
                .num_devices = count32(r->n_devices), .devices = devices,
        };
        *out = st;
        return 0;
}

const struct epd_admin_daemon_stats *epd_stats_daemon(const struct epd_stats *stats)
{
        return stats ? &stats->daemon : NULL;
}

void epd_stats_free(struct epd_stats *stats)
{
        snap_free((struct snapshot *)stats);
}

/* ---- admin verbs ---- */

/* A group named on the command line: its name, and its id too when it is a decimal number
 * (the daemon looks the name up first). */
static uint64_t group_id_of(const char *group)
{
        char *end;
        unsigned long long v;

        if (!group || group[0] < '0' || group[0] > '9')
                return 0;
        v = strtoull(group, &end, 10);
        return *end ? 0 : v;
}

static int drain_request(struct epd_client *client, int drain, const char *group,
                         struct epd_drain_result *out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Drain dm = EPD__V1__DRAIN__INIT;
        Epd__V1__Undrain um = EPD__V1__UNDRAIN__INIT;
        Epd__V1__Response *resp;
        int rc;

        if (!client)
                return EPD_INVALID_ARGUMENT;
        if (drain) {
                req.body_case = EPD__V1__REQUEST__BODY_DRAIN;
                req.drain = &dm;
                dm.all = group == NULL;
                dm.group_name = (char *)(group ? group : "");
                dm.group_id = group_id_of(group);
        } else {
                req.body_case = EPD__V1__REQUEST__BODY_UNDRAIN;
                req.undrain = &um;
                um.all = group == NULL;
                um.group_name = (char *)(group ? group : "");
                um.group_id = group_id_of(group);
        }
        if ((rc = epd__client_call(client, &req, NULL, 0, &resp, NULL)) < 0)
                return rc;
        const Epd__V1__DrainReply *r = resp->drain;
        if (out)
                *out = (struct epd_drain_result){ .groups = r->groups,
                                                  .executing_ops = r->executing_ops,
                                                  .waiting_ops = r->waiting_ops,
                                                  .daemon_draining = r->daemon_draining };
        epd__v1__response__free_unpacked(resp, NULL);
        return 0;
}

int epd_drain(struct epd_client *client, const char *group, struct epd_drain_result *out)
{
        return drain_request(client, 1, group, out);
}

int epd_undrain(struct epd_client *client, const char *group, struct epd_drain_result *out)
{
        return drain_request(client, 0, group, out);
}

int epd_evict(struct epd_client *client, uint64_t client_id)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Evict em = EPD__V1__EVICT__INIT;
        Epd__V1__Response *resp;
        int rc;

        if (!client)
                return EPD_INVALID_ARGUMENT;
        em.client_id = client_id;
        req.body_case = EPD__V1__REQUEST__BODY_EVICT;
        req.evict = &em;
        if ((rc = epd__client_call(client, &req, NULL, 0, &resp, NULL)) < 0)
                return rc;
        epd__v1__response__free_unpacked(resp, NULL);
        return 0;
}

int epd_resize(struct epd_client *client, const char *group, uint64_t bytes,
               struct epd_resize_result **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Resize rm = EPD__V1__RESIZE__INIT;
        struct epd_resize_result *res;
        struct epd_resize_rank *ranks;
        int rc;

        if (!client)
                return EPD_INVALID_ARGUMENT;
        if (!group)
                return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                        "epd_resize: name a group (its name or id)");
        if (bytes == 0)
                return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                        "epd_resize: an arena of 0 bytes; give the new size of "
                                        "each rank's arena");
        rm.group_name = (char *)group;
        rm.group_id = group_id_of(group);
        rm.bytes = bytes;
        req.body_case = EPD__V1__REQUEST__BODY_RESIZE;
        req.resize = &rm;
        if (!(res = snap_new(client, sizeof(*res), &req, &rc)))
                return rc;
        const Epd__V1__ResizeReply *r = res->snap.resp->resize;
        if (!SNAP_ARRAY(&res->snap, ranks, r->n_ranks))
                return no_memory(client, &res->snap);
        for (size_t i = 0; i < r->n_ranks; i++) {
                const Epd__V1__RankArenaSize *k = r->ranks[i];
                ranks[i] = (struct epd_resize_rank){
                        .rank = k->rank, .old_bytes = k->old_bytes, .new_bytes = k->new_bytes,
                        .segments = k->segments, .used_bytes = k->used_bytes,
                        .reserved_bytes = k->reserved_bytes,
                };
        }
        res->info = (struct epd_resize_info){
                .group_id = r->group_id, .requested_bytes = r->requested_bytes,
                .old_bytes = r->old_bytes, .new_bytes = r->new_bytes, .wait_ns = r->wait_ns,
                .num_ranks = count32(r->n_ranks), .ranks = ranks,
        };
        if (out)
                *out = res;
        else
                epd_resize_result_free(res);
        return 0;
}

const struct epd_resize_info *epd_resize_result_info(const struct epd_resize_result *result)
{
        return result ? &result->info : NULL;
}

void epd_resize_result_free(struct epd_resize_result *result)
{
        snap_free((struct snapshot *)result);
}
