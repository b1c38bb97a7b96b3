/*
 * Per-call cost of the CUDA driver API as a client sees it, for
 * bench/bench_interceptor.py.  Loads "libcuda.so.1" through the loader's
 * search path (the simulated driver, or a mirror where it is the interceptor),
 * then prints one JSON line:
 *   dlopen_ns, first_cuinit_ns: one-off costs of this process;
 *   passthrough_ns: median per call of cuDriverGetVersion (a function the
 *     interceptor forwards), over batches of 1000;
 *   alloc_free_ns: median per cuMemAlloc_v2 + cuMemFree_v2 pair (1 MiB).
 * usage: bench_calls <calls>   (calls per measurement, a multiple of 1000)
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

static double median(double *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp);
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

    uint64_t t2 = now_ns();
    CUresult rc = init(0);
    uint64_t t3 = now_ns();
    CUcontext ctx;
    if (rc != CUDA_SUCCESS || retain(&ctx, 0) != CUDA_SUCCESS || set_current(ctx) != CUDA_SUCCESS) {
        fprintf(stderr, "bench_calls: cannot initialise the driver (%d)\n", rc);
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
    double passthrough = median(per, batches);
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
    double alloc_free = median(per, batches);
    printf("{\"dlopen_ns\": %llu, \"first_cuinit_ns\": %llu, \"passthrough_ns\": %.2f, \"alloc_free_ns\": %.1f, "
           "\"calls\": %zu}\n",
           (unsigned long long)(t1 - t0), (unsigned long long)(t3 - t2), passthrough, alloc_free, batches * BATCH);
    free(per);
    return 0;
}
