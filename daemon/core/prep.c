/* prep.c - an op's validation (docs/architecture.md, "Ops and sequencing"; docs/semantics.md §1):
 * once every rank submitted, what must match across ranks is checked against rank 0, each rank's
 * tensors against its regions and the group's shapes, and the exec the backend runs is filled with
 * the resolved addresses. Works on the native requests (struct epd_op_request); loop thread only.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "tensor.h"

struct prep {
        struct epdd_op *op;
        struct epdd_exec *ex;
        struct epdd_region **refs;     /* regions referenced by the exec */
        unsigned num_refs, cap_refs;
        char err[512];
        int status;
};

static int prep_fail(struct prep *p, int status, uint32_t rank, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

static int prep_fail(struct prep *p, int status, uint32_t rank, const char *fmt, ...)
{
        char detail[400];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(detail, sizeof(detail), fmt, ap);
        va_end(ap);
        snprintf(p->err, sizeof(p->err), "group '%s' op %llu rank %u: %s", p->op->group->name,
                 (unsigned long long)p->op->number, rank, detail);
        p->status = status;
        return status;
}

static int prep_ref(struct prep *p, struct epdd_region *r)
{
        if (p->num_refs == p->cap_refs) {
                unsigned cap = p->cap_refs ? p->cap_refs * 2 : 16;
                struct epdd_region **n = realloc(p->refs, cap * sizeof(*n));
                if (!n)
                        return EPD_INTERNAL;
                p->refs = n;
                p->cap_refs = cap;
        }
        epd_region_ref(r);
        p->refs[p->num_refs++] = r;
        return 0;
}

/* Whether the group's ranks live on more than one device. */
static int group_spans_devices(const struct epdd_group *g)
{
        for (uint32_t r = 1; r < g->cfg.world_size; r++)
                if (g->ranks[r].device != g->ranks[0].device)
                        return 1;
        return 0;
}

/* Checks dtype and shape [rows, cols] (cols 0: one-dimensional [rows]) and resolves the tensor.
 * exact_rows: sizes[0] must equal rows; else sizes[0] >= rows and the whole declared extent is
 * resolved (outputs: sizes[0] is the capacity). */
static int prep_tensor(struct prep *p, uint32_t rank, const char *what,
                       const struct epd_tensor *ref, enum epd_dtype dtype, uint64_t rows,
                       uint64_t cols, int exact_rows, struct epd_mat *out, uint64_t *capacity)
{
        struct epdd_client *c = p->op->subs[rank].conn;
        const struct epd_tensor t = *ref;
        struct epdd_region *r;
        char err[256];
        int rc;

        memset(out, 0, sizeof(*out));
        if (!epd__tensor_present(&t))
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: absent", what);
        if (t.dtype != dtype)
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: dtype %d, expected %d", what,
                                 (int)t.dtype, (int)dtype);
        if (t.ndim != (cols ? 2u : 1u))
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: %u dims, expected %u", what,
                                 t.ndim, cols ? 2u : 1u);
        if (cols && t.sizes[1] != cols)
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank,
                                 "%s: %llu columns, expected %llu", what,
                                 (unsigned long long)t.sizes[1], (unsigned long long)cols);
        if (exact_rows ? t.sizes[0] != rows : t.sizes[0] < rows)
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank, "%s: %llu rows, expected %s%llu",
                                 what, (unsigned long long)t.sizes[0], exact_rows ? "" : "at least ",
                                 (unsigned long long)rows);
        rc = epd_region_resolve(c, &t, t.sizes[0], cols ? cols : 1, &r, &out->ptr, &out->stride,
                                err, sizeof(err));
        if (rc < 0)
                return prep_fail(p, rc, rank, "%s: %s", what, err);
        /* A CUDA IPC import is mapped for its own GPU only (the daemon opens it once, on the
         * device the memory lives on), so a kernel of another GPU of the group would fault on
         * it and take the daemon's context down with every group on it (seen on two H200s).
         * Until imports are opened per device, such a group needs cuMem memory. */
        if (r->mem.kind == EPD_REGION_CUDA_IPC && group_spans_devices(p->op->group))
                return prep_fail(p, EPD_INVALID_ARGUMENT, rank,
                                 "%s: cudaMalloc memory (a CUDA IPC region) cannot be used by a "
                                 "group spread over several GPUs; allocate it with "
                                 "epd_device_alloc or another cuMem allocator (PyTorch: "
                                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", what);
        if (capacity)
                *capacity = t.sizes[0];
        return prep_ref(p, r);
}

