/* frame.c - frame header coding and SCM_RIGHTS send/receive on SOCK_SEQPACKET sockets. */
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "frame.h"

static void put_u16(uint8_t *p, uint16_t v)
{
        p[0] = (uint8_t)v;
        p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v)
{
        for (int i = 0; i < 4; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_u16(const uint8_t *p)
{
        return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get_u32(const uint8_t *p)
{
        return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
               ((uint32_t)p[3] << 24);
}

void epd_frame_header_encode(const struct epd_frame_header *header, uint8_t *out)
{
        put_u32(out, header->magic);
        put_u16(out + 4, header->version);
        put_u16(out + 6, header->num_fds);
        put_u32(out + 8, header->length);
        put_u32(out + 12, header->reserved);
}

int epd_frame_header_check(const uint8_t *data, size_t data_len, uint32_t max_body,
                           unsigned fds_received, struct epd_frame_header *out, const char **why)
{
        struct epd_frame_header h;

        if (data_len < EPD_FRAME_HEADER_BYTES) {
                *why = "record shorter than the frame header";
                return -EPROTO;
        }
        h.magic = get_u32(data);
        h.version = get_u16(data + 4);
        h.num_fds = get_u16(data + 6);
        h.length = get_u32(data + 8);
        h.reserved = get_u32(data + 12);
        if (h.magic != EPD_FRAME_MAGIC) {
                *why = "bad frame magic";
                return -EPROTO;
        }
        if (h.reserved != 0) {
                *why = "reserved header field is not zero";
                return -EPROTO;
        }
        if (h.length > max_body) {
                *why = "frame body exceeds the maximum frame size";
                return -EMSGSIZE;
        }
        if ((size_t)h.length != data_len - EPD_FRAME_HEADER_BYTES) {
                *why = "frame length does not match the record (truncated or padded frame)";
                return -EPROTO;
        }
        if (h.num_fds != fds_received) {
                *why = h.num_fds > fds_received ? "frame announces more fds than it carries"
                                                : "frame carries fds it does not announce";
                return -EPROTO;
        }
        *out = h;
        return 0;
}

int epd_frame_send(int sock, uint16_t version, const void *body, size_t body_len,
                   const int *fds, unsigned num_fds)
{
        uint8_t header[EPD_FRAME_HEADER_BYTES];
        struct epd_frame_header h = {
                .magic = EPD_FRAME_MAGIC,
                .version = version,
                .num_fds = (uint16_t)num_fds,
                .length = (uint32_t)body_len,
        };
        union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * EPD_FRAME_MAX_FDS)];
        } control;
        struct iovec iov[2];
        struct msghdr msg;
        ssize_t n;

        if (num_fds > EPD_FRAME_MAX_FDS || body_len > UINT32_MAX)
                return -EINVAL;
        epd_frame_header_encode(&h, header);
        iov[0].iov_base = header;
        iov[0].iov_len = sizeof(header);
        iov[1].iov_base = (void *)body;
        iov[1].iov_len = body_len;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = iov;
        msg.msg_iovlen = body_len ? 2 : 1;
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
        do
                n = sendmsg(sock, &msg, MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        if (n < 0)
                return -errno;
        if ((size_t)n != sizeof(header) + body_len)
                return -EMSGSIZE; /* SEQPACKET sends records whole; anything else is a bug */
        return 0;
}

void epd_frame_close_fds(struct epd_frame *frame)
{
        for (unsigned i = 0; i < frame->num_fds; i++) {
                if (frame->fds[i] >= 0)
                        close(frame->fds[i]);
                frame->fds[i] = -1;
        }
        frame->num_fds = 0;
}

int epd_frame_take_fd(struct epd_frame *frame, unsigned i)
{
        int fd;

        if (i >= frame->num_fds)
                return -1;
        fd = frame->fds[i];
        frame->fds[i] = -1;
        return fd;
}

int epd_frame_recv(int sock, uint8_t *buf, size_t buf_len, uint32_t max_body,
                   unsigned max_fds, struct epd_frame *frame, const char **why)
{
        union {
                struct cmsghdr align;
                /* Room for more fds than allowed, so that an excess is seen and closed rather
                 * than silently cut off by the kernel. */
                char buf[CMSG_SPACE(sizeof(int) * (EPD_FRAME_MAX_FDS + 1))];
        } control;
        struct iovec iov = { .iov_base = buf, .iov_len = buf_len };
        struct msghdr msg;
        struct cmsghdr *cmsg;
        ssize_t n;
        int rc;

        memset(frame, 0, sizeof(*frame));
        for (unsigned i = 0; i < EPD_FRAME_MAX_FDS; i++)
                frame->fds[i] = -1;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof(control.buf);
        do
                n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        if (n < 0)
                return -errno;

        /* Collect every fd first, so that each path below closes them all. */
        int excess = 0;
        for (cmsg = CMSG_FIRSTHDR(&msg); cmsg; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
                if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS)
                        continue;
                size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                int *fds = (int *)CMSG_DATA(cmsg);
                for (size_t i = 0; i < count; i++) {
                        int fd;
                        memcpy(&fd, fds + i, sizeof(fd));
                        if (frame->num_fds < EPD_FRAME_MAX_FDS && frame->num_fds < max_fds) {
                                frame->fds[frame->num_fds++] = fd;
                        } else {
                                close(fd);
                                excess = 1;
                        }
                }
        }
        /* An empty record is end of stream only when nothing came with it: fds over the
         * limit (closed above) make it a bad frame, not a hang-up. */
        if (n == 0 && frame->num_fds == 0 && !excess && !(msg.msg_flags & MSG_CTRUNC))
                return -ECONNRESET;
        if (msg.msg_flags & MSG_CTRUNC) {
                *why = "file descriptors were truncated (MSG_CTRUNC)";
                rc = -EPROTO;
                goto fail;
        }
        if (excess) {
                *why = "frame carries more fds than allowed per frame";
                rc = -EPROTO;
                goto fail;
        }
        if (msg.msg_flags & MSG_TRUNC) {
                *why = "frame exceeds the maximum frame size";
                rc = -EMSGSIZE;
                goto fail;
        }
        rc = epd_frame_header_check(buf, (size_t)n, max_body, frame->num_fds, &frame->header,
                                    why);
        if (rc < 0)
                goto fail;
        frame->body = buf + EPD_FRAME_HEADER_BYTES;
        frame->body_len = frame->header.length;
        return 0;
fail:
        epd_frame_close_fds(frame);
        return rc;
}
