/* client.c - libepd: the connection to epd, Hello/Welcome, the request/response exchange,
 * memory registration, groups and size hints. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "reply.h"
#include "tensor.h"
#include "util.h"

#define DEFAULT_TIMEOUT_MS 30000
/* EPD_CLIENT_POLL_US's and EPD_CLIENT_SPIN_US's largest value (the daemon's poll_us has the
 * same bound). */
#define CLIENT_MAX_POLL_US 100000u
/* How long a wait in the doorbell page polls after a wake-up, by default: the daemon wakes its
 * sleepers when their op starts (daemon/net/mailbox.c), and a decode-sized op ends within this.
 * Only on machines of 8 CPUs or more (as the daemon's poll_us): on fewer, polling workers take
 * the CPUs that the daemon (and the host backend) need. */
#define CLIENT_DEFAULT_SPIN_US (sysconf(_SC_NPROCESSORS_ONLN) >= 8 ? 200u : 0u)

/* A microsecond setting from the environment: def when unset; 0..CLIENT_MAX_POLL_US. */
static int env_us(const char *name, unsigned def, uint64_t *ns, char *err, size_t err_len)
{
        const char *v = getenv(name);
        unsigned long us = def;

        if (v != NULL) {
                char *end = NULL;
                errno = 0;
                us = strtoul(v, &end, 10);
                if (errno != 0 || end == v || *end != '\0' || v[0] == '-' ||
                    us > CLIENT_MAX_POLL_US) {
                        if (err)
                                snprintf(err, err_len,
                                         "%s=%s: expected microseconds from 0 to %u", name, v,
                                         CLIENT_MAX_POLL_US);
                        return EPD_INVALID_ARGUMENT;
                }
        }
        *ns = (uint64_t)us * 1000;
        return 0;
}

/* Where dispatch and combine go from the environment (common/doorbell.h, the mailboxes):
 * *page = 1 for "doorbell" (also when unset), 0 for "socket". */
static int env_path(const char *name, int *page, char *err, size_t err_len)
{
        const char *v = getenv(name);

        *page = 1;
        if (v == NULL || strcmp(v, "doorbell") == 0)
                return 0;
        if (strcmp(v, "socket") == 0) {
                *page = 0;
                return 0;
        }
        if (err)
                snprintf(err, err_len, "%s=%s: expected doorbell or socket", name, v);
        return EPD_INVALID_ARGUMENT;
}

#define CLIENT_MAX_FRAME (16u << 20)

int epd__client_fail(struct epd_client *c, int status, const char *fmt, ...)
{
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
        va_end(ap);
        return status;
}

const char *epd_client_last_error(const struct epd_client *client)
{
        return client ? client->last_error : "no client";
}

int epd__client_send_locked(struct epd_client *c, Epd__V1__Request *req, const int *fds,
                            unsigned num_fds)
{
        size_t len;
        uint8_t stackbuf[4096], *buf = stackbuf;
        int rc;

        if (c->broken)
                return epd__client_fail(c, EPD_UNAVAILABLE, "connection to the daemon is lost");
        if (req->id == 0)
                req->id = ++c->next_id;
        len = epd__v1__request__get_packed_size(req);
        if (len > c->max_frame)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "request of %zu bytes exceeds the daemon's frame limit %u",
                                        len, c->max_frame);
        if (len > sizeof(stackbuf) && !(buf = malloc(len)))
                return epd__client_fail(c, EPD_INTERNAL, "out of memory");
        epd__v1__request__pack(req, buf);
        for (;;) {
                rc = epd_frame_send(c->fd, EPD_PROTOCOL_VERSION, buf, len, fds, num_fds);
                if (rc != -EAGAIN)
                        break;
                /* The daemon's receive queue is full: wait until it drains. */
                struct pollfd pfd = { .fd = c->fd, .events = POLLOUT };
                (void)poll(&pfd, 1, 1000);
        }
        if (buf != stackbuf)
                free(buf);
        if (rc == 0)
                c->last_socket_id = req->id;
        if (rc < 0) {
                c->broken = 1;
                return epd__client_fail(c, EPD_UNAVAILABLE, "send to the daemon failed: %s",
                                        strerror(-rc));
        }
        return 0;
}

static int stash_take(struct epd_client *c, uint64_t id, Epd__V1__Response **resp, int *fds_out)
{
        struct epd__stashed **pp;

        for (pp = &c->stash; *pp; pp = &(*pp)->next) {
                struct epd__stashed *s = *pp;
                if (s->resp->id != id)
                        continue;
                *pp = s->next;
                *resp = s->resp;
                c->last_read_ns = s->read_ns;
                for (unsigned i = 0; i < 2; i++)
                        fds_out[i] = i < s->num_fds ? s->fds[i] : -1;
                free(s);
                return 1;
        }
        return 0;
}

static int64_t now_ms(void)
{
        return (int64_t)(epd__now_ns() / 1000000);
}

static int client_wait(struct epd_client *c, uint64_t id, int timeout_ms, int quiet,
                       Epd__V1__Response **resp, int *fds_out);

int epd__client_wait_locked(struct epd_client *c, uint64_t id, int timeout_ms,
                            Epd__V1__Response **resp, int *fds_out)
{
        return client_wait(c, id, timeout_ms, 0, resp, fds_out);
}

int epd__client_try_locked(struct epd_client *c, uint64_t id, Epd__V1__Response **resp,
                           int *fds_out)
{
        return client_wait(c, id, 0, 1, resp, fds_out);
}

