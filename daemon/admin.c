/* admin.c - the admin verbs (README.md, "epctl"): Drain and Undrain stop and resume the
 * launching of ops, of one group or of the whole daemon; Evict closes a client's connection as
 * if it had crashed; Resize (resize.c) grows or shrinks a group's arenas. Only root and members
 * of admin_group may use them (conn->admin, decided at accept). Loop thread only.
 *
 * Draining never fails an op: ops already collected wait in their group (op.c's epd_op_kick
 * launches nothing while the daemon is draining, the group is DRAINING or a resize of it
 * waits), the op executing finishes, and new submissions are still collected. A drained group
 * whose rank is lost breaks as any other and comes back READY when it re-forms.
 */
#include <stdio.h>
#include <string.h>

#include "admin.h"
#include "log.h"
#include "resize.h"

/* The group a Drain/Undrain names: by name, else by id. */
static struct epdd_group *named_group(struct epdd_daemon *d, uint64_t id, const char *name)
{
        struct epdd_group *g = NULL;

        if (name && name[0])
                g = epd_group_find_name(d, name);
        if (!g && id)
                g = epd_group_find(d, id);
        return g;
}

/* Adds what the group has executing and waiting to the reply's counts. */
static void count_ops(const struct epdd_group *g, Epd__V1__DrainReply *dr)
{
        const struct epd_list *pos;

        dr->executing_ops += g->executing != NULL;
        epd_list_for_each(pos, &g->ops)
        {
                const struct epdd_op *op = epd_list_entry(pos, struct epdd_op, link);
                dr->waiting_ops += op->state == EPD_OP_QUEUED;
        }
}

static void reply_drain(struct epdd_conn *c, uint64_t request_id, Epd__V1__DrainReply *dr)
{
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;

        dr->daemon_draining = c->cl.daemon->draining;
        resp.id = request_id;
        resp.status = EPD__V1__STATUS_CODE__OK;
        resp.message = "";
        resp.body_case = EPD__V1__RESPONSE__BODY_DRAIN;
        resp.drain = dr;
        (void)epd_conn_send(c, &resp, NULL, 0);
}

static void handle_drain(struct epdd_conn *c, uint64_t request_id, uint64_t group_id,
                         const char *group_name, int all, int drain)
{
        struct epdd_daemon *d = c->cl.daemon;
        Epd__V1__DrainReply dr = EPD__V1__DRAIN_REPLY__INIT;
        struct epd_list *pos;
        struct epdd_group *g;

        if (all) {
                if (drain && !d->draining) {
                        d->draining = 1;
                        log_notice("daemon draining by=client=%llu uid=%u",
                                   (unsigned long long)c->cl.id, c->cl.uid);
                } else if (!drain && d->draining) {
                        d->draining = 0;
                        log_notice("daemon resumed by=client=%llu uid=%u",
                                   (unsigned long long)c->cl.id, c->cl.uid);
                }
                epd_list_for_each(pos, &d->groups)
                {
                        g = epd_list_entry(pos, struct epdd_group, link);
                        if (!drain && g->state == EPD_GROUP_DRAINING) {
                                g->state = EPD_GROUP_READY;
                                dr.groups++;
                        }
                        /* Client-executed groups stop at an op boundary of their own. */
                        epd_group_cx_drain(g, drain);
                        count_ops(g, &dr);
                }
                if (!drain) {
                        struct epd_list *tmp;
                        /* Launch what waited. */
                        epd_list_for_each_safe(pos, tmp, &d->groups)
                                epd_op_kick(epd_list_entry(pos, struct epdd_group, link));
                }
                reply_drain(c, request_id, &dr);
                return;
        }
        g = named_group(d, group_id, group_name);
        if (!g) {
                if (group_name && group_name[0])
                        epd_conn_reply_status(c, request_id, EPD_NOT_FOUND,
                                              "group '%s' does not exist", group_name);
                else if (group_id)
                        epd_conn_reply_status(c, request_id, EPD_NOT_FOUND,
                                              "group %llu does not exist",
                                              (unsigned long long)group_id);
                else
                        epd_conn_reply_status(c, request_id, EPD_INVALID_ARGUMENT,
                                              "name a group, or ask for all");
                return;
        }
        if (drain) {
                if (g->state != EPD_GROUP_READY && g->state != EPD_GROUP_DRAINING) {
                        epd_conn_reply_status(c, request_id, EPD_INVALID_ARGUMENT,
                                              "group '%s' is %s; only a READY group can be drained (drain the daemon instead)",
                                              g->name, epd_group_state_name(g->state));
                        return;
                }
                if (g->state == EPD_GROUP_READY) {
                        g->state = EPD_GROUP_DRAINING;
                        epd_group_cx_drain(g, 1);
                        dr.groups = 1;
                        log_notice("group draining group=%s by=client=%llu uid=%u", g->name,
                                   (unsigned long long)c->cl.id, c->cl.uid);
                }
        } else if (g->state == EPD_GROUP_DRAINING) {
                g->state = EPD_GROUP_READY;
                if (!d->draining)
                        epd_group_cx_drain(g, 0);
                dr.groups = 1;
                log_notice("group resumed group=%s by=client=%llu uid=%u", g->name,
                           (unsigned long long)c->cl.id, c->cl.uid);
                epd_op_kick(g);
        }
        count_ops(g, &dr);
        reply_drain(c, request_id, &dr);
}

