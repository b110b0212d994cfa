/* integ_faults.c - fault injection (docs/architecture.md, "Failure model"): ranks of a busy 8-rank
 * group are killed with SIGKILL at random points, and the daemon must turn every death into a
 * prompt, clean error for the survivors, let a new process take the rank over, keep an unrelated
 * group running untouched, and leak nothing.
 *
 * One daemon; group A has 8 worker processes (one per rank) running randomised MoE steps
 * (tests/lib/randstep.h: dispatch, sometimes a cached dispatch, combine; every step checked bitwise
 * against the reference); group B, 3 other clients, runs its own steps concurrently. The test
 * process plans everything from a seed before it forks (printed; EPD_FAULT_SEED overrides) and
 * coordinates through an anonymous shared mapping. The run is a sequence of generations; each
 * but the last ends with one SIGKILL, which lands:
 * - before submit: the victim stops just before it submits op n while its peers wait in op n;
 * - after submit: the victim has submitted op n, its peers too except one held back;
 * - during execution: every rank submitted a big op n (N_s = T on all ranks) and the kill comes
 *   10..60% of a big op's execution time later (measured on the second of two big calibration
 *   steps at the start); best effort: where each kill really landed is read from the
 *   survivors' messages and reported;
 * - during region registration: the victim registers and releases regions in a loop instead of
 *   submitting op n;
 * - during group join: in a freshly created group, the survivors submitted op 0 and the victim's
 *   replacement is killed around its GroupJoin; the survivors get PEER_LOST when it had bound,
 *   TIMEOUT (that group's op timeout, 600 ms) when it never came.
 * Checked: every survivor's pending op fails with PEER_LOST (or TIMEOUT for a rank that never
 * came) within 1 s of the kill, or of its submission when it was submitted after the kill (the
 * distribution is printed); a new process re-attaches to the
 * broken group (or the group is recreated after a join kill) and the next step succeeds and
 * matches the reference; group B sees no failure at all; group A completes at least 1000
 * collective ops; and once everyone has left, the daemon is back at its baseline: the same
 * number of open fds, no client but epctl, no region, no group, no client memfd mapped.
 *
 * The scenario is backend-agnostic: EPD_TEST_BACKEND=cuda runs it against the GPU backend.
 */
#include <check.h>
#include <dirent.h>
#include <jansson.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "randstep.h"

#define RA 8                     /* group A's ranks */
#define RB 3                     /* group B's ranks */
#define EVENTS_PER_PHASE 4
#define MAX_GENS (5 * EVENTS_PER_PHASE + 1)
#define MIN_OPS 1000             /* collective ops group A must complete */
#define OP_TIMEOUT_MS 30000      /* group A, except: */
#define OP_TIMEOUT_JOIN_MS 600   /* the group of a join kill: bounds its TIMEOUT */
#define LATENCY_LIMIT_MS 1000
#define WAIT_MS 60000

enum phase { PH_NONE, PH_BEFORE, PH_AFTER, PH_EXEC, PH_REGISTER, PH_JOIN, PH_COUNT };
static const char *const phase_names[PH_COUNT] = {
        "none", "before submit", "after submit", "during execution", "during registration",
        "during join",
};

/* What a survivor's failed op said, from its status and message. */
enum fclass { FC_NONE, FC_EXEC, FC_PENDING, FC_BROKEN, FC_TIMEOUT, FC_OTHER, FC_COUNT };
static const char *const fclass_names[FC_COUNT] = {
        "-", "executing (op completed without the lost rank)",
        "collected (pending op failed when the rank was lost)",
        "submitted after the break (group broken)", "TIMEOUT (the rank never came)", "other",
};

enum role { ROLE_RANK, ROLE_JOIN_VICTIM };

struct gen_plan {
        int phase;
        uint32_t victim, holdout;
        uint32_t step;           /* the event's step */
        int op_last;             /* the event op: the step's combine (else its dispatch) */
        int fresh;               /* a new group (else the previous one, re-attached) */
        uint32_t group_index;
        uint32_t delay;          /* µs before the kill; EXEC: per mille of the execution time */
        uint32_t steps;          /* PH_NONE: steps to run */
};

struct gen_state {
        atomic_int entered;      /* ranks in the generation's group */
        atomic_int submitted;    /* ranks that submitted the event op */
        atomic_int victim_ready;
        atomic_int join_go;
        atomic_int killed;
        atomic_int failed;       /* survivors that recorded their failure */
        atomic_llong kill_ns;
        long long fail_ns[RA];
        long long fail_submit_ns[RA];
        int fail_status[RA];
        int fail_class[RA];
        uint32_t fail_step[RA];
        unsigned fail_op[RA];
        unsigned long long ops_ok[RA];
        char message[RA][160];
};

