/* arena.h - a rank's daemon-owned output arena (docs/architecture.md, "Output arenas, and resizing
 * them"): memory exported to the client once, in which the daemon places exact-size dispatch
 * outputs after counting.
 *
 * Memory: a range of address space reserved once (`reserved` bytes at `base`, PROT_NONE), in
 * which segments are mapped back to back from offset 0. Each segment is its own sealed memfd
 * that the client maps at the same offset of its own reservation, so `epctl resize` can grow the
 * arena (map one more segment) or shrink it (drop the segments above the new end) without the
 * base moving in either process. `generation` counts those changes; replies tell it to clients.
 *
 * Allocation: first-fit over a sorted list of free extents of [0, bytes), 256-byte aligned.
 * Allocation happens on backend threads (after counting), release and resizing on the loop
 * thread (resizing only while no op of the group executes), so the allocator has its own mutex.
 * The segment list changes only on the loop thread.
 */
#ifndef EPD_DAEMON_ARENA_H
#define EPD_DAEMON_ARENA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "epd.h"

#define EPD_ARENA_ALIGN 256u

struct epdd_backend;

/* Output fields an arena can hold, in placement order. */
enum epdd_out_field {
        EPD_OUT_RECV_X,
        EPD_OUT_RECV_SCALES,
        EPD_OUT_RECV_TOPK_IDX,
        EPD_OUT_RECV_WEIGHTS,
        EPD_OUT_RECV_SRC,
        EPD_OUT_RECV_TOPK_SLOT,
        EPD_OUT_FIELDS
};

/* Where a rank's dispatch outputs sit in its arena: one extent holding every field. */
struct epdd_arena_place {
        int used;
        struct epdd_arena *arena;      /* the arena placed in: released there, even after the
                                       * rank's arena was replaced (core/group.c) */
        uint64_t ext_off, ext_len;
        uint64_t off[EPD_OUT_FIELDS]; /* absolute offsets in the arena; UINT64_MAX: absent */
};

struct epdd_arena_extent {
        uint64_t off, len;
};

struct epdd_arena_segment {
        uint64_t off, bytes;          /* inside the reservation; page multiples */
        int fd;                       /* sealed memfd, sent to the client; owned */
        uint64_t serial;              /* unique within the arena */
};

struct epdd_arena {
        uint8_t *base;                /* daemon address of offset 0 */
        uint64_t bytes;               /* usable: outputs are placed in [0, bytes) */
        uint64_t reserved;            /* address space at base: the most bytes can grow to */
        enum epd_region_kind kind;
        struct epdd_arena_segment *segs; /* by offset; [0].off == 0, contiguous */
        unsigned num_segs, max_segs;
        uint64_t mapped;              /* end of the last segment, >= bytes */
        uint64_t generation;          /* bumped by every resize that changes bytes or segments */
        uint64_t next_serial;
        /* Memory made by epd_arena_create through a backend; NULL: the caller's memory. */
        struct epdd_backend *backend;
        uint32_t device;
        int host_memory;
        pthread_mutex_t lock;         /* guards the allocator below, and bytes while resizing */
        struct epdd_arena_extent *free_list; /* sorted by offset, coalesced */
        unsigned num_free, cap_free;
        uint64_t used;
};

/* An allocator over caller-owned memory [base, base + bytes) exported as one segment with fd
 * (owned by the arena from here on; -1 for none). It cannot be resized. */
struct epdd_arena *epd_arena_new(uint8_t *base, uint64_t bytes, int fd, enum epd_region_kind kind);
/* What an arena of `bytes` maps (created or resized to it): the page multiple at or above. */
uint64_t epd_arena_mapped_bytes(uint64_t bytes);
/* Creates an arena of `bytes` for a rank on `device`: reserves max(reserve_bytes, bytes) of
 * address space (only bytes when the larger reservation fails) and maps the first segment
 * through the backend (host_memory as in backend.h's arena_map). max_segments bounds the
 * segments resizes may add. 0, or EPD_UNAVAILABLE with err set. */
int epd_arena_create(struct epdd_backend *b, uint32_t device, int host_memory, uint64_t bytes,
                     uint64_t reserve_bytes, unsigned max_segments, struct epdd_arena **out,
                     char *err, size_t err_len);
/* Frees the allocator, closes the fds and, for a created arena, unmaps its memory and its
 * reservation. No op may use it. NULL ok. */
void epd_arena_free(struct epdd_arena *a);
/* Resizes a created arena to `bytes` (1..reserved): a grow maps one more segment when the
 * mapped ones do not reach bytes; a shrink stops at the end of the highest live placement
 * and drops the segments that lie wholly above the new end. *new_bytes is the size reached.
 * Loop thread, with no op of the arena's group executing. 0, EPD_INVALID_ARGUMENT, or
 * EPD_UNAVAILABLE (memory, or max_segments reached); on error nothing changed. */
int epd_arena_resize(struct epdd_arena *a, uint64_t bytes, uint64_t *new_bytes, char *err,
                     size_t err_len);
/* Allocates len bytes (rounded up to EPD_ARENA_ALIGN). 0 with *off set, or -ENOMEM. */
int epd_arena_alloc(struct epdd_arena *a, uint64_t len, uint64_t *off);
void epd_arena_release(struct epdd_arena *a, uint64_t off, uint64_t len);
uint64_t epd_arena_used(struct epdd_arena *a);
/* Largest free extent, for error messages. */
uint64_t epd_arena_largest_free(struct epdd_arena *a);
/* The smallest size the arena can shrink to: the end of its highest live placement. */
uint64_t epd_arena_floor(struct epdd_arena *a);

#endif
