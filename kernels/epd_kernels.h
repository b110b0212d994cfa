/* epd_kernels.h - the C interface of epd's CUDA dispatch and combine kernels.
 *
 * Linked by the daemon's CUDA backend (daemon-executed mode) and later by libepd (client-executed
 * mode, docs/architecture.md "Where kernels run"), so every address and size is an argument: no globals, no assumption about
 * which process launches. Plain C; compiles with a C11 compiler that sees the CUDA include dir.
 *
 * Model. One op of a group covers all R ranks. Each launcher runs ONE kernel on the current
 * device covering every rank that lives on that device (its "local" ranks): the caller calls
 * cudaSetDevice to the stream's device first. Ranks may share a GPU or live on several GPUs with
 * peer access; every pointer in the descriptors below must be addressable from every device
 * that launches a kernel of the op (UVA peer mappings or cuMem mappings).
 *
 * A dispatch is three launches per device plus one for the group (see the sequencing notes at the
 * end of this header; small ops on one device take one or two launches):
 *   count  (every device)  validates topk_idx, normalises it into the workspace, counts tokens per
 *                          destination and selections per expert for each chunk of 256 tokens,
 *                          and ranks each entry among its chunk's entries with the same key;
 *   prefix (one device)    chunk bases, per-source totals, prefixes, expert bases and the
 *                          capacity check; writes the verdict;
 *   place  (every device)  row of every (s, t, k) = prefix + rank, exactly as plan.h documents;
 *   copy   (every device)  pushes every row into its final place in each destination's outputs
 *                          and writes EXPAND padding. Writes nothing when the verdict is an error.
 * Cached dispatch replaces count/prefix/place with recheck (one device) and then copy.
 * Combine is one launch per device.
 *
 * Errors: every launcher returns 0 or a negative enum epd_status. EPD_INVALID_ARGUMENT means the
 * arguments break a documented rule (checked on the host, before anything is queued);
 * EPD_UNAVAILABLE or EPD_INTERNAL mean CUDA refused (epd_k_last_cuda_error gives the code). The
 * op's own verdict (invalid topk_idx, capacity) is never a return value: it is the workspace's
 * struct epd_ws_error, which the host reads from the reply block once the op has completed.
 *
 * Threading: launchers keep no state; any thread may call them for any device.
 */
#ifndef EPD_KERNELS_H
#define EPD_KERNELS_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "epd.h"
#include "layout.h"
#include "mat.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where a device's ranks are, and where each one's tokens start in the device's flat token
 * range. local[i].token_offset = sum of num_tokens of local[0..i-1]; entry [num_local] is the
 * terminator holding the total (rank ignored). */
struct epd_k_local {
        uint32_t rank;
        uint32_t token_offset;
};

/* One rank's tensors for a dispatch, as source (inputs) and as destination (outputs), in
 * common/mat.h's descriptors (in.weights and out.recv_weights: ptr NULL unless has_weights). */
struct epd_k_dispatch_rank {
        uint32_t num_tokens;           /* N_s <= T */
        uint32_t reserved;
        const void *topk_idx;          /* [N_s, K_op] int32 or int64; unused by cached dispatch */
        uint64_t topk_stride;          /* elements between topk_idx rows; 0: K_op */
        struct epd_dispatch_src_io in;
        struct epd_dispatch_dst_io out;
        uint64_t capacity_rows;        /* smallest capacity among this rank's outputs */
};

/* epd_k_dispatch_args.flags of the copy step. OVERLAP: launch it as the programmatic dependent
 * of the kernel just before it on the stream (route_small): it starts while that kernel runs,
 * pulls its first source rows into L2, and waits for that kernel's completion before reading
 * anything the routing wrote. Only right after epd_k_dispatch_route_small on the same stream,
 * with nothing queued between them. */
#define EPD_K_COPY_OVERLAP 1u

