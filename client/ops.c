/* ops.c - libepd: dispatch and combine submission, waiting, results, and handle release. */
#include <errno.h>
#include <linux/futex.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "compact.h"
#include "reply.h"
#include "tensor.h"
#include "util.h"

struct epd_op {
        struct epd_client *client;
        struct epd_group *group;
        uint64_t request_id;
        int kind;                     /* 1 dispatch, 2 combine */
        uint64_t seq;                 /* doorbell value of its completion */
        int done;
        int status;
        char message[512];
        Epd__V1__Response *resp;
        int resp_compact;             /* resp was built from a compact reply: one free() */
        int mailbox;                  /* it asked for its reply in the doorbell page */
        int via_page;                 /* and the reply came there */
        int request_via_page;         /* the request went through the page */
        int request_compact;          /* as a compact request (when it went through the page) */
        uint64_t sent_ns;             /* just before the request was sent */
        uint64_t read_ns;             /* when the reply was read */
};

static struct epd_op *op_new(struct epd_group *g, int kind)
{
        struct epd_op *op = calloc(1, sizeof(*op));

        if (!op)
                return NULL;
        op->client = g->client;
        op->group = g;
        op->kind = kind;
        return op;
}

/* Posts req in the rank's request box (common/doorbell.h, request mailbox; the protocol's
 * other half is in daemon/mailbox.c) when the daemon looks at it and has read every frame this
 * client sent on the socket. Returns 1 when the daemon took or will take it, 0 when it is to go
 * on the socket (it may then have been given an id it does not keep). Lock held. */
static int page_post_locked(struct epd_client *c, struct epd_group *g, Epd__V1__Request *req,
                            int *compact)
{
        struct epd_request_box *box;

        *compact = 0;
        if (!c->page_requests || c->broken || !g->doorbell ||
            !(c->daemon_caps & EPD__V1__CAPABILITY__CAP_REQUEST_MAILBOX))
                return 0;
        box = epd_doorbell_request_box(g->doorbell, g->doorbell_bytes);
        if (!box || !epd_request_box_open(box, c->last_socket_id))
                return 0;
        req->id = ++c->next_id;
        *compact = c->compact_requests &&
                   (c->daemon_caps & EPD__V1__CAPABILITY__CAP_COMPACT_REQUEST) &&
                   sizeof(struct epd_compact_request) <= EPD_REQUEST_CAPACITY &&
                   epd__compact_request(req, (struct epd_compact_request *)box->bytes);
        if (*compact) {
                box->len = (uint32_t)sizeof(struct epd_compact_request) | EPD_REQUEST_COMPACT;
                return epd_request_publish(box);
        }
        const size_t len = epd__v1__request__get_packed_size(req);
        if (len > EPD_REQUEST_CAPACITY)
                return 0;
        epd__v1__request__pack(req, box->bytes);
        box->len = (uint32_t)len;
        return epd_request_publish(box);
}

static int op_send(struct epd_op *op, Epd__V1__Request *req, struct epd_op **out)
{
        struct epd_client *c = op->client;
        int rc = 0;

        pthread_mutex_lock(&c->lock);
        /* The reply in the doorbell page when the daemon offers it and no earlier op of this
         * rank still waits there (common/doorbell.h, reply mailbox). */
        const int mailbox = c->mailbox && op->group->doorbell &&
                            (c->daemon_caps & EPD__V1__CAPABILITY__CAP_REPLY_MAILBOX) &&
                            EPD_MAILBOX_CAPACITY(op->group->doorbell_bytes) > 0 &&
                            op->group->mailbox_id == 0;
        if (req->body_case == EPD__V1__REQUEST__BODY_DISPATCH) {
                req->dispatch->reply_in_doorbell = mailbox;
                req->dispatch->compact_reply = mailbox && c->compact_replies;
        } else {
                req->combine->reply_in_doorbell = mailbox;
                req->combine->compact_reply = mailbox && c->compact_replies;
        }
        op->sent_ns = epd__now_ns();
        op->request_via_page = page_post_locked(c, op->group, req, &op->request_compact);
        if (!op->request_via_page)
                rc = epd__client_send_locked(c, req, NULL, 0);
        if (rc == 0) {
                op->seq = ++op->group->submitted;
                op->mailbox = mailbox;
                if (mailbox)
                        op->group->mailbox_id = req->id;
        }
        pthread_mutex_unlock(&c->lock);
        if (rc < 0) {
                free(op);
                return rc;
        }
        op->request_id = req->id;
        *out = op;
        return 0;
}

