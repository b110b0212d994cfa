/* report_table.c - the human-readable table of a run (stdout, or stderr with --json): the
 * setup, the ceilings, one line per op and phase, and the overhead breakdown. */
#include <stdio.h>

#include "bench.h"
#include "util.h"

const char *dtype_name(enum epd_dtype d)
{
        return d == EPD_DTYPE_BF16 ? "bf16" : "fp8_e4m3";
}

const char *phase_name(const struct bench *b, uint32_t p)
{
        return b->phase_stream[p] ? "stream" : "host";
}

/* One P2P figure for the table: the median of both sets, each set's, or why it is missing. */
static void print_p2p_figure(const struct p2p_figure *p, FILE *f)
{
        if (!p->ok) {
                fprintf(f, "NOT MEASURED: %s\n", p->why);
                return;
        }
        fprintf(f, "%.2f GB/s (before the workers ", p->gbps);
        if (p->before_ok)
                fprintf(f, "%.2f", p->before);
        else
                fprintf(f, "FAILED");
        fprintf(f, ", after ");
        if (p->after_ok)
                fprintf(f, "%.2f", p->after);
        else
                fprintf(f, "FAILED");
        fprintf(f, ")%s%s\n", p->why[0] ? ": " : "", p->why);
}

/* --devices >= 2: the P2P store ceiling, one line per ordered pair and the all-at-once one. */
static void print_p2p(const struct bench *b, const struct run_info *ri, FILE *f)
{
        uint32_t n = b->opt.devices;

        fprintf(f, "  peer-to-peer store ceiling (a kernel on the source GPU storing 16-byte "
                   "vectors into %.0f MiB on the target, bytes stored, event-timed; median of "
                   "%d launches before and %d after the workers):\n",
                (double)P2P_BYTES / 1048576.0, P2P_REPS, P2P_REPS);
        for (uint32_t s = 0; s < n; s++) {
                for (uint32_t d = 0; d < n; d++) {
                        if (s == d)
                                continue;
                        fprintf(f, "    GPU %u -> GPU %u: ", s, d);
                        print_p2p_figure(&ri->pair[s][d], f);
                }
        }
        fprintf(f, "    all at once, GPU d -> GPU (d + 1) %% %u, aggregate (every GPU's bytes over "
                   "the slowest GPU's time): ", n);
        print_p2p_figure(&ri->ring, f);
        if (ri->ring.ok) {
                fprintf(f, "      per GPU in it:");
                for (uint32_t d = 0; d < n; d++)
                        fprintf(f, " GPU %u %.2f GB/s%s", d, ri->ring_dev[d], d + 1 < n ? "," : "");
                fprintf(f, "\n");
        }
        if (ri->ring_serialized)
                fprintf(f, "      WARNING: in %d of %d timed rounds the GPUs' kernels did not "
                           "overlap (the round took over 1.25 x the slowest GPU's kernel): the "
                           "aggregate above is too high\n",
                        ri->ring_serialized, ri->ring_rounds);
}

/* --devices >= 2: the ops' cross-GPU floor bytes against the all-at-once P2P store ceiling. */
static void print_cross(const struct bench *b, const struct run_info *ri, FILE *f)
{
        static const char *names[2] = { "dispatch", "combine" };
        const struct byte_counts *bc = &ri->bytes;

        fprintf(f, "  cross-GPU floor bytes (%llu of %llu received rows have their source and "
                   "destination ranks on different GPUs; dispatch: the floor's row bytes, "
                   "combine: the bf16 y row), against the all-at-once P2P store ceiling%s:\n",
                (unsigned long long)bc->cross_rows, (unsigned long long)bc->rows,
                ri->ring.ok ? "" : " (NOT MEASURED, so no fraction)");
        for (uint32_t p = 0; p < b->num_phases; p++) {
                for (int k = 0; k < 2; k++) {
                        const struct op_stats *st = &ri->st[p][k];
                        double g = (double)bc->cross[k] / (st->exec_p50 * 1e3);

                        fprintf(f, "    %s [%s]: %.1f MB = %.2f GB/s at the kernel p50", names[k],
                                phase_name(b, p), (double)bc->cross[k] / 1e6, g);
                        if (ri->ring.ok)
                                fprintf(f, ", %.1f%% of %.2f GB/s", 100.0 * g / ri->ring.gbps,
                                        ri->ring.gbps);
                        fprintf(f, "\n");
                }
        }
}