/* quiet: a probe (timeout 0) that neither polls nor records its timeout. */
static int client_wait(struct epd_client *c, uint64_t id, int timeout_ms, int quiet,
                       Epd__V1__Response **resp, int *fds_out)
{
        int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
        uint64_t spin_until = 0;
        int reset_seen = 0;

        fds_out[0] = fds_out[1] = -1;
        for (;;) {
                struct epd_frame frame;
                const char *why = NULL;
                int rc;

                if (stash_take(c, id, resp, fds_out))
                        return 0;
                if (c->broken)
                        return epd__client_fail(c, EPD_UNAVAILABLE,
                                                "connection to the daemon is lost");
                rc = epd_frame_recv(c->fd, c->rbuf, c->rbuf_len, c->max_frame, EPD_FRAME_MAX_FDS,
                                    &frame, &why);
                if (rc == -ECONNRESET && !reset_seen) {
                        /* A daemon that closes the connection with a request of ours unread
                         * (a refusal at accept, or a connection-level error) leaves
                         * ECONNRESET pending ahead of the frames it sent before closing:
                         * reading again returns them, or the end of the stream. */
                        reset_seen = 1;
                        continue;
                }
                if (rc == -EAGAIN) {
                        /* Poll a while before sleeping: a reply that comes within poll_ns is
                         * taken without the wake-up of a sleeping thread (tens of
                         * microseconds on a loaded or virtual machine). */
                        if (quiet)
                                return EPD_TIMEOUT;
                        if (c->poll_ns != 0) {
                                const uint64_t now = epd__now_ns();
                                if (spin_until == 0)
                                        spin_until = now + c->poll_ns;
                                if (now < spin_until) {
                                        epd__cpu_relax();
                                        continue;
                                }
                        }
                        int wait = -1;
                        if (deadline >= 0) {
                                int64_t left = deadline - now_ms();
                                if (left <= 0)
                                        return epd__client_fail(c, EPD_TIMEOUT,
                                                                "no reply from the daemon within %d ms",
                                                                timeout_ms);
                                wait = (int)left;
                        }
                        struct pollfd pfd = { .fd = c->fd, .events = POLLIN };
                        (void)poll(&pfd, 1, wait);
                        continue;
                }
                if (rc < 0) {
                        c->broken = 1;
                        return epd__client_fail(c, EPD_UNAVAILABLE,
                                                "connection to the daemon is lost: %s",
                                                rc == -ECONNRESET ? "daemon closed it"
                                                                  : why ? why : strerror(-rc));
                }
                const uint64_t read_ns = epd__now_ns();
                Epd__V1__Response *r = epd__v1__response__unpack(NULL, frame.body_len, frame.body);
                if (!r) {
                        epd_frame_close_fds(&frame);
                        c->broken = 1;
                        return epd__client_fail(c, EPD_INTERNAL, "undecodable reply from the daemon");
                }
                if (r->id == 0 && r->status != EPD__V1__STATUS_CODE__OK) {
                        /* A connection-level error: the daemon closes the connection after it. */
                        epd_frame_close_fds(&frame);
                        c->broken = 1;
                        int st = epd__status_from_wire(r->status);
                        epd__client_fail(c, st, "%s", r->message ? r->message : "");
                        epd__v1__response__free_unpacked(r, NULL);
                        return st;
                }
                if (r->id == id) {
                        for (unsigned i = 0; i < frame.num_fds && i < 2; i++)
                                fds_out[i] = epd_frame_take_fd(&frame, i);
                        epd_frame_close_fds(&frame);
                        *resp = r;
                        c->last_read_ns = read_ns;
                        return 0;
                }
                struct epd__stashed *s = calloc(1, sizeof(*s));
                if (!s) {
                        epd_frame_close_fds(&frame);
                        epd__v1__response__free_unpacked(r, NULL);
                        continue;
                }
                s->resp = r;
                s->read_ns = read_ns;
                for (unsigned i = 0; i < frame.num_fds && i < 2; i++)
                        s->fds[s->num_fds++] = epd_frame_take_fd(&frame, i);
                epd_frame_close_fds(&frame);
                s->next = c->stash;
                c->stash = s;
        }
}

int epd__client_call(struct epd_client *c, Epd__V1__Request *req, const int *fds,
                     unsigned num_fds, Epd__V1__Response **resp_out, int *fds_out)
{
        Epd__V1__Response *resp = NULL;
        int tmp_fds[2];
        int rc;

        pthread_mutex_lock(&c->lock);
        rc = epd__client_send_locked(c, req, fds, num_fds);
        if (rc == 0)
                rc = epd__client_wait_locked(c, req->id, c->timeout_ms, &resp, tmp_fds);
        pthread_mutex_unlock(&c->lock);
        if (rc < 0)
                return rc;
        if (resp->status != EPD__V1__STATUS_CODE__OK) {
                rc = epd__status_from_wire(resp->status);
                epd__client_fail(c, rc, "%s", resp->message ? resp->message : "");
        } else if (resp->body_case != epd__reply_body(req->body_case)) {
                /* Another member of the reply's oneof: reading the expected one would read it. */
                rc = epd__client_fail(c, EPD_INTERNAL, "daemon answered %s with %s",
                                      epd__request_body_name(req->body_case),
                                      epd__response_body_name(resp->body_case));
        }
        if (rc < 0) {
                epd__v1__response__free_unpacked(resp, NULL);
                for (int i = 0; i < 2; i++)
                        if (tmp_fds[i] >= 0)
                                close(tmp_fds[i]);
                return rc;
        }
        for (int i = 0; i < 2; i++) {
                if (fds_out)
                        fds_out[i] = tmp_fds[i];
                else if (tmp_fds[i] >= 0)
                        close(tmp_fds[i]);
        }
        *resp_out = resp;
        return 0;
}

static void client_destroy(struct epd_client *c)
{
        while (c->stash) {
                struct epd__stashed *s = c->stash;
                c->stash = s->next;
                for (unsigned i = 0; i < s->num_fds; i++)
                        if (s->fds[i] >= 0)
                                close(s->fds[i]);
                epd__v1__response__free_unpacked(s->resp, NULL);
                free(s);
        }
        for (unsigned i = 0; i < c->num_regions; i++) {
                if (c->regions[i].owned)
                        munmap(c->regions[i].ptr, c->regions[i].bytes);
                if (c->regions[i].fd >= 0)
                        close(c->regions[i].fd);
        }
        free(c->regions);
        if (c->fd >= 0)
                close(c->fd);
        /* After the close: the daemon's imports keep the memory of ops in flight alive. */
        epd__device_alloc_free_all(c);
        free(c->device_allocs);
        pthread_mutex_destroy(&c->lock);
        free(c->rbuf);
        free(c);
}

/* After Hello could not be sent: the daemon may have refused the connection (allow list,
 * max_clients, shutdown) and closed it before the Hello arrived. Its refusal, a frame with
 * request id 0, then waits in the socket: returns that status with its message, or `status`
 * when there is none. */
