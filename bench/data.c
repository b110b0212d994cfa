/* data.c - every rank's inputs and y in shared memfds, made by the parent before the workers are
 * forked (the workers inherit the mappings), the plan of their dispatch (bench/oracle.h), and the
 * byte counts the bandwidths are computed from (docs/benchmarks.md). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench.h"
#include "oracle.h"
#include "routing.h"
#include "testdata.h"
#include "util.h"

int shm_alloc(struct shm_buf *b, uint64_t bytes)
{
        void *p;

        /* Never zero bytes: a region needs a size, and ranks may receive no rows. */
        b->bytes = bytes < 4096 ? 4096 : bytes;
        if (epd_memfd_alloc(b->bytes, &b->fd, &p) < 0) {
                fprintf(stderr, "epd-bench: cannot create a %llu-byte memfd: %s\n",
                        (unsigned long long)b->bytes, strerror(errno));
                b->fd = -1;
                return -1;
        }
        b->ptr = p;
        return 0;
}

void shm_free(struct shm_buf *b)
{
        if (b->fd < 0 || !b->ptr)
                return;
        munmap(b->ptr, b->bytes);
        close(b->fd);
        b->fd = -1;
        b->ptr = NULL;
}

static uint32_t tokens_of(const struct bench *b, uint32_t r)
{
        if (!b->opt.wl->descending)
                return b->T;
        return b->T > r ? b->T - r : 0;
}

/* Generates every rank's inputs (seeded by the run seed and the rank; the routing of
 * docs/benchmarks.md: uniform random top-k without repeats) into shared memfds. Payloads are
 * finite normals: a benchmark has no business timing denormal arithmetic. */
int make_inputs(struct bench *b)
{
        for (uint32_t r = 0; r < b->R; r++) {
                struct rank_data *rd = &b->ranks[r];
                uint32_t n = tokens_of(b, r);
                uint64_t x_bytes = align64((uint64_t)n * b->row_bytes);
                uint64_t s_bytes = align64((uint64_t)n * b->scale_cols * 4);
                uint64_t k_bytes = align64((uint64_t)n * b->K * 8);
                uint64_t w_bytes = align64((uint64_t)n * b->K * 4);
                struct td_rng rng;

                rd->num_tokens = n;
                if (shm_alloc(&rd->in, x_bytes + s_bytes + k_bytes + w_bytes) < 0)
                        return -1;
                rd->x = rd->in.ptr;
                rd->scales = (float *)(rd->in.ptr + x_bytes);
                rd->topk = (int64_t *)(rd->in.ptr + x_bytes + s_bytes);
                rd->weights = (float *)(rd->in.ptr + x_bytes + s_bytes + k_bytes);
                td_rng_seed(&rng, td_mix_seed(b->opt.seed, r));
                if (b->opt.wl->dtype == EPD_DTYPE_BF16)
                        td_fill_bf16(&rng, rd->x, n, b->H, 0, 0.0);
                else
                        td_fill_bytes(&rng, rd->x, n, b->row_bytes, 0);
                if (b->scale_cols)
                        td_fill_f32(&rng, rd->scales, n, b->scale_cols, 0, 0.5f, 2.0f);
                struct td_routing_args ra = {
                        .world_size = b->R, .num_experts = b->E, .num_tokens = n,
                        .num_topk = b->K, .mode = TD_ROUTING_UNIFORM, .dtype = EPD_DTYPE_INT64,
                };
                td_gen_topk(&rng, &ra, rd->topk);
                td_fill_f32(&rng, rd->weights, n, b->K, 0, 0.0f, 1.0f);
        }
        return 0;
}

int build_oracle(struct bench *b)
{
        struct oracle_params p = {
                .world_size = b->R, .num_experts = b->E, .hidden = b->H, .max_tokens = b->T,
                .num_topk = b->K, .dtype = b->opt.wl->dtype, .scale_block = BENCH_SCALE_BLOCK,
                .topk_dtype = EPD_DTYPE_INT64, .layout = b->opt.layout, .expert_alignment = 1,
                .zero_padding = 0,
        };
        struct oracle_src *src = calloc(b->R, sizeof(*src));
        char err[512];
        int rc;

        if (!src)
                return -1;
        for (uint32_t r = 0; r < b->R; r++) {
                const struct rank_data *rd = &b->ranks[r];
                src[r] = (struct oracle_src){
                        .num_tokens = rd->num_tokens,
                        .x = rd->x,
                        .scales = b->scale_cols ? rd->scales : NULL,
                        .topk_idx = rd->topk,
                        .weights = rd->weights,
                };
        }
        rc = oracle_new(&p, src, &b->oracle, err, sizeof(err));
        free(src);
        if (rc < 0) {
                fprintf(stderr, "epd-bench: plan: %s\n", err);
                return -1;
        }
        for (uint32_t r = 0; r < b->R; r++)
                b->ranks[r].rows = oracle_rows(b->oracle, r);
        return 0;
}

