/* cx.c - client-executed ops in libepd (include/epd.h, docs/client-execution.md).
 *
 * At join, a client-executed group's GroupJoined carries every rank's communication buffer; this
 * file maps them once and runs the rank's ops over them. On the host backend all R buffers are one
 * sealed memfd (rank r at r * stride), mapped shared, and an op runs now on the calling thread
 * through cpu/cx.c: no message to the daemon, no lock of the client. The daemon writes the abort,
 * drain and epoch words of the same memory; cpu/cx.c polls them.
 *
 * On the cuda backend the buffers are one cuMem allocation that cx_cuda.c imports and maps on
 * this process's GPU, and an op is a kernel launch on the caller's stream; the calls below that
 * read a buffer then copy from device memory (the caller synchronises its stream first), and the
 * pointers they hand out are device addresses.
 *
 * Threading: the mapping is fixed from join to leave, so calls of different ranks (groups) run
 * concurrently; calls of one rank are a sequence (docs/client-execution.md).
 */
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client_internal.h"
#include "cx.h"
#include "cx_layout.h"
#include "util.h"

/* One registration: every rank's part as mapped here (this rank's own: the caller's pointer). */
struct epd__cx_mem {
        uint8_t *at[CX_MAX_RANKS];
        uint64_t bytes[CX_MAX_RANKS];
        void *map[CX_MAX_RANKS];      /* a peer's mapping, or NULL */
        uint64_t map_len[CX_MAX_RANKS];
};

struct epd__cx_group {
        struct cx_layout layout;
        uint8_t *map;                 /* every rank's buffer */
        uint64_t map_bytes;
        uint64_t stride;
        uint8_t **bufs;               /* [R] */
        struct cx_rank rank;
        /* Registrations of epd_cx_register, by number - 1. */
        struct epd__cx_mem *mem[CX_MAX_MEMORY];
        uint32_t num_mem;
#ifdef EPD_HAVE_CUDA
        struct epd__cx_dev *dev;      /* device memory (cuda backend), else NULL */
#endif
};

/* Copies n bytes at src of the buffers (a host mapping or device memory) to dst. */
static int cx_read(const struct epd__cx_group *cx, const void *src, void *dst, size_t n)
{
#ifdef EPD_HAVE_CUDA
        if (cx->dev)
                return epd__cx_dev_read(cx->dev, src, dst, n);
#endif
        (void)cx;
        memcpy(dst, src, n);
        return 0;
}

/* A word of the buffers: an acquire load in host memory (the rank's executor releases it), a
 * copy from device memory. */
static uint64_t cx_load(const struct epd__cx_group *cx, const uint64_t *p)
{
        uint64_t v = 0;

#ifdef EPD_HAVE_CUDA
        if (cx->dev) {
                if (epd__cx_dev_read(cx->dev, p, &v, sizeof(v)) < 0)
                        return 0;
                return v;
        }
#endif
        (void)cx;
        v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
        return v;
}

