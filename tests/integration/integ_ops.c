/* integ_ops.c - dispatch and combine end to end on the host backend: a real daemon, one real
 * worker process per rank, and every output compared bitwise with the independent reference.
 *
 * The cases are a covering set of docs/semantics.md: every option appears with every layout (ranks
 * 1, 2, 3, 4, 8; tokens full, T - r and zero on some ranks; top-k 1, 2, 8 with -1 entries;
 * uniform, skewed and one-rank routing; bf16 and fp8; alignment 1 and 128; zero padding; 0, 1
 * and 2 biases; apply_weights; int32 and int64 topk_idx; client regions and the arena; cached
 * dispatch; padded row strides), plus one realistic case per layout (H = 7168, T = 512).
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "workload.h"

#define BF EPD_DTYPE_BF16
#define F8 EPD_DTYPE_FP8_E4M3
#define I32 EPD_DTYPE_INT32
#define I64 EPD_DTYPE_INT64
#define NE EPD_LAYOUT_NON_EXPAND
#define EX EPD_LAYOUT_EXPAND
#define UNI TD_ROUTING_UNIFORM
#define SKW TD_ROUTING_SKEWED
#define ONE TD_ROUTING_ONE_RANK

/* name, seed, R, E, H, T, K, dtype, topk dtype, layout, align, zero_pad, weights, routing,
 * -1 probability, tokens, biases, apply_weights, arena, cached, steps, row padding, arena bytes,
 * combine's weight inputs (WL_COMBINE_*) */
static const struct wl_case cases[] = {
        { "r1_ne_bf16", 101, 1, 8, 64, 16, 2, BF, I64, NE, 1, 0, 1, UNI, 0.1, WL_TOKENS_FULL, 0, 0, 0, 1, 1, 0, 0, 0 },
        { "r2_ex_fp8_a128", 102, 2, 16, 256, 32, 8, F8, I32, EX, 128, 1, 1, SKW, 0.1, WL_TOKENS_DESCENDING, 1, 1, 1, 1, 1, 0, 0, 0 },
        { "r3_ne_fp8_a128", 103, 3, 48, 128, 24, 8, F8, I64, NE, 128, 0, 1, UNI, 0.2, WL_TOKENS_SOME_ZERO, 2, 0, 0, 0, 1, 8, 0, 0 },
        { "r3_ex_bf16", 104, 3, 48, 64, 20, 2, BF, I32, EX, 1, 0, 1, ONE, 0.0, WL_TOKENS_FULL, 2, 1, 1, 0, 1, 0, 0, 0 },
        { "r4_ne_bf16_k1", 105, 4, 16, 64, 40, 1, BF, I32, NE, 1, 0, 0, SKW, 0.1, WL_TOKENS_DESCENDING, 1, 0, 1, 1, 2, 0, 0, 0 },
        { "r4_ex_fp8_k1", 106, 4, 32, 128, 16, 1, F8, I64, EX, 128, 0, 0, UNI, 0.0, WL_TOKENS_SOME_ZERO, 0, 0, 0, 0, 1, 0, 0, 0 },
        { "r8_ne_bf16", 107, 8, 64, 128, 64, 8, BF, I64, NE, 1, 0, 1, UNI, 0.1, WL_TOKENS_DESCENDING, 2, 0, 1, 0, 2, 0, 0, 0 },
        { "r8_ex_bf16_a128", 108, 8, 64, 64, 32, 8, BF, I64, EX, 128, 1, 1, ONE, 0.1, WL_TOKENS_FULL, 1, 1, 1, 1, 1, 0, 0, 0 },
        { "r8_ne_fp8_onerank", 109, 8, 256, 256, 48, 2, F8, I32, NE, 1, 0, 1, ONE, 0.0, WL_TOKENS_SOME_ZERO, 0, 0, 0, 0, 1, 0, 0, 0 },
        { "r8_ex_fp8", 110, 8, 256, 256, 32, 8, F8, I32, EX, 1, 1, 1, SKW, 0.05, WL_TOKENS_DESCENDING, 2, 1, 0, 0, 1, 16, 0, 0 },
        { "r2_ex_bf16_unpadded", 111, 2, 8, 64, 16, 2, BF, I64, EX, 128, 0, 0, UNI, 0.3, WL_TOKENS_FULL, 0, 0, 0, 1, 1, 0, 0, 0 },
        { "r4_ne_fp8_cached", 112, 4, 32, 128, 32, 8, F8, I64, NE, 1, 0, 1, SKW, 0.1, WL_TOKENS_FULL, 1, 0, 1, 1, 1, 4, 0, 0 },
        /* combine's weight inputs: recv_weights (NON_EXPAND; also after a dispatch without
         * weights, and through a cached dispatch), source_weights with apply_weights (EXPAND;
         * also without dispatch weights) */
        { "r3_ne_bf16_recv_weights", 115, 3, 24, 64, 24, 4, BF, I64, NE, 1, 0, 1, UNI, 0.2, WL_TOKENS_SOME_ZERO, 1, 0, 0, 1, 1, 0, 0, WL_COMBINE_RECV_WEIGHTS },
        { "r4_ne_fp8_recv_weights_noweights", 116, 4, 32, 128, 20, 8, F8, I32, NE, 1, 0, 0, SKW, 0.1, WL_TOKENS_DESCENDING, 0, 0, 1, 1, 1, 0, 0, WL_COMBINE_RECV_WEIGHTS },
        { "r2_ex_bf16_source_weights", 117, 2, 16, 64, 24, 4, BF, I64, EX, 4, 1, 1, UNI, 0.1, WL_TOKENS_FULL, 2, 1, 0, 1, 1, 0, 0, WL_COMBINE_SOURCE_WEIGHTS },
        { "r4_ex_fp8_source_weights_noweights", 118, 4, 32, 128, 16, 8, F8, I32, EX, 128, 0, 0, SKW, 0.1, WL_TOKENS_SOME_ZERO, 1, 1, 1, 0, 1, 0, 0, WL_COMBINE_SOURCE_WEIGHTS },
        { "realistic_ne_bf16", 113, 2, 16, 7168, 512, 8, BF, I64, NE, 1, 0, 1, UNI, 0.05, WL_TOKENS_DESCENDING, 1, 0, 1, 0, 1, 0, 0, 0 },
        { "realistic_ex_fp8", 114, 2, 16, 7168, 512, 8, F8, I64, EX, 128, 1, 1, UNI, 0.05, WL_TOKENS_FULL, 2, 1, 1, 0, 1, 0, 0, 0 },
};

