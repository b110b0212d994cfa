/* util.h - small helpers shared by the daemon and libepd: time, randomness, secrets. */
#ifndef EPD_COMMON_UTIL_H
#define EPD_COMMON_UTIL_H

#include <stddef.h>
#include <stdint.h>

#define EPD_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

uint64_t epd__now_ns(void);        /* CLOCK_MONOTONIC */

/* One step of a busy-wait loop: tells the core (and its hyperthread sibling) that we spin. */
static inline void epd__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
}
int epd__random_bytes(void *buf, size_t len); /* getrandom; 0 or -errno */
/* Compares without an early exit, so the time taken does not reveal where a secret differs. */
int epd__consttime_equal(const void *a, size_t a_len, const void *b, size_t b_len);
int epd__status_from_wire(int code);
int epd__status_to_wire(int status);

#endif
