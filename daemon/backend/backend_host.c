/* backend_host.c - the host (CPU) backend: virtual devices, memfd regions mapped by the daemon,
 * and an executor thread that runs each op with a pool of copy threads.
 *
 * Threads: one executor thread takes ops in submission order (ops of one group are already
 * serialised by the core) and runs each op's parallel loops with host_threads - 1 helper
 * threads. The virtual devices share these threads: they share one memory system, so one pool
 * sized to the CPUs reaches the memcpy ceiling without oversubscribing cores.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <systemd/sd-id128.h>
#include <unistd.h>

#include "arena.h"
#include "backend.h"
#include "executor.h"
#include "exec.h"
#include "log.h"
#include "memfd.h"
#include "plan.h"
#include "util.h"

/* ---- a small parallel-for pool ---- */

typedef void (*pool_fn)(void *ctx, uint64_t item);

struct pool {
        unsigned num_helpers;
        pthread_t *threads;
        pthread_mutex_t lock;
        pthread_cond_t work_cond;
        pthread_cond_t done_cond;
        uint64_t generation;
        unsigned helpers_done;
        int stop;
        pool_fn fn;
        void *ctx;
        uint64_t num_items;
        atomic_uint_fast64_t next_item;
        const atomic_int *abort;      /* the running exec's abort_status: stop taking items */
};

static void pool_work(struct pool *p)
{
        for (;;) {
                uint64_t i;
                /* Relaxed: the abort only needs to be seen eventually, and what an aborted op
                 * wrote is undefined (docs/semantics.md §4); one load per item. */
                if (p->abort && atomic_load_explicit(p->abort, memory_order_relaxed))
                        return;
                i = atomic_fetch_add(&p->next_item, 1);
                if (i >= p->num_items)
                        return;
                p->fn(p->ctx, i);
        }
}

static void *pool_helper(void *arg)
{
        struct pool *p = arg;
        uint64_t seen = 0;

        pthread_mutex_lock(&p->lock);
        for (;;) {
                while (!p->stop && p->generation == seen)
                        pthread_cond_wait(&p->work_cond, &p->lock);
                if (p->stop)
                        break;
                seen = p->generation;
                pthread_mutex_unlock(&p->lock);
                pool_work(p);
                pthread_mutex_lock(&p->lock);
                if (++p->helpers_done == p->num_helpers)
                        pthread_cond_signal(&p->done_cond);
        }
        pthread_mutex_unlock(&p->lock);
        return NULL;
}

/* Runs fn(ctx, i) for every i < num_items on the caller and every helper; returns when all are
 * done. Only the executor thread calls it. */
static void pool_run(struct pool *p, pool_fn fn, void *ctx, uint64_t num_items)
{
        if (num_items == 0)
                return;
        if (p->num_helpers == 0 || num_items == 1) {
                for (uint64_t i = 0; i < num_items; i++) {
                        if (p->abort && atomic_load_explicit(p->abort, memory_order_relaxed))
                                return;
                        fn(ctx, i);
                }
                return;
        }
        pthread_mutex_lock(&p->lock);
        p->fn = fn;
        p->ctx = ctx;
        p->num_items = num_items;
        atomic_store(&p->next_item, 0);
        p->helpers_done = 0;
        p->generation++;
        pthread_cond_broadcast(&p->work_cond);
        pthread_mutex_unlock(&p->lock);
        pool_work(p);
        pthread_mutex_lock(&p->lock);
        while (p->helpers_done < p->num_helpers)
                pthread_cond_wait(&p->done_cond, &p->lock);
        pthread_mutex_unlock(&p->lock);
}

/* ---- backend state ---- */

struct host_backend {
        struct epdd_backend *b;
        struct pool pool;
        struct epdd_executor executor;
};

/* A handle's routing state on this backend. */
struct host_handle {
        struct epd_plan *plan;
        float **weights;              /* [R] -> [N_s * K] or NULL */
};

static void host_handle_free(struct host_handle *hh, uint32_t R)
{
        if (!hh)
                return;
        if (hh->weights)
                for (uint32_t r = 0; r < R; r++)
                        free(hh->weights[r]);
        free(hh->weights);
        epd_plan_free(hh->plan);
        free(hh);
}

/* ---- dispatch ---- */

