/* fuzz_script.h - the input format of fuzz_request: a script of client actions, shared by the
 * fuzz target (which interprets it) and gen_corpus (which writes the seed corpus).
 *
 * The input is read as a byte stream; a read past the end yields zeros, and the script ends
 * when the input is exhausted. Integers are little-endian.
 *
 *   u8 setup        number of clients = 1 + setup % EPD_FUZZ_MAX_CLIENTS; bit 7 set: the
 *                   clients do not send the automatic valid Hello first; bit 6 set: a
 *                   command does not wait for the ops executing after it, so the next ones
 *                   (a disconnect, a join, a resize, ...) overlap them
 *   then commands:  u8 op (% EPD_FUZZ_OP_COUNT), u8 client (% number of clients), fields
 *
 * Fields of each op are listed next to it below. Selections ("sel") index what the client
 * learnt from the daemon's replies (its group bindings, its regions, the handles of its
 * dispatches), so that a script can refer to objects whose ids the daemon chose; a selection
 * past the known objects becomes a raw (mostly invalid) id.
 *
 * Changing the format changes what committed inputs do: append ops (an op byte at or above the
 * old EPD_FUZZ_OP_COUNT is then read differently), and check that every input in
 * regressions/fuzz_request still reproduces its bug with the fix taken out.
 *
 *   config (9 bytes): u8 world_size (1 + v % 4; bit 7: raw mode, then the rest are u32 each
 *   and arena a u32), u8 experts_per_rank (1 + v % 8), u8 hidden (index into a table of
 *   sizes), u8 max_tokens (v % 17), u8 max_topk (1 + v % 4), u8 dtype (0 bf16, 1 fp8, else v),
 *   u8 scale_block (0 default, else 8 * v), u8 op_timeout_ms (1 + v % 16), u8 arena
 *   (0: none, else v KiB)
 *
 *   tensor (5 bytes + extras): u8 region (0 absent, 255 raw id u64, else known region
 *   (v-1) % n), u16 offset (bytes), u8 shape: bits 0-1 rows (0 natural, 1 natural + u8,
 *   2 u8, 3 u32), bits 2-3 cols (0 natural, 1 u8, 2 one dimension, 3 three dimensions),
 *   bit 4 explicit row stride cols + u8, bit 5 dtype u8, bit 6 innermost stride 2, bit 7 zero
 *   offset instead of the u16 (the u16 is still read)
 */
#ifndef EPD_TESTS_FUZZ_SCRIPT_H
#define EPD_TESTS_FUZZ_SCRIPT_H

#define EPD_FUZZ_MAX_CLIENTS 3
/* Flag bit 7 of DISPATCH and COMBINE: the op record (common/oprec.h) goes into the request box
 * of the binding's doorbell page (common/doorbell.h) instead of a frame; the daemon takes it
 * while it polls or before the client's next frame. With bit 3 also set, the length written is
 * not the record's length but, by the request id % 4: the length, half of it, 0, or one more
 * than the box holds. A request that the record's encoder refuses (a raw layout or dtype, three
 * biases, too many dims) is not sent: RAW_OP reaches the daemon's decoder. */
#define EPD_FUZZ_PAGE 0x80
#define EPD_FUZZ_NO_HELLO 0x80
#define EPD_FUZZ_OVERLAP 0x40

