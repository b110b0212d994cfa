/* gpu_cx_integ.c - client-executed groups on the CUDA backend: a real daemon allocates the
 * buffers on GPU 0, worker processes import them through libepd and launch dispatch and combine
 * on their own streams (docs/client-execution.md), checked bitwise against the reference.
 *
 * - Every case of tests/lib/cx_case.h whose routing fits, with inputs and outputs in the
 *   workers' device memory: at R = 2 and 4 when CUDA MPS is enabled on GPU 0, else at R = 1
 *   (ranks of several processes share a GPU only under MPS).
 * - Without MPS: creating a group of 2 ranks fails UNAVAILABLE with a message naming MPS.
 * - A CUDA graph per rank that captures three dispatch -> combine steps (the y copy into the
 *   rank's y area between them), replayed 20 times with new inputs uploaded before each replay;
 *   every replay's combined outputs bitwise, and the op numbers advance on the device.
 *
 * CUDA is never initialised in this process: main probes the GPU in a forked child, and only
 * the spawned workers call CUDA. Exit 77 when no GPU is usable.
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cx_case.h"
#include "cx_layout.h"
#include "epd.h"
#include "harness.h"
#include "testdata.h"

#define MAX_R 4u
#define STEPS 3u
#define REPLAYS 20u

struct shared {
        struct h_daemon d;
        struct cx_case c;
        char name[64];
        uint64_t seed;
        uint32_t recv_rows;     /* the group's receive rows; 0: the shape's worst case */
        char msg[MAX_R][512];
};

static int mps_on; /* from the probe */

/* ---- one worker: its group, stream and device copies of a round's inputs ---- */

struct dev_round {
        void *x, *topk;
        float *scales, *w, *w2, *sw, *yw, *cw;
        uint16_t *bias[2], *y, *combined;
};

struct worker {
        struct shared *sh;
        uint32_t me;
        struct epd_client *cl;
        struct epd_group *g;
        struct cx_layout l;
        struct epd_cx_buffers b;
        uint8_t *host;                /* a copy of the rank's buffer */
        cudaStream_t stream;
        uint64_t ops;
};

/* Records the worker's failure where the test process reads it; returns 1. */
#define worker_fail(w, ...) \
        h_fail((w)->sh->msg[(w)->me], sizeof((w)->sh->msg[(w)->me]), __VA_ARGS__)

#define CK(w, call)                                                                           \
        do {                                                                                  \
                cudaError_t e_ = (call);                                                      \
                if (e_ != cudaSuccess)                                                        \
                        return worker_fail(w, "rank %u line %d: %s: %s", (w)->me, __LINE__,   \
                                           #call, cudaGetErrorString(e_));                    \
        } while (0)

static int worker_open(struct worker *w, struct shared *sh, uint32_t me)
{
        struct epd_group_config cfg;
        struct cx_shape shape;
        int rc;

        memset(w, 0, sizeof(*w));
        w->sh = sh;
        w->me = me;
        w->cl = h_connect(&sh->d, "gpu-cx");
        if (!w->cl)
                return worker_fail(w, "rank %u: connect failed", me);
        CK(w, cudaSetDevice(0));
        CK(w, cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking));
        cx_case_group_config(&sh->c, 20000, &cfg);
        cfg.recv_rows = sh->recv_rows;
        rc = h_group_enter(w->cl, sh->name, me, &cfg, &w->g);
        if (rc)
                return worker_fail(w, "rank %u: enter returned %d: %s", me, rc,
                                   epd_client_last_error(w->cl));
        cx_case_shape(&sh->c, &shape);
        shape.recv_rows = sh->recv_rows;
        if (cx_layout_compute(&shape, &w->l) != CX_SHAPE_OK)
                return worker_fail(w, "rank %u: shape refused", me);
        w->b.size = sizeof(w->b);
        if (epd_cx_buffers(w->g, &w->b) || w->b.bytes_per_rank != w->l.total_bytes)
                return worker_fail(w, "rank %u: epd_cx_buffers: %s", me,
                                   epd_client_last_error(w->cl));
        w->host = malloc(w->l.total_bytes);
        if (!w->host)
                return worker_fail(w, "out of memory");
        return 0;
}

