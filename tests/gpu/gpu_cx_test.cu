/* gpu_cx_test.cu - the client-executed kernels (kernels/epd_cx.h) bitwise against the reference.
 *
 * R ranks live on one GPU as R streams of this process, each with an SM budget small enough that
 * every rank's blocks run at once. Each case runs dispatch, combine and, where asked, a cached
 * dispatch and its combine, and compares every rank's receive area, counts and combined output
 * with the independent reference (tests/lib/reference.h). Then each rank captures
 * dispatch -> y -> combine three times in one CUDA graph, and the graphs are replayed 100 times
 * with new inputs each time: the kernels take their op numbers from the buffers, so every replay
 * is three new ops, and every replay is checked bitwise.
 *
 * Exit 77 (skipped) where no GPU is usable.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "epd_cx.h"

extern "C" {
#include "cx.h"
#include "cx_case.h"
#include "testdata.h"
}

#define MAX_R 8u
#define REPLAYS 100u
#define GRAPH_OPS 3u

static int failures;

#define CUDA_OK(call)                                                                          \
        do {                                                                                   \
                cudaError_t e_ = (call);                                                       \
                if (e_ != cudaSuccess) {                                                       \
                        fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,          \
                                cudaGetErrorString(e_));                                       \
                        exit(1);                                                               \
                }                                                                              \
        } while (0)

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void check(int ok, const char *fmt, ...)
{
        va_list ap;

        if (ok)
                return;
        failures++;
        va_start(ap, fmt);
        fputs("FAIL: ", stderr);
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
        va_end(ap);
}

/* A group on this GPU: device buffers, a host image of each for checks, a stream per rank. */
struct dgroup {
        struct cx_layout l;
        uint32_t R, blocks;
        uint8_t *dbuf[MAX_R];
        uint8_t *host[MAX_R];
        cudaStream_t stream[MAX_R];
        struct epd_cx_group g[MAX_R];
};

static void dgroup_init(struct dgroup *dg, const struct cx_case *c, uint32_t sms)
{
        struct cx_shape shape;

        cx_case_shape(c, &shape);
        if (cx_layout_compute(&shape, &dg->l) != CX_SHAPE_OK) {
                fprintf(stderr, "%s: shape refused\n", c->name);
                exit(1);
        }
        dg->R = c->R;
        /* Every rank's blocks must be resident at once: a share of the SMs, at most 8. */
        dg->blocks = sms / c->R < 8 ? (sms / c->R ? sms / c->R : 1) : 8;
        for (uint32_t r = 0; r < c->R; r++) {
                dg->host[r] = (uint8_t *)calloc(1, dg->l.total_bytes);
                cx_buffer_init(dg->host[r], &dg->l, r, 3);
                CUDA_OK(cudaMalloc(&dg->dbuf[r], dg->l.total_bytes));
                CUDA_OK(cudaMemset(dg->dbuf[r], 0xA5, dg->l.total_bytes));
                CUDA_OK(cudaMemcpy(dg->dbuf[r], dg->host[r], dg->l.metadata_bytes,
                                   cudaMemcpyHostToDevice));
                CUDA_OK(cudaStreamCreateWithFlags(&dg->stream[r], cudaStreamNonBlocking));
        }
        for (uint32_t r = 0; r < c->R; r++) {
                struct epd_cx_group *g = &dg->g[r];

                memset(g, 0, sizeof(*g));
                g->layout = dg->l;
                g->rank = r;
                g->same_gpu_mask = ~0ull;
                g->timeout_ns = 10000000000ull;
                for (uint32_t s = 0; s < c->R; s++)
                        g->bufs[s] = dg->dbuf[s];
        }
}

static void dgroup_free(struct dgroup *dg)
{
        for (uint32_t r = 0; r < dg->R; r++) {
                cudaFree(dg->dbuf[r]);
                cudaStreamDestroy(dg->stream[r]);
                free(dg->host[r]);
        }
}

static void dgroup_sync_pull(struct dgroup *dg)
{
        for (uint32_t r = 0; r < dg->R; r++)
                CUDA_OK(cudaStreamSynchronize(dg->stream[r]));
        for (uint32_t r = 0; r < dg->R; r++)
                CUDA_OK(cudaMemcpy(dg->host[r], dg->dbuf[r], dg->l.total_bytes,
                                   cudaMemcpyDeviceToHost));
}

/* One op's inputs: the host data (cx_case.h) and device copies at fixed addresses, so a captured
 * graph reads each replay's new data. */
