/* unit_config.c - the daemon configuration (daemon/base/config.c): defaults, every key, number and
 * size parsing, range limits, socket_mode, allow lists, INI files (errors name the line) and the
 * hot keys a SIGHUP copies. Each test runs in its own process (fork mode).
 */
#include <check.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <unistd.h>

#include "config.h"

/* ---- helpers ---- */

/* Writes text to a new temporary file and returns its path (static buffer). */
static const char *write_conf(const char *text)
{
        static char path[256];
        const char *dir = getenv("TMPDIR");
        FILE *f;
        int fd;

        snprintf(path, sizeof(path), "%s/unit_config.XXXXXX", dir && *dir ? dir : "/tmp");
        fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        f = fdopen(fd, "w");
        ck_assert_ptr_nonnull(f);
        ck_assert_int_eq(fputs(text, f) >= 0, 1);
        ck_assert_int_eq(fclose(f), 0);
        return path;
}

static int set(struct epdd_config *cfg, const char *section, const char *name, const char *value,
               char *err, size_t err_len)
{
        err[0] = '\0';
        return epd_config_set(cfg, section, name, value, err, err_len);
}

/* Reads an unsigned field of any width at an offset into the config. */
static uint64_t field_u(const struct epdd_config *cfg, size_t off, size_t size)
{
        const uint8_t *p = (const uint8_t *)cfg + off;

        switch (size) {
        case 4: {
                uint32_t v;
                memcpy(&v, p, 4);
                return v;
        }
        case 8: {
                uint64_t v;
                memcpy(&v, p, 8);
                return v;
        }
        }
        ck_abort_msg("field size %zu", size);
        return 0;
}

#define FIELD(f) offsetof(struct epdd_config, f), sizeof(((struct epdd_config *)0)->f)

/* Every numeric key: section, name, field, largest accepted value. */
static const struct num_key {
        const char *section, *name;
        size_t off, size;
        uint64_t max;
} num_keys[] = {
        { "daemon", "op_timeout_ms", FIELD(op_timeout_ms), 3600000 },
        { "daemon", "peer_lost_ms", FIELD(peer_lost_ms), 60000 },
        { "daemon", "arena_bytes", FIELD(arena_bytes), 1ull << 40 },
        { "daemon", "max_arena_bytes", FIELD(max_arena_bytes), 1ull << 44 },
        { "daemon", "max_arena_segments", FIELD(max_arena_segments), 1024 },
        { "daemon", "poll_us", FIELD(poll_us), 100000 },
        { "limits", "max_op_timeout_ms", FIELD(max_op_timeout_ms), 3600000 },
        { "limits", "max_clients", FIELD(max_clients), 65536 },
        { "limits", "max_clients_per_uid", FIELD(max_clients_per_uid), 65536 },
        { "limits", "admin_reserved_clients", FIELD(admin_reserved_clients), 1024 },
        { "limits", "handshake_timeout_ms", FIELD(handshake_timeout_ms), 600000 },
        { "limits", "max_groups", FIELD(max_groups), 65536 },
        { "limits", "max_regions_per_client", FIELD(max_regions_per_client), 1u << 20 },
        { "limits", "max_region_bytes_per_client", FIELD(max_region_bytes_per_client),
          1ull << 50 },
        { "limits", "max_outstanding_ops_per_client", FIELD(max_outstanding_ops_per_client),
          1u << 16 },
        { "limits", "max_handles_per_group", FIELD(max_handles_per_group), 1u << 20 },
        { "limits", "max_frame_bytes", FIELD(max_frame_bytes), 16u << 20 },
        { "limits", "max_fds_per_frame", FIELD(max_fds_per_frame), 16 },
        { "limits", "max_output_queue_bytes", FIELD(max_output_queue_bytes), 1ull << 34 },
        { "limits", "max_group_bytes_per_uid", FIELD(max_group_bytes_per_uid), 1ull << 50 },
        { "limits", "max_group_bytes", FIELD(max_group_bytes), 1ull << 50 },
        { "host", "devices", FIELD(host_devices), 64 },
        { "host", "threads", FIELD(host_threads), 256 },
};
#define NUM_KEYS (sizeof(num_keys) / sizeof(num_keys[0]))

/* Asserts that two configurations agree in every field (strings up to their terminator, lists
 * up to their count). */
