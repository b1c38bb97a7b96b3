/*
 * A tenant's attempts to hold more device memory than its container's limit (tests/test_vcuda_memory_review11.py).
 *
 *   review11_mem <scenario> <limit MiB>
 *
 * Each scenario allocates through the interceptor (the libcuda.so.1 of LD_LIBRARY_PATH) as far as it lets it, then
 * prints one line "held <MiB>": what NVML accounts to this process on GPU 0 (the simulated driver's record of what
 * the GPU holds for it), asked through the interceptor's NVML forwarders.  Exit 0 when the scenario ran; 2/3 on a
 * set-up failure.
 */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>
#include <nvml.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "scenario.h"

/* ---- stream-ordered allocations while another thread switches the device's current pool ------------------- */

static CUmemoryPool g_pools[2];
static atomic_bool g_stop;

static void *switch_pools(void *arg)
{
    (void)arg;
    CUcontext ctx;
    check(FN(cuDevicePrimaryCtxRetain)(&ctx, 0), "cuDevicePrimaryCtxRetain");
    check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    while (!atomic_load(&g_stop)) {
        FN(cuDeviceSetMemPool)(0, g_pools[1]);
        FN(cuDeviceSetMemPool)(0, g_pools[0]);
    }
    return NULL;
}

static uint64_t pool_reserved(CUmemoryPool pool)
{
    cuuint64_t v = 0;
    check(FN(cuMemPoolGetAttribute)(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v), "cuMemPoolGetAttribute");
    return v;
}

/*
 * The device's current pool is P1 but for moments when another thread makes it P2.  Whatever came from P1 is
 * given back at once (freed, the pool trimmed): the container's charge stays far from its limit.  What came from
 * P2 is kept.  For 0.8 s, or until twice the limit is held.
 */
static void pool_switch(uint64_t limit_mib)
{
    primary();
    CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                            .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    for (int i = 0; i < 2; i++)
        check(FN(cuMemPoolCreate)(&g_pools[i], &props), "cuMemPoolCreate");
    check(FN(cuDeviceSetMemPool)(0, g_pools[0]), "cuDeviceSetMemPool");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    pthread_t t;
    pthread_create(&t, NULL, switch_pools, NULL);
    double end = now_s() + 0.8;
    unsigned kept = 0, tries = 0;
    while (now_s() < end && pool_reserved(g_pools[1]) < 2 * limit_mib * MIB) {
        CUdeviceptr p;
        uint64_t before = pool_reserved(g_pools[1]);
        tries++;
        if (FN(cuMemAllocAsync)(&p, 8 * MIB, s) != CUDA_SUCCESS)
            continue;
        if (pool_reserved(g_pools[1]) > before) {
            kept++;
            continue;
        }
        check(FN(cuMemFreeAsync)(p, s), "cuMemFreeAsync");
        check(FN(cuStreamSynchronize)(s), "cuStreamSynchronize");
        check(FN(cuMemPoolTrimTo)(g_pools[0], 0), "cuMemPoolTrimTo");
    }
    atomic_store(&g_stop, true);
    pthread_join(t, NULL);
    check(FN(cuStreamSynchronize)(s), "cuStreamSynchronize");
    fprintf(stderr, "%u tries, %u kept from the second pool\n", tries, kept);
    report();
}


/* ---- plain paths to exhaustion ------------------------------------------------------------------------- */

/* cuMemAlloc_v2 in steps until refused. */
static void fill(size_t step)
{
    CUdeviceptr p;
    while (FN(cuMemAlloc_v2)(&p, step) == CUDA_SUCCESS)
        ;
}

static void base(void)
{
    primary();
    fill(8 * MIB);
    report();
}

/* Pitch sizes that wrap 64 bits, then the rest of the limit. */
static void pitch_wrap(void)
{
    primary();
    CUdeviceptr p;
    size_t pitch;
    size_t widths[] = {SIZE_MAX, SIZE_MAX - 100, SIZE_MAX / 2 + 1, (size_t)1 << 40, 4 * MIB};
    size_t heights[] = {1, 2, 3, (size_t)1 << 24, 1};
    for (unsigned i = 0; i < sizeof(widths) / sizeof(widths[0]); i++)
        for (unsigned k = 0; k < 64; k++)
            if (FN(cuMemAllocPitch_v2)(&p, &pitch, widths[i], heights[i], 4) != CUDA_SUCCESS)
                break;
    fill(8 * MIB);
    report();
}

/* Every array shape in growing sizes until refused. */
static void arrays(void)
{
    primary();
    CUarray a;
    for (int round = 0; round < 4; round++) {
        for (size_t w = 1u << 16; w >= 64; w /= 2) {
            CUDA_ARRAY3D_DESCRIPTOR d = {.Width = w, .Height = w, .Depth = round == 3 ? 64 : 0,
                                         .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4,
                                         .Flags = round == 2 ? CUDA_ARRAY3D_LAYERED : 0};
            if (round == 2)
                d.Depth = 64;
            while (FN(cuArray3DCreate_v2)(&a, &d) == CUDA_SUCCESS)
                ;
            CUmipmappedArray m;
            while (FN(cuMipmappedArrayCreate)(&m, &d, 16) == CUDA_SUCCESS)
                ;
            CUDA_ARRAY_DESCRIPTOR d2 = {.Width = w, .Height = w / 4, .Format = CU_AD_FORMAT_UNSIGNED_INT8,
                                        .NumChannels = 1};
            while (FN(cuArrayCreate_v2)(&a, &d2) == CUDA_SUCCESS)
                ;
        }
    }
    report();
}

