/* epd.h - the public C API of libepd, the client library of the epd expert-parallel daemon.
 *
 * Conventions:
 * - Long-lived objects are opaque (struct epd_client, struct epd_group, struct epd_op) and come in
 *   create/free pairs; every free function accepts NULL.
 * - Calls with many parameters take an argument struct whose first field `size` the caller sets to
 *   sizeof(the struct), so fields can be appended without breaking callers.
 * - Every call returns 0 (EPD_OK) or a negative enum epd_status. The message of the last failure is
 * kept per object (epd_client_last_error, epd_op_error); strings are never handed out to be freed.
  * - Output parameters are written only on success.
 *
 * Thread safety: a struct epd_client and everything created from it may be used from several
 * threads; calls on one client are serialised by a mutex inside the client. Ops of one client may
 * be waited on from any thread.
 */
#ifndef EPD_H
#define EPD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPD_PROTOCOL_VERSION 2u
#define EPD_VERSION_STRING "0.1.0"

/* docs/semantics.md section 4. The wire code is the negated value. */
enum epd_status {
        EPD_OK = 0,
        EPD_INVALID_ARGUMENT = -1,
        EPD_NOT_FOUND = -2,
        EPD_ALREADY_EXISTS = -3,
        EPD_PERMISSION_DENIED = -4,
        EPD_CAPACITY_EXCEEDED = -5,
        EPD_PEER_LOST = -6,
        EPD_TIMEOUT = -7,
        EPD_ABORTED = -8,
        EPD_UNAVAILABLE = -9,
        EPD_VERSION_MISMATCH = -10,
        EPD_INTERNAL = -11,
};
#define EPD_STATUS_COUNT 12

/* "OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for values outside the enum. Static storage. */
const char *epd_status_name(int status);
/* sizeof the public structure `name` ("epd_group_config", ...) as this library was compiled, 0
 * for a name it does not know: for bindings that mirror the structures to check them. */
size_t epd_abi_struct_size(const char *name);

enum epd_dtype {
        EPD_DTYPE_INVALID = 0,
        EPD_DTYPE_BF16 = 1,
        EPD_DTYPE_FP8_E4M3 = 2,
        EPD_DTYPE_FP32 = 3,
        EPD_DTYPE_INT32 = 4,
        EPD_DTYPE_INT64 = 5,
};

/* Bytes per element, 0 for EPD_DTYPE_INVALID or unknown values. */
size_t epd_dtype_size(enum epd_dtype dtype);

enum epd_layout {
        EPD_LAYOUT_NON_EXPAND = 0,
        EPD_LAYOUT_EXPAND = 1,
};

enum epd_region_kind {
        EPD_REGION_HOST_MEMFD = 1,
        EPD_REGION_CUDA_IPC = 2,
        EPD_REGION_CUMEM_FD = 3,
};

#define EPD_TENSOR_MAX_DIMS 4

/* A tensor living in a registered region, as a value type. sizes/strides are in elements;
 * strides[ndim-1] must be 1 (or all strides 0 meaning contiguous). For outputs, sizes[0] is the
 * capacity in rows. A tensor with region_id 0 is absent. */
struct epd_tensor {
        enum epd_dtype dtype;
        uint32_t ndim;
        uint64_t sizes[EPD_TENSOR_MAX_DIMS];
        uint64_t strides[EPD_TENSOR_MAX_DIMS];
        uint64_t region_id;
        uint64_t offset; /* bytes from the region's start */
};

struct epd_client;
struct epd_group;
struct epd_op;

/* ---- connection ---- */

struct epd_connect_args {
        size_t size;
        const char *socket_path;  /* NULL: $EPD_SOCKET, else /run/epd/epd.sock */
        const char *client_name;  /* shown by epctl clients; may be NULL */
        uint32_t protocol_version; /* 0: EPD_PROTOCOL_VERSION (tests override it) */
        int timeout_ms;           /* per-request reply timeout for control calls; 0: 30000 */
};

/* Connects and performs Hello/Welcome. On failure *out is untouched; the reason is in the
 * returned status and, when err/err_len are given, in err. The environment tunes how ops wait
 * (docs/architecture.md, "Requests and replies through the doorbell page"):
 *   EPD_CLIENT_REPLY    doorbell (default): dispatch and combine replies come through the
 *                       rank's doorbell page when the daemon offers it; socket: always the socket.
 *   EPD_CLIENT_REQUEST  doorbell (default): dispatch and combine requests go into the rank's
 *                       doorbell page while the daemon polls it ("Requests through the
 *                       doorbell page"); socket: always the socket.
 *   EPD_CLIENT_SPIN_US  0 to 100000: how long a wait in the doorbell page polls after a wake-up
 *                       (the daemon wakes it when its op starts); default 200 on machines of 8
 *                       CPUs or more, else 0 (sleep until the reply).
 *   EPD_CLIENT_POLL_US  0 to 100000 (default 0): how long a wait polls right after the
 *                       submission, before it first sleeps.
 * Polling saves a thread wake-up per op at the price of a busy core while it waits
 * (docs/performance.md measures both). Any other value fails the connect with
 * EPD_INVALID_ARGUMENT and a message naming the variable. */
int epd_client_connect(const struct epd_connect_args *args, struct epd_client **out, char *err,
                       size_t err_len);
/* Closes the connection; the daemon releases every region, binding and handle of this client. */
void epd_client_free(struct epd_client *client);
const char *epd_client_last_error(const struct epd_client *client);

struct epd_device_info {
        uint32_t index;
        char uuid[64];
        char name[64];
        char kind[16];
        uint64_t memory_bytes;
};

struct epd_daemon_info {
        uint32_t protocol_version;
        uint64_t daemon_epoch;
        uint64_t client_id;
        char backend[16];
        char version[32];
        uint32_t max_frame_bytes;
        uint32_t max_fds_per_frame;
        uint32_t num_devices;
        struct epd_device_info devices[16]; /* the first 16 */
};

/* Copies what the daemon said in Welcome. */
int epd_client_daemon_info(const struct epd_client *client, struct epd_daemon_info *out);

