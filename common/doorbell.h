/* doorbell.h - the per-rank doorbell page: 64-bit sequence words in daemon-owned host memory,
 * shared with the rank's client, that order the client's CUDA stream and the daemon's streams
 * without a host round trip (DESIGN.md section 2, "Stream ordering").
 *
 *   completed     written by the daemon: how many of this rank's ops (since it was bound) have
 *                 finished, successfully or not. Its streams write it with cuStreamWriteValue64
 *                 once the op's last kernel is done; the loop thread also stores it (release)
 *                 when the op completes, and when a rank's client dies the daemon completes
 *                 every doorbell its peers wait on. A client stream waits with
 *                 cuStreamWaitValue64(completed >= n) for its n-th op, then reads the status on
 *                 the host when it needs it.
 *   inputs_ready  written by the client's stream (cuStreamWriteValue64) when the inputs of its
 *                 k-th request are ready; the daemon's streams wait for it before reading them.
 *                 When the client dies or the wait outlives the op timeout, the daemon stores
 *                 EPD_DOORBELL_RELEASED from the host so its own streams cannot hang.
 *
 * Both words live in host memory registered with CUDA in both processes: a CPU store and a GPU
 * stream memory operation on it are ordered at system scope, which is the scope that two
 * processes (and the CPU) share. Each word has its own 64-byte line so the two writers never
 * share a cache line.
 */
#ifndef EPD_COMMON_DOORBELL_H
#define EPD_COMMON_DOORBELL_H

#include <stdint.h>

#define EPD_DOORBELL_BYTES 4096u
#define EPD_DOORBELL_RELEASED (UINT64_MAX / 2)

struct epd_doorbell {
        volatile uint64_t completed;
        uint64_t pad0[7];
        volatile uint64_t inputs_ready;
        uint64_t pad1[7];
};

#endif
