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
#include "oprec.h"
#include "reply.h"
#include "tensor.h"
#include "util.h"

struct epd_op {
        struct epd_client *client;
        struct epd_group *group;
        uint64_t request_id;
        int kind;                     /* EPD_OPREC_DISPATCH or EPD_OPREC_COMBINE */
        uint64_t seq;                 /* doorbell value of its completion */
        int done;
        int status;
        char message[512];
        uint8_t *record;              /* the reply record, owned; `reply` points into it */
        struct epd_op_reply reply;    /* valid when record is set */
        int mailbox;                  /* it asked for its reply in the doorbell page */
        int via_page;                 /* and the reply came there */
        int request_via_page;         /* the request went through the page */
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

/* Posts the op record rec in the rank's request box (common/doorbell.h, request mailbox; the
 * protocol's other half is in daemon/net/mailbox.c) when the daemon looks at it and has read every
 * frame this client sent on the socket. Returns 1 when the daemon took or will take it, 0 when it
 * is to go on the socket. Lock held. */
static int page_post_locked(struct epd_client *c, struct epd_group *g, const uint8_t *rec,
                            size_t len)
{
        struct epd_request_box *box;

        if (!c->page_requests || c->broken || !g->doorbell ||
            !(c->daemon_caps & EPD__V1__CAPABILITY__CAP_REQUEST_MAILBOX))
                return 0;
        box = epd_doorbell_request_box(g->doorbell, g->doorbell_bytes);
        if (!box || len > EPD_REQUEST_CAPACITY || !epd_request_box_open(box, c->last_socket_id))
                return 0;
        memcpy(box->bytes, rec, len);
        box->len = (uint32_t)len;
        return epd_request_publish(box);
}

/* Sends the op record of req (its id and reply flag filled here) through the page or on the
 * socket inside an OpRecord. Takes op: freed on failure. */
static int op_send(struct epd_op *op, struct epd_op_request *req, struct epd_op **out)
{
        struct epd_client *c = op->client;
        uint8_t rec[EPD_OPREC_REQUEST_BYTES];
        char why[160];
        int rc = 0, len;

        pthread_mutex_lock(&c->lock);
        if (c->broken) {
                rc = epd__client_fail(c, EPD_UNAVAILABLE, "connection to the daemon is lost");
                goto out;
        }
        /* The reply in the doorbell page when the daemon offers it and no earlier op of this
         * rank still waits there (common/doorbell.h, reply mailbox). */
        const int mailbox = c->mailbox && op->group->doorbell &&
                            (c->daemon_caps & EPD__V1__CAPABILITY__CAP_REPLY_MAILBOX) &&
                            EPD_MAILBOX_CAPACITY(op->group->doorbell_bytes) > 0 &&
                            op->group->mailbox_id == 0;
        if (mailbox)
                req->flags |= EPD_OPREC_REPLY_IN_DOORBELL;
        req->id = c->next_id + 1;
        len = epd_oprec_request_encode(req, rec, sizeof(rec), why, sizeof(why));
        if (len < 0) {
                rc = epd__client_fail(c, EPD_INVALID_ARGUMENT, "%s: %s",
                                      epd_oprec_kind_name(req->kind), why);
                goto out;
        }
        c->next_id++;
        op->sent_ns = epd__now_ns();
        op->request_via_page = page_post_locked(c, op->group, rec, (size_t)len);
        if (!op->request_via_page) {
                Epd__V1__Request wire = EPD__V1__REQUEST__INIT;
                Epd__V1__OpRecord wrap = EPD__V1__OP_RECORD__INIT;
                wrap.record.data = rec;
                wrap.record.len = (size_t)len;
                wire.id = req->id;
                wire.body_case = EPD__V1__REQUEST__BODY_OP;
                wire.op = &wrap;
                rc = epd__client_send_locked(c, &wire, NULL, 0);
        }
        if (rc == 0) {
                op->seq = ++op->group->submitted;
                op->mailbox = mailbox;
                if (mailbox)
                        op->group->mailbox_id = req->id;
        }
out:
        pthread_mutex_unlock(&c->lock);
        if (rc < 0) {
                free(op);
                return rc;
        }
        op->request_id = req->id;
        *out = op;
        return 0;
}

int epd_dispatch_submit(struct epd_group *group, const struct epd_dispatch_args *args,
                        struct epd_op **out)
{
        struct epd_op_request req;
        struct epd_op *op;