struct count_ctx {
        struct epdd_exec *ex;
        struct epd_plan *plan;
        int *rc;
        char (*err)[256];
};

static void count_item(void *arg, uint64_t s)
{
        struct count_ctx *c = arg;
        struct epdd_exec_rank *er = &c->ex->ranks[s];

        c->rc[s] = epd_plan_count_source(c->plan, (uint32_t)s, er->topk_idx, c->ex->topk_dtype,
                                         er->topk_stride, c->err[s], sizeof(c->err[s]));
}

static void place_item(void *arg, uint64_t s)
{
        epd_plan_place_source(arg, (uint32_t)s);
}

static void dispatch_item(void *arg, uint64_t i)
{
        epd_host_dispatch_item(arg, i);
}

static void combine_item(void *arg, uint64_t i)
{
        epd_host_combine_item(arg, i);
}

/* The op was aborted while its data moved (a rank lost, the daemon stopping): it ends with that
 * status, its outputs undefined. */
static int aborted(struct epdd_exec *ex)
{
        int status = atomic_load_explicit(&ex->abort_status, memory_order_relaxed);

        if (!status)
                return 0;
        ex->status = status;
        snprintf(ex->message, sizeof(ex->message), "%s while the op ran",
                 status == EPD_ABORTED ? "the daemon is shutting down"
                                       : "a rank of the group was lost");
        return 1;
}

