/* gen_corpus.c - writes the seed corpus of the fuzz targets:
 *
 *   <dir>/fuzz_frame/    valid frames of every request type (and a few broken ones) in the
 *                        record format fuzz_frame reads
 *   <dir>/fuzz_request/  scripts (fuzz_script.h): each request type alone, each as a raw
 *                        protobuf body, and whole sessions that create groups, register
 *                        regions, dispatch and combine on one and two ranks, time out, ring
 *                        doorbells and disconnect mid-op
 *   <dir>/fuzz_config/   configuration files and epd_config_set lines
 *
 * Run once by `cmake --build build-fuzz --target fuzz-corpus`; the files are committed. Usage:
 * gen_corpus DIR
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "frame.h"
#include "fuzz_script.h"
#include "oprec.h"

static const char *out_dir;

/* ---- a growable byte buffer ---- */

struct buf {
        uint8_t data[16384];
        size_t len;
};

static void put(struct buf *b, const void *p, size_t n)
{
        if (b->len + n > sizeof(b->data)) {
                fprintf(stderr, "gen_corpus: seed too large\n");
                exit(1);
        }
        memcpy(b->data + b->len, p, n);
        b->len += n;
}

static void u8(struct buf *b, unsigned v)
{
        uint8_t x = (uint8_t)v;
        put(b, &x, 1);
}

static void u16(struct buf *b, unsigned v)
{
        u8(b, v & 0xff);
        u8(b, (v >> 8) & 0xff);
}

static void write_file(const char *target, const char *name, const struct buf *b)
{
        char path[512];
        FILE *f;

        snprintf(path, sizeof(path), "%s/%s", out_dir, target);
        if (mkdir(path, 0755) < 0 && errno != EEXIST) {
                perror(path);
                exit(1);
        }
        snprintf(path, sizeof(path), "%s/%s/%s", out_dir, target, name);
        f = fopen(path, "wb");
        if (!f || fwrite(b->data, 1, b->len, f) != b->len || fclose(f) != 0) {
                perror(path);
                exit(1);
        }
}

/* ---- one packed Request of every type ---- */

/* The combine seed: an op record too, of the other kind. */
#define SEED_OP_COMBINE 1000

