/* integ_admin.c - the admin verbs (epctl drain, undrain, evict) against the real epd binary.
 *
 * Covered (README.md, "epctl"):
 * - draining a group holds its collected ops (they stay pending), undraining launches them;
 * - draining the whole daemon does the same for every group, and `epctl status` says so;
 * - evicting a client closes it as if it had crashed: its peer's pending op gets PEER_LOST;
 * - a client that is neither root nor in admin_group gets PERMISSION_DENIED for every admin
 * verb (resize too) and changes nothing (run as a child that setuid()s to nobody, socket mode
  * 0666), while a member of admin_group may drain.
 *
 * Every admin command goes through the real epctl. Run as root, the test process is an admin
 * and the permission tests switch to nobody; run as another user, the daemon's admin_group is
 * set to the user's group for the admin tests and the user itself is the non-admin.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epd.h"
#include "harness.h"

#define NUM_EXPERTS 8
#define HIDDEN 64
#define MAX_TOKENS 16
#define MAX_TOPK 2
#define NUM_TOKENS 4u
#define REGION_BYTES 4096u
#define TOPK_OFFSET 2048u
#define NOBODY 65534

/* ---- daemon ---- */

static char config_path[PATH_MAX];

/* Writes a config whose admin_group is `group` (NULL: none) and returns its path. */
static const char *write_config(const char *group)
{
        FILE *f;

        snprintf(config_path, sizeof(config_path), "/tmp/epd-admin-test-%d.conf", (int)getpid());
        f = fopen(config_path, "we");
        ck_assert_msg(f != NULL, "cannot write %s", config_path);
        fprintf(f, "[daemon]\n");
        if (group)
                fprintf(f, "admin_group = %s\n", group);
        fclose(f);
        return config_path;
}

/* Starts a daemon in which this process is an admin: as root by itself, otherwise through an
 * admin_group naming this process's group. extra: more arguments or NULL. */
static void daemon_start_admin(struct h_daemon *d, const char *extra0, const char *extra1)
{
        const char *args[8];
        int n = 0;

        if (geteuid() != 0) {
                struct group *gr = getgrgid(getegid());
                ck_assert_msg(gr != NULL, "no name for group %u", (unsigned)getegid());
                args[n++] = "--config";
                args[n++] = write_config(gr->gr_name);
        }
        if (extra0)
                args[n++] = extra0;
        if (extra1)
                args[n++] = extra1;
        args[n] = NULL;
        ck_assert_int_eq(h_daemon_start(d, args), 0);
        if (config_path[0])
                unlink(config_path);
}

static void daemon_stop_clean(struct h_daemon *d)
{
        ck_assert_int_eq(h_daemon_stop(d, 5000), 0);
}

/* ---- epctl ---- */

/* Runs epctl with args (NULL-terminated), stdout and stderr into out. As root with uid/gid not
 * 0, the child switches to them first and runs `binary` (a copy it can reach). */
static int epctl_as(uid_t uid, gid_t gid, const char *binary, const char *const *args, char *out,
                    size_t out_len)
{
        char path[PATH_MAX];
        const char *argv[16];
        int pipefd[2], argc = 0, status;
        size_t used = 0;
        pid_t pid;

        snprintf(path, sizeof(path), "%s/epctl", h_bin_dir());
        argv[argc++] = binary ? binary : path;
        for (int i = 0; args[i] && argc < 15; i++)
                argv[argc++] = args[i];
        argv[argc] = NULL;
        ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                dup2(pipefd[1], STDOUT_FILENO);
                dup2(pipefd[1], STDERR_FILENO);
                if (uid || gid) {
                        if (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(uid) < 0) {
                                perror("cannot switch user");
                                _exit(126);
                        }
                }
                execv(argv[0], (char *const *)argv);
                perror("exec epctl");
                _exit(127);
        }
        close(pipefd[1]);
        for (;;) {
                ssize_t n = read(pipefd[0], out + used, out_len - used - 1);
                if (n <= 0)
                        break;
                used += (size_t)n;
                if (used + 1 >= out_len)
                        break;
        }
        out[used] = '\0';
        close(pipefd[0]);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int epctl(const struct h_daemon *d, const char *cmd, const char *arg, char *out,
                 size_t out_len)
{
        const char *args[] = { "--socket", d->socket, cmd, arg, NULL };

        return epctl_as(0, 0, NULL, args, out, out_len);
}