static void assert_cfg_eq(const struct epdd_config *a, const struct epdd_config *b)
{
        ck_assert_str_eq(a->config_path, b->config_path);
        ck_assert_int_eq(a->config_path_set, b->config_path_set);
        ck_assert_str_eq(a->socket_path, b->socket_path);
        ck_assert_uint_eq(a->socket_mode, b->socket_mode);
        ck_assert_str_eq(a->socket_group, b->socket_group);
        ck_assert_str_eq(a->backend, b->backend);
        ck_assert_int_eq(a->log_level, b->log_level);
        ck_assert_str_eq(a->metrics_listen, b->metrics_listen);
        ck_assert_str_eq(a->admin_group, b->admin_group);
        ck_assert_uint_eq(a->num_allow_uids, b->num_allow_uids);
        ck_assert_mem_eq(a->allow_uids, b->allow_uids, a->num_allow_uids * sizeof(uint32_t));
        ck_assert_uint_eq(a->num_allow_gids, b->num_allow_gids);
        ck_assert_mem_eq(a->allow_gids, b->allow_gids, a->num_allow_gids * sizeof(uint32_t));
        ck_assert_uint_eq(a->op_timeout_ms, b->op_timeout_ms);
        ck_assert_uint_eq(a->peer_lost_ms, b->peer_lost_ms);
        ck_assert_uint_eq(a->arena_bytes, b->arena_bytes);
        ck_assert_uint_eq(a->max_arena_bytes, b->max_arena_bytes);
        ck_assert_uint_eq(a->max_arena_segments, b->max_arena_segments);
        ck_assert_uint_eq(a->max_op_timeout_ms, b->max_op_timeout_ms);
        ck_assert_uint_eq(a->max_clients, b->max_clients);
        ck_assert_uint_eq(a->max_clients_per_uid, b->max_clients_per_uid);
        ck_assert_uint_eq(a->admin_reserved_clients, b->admin_reserved_clients);
        ck_assert_uint_eq(a->handshake_timeout_ms, b->handshake_timeout_ms);
        ck_assert_uint_eq(a->max_groups, b->max_groups);
        ck_assert_uint_eq(a->max_regions_per_client, b->max_regions_per_client);
        ck_assert_uint_eq(a->max_region_bytes_per_client, b->max_region_bytes_per_client);
        ck_assert_uint_eq(a->max_outstanding_ops_per_client, b->max_outstanding_ops_per_client);
        ck_assert_uint_eq(a->max_handles_per_group, b->max_handles_per_group);
        ck_assert_uint_eq(a->max_frame_bytes, b->max_frame_bytes);
        ck_assert_uint_eq(a->max_fds_per_frame, b->max_fds_per_frame);
        ck_assert_uint_eq(a->max_output_queue_bytes, b->max_output_queue_bytes);
        ck_assert_uint_eq(a->host_devices, b->host_devices);
        ck_assert_uint_eq(a->host_threads, b->host_threads);
        ck_assert_int_eq(a->cuda_graphs, b->cuda_graphs);
}

/* ---- defaults ---- */

START_TEST(test_defaults)
{
        struct epdd_config cfg;

        memset(&cfg, 0xee, sizeof(cfg));
        epd_config_defaults(&cfg);
        ck_assert_str_eq(cfg.config_path, "/etc/epd/epd.conf");
        ck_assert_int_eq(cfg.config_path_set, 0);
        ck_assert_str_eq(cfg.socket_path, "/run/epd/epd.sock");
        ck_assert_uint_eq(cfg.socket_mode, 0660);
        ck_assert_str_eq(cfg.socket_group, "");
        ck_assert_str_eq(cfg.backend, "auto");
        ck_assert_int_eq(cfg.log_level, LOG_INFO);
        ck_assert_str_eq(cfg.metrics_listen, "");
        ck_assert_str_eq(cfg.admin_group, "");
        ck_assert_uint_eq(cfg.num_allow_uids, 0);
        ck_assert_uint_eq(cfg.num_allow_gids, 0);
        ck_assert_uint_eq(cfg.op_timeout_ms, 10000);
        ck_assert_uint_eq(cfg.peer_lost_ms, 100);
        ck_assert_uint_eq(cfg.arena_bytes, 64ull << 20);
        /* The [limits] defaults README.md documents. */
        ck_assert_uint_eq(cfg.max_op_timeout_ms, 60000);
        ck_assert_uint_eq(cfg.max_clients, 256);
        ck_assert_uint_eq(cfg.max_clients_per_uid, 128);
        ck_assert_uint_eq(cfg.admin_reserved_clients, 4);
        ck_assert_uint_eq(cfg.handshake_timeout_ms, 5000);
        ck_assert_uint_eq(cfg.max_groups, 64);
        ck_assert_uint_eq(cfg.max_regions_per_client, 1024);
        ck_assert_uint_eq(cfg.max_region_bytes_per_client, 1ull << 40);
        ck_assert_uint_eq(cfg.max_outstanding_ops_per_client, 64);
        ck_assert_uint_eq(cfg.max_handles_per_group, 4096);
        ck_assert_uint_eq(cfg.max_frame_bytes, 64u * 1024u);
        ck_assert_uint_eq(cfg.max_fds_per_frame, 8);
        ck_assert_uint_eq(cfg.max_output_queue_bytes, 8ull << 20);
        ck_assert_uint_eq(cfg.host_devices, 1);
        ck_assert_uint_eq(cfg.host_threads, 0);
        /* Unset, the executor's polling is chosen from the machine's CPUs. */
        ck_assert_uint_eq(cfg.poll_us, EPD_POLL_AUTO);
        /* Every other default lies within the range the key accepts. */
        for (unsigned i = 0; i < NUM_KEYS; i++)
                if (num_keys[i].off != offsetof(struct epdd_config, poll_us))
                        ck_assert_uint_le(field_u(&cfg, num_keys[i].off, num_keys[i].size),
                                          num_keys[i].max);
}
END_TEST

/* ---- numeric keys ---- */