#define TENSOR_FIELD(name)                                                              \
        Epd__V1__TensorRef w_##name;                                                    \
        if (epd__tensor_present(&args->name)) {                                         \
                epd__tensor_to_wire(&args->name, &w_##name);                            \
                m.name = &w_##name;                                                     \
        }

int epd_dispatch_submit(struct epd_group *group, const struct epd_dispatch_args *args,
                        struct epd_op **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Dispatch m = EPD__V1__DISPATCH__INIT;
        struct epd_op *op;

        if (!group || !args || !out)
                return EPD_INVALID_ARGUMENT;
        if (args->size < sizeof(*args))
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_dispatch_args.size %zu is smaller than %zu", args->size,
                                        sizeof(*args));
        m.group_id = group->id;
        m.rank = group->rank;
        m.handle_id = args->handle_id;
        m.num_tokens = args->num_tokens;
        m.num_topk = args->num_topk;
        m.layout = (Epd__V1__Layout)args->layout;
        m.expert_alignment = args->expert_alignment;
        m.zero_padding = args->zero_padding != 0;
        m.use_arena = args->use_arena != 0;
        m.wait_inputs = args->wait_inputs;
        TENSOR_FIELD(x)
        TENSOR_FIELD(scales)
        TENSOR_FIELD(topk_idx)
        TENSOR_FIELD(topk_weights)
        TENSOR_FIELD(recv_x)
        TENSOR_FIELD(recv_scales)
        TENSOR_FIELD(recv_topk_idx)
        TENSOR_FIELD(recv_weights)
        TENSOR_FIELD(recv_src)
        TENSOR_FIELD(recv_topk_slot)
        req.body_case = EPD__V1__REQUEST__BODY_DISPATCH;
        req.dispatch = &m;
        op = op_new(group, 1);
        if (!op)
                return EPD_INTERNAL;
        return op_send(op, &req, out);
}

int epd_combine_submit(struct epd_group *group, const struct epd_combine_args *args,
                       struct epd_op **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Combine m = EPD__V1__COMBINE__INIT;
        Epd__V1__TensorRef w_bias[2], *bias_ptrs[2];
        struct epd_op *op;

        if (!group || !args || !out)
                return EPD_INVALID_ARGUMENT;
        if (args->size < sizeof(*args))
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_combine_args.size %zu is smaller than %zu", args->size,
                                        sizeof(*args));
        if (args->num_bias > 2)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "num_bias %u; at most 2", args->num_bias);
        m.group_id = group->id;
        m.rank = group->rank;
        m.handle_id = args->handle_id;
        m.apply_weights = args->apply_weights != 0;
        m.wait_inputs = args->wait_inputs;
        TENSOR_FIELD(y)
        TENSOR_FIELD(combined)
        TENSOR_FIELD(combined_topk_weights)
        for (uint32_t b = 0; b < args->num_bias; b++) {
                epd__tensor_to_wire(&args->bias[b], &w_bias[b]);
                bias_ptrs[b] = &w_bias[b];
        }
        m.n_bias = args->num_bias;
        m.bias = bias_ptrs;
        req.body_case = EPD__V1__REQUEST__BODY_COMBINE;
        req.combine = &m;
        op = op_new(group, 2);
        if (!op)
                return EPD_INTERNAL;
        return op_send(op, &req, out);
}

/* A compact reply (common/doorbell.h) turned into the Response that the result functions read,
 * in one allocation that epd_op_free releases with free(). The daemon's bytes are copied out of
 * the page once and checked against their own sizes before use. */
struct compact_resp {
        Epd__V1__Response resp;
        Epd__V1__DispatchReply dispatch;
        Epd__V1__CombineReply combine;
        Epd__V1__OpTimeline timeline;
        struct epd_compact_reply rep;   /* its counts follow */
};