/* Capability bits of Welcome (proto/epd.proto, enum Capability). */
#define EPD_CAP_HOST_REGIONS 1u   /* memfd regions */
#define EPD_CAP_CUDA_REGIONS 2u   /* GPU memory regions (cuda backend) */
#define EPD_CAP_OUTPUT_ARENA 4u   /* outputs placed in a daemon-exported arena */
#define EPD_CAP_ADMIN 8u          /* this connection may use admin verbs (root or admin_group) */
/* The EPD_CAP_* bits the daemon granted this connection in Welcome; 0 for NULL. Any thread. */
uint64_t epd_client_capabilities(const struct epd_client *client);

/* ---- memory ---- */

/* Creates an anonymous shared-memory file (memfd, MFD_CLOEXEC) of `bytes`, maps it read/write.
 * The caller owns the fd and the mapping (munmap + close). */
int epd_memfd_alloc(size_t bytes, int *fd_out, void **ptr_out);

/* Registers an fd-backed region (host memfd or cuMem POSIX fd). The fd is sent to the daemon and
 * stays owned by the caller. local_ptr, if not NULL, is where the caller has the region mapped,
 * which lets epd_tensor_at resolve pointers; for a host memfd libepd then keeps a duplicate of
 * the fd until the region is released, so that epd_cx_register can share the memory. */
int epd_region_register_fd(struct epd_client *client, enum epd_region_kind kind, int fd,
                           uint64_t bytes, uint32_t device, void *local_ptr, uint64_t *region_id);
/* Allocates a memfd of `bytes`, maps it and registers it: the common host-backend path. The
 * mapping is owned by the client object and unmapped by epd_region_release/epd_client_free. */
int epd_region_alloc(struct epd_client *client, size_t bytes, void **ptr_out,
                     uint64_t *region_id);
int epd_region_release(struct epd_client *client, uint64_t region_id);

/* `device` of epd_region_register_device: the daemon device whose GPU holds the memory. */
#define EPD_DEVICE_AUTO UINT32_MAX

/* Registers GPU memory of this process with the daemon (cuda backend; Welcome announces
 * CAP_CUDA_REGIONS) and returns the region that holds [dev_ptr, dev_ptr + bytes).
 *
 * The whole CUDA allocation containing dev_ptr is shared, so the region starts at the
 * allocation's base, not at dev_ptr: build tensors with epd_tensor_at(client, any device pointer
 * inside it, ...), which resolves device pointers like host ones. Supported allocations:
 * - cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among requestedHandleTypes, mapped
 *   with cuMemMap: exported as a POSIX fd (EPD_REGION_CUMEM_FD);
 * - cudaMalloc / cuMemAlloc: exported as a CUDA IPC handle (EPD_REGION_CUDA_IPC).
 * Managed memory, host memory and stream-ordered pool memory (cudaMallocAsync) are refused
 * with EPD_INVALID_ARGUMENT.
 *
 * Registration cache: registering a pointer inside an allocation this client already
 * registered returns the same region id without a request. An entry whose allocation was
 * freed and replaced by another at the same address (CUDA's buffer id differs) is released and
 * the new allocation registered.
 *
 * device is the daemon's device index (epd_client_daemon_info), checked against the GPU that
 * holds the memory by UUID when the daemon listed it; EPD_DEVICE_AUTO picks it by UUID.
 * Ownership: the memory stays the caller's and must stay allocated until the region is released
 * (epd_region_release, or epd_client_free): freeing cudaMalloc memory that the daemon still has
 * open through CUDA IPC is undefined behaviour in CUDA (the cache's buffer-id check is only a
 * safety net; a cuMem allocation stays alive in the daemon until the release). CUDA is
 * initialised by this call, never by epd_client_connect; it does not change the calling
 * thread's current CUDA device. Any thread.
 * Returns EPD_UNAVAILABLE when libepd was built without CUDA or the daemon cannot import GPU
 * memory. */
int epd_region_register_device(struct epd_client *client, const void *dev_ptr, size_t bytes,
                               uint32_t device, uint64_t *region_id);

/* Allocates GPU memory that the daemon reaches at full speed, and registers it: the allocator
 * for a worker's inputs and outputs on the cuda backend.
 *
 * Why: the daemon's kernels run on client memory through the daemon's own mapping of it. A
 * cuMem allocation exported as a POSIX fd (EPD_REGION_CUMEM_FD) is imported and mapped by the
 * daemon like its own memory; cudaMalloc memory opened through legacy CUDA IPC
 * (EPD_REGION_CUDA_IPC) measured about 2x slower in the daemon's kernels on an H200 (combine
 * 1.51 ms vs 0.757 ms on identical data; DRAM throughput 41% vs 81% of peak). PyTorch's
 * expandable segments allocator (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) may also
 * produce cuMem memory, which epd_region_register_device shares the same way when it carries
 * the POSIX-fd handle type.
 *
 * The memory: cuMemCreate on CUDA device ordinal `cuda_device` of this process (pinned device
 * memory, requestedHandleTypes CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), `bytes` rounded up
 * to the device's recommended granularity, mapped read/write for that device at a fresh
 * address range, uninitialised. It is then registered through epd_region_register_device
 * (EPD_DEVICE_AUTO: the daemon device with the GPU's UUID), so *region_id names an
 * EPD_REGION_CUMEM_FD region covering all of it, epd_tensor_at resolves any pointer inside it,
 * and epd_region_register_device on such a pointer answers *region_id from the cache.
 *
 * Ownership: the client object owns the memory and the region. epd_device_free gives both
 * back; epd_client_free frees whatever is still allocated. The caller must not free the
 * memory with CUDA calls, and must not use it after either. Releasing the region alone
 * (epd_region_release) leaves the memory allocated; a later registration of it makes a new
 * region, which epd_device_free releases too.
 * CUDA is initialised by this call, never by epd_client_connect; it does not change the
 * calling thread's current CUDA device. Any thread.
 * Returns EPD_INVALID_ARGUMENT for bytes 0, a NULL dev_ptr or region_id, or a CUDA device
 * this process does not have; EPD_UNAVAILABLE when libepd was built without CUDA, the daemon
 * cannot import GPU memory, or CUDA refuses (out of memory, no cuMem POSIX-fd support); the
 * statuses of epd_region_register_device otherwise (EPD_NOT_FOUND: the daemon does not list
 * the GPU). On failure nothing stays allocated or registered. */
