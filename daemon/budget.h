/* budget.h - limits on what clients hold, per uid and for the whole daemon, beside the
 * per-client ones: rank bindings, groups, registered regions and their bytes, queued reply
 * bytes, and file descriptors with headroom. One client, or one user with many clients, can
 * exhaust none of them for the others. Every check names the limit it hit. Loop thread only. */
#ifndef EPD_DAEMON_BUDGET_H
#define EPD_DAEMON_BUDGET_H

#include <stddef.h>
#include <stdint.h>

struct epd_daemon;
struct epd_conn;

/* Raises the soft fd limit to the hard one (at most 1 << 20) and records it. */
void epd_budget_init(struct epd_daemon *d);
/* A new rank binding for c (2 descriptors: its doorbell page and arena). 0 or EPD_UNAVAILABLE. */
int epd_budget_binding(struct epd_daemon *d, const struct epd_conn *c, char *err,
                       size_t err_len);
/* A new group created by c. */
int epd_budget_group(struct epd_daemon *d, const struct epd_conn *c, char *err, size_t err_len);
/* A new region of `bytes` registered by c (one mapping). */
int epd_budget_region(struct epd_daemon *d, const struct epd_conn *c, uint64_t bytes, char *err,
                      size_t err_len);
/* `len` more bytes queued for c: 0, or -1 when the daemon's total of queued reply bytes is over
 * its limit (*victim is then the connection holding the most, to be closed). */
int epd_budget_queue(struct epd_daemon *d, struct epd_conn *c, uint64_t len,
                     struct epd_conn **victim);
/* Descriptors open in the daemon now (from /proc/self/fd). */
int epd_budget_open_fds(void);

#endif
