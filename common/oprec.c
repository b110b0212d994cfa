/* oprec.c - see oprec.h. The byte layout, all integers little-endian (docs/architecture.md,
 * "Op records", has the same table):
 *
 *   every record        0 u16 version   2 u16 kind   4 u32 size (bytes of the whole record)
 *                       8 u64 id
 *   request            16 u64 group_id            24 u32 rank          28 u32 flags
 *                      32 u64 handle_id           40 u64 wait_inputs
 *                      48 u32 num_tokens          52 u32 num_topk
 *                      56 u32 layout              60 u32 expert_alignment
 *                      64 u32 topk_idx_dtype      68 u32 num_bias
 *                      72 tensor[10], 96 bytes each (a combine uses 7: y, bias[0], bias[1],
 *                         combined, combined_topk_weights, recv_weights, source_weights):
 *                         +0 u64 region_id  +8 u64 offset  +16 u32 dtype  +20 u32 ndim
 *                         +24 u64 reserved (0)  +32 u64 sizes[4]  +64 u64 strides[4]
 *                    1032 end
 *   reply              16 u32 status (wire StatusCode)  20 u32 message_bytes (NUL included)
 *                      24 u64 op_number   32 u64 handle_id
 *                      40 i64 num_tokens  48 i64 num_expanded_rows
 *                      56 u64 exec_ns     64 u64 queue_ns     72 u64 kernel_ns
 *                      80 u64 received_ns 88 u64 launched_ns  96 u64 exec_start_ns
 *                     104 u64 completed_ns                   112 u64 replied_ns
 *                     120 u64 arena_region_id 128 u64 arena_generation 136 u64 arena_bytes
 *                     144 u32 num_local_experts (L)          148 u32 world_size (R)
 *                     152 output[6], 32 bytes each:
 *                         +0 u64 offset  +8 u64 rows  +16 u64 cols  +24 u32 dtype  +28 u32 0
 *                     344 i32 counts[2 L + R + 1] when L or R is non-zero (dispatch only),
 *                         then message_bytes of message
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "oprec.h"
#include "util.h"

/* A reply's counts are read in place (oprec.h): the host must share the wire's byte order. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "op records assume a little-endian host");
_Static_assert(EPD_OPREC_REQUEST_BYTES == 1032, "request record layout");
_Static_assert(EPD_OPREC_REPLY_HEADER_BYTES == 344, "reply record layout");
_Static_assert(EPD_OPREC_REPLY_HEADER_BYTES % 8 == 0, "counts start 8-byte aligned");
_Static_assert(EPD_TENSOR_MAX_DIMS == 4, "a record tensor holds 4 dims");

enum {
        OFF_VERSION = 0, OFF_KIND = 2, OFF_SIZE = 4, OFF_ID = 8,
        /* request */
        OFF_GROUP = 16, OFF_RANK = 24, OFF_FLAGS = 28, OFF_HANDLE = 32, OFF_WAIT = 40,
        OFF_NUM_TOKENS = 48, OFF_NUM_TOPK = 52, OFF_LAYOUT = 56, OFF_ALIGNMENT = 60,
        OFF_TOPK_DTYPE = 64, OFF_NUM_BIAS = 68, OFF_TENSORS = 72,
        T_REGION = 0, T_OFFSET = 8, T_DTYPE = 16, T_NDIM = 20, T_RESERVED = 24, T_SIZES = 32,
        T_STRIDES = 64,
        /* reply */
        OFF_STATUS = 16, OFF_MESSAGE_BYTES = 20, OFF_OP_NUMBER = 24, OFF_R_HANDLE = 32,
        OFF_R_TOKENS = 40, OFF_R_ROWS = 48, OFF_EXEC = 56, OFF_QUEUE = 64, OFF_KERNEL = 72,
        OFF_RECEIVED = 80, OFF_LAUNCHED = 88, OFF_EXEC_START = 96, OFF_COMPLETED = 104,
        OFF_REPLIED = 112, OFF_ARENA_REGION = 120, OFF_ARENA_GEN = 128, OFF_ARENA_BYTES = 136,
        OFF_L = 144, OFF_R = 148, OFF_OUTPUTS = 152,
        O_OFFSET = 0, O_ROWS = 8, O_COLS = 16, O_DTYPE = 24, O_RESERVED = 28,
};