int epd_device_alloc(struct epd_client *client, uint32_t cuda_device, uint64_t bytes,
                     void **dev_ptr, uint64_t *region_id);
/* Releases the regions that cover memory from epd_device_alloc of this client (the daemon's
 * import keeps the memory alive for ops still in flight) and unmaps and frees it in this
 * process. dev_ptr must be the pointer epd_device_alloc returned; NULL does nothing. Any other
 * pointer, one inside such an allocation, or one freed already is refused with
 * EPD_INVALID_ARGUMENT. Once the pointer is recognised the memory is freed in this process
 * even when the daemon could not be told (a lost connection); that failure is returned. A
 * region the caller released already does not count as a failure. Any thread. */
int epd_device_free(struct epd_client *client, void *dev_ptr);

/* Describes a contiguous tensor at local pointer ptr inside a region registered with local_ptr
 * (or a device pointer inside a region from epd_region_register_device).
 * ndim <= EPD_TENSOR_MAX_DIMS. */
int epd_tensor_at(struct epd_client *client, const void *ptr, enum epd_dtype dtype, uint32_t ndim,
                  const uint64_t *sizes, struct epd_tensor *out);

/* ---- groups ---- */

/* Where a group's dispatch and combine run (docs/client-execution.md), chosen at creation. */
enum epd_execution {
        EPD_EXECUTION_DAEMON = 0,      /* the daemon runs each op (epd_dispatch, epd_combine) */
        EPD_EXECUTION_CLIENT = 1,      /* each rank runs its ops itself (epd_cx_dispatch, ...) */
};

struct epd_group_config {
        size_t size;
        uint32_t world_size;
        uint32_t num_experts;
        uint32_t hidden;
        uint32_t max_tokens_per_rank;
        uint32_t max_topk;
        enum epd_dtype dispatch_dtype; /* BF16 or FP8_E4M3 */
        uint32_t scale_block;          /* fp8 only; 0: 128 */
        uint32_t op_timeout_ms;        /* 0: daemon default */
        uint64_t arena_bytes;          /* per-rank output arena; 0: daemon default. Client-
                                        * executed groups have none (0). */
        /* The fields below are read when `size` covers them (0 or absent: the default). */
        enum epd_execution execution;  /* EPD_EXECUTION_DAEMON (default) or _CLIENT */
        /* Client-executed groups only: the shape the communication buffers are sized for.
         * Ops that ask for more are refused with EPD_INVALID_ARGUMENT. */
        uint32_t max_expert_alignment; /* the largest expert_alignment an op uses; 0: 1 */
        uint32_t expert_block_rows;    /* the largest C of fixed expert blocks (SEMANTICS.md
                                        * 2.6) an op uses; 0: none */
        uint32_t quantize;             /* bf16 groups: ops may quantize to fp8 rows (2.7) */
        uint32_t num_handle_slots;     /* handle slots per rank; 0: 2, at most 8 */
        uint32_t sms_per_rank;         /* cuda: blocks of each rank's kernels; 0: default */
        uint32_t recv_rows;            /* rows of each rank's receive area; 0: the most one op
                                        * of the shape can send a rank. Fewer rows cost less
                                        * memory; an op that needs more ends
                                        * EPD_CAPACITY_EXCEEDED. Read back: the rows in use. */
};

struct epd_group_args {
        size_t size;
        const char *name;
        const void *secret;
        size_t secret_len;
        uint32_t rank;
        uint32_t device;             /* device index */
        const char *device_uuid;     /* if not NULL, overrides device */
        const struct epd_group_config *config; /* create only */
};

int epd_group_create(struct epd_client *client, const struct epd_group_args *args,
                     struct epd_group **out);
int epd_group_join(struct epd_client *client, const struct epd_group_args *args,
                   struct epd_group **out);
/* Leaves the group (unbinds the rank) and frees the object. NULL is accepted. */
int epd_group_leave(struct epd_group *group);
uint64_t epd_group_id(const struct epd_group *group);
uint32_t epd_group_rank(const struct epd_group *group);
/* The group config as the daemon holds it (defaults filled in). */
const struct epd_group_config *epd_group_config(const struct epd_group *group);
/* The rank's output arena, mapped into this process, or NULL when the group has none. *bytes is
 * its usable size as of the last dispatch reply: `epctl resize` may change it (libepd maps the
 * new memory before it returns the next dispatch with use_arena), but never the address. */
void *epd_group_arena(const struct epd_group *group, uint64_t *bytes);

/* ---- sizing ---- */

struct epd_size_hint {
        uint64_t daemon_bytes_per_rank;
        uint64_t max_rows_non_expand;
        uint64_t max_rows_expand;
        uint64_t arena_bytes_non_expand;
        uint64_t arena_bytes_expand;
        /* A client-executed group's communication buffer per rank (docs/client-execution.md);
         * 0 for a daemon-executed config. */
        uint64_t client_buffer_bytes_per_rank;
};

int epd_size_hint(struct epd_client *client, const struct epd_group_config *config,
                  uint32_t expert_alignment, struct epd_size_hint *out);

/* ---- dispatch and combine (docs/semantics.md §2 and §3) ---- */

