/* integ_resize.c - `epctl resize` (DESIGN.md section 7) against the real epd binary: growing and
 * shrinking a group's output arenas while its clients keep working.
 *
 * - resize_under_load: 8 worker processes loop dispatch (use_arena) and combine, every output
 *   checked bitwise against the independent reference, each keeping the previous dispatch's
 *   handle alive (and its outputs checked again) across the next dispatch, while the test runs
 *   `epctl resize` 10 times, growing and shrinking; no op fails, nothing mismatches, and the
 *   arena base a client sees never moves.
 * - resize_segments: one process, world size 1: outputs placed in a grown segment (and across
 *   the boundary of two) are right, also as combine's y written in place; a shrink stops above
 *   live outputs; a shrink below the segment boundary drops the segment, which the client
 *   unmaps after its next dispatch; a grow after that maps new memory at the same address.
 * - resize_waits_for_executing_op: the resize is answered only after the op executing finishes.
 * - resize_edges: unknown group, invalid sizes, max_arena_bytes, max_arena_segments (nothing
 *   changes when a grow is refused), resizing by id, within the mapped segments, and a resize
 *   of a drained group leaves it drained.
 *
 * Runs as root or as a member of the daemon's admin_group (configured here when not root).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "harness.h"
#include "workload.h"

#define KiB 1024ull
#define MiB (1024ull * 1024ull)
#define MAX_R 8

/* ---- daemon and epctl ---- */

static char config_path[PATH_MAX];

/* Starts a daemon in which this process is an admin (root, or through admin_group), with
 * `extra` config lines in [daemon]. */
static void daemon_start(struct h_daemon *d, const char *extra)
{
        const char *args[4] = { NULL };
        FILE *f;

        snprintf(config_path, sizeof(config_path), "/tmp/epd-resize-test-%d.conf", (int)getpid());
        f = fopen(config_path, "we");
        ck_assert_msg(f != NULL, "cannot write %s", config_path);
        fprintf(f, "[daemon]\n");
        if (geteuid() != 0) {
                struct group *gr = getgrgid(getegid());
                ck_assert_msg(gr != NULL, "no name for group %u", (unsigned)getegid());
                fprintf(f, "admin_group = %s\n", gr->gr_name);
        }
        fputs(extra ? extra : "", f); /* last: it may open other sections */
        fclose(f);
        args[0] = "--config";
        args[1] = config_path;
        ck_assert_int_eq(h_daemon_start(d, args), 0);
        unlink(config_path);
}

/* Runs epctl with args (NULL-terminated, without --socket), stdout and stderr into out.
 * Returns its exit status. */
static int epctl(const struct h_daemon *d, const char *const *args, char *out, size_t out_len)
{
        char path[PATH_MAX];
        const char *argv[16];
        int pipefd[2], argc = 0, status;
        size_t used = 0;
        pid_t pid;

        snprintf(path, sizeof(path), "%s/epctl", h_bin_dir());
        argv[argc++] = path;
        argv[argc++] = "--socket";
        argv[argc++] = d->socket;
        for (int i = 0; args[i] && argc < 15; i++)
                argv[argc++] = args[i];
        argv[argc] = NULL;
        ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                dup2(pipefd[1], STDOUT_FILENO);
                dup2(pipefd[1], STDERR_FILENO);
                execv(argv[0], (char *const *)argv);
                _exit(127);
        }
        close(pipefd[1]);
        for (;;) {
                ssize_t n = read(pipefd[0], out + used, out_len - used - 1);
                if (n <= 0)
                        break;
                used += (size_t)n;
                if (used + 1 >= out_len)
                        break;
        }
        out[used] = '\0';
        close(pipefd[0]);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* `epctl resize GROUP --bytes SIZE --json`, which must succeed; returns the parsed reply. */
static json_t *resize_ok(const struct h_daemon *d, const char *group, const char *size)
{
        static char out[64 * 1024];
        const char *args[] = { "resize", group, "--bytes", size, "--json", NULL };
        json_error_t jerr;
        json_t *j;
        int rc = epctl(d, args, out, sizeof(out));

        ck_assert_msg(rc == 0, "epctl resize %s --bytes %s exited with %d: %s", group, size, rc,
                      out);
        j = json_loads(out, 0, &jerr);
        ck_assert_msg(j != NULL, "epctl resize --json printed invalid JSON (%s): %s", jerr.text,
                      out);
        return j;
}

static uint64_t jnum(const json_t *o, const char *key)
{
        const json_t *v = json_object_get(o, key);

        ck_assert_msg(json_is_integer(v), "no integer %s", key);
        return (uint64_t)json_integer_value(v);
}

static const json_t *jrank(const json_t *reply, size_t i)
{
        const json_t *ranks = json_object_get(reply, "ranks");

        ck_assert_msg(json_is_array(ranks) && i < json_array_size(ranks), "no rank %zu", i);
        return json_array_get(ranks, i);
}

/* A number of rank `rank` of group `name` in `epctl stats --json`. */
static uint64_t stats_rank(const struct h_daemon *d, const char *name, uint32_t rank,
                           const char *key)
{
        static char out[256 * 1024];
        const char *args[] = { "stats", "--json", NULL };
        json_error_t jerr;
        json_t *j, *g;
        uint64_t bytes = 0;
        size_t i;

        ck_assert_int_eq(epctl(d, args, out, sizeof(out)), 0);
        j = json_loads(out, 0, &jerr);
        ck_assert_msg(j != NULL, "invalid JSON: %s", jerr.text);
        json_array_foreach(json_object_get(j, "groups"), i, g)
        {
                if (strcmp(json_string_value(json_object_get(g, "name")), name) == 0)
                        bytes = jnum(json_array_get(json_object_get(g, "ranks"), rank), key);
        }
        json_decref(j);
        return bytes;
}

/* Rank 0's arena bytes of group `name`. */
static uint64_t stats_arena_bytes(const struct h_daemon *d, const char *name)
{
        return stats_rank(d, name, 0, "arena_bytes");
}

/* The permissions of the mapping holding addr in /proc/self/maps ("rw-s", "---p"), or "". */
static const char *mapping_perms(const void *addr)
{
        static char perms[8];
        char line[512];
        FILE *f = fopen("/proc/self/maps", "re");

        perms[0] = '\0';
        while (f && fgets(line, sizeof(line), f)) {
                unsigned long lo, hi;
                char p[8];
                if (sscanf(line, "%lx-%lx %7s", &lo, &hi, p) == 3 && (uintptr_t)addr >= lo &&
                    (uintptr_t)addr < hi) {
                        snprintf(perms, sizeof(perms), "%s", p);
                        break;
                }
        }
        if (f)
                fclose(f);
        return perms;
}

