/* stats.c - latency histograms and op counters. */
#include "stats.h"

const char *const epd_stage_names[EPD_STAGES] = { "peers", "daemon", "gpu" };
const char *const epd_op_kind_names[2] = { "dispatch", "combine" };

void epd_latency_record(struct epdd_latency_hist *h, uint64_t ns)
{
        uint64_t us = ns / 1000;
        unsigned b = 0;

        while (b < EPD_LAT_BUCKETS - 1 && us >= (1ull << b))
                b++;
        h->buckets[b]++;
        h->count++;
        h->sum_ns += ns;
        if (ns > h->max_ns)
                h->max_ns = ns;
}

uint64_t epd_latency_quantile(const struct epdd_latency_hist *h, double q)
{
        uint64_t seen = 0, target;

        if (h->count == 0)
                return 0;
        target = (uint64_t)(q * (double)h->count + 0.5);
        if (target == 0)
                target = 1;
        for (unsigned b = 0; b < EPD_LAT_BUCKETS; b++) {
                seen += h->buckets[b];
                if (seen >= target) {
                        uint64_t bound = (1ull << b) * 1000;
                        /* The last bucket is open-ended: its only upper bound is the max. */
                        if (b == EPD_LAT_BUCKETS - 1)
                                return h->max_ns;
                        return bound < h->max_ns ? bound : h->max_ns;
                }
        }
        return h->max_ns;
}

void epd_op_stats_record(struct epdd_op_stats *s, int status, uint64_t bytes, uint64_t ns)
{
        if (status == EPD_OK) {
                s->ops++;
                s->bytes += bytes;
                epd_latency_record(&s->latency, ns);
        } else if (status < 0 && status > -EPD_STATUS_COUNT) {
                s->errors[-status]++;
        }
}
