/* unit_oprec.c - the op record (common/oprec.h): the one encoding of dispatch and combine
 * requests and replies.
 *
 * Covers: requests of both kinds and replies (success with counts, arena outputs and timeline;
 * failure with a message) survive encode and decode unchanged; the bytes sit at the documented
 * offsets in little-endian order; every check of the decoder fails with its own error (truncated,
 * bad version, bad size, bad enum, out of range) and leaves the output untouched; the encoder
 * refuses what the decoder would refuse; a message longer than the maximum is cut.
 * Each test runs in its own process (fork mode).
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "oprec.h"

static struct epd_tensor tensor(uint64_t region, uint64_t offset, enum epd_dtype dtype,
                                uint64_t rows, uint64_t cols, uint64_t stride)
{
        struct epd_tensor t;

        memset(&t, 0, sizeof(t));
        t.region_id = region;
        t.offset = offset;
        t.dtype = dtype;
        t.ndim = cols ? 2 : 1;
        t.sizes[0] = rows;
        t.sizes[1] = cols;
        t.strides[0] = stride;
        t.strides[1] = stride ? 1 : 0;
        return t;
}

static struct epd_op_request dispatch_request(void)
{
        struct epd_op_request q;

        memset(&q, 0, sizeof(q));
        q.id = 0x0102030405060708ull;
        q.kind = EPD_OPREC_DISPATCH;
        q.rank = 3;
        q.group_id = 99;
        q.handle_id = 7;
        q.wait_inputs = 12;
        q.flags = EPD_OPREC_ZERO_PADDING | EPD_OPREC_REPLY_IN_DOORBELL;
        q.num_tokens = 128;
        q.num_topk = 8;
        q.expert_alignment = 16;
        q.layout = EPD_LAYOUT_EXPAND;
        q.topk_idx_dtype = EPD_DTYPE_INT64;
        q.t[EPD_OPREC_X] = tensor(1, 64, EPD_DTYPE_BF16, 128, 7168, 7200);
        q.t[EPD_OPREC_TOPK_IDX] = tensor(1, 1 << 20, EPD_DTYPE_INT64, 128, 8, 0);
        q.t[EPD_OPREC_TOPK_WEIGHTS] = tensor(2, 0, EPD_DTYPE_FP32, 128, 8, 0);
        q.t[EPD_OPREC_RECV_X] = tensor(3, 0, EPD_DTYPE_BF16, 4096, 7168, 0);
        q.t[EPD_OPREC_RECV_TOPK_SLOT] = tensor(3, 1ull << 33, EPD_DTYPE_INT32, 4096, 0, 0);
        return q;
}

static struct epd_op_request combine_request(void)
{
        struct epd_op_request q;

        memset(&q, 0, sizeof(q));
        q.id = 5;
        q.kind = EPD_OPREC_COMBINE;
        q.group_id = 1;
        q.handle_id = 2;
        q.flags = EPD_OPREC_APPLY_WEIGHTS;
        q.num_bias = 2;
        q.t[EPD_OPREC_Y] = tensor(4, 0, EPD_DTYPE_BF16, 100, 64, 0);
        q.t[EPD_OPREC_BIAS0] = tensor(4, 4096, EPD_DTYPE_BF16, 10, 64, 0);
        /* bias[1] listed but absent, as on a rank without tokens */
        q.t[EPD_OPREC_COMBINED] = tensor(5, 0, EPD_DTYPE_BF16, 10, 64, 0);
        return q;
}

