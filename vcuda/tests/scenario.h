/*
 * What the interceptor's C scenario programs share (vcuda/tests/review*.c, run by tests/vcuda_scenario.py): the
 * driver's entry points looked up in the libcuda.so.1 of LD_LIBRARY_PATH (the interceptor in front of the simulated
 * driver), a failed call ending the program, and what NVML accounts on GPU 0.  Include after <cuda.h> and <nvml.h>;
 * set g_lib (dlopen) before the first FN().
 */
#ifndef VCUDA_TESTS_SCENARIO_H
#define VCUDA_TESTS_SCENARIO_H

#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define MIB (1ull << 20)
#define SCENARIO_SHARED __attribute__((unused))

static void *g_lib;
static bool g_all SCENARIO_SHARED; /* held() counts every process on the GPU (the node runs only this container) */

static SCENARIO_SHARED void *sym(const char *name)
{
    void *p = dlsym(g_lib, name);
    if (p == NULL) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return p;
}

#define FN(name) ((__typeof__(&name))sym(#name))

static SCENARIO_SHARED void check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "%s failed: %d\n", what, (int)rc);
        exit(3);
    }
}

/* What NVML accounts to this process (g_all: to every process) on GPU 0, in bytes. */
static SCENARIO_SHARED uint64_t held(void)
{
    static bool init;
    if (!init) {
        if (FN(nvmlInit_v2)() != NVML_SUCCESS) {
            fprintf(stderr, "nvmlInit failed\n");
            exit(2);
        }
        init = true;
    }
    nvmlDevice_t dev;
    if (FN(nvmlDeviceGetHandleByIndex_v2)(0, &dev) != NVML_SUCCESS) {
        fprintf(stderr, "nvmlDeviceGetHandleByIndex failed\n");
        exit(2);
    }
    nvmlProcessInfo_t procs[64];
    unsigned n = 64;
    if (FN(nvmlDeviceGetComputeRunningProcesses_v3)(dev, &n, procs) != NVML_SUCCESS) {
        fprintf(stderr, "nvmlDeviceGetComputeRunningProcesses failed\n");
        exit(2);
    }
    uint64_t sum = 0;
    for (unsigned i = 0; i < n; i++)
        if (g_all || procs[i].pid == (unsigned)getpid())
            sum += procs[i].usedGpuMemory;
    return sum;
}

/* The line the test reads: "held <MiB>". */
static SCENARIO_SHARED void report(void)
{
    printf("held %llu\n", (unsigned long long)(held() / MIB));
    fflush(stdout);
}

/* GPU 0's primary context, current on this thread. */
static SCENARIO_SHARED CUcontext primary(void)
{
    check(FN(cuInit)(0), "cuInit");
    CUcontext ctx;
    check(FN(cuDevicePrimaryCtxRetain)(&ctx, 0), "cuDevicePrimaryCtxRetain");
    check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    return ctx;
}

static SCENARIO_SHARED double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#endif