static size_t pack_request(int type, uint8_t *out, size_t cap)
{
        static uint8_t secret[16] = "fuzz-group-secre";
        Epd__V1__Request req = EPD__V1__REQUEST__INIT;
        Epd__V1__Hello hello = EPD__V1__HELLO__INIT;
        Epd__V1__GroupConfig cfg = EPD__V1__GROUP_CONFIG__INIT;
        Epd__V1__GroupCreate gc = EPD__V1__GROUP_CREATE__INIT;
        Epd__V1__GroupJoin gj = EPD__V1__GROUP_JOIN__INIT;
        Epd__V1__GroupLeave gl = EPD__V1__GROUP_LEAVE__INIT;
        Epd__V1__RegionRegister rr = EPD__V1__REGION_REGISTER__INIT;
        Epd__V1__RegionRelease rl = EPD__V1__REGION_RELEASE__INIT;
        Epd__V1__SizeHint sh = EPD__V1__SIZE_HINT__INIT;
        Epd__V1__StatusRequest st = EPD__V1__STATUS_REQUEST__INIT;
        Epd__V1__ListGroups lg = EPD__V1__LIST_GROUPS__INIT;
        Epd__V1__ListClients lc = EPD__V1__LIST_CLIENTS__INIT;
        Epd__V1__OpRecord op = EPD__V1__OP_RECORD__INIT;
        struct epd_op_request q = { .id = 7, .group_id = 1 };
        uint8_t rec[EPD_OPREC_REQUEST_BYTES];
        char why[160];
        Epd__V1__HandleRelease hr = EPD__V1__HANDLE_RELEASE__INIT;
        Epd__V1__StatsRequest sr = EPD__V1__STATS_REQUEST__INIT;
        struct epd_tensor t = { .region_id = 1, .dtype = EPD_DTYPE_BF16, .ndim = 2,
                                .sizes = { 4, 16 } };
        Epd__V1__ArenaSegments as = EPD__V1__ARENA_SEGMENTS__INIT;
        Epd__V1__Resize rs = EPD__V1__RESIZE__INIT;
        Epd__V1__Drain dr = EPD__V1__DRAIN__INIT;
        Epd__V1__Undrain ud = EPD__V1__UNDRAIN__INIT;
        Epd__V1__Evict ev = EPD__V1__EVICT__INIT;

        cfg.world_size = 1;
        cfg.num_experts = 4;
        cfg.hidden = 16;
        cfg.max_tokens_per_rank = 4;
        cfg.max_topk = 2;
        cfg.dispatch_dtype = EPD__V1__DTYPE__BF16;
        cfg.arena_bytes = 65536;
        req.id = 7;
        req.body_case = (Epd__V1__Request__BodyCase)type;
        switch (type) {
        case EPD__V1__REQUEST__BODY_HELLO:
                hello.protocol_version = EPD_PROTOCOL_VERSION;
                hello.client_name = "seed";
                hello.capabilities = 1;
                req.hello = &hello;
                break;
        case EPD__V1__REQUEST__BODY_GROUP_CREATE:
                gc.name = "g0";
                gc.secret.data = secret;
                gc.secret.len = sizeof(secret);
                gc.config = &cfg;
                req.group_create = &gc;
                break;
        case EPD__V1__REQUEST__BODY_GROUP_JOIN:
                gj.name = "g0";
                gj.secret.data = secret;
                gj.secret.len = sizeof(secret);
                req.group_join = &gj;
                break;
        case EPD__V1__REQUEST__BODY_GROUP_LEAVE:
                gl.group_id = 1;
                req.group_leave = &gl;
                break;
        case EPD__V1__REQUEST__BODY_REGION_REGISTER:
                rr.kind = EPD__V1__REGION_KIND__HOST_MEMFD;
                rr.size = 4096;
                req.region_register = &rr;
                break;
        case EPD__V1__REQUEST__BODY_REGION_RELEASE:
                rl.region_id = 1;
                req.region_release = &rl;
                break;
        case EPD__V1__REQUEST__BODY_SIZE_HINT:
                sh.config = &cfg;
                sh.expert_alignment = 4;
                req.size_hint = &sh;
                break;
        case EPD__V1__REQUEST__BODY_STATUS: req.status = &st; break;
        case EPD__V1__REQUEST__BODY_LIST_GROUPS: req.list_groups = &lg; break;
        case EPD__V1__REQUEST__BODY_LIST_CLIENTS: req.list_clients = &lc; break;
        case EPD__V1__REQUEST__BODY_OP:
        case SEED_OP_COMBINE:
                if (type == EPD__V1__REQUEST__BODY_OP) {
                        q.kind = EPD_OPREC_DISPATCH;
                        q.num_tokens = 4;
                        q.t[EPD_OPREC_X] = t;
                        q.flags = EPD_OPREC_USE_ARENA;
                        q.num_topk = 2;
                } else {
                        q.kind = EPD_OPREC_COMBINE;
                        q.handle_id = 1;
                        q.t[EPD_OPREC_Y] = t;
                        q.t[EPD_OPREC_COMBINED] = t;
                }
                if (epd_oprec_request_encode(&q, rec, sizeof(rec), why, sizeof(why)) < 0) {
                        fprintf(stderr, "gen_corpus: %s\n", why);
                        exit(1);
                }
                op.record.data = rec;
                op.record.len = sizeof(rec);
                req.body_case = EPD__V1__REQUEST__BODY_OP;
                req.op = &op;
                break;
        case EPD__V1__REQUEST__BODY_HANDLE_RELEASE:
                hr.group_id = 1;
                hr.handle_id = 1;
                req.handle_release = &hr;
                break;
        case EPD__V1__REQUEST__BODY_ARENA_SEGMENTS:
                as.group_id = 1;
                req.arena_segments = &as;
                break;
        case EPD__V1__REQUEST__BODY_RESIZE:
                rs.group_name = "g0";
                rs.bytes = 131072;
                req.resize = &rs;
                break;
        case EPD__V1__REQUEST__BODY_DRAIN:
                dr.all = 1;
                req.drain = &dr;
                break;
        case EPD__V1__REQUEST__BODY_UNDRAIN:
                ud.group_name = "g0";
                req.undrain = &ud;
                break;
        case EPD__V1__REQUEST__BODY_EVICT:
                ev.client_id = 2;
                req.evict = &ev;
                break;
        default:
                req.body_case = EPD__V1__REQUEST__BODY_STATS;
                req.stats = &sr;
                break;
        }
        size_t len = epd__v1__request__get_packed_size(&req);
        if (len > cap)
                exit(1);
        epd__v1__request__pack(&req, out);
        return len;
}

