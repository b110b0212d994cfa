/* report.c - the Stats request: a snapshot of every counter of the daemon, its groups, ranks,
 * clients and devices, for `epctl stats`, `epctl top` and the metrics endpoint. Loop thread. */
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "backend.h"
#include "budget.h"
#include "daemon.h"
#include "report.h"
#include "util.h"

/* Allocations of one snapshot, freed together. */
struct pool {
        void **ptrs;
        size_t n, cap;
        int failed;
};

static void *pool_alloc(struct pool *p, size_t bytes)
{
        void *m;

        if (p->failed)
                return NULL;
        if (p->n == p->cap) {
                size_t cap = p->cap ? p->cap * 2 : 64;
                void **n = realloc(p->ptrs, cap * sizeof(*n));
                if (!n) {
                        p->failed = 1;
                        return NULL;
                }
                p->ptrs = n;
                p->cap = cap;
        }
        m = calloc(1, bytes ? bytes : 1);
        if (!m) {
                p->failed = 1;
                return NULL;
        }
        p->ptrs[p->n++] = m;
        return m;
}

static Epd__V1__OpStats *op_stats(struct pool *p, const struct epdd_op_stats *s)
{
        Epd__V1__OpStats *o = pool_alloc(p, sizeof(*o));
        uint64_t *errors = pool_alloc(p, sizeof(uint64_t) * EPD_STATUS_COUNT);
        uint64_t *buckets = pool_alloc(p, sizeof(uint64_t) * EPD_LAT_BUCKETS);

        if (!o || !errors || !buckets)
                return NULL;
        epd__v1__op_stats__init(o);
        o->ops = s->ops;
        o->bytes = s->bytes;
        memcpy(errors, s->errors, sizeof(uint64_t) * EPD_STATUS_COUNT);
        o->n_errors = EPD_STATUS_COUNT;
        o->errors = errors;
        o->latency_p50_ns = epd_latency_quantile(&s->latency, 0.50);
        o->latency_p90_ns = epd_latency_quantile(&s->latency, 0.90);
        o->latency_p99_ns = epd_latency_quantile(&s->latency, 0.99);
        o->latency_max_ns = s->latency.max_ns;
        o->latency_count = s->latency.count;
        o->latency_sum_ns = s->latency.sum_ns;
        memcpy(buckets, s->latency.buckets, sizeof(uint64_t) * EPD_LAT_BUCKETS);
        o->n_latency_buckets = EPD_LAT_BUCKETS;
        o->latency_buckets = buckets;
        return o;
}

/* The group's stage histograms that hold at least one op (stats.h). */
static Epd__V1__OpStage **group_stages(struct pool *p, const struct epdd_group_stats *gs,
                                       size_t *n)
{
        Epd__V1__OpStage **v = pool_alloc(p, sizeof(*v) * 2 * EPD_STAGES);

        *n = 0;
        for (int k = 0; v && k < 2; k++) {
                for (int st = 0; st < EPD_STAGES; st++) {
                        const struct epdd_latency_hist *h = &gs->stage[k][st];
                        if (h->count == 0)
                                continue;
                        struct epdd_op_stats os = { .ops = h->count, .latency = *h };
                        Epd__V1__OpStage *o = pool_alloc(p, sizeof(*o));
                        if (!o)
                                return v;
                        epd__v1__op_stage__init(o);
                        o->op = (char *)epd_op_kind_names[k];
                        o->stage = (char *)epd_stage_names[st];
                        o->latency = op_stats(p, &os);
                        v[(*n)++] = o;
                }
        }
        return v;
}

static unsigned rank_queue_depth(const struct epdd_group *g, uint32_t rank)
{
        const struct epd_list *pos;
        unsigned n = 0;

        epd_list_for_each(pos, &g->ops)
        {
                const struct epdd_op *op = epd_list_entry(pos, struct epdd_op, link);
                if (op->subs && op->subs[rank].arrived && op->subs[rank].conn)
                        n++;
        }
        return n;
}

