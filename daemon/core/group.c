/* group.c - EP groups (docs/semantics.md section 1): configuration checks, rank binding, the
 * FORMING -> READY <-> BROKEN lifecycle, output arenas and handles. Loop thread only. */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "budget.h"
#include "memfd.h"
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "backend.h"
#include "core.h"
#include "cx.h"
#include "log.h"
#include "routing.h"
#include "util.h"

const char *epd_group_state_name(enum epdd_group_state s)
{
        switch (s) {
        case EPD_GROUP_FORMING: return "FORMING";
        case EPD_GROUP_READY: return "READY";
        case EPD_GROUP_DRAINING: return "DRAINING";
        case EPD_GROUP_BROKEN: return "BROKEN";
        case EPD_GROUP_CLOSED: return "CLOSED";
        }
        return "UNKNOWN";
}

struct epdd_group *epd_group_find(struct epdd_daemon *d, uint64_t id)
{
        struct epd_list *pos;

        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                if (g->id == id && g->state != EPD_GROUP_CLOSED)
                        return g;
        }
        return NULL;
}

struct epdd_group *epd_group_find_name(struct epdd_daemon *d, const char *name)
{
        struct epd_list *pos;

        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                if (strcmp(g->name, name) == 0 && g->state != EPD_GROUP_CLOSED)
                        return g;
        }
        return NULL;
}

/* The client-executed part of a configuration: the buffers' shape (w as the client gave it,
 * cfg the checked daemon-mode part). A client-executed group has no output arena. */
static int cx_cfg_check(const struct epdd_daemon *d, const struct epdd_group_cfg *w,
                        struct epdd_group_cfg *cfg, char *err, size_t err_len)
{
        struct cx_shape shape;
        struct cx_layout l;
        enum cx_shape_error e;

        if (w->execution == EPD_EXECUTION_DAEMON) {
                if (w->max_alignment || w->block_rows || w->quantize || w->num_handles ||
                    w->sms_per_rank || w->recv_rows) {
                        snprintf(err, err_len,
                                 "max_expert_alignment, expert_block_rows, quantize, "
                                 "num_handle_slots, sms_per_rank and recv_rows apply to "
                                 "client-executed groups only (execution = client)");
                        return EPD_INVALID_ARGUMENT;
                }
                return 0;
        }
        if (w->execution != EPD_EXECUTION_CLIENT) {
                snprintf(err, err_len, "execution %d is neither daemon (0) nor client (1)",
                         (int)w->execution);
                return EPD_INVALID_ARGUMENT;
        }
        if (!d->backend->ops->cx_alloc) {
                snprintf(err, err_len,
                         "client-executed groups are not available on the %s backend yet",
                         d->backend->ops->name);
                return EPD_UNAVAILABLE;
        }
        shape = (struct cx_shape){
                .world_size = cfg->world_size, .num_experts = cfg->num_experts,
                .hidden = cfg->hidden, .max_tokens = cfg->max_tokens, .max_topk = cfg->max_topk,
                .dtype = cfg->dtype, .scale_block = cfg->scale_block,
                .quantize = w->quantize ? 1u : 0u, .max_alignment = w->max_alignment,
                .expert_block_rows = w->block_rows, .num_handles = w->num_handles,
                .recv_rows = w->recv_rows,
        };
        e = cx_layout_compute(&shape, &l);
        if (e == CX_SHAPE_RECV_ROWS) {
                uint64_t least = (uint64_t)cfg->num_experts / cfg->world_size * w->block_rows;

                snprintf(err, err_len,
                         "client-executed group: recv_rows %u is outside %llu .. %u (at least "
                         "num_local_experts * expert_block_rows, at most the most rows one op "
                         "of the shape can send a rank)", w->recv_rows,
                         (unsigned long long)(least ? least : 1), l.worst_rows);
                return EPD_INVALID_ARGUMENT;
        }
        if (e != CX_SHAPE_OK) {
                snprintf(err, err_len, "client-executed group: %s", cx_shape_error_str(e));
                return EPD_INVALID_ARGUMENT;
        }
        /* The buffers hold the outputs, as an output arena does: the same bound per rank. */
        if (l.total_bytes > d->cfg.max_arena_bytes) {
                snprintf(err, err_len,
                         "client-executed group: %llu bytes of buffer per rank exceed the "
                         "daemon's max_arena_bytes %llu (lower recv_rows, max_tokens_per_rank or "
                         "hidden)",
                         (unsigned long long)l.total_bytes,
                         (unsigned long long)d->cfg.max_arena_bytes);
                return EPD_INVALID_ARGUMENT;
        }
        if (w->sms_per_rank > CX_MAX_BLOCKS) {
                snprintf(err, err_len, "sms_per_rank %u exceeds %u", w->sms_per_rank,
                         CX_MAX_BLOCKS);
                return EPD_INVALID_ARGUMENT;
        }
        cfg->execution = EPD_EXECUTION_CLIENT;
        cfg->max_alignment = l.shape.max_alignment;
        cfg->block_rows = l.shape.expert_block_rows;
        cfg->quantize = l.shape.quantize;
        cfg->num_handles = l.shape.num_handles;
        cfg->sms_per_rank = w->sms_per_rank;
        cfg->recv_rows = l.recv_rows;
        cfg->cx_bytes = l.total_bytes;
        cfg->arena_bytes = 0; /* outputs land in the buffers: no daemon-mode ops */
        return 0;
}