static const struct {
        int type;
        const char *name;
} request_types[] = {
        { EPD__V1__REQUEST__BODY_HELLO, "hello" },
        { EPD__V1__REQUEST__BODY_GROUP_CREATE, "group_create" },
        { EPD__V1__REQUEST__BODY_GROUP_JOIN, "group_join" },
        { EPD__V1__REQUEST__BODY_GROUP_LEAVE, "group_leave" },
        { EPD__V1__REQUEST__BODY_REGION_REGISTER, "region_register" },
        { EPD__V1__REQUEST__BODY_REGION_RELEASE, "region_release" },
        { EPD__V1__REQUEST__BODY_SIZE_HINT, "size_hint" },
        { EPD__V1__REQUEST__BODY_STATUS, "status" },
        { EPD__V1__REQUEST__BODY_LIST_GROUPS, "list_groups" },
        { EPD__V1__REQUEST__BODY_LIST_CLIENTS, "list_clients" },
        { EPD__V1__REQUEST__BODY_OP, "dispatch" },
        { SEED_OP_COMBINE, "combine" },
        { EPD__V1__REQUEST__BODY_HANDLE_RELEASE, "handle_release" },
        { EPD__V1__REQUEST__BODY_STATS, "stats" },
        { EPD__V1__REQUEST__BODY_ARENA_SEGMENTS, "arena_segments" },
        { EPD__V1__REQUEST__BODY_RESIZE, "resize" },
        { EPD__V1__REQUEST__BODY_DRAIN, "drain" },
        { EPD__V1__REQUEST__BODY_UNDRAIN, "undrain" },
        { EPD__V1__REQUEST__BODY_EVICT, "evict" },
};

/* ---- fuzz_frame seeds ---- */

static void frame_record(struct buf *b, unsigned num_fds, uint32_t magic, uint16_t header_fds,
                         const uint8_t *body, size_t len, int32_t length_delta)
{
        struct epd_frame_header h = {
                .magic = magic,
                .version = EPD_PROTOCOL_VERSION,
                .num_fds = header_fds,
                .length = (uint32_t)((int64_t)len + length_delta),
        };
        uint8_t header[EPD_FRAME_HEADER_BYTES];

        epd_frame_header_encode(&h, header);
        u8(b, num_fds);
        u16(b, EPD_FRAME_HEADER_BYTES + len);
        put(b, header, sizeof(header));
        put(b, body, len);
}

static void gen_frames(void)
{
        uint8_t body[4096];
        struct buf b;
        char name[64];

        for (size_t i = 0; i < sizeof(request_types) / sizeof(request_types[0]); i++) {
                size_t len = pack_request(request_types[i].type, body, sizeof(body));
                unsigned fds = request_types[i].type == EPD__V1__REQUEST__BODY_REGION_REGISTER;
                b.len = 0;
                u8(&b, 8);      /* max_fds */
                u16(&b, 1024);  /* max_body */
                frame_record(&b, fds, EPD_FRAME_MAGIC, (uint16_t)fds, body, len, 0);
                snprintf(name, sizeof(name), "frame_%s", request_types[i].name);
                write_file("fuzz_frame", name, &b);
        }
        size_t len = pack_request(EPD__V1__REQUEST__BODY_STATUS, body, sizeof(body));
        /* Broken ones: each header rule once, then several records in one input. */
        struct {
                const char *name;
                unsigned fds;
                uint32_t magic;
                uint16_t header_fds;
                int32_t delta;
        } bad[] = {
                { "frame_bad_magic", 0, 0x12345678u, 0, 0 },
                { "frame_fds_unannounced", 2, EPD_FRAME_MAGIC, 0, 0 },
                { "frame_fds_missing", 0, EPD_FRAME_MAGIC, 3, 0 },
                { "frame_too_many_fds", 17, EPD_FRAME_MAGIC, 17, 0 },
                { "frame_length_short", 0, EPD_FRAME_MAGIC, 0, -1 },
                { "frame_length_long", 0, EPD_FRAME_MAGIC, 0, 1 },
        };
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                b.len = 0;
                u8(&b, 16);
                u16(&b, 1024);
                frame_record(&b, bad[i].fds, bad[i].magic, bad[i].header_fds, body, len,
                             bad[i].delta);
                write_file("fuzz_frame", bad[i].name, &b);
        }
        b.len = 0;
        u8(&b, 4);
        u16(&b, 8); /* a tiny maximum body: the status body is too large */
        frame_record(&b, 0, EPD_FRAME_MAGIC, 0, body, len, 0);
        u8(&b, 0);  /* an empty record */
        u16(&b, 0);
        u8(&b, 1);  /* fds without bytes */
        u16(&b, 0);
        frame_record(&b, 1, EPD_FRAME_MAGIC, 1, body, 0, 0);
        write_file("fuzz_frame", "frame_sequence", &b);
}

/* ---- fuzz_request seeds ---- */

static void op(struct buf *b, unsigned code, unsigned client)
{
        u8(b, code);
        u8(b, client);
}

/* config: world size, experts per rank, hidden index, tokens, topk, dtype, scale_block/8,
 * timeout, arena KiB. Hidden index 0 is 16 (EPD_FUZZ_HIDDEN_TABLE). */
static void config(struct buf *b, unsigned ws, unsigned epr, unsigned hidden_idx,
                   unsigned tokens, unsigned topk, unsigned dtype, unsigned sb8,
                   unsigned timeout, unsigned arena_kib)
{
        u8(b, ws - 1);
        u8(b, epr - 1);
        u8(b, hidden_idx);
        u8(b, tokens);
        u8(b, topk - 1);
        u8(b, dtype);
        u8(b, sb8);
        u8(b, timeout - 1);
        u8(b, arena_kib);
}

