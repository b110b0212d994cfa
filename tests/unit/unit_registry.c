/* unit_registry.c - the region registry and its bounds check (daemon/core/registry.c), the output
 * arena allocator and its resizing (daemon/backend/arena.c) and the latency histograms (daemon/base/stats.c).
 *
 * The registry runs against a hand-built daemon and connections whose regions point at malloc'd
 * buffers; registration goes through a fake backend that counts imports and releases, so no
 * real backend, socket or loop is involved. Each test runs in its own process (fork mode).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "backend.h"
#include "core.h"
#include "stats.h"

/* ---- a fake daemon ---- */

struct fake {
        struct epdd_daemon d;
        struct epdd_backend backend;
        struct epdd_client a, b;
        unsigned imports, releases;
        int import_rc;
};

static struct fake *fake_of(struct epdd_backend *b)
{
        return epd_container_of(b, struct fake, backend);
}

static uint8_t fake_memory[1 << 16];

static int fake_import(struct epdd_backend *b, struct epdd_mem *r, int fd, const void *ipc,
                       size_t ipc_len, uint64_t offset, char *err, size_t err_len)
{
        struct fake *f = fake_of(b);

        (void)ipc;
        (void)ipc_len;
        (void)offset;
        if (fd >= 0)
                close(fd);
        if (f->import_rc < 0) {
                snprintf(err, err_len, "fake import refused");
                return f->import_rc;
        }
        f->imports++;
        r->base = fake_memory;
        return 0;
}

static void fake_release(struct epdd_backend *b, struct epdd_mem *r)
{
        (void)r;
        fake_of(b)->releases++;
}

static const struct epdd_backend_ops fake_ops = {
        .name = "fake",
        .region_import = fake_import,
        .region_release = fake_release,
};

static struct fake *fake_new(void)
{
        struct fake *f = calloc(1, sizeof(*f));

        ck_assert_ptr_nonnull(f);
        epd_config_defaults(&f->d.cfg);
        f->backend.ops = &fake_ops;
        f->backend.num_devices = 2;
        f->d.backend = &f->backend;
        epd_list_init(&f->d.conns);
        epd_list_init(&f->d.groups);
        f->a.daemon = &f->d;
        f->a.id = 1;
        epd_list_init(&f->a.regions);
        f->b.daemon = &f->d;
        f->b.id = 2;
        epd_list_init(&f->b.regions);
        return f;
}

/* Frees the fake and whatever regions are still in its connections' tables. */
static void fake_free(struct fake *f)
{
        struct epdd_client *conns[2] = { &f->a, &f->b };

        for (int i = 0; i < 2; i++) {
                struct epd_list *pos, *tmp;
                epd_list_for_each_safe(pos, tmp, &conns[i]->regions)
                {
                        struct epdd_region *r = epd_list_entry(pos, struct epdd_region, conn_link);
                        epd_list_del(&r->conn_link);
                        if (!r->is_arena && r->mem.base != fake_memory)
                                free(r->mem.base);
                        free(r);
                }
                free(conns[i]->region_slots);
        }
        free(f);
}

/* A region of `size` bytes backed by a malloc'd buffer, added to c's table with a fresh id. */
static struct epdd_region *add_region(struct epdd_client *c, uint64_t size)
{
        struct epdd_region *r = calloc(1, sizeof(*r));

        ck_assert_ptr_nonnull(r);
        r->id = ++c->daemon->next_region_id;
        r->owner = c;
        r->mem.kind = EPD_REGION_HOST_MEMFD;
        r->mem.size = size;
        r->mem.base = malloc(size ? size : 1);
        ck_assert_ptr_nonnull(r->mem.base);
        r->refs = 1;
        ck_assert_int_eq(epd_region_attach(c, r), 0);
        c->num_regions++;
        c->region_bytes += size;
        return r;
}

static struct epd_tensor tensor2(enum epd_dtype dtype, uint64_t region_id, uint64_t offset,
                                 uint64_t rows, uint64_t cols, uint64_t stride0,
                                 uint64_t stride1)
{
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        t.dtype = dtype;
        t.ndim = 2;
        t.sizes[0] = rows;
        t.sizes[1] = cols;
        t.strides[0] = stride0;
        t.strides[1] = stride1;
        t.region_id = region_id;
        t.offset = offset;
        return t;
}

struct resolved {
        struct epdd_region *region;
        uint8_t *ptr;
        uint64_t stride;
        char err[256];
};

static int resolve(struct epdd_client *c, const struct epd_tensor *t, uint64_t rows, uint64_t cols,
                   struct resolved *out)
{
        out->region = (struct epdd_region *)(uintptr_t)0x1;
        out->ptr = (uint8_t *)(uintptr_t)0x2;
        out->stride = 0x3;
        out->err[0] = '\0';
        return epd_region_resolve(c, t, rows, cols, &out->region, &out->ptr, &out->stride,
                                  out->err, sizeof(out->err));
}

/* A refused tensor: EPD_INVALID_ARGUMENT, a message containing `why`, outputs untouched. */
static void expect_refused(struct epdd_client *c, const struct epd_tensor *t, uint64_t rows,
                           uint64_t cols, const char *why)
{
        struct resolved out;
        int rc = resolve(c, t, rows, cols, &out);

        ck_assert_msg(rc == EPD_INVALID_ARGUMENT, "rc %d (want INVALID_ARGUMENT) for '%s'", rc,
                      why);
        ck_assert_msg(strstr(out.err, why) != NULL, "err '%s' lacks '%s'", out.err, why);
        ck_assert_ptr_eq(out.region, (struct epdd_region *)(uintptr_t)0x1);
        ck_assert_ptr_eq(out.ptr, (uint8_t *)(uintptr_t)0x2);
        ck_assert_uint_eq(out.stride, 0x3);
}

static void expect_ok(struct epdd_client *c, const struct epd_tensor *t, uint64_t rows,
                      uint64_t cols, struct epdd_region *want_region, uint64_t want_stride)
{
        struct resolved out;
        int rc = resolve(c, t, rows, cols, &out);

        ck_assert_msg(rc == 0, "rc %d: %s", rc, out.err);
        ck_assert_ptr_eq(out.region, want_region);
        ck_assert_ptr_eq(out.ptr, want_region->mem.base + t->offset);
        ck_assert_uint_eq(out.stride, want_stride);
}

/* ---- region lookup ---- */