static void run_dispatch(struct host_backend *hb, struct epdd_exec *ex)
{
        const struct epdd_group_cfg *cfg = &ex->cfg;
        uint32_t R = cfg->world_size, L = cfg->num_local_experts;
        struct host_handle *hh = ex->handle_state, *fresh = NULL;
        struct epd_plan *plan;
        struct epd_dispatch_src_io *src = NULL;
        struct epd_dispatch_dst_io *dst = NULL;
        size_t msg_len = 0;
        uint64_t bytes = 0;

        if (!hh) {
                uint32_t *num_tokens = calloc(R, sizeof(*num_tokens));
                int *rc = calloc(R, sizeof(*rc));
                char (*err)[256] = calloc(R, sizeof(*err));

                fresh = calloc(1, sizeof(*fresh));
                if (!num_tokens || !rc || !err || !fresh) {
                        free(num_tokens);
                        free(rc);
                        free(err);
                        goto oom;
                }
                for (uint32_t r = 0; r < R; r++)
                        num_tokens[r] = ex->ranks[r].num_tokens;
                fresh->plan = epd_plan_new(R, cfg->num_experts, cfg->max_tokens, ex->num_topk,
                                           ex->expert_alignment, ex->layout, num_tokens);
                free(num_tokens);
                if (!fresh->plan) {
                        free(rc);
                        free(err);
                        goto oom;
                }
                struct count_ctx cc = { ex, fresh->plan, rc, err };
                pool_run(&hb->pool, count_item, &cc, R);
                for (uint32_t r = 0; r < R; r++) {
                        if (rc[r] < 0) {
                                ex->status = rc[r];
                                snprintf(ex->message, sizeof(ex->message),
                                         "invalid topk_idx on rank %u: %s", r, err[r]);
                                break;
                        }
                }
                free(rc);
                free(err);
                if (ex->status < 0)
                        goto fail;
                epd_plan_finish(fresh->plan);
                hh = fresh;
        } else if (hh->plan->expert_alignment != ex->expert_alignment) {
                ex->status = EPD_INVALID_ARGUMENT;
                snprintf(ex->message, sizeof(ex->message),
                         "cached dispatch with expert_alignment %u, the handle has %u",
                         ex->expert_alignment, hh->plan->expert_alignment);
                goto fail;
        }
        plan = hh->plan;

        /* docs/semantics.md §2.5: check every rank's capacity before any byte moves. */
        for (uint32_t d = 0; d < R; d++) {
                struct epdd_exec_rank *er = &ex->ranks[d];
                int64_t rows = epd_plan_rows(plan, d);
                er->num_recv_tokens = epd_plan_num_recv_tokens(plan, d);
                er->num_expanded_rows = epd_plan_num_expanded_rows(plan, d);
                if (er->use_arena || (uint64_t)rows <= er->capacity_rows)
                        continue;
                if (ex->status == 0)
                        msg_len = (size_t)snprintf(ex->message, sizeof(ex->message),
                                                   "op does not fit:");
                ex->status = EPD_CAPACITY_EXCEEDED;
                if (msg_len < sizeof(ex->message))
                        msg_len += (size_t)snprintf(ex->message + msg_len,
                                                    sizeof(ex->message) - msg_len,
                                                    " rank %u needs %lld rows, capacity %llu;",
                                                    d, (long long)rows,
                                                    (unsigned long long)er->capacity_rows);
        }
        if (ex->status < 0 || epd_exec_place_arenas(ex) < 0)
                goto fail;
        if (fresh)
                pool_run(&hb->pool, place_item, plan, R);

        /* The handle keeps its own copy of the weights: combine and combined_topk_weights use
         * them after the client's input may have changed. */
        if (ex->has_weights) {
                if (!hh->weights && !(hh->weights = calloc(R, sizeof(*hh->weights)))) {
                        epd_exec_release_new_arenas(ex);
                        goto oom;
                }
                for (uint32_t s = 0; s < R; s++) {
                        const struct epdd_exec_rank *er = &ex->ranks[s];
                        size_t n = (size_t)er->num_tokens * ex->num_topk;
                        float *w = hh->weights[s] ? hh->weights[s] : malloc(n * sizeof(float) + 1);
                        if (!w) {
                                epd_exec_release_new_arenas(ex);
                                goto oom;
                        }
                        for (uint32_t t = 0; t < er->num_tokens; t++)
                                memcpy(w + (size_t)t * ex->num_topk,
                                       er->src.weights.ptr + t * er->src.weights.stride,
                                       ex->num_topk * sizeof(float));
                        hh->weights[s] = w;
                }
        }
        src = calloc(R, sizeof(*src));
        dst = calloc(R, sizeof(*dst));
        if (!src || !dst) {
                epd_exec_release_new_arenas(ex);
                goto oom;
        }
        for (uint32_t r = 0; r < R; r++) {
                src[r] = ex->ranks[r].src;
                dst[r] = ex->ranks[r].dst;
                if (!ex->has_weights)
                        src[r].weights.ptr = NULL, dst[r].recv_weights.ptr = NULL;
        }
        struct epd_dispatch_exec de = {
                .plan = plan,
                .row_bytes = cfg->row_bytes,
                .scale_bytes = cfg->scale_cols * 4,
                .topk_dtype = ex->topk_dtype,
                .has_weights = ex->has_weights,
                .zero_padding = ex->zero_padding,
                .src = src,
                .dst = dst,
        };
        pool_run(&hb->pool, dispatch_item, &de, epd_host_dispatch_items(&de));
        if (aborted(ex))
                goto fail;

        for (uint32_t d = 0; d < R; d++) {
                struct epdd_exec_rank *er = &ex->ranks[d];
                memcpy(er->per_expert, plan->expert_count + (size_t)d * L, L * sizeof(int32_t));
                memcpy(er->per_expert_aligned, plan->expert_aligned + (size_t)d * L,
                       L * sizeof(int32_t));
                memcpy(er->rank_prefix, plan->rank_prefix + (size_t)d * (R + 1),
                       (R + 1) * sizeof(int32_t));
                bytes += (uint64_t)epd_plan_rows(plan, d) * (cfg->row_bytes + cfg->scale_cols * 4);
        }
        ex->bytes = 2 * bytes;
        ex->status = 0;
        if (fresh)
                ex->new_handle_state = fresh;
        free(src);
        free(dst);
        return;
oom:
        ex->status = EPD_INTERNAL;
        snprintf(ex->message, sizeof(ex->message), "out of memory");
fail:
        epd_exec_release_new_arenas(ex);
        host_handle_free(fresh, R);
        free(src);
        free(dst);
}

