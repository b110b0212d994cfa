/* frame.h - the epd frame: a fixed little-endian header, a protobuf body, and the file
 * descriptors announced by the header, carried together in one SOCK_SEQPACKET record.
 *
 *   offset 0  u32 magic      EPD_FRAME_MAGIC
 *   offset 4  u16 version    EPD_PROTOCOL_VERSION of the sender
 *   offset 6  u16 num_fds    fds attached to this record with SCM_RIGHTS
 *   offset 8  u32 length     body bytes that follow the header
 *   offset 12 u32 reserved   zero
 *
 * The header is checked before the body is decoded. Shared by the daemon and libepd; no logging,
 * no allocation. Every function returns 0 or a negative errno.
 */
#ifndef EPD_COMMON_FRAME_H
#define EPD_COMMON_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define EPD_FRAME_MAGIC 0x46445045u /* "EPDF" */
#define EPD_FRAME_HEADER_BYTES 16u
#define EPD_FRAME_MAX_FDS 16u       /* hard ceiling; the configured limit may be lower */
#define EPD_DEFAULT_MAX_FRAME_BYTES (64u * 1024u)

struct epd_frame_header {
        uint32_t magic;
        uint16_t version;
        uint16_t num_fds;
        uint32_t length;
        uint32_t reserved;
};

/* A received frame. body points into the caller's buffer; fds are owned by the frame until taken
 * (set to -1 when taken) and closed by epd_frame_close_fds. */
struct epd_frame {
        struct epd_frame_header header;
        const uint8_t *body;
        uint32_t body_len;
        unsigned num_fds;
        int fds[EPD_FRAME_MAX_FDS];
};

void epd_frame_header_encode(const struct epd_frame_header *header, uint8_t *out);

/* Decodes and checks a header against the received record: magic, reserved, length == bytes
 * after the header, length <= max_body, num_fds == fds_received. On failure returns -EPROTO (or
 * -EMSGSIZE for an oversized body) and sets *why to a static message. A version mismatch is not
 * checked here: the caller answers it with VERSION_MISMATCH. */
int epd_frame_header_check(const uint8_t *data, size_t data_len, uint32_t max_body,
                           unsigned fds_received, struct epd_frame_header *out, const char **why);

/* Sends one frame (header + body + fds) with sendmsg. Returns 0, -EAGAIN when the socket is
 * full (non-blocking sockets), or another -errno. */
int epd_frame_send(int sock, uint16_t version, const void *body, size_t body_len,
                   const int *fds, unsigned num_fds);

/* Receives one record into buf (buf_len must be >= EPD_FRAME_HEADER_BYTES + max_body + 1 so that
 * oversized records are detected) and checks it. Returns 0 with *frame filled, -EAGAIN when no
 * record is waiting, -ECONNRESET at end of stream, -EPROTO/-EMSGSIZE for a bad record (*why set;
 * every fd that came with it is already closed), or another -errno. */
int epd_frame_recv(int sock, uint8_t *buf, size_t buf_len, uint32_t max_body,
                   unsigned max_fds, struct epd_frame *frame, const char **why);

void epd_frame_close_fds(struct epd_frame *frame);
/* Takes fd i out of the frame; the caller owns it. Returns -1 when absent. */
int epd_frame_take_fd(struct epd_frame *frame, unsigned i);

#endif
