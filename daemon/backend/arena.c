/* arena.c - an output arena: its memory (a reservation with segments mapped through the
 * backend) and the first-fit extent allocator over it. See arena.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "backend.h"
#include "memfd.h"

static uint64_t round_up(uint64_t len)
{
        return (len + EPD_ARENA_ALIGN - 1) / EPD_ARENA_ALIGN * EPD_ARENA_ALIGN;
}

static uint64_t page_up(uint64_t bytes)
{
        uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);

        return (bytes + page - 1) / page * page;
}

static struct epdd_arena *arena_alloc(uint64_t bytes, enum epd_region_kind kind, unsigned max_segs)
{
        struct epdd_arena *a = calloc(1, sizeof(*a));

        if (!a)
                return NULL;
        a->cap_free = 16;
        a->free_list = calloc(a->cap_free, sizeof(*a->free_list));
        a->max_segs = max_segs ? max_segs : 1;
        a->segs = calloc(a->max_segs, sizeof(*a->segs));
        if (!a->free_list || !a->segs) {
                free(a->free_list);
                free(a->segs);
                free(a);
                return NULL;
        }
        a->bytes = bytes;
        a->kind = kind;
        a->generation = 1;
        a->free_list[0] = (struct epdd_arena_extent){ 0, bytes };
        a->num_free = bytes ? 1 : 0;
        pthread_mutex_init(&a->lock, NULL);
        return a;
}

struct epdd_arena *epd_arena_new(uint8_t *base, uint64_t bytes, int fd, enum epd_region_kind kind)
{
        struct epdd_arena *a = arena_alloc(bytes, kind, 1);

        if (!a)
                return NULL;
        a->base = base;
        a->reserved = bytes;
        a->mapped = bytes;
        a->segs[0] = (struct epdd_arena_segment){ 0, bytes, fd, ++a->next_serial };
        a->num_segs = 1;
        return a;
}

/* Maps segment [off, off + bytes) and appends it. */
static int segment_add(struct epdd_arena *a, uint64_t off, uint64_t bytes, char *err,
                       size_t err_len)
{
        struct epdd_backend *b = a->backend;
        enum epd_region_kind kind;
        int fd = -1, rc;

        if (a->num_segs >= a->max_segs) {
                snprintf(err, err_len,
                         "the arena has %u segments, the limit max_arena_segments (resize in fewer, larger steps)",
                         a->num_segs);
                return EPD_UNAVAILABLE;
        }
        rc = b->ops->arena_map(b, a->device, a->host_memory, a->base + off, bytes, &fd, &kind,
                               err, err_len);
        if (rc < 0)
                return rc;
        a->kind = kind;
        a->segs[a->num_segs++] = (struct epdd_arena_segment){ off, bytes, fd, ++a->next_serial };
        a->mapped = off + bytes;
        return 0;
}

static void segment_drop_last(struct epdd_arena *a)
{
        struct epdd_arena_segment *s = &a->segs[--a->num_segs];

        if (a->backend)
                a->backend->ops->arena_unmap(a->backend, a->base + s->off, s->bytes);
        if (s->fd >= 0)
                close(s->fd);
        a->mapped = s->off;
        memset(s, 0, sizeof(*s));
}

uint64_t epd_arena_mapped_bytes(uint64_t bytes)
{
        return page_up(bytes);
}

int epd_arena_create(struct epdd_backend *b, uint32_t device, int host_memory, uint64_t bytes,
                     uint64_t reserve_bytes, unsigned max_segments, struct epdd_arena **out,
                     char *err, size_t err_len)
{
        uint64_t first = page_up(bytes), reserve = page_up(reserve_bytes);
        struct epdd_arena *a = arena_alloc(bytes, EPD_REGION_HOST_MEMFD, max_segments);
        int rc;

        if (!a) {
                snprintf(err, err_len, "out of memory");
                return EPD_UNAVAILABLE;
        }
        a->backend = b;
        a->device = device;
        a->host_memory = host_memory;
        if (reserve < first)
                reserve = first;
        /* A large reservation costs only address space; where even that runs short, the
         * arena keeps its size and cannot grow. */
        rc = epd__va_reserve(reserve, &a->base, err, err_len);
        if (rc < 0 && reserve > first) {
                reserve = first;
                rc = epd__va_reserve(reserve, &a->base, err, err_len);
        }
        if (rc < 0) {
                a->base = NULL;
                epd_arena_free(a);
                return rc;
        }
        a->reserved = reserve;
        rc = segment_add(a, 0, first, err, err_len);
        if (rc < 0) {
                epd_arena_free(a);
                return rc;
        }
        *out = a;
        return 0;
}

void epd_arena_free(struct epdd_arena *a)
{
        if (!a)
                return;
        while (a->num_segs)
                segment_drop_last(a);
        if (a->backend)
                epd__va_unreserve(a->base, a->reserved);
        pthread_mutex_destroy(&a->lock);
        free(a->segs);
        free(a->free_list);
        free(a);
}

