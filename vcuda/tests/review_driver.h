/*
 * What the review test programs share: the real entry points of the libcuda.so.1 they dlopen
 * (the interceptor, as a container's program loads it), looked up by name, a check of each call's
 * result, and the set-ups they repeat (a context, a kernel, a capture ended by another thread).
 * Included once per program.
 */
#ifndef REVIEW_DRIVER_H
#define REVIEW_DRIVER_H

#include <cuda.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define MIB (1ull << 20)

/* The library every FN() is looked up in: set by the program's dlopen before the first call. */
static void *g_lib;

/* The address of `name` in lib; exit status 2 when it has none. */
static inline void *sym_in(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (p == NULL) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return p;
}

/* The address of `name` in g_lib; exit status 2 when it has none. */
static inline void *sym(const char *name)
{
    return sym_in(g_lib, name);
}

/* Call a driver function through g_lib: FN(cuInit)(0). */
#define FN(name) ((__typeof__(&name))sym(#name))

/* Exit status 3, naming the call, when rc is not CUDA_SUCCESS. */
static inline void check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "%s failed: %d\n", what, (int)rc);
        exit(3);
    }
}

/* `soname` loaded by name (LD_LIBRARY_PATH: the container's driver mirror); exit status 2 when it cannot be. */
static inline void *open_lib(const char *soname)
{
    void *lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
    return lib;
}

/* g_lib: libcuda.so.1 loaded by name, as a container's program loads it. */
static inline void open_driver(void)
{
    g_lib = open_lib("libcuda.so.1");
}

/* cuInit, device 0 and its primary context, made current. */
static inline CUcontext primary_context(void)
{
    CUdevice dev;
    CUcontext ctx;
    check(FN(cuInit)(0), "cuInit");
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    check(FN(cuDevicePrimaryCtxRetain)(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    return ctx;
}

/* cuInit, device 0 and a context created on it (current to the calling thread). */
static inline CUcontext created_context(void)
{
    CUdevice dev;
    CUcontext ctx;
    check(FN(cuInit)(0), "cuInit");
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    check(FN(cuCtxCreate_v2)(&ctx, 0, dev), "cuCtxCreate");
    return ctx;
}

/* Kernel `name` of the module loaded from `image` (cuModuleLoadData) in the current context. */
static inline CUfunction load_kernel(const void *image, const char *name)
{
    CUmodule mod;
    CUfunction fn;
    check(FN(cuModuleLoadData)(&mod, image), "cuModuleLoadData");
    check(FN(cuModuleGetFunction)(&fn, mod, name), "cuModuleGetFunction");
    return fn;
}

/* A stream capture ended by another thread: begin_timed_capture begins it (relaxed mode) and starts the thread,
 * which after `after_ms` makes `ctx` current and ends the capture into `graph`; finish_timed_capture waits for the
 * thread and destroys the graph it captured, if any. */
struct timed_capture {
    CUstream stream;
    CUcontext ctx;
    unsigned after_ms;
    CUgraph graph;
    pthread_t thread;
};

static inline void *timed_capture_end(void *arg)
{
    struct timed_capture *c = arg;
    usleep(c->after_ms * 1000u);
    FN(cuCtxSetCurrent)(c->ctx);
    check(FN(cuStreamEndCapture)(c->stream, &c->graph), "cuStreamEndCapture");
    return NULL;
}

static inline void begin_timed_capture(struct timed_capture *c)
{
    c->graph = NULL;
    check(FN(cuStreamBeginCapture_v2)(c->stream, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture_v2");
    if (pthread_create(&c->thread, NULL, timed_capture_end, c) != 0)
        exit(2);
}

static inline void finish_timed_capture(struct timed_capture *c)
{
    pthread_join(c->thread, NULL);
    if (c->graph != NULL)
        check(FN(cuGraphDestroy)(c->graph), "cuGraphDestroy");
}

/* Threads that allocate and free 1 MiB in `ctx` over and over (each allocation held `hold_us` before its free)
 * until `stop` is set: pthread_create(&t, NULL, churn, &the_struct). */
struct churn {
    CUcontext ctx;
    useconds_t hold_us;
    _Atomic bool stop;
};

static inline void *churn(void *arg)
{
    struct churn *c = arg;
    if (FN(cuCtxSetCurrent)(c->ctx) != CUDA_SUCCESS)
        return NULL;
    CUresult (*alloc)(CUdeviceptr *, size_t) = FN(cuMemAlloc_v2);
    CUresult (*release)(CUdeviceptr) = FN(cuMemFree_v2);
    while (!atomic_load(&c->stop)) {
        CUdeviceptr p;
        if (alloc(&p, MIB) == CUDA_SUCCESS) {
            if (c->hold_us > 0)
                usleep(c->hold_us);
            release(p);
        }
    }
    return NULL;
}

#endif