struct shared {
        char socket[320];
        uint64_t seed;
        struct rs_shape a, b;
        int num_gens;
        struct gen_plan plan[MAX_GENS];
        struct gen_state st[MAX_GENS];
        atomic_ullong exec_est_ns;   /* execution time of a big dispatch, from gen 0 step 0 */
        atomic_int b_stop;           /* the test asks group B to stop */
        atomic_llong b_stop_step;    /* group B's rank 0 turns that into a step number */
        atomic_ullong b_steps[RB], b_ops[RB];
        atomic_int errors;
};

static long long now_ns(void)
{
        return (long long)rs_now_ns();
}

static void group_name(const struct shared *sh, int gen, char *buf, size_t len)
{
        snprintf(buf, len, "faults-%u", sh->plan[gen].group_index);
}

static int wait_at_least(atomic_int *v, int want, int timeout_ms)
{
        long long deadline = now_ns() + (long long)timeout_ms * 1000000;

        while (atomic_load(v) < want) {
                if (now_ns() > deadline)
                        return -1;
                usleep(200);
        }
        return 0;
}

/* The test's own waits also give up as soon as a worker reported an error. */
static int parent_wait(struct shared *sh, atomic_int *v, int want, int timeout_ms)
{
        long long deadline = now_ns() + (long long)timeout_ms * 1000000;

        while (atomic_load(v) < want) {
                if (now_ns() > deadline || atomic_load(&sh->errors))
                        return -1;
                usleep(200);
        }
        return 0;
}

static void stay_dead(void)
{
        for (;;)
                pause();
}

/* ---- group A worker ---- */

struct wk {
        struct shared *sh;
        uint32_t rank;
        int gen;
        struct epd_client *client;
};

/* Registers and releases regions until killed; signals after the first. */
static void registration_loop(struct wk *k, struct gen_state *st)
{
        uint64_t ids[4];
        int n = 0;

        for (unsigned i = 0;; i++) {
                void *p;
                uint64_t id;
                if (epd_region_alloc(k->client, (64u << 10) + (i % 7) * 4096, &p, &id) == 0)
                        ids[n++] = id;
                if (i == 0)
                        atomic_store(&st->victim_ready, 1);
                if (n == 4) {
                        while (n > 0)
                                epd_region_release(k->client, ids[--n]);
                }
        }
}

static int fault_hook(void *ctx, enum rs_point pt, uint64_t index, unsigned op, unsigned nops)
{
        struct wk *k = ctx;
        const struct gen_plan *gp = &k->sh->plan[k->gen];
        struct gen_state *st = &k->sh->st[k->gen];
        int victim = k->rank == gp->victim;

        if (gp->phase == PH_NONE || index != gp->step || op != (gp->op_last ? nops - 1 : 0))
                return 0;
        switch (gp->phase) {
        case PH_BEFORE:
        case PH_REGISTER:
                if (pt == RS_BEFORE_SUBMIT && victim) {
                        if (gp->phase == PH_REGISTER)
                                registration_loop(k, st);
                        atomic_store(&st->victim_ready, 1);
                        stay_dead();
                }
                if (pt == RS_AFTER_SUBMIT)
                        atomic_fetch_add(&st->submitted, 1);
                break;
        case PH_AFTER:
                if (pt == RS_BEFORE_SUBMIT && k->rank == gp->holdout) {
                        /* Held back: submits only once the victim is dead. */
                        if (wait_at_least(&st->killed, 1, WAIT_MS) < 0)
                                return -1;
                }
                if (pt == RS_AFTER_SUBMIT && victim) {
                        atomic_store(&st->victim_ready, 1);
                        stay_dead();
                }
                if (pt == RS_AFTER_SUBMIT && k->rank != gp->holdout)
                        atomic_fetch_add(&st->submitted, 1);
                break;
        case PH_EXEC:
                if (pt == RS_AFTER_SUBMIT) {
                        atomic_fetch_add(&st->submitted, 1);
                        if (victim)
                                stay_dead();
                }
                break;
        case PH_JOIN:
                if (pt == RS_AFTER_SUBMIT)
                        atomic_fetch_add(&st->submitted, 1);
                break;
        }
        return 0;
}