START_TEST(test_every_numeric_key)
{
        const struct num_key *k = &num_keys[_i];
        struct epdd_config cfg;
        char err[256], value[64];

        epd_config_defaults(&cfg);
        ck_assert_int_eq(set(&cfg, k->section, k->name, "7", err, sizeof(err)), 0);
        ck_assert_uint_eq(field_u(&cfg, k->off, k->size), 7);
        ck_assert_int_eq(set(&cfg, k->section, k->name, "0", err, sizeof(err)), 0);
        ck_assert_uint_eq(field_u(&cfg, k->off, k->size), 0);

        /* The largest accepted value, then one more. */
        snprintf(value, sizeof(value), "%llu", (unsigned long long)k->max);
        ck_assert_int_eq(set(&cfg, k->section, k->name, value, err, sizeof(err)), 0);
        ck_assert_uint_eq(field_u(&cfg, k->off, k->size), k->max);
        snprintf(value, sizeof(value), "%llu", (unsigned long long)k->max + 1);
        ck_assert_int_eq(set(&cfg, k->section, k->name, value, err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, k->name) != NULL, "err '%s' does not name the key", err);
        /* A refused value leaves the field alone. */
        ck_assert_uint_eq(field_u(&cfg, k->off, k->size), k->max);

        /* The same key in another section is unknown. */
        ck_assert_int_eq(set(&cfg, strcmp(k->section, "host") ? "host" : "daemon", k->name, "1",
                             err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "unknown key") != NULL, "err: %s", err);
}
END_TEST

START_TEST(test_bad_numbers)
{
        static const char *const bad[] = {
                "", "abc", "12x", "-1", "-0", "+5", " 5", "1.5", "1e3", "0x", "0xg", "5 K",
                "K", "1KK", "1Ki", "1KiBB", "1Q", "99999999999999999999999", "0b101", "1,000",
        };
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                int rc = set(&cfg, "daemon", "arena_bytes", bad[i], err, sizeof(err));
                ck_assert_msg(rc == -EINVAL, "'%s' was accepted (rc %d)", bad[i], rc);
                ck_assert_msg(strstr(err, "arena_bytes") != NULL, "'%s': err '%s'", bad[i], err);
                ck_assert_uint_eq(cfg.arena_bytes, 64ull << 20);
        }
}
END_TEST