static void run_combine(struct host_backend *hb, struct epdd_exec *ex)
{
        const struct epdd_group_cfg *cfg = &ex->cfg;
        uint32_t R = cfg->world_size;
        struct host_handle *hh = ex->handle_state;
        struct epd_mat *y = calloc(2 * (size_t)R, sizeof(*y)); /* y[R], then recv_weights[R] */
        struct epd_combine_src_io *src = calloc(R, sizeof(*src));
        uint64_t rows = 0;

        if (!y || !src) {
                free(y);
                free(src);
                ex->status = EPD_INTERNAL;
                snprintf(ex->message, sizeof(ex->message), "out of memory");
                return;
        }
        for (uint32_t r = 0; r < R; r++) {
                y[r] = ex->ranks[r].y;
                y[R + r] = ex->ranks[r].recv_weights;
                src[r] = ex->ranks[r].comb;
                src[r].weights = hh->weights ? hh->weights[r] : NULL;
                rows += ex->ranks[r].y_rows;
        }
        struct epd_combine_exec ce = {
                .plan = hh->plan,
                .hidden = cfg->hidden,
                .apply_weights = ex->apply_weights,
                .y = y,
                .src = src,
                .recv_weights = ex->recv_weights ? y + R : NULL,
        };
        pool_run(&hb->pool, combine_item, &ce, epd_host_combine_items(&ce));
        if (aborted(ex)) {
                free(y);
                free(src);
                return;
        }
        ex->bytes = rows * cfg->hidden * 2;
        ex->status = 0;
        free(y);
        free(src);
}

static void host_run(void *ctx, struct epdd_exec *ex)
{
        struct host_backend *hb = ctx;

        hb->pool.abort = &ex->abort_status;
        if (ex->kind == EPD_OP_DISPATCH)
                run_dispatch(ctx, ex);
        else
                run_combine(ctx, ex);
}

/* ---- backend ops ---- */

