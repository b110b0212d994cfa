/* fuzz_request.c - libFuzzer target: every request handler, driven through real connections of
 * a real daemon object with the host backend.
 *
 * One daemon (struct epdd_daemon, host backend, its own libuv loop) is set up once. Each input
 * is a script (fuzz_script.h) run by up to three clients, each on its own socketpair whose
 * daemon end goes through epd_conn_accept exactly as an accepted connection does. A client sends
 * a valid Hello first, then frames built from the script: raw bodies under a valid header, raw
 * records, or Requests of every type (admin verbs too: the clients run as root) whose fields
 * come from the input, with ids of groups, regions, handles and clients that the client learnt
 * from the daemon's replies, so that ops really launch and run on the host backend. Clients
 * may also post dispatch and combine records (common/oprec.h) in their doorbell pages instead of
 * sending them (with a wrong length if the script says so), send or post raw op records, ring their doorbells, stop reading their
 * replies, or disconnect mid-op. After each
 * command the loop runs until no op executes, unless the input asks for commands that overlap
 * executing ops (EPD_FUZZ_OVERLAP).
 * At the end every client disconnects and the daemon must be back where it started: no
 * connection, no group, no libuv handle but the backend's, and no open fd more than before
 * (abort otherwise); ASan and LeakSanitizer watch the rest.
 *
 * EPD_FUZZ_VERBOSE=1 prints every reply, for checking what a seed reaches.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "daemon.h"
#include "doorbell.h"
#include "frame.h"
#include "fuzz_script.h"
#include "log.h"
#include "oprec.h"
#include "routing.h"
#include "util.h"

#define MAX_BINDINGS 8
#define MAX_REGIONS 16
#define MAX_HANDLES 16
#define MAX_PENDING 32
#define SETTLE_MS 200       /* longest wait for executing ops after one command */

/* The input's EPD_FUZZ_OVERLAP: commands do not wait for executing ops. */
static unsigned settle_ms = SETTLE_MS;
#define FINISH_MS 10000     /* longest wait for the daemon to release everything at the end */
#define SNDBUF_BYTES 40000  /* the kernel doubles it: room for one 64 KiB frame */

/* ---- input reader ---- */

struct reader {
        const uint8_t *p;
        size_t left;
};

static uint8_t rd_u8(struct reader *r)
{
        if (!r->left)
                return 0;
        r->left--;
        return *r->p++;
}

static uint16_t rd_u16(struct reader *r)
{
        uint16_t lo = rd_u8(r);
        return (uint16_t)(lo | (rd_u8(r) << 8));
}

static uint32_t rd_u32(struct reader *r)
{
        uint32_t lo = rd_u16(r);
        return lo | ((uint32_t)rd_u16(r) << 16);
}

static uint64_t rd_u64(struct reader *r)
{
        uint64_t lo = rd_u32(r);
        return lo | ((uint64_t)rd_u32(r) << 32);
}

/* Up to len bytes in place; *got says how many there were. */
static const uint8_t *rd_bytes(struct reader *r, size_t len, size_t *got)
{
        const uint8_t *p = r->p;

        if (len > r->left)
                len = r->left;
        r->p += len;
        r->left -= len;
        *got = len;
        return p;
}

/* ---- what each client knows ---- */

struct fz_binding {
        uint64_t group_id;
        uint32_t rank;
        uint32_t world_size, num_experts, hidden, max_tokens, max_topk, scale_block;
        enum epd_dtype dtype;
        struct epd_doorbell *doorbell;  /* the client's mapping of the doorbell page */
};

struct fz_region {
        uint64_t id;
        uint64_t size;
};

struct fz_handle {
        uint64_t group_id, id;
        uint32_t rank;
        int64_t rows;                   /* rows of the layout at this rank */
        uint32_t num_tokens;
        uint32_t num_topk;
};

/* A request whose reply carries ids the client wants to remember. */
struct fz_pending {
        uint64_t request_id;
        int is_dispatch;
        uint64_t group_id;
        uint32_t rank, num_tokens, num_topk;
        int expand;
};

struct fz_client {
        int fd;                         /* client end, -1 when disconnected */
        uint64_t client_id;             /* from Welcome */
        uint64_t next_id;
        struct fz_binding bindings[MAX_BINDINGS];
        unsigned num_bindings;
        struct fz_region regions[MAX_REGIONS];
        unsigned num_regions;
        struct fz_handle handles[MAX_HANDLES];
        unsigned num_handles;
        struct fz_pending pending[MAX_PENDING];
        unsigned num_pending;
        int muted;                      /* replies are left unread */
};

static struct epdd_daemon daemon_state;
static struct epdd_daemon *const d = &daemon_state;
static uv_loop_t loop;
static struct fz_client clients[EPD_FUZZ_MAX_CLIENTS];
static unsigned num_clients;
static int verbose;
static uint8_t *reply_buf;
static size_t reply_buf_len;

static void fail(const char *what)
{
        fprintf(stderr, "fuzz_request: %s\n", what);
        abort();
}

static uint64_t now_ms(void)
{
        return epd__now_ns() / 1000000;
}

static unsigned count_open_fds(void)
{
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *de;
        unsigned n = 0;

        if (!dir)
                fail("cannot open /proc/self/fd");
        while ((de = readdir(dir)) != NULL)
                if (de->d_name[0] != '.')
                        n++;
        closedir(dir);
        return n - 1;
}

static void count_handle(uv_handle_t *h, void *arg)
{
        (void)h;
        (*(unsigned *)arg)++;
}

static unsigned count_uv_handles(void)
{
        unsigned n = 0;

        uv_walk(&loop, count_handle, &n);
        return n;
}

/* ---- replies ---- */

static void forget_binding(struct fz_client *cl, unsigned i)
{
        if (cl->bindings[i].doorbell)
                munmap(cl->bindings[i].doorbell, EPD_DOORBELL_BYTES);
        cl->bindings[i] = cl->bindings[--cl->num_bindings];
}

static void add_region(struct fz_client *cl, uint64_t id, uint64_t size)
{
        if (cl->num_regions == MAX_REGIONS)
                memmove(cl->regions, cl->regions + 1, sizeof(cl->regions[0]) * --cl->num_regions);
        cl->regions[cl->num_regions++] = (struct fz_region){ .id = id, .size = size };
}

static struct fz_pending *take_pending(struct fz_client *cl, uint64_t id)
{
        static struct fz_pending found;

