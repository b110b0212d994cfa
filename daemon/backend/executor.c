/* executor.c - see executor.h. */
#include <stdio.h>
#include <sys/prctl.h>
#include <time.h>

#include "executor.h"
#include "util.h"

/* Polls, without the lock, until an exec is queued or spin_ns has passed. */
static void spin_for_work(struct epdd_executor *e)
{
        uint64_t end = epd__now_ns() + e->spin_ns;

        for (unsigned i = 0; atomic_load_explicit(&e->queued, memory_order_acquire) == 0; i++) {
                epd__cpu_relax();
                if ((i & 63) == 63 && epd__now_ns() > end)
                        return;
        }
}

/* The first queued exec that can go now, taken off the queue, with *run telling whether it is to
 * run or only to be completed (aborted, or its input wait timed out); NULL when none can. An exec
 * whose inputs are not ready stays queued and does not hold back those behind it: groups are
 * independent, and a group has at most one op in the backend (daemon/op.c), so taking execs out
 * of order never reorders one group's ops. *youngest_wait_ns gets how long the most recently
 * submitted of the execs left waiting has waited (UINT64_MAX: none). Lock held. */
static struct epdd_exec *take_ready(struct epdd_executor *e, int *run, uint64_t *youngest_wait_ns)
{
        uint64_t now = epd__now_ns();
        struct epd_list *pos;

        *youngest_wait_ns = UINT64_MAX;

        epd_list_for_each(pos, &e->queue)
        {
                struct epdd_exec *ex = epd_list_entry(pos, struct epdd_exec, link);
                int aborted = atomic_load_explicit(&ex->abort_status, memory_order_relaxed);
                int ready = 1;

                if (aborted) {
                        ex->status = aborted;
                        snprintf(ex->message, sizeof(ex->message), "%s before the op ran",
                                 aborted == EPD_ABORTED ? "the daemon is shutting down"
                                                        : "a rank of the group was lost");
                        ready = -1;
                } else if (e->host_input_waits) {
                        ready = epd_exec_inputs_ready(ex, now, ex->submit_ns + ex->timeout_ns);
                }
                if (ready == 0) {
                        uint64_t waited = now > ex->submit_ns ? now - ex->submit_ns : 0;
                        if (waited < *youngest_wait_ns)
                                *youngest_wait_ns = waited;
                        continue;
                }
                if (ready > 0) {
                        ex->status = 0;
                        ex->message[0] = '\0';
                }
                epd_list_del(&ex->link);
                atomic_fetch_sub_explicit(&e->queued, 1, memory_order_relaxed);
                *run = ready > 0;
                return ex;
        }
        return NULL;
}

