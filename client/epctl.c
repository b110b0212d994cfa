/* epctl - the control CLI of epd: status, groups, clients, stats (human tables or --json), top
 * (a live view), and the admin verbs drain, undrain, evict and resize. It uses only the public
 * API of include/epd.h (its administration calls). */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <termios.h>
#include <unistd.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epd.h"

static const char *dtype_name(int d)
{
        switch (d) {
        case EPD_DTYPE_BF16: return "bf16";
        case EPD_DTYPE_FP8_E4M3: return "fp8_e4m3";
        default: return "invalid";
        }
}

static void usage(FILE *f)
{
        fprintf(f,
                "Usage: epctl [--socket PATH] COMMAND [ARG] [--json]\n"
                "Commands:\n"
                "  status    daemon version, backend, devices, groups and clients\n"
                "  groups    groups with their state and ranks\n"
                "  clients   connected clients with their regions and bindings\n"
                "  stats     per group, rank, client and device: ops, bytes, errors, latency\n"
                "  top       live view of the stats, refreshed every second (q or Ctrl-C quits)\n"
                "  drain [GROUP]    stop launching ops of GROUP (name or id), or of the daemon\n"
                "  undrain [GROUP]  resume GROUP, or the daemon and every drained group\n"
                "  evict CLIENT_ID  disconnect a client as if it had crashed\n"
                "  resize GROUP --bytes N  grow or shrink GROUP's per-rank output arenas to N\n"
                "                   bytes (K/M/G/T suffixes) with its ops drained meanwhile\n"
                "  (drain, undrain, evict and resize need root or the daemon's admin_group)\n"
                "Options:\n"
                "  -s, --socket PATH   daemon socket (default $EPD_SOCKET or /run/epd/epd.sock)\n"
                "  -j, --json          print JSON instead of a table\n"
                "  -n, --iterations N  top: stop after N refreshes\n"
                "  -d, --delay MS      top: refresh interval (default 1000)\n"
                "  -b, --bytes N       resize: the new arena size per rank\n"
                "  -h, --help          this text\n");
}

/* Prints why a call failed; returns 1, epctl's exit status for it. */
static int failed(struct epd_client *c, int rc)
{
        fprintf(stderr, "epctl: %s: %s\n", epd_status_name(rc), epd_client_last_error(c));
        return 1;
}

static json_t *device_json(const struct epd_admin_device *d)
{
        return json_pack("{s:I, s:s, s:s, s:s, s:I}", "index", (json_int_t)d->index, "uuid",
                         d->uuid, "name", d->name, "kind", d->kind, "memory_bytes",
                         (json_int_t)d->memory_bytes);
}

static int cmd_status(struct epd_client *c, int json)
{
        struct epd_daemon_status *st;
        int rc;

        if ((rc = epd_daemon_status_get(c, &st)) < 0)
                return failed(c, rc);
        const struct epd_daemon_status_info *s = epd_daemon_status_info(st);
        if (json) {
                char epoch[24];
                snprintf(epoch, sizeof(epoch), "%016llx", (unsigned long long)s->daemon_epoch);
                json_t *devs = json_array();
                for (uint32_t i = 0; i < s->num_devices; i++)
                        json_array_append_new(devs, device_json(&s->devices[i]));
                json_t *o = json_pack(
                        "{s:s, s:s, s:s, s:I, s:i, s:o, s:I, s:I, s:I, s:I, s:I, s:I, s:b}",
                        "version", s->version, "backend", s->backend, "daemon_epoch", epoch, "uptime_ms", (json_int_t)s->uptime_ms, "pid",
                        s->pid, "devices", devs, "groups", (json_int_t)s->num_groups, "clients",
                        (json_int_t)s->num_clients, "regions", (json_int_t)s->num_regions,
                        "region_bytes", (json_int_t)s->region_bytes, "ops_completed",
                        (json_int_t)s->ops_completed, "ops_failed", (json_int_t)s->ops_failed,
                        "draining", s->draining);
                json_dumpf(o, stdout, JSON_INDENT(2));
                putchar('\n');
                json_decref(o);
        } else {
                printf("epd %s  pid %d  backend %s  uptime %.1f s%s\n", s->version, s->pid,
                       s->backend, s->uptime_ms / 1000.0, s->draining ? "  DRAINING" : "");
                printf("clients %u  groups %u  regions %u (%llu bytes)  ops %llu ok / %llu failed\n",
                       s->num_clients, s->num_groups, s->num_regions,
                       (unsigned long long)s->region_bytes, (unsigned long long)s->ops_completed,
                       (unsigned long long)s->ops_failed);
                printf("%-4s %-6s %-48s %s\n", "DEV", "KIND", "UUID", "NAME");
                for (uint32_t i = 0; i < s->num_devices; i++)
                        printf("%-4u %-6s %-48s %s\n", s->devices[i].index, s->devices[i].kind,
                               s->devices[i].uuid, s->devices[i].name);
        }
        epd_daemon_status_free(st);
        return 0;
}