        for (unsigned i = 0; i < cl->num_pending; i++) {
                if (cl->pending[i].request_id == id) {
                        found = cl->pending[i];
                        cl->pending[i] = cl->pending[--cl->num_pending];
                        return &found;
                }
        }
        return NULL;
}

static void add_pending(struct fz_client *cl, const struct fz_pending *p)
{
        if (cl->num_pending == MAX_PENDING)
                cl->pending[0] = cl->pending[--cl->num_pending];
        cl->pending[cl->num_pending++] = *p;
}

static void on_joined(struct fz_client *cl, const Epd__V1__GroupJoined *j, int *fds,
                      unsigned num_fds)
{
        struct fz_binding *b;

        if (!j->config)
                fail("GroupJoined without a config");
        if (num_fds < 1 || (j->arena_bytes && num_fds != 2))
                fail("GroupJoined without its doorbell/arena fds");
        if (cl->num_bindings == MAX_BINDINGS)
                forget_binding(cl, 0);
        b = &cl->bindings[cl->num_bindings++];
        memset(b, 0, sizeof(*b));
        b->group_id = j->group_id;
        b->rank = j->rank;
        b->world_size = j->config->world_size;
        b->num_experts = j->config->num_experts;
        b->hidden = j->config->hidden;
        b->max_tokens = j->config->max_tokens_per_rank;
        b->max_topk = j->config->max_topk;
        b->scale_block = j->config->scale_block;
        b->dtype = (enum epd_dtype)j->config->dispatch_dtype;
        void *page = mmap(NULL, EPD_DOORBELL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
        if (page == MAP_FAILED)
                fail("cannot map the doorbell page the daemon sent");
        b->doorbell = page;
        if (j->arena_region_id)
                add_region(cl, j->arena_region_id, j->arena_bytes);
}

static void on_dispatched(struct fz_client *cl, const struct fz_pending *p,
                          const struct epd_op_reply *dr)
{
        struct fz_handle *h;

        for (unsigned i = 0; i < cl->num_handles; i++)
                if (cl->handles[i].group_id == p->group_id && cl->handles[i].id == dr->handle_id)
                        return; /* a cached dispatch refreshed it */
        if (cl->num_handles == MAX_HANDLES)
                memmove(cl->handles, cl->handles + 1, sizeof(cl->handles[0]) * --cl->num_handles);
        h = &cl->handles[cl->num_handles++];
        h->group_id = p->group_id;
        h->id = dr->handle_id;
        h->rank = p->rank;
        h->rows = p->expand ? dr->num_expanded_rows : dr->num_tokens;
        h->num_tokens = p->num_tokens;
        h->num_topk = p->num_topk;
}

/* An op's reply record: it must decode (the daemon wrote it); a dispatch's success names its
 * handle. */
static void on_op_reply(struct fz_client *cl, const struct fz_pending *p,
                        const ProtobufCBinaryData *bytes)
{
        uint64_t rec[(EPD_OPREC_REPLY_HEADER_BYTES + EPD_OPREC_MESSAGE_MAX) / 8 + 64];
        struct epd_op_reply rep;
        char why[160];

        if (bytes->len > sizeof(rec))
                return; /* a large dispatch reply: not needed */
        memcpy(rec, bytes->data, bytes->len);
        if (epd_oprec_reply_decode((const uint8_t *)rec, bytes->len, &rep, why, sizeof(why)) < 0) {
                fprintf(stderr, "fuzz_request: undecodable reply record: %s\n", why);
                abort();
        }
        if (verbose)
                fprintf(stderr, "    %s reply status=%d %s\n", epd_oprec_kind_name(rep.kind),
                        rep.status, rep.message ? rep.message : "");
        if (p && p->is_dispatch && rep.status == EPD_OK && rep.kind == EPD_OPREC_DISPATCH)
                on_dispatched(cl, p, &rep);
}

static void handle_reply(struct fz_client *cl, const uint8_t *body, size_t len, int *fds,
                         unsigned num_fds)
{
        Epd__V1__Response *resp = epd__v1__response__unpack(NULL, len, body);
        struct fz_pending *p;

        if (!resp)
                fail("the daemon sent a body that is not a Response");
        if (verbose)
                fprintf(stderr, "  client %d reply id=%llu status=%d body=%d fds=%u %s\n",
                        (int)(cl - clients), (unsigned long long)resp->id, (int)resp->status,
                        (int)resp->body_case, num_fds, resp->message ? resp->message : "");
        p = take_pending(cl, resp->id);
        if (resp->body_case == EPD__V1__RESPONSE__BODY_OP && resp->op)
                on_op_reply(cl, p, &resp->op->record);
        if (resp->status == EPD__V1__STATUS_CODE__OK) {
                switch (resp->body_case) {
                case EPD__V1__RESPONSE__BODY_WELCOME:
                        cl->client_id = resp->welcome->client_id;
                        break;
                case EPD__V1__RESPONSE__BODY_GROUP_JOINED:
                        on_joined(cl, resp->group_joined, fds, num_fds);
                        break;
                case EPD__V1__RESPONSE__BODY_REGION_REGISTERED:
                        /* The size is unknown here; tensors are checked against it anyway. */
                        add_region(cl, resp->region_registered->region_id, 0);
                        break;
                default:
                        break;
                }
        }
        epd__v1__response__free_unpacked(resp, NULL);
}

/* Reads every reply waiting for the client, closing every fd that came with it. */
static void drain(struct fz_client *cl)
{
        for (;;) {
                struct epd_frame frame;
                const char *why = NULL;
                int rc;

                if (cl->fd < 0 || cl->muted)
                        return;
                rc = epd_frame_recv(cl->fd, reply_buf, reply_buf_len, d->cfg.max_frame_bytes,
                                    EPD_FRAME_MAX_FDS, &frame, &why);
                if (rc == -EAGAIN || rc == -ECONNRESET)
                        return;
                if (rc < 0) {
                        fprintf(stderr, "fuzz_request: bad frame from the daemon: %s (%s)\n",
                                why ? why : "", strerror(-rc));
                        abort();
                }
                handle_reply(cl, frame.body, frame.body_len, frame.fds, frame.num_fds);
                epd_frame_close_fds(&frame);
        }
}

static void drain_all(void)
{
        for (unsigned i = 0; i < num_clients; i++)
                drain(&clients[i]);
}

static int any_executing(void)
{
        struct epd_list *pos;

        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                if (g->executing)
                        return 1;
        }
        return 0;
}

static void nap(void)
{
        struct timespec ts = { 0, 100000 };

        nanosleep(&ts, NULL);
}