/* ---- one MoE step with the arena, checked against the reference ---- */

/* A client region for one rank's inputs, y and combine outputs, reused by every step. */
struct io {
        uint8_t *base;
        uint64_t bytes, region_id;
};

/* A dispatch whose handle is alive: its inputs (which the reference reads) and outputs. */
struct step {
        int live;
        int number;
        uint32_t world_size;
        struct wl_inputs ins[MAX_R];
        struct ref_src srcs[MAX_R];
        struct ref_dispatch *ref;
        struct ref_dispatch_actual act;
        uint64_t handle;
        struct epd_tensor recv_x;
        void *recv_x_ptr;
};

static void step_free(struct step *st)
{
        st->ref = ref_dispatch_free(st->ref);
        for (uint32_t s = 0; s < st->world_size; s++)
                wl_inputs_free(&st->ins[s]);
        st->live = 0;
}

static struct epd_tensor tensor_in(const struct io *io, const void *ptr, enum epd_dtype dt,
                                   uint64_t rows, uint64_t cols)
{
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        t.dtype = dt;
        t.ndim = cols ? 2 : 1;
        t.sizes[0] = rows;
        t.sizes[1] = cols;
        t.region_id = io->region_id;
        t.offset = (uint64_t)((const uint8_t *)ptr - io->base);
        return t;
}

static int io_alloc(struct epd_client *cl, const struct wl_case *c, struct io *io)
{
        uint64_t T = c->max_tokens, H = c->hidden, K = c->num_topk;
        void *base;

        /* x, topk, weights; y for every row this rank can receive; combined and its weights. */
        io->bytes = T * H * 2 + T * K * 8 + T * K * 4 + (uint64_t)c->world_size * T * H * 2 +
                    T * H * 2 + T * K * 4 + 64 * KiB;
        if (epd_region_alloc(cl, io->bytes, &base, &io->region_id) < 0)
                return -1;
        io->base = base;
        return 0;
}

/* Where things live in the io region. */
static uint8_t *io_x(const struct wl_case *c, const struct io *io)
{
        (void)c;
        return io->base;
}

static uint8_t *io_topk(const struct wl_case *c, const struct io *io)
{
        return io_x(c, io) + (uint64_t)c->max_tokens * c->hidden * 2;
}

static uint8_t *io_weights(const struct wl_case *c, const struct io *io)
{
        return io_topk(c, io) + (uint64_t)c->max_tokens * c->num_topk * 8;
}

static uint8_t *io_y(const struct wl_case *c, const struct io *io)
{
        return io_weights(c, io) + (uint64_t)c->max_tokens * c->num_topk * 4 + 4 * KiB;
}

static uint8_t *io_combined(const struct wl_case *c, const struct io *io)
{
        return io_y(c, io) + (uint64_t)c->world_size * c->max_tokens * c->hidden * 2 + 4 * KiB;
}

static uint8_t *io_cw(const struct wl_case *c, const struct io *io)
{
        return io_combined(c, io) + (uint64_t)c->max_tokens * c->hidden * 2 + 4 * KiB;
}

/* Every token of `in` (full, contiguous) into io's x and int64 topk_idx. */
static void io_fill(const struct wl_case *c, const struct io *io, const struct wl_inputs *in)
{
        memcpy(io_x(c, io), in->x, (size_t)c->max_tokens * c->hidden * 2);
        memcpy(io_topk(c, io), in->topk, (size_t)c->max_tokens * c->num_topk * 8);
}

/* Submits a use_arena dispatch of io's x and topk_idx (max_tokens tokens, no weights). */
static int io_submit(const struct wl_case *c, const struct io *io, struct epd_group *g,
                     uint64_t wait_inputs, struct epd_op **op)
{
        struct epd_dispatch_args da = {
                .size = sizeof(da), .num_tokens = c->max_tokens, .num_topk = c->num_topk,
                .use_arena = 1, .wait_inputs = wait_inputs,
        };

        da.x = tensor_in(io, io_x(c, io), EPD_DTYPE_BF16, c->max_tokens, c->hidden);
        da.topk_idx = tensor_in(io, io_topk(c, io), EPD_DTYPE_INT64, c->max_tokens, c->num_topk);
        return epd_dispatch_submit(g, &da, op);
}

/* Dispatch number `number` of case c on `rank` with use_arena: every source's inputs and the
 * reference, this rank's inputs copied into io, the outputs and counts checked. The arena
 * base must be `base` and the outputs inside the arena. 0, or -1 with msg. */