/* The hooked allocators as cuGetProcAddress hands them out, every version and flag, each used to exhaustion. */
static void getproc(void)
{
    primary();
    int versions[] = {0, 1000, 2000, 3000, 3020, 4000, 11020, 12000, 12040, 13000, 99999, -1};
    cuuint64_t flags[] = {CU_GET_PROC_ADDRESS_DEFAULT, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                          CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, 7};
    for (unsigned v = 0; v < sizeof(versions) / sizeof(versions[0]); v++)
        for (unsigned f = 0; f < sizeof(flags) / sizeof(flags[0]); f++)
            for (int which = 0; which < 2; which++) {
                void *fn = NULL;
                CUdriverProcAddressQueryResult st;
                CUresult rc = which ? FN(cuGetProcAddress_v2)("cuMemAlloc", &fn, versions[v], flags[f], &st)
                                    : FN(cuGetProcAddress)("cuMemAlloc", &fn, versions[v], flags[f]);
                if (rc != CUDA_SUCCESS || fn == NULL)
                    continue;
                Dl_info info;
                if (dladdr(fn, &info) && info.dli_fname && strstr(info.dli_fname, "550.54.15"))
                    fprintf(stderr, "cuMemAlloc at version %d flags %llu: the real driver's (%s)\n", versions[v],
                            (unsigned long long)flags[f], info.dli_fname);
                if (versions[v] >= 3020) {
                    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))fn;
                    CUdeviceptr p;
                    while (alloc(&p, 8 * MIB) == CUDA_SUCCESS)
                        ;
                } else {
                    CUresult (*alloc)(unsigned *, unsigned) = (CUresult(*)(unsigned *, unsigned))fn;
                    unsigned p;
                    while (alloc(&p, 8 * MIB) == CUDA_SUCCESS)
                        ;
                }
            }
    report();
}

/* Graphs with memory nodes: each instantiated, launched, its exec and graph destroyed without freeing. */
static void graphs(void)
{
    CUcontext ctx = primary();
    (void)ctx;
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (int i = 0; i < 64; i++) {
        CUgraph g;
        check(FN(cuGraphCreate)(&g, 0), "cuGraphCreate");
        CUDA_MEM_ALLOC_NODE_PARAMS np = {.poolProps = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                                       .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}},
                                         .bytesize = 64 * MIB};
        CUgraphNode n;
        if (FN(cuGraphAddMemAllocNode)(&n, g, NULL, 0, &np) != CUDA_SUCCESS) {
            FN(cuGraphDestroy)(g);
            continue;
        }
        CUgraphExec e;
        if (FN(cuGraphInstantiateWithFlags)(&e, g, 0) == CUDA_SUCCESS) {
            FN(cuGraphLaunch)(e, s);
            FN(cuStreamSynchronize)(s);
            if (i % 2)
                FN(cuGraphExecDestroy)(e);
        }
        if (i % 3)
            FN(cuGraphDestroy)(g);
    }
    fill(8 * MIB);
    report();
}

/* Contexts made and destroyed around allocations; allocations made in one context, freed in another. */
static void contexts(void)
{
    check(FN(cuInit)(0), "cuInit");
    for (int i = 0; i < 8; i++) {
        CUcontext a, b;
        if (FN(cuCtxCreate_v2)(&a, 0, 0) != CUDA_SUCCESS)
            continue;
        CUdeviceptr p;
        if (FN(cuCtxCreate_v2)(&b, 0, 0) == CUDA_SUCCESS) {
            FN(cuCtxSetCurrent)(a);
            FN(cuMemAlloc_v2)(&p, 64 * MIB);
            FN(cuCtxSetCurrent)(b);
            FN(cuMemFree_v2)(p);
            FN(cuMemAlloc_v2)(&p, 64 * MIB);
            FN(cuCtxDestroy_v2)(a);
            FN(cuCtxDestroy_v2)(b); /* with what was allocated in it */
        } else {
            FN(cuCtxDestroy_v2)(a);
        }
    }
    primary();
    fill(8 * MIB);
    report();
}

/* Asks for the memory view (cuMemGetInfo: the interceptor looks at the frees still queued first) until g_stop. */
static void *view_memory(void *arg)
{
    (void)arg;
    primary();
    while (!atomic_load(&g_stop)) {
        size_t free_b, total;
        FN(cuMemGetInfo_v2)(&free_b, &total);
        usleep(500);
    }
    return NULL;
}