static uint32_t dispatch_topk(const struct epd_op_request *m)
{
        const struct epd_tensor *topk_idx = &m->t[EPD_OPREC_TOPK_IDX];

        if (m->num_topk)
                return m->num_topk;
        return epd__tensor_present(topk_idx) && topk_idx->ndim == 2 ? (uint32_t)topk_idx->sizes[1]
                                                                    : 0;
}

static int prep_dispatch(struct prep *p)
{
        struct epdd_op *op = p->op;
        struct epdd_group *g = op->group;
        struct epdd_exec *ex = p->ex;
        const struct epdd_group_cfg *cfg = &g->cfg;
        const struct epd_op_request *m0 = &op->subs[0].req;
        struct epdd_handle *h = NULL;
        uint32_t R = cfg->world_size;

        ex->layout = (enum epd_layout)m0->layout;
        ex->expert_alignment = m0->expert_alignment ? m0->expert_alignment : 1;
        ex->zero_padding = (m0->flags & EPD_OPREC_ZERO_PADDING) != 0;
        ex->has_weights = epd__tensor_present(&m0->t[EPD_OPREC_TOPK_WEIGHTS]);
        ex->num_topk = dispatch_topk(m0);
        /* The top-k dtype comes from the first rank that gives topk_idx: a rank without tokens
         * may leave it out. */
        ex->topk_dtype = EPD_DTYPE_INVALID;
        for (uint32_t r = 0; r < R && ex->topk_dtype == EPD_DTYPE_INVALID; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                if (epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX]))
                        ex->topk_dtype = m->t[EPD_OPREC_TOPK_IDX].dtype;
        }
        if (m0->handle_id) {
                h = epd_group_handle_find(g, m0->handle_id);
                if (!h)
                        return prep_fail(p, EPD_NOT_FOUND, 0, "handle %llu does not exist",
                                         (unsigned long long)m0->handle_id);
                /* As for combine: a rank that released the handle no longer has it. */
                for (uint32_t r = 0; r < R; r++)
                        if (h->ranks[r].released)
                                return prep_fail(p, EPD_NOT_FOUND, r,
                                                 "handle %llu was released by rank %u",
                                                 (unsigned long long)h->id, r);
                ex->handle_state = h->state;
                ex->topk_dtype = h->topk_dtype;
                if (!ex->num_topk)
                        ex->num_topk = h->num_topk;
        }
        /* A new dispatch makes a handle that lives until every rank releases it: a client
         * that never releases must not take the daemon's memory (each holds a workspace). */
        if (!h && g->num_handles >= g->daemon->cfg.max_handles_per_group) {
                snprintf(p->err, sizeof(p->err),
                         "group '%s' op %llu: the group holds %u live handles, the limit max_handles_per_group; every rank releases a handle (epd_handle_release) once no combine or cached dispatch needs it",
                         g->name, (unsigned long long)op->number, g->num_handles);
                p->status = EPD_UNAVAILABLE;
                return p->status;
        }
        /* docs/semantics.md §1: what must match across ranks. */
        for (uint32_t r = 1; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                if (m->handle_id != m0->handle_id)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "handle %llu differs from rank 0's %llu",
                                         (unsigned long long)m->handle_id,
                                         (unsigned long long)m0->handle_id);
                /* expert_alignment 0 means 1 (epd.h): compare what the values mean. */
                if (m->layout != m0->layout ||
                    (m->expert_alignment ? m->expert_alignment : 1) != ex->expert_alignment ||
                    ((m->flags ^ m0->flags) & EPD_OPREC_ZERO_PADDING))
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "layout/expert_alignment/zero_padding differ from rank 0's");
                if (epd__tensor_present(&m->t[EPD_OPREC_TOPK_WEIGHTS]) != ex->has_weights)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "topk_weights %s but %s on rank 0",
                                         ex->has_weights ? "absent" : "present",
                                         ex->has_weights ? "present" : "absent");
                if ((dispatch_topk(m) ? dispatch_topk(m) : ex->num_topk) != ex->num_topk)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "top-k width %u differs from rank 0's %u",
                                         dispatch_topk(m), ex->num_topk);
                if (!h && epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX]) &&
                    m->t[EPD_OPREC_TOPK_IDX].dtype != ex->topk_dtype)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "topk_idx dtype differs from rank 0's");
        }
        if (ex->layout != EPD_LAYOUT_NON_EXPAND && ex->layout != EPD_LAYOUT_EXPAND)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "unknown layout %d", (int)ex->layout);
        if (ex->expert_alignment > 4096)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "expert_alignment %u exceeds 4096",
                                 ex->expert_alignment);
        if (ex->zero_padding && ex->layout != EPD_LAYOUT_EXPAND)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "zero_padding needs the EXPAND layout");
        if (ex->num_topk < 1 || ex->num_topk > cfg->max_topk)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "top-k width %u outside 1..%u",
                                 ex->num_topk, cfg->max_topk);
        if (h && (h->layout != ex->layout || h->num_topk != ex->num_topk))
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0,
                                 "cached dispatch must use the handle's layout and top-k width");
        if (!h && ex->topk_dtype != EPD_DTYPE_INT32 && ex->topk_dtype != EPD_DTYPE_INT64)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0, "topk_idx must be int32 or int64");

        int expand = ex->layout == EPD_LAYOUT_EXPAND;
        for (uint32_t r = 0; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                struct epdd_exec_rank *er = &ex->ranks[r];
                uint32_t n = m->num_tokens;
                uint64_t cap = UINT64_MAX, c;
                int rc;

                er->num_tokens = n;
                er->device = g->ranks[r].device;
                if (n > cfg->max_tokens)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "num_tokens %u exceeds max_tokens_per_rank %u", n,
                                         cfg->max_tokens);
                if (h && h->ranks[r].num_tokens != n)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "cached dispatch with %u tokens, the handle has %u", n,
                                         h->ranks[r].num_tokens);
                if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_X])) {
                        rc = prep_tensor(p, r, "x", &m->t[EPD_OPREC_X], cfg->dtype, n, cfg->hidden, 1,
                                         &er->src.x, NULL);
                        if (rc < 0)
                                return rc;
                }
                if (cfg->dtype == EPD_DTYPE_FP8_E4M3) {
                        if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_SCALES])) {
                                rc = prep_tensor(p, r, "scales", &m->t[EPD_OPREC_SCALES], EPD_DTYPE_FP32, n,
                                                 cfg->scale_cols, 1, &er->src.scales, NULL);
                                if (rc < 0)
                                        return rc;
                        }
                } else if (epd__tensor_present(&m->t[EPD_OPREC_SCALES])) {
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r, "scales given for a bf16 group");
                }
                if (h) {
                        if (epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX]))
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "cached dispatch takes no topk_idx");
                } else if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_TOPK_IDX])) {
                        struct epd_mat topk;
                        rc = prep_tensor(p, r, "topk_idx", &m->t[EPD_OPREC_TOPK_IDX], ex->topk_dtype, n,
                                         ex->num_topk, 1, &topk, NULL);
                        if (rc < 0)
                                return rc;
                        er->topk_idx = topk.ptr;
                        er->topk_stride = topk.stride / epd_dtype_size(ex->topk_dtype);
                }
                if (ex->has_weights && (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_TOPK_WEIGHTS]))) {
                        rc = prep_tensor(p, r, "topk_weights", &m->t[EPD_OPREC_TOPK_WEIGHTS], EPD_DTYPE_FP32, n,
                                         ex->num_topk, 1, &er->src.weights, NULL);
                        if (rc < 0)
                                return rc;
                }
                /* Outputs. */
                er->use_arena = ((m->flags & EPD_OPREC_USE_ARENA) != 0);
                if (((m->flags & EPD_OPREC_USE_ARENA) != 0)) {
                        if (!g->ranks[r].arena)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "use_arena but the group has no output arena (arena_bytes 0)");
                        if (epd__tensor_present(&m->t[EPD_OPREC_RECV_X]) || epd__tensor_present(&m->t[EPD_OPREC_RECV_SRC]))
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "use_arena and output tensors are exclusive");
                        er->arena = g->ranks[r].arena;
                        er->capacity_rows = UINT64_MAX;
                        if (h && h->ranks[r].arena.used)
                                er->place = h->ranks[r].arena;
                        continue;
                }
                if (!epd__tensor_present(&m->t[EPD_OPREC_RECV_X]))
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "recv_x is required (or use_arena)");
                rc = prep_tensor(p, r, "recv_x", &m->t[EPD_OPREC_RECV_X], cfg->dtype, 0, cfg->hidden, 0,
                                 &er->dst.recv_x, &c);
                if (rc < 0)
                        return rc;
                cap = c;
                if (cfg->dtype == EPD_DTYPE_FP8_E4M3) {
                        if (!epd__tensor_present(&m->t[EPD_OPREC_RECV_SCALES]))
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "recv_scales is required for fp8");
                        rc = prep_tensor(p, r, "recv_scales", &m->t[EPD_OPREC_RECV_SCALES], EPD_DTYPE_FP32, 0,
                                         cfg->scale_cols, 0, &er->dst.recv_scales, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_TOPK_IDX])) {
                        if (expand)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "EXPAND has no recv_topk_idx");
                        rc = prep_tensor(p, r, "recv_topk_idx", &m->t[EPD_OPREC_RECV_TOPK_IDX], ex->topk_dtype,
                                         0, ex->num_topk, 0, &er->dst.recv_topk_idx, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_WEIGHTS]) && ex->has_weights) {
                        rc = prep_tensor(p, r, "recv_weights", &m->t[EPD_OPREC_RECV_WEIGHTS], EPD_DTYPE_FP32, 0,
                                         expand ? 0 : ex->num_topk, 0, &er->dst.recv_weights, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_SRC])) {
                        rc = prep_tensor(p, r, "recv_src", &m->t[EPD_OPREC_RECV_SRC], EPD_DTYPE_INT64, 0, 0, 0,
                                         &er->dst.recv_src, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_RECV_TOPK_SLOT])) {
                        if (!expand)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "NON_EXPAND has no recv_topk_slot");
                        rc = prep_tensor(p, r, "recv_topk_slot", &m->t[EPD_OPREC_RECV_TOPK_SLOT],
                                         EPD_DTYPE_INT32, 0, 0, 0, &er->dst.recv_topk_slot, &c);
                        if (rc < 0)
                                return rc;
                        cap = c < cap ? c : cap;
                }
                er->capacity_rows = cap;
        }
        if (h) {
                h->busy = 1;
                op->handle = h;
        }
        return 0;
}

