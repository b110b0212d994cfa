/* unit_frame.c - the frame header and SCM_RIGHTS send/receive (common/frame.c).
 *
 * Covers: the little-endian header layout; every header check (short record, magic, reserved,
 * length mismatch both ways, oversized body, fd count mismatch both ways); send/receive over a
 * real SOCK_SEQPACKET socketpair: bodies, 0..16 fds that arrive valid and close-on-exec, more fds
 * than allowed, a control buffer the kernel has to truncate (MSG_CTRUNC), records larger than
 * the buffer, end of stream (and an empty record with fds, which is not), an empty non-blocking
 * socket and a full one. Every failure path is checked for fd leaks by counting /proc/self/fd.
 * Each test runs in its own process (fork mode).
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "frame.h"

#define MAX_BODY 1024u
#define BUF_LEN (EPD_FRAME_HEADER_BYTES + MAX_BODY + 1)

/* ---- helpers ---- */

static unsigned count_open_fds(void)
{
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *de;
        unsigned n = 0;

        ck_assert_ptr_nonnull(dir);
        while ((de = readdir(dir)) != NULL)
                if (de->d_name[0] != '.')
                        n++;
        closedir(dir);
        return n - 1; /* the directory's own fd */
}

static void make_pair(int sv[2], int nonblock)
{
        int type = SOCK_SEQPACKET | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0);

        ck_assert_int_eq(socketpair(AF_UNIX, type, 0, sv), 0);
}

static void make_header(uint8_t *out, uint32_t magic, uint16_t version, uint16_t num_fds,
                        uint32_t length, uint32_t reserved)
{
        struct epd_frame_header h = {
                .magic = magic, .version = version, .num_fds = num_fds, .length = length,
                .reserved = reserved,
        };
        epd_frame_header_encode(&h, out);
}

/* Sends one raw record (bytes plus fds) with sendmsg, bypassing epd_frame_send's limits. */
static void send_raw(int sock, const void *data, size_t len, const int *fds, unsigned num_fds)
{
        size_t control_len = CMSG_SPACE(sizeof(int) * (num_fds ? num_fds : 1));
        char *control = calloc(1, control_len);
        struct iovec iov = { .iov_base = (void *)data, .iov_len = len };
        struct msghdr msg;

        ck_assert_ptr_nonnull(control);
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        if (num_fds) {
                struct cmsghdr *cmsg;
                msg.msg_control = control;
                msg.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
                cmsg = CMSG_FIRSTHDR(&msg);
                cmsg->cmsg_level = SOL_SOCKET;
                cmsg->cmsg_type = SCM_RIGHTS;
                cmsg->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
                memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * num_fds);
        }
        ck_assert_int_eq(sendmsg(sock, &msg, MSG_NOSIGNAL), (ssize_t)len);
        free(control);
}

/* n pipes: rd[i] stays here, wr[i] is what gets sent. */
static void make_pipes(int *rd, int *wr, unsigned n)
{
        for (unsigned i = 0; i < n; i++) {
                int p[2];
                ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
                rd[i] = p[0];
                wr[i] = p[1];
        }
}

static void close_all(int *fds, unsigned n)
{
        for (unsigned i = 0; i < n; i++) {
                if (fds[i] >= 0)
                        close(fds[i]);
                fds[i] = -1;
        }
}

/* A frame after a failed receive holds nothing. */
static void assert_frame_empty(const struct epd_frame *f)
{
        ck_assert_uint_eq(f->num_fds, 0);
        for (unsigned i = 0; i < EPD_FRAME_MAX_FDS; i++)
                ck_assert_int_eq(f->fds[i], -1);
}

/* ---- header encode and check ---- */