static void put16(uint8_t *p, uint16_t v)
{
        p[0] = (uint8_t)v;
        p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v)
{
        for (int i = 0; i < 4; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
        for (int i = 0; i < 8; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get16(const uint8_t *p)
{
        return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get32(const uint8_t *p)
{
        uint32_t v = 0;

        for (int i = 3; i >= 0; i--)
                v = (v << 8) | p[i];
        return v;
}

static uint64_t get64(const uint8_t *p)
{
        uint64_t v = 0;

        for (int i = 7; i >= 0; i--)
                v = (v << 8) | p[i];
        return v;
}

static int fail(int code, char *err, size_t err_len, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

static int fail(int code, char *err, size_t err_len, const char *fmt, ...)
{
        va_list ap;

        if (err && err_len) {
                va_start(ap, fmt);
                vsnprintf(err, err_len, fmt, ap);
                va_end(ap);
        }
        return code;
}

const char *epd_oprec_kind_name(uint32_t kind)
{
        return kind == EPD_OPREC_DISPATCH ? "dispatch" : kind == EPD_OPREC_COMBINE ? "combine"
                                                                                 : "unknown op";
}

static const char *const dispatch_slot_names[EPD_OPREC_TENSORS] = {
        "x", "scales", "topk_idx", "topk_weights", "recv_x", "recv_scales", "recv_topk_idx",
        "recv_weights", "recv_src", "recv_topk_slot",
};
static const char *const combine_slot_names[EPD_OPREC_COMBINE_TENSORS] = {
        "y", "bias[0]", "bias[1]", "combined", "combined_topk_weights", "recv_weights",
        "source_weights",
};

static const char *slot_name(uint32_t kind, unsigned i)
{
        if (kind == EPD_OPREC_DISPATCH)
                return dispatch_slot_names[i];
        return i < EPD_OPREC_COMBINE_TENSORS ? combine_slot_names[i] : "unused slot";
}

/* The checks a request must pass, on the native form: the encoder runs them before it writes,
 * the decoder after it read, so both sides refuse the same records. */
static int request_check(const struct epd_op_request *q, char *err, size_t err_len)
{
        unsigned used;

        if (q->kind != EPD_OPREC_DISPATCH && q->kind != EPD_OPREC_COMBINE)
                return fail(EPD_OPREC_BAD_ENUM, err, err_len, "unknown op kind %u", q->kind);
        const uint32_t allowed = q->kind == EPD_OPREC_DISPATCH ? EPD_OPREC_DISPATCH_FLAGS
                                                               : EPD_OPREC_COMBINE_FLAGS;
        if (q->flags & ~allowed)
                return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len, "flags 0x%x unknown to a %s",
                            q->flags & ~allowed, epd_oprec_kind_name(q->kind));
        if (q->kind == EPD_OPREC_DISPATCH) {
                if ((uint32_t)q->layout > EPD_LAYOUT_EXPAND)
                        return fail(EPD_OPREC_BAD_ENUM, err, err_len, "unknown layout %u",
                                    (uint32_t)q->layout);
                if ((uint32_t)q->topk_idx_dtype > EPD_DTYPE_INT64)
                        return fail(EPD_OPREC_BAD_ENUM, err, err_len, "unknown topk_idx dtype %u",
                                    (uint32_t)q->topk_idx_dtype);
                if (q->num_bias)
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "a dispatch has no biases (num_bias %u)", q->num_bias);
                used = EPD_OPREC_TENSORS;
        } else {
                if (q->num_tokens || q->num_topk || q->expert_alignment || q->layout ||
                    q->topk_idx_dtype)
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "a combine sets dispatch fields");
                if (q->num_bias > 2)
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "%u biases; at most 2", q->num_bias);
                used = EPD_OPREC_COMBINE_TENSORS;
        }
        for (unsigned i = 0; i < EPD_OPREC_TENSORS; i++) {
                const struct epd_tensor *t = &q->t[i];
                if (t->region_id == 0)
                        continue;
                if (i >= used || (q->kind == EPD_OPREC_COMBINE && i >= EPD_OPREC_BIAS0 &&
                                  i <= EPD_OPREC_BIAS1 && i - EPD_OPREC_BIAS0 >= q->num_bias))
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "tensor slot %u is not used by this %s", i,
                                    epd_oprec_kind_name(q->kind));
                if ((uint32_t)t->dtype > EPD_DTYPE_INT64)
                        return fail(EPD_OPREC_BAD_ENUM, err, err_len, "%s: unknown dtype %u",
                                    slot_name(q->kind, i), (uint32_t)t->dtype);
                if (t->ndim == 0 || t->ndim > EPD_TENSOR_MAX_DIMS)
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "%s: %u dims; 1 to %d", slot_name(q->kind, i), t->ndim,
                                    EPD_TENSOR_MAX_DIMS);
                for (unsigned k = t->ndim; k < EPD_TENSOR_MAX_DIMS; k++)
                        if (t->sizes[k] || t->strides[k])
                                return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                            "%s: size or stride beyond its %u dims",
                                            slot_name(q->kind, i), t->ndim);
        }
        return 0;
}