START_TEST(test_number_bases)
{
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        ck_assert_int_eq(set(&cfg, "limits", "max_clients", "1000", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.max_clients, 1000);
        /* Hexadecimal with 0x. */
        ck_assert_int_eq(set(&cfg, "limits", "max_clients", "0x100", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.max_clients, 256);
        ck_assert_int_eq(set(&cfg, "limits", "max_clients", "0X1f", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.max_clients, 31);
        /* A leading zero is decimal, not octal. */
        ck_assert_int_eq(set(&cfg, "limits", "max_clients", "0100", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.max_clients, 100);
        ck_assert_int_eq(set(&cfg, "limits", "max_clients", "09", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.max_clients, 9);
}
END_TEST

START_TEST(test_size_suffixes)
{
        static const struct {
                const char *value;
                uint64_t bytes;
        } ok[] = {
                { "1K", 1ull << 10 },     { "1k", 1ull << 10 },   { "3M", 3ull << 20 },
                { "3m", 3ull << 20 },     { "2G", 2ull << 30 },   { "2g", 2ull << 30 },
                { "1T", 1ull << 40 },     { "1t", 1ull << 40 },   { "4KiB", 4ull << 10 },
                { "4kib", 4ull << 10 },   { "5MiB", 5ull << 20 }, { "6GiB", 6ull << 30 },
                { "7KB", 7ull << 10 },    { "0K", 0 },            { "512", 512 },
                { "1024G", 1ull << 40 },  { "0x10M", 16ull << 20 },
        };
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        for (unsigned i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
                int rc = set(&cfg, "daemon", "arena_bytes", ok[i].value, err, sizeof(err));
                ck_assert_msg(rc == 0, "'%s': rc %d err '%s'", ok[i].value, rc, err);
                ck_assert_msg(cfg.arena_bytes == ok[i].bytes, "'%s' gave %llu, want %llu",
                              ok[i].value, (unsigned long long)cfg.arena_bytes,
                              (unsigned long long)ok[i].bytes);
        }
        /* The range applies after the suffix: arena_bytes is at most 1T. */
        ck_assert_int_eq(set(&cfg, "daemon", "arena_bytes", "2T", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "arena_bytes", "1025G", err, sizeof(err)),
                         -EINVAL);
        ck_assert_uint_eq(cfg.arena_bytes, 16ull << 20);
        /* A multiplication that would overflow 64 bits is out of range, not wrapped. */
        ck_assert_int_eq(set(&cfg, "limits", "max_region_bytes_per_client", "17179869184T",
                             err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "limits", "max_region_bytes_per_client", "1024T", err,
                             sizeof(err)), 0);
        ck_assert_uint_eq(cfg.max_region_bytes_per_client, 1ull << 50);
        /* Suffixes on small limits. */
        ck_assert_int_eq(set(&cfg, "limits", "max_frame_bytes", "16M", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.max_frame_bytes, 16u << 20);
        ck_assert_int_eq(set(&cfg, "limits", "max_frame_bytes", "17M", err, sizeof(err)),
                         -EINVAL);
        ck_assert_int_eq(set(&cfg, "limits", "max_fds_per_frame", "1K", err, sizeof(err)),
                         -EINVAL);
}
END_TEST

/* ---- string and enumerated keys ---- */

START_TEST(test_string_keys)
{
        static const struct {
                const char *name;
                size_t off, size;
        } keys[] = {
                { "socket", FIELD(socket_path) },
                { "socket_group", FIELD(socket_group) },
                { "metrics_listen", FIELD(metrics_listen) },
                { "admin_group", FIELD(admin_group) },
        };
        struct epdd_config cfg;
        char err[256], value[512];

        epd_config_defaults(&cfg);
        for (unsigned i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
                const char *field = (const char *)&cfg + keys[i].off;

                ck_assert_int_eq(set(&cfg, "daemon", keys[i].name, "x-1", err, sizeof(err)), 0);
                ck_assert_str_eq(field, "x-1");
                /* The longest value that fits with its terminator, then one byte more. */
                memset(value, 'a', keys[i].size - 1);
                value[keys[i].size - 1] = '\0';
                ck_assert_int_eq(set(&cfg, "daemon", keys[i].name, value, err, sizeof(err)), 0);
                ck_assert_str_eq(field, value);
                memset(value, 'b', keys[i].size);
                value[keys[i].size] = '\0';
                ck_assert_int_eq(set(&cfg, "daemon", keys[i].name, value, err, sizeof(err)),
                                 -EINVAL);
                ck_assert_msg(strstr(err, "too long") != NULL, "err: %s", err);
                ck_assert_uint_eq(strlen(field), keys[i].size - 1);
                ck_assert_int_eq(field[0], 'a');
                ck_assert_int_eq(set(&cfg, "daemon", keys[i].name, "", err, sizeof(err)), 0);
                ck_assert_str_eq(field, "");
        }
        ck_assert_int_eq(set(&cfg, "daemon", "socket", "/tmp/e.sock", err, sizeof(err)), 0);
        ck_assert_str_eq(cfg.socket_path, "/tmp/e.sock");
}
END_TEST

START_TEST(test_backend)
{
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        ck_assert_int_eq(set(&cfg, "daemon", "backend", "host", err, sizeof(err)), 0);
        ck_assert_str_eq(cfg.backend, "host");
        ck_assert_int_eq(set(&cfg, "daemon", "backend", "cuda", err, sizeof(err)), 0);
        ck_assert_str_eq(cfg.backend, "cuda");
        ck_assert_int_eq(set(&cfg, "daemon", "backend", "auto", err, sizeof(err)), 0);
        ck_assert_str_eq(cfg.backend, "auto");
        ck_assert_int_eq(set(&cfg, "daemon", "backend", "gpu", err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "gpu") != NULL, "err: %s", err);
        ck_assert_int_eq(set(&cfg, "daemon", "backend", "HOST", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "backend", "", err, sizeof(err)), -EINVAL);
        ck_assert_str_eq(cfg.backend, "auto");
}
END_TEST

START_TEST(test_cuda_graphs)
{
        static const char *const on[] = { "on", "ON", "true", "yes", "1" };
        static const char *const off[] = { "off", "Off", "false", "no", "0" };
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        ck_assert_int_eq(cfg.cuda_graphs, 1);
        for (unsigned i = 0; i < 5; i++) {
                ck_assert_int_eq(set(&cfg, "daemon", "cuda_graphs", off[i], err, sizeof(err)), 0);
                ck_assert_int_eq(cfg.cuda_graphs, 0);
                ck_assert_int_eq(set(&cfg, "daemon", "cuda_graphs", on[i], err, sizeof(err)), 0);
                ck_assert_int_eq(cfg.cuda_graphs, 1);
        }
        /* A refused value names itself and leaves the setting as it was. */
        ck_assert_int_eq(set(&cfg, "daemon", "cuda_graphs", "off", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&cfg, "daemon", "cuda_graphs", "maybe", err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "maybe") != NULL && strstr(err, "cuda_graphs") != NULL,
                      "err: %s", err);
        ck_assert_int_eq(cfg.cuda_graphs, 0);
        ck_assert_int_eq(set(&cfg, "daemon", "cuda_graphs", "", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "cuda_graphs", "2", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "cuda_graphs", " on", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(cfg.cuda_graphs, 0);
}
END_TEST

START_TEST(test_log_level)
{
        static const struct {
                const char *name;
                int level;
        } ok[] = { { "error", LOG_ERR },   { "warning", LOG_WARNING }, { "notice", LOG_NOTICE },
                   { "info", LOG_INFO },   { "debug", LOG_DEBUG } };
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        for (unsigned i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
                ck_assert_int_eq(set(&cfg, "daemon", "log_level", ok[i].name, err, sizeof(err)),
                                 0);
                ck_assert_int_eq(cfg.log_level, ok[i].level);
        }
        ck_assert_int_eq(set(&cfg, "daemon", "log_level", "verbose", err, sizeof(err)),
                         -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "log_level", "7", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "log_level", "", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(cfg.log_level, LOG_DEBUG);
}
END_TEST

START_TEST(test_socket_mode)
{
        static const struct {
                const char *value;
                unsigned mode;
        } ok[] = { { "0660", 0660 }, { "660", 0660 }, { "0600", 0600 }, { "0777", 0777 },
                   { "0", 0 },       { "0000", 0 },   { "755", 0755 } };
        static const char *const bad[] = { "", "0778", "8", "01000", "0o660", "rw-rw----",
                                           "660x", "0x1a4", "-1", "-0", "+660", " 660" };
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        for (unsigned i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
                ck_assert_int_eq(set(&cfg, "daemon", "socket_mode", ok[i].value, err,
                                     sizeof(err)), 0);
                ck_assert_msg(cfg.socket_mode == ok[i].mode, "'%s' gave %o", ok[i].value,
                              cfg.socket_mode);
        }
        ck_assert_int_eq(set(&cfg, "daemon", "socket_mode", "0640", err, sizeof(err)), 0);
        for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
                int rc = set(&cfg, "daemon", "socket_mode", bad[i], err, sizeof(err));
                ck_assert_msg(rc == -EINVAL, "'%s' accepted as %o", bad[i], cfg.socket_mode);
                ck_assert_msg(strstr(err, "octal") != NULL, "err: %s", err);
                ck_assert_uint_eq(cfg.socket_mode, 0640);
        }
}
END_TEST

START_TEST(test_unknown_keys_and_sections)
{
        struct epdd_config cfg, before;
        char err[256];

        epd_config_defaults(&cfg);
        epd_config_defaults(&before);
        ck_assert_int_eq(set(&cfg, "daemon", "sockett", "/x", err, sizeof(err)), -EINVAL);
        ck_assert_str_eq(err, "unknown key [daemon] sockett");
        ck_assert_int_eq(set(&cfg, "bogus", "max_clients", "1", err, sizeof(err)), -EINVAL);
        ck_assert_str_eq(err, "unknown key [bogus] max_clients");
        /* A key outside any section. */
        ck_assert_int_eq(set(&cfg, "", "socket", "/x", err, sizeof(err)), -EINVAL);
        ck_assert_str_eq(err, "unknown key [] socket");
        /* Sections and keys are case-sensitive. */
        ck_assert_int_eq(set(&cfg, "Daemon", "socket", "/x", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "Socket", "/x", err, sizeof(err)), -EINVAL);
        /* Keys of one section under another. */
        ck_assert_int_eq(set(&cfg, "limits", "socket", "/x", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "max_clients", "1", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "devices", "1", err, sizeof(err)), -EINVAL);
        assert_cfg_eq(&cfg, &before);
}
END_TEST

/* ---- allow lists ---- */

START_TEST(test_allow_lists)
{
        struct epdd_config cfg;
        char err[256], value[1024];
        size_t len = 0;

        epd_config_defaults(&cfg);
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", "1000, 1001,1002  0", err,
                             sizeof(err)), 0);
        ck_assert_uint_eq(cfg.num_allow_uids, 4);
        ck_assert_uint_eq(cfg.allow_uids[0], 1000);
        ck_assert_uint_eq(cfg.allow_uids[1], 1001);
        ck_assert_uint_eq(cfg.allow_uids[2], 1002);
        ck_assert_uint_eq(cfg.allow_uids[3], 0);
        ck_assert_uint_eq(cfg.num_allow_gids, 0);

        ck_assert_int_eq(set(&cfg, "daemon", "allow_gids", "4294967295", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.num_allow_gids, 1);
        ck_assert_uint_eq(cfg.allow_gids[0], UINT32_MAX);
        ck_assert_int_eq(set(&cfg, "daemon", "allow_gids", "4294967296", err, sizeof(err)),
                         -EINVAL);
        ck_assert_msg(strstr(err, "allow_gids") != NULL, "err: %s", err);

        /* A leading zero does not turn an id octal. */
        ck_assert_int_eq(set(&cfg, "daemon", "allow_gids", "0100", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.allow_gids[0], 100);

        /* A bad entry refuses the whole list and keeps the previous one. */
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", "5,abc", err, sizeof(err)), -EINVAL);
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", "5,-1", err, sizeof(err)), -EINVAL);
        ck_assert_uint_eq(cfg.num_allow_uids, 4);
        ck_assert_uint_eq(cfg.allow_uids[0], 1000);

        /* Setting a list replaces it; an empty list clears it. */
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", "7", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.num_allow_uids, 1);
        ck_assert_uint_eq(cfg.allow_uids[0], 7);
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", "", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.num_allow_uids, 0);
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", " , ", err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.num_allow_uids, 0);

        /* EPD_MAX_ALLOW entries fit; one more does not. */
        for (unsigned i = 0; i < EPD_MAX_ALLOW; i++)
                len += (size_t)snprintf(value + len, sizeof(value) - len, "%s%u", i ? "," : "",
                                        2000 + i);
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", value, err, sizeof(err)), 0);
        ck_assert_uint_eq(cfg.num_allow_uids, EPD_MAX_ALLOW);
        ck_assert_uint_eq(cfg.allow_uids[EPD_MAX_ALLOW - 1], 2000 + EPD_MAX_ALLOW - 1);
        snprintf(value + len, sizeof(value) - len, ",9");
        ck_assert_int_eq(set(&cfg, "daemon", "allow_uids", value, err, sizeof(err)), -EINVAL);
        ck_assert_uint_eq(cfg.num_allow_uids, EPD_MAX_ALLOW);

        /* A list longer than the parser's buffer is refused, not cut to a different last id. */
        memset(value, ' ', 600);
        snprintf(value + 600, sizeof(value) - 600, "12345");
        ck_assert_int_eq(set(&cfg, "daemon", "allow_gids", value, err, sizeof(err)), -EINVAL);
        ck_assert_uint_eq(cfg.num_allow_gids, 1);
        ck_assert_uint_eq(cfg.allow_gids[0], 100);
}
END_TEST

/* ---- files ---- */

START_TEST(test_load_file)
{
        const char *path = write_conf("; comment\n"
                                      "# another comment\n"
                                      "[daemon]\n"
                                      "socket = /tmp/x.sock\n"
                                      "socket_mode = 0600\n"
                                      "backend = host\n"
                                      "log_level = debug\n"
                                      "arena_bytes = 128M\n"
                                      "allow_uids = 1, 2, 3\n"
                                      "\n"
                                      "[limits]\n"
                                      "max_clients = 12\n"
                                      "max_frame_bytes = 1MiB\n"
                                      "[host]\n"
                                      "devices = 4\n"
                                      "threads=3\n");
        struct epdd_config cfg;
        char err[256] = "";

        epd_config_defaults(&cfg);
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), 0);
        ck_assert_str_eq(cfg.socket_path, "/tmp/x.sock");
        ck_assert_uint_eq(cfg.socket_mode, 0600);
        ck_assert_str_eq(cfg.backend, "host");
        ck_assert_int_eq(cfg.log_level, LOG_DEBUG);
        ck_assert_uint_eq(cfg.arena_bytes, 128ull << 20);
        ck_assert_uint_eq(cfg.num_allow_uids, 3);
        ck_assert_uint_eq(cfg.allow_uids[2], 3);
        ck_assert_uint_eq(cfg.max_clients, 12);
        ck_assert_uint_eq(cfg.max_frame_bytes, 1u << 20);
        ck_assert_uint_eq(cfg.host_devices, 4);
        ck_assert_uint_eq(cfg.host_threads, 3);
        /* Keys the file does not name keep their defaults. */
        ck_assert_uint_eq(cfg.max_groups, 64);
        ck_assert_uint_eq(cfg.op_timeout_ms, 10000);
        unlink(path);
}
END_TEST

START_TEST(test_load_missing_file)
{
        struct epdd_config cfg;
        char err[256] = "";

        epd_config_defaults(&cfg);
        ck_assert_int_eq(epd_config_load(&cfg, "/nonexistent/epd-unit.conf", err, sizeof(err)),
                         -ENOENT);
        ck_assert_msg(strstr(err, "/nonexistent/epd-unit.conf") != NULL, "err: %s", err);
}
END_TEST

START_TEST(test_load_syntax_error_names_line)
{
        const char *path = write_conf("[daemon]\n"
                                      "socket_mode = 0600\n"
                                      "this line has no equals sign\n"
                                      "backend = host\n");
        struct epdd_config cfg;
        char err[256] = "", want[300];

        epd_config_defaults(&cfg);
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), -EINVAL);
        snprintf(want, sizeof(want), "%s:3:", path);
        ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "err '%s', want prefix '%s'", err,
                      want);
        ck_assert_msg(strstr(err, "syntax") != NULL, "err: %s", err);
        unlink(path);

        /* An unterminated section header. */
        path = write_conf("[daemon]\nbackend = host\n\n[limits\nmax_clients = 3\n");
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), -EINVAL);
        snprintf(want, sizeof(want), "%s:4:", path);
        ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "err '%s', want prefix '%s'", err,
                      want);
        unlink(path);
}
END_TEST

