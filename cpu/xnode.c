/* xnode.c - dispatch and combine across nodes over a transport (xnode.h, docs/scale-out.md).
 *
 * Roles. Rank (b, j) - node b, local index j - is the forwarder on node b for the sources
 * (a, j) of every other node a: it receives their tokens that go to node b, once each, and their
 * combine rows go back through it. Ranks of one node share the node's state (struct xnode_node):
 * every source's routing masked to the node's experts, the reassembled rows of remote sources,
 * the receive buffers and y of every rank of the node.
 *
 * Dispatch. Each source validates its routing with a one-source plan (cpu/plan.c), sends every
 * remote node a count record (its N, the tokens it sends that node, the op's options and its own
 * verdict), then its tokens in chunks. Each forwarder receives its sources' tokens and scatters
 * them back to their token index. The node then builds one plan from every source's routing
 * masked to the node's experts: a destination's rows depend only on the selections of its own
 * experts, so that plan places every row of the node's ranks exactly where the host backend's
 * plan of the whole group would. The host backend's data movement (cpu/exec.c) then copies the
 * rows into the node's receive buffers; the masked routing keeps it from touching other nodes.
 *
 * Combine. Each forwarder gathers, per token of its remote source that came to its node, the
 * node's contributing y rows in ascending top-k position, and sends them back in one record. The
 * source places them in a staging buffer at (token, position) and reduces with cpu/exec.c's
 * combine, reading its own node's rows in place, so the reduction order and every rounding are
 * the host backend's.
 *
 * Completion. Every window slot is double-buffered by op parity, and counters count per (kind,
 * parity, source node). No rank can be two ops ahead of a peer that sends to it (every op waits
 * for a count record or a combine record from every node, and a node's ranks end each op
 * together), so a slot written by op n + 2 was consumed by op n. An unordered receiver waits for
 * its counter to reach the chunks announced, then accepts a chunk only when its header names this
 * op, the source and the index, and the checksum over header and payload matches; a chunk of an
 * earlier op in the same slot (tag n - 2) is never consumed. An ordered receiver trusts the
 * transport: after the one signal that follows a source's chunks, the chunks are there.
 *
 * Threading: one thread per rank; node state is written in phases separated by the node's
 * barrier, and each phase writes disjoint parts (a source's rows belong to the rank whose local
 * index it has).
 */
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "exec.h"
#include "plan.h"
#include "routing.h"
#include "xnode.h"

#define HDR_BYTES 64u
#define COUNT_SLOT 128u
#define DEFAULT_CHUNK_TOKENS 32u
#define MAX_ALIGNMENT 4096u

enum kind { KIND_COUNT = 0, KIND_DISPATCH = 1, KIND_COMBINE = 2, NUM_KINDS = 3 };

/* The in-band header of every chunk and count record. sum covers the other fields and the
 * payload, seeded by the tag, so a chunk whose bytes are partly from another op fails it (up to
 * the 2^-64 chance of a 64-bit collision). */
struct chunk_hdr {
        uint64_t tag;           /* op_tag(op, kind) */
        uint64_t sum;
        uint32_t src;           /* the sending rank */
        uint32_t chunk;         /* index among the op's chunks from src to this receiver */
        uint32_t count;         /* records in the payload */
        uint32_t bytes;         /* payload bytes, a multiple of 16 */
        uint64_t reserved[4];
};
_Static_assert(sizeof(struct chunk_hdr) == HDR_BYTES, "chunk header size");

/* A count record's payload. */
struct count_body {
        int32_t status;         /* the source's verdict on its own arguments */
        uint32_t num_tokens;    /* N of the source */
        uint32_t tokens;        /* tokens the source sends to the receiver's node */
        uint32_t num_topk;
        uint32_t layout;
        uint32_t alignment;
        uint32_t has_weights;
        uint32_t topk_dtype;
        uint32_t zero_padding;
        uint32_t reserved[7];
};
_Static_assert(HDR_BYTES + sizeof(struct count_body) <= COUNT_SLOT, "count slot size");

/* The head of a token record (dispatch) or a row record (combine). */
struct rec_head {
        uint32_t token;
        uint32_t rows;          /* combine: y rows that follow */
        uint32_t reserved[2];
};

static uint64_t pad16(uint64_t n)
{
        return (n + 15) / 16 * 16;
}

static uint64_t op_tag(uint64_t op, enum kind k)
{
        return (op + 1) << 2 | (uint64_t)(k + 1);
}

static uint64_t checksum(const struct chunk_hdr *h, const uint8_t *payload)
{
        uint64_t x = h->tag * 0x9E3779B97F4A7C15ull;
        uint64_t fields[2] = { (uint64_t)h->src << 32 | h->chunk,
                               (uint64_t)h->count << 32 | h->bytes };

        for (uint64_t i = 0; i < 2 + h->bytes / 8u; i++) {
                uint64_t w;

                if (i < 2)
                        w = fields[i];
                else
                        memcpy(&w, payload + (i - 2) * 8, 8);
                x = (x ^ w) * 0xFF51AFD7ED558CCDull;
                x ^= x >> 32;
        }
        return x;
}

