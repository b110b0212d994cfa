/* lifecycle.c - bringing a struct epd_daemon up to the point where it can accept
 * connections: object lists, the receive buffer, the daemon epoch and the backend. Shared by
 * main() and the request fuzzer, so both run the same set-up. Loop thread. */
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"
#include "daemon.h"
#include "frame.h"
#include "util.h"

int epd_daemon_init(struct epd_daemon *d, uv_loop_t *loop, char *err, size_t err_len)
{
        int rc;

        d->loop = loop;
        d->listen_fd = -1;
        d->start_ns = epd__now_ns();
        epd_list_init(&d->conns);
        epd_list_init(&d->groups);
        if (epd__random_bytes(&d->epoch, sizeof(d->epoch)) < 0) {
                snprintf(err, err_len, "no randomness for the daemon epoch");
                return EPD_INTERNAL;
        }
        d->rbuf_len = EPD_FRAME_HEADER_BYTES + d->cfg.max_frame_bytes + 1;
        d->rbuf = malloc(d->rbuf_len);
        if (!d->rbuf) {
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        rc = epd_backend_open(d, &d->backend, err, err_len);
        if (rc < 0) {
                free(d->rbuf);
                d->rbuf = NULL;
                return rc;
        }
        return 0;
}
