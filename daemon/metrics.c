/* metrics.c - Prometheus text exposition (format 0.0.4) of the daemon's counters on an optional
 * HTTP listener (README.md, "epctl"; [daemon] metrics_listen, --metrics-listen).
 *
 * Threads: libmicrohttpd serves HTTP on a thread of its own, but every counter belongs to the
 * loop thread. A request therefore asks the loop for a snapshot: it bumps a request number and
 * calls uv_async_send (the one cross-thread call into libuv), the loop renders the exposition
 * from epd_report_build and publishes it under the mutex, and the request thread, waiting on the
 * condition variable for at most SNAPSHOT_WAIT_MS, sends a copy. A loop that does not answer in
 * time (or a daemon that is stopping) gets 503, never a stale page.
 *
 * Names follow Prometheus conventions: epd_ prefix, base units (seconds, bytes), counters end in
 * _total, latency is a real histogram built from the daemon's power-of-two buckets. Device
 * labels are those of dcgm-exporter (gpu = index, UUID) so the two join.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "metrics.h"
#include "report.h"
#include "util.h"

#define SNAPSHOT_WAIT_MS 2000
#define MAX_EXPOSITION_BYTES (64u << 20)  /* a bound on the page, whatever the client count */
#define MAX_HTTP_CONNECTIONS 16
#define HTTP_TIMEOUT_S 10
#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct epdd_metrics {
        struct epdd_daemon *daemon;
        struct MHD_Daemon *mhd;
        uv_async_t async;
        char address[96];
        /* Shared with the HTTP thread, under lock. */
        pthread_mutex_t lock;
        pthread_cond_t cond;
        uint64_t requested;           /* number of the newest request for a snapshot */
        uint64_t answered;            /* the newest request number the loop has answered */
        char *text;                   /* the latest exposition, NULL when rendering failed */
        size_t text_len;
        int stopping;
};

/* ---- text buffer with a maximum size ---- */

struct textbuf {
        char *data;
        size_t len, cap;
        int failed;
};