int epd_report_build(struct epdd_daemon *d, Epd__V1__StatsReply *out, struct epdd_report *mem)
{
        struct pool *p = calloc(1, sizeof(*p));
        struct epd_list *pos;
        size_t gi = 0, ci = 0;

        if (!p)
                return EPD_INTERNAL;
        mem->pool = p;
        epd__v1__stats_reply__init(out);
        out->uptime_ms = (epd__now_ns() - d->start_ns) / 1000000;
        out->ops_completed = d->stats.ops_completed;
        out->ops_failed = d->stats.ops_failed;
        out->frames_in = d->stats.frames_in;
        out->frames_out = d->stats.frames_out;
        out->mailbox_replies = d->stats.mailbox_replies;
        out->mailbox_requests = d->stats.mailbox_requests;
        out->protocol_errors = d->stats.protocol_errors;
        out->clients_accepted = d->stats.clients_accepted;
        out->clients_refused = d->stats.clients_refused;
        out->backend = (char *)d->backend->ops->name;

        out->groups = pool_alloc(p, sizeof(*out->groups) * (d->num_groups + 1));
        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                Epd__V1__GroupStats *gs = pool_alloc(p, sizeof(*gs));
                uint32_t R = g->cfg.world_size;
                const struct epd_list *op_pos;

                if (!gs || !out->groups || gi >= d->num_groups)
                        break;
                epd__v1__group_stats__init(gs);
                gs->id = g->id;
                gs->name = g->name;
                gs->state = (char *)epd_group_state_name(g->state);
                gs->world_size = R;
                gs->dispatch = op_stats(p, &g->stats.kind[0]);
                gs->combine = op_stats(p, &g->stats.kind[1]);
                gs->stages = group_stages(p, &g->stats, &gs->n_stages);
                gs->handles = g->num_handles;
                gs->memory_bytes = epd_budget_group_memory(g);
                gs->owner_uid = (uint32_t)g->owner_uid;
                epd_list_for_each(op_pos, &g->ops) gs->pending_ops++;
                gs->ranks = pool_alloc(p, sizeof(*gs->ranks) * R);
                for (uint32_t r = 0; gs->ranks && r < R; r++) {
                        const struct epdd_rank *rk = &g->ranks[r];
                        Epd__V1__RankStats *rs = pool_alloc(p, sizeof(*rs));
                        if (!rs)
                                break;
                        epd__v1__rank_stats__init(rs);
                        rs->rank = r;
                        rs->bound = rk->conn != NULL;
                        rs->client_id = rk->conn ? rk->conn->id : 0;
                        rs->device = rk->device;
                        rs->next_op = rk->next_op;
                        rs->dispatch = op_stats(p, &rk->stats.kind[0]);
                        rs->combine = op_stats(p, &rk->stats.kind[1]);
                        if (rk->arena) {
                                rs->arena_bytes = rk->arena->bytes;
                                rs->arena_used_bytes = epd_arena_used(rk->arena);
                        }
                        rs->queue_depth = rank_queue_depth(g, r);
                        if (g->cx) {
                                /* Client-executed: the rank's own ops counted in its buffer. */
                                struct cx_stats st;

                                epd_group_cx_stats(g, r, &st);
                                rs->client_ops = st.ops;
                                rs->client_rows = st.rows;
                                rs->client_bytes = st.bytes;
                                rs->client_failures = st.failures;
                                rs->client_buffer_bytes = g->cx->layout.total_bytes;
                                rs->client_kind_ops = pool_alloc(p, sizeof(st.kind_ops));
                                rs->client_phase_ns = pool_alloc(p, sizeof(st.phase_ns));
                                if (rs->client_kind_ops && rs->client_phase_ns) {
                                        memcpy(rs->client_kind_ops, st.kind_ops,
                                               sizeof(st.kind_ops));
                                        memcpy(rs->client_phase_ns, st.phase_ns,
                                               sizeof(st.phase_ns));
                                        rs->n_client_kind_ops = 2;
                                        rs->n_client_phase_ns = 2 * CX_PHASES;
                                }
                        }
                        gs->ranks[gs->n_ranks++] = rs;
                }
                out->groups[gi++] = gs;
        }
        out->n_groups = gi;

        out->clients = pool_alloc(p, sizeof(*out->clients) * (d->num_conns + 1));
        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_client *c = epd_list_entry(pos, struct epdd_client, link);
                Epd__V1__ClientStats *cs = pool_alloc(p, sizeof(*cs));
                if (!cs || !out->clients || ci >= d->num_conns)
                        break;
                epd__v1__client_stats__init(cs);
                cs->id = c->id;
                cs->pid = c->pid;
                cs->name = c->name;
                cs->requests = c->stats.requests;
                cs->ops = c->stats.ops;
                cs->outstanding_ops = c->outstanding_ops;
                cs->regions = c->num_regions;
                cs->region_bytes = c->region_bytes;
                out->clients[ci++] = cs;
        }
        out->n_clients = ci;

        unsigned nd = d->backend->num_devices < 64 ? d->backend->num_devices : 64;
        out->devices = pool_alloc(p, sizeof(*out->devices) * (nd + 1));
        for (unsigned i = 0; out->devices && i < nd; i++) {
                Epd__V1__DeviceStats *ds = pool_alloc(p, sizeof(*ds));
                if (!ds)
                        break;
                epd__v1__device_stats__init(ds);
                ds->index = i;
                ds->uuid = d->backend->devices[i].uuid;
                ds->kind = d->backend->devices[i].kind;
                ds->ops = d->stats.devices[i].ops;
                ds->bytes = d->stats.devices[i].bytes;
                epd_list_for_each(pos, &d->groups)
                {
                        struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                        for (uint32_t r = 0; r < g->cfg.world_size; r++)
                                ds->ranks += g->ranks[r].conn && g->ranks[r].device == i;
                }
                out->devices[out->n_devices++] = ds;
        }
        if (p->failed) {
                epd_report_free(mem);
                return EPD_INTERNAL;
        }
        return 0;
}

void epd_report_free(struct epdd_report *mem)
{
        struct pool *p = mem->pool;

        if (!p)
                return;
        for (size_t i = 0; i < p->n; i++)
                free(p->ptrs[i]);
        free(p->ptrs);
        free(p);
        mem->pool = NULL;
}

void epd_handle_stats(struct epdd_conn *c, const Epd__V1__Request *req)
{
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__StatsReply sr;
        struct epdd_report mem = { 0 };

        if (epd_report_build(c->cl.daemon, &sr, &mem) < 0) {
                epd_conn_reply_status(c, req->id, EPD_INTERNAL, "out of memory");
                return;
        }
        resp.id = req->id;
        resp.status = EPD__V1__STATUS_CODE__OK;
        resp.message = "";
        resp.body_case = EPD__V1__RESPONSE__BODY_STATS;
        resp.stats = &sr;
        (void)epd_conn_send(c, &resp, NULL, 0);
        epd_report_free(&mem);
}
