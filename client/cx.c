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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client_internal.h"
#include "cx.h"
#include "cx_layout.h"

struct epd__cx_group {
        struct cx_layout layout;
        uint8_t *map;                 /* every rank's buffer */
        uint64_t map_bytes;
        uint64_t stride;
        uint8_t **bufs;               /* [R] */
        struct cx_rank rank;
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
                .num_handles = cfg->num_handle_slots,
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

void epd__cx_leave(struct epd__cx_group *cx)
{
        if (!cx)
                return;
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

/* One op of the rank: a dispatch (dispatch, da) or a combine (ca), checked, then launched on
 * the device or run here. */
static int cx_run(struct epd_group *group, int dispatch, const struct epd_cx_dispatch_args *da,
                  const struct epd_cx_combine_args *ca, void *stream)
{
        const char *what = dispatch ? "epd_cx_dispatch" : "epd_cx_combine";
        size_t size = da ? da->size : ca ? ca->size : 0;
        char msg[512] = "";
        int rc = cx_of(group, dispatch ? (const void *)da : ca, size,
                       dispatch ? sizeof(*da) : sizeof(*ca), stream, what);

        if (rc)
                return rc;
        if (ca && ca->num_bias > 2)
                return epd__client_fail(group->client, EPD_INVALID_ARGUMENT,
                                        "epd_cx_combine: num_bias %u above 2", ca->num_bias);
#ifdef EPD_HAVE_CUDA
        if (group->cx->dev)
                return dispatch ? epd__cx_dev_dispatch(group, group->cx->dev, da, stream)
                          : epd__cx_dev_combine(group, group->cx->dev, ca, stream);
#endif
        if (dispatch) {
                struct cx_dispatch_args a = {
                        .num_tokens = da->num_tokens, .x = da->x, .x_stride = da->x_stride,
                        .scales = da->scales, .scales_stride = da->scales_stride,
                        .topk_idx = da->topk_idx, .topk_dtype = da->topk_dtype,
                        .num_topk = da->num_topk, .weights = da->topk_weights,
                        .layout = da->layout, .expert_alignment = da->expert_alignment,
                        .zero_padding = da->zero_padding,
                        .expert_block_rows = da->expert_block_rows, .quantize = da->quantize,
                        .handle = da->handle, .cached = da->cached,
                        .capacity_rows = da->capacity_rows,
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
                };
                rc = cx_combine(&group->cx->rank, &a, NULL, msg, sizeof(msg));
        }
        if (rc == 0)
                return 0;
        return epd__client_fail(group->client, rc, "%s", msg);
}

int epd_cx_dispatch(struct epd_group *group, const struct epd_cx_dispatch_args *args,
                    void *stream)
{
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
        int rc = cx_of(group, out, out ? out->size : 0, sizeof(*out), NULL, "epd_cx_status");

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
        return 0;
}

int epd_cx_counts(struct epd_group *group, uint32_t handle, struct epd_cx_counts *out)
{
        const struct cx_layout *l;
        uint8_t *own;
        struct cx_handle h;
        uint64_t epoch;
        int rc = cx_of(group, out, out ? out->size : 0, sizeof(*out), NULL, "epd_cx_counts");

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
        return 0;
}

int epd_cx_buffers(const struct epd_group *group, struct epd_cx_buffers *out)
{
        const struct cx_layout *l;
        uint8_t *own;

        if (!group || !out || out->size < sizeof(*out))
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
        return 0;
}