/* The weight inputs of a combine (docs/semantics.md §3), after the handle's options are in the
 * exec and the ranks agree on whether recv_weights are given: recv_weights, fp32 [>= rows, K_op]
 * on each destination, NON_EXPAND only; source_weights, fp32 [N_s, K_op] on each source, w(t, k)
 * of apply_weights, needed on every source with tokens when the dispatch carried no weights. */
static int prep_combine_weights(struct prep *p, const struct epdd_handle *h)
{
        struct epdd_op *op = p->op;
        struct epdd_exec *ex = p->ex;
        const uint32_t R = op->group->cfg.world_size, K = ex->num_topk;
        char what[96];
        int rc;

        ex->recv_weights = epd__tensor_present(&op->subs[0].req.t[EPD_OPREC_COMBINE_RECV_WEIGHTS]);
        if (ex->recv_weights && ex->layout != EPD_LAYOUT_NON_EXPAND)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0,
                                 "recv_weights: the handle's dispatch is EXPAND; recv_weights "
                                 "are NON_EXPAND only");
        for (uint32_t r = 0; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                const struct epd_tensor *rw = &m->t[EPD_OPREC_COMBINE_RECV_WEIGHTS];
                const struct epd_tensor *sw = &m->t[EPD_OPREC_SOURCE_WEIGHTS];
                struct epdd_exec_rank *er = &ex->ranks[r];
                const uint32_t n = h->ranks[r].num_tokens;
                const uint64_t rows = (uint64_t)h->ranks[r].rows;

                if (ex->recv_weights) {
                        snprintf(what, sizeof(what), "recv_weights (expected fp32 [%llu, %u])",
                                 (unsigned long long)rows, K);
                        rc = prep_tensor(p, r, what, rw, EPD_DTYPE_FP32, rows, K, 0,
                                         &er->recv_weights, NULL);
                        if (rc < 0)
                                return rc;
                }
                if (epd__tensor_present(sw) || (ex->apply_weights && !h->has_weights && n > 0)) {
                        if (!epd__tensor_present(sw))
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "apply_weights needs source_weights, fp32 "
                                                 "[%u, %u], when the dispatch carried no weights",
                                                 n, K);
                        snprintf(what, sizeof(what), "source_weights (expected fp32 [%u, %u])", n,
                                 K);
                        rc = prep_tensor(p, r, what, sw, EPD_DTYPE_FP32, n, K, 1,
                                         &er->comb.source_weights, NULL);
                        if (rc < 0)
                                return rc;
                }
        }
        return 0;
}

