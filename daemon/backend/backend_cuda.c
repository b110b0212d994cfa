/* backend_cuda.c - the CUDA backend, daemon-executed mode (docs/architecture.md, "The CUDA
 * backend's data path" and "Where kernels run").
 *
 * Devices are the node's GPUs, named by UUID. Client memory reaches the kernels three ways: host
 * memfd regions are mapped and registered with CUDA (cudaHostRegister, portable and mapped), so
 * a host-only client can use the GPU path; CUDA IPC handles are opened with
 * cudaIpcOpenMemHandle; cuMem POSIX fds are imported, mapped into a reserved VA range and made
 * accessible to every device. Every op runs on the executor thread as the launch sequence of
 * kernels/epd_kernels.h: count on each device, prefix on the first rank's device, place and copy
 * on each device, with events between streams and no host round trip, except when outputs go to
 * the output arena, whose exact placement needs the counts first. A small NON_EXPAND op of a
 * group on one GPU is one launch instead (dispatch_small: each cluster of blocks routes the whole
 * op and copies its share, and the kernel writes the reply block into pinned memory itself), or,
 * with arena outputs, route_small and then copy.
 *
 * Client memory from cuMem allocations (epd_device_alloc, PyTorch's expandable segments) is
 * mapped here by the daemon itself; cudaMalloc memory arrives as a CUDA IPC handle, and the
 * kernels were measured to reach such imports at about half the bandwidth on an H200
 * (docs/performance.md), so clients should prefer cuMem for large tensors.
 *
 * Each dispatch handle owns a workspace (routing state for combine and cached dispatch) in the
 * memory of its group's first device, reachable from the group's other devices through peer
 * access.
 *
 * Threads: init, region import and arena creation run on the loop thread; every launch and
 * synchronisation runs on the one executor thread.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stddef.h>
#include <time.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "arena.h"
#include "cudrv.h"
#include "backend.h"
#include "executor.h"
#include "epd_kernels.h"
#include "layout.h"
#include "log.h"
#include "memfd.h"
#include "util.h"

#define MAX_DEVICES 64

/* Descriptor staging for one kind of op: a pinned host buffer, its device copy, and what the
 * device copy holds, reused by every op (the executor runs one op at a time and waits for it).
 * The device copy is uploaded only when the bytes differ from what it holds: a model's ops
 * usually come back with the same tensors and token counts, and an upload is a host call and a
 * copy-engine round trip before the op's kernel can start. Kernels only read it. */
struct desc_buf {
        void *h, *d;
        void *held;                   /* malloc'd: the bytes d holds, held_bytes of them */
        size_t cap, held_bytes;       /* held_bytes 0: unknown */
};

enum { DESC_DISPATCH, DESC_COMBINE, DESC_KINDS };

/* The one-kernel ops launched with their timing events as one graph (kernels/timed.cu). */
enum { TIMED_DISPATCH_SMALL, TIMED_COMBINE, TIMED_KINDS };

struct cuda_dev {
        cudaStream_t stream;
        cudaEvent_t counted, done;
        cudaEvent_t t0, t1;           /* timing: around the op's kernels */
        struct desc_buf desc[DESC_KINDS];
        /* An op of one kernel on this device (the one-launch dispatch, a one-device combine)
         * sends t0, its kernel and t1 as one graph, so that the kernel time does not hold the
         * host's launch call (kernels/timed.cu); executor thread only. */
        struct epd_k_timed *timed[TIMED_KINDS];
        int timed_warned[TIMED_KINDS];
};

struct cuda_backend {
        struct epdd_backend *b;
        int num_devices;
        struct cuda_dev dev[MAX_DEVICES];
        uint64_t granularity;
        struct epdd_executor executor;
        /* Workspaces of released handles, kept for the next dispatch of the same shape instead
         * of cudaFree + cudaMalloc per op (tens of microseconds, and cudaFree synchronises the
         * device). Released handles are added by the loop thread; the executor takes them, and
         * frees those beyond SPARE_KEEP when it is idle. Own lock. */
        pthread_mutex_t lock;
        struct spare_ws *spare;
        unsigned num_spare, cap_spare;
        void *h_reply;               /* pinned copy of the reply block */
        size_t reply_cap;
        cudaEvent_t prefixed;
};

/* How many released workspaces stay allocated for reuse. */
#define SPARE_KEEP 16

struct spare_ws {
        void *ws;
        uint64_t bytes;
        int device;
};

struct cuda_handle {
        void *ws;
        int device;
        struct epd_ws_layout layout;
};

/* How a region is held on this backend. */
struct cuda_region {
        enum epd_region_kind kind;
        uint64_t lead;               /* memfd: bytes mapped before base */
        void *ipc_ptr;               /* CUDA IPC: the opened base pointer */
        CUdeviceptr va;              /* cuMem: reserved range */
        uint64_t va_size;
        CUmemGenericAllocationHandle mem;
};

static int cuda_fail(char *err, size_t err_len, const char *what, cudaError_t e)
{
        snprintf(err, err_len, "%s: %s", what, cudaGetErrorString(e));
        return EPD_UNAVAILABLE;
}

static int cu_fail(char *err, size_t err_len, const char *what, CUresult r)
{
        const char *s = NULL;
        if (epd_cudrv())
                epd_cudrv()->GetErrorString(r, &s);
        snprintf(err, err_len, "%s: %s", what, s ? s : "CUDA driver error");
        return EPD_UNAVAILABLE;
}

/* ---- executor ---- */

/* The staging buffer of `kind` with room for `bytes`, for the caller to fill; NULL when out
 * of memory. Current device: dv's. */
static void *ensure_desc(struct cuda_dev *dv, int kind, size_t bytes)
{
        struct desc_buf *b = &dv->desc[kind];

        if (b->cap >= bytes)
                return b->h;
        if (b->h)
                cudaFreeHost(b->h);
        if (b->d)
                cudaFree(b->d);
        free(b->held);
        memset(b, 0, sizeof(*b));
        if (cudaMallocHost(&b->h, bytes) != cudaSuccess ||
            cudaMalloc(&b->d, bytes) != cudaSuccess || !(b->held = malloc(bytes)))
                return NULL;
        b->cap = bytes;
        return b->h;
}

/* Queues the upload of the first `bytes` of the staging buffer of `kind` on dv's stream,
 * unless the device copy already holds exactly them. */
static int upload_desc(struct cuda_dev *dv, int kind, size_t bytes)
{
        struct desc_buf *b = &dv->desc[kind];

        if (b->held_bytes == bytes && memcmp(b->held, b->h, bytes) == 0)
                return 0;
        b->held_bytes = 0;
        if (cudaMemcpyAsync(b->d, b->h, bytes, cudaMemcpyHostToDevice, dv->stream) != cudaSuccess)
                return EPD_INTERNAL;
        memcpy(b->held, b->h, bytes);
        b->held_bytes = bytes;
        return 0;
}