struct epd_dispatch_args {
        size_t size;
        uint32_t num_tokens;           /* N_s <= T */
        uint32_t num_topk;             /* K_op <= K; 0: topk_idx.sizes[1] */
        struct epd_tensor x;           /* [N, H] bf16 or fp8 bytes */
        struct epd_tensor scales;      /* [N, H/scale_block] fp32, fp8 only */
        struct epd_tensor topk_idx;    /* [N, K_op] int32 or int64; absent for cached dispatch */
        struct epd_tensor topk_weights;/* [N, K_op] fp32, optional */
        uint64_t handle_id;            /* non-zero: cached dispatch */
        enum epd_layout layout;
        uint32_t expert_alignment;     /* 0: 1 */
        int zero_padding;              /* EXPAND only */
        int use_arena;                 /* outputs placed in the rank's output arena */
        /* Client-registered outputs (when !use_arena); sizes[0] is the capacity in rows. */
        struct epd_tensor recv_x;
        struct epd_tensor recv_scales;
        struct epd_tensor recv_topk_idx;   /* NON_EXPAND */
        struct epd_tensor recv_weights;    /* NON_EXPAND [rows, K_op]; EXPAND [rows] */
        struct epd_tensor recv_src;
        struct epd_tensor recv_topk_slot;  /* EXPAND */
        /* Stream ordering: non-zero makes the daemon wait until this rank's inputs_ready
         * doorbell reaches it (epd_group_mark_inputs_ready) before reading the inputs. */
        uint64_t wait_inputs;
};

/* What a completed dispatch returns (docs/semantics.md §2.3). The arrays are owned by the op and
 * valid until epd_op_free. With use_arena, the output tensors name the arena (region_id is the
 * arena's id) and *_ptr point into this process's mapping of it. */
struct epd_dispatch_result {
        uint64_t op_number;
        uint64_t handle_id;
        int32_t num_recv_tokens;
        int32_t num_expanded_rows;
        uint32_t num_local_experts;
        const int32_t *num_recv_tokens_per_expert;         /* [L] */
        const int32_t *num_recv_tokens_per_expert_aligned; /* [L] */
        uint32_t world_size;
        const int32_t *rank_prefix;                        /* [R+1] */
        struct epd_tensor recv_x, recv_scales, recv_topk_idx, recv_weights, recv_src,
                recv_topk_slot;
        void *recv_x_ptr, *recv_scales_ptr, *recv_topk_idx_ptr, *recv_weights_ptr, *recv_src_ptr,
                *recv_topk_slot_ptr;
        uint64_t exec_ns;  /* backend execution time of the whole op */
        uint64_t queue_ns; /* from this rank's submission to launch */
        uint64_t kernel_ns; /* GPU time of the op's kernels (cuda backend), else 0 */
};

struct epd_combine_args {
        size_t size;
        uint64_t handle_id;
        struct epd_tensor y;            /* dispatch layout rows, bf16 */
        int apply_weights;              /* EXPAND only */
        uint32_t num_bias;              /* 0, 1 or 2 */
        struct epd_tensor bias[2];      /* [N_s, H] bf16 */
        struct epd_tensor combined;     /* [N_s, H] bf16 */
        struct epd_tensor combined_topk_weights; /* [N_s, K_op] fp32, optional */
        uint64_t wait_inputs;           /* as in struct epd_dispatch_args */
        /* The weight inputs of docs/semantics.md §3. Fields past the caller's size are absent,
         * so callers built before them keep working (size versioning). */
        /* NON_EXPAND, optional: this destination's weights per received row, fp32
         * [num_recv_tokens, K_op] (for example the dispatch's recv_weights, possibly changed).
         * Given by every rank or by none: combined_topk_weights on each source is then, for every
         * k, the fp32 sum over the destinations its token went to, in ascending rank, of their
         * rows' weights (DeepEP's combine(topk_weights=...)); the dispatch need not have carried
         * weights. A rank that received no rows passes a [0, K_op] tensor. */
        struct epd_tensor recv_weights;
        /* Optional: this source's own weights, fp32 [N_s, K_op]: with apply_weights (EXPAND),
         * w(t, k) is source_weights[t][k] in place of the weight the dispatch carried, so a
         * dispatch without weights can be combined weighted. */
        struct epd_tensor source_weights;
};

struct epd_combine_result {
        uint64_t op_number;
        uint32_t num_tokens;
        uint64_t exec_ns;
        uint64_t queue_ns;
        uint64_t kernel_ns; /* GPU time of the op's kernels (cuda backend), else 0 */
};

/* Where a completed op's time went, as this rank saw it: CLOCK_MONOTONIC nanoseconds of this
 * host (the daemon runs on it and reads the same clock), 0 where not known (an op that failed,
 * or an older daemon). In order: libepd sent the request; the daemon read it, handed the op to
 * its executor, which began it and took exec_ns (kernel_ns of them on the GPU); the daemon's
 * loop took the completion and built this reply; libepd read it. */
struct epd_op_timeline {
        size_t size;                    /* sizeof(struct epd_op_timeline) */
        uint64_t submitted_ns;
        uint64_t received_ns;
        uint64_t launched_ns;
        uint64_t exec_start_ns;
        uint64_t exec_ns;
        uint64_t kernel_ns;
        uint64_t completed_ns;
        uint64_t replied_ns;
        uint64_t reply_read_ns;
        /* 1 when the reply came through the rank's doorbell page (EPD_CLIENT_REPLY, README),
         * 0 when on the socket. Filled when size covers it. */
        uint32_t reply_in_doorbell;
        /* 1 when the request went through the rank's doorbell page (EPD_CLIENT_REQUEST,
         * README), 0 when on the socket. Filled when size covers it. */
        uint32_t request_in_doorbell;
};
/* EPD_UNAVAILABLE while the op is pending (epd_op_wait first). */
int epd_op_timeline(const struct epd_op *op, struct epd_op_timeline *out);

/* Async forms: submit returns an op at once; epd_op_wait blocks until it completes. */
int epd_dispatch_submit(struct epd_group *group, const struct epd_dispatch_args *args,
                        struct epd_op **out);
int epd_combine_submit(struct epd_group *group, const struct epd_combine_args *args,
                       struct epd_op **out);
/* Waits for completion; timeout_ms < 0 waits forever. Returns the op's status, or EPD_TIMEOUT
 * when the wait itself timed out (the op stays pending and may be waited on again). */
int epd_op_wait(struct epd_op *op, int timeout_ms);
/* Status and message of a completed op. */
int epd_op_status(const struct epd_op *op);
const char *epd_op_error(const struct epd_op *op);
int epd_op_dispatch_result(const struct epd_op *op, struct epd_dispatch_result *out);
int epd_op_combine_result(const struct epd_op *op, struct epd_combine_result *out);
/* Frees a completed op; freeing a pending op waits for it first. NULL is accepted. */
void epd_op_free(struct epd_op *op);

