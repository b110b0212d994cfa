/* core.h - the daemon's object graph (docs/architecture.md, "Objects"): daemon, client, region,
 * group, rank binding, op, handle, and the core's functions on them. Every object here is owned and
 * touched by the libuv loop thread only; backends see copies of what they need (struct epdd_exec)
 * and report back through the completion hook the core registers with them.
 *
 * The core sits above daemon/base and daemon/backend and below daemon/net and the top level
 * (tests/unit/layers.sh checks it): it never sees a protobuf type and includes nothing of the
 * layers above. What it asks of them (sending a reply, waking a page, a resize waiting for the
 * group) goes through struct epdd_core_hooks, which they register.
 */
#ifndef EPD_DAEMON_CORE_H
#define EPD_DAEMON_CORE_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "cx_layout.h"
#include "doorbell.h"
#include "epd.h"
#include "list.h"
#include "oprec.h"
#include "stats.h"

struct epdd_client;
struct epdd_group;
struct epdd_resize;

/* Up-calls from the core to the layers above it, set by them before the loop runs. Loop
 * thread. */
struct epdd_core_hooks {
        /* Sends an op's reply record to client c: into `page` (the rank's doorbell page) when
         * given and it fits, else on the socket (daemon/net). */
        void (*reply_op)(struct epdd_client *c, struct epd_doorbell *page,
                         const struct epd_op_reply *rep);
        /* An op started: wake a client sleeping on its page until its reply (daemon/net). */
        void (*op_started)(struct epd_doorbell *page);
        /* A rank was bound to c with this page: tell the page what the loop does (daemon/net). */
        void (*page_bound)(struct epdd_client *c, struct epd_doorbell *page);
        /* The group's executing op completed: a resize may go on (resize.c). */
        void (*group_idle)(struct epdd_group *g);
        /* The group is going away: a pending resize ends (resize.c). */
        void (*group_closing)(struct epdd_group *g);
};

struct epdd_net;

/* The daemon. */
struct epdd_daemon {
        uv_loop_t *loop;
        struct epdd_config cfg;
        struct epdd_backend *backend;
        uint64_t epoch;               /* random per start, told to clients in Welcome */
        uint64_t start_ns;
        uint64_t fd_limit;            /* RLIMIT_NOFILE once raised (core/budget.c) */
        int shutting_down;            /* SIGTERM seen: no new ops, exit when drained */
        int draining;                 /* operator drain: no new ops are launched */
        uint64_t drain_start_ns;
        struct epd_list conns;        /* struct epdd_client */
        unsigned num_conns;
        uint64_t next_client_id;
        struct epd_list groups;
        unsigned num_groups;
        uint64_t next_group_id;
        uint64_t next_region_id;
        struct epdd_daemon_stats stats;
        struct epdd_core_hooks hooks;
        struct epdd_net *net;         /* the network layer's state (net/net.h); opaque here */
};

/* A client's registered memory: what the backend reached it through (mem.base: host mapping or
 * device VA) and who holds it. Referenced by its owner's table and by every exec using it, so a
 * disconnect never unmaps memory that an op in flight still writes. */
struct epdd_region {
        struct epdd_mem mem;          /* kind, size, device, base, backend_state */
        uint64_t id;
        struct epdd_client *owner;    /* NULL once the owner is gone */
        unsigned refs;
        int is_arena;                 /* daemon-owned arena: memory freed with its group */
        struct epd_list conn_link;
};

/* A client as the core knows it: its identity, regions, rank bindings and outstanding ops. The
 * network layer's connection (net/net.h, struct epdd_conn) embeds it. */