START_TEST(test_header_encode_layout)
{
        uint8_t out[EPD_FRAME_HEADER_BYTES];
        static const uint8_t want[EPD_FRAME_HEADER_BYTES] = {
                0x45, 0x50, 0x44, 0x46, /* magic "EPDF" little-endian */
                0x34, 0x12,             /* version 0x1234 */
                0x03, 0x00,             /* num_fds 3 */
                0x04, 0x03, 0x02, 0x01, /* length 0x01020304 */
                0xdd, 0xcc, 0xbb, 0xaa, /* reserved 0xaabbccdd */
        };

        memset(out, 0x5a, sizeof(out));
        make_header(out, EPD_FRAME_MAGIC, 0x1234, 3, 0x01020304, 0xaabbccdd);
        ck_assert_mem_eq(out, want, sizeof(want));
        ck_assert_mem_eq(out, "EPDF", 4);
}
END_TEST

START_TEST(test_header_check_ok)
{
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 10];
        struct epd_frame_header h;
        const char *why = NULL;

        make_header(rec, EPD_FRAME_MAGIC, 7, 2, 10, 0);
        ck_assert_int_eq(epd_frame_header_check(rec, sizeof(rec), 10, 2, &h, &why), 0);
        ck_assert_uint_eq(h.magic, EPD_FRAME_MAGIC);
        ck_assert_uint_eq(h.version, 7);
        ck_assert_uint_eq(h.num_fds, 2);
        ck_assert_uint_eq(h.length, 10);
        ck_assert_uint_eq(h.reserved, 0);
        ck_assert_ptr_null(why);

        /* Empty body, no fds, max_body 0. */
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 0, 0);
        ck_assert_int_eq(epd_frame_header_check(rec, EPD_FRAME_HEADER_BYTES, 0, 0, &h, &why), 0);
        ck_assert_uint_eq(h.length, 0);
        ck_assert_uint_eq(h.version, 1);
}
END_TEST

/* Runs one check that must fail; *out must stay untouched and *why must be set. */
static void expect_check_fail(const uint8_t *rec, size_t len, uint32_t max_body, unsigned fds,
                              int want_rc, const char *why_contains)
{
        struct epd_frame_header h;
        const char *why = NULL;

        memset(&h, 0xa5, sizeof(h));
        ck_assert_int_eq(epd_frame_header_check(rec, len, max_body, fds, &h, &why), want_rc);
        ck_assert_ptr_nonnull(why);
        ck_assert_msg(strstr(why, why_contains) != NULL, "why '%s' lacks '%s'", why,
                      why_contains);
        ck_assert_uint_eq(h.magic, 0xa5a5a5a5u);
        ck_assert_uint_eq(h.length, 0xa5a5a5a5u);
}

START_TEST(test_header_check_short)
{
        uint8_t rec[EPD_FRAME_HEADER_BYTES];

        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 0, 0);
        expect_check_fail(rec, EPD_FRAME_HEADER_BYTES - 1, 100, 0, -EPROTO, "shorter");
        expect_check_fail(rec, 0, 100, 0, -EPROTO, "shorter");
}
END_TEST

START_TEST(test_header_check_magic)
{
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 4];

        make_header(rec, EPD_FRAME_MAGIC ^ 0x01000000u, 1, 0, 4, 0);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "magic");
        /* Byte-swapped magic: a big-endian sender. */
        make_header(rec, __builtin_bswap32(EPD_FRAME_MAGIC), 1, 0, 4, 0);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "magic");
}
END_TEST

START_TEST(test_header_check_reserved)
{
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 4];

        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 4, 1);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "reserved");
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 4, 0x80000000u);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "reserved");
}
END_TEST

START_TEST(test_header_check_length_mismatch)
{
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 8];

        /* Announces more than the record carries (truncated). */
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 9, 0);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "length");
        /* Announces less than the record carries (padded). */
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 7, 0);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "length");
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 0, 0);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "length");
}
END_TEST

START_TEST(test_header_check_oversize)
{
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 101];
        struct epd_frame_header h;
        const char *why = NULL;

        /* One byte over the limit, record consistent: too big. */
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 101, 0);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EMSGSIZE, "maximum");
        /* Exactly the limit is fine. */
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 100, 0);
        ck_assert_int_eq(epd_frame_header_check(rec, EPD_FRAME_HEADER_BYTES + 100, 100, 0, &h,
                                                &why), 0);
        ck_assert_uint_eq(h.length, 100);
        /* A huge announced length wins over the length mismatch. */
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, UINT32_MAX, 0);
        expect_check_fail(rec, sizeof(rec), 100, 0, -EMSGSIZE, "maximum");
}
END_TEST

