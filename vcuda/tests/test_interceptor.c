/*
 * C test of libcuda-control.so over the simulated driver, built and run
 * under AddressSanitizer/UBSan by `make test`:
 *   test_interceptor <interceptor.so> <sim libcuda.so.1> <sim libnvidia-ml.so.1> <spec.json>
 * Lays out a driver mirror in a temporary directory, writes a vcuda.config,
 * and checks the cap (single thread, racing threads, forked child),
 * cuGetProcAddress, the memory queries of CUDA and NVML, and that the names
 * libcuda.so.1 / libnvidia-ml.so.1 keep finding the interceptor once the real
 * libraries are open.  It re-executes itself with the mirror on LD_LIBRARY_PATH,
 * as a container has it.
 */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <cuda.h>
#include <nvml.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB (1024ull * 1024ull)
#define LIMIT (1024 * MIB)

static size_t g_base; /* what the context takes (charged too): the baseline of every check */

static int g_failures;
#define CHECK(cond)                                                                                                \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                               \
            g_failures++;                                                                                          \
        }                                                                                                          \
    } while (0)

static CUresult (*p_cuInit)(unsigned);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree_v2)(CUdeviceptr);
static CUresult (*p_cuMemGetInfo_v2)(size_t *, size_t *);
static CUresult (*p_cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static CUresult (*p_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                 unsigned long long);
static CUresult (*p_cuMemRelease)(CUmemGenericAllocationHandle);
static nvmlReturn_t (*p_nvmlInit_v2)(void);
static nvmlReturn_t (*p_nvmlDeviceGetHandleByIndex_v2)(unsigned, nvmlDevice_t *);
static nvmlReturn_t (*p_nvmlDeviceGetMemoryInfo)(nvmlDevice_t, nvmlMemory_t *);
static nvmlReturn_t (*p_nvmlShutdown)(void);

static CUcontext g_ctx;

static void *need(void *h, const char *name)
{
    void *p = dlsym(h, name);
    if (p == NULL) {
        fprintf(stderr, "missing %s: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static void write_config(const char *path, uint64_t limit)
{
    unsigned char buf[8240];
    memset(buf, 0, sizeof(buf));
    memcpy(buf, "pod-c-test", 10);
    memcpy(buf + 4096, "main", 4);
    memcpy(buf + 8208, &limit, 8);
    int one = 1;
    memcpy(buf + 8232, &one, 4);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(buf, 1, sizeof(buf), f) != sizeof(buf) || fclose(f) != 0) {
        perror(path);
        exit(2);
    }
}

static size_t used_now(void)
{
    size_t free_b = 0, total = 0;
    CHECK(p_cuMemGetInfo_v2(&free_b, &total) == CUDA_SUCCESS);
    CHECK(total == LIMIT);
    return total - free_b;
}

static void test_fill_and_free(void)
{
    CUdeviceptr ptrs[64];
    int n = 0;
    CUresult rc;
    while ((rc = p_cuMemAlloc_v2(&ptrs[n], 16 * MIB)) == CUDA_SUCCESS)
        n++;
    CHECK(rc == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(n == (int)((LIMIT - g_base) / (16 * MIB)));
    CHECK(used_now() <= LIMIT && used_now() + 16 * MIB > LIMIT);
    for (int i = 0; i < n; i++)
        CHECK(p_cuMemFree_v2(ptrs[i]) == CUDA_SUCCESS);
    CHECK(used_now() == g_base);
}

static void *racer(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    CUdeviceptr held[8];
    size_t sizes[8];
    int n = 0;
    CHECK(p_cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS);
    for (int i = 0; i < 2000; i++) {
        if (n < 8 && (rand_r(&seed) & 1)) {
            size_t sz = ((size_t)(rand_r(&seed) % 16) + 1) * MIB;
            if (p_cuMemAlloc_v2(&held[n], sz) == CUDA_SUCCESS)
                sizes[n++] = sz;
        } else if (n > 0) {
            CHECK(p_cuMemFree_v2(held[--n]) == CUDA_SUCCESS);
        }
        if (i % 100 == 0)
            CHECK(used_now() <= LIMIT);
    }
    while (n > 0)
        CHECK(p_cuMemFree_v2(held[--n]) == CUDA_SUCCESS);
    (void)sizes;
    return NULL;
}

static void test_racing_threads(void)
{
    pthread_t t[4];
    for (uintptr_t i = 0; i < 4; i++)
        CHECK(pthread_create(&t[i], NULL, racer, (void *)(i + 1)) == 0);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    CHECK(used_now() == g_base);
}

static void test_get_proc_address(void)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    CHECK(p_cuGetProcAddress_v2("cuMemAlloc", &p, 12000, 0, &st) == CUDA_SUCCESS);
    CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS);
    CHECK(p == (void *)p_cuMemAlloc_v2);
    CUdeviceptr d;
    CHECK(((CUresult(*)(CUdeviceptr *, size_t))p)(&d, LIMIT + MIB) == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(p_cuGetProcAddress_v2("cuGetProcAddress", &p, 12000, 0, &st) == CUDA_SUCCESS);
    CHECK(p == (void *)p_cuGetProcAddress_v2);
}

static void test_vmm(void)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h, big;
    CHECK(p_cuMemCreate(&h, 128 * MIB, &prop, 0) == CUDA_SUCCESS);
    CHECK(p_cuMemCreate(&big, LIMIT - 64 * MIB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(used_now() == g_base + 128 * MIB);
    CHECK(p_cuMemRelease(h) == CUDA_SUCCESS);
    /* Host memory (NCCL's cuMemCreate) is not the device's. */
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CHECK(p_cuMemCreate(&h, 512 * MIB, &prop, 0) == CUDA_SUCCESS);
    CHECK(used_now() == g_base);
    CHECK(p_cuMemRelease(h) == CUDA_SUCCESS);
}

static void test_fork(void)
{
    CUdeviceptr d;
    CHECK(p_cuMemAlloc_v2(&d, 100 * MIB) == CUDA_SUCCESS);
    pid_t pid = fork();
    if (pid == 0) {
        /* A child of its own: its reservations go to a slot of its own, the parent's stay. */
        CUdeviceptr c;
        int bad = p_cuMemAlloc_v2(&c, 100 * MIB) != CUDA_SUCCESS;
        /* Both 100 MiB are charged: 1 MiB more than what is left does not fit. */
        bad |= p_cuMemAlloc_v2(&c, LIMIT - g_base - 200 * MIB + MIB) != CUDA_ERROR_OUT_OF_MEMORY;
        bad |= p_cuMemAlloc_v2(&c, LIMIT - g_base - 200 * MIB) != CUDA_SUCCESS;
        _exit(bad);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* The child is gone: what it held comes back. */
    CHECK(used_now() == g_base + 100 * MIB);
    CHECK(p_cuMemFree_v2(d) == CUDA_SUCCESS);
}

static void test_nvml(void *nvml)
{
    *(void **)&p_nvmlInit_v2 = need(nvml, "nvmlInit_v2");
    *(void **)&p_nvmlDeviceGetHandleByIndex_v2 = need(nvml, "nvmlDeviceGetHandleByIndex_v2");
    *(void **)&p_nvmlDeviceGetMemoryInfo = need(nvml, "nvmlDeviceGetMemoryInfo");
    *(void **)&p_nvmlShutdown = need(nvml, "nvmlShutdown");
    CUdeviceptr d;
    CHECK(p_cuMemAlloc_v2(&d, 64 * MIB) == CUDA_SUCCESS);
    nvmlDevice_t dev;
    nvmlMemory_t m;
    CHECK(p_nvmlInit_v2() == NVML_SUCCESS);
    CHECK(p_nvmlDeviceGetHandleByIndex_v2(0, &dev) == NVML_SUCCESS);
    CHECK(p_nvmlDeviceGetMemoryInfo(dev, &m) == NVML_SUCCESS);
    CHECK(m.total == LIMIT && m.used == g_base + 64 * MIB && m.free == LIMIT - g_base - 64 * MIB);
    CHECK(p_nvmlShutdown() == NVML_SUCCESS);
    CHECK(p_cuMemFree_v2(d) == CUDA_SUCCESS);
}

/*
 * Modules, libraries, context limits: the PTX parser (the interceptor's estimate and the simulated driver's
 * load) over awkward text, loads refused at the cap, everything given back on unload.
 */
static void test_modules(void *cuda)
{
    CUresult (*load)(CUmodule *, const void *) = need(cuda, "cuModuleLoadData");
    CUresult (*unload)(CUmodule) = need(cuda, "cuModuleUnload");
    CUresult (*global)(CUdeviceptr *, size_t *, CUmodule, const char *) = need(cuda, "cuModuleGetGlobal_v2");
    CUresult (*lib_load)(CUlibrary *, const void *, CUjit_option *, void **, unsigned, CUlibraryOption *, void **,
                         unsigned) = need(cuda, "cuLibraryLoadData");
    CUresult (*lib_unload)(CUlibrary) = need(cuda, "cuLibraryUnload");
    CUresult (*set_limit)(CUlimit, size_t) = need(cuda, "cuCtxSetLimit");
    static const char ptx[] =
        "  /* header */ .version 7.0\n.target sm_75 // x\n.address_size 64\n"
        ".file 1 \"a \\\" b.cu\"\n"
        ".visible .global .align 8 .b8 big[33554432];\n"
        ".const .align 4 .v4 .f32 vec[2] = {{1.0, 2.0, 3.0, 4.0}, {5.0, 6.0, 7.0, 8.0}}, one = {1,2,3,4};\n"
        ".global .u64 tbl[2][3];\n"
        ".extern .global .b8 ext[1048576];\n"
        ".visible .entry k(.param .u64 p) { .reg .b32 r<4>; { .reg .b32 inner; } ret; }\n"
        ".global .b8 tail[7";                                      /* cut short */
    CUmodule m;
    CUdeviceptr ptr;
    size_t size;
    size_t before = used_now();
    CHECK(load(&m, ptx) == CUDA_SUCCESS);
    CHECK(used_now() == before + 2 * MIB + 34 * MIB); /* code page + 32 MiB and a few bytes, in pages */
    CHECK(global(&ptr, &size, m, "big") == CUDA_SUCCESS && size == 32 * MIB);
    CHECK(global(&ptr, &size, m, "vec") == CUDA_SUCCESS && size == 32);
    CHECK(global(&ptr, &size, m, "one") == CUDA_SUCCESS && size == 16);
    CHECK(global(&ptr, &size, m, "tbl") == CUDA_SUCCESS && size == 48);
    CHECK(global(&ptr, &size, m, "ext") == CUDA_ERROR_NOT_FOUND);
    CHECK(unload(m) == CUDA_SUCCESS);
    CHECK(used_now() == before);
    static const char *const odd[] = {"", ".", "/*", "// .version", ".version", ".version 7.0 .global .b8 x[",
                                      "\x7f" "ELF", ".version 7.0 .global .b8 x[99999999999999999999999];"};
    for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++) {
        CUresult rc = load(&m, odd[i]);
        if (rc == CUDA_SUCCESS)
            CHECK(unload(m) == CUDA_SUCCESS);
    }
    CHECK(used_now() == before);
    CUmodule mods[512];
    int n = 0;
    CUresult rc;
    while (n < 512 && (rc = load(&mods[n], ptx)) == CUDA_SUCCESS)
        n++;
    CHECK(rc == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(used_now() <= LIMIT && used_now() + 36 * MIB > LIMIT);
    while (n > 0)
        CHECK(unload(mods[--n]) == CUDA_SUCCESS);
    CUlibrary lib;
    CHECK(lib_load(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0) == CUDA_SUCCESS);
    CHECK(used_now() == before + 34 * MIB); /* its variables are charged at once, its code when loaded */
    CHECK(lib_unload(lib) == CUDA_SUCCESS);
    CHECK(used_now() == before);
    CHECK(set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, 2 * LIMIT) == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(used_now() == before);
}

static int run(const char *dir);

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s interceptor.so sim-libcuda.so sim-libnvidia-ml.so spec.json\n", argv[0]);
        return 2;
    }
    char dir[] = "/tmp/vcuda-ctest-XXXXXX", path[512], target[512];
    const char *again = getenv("VCUDA_CTEST_DIR");
    if (again != NULL) {
        /* Second run: the mirror is on the loader's search path, as in a container. */
        snprintf(dir, sizeof(dir), "%s", again);
        return run(dir);
    }
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return 2;
    }
    const char *links[][2] = {{"libcuda.so.1", argv[1]},
                              {"libnvidia-ml.so.1", argv[1]},
                              {"libcuda.so.550.54.15", argv[2]},
                              {"libnvidia-ml.so.550.54.15", argv[3]}};
    snprintf(path, sizeof(path), "%s/lib64", dir);
    mkdir(path, 0755);
    for (size_t i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/lib64/%s", dir, links[i][0]);
        if (realpath(links[i][1], target) == NULL || symlink(target, path) != 0) {
            perror(links[i][1]);
            return 2;
        }
    }
    snprintf(path, sizeof(path), "%s/vcuda.config", dir);
    write_config(path, LIMIT);
    setenv("VCUDA_CONFIG_PATH", path, 1);
    snprintf(path, sizeof(path), "%s/shm", dir);
    setenv("VCUDA_BUDGET_DIR", path, 1);
    snprintf(path, sizeof(path), "%s/node.state", dir);
    setenv("GPUSIM_STATE", path, 1);
    setenv("GPUSIM_SPEC", argv[4], 1);
    snprintf(path, sizeof(path), "%s/lib64", dir);
    setenv("LD_LIBRARY_PATH", path, 1);
    setenv("VCUDA_CTEST_DIR", dir, 1);
    execv("/proc/self/exe", argv);
    perror("execv");
    return 2;
}

/* Loader identity: after the interceptor opened the real library, the name still finds the interceptor. */
static void test_names(void *lib, const char *name)
{
    void *h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    CHECK(h != NULL && dlsym(h, "cuMemAlloc_v2") == (void *)p_cuMemAlloc_v2);
    if (h != NULL)
        dlclose(h);
    (void)lib;
}

static int run(const char *dir)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/lib64/libcuda.so.1", dir);
    void *cuda = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    snprintf(path, sizeof(path), "%s/lib64/libnvidia-ml.so.1", dir);
    void *nvml = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (cuda == NULL || nvml == NULL) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    *(void **)&p_cuInit = need(cuda, "cuInit");
    *(void **)&p_cuDeviceGet = need(cuda, "cuDeviceGet");
    *(void **)&p_cuDevicePrimaryCtxRetain = need(cuda, "cuDevicePrimaryCtxRetain");
    *(void **)&p_cuCtxSetCurrent = need(cuda, "cuCtxSetCurrent");
    *(void **)&p_cuMemAlloc_v2 = need(cuda, "cuMemAlloc_v2");
    *(void **)&p_cuMemFree_v2 = need(cuda, "cuMemFree_v2");
    *(void **)&p_cuMemGetInfo_v2 = need(cuda, "cuMemGetInfo_v2");
    *(void **)&p_cuGetProcAddress_v2 = need(cuda, "cuGetProcAddress_v2");
    *(void **)&p_cuMemCreate = need(cuda, "cuMemCreate");
    *(void **)&p_cuMemRelease = need(cuda, "cuMemRelease");

    CUdevice dev;
    CHECK(p_cuInit(0) == CUDA_SUCCESS);
    CHECK(p_cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
    CHECK(p_cuDevicePrimaryCtxRetain(&g_ctx, dev) == CUDA_SUCCESS);
    CHECK(p_cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS);
    g_base = used_now();
    CHECK(g_base > 0 && g_base < LIMIT); /* the context's measured size */

    test_fill_and_free();
    test_racing_threads();
    test_get_proc_address();
    test_vmm();
    test_fork();
    test_nvml(nvml);
    test_modules(cuda);
    test_names(cuda, "libcuda.so.1");
    test_names(nvml, "libnvidia-ml.so.1");

    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    if (g_failures > 0) {
        fprintf(stderr, "test_interceptor: %d check(s) failed\n", g_failures);
        return 1;
    }
    printf("test_interceptor: all passed\n");
    return 0;
}