START_TEST(test_load_bad_value_names_line_and_key)
{
        const char *path = write_conf("[daemon]\n"
                                      "backend = host\n"
                                      "\n"
                                      "[limits]\n"
                                      "max_clients = 1\n"
                                      "max_fds_per_frame = 17\n"
                                      "max_groups = lots\n");
        struct epdd_config cfg;
        char err[256] = "", want[300];

        epd_config_defaults(&cfg);
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), -EINVAL);
        /* The first bad line is named, not a later one. */
        snprintf(want, sizeof(want), "%s:6:", path);
        ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "err '%s', want prefix '%s'", err,
                      want);
        ck_assert_msg(strstr(err, "max_fds_per_frame") != NULL, "err: %s", err);
        ck_assert_msg(strstr(err, "max_groups") == NULL, "err: %s", err);
        unlink(path);

        path = write_conf("[daemon]\nlog_level = info\n[bogus]\nkey = 1\n");
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), -EINVAL);
        snprintf(want, sizeof(want), "%s:4:", path);
        ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "err '%s', want prefix '%s'", err,
                      want);
        ck_assert_msg(strstr(err, "unknown key [bogus] key") != NULL, "err: %s", err);
        unlink(path);

        /* A key before any section. */
        path = write_conf("socket = /x\n[daemon]\n");
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), -EINVAL);
        snprintf(want, sizeof(want), "%s:1:", path);
        ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "err '%s', want prefix '%s'", err,
                      want);
        unlink(path);
}
END_TEST

