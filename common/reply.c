/* reply.c - the body of a successful reply to each request (reply.h). */
#include "reply.h"

Epd__V1__Response__BodyCase epd__reply_body(Epd__V1__Request__BodyCase request)
{
        switch (request) {
        case EPD__V1__REQUEST__BODY_HELLO:
                return EPD__V1__RESPONSE__BODY_WELCOME;
        case EPD__V1__REQUEST__BODY_GROUP_CREATE:
        case EPD__V1__REQUEST__BODY_GROUP_JOIN:
                return EPD__V1__RESPONSE__BODY_GROUP_JOINED;
        case EPD__V1__REQUEST__BODY_GROUP_LEAVE:
        case EPD__V1__REQUEST__BODY_REGION_RELEASE:
        case EPD__V1__REQUEST__BODY_HANDLE_RELEASE:
        case EPD__V1__REQUEST__BODY_EVICT:
                return EPD__V1__RESPONSE__BODY_EMPTY;
        case EPD__V1__REQUEST__BODY_REGION_REGISTER:
                return EPD__V1__RESPONSE__BODY_REGION_REGISTERED;
        case EPD__V1__REQUEST__BODY_SIZE_HINT:
                return EPD__V1__RESPONSE__BODY_SIZE_HINT;
        case EPD__V1__REQUEST__BODY_STATUS:
                return EPD__V1__RESPONSE__BODY_STATUS_REPLY;
        case EPD__V1__REQUEST__BODY_LIST_GROUPS:
                return EPD__V1__RESPONSE__BODY_GROUPS;
        case EPD__V1__REQUEST__BODY_LIST_CLIENTS:
                return EPD__V1__RESPONSE__BODY_CLIENTS;
        case EPD__V1__REQUEST__BODY_OP:
                return EPD__V1__RESPONSE__BODY_OP;
        case EPD__V1__REQUEST__BODY_STATS:
                return EPD__V1__RESPONSE__BODY_STATS;
        case EPD__V1__REQUEST__BODY_ARENA_SEGMENTS:
                return EPD__V1__RESPONSE__BODY_ARENA_SEGMENTS;
        case EPD__V1__REQUEST__BODY_RESIZE:
                return EPD__V1__RESPONSE__BODY_RESIZE;
        case EPD__V1__REQUEST__BODY_CX_MEMORY:
                return EPD__V1__RESPONSE__BODY_CX_MEMORY;
        case EPD__V1__REQUEST__BODY_DRAIN:
        case EPD__V1__REQUEST__BODY_UNDRAIN:
                return EPD__V1__RESPONSE__BODY_DRAIN;
        default:
                return EPD__V1__RESPONSE__BODY__NOT_SET;
        }
}

static const char *body_name(const ProtobufCMessageDescriptor *d, int body)
{
        const ProtobufCFieldDescriptor *f;

        if (body == 0)
                return "none";
        f = protobuf_c_message_descriptor_get_field(d, (unsigned)body);
        return f ? f->name : "unknown";
}

const char *epd__request_body_name(Epd__V1__Request__BodyCase body)
{
        return body_name(&epd__v1__request__descriptor, (int)body);
}

const char *epd__response_body_name(Epd__V1__Response__BodyCase body)
{
        return body_name(&epd__v1__response__descriptor, (int)body);
}
