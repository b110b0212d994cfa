/* daemon.h - the daemon's object graph (DESIGN.md section 3): daemon, connection (client),
 * region, group, rank binding, op, handle. Every object here is owned and touched by the libuv
 * loop thread only; backends see copies of what they need (struct epd_exec) and report back with
 * uv_async_send.
 */
#ifndef EPD_DAEMON_DAEMON_H
#define EPD_DAEMON_DAEMON_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "config.h"
#include "doorbell.h"
#include "epd.h"
#include "epd.pb-c.h"
#include "list.h"
#include "oprec.h"
#include "stats.h"

struct epd_backend;
struct epd_exec;
struct epd_arena;
struct epd_resize;

struct epd_daemon {
        uv_loop_t *loop;
        struct epd_config cfg;
        struct epd_backend *backend;
        uint64_t epoch;               /* random per start, told to clients in Welcome */
        uint64_t start_ns;
        int listen_fd;
        int listen_fd_activated;      /* from sd_listen_fds: not ours to unlink */
        uv_poll_t listen_poll;
        uv_signal_t sig_term, sig_int, sig_hup;
        uv_timer_t watchdog_timer;
        uv_timer_t drain_timer;
        uv_timer_t sweep_timer;       /* handshake deadlines (admission.c) */
        uv_timer_t backoff_timer;     /* accept() paused while out of descriptors */
        unsigned backoff_ms;
        int accept_paused;
        uint64_t fd_limit;            /* RLIMIT_NOFILE once raised (budget.c) */
        uint64_t out_bytes;           /* reply bytes queued for every client together */
        int shutting_down;            /* SIGTERM seen: no new ops, exit when drained */
        int draining;                 /* operator drain: no new ops are launched */
        uint64_t drain_start_ns;
        struct epd_list conns;
        unsigned num_conns;
        uint64_t next_client_id;
        struct epd_list groups;
        unsigned num_groups;
        uint64_t next_group_id;
        uint64_t next_region_id;
        struct epd_daemon_stats stats;
        uint8_t *rbuf;                /* receive buffer, max frame + header + 1 */
        size_t rbuf_len;
        int polling;                  /* the loop thread looks at the request boxes each turn */
};

/* A client's registered memory. base is the address through which the backend reaches it
 * (host mapping or device VA). Referenced by its owner's table and by every exec using it, so a
 * disconnect never unmaps memory that an op in flight still writes. */
struct epd_region {
        uint64_t id;
        struct epd_conn *owner;       /* NULL once the owner is gone */
        enum epd_region_kind kind;
        uint64_t size;
        uint32_t device;
        uint8_t *base;
        void *backend_state;
        unsigned refs;
        int is_arena;                 /* daemon-owned arena: memory freed with its group */
        struct epd_list conn_link;
};

struct epd_out_msg {
        struct epd_list link;
        size_t len;
        unsigned num_fds;
        int fds[2];
        uint8_t data[];
};

/* One client connection. */
struct epd_conn {
        struct epd_daemon *daemon;
        uint64_t id;
        int fd;
        uv_poll_t poll;
        int poll_events;
        pid_t pid;
        uid_t uid;
        gid_t gid;
        int admin;                    /* root or member of admin_group */
        int cuda_capable;             /* announced CAP_CUDA_REGIONS: can map device memory */
        char name[64];
        int hello_done;
        unsigned wrong_secrets;       /* GroupJoins refused for their secret */
        uint64_t accepted_ns;         /* the handshake must end within handshake_timeout_ms */
        int closing;
        /* A send failed (or the output queue overflowed) somewhere inside another object's
         * code: the close runs from close_idle on the loop's next turn (conn.c). */
        const char *close_reason;
        uv_idle_t close_idle;
        unsigned open_handles;        /* poll and close_idle; freed when both are closed */
        struct epd_list regions;
        /* The same regions by id (registry.c): open addressing, at most half full. */
        struct epd_region **region_slots;
        uint32_t region_cap, region_count;
        unsigned num_regions;         /* client-registered ones (arenas not counted) */
        uint64_t region_bytes;
        struct epd_list bindings;     /* struct epd_binding */
        unsigned num_bindings;
        uint64_t last_read_id;        /* id of the last request read from the socket */
        unsigned outstanding_ops;
        struct epd_list out_queue;
        uint64_t out_bytes;
        struct epd_list link;
        struct epd_client_stats stats;
};