static void epctl_ok(const struct h_daemon *d, const char *cmd, const char *arg)
{
        char out[4096];
        int rc = epctl(d, cmd, arg, out, sizeof(out));

        ck_assert_msg(rc == 0, "epctl %s %s exited with %d: %s", cmd, arg ? arg : "", rc, out);
}

static json_t *epctl_json(const struct h_daemon *d, const char *cmd)
{
        static char out[256 * 1024];
        const char *args[] = { "--socket", d->socket, cmd, "--json", NULL };
        json_error_t jerr;
        json_t *j;
        int rc = epctl_as(0, 0, NULL, args, out, sizeof(out));

        ck_assert_msg(rc == 0, "epctl %s --json exited with %d: %s", cmd, rc, out);
        j = json_loads(out, 0, &jerr);
        ck_assert_msg(j != NULL, "epctl %s --json printed invalid JSON: %s", cmd, jerr.text);
        return j;
}

/* The state of group `name` as `epctl groups --json` reports it. */
static const char *group_state(const struct h_daemon *d, const char *name)
{
        static char state[32];
        json_t *arr = epctl_json(d, "groups");
        size_t i;
        json_t *g;

        state[0] = '\0';
        json_array_foreach(arr, i, g)
        {
                if (strcmp(json_string_value(json_object_get(g, "name")), name) == 0)
                        snprintf(state, sizeof(state), "%s",
                                 json_string_value(json_object_get(g, "state")));
        }
        json_decref(arr);
        return state;
}

static int daemon_draining(const struct h_daemon *d)
{
        json_t *st = epctl_json(d, "status");
        int draining = json_is_true(json_object_get(st, "draining"));

        json_decref(st);
        return draining;
}

/* ---- groups and ops ---- */

static struct epd_group *enter_ok(struct epd_client *c, int create, const char *name,
                                  uint32_t world_size, uint32_t rank)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg),
                .world_size = world_size,
                .num_experts = NUM_EXPERTS,
                .hidden = HIDDEN,
                .max_tokens_per_rank = MAX_TOKENS,
                .max_topk = MAX_TOPK,
                .dispatch_dtype = EPD_DTYPE_BF16,
                .op_timeout_ms = 60000,
                .arena_bytes = 1u << 20,
        };
        unsigned char secret[16];
        struct epd_group_args args = {
                .size = sizeof(args),
                .name = name,
                .secret = secret,
                .secret_len = sizeof(secret),
                .rank = rank,
                .config = &cfg,
        };
        struct epd_group *g = NULL;
        int rc;

        h_secret(name, secret);
        rc = create ? epd_group_create(c, &args, &g) : epd_group_join(c, &args, &g);
        ck_assert_msg(rc == EPD_OK, "%s %s rank %u: %s: %s", create ? "create" : "join", name,
                      rank, epd_status_name(rc), epd_client_last_error(c));
        return g;
}

/* Dispatch inputs in one region: x [NUM_TOKENS, HIDDEN] bf16, topk_idx [NUM_TOKENS, MAX_TOPK]. */
struct inputs {
        struct epd_tensor x, topk_idx;
};

static void inputs_make(struct epd_client *c, struct inputs *in)
{
        uint64_t x_sizes[2] = { NUM_TOKENS, HIDDEN }, k_sizes[2] = { NUM_TOKENS, MAX_TOPK };
        uint64_t region_id;
        void *base;
        int64_t *topk;

        ck_assert_int_eq(epd_region_alloc(c, REGION_BYTES, &base, &region_id), EPD_OK);
        memset(base, 0, REGION_BYTES);
        topk = (int64_t *)((uint8_t *)base + TOPK_OFFSET);
        for (uint32_t t = 0; t < NUM_TOKENS; t++)
                for (uint32_t k = 0; k < MAX_TOPK; k++)
                        topk[t * MAX_TOPK + k] = (t + k) % NUM_EXPERTS;
        ck_assert_int_eq(epd_tensor_at(c, base, EPD_DTYPE_BF16, 2, x_sizes, &in->x), EPD_OK);
        ck_assert_int_eq(epd_tensor_at(c, topk, EPD_DTYPE_INT64, 2, k_sizes, &in->topk_idx),
                         EPD_OK);
}

