/* integ_auth.c - who may talk to the daemon, against the real epd binary (docs/architecture.md,
 * "Objects" and 6, README "Running the daemon").
 *
 * The tests run as root and check what another user sees by forking a child that drops to
 * `nobody` (setgroups, setgid, setuid) before it connects; the child reports back through a pipe.
 * Covered:
 * - the socket file gets --socket-mode, and a user the mode excludes cannot connect (EACCES);
 * - allow_uids / allow_gids: a peer outside both lists is refused with PERMISSION_DENIED and a
 *   message; a uid or a primary gid on a list is accepted; root always is; refusals are
 *   counted; the lists are hot (SIGHUP);
 * - admin rights: Welcome grants CAP_ADMIN to root and to members of admin_group, not to
 *   anyone else (epd_client_capabilities); that the admin verbs themselves refuse everyone
 *   else is integ_admin's;
 * - group secrets across users: another user who knows the secret may join a root's group,
 *   with a wrong secret it gets PERMISSION_DENIED;
 * - group names are per uid: another user who took a name first does not make root's create of
 *   that name fail, and a join finds its own uid's group first;
 * - wrong secrets cost the connection after EPD_MAX_WRONG_SECRETS tries;
 * - a uid dropped from the allow list by SIGHUP loses its open connections too. (Short secrets,
  * wrong secrets of the same user and regions of other clients are integ_proto's.) Without root the
  * tests say so and pass: dropping privileges needs it.
 */
#include <check.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <jansson.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "harness.h"

/* ---- the other user ---- */

static uid_t nobody_uid = 65534;
static gid_t nobody_gid = 65534;
static char nobody_group[64] = "nogroup";

static int have_root(void)
{
        struct passwd *pw = getpwnam("nobody");
        struct group *gr;

        if (pw) {
                nobody_uid = pw->pw_uid;
                nobody_gid = pw->pw_gid;
        }
        gr = getgrgid(nobody_gid);
        if (gr)
                snprintf(nobody_group, sizeof(nobody_group), "%s", gr->gr_name);
        if (geteuid() != 0) {
                printf("not root: cannot run a client as another user; test skipped\n");
                return 0;
        }
        return 1;
}

enum child_action {
        ACT_RAW_CONNECT,   /* connect(2) only: errno */
        ACT_CONNECT,       /* epd_client_connect: status, message, capabilities */
        ACT_JOIN,          /* connect, join group "shared" as rank 1 with the right secret */
        ACT_JOIN_WRONG,    /* ... with a wrong secret */
        ACT_CREATE_HOLD,   /* create group "shared" (2 ranks, its own secret), report, hold it */
        ACT_CONNECT_HOLD,  /* connect, report, then ask every 20 ms until the daemon refuses */
        ACT_GUESS,         /* join "shared" with wrong secrets until closed, then connect again */
};

struct child_result {
        int done;
        int rc;              /* connect(2): 0 or errno; libepd: the status */
        uint64_t caps;
        uid_t uid;
        char message[400];
};

/* Wrong secrets that cost a connection (the daemon's EPD_MAX_WRONG_SECRETS). */
#define EPD_GUESSES 8

/* The 2-rank group of these tests. */
static struct epd_group_config small_group(void)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = 2, .num_experts = 8, .hidden = 64,
                .max_tokens_per_rank = 16, .max_topk = 2, .dispatch_dtype = EPD_DTYPE_BF16,
                .arena_bytes = 1u << 20,
        };
        return cfg;
}

/* The hold actions report through hold_fd twice: once set up, once the connection ended. */
static int hold_fd = -1;

static int hold_body(struct epd_client *c, enum child_action act, struct child_result *r)
{
        struct epd_group_config cfg = small_group();
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = "shared", .secret = secret,
                                     .secret_len = sizeof(secret), .rank = 0, .config = &cfg };
        struct epd_size_hint hint;
        struct epd_group *g = NULL;

        if (act == ACT_CREATE_HOLD) {
                h_secret("nobody's own", secret);
                r->rc = epd_group_create(c, &ga, &g);
                snprintf(r->message, sizeof(r->message), "%s", epd_client_last_error(c));
        }
        r->done = 1;
        if (write(hold_fd, r, sizeof(*r)) != (ssize_t)sizeof(*r))
                _exit(2);
        do
                usleep(20000);
        while ((r->rc = epd_size_hint(c, &cfg, 1, &hint)) == EPD_OK);
        snprintf(r->message, sizeof(r->message), "%s", epd_client_last_error(c));
        if (write(hold_fd, r, sizeof(*r)) != (ssize_t)sizeof(*r))
                _exit(2);
        _exit(0);
}