/* Runs the loop until no op executes (or ms passed) and reads every reply. */
static void settle(unsigned ms)
{
        uint64_t deadline = now_ms() + ms;

        for (;;) {
                uv_run(&loop, UV_RUN_NOWAIT);
                drain_all();
                uv_run(&loop, UV_RUN_NOWAIT);
                drain_all();
                if (!any_executing() || now_ms() > deadline)
                        return;
                nap();
        }
}

/* ---- sending ---- */

/* Sends with retries while the socket is full (the daemon reads on the next loop turn). */
static void send_record(struct fz_client *cl, const void *data, size_t len, const int *fds,
                        unsigned num_fds)
{
        union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * 32)];
        } control;
        struct iovec iov = { .iov_base = (void *)data, .iov_len = len };
        struct msghdr msg;

        if (cl->fd < 0)
                return;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        if (num_fds) {
                struct cmsghdr *cmsg;
                memset(&control, 0, sizeof(control));
                msg.msg_control = control.buf;
                msg.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
                cmsg = CMSG_FIRSTHDR(&msg);
                cmsg->cmsg_level = SOL_SOCKET;
                cmsg->cmsg_type = SCM_RIGHTS;
                cmsg->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
                memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * num_fds);
        }
        for (int tries = 0; tries < 100; tries++) {
                if (sendmsg(cl->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) >= 0 || errno != EAGAIN)
                        return;
                settle(0);
        }
}

static void send_body(struct fz_client *cl, const void *body, size_t len, const int *fds,
                      unsigned num_fds, uint16_t version)
{
        struct epd_frame_header h = {
                .magic = EPD_FRAME_MAGIC,
                .version = version,
                .num_fds = (uint16_t)num_fds,
                .length = (uint32_t)len,
        };
        uint8_t *rec = malloc(EPD_FRAME_HEADER_BYTES + len);

        if (!rec)
                fail("out of memory");
        epd_frame_header_encode(&h, rec);
        if (len)
                memcpy(rec + EPD_FRAME_HEADER_BYTES, body, len);
        send_record(cl, rec, EPD_FRAME_HEADER_BYTES + len, fds, num_fds);
        free(rec);
}

static uint64_t send_request(struct fz_client *cl, Epd__V1__Request *req, const int *fds,
                             unsigned num_fds)
{
        size_t len;
        uint8_t *buf;

        req->id = ++cl->next_id;
        len = epd__v1__request__get_packed_size(req);
        buf = malloc(len ? len : 1);
        if (!buf)
                fail("out of memory");
        epd__v1__request__pack(req, buf);
        send_body(cl, buf, len, fds, num_fds, EPD_PROTOCOL_VERSION);
        free(buf);
        return req->id;
}

/* Sends the op record rec of len bytes inside an OpRecord, or with EPD_FUZZ_PAGE in flags posts
 * it in b's request box (fuzz_script.h), as a client may write anything there. */
static void send_or_post_record(struct fz_client *cl, const struct fz_binding *b, uint64_t id,
                                const uint8_t *rec, size_t len, uint8_t flags)
{
        struct epd_request_box *box =
                b->doorbell ? epd_doorbell_request_box(b->doorbell, EPD_DOORBELL_BYTES) : NULL;

        if (!(flags & EPD_FUZZ_PAGE) || !box || len > EPD_REQUEST_CAPACITY) {
                Epd__V1__Request req = EPD__V1__REQUEST__INIT;
                Epd__V1__OpRecord wrap = EPD__V1__OP_RECORD__INIT;
                uint8_t *buf;
                size_t n;

                wrap.record.data = (uint8_t *)rec;
                wrap.record.len = len;
                req.id = id;
                req.body_case = EPD__V1__REQUEST__BODY_OP;
                req.op = &wrap;
                n = epd__v1__request__get_packed_size(&req);
                if (!(buf = malloc(n ? n : 1)))
                        fail("out of memory");
                epd__v1__request__pack(&req, buf);
                send_body(cl, buf, n, NULL, 0, EPD_PROTOCOL_VERSION);
                free(buf);
                return;
        }
        memcpy(box->bytes, rec, len);
        if (flags & 0x08) {
                const size_t bad[4] = { len, len / 2, 0, EPD_REQUEST_CAPACITY + 1 };
                len = bad[id % 4];
        }
        box->len = (uint32_t)len;
        __atomic_store_n(&box->state, EPD_REQUEST_POSTED, __ATOMIC_SEQ_CST);
        if (verbose)
                fprintf(stderr, "  request id=%llu posted in the doorbell page, %zu bytes\n",
                        (unsigned long long)id, len);
}

/* Encodes q (its id assigned here) and sends or posts it. A request the encoder refuses is
 * not sent (raw op records reach the daemon's decoder instead). Returns the id, 0 if none. */
static uint64_t send_or_post(struct fz_client *cl, const struct fz_binding *b,
                             struct epd_op_request *q, uint8_t flags)
{
        uint8_t rec[EPD_OPREC_REQUEST_BYTES];
        char why[160];

        q->id = ++cl->next_id;
        int len = epd_oprec_request_encode(q, rec, sizeof(rec), why, sizeof(why));
        if (len < 0) {
                if (verbose)
                        fprintf(stderr, "  %s not sent: %s\n", epd_oprec_kind_name(q->kind), why);
                return 0;
        }
        send_or_post_record(cl, b, q->id, rec, (size_t)len, flags);
        return q->id;
}

static void send_hello(struct fz_client *cl, uint8_t flags, const char *name)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Hello h = EPD__V1__HELLO__INIT;

        h.protocol_version = (flags & 1) ? EPD_PROTOCOL_VERSION + 1 : EPD_PROTOCOL_VERSION;
        h.client_name = (char *)name;
        h.capabilities = EPD__V1__CAPABILITY__CAP_HOST_REGIONS |
                         ((flags & 2) ? EPD__V1__CAPABILITY__CAP_CUDA_REGIONS : 0);
        req.body_case = EPD__V1__REQUEST__BODY_HELLO;
        req.hello = &h;
        send_request(cl, &req, NULL, 0);
}

/* ---- connections ---- */

static void client_connect(struct fz_client *cl, int hello)
{
        int sv[2];

        memset(cl, 0, sizeof(*cl));
        cl->fd = -1;
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) < 0)
                fail("socketpair failed");
        /* A smaller send buffer (still above the largest frame), so that a client that does
         * not read fills it, and the output queue behind it, within a short script. */
        int sndbuf = SNDBUF_BYTES;
        if (setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)) < 0)
                fail("SO_SNDBUF failed");
        /* As the listener does: the daemon's end is non-blocking and close-on-exec. */
        if (epd_conn_accept(d, sv[0]) < 0)
                fail("epd_conn_accept refused a fresh connection");
        cl->fd = sv[1];
        if (hello)
                send_hello(cl, 0, "fuzz");
}

