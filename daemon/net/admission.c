/* admission.c - see admission.h. */
#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#include "admission.h"
#include "net.h"
#include "log.h"
#include "util.h"

#define SWEEP_MS 100
#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 2000
/* Connections closed to free descriptors each time accept() runs out of them. */
#define HANDSHAKES_CLOSED_PER_EMFILE 16
#define PENALTY_MIN_MS 250
#define PENALTY_MAX_MS 10000
#define PENALTY_FORGET_MS 60000

/* uid's entry of the penalty table, or NULL; add: make one, reusing a free entry or the one that
 * expired first. */
static struct epdd_uid_penalty *penalty_of(struct epdd_net *n, uint32_t uid, int add)
{
        struct epdd_uid_penalty *spare = NULL;

        for (unsigned i = 0; i < EPD_PENALTY_UIDS; i++) {
                struct epdd_uid_penalty *p = &n->penalties[i];

                if (p->ms && p->uid == uid)
                        return p;
                if (!spare || (spare->ms && (!p->ms || p->until_ns < spare->until_ns)))
                        spare = p;
        }
        if (!add)
                return NULL;
        memset(spare, 0, sizeof(*spare));
        spare->uid = uid;
        return spare;
}

void epd_admission_penalize(struct epdd_daemon *d, uint32_t uid)
{
        uint64_t now = epd__now_ns();
        struct epdd_uid_penalty *p = penalty_of(d->net, uid, 1);

        if (p->ms && now < p->until_ns + PENALTY_FORGET_MS * 1000000ull)
                p->ms = p->ms * 2 > PENALTY_MAX_MS ? PENALTY_MAX_MS : p->ms * 2;
        else
                p->ms = PENALTY_MIN_MS;
        p->until_ns = now + (uint64_t)p->ms * 1000000ull;
        log_notice("uid %u gave too many wrong group secrets: its new connections are refused "
                   "for %u ms", uid, p->ms);
}

static void on_sweep(uv_timer_t *timer)
{
        struct epdd_daemon *d = timer->data;
        uint64_t now = epd__now_ns(), limit = (uint64_t)d->cfg.handshake_timeout_ms * 1000000ull;
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &d->conns)
        {
                struct epdd_conn *c = epd_conn_of(epd_list_entry(pos, struct epdd_client, link));
                if (!c->hello_done && !c->cl.closing && now - c->accepted_ns >= limit) {
                        epd_conn_close(c, "no Hello within handshake_timeout_ms");
                }
        }
}

static void on_backoff_done(uv_timer_t *timer)
{
        struct epdd_daemon *d = timer->data;

        epd_server_resume(d);
}

void epd_admission_init(struct epdd_daemon *d)
{
        uv_timer_init(d->loop, &d->net->sweep_timer);
        d->net->sweep_timer.data = d;
        uv_timer_start(&d->net->sweep_timer, on_sweep, SWEEP_MS, SWEEP_MS);
        uv_unref((uv_handle_t *)&d->net->sweep_timer);
        uv_timer_init(d->loop, &d->net->backoff_timer);
        d->net->backoff_timer.data = d;
        d->net->backoff_ms = BACKOFF_MIN_MS;
}

void epd_admission_close(struct epdd_daemon *d)
{
        uv_timer_stop(&d->net->sweep_timer);
        uv_timer_stop(&d->net->backoff_timer);
        uv_close((uv_handle_t *)&d->net->sweep_timer, NULL);
        uv_close((uv_handle_t *)&d->net->backoff_timer, NULL);
}

int epd_admission_check(struct epdd_daemon *d, const struct ucred *cred, int admin,
                        const char **why)
{
        struct epdd_uid_penalty *penalty;
        struct epd_list *pos;
        unsigned same_uid = 0;

        if (d->num_conns >= d->cfg.max_clients + (admin ? d->cfg.admin_reserved_clients : 0)) {
                *why = admin ? "too many clients (max_clients and the administrators' reserve reached)"
                             : "too many clients (max_clients reached)";
                return EPD_UNAVAILABLE;
        }
        /* An administrator may always use the reserve, so that epctl reaches a daemon that
         * others have filled up. */
        if (admin)
                return 0;
        penalty = penalty_of(d->net, cred->uid, 0);
        if (penalty && epd__now_ns() < penalty->until_ns) {
                *why = "this uid gave too many wrong group secrets: its new connections are refused "
                       "for a while (250 ms, doubling up to 10 s while it goes on)";
                return EPD_UNAVAILABLE;
        }
        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_conn *c = epd_conn_of(epd_list_entry(pos, struct epdd_client, link));
                same_uid += c->cl.uid == cred->uid && !c->cl.closing;
        }
        if (same_uid >= d->cfg.max_clients_per_uid) {
                *why = "too many clients of this uid (max_clients_per_uid reached)";
                return EPD_UNAVAILABLE;
        }
        return 0;
}

int epd_admission_accept_failed(struct epdd_daemon *d, int err)
{
        struct epd_list *pos, *tmp;
        unsigned closed = 0;

        if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM) {
                log_warning("accept failed: %s, ignoring", strerror(err));
                return 0;
        }
        /* Oldest first: the list is in order of acceptance. */
        epd_list_for_each_safe(pos, tmp, &d->conns)
        {
                struct epdd_conn *c = epd_conn_of(epd_list_entry(pos, struct epdd_client, link));
                if (closed == HANDSHAKES_CLOSED_PER_EMFILE)
                        break;
                if (!c->hello_done && !c->cl.closing) {
                        epd_conn_close(c, "descriptors exhausted: handshake not finished");
                        closed++;
                }
        }
        log_warning("accept failed: %s; not accepting for %u ms, closed %u unfinished handshakes",
                    strerror(err), d->net->backoff_ms, closed);
        epd_server_pause(d);
        uv_timer_start(&d->net->backoff_timer, on_backoff_done, d->net->backoff_ms, 0);
        d->net->backoff_ms = d->net->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : d->net->backoff_ms * 2;
        return 1;
}

void epd_admission_accepted(struct epdd_daemon *d)
{
        d->net->backoff_ms = BACKOFF_MIN_MS;
}

int epd_admission_queue(struct epdd_daemon *d, struct epdd_conn *c, struct epdd_conn **victim)
{
        struct epd_list *pos;
        struct epdd_conn *most = c;

        if (d->net->out_bytes <= d->cfg.max_output_queue_bytes_total)
                return 0;
        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_conn *o = epd_conn_of(epd_list_entry(pos, struct epdd_client, link));
                if (!o->cl.closing && o->out_bytes > most->out_bytes)
                        most = o;
        }
        *victim = most;
        return -1;
}