START_TEST(test_load_error_order)
{
        struct epdd_config cfg;
        char err[256] = "", want[300];
        const char *path;

        /* A syntax error before a refused key: the syntax error is reported, with its line. */
        path = write_conf("[daemon]\nnot a key value line\nbogus_key = 1\n");
        epd_config_defaults(&cfg);
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), -EINVAL);
        snprintf(want, sizeof(want), "%s:2: syntax error", path);
        ck_assert_str_eq(err, want);
        unlink(path);

        /* A refused key before a syntax error: the key is reported, with its line. */
        path = write_conf("[daemon]\nbogus_key = 1\nnot a key value line\n");
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), -EINVAL);
        snprintf(want, sizeof(want), "%s:2: unknown key [daemon] bogus_key", path);
        ck_assert_str_eq(err, want);
        unlink(path);
}
END_TEST

/* inih reads lines into a fixed buffer (INI_MAX_LINE, 200 by default); a longer line must be
 * refused, not parsed in pieces: the tail would be a line of its own, or, when it starts with a
 * space, a continuation that replaces the value. Either outcome below is acceptable (refused, or
 * parsed whole by a library built with a larger buffer); a silently different value is not. */
START_TEST(test_load_long_line)
{
        struct epdd_config cfg;
        char text[1024], err[256] = "";
        const char *path;
        size_t len;
        int rc;

        /* 32 uids of 5 digits: 245 characters, split by a 200-byte buffer just after the
         * comma of the 26th, so that the tail " 10026, ..." reads as a continuation line. */
        len = (size_t)snprintf(text, sizeof(text), "[daemon]\nallow_uids =      ");
        for (unsigned i = 0; i < EPD_MAX_ALLOW; i++)
                len += (size_t)snprintf(text + len, sizeof(text) - len, "%s%u", i ? ", " : "",
                                        10000 + i);
        snprintf(text + len, sizeof(text) - len, "\n");
        path = write_conf(text);
        epd_config_defaults(&cfg);
        rc = epd_config_load(&cfg, path, err, sizeof(err));
        if (rc == 0) {
                ck_assert_uint_eq(cfg.num_allow_uids, EPD_MAX_ALLOW);
                for (unsigned i = 0; i < EPD_MAX_ALLOW; i++)
                        ck_assert_uint_eq(cfg.allow_uids[i], 10000 + i);
        } else {
                ck_assert_int_eq(rc, -EINVAL);
                ck_assert_msg(strstr(err, ":2: ") != NULL, "err: %s", err);
                ck_assert_msg(strstr(err, "longer") != NULL, "err: %s", err);
        }
        unlink(path);

        /* A long comment whose tail, after 199 bytes, reads as a key. */
        len = (size_t)snprintf(text, sizeof(text), "[daemon]\n;");
        for (unsigned i = 0; i < 198; i++)
                text[len++] = 'c';
        snprintf(text + len, sizeof(text) - len, "backend = cuda\n");
        path = write_conf(text);
        epd_config_defaults(&cfg);
        rc = epd_config_load(&cfg, path, err, sizeof(err));
        if (rc == 0) {
                ck_assert_str_eq(cfg.backend, "auto");
        } else {
                ck_assert_int_eq(rc, -EINVAL);
                ck_assert_msg(strstr(err, ":2: ") != NULL, "err: %s", err);
        }
        unlink(path);

        /* A last line without a newline is read whole. */
        len = (size_t)snprintf(text, sizeof(text), "[daemon]\nsocket = /");
        for (unsigned i = 0; i < 100; i++)
                text[len++] = 's';
        text[len] = '\0';
        path = write_conf(text);
        epd_config_defaults(&cfg);
        ck_assert_int_eq(epd_config_load(&cfg, path, err, sizeof(err)), 0);
        ck_assert_uint_eq(strlen(cfg.socket_path), 101);
        unlink(path);
}
END_TEST

