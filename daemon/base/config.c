/* config.c - defaults, INI parsing with inih, and hot reload of the daemon configuration. */
#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <strings.h>
#include <syslog.h>

#include "config.h"
#include "log.h"
#include "util.h"

void epd_config_defaults(struct epdd_config *cfg)
{
        memset(cfg, 0, sizeof(*cfg));
        snprintf(cfg->config_path, sizeof(cfg->config_path), "%s", EPD_CONFIG_PATH_DEFAULT);
        snprintf(cfg->socket_path, sizeof(cfg->socket_path), "%s", EPD_SOCKET_PATH_DEFAULT);
        snprintf(cfg->backend, sizeof(cfg->backend), "auto");
        cfg->socket_mode = 0660;
        cfg->log_level = LOG_INFO;
        cfg->poll_us = EPD_POLL_AUTO;
        cfg->cuda_graphs = 1;
        cfg->op_timeout_ms = 10000;
        cfg->peer_lost_ms = 100;
        cfg->arena_bytes = 64ull << 20;
        cfg->max_arena_bytes = 64ull << 30;
        cfg->max_arena_segments = 64;
        cfg->max_op_timeout_ms = 60000;
        cfg->max_clients = 256;
        cfg->max_clients_per_uid = 128;
        cfg->admin_reserved_clients = 4;
        cfg->handshake_timeout_ms = 5000;
        cfg->max_groups = 64;
        cfg->max_regions_per_client = 1024;
        cfg->max_region_bytes_per_client = 1ull << 40;
        cfg->max_outstanding_ops_per_client = 64;
        cfg->max_handles_per_group = 4096;
        cfg->max_frame_bytes = 64u * 1024u;
        cfg->max_fds_per_frame = 8;
        cfg->max_output_queue_bytes = 8ull << 20;
        cfg->max_bindings_per_client = 64;
        cfg->max_bindings_per_uid = 1024;
        cfg->max_bindings = 8192;
        cfg->max_groups_per_uid = 32;
        cfg->max_regions_per_uid = 16384;
        cfg->max_regions = 32768;
        cfg->fd_headroom = 64;
        cfg->max_region_bytes_per_uid = 1ull << 42;
        cfg->max_region_bytes = 1ull << 44;
        cfg->max_group_bytes_per_uid = 1ull << 42;
        cfg->max_group_bytes = 1ull << 44;
        cfg->max_output_queue_bytes_total = 256ull << 20;
        cfg->host_devices = 1;
        cfg->host_threads = 0;
}

/* Decimal, or hexadecimal with 0x. Not octal: a leading zero is a decimal digit here, so that
 * "0100" in allow_uids means uid 100, not 64. Signs and leading spaces are refused (strtoull
 * would silently negate "-1" into a huge value). */
static int parse_u64(const char *value, uint64_t max, uint64_t *out)
{
        char *end;
        unsigned long long v;
        uint64_t mult = 1;
        int hex = value[0] == '0' && (value[1] == 'x' || value[1] == 'X');

        if (!isdigit((unsigned char)value[0]) || (hex && !isxdigit((unsigned char)value[2])))
                return -EINVAL;
        errno = 0;
        v = strtoull(value, &end, hex ? 16 : 10);
        if (errno || end == value)
                return -EINVAL;
        /* Sizes may carry a binary suffix: K, M, G, T. */
        if (*end) {
                switch (*end) {
                case 'K': case 'k': mult = 1ull << 10; break;
                case 'M': case 'm': mult = 1ull << 20; break;
                case 'G': case 'g': mult = 1ull << 30; break;
                case 'T': case 't': mult = 1ull << 40; break;
                default: return -EINVAL;
                }
                if (end[1] && strcasecmp(end + 1, "iB") != 0 && strcasecmp(end + 1, "B") != 0)
                        return -EINVAL;
        }
        if (v > max / mult)
                return -ERANGE;
        *out = v * mult;
        return 0;
}

/* on/off, true/false, yes/no, 1/0, any case. */
static int parse_bool(const char *value, int *out)
{
        static const char *const on[] = { "on", "true", "yes", "1" };
        static const char *const off[] = { "off", "false", "no", "0" };

        for (unsigned i = 0; i < EPD_ARRAY_SIZE(on); i++) {
                if (strcasecmp(value, on[i]) == 0) {
                        *out = 1;
                        return 0;
                }
                if (strcasecmp(value, off[i]) == 0) {
                        *out = 0;
                        return 0;
                }
        }
        return -EINVAL;
}