static int step_dispatch(struct epd_client *cl, struct epd_group *g, const struct wl_case *c, uint32_t rank,
                         const struct io *io, int number, const uint8_t *base, struct step *st,
                         char *msg, size_t msg_len)
{
        uint32_t R = c->world_size, K = c->num_topk, H = c->hidden;
        struct ref_params params;
        struct epd_op *op = NULL;
        struct epd_dispatch_result dr;
        uint64_t arena_bytes;
        char err[512];
        int rc;

        memset(st, 0, sizeof(*st));
        st->number = number;
        st->world_size = R;
        for (uint32_t s = 0; s < R; s++) {
                if (wl_inputs_make(c, s, number, 0, &st->ins[s]) < 0) {
                        snprintf(msg, msg_len, "out of memory");
                        return -1;
                }
                st->srcs[s] = (struct ref_src){
                        .num_tokens = st->ins[s].num_tokens,
                        .x = { st->ins[s].x, st->ins[s].x_stride },
                        .topk_idx = { st->ins[s].topk, 0 },
                        .weights = { st->ins[s].weights, 0 },
                };
        }
        st->live = 1;
        wl_ref_params(c, &params);
        if (ref_dispatch_new(&params, st->srcs, &st->ref, err, sizeof(err)) < 0) {
                snprintf(msg, msg_len, "reference: %s", err);
                return -1;
        }
        uint32_t n = st->ins[rank].num_tokens;
        for (uint32_t t = 0; t < n; t++)
                memcpy(io_x(c, io) + (uint64_t)t * H * 2,
                       st->ins[rank].x + t * st->ins[rank].x_stride, (size_t)H * 2);
        memcpy(io_topk(c, io), st->ins[rank].topk, (size_t)n * K * 8);
        memcpy(io_weights(c, io), st->ins[rank].weights, (size_t)n * K * 4);
        struct epd_dispatch_args da = {
                .size = sizeof(da), .num_tokens = n, .num_topk = K, .layout = c->layout,
                .use_arena = 1,
        };
        da.x = tensor_in(io, io_x(c, io), EPD_DTYPE_BF16, n, H);
        da.topk_idx = tensor_in(io, io_topk(c, io), EPD_DTYPE_INT64, n, K);
        da.topk_weights = tensor_in(io, io_weights(c, io), EPD_DTYPE_FP32, n, K);
        rc = epd_dispatch(g, &da, &op);
        if (rc < 0) {
                snprintf(msg, msg_len, "dispatch %d: %s: %s", number, epd_status_name(rc),
                         epd_client_last_error(cl));
                return -1;
        }
        rc = epd_op_dispatch_result(op, &dr);
        if (rc < 0) {
                snprintf(msg, msg_len, "dispatch %d result: %s: %s", number, epd_status_name(rc),
                         epd_client_last_error(cl));
                epd_op_free(op);
                return -1;
        }
        st->handle = dr.handle_id;
        st->recv_x = dr.recv_x;
        st->recv_x_ptr = dr.recv_x_ptr;
        st->act = (struct ref_dispatch_actual){
                .recv_x = { dr.recv_x_ptr, 0 },
                .recv_topk_idx = { dr.recv_topk_idx_ptr, 0 },
                .recv_weights = { dr.recv_weights_ptr, 0 },
                .recv_src = { dr.recv_src_ptr, 0 },
        };
        struct ref_counts_actual counts = {
                dr.num_recv_tokens, dr.num_expanded_rows, dr.num_recv_tokens_per_expert,
                dr.num_recv_tokens_per_expert_aligned, dr.rank_prefix,
        };
        rc = ref_check_counts(st->ref, rank, &counts, err, sizeof(err));
        if (rc == 0)
                rc = ref_check_dispatch(st->ref, rank, &st->act, err, sizeof(err));
        epd_op_free(op);
        if (rc != 0) {
                snprintf(msg, msg_len, "dispatch %d outputs: %s", number, err);
                return -1;
        }
        uint8_t *now = epd_group_arena(g, &arena_bytes);
        if (now != base) {
                snprintf(msg, msg_len, "dispatch %d: the arena moved from %p to %p", number,
                         (const void *)base, (void *)now);
                return -1;
        }
        if (st->ref->dst[rank].rows > 0 &&
            ((uint8_t *)dr.recv_x_ptr < base ||
             dr.recv_x.offset + (uint64_t)st->ref->dst[rank].rows * H * 2 > arena_bytes ||
             (uint8_t *)dr.recv_x_ptr != base + dr.recv_x.offset)) {
                snprintf(msg, msg_len, "dispatch %d: recv_x at offset %llu outside the %llu-byte arena",
                         number, (unsigned long long)dr.recv_x.offset,
                         (unsigned long long)arena_bytes);
                return -1;
        }
        return 0;
}

/* Checks a live step's dispatch outputs again (they must survive resizes). */
static int step_recheck(const struct step *st, uint32_t rank, char *msg, size_t msg_len)
{
        char err[512];

        if (ref_check_dispatch(st->ref, rank, &st->act, err, sizeof(err)) != 0) {
                snprintf(msg, msg_len, "dispatch %d outputs changed later: %s", st->number, err);
                return -1;
        }
        return 0;
}

/* Combine of a live step: the stand-in expert's y (a seeded function of the step and the
 * destination) in io, or written in place over recv_x in the arena; combined checked. */
static int step_combine(struct epd_client *cl, struct epd_group *g, const struct wl_case *c, uint32_t rank,
                        const struct io *io, struct step *st, int y_in_place, char *msg,
                        size_t msg_len)
{
        uint32_t R = c->world_size, H = c->hidden, K = c->num_topk;
        uint16_t *ys[MAX_R] = { NULL };
        struct ref_buf ybufs[MAX_R];
        uint32_t n = st->ins[rank].num_tokens;
        int64_t my_rows = st->ref->dst[rank].rows;
        struct epd_combine_result cr;
        char err[512];
        int rc = -1;

        for (uint32_t d = 0; d < R; d++) {
                struct td_rng rng;
                int64_t rows = st->ref->dst[d].rows;
                ys[d] = malloc((size_t)rows * H * 2 + 2);
                if (!ys[d]) {
                        snprintf(msg, msg_len, "out of memory");
                        goto out;
                }
                td_rng_seed(&rng, td_mix_seed(c->seed, 9000000 + d * 100 + (uint64_t)st->number));
                td_fill_bf16(&rng, ys[d], (uint64_t)rows, H, 0, 0.0);
                ybufs[d] = (struct ref_buf){ ys[d], 0 };
        }
        struct epd_combine_args cb = { .size = sizeof(cb), .handle_id = st->handle,
                                       .apply_weights = c->apply_weights };
        if (y_in_place) {
                /* The expert writes its output over its input rows in the arena. */
                memcpy(st->recv_x_ptr, ys[rank], (size_t)my_rows * H * 2);
                cb.y = st->recv_x;
        } else {
                memcpy(io_y(c, io), ys[rank], (size_t)my_rows * H * 2);
                cb.y = tensor_in(io, io_y(c, io), EPD_DTYPE_BF16, (uint64_t)my_rows, H);
        }
        memset(io_combined(c, io), 0xEE, (size_t)n * H * 2);
        cb.combined = tensor_in(io, io_combined(c, io), EPD_DTYPE_BF16, n, H);
        cb.combined_topk_weights = tensor_in(io, io_cw(c, io), EPD_DTYPE_FP32, n, K);
        rc = epd_combine(g, &cb, &cr);
        if (rc < 0) {
                snprintf(msg, msg_len, "combine %d: %s: %s", st->number, epd_status_name(rc),
                         epd_client_last_error(cl));
                rc = -1;
                goto out;
        }
        struct ref_combine_in cin = { ybufs, c->apply_weights };
        struct ref_buf bias[2] = { { NULL, 0 }, { NULL, 0 } };
        rc = ref_check_combine(st->ref, &cin, rank, bias,
                               (struct ref_buf){ io_combined(c, io), 0 },
                               (struct ref_buf){ io_cw(c, io), 0 }, err, sizeof(err));
        if (rc != 0) {
                snprintf(msg, msg_len, "combine %d outputs: %s", st->number, err);
                rc = -1;
        }
out:
        for (uint32_t d = 0; d < R; d++)
                free(ys[d]);
        return rc;
}