/* A released workspace of exactly `bytes` on `device`, or NULL. Executor thread. */
static void *take_spare(struct cuda_backend *cb, int device, uint64_t bytes)
{
        void *ws = NULL;

        pthread_mutex_lock(&cb->lock);
        for (unsigned i = cb->num_spare; i-- > 0;) {
                if (cb->spare[i].device == device && cb->spare[i].bytes == bytes) {
                        ws = cb->spare[i].ws;
                        cb->spare[i] = cb->spare[--cb->num_spare];
                        break;
                }
        }
        pthread_mutex_unlock(&cb->lock);
        return ws;
}

/* Frees the oldest spares beyond `keep`. Executor thread (or fini). */
static void trim_spares(struct cuda_backend *cb, unsigned keep)
{
        pthread_mutex_lock(&cb->lock);
        while (cb->num_spare > keep) {
                struct spare_ws sp = cb->spare[0];
                memmove(cb->spare, cb->spare + 1, (cb->num_spare - 1) * sizeof(*cb->spare));
                cb->num_spare--;
                pthread_mutex_unlock(&cb->lock);
                cudaSetDevice(sp.device);
                cudaFree(sp.ws);
                pthread_mutex_lock(&cb->lock);
        }
        pthread_mutex_unlock(&cb->lock);
}

/* Local-rank lists of each device: counts[d] ranks and their token offsets. */
static void build_local(const struct epdd_exec *ex, int dev, struct epd_k_local *local,
                        uint32_t *num_local, uint32_t *local_tokens, int combine)
{
        uint32_t n = 0, tokens = 0;

        for (uint32_t r = 0; r < ex->cfg.world_size; r++) {
                if ((int)ex->ranks[r].device != dev)
                        continue;
                local[n].rank = r;
                local[n].token_offset = tokens;
                tokens += ex->ranks[r].num_tokens;
                n++;
        }
        (void)combine;
        local[n].rank = 0;
        local[n].token_offset = tokens;
        *num_local = n;
        *local_tokens = tokens;
}

static void fill_dispatch_ranks(const struct epdd_exec *ex, struct epd_k_dispatch_rank *kr)
{
        for (uint32_t r = 0; r < ex->cfg.world_size; r++) {
                const struct epdd_exec_rank *er = &ex->ranks[r];
                memset(&kr[r], 0, sizeof(kr[r]));
                kr[r].num_tokens = er->num_tokens;
                kr[r].topk_idx = er->topk_idx;
                kr[r].topk_stride = er->topk_stride;
                kr[r].in = er->src;
                kr[r].out = er->dst;
                if (!ex->has_weights) {
                        kr[r].in.weights = (struct epd_mat){ 0 };
                        kr[r].out.recv_weights = (struct epd_mat){ 0 };
                }
                kr[r].capacity_rows = er->capacity_rows;
        }
}

/* Uploads the rank descriptors and each device's local list; returns per-device args. */
static int upload_dispatch(struct cuda_backend *cb, struct epdd_exec *ex, void *ws,
                           struct epd_k_dispatch_args *args)
{
        uint32_t R = ex->cfg.world_size;
        size_t ranks_bytes = sizeof(struct epd_k_dispatch_rank) * R;
        size_t bytes = ranks_bytes + sizeof(struct epd_k_local) * (R + 1);

        for (int d = 0; d < cb->num_devices; d++) {
                struct cuda_dev *dv = &cb->dev[d];
                struct epd_k_dispatch_args *a = &args[d];
                uint8_t *h;

                memset(a, 0, sizeof(*a));
                cudaSetDevice(d);
                if (!(h = ensure_desc(dv, DESC_DISPATCH, bytes)))
                        return EPD_INTERNAL;
                fill_dispatch_ranks(ex, (struct epd_k_dispatch_rank *)h);
                build_local(ex, d, (struct epd_k_local *)(h + ranks_bytes), &a->num_local,
                            &a->local_tokens, 0);
                if (upload_desc(dv, DESC_DISPATCH, bytes) < 0)
                        return EPD_INTERNAL;
                a->world_size = R;
                a->num_experts = ex->cfg.num_experts;
                a->max_tokens = ex->cfg.max_tokens;
                a->max_topk = ex->cfg.max_topk;
                a->num_topk = ex->num_topk;
                a->expert_alignment = ex->expert_alignment;
                a->layout = ex->layout;
                a->topk_dtype = ex->topk_dtype;
                a->has_weights = ex->has_weights;
                a->zero_padding = ex->zero_padding;
                a->row_bytes = ex->cfg.row_bytes;
                a->scale_bytes = ex->cfg.scale_cols * 4;
                a->workspace = ws;
                a->ranks = dv->desc[DESC_DISPATCH].d;
                a->local = (const struct epd_k_local *)((uint8_t *)dv->desc[DESC_DISPATCH].d +
                                                        ranks_bytes);
                /* The same descriptors for the kernel's parameters (small groups). */
                a->ranks_host = (const struct epd_k_dispatch_rank *)h;
                a->local_host = (const struct epd_k_local *)(h + ranks_bytes);
        }
        return 0;
}

static int devices_of(const struct epdd_exec *ex, int *used)
{
        int n = 0;

        memset(used, 0, sizeof(int) * MAX_DEVICES);
        for (uint32_t r = 0; r < ex->cfg.world_size; r++) {
                if (!used[ex->ranks[r].device])
                        n++;
                used[ex->ranks[r].device] = 1;
        }
        return n;
}

static void fetch_reply(struct cuda_backend *cb, struct epdd_exec *ex,
                        const struct epd_ws_layout *l)
{
        uint32_t R = ex->cfg.world_size, L = ex->cfg.num_local_experts;
        uint8_t *h = cb->h_reply;

        for (uint32_t d = 0; d < R; d++) {
                struct epdd_exec_rank *er = &ex->ranks[d];
                er->num_recv_tokens = epd_ws_num_recv_tokens(h, l, d);
                er->num_expanded_rows = epd_ws_num_expanded_rows(h, l, d);
                memcpy(er->rank_prefix, epd_ws_i32(h, l->rank_prefix) + (size_t)d * (R + 1),
                       (R + 1) * sizeof(int32_t));
                memcpy(er->per_expert, epd_ws_i32(h, l->expert_count) + (size_t)d * L,
                       L * sizeof(int32_t));
                memcpy(er->per_expert_aligned, epd_ws_i32(h, l->expert_aligned) + (size_t)d * L,
                       L * sizeof(int32_t));
        }
}

