/* net.h - the daemon's network layer: the listening socket (server.c), client connections with
 * their framing and output queues (conn.c), the handlers that decode each protobuf request into
 * the core's native structs and encode its reply (handlers.c, wire.c), and the doorbell page's
 * mailboxes (mailbox.c). Loop thread only.
 *
 * It sits above daemon/core: it calls the core with native structs, and the core reaches it only
 * through the hooks it registers (epd_net_hooks_install). Requests that belong to the top level
 * (admin verbs, statistics) go to the handler the top level registers (epd_net_set_request_hook).
 */
#ifndef EPD_DAEMON_NET_H
#define EPD_DAEMON_NET_H

#include <stdint.h>
#include <uv.h>

#include "core.h"
#include "epd.pb-c.h"

/* A uid whose connections were closed for wrong group secrets: its new connections are refused
 * until until_ns (admission.c). */
struct epdd_uid_penalty {
        uint32_t uid;
        uint32_t ms;                  /* the last penalty; 0: a free entry */
        uint64_t until_ns;
};

#define EPD_PENALTY_UIDS 64

/* The network layer's state of a daemon (epdd_daemon.net). */
struct epdd_net {
        int listen_fd;
        int listen_fd_activated;      /* from sd_listen_fds: not ours to unlink */
        uv_poll_t listen_poll;
        uint8_t *rbuf;                /* receive buffer, max frame + header + 1 */
        size_t rbuf_len;
        int polling;                  /* the loop thread looks at the request boxes each turn */
        uv_timer_t sweep_timer;       /* handshake deadlines (admission.c) */
        uv_timer_t backoff_timer;     /* accept() paused while out of descriptors */
        unsigned backoff_ms;
        uint64_t out_bytes;           /* reply bytes queued for every client together */
        struct epdd_uid_penalty penalties[EPD_PENALTY_UIDS];
};

struct epdd_out_msg {
        struct epd_list link;
        size_t len;
        unsigned num_fds;
        int fds[2];
        uint8_t data[];
};

/* One client connection: the core's client, and its socket. */
struct epdd_conn {
        struct epdd_client cl;        /* first: the core's view; epd_conn_of gets back here */
        int fd;
        uv_poll_t poll;
        int poll_events;
        int hello_done;
        uint64_t accepted_ns;         /* the handshake must end within handshake_timeout_ms */
        /* A send failed (or the output queue overflowed) somewhere inside another object's
         * code: the close runs from close_idle on the loop's next turn (conn.c). */
        const char *close_reason;
        uv_idle_t close_idle;
        unsigned open_handles;        /* poll and close_idle; freed when both are closed */
        uint64_t last_read_id;        /* id of the last request read from the socket */
        struct epd_list out_queue;
        uint64_t out_bytes;
};

static inline struct epdd_conn *epd_conn_of(struct epdd_client *c)
{
        return (struct epdd_conn *)c;
}

/* conn.c */
int epd_conn_accept(struct epdd_daemon *d, int fd);
void epd_conn_close(struct epdd_conn *c, const char *why);
/* Closes c on the loop's next turn, after what is queued for it has been tried. */
void epd_conn_close_later(struct epdd_conn *c, const char *why);
/* A connection that sent this many wrong group secrets is closed. */
#define EPD_MAX_WRONG_SECRETS 8
int epd_conn_send(struct epdd_conn *c, const Epd__V1__Response *resp, const int *fds,
                  unsigned num_fds);
/* Sends a Response with only a status and message. */
void epd_conn_reply_status(struct epdd_conn *c, uint64_t request_id, int status,
                           const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* Requests through the doorbell pages (common/doorbell.h, request mailbox). The loop thread
 * takes every posted request and returns how many it handled; it tells the clients' pages
 * whether it looks at them (after saying no, it looks once more). */
unsigned epd_conn_poll_pages(struct epdd_daemon *d);
void epd_conn_set_polling(struct epdd_daemon *d, int on);
int epd_conn_is_allowed(const struct epdd_daemon *d, uid_t uid, gid_t gid);
/* Closes every connection whose uid and gid the allow lists no longer admit (after SIGHUP). */
void epd_conn_close_disallowed(struct epdd_daemon *d);
int epd_conn_is_admin(const struct epdd_daemon *d, uid_t uid, gid_t gid);
/* The client with this id whose connection is open, or NULL. */
struct epdd_conn *epd_conn_find(struct epdd_daemon *d, uint64_t id);
/* Sets the core's hooks (replies, pages) and the backend's page polling to this layer's. */
void epd_net_hooks_install(struct epdd_daemon *d);

/* handlers.c: one request, decoded. Returns 0, or a negative value when the connection must be
 * closed. */
int epd_handle_request(struct epdd_conn *c, Epd__V1__Request *req, int *fds, unsigned num_fds);
/* One op request, decoded from its record (socket or doorbell page). Refusals are replied. */
void epd_handle_op(struct epdd_conn *c, const struct epd_op_request *req);
/* The handler of the requests this layer leaves to the top level (Drain, Undrain, Evict,
 * Resize, Stats): it replies itself. */
typedef void (*epd_request_hook)(struct epdd_conn *c, const Epd__V1__Request *req);
void epd_net_set_request_hook(epd_request_hook hook);

/* wire.c: the core's objects in protobuf */
int epd_group_cfg_from_wire(const struct epdd_daemon *d, const Epd__V1__GroupConfig *wire,
                            struct epdd_group_cfg *cfg, char *err, size_t err_len);
void epd_group_cfg_to_wire(const struct epdd_group_cfg *cfg, Epd__V1__GroupConfig *wire);
/* A rank's arena in GroupJoined; returns the fd of its first segment, -1 when it has none. */
int epd_wire_fill_joined(const struct epdd_rank *r, Epd__V1__GroupJoined *j,
                         Epd__V1__ArenaSegment *segs, Epd__V1__ArenaSegment **ptrs);
void epd_handle_arena_segments(struct epdd_conn *c, const Epd__V1__Request *req);
/* Answers CxMemory: client memory registered with a client-executed group (fd of the frame). */
void epd_handle_cx_memory(struct epdd_conn *c, const Epd__V1__Request *req, int *fds,
                          unsigned num_fds);

/* server.c */
/* Makes d->net (no socket yet); epd_net_free undoes it. 0 or EPD_INTERNAL with err set. */
int epd_net_init(struct epdd_daemon *d, char *err, size_t err_len);
void epd_net_free(struct epdd_daemon *d);
int epd_server_listen(struct epdd_daemon *d, char *err, size_t err_len);
void epd_server_close(struct epdd_daemon *d);
/* Stops and restarts watching the listening socket (admission.c's back-off). */
void epd_server_pause(struct epdd_daemon *d);
void epd_server_resume(struct epdd_daemon *d);

#endif
