/* copy_token.cuh - how one source token's row reaches its destinations, shared by the copy step
 * (dispatch.cu, which reads each entry's expert and row from the workspace) and the one-launch
 * small dispatch (dispatch_small.cu, which computes them itself).
 *
 * A warp owns one source token, or one slice of its x row when an op has too few tokens to
 * fill the GPU (epd__k_slicing): it reads the bytes once, COPY_UNROLL accesses of 16 bytes in
 * flight per lane, and stores them to each destination that receives the token, then writes the
 * rows' metadata. Every output byte has exactly one writer: the entry's row names it.
 */
#ifndef EPD_KERNELS_COPY_TOKEN_CUH
#define EPD_KERNELS_COPY_TOKEN_CUH

#include <stdint.h>

#include "internal.cuh"

#ifndef COPY_UNROLL
#define COPY_UNROLL 4 /* 16-byte loads in flight per lane before the stores */
#endif
/* Slices of x rows (small ops) are multiples of one step of a warp on the 16-byte path (32
 * lanes x COPY_UNROLL vectors), so every slice starts on a step boundary. */
#define COPY_SLICE_UNIT (32 * 16 * COPY_UNROLL)

/* Copies nbytes from src to the row address each lane of dst_mask holds in my_dst, with
 * accesses of sizeof(V) bytes; every lane of the warp calls it with the same src, mask and size.
 * The source chunk is loaded once into registers and stored to every destination. */
template <typename V>
static __device__ __forceinline__ void copy_row_multi(const uint8_t *src, uint8_t *my_dst,
                                                      uint32_t dst_mask, uint64_t nbytes,
                                                      uint32_t lane)
{
        const uint64_t nvec = nbytes / sizeof(V);
        const V *s = (const V *)src;

        for (uint64_t base = 0; base < nvec; base += 32 * COPY_UNROLL) {
                V v[COPY_UNROLL];
#pragma unroll
                for (int u = 0; u < COPY_UNROLL; u++) {
                        uint64_t i = base + (uint64_t)u * 32 + lane;
                        v[u] = i < nvec ? epd__k_ldg(s + i) : epd__k_zero<V>();
                }
                for (uint32_t m = dst_mask; m != 0; m &= m - 1) {
                        int j = __ffs(m) - 1;
                        V *d = (V *)__shfl_sync(EPD_K_FULL_MASK, (unsigned long long)my_dst, j);
#pragma unroll
                        for (int u = 0; u < COPY_UNROLL; u++) {
                                uint64_t i = base + (uint64_t)u * 32 + lane;
                                if (i < nvec)
                                        d[i] = v[u];
                        }
                }
        }
}

/* align_bits: every address and size involved ORed together (low 32 bits suffice). */
static __device__ __noinline__ void copy_row_any(const uint8_t *src, uint8_t *my_dst,
                                                 uint32_t dst_mask, uint64_t nbytes,
                                                 uint32_t lane, uint32_t align_bits)
{
        switch (epd__k_access_width(align_bits)) {
        case 16:
                copy_row_multi<int4>(src, my_dst, dst_mask, nbytes, lane);
                break;
        case 8:
                copy_row_multi<uint2>(src, my_dst, dst_mask, nbytes, lane);
                break;
        case 4:
                copy_row_multi<unsigned int>(src, my_dst, dst_mask, nbytes, lane);
                break;
        case 2:
                copy_row_multi<unsigned short>(src, my_dst, dst_mask, nbytes, lane);
                break;
        default:
                copy_row_multi<unsigned char>(src, my_dst, dst_mask, nbytes, lane);
                break;
        }
}

/* The common case of an item, on the 16-byte path: its x bytes and, for slice 0, the scales
 * (svec 16-byte vectors, at most 32; ss NULL when there are none). The scales are loaded with the
 * first step's x loads and stored after them, so an item whose slice is one step waits one load
 * latency before its stores, not two, as it did when the scales were copied after the x bytes.
 * my_ds: this lane's destination scales row (NULL: that destination has none). */
