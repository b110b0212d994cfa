/* handle.c - the lifetime of dispatch handles (docs/architecture.md, "Objects"): made by a
 * successful dispatch, refreshed by a cached one, released rank by rank, freed with their arena
 * space and backend state once every rank released them and no op uses them. Loop thread only. */
#include <stdio.h>
#include <stdlib.h>

#include "arena.h"
#include "core.h"

void epd_group_handle_free(struct epdd_group *g, struct epdd_handle *h)
{
        struct epdd_backend *b = g->daemon->backend;

        epd_list_del(&h->link);
        g->num_handles--;
        for (uint32_t r = 0; r < g->cfg.world_size; r++) {
                struct epdd_arena_place *pl = &h->ranks[r].arena;
                if (pl->used)
                        epd_arena_release(pl->arena, pl->ext_off, pl->ext_len);
                pl->used = 0;
        }
        if (h->state)
                b->ops->handle_free(b, h->state);
        free(h->ranks);
        free(h);
}

struct epdd_handle *epd_group_handle_find(struct epdd_group *g, uint64_t id)
{
        struct epd_list *pos;

        epd_list_for_each(pos, &g->handles)
        {
                struct epdd_handle *h = epd_list_entry(pos, struct epdd_handle, link);
                if (h->id == id)
                        return h;
        }
        return NULL;
}

int epd_group_handle_all_released(const struct epdd_group *g, const struct epdd_handle *h)
{
        for (uint32_t r = 0; r < g->cfg.world_size; r++)
                if (!h->ranks[r].released)
                        return 0;
        return 1;
}

void epd_group_handle_release(struct epdd_group *g, struct epdd_handle *h, uint32_t rank)
{
        struct epdd_arena_place *pl = &h->ranks[rank].arena;

        h->ranks[rank].released = 1;
        /* The rank's outputs are its own business: free its arena space now, unless an op
         * still writes it. */
        if (!h->busy && pl->used) {
                epd_arena_release(pl->arena, pl->ext_off, pl->ext_len);
                pl->used = 0;
        }
        if (!h->busy && epd_group_handle_all_released(g, h))
                epd_group_handle_free(g, h);
}

struct epdd_handle *epd_handle_new(struct epdd_group *g, struct epdd_exec *ex)
{
        uint32_t R = g->cfg.world_size;
        struct epdd_handle *h = calloc(1, sizeof(*h));

        if (!h || !(h->ranks = calloc(R, sizeof(*h->ranks)))) {
                free(h);
                return NULL;
        }
        h->id = g->next_handle_id++;
        h->layout = ex->layout;
        h->topk_dtype = ex->topk_dtype;
        h->num_topk = ex->num_topk;
        h->epoch = g->epoch;
        h->state = ex->new_handle_state;
        epd_list_add_tail(&g->handles, &h->link);
        g->num_handles++;
        return h;
}

void epd_handle_record(struct epdd_group *g, struct epdd_handle *h, const struct epdd_exec *ex)
{
        h->has_weights = ex->has_weights;
        for (uint32_t r = 0; r < g->cfg.world_size; r++) {
                const struct epdd_exec_rank *er = &ex->ranks[r];
                h->ranks[r].num_tokens = er->num_tokens;
                h->ranks[r].rows = ex->layout == EPD_LAYOUT_EXPAND ? er->num_expanded_rows
                                                                   : er->num_recv_tokens;
                if (er->use_arena)
                        h->ranks[r].arena = er->place;
        }
}

int epd_handle_release_rank(struct epdd_group *g, uint32_t rank, uint64_t handle_id, char *err,
                            size_t err_len)
{
        struct epdd_handle *h = epd_group_handle_find(g, handle_id);

        if (!h && handle_id > 0 && handle_id < g->next_handle_id)
                return 0; /* it existed and is gone (released by every rank, or invalidated
                           * when the group broke): releasing it again is harmless cleanup */
        if (!h || h->ranks[rank].released) {
                snprintf(err, err_len, "handle %llu of group '%s' does not exist for rank %u",
                         (unsigned long long)handle_id, g->name, rank);
                return EPD_NOT_FOUND;
        }
        epd_group_handle_release(g, h, rank);
        return 0;
}
