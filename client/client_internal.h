/* client_internal.h - libepd internals shared by client.c, ops.c and epctl: the connection,
 * the request/response exchange and the local region table. Not installed. */
#ifndef EPD_CLIENT_INTERNAL_H
#define EPD_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "doorbell.h"
#include "frame.h"

struct epd__stashed {
        struct epd__stashed *next;
        uint64_t read_ns;             /* when its frame was read (CLOCK_MONOTONIC) */
        Epd__V1__Response *resp;
        int fds[2];
        unsigned num_fds;
};

struct epd__local_region {
        uint64_t id;
        uint8_t *ptr;                 /* local mapping (or device address), NULL when unknown */
        uint64_t bytes;
        int owned;                    /* mapping made by libepd: unmap on release */
        /* GPU memory registered by epd_region_register_device: ptr and bytes are the whole
         * CUDA allocation, the registration cache's key. */
        int device_mem;
        uint32_t device;              /* the daemon's device index */
        uint64_t buffer_id;           /* CUDA's process-unique allocation id; 0 unknown */
        /* Host memfd regions registered with a local pointer: a dup of the memfd, which
         * epd_cx_register shares with a client-executed group's peers; else -1. */
        int fd;
};

/* GPU memory made by epd_device_alloc (client/cuda.c): a cuMem allocation mapped at its own
 * reserved address range, which the client owns until epd_device_free or epd_client_free. */
struct epd__device_alloc {
        uint64_t base;                /* device address (CUdeviceptr) */
        uint64_t bytes;               /* reserved and mapped: the request rounded up */
        int ordinal;                  /* CUDA device ordinal in this process */
        void *ctx;                    /* the device's primary context, retained meanwhile */
};

struct epd_client {
        int fd;
        pthread_mutex_t lock;
        uint64_t next_id;
        int timeout_ms;
        uint64_t last_read_ns;        /* when the reply epd__client_wait_locked returned last
                                       * was read from the socket */
        uint64_t poll_ns;             /* how long a wait for a reply polls before it sleeps */
        uint64_t spin_ns;             /* how long a wait in the doorbell page polls after a
                                       * wake-up (EPD_CLIENT_SPIN_US) */
        int mailbox;                  /* ask for replies in the doorbell page (EPD_CLIENT_REPLY) */
        int page_requests;            /* post requests in the doorbell page when the daemon
                                       * polls (EPD_CLIENT_REQUEST) */
        uint64_t last_socket_id;      /* id of the last request sent on the socket */
        int broken;                   /* the connection failed; every call fails */
        char last_error[512];
        struct epd_daemon_info info;
        uint64_t daemon_caps;         /* Welcome.capabilities */
        uint8_t *rbuf;
        size_t rbuf_len;
        uint32_t max_frame;
        struct epd__stashed *stash;
        struct epd__local_region *regions;
        unsigned num_regions, cap_regions;
        struct epd__device_alloc *device_allocs; /* under lock */
        unsigned num_device_allocs, cap_device_allocs;
};

/* A segment of a rank's output arena as libepd mapped it (proto/epd.proto, ArenaSegment). */
struct epd__arena_segment {
        uint64_t off, bytes, serial;
};

struct epd_group {
        struct epd_client *client;
        uint64_t id;
        uint32_t rank;
        uint32_t device;
        struct epd_group_config config;
        /* The output arena: address space reserved once at join (arena_reserved bytes at
         * arena), with the daemon's segments mapped at their offsets, so that a resize never
         * moves it. Changed under the client's lock. */
        uint8_t *arena;
        uint64_t arena_bytes;         /* usable bytes as of arena_generation */
        uint64_t arena_reserved;
        uint64_t arena_generation;
        uint64_t arena_mapped_end;    /* end of the segments mapped */
        struct epd__arena_segment *arena_segs;
        unsigned num_arena_segs;
        uint64_t arena_region_id;
        struct epd_doorbell *doorbell; /* mapped doorbell page (common/doorbell.h) */
        uint64_t doorbell_bytes;      /* its mapped size */
        uint64_t mailbox_id;          /* request whose reply comes in the page; 0: none */
        void *doorbell_dev;           /* its device address once registered with CUDA */
        uint64_t submitted;           /* ops this rank submitted since it was bound */
        uint64_t inputs_marked;       /* inputs_ready values handed out */
        /* Client-executed groups (cx.c): every rank's buffer, mapped once at join. */
        struct epd__cx_group *cx;
};

/* cx.c: a client-executed group's buffers as this process maps them. */
struct epd__cx_group;
/* Maps the buffers GroupJoined announced (fd: the host backend's memfd of all R buffers, taken).
 * 0, or a negative status with the reason recorded on the client. */
int epd__cx_enter(struct epd_group *g, const Epd__V1__GroupJoined *j, int fd);
/* Unmaps them; NULL does nothing. */
void epd__cx_leave(struct epd__cx_group *cx);