static int take_refusal(struct epd_client *c, int status)
{
        for (int attempt = 0; attempt < 2; attempt++) {
                struct epd_frame frame;
                const char *why = NULL;
                int rc = epd_frame_recv(c->fd, c->rbuf, c->rbuf_len, c->max_frame,
                                        EPD_FRAME_MAX_FDS, &frame, &why);
                if (rc == -ECONNRESET)
                        continue; /* the pending error goes first (see epd__client_wait_locked) */
                if (rc < 0)
                        break;
                epd_frame_close_fds(&frame);
                Epd__V1__Response *r = epd__v1__response__unpack(NULL, frame.body_len, frame.body);
                if (r && r->id == 0 && r->status != EPD__V1__STATUS_CODE__OK) {
                        int st = epd__status_from_wire(r->status);
                        epd__client_fail(c, st, "%s", r->message ? r->message : "");
                        epd__v1__response__free_unpacked(r, NULL);
                        return st;
                }
                if (r)
                        epd__v1__response__free_unpacked(r, NULL);
                break;
        }
        return status;
}

int epd_client_connect(const struct epd_connect_args *args, struct epd_client **out, char *err,
                       size_t err_len)
{
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        const char *path = args && args->socket_path ? args->socket_path : getenv("EPD_SOCKET");
        struct epd_client *c;
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Hello hello = EPD__V1__HELLO__INIT;
        Epd__V1__Response *resp = NULL;
        uint64_t poll_ns = 0, spin_ns = 0;
        int rc;

        if (!path)
                path = "/run/epd/epd.sock";
        if (args && args->size < offsetof(struct epd_connect_args, timeout_ms) + sizeof(int)) {
                if (err)
                        snprintf(err, err_len, "epd_connect_args.size is too small");
                return EPD_INVALID_ARGUMENT;
        }
        if (strlen(path) >= sizeof(sa.sun_path)) {
                if (err)
                        snprintf(err, err_len, "socket path too long: %s", path);
                return EPD_INVALID_ARGUMENT;
        }
        if (env_us("EPD_CLIENT_POLL_US", 0, &poll_ns, err, err_len) < 0 ||
            env_us("EPD_CLIENT_SPIN_US", CLIENT_DEFAULT_SPIN_US, &spin_ns, err, err_len) < 0)
                return EPD_INVALID_ARGUMENT;
        /* Requests and replies of dispatch and combine: through the doorbell page (the
         * default) or the socket. */
        int mailbox, page_requests;
        if (env_path("EPD_CLIENT_REPLY", &mailbox, err, err_len) < 0 ||
            env_path("EPD_CLIENT_REQUEST", &page_requests, err, err_len) < 0)
                return EPD_INVALID_ARGUMENT;
        c = calloc(1, sizeof(*c));
        if (!c)
                return EPD_INTERNAL;
        pthread_mutex_init(&c->lock, NULL);
        c->timeout_ms = args && args->timeout_ms ? args->timeout_ms : DEFAULT_TIMEOUT_MS;
        c->poll_ns = poll_ns;
        c->spin_ns = spin_ns;
        c->mailbox = mailbox;
        c->page_requests = page_requests;
        c->max_frame = CLIENT_MAX_FRAME;
        c->rbuf_len = EPD_FRAME_HEADER_BYTES + CLIENT_MAX_FRAME + 1;
        c->rbuf = malloc(c->rbuf_len);
        c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (!c->rbuf || c->fd < 0) {
                if (err)
                        snprintf(err, err_len, "cannot create socket: %s", strerror(errno));
                client_destroy(c);
                return EPD_INTERNAL;
        }
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                if (err)
                        snprintf(err, err_len, "cannot connect to %s: %s", path, strerror(errno));
                client_destroy(c);
                return EPD_UNAVAILABLE;
        }
        hello.protocol_version = args && args->protocol_version ? args->protocol_version
                                                                : EPD_PROTOCOL_VERSION;
        hello.client_name = (char *)(args && args->client_name ? args->client_name : "");
        hello.capabilities = EPD__V1__CAPABILITY__CAP_HOST_REGIONS;
#ifdef EPD_HAVE_CUDA
        /* Announcing the capability touches no CUDA state: libepd initialises CUDA only when a
         * device function is called, so a process may connect and then fork. */
        hello.capabilities |= EPD__V1__CAPABILITY__CAP_CUDA_REGIONS;
#endif
        req.body_case = EPD__V1__REQUEST__BODY_HELLO;
        req.hello = &hello;
        rc = epd__client_call(c, &req, NULL, 0, &resp, NULL);
        if (rc == EPD_UNAVAILABLE && c->broken)
                rc = take_refusal(c, rc);
        if (rc < 0) {
                if (err)
                        snprintf(err, err_len, "%s", c->last_error);
                if (resp)
                        epd__v1__response__free_unpacked(resp, NULL);
                client_destroy(c);
                return rc;
        }
        const Epd__V1__Welcome *w = resp->welcome;
        c->info.protocol_version = w->protocol_version;
        c->info.daemon_epoch = w->daemon_epoch;
        c->info.client_id = w->client_id;
        c->daemon_caps = w->capabilities;
        snprintf(c->info.backend, sizeof(c->info.backend), "%s", w->backend ? w->backend : "");
        snprintf(c->info.version, sizeof(c->info.version), "%s", w->version ? w->version : "");
        if (w->limits) {
                c->info.max_frame_bytes = w->limits->max_frame_bytes;
                c->info.max_fds_per_frame = w->limits->max_fds_per_frame;
                if (w->limits->max_frame_bytes && w->limits->max_frame_bytes < c->max_frame)
                        c->max_frame = w->limits->max_frame_bytes;
        }
        for (size_t i = 0; i < w->n_devices && i < 16; i++) {
                struct epd_device_info *di = &c->info.devices[i];
                di->index = w->devices[i]->index;
                snprintf(di->uuid, sizeof(di->uuid), "%s", w->devices[i]->uuid);
                snprintf(di->name, sizeof(di->name), "%s", w->devices[i]->name);
                snprintf(di->kind, sizeof(di->kind), "%s", w->devices[i]->kind);
                di->memory_bytes = w->devices[i]->memory_bytes;
                c->info.num_devices++;
        }
        epd__v1__response__free_unpacked(resp, NULL);
        *out = c;
        return 0;
}

