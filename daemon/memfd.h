/* memfd.h - mapping client memfd regions and creating exported arenas, shared by the host and
 * cuda backends. Loop thread. */
#ifndef EPD_DAEMON_MEMFD_H
#define EPD_DAEMON_MEMFD_H

#include <stddef.h>
#include <stdint.h>

/* Maps [offset, offset + size) of a client's memfd read/write after sealing it against
 * shrinking (a client that shrank it later would make the daemon fault). *base is the first
 * byte of the range, *lead the bytes mapped before it (page alignment). Does not close fd.
 * Returns 0 or EPD_INVALID_ARGUMENT with err set. */
int epd__memfd_map(int fd, uint64_t offset, uint64_t size, uint8_t **base, uint64_t *lead,
                   char *err, size_t err_len);
void epd__memfd_unmap(uint8_t *base, uint64_t lead, uint64_t size);
/* Creates a sealed (fixed-size) memfd of bytes and maps it. 0 or EPD_UNAVAILABLE. */
int epd__memfd_arena(uint64_t bytes, uint8_t **base, int *fd, char *err, size_t err_len);

#endif
