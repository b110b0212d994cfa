/* backend.h - the interface between the daemon core and an execution backend (host, cuda).
 *
 * The core (loop thread) resolves every tensor of an op to a backend address and a row stride,
 * checked against its region, and hands the backend one struct epdd_exec per op. The backend runs
 * it on its own threads and calls epd_exec_done from any thread; the core then sees the result on
 * the loop thread. A backend never touches daemon objects other than the exec it was given and
 * the arenas named in it.
 */
#ifndef EPD_DAEMON_BACKEND_H
#define EPD_DAEMON_BACKEND_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "arena.h"
#include "config.h"
#include "doorbell.h"
#include "epd.h"
#include "mat.h"
#include "list.h"
#include "oprec.h"

/* A group's fixed configuration, as the core checks ops against it and a backend sizes them. */
struct epdd_group_cfg {
        uint32_t world_size;
        uint32_t num_experts;
        uint32_t num_local_experts;
        uint32_t hidden;
        uint32_t max_tokens;
        uint32_t max_topk;
        enum epd_dtype dtype;
        uint32_t scale_block;
        uint32_t op_timeout_ms;
        uint64_t arena_bytes;
        uint64_t row_bytes;           /* bytes of one x row */
        uint64_t scale_cols;          /* fp32 scales per row, 0 for bf16 */
        /* Client-executed groups (docs/client-execution.md): the shape of their buffers. */
        enum epd_execution execution;
        uint32_t max_alignment;       /* 1 .. for client-executed groups */
        uint32_t block_rows;
        uint32_t quantize;
        uint32_t num_handles;
        uint32_t sms_per_rank;
        uint32_t recv_rows;           /* rows of each rank's receive area (0 asked: worst case) */
        uint64_t cx_bytes;            /* one rank's buffer (cx_layout_compute), 0 in daemon mode */
};

/* What an op does: the op record's kinds (common/oprec.h). */
enum epdd_op_kind {
        EPD_OP_DISPATCH = EPD_OPREC_DISPATCH, /* the record's kinds (common/oprec.h) */
        EPD_OP_COMBINE = EPD_OPREC_COMBINE,
};

/* Client memory as a backend sees it: region_import fills base and backend_state. The core's
 * region (core/core.h) embeds one. */
struct epdd_mem {
        enum epd_region_kind kind;
        uint64_t size;
        uint32_t device;
        uint8_t *base;                /* the address through which the backend reaches it */
        void *backend_state;
};

struct epdd_device_desc {
        uint32_t index;
        char uuid[64];
        char name[64];
        char kind[16];
        uint64_t memory_bytes;
        uint32_t sm_count;            /* cuda: multiprocessors; 0 on the host backend */
};

/* Per-rank part of an exec. Pointers are backend addresses, already bounds-checked. */
struct epdd_exec_rank {
        uint32_t num_tokens;
        uint32_t device;
        /* dispatch inputs */
        struct epd_dispatch_src_io src;
        const uint8_t *topk_idx;      /* NULL for cached dispatch */
        uint64_t topk_stride;         /* elements */
        /* dispatch outputs */
        struct epd_dispatch_dst_io dst;
        uint64_t capacity_rows;       /* smallest capacity among the rank's outputs */
        int use_arena;
        struct epdd_arena *arena;
        /* Placement in the arena: filled by the backend for a new placement, or given (used set)
         * when a cached dispatch reuses its handle's placement. On failure the backend releases
         * any placement it made. */
        struct epdd_arena_place place;
        int place_new;                /* place was made by this op (released if it fails) */
        /* combine */
        struct epd_mat y;
        uint64_t y_rows;              /* rows the client declared for y */
        struct epd_combine_src_io comb;
        struct epd_mat recv_weights;  /* fp32 [y_rows, K_op] when the exec's recv_weights */
        /* Stream ordering (common/doorbell.h). */
        struct epd_doorbell *doorbell;  /* host address of the rank's doorbell */
        void *doorbell_dev;             /* device address, cuda backend */
        uint64_t completed_value;       /* value of `completed` once this op is done */
        uint64_t wait_inputs;           /* 0, or wait for inputs_ready >= this first */
        /* results of a dispatch, filled by the backend */
        int32_t num_recv_tokens;
        int32_t num_expanded_rows;
        int32_t *per_expert;          /* [L] */
        int32_t *per_expert_aligned;  /* [L] */
        int32_t *rank_prefix;         /* [R+1] */
};