int epd_group_cfg_check(const struct epdd_daemon *d, struct epdd_group_cfg *cfg, char *err,
                        size_t err_len)
{
        const struct epdd_group_cfg w = *cfg; /* as the client gave it */

        if (w.world_size < 1 || w.world_size > EPD_MAX_WORLD_SIZE) {
                snprintf(err, err_len, "world_size %u outside 1..%u", w.world_size,
                         EPD_MAX_WORLD_SIZE);
                return EPD_INVALID_ARGUMENT;
        }
        if (w.num_experts < 1 || w.num_experts > EPD_MAX_EXPERTS ||
            w.num_experts % w.world_size) {
                snprintf(err, err_len,
                         "num_experts %u must be in 1..%u and a multiple of world_size %u",
                         w.num_experts, EPD_MAX_EXPERTS, w.world_size);
                return EPD_INVALID_ARGUMENT;
        }
        if (w.num_experts / w.world_size > EPD_MAX_LOCAL_EXPERTS) {
                snprintf(err, err_len, "num_experts/world_size = %u exceeds %u local experts",
                         w.num_experts / w.world_size, EPD_MAX_LOCAL_EXPERTS);
                return EPD_INVALID_ARGUMENT;
        }
        if (w.max_topk < 1 || w.max_topk > EPD_MAX_TOPK) {
                snprintf(err, err_len, "max_topk %u outside 1..%u", w.max_topk, EPD_MAX_TOPK);
                return EPD_INVALID_ARGUMENT;
        }
        if (w.hidden < 1 || w.hidden > (1u << 20)) {
                snprintf(err, err_len, "hidden %u outside 1..%u", w.hidden, 1u << 20);
                return EPD_INVALID_ARGUMENT;
        }
        if (w.max_tokens < 1 || w.max_tokens > (1u << 24)) {
                snprintf(err, err_len, "max_tokens_per_rank %u outside 1..%u", w.max_tokens,
                         1u << 24);
                return EPD_INVALID_ARGUMENT;
        }
        /* Row indices and counts are 32-bit (docs/semantics.md §5): the worst case of
         * rows a rank can receive must fit. */
        if (epd_route_max_rows_expand(w.world_size, w.max_tokens, w.max_topk,
                                      w.num_experts / w.world_size, 1) > UINT32_MAX) {
                snprintf(err, err_len,
                         "world_size %u x max_tokens_per_rank %u x max_topk %u rows exceed 2^32",
                         w.world_size, w.max_tokens, w.max_topk);
                return EPD_INVALID_ARGUMENT;
        }
        if (w.op_timeout_ms > d->cfg.max_op_timeout_ms) {
                snprintf(err, err_len, "op_timeout_ms %u exceeds the daemon's max_op_timeout_ms %u",
                         w.op_timeout_ms, d->cfg.max_op_timeout_ms);
                return EPD_INVALID_ARGUMENT;
        }
        memset(cfg, 0, sizeof(*cfg));
        cfg->world_size = w.world_size;
        cfg->num_experts = w.num_experts;
        cfg->num_local_experts = w.num_experts / w.world_size;
        cfg->hidden = w.hidden;
        cfg->max_tokens = w.max_tokens;
        cfg->max_topk = w.max_topk;
        cfg->dtype = w.dtype;
        if (cfg->dtype == EPD_DTYPE_BF16) {
                cfg->row_bytes = (uint64_t)w.hidden * 2;
        } else if (cfg->dtype == EPD_DTYPE_FP8_E4M3) {
                cfg->scale_block = w.scale_block ? w.scale_block : EPD_DEFAULT_SCALE_BLOCK;
                if (w.hidden % cfg->scale_block) {
                        snprintf(err, err_len, "hidden %u is not a multiple of scale_block %u",
                                 w.hidden, cfg->scale_block);
                        return EPD_INVALID_ARGUMENT;
                }
                cfg->row_bytes = w.hidden;
                cfg->scale_cols = w.hidden / cfg->scale_block;
        } else {
                snprintf(err, err_len, "dispatch_dtype must be BF16 or FP8_E4M3");
                return EPD_INVALID_ARGUMENT;
        }
        if (cfg->row_bytes % 16) {
                snprintf(err, err_len, "dispatch row bytes %llu must be a multiple of 16",
                         (unsigned long long)cfg->row_bytes);
                return EPD_INVALID_ARGUMENT;
        }
        cfg->op_timeout_ms = w.op_timeout_ms ? w.op_timeout_ms : d->cfg.op_timeout_ms;
        cfg->arena_bytes = w.arena_bytes ? w.arena_bytes : d->cfg.arena_bytes;
        if (cfg->arena_bytes > (1ull << 40)) {
                snprintf(err, err_len, "arena_bytes %llu exceeds 1 TiB",
                         (unsigned long long)cfg->arena_bytes);
                return EPD_INVALID_ARGUMENT;
        }
        return cx_cfg_check(d, &w, cfg, err, err_len);
}

struct epdd_group *epd_group_find_name_of(struct epdd_daemon *d, uid_t owner, const char *name)
{
        struct epd_list *pos;

        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                if (g->owner_uid == owner && strcmp(g->name, name) == 0 &&
                    g->state != EPD_GROUP_CLOSED)
                        return g;
        }
        return NULL;
}