static int child_body(const struct h_daemon *d, enum child_action act, struct child_result *r)
{
        struct epd_connect_args args = { .size = sizeof(args), .socket_path = d->socket,
                                         .client_name = "nobody", .timeout_ms = 5000 };
        struct epd_client *c = NULL;
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = "shared", .secret = secret,
                                     .secret_len = sizeof(secret), .rank = 1 };
        struct epd_group *g = NULL;

        if (setgroups(0, NULL) < 0 || setgid(nobody_gid) < 0 || setuid(nobody_uid) < 0) {
                snprintf(r->message, sizeof(r->message), "cannot become nobody: %s",
                         strerror(errno));
                return -1;
        }
        r->uid = getuid();
        if (act == ACT_RAW_CONNECT) {
                struct sockaddr_un sa = { .sun_family = AF_UNIX };
                int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
                memcpy(sa.sun_path, d->socket, strlen(d->socket) + 1);
                r->rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ? errno : 0;
                close(fd);
                return 0;
        }
        r->rc = epd_client_connect(&args, &c, r->message, sizeof(r->message));
        if (r->rc < 0)
                return 0;
        r->caps = epd_client_capabilities(c);
        if (act == ACT_CREATE_HOLD || act == ACT_CONNECT_HOLD)
                return hold_body(c, act, r);
        if (act == ACT_GUESS) {
                /* Each wrong secret is refused; the last one closes the connection. */
                for (int i = 0; i < EPD_GUESSES; i++) {
                        h_secret(i % 2 ? "guess one" : "guess two", secret);
                        if (epd_group_join(c, &ga, &g) != EPD_PERMISSION_DENIED) {
                                snprintf(r->message, sizeof(r->message), "guess %d: %s", i,
                                         epd_client_last_error(c));
                                return -1;
                        }
                }
                epd_client_free(c);
                c = NULL;
                /* What a new connection of this uid gets now. */
                r->rc = epd_client_connect(&args, &c, r->message, sizeof(r->message));
        }
        if (act == ACT_JOIN || act == ACT_JOIN_WRONG) {
                h_secret(act == ACT_JOIN ? "shared" : "not shared", secret);
                r->rc = epd_group_join(c, &ga, &g);
                snprintf(r->message, sizeof(r->message), "%s", epd_client_last_error(c));
                if (r->rc == 0)
                        r->rc = epd_group_leave(g);
        }
        epd_client_free(c);
        return 0;
}

/* Runs act in a child that is `nobody`; returns what it saw. */
static struct child_result as_nobody(const struct h_daemon *d, enum child_action act)
{
        struct child_result r;
        int pipefd[2], status;
        pid_t pid;

        memset(&r, 0, sizeof(r));
        ck_assert_int_eq(pipe(pipefd), 0);
        fflush(stdout);
        fflush(stderr);
        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                close(pipefd[0]);
                r.done = child_body(d, act, &r) == 0;
                if (write(pipefd[1], &r, sizeof(r)) != (ssize_t)sizeof(r))
                        _exit(2);
                _exit(0);
        }
        close(pipefd[1]);
        ck_assert_int_eq(read(pipefd[0], &r, sizeof(r)), (ssize_t)sizeof(r));
        close(pipefd[0]);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(r.done, "the child failed: %s", r.message);
        ck_assert_uint_eq(r.uid, nobody_uid);
        return r;
}

/* Starts a hold action in a child that is `nobody`; returns its first report. */
struct held {
        pid_t pid;
        int fd;
};

static struct child_result hold_as_nobody(const struct h_daemon *d, enum child_action act,
                                          struct held *h)
{
        struct child_result r;
        int pipefd[2];