enum epd_group_state {
        EPD_GROUP_FORMING,
        EPD_GROUP_READY,
        EPD_GROUP_DRAINING,
        EPD_GROUP_BROKEN,
        EPD_GROUP_CLOSED,
};

struct epd_group_cfg {
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
};

struct epd_binding {
        struct epd_list conn_link;
        struct epd_group *group;
        uint32_t rank;
};

struct epd_rank {
        struct epd_conn *conn;        /* NULL when unbound */
        struct epd_binding *binding;
        uint32_t device;
        uint64_t next_op;
        struct epd_arena *arena;      /* daemon-owned output arena, exported to the client */
        uint64_t arena_region_id;     /* the arena in the bound client's region table */
        struct epd_doorbell *doorbell; /* this binding's doorbell page (common/doorbell.h) */
        int doorbell_fd;
        struct epd_retired *doorbell_retired; /* the record that retires it (group.c),
                                               * allocated with it so retiring cannot fail */
        void *doorbell_dev;           /* its device address (cuda backend), else NULL */
        uint64_t mailbox_id;          /* request whose reply goes into the page; 0: none */
        uint64_t completed;           /* ops of this binding finished, as in the doorbell */
        uint64_t submitted;           /* submissions of this binding, accepted or refused */
        uint64_t *refused;            /* sequence numbers of refused submissions not yet counted */
        unsigned num_refused, cap_refused;
        int arena_host;               /* the arena is host memory */
        struct epd_rank_stats stats;
};

/* Output fields an arena can hold, in placement order. */
enum epd_out_field {
        EPD_OUT_RECV_X,
        EPD_OUT_RECV_SCALES,
        EPD_OUT_RECV_TOPK_IDX,
        EPD_OUT_RECV_WEIGHTS,
        EPD_OUT_RECV_SRC,
        EPD_OUT_RECV_TOPK_SLOT,
        EPD_OUT_FIELDS
};

/* Where a rank's dispatch outputs sit in its arena: one extent holding every field. */
struct epd_arena_place {
        int used;
        struct epd_arena *arena;      /* the arena placed in: released there, even after the
                                       * rank's arena was replaced (group.c) */
        uint64_t ext_off, ext_len;
        uint64_t off[EPD_OUT_FIELDS]; /* absolute offsets in the arena; UINT64_MAX: absent */
};

struct epd_handle_rank {
        uint32_t num_tokens;
        int64_t rows;                 /* rows of the layout at this destination */
        int released;
        struct epd_arena_place arena;
};

/* Routing state produced by a dispatch (DESIGN.md section 3). The backend owns `state`. */
struct epd_handle {
        struct epd_list link;
        uint64_t id;
        enum epd_layout layout;
        enum epd_dtype topk_dtype;
        uint32_t num_topk;
        int has_weights;
        struct epd_handle_rank *ranks; /* [R] */
        void *state;
        int busy;                     /* an op using it is executing */
        uint64_t epoch;               /* group epoch it was made in */
};

enum epd_op_kind {
        EPD_OP_DISPATCH = EPD_OPREC_DISPATCH, /* the record's kinds (common/oprec.h) */
        EPD_OP_COMBINE = EPD_OPREC_COMBINE,
};

struct epd_submission {
        int arrived;
        uint64_t request_id;
        struct epd_conn *conn;
        uint64_t submitted_ns;
        uint64_t seq;                 /* the rank's submission number (doorbell) */
        int mailbox;                  /* the reply goes into the rank's doorbell page */
        struct epd_op_request req;    /* the decoded request record */
};

enum epd_op_state {
        EPD_OP_COLLECTING,            /* waiting for ranks */
        EPD_OP_QUEUED,                /* every rank arrived; waits for earlier ops */
        EPD_OP_EXECUTING,
        EPD_OP_FINISHED,              /* failed before launch; answers late arrivals */
};

struct epd_op {
        struct epd_list link;
        struct epd_group *group;
        uint64_t number;
        enum epd_op_kind kind;
        enum epd_op_state state;
        uint32_t arrived;
        int status;
        char message[512];
        struct epd_submission *subs;  /* [R] */
        uv_timer_t timer;
        int timer_active;
        struct epd_exec *exec;
        struct epd_handle *handle;    /* handle the executing op reads or refreshes */
        struct epd_region **refs;     /* regions the executing op uses */
        unsigned num_refs;
        uint64_t epoch;               /* group epoch at launch */
        uint64_t launch_ns;
        uint64_t completed_ns;        /* the loop thread took the completion */
};

