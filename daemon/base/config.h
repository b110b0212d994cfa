/* config.h - the daemon's configuration: built-in defaults, then the INI file (inih), then
 * command-line flags. Keys marked hot are re-read on SIGHUP. Loop thread only. */
#ifndef EPD_DAEMON_CONFIG_H
#define EPD_DAEMON_CONFIG_H

#include <stdint.h>

#define EPD_CONFIG_PATH_DEFAULT "/etc/epd/epd.conf"
#define EPD_SOCKET_PATH_DEFAULT "/run/epd/epd.sock"
#define EPD_MAX_ALLOW 32

/* poll_us when the config does not set it: 1000 us on machines with at least 8 CPUs, else 0
 * (polling threads would take the cores of a small machine's clients). */
#define EPD_POLL_AUTO UINT32_MAX

struct epdd_config {
        char config_path[256];
        int config_path_set;          /* given with --config: a missing file is an error */
        /* [daemon] */
        char socket_path[108];        /* sun_path size */
        unsigned socket_mode;         /* default 0660 */
        char socket_group[64];        /* group owning the socket; empty: unchanged */
        char backend[16];             /* auto | host | cuda */
        int log_level;                /* hot */
        char metrics_listen[64];      /* ADDR:PORT, empty: off */
        char admin_group[64];         /* hot; may use admin verbs besides root; empty: root only */
        uint32_t allow_uids[EPD_MAX_ALLOW]; /* hot; empty lists: anyone who can open the socket */
        unsigned num_allow_uids;
        uint32_t allow_gids[EPD_MAX_ALLOW];
        unsigned num_allow_gids;
        uint32_t op_timeout_ms;       /* hot; default group op timeout */
        uint32_t peer_lost_ms;        /* hot; bound on reporting PEER_LOST after a disconnect */
        uint64_t arena_bytes;         /* default per-rank output arena */
        uint64_t max_arena_bytes;     /* address space reserved per arena: `epctl resize` limit */
        uint32_t max_arena_segments;  /* segments per arena: a grow adds one */
        uint32_t poll_us;             /* the executor and the loop thread poll this long after
                                       * an op before sleeping (0: never; AUTO: see above) */
        int cuda_graphs;              /* read at start; 1 (default): an op of one kernel on one
                                       * device is sent as one CUDA graph (event, kernel, event);
                                       * 0: record, launch, record, as when a graph fails */
        /* [limits], hot (apply to new requests) except max_frame_bytes and max_fds_per_frame:
         * those size the receive buffer at start and are announced to clients at hello. */
        uint32_t max_op_timeout_ms;   /* bounds the daemon default and every group's timeout */
        uint32_t max_clients;
        uint32_t max_clients_per_uid;  /* connections of one uid other than administrators' */
        uint32_t admin_reserved_clients; /* beyond max_clients, for root and admin_group */
        uint32_t handshake_timeout_ms; /* a connection without Hello by then is closed */
        uint32_t max_groups;
        uint32_t max_regions_per_client;
        uint64_t max_region_bytes_per_client;
        uint32_t max_outstanding_ops_per_client;
        uint32_t max_handles_per_group;
        uint32_t max_frame_bytes;
        uint32_t max_fds_per_frame;
        uint64_t max_output_queue_bytes; /* a client that stops reading is disconnected */
        /* Per uid and per daemon (budget.c), hot. */
        uint32_t max_bindings_per_client; /* rank bindings one client holds (2 descriptors each) */
        uint32_t max_bindings_per_uid; /* rank bindings of all the clients of one uid */
        uint32_t max_bindings; /* rank bindings in the daemon */
        uint32_t max_groups_per_uid; /* groups one uid created */
        uint32_t max_regions_per_uid; /* regions of all the clients of one uid */
        uint32_t max_regions; /* regions in the daemon (one mapping each: keep under vm.max_map_count) */
        uint32_t fd_headroom; /* descriptors kept free for accepting and replying */
        uint64_t max_region_bytes_per_uid; /* region bytes of all the clients of one uid */
        uint64_t max_region_bytes; /* region bytes in the daemon */
        uint64_t max_group_bytes_per_uid; /* memory the daemon makes for the groups one uid
                                           * created: output arenas, client-executed buffers */
        uint64_t max_group_bytes; /* the same for every group */
        uint64_t max_output_queue_bytes_total; /* reply bytes queued for every client together */
        /* [host] */
        uint32_t host_devices;        /* virtual devices; 0: 1 */
        uint32_t host_threads;        /* copy threads; 0: number of CPUs */
};

void epd_config_defaults(struct epdd_config *cfg);
/* Reads the INI file into cfg. Returns 0, -ENOENT when the file is missing, or -EINVAL with
 * err naming the line and key. */
int epd_config_load(struct epdd_config *cfg, const char *path, char *err, size_t err_len);
/* Applies one key (section, name, value) as the INI file would. 0 or -EINVAL. */
int epd_config_set(struct epdd_config *cfg, const char *section, const char *name,
                   const char *value, char *err, size_t err_len);
/* Checks the keys against each other (a configuration that parses may still never run): 0, or
 * -EINVAL with err naming the keys. */
int epd_config_validate(const struct epdd_config *cfg, char *err, size_t err_len);
/* poll_us in nanoseconds, with EPD_POLL_AUTO resolved for this machine. */
uint64_t epd_config_poll_ns(const struct epdd_config *cfg);
/* Copies the keys that may change at run time from src into dst (SIGHUP). */
void epd_config_apply_hot(struct epdd_config *dst, const struct epdd_config *src);

#endif