static int cmd_groups(struct epd_client *c, int json)
{
        struct epd_group_list *list;
        int rc;

        if ((rc = epd_group_list_get(c, &list)) < 0)
                return failed(c, rc);
        size_t n = epd_group_list_count(list);
        if (json) {
                json_t *arr = json_array();
                for (size_t i = 0; i < n; i++) {
                        const struct epd_group_info *g = epd_group_list_at(list, i);
                        const struct epd_group_config *cfg = &g->config;
                        json_t *ranks = json_array();
                        for (uint32_t k = 0; k < g->num_ranks; k++) {
                                const struct epd_admin_rank *ri = &g->ranks[k];
                                json_array_append_new(
                                        ranks, json_pack("{s:I, s:b, s:I, s:I, s:I}", "rank",
                                                         (json_int_t)ri->rank, "bound", ri->bound,
                                                         "client_id", (json_int_t)ri->client_id,
                                                         "device", (json_int_t)ri->device,
                                                         "next_op", (json_int_t)ri->next_op));
                        }
                        json_t *obj =
                                json_pack("{s:I, s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:s, s:I, s:I, s:I, s:I, s:I, s:o}",
                                          "id", (json_int_t)g->id, "name", g->name, "state",
                                          g->state, "world_size", (json_int_t)cfg->world_size,
                                          "num_experts", (json_int_t)cfg->num_experts, "hidden",
                                          (json_int_t)cfg->hidden, "max_tokens_per_rank",
                                          (json_int_t)cfg->max_tokens_per_rank, "max_topk",
                                          (json_int_t)cfg->max_topk, "dispatch_dtype",
                                          dtype_name(cfg->dispatch_dtype), "arena_bytes",
                                          (json_int_t)cfg->arena_bytes, "ops_completed",
                                          (json_int_t)g->ops_completed, "ops_failed",
                                          (json_int_t)g->ops_failed, "handles",
                                          (json_int_t)g->num_handles, "pending_ops",
                                          (json_int_t)g->pending_ops, "ranks", ranks);
                        json_object_set_new(obj, "execution",
                                            json_string(cfg->execution == EPD_EXECUTION_CLIENT
                                                                ? "client"
                                                                : "daemon"));
                        json_object_set_new(obj, "client_buffer_bytes_per_rank",
                                            json_integer((json_int_t)
                                                                 g->client_buffer_bytes_per_rank));
                        json_object_set_new(obj, "recv_rows",
                                            json_integer((json_int_t)cfg->recv_rows));
                        json_object_set_new(obj, "owner_uid", json_integer(g->owner_uid));
                        json_object_set_new(obj, "memory_bytes",
                                            json_integer((json_int_t)g->memory_bytes));
                        json_array_append_new(arr, obj);
                }
                json_dumpf(arr, stdout, JSON_INDENT(2));
                putchar('\n');
                json_decref(arr);
        } else {
                printf("%-4s %-20s %-9s %5s %7s %6s %6s %-8s %10s %8s %7s %5s %9s %s\n", "ID",
                       "NAME", "STATE", "RANKS", "EXPERTS", "HIDDEN", "TOKENS", "DTYPE", "OPS",
                       "FAILED", "HANDLES", "BOUND", "MEM_MIB", "OWNER");
                for (size_t i = 0; i < n; i++) {
                        const struct epd_group_info *g = epd_group_list_at(list, i);
                        unsigned bound = 0;
                        for (uint32_t k = 0; k < g->num_ranks; k++)
                                bound += g->ranks[k].bound;
                        char ranks_bound[24];

                        snprintf(ranks_bound, sizeof(ranks_bound), "%u/%u", bound, g->num_ranks);
                        printf("%-4llu %-20s %-9s %5u %7u %6u %6u %-8s %10llu %8llu %7u %5s %9.1f "
                               "%u\n",
                               (unsigned long long)g->id, g->name, g->state,
                               g->config.world_size, g->config.num_experts, g->config.hidden,
                               g->config.max_tokens_per_rank,
                               dtype_name(g->config.dispatch_dtype),
                               (unsigned long long)g->ops_completed,
                               (unsigned long long)g->ops_failed, g->num_handles, ranks_bound,
                               g->memory_bytes / 1048576.0, g->owner_uid);
                        if (g->config.execution == EPD_EXECUTION_CLIENT)
                                printf("%-4s client-executed: %.1f MiB buffer per rank, %u "
                                       "receive rows\n", "",
                                       g->client_buffer_bytes_per_rank / 1048576.0,
                                       g->config.recv_rows);
                }
        }
        epd_group_list_free(list);
        return 0;
}

