/* worker.c - one rank's process: connects, enters the group, registers its inputs and outputs,
 * runs warmup + iters iterations of dispatch -> combine, checks iteration 0 bitwise against the
 * CPU executor (bench/oracle.h) and writes one sample per op into the shared mapping. Meets the
 * parent at the sync points (sync_after). Runs after fork, alone on its thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "oracle.h"

int enter_group(const struct bench *b, struct epd_client *client, uint32_t rank,
                struct epd_group **out)
{
        const int cx = b->opt.execution == EPD_EXECUTION_CLIENT;
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = b->R, .num_experts = b->E, .hidden = b->H,
                .max_tokens_per_rank = b->T, .max_topk = b->K,
                .dispatch_dtype = b->opt.wl->dtype, .scale_block = BENCH_SCALE_BLOCK,
                .op_timeout_ms = 60000, .arena_bytes = cx ? 0 : b->arena_bytes,
                .execution = b->opt.execution,
        };
        struct epd_group_args ga = {
                .size = sizeof(ga), .name = b->group_name, .secret = b->secret,
                .secret_len = sizeof(b->secret), .rank = rank, .device = rank % b->opt.devices,
                .config = &cfg,
        };

        if (rank == 0)
                return epd_group_create(client, &ga, out);
        /* Rank 0 may not have created the group yet: retry for up to 20 s. */
        for (int attempt = 0; attempt < 4000; attempt++) {
                int rc = epd_group_join(client, &ga, out);
                if (rc != EPD_NOT_FOUND)
                        return rc;
                usleep(5000);
        }
        return EPD_NOT_FOUND;
}

/* A tensor at ptr inside one of this client's registered regions. */
static int tensor(struct epd_client *c, const void *ptr, enum epd_dtype dt, uint64_t rows,
                  uint64_t cols, struct epd_tensor *out)
{
        uint64_t sizes[2] = { rows, cols };

        return epd_tensor_at(c, ptr, dt, cols ? 2 : 1, sizes, out);
}

/* Whether the workers meet the parent after iteration `it`: after the verified iteration 0, so
 * that no rank's next op waits for a slower peer's check, and at the measured-iteration
 * boundaries where the parent probes the ceiling (*probe). Both sides call it, so they agree. */
int sync_after(const struct bench *b, uint32_t it, int *probe)
{
        uint32_t done = it % b->per_phase + 1, w = b->opt.warmup;
        int mark = done >= w && ((done - w) % b->probe_every == 0 || done == b->per_phase);

        /* Without host probes (CUDA mode) the workers still meet at the start and end of every
         * phase's measured iterations, so that each phase starts together. */
        *probe = b->host_probes && mark;
        return it == 0 || mark;
}

/* The phase of iteration it (each phase is warmup + iters iterations). */
uint32_t phase_of(const struct bench *b, uint32_t it)
{
        return it / b->per_phase;
}

int worker_sync(const struct bench *b, uint32_t rank)
{
        char c = 's';

        if (write(b->to_parent[rank][1], &c, 1) != 1)
                return -1;
        return read(b->from_parent[rank][0], &c, 1) == 1 ? 0 : -1;
}

/* Submits one op, dispatch (da) or combine (cb), and waits for it as the phase says. t0 is taken
 * just before submit (after the L2 flush), t1 when completion is visible to the client. */
static int run_op(struct epd_group *group, struct wcuda *wc, int strm,
                  struct epd_dispatch_args *da, struct epd_combine_args *cb, struct epd_op **op,
                  uint64_t *t0, uint64_t *t1, char *err, size_t len)
{
        uint64_t seq = 0;
        int rc;

        *t0 = now_ns();
        if (strm) {
                rc = epd_group_mark_inputs_ready(group, wc_stream(wc), &seq);
                if (rc < 0) {
                        snprintf(err, len, "epd_group_mark_inputs_ready: %s", epd_status_name(rc));
                        return rc;
                }
        }
        if (da) {
                da->wait_inputs = seq;
                rc = epd_dispatch_submit(group, da, op);
        } else {
                cb->wait_inputs = seq;
                rc = epd_combine_submit(group, cb, op);
        }
        if (rc < 0) {
                snprintf(err, len, "submit: %s", epd_status_name(rc));
                return rc;
        }
        if (strm) {
                if (stream_complete(wc, *op, err, len) < 0)
                        return EPD_INTERNAL;
                *t1 = now_ns();
                rc = epd_op_wait(*op, -1);
        } else {
                rc = epd_op_wait(*op, -1);
                *t1 = now_ns();
        }
        if (rc < 0)
                snprintf(err, len, "%s: %s", epd_status_name(rc), epd_op_error(*op));
        return rc;
}