static void request_round_trip(const struct epd_op_request *q)
{
        uint8_t buf[EPD_OPREC_REQUEST_BYTES + 8];
        struct epd_op_request back;
        char err[160] = "";

        ck_assert_int_eq(epd_oprec_request_encode(q, buf, sizeof(buf), err, sizeof(err)),
                         (int)EPD_OPREC_REQUEST_BYTES);
        memset(&back, 0xa5, sizeof(back));
        ck_assert_int_eq(epd_oprec_request_decode(buf, EPD_OPREC_REQUEST_BYTES, &back, err,
                                                  sizeof(err)),
                         0);
        ck_assert_uint_eq(back.id, q->id);
        ck_assert_uint_eq(back.kind, q->kind);
        ck_assert_uint_eq(back.rank, q->rank);
        ck_assert_uint_eq(back.group_id, q->group_id);
        ck_assert_uint_eq(back.handle_id, q->handle_id);
        ck_assert_uint_eq(back.wait_inputs, q->wait_inputs);
        ck_assert_uint_eq(back.flags, q->flags);
        ck_assert_uint_eq(back.num_tokens, q->num_tokens);
        ck_assert_uint_eq(back.num_topk, q->num_topk);
        ck_assert_uint_eq(back.expert_alignment, q->expert_alignment);
        ck_assert_int_eq(back.layout, q->layout);
        ck_assert_int_eq(back.topk_idx_dtype, q->topk_idx_dtype);
        ck_assert_uint_eq(back.num_bias, q->num_bias);
        ck_assert_mem_eq(back.t, q->t, sizeof(q->t)); /* struct epd_tensor has no padding */
}

START_TEST(test_request_round_trip)
{
        struct epd_op_request d = dispatch_request(), c = combine_request(), e;

        request_round_trip(&d);
        request_round_trip(&c);
        /* docs/semantics.md §3's weight inputs ride in the combine's slots 5 and 6 */
        c.t[EPD_OPREC_COMBINE_RECV_WEIGHTS] = tensor(6, 512, EPD_DTYPE_FP32, 100, 4, 0);
        c.t[EPD_OPREC_SOURCE_WEIGHTS] = tensor(7, 64, EPD_DTYPE_FP32, 10, 4, 32);
        request_round_trip(&c);
        memset(&e, 0, sizeof(e));
        e.kind = EPD_OPREC_DISPATCH; /* every tensor absent: a rank without tokens */
        request_round_trip(&e);
}
END_TEST

/* The documented offsets (common/oprec.c, docs/architecture.md), little-endian. */
START_TEST(test_request_layout)
{
        struct epd_op_request q = dispatch_request();
        uint8_t buf[EPD_OPREC_REQUEST_BYTES];
        char err[160];

        ck_assert_int_eq(epd_oprec_request_encode(&q, buf, sizeof(buf), err, sizeof(err)),
                         (int)sizeof(buf));
        ck_assert_uint_eq(buf[0], EPD_OPREC_VERSION);
        ck_assert_uint_eq(buf[1], 0);
        ck_assert_uint_eq(buf[2], EPD_OPREC_DISPATCH);
        ck_assert_uint_eq(buf[4] | buf[5] << 8, EPD_OPREC_REQUEST_BYTES);
        ck_assert_uint_eq(buf[8], 0x08); /* id, least significant byte first */
        ck_assert_uint_eq(buf[15], 0x01);
        ck_assert_uint_eq(buf[16], 99);  /* group_id */
        ck_assert_uint_eq(buf[24], 3);   /* rank */
        ck_assert_uint_eq(buf[28], EPD_OPREC_ZERO_PADDING | EPD_OPREC_REPLY_IN_DOORBELL);
        ck_assert_uint_eq(buf[48], 128); /* num_tokens */
        ck_assert_uint_eq(buf[56], EPD_LAYOUT_EXPAND);
        /* tensor slot 0 (x): region 1, offset 64, bf16, 2 dims, [128, 7168], stride 7200 */
        const uint8_t *x = buf + 72;
        ck_assert_uint_eq(x[0], 1);
        ck_assert_uint_eq(x[8], 64);
        ck_assert_uint_eq(x[16], EPD_DTYPE_BF16);
        ck_assert_uint_eq(x[20], 2);
        ck_assert_uint_eq(x[40] | x[41] << 8, 7168);
        ck_assert_uint_eq(x[64] | x[65] << 8, 7200);
        /* slot 9 (recv_topk_slot): offset 2^33 */
        ck_assert_uint_eq(buf[72 + 9 * 96 + 8 + 4], 2);
}
END_TEST