static uint64_t now_ns(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Between polls: yield at first, then sleep a little, so that waiting ranks leave the cores to
 * the ranks (and the transport) they wait for. */
static void poll_pause(uint32_t *spins)
{
        if ((*spins)++ < 64) {
                sched_yield();
        } else {
                struct timespec ts = { 0, 20000 };

                nanosleep(&ts, NULL);
        }
}

/* ---- shape and window ---- */

struct dims {
        uint32_t N, G, R, L, K, T, H, CT, nscales;
        uint64_t row_bytes;             /* dispatched row */
        uint64_t disp_stride, comb_stride; /* bytes of one chunk slot */
        uint64_t max_chunks;
        uint64_t disp_off, comb_off, window;
};

static void dims_of(const struct xnode_shape *s, struct dims *d)
{
        uint32_t sb = s->scale_block ? s->scale_block : EPD_DEFAULT_SCALE_BLOCK;

        d->N = s->nodes;
        d->G = s->ranks_per_node;
        d->R = d->N * d->G;
        d->L = s->num_experts / d->R;
        d->K = s->max_topk;
        d->T = s->max_tokens;
        d->H = s->hidden;
        d->CT = s->chunk_tokens ? s->chunk_tokens : DEFAULT_CHUNK_TOKENS;
        d->nscales = s->dtype == EPD_DTYPE_FP8_E4M3 ? s->hidden / sb : 0;
        d->row_bytes = (uint64_t)s->hidden * (s->dtype == EPD_DTYPE_FP8_E4M3 ? 1 : 2);
        d->disp_stride = HDR_BYTES + (uint64_t)d->CT * (sizeof(struct rec_head) +
                                                        2 * pad16((uint64_t)d->K * 4) +
                                                        d->row_bytes +
                                                        pad16((uint64_t)d->nscales * 4));
        d->comb_stride = HDR_BYTES + (uint64_t)d->CT * (sizeof(struct rec_head) +
                                                        (uint64_t)d->K * d->H * 2);
        d->max_chunks = (d->T + d->CT - 1) / d->CT;
        d->disp_off = 2ull * d->N * COUNT_SLOT;
        d->comb_off = d->disp_off + 2ull * d->N * d->max_chunks * d->disp_stride;
        d->window = d->comb_off + 2ull * d->N * d->max_chunks * d->comb_stride;
}

/* Window offset of chunk c of kind k, parity p, from source node a. */
static uint64_t slot_off(const struct dims *d, enum kind k, uint32_t p, uint32_t a, uint64_t c)
{
        uint64_t i = (uint64_t)p * d->N + a;

        if (k == KIND_COUNT)
                return i * COUNT_SLOT;
        if (k == KIND_DISPATCH)
                return d->disp_off + (i * d->max_chunks + c) * d->disp_stride;
        return d->comb_off + (i * d->max_chunks + c) * d->comb_stride;
}

static uint32_t ctr_index(const struct dims *d, enum kind k, uint32_t p, uint32_t a)
{
        return ((uint32_t)k * 2 + p) * d->N + a;
}

int xnode_shape_check(const struct xnode_shape *s, char *err, size_t err_len)
{
        const char *why = NULL;
        uint32_t sb = s->scale_block ? s->scale_block : EPD_DEFAULT_SCALE_BLOCK;
        uint64_t R = (uint64_t)s->nodes * s->ranks_per_node;

        if (s->nodes < 1 || s->ranks_per_node < 1 || R > EPD_MAX_WORLD_SIZE)
                why = "nodes and ranks_per_node must be >= 1, with at most 1024 ranks";
        else if (s->num_experts < 1 || s->num_experts > EPD_MAX_EXPERTS ||
                 s->num_experts % R || s->num_experts / R > EPD_MAX_LOCAL_EXPERTS)
                why = "num_experts must be a multiple of the ranks, at most 2048 and 256 a rank";
        else if (s->max_topk < 1 || s->max_topk > EPD_MAX_TOPK)
                why = "max_topk must be 1 to 32";
        else if (s->max_tokens < 1 || s->max_tokens > (1u << 24) || s->hidden < 1 ||
                 s->hidden > (1u << 20))
                why = "max_tokens must be 1 to 2^24 and hidden 1 to 2^20";
        else if (s->dtype != EPD_DTYPE_BF16 && s->dtype != EPD_DTYPE_FP8_E4M3)
                why = "dtype must be bf16 or fp8_e4m3";
        else if (s->dtype == EPD_DTYPE_FP8_E4M3 && s->hidden % sb)
                why = "hidden must be a multiple of the scale block";
        else if ((uint64_t)s->hidden * (s->dtype == EPD_DTYPE_BF16 ? 2 : 1) % 16)
                why = "the dispatched row's bytes must be a multiple of 16";
        else if (s->completion > XNODE_COMPLETION_UNORDERED)
                why = "unknown completion mode";
        if (why && err && err_len)
                snprintf(err, err_len, "xnode shape: %s", why);
        return why ? EPD_INVALID_ARGUMENT : 0;
}

uint64_t xnode_window_bytes(const struct xnode_shape *s)
{
        struct dims d;

        dims_of(s, &d);
        return d.window;
}

uint32_t xnode_num_counters(const struct xnode_shape *s)
{
        return NUM_KINDS * 2 * s->nodes;
}

/* ---- node and rank state ---- */

struct xnode_node {
        struct xnode_shape shape;
        struct dims d;
        uint32_t node;
        struct xport *xp;
        int ordered;                    /* the completion mode in use */
        pthread_barrier_t barrier;
        pthread_mutex_t lock;           /* err */
        _Atomic int status;             /* the op's first failure on this node */
        char err[256];

        /* Per op, by source rank. */
        uint32_t *num_tokens;           /* [R] */
        int32_t **topk;                 /* [R] -> [T * K] routing masked to this node */
        uint8_t **x;                    /* [R] -> [T] rows: remote sources' tokens */
        float **scales;                 /* [R] -> [T * nscales] */
        float **weights;                /* [R] -> [T * K] */
        struct epd_dispatch_src_io *src_io;     /* [R] */
        struct epd_dispatch_dst_io *dst_io;     /* [R], this node's ranks only */
        struct epd_mat *y;                      /* [R], this node's ranks only */
        struct epd_dispatch_exec exec;
        struct epd_plan *plan;          /* the last dispatch's node plan: the handle */
        uint32_t num_topk;
        enum epd_layout layout;
};

struct xnode_rank {
        struct xnode_node *n;
        uint32_t rank, node, local;
        uint64_t timeout_ns;
        uint64_t op;                    /* the next op number */
        int sticky;                     /* a failure ends the group's use of the transport */
        uint64_t *base;                 /* [NUM_KINDS * 2 * N] counter values consumed */
        struct xnode_stats stats;
        uint8_t *scratch;               /* one chunk slot */

        /* The handle: this rank's last dispatch as a source. */
        struct epd_plan *own;           /* a one-source plan: routing and contributing positions */
        int has_weights;                /* the dispatch carried weights */
        float *weights;                 /* [N * K_op], or NULL without weights or tokens */
        uint16_t *staging;              /* combine: [N * K_op] rows received from other nodes */
        uint32_t staging_rows;
};

static void *zalloc(size_t count, size_t size)
{
        return calloc(count ? count : 1, size);
}

struct xnode_node *xnode_node_new(const struct xnode_shape *s, uint32_t node, struct xport *xp)
{
        struct xnode_node *n;
        struct dims d;
        int ok = 1;

        if (xnode_shape_check(s, NULL, 0) || node >= s->nodes || !xp)
                return NULL;
        dims_of(s, &d);
        if (xp->endpoints != d.R || xp->window_bytes < d.window ||
            xp->num_counters < xnode_num_counters(s))
                return NULL;
        n = calloc(1, sizeof(*n));
        if (!n)
                return NULL;
        n->shape = *s;
        n->d = d;
        n->node = node;
        n->xp = xp;
        n->ordered = s->completion == XNODE_COMPLETION_AUTO
                             ? xp->ordered
                             : s->completion == XNODE_COMPLETION_ORDERED;
        n->num_tokens = zalloc(d.R, sizeof(*n->num_tokens));
        n->topk = zalloc(d.R, sizeof(*n->topk));
        n->x = zalloc(d.R, sizeof(*n->x));
        n->scales = zalloc(d.R, sizeof(*n->scales));
        n->weights = zalloc(d.R, sizeof(*n->weights));
        n->src_io = zalloc(d.R, sizeof(*n->src_io));
        n->dst_io = zalloc(d.R, sizeof(*n->dst_io));
        n->y = zalloc(d.R, sizeof(*n->y));
        ok = n->num_tokens && n->topk && n->x && n->scales && n->weights && n->src_io &&
             n->dst_io && n->y;
        for (uint32_t r = 0; ok && r < d.R; r++) {
                n->topk[r] = zalloc((size_t)d.T * d.K, sizeof(int32_t));
                ok = n->topk[r] != NULL;
                if (ok && r / d.G != node) {
                        n->x[r] = zalloc((size_t)d.T, d.row_bytes);
                        n->scales[r] = zalloc((size_t)d.T * d.nscales, sizeof(float));
                        n->weights[r] = zalloc((size_t)d.T * d.K, sizeof(float));
                        ok = n->x[r] && n->scales[r] && n->weights[r];
                }
        }
        if (!ok || pthread_barrier_init(&n->barrier, NULL, d.G)) {
                n->xp = NULL;
                xnode_node_free(n);
                return NULL;
        }
        pthread_mutex_init(&n->lock, NULL);
        return n;
}

void xnode_node_free(struct xnode_node *n)
{
        if (!n)
                return;
        for (uint32_t r = 0; r < n->d.R; r++) {
                if (n->topk)
                        free(n->topk[r]);
                if (n->x)
                        free(n->x[r]);
                if (n->scales)
                        free(n->scales[r]);
                if (n->weights)
                        free(n->weights[r]);
        }
        if (n->xp) {
                pthread_barrier_destroy(&n->barrier);
                pthread_mutex_destroy(&n->lock);
        }
        epd_plan_free(n->plan);
        free(n->num_tokens);
        free(n->topk);
        free(n->x);
        free(n->scales);
        free(n->weights);
        free(n->src_io);
        free(n->dst_io);
        free(n->y);
        free(n);
}

struct xnode_rank *xnode_rank_new(struct xnode_node *n, uint32_t rank, uint64_t timeout_ns)
{
        struct xnode_rank *r;
        uint64_t slot;

        if (!n || rank >= n->d.R || rank / n->d.G != n->node)
                return NULL;
        r = calloc(1, sizeof(*r));
        if (!r)
                return NULL;
        r->n = n;
        r->rank = rank;
        r->node = rank / n->d.G;
        r->local = rank % n->d.G;
        r->timeout_ns = timeout_ns ? timeout_ns : 10000000000ull;
        slot = n->d.disp_stride > n->d.comb_stride ? n->d.disp_stride : n->d.comb_stride;
        r->base = zalloc((size_t)NUM_KINDS * 2 * n->d.N, sizeof(*r->base));
        r->scratch = malloc(slot);
        if (!r->base || !r->scratch) {
                xnode_rank_free(r);
                return NULL;
        }
        return r;
}

void xnode_rank_free(struct xnode_rank *r)
{
        if (!r)
                return;
        epd_plan_free(r->own);
        free(r->weights);
        free(r->staging);
        free(r->base);
        free(r->scratch);
        free(r);
}

void xnode_rank_stats(const struct xnode_rank *r, struct xnode_stats *out)
{
        *out = r->stats;
}

/* ---- failures ---- */

static int node_fail(struct xnode_node *n, int status, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

/* Records the node's first failure of this op; returns status. */
static int node_fail(struct xnode_node *n, int status, const char *fmt, ...)
{
        int expected = 0;
        va_list ap;

        pthread_mutex_lock(&n->lock);
        if (atomic_compare_exchange_strong(&n->status, &expected, status)) {
                va_start(ap, fmt);
                vsnprintf(n->err, sizeof(n->err), fmt, ap);
                va_end(ap);
        }
        pthread_mutex_unlock(&n->lock);
        return status;
}

static int node_status(struct xnode_node *n)
{
        return atomic_load(&n->status);
}

static void node_barrier(struct xnode_node *n)
{
        pthread_barrier_wait(&n->barrier);
}

/* The op's result on this rank, after the node's last barrier. */
static int op_end(struct xnode_rank *r, char *err, size_t err_len)
{
        struct xnode_node *n = r->n;
        int st = node_status(n);

        if (st) {
                r->sticky = st;
                if (err && err_len) {
                        pthread_mutex_lock(&n->lock);
                        snprintf(err, err_len, "%s", n->err);
                        pthread_mutex_unlock(&n->lock);
                }
        }
        /* Every rank has read the status; the next op starts from a clean one. */
        node_barrier(n);
        if (r->local == 0)
                atomic_store(&n->status, 0);
        node_barrier(n);
        return st;
}

/* ---- sending ---- */

static int send_put(struct xnode_rank *r, uint32_t dst, uint64_t off, const void *data,
                    uint64_t len)
{
        r->stats.bytes_sent += len;
        return xport_put(r->n->xp, r->rank, dst, off, data, len);
}

/* Seals the chunk in r->scratch (header fields, checksum) and puts it, with its signal when the
 * completion is unordered. */
static int send_chunk(struct xnode_rank *r, uint32_t dst, enum kind k, uint64_t op, uint32_t c,
                      uint32_t count, uint32_t bytes)
{
        struct xnode_node *n = r->n;
        struct chunk_hdr h = { .tag = op_tag(op, k), .src = r->rank, .chunk = c, .count = count,
                               .bytes = bytes };
        uint32_t p = (uint32_t)(op & 1);

        h.sum = checksum(&h, r->scratch + HDR_BYTES);
        memcpy(r->scratch, &h, sizeof(h));
        if (send_put(r, dst, slot_off(&n->d, k, p, r->node, c), r->scratch, HDR_BYTES + bytes))
                return -1;
        if (!n->ordered || k == KIND_COUNT)
                return xport_signal(n->xp, r->rank, dst, ctr_index(&n->d, k, p, r->node), 1);
        return 0;
}

/* Ordered completion: one signal after every chunk of kind k to dst. */
static int send_done(struct xnode_rank *r, uint32_t dst, enum kind k, uint64_t op)
{
        struct xnode_node *n = r->n;

        if (!n->ordered)
                return 0;
        return xport_signal(n->xp, r->rank, dst, ctr_index(&n->d, k, (uint32_t)(op & 1), r->node),
                            1);
}

/* ---- receiving ---- */

/* Waits until counter (k, parity, source node a) has risen by `add` since the last op of that
 * parity, and consumes it. */
static int wait_counter(struct xnode_rank *r, enum kind k, uint64_t op, uint32_t a, uint64_t add,
                        uint64_t deadline)
{
        struct xnode_node *n = r->n;
        uint32_t i = ctr_index(&n->d, k, (uint32_t)(op & 1), a);
        uint64_t target = r->base[i] + add;
        uint32_t spins = 0;

        while (xport_counter(n->xp, r->rank, i) < target) {
                if (now_ns() > deadline)
                        return node_fail(n, EPD_TIMEOUT,
                                         "op %llu: rank %u: node %u did not complete its %s "
                                         "to this rank in time",
                                         (unsigned long long)op, r->rank, a,
                                         k == KIND_COUNT ? "count record"
                                         : k == KIND_DISPATCH ? "dispatch chunks" : "combine rows");
                poll_pause(&spins);
        }
        r->base[i] = target;
        return 0;
}

/* Loads chunk c of kind k from source rank src (node a) into r->scratch. Ordered completion reads
 * it as it is; unordered completion polls until the header names this op, source and chunk with
 * `count` records of `bytes`, and the checksum proves every byte is this op's. */
static int recv_chunk(struct xnode_rank *r, enum kind k, uint64_t op, uint32_t src, uint32_t c,
                      uint32_t count, uint32_t bytes, uint64_t deadline)
{
        struct xnode_node *n = r->n;
        uint64_t off = slot_off(&n->d, k, (uint32_t)(op & 1), src / n->d.G, c);
        struct chunk_hdr h;
        uint32_t spins = 0;

        for (;;) {
                xport_load(n->xp, r->rank, off, r->scratch, HDR_BYTES + bytes);
                if (n->ordered)
                        break;
                memcpy(&h, r->scratch, sizeof(h));
                if (h.tag == op_tag(op, k) && h.src == src && h.chunk == c && h.count == count &&
                    h.bytes == bytes && h.sum == checksum(&h, r->scratch + HDR_BYTES))
                        break;
                r->stats.incomplete++;
                /* Same kind, lower op: what this slot held before this op's chunk lands. */
                if ((h.tag & 3) == (op_tag(op, k) & 3) && h.tag < op_tag(op, k))
                        r->stats.stale++;
                if (now_ns() > deadline)
                        return node_fail(n, EPD_TIMEOUT,
                                         "op %llu: rank %u: chunk %u from rank %u did not land "
                                         "whole in time",
                                         (unsigned long long)op, r->rank, c, src);
                poll_pause(&spins);
        }
        r->stats.chunks_received++;
        return 0;
}

/* ---- dispatch ---- */

struct rec_layout {
        uint64_t topk, weights, x, scales, bytes;
};

static void dispatch_rec_layout(const struct dims *d, uint32_t K, int has_weights,
                                struct rec_layout *rl)
{
        rl->topk = sizeof(struct rec_head);
        rl->weights = rl->topk + pad16((uint64_t)K * 4);
        rl->x = rl->weights + (has_weights ? pad16((uint64_t)K * 4) : 0);
        rl->scales = rl->x + d->row_bytes;
        rl->bytes = rl->scales + pad16((uint64_t)d->nscales * 4);
}

/* Whether expert e (valid) lives on node b. */
static int on_node(const struct dims *d, int32_t e, uint32_t b)
{
        return e >= 0 && epd_route_expert_rank(e, d->L) / d->G == b;
}

/* Whether token t of the rank's own routing has a selection on node b. */
static int goes_to_node(const struct dims *d, const int32_t *row, uint32_t K, uint32_t b)
{
        for (uint32_t k = 0; k < K; k++)
                if (on_node(d, row[k], b))
                        return 1;
        return 0;
}

/* Validates the rank's own arguments and builds its one-source plan. */
static int dispatch_prepare(struct xnode_rank *r, const struct xnode_dispatch_args *a, char *msg,
                            size_t len)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        uint32_t A = a->expert_alignment ? a->expert_alignment : 1;
        uint32_t *ntok;
        int ret;

        epd_plan_free(r->own);
        r->own = NULL;
        free(r->weights);
        r->weights = NULL;
        r->has_weights = a->weights != NULL;
        if (a->num_tokens > d->T || a->num_topk < 1 || a->num_topk > d->K ||
            (a->topk_dtype != EPD_DTYPE_INT32 && a->topk_dtype != EPD_DTYPE_INT64) ||
            (a->layout != EPD_LAYOUT_NON_EXPAND && a->layout != EPD_LAYOUT_EXPAND) ||
            A > MAX_ALIGNMENT || (a->num_tokens && (!a->x.ptr || !a->topk_idx)) ||
            (a->num_tokens && d->nscales && !a->scales.ptr) || !a->out.recv_x.ptr ||
            (d->nscales && !a->out.recv_scales.ptr)) {
                snprintf(msg, len, "rank %u: invalid dispatch arguments (N %u, K_op %u, "
                         "alignment %u, or a required tensor missing)",
                         r->rank, a->num_tokens, a->num_topk, A);
                return EPD_INVALID_ARGUMENT;
        }
        ntok = zalloc(d->R, sizeof(*ntok));
        if (!ntok)
                return EPD_INTERNAL;
        ntok[r->rank] = a->num_tokens;
        r->own = epd_plan_new(d->R, n->shape.num_experts, d->T, a->num_topk, A, a->layout, ntok);
        free(ntok);
        if (!r->own)
                return EPD_INTERNAL;
        ret = epd_plan_count_source(r->own, r->rank, a->topk_idx, a->topk_dtype, 0, msg, len);
        if (ret)
                return ret;
        epd_plan_finish(r->own);
        epd_plan_place_source(r->own, r->rank);
        if (a->weights && a->num_tokens) {
                r->weights = malloc((size_t)a->num_tokens * a->num_topk * 4);
                if (!r->weights)
                        return EPD_INTERNAL;
                memcpy(r->weights, a->weights, (size_t)a->num_tokens * a->num_topk * 4);
        }
        return 0;
}

/* Sends node b's forwarder the count record and the tokens that go to node b. */
static int dispatch_send(struct xnode_rank *r, const struct xnode_dispatch_args *a, int status,
                         uint32_t b, uint64_t op)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        const uint32_t K = a->num_topk, dst = b * d->G + r->local;
        const int32_t *topk = status ? NULL : r->own->topk[r->rank];
        struct count_body cb = { .status = status, .num_topk = K, .layout = a->layout,
                                 .alignment = a->expert_alignment ? a->expert_alignment : 1,
                                 .has_weights = a->weights != NULL,
                                 .topk_dtype = a->topk_dtype, .zero_padding = !!a->zero_padding };
        struct rec_layout rl;
        uint32_t c = 0, count = 0;
        uint8_t *rec;

        if (!status) {
                cb.num_tokens = a->num_tokens;
                for (uint32_t t = 0; t < a->num_tokens; t++)
                        cb.tokens += goes_to_node(d, topk + (size_t)t * K, K, b);
        }
        memset(r->scratch, 0, COUNT_SLOT);
        memcpy(r->scratch + HDR_BYTES, &cb, sizeof(cb));
        if (send_chunk(r, dst, KIND_COUNT, op, 0, 0, sizeof(cb)))
                return -1;
        if (status)
                return send_done(r, dst, KIND_DISPATCH, op);

        dispatch_rec_layout(d, K, a->weights != NULL, &rl);
        for (uint32_t t = 0; t < a->num_tokens; t++) {
                const int32_t *row = topk + (size_t)t * K;
                struct rec_head head = { .token = t };

                if (!goes_to_node(d, row, K, b))
                        continue;
                rec = r->scratch + HDR_BYTES + (uint64_t)count * rl.bytes;
                memset(rec, 0, rl.bytes);
                memcpy(rec, &head, sizeof(head));
                memcpy(rec + rl.topk, row, (size_t)K * 4);
                if (a->weights)
                        memcpy(rec + rl.weights, a->weights + (size_t)t * K, (size_t)K * 4);
                memcpy(rec + rl.x, a->x.ptr + (uint64_t)t * a->x.stride, d->row_bytes);
                if (d->nscales)
                        memcpy(rec + rl.scales, a->scales.ptr + (uint64_t)t * a->scales.stride,
                               (size_t)d->nscales * 4);
                if (++count == d->CT) {
                        if (send_chunk(r, dst, KIND_DISPATCH, op, c++, count,
                                       (uint32_t)(count * rl.bytes)))
                                return -1;
                        count = 0;
                }
        }
        if (count && send_chunk(r, dst, KIND_DISPATCH, op, c, count, (uint32_t)(count * rl.bytes)))
                return -1;
        return send_done(r, dst, KIND_DISPATCH, op);
}