struct epd_k_dispatch_args {
        /* Group dims, fixed at creation: they address the workspace. */
        uint32_t world_size;           /* R */
        uint32_t num_experts;          /* E */
        uint32_t max_tokens;           /* T */
        uint32_t max_topk;             /* K */
        /* The op. */
        uint32_t num_topk;             /* K_op, 1..K */
        uint32_t expert_alignment;     /* >= 1 */
        enum epd_layout layout;
        enum epd_dtype topk_dtype;     /* INT32 or INT64: topk_idx and recv_topk_idx */
        int has_weights;
        int zero_padding;              /* EXPAND only */
        uint32_t flags;                /* EPD_K_COPY_*; 0 for every step but copy */
        uint64_t row_bytes;            /* bytes of an x row (docs/semantics.md §1 wants % 16 == 0;
                                        * other sizes work, with narrower accesses) */
        uint64_t scale_bytes;          /* bytes of a scales row; 0 for bf16 */
        /* Memory. The caller owns all of it and keeps it alive until the launches complete. */
        void *workspace;               /* epd_k_workspace_bytes(R, E, T, K) bytes */
        /* ranks[]: every rank's descriptor, readable by the launching device (a copy in its own
         * memory keeps the per-row descriptor reads local). prefix and recheck read only the
         * capacities. */
        const struct epd_k_dispatch_rank *ranks; /* [R], device memory */
        const struct epd_k_local *local;         /* [num_local + 1], device memory */
        /* Optional host copies of ranks[] and local[] (NULL: none), read by the launcher only.
         * With world_size and num_local at most EPD_K_INLINE_RANKS, the one-launch dispatch and
         * combine pass them inside the kernel's parameters, so that the kernel's first loads do
         * not wait for a descriptor load from device memory (a DRAM round trip after an L2
         * flush). ranks and local must still hold the same descriptors. */
        const struct epd_k_dispatch_rank *ranks_host;
        const struct epd_k_local *local_host;
        uint32_t num_local;            /* ranks on the launching device (0 for prefix/recheck) */
        uint32_t local_tokens;         /* local[num_local].token_offset, known to the host */
        /* dispatch_small only, optional: pinned host memory of epd_k_reply_bytes, which the
         * kernel fills with the reply block as well, so that the host reads the verdict and the
         * counts there once the kernel has completed, without a copy after it. NULL: none. */
        void *reply_copy;
};

/* One rank's tensors for a combine. rank d's y is read by every device that hosts a source of a
 * token d received; bias and outputs are the source's own. */
struct epd_k_combine_rank {
        uint32_t num_tokens;           /* N_s of the handle's dispatch */
        uint32_t reserved;
        struct epd_mat y;              /* bf16 rows in the dispatch's layout */
        uint64_t y_rows;               /* rows of y checked at prep: a workspace row at or above
                                        * is not read (only a client rewriting its topk_idx
                                        * during the dispatch can make one) */
        struct epd_mat bias[2];        /* bf16 [N_s, H]; ptr NULL when absent */
        struct epd_mat combined;       /* bf16 [N_s, H] */
        struct epd_mat combined_topk_weights; /* fp32 [N_s, K_op]; ptr NULL when absent */
        /* docs/semantics.md §3's weight inputs; ptr NULL when absent. source_weights is the
         * source's fp32 [N_s, K_op], w(t, k) of apply_weights in place of the dispatch's;
         * recv_weights is the destination's fp32 [>= y_rows, K_op] (NON_EXPAND), read by the
         * devices of the sources of the rows it received, like y. */
        struct epd_mat source_weights;
        struct epd_mat recv_weights;
};

struct epd_k_combine_args {
        uint32_t world_size, num_experts, max_tokens, max_topk; /* as in the dispatch */
        uint32_t num_topk;             /* K_op of the handle's dispatch */
        enum epd_layout layout;        /* the handle's */
        uint32_t hidden;               /* H */
        int apply_weights;             /* EXPAND only, and only when has_weights or
                                        * source_weights */
        int has_weights;               /* the handle carries weights: its dispatch's, or the
                                        * last cached dispatch's that gave new ones (the copy
                                        * step keeps them in the workspace) */
        int source_weights;            /* every source with tokens has ranks[s].source_weights
                                        * when !has_weights; any source may have them else */
        int recv_weights;              /* NON_EXPAND: every rank with rows has
                                        * ranks[d].recv_weights; combined_topk_weights is their
                                        * reduction (docs/semantics.md §3) */
        const void *workspace;         /* the handle's workspace (placed dispatch) */
        const struct epd_k_combine_rank *ranks; /* [R], device memory */
        const struct epd_k_local *local;        /* [num_local + 1], device memory */
        /* Optional host copies, as in epd_k_dispatch_args. */
        const struct epd_k_combine_rank *ranks_host;
        const struct epd_k_local *local_host;
        uint32_t num_local;
        uint32_t local_tokens;
};

/* The most ranks whose descriptors travel inside a kernel's parameters (ranks_host). Eight
 * dispatch descriptors take 1.4 KB of the 4 KB every launch carries; larger groups read them
 * from device memory. */
#define EPD_K_INLINE_RANKS 8

/* Bytes of the group workspace, and of its reply block at offset 0 (error record and counts).
 * 0 when the dims break docs/semantics.md §1. */