/* Turns the workspace's verdict into the op's status and message. */
static int verdict(struct epdd_exec *ex, const struct epd_ws_layout *l, uint8_t *h)
{
        const struct epd_ws_error *e = epd_ws_error_rec(h, l);
        uint32_t R = ex->cfg.world_size;
        size_t len;

        if (e->status == 0)
                return 0;
        ex->status = e->status;
        switch (e->reason) {
        case EPD_WS_REASON_BAD_EXPERT:
                snprintf(ex->message, sizeof(ex->message),
                         "invalid topk_idx on rank %d: rank %d token %d topk position %d: expert id %lld outside [0, %u) and not -1",
                         e->rank, e->rank, e->token, e->pos, (long long)e->value,
                         ex->cfg.num_experts);
                break;
        case EPD_WS_REASON_DUP_EXPERT:
                snprintf(ex->message, sizeof(ex->message),
                         "invalid topk_idx on rank %d: rank %d token %d: expert %lld selected twice, again at topk position %d",
                         e->rank, e->rank, e->token, (long long)e->value, e->pos);
                break;
        case EPD_WS_REASON_CAPACITY:
                len = (size_t)snprintf(ex->message, sizeof(ex->message), "op does not fit:");
                for (uint32_t d = 0; d < R && len < sizeof(ex->message); d++) {
                        int64_t rows = ex->layout == EPD_LAYOUT_EXPAND
                                               ? epd_ws_num_expanded_rows(h, l, d)
                                               : epd_ws_num_recv_tokens(h, l, d);
                        if ((uint64_t)rows > ex->ranks[d].capacity_rows)
                                len += (size_t)snprintf(ex->message + len,
                                                        sizeof(ex->message) - len,
                                                        " rank %u needs %lld rows, capacity %llu;",
                                                        d, (long long)rows,
                                                        (unsigned long long)ex->ranks[d].capacity_rows);
                }
                break;
        default:
                snprintf(ex->message, sizeof(ex->message), "dispatch rejected (reason %d, rank %d)",
                         e->reason, e->rank);
        }
        return -1;
}

/* Stream memory operations (the doorbell waits and writes of every rank of an op) go to the
 * GPU as one cuStreamBatchMemOp per MEMOP_BATCH of them. One call each cost, on an H200, 1.3 us
 * of host time and about as much GPU time per operation: 10.6 us of host and 13.2 us of GPU time
 * for the 8 doorbell writes of an 8-rank op, against 2.3 us and 7.4 us as one batch
 * (bench/probes/memop_probe.cu, docs/performance.md). */
#define MEMOP_BATCH 64

struct memop_batch {
        CUstream stream;
        unsigned n;
        CUstreamBatchMemOpParams op[MEMOP_BATCH];
};

static void memop_flush(struct memop_batch *b)
{
        if (b->n == 0)
                return;
        if (epd_cudrv()->StreamBatchMemOp(b->stream, b->n, b->op, 0) != CUDA_SUCCESS) {
                /* A driver that refuses the batch: one call each. Waits (>=) and writes of the
                 * same value may be queued twice without harm. */
                for (unsigned i = 0; i < b->n; i++) {
                        const CUstreamBatchMemOpParams *o = &b->op[i];
                        if (o->operation == CU_STREAM_MEM_OP_WAIT_VALUE_64)
                                epd_cudrv()->StreamWaitValue64(b->stream, o->waitValue.address,
                                                               o->waitValue.value64,
                                                               o->waitValue.flags);
                        else
                                epd_cudrv()->StreamWriteValue64(b->stream, o->writeValue.address,
                                                                o->writeValue.value64,
                                                                o->writeValue.flags);
                }
        }
        b->n = 0;
}

static void memop_add(struct memop_batch *b, int wait, void *doorbell_dev, size_t offset,
                      uint64_t value)
{
        CUstreamBatchMemOpParams *o = &b->op[b->n++];

        memset(o, 0, sizeof(*o));
        if (wait) {
                o->waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
                o->waitValue.address = (CUdeviceptr)(uintptr_t)doorbell_dev + offset;
                o->waitValue.value64 = value;
                o->waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
        } else {
                o->writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
                o->writeValue.address = (CUdeviceptr)(uintptr_t)doorbell_dev + offset;
                o->writeValue.value64 = value;
        }
        if (b->n == MEMOP_BATCH)
                memop_flush(b);
}

/* Queues, on `stream`, the waits for every rank's inputs that the op was told to wait for,
 * except those the host already sees satisfied: the client's stream stored inputs_ready after
 * its inputs were written (a stream write with its memory barrier), so a kernel launched after
 * this read finds them, and a wait that is already satisfied still costs the GPU about 1.2 us
 * per rank (8 satisfied waits: 9.6-9.9 us, bench/probes/memop_probe.cu) before the op can start. */
static void queue_input_waits(const struct epdd_exec *ex, cudaStream_t stream)
{
        struct memop_batch b;

        b.stream = (CUstream)stream;
        b.n = 0;
        for (uint32_t r = 0; r < ex->cfg.world_size; r++) {
                const struct epdd_exec_rank *er = &ex->ranks[r];
                if (!er->wait_inputs || !er->doorbell_dev)
                        continue;
                if (er->doorbell && __atomic_load_n(&er->doorbell->inputs_ready,
                                                    __ATOMIC_ACQUIRE) >= er->wait_inputs)
                        continue;
                memop_add(&b, 1, er->doorbell_dev, offsetof(struct epd_doorbell, inputs_ready),
                          er->wait_inputs);
        }
        memop_flush(&b);
}

/* Publishes every rank's completion doorbell from the host once the executor has seen the op's
 * end event: its kernels are complete, so their outputs are in place for any stream of the
 * device, and a stream-ordered client's stream (waiting for `completed` with
 * cuStreamWaitValue64) is released. The loop thread stores the same value again when it takes
 * the completion (group.c, rank_publish); the word only ever grows (epd_doorbell_advance). From the
  * host rather than as stream writes after the end event: those 8 writes took 7.4 us of GPU time as
  * one batch (bench/probes/memop_probe.cu), so the last rank's doorbell moved that long after the
  * op ended, and the next op on the stream started that much later. Executor thread; the pages stay
  * mapped while the op executes (group.c, rank_doorbell_retire). */
static void publish_completions(const struct epdd_exec *ex)
{
        for (uint32_t r = 0; r < ex->cfg.world_size; r++)
                if (ex->ranks[r].doorbell)
                        epd_doorbell_advance(&ex->ranks[r].doorbell->completed,
                                             ex->ranks[r].completed_value);
}

/* Waits for a stream, or for an event on it (ev not NULL), with a bound: past the op timeout,
 * the input doorbells the op waits on are released from the host (their clients did not mark
 * their inputs ready), the stream drains, and the op fails with TIMEOUT. */
static cudaError_t sync_stream(struct epdd_exec *ex, int dev, cudaStream_t stream,
                               cudaEvent_t ev, uint64_t deadline_ns)
{
        int released = 0;

        cudaSetDevice(dev);
        for (unsigned spin = 0;; spin++) {
                cudaError_t ce = ev != NULL ? cudaEventQuery(ev) : cudaStreamQuery(stream);
                if (ce != cudaErrorNotReady)
                        return ce;
                if (!released && epd__now_ns() > deadline_ns) {
                        for (uint32_t r = 0; r < ex->cfg.world_size; r++) {
                                struct epdd_exec_rank *er = &ex->ranks[r];
                                if (er->wait_inputs && er->doorbell &&
                                    er->doorbell->inputs_ready < er->wait_inputs) {
                                        __atomic_store_n(&er->doorbell->inputs_ready,
                                                         EPD_DOORBELL_RELEASED, __ATOMIC_RELEASE);
                                        if (ex->status == 0) {
                                                ex->status = EPD_TIMEOUT;
                                                snprintf(ex->message, sizeof(ex->message),
                                                         "rank %u's inputs were not marked ready within the op timeout",
                                                         r);
                                        }
                                }
                        }
                        released = 1;
                }
                /* Spin briefly (ops are often short), then yield the core. */
                if (spin > 2000) {
                        struct timespec ts = { 0, 5000 };
                        nanosleep(&ts, NULL);
                }
        }
}