/* ids and count are written only on success: a bad list leaves the previous one in place. */
static int parse_id_list(const char *value, uint32_t *ids, unsigned *count)
{
        char buf[512], *save = NULL, *tok;
        uint32_t parsed[EPD_MAX_ALLOW];
        unsigned n = 0;

        /* A list cut short by the buffer could end in a truncated, different id. */
        if (strlen(value) >= sizeof(buf))
                return -EINVAL;
        snprintf(buf, sizeof(buf), "%s", value);
        for (tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
                uint64_t v;
                if (n >= EPD_MAX_ALLOW || parse_u64(tok, UINT32_MAX, &v) < 0)
                        return -EINVAL;
                parsed[n++] = (uint32_t)v;
        }
        memcpy(ids, parsed, n * sizeof(*ids));
        *count = n;
        return 0;
}

#define STR_KEY(sec, key, field)                                                        \
        if (strcmp(section, sec) == 0 && strcmp(name, key) == 0) {                      \
                if (strlen(value) >= sizeof(cfg->field))                                \
                        goto too_long;                                                  \
                snprintf(cfg->field, sizeof(cfg->field), "%s", value);                  \
                return 0;                                                               \
        }
#define NUM_KEY(sec, key, field, max)                                                   \
        if (strcmp(section, sec) == 0 && strcmp(name, key) == 0) {                      \
                uint64_t v_;                                                            \
                if (parse_u64(value, max, &v_) < 0)                                     \
                        goto bad_number;                                                \
                cfg->field = v_;                                                        \
                return 0;                                                               \
        }

int epd_config_set(struct epdd_config *cfg, const char *section, const char *name,
                   const char *value, char *err, size_t err_len)
{
        STR_KEY("daemon", "socket", socket_path)
        STR_KEY("daemon", "socket_group", socket_group)
        STR_KEY("daemon", "metrics_listen", metrics_listen)
        STR_KEY("daemon", "admin_group", admin_group)
        NUM_KEY("daemon", "op_timeout_ms", op_timeout_ms, 3600000)
        NUM_KEY("daemon", "peer_lost_ms", peer_lost_ms, 60000)
        NUM_KEY("daemon", "arena_bytes", arena_bytes, 1ull << 40)
        NUM_KEY("daemon", "max_arena_bytes", max_arena_bytes, 1ull << 44)
        NUM_KEY("daemon", "max_arena_segments", max_arena_segments, 1024)
        NUM_KEY("daemon", "poll_us", poll_us, 100000)
        NUM_KEY("limits", "max_op_timeout_ms", max_op_timeout_ms, 3600000)
        NUM_KEY("limits", "max_clients", max_clients, 65536)
        NUM_KEY("limits", "max_clients_per_uid", max_clients_per_uid, 65536)
        NUM_KEY("limits", "admin_reserved_clients", admin_reserved_clients, 1024)
        NUM_KEY("limits", "handshake_timeout_ms", handshake_timeout_ms, 600000)
        NUM_KEY("limits", "max_groups", max_groups, 65536)
        NUM_KEY("limits", "max_regions_per_client", max_regions_per_client, 1u << 20)
        NUM_KEY("limits", "max_region_bytes_per_client", max_region_bytes_per_client, 1ull << 50)
        NUM_KEY("limits", "max_outstanding_ops_per_client", max_outstanding_ops_per_client, 1u << 16)
        NUM_KEY("limits", "max_handles_per_group", max_handles_per_group, 1u << 20)
        NUM_KEY("limits", "max_frame_bytes", max_frame_bytes, 16u << 20)
        NUM_KEY("limits", "max_fds_per_frame", max_fds_per_frame, 16)
        NUM_KEY("limits", "max_output_queue_bytes", max_output_queue_bytes, 1ull << 34)
        NUM_KEY("limits", "max_bindings_per_client", max_bindings_per_client, 1u << 20)
        NUM_KEY("limits", "max_bindings_per_uid", max_bindings_per_uid, 1u << 20)
        NUM_KEY("limits", "max_bindings", max_bindings, 1u << 24)
        NUM_KEY("limits", "max_groups_per_uid", max_groups_per_uid, 65536)
        NUM_KEY("limits", "max_regions_per_uid", max_regions_per_uid, 1u << 24)
        NUM_KEY("limits", "max_regions", max_regions, 1u << 24)
        NUM_KEY("limits", "fd_headroom", fd_headroom, 65536)
        NUM_KEY("limits", "max_region_bytes_per_uid", max_region_bytes_per_uid, 1ull << 50)
        NUM_KEY("limits", "max_region_bytes", max_region_bytes, 1ull << 50)
        NUM_KEY("limits", "max_group_bytes_per_uid", max_group_bytes_per_uid, 1ull << 50)
        NUM_KEY("limits", "max_group_bytes", max_group_bytes, 1ull << 50)
        NUM_KEY("limits", "max_output_queue_bytes_total", max_output_queue_bytes_total, 1ull << 36)
        NUM_KEY("host", "devices", host_devices, 64)
        NUM_KEY("host", "threads", host_threads, 256)
        if (strcmp(section, "daemon") == 0 && strcmp(name, "backend") == 0) {
                if (strcmp(value, "auto") && strcmp(value, "host") && strcmp(value, "cuda")) {
                        snprintf(err, err_len, "backend must be auto, host or cuda, not '%s'", value);
                        return -EINVAL;
                }
                snprintf(cfg->backend, sizeof(cfg->backend), "%s", value);
                return 0;
        }
        if (strcmp(section, "daemon") == 0 && strcmp(name, "socket_mode") == 0) {
                char *end;
                unsigned long mode = strtoul(value, &end, 8);
                /* strtoul would also take leading spaces and a sign ("-0"). */
                if (*value < '0' || *value > '7' || *end || mode > 0777) {
                        snprintf(err, err_len, "socket_mode must be octal like 0660, not '%s'", value);
                        return -EINVAL;
                }
                cfg->socket_mode = (unsigned)mode;
                return 0;
        }
        if (strcmp(section, "daemon") == 0 && strcmp(name, "log_level") == 0) {
                int level = epd_log_parse_level(value);
                if (level < 0) {
                        snprintf(err, err_len, "log_level must be error, warning, notice, info or debug, not '%s'", value);
                        return -EINVAL;
                }
                cfg->log_level = level;
                return 0;
        }
        if (strcmp(section, "daemon") == 0 && strcmp(name, "cuda_graphs") == 0) {
                if (parse_bool(value, &cfg->cuda_graphs) < 0) {
                        snprintf(err, err_len, "[daemon] cuda_graphs must be on or off, not '%s'",
                                 value);
                        return -EINVAL;
                }
                return 0;
        }
        if (strcmp(section, "daemon") == 0 && strcmp(name, "allow_uids") == 0) {
                if (parse_id_list(value, cfg->allow_uids, &cfg->num_allow_uids) < 0)
                        goto bad_number;
                return 0;
        }
        if (strcmp(section, "daemon") == 0 && strcmp(name, "allow_gids") == 0) {
                if (parse_id_list(value, cfg->allow_gids, &cfg->num_allow_gids) < 0)
                        goto bad_number;
                return 0;
        }
        snprintf(err, err_len, "unknown key [%s] %s", section, name);
        return -EINVAL;
too_long:
        snprintf(err, err_len, "value of [%s] %s is too long", section, name);
        return -EINVAL;
bad_number:
        snprintf(err, err_len, "[%s] %s: '%s' is not a valid number in range", section, name, value);
        return -EINVAL;
}