START_TEST(test_find)
{
        struct fake *f = fake_new();
        struct epdd_region *r1 = add_region(&f->a, 100);
        struct epdd_region *r2 = add_region(&f->a, 200);
        struct epdd_region *r3 = add_region(&f->b, 300);

        ck_assert_ptr_eq(epd_region_find(&f->a, r1->id), r1);
        ck_assert_ptr_eq(epd_region_find(&f->a, r2->id), r2);
        ck_assert_ptr_eq(epd_region_find(&f->b, r3->id), r3);
        /* Another connection's region is invisible. */
        ck_assert_ptr_null(epd_region_find(&f->a, r3->id));
        ck_assert_ptr_null(epd_region_find(&f->b, r1->id));
        ck_assert_ptr_null(epd_region_find(&f->a, 0));
        ck_assert_ptr_null(epd_region_find(&f->a, 999));
        ck_assert_ptr_null(epd_region_find(&f->a, UINT64_MAX));
        fake_free(f);
}
END_TEST

/* Thousands of regions, released in a scattered order: every lookup finds exactly the regions
 * still held (the table's deletion moves entries back, never loses one). */
START_TEST(test_find_many)
{
        enum { N = 5000 };
        struct fake *f = fake_new();
        struct epdd_region **r = calloc(N, sizeof(*r));
        uint8_t *held = calloc(N, 1);
        uint64_t *ids = calloc(N, sizeof(*ids));
        uint64_t state = 12345;

        ck_assert_ptr_nonnull(r);
        ck_assert_ptr_nonnull(held);
        ck_assert_ptr_nonnull(ids);
        /* Pseudo-random ids rather than the daemon's sequence, whose hashes seldom collide:
         * the table's probe runs and their repair on release are what is under test. */
        for (int i = 0; i < N; i++) {
                state = state * 6364136223846793005ull + 1442695040888963407ull;
                r[i] = calloc(1, sizeof(*r[i]));
                ck_assert_ptr_nonnull(r[i]);
                r[i]->id = (state >> 1) | 1; /* never 0 */
                r[i]->owner = &f->a;
                r[i]->mem.size = 16;
                r[i]->mem.base = fake_memory;
                r[i]->refs = 1;
                ck_assert_int_eq(epd_region_attach(&f->a, r[i]), 0);
                f->a.num_regions++;
                ids[i] = r[i]->id;
                held[i] = 1;
        }
        ck_assert_uint_ge(f->a.region_cap, 2 * N);
        for (int round = 0; round < 3; round++) {
                /* Release about a third of those held, chosen pseudo-randomly. */
                for (int i = 0; i < N; i++) {
                        state = state * 6364136223846793005ull + 1442695040888963407ull;
                        if (!held[i] || (state >> 33) % 3 != 0)
                                continue;
                        ck_assert_int_eq(epd_region_release_id(&f->a, ids[i]), 0);
                        held[i] = 0;
                }
                for (int i = 0; i < N; i++)
                        ck_assert_ptr_eq(epd_region_find(&f->a, ids[i]), held[i] ? r[i] : NULL);
                ck_assert_ptr_null(epd_region_find(&f->a, 2)); /* even: never an id here */
        }
        unsigned left = 0;
        for (int i = 0; i < N; i++)
                left += held[i];
        ck_assert_uint_eq(f->a.num_regions, left);
        ck_assert_uint_eq(f->a.region_count, left);
        free(ids);
        free(held);
        free(r);
        fake_free(f);
}
END_TEST

/* ---- the bounds check ---- */

START_TEST(test_resolve_unknown_and_foreign_region)
{
        struct fake *f = fake_new();
        struct epdd_region *ra = add_region(&f->a, 4096);
        struct epdd_region *rb = add_region(&f->b, 4096);
        struct epd_tensor t;

        t = tensor2(EPD_DTYPE_BF16, 12345, 0, 1, 8, 0, 0);
        expect_refused(&f->a, &t, 1, 8, "region 12345 is not registered");
        t = tensor2(EPD_DTYPE_BF16, 0, 0, 1, 8, 0, 0);
        expect_refused(&f->a, &t, 1, 8, "not registered");
        /* b's region through a: refused although the id exists. */
        t = tensor2(EPD_DTYPE_BF16, rb->id, 0, 1, 8, 0, 0);
        expect_refused(&f->a, &t, 1, 8, "not registered by this client");
        expect_ok(&f->b, &t, 1, 8, rb, 16);
        t = tensor2(EPD_DTYPE_BF16, ra->id, 0, 1, 8, 0, 0);
        expect_ok(&f->a, &t, 1, 8, ra, 16);
        expect_refused(&f->b, &t, 1, 8, "not registered");
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_exact_fit_and_one_byte_over)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 1000);
        struct epd_tensor t;

        /* 3 rows of 100 bf16: 600 bytes; at offset 400 they end exactly at the region end. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 400, 3, 100, 0, 0);
        expect_ok(&f->a, &t, 3, 100, r, 200);
        t.offset = 401;
        expect_refused(&f->a, &t, 3, 100, "runs past the end");
        /* The whole region. */
        t = tensor2(EPD_DTYPE_FP32, r->id, 0, 250, 1, 0, 0);
        expect_ok(&f->a, &t, 250, 1, r, 4);
        expect_refused(&f->a, &t, 251, 1, "runs past the end");
        /* One column more widens every (contiguous) row: 1010 bytes. */
        t = tensor2(EPD_DTYPE_FP8_E4M3, r->id, 0, 10, 100, 0, 0);
        expect_ok(&f->a, &t, 10, 100, r, 100);
        expect_refused(&f->a, &t, 10, 101, "runs past the end");
        /* int64: 125 rows of 1 fill 1000 bytes. */
        t = tensor2(EPD_DTYPE_INT64, r->id, 0, 125, 1, 0, 0);
        expect_ok(&f->a, &t, 125, 1, r, 8);
        t.offset = 1;
        expect_refused(&f->a, &t, 125, 1, "runs past the end");
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_offset_past_end)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 512);
        struct epd_tensor t;

        t = tensor2(EPD_DTYPE_BF16, r->id, 513, 0, 4, 0, 0);
        expect_refused(&f->a, &t, 0, 4, "runs past the end");
        t.offset = UINT64_MAX;
        expect_refused(&f->a, &t, 0, 4, "runs past the end");
        expect_refused(&f->a, &t, 1, 4, "runs past the end");
        /* offset + extent would wrap: must not pass as small. */
        t.offset = UINT64_MAX - 3;
        expect_refused(&f->a, &t, 1, 4, "runs past the end");
        t.offset = 512;
        expect_refused(&f->a, &t, 1, 1, "runs past the end");
        t.offset = 511;
        expect_refused(&f->a, &t, 1, 1, "runs past the end"); /* a bf16 needs 2 bytes */
        t.offset = 510;
        expect_ok(&f->a, &t, 1, 1, r, 2);
        fake_free(f);
}
END_TEST

