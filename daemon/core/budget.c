/* budget.c - see budget.h. */
#include <dirent.h>
#include <stdio.h>
#include <sys/resource.h>

#include "arena.h"
#include "budget.h"
#include "core.h"
#include "log.h"

void epd_budget_init(struct epdd_daemon *d)
{
        struct rlimit rl;

        if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
                rlim_t want = rl.rlim_max > (1u << 20) ? (1u << 20) : rl.rlim_max;
                if (rl.rlim_cur < want) {
                        rl.rlim_cur = want;
                        (void)setrlimit(RLIMIT_NOFILE, &rl);
                        (void)getrlimit(RLIMIT_NOFILE, &rl);
                }
                d->fd_limit = rl.rlim_cur;
        }
}

int epd_budget_open_fds(void)
{
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *e;
        int n = 0;

        if (!dir)
                return -1;
        while ((e = readdir(dir)))
                n += e->d_name[0] != '.';
        closedir(dir);
        return n - 1; /* the directory's own descriptor */
}

/* Room for `need` more descriptors, keeping fd_headroom free for accepting and replying. */
static int fds_left(struct epdd_daemon *d, unsigned need, char *err, size_t err_len)
{
        int open;

        if (!d->fd_limit)
                return 0;
        open = epd_budget_open_fds();
        if (open >= 0 && (uint64_t)open + need + d->cfg.fd_headroom > d->fd_limit) {
                snprintf(err, err_len,
                         "the daemon has %d of its %llu file descriptors open and keeps fd_headroom=%u free",
                         open, (unsigned long long)d->fd_limit, d->cfg.fd_headroom);
                return EPD_UNAVAILABLE;
        }
        return 0;
}

struct holdings {
        unsigned bindings, regions;
        uint64_t region_bytes;
};

/* What the clients of c's uid hold (uid), and every client (all). */
static void count(struct epdd_daemon *d, const struct epdd_client *c, struct holdings *uid,
                  struct holdings *all)
{
        struct epd_list *pos;

        *uid = (struct holdings){ 0 };
        *all = (struct holdings){ 0 };
        epd_list_for_each(pos, &d->conns)
        {
                const struct epdd_client *o = epd_list_entry(pos, struct epdd_client, link);
                all->bindings += o->num_bindings;
                all->regions += o->num_regions;
                all->region_bytes += o->region_bytes;
                if (o->uid != c->uid)
                        continue;
                uid->bindings += o->num_bindings;
                uid->regions += o->num_regions;
                uid->region_bytes += o->region_bytes;
        }
}

int epd_budget_binding(struct epdd_daemon *d, const struct epdd_client *c, char *err,
                       size_t err_len)
{
        struct holdings uid, all;

        if (c->num_bindings >= d->cfg.max_bindings_per_client) {
                snprintf(err, err_len, "client holds %u rank bindings, the limit max_bindings_per_client",
                         c->num_bindings);
                return EPD_UNAVAILABLE;
        }
        count(d, c, &uid, &all);
        if (uid.bindings >= d->cfg.max_bindings_per_uid) {
                snprintf(err, err_len, "uid %u holds %u rank bindings, the limit max_bindings_per_uid",
                         (unsigned)c->uid, uid.bindings);
                return EPD_UNAVAILABLE;
        }
        if (all.bindings >= d->cfg.max_bindings) {
                snprintf(err, err_len, "the daemon holds %u rank bindings, the limit max_bindings",
                         all.bindings);
                return EPD_UNAVAILABLE;
        }
        return fds_left(d, 2, err, err_len);
}

int epd_budget_group(struct epdd_daemon *d, const struct epdd_client *c, char *err, size_t err_len)
{
        struct epd_list *pos;
        unsigned mine = 0;

        epd_list_for_each(pos, &d->groups)
        {
                const struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                mine += g->owner_uid == c->uid;
        }
        if (mine >= d->cfg.max_groups_per_uid) {
                snprintf(err, err_len, "uid %u created %u groups, the limit max_groups_per_uid",
                         (unsigned)c->uid, mine);
                return EPD_UNAVAILABLE;
        }
        return 0;
}

uint64_t epd_budget_group_memory(const struct epdd_group *g)
{
        uint64_t n = (g->cx ? g->cx->bytes : 0) + g->retired_arena_bytes;

        for (uint32_t r = 0; g->ranks && r < g->cfg.world_size; r++)
                if (g->ranks[r].arena)
                        n += g->ranks[r].arena->mapped;
        return n;
}

int epd_budget_group_bytes(struct epdd_daemon *d, uid_t owner, uint64_t more, char *err,
                           size_t err_len)
{
        struct epd_list *pos;
        uint64_t mine = 0, all = 0;

        epd_list_for_each(pos, &d->groups)
        {
                const struct epdd_group *g = epd_list_entry(pos, struct epdd_group, link);
                uint64_t n = epd_budget_group_memory(g);

                all += n;
                if (g->owner_uid == owner)
                        mine += n;
        }
        if (more > d->cfg.max_group_bytes_per_uid || mine > d->cfg.max_group_bytes_per_uid - more) {
                snprintf(err, err_len,
                         "%llu more bytes of group memory would exceed max_group_bytes_per_uid=%llu "
                         "(the groups uid %u created hold %llu)",
                         (unsigned long long)more,
                         (unsigned long long)d->cfg.max_group_bytes_per_uid, (unsigned)owner,
                         (unsigned long long)mine);
                return EPD_UNAVAILABLE;
        }
        if (more > d->cfg.max_group_bytes || all > d->cfg.max_group_bytes - more) {
                snprintf(err, err_len,
                         "%llu more bytes of group memory would exceed max_group_bytes=%llu "
                         "(every group holds %llu)",
                         (unsigned long long)more, (unsigned long long)d->cfg.max_group_bytes,
                         (unsigned long long)all);
                return EPD_UNAVAILABLE;
        }
        return 0;
}

int epd_budget_region(struct epdd_daemon *d, const struct epdd_client *c, uint64_t bytes, char *err,
                      size_t err_len)
{
        struct holdings uid, all;

        count(d, c, &uid, &all);
        if (uid.regions >= d->cfg.max_regions_per_uid) {
                snprintf(err, err_len, "uid %u has %u regions, the limit max_regions_per_uid",
                         (unsigned)c->uid, uid.regions);
                return EPD_UNAVAILABLE;
        }
        if (all.regions >= d->cfg.max_regions) {
                snprintf(err, err_len, "the daemon has %u regions, the limit max_regions",
                         all.regions);
                return EPD_UNAVAILABLE;
        }
        if (bytes > d->cfg.max_region_bytes_per_uid - uid.region_bytes ||
            uid.region_bytes > d->cfg.max_region_bytes_per_uid) {
                snprintf(err, err_len,
                         "registering %llu bytes would exceed max_region_bytes_per_uid=%llu (uid %u has %llu)",
                         (unsigned long long)bytes,
                         (unsigned long long)d->cfg.max_region_bytes_per_uid, (unsigned)c->uid,
                         (unsigned long long)uid.region_bytes);
                return EPD_UNAVAILABLE;
        }
        if (bytes > d->cfg.max_region_bytes - all.region_bytes ||
            all.region_bytes > d->cfg.max_region_bytes) {
                snprintf(err, err_len,
                         "registering %llu bytes would exceed max_region_bytes=%llu (the daemon has %llu)",
                         (unsigned long long)bytes, (unsigned long long)d->cfg.max_region_bytes,
                         (unsigned long long)all.region_bytes);
                return EPD_UNAVAILABLE;
        }
        return 0;
}