struct load_ctx {
        struct epdd_config *cfg;
        FILE *f;
        char *err;
        size_t err_len;
        int line;                     /* lines read so far: the line the handler is called for */
        int failed_line;              /* first line refused (bad key, or too long); 0: none */
};

/* fgets that counts lines, so that a refused key is reported with its own line even after an
 * earlier syntax error (inih returns only the first error's line), and that refuses a line
 * longer than inih's buffer: inih would parse its tail as a line of its own, or, when the tail
 * starts with a space, as a continuation that replaces the value. Reading stops at the first
 * refusal. */
static char *config_reader(char *str, int num, void *stream)
{
        struct load_ctx *ctx = stream;
        size_t len;

        if (ctx->failed_line || !fgets(str, num, ctx->f))
                return NULL;
        ctx->line++;
        len = strlen(str);
        if (len > 0 && str[len - 1] != '\n' && len == (size_t)num - 1) {
                int c = getc(ctx->f);
                if (c != EOF) {
                        snprintf(ctx->err, ctx->err_len, "line longer than %d characters",
                                 num - 2);
                        ctx->failed_line = ctx->line;
                        return NULL;
                }
        }
        return str;
}

static int config_ini_handler(void *user, const char *section, const char *name, const char *value)
{
        struct load_ctx *ctx = user;

        if (ctx->failed_line)
                return 0;
        if (epd_config_set(ctx->cfg, section, name, value, ctx->err, ctx->err_len) < 0) {
                ctx->failed_line = ctx->line;
                return 0;
        }
        return 1;
}