void epd_client_free(struct epd_client *client)
{
        if (client)
                client_destroy(client);
}

uint64_t epd_client_capabilities(const struct epd_client *client)
{
        return client ? client->daemon_caps : 0;
}

int epd_client_daemon_info(const struct epd_client *client, struct epd_daemon_info *out)
{
        if (!client || !out)
                return EPD_INVALID_ARGUMENT;
        *out = client->info;
        return 0;
}

/* ---- memory ---- */

int epd_memfd_alloc(size_t bytes, int *fd_out, void **ptr_out)
{
        int fd;
        void *p;

        if (bytes == 0)
                return EPD_INVALID_ARGUMENT;
        /* Sealing is allowed so the daemon can forbid shrinking under its mapping. */
        fd = memfd_create("epd-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0)
                return EPD_UNAVAILABLE;
        if (ftruncate(fd, (off_t)bytes) < 0) {
                close(fd);
                return EPD_UNAVAILABLE;
        }
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
                close(fd);
                return EPD_UNAVAILABLE;
        }
        *fd_out = fd;
        *ptr_out = p;
        return 0;
}

/* The region table is kept in ascending order of local address (regions without one first), so
 * that epd_tensor_at finds a pointer's region by bisection: a process may hold a thousand regions
 * and look up every tensor of every op. Lock held. */

/* The number of regions whose address is at or below p. */
static unsigned regions_at_or_below(const struct epd_client *c, const uint8_t *p)
{
        unsigned lo = 0, hi = c->num_regions;

        while (lo < hi) {
                const unsigned mid = lo + (hi - lo) / 2;
                if ((uintptr_t)c->regions[mid].ptr <= (uintptr_t)p)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        return lo;
}

void epd__client_region_remove_at(struct epd_client *c, unsigned i)
{
        if (c->regions[i].fd >= 0)
                close(c->regions[i].fd);
        memmove(&c->regions[i], &c->regions[i + 1],
                (c->num_regions - i - 1) * sizeof(c->regions[0]));
        c->num_regions--;
}

int epd__client_region_add(struct epd_client *c, uint64_t id, void *ptr, uint64_t bytes,
                           int owned)
{
        if (c->num_regions == c->cap_regions) {
                unsigned cap = c->cap_regions ? c->cap_regions * 2 : 16;
                struct epd__local_region *n = realloc(c->regions, cap * sizeof(*n));
                if (!n)
                        return EPD_INTERNAL;
                c->regions = n;
                c->cap_regions = cap;
        }
        const unsigned at = regions_at_or_below(c, ptr);
        memmove(&c->regions[at + 1], &c->regions[at],
                (c->num_regions - at) * sizeof(c->regions[0]));
        c->regions[at] =
                (struct epd__local_region){ .id = id, .ptr = ptr, .bytes = bytes, .owned = owned,
                                            .fd = -1 };
        c->num_regions++;
        return 0;
}

void *epd__client_region_ptr(struct epd_client *c, uint64_t id, uint64_t offset)
{
        void *p = NULL;

        pthread_mutex_lock(&c->lock);
        for (unsigned i = 0; i < c->num_regions; i++)
                if (c->regions[i].id == id && c->regions[i].ptr && offset <= c->regions[i].bytes)
                        p = c->regions[i].ptr + offset;
        pthread_mutex_unlock(&c->lock);
        return p;
}

int epd__client_region_register(struct epd_client *c, enum epd_region_kind kind, int fd,
                                const void *ipc_handle, size_t ipc_len, uint64_t bytes,
                                uint64_t offset, uint32_t device, void *local_ptr,
                                uint64_t *region_id)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__RegionRegister rr = EPD__V1__REGION_REGISTER__INIT;
        Epd__V1__Response *resp;
        int rc;

        rr.kind = (Epd__V1__RegionKind)kind;
        rr.size = bytes;
        rr.device = device;
        rr.offset = offset;
        if (ipc_handle) {
                rr.ipc_handle.data = (uint8_t *)ipc_handle;
                rr.ipc_handle.len = ipc_len;
        }
        req.body_case = EPD__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        rc = epd__client_call(c, &req, fd >= 0 ? &fd : NULL, fd >= 0 ? 1 : 0, &resp, NULL);
        if (rc < 0)
                return rc;
        uint64_t id = resp->region_registered ? resp->region_registered->region_id : 0;
        epd__v1__response__free_unpacked(resp, NULL);
        if (!id)
                return epd__client_fail(c, EPD_INTERNAL, "daemon returned no region id");
        pthread_mutex_lock(&c->lock);
        rc = epd__client_region_add(c, id, local_ptr, bytes, 0);
        if (rc == 0 && kind == EPD_REGION_HOST_MEMFD && local_ptr && fd >= 0)
                c->regions[regions_at_or_below(c, local_ptr) - 1].fd =
                        fcntl(fd, F_DUPFD_CLOEXEC, 0);
        pthread_mutex_unlock(&c->lock);
        if (rc < 0)
                return rc;
        *region_id = id;
        return 0;
}

int epd_region_register_fd(struct epd_client *client, enum epd_region_kind kind, int fd,
                           uint64_t bytes, uint32_t device, void *local_ptr, uint64_t *region_id)
{
        if (!client || fd < 0 || !region_id)
                return EPD_INVALID_ARGUMENT;
        return epd__client_region_register(client, kind, fd, NULL, 0, bytes, 0, device,
                                           local_ptr, region_id);
}

#ifndef EPD_HAVE_CUDA
/* Without CUDA support in libepd (client/cuda.c), device memory cannot be exported. */
int epd_region_register_device(struct epd_client *client, const void *dev_ptr, size_t bytes,
                               uint32_t device, uint64_t *region_id)
{
        (void)dev_ptr;
        (void)bytes;
        (void)device;
        (void)region_id;
        if (!client)
                return EPD_UNAVAILABLE;
        return epd__client_fail(client, EPD_UNAVAILABLE,
                                "libepd was built without CUDA support: device memory cannot be registered");
}