static __device__ __forceinline__ void copy_row_scales16(const uint8_t *src, uint8_t *my_dst,
                                                         uint64_t nbytes, const uint8_t *ss,
                                                         uint8_t *my_ds, uint32_t svec,
                                                         uint32_t dst_mask, uint32_t lane)
{
        const uint64_t nvec = nbytes / 16;
        const int4 *s = (const int4 *)src;
        int4 sv = make_int4(0, 0, 0, 0);

        if (ss != NULL && lane < svec)
                sv = epd__k_ldg((const int4 *)ss + lane);
        /* base 0 always runs when there are scales, even for an empty x slice. */
        for (uint64_t base = 0; base < nvec || (base == 0 && ss != NULL);
             base += 32 * COPY_UNROLL) {
                int4 v[COPY_UNROLL];
#pragma unroll
                for (int u = 0; u < COPY_UNROLL; u++) {
                        uint64_t i = base + (uint64_t)u * 32 + lane;
                        v[u] = i < nvec ? epd__k_ldg(s + i) : make_int4(0, 0, 0, 0);
                }
                for (uint32_t m = dst_mask; m != 0; m &= m - 1) {
                        int j = __ffs(m) - 1;
                        int4 *d = (int4 *)__shfl_sync(EPD_K_FULL_MASK, (unsigned long long)my_dst, j);
#pragma unroll
                        for (int u = 0; u < COPY_UNROLL; u++) {
                                uint64_t i = base + (uint64_t)u * 32 + lane;
                                if (i < nvec)
                                        d[i] = v[u];
                        }
                }
                if (base != 0 || ss == NULL)
                        continue;
                for (uint32_t m = dst_mask; m != 0; m &= m - 1) {
                        int j = __ffs(m) - 1;
                        int4 *e = (int4 *)__shfl_sync(EPD_K_FULL_MASK, (unsigned long long)my_ds, j);
                        if (e != NULL && lane < svec)
                                e[lane] = sv;
                }
        }
}

static __device__ __forceinline__ uint8_t *mat_row(const struct epd_k_mat *m, int64_t row)
{
        return m->ptr + (uint64_t)row * m->stride;
}

/* One slice of token t of source s: bytes [slice * slice_bytes, + slice_bytes) of its x row (the
 * whole row when there is one slice). ranks: a->ranks, or its copy in shared memory. Lane k < K_op
 * holds the entry's normalised expert and its row (the destination row of a first position, -1 for
 * every other entry and lane). Slice 0 also moves the scales and writes the rows' metadata and the
 * weights kept for combine (entry `ent` onwards in the workspace). Every lane of the warp calls
 * it. */
static __device__ __forceinline__ void copy_token_rows(const struct epd_k_dispatch_args *a,
                                                       const struct epd_k_dispatch_rank *ranks,
                                                       const struct epd_ws_layout *l, uint32_t s,
                                                       uint32_t t, uint64_t ent, int32_t expert,
                                                       int32_t row, uint32_t slice,
                                                       uint64_t slice_bytes, uint32_t lane)
{
        const uint32_t L = l->num_local_experts, K = a->num_topk;
        const struct epd_k_dispatch_rank *src = &ranks[s];
        float weight = 0.0f;

        /* The weight is loaded first and stored into the workspace (kept for combine:
         * apply_weights, combined_topk_weights) only after the rows' stores, so that its load
         * overlaps the x loads instead of preceding them. */
        if (lane < K && a->has_weights)
                weight = ((const float *)mat_row(&src->weights, t))[lane];
        const uint32_t dst_mask = __ballot_sync(EPD_K_FULL_MASK, row >= 0);
        if (dst_mask != 0) {
                const uint32_t d = row >= 0 ? epd_route_expert_rank(expert, L) : 0;
                const struct epd_k_dispatch_rank *dst = &ranks[d];

                /* x: this item's slice. The access width depends on the whole row (addresses
                 * and row_bytes), and slices start at multiples of every width, so the accesses
                 * are the same with or without slicing. */
                const uint64_t off = (uint64_t)slice * slice_bytes;
                const uint8_t *sx = mat_row(&src->x, t);
                uint8_t *dx = row >= 0 ? mat_row(&dst->recv_x, row) : NULL;
                const uint32_t bits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)dx) |
                                      (uint32_t)(uintptr_t)sx | (uint32_t)a->row_bytes;
#ifndef COPY_LEAD
                const uint64_t nbytes = off < a->row_bytes ? min(slice_bytes, a->row_bytes - off)
                                                           : 0;