struct epdd_group *epd_group_find_for_join(struct epdd_daemon *d, uid_t uid, const char *name,
                                          const void *secret, size_t secret_len, int *named)
{
        struct epdd_group *g = epd_group_find_name_of(d, uid, name), *match = NULL;
        struct epd_list *pos;

        *named = g != NULL;
        if (g)
                return epd__consttime_equal(g->secret, g->secret_len, secret, secret_len) ? g
                                                                                      : NULL;
        /* Another uid's group: the secret tells which, when several uids use the name. Every
         * candidate is compared, so the time does not tell how many there are before it. */
        epd_list_for_each(pos, &d->groups)
        {
                struct epdd_group *o = epd_list_entry(pos, struct epdd_group, link);
                if (strcmp(o->name, name) != 0 || o->state == EPD_GROUP_CLOSED)
                        continue;
                *named = 1;
                if (epd__consttime_equal(o->secret, o->secret_len, secret, secret_len) && !match)
                        match = o;
        }
        return match;
}

/* ---- client-executed groups' buffers ----
 *
 * The daemon touches only header words of the buffers: the epoch, abort and drain words it owns,
 * the op counters (to place a drain) and the statistics. Host memory is reached through the loop
 * thread's mapping with atomics (the clients' executors use them on the same words); device
 * memory through the backend's cx_copy. */

static void cx_destroy(struct epdd_group *g);

/* Offset of a header field of rank r's buffer in the group's allocation. */
#define CX_FIELD(cx, r, field) \
        ((uint64_t)(r) * (cx)->stride + (cx)->layout.header + offsetof(struct cx_header, field))

static uint64_t cx_load64(const struct epdd_group *g, uint64_t off)
{
        struct epdd_backend *b = g->daemon->backend;
        uint64_t v = 0;

        if (g->cx->host)
                return __atomic_load_n((uint64_t *)(g->cx->host + off), __ATOMIC_SEQ_CST);
        if (b->ops->cx_copy(b, g->cx->state, off, &v, sizeof(v), 0) < 0)
                log_warning("group=%s: cannot read a buffer word", g->name);
        return v;
}

static void cx_store(const struct epdd_group *g, uint64_t off, uint64_t v, unsigned bytes)
{
        struct epdd_backend *b = g->daemon->backend;
        uint32_t v32 = (uint32_t)v;

        if (g->cx->host) {
                if (bytes == 4)
                        __atomic_store_n((uint32_t *)(g->cx->host + off), v32, __ATOMIC_SEQ_CST);
                else
                        __atomic_store_n((uint64_t *)(g->cx->host + off), v, __ATOMIC_SEQ_CST);
                return;
        }
        if (b->ops->cx_copy(b, g->cx->state, off, bytes == 4 ? (void *)&v32 : (void *)&v, bytes,
                            1) < 0)
                log_warning("group=%s: cannot write a buffer word", g->name);
}

/* Initialises (init) or re-forms rank r's buffer: in place in host memory; for device memory on
 * a copy of its metadata (zeroed for init: device memory starts undefined) written back. */
static int cx_rank_meta(struct epdd_group *g, uint32_t r, int init)
{
        struct epdd_backend *b = g->daemon->backend;
        struct epdd_cx *cx = g->cx;
        uint64_t base = (uint64_t)r * cx->stride;
        uint8_t *m;
        int rc = 0;

        if (cx->host) {
                if (init)
                        cx_buffer_init(cx->host + base, &cx->layout, r, cx->epoch);
                else
                        cx_buffer_reform(cx->host + base, &cx->layout, cx->epoch);
                return 0;
        }
        m = calloc(1, cx->layout.metadata_bytes);
        if (!m)
                return EPD_INTERNAL;
        if (!init)
                rc = b->ops->cx_copy(b, cx->state, base, m, cx->layout.metadata_bytes, 0);
        if (rc == 0) {
                if (init)
                        cx_buffer_init(m, &cx->layout, r, cx->epoch);
                else
                        cx_buffer_reform(m, &cx->layout, cx->epoch);
                rc = b->ops->cx_copy(b, cx->state, base, m, cx->layout.metadata_bytes, 1);
        }
        free(m);
        return rc;
}