static void tb_printf(struct textbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void tb_printf(struct textbuf *b, const char *fmt, ...)
{
        va_list ap;
        int n;

        if (b->failed)
                return;
        for (;;) {
                size_t room = b->cap - b->len;
                va_start(ap, fmt);
                n = vsnprintf(b->data ? b->data + b->len : NULL, room, fmt, ap);
                va_end(ap);
                if (n < 0) {
                        b->failed = 1;
                        return;
                }
                if ((size_t)n < room) {
                        b->len += (size_t)n;
                        return;
                }
                size_t cap = b->cap ? b->cap * 2 : 64 * 1024;
                while (cap < b->len + (size_t)n + 1)
                        cap *= 2;
                if (cap > MAX_EXPOSITION_BYTES) {
                        b->failed = 1;
                        return;
                }
                char *data = realloc(b->data, cap);
                if (!data) {
                        b->failed = 1;
                        return;
                }
                b->data = data;
                b->cap = cap;
        }
}

/* Length of the valid UTF-8 sequence at s, or 0 when the bytes there are not one. */
static size_t utf8_seq_len(const unsigned char *s)
{
        size_t n;

        if (s[0] < 0x80)
                return 1;
        if (s[0] >= 0xc2 && s[0] <= 0xdf)
                n = 2;
        else if (s[0] >= 0xe0 && s[0] <= 0xef)
                n = 3;
        else if (s[0] >= 0xf0 && s[0] <= 0xf4)
                n = 4;
        else
                return 0;
        for (size_t i = 1; i < n; i++)
                if ((s[i] & 0xc0) != 0x80)
                        return 0;
        return n;
}

/* Writes a label value as the text format wants it: backslash, double quote and line feed
 * escaped. Names come from clients, so bytes that are not UTF-8 become U+FFFD. */
static void escape_label(char *out, size_t out_len, const char *value)
{
        const unsigned char *s = (const unsigned char *)(value ? value : "");
        size_t o = 0;

        while (*s && o + 8 < out_len) {
                size_t n = utf8_seq_len(s);
                if (n == 0) {
                        memcpy(out + o, "\xef\xbf\xbd", 3);
                        o += 3;
                        s++;
                        continue;
                }
                if (*s == '\\' || *s == '"' || *s == '\n') {
                        out[o++] = '\\';
                        out[o++] = *s == '\n' ? 'n' : (char)*s;
                        s++;
                        continue;
                }
                memcpy(out + o, s, n);
                o += n;
                s += n;
        }
        out[o] = '\0';
}

static void family(struct textbuf *b, const char *name, const char *type, const char *help)
{
        tb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample_u64(struct textbuf *b, const char *name, const char *labels, uint64_t v)
{
        if (labels && labels[0])
                tb_printf(b, "%s{%s} %llu\n", name, labels, (unsigned long long)v);
        else
                tb_printf(b, "%s %llu\n", name, (unsigned long long)v);
}

static void sample_f64(struct textbuf *b, const char *name, const char *labels, double v)
{
        if (labels && labels[0])
                tb_printf(b, "%s{%s} %.9f\n", name, labels, v);
        else
                tb_printf(b, "%s %.9f\n", name, v);
}

/* ---- rendering (loop thread) ---- */

/* Groups on their way out (CLOSED, freed once their last op completes) are left out: a new
 * group may already carry the same name. */
static int group_listed(const Epd__V1__GroupStats *gs)
{
        return gs && strcmp(gs->state, "CLOSED") != 0;
}

static void group_labels(char *out, size_t out_len, const Epd__V1__GroupStats *gs)
{
        char name[256];

        escape_label(name, sizeof(name), gs->name);
        snprintf(out, out_len, "group=\"%s\"", name);
}

static void rank_labels(char *out, size_t out_len, const Epd__V1__GroupStats *gs,
                        const Epd__V1__RankStats *rs)
{
        char name[256];

        escape_label(name, sizeof(name), gs->name);
        snprintf(out, out_len, "group=\"%s\",rank=\"%u\"", name, rs->rank);
}


static const Epd__V1__OpStats *rank_kind(const Epd__V1__RankStats *rs, int kind)
{
        return kind == 0 ? rs->dispatch : rs->combine;
}

/* Calls fn for every rank of every listed group. */
#define for_each_rank(s, gs, rs)                                                        \
        for (size_t gi_ = 0; gi_ < (s)->n_groups; gi_++)                                \
                for (const Epd__V1__GroupStats *gs = (s)->groups[gi_]; group_listed(gs); \
                     gs = NULL)                                                         \
                        for (size_t ri_ = 0; ri_ < gs->n_ranks; ri_++)                  \
                                for (const Epd__V1__RankStats *rs = gs->ranks[ri_]; rs; rs = NULL)

static void render_daemon(struct textbuf *b, const struct epdd_daemon *d,
                          const Epd__V1__StatsReply *s)
{
        char labels[256], backend[64];

        family(b, "epd_up", "gauge", "1 while the daemon serves.");
        sample_u64(b, "epd_up", NULL, 1);
        family(b, "epd_build_info", "gauge", "The daemon's version, source revision and backend.");
        escape_label(backend, sizeof(backend), s->backend);
        snprintf(labels, sizeof(labels), "version=\"%s\",revision=\"%s\",backend=\"%s\"",
                 EPD_VERSION_STRING, epd_git_rev, backend);
        sample_u64(b, "epd_build_info", labels, 1);
        family(b, "epd_uptime_seconds", "gauge", "Seconds since the daemon started.");
        sample_f64(b, "epd_uptime_seconds", NULL, (double)s->uptime_ms / 1e3);
        family(b, "epd_draining", "gauge",
               "1 while an operator drain (epctl drain) stops the launching of ops daemon-wide.");
        sample_u64(b, "epd_draining", NULL, (uint64_t)d->draining);
        family(b, "epd_shutting_down", "gauge", "1 once the daemon is stopping.");
        sample_u64(b, "epd_shutting_down", NULL, (uint64_t)d->shutting_down);
        family(b, "epd_clients", "gauge", "Connected clients.");
        sample_u64(b, "epd_clients", NULL, s->n_clients);
        family(b, "epd_groups", "gauge", "Groups (not counting groups being destroyed).");
        uint64_t groups = 0;
        for (size_t i = 0; i < s->n_groups; i++)
                groups += group_listed(s->groups[i]);
        sample_u64(b, "epd_groups", NULL, groups);
        family(b, "epd_clients_accepted_total", "counter", "Client connections accepted.");
        sample_u64(b, "epd_clients_accepted_total", NULL, s->clients_accepted);
        family(b, "epd_clients_refused_total", "counter",
               "Client connections refused (allow lists, max_clients).");
        sample_u64(b, "epd_clients_refused_total", NULL, s->clients_refused);
        family(b, "epd_protocol_errors_total", "counter",
               "Malformed frames or requests; each closed its connection.");
        sample_u64(b, "epd_protocol_errors_total", NULL, s->protocol_errors);
        family(b, "epd_frames_received_total", "counter", "Request frames received.");
        sample_u64(b, "epd_frames_received_total", NULL, s->frames_in);
        family(b, "epd_frames_sent_total", "counter", "Response frames sent.");
        sample_u64(b, "epd_frames_sent_total", NULL, s->frames_out);
        family(b, "epd_mailbox_replies_total", "counter",
               "Op replies written into the rank's doorbell page instead of a frame.");
        sample_u64(b, "epd_mailbox_replies_total", NULL, s->mailbox_replies);
        family(b, "epd_mailbox_requests_total", "counter",
               "Op requests taken from the rank's doorbell page instead of a frame.");
        sample_u64(b, "epd_mailbox_requests_total", NULL, s->mailbox_requests);
        family(b, "epd_collective_ops_total", "counter",
               "Collective ops (one per op of a group, all ranks together) by result.");
        sample_u64(b, "epd_collective_ops_total", "result=\"completed\"", s->ops_completed);
        sample_u64(b, "epd_collective_ops_total", "result=\"failed\"", s->ops_failed);
}

/* A latency histogram from OpStats' power-of-two buckets: bucket i counts ops below 2^i
 * microseconds; the last is open-ended and becomes +Inf, which must equal the count. */
static void render_histogram(struct textbuf *b, const char *name, const char *labels,
                             const Epd__V1__OpStats *o)
{
        uint64_t cumulative = 0;

        for (size_t i = 0; i + 1 < o->n_latency_buckets; i++) {
                cumulative += o->latency_buckets[i];
                tb_printf(b, "%s_bucket{%s,le=\"%.9g\"} %llu\n", name, labels,
                          (double)(1ull << i) * 1e-6, (unsigned long long)cumulative);
        }
        tb_printf(b, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, labels,
                  (unsigned long long)o->latency_count);
        tb_printf(b, "%s_sum{%s} %.9f\n", name, labels, (double)o->latency_sum_ns / 1e9);
        tb_printf(b, "%s_count{%s} %llu\n", name, labels, (unsigned long long)o->latency_count);
}

static void render_groups(struct textbuf *b, const Epd__V1__StatsReply *s)
{
        static const char *const states[] = { "FORMING", "READY", "DRAINING", "BROKEN" };
        char labels[384];

        family(b, "epd_group_state", "gauge", "1 for the state the group is in, 0 for the others.");
        for (size_t g = 0; g < s->n_groups; g++) {
                const Epd__V1__GroupStats *gs = s->groups[g];
                if (!group_listed(gs))
                        continue;
                for (size_t i = 0; i < EPD_ARRAY_SIZE(states); i++) {
                        char l[320];
                        group_labels(l, sizeof(l), gs);
                        snprintf(labels, sizeof(labels), "%s,state=\"%s\"", l, states[i]);
                        sample_u64(b, "epd_group_state", labels, strcmp(gs->state, states[i]) == 0);
                }
        }
        family(b, "epd_group_world_size", "gauge", "Ranks of the group.");
        for (size_t g = 0; g < s->n_groups; g++) {
                if (!group_listed(s->groups[g]))
                        continue;
                group_labels(labels, sizeof(labels), s->groups[g]);
                sample_u64(b, "epd_group_world_size", labels, s->groups[g]->world_size);
        }
        family(b, "epd_group_pending_ops", "gauge",
               "Ops of the group not completed yet (collecting, queued or executing).");
        for (size_t g = 0; g < s->n_groups; g++) {
                if (!group_listed(s->groups[g]))
                        continue;
                group_labels(labels, sizeof(labels), s->groups[g]);
                sample_u64(b, "epd_group_pending_ops", labels, s->groups[g]->pending_ops);
        }
        family(b, "epd_group_memory_bytes", "gauge",
               "Memory the daemon holds for the group (output arenas, client-executed buffers), "
               "counted against max_group_bytes_per_uid of owner_uid, its creator.");
        for (size_t g = 0; g < s->n_groups; g++) {
                char l[448];

                if (!group_listed(s->groups[g]))
                        continue;
                group_labels(labels, sizeof(labels), s->groups[g]);
                snprintf(l, sizeof(l), "%s,owner_uid=\"%u\"", labels, s->groups[g]->owner_uid);
                sample_u64(b, "epd_group_memory_bytes", l, s->groups[g]->memory_bytes);
        }
        family(b, "epd_group_handles", "gauge", "Dispatch handles the group holds.");
        for (size_t g = 0; g < s->n_groups; g++) {
                if (!group_listed(s->groups[g]))
                        continue;
                group_labels(labels, sizeof(labels), s->groups[g]);
                sample_u64(b, "epd_group_handles", labels, s->groups[g]->handles);
        }
        family(b, "epd_op_stage_seconds", "histogram",
               "Where the group's successful ops spent their time: stage peers (first rank's "
               "request to the last rank's), daemon (last request read to last reply sent, "
               "less the GPU time), gpu (kernel time).");
        for (size_t g = 0; g < s->n_groups; g++) {
                const Epd__V1__GroupStats *gs = s->groups[g];
                if (!group_listed(gs))
                        continue;
                for (size_t i = 0; i < gs->n_stages; i++) {
                        const Epd__V1__OpStage *st = gs->stages[i];
                        char l[320];
                        if (!st->latency)
                                continue;
                        group_labels(l, sizeof(l), gs);
                        snprintf(labels, sizeof(labels), "%s,kind=\"%s\",stage=\"%s\"", l,
                                 st->op, st->stage);
                        render_histogram(b, "epd_op_stage_seconds", labels, st->latency);
                }
        }
}

static void render_ranks(struct textbuf *b, const Epd__V1__StatsReply *s)
{
        char base[320], labels[448];

        family(b, "epd_ops_total", "counter",
               "Ops of a rank by kind and final status (OK or the error it got).");
        for_each_rank(s, gs, rs)
        {
                rank_labels(base, sizeof(base), gs, rs);
                for (int k = 0; k < 2; k++) {
                        const Epd__V1__OpStats *o = rank_kind(rs, k);
                        if (!o)
                                continue;
                        snprintf(labels, sizeof(labels), "%s,kind=\"%s\",status=\"OK\"", base,
                                 epd_op_kind_names[k]);
                        sample_u64(b, "epd_ops_total", labels, o->ops);
                        /* Error series appear once they are non-zero. */
                        for (size_t e = 1; e < o->n_errors; e++) {
                                if (!o->errors[e])
                                        continue;
                                snprintf(labels, sizeof(labels), "%s,kind=\"%s\",status=\"%s\"",
                                         base, epd_op_kind_names[k], epd_status_name(-(int)e));
                                sample_u64(b, "epd_ops_total", labels, o->errors[e]);
                        }
                }
        }
        family(b, "epd_op_bytes_total", "counter", "Bytes moved by a rank's successful ops.");
        for_each_rank(s, gs, rs)
        {
                rank_labels(base, sizeof(base), gs, rs);
                for (int k = 0; k < 2; k++) {
                        const Epd__V1__OpStats *o = rank_kind(rs, k);
                        if (!o)
                                continue;
                        snprintf(labels, sizeof(labels), "%s,kind=\"%s\"", base,
                                 epd_op_kind_names[k]);
                        sample_u64(b, "epd_op_bytes_total", labels, o->bytes);
                }
        }
        family(b, "epd_op_latency_seconds", "histogram",
               "Time from a rank's submission of a successful op to its completion.");
        for_each_rank(s, gs, rs)
        {
                rank_labels(base, sizeof(base), gs, rs);
                for (int k = 0; k < 2; k++) {
                        const Epd__V1__OpStats *o = rank_kind(rs, k);
                        if (!o)
                                continue;
                        snprintf(labels, sizeof(labels), "%s,kind=\"%s\"", base,
                                 epd_op_kind_names[k]);
                        render_histogram(b, "epd_op_latency_seconds", labels, o);
                }
        }
        family(b, "epd_rank_bound", "gauge", "1 while a client holds the rank.");
        for_each_rank(s, gs, rs)
        {
                rank_labels(labels, sizeof(labels), gs, rs);
                sample_u64(b, "epd_rank_bound", labels, rs->bound);
        }
        family(b, "epd_rank_queue_depth", "gauge",
               "Ops the rank submitted that have not completed.");
        for_each_rank(s, gs, rs)
        {
                rank_labels(labels, sizeof(labels), gs, rs);
                sample_u64(b, "epd_rank_queue_depth", labels, rs->queue_depth);
        }
        family(b, "epd_arena_bytes", "gauge", "Size of the rank's output arena.");
        for_each_rank(s, gs, rs)
        {
                rank_labels(labels, sizeof(labels), gs, rs);
                sample_u64(b, "epd_arena_bytes", labels, rs->arena_bytes);
        }
        family(b, "epd_arena_used_bytes", "gauge",
               "Bytes of the rank's output arena held by live dispatch outputs.");
        for_each_rank(s, gs, rs)
        {
                rank_labels(labels, sizeof(labels), gs, rs);
                sample_u64(b, "epd_arena_used_bytes", labels, rs->arena_used_bytes);
        }
        /* Client-executed groups: the counters the ranks' own ops keep in their buffers. */
        static const struct {
                const char *name, *type, *help;
                size_t off;
        } cx_families[] = {
                { "epd_client_buffer_bytes", "gauge",
                  "Size of the rank's communication buffer (client-executed groups, else 0).",
                  offsetof(Epd__V1__RankStats, client_buffer_bytes) },
                { "epd_client_executed_ops_total", "counter",
                  "Client-executed ops of the rank that ended OK.",
                  offsetof(Epd__V1__RankStats, client_ops) },
                { "epd_client_executed_failed_ops_total", "counter",
                  "Client-executed ops of the rank that ended with another status.",
                  offsetof(Epd__V1__RankStats, client_failures) },
                { "epd_client_executed_rows_total", "counter",
                  "Rows the rank received (dispatch) or reduced (combine) in client-executed ops.",
                  offsetof(Epd__V1__RankStats, client_rows) },
                { "epd_client_executed_bytes_total", "counter",
                  "Payload bytes the rank wrote to destinations in client-executed ops.",
                  offsetof(Epd__V1__RankStats, client_bytes) },
        };
        for (size_t i = 0; i < sizeof(cx_families) / sizeof(cx_families[0]); i++) {
                family(b, cx_families[i].name, cx_families[i].type, cx_families[i].help);
                for_each_rank(s, gs, rs)
                {
                        rank_labels(labels, sizeof(labels), gs, rs);
                        sample_u64(b, cx_families[i].name, labels,
                                   *(const uint64_t *)((const char *)rs + cx_families[i].off));
                }
        }
        /* Where client-executed ops spend their time: per op kind, and per phase. */
        static const char *const ops[2] = { "dispatch", "combine" };
        static const char *const phases[3] = { "exchange", "move", "finish" };
        family(b, "epd_client_executed_kind_ops_total", "counter",
               "Client-executed ops of the rank that ended OK, by op.");
        for_each_rank(s, gs, rs)
        {
                for (size_t k = 0; k < rs->n_client_kind_ops && k < 2; k++) {
                        char l[512];

                        rank_labels(labels, sizeof(labels), gs, rs);
                        snprintf(l, sizeof(l), "%s,op=\"%s\"", labels, ops[k]);
                        sample_u64(b, "epd_client_executed_kind_ops_total", l,
                                   rs->client_kind_ops[k]);
                }
        }
        family(b, "epd_client_executed_phase_seconds_total", "counter",
               "Time of the rank's OK client-executed ops in each phase: to every rank's records "
               "exchanged (mostly waiting for the last peer), to every row moved, to every "
               "peer's end signals.");
        for_each_rank(s, gs, rs)
        {
                for (size_t i = 0; i < rs->n_client_phase_ns && i < 6; i++) {
                        char l[512];

                        rank_labels(labels, sizeof(labels), gs, rs);
                        snprintf(l, sizeof(l), "%s,op=\"%s\",phase=\"%s\"", labels, ops[i / 3],
                                 phases[i % 3]);
                        sample_f64(b, "epd_client_executed_phase_seconds_total", l,
                                   (double)rs->client_phase_ns[i] / 1e9);
                }
        }
}

static void client_labels(char *out, size_t out_len, const Epd__V1__ClientStats *cs)
{
        char name[256];

        escape_label(name, sizeof(name), cs->name);
        snprintf(out, out_len, "client=\"%llu\",name=\"%s\"", (unsigned long long)cs->id, name);
}

static void render_clients(struct textbuf *b, const Epd__V1__StatsReply *s)
{
        static const struct {
                const char *name, *type, *help;
                size_t offset;
                int is32;
        } fields[] = {
                { "epd_client_requests_total", "counter", "Requests the client sent.",
                  offsetof(Epd__V1__ClientStats, requests), 0 },
                { "epd_client_ops_total", "counter", "Rank ops the client submitted.",
                  offsetof(Epd__V1__ClientStats, ops), 0 },
                { "epd_client_outstanding_ops", "gauge", "The client's ops not answered yet.",
                  offsetof(Epd__V1__ClientStats, outstanding_ops), 1 },
                { "epd_client_regions", "gauge", "Memory regions the client registered.",
                  offsetof(Epd__V1__ClientStats, regions), 1 },
                { "epd_client_region_bytes", "gauge", "Bytes of the client's regions.",
                  offsetof(Epd__V1__ClientStats, region_bytes), 0 },
        };
        char labels[384];

        for (size_t f = 0; f < EPD_ARRAY_SIZE(fields); f++) {
                family(b, fields[f].name, fields[f].type, fields[f].help);
                for (size_t i = 0; i < s->n_clients; i++) {
                        const char *p = (const char *)s->clients[i] + fields[f].offset;
                        uint64_t v = fields[f].is32 ? *(const uint32_t *)p : *(const uint64_t *)p;
                        client_labels(labels, sizeof(labels), s->clients[i]);
                        sample_u64(b, fields[f].name, labels, v);
                }
        }
}

static void render_devices(struct textbuf *b, const Epd__V1__StatsReply *s)
{
        char labels[3][256];
        char uuid[160];

        for (int f = 0; f < 3; f++) {
                static const char *const names[] = { "epd_device_ops_total",
                                                     "epd_device_bytes_total", "epd_device_ranks" };
                static const char *const types[] = { "counter", "counter", "gauge" };
                static const char *const helps[] = {
                        "Rank ops executed for ranks on this device.",
                        "Bytes moved by ops of ranks on this device.",
                        "Bound ranks on this device.",
                };
                family(b, names[f], types[f], helps[f]);
                for (size_t i = 0; i < s->n_devices; i++) {
                        const Epd__V1__DeviceStats *ds = s->devices[i];
                        uint64_t v = f == 0 ? ds->ops : f == 1 ? ds->bytes : ds->ranks;
                        escape_label(uuid, sizeof(uuid), ds->uuid);
                        snprintf(labels[f], sizeof(labels[f]), "gpu=\"%u\",UUID=\"%s\"", ds->index,
                                 uuid);
                        sample_u64(b, names[f], labels[f], v);
                }
        }
}

int epd_metrics_render(struct epdd_daemon *d, char **text, size_t *len)
{
        Epd__V1__StatsReply s;
        struct epdd_report mem = { 0 };
        struct textbuf b = { 0 };

        if (epd_report_build(d, &s, &mem) < 0)
                return -ENOMEM;
        render_daemon(&b, d, &s);
        render_groups(&b, &s);
        render_ranks(&b, &s);
        render_clients(&b, &s);
        render_devices(&b, &s);
        epd_report_free(&mem);
        if (b.failed || !b.data) {
                free(b.data);
                return b.len + 1 >= MAX_EXPOSITION_BYTES ? -EFBIG : -ENOMEM;
        }
        *text = b.data;
        *len = b.len;
        return 0;
}

/* The loop's side: render for the newest request and wake the request threads. */
static void on_snapshot_wanted(uv_async_t *handle)
{
        struct epdd_metrics *m = handle->data;
        uint64_t want;
        char *text = NULL;
        size_t len = 0;

        pthread_mutex_lock(&m->lock);
        want = m->requested;
        pthread_mutex_unlock(&m->lock);
        if (want == m->answered)
                return;
        if (epd_metrics_render(m->daemon, &text, &len) < 0)
                text = NULL;
        pthread_mutex_lock(&m->lock);
        free(m->text);
        m->text = text;
        m->text_len = len;
        m->answered = want;
        pthread_cond_broadcast(&m->cond);
        pthread_mutex_unlock(&m->lock);
}

/* ---- HTTP (the server's thread) ---- */

static enum MHD_Result send_text(struct MHD_Connection *conn, unsigned code, const char *text)
{
        struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), (void *)text,
                                                                 MHD_RESPMEM_PERSISTENT);
        enum MHD_Result ret;

        if (!r)
                return MHD_NO;
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
        ret = MHD_queue_response(conn, code, r);
        MHD_destroy_response(r);
        return ret;
}