struct epdd_client {
        struct epdd_daemon *daemon;
        uint64_t id;
        pid_t pid;
        uid_t uid;
        gid_t gid;
        int admin;                    /* root or member of admin_group */
        int cuda_capable;             /* announced CAP_CUDA_REGIONS: can map device memory */
        char name[64];
        int closing;                  /* its connection is closing: no more replies */
        struct epd_list regions;
        /* The same regions by id (registry.c): open addressing, at most half full. */
        struct epdd_region **region_slots;
        uint32_t region_cap, region_count;
        unsigned num_regions;         /* client-registered ones (arenas not counted) */
        uint64_t region_bytes;
        struct epd_list bindings;     /* struct epdd_binding */
        unsigned num_bindings;
        unsigned wrong_secrets;       /* GroupJoins refused for their secret */
        unsigned outstanding_ops;
        struct epd_list link;         /* in the daemon's conns */
        struct epdd_client_stats stats;
};

enum epdd_group_state {
        EPD_GROUP_FORMING,
        EPD_GROUP_READY,
        EPD_GROUP_DRAINING,
        EPD_GROUP_BROKEN,
        EPD_GROUP_CLOSED,
};

struct epdd_binding {
        struct epd_list conn_link;
        struct epdd_group *group;
        uint32_t rank;
};

struct epdd_rank {
        struct epdd_client *conn;      /* NULL when unbound */
        struct epdd_binding *binding;
        uint32_t device;
        uint64_t next_op;
        struct epdd_arena *arena;      /* daemon-owned output arena, exported to the client */
        uint64_t arena_region_id;     /* the arena in the bound client's region table */
        struct epd_doorbell *doorbell; /* this binding's doorbell page (common/doorbell.h) */
        int doorbell_fd;
        struct epdd_retired *doorbell_retired; /* the record that retires it (group.c),
                                               * allocated with it so retiring cannot fail */
        void *doorbell_dev;           /* its device address (cuda backend), else NULL */
        uint64_t mailbox_id;          /* request whose reply goes into the page; 0: none */
        uint64_t completed;           /* ops of this binding finished, as in the doorbell */
        uint64_t submitted;           /* submissions of this binding, accepted or refused */
        uint64_t *refused;            /* sequence numbers of refused submissions not yet counted */
        unsigned num_refused, cap_refused;
        int arena_host;               /* the arena is host memory */
        struct epdd_rank_stats stats;
};

struct epdd_handle_rank {
        uint32_t num_tokens;
        int64_t rows;                 /* rows of the layout at this destination */
        int released;
        struct epdd_arena_place arena;
};

/* Routing state produced by a dispatch (docs/architecture.md, "Objects"). The backend owns
 * `state`. */
struct epdd_handle {
        struct epd_list link;
        uint64_t id;
        enum epd_layout layout;
        enum epd_dtype topk_dtype;
        uint32_t num_topk;
        int has_weights;
        struct epdd_handle_rank *ranks; /* [R] */
        void *state;
        int busy;                     /* an op using it is executing */
        uint64_t epoch;               /* group epoch it was made in */
};

struct epdd_submission {
        int arrived;
        uint64_t request_id;
        struct epdd_client *conn;
        uint64_t submitted_ns;
        uint64_t seq;                 /* the rank's submission number (doorbell) */
        int mailbox;                  /* the reply goes into the rank's doorbell page */
        struct epd_op_request req;    /* the decoded request record */
};

enum epdd_op_state {
        EPD_OP_COLLECTING,            /* waiting for ranks */
        EPD_OP_QUEUED,                /* every rank arrived; waits for earlier ops */
        EPD_OP_EXECUTING,
        EPD_OP_FINISHED,              /* failed before launch; answers late arrivals */
};

struct epdd_op {
        struct epd_list link;
        struct epdd_group *group;
        uint64_t number;
        enum epdd_op_kind kind;
        enum epdd_op_state state;
        uint32_t arrived;
        int status;
        char message[512];
        struct epdd_submission *subs;  /* [R] */
        uv_timer_t timer;
        int timer_active;
        struct epdd_exec *exec;
        struct epdd_handle *handle;    /* handle the executing op reads or refreshes */
        struct epdd_region **refs;     /* regions the executing op uses */
        unsigned num_refs;
        uint64_t epoch;               /* group epoch at launch */
        uint64_t launch_ns;
        uint64_t completed_ns;        /* the loop thread took the completion */
};