/* Blocking forms. On failure the group's client holds the message (epd_client_last_error). */
int epd_dispatch(struct epd_group *group, const struct epd_dispatch_args *args,
                 struct epd_op **out);
int epd_combine(struct epd_group *group, const struct epd_combine_args *args,
                struct epd_combine_result *out);

/* ---- stream ordering without host round trips (common/doorbell.h) ----
 *
 * Each rank binding has a doorbell page shared with the daemon. `completed` counts this rank's
 * finished ops; op n of the rank (its n-th submission since it was bound) is finished when
 * completed >= epd_op_sequence(op), whatever its status: read the status with epd_op_wait.
 * `inputs_ready` is written by the client when the inputs of a request are ready; a request
 * submitted with wait_inputs = v makes the daemon wait for inputs_ready >= v (bounded by the
 * group's op timeout) before reading them. */

/* The doorbell value that marks this op finished. */
uint64_t epd_op_sequence(const struct epd_op *op);
/* Host-side access to the words (for clients without CUDA, and for tests). */
int epd_group_doorbell(const struct epd_group *group, const volatile uint64_t **completed,
                       volatile uint64_t **inputs_ready);
/* Marks the inputs of the next request ready from the host (release store); *seq is the value
 * to pass as wait_inputs. */
int epd_group_mark_inputs_ready_host(struct epd_group *group, uint64_t *seq);
/* CUDA (EPD_UNAVAILABLE when libepd was built without it): make `stream` (a cudaStream_t) wait
 * until the op has finished, or write the inputs_ready doorbell on `stream` once the work queued
 * before it is done. Neither involves the host; both can be captured in CUDA graphs. */
int epd_op_stream_wait(struct epd_op *op, void *stream);
int epd_group_mark_inputs_ready(struct epd_group *group, void *stream, uint64_t *seq);

/* ---- client-executed ops (docs/client-execution.md) ----
 *
 * In a group created with execution EPD_EXECUTION_CLIENT each rank runs its own dispatch and
 * combine over communication buffers the daemon allocated; no message goes to the daemon per op.
 * On the host backend an op runs now, on the calling thread, and `stream` must be NULL. The n-th
 * op of each rank meets the n-th of every other rank; a failed op leaves every later op of the
 * group failing at once with the same status until the group is formed again (a lost rank is
 * bound again). On the cuda backend an op is a kernel launch on `stream` (a cudaStream_t of the
 * group's GPU; NULL: the legacy default stream) and the call returns at once, so sequences of
 * ops can be captured in CUDA graphs; pointers in the arguments are device pointers, the status
 * of a launch only says whether it was queued, and epd_cx_status reads the op's own status once
 * the stream has passed it. A group's ranks then share one GPU (CUDA MPS is needed for ranks of
 * several processes: without it the create or join fails EPD_UNAVAILABLE naming MPS), and
 * sms_per_rank times the ranks must fit its SMs. Inputs are the caller's memory; outputs land in the rank's receive area
 * (epd_cx_buffers), and counts in the handle slot the dispatch names. epd_dispatch and
 * epd_combine are refused on such a group, and these calls on a daemon-executed one, with
 * EPD_INVALID_ARGUMENT. Calls of one rank must not overlap; ranks may run on any threads. */

/* The form of a quantizing dispatch's recv_scales (docs/semantics.md §2.7). */
enum epd_scale_format {
        EPD_SCALE_FORMAT_FP32 = 0,     /* one fp32 per block of 128 channels: [rows, H/128] */
        EPD_SCALE_FORMAT_UE8M0 = 1,    /* one byte e + 127 per block (needs round_scale): packed
                                        * [rows, H/128] bytes, four blocks to a little-endian
                                        * 32-bit word ([rows, H/512] int32 when 512 divides H) */
};

struct epd_cx_dispatch_args {
        size_t size;
        uint32_t num_tokens;           /* N <= max_tokens_per_rank */
        uint32_t num_topk;             /* K_op <= max_topk */
        const void *x;                 /* [N, H] of the group dtype (bf16 when quantizing) */
        uint64_t x_stride;             /* bytes between rows; 0: packed */
        const float *scales;           /* fp8 groups: [N, H / scale_block] */
        uint64_t scales_stride;        /* bytes; 0: packed */
        const void *topk_idx;          /* [N, K_op] packed; ignored by a cached dispatch */
        enum epd_dtype topk_dtype;     /* INT32 or INT64 */
        const float *topk_weights;     /* [N, K_op] packed, optional */
        enum epd_layout layout;
        uint32_t expert_alignment;     /* 0: 1; at most the group's max_expert_alignment */
        int zero_padding;              /* EXPAND */
        uint32_t expert_block_rows;    /* EXPAND: C of SEMANTICS.md 2.6; 0: packed */
        int quantize;                  /* bf16 groups created with quantize: fp8 rows (2.7) */
        uint32_t handle;               /* handle slot it fills (or reuses when cached) */
        int cached;                    /* reuse the routing of the slot's dispatch (2.4) */
        uint64_t capacity_rows;        /* rows this rank accepts; 0: its whole receive area */
        /* 0: rows land in the ranks' receive areas (epd_cx_buffers). Else a registration of
         * epd_cx_register: rows land in each rank's registered memory, laid out as the receive
         * area. Every rank names the same one. */
        uint32_t recv_memory;
        uint32_t reserved;             /* 0 */
        /* Read when `size` covers them (absent: 0). With quantize only; every rank passes the
         * same. */
        int round_scale;               /* power-of-two scales: x times 2^-e, recv_scales 2^e */
        enum epd_scale_format scale_format; /* UE8M0 needs round_scale */
};

