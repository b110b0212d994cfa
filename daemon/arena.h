/* arena.h - a rank's daemon-owned output arena (DESIGN.md section 2): memory exported to the
 * client once, in which the daemon places exact-size dispatch outputs after counting.
 *
 * The allocator is first-fit over a sorted list of free extents, 256-byte aligned. Allocation
 * happens on backend threads (after counting), release on the loop thread (handle release), so
 * the allocator has its own mutex; nothing else in the arena changes after creation.
 */
#ifndef EPD_DAEMON_ARENA_H
#define EPD_DAEMON_ARENA_H

#include <pthread.h>
#include <stdint.h>

#include "epd.h"

#define EPD_ARENA_ALIGN 256u

struct epd_arena_extent {
        uint64_t off, len;
};

struct epd_arena {
        uint8_t *base;                /* daemon address */
        uint64_t bytes;
        int fd;                       /* exported to the client at join; owned */
        enum epd_region_kind kind;
        pthread_mutex_t lock;
        struct epd_arena_extent *free_list; /* sorted by offset, coalesced */
        unsigned num_free, cap_free;
        uint64_t used;
};

struct epd_arena *epd_arena_new(uint8_t *base, uint64_t bytes, int fd, enum epd_region_kind kind);
/* Frees the allocator and closes the fd; the memory itself belongs to the backend. NULL ok. */
void epd_arena_free(struct epd_arena *a);
/* Allocates len bytes (rounded up to EPD_ARENA_ALIGN). 0 with *off set, or -ENOMEM. */
int epd_arena_alloc(struct epd_arena *a, uint64_t len, uint64_t *off);
void epd_arena_release(struct epd_arena *a, uint64_t off, uint64_t len);
uint64_t epd_arena_used(struct epd_arena *a);
/* Largest free extent, for error messages. */
uint64_t epd_arena_largest_free(struct epd_arena *a);

#endif
