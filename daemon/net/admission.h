/* admission.h - who gets a connection when slots or descriptors run short: a deadline for the
 * handshake, connections per uid, slots kept for administrators, a pause of accept() while
 * the process is out of descriptors, and a cool-down for uids that guess group secrets. Loop thread only. */
#ifndef EPD_DAEMON_ADMISSION_H
#define EPD_DAEMON_ADMISSION_H

#include <stdint.h>
#include <sys/socket.h>

struct epdd_daemon;

/* Starts the sweep timer (handshake deadlines) and the accept back-off timer. */
void epd_admission_init(struct epdd_daemon *d);
void epd_admission_close(struct epdd_daemon *d);

/* Decides on a new connection from cred (admin: root or admin_group). Returns 0 to admit it, or
 * an EPD status with *why set to the message the client gets. */
int epd_admission_check(struct epdd_daemon *d, const struct ucred *cred, int admin,
                        const char **why);

/* accept() failed with errno err. Out of descriptors (EMFILE, ENFILE) or kernel memory: closes
 * the oldest connections that have not finished their handshake, stops accepting for a back-off
 * (doubling from 50 ms to 2 s while it lasts), and resumes by itself. Returns 1 when accepting
 * was paused, 0 for an error worth only a log line. */
int epd_admission_accept_failed(struct epdd_daemon *d, int err);
/* A connection was accepted: the back-off starts again from its shortest. */
void epd_admission_accepted(struct epdd_daemon *d);

/* A connection of uid was closed for too many wrong group secrets: refuse the uid's new
 * connections (administrators' excepted) for 250 ms, doubling up to 10 s while it goes on within
 * a minute of the last penalty. */
void epd_admission_penalize(struct epdd_daemon *d, uint32_t uid);

struct epdd_conn;
/* More reply bytes were queued for c: 0, or -1 when the daemon's total of queued reply bytes is
 * over max_output_queue_bytes_total (*victim is then the connection holding the most, to be
 * closed). */
int epd_admission_queue(struct epdd_daemon *d, struct epdd_conn *c, struct epdd_conn **victim);

#endif
