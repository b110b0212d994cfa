/* resize.c - `epctl resize` (DESIGN.md section 7): grows or shrinks the output arenas of every
 * rank of a group with the group's ops drained, while its clients keep running. Loop thread only.
 *
 * A Resize request stops the launching of the group's ops (group->resize: epd_op_kick launches
 * nothing while it is set, as for a drained group; submissions are still collected). When no
 * op of the group executes (now, or when the executing op completes: epd_resize_continue from
 * op.c), every rank's arena is resized (arena.c: one more segment mapped, or the segments above
 * the new end dropped), the arena regions of the bound clients get the new size for their
 * bounds checks, the requester gets the sizes, and the group's ops launch again.
 *
 * Clients learn of a resize from their next DispatchReply with use_arena, which carries the
 * arena's generation; libepd then asks for the segments with ArenaSegments and maps them into
 * the address range it reserved at join, so nothing moves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "log.h"
#include "resize.h"
#include "util.h"

/* Segment fds per ArenaSegmentsReply: what one queued reply can carry (daemon.h,
 * struct epd_out_msg); the client asks again for the rest. */
#define SEGMENT_FDS_PER_REPLY 2u

static struct epd_conn *conn_by_id(struct epd_daemon *d, uint64_t id)
{
        struct epd_list *pos;

        epd_list_for_each(pos, &d->conns)
        {
                struct epd_conn *c = epd_list_entry(pos, struct epd_conn, link);
                if (c->id == id && !c->closing)
                        return c;
        }
        return NULL;
}

static void segment_to_wire(const struct epd_arena_segment *s, Epd__V1__ArenaSegment *w)
{
        epd__v1__arena_segment__init(w);
        w->offset = s->off;
        w->bytes = s->bytes;
        w->serial = s->serial;
}

int epd_resize_fill_joined(const struct epd_rank *r, Epd__V1__GroupJoined *j,
                           Epd__V1__ArenaSegment *segs, Epd__V1__ArenaSegment **ptrs)
{
        const struct epd_arena *a = r->arena;

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

void epd_handle_arena_segments(struct epd_conn *c, const Epd__V1__Request *req)
{
        const Epd__V1__ArenaSegments *m = req->arena_segments;
        struct epd_group *g = epd_group_find(c->daemon, m->group_id);
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__ArenaSegmentsReply ar = EPD__V1__ARENA_SEGMENTS_REPLY__INIT;
        Epd__V1__ArenaSegment *segs;
        Epd__V1__ArenaSegment **ptrs;
        const struct epd_arena *a;
        int fds[SEGMENT_FDS_PER_REPLY];
        unsigned n = 0;

        if (!g) {
                epd_conn_reply_status(c, req->id, EPD_NOT_FOUND, "group %llu does not exist",
                                      (unsigned long long)m->group_id);
                return;
        }
        if (m->rank >= g->cfg.world_size || g->ranks[m->rank].conn != c) {
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

/* Resizes every rank's arena to bytes; on a failure, the ranks already resized go back to
 * their old size (a grow that failed on one rank leaves the group as it was). */
static int resize_ranks(struct epd_group *g, uint64_t bytes, Epd__V1__RankArenaSize *sizes,
                        unsigned *num_sizes, char *err, size_t err_len)
{
        uint32_t R = g->cfg.world_size;
        unsigned n = 0;
        int rc = 0;

        for (uint32_t r = 0; r < R; r++) {
                struct epd_rank *rk = &g->ranks[r];
                struct epd_arena *a = rk->arena;
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
                struct epd_rank *rk = &g->ranks[sizes[i].rank];
                struct epd_arena *a = rk->arena;
                sizes[i].segments = a->num_segs;
                sizes[i].used_bytes = epd_arena_used(a);
                sizes[i].reserved_bytes = a->reserved;
                /* The bound client's bounds checks (inputs such as combine's y may lie in the
                 * arena) see the new size. */
                if (rk->conn && rk->arena_region_id) {
                        struct epd_region *reg = epd_region_find(rk->conn, rk->arena_region_id);
                        if (reg)
                                reg->size = a->bytes;
                }
        }
        *num_sizes = n;
        return 0;
}

/* Runs the resize and answers its requester. No op of the group executes. */
static void resize_run(struct epd_group *g)
{
        struct epd_resize *rs = g->resize;
        struct epd_daemon *d = g->daemon;
        struct epd_conn *c = conn_by_id(d, rs->conn_id);
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

void epd_resize_continue(struct epd_group *g)
{
        if (g->resize && !g->executing)
                resize_run(g);
}

void epd_resize_abort(struct epd_group *g)
{
        struct epd_resize *rs = g->resize;
        struct epd_conn *c;

        if (!rs)
                return;
        g->resize = NULL;
        c = conn_by_id(g->daemon, rs->conn_id);
        if (c)
                epd_conn_reply_status(c, rs->request_id, EPD_ABORTED,
                                      "resize of group '%s': the group closed", g->name);
        free(rs);
}

void epd_resize_request(struct epd_conn *c, const Epd__V1__Request *req)
{
        const Epd__V1__Resize *m = req->resize;
        struct epd_daemon *d = c->daemon;
        struct epd_group *g = NULL;
        struct epd_resize *rs;

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
        rs->conn_id = c->id;
        rs->request_id = req->id;
        rs->bytes = m->bytes;
        rs->start_ns = epd__now_ns();
        g->resize = rs;
        log_info("group resize requested group=%s bytes=%llu executing=%d by=client=%llu uid=%u",
                 g->name, (unsigned long long)m->bytes, g->executing != NULL,
                 (unsigned long long)c->id, c->uid);
        if (!g->executing) {
                resize_run(g);
                epd_op_kick(g);
        }
}