static void worker_close(struct worker *w)
{
        epd_group_leave(w->g);
        epd_client_free(w->cl);
        free(w->host);
}

static int upload(struct worker *w, const struct cx_case_data *rd, struct dev_round *dr)
{
        const struct cx_case *c = &w->sh->c;
        const uint32_t me = w->me, n = rd->n[me];
        const size_t xb = (size_t)n * cx_case_x_row_bytes(c) + 16,
                     sb = (size_t)n * cx_case_num_scales(c) * 4 + 16,
                     tb = (size_t)n * c->K * cx_case_topk_size(c) + 16,
                     kb = (size_t)n * c->K * 4 + 16, hb = (size_t)n * c->H * 2 + 16,
                     yb = (size_t)w->l.recv_rows * c->H * 2, ywb = (size_t)w->l.recv_rows * c->K * 4;

        if (!dr->x) {
                CK(w, cudaMalloc(&dr->x, (size_t)c->T * cx_case_x_row_bytes(c) + 16));
                CK(w, cudaMalloc((void **)&dr->scales, (size_t)c->T * c->H * 4 + 16));
                CK(w, cudaMalloc(&dr->topk, (size_t)c->T * c->K * 8 + 16));
                CK(w, cudaMalloc((void **)&dr->w, (size_t)c->T * c->K * 4 + 16));
                CK(w, cudaMalloc((void **)&dr->w2, (size_t)c->T * c->K * 4 + 16));
                CK(w, cudaMalloc((void **)&dr->sw, (size_t)c->T * c->K * 4 + 16));
                CK(w, cudaMalloc((void **)&dr->cw, (size_t)c->T * c->K * 4 + 16));
                CK(w, cudaMalloc((void **)&dr->combined, (size_t)c->T * c->H * 2 + 16));
                for (int k = 0; k < 2; k++)
                        CK(w, cudaMalloc((void **)&dr->bias[k], (size_t)c->T * c->H * 2 + 16));
                CK(w, cudaMalloc((void **)&dr->y, yb));
                CK(w, cudaMalloc((void **)&dr->yw, ywb));
        }
        CK(w, cudaMemcpy(dr->x, rd->x[me], xb, cudaMemcpyHostToDevice));
        CK(w, cudaMemcpy(dr->scales, rd->scales[me], sb, cudaMemcpyHostToDevice));
        CK(w, cudaMemcpy(dr->topk, rd->topk[me], tb, cudaMemcpyHostToDevice));
        CK(w, cudaMemcpy(dr->w, rd->weights[me], kb, cudaMemcpyHostToDevice));
        CK(w, cudaMemcpy(dr->w2, rd->weights2[me], kb, cudaMemcpyHostToDevice));
        CK(w, cudaMemcpy(dr->sw, rd->sw[me], kb, cudaMemcpyHostToDevice));
        for (int k = 0; k < 2; k++)
                CK(w, cudaMemcpy(dr->bias[k], rd->bias[me][k], hb, cudaMemcpyHostToDevice));
        CK(w, cudaMemcpy(dr->y, rd->y[me], yb, cudaMemcpyHostToDevice));
        CK(w, cudaMemcpy(dr->yw, rd->yw[me], ywb, cudaMemcpyHostToDevice));
        return 0;
}

static void dev_round_free(struct dev_round *dr)
{
        void *p[] = { dr->x, dr->topk, dr->scales, dr->w, dr->w2, dr->sw, dr->yw, dr->cw,
                      dr->bias[0], dr->bias[1], dr->y, dr->combined };

        for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
                cudaFree(p[i]);
        memset(dr, 0, sizeof(*dr));
}