/* ---- resize under load ---- */

/* 8 ranks, 16 experts, H 256, T 16, top-2 with weights: at most 128 rows of ~544 bytes per
 * rank, about 70 KiB per placement. Two placements are alive at a time (the previous handle and
 * the new dispatch), so 256 KiB always fits them, whatever the fragmentation. */
static const struct wl_case load_case = {
        .name = "resize_load", .seed = 4242, .world_size = 8, .num_experts = 16, .hidden = 256,
        .max_tokens = 16, .num_topk = 2, .dtype = EPD_DTYPE_BF16, .topk_dtype = EPD_DTYPE_INT64,
        .layout = EPD_LAYOUT_NON_EXPAND, .has_weights = 1, .routing = TD_ROUTING_UNIFORM,
        .minus_one_prob = 0.1, .tokens = WL_TOKENS_DESCENDING, .apply_weights = 0, .use_arena = 1,
        .arena_bytes = 256 * KiB,
};

struct shared {
        const char *socket;
        atomic_int stop_at;           /* 0: run on; else the step at which every worker stops */
        atomic_int steps[MAX_R];      /* steps begun per worker */
        atomic_long ops_ok;           /* dispatches and combines completed and verified */
        atomic_int failures;          /* workers that failed (details on stderr) */
        atomic_int base_moved;
        atomic_long sizes_seen;       /* arena size changes a worker saw between dispatches */
};

static int load_worker(void *arg, int index)
{
        struct shared *sh = arg;
        const struct wl_case *c = &load_case;
        uint32_t rank = (uint32_t)index;
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = sh->socket,
                                       .client_name = "resize-worker", .timeout_ms = 60000 };
        struct epd_group_config gcfg = {
                .size = sizeof(gcfg), .world_size = c->world_size, .num_experts = c->num_experts,
                .hidden = c->hidden, .max_tokens_per_rank = c->max_tokens, .max_topk = c->num_topk,
                .dispatch_dtype = c->dtype, .op_timeout_ms = 60000, .arena_bytes = c->arena_bytes,
        };
        struct epd_client *cl = NULL;
        struct epd_group *g = NULL;
        static struct step steps[2];
        struct io io;
        char err[1024], msg[1024];
        uint64_t last_bytes;
        int rc = 1, step = 0;

        if (epd_client_connect(&ca, &cl, err, sizeof(err)) < 0) {
                fprintf(stderr, "rank %u: connect: %s\n", rank, err);
                goto out;
        }
        if (wl_enter_group(cl, "stress", rank, &gcfg, &g) < 0) {
                fprintf(stderr, "rank %u: enter: %s\n", rank, epd_client_last_error(cl));
                goto out;
        }
        if (io_alloc(cl, c, &io) < 0) {
                fprintf(stderr, "rank %u: region: %s\n", rank, epd_client_last_error(cl));
                goto out;
        }
        uint8_t *base = epd_group_arena(g, &last_bytes);
        for (step = 0;; step++) {
                struct step *cur = &steps[step % 2], *prev = &steps[(step + 1) % 2];
                int stop = atomic_load(&sh->stop_at);
                uint64_t bytes;

                if (stop && step >= stop)
                        break;
                atomic_store(&sh->steps[rank], step + 1);
                if (step_dispatch(cl, g, c, rank, &io, step, base, cur, msg, sizeof(msg)) < 0)
                        goto fail;
                atomic_fetch_add(&sh->ops_ok, 1);
                if (epd_group_arena(g, &bytes) != base)
                        atomic_fetch_add(&sh->base_moved, 1);
                if (bytes != last_bytes) {
                        atomic_fetch_add(&sh->sizes_seen, 1);
                        last_bytes = bytes;
                }
                /* The previous handle lived through this dispatch, and maybe a resize. */
                if (prev->live) {
                        if (step_recheck(prev, rank, msg, sizeof(msg)) < 0)
                                goto fail;
                        if (epd_handle_release(g, prev->handle) < 0) {
                                snprintf(msg, sizeof(msg), "release: %s",
                                         epd_client_last_error(cl));
                                goto fail;
                        }
                        step_free(prev);
                }
                if (step_combine(cl, g, c, rank, &io, cur, 0, msg, sizeof(msg)) < 0)
                        goto fail;
                atomic_fetch_add(&sh->ops_ok, 1);
        }
        rc = 0;
        goto out;
fail:
        fprintf(stderr, "[resize_load seed=%llu rank=%u step=%d] %s\n",
                (unsigned long long)c->seed, rank, step, msg);
        atomic_fetch_add(&sh->failures, 1);
out:
        for (int i = 0; i < 2; i++)
                if (steps[i].live)
                        step_free(&steps[i]);
        epd_group_leave(g);
        epd_client_free(cl);
        return rc;
}

static int max_step(struct shared *sh)
{
        int m = 0;

        for (int i = 0; i < MAX_R; i++)
                if (atomic_load(&sh->steps[i]) > m)
                        m = atomic_load(&sh->steps[i]);
        return m;
}