#ifdef EPD_HAVE_CUDA
/* cuda.c: the CUDA ordinal of this process's device with the UUID of daemon device
 * daemon_device (0, or EPD_NOT_FOUND recorded on the client); whether CUDA MPS is enabled on it
 * (0 when it cannot be told; records nothing). */
int epd__cuda_ordinal(struct epd_client *c, uint32_t daemon_device, int *ordinal);
int epd__cuda_mps_enabled(struct epd_client *c, uint32_t daemon_device);

/* cx_cuda.c: a client-executed group's buffers in device memory (the cuda backend). */
struct epd__cx_dev;
struct cx_layout;
struct epd_cx_dispatch_args;
struct epd_cx_combine_args;
/* Imports the buffers (fd, always taken) of `total` bytes, rank r's at r * stride, and maps them
 * on this process's device of the group; *base is their device address. */
int epd__cx_dev_enter(struct epd_group *g, const struct cx_layout *l, int fd, uint64_t total,
                      uint64_t stride, struct epd__cx_dev **out, uint8_t **base);
void epd__cx_dev_leave(struct epd__cx_dev *d);
/* Queue one op of the group's rank on stream (a cudaStream_t); 0 or a status recorded. */
int epd__cx_dev_dispatch(struct epd_group *g, struct epd__cx_dev *d,
                         const struct epd_cx_dispatch_args *a, void *stream);
int epd__cx_dev_combine(struct epd_group *g, struct epd__cx_dev *d,
                        const struct epd_cx_combine_args *a, void *stream);
/* Copies device memory of the buffers to the host, synchronously. 0 or EPD_INTERNAL. */
int epd__cx_dev_read(struct epd__cx_dev *d, const void *src, void *dst, size_t bytes);
#endif

/* Records a failure on the client and returns status. */
int epd__client_fail(struct epd_client *c, int status, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
/* Sends req with fds, assigning its id unless it has one (an op record's, from the same
 * counter). Lock held by the caller. */
int epd__client_send_locked(struct epd_client *c, Epd__V1__Request *req, const int *fds,
                            unsigned num_fds);
/* Waits for the response to request id. On success *resp is owned by the caller and fds it
 * carried are returned in fds_out (up to 2; -1 when absent). timeout_ms < 0: forever. Lock
 * held by the caller. Returns 0, EPD_TIMEOUT, or EPD_UNAVAILABLE (connection lost). */
int epd__client_wait_locked(struct epd_client *c, uint64_t id, int timeout_ms,
                            Epd__V1__Response **resp, int *fds_out);
/* The same without waiting and without recording anything: EPD_TIMEOUT when the reply has not
 * come yet. */
int epd__client_try_locked(struct epd_client *c, uint64_t id, Epd__V1__Response **resp,
                           int *fds_out);
/* Sends req and waits for its response with the client's timeout. Converts a non-OK status to
 * the return value and records its message. *resp is owned by the caller on success. */
int epd__client_call(struct epd_client *c, Epd__V1__Request *req, const int *fds,
                     unsigned num_fds, Epd__V1__Response **resp, int *fds_out);
/* Adds an entry to the local region table, in address order (lock held). */
int epd__client_region_add(struct epd_client *c, uint64_t id, void *ptr, uint64_t bytes,
                           int owned);
/* Removes entry i of the region table, keeping its order. Lock held. */
void epd__client_region_remove_at(struct epd_client *c, unsigned i);
/* Sends RegionRegister (fd: -1 for none; ipc_handle: NULL for none) and adds the region to the
 * local table with local_ptr/bytes. On success *region_id is the daemon's id. Lock not held. */
int epd__client_region_register(struct epd_client *c, enum epd_region_kind kind, int fd,
                                const void *ipc_handle, size_t ipc_len, uint64_t bytes,
                                uint64_t offset, uint32_t device, void *local_ptr,
                                uint64_t *region_id);
/* Local address of region `id` + offset, or NULL. */
void *epd__client_region_ptr(struct epd_client *c, uint64_t id, uint64_t offset);

/* Brings the group's arena mapping up to the daemon's (ArenaSegments): maps new segments,
 * replaces changed ones, drops those the daemon dropped, and updates the size in the region
 * table. Lock held. 0, or a negative status with the client's error set. */
int epd__group_arena_sync_locked(struct epd_group *group);

/* Releases what the stream-ordering functions set up for a group (CUDA registration of its
 * doorbell page); a no-op without CUDA. */
void epd__group_stream_fini(struct epd_group *group);
/* Unmaps and frees every allocation of epd_device_alloc still held by the client, without
 * telling the daemon (epd_client_free: the connection's close releases the regions); a no-op
 * without CUDA. */
void epd__device_alloc_free_all(struct epd_client *c);
struct epd_group *epd__op_group(const struct epd_op *op);

#endif