int worker_start(const struct bench *b, uint32_t rank, const void ***ybufs,
                 struct epd_client **client, struct epd_group **group, struct wcuda *wc,
                 char *err, size_t len)
{
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = b->socket,
                                       .client_name = "epd-bench", .timeout_ms = 120000 };
        char why[512];
        int rc;

        memset(wc, 0, sizeof(*wc));
        *ybufs = calloc(b->R, sizeof(**ybufs));
        if (!*ybufs) {
                snprintf(err, len, "out of memory");
                return -1;
        }
        for (uint32_t d = 0; d < b->R; d++)
                (*ybufs)[d] = b->ranks[d].y.ptr;
        rc = epd_client_connect(&ca, client, why, sizeof(why));
        if (rc < 0) {
                snprintf(err, len, "connect to %s: %s: %s", b->socket, epd_status_name(rc), why);
                return -1;
        }
        /* The group first (rank 0 creates it at once), then CUDA, whose context creation in
         * several processes at once may take a while. */
        rc = enter_group(b, *client, rank, group);
        if (rc < 0) {
                snprintf(err, len, "enter group %s: %s: %s", b->group_name, epd_status_name(rc),
                         epd_client_last_error(*client));
                return -1;
        }
        if (b->worker_cuda && wcuda_init(wc, b, rank, why, sizeof(why)) < 0) {
                snprintf(err, len, "CUDA on device %u: %s", rank % b->opt.devices, why);
                return -1;
        }
        return 0;
}

void dev_release(struct epd_client *client, const struct wcuda *wc, uint8_t **const *bufs,
                 uint64_t *regions, int n)
{
        for (int i = 0; i < n; i++) {
                if (wc->cumem) {
                        if (*bufs[i])
                                epd_device_free(client, *bufs[i]);
                        *bufs[i] = NULL;
                        regions[i] = 0;
                }
                if (regions[i])
                        epd_region_release(client, regions[i]);
        }
}