/* Decodes buf and expects error `code` with `words` in the message; out stays untouched. */
static void expect_request_error(const uint8_t *buf, size_t len, int code, const char *words)
{
        struct epd_op_request out;
        char err[160] = "";

        memset(&out, 0x5a, sizeof(out));
        ck_assert_int_eq(epd_oprec_request_decode(buf, len, &out, err, sizeof(err)), code);
        ck_assert_msg(strstr(err, words) != NULL, "message '%s' lacks '%s'", err, words);
        for (size_t i = 0; i < sizeof(out); i++)
                ck_assert_uint_eq(((const uint8_t *)&out)[i], 0x5a);
}

START_TEST(test_request_errors)
{
        struct epd_op_request d = dispatch_request(), c = combine_request();
        uint8_t good[EPD_OPREC_REQUEST_BYTES], buf[EPD_OPREC_REQUEST_BYTES + 8];
        char err[160];

        ck_assert_int_gt(epd_oprec_request_encode(&d, good, sizeof(good), err, sizeof(err)), 0);
#define FRESH() memcpy(buf, good, sizeof(good))
        /* Truncated: shorter than the header, or than the size it states. */
        FRESH();
        expect_request_error(buf, 15, EPD_OPREC_TRUNCATED, "header");
        expect_request_error(buf, 0, EPD_OPREC_TRUNCATED, "header");
        expect_request_error(buf, sizeof(good) - 1, EPD_OPREC_TRUNCATED, "arrived");
        /* Bad version. */
        FRESH();
        buf[0] = 2;
        expect_request_error(buf, sizeof(good), EPD_OPREC_BAD_VERSION, "version 2");
        /* Bad size: more bytes than stated, or a stated size that is not a request's. */
        FRESH();
        expect_request_error(buf, sizeof(good) + 8, EPD_OPREC_BAD_SIZE, "states");
        FRESH();
        buf[4] = 16;
        buf[5] = 0;
        expect_request_error(buf, 16, EPD_OPREC_BAD_SIZE, "must be");
        /* Bad enums: kind, layout, topk_idx dtype, a tensor's dtype. */
        FRESH();
        buf[2] = 3;
        expect_request_error(buf, sizeof(good), EPD_OPREC_BAD_ENUM, "kind 3");
        FRESH();
        buf[56] = 2;
        expect_request_error(buf, sizeof(good), EPD_OPREC_BAD_ENUM, "layout 2");
        FRESH();
        buf[64] = 6;
        expect_request_error(buf, sizeof(good), EPD_OPREC_BAD_ENUM, "topk_idx dtype 6");
        FRESH();
        buf[72 + 16] = 9;
        expect_request_error(buf, sizeof(good), EPD_OPREC_BAD_ENUM, "x: unknown dtype 9");
        /* Out of range: flags, dims, sizes past ndim, reserved bytes, biases on a dispatch. */
        FRESH();
        buf[28] |= EPD_OPREC_APPLY_WEIGHTS;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "flags 0x4");
        FRESH();
        buf[72 + 20] = 5;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "x: 5 dims");
        FRESH();
        buf[72 + 20] = 0;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "x: 0 dims");
        FRESH();
        buf[72 + 32 + 2 * 8] = 1; /* sizes[2] of a 2-dim tensor */
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "beyond");
        FRESH();
        buf[72 + 24] = 1;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "reserved");
        FRESH();
        buf[68] = 1;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "no biases");

        /* A combine: three biases, a bias slot past num_bias, a slot a combine has not,
         * dispatch fields. */
        ck_assert_int_gt(epd_oprec_request_encode(&c, good, sizeof(good), err, sizeof(err)), 0);
        FRESH();
        buf[68] = 3;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "3 biases");
        FRESH();
        buf[68] = 0;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "slot 1");
        FRESH();
        memcpy(buf + 72 + 7 * 96, buf + 72, 96);
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "slot 7");
        FRESH();
        buf[48] = 1;
        expect_request_error(buf, sizeof(good), EPD_OPREC_OUT_OF_RANGE, "dispatch fields");
