/* integ_hostile.c - one tenant never stalls, starves or locks out another. Each test runs an
 * attack (tests/lib/attacks.h) against the real daemon (host backend) while a bystander group of
 * two worker processes runs verified MoE steps (dispatch and combine checked bitwise against the
 * reference), and asserts order and outcome, not time:
 * - the bystander's steps all complete, and match, while the attack is still active;
 * - the daemon answers `epctl status` during the attack;
 * - once the attacker is gone, the daemon's open fds and RSS are back at their baseline.
 * Attacks: a dispatch that waits for inputs forever (and SIGTERM then ends it with ABORTED at
 * once), idle connections of another uid, guessing the bystander group's secret, rank bindings
 * and regions until the budgets refuse. Without root the attacks run as the same uid, and the
 * per-uid limits are not exercised (the test says so).
 */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "attacks.h"
#include "epd.h"
#include "harness.h"
#include "workload.h"

#define BYSTANDER_STEPS 12
#define BYSTANDER_WAIT_MS 120000

static const struct wl_case bystander_case = {
        "bystander", 4401, 2, 8, 256, 32, 2, EPD_DTYPE_BF16, EPD_DTYPE_INT64,
        EPD_LAYOUT_EXPAND, 4, 1, 1, TD_ROUTING_UNIFORM, 0.05, WL_TOKENS_DESCENDING, 1, 1, 1, 1,
        BYSTANDER_STEPS, 0, 0, 0,
};

struct bystander {
        const char *socket;
        char group[32];
        pid_t pids[2];
};

static int bystander_main(void *arg, int index)
{
        struct bystander *b = arg;

        return wl_worker(&bystander_case, b->socket, b->group, (uint32_t)index, NULL);
}

static void bystander_start(struct bystander *b, const struct h_daemon *d, const char *group)
{
        b->socket = d->socket;
        snprintf(b->group, sizeof(b->group), "%s", group);
        for (int i = 0; i < 2; i++) {
                b->pids[i] = h_spawn(bystander_main, b, i);
                ck_assert_int_gt(b->pids[i], 0);
        }
}

static void bystander_finish_ok(struct bystander *b)
{
        ck_assert_msg(h_wait_all(b->pids, 2, BYSTANDER_WAIT_MS) == 0,
                      "the bystander group's verified steps failed during the attack");
}

static int is_root(void)
{
        return geteuid() == 0;
}

/* The daemon's socket reachable by another uid. */
static void daemon_start_open(struct h_daemon *d, const char *config_text, char *config_path)
{
        const char *args[] = { "--config", config_path, "--socket-mode", "0666", NULL };
        FILE *f;
        int fd = mkstemp(config_path);

        ck_assert_int_ge(fd, 0);
        f = fdopen(fd, "w");
        ck_assert_ptr_nonnull(f);
        fputs(config_text, f);
        fclose(f);
        ck_assert_int_eq(h_daemon_start(d, args), 0);
        ck_assert_int_eq(chmod(d->dir, 0755), 0);
}

static void epctl_answers(const struct h_daemon *d, const char *context)
{
        json_t *st = h_epctl_json(d, "status");

        ck_assert_msg(st != NULL, "epctl status got no answer %s", context);
        json_decref(st);
}

/* The daemon's fds once its clients are gone, polled until they are back at `baseline` or
 * below. */
static void fds_back_to(const struct h_daemon *d, int baseline, int timeout_ms)
{
        long long deadline = h_now_ms() + timeout_ms;
        int now;

        do {
                now = h_proc_fd_count(d->pid);
                if (now <= baseline)
                        return;
                usleep(20000);
        } while (h_now_ms() < deadline);
        ck_assert_msg(0, "the daemon holds %d fds after the attack, %d before", now, baseline);
}

/* ---- stall: an op that waits for inputs forever ---- */