static long long ms_now(void)
{
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits until the workers completed `ops` more ops than `from`, or a worker failed. */
static void wait_ops(struct shared *sh, long from, long ops)
{
        long long deadline = ms_now() + 30000;

        while (atomic_load(&sh->ops_ok) < from + ops && !atomic_load(&sh->failures)) {
                ck_assert_msg(ms_now() < deadline, "workers made no progress for 30 s (%ld ops)",
                              atomic_load(&sh->ops_ok) - from);
                usleep(2000);
        }
}

START_TEST(test_resize_under_load)
{
        static const char *const sizes[] = { "1M", "256K", "2M", "300K", "4M",
                                             "256K", "768K", "256K", "3M", "256K" };
        static const uint64_t bytes[] = { 1 * MiB, 256 * KiB, 2 * MiB, 300 * KiB, 4 * MiB,
                                          256 * KiB, 768 * KiB, 256 * KiB, 3 * MiB, 256 * KiB };
        struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        struct h_daemon d;
        pid_t pids[MAX_R];
        int waited = 0;

        ck_assert_ptr_ne(sh, MAP_FAILED);
        memset(sh, 0, sizeof(*sh));
        daemon_start(&d, NULL);
        sh->socket = d.socket;
        for (int i = 0; i < MAX_R; i++)
                pids[i] = h_spawn(load_worker, sh, i);
        wait_ops(sh, 0, 4 * MAX_R);
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
                long before = atomic_load(&sh->ops_ok);
                json_t *r = resize_ok(&d, "stress", sizes[i]);
                ck_assert_uint_eq(jnum(r, "requested_bytes"), bytes[i]);
                ck_assert_uint_eq(jnum(r, "new_bytes"), bytes[i]);
                ck_assert_uint_eq(json_array_size(json_object_get(r, "ranks")), MAX_R);
                for (size_t k = 0; k < MAX_R; k++)
                        /* Two live placements of at most ~70 KiB never hold a shrink up. */
                        ck_assert_uint_eq(jnum(jrank(r, k), "new_bytes"), bytes[i]);
                json_decref(r);
                /* Ops keep flowing between resizes: each one lands in the middle of the load. */
                wait_ops(sh, before, 6 * MAX_R);
        }
        ck_assert_uint_eq(stats_arena_bytes(&d, "stress"), 256 * KiB);
        /* How many resizes found an op executing (and waited for it), from the daemon's log. */
        FILE *log = fopen(d.log, "re");
        char line[1024];
        while (log && fgets(line, sizeof(line), log))
                waited += strstr(line, "group resize requested") && strstr(line, "executing=1");
        if (log)
                fclose(log);
        atomic_store(&sh->stop_at, max_step(sh) + 3);
        ck_assert_int_eq(h_wait_all(pids, MAX_R, 60000), 0);
        ck_assert_int_eq(atomic_load(&sh->failures), 0);
        ck_assert_int_eq(atomic_load(&sh->base_moved), 0);
        /* Every client followed the resizes through its dispatch replies. */
        ck_assert_msg(atomic_load(&sh->sizes_seen) >= 5 * MAX_R,
                      "the clients saw only %ld arena size changes",
                      atomic_load(&sh->sizes_seen));
        fprintf(stderr, "resize_under_load: %ld verified ops across 10 resizes, %d of which waited for an executing op\n",
                atomic_load(&sh->ops_ok), waited);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
        munmap(sh, sizeof(*sh));
}
END_TEST

/* ---- one process: segments ---- */

/* World size 1, every token routed: 64 rows of 544 bytes per dispatch, one 34816-byte
 * extent (x 32768, topk_idx 1024, weights 512, src 512). */
static const struct wl_case seg_case = {
        .name = "resize_segments", .seed = 77, .world_size = 1, .num_experts = 4, .hidden = 256,
        .max_tokens = 64, .num_topk = 2, .dtype = EPD_DTYPE_BF16, .topk_dtype = EPD_DTYPE_INT64,
        .layout = EPD_LAYOUT_NON_EXPAND, .has_weights = 1, .routing = TD_ROUTING_UNIFORM,
        .minus_one_prob = 0.0, .tokens = WL_TOKENS_FULL, .apply_weights = 0, .use_arena = 1,
        .arena_bytes = 128 * KiB,
};
#define EXTENT 34816u

struct solo {
        struct epd_client *cl;
        struct epd_group *g;
        struct io io;
        uint8_t *base;
        int next;
};

static void solo_enter(struct solo *s, const struct h_daemon *d, const char *name,
                       const struct wl_case *c)
{
        struct epd_group_config gcfg = {
                .size = sizeof(gcfg), .world_size = 1, .num_experts = c->num_experts,
                .hidden = c->hidden, .max_tokens_per_rank = c->max_tokens,
                .max_topk = c->num_topk, .dispatch_dtype = c->dtype, .op_timeout_ms = 60000,
                .arena_bytes = c->arena_bytes,
        };
        uint64_t bytes;

        memset(s, 0, sizeof(*s));
        s->cl = h_connect(d, name);
        ck_assert_ptr_nonnull(s->cl);
        ck_assert_int_eq(wl_enter_group(s->cl, name, 0, &gcfg, &s->g), EPD_OK);
        ck_assert_int_eq(io_alloc(s->cl, c, &s->io), 0);
        s->base = epd_group_arena(s->g, &bytes);
        ck_assert_ptr_nonnull(s->base);
        ck_assert_uint_eq(bytes, c->arena_bytes);
}

static void solo_dispatch(struct solo *s, const struct wl_case *c, struct step *st)
{
        char msg[1024];

        ck_assert_msg(step_dispatch(s->cl, s->g, c, 0, &s->io, s->next++, s->base, st, msg,
                                    sizeof(msg)) == 0,
                      "%s", msg);
}

static void solo_release(struct solo *s, struct step *st)
{
        ck_assert_int_eq(epd_handle_release(s->g, st->handle), EPD_OK);
        step_free(st);
}

static uint64_t solo_bytes(struct solo *s)
{
        uint64_t bytes;

        ck_assert_ptr_eq(epd_group_arena(s->g, &bytes), s->base);
        return bytes;
}

static void solo_leave(struct solo *s)
{
        epd_group_leave(s->g);
        epd_client_free(s->cl);
}