START_TEST(test_header_check_fd_mismatch)
{
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 4];

        make_header(rec, EPD_FRAME_MAGIC, 1, 2, 4, 0);
        expect_check_fail(rec, sizeof(rec), 100, 1, -EPROTO, "announces more fds");
        expect_check_fail(rec, sizeof(rec), 100, 0, -EPROTO, "announces more fds");
        make_header(rec, EPD_FRAME_MAGIC, 1, 1, 4, 0);
        expect_check_fail(rec, sizeof(rec), 100, 2, -EPROTO, "does not announce");
        make_header(rec, EPD_FRAME_MAGIC, 1, 0, 4, 0);
        expect_check_fail(rec, sizeof(rec), 100, 1, -EPROTO, "does not announce");
}
END_TEST

/* ---- send and receive ---- */

START_TEST(test_roundtrip_body)
{
        int sv[2];
        uint8_t body[MAX_BODY], buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;

        for (unsigned i = 0; i < sizeof(body); i++)
                body[i] = (uint8_t)(i * 7 + 3);
        make_pair(sv, 0);

        ck_assert_int_eq(epd_frame_send(sv[0], 3, body, 37, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why), 0);
        ck_assert_uint_eq(f.header.magic, EPD_FRAME_MAGIC);
        ck_assert_uint_eq(f.header.version, 3);
        ck_assert_uint_eq(f.header.length, 37);
        ck_assert_uint_eq(f.body_len, 37);
        ck_assert_ptr_eq(f.body, buf + EPD_FRAME_HEADER_BYTES);
        ck_assert_mem_eq(f.body, body, 37);
        ck_assert_uint_eq(f.num_fds, 0);

        /* The largest allowed body. */
        ck_assert_int_eq(epd_frame_send(sv[0], 0xffff, body, MAX_BODY, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why), 0);
        ck_assert_uint_eq(f.header.version, 0xffff);
        ck_assert_uint_eq(f.body_len, MAX_BODY);
        ck_assert_mem_eq(f.body, body, MAX_BODY);

        /* An empty body is a record of just the header, not end of stream. */
        ck_assert_int_eq(epd_frame_send(sv[0], 1, NULL, 0, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why), 0);
        ck_assert_uint_eq(f.body_len, 0);

        /* Records stay separate. */
        ck_assert_int_eq(epd_frame_send(sv[0], 1, "abc", 3, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_send(sv[0], 2, "defgh", 5, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why), 0);
        ck_assert_uint_eq(f.body_len, 3);
        ck_assert_mem_eq(f.body, "abc", 3);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why), 0);
        ck_assert_uint_eq(f.header.version, 2);
        ck_assert_uint_eq(f.body_len, 5);
        ck_assert_mem_eq(f.body, "defgh", 5);
        close(sv[0]);
        close(sv[1]);
}
END_TEST

