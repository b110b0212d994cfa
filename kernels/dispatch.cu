/* dispatch.cu - the copy step of a dispatch: every row straight into its final place.
 *
 * One kernel per device covers every source on that device. A warp owns one source token at a
 * time (or, when the op has too few tokens to fill the GPU, one slice of a token's row:
 * epd__k_slicing): it reads the row once, 4 accesses of 16 bytes in flight per lane, and stores
 * it to each destination that receives the token (one row per destination for NON_EXPAND, one
 * per selection for EXPAND), then writes the rows' metadata. Destinations may be on this GPU or
 * on peers; the stores are the same. After the tokens, the same warps write the EXPAND padding
 * of the device's own destinations. There are no atomics: every output byte has exactly one
 * writer, named by the row that the place step computed.
 */
#include <stdint.h>

#include "internal.cuh"

/* Tunables; overridable with -D for experiments. */
#ifndef COPY_THREADS
#define COPY_THREADS 256
#endif
#ifndef COPY_UNROLL
#define COPY_UNROLL 4 /* 16-byte loads in flight per lane before the stores */
#endif
#define PAD_ROWS_PER_ITEM 8
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

template <typename V>
static __device__ __forceinline__ void zero_row(uint8_t *dst, uint64_t nbytes, uint32_t lane)
{
        const uint64_t nvec = nbytes / sizeof(V);
        V *d = (V *)dst;
        for (uint64_t i = lane; i < nvec; i += 32)
                d[i] = epd__k_zero<V>();
}

static __device__ __noinline__ void zero_row_any(uint8_t *dst, uint64_t nbytes, uint32_t lane)
{
        switch (epd__k_access_width((uint64_t)(uintptr_t)dst | nbytes)) {
        case 16:
                zero_row<int4>(dst, nbytes, lane);
                break;
        case 8:
                zero_row<uint2>(dst, nbytes, lane);
                break;
        case 4:
                zero_row<unsigned int>(dst, nbytes, lane);
                break;
        case 2:
                zero_row<unsigned short>(dst, nbytes, lane);
                break;
        default:
                zero_row<unsigned char>(dst, nbytes, lane);
                break;
        }
}

static __device__ __forceinline__ uint8_t *mat_row(const struct epd_k_mat *m, int64_t row)
{
        return m->ptr + (uint64_t)row * m->stride;
}

/* One slice of one source token: flat token g of this device, bytes [slice * slice_bytes,
 * + slice_bytes) of its x row (the whole row when there is one slice). Slice 0 also moves the scales and writes
 * the rows' metadata and the weights kept for combine. */
static __device__ void copy_token(const struct epd_k_dispatch_args *a,
                                  const struct epd_ws_layout *l, uint32_t g, uint32_t slice,
                                  uint64_t slice_bytes, uint32_t lane)
{
        const uint32_t L = l->num_local_experts, K = a->num_topk;
        const uint32_t i = epd__k_find_local(a->local, a->num_local, g);
        const uint32_t s = a->local[i].rank, t = g - a->local[i].token_offset;
        const struct epd_k_dispatch_rank *src = &a->ranks[s];
        const uint64_t ent = epd_ws_entry(l, s, t, K, 0);
        int32_t expert = -1, row = -1;
        float weight = 0.0f;

        if (lane < K) {
                expert = epd_ws_i32(a->workspace, l->topk)[ent + lane];
                row = epd_ws_i32(a->workspace, l->row)[ent + lane];
                if (a->has_weights) {
                        weight = ((const float *)mat_row(&src->weights, t))[lane];
                        /* Kept for combine (apply_weights, combined_topk_weights). */
                        if (slice == 0)
                                epd_ws_f32(a->workspace, l->weights)[ent + lane] = weight;
                }
        }
        const uint32_t dst_mask = __ballot_sync(EPD_K_FULL_MASK, row >= 0);
        if (dst_mask == 0)
                return;

        const uint32_t d = row >= 0 ? epd_route_expert_rank(expert, L) : 0;
        const struct epd_k_dispatch_rank *dst = &a->ranks[d];

        /* x: this item's slice. The access width depends on the whole row (addresses and
         * row_bytes), and slices start at multiples of every width, so the accesses are the
         * same with or without slicing. */
        const uint64_t off = (uint64_t)slice * slice_bytes;
        const uint8_t *sx = mat_row(&src->x, t);
        uint8_t *dx = row >= 0 ? mat_row(&dst->recv_x, row) : NULL;
        uint32_t bits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)dx) |
                        (uint32_t)(uintptr_t)sx | (uint32_t)a->row_bytes;
        if (off < a->row_bytes)
                copy_row_any(sx + off, dx + (dx != NULL ? off : 0), dst_mask,
                             min(slice_bytes, a->row_bytes - off), lane, bits);
        if (slice != 0)
                return;

        /* scales (fp8). A destination without a recv_scales tensor is skipped, not faulted. */
        if (a->scale_bytes != 0 && src->scales.ptr != NULL) {
                const uint8_t *ss = mat_row(&src->scales, t);
                uint8_t *ds = row >= 0 && dst->recv_scales.ptr != NULL
                                      ? mat_row(&dst->recv_scales, row)
                                      : NULL;
                uint32_t smask = __ballot_sync(EPD_K_FULL_MASK, ds != NULL);
                bits = __reduce_or_sync(EPD_K_FULL_MASK, (uint32_t)(uintptr_t)ds) |
                       (uint32_t)(uintptr_t)ss | (uint32_t)a->scale_bytes;
                copy_row_any(ss, ds, smask, a->scale_bytes, lane, bits);
        }

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
                const struct epd_k_dispatch_rank *dd = &a->ranks[dj];
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