static void client_disconnect(struct fz_client *cl)
{
        while (cl->num_bindings)
                forget_binding(cl, cl->num_bindings - 1);
        if (cl->fd >= 0)
                close(cl->fd);
        cl->fd = -1;
        cl->num_regions = cl->num_handles = cl->num_pending = 0;
}

/* ---- building requests from the script ---- */

static const char *group_name(unsigned i)
{
        static const char *const names[] = { "g0", "g1", "g2", "g3", "nope" };
        return names[i < 4 ? i : 4];
}

static void pick_secret(uint8_t sel, ProtobufCBinaryData *out)
{
        static uint8_t good[64] = "fuzz-group-secret-0123456789abcdefghijklmnopqrstuvwxyz-0123456";
        static uint8_t other[16] = "another-secret!!";

        switch (sel) {
        case 0: out->data = good; out->len = 16; break;
        case 1: out->data = good; out->len = 64; break;
        case 2: out->data = good; out->len = 8; break;
        default: out->data = other; out->len = 16; break;
        }
}

static const char *pick_uuid(uint8_t sel)
{
        if (sel == 0)
                return NULL;
        if (sel <= d->backend->num_devices)
                return d->backend->devices[sel - 1].uuid;
        return "HOST-no-such-device";
}

static void read_config(struct reader *r, Epd__V1__GroupConfig *c)
{
        static const uint32_t hidden[] = EPD_FUZZ_HIDDEN_TABLE;
        uint8_t ws = rd_u8(r);

        epd__v1__group_config__init(c);
        if (ws & 0x80) {
                c->world_size = rd_u32(r);
                c->num_experts = rd_u32(r);
                c->hidden = rd_u32(r);
                c->max_tokens_per_rank = rd_u32(r);
                c->max_topk = rd_u32(r);
                c->dispatch_dtype = (Epd__V1__DType)rd_u32(r);
                c->scale_block = rd_u32(r);
                c->op_timeout_ms = rd_u32(r) % 64;
                /* Up to 1 MiB: an arena is memory the daemon maps for every rank. */
                c->arena_bytes = rd_u32(r) % (1u << 20);
                return;
        }
        c->world_size = 1 + ws % 4;
        c->num_experts = c->world_size * (1 + rd_u8(r) % 8);
        c->hidden = hidden[rd_u8(r) % EPD_FUZZ_HIDDEN_COUNT];
        c->max_tokens_per_rank = rd_u8(r) % 17;
        c->max_topk = 1 + rd_u8(r) % 4;
        uint8_t dt = rd_u8(r);
        c->dispatch_dtype = dt == 0 ? EPD__V1__DTYPE__BF16
                          : dt == 1 ? EPD__V1__DTYPE__FP8_E4M3
                                    : (Epd__V1__DType)dt;
        c->scale_block = 8u * rd_u8(r);
        c->op_timeout_ms = 1 + rd_u8(r) % 16;
        c->arena_bytes = 1024u * rd_u8(r);
}

static struct fz_binding *pick_binding(struct fz_client *cl, uint8_t sel,
                                       struct fz_binding *scratch)
{
        if (sel < cl->num_bindings)
                return &cl->bindings[sel];
        /* An id the client does not hold (or a group that does not exist). */
        memset(scratch, 0, sizeof(*scratch));
        scratch->group_id = sel - cl->num_bindings;
        scratch->world_size = 1;
        scratch->num_experts = 1;
        scratch->hidden = 16;
        scratch->max_topk = 1;
        scratch->dtype = EPD_DTYPE_BF16;
        return scratch;
}

static uint32_t pick_rank(const struct fz_binding *b, uint8_t sel)
{
        return sel == 0 ? b->rank : (uint32_t)sel - 1;
}

static uint64_t pick_handle(struct reader *r, struct fz_client *cl, uint8_t sel,
                            const struct fz_binding *b, const struct fz_handle **found)
{
        unsigned n = 0;

        *found = NULL;
        if (sel == 0)
                return 0;
        if (sel == 255)
                return rd_u64(r);
        /* The (sel-1)-th handle of this group, counting around. */
        for (unsigned i = 0; i < cl->num_handles; i++)
                n += cl->handles[i].group_id == b->group_id;
        if (n == 0)
                return sel;
        unsigned want = (unsigned)(sel - 1) % n;
        for (unsigned i = 0; i < cl->num_handles; i++) {
                if (cl->handles[i].group_id != b->group_id)
                        continue;
                if (want-- == 0) {
                        *found = &cl->handles[i];
                        return cl->handles[i].id;
                }
        }
        return sel;
}

/* A tensor built from the script around a natural shape; absent (region 0) when it says so. */
static struct epd_tensor read_tensor(struct reader *r, struct fz_client *cl, uint64_t rows,
                                     uint64_t cols, enum epd_dtype dtype)
{
        uint8_t region = rd_u8(r);
        uint16_t offset;
        uint8_t shape;
        uint64_t row_elems;
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        if (region == 0)
                return t;
        if (region == 255)
                t.region_id = rd_u64(r);
        else if (cl->num_regions)
                t.region_id = cl->regions[(region - 1) % cl->num_regions].id;
        else
                t.region_id = region;
        offset = rd_u16(r);
        shape = rd_u8(r);
        t.offset = (shape & 0x80) ? 0 : offset;
        switch (shape & 3) {
        case 0: break;
        case 1: rows += rd_u8(r); break;
        case 2: rows = rd_u8(r); break;
        default: rows = rd_u32(r); break;
        }
        switch ((shape >> 2) & 3) {
        case 0: break;
        case 1: cols = rd_u8(r); break;
        case 2: cols = cols ? 0 : 1; break; /* the other dimensionality */
        default: cols = cols ? cols : 1; break;
        }
        t.sizes[0] = rows;
        t.ndim = 1;
        if (cols) {
                t.sizes[1] = cols;
                t.ndim = 2;
        }
        if (((shape >> 2) & 3) == 3) {
                t.sizes[2] = 1;
                t.ndim = 3;
        }
        row_elems = cols ? cols : 1;
        if (shape & 0x10) {
                t.strides[0] = row_elems + rd_u8(r);
                for (uint32_t i = 1; i < t.ndim; i++)
                        t.strides[i] = 1;
        }
        if (shape & 0x40) {
                for (uint32_t i = 0; i + 1 < t.ndim; i++)
                        t.strides[i] = t.strides[i] ? t.strides[i] : row_elems * 2;
                t.strides[t.ndim - 1] = 2;
        }
        t.dtype = (enum epd_dtype)((shape & 0x20) ? rd_u8(r) : dtype);
        return t;
}