        if (!group || !args || !out)
                return EPD_INVALID_ARGUMENT;
        if (args->size < sizeof(*args))
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_dispatch_args.size %zu is smaller than %zu", args->size,
                                        sizeof(*args));
        memset(&req, 0, sizeof(req));
        req.kind = EPD_OPREC_DISPATCH;
        req.group_id = group->id;
        req.rank = group->rank;
        req.handle_id = args->handle_id;
        req.num_tokens = args->num_tokens;
        req.num_topk = args->num_topk;
        req.layout = args->layout;
        req.expert_alignment = args->expert_alignment;
        req.flags = (args->zero_padding ? EPD_OPREC_ZERO_PADDING : 0) |
                    (args->use_arena ? EPD_OPREC_USE_ARENA : 0);
        req.wait_inputs = args->wait_inputs;
        req.t[EPD_OPREC_X] = args->x;
        req.t[EPD_OPREC_SCALES] = args->scales;
        req.t[EPD_OPREC_TOPK_IDX] = args->topk_idx;
        req.t[EPD_OPREC_TOPK_WEIGHTS] = args->topk_weights;
        req.t[EPD_OPREC_RECV_X] = args->recv_x;
        req.t[EPD_OPREC_RECV_SCALES] = args->recv_scales;
        req.t[EPD_OPREC_RECV_TOPK_IDX] = args->recv_topk_idx;
        req.t[EPD_OPREC_RECV_WEIGHTS] = args->recv_weights;
        req.t[EPD_OPREC_RECV_SRC] = args->recv_src;
        req.t[EPD_OPREC_RECV_TOPK_SLOT] = args->recv_topk_slot;
        req.topk_idx_dtype = epd__tensor_present(&args->topk_idx) ? args->topk_idx.dtype
                                                                   : EPD_DTYPE_INVALID;
        op = op_new(group, EPD_OPREC_DISPATCH);
        if (!op)
                return EPD_INTERNAL;
        return op_send(op, &req, out);
}

/* The oldest struct epd_combine_args (through wait_inputs), and whether a caller's size covers
 * a later field. */
#define COMBINE_ARGS_V1 (offsetof(struct epd_combine_args, wait_inputs) + sizeof(uint64_t))
#define COMBINE_ARGS_HAS(a, field)                                                                \
        ((a)->size >= offsetof(struct epd_combine_args, field) + sizeof((a)->field))

int epd_combine_submit(struct epd_group *group, const struct epd_combine_args *args,
                       struct epd_op **out)
{
        struct epd_op_request req;
        struct epd_op *op;

        if (!group || !args || !out)
                return EPD_INVALID_ARGUMENT;
        if (args->size < COMBINE_ARGS_V1)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_combine_args.size %zu is smaller than %zu", args->size,
                                        COMBINE_ARGS_V1);
        if (args->num_bias > 2)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "num_bias %u; at most 2", args->num_bias);
        memset(&req, 0, sizeof(req));
        req.kind = EPD_OPREC_COMBINE;
        req.group_id = group->id;
        req.rank = group->rank;
        req.handle_id = args->handle_id;
        req.flags = args->apply_weights ? EPD_OPREC_APPLY_WEIGHTS : 0;
        req.wait_inputs = args->wait_inputs;
        req.t[EPD_OPREC_Y] = args->y;
        req.t[EPD_OPREC_COMBINED] = args->combined;
        req.t[EPD_OPREC_COMBINED_TOPK_WEIGHTS] = args->combined_topk_weights;
        for (uint32_t b = 0; b < args->num_bias; b++)
                req.t[EPD_OPREC_BIAS0 + b] = args->bias[b];
        req.num_bias = args->num_bias;
        if (COMBINE_ARGS_HAS(args, recv_weights))
                req.t[EPD_OPREC_COMBINE_RECV_WEIGHTS] = args->recv_weights;
        if (COMBINE_ARGS_HAS(args, source_weights))
                req.t[EPD_OPREC_SOURCE_WEIGHTS] = args->source_weights;
        op = op_new(group, EPD_OPREC_COMBINE);
        if (!op)
                return EPD_INTERNAL;
        return op_send(op, &req, out);
}