START_TEST(test_stalled_inputs_do_not_block_others)
{
        const struct wl_case *c = &bystander_case;
        char config[] = "/tmp/epd-hostile-XXXXXX";
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = 1, .num_experts = c->num_experts,
                .hidden = c->hidden, .max_tokens_per_rank = c->max_tokens,
                .max_topk = c->num_topk, .dispatch_dtype = EPD_DTYPE_BF16,
                .op_timeout_ms = 60000, .arena_bytes = 1 << 20,
        };
        struct epd_dispatch_args da = { .size = sizeof(da) };
        uint64_t xs[2] = { c->max_tokens, c->hidden }, ks[2] = { c->max_tokens, c->num_topk };
        struct bystander by;
        struct h_daemon d;
        struct wl_inputs in;
        struct epd_client *cl;
        struct epd_group *g;
        struct epd_op *op;
        uint64_t region;
        long long t0;
        void *p;
        int rc;

        daemon_start_open(&d, "[limits]\nmax_op_timeout_ms = 60000\n", config);
        cl = h_connect_ok(&d, "staller");
        ck_assert_int_eq(wl_enter_group(cl, "stall", 0, &cfg, &g), EPD_OK);
        ck_assert_int_eq(wl_inputs_make(c, 0, 0, 0, &in), 0);
        ck_assert_int_eq(epd_region_alloc(cl, 1 << 16, &p, &region), EPD_OK);
        memcpy(p, in.x, (size_t)c->max_tokens * c->hidden * 2);
        memcpy((uint8_t *)p + 32768, in.topk, (size_t)c->max_tokens * c->num_topk * 8);
        da.num_tokens = c->max_tokens;
        da.use_arena = 1;
        da.wait_inputs = 1; /* never marked ready */
        ck_assert_int_eq(epd_tensor_at(cl, p, EPD_DTYPE_BF16, 2, xs, &da.x), EPD_OK);
        ck_assert_int_eq(epd_tensor_at(cl, (uint8_t *)p + 32768, EPD_DTYPE_INT64, 2, ks,
                                       &da.topk_idx), EPD_OK);
        ck_assert_int_eq(epd_dispatch_submit(g, &da, &op), EPD_OK);
        ck_assert_int_eq(epd_op_wait(op, 100), EPD_TIMEOUT);

        bystander_start(&by, &d, "bystander");
        bystander_finish_ok(&by);
        epctl_answers(&d, "while an op waits for its inputs");
        /* The attack was active the whole time: the stalled op still waits. */
        ck_assert_int_eq(epd_op_wait(op, 0), EPD_TIMEOUT);

        /* SIGTERM ends the waiting op with ABORTED well before its 60 s timeout. */
        t0 = h_now_ms();
        ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
        rc = epd_op_wait(op, 20000);
        ck_assert_msg(rc == EPD_ABORTED, "the stalled op ended with %s: %s", epd_status_name(rc),
                      epd_op_error(op));
        ck_assert_msg(h_now_ms() - t0 < 20000, "SIGTERM took the op's timeout");
        epd_op_free(op);
        ck_assert_int_eq(h_daemon_stop(&d, 20000), 0);
        epd_group_leave(g);
        epd_client_free(cl);
        wl_inputs_free(&in);
        unlink(config);
}
END_TEST

/* ---- every attack beside a bystander ---- */

static long rss_kib(pid_t pid)
{
        char path[64], line[256];
        long kib = -1;
        FILE *f;

        snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
        f = fopen(path, "re");
        if (!f)
                return -1;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "VmRSS: %ld", &kib) == 1)
                        break;
        fclose(f);
        return kib;
}

START_TEST(test_attack_beside_bystander)
{
        const enum attack a = (enum attack)(_i + 1);
        char config[] = "/tmp/epd-hostile-XXXXXX";
        struct attack_run run;
        struct bystander by;
        struct h_daemon d;
        long rss0, rss1;
        int fds0;

        if (!is_root())
                printf("not root: the attack runs as the same uid\n");
        printf("attack %s\n", attack_name(a));
        daemon_start_open(&d, "[limits]\nmax_clients = 64\nmax_clients_per_uid = 16\n"
                              "handshake_timeout_ms = 2000\nmax_regions_per_uid = 4096\n", config);
        /* The baseline after a first bystander run, so that warm pools count as baseline. */
        bystander_start(&by, &d, "bystander");
        bystander_finish_ok(&by);
        fds0 = h_proc_fd_count(d.pid);
        rss0 = rss_kib(d.pid);

        ck_assert_msg(attack_start(&run, a, &d, "bystander") == 0, "the attack did not start");
        bystander_start(&by, &d, "bystander");
        bystander_finish_ok(&by);
        epctl_answers(&d, attack_name(a));
        ck_assert_msg(attack_active(&run), "the attacker ended before the bystander finished");
        attack_stop(&run);

        fds_back_to(&d, fds0, 10000);
        rss1 = rss_kib(d.pid);
        ck_assert_msg(rss1 <= rss0 + 32 * 1024, "the daemon's RSS grew from %ld to %ld KiB", rss0,
                      rss1);
        h_assert_daemon_alive(&d, NULL);
        ck_assert_int_eq(h_daemon_stop(&d, 10000), 0);
        unlink(config);
}
END_TEST

int main(void)
{
        Suite *s = suite_create("integ_hostile");
        TCase *tc = tcase_create("attacks");

        tcase_set_timeout(tc, 180);
        tcase_add_test(tc, test_stalled_inputs_do_not_block_others);
        tcase_add_loop_test(tc, test_attack_beside_bystander, 0, ATTACK_COUNT - 1);
        suite_add_tcase(s, tc);
        return h_run_suite(s);
}
