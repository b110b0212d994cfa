/* gpu_integ.c - client processes whose tensors live in their own GPU memory, against the real
 * epd binary with the CUDA backend (daemon-executed mode, docs/architecture.md, "Where kernels
  * run").
 *
 * Each worker is a separate process with its own CUDA context on GPU 0, where every rank of the
 * group lives. It allocates its inputs and outputs in device memory (cudaMalloc, cuMemCreate
 * with the POSIX-fd handle type, or libepd's epd_device_alloc), uploads the seeded inputs of
 * tests/lib/workload.c, registers the memory with epd_region_register_device (epd_device_alloc
 * registers its own), dispatches and combines through the daemon with every output in its
 * device memory (client-registered capacity = the exact rows the reference expects), copies the
 * outputs back and compares them bitwise with tests/lib/reference.h.
 *
 * Cases: ranks 1, 2, 4 and 8 on GPU 0; both layouts; bf16 and fp8; cudaMalloc, cuMem, both in
 * one worker, and epd_device_alloc; cached dispatch; a second identical run that must give
 * identical bits (every output byte, unwritten padding included, since both runs poison alike);
 * CAPACITY_EXCEEDED on every rank with the device outputs untouched; a client SIGKILLed while
 * its peers wait in an op (PEER_LOST, then a re-joined rank and a successful op); the
 * registration API itself (cache, stale entries, refusals); and epd_device_alloc /
 * epd_device_free on their own (0 bytes, a missing device, foreign pointers, a released and
 * re-registered region, freeing at epd_client_free). After every test a fresh client runs a
 * small op on the same daemon, which shows that the daemon's GPU context survived.
 *
 * CUDA is never initialised in this process (STYLE.md): main probes the GPU in a forked child,
 * and CUDA calls happen only in the spawned workers. Exit 77 when no GPU is usable. Every case
 * prints its seed; every failure names the case, seed, rank and line.
 */
#include <check.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "workload.h"

#define BF EPD_DTYPE_BF16
#define F8 EPD_DTYPE_FP8_E4M3
#define I32 EPD_DTYPE_INT32
#define I64 EPD_DTYPE_INT64
#define NE EPD_LAYOUT_NON_EXPAND
#define EX EPD_LAYOUT_EXPAND

#define MAX_RANKS 8
#define SLAB_BYTES (64ull << 20) /* per worker and slab; a multiple of every cuMem granularity */
#define SENTINEL 0x5A            /* pre-fill of outputs that a failed op must leave alone */
#define POISON 0xAB              /* pre-fill of outputs of a successful op */
#define COMBINED_FILL 0xEE
#define WAIT_MS 60000            /* longest a worker waits for an op or a flag */
#define CASE_MS 180000           /* longest a test waits for its workers */

/* Where a worker's two slabs live: inputs (x, scales, topk, weights, y, biases) and outputs. */
enum mem_kind {
        MEM_MALLOC, /* both cudaMalloc: CUDA IPC regions */
        MEM_CUMEM,  /* both cuMemCreate with a POSIX fd: CUMEM_FD regions */
        MEM_MIXED,  /* inputs cudaMalloc, outputs cuMem */
        MEM_EPD,    /* both from epd_device_alloc: CUMEM_FD regions that libepd owns */
};

static const char *const mem_names[] = { "cudaMalloc", "cuMem", "cudaMalloc+cuMem",
                                         "epd_device_alloc" };

struct gcase {
        struct wl_case c;
        enum mem_kind mem;
        int repeat; /* run the whole case twice on the same memory; bits must match */
};

#define CASE(nm, sd, R, E, H, T, K, dt, tdt, lay, al, zp, w, rt, m1, tok, nb, aw, cch)        \
        {                                                                               \
                .name = nm, .seed = sd, .world_size = R, .num_experts = E, .hidden = H, \
                .max_tokens = T, .num_topk = K, .dtype = dt, .topk_dtype = tdt,         \
                .layout = lay, .expert_alignment = al, .zero_padding = zp,              \
                .has_weights = w, .routing = rt, .minus_one_prob = m1, .tokens = tok,   \
                .num_bias = nb, .apply_weights = aw, .cached = cch, .steps = 1,         \
        }

static const struct gcase matrix[] = {
        { CASE("gpu_r1_ne_bf16", 701, 1, 8, 256, 32, 4, BF, I64, NE, 1, 0, 1,
               TD_ROUTING_UNIFORM, 0.1, WL_TOKENS_FULL, 1, 0, 0), MEM_MALLOC, 1 },
        { CASE("gpu_r2_ex_fp8_a16", 702, 2, 16, 512, 64, 8, F8, I32, EX, 16, 1, 1,
               TD_ROUTING_SKEWED, 0.1, WL_TOKENS_DESCENDING, 2, 1, 1), MEM_MALLOC, 0 },
        { CASE("gpu_r4_ne_fp8_cumem", 703, 4, 32, 256, 48, 8, F8, I64, NE, 1, 0, 1,
               TD_ROUTING_UNIFORM, 0.1, WL_TOKENS_SOME_ZERO, 1, 0, 1), MEM_CUMEM, 1 },
        { CASE("gpu_r8_ex_bf16_a4", 704, 8, 64, 128, 32, 8, BF, I64, EX, 4, 0, 1,
               TD_ROUTING_ONE_RANK, 0.1, WL_TOKENS_FULL, 0, 1, 1), MEM_MIXED, 1 },
        { CASE("gpu_r8_ne_bf16_h7168", 705, 8, 64, 7168, 64, 8, BF, I64, NE, 1, 0, 1,
               TD_ROUTING_UNIFORM, 0.05, WL_TOKENS_DESCENDING, 1, 0, 0), MEM_MALLOC, 0 },
        { CASE("gpu_r2_ne_bf16_i32_mixed", 706, 2, 8, 128, 16, 2, BF, I32, NE, 1, 0, 0,
               TD_ROUTING_UNIFORM, 0.2, WL_TOKENS_FULL, 2, 0, 1), MEM_MIXED, 0 },
        { CASE("gpu_r4_ex_bf16_a8_epd_alloc", 707, 4, 32, 1024, 64, 8, BF, I64, EX, 8, 1, 1,
               TD_ROUTING_SKEWED, 0.1, WL_TOKENS_DESCENDING, 1, 1, 1), MEM_EPD, 1 },
        { CASE("gpu_r2_ne_fp8_epd_alloc", 708, 2, 16, 512, 32, 4, F8, I32, NE, 1, 0, 1,
               TD_ROUTING_UNIFORM, 0.1, WL_TOKENS_SOME_ZERO, 2, 0, 0), MEM_EPD, 0 },
        /* combine's weight inputs (docs/semantics.md §3): recv_weights after a dispatch
         * without weights (and its cached dispatch); source_weights with apply_weights. */
        { { .name = "gpu_r4_ne_bf16_recv_weights", .seed = 709, .world_size = 4,
            .num_experts = 32, .hidden = 256, .max_tokens = 48, .num_topk = 8, .dtype = BF,
            .topk_dtype = I64, .layout = NE, .expert_alignment = 1, .has_weights = 0,
            .routing = TD_ROUTING_UNIFORM, .minus_one_prob = 0.1,
            .tokens = WL_TOKENS_DESCENDING, .num_bias = 1, .cached = 1, .steps = 1,
            .combine_weights = WL_COMBINE_RECV_WEIGHTS }, MEM_MALLOC, 0 },
        { { .name = "gpu_r4_ex_fp8_source_weights", .seed = 710, .world_size = 4,
            .num_experts = 32, .hidden = 512, .max_tokens = 48, .num_topk = 8, .dtype = F8,
            .topk_dtype = I64, .layout = EX, .expert_alignment = 4, .zero_padding = 1,
            .has_weights = 0, .routing = TD_ROUTING_SKEWED, .minus_one_prob = 0.1,
            .tokens = WL_TOKENS_SOME_ZERO, .num_bias = 2, .apply_weights = 1, .steps = 1,
            .combine_weights = WL_COMBINE_SOURCE_WEIGHTS }, MEM_CUMEM, 0 },
};

/* CAPACITY_EXCEEDED: rank 1's outputs hold one row fewer than it receives. */
static const struct gcase capacity_case = {
        CASE("gpu_capacity", 711, 2, 8, 128, 32, 2, BF, I64, NE, 1, 0, 1, TD_ROUTING_UNIFORM,
             0.0, WL_TOKENS_FULL, 0, 0, 0), MEM_MIXED, 0
};

/* PEER_LOST: rank 2 is killed while ranks 0 and 1 wait in op 2. */
static const struct gcase peer_case = {
        CASE("gpu_peer_lost", 721, 3, 12, 128, 16, 4, BF, I64, EX, 4, 1, 1, TD_ROUTING_UNIFORM,
             0.1, WL_TOKENS_DESCENDING, 1, 1, 0), MEM_MALLOC, 0
};

/* The small op that shows the daemon's GPU context still works after a test. */
static const struct gcase probe_case = {
        CASE("gpu_probe", 731, 1, 4, 128, 8, 2, BF, I64, NE, 1, 0, 1, TD_ROUTING_UNIFORM, 0.0,
             WL_TOKENS_FULL, 1, 0, 0), MEM_MIXED, 0
};

/* ---- state shared between a test and its workers ---- */

enum { FLAG_VICTIM_READY, FLAG_SUBMITTED, FLAG_REJOINED, FLAG_COUNT };

struct shared {
        char socket[320];
        char group[64];
        struct gcase gc;
        atomic_int flag[FLAG_COUNT];
        atomic_llong kill_ms;
};

static struct shared *shared_new(const struct h_daemon *d, const struct gcase *gc)
{
        struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);

        ck_assert_msg(sh != MAP_FAILED, "mmap of the shared state failed");
        memset(sh, 0, sizeof(*sh));
        snprintf(sh->socket, sizeof(sh->socket), "%s", d->socket);
        snprintf(sh->group, sizeof(sh->group), "%s", gc->c.name);
        sh->gc = *gc;
        return sh;
}