int epd_oprec_request_encode(const struct epd_op_request *q, uint8_t *buf, size_t buf_len,
                             char *err, size_t err_len)
{
        int rc = request_check(q, err, err_len);

        if (rc < 0)
                return rc;
        if (buf_len < EPD_OPREC_REQUEST_BYTES)
                return fail(EPD_OPREC_BAD_SIZE, err, err_len, "%zu bytes hold no %u-byte record",
                            buf_len, EPD_OPREC_REQUEST_BYTES);
        memset(buf, 0, EPD_OPREC_REQUEST_BYTES);
        put16(buf + OFF_VERSION, EPD_OPREC_VERSION);
        put16(buf + OFF_KIND, (uint16_t)q->kind);
        put32(buf + OFF_SIZE, EPD_OPREC_REQUEST_BYTES);
        put64(buf + OFF_ID, q->id);
        put64(buf + OFF_GROUP, q->group_id);
        put32(buf + OFF_RANK, q->rank);
        put32(buf + OFF_FLAGS, q->flags);
        put64(buf + OFF_HANDLE, q->handle_id);
        put64(buf + OFF_WAIT, q->wait_inputs);
        put32(buf + OFF_NUM_TOKENS, q->num_tokens);
        put32(buf + OFF_NUM_TOPK, q->num_topk);
        put32(buf + OFF_LAYOUT, (uint32_t)q->layout);
        put32(buf + OFF_ALIGNMENT, q->expert_alignment);
        put32(buf + OFF_TOPK_DTYPE, (uint32_t)q->topk_idx_dtype);
        put32(buf + OFF_NUM_BIAS, q->num_bias);
        for (unsigned i = 0; i < EPD_OPREC_TENSORS; i++) {
                const struct epd_tensor *t = &q->t[i];
                uint8_t *p = buf + OFF_TENSORS + i * EPD_OPREC_TENSOR_BYTES;
                if (t->region_id == 0)
                        continue; /* absent: all zero */
                put64(p + T_REGION, t->region_id);
                put64(p + T_OFFSET, t->offset);
                put32(p + T_DTYPE, (uint32_t)t->dtype);
                put32(p + T_NDIM, t->ndim);
                for (unsigned k = 0; k < EPD_TENSOR_MAX_DIMS; k++) {
                        put64(p + T_SIZES + 8 * k, t->sizes[k]);
                        put64(p + T_STRIDES + 8 * k, t->strides[k]);
                }
        }
        return (int)EPD_OPREC_REQUEST_BYTES;
}