struct run {
        const struct wl_case *c;
        const char *socket;
        const char *group;
};

static int worker_main(void *arg, int index)
{
        const struct run *r = arg;

        return wl_worker(r->c, r->socket, r->group, (uint32_t)index, NULL);
}

/* Runs a case's R workers on a daemon; returns the number of failed workers. */
static int run_case(const struct h_daemon *d, const struct wl_case *c, const char *group,
                    pid_t *pids)
{
        static struct run runs[8];
        static int next;
        struct run *r = &runs[next++ % 8];

        r->c = c;
        r->socket = d->socket;
        r->group = group;
        for (uint32_t i = 0; i < c->world_size; i++)
                pids[i] = h_spawn(worker_main, r, (int)i);
        return 0;
}

START_TEST(test_case)
{
        const struct wl_case *c = &cases[_i];
        struct h_daemon d;
        pid_t pids[8];

        printf("case %s seed=%llu ranks=%u layout=%s dtype=%s\n", c->name,
               (unsigned long long)c->seed, c->world_size,
               c->layout == EX ? "EXPAND" : "NON_EXPAND", c->dtype == BF ? "bf16" : "fp8");
        fflush(stdout);
        ck_assert_int_eq(h_daemon_start(&d, NULL), 0);
        run_case(&d, c, c->name, pids);
        int failures = h_wait_all(pids, (int)c->world_size, 300000);
        if (failures)
                h_daemon_dump_log(&d);
        ck_assert_msg(failures == 0, "case %s (seed %llu): %d worker(s) failed", c->name,
                      (unsigned long long)c->seed, failures);
        ck_assert_int_eq(h_daemon_stop(&d, 10000), 0);
}
END_TEST

/* Two groups owned by different client processes run their ops interleaved on one daemon
 * started with `args`; each must see exactly its own results. */
static void two_groups(const char *tag, uint64_t seed_b, const char *const *args)
{
        struct wl_case a = cases[6], b = cases[1];
        struct h_daemon d;
        pid_t pids[16];

        a.name = "group_a";
        a.steps = 3;
        b.name = "group_b";
        b.steps = 3;
        b.seed = seed_b;
        printf("case %s seeds=%llu,%llu\n", tag, (unsigned long long)a.seed,
               (unsigned long long)b.seed);
        fflush(stdout);
        ck_assert_int_eq(h_daemon_start(&d, args), 0);
        run_case(&d, &a, "group_a", pids);
        run_case(&d, &b, "group_b", pids + a.world_size);
        int failures = h_wait_all(pids, (int)(a.world_size + b.world_size), 300000);
        if (failures)
                h_daemon_dump_log(&d);
        ck_assert_int_eq(failures, 0);
        ck_assert_int_eq(h_daemon_stop(&d, 10000), 0);
}

START_TEST(test_two_groups_interleaved)
{
        two_groups("two groups", 202, NULL);
}
END_TEST

/* The same with the loop and executor threads polling (--poll-us): requests and completions are
 * handled from the polling turns instead of wake-ups, and the daemon still answers every op
 * right and stops cleanly. (Machines with fewer than 8 CPUs, like CI, do not poll by default.) */
START_TEST(test_polling)
{
        static const char *const args[] = { "--poll-us", "500", NULL };

        two_groups("two groups, polling", 303, args);
}
END_TEST

int main(void)
{
        Suite *s = suite_create("integ_ops");
        TCase *tc = tcase_create("host_backend");

        tcase_set_timeout(tc, 600);
        tcase_add_loop_test(tc, test_case, 0, (int)(sizeof(cases) / sizeof(cases[0])));
        tcase_add_test(tc, test_two_groups_interleaved);
        tcase_add_test(tc, test_polling);
        suite_add_tcase(s, tc);
        return h_run_suite(s);
}
