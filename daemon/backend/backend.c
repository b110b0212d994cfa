/* backend.c - backend selection and the completion queue from backend threads to the loop. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "log.h"
#include "util.h"

static void drain_done(struct epdd_backend *b)
{
        struct epd_list batch;

        epd_list_init(&batch);
        pthread_mutex_lock(&b->done_lock);
        if (!epd_list_empty(&b->done)) {
                /* Move the whole queue out, then complete without holding the lock. */
                batch.next = b->done.next;
                batch.prev = b->done.prev;
                batch.next->prev = &batch;
                batch.prev->next = &batch;
                epd_list_init(&b->done);
        }
        pthread_mutex_unlock(&b->done_lock);
        while (!epd_list_empty(&batch)) {
                struct epdd_exec *ex = epd_list_entry(batch.next, struct epdd_exec, link);
                epd_list_del(&ex->link);
                b->inflight--;
                b->poll_until_ns = epd__now_ns() + b->poll_ns;
                b->on_complete(b->complete_arg, ex);
        }
}

static void on_done_async(uv_async_t *handle)
{
        drain_done(handle->data);
}

/* An active idle handle makes every loop turn poll for I/O without blocking; this callback
 * runs once per turn. A completion is then answered without the eventfd wake-up of the loop
 * thread, the next request is read as soon as it arrives, and requests that clients post in
 * their doorbell pages are taken without a system call (the network layer's poll_pages). */
static void on_poll_idle(uv_idle_t *handle)
{
        struct epdd_backend *b = handle->data;

        uint64_t now;

        drain_done(b);
        if (b->poll_pages)
                (void)b->poll_pages(b->poll_arg);
        now = epd__now_ns();
        if (now > b->poll_until_ns &&
            (b->inflight == 0 ||
             (!atomic_load_explicit(&b->running, memory_order_relaxed) &&
              now - b->last_submit_ns > EPD_POLL_WAIT_NS))) {
                uv_idle_stop(handle);
                /* Its last look may take a request that launches an op, which polls again. */
                if (b->set_polling)
                        b->set_polling(b->poll_arg, 0);
        }
}

static void poll_start(struct epdd_backend *b)
{
        if (b->poll_ns && !uv_is_active((uv_handle_t *)&b->poll_idle)) {
                uv_idle_start(&b->poll_idle, on_poll_idle);
                if (b->set_polling)
                        b->set_polling(b->poll_arg, 1);
        }
}

void epd_backend_submit(struct epdd_backend *b, struct epdd_exec *ex)
{
        b->inflight++;
        b->last_submit_ns = epd__now_ns();
        poll_start(b);
        b->ops->submit(b, ex);
}

void epd_backend_poll_window(struct epdd_backend *b)
{
        const uint64_t until = epd__now_ns() + b->poll_ns;

        if (until > b->poll_until_ns)
                b->poll_until_ns = until;
        poll_start(b);
}

void epd_exec_done(struct epdd_backend *b, struct epdd_exec *ex)
{
        pthread_mutex_lock(&b->done_lock);
        epd_list_add_tail(&b->done, &ex->link);
        pthread_mutex_unlock(&b->done_lock);
        uv_async_send(&b->done_async);
}

int epd_backend_open(uv_loop_t *loop, const struct epdd_config *cfg, struct epdd_backend **out,
                     char *err, size_t err_len)
{
        const struct epdd_backend_ops *candidates[2];
        unsigned n = 0;
        struct epdd_backend *b;
        int rc = EPD_UNAVAILABLE;

        if (strcmp(cfg->backend, "host") == 0) {
                candidates[n++] = &epd_backend_host_ops;
        } else if (strcmp(cfg->backend, "cuda") == 0) {
#ifdef EPD_HAVE_CUDA
                candidates[n++] = &epd_backend_cuda_ops;
#else
                snprintf(err, err_len, "this epd was built without CUDA support");
                return EPD_UNAVAILABLE;
#endif
        } else {
#ifdef EPD_HAVE_CUDA
                candidates[n++] = &epd_backend_cuda_ops;
#endif
                candidates[n++] = &epd_backend_host_ops;
        }
        for (unsigned i = 0; i < n; i++) {
                b = calloc(1, sizeof(*b));
                if (!b)
                        return EPD_INTERNAL;
                b->ops = candidates[i];
                pthread_mutex_init(&b->done_lock, NULL);
                epd_list_init(&b->done);
                uv_async_init(loop, &b->done_async, on_done_async);
                b->done_async.data = b;
                uv_idle_init(loop, &b->poll_idle);
                b->poll_idle.data = b;
                b->poll_ns = epd_config_poll_ns(cfg);
                rc = b->ops->init(b, cfg, err, err_len);
                if (rc == 0) {
                        *out = b;
                        return 0;
                }
                if (i + 1 < n)
                        log_info("backend %s unavailable (%s), trying the next", b->ops->name, err);
                uv_close((uv_handle_t *)&b->done_async, NULL);
                uv_close((uv_handle_t *)&b->poll_idle, NULL);
                uv_run(loop, UV_RUN_NOWAIT);
                pthread_mutex_destroy(&b->done_lock);
                free(b);
        }
        return rc;
}

static void on_backend_closed(uv_handle_t *handle)
{
        struct epdd_backend *b = handle->data;

        pthread_mutex_destroy(&b->done_lock);
        free(b);
}

void epd_backend_close(struct epdd_backend *b)
{
        if (!b)
                return;
        b->ops->fini(b);
        /* The loop runs once more in main() to finish closing the handles; the last one
         * closed frees b (handles close in the order they were closed). */
        uv_close((uv_handle_t *)&b->poll_idle, NULL);
        uv_close((uv_handle_t *)&b->done_async, on_backend_closed);
}
