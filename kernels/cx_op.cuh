/* cx_op.cuh - the frame of one client-executed op on the device: its number, whether it may run,
 * and how it ends (status ring, sticky failure, statistics), as cpu/cx.c does on the host.
 *
 * Only block 0's thread 0 decides and records. The op number and the sticky status are written
 * only by this rank's own kernels, which the stream orders, so plain loads see the last op's
 * values. The epoch, drain and abort words are the daemon's (CPU): relaxed .sys loads, value
 * only. The other blocks learn the decision through the header's verdict word after the first
 * grid barrier.
 */
#ifndef EPD_KERNELS_CX_OP_CUH
#define EPD_KERNELS_CX_OP_CUH

#include <stdint.h>

#include "cx_layout.h"
#include "cx_sync.cuh"

/* The threads that move or reduce one token together: the whole block, or a part of it. */
struct cx_crew {
        uint32_t id, size;
};

/* The crew size for n tokens over the grid: as wide as lets every token of a block have its own
 * crew at once, a power of two from a warp to the whole block (blockDim.x a power of two). Wide
 * crews keep a few tokens' loads in flight; narrow ones keep many tokens going without a
 * block-wide step between them. */
static __device__ __forceinline__ uint32_t cx_crew_size(uint32_t n)
{
        const uint32_t per_block = (n + gridDim.x - 1) / gridDim.x;
        uint32_t size = blockDim.x;

        while (size > 32u && blockDim.x / size < per_block)
                size /= 2u;
        return size;
}

struct cx_dev_op {
        uint64_t epoch, op, tag, seq;
        uint32_t parity;
        int numbered;        /* the op took a number (not refused by drain) */
        int kind;            /* 0 dispatch, 1 combine */
        uint64_t t[CX_PHASES + 1]; /* block 0's thread 0: the phases' bounds (cx_layout.h) */
        uint64_t first[CX_FIRST_PARTS]; /* dispatch: the ends of its first phase's parts */
};

static __device__ __forceinline__ uint64_t cx_ld_relaxed_sys_u64(const uint64_t *p)
{
        uint64_t v;
        asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
}

/* Every thread: the op's identity (same in every block: nothing but this rank's previous kernels
 * wrote op_counter and launch_seq). */
static __device__ __forceinline__ void cx_op_identity(const struct epd_cx_group *g, int kind,
                                                      struct cx_dev_op *o)
{
        const struct cx_header *h = cx_header_of(g->bufs[g->rank], &g->layout);

        o->kind = kind;
        o->t[0] = epd_globaltimer_ns();
        for (int i = 1; i <= CX_PHASES; i++)
                o->t[i] = 0;
        for (int i = 0; i < CX_FIRST_PARTS; i++)
                o->first[i] = 0;

        o->epoch = cx_ld_relaxed_sys_u64(&h->epoch);
        o->op = *(const volatile uint64_t *)&h->op_counter;
        o->seq = *(const volatile uint64_t *)&h->launch_seq;
        o->tag = cx_tag(o->epoch, o->op);
        o->parity = (uint32_t)(o->op & 1u);
        o->numbered = 1;
}

/* Block 0's thread 0: the end of part i of dispatch's first phase. */
static __device__ __forceinline__ void cx_first_stamp(struct cx_dev_op *o, int i)
{
        if (threadIdx.x == 0)
                o->first[i] = epd_globaltimer_ns();
}

static __device__ __forceinline__ void cx_status_set(struct cx_op_status *st, int32_t status,
                                                     int32_t reason, int32_t rank)
{
        st->status = status;
        st->reason = reason;
        st->rank = rank;
        st->num_short = 0;
        st->token = st->pos = -1;
        st->value = st->capacity = 0;
}

/* Block 0, thread 0: whether the op may run. Returns 0, or its status in st. */
static __device__ int cx_op_admit(const struct epd_cx_group *g, struct cx_dev_op *o,
                                  struct cx_op_status *st)
{
        struct cx_header *h = cx_header_of(g->bufs[g->rank], &g->layout);
        uint64_t drain = cx_ld_relaxed_sys_u64(&h->drain_op);

        cx_status_set(st, 0, CX_REASON_NONE, -1);
        if (drain && o->op >= drain - 1) {
                o->numbered = 0;
                cx_status_set(st, EPD_ABORTED, CX_REASON_DRAIN, (int32_t)g->rank);
        } else if (h->sticky_status != 0 && h->sticky_epoch == o->epoch) {
                *st = h->sticky;
                st->status = h->sticky_status;
                st->reason = CX_REASON_STICKY;
        } else if (epd_ld_relaxed_sys_u32(&h->abort_word) != 0) {
                cx_status_set(st, EPD_PEER_LOST, CX_REASON_ABORT, -1);
        }
        return st->status;
}

/* Block 0, thread 0, last: records the end and advances the counters. The status entry's tag is
 * released at .sys: the host reads it (epd's status call) once the stream has passed the op. */
static __device__ void cx_op_end(const struct epd_cx_group *g, const struct cx_dev_op *o,
                                 struct cx_op_status *st, uint64_t rows, uint64_t bytes)
{
        struct cx_header *h = cx_header_of(g->bufs[g->rank], &g->layout);
        struct cx_op_status *slot = &h->status[o->op % CX_STATUS_RING];

        uint64_t end;

        *(volatile uint64_t *)&h->launch_seq = o->seq + 1;
        if (!o->numbered)
                return;
        end = epd_globaltimer_ns();
        if (st->status == 0) {
                h->stats.ops++;
                h->stats.rows += rows;
                h->stats.bytes += bytes;
                if (o->t[CX_PHASE_MOVE] && o->t[CX_PHASE_FINISH]) {
                        h->stats.kind_ops[o->kind]++;
                        for (int i = 0; i < CX_PHASES; i++)
                                h->stats.phase_ns[o->kind][i] +=
                                        (i + 1 < CX_PHASES ? o->t[i + 1] : end) - o->t[i];
                        if (o->kind == 0 && o->first[CX_FIRST_COUNTS])
                                for (int i = 0; i < CX_FIRST_PARTS; i++)
                                        h->stats.first_ns[i] +=
                                                o->first[i] - (i ? o->first[i - 1] : o->t[0]);
                }
        } else {
                h->stats.failures++;
                if (h->sticky_status == 0 || h->sticky_epoch != o->epoch) {
                        h->sticky = *st;
                        h->sticky_epoch = o->epoch;
                        h->sticky_status = st->status;
                }
        }
        slot->status = st->status;
        slot->reason = st->reason;
        slot->rank = st->rank;
        slot->num_short = st->num_short;
        slot->token = st->token;
        slot->pos = st->pos;
        slot->value = st->value;
        slot->capacity = st->capacity;
        slot->start_ns = o->t[0];
        slot->end_ns = end;
        epd_st_release_sys_u64(&slot->tag, o->tag);
        *(volatile uint64_t *)&h->op_counter = o->op + 1;
}

#endif