static int cmd_clients(struct epd_client *c, int json)
{
        struct epd_client_list *list;
        int rc;

        if ((rc = epd_client_list_get(c, &list)) < 0)
                return failed(c, rc);
        size_t n = epd_client_list_count(list);
        if (json) {
                json_t *arr = json_array();
                for (size_t i = 0; i < n; i++) {
                        const struct epd_client_info *ci = epd_client_list_at(list, i);
                        json_t *b = json_array();
                        for (uint32_t k = 0; k < ci->num_bindings; k++)
                                json_array_append_new(b, json_string(ci->bindings[k]));
                        json_array_append_new(
                                arr, json_pack("{s:I, s:i, s:I, s:I, s:s, s:I, s:I, s:I, s:o}",
                                               "id", (json_int_t)ci->id, "pid", ci->pid, "uid",
                                               (json_int_t)ci->uid, "gid", (json_int_t)ci->gid,
                                               "name", ci->name, "regions",
                                               (json_int_t)ci->num_regions, "region_bytes",
                                               (json_int_t)ci->region_bytes, "outstanding_ops",
                                               (json_int_t)ci->outstanding_ops, "bindings", b));
                }
                json_dumpf(arr, stdout, JSON_INDENT(2));
                putchar('\n');
                json_decref(arr);
        } else {
                printf("%-6s %-8s %-6s %-16s %7s %14s %5s %s\n", "ID", "PID", "UID", "NAME",
                       "REGIONS", "BYTES", "OPS", "BINDINGS");
                for (size_t i = 0; i < n; i++) {
                        const struct epd_client_info *ci = epd_client_list_at(list, i);
                        printf("%-6llu %-8d %-6u %-16s %7u %14llu %5u ", (unsigned long long)ci->id,
                               ci->pid, ci->uid, ci->name[0] ? ci->name : "-", ci->num_regions,
                               (unsigned long long)ci->region_bytes, ci->outstanding_ops);
                        for (uint32_t k = 0; k < ci->num_bindings; k++)
                                printf("%s%s", k ? "," : "", ci->bindings[k]);
                        printf("%s\n", ci->num_bindings ? "" : "-");
                }
        }
        epd_client_list_free(list);
        return 0;
}


static json_t *op_stats_json(const struct epd_admin_op_stats *o)
{
        json_t *errors = json_object();

        for (uint32_t i = 1; i < o->num_errors; i++)
                if (o->errors[i])
                        json_object_set_new(errors, epd_status_name(-(int)i),
                                            json_integer((json_int_t)o->errors[i]));
        return json_pack("{s:I, s:I, s:o, s:I, s:I, s:I, s:I, s:I, s:I}", "ops",
                         (json_int_t)o->ops, "bytes", (json_int_t)o->bytes, "errors", errors,
                         "latency_p50_ns", (json_int_t)o->latency_p50_ns, "latency_p90_ns",
                         (json_int_t)o->latency_p90_ns, "latency_p99_ns",
                         (json_int_t)o->latency_p99_ns, "latency_max_ns",
                         (json_int_t)o->latency_max_ns, "latency_count",
                         (json_int_t)o->latency_count, "latency_sum_ns",
                         (json_int_t)o->latency_sum_ns);
}

static struct epd_stats *fetch_stats(struct epd_client *c)
{
        struct epd_stats *st;
        int rc;

        if ((rc = epd_stats_get(c, &st)) < 0) {
                failed(c, rc);
                return NULL;
        }
        return st;
}

static uint64_t errors_total(const struct epd_admin_op_stats *o)
{
        uint64_t n = 0;

        for (uint32_t i = 1; i < o->num_errors; i++)
                n += o->errors[i];
        return n;
}