        memset(&r, 0, sizeof(r));
        ck_assert_int_eq(pipe(pipefd), 0);
        fflush(stdout);
        fflush(stderr);
        h->pid = fork();
        ck_assert_int_ge(h->pid, 0);
        if (h->pid == 0) {
                close(pipefd[0]);
                hold_fd = pipefd[1];
                child_body(d, act, &r);
                (void)!write(pipefd[1], &r, sizeof(r));
                _exit(1);
        }
        close(pipefd[1]);
        h->fd = pipefd[0];
        ck_assert_int_eq(read(h->fd, &r, sizeof(r)), (ssize_t)sizeof(r));
        ck_assert_msg(r.done, "the child failed: %s", r.message);
        return r;
}

/* The hold's second report (the connection ended), or a failure after timeout_ms. */
static struct child_result held_end(struct held *h, int timeout_ms)
{
        struct pollfd pfd = { .fd = h->fd, .events = POLLIN };
        struct child_result r;
        int status;

        memset(&r, 0, sizeof(r));
        ck_assert_msg(poll(&pfd, 1, timeout_ms) == 1, "the held connection still works");
        ck_assert_int_eq(read(h->fd, &r, sizeof(r)), (ssize_t)sizeof(r));
        close(h->fd);
        ck_assert_int_eq(waitpid(h->pid, &status, 0), h->pid);
        return r;
}

static void held_kill(struct held *h)
{
        int status;

        kill(h->pid, SIGKILL);
        ck_assert_int_eq(waitpid(h->pid, &status, 0), h->pid);
        close(h->fd);
}

/* ---- daemon ---- */

struct auth_daemon {
        struct h_daemon d;
        char config[64];
};

static void config_write(struct auth_daemon *ad, const char *text)
{
        char tmp[80];
        FILE *f;

        snprintf(tmp, sizeof(tmp), "%s.new", ad->config);
        f = fopen(tmp, "w");
        ck_assert_ptr_nonnull(f);
        fputs(text, f);
        fclose(f);
        ck_assert_int_eq(rename(tmp, ad->config), 0);
}

/* Starts epd with config_text and extra flags (NULL-terminated, may be NULL); the temporary
 * directory becomes searchable by everyone so the socket's own mode decides who connects. */
static void daemon_start(struct auth_daemon *ad, const char *config_text,
                         const char *const *flags)
{
        const char *extra[16];
        int n = 0, fd;

        snprintf(ad->config, sizeof(ad->config), "/tmp/epd-auth-XXXXXX");
        fd = mkstemp(ad->config);
        ck_assert_int_ge(fd, 0);
        close(fd);
        config_write(ad, config_text);
        extra[n++] = "--config";
        extra[n++] = ad->config;
        for (int i = 0; flags && flags[i] && n < 15; i++)
                extra[n++] = flags[i];
        extra[n] = NULL;
        printf("config:\n%s", config_text);
        fflush(stdout);
        ck_assert_int_eq(h_daemon_start(&ad->d, extra), 0);
        ck_assert_int_eq(chmod(ad->d.dir, 0755), 0);
}

static void daemon_stop_clean(struct auth_daemon *ad)
{
        int rc = h_daemon_stop(&ad->d, 5000);

        unlink(ad->config);
        ck_assert_int_eq(rc, 0);
}

static long long stats_field(const struct h_daemon *d, const char *field)
{
        static char out[256 * 1024];
        const char *args[] = { "--socket", d->socket, "stats", "--json", NULL };
        json_error_t jerr;
        json_t *j;
        long long v;

        ck_assert_int_eq(h_run_tool("epctl", args, out, sizeof(out)), 0);
        j = json_loads(out, 0, &jerr);
        ck_assert_msg(j != NULL, "epctl stats --json: %s", jerr.text);
        ck_assert_msg(json_is_integer(json_object_get(j, field)), "no '%s'", field);
        v = json_integer_value(json_object_get(j, field));
        json_decref(j);
        return v;
}

static struct epd_client *connect_root(const struct h_daemon *d)
{
        struct epd_client *c = h_connect(d, "root");

        ck_assert_ptr_nonnull(c);
        return c;
}