#undef FRESH
}
END_TEST

/* The combine's weight inputs: where they sit in the record, what the decoder refuses of them,
 * and that the slot after them is still no combine's. */
START_TEST(test_request_combine_weights)
{
        struct epd_op_request c = combine_request();
        uint8_t good[EPD_OPREC_REQUEST_BYTES], buf[EPD_OPREC_REQUEST_BYTES];
        struct epd_op_request back;
        char err[160];

        c.t[EPD_OPREC_COMBINE_RECV_WEIGHTS] = tensor(6, 512, EPD_DTYPE_FP32, 100, 4, 0);
        c.t[EPD_OPREC_SOURCE_WEIGHTS] = tensor(7, 64, EPD_DTYPE_FP32, 10, 4, 32);
        ck_assert_int_eq(epd_oprec_request_encode(&c, good, sizeof(good), err, sizeof(err)),
                         (int)sizeof(good));
        ck_assert_uint_eq(EPD_OPREC_COMBINE_RECV_WEIGHTS, 5);
        ck_assert_uint_eq(EPD_OPREC_SOURCE_WEIGHTS, 6);
        ck_assert_uint_eq(good[72 + 5 * 96], 6);      /* recv_weights' region_id */
        ck_assert_uint_eq(good[72 + 5 * 96 + 8] | good[72 + 5 * 96 + 9] << 8, 512);
        ck_assert_uint_eq(good[72 + 6 * 96], 7);      /* source_weights' region_id */
        ck_assert_uint_eq(good[72 + 6 * 96 + 16], EPD_DTYPE_FP32);
        ck_assert_uint_eq(good[72 + 6 * 96 + 64], 32); /* its row stride */

        memcpy(buf, good, sizeof(buf));
        buf[72 + 5 * 96 + 20] = 0; /* recv_weights with 0 dims */
        ck_assert_int_eq(epd_oprec_request_decode(buf, sizeof(buf), &back, err, sizeof(err)),
                         EPD_OPREC_OUT_OF_RANGE);
        ck_assert_ptr_nonnull(strstr(err, "recv_weights: 0 dims"));
        memcpy(buf, good, sizeof(buf));
        buf[72 + 6 * 96 + 16] = 0x77; /* source_weights of an unknown dtype */
        ck_assert_int_eq(epd_oprec_request_decode(buf, sizeof(buf), &back, err, sizeof(err)),
                         EPD_OPREC_BAD_ENUM);
        ck_assert_ptr_nonnull(strstr(err, "source_weights: unknown dtype"));
        memcpy(buf, good, sizeof(buf));
        memcpy(buf + 72 + 7 * 96, buf + 72 + 6 * 96, 96);
        ck_assert_int_eq(epd_oprec_request_decode(buf, sizeof(buf), &back, err, sizeof(err)),
                         EPD_OPREC_OUT_OF_RANGE);
        ck_assert_ptr_nonnull(strstr(err, "slot 7"));
        /* The encoder refuses the same. */
        c.t[EPD_OPREC_SOURCE_WEIGHTS].ndim = 5;
        ck_assert_int_eq(epd_oprec_request_encode(&c, buf, sizeof(buf), err, sizeof(err)),
                         EPD_OPREC_OUT_OF_RANGE);
        ck_assert_ptr_nonnull(strstr(err, "source_weights: 5 dims"));
}
END_TEST