struct epdd_exec {
        void *owner;                  /* the core's op; the backend does not use it */
        enum epdd_op_kind kind;
        struct epdd_group_cfg cfg;
        uint32_t num_topk;
        enum epd_dtype topk_dtype;
        enum epd_layout layout;
        uint32_t expert_alignment;
        int zero_padding;
        int has_weights;
        int apply_weights;
        int recv_weights;             /* combine: ranks[].recv_weights given (NON_EXPAND) */
        void *handle_state;           /* combine / cached dispatch: the handle's state */
        void *new_handle_state;       /* dispatch: state produced for the new handle */
        struct epdd_exec_rank *ranks;  /* [R] */
        /* Result, written by the backend before epd_exec_done. */
        int status;
        char message[512];
        uint64_t exec_start_ns;       /* when the executor began it (CLOCK_MONOTONIC) */
        uint64_t exec_ns;
        uint64_t kernel_ns;           /* GPU time of the op's kernels (cuda), else 0 */
        uint64_t bytes;               /* floor bytes moved, for statistics */
        uint64_t timeout_ns;          /* the group's op timeout, for waits on clients */
        uint64_t submit_ns;           /* when the backend got it: the input wait's deadline */
        /* Set by the loop thread (epd_exec_abort): a status the exec ends with if it has not
         * started running yet (a rank was lost, the daemon is stopping). */
        atomic_int abort_status;
        struct epd_list link;         /* completion queue */
};

struct epdd_backend;

struct epdd_backend_ops {
        const char *name;
        int (*init)(struct epdd_backend *b, const struct epdd_config *cfg, char *err,
                    size_t err_len);
        void (*fini)(struct epdd_backend *b);
        /* Maps or imports a client allocation; sets r->base and r->backend_state. Consumes fd
         * (closes it) in every case. */
        int (*region_import)(struct epdd_backend *b, struct epdd_mem *r, int fd,
                             const void *ipc_handle, size_t ipc_len, uint64_t offset,
                             char *err, size_t err_len);
        void (*region_release)(struct epdd_backend *b, struct epdd_mem *r);
        /* Maps one segment of an output arena (arena.h) for a rank on a device: new memory of
         * `bytes` at `addr` (page aligned, inside the arena's reserved range, which it
         * replaces) that the backend's devices can reach, and an fd the client can map (kind
         * says how). host_memory: the client cannot map device memory (it announced no CUDA
         * capability), so the segment must be host memory. Loop thread. */
        int (*arena_map)(struct epdd_backend *b, uint32_t device, int host_memory, uint8_t *addr,
                         uint64_t bytes, int *fd, enum epd_region_kind *kind, char *err,
                         size_t err_len);
        /* Undoes arena_map: the range becomes reserved address space again. The caller closes
         * the fd. No op may use the range. Loop thread. */
        void (*arena_unmap)(struct epdd_backend *b, uint8_t *addr, uint64_t bytes);
        /* Client-executed groups: memory of `bytes` for the communication buffers of a group,
         * zeroed (host memory) or not (device memory), that clients map through *fd (kind
         * says how). *host is where the loop thread reads and writes it (the buffers' header
         * words), or NULL for device memory, which it reaches through cx_copy; *state is the
         * backend's. NULL: the backend has no client-executed mode. Loop thread. */
        int (*cx_alloc)(struct epdd_backend *b, uint32_t device, uint64_t bytes, uint8_t **host,
                        void **state, int *fd, enum epd_region_kind *kind, char *err,
                        size_t err_len);
        /* Frees what cx_alloc made; clients may still have it mapped (the memory lives on in
         * their mappings). The caller closes the fd. */
        void (*cx_free)(struct epdd_backend *b, uint8_t *host, uint64_t bytes, void *state);
        /* Copies bytes between the daemon's memory at host and the buffers at offset (to_buffers:
         * into them), for buffers without a host mapping; synchronous. 0 or EPD_INTERNAL. NULL
         * when cx_alloc always gives a host mapping. Loop thread. */
        int (*cx_copy)(struct epdd_backend *b, void *state, uint64_t offset, void *host,
                       uint64_t bytes, int to_buffers);
        /* Makes daemon host memory (a doorbell page) reachable by the backend's devices; *dev
         * is its device address, or NULL when the backend has no devices. */
        int (*host_register)(struct epdd_backend *b, void *ptr, uint64_t bytes, void **dev);
        void (*host_unregister)(struct epdd_backend *b, void *ptr);
        /* Starts an op; returns at once. Completion: epd_exec_done(ex) from any thread. */
        void (*submit)(struct epdd_backend *b, struct epdd_exec *ex);
        /* Frees a handle's state. Called on the loop thread when no op uses the handle. */
        void (*handle_free)(struct epdd_backend *b, void *state);
        /* Liveness of the backend's threads for the watchdog: 0 when every thread made progress
         * or is idle. */
        int (*check_alive)(struct epdd_backend *b);
        /* Whether ranks on devices a and b can be in one group (direct access between them).
         * NULL: always. */
        int (*devices_connected)(struct epdd_backend *b, uint32_t a, uint32_t b_dev);
};

