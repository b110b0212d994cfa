/* timed.cu - a kernel launched between the two events that time it, as one CUDA graph.
 *
 * Why. An op's kernel time is the span between an event recorded before its first kernel and one
 * recorded after its last (docs/benchmarks.md, "Time"). Recorded around a direct launch on an
 * idle GPU, the first event completes as soon as the GPU reads it, while the host is still
 * inside the launch call, so the window holds the host's launch latency as well as the kernel:
 * an empty kernel timed that way measures about twice what it does when the stream is held
 * until the launch is queued (epd-floor-probe). Sent as one graph (event, kernel, event), the
 * three reach the GPU in one submission: the same empty kernel measures close to the held
 * figure, and the host's work moves before the window, where the client-observed time still
 * counts it (docs/performance.md, "Design choices and their measured effect").
 *
 * How. The graph is built once per kernel function and cluster shape (and events and device),
 * instantiated, and kept; each launch updates the kernel node's grid, block, shared memory and
 * parameters in the instantiated graph (cudaGraphExecKernelNodeSetParams) and launches it. A
 * change of function or cluster shape builds a new one. When a graph cannot be built or
 * updated, the launch falls back to what it replaces (record, launch, record) and stays there:
 * the object then only costs a flag test.
 *
 * An epd_k_timed belongs to one caller thread and one stream at a time; the graph's launches are
 * ordered on the caller's stream like any other work, and an update does not affect a launch
 * already queued.
 */
#include <stdlib.h>

#include "internal.cuh"

struct epd_k_timed {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        cudaGraphNode_t kernel;
        const void *func;
        unsigned cluster;
        int device;
        cudaEvent_t t0, t1;
        int direct; /* a graph could not be built or updated: direct launches from now on */
        cudaError_t why; /* what made it so */
        unsigned graphs_built;
};

extern "C" int epd_k_timed_create(struct epd_k_timed **out)
{
        *out = (struct epd_k_timed *)calloc(1, sizeof(**out));
        return *out ? 0 : EPD_INTERNAL;
}

static void drop_graph(struct epd_k_timed *t)
{
        if (t->exec)
                cudaGraphExecDestroy(t->exec);
        if (t->graph)
                cudaGraphDestroy(t->graph);
        t->exec = NULL;
        t->graph = NULL;
        t->kernel = NULL;
}

extern "C" void epd_k_timed_destroy(struct epd_k_timed *t)
{
        if (!t)
                return;
        drop_graph(t);
        free(t);
}

extern "C" void epd_k_timed_set_graphs(struct epd_k_timed *t, int on)
{
        if (!on)
                drop_graph(t);
        t->direct = !on;
        t->why = cudaSuccess;
}

extern "C" int epd_k_timed_uses_graph(const struct epd_k_timed *t)
{
        return t != NULL && !t->direct && t->exec != NULL;
}

extern "C" cudaError_t epd_k_timed_fallback_error(const struct epd_k_timed *t)
{
        return t != NULL && t->direct ? t->why : cudaSuccess;
}

static cudaKernelNodeParams node_params(const struct epd__k_launch *l)
{
        cudaKernelNodeParams kp = {};

        kp.func = (void *)l->func;
        kp.gridDim = l->grid;
        kp.blockDim = l->block;
        kp.sharedMemBytes = (unsigned)l->smem;
        kp.kernelParams = (void **)l->params;
        kp.extra = NULL;
        return kp;
}

/* event t0 -> kernel -> event t1. */
static cudaError_t build_graph(struct epd_k_timed *t, const struct epd__k_launch *l,
                               cudaEvent_t t0, cudaEvent_t t1)
{
        cudaGraphNode_t n0, n1;
        cudaKernelNodeParams kp = node_params(l);
        cudaError_t e;

        if ((e = cudaGraphCreate(&t->graph, 0)) != cudaSuccess)
                return e;
        if ((e = cudaGraphAddEventRecordNode(&n0, t->graph, NULL, 0, t0)) != cudaSuccess ||
            (e = cudaGraphAddKernelNode(&t->kernel, t->graph, &n0, 1, &kp)) != cudaSuccess)
                return e;
        if (l->cluster != 0) {
                cudaLaunchAttributeValue v = {};
                v.clusterDim.x = l->cluster;
                v.clusterDim.y = 1;
                v.clusterDim.z = 1;
                if ((e = cudaGraphKernelNodeSetAttribute(t->kernel, cudaLaunchAttributeClusterDimension,
                                                         &v)) != cudaSuccess)
                        return e;
        }
        if ((e = cudaGraphAddEventRecordNode(&n1, t->graph, &t->kernel, 1, t1)) != cudaSuccess)
                return e;
        return cudaGraphInstantiate(&t->exec, t->graph, 0);
}

int epd__k_launch_timed(struct epd_k_timed *t, const struct epd__k_launch *l, cudaEvent_t t0,
                        cudaEvent_t t1, cudaStream_t stream)
{
        int device = -1;

        if (!t->direct && cudaGetDevice(&device) == cudaSuccess) {
                if (t->exec && (t->func != l->func || t->cluster != l->cluster ||
                                t->device != device || t->t0 != t0 || t->t1 != t1))
                        drop_graph(t);
                cudaError_t e = cudaSuccess;
                if (!t->exec) {
                        e = build_graph(t, l, t0, t1);
                        if (e == cudaSuccess) {
                                t->func = l->func;
                                t->cluster = l->cluster;
                                t->device = device;
                                t->t0 = t0;
                                t->t1 = t1;
                                t->graphs_built++;
                        }
                } else {
                        cudaKernelNodeParams kp = node_params(l);
                        e = cudaGraphExecKernelNodeSetParams(t->exec, t->kernel, &kp);
                }
                if (e == cudaSuccess)
                        return epd__k_cuda_status(cudaGraphLaunch(t->exec, stream));
                /* Nothing was queued: fall back for good. */
                (void)cudaGetLastError();
                drop_graph(t);
                t->direct = 1;
                t->why = e;
        }
        int ret = epd__k_cuda_status(cudaEventRecord(t0, stream));
        if (ret == 0)
                ret = epd__k_launch_direct(l, stream);
        if (ret == 0)
                ret = epd__k_cuda_status(cudaEventRecord(t1, stream));
        return ret;
}
