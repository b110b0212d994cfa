/* resize.c - `epctl resize` (README.md, "epctl"): grows or shrinks the output arenas of every
 * rank of a group with the group's ops drained, while its clients keep running. Loop thread only.
 *
 * A Resize request stops the launching of the group's ops (group->resize: epd_op_kick launches
 * nothing while it is set, as for a drained group; submissions are still collected). When no
 * op of the group executes (now, or when the executing op completes: epd_resize_continue, the
 * core's group_idle hook), every rank's arena is resized (arena.c: one more segment mapped, or
 * the segments above the new end dropped), the arena regions of the bound clients get the new
 * size for their bounds checks, the requester gets the sizes, and the group's ops launch again.
 *
 * Clients learn of a resize from their next dispatch reply record with use_arena, which carries
 * the arena's generation; libepd then asks for the segments with ArenaSegments and maps them into
 * the address range it reserved at join, so nothing moves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "budget.h"
#include "log.h"
#include "resize.h"
#include "util.h"

/* Resizes every rank's arena to bytes; on a failure, the ranks already resized go back to
 * their old size (a grow that failed on one rank leaves the group as it was). */
static int resize_ranks(struct epdd_group *g, uint64_t bytes, Epd__V1__RankArenaSize *sizes,
                        unsigned *num_sizes, char *err, size_t err_len)
{
        uint32_t R = g->cfg.world_size;
        uint64_t grow = 0;
        unsigned n = 0;
        int rc = 0;

        /* A grow maps new memory on every rank: the group's owner pays for it. */
        for (uint32_t r = 0; r < R; r++) {
                const struct epdd_arena *a = g->ranks[r].arena;

                if (a && epd_arena_mapped_bytes(bytes) > a->mapped)
                        grow += epd_arena_mapped_bytes(bytes) - a->mapped;
        }
        if (grow) {
                rc = epd_budget_group_bytes(g->daemon, g->owner_uid, grow, err, err_len);
                if (rc < 0)
                        return rc;
        }
        for (uint32_t r = 0; r < R; r++) {
                struct epdd_rank *rk = &g->ranks[r];
                struct epdd_arena *a = rk->arena;
                Epd__V1__RankArenaSize *s = &sizes[n];
                uint64_t now;

                if (!a)
                        continue;
                epd__v1__rank_arena_size__init(s);
                s->rank = r;
                s->old_bytes = a->bytes;
                rc = epd_arena_resize(a, bytes, &now, err, err_len);
                if (rc < 0) {
                        char msg[256];
                        snprintf(msg, sizeof(msg), "rank %u: %s", r, err);
                        snprintf(err, err_len, "%s", msg);
                        break;
                }
                s->new_bytes = now;
                n++;
        }
        if (rc < 0) {
                /* Back to the old sizes: shrinking to a size the arena had before always
                 * succeeds (nothing was placed since). */
                for (unsigned i = 0; i < n; i++) {
                        uint64_t now;
                        char ignored[128];
                        (void)epd_arena_resize(g->ranks[sizes[i].rank].arena, sizes[i].old_bytes,
                                               &now, ignored, sizeof(ignored));
                }
                return rc;
        }
        for (unsigned i = 0; i < n; i++) {
                struct epdd_rank *rk = &g->ranks[sizes[i].rank];
                struct epdd_arena *a = rk->arena;
                sizes[i].segments = a->num_segs;
                sizes[i].used_bytes = epd_arena_used(a);
                sizes[i].reserved_bytes = a->reserved;
                /* The bound client's bounds checks (inputs such as combine's y may lie in the
                 * arena) see the new size. */
                if (rk->conn && rk->arena_region_id) {
                        struct epdd_region *reg = epd_region_find(rk->conn, rk->arena_region_id);
                        if (reg)
                                reg->mem.size = a->bytes;
                }
        }
        *num_sizes = n;
        return 0;
}

