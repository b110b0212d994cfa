/* epd-demo - the main job on the embedded default: a host-backend epd on a temporary socket and
 * 8 worker processes running MoE steps through it. Each step routes tokens (softmax top-k over
 * router logits), dispatches them in the EXPAND layout into the daemon's output arena, runs a
 * stand-in expert in place on the received rows (expert l scales its rows by 1 + l/8), combines
 * with the routing weights, and verifies dispatch and combine bit for bit against the CPU
 * executor (bench/oracle.h). Prints per-op latency and throughput, then `epctl groups`.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bf16.h"
#include "daemon_proc.h"
#include "epd.h"
#include "oracle.h"
#include "testdata.h"

#define RANKS 8
#define EXPERTS 64
#define HIDDEN 2048
#define TOKENS 256
#define TOPK 4
#define STEPS 5
#define SEED 20261201ull

struct sample {
        double dispatch_us, combine_us, dispatch_exec_us, combine_exec_us;
        uint64_t recv_rows, sent_rows;
};

static double now_us(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Router of source s at a step: logits from the seed, softmax, top-k (ties to the lower id). */
static void route(uint32_t s, int step, int64_t *topk, float *weights, uint16_t *x)
{
        struct td_rng rng;
        float logits[EXPERTS];

        td_rng_seed(&rng, td_mix_seed(SEED, (uint64_t)step * 100 + s));
        td_fill_bf16(&rng, x, TOKENS, HIDDEN, 0, 0.0);
        for (uint32_t t = 0; t < TOKENS; t++) {
                float maxv = -INFINITY, sum = 0;
                int used[EXPERTS] = { 0 };
                for (int e = 0; e < EXPERTS; e++) {
                        logits[e] = (float)(td_rng_unit(&rng) * 8.0 - 4.0);
                        maxv = logits[e] > maxv ? logits[e] : maxv;
                }
                for (int e = 0; e < EXPERTS; e++)
                        sum += expf(logits[e] - maxv);
                for (int k = 0; k < TOPK; k++) {
                        int best = -1;
                        for (int e = 0; e < EXPERTS; e++)
                                if (!used[e] && (best < 0 || logits[e] > logits[best]))
                                        best = e;
                        used[best] = 1;
                        topk[t * TOPK + k] = best;
                        weights[t * TOPK + k] = expf(logits[best] - maxv) / sum;
                }
        }
}

/* The stand-in expert: local expert l scales a bf16 row by 1 + l/8, rounding once. */
static void expert(uint32_t l, const uint16_t *in, uint16_t *out)
{
        float scale = 1.0f + (float)l / 8.0f;

        for (int h = 0; h < HIDDEN; h++)
                out[h] = epd__float_to_bf16(epd__bf16_to_float(in[h]) * scale);
}

/* The stand-in expert on every row of destination d's EXPAND output rows that holds a selection
 * (padding rows are left alone: combine never reads them). */
static void run_experts(const struct oracle *orc, uint32_t d, const int32_t *per_expert,
                        uint16_t *rows)
{
        const uint32_t L = EXPERTS / RANKS;
        const int32_t *base = orc->plan->expert_base + (size_t)d * (L + 1);

        for (uint32_t l = 0; l < L; l++)
                for (int32_t i = 0; i < per_expert[l]; i++)
                        expert(l, rows + (size_t)(base[l] + i) * HIDDEN,
                               rows + (size_t)(base[l] + i) * HIDDEN);
}