static struct epd_cx_dispatch_args dispatch_args(const struct cx_case *c,
                                                 const struct cx_case_data *rd, uint32_t me,
                                                 const struct dev_round *dr, uint32_t handle)
{
        return (struct epd_cx_dispatch_args){
                .size = sizeof(struct epd_cx_dispatch_args), .num_tokens = rd->n[me],
                .num_topk = c->K, .x = dr->x,
                .scales = c->dtype == EPD_DTYPE_FP8_E4M3 ? dr->scales : NULL,
                .topk_idx = dr->topk, .topk_dtype = c->topk_dtype,
                .topk_weights = c->has_weights ? dr->w : NULL, .layout = c->layout,
                .expert_alignment = c->align, .zero_padding = c->zero_padding,
                .expert_block_rows = c->block_rows, .quantize = c->quantize, .handle = handle,
                .round_scale = c->round_scale,
                .scale_format = (enum epd_scale_format)cx_case_scale_format(c),
        };
}

static struct epd_cx_combine_args combine_args(const struct cx_case *c,
                                               const struct dev_round *dr, uint32_t handle)
{
        return (struct epd_cx_combine_args){
                .size = sizeof(struct epd_cx_combine_args), .handle = handle,
                .recv_weights = c->recv_weights, .apply_weights = c->apply_weights,
                .source_weights = c->source_weights ? dr->sw : NULL,
                .num_bias = (uint32_t)c->nbias, .bias = { dr->bias[0], dr->bias[1] },
                .combined = dr->combined, .combined_topk_weights = dr->cw,
        };
}

/* The op status of the rank's last op, expected OK and numbered op. */
static int expect_status(struct worker *w, uint64_t op, const char *what)
{
        struct epd_cx_status st = { .size = sizeof(st) };

        if (epd_cx_status(w->g, &st) || st.status != 0 || st.op != op)
                return worker_fail(w, "rank %u: %s: status %d op %" PRIu64 " (expected op %"
                                   PRIu64 " OK): %s %s", w->me, what, st.status, st.op, op,
                                   st.message, epd_client_last_error(w->cl));
        return 0;
}

static int check_combined(struct worker *w, const struct cx_case_data *rd,
                          const struct ref_dispatch *ref, const struct dev_round *dr,
                          const char *what)
{
        const struct cx_case *c = &w->sh->c;
        const uint32_t n = rd->n[w->me];
        uint16_t *combined = malloc((size_t)n * c->H * 2 + 2);
        float *cw = malloc((size_t)n * c->K * 4 + 4);
        char msg[400];
        int failed = 0;

        if (!combined || !cw)
                failed = worker_fail(w, "out of memory");
        else if (cudaMemcpy(combined, dr->combined, (size_t)n * c->H * 2, cudaMemcpyDeviceToHost) ||
                 cudaMemcpy(cw, dr->cw, (size_t)n * c->K * 4, cudaMemcpyDeviceToHost))
                failed = worker_fail(w, "rank %u: copying the combined outputs back", w->me);
        else if (cx_case_check_combine(c, rd, ref, w->me, combined, cw, msg, sizeof(msg)))
                failed = worker_fail(w, "%s rank %u: %s: %s", c->name, w->me, what, msg);
        free(combined);
        free(cw);
        return failed;
}

/* After a launch (rc): the stream synchronised, then the op's own status. */
static int op_done(struct worker *w, int rc, const char *what)
{
        if (rc)
                return worker_fail(w, "rank %u: %s launch %d: %s", w->me, what, rc,
                                   epd_client_last_error(w->cl));
        CK(w, cudaStreamSynchronize(w->stream));
        return expect_status(w, w->ops++, what);
}