static int classify(int status, const char *msg)
{
        if (status == EPD_TIMEOUT)
                return FC_TIMEOUT;
        if (status != EPD_PEER_LOST)
                return FC_OTHER;
        if (strstr(msg, "before the op completed on every rank"))
                return FC_EXEC;
        if (strstr(msg, "is broken"))
                return FC_BROKEN;
        if (strstr(msg, "was lost"))
                return FC_PENDING;
        return FC_OTHER;
}

static int rank_fail(struct wk *k, const char *what, const char *detail)
{
        fprintf(stderr, "[faults seed=%llu gen=%d rank=%u pid=%d] %s: %s\n",
                (unsigned long long)k->sh->seed, k->gen, k->rank, (int)getpid(), what, detail);
        atomic_fetch_add(&k->sh->errors, 1);
        return 1;
}

static int join_victim(struct wk *k)
{
        struct gen_state *st = &k->sh->st[k->gen];
        struct epd_group_config cfg = rs_group_config(&k->sh->a, OP_TIMEOUT_JOIN_MS,
                                                      rs_arena_bytes(&k->sh->a));
        struct epd_group *g = NULL;
        char name[64];
        uint64_t id;
        void *p;

        if (epd_region_alloc(k->client, 1u << 20, &p, &id) < 0)
                return rank_fail(k, "join victim: region", epd_client_last_error(k->client));
        atomic_store(&st->victim_ready, 1);
        if (wait_at_least(&st->join_go, 1, WAIT_MS) < 0)
                return rank_fail(k, "join victim", "no go");
        group_name(k->sh, k->gen, name, sizeof(name));
        rs_enter_group(k->client, name, k->rank, &cfg, &g, 5000);
        stay_dead();
        return 0;
}

static int rank_main(void *arg, int index)
{
        struct wk k = { .sh = arg, .rank = (uint32_t)(index & 0xff), .gen = (index >> 8) & 0xff };
        int role = index >> 16;
        struct shared *sh = k.sh;
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = sh->socket,
                                       .client_name = "faults-a", .timeout_ms = 30000 };
        struct epd_group_config cfg;
        struct epd_group *group = NULL;
        struct rs_worker w;
        char err[512], name[64];
        int start = k.gen, rc;

        rc = epd_client_connect(&ca, &k.client, err, sizeof(err));
        if (rc < 0)
                return rank_fail(&k, "connect", err);
        if (role == ROLE_JOIN_VICTIM)
                return join_victim(&k);
        rs_worker_init(&w, &sh->a, k.rank, k.client, NULL);
        w.hook = fault_hook;
        w.hook_ctx = &k;
        w.wait_ms = WAIT_MS;
        w.sample_rows = 64;
        for (; k.gen < sh->num_gens; k.gen++) {
                const struct gen_plan *gp = &sh->plan[k.gen];
                struct gen_state *st = &sh->st[k.gen];
                uint64_t ops0 = w.ops_ok;
                uint32_t step;

                if (k.gen == start || gp->fresh) {
                        if (group && epd_group_leave(group) < 0)
                                return rank_fail(&k, "leave", epd_client_last_error(k.client));
                        group = NULL;
                        group_name(sh, k.gen, name, sizeof(name));
                        /* A short op timeout only where a TIMEOUT is the point: elsewhere a
                         * slow rank (sanitizers, a loaded machine) must not time out. */
                        cfg = rs_group_config(&sh->a, gp->phase == PH_JOIN ? OP_TIMEOUT_JOIN_MS
                                                                           : OP_TIMEOUT_MS,
                                              rs_arena_bytes(&sh->a));
                        rc = rs_enter_group(k.client, name, k.rank, &cfg, &group, 10000);
                        if (rc < 0)
                                return rank_fail(&k, "enter group",
                                                 epd_client_last_error(k.client));
                        w.group = group;
                }
                atomic_fetch_add(&st->entered, 1);
                /* Everyone is bound before op 0 (the group is READY), except where the test
                 * wants a rank that never comes: there the others start together. */
                if (wait_at_least(&st->entered, gp->phase == PH_JOIN ? RA - 1 : RA, WAIT_MS) < 0)
                        return rank_fail(&k, "re-forming", "the group did not re-form");
                for (step = 0;; step++) {
                        struct rs_plan p;
                        int big = (gp->phase == PH_EXEC && step == gp->step) ||
                                  (k.gen == 0 && step < 2);

                        if (gp->phase == PH_NONE && step >= gp->steps)
                                break;
                        if (gp->phase != PH_NONE && step > gp->step + 1)
                                return rank_fail(&k, "kill", "no failure one step after the kill");
                        rs_plan_make(&sh->a, (uint64_t)k.gen, step, big, &p);
                        w.check = big ? RS_CHECK_SAMPLED : RS_CHECK_FULL;
                        rc = rs_step_run(&w, &p, (uint64_t)k.gen, step);
                        if (rc == RS_OK) {
                                /* Calibration: the second big op, with warm memory. */
                                if (k.gen == 0 && step == 1 && k.rank == 0)
                                        atomic_store(&sh->exec_est_ns, w.last_exec_ns);
                                continue;
                        }
                        if (rc != RS_OP_FAILED)
                                return rank_fail(&k, "step", w.err);
                        int event_op = gp->op_last ? (int)p.num_ops - 1 : 0;
                        if (gp->phase == PH_NONE || step < gp->step ||
                            (step == gp->step && (int)w.fail_op_in_step < event_op))
                                return rank_fail(&k, "an op failed before any kill", w.err);
                        st->fail_ns[k.rank] = (long long)w.fail_ns;
                        st->fail_submit_ns[k.rank] = (long long)w.fail_submit_ns;
                        st->fail_status[k.rank] = w.fail_status;
                        st->fail_class[k.rank] = classify(w.fail_status, w.err);
                        st->fail_step[k.rank] = step;
                        st->fail_op[k.rank] = w.fail_op_in_step;
                        snprintf(st->message[k.rank], sizeof(st->message[k.rank]), "%.159s", w.err);
                        break;
                }
                st->ops_ok[k.rank] = w.ops_ok - ops0;
                if (gp->phase != PH_NONE)
                        atomic_fetch_add(&st->failed, 1);
        }
        rs_worker_fini(&w);
        if (group && epd_group_leave(group) < 0)
                return rank_fail(&k, "final leave", epd_client_last_error(k.client));
        epd_client_free(k.client);
        return 0;
}