static int worker(const char *socket_path, const unsigned char secret[16], uint32_t rank,
                  int report_fd, int go_fd)
{
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = socket_path,
                                       .client_name = "epd-demo", .timeout_ms = 60000 };
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = RANKS, .num_experts = EXPERTS,
                .hidden = HIDDEN, .max_tokens_per_rank = TOKENS, .max_topk = TOPK,
                .dispatch_dtype = EPD_DTYPE_BF16, .arena_bytes = 64ull << 20,
        };
        struct epd_group_args ga = { .size = sizeof(ga), .name = "demo", .secret = secret,
                                     .secret_len = 16, .rank = rank, .config = &cfg };
        struct epd_client *c = NULL;
        struct epd_group *g = NULL;
        size_t in_bytes = (size_t)TOKENS * (HIDDEN * 2 + TOPK * 12) + (size_t)TOKENS * HIDDEN * 2;
        int64_t *all_topk[RANKS];
        float *all_w[RANKS];
        uint16_t *all_x[RANKS];
        char err[512];
        int rc = 1;

        if (epd_client_connect(&ca, &c, err, sizeof(err)) < 0) {
                fprintf(stderr, "rank %u: connect: %s\n", rank, err);
                return 1;
        }
        for (int i = 0; i < 2000; i++) {
                rc = rank == 0 ? epd_group_create(c, &ga, &g) : epd_group_join(c, &ga, &g);
                if (rc != EPD_NOT_FOUND)
                        break;
                usleep(2000);
        }
        if (rc < 0) {
                fprintf(stderr, "rank %u: group: %s\n", rank, epd_client_last_error(c));
                goto out;
        }
        void *base;
        uint64_t region;
        if (epd_region_alloc(c, in_bytes, &base, &region) < 0)
                goto out;
        uint16_t *x = base;
        int64_t *topk = (int64_t *)(x + (size_t)TOKENS * HIDDEN);
        float *w = (float *)(topk + TOKENS * TOPK);
        uint16_t *combined = (uint16_t *)(w + TOKENS * TOPK);
        for (uint32_t s = 0; s < RANKS; s++) {
                all_topk[s] = malloc(sizeof(int64_t) * TOKENS * TOPK);
                all_w[s] = malloc(sizeof(float) * TOKENS * TOPK);
                all_x[s] = malloc(2ull * TOKENS * HIDDEN);
        }

        for (int step = 0; step < STEPS; step++) {
                struct sample smp = { 0 };
                struct oracle_src src[RANKS];
                struct oracle_params p = {
                        .world_size = RANKS, .num_experts = EXPERTS, .hidden = HIDDEN,
                        .max_tokens = TOKENS, .num_topk = TOPK, .dtype = EPD_DTYPE_BF16,
                        .topk_dtype = EPD_DTYPE_INT64, .layout = EPD_LAYOUT_EXPAND,
                        .expert_alignment = 16, .zero_padding = 1,
                };
                struct oracle *orc = NULL;

                /* Every worker knows every rank's routing (a pure function of the seed), so each
                 * can compute the expected outputs on its own. */
                for (uint32_t s = 0; s < RANKS; s++) {
                        route(s, step, all_topk[s], all_w[s], all_x[s]);
                        src[s] = (struct oracle_src){ TOKENS, all_x[s], NULL, all_topk[s],
                                                      all_w[s] };
                }
                memcpy(x, all_x[rank], 2ull * TOKENS * HIDDEN);
                memcpy(topk, all_topk[rank], sizeof(int64_t) * TOKENS * TOPK);
                memcpy(w, all_w[rank], sizeof(float) * TOKENS * TOPK);
                if (oracle_new(&p, src, &orc, err, sizeof(err)) < 0) {
                        fprintf(stderr, "rank %u: plan: %s\n", rank, err);
                        goto out;
                }
                uint64_t xs[2] = { TOKENS, HIDDEN }, ks[2] = { TOKENS, TOPK };
                struct epd_dispatch_args da = { .size = sizeof(da), .num_tokens = TOKENS,
                                                .layout = EPD_LAYOUT_EXPAND,
                                                .expert_alignment = 16, .zero_padding = 1,
                                                .use_arena = 1 };
                epd_tensor_at(c, x, EPD_DTYPE_BF16, 2, xs, &da.x);
                epd_tensor_at(c, topk, EPD_DTYPE_INT64, 2, ks, &da.topk_idx);
                epd_tensor_at(c, w, EPD_DTYPE_FP32, 2, ks, &da.topk_weights);
                struct epd_op *op;
                double t0 = now_us();
                rc = epd_dispatch(g, &da, &op);
                smp.dispatch_us = now_us() - t0;
                if (rc < 0) {
                        fprintf(stderr, "rank %u step %d: dispatch: %s\n", rank, step,
                                epd_client_last_error(c));
                        goto out;
                }
                struct epd_dispatch_result dr;
                epd_op_dispatch_result(op, &dr);
                smp.dispatch_exec_us = dr.exec_ns / 1e3;
                smp.recv_rows = (uint64_t)dr.num_recv_tokens;
                struct oracle_dispatch_out act = {
                        .recv_x = dr.recv_x_ptr, .recv_weights = dr.recv_weights_ptr,
                        .recv_src = dr.recv_src_ptr, .recv_topk_slot = dr.recv_topk_slot_ptr,
                };
                if (oracle_check_counts(orc, rank, &dr, err, sizeof(err)) ||
                    oracle_check_dispatch(orc, rank, &act, err, sizeof(err))) {
                        fprintf(stderr, "rank %u step %d: dispatch mismatch: %s\n", rank, step, err);
                        goto out;
                }
                /* The expert runs in place on the arena rows; combine reads them back as y. */
                run_experts(orc, rank, dr.num_recv_tokens_per_expert, dr.recv_x_ptr);
                /* The expected y of every destination: the CPU executor's dispatch outputs, with
                 * the same expert run on them. */
                struct oracle_dispatch_out want[RANKS];
                const void *ys[RANKS];
                int no_memory = 0;
                memset(want, 0, sizeof(want));
                for (uint32_t d = 0; d < RANKS && !no_memory; d++) {
                        no_memory = oracle_dispatch_expected(orc, d, &want[d]) < 0;
                        if (no_memory)
                                break;
                        run_experts(orc, d, orc->plan->expert_count + (size_t)d * (EXPERTS / RANKS),
                                    want[d].recv_x);
                        ys[d] = want[d].recv_x;
                }
                if (no_memory) {
                        fprintf(stderr, "rank %u step %d: out of memory\n", rank, step);
                        for (uint32_t d = 0; d < RANKS; d++)
                                oracle_dispatch_out_free(&want[d]);
                        rc = 1;
                        goto out;
                }
                struct epd_combine_args cb = { .size = sizeof(cb), .handle_id = dr.handle_id,
                                               .apply_weights = 1, .y = dr.recv_x };
                uint64_t cs[2] = { TOKENS, HIDDEN };
                epd_tensor_at(c, combined, EPD_DTYPE_BF16, 2, cs, &cb.combined);
                struct epd_combine_result cr;
                t0 = now_us();
                rc = epd_combine(g, &cb, &cr);
                smp.combine_us = now_us() - t0;
                if (rc < 0) {
                        fprintf(stderr, "rank %u step %d: combine: %s\n", rank, step,
                                epd_client_last_error(c));
                        goto out;
                }
                smp.combine_exec_us = cr.exec_ns / 1e3;
                smp.sent_rows = (uint64_t)dr.num_expanded_rows;
                rc = oracle_check_combine(orc, rank, ys, 1, combined, NULL, err, sizeof(err));
                for (uint32_t d = 0; d < RANKS; d++)
                        oracle_dispatch_out_free(&want[d]);
                if (rc) {
                        fprintf(stderr, "rank %u step %d: combine mismatch: %s\n", rank, step, err);
                        rc = 1;
                        goto out;
                }
                epd_handle_release(g, dr.handle_id);
                epd_op_free(op);
                oracle_free(orc);
                if (write(report_fd, &smp, sizeof(smp)) != sizeof(smp))
                        goto out;
        }
        /* Stay in the group until the parent has shown `epctl groups`. */
        char go;
        if (read(go_fd, &go, 1) != 1)
                goto out;
        rc = 0;