/*
 * Memory freed with cuMemFreeAsync behind a long kernel, in a context then destroyed with the free still queued:
 * the event the interceptor follows the free with went with the context (the driver's freed memory, never to be
 * asked for again; the simulated driver stops the process), and the memory with it.  Then the rest of the limit.
 * `watched`: another thread asks for the memory view all along, so that it looks at the queued frees at any moment,
 * the one right after the driver's destroy too (VCUDA_TEST_DESTROY_DELAY_US, -DVC_TEST_HOOKS, holds it open).
 */
static void free_async_context_destroyed(bool watched)
{
    static const char ptx[] = ".version 7.0\n.target sm_75\n.address_size 64\n.visible .entry spin_3000ms() { ret; }\n";
    check(FN(cuInit)(0), "cuInit");
    pthread_t t;
    if (watched && pthread_create(&t, NULL, view_memory, NULL) != 0)
        exit(2);
    CUcontext a;
    check(FN(cuCtxCreate_v2)(&a, 0, 0), "cuCtxCreate");
    CUmodule mod;
    CUfunction fn;
    check(FN(cuModuleLoadData)(&mod, ptx), "cuModuleLoadData");
    check(FN(cuModuleGetFunction)(&fn, mod, "spin_3000ms"), "cuModuleGetFunction");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUdeviceptr p;
    check(FN(cuMemAlloc_v2)(&p, 256 * MIB), "cuMemAlloc");
    check(FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    check(FN(cuMemFreeAsync)(p, s), "cuMemFreeAsync");
    if (watched)
        usleep(20000); /* the other thread has looked at the queued free */
    check(FN(cuCtxDestroy_v2)(a), "cuCtxDestroy");
    if (watched) {
        atomic_store(&g_stop, true);
        pthread_join(t, NULL);
    }
    primary();
    fill(8 * MIB);
    report();
}

/* VMM: one allocation mapped twice, released, retained, unmapped in every order. */
static void vmm(void)
{
    primary();
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    size_t gran = 0;
    check(FN(cuMemGetAllocationGranularity)(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity");
    size_t size = (64 * MIB + gran - 1) / gran * gran;
    for (int i = 0; i < 64; i++) {
        CUmemGenericAllocationHandle h, h2;
        if (FN(cuMemCreate)(&h, size, &prop, 0) != CUDA_SUCCESS)
            break;
        CUdeviceptr va;
        check(FN(cuMemAddressReserve)(&va, 2 * size, 0, 0, 0), "cuMemAddressReserve");
        FN(cuMemMap)(va, size, 0, h, 0);
        FN(cuMemMap)(va + size, size, 0, h, 0);
        FN(cuMemMap)(va, size, 0, h, 0); /* already mapped */
        switch (i % 4) {
        case 0:
            FN(cuMemRelease)(h);
            FN(cuMemUnmap)(va, 2 * size);
            break;
        case 1:
            FN(cuMemUnmap)(va, size);
            FN(cuMemUnmap)(va, size);
            FN(cuMemRelease)(h);
            FN(cuMemRelease)(h);
            break;
        case 2:
            if (FN(cuMemRetainAllocationHandle)(&h2, (void *)(uintptr_t)va) == CUDA_SUCCESS) {
                FN(cuMemRelease)(h2);
                FN(cuMemRelease)(h2);
            }
            FN(cuMemUnmap)(va, size);
            break;
        default:
            FN(cuMemRelease)(h);
            FN(cuMemAddressFree)(va, 2 * size);
            break;
        }
    }
    fill(8 * MIB);
    report();
}

/* The kernel frame_1us of a module whose PTX gives each thread a local frame of frame_bytes (in the current context). */
static CUfunction frame_kernel(unsigned frame_bytes)
{
    char ptx[256];
    snprintf(ptx, sizeof(ptx),
             ".version 7.0\n.target sm_75\n.address_size 64\n\n.visible .entry frame_1us()\n{\n"
             "    .local .align 8 .b8 buf[%u];\n    ret;\n}\n",
             frame_bytes);
    CUmodule mod;
    CUfunction fn;
    check(FN(cuModuleLoadData)(&mod, ptx), "cuModuleLoadData");
    check(FN(cuModuleGetFunction)(&fn, mod, "frame_1us"), "cuModuleGetFunction");
    return fn;
}

/* The parameters of one launch of fn (one block of 32 threads, no arguments). */
static CUDA_KERNEL_NODE_PARAMS once(CUfunction fn)
{
    return (CUDA_KERNEL_NODE_PARAMS){.func = fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32,
                                     .blockDimY = 1, .blockDimZ = 1};
}

/* A graph of one node launching fn once; *node (unless NULL) is that node. */
static CUgraph kernel_graph(CUfunction fn, CUgraphNode *node)
{
    CUgraph g;
    check(FN(cuGraphCreate)(&g, 0), "cuGraphCreate");
    CUDA_KERNEL_NODE_PARAMS p = once(fn);
    CUgraphNode n;
    check(FN(cuGraphAddKernelNode_v2)(&n, g, NULL, 0, &p), "cuGraphAddKernelNode_v2");
    if (node != NULL)
        *node = n;
    return g;
}

/*
 * A kernel whose local frame (frame_kib per thread) is bigger than the context's stack: the driver grows the stack at
 * its launch, for every thread the GPU can hold.  fill_first: the container is at its limit when it is launched (the
 * launch must be refused); else the rest of the limit is allocated after it (the grown stack counts).
 */
static void local_frame(unsigned frame_kib, bool fill_first)
{
    primary();
    CUfunction fn = frame_kernel(frame_kib * 1024u);
    if (fill_first)
        fill(2 * MIB);
    CUresult rc = FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
    fprintf(stderr, "launch: %d\n", (int)rc);
    FN(cuCtxSynchronize)();
    if (!fill_first)
        fill(2 * MIB);
    report();
}

/*
 * A graph of one kernel with a 64 KiB local frame, in a container at its limit: the driver grows the stack for its
 * kernels when the graph runs.  by_capture: the kernel is recorded by a stream capture, else added as a node.
 */
/* g instantiated ("instantiate: <rc>") and, when it was, launched on s ("launch: <rc>") and waited for. */
static void instantiate_and_launch(CUgraph g, CUstream s)
{
    CUgraphExec e;
    CUresult rc = FN(cuGraphInstantiateWithFlags)(&e, g, 0);
    fprintf(stderr, "instantiate: %d\n", (int)rc);
    if (rc == CUDA_SUCCESS) {
        fprintf(stderr, "launch: %d\n", (int)FN(cuGraphLaunch)(e, s));
        FN(cuStreamSynchronize)(s);
    }
}

/* A graph whose one node is a child graph, levels deep, around g (levels 0: g itself); *node (unless NULL) is that
 * node. */
static CUgraph nested(CUgraph g, unsigned levels, CUgraphNode *node)
{
    for (unsigned i = 0; i < levels; i++) {
        CUgraph outer;
        check(FN(cuGraphCreate)(&outer, 0), "cuGraphCreate");
        CUgraphNode n;
        check(FN(cuGraphAddChildGraphNode)(&n, outer, NULL, 0, g), "cuGraphAddChildGraphNode");
        if (node != NULL)
            *node = n;
        g = outer;
    }
    return g;
}

/* A graph of a kernel with a 64 KiB frame, instantiated at the limit: as a node, recorded by a capture, or in a child
 * graph nesting levels deep. */
static void graph_frame(bool by_capture, unsigned nesting)
{
    primary();
    CUfunction fn = frame_kernel(65536);
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUgraph g;
    if (by_capture) {
        check(FN(cuStreamBeginCapture_v2)(s, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture_v2");
        CUresult rc = FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
        fprintf(stderr, "captured launch: %d\n", (int)rc);
        check(FN(cuStreamEndCapture)(s, &g), "cuStreamEndCapture");
    } else {
        g = nested(kernel_graph(fn, NULL), nesting, NULL);
    }
    fill(2 * MIB);
    instantiate_and_launch(g, s);
    report();
}

/*
 * A graph of one kernel with an 8 KiB local frame is instantiated (its stack grown and charged), the stack set back
 * to 1 KiB (which would give the memory back), the container filled to its limit, then the graph launched: the
 * driver grows the stack again at the launch.
 */
static void graph_shrink(void)
{
    primary();
    CUfunction fn = frame_kernel(8192);
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUgraph g = kernel_graph(fn, NULL);
    CUgraphExec e;
    check(FN(cuGraphInstantiateWithFlags)(&e, g, 0), "cuGraphInstantiateWithFlags");
    fprintf(stderr, "shrink: %d\n", (int)FN(cuCtxSetLimit)(CU_LIMIT_STACK_SIZE, 1024));
    fill(2 * MIB);
    fprintf(stderr, "launch: %d\n", (int)FN(cuGraphLaunch)(e, s));
    FN(cuStreamSynchronize)(s);
    report();
}

/*
 * An exec of a one-node graph whose kernel has no frame, in a container at its limit, made to run a kernel with a
 * 64 KiB local frame: by_update from a graph of it (cuGraphExecUpdate), else by its node's parameters
 * (cuGraphExecKernelNodeSetParams); then launched.
 */
/* How exec_update changes the exec: the CUDA 12 calls, their CUDA 10-11 ABIs (found by name, or as a CUDA 11 runtime
 * finds them: through cuGetProcAddress at its version), or the generic node call of CUDA 12.2. */
enum exec_change {
    UPDATE_V2,
    NODE_V2,
    UPDATE_V1,
    NODE_V1,
    UPDATE_PROC_V1,
    NODE_PROC_V1,
    NODE_GENERIC,
    CHILD_SET,
    CHILD_GENERIC
};

static void *proc_at(const char *name, int version)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    check(FN(cuGetProcAddress_v2)(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &st), "cuGetProcAddress_v2");
    if (fn == NULL) {
        fprintf(stderr, "cuGetProcAddress_v2(%s, %d): no function\n", name, version);
        exit(1);
    }
    return fn;
}

static void exec_update(enum exec_change how)
{
    primary();
    CUfunction small = frame_kernel(16), big = frame_kernel(65536);
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUgraphNode n;
    bool child = how == CHILD_SET || how == CHILD_GENERIC; /* the exec's node is a child graph of that kernel */
    CUgraph g = child ? nested(kernel_graph(small, NULL), 1, &n) : kernel_graph(small, &n);
    CUgraphExec e;
    check(FN(cuGraphInstantiateWithFlags)(&e, g, 0), "cuGraphInstantiateWithFlags");
    CUgraph bigger = kernel_graph(big, NULL);
    fill(2 * MIB);
    CUresult rc = CUDA_ERROR_UNKNOWN;
    CUDA_KERNEL_NODE_PARAMS p = once(big);
    CUDA_KERNEL_NODE_PARAMS_v1 p1 = {.func = big, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32,
                                     .blockDimY = 1, .blockDimZ = 1};
    CUgraphExecUpdateResultInfo info;
    CUgraphExecUpdateResult result;
    CUgraphNode failed;
    switch (how) {
    case UPDATE_V2: rc = FN(cuGraphExecUpdate_v2)(e, bigger, &info); break;
    case NODE_V2: rc = FN(cuGraphExecKernelNodeSetParams_v2)(e, n, &p); break;
    case UPDATE_V1: rc = FN(cuGraphExecUpdate)(e, bigger, &failed, &result); break;
    case NODE_V1: rc = FN(cuGraphExecKernelNodeSetParams)(e, n, &p1); break;
    case UPDATE_PROC_V1:
        rc = ((__typeof__(&cuGraphExecUpdate))proc_at("cuGraphExecUpdate", 11040))(e, bigger, &failed, &result);
        break;
    case NODE_PROC_V1:
        rc = ((__typeof__(&cuGraphExecKernelNodeSetParams))proc_at("cuGraphExecKernelNodeSetParams", 11040))(e, n, &p1);
        break;
    case NODE_GENERIC: {
        CUgraphNodeParams gp = {.type = CU_GRAPH_NODE_TYPE_KERNEL};
        gp.kernel.func = big;
        gp.kernel.gridDimX = gp.kernel.gridDimY = gp.kernel.gridDimZ = 1;
        gp.kernel.blockDimX = 32;
        gp.kernel.blockDimY = gp.kernel.blockDimZ = 1;
        rc = FN(cuGraphExecNodeSetParams)(e, n, &gp);
        break;
    }
    case CHILD_SET: rc = FN(cuGraphExecChildGraphNodeSetParams)(e, n, bigger); break;
    case CHILD_GENERIC: {
        CUgraphNodeParams gp = {.type = CU_GRAPH_NODE_TYPE_GRAPH};
        gp.graph.graph = bigger;
        rc = FN(cuGraphExecNodeSetParams)(e, n, &gp);
        break;
    }
    }
    fprintf(stderr, "update: %d\n", (int)rc);
    fprintf(stderr, "launch: %d\n", (int)FN(cuGraphLaunch)(e, s));
    FN(cuStreamSynchronize)(s);
    report();
}

/* Streams made in a container at its limit: each takes device memory of its context that no allocation shows. */
static void streams(void)
{
    primary();
    fill(2 * MIB);
    unsigned made = 0;
    for (int i = 0; i < 200; i++) {
        CUstream s;
        if (FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS)
            made++;
    }
    fprintf(stderr, "streams made: %u\n", made);
    report();
}

/* Many threads allocating at once. */
static void *racer(void *arg)
{
    CUcontext ctx = arg;
    FN(cuCtxSetCurrent)(ctx);
    CUdeviceptr p = 0; /* a free of a failed first allocation frees nothing (a real driver crashes on garbage) */
    for (int i = 0; i < 2000; i++) {
        if (FN(cuMemAlloc_v2)(&p, 1 * MIB) != CUDA_SUCCESS && i % 2)
            continue;
        if (i % 3 == 0)
            FN(cuMemFree_v2)(p);
    }
    return NULL;
}

static void threads(void)
{
    CUcontext ctx = primary();
    pthread_t t[16];
    for (int i = 0; i < 16; i++)
        pthread_create(&t[i], NULL, racer, ctx);
    for (int i = 0; i < 16; i++)
        pthread_join(t[i], NULL);
    fill(1 * MIB);
    report();
}

/* Frees that should give nothing back: twice, inside an allocation, a foreign address, in the wrong ABI. */
static void frees(void)
{
    primary();
    for (int i = 0; i < 256; i++) {
        CUdeviceptr p;
        if (FN(cuMemAlloc_v2)(&p, 16 * MIB) != CUDA_SUCCESS)
            break;
        FN(cuMemFree_v2)(p + 4096);
        FN(cuMemFree)((CUdeviceptr_v1)p);
        FN(cuMemFree_v2)(p & ~(CUdeviceptr)0xffffffffu);
        CUstream s = NULL;
        FN(cuMemFreeAsync)(p + 1, s);
        unsigned q;
        if (FN(cuMemAlloc)(&q, 16 * MIB) == CUDA_SUCCESS)
            FN(cuMemFree_v2)(q);
    }
    report();
}


/*
 * A graph's allocation node is charged from its creation, before the GPU backs it.  Memory no hook charges (a
 * bigger malloc heap, handed over to the reconciliation with NVML) is then made while the node's charge stands in
 * for it; instantiating the graph backs the node as well.
 */
static void graph_phantom(uint64_t limit_mib)
{
    primary();
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate"); /* before the limit is reached */
    uint64_t ctx = held();
    uint64_t node = (limit_mib * MIB - ctx) / MIB / 2 * 2 * MIB - 16 * MIB;
    CUgraph g;
    check(FN(cuGraphCreate)(&g, 0), "cuGraphCreate");
    CUDA_MEM_ALLOC_NODE_PARAMS np = {.poolProps = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                                   .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}},
                                     .bytesize = node};
    CUgraphNode n;
    check(FN(cuGraphAddMemAllocNode)(&n, g, NULL, 0, &np), "cuGraphAddMemAllocNode");
    size_t heap = 0;
    check(FN(cuCtxGetLimit)(&heap, CU_LIMIT_MALLOC_HEAP_SIZE), "cuCtxGetLimit");
    uint64_t grown = 0;
    while (grown < node && FN(cuCtxSetLimit)(CU_LIMIT_MALLOC_HEAP_SIZE, heap + grown + 16 * MIB) == CUDA_SUCCESS)
        grown += 16 * MIB; /* each step fits beside the node's charge */
    fprintf(stderr, "node %llu MiB, heap +%llu MiB\n", (unsigned long long)(node / MIB),
            (unsigned long long)(grown / MIB));
    CUgraphExec e;
    CUresult rc = FN(cuGraphInstantiateWithFlags)(&e, g, 0);
    fprintf(stderr, "instantiate: %d\n", (int)rc);
    if (rc == CUDA_SUCCESS) {
        FN(cuGraphLaunch)(e, s);
        FN(cuStreamSynchronize)(s);
    }
    report();
}


/* A graph allocation launched, freed, its graph and exec gone: the device's graph memory pool keeps its memory. */
static void graph_pool_keeps(CUstream s, size_t bytes)
{
    CUgraph g;
    check(FN(cuGraphCreate)(&g, 0), "cuGraphCreate");
    CUDA_MEM_ALLOC_NODE_PARAMS np = {.poolProps = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                                   .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}},
                                     .bytesize = bytes};
    CUgraphNode n;
    check(FN(cuGraphAddMemAllocNode)(&n, g, NULL, 0, &np), "cuGraphAddMemAllocNode");
    CUgraphExec e;
    check(FN(cuGraphInstantiateWithFlags)(&e, g, 0), "cuGraphInstantiateWithFlags");
    check(FN(cuGraphLaunch)(e, s), "cuGraphLaunch");
    check(FN(cuStreamSynchronize)(s), "cuStreamSynchronize");
    check(FN(cuMemFree_v2)(np.dptr), "cuMemFree_v2");
    check(FN(cuGraphExecDestroy)(e), "cuGraphExecDestroy");
    check(FN(cuGraphDestroy)(g), "cuGraphDestroy");
}