/* Runs the resize and answers its requester. No op of the group executes. */
static void resize_run(struct epdd_group *g)
{
        struct epdd_resize *rs = g->resize;
        struct epdd_daemon *d = g->daemon;
        struct epdd_conn *c = epd_conn_find(d, rs->conn_id);
        Epd__V1__RankArenaSize *sizes = calloc(g->cfg.world_size, sizeof(*sizes));
        Epd__V1__RankArenaSize **ptrs = calloc(g->cfg.world_size, sizeof(*ptrs));
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__ResizeReply rr = EPD__V1__RESIZE_REPLY__INIT;
        uint64_t old_bytes = g->cfg.arena_bytes, wait_ns = epd__now_ns() - rs->start_ns;
        unsigned n = 0;
        char err[512] = "";
        int rc;

        g->resize = NULL;
        if (!sizes || !ptrs) {
                rc = EPD_INTERNAL;
                snprintf(err, sizeof(err), "out of memory");
        } else {
                rc = resize_ranks(g, rs->bytes, sizes, &n, err, sizeof(err));
        }
        if (rc < 0) {
                log_notice("group resize failed group=%s bytes=%llu: %s", g->name,
                           (unsigned long long)rs->bytes, err);
                if (c)
                        epd_conn_reply_status(c, rs->request_id, rc, "resize of group '%s': %s",
                                              g->name, err);
                goto out;
        }
        /* Ranks whose arena is made later (a first bind, a rebind on another device) get the
         * new size. */
        g->cfg.arena_bytes = rs->bytes;
        for (unsigned i = 0; i < n; i++) {
                ptrs[i] = &sizes[i];
                if (sizes[i].new_bytes != rs->bytes)
                        log_info("group resize group=%s rank=%u stops at %llu bytes: live outputs end there",
                                 g->name, sizes[i].rank,
                                 (unsigned long long)sizes[i].new_bytes);
        }
        log_notice("group resized group=%s bytes=%llu->%llu ranks=%u waited_ms=%.1f", g->name,
                   (unsigned long long)old_bytes, (unsigned long long)rs->bytes, n,
                   wait_ns / 1e6);
        if (!c)
                goto out;
        rr.group_id = g->id;
        rr.requested_bytes = rs->bytes;
        rr.old_bytes = old_bytes;
        rr.new_bytes = g->cfg.arena_bytes;
        rr.n_ranks = n;
        rr.ranks = ptrs;
        rr.wait_ns = wait_ns;
        resp.id = rs->request_id;
        resp.status = EPD__V1__STATUS_CODE__OK;
        resp.message = "";
        resp.body_case = EPD__V1__RESPONSE__BODY_RESIZE;
        resp.resize = &rr;
        (void)epd_conn_send(c, &resp, NULL, 0);
out:
        free(ptrs);
        free(sizes);
        free(rs);
}

void epd_resize_continue(struct epdd_group *g)
{
        if (g->resize && !g->executing)
                resize_run(g);
}

void epd_resize_abort(struct epdd_group *g)
{
        struct epdd_resize *rs = g->resize;
        struct epdd_conn *c;

        if (!rs)
                return;
        g->resize = NULL;
        c = epd_conn_find(g->daemon, rs->conn_id);
        if (c)
                epd_conn_reply_status(c, rs->request_id, EPD_ABORTED,
                                      "resize of group '%s': the group closed", g->name);
        free(rs);
}

void epd_resize_request(struct epdd_conn *c, const Epd__V1__Request *req)
{
        const Epd__V1__Resize *m = req->resize;
        struct epdd_daemon *d = c->cl.daemon;
        struct epdd_group *g = NULL;
        struct epdd_resize *rs;

        if (m->group_name && m->group_name[0])
                g = epd_group_find_name(d, m->group_name);
        if (!g && m->group_id)
                g = epd_group_find(d, m->group_id);
        if (!g) {
                if (m->group_name && m->group_name[0])
                        epd_conn_reply_status(c, req->id, EPD_NOT_FOUND,
                                              "group '%s' does not exist", m->group_name);
                else
                        epd_conn_reply_status(c, req->id, m->group_id ? EPD_NOT_FOUND
                                                                      : EPD_INVALID_ARGUMENT,
                                              "group %llu does not exist",
                                              (unsigned long long)m->group_id);
                return;
        }
        if (g->cfg.execution == EPD_EXECUTION_CLIENT) {
                /* Its buffers are sized by its shape (max_tokens_per_rank, recv_rows and the
                 * options it was created with), not by an arena size. */
                epd_conn_reply_status(c, req->id, EPD_UNAVAILABLE,
                                      "group '%s' is client-executed: resizing its "
                                      "communication buffers is not supported; create a group "
                                      "with the new shape or recv_rows instead", g->name);
                return;
        }
        if (g->cfg.arena_bytes == 0) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "group '%s' has no output arenas (arena_bytes 0)", g->name);
                return;
        }
        if (m->bytes == 0) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "an arena needs at least 1 byte");
                return;
        }
        /* The reserved range bounds a rank's growth; ranks whose arena is made later reserve
         * max_arena_bytes. */
        uint64_t max = d->cfg.max_arena_bytes > g->cfg.arena_bytes ? d->cfg.max_arena_bytes
                                                                    : g->cfg.arena_bytes;
        for (uint32_t r = 0; r < g->cfg.world_size; r++)
                if (g->ranks[r].arena && g->ranks[r].arena->reserved < max)
                        max = g->ranks[r].arena->reserved;
        if (m->bytes > max) {
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT,
                                      "%llu bytes exceed the %llu bytes an arena of group '%s' can grow to (max_arena_bytes)",
                                      (unsigned long long)m->bytes, (unsigned long long)max,
                                      g->name);
                return;
        }
        if (g->resize) {
                epd_conn_reply_status(c, req->id, EPD_UNAVAILABLE,
                                      "a resize of group '%s' is already in progress", g->name);
                return;
        }
        rs = calloc(1, sizeof(*rs));
        if (!rs) {
                epd_conn_reply_status(c, req->id, EPD_INTERNAL, "out of memory");
                return;
        }
        rs->conn_id = c->cl.id;
        rs->request_id = req->id;
        rs->bytes = m->bytes;
        rs->start_ns = epd__now_ns();
        g->resize = rs;
        log_info("group resize requested group=%s bytes=%llu executing=%d by=client=%llu uid=%u",
                 g->name, (unsigned long long)m->bytes, g->executing != NULL,
                 (unsigned long long)c->cl.id, c->cl.uid);
        if (!g->executing) {
                resize_run(g);
                epd_op_kick(g);
        }
}
