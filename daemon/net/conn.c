/* conn.c - one client connection: frame reception, protocol checks, replies with an output
 * queue, and the release of everything the client held when it goes away. Loop thread only.
 *
 * Closing a connection unbinds its ranks, which fails pending ops and replies to the other
 * ranks' clients. So a reply that fails (the peer is gone, or its output queue overflowed) never
 * closes its connection on the spot: it may be deep inside a group or op of another connection
 * (failing that connection's ops, completing an op) that must not change under its caller. It
 * records the reason and the close runs from the connection's idle handle on the loop's next
 * turn. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "admission.h"
#include "backend.h"
#include "net.h"
#include "frame.h"
#include "log.h"
#include "mailbox.h"
#include "util.h"

static void on_conn_event(uv_poll_t *handle, int status, int events);
static void on_close_idle(uv_idle_t *idle);
static int conn_flush(struct epdd_conn *c);

static void conn_update_poll(struct epdd_conn *c)
{
        int want = UV_READABLE | (epd_list_empty(&c->out_queue) ? 0 : UV_WRITABLE);

        if (c->cl.closing || want == c->poll_events)
                return;
        c->poll_events = want;
        uv_poll_start(&c->poll, want, on_conn_event);
}

/* Refuses a connection with one status frame, then closes it. */
static void refuse(int fd, int status, const char *message)
{
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        uint8_t buf[512];

        resp.status = (Epd__V1__StatusCode)epd__status_to_wire(status);
        resp.message = (char *)message;
        size_t len = epd__v1__response__get_packed_size(&resp);
        if (len <= sizeof(buf)) {
                epd__v1__response__pack(&resp, buf);
                (void)epd_frame_send(fd, EPD_PROTOCOL_VERSION, buf, len, NULL, 0);
        }
        close(fd);
}

int epd_conn_accept(struct epdd_daemon *d, int fd)
{
        struct ucred cred;
        socklen_t len = sizeof(cred);
        struct epdd_conn *c;
        const char *why;
        int admin, rc;

        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
                log_warning("SO_PEERCRED failed: %s, ignoring connection", strerror(errno));
                close(fd);
                return -errno;
        }
        if (!epd_conn_is_allowed(d, cred.uid, cred.gid)) {
                d->stats.clients_refused++;
                log_notice("refused client pid=%d uid=%u gid=%u: not in the allow list",
                           (int)cred.pid, cred.uid, cred.gid);
                refuse(fd, EPD_PERMISSION_DENIED, "uid/gid not allowed by the daemon's allow list");
                return -EPERM;
        }
        if (d->shutting_down) {
                refuse(fd, EPD_UNAVAILABLE, "daemon is shutting down");
                return -ESHUTDOWN;
        }
        admin = epd_conn_is_admin(d, cred.uid, cred.gid);
        rc = epd_admission_check(d, &cred, admin, &why);
        if (rc != 0) {
                d->stats.clients_refused++;
                log_notice("refused client pid=%d uid=%u: %s", (int)cred.pid, cred.uid, why);
                refuse(fd, rc, why);
                return -EMFILE;
        }
        c = calloc(1, sizeof(*c));
        if (!c) {
                close(fd);
                return -ENOMEM;
        }
        c->cl.daemon = d;
        c->cl.id = ++d->next_client_id;
        c->fd = fd;
        c->cl.pid = cred.pid;
        c->cl.uid = cred.uid;
        c->cl.gid = cred.gid;
        c->cl.admin = admin;
        c->accepted_ns = epd__now_ns();
        epd_list_init(&c->cl.regions);
        epd_list_init(&c->cl.bindings);
        epd_list_init(&c->out_queue);
        epd_list_add_tail(&d->conns, &c->cl.link);
        d->num_conns++;
        d->stats.clients_accepted++;
        uv_poll_init(d->loop, &c->poll, fd);
        c->poll.data = c;
        c->poll_events = 0;
        uv_idle_init(d->loop, &c->close_idle);
        c->close_idle.data = c;
        c->open_handles = 2;
        conn_update_poll(c);
        log_debug("client connected client=%llu pid=%d uid=%u", (unsigned long long)c->cl.id,
                  (int)c->cl.pid, c->cl.uid);
        return 0;
}

static void free_out_msg(struct epdd_out_msg *m)
{
        for (unsigned i = 0; i < m->num_fds; i++)
                close(m->fds[i]);
        free(m);
}