/* One dispatch (cached or not) and its combine, checked. */
static int op_pair(struct worker *w, const struct cx_case_data *rd,
                   const struct ref_dispatch *ref, struct dev_round *dr, uint32_t handle,
                   int cached)
{
        const struct cx_case *c = &w->sh->c;
        struct epd_cx_dispatch_args a = dispatch_args(c, rd, w->me, dr, handle);
        struct epd_cx_combine_args cb = combine_args(c, dr, handle);
        uint8_t *dev_base = (uint8_t *)w->b.recv_x - w->l.recv_x;
        char msg[400];

        if (cached) {
                a.cached = 1;
                a.topk_idx = NULL;
                a.topk_weights = c->has_weights ? dr->w2 : NULL;
        }
        if (op_done(w, epd_cx_dispatch(w->g, &a, w->stream), "dispatch"))
                return 1;
        CK(w, cudaMemcpy(w->host, dev_base, w->l.total_bytes, cudaMemcpyDeviceToHost));
        if (cx_case_check_dispatch(c, &w->l, w->host, handle, w->host, ref, w->me, msg,
                                   sizeof(msg)))
                return worker_fail(w, "%s rank %u: dispatch: %s", c->name, w->me, msg);
        CK(w, cudaMemcpy(w->b.y, dr->y, (size_t)w->l.recv_rows * c->H * 2,
                         cudaMemcpyDeviceToDevice));
        if (c->recv_weights)
                CK(w, cudaMemcpy(w->b.y_weights, dr->yw, (size_t)w->l.recv_rows * c->K * 4,
                                 cudaMemcpyDeviceToDevice));
        if (op_done(w, epd_cx_combine(w->g, &cb, w->stream), "combine"))
                return 1;
        return check_combined(w, rd, ref, dr, "combine");
}

static int bitwise_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w;
        struct dev_round dr = { 0 };
        int failed = worker_open(&w, sh, (uint32_t)index);

        for (uint32_t i = 0; !failed && i < sh->c.rounds; i++) {
                struct cx_case_data rd;
                char err[256];
                uint32_t handle = i % w.b.num_handle_slots;

                if (cx_case_data_make(&sh->c, w.l.recv_rows, td_mix_seed(sh->seed, i), &rd, err,
                                      sizeof(err))) {
                        cx_case_data_free(&sh->c, &rd);
                        failed = worker_fail(&w, "%s", err);
                        break;
                }
                failed = upload(&w, &rd, &dr) || op_pair(&w, &rd, rd.ref, &dr, handle, 0) ||
                         (sh->c.cached && op_pair(&w, &rd, rd.ref2, &dr, handle, 1));
                cx_case_data_free(&sh->c, &rd);
        }
        dev_round_free(&dr);
        if (w.g)
                worker_close(&w);
        return failed;
}

/* A group whose receive rows are exactly what round 0 needs runs it bitwise (bitwise_worker);
 * with one row fewer the dispatch ends CAPACITY_EXCEEDED on every rank, naming the group's
 * rows, and no row of the receive area is written. */
static int short_rows_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w;
        struct dev_round dr = { 0 };
        struct cx_case_data rd;
        struct epd_cx_status st = { .size = sizeof(st) };
        char err[256], want[64];
        const size_t area = (size_t)sh->recv_rows * cx_case_x_row_bytes(&sh->c);
        int failed = worker_open(&w, sh, (uint32_t)index);
        uint8_t *back = malloc(area + 1);

        if (!failed && !back)
                failed = worker_fail(&w, "out of memory");
        if (!failed && cx_case_data_make(&sh->c, w.l.recv_rows, td_mix_seed(sh->seed, 0), &rd,
                                         err, sizeof(err))) {
                cx_case_data_free(&sh->c, &rd);
                failed = worker_fail(&w, "%s", err);
        }
        if (!failed) {
                struct epd_cx_dispatch_args a;

                failed = upload(&w, &rd, &dr);
                a = dispatch_args(&sh->c, &rd, w.me, &dr, 0);
                if (!failed && (cudaMemset(w.b.recv_x, 0xA5, area) != cudaSuccess ||
                                epd_cx_dispatch(w.g, &a, w.stream) != 0 ||
                                cudaStreamSynchronize(w.stream) != cudaSuccess))
                        failed = worker_fail(&w, "rank %u: the launch failed: %s", w.me,
                                             epd_client_last_error(w.cl));
                snprintf(want, sizeof(want), "capacity %u", sh->recv_rows);
                if (!failed && (epd_cx_status(w.g, &st) || st.status != EPD_CAPACITY_EXCEEDED ||
                                !strstr(st.message, want)))
                        failed = worker_fail(&w, "rank %u: status %d: %s (expected \"%s\")",
                                             w.me, st.status, st.message, want);
                if (!failed &&
                    cudaMemcpy(back, w.b.recv_x, area, cudaMemcpyDeviceToHost) != cudaSuccess)
                        failed = worker_fail(&w, "rank %u: copying the receive area back", w.me);
                for (size_t i = 0; !failed && i < area; i++)
                        if (back[i] != 0xA5)
                                failed = worker_fail(&w, "rank %u: byte %zu of recv_x written by "
                                                     "a failed op", w.me, i);
                cx_case_data_free(&sh->c, &rd);
        }
        free(back);
        dev_round_free(&dr);
        if (w.g)
                worker_close(&w);
        return failed;
}

