/* stats.c - percentiles, and the statistics of one op kind over the measured iterations of a
 * phase: op time, client-observed time, the daemon's overhead and where it went. Runs in the
 * parent after every worker has exited. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

int cmp_double(const void *a, const void *b)
{
        double x = *(const double *)a, y = *(const double *)b;

        return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted v[n]. */
static double pct(const double *v, size_t n, double p)
{
        size_t i;

        if (n == 0)
                return NAN;
        i = (size_t)ceil(p / 100.0 * (double)n);
        if (i > 0)
                i--;
        return v[i < n ? i : n - 1];
}

/* The op time of a sample, in ns (see bench.kernel_time). */
static uint64_t op_ns(const struct bench *b, const struct sample *s)
{
        return b->kernel_time ? s->kernel_ns : s->exec_ns;
}

/* Steps of the op timeline that the last submitter's overhead is split into (tl_step_names). */
/* The last submitter's overhead along the op's timeline: each step's time in us. The GPU
 * window (kernel_ns) is the op time and left out; for the host backend the whole execution
 * is. Stream-ordered ops end when the worker's stream passes the doorbell, which may come
 * before the reply: their last steps are then negative. */
const char *const tl_step_names[TL_STEPS] = {
        "request_build",     /* the call to libepd sending the request */
        "request",           /* sent to the daemon reading it */
        "loop_to_executor",  /* read to handed to the executor (queue_ns) */
        "executor_pickup",   /* handed to begun */
        "executor_host",     /* the executor's time outside the GPU window */
        "completion_pickup", /* executor done to the loop taking the completion */
        "reply_build",       /* completion taken to this reply built (replies to other ranks
                              * built first included) */
        "reply_transit",     /* reply built to libepd reading it */
        "client_return",     /* reply read to the call returning (host-waited) */
};

static void tl_steps(const struct sample *s, double *out)
{
        const struct epd_op_timeline *t = &s->tl;
        const double host = (double)(s->kernel_ns ? s->exec_ns - s->kernel_ns : 0);

        out[0] = ((double)t->submitted_ns - (double)s->submit_ns) / 1e3;
        out[1] = ((double)t->received_ns - (double)t->submitted_ns) / 1e3;
        out[2] = ((double)t->launched_ns - (double)t->received_ns) / 1e3;
        out[3] = ((double)t->exec_start_ns - (double)t->launched_ns) / 1e3;
        out[4] = host / 1e3;
        out[5] = ((double)t->completed_ns - (double)(t->exec_start_ns + t->exec_ns)) / 1e3;
        out[6] = ((double)t->replied_ns - (double)t->completed_ns) / 1e3;
        out[7] = ((double)t->reply_read_ns - (double)t->replied_ns) / 1e3;
        out[8] = ((double)s->done_ns - (double)t->reply_read_ns) / 1e3;
}