int epd_device_alloc(struct epd_client *client, uint32_t cuda_device, uint64_t bytes,
                     void **dev_ptr, uint64_t *region_id)
{
        (void)cuda_device;
        if (!client)
                return EPD_INVALID_ARGUMENT;
        if (!dev_ptr || !region_id || !bytes)
                return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                        "epd_device_alloc needs a size above 0, dev_ptr and region_id");
        return epd__client_fail(client, EPD_UNAVAILABLE,
                                "libepd was built without CUDA support: device memory cannot be allocated");
}

int epd_device_free(struct epd_client *client, void *dev_ptr)
{
        if (!client)
                return EPD_INVALID_ARGUMENT;
        if (!dev_ptr)
                return 0;
        return epd__client_fail(client, EPD_INVALID_ARGUMENT,
                                "%p did not come from epd_device_alloc of this client (libepd was built without CUDA support)",
                                dev_ptr);
}

void epd__device_alloc_free_all(struct epd_client *c)
{
        (void)c;
}
#endif

int epd_region_alloc(struct epd_client *client, size_t bytes, void **ptr_out, uint64_t *region_id)
{
        void *p;
        int fd, rc;
        uint64_t id;

        if (!client || !ptr_out || !region_id)
                return EPD_INVALID_ARGUMENT;
        rc = epd_memfd_alloc(bytes, &fd, &p);
        if (rc < 0)
                return epd__client_fail(client, rc, "cannot allocate a %zu-byte memfd", bytes);
        rc = epd_region_register_fd(client, EPD_REGION_HOST_MEMFD, fd, bytes, 0, p, &id);
        close(fd);
        if (rc < 0) {
                munmap(p, bytes);
                return rc;
        }
        pthread_mutex_lock(&client->lock);
        for (unsigned i = 0; i < client->num_regions; i++)
                if (client->regions[i].id == id)
                        client->regions[i].owned = 1;
        pthread_mutex_unlock(&client->lock);
        *ptr_out = p;
        *region_id = id;
        return 0;
}

int epd_region_release(struct epd_client *client, uint64_t region_id)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__RegionRelease rr = EPD__V1__REGION_RELEASE__INIT;
        Epd__V1__Response *resp;
        int rc;

        if (!client)
                return EPD_INVALID_ARGUMENT;
        rr.region_id = region_id;
        req.body_case = EPD__V1__REQUEST__BODY_REGION_RELEASE;
        req.region_release = &rr;
        rc = epd__client_call(client, &req, NULL, 0, &resp, NULL);
        if (rc < 0)
                return rc;
        epd__v1__response__free_unpacked(resp, NULL);
        pthread_mutex_lock(&client->lock);
        for (unsigned i = 0; i < client->num_regions; i++) {
                if (client->regions[i].id != region_id)
                        continue;
                if (client->regions[i].owned)
                        munmap(client->regions[i].ptr, client->regions[i].bytes);
                epd__client_region_remove_at(client, i);
                break;
        }
        pthread_mutex_unlock(&client->lock);
        return 0;
}

int epd_tensor_at(struct epd_client *client, const void *ptr, enum epd_dtype dtype, uint32_t ndim,
                  const uint64_t *sizes, struct epd_tensor *out)
{
        const uint8_t *p = ptr;
        uint64_t bytes = epd_dtype_size(dtype);

        if (!client || !out || ndim == 0 || ndim > EPD_TENSOR_MAX_DIMS || bytes == 0)
                return EPD_INVALID_ARGUMENT;
        for (uint32_t i = 0; i < ndim; i++)
                bytes *= sizes[i];
        pthread_mutex_lock(&client->lock);
        /* The regions that start at or below p, nearest first: the first one normally holds
         * it, and only overlapping registrations (or a miss) look further. */
        for (unsigned i = regions_at_or_below(client, p); i-- > 0;) {
                const struct epd__local_region *r = &client->regions[i];
                if (!r->ptr || p < r->ptr || p > r->ptr + r->bytes ||
                    bytes > (uint64_t)(r->ptr + r->bytes - p))
                        continue;
                memset(out, 0, sizeof(*out));
                out->dtype = dtype;
                out->ndim = ndim;
                for (uint32_t d = 0; d < ndim; d++)
                        out->sizes[d] = sizes[d];
                out->region_id = r->id;
                out->offset = (uint64_t)(p - r->ptr);
                pthread_mutex_unlock(&client->lock);
                return 0;
        }
        pthread_mutex_unlock(&client->lock);
        return epd__client_fail(client, EPD_NOT_FOUND,
                                "pointer %p with %llu bytes is not inside a registered region",
                                ptr, (unsigned long long)bytes);
}

/* ---- groups ---- */

static void config_to_wire(const struct epd_group_config *cfg, Epd__V1__GroupConfig *w)
{
        epd__v1__group_config__init(w);
        w->world_size = cfg->world_size;
        w->num_experts = cfg->num_experts;
        w->hidden = cfg->hidden;
        w->max_tokens_per_rank = cfg->max_tokens_per_rank;
        w->max_topk = cfg->max_topk;
        w->dispatch_dtype = (Epd__V1__DType)cfg->dispatch_dtype;
        w->scale_block = cfg->scale_block;
        w->op_timeout_ms = cfg->op_timeout_ms;
        w->arena_bytes = cfg->arena_bytes;
        /* Fields appended later count only when the caller's struct has them. */
        if (cfg->size >= offsetof(struct epd_group_config, sms_per_rank) +
                                 sizeof(cfg->sms_per_rank)) {
                w->execution = (Epd__V1__Execution)cfg->execution;
                w->max_expert_alignment = cfg->max_expert_alignment;
                w->expert_block_rows = cfg->expert_block_rows;
                w->quantize = cfg->quantize != 0;
                w->num_handle_slots = cfg->num_handle_slots;
                w->sms_per_rank = cfg->sms_per_rank;
        }
        if (cfg->size >= offsetof(struct epd_group_config, recv_rows) + sizeof(cfg->recv_rows))
                w->recv_rows = cfg->recv_rows;
}

/* ---- output arenas ---- */