/* The encoder runs the decoder's checks: a client cannot send what the daemon refuses. */
START_TEST(test_request_encode_refuses)
{
        struct epd_op_request q = dispatch_request();
        uint8_t buf[EPD_OPREC_REQUEST_BYTES];
        char err[160];

        q.t[EPD_OPREC_X].ndim = 0;
        ck_assert_int_eq(epd_oprec_request_encode(&q, buf, sizeof(buf), err, sizeof(err)),
                         EPD_OPREC_OUT_OF_RANGE);
        ck_assert_ptr_nonnull(strstr(err, "x: 0 dims"));
        q = dispatch_request();
        q.kind = 0;
        ck_assert_int_eq(epd_oprec_request_encode(&q, buf, sizeof(buf), err, sizeof(err)),
                         EPD_OPREC_BAD_ENUM);
        q = combine_request();
        q.num_bias = 3;
        ck_assert_int_eq(epd_oprec_request_encode(&q, buf, sizeof(buf), err, sizeof(err)),
                         EPD_OPREC_OUT_OF_RANGE);
        q = dispatch_request();
        ck_assert_int_eq(epd_oprec_request_encode(&q, buf, sizeof(buf) - 1, err, sizeof(err)),
                         EPD_OPREC_BAD_SIZE);
}
END_TEST

static int32_t counts_store[2 * 4 + 3];

static struct epd_op_reply dispatch_reply(void)
{
        struct epd_op_reply r;

        memset(&r, 0, sizeof(r));
        for (int i = 0; i < 11; i++)
                counts_store[i] = i * 3 - 5;
        r.id = 77;
        r.kind = EPD_OPREC_DISPATCH;
        r.status = EPD_OK;
        r.op_number = 12;
        r.handle_id = 4;
        r.num_tokens = 300;
        r.num_expanded_rows = 640;
        r.exec_ns = 1000;
        r.queue_ns = 2000;
        r.kernel_ns = 3000;
        r.received_ns = 10;
        r.launched_ns = 20;
        r.exec_start_ns = 30;
        r.completed_ns = 40;
        r.replied_ns = 50;
        r.arena_region_id = 9;
        r.arena_generation = 2;
        r.arena_bytes = 1ull << 30;
        r.out[EPD_OPREC_OUT_RECV_X] = (struct epd_oprec_output){ EPD_DTYPE_BF16, 4096, 640, 7168 };
        r.out[EPD_OPREC_OUT_RECV_SRC] = (struct epd_oprec_output){ EPD_DTYPE_INT64, 1 << 24, 640, 0 };
        r.num_local_experts = 4;
        r.world_size = 2;
        r.per_expert = counts_store;
        r.per_expert_aligned = counts_store + 4;
        r.rank_prefix = counts_store + 8;
        return r;
}

/* Encodes r, decodes it back and compares field by field (the pointers point into buf). */
static void reply_round_trip(const struct epd_op_reply *r, uint64_t *buf, size_t cap)
{
        struct epd_op_reply back;
        char err[160] = "";
        const size_t len = epd_oprec_reply_bytes(r);

        ck_assert_int_eq(epd_oprec_reply_encode(r, (uint8_t *)buf, cap), (int)len);
        ck_assert_int_eq(epd_oprec_reply_decode((const uint8_t *)buf, len, &back, err,
                                                sizeof(err)),
                         0);
        ck_assert_uint_eq(back.id, r->id);
        ck_assert_uint_eq(back.kind, r->kind);
        ck_assert_int_eq(back.status, r->status);
        ck_assert_uint_eq(back.op_number, r->op_number);
        ck_assert_uint_eq(back.handle_id, r->handle_id);
        ck_assert_int_eq(back.num_tokens, r->num_tokens);
        ck_assert_int_eq(back.num_expanded_rows, r->num_expanded_rows);
        ck_assert_uint_eq(back.exec_ns, r->exec_ns);
        ck_assert_uint_eq(back.queue_ns, r->queue_ns);
        ck_assert_uint_eq(back.kernel_ns, r->kernel_ns);
        ck_assert_uint_eq(back.received_ns, r->received_ns);
        ck_assert_uint_eq(back.launched_ns, r->launched_ns);
        ck_assert_uint_eq(back.exec_start_ns, r->exec_start_ns);
        ck_assert_uint_eq(back.completed_ns, r->completed_ns);
        ck_assert_uint_eq(back.replied_ns, r->replied_ns);
        ck_assert_uint_eq(back.arena_region_id, r->arena_region_id);
        ck_assert_uint_eq(back.arena_generation, r->arena_generation);
        ck_assert_uint_eq(back.arena_bytes, r->arena_bytes);
        ck_assert_mem_eq(back.out, r->out, sizeof(r->out));
        ck_assert_uint_eq(back.num_local_experts, r->num_local_experts);
        ck_assert_uint_eq(back.world_size, r->world_size);
        const uint32_t L = r->num_local_experts, R = r->world_size;
        if (L || R) {
                ck_assert_mem_eq(back.per_expert, r->per_expert, L * 4);
                ck_assert_mem_eq(back.per_expert_aligned, r->per_expert_aligned, L * 4);
                ck_assert_mem_eq(back.rank_prefix, r->rank_prefix, (R + 1) * 4);
        } else {
                ck_assert_ptr_null(back.per_expert);
        }
        if (r->message && r->message[0])
                ck_assert_str_eq(back.message, r->message);
        else
                ck_assert_ptr_null(back.message);
}