/* Receives source src's (a remote rank with this rank's local index) count record and tokens,
 * and scatters them into the node's state at their token index. */
static int dispatch_recv(struct xnode_rank *r, const struct xnode_dispatch_args *a, uint32_t src,
                         uint64_t op, uint64_t deadline)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        const uint32_t K = a->num_topk, A = a->expert_alignment ? a->expert_alignment : 1;
        const uint32_t an = src / d->G;
        struct count_body cb;
        struct rec_layout rl;
        uint32_t nchunks, last = 0;
        int32_t *topk = n->topk[src];
        int ret;

        if ((ret = wait_counter(r, KIND_COUNT, op, an, 1, deadline)) ||
            (ret = recv_chunk(r, KIND_COUNT, op, src, 0, 0, sizeof(cb), deadline)))
                return ret;
        memcpy(&cb, r->scratch + HDR_BYTES, sizeof(cb));
        if (cb.status)
                return node_fail(n, cb.status, "op %llu: rank %u refused its dispatch arguments",
                                 (unsigned long long)op, src);
        if (cb.num_tokens > d->T || cb.tokens > cb.num_tokens)
                return node_fail(n, EPD_INTERNAL, "op %llu: rank %u: corrupt count record from "
                                 "rank %u (N %u, tokens %u)", (unsigned long long)op, r->rank,
                                 src, cb.num_tokens, cb.tokens);
        if (cb.num_topk != K || cb.layout != a->layout || cb.alignment != A ||
            cb.has_weights != (a->weights != NULL) || cb.topk_dtype != a->topk_dtype ||
            cb.zero_padding != !!a->zero_padding)
                return node_fail(n, EPD_INVALID_ARGUMENT, "op %llu: ranks %u and %u disagree on "
                                 "the dispatch's options", (unsigned long long)op, src, r->rank);
        n->num_tokens[src] = cb.num_tokens;
        for (size_t i = 0; i < (size_t)cb.num_tokens * K; i++)
                topk[i] = -1;

        nchunks = (cb.tokens + d->CT - 1) / d->CT;
        if ((ret = wait_counter(r, KIND_DISPATCH, op, an, n->ordered ? 1 : nchunks, deadline)))
                return ret;
        dispatch_rec_layout(d, K, cb.has_weights, &rl);
        for (uint32_t c = 0; c < nchunks; c++) {
                uint32_t count = c + 1 < nchunks ? d->CT : cb.tokens - c * d->CT;

                if ((ret = recv_chunk(r, KIND_DISPATCH, op, src, c, count,
                                      (uint32_t)(count * rl.bytes), deadline)))
                        return ret;
                for (uint32_t i = 0; i < count; i++) {
                        const uint8_t *rec = r->scratch + HDR_BYTES + (uint64_t)i * rl.bytes;
                        struct rec_head head;
                        const int32_t *row = (const int32_t *)(rec + rl.topk);

                        memcpy(&head, rec, sizeof(head));
                        if (head.token >= cb.num_tokens || (c + i && head.token <= last))
                                return node_fail(n, EPD_INTERNAL, "op %llu: rank %u: corrupt "
                                                 "token record from rank %u (token %u)",
                                                 (unsigned long long)op, r->rank, src,
                                                 head.token);
                        last = head.token;
                        for (uint32_t k = 0; k < K; k++)
                                topk[(size_t)head.token * K + k] =
                                        on_node(d, row[k], r->node) ? row[k] : -1;
                        if (cb.has_weights)
                                memcpy(n->weights[src] + (size_t)head.token * K, rec + rl.weights,
                                       (size_t)K * 4);
                        memcpy(n->x[src] + head.token * d->row_bytes, rec + rl.x, d->row_bytes);
                        if (d->nscales)
                                memcpy(n->scales[src] + (size_t)head.token * d->nscales,
                                       rec + rl.scales, (size_t)d->nscales * 4);
                }
        }
        n->src_io[src] = (struct epd_dispatch_src_io){
                .x = { n->x[src], d->row_bytes },
                .scales = { (uint8_t *)n->scales[src], (uint64_t)d->nscales * 4 },
                .weights = { cb.has_weights ? (uint8_t *)n->weights[src] : NULL,
                             (uint64_t)K * 4 },
        };
        return 0;
}