/* ---- keys checked against each other ---- */

START_TEST(test_validate)
{
        struct epdd_config cfg;
        char err[256];

        epd_config_defaults(&cfg);
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), 0);

        /* A default timeout beyond the bound on every timeout can never be used. */
        cfg.op_timeout_ms = 60001;
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "op_timeout_ms 60001 exceeds max_op_timeout_ms 60000"),
                      "err: %s", err);
        cfg.max_op_timeout_ms = 60001;
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), 0);

        cfg.op_timeout_ms = 0;
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "op_timeout_ms must be at least 1 ms"), "err: %s", err);
        cfg.op_timeout_ms = 1;
        cfg.max_op_timeout_ms = 0;
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "max_op_timeout_ms must be at least 1 ms"), "err: %s", err);

        epd_config_defaults(&cfg);
        cfg.max_clients = 0;
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "max_clients"), "err: %s", err);
        epd_config_defaults(&cfg);
        cfg.handshake_timeout_ms = 0;
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "handshake_timeout_ms"), "err: %s", err);
        epd_config_defaults(&cfg);
        cfg.max_groups = 0;
        ck_assert_int_eq(epd_config_validate(&cfg, err, sizeof(err)), -EINVAL);
        ck_assert_msg(strstr(err, "max_groups"), "err: %s", err);
}
END_TEST

/* ---- hot reload ---- */