struct epdd_backend {
        const struct epdd_backend_ops *ops;
        /* Up-calls, registered by the layers above before the first op (loop thread): the core
         * takes each completed exec; the network layer takes the requests posted in doorbell
         * pages (returns how many) and tells the pages whether the loop polls them. */
        void (*on_complete)(void *arg, struct epdd_exec *ex);
        void *complete_arg;
        unsigned (*poll_pages)(void *arg);
        void (*set_polling)(void *arg, int on);
        void *poll_arg;
        unsigned num_devices;
        struct epdd_device_desc devices[64];
        void *priv;
        /* Completion queue drained on the loop thread. */
        uv_async_t done_async;
        pthread_mutex_t done_lock;
        struct epd_list done;
        /* Loop-side polling (poll_us): while execs are in flight, and poll_ns after the last
         * one completed or an op's first request came, an active idle handle keeps uv_run from
         * sleeping, drains the completion queue and takes the requests posted in doorbell pages
         * on every turn. Loop thread only. */
        uv_idle_t poll_idle;
        uint64_t poll_ns, poll_until_ns;
        unsigned inflight;
        /* Polling stops while every exec in flight is one that has waited over
         * EPD_POLL_WAIT_NS for its inputs, as nothing then completes until a client marks its
         * inputs ready (the executor's completion wakes the loop anyway). */
        uint64_t last_submit_ns;      /* loop thread */
        atomic_int running;           /* the executor runs an exec (executor.c) */
};

/* How long an exec waits for its inputs before the loop thread stops polling for it and the
 * executor looks again only after growing pauses. */
#define EPD_POLL_WAIT_NS 2000000ull

/* Hands an exec to the backend (ops->submit) and starts the loop's polling. Loop thread. */
void epd_backend_submit(struct epdd_backend *b, struct epdd_exec *ex);
/* Keeps the loop polling for poll_ns from now: an op's first request came, and its other ranks'
 * requests are on their way. Loop thread. */
void epd_backend_poll_window(struct epdd_backend *b);

/* Without waiting: 1 when every rank's inputs are ready, 0 while some are not and now is before
 * deadline_ns, -1 (with ex->status TIMEOUT and its message) after it. */
int epd_exec_inputs_ready(struct epdd_exec *ex, uint64_t now_ns, uint64_t deadline_ns);
/* Asks an exec that waits for its turn or its inputs to end with status instead of running.
 * One that already runs finishes; the loop thread then reports what the group decided. */
void epd_exec_abort(struct epdd_exec *ex, int status);

/* exec_common.c: once every arena rank's num_recv_tokens / num_expanded_rows is set, places
 * the outputs of ranks without a placement and points every arena rank's outputs at it.
 * Returns 0, or -1 with ex->status CAPACITY_EXCEEDED (new placements released). */
int epd_exec_place_arenas(struct epdd_exec *ex);
void epd_exec_bind_arena(struct epdd_exec *ex, struct epdd_exec_rank *er);
/* Releases the placements this op made; idempotent. */
void epd_exec_release_new_arenas(struct epdd_exec *ex);

/* Picks and initialises the backend named by cfg->backend ("auto": cuda when a GPU is usable,
 * else host), with its handles on loop. */
int epd_backend_open(uv_loop_t *loop, const struct epdd_config *cfg, struct epdd_backend **out,
                     char *err, size_t err_len);
void epd_backend_close(struct epdd_backend *b);
/* Thread-safe completion: queues ex for the loop thread. */
void epd_exec_done(struct epdd_backend *b, struct epdd_exec *ex);

extern const struct epdd_backend_ops epd_backend_host_ops;
#ifdef EPD_HAVE_CUDA
extern const struct epdd_backend_ops epd_backend_cuda_ops;
#endif

#endif