/* ---- socket mode ---- */

START_TEST(test_socket_mode)
{
        const char *mode_0600[] = { "--socket-mode", "0600", NULL };
        const char *mode_0666[] = { "--socket-mode", "0666", NULL };
        struct auth_daemon ad;
        struct child_result r;
        struct epd_client *c;
        struct stat st;

        if (!have_root())
                return;
        daemon_start(&ad, "", mode_0600);
        ck_assert_int_eq(stat(ad.d.socket, &st), 0);
        ck_assert_msg(S_ISSOCK(st.st_mode), "%s is not a socket", ad.d.socket);
        ck_assert_msg((st.st_mode & 07777) == 0600, "socket mode %04o, expected 0600",
                      (unsigned)(st.st_mode & 07777));
        ck_assert_uint_eq(st.st_uid, 0);
        r = as_nobody(&ad.d, ACT_RAW_CONNECT);
        ck_assert_msg(r.rc == EACCES, "nobody's connect(2) to a 0600 socket: %s",
                      r.rc ? strerror(r.rc) : "succeeded");
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_msg(r.rc == EPD_UNAVAILABLE && strstr(r.message, "Permission denied"),
                      "nobody's epd_client_connect to a 0600 socket: %s: %s",
                      epd_status_name(r.rc), r.message);
        /* Root is not affected. */
        c = connect_root(&ad.d);
        epd_client_free(c);
        daemon_stop_clean(&ad);

        /* The mode is what lets the other user in (no allow list configured). */
        daemon_start(&ad, "[daemon]\nsocket_mode = 0600\n", mode_0666); /* the flag wins */
        ck_assert_int_eq(stat(ad.d.socket, &st), 0);
        ck_assert_msg((st.st_mode & 07777) == 0666, "socket mode %04o, expected 0666",
                      (unsigned)(st.st_mode & 07777));
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_msg(r.rc == EPD_OK, "nobody's connect to a 0666 socket: %s: %s",
                      epd_status_name(r.rc), r.message);
        daemon_stop_clean(&ad);
}
END_TEST

/* ---- allow lists ---- */

START_TEST(test_allow_uids)
{
        const char *mode_0666[] = { "--socket-mode", "0666", NULL };
        struct auth_daemon ad;
        struct child_result r;
        struct epd_client *c;
        char text[256];

        if (!have_root())
                return;
        daemon_start(&ad, "[daemon]\nallow_uids = 0\n", mode_0666);
        for (int i = 0; i < 5; i++) {
                r = as_nobody(&ad.d, ACT_CONNECT);
                ck_assert_msg(r.rc == EPD_PERMISSION_DENIED,
                              "nobody with allow_uids = 0 (attempt %d): %s: %s", i,
                              epd_status_name(r.rc), r.message);
                ck_assert_msg(strstr(r.message, "allow list"),
                              "the refusal does not mention the allow list: '%s'", r.message);
        }
        ck_assert_int_ge(stats_field(&ad.d, "clients_refused"), 5);
        c = connect_root(&ad.d);
        epd_client_free(c);
        daemon_stop_clean(&ad);

        /* nobody's uid on the list. */
        snprintf(text, sizeof(text), "[daemon]\nallow_uids = 0, %u\n", (unsigned)nobody_uid);
        daemon_start(&ad, text, mode_0666);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_msg(r.rc == EPD_OK, "nobody with its uid allowed: %s: %s",
                      epd_status_name(r.rc), r.message);
        daemon_stop_clean(&ad);

        /* Root is always allowed, even by a list that does not name it. */
        snprintf(text, sizeof(text), "[daemon]\nallow_uids = %u\n", (unsigned)nobody_uid + 1);
        daemon_start(&ad, text, mode_0666);
        c = connect_root(&ad.d);
        epd_client_free(c);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_int_eq(r.rc, EPD_PERMISSION_DENIED);
        daemon_stop_clean(&ad);
}
END_TEST