/* ---- one worker: its client, group and device memory ---- */

enum slab_kind { SLAB_MALLOC, SLAB_CUMEM, SLAB_EPD };

struct dslab {
        uint8_t *base;     /* device address */
        uint64_t bytes, used;
        enum slab_kind kind;
        uint64_t region_id;
};

struct worker {
        struct shared *sh;
        const struct wl_case *c;
        uint32_t rank;
        struct epd_client *client;
        struct epd_group *group;
        struct dslab in, out;
        char msg[1024];    /* the message of the last op */
        /* A second identical run compares every downloaded buffer with the first run's. */
        int recording, comparing;
        unsigned num_bits, next_bit;
        uint8_t *bits[64];
        uint64_t bits_len[64];
};

static int failf(const struct worker *w, int line, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

static int failf(const struct worker *w, int line, const char *fmt, ...)
{
        char detail[1536];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(detail, sizeof(detail), fmt, ap);
        va_end(ap);
        /* One write per line: the workers share stderr. */
        fprintf(stderr, "[%s seed=%llu mem=%s rank=%u line=%d] %s\n", w->c->name,
                (unsigned long long)w->c->seed, mem_names[w->sh->gc.mem], w->rank, line,
                detail);
        fflush(stderr);
        return 1;
}

#define CHECK(cond, ...)                                                  \
        do {                                                              \
                if (!(cond))                                              \
                        return failf(w, __LINE__, __VA_ARGS__);           \
        } while (0)
#define TRY(expr)                                                         \
        do {                                                              \
                if ((expr) != 0)                                          \
                        return 1;                                         \
        } while (0)
#define CU(call)                                                                         \
        do {                                                                             \
                cudaError_t e_ = (call);                                                 \
                if (e_ != cudaSuccess)                                                   \
                        return failf(w, __LINE__, "%s: %s", #call, cudaGetErrorString(e_)); \
        } while (0)
#define DRV(call)                                                                        \
        do {                                                                             \
                CUresult r_ = (call);                                                    \
                if (r_ != CUDA_SUCCESS) {                                                \
                        const char *s_ = NULL;                                           \
                        cuGetErrorName(r_, &s_);                                         \
                        return failf(w, __LINE__, "%s: %s", #call, s_ ? s_ : "?");       \
                }                                                                        \
        } while (0)

/* Creates a cuMem allocation of *bytes (rounded up to the granularity) on device 0, mapped
 * read/write; the mapping holds the allocation (the handle is released here). */
static int cumem_alloc(struct worker *w, uint64_t *bytes, CUmemAllocationHandleType types,
                       uint8_t **out)
{
        CUmemAllocationProp prop;
        CUmemAccessDesc acc;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        size_t gran = 0;

        memset(&prop, 0, sizeof(prop));
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        prop.requestedHandleTypes = types;
        DRV(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        *bytes = (*bytes + gran - 1) / gran * gran;
        DRV(cuMemCreate(&h, *bytes, &prop, 0));
        DRV(cuMemAddressReserve(&va, *bytes, gran, 0, 0));
        DRV(cuMemMap(va, *bytes, 0, h, 0));
        DRV(cuMemRelease(h));
        memset(&acc, 0, sizeof(acc));
        acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        acc.location.id = 0;
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        DRV(cuMemSetAccess(va, *bytes, &acc, 1));
        *out = (uint8_t *)(uintptr_t)va;
        return 0;
}

static int cumem_free(struct worker *w, uint8_t *p, uint64_t bytes)
{
        DRV(cuMemUnmap((CUdeviceptr)(uintptr_t)p, bytes));
        DRV(cuMemAddressFree((CUdeviceptr)(uintptr_t)p, bytes));
        return 0;
}

/* Allocates and registers a slab; checks that the registration cache answers for a pointer
 * inside it and that epd_tensor_at resolves device pointers. */
static int slab_open(struct worker *w, struct dslab *s, enum slab_kind kind)
{
        static const char *const kind_names[] = { "cudaMalloc", "cuMem", "epd_device_alloc" };
        uint64_t id2 = 0;
        struct epd_tensor t;
        uint64_t sizes[1] = { 1024 };
        int rc;

        memset(s, 0, sizeof(*s));
        s->bytes = SLAB_BYTES;
        s->kind = kind;
        if (kind == SLAB_EPD) {
                /* Allocated and registered in one call; the slab uses the bytes it asked for. */
                rc = epd_device_alloc(w->client, 0, s->bytes, (void **)&s->base, &s->region_id);
        } else {
                if (kind == SLAB_CUMEM)
                        TRY(cumem_alloc(w, &s->bytes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                        &s->base));
                else
                        CU(cudaMalloc((void **)&s->base, s->bytes));
                rc = epd_region_register_device(w->client, s->base, s->bytes, 0, &s->region_id);
        }
        CHECK(rc == 0, "register %s slab %p (%llu bytes): %s: %s", kind_names[kind],
              (void *)s->base, (unsigned long long)s->bytes, epd_status_name(rc),
              epd_client_last_error(w->client));
        rc = epd_region_register_device(w->client, s->base + s->bytes / 2, 4096, 0, &id2);
        CHECK(rc == 0 && id2 == s->region_id,
              "registering a pointer inside the slab gave %s, region %llu, expected region %llu: %s",
              epd_status_name(rc), (unsigned long long)id2, (unsigned long long)s->region_id,
              epd_client_last_error(w->client));
        rc = epd_tensor_at(w->client, s->base + 4096, EPD_DTYPE_INT32, 1, sizes, &t);
        CHECK(rc == 0 && t.region_id == s->region_id && t.offset == 4096,
              "epd_tensor_at(base + 4096) gave %s, region %llu offset %llu", epd_status_name(rc),
              (unsigned long long)t.region_id, (unsigned long long)t.offset);
        return 0;
}

/* A bump allocator over a slab, 256-byte aligned; sizing it is the test's own arithmetic. */
static void *dtake(struct worker *w, struct dslab *s, uint64_t bytes)
{
        uint64_t off = (s->used + 255) / 256 * 256;

        if (off + bytes > s->bytes) {
                failf(w, __LINE__, "device slab of %llu bytes exhausted (test bug)",
                      (unsigned long long)s->bytes);
                abort();
        }
        s->used = off + bytes;
        return s->base + off;
}

static int upload(struct worker *w, void *dst, const void *src, uint64_t bytes)
{
        if (bytes)
                CU(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
        return 0;
}

/* Copies device bytes back into a new host buffer (*out, freed by the caller). */
static int download(struct worker *w, const void *src, uint64_t bytes, uint8_t **out)
{
        *out = malloc(bytes + 1);
        CHECK(*out, "out of memory");
        if (bytes)
                CU(cudaMemcpy(*out, src, bytes, cudaMemcpyDeviceToHost));
        return 0;
}

/* Records (first run) or compares (second run) a downloaded buffer. */
static int bits_note(struct worker *w, const char *what, const uint8_t *p, uint64_t bytes)
{
        if (w->recording) {
                CHECK(w->num_bits < 64, "too many buffers to record");
                w->bits[w->num_bits] = malloc(bytes + 1);
                CHECK(w->bits[w->num_bits], "out of memory");
                memcpy(w->bits[w->num_bits], p, bytes);
                w->bits_len[w->num_bits++] = bytes;
        } else if (w->comparing) {
                unsigned i = w->next_bit++;
                CHECK(i < w->num_bits && w->bits_len[i] == bytes,
                      "second run: %s is buffer %u of %llu bytes, the first run had %u buffers",
                      what, i, (unsigned long long)bytes, w->num_bits);
                for (uint64_t b = 0; b < bytes; b++)
                        CHECK(w->bits[i][b] == p[b],
                              "second identical run: %s byte %llu is 0x%02x, the first run gave 0x%02x",
                              what, (unsigned long long)b, p[b], w->bits[i][b]);
        }
        return 0;
}

static int dtensor(struct worker *w, const void *dptr, enum epd_dtype dtype, uint64_t rows,
                   uint64_t cols, struct epd_tensor *t)
{
        uint64_t sizes[2] = { rows, cols };
        int rc = epd_tensor_at(w->client, dptr, dtype, cols ? 2 : 1, sizes, t);

        CHECK(rc == 0, "epd_tensor_at(%p, %llu x %llu): %s", dptr, (unsigned long long)rows,
              (unsigned long long)cols, epd_client_last_error(w->client));
        return 0;
}

static int worker_open(struct worker *w, struct shared *sh, uint32_t rank)
{
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = sh->socket,
                                       .client_name = sh->gc.c.name, .timeout_ms = WAIT_MS };
        const struct wl_case *c = &sh->gc.c;
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = c->world_size,
                .num_experts = c->num_experts, .hidden = c->hidden,
                .max_tokens_per_rank = c->max_tokens, .max_topk = c->num_topk,
                .dispatch_dtype = c->dtype, .op_timeout_ms = WAIT_MS,
                .arena_bytes = 1u << 20,
        };
        struct epd_daemon_info info;
        long long deadline = h_now_ms() + WAIT_MS;
        char err[512];
        int rc;

        memset(w, 0, sizeof(*w));
        w->sh = sh;
        w->c = c;
        w->rank = rank;
        rc = epd_client_connect(&ca, &w->client, err, sizeof(err));
        CHECK(rc == 0, "connect: %s: %s", epd_status_name(rc), err);
        epd_client_daemon_info(w->client, &info);
        CHECK(strcmp(info.backend, "cuda") == 0, "the daemon runs the '%s' backend, not cuda",
              info.backend);
        /* The group first (rank 0 creates it at once; the others wait for it, and a re-joining
         * rank waits while the daemon still holds the lost client), then CUDA, whose context
         * creation in several processes at once may take a while. */
        do {
                rc = wl_enter_group(w->client, sh->group, rank, &cfg, &w->group);
                if (rank == 0 || (rc != EPD_ALREADY_EXISTS && rc != EPD_NOT_FOUND))
                        break;
                usleep(10000);
        } while (h_now_ms() < deadline);
        CHECK(rc == 0, "enter group '%s' as rank %u: %s: %s", sh->group, rank,
              epd_status_name(rc), epd_client_last_error(w->client));
        /* This process's own CUDA context on GPU 0. */
        CU(cudaSetDevice(0));
        CU(cudaFree(NULL));
        TRY(slab_open(w, &w->in, sh->gc.mem == MEM_EPD     ? SLAB_EPD
                                 : sh->gc.mem == MEM_CUMEM ? SLAB_CUMEM
                                                           : SLAB_MALLOC));
        TRY(slab_open(w, &w->out, sh->gc.mem == MEM_EPD      ? SLAB_EPD
                                  : sh->gc.mem == MEM_MALLOC ? SLAB_MALLOC
                                                             : SLAB_CUMEM));
        return 0;
}

/* The clean order: the daemon closes its mappings before this process frees the memory
 * (epd_device_free keeps that order itself). */
static int worker_close(struct worker *w)
{
        int rc = epd_group_leave(w->group);

        w->group = NULL;
        CHECK(rc == 0, "leave: %s", epd_client_last_error(w->client));
        for (int i = 0; i < 2; i++) {
                struct dslab *s = i ? &w->out : &w->in;
                if (s->kind == SLAB_EPD) {
                        rc = epd_device_free(w->client, s->base);
                        CHECK(rc == 0, "epd_device_free(%p): %s", (void *)s->base,
                              epd_client_last_error(w->client));
                        rc = epd_region_release(w->client, s->region_id);
                        CHECK(rc == EPD_NOT_FOUND,
                              "region %llu outlived epd_device_free (release gave %s)",
                              (unsigned long long)s->region_id, epd_status_name(rc));
                        continue;
                }
                rc = epd_region_release(w->client, s->region_id);
                CHECK(rc == 0, "release region %llu: %s", (unsigned long long)s->region_id,
                      epd_client_last_error(w->client));
        }
        epd_client_free(w->client);
        w->client = NULL;
        for (int i = 0; i < 2; i++) {
                struct dslab *s = i ? &w->out : &w->in;
                if (s->kind == SLAB_CUMEM)
                        TRY(cumem_free(w, s->base, s->bytes));
                else if (s->kind == SLAB_MALLOC)
                        CU(cudaFree(s->base));
        }
        for (unsigned i = 0; i < w->num_bits; i++)
                free(w->bits[i]);
        return 0;
}

/* ---- one dispatch's inputs and reference ---- */

struct step {
        struct wl_inputs ins[MAX_RANKS];
        struct ref_dispatch *ref;
};

static void step_free(struct step *st)
{
        st->ref = ref_dispatch_free(st->ref);
        for (int s = 0; s < MAX_RANKS; s++)
                wl_inputs_free(&st->ins[s]);
}

static uint32_t scale_cols(const struct wl_case *c)
{
        return c->dtype == F8 ? c->hidden / WL_SCALE_BLOCK : 0;
}

/* Every rank's inputs of `step` (weights variant wv) and the reference built from them. */
static int step_make(struct worker *w, struct step *st, int step, int wv)
{
        const struct wl_case *c = w->c;
        struct ref_src srcs[MAX_RANKS];
        struct ref_params params;
        char err[512];

        step_free(st);
        for (uint32_t s = 0; s < c->world_size; s++) {
                struct wl_inputs *in = &st->ins[s];
                CHECK(wl_inputs_make(c, s, step, wv, in) == 0, "out of memory");
                srcs[s] = (struct ref_src){
                        .num_tokens = in->num_tokens,
                        .x = { in->x, in->x_stride },
                        .scales = { scale_cols(c) ? in->scales : NULL, 0 },
                        .topk_idx = { in->topk, 0 },
                        .weights = { c->has_weights ? in->weights : NULL, 0 },
                };
        }
        wl_ref_params(c, &params);
        CHECK(ref_dispatch_new(&params, srcs, &st->ref, err, sizeof(err)) == 0, "reference: %s",
              err);
        return 0;
}

static int64_t my_rows(const struct worker *w, const struct step *st)
{
        return st->ref->dst[w->rank].rows;
}

/* ---- dispatch ---- */

enum out_field { OF_X, OF_SCALES, OF_TOPK_IDX, OF_WEIGHTS, OF_SRC, OF_TOPK_SLOT, OF_COUNT };

static const char *const of_names[OF_COUNT] = { "recv_x", "recv_scales", "recv_topk_idx",
                                                "recv_weights", "recv_src", "recv_topk_slot" };

struct outputs {
        uint8_t *dev[OF_COUNT]; /* NULL: not given */
        uint64_t bytes[OF_COUNT];
        /* The inputs on the device; a cached dispatch reuses x and scales and rewrites the
         * weights. */
        uint8_t *x_dev;
        float *scales_dev, *weights_dev;
};

/* Uploads this rank's inputs of st and describes a dispatch whose outputs are device tensors
 * of cap rows, filled with `fill`. */
static int build_dispatch(struct worker *w, const struct step *st, uint64_t cap, uint8_t fill,
                          struct epd_dispatch_args *da, struct outputs *o)
{
        const struct wl_case *c = w->c;
        const struct wl_inputs *in = &st->ins[w->rank];
        uint32_t n = in->num_tokens, K = c->num_topk, H = c->hidden, S = scale_cols(c);
        uint64_t row_bytes = (uint64_t)H * epd_dtype_size(c->dtype);
        size_t te = epd_dtype_size(c->topk_dtype);
        int expand = c->layout == EX;

        memset(da, 0, sizeof(*da));
        memset(o, 0, sizeof(*o));
        da->size = sizeof(*da);
        da->num_tokens = n;
        da->num_topk = K;
        da->layout = c->layout;
        da->expert_alignment = c->expert_alignment;
        da->zero_padding = c->zero_padding;
        CHECK(in->x_stride == row_bytes, "inputs with padded rows are not used here");
        o->x_dev = dtake(w, &w->in, (uint64_t)n * row_bytes);
        TRY(upload(w, o->x_dev, in->x, (uint64_t)n * row_bytes));
        TRY(dtensor(w, o->x_dev, c->dtype, n, H, &da->x));
        if (S) {
                o->scales_dev = dtake(w, &w->in, (uint64_t)n * S * 4);
                TRY(upload(w, o->scales_dev, in->scales, (uint64_t)n * S * 4));
                TRY(dtensor(w, o->scales_dev, EPD_DTYPE_FP32, n, S, &da->scales));
        }
        void *topk = dtake(w, &w->in, (uint64_t)n * K * te);
        TRY(upload(w, topk, in->topk, (uint64_t)n * K * te));
        TRY(dtensor(w, topk, c->topk_dtype, n, K, &da->topk_idx));
        if (c->has_weights) {
                o->weights_dev = dtake(w, &w->in, (uint64_t)n * K * 4);
                TRY(upload(w, o->weights_dev, in->weights, (uint64_t)n * K * 4));
                TRY(dtensor(w, o->weights_dev, EPD_DTYPE_FP32, n, K, &da->topk_weights));
        }
        const struct {
                int present;
                struct epd_tensor *slot;
                enum epd_dtype dtype;
                uint64_t cols;
        } f[OF_COUNT] = {
                [OF_X] = { 1, &da->recv_x, c->dtype, H },
                [OF_SCALES] = { S != 0, &da->recv_scales, EPD_DTYPE_FP32, S },
                [OF_TOPK_IDX] = { !expand, &da->recv_topk_idx, c->topk_dtype, K },
                [OF_WEIGHTS] = { c->has_weights, &da->recv_weights, EPD_DTYPE_FP32,
                                 expand ? 0 : K },
                [OF_SRC] = { 1, &da->recv_src, I64, 0 },
                [OF_TOPK_SLOT] = { expand, &da->recv_topk_slot, I32, 0 },
        };
        for (int i = 0; i < OF_COUNT; i++) {
                if (!f[i].present)
                        continue;
                o->bytes[i] = cap * (f[i].cols ? f[i].cols : 1) * epd_dtype_size(f[i].dtype);
                o->dev[i] = dtake(w, &w->out, o->bytes[i]);
                CU(cudaMemset(o->dev[i], fill, o->bytes[i]));
                TRY(dtensor(w, o->dev[i], f[i].dtype, cap, f[i].cols, f[i].slot));
        }
        /* cudaMemcpy from pageable memory may return before the DMA lands, and the daemon's
         * kernels run in another context: wait for everything before submitting. */
        CU(cudaDeviceSynchronize());
        return 0;
}

/* Downloads the outputs and checks counts and every output against st's reference. */
static int dispatch_check(struct worker *w, const struct step *st, struct epd_op *op,
                          const struct outputs *o, uint64_t *handle)
{
        struct epd_dispatch_result dr;
        struct ref_dispatch_actual act;
        uint8_t *host[OF_COUNT] = { NULL };
        char err[1024];
        int rc = epd_op_dispatch_result(op, &dr), bad = 0;

        CHECK(rc == 0, "dispatch result: %s", epd_status_name(rc));
        CHECK(dr.world_size == w->c->world_size &&
                      dr.num_local_experts == w->c->num_experts / w->c->world_size,
              "reply has %u ranks and %u local experts", dr.world_size, dr.num_local_experts);
        struct ref_counts_actual counts = {
                dr.num_recv_tokens, dr.num_expanded_rows, dr.num_recv_tokens_per_expert,
                dr.num_recv_tokens_per_expert_aligned, dr.rank_prefix,
        };
        CHECK(ref_check_counts(st->ref, w->rank, &counts, err, sizeof(err)) == 0, "counts: %s",
              err);
        for (int i = 0; i < OF_COUNT; i++)
                if (o->dev[i] && download(w, o->dev[i], o->bytes[i], &host[i]) != 0)
                        bad = 1;
        for (int i = 0; i < OF_COUNT && !bad; i++)
                if (host[i] && bits_note(w, of_names[i], host[i], o->bytes[i]) != 0)
                        bad = 1;
        if (!bad) {
                memset(&act, 0, sizeof(act));
                act.recv_x = (struct ref_buf){ host[OF_X], 0 };
                act.recv_scales = (struct ref_buf){ host[OF_SCALES], 0 };
                act.recv_topk_idx = (struct ref_buf){ host[OF_TOPK_IDX], 0 };
                act.recv_weights = (struct ref_buf){ host[OF_WEIGHTS], 0 };
                act.recv_src = (struct ref_buf){ host[OF_SRC], 0 };
                act.recv_topk_slot = (struct ref_buf){ host[OF_TOPK_SLOT], 0 };
                if (ref_check_dispatch(st->ref, w->rank, &act, err, sizeof(err)) != 0)
                        bad = failf(w, __LINE__, "dispatch outputs (device memory): %s", err);
        }
        for (int i = 0; i < OF_COUNT; i++)
                free(host[i]);
        if (bad)
                return 1;
        if (handle)
                *handle = dr.handle_id;
        return 0;
}

/* A dispatch of st with exactly enough rows that must succeed. */
static int dispatch_ok(struct worker *w, const struct step *st, struct outputs *o,
                       uint64_t *handle)
{
        struct epd_dispatch_args da;
        struct epd_op *op = NULL;
        int rc;

        TRY(build_dispatch(w, st, (uint64_t)my_rows(w, st), POISON, &da, o));
        rc = epd_dispatch(w->group, &da, &op);
        CHECK(rc == 0, "dispatch: %s: %s", epd_status_name(rc), epd_client_last_error(w->client));
        rc = dispatch_check(w, st, op, o, handle);
        epd_op_free(op);
        return rc;
}

/* A cached dispatch naming `handle` with st's (new) weights, into the same outputs, which are
 * poisoned again first so stale rows cannot pass. */
static int dispatch_cached(struct worker *w, const struct step *st, uint64_t handle,
                           const struct outputs *o)
{
        const struct wl_case *c = w->c;
        const struct wl_inputs *in = &st->ins[w->rank];
        struct epd_dispatch_args da;
        struct epd_op *op = NULL;
        uint64_t cap = (uint64_t)my_rows(w, st), got = 0;
        uint32_t n = in->num_tokens, K = c->num_topk;
        int rc;

        memset(&da, 0, sizeof(da));
        da.size = sizeof(da);
        da.num_tokens = n;
        da.num_topk = K;
        da.layout = c->layout;
        da.expert_alignment = c->expert_alignment;
        da.zero_padding = c->zero_padding;
        da.handle_id = handle;
        /* x and scales come from the first dispatch's buffers, which still hold them. */
        if (c->has_weights) {
                TRY(upload(w, o->weights_dev, in->weights, (uint64_t)n * K * 4));
                TRY(dtensor(w, o->weights_dev, EPD_DTYPE_FP32, n, K, &da.topk_weights));
        }
        TRY(dtensor(w, o->x_dev, c->dtype, n, c->hidden, &da.x));
        if (o->scales_dev)
                TRY(dtensor(w, o->scales_dev, EPD_DTYPE_FP32, n, scale_cols(c), &da.scales));
        struct epd_tensor *slots[OF_COUNT] = { &da.recv_x, &da.recv_scales, &da.recv_topk_idx,
                                               &da.recv_weights, &da.recv_src,
                                               &da.recv_topk_slot };
        const enum epd_dtype dts[OF_COUNT] = { c->dtype, EPD_DTYPE_FP32, c->topk_dtype,
                                               EPD_DTYPE_FP32, I64, I32 };
        const uint64_t cols[OF_COUNT] = { c->hidden, scale_cols(c), K,
                                          c->layout == EX ? 0 : K, 0, 0 };
        for (int i = 0; i < OF_COUNT; i++) {
                if (!o->dev[i])
                        continue;
                CU(cudaMemset(o->dev[i], POISON, o->bytes[i]));
                TRY(dtensor(w, o->dev[i], dts[i], cap, cols[i], slots[i]));
        }
        CU(cudaDeviceSynchronize());
        rc = epd_dispatch(w->group, &da, &op);
        CHECK(rc == 0, "cached dispatch: %s: %s", epd_status_name(rc),
              epd_client_last_error(w->client));
        rc = dispatch_check(w, st, op, o, &got);
        epd_op_free(op);
        TRY(rc);
        CHECK(got == handle, "cached dispatch returned handle %llu, expected %llu",
              (unsigned long long)got, (unsigned long long)handle);
        return 0;
}

/* ---- combine ---- */

/* y of destination d: a seeded bf16 function of (seed, d, tag), the same in every worker. */
static uint16_t *y_make(const struct wl_case *c, uint32_t d, int64_t rows, int tag)
{
        uint16_t *y = malloc((size_t)rows * c->hidden * 2 + 2);
        struct td_rng rng;

        if (!y)
                abort();
        td_rng_seed(&rng, td_mix_seed(c->seed, 9000000 + (uint64_t)d * 100 + (uint64_t)tag));
        td_fill_bf16(&rng, y, (uint64_t)rows, c->hidden, 0, 0.0);
        return y;
}

/* Combines `handle` (dispatched from st) with device y, biases and outputs, and checks the
 * combined rows and weights bitwise. */
static int combine_ok(struct worker *w, const struct step *st, uint64_t handle, int tag)
{
        const struct wl_case *c = w->c;
        uint32_t R = c->world_size, H = c->hidden, K = c->num_topk;
        uint32_t n = st->ins[w->rank].num_tokens;
        uint16_t *ys[MAX_RANKS] = { NULL }, *bias_h[2] = { NULL, NULL };
        struct ref_buf ybufs[MAX_RANKS], bias[2] = { { NULL, 0 }, { NULL, 0 } };
        struct epd_combine_args cb = { .size = sizeof(cb), .handle_id = handle,
                                       .apply_weights = c->apply_weights,
                                       .num_bias = c->num_bias };
        struct epd_combine_result cr;
        uint8_t *combined_h = NULL, *cw_h = NULL;
        float *cw = NULL;
        char err[1024];
        int rc, bad = 0;
        /* combine's weight inputs: every rank's recv_weights (wh[d]) and source_weights
         * (wh[R + s]), seeded, so every worker has them for its reference */
        const int recv_w = (c->combine_weights & WL_COMBINE_RECV_WEIGHTS) != 0;
        const int source_w = (c->combine_weights & WL_COMBINE_SOURCE_WEIGHTS) != 0;
        float *wh[2 * MAX_RANKS] = { NULL };
        struct ref_buf wbufs[2 * MAX_RANKS];

        for (uint32_t d = 0; d < R; d++) {
                ys[d] = y_make(c, d, st->ref->dst[d].rows, tag);
                ybufs[d] = (struct ref_buf){ ys[d], 0 };
        }
        for (uint32_t i = 0; i < 2 * R; i++) {
                struct td_rng rng;
                uint64_t wrows = i < R ? (uint64_t)st->ref->dst[i].rows
                                       : st->ins[i - R].num_tokens;
                wh[i] = malloc((size_t)wrows * K * 4 + 4);
                if (!wh[i])
                        abort();
                td_rng_seed(&rng, td_mix_seed(c->seed, 7000000 + (uint64_t)i * 100 +
                                                               (uint64_t)tag));
                td_fill_f32(&rng, wh[i], wrows, K, 0, -1.0f, 2.0f);
                wbufs[i] = (struct ref_buf){ wh[i], 0 };
        }
        int64_t rows = my_rows(w, st);
        uint16_t *y = dtake(w, &w->in, (uint64_t)rows * H * 2);
        if (upload(w, y, ys[w->rank], (uint64_t)rows * H * 2) != 0 ||
            dtensor(w, y, BF, (uint64_t)rows, H, &cb.y) != 0) {
                bad = 1;
                goto out;
        }
        for (uint32_t b = 0; b < c->num_bias; b++) {
                struct td_rng rng;
                uint16_t *bd = dtake(w, &w->in, (uint64_t)n * H * 2);
                bias_h[b] = malloc((size_t)n * H * 2 + 2);
                if (!bias_h[b])
                        abort();
                td_rng_seed(&rng, td_mix_seed(c->seed, 8000000 + w->rank * 10 + b +
                                                               (uint64_t)tag * 1000));
                td_fill_bf16(&rng, bias_h[b], n, H, 0, 0.0);
                if (upload(w, bd, bias_h[b], (uint64_t)n * H * 2) != 0 ||
                    dtensor(w, bd, BF, n, H, &cb.bias[b]) != 0) {
                        bad = 1;
                        goto out;
                }
                bias[b] = (struct ref_buf){ bias_h[b], 0 };
        }
        uint16_t *combined = dtake(w, &w->out, (uint64_t)n * H * 2);
        if (cudaMemset(combined, COMBINED_FILL, (size_t)n * H * 2) != cudaSuccess ||
            dtensor(w, combined, BF, n, H, &cb.combined) != 0) {
                bad = failf(w, __LINE__, "combined output setup failed");
                goto out;
        }
        if (recv_w) {
                float *rw = dtake(w, &w->in, (uint64_t)rows * K * 4);
                if (upload(w, rw, wh[w->rank], (uint64_t)rows * K * 4) != 0 ||
                    dtensor(w, rw, EPD_DTYPE_FP32, (uint64_t)rows, K, &cb.recv_weights) != 0) {
                        bad = 1;
                        goto out;
                }
        }
        if (source_w) {
                float *sw = dtake(w, &w->in, (uint64_t)n * K * 4);
                if (upload(w, sw, wh[R + w->rank], (uint64_t)n * K * 4) != 0 ||
                    dtensor(w, sw, EPD_DTYPE_FP32, n, K, &cb.source_weights) != 0) {
                        bad = 1;
                        goto out;
                }
        }
        if (c->has_weights || recv_w) {
                cw = dtake(w, &w->out, (uint64_t)n * K * 4);
                if (dtensor(w, cw, EPD_DTYPE_FP32, n, K, &cb.combined_topk_weights) != 0) {
                        bad = 1;
                        goto out;
                }
        }
        if (cudaDeviceSynchronize() != cudaSuccess) {
                bad = failf(w, __LINE__, "cudaDeviceSynchronize before combine failed");
                goto out;
        }
        rc = epd_combine(w->group, &cb, &cr);
        if (rc != 0) {
                bad = failf(w, __LINE__, "combine (tag %d): %s: %s", tag, epd_status_name(rc),
                            epd_client_last_error(w->client));
                goto out;
        }
        if (cr.num_tokens != n) {
                bad = failf(w, __LINE__, "combine reply has %u tokens, expected %u",
                            cr.num_tokens, n);
                goto out;
        }
        if (download(w, combined, (uint64_t)n * H * 2, &combined_h) != 0 ||
            (cw && download(w, cw, (uint64_t)n * K * 4, &cw_h) != 0) ||
            bits_note(w, "combined", combined_h, (uint64_t)n * H * 2) != 0 ||
            (cw_h && bits_note(w, "combined_topk_weights", cw_h, (uint64_t)n * K * 4) != 0)) {
                bad = 1;
                goto out;
        }
        struct ref_combine_in cin = { ybufs, c->apply_weights };
        struct ref_combine_weights cws = { .source_weights = source_w ? wbufs + R : NULL,
                                           .recv_weights = recv_w ? wbufs : NULL };
        if (ref_check_combine_w(st->ref, &cin, &cws, w->rank, bias,
                                (struct ref_buf){ combined_h, 0 }, (struct ref_buf){ cw_h, 0 },
                                err, sizeof(err)) != 0)
                bad = failf(w, __LINE__, "combine outputs (device memory, tag %d): %s", tag, err);
out:
        for (uint32_t d = 0; d < R; d++)
                free(ys[d]);
        for (uint32_t i = 0; i < 2 * R; i++)
                free(wh[i]);
        free(bias_h[0]);
        free(bias_h[1]);
        free(combined_h);
        free(cw_h);
        return bad;
}

static int handle_release(struct worker *w, uint64_t handle)
{
        int rc = epd_handle_release(w->group, handle);

        CHECK(rc == 0, "release handle %llu: %s", (unsigned long long)handle,
              epd_client_last_error(w->client));
        return 0;
}

/* One MoE step on the worker's slabs (reused from their start): dispatch, combine and, for a
 * cached case, a cached dispatch with new weights and a second combine. */
static int run_step(struct worker *w, int step)
{
        struct step st;
        struct outputs o;
        uint64_t handle = 0;

        memset(&st, 0, sizeof(st));
        w->in.used = 0;
        w->out.used = 0;
        if (step_make(w, &st, step, 0) != 0 || dispatch_ok(w, &st, &o, &handle) != 0 ||
            combine_ok(w, &st, handle, step * 2) != 0)
                goto fail;
        if (w->c->cached) {
                /* Same routing, new weights: the reference is rebuilt from them. */
                if (step_make(w, &st, step, 1) != 0 || dispatch_cached(w, &st, handle, &o) != 0 ||
                    combine_ok(w, &st, handle, step * 2 + 1) != 0)
                        goto fail;
        }
        step_free(&st);
        return handle_release(w, handle);
fail:
        step_free(&st);
        return 1;
}

/* ---- workers ---- */

static int matrix_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w_s, *w = &w_s;

        TRY(worker_open(w, sh, (uint32_t)index));
        w->recording = sh->gc.repeat;
        TRY(run_step(w, 0));
        if (sh->gc.repeat) {
                /* The same inputs into the same memory, poisoned alike: identical bits. */
                w->recording = 0;
                w->comparing = 1;
                TRY(run_step(w, 0));
                CHECK(w->next_bit == w->num_bits, "second run compared %u of %u buffers",
                      w->next_bit, w->num_bits);
        }
        return worker_close(w);
}

static int capacity_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w_s, *w = &w_s;
        struct step st;
        struct outputs o;
        struct epd_dispatch_args da;
        struct epd_op *op = NULL;
        char needle[128];
        int64_t short_rows;
        int status;

        memset(&st, 0, sizeof(st));
        TRY(worker_open(w, sh, (uint32_t)index));
        TRY(step_make(w, &st, 0, 0));
        short_rows = st.ref->dst[1].rows;
        CHECK(short_rows >= 1, "rank 1 receives no rows; the case cannot be short by one");
        /* Rank 1's capacity is one row short; rank 0's is exact. */
        TRY(build_dispatch(w, &st, (uint64_t)(w->rank == 1 ? short_rows - 1 : my_rows(w, &st)),
                           SENTINEL, &da, &o));
        CHECK(epd_dispatch_submit(w->group, &da, &op) == 0, "submit: %s",
              epd_client_last_error(w->client));
        epd_op_wait(op, WAIT_MS);
        status = epd_op_status(op);
        snprintf(w->msg, sizeof(w->msg), "%s", epd_op_error(op));
        epd_op_free(op);
        snprintf(needle, sizeof(needle), "rank 1 needs %lld rows, capacity %lld",
                 (long long)short_rows, (long long)short_rows - 1);
        CHECK(status == EPD_CAPACITY_EXCEEDED, "dispatch gave %s, expected CAPACITY_EXCEEDED: '%s'",
              epd_status_name(status), w->msg);
        CHECK(strstr(w->msg, needle), "the message lacks '%s': '%s'", needle, w->msg);
        /* No output byte was written, on either rank. */
        for (int i = 0; i < OF_COUNT; i++) {
                uint8_t *h = NULL;
                if (!o.dev[i])
                        continue;
                TRY(download(w, o.dev[i], o.bytes[i], &h));
                for (uint64_t b = 0; b < o.bytes[i]; b++) {
                        if (h[b] != SENTINEL) {
                                failf(w, __LINE__,
                                      "%s byte %llu is 0x%02x after CAPACITY_EXCEEDED, expected 0x%02x",
                                      of_names[i], (unsigned long long)b, h[b], SENTINEL);
                                free(h);
                                return 1;
                        }
                }
                free(h);
        }
        step_free(&st);
        /* The group goes on: the next op with enough room succeeds. */
        TRY(run_step(w, 1));
        return worker_close(w);
}

/* Ranks 0 and 1 (and a re-joined rank 2) after the group re-formed: a fresh step succeeds. */
static int peer_after_rejoin(struct worker *w)
{
        TRY(run_step(w, 3));
        return worker_close(w);
}

static int peer_first_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w_s, *w = &w_s;
        struct step st;
        struct outputs o;
        struct epd_dispatch_args da;
        struct epd_op *op = NULL;
        long long done, killed;
        int status;

        memset(&st, 0, sizeof(st));
        TRY(worker_open(w, sh, (uint32_t)index));
        TRY(run_step(w, 0)); /* ops 0 and 1 */
        if (w->rank == 2) {
                /* The victim: killed before it submits op 2. */
                atomic_store(&sh->flag[FLAG_VICTIM_READY], 1);
                for (;;)
                        pause();
        }
        w->in.used = 0;
        w->out.used = 0;
        TRY(step_make(w, &st, 1, 0));
        TRY(build_dispatch(w, &st, (uint64_t)my_rows(w, &st), SENTINEL, &da, &o));
        CHECK(epd_dispatch_submit(w->group, &da, &op) == 0, "submit: %s",
              epd_client_last_error(w->client));
        atomic_fetch_add(&sh->flag[FLAG_SUBMITTED], 1);
        epd_op_wait(op, WAIT_MS);
        status = epd_op_status(op);
        snprintf(w->msg, sizeof(w->msg), "%s", epd_op_error(op));
        epd_op_free(op);
        done = h_now_ms();
        killed = atomic_load(&sh->kill_ms);
        CHECK(status == EPD_PEER_LOST, "op 2 while rank 2 dies gave %s, expected PEER_LOST: '%s'",
              epd_status_name(status), w->msg);
        CHECK(strstr(w->msg, "rank 2"), "the PEER_LOST message does not name rank 2: '%s'",
              w->msg);
        CHECK(killed > 0 && done >= killed, "op 2 ended before rank 2 was killed: '%s'", w->msg);
        printf("rank %u: PEER_LOST %lld ms after the kill: %s\n", w->rank, done - killed, w->msg);
        fflush(stdout);
        for (int i = 0; i < OF_COUNT; i++) {
                uint8_t *h = NULL;
                if (!o.dev[i])
                        continue;
                TRY(download(w, o.dev[i], o.bytes[i], &h));
                for (uint64_t b = 0; b < o.bytes[i]; b++) {
                        if (h[b] != SENTINEL) {
                                failf(w, __LINE__, "%s byte %llu is 0x%02x after PEER_LOST",
                                      of_names[i], (unsigned long long)b, h[b]);
                                free(h);
                                return 1;
                        }
                }
                free(h);
        }
        step_free(&st);
        CHECK(h_flag_wait(&sh->flag[FLAG_REJOINED], 1, WAIT_MS) == 0, "rank 2 did not re-join");
        return peer_after_rejoin(w);
}