static Epd__V1__Response *compact_decode(const struct epd_op *op, const uint8_t *page,
                                         uint32_t len)
{
        struct epd_compact_reply h;

        if (len < sizeof(h))
                return NULL;
        memcpy(&h, page, sizeof(h));
        const uint32_t kind = op->kind == 1 ? EPD_COMPACT_DISPATCH : EPD_COMPACT_COMBINE;
        if (h.kind != kind || h.id != op->request_id ||
            epd_compact_reply_bytes(kind, h.num_local_experts, h.world_size) != len)
                return NULL;
        struct compact_resp *m = malloc(offsetof(struct compact_resp, rep) + len);
        if (!m)
                return NULL;
        memcpy(&m->rep, page, len);
        const struct epd_compact_reply *c = &m->rep;
        epd__v1__response__init(&m->resp);
        epd__v1__op_timeline__init(&m->timeline);
        m->resp.id = c->id;
        m->resp.status = EPD__V1__STATUS_CODE__OK;
        m->resp.message = "";
        m->timeline.received_ns = c->received_ns;
        m->timeline.launched_ns = c->launched_ns;
        m->timeline.exec_start_ns = c->exec_start_ns;
        m->timeline.completed_ns = c->completed_ns;
        m->timeline.replied_ns = c->replied_ns;
        if (kind == EPD_COMPACT_DISPATCH) {
                Epd__V1__DispatchReply *d = &m->dispatch;
                const uint32_t L = c->num_local_experts;
                epd__v1__dispatch_reply__init(d);
                d->op_number = c->op_number;
                d->handle_id = c->handle_id;
                d->num_recv_tokens = (int32_t)c->num_tokens;
                d->num_expanded_rows = (int32_t)c->num_expanded_rows;
                d->n_num_recv_tokens_per_expert = L;
                d->num_recv_tokens_per_expert = m->rep.counts;
                d->n_num_recv_tokens_per_expert_aligned = L;
                d->num_recv_tokens_per_expert_aligned = m->rep.counts + L;
                d->n_rank_prefix = (size_t)c->world_size + 1;
                d->rank_prefix = m->rep.counts + 2 * (size_t)L;
                d->exec_ns = c->exec_ns;
                d->queue_ns = c->queue_ns;
                d->kernel_ns = c->kernel_ns;
                d->timeline = &m->timeline;
                m->resp.body_case = EPD__V1__RESPONSE__BODY_DISPATCH;
                m->resp.dispatch = d;
        } else {
                Epd__V1__CombineReply *cr = &m->combine;
                epd__v1__combine_reply__init(cr);
                cr->op_number = c->op_number;
                cr->num_tokens = (uint32_t)c->num_tokens;
                cr->exec_ns = c->exec_ns;
                cr->queue_ns = c->queue_ns;
                cr->kernel_ns = c->kernel_ns;
                cr->timeline = &m->timeline;
                m->resp.body_case = EPD__V1__RESPONSE__BODY_COMBINE;
                m->resp.combine = cr;
        }
        return &m->resp;
}

/* The reply that an op asked for in the doorbell page (common/doorbell.h, reply mailbox), read
 * once reply_id names it. Not on the client's lock. */
static int mailbox_take(struct epd_op *op, Epd__V1__Response **resp, int *fds, int64_t left_ms)
{
        struct epd_client *c = op->client;
        const struct epd_doorbell *db = op->group->doorbell;
        const uint32_t len = db->reply_len;
        int rc;

        if (len == EPD_MAILBOX_ON_SOCKET) {
                /* Too large for the page: it follows on the socket. */
                pthread_mutex_lock(&c->lock);
                rc = epd__client_wait_locked(c, op->request_id, (int)left_ms, resp, fds);
                if (rc == 0)
                        op->read_ns = c->last_read_ns;
                pthread_mutex_unlock(&c->lock);
                return rc;
        }
        op->read_ns = epd__now_ns();
        const int compact = (len & EPD_MAILBOX_COMPACT) != 0;
        const uint32_t bytes = len & ~EPD_MAILBOX_COMPACT;
        Epd__V1__Response *r = NULL;
        if (bytes <= EPD_MAILBOX_CAPACITY(op->group->doorbell_bytes))
                r = compact ? compact_decode(op, (const uint8_t *)db->reply, bytes)
                            : epd__v1__response__unpack(NULL, bytes, db->reply);
        if (r && !compact && r->id != op->request_id) {
                epd__v1__response__free_unpacked(r, NULL);
                r = NULL;
        }
        if (!r)
                return epd__client_fail(c, EPD_INTERNAL,
                                        "undecodable %sreply of %u bytes in the doorbell page",
                                        compact ? "compact " : "", bytes);
        *resp = r;
        op->resp_compact = compact;
        op->via_page = 1;
        return 0;
}