static void print_stats_table(const struct epd_admin_daemon_stats *s,
                              const struct epd_admin_daemon_stats *prev, double dt)
{
        printf("epd  backend %s  uptime %.1f s  ops %llu ok / %llu failed  clients %u  requests "
               "%llu framed / %llu in doorbell pages  replies %llu framed / %llu in doorbell "
               "pages\n",
               s->backend, s->uptime_ms / 1000.0, (unsigned long long)s->ops_completed,
               (unsigned long long)s->ops_failed, s->num_clients, (unsigned long long)s->frames_in,
               (unsigned long long)s->mailbox_requests, (unsigned long long)s->frames_out,
               (unsigned long long)s->mailbox_replies);
        printf("%-16s %4s %5s %9s %8s %8s %8s %9s %8s %8s %6s %5s %12s\n", "GROUP", "RANK", "DEV",
               "DISPATCH", "/s", "p50[us]", "p99[us]", "COMBINE", "p50[us]", "p99[us]", "ERR",
               "QUEUE", "ARENA[MiB]");
        for (uint32_t g = 0; g < s->num_groups; g++) {
                const struct epd_admin_group_stats *gs = &s->groups[g];
                const struct epd_admin_group_stats *pg = NULL;
                for (uint32_t k = 0; prev && k < prev->num_groups; k++)
                        if (prev->groups[k].id == gs->id)
                                pg = &prev->groups[k];
                for (uint32_t r = 0; r < gs->num_ranks; r++) {
                        const struct epd_admin_rank_stats *rs = &gs->ranks[r];
                        double rate = 0;
                        if (pg && r < pg->num_ranks && dt > 0)
                                rate = (double)(rs->dispatch->ops + rs->combine->ops -
                                                pg->ranks[r].dispatch->ops -
                                                pg->ranks[r].combine->ops) / dt;
                        printf("%-16.16s %4u %5u %9llu %8.0f %8.1f %8.1f %9llu %8.1f %8.1f %6llu %5u %5.1f/%-6.1f\n",
                               r ? "" : gs->name, rs->rank, rs->device,
                               (unsigned long long)rs->dispatch->ops, rate,
                               rs->dispatch->latency_p50_ns / 1e3,
                               rs->dispatch->latency_p99_ns / 1e3,
                               (unsigned long long)rs->combine->ops,
                               rs->combine->latency_p50_ns / 1e3,
                               rs->combine->latency_p99_ns / 1e3,
                               (unsigned long long)(errors_total(rs->dispatch) +
                                                    errors_total(rs->combine)),
                               rs->queue_depth, rs->arena_used_bytes / 1048576.0,
                               rs->arena_bytes / 1048576.0);
                        if (rs->client_buffer_bytes) {
                                printf("%-16s client-executed: ops %llu failed %llu rows %llu "
                                       "bytes %llu buffer %.1f MiB\n", "",
                                       (unsigned long long)rs->client_ops,
                                       (unsigned long long)rs->client_failures,
                                       (unsigned long long)rs->client_rows,
                                       (unsigned long long)rs->client_bytes,
                                       rs->client_buffer_bytes / 1048576.0);
                                /* Mean us per OK op: exchange / move / finish. */
                                for (int k = 0; k < 2; k++) {
                                        double n = (double)rs->client_kind_ops[k];

                                        if (!rs->client_kind_ops[k])
                                                continue;
                                        printf("%-16s   %s phases exchange/move/finish[us]: "
                                               "%.1f/%.1f/%.1f\n", "",
                                               k ? "combine" : "dispatch",
                                               rs->client_phase_ns[k][0] / 1e3 / n,
                                               rs->client_phase_ns[k][1] / 1e3 / n,
                                               rs->client_phase_ns[k][2] / 1e3 / n);
                                }
                        }
                }
                /* Where the group's ops spent their time (p50/p99 us per stage). */
                if (gs->num_stages > 0) {
                        printf("%-16s stages p50/p99[us]:", "");
                        for (uint32_t i = 0; i < gs->num_stages; i++) {
                                const struct epd_admin_stage_stats *st = &gs->stages[i];
                                printf(" %s %s %.1f/%.1f", st->op, st->stage,
                                       st->latency->latency_p50_ns / 1e3,
                                       st->latency->latency_p99_ns / 1e3);
                        }
                        printf("\n");
                }
        }
        printf("%-6s %-44s %6s %12s %14s\n", "DEV", "UUID", "RANKS", "RANK-OPS", "BYTES");
        for (uint32_t i = 0; i < s->num_devices; i++)
                printf("%-6u %-44s %6u %12llu %14llu\n", s->devices[i].index, s->devices[i].uuid,
                       s->devices[i].ranks, (unsigned long long)s->devices[i].ops,
                       (unsigned long long)s->devices[i].bytes);
}