int epd__cx_enter(struct epd_group *g, const Epd__V1__GroupJoined *j, int fd)
{
        struct epd_client *c = g->client;
        const struct epd_group_config *cfg = &g->config;
        struct cx_shape shape = {
                .world_size = cfg->world_size, .num_experts = cfg->num_experts,
                .hidden = cfg->hidden, .max_tokens = cfg->max_tokens_per_rank,
                .max_topk = cfg->max_topk, .dtype = cfg->dispatch_dtype,
                .scale_block = cfg->scale_block, .quantize = cfg->quantize,
                .max_alignment = cfg->max_expert_alignment,
                .expert_block_rows = cfg->expert_block_rows,
                .num_handles = cfg->num_handle_slots, .recv_rows = cfg->recv_rows,
        };
        struct epd__cx_group *cx;
        void *p;

        if (fd < 0 || (j->cx_kind != EPD__V1__REGION_KIND__HOST_MEMFD &&
                       j->cx_kind != EPD__V1__REGION_KIND__CUMEM_FD)) {
                if (fd >= 0)
                        close(fd);
                return epd__client_fail(c, EPD_UNAVAILABLE,
                                        "client-executed group: the daemon sent no buffers this "
                                        "libepd can map (kind %d)", (int)j->cx_kind);
        }
#ifndef EPD_HAVE_CUDA
        if (j->cx_kind == EPD__V1__REGION_KIND__CUMEM_FD) {
                close(fd);
                return epd__client_fail(c, EPD_UNAVAILABLE,
                                        "client-executed group on the cuda backend: this libepd "
                                        "was built without CUDA");
        }
#endif
        cx = calloc(1, sizeof(*cx));
        if (!cx || !(cx->bufs = calloc(cfg->world_size, sizeof(*cx->bufs)))) {
                free(cx);
                close(fd);
                return epd__client_fail(c, EPD_INTERNAL, "out of memory");
        }
        /* The same header computes the same layout here as in the daemon; a difference means
         * the two were built from different sources. */
        if (cx_layout_compute(&shape, &cx->layout) != CX_SHAPE_OK ||
            cx->layout.total_bytes != j->cx_bytes_per_rank ||
            j->cx_stride < j->cx_bytes_per_rank ||
            j->cx_total_bytes < j->cx_stride * cfg->world_size) {
                free(cx->bufs);
                free(cx);
                close(fd);
                return epd__client_fail(c, EPD_VERSION_MISMATCH,
                                        "client-executed group: the daemon's buffer layout (%llu "
                                        "bytes a rank) differs from this libepd's",
                                        (unsigned long long)j->cx_bytes_per_rank);
        }
        cx->stride = j->cx_stride;
#ifdef EPD_HAVE_CUDA
        if (j->cx_kind == EPD__V1__REGION_KIND__CUMEM_FD) {
                uint8_t *base;
                int rc = epd__cx_dev_enter(g, &cx->layout, fd, j->cx_total_bytes, j->cx_stride,
                                           &cx->dev, &base);
                if (rc < 0) {
                        free(cx->bufs);
                        free(cx);
                        return rc;
                }
                for (uint32_t r = 0; r < cfg->world_size; r++)
                        cx->bufs[r] = base + r * cx->stride;
                cx->rank.layout = &cx->layout;
                cx->rank.rank = g->rank;
                cx->rank.bufs = cx->bufs;
                g->cx = cx;
                return 0;
        }
#endif
        p = mmap(NULL, j->cx_total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) {
                free(cx->bufs);
                free(cx);
                return epd__client_fail(c, EPD_UNAVAILABLE,
                                        "cannot map the group's %llu-byte buffers",
                                        (unsigned long long)j->cx_total_bytes);
        }
        cx->map = p;
        cx->map_bytes = j->cx_total_bytes;
        for (uint32_t r = 0; r < cfg->world_size; r++) {
                const struct cx_header *h;

                cx->bufs[r] = cx->map + r * cx->stride;
                h = cx_header_of(cx->bufs[r], &cx->layout);
                if (h->magic != CX_MAGIC || h->version != CX_VERSION || h->rank != r) {
                        epd__cx_leave(cx);
                        return epd__client_fail(c, EPD_VERSION_MISMATCH,
                                                "client-executed group: rank %u's buffer has no "
                                                "valid header (magic 0x%08x, version %u)",
                                                r, h->magic, h->version);
                }
        }
        cx->rank.layout = &cx->layout;
        cx->rank.rank = g->rank;
        cx->rank.bufs = cx->bufs;
        cx->rank.timeout_ns = (uint64_t)cfg->op_timeout_ms * 1000000ull;
        g->cx = cx;
        return 0;
}

static void cx_mem_free(struct epd__cx_mem *m)
{
        if (!m)
                return;
        for (uint32_t r = 0; r < CX_MAX_RANKS; r++)
                if (m->map[r])
                        munmap(m->map[r], m->map_len[r]);
        free(m);
}

void epd__cx_leave(struct epd__cx_group *cx)
{
        if (!cx)
                return;
        for (uint32_t i = 0; i < cx->num_mem; i++)
                cx_mem_free(cx->mem[i]);
#ifdef EPD_HAVE_CUDA
        epd__cx_dev_leave(cx->dev);
#endif
        if (cx->map)
                munmap(cx->map, cx->map_bytes);
        free(cx->bufs);
        free(cx);
}