static struct epd_op *dispatch_submit(struct epd_group *g, const struct inputs *in)
{
        struct epd_dispatch_args a = {
                .size = sizeof(a),
                .num_tokens = NUM_TOKENS,
                .x = in->x,
                .topk_idx = in->topk_idx,
                .use_arena = 1,
        };
        struct epd_op *op = NULL;

        ck_assert_int_eq(epd_dispatch_submit(g, &a, &op), EPD_OK);
        return op;
}

/* A request that needs no group: proof that a connection still gets answers. */
static int size_hint(struct epd_client *c)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = 1, .num_experts = NUM_EXPERTS,
                .hidden = HIDDEN, .max_tokens_per_rank = MAX_TOKENS, .max_topk = MAX_TOPK,
                .dispatch_dtype = EPD_DTYPE_BF16,
        };
        struct epd_size_hint hint;

        return epd_size_hint(c, &cfg, 1, &hint);
}

/* ---- tests ---- */

START_TEST(test_drain_group_holds_ops)
{
        struct h_daemon d;
        struct inputs in;
        char out[4096];

        daemon_start_admin(&d, NULL, NULL);
        struct epd_client *a = h_connect_ok(&d, "a");
        struct epd_group *g = enter_ok(a, 1, "drained", 1, 0);
        inputs_make(a, &in);

        /* An op runs before the drain. */
        struct epd_op *op = dispatch_submit(g, &in);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        epd_op_free(op);

        ck_assert_int_eq(epctl(&d, "drain", "drained", out, sizeof(out)), 0);
        ck_assert_msg(strstr(out, "draining"), "epctl drain printed: %s", out);
        ck_assert_str_eq(group_state(&d, "drained"), "DRAINING");
        ck_assert_int_eq(daemon_draining(&d), 0);
        /* Draining twice is harmless. */
        epctl_ok(&d, "drain", "drained");

        op = dispatch_submit(g, &in);
        ck_assert_int_eq(epd_op_wait(op, 500), EPD_TIMEOUT);
        /* Still held after a second look, and the drain reply counts it. */
        ck_assert_int_eq(epctl(&d, "drain", "drained", out, sizeof(out)), 0);
        ck_assert_msg(strstr(out, "1 waiting"), "epctl drain printed: %s", out);
        ck_assert_int_eq(epd_op_wait(op, 200), EPD_TIMEOUT);

        ck_assert_int_eq(epctl(&d, "undrain", "drained", out, sizeof(out)), 0);
        ck_assert_msg(strstr(out, "resumed"), "epctl undrain printed: %s", out);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        epd_op_free(op);
        ck_assert_str_eq(group_state(&d, "drained"), "READY");

        /* The group's id names it as well as its name; unknown groups are NOT_FOUND. */
        char id[32];
        snprintf(id, sizeof(id), "%llu", (unsigned long long)epd_group_id(g));
        epctl_ok(&d, "drain", id);
        ck_assert_str_eq(group_state(&d, "drained"), "DRAINING");
        epctl_ok(&d, "undrain", id);
        ck_assert_str_eq(group_state(&d, "drained"), "READY");
        ck_assert_int_eq(epctl(&d, "drain", "no-such-group", out, sizeof(out)), 1);
        ck_assert_msg(strstr(out, "NOT_FOUND"), "epctl drain printed: %s", out);

        epd_group_leave(g);
        epd_client_free(a);
        daemon_stop_clean(&d);
}
END_TEST

START_TEST(test_drain_daemon_holds_ops)
{
        struct h_daemon d;
        struct inputs in;
        char out[4096];

        daemon_start_admin(&d, NULL, NULL);
        struct epd_client *a = h_connect_ok(&d, "a");
        struct epd_group *g = enter_ok(a, 1, "whole", 1, 0);
        inputs_make(a, &in);

        ck_assert_int_eq(epctl(&d, "drain", NULL, out, sizeof(out)), 0);
        ck_assert_msg(strstr(out, "daemon draining"), "epctl drain printed: %s", out);
        ck_assert_int_eq(daemon_draining(&d), 1);
        struct epd_op *op = dispatch_submit(g, &in);
        ck_assert_int_eq(epd_op_wait(op, 500), EPD_TIMEOUT);

        /* A group drained on its own as well is resumed by the daemon-wide undrain. */
        epctl_ok(&d, "drain", "whole");
        ck_assert_int_eq(epctl(&d, "undrain", NULL, out, sizeof(out)), 0);
        ck_assert_msg(strstr(out, "resumed"), "epctl undrain printed: %s", out);
        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_OK);
        epd_op_free(op);
        ck_assert_int_eq(daemon_draining(&d), 0);
        ck_assert_str_eq(group_state(&d, "whole"), "READY");

        epd_group_leave(g);
        epd_client_free(a);
        daemon_stop_clean(&d);
}
END_TEST