/* Asks the loop for a snapshot and waits for it. Returns a malloc'ed copy, or NULL with *code
 * the HTTP status to answer. */
static char *wait_snapshot(struct epdd_metrics *m, size_t *len, unsigned *code)
{
        struct timespec deadline;
        char *copy = NULL;
        uint64_t mine;

        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += SNAPSHOT_WAIT_MS / 1000;
        deadline.tv_nsec += (long)(SNAPSHOT_WAIT_MS % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
                deadline.tv_sec++;
                deadline.tv_nsec -= 1000000000L;
        }
        pthread_mutex_lock(&m->lock);
        *code = MHD_HTTP_SERVICE_UNAVAILABLE;
        if (m->stopping)
                goto out;
        mine = ++m->requested;
        pthread_mutex_unlock(&m->lock);
        uv_async_send(&m->async);
        pthread_mutex_lock(&m->lock);
        while (!m->stopping && m->answered < mine)
                if (pthread_cond_timedwait(&m->cond, &m->lock, &deadline) == ETIMEDOUT)
                        break;
        if (m->stopping || m->answered < mine)
                goto out;
        if (!m->text) {
                *code = MHD_HTTP_INTERNAL_SERVER_ERROR;
                goto out;
        }
        copy = malloc(m->text_len + 1);
        if (!copy) {
                *code = MHD_HTTP_INTERNAL_SERVER_ERROR;
                goto out;
        }
        memcpy(copy, m->text, m->text_len + 1);
        *len = m->text_len;
        *code = MHD_HTTP_OK;
out:
        pthread_mutex_unlock(&m->lock);
        return copy;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **req_cls)
{
        struct epdd_metrics *m = cls;
        struct MHD_Response *r;
        enum MHD_Result ret;
        unsigned code;
        size_t len = 0;
        char *text;

        (void)version;
        (void)upload_data;
        (void)req_cls;
        if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
                return send_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET and HEAD\n");
        if (*upload_data_size)
                return MHD_NO;
        if (strcmp(url, "/") == 0)
                return send_text(conn, MHD_HTTP_OK, "epd: metrics at /metrics\n");
        if (strcmp(url, "/metrics") != 0)
                return send_text(conn, MHD_HTTP_NOT_FOUND, "not found; metrics at /metrics\n");
        text = wait_snapshot(m, &len, &code);
        if (!text)
                return send_text(conn, code,
                                 code == MHD_HTTP_SERVICE_UNAVAILABLE
                                         ? "the daemon did not produce a snapshot in time\n"
                                         : "the daemon could not render its metrics\n");
        r = MHD_create_response_from_buffer_with_free_callback(len, text, free);
        if (!r) {
                free(text);
                return MHD_NO;
        }
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, CONTENT_TYPE);
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
        ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        return ret;
}