static int peer_rejoin_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w_s, *w = &w_s;

        TRY(worker_open(w, sh, (uint32_t)index));
        atomic_store(&sh->flag[FLAG_REJOINED], 1);
        return peer_after_rejoin(w);
}

/* True when [p, p+1) is no longer mapped in this process. */
static int unmapped(const void *p)
{
        CUdeviceptr base = 0;
        size_t size = 0;

        return cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS;
}

/* epd_device_alloc / epd_device_free on their own: refusals, what the memory is, foreign
 * pointers, a released and re-registered region, and epd_client_free freeing the rest. */
static int alloc_api(struct worker *w)
{
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = w->sh->socket,
                                       .client_name = "gpu_alloc_api", .timeout_ms = WAIT_MS };
        struct epd_client *other = NULL;
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp prop;
        CUdeviceptr base = 0;
        size_t size = 0;
        uint64_t id = 0, id2 = 0;
        uint8_t *p = NULL, *q = NULL;
        char err[512];
        int count = 0, rc;

        /* Refusals, with the outputs untouched. */
        rc = epd_device_alloc(w->client, 0, 0, (void **)&p, &id);
        CHECK(rc == EPD_INVALID_ARGUMENT && !p, "epd_device_alloc of 0 bytes gave %s",
              epd_status_name(rc));
        printf("0 bytes refused: %s\n", epd_client_last_error(w->client));
        rc = epd_device_alloc(w->client, 0, 4096, NULL, &id);
        CHECK(rc == EPD_INVALID_ARGUMENT, "epd_device_alloc without dev_ptr gave %s",
              epd_status_name(rc));
        CU(cudaGetDeviceCount(&count));
        rc = epd_device_alloc(w->client, (uint32_t)count, 4096, (void **)&p, &id);
        CHECK(rc == EPD_INVALID_ARGUMENT && !p, "epd_device_alloc on CUDA device %d gave %s",
              count, epd_status_name(rc));
        printf("missing device refused: %s\n", epd_client_last_error(w->client));

        /* One byte: a whole granule of cuMem memory with the POSIX-fd handle type, one region
         * that the cache and epd_tensor_at know, writable by CUDA. */
        rc = epd_device_alloc(w->client, 0, 1, (void **)&p, &id);
        CHECK(rc == 0 && p && id, "epd_device_alloc of 1 byte gave %s: %s", epd_status_name(rc),
              epd_client_last_error(w->client));
        DRV(cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)p));
        CHECK(base == (CUdeviceptr)(uintptr_t)p && size >= 4096,
              "epd_device_alloc gave %p, inside the mapping 0x%llx of %zu bytes", (void *)p,
              (unsigned long long)base, size);
        DRV(cuMemRetainAllocationHandle(&h, p));
        memset(&prop, 0, sizeof(prop));
        DRV(cuMemGetAllocationPropertiesFromHandle(&prop, h));
        DRV(cuMemRelease(h));
        CHECK(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
              "epd_device_alloc memory lacks the POSIX-fd handle type (types 0x%x)",
              (unsigned)prop.requestedHandleTypes);
        rc = epd_region_register_device(w->client, p + size - 1, 1, EPD_DEVICE_AUTO, &id2);
        CHECK(rc == 0 && id2 == id, "registering inside it gave %s, region %llu, not %llu: %s",
              epd_status_name(rc), (unsigned long long)id2, (unsigned long long)id,
              epd_client_last_error(w->client));
        CU(cudaMemset(p, 0x3C, size));
        CU(cudaDeviceSynchronize());
        printf("epd_device_alloc(1 byte): %zu bytes at %p, region %llu\n", size, (void *)p,
               (unsigned long long)id);

        /* Pointers that are not epd_device_alloc's: cudaMalloc memory, a registered slab, a
         * pointer inside the allocation. */
        CU(cudaMalloc((void **)&q, 4096));
        rc = epd_device_free(w->client, q);
        CHECK(rc == EPD_INVALID_ARGUMENT, "epd_device_free(cudaMalloc memory) gave %s",
              epd_status_name(rc));
        printf("foreign pointer refused: %s\n", epd_client_last_error(w->client));
        CU(cudaFree(q));
        rc = epd_device_free(w->client, w->in.base);
        CHECK(rc == EPD_INVALID_ARGUMENT, "epd_device_free(a registered slab) gave %s",
              epd_status_name(rc));
        rc = epd_device_free(w->client, p + 64);
        CHECK(rc == EPD_INVALID_ARGUMENT, "epd_device_free(inside) gave %s", epd_status_name(rc));
        printf("pointer inside refused: %s\n", epd_client_last_error(w->client));
        CHECK(epd_device_free(w->client, NULL) == 0, "epd_device_free(NULL) failed");

        /* Freed: the region went with it, the range is unmapped, a second free is refused. */
        rc = epd_device_free(w->client, p);
        CHECK(rc == 0, "epd_device_free: %s: %s", epd_status_name(rc),
              epd_client_last_error(w->client));
        rc = epd_region_release(w->client, id);
        CHECK(rc == EPD_NOT_FOUND, "region %llu outlived epd_device_free (release gave %s)",
              (unsigned long long)id, epd_status_name(rc));
        CHECK(unmapped(p), "%p is still mapped after epd_device_free", (void *)p);
        rc = epd_device_free(w->client, p);
        CHECK(rc == EPD_INVALID_ARGUMENT, "a second epd_device_free gave %s",
              epd_status_name(rc));

        /* The caller releases the region and an op registers the memory again: the free
         * releases that new region too. */
        rc = epd_device_alloc(w->client, 0, 3u << 20, (void **)&p, &id);
        CHECK(rc == 0, "epd_device_alloc: %s: %s", epd_status_name(rc),
              epd_client_last_error(w->client));
        CHECK(epd_region_release(w->client, id) == 0, "release: %s",
              epd_client_last_error(w->client));
        rc = epd_region_register_device(w->client, p + 4096, 64, 0, &id2);
        CHECK(rc == 0 && id2 != id, "re-registering gave %s, region %llu (old %llu): %s",
              epd_status_name(rc), (unsigned long long)id2, (unsigned long long)id,
              epd_client_last_error(w->client));
        rc = epd_device_free(w->client, p);
        CHECK(rc == 0, "epd_device_free: %s: %s", epd_status_name(rc),
              epd_client_last_error(w->client));
        rc = epd_region_release(w->client, id2);
        CHECK(rc == EPD_NOT_FOUND, "re-registered region %llu outlived epd_device_free (%s)",
              (unsigned long long)id2, epd_status_name(rc));

        /* epd_client_free frees what its client still holds. */
        rc = epd_client_connect(&ca, &other, err, sizeof(err));
        CHECK(rc == 0, "connect: %s: %s", epd_status_name(rc), err);
        rc = epd_device_alloc(other, 0, 1u << 20, (void **)&p, &id);
        CHECK(rc == 0, "epd_device_alloc: %s: %s", epd_status_name(rc),
              epd_client_last_error(other));
        epd_client_free(other);
        CHECK(unmapped(p), "%p is still mapped after epd_client_free", (void *)p);
        fflush(stdout);
        return 0;
}