/* The start of an op on its devices: every used stream waits for the clients' inputs, then
 * t0 on W marks the start of the kernel time, unless the op's one kernel is a timed launch
 * (timed: it records t0 and t1 itself). W is the current device on return. */
static void op_begin(struct cuda_backend *cb, const struct epdd_exec *ex, const int *used, int W,
                     int timed)
{
        for (int d = 0; d < cb->num_devices; d++) {
                if (!used[d])
                        continue;
                cudaSetDevice(d);
                queue_input_waits(ex, cb->dev[d].stream);
        }
        cudaSetDevice(W);
        if (!timed)
                cudaEventRecord(cb->dev[W].t0, cb->dev[W].stream);
}

/* The end of an op: W's stream joins every other device's work, t1 marks the end of the
 * kernel time (the executor publishes the completion doorbells once it has passed). */
static void op_end(struct cuda_backend *cb, const int *used, int W)
{
        for (int d = 0; d < cb->num_devices; d++) {
                if (!used[d] || d == W)
                        continue;
                cudaSetDevice(d);
                cudaEventRecord(cb->dev[d].done, cb->dev[d].stream);
                cudaSetDevice(W);
                cudaStreamWaitEvent(cb->dev[W].stream, cb->dev[d].done, 0);
        }
        cudaSetDevice(W);
        cudaEventRecord(cb->dev[W].t1, cb->dev[W].stream);
}

/* After a timed launch on device d: says once per kind when it could not go through a graph,
 * since the kernel times then hold the host's launch call again. */
static void timed_note(struct cuda_backend *cb, int d, int kind)
{
        /* cudaSuccess: graphs are off by configuration (said at start). */
        if (epd_k_timed_uses_graph(cb->dev[d].timed[kind]) || cb->dev[d].timed_warned[kind] ||
            epd_k_timed_fallback_error(cb->dev[d].timed[kind]) == cudaSuccess)
                return;
        cb->dev[d].timed_warned[kind] = 1;
        log_warning("device %d: %s launched without a CUDA graph (%s); its kernel times include "
                    "the host's launch call", d,
                    kind == TIMED_COMBINE ? "combine" : "the one-launch dispatch",
                    cudaGetErrorString(epd_k_timed_fallback_error(cb->dev[d].timed[kind])));
}

/* GPU time between op_begin and op_end, once both have completed. */
static uint64_t op_kernel_ns(struct cuda_backend *cb, int W)
{
        float ms = 0;

        cudaSetDevice(W);
        if (cudaEventElapsedTime(&ms, cb->dev[W].t0, cb->dev[W].t1) != cudaSuccess)
                return 0;
        return (uint64_t)(ms * 1e6);
}

/* The op's devices for a launch plan, in ascending ordinal (the used ones). */
static uint32_t op_devices(struct cuda_backend *cb, const int *used, struct epd_k_op_device *devs)
{
        uint32_t n = 0;

        for (int d = 0; d < cb->num_devices; d++) {
                if (!used[d])
                        continue;
                devs[n].device = d;
                devs[n].stream = cb->dev[d].stream;
                devs[n].counted = cb->dev[d].counted;
                n++;
        }
        return n;
}

/* A dispatch with new arena placements, in the middle: the arenas need exact sizes, so wait for
 * the counts, place, and upload the descriptors again (epd_k_counts_fn). */
struct arena_wait {
        struct cuda_backend *cb;
        struct epdd_exec *ex;
        struct cuda_handle *ch;
        uint64_t deadline;
};

static int arena_place(void *ctx, struct epd_k_dispatch_plan *plan)
{
        struct arena_wait *aw = ctx;
        struct epdd_exec *ex = aw->ex;

        plan->step = "routing (arena placement wait)";
        if (sync_stream(ex, plan->group_device, aw->cb->dev[plan->group_device].stream, NULL,
                        aw->deadline) != cudaSuccess)
                return EPD_UNAVAILABLE;
        if (ex->status < 0 || verdict(ex, &aw->ch->layout, aw->cb->h_reply) < 0)
                return 1;
        fetch_reply(aw->cb, ex, &aw->ch->layout);
        if (epd_exec_place_arenas(ex) < 0)
                return 1;
        if (upload_dispatch(aw->cb, ex, aw->ch->ws, plan->args) < 0)
                return EPD_INTERNAL;
        return 0;
}