/* Up to PAD_ROWS_PER_ITEM padding rows of one local expert of one local destination
 * (SEMANTICS.md 2.2): recv_src and recv_topk_slot are -1 always; x, scales and weights are
 * zeroed only with zero_padding, else left as they were. */
static __device__ void pad_item(const struct epd_k_dispatch_args *a, const struct epd_ws_layout *l,
                                uint64_t p, uint32_t chunks, uint32_t lane)
{
        const uint32_t L = l->num_local_experts;
        const uint32_t i = (uint32_t)(p / ((uint64_t)L * chunks));
        const uint32_t rem = (uint32_t)(p % ((uint64_t)L * chunks));
        const uint32_t le = rem / chunks, c = rem % chunks;
        const uint32_t d = a->local[i].rank;
        const struct epd_k_dispatch_rank *dst = &a->ranks[d];
        const uint64_t flat = (uint64_t)d * L + le;
        const int32_t count = epd_ws_i32(a->workspace, l->expert_count)[flat];
        const int32_t aligned = epd_ws_i32(a->workspace, l->expert_aligned)[flat];
        const int32_t base = epd_ws_i32(a->workspace, l->expert_base)[(uint64_t)d * (L + 1) + le];
        const int32_t first = base + count + (int32_t)(c * PAD_ROWS_PER_ITEM);
        const int32_t end = min(base + aligned, first + PAD_ROWS_PER_ITEM);

        if (first >= end)
                return;
        int32_t r = first + (int32_t)lane;
        if (r < end) {
                if (dst->recv_src.ptr != NULL)
                        *(int64_t *)mat_row(&dst->recv_src, r) = -1;
                if (dst->recv_topk_slot.ptr != NULL)
                        *(int32_t *)mat_row(&dst->recv_topk_slot, r) = -1;
                if (a->zero_padding && a->has_weights && dst->recv_weights.ptr != NULL)
                        *(float *)mat_row(&dst->recv_weights, r) = 0.0f;
        }
        if (!a->zero_padding)
                return;
        for (r = first; r < end; r++) {
                if (dst->recv_x.ptr != NULL)
                        zero_row_any(mat_row(&dst->recv_x, r), a->row_bytes, lane);
                if (a->scale_bytes != 0 && dst->recv_scales.ptr != NULL)
                        zero_row_any(mat_row(&dst->recv_scales, r), a->scale_bytes, lane);
        }
}

/* Asks L2 for the source bytes of this warp's first item (its slice of x, and the scales for
 * slice 0), a 128-byte line per lane per step: what the warp reads first once the routing it
 * overlaps has finished. Addresses only (prefetch.global.L2 has no effect on results); the
 * descriptors and local list it reads were uploaded before the op. */
static __device__ void prefetch_first_item(const struct epd_k_dispatch_args &a, uint64_t item,
                                           uint32_t slices, uint64_t slice_bytes, uint32_t lane)
{
        if (item >= (uint64_t)a.local_tokens * slices)
                return;
        const uint32_t g = (uint32_t)(item / slices), slice = (uint32_t)(item % slices);
        const uint32_t i = epd__k_find_local(a.local, a.num_local, g);
        const struct epd_k_dispatch_rank *src = &a.ranks[a.local[i].rank];
        const uint32_t t = g - a.local[i].token_offset;
        if (src->num_tokens > a.max_tokens)
                return;
        const uint64_t off = (uint64_t)slice * slice_bytes;
        const uint8_t *x = src->x.ptr + (uint64_t)t * src->x.stride;
        const uint64_t end = min(off + slice_bytes, a.row_bytes);
        for (uint64_t o = off + 128ull * lane; o < end; o += 32 * 128)
                asm volatile("prefetch.global.L2 [%0];" : : "l"(x + o));
        if (slice == 0 && a.scale_bytes != 0 && src->scales.ptr != NULL) {
                const uint8_t *sc = src->scales.ptr + (uint64_t)t * src->scales.stride;
                for (uint64_t o = 128ull * lane; o < a.scale_bytes; o += 32 * 128)
                        asm volatile("prefetch.global.L2 [%0];" : : "l"(sc + o));
        }
}