static uint64_t page_up(uint64_t bytes)
{
        uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);

        return (bytes + page - 1) / page * page;
}

/* Turns [off, end) of the arena back into reserved address space. */
static void arena_unmap_range(struct epd_group *g, uint64_t off, uint64_t end)
{
        if (end > off)
                (void)mmap(g->arena + off, end - off, PROT_NONE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

/* Maps segment s from fd at its offset, replacing what was there (reservation, or a segment
 * the daemon has replaced). Lock held. */
static int arena_map_segment(struct epd_group *g, const Epd__V1__ArenaSegment *s, int fd)
{
        struct epd_client *c = g->client;

        if (s->offset % (uint64_t)sysconf(_SC_PAGESIZE) || s->bytes == 0 ||
            s->offset > g->arena_reserved || s->bytes > g->arena_reserved - s->offset)
                return epd__client_fail(c, EPD_INTERNAL,
                                        "arena segment at %llu with %llu bytes is outside the %llu reserved",
                                        (unsigned long long)s->offset,
                                        (unsigned long long)s->bytes,
                                        (unsigned long long)g->arena_reserved);
        if (mmap(g->arena + s->offset, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                 fd, 0) == MAP_FAILED)
                return epd__client_fail(c, EPD_UNAVAILABLE, "cannot map an arena segment: %s",
                                        strerror(errno));
        if (s->offset + s->bytes > g->arena_mapped_end)
                g->arena_mapped_end = s->offset + s->bytes;
        return 0;
}

static int same_segment(const struct epd__arena_segment *a, const Epd__V1__ArenaSegment *b)
{
        return a->serial == b->serial && a->off == b->offset && a->bytes == b->bytes;
}

/* Installs the daemon's segment list segs[0, n): the fds for segs[first, first + num_fds) are
 * given (taken: closed here); segments before `first` must already be mapped. Afterwards the
 * client knows segments [0, min(n, first + num_fds)). Lock held. */
static int arena_install(struct epd_group *g, Epd__V1__ArenaSegment *const *segs, size_t n,
                         unsigned first, int *fds, unsigned num_fds)
{
        unsigned known = first + num_fds < n ? first + num_fds : (unsigned)n;
        int rc = 0;

        if (known > g->num_arena_segs) {
                struct epd__arena_segment *ns =
                        realloc(g->arena_segs, known * sizeof(*ns));
                if (!ns)
                        rc = epd__client_fail(g->client, EPD_INTERNAL, "out of memory");
                else
                        g->arena_segs = ns;
        }
        for (unsigned k = 0; k < num_fds; k++) {
                unsigned i = first + k;
                if (rc == 0 && i < n) {
                        if (i < g->num_arena_segs && same_segment(&g->arena_segs[i], segs[i]))
                                ; /* already mapped */
                        else
                                rc = arena_map_segment(g, segs[i], fds[k]);
                        if (rc == 0)
                                g->arena_segs[i] = (struct epd__arena_segment){
                                        segs[i]->offset, segs[i]->bytes, segs[i]->serial
                                };
                }
                close(fds[k]);
                fds[k] = -1;
        }
        if (rc == 0)
                g->num_arena_segs = known;
        return rc;
}

/* Sets the arena's size in the region table, so that pointers into it resolve. Lock held. */
static void arena_set_bytes(struct epd_group *g, uint64_t bytes)
{
        struct epd_client *c = g->client;

        g->arena_bytes = bytes;
        for (unsigned i = 0; i < c->num_regions; i++)
                if (c->regions[i].id == g->arena_region_id)
                        c->regions[i].bytes = bytes;
}

int epd__group_arena_sync_locked(struct epd_group *g)
{
        struct epd_client *c = g->client;
        unsigned first = g->num_arena_segs; /* the usual case: the old segments stay */
        Epd__V1__ArenaSegmentsReply *done = NULL;
        Epd__V1__Response *resp = NULL;
        int rc = 0;

        if (!g->arena)
                return 0;
        /* Every reply carries a few fds; another resize may come between two replies, so each
         * one is compared with what is mapped. Bounded: every round maps at least one segment
         * or moves `first` down. */
        for (int round = 0; round < 8192; round++) {
                Epd__V1__Request req = EPD__V1__REQUEST__INIT;
                Epd__V1__ArenaSegments m = EPD__V1__ARENA_SEGMENTS__INIT;
                int fds[2];
                unsigned p = 0;

                m.group_id = g->id;
                m.rank = g->rank;
                m.first = first;
                req.body_case = EPD__V1__REQUEST__BODY_ARENA_SEGMENTS;
                req.arena_segments = &m;
                rc = epd__client_send_locked(c, &req, NULL, 0);
                if (rc == 0)
                        rc = epd__client_wait_locked(c, req.id, c->timeout_ms, &resp, fds);
                if (rc < 0)
                        return rc;
                const Epd__V1__ArenaSegmentsReply *r =
                        resp->body_case == EPD__V1__RESPONSE__BODY_ARENA_SEGMENTS
                                ? resp->arena_segments
                                : NULL;
                unsigned nf = fds[1] >= 0 ? 2 : fds[0] >= 0 ? 1 : 0;
                if (resp->status != EPD__V1__STATUS_CODE__OK || !r || r->n_segments == 0 ||
                    r->first != first || r->num_fds != nf) {
                        rc = resp->status != EPD__V1__STATUS_CODE__OK
                                     ? epd__client_fail(c, epd__status_from_wire(resp->status),
                                                        "arena segments: %s",
                                                        resp->message ? resp->message : "")
                                     : epd__client_fail(c, EPD_INTERNAL,
                                                        "bad ArenaSegments reply");
                        for (int i = 0; i < 2; i++)
                                if (fds[i] >= 0)
                                        close(fds[i]);
                        break;
                }
                while (p < g->num_arena_segs && p < r->n_segments &&
                       same_segment(&g->arena_segs[p], r->segments[p]))
                        p++;
                if (first > p) {
                        /* A segment before `first` changed: ask again from there. */
                        for (int i = 0; i < 2; i++)
                                if (fds[i] >= 0)
                                        close(fds[i]);
                        first = p;
                        epd__v1__response__free_unpacked(resp, NULL);
                        resp = NULL;
                        continue;
                }
                if (first < r->n_segments && nf == 0) {
                        rc = epd__client_fail(c, EPD_INTERNAL, "ArenaSegments reply without fds");
                        break;
                }
                rc = arena_install(g, r->segments, r->n_segments, first, fds, nf);
                if (rc < 0)
                        break;
                if (first + nf >= r->n_segments) {
                        done = resp->arena_segments;
                        break;
                }
                first += nf;
                epd__v1__response__free_unpacked(resp, NULL);
                resp = NULL;
        }
        if (rc == 0 && !done)
                rc = epd__client_fail(c, EPD_INTERNAL, "the arena's segments kept changing");
        if (rc == 0) {
                const Epd__V1__ArenaSegment *last = done->segments[done->n_segments - 1];
                uint64_t end = last->offset + last->bytes;
                /* Segments the daemon dropped: their memory goes once they are unmapped. */
                arena_unmap_range(g, end, g->arena_mapped_end);
                g->arena_mapped_end = end;
                g->num_arena_segs = (unsigned)done->n_segments;
                g->arena_generation = done->generation;
                arena_set_bytes(g, done->arena_bytes <= end ? done->arena_bytes : end);
        }
        if (resp)
                epd__v1__response__free_unpacked(resp, NULL);
        return rc;
}

/* Sets up the arena from GroupJoined: reserves its range, maps the first segment (fd, taken)
 * and fetches the others. Lock held. */
static int arena_enter_locked(struct epd_group *g, const Epd__V1__GroupJoined *j, int fd)
{
        struct epd_client *c = g->client;
        uint64_t reserve = page_up(j->arena_reserved_bytes > j->arena_bytes
                                           ? j->arena_reserved_bytes
                                           : j->arena_bytes);
        void *p;
        int rc;

        if (j->n_arena_segments == 0) {
                close(fd);
                return epd__client_fail(c, EPD_INTERNAL, "GroupJoined lists no arena segment");
        }
        p = mmap(NULL, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
                close(fd);
                return epd__client_fail(c, EPD_UNAVAILABLE,
                                        "cannot reserve %llu bytes of address space for the output arena: %s",
                                        (unsigned long long)reserve, strerror(errno));
        }
        g->arena = p;
        g->arena_reserved = reserve;
        g->arena_region_id = j->arena_region_id;
        rc = arena_install(g, j->arena_segments, j->n_arena_segments, 0, &fd, 1);
        if (rc == 0 && j->n_arena_segments > 1)
                rc = epd__group_arena_sync_locked(g);
        else if (rc == 0) {
                g->arena_mapped_end = j->arena_segments[0]->offset + j->arena_segments[0]->bytes;
                g->arena_generation = j->arena_generation;
                g->arena_bytes = j->arena_bytes;
        }
        if (rc == 0)
                rc = epd__client_region_add(c, g->arena_region_id, g->arena, g->arena_bytes, 0);
        return rc;
}

/* Whether CUDA MPS is enabled on the device a create or join names, as the daemon asks for
 * client-executed groups (ranks of several processes share a GPU only under it). Only on the
 * cuda backend, and only then does joining initialise CUDA in this process. */
static int join_mps(struct epd_client *c, const struct epd_group_args *args)
{
#ifdef EPD_HAVE_CUDA
        uint32_t dev = args->device;

        if (!(c->daemon_caps & EPD__V1__CAPABILITY__CAP_CUDA_REGIONS))
                return 0;
        for (uint32_t i = 0; args->device_uuid && i < c->info.num_devices && i < 16; i++)
                if (strcmp(c->info.devices[i].uuid, args->device_uuid) == 0)
                        dev = i;
        return epd__cuda_mps_enabled(c, dev);
#else
        (void)c;
        (void)args;
        return 0;
#endif
}

static int group_enter(struct epd_client *c, const struct epd_group_args *args, int create,
                       struct epd_group **out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__GroupCreate gc = EPD__V1__GROUP_CREATE__INIT;
        Epd__V1__GroupJoin gj = EPD__V1__GROUP_JOIN__INIT;
        Epd__V1__GroupConfig wcfg;
        Epd__V1__Response *resp;
        struct epd_group *g;
        int fds[2], rc;

        if (!c || !args || !out || !args->name || args->size < sizeof(*args))
                return EPD_INVALID_ARGUMENT;
        if (create) {
                if (!args->config)
                        return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                                "group create needs a config");
                config_to_wire(args->config, &wcfg);
                gc.name = (char *)args->name;
                gc.secret.data = (uint8_t *)args->secret;
                gc.secret.len = args->secret_len;
                gc.config = &wcfg;
                gc.rank = args->rank;
                gc.device = args->device;
                gc.device_uuid = (char *)(args->device_uuid ? args->device_uuid : "");
                if (args->config->size >= offsetof(struct epd_group_config, execution) +
                                                   sizeof(args->config->execution) &&
                    args->config->execution == EPD_EXECUTION_CLIENT)
                        gc.mps_enabled = join_mps(c, args);
                req.body_case = EPD__V1__REQUEST__BODY_GROUP_CREATE;
                req.group_create = &gc;
        } else {
                gj.name = (char *)args->name;
                gj.secret.data = (uint8_t *)args->secret;
                gj.secret.len = args->secret_len;
                gj.rank = args->rank;
                gj.device = args->device;
                gj.device_uuid = (char *)(args->device_uuid ? args->device_uuid : "");
                gj.mps_enabled = join_mps(c, args);
                req.body_case = EPD__V1__REQUEST__BODY_GROUP_JOIN;
                req.group_join = &gj;
        }
        rc = epd__client_call(c, &req, NULL, 0, &resp, fds);
        if (rc < 0)
                return rc;
        const Epd__V1__GroupJoined *j = resp->group_joined;
        g = calloc(1, sizeof(*g));
        if (!g || !j || !j->config) {
                free(g);
                rc = epd__client_fail(c, EPD_INTERNAL, "bad GroupJoined reply");
                goto out;
        }
        g->client = c;
        g->id = j->group_id;
        g->rank = j->rank;
        g->device = j->device;
        g->config.size = sizeof(g->config);
        g->config.world_size = j->config->world_size;
        g->config.num_experts = j->config->num_experts;
        g->config.hidden = j->config->hidden;
        g->config.max_tokens_per_rank = j->config->max_tokens_per_rank;
        g->config.max_topk = j->config->max_topk;
        g->config.dispatch_dtype = (enum epd_dtype)j->config->dispatch_dtype;
        g->config.scale_block = j->config->scale_block;
        g->config.op_timeout_ms = j->config->op_timeout_ms;
        g->config.arena_bytes = j->config->arena_bytes;
        g->config.execution = (enum epd_execution)j->config->execution;
        g->config.max_expert_alignment = j->config->max_expert_alignment;
        g->config.expert_block_rows = j->config->expert_block_rows;
        g->config.quantize = j->config->quantize;
        g->config.num_handle_slots = j->config->num_handle_slots;
        g->config.sms_per_rank = j->config->sms_per_rank;
        g->config.recv_rows = j->config->recv_rows;
        if (fds[0] >= 0 && j->doorbell_bytes >= sizeof(struct epd_doorbell)) {
                void *p = mmap(NULL, j->doorbell_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                               fds[0], 0);
                if (p != MAP_FAILED) {
                        g->doorbell = p;
                        g->doorbell_bytes = j->doorbell_bytes;
                }
        }
        if (j->arena_bytes && fds[1] >= 0 && j->arena_kind == EPD__V1__REGION_KIND__HOST_MEMFD) {
                pthread_mutex_lock(&c->lock);
                rc = arena_enter_locked(g, j, fds[1]);
                pthread_mutex_unlock(&c->lock);
                fds[1] = -1; /* taken */
                if (rc < 0) {
                        /* The daemon keeps the binding; leaving releases it. */
                        (void)epd_group_leave(g);
                        goto out;
                }
        }
        /* A daemon that predates recv_rows drops it and gives the worst-case receive area. */
        if (create && wcfg.recv_rows && !g->config.recv_rows) {
                (void)epd_group_leave(g);
                rc = epd__client_fail(c, EPD_VERSION_MISMATCH,
                                      "group '%s': the daemon does not take recv_rows (it "
                                      "predates it); create the group without it",
                                      args->name);
                goto out;
        }
        if (g->config.execution == EPD_EXECUTION_CLIENT) {
                rc = epd__cx_enter(g, j, fds[1]);
                fds[1] = -1; /* taken */
                if (rc < 0) {
                        (void)epd_group_leave(g);
                        goto out;
                }
        }
        *out = g;
out:
        for (int i = 0; i < 2; i++)
                if (fds[i] >= 0)
                        close(fds[i]);
        epd__v1__response__free_unpacked(resp, NULL);
        return rc;
}

int epd_group_create(struct epd_client *client, const struct epd_group_args *args,
                     struct epd_group **out)
{
        return group_enter(client, args, 1, out);
}

int epd_group_join(struct epd_client *client, const struct epd_group_args *args,
                   struct epd_group **out)
{
        return group_enter(client, args, 0, out);
}

int epd_group_leave(struct epd_group *group)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__GroupLeave gl = EPD__V1__GROUP_LEAVE__INIT;
        Epd__V1__Response *resp;
        struct epd_client *c;
        int rc;

        if (!group)
                return 0;
        c = group->client;
        gl.group_id = group->id;
        gl.rank = group->rank;
        req.body_case = EPD__V1__REQUEST__BODY_GROUP_LEAVE;
        req.group_leave = &gl;
        rc = epd__client_call(c, &req, NULL, 0, &resp, NULL);
        if (rc == 0)
                epd__v1__response__free_unpacked(resp, NULL);
        pthread_mutex_lock(&c->lock);
        for (unsigned i = 0; i < c->num_regions; i++) {
                if (c->regions[i].id == group->arena_region_id && group->arena_region_id) {
                        epd__client_region_remove_at(c, i);
                        break;
                }
        }
        pthread_mutex_unlock(&c->lock);
        if (group->arena)
                munmap(group->arena, group->arena_reserved);
        free(group->arena_segs);
        epd__cx_leave(group->cx);
        epd__group_stream_fini(group);
        if (group->doorbell)
                munmap(group->doorbell, group->doorbell_bytes);
        free(group);
        return rc;
}