START_TEST(test_resize_segments)
{
        const struct wl_case *c = &seg_case;
        static struct step st[16];
        struct h_daemon d;
        struct solo s;
        char msg[1024];
        json_t *r;

        daemon_start(&d, NULL);
        solo_enter(&s, &d, "seg", c);
        /* Three extents fill the first segment (a fourth would not fit in 128 KiB). */
        for (int i = 0; i < 3; i++) {
                solo_dispatch(&s, c, &st[i]);
                ck_assert_uint_eq(st[i].recv_x.offset, (uint64_t)i * EXTENT);
        }

        r = resize_ok(&d, "seg", "1M");
        ck_assert_uint_eq(jnum(r, "old_bytes"), 128 * KiB);
        ck_assert_uint_eq(jnum(jrank(r, 0), "new_bytes"), 1 * MiB);
        ck_assert_uint_eq(jnum(jrank(r, 0), "segments"), 2);
        ck_assert_uint_eq(jnum(jrank(r, 0), "used_bytes"), 3 * EXTENT);
        json_decref(r);
        /* The client learns of the new segment from the next reply: the fourth extent
         * straddles the two segments, the next ones lie in the new one. */
        for (int i = 3; i < 8; i++) {
                solo_dispatch(&s, c, &st[i]);
                ck_assert_uint_eq(st[i].recv_x.offset, (uint64_t)i * EXTENT);
        }
        ck_assert_uint_eq(solo_bytes(&s), 1 * MiB);
        ck_assert_str_eq(mapping_perms(s.base + 200 * KiB), "rw-s");
        /* The expert writes y in place in the new segment: the daemon's bounds check of the
         * arena region sees the new size. */
        ck_assert_msg(step_combine(s.cl, s.g, c, 0, &s.io, &st[7], 1, msg, sizeof(msg)) == 0, "%s",
                      msg);
        for (int i = 0; i < 7; i++)
                ck_assert_msg(step_recheck(&st[i], 0, msg, sizeof(msg)) == 0, "%s", msg);

        /* Live outputs end at 8 extents: a shrink stops there. */
        r = resize_ok(&d, "seg", "64K");
        ck_assert_uint_eq(jnum(r, "new_bytes"), 64 * KiB);
        ck_assert_uint_eq(jnum(jrank(r, 0), "new_bytes"), 8 * EXTENT);
        ck_assert_uint_eq(jnum(jrank(r, 0), "segments"), 2);
        json_decref(r);
        for (int i = 0; i < 7; i++)
                ck_assert_msg(step_recheck(&st[i], 0, msg, sizeof(msg)) == 0, "%s", msg);
        for (int i = 0; i < 8; i++)
                solo_release(&s, &st[i]);

        /* Nothing live: the shrink reaches 64 KiB and drops the segment above 128 KiB (the
         * first one stays whole). The client unmaps it after its next dispatch. */
        r = resize_ok(&d, "seg", "64K");
        ck_assert_uint_eq(jnum(jrank(r, 0), "new_bytes"), 64 * KiB);
        ck_assert_uint_eq(jnum(jrank(r, 0), "segments"), 1);
        json_decref(r);
        ck_assert_str_eq(mapping_perms(s.base + 200 * KiB), "rw-s");
        solo_dispatch(&s, c, &st[8]);
        ck_assert_uint_eq(st[8].recv_x.offset, 0);
        ck_assert_uint_eq(solo_bytes(&s), 64 * KiB);
        ck_assert_str_eq(mapping_perms(s.base + 200 * KiB), "---p");
        ck_assert_uint_eq(stats_arena_bytes(&d, "seg"), 64 * KiB);

        /* Grow again: new memory at the same addresses, used across the old boundary. */
        r = resize_ok(&d, "seg", "512K");
        ck_assert_uint_eq(jnum(jrank(r, 0), "segments"), 2);
        json_decref(r);
        for (int i = 9; i < 13; i++) {
                solo_dispatch(&s, c, &st[i]);
                ck_assert_uint_eq(st[i].recv_x.offset, (uint64_t)(i - 8) * EXTENT);
        }
        ck_assert_str_eq(mapping_perms(s.base + 200 * KiB), "rw-s");
        ck_assert_msg(step_combine(s.cl, s.g, c, 0, &s.io, &st[12], 0, msg, sizeof(msg)) == 0, "%s",
                      msg);
        for (int i = 8; i < 13; i++) {
                ck_assert_msg(step_recheck(&st[i], 0, msg, sizeof(msg)) == 0, "%s", msg);
                solo_release(&s, &st[i]);
        }
        ck_assert_uint_eq(stats_arena_bytes(&d, "seg"), 512 * KiB);
        solo_leave(&s);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

/* ---- the resize waits for the executing op ---- */

START_TEST(test_resize_waits_for_executing_op)
{
        const struct wl_case *c = &seg_case;
        char path[PATH_MAX], out[4096];
        struct h_daemon d;
        struct solo s;
        struct step st;
        struct epd_op *op = NULL;
        int status;

        daemon_start(&d, NULL);
        solo_enter(&s, &d, "busy", c);
        /* An op that executes until its inputs are marked ready. */
        memset(&st, 0, sizeof(st));
        st.world_size = 1;
        ck_assert_int_eq(wl_inputs_make(c, 0, 0, 0, &st.ins[0]), 0);
        io_fill(c, &s.io, &st.ins[0]);
        ck_assert_int_eq(io_submit(c, &s.io, s.g, 1, &op), EPD_OK);
        ck_assert_int_eq(epd_op_wait(op, 200), EPD_TIMEOUT);

        snprintf(path, sizeof(path), "/tmp/epd-resize-out-%d", (int)getpid());
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                const char *args[] = { "--socket", d.socket, "resize", "busy", "--bytes", "1M",
                                       "--json", NULL };
                int rc = h_run_tool("epctl", args, out, sizeof(out));
                FILE *f = fopen(path, "we");
                if (f) {
                        fputs(out, f);
                        fclose(f);
                }
                _exit(rc);
        }
        /* epctl needs time to start and send the resize (about 0.2 s under the sanitizers on
         * two busy cores, where a 0.4 s pause left the resize waiting only 0.23 s); 1.5 s leaves
         * it well over the 0.3 s that the check below asks of the wait. */
        usleep(1500 * 1000);
        ck_assert_int_eq(waitpid(pid, &status, WNOHANG), 0); /* still waiting for the op */
        ck_assert_int_eq(epd_group_mark_inputs_ready_host(s.g, NULL), EPD_OK);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "epctl resize failed");
        FILE *f = fopen(path, "re");
        ck_assert_ptr_nonnull(f);
        size_t n = fread(out, 1, sizeof(out) - 1, f);
        out[n] = '\0';
        fclose(f);
        unlink(path);
        json_error_t jerr;
        json_t *r = json_loads(out, 0, &jerr);
        ck_assert_msg(r != NULL, "invalid JSON: %s", out);
        ck_assert_uint_ge(jnum(r, "wait_ns"), 300ull * 1000 * 1000);
        ck_assert_uint_eq(jnum(jrank(r, 0), "new_bytes"), 1 * MiB);
        json_decref(r);
        /* The op that ran placed its outputs before the resize; the next one sees 1 MiB. */
        struct epd_dispatch_result dr;
        ck_assert_int_eq(epd_op_dispatch_result(op, &dr), EPD_OK);
        ck_assert_int_eq(epd_handle_release(s.g, dr.handle_id), EPD_OK);
        epd_op_free(op);
        wl_inputs_free(&st.ins[0]);
        solo_dispatch(&s, c, &st);
        ck_assert_uint_eq(solo_bytes(&s), 1 * MiB);
        solo_release(&s, &st);
        solo_leave(&s);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

