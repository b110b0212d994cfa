/* memfd.c - see memfd.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "epd.h"
#include "memfd.h"

int epd__memfd_map(int fd, uint64_t offset, uint64_t size, uint8_t **base, uint64_t *lead,
                   char *err, size_t err_len)
{
        struct stat st;
        uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), map_off;
        int seals;
        void *p;

        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
                snprintf(err, err_len, "region fd is not a memfd or regular file");
                return EPD_INVALID_ARGUMENT;
        }
        /* Seal before reading the size: the client still holds the file and could shrink it
         * between the check and the seal, and a mapping past the file's end faults (SIGBUS) on
         * the daemon's first access. */
        /* Outputs are written into regions, and sealing needs write access too: a read-only
         * descriptor (such as /proc/PID/fd/N reopened O_RDONLY) is refused for what it is. */
        if ((fcntl(fd, F_GETFL) & O_ACCMODE) != O_RDWR) {
                snprintf(err, err_len,
                         "region fd is not open for reading and writing (O_RDWR): the daemon writes outputs into regions");
                return EPD_INVALID_ARGUMENT;
        }
        seals = fcntl(fd, F_GET_SEALS);
        if (seals < 0 || (!(seals & F_SEAL_SHRINK) && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0)) {
                snprintf(err, err_len,
                         "memfd must allow sealing (MFD_ALLOW_SEALING) so that it cannot shrink under the daemon");
                return EPD_INVALID_ARGUMENT;
        }
        if (fstat(fd, &st) < 0) {
                snprintf(err, err_len, "cannot read the region file's size: %s", strerror(errno));
                return EPD_INVALID_ARGUMENT;
        }
        if (offset > (uint64_t)st.st_size || size > (uint64_t)st.st_size - offset) {
                snprintf(err, err_len,
                         "region of %llu bytes at offset %llu exceeds the file's %lld bytes",
                         (unsigned long long)size, (unsigned long long)offset,
                         (long long)st.st_size);
                return EPD_INVALID_ARGUMENT;
        }
        map_off = offset / page * page;
        p = mmap(NULL, offset - map_off + size, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 (off_t)map_off);
        if (p == MAP_FAILED) {
                snprintf(err, err_len, "mmap of region failed: %s", strerror(errno));
                return EPD_INVALID_ARGUMENT;
        }
        *lead = offset - map_off;
        *base = (uint8_t *)p + *lead;
        return 0;
}

void epd__memfd_unmap(uint8_t *base, uint64_t lead, uint64_t size)
{
        if (base)
                munmap(base - lead, lead + size);
}

int epd__memfd_arena(uint64_t bytes, uint8_t **base, int *fd_out, char *err, size_t err_len)
{
        int fd = memfd_create("epd-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        void *p;

        /* Sealed against growing and shrinking: the client maps exactly this size. */
        if (fd < 0 || ftruncate(fd, (off_t)bytes) < 0 ||
            fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0) {
                snprintf(err, err_len, "cannot create a %llu-byte output arena: %s",
                         (unsigned long long)bytes, strerror(errno));
                if (fd >= 0)
                        close(fd);
                return EPD_UNAVAILABLE;
        }
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
                snprintf(err, err_len, "cannot map the output arena: %s", strerror(errno));
                close(fd);
                return EPD_UNAVAILABLE;
        }
        *base = p;
        *fd_out = fd;
        return 0;
}

#define RESERVE_FLAGS (MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)

int epd__va_reserve(uint64_t bytes, uint8_t **base, char *err, size_t err_len)
{
        void *p = mmap(NULL, bytes, PROT_NONE, RESERVE_FLAGS, -1, 0);

        if (p == MAP_FAILED) {
                snprintf(err, err_len, "cannot reserve %llu bytes of address space: %s",
                         (unsigned long long)bytes, strerror(errno));
                return EPD_UNAVAILABLE;
        }
        *base = p;
        return 0;
}

void epd__va_unreserve(uint8_t *base, uint64_t bytes)
{
        if (base)
                munmap(base, bytes);
}

int epd__memfd_segment(uint8_t *addr, uint64_t bytes, int *fd_out, char *err, size_t err_len)
{
        int fd = memfd_create("epd-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        void *p;

        /* Sealed against growing and shrinking: the client maps exactly this size, and a
         * client that could shrink it would make the daemon fault. */
        if (fd < 0 || ftruncate(fd, (off_t)bytes) < 0 ||
            fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0) {
                snprintf(err, err_len, "cannot create a %llu-byte arena segment: %s",
                         (unsigned long long)bytes, strerror(errno));
                if (fd >= 0)
                        close(fd);
                return EPD_UNAVAILABLE;
        }
        p = mmap(addr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
        if (p == MAP_FAILED) {
                snprintf(err, err_len, "cannot map an arena segment: %s", strerror(errno));
                close(fd);
                return EPD_UNAVAILABLE;
        }
        *fd_out = fd;
        return 0;
}

void epd__memfd_segment_drop(uint8_t *addr, uint64_t bytes)
{
        /* MAP_FIXED replaces the segment's mapping in one step: the range never becomes free
         * address space that another mapping of this process could take. */
        (void)mmap(addr, bytes, PROT_NONE, RESERVE_FLAGS | MAP_FIXED, -1, 0);
}