static void on_conn_closed(uv_handle_t *handle)
{
        struct epdd_conn *c = handle->data;

        if (--c->open_handles == 0)
                free(c);
}

/* Schedules the close for the loop's next turn (see the top of this file). */
static void conn_close_later(struct epdd_conn *c, const char *why)
{
        if (c->cl.closing || c->close_reason)
                return;
        c->close_reason = why;
        uv_idle_start(&c->close_idle, on_close_idle);
}

void epd_conn_close_later(struct epdd_conn *c, const char *why)
{
        conn_flush(c);
        conn_close_later(c, why);
}

static void on_close_idle(uv_idle_t *idle)
{
        struct epdd_conn *c = idle->data;

        uv_idle_stop(idle);
        epd_conn_close(c, c->close_reason);
}

void epd_conn_close(struct epdd_conn *c, const char *why)
{
        struct epdd_daemon *d = c->cl.daemon;
        struct epd_list *pos, *tmp;

        if (c->cl.closing)
                return;
        c->cl.closing = 1;
        /* A clean close is routine; anything else is worth the operator's attention. */
        epd_log(strcmp(why, "end of stream") ? LOG_INFO : LOG_DEBUG,
                "client disconnected client=%llu pid=%d reason=\"%s\"",
                (unsigned long long)c->cl.id, (int)c->cl.pid, why);
        uv_poll_stop(&c->poll);
        uv_idle_stop(&c->close_idle);
        /* Unbind every rank first: the groups fail or finish the ops of this client, and no
         * reply is sent to it any more. */
        epd_list_for_each_safe(pos, tmp, &c->cl.bindings)
        {
                struct epdd_binding *b = epd_list_entry(pos, struct epdd_binding, conn_link);
                struct epdd_group *g = b->group;
                epd_group_unbind(g, b->rank, 1);
                epd_group_maybe_free(g);
        }
        epd_region_release_all(&c->cl);
        epd_list_for_each_safe(pos, tmp, &c->out_queue)
        {
                struct epdd_out_msg *m = epd_list_entry(pos, struct epdd_out_msg, link);
                epd_list_del(&m->link);
                free_out_msg(m);
        }
        d->net->out_bytes -= c->out_bytes;
        c->out_bytes = 0;
        close(c->fd);
        c->fd = -1;
        epd_list_del(&c->cl.link);
        d->num_conns--;
        uv_close((uv_handle_t *)&c->poll, on_conn_closed);
        uv_close((uv_handle_t *)&c->close_idle, on_conn_closed);
}

/* Sends queued frames until the socket is full. Returns 0 or -errno (connection broken). */
static int conn_flush(struct epdd_conn *c)
{
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &c->out_queue)
        {
                struct epdd_out_msg *m = epd_list_entry(pos, struct epdd_out_msg, link);
                int rc = epd_frame_send(c->fd, EPD_PROTOCOL_VERSION, m->data, m->len, m->fds,
                                        m->num_fds);
                if (rc == -EAGAIN)
                        break;
                if (rc < 0)
                        return rc;
                c->out_bytes -= m->len;
                c->cl.daemon->net->out_bytes -= m->len;
                epd_list_del(&m->link);
                free_out_msg(m);
                c->cl.daemon->stats.frames_out++;
        }
        conn_update_poll(c);
        return 0;
}