/* A memfd of the given size filled as the script says; -1 on failure. */
static int make_memfd(uint64_t bytes, struct reader *r)
{
        uint8_t mode = rd_u8(r) % EPD_FUZZ_FILL_COUNT;
        uint8_t a = rd_u8(r), b = rd_u8(r), c = rd_u8(r);
        int fd = memfd_create("fuzz-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        uint8_t *p;

        if (fd < 0)
                return -1;
        if (ftruncate(fd, (off_t)bytes) < 0) {
                close(fd);
                return -1;
        }
        if (bytes == 0 || mode == EPD_FUZZ_FILL_ZERO)
                return fd;
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
                close(fd);
                return -1;
        }
        uint64_t ka = a ? a : 1, kc = c ? c : 1;
        switch (mode) {
        case EPD_FUZZ_FILL_I32:
                for (uint64_t k = 0; k < bytes / 4; k++) {
                        int32_t v = (int32_t)(((k % ka) * b + k / ka) % kc);
                        memcpy(p + 4 * k, &v, 4);
                }
                break;
        case EPD_FUZZ_FILL_I64:
                for (uint64_t k = 0; k < bytes / 8; k++) {
                        int64_t v = (int64_t)(((k % ka) * b + k / ka) % kc);
                        memcpy(p + 8 * k, &v, 8);
                }
                break;
        case EPD_FUZZ_FILL_F32:
                for (uint64_t k = 0; k < bytes / 4; k++) {
                        float v = 1.0f;
                        memcpy(p + 4 * k, &v, 4);
                }
                break;
        default:
                for (uint64_t k = 0; k < bytes; k++)
                        p[k] = k % 3 == 0 ? a : k % 3 == 1 ? b : c;
                break;
        }
        munmap(p, bytes);
        return fd;
}

static void cmd_group_create(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__GroupCreate m = EPD__V1__GROUP_CREATE__INIT;
        Epd__V1__GroupConfig cfg;

        m.name = (char *)group_name(rd_u8(r) % 4);
        pick_secret(rd_u8(r), &m.secret);
        read_config(r, &cfg);
        m.config = &cfg;
        m.rank = rd_u8(r);
        m.device = rd_u8(r);
        m.device_uuid = (char *)pick_uuid(rd_u8(r));
        req.body_case = EPD__V1__REQUEST__BODY_GROUP_CREATE;
        req.group_create = &m;
        send_request(cl, &req, NULL, 0);
}

static void cmd_group_join(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__GroupJoin m = EPD__V1__GROUP_JOIN__INIT;

        m.name = (char *)group_name(rd_u8(r) % 8);
        pick_secret(rd_u8(r), &m.secret);
        m.rank = rd_u8(r);
        m.device = rd_u8(r);
        m.device_uuid = (char *)pick_uuid(rd_u8(r));
        req.body_case = EPD__V1__REQUEST__BODY_GROUP_JOIN;
        req.group_join = &m;
        send_request(cl, &req, NULL, 0);
}

static void cmd_group_leave(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__GroupLeave m = EPD__V1__GROUP_LEAVE__INIT;
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);

        m.group_id = b->group_id;
        m.rank = pick_rank(b, rd_u8(r));
        req.body_case = EPD__V1__REQUEST__BODY_GROUP_LEAVE;
        req.group_leave = &m;
        send_request(cl, &req, NULL, 0);
}

static void cmd_region_register(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__RegionRegister m = EPD__V1__REGION_REGISTER__INIT;
        uint8_t kind = rd_u8(r);
        uint64_t size = 16ull * rd_u16(r);
        uint64_t offset = rd_u16(r);
        uint8_t file = rd_u8(r);
        uint64_t file_bytes = file == 0 ? offset + size
                            : file == 1 ? (offset + size) / 2
                                        : offset + size + file;
        int fds[2] = { -1, -1 };
        unsigned num_fds = 0;
        int sv[2];

        /* The fill bytes are read whatever the fd choice, so the script's layout is fixed. */
        int memfd = make_memfd(file_bytes, r);
        uint8_t fd_sel = rd_u8(r) % 5;
        m.kind = kind == 0 ? EPD__V1__REGION_KIND__HOST_MEMFD : (Epd__V1__RegionKind)(kind % 5);
        m.size = size;
        m.offset = offset;
        m.device = rd_u8(r);
        switch (fd_sel) {
        case 0:
                fds[num_fds++] = memfd;
                memfd = -1;
                break;
        case 1:
                break;
        case 2:
                fds[num_fds++] = memfd;
                fds[num_fds++] = dup(memfd);
                memfd = -1;
                break;
        case 3:
                if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) {
                        fds[num_fds++] = sv[0];
                        close(sv[1]);
                }
                break;
        default:
                fds[num_fds++] = memfd_create("fuzz-unsealable", MFD_CLOEXEC);
                if (fds[0] >= 0 && ftruncate(fds[0], (off_t)file_bytes) < 0) {
                        close(fds[0]);
                        fds[0] = -1;
                }
                if (fds[0] < 0)
                        num_fds = 0;
                break;
        }
        for (unsigned i = 0; i < num_fds; i++)
                if (fds[i] < 0)
                        num_fds = 0;
        if (m.kind == EPD__V1__REGION_KIND__CUDA_IPC) {
                static uint8_t ipc[64];
                m.ipc_handle.data = ipc;
                m.ipc_handle.len = kind % 2 ? sizeof(ipc) : 8;
        }
        req.body_case = EPD__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &m;
        send_request(cl, &req, fds, num_fds);
        /* The frame carried duplicates; the client's own copies go now. */
        for (unsigned i = 0; i < 2; i++)
                if (fds[i] >= 0)
                        close(fds[i]);
        if (memfd >= 0)
                close(memfd);
}

static void cmd_region_release(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__RegionRelease m = EPD__V1__REGION_RELEASE__INIT;
        uint8_t sel = rd_u8(r);

        m.region_id = sel < cl->num_regions ? cl->regions[sel].id : sel;
        req.body_case = EPD__V1__REQUEST__BODY_REGION_RELEASE;
        req.region_release = &m;
        send_request(cl, &req, NULL, 0);
        if (sel < cl->num_regions)
                cl->regions[sel] = cl->regions[--cl->num_regions];
}

