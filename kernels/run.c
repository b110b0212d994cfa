/* run.c - whole ops: which of the launchers an op takes, on which devices and streams, in which
 * order, with which events between the streams (epd_kernels.h, "Whole ops"). Host code only; it
 * keeps no state and knows nothing of who owns the memory, so the daemon's CUDA backend and a
 * client-executed op can share it.
 *
 * Runs on the caller's thread, which must own the streams for the call (the daemon's executor).
 * Each step sets the current device before it queues anything on that device's stream.
 */
#include <stddef.h>

#include "epd_kernels.h"

/* The stream of the device with ordinal `device`; NULL (the legacy default stream, never an op's)
 * when the plan does not list it, which the launches that follow then report. */
static cudaStream_t stream_of(const struct epd_k_op_device *devices, uint32_t n, int device)
{
        for (uint32_t i = 0; i < n; i++)
                if (devices[i].device == device)
                        return devices[i].stream;
        return NULL;
}

/* The reply block to the host's pinned copy, on the group device's stream: the verdict and the
 * counts, read once the op has completed. */
static void queue_reply_copy(const struct epd_k_dispatch_plan *p, cudaStream_t stream)
{
        const struct epd_k_dispatch_args *a = &p->args[p->group_device];

        cudaMemcpyAsync(p->reply_host, a->workspace,
                        epd_k_reply_bytes(a->world_size, a->num_experts),
                        cudaMemcpyDeviceToHost, stream);
}

int epd_k_dispatch_prepare(struct epd_k_dispatch_plan *p)
{
        int rc;

        p->one_launch = 0;
        p->step = "setup";
        if (p->cached || p->num_devices != 1 || p->counts_ready != NULL)
                return 0;
        /* EPD_INVALID_ARGUMENT, before anything is queued: not a small op. */
        cudaSetDevice(p->group_device);
        p->step = "dispatch_small (plan)";
        rc = epd_k_dispatch_small_plan(&p->args[p->group_device], &p->small);
        if (rc < 0 && rc != EPD_INVALID_ARGUMENT)
                return rc;
        p->one_launch = rc == 0;
        return 0;
}

/* count on every device, each but the group device's followed by its `counted` event, and prefix
 * on the group device once every count is done. */
static int queue_count_prefix(struct epd_k_dispatch_plan *p, cudaStream_t sw)
{
        const int W = p->group_device;
        int rc;

        for (uint32_t i = 0; i < p->num_devices; i++) {
                const struct epd_k_op_device *dv = &p->devices[i];
                cudaSetDevice(dv->device);
                p->step = "count";
                rc = epd_k_dispatch_count(&p->args[dv->device], dv->stream);
                if (rc < 0)
                        return rc;
                if (dv->device != W && cudaEventRecord(dv->counted, dv->stream) != cudaSuccess)
                        return EPD_INTERNAL;
        }
        cudaSetDevice(W);
        for (uint32_t i = 0; i < p->num_devices; i++)
                if (p->devices[i].device != W)
                        cudaStreamWaitEvent(sw, p->devices[i].counted, 0);
        p->step = "prefix";
        return epd_k_dispatch_prefix(&p->args[W], sw);
}

int epd_k_dispatch_run(struct epd_k_dispatch_plan *p)
{
        const int W = p->group_device;
        const cudaStream_t sw = stream_of(p->devices, p->num_devices, W);
        int small = 0, rc = 0;

        cudaSetDevice(W);
        if (p->one_launch) {
                /* The kernel writes the reply block into reply_host itself: no copy after it. */
                p->step = "dispatch_small";
                p->args[W].reply_copy = p->reply_host;
                rc = epd_k_dispatch_small_timed(&p->args[W], &p->small, p->timed, p->t0, p->t1,
                                                sw);
                p->args[W].reply_copy = NULL;
                return rc;
        }
        if (!p->cached && p->num_devices == 1) {
                /* EPD_INVALID_ARGUMENT, before anything is queued: not a small op. */
                p->step = "route_small";
                rc = epd_k_dispatch_route_small(&p->args[W], sw);
                if (rc < 0 && rc != EPD_INVALID_ARGUMENT)
                        return rc;
                small = rc == 0;
                rc = 0;
        }
        if (p->cached) {
                p->step = "recheck";
                rc = epd_k_dispatch_recheck(&p->args[W], sw);
        } else if (small) {
                if (p->counts_ready == NULL) {
                        /* The copy overlaps the routing block (programmatic dependent launch:
                         * nothing may sit between the two); the reply block follows both. */
                        p->args[W].flags |= EPD_K_COPY_OVERLAP;
                        p->step = "copy";
                        rc = epd_k_dispatch_copy(&p->args[W], sw);
                        if (rc < 0)
                                return rc;
                        queue_reply_copy(p, sw);
                        return 0;
                }
        } else {
                rc = queue_count_prefix(p, sw);
        }
        if (rc < 0)
                return rc;
        cudaSetDevice(W);
        queue_reply_copy(p, sw);
        if (p->counts_ready != NULL) {
                /* The caller places the outputs from the counts (it waits for them) and rewrites
                 * the args; the verdict is then checked against the new capacities. */
                rc = p->counts_ready(p->ctx, p);
                if (rc != 0)
                        return rc;
                cudaSetDevice(W);
                p->step = "recheck";
                rc = epd_k_dispatch_recheck(&p->args[W], sw);
                if (rc < 0)
                        return rc;
        }
        cudaEventRecord(p->routed, sw);
        for (uint32_t i = 0; i < p->num_devices; i++) {
                const struct epd_k_op_device *dv = &p->devices[i];
                cudaSetDevice(dv->device);
                if (dv->device != W)
                        cudaStreamWaitEvent(dv->stream, p->routed, 0);
                if (!p->cached && !small) {
                        p->step = "place";
                        rc = epd_k_dispatch_place(&p->args[dv->device], dv->stream);
                        if (rc < 0)
                                return rc;
                }
                p->step = "copy";
                rc = epd_k_dispatch_copy(&p->args[dv->device], dv->stream);
                if (rc < 0)
                        return rc;
        }
        return 0;
}

int epd_k_combine_prepare(struct epd_k_combine_plan *p)
{
        /* One device: one kernel, launched with its events as one graph (timed.cu). */
        p->one_launch = p->num_devices == 1;
        return 0;
}

int epd_k_combine_run(const struct epd_k_combine_plan *p)
{
        const int W = p->group_device;
        int rc;

        if (p->one_launch) {
                cudaSetDevice(W);
                return epd_k_combine_timed(&p->args[W], p->timed, p->t0, p->t1,
                                           stream_of(p->devices, p->num_devices, W));
        }
        for (uint32_t i = 0; i < p->num_devices; i++) {
                cudaSetDevice(p->devices[i].device);
                rc = epd_k_combine(&p->args[p->devices[i].device], p->devices[i].stream);
                if (rc < 0)
                        return rc;
        }
        return 0;
}
