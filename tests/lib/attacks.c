/* attacks.c - see attacks.h. */
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "attacks.h"
#include "epd.h"

#define NOBODY 65534

static const char *const names[ATTACK_COUNT] = {
        "quiet", "stall", "idle-connections", "wrong-secret", "bindings", "regions",
};

const char *attack_name(enum attack a)
{
        return a < ATTACK_COUNT ? names[a] : "?";
}

int attack_parse(const char *name)
{
        for (int i = 0; i < ATTACK_COUNT; i++)
                if (strcmp(name, names[i]) == 0)
                        return i;
        return -1;
}

/* A connection that may be refused; -1 then (no assertion: this runs outside Check). */
static int raw_connect(const struct h_daemon *d)
{
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

        if (fd < 0)
                return -1;
        if (strlen(d->socket) >= sizeof(sa.sun_path)) {
                close(fd);
                return -1;
        }
        memcpy(sa.sun_path, d->socket, strlen(d->socket) + 1);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                close(fd);
                return -1;
        }
        return fd;
}

static void become_nobody(void)
{
        if (geteuid() == 0 && (setgroups(0, NULL) < 0 || setgid(NOBODY) < 0 || setuid(NOBODY) < 0))
                _exit(2);
}

static struct epd_client *connect_as(const struct h_daemon *d, const char *name)
{
        struct epd_connect_args args = { .size = sizeof(args), .socket_path = d->socket,
                                         .client_name = name, .timeout_ms = 5000 };
        struct epd_client *c = NULL;
        char err[256];

        return epd_client_connect(&args, &c, err, sizeof(err)) == EPD_OK ? c : NULL;
}

static struct epd_group_config small_config(uint32_t world_size, uint32_t timeout_ms)
{
        struct epd_group_config cfg = {
                .size = sizeof(cfg), .world_size = world_size, .num_experts = 8, .hidden = 64,
                .max_tokens_per_rank = 16, .max_topk = 2, .dispatch_dtype = EPD_DTYPE_BF16,
                .op_timeout_ms = timeout_ms, .arena_bytes = 1 << 20,
        };
        return cfg;
}

static void ready(int fd)
{
        if (write(fd, "r", 1) != 1)
                _exit(2);
        close(fd);
}

static void stall(const struct h_daemon *d, int ready_fd)
{
        struct epd_group_config cfg = small_config(1, 60000);
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .name = "stall", .secret = secret,
                                     .secret_len = sizeof(secret), .config = &cfg };
        uint64_t xs[2] = { 16, 64 }, ks[2] = { 16, 2 }, region;
        struct epd_dispatch_args da = { .size = sizeof(da), .num_tokens = 16, .use_arena = 1,
                                        .wait_inputs = 1 };
        struct epd_client *c = connect_as(d, "stall");
        struct epd_group *g;
        struct epd_op *op;
        uint8_t *p;

        h_secret("stall", secret);
        if (!c || epd_group_create(c, &ga, &g) != EPD_OK ||
            epd_region_alloc(c, 1 << 16, (void **)&p, &region) != EPD_OK)
                _exit(3);
        memset(p, 0, 1 << 16); /* top-k ids 0: valid experts */
        if (epd_tensor_at(c, p, EPD_DTYPE_BF16, 2, xs, &da.x) != EPD_OK ||
            epd_tensor_at(c, p + 32768, EPD_DTYPE_INT64, 2, ks, &da.topk_idx) != EPD_OK ||
            epd_dispatch_submit(g, &da, &op) != EPD_OK)
                _exit(4);
        ready(ready_fd);
        for (;;)
                pause();
}

static void idle_connections(const struct h_daemon *d, int ready_fd)
{
        int socks[64];
        char byte;

        become_nobody();
        for (int i = 0; i < 64; i++)
                socks[i] = raw_connect(d);
        ready(ready_fd);
        for (;;) {
                for (int i = 0; i < 64; i++) {
                        if (socks[i] >= 0 && recv(socks[i], &byte, 1, MSG_DONTWAIT) < 0 &&
                            errno == EAGAIN)
                                continue; /* still held open by the daemon */
                        if (socks[i] >= 0)
                                close(socks[i]);
                        socks[i] = raw_connect(d);
                }
                usleep(5000);
        }
}