static void cmd_size_hint(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__SizeHint m = EPD__V1__SIZE_HINT__INIT;
        Epd__V1__GroupConfig cfg;

        read_config(r, &cfg);
        m.config = &cfg;
        m.expert_alignment = rd_u16(r);
        req.body_case = EPD__V1__REQUEST__BODY_SIZE_HINT;
        req.size_hint = &m;
        send_request(cl, &req, NULL, 0);
}

static void cmd_empty(struct fz_client *cl, uint8_t op)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__StatusRequest st = EPD__V1__STATUS_REQUEST__INIT;
        Epd__V1__ListGroups lg = EPD__V1__LIST_GROUPS__INIT;
        Epd__V1__ListClients lc = EPD__V1__LIST_CLIENTS__INIT;
        Epd__V1__StatsRequest sr = EPD__V1__STATS_REQUEST__INIT;

        switch (op) {
        case EPD_FUZZ_OP_STATUS:
                req.body_case = EPD__V1__REQUEST__BODY_STATUS;
                req.status = &st;
                break;
        case EPD_FUZZ_OP_LIST_GROUPS:
                req.body_case = EPD__V1__REQUEST__BODY_LIST_GROUPS;
                req.list_groups = &lg;
                break;
        case EPD_FUZZ_OP_LIST_CLIENTS:
                req.body_case = EPD__V1__REQUEST__BODY_LIST_CLIENTS;
                req.list_clients = &lc;
                break;
        default:
                req.body_case = EPD__V1__REQUEST__BODY_STATS;
                req.stats = &sr;
                break;
        }
        send_request(cl, &req, NULL, 0);
}

static void cmd_dispatch(struct reader *r, struct fz_client *cl)
{
        struct epd_op_request m = { .kind = EPD_OPREC_DISPATCH };
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);
        const struct fz_handle *h;
        struct fz_pending p = { .is_dispatch = 1 };

        m.group_id = b->group_id;
        m.rank = pick_rank(b, rd_u8(r));
        m.handle_id = pick_handle(r, cl, rd_u8(r), b, &h);
        m.num_tokens = rd_u8(r);
        if (h)
                m.num_tokens = h->num_tokens + m.num_tokens % 2; /* mostly what the handle has */
        uint8_t flags = rd_u8(r);
        m.layout = (flags & 1) ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND;
        m.flags = ((flags & 2) ? EPD_OPREC_ZERO_PADDING : 0) | ((flags & 4) ? EPD_OPREC_USE_ARENA : 0);
        if (flags & 8)
                m.layout = (enum epd_layout)rd_u8(r);
        m.wait_inputs = (flags & 16) ? 1 : 0;
        m.expert_alignment = rd_u16(r);
        uint32_t K = b->max_topk;
        if (flags & 64) {
                m.num_topk = rd_u8(r);
                K = m.num_topk;
        }
        enum epd_dtype topk_dtype = (flags & 32) ? EPD_DTYPE_INT64 : EPD_DTYPE_INT32;
        uint32_t R = b->world_size, H = b->hidden, n = m.num_tokens;
        uint32_t L = b->world_size ? b->num_experts / b->world_size : 1;
        uint32_t S = b->dtype == EPD_DTYPE_FP8_E4M3 && b->scale_block ? H / b->scale_block : 0;
        uint32_t align = m.expert_alignment ? m.expert_alignment : 1;
        int expand = m.layout == EPD_LAYOUT_EXPAND;
        uint64_t cap = expand ? epd_route_max_rows_expand(R, b->max_tokens, K ? K : 1, L ? L : 1,
                                                           align > 4096 ? 1 : align)
                              : epd_route_max_rows_non_expand(R, b->max_tokens);

        m.t[EPD_OPREC_X] = read_tensor(r, cl, n, H, b->dtype);
        m.t[EPD_OPREC_SCALES] = read_tensor(r, cl, n, S, EPD_DTYPE_FP32);
        m.t[EPD_OPREC_TOPK_IDX] = read_tensor(r, cl, n, K, topk_dtype);
        m.t[EPD_OPREC_TOPK_WEIGHTS] = read_tensor(r, cl, n, K, EPD_DTYPE_FP32);
        m.t[EPD_OPREC_RECV_X] = read_tensor(r, cl, cap, H, b->dtype);
        m.t[EPD_OPREC_RECV_SCALES] = read_tensor(r, cl, cap, S, EPD_DTYPE_FP32);
        m.t[EPD_OPREC_RECV_TOPK_IDX] = read_tensor(r, cl, cap, K, topk_dtype);
        m.t[EPD_OPREC_RECV_WEIGHTS] = read_tensor(r, cl, cap, expand ? 0 : K, EPD_DTYPE_FP32);
        m.t[EPD_OPREC_RECV_SRC] = read_tensor(r, cl, cap, 0, EPD_DTYPE_INT64);
        m.t[EPD_OPREC_RECV_TOPK_SLOT] = read_tensor(r, cl, cap, 0, EPD_DTYPE_INT32);
        m.topk_idx_dtype = topk_dtype;
        p.request_id = send_or_post(cl, b, &m, flags);
        if (!p.request_id)
                return;
        p.group_id = b->group_id;
        p.rank = m.rank;
        p.num_tokens = n;
        p.num_topk = K;
        p.expand = expand;
        add_pending(cl, &p);
}

