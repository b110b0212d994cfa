/* fuzz_frame.c - libFuzzer target: the frame header check and epd_frame_recv (common/frame.c).
 *
 * The whole input is first given to epd_frame_header_check as a record. Then it is read as
 *
 *   u8 max_fds (% 18), u16 max_body (% 4096), then records: u8 fds (% 24), u16 len, bytes
 *
 * and each record is sent on a SOCK_SEQPACKET socketpair with that many fds (memfds, up to more
 * than EPD_FRAME_MAX_FDS, so the kernel truncates) and received with epd_frame_recv into a
 * buffer of exactly the documented size. Every result is checked against the record sent: an
 * accepted frame has the header it was sent with, its body, and only valid close-on-exec fds;
 * a refused one has a reason and no fds. At the end of each run the number of open fds must be
 * what it was before (abort otherwise).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "frame.h"

#define MAX_SEND_FDS 24

static void fail(const char *what)
{
        fprintf(stderr, "fuzz_frame: %s\n", what);
        abort();
}

static unsigned count_open_fds(void)
{
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *de;
        unsigned n = 0;

        if (!dir)
                fail("cannot open /proc/self/fd");
        while ((de = readdir(dir)) != NULL)
                if (de->d_name[0] != '.')
                        n++;
        closedir(dir);
        return n - 1;
}

static uint32_t le32(const uint8_t *p)
{
        return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
               ((uint32_t)p[3] << 24);
}

/* What epd_frame_header_check must decide, written out independently. */
static int expect_header(const uint8_t *data, size_t len, uint32_t max_body, unsigned fds)
{
        if (len < EPD_FRAME_HEADER_BYTES || le32(data) != EPD_FRAME_MAGIC || le32(data + 12))
                return -EPROTO;
        if (le32(data + 8) > max_body)
                return -EMSGSIZE;
        if (le32(data + 8) != len - EPD_FRAME_HEADER_BYTES)
                return -EPROTO;
        if ((unsigned)(data[6] | (data[7] << 8)) != fds)
                return -EPROTO;
        return 0;
}

static void check_header(const uint8_t *data, size_t len, uint32_t max_body, unsigned fds)
{
        struct epd_frame_header h;
        const char *why = NULL;
        int rc = epd_frame_header_check(data, len, max_body, fds, &h, &why);

        if (rc != expect_header(data, len, max_body, fds))
                fail("epd_frame_header_check disagrees with the header rules");
        if (rc < 0) {
                if (!why)
                        fail("a refused header has no reason");
                return;
        }
        /* Encoding the decoded header gives the bytes back. */
        uint8_t again[EPD_FRAME_HEADER_BYTES];
        epd_frame_header_encode(&h, again);
        if (memcmp(again, data, sizeof(again)) != 0)
                fail("header encode(decode(x)) != x");
}

static void send_with_fds(int sock, const uint8_t *data, size_t len, unsigned num_fds)
{
        union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * MAX_SEND_FDS)];
        } control;
        struct iovec iov = { .iov_base = (void *)data, .iov_len = len };
        struct msghdr msg;
        int fds[MAX_SEND_FDS];

        for (unsigned i = 0; i < num_fds; i++) {
                fds[i] = memfd_create("fuzz-frame", MFD_CLOEXEC);
                if (fds[i] < 0)
                        fail("memfd_create failed");
        }
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
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
        if (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0)
                fail("sendmsg failed");
        for (unsigned i = 0; i < num_fds; i++)
                close(fds[i]);
}