/* The header every record starts with: truncation, version, and the stated size against len. */
static int header_check(const uint8_t *buf, size_t len, char *err, size_t err_len)
{
        if (len < EPD_OPREC_HEADER_BYTES)
                return fail(EPD_OPREC_TRUNCATED, err, err_len,
                            "%zu bytes, shorter than a record's %u-byte header", len,
                            EPD_OPREC_HEADER_BYTES);
        if (get16(buf + OFF_VERSION) != EPD_OPREC_VERSION)
                return fail(EPD_OPREC_BAD_VERSION, err, err_len,
                            "record version %u; this build reads version %u",
                            get16(buf + OFF_VERSION), EPD_OPREC_VERSION);
        const uint32_t size = get32(buf + OFF_SIZE);
        if (size > len)
                return fail(EPD_OPREC_TRUNCATED, err, err_len,
                            "record states %u bytes, %zu arrived", size, len);
        if (size < len)
                return fail(EPD_OPREC_BAD_SIZE, err, err_len,
                            "record states %u bytes, %zu arrived", size, len);
        return 0;
}

int epd_oprec_request_decode(const uint8_t *buf, size_t len, struct epd_op_request *out,
                             char *err, size_t err_len)
{
        struct epd_op_request q;
        int rc = header_check(buf, len, err, err_len);

        if (rc < 0)
                return rc;
        if (len != EPD_OPREC_REQUEST_BYTES)
                return fail(EPD_OPREC_BAD_SIZE, err, err_len,
                            "a request record of %zu bytes; it must be %u", len,
                            EPD_OPREC_REQUEST_BYTES);
        memset(&q, 0, sizeof(q));
        q.id = get64(buf + OFF_ID);
        q.kind = get16(buf + OFF_KIND);
        q.group_id = get64(buf + OFF_GROUP);
        q.rank = get32(buf + OFF_RANK);
        q.flags = get32(buf + OFF_FLAGS);
        q.handle_id = get64(buf + OFF_HANDLE);
        q.wait_inputs = get64(buf + OFF_WAIT);
        q.num_tokens = get32(buf + OFF_NUM_TOKENS);
        q.num_topk = get32(buf + OFF_NUM_TOPK);
        q.layout = (enum epd_layout)get32(buf + OFF_LAYOUT);
        q.expert_alignment = get32(buf + OFF_ALIGNMENT);
        q.topk_idx_dtype = (enum epd_dtype)get32(buf + OFF_TOPK_DTYPE);
        q.num_bias = get32(buf + OFF_NUM_BIAS);
        for (unsigned i = 0; i < EPD_OPREC_TENSORS; i++) {
                const uint8_t *p = buf + OFF_TENSORS + i * EPD_OPREC_TENSOR_BYTES;
                struct epd_tensor *t = &q.t[i];
                t->region_id = get64(p + T_REGION);
                if (t->region_id == 0)
                        continue;
                if (get64(p + T_RESERVED))
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "tensor slot %u: reserved bytes are not zero", i);
                t->offset = get64(p + T_OFFSET);
                t->dtype = (enum epd_dtype)get32(p + T_DTYPE);
                t->ndim = get32(p + T_NDIM);
                for (unsigned k = 0; k < EPD_TENSOR_MAX_DIMS; k++) {
                        t->sizes[k] = get64(p + T_SIZES + 8 * k);
                        t->strides[k] = get64(p + T_STRIDES + 8 * k);
                }
        }
        rc = request_check(&q, err, err_len);
        if (rc < 0)
                return rc;
        *out = q;
        return 0;
}

/* Counts a reply with L local experts and R ranks carries; 0 when both are 0. */
static uint64_t reply_counts(uint64_t L, uint64_t R)
{
        return L || R ? 2 * L + R + 1 : 0;
}

static size_t message_bytes(const struct epd_op_reply *rep)
{
        if (!rep->message || !rep->message[0])
                return 0;
        size_t n = strnlen(rep->message, EPD_OPREC_MESSAGE_MAX - 1);
        return n + 1;
}

size_t epd_oprec_reply_bytes(const struct epd_op_reply *rep)
{
        const uint64_t n = reply_counts(rep->num_local_experts, rep->world_size);

        if (n > EPD_OPREC_MAX_COUNTS)
                return 0;
        return EPD_OPREC_REPLY_HEADER_BYTES + (size_t)n * 4 + message_bytes(rep);
}