static int cmd_stats(struct epd_client *c, int json)
{
        struct epd_stats *st = fetch_stats(c);

        if (!st)
                return 1;
        const struct epd_admin_daemon_stats *s = epd_stats_daemon(st);
        if (!json) {
                print_stats_table(s, NULL, 0);
                epd_stats_free(st);
                return 0;
        }
        json_t *groups = json_array(), *clients = json_array(), *devices = json_array();
        for (uint32_t g = 0; g < s->num_groups; g++) {
                const struct epd_admin_group_stats *gs = &s->groups[g];
                json_t *ranks = json_array();
                for (uint32_t r = 0; r < gs->num_ranks; r++) {
                        const struct epd_admin_rank_stats *rs = &gs->ranks[r];
                        json_t *robj =
                                json_pack("{s:I, s:b, s:I, s:I, s:o, s:o, s:I, s:I, s:I, s:I}",
                                                 "rank", (json_int_t)rs->rank, "bound", rs->bound,
                                                 "client_id", (json_int_t)rs->client_id, "device",
                                                 (json_int_t)rs->device, "dispatch",
                                                 op_stats_json(rs->dispatch), "combine",
                                                 op_stats_json(rs->combine), "arena_bytes",
                                                 (json_int_t)rs->arena_bytes, "arena_used_bytes",
                                                 (json_int_t)rs->arena_used_bytes, "queue_depth",
                                                 (json_int_t)rs->queue_depth, "next_op",
                                                 (json_int_t)rs->next_op);
                        if (rs->client_buffer_bytes) {
                                json_t *cl = json_pack(
                                        "{s:I, s:I, s:I, s:I, s:I}", "ops",
                                        (json_int_t)rs->client_ops, "failures",
                                        (json_int_t)rs->client_failures, "rows",
                                        (json_int_t)rs->client_rows, "bytes",
                                        (json_int_t)rs->client_bytes, "buffer_bytes",
                                        (json_int_t)rs->client_buffer_bytes);
                                static const char *const kinds[2] = { "dispatch", "combine" };
                                json_t *ph = json_object();

                                for (int k = 0; k < 2; k++)
                                        json_object_set_new(
                                                ph, kinds[k],
                                                json_pack("{s:I, s:I, s:I, s:I}", "ops",
                                                          (json_int_t)rs->client_kind_ops[k],
                                                          "exchange_ns",
                                                          (json_int_t)rs->client_phase_ns[k][0],
                                                          "move_ns",
                                                          (json_int_t)rs->client_phase_ns[k][1],
                                                          "finish_ns",
                                                          (json_int_t)rs->client_phase_ns[k][2]));
                                json_object_set_new(cl, "phases", ph);
                                json_object_set_new(robj, "client", cl);
                        }
                        json_array_append_new(ranks, robj);
                }
                json_t *stages = json_array();
                for (uint32_t i = 0; i < gs->num_stages; i++)
                        json_array_append_new(stages,
                                              json_pack("{s:s, s:s, s:o}", "op", gs->stages[i].op,
                                                        "stage", gs->stages[i].stage, "latency",
                                                        op_stats_json(gs->stages[i].latency)));
                json_array_append_new(
                        groups, json_pack("{s:I, s:s, s:s, s:I, s:o, s:o, s:I, s:I, s:o, s:o}",
                                          "id", (json_int_t)gs->id, "name", gs->name, "state",
                                          gs->state, "world_size", (json_int_t)gs->world_size,
                                          "dispatch", op_stats_json(gs->dispatch), "combine",
                                          op_stats_json(gs->combine), "pending_ops",
                                          (json_int_t)gs->pending_ops, "handles",
                                          (json_int_t)gs->handles, "stages", stages, "ranks",
                                          ranks));
        }
        for (uint32_t i = 0; i < s->num_clients; i++) {
                const struct epd_admin_client_stats *cs = &s->clients[i];
                json_array_append_new(
                        clients, json_pack("{s:I, s:i, s:s, s:I, s:I, s:I, s:I, s:I}", "id",
                                           (json_int_t)cs->id, "pid", cs->pid, "name", cs->name,
                                           "requests", (json_int_t)cs->requests, "ops",
                                           (json_int_t)cs->ops, "outstanding_ops",
                                           (json_int_t)cs->outstanding_ops, "regions",
                                           (json_int_t)cs->regions, "region_bytes",
                                           (json_int_t)cs->region_bytes));
        }
        for (uint32_t i = 0; i < s->num_devices; i++) {
                const struct epd_admin_device_stats *ds = &s->devices[i];
                json_array_append_new(devices,
                                      json_pack("{s:I, s:s, s:s, s:I, s:I, s:I}", "index",
                                                (json_int_t)ds->index, "uuid", ds->uuid, "kind",
                                                ds->kind, "ranks", (json_int_t)ds->ranks, "ops",
                                                (json_int_t)ds->ops, "bytes",
                                                (json_int_t)ds->bytes));
        }
        json_t *o = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, "
                              "s:o, s:o, s:o}",
                              "backend", s->backend, "uptime_ms", (json_int_t)s->uptime_ms,
                              "ops_completed", (json_int_t)s->ops_completed, "ops_failed",
                              (json_int_t)s->ops_failed, "protocol_errors",
                              (json_int_t)s->protocol_errors, "clients_accepted",
                              (json_int_t)s->clients_accepted, "clients_refused",
                              (json_int_t)s->clients_refused, "frames_out",
                              (json_int_t)s->frames_out, "mailbox_replies",
                              (json_int_t)s->mailbox_replies, "frames_in",
                              (json_int_t)s->frames_in, "mailbox_requests",
                              (json_int_t)s->mailbox_requests, "groups", groups, "clients",
                              clients, "devices", devices);
        json_dumpf(o, stdout, JSON_INDENT(2));
        putchar('\n');
        json_decref(o);
        epd_stats_free(st);
        return 0;
}