uint64_t epd_k_workspace_bytes(uint32_t world_size, uint32_t num_experts, uint32_t max_tokens,
                               uint32_t max_topk);
uint64_t epd_k_reply_bytes(uint32_t world_size, uint32_t num_experts);

/* The dispatch steps. count, place and copy run on every device that hosts ranks (args->local
 * names them); prefix and recheck run once per op, on any one device. */
int epd_k_dispatch_count(const struct epd_k_dispatch_args *args, cudaStream_t stream);
int epd_k_dispatch_prefix(const struct epd_k_dispatch_args *args, cudaStream_t stream);
int epd_k_dispatch_place(const struct epd_k_dispatch_args *args, cudaStream_t stream);
int epd_k_dispatch_copy(const struct epd_k_dispatch_args *args, cudaStream_t stream);
/* Cached dispatch: rewrites the verdict from the handle's counts and the new capacities. */
int epd_k_dispatch_recheck(const struct epd_k_dispatch_args *args, cudaStream_t stream);

int epd_k_combine(const struct epd_k_combine_args *args, cudaStream_t stream);

/* Routing for small ops in one launch (route_small.cu): count, prefix and place for a
 * NON_EXPAND op whose ranks all live on the launching device (num_local == world_size <= 64,
 * local[] in ascending rank order) with at most EPD_K_SMALL_MAX_TOKENS local tokens, one block
 * per chunk of a source, meeting through flags in the workspace. It leaves the verdict, the reply
 * block, the counts and every entry's row exactly as the three steps do, so copy, combine and
 * cached dispatch follow it unchanged:  route_small -> copy (overlapped) -> [reply copy].
 * The workspace's small-routing counters must be zero before its first use: call
 * epd_k_workspace_init once after allocating it (the kernel leaves them zero again).
 * epd_k_dispatch_route_small_ok says whether an op qualifies (1) or not (0);
 * epd_k_dispatch_route_small returns EPD_INVALID_ARGUMENT, before queueing anything, for one
 * that does not. */
#define EPD_K_SMALL_MAX_TOKENS 4096u
int epd_k_dispatch_route_small_ok(const struct epd_k_dispatch_args *args);
int epd_k_dispatch_route_small(const struct epd_k_dispatch_args *args, cudaStream_t stream);
/* A whole small dispatch in one launch (dispatch_small.cu): the ops route_small takes, with at
 * most 1024 tokens per block of a thread block cluster (8 blocks where the device fits them: up to
 * EPD_K_SMALL_MAX_TOKENS), and outputs whose addresses are known before the op (client memory,
 * not the daemon's arena, which is placed from the counts). Each cluster routes the whole op,
 * its blocks meeting at cluster barriers, and copies its share; clusters never wait for each
 * other. It leaves the verdict, the reply block, the counts, every entry's row and the weights
 * kept for combine as route_small followed by copy does:  dispatch_small -> [reply copy].
 * epd_k_dispatch_small_ok and the EPD_INVALID_ARGUMENT return work as for route_small. */
int epd_k_dispatch_small_ok(const struct epd_k_dispatch_args *args);
int epd_k_dispatch_small(const struct epd_k_dispatch_args *args, cudaStream_t stream);
/* The same in two halves, so that a caller timing the op can make the plan (the host's
 * checks and occupancy queries) before it opens its GPU time window: _plan queues nothing and
 * returns EPD_INVALID_ARGUMENT for an op that does not qualify; _launch takes a plan that _plan
 * made for the same args on the same device. The fields belong to dispatch_small.cu. */
struct epd_k_small_plan {
        uint32_t cluster, blocks, slots, slices, skip0, reserved;
        uint64_t slice_bytes;
        uint64_t smem;
};
int epd_k_dispatch_small_plan(const struct epd_k_dispatch_args *args,
                              struct epd_k_small_plan *plan);
int epd_k_dispatch_small_launch(const struct epd_k_dispatch_args *args,
                                const struct epd_k_small_plan *plan, cudaStream_t stream);
/* Timed launches (timed.cu): the op's kernel between the two events that time it, sent as one
 * CUDA graph (event, kernel, event) that is instantiated once per kernel and cluster shape and
 * updated with each op's parameters. Around a direct launch on an idle GPU the first event
 * completes while the host is still in the launch call, so the kernel time would hold the host's
 * launch latency; in one graph the three reach the GPU together.
 * When a graph cannot be built or updated, the launch falls back to record, launch, record.
 * One object per caller thread and device at a time; create costs a calloc. */