struct epd_group {
        struct epd_list link;
        struct epd_daemon *daemon;
        uint64_t id;
        char name[64];
        uid_t owner_uid;              /* its creator's: names and group budgets are per uid */
        uint8_t secret[64];
        size_t secret_len;
        struct epd_group_cfg cfg;
        enum epd_group_state state;
        struct epd_rank *ranks;       /* [R] */
        uint32_t num_bound;
        struct epd_list ops;          /* by number */
        struct epd_op *executing;
        struct epd_list handles;
        unsigned num_handles;
        uint64_t next_handle_id;
        uint64_t epoch;               /* bumped when the group breaks: old handles die */
        int free_pending;             /* destroy once the executing op completes */
        struct epd_list retired;      /* doorbell pages and arenas of past bindings that the
                                       * executing op may still use */
        struct epd_resize *resize;    /* pending `epctl resize` (resize.c): no op is launched */
        struct epd_group_stats stats;
};

/* conn.c */
int epd_conn_accept(struct epd_daemon *d, int fd);
void epd_conn_close(struct epd_conn *c, const char *why);
/* Closes c on the loop's next turn, after what is queued for it has been tried (conn.c). */
void epd_conn_close_later(struct epd_conn *c, const char *why);
/* A connection that sent this many wrong group secrets is closed. */
#define EPD_MAX_WRONG_SECRETS 8
int epd_conn_send(struct epd_conn *c, const Epd__V1__Response *resp, const int *fds,
                  unsigned num_fds);