/* Runs the work items of source s (and, for EXPAND, the padding of destination d) of the node's
 * dispatch. */
static void dispatch_items(struct xnode_node *n, uint32_t s, uint32_t d)
{
        const struct epd_dispatch_exec *op = &n->exec;
        uint64_t pad = op->plan->layout == EPD_LAYOUT_EXPAND
                               ? (uint64_t)n->d.R * n->d.L : 0;
        uint64_t per_src = (epd_host_dispatch_items(op) - pad) / n->d.R;
        uint64_t token_items = per_src * n->d.R;

        for (uint64_t i = 0; i < per_src; i++)
                epd_host_dispatch_item(op, s * per_src + i);
        if (pad)
                for (uint32_t l = 0; l < n->d.L; l++)
                        epd_host_dispatch_item(op, token_items + (uint64_t)d * n->d.L + l);
}

static void write_counts(const struct xnode_node *n, uint32_t d, struct xnode_counts *c)
{
        const struct epd_plan *p = n->plan;
        const uint32_t L = n->d.L, R = n->d.R;

        c->num_recv_tokens = epd_plan_num_recv_tokens(p, d);
        c->num_expanded_rows = epd_plan_num_expanded_rows(p, d);
        if (c->per_expert)
                memcpy(c->per_expert, p->expert_count + (size_t)d * L, (size_t)L * 4);
        if (c->per_expert_aligned)
                memcpy(c->per_expert_aligned, p->expert_aligned + (size_t)d * L, (size_t)L * 4);
        if (c->rank_prefix)
                memcpy(c->rank_prefix, p->rank_prefix + (size_t)d * (R + 1), (size_t)(R + 1) * 4);
}

