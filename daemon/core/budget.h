/* budget.h - limits on what clients hold, per uid and for the whole daemon, beside the
 * per-client ones: rank bindings, groups and the memory made for them, registered regions and
 * their bytes, and file descriptors with headroom (queued reply bytes are the network layer's,
 * net/admission.c). One client, or one user with many clients, can exhaust none of them for the
 * others. Every check names the limit it hit. Loop thread only. */
#ifndef EPD_DAEMON_BUDGET_H
#define EPD_DAEMON_BUDGET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct epdd_daemon;
struct epdd_client;
struct epdd_group;

/* Raises the soft fd limit to the hard one (at most 1 << 20) and records it. */
void epd_budget_init(struct epdd_daemon *d);
/* A new rank binding for c (2 descriptors: its doorbell page and arena). 0 or EPD_UNAVAILABLE. */
int epd_budget_binding(struct epdd_daemon *d, const struct epdd_client *c, char *err,
                       size_t err_len);
/* A new group created by c. */
int epd_budget_group(struct epdd_daemon *d, const struct epdd_client *c, char *err, size_t err_len);
/* The memory the daemon holds for g: its ranks' output arenas as mapped (those of past
 * bindings that its executing op still uses included) and its client-executed buffers. */
uint64_t epd_budget_group_memory(const struct epdd_group *g);
/* `more` bytes of such memory for a group created by uid `owner`, against
 * max_group_bytes_per_uid (every group that uid created) and max_group_bytes (every group). */
int epd_budget_group_bytes(struct epdd_daemon *d, uid_t owner, uint64_t more, char *err,
                           size_t err_len);
/* A new region of `bytes` registered by c (one mapping). */
int epd_budget_region(struct epdd_daemon *d, const struct epdd_client *c, uint64_t bytes, char *err,
                      size_t err_len);
/* Descriptors open in the daemon now (from /proc/self/fd). */
int epd_budget_open_fds(void);

#endif
