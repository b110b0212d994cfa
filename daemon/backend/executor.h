/* executor.h - the thread that runs a backend's ops: it takes from its queue the first exec that
 * can go (when the backend asks for host input waits, one whose clients have marked their
 * inputs ready; an exec still waiting never holds back another group's), runs the backend's
 * function on it, times it, and hands it back to the loop with epd_exec_done. An exec aborted or
 * timed out while queued is handed back without running. It also keeps a heartbeat for the
 * watchdog. Shared by every backend. */
#ifndef EPD_DAEMON_EXECUTOR_H
#define EPD_DAEMON_EXECUTOR_H

#include <pthread.h>
#include <stdatomic.h>

#include "backend.h"

struct epdd_executor {
        struct epdd_backend *b;
        void (*run)(void *ctx, struct epdd_exec *ex); /* sets ex->status and ex->message */
        void (*idle)(void *ctx);      /* housekeeping between ops (may be NULL), unlocked */
        void *ctx;
        int host_input_waits;         /* wait for inputs_ready on the host before run */
        pthread_t thread;
        pthread_mutex_t lock;
        pthread_cond_t cond;
        struct epd_list queue;
        int stop, started, kicked;
        atomic_uint_fast64_t heartbeat_ns;
        /* Polling before sleeping: set by the backend before epd_executor_start (0: never). */
        uint64_t spin_ns;
        atomic_uint queued;           /* execs in the queue, read without the lock while polling */
};

int epd_executor_start(struct epdd_executor *e);
void epd_executor_submit(struct epdd_executor *e, struct epdd_exec *ex);
/* Wakes the thread to run `idle` soon. */
void epd_executor_kick(struct epdd_executor *e);
/* Runs what is queued, then joins the thread. */
void epd_executor_stop(struct epdd_executor *e);
/* 0 while the thread made progress within the last minute (an idle thread wakes every second). */
int epd_executor_alive(struct epdd_executor *e);

#endif