int epd_conn_send(struct epdd_conn *c, const Epd__V1__Response *resp, const int *fds,
                  unsigned num_fds)
{
        struct epdd_daemon *d = c->cl.daemon;
        struct epdd_conn *victim = NULL;
        size_t len;
        struct epdd_out_msg *m;
        int rc;

        if (c->cl.closing || c->close_reason)
                return -ECONNRESET;
        len = epd__v1__response__get_packed_size(resp);
        if (len > d->cfg.max_frame_bytes) {
                log_error("reply of %zu bytes exceeds max_frame_bytes=%u client=%llu", len,
                          d->cfg.max_frame_bytes, (unsigned long long)c->cl.id);
                epd_conn_reply_status(c, resp->id, EPD_INTERNAL,
                                      "reply of %zu bytes exceeds the maximum frame size %u",
                                      len, d->cfg.max_frame_bytes);
                return -EMSGSIZE;
        }
        m = malloc(sizeof(*m) + len);
        if (!m)
                return -ENOMEM;
        m->len = len;
        m->num_fds = 0;
        epd__v1__response__pack(resp, m->data);
        for (unsigned i = 0; i < num_fds && i < EPD_ARRAY_SIZE(m->fds); i++) {
                /* The queue owns a duplicate, so the caller's fd may close before the send. */
                int dup_fd = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
                if (dup_fd < 0) {
                        int e = errno;
                        free_out_msg(m);
                        /* The reply cannot go without its descriptor: the client learns it
                         * from the closed connection, and the log says why. */
                        conn_close_later(c, "a reply's file descriptor could not be duplicated "
                                            "(the daemon is out of descriptors)");
                        return -e;
                }
                m->fds[m->num_fds++] = dup_fd;
        }
        epd_list_add_tail(&c->out_queue, &m->link);
        c->out_bytes += len;
        d->net->out_bytes += len;
        if (c->out_bytes > d->cfg.max_output_queue_bytes) {
                conn_close_later(c, "output queue limit exceeded: the client does not read its replies");
                return -ENOBUFS;
        }
        if (epd_admission_queue(d, c, &victim) < 0) {
                conn_close_later(victim, "the daemon's queued replies exceed "
                                         "max_output_queue_bytes_total: this client holds the most");
                if (victim == c)
                        return -ENOBUFS;
        }
        rc = conn_flush(c);
        if (rc < 0) {
                conn_close_later(c, "send failed");
                return rc;
        }
        return 0;
}

/* The core's reply_op hook: the reply record into the page when given and it fits, else on
 * the socket inside an OpRecord. */
static void conn_reply_op(struct epdd_client *cl, struct epd_doorbell *mailbox,
                          const struct epd_op_reply *rep)
{
        struct epdd_conn *c = epd_conn_of(cl);

        if (c->cl.closing || c->close_reason)
                return;
        if (mailbox && epd_mailbox_post(mailbox, rep) == 0) {
                c->cl.daemon->stats.mailbox_replies++;
                return;
        }
        /* On the socket: the same record inside an OpRecord. */
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__OpRecord wrap = EPD__V1__OP_RECORD__INIT;
        const size_t len = epd_oprec_reply_bytes(rep);
        uint8_t stack[EPD_OPREC_REPLY_HEADER_BYTES + EPD_OPREC_MESSAGE_MAX + 256];
        uint8_t *buf = len <= sizeof(stack) ? stack : malloc(len);

        if (len == 0 || !buf)
                return;
        (void)epd_oprec_reply_encode(rep, buf, len);
        wrap.record.data = buf;
        wrap.record.len = len;
        resp.id = rep->id;
        resp.status = (Epd__V1__StatusCode)epd__status_to_wire(rep->status);
        resp.message = "";
        resp.body_case = EPD__V1__RESPONSE__BODY_OP;
        resp.op = &wrap;
        (void)epd_conn_send(c, &resp, NULL, 0);
        if (buf != stack)
                free(buf);
}

static void reply_status(struct epdd_conn *c, uint64_t request_id, int status, const char *fmt,
                         va_list ap) __attribute__((format(printf, 4, 0)));

static void reply_status(struct epdd_conn *c, uint64_t request_id, int status, const char *fmt,
                         va_list ap)
{
        Epd__V1__Response resp = EPD__V1__RESPONSE__INIT;
        Epd__V1__Empty empty = EPD__V1__EMPTY__INIT;
        char message[1024];

        vsnprintf(message, sizeof(message), fmt, ap);
        resp.id = request_id;
        resp.status = (Epd__V1__StatusCode)epd__status_to_wire(status);
        resp.message = message;
        resp.body_case = EPD__V1__RESPONSE__BODY_EMPTY;
        resp.empty = &empty;
        (void)epd_conn_send(c, &resp, NULL, 0);
}

void epd_conn_reply_status(struct epdd_conn *c, uint64_t request_id, int status, const char *fmt,
                           ...)
{
        va_list ap;

        va_start(ap, fmt);
        reply_status(c, request_id, status, fmt, ap);
        va_end(ap);
}

static int conn_protocol_error(struct epdd_conn *c, const char *fmt, ...)
        __attribute__((format(printf, 2, 3)));

/* Answers a protocol error with request id 0 and closes the connection. Returns -1. */
static int conn_protocol_error(struct epdd_conn *c, const char *fmt, ...)
{
        char msg[512];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        c->cl.daemon->stats.protocol_errors++;
        log_notice("client=%llu %s", (unsigned long long)c->cl.id, msg);
        epd_conn_reply_status(c, 0, EPD_INVALID_ARGUMENT, "%s", msg);
        epd_conn_close(c, msg);
        return -1;
}

