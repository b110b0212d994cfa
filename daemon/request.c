/* request.c - see request.h.
 *
 * A compact request becomes the Request that protobuf-c would have unpacked from the same
 * fields, so that everything after the decode (epd_handle_request and the op's preparation)
 * reads one form. The whole tree lives in one allocation: the Request, its Dispatch or Combine,
 * the TensorRefs, and a copy of the client's struct whose size and stride arrays the TensorRefs
 * point into. Its base.unknown_fields holds a sentinel that protobuf-c never produces, which is
 * how epd_request_free tells the two forms apart. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "request.h"

struct compact_block {
        Epd__V1__Request req;
        Epd__V1__Dispatch dispatch;
        Epd__V1__Combine combine;
        Epd__V1__TensorRef refs[EPD_CT_DISPATCH_TENSORS];
        Epd__V1__TensorRef *bias[2];
        struct epd_compact_request raw;
};

static ProtobufCMessageUnknownField compact_sentinel;

/* The TensorRef of slot i, or NULL when the tensor is absent. */
static Epd__V1__TensorRef *tensor_ref(struct compact_block *b, unsigned i)
{
        struct epd_compact_tensor *t = &b->raw.t[i];
        Epd__V1__TensorRef *ref = &b->refs[i];

        if (t->region_id == 0)
                return NULL;
        epd__v1__tensor_ref__init(ref);
        ref->region_id = t->region_id;
        ref->offset = t->offset;
        ref->dtype = (Epd__V1__DType)t->dtype;
        ref->n_sizes = t->ndim;
        ref->sizes = t->sizes;
        ref->n_strides = t->n_strides;
        ref->strides = t->n_strides ? t->strides : NULL;
        return ref;
}

/* Whether the struct's own sizes hold together: kind, flags, tensor ranks and bias count. */
static int compact_check(const struct epd_compact_request *c, char *err, size_t err_len)
{
        const unsigned tensors = c->kind == EPD_COMPACT_DISPATCH ? EPD_CT_DISPATCH_TENSORS
                                                                 : EPD_CT_COMBINED_TOPK_WEIGHTS + 1;

        if (c->kind != EPD_COMPACT_DISPATCH && c->kind != EPD_COMPACT_COMBINE) {
                snprintf(err, err_len, "unknown kind %u", c->kind);
                return -1;
        }
        if (c->flags & ~EPD_COMPACT_FLAGS) {
                snprintf(err, err_len, "unknown flags 0x%x", c->flags & ~EPD_COMPACT_FLAGS);
                return -1;
        }
        if (c->kind == EPD_COMPACT_COMBINE && c->num_bias > 2) {
                snprintf(err, err_len, "%u biases; a compact combine holds at most 2", c->num_bias);
                return -1;
        }
        for (unsigned i = 0; i < EPD_CT_DISPATCH_TENSORS; i++) {
                const struct epd_compact_tensor *t = &c->t[i];
                if (t->region_id == 0)
                        continue;
                if (i >= tensors || (c->kind == EPD_COMPACT_COMBINE && i >= EPD_CT_BIAS0 &&
                                     i <= EPD_CT_BIAS1 && i - EPD_CT_BIAS0 >= c->num_bias)) {
                        snprintf(err, err_len, "tensor slot %u is not used by this request", i);
                        return -1;
                }
                if (t->ndim == 0 || t->ndim > EPD_COMPACT_MAX_DIMS ||
                    (t->n_strides != 0 && t->n_strides != t->ndim)) {
                        snprintf(err, err_len, "tensor slot %u has %u dims and %u strides", i,
                                 t->ndim, t->n_strides);
                        return -1;
                }
        }
        return 0;
}

