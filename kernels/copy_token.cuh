/* copy_token.cuh - how one source token's row reaches its destinations, shared by the copy step
 * (dispatch.cu, which reads each entry's expert and row from the workspace) and the one-launch
 * small dispatch (dispatch_small.cu, which computes them itself).
 *
 * A warp owns one source token, or one slice of its x row when an op has too few tokens to
 * fill the GPU (epd__k_slicing): it reads the bytes once, COPY_UNROLL accesses of 16 bytes in
 * flight per lane, and stores them to each destination that receives the token; the scales and
 * the rows' metadata are spread over the token's slices (copy_token_rows). Every output byte has
 * exactly one writer: the entry's row names the row, the slice the bytes within it.
 */
#ifndef EPD_KERNELS_COPY_TOKEN_CUH
#define EPD_KERNELS_COPY_TOKEN_CUH

#include <stdint.h>

#include "internal.cuh"

#define COPY_UNROLL 4 /* 16-byte loads in flight per lane before the stores */
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

static __device__ __forceinline__ uint8_t *mat_row(const struct epd_mat *m, int64_t row)
{
        return m->ptr + (uint64_t)row * m->stride;
}

/* The lane of the n-th (from 0) set bit of mask; n < popc(mask). */
static __device__ __forceinline__ int copy_nth_lane(uint32_t mask, uint32_t n)
{
        for (; n != 0; n--)
                mask &= mask - 1;
        return __ffs(mask) - 1;
}

/* The scales of a token (scale_bytes <= 512, every address and size a multiple of 16): loaded by
 * the caller before its x loads (copy_scales_load), stored after its x stores (copy_scales_store),
 * so that one load latency covers both. A destination takes copy_scales_lanes lanes: 16 when the
 * row is at most 16 vectors, so that one store instruction serves two destinations, else 32. */
static __device__ __forceinline__ uint32_t copy_scales_lanes(uint64_t scale_bytes)
{
        return scale_bytes <= 16 * 16 ? 16 : 32;
}

static __device__ __forceinline__ int4 copy_scales_load(const uint8_t *ss, uint64_t scale_bytes,
                                                        uint32_t lane)
{
        const uint32_t v = lane % copy_scales_lanes(scale_bytes);
        return v < scale_bytes / 16 ? epd__k_ldg((const int4 *)ss + v) : make_int4(0, 0, 0, 0);
}

static __device__ __forceinline__ void copy_scales_store(int4 sv, uint64_t scale_bytes,
                                                         uint8_t *my_ds, uint32_t dst_mask,
                                                         uint32_t lane)
{
        const uint32_t spl = copy_scales_lanes(scale_bytes), v = lane % spl;
        const uint32_t ndst = __popc(dst_mask), per = 32 / spl, h = lane / spl;

        for (uint32_t base = 0; base < ndst; base += per) {
                const uint32_t n = base + h;
                const int j = n < ndst ? copy_nth_lane(dst_mask, n) : 0;
                int4 *e = (int4 *)__shfl_sync(EPD_K_FULL_MASK, (unsigned long long)my_ds, j);
                if (n < ndst && e != NULL && v < scale_bytes / 16)
                        e[v] = sv;
        }
}

/* A token's parts besides its x bytes, each moved by slice (part % slices) of the token. */
enum copy_part {
        COPY_PART_SCALES = 0,  /* the scales (fp8) */
        COPY_PART_TOPK = 1,    /* NON_EXPAND: the rows' top-k indices; EXPAND: recv_topk_slot */
        COPY_PART_WEIGHTS = 2, /* the rows' weights, and the weights kept for combine */
        COPY_PART_SRC = 3      /* recv_src */
};

/* One slice of token t of source s: bytes [slice * slice_bytes, + slice_bytes) of its x row (the
 * whole row when there is one slice), of `slices`, and the parts whose number is slice modulo
 * slices. ranks: a->ranks, or its copy in shared memory. Lane k < K_op holds the entry's
 * normalised expert and its row (the destination row of a first position, -1 for every other
 * entry and lane). Every lane of the warp calls it.
 *
 * Why the parts are spread: a block ends with its slowest warp, and a slice-0 warp that also
 * moved the scales and all the metadata took half as long again as the others and ended every
 * copying block (per-warp traces of decode, 4 slices of 1792 bytes). A destination's small part
 * costs a warp about as much time as its share of x, and neither its bytes nor its store
 * instructions say why (every part on one short slice makes that slice the slowest), so each
 * part gets its own slice (docs/performance.md, "Design choices and their measured effect"),
 * and its stores serve several destinations per instruction where the lanes allow: the top-k
 * and weight rows 32 / K_op, the scales (up to 256 bytes) two. */