static int run_dispatch(struct cuda_backend *cb, struct epdd_exec *ex)
{
        uint32_t R = ex->cfg.world_size;
        struct cuda_handle *ch = ex->handle_state, *fresh = NULL;
        struct epd_k_dispatch_args args[MAX_DEVICES];
        struct epd_k_op_device devs[MAX_DEVICES];
        int used[MAX_DEVICES];
        int W = (int)ex->ranks[0].device, arena = 0, rc;
        const char *step = "setup"; /* named in the op's error when CUDA fails */
        cudaError_t ce;

        devices_of(ex, used);
        for (uint32_t r = 0; r < R; r++)
                arena |= ex->ranks[r].use_arena && !ex->ranks[r].place.used;
        if (!ch) {
                fresh = calloc(1, sizeof(*fresh));
                if (!fresh)
                        goto oom;
                epd_ws_layout_init(&fresh->layout, R, ex->cfg.num_experts, ex->cfg.max_tokens,
                                   ex->cfg.max_topk);
                fresh->device = W;
                cudaSetDevice(W);
                fresh->ws = take_spare(cb, W, fresh->layout.total_bytes);
                if (!fresh->ws) {
                        if (cudaMalloc(&fresh->ws, fresh->layout.total_bytes) != cudaSuccess)
                                goto oom;
                        /* The small routing's counters start at zero (it leaves them so). */
                        if (epd_k_workspace_init(fresh->ws, R, ex->cfg.num_experts,
                                                 ex->cfg.max_tokens, ex->cfg.max_topk,
                                                 cb->dev[W].stream) < 0)
                                goto cuda_error;
                }
                ch = fresh;
        } else {
                W = ch->device;
        }
        if (cb->reply_cap < ch->layout.reply_bytes) {
                if (cb->h_reply)
                        cudaFreeHost(cb->h_reply);
                cb->reply_cap = 0;
                if (cudaMallocHost(&cb->h_reply, ch->layout.reply_bytes) != cudaSuccess)
                        goto oom;
                cb->reply_cap = ch->layout.reply_bytes;
        }
        /* Ranks whose arena placement is already known (cached dispatch) get their outputs
         * bound now; new placements wait for the counts (arena_place). */
        for (uint32_t r = 0; r < R; r++) {
                struct epdd_exec_rank *er = &ex->ranks[r];
                if (er->use_arena && er->place.used)
                        epd_exec_bind_arena(ex, er);
        }
        if (upload_dispatch(cb, ex, ch->ws, args) < 0)
                goto cuda_error;

        /* kernels/ chooses the launches (run.c); the plan is made (host checks and occupancy
         * queries) before the GPU time window opens. */
        struct arena_wait aw = { cb, ex, ch, 0 };
        struct epd_k_dispatch_plan plan = {
                .num_devices = op_devices(cb, used, devs),
                .devices = devs,
                .group_device = W,
                .args = args,
                .cached = fresh == NULL,
                .counts_ready = arena ? arena_place : NULL,
                .ctx = &aw,
                .reply_host = cb->h_reply,
                .routed = cb->prefixed,
                .timed = cb->dev[W].timed[TIMED_DISPATCH_SMALL],
                .t0 = cb->dev[W].t0,
                .t1 = cb->dev[W].t1,
        };
        rc = epd_k_dispatch_prepare(&plan);
        step = plan.step;
        if (rc < 0)
                goto cuda_error;
        aw.deadline = epd__now_ns() + ex->timeout_ns;
        op_begin(cb, ex, used, W, plan.one_launch);
        rc = epd_k_dispatch_run(&plan);
        step = plan.step;
        if (rc < 0)
                goto cuda_error;
        if (rc > 0)
                goto fail;
        if (plan.one_launch)
                timed_note(cb, W, TIMED_DISPATCH_SMALL);
        else
                /* Every device's copy done: t1 on W's stream, which the executor waits for. */
                op_end(cb, used, W);
        step = "the op's kernels (found at completion)";
        ce = sync_stream(ex, W, cb->dev[W].stream, cb->dev[W].t1, aw.deadline);
        if (ce != cudaSuccess)
                goto cuda_error;
        publish_completions(ex);
        if (ex->status < 0)
                goto fail;
        if (verdict(ex, &ch->layout, cb->h_reply) < 0)
                goto fail;
        ex->kernel_ns = op_kernel_ns(cb, W);
        fetch_reply(cb, ex, &ch->layout);
        ex->bytes = 0;
        for (uint32_t d = 0; d < R; d++) {
                int64_t rows = ex->layout == EPD_LAYOUT_EXPAND ? ex->ranks[d].num_expanded_rows
                                                               : ex->ranks[d].num_recv_tokens;
                ex->bytes += 2 * (uint64_t)rows * (ex->cfg.row_bytes + ex->cfg.scale_cols * 4);
        }
        if (fresh)
                ex->new_handle_state = fresh;
        return 0;
oom:
        ex->status = EPD_INTERNAL;
        snprintf(ex->message, sizeof(ex->message), "out of GPU or pinned memory");
        goto fail;
cuda_error:
        ex->status = EPD_UNAVAILABLE;
        /* A runtime call's error is still pending; a launcher's was taken by the launcher,
         * which keeps it (epd_k_last_cuda_error). */
        ce = cudaGetLastError();
        snprintf(ex->message, sizeof(ex->message), "CUDA error in %s: %s", step,
                 cudaGetErrorString(ce != cudaSuccess ? ce : epd_k_last_cuda_error()));
fail:
        epd_exec_release_new_arenas(ex);
        if (fresh) {
                if (fresh->ws)
                        cudaFree(fresh->ws);
                free(fresh);
        }
        return -1;
}

static int run_combine(struct cuda_backend *cb, struct epdd_exec *ex)
{
        uint32_t R = ex->cfg.world_size;
        struct cuda_handle *ch = ex->handle_state;
        size_t ranks_bytes = sizeof(struct epd_k_combine_rank) * R;
        size_t bytes = ranks_bytes + sizeof(struct epd_k_local) * (R + 1);
        struct epd_k_combine_args args[MAX_DEVICES];
        struct epd_k_op_device devs[MAX_DEVICES];
        int used[MAX_DEVICES];
        int rc = 0;

        uint64_t deadline = epd__now_ns() + ex->timeout_ns;
        int W = (int)ex->ranks[0].device;

        devices_of(ex, used);
        /* Descriptors first, so that the op's GPU time starts with its kernel. */
        for (int d = 0; d < cb->num_devices && rc == 0; d++) {
                struct cuda_dev *dv = &cb->dev[d];
                struct epd_k_combine_args *a = &args[d];
                uint8_t *h;

                if (!used[d])
                        continue;
                cudaSetDevice(d);
                if (!(h = ensure_desc(dv, DESC_COMBINE, bytes))) {
                        rc = EPD_INTERNAL;
                        break;
                }
                struct epd_k_combine_rank *kr = (struct epd_k_combine_rank *)h;
                memset(a, 0, sizeof(*a));
                for (uint32_t r = 0; r < R; r++) {
                        const struct epdd_exec_rank *er = &ex->ranks[r];
                        memset(&kr[r], 0, sizeof(kr[r]));
                        kr[r].num_tokens = er->num_tokens;
                        kr[r].y = er->y;
                        kr[r].y_rows = er->y_rows;
                        kr[r].bias[0] = er->comb.bias[0];
                        kr[r].bias[1] = er->comb.bias[1];
                        kr[r].combined = er->comb.combined;
                        kr[r].combined_topk_weights = er->comb.combined_topk_weights;
                        kr[r].source_weights = er->comb.source_weights;
                        kr[r].recv_weights = er->recv_weights;
                        a->source_weights |= er->comb.source_weights.ptr != NULL;
                }
                build_local(ex, d, (struct epd_k_local *)(h + ranks_bytes), &a->num_local,
                            &a->local_tokens, 1);
                if (upload_desc(dv, DESC_COMBINE, bytes) < 0) {
                        rc = EPD_INTERNAL;
                        break;
                }
                a->world_size = R;
                a->num_experts = ex->cfg.num_experts;
                a->max_tokens = ex->cfg.max_tokens;
                a->max_topk = ex->cfg.max_topk;
                a->num_topk = ex->num_topk;
                a->layout = ex->layout;
                a->hidden = ex->cfg.hidden;
                a->apply_weights = ex->apply_weights;
                a->has_weights = ex->has_weights;
                a->recv_weights = ex->recv_weights;
                a->workspace = ch->ws;
                a->ranks = dv->desc[DESC_COMBINE].d;
                a->local = (const struct epd_k_local *)((uint8_t *)dv->desc[DESC_COMBINE].d +
                                                        ranks_bytes);
                a->ranks_host = kr;
                a->local_host = (const struct epd_k_local *)(h + ranks_bytes);
        }
        /* kernels/ chooses the launches (run.c): one device is one kernel, launched with its
         * events as one graph. */
        struct epd_k_combine_plan plan = {
                .num_devices = op_devices(cb, used, devs),
                .devices = devs,
                .group_device = W,
                .args = args,
                .timed = cb->dev[W].timed[TIMED_COMBINE],
                .t0 = cb->dev[W].t0,
                .t1 = cb->dev[W].t1,
        };
        epd_k_combine_prepare(&plan);
        if (rc == 0) {
                op_begin(cb, ex, used, W, plan.one_launch);
                rc = epd_k_combine_run(&plan);
                if (plan.one_launch) {
                        if (rc == 0 && args[W].local_tokens != 0)
                                timed_note(cb, W, TIMED_COMBINE);
                } else {
                        op_end(cb, used, W);
                }
        }
        /* As for dispatch: the end event (it follows every device's combine); after a failed
         * launch, every used stream. */
        for (int d = 0; d < cb->num_devices; d++) {
                if (!used[d] || (rc == 0 && d != W))
                        continue;
                if (sync_stream(ex, d, cb->dev[d].stream, rc == 0 ? cb->dev[W].t1 : NULL,
                                deadline) != cudaSuccess)
                        rc = EPD_UNAVAILABLE;
        }
        if (rc == 0 && ex->status == 0)
                publish_completions(ex);
        if (ex->status < 0)
                return -1;
        if (rc < 0) {
                ex->status = rc;
                cudaError_t ce = cudaGetLastError();
                snprintf(ex->message, sizeof(ex->message), "CUDA error in combine: %s",
                         cudaGetErrorString(ce != cudaSuccess ? ce : epd_k_last_cuda_error()));
                return -1;
        }
        ex->kernel_ns = op_kernel_ns(cb, W);
        uint64_t rows = 0;
        for (uint32_t r = 0; r < R; r++)
                rows += ex->ranks[r].y_rows;
        ex->bytes = rows * ex->cfg.hidden * 2;
        return 0;
}