/* ---- group B: bystanders ---- */

static int bystander_main(void *arg, int index)
{
        struct shared *sh = arg;
        struct wk k = { .sh = sh, .rank = (uint32_t)index };
        struct epd_connect_args ca = { .size = sizeof(ca), .socket_path = sh->socket,
                                       .client_name = "faults-b", .timeout_ms = 30000 };
        struct epd_group_config cfg = rs_group_config(&sh->b, 10000, rs_arena_bytes(&sh->b));
        struct epd_group *group = NULL;
        struct rs_worker w;
        char err[512];
        int rc;

        rc = epd_client_connect(&ca, &k.client, err, sizeof(err));
        if (rc < 0)
                return rank_fail(&k, "bystander connect", err);
        rc = rs_enter_group(k.client, "bystanders", k.rank, &cfg, &group, 10000);
        if (rc < 0)
                return rank_fail(&k, "bystander group", epd_client_last_error(k.client));
        rs_worker_init(&w, &sh->b, k.rank, k.client, group);
        for (uint64_t step = 0;; step++) {
                struct rs_plan p;

                /* Rank 0 picks the step at which everyone stops: no rank can be past the step
                 * rank 0 is about to start. */
                if (k.rank == 0 && atomic_load(&sh->b_stop) &&
                    atomic_load(&sh->b_stop_step) == INT64_MAX)
                        atomic_store(&sh->b_stop_step, (long long)step + 1);
                if ((long long)step >= atomic_load(&sh->b_stop_step))
                        break;
                rs_plan_make(&sh->b, 0, step, 0, &p);
                rc = rs_step_run(&w, &p, 0, step);
                if (rc != RS_OK)
                        return rank_fail(&k, "bystander", w.err);
                atomic_store(&sh->b_steps[k.rank], w.steps_ok);
                atomic_store(&sh->b_ops[k.rank], w.ops_ok);
                usleep(2000); /* steady, but leaves the CPUs to group A */
        }
        rs_worker_fini(&w);
        if (epd_group_leave(group) < 0)
                return rank_fail(&k, "bystander leave", epd_client_last_error(k.client));
        epd_client_free(k.client);
        return 0;
}

/* ---- the plan ---- */

static unsigned step_ops(const struct rs_shape *sh, int gen, uint32_t step, int big)
{
        struct rs_plan p;

        rs_plan_make(sh, (uint64_t)gen, step, big, &p);
        return p.num_ops;
}

