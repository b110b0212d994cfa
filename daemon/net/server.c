/* server.c - the listening Unix socket (SOCK_SEQPACKET): created from config, or inherited
 * through systemd socket activation; accepting connections and checking peer credentials.
 * Loop thread only. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "admission.h"
#include "net.h"
#include "frame.h"
#include "log.h"

static void on_listen_readable(uv_poll_t *handle, int status, int events)
{
        struct epdd_daemon *d = handle->data;

        (void)events;
        if (status < 0)
                return;
        /* A few at a time: a client that opens connections in bursts then delays the other
         * clients' requests by the cost of a few accepts, not of its whole burst. */
        for (int i = 0; i < 8; i++) {
                int fd = accept4(d->net->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) {
                        if (errno != EAGAIN && errno != EINTR)
                                epd_admission_accept_failed(d, errno);
                        return;
                }
                epd_admission_accepted(d);
                epd_conn_accept(d, fd);
        }
}

/* A stale socket file from a crashed daemon is removed; a live one (someone accepts) is not. */
static int remove_stale_socket(const char *path)
{
        struct stat st;
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd, rc;

        if (lstat(path, &st) < 0)
                return errno == ENOENT ? 0 : -errno;
        if (!S_ISSOCK(st.st_mode))
                return -EEXIST;
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return -errno;
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
        close(fd);
        if (rc == 0)
                return -EADDRINUSE;
        return unlink(path) < 0 ? -errno : 0;
}

int epd_server_listen(struct epdd_daemon *d, char *err, size_t err_len)
{
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int n = sd_listen_fds(1);
        int fd = -1, rc;

        if (n > 1) {
                snprintf(err, err_len, "socket activation passed %d sockets; expected 1", n);
                return -EINVAL;
        }
        if (n == 1) {
                fd = SD_LISTEN_FDS_START;
                if (sd_is_socket_unix(fd, SOCK_SEQPACKET, 1, NULL, 0) <= 0) {
                        snprintf(err, err_len, "activated socket is not a listening SOCK_SEQPACKET Unix socket (use ListenSequentialPacket=)");
                        return -EINVAL;
                }
                if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0 ||
                    fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
                        snprintf(err, err_len, "cannot set activated socket non-blocking");
                        return -EINVAL;
                }
                d->net->listen_fd_activated = 1;
                log_info("using activated socket fd=%d", fd);
        } else {
                if (strlen(d->cfg.socket_path) >= sizeof(sa.sun_path)) {
                        snprintf(err, err_len, "socket path too long: %s", d->cfg.socket_path);
                        return -ENAMETOOLONG;
                }
                snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d->cfg.socket_path);
                rc = remove_stale_socket(sa.sun_path);
                if (rc < 0) {
                        snprintf(err, err_len, "socket %s: %s", sa.sun_path,
                                 rc == -EADDRINUSE ? "another daemon is serving it"
                                                   : strerror(-rc));
                        return rc;
                }
                fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
                if (fd < 0)
                        goto sys_fail;
                /* Create the socket file with no access, then set the configured mode, so no
                 * one connects in between with wider rights. */
                mode_t old = umask(0777);
                rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
                umask(old);
                if (rc < 0)
                        goto sys_fail;
                if (d->cfg.socket_group[0]) {
                        struct group *gr = getgrnam(d->cfg.socket_group);
                        if (!gr || chown(sa.sun_path, (uid_t)-1, gr->gr_gid) < 0) {
                                snprintf(err, err_len, "cannot give socket to group '%s'",
                                         d->cfg.socket_group);
                                close(fd);
                                unlink(sa.sun_path);
                                return -EINVAL;
                        }
                }
                if (chmod(sa.sun_path, d->cfg.socket_mode) < 0)
                        goto sys_fail;
                if (listen(fd, 128) < 0)
                        goto sys_fail;
        }
        d->net->listen_fd = fd;
        uv_poll_init(d->loop, &d->net->listen_poll, fd);
        d->net->listen_poll.data = d;
        uv_poll_start(&d->net->listen_poll, UV_READABLE, on_listen_readable);
        return 0;
sys_fail:
        rc = -errno;
        snprintf(err, err_len, "socket %s: %s", d->cfg.socket_path, strerror(errno));
        if (fd >= 0)
                close(fd);
        return rc;
}

void epd_server_pause(struct epdd_daemon *d)
{
        if (d->net->listen_fd >= 0)
                uv_poll_stop(&d->net->listen_poll);
}

void epd_server_resume(struct epdd_daemon *d)
{
        if (d->net->listen_fd >= 0 && !d->shutting_down)
                uv_poll_start(&d->net->listen_poll, UV_READABLE, on_listen_readable);
}

void epd_server_close(struct epdd_daemon *d)
{
        if (d->net->listen_fd < 0)
                return;
        uv_poll_stop(&d->net->listen_poll);
        uv_close((uv_handle_t *)&d->net->listen_poll, NULL);
        if (!d->net->listen_fd_activated) {
                close(d->net->listen_fd);
                unlink(d->cfg.socket_path);
        }
        d->net->listen_fd = -1;
}

static int in_list(const uint32_t *ids, unsigned n, uint32_t id)
{
        for (unsigned i = 0; i < n; i++)
                if (ids[i] == id)
                        return 1;
        return 0;
}

int epd_conn_is_allowed(const struct epdd_daemon *d, uid_t uid, gid_t gid)
{
        if (uid == 0)
                return 1;
        if (d->cfg.num_allow_uids == 0 && d->cfg.num_allow_gids == 0)
                return 1;
        return in_list(d->cfg.allow_uids, d->cfg.num_allow_uids, uid) ||
               in_list(d->cfg.allow_gids, d->cfg.num_allow_gids, gid);
}

int epd_conn_is_admin(const struct epdd_daemon *d, uid_t uid, gid_t gid)
{
        if (uid == 0)
                return 1;
        if (d->cfg.admin_group[0]) {
                struct group *gr = getgrnam(d->cfg.admin_group);
                if (gr && gr->gr_gid == gid)
                        return 1;
        }
        return 0;
}

int epd_net_init(struct epdd_daemon *d, char *err, size_t err_len)
{
        struct epdd_net *n = calloc(1, sizeof(*n));

        if (n)
                n->rbuf_len = EPD_FRAME_HEADER_BYTES + d->cfg.max_frame_bytes + 1;
        if (!n || !(n->rbuf = malloc(n->rbuf_len))) {
                free(n);
                snprintf(err, err_len, "out of memory");
                return EPD_INTERNAL;
        }
        n->listen_fd = -1;
        d->net = n;
        return 0;
}

void epd_net_free(struct epdd_daemon *d)
{
        if (!d->net)
                return;
        free(d->net->rbuf);
        free(d->net);
        d->net = NULL;
}

void epd_conn_close_disallowed(struct epdd_daemon *d)
{
        struct epd_list *pos, *tmp;

        epd_list_for_each_safe(pos, tmp, &d->conns)
        {
                struct epdd_conn *c = epd_conn_of(epd_list_entry(pos, struct epdd_client, link));
                if (!epd_conn_is_allowed(d, c->cl.uid, c->cl.gid))
                        epd_conn_close(c, "no longer allowed by the allow list");
        }
}
