/*
 * A launch description rewritten by another thread while the launch is on its way to the driver.
 *
 * Usage: review5_launchex ex|multi SWITCH_MS
 *   cuInit, a context, a module with kernel spin_500ms, streams s1 (capturing, relaxed mode) and s2.  The kernel is
 *   launched on s1 with cuLaunchKernelEx (ex) or cuLaunchCooperativeKernelMultiDevice (multi, one device) while
 *   another thread, SWITCH_MS later, changes the launch's stream in the caller's description to s2 (the
 *   interceptor's test-only VCUDA_TEST_CAPTURE_DELAY_US holds the launch after its capture check of s1).
 *   Prints {"launch": rc, "s2_busy": whether s2 has the kernel running right after the launch}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char PTX[] = ".version 7.0\n.target sm_75\n.address_size 64\n.visible .entry spin_500ms() { ret; }\n";
static CUstream g_s1, g_s2;
static unsigned g_switch_ms;
static CUlaunchConfig g_cfg;
static CUDA_LAUNCH_PARAMS g_params;

typedef CUresult (*multi_fn)(CUDA_LAUNCH_PARAMS *, unsigned int, unsigned int); /* deprecated in cuda.h */

static void *switcher(void *arg)
{
    (void)arg;
    usleep(g_switch_ms * 1000u);
    *(CUstream volatile *)&g_cfg.hStream = g_s2;
    *(CUstream volatile *)&g_params.hStream = g_s2;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: review5_launchex ex|multi SWITCH_MS\n");
        return 2;
    }
    open_driver();
    g_switch_ms = (unsigned)atoi(argv[2]);
    created_context();
    CUfunction fn = load_kernel(PTX, "spin_500ms");
    check(FN(cuStreamCreate)(&g_s1, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    check(FN(cuStreamCreate)(&g_s2, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    g_cfg = (CUlaunchConfig){.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32, .blockDimY = 1,
                             .blockDimZ = 1, .hStream = g_s1};
    g_params = (CUDA_LAUNCH_PARAMS){.function = fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32,
                                    .blockDimY = 1, .blockDimZ = 1, .hStream = g_s1};
    check(FN(cuStreamBeginCapture_v2)(g_s1, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture_v2");
    pthread_t t;
    if (pthread_create(&t, NULL, switcher, NULL) != 0)
        return 2;
    multi_fn multi = (multi_fn)sym("cuLaunchCooperativeKernelMultiDevice");
    CUresult rc = strcmp(argv[1], "multi") == 0 ? multi(&g_params, 1, 0) : FN(cuLaunchKernelEx)(&g_cfg, fn, NULL, NULL);
    pthread_join(t, NULL);
    CUresult q = FN(cuStreamQuery)(g_s2);
    CUgraph graph = NULL;
    check(FN(cuStreamEndCapture)(g_s1, &graph), "cuStreamEndCapture");
    if (graph != NULL)
        check(FN(cuGraphDestroy)(graph), "cuGraphDestroy");
    printf("{\"launch\": %d, \"s2_busy\": %d}\n", (int)rc, q == CUDA_ERROR_NOT_READY);
    return 0;
}