struct dinputs {
        struct cx_case_data h;
        void *x[MAX_R], *scales[MAX_R], *topk[MAX_R], *w[MAX_R], *w2[MAX_R], *sw[MAX_R];
        void *bias[MAX_R][2], *y[MAX_R], *yw[MAX_R], *combined[MAX_R], *cw[MAX_R];
        void *snap[MAX_R]; /* the receive area right after the dispatch (graph test) */
};

static void *dev_alloc(size_t bytes)
{
        void *p;

        CUDA_OK(cudaMalloc(&p, bytes + 16));
        return p;
}

/* Fills in from seed (allocating the device side on the first call) and uploads it. */
static void dinputs_make(const struct cx_case *c, const struct dgroup *dg, struct dinputs *in,
                         uint64_t seed)
{
        const size_t T = c->T, K = c->K, H = c->H, rows = dg->l.recv_rows;
        const size_t xb = T * cx_case_x_row_bytes(c), sb = T * cx_case_num_scales(c) * 4;
        const size_t tb = T * K * cx_case_topk_size(c), wb = T * K * 4, bb = T * H * 2;
        char err[256];

        cx_case_data_free(c, &in->h);
        if (cx_case_data_make(c, (uint32_t)rows, seed, &in->h, err, sizeof(err))) {
                fprintf(stderr, "%s: %s\n", c->name, err);
                exit(1);
        }
        for (uint32_t s = 0; s < c->R; s++) {
                if (!in->x[s]) {
                        in->x[s] = dev_alloc(xb);
                        in->scales[s] = dev_alloc(sb);
                        in->topk[s] = dev_alloc(tb);
                        in->w[s] = dev_alloc(wb);
                        in->w2[s] = dev_alloc(wb);
                        in->sw[s] = dev_alloc(wb);
                        in->bias[s][0] = dev_alloc(bb);
                        in->bias[s][1] = dev_alloc(bb);
                        in->y[s] = dev_alloc(rows * H * 2);
                        in->yw[s] = dev_alloc(rows * K * 4);
                        in->combined[s] = dev_alloc(bb);
                        in->cw[s] = dev_alloc(wb);
                        in->snap[s] = dev_alloc(dg->l.y - dg->l.recv_x);
                }
                const struct { void *d; const void *h; size_t n; } up[] = {
                        { in->x[s], in->h.x[s], xb },
                        { in->scales[s], in->h.scales[s], sb },
                        { in->topk[s], in->h.topk[s], tb },
                        { in->w[s], in->h.weights[s], wb },
                        { in->w2[s], in->h.weights2[s], wb },
                        { in->sw[s], in->h.sw[s], wb },
                        { in->bias[s][0], in->h.bias[s][0], bb },
                        { in->bias[s][1], in->h.bias[s][1], bb },
                        { in->y[s], in->h.y[s], rows * H * 2 },
                        { in->yw[s], in->h.yw[s], rows * K * 4 },
                };
                for (size_t i = 0; i < sizeof(up) / sizeof(up[0]); i++)
                        CUDA_OK(cudaMemcpy(up[i].d, up[i].h, up[i].n, cudaMemcpyHostToDevice));
        }
}

static struct epd_cxk_dispatch_args dispatch_args(const struct cx_case *c, struct dinputs *in,
                                                 uint32_t s, int cached)
{
        struct epd_cxk_dispatch_args a = {};

        a.num_tokens = in->h.n[s];
        a.num_topk = c->K;
        a.x = in->x[s];
        a.scales = (const float *)in->scales[s];
        a.topk_idx = in->topk[s];
        a.topk_dtype = c->topk_dtype;
        a.layout = c->layout;
        a.weights = c->has_weights ? (const float *)(cached ? in->w2[s] : in->w[s]) : NULL;
        a.expert_alignment = c->align;
        a.expert_block_rows = c->block_rows;
        a.zero_padding = (uint32_t)c->zero_padding;
        a.quantize = (uint32_t)c->quantize;
        a.round_scale = (uint32_t)c->round_scale;
        a.scale_format = cx_case_scale_format(c);
        a.cached = (uint32_t)cached;
        return a;
}

