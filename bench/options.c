/* options.c - epd-bench's command line: the options, their defaults and what they imply. Runs
 * in the parent before anything else. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static const struct workload_spec workloads[] = {
        { "prefill", 4096, EPD_DTYPE_FP8_E4M3, 1 },
        { "prefill-bf16", 4096, EPD_DTYPE_BF16, 1 },
        { "decode", 128, EPD_DTYPE_FP8_E4M3, 0 },
        { "tiny", 8, EPD_DTYPE_BF16, 0 },
};

void usage(FILE *f)
{
        fprintf(f,
                "Usage: epd-bench --workload prefill|prefill-bf16|decode|tiny --ranks N --iters N\n"
                "                 [--json] [--socket PATH] [--tokens T] [--layout non-expand|expand]\n"
                "                 [--seed S] [--warmup N] [--threads N] [--outputs arena|regions]\n"
                "                 [--backend host|cuda] [--device-memory|--host-memory]\n"
                "                 [--alloc cudamalloc|cumem] [--devices N] [--flush-l2|--no-flush-l2]\n"
                "                 [--completion host|stream|both] [--stream-order]\n"
                "                 [--execution daemon|client] [--start gate|free]\n\n"
                "Measures dispatch and combine through real client processes, one per rank, as\n"
                "docs/benchmarks.md defines. Without --socket it starts build/bin/epd (host backend,\n"
                "or the CUDA backend with --backend cuda) on a temporary socket and stops it at the\n"
                "end.\n\n"
                "  --workload NAME   prefill (fp8, T=4096, rank r sends T-r), prefill-bf16, decode\n"
                "                    (fp8, T=128), tiny (bf16, T=8; --tokens 1 for the 1-token case)\n"
                "  --ranks N         world size (1..64)\n"
                "  --iters N         measured iterations of dispatch -> combine (default 200)\n"
                "  --warmup N        unmeasured iterations first (default 5, at least 1); iteration\n"
                "                    0 is verified bitwise against the CPU executor\n"
                "  --tokens T        tokens per rank; below the workload's T the run is 'scaled'\n"
                "  --layout L        non-expand (default) or expand\n"
                "  --seed S          data and routing seed (default 1)\n"
                "  --threads N       host backend threads (daemon --host-threads) and memcpy-ceiling\n"
                "                    threads; default: the number of CPUs\n"
                "  --execution X     daemon (default): the daemon runs each op; client: each\n"
                "                    worker runs its own ops in a client-executed group\n"
                "                    (epd_cx_dispatch/combine; host backend: on its own thread,\n"
                "                    cuda: on its stream); on one GPU the op time is the device\n"
                "                    figure (first rank's kernel start to last rank's end, on\n"
                "                    the GPU's clock), on the host backend the launch to the\n"
                "                    completion\n"
                "  --start S         client-executed ranks on one GPU: gate (default) starts every\n"
                "                    rank's op together once all have launched (and flushed), so\n"
                "                    the device figure measures the op, not the ranks' skew;\n"
                "                    free launches each op as the rank gets to it, as an engine\n"
                "                    does, so the last rank's wait carries no gate (use it with\n"
                "                    --no-flush-l2: a peer's flush would run beside the op)\n"
                "  --outputs O       arena (default in host memory): outputs in the daemon's output\n"
                "                    arena; regions: client-registered outputs of exact capacity\n"
                "  --socket PATH     use a running daemon instead of starting one (else the\n"
                "                    one started is $EPD_BENCH_DAEMON if set, or epd beside\n"
                "                    epd-bench)\n"
                "  --json            one JSON object per line per result on stdout (table on stderr)\n"
                "\nCUDA mode:\n"
                "  --backend B       host (default) or cuda: the daemon's backend; with --socket the\n"
                "                    running daemon must have it\n"
                "  --device-memory   (default with cuda) inputs and outputs in each worker's GPU\n"
                "                    memory (see --alloc); outputs are\n"
                "                    client-registered regions (the CUDA backend's arena is host\n"
                "                    memory); the ceiling is the device-to-device copy\n"
                "  --host-memory     host memfds on the CUDA backend instead\n"
                "  --alloc A         device memory from cumem (default: epd_device_alloc, cuMem\n"
                "                    shared as POSIX fds, which the daemon maps itself) or\n"
                "                    cudamalloc (shared as CUDA IPC handles; the daemon's kernels\n"
                "                    reach it at about half speed, docs/performance.md)\n"
                "  --devices N       GPUs to spread the ranks over: rank r on device r %% N (default 1).\n"
                "                    With N >= 2 the run also measures the peer-to-peer store\n"
                "                    ceiling (a kernel storing 16-byte vectors into 1 GiB of the\n"
                "                    other GPU, 10 event-timed launches; median of those before and\n"
                "                    after the workers) for every ordered pair and with every GPU\n"
                "                    d storing to GPU (d + 1) %% N at once (aggregate: all bytes\n"
                "                    over the slowest GPU's time), and each op's cross-GPU floor\n"
                "                    bytes: rows whose source and destination ranks are on\n"
                "                    different GPUs, at the floor's row bytes (dispatch) or the\n"
                "                    bf16 y row (combine). JSON fields, null with N = 1 or the host\n"
                "                    backend:\n"
                "                      p2p_store_pairs [{src, dst, gbps, before_gbps, after_gbps,\n"
                "                        error}]: GB/s stored per ordered pair; gbps null and error\n"
                "                        set when a pair could not be measured\n"
                "                      p2p_store_concurrent_gbps: the all-at-once aggregate\n"
                "                      p2p_store_concurrent_device_gbps: [N] each GPU's own rate\n"
                "                      p2p_store_bytes: bytes stored per launch and GPU\n"
                "                      cross_gpu_floor_bytes, cross_gpu_floor_gbps (the bytes over\n"
                "                        the kernel time p50), cross_gpu_fraction_of_p2p (that\n"
                "                        over p2p_store_concurrent_gbps)\n"
                "  --flush-l2        Fresh mode: write 256 MB on the GPU before every op (in each\n"
                "                    worker, before submit, synchronised); default for decode\n"
                "  --no-flush-l2     never flush\n"
                "  --poll-us N       start the daemon with --poll-us N (0..100000; default: the\n"
                "                    daemon's own default)\n"
                "  --extra-regions N each worker registers N small regions (0..1000) before its\n"
                "                    own and keeps them, as a long-lived process holds many: the\n"
                "                    daemon looks up every tensor of every op among them\n"
                "  --completion C    host (default): the client waits for the reply (epd_op_wait);\n"
                "                    stream: inputs marked ready on the worker's stream, then\n"
                "                    epd_op_stream_wait and an event whose completion ends the\n"
                "                    client-observed time; both: a host phase, then a stream phase\n"
                "                    (each with its own warm-up), reported separately\n"
                "  --stream-order    the same as --completion stream\n");
}

/* The index of s among the NULL-terminated names, or -1. */
static int choice(const char *s, const char *const *names)
{
        for (int i = 0; names[i]; i++)
                if (strcmp(s, names[i]) == 0)
                        return i;
        return -1;
}