/*
 * With memory kept by the graph pool, an allocation node too big for what the container has left is refused;
 * then the rest of the limit is allocated again, three times.
 */
static void graph_refused(uint64_t limit_mib)
{
    primary();
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    graph_pool_keeps(s, 64 * MIB);
    for (int round = 0; round < 3; round++) {
        fill(8 * MIB);
        CUgraph g;
        check(FN(cuGraphCreate)(&g, 0), "cuGraphCreate");
        CUDA_MEM_ALLOC_NODE_PARAMS np = {.poolProps = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                                       .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}},
                                         .bytesize = limit_mib * MIB};
        CUgraphNode n;
        CUresult rc = FN(cuGraphAddMemAllocNode)(&n, g, NULL, 0, &np);
        fprintf(stderr, "allocation node of the whole limit: %d\n", (int)rc);
        FN(cuGraphDestroy)(g);
    }
    fill(8 * MIB);
    report();
}


/* Grows the current context's malloc heap in 16 MiB steps (memory no hook charges) up to `most`; what it grew by. */
static uint64_t grow_heap(uint64_t most)
{
    size_t heap = 0;
    check(FN(cuCtxGetLimit)(&heap, CU_LIMIT_MALLOC_HEAP_SIZE), "cuCtxGetLimit");
    uint64_t grown = 0;
    while (grown < most && FN(cuCtxSetLimit)(CU_LIMIT_MALLOC_HEAP_SIZE, heap + grown + 16 * MIB) == CUDA_SUCCESS)
        grown += 16 * MIB;
    return grown;
}