struct epd_cx_combine_args {
        size_t size;
        uint32_t handle;               /* the slot of the dispatch whose layout y uses */
        int recv_weights;              /* NON_EXPAND: weights are in the y_weights area */
        int apply_weights;             /* EXPAND: multiply by the weights */
        const float *source_weights;   /* [N, K_op] packed, optional */
        uint32_t num_bias;             /* 0, 1 or 2 */
        const uint16_t *bias[2];       /* [N, H] bf16 packed */
        uint16_t *combined;            /* [N, H] bf16 packed, written */
        float *combined_topk_weights;  /* [N, K_op] packed, optional, written */
        /* 0: y is in the ranks' y areas. Else a registration of epd_cx_register: each rank's y
         * (and y_weights) is in its registered memory, laid out as the y area. Every rank names
         * the same one. */
        uint32_t y_memory;
};

/* Runs (host) or enqueues on `stream` (cuda, a cudaStream_t) one dispatch of this rank. Host:
 * returns the op's status (the message in epd_client_last_error). A drained group refuses at
 * once with EPD_ABORTED without taking an op number. */
int epd_cx_dispatch(struct epd_group *group, const struct epd_cx_dispatch_args *args,
                    void *stream);
/* Combine: this rank's expert output must be in its y area (epd_cx_buffers: y and, for
 * recv_weights, y_weights) before the op starts; it may be rewritten once the op is done. */
int epd_cx_combine(struct epd_group *group, const struct epd_cx_combine_args *args,
                   void *stream);

/* The end of a rank's op, read from its buffer once the op is done. */
struct epd_cx_status {
        size_t size;
        uint64_t op;                   /* the op's number in the group's current formation */
        int status;                    /* 0 or a negative enum epd_status */
        char message[256];             /* what failed, naming the rank and numbers */
        /* Read when size covers them: this rank's ops that ended OK (dispatches, combines) since
         * its buffer was made, and their time in each phase, summed, in ns: [0] from the op's
         * start to every rank's records exchanged (mostly waiting for the last peer to start),
         * [1] to every row moved or reduced, [2] to every peer's end signals. */
        uint64_t kind_ops[2];
        uint64_t phase_ns[2][3];
        /* Read when size covers them: the op's window on its executor's clock, ns (cuda: the
         * GPU's %globaltimer, one clock for every process on that GPU, so the windows of ranks
         * sharing it compare; host backend: CLOCK_MONOTONIC). */
        uint64_t start_ns;
        uint64_t end_ns;
        /* Read when size covers it: cuda only (0 on the host backend), this rank's OK
         * dispatches' first phase ([0] of phase_ns) in parts, summed, ns: its inputs checked
         * and counted; its count record sent; every rank's record here; the verdict; its rows
         * placed; the handle's counts written. */
        uint64_t dispatch_first_ns[6];
};
/* The rank's most recent op (the host: the one that last returned; cuda: synchronise the
 * stream first). EPD_NOT_FOUND when the rank has run no op since the group formed. */
int epd_cx_status(struct epd_group *group, struct epd_cx_status *out);

/* The counts of SEMANTICS.md 2.3 of the dispatch that last filled a handle slot. Pointers are
 * into the rank's buffer, valid until the slot's next dispatch (device addresses on the cuda
 * backend, where the two totals are copied to the host). */
struct epd_cx_counts {
        size_t size;
        int32_t num_recv_tokens;
        int32_t num_expanded_rows;
        uint32_t num_local_experts;
        const int32_t *num_recv_tokens_per_expert;         /* [L] */
        const int32_t *num_recv_tokens_per_expert_aligned; /* [L] */
        uint32_t world_size;
        const int32_t *rank_prefix;                        /* [R+1] */
        const int32_t *expert_base;                        /* [L+1]: first row of each expert */
        /* Read when size covers it: [R][R], [s][d] the tokens that ranks 0..s sent to rank d
         * in this dispatch (every rank's counts, as DeepEP's rank prefix matrix). */
        const int32_t *rank_prefix_matrix;
};
/* EPD_NOT_FOUND when the slot holds no dispatch of this formation. */
int epd_cx_counts(struct epd_group *group, uint32_t handle, struct epd_cx_counts *out);

/* Where this rank's outputs and combine inputs live in its buffer (as mapped here: device
 * addresses on the cuda backend). Rows of the receive area are packed at the op's row size;
 * recv_rows is their number. */
struct epd_cx_buffers {
        size_t size;
        uint64_t bytes_per_rank;       /* the communication buffer of each rank */
        uint32_t recv_rows;
        uint32_t num_handle_slots;
        void *recv_x;
        float *recv_scales;            /* fp32 [recv_rows, H/scale_block] (quantizing: H/128);
                                        * a UE8M0 dispatch's are bytes [recv_rows, H/128] */
        void *recv_topk_idx;           /* NON_EXPAND, of the dispatch's topk dtype */
        float *recv_weights;
        int64_t *recv_src;
        int32_t *recv_topk_slot;       /* EXPAND */
        uint16_t *y;                   /* [recv_rows, H] bf16: the expert's output */
        float *y_weights;              /* [recv_rows, K_op]: combine's recv_weights */
        /* The receive area is one piece from recv_x (every recv_* above at its offset from
         * recv_x) and the y area one piece from y: what registered memory must hold. */
        uint64_t recv_area_bytes;
        uint64_t y_area_bytes;
};
int epd_cx_buffers(const struct epd_group *group, struct epd_cx_buffers *out);

/* Registers client memory with a client-executed group, as a destination of dispatched rows
 * (epd_cx_dispatch_args.recv_memory) or as y (epd_cx_combine_args.y_memory). Collective: every
 * rank calls it, the k-th call of each rank forming registration k, and it returns once every
 * peer has registered its part (bounded by the group's op timeout: EPD_TIMEOUT naming the
 * rank); register before the first op that uses it (and before any capture). [ptr, ptr + bytes)
 * must lie inside a host memfd region this client registered with its local pointer
 * (epd_region_alloc, or epd_region_register_fd with local_ptr) and start 64-byte aligned. The
 * daemon hands the memfd to the peers, and libepd maps each peer's part once; the mappings
 * last until the group is left or re-formed (a lost rank: register again after re-forming).
 * The memory is laid out as the receive area (its start is recv_x, the other recv_* at their
 * offsets from recv_x in epd_cx_buffers) or as the y area (from y); a dispatch or combine
 * naming memory smaller than epd_cx_buffers' recv_area_bytes or y_area_bytes fails
 * EPD_INVALID_ARGUMENT on every rank, naming the rank. *memory gets the registration's number
 * (from 1). At most 16 registrations a rank. On the cuda backend: EPD_UNAVAILABLE for now. */