/* Elements must sit at their natural alignment: backends use typed and vectorised access
 * (found by fuzz_request: an odd bf16 offset reached the host backend's stores). */
START_TEST(test_resolve_alignment)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 512);
        struct epd_tensor t;

        t = tensor2(EPD_DTYPE_BF16, r->id, 3, 4, 8, 0, 0);
        expect_refused(&f->a, &t, 4, 8, "not aligned");
        t.offset = 4;
        expect_ok(&f->a, &t, 4, 8, r, 16);
        t = tensor2(EPD_DTYPE_INT64, r->id, 4, 2, 1, 0, 0);
        expect_refused(&f->a, &t, 2, 1, "not aligned");
        t.offset = 8;
        expect_ok(&f->a, &t, 2, 1, r, 8);
        t = tensor2(EPD_DTYPE_FP32, r->id, 2, 2, 2, 0, 0);
        expect_refused(&f->a, &t, 2, 2, "not aligned");
        /* fp8 elements are bytes: any offset. */
        t = tensor2(EPD_DTYPE_FP8_E4M3, r->id, 3, 4, 16, 0, 0);
        expect_ok(&f->a, &t, 4, 16, r, 16);
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_strides)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 1100);
        struct epd_tensor t;

        /* 4 rows of 100 bf16 with a row stride of 150 elements: 3 * 300 + 200 = 1100 bytes. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 4, 100, 150, 1);
        expect_ok(&f->a, &t, 4, 100, r, 300);
        t.offset = 1;
        expect_refused(&f->a, &t, 4, 100, "runs past the end");
        t.offset = 0;
        expect_refused(&f->a, &t, 5, 100, "runs past the end");
        /* The padding after the last row is not needed. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 4, 100, 150, 0);
        expect_ok(&f->a, &t, 4, 100, r, 300);
        /* A stride equal to the row is contiguous; a smaller one overlaps rows. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 4, 100, 100, 1);
        expect_ok(&f->a, &t, 4, 100, r, 200);
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 4, 100, 99, 1);
        expect_refused(&f->a, &t, 4, 100, "smaller than a row");
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 4, 100, 1, 1);
        expect_refused(&f->a, &t, 4, 100, "smaller than a row");
        /* A stride of 0 means contiguous. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 4, 100, 0, 0);
        expect_ok(&f->a, &t, 4, 100, r, 200);
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_innermost_stride)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 4096);
        struct epd_tensor t;

        t = tensor2(EPD_DTYPE_FP32, r->id, 0, 2, 8, 16, 2);
        expect_refused(&f->a, &t, 2, 8, "innermost dimension must be contiguous");
        t.strides[1] = UINT64_MAX;
        expect_refused(&f->a, &t, 2, 8, "innermost dimension must be contiguous");
        t.strides[1] = 1;
        expect_ok(&f->a, &t, 2, 8, r, 64);
        t.strides[1] = 0;
        expect_ok(&f->a, &t, 2, 8, r, 64);
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_one_dimensional)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 400);
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        t.dtype = EPD_DTYPE_INT32;
        t.ndim = 1;
        t.sizes[0] = 100;
        t.region_id = r->id;
        /* The daemon resolves [rows] as rows x 1. */
        expect_ok(&f->a, &t, 100, 1, r, 4);
        expect_refused(&f->a, &t, 101, 1, "runs past the end");
        t.strides[0] = 1;
        expect_ok(&f->a, &t, 100, 1, r, 4);
        t.strides[0] = 2;
        expect_refused(&f->a, &t, 100, 1, "one-dimensional tensor must be contiguous");
        t.strides[0] = 0;
        t.offset = 4;
        expect_ok(&f->a, &t, 99, 1, r, 4);
        expect_refused(&f->a, &t, 100, 1, "runs past the end");
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_zero_rows)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 256);
        struct epd_tensor t;

        /* Nothing is touched: any offset up to the end is fine, even with a huge stride. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 0, 1000, 0, 0);
        expect_ok(&f->a, &t, 0, 1000, r, 2000);
        t.offset = 256;
        expect_ok(&f->a, &t, 0, 1000, r, 2000);
        t.offset = 257;
        expect_refused(&f->a, &t, 0, 1000, "runs past the end");
        /* The stride is still checked. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 0, 100, 50, 0);
        expect_refused(&f->a, &t, 0, 100, "smaller than a row");
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_overflow)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 4096);
        struct epd_tensor t;

        /* (rows - 1) * stride wraps to exactly 0 in 64 bits: 2^63 * 2 bytes. Without the
         * overflow check the extent would be one 2-byte row. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, (1ull << 63) + 1, 1, 0, 0);
        expect_refused(&f->a, &t, (1ull << 63) + 1, 1, "tensor extent overflows");
        /* Wraps to a small value: (2^62 + 1) strides of 4 bytes = 2^64 + 4 -> 4. */
        t = tensor2(EPD_DTYPE_FP32, r->id, 0, 0, 1, 0, 0);
        expect_refused(&f->a, &t, (1ull << 62) + 2, 1, "tensor extent overflows");
        /* A stride that fits in elements but not in bytes. */
        t = tensor2(EPD_DTYPE_INT64, r->id, 0, 2, 1, UINT64_MAX / 8 + 1, 1);
        expect_refused(&f->a, &t, 2, 1, "row stride 2305843009213693952 overflows");
        /* A row that does not fit in 64 bits. */
        t = tensor2(EPD_DTYPE_FP32, r->id, 0, 1, UINT64_MAX / 4 + 1, 0, 0);
        expect_refused(&f->a, &t, 1, UINT64_MAX / 4 + 1, "row size overflows");
        /* Near UINT64_MAX without wrapping: simply too big for the region. */
        t = tensor2(EPD_DTYPE_FP8_E4M3, r->id, 0, 2, 1, UINT64_MAX / 2, 1);
        expect_refused(&f->a, &t, 2, 1, "runs past the end");
        t = tensor2(EPD_DTYPE_FP8_E4M3, r->id, 0, 3, 1, UINT64_MAX / 2, 1);
        expect_refused(&f->a, &t, 3, 1, "runs past the end"); /* 2^64 - 1: just fits */
        t = tensor2(EPD_DTYPE_FP8_E4M3, r->id, 0, 4, 1, UINT64_MAX / 2, 1);
        expect_refused(&f->a, &t, 4, 1, "tensor extent overflows");
        /* rows = UINT64_MAX with a 1-byte stride: extent = UINT64_MAX, fits 64 bits. */
        t = tensor2(EPD_DTYPE_FP8_E4M3, r->id, 0, 0, 1, 0, 0);
        expect_refused(&f->a, &t, UINT64_MAX, 1, "runs past the end");
        fake_free(f);
}
END_TEST

