/* lifecycle.c - bringing a struct epdd_daemon up to the point where it can accept
 * connections: object lists, the receive buffer, the daemon epoch and the backend, and the hooks
 * through which each layer calls the one above it (the backend the core, the core the network
 * layer and `epctl resize`, the network layer the admin verbs and statistics). Shared by main()
 * and the request fuzzer, so both run the same set-up. Loop thread. */
#include <stdio.h>
#include <stdlib.h>

#include "admin.h"
#include "backend.h"
#include "daemon.h"
#include "frame.h"
#include "report.h"
#include "resize.h"
#include "util.h"

/* The requests the network layer leaves to the top level. */
static void top_request(struct epdd_conn *c, const Epd__V1__Request *req)
{
        if (req->body_case == EPD__V1__REQUEST__BODY_STATS)
                epd_handle_stats(c, req);
        else
                epd_handle_admin(c, req); /* Drain, Undrain, Evict, Resize */
}

int epd_daemon_init(struct epdd_daemon *d, uv_loop_t *loop, char *err, size_t err_len)
{
        int rc;

        d->loop = loop;
        d->start_ns = epd__now_ns();
        epd_list_init(&d->conns);
        epd_list_init(&d->groups);
        if (epd__random_bytes(&d->epoch, sizeof(d->epoch)) < 0) {
                snprintf(err, err_len, "no randomness for the daemon epoch");
                return EPD_INTERNAL;
        }
        rc = epd_net_init(d, err, err_len);
        if (rc < 0)
                return rc;
        rc = epd_backend_open(loop, &d->cfg, &d->backend, err, err_len);
        if (rc < 0) {
                epd_net_free(d);
                return rc;
        }
        d->backend->on_complete = epd_op_complete;
        d->backend->complete_arg = d;
        d->hooks.group_idle = epd_resize_continue;
        d->hooks.group_closing = epd_resize_abort;
        epd_net_hooks_install(d);
        epd_net_set_request_hook(top_request);
        return 0;
}