static void check_recv(int rx, uint8_t *buf, size_t buf_len, uint32_t max_body,
                       unsigned max_fds, const uint8_t *sent, size_t sent_len,
                       unsigned sent_fds)
{
        struct epd_frame frame;
        const char *why = NULL;
        int rc = epd_frame_recv(rx, buf, buf_len, max_body, max_fds, &frame, &why);

        if (rc == -ECONNRESET) {
                /* A record with neither bytes nor fds reads as end of stream. */
                if (sent_len != 0 || sent_fds != 0)
                        fail("end of stream reported for a record that carried something");
                return;
        }
        if (rc == -EAGAIN)
                fail("the record sent was not received");
        if (rc < 0) {
                if (rc != -EPROTO && rc != -EMSGSIZE)
                        fail("unexpected error from epd_frame_recv");
                if (!why)
                        fail("a refused frame has no reason");
                if (frame.num_fds != 0)
                        fail("a refused frame still holds fds");
                /* Only records that pass every rule may be accepted. */
                if (sent_fds <= max_fds && sent_fds <= EPD_FRAME_MAX_FDS &&
                    sent_len <= buf_len && expect_header(sent, sent_len, max_body, sent_fds) == 0)
                        fail("a valid record was refused");
                return;
        }
        if (sent_fds > max_fds || sent_fds > EPD_FRAME_MAX_FDS)
                fail("a frame with more fds than allowed was accepted");
        if (expect_header(sent, sent_len, max_body, sent_fds) != 0)
                fail("an invalid record was accepted");
        if (frame.body != buf + EPD_FRAME_HEADER_BYTES || frame.body_len != frame.header.length ||
            frame.body_len != sent_len - EPD_FRAME_HEADER_BYTES ||
            memcmp(frame.body, sent + EPD_FRAME_HEADER_BYTES, frame.body_len) != 0)
                fail("the frame body is not the body sent");
        if (frame.num_fds != sent_fds || frame.header.num_fds != sent_fds)
                fail("the frame does not hold the fds sent");
        for (unsigned i = 0; i < frame.num_fds; i++) {
                int flags = fcntl(frame.fds[i], F_GETFD);
                if (flags < 0 || !(flags & FD_CLOEXEC))
                        fail("a received fd is invalid or not close-on-exec");
        }
        /* Take one fd out as a handler does; the rest go with the frame. */
        if (frame.num_fds) {
                int fd = epd_frame_take_fd(&frame, sent_len % frame.num_fds);
                if (fd < 0 || epd_frame_take_fd(&frame, sent_len % frame.num_fds) != -1)
                        fail("epd_frame_take_fd");
                close(fd);
        }
        if (epd_frame_take_fd(&frame, frame.num_fds) != -1)
                fail("epd_frame_take_fd past the end");
        epd_frame_close_fds(&frame);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
        unsigned fds_before = count_open_fds();
        int sv[2];

        check_header(data, size, EPD_DEFAULT_MAX_FRAME_BYTES, 0);
        if (size >= 8)
                check_header(data, size, EPD_DEFAULT_MAX_FRAME_BYTES,
                             (unsigned)(data[6] | (data[7] << 8)));
        if (size < 3)
                return 0;

        unsigned max_fds = data[0] % (EPD_FRAME_MAX_FDS + 2);
        uint32_t max_body = (uint32_t)(data[1] | (data[2] << 8)) % 4096;
        size_t buf_len = EPD_FRAME_HEADER_BYTES + max_body + 1;
        uint8_t *buf = malloc(buf_len);
        size_t pos = 3;

        if (!buf)
                fail("out of memory");
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
                fail("socketpair failed");
        while (pos + 3 <= size) {
                unsigned num_fds = data[pos] % (MAX_SEND_FDS + 1);
                size_t len = (size_t)(data[pos + 1] | (data[pos + 2] << 8));
                pos += 3;
                if (len > size - pos)
                        len = size - pos;
                send_with_fds(sv[0], data + pos, len, num_fds);
                check_recv(sv[1], buf, buf_len, max_body, max_fds, data + pos, len, num_fds);
                pos += len;
        }
        /* Nothing is left: an empty non-blocking socket says so. */
        {
                struct epd_frame frame;
                const char *why = NULL;
                if (epd_frame_recv(sv[1], buf, buf_len, max_body, max_fds, &frame, &why) != -EAGAIN)
                        fail("a record appeared that was never sent");
        }
        close(sv[0]);
        close(sv[1]);
        free(buf);
        if (count_open_fds() != fds_before)
                fail("fd leak");
        return 0;
}