START_TEST(test_allow_gids)
{
        const char *mode_0666[] = { "--socket-mode", "0666", NULL };
        struct auth_daemon ad;
        struct child_result r;
        char text[256];

        if (!have_root())
                return;
        /* A uid list that excludes nobody, and a gid list that names its primary group. */
        snprintf(text, sizeof(text), "[daemon]\nallow_uids = 0\nallow_gids = %u\n",
                 (unsigned)nobody_gid);
        daemon_start(&ad, text, mode_0666);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_msg(r.rc == EPD_OK, "nobody with its gid %u allowed: %s: %s",
                      (unsigned)nobody_gid, epd_status_name(r.rc), r.message);
        daemon_stop_clean(&ad);

        /* A gid list alone that does not name it. */
        snprintf(text, sizeof(text), "[daemon]\nallow_gids = %u\n", (unsigned)nobody_gid + 1);
        daemon_start(&ad, text, mode_0666);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_msg(r.rc == EPD_PERMISSION_DENIED, "nobody with another gid allowed: %s: %s",
                      epd_status_name(r.rc), r.message);
        daemon_stop_clean(&ad);
}
END_TEST

/* The allow lists are hot keys: SIGHUP applies them to new connections. */
START_TEST(test_allow_reload)
{
        const char *mode_0666[] = { "--socket-mode", "0666", NULL };
        struct auth_daemon ad;
        struct child_result r;
        struct held held;
        char text[256];
        long long deadline;

        if (!have_root())
                return;
        daemon_start(&ad, "[daemon]\nallow_uids = 0\n", mode_0666);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_int_eq(r.rc, EPD_PERMISSION_DENIED);
        snprintf(text, sizeof(text), "[daemon]\nallow_uids = 0\nallow_gids = %u\n",
                 (unsigned)nobody_gid);
        config_write(&ad, text);
        ck_assert_int_eq(kill(ad.d.pid, SIGHUP), 0);
        deadline = h_now_ms() + 3000;
        do {
                usleep(20000);
                r = as_nobody(&ad.d, ACT_CONNECT);
        } while (r.rc != EPD_OK && h_now_ms() < deadline);
        ck_assert_msg(r.rc == EPD_OK, "nobody still refused after the reload: %s: %s",
                      epd_status_name(r.rc), r.message);
        /* An open connection of nobody's, which the next reload must end. */
        r = hold_as_nobody(&ad.d, ACT_CONNECT_HOLD, &held);
        ck_assert_int_eq(r.rc, EPD_OK);
        config_write(&ad, "[daemon]\nallow_uids = 0\n");
        ck_assert_int_eq(kill(ad.d.pid, SIGHUP), 0);
        deadline = h_now_ms() + 3000;
        do {
                usleep(20000);
                r = as_nobody(&ad.d, ACT_CONNECT);
        } while (r.rc == EPD_OK && h_now_ms() < deadline);
        ck_assert_msg(r.rc == EPD_PERMISSION_DENIED, "nobody still admitted after the reload: %s",
                      epd_status_name(r.rc));
        r = held_end(&held, 3000);
        ck_assert_msg(r.rc != EPD_OK, "nobody's open connection survived its removal");
        ck_assert(h_daemon_log_contains(&ad.d, "no longer allowed"));
        daemon_stop_clean(&ad);
}
END_TEST

/* ---- admin rights ---- */

START_TEST(test_admin_capability)
{
        const char *mode_0666[] = { "--socket-mode", "0666", NULL };
        struct auth_daemon ad;
        struct child_result r;
        struct epd_client *c;
        char text[256];

        if (!have_root())
                return;
        daemon_start(&ad, "", mode_0666);
        c = connect_root(&ad.d);
        ck_assert_msg(epd_client_capabilities(c) & EPD_CAP_ADMIN, "root lacks CAP_ADMIN (0x%llx)",
                      (unsigned long long)epd_client_capabilities(c));
        ck_assert(epd_client_capabilities(c) & EPD_CAP_HOST_REGIONS);
        epd_client_free(c);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_int_eq(r.rc, EPD_OK);
        ck_assert_msg(!(r.caps & EPD_CAP_ADMIN), "nobody got CAP_ADMIN (0x%llx)",
                      (unsigned long long)r.caps);
        ck_assert(r.caps & EPD_CAP_HOST_REGIONS);
        daemon_stop_clean(&ad);

        /* admin_group grants it to the group's members. */
        snprintf(text, sizeof(text), "[daemon]\nadmin_group = %s\n", nobody_group);
        daemon_start(&ad, text, mode_0666);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_int_eq(r.rc, EPD_OK);
        ck_assert_msg(r.caps & EPD_CAP_ADMIN, "nobody in admin_group %s lacks CAP_ADMIN (0x%llx)",
                      nobody_group, (unsigned long long)r.caps);
        daemon_stop_clean(&ad);

        /* An admin_group that names another group does not. */
        daemon_start(&ad, "[daemon]\nadmin_group = root\n", mode_0666);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_int_eq(r.rc, EPD_OK);
        ck_assert(!(r.caps & EPD_CAP_ADMIN));
        daemon_stop_clean(&ad);
}
END_TEST

