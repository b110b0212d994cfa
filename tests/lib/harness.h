/* harness.h - integration-test plumbing: start the real epd binary on a temporary socket, run
 * real client processes against it, run epctl and capture its output. Binaries are found next
 * to the test executable (build/bin), never through paths baked in at configure time. */
#ifndef EPD_TESTS_HARNESS_H
#define EPD_TESTS_HARNESS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
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
/* Whether a line of the daemon's log contains text. */
int h_daemon_log_contains(const struct h_daemon *d, const char *text);
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
/* Formats a failure into msg (len bytes) and returns 1, for workers that report through a
 * shared mapping. */
int h_fail(char *msg, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Rank 0 creates group `name` (secret h_secret(name)) with cfg; other ranks join it, retrying
 * while it does not exist yet (10 s at most). Returns the status; *out on success. */
int h_group_enter(struct epd_client *cl, const char *name, uint32_t rank,
                  const struct epd_group_config *cfg, struct epd_group **out);

/* CLOCK_MONOTONIC in milliseconds (system-wide: comparable across processes). */
long long h_now_ms(void);
/* Waits until *flag >= value (polling every millisecond): 0, or -1 after timeout_ms. */
int h_flag_wait(atomic_int *flag, int value, int timeout_ms);

/* ---- harness_check.c: helpers that assert with Check (a failure fails the calling test) ---- */

struct epd_frame_header;
struct Epd__V1__Response;
struct json_t;

/* Largest body h_raw_recv accepts, and most fds h_raw_send can attach. */
#define H_RAW_MAX_BODY (256u * 1024u)
#define H_RAW_MAX_FDS 32u

struct Suite;
/* Runs every test of suite s in fork mode (CK_VERBOSITY picks the output) and frees it: the
 * exit status of a test binary's main, EXIT_FAILURE when any test failed. */
int h_run_suite(struct Suite *s);
/* h_connect, asserting that it succeeded. */
struct epd_client *h_connect_ok(const struct h_daemon *d, const char *name);
/* Asserts the daemon has not exited; context (may be NULL) is appended to the failure message. */
void h_assert_daemon_alive(const struct h_daemon *d, const char *context);
/* Number of region memfd mappings (/memfd:epd-region) in the daemon's /proc/PID/maps. */
int h_daemon_region_mappings(const struct h_daemon *d);
/* Open fds of a process, and its mappings of client memfd regions ("memfd:epd-region"), read
 * from /proc; -1 when /proc cannot be read. */
int h_proc_fd_count(pid_t pid);
int h_proc_region_mappings(pid_t pid);
/* CPU seconds (user + system) a process has used, from /proc/PID/stat; -1 when unreadable. */
double h_proc_cpu_seconds(pid_t pid);
/* Runs epctl --socket SOCKET COMMAND --json, asserts exit 0 and valid JSON; the caller
 * json_decref()s the result. */
struct json_t *h_epctl_json(const struct h_daemon *d, const char *command);

/* A raw SOCK_SEQPACKET connection to the daemon (no Hello sent). */
int h_raw_connect(const struct h_daemon *d);
/* A well-formed frame header for body_len bytes and num_fds fds. */
struct epd_frame_header h_good_header(size_t body_len, unsigned num_fds);
/* Sends header h + body with num_fds fds (SCM_RIGHTS); flags are OR'ed with MSG_NOSIGNAL.
 * Returns 0 or -errno. */
int h_raw_send(int sock, const struct epd_frame_header *h, const void *body, size_t body_len,
               const int *fds, unsigned num_fds, int flags);
/* Receives one frame within timeout_ms (fds that came with it are closed): 1 with *out set (the
 * caller frees it), 0 when the daemon closed the connection, -1 on timeout. A malformed or
 * undecodable frame fails the test. */
int h_raw_recv(int sock, int timeout_ms, struct Epd__V1__Response **out);

struct h_close_result {
        int replies;          /* frames received before the end of stream */
        int errors;           /* of which had a status other than OK */
        int status;           /* the last error reply's status as enum epd_status; EPD_OK if none */
        uint64_t id;          /* the last error reply's request id */
        char message[512];    /* the last error reply's message */
};
/* Reads until the daemon closes sock, asserting that it does so within 2 s; summarizes the
 * replies received before the close in *out. */
void h_expect_closed(int sock, struct h_close_result *out);
/* Asserts the read end of a pipe reaches EOF within 2 s, i.e. the daemon closed the write end it
 * received. */
void h_expect_pipe_eof(int read_end);

#endif