static void *executor_main(void *arg)
{
        struct epdd_executor *e = arg;

        /* The bounded waits of the backends sleep in small steps (nanosleep); the default 50 us
         * timer slack would stretch each one to tens of microseconds of op latency. */
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        uint64_t idle_wait_ns = 10000, youngest_wait_ns;

        pthread_mutex_lock(&e->lock);
        for (;;) {
                struct epdd_exec *ex;
                int run = 0;

                while (!e->stop && !e->kicked && epd_list_empty(&e->queue)) {
                        struct timespec ts;
                        atomic_store(&e->heartbeat_ns, epd__now_ns());
                        clock_gettime(CLOCK_REALTIME, &ts);
                        ts.tv_sec += 1;
                        pthread_cond_timedwait(&e->cond, &e->lock, &ts);
                }
                if (e->kicked || epd_list_empty(&e->queue)) {
                        e->kicked = 0;
                        pthread_mutex_unlock(&e->lock);
                        if (e->idle)
                                e->idle(e->ctx);
                        pthread_mutex_lock(&e->lock);
                        if (e->stop && epd_list_empty(&e->queue))
                                break;
                        continue;
                }
                ex = take_ready(e, &run, &youngest_wait_ns);
                if (!ex) {
                        /* Every queued exec waits for a client's inputs, which come without a
                         * wake-up (a stream-ordered client's stream stores inputs_ready). While
                         * some exec has waited less than EPD_POLL_WAIT_NS (its client's kernels
                         * still running, the usual case), look again every 10 us; once every one
                         * has waited longer (the loop thread then stops polling too), after a
                         * pause that grows to 1 ms, so that a stalled client costs the daemon,
                         * and the clients beside it, little CPU. A new exec wakes the thread at
                         * once. */
                        struct timespec ts;
                        uint64_t until;
                        if (youngest_wait_ns < EPD_POLL_WAIT_NS)
                                idle_wait_ns = 10000;
                        else
                                idle_wait_ns = idle_wait_ns * 2 > 1000000 ? 1000000
                                                                          : idle_wait_ns * 2;
                        atomic_store(&e->heartbeat_ns, epd__now_ns());
                        clock_gettime(CLOCK_REALTIME, &ts);
                        until = (uint64_t)ts.tv_nsec + idle_wait_ns;
                        ts.tv_sec += (time_t)(until / 1000000000ull);
                        ts.tv_nsec = (long)(until % 1000000000ull);
                        pthread_cond_timedwait(&e->cond, &e->lock, &ts);
                        continue;
                }
                pthread_mutex_unlock(&e->lock);

                uint64_t t0 = epd__now_ns();
                ex->exec_start_ns = t0;
                atomic_store(&e->heartbeat_ns, t0);
                atomic_store_explicit(&e->b->running, 1, memory_order_relaxed);
                if (run)
                        e->run(e->ctx, ex);
                atomic_store_explicit(&e->b->running, 0, memory_order_relaxed);
                ex->exec_ns = epd__now_ns() - t0;
                atomic_store(&e->heartbeat_ns, epd__now_ns());
                epd_exec_done(e->b, ex);

                /* Ops of a running model come back to back: catch the next one without a
                 * thread wake-up. */
                if (e->spin_ns)
                        spin_for_work(e);
                pthread_mutex_lock(&e->lock);
        }
        pthread_mutex_unlock(&e->lock);
        return NULL;
}

int epd_executor_start(struct epdd_executor *e)
{
        epd_list_init(&e->queue);
        atomic_store(&e->queued, 0);
        pthread_mutex_init(&e->lock, NULL);
        pthread_cond_init(&e->cond, NULL);
        atomic_store(&e->heartbeat_ns, epd__now_ns());
        if (pthread_create(&e->thread, NULL, executor_main, e) != 0)
                return -1;
        e->started = 1;
        return 0;
}

void epd_executor_submit(struct epdd_executor *e, struct epdd_exec *ex)
{
        ex->submit_ns = epd__now_ns();
        pthread_mutex_lock(&e->lock);
        epd_list_add_tail(&e->queue, &ex->link);
        atomic_fetch_add_explicit(&e->queued, 1, memory_order_release);
        pthread_cond_signal(&e->cond);
        pthread_mutex_unlock(&e->lock);
}

void epd_executor_kick(struct epdd_executor *e)
{
        pthread_mutex_lock(&e->lock);
        e->kicked = 1;
        pthread_cond_signal(&e->cond);
        pthread_mutex_unlock(&e->lock);
}

void epd_executor_stop(struct epdd_executor *e)
{
        struct epd_list *pos;

        if (!e->started)
                return;
        pthread_mutex_lock(&e->lock);
        /* What still waits for a client's inputs ends now rather than at its timeout. */
        epd_list_for_each(pos, &e->queue)
                epd_exec_abort(epd_list_entry(pos, struct epdd_exec, link), EPD_ABORTED);
        e->stop = 1;
        pthread_cond_signal(&e->cond);
        pthread_mutex_unlock(&e->lock);
        pthread_join(e->thread, NULL);
        pthread_mutex_destroy(&e->lock);
        pthread_cond_destroy(&e->cond);
        e->started = 0;
}

int epd_executor_alive(struct epdd_executor *e)
{
        return epd__now_ns() - atomic_load(&e->heartbeat_ns) > 60ull * 1000000000ull ? -1 : 0;
}