/* A client-executed group's communication buffers (docs/client-execution.md): rank r's buffer
 * is at host + r * stride, laid out by common/cx_layout.h. The daemon writes only the header
 * words it owns (epoch, abort, drain) and reads the statistics. */
/* Client memory one rank registered with a client-executed group (host backend): a dup of the
 * client's memfd, handed to every peer that asks (CxMemory). */
struct epdd_cx_mem {
        int fd;
        uint64_t offset, bytes, fd_bytes;
};

struct epdd_cx {
        /* Registrations per rank, in order: the k-th of every rank is registration k. A
         * re-forming forgets them all (cx_mem_forget). */
        struct epdd_cx_mem mem[CX_MAX_RANKS][CX_MAX_MEMORY];
        uint32_t num_mem[CX_MAX_RANKS];
        struct cx_layout layout;
        uint64_t stride;              /* bytes between ranks' buffers (page multiple) */
        uint64_t bytes;               /* R * stride */
        uint8_t *host;                /* the loop thread's mapping of all R buffers, or NULL
                                       * (device memory: the backend's cx_copy reaches it) */
        uint32_t device;              /* where they live */
        void *state;                  /* the backend's */
        int fd;                       /* exported at join */
        enum epd_region_kind kind;
        uint64_t epoch;               /* the buffers' current epoch, < 2^24 */
        int aborted;                  /* the abort word is set in every buffer */
        int drained;                  /* the drain word is set in every buffer */
};

struct epdd_group {
        struct epd_list link;
        struct epdd_daemon *daemon;
        uint64_t id;
        char name[64];
        uid_t owner_uid;              /* its creator's: names and group budgets are per uid */
        uint8_t secret[64];
        size_t secret_len;
        struct epdd_group_cfg cfg;
        enum epdd_group_state state;
        struct epdd_rank *ranks;       /* [R] */
        uint32_t num_bound;
        struct epd_list ops;          /* by number */
        struct epdd_op *executing;
        struct epd_list handles;
        unsigned num_handles;
        uint64_t next_handle_id;
        uint64_t epoch;               /* bumped when the group breaks: old handles die */
        int free_pending;             /* destroy once the executing op completes */
        struct epd_list retired;      /* doorbell pages and arenas of past bindings that the
                                       * executing op may still use */
        uint64_t retired_arena_bytes; /* the mapped bytes of those arenas (group budgets) */
        struct epdd_resize *resize;    /* pending `epctl resize` (resize.c): no op is launched */
        struct epdd_cx *cx;            /* client-executed groups' buffers, else NULL */
        struct epdd_group_stats stats;
};

/* registry.c */
/* A region to register, as the client described it. */
struct epdd_region_args {
        enum epd_region_kind kind;
        uint64_t size;
        uint32_t device;
        const void *ipc_handle;       /* CUDA IPC: the handle's bytes */
        size_t ipc_len;
        uint64_t offset;              /* of the registered range inside the shared allocation */
};
int epd_region_register(struct epdd_client *c, const struct epdd_region_args *ra, int fd,
                        uint64_t *region_id, char *err, size_t err_len);
int epd_region_release_id(struct epdd_client *c, uint64_t region_id);
void epd_region_release_all(struct epdd_client *c);
void epd_region_detach(struct epdd_client *c, struct epdd_region *r);
int epd_region_add_arena(struct epdd_client *c, struct epdd_arena *arena, uint32_t device,
                         uint64_t *region_id);
struct epdd_region *epd_region_find(struct epdd_client *c, uint64_t region_id);
void epd_region_ref(struct epdd_region *r);
void epd_region_unref(struct epdd_daemon *d, struct epdd_region *r);
/* Adds r (id set) to c's list and lookup table; the caller counts it. Returns 0, or
 * EPD_INTERNAL when the table cannot grow (r is then not added). */