static volatile sig_atomic_t top_stop;

static void on_top_signal(int sig)
{
        (void)sig;
        top_stop = 1;
}

/* A live view like top(1): clear, print, sleep; q on a terminal or SIGINT/SIGTERM quits. */
static int cmd_top(struct epd_client *c, long iterations, long delay_ms)
{
        struct epd_stats *prev = NULL;
        struct termios saved;
        int tty = isatty(STDIN_FILENO);

        signal(SIGINT, on_top_signal);
        signal(SIGTERM, on_top_signal);
        if (tty && tcgetattr(STDIN_FILENO, &saved) == 0) {
                struct termios raw = saved;
                raw.c_lflag &= (tcflag_t) ~(ICANON | ECHO);
                tcsetattr(STDIN_FILENO, TCSANOW, &raw);
        } else {
                tty = 0;
        }
        for (long i = 0; !top_stop && (iterations <= 0 || i < iterations); i++) {
                struct epd_stats *cur = fetch_stats(c);
                if (!cur)
                        break;
                const struct epd_admin_daemon_stats *s = epd_stats_daemon(cur);
                const struct epd_admin_daemon_stats *p = prev ? epd_stats_daemon(prev) : NULL;
                double dt = p ? (s->uptime_ms - p->uptime_ms) / 1000.0 : 0;
                printf("\033[H\033[2J");
                print_stats_table(s, p, dt);
                printf("\n(refresh %ld ms; q quits)\n", delay_ms);
                fflush(stdout);
                epd_stats_free(prev);
                prev = cur;
                if (iterations > 0 && i + 1 >= iterations)
                        break;
                struct pollfd pfd = { .fd = STDIN_FILENO, .events = POLLIN };
                if (poll(&pfd, tty ? 1 : 0, (int)delay_ms) > 0) {
                        char ch;
                        if (read(STDIN_FILENO, &ch, 1) == 1 && (ch == 'q' || ch == 'Q'))
                                break;
                }
        }
        if (tty)
                tcsetattr(STDIN_FILENO, TCSANOW, &saved);
        epd_stats_free(prev);
        return 0;
}

/* ---- admin verbs ---- */

/* drain/undrain [GROUP]: GROUP is a name, or an id when no group has that name. */
static int cmd_drain(struct epd_client *c, int drain, const char *group, int json)
{
        struct epd_drain_result r;
        int rc = drain ? epd_drain(c, group, &r) : epd_undrain(c, group, &r);

        if (rc < 0)
                return failed(c, rc);
        if (json) {
                json_t *o = json_pack("{s:s, s:s?, s:I, s:I, s:I, s:b}", "action",
                                      drain ? "drain" : "undrain", "group", group, "groups",
                                      (json_int_t)r.groups, "executing_ops",
                                      (json_int_t)r.executing_ops, "waiting_ops",
                                      (json_int_t)r.waiting_ops, "daemon_draining",
                                      r.daemon_draining);
                json_dumpf(o, stdout, JSON_INDENT(2));
                putchar('\n');
                json_decref(o);
        } else {
                if (group)
                        printf("group %s %s", group,
                               drain ? "draining: no new ops are launched"
                                     : "resumed");
                else
                        printf("daemon %s", drain ? "draining: no new ops are launched"
                                                  : "resumed");
                if (!drain && r.groups && !group)
                        printf(" (and %u drained group%s)", r.groups, r.groups == 1 ? "" : "s");
                printf("; %u op%s executing, %u waiting%s\n", r.executing_ops,
                       r.executing_ops == 1 ? "" : "s", r.waiting_ops,
                       !drain && r.daemon_draining ? "; the daemon itself is still draining" : "");
        }
        return 0;
}

