/* report_json.c - one JSON object per line per op and phase on stdout (--json). Keys that belong
 * to a mode are null outside it. With --backend cuda --devices N >= 2 (ceilings.c):
 *   p2p_store_pairs            [{src, dst, gbps, before_gbps, after_gbps, error}] per ordered
 *                              pair of GPUs: GB/s stored (median of the launches before and
 *                              after the workers, and of each set); gbps null and error set when
 *                              the pair could not be measured (no peer access, a CUDA error)
 *   p2p_store_concurrent_gbps  aggregate GB/s of every GPU storing to the next at once (median)
 *   p2p_store_concurrent_device_gbps  [N] each GPU's own GB/s in that measurement
 *   p2p_store_bytes            bytes one launch stores (per GPU)
 *   cross_gpu_floor_bytes      the op's cross-GPU floor bytes (data.c)
 *   cross_gpu_floor_gbps       cross_gpu_floor_bytes / the op's kernel time p50 (the time the
 *                              other GB/s figures use)
 *   cross_gpu_fraction_of_p2p  cross_gpu_floor_gbps / p2p_store_concurrent_gbps
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "util.h"

static json_t *json_real_or_null(double v, int present)
{
        return present ? json_real(v) : json_null();
}

/* p2p_store_pairs: one object per ordered pair of GPUs (see the file comment). */
static json_t *p2p_pairs_json(const struct bench *b, const struct run_info *ri)
{
        json_t *a = json_array();

        for (uint32_t s = 0; s < b->opt.devices; s++) {
                for (uint32_t d = 0; d < b->opt.devices; d++) {
                        const struct p2p_figure *p = &ri->pair[s][d];
                        json_t *o;

                        if (s == d)
                                continue;
                        o = json_object();
                        json_object_set_new(o, "src", json_integer(s));
                        json_object_set_new(o, "dst", json_integer(d));
                        json_object_set_new(o, "gbps", json_real_or_null(p->gbps, p->ok));
                        json_object_set_new(o, "before_gbps",
                                            json_real_or_null(p->before, p->before_ok));
                        json_object_set_new(o, "after_gbps",
                                            json_real_or_null(p->after, p->after_ok));
                        json_object_set_new(o, "error", p->why[0] ? json_string(p->why)
                                                                  : json_null());
                        json_array_append_new(a, o);
                }
        }
        return a;
}

