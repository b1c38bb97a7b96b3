/*
 * A continuously fed, unsynchronised launch loop: the workload of
 * bench/bench_compute.py and tests/test_vcuda_compute.py.  Loads
 * "libcuda.so.1" through the loader's search path (the simulated driver, or a
 * mirror where it is the interceptor), launches one kernel over and over
 * through the chosen path for the given time, never synchronising (a launch
 * blocks only when the stream's queue is full, or when the limiter says so),
 * then prints one JSON line:
 *   {"path": ..., "launches": N, "seconds": S, "per_launch_ns": median over batches of 256}
 *
 * usage: launch_loop <path> <kernel name> <seconds> [blocks] [threads per block] [device]
 *   path: kernel | kernel_ptsz | ex | ex_ptsz | coop | coop_ptsz | multi | graph | graph_ptsz | proc | proc_ptsz
 *         | launch | grid | grid_async | kernel_noctx | ex_noctx | graph_noctx
 *   ("proc": cuLaunchKernel obtained through cuGetProcAddress_v2; "multi":
 *   cuLaunchCooperativeKernelMultiDevice with one device; "launch", "grid",
 *   "grid_async": the legacy cuLaunch, cuLaunchGrid (blocks x 1 grid),
 *   cuLaunchGridAsync after cuFuncSetBlockShape; "*_noctx": a context-less
 *   CUkernel (cuLibraryLoadData, cuLibraryGetKernel), or a graph of one, launched
 *   on a created stream while no context is current; "*_green": in a green context (cuGreenCtxCreate
 *   with all the device's SMs, its CUcontext current) on a stream of cuGreenCtxStreamCreate)
 *   kernel name: the simulated driver takes a name ending in _<N>ns, _<N>us
 *   or _<N>ms as the kernel's duration, e.g. spin_10us.
 */
#include <cuda.h>

#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BATCH 256
#define MAX_BATCHES 400000

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *lib;

static void *need(const char *name)
{
    void *p = dlsym(lib, name);
    if (p == NULL) {
        fprintf(stderr, "launch_loop: no %s\n", name);
        exit(2);
    }
    return p;
}