/* The registration API on its own: cache hits, refusals, stale entries. */
static int api_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w_s, *w = &w_s;
        uint64_t id = 0, id2 = 0, bytes = 4u << 20, nofd_bytes = 2u << 20;
        struct epd_daemon_info info;
        uint8_t *p = NULL, *nofd = NULL;
        int host_word = 0, rc;

        (void)index;
        TRY(worker_open(w, sh, 0));
        epd_client_daemon_info(w->client, &info);

        /* EPD_DEVICE_AUTO finds device 0 by UUID, and the cache answers. */
        rc = epd_region_register_device(w->client, w->in.base + 100, 100, EPD_DEVICE_AUTO, &id);
        CHECK(rc == 0 && id == w->in.region_id, "EPD_DEVICE_AUTO gave %s, region %llu (want %llu): %s",
              epd_status_name(rc), (unsigned long long)id, (unsigned long long)w->in.region_id,
              epd_client_last_error(w->client));
        /* Another daemon device is another GPU: refused by UUID. */
        if (info.num_devices > 1) {
                rc = epd_region_register_device(w->client, w->in.base, 64, 1, &id);
                CHECK(rc == EPD_INVALID_ARGUMENT, "registering GPU 0 memory as device 1 gave %s",
                      epd_status_name(rc));
                printf("device mismatch refused: %s\n", epd_client_last_error(w->client));
        }
        /* A range past the end of the allocation. */
        rc = epd_region_register_device(w->client, w->in.base + w->in.bytes - 16, 32, 0, &id);
        CHECK(rc == EPD_INVALID_ARGUMENT, "a range past the allocation gave %s",
              epd_status_name(rc));
        printf("past the end refused: %s\n", epd_client_last_error(w->client));
        /* Host memory is not device memory. */
        rc = epd_region_register_device(w->client, &host_word, sizeof(host_word), 0, &id);
        CHECK(rc == EPD_INVALID_ARGUMENT, "host memory gave %s", epd_status_name(rc));
        printf("host memory refused: %s\n", epd_client_last_error(w->client));
        /* A cuMem allocation without the POSIX-fd handle type cannot travel. */
        TRY(cumem_alloc(w, &nofd_bytes, CU_MEM_HANDLE_TYPE_NONE, &nofd));
        rc = epd_region_register_device(w->client, nofd, 64, 0, &id);
        CHECK(rc == EPD_INVALID_ARGUMENT, "cuMem without a POSIX fd gave %s: %s",
              epd_status_name(rc), epd_client_last_error(w->client));
        printf("cuMem without POSIX fd refused: %s\n", epd_client_last_error(w->client));
        TRY(cumem_free(w, nofd, nofd_bytes));

        /* Two cudaMalloc allocations are two regions; release then re-register works. */
        CU(cudaMalloc((void **)&p, bytes));
        rc = epd_region_register_device(w->client, p + 8, 8, 0, &id);
        CHECK(rc == 0 && id != w->in.region_id && id != w->out.region_id,
              "a second cudaMalloc allocation gave %s, region %llu: %s", epd_status_name(rc),
              (unsigned long long)id, epd_client_last_error(w->client));
        CHECK(epd_region_release(w->client, id) == 0, "release: %s",
              epd_client_last_error(w->client));
        rc = epd_region_register_device(w->client, p, bytes, 0, &id2);
        CHECK(rc == 0 && id2 != id, "re-registering after release gave %s, region %llu (old %llu)",
              epd_status_name(rc), (unsigned long long)id2, (unsigned long long)id);
        CHECK(epd_region_release(w->client, id2) == 0, "release: %s",
              epd_client_last_error(w->client));
        CU(cudaFree(p));

        /* Stale entry: a cuMem allocation replaced by another at the same address without a
         * release (safe with cuMem: the daemon's imported handle keeps the old memory). */
        {
                CUmemAllocationProp prop;
                CUmemAccessDesc acc;
                CUmemGenericAllocationHandle h;
                CUdeviceptr va;
                size_t gran = 0;
                unsigned long long b1 = 0, b2 = 0;
                uint64_t sz;

                memset(&prop, 0, sizeof(prop));
                prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
                prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                prop.location.id = 0;
                prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
                DRV(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
                sz = gran;
                memset(&acc, 0, sizeof(acc));
                acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                acc.location.id = 0;
                acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                DRV(cuMemAddressReserve(&va, sz, gran, 0, 0));
                DRV(cuMemCreate(&h, sz, &prop, 0));
                DRV(cuMemMap(va, sz, 0, h, 0));
                DRV(cuMemRelease(h));
                DRV(cuMemSetAccess(va, sz, &acc, 1));
                (void)cuPointerGetAttribute(&b1, CU_POINTER_ATTRIBUTE_BUFFER_ID, va);
                rc = epd_region_register_device(w->client, (void *)(uintptr_t)va, sz, 0, &id);
                CHECK(rc == 0, "register cuMem: %s: %s", epd_status_name(rc),
                      epd_client_last_error(w->client));
                DRV(cuMemUnmap(va, sz));
                DRV(cuMemCreate(&h, sz, &prop, 0));
                DRV(cuMemMap(va, sz, 0, h, 0));
                DRV(cuMemRelease(h));
                DRV(cuMemSetAccess(va, sz, &acc, 1));
                (void)cuPointerGetAttribute(&b2, CU_POINTER_ATTRIBUTE_BUFFER_ID, va);
                rc = epd_region_register_device(w->client, (void *)(uintptr_t)va, sz, 0, &id2);
                CHECK(rc == 0, "register the replacement: %s: %s", epd_status_name(rc),
                      epd_client_last_error(w->client));
                if (b1 && b2 && b1 != b2) {
                        CHECK(id2 != id, "the replacement allocation reused stale region %llu",
                              (unsigned long long)id);
                        rc = epd_region_release(w->client, id);
                        CHECK(rc == EPD_NOT_FOUND,
                              "the stale region %llu was not released (release gave %s)",
                              (unsigned long long)id, epd_status_name(rc));
                        printf("stale cuMem entry replaced: region %llu -> %llu\n",
                               (unsigned long long)id, (unsigned long long)id2);
                } else {
                        printf("buffer ids of the remapped cuMem range: %llu, %llu: stale detection not checkable here\n",
                               b1, b2);
                        if (id2 != id)
                                (void)epd_region_release(w->client, id);
                }
                CHECK(epd_region_release(w->client, id2) == 0, "release: %s",
                      epd_client_last_error(w->client));
                DRV(cuMemUnmap(va, sz));
                DRV(cuMemAddressFree(va, sz));
        }
        TRY(alloc_api(w));
        fflush(stdout);
        /* The slabs still work for an op after all that. */
        TRY(run_step(w, 0));
        return worker_close(w);
}

