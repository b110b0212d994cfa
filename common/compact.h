/* compact.h - a Dispatch or Combine Request as a compact request (common/doorbell.h, struct
 * epd_compact_request), for libepd and the fuzz target. The daemon's way back is
 * daemon/request.c. */
#ifndef EPD_COMMON_COMPACT_H
#define EPD_COMMON_COMPACT_H

#include "doorbell.h"
#include "epd.pb-c.h"

/* Fills c from req (a Dispatch or Combine); returns 0 when req does not fit a compact request
 * (more than two biases, or a tensor of more than EPD_COMPACT_MAX_DIMS dimensions), 1 when it
 * does. */
int epd__compact_request(const Epd__V1__Request *req, struct epd_compact_request *c);

#endif