Epd__V1__Request *epd_request_from_compact(const uint8_t *buf, size_t len, char *err,
                                           size_t err_len)
{
        struct compact_block *b;

        if (len != sizeof(struct epd_compact_request)) {
                snprintf(err, err_len, "a compact request of %zu bytes; it must be %zu", len,
                         sizeof(struct epd_compact_request));
                return NULL;
        }
        if (!(b = malloc(sizeof(*b)))) {
                snprintf(err, err_len, "out of memory");
                return NULL;
        }
        memcpy(&b->raw, buf, len);
        const struct epd_compact_request *c = &b->raw;
        if (compact_check(c, err, err_len) < 0) {
                free(b);
                return NULL;
        }
        epd__v1__request__init(&b->req);
        b->req.base.unknown_fields = &compact_sentinel;
        b->req.id = c->id;
        const int reply_in_doorbell = (c->flags & EPD_COMPACT_REPLY_IN_DOORBELL) != 0;
        const int compact_reply = (c->flags & EPD_COMPACT_REPLY) != 0;
        if (c->kind == EPD_COMPACT_DISPATCH) {
                Epd__V1__Dispatch *m = &b->dispatch;
                epd__v1__dispatch__init(m);
                m->group_id = c->group_id;
                m->rank = c->rank;
                m->handle_id = c->handle_id;
                m->num_tokens = c->num_tokens;
                m->x = tensor_ref(b, EPD_CT_X);
                m->scales = tensor_ref(b, EPD_CT_SCALES);
                m->topk_idx = tensor_ref(b, EPD_CT_TOPK_IDX);
                m->topk_weights = tensor_ref(b, EPD_CT_TOPK_WEIGHTS);
                m->layout = (Epd__V1__Layout)c->layout;
                m->expert_alignment = c->expert_alignment;
                m->zero_padding = (c->flags & EPD_COMPACT_ZERO_PADDING) != 0;
                m->use_arena = (c->flags & EPD_COMPACT_USE_ARENA) != 0;
                m->recv_x = tensor_ref(b, EPD_CT_RECV_X);
                m->recv_scales = tensor_ref(b, EPD_CT_RECV_SCALES);
                m->recv_topk_idx = tensor_ref(b, EPD_CT_RECV_TOPK_IDX);
                m->recv_weights = tensor_ref(b, EPD_CT_RECV_WEIGHTS);
                m->recv_src = tensor_ref(b, EPD_CT_RECV_SRC);
                m->recv_topk_slot = tensor_ref(b, EPD_CT_RECV_TOPK_SLOT);
                m->num_topk = c->num_topk;
                m->topk_idx_dtype = (Epd__V1__DType)c->topk_idx_dtype;
                m->wait_inputs = c->wait_inputs;
                m->reply_in_doorbell = reply_in_doorbell;
                m->compact_reply = compact_reply;
                b->req.body_case = EPD__V1__REQUEST__BODY_DISPATCH;
                b->req.dispatch = m;
        } else {
                Epd__V1__Combine *m = &b->combine;
                epd__v1__combine__init(m);
                m->group_id = c->group_id;
                m->rank = c->rank;
                m->handle_id = c->handle_id;
                m->y = tensor_ref(b, EPD_CT_Y);
                m->apply_weights = (c->flags & EPD_COMPACT_APPLY_WEIGHTS) != 0;
                /* A listed bias may be absent (region 0), as in a packed Combine. */
                for (unsigned i = 0; i < c->num_bias; i++)
                        b->bias[i] = tensor_ref(b, EPD_CT_BIAS0 + i);
                m->n_bias = c->num_bias;
                m->bias = c->num_bias ? b->bias : NULL;
                m->combined = tensor_ref(b, EPD_CT_COMBINED);
                m->combined_topk_weights = tensor_ref(b, EPD_CT_COMBINED_TOPK_WEIGHTS);
                m->wait_inputs = c->wait_inputs;
                m->reply_in_doorbell = reply_in_doorbell;
                m->compact_reply = compact_reply;
                b->req.body_case = EPD__V1__REQUEST__BODY_COMBINE;
                b->req.combine = m;
        }
        return &b->req;
}

void epd_request_free(Epd__V1__Request *req)
{
        if (req && req->base.unknown_fields == &compact_sentinel)
                free(req); /* the first member of its struct compact_block */
        else if (req)
                epd__v1__request__free_unpacked(req, NULL);
}