/* The group's buffers, or a failure naming the misuse. */
static int cx_of(struct epd_group *group, const void *args, size_t size, size_t need,
                 void *stream, const char *what)
{
        if (!group)
                return EPD_INVALID_ARGUMENT;
        if (!args || size < need)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "%s: arguments missing or their size too small", what);
        if (!group->cx)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "%s: group %llu is daemon-executed; use epd_dispatch "
                                        "and epd_combine, or create the group with execution "
                                        "EPD_EXECUTION_CLIENT", what,
                                        (unsigned long long)group->id);
#ifdef EPD_HAVE_CUDA
        if (group->cx->dev)
                return 0; /* any stream of the group's GPU; NULL: the legacy default stream */
#endif
        if (stream)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "%s: the host backend runs ops on the calling thread; "
                                        "stream must be NULL", what);
        return 0;
}

/* The areas of registration mem_id (from 1) for a dispatch (the receive area) or a combine
 * (the y area), or NULL with why: this rank's verdict, which its peers see too. */
static uint8_t *const *cx_mem_area(struct epd_group *group, int dispatch, uint32_t mem_id,
                                   char *why, size_t why_len)
{
        const struct epd__cx_group *cx = group->cx;
        const char *name = dispatch ? "recv_memory" : "y_memory";
        uint64_t need = dispatch ? cx_recv_area_bytes(&cx->layout) : cx_y_area_bytes(&cx->layout);
        const struct epd__cx_mem *m;

        if (mem_id > cx->num_mem) {
                snprintf(why, why_len, "%s %u is not registered with the group (%u %s)", name,
                         mem_id, cx->num_mem,
                         cx->num_mem == 1 ? "registration" : "registrations");
                return NULL;
        }
        m = cx->mem[mem_id - 1];
        for (uint32_t r = 0; r < cx->layout.shape.world_size; r++) {
                if (m->bytes[r] < need) {
                        snprintf(why, why_len, "%s %u of rank %u has %llu bytes, the %s area "
                                 "needs %llu", name, mem_id, r,
                                 (unsigned long long)m->bytes[r], dispatch ? "receive" : "y",
                                 (unsigned long long)need);
                        return NULL;
                }
        }
        return m->at;
}

/* One op of the rank: a dispatch (dispatch, da) or a combine (ca), checked, then launched on
 * the device or run here. */
static int cx_run(struct epd_group *group, int dispatch, const struct epd_cx_dispatch_args *da,
                  const struct epd_cx_combine_args *ca, void *stream)
{
        const char *what = dispatch ? "epd_cx_dispatch" : "epd_cx_combine";
        size_t size = da ? da->size : ca ? ca->size : 0;
        char msg[512] = "", why[256] = "";
        /* Callers built before recv_memory / y_memory existed pass a shorter struct. */
        int rc = cx_of(group, dispatch ? (const void *)da : ca, size,
                       dispatch ? offsetof(struct epd_cx_dispatch_args, recv_memory)
                                : offsetof(struct epd_cx_combine_args, y_memory),
                       stream, what);
        uint32_t mem_id;
        uint8_t *const *area = NULL;

        if (rc)
                return rc;
        mem_id = dispatch ? (size >= sizeof(*da) ? da->recv_memory : 0)
                          : (size >= sizeof(*ca) ? ca->y_memory : 0);
        if (ca && ca->num_bias > 2)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_cx_combine: num_bias %u above 2", ca->num_bias);
#ifdef EPD_HAVE_CUDA
        if (group->cx->dev && mem_id)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "%s: %s %u is not registered (the cuda backend has no "
                                        "registered client memory yet)", what,
                                        dispatch ? "recv_memory" : "y_memory", mem_id);
        if (group->cx->dev)
                return dispatch ? epd__cx_dev_dispatch(group, group->cx->dev, da, stream)
                          : epd__cx_dev_combine(group, group->cx->dev, ca, stream);