START_TEST(test_evict_peer_lost)
{
        struct h_daemon d;
        struct inputs in;
        struct epd_daemon_info info;
        char out[4096], id[32];

        daemon_start_admin(&d, NULL, NULL);
        struct epd_client *a = h_connect_ok(&d, "survivor");
        struct epd_client *b = h_connect_ok(&d, "victim");
        struct epd_group *ga = enter_ok(a, 1, "pair", 2, 0);
        struct epd_group *gb = enter_ok(b, 0, "pair", 2, 1);
        inputs_make(a, &in);

        /* Rank 0's op waits for rank 1, which is evicted instead of submitting. */
        struct epd_op *op = dispatch_submit(ga, &in);
        ck_assert_int_eq(epd_op_wait(op, 200), EPD_TIMEOUT);
        ck_assert_int_eq(epd_client_daemon_info(b, &info), EPD_OK);
        snprintf(id, sizeof(id), "%llu", (unsigned long long)info.client_id);
        ck_assert_int_eq(epctl(&d, "evict", id, out, sizeof(out)), 0);
        ck_assert_msg(strstr(out, "evicted"), "epctl evict printed: %s", out);

        ck_assert_int_eq(epd_op_wait(op, 10000), EPD_PEER_LOST);
        ck_assert_msg(strstr(epd_op_error(op), "rank 1"), "PEER_LOST message: %s",
                      epd_op_error(op));
        epd_op_free(op);
        ck_assert_str_eq(group_state(&d, "pair"), "BROKEN");

        /* The victim's connection is gone; the survivor's works. */
        ck_assert_int_ne(size_hint(b), EPD_OK);
        ck_assert_int_eq(size_hint(a), EPD_OK);
        ck_assert_msg(h_daemon_log_contains(&d, "evicted by admin"),
                      "the daemon log does not name the eviction");

        /* Evicting a client that is not there is NOT_FOUND. */
        ck_assert_int_eq(epctl(&d, "evict", id, out, sizeof(out)), 1);
        ck_assert_msg(strstr(out, "NOT_FOUND"), "epctl evict printed: %s", out);
        ck_assert_int_eq(epctl(&d, "evict", "x1", out, sizeof(out)), 2);

        epd_group_leave(gb); /* fails (the connection is gone) but frees gb */
        epd_group_leave(ga);
        epd_client_free(b);
        epd_client_free(a);
        daemon_stop_clean(&d);
}
END_TEST

/* Copies epctl into the daemon's directory and opens that directory, so that user nobody can
 * run epctl and reach the socket wherever the build directory lives. */