static __device__ __forceinline__ void copy_token_rows(const struct epd_k_dispatch_args *a,
                                                       const struct epd_k_dispatch_rank *ranks,
                                                       const struct epd_ws_layout *l, uint32_t s,
                                                       uint32_t t, uint64_t ent, int32_t expert,
                                                       int32_t row, uint32_t slice,
                                                       uint32_t slices, uint64_t slice_bytes,
                                                       uint32_t lane)
{
        const uint32_t L = l->num_local_experts, K = a->num_topk;
        const struct epd_k_dispatch_rank *src = &ranks[s];
        /* Does this slice move part p? */
#define COPY_MINE(p) (slice == (p) % slices)
        const int weights = COPY_MINE(COPY_PART_WEIGHTS) && a->has_weights;
        float weight = 0.0f;

        /* The weights' load overlaps the x loads; they are stored after the rows. */
        if (weights && lane < K)
                weight = ((const float *)mat_row(&src->in.weights, t))[lane];
        const uint32_t dst_mask = __ballot_sync(EPD_K_FULL_MASK, row >= 0);
        const uint32_t d = row >= 0 ? epd_route_expert_rank(expert, L) : 0;
        const struct epd_k_dispatch_rank *dst = &ranks[d];

        /* Kept for combine (apply_weights, combined_topk_weights), whether or not the token goes
         * anywhere. */
        if (weights && lane < K)
                epd_ws_f32(a->workspace, l->weights)[ent + lane] = weight;
        if (dst_mask == 0)
                return;

        /* The scales (fp8). A destination without a recv_scales tensor is skipped, not
         * faulted. */
        const int scaled =
                COPY_MINE(COPY_PART_SCALES) && a->scale_bytes != 0 && src->in.scales.ptr != NULL;
        const uint8_t *ss = scaled ? mat_row(&src->in.scales, t) : NULL;
        uint8_t *ds = scaled && row >= 0 && dst->out.recv_scales.ptr != NULL
                              ? mat_row(&dst->out.recv_scales, row)
                              : NULL;
        const uint32_t sbits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)ds) |
                               (uint32_t)(uintptr_t)ss | (uint32_t)a->scale_bytes;
        const int sfast = scaled && (sbits & 15) == 0 && a->scale_bytes <= 32 * 16;
        int4 sv = make_int4(0, 0, 0, 0);
        if (sfast)
                sv = copy_scales_load(ss, a->scale_bytes, lane);

        /* x: this item's slice. The access width depends on the whole row (addresses and
         * row_bytes), and slices start at multiples of every width, so the accesses are the
         * same with or without slicing. */
        const uint64_t off = (uint64_t)slice * slice_bytes;
        const uint8_t *sx = mat_row(&src->in.x, t);
        uint8_t *dx = row >= 0 ? mat_row(&dst->out.recv_x, row) : NULL;
        const uint32_t bits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)dx) |
                              (uint32_t)(uintptr_t)sx | (uint32_t)a->row_bytes;
        if (off < a->row_bytes) {
                const uint64_t nbytes = min(slice_bytes, a->row_bytes - off);
                uint8_t *my_dst = dx + (dx != NULL ? off : 0);
                if ((bits & 15) == 0) /* inline: the scales' load stays in flight */
                        copy_row_multi<int4>(sx + off, my_dst, dst_mask, nbytes, lane);
                else
                        copy_row_any(sx + off, my_dst, dst_mask, nbytes, lane, bits);
        }
        if (sfast)
                copy_scales_store(sv, a->scale_bytes, ds, dst_mask, lane);
        else if (scaled)
                copy_row_any(ss, ds, __ballot_sync(EPD_K_FULL_MASK, ds != NULL),
                             a->scale_bytes, lane, sbits);

        if (COPY_MINE(COPY_PART_SRC) && row >= 0 && dst->out.recv_src.ptr != NULL)
                *(int64_t *)mat_row(&dst->out.recv_src, row) =
                        epd_route_global_src(s, a->max_tokens, t);
        const int topk = COPY_MINE(COPY_PART_TOPK);
        if (a->layout == EPD_LAYOUT_EXPAND) {
                if (row >= 0) {
                        if (topk && dst->out.recv_topk_slot.ptr != NULL)
                                *(int32_t *)mat_row(&dst->out.recv_topk_slot, row) = (int32_t)lane;
                        if (weights && dst->out.recv_weights.ptr != NULL)
                                *(float *)mat_row(&dst->out.recv_weights, row) = weight;
                }
                return;
        }
        if (!topk && !weights)
                return;
        /* NON_EXPAND: each receiving destination gets the token's whole top-k row, localised to
         * it. Lane g * K + k writes column k of the row of destination base + g, 32 / K
         * destinations per store instruction. */
        const uint32_t ndst = __popc(dst_mask), per = 32 / K, g = lane / K, k = lane % K;
        const int32_t ek = __shfl_sync(EPD_K_FULL_MASK, expert, k);
        const float wk = __shfl_sync(EPD_K_FULL_MASK, weight, k);
        for (uint32_t base = 0; base < ndst; base += per) {
                const uint32_t n = base + g;
                const int live = g < per && n < ndst;
                const int j = live ? copy_nth_lane(dst_mask, n) : 0;
                const uint32_t dj = __shfl_sync(EPD_K_FULL_MASK, d, j);
                const int32_t rj = __shfl_sync(EPD_K_FULL_MASK, row, j);
                if (!live)
                        continue;
                const struct epd_k_dispatch_rank *dd = &ranks[dj];
                const int on = ek >= 0 && epd_route_expert_rank(ek, L) == dj;
                if (topk && dd->out.recv_topk_idx.ptr != NULL) {
                        uint8_t *p = mat_row(&dd->out.recv_topk_idx, rj);
                        const int64_t v = on ? (int64_t)ek - (int64_t)dj * L : -1;
                        if (a->topk_dtype == EPD_DTYPE_INT64)
                                ((int64_t *)p)[k] = v;
                        else
                                ((int32_t *)p)[k] = (int32_t)v;
                }
                if (weights && dd->out.recv_weights.ptr != NULL)
                        ((float *)mat_row(&dd->out.recv_weights, rj))[k] = on ? wk : 0.0f;
        }
#undef COPY_MINE
}

#endif