int xnode_dispatch(struct xnode_rank *r, const struct xnode_dispatch_args *a,
                   struct xnode_counts *counts, char *err, size_t err_len)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        const uint64_t op = r->op++;
        const uint64_t deadline = now_ns() + r->timeout_ns;
        const uint32_t me = r->rank, b = r->node;
        char msg[200] = "";
        int status;

        if (r->sticky) {
                if (err && err_len)
                        snprintf(err, err_len, "op %llu: rank %u: an earlier op failed (%d); "
                                 "the group must be formed again", (unsigned long long)op, me,
                                 r->sticky);
                return r->sticky;
        }
        status = dispatch_prepare(r, a, msg, sizeof(msg));
        if (status)
                node_fail(n, status, "op %llu: %s", (unsigned long long)op, msg);

        /* Phase 1: every node hears from this rank; this rank hears from its remote sources. */
        for (uint32_t nb = 0; nb < d->N; nb++)
                if (nb != b && dispatch_send(r, a, status, nb, op))
                        node_fail(n, EPD_INTERNAL, "op %llu: rank %u: transport refused a put",
                                  (unsigned long long)op, me);
        if (!status) {
                const uint32_t K = a->num_topk;
                const int32_t *own = r->own->topk[me];

                n->num_tokens[me] = a->num_tokens;
                for (size_t i = 0; i < (size_t)a->num_tokens * K; i++)
                        n->topk[me][i] = on_node(d, own[i], b) ? own[i] : -1;
                n->src_io[me] = (struct epd_dispatch_src_io){
                        .x = a->x, .scales = a->scales,
                        .weights = { (uint8_t *)a->weights, (uint64_t)K * 4 },
                };
        }
        n->dst_io[me] = a->out;
        for (uint32_t nb = 0; nb < d->N; nb++)
                if (nb != b && !status)
                        dispatch_recv(r, a, nb * d->G + r->local, op, deadline);
        node_barrier(n);

        /* Phase 2: the node's plan of its rows. */
        if (r->local == 0) {
                n->plan = epd_plan_free(n->plan);
                if (!node_status(n)) {
                        n->plan = epd_plan_new(d->R, n->shape.num_experts, d->T, a->num_topk,
                                               a->expert_alignment ? a->expert_alignment : 1,
                                               a->layout, n->num_tokens);
                        if (!n->plan)
                                node_fail(n, EPD_INTERNAL, "op %llu: out of memory",
                                          (unsigned long long)op);
                        n->num_topk = a->num_topk;
                        n->layout = a->layout;
                        n->exec = (struct epd_dispatch_exec){
                                .plan = n->plan, .row_bytes = d->row_bytes,
                                .scale_bytes = (uint64_t)d->nscales * 4,
                                .topk_dtype = a->topk_dtype, .has_weights = a->weights != NULL,
                                .zero_padding = a->zero_padding, .src = n->src_io,
                                .dst = n->dst_io,
                        };
                }
        }
        node_barrier(n);
        if (!node_status(n))
                for (uint32_t s = r->local; s < d->R; s += d->G)
                        if (epd_plan_count_source(n->plan, s, n->topk[s], EPD_DTYPE_INT32, 0, msg,
                                                  sizeof(msg)))
                                node_fail(n, EPD_INTERNAL, "op %llu: rank %u: routing received "
                                          "from rank %u is corrupt: %s",
                                          (unsigned long long)op, me, s, msg);
        node_barrier(n);
        if (r->local == 0 && !node_status(n))
                epd_plan_finish(n->plan);
        node_barrier(n);

        /* Phase 3: rows to the node's ranks: this rank carries its sources' tokens. */
        if (!node_status(n)) {
                for (uint32_t s = r->local; s < d->R; s += d->G)
                        epd_plan_place_source(n->plan, s);
                for (uint32_t s = r->local; s < d->R; s += d->G)
                        dispatch_items(n, s, me);
        }
        node_barrier(n);
        if (!node_status(n) && counts)
                write_counts(n, me, counts);
        return op_end(r, err, err_len);
}