#endif
        if (mem_id)
                area = cx_mem_area(group, dispatch, mem_id, why, sizeof(why));
        if (dispatch) {
                struct cx_dispatch_args a = {
                        .num_tokens = da->num_tokens, .x = da->x, .x_stride = da->x_stride,
                        .scales = da->scales, .scales_stride = da->scales_stride,
                        .topk_idx = da->topk_idx, .topk_dtype = da->topk_dtype,
                        .num_topk = da->num_topk, .weights = da->topk_weights,
                        .layout = da->layout, .expert_alignment = da->expert_alignment,
                        .zero_padding = da->zero_padding,
                        .expert_block_rows = da->expert_block_rows, .quantize = da->quantize,
                        .round_scale = da->round_scale,
                        .scale_format = (uint32_t)da->scale_format,
                        .handle = da->handle, .cached = da->cached,
                        .capacity_rows = da->capacity_rows,
                        .recv_area = area, .recv_mem = mem_id,
                        .arg_error = why[0] ? why : NULL,
                };
                rc = cx_dispatch(&group->cx->rank, &a, NULL, msg, sizeof(msg));
        } else {
                struct cx_combine_args a = {
                        .handle = ca->handle, .recv_weights = ca->recv_weights,
                        .apply_weights = ca->apply_weights,
                        .source_weights = ca->source_weights,
                        .bias = { ca->num_bias > 0 ? ca->bias[0] : NULL,
                                  ca->num_bias > 1 ? ca->bias[1] : NULL },
                        .combined = ca->combined,
                        .combined_topk_weights = ca->combined_topk_weights,
                        .y_area = area, .y_mem = mem_id, .arg_error = why[0] ? why : NULL,
                };
                rc = cx_combine(&group->cx->rank, &a, NULL, msg, sizeof(msg));
        }
        if (rc == 0)
                return 0;
        if (why[0] && rc == EPD_INVALID_ARGUMENT && !dispatch)
                return epd__client_fail(group->client, rc, "%s (rank %u: %s)", msg, group->rank,
                                        why);
        return epd__client_fail(group->client, rc, "%s", msg);
}

int epd_cx_dispatch(struct epd_group *group, const struct epd_cx_dispatch_args *args,
                    void *stream)
{
        struct epd_cx_dispatch_args full;

        /* Callers built against an older epd.h pass a shorter struct (none that has
         * round_scale also covers it with padding); what it lacks reads 0. Shorter than
         * recv_memory is refused by cx_run. */
        if (args && args->size >= offsetof(struct epd_cx_dispatch_args, recv_memory) &&
            args->size < sizeof(full)) {
                memset(&full, 0, sizeof(full));
                memcpy(&full, args, args->size);
                full.size = sizeof(full);
                args = &full;
        }
        return cx_run(group, 1, args, NULL, stream);
}

int epd_cx_combine(struct epd_group *group, const struct epd_cx_combine_args *args,
                   void *stream)
{
        return cx_run(group, 0, NULL, args, stream);
}

