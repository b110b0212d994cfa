/* reply.h - which body a successful reply carries, for each request (proto/epd.proto). The
 * client checks every OK reply against it, so that a daemon answering with another body (a
 * mismatched version, a bug) is an error and not a read of the wrong member of the reply's
 * oneof. */
#ifndef EPD_COMMON_REPLY_H
#define EPD_COMMON_REPLY_H

#include "epd.pb-c.h"

/* The body of an OK reply to a request with this body; NOT_SET for a body that has no reply
 * defined (none that a client sends). */
Epd__V1__Response__BodyCase epd__reply_body(Epd__V1__Request__BodyCase request);

/* The oneof member's name ("size_hint", ...), or "none" / "unknown". */
const char *epd__request_body_name(Epd__V1__Request__BodyCase body);
const char *epd__response_body_name(Epd__V1__Response__BodyCase body);

#endif