/* ---- combine ---- */

/* Sends source src (a remote rank with this rank's local index) its tokens' y rows from this
 * node, one record per token in token order, the rows in ascending top-k position. */
static int combine_send(struct xnode_rank *r, uint32_t src, uint64_t op)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        const struct epd_plan *p = n->plan;
        const uint32_t K = p->num_topk;
        const uint64_t yb = (uint64_t)d->H * 2;
        uint64_t used = 0;
        uint32_t c = 0, count = 0;

        for (uint32_t t = 0; t < p->num_tokens[src]; t++) {
                const int32_t *sel = p->topk[src] + (size_t)t * K;
                const int32_t *rows = p->row[src] + (size_t)t * K;
                uint8_t *rec = r->scratch + HDR_BYTES + used;
                struct rec_head head = { .token = t };

                if (!goes_to_node(d, sel, K, r->node))
                        continue;
                for (uint32_t k = 0; k < K; k++) {
                        const struct epd_mat *y;

                        if (rows[k] < 0)
                                continue;
                        y = &n->y[epd_route_expert_rank(sel[k], d->L)];
                        memcpy(rec + sizeof(head) + head.rows * yb,
                               y->ptr + (uint64_t)rows[k] * y->stride, yb);
                        head.rows++;
                }
                memcpy(rec, &head, sizeof(head));
                used += sizeof(head) + head.rows * yb;
                if (++count == d->CT) {
                        if (send_chunk(r, src, KIND_COMBINE, op, c++, count, (uint32_t)used))
                                return -1;
                        count = 0;
                        used = 0;
                }
        }
        /* An empty chunk when no token came here: every op hears from every node it waits on. */
        if ((count || c == 0) && send_chunk(r, src, KIND_COMBINE, op, c, count, (uint32_t)used))
                return -1;
        return send_done(r, src, KIND_COMBINE, op);
}