/* Queues on rank s's stream: y (and its weights) into the y area, then the combine. */
static void queue_combine(const struct cx_case *c, struct dgroup *dg, struct dinputs *in,
                          uint32_t s)
{
        struct epd_cxk_combine_args a = {};

        a.recv_weights = (uint32_t)c->recv_weights;
        a.apply_weights = (uint32_t)c->apply_weights;
        a.source_weights = c->source_weights ? (const float *)in->sw[s] : NULL;
        a.bias[0] = c->nbias > 0 ? (const uint16_t *)in->bias[s][0] : NULL;
        a.bias[1] = c->nbias > 1 ? (const uint16_t *)in->bias[s][1] : NULL;
        a.combined = (uint16_t *)in->combined[s];
        a.combined_topk_weights = (float *)in->cw[s];
        CUDA_OK(cudaMemcpyAsync(dg->dbuf[s] + dg->l.y, in->y[s],
                                (size_t)dg->l.recv_rows * c->H * 2, cudaMemcpyDeviceToDevice,
                                dg->stream[s]));
        CUDA_OK(cudaMemcpyAsync(dg->dbuf[s] + dg->l.y_weights, in->yw[s],
                                (size_t)dg->l.recv_rows * c->K * 4, cudaMemcpyDeviceToDevice,
                                dg->stream[s]));
        check(epd_cx_combine_launch(&dg->g[s], &a, dg->blocks, dg->stream[s]) == 0,
              "%s: combine launch", c->name);
}