/* The group's buffers, at the first bind, on the binding rank's device. */
static int cx_create(struct epdd_group *g, uint32_t device, char *err, size_t err_len)
{
        struct epdd_backend *b = g->daemon->backend;
        const struct epdd_group_cfg *cfg = &g->cfg;
        struct cx_shape shape = {
                .world_size = cfg->world_size, .num_experts = cfg->num_experts,
                .hidden = cfg->hidden, .max_tokens = cfg->max_tokens, .max_topk = cfg->max_topk,
                .dtype = cfg->dtype, .scale_block = cfg->scale_block, .quantize = cfg->quantize,
                .max_alignment = cfg->max_alignment, .expert_block_rows = cfg->block_rows,
                .num_handles = cfg->num_handles, .recv_rows = cfg->recv_rows,
        };
        uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
        struct epdd_cx *cx = calloc(1, sizeof(*cx));
        int rc;

        if (!cx) {
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        if (cx_layout_compute(&shape, &cx->layout) != CX_SHAPE_OK) {
                free(cx);
                snprintf(err, err_len, "client-executed group: shape refused");
                return EPD_INVALID_ARGUMENT;
        }
        /* One allocation for all R buffers, so one fd exports them all whatever R is; each
         * buffer starts on a page so a rank's words never share a page with another's. */
        cx->stride = (cx->layout.total_bytes + page - 1) / page * page;
        cx->bytes = cx->stride * cfg->world_size;
        rc = epd_budget_group_bytes(g->daemon, g->owner_uid, cx->bytes, err, err_len);
        if (rc < 0) {
                free(cx);
                return rc;
        }
        cx->fd = -1;
        cx->device = device;
        rc = b->ops->cx_alloc(b, device, cx->bytes, &cx->host, &cx->state, &cx->fd, &cx->kind,
                              err, err_len);
        if (rc < 0) {
                free(cx);
                return rc;
        }
        g->cx = cx;
        cx->epoch = 1;
        for (uint32_t r = 0; r < cfg->world_size && rc == 0; r++)
                rc = cx_rank_meta(g, r, 1);
        if (rc < 0) {
                snprintf(err, err_len, "cannot initialise the group's buffers");
                cx_destroy(g);
        }
        return rc;
}

/* Closes every registration's fd (at re-forming and destruction). */
static void cx_mem_forget(struct epdd_cx *cx, uint32_t world_size)
{
        for (uint32_t r = 0; r < world_size; r++) {
                for (uint32_t i = 0; i < cx->num_mem[r]; i++)
                        close(cx->mem[r][i].fd);
                cx->num_mem[r] = 0;
        }
}

static void cx_destroy(struct epdd_group *g)
{
        struct epdd_backend *b = g->daemon->backend;
        struct epdd_cx *cx = g->cx;

        if (!cx)
                return;
        cx_mem_forget(cx, g->cfg.world_size);
        b->ops->cx_free(b, cx->host, cx->bytes, cx->state);
        if (cx->fd >= 0)
                close(cx->fd);
        free(cx);
        g->cx = NULL;
}

/* What a bind of a client-executed group needs on a backend of device memory: every rank on
 * the buffers' GPU (one GPU per group for now), MPS for ranks of several processes on it, and
 * SM budgets that fit it together. Fills the group's sms_per_rank at the first bind. */
static int cx_bind_check(struct epdd_group *g, struct epdd_client *c, uint32_t rank,
                         uint32_t device, int mps, char *err, size_t err_len)
{
        const struct epdd_backend *b = g->daemon->backend;
        const uint32_t R = g->cfg.world_size;
        uint32_t sms = b->devices[device].sm_count, want;

        if (!b->ops->cx_copy)
                return 0; /* host memory: any device, no SMs */
        if (g->cx && device != g->cx->device) {
                snprintf(err, err_len,
                         "rank %u of client-executed group '%s' asks for device %u, but the "
                         "group's buffers are on device %u: a client-executed group keeps "
                         "every rank on one GPU for now",
                         rank, g->name, device, g->cx->device);
                return EPD_UNAVAILABLE;
        }
        (void)c;
        if (R > 1 && !mps) {
                snprintf(err, err_len,
                         "client-executed group '%s' puts its %u ranks on GPU %u, and ranks of "
                         "different processes run at once on one GPU only under CUDA MPS, which "
                         "is not enabled for this client (start nvidia-cuda-mps-control -d "
                         "before the workers, or create groups of one rank)",
                         g->name, R, device);
                return EPD_UNAVAILABLE;
        }
        if (g->cx)
                return 0;
        /* By default the group's kernels take at most half the GPU's SMs: a rank's kernel
         * holds its SMs while it waits for its peers, and a peer's own work queued before its
         * launch (a GEMM that needs whole SMs) must still find SMs to run on, or the peer never
         * launches and the op times out. */
        want = g->cfg.sms_per_rank ? g->cfg.sms_per_rank : (sms / (2 * R) ? sms / (2 * R) : 1);
        if (want > CX_MAX_BLOCKS)
                want = CX_MAX_BLOCKS;
        if (sms && (uint64_t)want * R > sms) {
                snprintf(err, err_len,
                         "sms_per_rank %u x %u ranks exceeds the %u SMs of GPU %u: every rank's "
                         "kernel must be resident at once",
                         want, R, sms, device);
                return EPD_INVALID_ARGUMENT;
        }
        g->cfg.sms_per_rank = want;
        return 0;
}

/* A member died or left: every op of every rank that waits, or starts later, ends PEER_LOST. */
static void cx_abort(struct epdd_group *g)
{
        if (!g->cx || g->cx->aborted)
                return;
        for (uint32_t r = 0; r < g->cfg.world_size; r++)
                cx_store(g, CX_FIELD(g->cx, r, abort_word), 1, 4);
        g->cx->aborted = 1;
}

/* Every rank is bound again after a loss: a new epoch, op numbers from 0. The ops of the old
 * epoch ended when the abort word was written (they poll it), before any rank was re-bound. */
static void cx_reform(struct epdd_group *g)
{
        struct epdd_cx *cx = g->cx;

        if (!cx || !cx->aborted)
                return;
        cx->epoch++;
        /* The lost rank's memory went with its client; every rank registers again. */
        cx_mem_forget(cx, g->cfg.world_size);
        for (uint32_t r = 0; r < g->cfg.world_size; r++)
                if (cx_rank_meta(g, r, 0) < 0)
                        log_warning("group=%s: cannot re-form rank %u's buffer", g->name, r);
        cx->aborted = 0;
        cx->drained = 0;
        log_info("group re-formed group=%s epoch=%llu", g->name, (unsigned long long)cx->epoch);
}

void epd_group_cx_drain(struct epdd_group *g, int on)
{
        struct epdd_cx *cx = g->cx;
        uint64_t boundary = 0, seen;

        if (!cx)
                return;
        if (!on) {
                for (uint32_t r = 0; r < g->cfg.world_size; r++)
                        cx_store(g, CX_FIELD(cx, r, drain_op), 0, 8);
                cx->drained = 0;
                return;
        }
        /* The boundary is the highest op number any rank has taken: ranks behind it still run
         * up to it (their peers ahead wait for them), and nobody starts an op at or past it. A
         * rank may take a number between our read and our store (it read the drain word before
         * our store and publishes its counter a moment later); reading again a millisecond
         * after the store finds it and moves the boundary past it. A drain is rare and the
         * loop thread can spare the pause. */
        do {
                seen = boundary;
                for (uint32_t r = 0; r < g->cfg.world_size; r++) {
                        uint64_t n = cx_load64(g, CX_FIELD(cx, r, op_counter));
                        if (n > boundary)
                                boundary = n;
                }
                for (uint32_t r = 0; r < g->cfg.world_size; r++)
                        cx_store(g, CX_FIELD(cx, r, drain_op), boundary + 1, 8);
                usleep(1000);
                for (uint32_t r = 0; r < g->cfg.world_size; r++) {
                        uint64_t n = cx_load64(g, CX_FIELD(cx, r, op_counter));
                        if (n > boundary)
                                boundary = n;
                }
        } while (boundary != seen);
        cx->drained = 1;
}

void epd_group_cx_stats(const struct epdd_group *g, uint32_t rank, struct cx_stats *out)
{
        memset(out, 0, sizeof(*out));
        if (!g->cx)
                return;
        out->ops = cx_load64(g, CX_FIELD(g->cx, rank, stats.ops));
        out->rows = cx_load64(g, CX_FIELD(g->cx, rank, stats.rows));
        out->bytes = cx_load64(g, CX_FIELD(g->cx, rank, stats.bytes));
        out->failures = cx_load64(g, CX_FIELD(g->cx, rank, stats.failures));
        for (int k = 0; k < 2; k++) {
                out->kind_ops[k] = cx_load64(g, CX_FIELD(g->cx, rank, stats.kind_ops[k]));
                for (int p = 0; p < CX_PHASES; p++)
                        out->phase_ns[k][p] =
                                cx_load64(g, CX_FIELD(g->cx, rank, stats.phase_ns[k][p]));
        }
}

int epd_group_new(struct epdd_daemon *d, uid_t owner, const char *name, const void *secret,
                  size_t secret_len, const struct epdd_group_cfg *cfg, struct epdd_group **out,
                  char *err, size_t err_len)
{
        struct epdd_group *g;

        if (!name[0] || strlen(name) >= sizeof(g->name)) {
                snprintf(err, err_len, "group name must be 1..%zu bytes", sizeof(g->name) - 1);
                return EPD_INVALID_ARGUMENT;
        }
        if (secret_len > sizeof(g->secret)) {
                snprintf(err, err_len, "group secret longer than %zu bytes", sizeof(g->secret));
                return EPD_INVALID_ARGUMENT;
        }
        /* Names are per uid: another user cannot take a name first and make the owner's
         * create fail. */
        if (epd_group_find_name_of(d, owner, name)) {
                snprintf(err, err_len, "group '%s' already exists", name);
                return EPD_ALREADY_EXISTS;
        }
        if (d->num_groups >= d->cfg.max_groups) {
                snprintf(err, err_len, "the daemon has %u groups, the limit max_groups",
                         d->num_groups);
                return EPD_UNAVAILABLE;
        }
        g = calloc(1, sizeof(*g));
        if (!g || !(g->ranks = calloc(cfg->world_size, sizeof(*g->ranks)))) {
                free(g);
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        g->daemon = d;
        g->owner_uid = owner;
        g->id = ++d->next_group_id;
        snprintf(g->name, sizeof(g->name), "%s", name);
        memcpy(g->secret, secret, secret_len);
        g->secret_len = secret_len;
        g->cfg = *cfg;
        g->state = EPD_GROUP_FORMING;
        g->next_handle_id = 1;
        epd_list_init(&g->ops);
        epd_list_init(&g->handles);
        epd_list_init(&g->retired);
        for (uint32_t r = 0; r < cfg->world_size; r++)
                g->ranks[r].doorbell_fd = -1;
        epd_list_add_tail(&d->groups, &g->link);
        d->num_groups++;
        log_info("group created group=%s id=%llu ranks=%u experts=%u hidden=%u tokens=%u topk=%u",
                 g->name, (unsigned long long)g->id, cfg->world_size, cfg->num_experts,
                 cfg->hidden, cfg->max_tokens, cfg->max_topk);
        *out = g;
        return 0;
}

static int rank_arena_create(struct epdd_group *g, struct epdd_rank *r, int host_memory, char *err,
                             size_t err_len)
{
        const struct epdd_config *cfg = &g->daemon->cfg;

        int rc;

        if (r->arena || g->cfg.arena_bytes == 0)
                return 0;
        rc = epd_budget_group_bytes(g->daemon, g->owner_uid,
                                    epd_arena_mapped_bytes(g->cfg.arena_bytes), err, err_len);
        if (rc < 0)
                return rc;
        return epd_arena_create(g->daemon->backend, r->device, host_memory, g->cfg.arena_bytes,
                                cfg->max_arena_bytes, cfg->max_arena_segments, &r->arena, err,
                                err_len);
}

/* What a past binding leaves behind while the group's executing op may still use it: its
 * doorbell page (the op's waits and completion stores), or its arena (the op places outputs
 * in it, and the op's handle releases them there). */
struct epdd_retired {
        struct epd_list link;
        struct epd_doorbell *page;    /* with fd; or NULL */
        int fd;
        struct epdd_arena *arena;      /* or NULL */
};

/* Frees the rank's arena now, or once the executing op completes. No other handle has outputs
 * in it by then: a rank is bound again either before its group ran any op (no handle exists) or
 * after the group broke, which freed every handle but the executing op's, and that op's
 * completion frees its handle before the retired list. */
static int rank_arena_destroy(struct epdd_group *g, struct epdd_rank *r)
{
        if (g->executing && r->arena) {
                struct epdd_retired *rt = calloc(1, sizeof(*rt));
                if (!rt)
                        return EPD_INTERNAL;
                rt->arena = r->arena;
                rt->fd = -1;
                g->retired_arena_bytes += r->arena->mapped;
                epd_list_add_tail(&g->retired, &rt->link);
        } else {
                epd_arena_free(r->arena);
        }
        r->arena = NULL;
        return 0;
}

static void doorbell_free(struct epdd_group *g, struct epd_doorbell *page, int fd)
{
        struct epdd_backend *b = g->daemon->backend;

        if (!page)
                return;
        b->ops->host_unregister(b, page);
        munmap(page, EPD_DOORBELL_BYTES);
        if (fd >= 0)
                close(fd);
}

void epd_group_free_retired(struct epdd_group *g)
{
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &g->retired)
        {
                struct epdd_retired *rt = epd_list_entry(pos, struct epdd_retired, link);
                epd_list_del(&rt->link);
                doorbell_free(g, rt->page, rt->fd);
                if (rt->arena)
                        g->retired_arena_bytes -= rt->arena->mapped;
                epd_arena_free(rt->arena);
                free(rt);
        }
}

/* Retires a binding's doorbell page: freed now, or once the executing op (which may still
 * have stream operations queued on it) completes. */
static void rank_doorbell_retire(struct epdd_group *g, struct epdd_rank *r)
{
        struct epdd_retired *rt;

        if (!r->doorbell)
                return;
        /* Release the daemon's own streams that may wait for this client's inputs. */
        __atomic_store_n(&r->doorbell->inputs_ready, EPD_DOORBELL_RELEASED, __ATOMIC_RELEASE);
        /* The record was allocated with the page, so retiring cannot fail: with no record, the
         * page would have to be freed under the executing op. */
        rt = r->doorbell_retired;
        if (g->executing) {
                rt->page = r->doorbell;
                rt->fd = r->doorbell_fd;
                epd_list_add_tail(&g->retired, &rt->link);
        } else {
                doorbell_free(g, r->doorbell, r->doorbell_fd);
                free(rt);
        }
        r->doorbell_retired = NULL;
        r->doorbell = NULL;
        r->doorbell_dev = NULL;
        r->doorbell_fd = -1;
        r->mailbox_id = 0;
}

static int rank_doorbell_create(struct epdd_group *g, struct epdd_rank *r, char *err,
                                size_t err_len)
{
        struct epdd_backend *b = g->daemon->backend;
        struct epdd_retired *rt = calloc(1, sizeof(*rt)); /* for rank_doorbell_retire */
        uint8_t *page;
        int fd, rc;

        if (!rt) {
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        rc = epd__memfd_arena(EPD_DOORBELL_BYTES, &page, &fd, err, err_len);
        if (rc < 0) {
                free(rt);
                return rc;
        }
        memset(page, 0, EPD_DOORBELL_BYTES);
        rc = b->ops->host_register(b, page, EPD_DOORBELL_BYTES, &r->doorbell_dev);
        if (rc < 0) {
                munmap(page, EPD_DOORBELL_BYTES);
                close(fd);
                free(rt);
                snprintf(err, err_len, "cannot register the doorbell page with the backend");
                return rc;
        }
        r->doorbell_retired = rt;
        r->doorbell = (struct epd_doorbell *)page;
        r->doorbell_fd = fd;
        r->mailbox_id = 0;
        r->completed = 0;
        r->submitted = 0;
        r->num_refused = 0;
        return 0;
}

/* Advances `completed` over refused submissions that are next in line, then publishes it.
 * Release: a client that sees the count also sees the op's outputs (the backend's work is
 * complete before the loop thread learns of it). */
static void rank_publish(struct epdd_rank *r)
{
        unsigned i = 0;

        while (i < r->num_refused && r->refused[i] == r->completed + 1) {
                r->completed++;
                i++;
        }
        if (i) {
                memmove(r->refused, r->refused + i, (r->num_refused - i) * sizeof(*r->refused));
                r->num_refused -= i;
        }
        /* Never lower: the CUDA executor may have stored an executing op's count already. */
        if (r->doorbell)
                epd_doorbell_advance(&r->doorbell->completed, r->completed);
}

uint64_t epd_group_rank_submitted(struct epdd_group *g, uint32_t rank)
{
        return ++g->ranks[rank].submitted;
}

void epd_group_rank_op_finished(struct epdd_group *g, uint32_t rank, uint64_t seq)
{
        struct epdd_rank *r = &g->ranks[rank];

        /* A rank's accepted ops finish in submission order (ops of a group finish in order). */
        if (seq > r->completed)
                r->completed = seq;
        rank_publish(r);
}

void epd_group_rank_refused(struct epdd_group *g, uint32_t rank)
{
        struct epdd_rank *r = &g->ranks[rank];
        uint64_t seq = ++r->submitted;

        /* A submission refused at once still counts in the doorbell, but only after every
         * earlier submission of the rank has finished, so that the count keeps meaning "the
         * first n submissions are done". */
        if (seq == r->completed + 1) {
                r->completed = seq;
        } else {
                if (r->num_refused == r->cap_refused) {
                        unsigned cap = r->cap_refused ? r->cap_refused * 2 : 8;
                        uint64_t *n = realloc(r->refused, cap * sizeof(*n));
                        if (!n)
                                return; /* the doorbell then stops short; the host status is exact */
                        r->refused = n;
                        r->cap_refused = cap;
                }
                r->refused[r->num_refused++] = seq;
        }
        rank_publish(r);
}

int epd_group_bind(struct epdd_group *g, struct epdd_client *c, uint32_t rank, uint32_t device,
                   int mps, char *err, size_t err_len)
{
        struct epdd_daemon *d = g->daemon;
        struct epdd_rank *r;
        struct epdd_binding *b;
        int rc;

        if (rank >= g->cfg.world_size) {
                snprintf(err, err_len, "rank %u outside 0..%u of group '%s'", rank,
                         g->cfg.world_size - 1, g->name);
                return EPD_INVALID_ARGUMENT;
        }
        if (device >= d->backend->num_devices) {
                snprintf(err, err_len, "device %u does not exist (the daemon has %u)", device,
                         d->backend->num_devices);
                return EPD_INVALID_ARGUMENT;
        }
        r = &g->ranks[rank];
        /* docs/architecture.md, "The CUDA backend's data path": ranks of a group reach each other's
         * buffers directly; a group spanning devices without peer access would need the NCCL
         * fallback, which does not exist yet. */
        for (uint32_t o = 0; d->backend->ops->devices_connected && o < g->cfg.world_size; o++) {
                const struct epdd_rank *other = &g->ranks[o];
                if (o == rank || !other->conn)
                        continue;
                if (!d->backend->ops->devices_connected(d->backend, device, other->device)) {
                        snprintf(err, err_len,
                                 "rank %u on device %u cannot join group '%s': device %u (rank %u) has no peer access to it, and the NCCL fallback for such groups does not exist yet",
                                 rank, device, g->name, other->device, o);
                        return EPD_UNAVAILABLE;
                }
        }
        if (r->conn) {
                snprintf(err, err_len, "rank %u of group '%s' is already bound to client %llu",
                         rank, g->name, (unsigned long long)r->conn->id);
                return EPD_ALREADY_EXISTS;
        }
        if (g->cfg.execution == EPD_EXECUTION_CLIENT) {
                rc = cx_bind_check(g, c, rank, device, mps, err, err_len);
                if (rc == 0 && !g->cx)
                        rc = cx_create(g, device, err, err_len);
                if (rc < 0)
                        return rc;
        }
        rc = epd_budget_binding(d, c, err, err_len);
        if (rc != 0)
                return rc;
        /* The arena lives on the rank's device, in memory this client can map. */
        if (r->arena && (r->device != device || r->arena_host != !c->cuda_capable) &&
            rank_arena_destroy(g, r) < 0) {
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        r->device = device;
        r->arena_host = !c->cuda_capable;
        rc = rank_arena_create(g, r, r->arena_host, err, err_len);
        if (rc < 0)
                return rc;
        rc = rank_doorbell_create(g, r, err, err_len);
        if (rc < 0)
                return rc;
        b = calloc(1, sizeof(*b));
        if (!b) {
                rank_doorbell_retire(g, r);
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        b->group = g;
        b->rank = rank;
        epd_list_add_tail(&c->bindings, &b->conn_link);
        c->num_bindings++;
        if (r->arena && epd_region_add_arena(c, r->arena, device, &r->arena_region_id) < 0) {
                c->num_bindings--;
                epd_list_del(&b->conn_link);
                free(b);
                rank_doorbell_retire(g, r);
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        r->conn = c;
        r->binding = b;
        r->next_op = 0;
        if (r->doorbell)
                if (g->daemon->hooks.page_bound)
                        g->daemon->hooks.page_bound(c, r->doorbell);
        g->num_bound++;
        if (g->num_bound == g->cfg.world_size &&
            (g->state == EPD_GROUP_FORMING || g->state == EPD_GROUP_BROKEN)) {
                /* docs/semantics.md §1: a re-formed group restarts at op 0 on every rank. A group
                 * forming for the first time keeps the ops its early ranks already submitted. */
                if (g->state == EPD_GROUP_BROKEN)
                        for (uint32_t i = 0; i < g->cfg.world_size; i++)
                                g->ranks[i].next_op = 0;
                cx_reform(g);
                if (d->draining)
                        epd_group_cx_drain(g, 1);
                log_info("group ready group=%s from=%s", g->name, epd_group_state_name(g->state));
                g->state = EPD_GROUP_READY;
        }
        return 0;
}

static void free_all_handles(struct epdd_group *g)
{
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &g->handles)
        {
                struct epdd_handle *h = epd_list_entry(pos, struct epdd_handle, link);
                if (h->busy) {
                        /* The executing op still uses it; op.c frees it on completion since
                         * the group's epoch moved on. */
                        continue;
                }
                epd_group_handle_free(g, h);
        }
}

void epd_group_unbind(struct epdd_group *g, uint32_t rank, int lost)
{
        struct epdd_rank *r = &g->ranks[rank];
        struct epd_list *pos;

        if (!r->conn)
                return;
        /* No reply goes to this client any more. */
        epd_list_for_each(pos, &g->ops)
        {
                struct epdd_op *op = epd_list_entry(pos, struct epdd_op, link);
                op->subs[rank].conn = NULL;
        }
        if (r->arena_region_id) {
                struct epdd_region *ar = epd_region_find(r->conn, r->arena_region_id);
                if (ar)
                        epd_region_detach(r->conn, ar);
                r->arena_region_id = 0;
        }
        rank_doorbell_retire(g, r);
        r->conn->num_bindings--;
        epd_list_del(&r->binding->conn_link);
        free(r->binding);
        r->binding = NULL;
        r->conn = NULL;
        g->num_bound--;
        if (g->num_bound == 0) {
                g->state = EPD_GROUP_CLOSED;
                epd_op_fail_pending(g, EPD_ABORTED, "group '%s' closed: its last client left",
                                    g->name);
                return;
        }
        /* A group that has run (or collected) ops breaks: its op numbering restarts at 0 on
         * every rank once the rank is bound again. A group still forming without any op stays
         * FORMING. */
        int ran = 0;
        for (uint32_t i = 0; i < g->cfg.world_size; i++)
                ran |= g->ranks[i].next_op > 0;
        /* A client-executed group's ops are invisible here: assume they ran, and end every
         * op of the peers, waiting or not, with PEER_LOST. */
        if (g->cx) {
                ran = 1;
                cx_abort(g);
        }
        if (g->state == EPD_GROUP_READY || g->state == EPD_GROUP_DRAINING ||
            (g->state == EPD_GROUP_FORMING && ran)) {
                log_notice("group broken group=%s rank=%u reason=%s", g->name, rank,
                           lost ? "client lost" : "rank left");
                g->state = EPD_GROUP_BROKEN;
                g->epoch++;
        }
        epd_op_fail_pending(g, EPD_PEER_LOST, "group '%s': rank %u %s", g->name, rank,
                            lost ? "was lost (its client disconnected)" : "left the group");
        if (g->state == EPD_GROUP_BROKEN)
                free_all_handles(g);
}

void epd_group_maybe_free(struct epdd_group *g)
{
        struct epdd_daemon *d = g->daemon;
        struct epd_list *pos, *tmp;

        if (g->num_bound > 0)
                return;
        g->state = EPD_GROUP_CLOSED;
        if (g->executing) {
                g->free_pending = 1;
                return;
        }
        if (g->daemon->hooks.group_closing)
                g->daemon->hooks.group_closing(g);
        epd_list_for_each_safe(pos, tmp, &g->handles)
                epd_group_handle_free(g, epd_list_entry(pos, struct epdd_handle, link));
        epd_op_destroy_all(g);
        for (uint32_t r = 0; r < g->cfg.world_size; r++) {
                (void)rank_arena_destroy(g, &g->ranks[r]); /* nothing executes: frees */
                rank_doorbell_retire(g, &g->ranks[r]);
        }
        epd_group_free_retired(g);
        cx_destroy(g);
        log_info("group destroyed group=%s id=%llu", g->name, (unsigned long long)g->id);
        epd_list_del(&g->link);
        d->num_groups--;
        for (uint32_t r = 0; r < g->cfg.world_size; r++)
                free(g->ranks[r].refused);
        free(g->ranks);
        free(g);
}

int epd_group_cx_memory(struct epdd_group *g, struct epdd_client *c, int reg, uint32_t rank,
                        uint32_t index, uint32_t peer, int *fd, uint64_t offset, uint64_t bytes,
                        uint32_t *out_index, const struct epdd_cx_mem **mem, char *err,
                        size_t err_len)
{
        struct epdd_cx *cx = g->cx;
        const uint32_t R = g->cfg.world_size;
        struct stat st;
        int seals;

        if (!cx) {
                snprintf(err, err_len, "group '%s' is daemon-executed: client memory is "
                         "registered with client-executed groups only", g->name);
                return EPD_INVALID_ARGUMENT;
        }
        if (rank >= R || g->ranks[rank].conn != c) {
                snprintf(err, err_len, "rank %u of group '%s' is not bound to this client", rank,
                         g->name);
                return EPD_PERMISSION_DENIED;
        }
        if (cx->kind != EPD_REGION_HOST_MEMFD) {
                snprintf(err, err_len, "group '%s': client memory is registered with "
                         "client-executed groups of the host backend only", g->name);
                return EPD_UNAVAILABLE;
        }
        if (!reg) {
                if (peer >= R) {
                        snprintf(err, err_len, "rank %u outside the group's %u ranks", peer, R);
                        return EPD_INVALID_ARGUMENT;
                }
                if (index >= cx->num_mem[peer]) {
                        snprintf(err, err_len, "rank %u has not registered memory %u of group "
                                 "'%s' yet", peer, index, g->name);
                        return EPD_NOT_FOUND;
                }
                *out_index = index;
                *mem = &cx->mem[peer][index];
                return 0;
        }
        if (!fd || *fd < 0) {
                snprintf(err, err_len, "the registration carries no memfd");
                return EPD_INVALID_ARGUMENT;
        }
        if (cx->num_mem[rank] == CX_MAX_MEMORY) {
                snprintf(err, err_len, "rank %u registered %u memories with group '%s', the "
                         "most a rank may", rank, CX_MAX_MEMORY, g->name);
                return EPD_CAPACITY_EXCEEDED;
        }
        if (fstat(*fd, &st) < 0 || !S_ISREG(st.st_mode) || bytes == 0 ||
            offset > (uint64_t)st.st_size || bytes > (uint64_t)st.st_size - offset) {
                snprintf(err, err_len, "the registered range (offset %llu, %llu bytes) is not "
                         "inside the memfd", (unsigned long long)offset,
                         (unsigned long long)bytes);
                return EPD_INVALID_ARGUMENT;
        }
        /* The peers map it: a memfd that could shrink would fault them. Regions registered
         * with the daemon carry the seal already. */
        seals = fcntl(*fd, F_GET_SEALS);
        if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
                snprintf(err, err_len, "the registered memfd is not sealed against shrinking "
                         "(register its region with the daemon first)");
                return EPD_INVALID_ARGUMENT;
        }
        cx->mem[rank][cx->num_mem[rank]] = (struct epdd_cx_mem){
                .fd = *fd, .offset = offset, .bytes = bytes, .fd_bytes = (uint64_t)st.st_size };
        *fd = -1;
        *out_index = cx->num_mem[rank]++;
        *mem = &cx->mem[rank][*out_index];
        return 0;
}
