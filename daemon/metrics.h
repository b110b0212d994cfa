/* metrics.h - Prometheus text exposition over HTTP (metrics.c). Started and stopped on the loop
 * thread; the HTTP server runs its own thread. */
#ifndef EPD_DAEMON_METRICS_H
#define EPD_DAEMON_METRICS_H

#include <stddef.h>

#include "daemon.h"

struct epdd_metrics;

/* Listens on `listen` ("ADDR:PORT" or "[IPV6]:PORT"; port 0 picks a free one) and serves
 * GET /metrics. The returned object is owned by the caller (epd_metrics_stop). Returns 0, or a
 * negative errno with err saying why. */
int epd_metrics_start(struct epdd_daemon *d, const char *listen, struct epdd_metrics **out,
                      char *err, size_t err_len);
/* The address actually bound, "ADDR:PORT" with the real port (owned by m). */
const char *epd_metrics_address(const struct epdd_metrics *m);
/* Stops the server (waiting requests get 503) and frees m once the loop has closed its handle:
 * run the loop afterwards. NULL is fine. */
void epd_metrics_stop(struct epdd_metrics *m);

/* Renders the exposition of the daemon's counters into a malloc'ed string (*len bytes, NUL
 * terminated), owned by the caller. Loop thread. Returns 0 or a negative errno. */
int epd_metrics_render(struct epdd_daemon *d, char **text, size_t *len);

#endif