static void check_combine(const struct cx_case *c, struct dinputs *in,
                          const struct ref_dispatch *ref, uint32_t s, const char *what)
{
        size_t n = in->h.n[s];
        uint16_t *combined = (uint16_t *)malloc(n * c->H * 2 + 2);
        float *cw = (float *)malloc(n * c->K * 4 + 4);
        char msg[400];

        CUDA_OK(cudaMemcpy(combined, in->combined[s], n * c->H * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(cw, in->cw[s], n * c->K * 4, cudaMemcpyDeviceToHost));
        check(cx_case_check_combine(c, &in->h, ref, s, combined, cw, msg, sizeof(msg)) == 0,
              "%s %s rank %u: %s", c->name, what, s, msg);
        free(combined);
        free(cw);
}

static void check_status(const struct cx_case *c, const struct dgroup *dg, uint64_t op)
{
        for (uint32_t r = 0; r < dg->R; r++) {
                const struct cx_header *h = cx_header_of(dg->host[r], &dg->l);
                const struct cx_op_status *st = &h->status[op % CX_STATUS_RING];

                check(st->tag == cx_tag(3, op) && st->status == 0,
                      "%s rank %u op %" PRIu64 ": status tag 0x%" PRIx64 " status %d reason %d",
                      c->name, r, op, st->tag, st->status, st->reason);
        }
}

static void run_case(const struct cx_case *c, uint32_t sms)
{
        struct dgroup dg;
        struct dinputs in = {};
        uint64_t op = 0;
        char msg[400];

        dgroup_init(&dg, c, sms);
        dinputs_make(c, &dg, &in, td_mix_seed(0x6C0DEull, (uint64_t)c->R * 131 + c->K));
        for (int pass = 0; pass < (c->cached ? 2 : 1); pass++) {
                const struct ref_dispatch *ref = pass ? in.h.ref2 : in.h.ref;

                for (uint32_t s = 0; s < c->R; s++) {
                        struct epd_cxk_dispatch_args a = dispatch_args(c, &in, s, pass);

                        check(epd_cx_dispatch_launch(&dg.g[s], &a, dg.blocks, dg.stream[s]) == 0,
                              "%s: dispatch launch", c->name);
                }
                dgroup_sync_pull(&dg);
                check_status(c, &dg, op++);
                for (uint32_t d = 0; d < c->R; d++)
                        check(cx_case_check_dispatch(c, &dg.l, dg.host[d], 0, dg.host[d], ref, d,
                                                     msg, sizeof(msg)) == 0,
                              "%s %s: %s", c->name, pass ? "cached" : "dispatch", msg);
                for (uint32_t s = 0; s < c->R; s++)
                        queue_combine(c, &dg, &in, s);
                dgroup_sync_pull(&dg);
                check_status(c, &dg, op++);
                for (uint32_t s = 0; s < c->R; s++)
                        check_combine(c, &in, ref, s, pass ? "cached combine" : "combine");
        }
        cx_case_data_free(c, &in.h);
        dgroup_free(&dg);
        printf("%-24s %s\n", c->name, failures ? "checked (failures above)" : "ok");
}

/* Three dispatch -> y -> combine steps per rank in one graph, replayed with new inputs. */
static void run_graph(const struct cx_case *c, uint32_t sms)
{
        struct dgroup dg;
        struct dinputs in[GRAPH_OPS] = {};
        cudaGraphExec_t exec[MAX_R];
        uint8_t *img;
        char msg[400];

        dgroup_init(&dg, c, sms);
        img = (uint8_t *)malloc(dg.l.y);
        for (uint32_t k = 0; k < GRAPH_OPS; k++)
                dinputs_make(c, &dg, &in[k], td_mix_seed(0x9A9Full, k));
        for (uint32_t s = 0; s < c->R; s++) {
                cudaGraph_t graph;

                CUDA_OK(cudaStreamBeginCapture(dg.stream[s], cudaStreamCaptureModeThreadLocal));
                for (uint32_t k = 0; k < GRAPH_OPS; k++) {
                        struct epd_cxk_dispatch_args a = dispatch_args(c, &in[k], s, 0);

                        check(epd_cx_dispatch_launch(&dg.g[s], &a, dg.blocks, dg.stream[s]) == 0,
                              "graph dispatch launch");
                        /* The receive area as this op left it, for the check. */
                        CUDA_OK(cudaMemcpyAsync(in[k].snap[s], dg.dbuf[s] + dg.l.recv_x,
                                                dg.l.y - dg.l.recv_x, cudaMemcpyDeviceToDevice,
                                                dg.stream[s]));
                        queue_combine(c, &dg, &in[k], s);
                }
                CUDA_OK(cudaStreamEndCapture(dg.stream[s], &graph));
                CUDA_OK(cudaGraphInstantiate(&exec[s], graph, 0));
                CUDA_OK(cudaGraphDestroy(graph));
        }
        for (uint32_t rep = 0; rep < REPLAYS && !failures; rep++) {
                if (rep)
                        for (uint32_t k = 0; k < GRAPH_OPS; k++)
                                dinputs_make(c, &dg, &in[k], td_mix_seed(rep, k));
                for (uint32_t s = 0; s < c->R; s++)
                        CUDA_OK(cudaGraphLaunch(exec[s], dg.stream[s]));
                dgroup_sync_pull(&dg);
                for (uint32_t k = 0; k < GRAPH_OPS; k++) {
                        uint64_t op = (uint64_t)rep * 2 * GRAPH_OPS + 2 * k;

                        check_status(c, &dg, op);
                        check_status(c, &dg, op + 1);
                        for (uint32_t d = 0; d < c->R; d++) {
                                /* The snapshot at the layout's offsets; the handle's counts are
                                 * the last op's, so only its counts are compared. */
                                CUDA_OK(cudaMemcpy(img + dg.l.recv_x, in[k].snap[d],
                                                   dg.l.y - dg.l.recv_x, cudaMemcpyDeviceToHost));
                                check(cx_case_check_dispatch(c, &dg.l,
                                                             k == GRAPH_OPS - 1 ? dg.host[d] : NULL,
                                                             0, img, in[k].h.ref, d, msg,
                                                             sizeof(msg)) == 0,
                                      "%s replay %u op %u: %s", c->name, rep, k, msg);
                                check_combine(c, &in[k], in[k].h.ref, d, "graph combine");
                        }
                }
        }
        for (uint32_t s = 0; s < c->R; s++)
                cudaGraphExecDestroy(exec[s]);
        for (uint32_t k = 0; k < GRAPH_OPS; k++)
                cx_case_data_free(c, &in[k].h);
        free(img);
        dgroup_free(&dg);
        printf("%-24s %u replays of %u ops per rank: %s\n", c->name, REPLAYS, 2 * GRAPH_OPS,
               failures ? "failures above" : "ok");
}

int main(void)
{
        int devices = 0;
        struct cudaDeviceProp prop;
        /* EXPAND, quantizing, weighted: the richest path, four ranks. */
        const struct cx_case graph_case = { "graph_r4_ex_quant", 4, 16, 256, 12, 4,
                                            EPD_DTYPE_BF16, 1, EPD_LAYOUT_EXPAND, 2, 1, 0, 1,
                                            EPD_DTYPE_INT64, 1, 1, 0, 0, 0, 1, 0, 0 };

        if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
                printf("no usable GPU: skipped\n");
                return 77;
        }
        CUDA_OK(cudaSetDevice(0));
        CUDA_OK(cudaGetDeviceProperties(&prop, 0));
        if (epd_cx_preload() != 0) {
                fprintf(stderr, "preload failed\n");
                return 1;
        }
        for (size_t i = 0; i < cx_num_cases; i++)
                run_case(&cx_cases[i], (uint32_t)prop.multiProcessorCount);
        run_graph(&graph_case, (uint32_t)prop.multiProcessorCount);
        if (failures) {
                fprintf(stderr, "%d failure(s)\n", failures);
                return 1;
        }
        printf("all client-executed kernel checks passed\n");
        return 0;
}