int epd_cx_register(struct epd_group *group, void *ptr, uint64_t bytes, uint32_t *memory);

/* Releases this rank's share of a handle (local bookkeeping, not collective). */
int epd_handle_release(struct epd_group *group, uint64_t handle_id);

/* ---- administration: what epctl shows and does ----
 *
 * Reading calls ask the daemon once and return a snapshot: an opaque object that owns every
 * struct, string and array reachable through its accessors, all read-only and valid until the
 * snapshot's *_free (which accepts NULL). Structs handed out by pointer may gain fields at the
 * end; the library allocates them. Reading is open to every client; epd_drain, epd_undrain,
 * epd_evict and epd_resize are admin verbs, for root and members of the daemon's admin_group
 * (EPD_CAP_ADMIN), and answer EPD_PERMISSION_DENIED to anyone else without changing anything.
 * Failures return a negative status with the message in epd_client_last_error (a NULL client
 * gives EPD_INVALID_ARGUMENT and no message). On failure *out is untouched.
 *
 * `group` of the verbs names a group by name, or by its decimal id (epd_group_id) when no group
 * has that name. */

/* A device of the daemon. */
struct epd_admin_device {
        uint32_t index;
        const char *uuid;
        const char *name;
        const char *kind;              /* "host" or "cuda" */
        uint64_t memory_bytes;
};

struct epd_daemon_status_info {
        const char *version;
        const char *backend;
        uint64_t daemon_epoch;         /* random per daemon start */
        uint64_t uptime_ms;
        int32_t pid;
        int draining;                  /* the whole daemon is drained (epd_drain with NULL) */
        uint32_t num_groups;
        uint32_t num_clients;
        uint32_t num_regions;
        uint64_t region_bytes;
        uint64_t ops_completed;
        uint64_t ops_failed;
        uint32_t num_devices;
        const struct epd_admin_device *devices;
};

struct epd_daemon_status;
int epd_daemon_status_get(struct epd_client *client, struct epd_daemon_status **out);
const struct epd_daemon_status_info *epd_daemon_status_info(const struct epd_daemon_status *st);
void epd_daemon_status_free(struct epd_daemon_status *st);

/* A rank of a group as the daemon holds it. */
struct epd_admin_rank {
        uint32_t rank;
        int bound;                     /* a client holds it */
        uint64_t client_id;            /* that client, 0 when unbound */
        uint32_t device;
        uint64_t next_op;              /* the sequence number of its next op */
};

struct epd_group_info {
        uint64_t id;
        const char *name;
        const char *state;             /* FORMING, READY, DRAINING, BROKEN or CLOSED */
        struct epd_group_config config; /* as the daemon holds it: defaults filled in
                                         * (scale_block stays 0 unless fp8) */
        uint64_t ops_completed;
        uint64_t ops_failed;
        uint32_t num_handles;
        uint32_t pending_ops;
        uint32_t num_ranks;
        const struct epd_admin_rank *ranks;
        uint64_t client_buffer_bytes_per_rank; /* client-executed groups, else 0 */
        uint32_t owner_uid;            /* the uid that created it */
        uint64_t memory_bytes;         /* the memory the daemon holds for it (output arenas,
                                        * client-executed buffers): what max_group_bytes_per_uid
                                        * of its owner counts */
};

/* Every group of the daemon, in the daemon's order. epd_group_list_at returns NULL for
 * i >= epd_group_list_count. */
struct epd_group_list;
int epd_group_list_get(struct epd_client *client, struct epd_group_list **out);
size_t epd_group_list_count(const struct epd_group_list *list);
const struct epd_group_info *epd_group_list_at(const struct epd_group_list *list, size_t i);
void epd_group_list_free(struct epd_group_list *list);

struct epd_client_info {
        uint64_t id;                   /* what epd_evict takes */
        int32_t pid;
        uint32_t uid;
        uint32_t gid;
        const char *name;              /* epd_connect_args.client_name; "" when none */
        uint32_t num_regions;
        uint64_t region_bytes;
        uint32_t outstanding_ops;
        uint32_t num_bindings;
        const char *const *bindings;   /* "group/rank" */
};

/* Every connected client, the caller included. */
struct epd_client_list;
int epd_client_list_get(struct epd_client *client, struct epd_client_list **out);
size_t epd_client_list_count(const struct epd_client_list *list);
const struct epd_client_info *epd_client_list_at(const struct epd_client_list *list, size_t i);
void epd_client_list_free(struct epd_client_list *list);

/* Counters of one kind of op. Latencies in nanoseconds; latency_buckets[i] counts ops below
 * 2^i microseconds (the last bucket is open-ended). */
struct epd_admin_op_stats {
        uint64_t ops;
        uint64_t bytes;
        uint32_t num_errors;
        const uint64_t *errors;        /* errors[-status]: failed ops by status; [0] unused */
        uint64_t latency_p50_ns;
        uint64_t latency_p90_ns;
        uint64_t latency_p99_ns;
        uint64_t latency_max_ns;
        uint64_t latency_count;
        uint64_t latency_sum_ns;
        uint32_t num_latency_buckets;
        const uint64_t *latency_buckets;
};

struct epd_admin_rank_stats {
        uint32_t rank;
        int bound;
        uint64_t client_id;
        uint32_t device;
        const struct epd_admin_op_stats *dispatch; /* never NULL (all zero when not reported) */
        const struct epd_admin_op_stats *combine;
        uint64_t arena_bytes;
        uint64_t arena_used_bytes;
        uint32_t queue_depth;          /* ops this rank submitted that have not completed */
        uint64_t next_op;
        /* Client-executed groups: what the rank's own ops counted in its buffer since the group
         * was created (dispatch and combine together), and the buffer's size. */
        uint64_t client_ops;
        uint64_t client_rows;
        uint64_t client_bytes;
        uint64_t client_failures;
        uint64_t client_buffer_bytes;
        /* Of client_ops: dispatches and combines, and their time in each phase, summed, ns:
         * [0] to every rank's records exchanged, [1] to every row moved or reduced, [2] to every
         * peer's end signals (as epd_cx_status). */
        uint64_t client_kind_ops[2];
        uint64_t client_phase_ns[2][3];
};