/* A host-backend daemon cannot import GPU memory; libepd says so before touching CUDA. */
static int host_daemon_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w_s, *w = &w_s;
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = sh->socket,
                                       .client_name = "gpu_host_check", .timeout_ms = WAIT_MS };
        char err[512];
        uint64_t id = 0;
        void *p = NULL;
        int rc;

        (void)index;
        memset(w, 0, sizeof(*w));
        w->sh = sh;
        w->c = &sh->gc.c;
        rc = epd_client_connect(&ca, &w->client, err, sizeof(err));
        CHECK(rc == 0, "connect: %s: %s", epd_status_name(rc), err);
        CU(cudaMalloc(&p, 1u << 20));
        rc = epd_region_register_device(w->client, p, 1u << 20, 0, &id);
        CHECK(rc == EPD_UNAVAILABLE, "registering device memory with a host daemon gave %s",
              epd_status_name(rc));
        printf("host daemon: %s\n", epd_client_last_error(w->client));
        fflush(stdout);
        epd_client_free(w->client);
        CU(cudaFree(p));
        return 0;
}

/* ---- the tests ---- */

static void announce(const struct gcase *gc, const char *what)
{
        const struct wl_case *c = &gc->c;

        printf("case %s (%s) seed=%llu ranks=%u layout=%s dtype=%s mem=%s%s%s\n", c->name, what,
               (unsigned long long)c->seed, c->world_size, c->layout == EX ? "EXPAND" : "NON_EXPAND",
               c->dtype == BF ? "bf16" : "fp8", mem_names[gc->mem], c->cached ? " cached" : "",
               gc->repeat ? " repeat" : "");
        fflush(stdout);
}

