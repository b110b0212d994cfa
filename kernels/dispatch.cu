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

#include "copy_token.cuh"
#include "internal.cuh"

#define COPY_THREADS 256
/* Blocks per multiprocessor the copy kernel is compiled for (__launch_bounds__). With the
 * scales' load ahead of the x loads it takes 84 registers, 24 warps per multiprocessor; bound to
 * 64 registers (4 blocks) it spills, and the spills make prefill fp8's copy slower
 * (docs/performance.md). */
#define COPY_MIN_BLOCKS 1
#define PAD_ROWS_PER_ITEM 8

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

/* One slice of flat token g of this device: its entries' experts and rows from the workspace
 * (place step or small routing), then copy_token_rows. */
static __device__ void copy_token(const struct epd_k_dispatch_args *a,
                                  const struct epd_ws_layout *l, uint32_t g, uint32_t slice,
                                  uint32_t slices, uint64_t slice_bytes, uint32_t lane)
{
        const uint32_t i = epd__k_find_local(a->local, a->num_local, g);
        const uint32_t s = a->local[i].rank, t = g - a->local[i].token_offset;
        const uint64_t ent = epd_ws_entry(l, s, t, a->num_topk, 0);
        int32_t expert = -1, row = -1;

        if (lane < a->num_topk) {
                expert = epd_ws_i32(a->workspace, l->topk)[ent + lane];
                row = epd_ws_i32(a->workspace, l->row)[ent + lane];
        }
        copy_token_rows(a, a->ranks, l, s, t, ent, expert, row, slice, slices, slice_bytes, lane);
}

/* Up to PAD_ROWS_PER_ITEM padding rows of one local expert of one local destination
 * (docs/semantics.md §2.2): recv_src and recv_topk_slot are -1 always; x, scales and weights are
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
                if (dst->out.recv_src.ptr != NULL)
                        *(int64_t *)mat_row(&dst->out.recv_src, r) = -1;
                if (dst->out.recv_topk_slot.ptr != NULL)
                        *(int32_t *)mat_row(&dst->out.recv_topk_slot, r) = -1;
                if (a->zero_padding && a->has_weights && dst->out.recv_weights.ptr != NULL)
                        *(float *)mat_row(&dst->out.recv_weights, r) = 0.0f;
        }
        if (!a->zero_padding)
                return;
        for (r = first; r < end; r++) {
                if (dst->out.recv_x.ptr != NULL)
                        zero_row_any(mat_row(&dst->out.recv_x, r), a->row_bytes, lane);
                if (a->scale_bytes != 0 && dst->out.recv_scales.ptr != NULL)
                        zero_row_any(mat_row(&dst->out.recv_scales, r), a->scale_bytes, lane);
        }
}

/* Asks L2 for the source bytes of one slice of token t (x and scales: its source's rows; the
 * scales for slice 0), a 128-byte line per lane per step. Addresses only: prefetch.global.L2 has
 * no effect on results. */
static __device__ void prefetch_token_slice(const struct epd_k_dispatch_args &a,
                                            const struct epd_mat *x,
                                            const struct epd_mat *scales, uint32_t t,
                                            uint32_t slice, uint64_t slice_bytes, uint32_t lane)
{
        const uint64_t off = (uint64_t)slice * slice_bytes;
        const uint8_t *row = mat_row(x, t);
        const uint64_t end = min(off + slice_bytes, a.row_bytes);
        for (uint64_t o = off + 128ull * lane; o < end; o += 32 * 128)
                asm volatile("prefetch.global.L2 [%0];" : : "l"(row + o));
        if (slice == 0 && a.scale_bytes != 0 && scales->ptr != NULL) {
                const uint8_t *sc = mat_row(scales, t);
                for (uint64_t o = 128ull * lane; o < a.scale_bytes; o += 32 * 128)
                        asm volatile("prefetch.global.L2 [%0];" : : "l"(sc + o));
        }
}

/* Asks L2 for the source bytes of this warp's first item: what the warp reads first once the
 * routing it overlaps has finished. The descriptors and local list it reads were uploaded before
 * the op. */
static __device__ void prefetch_first_item(const struct epd_k_dispatch_args &a, uint64_t item,
                                           uint32_t slices, uint64_t slice_bytes, uint32_t lane)
{
        if (item >= (uint64_t)a.local_tokens * slices)
                return;
        const uint32_t g = (uint32_t)(item / slices), slice = (uint32_t)(item % slices);
        const uint32_t i = epd__k_find_local(a.local, a.num_local, g);
        const struct epd_k_dispatch_rank *src = &a.ranks[a.local[i].rank];
        if (src->num_tokens > a.max_tokens)
                return;
        prefetch_token_slice(a, &src->in.x, &src->in.scales, g - a.local[i].token_offset, slice,
                             slice_bytes, lane);
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
static __global__ void __launch_bounds__(COPY_THREADS, COPY_MIN_BLOCKS)
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
                                          (uint32_t)(item % slices), slices, slice_bytes, lane);
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
        ret = epd__k_slicing(args->local_tokens, args->row_bytes, COPY_SLICE_UNIT,
                             EPD_K_SLICE_WARPS, &slice_bytes, &slices);
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
