/* log.h - the daemon's one logger. Messages go to stderr; when stderr is the journal
 * (JOURNAL_STREAM names it) each line carries a <N> syslog priority prefix, otherwise a
 * timestamp and level word. Context is written as key=value pairs. Safe from any thread. */
#ifndef EPD_DAEMON_LOG_H
#define EPD_DAEMON_LOG_H

#include <syslog.h>

void epd_log_init(void);
void epd_log_set_level(int level);           /* LOG_ERR .. LOG_DEBUG */
int epd_log_level(void);
int epd_log_parse_level(const char *name);   /* "debug", "info", ...; -1 if unknown */
void epd_log(int priority, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Lines up to LOG_INFO are limited per call site (its format string): at most `burst` in each
 * window of `window_ms`; the rest are counted and reported as one line when a later window
 * begins, so that a client repeating a failure cannot fill the disk or starve the loop.
 * Debug lines are not limited. Defaults: 20 lines a second. */
void epd_log_set_rate(unsigned burst, unsigned window_ms);
/* Reports the suppressed counts of every window that has ended (the loop calls it on a timer,
 * so a flood that stops is still reported). */
void epd_log_flush_suppressed(void);

#define log_error(...) epd_log(LOG_ERR, __VA_ARGS__)
#define log_warning(...) epd_log(LOG_WARNING, __VA_ARGS__)
#define log_notice(...) epd_log(LOG_NOTICE, __VA_ARGS__)
#define log_info(...) epd_log(LOG_INFO, __VA_ARGS__)
#define log_debug(...) epd_log(LOG_DEBUG, __VA_ARGS__)

#endif