/* Plans the generations; returns the collective ops planned to succeed. */
static unsigned plan_run(struct shared *sh)
{
        struct td_rng rng;
        int phases[MAX_GENS];
        int n = 0;
        unsigned ops = 0;
        uint32_t group_index = 0;

        td_rng_seed(&rng, td_mix_seed(sh->seed, 77));
        for (int ph = PH_BEFORE; ph < PH_COUNT; ph++)
                for (int i = 0; i < EVENTS_PER_PHASE; i++)
                        phases[n++] = ph;
        /* Shuffle; the first generation must not be a join kill (nothing to re-join yet). */
        do {
                for (int i = n - 1; i > 0; i--) {
                        int j = (int)td_rng_below(&rng, (uint32_t)i + 1), t = phases[i];
                        phases[i] = phases[j];
                        phases[j] = t;
                }
        } while (phases[0] == PH_JOIN);
        sh->num_gens = n + 1;
        for (int g = 0; g <= n; g++) {
                struct gen_plan *gp = &sh->plan[g];

                gp->phase = g < n ? phases[g] : PH_NONE;
                gp->fresh = g == 0 || gp->phase == PH_JOIN || sh->plan[g - 1].phase == PH_JOIN;
                group_index += gp->fresh && g > 0;
                gp->group_index = group_index;
                /* A join kill is of the previous victim's replacement. */
                gp->victim = gp->phase == PH_JOIN ? sh->plan[g - 1].victim : td_rng_below(&rng, RA);
                gp->holdout = (gp->victim + 1 + td_rng_below(&rng, RA - 1)) % RA;
                gp->step = gp->phase == PH_JOIN ? 0 : 1 + td_rng_below(&rng, 12);
                if (g == 0 && gp->step < 2)
                        gp->step = 2; /* after the two calibration steps */
                gp->op_last = (gp->phase == PH_BEFORE || gp->phase == PH_AFTER ||
                               gp->phase == PH_REGISTER) && td_rng_below(&rng, 2);
                switch (gp->phase) {
                case PH_EXEC: gp->delay = 100 + td_rng_below(&rng, 500); break;
                case PH_JOIN: gp->delay = td_rng_below(&rng, 800); break;
                case PH_AFTER: gp->delay = 500 + td_rng_below(&rng, 2500); break;
                default: gp->delay = td_rng_below(&rng, 3000); break;
                }
                if (gp->phase == PH_NONE)
                        break;
                for (uint32_t s = 0; s < gp->step; s++)
                        ops += step_ops(&sh->a, g, s, g == 0 && s < 2);
                if (gp->op_last)
                        ops += step_ops(&sh->a, g, gp->step, 0) - 1;
        }
        /* The last generation runs until group A has done MIN_OPS. */
        struct gen_plan *last = &sh->plan[n];
        for (last->steps = 0; ops < MIN_OPS || last->steps < 2; last->steps++)
                ops += step_ops(&sh->a, n, last->steps, 0);
        return ops;
}

/* ---- daemon state ---- */

static json_t *epctl_json(const struct h_daemon *d, const char *command)
{
        static char out[1 << 20];
        const char *args[] = { "--socket", d->socket, command, "--json", NULL };
        json_error_t jerr;

        if (h_run_tool("epctl", args, out, sizeof(out)) != 0)
                return NULL;
        return json_loads(out, 0, &jerr);
}

struct tables {
        int fds, clients, regions, groups, mappings;
        long long outstanding, pending;
};

static void tables_read(const struct h_daemon *d, struct tables *t)
{
        json_t *st = epctl_json(d, "status"), *stats = epctl_json(d, "stats");
        size_t i;
        json_t *v;

        memset(t, 0, sizeof(*t));
        t->fds = h_proc_fd_count(d->pid);
        t->mappings = h_proc_region_mappings(d->pid);
        t->clients = t->regions = t->groups = -1;
        if (st) {
                t->clients = (int)json_integer_value(json_object_get(st, "clients"));
                t->regions = (int)json_integer_value(json_object_get(st, "regions"));
                t->groups = (int)json_integer_value(json_object_get(st, "groups"));
        }
        if (stats) {
                json_array_foreach(json_object_get(stats, "clients"), i, v)
                        t->outstanding += json_integer_value(json_object_get(v, "outstanding_ops"));
                json_array_foreach(json_object_get(stats, "groups"), i, v)
                        t->pending += json_integer_value(json_object_get(v, "pending_ops"));
        }
        json_decref(st);
        json_decref(stats);
}

/* ---- the test ---- */

static int cmp_ll(const void *a, const void *b)
{
        long long x = *(const long long *)a, y = *(const long long *)b;

        return (x > y) - (x < y);
}