static int cmd_evict(struct epd_client *c, const char *client_id, int json)
{
        char *end;
        unsigned long long id = strtoull(client_id, &end, 10);
        int rc;

        if (!client_id[0] || *end || client_id[0] < '0' || client_id[0] > '9') {
                fprintf(stderr, "epctl: evict: '%s' is not a client id (see epctl clients)\n",
                        client_id);
                return 2;
        }
        if ((rc = epd_evict(c, id)) < 0)
                return failed(c, rc);
        if (json)
                printf("{\n  \"evicted\": %llu\n}\n", id);
        else
                printf("client %llu evicted\n", id);
        return 0;
}

/* N with an optional binary suffix K, M, G, T (and an optional "B" or "iB"). */
static int parse_bytes(const char *s, uint64_t *out)
{
        char *end;
        unsigned long long v;
        uint64_t mult = 1;

        if (s[0] < '0' || s[0] > '9')
                return -1;
        errno = 0;
        v = strtoull(s, &end, 10);
        if (errno || end == s)
                return -1;
        switch (*end) {
        case '\0': break;
        case 'K': case 'k': mult = 1ull << 10; end++; break;
        case 'M': case 'm': mult = 1ull << 20; end++; break;
        case 'G': case 'g': mult = 1ull << 30; end++; break;
        case 'T': case 't': mult = 1ull << 40; end++; break;
        default: return -1;
        }
        if (*end && strcmp(end, "B") && strcmp(end, "iB") && strcmp(end, "b"))
                return -1;
        if (v > UINT64_MAX / mult)
                return -1;
        *out = v * mult;
        return 0;
}

static const char *mib(uint64_t bytes, char *buf, size_t len)
{
        snprintf(buf, len, "%.1f MiB", bytes / 1048576.0);
        return buf;
}

/* resize GROUP --bytes N: GROUP is a name, or an id when no group has that name. */
static int cmd_resize(struct epd_client *c, const char *group, const char *bytes_arg, int json)
{
        struct epd_resize_result *res;
        char a[32], b[32];
        uint64_t bytes;
        int rc;

        if (parse_bytes(bytes_arg, &bytes) < 0 || bytes == 0) {
                fprintf(stderr, "epctl: resize: '%s' is not a size (N with K, M, G or T)\n",
                        bytes_arg);
                return 2;
        }
        if ((rc = epd_resize(c, group, bytes, &res)) < 0)
                return failed(c, rc);
        const struct epd_resize_info *r = epd_resize_result_info(res);
        if (json) {
                json_t *ranks = json_array();
                for (uint32_t i = 0; i < r->num_ranks; i++) {
                        const struct epd_resize_rank *k = &r->ranks[i];
                        json_array_append_new(
                                ranks, json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}", "rank",
                                                 (json_int_t)k->rank, "old_bytes",
                                                 (json_int_t)k->old_bytes, "new_bytes",
                                                 (json_int_t)k->new_bytes, "segments",
                                                 (json_int_t)k->segments, "used_bytes",
                                                 (json_int_t)k->used_bytes, "reserved_bytes",
                                                 (json_int_t)k->reserved_bytes));
                }
                json_t *o = json_pack("{s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:o}", "action",
                                      "resize", "group", group, "group_id",
                                      (json_int_t)r->group_id, "requested_bytes",
                                      (json_int_t)r->requested_bytes, "old_bytes",
                                      (json_int_t)r->old_bytes, "new_bytes",
                                      (json_int_t)r->new_bytes, "wait_ns",
                                      (json_int_t)r->wait_ns, "ranks", ranks);
                json_dumpf(o, stdout, JSON_INDENT(2));
                putchar('\n');
                json_decref(o);
        } else {
                printf("group %s resized: %s -> %s per rank (ops drained for %.1f ms)\n", group,
                       mib(r->old_bytes, a, sizeof(a)), mib(r->new_bytes, b, sizeof(b)),
                       r->wait_ns / 1e6);
                for (uint32_t i = 0; i < r->num_ranks; i++) {
                        const struct epd_resize_rank *k = &r->ranks[i];
                        printf("  rank %u: %s -> %s, %u segment%s, %llu bytes in use%s\n",
                               k->rank, mib(k->old_bytes, a, sizeof(a)),
                               mib(k->new_bytes, b, sizeof(b)), k->segments,
                               k->segments == 1 ? "" : "s", (unsigned long long)k->used_bytes,
                               k->new_bytes > r->requested_bytes
                                       ? " (live outputs end above the requested size)"
                                       : "");
                }
        }
        epd_resize_result_free(res);
        return 0;
}