/* Waits for an op's reply in the doorbell page: polls reply_id for the client's poll time, then
 * sleeps on reply_seq's futex (the protocol in daemon/mailbox.c), and after each wake-up polls
 * again for the spin time: the daemon wakes its sleepers when their op starts, so the reply
 * finds them polling. It also polls, once, when the op's completion doorbell has passed (the
 * reply is then on its way). Between sleeps it looks at the socket, where the reply comes
 * instead when the daemon refused the request before taking it and where a lost connection
 * shows; sleeps that end by timeout grow from 1 to 64 ms, so such a reply is seen late but not
 * missed. Not on the client's lock. */
static int mailbox_wait(struct epd_op *op, int timeout_ms, Epd__V1__Response **resp, int *fds)
{
        struct epd_client *c = op->client;
        struct epd_doorbell *db = op->group->doorbell;
        const uint64_t id = op->request_id, t0 = epd__now_ns();
        const uint64_t deadline =
                timeout_ms < 0 ? UINT64_MAX : t0 + (uint64_t)timeout_ms * 1000000ull;
        uint64_t nap_ns = 1000000, spin_until = t0 + c->poll_ns;
        int rc, finished = 0;

        fds[0] = fds[1] = -1;
        for (;;) {
                const uint64_t now = epd__now_ns();
                if (__atomic_load_n(&db->reply_id, __ATOMIC_ACQUIRE) == id) {
                        int64_t left_ms = -1; /* for a reply that follows on the socket */
                        if (deadline != UINT64_MAX)
                                left_ms = now >= deadline ? 0 : (int64_t)((deadline - now) / 1000000);
                        return mailbox_take(op, resp, fds, left_ms);
                }
                if (now < spin_until && now < deadline) {
                        epd__cpu_relax();
                        continue;
                }
                /* The op is complete (its doorbell passed, as a stream-ordered caller has
                 * seen before it asks for the result): the reply follows within microseconds,
                 * so poll for it once rather than sleep. */
                if (!finished && __atomic_load_n(&db->completed, __ATOMIC_ACQUIRE) >= op->seq) {
                        finished = 1;
                        spin_until = now + c->spin_ns;
                        if (now < spin_until && now < deadline)
                                continue;
                }
                pthread_mutex_lock(&c->lock);
                rc = epd__client_try_locked(c, id, resp, fds);
                if (rc == 0)
                        op->read_ns = c->last_read_ns;
                pthread_mutex_unlock(&c->lock);
                if (rc != EPD_TIMEOUT)
                        return rc;
                if (now >= deadline)
                        return epd__client_fail(c, EPD_TIMEOUT,
                                                "no reply from the daemon within %d ms",
                                                timeout_ms);
                const uint32_t seq = __atomic_load_n(&db->reply_seq, __ATOMIC_ACQUIRE);
                __atomic_store_n(&db->waiting,
                                 c->spin_ns ? EPD_MAILBOX_WAKE_AT_START : EPD_MAILBOX_WAKE_AT_REPLY,
                                 __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&db->reply_id, __ATOMIC_SEQ_CST) != id) {
                        uint64_t ns = nap_ns < deadline - now ? nap_ns : deadline - now;
                        struct timespec ts = { (time_t)(ns / 1000000000ull),
                                               (long)(ns % 1000000000ull) };
                        if (syscall(SYS_futex, &db->reply_seq, FUTEX_WAIT, seq, &ts, NULL, 0) < 0 &&
                            errno == ETIMEDOUT) {
                                if (nap_ns < 64000000)
                                        nap_ns *= 2;
                        } else {
                                /* Woken, or reply_seq moved: the op runs. */
                                spin_until = epd__now_ns() + c->spin_ns;
                        }
                }
                __atomic_store_n(&db->waiting, 0, __ATOMIC_RELAXED);
        }
}