/* The y buffers (combine inputs). For bf16 the worker copies its received rows in after the
 * first dispatch, so y is the identity expert; fp8 rows are not bf16, so y is seeded bf16. */
int make_y(struct bench *b)
{
        for (uint32_t r = 0; r < b->R; r++) {
                struct rank_data *rd = &b->ranks[r];

                if (shm_alloc(&rd->y, (uint64_t)rd->rows * b->H * 2) < 0)
                        return -1;
                if (b->opt.wl->dtype != EPD_DTYPE_BF16) {
                        struct td_rng rng;
                        td_rng_seed(&rng, td_mix_seed(b->opt.seed, 1000000 + r));
                        td_fill_bf16(&rng, rd->y.ptr, (uint64_t)rd->rows, b->H, 0, 0.0);
                }
        }
        return 0;
}

/* Bytes of the metadata a received row carries, as docs/benchmarks.md defines logical bytes:
 * NON_EXPAND rows carry recv_topk_idx (counted as int64) and recv_topk_weights (fp32) for all
 * K_op positions. EXPAND rows carry one weight (fp32) and one top-k slot, counted as int64 like
 * topk_idx. */
static uint64_t meta_bytes(const struct bench *b)
{
        return b->opt.layout == EPD_LAYOUT_EXPAND ? 8 + 4 : (uint64_t)b->K * (8 + 4);
}

/* fp32 weights a row carries back in combine: [K_op] per NON_EXPAND row, one per EXPAND row. */
static uint64_t combine_weight_bytes(const struct bench *b)
{
        return b->opt.layout == EPD_LAYOUT_EXPAND ? 4 : (uint64_t)b->K * 4;
}

void count_bytes(const struct bench *b, struct byte_counts *c)
{
        uint64_t row = b->row_bytes + (uint64_t)b->scale_cols * 4 + meta_bytes(b);

        memset(c, 0, sizeof(*c));
        for (uint32_t r = 0; r < b->R; r++) {
                c->rows += (uint64_t)b->ranks[r].rows;
                c->tokens += b->ranks[r].num_tokens;
        }
        c->logical[OP_DISPATCH] = c->rows * row;
        /* Every received row is read once at its source and written once at its destination. */
        c->floor[OP_DISPATCH] = 2 * c->rows * row;
        c->logical[OP_COMBINE] = c->rows * ((uint64_t)b->H * 2 + combine_weight_bytes(b));
        /* Every contributed y row read once; every combined row (and its combined_topk_weights,
         * which the benchmark requests) written once. */
        c->floor[OP_COMBINE] = c->rows * (uint64_t)b->H * 2 +
                               c->tokens * ((uint64_t)b->H * 2 + (uint64_t)b->K * 4);
        c->unique[OP_DISPATCH] = c->tokens * (b->row_bytes + (uint64_t)b->scale_cols * 4 +
                                              (uint64_t)b->K * 12) +
                                 c->rows * row;
        c->unique[OP_COMBINE] = c->floor[OP_COMBINE];
        c->data = c->unique[OP_DISPATCH];
        if (!b->opt.cuda || b->opt.devices < 2)
                return;
        /* The plan says where each received row comes from: every placed (source, token, top-k
         * position) is one row at the expert's rank, and these are the rows the ops move. */
        c->cross_valid = 1;
        for (uint32_t s = 0; s < b->R; s++) {
                const struct epd_plan *plan = b->oracle->plan;
                const size_t n = (size_t)plan->num_tokens[s] * plan->num_topk;

                for (size_t i = 0; i < n; i++) {
                        int32_t e = plan->topk[s][i];
                        uint32_t d;

                        if (plan->row[s][i] < 0)
                                continue;
                        d = epd_route_expert_rank(e, plan->num_local_experts);
                        if (s % b->opt.devices != d % b->opt.devices)
                                c->cross_rows++;
                }
        }
        c->cross[OP_DISPATCH] = c->cross_rows * row;
        c->cross[OP_COMBINE] = c->cross_rows * (uint64_t)b->H * 2;
}

/* The arena a rank needs for its outputs: every field rounded up as the daemon places them. */
uint64_t arena_need(const struct bench *b, uint64_t rows)
{
        int expand = b->opt.layout == EPD_LAYOUT_EXPAND;
        uint64_t f[6] = {
                rows * b->row_bytes,
                rows * b->scale_cols * 4,
                expand ? 0 : rows * b->K * 8,
                rows * (expand ? 1 : b->K) * 4,
                rows * 8,
                expand ? rows * 4 : 0,
        };
        uint64_t total = 0;

        for (int i = 0; i < 6; i++)
                total += (f[i] + 4095) / 4096 * 4096;
        return total + (1u << 20);
}