/* ---- a CUDA graph of three steps, replayed with new inputs ---- */

static int graph_worker(void *arg, int index)
{
        struct shared *sh = arg;
        const struct cx_case *c = &sh->c;
        struct worker w;
        struct dev_round dr[STEPS] = { 0 };
        struct cx_case_data rd[STEPS];
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        int failed = worker_open(&w, sh, (uint32_t)index);

        for (uint32_t rep = 0; !failed && rep < REPLAYS; rep++) {
                char err[256];

                /* New inputs of every step, uploaded to the addresses the graph captured. */
                for (uint32_t i = 0; i < STEPS && !failed; i++) {
                        if (cx_case_data_make(c, w.l.recv_rows,
                                              td_mix_seed(sh->seed, rep * STEPS + i), &rd[i],
                                              err, sizeof(err)))
                                failed = worker_fail(&w, "%s", err);
                        else
                                failed = upload(&w, &rd[i], &dr[i]);
                }
                if (!failed && !exec) {
                        if (cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeThreadLocal))
                                failed = worker_fail(&w, "rank %u: begin capture", w.me);
                        for (uint32_t i = 0; i < STEPS && !failed; i++) {
                                uint32_t h = i % w.b.num_handle_slots;
                                struct epd_cx_dispatch_args a =
                                        dispatch_args(c, &rd[i], w.me, &dr[i], h);
                                struct epd_cx_combine_args cb = combine_args(c, &dr[i], h);

                                if (epd_cx_dispatch(w.g, &a, w.stream) ||
                                    cudaMemcpyAsync(w.b.y, dr[i].y,
                                                    (size_t)w.l.recv_rows * c->H * 2,
                                                    cudaMemcpyDeviceToDevice, w.stream) ||
                                    (c->recv_weights &&
                                     cudaMemcpyAsync(w.b.y_weights, dr[i].yw,
                                                     (size_t)w.l.recv_rows * c->K * 4,
                                                     cudaMemcpyDeviceToDevice, w.stream)) ||
                                    epd_cx_combine(w.g, &cb, w.stream))
                                        failed = worker_fail(&w, "rank %u: capturing step %u: "
                                                             "%s", w.me, i,
                                                             epd_client_last_error(w.cl));
                        }
                        if (cudaStreamEndCapture(w.stream, &graph) != cudaSuccess || !graph ||
                            cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
                                failed = failed ? failed
                                                : worker_fail(&w, "rank %u: graph capture",
                                                              w.me);
                }
                if (!failed) {
                        if (cudaGraphLaunch(exec, w.stream) ||
                            cudaStreamSynchronize(w.stream))
                                failed = worker_fail(&w, "rank %u: replay %u failed", w.me, rep);
                        w.ops += 2 * STEPS;
                }
                if (!failed)
                        failed = expect_status(&w, w.ops - 1, "replay");
                for (uint32_t i = 0; i < STEPS && !failed; i++)
                        failed = check_combined(&w, &rd[i], rd[i].ref, &dr[i], "graph replay");
                for (uint32_t i = 0; i < STEPS; i++)
                        cx_case_data_free(c, &rd[i]);
        }
        if (exec)
                cudaGraphExecDestroy(exec);
        if (graph)
                cudaGraphDestroy(graph);
        for (uint32_t i = 0; i < STEPS; i++)
                dev_round_free(&dr[i]);
        if (w.g)
                worker_close(&w);
        return failed;
}

