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

/* Output arenas (arena.h): address space reserved once, with segments mapped into it. */
/* Reserves bytes (a page multiple) of address space, inaccessible and without commit charge.
 * 0 or EPD_UNAVAILABLE. */
int epd__va_reserve(uint64_t bytes, uint8_t **base, char *err, size_t err_len);
void epd__va_unreserve(uint8_t *base, uint64_t bytes);
/* Creates a sealed memfd of bytes and maps it at addr (page aligned, inside a reservation),
 * replacing the reservation there. 0 or EPD_UNAVAILABLE (the reservation is left as it was). */
int epd__memfd_segment(uint8_t *addr, uint64_t bytes, int *fd, char *err, size_t err_len);
/* Turns [addr, addr + bytes) back into reserved address space. */
void epd__memfd_segment_drop(uint8_t *addr, uint64_t bytes);

#endif