int epd_cx_status(struct epd_group *group, struct epd_cx_status *out)
{
        const struct cx_header *h;
        struct cx_op_status st;
        uint64_t epoch, next, tag;
        /* Callers built before the statistics fields pass a shorter struct. */
        int rc = cx_of(group, out, out ? out->size : 0, offsetof(struct epd_cx_status, kind_ops),
                       NULL, "epd_cx_status");

        if (rc)
                return rc;
        h = cx_header_of(group->cx->bufs[group->rank], &group->cx->layout);
        epoch = cx_load(group->cx, &h->epoch);
        next = cx_load(group->cx, &h->op_counter);
        if (next == 0)
                return epd__client_fail(group->client, EPD_NOT_FOUND,
                                        "epd_cx_status: rank %u has run no op since the group "
                                        "formed", group->rank);
        /* The entry is complete once its tag names the op (written last, release). */
        tag = cx_load(group->cx, &h->status[(next - 1) % CX_STATUS_RING].tag);
        if (tag != cx_tag(epoch, next - 1) ||
            cx_read(group->cx, &h->status[(next - 1) % CX_STATUS_RING], &st, sizeof(st)) < 0)
                return epd__client_fail(group->client, EPD_UNAVAILABLE,
                                        "epd_cx_status: op %llu of rank %u has not ended yet",
                                        (unsigned long long)(next - 1), group->rank);
        out->op = next - 1;
        out->status = st.status;
        out->message[0] = '\0';
        if (st.status)
                cx_format_status(&st, group->rank, next - 1, out->message,
                                 sizeof(out->message));
        if (out->size >= offsetof(struct epd_cx_status, phase_ns) + sizeof(out->phase_ns)) {
                struct cx_stats stats;

                if (cx_read(group->cx, &h->stats, &stats, sizeof(stats)) < 0)
                        return epd__client_fail(group->client, EPD_INTERNAL,
                                                "epd_cx_status: cannot read rank %u's statistics",
                                                group->rank);
                static_assert(sizeof(out->phase_ns) == sizeof(stats.phase_ns),
                              "epd_cx_status.phase_ns mirrors cx_stats.phase_ns");
                memcpy(out->kind_ops, stats.kind_ops, sizeof(out->kind_ops));
                memcpy(out->phase_ns, stats.phase_ns, sizeof(out->phase_ns));
                if (out->size >= offsetof(struct epd_cx_status, dispatch_first_ns) +
                                         sizeof(out->dispatch_first_ns)) {
                        static_assert(sizeof(out->dispatch_first_ns) == sizeof(stats.first_ns),
                                      "epd_cx_status.dispatch_first_ns mirrors cx_stats.first_ns");
                        memcpy(out->dispatch_first_ns, stats.first_ns,
                               sizeof(out->dispatch_first_ns));
                }
        }
        if (out->size >= offsetof(struct epd_cx_status, end_ns) + sizeof(out->end_ns)) {
                out->start_ns = st.start_ns;
                out->end_ns = st.end_ns;
        }
        return 0;
}

int epd_cx_counts(struct epd_group *group, uint32_t handle, struct epd_cx_counts *out)
{
        const struct cx_layout *l;
        uint8_t *own;
        struct cx_handle h;
        uint64_t epoch;
        /* Callers built before rank_prefix_matrix pass a shorter struct. */
        int rc = cx_of(group, out, out ? out->size : 0,
                       offsetof(struct epd_cx_counts, rank_prefix_matrix), NULL, "epd_cx_counts");

        if (rc)
                return rc;
        l = &group->cx->layout;
        own = group->cx->bufs[group->rank];
        if (handle >= l->shape.num_handles)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_cx_counts: handle slot %u outside 0..%u", handle,
                                        l->shape.num_handles - 1);
        epoch = cx_load(group->cx, &cx_header_of(own, l)->epoch);
        if (cx_read(group->cx, cx_handle_at(own, l, handle), &h, sizeof(h)) < 0 || h.tag == 0 ||
            h.tag >> CX_OP_BITS != epoch)
                return epd__client_fail(group->client, EPD_NOT_FOUND,
                                        "epd_cx_counts: handle slot %u holds no dispatch of the "
                                        "group's current formation", handle);
        out->num_recv_tokens = h.num_recv_tokens;
        out->num_expanded_rows = h.num_expanded_rows;
        out->num_local_experts = l->num_local_experts;
        out->num_recv_tokens_per_expert = cx_handle_i32(own, l, handle, l->h_per_expert);
        out->num_recv_tokens_per_expert_aligned =
                cx_handle_i32(own, l, handle, l->h_per_expert_aligned);
        out->world_size = l->shape.world_size;
        out->rank_prefix = cx_handle_i32(own, l, handle, l->h_rank_prefix);
        out->expert_base = cx_handle_i32(own, l, handle, l->h_expert_base);
        if (out->size >= offsetof(struct epd_cx_counts, rank_prefix_matrix) +
                                 sizeof(out->rank_prefix_matrix))
                out->rank_prefix_matrix = cx_handle_i32(own, l, handle, l->h_rank_matrix);
        return 0;
}