static void group_create(struct buf *b, unsigned client, unsigned name, unsigned ws,
                         unsigned epr, unsigned hidden_idx, unsigned tokens, unsigned topk,
                         unsigned dtype, unsigned sb8, unsigned arena_kib, unsigned rank)
{
        op(b, EPD_FUZZ_OP_GROUP_CREATE, client);
        u8(b, name);
        u8(b, 0); /* the good secret */
        config(b, ws, epr, hidden_idx, tokens, topk, dtype, sb8, 16, arena_kib);
        u8(b, rank);
        u8(b, 0); /* device */
        u8(b, 0); /* no uuid */
}

static void group_join(struct buf *b, unsigned client, unsigned name, unsigned rank,
                       unsigned device)
{
        op(b, EPD_FUZZ_OP_GROUP_JOIN, client);
        u8(b, name);
        u8(b, 0);
        u8(b, rank);
        u8(b, device);
        u8(b, 0);
}

/* A region of size16 * 16 bytes filled with int32 ((k % a) * b + k / a) % c. */
static void region(struct buf *b, unsigned client, unsigned size16, unsigned fill,
                   unsigned fa, unsigned fb, unsigned fc)
{
        op(b, EPD_FUZZ_OP_REGION_REGISTER, client);
        u8(b, 0);        /* memfd */
        u16(b, size16);
        u16(b, 0);       /* offset */
        u8(b, 0);        /* exact file */
        u8(b, fill);
        u8(b, fa);
        u8(b, fb);
        u8(b, fc);
        u8(b, 0);        /* one fd */
        u8(b, 0);        /* device 0 */
}

/* A tensor of natural shape in known region `region` (1-based) at `offset`. */
static void tensor(struct buf *b, unsigned region, unsigned offset)
{
        u8(b, region);
        u16(b, offset);
        u8(b, 0);
}

static void absent(struct buf *b)
{
        u8(b, 0);
}

static void simple(struct buf *b, unsigned code)
{
        op(b, code, 0);
}

/* A dispatch of the client's first binding: 4 tokens, x at 0 and int32 topk_idx at 256 of its
 * first region, no other tensor (flags as in fuzz_script.h: 4 use_arena, 16 wait_inputs). */
static void small_dispatch(struct buf *b, unsigned client, unsigned flags)
{
        op(b, EPD_FUZZ_OP_DISPATCH, client);
        u8(b, 0); u8(b, 0); u8(b, 0); u8(b, 4); u8(b, flags); u16(b, 0);
        tensor(b, 1, 0); absent(b); tensor(b, 1, 256);
        for (int i = 0; i < 7; i++)
                absent(b);
}

