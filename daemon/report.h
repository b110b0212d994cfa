/* report.h - statistics snapshots (report.c). Loop thread. */
#ifndef EPD_DAEMON_REPORT_H
#define EPD_DAEMON_REPORT_H

#include "daemon.h"

struct epdd_report {
        void *pool;                   /* every allocation of the snapshot */
};

/* Fills out from the daemon's counters; mem owns the allocations (epd_report_free). */
int epd_report_build(struct epdd_daemon *d, Epd__V1__StatsReply *out, struct epdd_report *mem);
void epd_report_free(struct epdd_report *mem);
void epd_handle_stats(struct epdd_conn *c, const Epd__V1__Request *req);

#endif