int epd_op_wait(struct epd_op *op, int timeout_ms)
{
        struct epd_client *c;
        Epd__V1__Response *resp = NULL;
        int fds[2], rc, arena_rc = 0;

        if (!op)
                return EPD_INVALID_ARGUMENT;
        if (op->done)
                return op->status;
        c = op->client;
        if (op->mailbox) {
                rc = mailbox_wait(op, timeout_ms, &resp, fds);
                pthread_mutex_lock(&c->lock);
                if (rc != EPD_TIMEOUT || c->broken)
                        op->group->mailbox_id = 0; /* the page is this rank's again */
        } else {
                pthread_mutex_lock(&c->lock);
                rc = epd__client_wait_locked(c, op->request_id, timeout_ms, &resp, fds);
                if (rc == 0)
                        op->read_ns = c->last_read_ns;
        }
        /* Outputs in an arena that a resize changed since this client mapped it: map its new
         * segments before anyone reads them (client_internal.h). */
        if (rc == 0 && resp->status == EPD__V1__STATUS_CODE__OK &&
            resp->body_case == EPD__V1__RESPONSE__BODY_DISPATCH && resp->dispatch &&
            resp->dispatch->arena_generation > op->group->arena_generation)
                arena_rc = epd__group_arena_sync_locked(op->group);
        pthread_mutex_unlock(&c->lock);
        if (rc == EPD_TIMEOUT && !c->broken)
                return rc; /* the op is still pending */
        op->done = 1;
        if (rc < 0) {
                op->status = rc;
                snprintf(op->message, sizeof(op->message), "%s", c->last_error);
                return rc;
        }
        for (int i = 0; i < 2; i++)
                if (fds[i] >= 0)
                        close(fds[i]);
        op->resp = resp;
        op->status = epd__status_from_wire(resp->status);
        snprintf(op->message, sizeof(op->message), "%s", resp->message ? resp->message : "");
        const Epd__V1__Request__BodyCase asked = op->kind == 1 ? EPD__V1__REQUEST__BODY_DISPATCH
                                                               : EPD__V1__REQUEST__BODY_COMBINE;
        if (op->status == 0 && resp->body_case != epd__reply_body(asked)) {
                /* Another member of the reply's oneof: reading ours would read it. */
                op->status = EPD_INTERNAL;
                snprintf(op->message, sizeof(op->message), "daemon answered %s with %s",
                         epd__request_body_name(asked), epd__response_body_name(resp->body_case));
        }
        if (arena_rc < 0) {
                /* The daemon placed the outputs where this process cannot reach them. */
                op->status = arena_rc;
                snprintf(op->message, sizeof(op->message), "dispatch outputs unreachable: %.400s",
                         c->last_error);
        }
        if (op->status < 0)
                epd__client_fail(c, op->status, "%s", op->message);
        return op->status;
}

int epd_op_status(const struct epd_op *op)
{
        if (!op)
                return EPD_INVALID_ARGUMENT;
        return op->done ? op->status : EPD_UNAVAILABLE;
}

const char *epd_op_error(const struct epd_op *op)
{
        if (!op)
                return "no op";
        return op->done ? op->message : "op not completed";
}

static void result_tensor(struct epd_op *op, const Epd__V1__TensorRef *ref, struct epd_tensor *t,
                          void **ptr)
{
        if (epd__tensor_from_wire(ref, t) < 0 || !epd__tensor_present(t)) {
                memset(t, 0, sizeof(*t));
                *ptr = NULL;
                return;
        }
        *ptr = epd__client_region_ptr(op->client, t->region_id, t->offset);
}