/* Sends n pipe write ends and checks each received fd is the same pipe, writable, and CLOEXEC. */
START_TEST(test_roundtrip_fds)
{
        unsigned n = (unsigned)_i;
        int sv[2], rd[EPD_FRAME_MAX_FDS], wr[EPD_FRAME_MAX_FDS];
        uint8_t buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;
        unsigned before;

        make_pair(sv, 0);
        make_pipes(rd, wr, n);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, "fds", 3, wr, n), 0);
        before = count_open_fds();
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, EPD_FRAME_MAX_FDS, &f,
                                        &why), 0);
        ck_assert_uint_eq(f.num_fds, n);
        ck_assert_uint_eq(f.header.num_fds, n);
        ck_assert_uint_eq(count_open_fds(), before + n);
        for (unsigned i = n; i < EPD_FRAME_MAX_FDS; i++)
                ck_assert_int_eq(f.fds[i], -1);
        for (unsigned i = 0; i < n; i++) {
                struct stat a, b;
                char c = (char)('a' + i), got = 0;
                int fd = f.fds[i];

                ck_assert_int_ge(fd, 0);
                for (unsigned j = 0; j < n; j++)
                        ck_assert_int_ne(fd, wr[j]); /* a new descriptor, not the sender's */
                ck_assert_int_eq(fstat(fd, &a), 0);
                ck_assert_int_eq(fstat(wr[i], &b), 0);
                ck_assert_uint_eq(a.st_ino, b.st_ino);
                ck_assert_uint_eq(a.st_dev, b.st_dev);
                ck_assert_int_ne(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
                ck_assert_int_eq(write(fd, &c, 1), 1);
                ck_assert_int_eq(read(rd[i], &got, 1), 1);
                ck_assert_int_eq(got, c);
        }
        /* take_fd hands one over; close_fds closes the rest. */
        if (n > 0) {
                int taken = epd_frame_take_fd(&f, 0);
                ck_assert_int_ge(taken, 0);
                ck_assert_int_eq(f.fds[0], -1);
                ck_assert_int_eq(epd_frame_take_fd(&f, 0), -1);
                ck_assert_int_eq(epd_frame_take_fd(&f, n), -1);
                epd_frame_close_fds(&f);
                ck_assert_uint_eq(count_open_fds(), before + 1);
                ck_assert_int_eq(fcntl(taken, F_GETFD) >= 0, 1);
                close(taken);
        } else {
                ck_assert_int_eq(epd_frame_take_fd(&f, 0), -1);
                epd_frame_close_fds(&f);
        }
        ck_assert_uint_eq(count_open_fds(), before);
        ck_assert_uint_eq(f.num_fds, 0);
        close_all(rd, n);
        close_all(wr, n);
        close(sv[0]);
        close(sv[1]);
}
END_TEST

START_TEST(test_send_too_many_fds)
{
        int sv[2], fds[EPD_FRAME_MAX_FDS + 1];

        make_pair(sv, 1);
        for (unsigned i = 0; i <= EPD_FRAME_MAX_FDS; i++)
                fds[i] = sv[0];
        ck_assert_int_eq(epd_frame_send(sv[0], 1, "x", 1, fds, EPD_FRAME_MAX_FDS + 1), -EINVAL);
        /* Nothing was sent. */
        {
                uint8_t buf[BUF_LEN];
                struct epd_frame f;
                const char *why = NULL;
                ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 16, &f, &why),
                                 -EAGAIN);
        }
        close(sv[0]);
        close(sv[1]);
}
END_TEST

/* More fds than the receiver's max_fds (but within the hard ceiling): -EPROTO, all closed. */
START_TEST(test_recv_more_than_max_fds)
{
        static const struct {
                unsigned sent, max_fds;
        } cases[] = { { 1, 0 }, { 3, 2 }, { 9, 8 }, { EPD_FRAME_MAX_FDS, 4 } };

        for (unsigned k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
                int sv[2], rd[EPD_FRAME_MAX_FDS], wr[EPD_FRAME_MAX_FDS];
                uint8_t buf[BUF_LEN];
                struct epd_frame f;
                const char *why = NULL;
                unsigned before;

                make_pair(sv, 0);
                make_pipes(rd, wr, cases[k].sent);
                ck_assert_int_eq(epd_frame_send(sv[0], 1, "x", 1, wr, cases[k].sent), 0);
                /* Close our copies of the write ends: a leaked received copy keeps the pipe
                 * open, which the read below would then not see as EOF. */
                close_all(wr, cases[k].sent);
                before = count_open_fds();
                ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY,
                                                cases[k].max_fds, &f, &why), -EPROTO);
                ck_assert_ptr_nonnull(why);
                ck_assert_msg(strstr(why, "more fds than allowed") != NULL, "why: %s", why);
                ck_assert_uint_eq(count_open_fds(), before);
                assert_frame_empty(&f);
                for (unsigned i = 0; i < cases[k].sent; i++) {
                        char c;
                        ck_assert_int_eq(read(rd[i], &c, 1), 0); /* every writer is gone */
                }
                close_all(rd, cases[k].sent);
                close(sv[0]);
                close(sv[1]);
        }
}
END_TEST

