/* client_internal.h - libepd internals shared by client.c, ops.c and epctl: the connection,
 * the request/response exchange and the local region table. Not installed. */
#ifndef EPD_CLIENT_INTERNAL_H
#define EPD_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "frame.h"

struct epd__stashed {
        struct epd__stashed *next;
        Epd__V1__Response *resp;
        int fds[2];
        unsigned num_fds;
};

struct epd__local_region {
        uint64_t id;
        uint8_t *ptr;                 /* local mapping, or NULL when unknown */
        uint64_t bytes;
        int owned;                    /* mapping made by libepd: unmap on release */
};

struct epd_client {
        int fd;
        pthread_mutex_t lock;
        uint64_t next_id;
        int timeout_ms;
        int broken;                   /* the connection failed; every call fails */
        char last_error[512];
        struct epd_daemon_info info;
        uint8_t *rbuf;
        size_t rbuf_len;
        uint32_t max_frame;
        struct epd__stashed *stash;
        struct epd__local_region *regions;
        unsigned num_regions, cap_regions;
};

struct epd_group {
        struct epd_client *client;
        uint64_t id;
        uint32_t rank;
        uint32_t device;
        struct epd_group_config config;
        uint8_t *arena;
        uint64_t arena_bytes;
        uint64_t arena_region_id;
};

/* Records a failure on the client and returns status. */
int epd__client_fail(struct epd_client *c, int status, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
/* Sends req (assigning its id) with fds. Lock held by the caller. */
int epd__client_send_locked(struct epd_client *c, Epd__V1__Request *req, const int *fds,
                            unsigned num_fds);
/* Waits for the response to request id. On success *resp is owned by the caller and fds it
 * carried are returned in fds_out (up to 2; -1 when absent). timeout_ms < 0: forever. Lock
 * held by the caller. Returns 0, EPD_TIMEOUT, or EPD_UNAVAILABLE (connection lost). */
int epd__client_wait_locked(struct epd_client *c, uint64_t id, int timeout_ms,
                            Epd__V1__Response **resp, int *fds_out);
/* Sends req and waits for its response with the client's timeout. Converts a non-OK status to
 * the return value and records its message. *resp is owned by the caller on success. */
int epd__client_call(struct epd_client *c, Epd__V1__Request *req, const int *fds,
                     unsigned num_fds, Epd__V1__Response **resp, int *fds_out);
/* Adds an entry to the local region table (lock held). */
int epd__client_region_add(struct epd_client *c, uint64_t id, void *ptr, uint64_t bytes,
                           int owned);
/* Local address of region `id` + offset, or NULL. */
void *epd__client_region_ptr(struct epd_client *c, uint64_t id, uint64_t offset);

#endif