int epd_op_dispatch_result(const struct epd_op *op_c, struct epd_dispatch_result *out)
{
        struct epd_op *op = (struct epd_op *)op_c;
        const Epd__V1__DispatchReply *r;

        if (!op || !out || op->kind != 1)
                return EPD_INVALID_ARGUMENT;
        if (!op->done)
                return EPD_UNAVAILABLE;
        if (op->status < 0)
                return op->status;
        r = op->resp->dispatch;
        if (!r)
                return EPD_INTERNAL;
        memset(out, 0, sizeof(*out));
        out->op_number = r->op_number;
        out->handle_id = r->handle_id;
        out->num_recv_tokens = r->num_recv_tokens;
        out->num_expanded_rows = r->num_expanded_rows;
        out->num_local_experts = (uint32_t)r->n_num_recv_tokens_per_expert;
        out->num_recv_tokens_per_expert = r->num_recv_tokens_per_expert;
        out->num_recv_tokens_per_expert_aligned = r->num_recv_tokens_per_expert_aligned;
        out->world_size = r->n_rank_prefix ? (uint32_t)r->n_rank_prefix - 1 : 0;
        out->rank_prefix = r->rank_prefix;
        out->exec_ns = r->exec_ns;
        out->queue_ns = r->queue_ns;
        out->kernel_ns = r->kernel_ns;
        result_tensor(op, r->recv_x, &out->recv_x, &out->recv_x_ptr);
        result_tensor(op, r->recv_scales, &out->recv_scales, &out->recv_scales_ptr);
        result_tensor(op, r->recv_topk_idx, &out->recv_topk_idx, &out->recv_topk_idx_ptr);
        result_tensor(op, r->recv_weights, &out->recv_weights, &out->recv_weights_ptr);
        result_tensor(op, r->recv_src, &out->recv_src, &out->recv_src_ptr);
        result_tensor(op, r->recv_topk_slot, &out->recv_topk_slot, &out->recv_topk_slot_ptr);
        return 0;
}

int epd_op_combine_result(const struct epd_op *op, struct epd_combine_result *out)
{
        const Epd__V1__CombineReply *r;

        if (!op || !out || op->kind != 2)
                return EPD_INVALID_ARGUMENT;
        if (!op->done)
                return EPD_UNAVAILABLE;
        if (op->status < 0)
                return op->status;
        r = op->resp->combine;
        if (!r)
                return EPD_INTERNAL;
        out->op_number = r->op_number;
        out->num_tokens = r->num_tokens;
        out->exec_ns = r->exec_ns;
        out->queue_ns = r->queue_ns;
        out->kernel_ns = r->kernel_ns;
        return 0;
}

int epd_op_timeline(const struct epd_op *op, struct epd_op_timeline *out)
{
        const Epd__V1__OpTimeline *t = NULL;

        /* Callers built before a field was added pass a smaller size: each later field is
         * filled only when the size covers it. */
        const size_t v1 = offsetof(struct epd_op_timeline, reply_in_doorbell);
        if (!op || !out || out->size < v1)
                return EPD_INVALID_ARGUMENT;
        if (!op->done)
                return EPD_UNAVAILABLE;
        const size_t have = out->size < sizeof(*out) ? out->size : sizeof(*out);
        memset((uint8_t *)out + sizeof(out->size), 0, have - sizeof(out->size));
#define COVERS(field) (have >= offsetof(struct epd_op_timeline, field) + sizeof(out->field))
        if (COVERS(reply_in_doorbell))
                out->reply_in_doorbell = op->via_page;
        if (COVERS(request_in_doorbell))
                out->request_in_doorbell = op->request_via_page;
        if (COVERS(reply_compact))
                out->reply_compact = op->resp_compact;
        if (COVERS(request_compact))
                out->request_compact = op->request_via_page && op->request_compact;
#undef COVERS
        out->submitted_ns = op->sent_ns;
        out->reply_read_ns = op->read_ns;
        if (op->resp && op->resp->body_case == EPD__V1__RESPONSE__BODY_DISPATCH &&
            op->resp->dispatch) {
                t = op->resp->dispatch->timeline;
                out->exec_ns = op->resp->dispatch->exec_ns;
                out->kernel_ns = op->resp->dispatch->kernel_ns;
        } else if (op->resp && op->resp->body_case == EPD__V1__RESPONSE__BODY_COMBINE &&
                   op->resp->combine) {
                t = op->resp->combine->timeline;
                out->exec_ns = op->resp->combine->exec_ns;
                out->kernel_ns = op->resp->combine->kernel_ns;
        }
        if (t) {
                out->received_ns = t->received_ns;
                out->launched_ns = t->launched_ns;
                out->exec_start_ns = t->exec_start_ns;
                out->completed_ns = t->completed_ns;
                out->replied_ns = t->replied_ns;
        }
        return 0;
}