void op_stats(const struct bench *b, uint32_t phase, int kind, struct op_stats *st)
{
        uint32_t R = b->R, iters = b->opt.iters, w = phase * b->per_phase + b->opt.warmup;
        size_t ns = (size_t)R * iters;
        double *exec = calloc(iters, sizeof(double));
        double *e2e = calloc(ns, sizeof(double)), *ovh = calloc(ns, sizeof(double));
        double *last = calloc(iters, sizeof(double)), *queue = calloc(ns, sizeof(double));
        double *lq = calloc(iters, sizeof(double)), *lx = calloc(iters, sizeof(double));
        double *lr = calloc(iters, sizeof(double));
        double *ltl = calloc((size_t)iters * TL_STEPS, sizeof(double));
        double *grp = calloc(iters, sizeof(double));
        size_t in_page = 0, req_in_page = 0;
        size_t k = 0;

        memset(st, 0, sizeof(*st));
        if (!exec || !e2e || !ovh || !last || !queue || !lq || !lx || !lr || !ltl || !grp)
                goto out;
        for (uint32_t i = 0; i < iters; i++) {
                uint64_t emax = 0, emin = UINT64_MAX, last_submit = 0, last_done = 0;
                uint64_t first_start = UINT64_MAX, last_end = 0;
                double last_ovh = 0;

                for (uint32_t r = 0; r < R; r++) {
                        const struct sample *s =
                                &b->samples[((size_t)r * b->total_iters + w + i) * 2 + kind];
                        emax = op_ns(b, s) > emax ? op_ns(b, s) : emax;
                        emin = op_ns(b, s) < emin ? op_ns(b, s) : emin;
                        if (s->gpu_start_ns < first_start)
                                first_start = s->gpu_start_ns;
                        if (s->gpu_start_ns + s->kernel_ns > last_end)
                                last_end = s->gpu_start_ns + s->kernel_ns;
                }
                /* Ranks sharing one GPU: the device figure, first start to last end. */
                if (b->device_window)
                        emax = last_end - first_start;
                for (uint32_t r = 0; r < R; r++) {
                        const struct sample *s =
                                &b->samples[((size_t)r * b->total_iters + w + i) * 2 + kind];
                        double t = (double)(s->done_ns - s->submit_ns) / 1e3;
                        e2e[k] = t;
                        ovh[k] = t - (double)op_ns(b, s) / 1e3;
                        queue[k] = (double)s->queue_ns / 1e3;
                        k++;
                        in_page += s->tl.reply_in_doorbell != 0;
                        req_in_page += s->tl.request_in_doorbell != 0;
                        last_done = s->done_ns > last_done ? s->done_ns : last_done;
                        if (s->submit_ns >= last_submit) {
                                last_submit = s->submit_ns;
                                last_ovh = t - (double)op_ns(b, s) / 1e3;
                                lq[i] = (double)s->queue_ns / 1e3;
                                lx[i] = s->kernel_ns && s->exec_ns > s->kernel_ns
                                                ? (double)(s->exec_ns - s->kernel_ns) / 1e3
                                                : 0;
                                lr[i] = t - (double)(s->queue_ns + s->exec_ns) / 1e3;
                                double steps[TL_STEPS];
                                tl_steps(s, steps);
                                for (int j = 0; j < TL_STEPS; j++)
                                        ltl[(size_t)j * iters + i] = steps[j];
                        }
                }
                /* Daemon-executed: one exec serves every rank, so its time is the device
                 * figure; client-executed on one GPU, emax is that figure already. */
                exec[i] = (double)emax / 1e3;
                last[i] = last_ovh;
                grp[i] = ((double)last_done - (double)last_submit - (double)emax) / 1e3;
                if ((double)(emax - emin) / 1e3 > st->exec_spread_max)
                        st->exec_spread_max = (double)(emax - emin) / 1e3;
        }
        qsort(exec, iters, sizeof(double), cmp_double);
        qsort(e2e, ns, sizeof(double), cmp_double);
        qsort(ovh, ns, sizeof(double), cmp_double);
        qsort(last, iters, sizeof(double), cmp_double);
        qsort(queue, ns, sizeof(double), cmp_double);
        st->exec_p50 = pct(exec, iters, 50);
        st->exec_p99 = pct(exec, iters, 99);
        st->e2e_p50 = pct(e2e, ns, 50);
        st->e2e_p99 = pct(e2e, ns, 99);
        st->e2e_max = pct(e2e, ns, 100);
        st->ovh_p50 = pct(ovh, ns, 50);
        st->ovh_p99 = pct(ovh, ns, 99);
        st->last_ovh_p50 = pct(last, iters, 50);
        st->last_ovh_p99 = pct(last, iters, 99);
        st->queue_p50 = pct(queue, ns, 50);
        qsort(lq, iters, sizeof(double), cmp_double);
        qsort(lx, iters, sizeof(double), cmp_double);
        qsort(lr, iters, sizeof(double), cmp_double);
        st->last_queue_p50 = pct(lq, iters, 50);
        st->last_host_exec_p50 = pct(lx, iters, 50);
        st->last_rest_p50 = pct(lr, iters, 50);
        for (int j = 0; j < TL_STEPS; j++) {
                qsort(ltl + (size_t)j * iters, iters, sizeof(double), cmp_double);
                st->last_tl_p50[j] = pct(ltl + (size_t)j * iters, iters, 50);
        }
        qsort(grp, iters, sizeof(double), cmp_double);
        st->group_ovh_p50 = pct(grp, iters, 50);
        st->group_ovh_p99 = pct(grp, iters, 99);
        st->replies_in_doorbell = ns ? (double)in_page / (double)ns : 0;
        st->requests_in_doorbell = ns ? (double)req_in_page / (double)ns : 0;
out:
        free(grp);
        free(ltl);
        free(lq);
        free(lx);
        free(lr);
        free(exec);
        free(e2e);
        free(ovh);
        free(last);
        free(queue);
}

double median_of(const double *v, unsigned n)
{
        double *c = malloc((n ? n : 1) * sizeof(double)), m;

        if (!c || n == 0) {
                free(c);
                return 0;
        }
        memcpy(c, v, n * sizeof(double));
        qsort(c, n, sizeof(double), cmp_double);
        m = c[n / 2];
        free(c);
        return m;
}

double launch_floor_us(const struct bench *b)
{
        double v[GATE_RANKS];
        unsigned n = b->R < GATE_RANKS ? b->R : GATE_RANKS;

        for (unsigned r = 0; r < n; r++)
                v[r] = b->gate->launch_floor_us[r];
        return median_of(v, n);
}