#else
                /* Experiment: slice 0, which also moves the scales and the metadata, takes
                 * COPY_LEAD fewer x bytes; the other slices share them, in 128-byte units. */
                uint64_t off2 = off, nbytes = off < a->row_bytes ? min(slice_bytes, a->row_bytes - off)
                                                                  : 0;
                if (slice_bytes < a->row_bytes && slice_bytes > COPY_LEAD) {
                        const uint64_t nsl = (a->row_bytes + slice_bytes - 1) / slice_bytes;
                        const uint64_t b0 = slice_bytes - COPY_LEAD;
                        const uint64_t sb1 = ((a->row_bytes - b0) / (nsl - 1) + 127) / 128 * 128;
                        off2 = slice == 0 ? 0 : b0 + (slice - 1) * sb1;
                        nbytes = slice == 0 ? b0
                                            : (off2 < a->row_bytes ? min(sb1, a->row_bytes - off2)
                                                                   : 0);
                }
#define off off2
#endif
                /* The scales (fp8) go with slice 0. A destination without a recv_scales tensor
                 * is skipped, not faulted. */
                const int scaled = slice == 0 && a->scale_bytes != 0 && src->scales.ptr != NULL;
                const uint8_t *ss = scaled ? mat_row(&src->scales, t) : NULL;
                uint8_t *ds = scaled && row >= 0 && dst->recv_scales.ptr != NULL
                                      ? mat_row(&dst->recv_scales, row)
                                      : NULL;
                const uint32_t sbits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)ds) |
                                       (uint32_t)(uintptr_t)ss | (uint32_t)a->scale_bytes;
                if ((bits & 15) == 0 && (!scaled || ((sbits & 15) == 0 &&
                                                     a->scale_bytes <= 32 * 16))) {
                        copy_row_scales16(sx + off, dx + (dx != NULL ? off : 0), nbytes, ss, ds,
                                          (uint32_t)(a->scale_bytes / 16), dst_mask, lane);
                } else {
                        if (nbytes != 0)
                                copy_row_any(sx + off, dx + (dx != NULL ? off : 0), dst_mask,
                                             nbytes, lane, bits);
                        if (scaled)
                                copy_row_any(ss, ds, __ballot_sync(EPD_K_FULL_MASK, ds != NULL),
                                             a->scale_bytes, lane, sbits);
                }
#ifdef COPY_LEAD
#undef off
#endif
        }
        if (slice != 0)
                return;
        if (lane < K && a->has_weights)
                epd_ws_f32(a->workspace, l->weights)[ent + lane] = weight;
        if (dst_mask == 0)
                return;
        const uint32_t d = row >= 0 ? epd_route_expert_rank(expert, L) : 0;
        const struct epd_k_dispatch_rank *dst = &ranks[d];

        /* Metadata. */
        const int64_t global_src = epd_route_global_src(s, a->max_tokens, t);
        if (row >= 0 && dst->recv_src.ptr != NULL)
                *(int64_t *)mat_row(&dst->recv_src, row) = global_src;
        if (a->layout == EPD_LAYOUT_EXPAND) {
                if (row >= 0) {
                        if (dst->recv_topk_slot.ptr != NULL)
                                *(int32_t *)mat_row(&dst->recv_topk_slot, row) = (int32_t)lane;
                        if (a->has_weights && dst->recv_weights.ptr != NULL)
                                *(float *)mat_row(&dst->recv_weights, row) = weight;
                }
                return;
        }
        /* NON_EXPAND: each receiving destination gets the token's whole top-k row, localised
         * to it; lane k writes column k of every such row. */
        for (uint32_t m = dst_mask; m != 0; m &= m - 1) {
                int j = __ffs(m) - 1;
                uint32_t dj = __shfl_sync(EPD_K_FULL_MASK, d, j);
                int32_t rj = __shfl_sync(EPD_K_FULL_MASK, row, j);
                const struct epd_k_dispatch_rank *dd = &ranks[dj];
                if (lane >= K)
                        continue;
                int on = expert >= 0 && epd_route_expert_rank(expert, L) == dj;
                if (dd->recv_topk_idx.ptr != NULL) {
                        uint8_t *p = mat_row(&dd->recv_topk_idx, rj);
                        int64_t v = on ? (int64_t)expert - (int64_t)dj * L : -1;
                        if (a->topk_dtype == EPD_DTYPE_INT64)
                                ((int64_t *)p)[lane] = v;
                        else
                                ((int32_t *)p)[lane] = (int32_t)v;
                }
                if (a->has_weights && dd->recv_weights.ptr != NULL)
                        ((float *)mat_row(&dd->recv_weights, rj))[lane] = on ? weight : 0.0f;
        }
}

#endif