int epd_cx_buffers(const struct epd_group *group, struct epd_cx_buffers *out)
{
        const struct cx_layout *l;
        uint8_t *own;

        if (!group || !out || out->size < offsetof(struct epd_cx_buffers, recv_area_bytes))
                return EPD_INVALID_ARGUMENT;
        if (!group->cx)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_cx_buffers: group %llu is daemon-executed",
                                        (unsigned long long)group->id);
        l = &group->cx->layout;
        own = group->cx->bufs[group->rank];
        out->bytes_per_rank = l->total_bytes;
        out->recv_rows = l->recv_rows;
        out->num_handle_slots = l->shape.num_handles;
        out->recv_x = own + l->recv_x;
        out->recv_scales = l->num_scales ? (float *)(own + l->recv_scales) : NULL;
        out->recv_topk_idx = own + l->recv_topk_idx;
        out->recv_weights = (float *)(own + l->recv_weights);
        out->recv_src = (int64_t *)(own + l->recv_src);
        out->recv_topk_slot = (int32_t *)(own + l->recv_topk_slot);
        out->y = (uint16_t *)(own + l->y);
        out->y_weights = (float *)(own + l->y_weights);
        if (out->size >= sizeof(*out)) {
                out->recv_area_bytes = cx_recv_area_bytes(l);
                out->y_area_bytes = cx_y_area_bytes(l);
        }
        return 0;
}

/* One CxMemory request: registers (fd >= 0) or fetches rank peer's part of registration
 * index (*fd_out gets its memfd). */
static int cx_mem_call(struct epd_group *g, int fd, uint64_t offset, uint64_t bytes,
                       uint32_t index, uint32_t peer, Epd__V1__CxMemoryReply *out, int *fd_out)
{
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__CxMemory m = EPD__V1__CX_MEMORY__INIT;
        Epd__V1__Response *resp = NULL;
        int fds[2] = { -1, -1 };
        int rc;

        m.group_id = g->id;
        m.rank = g->rank;
        m.register_ = fd >= 0;
        m.offset = offset;
        m.bytes = bytes;
        m.index = index;
        m.peer = peer;
        req.body_case = EPD__V1__REQUEST__BODY_CX_MEMORY;
        req.cx_memory = &m;
        rc = epd__client_call(g->client, &req, fd >= 0 ? &fd : NULL, fd >= 0 ? 1 : 0, &resp,
                              fds);
        if (rc < 0)
                return rc;
        if (resp->body_case != EPD__V1__RESPONSE__BODY_CX_MEMORY || (fd < 0 && fds[0] < 0)) {
                for (int i = 0; i < 2; i++)
                        if (fds[i] >= 0)
                                close(fds[i]);
                epd__v1__response__free_unpacked(resp, NULL);
                return epd__client_fail(g->client, EPD_INTERNAL, "bad CxMemory reply");
        }
        *out = *resp->cx_memory;
        if (fds[1] >= 0)
                close(fds[1]);
        if (fd_out)
                *fd_out = fds[0];
        else if (fds[0] >= 0)
                close(fds[0]);
        epd__v1__response__free_unpacked(resp, NULL);
        return 0;
}

/* Maps rank peer's part of registration index once it is there, waiting for it until the
 * group's op timeout. */
static int cx_mem_map_peer(struct epd_group *g, uint32_t index, uint32_t peer,
                           struct epd__cx_mem *m, uint64_t deadline_ms)
{
        const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
        Epd__V1__CxMemoryReply r = EPD__V1__CX_MEMORY_REPLY__INIT;
        uint64_t lo;
        void *p;
        int fd = -1, rc;

        for (;;) {
                rc = cx_mem_call(g, -1, 0, 0, index, peer, &r, &fd);
                if (rc != EPD_NOT_FOUND)
                        break;
                if ((epd__now_ns() / 1000000u) >= deadline_ms)
                        return epd__client_fail(g->client, EPD_TIMEOUT,
                                                "epd_cx_register: rank %u did not register its "
                                                "memory %u within the op timeout", peer,
                                                index + 1);
                usleep(1000);
        }
        if (rc < 0)
                return rc;
        lo = r.offset / page * page;
        p = mmap(NULL, r.offset + r.bytes - lo, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 (off_t)lo);
        close(fd);
        if (p == MAP_FAILED)
                return epd__client_fail(g->client, EPD_UNAVAILABLE,
                                        "epd_cx_register: cannot map rank %u's %llu bytes", peer,
                                        (unsigned long long)r.bytes);
        m->map[peer] = p;
        m->map_len[peer] = r.offset + r.bytes - lo;
        m->at[peer] = (uint8_t *)p + (r.offset - lo);
        m->bytes[peer] = r.bytes;
        return 0;
}