int epd_region_attach(struct epdd_client *c, struct epdd_region *r);
/* Checks that `tensor` (rows x cols of dtype, row stride from strides[0]) lies inside the
 * client's region and returns the backend address of its first byte and its row stride in
 * bytes. rows is the number of rows the op will touch (capacity for outputs). */
int epd_region_resolve(struct epdd_client *c, const struct epd_tensor *tensor, uint64_t rows,
                       uint64_t cols, struct epdd_region **region, uint8_t **ptr,
                       uint64_t *row_stride, char *err, size_t err_len);

/* group.c */
/* Doorbell bookkeeping (common/doorbell.h): every submission of a rank gets a sequence number;
 * `completed` counts the first n that have finished, whatever their status. */
uint64_t epd_group_rank_submitted(struct epdd_group *g, uint32_t rank);
void epd_group_rank_op_finished(struct epdd_group *g, uint32_t rank, uint64_t seq);
void epd_group_rank_refused(struct epdd_group *g, uint32_t rank);
/* Frees the doorbell pages and arenas of past bindings (no op executing). */
void epd_group_free_retired(struct epdd_group *g);
struct epdd_group *epd_group_find(struct epdd_daemon *d, uint64_t id);
struct epdd_group *epd_group_find_name(struct epdd_daemon *d, const char *name);
/* Checks a configuration as the client gave it (cfg's derived fields are filled here). */
int epd_group_cfg_check(const struct epdd_daemon *d, struct epdd_group_cfg *cfg, char *err,
                        size_t err_len);
/* Names are per uid (the creator's): owner's group of that name, or NULL. */
struct epdd_group *epd_group_find_name_of(struct epdd_daemon *d, uid_t owner, const char *name);
/* The group a join names: uid's own group of that name if there is one, else another uid's
 * whose secret matches. NULL when none matches; *named then tells a wrong secret (1) from a
 * name no group has (0). */
struct epdd_group *epd_group_find_for_join(struct epdd_daemon *d, uid_t uid, const char *name,
                                           const void *secret, size_t secret_len, int *named);
int epd_group_new(struct epdd_daemon *d, uid_t owner, const char *name, const void *secret,
                  size_t secret_len, const struct epdd_group_cfg *cfg, struct epdd_group **out,
                  char *err, size_t err_len);
/* mps: the client reported CUDA MPS on the device (client-executed groups share a GPU only
 * under it). */
int epd_group_bind(struct epdd_group *g, struct epdd_client *c, uint32_t rank, uint32_t device,
                   int mps, char *err, size_t err_len);
/* Unbinds a rank. lost != 0: the client vanished (the group breaks); else it left politely. */
void epd_group_unbind(struct epdd_group *g, uint32_t rank, int lost);
void epd_group_maybe_free(struct epdd_group *g);
/* Client-executed groups. */
/* Stops (on) or resumes the group's ops at an op boundary every rank observes: the drain word
 * of every buffer (docs/client-execution.md, "Drain"). */
void epd_group_cx_drain(struct epdd_group *g, int on);
/* CxMemory: registers client memory of a rank bound to c (fd taken: set to -1 when kept), or
 * looks up a peer's part of a registration. Returns 0 with *index, *mem filled, or a negative
 * status with err. */
int epd_group_cx_memory(struct epdd_group *g, struct epdd_client *c, int reg, uint32_t rank,
                        uint32_t index, uint32_t peer, int *fd, uint64_t offset, uint64_t bytes,
                        uint32_t *out_index, const struct epdd_cx_mem **mem, char *err,
                        size_t err_len);
/* Reads the statistics of rank r's buffer. */
void epd_group_cx_stats(const struct epdd_group *g, uint32_t rank, struct cx_stats *out);
const char *epd_group_state_name(enum epdd_group_state s);