START_TEST(test_reply_round_trip)
{
        uint64_t buf[512];
        struct epd_op_reply r = dispatch_reply();

        ck_assert_uint_eq(epd_oprec_reply_bytes(&r), EPD_OPREC_REPLY_HEADER_BYTES + 11 * 4);
        reply_round_trip(&r, buf, sizeof(buf));
        /* A failure: status and message only. */
        memset(&r, 0, sizeof(r));
        r.id = 3;
        r.kind = EPD_OPREC_COMBINE;
        r.status = EPD_PEER_LOST;
        r.message = "group 'g' op 4: rank 1 was lost";
        ck_assert_uint_eq(epd_oprec_reply_bytes(&r),
                          EPD_OPREC_REPLY_HEADER_BYTES + strlen(r.message) + 1);
        reply_round_trip(&r, buf, sizeof(buf));
        /* A message beyond the maximum is cut to it. */
        char *long_msg = malloc(5000);
        ck_assert_ptr_nonnull(long_msg);
        memset(long_msg, 'z', 4999);
        long_msg[4999] = 0;
        r.message = long_msg;
        ck_assert_uint_eq(epd_oprec_reply_bytes(&r),
                          EPD_OPREC_REPLY_HEADER_BYTES + EPD_OPREC_MESSAGE_MAX);
        struct epd_op_reply back;
        char err[160];
        ck_assert_int_gt(epd_oprec_reply_encode(&r, (uint8_t *)buf, sizeof(buf)), 0);
        ck_assert_int_eq(epd_oprec_reply_decode((const uint8_t *)buf, epd_oprec_reply_bytes(&r),
                                                &back, err, sizeof(err)),
                         0);
        ck_assert_uint_eq(strlen(back.message), EPD_OPREC_MESSAGE_MAX - 1);
        free(long_msg);
        /* Too small a buffer. */
        r = dispatch_reply();
        ck_assert_int_eq(epd_oprec_reply_encode(&r, (uint8_t *)buf, EPD_OPREC_REPLY_HEADER_BYTES),
                         EPD_OPREC_BAD_SIZE);
}
END_TEST

static void expect_reply_error(const uint64_t *buf, size_t len, int code, const char *words)
{
        struct epd_op_reply out;
        char err[160] = "";

        memset(&out, 0x5a, sizeof(out));
        ck_assert_int_eq(epd_oprec_reply_decode((const uint8_t *)buf, len, &out, err, sizeof(err)),
                         code);
        ck_assert_msg(strstr(err, words) != NULL, "message '%s' lacks '%s'", err, words);
        for (size_t i = 0; i < sizeof(out); i++)
                ck_assert_uint_eq(((const uint8_t *)&out)[i], 0x5a);
}

