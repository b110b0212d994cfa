/* worker_cx.c - one rank's process for --execution client: the group is client-executed
 * (docs/client-execution.md), so the worker runs its own dispatch and combine with epd_cx_* (host
 * backend: on this thread over the daemon's shared buffers; cuda: kernels on its stream, which it
 * then synchronises). Outputs land in the rank's buffer; iteration 0 is checked bitwise against
 * the CPU executor (bench/oracle.h) like worker.c's, and every op leaves one sample: t0 before the
 * launch, t1 once the op is complete, and the op time: on cuda the kernel's window on the GPU's
 * clock (epd_cx_status), on the host backend t1 - t0 (no daemon is involved, so there is no
 * queue or timeline). Ranks sharing one GPU start each op at a gate (struct cx_gate) that opens
 * once every rank has flushed L2 and launched, so a rank's flush never runs beside a peer's op
 * and the device figure (first start to last end) measures the op, not the processes' skew.
 * With --start free they launch as they get there, as an engine's ranks do: the last rank's
 * wait then holds no gate (its wait-value and the GPU's poll of the host word).
 * Meets the parent at the same sync points as worker.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "oracle.h"

/* This rank's launch of op seq (from 1) is made: the rank whose launch completes the set opens
 * the gate. */
static void gate_arm(const struct bench *b, uint64_t seq)
{
        if (__atomic_add_fetch(&b->gate->armed, 1, __ATOMIC_ACQ_REL) == (uint64_t)b->R * seq)
                __atomic_store_n(&b->gate->open, seq, __ATOMIC_RELEASE);
}

/* One op: launched at *t0, complete at *t1 (cuda: the stream synchronised, then the op's own
 * status read from the rank's buffer, with its window on the GPU's clock in *win). With seq, the
 * stream first waits at the start gate for op seq. */
static int run_cx_op(const struct bench *b, struct epd_group *group, struct wcuda *wc, int cuda,
                     uint64_t seq, const struct epd_cx_dispatch_args *da,
                     const struct epd_cx_combine_args *ca, uint64_t *t0, uint64_t *t1,
                     uint64_t win[2], char *err, size_t len)
{
        struct epd_cx_status st = { .size = sizeof(st) };
        void *stream = cuda ? wc_stream(wc) : NULL;
        int rc;

        *t0 = now_ns();
        if (seq && wc_gate_wait(wc, seq, err, len) < 0)
                return EPD_INTERNAL;
        rc = da ? epd_cx_dispatch(group, da, stream) : epd_cx_combine(group, ca, stream);
        if (seq)
                gate_arm(b, seq); /* a failed launch too: the peers' ops then fail, not hang */
        if (rc == 0 && cuda && wc_sync(wc, err, len) < 0)
                return EPD_INTERNAL;
        *t1 = now_ns();
        if (rc < 0) {
                snprintf(err, len, "%s", epd_status_name(rc));
                return rc;
        }
        if (cuda) {
                rc = epd_cx_status(group, &st);
                if (rc == 0 && st.status != 0)
                        rc = st.status;
                if (rc < 0) {
                        snprintf(err, len, "%s: %s", epd_status_name(rc), st.message);
                        return rc;
                }
                win[0] = st.start_ns;
                win[1] = st.end_ns;
        }
        return 0;
}

/* Copies n bytes from the rank's buffer (device memory with cuda) to host memory at dst. */
static int fetch(int cuda, void *dst, const void *src, uint64_t n, char *err, size_t len)
{
        if (!cuda) {
                memcpy(dst, src, n);
                return 0;
        }
        return dev_copy(dst, src, n, COPY_D2H, err, len);
}