/* ---- requests through the doorbell pages (common/doorbell.h, request mailbox) ---- */

static struct epd_doorbell *binding_page(const struct epdd_binding *b)
{
        return b->group->ranks[b->rank].doorbell;
}

/* Handles the request a client posted in the page of binding b, if any. Returns 1 when one was
 * handled, 0 when there was none, -1 once the connection was closed. */
static int conn_take_page(struct epdd_conn *c, struct epdd_binding *b)
{
        struct epdd_daemon *d = c->cl.daemon;
        struct epdd_group *g = b->group;
        struct epd_doorbell *page = binding_page(b);
        uint8_t buf[EPD_REQUEST_CAPACITY];
        size_t len;
        int rc;

        if (!page)
                return 0;
        rc = epd_mailbox_take(page, buf, sizeof(buf), &len);
        if (rc == 0)
                return 0;
        if (rc < 0)
                return conn_protocol_error(
                        c, "protocol error: the request in the doorbell page of group '%s' rank %u is %zu bytes; it must be 1 to %zu",
                        g->name, b->rank, len, (size_t)EPD_REQUEST_CAPACITY);
        char why[160];
        struct epd_op_request req;
        if (epd_oprec_request_decode(buf, len, &req, why, sizeof(why)) < 0)
                return conn_protocol_error(
                        c, "protocol error: the op record in the doorbell page of group '%s' rank %u is malformed: %s",
                        g->name, b->rank, why);
        if (req.group_id != g->id || req.rank != b->rank)
                return conn_protocol_error(
                        c, "protocol error: an op record in the doorbell page of group '%s' rank %u must be one of that rank (it names group %llu rank %u)",
                        g->name, b->rank, (unsigned long long)req.group_id, req.rank);
        d->stats.mailbox_requests++;
        c->cl.stats.requests++;
        epd_handle_op(c, &req);
        if (c->cl.closing || c->close_reason) {
                if (!c->cl.closing)
                        epd_conn_close(c, "request handler closed the connection");
                return -1;
        }
        return 1;
}

/* Takes every request c's client posted in its pages. Returns the number handled, or -1 once
 * the connection was closed. */
static int conn_take_pages(struct epdd_conn *c)
{
        struct epd_list *pos, *tmp;
        int n = 0;

        if (c->cl.closing || c->close_reason)
                return 0;
        epd_list_for_each_safe(pos, tmp, &c->cl.bindings)
        {
                int rc = conn_take_page(c, epd_list_entry(pos, struct epdd_binding, conn_link));
                if (rc < 0)
                        return -1;
                n += rc;
        }
        return n;
}

unsigned epd_conn_poll_pages(struct epdd_daemon *d)
{
        struct epd_list *pos, *tmp;
        unsigned n = 0;

        epd_list_for_each_safe(pos, tmp, &d->conns)
        {
                int rc = conn_take_pages(epd_list_entry(pos, struct epdd_conn, cl.link));
                if (rc > 0)
                        n += (unsigned)rc;
        }
        return n;
}

/* The core's page_bound hook: a new binding's page gets the current state. */
static void conn_page_bound(struct epdd_client *cl, struct epd_doorbell *page)
{
        struct epdd_conn *c = epd_conn_of(cl);

        epd_mailbox_set_read_id(page, c->last_read_id);
        epd_mailbox_set_polling(page, c->cl.daemon->net->polling);
}

void epd_conn_set_polling(struct epdd_daemon *d, int on)
{
        struct epd_list *pos, *bpos;

        if (d->net->polling == on)
                return;
        d->net->polling = on;
        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_conn *c = epd_list_entry(pos, struct epdd_conn, cl.link);
                epd_list_for_each(bpos, &c->cl.bindings)
                {
                        struct epd_doorbell *page = binding_page(
                                epd_list_entry(bpos, struct epdd_binding, conn_link));
                        if (page)
                                epd_mailbox_set_polling(page, on);
                }
        }
        /* A client that posted before it could see the 0 is served by this last look. */
        if (!on)
                (void)epd_conn_poll_pages(d);
}

/* Tells the client's pages that its socket was read up to request `id`. */
static void conn_read_up_to(struct epdd_conn *c, uint64_t id)
{
        struct epd_list *pos;

        c->last_read_id = id;
        epd_list_for_each(pos, &c->cl.bindings)
        {
                struct epd_doorbell *page =
                        binding_page(epd_list_entry(pos, struct epdd_binding, conn_link));
                if (page)
                        epd_mailbox_set_read_id(page, id);
        }
}