/* handle.c: handle lifetime */
struct epdd_handle *epd_group_handle_find(struct epdd_group *g, uint64_t id);
void epd_group_handle_release(struct epdd_group *g, struct epdd_handle *h, uint32_t rank);
void epd_group_handle_free(struct epdd_group *g, struct epdd_handle *h);
int epd_group_handle_all_released(const struct epdd_group *g, const struct epdd_handle *h);
/* A dispatch's new handle from its exec, or NULL when out of memory. */
struct epdd_handle *epd_handle_new(struct epdd_group *g, struct epdd_exec *ex);
/* Records what the dispatch of ex left in h: token counts, rows and arena placements. */
void epd_handle_record(struct epdd_group *g, struct epdd_handle *h, const struct epdd_exec *ex);
/* A rank releases handle `handle_id` (HandleRelease): 0, or EPD_NOT_FOUND with err set. */
int epd_handle_release_rank(struct epdd_group *g, uint32_t rank, uint64_t handle_id, char *err,
                            size_t err_len);

/* op.c: sequencing */
/* Files rank's submission of its next op; the op keeps a copy of req. */
void epd_op_submit(struct epdd_group *g, uint32_t rank, struct epdd_client *c,
                   const struct epd_op_request *req);
/* Fails every op of the group that has not launched with status/message, and aborts the one in
 * the backend (epd_op_abort_executing). */
void epd_op_fail_pending(struct epdd_group *g, int status, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
/* Aborts the group's op in the backend, if any, with status (epd_exec_abort): it ends without
 * waiting for what it waits for. */
void epd_op_abort_executing(struct epdd_group *g, int status);
/* The backend's completion, on the loop thread (registered as the backend's on_complete). */
void epd_op_complete(void *daemon, struct epdd_exec *ex);
void epd_op_kick(struct epdd_group *g);       /* launch queued ops if possible */
/* Removes every op that is not executing (the group is going away); no replies. */
void epd_op_destroy_all(struct epdd_group *g);

/* prep.c: validation. Checks an op whose every rank arrived (consistency across ranks, each
 * rank's tensors against its regions) and fills ex; takes references on the regions it resolves
 * (refs, num_refs). 0, or a negative status with the message in err. */
int epd_op_prepare(struct epdd_op *op, struct epdd_exec *ex, struct epdd_region ***refs,
                   unsigned *num_refs, char *err, size_t err_len);

/* opstats.c: the statistics an op leaves */
/* An op that failed before it ran, once; and each rank that had submitted it. */
void epd_opstats_op_failed(struct epdd_group *g);
void epd_opstats_rank_failed(struct epdd_group *g, uint32_t rank, enum epdd_op_kind kind,
                             int status);
/* A completed op, its replies sent: every rank's and the group's statistics, the devices' and
 * the daemon's counts, and the group's stage times. */
void epd_opstats_completed(const struct epdd_op *op, const struct epdd_exec *ex, int status,
                           uint64_t now);

/* reply.c: replies through the hooks */
/* The page rank r's reply goes into (its request asked and its binding still holds the rank),
 * else NULL; epd_op_reply_page also frees the rank's mailbox for the reply being sent now. */
struct epd_doorbell *epd_op_rank_page(const struct epdd_op *op, uint32_t r);
struct epd_doorbell *epd_op_reply_page(struct epdd_op *op, uint32_t r);
/* The success replies of rank r (h: the dispatch's handle). */
void epd_op_reply_dispatch(struct epdd_op *op, uint32_t r, struct epdd_handle *h);
void epd_op_reply_combine(struct epdd_op *op, uint32_t r);
void epd_reply_op(struct epdd_client *c, struct epd_doorbell *page,
                  const struct epd_op_reply *rep);
void epd_reply_op_status(struct epdd_client *c, struct epd_doorbell *page, uint32_t kind,
                         uint64_t request_id, int status, const char *fmt, ...)
        __attribute__((format(printf, 6, 7)));

#endif