/* Grid-stride over work items, a warp per item: first the device's source tokens (each cut into
 * `slices` items when the op is too small to fill the GPU with whole rows), then (EXPAND) the
 * padding chunks of its destinations.
 *
 * Memory ordering: with EPD_K_COPY_OVERLAP the kernel runs alongside the routing kernel before
 * it; griddepcontrol.wait returns once that grid has completed and its stores are visible, and
 * nothing but the source rows' addresses (for the L2 prefetch) is read before it. Without the
 * flag the wait returns at once. Each block acquires the verdict at .sys (it may come from a
 * prefix kernel on another GPU, and the workspace may live on a peer) and exits without writing anything when it
 * is an error, which is how a capacity or validation failure leaves every output byte untouched.
 * The rows, topk and counts it reads were written by earlier kernels ordered by events. Its
 * stores to peer outputs are made visible to the destination's later work by the kernel
 * boundary and the event the host records after it; nothing inside this kernel reads them. */
static __global__ void __launch_bounds__(COPY_THREADS)
        copy_kernel(const __grid_constant__ struct epd_k_dispatch_args a,
                     const __grid_constant__ struct epd_ws_layout l, uint32_t pad_chunks,
                     uint32_t slices, uint64_t slice_bytes)
{
        const uint32_t lane = threadIdx.x % 32;
        const uint64_t warp = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
        const uint64_t warps = (uint64_t)gridDim.x * blockDim.x / 32;

        if (a.flags & EPD_K_COPY_OVERLAP) {
                prefetch_first_item(a, warp, slices, slice_bytes, lane);
                asm volatile("griddepcontrol.wait;" : : : "memory");
        }
        const struct epd_ws_error *rec = epd_ws_error_rec(a.workspace, &l);
        if (epd_block_read_verdict(&rec->status) != 0)
                return;

        const uint64_t token_items = (uint64_t)a.local_tokens * slices;
        const uint64_t pad_items = a.layout == EPD_LAYOUT_EXPAND
                                           ? (uint64_t)a.num_local * l.num_local_experts *
                                                     pad_chunks
                                           : 0;

        for (uint64_t item = warp; item < token_items + pad_items; item += warps) {
                if (item < token_items)
                        copy_token(&a, &l, (uint32_t)(item / slices),
                                          (uint32_t)(item % slices), slice_bytes, lane);
                else
                        pad_item(&a, &l, item - token_items, pad_chunks, lane);
        }
}

extern "C" int epd_k_dispatch_copy(const struct epd_k_dispatch_args *args, cudaStream_t stream)
{
        struct epd_ws_layout l;
        int blocks, ret = epd__k_check_dispatch(args, &l);

        if (ret < 0)
                return ret;
        if (args->num_local == 0)
                return 0;
        /* Padding rows of one expert are fewer than the alignment; cut them into chunks so that
         * a large alignment spreads over many warps instead of one. */
        uint32_t pad_chunks = (args->expert_alignment - 1 + PAD_ROWS_PER_ITEM - 1) /
                              PAD_ROWS_PER_ITEM;
        uint64_t slice_bytes;
        uint32_t slices;
        ret = epd__k_slicing(args->local_tokens, args->row_bytes, COPY_SLICE_UNIT, &slice_bytes,
                             &slices);
        if (ret < 0)
                return ret;
        uint64_t items = (uint64_t)args->local_tokens * slices;
        if (args->layout == EPD_LAYOUT_EXPAND)
                items += (uint64_t)args->num_local * l.num_local_experts * pad_chunks;
        if (items == 0)
                return 0;
        const uint64_t warps_per_block = COPY_THREADS / 32;
        ret = epd__k_grid_blocks((const void *)copy_kernel, COPY_THREADS, 0,
                                 (items + warps_per_block - 1) / warps_per_block, &blocks);
        if (ret < 0)
                return ret;
        if (!(args->flags & EPD_K_COPY_OVERLAP)) {
                copy_kernel<<<blocks, COPY_THREADS, 0, stream>>>(*args, l, pad_chunks, slices,
                                                                 slice_bytes);
                return epd__k_launch_status();
        }
        /* Programmatic dependent launch: may start before the kernel ahead of it ends. */
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3((unsigned)blocks);
        cfg.blockDim = dim3(COPY_THREADS);
        cfg.stream = stream;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        return epd__k_cuda_status(cudaLaunchKernelEx(&cfg, copy_kernel, *args, l, pad_chunks,
                                                     slices, slice_bytes));
}

int epd__k_preload_dispatch(void)
{
        struct cudaFuncAttributes attr;
        return epd__k_cuda_status(cudaFuncGetAttributes(&attr, copy_kernel));
}