/* ---- start and stop (loop thread) ---- */

/* Splits "ADDR:PORT" or "[ADDR]:PORT" and resolves it (numeric or a host name such as
 * localhost). *res is freed with freeaddrinfo. */
static int resolve(const char *spec, struct addrinfo **res, char *err, size_t err_len)
{
        struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV };
        char host[256];
        const char *port, *colon;
        int rc;

        if (spec[0] == '[') {
                const char *close = strchr(spec, ']');
                if (!close || close[1] != ':' || (size_t)(close - spec - 1) >= sizeof(host)) {
                        snprintf(err, err_len, "metrics_listen '%s': expected [IPV6]:PORT", spec);
                        return -EINVAL;
                }
                memcpy(host, spec + 1, (size_t)(close - spec - 1));
                host[close - spec - 1] = '\0';
                port = close + 2;
                hints.ai_family = AF_INET6;
        } else {
                colon = strrchr(spec, ':');
                if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof(host) ||
                    memchr(spec, ':', (size_t)(colon - spec))) {
                        snprintf(err, err_len,
                                 "metrics_listen '%s': expected ADDR:PORT or [IPV6]:PORT", spec);
                        return -EINVAL;
                }
                memcpy(host, spec, (size_t)(colon - spec));
                host[colon - spec] = '\0';
                port = colon + 1;
        }
        char *end;
        unsigned long p = strtoul(port, &end, 10);
        if (!port[0] || *end || p > 65535) {
                snprintf(err, err_len, "metrics_listen '%s': bad port '%s'", spec, port);
                return -EINVAL;
        }
        rc = getaddrinfo(host, port, &hints, res);
        if (rc != 0) {
                snprintf(err, err_len, "metrics_listen '%s': %s", spec, gai_strerror(rc));
                return -EINVAL;
        }
        return 0;
}