static const char *const cuda_args[] = { "--backend", "cuda", NULL };

static void daemon_start_with(struct h_daemon *d, const char *const *args)
{
        ck_assert_msg(h_daemon_start(d, args) == 0, "epd --backend cuda did not start");
}

static void daemon_start(struct h_daemon *d)
{
        daemon_start_with(d, cuda_args);
}

static int spawn_and_wait(struct shared *sh, int (*fn)(void *, int), int n)
{
        pid_t pids[MAX_RANKS];

        for (int i = 0; i < n; i++)
                pids[i] = h_spawn(fn, sh, i);
        return h_wait_all(pids, n, CASE_MS);
}

/* Fails the test when workers failed, after showing the daemon's log and stopping the daemon,
 * so that no GPU daemon outlives its test. */
static void expect_ok(struct h_daemon *d, int failures, const char *what, uint64_t seed)
{
        if (!failures)
                return;
        h_daemon_dump_log(d);
        (void)h_daemon_stop(d, 5000);
        ck_abort_msg("%s (seed %llu): %d worker(s) failed", what, (unsigned long long)seed,
                     failures);
}

/* A fresh client runs a small op on the daemon: its GPU context still works. */
static void probe_daemon(struct h_daemon *d, const char *after)
{
        struct shared *sh = shared_new(d, &probe_case);
        char what[96];
        int failures;

        snprintf(sh->group, sizeof(sh->group), "probe_after_%s", after);
        snprintf(what, sizeof(what), "the small op after %s", after);
        failures = spawn_and_wait(sh, matrix_worker, 1);
        munmap(sh, sizeof(*sh));
        expect_ok(d, failures, what, probe_case.c.seed);
}

