/* admission.h - who gets a connection when slots or descriptors run short: a deadline for the
 * handshake, connections per uid, slots kept for administrators, and a pause of accept() while
 * the process is out of descriptors. Loop thread only. */
#ifndef EPD_DAEMON_ADMISSION_H
#define EPD_DAEMON_ADMISSION_H

#include <sys/socket.h>

struct epd_daemon;

/* Starts the sweep timer (handshake deadlines) and the accept back-off timer. */
void epd_admission_init(struct epd_daemon *d);
void epd_admission_close(struct epd_daemon *d);

/* Decides on a new connection from cred (admin: root or admin_group). Returns 0 to admit it, or
 * an EPD status with *why set to the message the client gets. */
int epd_admission_check(struct epd_daemon *d, const struct ucred *cred, int admin,
                        const char **why);

/* accept() failed with errno err. Out of descriptors (EMFILE, ENFILE) or kernel memory: closes
 * the oldest connections that have not finished their handshake, stops accepting for a back-off
 * (doubling from 50 ms to 2 s while it lasts), and resumes by itself. Returns 1 when accepting
 * was paused, 0 for an error worth only a log line. */
int epd_admission_accept_failed(struct epd_daemon *d, int err);
/* A connection was accepted: the back-off starts again from its shortest. */
void epd_admission_accepted(struct epd_daemon *d);

#endif