START_TEST(test_resolve_bad_dtype_and_empty_row)
{
        struct fake *f = fake_new();
        struct epdd_region *r = add_region(&f->a, 256);
        struct epd_tensor t;

        t = tensor2(EPD_DTYPE_INVALID, r->id, 0, 1, 1, 0, 0);
        expect_refused(&f->a, &t, 1, 1, "invalid dtype");
        t = tensor2((enum epd_dtype)99, r->id, 0, 1, 1, 0, 0);
        expect_refused(&f->a, &t, 1, 1, "invalid dtype");
        /* A row of no elements (a zero stride) must be refused, not divide by zero. */
        t = tensor2(EPD_DTYPE_BF16, r->id, 0, 4, 0, 0, 0);
        expect_refused(&f->a, &t, 4, 0, "at least one element");
        fake_free(f);
}
END_TEST

/* ---- registration through a fake backend ---- */

static int fd_is_open(int fd)
{
        return fcntl(fd, F_GETFD) >= 0;
}

static int make_fd(void)
{
        int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);

        ck_assert_int_ge(fd, 0);
        return fd;
}

static int do_register(struct fake *f, struct epdd_client *c, uint64_t size, uint32_t device,
                       int fd, uint64_t *id, char *err, size_t err_len)
{
        const struct epdd_region_args rr = { .kind = EPD_REGION_HOST_MEMFD, .size = size,
                                             .device = device };

        (void)f;
        return epd_region_register(c, &rr, fd, id, err, err_len);
}

START_TEST(test_register_and_release)
{
        struct fake *f = fake_new();
        char err[256];
        uint64_t id1 = 0, id2 = 0, id3 = 0;
        struct epdd_region *r;

        ck_assert_int_eq(do_register(f, &f->a, 1000, 0, make_fd(), &id1, err, sizeof(err)), 0);
        ck_assert_int_eq(do_register(f, &f->a, 24, 1, make_fd(), &id2, err, sizeof(err)), 0);
        ck_assert_int_eq(do_register(f, &f->b, 5, 0, -1, &id3, err, sizeof(err)), 0);
        ck_assert_uint_ne(id1, 0);
        ck_assert_uint_gt(id2, id1);
        ck_assert_uint_gt(id3, id2);
        ck_assert_uint_eq(f->imports, 3);
        ck_assert_uint_eq(f->a.num_regions, 2);
        ck_assert_uint_eq(f->a.region_bytes, 1024);
        ck_assert_uint_eq(f->b.num_regions, 1);
        r = epd_region_find(&f->a, id2);
        ck_assert_ptr_nonnull(r);
        ck_assert_uint_eq(r->mem.size, 24);
        ck_assert_uint_eq(r->mem.device, 1);
        ck_assert_ptr_eq(r->owner, &f->a);
        ck_assert_ptr_eq(r->mem.base, fake_memory);
        ck_assert_uint_eq(r->refs, 1);

        /* Release: only the owner, only once. */
        ck_assert_int_eq(epd_region_release_id(&f->b, id1), EPD_NOT_FOUND);
        ck_assert_int_eq(epd_region_release_id(&f->a, id1), 0);
        ck_assert_uint_eq(f->releases, 1);
        ck_assert_uint_eq(f->a.num_regions, 1);
        ck_assert_uint_eq(f->a.region_bytes, 24);
        ck_assert_ptr_null(epd_region_find(&f->a, id1));
        ck_assert_int_eq(epd_region_release_id(&f->a, id1), EPD_NOT_FOUND);

        /* A region an op still references outlives its detach. */
        r = epd_region_find(&f->a, id2);
        epd_region_ref(r);
        ck_assert_int_eq(epd_region_release_id(&f->a, id2), 0);
        ck_assert_uint_eq(f->releases, 1);
        ck_assert_ptr_null(r->owner);
        ck_assert_uint_eq(f->a.num_regions, 0);
        ck_assert_uint_eq(f->a.region_bytes, 0);
        epd_region_unref(&f->d, r);
        ck_assert_uint_eq(f->releases, 2);

        epd_region_release_all(&f->b);
        ck_assert_uint_eq(f->releases, 3);
        ck_assert_uint_eq(f->b.num_regions, 0);
        ck_assert_int_eq(epd_list_empty(&f->b.regions), 1);
        fake_free(f);
}
END_TEST