/* Sends a Response with only a status and message. */
void epd_conn_reply_status(struct epd_conn *c, uint64_t request_id, int status,
                           const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* The reply record (common/oprec.h) of an op request: into `mailbox` (the rank's doorbell page)
 * when given and the record fits, else on the socket inside an OpRecord. */
int epd_conn_reply_op(struct epd_conn *c, struct epd_doorbell *mailbox,
                      const struct epd_op_reply *rep);
/* A reply record that carries only a status and message. */
void epd_conn_reply_op_status(struct epd_conn *c, struct epd_doorbell *mailbox, uint32_t kind,
                              uint64_t request_id, int status, const char *fmt, ...)
        __attribute__((format(printf, 6, 7)));

/* handlers.c: one request, decoded. Returns 0, or a negative value when the connection must be
 * closed. */
int epd_handle_request(struct epd_conn *c, Epd__V1__Request *req, int *fds, unsigned num_fds);
/* One op request, decoded from its record (socket or doorbell page). Refusals are replied. */
void epd_handle_op(struct epd_conn *c, const struct epd_op_request *req);

/* registry.c */
int epd_region_register(struct epd_conn *c, const Epd__V1__RegionRegister *rr, int fd,
                        uint64_t *region_id, char *err, size_t err_len);
int epd_region_release_id(struct epd_conn *c, uint64_t region_id);
void epd_region_release_all(struct epd_conn *c);
void epd_region_detach(struct epd_conn *c, struct epd_region *r);
int epd_region_add_arena(struct epd_conn *c, struct epd_arena *arena, uint32_t device,
                         uint64_t *region_id);
struct epd_region *epd_region_find(struct epd_conn *c, uint64_t region_id);
void epd_region_ref(struct epd_region *r);
void epd_region_unref(struct epd_daemon *d, struct epd_region *r);
/* Checks that `tensor` (rows x cols of dtype, row stride from strides[0]) lies inside the
 * client's region and returns the backend address of its first byte and its row stride in
 * bytes. rows is the number of rows the op will touch (capacity for outputs). */
/* Adds r (id set) to c's list and lookup table; the caller counts it. Returns 0, or
 * EPD_INTERNAL when the table cannot grow (r is then not added). */
int epd_region_attach(struct epd_conn *c, struct epd_region *r);
int epd_region_resolve(struct epd_conn *c, const struct epd_tensor *tensor, uint64_t rows,
                       uint64_t cols, struct epd_region **region, uint8_t **ptr,
                       uint64_t *row_stride, char *err, size_t err_len);

/* group.c */
/* Doorbell bookkeeping (common/doorbell.h): every submission of a rank gets a sequence number;
 * `completed` counts the first n that have finished, whatever their status. */
uint64_t epd_group_rank_submitted(struct epd_group *g, uint32_t rank);
void epd_group_rank_op_finished(struct epd_group *g, uint32_t rank, uint64_t seq);
void epd_group_rank_refused(struct epd_group *g, uint32_t rank);
/* Frees the doorbell pages and arenas of past bindings (no op executing). */
void epd_group_free_retired(struct epd_group *g);
struct epd_group *epd_group_find(struct epd_daemon *d, uint64_t id);
struct epd_group *epd_group_find_name(struct epd_daemon *d, const char *name);
int epd_group_cfg_from_wire(const struct epd_daemon *d, const Epd__V1__GroupConfig *wire,
                            struct epd_group_cfg *cfg, char *err, size_t err_len);
void epd_group_cfg_to_wire(const struct epd_group_cfg *cfg, Epd__V1__GroupConfig *wire);
/* Names are per uid (the creator's): owner's group of that name, or NULL. */
struct epd_group *epd_group_find_name_of(struct epd_daemon *d, uid_t owner, const char *name);
/* The group a join names: uid's own group of that name if there is one, else another uid's
 * whose secret matches. NULL when none matches; *named then tells a wrong secret (1) from a
 * name no group has (0). */
struct epd_group *epd_group_find_for_join(struct epd_daemon *d, uid_t uid, const char *name,
                                          const void *secret, size_t secret_len, int *named);
int epd_group_new(struct epd_daemon *d, uid_t owner, const char *name, const void *secret,
                  size_t secret_len, const struct epd_group_cfg *cfg, struct epd_group **out,
                  char *err, size_t err_len);
int epd_group_bind(struct epd_group *g, struct epd_conn *c, uint32_t rank, uint32_t device,
                   char *err, size_t err_len);
/* Unbinds a rank. lost != 0: the client vanished (the group breaks); else it left politely. */
void epd_group_unbind(struct epd_group *g, uint32_t rank, int lost);
void epd_group_maybe_free(struct epd_group *g);
const char *epd_group_state_name(enum epd_group_state s);
struct epd_handle *epd_group_handle_find(struct epd_group *g, uint64_t id);
void epd_group_handle_release(struct epd_group *g, struct epd_handle *h, uint32_t rank);
void epd_group_handle_free(struct epd_group *g, struct epd_handle *h);
int epd_group_handle_all_released(const struct epd_group *g, const struct epd_handle *h);

/* op.c */
/* Files rank's submission of its next op; the op keeps a copy of req. */
void epd_op_submit(struct epd_group *g, uint32_t rank, struct epd_conn *c,
                   const struct epd_op_request *req);
/* Fails every op of the group that has not launched with status/message. */
void epd_op_fail_pending(struct epd_group *g, int status, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
void epd_op_complete(struct epd_exec *ex);   /* backend completion, on the loop thread */
void epd_op_kick(struct epd_group *g);       /* launch queued ops if possible */
/* Removes every op that is not executing (the group is going away); no replies. */
void epd_op_destroy_all(struct epd_group *g);

/* lifecycle.c: lists, receive buffer, epoch and backend of a daemon whose cfg is set.
 * 0 or a negative status with err set. */
int epd_daemon_init(struct epd_daemon *d, uv_loop_t *loop, char *err, size_t err_len);

/* server.c */
int epd_server_listen(struct epd_daemon *d, char *err, size_t err_len);
void epd_server_close(struct epd_daemon *d);
/* Stops and restarts watching the listening socket (admission.c's back-off). */
void epd_server_pause(struct epd_daemon *d);
void epd_server_resume(struct epd_daemon *d);
/* Requests through the doorbell pages (common/doorbell.h, request mailbox; conn.c). The loop
 * thread takes every posted request and returns how many it handled; it tells the clients'
 * pages whether it looks at them (after saying no, it looks once more); a new binding's page
 * gets the current state. */
unsigned epd_conn_poll_pages(struct epd_daemon *d);
void epd_conn_set_polling(struct epd_daemon *d, int on);
void epd_conn_page_init(struct epd_conn *c, struct epd_doorbell *page);
int epd_conn_is_allowed(const struct epd_daemon *d, uid_t uid, gid_t gid);
int epd_conn_is_admin(const struct epd_daemon *d, uid_t uid, gid_t gid);

#endif