int epd_oprec_reply_encode(const struct epd_op_reply *rep, uint8_t *buf, size_t buf_len)
{
        const size_t len = epd_oprec_reply_bytes(rep);
        const uint32_t L = rep->num_local_experts, R = rep->world_size;

        if (len == 0)
                return EPD_OPREC_OUT_OF_RANGE;
        if (len > buf_len)
                return EPD_OPREC_BAD_SIZE;
        memset(buf, 0, EPD_OPREC_REPLY_HEADER_BYTES);
        put16(buf + OFF_VERSION, EPD_OPREC_VERSION);
        put16(buf + OFF_KIND, (uint16_t)rep->kind);
        put32(buf + OFF_SIZE, (uint32_t)len);
        put64(buf + OFF_ID, rep->id);
        put32(buf + OFF_STATUS, (uint32_t)epd__status_to_wire(rep->status));
        put32(buf + OFF_MESSAGE_BYTES, (uint32_t)message_bytes(rep));
        put64(buf + OFF_OP_NUMBER, rep->op_number);
        put64(buf + OFF_R_HANDLE, rep->handle_id);
        put64(buf + OFF_R_TOKENS, (uint64_t)rep->num_tokens);
        put64(buf + OFF_R_ROWS, (uint64_t)rep->num_expanded_rows);
        put64(buf + OFF_EXEC, rep->exec_ns);
        put64(buf + OFF_QUEUE, rep->queue_ns);
        put64(buf + OFF_KERNEL, rep->kernel_ns);
        put64(buf + OFF_RECEIVED, rep->received_ns);
        put64(buf + OFF_LAUNCHED, rep->launched_ns);
        put64(buf + OFF_EXEC_START, rep->exec_start_ns);
        put64(buf + OFF_COMPLETED, rep->completed_ns);
        put64(buf + OFF_REPLIED, rep->replied_ns);
        put64(buf + OFF_ARENA_REGION, rep->arena_region_id);
        put64(buf + OFF_ARENA_GEN, rep->arena_generation);
        put64(buf + OFF_ARENA_BYTES, rep->arena_bytes);
        put32(buf + OFF_L, L);
        put32(buf + OFF_R, R);
        for (unsigned f = 0; f < EPD_OPREC_OUTPUTS; f++) {
                const struct epd_oprec_output *o = &rep->out[f];
                uint8_t *p = buf + OFF_OUTPUTS + f * EPD_OPREC_OUTPUT_BYTES;
                if (o->dtype == EPD_DTYPE_INVALID)
                        continue;
                put64(p + O_OFFSET, o->offset);
                put64(p + O_ROWS, o->rows);
                put64(p + O_COLS, o->cols);
                put32(p + O_DTYPE, (uint32_t)o->dtype);
        }
        uint8_t *p = buf + EPD_OPREC_REPLY_HEADER_BYTES;
        const struct {
                const int32_t *v;
                uint32_t n;
        } arrays[3] = { { rep->per_expert, L }, { rep->per_expert_aligned, L },
                        { rep->rank_prefix, L || R ? R + 1 : 0 } };
        for (int a = 0; a < 3; a++) {
                for (uint32_t i = 0; i < arrays[a].n; i++)
                        put32(p + 4 * (size_t)i, arrays[a].v ? (uint32_t)arrays[a].v[i] : 0);
                p += 4 * (size_t)arrays[a].n;
        }
        const size_t msg = message_bytes(rep);
        if (msg) {
                memcpy(p, rep->message, msg - 1);
                p[msg - 1] = 0;
        }
        return (int)len;
}

