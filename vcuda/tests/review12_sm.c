/*
 * A tenant's attempts to run more kernels than its container's SM share admits (tests/test_vcuda_sm_review12.py).
 *
 *   review12_sm <scenario>
 *
 * Each scenario offers up to OFFERED kernels of 50 ms of simulated GPU time through one launch path for at most
 * WINDOW_MS of wall time, and prints one line "admitted <n> of <offered> in <ms> ms": how many launch calls returned
 * (the work the interceptor let through to the driver).  At a 30 % share the gate admits a few hundred ms of GPU time
 * in that window, i.e. a handful of such kernels; an ungated path admits all of them at once.  With REVIEW12_RESTED
 * set, the offer comes after one launch through the path and half a second's rest (the credit full).  Exit 0 when the
 * scenario ran; 2/3 on a set-up failure.  Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's mirror).
 */
#include "review_driver.h"

#include <nvml.h>

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#define OFFERED 100
#define WINDOW_MS 1000.0

static const char PTX[] = ".version 7.0\n.target sm_75\n.address_size 64\n.visible .entry spin_50ms() { ret; }\n"
                          ".visible .entry spin_1us() { ret; }\n"
                          ".visible .entry spin_2500ms() { ret; }\n"
                          ".visible .entry spin_5000ms() { ret; }\n";

typedef CUresult (*multi_fn)(CUDA_LAUNCH_PARAMS *, unsigned int, unsigned int); /* deprecated in cuda.h */
typedef CUresult (*grid_fn)(CUfunction, int, int);
typedef CUresult (*grid_async_fn)(CUfunction, int, int, CUstream);
typedef CUresult (*shape_fn)(CUfunction, int, int, int);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static CUfunction g_fn, g_long;
static CUstream g_stream;
static CUcontext g_ctx;

/* Offers kernels through `one` (returns a launch's result) until OFFERED or the window is over; prints the count. */
static void offer(CUresult (*one)(void))
{
    if (getenv("REVIEW12_RESTED") != NULL) {
        /* One launch through the path, then a rest: the offer starts with the limiter's credit full. */
        check(one(), "launch");
        usleep(500000);
    }
    double start = now_ms();
    int admitted = 0;
    while (admitted < OFFERED && now_ms() - start < WINDOW_MS) {
        check(one(), "launch");
        admitted++;
    }
    printf("admitted %d of %d in %.0f ms\n", admitted, OFFERED, now_ms() - start);
    fflush(stdout);
}

static CUresult one_kernel(void)
{
    return FN(cuLaunchKernel)(g_fn, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL);
}

static CUresult one_kernel_ptsz(void)
{
    return ((launch_fn)sym("cuLaunchKernel_ptsz"))(g_fn, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL);
}

static CUlaunchConfig ex_config(void)
{
    return (CUlaunchConfig){.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32, .blockDimY = 1,
                            .blockDimZ = 1, .hStream = g_stream};
}

static CUresult one_ex(void)
{
    CUlaunchConfig c = ex_config();
    return FN(cuLaunchKernelEx)(&c, g_fn, NULL, NULL);
}

static CUresult one_ex_ptsz(void)
{
    CUlaunchConfig c = ex_config();
    return ((__typeof__(&cuLaunchKernelEx))sym("cuLaunchKernelEx_ptsz"))(&c, g_fn, NULL, NULL);
}

static CUresult one_coop(void)
{
    return FN(cuLaunchCooperativeKernel)(g_fn, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL);
}

static CUresult one_coop_ptsz(void)
{
    return ((__typeof__(&cuLaunchCooperativeKernel))sym("cuLaunchCooperativeKernel_ptsz"))(g_fn, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL);
}

static CUresult one_multi(void)
{
    CUDA_LAUNCH_PARAMS p = {.function = g_fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32,
                            .blockDimY = 1, .blockDimZ = 1, .hStream = g_stream};
    return ((multi_fn)sym("cuLaunchCooperativeKernelMultiDevice"))(&p, 1, 0);
}

static CUresult one_grid_async(void)
{
    return ((grid_async_fn)sym("cuLaunchGridAsync"))(g_fn, 1, 1, g_stream);
}

static CUresult one_grid(void)
{
    return ((grid_fn)sym("cuLaunchGrid"))(g_fn, 1, 1);
}

static CUresult one_legacy(void)
{
    return ((CUresult(*)(CUfunction))sym("cuLaunch"))(g_fn);
}