int epd_cx_register(struct epd_group *group, void *ptr, uint64_t bytes, uint32_t *memory)
{
        struct epd_client *c;
        struct epd__cx_group *cx;
        struct epd__cx_mem *m;
        Epd__V1__CxMemoryReply r = EPD__V1__CX_MEMORY_REPLY__INIT;
        uint64_t offset = 0, deadline;
        int fd = -1, rc;

        if (!group)
                return EPD_INVALID_ARGUMENT;
        c = group->client;
        cx = group->cx;
        if (!cx)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "epd_cx_register: group %llu is daemon-executed",
                                        (unsigned long long)group->id);
#ifdef EPD_HAVE_CUDA
        if (cx->dev)
                return epd__client_fail(c, EPD_UNAVAILABLE,
                                        "epd_cx_register: registered client memory is not "
                                        "supported on the cuda backend yet; outputs stay in the "
                                        "group's buffers");
#endif
        if (!ptr || !bytes || !memory || (uintptr_t)ptr % 64)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "epd_cx_register needs ptr (64-byte aligned), bytes above "
                                        "0 and memory");
        pthread_mutex_lock(&c->lock);
        for (unsigned i = 0; i < c->num_regions; i++) {
                const struct epd__local_region *lr = &c->regions[i];

                if (lr->fd >= 0 && (uint8_t *)ptr >= lr->ptr &&
                    (uint8_t *)ptr - lr->ptr <= (ptrdiff_t)lr->bytes &&
                    bytes <= lr->bytes - (uint64_t)((uint8_t *)ptr - lr->ptr)) {
                        offset = (uint64_t)((uint8_t *)ptr - lr->ptr);
                        fd = fcntl(lr->fd, F_DUPFD_CLOEXEC, 0);
                        break;
                }
        }
        pthread_mutex_unlock(&c->lock);
        if (fd < 0)
                return epd__client_fail(c, EPD_INVALID_ARGUMENT,
                                        "epd_cx_register: [%p, +%llu) is not inside a host memfd "
                                        "region this client registered with its local pointer "
                                        "(epd_region_alloc)", ptr, (unsigned long long)bytes);
        if (!(m = calloc(1, sizeof(*m)))) {
                close(fd);
                return epd__client_fail(c, EPD_INTERNAL, "out of memory");
        }
        rc = cx_mem_call(group, fd, offset, bytes, 0, 0, &r, NULL);
        close(fd);
        if (rc < 0) {
                free(m);
                return rc;
        }
        /* The daemon forgets registrations when the group re-forms: numbering restarts. */
        while (cx->num_mem > r.index)
                cx_mem_free(cx->mem[--cx->num_mem]);
        if (r.index != cx->num_mem) {
                free(m);
                return epd__client_fail(c, EPD_INTERNAL, "epd_cx_register: the daemon numbered "
                                        "it %u, libepd expected %u", r.index, cx->num_mem);
        }
        m->at[group->rank] = ptr;
        m->bytes[group->rank] = bytes;
        deadline = (epd__now_ns() / 1000000u) + (group->config.op_timeout_ms ? group->config.op_timeout_ms
                                                                 : 10000);
        for (uint32_t p = 0; p < cx->layout.shape.world_size; p++) {
                if (p == group->rank)
                        continue;
                rc = cx_mem_map_peer(group, r.index, p, m, deadline);
                if (rc < 0) {
                        cx_mem_free(m);
                        return rc;
                }
        }
        cx->mem[cx->num_mem++] = m;
        *memory = cx->num_mem;
        return 0;
}
