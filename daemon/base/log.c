/* log.c - stderr logging with journald priority prefixes. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

static atomic_int log_level = LOG_INFO;
static int to_journal;

void epd_log_init(void)
{
        const char *stream = getenv("JOURNAL_STREAM");
        struct stat st;
        unsigned long dev, ino;

        /* JOURNAL_STREAM is "device:inode" of the journal's stream; prefix priorities only when
         * stderr still is that stream (not redirected by the caller). */
        if (stream && sscanf(stream, "%lu:%lu", &dev, &ino) == 2 && fstat(STDERR_FILENO, &st) == 0 &&
            st.st_dev == (dev_t)dev && st.st_ino == (ino_t)ino)
                to_journal = 1;
}

void epd_log_set_level(int level)
{
        atomic_store(&log_level, level);
}

int epd_log_level(void)
{
        return atomic_load(&log_level);
}

int epd_log_parse_level(const char *name)
{
        static const struct {
                const char *name;
                int level;
        } levels[] = {
                { "error", LOG_ERR },   { "warning", LOG_WARNING }, { "notice", LOG_NOTICE },
                { "info", LOG_INFO },   { "debug", LOG_DEBUG },
        };
        for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++)
                if (strcmp(name, levels[i].name) == 0)
                        return levels[i].level;
        return -1;
}

void epd_log(int priority, const char *fmt, ...)
{
        static const char *const words[] = { "emerg", "alert", "crit", "error",
                                             "warning", "notice", "info", "debug" };
        char line[1024];
        int n;
        va_list ap;

        if (priority > atomic_load(&log_level))
                return;
        if (to_journal) {
                n = snprintf(line, sizeof(line), "<%d>", priority);
        } else {
                struct timespec ts;
                struct tm tm;
                clock_gettime(CLOCK_REALTIME, &ts);
                gmtime_r(&ts.tv_sec, &tm);
                n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ epd %s: ",
                             tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                             tm.tm_sec, ts.tv_nsec / 1000000, words[priority & 7]);
        }
        va_start(ap, fmt);
        vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
        va_end(ap);
        /* One write per line, so lines from different threads do not interleave. */
        size_t len = strlen(line);
        line[len++] = '\n';
        ssize_t w = write(STDERR_FILENO, line, len);
        (void)w;
}