static void daemon_stop_clean(struct h_daemon *d)
{
        int rc = h_daemon_stop(d, 20000);

        ck_assert_msg(rc == 0, "epd exited with %d", rc);
}

/* One case from start to clean stop: a daemon started with args, `workers` processes running
 * `worker`, every worker passing, and a small op that proves the daemon's context still
 * works; expect_log (or NULL): a text the daemon's log must hold. */
static void run_case_with(const struct gcase *gc, const char *what, const char *label,
                          int (*worker)(void *, int), int workers, const char *const *args,
                          const char *expect_log)
{
        struct h_daemon d;
        struct shared *sh;
        int failures;

        announce(gc, what);
        daemon_start_with(&d, args);
        sh = shared_new(&d, gc);
        failures = spawn_and_wait(sh, worker, workers);
        munmap(sh, sizeof(*sh));
        expect_ok(&d, failures, label, gc->c.seed);
        probe_daemon(&d, label);
        if (expect_log && !h_daemon_log_contains(&d, expect_log)) {
                h_daemon_dump_log(&d);
                (void)h_daemon_stop(&d, 5000);
                ck_abort_msg("%s: the daemon's log does not say '%s'", label, expect_log);
        }
        daemon_stop_clean(&d);
}

static void run_case(const struct gcase *gc, const char *what, const char *label,
                     int (*worker)(void *, int), int workers)
{
        run_case_with(gc, what, label, worker, workers, cuda_args, NULL);
}

START_TEST(test_matrix)
{
        const struct gcase *gc = &matrix[_i];

        run_case(gc, "matrix", gc->c.name, matrix_worker, (int)gc->c.world_size);
}
END_TEST

/* A daemon configured with cuda_graphs = off sends its one-kernel ops (the one-launch dispatch
 * of a small NON_EXPAND op, a one-device combine) as record, launch, record: the outputs are
 * the same bits. Two matrix cases: 8 ranks NON_EXPAND at H 7168 (one launch, sliced combine),
 * 8 ranks EXPAND (combine). */
static const int no_graph_cases[] = { 4, 3 };

START_TEST(test_no_graphs)
{
        static const char *const args[] = { "--backend", "cuda", "--cuda-graphs", "off", NULL };
        const struct gcase *gc = &matrix[no_graph_cases[_i]];
        char label[96];

        snprintf(label, sizeof(label), "%s, cuda_graphs off", gc->c.name);
        run_case_with(gc, "cuda_graphs off", label, matrix_worker, (int)gc->c.world_size, args,
                      "cuda_graphs = off");
}
END_TEST