/* Where a group's successful ops spent their time: stage "peers" (first rank's request to the
 * last rank's), "daemon" or "gpu", of op "dispatch" or "combine". Only ops and the latency
 * fields of `latency` are set. */
struct epd_admin_stage_stats {
        const char *op;
        const char *stage;
        const struct epd_admin_op_stats *latency; /* never NULL */
};

struct epd_admin_group_stats {
        uint64_t id;
        const char *name;
        const char *state;
        uint32_t world_size;
        const struct epd_admin_op_stats *dispatch; /* never NULL */
        const struct epd_admin_op_stats *combine;
        uint32_t pending_ops;
        uint32_t handles;
        uint32_t num_ranks;
        const struct epd_admin_rank_stats *ranks;
        uint32_t num_stages;           /* stages with at least one op */
        const struct epd_admin_stage_stats *stages;
};

struct epd_admin_client_stats {
        uint64_t id;
        int32_t pid;
        const char *name;
        uint64_t requests;
        uint64_t ops;
        uint32_t outstanding_ops;
        uint32_t regions;
        uint64_t region_bytes;
};

struct epd_admin_device_stats {
        uint32_t index;
        const char *uuid;
        const char *kind;
        uint64_t ops;                  /* rank-ops executed on it */
        uint64_t bytes;
        uint32_t ranks;
};

struct epd_admin_daemon_stats {
        const char *backend;
        uint64_t uptime_ms;
        uint64_t ops_completed;
        uint64_t ops_failed;
        uint64_t frames_in;
        uint64_t frames_out;
        uint64_t protocol_errors;
        uint64_t clients_accepted;
        uint64_t clients_refused;
        uint64_t mailbox_replies;      /* op replies written into doorbell pages */
        uint64_t mailbox_requests;     /* requests taken from doorbell pages */
        uint32_t num_groups;
        const struct epd_admin_group_stats *groups;
        uint32_t num_clients;
        const struct epd_admin_client_stats *clients;
        uint32_t num_devices;
        const struct epd_admin_device_stats *devices;
};

/* The daemon's statistics (epctl stats and top; the Prometheus endpoint shows the same). */
struct epd_stats;
int epd_stats_get(struct epd_client *client, struct epd_stats **out);
const struct epd_admin_daemon_stats *epd_stats_daemon(const struct epd_stats *stats);
void epd_stats_free(struct epd_stats *stats);

/* What a drain or undrain found: the groups whose state it changed, the ops still executing in
 * the groups concerned (they finish) and the collected ops that wait for the undrain. */
struct epd_drain_result {
        uint32_t groups;
        uint32_t executing_ops;
        uint32_t waiting_ops;
        int daemon_draining;           /* the whole daemon is drained after the call */
};

/* Stops launching ops of `group`, or with group NULL of the whole daemon. Draining never fails
 * an op: an op every rank submitted waits, with no time limit, until the undrain (epd_op_wait
 * answers EPD_TIMEOUT meanwhile and the op stays pending); the op executing finishes; new
 * submissions are still collected (an op some rank never submits still fails with EPD_TIMEOUT
 * after op_timeout_ms). Only a READY (or already DRAINING) group can be drained:
 * EPD_INVALID_ARGUMENT otherwise; EPD_NOT_FOUND for an unknown group. out may be NULL. */
int epd_drain(struct epd_client *client, const char *group, struct epd_drain_result *out);
/* Resumes `group`, or with NULL the daemon and every drained group; what waited launches. */
int epd_undrain(struct epd_client *client, const char *group, struct epd_drain_result *out);

/* Closes client `client_id`'s connection as if it had crashed: the peers of its ranks get
 * EPD_PEER_LOST. EPD_NOT_FOUND when no such client is connected; EPD_INVALID_ARGUMENT for the
 * caller itself. */
int epd_evict(struct epd_client *client, uint64_t client_id);

/* A rank's output arena before and after a resize. */
struct epd_resize_rank {
        uint32_t rank;
        uint64_t old_bytes;
        uint64_t new_bytes;            /* above the requested size when live outputs end there */
        uint32_t segments;
        uint64_t used_bytes;           /* held by live placements */
        uint64_t reserved_bytes;       /* the most it can grow to */
};

struct epd_resize_info {
        uint64_t group_id;
        uint64_t requested_bytes;
        uint64_t old_bytes;            /* the group's arena size before */
        uint64_t new_bytes;            /* and now (ranks bound later get it) */
        uint64_t wait_ns;              /* spent waiting for the executing op */
        uint32_t num_ranks;            /* the ranks that have an arena */
        const struct epd_resize_rank *ranks;
};

/* Grows or shrinks every rank's output arena of `group` to `bytes` with the group's ops held
 * meanwhile (as by a drain, without changing its state); clients keep working and the arenas
 * do not move (epd_group_arena). A shrink stops above a rank's live outputs. Answered when
 * done. EPD_INVALID_ARGUMENT: group NULL, bytes 0, a group without arenas, or bytes above a
 * rank's reserved range; EPD_UNAVAILABLE: the memory could not be created (nothing changed),
 * or another resize of the group is in progress. out may be NULL. */
struct epd_resize_result;
int epd_resize(struct epd_client *client, const char *group, uint64_t bytes,
               struct epd_resize_result **out);
const struct epd_resize_info *epd_resize_result_info(const struct epd_resize_result *result);
void epd_resize_result_free(struct epd_resize_result *result);

/* ---- bf16 helpers (exact, round to nearest even, NaN -> 0x7FFF) ---- */
float epd_bf16_to_float(uint16_t value);
uint16_t epd_float_to_bf16(float value);

#ifdef __cplusplus
}
#endif

#endif