START_TEST(test_register_limits_close_fd)
{
        struct fake *f = fake_new();
        char err[256];
        uint64_t id = 77;
        int fd;

        f->d.cfg.max_regions_per_client = 2;
        f->d.cfg.max_region_bytes_per_client = 1000;

        fd = make_fd();
        ck_assert_int_eq(do_register(f, &f->a, 0, 0, fd, &id, err, sizeof(err)),
                         EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(fd_is_open(fd), 0);
        ck_assert_uint_eq(id, 77);

        fd = make_fd();
        ck_assert_int_eq(do_register(f, &f->a, 10, 2, fd, &id, err, sizeof(err)),
                         EPD_INVALID_ARGUMENT);
        ck_assert_msg(strstr(err, "device 2") != NULL, "err: %s", err);
        ck_assert_int_eq(fd_is_open(fd), 0);

        fd = make_fd();
        ck_assert_int_eq(do_register(f, &f->a, 1001, 0, fd, &id, err, sizeof(err)),
                         EPD_UNAVAILABLE);
        ck_assert_int_eq(fd_is_open(fd), 0);
        ck_assert_uint_eq(id, 77);

        /* Exactly the byte limit, in two regions; then the region count limit. */
        ck_assert_int_eq(do_register(f, &f->a, 600, 0, make_fd(), &id, err, sizeof(err)), 0);
        fd = make_fd();
        ck_assert_int_eq(do_register(f, &f->a, 401, 0, fd, &id, err, sizeof(err)),
                         EPD_UNAVAILABLE);
        ck_assert_int_eq(fd_is_open(fd), 0);
        ck_assert_int_eq(do_register(f, &f->a, 400, 0, make_fd(), &id, err, sizeof(err)), 0);
        ck_assert_uint_eq(f->a.region_bytes, 1000);
        f->d.cfg.max_region_bytes_per_client = 1u << 20;
        fd = make_fd();
        ck_assert_int_eq(do_register(f, &f->a, 1, 0, fd, &id, err, sizeof(err)),
                         EPD_UNAVAILABLE);
        ck_assert_msg(strstr(err, "max_regions_per_client") != NULL, "err: %s", err);
        ck_assert_int_eq(fd_is_open(fd), 0);

        /* A limit lowered below what the client holds (SIGHUP) refuses without wrapping. */
        f->d.cfg.max_regions_per_client = 100;
        f->d.cfg.max_region_bytes_per_client = 500;
        ck_assert_int_eq(do_register(f, &f->a, 1, 0, -1, &id, err, sizeof(err)),
                         EPD_UNAVAILABLE);
        ck_assert_uint_eq(f->a.num_regions, 2);
        ck_assert_uint_eq(f->imports, 2);

        /* A backend failure is passed through and registers nothing. */
        f->d.cfg.max_region_bytes_per_client = 1u << 20;
        f->import_rc = EPD_INTERNAL;
        ck_assert_int_eq(do_register(f, &f->a, 1, 0, make_fd(), &id, err, sizeof(err)),
                         EPD_INTERNAL);
        ck_assert_uint_eq(f->a.num_regions, 2);
        ck_assert_uint_eq(f->a.region_bytes, 1000);
        fake_free(f);
}
END_TEST

START_TEST(test_arena_region)
{
        struct fake *f = fake_new();
        uint8_t *mem = malloc(4096);
        struct epdd_arena *arena = epd_arena_new(mem, 4096, -1, EPD_REGION_HOST_MEMFD);
        struct epdd_region *r;
        struct epd_tensor t;
        uint64_t id = 0;

        ck_assert_ptr_nonnull(arena);
        ck_assert_int_eq(epd_region_add_arena(&f->a, arena, 1, &id), 0);
        r = epd_region_find(&f->a, id);
        ck_assert_ptr_nonnull(r);
        ck_assert_int_eq(r->is_arena, 1);
        ck_assert_ptr_eq(r->mem.base, mem);
        ck_assert_uint_eq(r->mem.size, 4096);
        ck_assert_uint_eq(r->mem.device, 1);
        /* The daemon's arena counts against no client limit. */
        ck_assert_uint_eq(f->a.num_regions, 0);
        ck_assert_uint_eq(f->a.region_bytes, 0);
        /* It resolves like any region and cannot be released by the client. */
        t = tensor2(EPD_DTYPE_BF16, id, 4096 - 64, 2, 16, 0, 0);
        expect_ok(&f->a, &t, 2, 16, r, 32);
        ck_assert_int_eq(epd_region_release_id(&f->a, id), EPD_PERMISSION_DENIED);
        ck_assert_ptr_eq(epd_region_find(&f->a, id), r);
        /* Dropped with the connection, without a backend release. */
        epd_region_release_all(&f->a);
        ck_assert_uint_eq(f->releases, 0);
        ck_assert_ptr_null(epd_region_find(&f->a, id));
        ck_assert_uint_eq(f->a.num_regions, 0);
        epd_arena_free(arena);
        free(mem);
        fake_free(f);
}
END_TEST

/* ---- arena allocator ---- */

static struct epdd_arena *arena_of(uint64_t bytes)
{
        struct epdd_arena *a = epd_arena_new(NULL, bytes, -1, EPD_REGION_HOST_MEMFD);

        ck_assert_ptr_nonnull(a);
        return a;
}

START_TEST(test_arena_alloc_align)
{
        struct epdd_arena *a = arena_of(4096);
        uint64_t off = 1;

        ck_assert_uint_eq(epd_arena_largest_free(a), 4096);
        ck_assert_uint_eq(epd_arena_used(a), 0);
        ck_assert_int_eq(epd_arena_alloc(a, 1, &off), 0);
        ck_assert_uint_eq(off, 0);
        ck_assert_uint_eq(epd_arena_used(a), 256);
        ck_assert_int_eq(epd_arena_alloc(a, 256, &off), 0);
        ck_assert_uint_eq(off, 256);
        ck_assert_int_eq(epd_arena_alloc(a, 257, &off), 0);
        ck_assert_uint_eq(off, 512);
        ck_assert_uint_eq(epd_arena_used(a), 1024);
        /* Zero bytes still take one aligned unit: every placement has a distinct offset. */
        ck_assert_int_eq(epd_arena_alloc(a, 0, &off), 0);
        ck_assert_uint_eq(off, 1024);
        ck_assert_uint_eq(epd_arena_used(a), 1280);
        ck_assert_uint_eq(epd_arena_largest_free(a), 4096 - 1280);
        epd_arena_free(a);
}
END_TEST

START_TEST(test_arena_alignment_random)
{
        struct epdd_arena *a = arena_of(1u << 20);
        uint64_t offs[64], lens[64], end_max = 0;
        unsigned n = 0;
        uint32_t seed = 12345;

        for (; n < 64; n++) {
                seed = seed * 1103515245u + 12345u;
                lens[n] = 1 + (seed >> 8) % 9000;
                ck_assert_int_eq(epd_arena_alloc(a, lens[n], &offs[n]), 0);
                ck_assert_uint_eq(offs[n] % EPD_ARENA_ALIGN, 0);
                /* No overlap with any earlier placement. */
                for (unsigned j = 0; j < n; j++)
                        ck_assert(offs[n] >= offs[j] + lens[j] || offs[j] >= offs[n] + lens[n]);
                if (offs[n] + lens[n] > end_max)
                        end_max = offs[n] + lens[n];
        }
        ck_assert_uint_le(end_max, 1u << 20);
        for (unsigned i = 0; i < n; i += 2)
                epd_arena_release(a, offs[i], lens[i]);
        for (unsigned i = 1; i < n; i += 2)
                epd_arena_release(a, offs[i], lens[i]);
        ck_assert_uint_eq(epd_arena_used(a), 0);
        ck_assert_uint_eq(epd_arena_largest_free(a), 1u << 20);
        ck_assert_uint_eq(a->num_free, 1);
        epd_arena_free(a);
}
END_TEST

START_TEST(test_arena_exhaustion)
{
        struct epdd_arena *a = arena_of(1024);
        uint64_t off = 0, sentinel;

        ck_assert_int_eq(epd_arena_alloc(a, 1025, &off), -ENOMEM);
        ck_assert_int_eq(epd_arena_alloc(a, 1024, &off), 0);
        ck_assert_uint_eq(off, 0);
        ck_assert_uint_eq(epd_arena_largest_free(a), 0);
        sentinel = off = 0xdead;
        ck_assert_int_eq(epd_arena_alloc(a, 1, &off), -ENOMEM);
        ck_assert_uint_eq(off, sentinel);
        epd_arena_release(a, 0, 1024);
        ck_assert_uint_eq(epd_arena_largest_free(a), 1024);

        /* Enough free bytes in total but no extent large enough. */
        uint64_t o[4];
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(epd_arena_alloc(a, 256, &o[i]), 0);
        epd_arena_release(a, o[0], 256);
        epd_arena_release(a, o[2], 256);
        ck_assert_uint_eq(epd_arena_used(a), 512);
        ck_assert_uint_eq(epd_arena_largest_free(a), 256);
        ck_assert_int_eq(epd_arena_alloc(a, 257, &off), -ENOMEM);
        epd_arena_free(a);

        /* A length whose rounding would wrap 64 bits is refused, not served as tiny. */
        a = arena_of(4096);
        ck_assert_int_eq(epd_arena_alloc(a, UINT64_MAX, &off), -ENOMEM);
        ck_assert_int_eq(epd_arena_alloc(a, UINT64_MAX - 100, &off), -ENOMEM);
        ck_assert_uint_eq(epd_arena_used(a), 0);
        ck_assert_uint_eq(epd_arena_largest_free(a), 4096);
        epd_arena_free(a);

        /* An arena whose size is not a multiple of the alignment. */
        a = arena_of(1000);
        ck_assert_int_eq(epd_arena_alloc(a, 768, &off), 0);
        ck_assert_int_eq(epd_arena_alloc(a, 1, &off), -ENOMEM);
        ck_assert_uint_eq(epd_arena_largest_free(a), 232);
        epd_arena_release(a, 0, 768);
        ck_assert_uint_eq(epd_arena_largest_free(a), 1000);
        epd_arena_free(a);

        /* An empty arena. */
        a = arena_of(0);
        ck_assert_int_eq(epd_arena_alloc(a, 1, &off), -ENOMEM);
        ck_assert_uint_eq(epd_arena_largest_free(a), 0);
        epd_arena_free(a);
}
END_TEST

START_TEST(test_arena_coalescing)
{
        struct epdd_arena *a = arena_of(2048);
        uint64_t o[8], off;

        for (int i = 0; i < 8; i++) {
                ck_assert_int_eq(epd_arena_alloc(a, 256, &o[i]), 0);
                ck_assert_uint_eq(o[i], (uint64_t)i * 256);
        }
        ck_assert_uint_eq(a->num_free, 0);
        /* Isolated holes. */
        epd_arena_release(a, o[1], 256);
        epd_arena_release(a, o[5], 256);
        ck_assert_uint_eq(a->num_free, 2);
        ck_assert_uint_eq(epd_arena_largest_free(a), 256);
        /* Merge with the next extent. */
        epd_arena_release(a, o[4], 256);
        ck_assert_uint_eq(a->num_free, 2);
        ck_assert_uint_eq(a->free_list[1].off, 1024);
        ck_assert_uint_eq(a->free_list[1].len, 512);
        /* Merge with the previous extent. */
        epd_arena_release(a, o[6], 256);
        ck_assert_uint_eq(a->num_free, 2);
        ck_assert_uint_eq(a->free_list[1].len, 768);
        /* Merge with both: [1] + [2] + [3..6]. */
        epd_arena_release(a, o[3], 256);
        epd_arena_release(a, o[2], 256);
        ck_assert_uint_eq(a->num_free, 1);
        ck_assert_uint_eq(a->free_list[0].off, 256);
        ck_assert_uint_eq(a->free_list[0].len, 1536);
        ck_assert_uint_eq(epd_arena_used(a), 512);
        /* First fit takes the lowest extent that fits. */
        ck_assert_int_eq(epd_arena_alloc(a, 300, &off), 0);
        ck_assert_uint_eq(off, 256);
        epd_arena_release(a, off, 300);
        epd_arena_release(a, o[0], 256);
        epd_arena_release(a, o[7], 256);
        ck_assert_uint_eq(a->num_free, 1);
        ck_assert_uint_eq(a->free_list[0].off, 0);
        ck_assert_uint_eq(a->free_list[0].len, 2048);
        ck_assert_uint_eq(epd_arena_used(a), 0);
        ck_assert_uint_eq(epd_arena_largest_free(a), 2048);
        epd_arena_free(a);
}
END_TEST

/* More holes than the initial free-list capacity: the list grows and still coalesces. */
START_TEST(test_arena_many_holes)
{
        enum { N = 128 };
        struct epdd_arena *a = arena_of(N * 256);
        uint64_t o[N];

        for (int i = 0; i < N; i++)
                ck_assert_int_eq(epd_arena_alloc(a, 200, &o[i]), 0);
        for (int i = 0; i < N; i += 2)
                epd_arena_release(a, o[i], 200);
        ck_assert_uint_eq(a->num_free, N / 2);
        ck_assert_uint_ge(a->cap_free, N / 2);
        for (unsigned i = 1; i < a->num_free; i++)
                ck_assert_uint_gt(a->free_list[i].off, a->free_list[i - 1].off);
        ck_assert_uint_eq(epd_arena_largest_free(a), 256);
        for (int i = 1; i < N; i += 2)
                epd_arena_release(a, o[i], 200);
        ck_assert_uint_eq(a->num_free, 1);
        ck_assert_uint_eq(epd_arena_largest_free(a), N * 256);
        ck_assert_uint_eq(epd_arena_used(a), 0);
        epd_arena_free(a);
}
END_TEST

START_TEST(test_arena_free_closes_fd)
{
        int p[2];
        struct epdd_arena *a;

        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        a = epd_arena_new(NULL, 4096, p[1], EPD_REGION_HOST_MEMFD);
        ck_assert_ptr_nonnull(a);
        ck_assert_int_eq(a->segs[0].fd, p[1]);
        epd_arena_free(a);
        ck_assert_int_eq(fd_is_open(p[1]), 0);
        ck_assert_int_eq(fd_is_open(p[0]), 1);
        epd_arena_free(NULL);
        close(p[0]);
}
END_TEST

/* ---- arena resizing (real memory through the host backend's segment mapping) ---- */

static struct epdd_arena *arena_created(struct epdd_backend *b, uint64_t bytes, uint64_t reserve,
                                       unsigned max_segments)
{
        struct epdd_arena *a = NULL;
        char err[256];

        b->ops = &epd_backend_host_ops; /* arena_map/arena_unmap need no initialised backend */
        ck_assert_msg(epd_arena_create(b, 0, 1, bytes, reserve, max_segments, &a, err,
                                       sizeof(err)) == 0,
                      "%s", err);
        return a;
}

static uint64_t resized(struct epdd_arena *a, uint64_t bytes)
{
        uint64_t now = 0;
        char err[256];

        ck_assert_msg(epd_arena_resize(a, bytes, &now, err, sizeof(err)) == 0, "%s", err);
        return now;
}

START_TEST(test_arena_resize_grow_shrink)
{
        struct epdd_backend b;
        struct epdd_arena *a = arena_created(&b, 64 << 10, 1 << 20, 4);
        uint8_t *base = a->base;
        uint64_t off[3], big, gen = a->generation, now;
        char err[256];

        ck_assert_uint_eq(a->bytes, 64 << 10);
        ck_assert_uint_eq(a->reserved, 1 << 20);
        ck_assert_uint_eq(a->num_segs, 1);
        for (int i = 0; i < 3; i++) {
                ck_assert_int_eq(epd_arena_alloc(a, 16 << 10, &off[i]), 0);
                ck_assert_uint_eq(off[i], (uint64_t)i * (16 << 10));
        }
        ck_assert_uint_eq(epd_arena_floor(a), 48 << 10);
        /* A shrink stops at the end of the highest placement. */
        ck_assert_uint_eq(resized(a, 4096), 48 << 10);
        ck_assert_uint_eq(a->num_segs, 1);
        ck_assert_uint_gt(a->generation, gen);
        /* A grow maps a second segment after the first; placements may straddle them. */
        ck_assert_uint_eq(resized(a, 256 << 10), 256 << 10);
        ck_assert_uint_eq(a->num_segs, 2);
        ck_assert_uint_eq(a->segs[1].off, 64 << 10);
        ck_assert_ptr_eq(a->base, base);
        ck_assert_int_eq(epd_arena_alloc(a, 200 << 10, &big), 0);
        ck_assert_uint_eq(big, 48 << 10);
        memset(a->base + big, 0x5A, 200 << 10);
        ck_assert_int_eq(a->base[big + (200 << 10) - 1], 0x5A);
        ck_assert_uint_eq(epd_arena_floor(a), 248 << 10);
        epd_arena_release(a, big, 200 << 10);
        ck_assert_uint_eq(epd_arena_floor(a), 48 << 10);
        /* Back down: the second segment lies wholly above the new end and goes. */
        ck_assert_uint_eq(resized(a, 4096), 48 << 10);
        ck_assert_uint_eq(a->num_segs, 1);
        ck_assert_uint_eq(a->mapped, 64 << 10);
        for (int i = 0; i < 3; i++)
                epd_arena_release(a, off[i], 16 << 10);
        ck_assert_uint_eq(resized(a, 4096), 4096);
        ck_assert_uint_eq(epd_arena_largest_free(a), 4096);
        ck_assert_int_eq(epd_arena_alloc(a, 4096, &off[0]), 0);
        ck_assert_int_eq(epd_arena_alloc(a, 1, &off[1]), -ENOMEM);
        epd_arena_release(a, off[0], 4096);
        /* Growing within the mapped first segment needs no new one. */
        ck_assert_uint_eq(resized(a, 60 << 10), 60 << 10);
        ck_assert_uint_eq(a->num_segs, 1);
        ck_assert_uint_eq(epd_arena_largest_free(a), 60 << 10);
        /* Outside 1..reserved. */
        ck_assert_int_eq(epd_arena_resize(a, 0, &now, err, sizeof(err)), EPD_INVALID_ARGUMENT);
        ck_assert_int_eq(epd_arena_resize(a, (1 << 20) + 1, &now, err, sizeof(err)),
                         EPD_INVALID_ARGUMENT);
        ck_assert_uint_eq(resized(a, 1 << 20), 1 << 20);
        ck_assert_uint_eq(epd_arena_largest_free(a), 1 << 20);
        epd_arena_free(a);
}
END_TEST

START_TEST(test_arena_resize_segment_limit)
{
        struct epdd_backend b;
        struct epdd_arena *a = arena_created(&b, 64 << 10, 1 << 20, 2);
        uint64_t now = 0, gen;
        char err[256];

        ck_assert_uint_eq(resized(a, 128 << 10), 128 << 10);
        gen = a->generation;
        ck_assert_int_eq(epd_arena_resize(a, 256 << 10, &now, err, sizeof(err)), EPD_UNAVAILABLE);
        ck_assert_msg(strstr(err, "max_arena_segments") != NULL, "%s", err);
        /* Nothing changed. */
        ck_assert_uint_eq(a->bytes, 128 << 10);
        ck_assert_uint_eq(a->num_segs, 2);
        ck_assert_uint_eq(a->generation, gen);
        ck_assert_uint_eq(epd_arena_largest_free(a), 128 << 10);
        /* An arena over the caller's memory cannot be resized. */
        struct epdd_arena *fixed = epd_arena_new(fake_memory, 4096, -1, EPD_REGION_HOST_MEMFD);
        ck_assert_int_eq(epd_arena_resize(fixed, 2048, &now, err, sizeof(err)),
                         EPD_INVALID_ARGUMENT);
        epd_arena_free(fixed);
        epd_arena_free(a);
}
END_TEST

/* ---- latency histograms ---- */

START_TEST(test_hist_buckets)
{
        static const struct {
                uint64_t ns;
                unsigned bucket;
        } cases[] = {
                { 0, 0 },          { 999, 0 },         { 1000, 1 },       { 1999, 1 },
                { 2000, 2 },       { 3999, 2 },        { 4000, 3 },       { 7999, 3 },
                { 8000, 4 },       { 1023999, 10 },    { 1024000, 11 },
                { (1ull << 22) * 1000 - 1, 22 },       { (1ull << 22) * 1000, 23 },
                { (1ull << 40) * 1000, 23 },           { UINT64_MAX, 23 },
        };

        for (unsigned i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                struct epdd_latency_hist h;
                memset(&h, 0, sizeof(h));
                epd_latency_record(&h, cases[i].ns);
                for (unsigned b = 0; b < EPD_LAT_BUCKETS; b++)
                        ck_assert_msg(h.buckets[b] == (b == cases[i].bucket),
                                      "%llu ns: bucket %u holds %llu, want bucket %u",
                                      (unsigned long long)cases[i].ns, b,
                                      (unsigned long long)h.buckets[b], cases[i].bucket);
                ck_assert_uint_eq(h.count, 1);
                ck_assert_uint_eq(h.sum_ns, cases[i].ns);
                ck_assert_uint_eq(h.max_ns, cases[i].ns);
        }
}
END_TEST

START_TEST(test_hist_quantiles)
{
        struct epdd_latency_hist h;

        memset(&h, 0, sizeof(h));
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.5), 0);

        /* One sample: capped by the max, not the bucket bound. */
        epd_latency_record(&h, 1500);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.5), 1500);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.0), 1500);

        /* 90 samples of 10 us (bucket 4, bound 16 us), 9 of 100 us (bucket 7, bound 128 us),
         * 1 of 900 us (bucket 10, bound 1024 us, capped to the max). */
        memset(&h, 0, sizeof(h));
        for (int i = 0; i < 90; i++)
                epd_latency_record(&h, 10000);
        for (int i = 0; i < 9; i++)
                epd_latency_record(&h, 100000);
        epd_latency_record(&h, 900000);
        ck_assert_uint_eq(h.count, 100);
        ck_assert_uint_eq(h.sum_ns, 90 * 10000 + 9 * 100000 + 900000);
        ck_assert_uint_eq(h.max_ns, 900000);
        ck_assert_uint_eq(h.buckets[4], 90);
        ck_assert_uint_eq(h.buckets[7], 9);
        ck_assert_uint_eq(h.buckets[10], 1);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.0), 16000);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.5), 16000);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.9), 16000);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.95), 128000);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.99), 128000);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.999), 900000);
        ck_assert_uint_eq(epd_latency_quantile(&h, 1.0), 900000);
}
END_TEST