static int open_listener(const char *spec, char *address, size_t address_len, int *family_out,
                         char *err, size_t err_len)
{
        struct addrinfo *res = NULL;
        struct sockaddr_storage ss;
        socklen_t ss_len = sizeof(ss);
        char host[INET6_ADDRSTRLEN];
        int fd, one = 1, rc;

        rc = resolve(spec, &res, err, err_len);
        if (rc < 0)
                return rc;
        fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
                goto sys_fail;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (res->ai_family == AF_INET6)
                setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
        if (bind(fd, res->ai_addr, res->ai_addrlen) < 0 || listen(fd, 64) < 0 ||
            getsockname(fd, (struct sockaddr *)&ss, &ss_len) < 0)
                goto sys_fail;
        if (ss.ss_family == AF_INET6) {
                const struct sockaddr_in6 *sa = (const struct sockaddr_in6 *)&ss;
                inet_ntop(AF_INET6, &sa->sin6_addr, host, sizeof(host));
                snprintf(address, address_len, "[%s]:%u", host, ntohs(sa->sin6_port));
        } else {
                const struct sockaddr_in *sa = (const struct sockaddr_in *)&ss;
                inet_ntop(AF_INET, &sa->sin_addr, host, sizeof(host));
                snprintf(address, address_len, "%s:%u", host, ntohs(sa->sin_port));
        }
        *family_out = ss.ss_family;
        freeaddrinfo(res);
        return fd;
sys_fail:
        rc = -errno;
        snprintf(err, err_len, "metrics_listen '%s': %s", spec, strerror(errno));
        if (fd >= 0)
                close(fd);
        freeaddrinfo(res);
        return rc;
}