void print_table(const struct bench *b, const struct run_info *ri, FILE *f)
{
        static const char *names[2] = { "dispatch", "combine" };
        const struct byte_counts *bc = &ri->bytes;
        const int cuda = b->opt.cuda;

        fprintf(f, "\nepd-bench %s: %u ranks, T=%u%s, H=%u, top-k %u of %u experts, %s, %s, "
                   "%s outputs, seed %llu\n",
                b->opt.wl->name, b->R, b->T,
                ri->scaled ? " (SCALED)" : "", b->H, b->K, b->E,
                dtype_name(b->opt.wl->dtype),
                b->opt.layout == EPD_LAYOUT_EXPAND ? "expand" : "non-expand",
                b->opt.use_arena ? "arena" : "client-region", (unsigned long long)b->opt.seed);
        if (b->opt.execution == EPD_EXECUTION_CLIENT)
                fprintf(f, "  client-executed: each worker runs its own ops (epd_cx_*), outputs "
                           "in the group's buffers; %s\n",
                        b->device_window && !b->opt.start_free
                                ? "ranks start each op at a common gate after their flushes; "
                                  "time = the device figure, first rank's kernel start to last "
                                  "rank's end on the GPU clock; last-sub = the last rank to "
                                  "launch: launch to completion seen, less its own kernel"
                        : b->device_window
                                ? "ranks launch each op as they get to it (--start free); "
                                  "time = the device figure, the ranks' skew included; last-sub "
                                  "= the last rank to launch: launch to completion seen, less "
                                  "its own kernel"
                        : b->kernel_time ? "time = each rank's kernel, the slowest rank's"
                                         : "time = the worker's launch to completion");
        if (ri->scaled)
                fprintf(f, "  SCALED: %u tokens per rank instead of the workload's %u (--tokens)\n",
                        b->T, b->opt.wl->tokens);
        if (cuda)
                fprintf(f, "  backend %s on %s, ranks on %u device(s) (rank r on r %% %u; the "
                           "daemon has %u), %s memory, MPS %s (%s), rev %s\n",
                        ri->backend, ri->device_name, b->opt.devices, b->opt.devices,
                        ri->devices,
                        !b->opt.device_memory ? "host (memfd)"
                        : b->opt.cumem        ? "device (cuMem, epd_device_alloc)"
                                              : "device (cudaMalloc, CUDA IPC)",
                        ri->mps,
                        ri->mps_detail, epd_git_rev);
        else
                fprintf(f, "  backend %s, every rank on device 0 (the daemon has %u), MPS %s, %u "
                           "host threads, %u CPUs, rev %s\n",
                        ri->backend, ri->devices, ri->mps, b->threads, b->cpus, epd_git_rev);
        fprintf(f, "  %u measured iterations after %u warm-up per phase (%s); iteration 0 "
                   "verified bitwise%s\n",
                b->opt.iters, b->opt.warmup,
                b->num_phases == 2 ? "host-wait, then stream-ordered"
                                   : b->phase_stream[0] ? "stream-ordered" : "host-wait",
                cuda ? (b->opt.flush_l2 ? "; Fresh mode: 256 MB written on the GPU before "
                                          "every op"
                                        : "; no L2 flush (warm L2)")
                     : "");
        fprintf(f, "  data per dispatch %.1f MiB (inputs + outputs); %s %.1f MiB%s\n",
                (double)bc->data / 1048576.0, cuda ? "GPU L2" : "last-level cache",
                (double)ri->llc / 1048576.0,
                ri->llc == 0 ? " (unknown)" : bc->data > ri->llc ? ": data is larger"
                                                                 : ": DATA FITS IN THE CACHE");
        if (cuda) {
                fprintf(f, "  device-to-device copy ceiling (cudaMemcpyAsync of %.0f MiB, bytes "
                           "read + written, event-timed): %.2f GB/s = median of %u copies; %.2f "
                           "before the workers, %.2f after; all copies %.2f .. %.2f\n",
                        (double)D2D_BYTES / 1048576.0, ri->ceiling, ri->num_probes,
                        ri->ceiling_initial, ri->d2d_after, ri->ceiling_min, ri->ceiling_best);
                if (ri->p2p)
                        print_p2p(b, ri, f);
                fprintf(f, "  daemon workspace: %.2f MiB per live dispatch handle of the group "
                           "= %.2f MiB per rank (device memory); output arena %.2f MiB per rank "
                           "(host memory%s)\n",
                        (double)ri->ws_bytes / 1048576.0,
                        (double)ri->ws_bytes / b->R / 1048576.0,
                        (double)b->arena_bytes / 1048576.0,
                        b->opt.use_arena ? "" : ", unused: outputs are client regions");
        } else {
                fprintf(f, "  host memcpy ceiling (2 x %.0f MiB buffers, %u threads, bytes read + "
                           "written): %.2f GB/s = median of %u probes between the measured "
                           "iterations; %.2f before the workers started (median of %d); all "
                           "copies %.2f .. %.2f\n",
                        (double)CEILING_BYTES / 1048576.0, b->threads, ri->ceiling,
                        ri->num_probes, ri->ceiling_initial, CEILING_REPS, ri->ceiling_min,
                        ri->ceiling_best);
        }
        if (b->opt.execution == EPD_EXECUTION_CLIENT)
                fprintf(f, "\n");
        else if (b->kernel_time)
                fprintf(f, "  time = the GPU time of the op's kernels as the daemon reports it "
                           "(kernel_ns, one exec for every rank: the device figure)%s; GB = 1e9 "
                           "bytes\n\n",
                        cuda ? "" : "; the ceiling above is the HOST memcpy, not the device copy "
                                    "a GPU run is bounded by");
        else
                fprintf(f, "  time = the backend's exec time of the whole op (the host backend runs "
                           "all ranks in one exec: the device figure); GB = 1e9 bytes\n\n");
        fprintf(f, "%-16s %9s %11s %11s %10s %9s %9s %8s %10s %10s %10s %9s %9s %9s %9s\n",
                "op", "rows", "logical MB", "floor MB", cuda ? "kernel p50" : "exec p50",
                "logic", "floor", "floor/", "e2e p50", "e2e p99", "e2e max", "ovh p50",
                "ovh p99", "last-sub", "last-sub");
        fprintf(f, "%-16s %9s %11s %11s %10s %9s %9s %8s %10s %10s %10s %9s %9s %9s %9s\n",
                "", "", "", "", "us", "GB/s", "GB/s", "ceiling", "us", "us", "us", "us", "us",
                "ovh p50", "ovh p99");
        for (uint32_t p = 0; p < b->num_phases; p++) {
                for (int k = 0; k < 2; k++) {
                        const struct op_stats *st = &ri->st[p][k];
                        double lg = (double)bc->logical[k] / (st->exec_p50 * 1e3);
                        double fl = (double)bc->floor[k] / (st->exec_p50 * 1e3);
                        char label[32];

                        snprintf(label, sizeof(label), "%s%s%s%s", names[k],
                                 cuda ? " [" : "", cuda ? phase_name(b, p) : "", cuda ? "]" : "");
                        fprintf(f, "%-16s %9llu %11.1f %11.1f %10.1f %9.2f %9.2f %7.1f%% %10.1f "
                                   "%10.1f %10.1f %9.1f %9.1f %9.1f %9.1f\n",
                                label, (unsigned long long)bc->rows,
                                (double)bc->logical[k] / 1e6, (double)bc->floor[k] / 1e6,
                                st->exec_p50, lg, fl, 100.0 * fl / ri->ceiling, st->e2e_p50,
                                st->e2e_p99, st->e2e_max, st->ovh_p50, st->ovh_p99,
                                st->last_ovh_p50, st->last_ovh_p99);
                }
        }
        fprintf(f, "\n  logical bytes (DeepEP): received rows x (x + scales + topk_idx as int64 + "
                   "fp32 weights); combine: rows sent x (bf16 row + fp32 weights)\n"
                   "  floor bytes: dispatch 2 x rows x row bytes; combine y rows read once + "
                   "combined rows (and weights) written once\n"
                   "  ovh = daemon overhead: client-observed (just before submit to completion "
                   "visible: %s) minus %s, over every rank's samples; last-sub = the same for "
                   "the rank that submitted last\n",
                cuda ? "[host] the reply in epd_op_wait, [stream] the event after "
                       "epd_op_stream_wait"
                     : "the reply in epd_op_wait",
                b->kernel_time ? "kernel time" : "exec");
        /* Client-executed: where each op's kernel time goes, the ranks' mean per phase. */
        for (int k = 0; b->opt.execution == EPD_EXECUTION_CLIENT && k < 2; k++) {
                double ph[3] = { 0, 0, 0 };

                for (uint32_t r = 0; r < b->R; r++)
                        for (int i = 0; i < 3; i++)
                                ph[i] += b->cx_phase_us[r][k][i] / b->R;
                fprintf(f, "  %s kernel phases, mean over ranks and ops (us): records exchanged "
                           "%.1f, rows moved %.1f, end signals %.1f\n",
                        names[k], ph[0], ph[1], ph[2]);
        }
        if (b->device_window) {
                static const char *parts[FIRST_PARTS] = { "inputs checked", "record sent",
                                                           "records here", "verdict",
                                                           "rows placed", "counts written" };
                unsigned n = b->R < GATE_RANKS ? b->R : GATE_RANKS;

                fprintf(f, "  dispatch's first phase in parts, mean over ranks and ops (us):");
                for (size_t i = 0; i < FIRST_PARTS; i++) {
                        double m = 0;

                        for (unsigned r = 0; r < n; r++)
                                m += b->gate->first_us[r][i] / n;
                        fprintf(f, "%s %s %.1f", i ? "," : "", parts[i], m);
                }
                fprintf(f, "\n");
        }
        if (b->device_window)
                fprintf(f, "  launch floor (an empty kernel, launch to synchronised, median over "
                           "ranks): %.1f us, the least last-sub can be\n",
                        launch_floor_us(b));
        /* Client-executed ops pass through no daemon: no overhead to split. */
        for (uint32_t p = 0; b->opt.execution != EPD_EXECUTION_CLIENT && p < b->num_phases; p++) {
                for (int k = 0; k < 2; k++) {
                        const struct op_stats *st = &ri->st[p][k];
                        fprintf(f, "  last-sub overhead, %s%s%s%s, p50 per step (us):", names[k],
                                cuda ? " [" : "", cuda ? phase_name(b, p) : "",
                                cuda ? "]" : "");
                        for (int j = 0; j < TL_STEPS; j++)
                                fprintf(f, " %s %.1f", tl_step_names[j], st->last_tl_p50[j]);
                        fprintf(f, "\n    group overhead (last submission to last completion, "
                                   "less the op) p50 %.1f p99 %.1f us; requests / replies in "
                                   "doorbell pages %.0f%% / %.0f%%\n",
                                st->group_ovh_p50, st->group_ovh_p99,
                                100.0 * st->requests_in_doorbell,
                                100.0 * st->replies_in_doorbell);
                }
        }
        for (int k = 0; k < 2; k++) {
                double u = (double)bc->unique[k] / (ri->st[0][k].exec_p50 * 1e3);
                double fl = (double)bc->floor[k] / (ri->st[0][k].exec_p50 * 1e3);
                fprintf(f, "  %s: floor %.1f%% of the best single copy (%.2f GB/s); unique bytes "
                           "(each distinct byte read or written once) %.1f MB = %.2f GB/s, %.1f%% "
                           "of the ceiling\n",
                        names[k], 100.0 * fl / ri->ceiling_best, ri->ceiling_best,
                        (double)bc->unique[k] / 1e6, u, 100.0 * u / ri->ceiling);
        }
        if (ri->p2p && bc->cross_valid)
                print_cross(b, ri, f);
}
