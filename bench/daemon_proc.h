/* daemon_proc.h - the child processes of epd-bench, epd-demo and the integration tests' harness:
 * the epd daemon, started on a socket in a private temporary directory with its output in a log
 * file there and stopped with SIGTERM at the end; worker processes waited for with a deadline;
 * and the other epd tools (epctl) run beside the running executable. Binaries are
 * found next to the running executable (build/bin), never through paths baked in at configure
 * time. Messages go to stderr, prefixed with the program's name.
 */
#ifndef EPD_BENCH_DAEMON_PROC_H
#define EPD_BENCH_DAEMON_PROC_H

#include <stddef.h>
#include <sys/types.h>

struct daemon_proc {
        pid_t pid;          /* 0 when not running */
        char dir[256];      /* private temporary directory */
        char socket[320];
        char log[320];      /* the daemon's stdout and stderr */
};

/* The directory holding the running executable. */
const char *daemon_proc_bin_dir(void);
/* Starts `epd --socket DIR/epd.sock --config /dev/null [args, NULL-terminated]` (epd NULL: the
 * epd beside the running executable) in a new directory /tmp/PROG-XXXXXX and waits up to
 * timeout_ms until it accepts connections. Returns 0, or -1 after printing why and the log. */
int daemon_proc_start(struct daemon_proc *d, const char *prog, const char *epd,
                      const char *const *args, int timeout_ms);
/* SIGTERM, then waits up to timeout_ms (SIGKILL after that). Returns the exit status, 128+signal
 * when a signal ended it, or -1 when it had to be killed; prints the log unless it exited with 0.
 * Removes the directory. */
int daemon_proc_stop(struct daemon_proc *d, int timeout_ms);
/* Prints the daemon's log to stderr. */
void daemon_proc_dump_log(const struct daemon_proc *d);
/* Waits for n child processes; any still running after timeout_ms is killed. Returns the number
 * that did not exit with status 0 (each named on stderr). */
int daemon_proc_wait_children(const pid_t *pids, int n, int timeout_ms);
/* Runs TOOL beside the running executable with args (NULL-terminated, without argv[0]) and
 * captures its stdout into out (truncated to out_len - 1 bytes). Returns its exit status or -1. */
int daemon_proc_run_tool(const char *tool, const char *const *args, char *out, size_t out_len);

#endif
