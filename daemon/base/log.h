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

#define log_error(...) epd_log(LOG_ERR, __VA_ARGS__)
#define log_warning(...) epd_log(LOG_WARNING, __VA_ARGS__)
#define log_notice(...) epd_log(LOG_NOTICE, __VA_ARGS__)
#define log_info(...) epd_log(LOG_INFO, __VA_ARGS__)
#define log_debug(...) epd_log(LOG_DEBUG, __VA_ARGS__)

#endif