void epd_op_free(struct epd_op *op)
{
        if (!op)
                return;
        if (!op->done)
                (void)epd_op_wait(op, -1);
        if (op->resp && op->resp_compact)
                free(op->resp); /* the first member of its struct compact_resp */
        else if (op->resp)
                epd__v1__response__free_unpacked(op->resp, NULL);
        free(op);
}

int epd_dispatch(struct epd_group *group, const struct epd_dispatch_args *args,
                 struct epd_op **out)
{
        struct epd_op *op;
        int rc = epd_dispatch_submit(group, args, &op);

        if (rc < 0)
                return rc;
        rc = epd_op_wait(op, -1);
        if (rc < 0) {
                epd_op_free(op);
                return rc;
        }
        *out = op;
        return 0;
}

int epd_combine(struct epd_group *group, const struct epd_combine_args *args,
                struct epd_combine_result *out)
{
        struct epd_op *op;
        int rc = epd_combine_submit(group, args, &op);

        if (rc < 0)
                return rc;
        rc = epd_op_wait(op, -1);
        if (rc == 0 && out)
                rc = epd_op_combine_result(op, out);
        epd_op_free(op);
        return rc;
}

int epd_handle_release(struct epd_group *group, uint64_t handle_id)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__HandleRelease hr = EPD__V1__HANDLE_RELEASE__INIT;
        Epd__V1__Response *resp;
        int rc;

        if (!group)
                return EPD_INVALID_ARGUMENT;
        hr.group_id = group->id;
        hr.rank = group->rank;
        hr.handle_id = handle_id;
        req.body_case = EPD__V1__REQUEST__BODY_HANDLE_RELEASE;
        req.handle_release = &hr;
        rc = epd__client_call(group->client, &req, NULL, 0, &resp, NULL);
        if (rc == 0)
                epd__v1__response__free_unpacked(resp, NULL);
        return rc;
}

struct epd_group *epd__op_group(const struct epd_op *op)
{
        return op->group;
}

uint64_t epd_op_sequence(const struct epd_op *op)
{
        return op ? op->seq : 0;
}

int epd_group_doorbell(const struct epd_group *group, const volatile uint64_t **completed,
                       volatile uint64_t **inputs_ready)
{
        if (!group || !group->doorbell)
                return EPD_UNAVAILABLE;
        if (completed)
                *completed = &group->doorbell->completed;
        if (inputs_ready)
                *inputs_ready = &group->doorbell->inputs_ready;
        return 0;
}

int epd_group_mark_inputs_ready_host(struct epd_group *group, uint64_t *seq)
{
        uint64_t v;

        if (!group || !group->doorbell)
                return EPD_UNAVAILABLE;
        pthread_mutex_lock(&group->client->lock);
        v = ++group->inputs_marked;
        pthread_mutex_unlock(&group->client->lock);
        /* Release: the daemon that acquires the value also sees the inputs written before. */
        __atomic_store_n(&group->doorbell->inputs_ready, v, __ATOMIC_RELEASE);
        if (seq)
                *seq = v;
        return 0;
}

#ifndef EPD_HAVE_CUDA
int epd_op_stream_wait(struct epd_op *op, void *stream)
{
        (void)stream;
        if (op)
                epd__client_fail(op->client, EPD_UNAVAILABLE, "libepd was built without CUDA");
        return EPD_UNAVAILABLE;
}

int epd_group_mark_inputs_ready(struct epd_group *group, void *stream, uint64_t *seq)
{
        (void)stream;
        (void)seq;
        if (group)
                epd__client_fail(group->client, EPD_UNAVAILABLE, "libepd was built without CUDA");
        return EPD_UNAVAILABLE;
}

void epd__group_stream_fini(struct epd_group *group)
{
        (void)group;
}
#endif