struct epd_k_timed;
int epd_k_timed_create(struct epd_k_timed **out);
void epd_k_timed_destroy(struct epd_k_timed *t); /* on the device it launched on; NULL is a no-op */
/* Graphs off: every later launch of t is record, launch, record (a daemon configured with
 * cuda_graphs = off); on again: t tries a graph at its next launch. epd_k_timed_fallback_error
 * then says cudaSuccess: off by request, not by failure. */
void epd_k_timed_set_graphs(struct epd_k_timed *t, int on);
/* 1 when t's last launch went through a graph, 0 after a fallback or before any launch. */
int epd_k_timed_uses_graph(const struct epd_k_timed *t);
/* The CUDA error that made t fall back to direct launches; cudaSuccess when it has not. */
cudaError_t epd_k_timed_fallback_error(const struct epd_k_timed *t);
/* epd_k_dispatch_small_launch and epd_k_combine, timed: t0 before the kernel, t1 after it. */
int epd_k_dispatch_small_timed(const struct epd_k_dispatch_args *args,
                               const struct epd_k_small_plan *plan, struct epd_k_timed *t,
                               cudaEvent_t t0, cudaEvent_t t1, cudaStream_t stream);
int epd_k_combine_timed(const struct epd_k_combine_args *args, struct epd_k_timed *t,
                        cudaEvent_t t0, cudaEvent_t t1, cudaStream_t stream);
/* Zeroes the small routing's counters of a freshly allocated workspace, on `stream`. */
int epd_k_workspace_init(void *workspace, uint32_t world_size, uint32_t num_experts,
                         uint32_t max_tokens, uint32_t max_topk, cudaStream_t stream);

/* ---- Whole ops (run.c) ----
 *
 * The launch plan of an op over its devices, chosen here so that a caller only maps memory,
 * fills the args and sequences ops: which kernels, on which streams, in which order, with which
 * events between them (the sequencing notes at the end of this header). A caller fills a plan,
 * calls _prepare (it queues nothing: the host's checks and occupancy queries, so that they stay
 * out of the op's GPU time window), queues what must precede the op on the streams (waits for
 * its inputs, a timing event unless plan->one_launch), calls _run, and then waits for the
 * streams. Every pointer a plan holds is the caller's and must stay valid until _run returns;
 * the memory the args name must stay alive until the op's kernels complete. */

/* One device of an op. */
struct epd_k_op_device {
        int device;                    /* CUDA ordinal */
        cudaStream_t stream;           /* the op's kernels on this device go to this stream */
        cudaEvent_t counted;           /* dispatch, devices but the group's: recorded after count */
};

struct epd_k_dispatch_plan;

/* A dispatch whose outputs can only be placed once its counts are known (the caller sizes them
 * from the counts, as the daemon's output arenas are): called by epd_k_dispatch_run once the
 * routing and the copy of the reply block to plan->reply_host are queued and nothing after them.
 * It waits for the group device's stream, reads the counts from reply_host, places the outputs,
 * and rewrites plan->args with their addresses and capacities (ranks, ranks_host and every
 * descriptor they hold); _run then queues recheck (the verdict against the new capacities),
 * place and copy. It returns 0 to go on; anything else stops the op with nothing more queued,
 * and _run returns that value: a positive one for the caller's own reasons (the op failed on
 * the host), a negative enum epd_status for CUDA errors. It may set plan->step. */
typedef int (*epd_k_counts_fn)(void *ctx, struct epd_k_dispatch_plan *plan);

struct epd_k_dispatch_plan {
        /* The caller's. */
        uint32_t num_devices;                   /* devices hosting ranks, >= 1 */
        const struct epd_k_op_device *devices;  /* [num_devices], ascending ordinal */
        int group_device;                       /* ordinal of the group step's device, which
                                                 * holds the workspace; one of devices[] */
        struct epd_k_dispatch_args *args;       /* indexed by ordinal: args[devices[i].device]
                                                 * is device i's; flags 0, reply_copy NULL */
        int cached;                             /* cached dispatch: recheck, no routing */
        epd_k_counts_fn counts_ready;           /* NULL: the outputs are known before the op */
        void *ctx;                              /* for counts_ready */
        void *reply_host;                       /* pinned, epd_k_reply_bytes: the reply block
                                                 * once the op has completed */
        cudaEvent_t routed;                     /* recorded on the group device's stream after
                                                 * the routing; the other devices wait for it */
        struct epd_k_timed *timed;              /* the one-launch dispatch's timed launch, on
                                                 * the group device */
        cudaEvent_t t0, t1;                     /* its events */
        /* Set by epd_k_dispatch_prepare. */
        int one_launch;                         /* the op is one kernel that _run launches between
                                                 * t0 and t1 itself, on the group device only */
        struct epd_k_small_plan small;          /* the one launch's shape */
        /* Set by _prepare, _run and counts_ready: the step being queued, for the caller's error
         * message when one of them fails. */
        const char *step;
};