/* Exactly the ceiling plus one fits the receive buffer: the extra fd is seen and closed. */
START_TEST(test_recv_ceiling_plus_one)
{
        enum { N = EPD_FRAME_MAX_FDS + 1 };
        int sv[2], rd[N], wr[N];
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 1] = { 0 }, buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;
        unsigned before;

        make_pair(sv, 0);
        make_pipes(rd, wr, N);
        make_header(rec, EPD_FRAME_MAGIC, 1, N, 1, 0);
        send_raw(sv[0], rec, sizeof(rec), wr, N);
        close_all(wr, N);
        before = count_open_fds();
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, EPD_FRAME_MAX_FDS, &f,
                                        &why), -EPROTO);
        ck_assert_ptr_nonnull(why);
        ck_assert_uint_eq(count_open_fds(), before);
        assert_frame_empty(&f);
        for (unsigned i = 0; i < N; i++) {
                char c;
                ck_assert_int_eq(read(rd[i], &c, 1), 0);
        }
        close_all(rd, N);
        close(sv[0]);
        close(sv[1]);
}
END_TEST

/* More fds than the receive control buffer holds: the kernel truncates (MSG_CTRUNC). */
START_TEST(test_recv_ctrunc)
{
        enum { N = EPD_FRAME_MAX_FDS + 8 };
        int sv[2], rd[N], wr[N];
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 2] = { 0 }, buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;
        unsigned before;

        make_pair(sv, 0);
        make_pipes(rd, wr, N);
        make_header(rec, EPD_FRAME_MAGIC, 1, N, 2, 0);
        send_raw(sv[0], rec, sizeof(rec), wr, N);
        close_all(wr, N);
        before = count_open_fds();
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, EPD_FRAME_MAX_FDS, &f,
                                        &why), -EPROTO);
        ck_assert_ptr_nonnull(why);
        ck_assert_msg(strstr(why, "MSG_CTRUNC") != NULL, "why: %s", why);
        ck_assert_uint_eq(count_open_fds(), before);
        assert_frame_empty(&f);
        /* Neither the fds that were delivered nor the ones the kernel dropped stay open. */
        for (unsigned i = 0; i < N; i++) {
                char c;
                ck_assert_int_eq(read(rd[i], &c, 1), 0);
        }
        close_all(rd, N);
        /* The socket still works afterwards. */
        ck_assert_int_eq(epd_frame_send(sv[0], 1, "ok", 2, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why), 0);
        ck_assert_mem_eq(f.body, "ok", 2);
        close(sv[0]);
        close(sv[1]);
}
END_TEST

/* A record bigger than the buffer: the kernel truncates it (MSG_TRUNC) -> -EMSGSIZE. */
START_TEST(test_recv_record_too_big)
{
        int sv[2], rd[2], wr[2];
        uint8_t *body = calloc(1, MAX_BODY + 100), buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;
        unsigned before;

        ck_assert_ptr_nonnull(body);
        make_pair(sv, 0);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, MAX_BODY + 100, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EMSGSIZE);
        ck_assert_ptr_nonnull(why);

        /* One byte over: fits the buffer exactly (that is what the +1 is for), the header
         * check refuses it. */
        why = NULL;
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, MAX_BODY + 1, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EMSGSIZE);
        ck_assert_ptr_nonnull(why);

        /* With fds attached: they are closed. */
        make_pipes(rd, wr, 2);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, MAX_BODY + 100, wr, 2), 0);
        close_all(wr, 2);
        before = count_open_fds();
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EMSGSIZE);
        ck_assert_uint_eq(count_open_fds(), before);
        assert_frame_empty(&f);
        for (unsigned i = 0; i < 2; i++) {
                char c;
                ck_assert_int_eq(read(rd[i], &c, 1), 0);
        }
        close_all(rd, 2);

        /* A buffer smaller than the contract asks for (max_body + 1 after the header): the
         * kernel's truncation flag alone tells that the record did not fit. */
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, 20, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, EPD_FRAME_HEADER_BYTES + 8, MAX_BODY, 8, &f,
                                        &why), -EMSGSIZE);

        /* A smaller receive limit applies to the same record sizes. */
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, 65, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), 64, 8, &f, &why), -EMSGSIZE);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, 64, NULL, 0), 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), 64, 8, &f, &why), 0);
        ck_assert_uint_eq(f.body_len, 64);
        free(body);
        close(sv[0]);
        close(sv[1]);
}
END_TEST