static int host_init(struct epdd_backend *b, const struct epdd_config *cfg, char *err,
                     size_t err_len)
{
        struct host_backend *hb = calloc(1, sizeof(*hb));
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        unsigned threads = cfg->host_threads ? cfg->host_threads : (unsigned)(cpus > 0 ? cpus : 1);
        unsigned devices = cfg->host_devices ? cfg->host_devices : 1;
        sd_id128_t app = SD_ID128_MAKE(6b, 3e, 0a, 51, 8c, 2f, 4d, 17, 9e, 41, c3, 70, 5d, 88, 12, ab);

        if (!hb) {
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        if (devices > EPD_ARRAY_SIZE(b->devices))
                devices = EPD_ARRAY_SIZE(b->devices);
        hb->b = b;
        b->priv = hb;
        b->num_devices = devices;
        for (unsigned i = 0; i < devices; i++) {
                struct epdd_device_desc *dev = &b->devices[i];
                sd_id128_t id;
                /* Stable per machine and index, UUID-shaped like a GPU's. */
                if (sd_id128_get_machine_app_specific(app, &id) < 0)
                        memset(&id, 0, sizeof(id));
                id.bytes[15] ^= (uint8_t)i;
                id.bytes[14] ^= (uint8_t)(i >> 8);
                dev->index = i;
                snprintf(dev->uuid, sizeof(dev->uuid), "HOST-" SD_ID128_UUID_FORMAT_STR,
                         SD_ID128_FORMAT_VAL(id));
                snprintf(dev->name, sizeof(dev->name), "host virtual device %u", i);
                snprintf(dev->kind, sizeof(dev->kind), "host");
                dev->memory_bytes = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
        }
        pthread_mutex_init(&hb->pool.lock, NULL);
        pthread_cond_init(&hb->pool.work_cond, NULL);
        pthread_cond_init(&hb->pool.done_cond, NULL);
        hb->pool.threads = calloc(threads, sizeof(pthread_t));
        if (!hb->pool.threads) {
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        for (unsigned i = 0; i + 1 < threads; i++) {
                if (pthread_create(&hb->pool.threads[i], NULL, pool_helper, &hb->pool) != 0)
                        break;
                hb->pool.num_helpers++;
        }
        hb->executor.b = b;
        hb->executor.run = host_run;
        hb->executor.ctx = hb;
        hb->executor.spin_ns = epd_config_poll_ns(cfg);
        /* The host backend reads inputs on the CPU: wait for clients' doorbells there. */
        hb->executor.host_input_waits = 1;
        if (epd_executor_start(&hb->executor) < 0) {
                snprintf(err, err_len, "cannot start the executor thread");
                return EPD_INTERNAL;
        }
        log_info("host backend devices=%u threads=%u", devices, hb->pool.num_helpers + 1);
        return 0;
}

static void host_fini(struct epdd_backend *b)
{
        struct host_backend *hb = b->priv;

        if (!hb)
                return;
        epd_executor_stop(&hb->executor);
        pthread_mutex_lock(&hb->pool.lock);
        hb->pool.stop = 1;
        pthread_cond_broadcast(&hb->pool.work_cond);
        pthread_mutex_unlock(&hb->pool.lock);
        for (unsigned i = 0; i < hb->pool.num_helpers; i++)
                pthread_join(hb->pool.threads[i], NULL);
        free(hb->pool.threads);
        free(hb);
        b->priv = NULL;
}

static int host_region_import(struct epdd_backend *b, struct epdd_mem *r, int fd,
                              const void *ipc_handle, size_t ipc_len, uint64_t offset, char *err,
                              size_t err_len)
{
        uint64_t lead = 0;
        int rc;

        (void)b;
        (void)ipc_handle;
        (void)ipc_len;
        if (r->kind != EPD_REGION_HOST_MEMFD) {
                snprintf(err, err_len, "the host backend accepts only host memfd regions");
                close(fd);
                return EPD_INVALID_ARGUMENT;
        }
        rc = epd__memfd_map(fd, offset, r->size, &r->base, &lead, err, err_len);
        close(fd);
        r->backend_state = (void *)(uintptr_t)lead;
        return rc;
}

static void host_region_release(struct epdd_backend *b, struct epdd_mem *r)
{
        (void)b;
        epd__memfd_unmap(r->base, (uint64_t)(uintptr_t)r->backend_state, r->size);
        r->base = NULL;
}

static int host_arena_map(struct epdd_backend *b, uint32_t device, int host_memory, uint8_t *addr,
                          uint64_t bytes, int *fd, enum epd_region_kind *kind, char *err,
                          size_t err_len)
{
        (void)b;
        (void)device;
        (void)host_memory;
        *kind = EPD_REGION_HOST_MEMFD;
        return epd__memfd_segment(addr, bytes, fd, err, err_len);
}

static void host_arena_unmap(struct epdd_backend *b, uint8_t *addr, uint64_t bytes)
{
        (void)b;
        epd__memfd_segment_drop(addr, bytes);
}

/* A client-executed group's buffers: one sealed memfd that the daemon and every rank map
 * shared, so the protocol's words are plain shared memory (docs/client-execution.md). */
static int host_cx_alloc(struct epdd_backend *b, uint32_t device, uint64_t bytes, uint8_t **host,
                         void **state, int *fd, enum epd_region_kind *kind, char *err,
                         size_t err_len)
{
        int rc;

        (void)b;
        (void)device;
        rc = epd__memfd_arena(bytes, host, fd, err, err_len);
        if (rc < 0)
                return rc;
        *state = NULL; /* a new memfd reads as zeros */
        *kind = EPD_REGION_HOST_MEMFD;
        return 0;
}

static void host_cx_free(struct epdd_backend *b, uint8_t *host, uint64_t bytes, void *state)
{
        (void)b;
        (void)state;
        if (host)
                munmap(host, bytes);
}

static int host_host_register(struct epdd_backend *b, void *ptr, uint64_t bytes, void **dev)
{
        (void)b;
        (void)ptr;
        (void)bytes;
        *dev = NULL;
        return 0;
}

static void host_host_unregister(struct epdd_backend *b, void *ptr)
{
        (void)b;
        (void)ptr;
}

static void host_submit(struct epdd_backend *b, struct epdd_exec *ex)
{
        struct host_backend *hb = b->priv;

        epd_executor_submit(&hb->executor, ex);
}

static void host_handle_free_op(struct epdd_backend *b, void *state)
{
        struct host_handle *hh = state;

        (void)b;
        if (hh)
                host_handle_free(hh, hh->plan ? hh->plan->world_size : 0);
}

static int host_check_alive(struct epdd_backend *b)
{
        struct host_backend *hb = b->priv;

        return epd_executor_alive(&hb->executor);
}

const struct epdd_backend_ops epd_backend_host_ops = {
        .name = "host",
        .init = host_init,
        .fini = host_fini,
        .region_import = host_region_import,
        .region_release = host_region_release,
        .arena_map = host_arena_map,
        .arena_unmap = host_arena_unmap,
        .cx_alloc = host_cx_alloc,
        .cx_free = host_cx_free,
        .host_register = host_host_register,
        .host_unregister = host_host_unregister,
        .submit = host_submit,
        .handle_free = host_handle_free_op,
        .check_alive = host_check_alive,
};
