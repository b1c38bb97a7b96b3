/*
 * A stream capture ended by another thread while a launch on the stream is on its way to the driver.
 *
 * Usage: review5_capture ROUNDS END_MS
 *   cuInit, a context, a stream, a module with kernel spin_2ms.  Each round: the stream begins a capture (relaxed
 *   mode), another thread ends it END_MS later, and meanwhile the main thread launches spin_2ms on the stream (the
 *   interceptor's test-only VCUDA_TEST_CAPTURE_DELAY_US holds the launch after its capture check); then the stream
 *   is synchronised.  The launch reaches the driver after the capture ended (END_MS well below the delay): it runs.
 *   Prints {"rounds": N, "ok": launches that succeeded}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char PTX[] = ".version 7.0\n.target sm_75\n.address_size 64\n.visible .entry spin_2ms() { ret; }\n";
static CUstream g_stream;
static unsigned g_end_ms;
static CUcontext g_ctx;

static void *ender(void *arg)
{
    CUgraph *graph = arg;
    usleep(g_end_ms * 1000u);
    FN(cuCtxSetCurrent)(g_ctx);
    check(FN(cuStreamEndCapture)(g_stream, graph), "cuStreamEndCapture");
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: review5_capture ROUNDS END_MS\n");
        return 2;
    }
    g_lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (g_lib == NULL) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    int rounds = atoi(argv[1]);
    g_end_ms = (unsigned)atoi(argv[2]);
    CUdevice dev;
    CUmodule mod;
    CUfunction fn;
    check(FN(cuInit)(0), "cuInit");
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    check(FN(cuCtxCreate_v2)(&g_ctx, 0, dev), "cuCtxCreate");
    check(FN(cuModuleLoadData)(&mod, PTX), "cuModuleLoadData");
    check(FN(cuModuleGetFunction)(&fn, mod, "spin_2ms"), "cuModuleGetFunction");
    check(FN(cuStreamCreate)(&g_stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    int ok = 0;
    for (int i = 0; i < rounds; i++) {
        CUgraph graph = NULL;
        check(FN(cuStreamBeginCapture_v2)(g_stream, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture_v2");
        pthread_t t;
        if (pthread_create(&t, NULL, ender, &graph) != 0)
            return 2;
        CUresult rc = FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, g_stream, NULL, NULL);
        pthread_join(t, NULL);
        if (graph != NULL)
            check(FN(cuGraphDestroy)(graph), "cuGraphDestroy");
        ok += rc == CUDA_SUCCESS;
        check(FN(cuStreamSynchronize)(g_stream), "cuStreamSynchronize");
    }
    printf("{\"rounds\": %d, \"ok\": %d}\n", rounds, ok);
    return 0;
}