START_TEST(test_apply_hot_copies_exactly_the_hot_keys)
{
        struct epdd_config dst, src, orig;
        char err[256];

        epd_config_defaults(&dst);
        epd_config_defaults(&src);
        /* src differs from dst in every field. */
        snprintf(src.config_path, sizeof(src.config_path), "/src.conf");
        src.config_path_set = 1;
        ck_assert_int_eq(set(&src, "daemon", "socket", "/src.sock", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "socket_mode", "0600", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "socket_group", "srcgrp", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "backend", "host", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "log_level", "debug", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "metrics_listen", "127.0.0.1:9", err,
                             sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "admin_group", "wheel", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "allow_uids", "10,11", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "allow_gids", "20,21,22", err, sizeof(err)), 0);
        ck_assert_int_eq(set(&src, "daemon", "cuda_graphs", "off", err, sizeof(err)), 0);
        for (unsigned i = 0; i < NUM_KEYS; i++)
                ck_assert_int_eq(set(&src, num_keys[i].section, num_keys[i].name, "3", err,
                                     sizeof(err)), 0);
        orig = dst;

        epd_config_apply_hot(&dst, &src);

        /* Hot: log level, timeouts, limits that apply to new requests, allow lists, admin
         * group. */
        ck_assert_int_eq(dst.log_level, LOG_DEBUG);
        ck_assert_uint_eq(dst.op_timeout_ms, 3);
        ck_assert_uint_eq(dst.peer_lost_ms, 3);
        ck_assert_uint_eq(dst.max_op_timeout_ms, 3);
        ck_assert_uint_eq(dst.max_clients_per_uid, 3);
        ck_assert_uint_eq(dst.admin_reserved_clients, 3);
        ck_assert_uint_eq(dst.handshake_timeout_ms, 3);
        ck_assert_uint_eq(dst.max_clients, 3);
        ck_assert_uint_eq(dst.max_groups, 3);
        ck_assert_uint_eq(dst.max_regions_per_client, 3);
        ck_assert_uint_eq(dst.max_region_bytes_per_client, 3);
        ck_assert_uint_eq(dst.max_outstanding_ops_per_client, 3);
        ck_assert_uint_eq(dst.max_handles_per_group, 3);
        ck_assert_uint_eq(dst.max_output_queue_bytes, 3);
        ck_assert_str_eq(dst.admin_group, "wheel");
        ck_assert_uint_eq(dst.num_allow_uids, 2);
        ck_assert_uint_eq(dst.allow_uids[0], 10);
        ck_assert_uint_eq(dst.allow_uids[1], 11);
        ck_assert_uint_eq(dst.num_allow_gids, 3);
        ck_assert_uint_eq(dst.allow_gids[2], 22);

        /* Not hot: bound at start (socket, backend, devices, arena, receive buffer). */
        ck_assert_str_eq(dst.config_path, orig.config_path);
        ck_assert_int_eq(dst.config_path_set, 0);
        ck_assert_str_eq(dst.socket_path, orig.socket_path);
        ck_assert_uint_eq(dst.socket_mode, 0660);
        ck_assert_str_eq(dst.socket_group, "");
        ck_assert_str_eq(dst.backend, "auto");
        ck_assert_str_eq(dst.metrics_listen, "");
        ck_assert_uint_eq(dst.arena_bytes, orig.arena_bytes);
        ck_assert_uint_eq(dst.max_frame_bytes, orig.max_frame_bytes);
        ck_assert_uint_eq(dst.max_fds_per_frame, orig.max_fds_per_frame);
        ck_assert_uint_eq(dst.host_devices, orig.host_devices);
        ck_assert_uint_eq(dst.host_threads, orig.host_threads);
        ck_assert_int_eq(dst.cuda_graphs, 1); /* read when the backend starts */

        /* Applying the original back restores everything (nothing else was touched). */
        epd_config_apply_hot(&dst, &orig);
        assert_cfg_eq(&dst, &orig);

        /* Shrinking an allow list to empty is applied too. */
        epd_config_apply_hot(&dst, &src);
        src.num_allow_uids = 0;
        epd_config_apply_hot(&dst, &src);
        ck_assert_uint_eq(dst.num_allow_uids, 0);
}
END_TEST

static Suite *config_suite(void)
{
        Suite *s = suite_create("config");
        TCase *tc = tcase_create("keys");

        tcase_add_test(tc, test_defaults);
        tcase_add_loop_test(tc, test_every_numeric_key, 0, NUM_KEYS);
        tcase_add_test(tc, test_bad_numbers);
        tcase_add_test(tc, test_number_bases);
        tcase_add_test(tc, test_size_suffixes);
        tcase_add_test(tc, test_string_keys);
        tcase_add_test(tc, test_backend);
        tcase_add_test(tc, test_cuda_graphs);
        tcase_add_test(tc, test_log_level);
        tcase_add_test(tc, test_socket_mode);
        tcase_add_test(tc, test_unknown_keys_and_sections);
        tcase_add_test(tc, test_allow_lists);
        suite_add_tcase(s, tc);

        tc = tcase_create("file");
        tcase_add_test(tc, test_load_file);
        tcase_add_test(tc, test_load_missing_file);
        tcase_add_test(tc, test_load_syntax_error_names_line);
        tcase_add_test(tc, test_load_bad_value_names_line_and_key);
        tcase_add_test(tc, test_load_error_order);
        tcase_add_test(tc, test_load_long_line);
        suite_add_tcase(s, tc);

        tc = tcase_create("hot");
        tcase_add_test(tc, test_validate);
        tcase_add_test(tc, test_apply_hot_copies_exactly_the_hot_keys);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(config_suite());
        int failed;

        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
