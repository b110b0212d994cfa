/* harness.h - integration-test plumbing: start the real epd binary on a temporary socket, run
 * real client processes against it, run epctl and capture its output. Binaries are found next
 * to the test executable (build/bin), never through paths baked in at configure time. */
#ifndef EPD_TESTS_HARNESS_H
#define EPD_TESTS_HARNESS_H

#include <stddef.h>
#include <sys/types.h>

#include "epd.h"

struct h_daemon {
        pid_t pid;
        char dir[256];      /* private temporary directory */
        char socket[320];
        char log[320];      /* the daemon's stderr */
};

/* Directory holding the running executable (and epd, epctl). */
const char *h_bin_dir(void);
/* Starts epd --backend host --socket DIR/epd.sock [extra args, NULL-terminated] and waits until
 * it accepts connections (5 s at most). Returns 0 or -1 (the log is printed). */
int h_daemon_start(struct h_daemon *d, const char *const *extra_args);
/* SIGTERM, then waits up to timeout_ms. Returns the exit status, 128+signal if killed by one, or
 * -1 when it did not exit in time (it is then killed). Removes the directory. */
int h_daemon_stop(struct h_daemon *d, int timeout_ms);
/* Prints the daemon's log to stderr (for failing tests). */
void h_daemon_dump_log(const struct h_daemon *d);
/* Connects with a default name; NULL on failure (message on stderr). */
struct epd_client *h_connect(const struct h_daemon *d, const char *name);

/* Forks a process that returns fn(arg, index) as its exit status. */
pid_t h_spawn(int (*fn)(void *arg, int index), void *arg, int index);
/* Waits for n processes; any still running after timeout_ms is killed. Returns the number that
 * did not exit with status 0 (printing which). */
int h_wait_all(const pid_t *pids, int n, int timeout_ms);

/* Runs build/bin/<tool> with args (NULL-terminated, without argv[0]), captures stdout into out.
 * Returns the exit status or -1. */
int h_run_tool(const char *tool, const char *const *args, char *out, size_t out_len);

/* A 16-byte secret derived from a label, for groups in tests. */
void h_secret(const char *label, unsigned char secret[16]);

#endif