/* Receives node a's rows of this rank's tokens into the staging buffer at (token, position). */
static int combine_recv(struct xnode_rank *r, uint32_t a, uint64_t op, uint64_t deadline)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        const struct epd_plan *own = r->own;
        const uint32_t K = own->num_topk, N = own->num_tokens[r->rank];
        const int32_t *topk = own->topk[r->rank], *contrib = own->row[r->rank];
        const uint32_t src = a * d->G + r->local;
        const uint64_t yb = (uint64_t)d->H * 2;
        uint32_t tokens = 0, nchunks, t = 0;
        int ret;

        for (uint32_t i = 0; i < N; i++)
                tokens += goes_to_node(d, topk + (size_t)i * K, K, a);
        nchunks = tokens ? (tokens + d->CT - 1) / d->CT : 1;
        if ((ret = wait_counter(r, KIND_COMBINE, op, a, n->ordered ? 1 : nchunks, deadline)))
                return ret;
        for (uint32_t c = 0; c < nchunks; c++) {
                uint32_t count = c + 1 < nchunks ? d->CT : tokens - c * d->CT;
                uint64_t bytes = 0, used = 0;

                /* The sizes follow from this rank's own routing, so the receiver knows them. */
                for (uint32_t i = 0, tt = t; i < count; tt++) {
                        const int32_t *sel = topk + (size_t)tt * K;

                        if (!goes_to_node(d, sel, K, a))
                                continue;
                        bytes += sizeof(struct rec_head);
                        for (uint32_t k = 0; k < K; k++)
                                bytes += contrib[(size_t)tt * K + k] >= 0 && on_node(d, sel[k], a)
                                                 ? yb : 0;
                        i++;
                }
                if ((ret = recv_chunk(r, KIND_COMBINE, op, src, c, count, (uint32_t)bytes,
                                      deadline)))
                        return ret;
                for (uint32_t i = 0; i < count; t++) {
                        const int32_t *sel = topk + (size_t)t * K;
                        const uint8_t *rec = r->scratch + HDR_BYTES + used;
                        struct rec_head head;
                        uint32_t j = 0;

                        if (!goes_to_node(d, sel, K, a))
                                continue;
                        memcpy(&head, rec, sizeof(head));
                        if (head.token != t)
                                return node_fail(n, EPD_INTERNAL, "op %llu: rank %u: corrupt "
                                                 "combine record from rank %u (token %u, "
                                                 "expected %u)", (unsigned long long)op,
                                                 r->rank, src, head.token, t);
                        for (uint32_t k = 0; k < K; k++) {
                                if (contrib[(size_t)t * K + k] < 0 || !on_node(d, sel[k], a))
                                        continue;
                                memcpy(r->staging + ((size_t)t * K + k) * d->H,
                                       rec + sizeof(head) + (uint64_t)j++ * yb, yb);
                        }
                        used += sizeof(head) + (uint64_t)j * yb;
                        i++;
                }
        }
        return 0;
}

