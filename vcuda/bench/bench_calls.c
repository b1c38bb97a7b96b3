/*
 * Per-call cost of the CUDA driver API as a client sees it, for
 * bench/bench_interceptor.py.  Loads "libcuda.so.1" through the loader's
 * search path (the simulated driver, or a mirror where it is the interceptor),
 * then prints one JSON line:
 *   dlopen_ns, first_cuinit_ns, context_ns: one-off costs of this process (the
 *     library's load, its first cuInit, its first context: cuDevicePrimaryCtxRetain);
 *   passthrough_ns: median per call of cuDriverGetVersion (a function the
 *     interceptor forwards), over batches of 1000 (and _p1_ns, _p99_ns: the
 *     batches' 1st and 99th percentiles);
 *   alloc_free_ns: median per cuMemAlloc_v2 + cuMemFree_v2 pair (1 MiB), after
 *     allocating <hold> bytes first (0: none; near a container's cap the
 *     interceptor reconciles with NVML at every reservation);
 *   module_ns: median per cuModuleLoadData + cuModuleUnload pair of a small PTX module
 *     (calls / 100 pairs in batches of 10; the interceptor reserves its footprint and
 *     reconciles with NVML right after the load).
 * usage: bench_calls <calls> [hold bytes]   (calls per measurement, a multiple of 1000)
 */
#include <cuda.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BATCH 1000

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v; its median, and (out) its 1st and 99th percentiles. */
static double median(double *v, size_t n, double *p1, double *p99)
{
    qsort(v, n, sizeof(*v), cmp);
    *p1 = v[n / 100];
    *p99 = v[n - 1 - n / 100];
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void *need(void *h, const char *name)
{
    void *p = dlsym(h, name);
    if (p == NULL) {
        fprintf(stderr, "bench_calls: no %s\n", name);
        exit(2);
    }
    return p;
}

int main(int argc, char **argv)
{
    size_t calls = argc > 1 ? strtoull(argv[1], NULL, 10) : 1000000;
    size_t hold = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    size_t batches = calls / BATCH ? calls / BATCH : 1;
    uint64_t t0 = now_ns();
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    uint64_t t1 = now_ns();
    if (h == NULL) {
        fprintf(stderr, "bench_calls: %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))need(h, "cuInit");
    CUresult (*version)(int *) = (CUresult(*)(int *))need(h, "cuDriverGetVersion");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))need(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = (CUresult(*)(CUcontext))need(h, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))need(h, "cuMemAlloc_v2");
    CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))need(h, "cuMemFree_v2");
    CUresult (*load)(CUmodule *, const void *) = (CUresult(*)(CUmodule *, const void *))need(h, "cuModuleLoadData");
    CUresult (*unload)(CUmodule) = (CUresult(*)(CUmodule))need(h, "cuModuleUnload");

    uint64_t t2 = now_ns();
    CUresult rc = init(0);
    uint64_t t3 = now_ns();
    CUcontext ctx;
    uint64_t t4 = now_ns();
    CUresult rc_ctx = rc == CUDA_SUCCESS ? retain(&ctx, 0) : rc;
    uint64_t t5 = now_ns();
    if (rc_ctx != CUDA_SUCCESS || set_current(ctx) != CUDA_SUCCESS) {
        fprintf(stderr, "bench_calls: cannot initialise the driver (%d)\n", rc_ctx);
        return 2;
    }
    CUdeviceptr held = 0;
    if (hold > 0 && alloc(&held, hold) != CUDA_SUCCESS) {
        fprintf(stderr, "bench_calls: cannot hold %zu bytes\n", hold);
        return 2;
    }
    double *per = malloc(batches * sizeof(*per));
    if (per == NULL)
        return 2;
    int v = 0;
    for (size_t b = 0; b < batches; b++) {
        uint64_t s = now_ns();
        for (int i = 0; i < BATCH; i++)
            version(&v);
        per[b] = (double)(now_ns() - s) / BATCH;
    }
    double pass_p1, pass_p99;
    double passthrough = median(per, batches, &pass_p1, &pass_p99);
    for (size_t b = 0; b < batches; b++) {
        uint64_t s = now_ns();
        for (int i = 0; i < BATCH; i++) {
            CUdeviceptr p;
            if (alloc(&p, 1 << 20) != CUDA_SUCCESS || release(p) != CUDA_SUCCESS) {
                fprintf(stderr, "bench_calls: cuMemAlloc/cuMemFree failed\n");
                return 2;
            }
        }
        per[b] = (double)(now_ns() - s) / BATCH;
    }
    double alloc_p1, alloc_p99;
    double alloc_free = median(per, batches, &alloc_p1, &alloc_p99);
    static const char ptx[] = ".version 7.0\n.target sm_75\n.address_size 64\n"
                              ".visible .global .align 4 .u32 counter;\n"
                              ".visible .entry work_1us(.param .u64 p) { ret; }\n";
    size_t mod_batches = batches / 10 ? batches / 10 : 1;
    for (size_t b = 0; b < mod_batches; b++) {
        uint64_t s = now_ns();
        for (int i = 0; i < 10; i++) {
            CUmodule m;
            if (load(&m, ptx) != CUDA_SUCCESS || unload(m) != CUDA_SUCCESS) {
                fprintf(stderr, "bench_calls: cuModuleLoadData/cuModuleUnload failed\n");
                return 2;
            }
        }
        per[b] = (double)(now_ns() - s) / 10;
    }
    double mod_p1, mod_p99;
    double module = median(per, mod_batches, &mod_p1, &mod_p99);
    printf("{\"dlopen_ns\": %llu, \"first_cuinit_ns\": %llu, \"context_ns\": %llu, \"passthrough_ns\": %.2f, "
           "\"passthrough_p1_ns\": %.2f, \"passthrough_p99_ns\": %.2f, \"alloc_free_ns\": %.1f, "
           "\"alloc_free_p1_ns\": %.1f, \"alloc_free_p99_ns\": %.1f, \"module_ns\": %.1f, \"module_p1_ns\": %.1f, "
           "\"module_p99_ns\": %.1f, \"calls\": %zu}\n",
           (unsigned long long)(t1 - t0), (unsigned long long)(t3 - t2), (unsigned long long)(t5 - t4), passthrough,
           pass_p1, pass_p99, alloc_free, alloc_p1, alloc_p99, module, mod_p1, mod_p99, batches * BATCH);
    if (held != 0)
        release(held);
    free(per);
    return 0;
}
