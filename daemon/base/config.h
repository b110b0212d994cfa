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
        uint32_t max_clients;
        uint32_t max_groups;
        uint32_t max_regions_per_client;
        uint64_t max_region_bytes_per_client;
        uint32_t max_outstanding_ops_per_client;
        uint32_t max_handles_per_group;
        uint32_t max_frame_bytes;
        uint32_t max_fds_per_frame;
        uint64_t max_output_queue_bytes; /* a client that stops reading is disconnected */
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
/* Copies the keys that may change at run time from src into dst (SIGHUP). */
/* poll_us in nanoseconds, with EPD_POLL_AUTO resolved for this machine. */
uint64_t epd_config_poll_ns(const struct epdd_config *cfg);
void epd_config_apply_hot(struct epdd_config *dst, const struct epdd_config *src);

#endif
