/*
 * A stream capture ended by another thread while a stream-ordered allocation on the stream is on its way to the
 * driver.
 *
 * Usage: review5_galloc ROUNDS MIB END_MS
 *   cuInit, a context, a stream.  Each round: the stream begins a capture (relaxed mode), another thread ends it
 *   END_MS later, and meanwhile the main thread calls cuMemAllocAsync(MIB) on the stream (the interceptor's
 *   test-only VCUDA_TEST_CAPTURE_DELAY_US holds the call after its capture check); the captured graph, if any, is
 *   destroyed without being instantiated.  Prints {"rounds": N, "ok": allocations that succeeded} and then waits for a line on stdin (the test reads the GPU's
 *   memory meanwhile) before it exits.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

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
    if (argc != 4) {
        fprintf(stderr, "usage: review5_galloc ROUNDS MIB END_MS\n");
        return 2;
    }
    g_lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (g_lib == NULL) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    int rounds = atoi(argv[1]);
    size_t bytes = (size_t)atoi(argv[2]) * MIB;
    g_end_ms = (unsigned)atoi(argv[3]);
    CUdevice dev;
    check(FN(cuInit)(0), "cuInit");
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    check(FN(cuCtxCreate_v2)(&g_ctx, 0, dev), "cuCtxCreate");
    check(FN(cuStreamCreate)(&g_stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    int ok = 0;
    for (int i = 0; i < rounds; i++) {
        CUgraph graph = NULL;
        check(FN(cuStreamBeginCapture_v2)(g_stream, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture_v2");
        pthread_t t;
        if (pthread_create(&t, NULL, ender, &graph) != 0)
            return 2;
        CUdeviceptr p = 0;
        CUresult rc = FN(cuMemAllocAsync)(&p, bytes, g_stream);
        pthread_join(t, NULL);
        if (graph != NULL)
            check(FN(cuGraphDestroy)(graph), "cuGraphDestroy");
        ok += rc == CUDA_SUCCESS;
    }
    check(FN(cuStreamSynchronize)(g_stream), "cuStreamSynchronize");
    printf("{\"rounds\": %d, \"ok\": %d}\n", rounds, ok);
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof(line), stdin) == NULL)
        return 0;
    return 0;
}
