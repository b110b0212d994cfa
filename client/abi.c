/* abi.c - libepd: the sizes of the public structures as this library was compiled, so that a
 * binding that mirrors them (client/python/epd/_lib.py) can refuse a library built from other
 * sources instead of reading or writing past a structure's end. */
#include <string.h>

#include "epd.h"

#define ABI_STRUCT(n) { #n, sizeof(struct n) }

static const struct {
        const char *name;
        size_t size;
} abi_structs[] = {
        ABI_STRUCT(epd_tensor),
        ABI_STRUCT(epd_connect_args),
        ABI_STRUCT(epd_device_info),
        ABI_STRUCT(epd_daemon_info),
        ABI_STRUCT(epd_group_config),
        ABI_STRUCT(epd_group_args),
        ABI_STRUCT(epd_size_hint),
        ABI_STRUCT(epd_dispatch_args),
        ABI_STRUCT(epd_dispatch_result),
        ABI_STRUCT(epd_op_timeline),
        ABI_STRUCT(epd_combine_args),
        ABI_STRUCT(epd_combine_result),
        ABI_STRUCT(epd_cx_dispatch_args),
        ABI_STRUCT(epd_cx_combine_args),
        ABI_STRUCT(epd_cx_status),
        ABI_STRUCT(epd_cx_counts),
        ABI_STRUCT(epd_cx_buffers),
        ABI_STRUCT(epd_admin_device),
        ABI_STRUCT(epd_daemon_status_info),
        ABI_STRUCT(epd_admin_rank),
        ABI_STRUCT(epd_group_info),
        ABI_STRUCT(epd_client_info),
        ABI_STRUCT(epd_admin_op_stats),
        ABI_STRUCT(epd_admin_rank_stats),
        ABI_STRUCT(epd_admin_stage_stats),
        ABI_STRUCT(epd_admin_group_stats),
        ABI_STRUCT(epd_admin_client_stats),
        ABI_STRUCT(epd_admin_device_stats),
        ABI_STRUCT(epd_admin_daemon_stats),
        ABI_STRUCT(epd_drain_result),
        ABI_STRUCT(epd_resize_rank),
        ABI_STRUCT(epd_resize_info),
};

size_t epd_abi_struct_size(const char *name)
{
        for (size_t i = 0; name && i < sizeof(abi_structs) / sizeof(abi_structs[0]); i++)
                if (strcmp(abi_structs[i].name, name) == 0)
                        return abi_structs[i].size;
        return 0;
}
