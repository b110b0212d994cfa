/* mps_state.c - whether MPS serves this machine's GPUs, for the benchmarks' records
 * (docs/benchmarks.md: every figure says whether MPS was on), shared by epd-bench and
 * epd-floor-probe.
 *
 * The pipe directory is CUDA_MPS_PIPE_DIRECTORY or the default /tmp/nvidia-mps; MPS is "on" when
 * nvidia-cuda-mps-control answers there, "off" when the directory is missing or nothing answers,
 * and "unknown" when the control program is missing but a control pipe exists. The control
 * program runs through popen with a 10 s timeout.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "mps_state.h"

void epd_bench_mps_state(char *state, size_t state_len, char *detail, size_t detail_len)
{
        const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
        char path[PATH_MAX], out[128] = "";
        struct stat st;
        int fifo, rc;
        FILE *p;

        if (!dir || !*dir)
                dir = "/tmp/nvidia-mps";
        if (stat(dir, &st) != 0) {
                snprintf(state, state_len, "off");
                snprintf(detail, detail_len, "no MPS pipe directory %.200s", dir);
                return;
        }
        snprintf(path, sizeof(path), "%s/control", dir);
        fifo = stat(path, &st) == 0 && S_ISFIFO(st.st_mode);
        fflush(stdout);
        fflush(stderr);
        p = popen("echo get_server_list | PATH=\"$PATH:/usr/local/nvidia/bin\" timeout 10 "
                  "nvidia-cuda-mps-control 2>&1", "r");
        if (!p) {
                snprintf(state, state_len, "unknown");
                snprintf(detail, detail_len, "pipe directory %.200s, but popen failed", dir);
                return;
        }
        if (!fgets(out, sizeof(out), p))
                out[0] = 0;
        while (fgetc(p) != EOF)
                ;
        out[strcspn(out, "\n")] = 0;
        rc = pclose(p);
        if (rc == 0) {
                snprintf(state, state_len, "on");
                snprintf(detail, detail_len,
                         "control daemon answers at %.200s; servers: %.60s", dir,
                         out[0] ? out : "none yet");
        } else if (WIFEXITED(rc) && WEXITSTATUS(rc) == 127) {
                snprintf(state, state_len, "%s", fifo ? "unknown" : "off");
                snprintf(detail, detail_len,
                         "nvidia-cuda-mps-control not found; %s control pipe in %.200s",
                         fifo ? "a" : "no", dir);
        } else {
                snprintf(state, state_len, "off");
                snprintf(detail, detail_len,
                         "no control daemon answers at %.200s (%.60s)", dir, out);
        }
}