int epd_metrics_start(struct epdd_daemon *d, const char *spec, struct epdd_metrics **out,
                      char *err, size_t err_len)
{
        struct epdd_metrics *m;
        pthread_condattr_t ca;
        int fd, family = AF_INET;

        m = calloc(1, sizeof(*m));
        if (!m) {
                snprintf(err, err_len, "out of memory");
                return -ENOMEM;
        }
        m->daemon = d;
        fd = open_listener(spec, m->address, sizeof(m->address), &family, err, err_len);
        if (fd < 0) {
                free(m);
                return fd;
        }
        pthread_mutex_init(&m->lock, NULL);
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&m->cond, &ca);
        pthread_condattr_destroy(&ca);
        uv_async_init(d->loop, &m->async, on_snapshot_wanted);
        m->async.data = m;
        /* From here on the server owns the listening socket (it closes it when stopped). */
        m->mhd = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO |
                                          (family == AF_INET6 ? MHD_USE_IPv6 : 0),
                                  0, NULL, NULL, on_request, m, MHD_OPTION_LISTEN_SOCKET, fd,
                                  MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_HTTP_CONNECTIONS,
                                  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_TIMEOUT_S,
                                  MHD_OPTION_END);
        if (!m->mhd) {
                snprintf(err, err_len, "metrics_listen '%s': cannot start the HTTP server",
                         spec);
                m->stopping = 1;
                epd_metrics_stop(m);
                return -EINVAL;
        }
        *out = m;
        return 0;
}

const char *epd_metrics_address(const struct epdd_metrics *m)
{
        return m->address;
}

static void on_async_closed(uv_handle_t *handle)
{
        struct epdd_metrics *m = handle->data;

        pthread_cond_destroy(&m->cond);
        pthread_mutex_destroy(&m->lock);
        free(m->text);
        free(m);
}

void epd_metrics_stop(struct epdd_metrics *m)
{
        if (!m)
                return;
        /* Wake every request thread first: MHD_stop_daemon joins the server's thread. */
        pthread_mutex_lock(&m->lock);
        m->stopping = 1;
        pthread_cond_broadcast(&m->cond);
        pthread_mutex_unlock(&m->lock);
        if (m->mhd)
                MHD_stop_daemon(m->mhd);
        m->mhd = NULL;
        uv_close((uv_handle_t *)&m->async, on_async_closed);
}