/* One JSON line: op k of phase p. */
static void print_json_one(const struct bench *b, const struct run_info *ri, uint32_t p, int k)
{
        static const char *names[2] = { "dispatch", "combine" };
        const int cuda = b->opt.cuda, cx = b->opt.execution == EPD_EXECUTION_CLIENT;
        const struct op_stats *st = &ri->st[p][k];
        double lg = (double)ri->bytes.logical[k] / (st->exec_p50 * 1e3);
        double fl = (double)ri->bytes.floor[k] / (st->exec_p50 * 1e3);
        double un = (double)ri->bytes.unique[k] / (st->exec_p50 * 1e3);
        json_t *o = json_object();
        char *s;

        json_object_set_new(o, "bench", json_string("epd-bench"));
        json_object_set_new(o, "op", json_string(names[k]));
        json_object_set_new(o, "workload", json_string(b->opt.wl->name));
        json_object_set_new(o, "ranks", json_integer(b->R));
        /* The GPUs the ranks use (host backend: every rank binds device 0); the device
         * figure is the whole op either way: one exec serves every rank. */
        json_object_set_new(o, "devices", json_integer(cuda ? b->opt.devices : 1));
        json_object_set_new(o, "daemon_devices", json_integer(ri->devices));
        json_object_set_new(o, "backend", json_string(ri->backend));
        json_object_set_new(o, "execution",
                            json_string(b->opt.execution == EPD_EXECUTION_CLIENT ? "client"
                                                                                 : "daemon"));
        json_object_set_new(o, "mps", json_string(ri->mps));
        json_object_set_new(o, "mps_detail", json_string(ri->mps_detail));
        json_object_set_new(o, "device_name", json_string(ri->device_name));
        json_object_set_new(o, "memory", json_string(b->opt.device_memory ? "device"
                                                                           : "host"));
        json_object_set_new(o, "alloc", json_string(!b->opt.device_memory ? "memfd"
                                                    : b->opt.cumem ? "cumem" : "cudamalloc"));
        json_object_set_new(o, "completion", json_string(b->phase_stream[p]
                                                                ? "stream" : "host"));
        json_object_set_new(o, "flush_l2", json_boolean(b->opt.flush_l2));
        if (b->opt.poll_us_set)
                json_object_set_new(o, "daemon_poll_us", json_integer(b->opt.poll_us));
        else
                json_object_set_new(o, "daemon_poll_us", json_string("default"));
        /* libepd's settings as the workers saw them (unset: libepd's defaults). */
        const char *reply_env = getenv("EPD_CLIENT_REPLY");
        const char *request_env = getenv("EPD_CLIENT_REQUEST");
        const char *poll_env = getenv("EPD_CLIENT_POLL_US");
        const char *spin_env = getenv("EPD_CLIENT_SPIN_US");
        json_object_set_new(o, "client_reply", json_string(reply_env ? reply_env : "default"));
        json_object_set_new(o, "client_request",
                            json_string(request_env ? request_env : "default"));
        json_object_set_new(o, "client_poll_us", json_string(poll_env ? poll_env : "default"));
        json_object_set_new(o, "client_spin_us", json_string(spin_env ? spin_env : "default"));
        json_object_set_new(o, "extra_regions", json_integer(b->opt.extra_regions));
        /* Client-executed ranks on one GPU: started together at the gate, or free. */
        json_object_set_new(o, "start", b->cx_one_gpu ? json_string(b->opt.start_free ? "free"
                                                                                      : "gate")
                                                      : json_null());
        json_object_set_new(o, "git_rev", json_string(epd_git_rev));
        json_object_set_new(o, "tokens", json_integer(b->T));
        json_object_set_new(o, "nominal_tokens", json_integer(b->opt.wl->tokens));
        json_object_set_new(o, "scaled", json_boolean(ri->scaled));
        json_object_set_new(o, "hidden", json_integer(b->H));
        json_object_set_new(o, "topk", json_integer(b->K));
        json_object_set_new(o, "experts", json_integer(b->E));
        json_object_set_new(o, "dtype", json_string(dtype_name(b->opt.wl->dtype)));
        json_object_set_new(o, "layout", json_string(b->opt.layout == EPD_LAYOUT_EXPAND
                                                             ? "expand" : "non-expand"));
        json_object_set_new(o, "outputs", json_string(b->opt.use_arena ? "arena"
                                                                       : "regions"));
        json_object_set_new(o, "seed", json_integer((json_int_t)b->opt.seed));
        json_object_set_new(o, "iters", json_integer(b->opt.iters));
        json_object_set_new(o, "warmup", json_integer(b->opt.warmup));
        json_object_set_new(o, "host_threads", json_integer(b->threads));
        json_object_set_new(o, "cpus", json_integer(b->cpus));
        json_object_set_new(o, "verified", json_true());
        json_object_set_new(o, "rows", json_integer((json_int_t)ri->bytes.rows));
        json_object_set_new(o, "logical_bytes", json_integer((json_int_t)ri->bytes.logical[k]));
        json_object_set_new(o, "floor_bytes", json_integer((json_int_t)ri->bytes.floor[k]));
        json_object_set_new(o, "data_bytes", json_integer((json_int_t)ri->bytes.data));
        json_object_set_new(o, cuda ? "gpu_l2_bytes" : "llc_bytes",
                            json_integer((json_int_t)ri->llc));
        json_object_set_new(o, "time_basis", json_string(b->device_window ? "device_window"
                                                         : cx && !b->kernel_time
                                                                 ? "launch_to_completion"
                                                         : b->kernel_time ? "kernel_ns"
                                                                          : "exec_ns"));
        json_object_set_new(o, "kernel_time_p50_us", json_real(st->exec_p50));
        json_object_set_new(o, "kernel_time_p99_us", json_real(st->exec_p99));
        json_object_set_new(o, "e2e_p50_us", json_real(st->e2e_p50));
        json_object_set_new(o, "e2e_p99_us", json_real(st->e2e_p99));
        json_object_set_new(o, "e2e_max_us", json_real(st->e2e_max));
        /* Client-executed ops pass through no daemon: its overhead and timeline are null. */
#define DAEMON_ONLY(v) json_real_or_null((v), !cx)
        json_object_set_new(o, "daemon_overhead_p50_us", DAEMON_ONLY(st->ovh_p50));
        json_object_set_new(o, "daemon_overhead_p99_us", DAEMON_ONLY(st->ovh_p99));
        /* What the last rank to submit (daemon) or launch (client) waits beyond its own kernel
         * (docs/benchmarks.md); the host backend's client-executed ops have no kernel. */
        json_object_set_new(o, "last_rank_wait_p50_us",
                            json_real_or_null(st->last_ovh_p50, !cx || b->kernel_time));
        json_object_set_new(o, "last_rank_wait_p99_us",
                            json_real_or_null(st->last_ovh_p99, !cx || b->kernel_time));
        /* Its floor: an empty kernel's launch to synchronised, the median over the ranks. */
        json_object_set_new(o, "launch_floor_us",
                            json_real_or_null(launch_floor_us(b), b->device_window));
        json_object_set_new(o, "daemon_overhead_last_submitter_p50_us",
                            DAEMON_ONLY(st->last_ovh_p50));
        json_object_set_new(o, "daemon_overhead_last_submitter_p99_us",
                            DAEMON_ONLY(st->last_ovh_p99));
        json_object_set_new(o, "daemon_overhead_group_p50_us", DAEMON_ONLY(st->group_ovh_p50));
        json_object_set_new(o, "daemon_overhead_group_p99_us", DAEMON_ONLY(st->group_ovh_p99));
        json_object_set_new(o, "replies_in_doorbell", DAEMON_ONLY(st->replies_in_doorbell));
        json_object_set_new(o, "requests_in_doorbell", DAEMON_ONLY(st->requests_in_doorbell));
        json_object_set_new(o, "queue_p50_us", DAEMON_ONLY(st->queue_p50));
        json_object_set_new(o, "last_submitter_queue_p50_us", DAEMON_ONLY(st->last_queue_p50));
        json_object_set_new(o, "last_submitter_host_exec_p50_us",
                            DAEMON_ONLY(st->last_host_exec_p50));
        json_object_set_new(o, "last_submitter_socket_loop_p50_us", DAEMON_ONLY(st->last_rest_p50));
        json_t *tl = json_object();
        for (int j = 0; j < TL_STEPS; j++)
                json_object_set_new(tl, tl_step_names[j], DAEMON_ONLY(st->last_tl_p50[j]));
        json_object_set_new(o, "last_submitter_timeline_p50_us", cx ? json_null() : tl);
        if (cx)
                json_decref(tl);
#undef DAEMON_ONLY
        json_object_set_new(o, "logical_gbps", json_real(lg));
        json_object_set_new(o, "floor_gbps", json_real(fl));
        json_object_set_new(o, "floor_fraction_of_ceiling", json_real(fl / ri->ceiling));
        json_object_set_new(o, "ceiling_kind", json_string(cuda ? "d2d_copy"
                                                                : "host_memcpy"));
        json_object_set_new(o, "unique_bytes", json_integer((json_int_t)ri->bytes.unique[k]));
        json_object_set_new(o, "unique_gbps", json_real(un));
        json_object_set_new(o, "unique_fraction_of_ceiling", json_real(un / ri->ceiling));
        json_object_set_new(o, "ceiling_memcpy_gbps", json_real_or_null(ri->ceiling, !cuda));
        json_object_set_new(o, "ceiling_memcpy_probes",
                            cuda ? json_null() : json_integer(ri->num_probes));
        json_object_set_new(o, "ceiling_memcpy_initial_gbps",
                            json_real_or_null(ri->ceiling_initial, !cuda));
        json_object_set_new(o, "ceiling_memcpy_min_gbps",
                            json_real_or_null(ri->ceiling_min, !cuda));
        json_object_set_new(o, "ceiling_memcpy_best_gbps",
                            json_real_or_null(ri->ceiling_best, !cuda));
        json_object_set_new(o, "floor_fraction_of_best_ceiling",
                            json_real(fl / ri->ceiling_best));
        json_object_set_new(o, "ceiling_buffer_bytes",
                            json_integer((json_int_t)(cuda ? D2D_BYTES : CEILING_BYTES)));
        json_object_set_new(o, "ceiling_threads", cuda ? json_null()
                                                       : json_integer(b->threads));
        json_object_set_new(o, "ceiling_d2d_gbps", json_real_or_null(ri->ceiling, cuda));
        json_object_set_new(o, "ceiling_d2d_before_gbps",
                            json_real_or_null(ri->ceiling_initial, cuda));
        json_object_set_new(o, "ceiling_d2d_after_gbps",
                            json_real_or_null(ri->d2d_after, cuda));
        json_object_set_new(o, "ceiling_d2d_min_gbps",
                            json_real_or_null(ri->ceiling_min, cuda));
        json_object_set_new(o, "ceiling_d2d_best_gbps",
                            json_real_or_null(ri->ceiling_best, cuda));
        json_object_set_new(o, "ceiling_d2d_copies",
                            cuda ? json_integer(ri->num_probes) : json_null());
        json_object_set_new(o, "daemon_workspace_bytes",
                            cuda ? json_integer((json_int_t)ri->ws_bytes) : json_null());
        json_object_set_new(o, "daemon_workspace_bytes_per_rank",
                            cuda ? json_integer((json_int_t)(ri->ws_bytes / b->R))
                                 : json_null());
        json_object_set_new(o, "arena_bytes_per_rank",
                            json_integer((json_int_t)b->arena_bytes));
        /* --devices >= 2 in CUDA mode: the P2P store ceiling and the op's cross-GPU floor bytes
         * (the file comment); null otherwise, and a fraction only with a concurrent figure. */
        {
                const int p2p = ri->p2p && ri->bytes.cross_valid;
                const int timed = st->exec_p50 > 0;
                double cg = timed ? (double)ri->bytes.cross[k] / (st->exec_p50 * 1e3) : 0;
                json_t *dev = NULL;

                if (p2p && ri->ring.ok) {
                        dev = json_array();
                        for (uint32_t d = 0; d < b->opt.devices; d++)
                                json_array_append_new(dev, json_real(ri->ring_dev[d]));
                }
                json_object_set_new(o, "p2p_store_pairs", p2p ? p2p_pairs_json(b, ri)
                                                              : json_null());
                json_object_set_new(o, "p2p_store_concurrent_gbps",
                                    json_real_or_null(ri->ring.gbps, p2p && ri->ring.ok));
                json_object_set_new(o, "p2p_store_concurrent_device_gbps",
                                    dev ? dev : json_null());
                json_object_set_new(o, "p2p_store_bytes",
                                    p2p ? json_integer((json_int_t)P2P_BYTES) : json_null());
                json_object_set_new(o, "cross_gpu_floor_bytes",
                                    p2p ? json_integer((json_int_t)ri->bytes.cross[k])
                                        : json_null());
                json_object_set_new(o, "cross_gpu_floor_gbps", json_real_or_null(cg, p2p && timed));
                json_object_set_new(o, "cross_gpu_fraction_of_p2p",
                                    json_real_or_null(ri->ring.gbps > 0 ? cg / ri->ring.gbps : 0,
                                                      p2p && timed && ri->ring.ok &&
                                                              ri->ring.gbps > 0));
        }
        if (cx) {
                /* Where a client-executed op's time goes, per rank (epd_cx_status). */
                json_t *ranks = json_array();

                for (uint32_t r = 0; r < b->R; r++)
                        json_array_append_new(ranks, json_pack("{s:f,s:f,s:f}", "exchange",
                                                               b->cx_phase_us[r][k][0], "move",
                                                               b->cx_phase_us[r][k][1], "finish",
                                                               b->cx_phase_us[r][k][2]));
                json_object_set_new(o, "client_phase_us_per_rank", ranks);
        }
        if (b->device_window && k == OP_DISPATCH) {
                /* Dispatch's first phase in parts, per rank (epd_cx_status.dispatch_first_ns). */
                json_t *ranks = json_array();

                for (uint32_t r = 0; r < b->R && r < GATE_RANKS; r++) {
                        const double *u = b->gate->first_us[r];

                        json_array_append_new(ranks, json_pack("{s:f,s:f,s:f,s:f,s:f,s:f}",
                                                               "check", u[0], "publish", u[1],
                                                               "wait", u[2], "verdict", u[3],
                                                               "place", u[4], "counts", u[5]));
                }
                json_object_set_new(o, "client_dispatch_first_us_per_rank", ranks);
        }
        s = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (s)
                printf("%s\n", s);
        free(s);
        json_decref(o);
}

void print_json(const struct bench *b, const struct run_info *ri)
{
        for (uint32_t p = 0; p < b->num_phases; p++)
                for (int k = 0; k < 2; k++)
                        print_json_one(b, ri, p, k);
        fflush(stdout);
}