/* ---- group secrets across users ---- */

/* A daemon whose socket anyone may use, and root's group "shared" (secret h_secret("shared")). */
static struct epd_group *root_creates_shared(struct auth_daemon *ad, struct epd_client **c)
{
        const char *mode_0666[] = { "--socket-mode", "0666", NULL };
        struct epd_group_config cfg = small_group();
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = "shared", .secret = secret,
                                     .secret_len = sizeof(secret), .rank = 0, .config = &cfg };
        struct epd_group *g = NULL;

        daemon_start(ad, "", mode_0666);
        *c = connect_root(&ad->d);
        h_secret("shared", secret);
        ck_assert_int_eq(epd_group_create(*c, &ga, &g), EPD_OK);
        return g;
}

START_TEST(test_secret_across_users)
{
        struct auth_daemon ad;
        struct child_result r;
        struct epd_client *c;
        struct epd_group *g;

        if (!have_root())
                return;
        g = root_creates_shared(&ad, &c);
        r = as_nobody(&ad.d, ACT_JOIN_WRONG);
        ck_assert_msg(r.rc == EPD_PERMISSION_DENIED, "nobody with a wrong secret: %s: %s",
                      epd_status_name(r.rc), r.message);
        r = as_nobody(&ad.d, ACT_JOIN);
        ck_assert_msg(r.rc == EPD_OK, "nobody with the secret: %s: %s", epd_status_name(r.rc),
                      r.message);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(c);
        daemon_stop_clean(&ad);
}
END_TEST

/* ---- group names per uid, and guessing secrets ---- */

START_TEST(test_names_per_uid)
{
        const char *mode_0666[] = { "--socket-mode", "0666", NULL };
        struct epd_group_config cfg = small_group();
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = "shared", .secret = secret,
                                     .secret_len = sizeof(secret), .rank = 0, .config = &cfg };
        struct auth_daemon ad;
        struct child_result r;
        struct epd_client *c, *c1;
        struct epd_group *g, *g1;
        struct held squatter;
        int rc;

        if (!have_root())
                return;
        daemon_start(&ad, "", mode_0666);
        /* nobody takes the name first. */
        r = hold_as_nobody(&ad.d, ACT_CREATE_HOLD, &squatter);
        ck_assert_msg(r.rc == EPD_OK, "nobody's create: %s: %s", epd_status_name(r.rc),
                      r.message);
        /* root's create of the same name is root's own group. */
        c = connect_root(&ad.d);
        h_secret("shared", secret);
        rc = epd_group_create(c, &ga, &g);
        ck_assert_msg(rc == EPD_OK, "root's create beside nobody's group: %s: %s",
                      epd_status_name(rc), epd_client_last_error(c));
        /* A second create by the same uid is refused. */
        c1 = connect_root(&ad.d);
        ck_assert_int_eq(epd_group_create(c1, &ga, &g1), EPD_ALREADY_EXISTS);
        /* A root join finds root's group. */
        ga.rank = 1;
        ga.config = NULL;
        ck_assert_int_eq(epd_group_join(c1, &ga, &g1), EPD_OK);
        ck_assert_uint_eq(epd_group_id(g1), epd_group_id(g));
        /* nobody, with root's secret, finds its own group first: wrong secret there. */
        r = as_nobody(&ad.d, ACT_JOIN);
        ck_assert_msg(r.rc == EPD_PERMISSION_DENIED, "nobody's join: %s: %s",
                      epd_status_name(r.rc), r.message);
        held_kill(&squatter);
        ck_assert_int_eq(epd_group_leave(g1), EPD_OK);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(c1);
        epd_client_free(c);
        daemon_stop_clean(&ad);
}
END_TEST