static void wrong_secret(const struct h_daemon *d, const char *victim, int ready_fd)
{
        unsigned char secret[16] = { 0 };
        struct epd_group_args ga = { .size = sizeof(ga), .name = victim, .secret = secret,
                                     .secret_len = sizeof(secret), .rank = 1 };
        int announced = 0;
        uint64_t guess = 0;

        become_nobody();
        for (;;) {
                struct epd_client *c = connect_as(d, "guesser");
                struct epd_group *g;
                if (!announced) {
                        ready(ready_fd);
                        announced = 1;
                }
                if (!c) {
                        usleep(10000);
                        continue;
                }
                /* Until the daemon closes the connection. */
                for (int i = 0; i < 64; i++) {
                        guess++;
                        memcpy(secret, &guess, sizeof(guess));
                        int rc = epd_group_join(c, &ga, &g);
                        if (rc == EPD_OK)
                                _exit(5); /* guessed: the test must notice */
                        if (rc != EPD_PERMISSION_DENIED && rc != EPD_NOT_FOUND)
                                break;
                }
                epd_client_free(c);
        }
}

static void bindings(const struct h_daemon *d, int ready_fd)
{
        struct epd_group_config cfg = small_config(64, 1000);
        unsigned char secret[16];
        struct epd_group_args ga = { .size = sizeof(ga), .secret = secret,
                                     .secret_len = sizeof(secret), .config = &cfg };
        struct epd_client *c[16] = { NULL };
        char name[32];
        unsigned n = 0;

        become_nobody();
        h_secret("bindings", secret);
        for (int k = 0; k < 16; k++)
                c[k] = connect_as(d, "binder");
        /* Groups of 64 ranks, every rank bound by one of 16 clients, until refused. */
        for (int k = 0; k < 16 && c[k]; k++) {
                struct epd_group *g;
                snprintf(name, sizeof(name), "hog%u", n++);
                ga.name = name;
                ga.rank = 0;
                ga.config = &cfg;
                if (epd_group_create(c[k], &ga, &g) != EPD_OK)
                        continue;
                ga.config = NULL;
                for (uint32_t r = 1; r < 64; r++) {
                        ga.rank = r;
                        if (epd_group_join(c[(k + r) % 16] ? c[(k + r) % 16] : c[k], &ga, &g) !=
                            EPD_OK)
                                break;
                }
        }
        ready(ready_fd);
        for (;;)
                pause();
}

static void regions(const struct h_daemon *d, int ready_fd)
{
        struct epd_client *c[8];
        uint64_t id;
        void *p;

        become_nobody();
        for (int k = 0; k < 8; k++) {
                c[k] = connect_as(d, "hoarder");
                while (c[k] && epd_region_alloc(c[k], 4096, &p, &id) == EPD_OK)
                        ;
        }
        ready(ready_fd);
        for (;;)
                pause();
}

int attack_start(struct attack_run *r, enum attack a, const struct h_daemon *d,
                 const char *victim_group)
{
        int pipefd[2];
        char byte;

        r->kind = a;
        r->pid = 0;
        r->ready_fd = -1;
        if (a == ATTACK_NONE)
                return 0;
        if (pipe(pipefd) < 0)
                return -1;
        fflush(stdout);
        fflush(stderr);
        r->pid = fork();
        if (r->pid < 0)
                return -1;
        if (r->pid == 0) {
                close(pipefd[0]);
                switch (a) {
                case ATTACK_STALL: stall(d, pipefd[1]); break;
                case ATTACK_IDLE: idle_connections(d, pipefd[1]); break;
                case ATTACK_WRONG_SECRET: wrong_secret(d, victim_group, pipefd[1]); break;
                case ATTACK_BINDINGS: bindings(d, pipefd[1]); break;
                case ATTACK_REGIONS: regions(d, pipefd[1]); break;
                default: break;
                }
                _exit(1);
        }
        close(pipefd[1]);
        r->ready_fd = pipefd[0];
        if (read(r->ready_fd, &byte, 1) != 1) {
                attack_stop(r);
                return -1;
        }
        return 0;
}

int attack_active(const struct attack_run *r)
{
        int status;

        return r->pid == 0 || waitpid(r->pid, &status, WNOHANG) == 0;
}

void attack_stop(struct attack_run *r)
{
        int status;

        if (r->pid > 0) {
                kill(r->pid, SIGKILL);
                waitpid(r->pid, &status, 0);
        }
        if (r->ready_fd >= 0)
                close(r->ready_fd);
        r->pid = 0;
        r->ready_fd = -1;
}