uint64_t epd_group_id(const struct epd_group *group)
{
        return group ? group->id : 0;
}

uint32_t epd_group_rank(const struct epd_group *group)
{
        return group ? group->rank : 0;
}

const struct epd_group_config *epd_group_config(const struct epd_group *group)
{
        return group ? &group->config : NULL;
}

void *epd_group_arena(const struct epd_group *group, uint64_t *bytes)
{
        if (!group)
                return NULL;
        if (bytes)
                *bytes = group->arena_bytes;
        return group->arena;
}

int epd_size_hint(struct epd_client *client, const struct epd_group_config *config,
                  uint32_t expert_alignment, struct epd_size_hint *out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__SizeHint sh = EPD__V1__SIZE_HINT__INIT;
        Epd__V1__GroupConfig wcfg;
        Epd__V1__Response *resp;
        int rc;

        if (!client || !config || !out)
                return EPD_INVALID_ARGUMENT;
        config_to_wire(config, &wcfg);
        sh.config = &wcfg;
        sh.expert_alignment = expert_alignment;
        req.body_case = EPD__V1__REQUEST__BODY_SIZE_HINT;
        req.size_hint = &sh;
        rc = epd__client_call(client, &req, NULL, 0, &resp, NULL);
        if (rc < 0)
                return rc;
        if (resp->size_hint) {
                out->daemon_bytes_per_rank = resp->size_hint->daemon_bytes_per_rank;
                out->max_rows_non_expand = resp->size_hint->max_rows_non_expand;
                out->max_rows_expand = resp->size_hint->max_rows_expand;
                out->arena_bytes_non_expand = resp->size_hint->arena_bytes_non_expand;
                out->arena_bytes_expand = resp->size_hint->arena_bytes_expand;
                out->client_buffer_bytes_per_rank =
                        resp->size_hint->client_buffer_bytes_per_rank;
        }
        epd__v1__response__free_unpacked(resp, NULL);
        return 0;
}
