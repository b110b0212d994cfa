/* resize.h - `epctl resize` (resize.c): growing and shrinking a group's output arenas with its
 * ops drained, and the ArenaSegments request through which clients map the segments. Loop
 * thread. */
#ifndef EPD_DAEMON_RESIZE_H
#define EPD_DAEMON_RESIZE_H

#include "daemon.h"

/* A Resize request waiting for the group's executing op (group->resize). */
struct epdd_resize {
        uint64_t conn_id;             /* the requester; it may be gone by the time it is done */
        uint64_t request_id;
        uint64_t bytes;
        uint64_t start_ns;
};

/* Answers a Resize request (admin.c has checked conn->admin). req stays owned by the caller. */
void epd_resize_request(struct epdd_conn *c, const Epd__V1__Request *req);
/* The group's executing op completed: runs a pending resize. The caller kicks the group. */
void epd_resize_continue(struct epdd_group *g);
/* The group is going away: a pending resize fails with ABORTED. */
void epd_resize_abort(struct epdd_group *g);
/* Answers ArenaSegments: the rank's segment list and the fds of the segments from `first` on
 * (none when first is past the last: a client that still maps dropped segments learns of
 * the shorter list). */
void epd_handle_arena_segments(struct epdd_conn *c, const Epd__V1__Request *req);
/* Fills the arena fields of GroupJoined for rank r and returns the fd of the first segment
 * (-1: no arena). segs/ptrs: room for the arena's segments (arena->num_segs), alive until the
 * reply is sent. */
int epd_resize_fill_joined(const struct epdd_rank *r, Epd__V1__GroupJoined *j,
                           Epd__V1__ArenaSegment *segs, Epd__V1__ArenaSegment **ptrs);

#endif