/* Chooses the launch plan: one launch (epd_k_dispatch_small) for a new small op of one device
 * whose outputs are known, else the steps of the sequencing notes. Queues nothing. 0, or a
 * negative enum epd_status when CUDA fails. */
int epd_k_dispatch_prepare(struct epd_k_dispatch_plan *plan);
/* Queues the op on the devices' streams: one launch; or route_small and the overlapped copy (one
 * device), then the reply copy; or count on every device, prefix on the group device (recheck
 * for a cached dispatch; route_small in place of both on one device), the reply copy, [the
 * caller's counts_ready, recheck], then place (new dispatches not routed by route_small) and copy
 * on every device. The group device's stream holds the last of the op's work only with one
 * device: with several, the caller joins the other streams (events) before it waits. 0, a
 * negative enum epd_status from a launcher or CUDA (plan->step names the step), or what
 * counts_ready returned. */
int epd_k_dispatch_run(struct epd_k_dispatch_plan *plan);

struct epd_k_combine_plan {
        /* The caller's. */
        uint32_t num_devices;                   /* devices hosting ranks, >= 1 */
        const struct epd_k_op_device *devices;  /* [num_devices], ascending ordinal */
        int group_device;                       /* one of devices[] */
        const struct epd_k_combine_args *args;  /* indexed by ordinal, as in the dispatch plan */
        struct epd_k_timed *timed;              /* the one-device combine's timed launch */
        cudaEvent_t t0, t1;
        /* Set by epd_k_combine_prepare. */
        int one_launch;                         /* one kernel, launched between t0 and t1 */
};

/* Chooses the launch plan: with one device, one timed launch. Queues nothing; returns 0. */
int epd_k_combine_prepare(struct epd_k_combine_plan *plan);
/* Queues the combine on every device's stream (the timed launch for one device). 0 or a
 * negative enum epd_status; after a failure on one device, nothing is queued on the later ones. */
int epd_k_combine_run(const struct epd_k_combine_plan *plan);

/* Loads every kernel of this library into the current device's context. Call it once per
 * device before the first op (the daemon at device start; libepd at attach): CUDA loads modules
 * lazily by default (CUDA_MODULE_LOADING=LAZY), and a load can have to wait for kernels that are
 * running, which a kernel spinning on a flag set by a not-yet-loaded kernel never finishes. It
 * also keeps the load out of the first op's latency. */
int epd_k_preload(void);

/* The CUDA error behind the last EPD_UNAVAILABLE / EPD_INTERNAL returned on this thread
 * (cudaSuccess when none). */
cudaError_t epd_k_last_cuda_error(void);

/* Sequencing (daemon-executed mode). Stream S_D on each device D hosting ranks, stream S_W on
 * the device chosen for the group step (the workspace's device is the natural choice):
 *
 *   on each S_D:  [wait for the clients' inputs]  count(local of D)      record C_D
 *   on S_W:       wait every C_D                  prefix                 record P
 *                 cudaMemcpyAsync(reply block -> pinned host)             (the op's verdict)
 *   on each S_D:  wait P                          place(D)  copy(D)      record done_D
 *
 * A small NON_EXPAND op with every rank on one device is dispatch_small alone on that device's
 * stream (given reply_copy, no reply copy follows it), or, when its outputs are placed from the
 * counts (the daemon's arena), route_small in place of count, prefix and place.
 * epd_k_dispatch_run and epd_k_combine_run queue exactly these sequences from a plan.
 *
 * The host completes the op when every done_D and the reply copy have completed, then reads
 * struct epd_ws_error: status != 0 means the op failed and no output byte was written. Kernels
 * never wait on each other inside the GPU in this mode: events order them, and a kernel
 * boundary makes its stores visible to every later kernel of the dependent streams, on any GPU.
 * With every rank on one device the whole chain is one stream and needs no events.
 *
 * Combine: on each S_D, after the clients' y and biases are ready on every device (events on
 * the producers' streams): combine(D). A combine must be ordered after the dispatch whose
 * handle it names; the workspace of a handle must not be reused while the handle lives. */

#ifdef __cplusplus
}
#endif

#endif