static void gen_requests(void)
{
        uint8_t body[4096];
        struct buf b;
        char name[64];

        /* Each request type as a raw protobuf body after the automatic Hello. */
        for (size_t i = 0; i < sizeof(request_types) / sizeof(request_types[0]); i++) {
                size_t len = pack_request(request_types[i].type, body, sizeof(body));
                b.len = 0;
                u8(&b, 0);
                op(&b, EPD_FUZZ_OP_RAW_BODY, 0);
                u16(&b, len);
                put(&b, body, len);
                snprintf(name, sizeof(name), "raw_%s", request_types[i].name);
                write_file("fuzz_request", name, &b);
        }

        /* The stateless requests, structured. */
        b.len = 0;
        u8(&b, 1); /* two clients */
        simple(&b, EPD_FUZZ_OP_STATUS);
        simple(&b, EPD_FUZZ_OP_LIST_GROUPS);
        simple(&b, EPD_FUZZ_OP_LIST_CLIENTS);
        simple(&b, EPD_FUZZ_OP_STATS);
        op(&b, EPD_FUZZ_OP_SIZE_HINT, 1);
        config(&b, 2, 4, 3, 16, 4, 1, 16, 1, 64);
        u16(&b, 8);
        write_file("fuzz_request", "stateless", &b);

        /* Hello rules: no Hello first; a second Hello; a Hello of another version. */
        b.len = 0;
        u8(&b, EPD_FUZZ_NO_HELLO | 2);
        simple(&b, EPD_FUZZ_OP_STATUS);
        op(&b, EPD_FUZZ_OP_HELLO, 1);
        u8(&b, 2);
        u8(&b, 4);
        put(&b, "abcd", 4);
        op(&b, EPD_FUZZ_OP_HELLO, 1);
        u8(&b, 0);
        u8(&b, 0);
        op(&b, EPD_FUZZ_OP_HELLO, 2);
        u8(&b, 1);
        u8(&b, 0);
        write_file("fuzz_request", "hello_rules", &b);

        /* Regions: register, release, and the refusals. */
        b.len = 0;
        u8(&b, 0);
        region(&b, 0, 256, EPD_FUZZ_FILL_ZERO, 0, 0, 0);
        op(&b, EPD_FUZZ_OP_REGION_REGISTER, 0); /* a file shorter than the region */
        u8(&b, 0); u16(&b, 16); u16(&b, 4096); u8(&b, 1); u8(&b, 0); u8(&b, 0); u8(&b, 0);
        u8(&b, 0); u8(&b, 0); u8(&b, 0);
        op(&b, EPD_FUZZ_OP_REGION_REGISTER, 0); /* CUDA IPC on the host backend, no fd */
        u8(&b, 2); u16(&b, 16); u16(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 0);
        u8(&b, 0); u8(&b, 1); u8(&b, 0);
        op(&b, EPD_FUZZ_OP_REGION_REGISTER, 0); /* an unsealable memfd */
        u8(&b, 0); u16(&b, 16); u16(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 0);
        u8(&b, 0); u8(&b, 4); u8(&b, 0);
        op(&b, EPD_FUZZ_OP_REGION_RELEASE, 0);
        u8(&b, 0);
        op(&b, EPD_FUZZ_OP_REGION_RELEASE, 0);
        u8(&b, 9);
        op(&b, EPD_FUZZ_OP_REGION_REGISTER, 0); /* two fds: the connection closes */
        u8(&b, 0); u16(&b, 16); u16(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 0);
        u8(&b, 0); u8(&b, 2); u8(&b, 0);
        write_file("fuzz_request", "regions", &b);

        /* Groups: create, a second create of the same name, join with a wrong secret, leave. */
        b.len = 0;
        u8(&b, 1);
        group_create(&b, 0, 0, 2, 2, 0, 4, 2, 0, 0, 16, 0);
        group_create(&b, 1, 0, 2, 2, 0, 4, 2, 0, 0, 16, 1);
        op(&b, EPD_FUZZ_OP_GROUP_JOIN, 1);
        u8(&b, 0); u8(&b, 3); u8(&b, 1); u8(&b, 0); u8(&b, 0);
        group_join(&b, 1, 0, 1, 1);
        simple(&b, EPD_FUZZ_OP_LIST_GROUPS);
        simple(&b, EPD_FUZZ_OP_LIST_CLIENTS);
        simple(&b, EPD_FUZZ_OP_STATS);
        op(&b, EPD_FUZZ_OP_GROUP_LEAVE, 1);
        u8(&b, 0); u8(&b, 0);
        op(&b, EPD_FUZZ_OP_GROUP_LEAVE, 0);
        u8(&b, 0); u8(&b, 0);
        write_file("fuzz_request", "groups", &b);

        /* Raw op records after a group of one rank: a dispatch record made the binding's, the
         * same posted in the doorbell page (then a frame, so that the daemon takes it), and
         * one record cut short. */
        {
                uint8_t rec[EPD_OPREC_REQUEST_BYTES + 64];
                const size_t n = pack_request(EPD__V1__REQUEST__BODY_OP, rec, sizeof(rec));
                /* The record is the last bytes of the packed Request (field 26, then its one
                 * bytes field): take them from there. */
                const uint8_t *record = rec + n - EPD_OPREC_REQUEST_BYTES;
                b.len = 0;
                u8(&b, 0);
                region(&b, 0, 256, EPD_FUZZ_FILL_I32, 2, 1, 4);
                group_create(&b, 0, 0, 1, 4, 0, 4, 2, 0, 0, 64, 0);
                for (unsigned flags = 2; flags <= 3; flags++) {
                        op(&b, EPD_FUZZ_OP_RAW_OP, 0);
                        u8(&b, 0);
                        u8(&b, flags);
                        u16(&b, EPD_OPREC_REQUEST_BYTES);
                        put(&b, record, EPD_OPREC_REQUEST_BYTES);
                        simple(&b, EPD_FUZZ_OP_STATS);
                }
                op(&b, EPD_FUZZ_OP_RAW_OP, 0);
                u8(&b, 0);
                u8(&b, 0);
                u16(&b, 40);
                put(&b, record, 40);
                write_file("fuzz_request", "raw_op", &b);
        }

        /* One rank, bf16, arena outputs: dispatch, cached dispatch, combine, release.
         * Region 1: 4096 bytes of int32 (k % 2 + k / 2) % 4: valid top-2 expert ids for a row
         * that starts at an even element. Known regions: 1 the region, 2 the arena. Variant 2:
         * non-expand, every dispatch and combine posted in the doorbell page, and a last post
         * whose length is wrong. */
        for (int variant = 0; variant < 3; variant++) {
                const int expand = variant == 1;
                const unsigned page = variant == 2 ? EPD_FUZZ_PAGE : 0;
                b.len = 0;
                u8(&b, 0);
                region(&b, 0, 256, EPD_FUZZ_FILL_I32, 2, 1, 4);
                group_create(&b, 0, 0, 1, 4, 0, 4, 2, 0, 0, 64, 0);
                op(&b, EPD_FUZZ_OP_DISPATCH, 0);
                u8(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 4);
                u8(&b, page | 4 | expand); /* use_arena */
                u16(&b, expand ? 4 : 0);
                tensor(&b, 1, 0);        /* x */
                absent(&b);              /* scales */
                tensor(&b, 1, 256);      /* topk_idx */
                tensor(&b, 1, 512);      /* topk_weights */
                for (int i = 0; i < 6; i++)
                        absent(&b);
                if (page) /* a frame: the daemon takes the page first */
                        simple(&b, EPD_FUZZ_OP_STATS);
                op(&b, EPD_FUZZ_OP_DISPATCH, 0); /* cached: handle 1 */
                u8(&b, 0); u8(&b, 0); u8(&b, 1); u8(&b, 0);
                u8(&b, page | 4 | expand);
                u16(&b, expand ? 4 : 0);
                tensor(&b, 1, 0);
                absent(&b);
                absent(&b);
                tensor(&b, 1, 512);
                for (int i = 0; i < 6; i++)
                        absent(&b);
                if (page)
                        simple(&b, EPD_FUZZ_OP_STATS);
                op(&b, EPD_FUZZ_OP_COMBINE, 0);
                u8(&b, 0); u8(&b, 0); u8(&b, 1);
                u8(&b, page | expand);   /* apply_weights with EXPAND */
                u8(&b, 1);               /* one bias */
                tensor(&b, 1, 1024);     /* y: the handle's rows */
                tensor(&b, 1, 2048);     /* bias[0] */
                absent(&b);
                tensor(&b, 1, 3072);     /* combined */
                absent(&b);
                simple(&b, EPD_FUZZ_OP_STATS);
                if (page) {
                        /* A combine whose posted length is not the packed one (bit 3):
                         * the daemon closes the connection at the next frame. */
                        op(&b, EPD_FUZZ_OP_COMBINE, 0);
                        u8(&b, 0); u8(&b, 0); u8(&b, 1);
                        u8(&b, page | 8);
                        u8(&b, 0);
                        for (int i = 0; i < 5; i++)
                                absent(&b);
                        simple(&b, EPD_FUZZ_OP_STATS);
                }
                op(&b, EPD_FUZZ_OP_HANDLE_RELEASE, 0);
                u8(&b, 0); u8(&b, 0); u8(&b, 1);
                op(&b, EPD_FUZZ_OP_REGION_RELEASE, 0);
                u8(&b, 0);
                op(&b, EPD_FUZZ_OP_GROUP_LEAVE, 0);
                u8(&b, 0); u8(&b, 0);
                write_file("fuzz_request", variant == 2   ? "one_rank_arena_page"
                                           : expand ? "one_rank_expand_arena"
                                                    : "one_rank_arena",
                           &b);
        }

        /* One rank, fp8 (hidden 16, scale block 16), outputs in the client's own region. */
        b.len = 0;
        u8(&b, 0);
        region(&b, 0, 1024, EPD_FUZZ_FILL_I32, 2, 1, 4);
        group_create(&b, 0, 1, 1, 4, 0, 4, 2, 1, 2, 0, 0);
        op(&b, EPD_FUZZ_OP_DISPATCH, 0);
        u8(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 4);
        u8(&b, 0);
        u16(&b, 0);
        tensor(&b, 1, 0);          /* x: 4 x 16 fp8 */
        tensor(&b, 1, 64);         /* scales: 4 x 1 fp32 */
        tensor(&b, 1, 128);        /* topk_idx */
        absent(&b);                /* no weights */
        tensor(&b, 1, 1024);       /* recv_x: 4 x 16 */
        tensor(&b, 1, 2048);       /* recv_scales: 4 x 1 */
        tensor(&b, 1, 3072);       /* recv_topk_idx: 4 x 2 */
        absent(&b);
        tensor(&b, 1, 4096);       /* recv_src: 4 */
        absent(&b);
        op(&b, EPD_FUZZ_OP_COMBINE, 0);
        u8(&b, 0); u8(&b, 0); u8(&b, 1); u8(&b, 0); u8(&b, 0);
        tensor(&b, 1, 8192);
        absent(&b);
        absent(&b);
        tensor(&b, 1, 12288);
        absent(&b);
        write_file("fuzz_request", "one_rank_fp8_own_outputs", &b);

        /* Two ranks on two clients: both dispatch into their arenas, both combine. */
        b.len = 0;
        u8(&b, 1);
        region(&b, 0, 256, EPD_FUZZ_FILL_I32, 2, 1, 4);
        region(&b, 1, 256, EPD_FUZZ_FILL_I32, 2, 3, 4);
        group_create(&b, 0, 0, 2, 2, 0, 4, 2, 0, 0, 64, 0);
        group_join(&b, 1, 0, 1, 1);
        for (unsigned c = 0; c < 2; c++) {
                op(&b, EPD_FUZZ_OP_DISPATCH, c);
                u8(&b, 0); u8(&b, 0); u8(&b, 0); u8(&b, 4);
                u8(&b, 4);
                u16(&b, 0);
                tensor(&b, 1, 0);
                absent(&b);
                tensor(&b, 1, 256);
                tensor(&b, 1, 512);
                for (int i = 0; i < 6; i++)
                        absent(&b);
        }
        for (unsigned c = 0; c < 2; c++) {
                op(&b, EPD_FUZZ_OP_COMBINE, c);
                u8(&b, 0); u8(&b, 0); u8(&b, 1); u8(&b, 0); u8(&b, 0);
                tensor(&b, 1, 1024);
                absent(&b);
                absent(&b);
                tensor(&b, 1, 3072);
                absent(&b);
        }
        simple(&b, EPD_FUZZ_OP_STATS);
        write_file("fuzz_request", "two_ranks", &b);

        /* Two ranks, only one submits: the op times out; then a rank disconnects mid-op. */
        b.len = 0;
        u8(&b, 1);
        region(&b, 0, 256, EPD_FUZZ_FILL_I32, 2, 1, 4);
        group_create(&b, 0, 2, 2, 2, 0, 4, 2, 0, 0, 64, 0);
        group_join(&b, 1, 2, 1, 0);
        small_dispatch(&b, 0, 4);
        op(&b, EPD_FUZZ_OP_PUMP, 0);
        u8(&b, 7);
        op(&b, EPD_FUZZ_OP_PUMP, 0);
        u8(&b, 7);
        op(&b, EPD_FUZZ_OP_PUMP, 0);
        u8(&b, 7);
        small_dispatch(&b, 0, 4);
        op(&b, EPD_FUZZ_OP_DISCONNECT, 1);
        u8(&b, 1);
        group_join(&b, 1, 2, 1, 0);
        write_file("fuzz_request", "timeout_and_disconnect", &b);

        /* Stream ordering: a dispatch that waits for inputs_ready, released by the doorbell. */
        b.len = 0;
        u8(&b, 0);
        region(&b, 0, 256, EPD_FUZZ_FILL_I32, 2, 1, 4);
        group_create(&b, 0, 3, 1, 4, 0, 4, 2, 0, 0, 64, 0);
        small_dispatch(&b, 0, 4 | 16);
        op(&b, EPD_FUZZ_OP_RING, 0);
        u8(&b, 0);
        u8(&b, 1);
        small_dispatch(&b, 0, 4 | 16);
        op(&b, EPD_FUZZ_OP_DISCONNECT, 0);
        u8(&b, 0);
        write_file("fuzz_request", "doorbell", &b);

        /* Overlap: commands do not wait for the op. Rank 1's inputs hold it while rank 0's
         * client dies and comes back on device 1 (a new arena), then rank 1 rings. */
        b.len = 0;
        u8(&b, EPD_FUZZ_OVERLAP); /* 0x40 % 3 == 1: two clients */
        region(&b, 0, 256, EPD_FUZZ_FILL_I32, 2, 1, 4);
        region(&b, 1, 256, EPD_FUZZ_FILL_I32, 2, 3, 4);
        group_create(&b, 0, 3, 2, 2, 0, 4, 2, 0, 0, 64, 0);
        group_join(&b, 1, 3, 1, 0);
        for (unsigned c = 0; c < 2; c++)
                small_dispatch(&b, c, c ? 4 | 16 : 4);
        op(&b, EPD_FUZZ_OP_DISCONNECT, 0);
        u8(&b, 1);
        group_join(&b, 0, 3, 0, 1);
        op(&b, EPD_FUZZ_OP_RING, 1);
        u8(&b, 0);
        u8(&b, 1);
        simple(&b, EPD_FUZZ_OP_STATS);
        write_file("fuzz_request", "overlap_rebind", &b);

        /* Admin verbs around live ops: drain a group (its ops wait), undrain (they run),
         * resize its arenas, fetch the segments, drain and undrain the daemon, evict a rank. */
        b.len = 0;
        u8(&b, 1);
        region(&b, 0, 256, EPD_FUZZ_FILL_I32, 2, 1, 4);
        region(&b, 1, 256, EPD_FUZZ_FILL_I32, 2, 3, 4);
        group_create(&b, 0, 0, 2, 2, 0, 4, 2, 0, 0, 16, 0);
        group_join(&b, 1, 0, 1, 1);
        op(&b, EPD_FUZZ_OP_DRAIN, 0);
        u8(&b, 0); u8(&b, 9); u8(&b, 1);       /* drain "g0" by name */
        for (int round = 0; round < 2; round++) {
                for (unsigned c = 0; c < 2; c++) {
                        small_dispatch(&b, c, 4);
                }
                if (round == 0) {
                        op(&b, EPD_FUZZ_OP_DRAIN, 0);
                        u8(&b, 1); u8(&b, 0); u8(&b, 0); /* undrain by id */
                        op(&b, EPD_FUZZ_OP_RESIZE, 0);
                        u8(&b, 0); u8(&b, 0); u16(&b, 48); /* 48 KiB by id */
                }
        }
        op(&b, EPD_FUZZ_OP_ARENA_SEGMENTS, 0);
        u8(&b, 0); u8(&b, 0); u8(&b, 0);
        op(&b, EPD_FUZZ_OP_ARENA_SEGMENTS, 1);
        u8(&b, 0); u8(&b, 0); u8(&b, 1);
        op(&b, EPD_FUZZ_OP_RESIZE, 1);
        u8(&b, 0); u8(&b, 1); u16(&b, 8);      /* shrink "g0" to 8 KiB */
        op(&b, EPD_FUZZ_OP_DRAIN, 0);
        u8(&b, 2); u8(&b, 0); u8(&b, 0);       /* drain the daemon */
        op(&b, EPD_FUZZ_OP_DRAIN, 1);
        u8(&b, 3); u8(&b, 0); u8(&b, 0);       /* undrain the daemon */
        op(&b, EPD_FUZZ_OP_EVICT, 0);
        u8(&b, 1);
        write_file("fuzz_request", "admin", &b);

        /* A client that stops reading: the daemon's socket fills, then the output queue,
         * and the daemon drops the client. */
        b.len = 0;
        u8(&b, 1);
        group_create(&b, 0, 0, 2, 2, 0, 4, 2, 0, 0, 16, 0);
        group_join(&b, 1, 0, 1, 0);
        op(&b, EPD_FUZZ_OP_MUTE, 1);
        for (int i = 0; i < 300; i++)
                op(&b, EPD_FUZZ_OP_STATS, 1);
        op(&b, EPD_FUZZ_OP_MUTE, 1);
        simple(&b, EPD_FUZZ_OP_LIST_CLIENTS);
        write_file("fuzz_request", "slow_reader", &b);

        /* Raw records: a broken header and too many fds. */
        b.len = 0;
        u8(&b, 1);
        op(&b, EPD_FUZZ_OP_RAW_RECORD, 0);
        u16(&b, 4);
        put(&b, "EPDF", 4);
        u8(&b, 0);
        op(&b, EPD_FUZZ_OP_RAW_RECORD, 1);
        u16(&b, 0);
        u8(&b, 19);
        write_file("fuzz_request", "raw_records", &b);
}

