/* stats.h - counters and latency histograms. Updated on the loop thread only (which owns every
 * object they live in), so the hot path takes no lock. */
#ifndef EPD_DAEMON_STATS_H
#define EPD_DAEMON_STATS_H

#include <stdint.h>

#include "epd.h"

/* Bucket i counts latencies below 2^i microseconds (the last bucket is open-ended). */
#define EPD_LAT_BUCKETS 24

struct epdd_latency_hist {
        uint64_t buckets[EPD_LAT_BUCKETS];
        uint64_t count;
        uint64_t sum_ns;
        uint64_t max_ns;
};

struct epdd_op_stats {
        uint64_t ops;
        uint64_t bytes;
        uint64_t errors[EPD_STATUS_COUNT];
        struct epdd_latency_hist latency;
};

struct epdd_rank_stats {
        struct epdd_op_stats kind[2];  /* dispatch, combine */
};

/* Where a group's successful ops spent their time (epd_stage_names):
 *   peers   from the first rank's request to the last rank's: the wait for the slowest rank;
 *   daemon  from the last request read to the last reply sent, less the GPU time: the daemon's
 *           own share (with the host backend, whose ops have no GPU time, the execution too);
 *   gpu     the op's kernel time (CUDA backend only). */
enum { EPD_STAGE_PEERS, EPD_STAGE_DAEMON, EPD_STAGE_GPU, EPD_STAGES };
extern const char *const epd_stage_names[EPD_STAGES];
/* Op kinds as statistics and metrics name them: [0] dispatch, [1] combine. */
extern const char *const epd_op_kind_names[2];

struct epdd_group_stats {
        uint64_t ops_completed;
        uint64_t ops_failed;
        struct epdd_op_stats kind[2];
        struct epdd_latency_hist stage[2][EPD_STAGES]; /* [kind][stage] */
};

struct epdd_client_stats {
        uint64_t requests;
        uint64_t ops;
};

struct epdd_daemon_stats {
        uint64_t ops_completed;
        uint64_t ops_failed;
        uint64_t frames_in;
        uint64_t frames_out;
        uint64_t mailbox_replies;     /* replies through doorbell pages, not frames */
        uint64_t mailbox_requests;    /* requests through doorbell pages, not frames */
        uint64_t protocol_errors;
        uint64_t clients_accepted;
        uint64_t clients_refused;
        struct {
                uint64_t ops;         /* rank-ops executed for ranks on this device */
                uint64_t bytes;
        } devices[64];
};

void epd_latency_record(struct epdd_latency_hist *h, uint64_t ns);
/* Approximate quantile (upper bucket bound, capped by max) in nanoseconds. */
uint64_t epd_latency_quantile(const struct epdd_latency_hist *h, double q);
void epd_op_stats_record(struct epdd_op_stats *s, int status, uint64_t bytes, uint64_t ns);

#endif
