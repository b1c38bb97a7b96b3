/*
 * A tenant's attempts to hold more device memory than its container's limit through memory pools
 * (tests/test_vcuda_pool_review12.py).
 *
 *   review12_pool <scenario> <limit MiB>
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
#include <unistd.h>

#include "scenario.h"

/*
 * cuDeviceSetMemPool as the CUDA runtime finds it: through cuGetProcAddress_v2 (cudaDeviceSetMemPool), not by
 * its exported name.
 */
static __typeof__(&cuDeviceSetMemPool) set_pool_by_proc(void)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    check(FN(cuGetProcAddress_v2)("cuDeviceSetMemPool", &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st),
          "cuGetProcAddress_v2(cuDeviceSetMemPool)");
    if (p == NULL) {
        fprintf(stderr, "cuGetProcAddress_v2(cuDeviceSetMemPool): no function\n");
        exit(3);
    }
    return (__typeof__(&cuDeviceSetMemPool))p;
}

/* ---- the device's current pool changed by another thread under a stream-ordered allocation ----------------- */

static CUmemoryPool g_pools[2];
static atomic_bool g_stop;
static bool g_destroying; /* the other thread destroys the current pool (the default one becomes current) */

static void *switch_pools(void *arg)
{
    (void)arg;
    CUcontext ctx;
    check(FN(cuDevicePrimaryCtxRetain)(&ctx, 0), "cuDevicePrimaryCtxRetain");
    check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    __typeof__(&cuDeviceSetMemPool) set_pool = set_pool_by_proc();
    __typeof__(&cuMemPoolCreate) create = FN(cuMemPoolCreate);
    __typeof__(&cuMemPoolDestroy) destroy = FN(cuMemPoolDestroy);
    CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                            .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    while (!atomic_load(&g_stop)) {
        if (g_destroying) {
            CUmemoryPool p;
            if (create(&p, &props) != CUDA_SUCCESS)
                continue;
            set_pool(0, p);
            destroy(p); /* the device's default pool is current again */
        } else {
            set_pool(0, g_pools[1]);
            set_pool(0, g_pools[0]);
        }
    }
    return NULL;
}

/*
 * Allocates `big` MiB from the device's current pool while another thread switches it (between two pools of its
 * own, or by destroying a current pool), then `rest` MiB with cuMemAlloc: the two together are above the limit,
 * so the second must fail, whichever pool the first came from.  When it does, both are given back (freed, the
 * pools trimmed) and it is tried again, for 3 s or until the second one is let through.  The first one leaves
 * less than a quarter of the limit, so its reservation is reconciled with NVML (tens of microseconds between the
 * interceptor's look at the current pool and its driver call: the switch lands there within a few hundred tries);
 * the second one, once the first is not charged, leaves more, and is let through without a reconciliation.
 */
static void switch_race(bool destroying, uint64_t limit_mib)
{
    primary();
    uint64_t ctx_mib = held() / MIB;
    uint64_t big = limit_mib * 5 / 8, rest = limit_mib - ctx_mib - big + 64; /* 64 MiB above the limit together */
    CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                            .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    for (int i = 0; i < 2; i++)
        check(FN(cuMemPoolCreate)(&g_pools[i], &props), "cuMemPoolCreate");
    check(FN(cuDeviceSetMemPool)(0, g_pools[0]), "cuDeviceSetMemPool");
    CUmemoryPool dflt;
    check(FN(cuDeviceGetDefaultMemPool)(&dflt, 0), "cuDeviceGetDefaultMemPool");
    g_destroying = destroying;
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    __typeof__(&cuMemAllocAsync) alloc_async = FN(cuMemAllocAsync);
    __typeof__(&cuMemAlloc_v2) alloc = FN(cuMemAlloc_v2);
    __typeof__(&cuMemFreeAsync) free_async = FN(cuMemFreeAsync);
    __typeof__(&cuStreamSynchronize) sync = FN(cuStreamSynchronize);
    __typeof__(&cuMemPoolTrimTo) trim = FN(cuMemPoolTrimTo);
    pthread_t t;
    pthread_create(&t, NULL, switch_pools, NULL);
    double end = now_s() + 3.0;
    unsigned tries = 0, through = 0;
    while (now_s() < end && through == 0) {
        CUdeviceptr p, q;
        tries++;
        if (alloc_async(&p, big * MIB, s) != CUDA_SUCCESS)
            continue;
        if (alloc(&q, rest * MIB) == CUDA_SUCCESS) {
            through++;
            break;
        }
        check(free_async(p, s), "cuMemFreeAsync");
        check(sync(s), "cuStreamSynchronize");
        for (int i = 0; i < 2; i++)
            check(trim(g_pools[i], 0), "cuMemPoolTrimTo");
        check(trim(dflt, 0), "cuMemPoolTrimTo");
    }
    atomic_store(&g_stop, true);
    pthread_join(t, NULL);
    fprintf(stderr, "%u tries, %u let through beyond the limit (context %llu MiB, %llu + %llu MiB)\n", tries, through,
            (unsigned long long)ctx_mib, (unsigned long long)big, (unsigned long long)rest);
    report();
}