int main(int argc, char **argv)
{
        static const struct option options[] = {
                { "socket", required_argument, NULL, 's' },
                { "json", no_argument, NULL, 'j' },
                { "iterations", required_argument, NULL, 'n' },
                { "delay", required_argument, NULL, 'd' },
                { "bytes", required_argument, NULL, 'b' },
                { "help", no_argument, NULL, 'h' },
                { NULL, 0, NULL, 0 },
        };
        struct epd_connect_args args = { .size = sizeof(args), .client_name = "epctl" };
        struct epd_client *c;
        char err[512];
        int json = 0, opt, rc;
        long iterations = 0, delay_ms = 1000;
        const char *cmd, *arg = NULL, *bytes_arg = NULL;

        while ((opt = getopt_long(argc, argv, "+s:jn:d:b:h", options, NULL)) != -1) {
                switch (opt) {
                case 's': args.socket_path = optarg; break;
                case 'j': json = 1; break;
                case 'n': iterations = strtol(optarg, NULL, 10); break;
                case 'd': delay_ms = strtol(optarg, NULL, 10); break;
                case 'b': bytes_arg = optarg; break;
                case 'h': usage(stdout); return 0;
                default: usage(stderr); return 2;
                }
        }
        if (optind >= argc) {
                usage(stderr);
                return 2;
        }
        cmd = argv[optind++];
        /* Options may also follow the command: `epctl status --json`. */
        for (; optind < argc; optind++) {
                if (strcmp(argv[optind], "--json") == 0 || strcmp(argv[optind], "-j") == 0) {
                        json = 1;
                } else if ((strcmp(argv[optind], "-n") == 0 ||
                            strcmp(argv[optind], "--iterations") == 0) && optind + 1 < argc) {
                        iterations = strtol(argv[++optind], NULL, 10);
                } else if ((strcmp(argv[optind], "-d") == 0 ||
                            strcmp(argv[optind], "--delay") == 0) && optind + 1 < argc) {
                        delay_ms = strtol(argv[++optind], NULL, 10);
                } else if ((strcmp(argv[optind], "-b") == 0 ||
                            strcmp(argv[optind], "--bytes") == 0) && optind + 1 < argc) {
                        bytes_arg = argv[++optind];
                } else if (strncmp(argv[optind], "--bytes=", 8) == 0) {
                        bytes_arg = argv[optind] + 8;
                } else if (!arg && argv[optind][0] != '-' &&
                           (strcmp(cmd, "drain") == 0 || strcmp(cmd, "undrain") == 0 ||
                            strcmp(cmd, "evict") == 0 || strcmp(cmd, "resize") == 0)) {
                        arg = argv[optind];
                } else {
                        fprintf(stderr, "epctl: unexpected argument '%s'\n", argv[optind]);
                        return 2;
                }
        }
        if (strcmp(cmd, "status") && strcmp(cmd, "groups") && strcmp(cmd, "clients") &&
            strcmp(cmd, "stats") && strcmp(cmd, "top") && strcmp(cmd, "drain") &&
            strcmp(cmd, "undrain") && strcmp(cmd, "evict") && strcmp(cmd, "resize")) {
                fprintf(stderr, "epctl: unknown command '%s'\n", cmd);
                usage(stderr);
                return 2;
        }
        if (strcmp(cmd, "evict") == 0 && !arg) {
                fprintf(stderr, "epctl: evict needs a CLIENT_ID (see epctl clients)\n");
                return 2;
        }
        if (strcmp(cmd, "resize") == 0 && (!arg || !bytes_arg)) {
                fprintf(stderr, "epctl: usage: epctl resize GROUP --bytes N\n");
                return 2;
        }
        rc = epd_client_connect(&args, &c, err, sizeof(err));
        if (rc < 0) {
                fprintf(stderr, "epctl: %s: %s\n", epd_status_name(rc), err);
                return 1;
        }
        if (strcmp(cmd, "status") == 0)
                rc = cmd_status(c, json);
        else if (strcmp(cmd, "groups") == 0)
                rc = cmd_groups(c, json);
        else if (strcmp(cmd, "stats") == 0)
                rc = cmd_stats(c, json);
        else if (strcmp(cmd, "top") == 0)
                rc = cmd_top(c, iterations, delay_ms > 0 ? delay_ms : 1000);
        else if (strcmp(cmd, "drain") == 0 || strcmp(cmd, "undrain") == 0)
                rc = cmd_drain(c, strcmp(cmd, "drain") == 0, arg, json);
        else if (strcmp(cmd, "evict") == 0)
                rc = cmd_evict(c, arg, json);
        else if (strcmp(cmd, "resize") == 0)
                rc = cmd_resize(c, arg, bytes_arg, json);
        else
                rc = cmd_clients(c, json);
        epd_client_free(c);
        return rc;
}