/* The last bucket is open-ended: a quantile that lands there is the max, not 2^23 us. */
START_TEST(test_hist_open_ended_bucket)
{
        struct epdd_latency_hist h;
        uint64_t slow = 100ull * 1000 * 1000 * 1000; /* 100 s */

        memset(&h, 0, sizeof(h));
        epd_latency_record(&h, 5000);
        epd_latency_record(&h, slow);
        ck_assert_uint_eq(h.buckets[EPD_LAT_BUCKETS - 1], 1);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.25), 8000);
        ck_assert_uint_eq(epd_latency_quantile(&h, 1.0), slow);
        ck_assert_uint_eq(epd_latency_quantile(&h, 0.99), slow);
}
END_TEST

START_TEST(test_op_stats_record)
{
        struct epdd_op_stats s;

        memset(&s, 0, sizeof(s));
        epd_op_stats_record(&s, EPD_OK, 4096, 3000);
        epd_op_stats_record(&s, EPD_OK, 100, 5000);
        ck_assert_uint_eq(s.ops, 2);
        ck_assert_uint_eq(s.bytes, 4196);
        ck_assert_uint_eq(s.latency.count, 2);
        ck_assert_uint_eq(s.latency.buckets[2], 1);
        ck_assert_uint_eq(s.latency.buckets[3], 1);
        epd_op_stats_record(&s, EPD_TIMEOUT, 999, 7000);
        epd_op_stats_record(&s, EPD_INTERNAL, 999, 7000);
        epd_op_stats_record(&s, EPD_TIMEOUT, 999, 7000);
        ck_assert_uint_eq(s.errors[-EPD_TIMEOUT], 2);
        ck_assert_uint_eq(s.errors[-EPD_INTERNAL], 1);
        /* Failures count no bytes or latency; statuses outside the enum are ignored. */
        epd_op_stats_record(&s, -EPD_STATUS_COUNT, 1, 1);
        epd_op_stats_record(&s, 5, 1, 1);
        ck_assert_uint_eq(s.ops, 2);
        ck_assert_uint_eq(s.bytes, 4196);
        ck_assert_uint_eq(s.latency.count, 2);
        for (unsigned i = 0; i < EPD_STATUS_COUNT; i++)
                if (i != (unsigned)-EPD_TIMEOUT && i != (unsigned)-EPD_INTERNAL)
                        ck_assert_uint_eq(s.errors[i], 0);
}
END_TEST

