/* util.c - time, randomness and constant-time comparison. */
#include <errno.h>
#include <sys/random.h>
#include <time.h>

#include "util.h"

uint64_t epd__now_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int epd__random_bytes(void *buf, size_t len)
{
        uint8_t *p = buf;

        while (len) {
                ssize_t n = getrandom(p, len, 0);
                if (n < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                p += n;
                len -= (size_t)n;
        }
        return 0;
}

int epd__consttime_equal(const void *a, size_t a_len, const void *b, size_t b_len)
{
        const volatile uint8_t *pa = a, *pb = b;
        uint8_t diff = (uint8_t)(a_len != b_len);
        size_t n = a_len < b_len ? a_len : b_len;

        for (size_t i = 0; i < n; i++)
                diff |= pa[i] ^ pb[i];
        return diff == 0;
}