static CUgraphExec g_exec;

static CUresult one_graph(void)
{
    return FN(cuGraphLaunch)(g_exec, g_stream);
}

static CUresult one_graph_ptsz(void)
{
    return ((__typeof__(&cuGraphLaunch))sym("cuGraphLaunch_ptsz"))(g_exec, g_stream);
}

/* g_exec: a graph of one 50 ms kernel, captured from a stream (captured) or built node by node. */
static void make_graph(bool captured)
{
    CUgraph graph;
    if (captured) {
        check(FN(cuStreamBeginCapture_v2)(g_stream, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture_v2");
        check(one_kernel(), "captured cuLaunchKernel");
        check(FN(cuStreamEndCapture)(g_stream, &graph), "cuStreamEndCapture");
    } else {
        check(FN(cuGraphCreate)(&graph, 0), "cuGraphCreate");
        CUDA_KERNEL_NODE_PARAMS kp = {.func = g_fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32,
                                      .blockDimY = 1, .blockDimZ = 1};
        CUgraphNode node;
        check(FN(cuGraphAddKernelNode_v2)(&node, graph, NULL, 0, &kp), "cuGraphAddKernelNode");
    }
    check(FN(cuGraphInstantiateWithFlags)(&g_exec, graph, 0), "cuGraphInstantiate");
}

/* A CUkernel of a library, launched as a CUfunction on a created stream while no context is current. */
static void library_kernel(void)
{
    CUlibrary lib;
    CUkernel k;
    check(FN(cuLibraryLoadData)(&lib, PTX, NULL, NULL, 0, NULL, NULL, 0), "cuLibraryLoadData");
    check(FN(cuLibraryGetKernel)(&k, lib, "spin_50ms"), "cuLibraryGetKernel");
    g_fn = (CUfunction)k;
    CUcontext none = NULL;
    check(FN(cuCtxPopCurrent_v2)(&none), "cuCtxPopCurrent");
    offer(one_kernel);
}

/* Launches spread over several threads, each with a stream of its own. */
#define THREADS 8
static _Atomic int g_admitted;
static double g_start;

static void *launcher(void *arg)
{
    (void)arg;
    FN(cuCtxSetCurrent)(g_ctx);
    CUstream s;
    if (FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        return NULL;
    while (atomic_load(&g_admitted) < OFFERED && now_ms() - g_start < WINDOW_MS)
        if (FN(cuLaunchKernel)(g_fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL) == CUDA_SUCCESS)
            atomic_fetch_add(&g_admitted, 1);
    return NULL;
}

static void threads(void)
{
    pthread_t t[THREADS];
    g_start = now_ms();
    for (int i = 0; i < THREADS; i++)
        if (pthread_create(&t[i], NULL, launcher, NULL) != 0)
            exit(2);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    printf("admitted %d of %d in %.0f ms\n", atomic_load(&g_admitted), OFFERED, now_ms() - g_start);
}

/* Launches spread over several contexts of the device, each with its module and stream. */
#define CONTEXTS 4
static CUfunction g_fns[CONTEXTS];
static CUstream g_streams[CONTEXTS];
static CUcontext g_ctxs[CONTEXTS];
static unsigned g_next;

static CUresult one_in_next_context(void)
{
    unsigned i = g_next++ % CONTEXTS;
    FN(cuCtxSetCurrent)(g_ctxs[i]);
    return FN(cuLaunchKernel)(g_fns[i], 1, 1, 1, 32, 1, 1, 0, g_streams[i], NULL, NULL);
}

static void contexts(bool rested)
{
    for (int i = 0; i < CONTEXTS; i++) {
        g_ctxs[i] = created_context();
        g_fns[i] = load_kernel(PTX, "spin_50ms");
        check(FN(cuStreamCreate)(&g_streams[i], CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    }
    if (rested) {
        /*
         * A kernel in each context, waited for, then a rest: the limiter has measured them and its credit is full
         * when the offer starts, so the first launches find another context's marker outstanding with credit to
         * spare.  Such a launch was counted complete at once, and every launch before it with it: nothing stayed in
         * flight, and the gate let the whole offer through before its next measurement.
         */
        for (int i = 0; i < CONTEXTS; i++) {
            check(one_in_next_context(), "launch");
            check(FN(cuStreamSynchronize)(g_streams[i]), "cuStreamSynchronize");
        }
        usleep(500000);
    }
    offer(one_in_next_context);
}

/*
 * Kernels in a context that then goes (kind: "created", cuCtxDestroy; "primary", the primary context's last
 * release; "green", cuGreenCtxDestroy, which releases the primary context too) with them still running, then the
 * offer in a new context.  The context's events went with it: the limiter must neither ask for nor destroy its
 * markers there again (a real driver's freed memory; the simulated driver stops the process), at no moment (its
 * watcher looks every 10 ms, and VCUDA_TEST_DESTROY_DELAY_US, in a build with -DVC_TEST_HOOKS, holds the moment
 * right after the driver's destroy open), and must still gate the new context's launches.
 */
static void context_destroyed(const char *kind)
{
    CUdevice dev;
    check(FN(cuInit)(0), "cuInit");
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    CUcontext gone = NULL;
    CUgreenCtx green = NULL;
    CUstream s;
    if (strcmp(kind, "primary") == 0) {
        check(FN(cuDevicePrimaryCtxRetain)(&gone, dev), "cuDevicePrimaryCtxRetain");
        check(FN(cuCtxSetCurrent)(gone), "cuCtxSetCurrent");
    } else if (strcmp(kind, "green") == 0) {
        CUdevResource sm;
        check(FN(cuDeviceGetDevResource)(dev, &sm, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
        CUdevResourceDesc desc;
        check(FN(cuDevResourceGenerateDesc)(&desc, &sm, 1), "cuDevResourceGenerateDesc");
        check(FN(cuGreenCtxCreate)(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
        check(FN(cuCtxFromGreenCtx)(&gone, green), "cuCtxFromGreenCtx");
        check(FN(cuCtxSetCurrent)(gone), "cuCtxSetCurrent");
    } else {
        gone = created_context();
    }
    CUfunction fn = load_kernel(PTX, "spin_50ms");
    if (green != NULL)
        check(FN(cuGreenCtxStreamCreate)(&s, green, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate");
    else
        check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (int i = 0; i < 3; i++)
        check(FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL), "launch");
    if (strcmp(kind, "primary") == 0) {
        check(FN(cuCtxSetCurrent)(NULL), "cuCtxSetCurrent");
        check(FN(cuDevicePrimaryCtxRelease_v2)(dev), "cuDevicePrimaryCtxRelease");
    } else if (green != NULL) {
        check(FN(cuCtxSetCurrent)(NULL), "cuCtxSetCurrent");
        check(FN(cuGreenCtxDestroy)(green), "cuGreenCtxDestroy");
    } else {
        check(FN(cuCtxDestroy_v2)(gone), "cuCtxDestroy");
    }
    g_ctx = created_context();
    g_fn = load_kernel(PTX, "spin_50ms");
    check(FN(cuStreamCreate)(&g_stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    offer(one_kernel);
}

/*
 * Another thread's launches while a context is destroyed (`primary`: the device's primary context, released for the
 * last time; `held`: with another reference kept, so that the release leaves it alive and its kernels running).  Kernels in the context first, complete (their markers
 * stay in the limiter's ring) or, `running`, still running (the limiter counts them in flight), then the destroy; from just before it, another thread launches 1 us kernels in its
 * own context until the destroy has returned, and the launches that went meanwhile are counted.  The limiter held
 * every device's lock across the driver's destroy, which waits for the context's work: nothing launched anywhere
 * meanwhile (VCUDA_TEST_DESTROY_DELAY_US, -DVC_TEST_HOOKS, makes the destroy last), and a host function of the
 * context waiting for another thread's launch would have waited for good.
 */
static atomic_int g_destroy_phase; /* 0: before, 1: destroying, 2: done */
static _Atomic long g_during;

static void *launch_during_destroy(void *arg)
{
    (void)arg;
    check(FN(cuCtxSetCurrent)(g_ctx), "cuCtxSetCurrent");
    CUfunction cheap = load_kernel(PTX, "spin_1us");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    while (atomic_load(&g_destroy_phase) == 0)
        usleep(1000);
    while (atomic_load(&g_destroy_phase) == 1)
        if (FN(cuLaunchKernel)(cheap, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL) == CUDA_SUCCESS &&
            atomic_load(&g_destroy_phase) == 1)
            atomic_fetch_add(&g_during, 1);
    return NULL;
}

static void destroy_elsewhere(bool running, bool primary, bool held)
{
    pthread_t t;
    if (pthread_create(&t, NULL, launch_during_destroy, NULL) != 0)
        exit(2);
    CUdevice dev;
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    CUcontext gone = NULL;
    if (primary) {
        check(FN(cuDevicePrimaryCtxRetain)(&gone, dev), "cuDevicePrimaryCtxRetain");
        if (held) /* a reference kept: the release below is not the last */
            check(FN(cuDevicePrimaryCtxRetain)(&gone, dev), "cuDevicePrimaryCtxRetain");
        check(FN(cuCtxSetCurrent)(gone), "cuCtxSetCurrent");
    } else {
        gone = created_context();
    }
    CUfunction fn = load_kernel(PTX, "spin_50ms");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (int i = 0; i < 3; i++)
        check(FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL), "launch");
    if (!running) {
        check(FN(cuCtxSynchronize)(), "cuCtxSynchronize");
        usleep(100000); /* the limiter's watcher has seen the markers complete */
    }
    atomic_store(&g_destroy_phase, 1);
    usleep(20000); /* the other thread launches */
    double start = now_ms();
    if (primary) {
        check(FN(cuCtxSetCurrent)(NULL), "cuCtxSetCurrent");
        check(FN(cuDevicePrimaryCtxRelease_v2)(dev), "cuDevicePrimaryCtxRelease"); /* the last one unless held */
    }
    else
        check(FN(cuCtxDestroy_v2)(gone), "cuCtxDestroy");
    double took = now_ms() - start;
    atomic_store(&g_destroy_phase, 2);
    pthread_join(t, NULL);
    printf("admitted %ld of 1 us in another context while the destroy took %.0f ms\n", atomic_load(&g_during), took);
}

/* One kernel in a context made for it, destroyed right after the launch with the kernel running. */
static CUresult one_in_fresh_context(void)
{
    CUcontext c = created_context();
    CUfunction fn = load_kernel(PTX, "spin_50ms");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUresult rc = FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
    check(FN(cuCtxDestroy_v2)(c), "cuCtxDestroy");
    return rc;
}

/*
 * One kernel in the device's primary context, retained for it and released right after the launch with the kernel
 * running: the last release destroys it (primary-churn), or, with a reference held all along (primary-held-churn),
 * leaves it alive, its kernels still running and still to be waited for.
 */
static CUresult one_in_primary(void)
{
    CUdevice dev;
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    CUcontext primary;
    check(FN(cuDevicePrimaryCtxRetain)(&primary, dev), "cuDevicePrimaryCtxRetain");
    check(FN(cuCtxSetCurrent)(primary), "cuCtxSetCurrent");
    CUfunction fn = load_kernel(PTX, "spin_50ms");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUresult rc = FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
    check(FN(cuCtxSetCurrent)(NULL), "cuCtxSetCurrent");
    check(FN(cuDevicePrimaryCtxRelease_v2)(dev), "cuDevicePrimaryCtxRelease");
    return rc;
}

static void primary_churn(bool held)
{
    if (held) {
        CUdevice dev;
        check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
        CUcontext primary;
        check(FN(cuDevicePrimaryCtxRetain)(&primary, dev), "cuDevicePrimaryCtxRetain");
    }
    offer(one_in_primary);
}

/*
 * The thread's context stack filled (another context pushed until the driver refuses), then kernels on a stream of
 * the first context: the limiter cannot make the stream's context current to tell its device or record a marker
 * there.  Such a launch was counted complete at once: nothing was ever in flight (1025 of 50 ms admitted in 1 s).
 */
static void stack_full(void)
{
    CUdevice dev;
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    CUcontext other;
    check(FN(cuCtxCreate_v2)(&other, 0, dev), "cuCtxCreate");
    for (int i = 0; i < 4096 && FN(cuCtxPushCurrent_v2)(other) == CUDA_SUCCESS; i++)
        ;
    offer(one_kernel);
}

/*
 * Kernels of 1 us for a second on a stream that another thread keeps replacing: it makes a new stream, publishes it
 * and destroys the one before, so that a launch often finds its stream destroyed while it is in the driver, or
 * right after (the limiter's marker on it then fails).  A launch refused for its destroyed stream is tried again on
 * the new one.  The process must run through (the simulated driver, under ASan, wrote to a stream it had looked up
 * and another thread had freed since) and its launches must stay gated: it prints the launches admitted.
 */
static _Atomic(CUstream) g_churned;
static atomic_bool g_churn_stop;

static void *churn_streams(void *arg)
{
    (void)arg;
    FN(cuCtxSetCurrent)(g_ctx);
    while (!atomic_load(&g_churn_stop)) {
        CUstream fresh;
        if (FN(cuStreamCreate)(&fresh, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
            continue;
        CUstream old = atomic_exchange(&g_churned, fresh);
        FN(cuStreamDestroy_v2)(old);
    }
    return NULL;
}

static void stream_churn(void)
{
    CUfunction cheap = load_kernel(PTX, "spin_1us");
    CUstream first;
    check(FN(cuStreamCreate)(&first, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    atomic_store(&g_churned, first);
    pthread_t t;
    if (pthread_create(&t, NULL, churn_streams, NULL) != 0)
        exit(2);
    double start = now_ms();
    long admitted = 0, refused = 0;
    while (now_ms() - start < WINDOW_MS) {
        CUresult rc = FN(cuLaunchKernel)(cheap, 1, 1, 1, 32, 1, 1, 0, atomic_load(&g_churned), NULL, NULL);
        if (rc == CUDA_SUCCESS)
            admitted++;
        else if (rc == CUDA_ERROR_INVALID_HANDLE)
            refused++;
        else
            check(rc, "launch");
    }
    atomic_store(&g_churn_stop, true);
    pthread_join(t, NULL);
    printf("admitted %ld of 1 us (%ld refused: their stream destroyed) in %.0f ms\n", admitted, refused,
           now_ms() - start);
}

/*
 * Kernels of 1 us for 0.3 s first: the limiter learns a cost of about 1 us a launch, and at that cost its credit
 * covered a thousand launches in flight.  The 50 ms kernels offered next all went (1025 queued at once, 51 s of
 * GPU time) before a measurement showed what they were.
 */
static void taught(void)
{
    CUfunction cheap = load_kernel(PTX, "spin_1us");
    double start = now_ms();
    while (now_ms() - start < 300.0)
        check(FN(cuLaunchKernel)(cheap, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL), "launch");
    offer(one_kernel);
}

/*
 * A rest (the credit full), a kernel waited for with cuStreamSynchronize, and at once a burst of launches the driver
 * refuses, before the limiter has looked at the kernel's marker: each refused launch was counted done on its own,
 * standing for the kernel, whose marker then raised the count no further.  That phantom stayed in flight, its wall
 * time charged while the cost was still a guess, and a later launch could wait for good.
 */
static void refused_after_sync(void)
{
    CUfunction cheap = load_kernel(PTX, "spin_1us");
    check(FN(cuLaunchKernel)(cheap, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL), "launch");
    usleep(500000);
    check(one_kernel(), "launch");
    check(FN(cuStreamSynchronize)(g_stream), "cuStreamSynchronize");
    for (int i = 0; i < 50; i++)
        (void)FN(cuLaunchKernel)(NULL, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL);
    offer(one_kernel);
}

/* A green context's stream. */
static void green(void)
{
    CUdevice dev;
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    CUdevResource sm;
    check(FN(cuDeviceGetDevResource)(dev, &sm, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
    CUdevResourceDesc desc;
    check(FN(cuDevResourceGenerateDesc)(&desc, &sm, 1), "cuDevResourceGenerateDesc");
    CUgreenCtx gc;
    check(FN(cuGreenCtxCreate)(&gc, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
    CUcontext ctx;
    check(FN(cuCtxFromGreenCtx)(&ctx, gc), "cuCtxFromGreenCtx");
    check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    g_fn = load_kernel(PTX, "spin_50ms");
    check(FN(cuGreenCtxStreamCreate)(&g_stream, gc, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate");
    offer(one_kernel);
}

/*
 * The first limited launch of the process sets the limiter up for the device and logs it (LOGGER_LEVEL=4, the
 * tenant's variable).  The tenant has made its stderr a pipe that nobody reads and that is full: that thread's
 * log line blocks for good.  The other threads' launches must still be gated.
 */
static void *first_launch(void *arg)
{
    (void)arg;
    FN(cuCtxSetCurrent)(g_ctx);
    CUstream s;
    if (FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        return NULL;
    FN(cuLaunchKernel)(g_fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
    return NULL;
}

static void stall(void)
{
    int p[2];
    if (pipe(p) != 0)
        exit(2);
    fcntl(p[1], F_SETFL, O_NONBLOCK);
    char block[4096];
    memset(block, 'x', sizeof(block));
    while (write(p[1], block, sizeof(block)) > 0)
        ;
    while (write(p[1], block, 1) > 0)
        ;
    fcntl(p[1], F_SETFL, 0);
    if (FN(nvmlInit_v2)() != NVML_SUCCESS) /* the real NVML is opened (and logged) before stderr is the pipe */
        exit(2);
    fflush(stderr);
    int saved = dup(2);
    dup2(p[1], 2);
    pthread_t t;
    if (pthread_create(&t, NULL, first_launch, NULL) != 0)
        exit(2);
    usleep(300000); /* the first launch is in its log line now */
    offer(one_kernel);
    dup2(saved, 2);
    _exit(0); /* the first thread never comes back */
}

/*
 * Every launch entry point the driver hands out through cuGetProcAddress and cuGetProcAddress_v2, at every version
 * and flag: the address must be the interceptor's (the object cuInit is found in), never the driver's.  Prints
 * "escapes <n>" and one line per escape.
 */
static void getproc(void)
{
    static const char *const names[] = {"cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
                                        "cuLaunchCooperativeKernelMultiDevice", "cuGraphLaunch", "cuLaunch",
                                        "cuLaunchGrid", "cuLaunchGridAsync", "cuGetProcAddress"};
    static const int versions[] = {2000, 3000, 3020, 4000, 6000, 7000, 9000, 10000, 11000, 11030, 11060, 11080,
                                   12000, 12010, 12030, 12040, 12050, 12060, 12080, 12090, 13000, 99999};
    static const cuuint64_t flags[] = {CU_GET_PROC_ADDRESS_DEFAULT, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                                       CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM};
    Dl_info self;
    if (dladdr(sym("cuInit"), &self) == 0)
        exit(2);
    CUresult (*gpa)(const char *, void **, int, cuuint64_t) = (__typeof__(gpa))sym("cuGetProcAddress");
    CUresult (*gpa2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        (__typeof__(gpa2))sym("cuGetProcAddress_v2");
    int escapes = 0, found = 0;
    for (size_t n = 0; n < sizeof(names) / sizeof(names[0]); n++)
        for (size_t v = 0; v < sizeof(versions) / sizeof(versions[0]); v++)
            for (size_t f = 0; f < sizeof(flags) / sizeof(flags[0]); f++)
                for (int which = 0; which < 2; which++) {
                    void *p = NULL;
                    CUdriverProcAddressQueryResult st;
                    CUresult rc = which == 0 ? gpa(names[n], &p, versions[v], flags[f])
                                             : gpa2(names[n], &p, versions[v], flags[f], &st);
                    if (rc != CUDA_SUCCESS || p == NULL)
                        continue;
                    found++;
                    Dl_info info;
                    if (dladdr(p, &info) == 0 || info.dli_fbase != self.dli_fbase) {
                        escapes++;
                        printf("escape %s version %d flags %llu via %s: %s\n", names[n], versions[v],
                               (unsigned long long)flags[f], which == 0 ? "cuGetProcAddress" : "cuGetProcAddress_v2",
                               dladdr(p, &info) != 0 && info.dli_fname != NULL ? info.dli_fname : "?");
                    }
                }
    printf("found %d escapes %d\n", found, escapes);
}

/*
 * One kernel of 2.5 s (admitted: nothing is in flight), then the process has itself stopped (SIGSTOP from a child,
 * SIGCONT 3.5 s later): its limiter measures nothing meanwhile, and NVML answers for the last second only.  The
 * kernel's 2.5 s must still be paid for: at 30 % the container owes about 1.5 s after it (5 s of no launches).
 */
static void stopped(void)
{
    /* The limiter learns what a launch costs first (else a launch is charged the wall time it was outstanding). */
    for (double start = now_ms(); now_ms() - start < 1500.0;)
        check(one_kernel(), "cuLaunchKernel");
    check(FN(cuStreamSynchronize)(g_stream), "cuStreamSynchronize");
    check(FN(cuLaunchKernel)(g_long, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL), "cuLaunchKernel");
    pid_t parent = getpid();
    pid_t child = fork();
    if (child < 0)
        exit(2);
    if (child == 0) {
        kill(parent, SIGSTOP);
        usleep(3500000);
        kill(parent, SIGCONT);
        _exit(0);
    }
    int status;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR)
        ;
    offer(one_kernel);
}

/*
 * Two threads' first launches at once (an interceptor built with -DVC_TEST_HOOKS holds the one that sets the
 * device's limiter up for VCUDA_TEST_INIT_DELAY_US in the middle of it): the other thread's launches must wait for
 * the limiter, not pass while it is half set up.
 */
static void init_race(void)
{
    pthread_t t;
    if (pthread_create(&t, NULL, first_launch, NULL) != 0)
        exit(2);
    usleep(200000); /* the first launch is setting the limiter up now */
    offer(one_kernel);
    pthread_join(t, NULL);
}

/*
 * Thread creation the tenant refuses once g_refuse_threads is set (this program's pthread_create comes first in the
 * process's symbol lookup): as where the container's pids cgroup is full when the limiter starts its watcher.
 */
static atomic_bool g_refuse_threads;

int pthread_create(pthread_t *thread, const pthread_attr_t *attr, void *(*start)(void *), void *arg)
{
    static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    if (atomic_load(&g_refuse_threads))
        return EAGAIN;
    if (real == NULL)
        *(void **)&real = dlsym(RTLD_NEXT, "pthread_create");
    return real(thread, attr, start, arg);
}

/*
 * The limiter's watcher (the thread that measures every 10 ms) cannot be started (the tenant refuses threads; it
 * could as well end it with a signal handler that calls pthread_exit).  Then kernels of 2.5 s, one every 300 ms:
 * each launch found credit enough (300 ms of refill at 30 % is more than the 50 ms a launch was learnt to cost) and
 * went without a look at NVML, so nothing was ever measured.  Gated, the second waits until the first is paid for:
 * at most 2 in the 3 s.
 */
static void no_watcher(void)
{
    atomic_store(&g_refuse_threads, true);
    for (double start = now_ms(); now_ms() - start < 1500.0;)
        check(one_kernel(), "cuLaunchKernel");
    check(FN(cuStreamSynchronize)(g_stream), "cuStreamSynchronize");
    double start = now_ms();
    int admitted = 0;
    while (now_ms() - start < 3000.0) {
        check(FN(cuLaunchKernel)(g_long, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL), "cuLaunchKernel");
        admitted++;
        usleep(300000);
    }
    printf("admitted %d of %d in %.0f ms\n", admitted, admitted, now_ms() - start);
    fflush(stdout);
    _exit(0); /* the long kernels are not waited for */
}

/*
 * A chain of processes, one after the other: each launches a kernel of 5 s (gated: it waits for the debt of those
 * before it) and exits 1 s later, its kernel still running.  Prints "elapsed <ms>" for the whole chain; the test
 * compares it with the GPU time the chain used (the simulated node's timeline).
 */
static void exit_tail(const char *self, int processes)
{
    double start = now_ms();
    for (int i = 0; i < processes; i++) {
        pid_t child = fork();
        if (child < 0)
            exit(2);
        if (child == 0) {
            execl(self, self, "tail-child", (char *)NULL);
            _exit(2);
        }
        int status;
        while (waitpid(child, &status, 0) < 0 && errno == EINTR)
            ;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            exit(3);
    }
    printf("elapsed %.0f\n", now_ms() - start);
}

static void tail_child(void)
{
    open_driver();
    created_context();
    CUfunction fn = load_kernel(PTX, "spin_5000ms");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    check(FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");
    const char *life = getenv("REVIEW12_CHILD_US");
    usleep(life != NULL ? (useconds_t)atoi(life) : 1000000u);
    _exit(0);
}

/*
 * The cost's wall bound (vc_core.c, bound_cost) counts the launches completed: one kernel, then a burst of launches
 * the driver refuses (no function), each counted complete at once, made it nanoseconds, and the gate then let every
 * kernel offered through at once.  `learnt`: the burst comes once the limiter has learnt the kernel's cost from
 * NVML's samples, spread over its measurements; each refused launch was then charged that cost provisionally (about
 * 50 ms), a debt of minutes that the idle process's samples did not refund, and a refused launch of the burst waited
 * for it (seen now and then in the plain burst, slowed down by ASan and a busy machine).  Prints the refused launches
 * made in 20 s (at most) too.
 */
static void failed_burst(bool learnt)
{
    check(one_kernel(), "launch");
    check(FN(cuStreamSynchronize)(g_stream), "cuStreamSynchronize");
    if (learnt)
        usleep(300000); /* NVML's samples have taught the limiter the kernel's cost (about 50 ms) */
    double start = now_ms();
    int refused = 0;
    for (; refused < 2000 && now_ms() - start < 20000.0; refused++) {
        (void)FN(cuLaunchKernel)(NULL, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL);
        if (learnt)
            usleep(200); /* spread over the limiter's measurements (the watcher's 10 ms) */
    }
    printf("refused %d of 2000 in %.0f ms\n", refused, now_ms() - start);
    offer(one_kernel);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: review12_sm <scenario>\n");
        return 2;
    }
    if (strcmp(argv[1], "exit-tail") == 0) {
        exit_tail(argv[0], 5);
        return 0;
    }
    if (strcmp(argv[1], "tail-child") == 0)
        tail_child();
    open_driver();
    g_ctx = created_context();
    g_fn = load_kernel(PTX, "spin_50ms");
    g_long = load_kernel(PTX, "spin_2500ms");
    check(FN(cuStreamCreate)(&g_stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    const char *s = argv[1];
    if (strcmp(s, "stall") == 0)
        stall();
    else if (strcmp(s, "init-race") == 0)
        init_race();
    else if (strcmp(s, "no-watcher") == 0)
        no_watcher();
    else if (strcmp(s, "stopped") == 0)
        stopped();
    else if (strcmp(s, "getproc") == 0)
        getproc();
    else if (strcmp(s, "kernel") == 0)
        offer(one_kernel);
    else if (strcmp(s, "kernel-ptsz") == 0)
        offer(one_kernel_ptsz);
    else if (strcmp(s, "ex") == 0)
        offer(one_ex);
    else if (strcmp(s, "ex-ptsz") == 0)
        offer(one_ex_ptsz);
    else if (strcmp(s, "coop") == 0)
        offer(one_coop);
    else if (strcmp(s, "coop-ptsz") == 0)
        offer(one_coop_ptsz);
    else if (strcmp(s, "multi") == 0)
        offer(one_multi);
    else if (strcmp(s, "legacy") == 0 || strcmp(s, "grid") == 0 || strcmp(s, "grid-async") == 0) {
        check(((shape_fn)sym("cuFuncSetBlockShape"))(g_fn, 32, 1, 1), "cuFuncSetBlockShape");
        offer(strcmp(s, "grid") == 0 ? one_grid : strcmp(s, "legacy") == 0 ? one_legacy : one_grid_async);
    } else if (strcmp(s, "graph-captured") == 0 || strcmp(s, "graph-built") == 0) {
        make_graph(strcmp(s, "graph-captured") == 0);
        offer(one_graph);
    } else if (strcmp(s, "graph-ptsz") == 0) {
        make_graph(true);
        offer(one_graph_ptsz);
    } else if (strcmp(s, "library") == 0)
        library_kernel();
    else if (strcmp(s, "threads") == 0)
        threads();
    else if (strcmp(s, "contexts") == 0 || strcmp(s, "contexts-rested") == 0)
        contexts(strcmp(s, "contexts-rested") == 0);
    else if (strcmp(s, "green") == 0)
        green();
    else if (strcmp(s, "context-destroyed") == 0)
        context_destroyed("created");
    else if (strcmp(s, "context-churn") == 0)
        offer(one_in_fresh_context);
    else if (strcmp(s, "primary-churn") == 0 || strcmp(s, "primary-held-churn") == 0)
        primary_churn(strcmp(s, "primary-held-churn") == 0);
    else if (strcmp(s, "primary-released") == 0)
        context_destroyed("primary");
    else if (strcmp(s, "green-destroyed") == 0)
        context_destroyed("green");
    else if (strcmp(s, "stack-full") == 0)
        stack_full();
    else if (strcmp(s, "taught") == 0)
        taught();
    else if (strcmp(s, "stream-churn") == 0)
        stream_churn();
    else if (strcmp(s, "destroy-elsewhere") == 0)
        destroy_elsewhere(false, false, false);
    else if (strcmp(s, "destroy-elsewhere-running") == 0)
        destroy_elsewhere(true, false, false);
    else if (strcmp(s, "release-elsewhere-running") == 0)
        destroy_elsewhere(true, true, false);
    else if (strcmp(s, "release-elsewhere-running-held") == 0)
        destroy_elsewhere(true, true, true);
    else if (strcmp(s, "refused-after-sync") == 0)
        refused_after_sync();
    else if (strcmp(s, "failed-burst") == 0)
        failed_burst(false);
    else if (strcmp(s, "failed-burst-learnt") == 0)
        failed_burst(true);
    else {
        fprintf(stderr, "unknown scenario %s\n", s);
        return 2;
    }
    return 0;
}
