/* mailbox.h - replies through a rank's doorbell page (common/doorbell.h, reply mailbox). */
#ifndef EPD_DAEMON_MAILBOX_H
#define EPD_DAEMON_MAILBOX_H

#include "doorbell.h"
#include "epd.pb-c.h"

/* Packs resp into the page and publishes it; wakes the client if it sleeps. A reply larger than
 * the page is not written: the page announces it (EPD_MAILBOX_ON_SOCKET) and -EMSGSIZE tells
 * the caller to send it on the socket. Loop thread. */
int epd_mailbox_post(struct epd_doorbell *db, const Epd__V1__Response *resp);
/* Tells a client sleeping on the page that its op started: reply_seq moves and a sleeper is
 * woken, nothing else changes. Any thread. */
void epd_mailbox_nudge(struct epd_doorbell *db);

#endif