START_TEST(test_wrong_secrets_close_the_connection)
{
        struct epd_group_config cfg = small_group();
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = "guarded", .secret = secret,
                                     .secret_len = sizeof(secret), .rank = 0, .config = &cfg };
        struct epd_size_hint hint;
        struct auth_daemon ad;
        struct epd_client *owner, *guesser;
        struct epd_group *g, *x = NULL;
        int rc;

        daemon_start(&ad, "", NULL);
        owner = connect_root(&ad.d);
        h_secret("guarded", secret);
        ck_assert_int_eq(epd_group_create(owner, &ga, &g), EPD_OK);
        guesser = connect_root(&ad.d);
        ga.rank = 1;
        ga.config = NULL;
        for (int i = 1; i <= 8; i++) {
                h_secret(i % 2 ? "guess one" : "guess two", secret);
                rc = epd_group_join(guesser, &ga, &x);
                ck_assert_msg(rc == EPD_PERMISSION_DENIED, "guess %d: %s: %s", i,
                              epd_status_name(rc), epd_client_last_error(guesser));
                ck_assert_int_eq(!!strstr(epd_client_last_error(guesser), "closing"), i == 8);
        }
        /* The guesser's connection is gone; the owner's is not. */
        ck_assert_int_ne(epd_size_hint(guesser, &cfg, 1, &hint), EPD_OK);
        ck_assert_int_eq(epd_size_hint(owner, &cfg, 1, &hint), EPD_OK);
        ck_assert(h_daemon_log_contains(&ad.d, "too many wrong group secrets"));
        epd_client_free(guesser);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(owner);
        daemon_stop_clean(&ad);
}
END_TEST

/* A uid that keeps guessing is refused new connections for a while; root is not. */
START_TEST(test_guessing_uid_cools_down)
{
        struct auth_daemon ad;
        struct child_result r;
        struct epd_client *c, *other;
        struct epd_group *g;

        if (!have_root())
                return;
        g = root_creates_shared(&ad, &c);
        r = as_nobody(&ad.d, ACT_GUESS);
        ck_assert_msg(r.rc == EPD_UNAVAILABLE && strstr(r.message, "wrong group secrets"),
                      "nobody's connection after its guesses: %s: %s", epd_status_name(r.rc),
                      r.message);
        ck_assert(h_daemon_log_contains(&ad.d, "gave too many wrong group secrets"));
        /* Another uid (root, an administrator) still connects. */
        other = connect_root(&ad.d);
        ck_assert_ptr_nonnull(other);
        epd_client_free(other);
        /* The first penalty is 250 ms. */
        usleep(400000);
        r = as_nobody(&ad.d, ACT_CONNECT);
        ck_assert_msg(r.rc == EPD_OK, "nobody after the cool-down: %s: %s",
                      epd_status_name(r.rc), r.message);
        ck_assert_int_eq(epd_group_leave(g), EPD_OK);
        epd_client_free(c);
        daemon_stop_clean(&ad);
}
END_TEST

int main(void)
{
        Suite *s = suite_create("auth");
        TCase *tc = tcase_create("auth");
        SRunner *sr;
        int failed;

        tcase_set_timeout(tc, 30);
        tcase_add_test(tc, test_socket_mode);
        tcase_add_test(tc, test_allow_uids);
        tcase_add_test(tc, test_allow_gids);
        tcase_add_test(tc, test_allow_reload);
        tcase_add_test(tc, test_admin_capability);
        tcase_add_test(tc, test_secret_across_users);
        tcase_add_test(tc, test_names_per_uid);
        tcase_add_test(tc, test_wrong_secrets_close_the_connection);
        tcase_add_test(tc, test_guessing_uid_cools_down);
        suite_add_tcase(s, tc);
        sr = srunner_create(s);
        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_ENV);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