/* ---- tests ---- */

static struct shared *shared_new(void)
{
        struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);

        ck_assert(sh != MAP_FAILED);
        memset(sh, 0, sizeof(*sh));
        ck_assert_int_eq(h_daemon_start(&sh->d, NULL), 0);
        return sh;
}

static void shared_free(struct shared *sh)
{
        ck_assert_int_eq(h_daemon_stop(&sh->d, 10000), 0);
        munmap(sh, sizeof(*sh));
}

static void run_workers(struct shared *sh, int (*fn)(void *, int))
{
        pid_t pids[MAX_R];
        int bad;

        memset(sh->msg, 0, sizeof(sh->msg));
        for (uint32_t r = 0; r < sh->c.R; r++)
                pids[r] = h_spawn(fn, sh, (int)r);
        bad = h_wait_all(pids, (int)sh->c.R, 300000);
        for (uint32_t r = 0; r < sh->c.R; r++)
                if (sh->msg[r][0])
                        fprintf(stderr, "%s\n", sh->msg[r]);
        if (bad)
                h_daemon_dump_log(&sh->d);
        ck_assert_msg(bad == 0, "%s at R = %u: %d worker(s) failed: %s", sh->c.name, sh->c.R, bad,
                      sh->msg[0][0] ? sh->msg[0] : sh->msg[1]);
}

/* Whether the case's routing fits it at its R for every round (fixed blocks). */
static int data_fits(const struct shared *sh, uint32_t rounds)
{
        struct cx_shape shape;
        struct cx_layout l;
        struct cx_case_data rd;
        char err[256];

        cx_case_shape(&sh->c, &shape);
        if (cx_layout_compute(&shape, &l) != CX_SHAPE_OK)
                return 0;
        for (uint32_t i = 0; i < rounds; i++) {
                int bad = cx_case_data_make(&sh->c, l.recv_rows, td_mix_seed(sh->seed, i), &rd,
                                            err, sizeof(err));

                cx_case_data_free(&sh->c, &rd);
                if (bad)
                        return 0;
        }
        return 1;
}

START_TEST(test_bitwise)
{
        struct shared *sh = shared_new();
        uint32_t Rs[2] = { 2, 4 }, nR = 2;
        unsigned ran = 0;

        if (!mps_on) {
                Rs[0] = 1;
                nR = 1;
        }
        for (uint32_t k = 0; k < nR; k++) {
                for (size_t i = 0; i < cx_num_cases; i++) {
                        sh->c = cx_cases[i];
                        sh->c.R = Rs[k];
                        if (sh->c.E % sh->c.R)
                                continue;
                        sh->seed = td_mix_seed(0xC0DAull, i * 8 + Rs[k]);
                        if (!data_fits(sh, sh->c.rounds))
                                continue;
                        snprintf(sh->name, sizeof(sh->name), "gcx-%s-r%u", sh->c.name, Rs[k]);
                        run_workers(sh, bitwise_worker);
                        ran++;
                }
        }
        printf("gpu_cx_integ: %u case(s) bitwise (MPS %s)\n", ran, mps_on ? "on" : "off");
        ck_assert_uint_ge(ran, cx_num_cases - 2);
        shared_free(sh);
}
END_TEST

