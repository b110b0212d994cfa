/* registry.c - the region registry: client memory registered with the daemon, and the bounds
 * check every later access goes through. A client reaches only its own regions: lookups go
 * through the connection's own table. Loop thread only. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "budget.h"
#include "arena.h"
#include "backend.h"
#include "core.h"
#include "log.h"

/* ---- the connection's lookup table: a client may hold thousands of regions
 * (max_regions_per_client), and every tensor of every op is looked up by id ---- */

static uint32_t slot_of(uint64_t id, uint32_t cap)
{
        return (uint32_t)((id * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
}

static void table_insert(struct epdd_region **slots, uint32_t cap, struct epdd_region *r)
{
        uint32_t i = slot_of(r->id, cap);

        while (slots[i])
                i = (i + 1) & (cap - 1);
        slots[i] = r;
}

int epd_region_attach(struct epdd_client *c, struct epdd_region *r)
{
        if (2 * (c->region_count + 1) > c->region_cap) {
                const uint32_t cap = c->region_cap ? 2 * c->region_cap : 16;
                struct epdd_region **n = calloc(cap, sizeof(*n));
                if (!n)
                        return EPD_INTERNAL;
                for (uint32_t i = 0; i < c->region_cap; i++)
                        if (c->region_slots[i])
                                table_insert(n, cap, c->region_slots[i]);
                free(c->region_slots);
                c->region_slots = n;
                c->region_cap = cap;
        }
        table_insert(c->region_slots, c->region_cap, r);
        c->region_count++;
        epd_list_add_tail(&c->regions, &r->conn_link);
        return 0;
}

/* Removes r from the table, moving later entries of its probe run back so that no lookup
 * stops early at the hole (deletion without tombstones). */
static void table_remove(struct epdd_client *c, struct epdd_region *r)
{
        const uint32_t mask = c->region_cap - 1;
        uint32_t hole = slot_of(r->id, c->region_cap);

        while (c->region_slots[hole] != r)
                hole = (hole + 1) & mask;
        c->region_slots[hole] = NULL;
        c->region_count--;
        for (uint32_t j = (hole + 1) & mask; c->region_slots[j]; j = (j + 1) & mask) {
                const uint32_t home = slot_of(c->region_slots[j]->id, c->region_cap);
                /* Entry j may move into the hole unless its home lies cyclically in
                 * (hole, j]: then the hole is before its home and lookups never pass it. */
                const int stays = hole <= j ? (home > hole && home <= j)
                                            : (home > hole || home <= j);
                if (stays)
                        continue;
                c->region_slots[hole] = c->region_slots[j];
                c->region_slots[j] = NULL;
                hole = j;
        }
}

int epd_region_register(struct epdd_client *c, const struct epdd_region_args *rr, int fd,
                        uint64_t *region_id, char *err, size_t err_len)
{
        struct epdd_daemon *d = c->daemon;
        struct epdd_region *r;
        int rc;

        if (c->num_regions >= d->cfg.max_regions_per_client) {
                snprintf(err, err_len, "client has %u regions, the limit max_regions_per_client",
                         c->num_regions);
                rc = EPD_UNAVAILABLE;
                goto fail_fd;
        }
        if (rr->size == 0) {
                snprintf(err, err_len, "region size must be > 0");
                rc = EPD_INVALID_ARGUMENT;
                goto fail_fd;
        }
        if (rr->size > d->cfg.max_region_bytes_per_client - c->region_bytes ||
            c->region_bytes > d->cfg.max_region_bytes_per_client) {
                snprintf(err, err_len,
                         "registering %llu bytes would exceed max_region_bytes_per_client=%llu (client has %llu)",
                         (unsigned long long)rr->size,
                         (unsigned long long)d->cfg.max_region_bytes_per_client,
                         (unsigned long long)c->region_bytes);
                rc = EPD_UNAVAILABLE;
                goto fail_fd;
        }
        if (rr->device >= d->backend->num_devices) {
                snprintf(err, err_len, "device %u does not exist (the daemon has %u)", rr->device,
                         d->backend->num_devices);
                rc = EPD_INVALID_ARGUMENT;
                goto fail_fd;
        }
        rc = epd_budget_region(d, c, rr->size, err, err_len);
        if (rc != 0)
                goto fail_fd;
        r = calloc(1, sizeof(*r));
        if (!r) {
                snprintf(err, err_len, "out of memory");
                rc = EPD_INTERNAL;
                goto fail_fd;
        }
        r->owner = c;
        r->mem.kind = rr->kind;
        r->mem.size = rr->size;
        r->mem.device = rr->device;
        /* region_import consumes fd on every path. */
        rc = d->backend->ops->region_import(d->backend, &r->mem, fd, rr->ipc_handle,
                                            rr->ipc_len, rr->offset, err, err_len);
        if (rc < 0) {
                free(r);
                return rc;
        }
        r->id = ++d->next_region_id;
        r->refs = 1;
        if (epd_region_attach(c, r) < 0) {
                d->backend->ops->region_release(d->backend, &r->mem);
                free(r);
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        c->num_regions++;
        c->region_bytes += r->mem.size;
        *region_id = r->id;
        return 0;
fail_fd:
        if (fd >= 0)
                close(fd);
        return rc;
}

void epd_region_ref(struct epdd_region *r)
{
        r->refs++;
}

void epd_region_unref(struct epdd_daemon *d, struct epdd_region *r)
{
        if (--r->refs > 0)
                return;
        if (!r->is_arena)
                d->backend->ops->region_release(d->backend, &r->mem);
        free(r);
}

static void region_detach(struct epdd_client *c, struct epdd_region *r)
{
        table_remove(c, r);
        epd_list_del(&r->conn_link);
        if (!r->is_arena) {
                c->num_regions--;
                c->region_bytes -= r->mem.size;
        }
        r->owner = NULL;
        epd_region_unref(c->daemon, r);
}

struct epdd_region *epd_region_find(struct epdd_client *c, uint64_t region_id)
{
        if (c->region_cap == 0)
                return NULL;
        for (uint32_t i = slot_of(region_id, c->region_cap);; i = (i + 1) & (c->region_cap - 1)) {
                struct epdd_region *r = c->region_slots[i];
                if (!r || r->id == region_id)
                        return r;
        }
}

int epd_region_release_id(struct epdd_client *c, uint64_t region_id)
{
        struct epdd_region *r = epd_region_find(c, region_id);

        if (!r)
                return EPD_NOT_FOUND;
        if (r->is_arena)
                return EPD_PERMISSION_DENIED; /* released with the rank binding */
        region_detach(c, r);
        return 0;
}

void epd_region_detach(struct epdd_client *c, struct epdd_region *r)
{
        region_detach(c, r);
}

void epd_region_release_all(struct epdd_client *c)
{
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &c->regions)
                region_detach(c, epd_list_entry(pos, struct epdd_region, conn_link));
        free(c->region_slots);
        c->region_slots = NULL;
        c->region_cap = 0;
}

int epd_region_resolve(struct epdd_client *c, const struct epd_tensor *t, uint64_t rows,
                       uint64_t cols, struct epdd_region **region, uint8_t **ptr,
                       uint64_t *row_stride, char *err, size_t err_len)
{
        struct epdd_region *r = epd_region_find(c, t->region_id);
        size_t esize = epd_dtype_size(t->dtype);
        uint64_t stride_elems, stride_bytes, row_bytes, extent;

        if (!r) {
                snprintf(err, err_len, "region %llu is not registered by this client",
                         (unsigned long long)t->region_id);
                return EPD_INVALID_ARGUMENT;
        }
        if (esize == 0) {
                snprintf(err, err_len, "invalid dtype %d", (int)t->dtype);
                return EPD_INVALID_ARGUMENT;
        }
        if (t->ndim >= 2 && t->strides[t->ndim - 1] > 1) {
                snprintf(err, err_len, "the innermost dimension must be contiguous (stride %llu)",
                         (unsigned long long)t->strides[t->ndim - 1]);
                return EPD_INVALID_ARGUMENT;
        }
        if (cols == 0) {
                /* Callers pass 1 for one-dimensional tensors; 0 would make the stride zero. */
                snprintf(err, err_len, "a row must have at least one element");
                return EPD_INVALID_ARGUMENT;
        }
        if (cols > UINT64_MAX / esize) {
                snprintf(err, err_len, "row size overflows");
                return EPD_INVALID_ARGUMENT;
        }
        row_bytes = cols * esize;
        stride_elems = t->ndim >= 2 && t->strides[0] ? t->strides[0] : cols;
        if (t->ndim == 1 && t->strides[0] > 1) {
                snprintf(err, err_len, "a one-dimensional tensor must be contiguous");
                return EPD_INVALID_ARGUMENT;
        }
        if (stride_elems < cols) {
                snprintf(err, err_len, "row stride %llu is smaller than a row of %llu elements",
                         (unsigned long long)stride_elems, (unsigned long long)cols);
                return EPD_INVALID_ARGUMENT;
        }
        if (stride_elems > UINT64_MAX / esize) {
                snprintf(err, err_len, "row stride %llu overflows in bytes",
                         (unsigned long long)stride_elems);
                return EPD_INVALID_ARGUMENT;
        }
        stride_bytes = stride_elems * esize;
        /* Extent of the rows touched: (rows-1) strides plus one row, checked for overflow. */
        if (rows == 0) {
                extent = 0;
        } else {
                if (rows - 1 > (UINT64_MAX - row_bytes) / stride_bytes) {
                        snprintf(err, err_len, "tensor extent overflows");
                        return EPD_INVALID_ARGUMENT;
                }
                extent = (rows - 1) * stride_bytes + row_bytes;
        }
        if (t->offset > r->mem.size || extent > r->mem.size - t->offset) {
                snprintf(err, err_len,
                         "tensor at offset %llu with %llu bytes runs past the end of region %llu (%llu bytes)",
                         (unsigned long long)t->offset, (unsigned long long)extent,
                         (unsigned long long)r->id, (unsigned long long)r->mem.size);
                return EPD_INVALID_ARGUMENT;
        }
        /* Backends access elements through typed (and vectorised) pointers: an element that
         * straddles its natural alignment is undefined behaviour on the host and a fault on a
         * GPU. Strides are whole elements, so the first element decides. */
        if ((uintptr_t)(r->mem.base + t->offset) % esize != 0) {
                snprintf(err, err_len,
                         "tensor at offset %llu of region %llu is not aligned to its %zu-byte elements",
                         (unsigned long long)t->offset, (unsigned long long)r->id, esize);
                return EPD_INVALID_ARGUMENT;
        }
        *region = r;
        *ptr = r->mem.base + t->offset;
        *row_stride = stride_bytes;
        return 0;
}

int epd_region_add_arena(struct epdd_client *c, struct epdd_arena *arena, uint32_t device,
                         uint64_t *region_id)
{
        struct epdd_region *r = calloc(1, sizeof(*r));

        if (!r)
                return EPD_INTERNAL;
        r->owner = c;
        r->mem.kind = arena->kind;
        r->mem.size = arena->bytes;
        r->mem.device = device;
        r->mem.base = arena->base;
        r->is_arena = 1;
        r->id = ++c->daemon->next_region_id;
        r->refs = 1;
        /* Arena regions count against no client limit: the daemon sized them. */
        if (epd_region_attach(c, r) < 0) {
                free(r);
                return EPD_INTERNAL;
        }
        *region_id = r->id;
        return 0;
}