static void cuda_run(void *ctx, struct epdd_exec *ex)
{
        if (ex->kind == EPD_OP_DISPATCH)
                run_dispatch(ctx, ex);
        else
                run_combine(ctx, ex);
}

static void cuda_idle(void *ctx)
{
        trim_spares(ctx, SPARE_KEEP);
}

/* ---- backend ops ---- */

static int cuda_init(struct epdd_backend *b, const struct epdd_config *cfg, char *err,
                     size_t err_len)
{
        struct cuda_backend *cb;
        int n = 0;
        cudaError_t ce;

        (void)cfg;
        ce = cudaGetDeviceCount(&n);
        if (ce != cudaSuccess || n == 0) {
                snprintf(err, err_len, "no usable GPU: %s",
                         ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices");
                return EPD_UNAVAILABLE;
        }
        if (!epd_cudrv()) {
                snprintf(err, err_len, "the CUDA driver lacks a function epd needs (driver too old?)");
                return EPD_UNAVAILABLE;
        }
        cb = calloc(1, sizeof(*cb));
        if (!cb)
                return EPD_INTERNAL;
        cb->b = b;
        b->priv = cb;
        cb->num_devices = n > MAX_DEVICES ? MAX_DEVICES : n;
        b->num_devices = (unsigned)cb->num_devices;
        for (int d = 0; d < cb->num_devices; d++) {
                struct cudaDeviceProp prop;
                struct epdd_device_desc *dev = &b->devices[d];
                const unsigned char *u;

                cudaSetDevice(d);
                if (cudaGetDeviceProperties(&prop, d) != cudaSuccess)
                        return cuda_fail(err, err_len, "cudaGetDeviceProperties", cudaGetLastError());
                u = (const unsigned char *)prop.uuid.bytes;
                dev->index = (uint32_t)d;
                snprintf(dev->uuid, sizeof(dev->uuid),
                         "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
                         u[12], u[13], u[14], u[15]);
                snprintf(dev->name, sizeof(dev->name), "%.63s", prop.name);
                snprintf(dev->kind, sizeof(dev->kind), "cuda");
                dev->memory_bytes = prop.totalGlobalMem;
                dev->sm_count = (uint32_t)prop.multiProcessorCount;
                if ((ce = cudaStreamCreateWithFlags(&cb->dev[d].stream, cudaStreamNonBlocking)) ||
                    (ce = cudaEventCreateWithFlags(&cb->dev[d].counted, cudaEventDisableTiming)) ||
                    (ce = cudaEventCreateWithFlags(&cb->dev[d].done, cudaEventDisableTiming)) ||
                    (ce = cudaEventCreate(&cb->dev[d].t0)) || (ce = cudaEventCreate(&cb->dev[d].t1)))
                        return cuda_fail(err, err_len, "stream/event creation", ce);
                for (int k = 0; k < TIMED_KINDS; k++) {
                        if (epd_k_timed_create(&cb->dev[d].timed[k]) < 0) {
                                snprintf(err, err_len, "out of memory");
                                return EPD_INTERNAL;
                        }
                        epd_k_timed_set_graphs(cb->dev[d].timed[k], cfg->cuda_graphs);
                }
                if (epd_k_preload() < 0)
                        return cuda_fail(err, err_len, "kernel preload", epd_k_last_cuda_error());
                /* Peer access to every device that allows it; a group spanning devices without
                 * it is refused at bind time. */
                for (int p = 0; p < cb->num_devices; p++) {
                        int can = 0;
                        if (p == d)
                                continue;
                        cudaDeviceCanAccessPeer(&can, d, p);
                        if (can) {
                                ce = cudaDeviceEnablePeerAccess(p, 0);
                                if (ce != cudaSuccess && ce != cudaErrorPeerAccessAlreadyEnabled)
                                        log_warning("peer access %d->%d: %s, ignoring", d, p,
                                                    cudaGetErrorString(ce));
                                cudaGetLastError();
                        }
                }
        }
        cudaSetDevice(0);
        cudaEventCreateWithFlags(&cb->prefixed, cudaEventDisableTiming);
        CUmemAllocationProp prop = { 0 };
        size_t gran = 0;
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        if (epd_cudrv()->MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ==
            CUDA_SUCCESS)
                cb->granularity = gran;
        pthread_mutex_init(&cb->lock, NULL);
        cb->executor.b = b;
        cb->executor.run = cuda_run;
        cb->executor.idle = cuda_idle;
        cb->executor.ctx = cb;
        cb->executor.spin_ns = epd_config_poll_ns(cfg);
        /* Every group's ops share one executor thread and one stream per device: an op queued
         * on a stream behind a wait for a client that never marks its inputs ready would hold
         * every other group's ops until the op timeout. So the executor runs an op only once
         * the host sees its inputs ready, and ops of other groups go first meanwhile
         * (executor.c, take_ready); queue_input_waits then finds every wait satisfied. */
        cb->executor.host_input_waits = 1;
        if (epd_executor_start(&cb->executor) < 0) {
                snprintf(err, err_len, "cannot start the executor thread");
                return EPD_INTERNAL;
        }
        log_info("cuda backend devices=%d cuda_graphs=%s", cb->num_devices,
                 cfg->cuda_graphs ? "on" : "off");
        if (!cfg->cuda_graphs)
                log_notice("cuda_graphs = off: one-kernel ops are sent as record, launch, record; "
                           "their kernel times include the host's launch call");
        return 0;
}

static void cuda_fini(struct epdd_backend *b)
{
        struct cuda_backend *cb = b->priv;

        if (!cb)
                return;
        epd_executor_stop(&cb->executor);
        trim_spares(cb, 0);
        for (int d = 0; d < cb->num_devices; d++) {
                cudaSetDevice(d);
                for (int k = 0; k < TIMED_KINDS; k++)
                        epd_k_timed_destroy(cb->dev[d].timed[k]);
        }
        free(cb->spare);
        free(cb);
        b->priv = NULL;
}

static int epd_cuda_peer_ok(struct epdd_backend *b, uint32_t a, uint32_t d)
{
        int can = 0;

        (void)b;
        if (a == d)
                return 1;
        cudaDeviceCanAccessPeer(&can, (int)a, (int)d);
        return can;
}

static int cuda_region_import(struct epdd_backend *b, struct epdd_mem *r, int fd,
                              const void *ipc_handle, size_t ipc_len, uint64_t offset, char *err,
                              size_t err_len)
{
        struct cuda_backend *cb = b->priv;
        struct cuda_region *cr = calloc(1, sizeof(*cr));
        cudaError_t ce;
        CUresult res;
        int rc = EPD_INVALID_ARGUMENT;

        if (!cr) {
                if (fd >= 0)
                        close(fd);
                return EPD_INTERNAL;
        }
        cr->kind = r->kind;
        cudaSetDevice((int)r->device);
        switch (r->kind) {
        case EPD_REGION_HOST_MEMFD:
                rc = epd__memfd_map(fd, offset, r->size, &r->base, &cr->lead, err, err_len);
                if (rc < 0)
                        break;
                /* Portable: every device's kernels may reach it; mapped: through UVA. */
                ce = cudaHostRegister(r->base - cr->lead, cr->lead + r->size,
                                      cudaHostRegisterPortable | cudaHostRegisterMapped);
                if (ce != cudaSuccess) {
                        epd__memfd_unmap(r->base, cr->lead, r->size);
                        rc = cuda_fail(err, err_len, "cudaHostRegister", ce);
                        break;
                }
                rc = 0;
                break;
        case EPD_REGION_CUDA_IPC: {
                cudaIpcMemHandle_t h;
                void *p;
                CUdeviceptr abase;
                size_t asize;
                if (ipc_len != sizeof(h)) {
                        snprintf(err, err_len, "CUDA IPC handle must be %zu bytes, got %zu",
                                 sizeof(h), ipc_len);
                        break;
                }
                memcpy(&h, ipc_handle, sizeof(h));
                ce = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
                if (ce != cudaSuccess) {
                        rc = cuda_fail(err, err_len, "cudaIpcOpenMemHandle", ce);
                        break;
                }
                if (epd_cudrv()->MemGetAddressRange(&abase, &asize, (CUdeviceptr)(uintptr_t)p) !=
                            CUDA_SUCCESS ||
                    offset > asize || r->size > asize - offset) {
                        snprintf(err, err_len,
                                 "region of %llu bytes at offset %llu exceeds the IPC allocation",
                                 (unsigned long long)r->size, (unsigned long long)offset);
                        cudaIpcCloseMemHandle(p);
                        break;
                }
                cr->ipc_ptr = p;
                r->base = (uint8_t *)p + offset;
                rc = 0;
                break;
        }
        case EPD_REGION_CUMEM_FD: {
                uint64_t g = cb->granularity ? cb->granularity : (2u << 20);
                uint64_t size = (offset + r->size + g - 1) / g * g;
                CUmemAccessDesc acc[MAX_DEVICES];
                int n = 0;
                res = epd_cudrv()->MemImportFromShareableHandle(&cr->mem, (void *)(uintptr_t)fd,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
                if (res != CUDA_SUCCESS) {
                        rc = cu_fail(err, err_len, "cuMemImportFromShareableHandle", res);
                        break;
                }
                res = epd_cudrv()->MemAddressReserve(&cr->va, size, g, 0, 0);
                if (res == CUDA_SUCCESS)
                        res = epd_cudrv()->MemMap(cr->va, size, 0, cr->mem, 0);
                if (res != CUDA_SUCCESS) {
                        if (cr->va)
                                epd_cudrv()->MemAddressFree(cr->va, size);
                        epd_cudrv()->MemRelease(cr->mem);
                        rc = cu_fail(err, err_len,
                                     "mapping the cuMem allocation (is the size right?)", res);
                        break;
                }
                for (int d = 0; d < cb->num_devices; d++) {
                        if (!epd_cuda_peer_ok(b, r->device, (uint32_t)d))
                                continue;
                        acc[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                        acc[n].location.id = d;
                        acc[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                        n++;
                }
                res = epd_cudrv()->MemSetAccess(cr->va, size, acc, (size_t)n);
                if (res != CUDA_SUCCESS) {
                        epd_cudrv()->MemUnmap(cr->va, size);
                        epd_cudrv()->MemAddressFree(cr->va, size);
                        epd_cudrv()->MemRelease(cr->mem);
                        rc = cu_fail(err, err_len, "cuMemSetAccess", res);
                        break;
                }
                cr->va_size = size;
                r->base = (uint8_t *)(uintptr_t)cr->va + offset;
                rc = 0;
                break;
        }
        default:
                snprintf(err, err_len, "unknown region kind %d", (int)r->kind);
        }
        if (fd >= 0)
                close(fd);
        if (rc < 0) {
                free(cr);
                return rc;
        }
        r->backend_state = cr;
        return 0;
}

static void cuda_region_release(struct epdd_backend *b, struct epdd_mem *r)
{
        struct cuda_region *cr = r->backend_state;

        (void)b;
        if (!cr)
                return;
        switch (cr->kind) {
        case EPD_REGION_HOST_MEMFD:
                cudaHostUnregister(r->base - cr->lead);
                epd__memfd_unmap(r->base, cr->lead, r->size);
                break;
        case EPD_REGION_CUDA_IPC:
                cudaIpcCloseMemHandle(cr->ipc_ptr);
                break;
        case EPD_REGION_CUMEM_FD:
                epd_cudrv()->MemUnmap(cr->va, cr->va_size);
                epd_cudrv()->MemAddressFree(cr->va, cr->va_size);
                epd_cudrv()->MemRelease(cr->mem);
                break;
        }
        free(cr);
        r->backend_state = NULL;
        r->base = NULL;
}

static int cuda_arena_map(struct epdd_backend *b, uint32_t device, int host_memory, uint8_t *addr,
                          uint64_t bytes, int *fd, enum epd_region_kind *kind, char *err,
                          size_t err_len)
{
        cudaError_t ce;
        int rc;

        (void)b;
        if (!host_memory) {
                /* Device arenas exported as cuMem fds come with client-executed mode; until
                 * then a CUDA-capable client also gets a host arena the GPUs can reach. */
                log_debug("device arena requested; using a host arena");
        }
        rc = epd__memfd_segment(addr, bytes, fd, err, err_len);
        if (rc < 0)
                return rc;
        /* Each segment is registered on its own; the kernels address the arena through its
         * host addresses (unified addressing), so placements may straddle segments. */
        cudaSetDevice((int)device);
        ce = cudaHostRegister(addr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
        if (ce != cudaSuccess) {
                epd__memfd_segment_drop(addr, bytes);
                close(*fd);
                *fd = -1;
                return cuda_fail(err, err_len, "cudaHostRegister of an arena segment", ce);
        }
        *kind = EPD_REGION_HOST_MEMFD;
        return 0;
}

static void cuda_arena_unmap(struct epdd_backend *b, uint8_t *addr, uint64_t bytes)
{
        (void)b;
        cudaHostUnregister(addr);
        epd__memfd_segment_drop(addr, bytes);
}

/* A client-executed group's buffers: one cuMem allocation on the device, exported as a POSIX
 * fd that each client imports and maps on its own device, and mapped here for the devices with
 * peer access to it (the daemon itself only copies header words in and out). */
struct cuda_cx {
        CUdeviceptr va;
        size_t size;
        int device;
};

static int cuda_cx_alloc(struct epdd_backend *b, uint32_t device, uint64_t bytes, uint8_t **host,
                         void **state, int *fd, enum epd_region_kind *kind, char *err,
                         size_t err_len)
{
        struct cuda_backend *cb = b->priv;
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp prop;
        CUmemAccessDesc acc[MAX_DEVICES];
        struct cuda_cx *cx;
        size_t gran = 0;
        CUresult r;
        int n = 0, shared_fd = -1;

        if (!epd_cudrv()) {
                snprintf(err, err_len, "the CUDA driver API is not available");
                return EPD_UNAVAILABLE;
        }
        memset(&prop, 0, sizeof(prop));
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = (int)device;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        r = epd_cudrv()->MemGetAllocationGranularity(&gran, &prop,
                                                     CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        if (r != CUDA_SUCCESS || gran == 0)
                return cu_fail(err, err_len, "cuMemGetAllocationGranularity", r);
        cx = calloc(1, sizeof(*cx));
        if (!cx) {
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        cx->device = (int)device;
        cx->size = (bytes + gran - 1) / gran * gran;
        r = epd_cudrv()->MemCreate(&h, cx->size, &prop, 0);
        if (r != CUDA_SUCCESS) {
                free(cx);
                return cu_fail(err, err_len, "cuMemCreate of a client-executed group's buffers",
                               r);
        }
        r = epd_cudrv()->MemExportToShareableHandle(&shared_fd, h,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (r == CUDA_SUCCESS)
                r = epd_cudrv()->MemAddressReserve(&cx->va, cx->size, gran, 0, 0);
        if (r == CUDA_SUCCESS)
                r = epd_cudrv()->MemMap(cx->va, cx->size, 0, h, 0);
        /* The mapping (and the clients' imports) hold the memory from here on. */
        epd_cudrv()->MemRelease(h);
        for (int d = 0; r == CUDA_SUCCESS && d < cb->num_devices; d++) {
                if (!epd_cuda_peer_ok(b, device, (uint32_t)d))
                        continue;
                acc[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                acc[n].location.id = d;
                acc[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                n++;
        }
        if (r == CUDA_SUCCESS)
                r = epd_cudrv()->MemSetAccess(cx->va, cx->size, acc, (size_t)n);
        if (r != CUDA_SUCCESS) {
                if (cx->va) {
                        epd_cudrv()->MemUnmap(cx->va, cx->size);
                        epd_cudrv()->MemAddressFree(cx->va, cx->size);
                }
                if (shared_fd >= 0)
                        close(shared_fd);
                free(cx);
                return cu_fail(err, err_len, "exporting a client-executed group's buffers", r);
        }
        *host = NULL;
        *state = cx;
        *fd = shared_fd;
        *kind = EPD_REGION_CUMEM_FD;
        return 0;
}

static void cuda_cx_free(struct epdd_backend *b, uint8_t *host, uint64_t bytes, void *state)
{
        struct cuda_cx *cx = state;

        (void)b;
        (void)host;
        (void)bytes;
        if (!cx)
                return;
        epd_cudrv()->MemUnmap(cx->va, cx->size);
        epd_cudrv()->MemAddressFree(cx->va, cx->size);
        free(cx);
}

static int cuda_cx_copy(struct epdd_backend *b, void *state, uint64_t offset, void *host,
                        uint64_t bytes, int to_buffers)
{
        struct cuda_cx *cx = state;
        void *dev = (void *)(uintptr_t)(cx->va + offset);
        cudaError_t ce;

        (void)b;
        if (offset > cx->size || bytes > cx->size - offset)
                return EPD_INTERNAL;
        cudaSetDevice(cx->device);
        /* Synchronous and ordered with nothing but itself: the clients' kernels may run; the
         * words written here are the ones they poll. */
        ce = to_buffers ? cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice)
                        : cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess) {
                log_warning("client-executed buffers: cudaMemcpy: %s", cudaGetErrorString(ce));
                cudaGetLastError();
                return EPD_INTERNAL;
        }
        return 0;
}

static int cuda_host_register(struct epdd_backend *b, void *ptr, uint64_t bytes, void **dev)
{
        cudaError_t ce;

        (void)b;
        ce = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
        if (ce == cudaSuccess)
                ce = cudaHostGetDevicePointer(dev, ptr, 0);
        if (ce != cudaSuccess) {
                log_warning("cannot register a doorbell page: %s", cudaGetErrorString(ce));
                cudaGetLastError();
                return EPD_UNAVAILABLE;
        }
        return 0;
}

static void cuda_host_unregister(struct epdd_backend *b, void *ptr)
{
        (void)b;
        cudaHostUnregister(ptr);
}

static void cuda_submit(struct epdd_backend *b, struct epdd_exec *ex)
{
        struct cuda_backend *cb = b->priv;

        epd_executor_submit(&cb->executor, ex);
}

static void cuda_handle_free(struct epdd_backend *b, void *state)
{
        struct cuda_backend *cb = b->priv;
        struct cuda_handle *ch = state;

        if (!ch)
                return;
        pthread_mutex_lock(&cb->lock);
        if (cb->num_spare == cb->cap_spare) {
                unsigned cap = cb->cap_spare ? cb->cap_spare * 2 : 16;
                struct spare_ws *n = realloc(cb->spare, cap * sizeof(*n));
                if (n) {
                        cb->spare = n;
                        cb->cap_spare = cap;
                }
        }
        /* Without room (out of memory) the workspace leaks rather than being freed on the
         * loop thread, which must not synchronise the device. */
        if (cb->num_spare < cb->cap_spare)
                cb->spare[cb->num_spare++] = (struct spare_ws){ ch->ws, ch->layout.total_bytes,
                                                                ch->device };
        const int trim = cb->num_spare > SPARE_KEEP;
        pthread_mutex_unlock(&cb->lock);
        if (trim)
                epd_executor_kick(&cb->executor);
        free(ch);
}

static int cuda_check_alive(struct epdd_backend *b)
{
        struct cuda_backend *cb = b->priv;

        return epd_executor_alive(&cb->executor);
}

const struct epdd_backend_ops epd_backend_cuda_ops = {
        .name = "cuda",
        .init = cuda_init,
        .fini = cuda_fini,
        .region_import = cuda_region_import,
        .region_release = cuda_region_release,
        .arena_map = cuda_arena_map,
        .arena_unmap = cuda_arena_unmap,
        .cx_alloc = cuda_cx_alloc,
        .cx_free = cuda_cx_free,
        .cx_copy = cuda_cx_copy,
        .host_register = cuda_host_register,
        .host_unregister = cuda_host_unregister,
        .submit = cuda_submit,
        .handle_free = cuda_handle_free,
        .check_alive = cuda_check_alive,
        .devices_connected = epd_cuda_peer_ok,
};