int worker_run(struct bench *b, uint32_t rank)
{
        struct rank_data *me = &b->ranks[rank];
        const int expand = b->opt.layout == EPD_LAYOUT_EXPAND;
        const int dev = b->opt.device_memory;
        const enum epd_dtype dt = b->opt.wl->dtype;
        const uint32_t n = me->num_tokens, H = b->H, K = b->K;
        struct epd_client *client = NULL;
        struct epd_group *group = NULL;
        struct epd_op *op = NULL;
        const void **ybufs = NULL;
        struct wcuda wc;
        /* Device memory regions (in, y, outputs, combined), released before the memory is
         * freed; host copies of iteration 0's device outputs. */
        uint64_t dregion[4] = { 0, 0, 0, 0 };
        uint8_t *h_out = NULL, *h_comb = NULL;
        uint64_t region_id, out_total = 0;
        char err[1024];
        int rc, status = 1;

        if (b->opt.execution == EPD_EXECUTION_CLIENT)
                return worker_run_cx(b, rank);
        if (worker_start(b, rank, &ybufs, &client, &group, &wc, err, sizeof(err)) < 0)
                WFAIL("%s", err);

        /* Regions the ops never use, registered first (--extra-regions). */
        for (uint32_t i = 0; i < b->opt.extra_regions; i++) {
                void *p;
                rc = epd_region_alloc(client, 4096, &p, &region_id);
                if (rc < 0)
                        WFAIL("extra region %u: %s", i, epd_client_last_error(client));
        }

        /* Inputs and y: the shared memfds themselves, or device copies of them uploaded once.
         * The device copies keep the memfd's layout, so in_base + (p - me->in.ptr) maps. */
        uint8_t *in_base = me->in.ptr, *y_base = me->y.ptr;
        if (dev) {
                if (dev_alloc_register(client, &wc, me->in.bytes, &wc.d_in, &dregion[0], err,
                                       sizeof(err)) < 0 ||
                    dev_alloc_register(client, &wc, me->y.bytes, &wc.d_y, &dregion[1], err,
                                       sizeof(err)) < 0 ||
                    dev_copy(wc.d_in, me->in.ptr, me->in.bytes, COPY_H2D, err, sizeof(err)) < 0 ||
                    dev_copy(wc.d_y, me->y.ptr, me->y.bytes, COPY_H2D, err, sizeof(err)) < 0)
                        WFAIL("device inputs: %s", err);
                in_base = wc.d_in;
                y_base = wc.d_y;
        } else {
                rc = epd_region_register_fd(client, EPD_REGION_HOST_MEMFD, me->in.fd, me->in.bytes,
                                            0, me->in.ptr, &region_id);
                if (rc >= 0)
                        rc = epd_region_register_fd(client, EPD_REGION_HOST_MEMFD, me->y.fd,
                                                    me->y.bytes, 0, me->y.ptr, &region_id);
                if (rc < 0)
                        WFAIL("register inputs: %s", epd_client_last_error(client));
        }
#define IN_PTR(p) (in_base + ((const uint8_t *)(p) - me->in.ptr))

        /* Combine outputs: combined [N, H] bf16 and combined_topk_weights [N, K] fp32. cbase is
         * where the daemon writes them, h_cbase where this process reads them. */
        uint64_t comb_x = align64((uint64_t)n * H * 2);
        uint64_t comb_bytes = comb_x + (uint64_t)n * K * 4 + 4096;
        uint8_t *cbase, *h_cbase;
        if (dev) {
                h_comb = malloc(comb_bytes);
                if (!h_comb)
                        WFAIL("out of memory");
                if (dev_alloc_register(client, &wc, comb_bytes, &wc.d_comb, &dregion[3], err,
                                       sizeof(err)) < 0 ||
                    dev_fill(wc.d_comb, 0xEE, comb_bytes, err, sizeof(err)) < 0)
                        WFAIL("combined device region: %s", err);
                cbase = wc.d_comb;
                h_cbase = h_comb;
        } else {
                void *p;
                rc = epd_region_alloc(client, comb_bytes, &p, &region_id);
                if (rc < 0)
                        WFAIL("combined region: %s", epd_client_last_error(client));
                cbase = h_cbase = p;
        }

        struct epd_dispatch_args da = {
                .size = sizeof(da), .num_tokens = n, .num_topk = K, .layout = b->opt.layout,
                .expert_alignment = 1, .use_arena = b->opt.use_arena,
        };
        rc = tensor(client, IN_PTR(me->x), dt, n, H, &da.x);
        if (rc >= 0 && b->scale_cols)
                rc = tensor(client, IN_PTR(me->scales), EPD_DTYPE_FP32, n, b->scale_cols,
                            &da.scales);
        if (rc >= 0)
                rc = tensor(client, IN_PTR(me->topk), EPD_DTYPE_INT64, n, K, &da.topk_idx);
        if (rc >= 0)
                rc = tensor(client, IN_PTR(me->weights), EPD_DTYPE_FP32, n, K, &da.topk_weights);
        if (rc < 0)
                WFAIL("input tensors: %s", epd_client_last_error(client));
#undef IN_PTR

        /* Client-registered outputs of exactly the rows this rank receives (the capacity check of
         * docs/semantics.md 2.5 is then tight), laid out in one region: host memory, or device memory
         * poisoned before the verified iteration and downloaded after it. */
        struct oracle_dispatch_out act;
        memset(&act, 0, sizeof(act));
        if (!b->opt.use_arena) {
                uint64_t cap = me->rows > 0 ? (uint64_t)me->rows : 1;
                uint64_t sz[6] = {
                        align64(cap * b->row_bytes), align64(cap * b->scale_cols * 4),
                        expand ? 0 : align64(cap * K * 8), align64(cap * (expand ? 1 : K) * 4),
                        align64(cap * 8), expand ? align64(cap * 4) : 0,
                };
                uint8_t *p, *hp;

                for (int i = 0; i < 6; i++)
                        out_total += sz[i];
                out_total += 4096;
                if (dev) {
                        h_out = malloc(out_total);
                        if (!h_out)
                                WFAIL("out of memory");
                        if (dev_alloc_register(client, &wc, out_total, &wc.d_out, &dregion[2], err,
                                               sizeof(err)) < 0 ||
                            dev_fill(wc.d_out, 0xAB, out_total, err, sizeof(err)) < 0)
                                WFAIL("output device region: %s", err);
                        p = wc.d_out;
                        hp = h_out;
                } else {
                        void *obase;
                        rc = epd_region_alloc(client, out_total, &obase, &region_id);
                        if (rc < 0)
                                WFAIL("output region: %s", epd_client_last_error(client));
                        p = hp = obase;
                }
                rc = tensor(client, p, dt, cap, H, &da.recv_x);
                act.recv_x = hp;
                p += sz[0];
                hp += sz[0];
                if (rc >= 0 && b->scale_cols) {
                        rc = tensor(client, p, EPD_DTYPE_FP32, cap, b->scale_cols, &da.recv_scales);
                        act.recv_scales = hp;
                }
                p += sz[1];
                hp += sz[1];
                if (rc >= 0 && !expand) {
                        rc = tensor(client, p, EPD_DTYPE_INT64, cap, K, &da.recv_topk_idx);
                        act.recv_topk_idx = hp;
                }
                p += sz[2];
                hp += sz[2];
                if (rc >= 0) {
                        rc = tensor(client, p, EPD_DTYPE_FP32, cap, expand ? 0 : K, &da.recv_weights);
                        act.recv_weights = hp;
                }
                p += sz[3];
                hp += sz[3];
                if (rc >= 0) {
                        rc = tensor(client, p, EPD_DTYPE_INT64, cap, 0, &da.recv_src);
                        act.recv_src = hp;
                }
                p += sz[4];
                hp += sz[4];
                if (rc >= 0 && expand) {
                        rc = tensor(client, p, EPD_DTYPE_INT32, cap, 0, &da.recv_topk_slot);
                        act.recv_topk_slot = hp;
                }
                if (rc < 0)
                        WFAIL("output tensors: %s", epd_client_last_error(client));
        }

        struct epd_combine_args cb = {
                .size = sizeof(cb), .apply_weights = expand, .num_bias = 0,
        };
        rc = tensor(client, y_base, EPD_DTYPE_BF16, (uint64_t)me->rows, H, &cb.y);
        if (rc >= 0)
                rc = tensor(client, cbase, EPD_DTYPE_BF16, n, H, &cb.combined);
        if (rc >= 0)
                rc = tensor(client, cbase + comb_x, EPD_DTYPE_FP32, n, K, &cb.combined_topk_weights);
        if (rc < 0)
                WFAIL("combine tensors: %s", epd_client_last_error(client));

        for (uint32_t it = 0; it < b->total_iters; it++) {
                struct sample *smp = &b->samples[((size_t)rank * b->total_iters + it) * 2];
                int strm = b->phase_stream[phase_of(b, it)];
                struct epd_dispatch_result dr;
                struct epd_combine_result cr;
                uint64_t t0 = 0, t1 = 0;

                if (b->opt.flush_l2 && dev_flush(&wc, 2 * it, err, sizeof(err)) < 0)
                        WFAIL("L2 flush before dispatch %u: %s", it, err);
                rc = run_op(group, &wc, strm, &da, NULL, &op, &t0, &t1, err, sizeof(err));
                if (rc < 0)
                        WFAIL("dispatch %u: %s%s%s", it, err, op ? "" : ": ",
                              op ? "" : epd_client_last_error(client));
                rc = epd_op_dispatch_result(op, &dr);
                if (rc < 0)
                        WFAIL("dispatch %u result: %s", it, epd_status_name(rc));
                smp[OP_DISPATCH] = (struct sample){ t0, t1, dr.exec_ns, dr.kernel_ns, dr.queue_ns,
                                                    { .size = sizeof(struct epd_op_timeline) }, 0 };
                if (epd_op_timeline(op, &smp[OP_DISPATCH].tl) < 0)
                        WFAIL("dispatch %u timeline", it);

                if (it == 0) {
                        if (b->opt.use_arena) {
                                act.recv_x = dr.recv_x_ptr;
                                act.recv_scales = dr.recv_scales_ptr;
                                act.recv_topk_idx = dr.recv_topk_idx_ptr;
                                act.recv_weights = dr.recv_weights_ptr;
                                act.recv_src = dr.recv_src_ptr;
                                act.recv_topk_slot = dr.recv_topk_slot_ptr;
                                if (me->rows > 0 && !dr.recv_x_ptr)
                                        WFAIL("dispatch reply names no arena placement");
                        }
                        if (dev && dev_copy(h_out, wc.d_out, out_total, COPY_D2H, err,
                                            sizeof(err)) < 0)
                                WFAIL("download of the dispatch outputs: %s", err);
                        if (oracle_check_counts(b->oracle, rank, &dr, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: dispatch counts: %s", err);
                        if (oracle_check_dispatch(b->oracle, rank, &act, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: dispatch outputs: %s", err);
                        /* The identity expert: y is the received rows, outside the timing. The
                         * shared host copy is what the other ranks' combine checks read. */
                        if (dt == EPD_DTYPE_BF16 && me->rows > 0) {
                                memcpy(me->y.ptr, act.recv_x, (size_t)me->rows * b->row_bytes);
                                if (dev && dev_copy(wc.d_y, wc.d_out,
                                                    (uint64_t)me->rows * b->row_bytes, COPY_D2D,
                                                    err, sizeof(err)) < 0)
                                        WFAIL("y from recv_x: %s", err);
                        }
                }
                cb.handle_id = dr.handle_id;
                epd_op_free(op);
                op = NULL;

                if (b->opt.flush_l2 && dev_flush(&wc, 2 * it + 1, err, sizeof(err)) < 0)
                        WFAIL("L2 flush before combine %u: %s", it, err);
                rc = run_op(group, &wc, strm, NULL, &cb, &op, &t0, &t1, err, sizeof(err));
                if (rc < 0)
                        WFAIL("combine %u: %s%s%s", it, err, op ? "" : ": ",
                              op ? "" : epd_client_last_error(client));
                rc = epd_op_combine_result(op, &cr);
                if (rc < 0)
                        WFAIL("combine %u result: %s", it, epd_status_name(rc));
                smp[OP_COMBINE] = (struct sample){ t0, t1, cr.exec_ns, cr.kernel_ns, cr.queue_ns,
                                                   { .size = sizeof(struct epd_op_timeline) }, 0 };
                if (epd_op_timeline(op, &smp[OP_COMBINE].tl) < 0)
                        WFAIL("combine %u timeline", it);
                epd_op_free(op);
                op = NULL;

                if (it == 0) {
                        /* Every rank wrote its y before submitting the combine, and the combine
                         * completed only after every rank submitted: all y are in place. */
                        if (dev && dev_copy(h_comb, wc.d_comb, comb_bytes, COPY_D2H, err,
                                            sizeof(err)) < 0)
                                WFAIL("download of the combine outputs: %s", err);
                        if (oracle_check_combine(b->oracle, rank, ybufs, cb.apply_weights, h_cbase,
                                                 h_cbase + comb_x, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: combine outputs: %s", err);
                        /* The host copies are needed no more. */
                        free(h_out);
                        free(h_comb);
                        h_out = h_comb = NULL;
                }
                rc = epd_handle_release(group, cb.handle_id);
                if (rc < 0)
                        WFAIL("handle release: %s", epd_client_last_error(client));
                int probe;
                if (sync_after(b, it, &probe) && worker_sync(b, rank) < 0)
                        WFAIL("lost the parent at the sync point after iteration %u", it);
        }
        status = 0;
out:
        epd_op_free(op);
        epd_group_leave(group);
        /* The clean order: the daemon lets go of the device memory before it is freed.
         * epd_device_free does both for --alloc cumem (dregion[] follows d_in, d_y, d_out,
         * d_comb). */
        {
                uint8_t **bufs[4] = { &wc.d_in, &wc.d_y, &wc.d_out, &wc.d_comb };
                dev_release(client, &wc, bufs, dregion, 4);
        }
        epd_client_free(client);
        wcuda_fini(&wc);
        free(h_out);
        free(h_comb);
        free(ybufs);
        return status;
}