/* Reads and handles the next waiting frame. One per readiness event: the poll is
 * level-triggered, so libuv reports the socket again while frames wait, and reading on until
 * EAGAIN would cost every request a second, empty recvmsg (about a microsecond on a virtual
 * machine, and the loop thread reads eight ranks' requests one after another). Returns -1 once
 * the connection was closed. */
static int conn_read(struct epdd_conn *c)
{
        struct epdd_daemon *d = c->cl.daemon;

        if (c->cl.closing || c->close_reason)
                return 0;
        struct epd_frame frame;
        const char *why = NULL;
        int rc = epd_frame_recv(c->fd, d->net->rbuf, d->net->rbuf_len, d->cfg.max_frame_bytes,
                                d->cfg.max_fds_per_frame, &frame, &why);
        if (rc == -EAGAIN)
                return 0;
        if (rc == -ECONNRESET) {
                epd_conn_close(c, "end of stream");
                return -1;
        }
        if (rc < 0)
                return conn_protocol_error(c, "protocol error: %s", why ? why : strerror(-rc));
        /* Requests the client posted in its pages came before this frame. */
        if (conn_take_pages(c) < 0) {
                epd_frame_close_fds(&frame);
                return -1;
        }
        d->stats.frames_in++;
        c->cl.stats.requests++;
        if (frame.header.version != EPD_PROTOCOL_VERSION) {
                epd_frame_close_fds(&frame);
                epd_conn_reply_status(c, 0, EPD_VERSION_MISMATCH,
                                      "frame protocol version %u, daemon speaks %u",
                                      frame.header.version, EPD_PROTOCOL_VERSION);
                epd_conn_close(c, "protocol version mismatch");
                return -1;
        }
        Epd__V1__Request *req =
                epd__v1__request__unpack(NULL, frame.body_len, frame.body);
        if (!req) {
                epd_frame_close_fds(&frame);
                return conn_protocol_error(c, "protocol error: body is not a valid Request");
        }
        conn_read_up_to(c, req->id);
        /* The handler takes the fds it uses (setting them to -1); the rest are closed
         * here, so a stray fd never outlives its frame. */
        rc = epd_handle_request(c, req, frame.fds, frame.num_fds);
        epd_frame_close_fds(&frame);
        if (rc < 0) {
                if (!c->cl.closing)
                        epd_conn_close(c, "request handler closed the connection");
                return -1;
        }
        return 0;
}

static void on_conn_event(uv_poll_t *handle, int status, int events)
{
        struct epdd_conn *c = handle->data;

        if (c->cl.closing)
                return;
        if (c->close_reason) {
                epd_conn_close(c, c->close_reason);
                return;
        }
        if (status < 0) {
                /* libuv reports an error condition on the socket (POLLERR: a client that died
                 * with replies unread resets the connection) as UV_EBADF. */
                epd_conn_close(c, status == UV_EBADF ? "connection reset by the client"
                                                     : uv_strerror(status));
                return;
        }
        if (events & UV_WRITABLE) {
                if (conn_flush(c) < 0) {
                        epd_conn_close(c, "send failed");
                        return;
                }
        }
        if (events & (UV_READABLE | UV_DISCONNECT))
                conn_read(c);
}

struct epdd_conn *epd_conn_find(struct epdd_daemon *d, uint64_t id)
{
        struct epd_list *pos;

        epd_list_for_each(pos, &d->conns)
        {
                struct epdd_conn *c = epd_list_entry(pos, struct epdd_conn, cl.link);
                if (c->cl.id == id && !c->cl.closing)
                        return c;
        }
        return NULL;
}

static unsigned hook_poll_pages(void *arg)
{
        return epd_conn_poll_pages(arg);
}

static void hook_set_polling(void *arg, int on)
{
        epd_conn_set_polling(arg, on);
}

void epd_net_hooks_install(struct epdd_daemon *d)
{
        d->hooks.reply_op = conn_reply_op;
        d->hooks.op_started = epd_mailbox_nudge;
        d->hooks.page_bound = conn_page_bound;
        d->backend->poll_pages = hook_poll_pages;
        d->backend->set_polling = hook_set_polling;
        d->backend->poll_arg = d;
}