enum epd_fuzz_op {
        /* u16 len, bytes: a frame body under a valid header */
        EPD_FUZZ_OP_RAW_BODY = 0,
        /* u16 len, bytes, u8 fds (% 20): a record exactly as given, with that many fds */
        EPD_FUZZ_OP_RAW_RECORD = 1,
        /* u8 flags (bit 0 wrong version, bit 1 CUDA capability), u8 name length, name */
        EPD_FUZZ_OP_HELLO = 2,
        /* u8 name (% 4), u8 secret (0: 16 good bytes, 1: 64 bytes, 2: 8 bytes, else 16 other
         * bytes), config, u8 rank, u8 device, u8 uuid (0 none, 1 device 0's, else bogus) */
        EPD_FUZZ_OP_GROUP_CREATE = 3,
        /* u8 name (% 4, 4+: unknown), u8 secret (as above), u8 rank, u8 device, u8 uuid */
        EPD_FUZZ_OP_GROUP_JOIN = 4,
        /* u8 binding sel, u8 rank (0: the binding's, else v - 1) */
        EPD_FUZZ_OP_GROUP_LEAVE = 5,
        /* u8 kind (0 memfd, else v % 5), u16 size (x16 bytes), u16 offset, u8 file (0: exact,
         * 1: shorter, else larger), u8 fill (mode % 5, then u8 a, u8 b, u8 c), u8 fds (0 one
         * memfd, 1 none, 2 two, 3 a socket, 4 an unsealable memfd), u8 device */
        EPD_FUZZ_OP_REGION_REGISTER = 6,
        /* u8 region sel */
        EPD_FUZZ_OP_REGION_RELEASE = 7,
        /* config, u16 expert_alignment */
        EPD_FUZZ_OP_SIZE_HINT = 8,
        EPD_FUZZ_OP_STATUS = 9,
        EPD_FUZZ_OP_LIST_GROUPS = 10,
        EPD_FUZZ_OP_LIST_CLIENTS = 11,
        EPD_FUZZ_OP_STATS = 12,
        /* u8 binding sel, u8 rank, u8 handle sel (0 new, 255 raw u64), u8 num_tokens,
         * u8 flags (bit 0 EXPAND, 1 zero_padding, 2 use_arena, 3 raw layout u8, 4 wait_inputs,
         * 5 int64 topk_idx, 6 num_topk u8 explicit, 7 posted in the binding's doorbell page
         * instead of sent: see EPD_FUZZ_PAGE), u16 expert_alignment, then the tensors x,
         * scales, topk_idx, topk_weights, recv_x, recv_scales, recv_topk_idx, recv_weights,
         * recv_src, recv_topk_slot */
        EPD_FUZZ_OP_DISPATCH = 13,
        /* u8 binding sel, u8 rank, u8 handle sel, u8 flags (bit 0 apply_weights, bit 1
         * recv_weights, bit 2 source_weights, bit 3 see EPD_FUZZ_PAGE, bit 4 wait_inputs, bit 7
         * posted in the doorbell page), u8 number of biases (% 4), then the tensors y, bias[0],
         * bias[1], combined, combined_topk_weights, then recv_weights (bit 1) and
         * source_weights (bit 2) */
        EPD_FUZZ_OP_COMBINE = 14,
        /* u8 binding sel, u8 rank, u8 handle sel */
        EPD_FUZZ_OP_HANDLE_RELEASE = 15,
        /* u8 ms (% 8): run the daemon's loop that long (op timeouts) */
        EPD_FUZZ_OP_PUMP = 16,
        /* u8 binding sel, u8 value (0: released, else v): writes inputs_ready of the doorbell */
        EPD_FUZZ_OP_RING = 17,
        /* u8 flags (bit 0: reconnect with a Hello): the client disconnects */
        EPD_FUZZ_OP_DISCONNECT = 18,
        /* no fields: the client stops reading its replies (again: reads them again), so the
         * daemon's socket fills and its output queue reaches max_output_queue_bytes */
        EPD_FUZZ_OP_MUTE = 19,
        /* u8 binding sel, u8 rank, u8 first segment */
        EPD_FUZZ_OP_ARENA_SEGMENTS = 20,
        /* u8 binding sel, u8 name (0: by id, else group name (v-1) % 8), u16 bytes (x1 KiB,
         * 0xffff: u64 raw) */
        EPD_FUZZ_OP_RESIZE = 21,
        /* u8 flags (bit 0 undrain, bit 1 all), u8 binding sel, u8 name (as for RESIZE) */
        EPD_FUZZ_OP_DRAIN = 22,
        /* u8 victim: (v % 4) < number of clients: that client's id, else raw v */
        EPD_FUZZ_OP_EVICT = 23,
        /* u8 binding sel, u8 flags (bit 0: into the binding's doorbell page, else an OpRecord
         * on the socket; bit 1: a record that decodes is made one of the binding's group and
         * rank first), u16 len, bytes: an op record as given */
        EPD_FUZZ_OP_RAW_OP = 24,
        EPD_FUZZ_OP_COUNT = 25,
};

/* Hidden sizes the config's hidden byte indexes (v % count). */
#define EPD_FUZZ_HIDDEN_TABLE { 16, 32, 64, 128, 8, 256, 7, 4096 }
#define EPD_FUZZ_HIDDEN_COUNT 8

/* Fill modes of a registered region (the client writes the memory before registering it). */
enum epd_fuzz_fill {
        EPD_FUZZ_FILL_ZERO = 0,
        EPD_FUZZ_FILL_I32 = 1,    /* element k = ((k % a) * b + k / a) % c, a/b/c from input */
        EPD_FUZZ_FILL_I64 = 2,    /* same, 64-bit */
        EPD_FUZZ_FILL_F32 = 3,    /* 1.0f everywhere */
        EPD_FUZZ_FILL_BYTES = 4,  /* the bytes a, b, c repeated */
        EPD_FUZZ_FILL_COUNT = 5,
};

#endif
