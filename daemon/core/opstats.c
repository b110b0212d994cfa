/* opstats.c - the statistics an op leaves behind (base/stats.h): per rank and per group, by
 * kind, with latency and bytes, the devices' counts, the group's stage times, and the daemon's
 * totals. Loop thread only. */
#include "core.h"
#include "util.h"

void epd_opstats_op_failed(struct epdd_group *g)
{
        g->stats.ops_failed++;
        g->daemon->stats.ops_failed++;
}

void epd_opstats_rank_failed(struct epdd_group *g, uint32_t rank, enum epdd_op_kind kind,
                             int status)
{
        epd_op_stats_record(&g->ranks[rank].stats.kind[kind - 1], status, 0, 0);
}

/* The group's stage statistics of a successful op (stats.h), once its replies are sent. */
static void record_stages(const struct epdd_op *op, const struct epdd_exec *ex)
{
        struct epdd_latency_hist *st = op->group->stats.stage[op->kind - 1];
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

void epd_opstats_completed(const struct epdd_op *op, const struct epdd_exec *ex, int status,
                           uint64_t now)
{
        struct epdd_group *g = op->group;
        struct epdd_daemon *d = g->daemon;
        const uint32_t R = g->cfg.world_size;

        for (uint32_t r = 0; r < R; r++) {
                struct epdd_op_stats *st = &g->ranks[r].stats.kind[op->kind - 1];
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
                epd_opstats_op_failed(g);
        }
}