/* Keeps a copy of the reply record of len bytes and decodes it into op->reply. */
static int op_take_record(struct epd_op *op, const void *bytes, size_t len)
{
        struct epd_client *c = op->client;
        char why[160];
        uint8_t *rec = malloc(len ? len : 1);

        if (!rec)
                return epd__client_fail(c, EPD_INTERNAL, "out of memory");
        memcpy(rec, bytes, len);
        if (epd_oprec_reply_decode(rec, len, &op->reply, why, sizeof(why)) < 0) {
                free(rec);
                return epd__client_fail(c, EPD_INTERNAL, "undecodable reply record of %zu bytes: %s",
                                        len, why);
        }
        if (op->reply.id != op->request_id || op->reply.kind != (uint32_t)op->kind) {
                free(rec);
                return epd__client_fail(c, EPD_INTERNAL,
                                        "daemon answered %s %llu with a %s reply to %llu",
                                        epd_oprec_kind_name((uint32_t)op->kind),
                                        (unsigned long long)op->request_id,
                                        epd_oprec_kind_name(op->reply.kind),
                                        (unsigned long long)op->reply.id);
        }
        op->record = rec;
        return 0;
}

/* An op's answer on the socket: its reply record inside an OpRecord, or a plain status (the
 * daemon refused the frame itself). Frees resp. */
static int op_take_response(struct epd_op *op, Epd__V1__Response *resp)
{
        struct epd_client *c = op->client;
        int rc;

        if (resp->body_case == EPD__V1__RESPONSE__BODY_OP && resp->op) {
                rc = op_take_record(op, resp->op->record.data, resp->op->record.len);
        } else if (resp->status != EPD__V1__STATUS_CODE__OK) {
                memset(&op->reply, 0, sizeof(op->reply));
                rc = epd__client_fail(c, epd__status_from_wire(resp->status), "%s",
                                      resp->message ? resp->message : "");
                /* Not a failure to read the reply: the op's status is the daemon's. */
                op->status = rc;
                rc = 1;
        } else {
                rc = epd__client_fail(c, EPD_INTERNAL, "daemon answered %s with %s",
                                      epd_oprec_kind_name((uint32_t)op->kind),
                                      epd__response_body_name(resp->body_case));
        }
        epd__v1__response__free_unpacked(resp, NULL);
        return rc;
}

/* Waits for an op's reply on the socket. Returns 0 with op->record set, 1 when the op got a
 * plain status (op->status), or a negative status. Not on the client's lock. */
static int socket_wait(struct epd_op *op, int timeout_ms)
{
        struct epd_client *c = op->client;
        Epd__V1__Response *resp;
        int fds[2], rc;

        pthread_mutex_lock(&c->lock);
        rc = epd__client_wait_locked(c, op->request_id, timeout_ms, &resp, fds);
        if (rc == 0)
                op->read_ns = c->last_read_ns;
        pthread_mutex_unlock(&c->lock);
        if (rc < 0)
                return rc;
        for (int i = 0; i < 2; i++)
                if (fds[i] >= 0)
                        close(fds[i]);
        return op_take_response(op, resp);
}

/* The reply that an op asked for in the doorbell page (common/doorbell.h, reply mailbox), read
 * once reply_id names it. Returns as socket_wait. Not on the client's lock. */
static int mailbox_take(struct epd_op *op, int64_t left_ms)
{
        struct epd_client *c = op->client;
        const struct epd_doorbell *db = op->group->doorbell;
        const uint32_t len = db->reply_len;
        int rc;

        if (len == EPD_MAILBOX_ON_SOCKET)
                return socket_wait(op, (int)left_ms); /* too large for the page */
        op->read_ns = epd__now_ns();
        if (len > EPD_MAILBOX_CAPACITY(op->group->doorbell_bytes))
                return epd__client_fail(c, EPD_INTERNAL,
                                        "a reply of %u bytes in the doorbell page", len);
        rc = op_take_record(op, (const uint8_t *)db->reply, len);
        if (rc == 0)
                op->via_page = 1;
        return rc;
}