#define CHECK(call)                                                                                                \
    do {                                                                                                           \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                                 \
            fprintf(stderr, "launch_loop: %s failed: %d\n", #call, (int)rc_);                                     \
            exit(1);                                                                                               \
        }                                                                                                          \
    } while (0)

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double batches[MAX_BATCHES];

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: launch_loop <path> <kernel name> <seconds> [blocks] [threads] [device]\n");
        return 2;
    }
    const char *path = argv[1];
    const char *kname = argv[2];
    double seconds = atof(argv[3]);
    unsigned blocks = argc > 4 ? (unsigned)atoi(argv[4]) : 1;
    unsigned threads = argc > 5 ? (unsigned)atoi(argv[5]) : 128;
    int device = argc > 6 ? atoi(argv[6]) : 0;
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "launch_loop: %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned) = need("cuInit");
    CUresult (*dev_get)(CUdevice *, int) = need("cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = need("cuDevicePrimaryCtxRetain");
    CUresult (*set_cur)(CUcontext) = need("cuCtxSetCurrent");
    CUresult (*load)(CUmodule *, const void *) = need("cuModuleLoadData");
    CUresult (*get_fn)(CUfunction *, CUmodule, const char *) = need("cuModuleGetFunction");
    CUresult (*alloc)(CUdeviceptr *, size_t) = need("cuMemAlloc_v2");
    CUresult (*stream_create)(CUstream *, unsigned) = need("cuStreamCreate");
    CUresult (*pop)(CUcontext *) = need("cuCtxPopCurrent_v2");
    CHECK(init(0));
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUdeviceptr buf;
    CUstream stream;
    CHECK(dev_get(&dev, device));
    CHECK(retain(&ctx, dev));
    CHECK(set_cur(ctx));
    CUgreenCtx green = NULL;
    if (strstr(path, "_green") != NULL) {
        CUresult (*get_res)(CUdevice, CUdevResource *, CUdevResourceType) = need("cuDeviceGetDevResource");
        CUresult (*gen_desc)(CUdevResourceDesc *, CUdevResource *, unsigned) = need("cuDevResourceGenerateDesc");
        CUresult (*gcreate)(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned) = need("cuGreenCtxCreate");
        CUresult (*from_green)(CUcontext *, CUgreenCtx) = need("cuCtxFromGreenCtx");
        CUdevResource res;
        CUdevResourceDesc desc;
        CUcontext gctx;
        CHECK(get_res(dev, &res, CU_DEV_RESOURCE_TYPE_SM));
        CHECK(gen_desc(&desc, &res, 1));
        CHECK(gcreate(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
        CHECK(from_green(&gctx, green));
        CHECK(set_cur(gctx));
    }
    bool noctx = strstr(path, "_noctx") != NULL;
    if (noctx) {
        CUresult (*lib_load)(CUlibrary *, const void *, CUjit_option *, void **, unsigned, CUlibraryOption *,
                             void **, unsigned) = need("cuLibraryLoadData");
        CUresult (*get_kernel)(CUkernel *, CUlibrary, const char *) = need("cuLibraryGetKernel");
        CUlibrary library;
        CUkernel kernel;
        CHECK(lib_load(&library, "fatbin", NULL, NULL, 0, NULL, NULL, 0));
        CHECK(get_kernel(&kernel, library, kname));
        fn = (CUfunction)(void *)kernel; /* cuda.h: a CUkernel may be launched as a CUfunction */
    } else {
        CHECK(load(&mod, "fatbin"));
        CHECK(get_fn(&fn, mod, kname));
    }
    CHECK(alloc(&buf, 1 << 20)); /* so that the process is listed among the GPU's compute processes */
    if (green != NULL) {
        CUresult (*gstream)(CUstream *, CUgreenCtx, unsigned, int) = need("cuGreenCtxStreamCreate");
        CHECK(gstream(&stream, green, CU_STREAM_NON_BLOCKING, 0));
    } else {
        CHECK(stream_create(&stream, CU_STREAM_NON_BLOCKING));
    }
    void *args[] = {&buf};

    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **) = NULL;
    CUresult (*launch_ex)(const CUlaunchConfig *, CUfunction, void **, void **) = NULL;
    CUresult (*coop)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **) = NULL;
    CUresult (*multi)(CUDA_LAUNCH_PARAMS *, unsigned, unsigned) = NULL;
    CUresult (*graph_launch)(CUgraphExec, CUstream) = NULL;
    CUresult (*grid)(CUfunction, int, int) = NULL;
    CUresult (*grid_async)(CUfunction, int, int, CUstream) = NULL;
    CUresult (*launch1)(CUfunction) = NULL;
    CUgraphExec exec = NULL;
    bool ptsz = strstr(path, "_ptsz") != NULL;
    if (strcmp(path, "launch") == 0 || strncmp(path, "grid", 4) == 0) {
        CUresult (*shape)(CUfunction, int, int, int) = need("cuFuncSetBlockShape");
        CUresult (*param_size)(CUfunction, unsigned) = need("cuParamSetSize");
        CUresult (*param_v)(CUfunction, int, void *, unsigned) = need("cuParamSetv");
        CHECK(shape(fn, (int)threads, 1, 1));
        CHECK(param_size(fn, sizeof(buf)));
        CHECK(param_v(fn, 0, &buf, sizeof(buf)));
        if (strcmp(path, "launch") == 0)
            launch1 = need("cuLaunch");
        else if (strcmp(path, "grid") == 0)
            grid = need("cuLaunchGrid");
        else
            grid_async = need("cuLaunchGridAsync");
    } else if (strncmp(path, "kernel", 6) == 0) {
        launch = need(ptsz ? "cuLaunchKernel_ptsz" : "cuLaunchKernel");
    } else if (strncmp(path, "proc", 4) == 0) {
        CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
            need("cuGetProcAddress_v2");
        CUdriverProcAddressQueryResult st;
        CHECK(gpa("cuLaunchKernel", (void **)&launch, 12000,
                  ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT, &st));
    } else if (strncmp(path, "ex", 2) == 0) {
        launch_ex = need(ptsz ? "cuLaunchKernelEx_ptsz" : "cuLaunchKernelEx");
    } else if (strncmp(path, "coop", 4) == 0) {
        coop = need(ptsz ? "cuLaunchCooperativeKernel_ptsz" : "cuLaunchCooperativeKernel");
    } else if (strcmp(path, "multi") == 0) {
        multi = need("cuLaunchCooperativeKernelMultiDevice");
    } else if (strncmp(path, "graph", 5) == 0) {
        CUresult (*gcreate)(CUgraph *, unsigned) = need("cuGraphCreate");
        CUresult (*gadd)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const CUDA_KERNEL_NODE_PARAMS *) =
            need("cuGraphAddKernelNode_v2");
        CUresult (*ginst)(CUgraphExec *, CUgraph, unsigned long long) = need("cuGraphInstantiateWithFlags");
        graph_launch = need(ptsz ? "cuGraphLaunch_ptsz" : "cuGraphLaunch");
        CUgraph g;
        CUgraphNode node;
        CUDA_KERNEL_NODE_PARAMS p;
        memset(&p, 0, sizeof(p));
        if (noctx)
            p.kern = (CUkernel)(void *)fn; /* func NULL: the context-less kernel */
        else
            p.func = fn;
        p.gridDimX = blocks, p.gridDimY = 1, p.gridDimZ = 1;
        p.blockDimX = threads, p.blockDimY = 1, p.blockDimZ = 1;
        p.kernelParams = args;
        CHECK(gcreate(&g, 0));
        CHECK(gadd(&node, g, NULL, 0, &p));
        CHECK(ginst(&exec, g, 0));
    } else {
        fprintf(stderr, "launch_loop: unknown path %s\n", path);
        return 2;
    }
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.gridDimX = blocks, cfg.gridDimY = 1, cfg.gridDimZ = 1;
    cfg.blockDimX = threads, cfg.blockDimY = 1, cfg.blockDimZ = 1;
    cfg.hStream = stream;
    CUDA_LAUNCH_PARAMS mp;
    memset(&mp, 0, sizeof(mp));
    mp.function = fn;
    mp.gridDimX = blocks, mp.gridDimY = 1, mp.gridDimZ = 1;
    mp.blockDimX = threads, mp.blockDimY = 1, mp.blockDimZ = 1;
    mp.hStream = stream;
    mp.kernelParams = args;

    if (noctx) {
        CUcontext popped;
        CHECK(pop(&popped)); /* from here on no context is current: the stream's context is used */
    }

    uint64_t start = now_ns(), end = start + (uint64_t)(seconds * 1e9);
    uint64_t launches = 0;
    size_t nb = 0;
    for (;;) {
        uint64_t t0 = now_ns();
        if (t0 >= end)
            break;
        for (int i = 0; i < BATCH; i++) {
            if (i > 0 && now_ns() >= end)
                break;
            if (launch != NULL)
                CHECK(launch(fn, blocks, 1, 1, threads, 1, 1, 0, stream, args, NULL));
            else if (launch_ex != NULL)
                CHECK(launch_ex(&cfg, fn, args, NULL));
            else if (coop != NULL)
                CHECK(coop(fn, blocks, 1, 1, threads, 1, 1, 0, stream, args));
            else if (multi != NULL)
                CHECK(multi(&mp, 1, 0));
            else if (launch1 != NULL)
                CHECK(launch1(fn));
            else if (grid != NULL)
                CHECK(grid(fn, (int)blocks, 1));
            else if (grid_async != NULL)
                CHECK(grid_async(fn, (int)blocks, 1, stream));
            else
                CHECK(graph_launch(exec, stream));
        }
        launches += BATCH;
        if (nb < MAX_BATCHES)
            batches[nb++] = (double)(now_ns() - t0) / BATCH;
    }
    double secs = (double)(now_ns() - start) / 1e9;
    qsort(batches, nb, sizeof(batches[0]), cmp);
    double median = nb == 0 ? 0 : nb % 2 ? batches[nb / 2] : (batches[nb / 2 - 1] + batches[nb / 2]) / 2;
    printf("{\"path\": \"%s\", \"launches\": %llu, \"seconds\": %.3f, \"per_launch_ns\": %.1f}\n", path,
           (unsigned long long)launches, secs, median);
    fflush(stdout);
    return 0;
}