static Suite *registry_suite(void)
{
        Suite *s = suite_create("registry");
        TCase *tc = tcase_create("resolve");

        tcase_add_test(tc, test_find);
        tcase_add_test(tc, test_find_many);
        tcase_add_test(tc, test_resolve_unknown_and_foreign_region);
        tcase_add_test(tc, test_resolve_exact_fit_and_one_byte_over);
        tcase_add_test(tc, test_resolve_offset_past_end);
        tcase_add_test(tc, test_resolve_alignment);
        tcase_add_test(tc, test_resolve_strides);
        tcase_add_test(tc, test_resolve_innermost_stride);
        tcase_add_test(tc, test_resolve_one_dimensional);
        tcase_add_test(tc, test_resolve_zero_rows);
        tcase_add_test(tc, test_resolve_overflow);
        tcase_add_test(tc, test_resolve_bad_dtype_and_empty_row);
        suite_add_tcase(s, tc);

        tc = tcase_create("register");
        tcase_add_test(tc, test_register_and_release);
        tcase_add_test(tc, test_register_limits_close_fd);
        tcase_add_test(tc, test_arena_region);
        suite_add_tcase(s, tc);

        tc = tcase_create("arena");
        tcase_add_test(tc, test_arena_alloc_align);
        tcase_add_test(tc, test_arena_alignment_random);
        tcase_add_test(tc, test_arena_exhaustion);
        tcase_add_test(tc, test_arena_coalescing);
        tcase_add_test(tc, test_arena_many_holes);
        tcase_add_test(tc, test_arena_free_closes_fd);
        tcase_add_test(tc, test_arena_resize_grow_shrink);
        tcase_add_test(tc, test_arena_resize_segment_limit);
        suite_add_tcase(s, tc);

        tc = tcase_create("stats");
        tcase_add_test(tc, test_hist_buckets);
        tcase_add_test(tc, test_hist_quantiles);
        tcase_add_test(tc, test_hist_open_ended_bucket);
        tcase_add_test(tc, test_op_stats_record);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(registry_suite());
        int failed;

        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