/*
 * A library's variables are charged from its load in every live context, before the driver puts the library
 * into one (lazily, at its first use there).  Memory no hook charges is made meanwhile; then the library is used:
 * a variable asked for, or (by_kernel) a kernel asked for before and launched after.
 */
static void library_phantom(uint64_t limit_mib, bool by_kernel)
{
    primary();
    uint64_t ctx = held();
    uint64_t vars = (limit_mib * MIB - ctx) / (2 * MIB) * (2 * MIB) - 32 * MIB;
    char ptx[512];
    snprintf(ptx, sizeof(ptx),
             ".version 7.0\n.target sm_75\n.address_size 64\n\n.visible .global .align 8 .b8 big[%llu];\n"
             ".visible .entry k() { ret; }\n",
             (unsigned long long)vars);
    CUlibrary lib;
    CUresult rc = FN(cuLibraryLoadData)(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0);
    fprintf(stderr, "library of %llu MiB of variables: %d\n", (unsigned long long)(vars / MIB), (int)rc);
    if (rc != CUDA_SUCCESS) {
        report();
        return;
    }
    if (by_kernel) { /* asked for, but in no context until the kernel's first launch there */
        CUkernel k;
        check(FN(cuLibraryGetKernel)(&k, lib, "k"), "cuLibraryGetKernel");
        uint64_t grown = grow_heap(vars);
        rc = FN(cuLaunchKernel)((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        fprintf(stderr, "heap +%llu MiB, the library's kernel launched: %d\n", (unsigned long long)(grown / MIB),
                (int)rc);
        FN(cuCtxSynchronize)();
    } else {
        uint64_t grown = grow_heap(vars);
        CUdeviceptr p;
        size_t size;
        rc = FN(cuLibraryGetGlobal)(&p, &size, lib, "big");
        fprintf(stderr, "heap +%llu MiB, the library's variable asked for: %d\n", (unsigned long long)(grown / MIB),
                (int)rc);
    }
    report();
}


/*
 * Half the limit allocated, then a fork: the child makes its own context and allocates what it can, the parent
 * the rest; a second child exits without freeing, and the parent allocates again.  Every process of the container
 * counts.
 */
static void forked(void)
{
    primary();
    CUdeviceptr p;
    for (int i = 0; i < 32 && FN(cuMemAlloc_v2)(&p, 8 * MIB) == CUDA_SUCCESS; i++)
        ;
    int ready[2];
    if (pipe(ready) != 0)
        exit(2);
    pid_t child = fork();
    if (child == 0) {
        close(ready[0]);
        primary();
        fill(8 * MIB);
        if (write(ready[1], "x", 1) != 1)
            _exit(2);
        pause(); /* holds its memory until killed */
        _exit(0);
    }
    close(ready[1]); /* a child that ends without a word (a real driver: no CUDA after a fork) ends the read */
    char c;
    if (read(ready[0], &c, 1) != 1) {
        fprintf(stderr, "the forked child could not use CUDA\n");
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        exit(2);
    }
    fill(8 * MIB);
    pid_t quitter = fork();
    if (quitter == 0) {
        primary();
        fill(8 * MIB);
        _exit(0); /* without freeing */
    }
    waitpid(quitter, NULL, 0);
    fill(8 * MIB);
    g_all = true;
    report();
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
}

/*
 * A graph of a kernel with a 64 KiB frame instantiated in a container at its limit with no context current (no stack
 * to grow then), then launched on a stream of the primary context.
 */
static void graph_no_context(void)
{
    primary();
    CUfunction fn = frame_kernel(65536);
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUgraph g = kernel_graph(fn, NULL);
    fill(2 * MIB);
    CUcontext ctx;
    check(FN(cuCtxPopCurrent_v2)(&ctx), "cuCtxPopCurrent_v2");
    CUgraphExec e;
    CUresult rc = FN(cuGraphInstantiateWithFlags)(&e, g, 0);
    fprintf(stderr, "instantiate: %d\n", (int)rc);
    check(FN(cuCtxPushCurrent_v2)(ctx), "cuCtxPushCurrent_v2");
    if (rc == CUDA_SUCCESS) {
        fprintf(stderr, "launch: %d\n", (int)FN(cuGraphLaunch)(e, s));
        FN(cuStreamSynchronize)(s);
    }
    report();
}

/*
 * A graph of a kernel with a 3 KiB frame made in a second context, instantiated with the primary context current (its
 * stack grown), launched on a stream of the second context (whose stack the launch grows), then the container filled.
 */
static void graph_other_context(void)
{
    primary();
    CUcontext first, second;
    check(FN(cuCtxGetCurrent)(&first), "cuCtxGetCurrent");
    check(FN(cuCtxCreate_v2)(&second, 0, 0), "cuCtxCreate_v2");
    CUfunction fn = frame_kernel(3072);
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUgraph g = kernel_graph(fn, NULL);
    check(FN(cuCtxSetCurrent)(first), "cuCtxSetCurrent");
    instantiate_and_launch(g, s);
    fill(2 * MIB);
    report();
}

/* A child node's embedded graph destroyed by the program (cuda.h: the node owns it), then its graph instantiated. */
static void child_graph_destroyed(void)
{
    primary();
    CUgraphNode n;
    CUgraph g = nested(kernel_graph(frame_kernel(16), NULL), 1, &n);
    CUgraph embedded;
    check(FN(cuGraphChildGraphNodeGetGraph)(n, &embedded), "cuGraphChildGraphNodeGetGraph");
    fprintf(stderr, "destroy embedded: %d\n", (int)FN(cuGraphDestroy)(embedded));
    CUgraphExec e;
    fprintf(stderr, "instantiate: %d\n", (int)FN(cuGraphInstantiateWithFlags)(&e, g, 0));
    fprintf(stderr, "destroy: %d\n", (int)FN(cuGraphDestroy)(g));
    report();
}

/*
 * An exec of a kernel with a 64 KiB frame (instantiated with room to spare) launched into a capture; the captured graph
 * is instantiated and launched once the container is at its limit.
 */
static void graph_in_capture(void)
{
    primary();
    CUfunction fn = frame_kernel(65536);
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUgraph g = kernel_graph(fn, NULL);
    CUgraphExec inner;
    CUcontext ctx;
    check(FN(cuCtxPopCurrent_v2)(&ctx), "cuCtxPopCurrent_v2"); /* as graph_no_context: no stack grown for it */
    fprintf(stderr, "inner instantiate: %d\n", (int)FN(cuGraphInstantiateWithFlags)(&inner, g, 0));
    check(FN(cuCtxPushCurrent_v2)(ctx), "cuCtxPushCurrent_v2");
    check(FN(cuStreamBeginCapture_v2)(s, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture_v2");
    fprintf(stderr, "captured launch: %d\n", (int)FN(cuGraphLaunch)(inner, s));
    CUgraph captured;
    check(FN(cuStreamEndCapture)(s, &captured), "cuStreamEndCapture");
    fill(2 * MIB);
    instantiate_and_launch(captured, s);
    report();
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: review11_mem SCENARIO LIMIT_MIB\n");
        return 2;
    }
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (g_lib == NULL) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    uint64_t limit = strtoull(argv[2], NULL, 10);
    if (strcmp(argv[1], "pool-switch") == 0)
        pool_switch(limit);
    else if (strcmp(argv[1], "graph-phantom") == 0)
        graph_phantom(limit);
    else if (strcmp(argv[1], "graph-refused") == 0)
        graph_refused(limit);
    else if (strcmp(argv[1], "library-phantom") == 0)
        library_phantom(limit, false);
    else if (strcmp(argv[1], "library-kernel") == 0)
        library_phantom(limit, true);
    else if (strcmp(argv[1], "graph-frame") == 0)
        graph_frame(false, 0);
    else if (strcmp(argv[1], "graph-frame-capture") == 0)
        graph_frame(true, 0);
    else if (strcmp(argv[1], "graph-frame-child") == 0)
        graph_frame(false, 3);
    else if (strcmp(argv[1], "graph-frame-deep") == 0)
        graph_frame(false, 40);
    else if (strcmp(argv[1], "graph-no-context") == 0)
        graph_no_context();
    else if (strcmp(argv[1], "graph-other-context") == 0)
        graph_other_context();
    else if (strcmp(argv[1], "child-graph-destroyed") == 0)
        child_graph_destroyed();
    else if (strcmp(argv[1], "graph-in-capture") == 0)
        graph_in_capture();
    else if (strcmp(argv[1], "graph-shrink") == 0)
        graph_shrink();
    else if (strcmp(argv[1], "exec-update") == 0)
        exec_update(UPDATE_V2);
    else if (strcmp(argv[1], "exec-node-params") == 0)
        exec_update(NODE_V2);
    else if (strcmp(argv[1], "exec-update-v1") == 0)
        exec_update(UPDATE_V1);
    else if (strcmp(argv[1], "exec-node-params-v1") == 0)
        exec_update(NODE_V1);
    else if (strcmp(argv[1], "exec-update-proc-v1") == 0)
        exec_update(UPDATE_PROC_V1);
    else if (strcmp(argv[1], "exec-node-params-proc-v1") == 0)
        exec_update(NODE_PROC_V1);
    else if (strcmp(argv[1], "exec-node-set-params") == 0)
        exec_update(NODE_GENERIC);
    else if (strcmp(argv[1], "exec-child-params") == 0)
        exec_update(CHILD_SET);
    else if (strcmp(argv[1], "exec-child-set-params") == 0)
        exec_update(CHILD_GENERIC);
    else if (strcmp(argv[1], "streams") == 0)
        streams();
    else if (strcmp(argv[1], "local-frame-full") == 0)
        local_frame(64, true);
    else if (strcmp(argv[1], "local-frame") == 0)
        local_frame(8, false);
    else if (strcmp(argv[1], "fork") == 0)
        forked();
    else if (strcmp(argv[1], "base") == 0)
        base();
    else if (strcmp(argv[1], "pitch-wrap") == 0)
        pitch_wrap();
    else if (strcmp(argv[1], "arrays") == 0)
        arrays();
    else if (strcmp(argv[1], "getproc") == 0)
        getproc();
    else if (strcmp(argv[1], "graphs") == 0)
        graphs();
    else if (strcmp(argv[1], "contexts") == 0)
        contexts();
    else if (strcmp(argv[1], "vmm") == 0)
        vmm();
    else if (strcmp(argv[1], "threads") == 0)
        threads();
    else if (strcmp(argv[1], "frees") == 0)
        frees();
    else if (strcmp(argv[1], "free-async-context-destroyed") == 0)
        free_async_context_destroyed(false);
    else if (strcmp(argv[1], "free-async-context-destroyed-watched") == 0)
        free_async_context_destroyed(true);
    else {
        fprintf(stderr, "unknown scenario %s\n", argv[1]);
        return 2;
    }
    return 0;
}