out:
        epd_group_leave(g);
        epd_client_free(c);
        return rc ? 1 : 0;
}

static int cmp_double(const void *a, const void *b)
{
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

int main(void)
{
        const char *const daemon_args[] = { "--backend", "host", NULL };
        struct daemon_proc d;
        unsigned char secret[16];
        int report[2], go[2];
        pid_t pids[RANKS];
        struct sample s[RANKS * STEPS];
        int failures;

        setvbuf(stdout, NULL, _IOLBF, 0);
        printf("epd demo: %d worker processes, %d experts, hidden %d, %d tokens per rank, top-%d, "
               "%d MoE steps (EXPAND, bf16, output arena, host backend)\n",
               RANKS, EXPERTS, HIDDEN, TOKENS, TOPK, STEPS);
        /* The group's secret: drawn here, inherited by every worker, known to no one else. */
        if (getrandom(secret, sizeof(secret), 0) != (ssize_t)sizeof(secret)) {
                fprintf(stderr, "epd-demo: getrandom: %s\n", strerror(errno));
                return 1;
        }
        if (daemon_proc_start(&d, "epd-demo", NULL, daemon_args, 10000) < 0)
                return 1;
        printf("daemon: pid %d, socket %s\n", (int)d.pid, d.socket);
        if (pipe(report) < 0 || pipe(go) < 0)
                return 1;
        for (uint32_t r = 0; r < RANKS; r++) {
                pids[r] = fork();
                if (pids[r] == 0) {
                        close(report[0]);
                        close(go[1]);
                        _exit(worker(d.socket, secret, r, report[1], go[0]));
                }
        }
        close(report[1]);
        close(go[0]);
        int got = 0;
        while (got < RANKS * STEPS && read(report[0], &s[got], sizeof(s[0])) == sizeof(s[0]))
                got++;
        if (got == RANKS * STEPS) {
                double dl[RANKS * STEPS], cl[RANKS * STEPS];
                uint64_t rows = 0, sent = 0;
                double dex = 0, cex = 0;
                for (int i = 0; i < got; i++) {
                        dl[i] = s[i].dispatch_us;
                        cl[i] = s[i].combine_us;
                        rows += s[i].recv_rows;
                        sent += s[i].sent_rows;
                        dex += s[i].dispatch_exec_us / RANKS;
                        cex += s[i].combine_exec_us / RANKS;
                }
                qsort(dl, (size_t)got, sizeof(double), cmp_double);
                qsort(cl, (size_t)got, sizeof(double), cmp_double);
                double row = HIDDEN * 2.0;
                printf("all %d steps verified bit for bit against the CPU executor on every rank\n",
                       STEPS);
                printf("%-9s %12s %12s %14s %16s\n", "op", "p50 [us]", "max [us]",
                       "exec sum [ms]", "payload [GB/s]");
                printf("%-9s %12.1f %12.1f %14.2f %16.2f\n", "dispatch", dl[got / 2],
                       dl[got - 1], dex / 1e3, rows * row / (dex * 1e3));
                printf("%-9s %12.1f %12.1f %14.2f %16.2f\n", "combine", cl[got / 2],
                       cl[got - 1], cex / 1e3, sent * row / (cex * 1e3));
                printf("(payload: received rows x row bytes over the backend's execution time)\n\n");
                char out[16384];
                const char *args[] = { "--socket", d.socket, "groups", NULL };
                if (daemon_proc_run_tool("epctl", args, out, sizeof(out)) != 0)
                        fprintf(stderr, "epd-demo: epctl groups failed\n");
                printf("$ epctl groups\n%s", out);
        }
        for (int i = 0; i < RANKS; i++)
                if (write(go[1], "g", 1) != 1)
                        break;
        close(go[1]);
        failures = daemon_proc_wait_children(pids, RANKS, 120000);
        int stop = daemon_proc_stop(&d, 10000);
        if (failures || got != RANKS * STEPS || stop != 0) {
                fprintf(stderr, "epd demo FAILED: %d worker(s) failed, daemon exit %d\n", failures,
                        stop);
                return 1;
        }
        printf("epd demo passed\n");
        return 0;
}