static int prep_combine(struct prep *p)
{
        struct epdd_op *op = p->op;
        struct epdd_group *g = op->group;
        struct epdd_exec *ex = p->ex;
        const struct epdd_group_cfg *cfg = &g->cfg;
        const struct epd_op_request *m0 = &op->subs[0].req;
        uint32_t R = cfg->world_size;
        struct epdd_handle *h;
        int rc;

        for (uint32_t r = 1; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                if (m->handle_id != m0->handle_id)
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "handle %llu differs from rank 0's %llu",
                                         (unsigned long long)m->handle_id,
                                         (unsigned long long)m0->handle_id);
                if (((m->flags ^ m0->flags) & EPD_OPREC_APPLY_WEIGHTS))
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "apply_weights differs from rank 0's");
                if (epd__tensor_present(&m->t[EPD_OPREC_COMBINE_RECV_WEIGHTS]) !=
                    epd__tensor_present(&m0->t[EPD_OPREC_COMBINE_RECV_WEIGHTS]))
                        return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                         "recv_weights %s but %s on rank 0",
                                         epd__tensor_present(&m->t[EPD_OPREC_COMBINE_RECV_WEIGHTS])
                                                 ? "present" : "absent",
                                         epd__tensor_present(&m->t[EPD_OPREC_COMBINE_RECV_WEIGHTS])
                                                 ? "absent" : "present");
        }
        h = epd_group_handle_find(g, m0->handle_id);
        if (!h)
                return prep_fail(p, EPD_NOT_FOUND, 0, "handle %llu does not exist",
                                 (unsigned long long)m0->handle_id);
        for (uint32_t r = 0; r < R; r++)
                if (h->ranks[r].released)
                        return prep_fail(p, EPD_NOT_FOUND, r, "handle %llu was released by rank %u",
                                         (unsigned long long)h->id, r);
        ex->handle_state = h->state;
        ex->layout = h->layout;
        ex->num_topk = h->num_topk;
        ex->topk_dtype = h->topk_dtype;
        ex->has_weights = h->has_weights;
        ex->apply_weights = ((m0->flags & EPD_OPREC_APPLY_WEIGHTS) != 0);
        if (ex->apply_weights && ex->layout != EPD_LAYOUT_EXPAND)
                return prep_fail(p, EPD_INVALID_ARGUMENT, 0,
                                 "apply_weights needs an EXPAND dispatch");
        rc = prep_combine_weights(p, h);
        if (rc < 0)
                return rc;
        for (uint32_t r = 0; r < R; r++) {
                const struct epd_op_request *m = &op->subs[r].req;
                struct epdd_exec_rank *er = &ex->ranks[r];
                uint32_t n = h->ranks[r].num_tokens;

                er->num_tokens = n;
                er->device = g->ranks[r].device;
                er->y_rows = (uint64_t)h->ranks[r].rows;
                if (h->ranks[r].rows > 0 || epd__tensor_present(&m->t[EPD_OPREC_Y])) {
                        rc = prep_tensor(p, r, "y", &m->t[EPD_OPREC_Y], EPD_DTYPE_BF16, (uint64_t)h->ranks[r].rows,
                                         cfg->hidden, 0, &er->y, NULL);
                        if (rc < 0)
                                return rc;
                }
                /* (The record's decoder allows at most 2 biases.) A listed bias may be absent
                 * on a rank without tokens. */
                for (uint32_t b = 0; b < m->num_bias; b++) {
                        const struct epd_tensor *bias = &m->t[EPD_OPREC_BIAS0 + b];
                        if (!epd__tensor_present(bias) && n == 0)
                                continue;
                        rc = prep_tensor(p, r, b ? "bias[1]" : "bias[0]", bias,
                                         EPD_DTYPE_BF16, n, cfg->hidden, 1, &er->comb.bias[b],
                                         NULL);
                        if (rc < 0)
                                return rc;
                }
                if (n > 0 || epd__tensor_present(&m->t[EPD_OPREC_COMBINED])) {
                        rc = prep_tensor(p, r, "combined", &m->t[EPD_OPREC_COMBINED], EPD_DTYPE_BF16, n,
                                         cfg->hidden, 0, &er->comb.combined, NULL);
                        if (rc < 0)
                                return rc;
                }
                if (epd__tensor_present(&m->t[EPD_OPREC_COMBINED_TOPK_WEIGHTS])) {
                        if (!h->has_weights && !ex->recv_weights)
                                return prep_fail(p, EPD_INVALID_ARGUMENT, r,
                                                 "combined_topk_weights needs a dispatch that "
                                                 "carried weights, or recv_weights");
                        rc = prep_tensor(p, r, "combined_topk_weights", &m->t[EPD_OPREC_COMBINED_TOPK_WEIGHTS],
                                         EPD_DTYPE_FP32, n, ex->num_topk, 0,
                                         &er->comb.combined_topk_weights, NULL);
                        if (rc < 0)
                                return rc;
                }
        }
        h->busy = 1;
        op->handle = h;
        return 0;
}

int epd_op_prepare(struct epdd_op *op, struct epdd_exec *ex, struct epdd_region ***refs,
                   unsigned *num_refs, char *err, size_t err_len)
{
        struct prep p = { .op = op, .ex = ex };
        int rc = op->kind == EPD_OP_DISPATCH ? prep_dispatch(&p) : prep_combine(&p);

        if (rc < 0) {
                for (unsigned i = 0; i < p.num_refs; i++)
                        epd_region_unref(op->group->daemon, p.refs[i]);
                free(p.refs);
                snprintf(err, err_len, "%s", p.err);
                return p.status;
        }
        *refs = p.refs;
        *num_refs = p.num_refs;
        return 0;
}