START_TEST(test_recv_rows)
{
        struct shared *sh = shared_new();
        struct cx_shape shape;
        struct cx_layout l;

        sh->c = cx_cases[2]; /* EXPAND, alignment 4, zero padding */
        sh->c.R = mps_on ? 2 : 1;
        sh->seed = td_mix_seed(0x5EEDull, 9);
        cx_case_shape(&sh->c, &shape);
        ck_assert_int_eq(cx_layout_compute(&shape, &l), CX_SHAPE_OK);
        sh->recv_rows = cx_case_rows_needed(&sh->c, td_mix_seed(sh->seed, 0));
        ck_assert_uint_gt(sh->recv_rows, 1);
        ck_assert_uint_lt(sh->recv_rows, l.recv_rows);
        sh->c.rounds = 1;
        snprintf(sh->name, sizeof(sh->name), "gcx-recv-rows");
        run_workers(sh, bitwise_worker);
        sh->recv_rows--;
        snprintf(sh->name, sizeof(sh->name), "gcx-recv-rows-short");
        run_workers(sh, short_rows_worker);
        shared_free(sh);
}
END_TEST

START_TEST(test_graph)
{
        struct shared *sh = shared_new();

        sh->c = cx_cases[1]; /* NON_EXPAND bf16, recv_weights and bias */
        sh->c.cached = 0;
        sh->c.R = mps_on ? 2 : 1;
        sh->seed = 0x6A4Full;
        ck_assert(data_fits(sh, REPLAYS * STEPS));
        snprintf(sh->name, sizeof(sh->name), "gcx-graph");
        run_workers(sh, graph_worker);
        shared_free(sh);
}
END_TEST

/* Without MPS, ranks of several processes cannot share the GPU: refused at creation. */
START_TEST(test_mps_refusal)
{
        struct shared *sh = shared_new();
        struct epd_client *cl;
        struct epd_group_config cfg;
        struct epd_group *g = NULL;
        int rc;

        if (mps_on) {
                printf("gpu_cx_integ: MPS is on; the refusal is not testable here\n");
                shared_free(sh);
                return;
        }
        cl = h_connect_ok(&sh->d, "gpu-cx-mps");
        sh->c = cx_cases[1];
        sh->c.R = 2;
        cx_case_group_config(&sh->c, 0, &cfg);
        rc = h_group_enter(cl, "gcx-mps", 0, &cfg, &g);
        ck_assert_int_eq(rc, EPD_UNAVAILABLE);
        ck_assert_msg(strstr(epd_client_last_error(cl), "MPS"), "%s",
                      epd_client_last_error(cl));
        epd_client_free(cl);
        shared_free(sh);
}
END_TEST

/* 0: a GPU with cuMem POSIX fds (mps_on set from MPS), 77: none, 1: the probe crashed. */
static int gpu_probe(void)
{
        int *shared_mps = mmap(NULL, sizeof(int), PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        pid_t pid;
        int status;

        if (shared_mps == MAP_FAILED)
                return 1;
        pid = fork();
        if (pid < 0)
                return 1;
        if (pid == 0) {
                int n = 0, on = 0;

                if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
                        printf("gpu_cx_integ: no usable GPU; skipping\n");
                        fflush(stdout);
                        _exit(77);
                }
                cudaDeviceGetAttribute(&on, cudaDevAttrMpsEnabled, 0);
                *shared_mps = on;
                _exit(0);
        }
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
                return 1;
        mps_on = *shared_mps;
        munmap(shared_mps, sizeof(int));
        return WEXITSTATUS(status);
}

int main(void)
{
        Suite *s = suite_create("gpu_cx_integ");
        TCase *tc = tcase_create("client_executed_cuda");
        SRunner *sr;
        int failed, probe = gpu_probe();

        if (probe == 77)
                return 77;
        if (probe != 0)
                return EXIT_FAILURE;
        printf("gpu_cx_integ: CUDA MPS %s on GPU 0\n", mps_on ? "enabled" : "not enabled");
        setenv("EPD_TEST_BACKEND", "cuda", 1);
        tcase_set_timeout(tc, 900);
        tcase_add_test(tc, test_mps_refusal);
        tcase_add_test(tc, test_bitwise);
        tcase_add_test(tc, test_graph);
        tcase_add_test(tc, test_recv_rows);
        suite_add_tcase(s, tc);
        sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