static void make_reachable(const struct h_daemon *d, char *copy, size_t copy_len)
{
        char src[PATH_MAX], buf[65536];
        int in, out;
        ssize_t n;

        snprintf(src, sizeof(src), "%s/epctl", h_bin_dir());
        snprintf(copy, copy_len, "%s/epctl", d->dir);
        in = open(src, O_RDONLY | O_CLOEXEC);
        ck_assert_int_ge(in, 0);
        out = open(copy, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
        ck_assert_int_ge(out, 0);
        while ((n = read(in, buf, sizeof(buf))) > 0)
                ck_assert_int_eq(write(out, buf, (size_t)n), n);
        close(in);
        close(out);
        ck_assert_int_eq(chmod(copy, 0755), 0);
        ck_assert_int_eq(chmod(d->dir, 0711), 0);
}

START_TEST(test_non_admin_denied)
{
        const char *start_args[] = { "--socket-mode", "0666", NULL };
        struct h_daemon d;
        struct epd_daemon_info info;
        char out[4096], copy[PATH_MAX] = "", id[32];
        int root = geteuid() == 0;
        uid_t uid = root ? NOBODY : 0;
        gid_t gid = root ? NOBODY : 0;

        /* No admin_group: only root is an admin. */
        ck_assert_int_eq(h_daemon_start(&d, start_args), 0);
        if (root)
                make_reachable(&d, copy, sizeof(copy));
        struct epd_client *a = h_connect_ok(&d, "owner");
        struct epd_group *g = enter_ok(a, 1, "guarded", 1, 0);
        ck_assert_int_eq(epd_client_daemon_info(a, &info), EPD_OK);
        snprintf(id, sizeof(id), "%llu", (unsigned long long)info.client_id);

        const char *drain_one[] = { "--socket", d.socket, "drain", "guarded", NULL };
        const char *drain_all[] = { "--socket", d.socket, "drain", NULL };
        const char *undrain_all[] = { "--socket", d.socket, "undrain", NULL };
        const char *evict[] = { "--socket", d.socket, "evict", id, NULL };
        const char *resize[] = { "--socket", d.socket, "resize", "guarded", "--bytes", "2M", NULL };
        const char *status[] = { "--socket", d.socket, "status", NULL };
        const char *const *denied[] = { drain_one, drain_all, undrain_all, evict, resize };
        for (size_t i = 0; i < sizeof(denied) / sizeof(denied[0]); i++) {
                int rc = epctl_as(uid, gid, root ? copy : NULL, denied[i], out, sizeof(out));
                ck_assert_msg(rc == 1 && strstr(out, "PERMISSION_DENIED"),
                              "epctl %s as uid %u: exit %d: %s", denied[i][2], (unsigned)uid, rc,
                              out);
        }
        /* Reading is open to everyone who may connect. */
        ck_assert_int_eq(epctl_as(uid, gid, root ? copy : NULL, status, out, sizeof(out)), 0);

        /* Nothing changed: the owner is still connected, the group and daemon not drained. */
        ck_assert_int_eq(size_hint(a), EPD_OK);
        ck_assert_str_eq(group_state(&d, "guarded"), "READY");
        ck_assert_int_eq(daemon_draining(&d), 0);
        ck_assert_msg(h_daemon_log_contains(&d, "admin request refused"),
                      "the daemon log does not name the refusal");
        if (root)
                unlink(copy);
        epd_group_leave(g);
        epd_client_free(a);
        daemon_stop_clean(&d);
}
END_TEST

/* A member of admin_group (here nogroup, as nobody) may use the admin verbs. Root only. */
START_TEST(test_admin_group_allowed)
{
        struct h_daemon d;
        struct group *gr;
        char out[4096], copy[PATH_MAX];

        if (geteuid() != 0) {
                printf("test_admin_group_allowed: not root, nothing to switch to; passing\n");
                return;
        }
        gr = getgrgid(NOBODY);
        ck_assert_msg(gr != NULL, "no group %d", NOBODY);
        const char *start_args[] = { "--config", write_config(gr->gr_name), "--socket-mode",
                                     "0666", NULL };
        ck_assert_int_eq(h_daemon_start(&d, start_args), 0);
        unlink(config_path);
        make_reachable(&d, copy, sizeof(copy));

        const char *drain[] = { "--socket", d.socket, "drain", NULL };
        const char *undrain[] = { "--socket", d.socket, "undrain", NULL };
        ck_assert_msg(epctl_as(NOBODY, NOBODY, copy, drain, out, sizeof(out)) == 0,
                      "drain as nobody:%s: %s", gr->gr_name, out);
        ck_assert_int_eq(daemon_draining(&d), 1);
        ck_assert_msg(epctl_as(NOBODY, NOBODY, copy, undrain, out, sizeof(out)) == 0,
                      "undrain as nobody:%s: %s", gr->gr_name, out);
        ck_assert_int_eq(daemon_draining(&d), 0);
        unlink(copy);
        daemon_stop_clean(&d);
}
END_TEST

static Suite *admin_suite(void)
{
        Suite *s = suite_create("admin");
        TCase *tc = tcase_create("admin");

        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_drain_group_holds_ops);
        tcase_add_test(tc, test_drain_daemon_holds_ops);
        tcase_add_test(tc, test_evict_peer_lost);
        tcase_add_test(tc, test_non_admin_denied);
        tcase_add_test(tc, test_admin_group_allowed);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        return h_run_suite(admin_suite());
}