/* Waits for an op's reply in the doorbell page: polls reply_id for the client's poll time, then
 * sleeps on reply_seq's futex (the protocol in daemon/net/mailbox.c), and after each wake-up polls
 * again for the spin time: the daemon wakes its sleepers when their op starts, so the reply
 * finds them polling. It also polls, once, when the op's completion doorbell has passed (the
 * reply is then on its way). Between sleeps it looks at the socket, where the reply comes
 * instead when the daemon refused the request before taking it and where a lost connection
 * shows; sleeps that end by timeout grow from 1 to 64 ms, so such a reply is seen late but not
 * missed. Returns as socket_wait. Not on the client's lock. */
static int mailbox_wait(struct epd_op *op, int timeout_ms)
{
        struct epd_client *c = op->client;
        struct epd_doorbell *db = op->group->doorbell;
        const uint64_t id = op->request_id, t0 = epd__now_ns();
        const uint64_t deadline =
                timeout_ms < 0 ? UINT64_MAX : t0 + (uint64_t)timeout_ms * 1000000ull;
        uint64_t nap_ns = 1000000, spin_until = t0 + c->poll_ns;
        Epd__V1__Response *resp;
        int fds[2], rc, finished = 0;

        for (;;) {
                const uint64_t now = epd__now_ns();
                if (__atomic_load_n(&db->reply_id, __ATOMIC_ACQUIRE) == id) {
                        int64_t left_ms = -1; /* for a reply that follows on the socket */
                        if (deadline != UINT64_MAX)
                                left_ms = now >= deadline ? 0 : (int64_t)((deadline - now) / 1000000);
                        return mailbox_take(op, left_ms);
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
                rc = epd__client_try_locked(c, id, &resp, fds);
                if (rc == 0)
                        op->read_ns = c->last_read_ns;
                pthread_mutex_unlock(&c->lock);
                if (rc == 0) {
                        for (int i = 0; i < 2; i++)
                                if (fds[i] >= 0)
                                        close(fds[i]);
                        return op_take_response(op, resp);
                }
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
        int rc, arena_rc = 0;

        if (!op)
                return EPD_INVALID_ARGUMENT;
        if (op->done)
                return op->status;
        c = op->client;
        rc = op->mailbox ? mailbox_wait(op, timeout_ms) : socket_wait(op, timeout_ms);
        pthread_mutex_lock(&c->lock);
        if (op->mailbox && (rc != EPD_TIMEOUT || c->broken))
                op->group->mailbox_id = 0; /* the page is this rank's again */
        /* Outputs in an arena that a resize changed since this client mapped it: map its new
         * segments before anyone reads them (client_internal.h). */
        if (rc == 0 && op->reply.status == EPD_OK && op->kind == EPD_OPREC_DISPATCH &&
            op->reply.arena_generation > op->group->arena_generation)
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
        if (rc == 0) {
                op->status = op->reply.status;
                snprintf(op->message, sizeof(op->message), "%s",
                         op->reply.message ? op->reply.message : "");
        } else {
                snprintf(op->message, sizeof(op->message), "%s", c->last_error);
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

/* An arena placement of a dispatch reply as a tensor and a local pointer. */
static void result_tensor(struct epd_op *op, const struct epd_oprec_output *o,
                          struct epd_tensor *t, void **ptr)
{
        memset(t, 0, sizeof(*t));
        *ptr = NULL;
        if (o->dtype == EPD_DTYPE_INVALID || op->reply.arena_region_id == 0)
                return;
        t->region_id = op->reply.arena_region_id;
        t->offset = o->offset;
        t->dtype = o->dtype;
        t->ndim = o->cols ? 2 : 1;
        t->sizes[0] = o->rows;
        t->sizes[1] = o->cols;
        *ptr = epd__client_region_ptr(op->client, t->region_id, t->offset);
}

/* The reply of a completed, successful op of kind, or NULL. */
static const struct epd_op_reply *op_result(const struct epd_op *op, int kind, int *rc)
{
        *rc = 0;
        if (!op || op->kind != kind)
                *rc = EPD_INVALID_ARGUMENT;
        else if (!op->done)
                *rc = EPD_UNAVAILABLE;
        else if (op->status < 0)
                *rc = op->status;
        else if (!op->record)
                *rc = EPD_INTERNAL;
        return *rc ? NULL : &op->reply;
}

int epd_op_dispatch_result(const struct epd_op *op_c, struct epd_dispatch_result *out)
{
        struct epd_op *op = (struct epd_op *)op_c;
        const struct epd_op_reply *r;
        int rc;

        if (!out)
                return EPD_INVALID_ARGUMENT;
        if (!(r = op_result(op, EPD_OPREC_DISPATCH, &rc)))
                return rc;
        memset(out, 0, sizeof(*out));
        out->op_number = r->op_number;
        out->handle_id = r->handle_id;
        out->num_recv_tokens = (int32_t)r->num_tokens;
        out->num_expanded_rows = (int32_t)r->num_expanded_rows;
        out->num_local_experts = r->num_local_experts;
        out->num_recv_tokens_per_expert = r->per_expert;
        out->num_recv_tokens_per_expert_aligned = r->per_expert_aligned;
        out->world_size = r->world_size;
        out->rank_prefix = r->rank_prefix;
        out->exec_ns = r->exec_ns;
        out->queue_ns = r->queue_ns;
        out->kernel_ns = r->kernel_ns;
        result_tensor(op, &r->out[EPD_OPREC_OUT_RECV_X], &out->recv_x, &out->recv_x_ptr);
        result_tensor(op, &r->out[EPD_OPREC_OUT_RECV_SCALES], &out->recv_scales,
                      &out->recv_scales_ptr);
        result_tensor(op, &r->out[EPD_OPREC_OUT_RECV_TOPK_IDX], &out->recv_topk_idx,
                      &out->recv_topk_idx_ptr);
        result_tensor(op, &r->out[EPD_OPREC_OUT_RECV_WEIGHTS], &out->recv_weights,
                      &out->recv_weights_ptr);
        result_tensor(op, &r->out[EPD_OPREC_OUT_RECV_SRC], &out->recv_src, &out->recv_src_ptr);
        result_tensor(op, &r->out[EPD_OPREC_OUT_RECV_TOPK_SLOT], &out->recv_topk_slot,
                      &out->recv_topk_slot_ptr);
        return 0;
}

int epd_op_combine_result(const struct epd_op *op, struct epd_combine_result *out)
{
        const struct epd_op_reply *r;
        int rc;

        if (!out)
                return EPD_INVALID_ARGUMENT;
        if (!(r = op_result(op, EPD_OPREC_COMBINE, &rc)))
                return rc;
        out->op_number = r->op_number;
        out->num_tokens = (uint32_t)r->num_tokens;
        out->exec_ns = r->exec_ns;
        out->queue_ns = r->queue_ns;
        out->kernel_ns = r->kernel_ns;
        return 0;
}

int epd_op_timeline(const struct epd_op *op, struct epd_op_timeline *out)
{
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
#undef COVERS
        out->submitted_ns = op->sent_ns;
        out->reply_read_ns = op->read_ns;
        if (op->record) {
                const struct epd_op_reply *r = &op->reply;
                out->exec_ns = r->exec_ns;
                out->kernel_ns = r->kernel_ns;
                out->received_ns = r->received_ns;
                out->launched_ns = r->launched_ns;
                out->exec_start_ns = r->exec_start_ns;
                out->completed_ns = r->completed_ns;
                out->replied_ns = r->replied_ns;
        }
        return 0;
}

void epd_op_free(struct epd_op *op)
{
        if (!op)
                return;
        if (!op->done)
                (void)epd_op_wait(op, -1);
        free(op->record);
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