int worker_run_cx(struct bench *b, uint32_t rank)
{
        struct rank_data *me = &b->ranks[rank];
        const int expand = b->opt.layout == EPD_LAYOUT_EXPAND, cuda = b->opt.cuda;
        const uint32_t n = me->num_tokens, H = b->H, K = b->K, L = b->E / b->R;
        struct epd_client *client = NULL;
        struct epd_group *group = NULL;
        struct epd_cx_buffers bufs = { .size = sizeof(bufs) };
        struct epd_cx_counts counts = { .size = sizeof(counts) };
        const void **ybufs = NULL;
        uint8_t *recv_copy = NULL, *combined = NULL, *h_comb = NULL;
        int32_t *count_copy = malloc(((size_t)2 * L + b->R + 1) * sizeof(int32_t));
        uint64_t dregion[2] = { 0, 0 }, recv_bytes = 0;
        struct wcuda wc;
        char err[1024];
        int rc, status = 1, gated = 0;

        if (worker_start(b, rank, &ybufs, &client, &group, &wc, err, sizeof(err)) < 0)
                WFAIL("%s", err);
        if (!count_copy)
                WFAIL("out of memory");
        if (epd_cx_buffers(group, &bufs) < 0)
                WFAIL("epd_cx_buffers: %s", epd_client_last_error(client));
        /* Ranks sharing a GPU start each op together, after every rank's flush (unless
         * --start free). */
        gated = b->cx_one_gpu && !b->opt.start_free;
        if (gated && wc_gate_init(&wc, b->gate, err, sizeof(err)) < 0)
                WFAIL("%s", err);

        /* Inputs: the shared memfd itself, or a device copy of it with the same layout. */
        uint8_t *in_base = me->in.ptr;
        uint64_t comb_x = align64((uint64_t)n * H * 2);
        uint64_t comb_bytes = comb_x + (uint64_t)n * K * 4 + 4096;
        if (cuda) {
                if (dev_alloc_register(client, &wc, me->in.bytes, &wc.d_in, &dregion[0], err,
                                       sizeof(err)) < 0 ||
                    dev_copy(wc.d_in, me->in.ptr, me->in.bytes, COPY_H2D, err, sizeof(err)) < 0 ||
                    dev_alloc_register(client, &wc, comb_bytes, &wc.d_comb, &dregion[1], err,
                                       sizeof(err)) < 0)
                        WFAIL("device memory: %s", err);
                in_base = wc.d_in;
                combined = wc.d_comb;
                h_comb = malloc(comb_bytes);
                if (!h_comb)
                        WFAIL("out of memory");
        } else {
                combined = h_comb = malloc(comb_bytes);
                if (!combined)
                        WFAIL("out of memory");
        }
#define IN_PTR(p) (in_base + ((const uint8_t *)(p) - me->in.ptr))
        struct epd_cx_dispatch_args da = {
                .size = sizeof(da), .num_tokens = n, .num_topk = K, .x = IN_PTR(me->x),
                .scales = b->scale_cols ? (const float *)IN_PTR(me->scales) : NULL,
                .topk_idx = IN_PTR(me->topk), .topk_dtype = EPD_DTYPE_INT64,
                .topk_weights = (const float *)IN_PTR(me->weights), .layout = b->opt.layout,
                .expert_alignment = 1, .handle = 0,
        };
#undef IN_PTR
        struct epd_cx_combine_args cb = {
                .size = sizeof(cb), .handle = 0, .apply_weights = expand,
                .combined = (uint16_t *)combined,
                .combined_topk_weights = (float *)(combined + comb_x),
        };

        for (uint32_t it = 0; it < b->total_iters; it++) {
                struct sample *smp = &b->samples[((size_t)rank * b->total_iters + it) * 2];
                uint64_t t0 = 0, t1 = 0, win[2] = { 0, 0 };

                if (b->opt.flush_l2 && dev_flush(&wc, 2 * it, err, sizeof(err)) < 0)
                        WFAIL("L2 flush before dispatch %u: %s", it, err);
                rc = run_cx_op(b, group, &wc, cuda, gated ? 2ull * it + 1 : 0, &da, NULL, &t0,
                               &t1, win, err, sizeof(err));
                if (rc < 0)
                        WFAIL("dispatch %u: %s: %s", it, err, epd_client_last_error(client));
                smp[OP_DISPATCH] = (struct sample){
                        t0, t1, t1 - t0, win[1] - win[0], 0,
                        { .size = sizeof(struct epd_op_timeline) }, win[0] };
                if (it == 0) {
                        struct epd_dispatch_result dr;
                        struct oracle_dispatch_out act;
                        uint8_t *base = (uint8_t *)bufs.recv_x;
                        int32_t *c32 = count_copy;

                        if (epd_cx_counts(group, 0, &counts) < 0)
                                WFAIL("epd_cx_counts: %s", epd_client_last_error(client));
                        /* The counts and the receive area, copied out of the buffer. */
                        if (fetch(cuda, c32, counts.num_recv_tokens_per_expert, L * 4, err,
                                  sizeof(err)) < 0 ||
                            fetch(cuda, c32 + L, counts.num_recv_tokens_per_expert_aligned, L * 4,
                                  err, sizeof(err)) < 0 ||
                            fetch(cuda, c32 + 2 * L, counts.rank_prefix, (b->R + 1) * 4, err,
                                  sizeof(err)) < 0)
                                WFAIL("counts: %s", err);
                        memset(&dr, 0, sizeof(dr));
                        dr.num_recv_tokens = counts.num_recv_tokens;
                        dr.num_expanded_rows = counts.num_expanded_rows;
                        dr.num_local_experts = L;
                        dr.num_recv_tokens_per_expert = c32;
                        dr.num_recv_tokens_per_expert_aligned = c32 + L;
                        dr.world_size = b->R;
                        dr.rank_prefix = c32 + 2 * L;
                        if (oracle_check_counts(b->oracle, rank, &dr, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: dispatch counts: %s", err);
                        recv_bytes = (uint64_t)((uint8_t *)bufs.y - base);
                        recv_copy = malloc(recv_bytes);
                        if (!recv_copy)
                                WFAIL("out of memory");
                        if (fetch(cuda, recv_copy, base, recv_bytes, err, sizeof(err)) < 0)
                                WFAIL("receive area: %s", err);
#define AT(p) (recv_copy + ((uint8_t *)(p) - base))
                        act = (struct oracle_dispatch_out){
                                .recv_x = AT(bufs.recv_x),
                                .recv_scales = b->scale_cols ? AT(bufs.recv_scales) : NULL,
                                .recv_topk_idx = expand ? NULL : AT(bufs.recv_topk_idx),
                                .recv_weights = AT(bufs.recv_weights),
                                .recv_src = AT(bufs.recv_src),
                                .recv_topk_slot = expand ? AT(bufs.recv_topk_slot) : NULL,
                        };
#undef AT
                        if (oracle_check_dispatch(b->oracle, rank, &act, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: dispatch outputs: %s", err);
                        /* The identity expert for bf16 (y is the received rows), the generated
                         * y for fp8; written once into the y area, outside the timing: the
                         * dispatches never touch it, and a peer reads it only inside a combine. */
                        if (b->opt.wl->dtype == EPD_DTYPE_BF16 && me->rows > 0)
                                memcpy(me->y.ptr, act.recv_x, (size_t)me->rows * b->row_bytes);
                        if (me->rows > 0 &&
                            (cuda ? dev_copy(bufs.y, me->y.ptr, (uint64_t)me->rows * H * 2,
                                             COPY_H2D, err, sizeof(err))
                                  : (memcpy(bufs.y, me->y.ptr, (size_t)me->rows * H * 2), 0)) < 0)
                                WFAIL("y: %s", err);
                        free(recv_copy);
                        recv_copy = NULL;
                }

                if (b->opt.flush_l2 && dev_flush(&wc, 2 * it + 1, err, sizeof(err)) < 0)
                        WFAIL("L2 flush before combine %u: %s", it, err);
                rc = run_cx_op(b, group, &wc, cuda, gated ? 2ull * it + 2 : 0, NULL, &cb, &t0,
                               &t1, win, err, sizeof(err));
                if (rc < 0)
                        WFAIL("combine %u: %s: %s", it, err, epd_client_last_error(client));
                smp[OP_COMBINE] = (struct sample){
                        t0, t1, t1 - t0, win[1] - win[0], 0,
                        { .size = sizeof(struct epd_op_timeline) }, win[0] };
                if (it == 0) {
                        if (fetch(cuda, h_comb, combined, comb_bytes - 4096, err, sizeof(err)) < 0)
                                WFAIL("combined: %s", err);
                        if (oracle_check_combine(b->oracle, rank, ybufs, cb.apply_weights, h_comb,
                                                 h_comb + comb_x, err, sizeof(err)) != 0)
                                WFAIL("VERIFICATION FAILED: combine outputs: %s", err);
                }
                int probe;
                if (sync_after(b, it, &probe) && worker_sync(b, rank) < 0)
                        WFAIL("lost the parent at the sync point after iteration %u", it);
        }
        {
                /* Where the kernel time goes: this rank's phases, averaged over its ops. */
                struct epd_cx_status st = { .size = sizeof(st) };
                double us[2][3];

                if (epd_cx_status(group, &st) < 0)
                        WFAIL("epd_cx_status: %s", epd_client_last_error(client));
                for (int k = 0; k < 2; k++)
                        for (int i = 0; i < 3; i++)
                                us[k][i] = st.kind_ops[k] ? st.phase_ns[k][i] / 1e3 /
                                                                    (double)st.kind_ops[k]
                                                          : 0.0;
                memcpy(b->cx_phase_us[rank], us, sizeof(us));
                for (size_t i = 0; b->cx_one_gpu && rank < GATE_RANKS && i < FIRST_PARTS; i++)
                        b->gate->first_us[rank][i] =
                                st.kind_ops[0] ? st.dispatch_first_ns[i] / 1e3 /
                                                         (double)st.kind_ops[0]
                                               : 0.0;
        }
        if (b->cx_one_gpu && rank < GATE_RANKS &&
            wc_launch_floor(&wc, 200, &b->gate->launch_floor_us[rank], err, sizeof(err)) < 0)
                WFAIL("%s", err);
        status = 0;
out:
        /* A rank that fails lets every later op through, so the peers' ops end (PEER_LOST once
         * this rank leaves) instead of waiting at the gate. */
        if (gated)
                __atomic_store_n(&b->gate->open, UINT64_MAX, __ATOMIC_RELEASE);
        epd_group_leave(group);
        {
                uint8_t **devbufs[2] = { &wc.d_in, &wc.d_comb };
                dev_release(client, &wc, devbufs, dregion, 2);
        }
        epd_client_free(client);
        wcuda_fini(&wc);
        free(recv_copy);
        free(h_comb);
        free(count_copy);
        free(ybufs);
        return status;
}