static void print_latency(const char *what, long long *v, int n)
{
        if (n == 0) {
                printf("%s: none\n", what);
                return;
        }
        qsort(v, (size_t)n, sizeof(v[0]), cmp_ll);
        printf("%s (%d survivors): min %.2f p50 %.2f p99 %.2f max %.2f ms\n", what, n, v[0] / 1e6,
               v[n / 2] / 1e6, v[(n * 99) / 100] / 1e6, v[n - 1] / 1e6);
}

static void kill_all(pid_t *pids, int n)
{
        pid_t live[RA];
        int m = 0;

        for (int i = 0; i < n && m < RA; i++)
                if (pids[i] > 0) {
                        kill(pids[i], SIGKILL);
                        live[m++] = pids[i];
                }
        h_wait_all(live, m, 2000); /* a pid of 0 would wait for any child */
}

START_TEST(test_faults)
{
        struct h_daemon d;
        struct shared *sh;
        struct tables base, now;
        pid_t a_pids[RA], b_pids[RB];
        long long lat[MAX_GENS * RA], lat_lost[MAX_GENS * RA], lat_timeout[MAX_GENS * RA];
        int nlat = 0, nlat_lost = 0, nlat_timeout = 0, submitted_after = 0;
        int hits[PH_COUNT][FC_COUNT] = { { 0 } }, after_completion = 0;
        unsigned planned_ops;
        const char *env = getenv("EPD_FAULT_SEED");
        long long t_start = now_ns();

        sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        ck_assert_ptr_ne(sh, MAP_FAILED);
        memset(sh, 0, sizeof(*sh));
        sh->seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u % 1000000007u;
        printf("integ_faults seed=%llu (EPD_FAULT_SEED=%llu replays it)\n",
               (unsigned long long)sh->seed, (unsigned long long)sh->seed);
        fflush(stdout);
        /* A: 8 ranks, small steps (N_s <= 16, H = 512) and room for one big op (T = 1024). */
        sh->a = (struct rs_shape){ .world_size = RA, .num_experts = 64, .hidden = 512,
                                   .max_tokens = 1024, .max_topk = 8, .dtype = EPD_DTYPE_BF16,
                                   .step_tokens = 16, .seed = sh->seed };
        /* B: 3 ranks of another shape and dtype. */
        sh->b = (struct rs_shape){ .world_size = RB, .num_experts = 12, .hidden = 256,
                                   .max_tokens = 16, .max_topk = 4,
                                   .dtype = EPD_DTYPE_FP8_E4M3, .step_tokens = 16,
                                   .seed = sh->seed ^ 0xB0B0 };
        atomic_store(&sh->b_stop_step, INT64_MAX);
        planned_ops = plan_run(sh);
        for (int g = 0; g < sh->num_gens; g++)
                printf("gen %2d: %-20s victim %u step %2u%s%s delay %u\n", g,
                       phase_names[sh->plan[g].phase], sh->plan[g].victim, sh->plan[g].step,
                       sh->plan[g].op_last ? " (combine)" : "",
                       sh->plan[g].fresh ? " fresh group" : "", sh->plan[g].delay);

        ck_assert_int_eq(h_daemon_start(&d, NULL), 0);
        snprintf(sh->socket, sizeof(sh->socket), "%s", d.socket);
        tables_read(&d, &base);
        printf("baseline: fds %d clients %d (epctl) regions %d groups %d mappings %d\n",
               base.fds, base.clients, base.regions, base.groups, base.mappings);
        fflush(stdout);

        for (int r = 0; r < RB; r++)
                b_pids[r] = h_spawn(bystander_main, sh, r);
        for (int r = 0; r < RA; r++)
                a_pids[r] = h_spawn(rank_main, sh, r);

        for (int g = 0; g + 1 < sh->num_gens; g++) {
                const struct gen_plan *gp = &sh->plan[g];
                struct gen_state *st = &sh->st[g];
                uint32_t v = gp->victim;
                pid_t join_pid = 0, victim_pid;
                int want = RA - 1, rc = 0, status;

                if (gp->phase == PH_JOIN)
                        join_pid = h_spawn(rank_main, sh, (int)v | g << 8 | ROLE_JOIN_VICTIM << 16);
                if (gp->phase == PH_AFTER)
                        want = RA - 2;
                if (gp->phase == PH_EXEC)
                        want = RA;
                rc |= parent_wait(sh, &st->submitted, want, WAIT_MS);
                if (gp->phase != PH_EXEC)
                        rc |= parent_wait(sh, &st->victim_ready, 1, WAIT_MS);
                if (rc < 0 || atomic_load(&sh->errors)) {
                        kill_all(a_pids, RA);
                        kill_all(b_pids, RB);
                        if (join_pid)
                                kill_all(&join_pid, 1);
                        h_daemon_dump_log(&d);
                        ck_abort_msg("gen %d (%s): the event point was not reached (seed %llu)", g,
                                     phase_names[gp->phase], (unsigned long long)sh->seed);
                }
                if (gp->phase == PH_JOIN)
                        atomic_store(&st->join_go, 1);
                long long delay_ns = gp->phase == PH_EXEC
                                             ? (long long)atomic_load(&sh->exec_est_ns) *
                                                       gp->delay / 1000
                                             : (long long)gp->delay * 1000;
                long long t_kill = now_ns() + delay_ns;
                while (now_ns() < t_kill)
                        ;
                victim_pid = gp->phase == PH_JOIN ? join_pid : a_pids[v];
                atomic_store(&st->kill_ns, now_ns());
                ck_assert_int_eq(kill(victim_pid, SIGKILL), 0);
                ck_assert_int_eq(waitpid(victim_pid, &status, 0), victim_pid);
                atomic_store(&st->killed, 1);
                if (parent_wait(sh, &st->failed, RA - 1, 10000) < 0) {
                        for (uint32_t r = 0; r < RA; r++)
                                if (r != v && st->fail_class[r] == FC_NONE)
                                        fprintf(stderr, "gen %d: rank %u recorded no failure\n",
                                                g, r);
                        kill_all(a_pids, RA);
                        kill_all(b_pids, RB);
                        h_daemon_dump_log(&d);
                        ck_abort_msg("gen %d (%s): survivors did not all fail within 10 s of the kill (seed %llu)",
                                     g, phase_names[gp->phase], (unsigned long long)sh->seed);
                }
                /* The rank's next process: re-attaches, or enters the next fresh group; before
                 * a join kill it is the next generation's join victim instead. */
                a_pids[v] = 0;
                if (sh->plan[g + 1].phase != PH_JOIN)
                        a_pids[v] = h_spawn(rank_main, sh, (int)v | (g + 1) << 8);

                /* What the survivors saw: where the kill landed is the most advanced state
                 * any survivor's op was in. */
                static const int rank_of[FC_COUNT] = { 0, 4, 3, 1, 2, 0 };
                int worst = FC_NONE, late = 0;
                unsigned event_op = gp->op_last ? step_ops(&sh->a, g, gp->step, 0) - 1 : 0;
                long long lo = -1, hi = -1;
                for (uint32_t r = 0; r < RA; r++) {
                        long long l;
                        if (r == v)
                                continue;
                        ck_assert_msg(st->fail_class[r] != FC_OTHER,
                                      "gen %d rank %u: unexpected failure: %s", g, r,
                                      st->message[r]);
                        ck_assert_msg(st->fail_ns[r] >= atomic_load(&st->kill_ns),
                                      "gen %d rank %u failed before the kill: %s", g, r,
                                      st->message[r]);
                        /* From the kill, or from the op's submission when the survivor
                         * submitted it only after the kill (the kill came after the event op
                         * had completed, or the rank was held back): the time the daemon took,
                         * not the survivor's own work in between. */
                        long long from = atomic_load(&st->kill_ns);
                        if (st->fail_submit_ns[r] > from) {
                                from = st->fail_submit_ns[r];
                                submitted_after++;
                        }
                        lat[nlat++] = st->fail_ns[r] - from;
                        if (st->fail_status[r] == EPD_TIMEOUT)
                                lat_timeout[nlat_timeout++] = lat[nlat - 1];
                        else
                                lat_lost[nlat_lost++] = lat[nlat - 1];
                        l = lat[nlat - 1] / 1000000;
                        lo = lo < 0 || l < lo ? l : lo;
                        hi = l > hi ? l : hi;
                        if (rank_of[st->fail_class[r]] > rank_of[worst])
                                worst = st->fail_class[r];
                        if (st->fail_step[r] > gp->step ||
                            (st->fail_step[r] == gp->step && st->fail_op[r] > event_op))
                                late = 1;
                }
                hits[gp->phase][worst]++;
                after_completion += late;
                printf("gen %2d %-20s victim %u: survivors got their error %lld..%lld ms after the kill; %s%s\n",
                       g, phase_names[gp->phase], v, lo, hi, fclass_names[worst],
                       late ? " (the event op itself completed)" : "");
                fflush(stdout);
        }

        printf("a big dispatch (N_s = %u on %d ranks, H = %u) executed in %.2f ms (gen 0, warm)\n",
               sh->a.max_tokens, RA, sh->a.hidden, atomic_load(&sh->exec_est_ns) / 1e6);
        /* The last generation runs out; then group B stops. */
        int failures = h_wait_all(a_pids, RA, 120000);
        atomic_store(&sh->b_stop, 1);
        failures += h_wait_all(b_pids, RB, 60000);
        if (failures || atomic_load(&sh->errors))
                h_daemon_dump_log(&d);
        ck_assert_msg(failures == 0 && atomic_load(&sh->errors) == 0,
                      "%d worker(s) failed, %d error(s) (seed %llu)", failures,
                      atomic_load(&sh->errors), (unsigned long long)sh->seed);

        /* Latency of PEER_LOST / TIMEOUT after the kill. */
        print_latency("PEER_LOST after the kill", lat_lost, nlat_lost);
        print_latency("TIMEOUT after the kill", lat_timeout, nlat_timeout);
        qsort(lat, (size_t)nlat, sizeof(lat[0]), cmp_ll);
        print_latency("any error after the kill", lat, nlat);
        printf("(%d of them submitted the failing op only after the kill: counted from the submission)\n",
               submitted_after);
        printf("where the kills landed (planned phase: what the survivors saw):\n");
        for (int ph = PH_BEFORE; ph < PH_COUNT; ph++)
                for (int c = 0; c < FC_COUNT; c++)
                        if (hits[ph][c])
                                printf("  %-20s %2d x %s\n", phase_names[ph], hits[ph][c],
                                       fclass_names[c]);
        printf("  (%d kill(s) came after the event op had completed everywhere)\n",
               after_completion);
        ck_assert_msg(lat[nlat - 1] < (long long)LATENCY_LIMIT_MS * 1000000,
                      "a survivor waited %.1f ms for its error after a kill (seed %llu)",
                      lat[nlat - 1] / 1e6, (unsigned long long)sh->seed);

        unsigned long long a_ops = 0, b_ops = 0, b_steps = 0;
        for (int g = 0; g < sh->num_gens; g++) {
                unsigned long long m = 0;
                for (int r = 0; r < RA; r++)
                        m = sh->st[g].ops_ok[r] > m ? sh->st[g].ops_ok[r] : m;
                a_ops += m;
        }
        for (int r = 0; r < RB; r++) {
                b_ops = atomic_load(&sh->b_ops[r]) > b_ops ? atomic_load(&sh->b_ops[r]) : b_ops;
                b_steps = atomic_load(&sh->b_steps[r]) > b_steps ? atomic_load(&sh->b_steps[r])
                                                                   : b_steps;
        }
        printf("group A: %llu collective ops completed and verified (%u planned), %d kills; group B: %llu ops in %llu steps, 0 failures\n",
               a_ops, planned_ops, sh->num_gens - 1, b_ops, b_steps);
        ck_assert_uint_ge(a_ops, MIN_OPS);
        ck_assert_uint_gt(b_steps, 0);

        /* Back to the baseline once every worker is gone. */
        long long deadline = now_ns() + 3000000000ll;
        for (;;) {
                tables_read(&d, &now);
                if ((now.fds == base.fds && now.clients == base.clients && now.regions == 0 &&
                     now.groups == 0 && now.mappings == 0 && now.outstanding == 0 &&
                     now.pending == 0) ||
                    now_ns() > deadline)
                        break;
                usleep(50000);
        }
        printf("after: fds %d clients %d regions %d groups %d mappings %d outstanding %lld pending %lld\n",
               now.fds, now.clients, now.regions, now.groups, now.mappings, now.outstanding,
               now.pending);
        ck_assert_int_eq(now.fds, base.fds);
        ck_assert_int_eq(now.clients, base.clients);
        ck_assert_int_eq(now.regions, 0);
        ck_assert_int_eq(now.groups, 0);
        ck_assert_int_eq(now.mappings, 0);
        ck_assert_int_eq(now.outstanding, 0);
        ck_assert_int_eq(now.pending, 0);
        printf("integ_faults took %.1f s\n", (now_ns() - t_start) / 1e9);
        ck_assert_int_eq(h_daemon_stop(&d, 10000), 0);
        munmap(sh, sizeof(*sh));
}
END_TEST

int main(void)
{
        Suite *s = suite_create("faults");
        TCase *tc = tcase_create("faults");
        SRunner *sr;
        int failed;

        tcase_set_timeout(tc, 600);
        tcase_add_test(tc, test_faults);
        suite_add_tcase(s, tc);
        sr = srunner_create(s);
        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