/* Bad records over the socket: header checks apply and carried fds are closed. */
START_TEST(test_recv_bad_header_closes_fds)
{
        int sv[2], rd[3], wr[3];
        uint8_t rec[EPD_FRAME_HEADER_BYTES + 4] = { 0 }, buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;
        unsigned before;

        make_pair(sv, 0);
        /* Header announces 2 fds, the record carries 3. */
        make_pipes(rd, wr, 3);
        make_header(rec, EPD_FRAME_MAGIC, 1, 2, 4, 0);
        send_raw(sv[0], rec, sizeof(rec), wr, 3);
        close_all(wr, 3);
        before = count_open_fds();
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EPROTO);
        ck_assert_msg(strstr(why, "does not announce") != NULL, "why: %s", why);
        ck_assert_uint_eq(count_open_fds(), before);
        assert_frame_empty(&f);
        for (unsigned i = 0; i < 3; i++) {
                char c;
                ck_assert_int_eq(read(rd[i], &c, 1), 0);
        }
        close_all(rd, 3);

        /* Bad magic with one fd. */
        make_pipes(rd, wr, 1);
        make_header(rec, 0x12345678u, 1, 1, 4, 0);
        send_raw(sv[0], rec, sizeof(rec), wr, 1);
        close_all(wr, 1);
        before = count_open_fds();
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EPROTO);
        ck_assert_msg(strstr(why, "magic") != NULL, "why: %s", why);
        ck_assert_uint_eq(count_open_fds(), before);
        close_all(rd, 1);

        /* A record shorter than a header. */
        send_raw(sv[0], "EPD", 3, NULL, 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EPROTO);
        ck_assert_msg(strstr(why, "shorter") != NULL, "why: %s", why);
        close(sv[0]);
        close(sv[1]);
}
END_TEST

START_TEST(test_recv_eof)
{
        int sv[2];
        uint8_t buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;

        make_pair(sv, 0);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, "last", 4, NULL, 0), 0);
        close(sv[0]);
        /* A queued record is still delivered before end of stream. */
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why), 0);
        ck_assert_mem_eq(f.body, "last", 4);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -ECONNRESET);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -ECONNRESET);
        close(sv[1]);
}
END_TEST

/* An empty record that brings fds is not end of stream, even when every fd is over the limit
 * (found by fuzz_frame: it read as a hang-up once the excess fds were closed). */
START_TEST(test_recv_empty_record_with_fds)
{
        static const unsigned max_fds[] = { 0, 1, 8 };

        for (unsigned k = 0; k < sizeof(max_fds) / sizeof(max_fds[0]); k++) {
                int sv[2], rd[2], wr[2];
                uint8_t buf[BUF_LEN];
                struct epd_frame f;
                const char *why = NULL;
                unsigned before;

                make_pair(sv, 0);
                make_pipes(rd, wr, 2);
                send_raw(sv[0], NULL, 0, wr, 2);
                close_all(wr, 2);
                before = count_open_fds();
                ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, max_fds[k],
                                                &f, &why), -EPROTO);
                ck_assert_ptr_nonnull(why);
                ck_assert_uint_eq(count_open_fds(), before);
                assert_frame_empty(&f);
                close_all(rd, 2);
                close(sv[0]);
                close(sv[1]);
        }
}
END_TEST