int epd_oprec_reply_decode(const uint8_t *buf, size_t len, struct epd_op_reply *out, char *err,
                           size_t err_len)
{
        struct epd_op_reply rep;
        int rc;

        assert(((uintptr_t)buf & 3) == 0);
        rc = header_check(buf, len, err, err_len);
        if (rc < 0)
                return rc;
        if (len < EPD_OPREC_REPLY_HEADER_BYTES)
                return fail(EPD_OPREC_BAD_SIZE, err, err_len,
                            "a reply record of %zu bytes; its header alone is %u", len,
                            EPD_OPREC_REPLY_HEADER_BYTES);
        memset(&rep, 0, sizeof(rep));
        rep.id = get64(buf + OFF_ID);
        rep.kind = get16(buf + OFF_KIND);
        if (rep.kind != EPD_OPREC_DISPATCH && rep.kind != EPD_OPREC_COMBINE)
                return fail(EPD_OPREC_BAD_ENUM, err, err_len, "unknown op kind %u", rep.kind);
        const uint32_t code = get32(buf + OFF_STATUS);
        if (code >= EPD_STATUS_COUNT)
                return fail(EPD_OPREC_BAD_ENUM, err, err_len, "unknown status code %u", code);
        rep.status = epd__status_from_wire((int)code);
        rep.op_number = get64(buf + OFF_OP_NUMBER);
        rep.handle_id = get64(buf + OFF_R_HANDLE);
        rep.num_tokens = (int64_t)get64(buf + OFF_R_TOKENS);
        rep.num_expanded_rows = (int64_t)get64(buf + OFF_R_ROWS);
        rep.exec_ns = get64(buf + OFF_EXEC);
        rep.queue_ns = get64(buf + OFF_QUEUE);
        rep.kernel_ns = get64(buf + OFF_KERNEL);
        rep.received_ns = get64(buf + OFF_RECEIVED);
        rep.launched_ns = get64(buf + OFF_LAUNCHED);
        rep.exec_start_ns = get64(buf + OFF_EXEC_START);
        rep.completed_ns = get64(buf + OFF_COMPLETED);
        rep.replied_ns = get64(buf + OFF_REPLIED);
        rep.arena_region_id = get64(buf + OFF_ARENA_REGION);
        rep.arena_generation = get64(buf + OFF_ARENA_GEN);
        rep.arena_bytes = get64(buf + OFF_ARENA_BYTES);
        rep.num_local_experts = get32(buf + OFF_L);
        rep.world_size = get32(buf + OFF_R);
        for (unsigned f = 0; f < EPD_OPREC_OUTPUTS; f++) {
                const uint8_t *p = buf + OFF_OUTPUTS + f * EPD_OPREC_OUTPUT_BYTES;
                struct epd_oprec_output *o = &rep.out[f];
                const uint32_t dtype = get32(p + O_DTYPE);
                if (dtype > EPD_DTYPE_INT64)
                        return fail(EPD_OPREC_BAD_ENUM, err, err_len,
                                    "output %u: unknown dtype %u", f, dtype);
                if (get32(p + O_RESERVED))
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "output %u: reserved bytes are not zero", f);
                o->dtype = (enum epd_dtype)dtype;
                o->offset = get64(p + O_OFFSET);
                o->rows = get64(p + O_ROWS);
                o->cols = get64(p + O_COLS);
        }
        const uint64_t L = rep.num_local_experts, R = rep.world_size;
        const uint64_t n = reply_counts(L, R);
        if (n && rep.kind != EPD_OPREC_DISPATCH)
                return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                            "a combine reply with %llu counts", (unsigned long long)n);
        if (n > EPD_OPREC_MAX_COUNTS)
                return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                            "%llu counts; at most %u", (unsigned long long)n, EPD_OPREC_MAX_COUNTS);
        const uint32_t msg = get32(buf + OFF_MESSAGE_BYTES);
        if (msg > EPD_OPREC_MESSAGE_MAX)
                return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                            "a message of %u bytes; at most %u", msg, EPD_OPREC_MESSAGE_MAX);
        if (len != EPD_OPREC_REPLY_HEADER_BYTES + n * 4 + msg)
                return fail(EPD_OPREC_BAD_SIZE, err, err_len,
                            "a reply record of %zu bytes with %llu counts and a %u-byte message",
                            len, (unsigned long long)n, msg);
        const int32_t *counts = (const int32_t *)(buf + EPD_OPREC_REPLY_HEADER_BYTES);
        if (n) {
                rep.per_expert = counts;
                rep.per_expert_aligned = counts + L;
                rep.rank_prefix = counts + 2 * L;
        }
        if (msg) {
                const char *m = (const char *)(buf + EPD_OPREC_REPLY_HEADER_BYTES + n * 4);
                if (m[msg - 1] != 0 || strlen(m) != msg - 1)
                        return fail(EPD_OPREC_OUT_OF_RANGE, err, err_len,
                                    "the message is not one NUL-terminated string");
                rep.message = m;
        }
        *out = rep;
        return 0;
}
