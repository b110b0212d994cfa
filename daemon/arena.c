/* arena.c - first-fit extent allocator of an output arena. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"

static uint64_t round_up(uint64_t len)
{
        return (len + EPD_ARENA_ALIGN - 1) / EPD_ARENA_ALIGN * EPD_ARENA_ALIGN;
}

struct epd_arena *epd_arena_new(uint8_t *base, uint64_t bytes, int fd, enum epd_region_kind kind)
{
        struct epd_arena *a = calloc(1, sizeof(*a));

        if (!a)
                return NULL;
        a->cap_free = 16;
        a->free_list = calloc(a->cap_free, sizeof(*a->free_list));
        if (!a->free_list) {
                free(a);
                return NULL;
        }
        a->base = base;
        a->bytes = bytes;
        a->fd = fd;
        a->kind = kind;
        a->free_list[0] = (struct epd_arena_extent){ 0, bytes };
        a->num_free = bytes ? 1 : 0;
        pthread_mutex_init(&a->lock, NULL);
        return a;
}

void epd_arena_free(struct epd_arena *a)
{
        if (!a)
                return;
        if (a->fd >= 0)
                close(a->fd);
        pthread_mutex_destroy(&a->lock);
        free(a->free_list);
        free(a);
}

int epd_arena_alloc(struct epd_arena *a, uint64_t len, uint64_t *off)
{
        int rc = -ENOMEM;

        /* Rounding a length near UINT64_MAX up would wrap to a tiny extent. */
        if (len > a->bytes)
                return -ENOMEM;
        len = round_up(len ? len : 1);
        pthread_mutex_lock(&a->lock);
        for (unsigned i = 0; i < a->num_free; i++) {
                struct epd_arena_extent *e = &a->free_list[i];
                if (e->len < len)
                        continue;
                *off = e->off;
                e->off += len;
                e->len -= len;
                if (e->len == 0) {
                        memmove(e, e + 1, (a->num_free - i - 1) * sizeof(*e));
                        a->num_free--;
                }
                a->used += len;
                rc = 0;
                break;
        }
        pthread_mutex_unlock(&a->lock);
        return rc;
}

void epd_arena_release(struct epd_arena *a, uint64_t off, uint64_t len)
{
        unsigned i;

        len = round_up(len ? len : 1);
        pthread_mutex_lock(&a->lock);
        for (i = 0; i < a->num_free && a->free_list[i].off < off; i++)
                ;
        /* Merge with the previous and/or next extent, else insert. */
        int merge_prev = i > 0 && a->free_list[i - 1].off + a->free_list[i - 1].len == off;
        int merge_next = i < a->num_free && off + len == a->free_list[i].off;
        if (merge_prev && merge_next) {
                a->free_list[i - 1].len += len + a->free_list[i].len;
                memmove(&a->free_list[i], &a->free_list[i + 1],
                        (a->num_free - i - 1) * sizeof(*a->free_list));
                a->num_free--;
        } else if (merge_prev) {
                a->free_list[i - 1].len += len;
        } else if (merge_next) {
                a->free_list[i].off = off;
                a->free_list[i].len += len;
        } else {
                if (a->num_free == a->cap_free) {
                        unsigned cap = a->cap_free * 2;
                        struct epd_arena_extent *n = realloc(a->free_list, cap * sizeof(*n));
                        if (!n) {
                                /* Losing track of one extent leaks arena space but keeps every
                                 * live placement intact; report it through the used figure. */
                                pthread_mutex_unlock(&a->lock);
                                return;
                        }
                        a->free_list = n;
                        a->cap_free = cap;
                }
                memmove(&a->free_list[i + 1], &a->free_list[i],
                        (a->num_free - i) * sizeof(*a->free_list));
                a->free_list[i] = (struct epd_arena_extent){ off, len };
                a->num_free++;
        }
        a->used -= len;
        pthread_mutex_unlock(&a->lock);
}

uint64_t epd_arena_used(struct epd_arena *a)
{
        uint64_t used;

        pthread_mutex_lock(&a->lock);
        used = a->used;
        pthread_mutex_unlock(&a->lock);
        return used;
}

uint64_t epd_arena_largest_free(struct epd_arena *a)
{
        uint64_t best = 0;

        pthread_mutex_lock(&a->lock);
        for (unsigned i = 0; i < a->num_free; i++)
                if (a->free_list[i].len > best)
                        best = a->free_list[i].len;
        pthread_mutex_unlock(&a->lock);
        return best;
}