/* ---- cuDeviceSetMemPool through cuGetProcAddress at every version and flag ------------------------------------ */

/* Exit 4 unless every lookup answers the interceptor's cuDeviceSetMemPool (the exported name's). */
static void getproc(void)
{
    primary();
    void *hook = sym("cuDeviceSetMemPool");
    int versions[] = {11020, 11030, 11080, 12000, 12040, 12090};
    cuuint64_t flags[] = {CU_GET_PROC_ADDRESS_DEFAULT, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                          CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM};
    for (size_t v = 0; v < sizeof(versions) / sizeof(versions[0]); v++) {
        for (size_t f = 0; f < sizeof(flags) / sizeof(flags[0]); f++) {
            void *p = NULL, *p1 = NULL;
            CUdriverProcAddressQueryResult st;
            const char *name = "cuDeviceSetMemPool";
            check(FN(cuGetProcAddress_v2)(name, &p, versions[v], flags[f], &st), "cuGetProcAddress_v2");
            check(FN(cuGetProcAddress)(name, &p1, versions[v], flags[f]), "cuGetProcAddress");
            if (p != hook || p1 != hook) {
                fprintf(stderr, "cuGetProcAddress(cuDeviceSetMemPool, %d, %llu): %p / %p, not the hook %p\n", versions[v],
                        (unsigned long long)flags[f], p, p1, hook);
                exit(4);
            }
        }
    }
    report();
}

/* ---- a pool created with a maximum size ---------------------------------------------------------------------- */

/*
 * A pool of at most 64 MiB: a second 40 MiB allocation from it fails (the pool may not grow beyond its maxSize;
 * exit 4 if it does), and what was reserved for it comes back: the rest of the limit is then filled with cuMemAlloc.
 */
static void max_size(void)
{
    primary();
    CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                            .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                            .maxSize = 64 * MIB};
    CUmemoryPool pool;
    check(FN(cuMemPoolCreate)(&pool, &props), "cuMemPoolCreate");
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUdeviceptr p, q;
    check(FN(cuMemAllocFromPoolAsync)(&p, 40 * MIB, pool, s), "cuMemAllocFromPoolAsync");
    CUresult rc = FN(cuMemAllocFromPoolAsync)(&q, 40 * MIB, pool, s);
    if (rc != CUDA_ERROR_OUT_OF_MEMORY) {
        fprintf(stderr, "a second 40 MiB from a pool of at most 64 MiB: %d, not CUDA_ERROR_OUT_OF_MEMORY\n", (int)rc);
        exit(4);
    }
    cuuint64_t reserved = 0;
    check(FN(cuMemPoolGetAttribute)(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved), "cuMemPoolGetAttribute");
    if (reserved > 64 * MIB) {
        fprintf(stderr, "a pool of at most 64 MiB reserves %llu bytes\n", (unsigned long long)reserved);
        exit(4);
    }
    while (FN(cuMemAlloc_v2)(&q, 8 * MIB) == CUDA_SUCCESS)
        ;
    report();
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: review12_pool SCENARIO LIMIT_MIB\n");
        return 2;
    }
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (g_lib == NULL) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    uint64_t limit = strtoull(argv[2], NULL, 10);
    if (strcmp(argv[1], "switch-race") == 0)
        switch_race(false, limit);
    else if (strcmp(argv[1], "destroy-race") == 0)
        switch_race(true, limit);
    else if (strcmp(argv[1], "getproc") == 0)
        getproc();
    else if (strcmp(argv[1], "max-size") == 0)
        max_size();
    else {
        fprintf(stderr, "unknown scenario %s\n", argv[1]);
        return 2;
    }
    return 0;
}