/* ---- fuzz_config seeds ---- */

static void gen_config(void)
{
        static const char *const files[] = {
                "[daemon]\nsocket = /run/epd/epd.sock\nsocket_mode = 0660\nbackend = host\n"
                "log_level = info\nop_timeout_ms = 10000\narena_bytes = 64M\n"
                "allow_uids = 0, 1000\nallow_gids = 0x64\nadmin_group = wheel\n",
                "[limits]\nmax_clients = 256\nmax_groups = 64\nmax_regions_per_client = 1024\n"
                "max_region_bytes_per_client = 1T\nmax_outstanding_ops_per_client = 64\n"
                "max_frame_bytes = 64KiB\nmax_fds_per_frame = 8\nmax_output_queue_bytes = 8MB\n",
                "[host]\ndevices = 2\nthreads = 0\n; comment\n# comment\n",
                "[daemon]\nbogus = 1\n",
                "[limits]\nmax_fds_per_frame = 17\n",
                "no section = here\n[unterminated\n",
        };
        struct buf b;
        char name[32];

        for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
                b.len = 0;
                put(&b, files[i], strlen(files[i]));
                snprintf(name, sizeof(name), "config_%zu", i);
                write_file("fuzz_config", name, &b);
        }
        b.len = 0;
        put(&b, files[0], strlen(files[0]));
        u8(&b, 0);
        static const char sets[] = "daemon\tlog_level\tdebug\nlimits\tmax_clients\t0x10\n"
                                   "daemon\tsocket_mode\t-0\nhost\tthreads\t1K\n";
        put(&b, sets, strlen(sets));
        write_file("fuzz_config", "config_and_sets", &b);
}

int main(int argc, char **argv)
{
        if (argc != 2) {
                fprintf(stderr, "usage: gen_corpus DIR\n");
                return 2;
        }
        out_dir = argv[1];
        if (mkdir(out_dir, 0755) < 0 && errno != EEXIST) {
                perror(out_dir);
                return 1;
        }
        gen_frames();
        gen_requests();
        gen_config();
        return 0;
}
