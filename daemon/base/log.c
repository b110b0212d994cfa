/* log.c - stderr logging with journald priority prefixes. */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
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

/* Per call site limits, keyed by the format string's address (one per call site). A table that
 * is full limits nothing rather than dropping lines it cannot account for. */
#define RATE_SLOTS 256
struct rate_slot {
        const char *fmt;
        int priority;
        uint64_t window_start_ns;
        unsigned lines;      /* written in this window */
        uint64_t suppressed; /* dropped in this window */
};
static pthread_mutex_t rate_lock = PTHREAD_MUTEX_INITIALIZER;
static struct rate_slot rate_slots[RATE_SLOTS];
static unsigned rate_burst = 20;
static uint64_t rate_window_ns = 1000000000ull;

static uint64_t now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

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

static void log_write(int priority, const char *fmt, va_list ap)
{
        static const char *const words[] = { "emerg", "alert", "crit", "error",
                                             "warning", "notice", "info", "debug" };
        char line[1024];
        int n;

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
        vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
        /* One write per line, so lines from different threads do not interleave. */
        size_t len = strlen(line);
        line[len++] = '\n';
        ssize_t w = write(STDERR_FILENO, line, len);
        (void)w;
}

static void log_line(int priority, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log_line(int priority, const char *fmt, ...)
{
        va_list ap;

        va_start(ap, fmt);
        log_write(priority, fmt, ap);
        va_end(ap);
}

/* Reports a slot's suppressed lines and opens a new window. rate_lock held. */
static void rate_roll(struct rate_slot *s, uint64_t now)
{
        if (s->suppressed)
                log_line(s->priority, "%llu similar lines suppressed in %.1f s (at most %u a window): %s",
                         (unsigned long long)s->suppressed,
                         (double)(now - s->window_start_ns) / 1e9, rate_burst, s->fmt);
        s->window_start_ns = now;
        s->lines = 0;
        s->suppressed = 0;
}

/* 1: write the line; 0: count it as suppressed. */
static int rate_admit(int priority, const char *fmt)
{
        uint64_t now = now_ns();
        size_t h = ((uintptr_t)fmt >> 3) % RATE_SLOTS;
        int admit = 1;

        pthread_mutex_lock(&rate_lock);
        for (unsigned probe = 0; probe < RATE_SLOTS; probe++) {
                struct rate_slot *s = &rate_slots[(h + probe) % RATE_SLOTS];
                if (s->fmt && s->fmt != fmt)
                        continue;
                if (!s->fmt) {
                        s->fmt = fmt;
                        s->priority = priority;
                        s->window_start_ns = now;
                }
                if (now - s->window_start_ns >= rate_window_ns)
                        rate_roll(s, now);
                if (s->lines < rate_burst)
                        s->lines++;
                else
                        s->suppressed++, admit = 0;
                break;
        }
        pthread_mutex_unlock(&rate_lock);
        return admit;
}

void epd_log_set_rate(unsigned burst, unsigned window_ms)
{
        pthread_mutex_lock(&rate_lock);
        rate_burst = burst ? burst : 1;
        rate_window_ns = (uint64_t)(window_ms ? window_ms : 1) * 1000000ull;
        pthread_mutex_unlock(&rate_lock);
}

void epd_log_flush_suppressed(void)
{
        uint64_t now = now_ns();

        pthread_mutex_lock(&rate_lock);
        for (unsigned i = 0; i < RATE_SLOTS; i++) {
                struct rate_slot *s = &rate_slots[i];
                if (s->fmt && s->suppressed && now - s->window_start_ns >= rate_window_ns)
                        rate_roll(s, now);
        }
        pthread_mutex_unlock(&rate_lock);
}

void epd_log(int priority, const char *fmt, ...)
{
        va_list ap;

        if (priority > atomic_load(&log_level))
                return;
        if (priority < LOG_DEBUG && !rate_admit(priority, fmt))
                return;
        va_start(ap, fmt);
        log_write(priority, fmt, ap);
        va_end(ap);
}