/* Reduces this rank's tokens with the host backend's combine: rows of its own node are read in
 * place, rows of other nodes from the staging buffer. */
static int combine_reduce(struct xnode_rank *r, const struct xnode_combine_args *a)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        const struct epd_plan *own = r->own;
        const uint32_t me = r->rank, K = own->num_topk, N = own->num_tokens[me];
        struct epd_plan view = *own;
        struct epd_combine_src_io *src = zalloc(d->R, sizeof(*src));
        struct epd_mat *y = zalloc(d->R, sizeof(*y));
        int32_t **rows = zalloc(d->R, sizeof(*rows));
        int32_t *row = zalloc((size_t)N * K, sizeof(*row));
        struct epd_combine_exec op;
        uint64_t per_src;

        if (!src || !y || !rows || !row) {
                free(src);
                free(y);
                free(rows);
                free(row);
                return EPD_INTERNAL;
        }
        for (size_t i = 0; i < (size_t)N * K; i++) {
                int32_t e = own->topk[me][i];

                if (own->row[me][i] < 0)
                        row[i] = -1;
                else if (on_node(d, e, r->node))
                        row[i] = n->plan->row[me][i];
                else
                        row[i] = (int32_t)i;
        }
        for (uint32_t dd = 0; dd < d->R; dd++)
                y[dd] = dd / d->G == r->node ? n->y[dd]
                                             : (struct epd_mat){ (uint8_t *)r->staging,
                                                                 (uint64_t)d->H * 2 };
        rows[me] = row;
        view.row = rows;
        src[me] = (struct epd_combine_src_io){
                .bias = { a->bias[0], a->bias[1] },
                .combined = a->combined,
                .combined_topk_weights = a->combined_topk_weights,
                .weights = r->weights,
        };
        op = (struct epd_combine_exec){ .plan = &view, .hidden = d->H,
                                        .apply_weights = a->apply_weights, .y = y, .src = src };
        per_src = epd_host_combine_items(&op) / d->R;
        for (uint64_t i = 0; i < per_src; i++)
                epd_host_combine_item(&op, me * per_src + i);
        free(src);
        free(y);
        free(rows);
        free(row);
        return 0;
}

int xnode_combine(struct xnode_rank *r, const struct xnode_combine_args *a, char *err,
                  size_t err_len)
{
        struct xnode_node *n = r->n;
        const struct dims *d = &n->d;
        const uint64_t op = r->op++;
        const uint64_t deadline = now_ns() + r->timeout_ns;
        const uint32_t me = r->rank;
        int bad_args;

        if (r->sticky || !r->own || !n->plan) {
                if (err && err_len)
                        snprintf(err, err_len, "op %llu: rank %u: %s", (unsigned long long)op, me,
                                 r->sticky ? "an earlier op failed; the group must be formed "
                                             "again" : "no dispatch to combine");
                return r->sticky ? r->sticky : EPD_NOT_FOUND;
        }
        bad_args = !a->y.ptr || !a->combined.ptr ||
                   (a->apply_weights && (r->own->layout != EPD_LAYOUT_EXPAND ||
                                         !r->has_weights)) ||
                   (a->combined_topk_weights.ptr && !r->has_weights);
        if (!r->staging || r->staging_rows < r->own->num_tokens[me] * r->own->num_topk) {
                free(r->staging);
                r->staging_rows = d->T * d->K;
                r->staging = malloc((size_t)r->staging_rows * d->H * 2);
                if (!r->staging)
                        r->staging_rows = 0;
        }
        if (!r->staging)
                node_fail(n, EPD_INTERNAL, "op %llu: out of memory", (unsigned long long)op);
        n->y[me] = a->y;
        node_barrier(n);

        /* Forward: every remote source with this rank's local index gets this node's rows. */
        for (uint32_t nb = 0; nb < d->N; nb++)
                if (nb != r->node && combine_send(r, nb * d->G + r->local, op))
                        node_fail(n, EPD_INTERNAL, "op %llu: rank %u: transport refused a put",
                                  (unsigned long long)op, me);
        for (uint32_t nb = 0; nb < d->N && r->staging; nb++)
                if (nb != r->node && combine_recv(r, nb, op, deadline))
                        break;
        if (!node_status(n) && !bad_args && combine_reduce(r, a))
                node_fail(n, EPD_INTERNAL, "op %llu: out of memory", (unsigned long long)op);
        /* The node's ranks have read every y of the node once all pass here. */
        node_barrier(n);
        if (bad_args) {
                if (err && err_len)
                        snprintf(err, err_len, "op %llu: rank %u: invalid combine arguments "
                                 "(y or combined missing, or apply_weights / "
                                 "combined_topk_weights without the dispatch's weights)",
                                 (unsigned long long)op, me);
                op_end(r, NULL, 0);
                return EPD_INVALID_ARGUMENT;
        }
        return op_end(r, err, err_len);
}
