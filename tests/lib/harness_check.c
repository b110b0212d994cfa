/* harness_check.c - integration-test helpers shared by several tests that assert with Check (a
 * failed check fails the calling test) or parse JSON with jansson: raw protocol frames on a
 * hand-made connection, epctl --json, and small checks on the daemon process. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epd.h"
#include "epd.pb-c.h"
#include "frame.h"
#include "harness.h"
#include "util.h"

int h_run_suite(Suite *s)
{
        SRunner *sr = srunner_create(s);
        int failed;

        /* Fork mode: each test is its own process, and Check kills the test's process group
         * afterwards, so a daemon left behind by a failed assertion does not outlive it. */
        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY=verbose lists every test */
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

struct epd_client *h_connect_ok(const struct h_daemon *d, const char *name)
{
        struct epd_client *c = h_connect(d, name);

        ck_assert_msg(c != NULL, "cannot connect %s", name);
        return c;
}

void h_assert_daemon_alive(const struct h_daemon *d, const char *context)
{
        int status;

        ck_assert_msg(waitpid(d->pid, &status, WNOHANG) == 0, "the daemon exited (status %d)%s",
                      status, context ? context : "");
}

int h_daemon_region_mappings(const struct h_daemon *d)
{
        int n = h_proc_region_mappings(d->pid);

        ck_assert_msg(n >= 0, "cannot read /proc/%d/maps", (int)d->pid);
        return n;
}

json_t *h_epctl_json(const struct h_daemon *d, const char *command)
{
        static char out[256 * 1024];
        const char *args[] = { "--socket", d->socket, command, "--json", NULL };
        json_error_t jerr;
        json_t *j;
        int rc = h_run_tool("epctl", args, out, sizeof(out));

        ck_assert_msg(rc == 0, "epctl %s exited with %d", command, rc);
        j = json_loads(out, 0, &jerr);
        ck_assert_msg(j != NULL, "epctl %s --json printed invalid JSON: %s", command, jerr.text);
        return j;
}

int h_raw_connect(const struct h_daemon *d)
{
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

        ck_assert_int_ge(fd, 0);
        ck_assert_uint_lt(strlen(d->socket), sizeof(sa.sun_path));
        memcpy(sa.sun_path, d->socket, strlen(d->socket) + 1);
        ck_assert_msg(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect: %s",
                      strerror(errno));
        return fd;
}

struct epd_frame_header h_good_header(size_t body_len, unsigned num_fds)
{
        struct epd_frame_header h = {
                .magic = EPD_FRAME_MAGIC,
                .version = EPD_PROTOCOL_VERSION,
                .num_fds = (uint16_t)num_fds,
                .length = (uint32_t)body_len,
        };
        return h;
}

int h_raw_send(int sock, const struct epd_frame_header *h, const void *body, size_t body_len,
               const int *fds, unsigned num_fds, int flags)
{
        uint8_t header[EPD_FRAME_HEADER_BYTES];
        union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * H_RAW_MAX_FDS)];
        } control;
        struct iovec iov[2] = {
                { .iov_base = header, .iov_len = sizeof(header) },
                { .iov_base = (void *)body, .iov_len = body_len },
        };
        struct msghdr msg = { .msg_iov = iov, .msg_iovlen = body_len ? 2 : 1 };

        ck_assert_uint_le(num_fds, H_RAW_MAX_FDS);
        epd_frame_header_encode(h, header);
        if (num_fds) {
                struct cmsghdr *cmsg;

                memset(&control, 0, sizeof(control));
                msg.msg_control = control.buf;
                msg.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
                cmsg = CMSG_FIRSTHDR(&msg);
                cmsg->cmsg_level = SOL_SOCKET;
                cmsg->cmsg_type = SCM_RIGHTS;
                cmsg->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
                memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * num_fds);
        }
        if (sendmsg(sock, &msg, MSG_NOSIGNAL | flags) < 0)
                return -errno;
        return 0;
}

int h_raw_recv(int sock, int timeout_ms, Epd__V1__Response **out)
{
        static uint8_t buf[EPD_FRAME_HEADER_BYTES + H_RAW_MAX_BODY + 1];
        union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * EPD_FRAME_MAX_FDS)];
        } control;
        struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) };
        struct msghdr msg = {
                .msg_iov = &iov,
                .msg_iovlen = 1,
                .msg_control = control.buf,
                .msg_controllen = sizeof(control.buf),
        };
        struct pollfd pfd = { .fd = sock, .events = POLLIN };
        struct epd_frame_header h;
        struct cmsghdr *cmsg;
        const char *why = NULL;
        unsigned num_fds = 0;
        ssize_t n;
        int rc;

        rc = poll(&pfd, 1, timeout_ms);
        ck_assert_int_ge(rc, 0);
        if (rc == 0)
                return -1;
        n = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        /* ECONNRESET (the daemon closed with our frames unread) is reported once and clears
         * sk_err; replies it queued before closing can still be read after it. */
        if (n < 0 && errno == ECONNRESET)
                n = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0 && (errno == ECONNRESET || errno == EAGAIN))
                return 0;
        ck_assert_msg(n >= 0, "recvmsg: %s", strerror(errno));
        for (cmsg = CMSG_FIRSTHDR(&msg); cmsg; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
                if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS)
                        continue;
                for (size_t i = 0; i < (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
                        int fd;
                        memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(fd));
                        close(fd);
                        num_fds++;
                }
        }
        if (n == 0 && num_fds == 0)
                return 0;
        rc = epd_frame_header_check(buf, (size_t)n, H_RAW_MAX_BODY, num_fds, &h, &why);
        ck_assert_msg(rc == 0, "the daemon sent a malformed frame: %s", why);
        *out = epd__v1__response__unpack(NULL, h.length, buf + EPD_FRAME_HEADER_BYTES);
        ck_assert_msg(*out != NULL, "the daemon sent an undecodable Response");
        return 1;
}

void h_expect_closed(int sock, struct h_close_result *out)
{
        long long deadline = h_now_ms() + 2000;

        memset(out, 0, sizeof(*out));
        out->status = EPD_OK;
        for (;;) {
                Epd__V1__Response *resp = NULL;
                long long left = deadline - h_now_ms();
                int rc = h_raw_recv(sock, left > 0 ? (int)left : 0, &resp);

                ck_assert_msg(rc >= 0, "the daemon did not close the connection within 2 s");
                if (rc == 0)
                        return;
                out->replies++;
                if (resp->status != EPD__V1__STATUS_CODE__OK) {
                        out->errors++;
                        out->status = epd__status_from_wire(resp->status);
                        out->id = resp->id;
                        snprintf(out->message, sizeof(out->message), "%s",
                                 resp->message ? resp->message : "");
                }
                epd__v1__response__free_unpacked(resp, NULL);
        }
}

void h_expect_pipe_eof(int read_end)
{
        struct pollfd pfd = { .fd = read_end, .events = POLLIN };
        char c;

        ck_assert_msg(poll(&pfd, 1, 2000) == 1,
                      "the daemon still holds an fd it received on a refused frame");
        ck_assert_int_eq(read(read_end, &c, 1), 0);
}