static void handle_evict(struct epdd_conn *c, uint64_t request_id, uint64_t client_id)
{
        struct epdd_daemon *d = c->cl.daemon;
        struct epd_list *pos;

        if (client_id == c->cl.id) {
                epd_conn_reply_status(c, request_id, EPD_INVALID_ARGUMENT,
                                      "a client cannot evict itself");
                return;
        }
        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_conn *victim = epd_list_entry(pos, struct epdd_conn, cl.link);
                if (victim->cl.id != client_id || victim->cl.closing)
                        continue;
                log_notice("client evicted client=%llu pid=%d by=client=%llu uid=%u",
                           (unsigned long long)victim->cl.id, (int)victim->cl.pid,
                           (unsigned long long)c->cl.id, c->cl.uid);
                /* As if it had crashed: its ranks are lost and their peers get PEER_LOST. */
                epd_conn_close(victim, "evicted by admin");
                epd_conn_reply_status(c, request_id, EPD_OK, "%s", "");
                return;
        }
        epd_conn_reply_status(c, request_id, EPD_NOT_FOUND, "client %llu is not connected",
                              (unsigned long long)client_id);
}

static const char *verb_name(const Epd__V1__Request *req)
{
        switch (req->body_case) {
        case EPD__V1__REQUEST__BODY_DRAIN: return "drain";
        case EPD__V1__REQUEST__BODY_UNDRAIN: return "undrain";
        case EPD__V1__REQUEST__BODY_RESIZE: return "resize";
        default: return "evict";
        }
}

void epd_handle_admin(struct epdd_conn *c, const Epd__V1__Request *req)
{
        if (!c->cl.admin) {
                log_notice("admin request refused verb=%s client=%llu pid=%d uid=%u",
                           verb_name(req), (unsigned long long)c->cl.id, (int)c->cl.pid, c->cl.uid);
                epd_conn_reply_status(c, req->id, EPD_PERMISSION_DENIED,
                                      "%s is an admin verb: it needs root or the daemon's admin_group",
                                      verb_name(req));
                return;
        }
        switch (req->body_case) {
        case EPD__V1__REQUEST__BODY_DRAIN:
                handle_drain(c, req->id, req->drain->group_id, req->drain->group_name,
                             req->drain->all, 1);
                break;
        case EPD__V1__REQUEST__BODY_UNDRAIN:
                handle_drain(c, req->id, req->undrain->group_id, req->undrain->group_name,
                             req->undrain->all, 0);
                break;
        case EPD__V1__REQUEST__BODY_EVICT:
                handle_evict(c, req->id, req->evict->client_id);
                break;
        case EPD__V1__REQUEST__BODY_RESIZE:
                epd_resize_request(c, req); /* resize.c */
                break;
        default:
                epd_conn_reply_status(c, req->id, EPD_INVALID_ARGUMENT, "not an admin request");
                break;
        }
}
