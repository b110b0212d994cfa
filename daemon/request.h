/* request.h - the two forms of a decoded request: a Request unpacked by protobuf-c, and one built
 * from a compact request posted in a doorbell page (common/doorbell.h, struct
 * epd_compact_request). Loop thread. */
#ifndef EPD_DAEMON_REQUEST_H
#define EPD_DAEMON_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include "doorbell.h"
#include "epd.pb-c.h"

/* The Request that a compact request of len bytes stands for, in one allocation; NULL with the
 * reason in err when the struct is malformed (length, kind, flags, tensor ranks, biases). */
Epd__V1__Request *epd_request_from_compact(const uint8_t *buf, size_t len, char *err,
                                           size_t err_len);
/* Frees a Request of either form. */
void epd_request_free(Epd__V1__Request *req);

#endif