int epd_config_load(struct epdd_config *cfg, const char *path, char *err, size_t err_len)
{
        struct load_ctx ctx = { .cfg = cfg, .err = err, .err_len = err_len };
        char msg[512];
        int line;

        ctx.f = fopen(path, "re");
        if (!ctx.f) {
                int rc = -errno;
                snprintf(err, err_len, "cannot open %s: %s", path, strerror(-rc));
                return rc;
        }
        line = ini_parse_stream(config_reader, &ctx, config_ini_handler, &ctx);
        fclose(ctx.f);
        if (line > 0 && (ctx.failed_line == 0 || line < ctx.failed_line))
                snprintf(msg, sizeof(msg), "%s:%d: syntax error", path, line);
        else if (ctx.failed_line)
                snprintf(msg, sizeof(msg), "%s:%d: %s", path, ctx.failed_line, err);
        else if (line != 0)
                snprintf(msg, sizeof(msg), "%s: cannot parse (inih error %d)", path, line);
        else
                return 0;
        snprintf(err, err_len, "%s", msg);
        return -EINVAL;
}

int epd_config_validate(const struct epdd_config *cfg, char *err, size_t err_len)
{
        if (cfg->op_timeout_ms == 0 || cfg->max_op_timeout_ms == 0) {
                snprintf(err, err_len, "%s must be at least 1 ms",
                         cfg->op_timeout_ms ? "max_op_timeout_ms" : "op_timeout_ms");
                return -EINVAL;
        }
        if (cfg->op_timeout_ms > cfg->max_op_timeout_ms) {
                snprintf(err, err_len, "op_timeout_ms %u exceeds max_op_timeout_ms %u",
                         (unsigned)cfg->op_timeout_ms, (unsigned)cfg->max_op_timeout_ms);
                return -EINVAL;
        }
        if (cfg->max_clients == 0 || cfg->max_groups == 0 || cfg->max_clients_per_uid == 0 ||
            cfg->handshake_timeout_ms == 0) {
                snprintf(err, err_len, "%s must be at least 1",
                         !cfg->max_clients       ? "max_clients"
                         : !cfg->max_groups      ? "max_groups"
                         : !cfg->max_clients_per_uid ? "max_clients_per_uid"
                                                 : "handshake_timeout_ms");
                return -EINVAL;
        }
        return 0;
}

uint64_t epd_config_poll_ns(const struct epdd_config *cfg)
{
        /* Long enough to span the gap between a decoding model's MoE layers (a few hundred
         * microseconds), so that their requests go through the doorbell pages and the threads
         * need no wake-up (docs/performance.md, "Where the last rank's overhead goes"). */
        if (cfg->poll_us == EPD_POLL_AUTO)
                return sysconf(_SC_NPROCESSORS_ONLN) >= 8 ? 1000000 : 0;
        return (uint64_t)cfg->poll_us * 1000;
}

void epd_config_apply_hot(struct epdd_config *dst, const struct epdd_config *src)
{
        dst->log_level = src->log_level;
        dst->op_timeout_ms = src->op_timeout_ms;
        dst->peer_lost_ms = src->peer_lost_ms;
        dst->max_op_timeout_ms = src->max_op_timeout_ms;
        dst->max_clients = src->max_clients;
        dst->max_clients_per_uid = src->max_clients_per_uid;
        dst->admin_reserved_clients = src->admin_reserved_clients;
        dst->handshake_timeout_ms = src->handshake_timeout_ms;
        dst->max_groups = src->max_groups;
        dst->max_regions_per_client = src->max_regions_per_client;
        dst->max_region_bytes_per_client = src->max_region_bytes_per_client;
        dst->max_outstanding_ops_per_client = src->max_outstanding_ops_per_client;
        dst->max_handles_per_group = src->max_handles_per_group;
        dst->max_output_queue_bytes = src->max_output_queue_bytes;
        dst->max_bindings_per_client = src->max_bindings_per_client;
        dst->max_bindings_per_uid = src->max_bindings_per_uid;
        dst->max_bindings = src->max_bindings;
        dst->max_groups_per_uid = src->max_groups_per_uid;
        dst->max_regions_per_uid = src->max_regions_per_uid;
        dst->max_regions = src->max_regions;
        dst->fd_headroom = src->fd_headroom;
        dst->max_region_bytes_per_uid = src->max_region_bytes_per_uid;
        dst->max_region_bytes = src->max_region_bytes;
        dst->max_group_bytes_per_uid = src->max_group_bytes_per_uid;
        dst->max_group_bytes = src->max_group_bytes;
        dst->max_output_queue_bytes_total = src->max_output_queue_bytes_total;
        memcpy(dst->allow_uids, src->allow_uids, sizeof(dst->allow_uids));
        dst->num_allow_uids = src->num_allow_uids;
        memcpy(dst->allow_gids, src->allow_gids, sizeof(dst->allow_gids));
        dst->num_allow_gids = src->num_allow_gids;
        snprintf(dst->admin_group, sizeof(dst->admin_group), "%s", src->admin_group);
}