static void cmd_combine(struct reader *r, struct fz_client *cl)
{
        struct epd_op_request m = { .kind = EPD_OPREC_COMBINE };
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);
        const struct fz_handle *h;

        m.group_id = b->group_id;
        m.rank = pick_rank(b, rd_u8(r));
        m.handle_id = pick_handle(r, cl, rd_u8(r), b, &h);
        uint8_t flags = rd_u8(r);
        m.flags = (flags & 1) ? EPD_OPREC_APPLY_WEIGHTS : 0;
        m.wait_inputs = (flags & 16) ? 1 : 0;
        m.num_bias = rd_u8(r) % 4; /* 3: refused by the encoder, not sent */
        uint64_t rows = h && h->rows > 0 ? (uint64_t)h->rows : 0;
        uint32_t n = h ? h->num_tokens : 0, K = h ? h->num_topk : b->max_topk;
        uint32_t H = b->hidden;

        m.t[EPD_OPREC_Y] = read_tensor(r, cl, rows, H, EPD_DTYPE_BF16);
        m.t[EPD_OPREC_BIAS0] = read_tensor(r, cl, n, H, EPD_DTYPE_BF16);
        m.t[EPD_OPREC_BIAS1] = read_tensor(r, cl, n, H, EPD_DTYPE_BF16);
        m.t[EPD_OPREC_COMBINED] = read_tensor(r, cl, n, H, EPD_DTYPE_BF16);
        m.t[EPD_OPREC_COMBINED_TOPK_WEIGHTS] = read_tensor(r, cl, n, K, EPD_DTYPE_FP32);
        if (flags & 2)
                m.t[EPD_OPREC_COMBINE_RECV_WEIGHTS] = read_tensor(r, cl, rows, K, EPD_DTYPE_FP32);
        if (flags & 4)
                m.t[EPD_OPREC_SOURCE_WEIGHTS] = read_tensor(r, cl, n, K, EPD_DTYPE_FP32);
        /* Bias slots past the count stay empty: the script reads them either way. */
        for (uint32_t i = m.num_bias; i < 2; i++)
                memset(&m.t[EPD_OPREC_BIAS0 + i], 0, sizeof(m.t[0]));
        send_or_post(cl, b, &m, flags);
}

/* A raw op record (fuzz_script.h, EPD_FUZZ_OP_RAW_OP): sent or posted as given, or, when it
 * decodes and the script asks for it, first made one of the binding's. */
static void cmd_raw_op(struct reader *r, struct fz_client *cl)
{
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);
        const uint8_t flags = rd_u8(r);
        size_t len;
        const uint8_t *bytes = rd_bytes(r, rd_u16(r), &len);
        struct epd_op_request q;
        char why[160];
        const uint8_t where = (flags & 1) ? EPD_FUZZ_PAGE : 0;

        if ((flags & 2) &&
            epd_oprec_request_decode(bytes, len, &q, why, sizeof(why)) == 0) {
                q.group_id = b->group_id;
                q.rank = b->rank;
                (void)send_or_post(cl, b, &q, where);
                return;
        }
        send_or_post_record(cl, b, ++cl->next_id, bytes, len, where);
}

static void cmd_handle_release(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__HandleRelease m = EPD__V1__HANDLE_RELEASE__INIT;
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);
        const struct fz_handle *h;

        m.group_id = b->group_id;
        m.rank = pick_rank(b, rd_u8(r));
        m.handle_id = pick_handle(r, cl, rd_u8(r), b, &h);
        req.body_case = EPD__V1__REQUEST__BODY_HANDLE_RELEASE;
        req.handle_release = &m;
        send_request(cl, &req, NULL, 0);
}

static const char *name_or_null(uint8_t sel)
{
        return sel == 0 ? NULL : group_name((unsigned)(sel - 1) % 8);
}

static void cmd_arena_segments(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__ArenaSegments m = EPD__V1__ARENA_SEGMENTS__INIT;
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);

        m.group_id = b->group_id;
        m.rank = pick_rank(b, rd_u8(r));
        m.first = rd_u8(r);
        req.body_case = EPD__V1__REQUEST__BODY_ARENA_SEGMENTS;
        req.arena_segments = &m;
        send_request(cl, &req, NULL, 0);
}

static void cmd_resize(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Resize m = EPD__V1__RESIZE__INIT;
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);
        uint16_t kib;

        m.group_id = b->group_id;
        m.group_name = (char *)name_or_null(rd_u8(r));
        kib = rd_u16(r);
        m.bytes = kib == 0xffff ? rd_u64(r) : 1024ull * kib;
        req.body_case = EPD__V1__REQUEST__BODY_RESIZE;
        req.resize = &m;
        send_request(cl, &req, NULL, 0);
}

static void cmd_drain(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Drain drain = EPD__V1__DRAIN__INIT;
        Epd__V1__Undrain undrain = EPD__V1__UNDRAIN__INIT;
        uint8_t flags = rd_u8(r);
        struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);
        const char *name = name_or_null(rd_u8(r));

        if (flags & 1) {
                undrain.group_id = b->group_id;
                undrain.group_name = (char *)name;
                undrain.all = (flags & 2) != 0;
                req.body_case = EPD__V1__REQUEST__BODY_UNDRAIN;
                req.undrain = &undrain;
        } else {
                drain.group_id = b->group_id;
                drain.group_name = (char *)name;
                drain.all = (flags & 2) != 0;
                req.body_case = EPD__V1__REQUEST__BODY_DRAIN;
                req.drain = &drain;
        }
        send_request(cl, &req, NULL, 0);
}

static void cmd_evict(struct reader *r, struct fz_client *cl)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Evict m = EPD__V1__EVICT__INIT;
        uint8_t v = rd_u8(r);

        m.client_id = v % 4 < num_clients ? clients[v % 4].client_id : v;
        req.body_case = EPD__V1__REQUEST__BODY_EVICT;
        req.evict = &m;
        send_request(cl, &req, NULL, 0);
}

static void cmd_raw_record(struct reader *r, struct fz_client *cl)
{
        size_t len;
        const uint8_t *bytes = rd_bytes(r, rd_u16(r), &len);
        unsigned num_fds = rd_u8(r) % 20;
        int fds[20];

        for (unsigned i = 0; i < num_fds; i++)
                fds[i] = memfd_create("fuzz-raw", MFD_CLOEXEC);
        for (unsigned i = 0; i < num_fds; i++)
                if (fds[i] < 0)
                        fail("memfd_create failed");
        send_record(cl, bytes, len, fds, num_fds);
        for (unsigned i = 0; i < num_fds; i++)
                close(fds[i]);
}