START_TEST(test_reply_errors)
{
        uint64_t good[128], buf[130];
        uint8_t *b = (uint8_t *)buf;
        struct epd_op_reply r = dispatch_reply();
        const size_t len = epd_oprec_reply_bytes(&r);

        ck_assert_int_eq(epd_oprec_reply_encode(&r, (uint8_t *)good, sizeof(good)), (int)len);
#define FRESH() memcpy(buf, good, sizeof(good))
        FRESH();
        expect_reply_error(buf, 8, EPD_OPREC_TRUNCATED, "header");
        expect_reply_error(buf, len - 4, EPD_OPREC_TRUNCATED, "arrived");
        b[0] = 9;
        expect_reply_error(buf, len, EPD_OPREC_BAD_VERSION, "version 9");
        FRESH();
        b[4] = 100;
        b[5] = 0;
        expect_reply_error(buf, 100, EPD_OPREC_BAD_SIZE, "header alone");
        FRESH();
        b[4] += 4; /* states 4 more bytes than its counts and message need */
        expect_reply_error(buf, len + 4, EPD_OPREC_BAD_SIZE, "counts");
        FRESH();
        b[2] = 0;
        expect_reply_error(buf, len, EPD_OPREC_BAD_ENUM, "kind 0");
        FRESH();
        b[16] = 12; /* StatusCode past INTERNAL */
        expect_reply_error(buf, len, EPD_OPREC_BAD_ENUM, "status code 12");
        FRESH();
        b[152 + 24] = 6;
        expect_reply_error(buf, len, EPD_OPREC_BAD_ENUM, "output 0: unknown dtype 6");
        FRESH();
        b[152 + 28] = 1;
        expect_reply_error(buf, len, EPD_OPREC_OUT_OF_RANGE, "reserved");
        FRESH();
        b[2] = EPD_OPREC_COMBINE; /* a combine with counts */
        expect_reply_error(buf, len, EPD_OPREC_OUT_OF_RANGE, "combine reply with 11 counts");
        FRESH();
        b[144 + 3] = 0x10; /* L = 2^28 + 4: too many counts */
        expect_reply_error(buf, len, EPD_OPREC_OUT_OF_RANGE, "counts; at most");
        FRESH();
        b[20] = 0x01;
        b[21] = 0x10; /* a 4097-byte message */
        expect_reply_error(buf, len, EPD_OPREC_OUT_OF_RANGE, "message of 4097 bytes");
        /* A message without its NUL, or with one inside it. */
        FRESH();
        b[20] = 4;
        b[4] += 4;
        memcpy(b + len, "abcd", 4);
        expect_reply_error(buf, len + 4, EPD_OPREC_OUT_OF_RANGE, "NUL");
        memcpy(b + len, "a\0c\0", 4);
        expect_reply_error(buf, len + 4, EPD_OPREC_OUT_OF_RANGE, "NUL");
        memcpy(b + len, "abc\0", 4);
        struct epd_op_reply ok;
        char err[160];
        ck_assert_int_eq(epd_oprec_reply_decode(b, len + 4, &ok, err, sizeof(err)), 0);
        ck_assert_str_eq(ok.message, "abc");
#undef FRESH
}
END_TEST

int main(void)
{
        Suite *su = suite_create("unit_oprec");
        TCase *tc = tcase_create("oprec");
        SRunner *sr;
        int failed;

        tcase_add_test(tc, test_request_round_trip);
        tcase_add_test(tc, test_request_layout);
        tcase_add_test(tc, test_request_errors);
        tcase_add_test(tc, test_request_combine_weights);
        tcase_add_test(tc, test_request_encode_refuses);
        tcase_add_test(tc, test_reply_round_trip);
        tcase_add_test(tc, test_reply_errors);
        suite_add_tcase(su, tc);
        sr = srunner_create(su);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
