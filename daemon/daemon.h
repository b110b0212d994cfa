/* daemon.h - the daemon's top level: what main.c, the admin verbs, the statistics report, the
 * metrics endpoint and `epctl resize` see. It sits above every layer (daemon/base, backend,
 * core, net; docs/architecture.md, "The daemon's layers") and wires them together: lifecycle.c
 * registers the hooks through which the lower layers call up. */
#ifndef EPD_DAEMON_DAEMON_H
#define EPD_DAEMON_DAEMON_H

#include "core.h"
#include "net.h"

/* lifecycle.c: lists, receive buffer, epoch and backend of a daemon whose cfg is set, with
 * every layer's hooks registered. 0 or a negative status with err set. */
int epd_daemon_init(struct epdd_daemon *d, uv_loop_t *loop, char *err, size_t err_len);

#endif
