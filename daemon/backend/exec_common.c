/* exec_common.c - the backend-independent parts of executing an op, shared by every backend:
 * placing a dispatch's outputs in the ranks' output arenas once the counts are known (one
 * extent per rank holding all its output fields), and waiting on the host for clients' inputs.
 * Runs on backend threads; the arena allocator has its own lock. */
#include <stdio.h>
#include <time.h>
#include <string.h>

#include "arena.h"
#include "backend.h"
#include "util.h"

static uint64_t align_up(uint64_t bytes)
{
        return (bytes + EPD_ARENA_ALIGN - 1) / EPD_ARENA_ALIGN * EPD_ARENA_ALIGN;
}

/* Lays out a rank's outputs in one arena extent. */
static int arena_place(struct epdd_exec *ex, struct epdd_exec_rank *er, uint64_t rows)
{
        const struct epdd_group_cfg *cfg = &ex->cfg;
        int expand = ex->layout == EPD_LAYOUT_EXPAND;
        uint64_t bytes[EPD_OUT_FIELDS] = {
                rows * cfg->row_bytes,
                cfg->scale_cols ? rows * cfg->scale_cols * 4 : 0,
                expand ? 0 : rows * ex->num_topk * epd_dtype_size(ex->topk_dtype),
                ex->has_weights ? rows * (expand ? 1 : ex->num_topk) * 4 : 0,
                rows * 8,
                expand ? rows * 4 : 0,
        };
        int needed[EPD_OUT_FIELDS] = { 1, cfg->scale_cols != 0, !expand, ex->has_weights, 1,
                                       expand };
        uint64_t total = 0, off;

        for (int f = 0; f < EPD_OUT_FIELDS; f++)
                if (needed[f])
                        total += align_up(bytes[f]);
        if (epd_arena_alloc(er->arena, total, &off) < 0)
                return -1;
        er->place.used = 1;
        er->place.arena = er->arena;
        er->place.ext_off = off;
        er->place.ext_len = total;
        er->place_new = 1;
        for (int f = 0; f < EPD_OUT_FIELDS; f++) {
                if (!needed[f]) {
                        er->place.off[f] = UINT64_MAX;
                        continue;
                }
                er->place.off[f] = off;
                off += align_up(bytes[f]);
        }
        return 0;
}

void epd_exec_bind_arena(struct epdd_exec *ex, struct epdd_exec_rank *er)
{
        const struct epdd_group_cfg *cfg = &ex->cfg;
        uint8_t *base = er->arena->base;
        const struct epdd_arena_place *pl = &er->place;
        int expand = ex->layout == EPD_LAYOUT_EXPAND;

        memset(&er->dst, 0, sizeof(er->dst));
        er->dst.recv_x = (struct epd_mat){ base + pl->off[EPD_OUT_RECV_X], cfg->row_bytes };
        if (pl->off[EPD_OUT_RECV_SCALES] != UINT64_MAX)
                er->dst.recv_scales = (struct epd_mat){ base + pl->off[EPD_OUT_RECV_SCALES],
                                                        cfg->scale_cols * 4 };
        if (pl->off[EPD_OUT_RECV_TOPK_IDX] != UINT64_MAX)
                er->dst.recv_topk_idx =
                        (struct epd_mat){ base + pl->off[EPD_OUT_RECV_TOPK_IDX],
                                          ex->num_topk * epd_dtype_size(ex->topk_dtype) };
        if (pl->off[EPD_OUT_RECV_WEIGHTS] != UINT64_MAX)
                er->dst.recv_weights = (struct epd_mat){ base + pl->off[EPD_OUT_RECV_WEIGHTS],
                                                         expand ? 4 : ex->num_topk * 4ull };
        er->dst.recv_src = (struct epd_mat){ base + pl->off[EPD_OUT_RECV_SRC], 8 };
        if (pl->off[EPD_OUT_RECV_TOPK_SLOT] != UINT64_MAX)
                er->dst.recv_topk_slot =
                        (struct epd_mat){ base + pl->off[EPD_OUT_RECV_TOPK_SLOT], 4 };
}

int epd_exec_place_arenas(struct epdd_exec *ex)
{
        size_t len = 0;

        for (uint32_t d = 0; d < ex->cfg.world_size; d++) {
                struct epdd_exec_rank *er = &ex->ranks[d];
                int64_t rows = ex->layout == EPD_LAYOUT_EXPAND ? er->num_expanded_rows
                                                               : er->num_recv_tokens;
                if (!er->use_arena)
                        continue;
                if (!er->place.used && arena_place(ex, er, (uint64_t)rows) < 0) {
                        if (ex->status == 0)
                                len = (size_t)snprintf(ex->message, sizeof(ex->message),
                                                       "op does not fit:");
                        ex->status = EPD_CAPACITY_EXCEEDED;
                        if (len < sizeof(ex->message))
                                len += (size_t)snprintf(
                                        ex->message + len, sizeof(ex->message) - len,
                                        " rank %u needs %lld rows, its output arena has no free extent that large (largest %llu bytes of %llu);",
                                        d, (long long)rows,
                                        (unsigned long long)epd_arena_largest_free(er->arena),
                                        (unsigned long long)er->arena->bytes);
                        continue;
                }
                er->capacity_rows = (uint64_t)rows;
                epd_exec_bind_arena(ex, er);
        }
        if (ex->status < 0) {
                epd_exec_release_new_arenas(ex);
                return -1;
        }
        return 0;
}

void epd_exec_release_new_arenas(struct epdd_exec *ex)
{
        for (uint32_t r = 0; r < ex->cfg.world_size; r++) {
                struct epdd_exec_rank *er = &ex->ranks[r];
                if (!er->place_new)
                        continue;
                epd_arena_release(er->place.arena, er->place.ext_off, er->place.ext_len);
                memset(&er->place, 0, sizeof(er->place));
                er->place_new = 0;
        }
}

int epd_exec_inputs_ready(struct epdd_exec *ex, uint64_t now_ns, uint64_t deadline_ns)
{
        for (uint32_t r = 0; r < ex->cfg.world_size; r++) {
                struct epdd_exec_rank *er = &ex->ranks[r];
                uint64_t seen;
                if (!er->wait_inputs || !er->doorbell)
                        continue;
                /* Acquire pairs with the client stream's system-scope write: once the value is
                 * seen, the inputs written before it are visible too. */
                seen = __atomic_load_n(&er->doorbell->inputs_ready, __ATOMIC_ACQUIRE);
                if (seen >= er->wait_inputs)
                        continue;
                if (now_ns <= deadline_ns)
                        return 0;
                ex->status = EPD_TIMEOUT;
                snprintf(ex->message, sizeof(ex->message),
                         "rank %u's inputs were not marked ready (inputs_ready %llu < %llu) within the op timeout",
                         r, (unsigned long long)seen, (unsigned long long)er->wait_inputs);
                return -1;
        }
        return 1;
}

void epd_exec_abort(struct epdd_exec *ex, int status)
{
        int none = 0;

        atomic_compare_exchange_strong(&ex->abort_status, &none, status);
}