#define CHOICE(s, ...) choice((s), (const char *const[]){ __VA_ARGS__, NULL })

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
        char *end;
        unsigned long v;

        errno = 0;
        v = strtoul(s, &end, 0);
        if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi)
                return -1;
        *out = (uint32_t)v;
        return 0;
}

int parse_args(int argc, char **argv, struct options *o)
{
        static const struct option longopts[] = {
                { "workload", required_argument, NULL, 'w' },
                { "ranks", required_argument, NULL, 'r' },
                { "iters", required_argument, NULL, 'i' },
                { "warmup", required_argument, NULL, 'W' },
                { "tokens", required_argument, NULL, 't' },
                { "layout", required_argument, NULL, 'l' },
                { "seed", required_argument, NULL, 's' },
                { "threads", required_argument, NULL, 'T' },
                { "outputs", required_argument, NULL, 'o' },
                { "socket", required_argument, NULL, 'S' },
                { "json", no_argument, NULL, 'j' },
                { "backend", required_argument, NULL, 'B' },
                { "device-memory", no_argument, NULL, 'D' },
                { "host-memory", no_argument, NULL, 'M' },
                { "devices", required_argument, NULL, 'n' },
                { "alloc", required_argument, NULL, 'A' },
                { "flush-l2", no_argument, NULL, 'F' },
                { "no-flush-l2", no_argument, NULL, 'f' },
                { "completion", required_argument, NULL, 'C' },
                { "stream-order", no_argument, NULL, 'O' },
                { "poll-us", required_argument, NULL, 'P' },
                { "extra-regions", required_argument, NULL, 'X' },
                { "execution", required_argument, NULL, 'E' },
                { "start", required_argument, NULL, 'G' },
                { "help", no_argument, NULL, 'h' },
                { NULL, 0, NULL, 0 },
        };
        int c, i;

        memset(o, 0, sizeof(*o));
        o->iters = 200;
        o->warmup = 5;
        o->seed = 1;
        o->use_arena = 1;
        o->layout = EPD_LAYOUT_NON_EXPAND;
        o->device_memory = -1;
        o->cumem = -1;
        o->flush_l2 = -1;
        o->devices = 1;
        while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
                switch (c) {
                case 'w':
                        for (size_t w = 0; w < sizeof(workloads) / sizeof(workloads[0]); w++)
                                if (strcmp(optarg, workloads[w].name) == 0)
                                        o->wl = &workloads[w];
                        if (!o->wl) {
                                fprintf(stderr, "epd-bench: unknown workload '%s'\n", optarg);
                                return -1;
                        }
                        break;
                case 'r':
                        if (parse_u32(optarg, 1, 64, &o->ranks) < 0)
                                goto bad;
                        break;
                case 'i':
                        if (parse_u32(optarg, 1, 10000000, &o->iters) < 0)
                                goto bad;
                        break;
                case 'W':
                        /* At least 1: iteration 0 is verified and faults the outputs in. */
                        if (parse_u32(optarg, 1, 10000000, &o->warmup) < 0)
                                goto bad;
                        break;
                case 't':
                        if (parse_u32(optarg, 1, 1u << 20, &o->tokens) < 0)
                                goto bad;
                        break;
                case 'T':
                        if (parse_u32(optarg, 1, 256, &o->threads) < 0)
                                goto bad;
                        break;
                case 'l':
                        if ((i = CHOICE(optarg, "non-expand", "expand")) < 0)
                                goto bad;
                        o->layout = i ? EPD_LAYOUT_EXPAND : EPD_LAYOUT_NON_EXPAND;
                        break;
                case 'o':
                        if ((i = CHOICE(optarg, "regions", "arena")) < 0)
                                goto bad;
                        o->use_arena = i;
                        o->outputs_given = 1;
                        break;
                case 'B':
                        if ((i = CHOICE(optarg, "host", "cuda")) < 0)
                                goto bad;
                        o->cuda = i;
                        break;
                case 'D':
                        o->device_memory = 1;
                        break;
                case 'M':
                        o->device_memory = 0;
                        break;
                case 'A':
                        if ((i = CHOICE(optarg, "cudamalloc", "cumem")) < 0)
                                goto bad;
                        o->cumem = i;
                        break;
                case 'n':
                        if (parse_u32(optarg, 1, D2D_MAX_DEVICES, &o->devices) < 0)
                                goto bad;
                        break;
                case 'F':
                        o->flush_l2 = 1;
                        break;
                case 'P':
                        if (parse_u32(optarg, 0, 100000, &o->poll_us) < 0)
                                goto bad;
                        o->poll_us_set = 1;
                        break;
                case 'f':
                        o->flush_l2 = 0;
                        break;
                case 'X':
                        if (parse_u32(optarg, 0, 1000, &o->extra_regions) < 0)
                                goto bad;
                        break;
                case 'E':
                        if ((i = CHOICE(optarg, "daemon", "client")) < 0)
                                goto bad;
                        o->execution = i ? EPD_EXECUTION_CLIENT : EPD_EXECUTION_DAEMON;
                        break;
                case 'G':
                        if ((i = CHOICE(optarg, "gate", "free")) < 0)
                                goto bad;
                        o->start_free = i;
                        o->start_given = 1;
                        break;
                case 'C': {
                        static const enum completion modes[] = { COMPLETION_HOST,
                                                                  COMPLETION_STREAM,
                                                                  COMPLETION_BOTH };

                        if ((i = CHOICE(optarg, "host", "stream", "both")) < 0)
                                goto bad;
                        o->completion = modes[i];
                        break;
                }
                case 'O':
                        o->completion = COMPLETION_STREAM;
                        break;
                case 's': {
                        char *end;
                        errno = 0;
                        o->seed = strtoull(optarg, &end, 0);
                        if (errno || end == optarg || *end)
                                goto bad;
                        break;
                }
                case 'S':
                        o->socket = optarg;
                        break;
                case 'j':
                        o->json = 1;
                        break;
                case 'h':
                        usage(stdout);
                        exit(0);
                default:
                        usage(stderr);
                        return -1;
                }
                continue;
bad:
                fprintf(stderr, "epd-bench: bad value '%s'\n", optarg);
                return -1;
        }
        if (optind < argc || !o->wl || !o->ranks) {
                fprintf(stderr, "epd-bench: --workload and --ranks are required\n");
                usage(stderr);
                return -1;
        }
        if (o->execution == EPD_EXECUTION_CLIENT &&
            (o->outputs_given || o->completion != COMPLETION_HOST || o->extra_regions)) {
                fprintf(stderr, "epd-bench: --execution client: outputs land in the group's "
                                "buffers and each op completes on the worker's own thread or "
                                "stream, so --outputs, --completion, --stream-order and "
                                "--extra-regions do not apply\n");
                return -1;
        }
        if (o->start_given && (o->execution != EPD_EXECUTION_CLIENT || !o->cuda)) {
                fprintf(stderr, "epd-bench: --start applies to --execution client on --backend "
                                "cuda only\n");
                return -1;
        }
        if (!o->cuda) {
                if (o->device_memory == 1 || o->flush_l2 == 1 || o->devices != 1 ||
                    o->cumem >= 0 || o->completion != COMPLETION_HOST) {
                        fprintf(stderr, "epd-bench: --device-memory, --alloc, --flush-l2, --devices and "
                                        "stream completion need --backend cuda\n");
                        return -1;
                }
                o->device_memory = 0;
                o->cumem = 0;
                o->flush_l2 = 0;
                return 0;
        }
#ifndef EPD_BENCH_CUDA
        fprintf(stderr, "epd-bench: --backend cuda: this epd-bench was built without CUDA "
                        "(configure with -DEPD_CUDA=ON on a machine with the CUDA toolkit)\n");
        return -1;
#else
        if (o->device_memory < 0)
                o->device_memory = 1;
        if (o->flush_l2 < 0)
                o->flush_l2 = strcmp(o->wl->name, "decode") == 0;
        if (o->cumem < 0)
                o->cumem = o->device_memory;
        if (o->cumem && !o->device_memory) {
                fprintf(stderr, "epd-bench: --alloc cumem allocates device memory; it does not "
                                "go with --host-memory\n");
                return -1;
        }
        if (o->device_memory) {
                /* The CUDA backend's output arena is host memory: device outputs are regions. */
                if (o->outputs_given && o->use_arena) {
                        fprintf(stderr, "epd-bench: --outputs arena puts outputs in host memory; "
                                        "--device-memory uses client-registered device outputs "
                                        "(--outputs regions, implied)\n");
                        return -1;
                }
                o->use_arena = 0;
        }
        return 0;
#endif
}