static void run_command(struct reader *r)
{
        uint8_t op = rd_u8(r) % EPD_FUZZ_OP_COUNT;
        struct fz_client *cl = &clients[rd_u8(r) % num_clients];
        size_t len;
        const uint8_t *bytes;

        if (verbose)
                fprintf(stderr, "client %d op %u\n", (int)(cl - clients), op);
        switch (op) {
        case EPD_FUZZ_OP_RAW_BODY:
                bytes = rd_bytes(r, rd_u16(r), &len);
                send_body(cl, bytes, len, NULL, 0, EPD_PROTOCOL_VERSION);
                break;
        case EPD_FUZZ_OP_RAW_RECORD:
                cmd_raw_record(r, cl);
                break;
        case EPD_FUZZ_OP_HELLO: {
                uint8_t flags = rd_u8(r);
                char name[256];
                bytes = rd_bytes(r, rd_u8(r), &len);
                memcpy(name, bytes, len);
                name[len] = '\0';
                send_hello(cl, flags, name);
                break;
        }
        case EPD_FUZZ_OP_GROUP_CREATE: cmd_group_create(r, cl); break;
        case EPD_FUZZ_OP_GROUP_JOIN: cmd_group_join(r, cl); break;
        case EPD_FUZZ_OP_GROUP_LEAVE: cmd_group_leave(r, cl); break;
        case EPD_FUZZ_OP_REGION_REGISTER: cmd_region_register(r, cl); break;
        case EPD_FUZZ_OP_REGION_RELEASE: cmd_region_release(r, cl); break;
        case EPD_FUZZ_OP_SIZE_HINT: cmd_size_hint(r, cl); break;
        case EPD_FUZZ_OP_STATUS:
        case EPD_FUZZ_OP_LIST_GROUPS:
        case EPD_FUZZ_OP_LIST_CLIENTS:
        case EPD_FUZZ_OP_STATS:
                cmd_empty(cl, op);
                break;
        case EPD_FUZZ_OP_DISPATCH: cmd_dispatch(r, cl); break;
        case EPD_FUZZ_OP_COMBINE: cmd_combine(r, cl); break;
        case EPD_FUZZ_OP_HANDLE_RELEASE: cmd_handle_release(r, cl); break;
        case EPD_FUZZ_OP_PUMP: {
                uint64_t until = now_ms() + rd_u8(r) % 8;
                do {
                        settle(0);
                        nap();
                } while (now_ms() < until);
                break;
        }
        case EPD_FUZZ_OP_RING: {
                struct fz_binding scratch, *b = pick_binding(cl, rd_u8(r), &scratch);
                uint8_t v = rd_u8(r);
                if (b->doorbell)
                        __atomic_store_n(&b->doorbell->inputs_ready,
                                         v ? (uint64_t)v : EPD_DOORBELL_RELEASED,
                                         __ATOMIC_RELEASE);
                break;
        }
        case EPD_FUZZ_OP_ARENA_SEGMENTS: cmd_arena_segments(r, cl); break;
        case EPD_FUZZ_OP_RESIZE: cmd_resize(r, cl); break;
        case EPD_FUZZ_OP_DRAIN: cmd_drain(r, cl); break;
        case EPD_FUZZ_OP_EVICT: cmd_evict(r, cl); break;
        case EPD_FUZZ_OP_RAW_OP: cmd_raw_op(r, cl); break;
        case EPD_FUZZ_OP_MUTE:
                cl->muted = !cl->muted;
                break;
        case EPD_FUZZ_OP_DISCONNECT: {
                uint8_t flags = rd_u8(r);
                client_disconnect(cl);
                settle(settle_ms);
                if (flags & 1)
                        client_connect(cl, 1);
                break;
        }
        }
        settle(settle_ms);
}

/* ---- libFuzzer entry points ---- */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
        char err[256];

        (void)argc;
        (void)argv;
        verbose = getenv("EPD_FUZZ_VERBOSE") != NULL;
        epd_log_init();
        epd_config_defaults(&d->cfg);
        snprintf(d->cfg.backend, sizeof(d->cfg.backend), "host");
        /* Small and quick: two virtual devices, one copy thread, small arenas, op timeouts
         * short enough that a missing rank turns into TIMEOUT within a run, and limits a short
         * script can reach (groups, regions, outstanding ops, a client's output queue). */
        d->cfg.host_devices = 2;
        d->cfg.host_threads = 1;
        d->cfg.arena_bytes = 64u << 10;
        d->cfg.op_timeout_ms = 20;
        d->cfg.max_groups = 8;
        d->cfg.max_regions_per_client = 32;
        d->cfg.max_outstanding_ops_per_client = 8;
        d->cfg.max_output_queue_bytes = 16u << 10;
        d->cfg.max_arena_bytes = 4u << 20;
        d->cfg.log_level = verbose ? LOG_DEBUG : LOG_CRIT;
        epd_log_set_level(d->cfg.log_level);
        if (uv_loop_init(&loop) != 0)
                fail("uv_loop_init failed");
        reply_buf_len = EPD_FRAME_HEADER_BYTES + d->cfg.max_frame_bytes + 1;
        reply_buf = malloc(reply_buf_len);
        if (!reply_buf)
                fail("out of memory");
        /* The daemon's own set-up, as main() runs it. */
        if (epd_daemon_init(d, &loop, err, sizeof(err)) < 0) {
                fprintf(stderr, "fuzz_request: no host backend: %s\n", err);
                abort();
        }
        d->epoch = 0x66757a7a; /* "fuzz": replies are reproducible */
        return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
        struct reader r = { .p = data, .left = size };
        unsigned fds_before = count_open_fds();
        unsigned handles_before = count_uv_handles();
        uint8_t setup = rd_u8(&r);
        uint64_t deadline;

        /* Every object of the previous run is gone: numbering restarts, so a run does not
         * depend on the ones before it. */
        d->next_client_id = d->next_group_id = d->next_region_id = 0;
        num_clients = 1 + setup % EPD_FUZZ_MAX_CLIENTS;
        settle_ms = setup & EPD_FUZZ_OVERLAP ? 0 : SETTLE_MS;
        for (unsigned i = 0; i < num_clients; i++)
                client_connect(&clients[i], !(setup & EPD_FUZZ_NO_HELLO));
        settle(SETTLE_MS);
        while (r.left)
                run_command(&r);

        /* Every client goes away; the daemon must release everything they held. */
        for (unsigned i = 0; i < num_clients; i++)
                client_disconnect(&clients[i]);
        /* The one state a client may leave behind on purpose: an admin's daemon-wide drain. */
        d->draining = 0;
        deadline = now_ms() + FINISH_MS;
        for (;;) {
                uv_run(&loop, UV_RUN_NOWAIT);
                if (d->num_conns == 0 && epd_list_empty(&d->conns) && d->num_groups == 0 &&
                    epd_list_empty(&d->groups) && count_uv_handles() == handles_before)
                        break;
                if (now_ms() > deadline) {
                        fprintf(stderr,
                                "fuzz_request: after every client left the daemon still has %u connections, %u groups, %u libuv handles (%u before)\n",
                                d->num_conns, d->num_groups, count_uv_handles(), handles_before);
                        abort();
                }
                nap();
        }
        if (count_open_fds() != fds_before) {
                fprintf(stderr, "fuzz_request: fd leak: %u open fds before the run, %u after\n",
                        fds_before, count_open_fds());
                abort();
        }
        return 0;
}
