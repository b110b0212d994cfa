/* status.c - status names and the mapping between enum epd_status and the wire StatusCode. */
#include "epd.h"
#include "util.h"

static const char *const status_names[EPD_STATUS_COUNT] = {
        "OK",        "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS",
        "PERMISSION_DENIED", "CAPACITY_EXCEEDED", "PEER_LOST", "TIMEOUT",
        "ABORTED",   "UNAVAILABLE",      "VERSION_MISMATCH", "INTERNAL",
};

const char *epd_status_name(int status)
{
        if (status > 0 || status <= -EPD_STATUS_COUNT)
                return "UNKNOWN";
        return status_names[-status];
}

int epd__status_from_wire(int code)
{
        if (code < 0 || code >= EPD_STATUS_COUNT)
                return EPD_INTERNAL;
        return -code;
}

int epd__status_to_wire(int status)
{
        if (status > 0 || status <= -EPD_STATUS_COUNT)
                return -EPD_INTERNAL;
        return -status;
}

size_t epd_dtype_size(enum epd_dtype dtype)
{
        switch (dtype) {
        case EPD_DTYPE_BF16:
                return 2;
        case EPD_DTYPE_FP8_E4M3:
                return 1;
        case EPD_DTYPE_FP32:
        case EPD_DTYPE_INT32:
                return 4;
        case EPD_DTYPE_INT64:
                return 8;
        default:
                return 0;
        }
}