/* ---- a rank bound again on another device while an op executes ---- */

/* Rank 0's client dies while an op of its group is in the backend (held by rank 1's inputs),
 * and a new client binds rank 0 on another device, which replaces the rank's arena. The op ends
 * with PEER_LOST at the loss, without running; marking the inputs ready afterwards starts
 * nothing; the new arena is untouched, rank 1's outputs of that op are freed, and the re-formed
 * group works. (An op already running when its rank's arena is replaced places into the old
 * arena, which the op's references keep mapped until it completes.) */
static const struct wl_case rebind_case = {
        .name = "rebind", .seed = 78, .world_size = 2, .num_experts = 4, .hidden = 256,
        .max_tokens = 64, .num_topk = 2, .dtype = EPD_DTYPE_BF16, .topk_dtype = EPD_DTYPE_INT64,
        .layout = EPD_LAYOUT_NON_EXPAND, .has_weights = 0, .routing = TD_ROUTING_UNIFORM,
        .minus_one_prob = 0.0, .tokens = WL_TOKENS_FULL, .apply_weights = 0, .use_arena = 1,
        .arena_bytes = 128 * KiB,
};

struct member {
        struct epd_client *cl;
        struct epd_group *g;
        struct io io;
        struct wl_inputs in;
};

static void member_inputs(struct member *m, const struct wl_case *c, uint32_t rank)
{
        ck_assert_int_eq(io_alloc(m->cl, c, &m->io), 0);
        ck_assert_int_eq(wl_inputs_make(c, rank, 0, 0, &m->in), 0);
        io_fill(c, &m->io, &m->in);
}

/* Rank 0 in a child process: enters the group, submits the op, says so, and waits to be
 * killed. */
static void rebind_rank0(const struct h_daemon *d, const struct wl_case *c,
                         const struct epd_group_config *gcfg, int ready_fd)
{
        struct member a = { 0 };
        struct epd_op *op;

        a.cl = h_connect(d, "rebind-a");
        if (!a.cl || wl_enter_group(a.cl, "rebind", 0, gcfg, &a.g) != EPD_OK ||
            io_alloc(a.cl, c, &a.io) < 0 || wl_inputs_make(c, 0, 0, 0, &a.in) < 0)
                _exit(1);
        io_fill(c, &a.io, &a.in);
        if (io_submit(c, &a.io, a.g, 0, &op) != EPD_OK || write(ready_fd, "r", 1) != 1)
                _exit(1);
        for (;;)
                pause();
}

