/* fuzz_config.c - libFuzzer target: the configuration file parser and epd_config_set
 * (daemon/base/config.c).
 *
 * The input up to its first NUL byte is written to a temporary file and loaded with
 * epd_config_load onto the defaults; the rest is read as lines "section name value" (separated
 * by tabs) given to epd_config_set. After each call the error text must be a terminated string
 * and, on success, every limit must still lie in its documented range.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "frame.h"
#include "log.h"

static char path[64];

static void remove_file(void)
{
        unlink(path);
}

static void fail(const char *what)
{
        fprintf(stderr, "fuzz_config: %s\n", what);
        abort();
}

static void check_cfg(const struct epdd_config *cfg)
{
        if (cfg->max_fds_per_frame > EPD_FRAME_MAX_FDS || cfg->max_frame_bytes > (16u << 20) ||
            cfg->arena_bytes > (1ull << 40) || cfg->host_devices > 64 ||
            cfg->host_threads > 256 || cfg->socket_mode > 0777 ||
            cfg->num_allow_uids > EPD_MAX_ALLOW || cfg->num_allow_gids > EPD_MAX_ALLOW ||
            cfg->op_timeout_ms > 3600000 || cfg->max_clients > 65536 ||
            cfg->max_groups > 65536)
                fail("a configuration value is outside its range");
        if (memchr(cfg->socket_path, 0, sizeof(cfg->socket_path)) == NULL ||
            memchr(cfg->socket_group, 0, sizeof(cfg->socket_group)) == NULL ||
            memchr(cfg->backend, 0, sizeof(cfg->backend)) == NULL ||
            memchr(cfg->metrics_listen, 0, sizeof(cfg->metrics_listen)) == NULL ||
            memchr(cfg->admin_group, 0, sizeof(cfg->admin_group)) == NULL)
                fail("a configuration string is not terminated");
}

static void check_err(int rc, const char *err, size_t err_len)
{
        if (rc == 0)
                return;
        if (rc != -EINVAL && rc != -ENOENT)
                fail("unexpected error code");
        if (memchr(err, 0, err_len) == NULL || err[0] == '\0')
                fail("error text missing or not terminated");
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
        int fd;

        (void)argc;
        (void)argv;
        epd_log_set_level(LOG_CRIT);
        snprintf(path, sizeof(path), "/tmp/epd-fuzz-config-XXXXXX");
        fd = mkstemp(path);
        if (fd < 0)
                fail("mkstemp failed");
        close(fd);
        atexit(remove_file);
        return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
        const uint8_t *nul = memchr(data, 0, size);
        size_t file_len = nul ? (size_t)(nul - data) : size;
        struct epdd_config cfg;
        char err[256];
        FILE *f;
        int rc;

        f = fopen(path, "we");
        if (!f)
                fail("cannot write the temporary file");
        if (file_len && fwrite(data, 1, file_len, f) != file_len)
                fail("short write");
        fclose(f);
        epd_config_defaults(&cfg);
        memset(err, 0x55, sizeof(err));
        rc = epd_config_load(&cfg, path, err, sizeof(err));
        check_err(rc, err, sizeof(err));
        check_cfg(&cfg);
        if (!nul)
                return 0;

        /* The rest: "section\tname\tvalue" lines. */
        char *rest = malloc(size - file_len);
        if (!rest)
                fail("out of memory");
        memcpy(rest, nul + 1, size - file_len - 1);
        rest[size - file_len - 1] = '\0';
        char *save = NULL;
        for (char *line = strtok_r(rest, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
                char *section = line, *name = strchr(section, '\t'), *value;
                if (!name)
                        continue;
                *name++ = '\0';
                value = strchr(name, '\t');
                if (!value)
                        continue;
                *value++ = '\0';
                memset(err, 0x55, sizeof(err));
                rc = epd_config_set(&cfg, section, name, value, err, sizeof(err));
                check_err(rc, err, sizeof(err));
                check_cfg(&cfg);
        }
        free(rest);
        return 0;
}