/* The end of the highest live placement: the last free extent reaches the end of the range
 * when the top of the arena is free. Lock held. */
static uint64_t floor_locked(const struct epdd_arena *a)
{
        if (a->num_free == 0)
                return a->bytes;
        const struct epdd_arena_extent *last = &a->free_list[a->num_free - 1];
        return last->off + last->len == a->bytes ? last->off : a->bytes;
}

uint64_t epd_arena_floor(struct epdd_arena *a)
{
        uint64_t f;

        pthread_mutex_lock(&a->lock);
        f = floor_locked(a);
        pthread_mutex_unlock(&a->lock);
        return f;
}

/* Moves the end of the allocator's range to bytes (>= the floor). Lock held. Returns -ENOMEM
 * when the free list cannot take one more extent. */
static int set_bytes_locked(struct epdd_arena *a, uint64_t bytes)
{
        struct epdd_arena_extent *last = a->num_free ? &a->free_list[a->num_free - 1] : NULL;
        int top_free = last && last->off + last->len == a->bytes;

        if (bytes > a->bytes) {
                if (top_free) {
                        last->len += bytes - a->bytes;
                } else {
                        if (a->num_free == a->cap_free) {
                                unsigned cap = a->cap_free * 2;
                                struct epdd_arena_extent *n =
                                        realloc(a->free_list, cap * sizeof(*n));
                                if (!n)
                                        return -ENOMEM;
                                a->free_list = n;
                                a->cap_free = cap;
                        }
                        a->free_list[a->num_free++] =
                                (struct epdd_arena_extent){ a->bytes, bytes - a->bytes };
                }
        } else if (bytes < a->bytes) {
                /* The caller never goes below the floor: the top is free down to bytes. */
                if (last->off == bytes)
                        a->num_free--;
                else
                        last->len = bytes - last->off;
        }
        a->bytes = bytes;
        return 0;
}

int epd_arena_resize(struct epdd_arena *a, uint64_t bytes, uint64_t *new_bytes, char *err,
                     size_t err_len)
{
        uint64_t target = bytes, old_bytes = a->bytes;
        unsigned old_segs = a->num_segs;
        int rc;

        if (!a->backend || bytes == 0 || bytes > a->reserved) {
                snprintf(err, err_len, "%llu bytes outside 1..%llu, the arena's reserved range",
                         (unsigned long long)bytes, (unsigned long long)a->reserved);
                return EPD_INVALID_ARGUMENT;
        }
        if (bytes > a->mapped) {
                rc = segment_add(a, a->mapped, page_up(bytes) - a->mapped, err, err_len);
                if (rc < 0)
                        return rc;
        }
        pthread_mutex_lock(&a->lock);
        if (target < floor_locked(a))
                target = floor_locked(a);
        rc = set_bytes_locked(a, target);
        pthread_mutex_unlock(&a->lock);
        if (rc < 0) {
                if (a->num_segs > old_segs)
                        segment_drop_last(a);
                snprintf(err, err_len, "out of memory");
                return EPD_UNAVAILABLE;
        }
        /* Segments wholly above the new end hold nothing live: drop them. The first segment
         * always stays (target >= 1). */
        while (a->num_segs > 1 && a->segs[a->num_segs - 1].off >= page_up(target))
                segment_drop_last(a);
        if (a->bytes != old_bytes || a->num_segs != old_segs)
                a->generation++;
        *new_bytes = a->bytes;
        return 0;
}

int epd_arena_alloc(struct epdd_arena *a, uint64_t len, uint64_t *off)
{
        int rc = -ENOMEM;

        /* Rounding a length near UINT64_MAX up would wrap to a tiny extent. */
        if (len > a->bytes)
                return -ENOMEM;
        len = round_up(len ? len : 1);
        pthread_mutex_lock(&a->lock);
        for (unsigned i = 0; i < a->num_free; i++) {
                struct epdd_arena_extent *e = &a->free_list[i];
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

void epd_arena_release(struct epdd_arena *a, uint64_t off, uint64_t len)
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
                        struct epdd_arena_extent *n = realloc(a->free_list, cap * sizeof(*n));
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
                a->free_list[i] = (struct epdd_arena_extent){ off, len };
                a->num_free++;
        }
        a->used -= len;
        pthread_mutex_unlock(&a->lock);
}

uint64_t epd_arena_used(struct epdd_arena *a)
{
        uint64_t used;

        pthread_mutex_lock(&a->lock);
        used = a->used;
        pthread_mutex_unlock(&a->lock);
        return used;
}

uint64_t epd_arena_largest_free(struct epdd_arena *a)
{
        uint64_t best = 0;

        pthread_mutex_lock(&a->lock);
        for (unsigned i = 0; i < a->num_free; i++)
                if (a->free_list[i].len > best)
                        best = a->free_list[i].len;
        pthread_mutex_unlock(&a->lock);
        return best;
}
