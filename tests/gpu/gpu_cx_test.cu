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
#include "reference.h"
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

struct gcase {
        const char *name;
        uint32_t R, E, H, T, K;
        enum epd_dtype dtype;
        int quantize;
        enum epd_layout layout;
        uint32_t align, zero_padding, block_rows;
        int has_weights;
        enum epd_dtype topk_dtype;
        int nbias, apply_weights, source_weights, recv_weights, cached;
};

/* A group on this GPU: device buffers, a host image of each for checks, a stream per rank. */
struct dgroup {
        struct cx_layout l;
        uint32_t R, blocks;
        uint8_t *dbuf[MAX_R];
        uint8_t *host[MAX_R];
        cudaStream_t stream[MAX_R];
        struct epd_cx_group g[MAX_R];
};

static void dgroup_init(struct dgroup *dg, const struct gcase *c, uint32_t sms)
{
        struct cx_shape shape = {};

        shape.world_size = c->R;
        shape.num_experts = c->E;
        shape.hidden = c->H;
        shape.max_tokens = c->T;
        shape.max_topk = c->K;
        shape.dtype = c->dtype;
        shape.scale_block = 64;
        shape.quantize = (uint32_t)c->quantize;
        shape.max_alignment = c->align;
        shape.expert_block_rows = c->block_rows;
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

/* One op's inputs of every rank, on the host and on the device. */
struct inputs {
        uint32_t n[MAX_R];
        void *hx[MAX_R], *hscales[MAX_R], *htopk[MAX_R], *hw[MAX_R], *hw2[MAX_R], *hsw[MAX_R];
        void *hbias[MAX_R][2], *hy[MAX_R], *hyw[MAX_R];
        void *dx[MAX_R], *dscales[MAX_R], *dtopk[MAX_R], *dw[MAX_R], *dw2[MAX_R], *dsw[MAX_R];
        void *dbias[MAX_R][2], *dy[MAX_R], *dyw[MAX_R], *dcombined[MAX_R], *dcw[MAX_R];
        void *dsnap[MAX_R]; /* the receive area right after the dispatch (graph test) */
        struct ref_dispatch *ref, *ref2;
};

static void *host_dev(void **h, void **d, size_t bytes)
{
        *h = calloc(1, bytes + 16);
        CUDA_OK(cudaMalloc(d, bytes + 16));
        return *h;
}

static struct ref_dispatch *build_ref(const struct gcase *c, struct inputs *in, void **w)
{
        struct ref_src src[MAX_R];
        struct ref_params p = {};
        struct ref_dispatch *ref = NULL;
        char err[256];

        p.world_size = c->R;
        p.num_experts = c->E;
        p.hidden = c->H;
        p.max_tokens = c->T;
        p.num_topk = c->K;
        p.dtype = c->dtype;
        p.scale_block = 64;
        p.topk_dtype = c->topk_dtype;
        p.layout = c->layout;
        p.expert_alignment = c->align;
        p.zero_padding = (int)c->zero_padding;
        p.has_weights = c->has_weights;
        p.expert_block_rows = c->block_rows;
        p.quantize = c->quantize;
        for (uint32_t s = 0; s < c->R; s++) {
                memset(&src[s], 0, sizeof(src[s]));
                src[s].num_tokens = in->n[s];
                src[s].x.ptr = in->hx[s];
                src[s].scales.ptr = in->hscales[s];
                src[s].topk_idx.ptr = in->htopk[s];
                src[s].weights.ptr = c->has_weights ? w[s] : NULL;
        }
        if (ref_dispatch_new(&p, src, &ref, err, sizeof(err)) != 0) {
                fprintf(stderr, "%s: reference: %s\n", c->name, err);
                exit(1);
        }
        return ref;
}

/* Allocates (first call) and fills one op's inputs from seed, uploads them, builds references. */
static void inputs_make(const struct gcase *c, const struct dgroup *dg, struct inputs *in,
                        uint64_t seed, int alloc)
{
        const uint64_t xrow = (uint64_t)c->H * (c->dtype == EPD_DTYPE_BF16 ? 2 : 1);
        const uint32_t nsc = c->dtype == EPD_DTYPE_FP8_E4M3 ? c->H / 64 : 0;
        const size_t esz = c->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        const uint64_t rows = dg->l.recv_rows;
        struct td_rng rng;

        td_rng_seed(&rng, seed);
        for (uint32_t s = 0; s < c->R; s++) {
                uint32_t n = c->R == 1 ? c->T : c->T - s % 2;
                struct td_routing_args ra = {};

                in->n[s] = n;
                if (alloc) {
                        host_dev(&in->hx[s], &in->dx[s], c->T * xrow);
                        host_dev(&in->hscales[s], &in->dscales[s], (size_t)c->T * nsc * 4);
                        host_dev(&in->htopk[s], &in->dtopk[s], (size_t)c->T * c->K * esz);
                        host_dev(&in->hw[s], &in->dw[s], (size_t)c->T * c->K * 4);
                        host_dev(&in->hw2[s], &in->dw2[s], (size_t)c->T * c->K * 4);
                        host_dev(&in->hsw[s], &in->dsw[s], (size_t)c->T * c->K * 4);
                        for (int b = 0; b < 2; b++)
                                host_dev(&in->hbias[s][b], &in->dbias[s][b], (size_t)c->T * c->H * 2);
                        host_dev(&in->hy[s], &in->dy[s], rows * c->H * 2);
                        host_dev(&in->hyw[s], &in->dyw[s], rows * c->K * 4);
                        CUDA_OK(cudaMalloc(&in->dcombined[s], (size_t)c->T * c->H * 2 + 16));
                        CUDA_OK(cudaMalloc(&in->dcw[s], (size_t)c->T * c->K * 4 + 16));
                        CUDA_OK(cudaMalloc(&in->dsnap[s], dg->l.y - dg->l.recv_x));
                }
                ra.world_size = c->R;
                ra.num_experts = c->E;
                ra.num_tokens = n;
                ra.num_topk = c->K;
                ra.mode = s % 2 ? TD_ROUTING_SKEWED : TD_ROUTING_UNIFORM;
                ra.minus_one_prob = 0.1;
                ra.empty_row_prob = 0.05;
                ra.dtype = c->topk_dtype;
                if (c->dtype == EPD_DTYPE_BF16)
                        td_fill_bf16(&rng, in->hx[s], n, c->H, 0, 0.01);
                else
                        td_fill_bytes(&rng, in->hx[s], n, c->H, 0);
                td_fill_f32(&rng, in->hscales[s], n, nsc, 0, 0.01f, 4.0f);
                td_gen_topk(&rng, &ra, in->htopk[s]);
                td_fill_f32(&rng, in->hw[s], n, c->K, 0, -1.0f, 1.0f);
                td_fill_f32(&rng, in->hw2[s], n, c->K, 0, -1.0f, 1.0f);
                td_fill_f32(&rng, in->hsw[s], n, c->K, 0, -1.0f, 1.0f);
                for (int b = 0; b < 2; b++)
                        td_fill_bf16(&rng, in->hbias[s][b], n, c->H, 0, 0.0);
        }
        ref_dispatch_free(in->ref);
        ref_dispatch_free(in->ref2);
        in->ref = build_ref(c, in, in->hw);
        in->ref2 = c->cached ? build_ref(c, in, in->hw2) : NULL;
        for (uint32_t d = 0; d < c->R; d++) {
                uint16_t *y = (uint16_t *)in->hy[d];

                td_fill_bf16(&rng, y, rows, c->H, 0, 0.01);
                td_fill_f32(&rng, in->hyw[d], rows, c->K, 0, -2.0f, 2.0f);
                for (int64_t i = 0; i < in->ref->dst[d].rows; i++)
                        if (in->ref->dst[d].row_kind[i] != REF_ROW_DATA)
                                for (uint32_t h = 0; h < c->H; h++)
                                        y[(size_t)i * c->H + h] = 0x7FC0; /* never read */
        }
        for (uint32_t s = 0; s < c->R; s++) {
                const struct { void *d, *h; size_t n; } up[] = {
                        { in->dx[s], in->hx[s], c->T * xrow },
                        { in->dscales[s], in->hscales[s], (size_t)c->T * nsc * 4 },
                        { in->dtopk[s], in->htopk[s], (size_t)c->T * c->K * esz },
                        { in->dw[s], in->hw[s], (size_t)c->T * c->K * 4 },
                        { in->dw2[s], in->hw2[s], (size_t)c->T * c->K * 4 },
                        { in->dsw[s], in->hsw[s], (size_t)c->T * c->K * 4 },
                        { in->dbias[s][0], in->hbias[s][0], (size_t)c->T * c->H * 2 },
                        { in->dbias[s][1], in->hbias[s][1], (size_t)c->T * c->H * 2 },
                        { in->dy[s], in->hy[s], rows * c->H * 2 },
                        { in->dyw[s], in->hyw[s], rows * c->K * 4 },
                };
                for (size_t i = 0; i < sizeof(up) / sizeof(up[0]); i++)
                        CUDA_OK(cudaMemcpy(up[i].d, up[i].h, up[i].n, cudaMemcpyHostToDevice));
        }
}

static struct epd_cx_dispatch_args dispatch_args(const struct gcase *c, struct inputs *in,
                                                 uint32_t s, int cached)
{
        struct epd_cx_dispatch_args a = {};

        a.num_tokens = in->n[s];
        a.num_topk = c->K;
        a.x = in->dx[s];
        a.scales = (const float *)in->dscales[s];
        a.topk_idx = in->dtopk[s];
        a.topk_dtype = c->topk_dtype;
        a.layout = c->layout;
        a.weights = c->has_weights ? (const float *)(cached ? in->dw2[s] : in->dw[s]) : NULL;
        a.expert_alignment = c->align;
        a.expert_block_rows = c->block_rows;
        a.zero_padding = c->zero_padding;
        a.quantize = (uint32_t)c->quantize;
        a.cached = (uint32_t)cached;
        return a;
}

static struct epd_cx_combine_args combine_args(const struct gcase *c, struct inputs *in,
                                               uint32_t s)
{
        struct epd_cx_combine_args a = {};

        a.recv_weights = (uint32_t)c->recv_weights;
        a.apply_weights = (uint32_t)c->apply_weights;
        a.source_weights = c->source_weights ? (const float *)in->dsw[s] : NULL;
        a.bias[0] = c->nbias > 0 ? (const uint16_t *)in->dbias[s][0] : NULL;
        a.bias[1] = c->nbias > 1 ? (const uint16_t *)in->dbias[s][1] : NULL;
        a.combined = (uint16_t *)in->dcombined[s];
        a.combined_topk_weights = (float *)in->dcw[s];
        return a;
}

/* Queues on rank s's stream: y (and its weights) into the y area, then the combine. */
static void queue_combine(const struct gcase *c, struct dgroup *dg, struct inputs *in, uint32_t s)
{
        struct epd_cx_combine_args a = combine_args(c, in, s);

        CUDA_OK(cudaMemcpyAsync(dg->dbuf[s] + dg->l.y, in->dy[s],
                                (size_t)dg->l.recv_rows * c->H * 2, cudaMemcpyDeviceToDevice,
                                dg->stream[s]));
        CUDA_OK(cudaMemcpyAsync(dg->dbuf[s] + dg->l.y_weights, in->dyw[s],
                                (size_t)dg->l.recv_rows * c->K * 4, cudaMemcpyDeviceToDevice,
                                dg->stream[s]));
        check(epd_cx_combine_launch(&dg->g[s], &a, dg->blocks, dg->stream[s]) == 0,
              "%s: combine launch", c->name);
}

/* The dispatch outputs of rank d, read from recv (a host copy of its receive area at the
 * layout's offsets relative to base). */
static void check_dispatch(const struct gcase *c, const struct dgroup *dg, const uint8_t *base,
                           const struct ref_dispatch *ref, uint32_t d, int with_counts,
                           const char *what)
{
        const struct cx_layout *l = &dg->l;
        const uint8_t *own = dg->host[d];
        const struct cx_handle *h = cx_handle_at((uint8_t *)own, l, 0);
        const size_t esz = c->topk_dtype == EPD_DTYPE_INT64 ? 8 : 4;
        struct ref_counts_actual counts = {};
        struct ref_dispatch_actual act = {};
        char msg[400];

        counts.num_recv_tokens = h->num_recv_tokens;
        counts.num_expanded_rows = h->num_expanded_rows;
        counts.per_expert = cx_handle_i32((uint8_t *)own, l, 0, l->h_per_expert);
        counts.per_expert_aligned = cx_handle_i32((uint8_t *)own, l, 0, l->h_per_expert_aligned);
        counts.rank_prefix = cx_handle_i32((uint8_t *)own, l, 0, l->h_rank_prefix);
        act.recv_x.ptr = base + l->recv_x;
        act.recv_scales.ptr = base + l->recv_scales;
        act.recv_topk_idx = { base + l->recv_topk_idx, c->K * esz };
        act.recv_weights = { base + l->recv_weights,
                             c->layout == EPD_LAYOUT_EXPAND ? 4 : (uint64_t)c->K * 4 };
        act.recv_src = { base + l->recv_src, 8 };
        act.recv_topk_slot = { base + l->recv_topk_slot, 4 };
        check(!with_counts || ref_check_counts(ref, d, &counts, msg, sizeof(msg)) == 0,
              "%s %s counts: %s", c->name, what, msg);
        check(ref_check_dispatch(ref, d, &act, msg, sizeof(msg)) == 0, "%s %s: %s", c->name,
              what, msg);
}

static void check_combine(const struct gcase *c, struct inputs *in, const struct ref_dispatch *ref,
                          uint32_t s, const char *what)
{
        struct ref_buf y[MAX_R], sw[MAX_R], rw[MAX_R], bias[2];
        struct ref_combine_in cin = {};
        struct ref_combine_weights w = {};
        size_t n = in->n[s];
        uint16_t *combined = (uint16_t *)malloc(n * c->H * 2 + 2);
        float *cw = (float *)malloc(n * c->K * 4 + 4);
        char msg[400];

        CUDA_OK(cudaMemcpy(combined, in->dcombined[s], n * c->H * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(cw, in->dcw[s], n * c->K * 4, cudaMemcpyDeviceToHost));
        for (uint32_t d = 0; d < c->R; d++) {
                y[d] = { in->hy[d], 0 };
                sw[d] = { in->hsw[d], 0 };
                rw[d] = { in->hyw[d], 0 };
        }
        for (int b = 0; b < 2; b++)
                bias[b] = { b < c->nbias ? in->hbias[s][b] : NULL, 0 };
        cin.y = y;
        cin.apply_weights = c->apply_weights;
        w.source_weights = c->source_weights ? sw : NULL;
        w.recv_weights = c->recv_weights ? rw : NULL;
        check(ref_check_combine_w(ref, &cin, &w, s, bias, { combined, 0 },
                                  { (c->has_weights || c->recv_weights) ? cw : NULL, 0 }, msg,
                                  sizeof(msg)) == 0,
              "%s %s rank %u: %s", c->name, what, s, msg);
        free(combined);
        free(cw);
}

static void check_status(const struct gcase *c, const struct dgroup *dg, uint64_t op)
{
        for (uint32_t r = 0; r < dg->R; r++) {
                const struct cx_header *h = cx_header_of(dg->host[r], &dg->l);
                const struct cx_op_status *st = &h->status[op % CX_STATUS_RING];

                check(st->tag == cx_tag(3, op) && st->status == 0,
                      "%s rank %u op %" PRIu64 ": status tag 0x%" PRIx64 " status %d reason %d",
                      c->name, r, op, st->tag, st->status, st->reason);
        }
}

static void run_case(const struct gcase *c, uint32_t sms)
{
        struct dgroup dg;
        struct inputs in = {};
        uint64_t op = 0;

        dgroup_init(&dg, c, sms);
        inputs_make(c, &dg, &in, td_mix_seed(0x6C0DEull, (uint64_t)c->R * 131 + c->K), 1);
        for (int pass = 0; pass < (c->cached ? 2 : 1); pass++) {
                const struct ref_dispatch *ref = pass ? in.ref2 : in.ref;

                for (uint32_t s = 0; s < c->R; s++) {
                        struct epd_cx_dispatch_args a = dispatch_args(c, &in, s, pass);

                        check(epd_cx_dispatch_launch(&dg.g[s], &a, dg.blocks, dg.stream[s]) == 0,
                              "%s: dispatch launch", c->name);
                }
                dgroup_sync_pull(&dg);
                check_status(c, &dg, op++);
                for (uint32_t d = 0; d < c->R; d++)
                        check_dispatch(c, &dg, dg.host[d], ref, d, 1,
                                       pass ? "cached" : "dispatch");
                for (uint32_t s = 0; s < c->R; s++)
                        queue_combine(c, &dg, &in, s);
                dgroup_sync_pull(&dg);
                check_status(c, &dg, op++);
                for (uint32_t s = 0; s < c->R; s++)
                        check_combine(c, &in, ref, s, pass ? "cached combine" : "combine");
        }
        dgroup_free(&dg);
        printf("%-24s %s\n", c->name, failures ? "checked (failures above)" : "ok");
}

/* Three dispatch -> y -> combine steps per rank in one graph, replayed with new inputs. */
static void run_graph(const struct gcase *c, uint32_t sms)
{
        struct dgroup dg;
        struct inputs in[GRAPH_OPS] = {};
        cudaGraphExec_t exec[MAX_R];

        dgroup_init(&dg, c, sms);
        for (uint32_t k = 0; k < GRAPH_OPS; k++)
                inputs_make(c, &dg, &in[k], td_mix_seed(0x9A9Full, k), 1);
        for (uint32_t s = 0; s < c->R; s++) {
                cudaGraph_t graph;

                CUDA_OK(cudaStreamBeginCapture(dg.stream[s], cudaStreamCaptureModeThreadLocal));
                for (uint32_t k = 0; k < GRAPH_OPS; k++) {
                        struct epd_cx_dispatch_args a = dispatch_args(c, &in[k], s, 0);

                        check(epd_cx_dispatch_launch(&dg.g[s], &a, dg.blocks, dg.stream[s]) == 0,
                              "graph dispatch launch");
                        /* The receive area as this op left it, for the check. */
                        CUDA_OK(cudaMemcpyAsync(in[k].dsnap[s], dg.dbuf[s] + dg.l.recv_x,
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
                                inputs_make(c, &dg, &in[k], td_mix_seed(rep, k), 0);
                for (uint32_t s = 0; s < c->R; s++)
                        CUDA_OK(cudaGraphLaunch(exec[s], dg.stream[s]));
                dgroup_sync_pull(&dg);
                for (uint32_t k = 0; k < GRAPH_OPS; k++) {
                        uint64_t op = (uint64_t)rep * 2 * GRAPH_OPS + 2 * k;

                        check_status(c, &dg, op);
                        check_status(c, &dg, op + 1);
                        for (uint32_t d = 0; d < c->R; d++) {
                                /* Rebase the snapshot so the layout's offsets address it. */
                                uint8_t *img = (uint8_t *)malloc(dg.l.y);

                                CUDA_OK(cudaMemcpy(img + dg.l.recv_x, in[k].dsnap[d],
                                                   dg.l.y - dg.l.recv_x, cudaMemcpyDeviceToHost));
                                /* The handle's counts are the last op's. */
                                check_dispatch(c, &dg, img, in[k].ref, d, k == GRAPH_OPS - 1,
                                               "graph dispatch");
                                free(img);
                                check_combine(c, &in[k], in[k].ref, d, "graph combine");
                        }
                }
        }
        for (uint32_t s = 0; s < c->R; s++)
                cudaGraphExecDestroy(exec[s]);
        dgroup_free(&dg);
        printf("%-24s %u replays of %u ops per rank: %s\n", c->name, REPLAYS, 2 * GRAPH_OPS,
               failures ? "failures above" : "ok");
}

#define BF16 EPD_DTYPE_BF16
#define FP8 EPD_DTYPE_FP8_E4M3
#define I32 EPD_DTYPE_INT32
#define I64 EPD_DTYPE_INT64
#define NE EPD_LAYOUT_NON_EXPAND
#define EX EPD_LAYOUT_EXPAND

static const struct gcase cases[] = {
        /* name R E H T K dtype q layout align zp C w topk bias aw sw rw cached */
        { "r1_ne_bf16", 1, 8, 256, 24, 2, BF16, 0, NE, 1, 0, 0, 1, I64, 1, 0, 0, 0, 0 },
        { "r2_ne_bf16_recvw", 2, 16, 256, 40, 4, BF16, 0, NE, 1, 0, 0, 1, I32, 2, 0, 0, 1, 1 },
        { "r3_ex_bf16_a4_zp", 3, 24, 512, 33, 4, BF16, 0, EX, 4, 1, 0, 1, I64, 1, 1, 0, 0, 1 },
        { "r4_ex_fp8_nozp", 4, 32, 512, 33, 3, FP8, 0, EX, 2, 0, 0, 1, I32, 0, 1, 1, 0, 0 },
        { "r8_ne_fp8", 8, 64, 256, 17, 8, FP8, 0, NE, 1, 0, 0, 1, I64, 2, 0, 0, 0, 1 },
        { "r8_ex_blocks", 8, 32, 256, 9, 4, BF16, 0, EX, 2, 1, 32, 1, I32, 1, 1, 0, 0, 1 },
        { "r3_ne_quant", 3, 12, 512, 20, 3, BF16, 1, NE, 1, 0, 0, 0, I32, 1, 0, 0, 0, 1 },
        { "r8_ex_quant_blocks", 8, 16, 256, 6, 2, BF16, 1, EX, 2, 1, 24, 1, I64, 2, 1, 0, 0, 1 },
        { "r2_ex_nowt_sw", 2, 8, 256, 16, 2, BF16, 0, EX, 1, 1, 0, 0, I32, 0, 1, 1, 0, 0 },
};

int main(void)
{
        int devices = 0;
        struct cudaDeviceProp prop;
        const struct gcase graph_case = { "graph_r4_ex_quant", 4, 16, 256, 12, 4, BF16, 1, EX, 2,
                                          1, 0, 1, I64, 1, 1, 0, 0, 0 };

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
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
                run_case(&cases[i], (uint32_t)prop.multiProcessorCount);
        run_graph(&graph_case, (uint32_t)prop.multiProcessorCount);
        if (failures) {
                fprintf(stderr, "%d failure(s)\n", failures);
                return 1;
        }
        printf("all client-executed kernel checks passed\n");
        return 0;
}
