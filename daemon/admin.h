/* admin.h - the admin verbs Drain, Undrain, Evict and Resize (admin.c). Loop thread. */
#ifndef EPD_DAEMON_ADMIN_H
#define EPD_DAEMON_ADMIN_H

#include "daemon.h"

/* Answers a Drain, Undrain, Evict or Resize request; non-admin clients get PERMISSION_DENIED.
 * req stays owned by the caller. */
void epd_handle_admin(struct epdd_conn *c, const Epd__V1__Request *req);

#endif
