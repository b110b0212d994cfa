/* mailbox.h - replies and requests through a rank's doorbell page (common/doorbell.h, reply
 * and request mailboxes). */
#ifndef EPD_DAEMON_MAILBOX_H
#define EPD_DAEMON_MAILBOX_H

#include "doorbell.h"
#include "oprec.h"

/* Writes rep's record (common/oprec.h) into the page and publishes it; wakes the client if it
 * sleeps. A record larger than the page is not written: the page announces it
 * (EPD_MAILBOX_ON_SOCKET) and -EMSGSIZE tells the caller to send it on the socket. Loop thread. */
int epd_mailbox_post(struct epd_doorbell *db, const struct epd_op_reply *rep);
/* Tells a client sleeping on the page that its op started: reply_seq moves and a sleeper is
 * woken, nothing else changes. Any thread. */
void epd_mailbox_nudge(struct epd_doorbell *db);

/* Tells the client whether the loop thread looks at its request box (sequentially consistent:
 * after storing 0, the caller looks at the box once more). Loop thread. */
void epd_mailbox_set_polling(struct epd_doorbell *db, int on);
/* Publishes the id of the last request read from the client's socket. Loop thread. */
void epd_mailbox_set_read_id(struct epd_doorbell *db, uint64_t id);
/* Claims a posted request: copies it into buf and empties the slot. Returns 1 with *len set, 0
 * when there is none (or the client took it back), -EMSGSIZE when its length is 0 or larger than
 * the box or buf (*len says what it claimed; the slot is emptied). Loop thread. */
int epd_mailbox_take(struct epd_doorbell *db, uint8_t *buf, size_t buf_len, size_t *len);

#endif
