/* compact.c - see compact.h. */
#include <string.h>

#include "compact.h"

/* A TensorRef as a compact tensor; 0 when it does not fit one. A malformed one (no sizes, or
 * strides that do not match them) does not either: packed, it fails its op with a clear error,
 * where the daemon would refuse the compact struct as a protocol error. */
static int compact_tensor(const Epd__V1__TensorRef *ref, struct epd_compact_tensor *t)
{
        memset(t, 0, sizeof(*t));
        if (!ref || ref->region_id == 0)
                return 1;
        if (ref->n_sizes == 0 || ref->n_sizes > EPD_COMPACT_MAX_DIMS ||
            (ref->n_strides != 0 && ref->n_strides != ref->n_sizes))
                return 0;
        t->region_id = ref->region_id;
        t->offset = ref->offset;
        t->dtype = (uint32_t)ref->dtype;
        t->ndim = (uint32_t)ref->n_sizes;
        t->n_strides = (uint32_t)ref->n_strides;
        memcpy(t->sizes, ref->sizes, ref->n_sizes * sizeof(uint64_t));
        if (ref->n_strides)
                memcpy(t->strides, ref->strides, ref->n_strides * sizeof(uint64_t));
        return 1;
}

int epd__compact_request(const Epd__V1__Request *req, struct epd_compact_request *c)
{
        int ok = 1;

        memset(c, 0, sizeof(*c));
        c->id = req->id;
        if (req->body_case == EPD__V1__REQUEST__BODY_DISPATCH) {
                const Epd__V1__Dispatch *m = req->dispatch;
                const Epd__V1__TensorRef *t[EPD_CT_DISPATCH_TENSORS] = {
                        [EPD_CT_X] = m->x, [EPD_CT_SCALES] = m->scales,
                        [EPD_CT_TOPK_IDX] = m->topk_idx, [EPD_CT_TOPK_WEIGHTS] = m->topk_weights,
                        [EPD_CT_RECV_X] = m->recv_x, [EPD_CT_RECV_SCALES] = m->recv_scales,
                        [EPD_CT_RECV_TOPK_IDX] = m->recv_topk_idx,
                        [EPD_CT_RECV_WEIGHTS] = m->recv_weights, [EPD_CT_RECV_SRC] = m->recv_src,
                        [EPD_CT_RECV_TOPK_SLOT] = m->recv_topk_slot,
                };
                c->kind = EPD_COMPACT_DISPATCH;
                c->rank = m->rank;
                c->group_id = m->group_id;
                c->handle_id = m->handle_id;
                c->wait_inputs = m->wait_inputs;
                c->num_tokens = m->num_tokens;
                c->num_topk = m->num_topk;
                c->layout = (uint32_t)m->layout;
                c->expert_alignment = m->expert_alignment;
                c->topk_idx_dtype = (uint32_t)m->topk_idx_dtype;
                c->flags = (m->zero_padding ? EPD_COMPACT_ZERO_PADDING : 0) |
                           (m->use_arena ? EPD_COMPACT_USE_ARENA : 0) |
                           (m->reply_in_doorbell ? EPD_COMPACT_REPLY_IN_DOORBELL : 0) |
                           (m->compact_reply ? EPD_COMPACT_REPLY : 0);
                for (unsigned i = 0; i < EPD_CT_DISPATCH_TENSORS; i++)
                        ok &= compact_tensor(t[i], &c->t[i]);
                return ok;
        }
        const Epd__V1__Combine *m = req->combine;
        if (m->n_bias > 2)
                return 0;
        c->kind = EPD_COMPACT_COMBINE;
        c->rank = m->rank;
        c->group_id = m->group_id;
        c->handle_id = m->handle_id;
        c->wait_inputs = m->wait_inputs;
        c->num_bias = (uint32_t)m->n_bias;
        c->flags = (m->apply_weights ? EPD_COMPACT_APPLY_WEIGHTS : 0) |
                   (m->reply_in_doorbell ? EPD_COMPACT_REPLY_IN_DOORBELL : 0) |
                   (m->compact_reply ? EPD_COMPACT_REPLY : 0);
        ok &= compact_tensor(m->y, &c->t[EPD_CT_Y]);
        for (size_t b = 0; b < m->n_bias; b++)
                ok &= compact_tensor(m->bias[b], &c->t[EPD_CT_BIAS0 + b]);
        ok &= compact_tensor(m->combined, &c->t[EPD_CT_COMBINED]);
        ok &= compact_tensor(m->combined_topk_weights, &c->t[EPD_CT_COMBINED_TOPK_WEIGHTS]);
        return ok;
}