START_TEST(test_recv_eagain)
{
        int sv[2];
        uint8_t buf[BUF_LEN];
        struct epd_frame f;
        const char *why = NULL;

        make_pair(sv, 1);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EAGAIN);
        ck_assert_ptr_null(why);
        ck_assert_uint_eq(f.num_fds, 0);
        close(sv[0]);
        close(sv[1]);
        /* recv never blocks, even on a blocking socket. */
        make_pair(sv, 0);
        ck_assert_int_eq(epd_frame_recv(sv[1], buf, sizeof(buf), MAX_BODY, 8, &f, &why),
                         -EAGAIN);
        close(sv[0]);
        close(sv[1]);
}
END_TEST

/* A full socket is -EAGAIN; a closed peer is an error return. */
START_TEST(test_send_full_and_closed)
{
        int sv[2], sent = 0, rc;
        uint8_t body[512] = { 0 };

        make_pair(sv, 1);
        while ((rc = epd_frame_send(sv[0], 1, body, sizeof(body), NULL, 0)) == 0)
                ck_assert_int_lt(++sent, 1 << 20);
        ck_assert_int_eq(rc, -EAGAIN);
        ck_assert_int_gt(sent, 0);
        /* The peer goes away with records unread: the kernel reports a reset once, then a
         * broken pipe. */
        close(sv[1]);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, 1, NULL, 0), -ECONNRESET);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, 1, NULL, 0), -EPIPE);
        close(sv[0]);

        make_pair(sv, 0);
        close(sv[1]);
        ck_assert_int_eq(epd_frame_send(sv[0], 1, body, 1, NULL, 0), -EPIPE);
        close(sv[0]);
}
END_TEST

START_TEST(test_close_fds_idempotent)
{
        struct epd_frame f;
        int p[2];

        memset(&f, 0, sizeof(f));
        for (unsigned i = 0; i < EPD_FRAME_MAX_FDS; i++)
                f.fds[i] = -1;
        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        f.fds[0] = p[0];
        f.fds[1] = p[1];
        f.num_fds = 2;
        epd_frame_close_fds(&f);
        ck_assert_uint_eq(f.num_fds, 0);
        ck_assert_int_eq(f.fds[0], -1);
        ck_assert_int_eq(f.fds[1], -1);
        ck_assert_int_eq(fcntl(p[0], F_GETFD), -1);
        ck_assert_int_eq(fcntl(p[1], F_GETFD), -1);
        epd_frame_close_fds(&f);
        ck_assert_uint_eq(f.num_fds, 0);
}
END_TEST

static Suite *frame_suite(void)
{
        Suite *s = suite_create("frame");
        TCase *tc = tcase_create("header");

        tcase_add_test(tc, test_header_encode_layout);
        tcase_add_test(tc, test_header_check_ok);
        tcase_add_test(tc, test_header_check_short);
        tcase_add_test(tc, test_header_check_magic);
        tcase_add_test(tc, test_header_check_reserved);
        tcase_add_test(tc, test_header_check_length_mismatch);
        tcase_add_test(tc, test_header_check_oversize);
        tcase_add_test(tc, test_header_check_fd_mismatch);
        suite_add_tcase(s, tc);

        tc = tcase_create("socket");
        tcase_add_test(tc, test_roundtrip_body);
        tcase_add_loop_test(tc, test_roundtrip_fds, 0, EPD_FRAME_MAX_FDS + 1);
        tcase_add_test(tc, test_send_too_many_fds);
        tcase_add_test(tc, test_recv_more_than_max_fds);
        tcase_add_test(tc, test_recv_ceiling_plus_one);
        tcase_add_test(tc, test_recv_ctrunc);
        tcase_add_test(tc, test_recv_record_too_big);
        tcase_add_test(tc, test_recv_bad_header_closes_fds);
        tcase_add_test(tc, test_recv_eof);
        tcase_add_test(tc, test_recv_empty_record_with_fds);
        tcase_add_test(tc, test_recv_eagain);
        tcase_add_test(tc, test_send_full_and_closed);
        tcase_add_test(tc, test_close_fds_idempotent);
        suite_add_tcase(s, tc);
        return s;
}

int main(void)
{
        SRunner *sr = srunner_create(frame_suite());
        int failed;

        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