START_TEST(test_rebind_while_op_executes)
{
        const struct wl_case *c = &rebind_case;
        struct epd_group_config gcfg = {
                .size = sizeof(gcfg), .world_size = 2, .num_experts = c->num_experts,
                .hidden = c->hidden, .max_tokens_per_rank = c->max_tokens,
                .max_topk = c->num_topk, .dispatch_dtype = c->dtype, .op_timeout_ms = 60000,
                .arena_bytes = c->arena_bytes,
        };
        struct member b = { 0 }, n = { 0 };
        struct epd_op *op_b, *op_n;
        struct epd_dispatch_result dr;
        struct h_daemon d;
        uint64_t bytes;
        int status, pipefd[2];
        char byte;

        daemon_start(&d, "[host]\ndevices = 2\n");
        ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
        pid_t child = fork();
        ck_assert_int_ge(child, 0);
        if (child == 0) {
                close(pipefd[0]);
                rebind_rank0(&d, c, &gcfg, pipefd[1]);
        }
        close(pipefd[1]);
        b.cl = h_connect(&d, "rebind-b");
        ck_assert_ptr_nonnull(b.cl);
        ck_assert_int_eq(wl_enter_group(b.cl, "rebind", 1, &gcfg, &b.g), EPD_OK);
        member_inputs(&b, c, 1);

        /* The op executes, waiting for rank 1's inputs. */
        ck_assert_int_eq(io_submit(c, &b.io, b.g, 1, &op_b), EPD_OK);
        ck_assert_int_eq(read(pipefd[0], &byte, 1), 1);
        close(pipefd[0]);
        ck_assert_int_eq(epd_op_wait(op_b, 300), EPD_TIMEOUT);

        /* Rank 0's client dies; a new one binds rank 0 on device 1 (a new arena). */
        ck_assert_int_eq(kill(child, SIGKILL), 0);
        ck_assert_int_eq(waitpid(child, &status, 0), child);
        n.cl = h_connect(&d, "rebind-n");
        ck_assert_ptr_nonnull(n.cl);
        int rc = EPD_UNAVAILABLE;
        for (int i = 0; i < 2500 && rc != EPD_OK; i++) { /* up to 5 s */
                rc = wl_join_group_on(n.cl, "rebind", 0, 1, &n.g);
                if (rc != EPD_OK)
                        usleep(2000); /* until the daemon has seen the old client go */
        }
        ck_assert_msg(rc == EPD_OK, "join: %s: %s", epd_status_name(rc),
                      epd_client_last_error(n.cl));
        /* The op waited for rank 1's inputs when rank 0 was lost: it ended with PEER_LOST
         * without running (the loss does not wait for the op's timeout). */
        rc = epd_op_wait(op_b, 2000);
        if (rc != EPD_PEER_LOST)
                h_daemon_dump_log(&d);
        ck_assert_msg(rc == EPD_PEER_LOST, "the op: %s: %s", epd_status_name(rc),
                      epd_op_error(op_b));
        uint8_t *arena = epd_group_arena(n.g, &bytes);
        ck_assert_ptr_nonnull(arena);
        memset(arena, 0x5a, bytes);
        /* Marking the inputs ready now starts nothing that writes what the new client sees. */
        ck_assert_int_eq(epd_group_mark_inputs_ready_host(b.g, NULL), EPD_OK);
        usleep(100000);
        epd_op_free(op_b);
        ck_assert_int_eq(waitpid(d.pid, &status, WNOHANG), 0); /* the daemon lives */
        for (uint64_t i = 0; i < bytes; i++)
                ck_assert_msg(arena[i] == 0x5a, "byte %llu of the new arena changed",
                              (unsigned long long)i);
        /* Rank 1's outputs of the failed op have no handle: their extents are free again. */
        ck_assert_uint_eq(stats_rank(&d, "rebind", 1, "arena_used_bytes"), 0);

        /* The group re-formed with the new rank 0: a dispatch places into the new arena. */
        member_inputs(&n, c, 0);
        ck_assert_int_eq(io_submit(c, &n.io, n.g, 0, &op_n), EPD_OK);
        ck_assert_int_eq(io_submit(c, &b.io, b.g, 0, &op_b), EPD_OK);
        rc = epd_op_wait(op_n, 10000);
        ck_assert_msg(rc == EPD_OK, "rank 0: %s: %s", epd_status_name(rc), epd_op_error(op_n));
        ck_assert_int_eq(epd_op_wait(op_b, 10000), EPD_OK);
        ck_assert_int_eq(epd_op_dispatch_result(op_n, &dr), EPD_OK);
        ck_assert_ptr_eq(dr.recv_x_ptr, arena + dr.recv_x.offset);
        ck_assert_int_eq(epd_handle_release(n.g, dr.handle_id), EPD_OK);
        ck_assert_int_eq(epd_handle_release(b.g, dr.handle_id), EPD_OK);
        epd_op_free(op_n);
        epd_op_free(op_b);

        wl_inputs_free(&n.in);
        wl_inputs_free(&b.in);
        epd_group_leave(n.g);
        epd_group_leave(b.g);
        epd_client_free(n.cl);
        epd_client_free(b.cl);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

/* ---- edges ---- */

START_TEST(test_resize_edges)
{
        const struct wl_case *c = &seg_case;
        struct h_daemon d;
        struct solo s;
        struct step st;
        char out[8192], id[32];
        json_t *r;

        daemon_start(&d, "max_arena_bytes = 4M\nmax_arena_segments = 2\n");
        solo_enter(&s, &d, "edge", c);

        const char *unknown[] = { "resize", "nosuch", "--bytes", "1M", NULL };
        ck_assert_int_eq(epctl(&d, unknown, out, sizeof(out)), 1);
        ck_assert_msg(strstr(out, "NOT_FOUND"), "%s", out);
        const char *zero[] = { "resize", "edge", "--bytes", "0", NULL };
        ck_assert_int_eq(epctl(&d, zero, out, sizeof(out)), 2);
        const char *junk[] = { "resize", "edge", "--bytes", "12Q", NULL };
        ck_assert_int_eq(epctl(&d, junk, out, sizeof(out)), 2);
        const char *missing[] = { "resize", "edge", NULL };
        ck_assert_int_eq(epctl(&d, missing, out, sizeof(out)), 2);
        const char *too_big[] = { "resize", "edge", "--bytes", "8M", NULL };
        ck_assert_int_eq(epctl(&d, too_big, out, sizeof(out)), 1);
        ck_assert_msg(strstr(out, "INVALID_ARGUMENT") && strstr(out, "max_arena_bytes"), "%s",
                      out);

        /* Up to the reserved 4 MiB, by id, in human form. */
        snprintf(id, sizeof(id), "%llu", (unsigned long long)epd_group_id(s.g));
        const char *by_id[] = { "resize", id, "--bytes", "1M", NULL };
        ck_assert_int_eq(epctl(&d, by_id, out, sizeof(out)), 0);
        ck_assert_msg(strstr(out, "resized") && strstr(out, "-> 1.0 MiB"), "%s", out);
        /* A third segment is refused and changes nothing. */
        const char *third[] = { "resize", "edge", "--bytes", "2M", NULL };
        ck_assert_int_eq(epctl(&d, third, out, sizeof(out)), 1);
        ck_assert_msg(strstr(out, "UNAVAILABLE") && strstr(out, "max_arena_segments"), "%s", out);
        ck_assert_uint_eq(stats_arena_bytes(&d, "edge"), 1 * MiB);
        /* Shrinking into the second segment keeps it; growing back within it needs none. */
        r = resize_ok(&d, "edge", "512K");
        ck_assert_uint_eq(jnum(jrank(r, 0), "segments"), 2);
        json_decref(r);
        r = resize_ok(&d, "edge", "1M");
        ck_assert_uint_eq(jnum(jrank(r, 0), "segments"), 2);
        json_decref(r);
        solo_dispatch(&s, c, &st);
        ck_assert_uint_eq(solo_bytes(&s), 1 * MiB);
        solo_release(&s, &st);

        /* A drained group stays drained through a resize: its op waits for the undrain. */
        const char *drain[] = { "drain", "edge", NULL };
        ck_assert_int_eq(epctl(&d, drain, out, sizeof(out)), 0);
        memset(&st, 0, sizeof(st));
        st.world_size = 1;
        ck_assert_int_eq(wl_inputs_make(c, 0, 0, 0, &st.ins[0]), 0);
        io_fill(c, &s.io, &st.ins[0]);
        struct epd_op *op = NULL;
        ck_assert_int_eq(io_submit(c, &s.io, s.g, 0, &op), EPD_OK);
        ck_assert_int_eq(epd_op_wait(op, 200), EPD_TIMEOUT);
        r = resize_ok(&d, "edge", "768K");
        json_decref(r);
        ck_assert_int_eq(epd_op_wait(op, 300), EPD_TIMEOUT);
        const char *undrain[] = { "undrain", "edge", NULL };
        ck_assert_int_eq(epctl(&d, undrain, out, sizeof(out)), 0);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        ck_assert_uint_eq(solo_bytes(&s), 768 * KiB);
        struct epd_dispatch_result dr;
        ck_assert_int_eq(epd_op_dispatch_result(op, &dr), EPD_OK);
        ck_assert_int_eq(epd_handle_release(s.g, dr.handle_id), EPD_OK);
        epd_op_free(op);
        wl_inputs_free(&st.ins[0]);
        solo_leave(&s);
        ck_assert_int_eq(h_daemon_stop(&d, 5000), 0);
}
END_TEST

int main(void)
{
        Suite *s = suite_create("integ_resize");
        TCase *tc = tcase_create("resize");
        SRunner *sr;
        int failed;

        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_resize_under_load);
        tcase_add_test(tc, test_resize_segments);
        tcase_add_test(tc, test_resize_waits_for_executing_op);
        tcase_add_test(tc, test_rebind_while_op_executes);
        tcase_add_test(tc, test_resize_edges);
        suite_add_tcase(s, tc);
        sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? 1 : 0;
}