START_TEST(test_capacity)
{
        run_case(&capacity_case, "CAPACITY_EXCEEDED", "capacity", capacity_worker, 2);
}
END_TEST

START_TEST(test_peer_lost)
{
        struct h_daemon d;
        struct shared *sh;
        pid_t pids[3];
        int status, failures;

        announce(&peer_case, "PEER_LOST");
        daemon_start(&d);
        sh = shared_new(&d, &peer_case);
        for (int r = 0; r < 3; r++)
                pids[r] = h_spawn(peer_first_worker, sh, r);
        if (h_flag_wait(&sh->flag[FLAG_VICTIM_READY], 1, WAIT_MS) < 0 ||
            h_flag_wait(&sh->flag[FLAG_SUBMITTED], 2, WAIT_MS) < 0) {
                for (int r = 0; r < 3; r++)
                        kill(pids[r], SIGKILL);
                h_wait_all(pids, 3, 1000);
                fprintf(stderr, "ops 0-1 did not complete or op 2 was not submitted\n");
                expect_ok(&d, 3, "peer lost", peer_case.c.seed);
        }
        usleep(200000); /* the daemon holds both submissions of op 2 */
        atomic_store(&sh->kill_ms, h_now_ms());
        if (kill(pids[2], SIGKILL) != 0 || waitpid(pids[2], &status, 0) != pids[2]) {
                fprintf(stderr, "cannot kill rank 2 (pid %d)\n", (int)pids[2]);
                kill(pids[0], SIGKILL);
                kill(pids[1], SIGKILL);
                h_wait_all(pids, 2, 1000);
                expect_ok(&d, 1, "peer lost", peer_case.c.seed);
        }
        printf("killed rank 2 (pid %d) while ranks 0 and 1 wait in op 2\n", (int)pids[2]);
        fflush(stdout);
        pids[2] = h_spawn(peer_rejoin_worker, sh, 2);
        failures = h_wait_all(pids, 3, CASE_MS);
        munmap(sh, sizeof(*sh));
        expect_ok(&d, failures, "peer lost", peer_case.c.seed);
        probe_daemon(&d, "peer_lost");
        daemon_stop_clean(&d);
}
END_TEST

/* Stream ordering without host round trips: the inputs are uploaded on the worker's stream,
 * whose inputs_ready doorbell the daemon waits for; the same stream waits for the op's
 * completion doorbell and downloads the outputs. The host never waits for the op before the
 * download is queued, so correct outputs prove both orderings. */
static const struct gcase stream_case = {
        CASE("gpu_stream_order", 741, 2, 16, 2048, 256, 8, BF, I64, NE, 1, 0, 1,
             TD_ROUTING_UNIFORM, 0.0, WL_TOKENS_FULL, 0, 0, 0), MEM_MALLOC, 0
};

static int stream_worker(void *arg, int index)
{
        struct shared *sh = arg;
        struct worker w_s, *w = &w_s;
        struct step st;
        struct outputs o;
        struct epd_dispatch_args da;
        struct epd_op *op = NULL;
        cudaStream_t stream;
        uint8_t *pinned_x = NULL, *pinned_out = NULL;
        uint64_t seq = 0;
        int rc;

        memset(&st, 0, sizeof(st));
        TRY(worker_open(w, sh, (uint32_t)index));
        TRY(step_make(w, &st, 0, 0));
        TRY(build_dispatch(w, &st, (uint64_t)my_rows(w, &st), POISON, &da, &o));
        const struct wl_inputs *in = &st.ins[w->rank];
        uint64_t x_bytes = (uint64_t)in->num_tokens * in->x_stride;
        uint64_t out_bytes = o.bytes[OF_X] + o.bytes[OF_SRC];
        CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        CU(cudaMallocHost((void **)&pinned_x, x_bytes + 1));
        CU(cudaMallocHost((void **)&pinned_out, out_bytes + 1));
        memcpy(pinned_x, in->x, x_bytes);
        /* Spoil x on the device; only the upload queued on the stream repairs it. */
        CU(cudaMemset(o.x_dev, 0x7F, x_bytes));
        CU(cudaDeviceSynchronize());
        CU(cudaMemcpyAsync(o.x_dev, pinned_x, x_bytes, cudaMemcpyHostToDevice, stream));
        rc = epd_group_mark_inputs_ready(w->group, stream, &seq);
        CHECK(rc == 0, "mark inputs ready: %s", epd_client_last_error(w->client));
        da.wait_inputs = seq;
        rc = epd_dispatch_submit(w->group, &da, &op);
        CHECK(rc == 0, "submit: %s", epd_client_last_error(w->client));
        rc = epd_op_stream_wait(op, stream);
        CHECK(rc == 0, "stream wait: %s", epd_client_last_error(w->client));
        CU(cudaMemcpyAsync(pinned_out, o.dev[OF_X], o.bytes[OF_X], cudaMemcpyDeviceToHost, stream));
        CU(cudaMemcpyAsync(pinned_out + o.bytes[OF_X], o.dev[OF_SRC], o.bytes[OF_SRC],
                           cudaMemcpyDeviceToHost, stream));
        CU(cudaStreamSynchronize(stream));
        /* Only now does the host look at the op. */
        rc = epd_op_wait(op, 60000);
        CHECK(rc == 0, "dispatch: %s: %s", epd_status_name(rc), epd_op_error(op));
        struct ref_dispatch_actual act;
        char err[1024];
        memset(&act, 0, sizeof(act));
        act.recv_x = (struct ref_buf){ pinned_out, 0 };
        act.recv_src = (struct ref_buf){ pinned_out + o.bytes[OF_X], 0 };
        CHECK(ref_check_dispatch(st.ref, w->rank, &act, err, sizeof(err)) == 0,
              "outputs read by the stream after epd_op_stream_wait: %s", err);
        printf("rank %u: stream-ordered dispatch verified (inputs_ready %llu, op sequence %llu)\n",
               w->rank, (unsigned long long)seq, (unsigned long long)epd_op_sequence(op));
        fflush(stdout);
        epd_op_free(op);
        cudaFreeHost(pinned_x);
        cudaFreeHost(pinned_out);
        cudaStreamDestroy(stream);
        step_free(&st);
        return worker_close(w);
}

START_TEST(test_stream_order)
{
        run_case(&stream_case, "stream ordering", "stream ordering", stream_worker, 2);
}
END_TEST

START_TEST(test_register_api)
{
        static const char *const host_args[] = { "--backend", "host", NULL };
        struct gcase gc = probe_case;
        struct h_daemon d;
        struct shared *sh;
        int failures;

        gc.c.name = "gpu_register_api";
        gc.mem = MEM_MIXED;
        announce(&gc, "registration API");
        daemon_start(&d);
        sh = shared_new(&d, &gc);
        failures = spawn_and_wait(sh, api_worker, 1);
        munmap(sh, sizeof(*sh));
        expect_ok(&d, failures, "registration API", gc.c.seed);
        probe_daemon(&d, "register_api");
        daemon_stop_clean(&d);

        /* A host-backend daemon: libepd refuses device memory before touching CUDA. */
        ck_assert_msg(h_daemon_start(&d, host_args) == 0, "epd --backend host did not start");
        sh = shared_new(&d, &gc);
        failures = spawn_and_wait(sh, host_daemon_worker, 1);
        munmap(sh, sizeof(*sh));
        expect_ok(&d, failures, "device memory with a host daemon", gc.c.seed);
        daemon_stop_clean(&d);
}
END_TEST

/* Probes for a usable GPU in a child, so this process never initialises CUDA before it forks
 * the daemon and the workers. Returns 0 (usable), 77 (none) or 1 (the probe crashed). */
static int gpu_probe(void)
{
        pid_t pid = fork();
        int status;

        if (pid < 0)
                return 1;
        if (pid == 0) {
                struct cudaDeviceProp prop;
                int n = 0, fd_ok = 0;
                CUdevice dev;
                cudaError_t e = cudaGetDeviceCount(&n);

                if (e != cudaSuccess || n < 1) {
                        printf("gpu_integ: no usable GPU (%s); skipping\n",
                               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
                        fflush(stdout);
                        _exit(77);
                }
                if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
                        _exit(77);
                if (cuDeviceGet(&dev, 0) == CUDA_SUCCESS)
                        cuDeviceGetAttribute(&fd_ok,
                                             CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                             dev);
                printf("gpu_integ: %d GPU(s); device 0 is %s (cc %d.%d), cuMem POSIX fds %s\n", n,
                       prop.name, prop.major, prop.minor, fd_ok ? "supported" : "NOT supported");
                fflush(stdout);
                _exit(0);
        }
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
                return 1;
        return WEXITSTATUS(status);
}

int main(void)
{
        Suite *s = suite_create("gpu_integ");
        TCase *tc = tcase_create("cuda_backend_device_memory");
        SRunner *sr;
        int failed, probe;

        probe = gpu_probe();
        if (probe == 77)
                return 77;
        if (probe != 0) {
                fprintf(stderr, "gpu_integ: the GPU probe failed (status %d)\n", probe);
                return EXIT_FAILURE;
        }
        /* The harness passes --backend from EPD_TEST_BACKEND; the daemons here are GPU ones. */
        setenv("EPD_TEST_BACKEND", "cuda", 1);
        tcase_set_timeout(tc, 600);
        tcase_add_test(tc, test_register_api);
        tcase_add_loop_test(tc, test_matrix, 0, (int)(sizeof(matrix) / sizeof(matrix[0])));
        tcase_add_loop_test(tc, test_no_graphs, 0,
                            (int)(sizeof(no_graph_cases) / sizeof(no_graph_cases[0])));
        tcase_add_test(tc, test_capacity);
        tcase_add_test(tc, test_peer_lost);
        tcase_add_test(tc, test_stream_order);
        suite_add_tcase(s, tc);
        sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
