/*
 * C test of the simulated libnvidia-ml.so.1, run by `make -C vcuda test`
 * under AddressSanitizer and UBSan.
 *
 *     test_nvml_sim <path/to/libnvidia-ml.so.1> <deploy/sim directory>
 *
 * The library is dlopen()ed as a driver would be.  Events and lost GPUs are
 * injected through this program's own handle on the state file (sim_state.c
 * compiled in), i.e. through a second open file and the file lock, as the
 * gpusim CLI does from another process.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include "sim_state.h"

static int g_failures;

#define CHECK(cond)                                                                                              \
    do {                                                                                                         \
        if (!(cond)) {                                                                                           \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                             \
            __atomic_add_fetch(&g_failures, 1, __ATOMIC_RELAXED);                                                \
        }                                                                                                        \
    } while (0)

#define CHECK_RC(call, want)                                                                                     \
    do {                                                                                                         \
        nvmlReturn_t rc_ = (call);                                                                               \
        if (rc_ != (want)) {                                                                                     \
            fprintf(stderr, "%s:%d: %s returned %d, expected %d (%s)\n", __FILE__, __LINE__, #call, (int)rc_,    \
                    (int)(want), #want);                                                                         \
            __atomic_add_fetch(&g_failures, 1, __ATOMIC_RELAXED);                                                \
        }                                                                                                        \
    } while (0)

/* Typed pointers to the library's entry points, resolved with dlsym. */
#define NVML_FUNCS(X)                                                                                            \
    X(nvmlInit_v2)                                                                                               \
    X(nvmlInitWithFlags)                                                                                         \
    X(nvmlShutdown)                                                                                              \
    X(nvmlErrorString)                                                                                           \
    X(nvmlDeviceGetCount_v2)                                                                                     \
    X(nvmlDeviceGetHandleByIndex_v2)                                                                             \
    X(nvmlDeviceGetHandleByUUID)                                                                                 \
    X(nvmlDeviceGetName)                                                                                         \
    X(nvmlDeviceGetUUID)                                                                                         \
    X(nvmlDeviceGetMemoryInfo)                                                                                   \
    X(nvmlDeviceGetPciInfo_v3)                                                                                   \
    X(nvmlDeviceGetTopologyCommonAncestor)                                                                       \
    X(nvmlDeviceGetFanSpeed)                                                                                     \
    X(nvmlEventSetCreate)                                                                                        \
    X(nvmlDeviceRegisterEvents)                                                                                  \
    X(nvmlEventSetWait_v2)                                                                                       \
    X(nvmlEventSetFree)

#define DECLARE_FN(name) static __typeof__(&name) p_##name;
NVML_FUNCS(DECLARE_FN)

/* nvmlGetBlacklistDeviceCount is only an alias macro in nvml.h; declare its exported symbol's type. */
typedef nvmlReturn_t (*blacklist_count_fn)(unsigned int *);
static blacklist_count_fn p_blacklist_count;

static void load(const char *lib)
{
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        fprintf(stderr, "dlopen %s: %s\n", lib, dlerror());
        exit(2);
    }
#define LOAD_FN(name)                                                                                            \
    *(void **)&p_##name = dlsym(h, #name);                                                                       \
    if (p_##name == NULL) {                                                                                      \
        fprintf(stderr, "missing symbol %s\n", #name);                                                           \
        exit(2);                                                                                                 \
    }
    NVML_FUNCS(LOAD_FN)
    *(void **)&p_blacklist_count = dlsym(h, "nvmlGetBlacklistDeviceCount");
    if (p_blacklist_count == NULL) {
        fprintf(stderr, "missing symbol nvmlGetBlacklistDeviceCount\n");
        exit(2);
    }
}

static char g_dir[] = "/tmp/gpusim-ctest-XXXXXX";
static char g_state_path[256];
static struct sim_state *g_injector; /* this program's own handle on the state file */

static void inject_xid(unsigned gpu, unsigned xid)
{
    CHECK(sim_state_lock(g_injector) == 0);
    sim_state_push_event(g_injector, gpu, nvmlEventTypeXidCriticalError, xid);
    sim_state_unlock(g_injector);
}

static void set_lost(unsigned gpu, int lost)
{
    CHECK(sim_state_lock(g_injector) == 0);
    struct gpusim_gpu *g = sim_state_gpu(g_injector, gpu);
    g->flags = lost ? (g->flags | GPUSIM_GPU_LOST) : (g->flags & ~GPUSIM_GPU_LOST);
    sim_state_touch(g_injector);
    sim_state_unlock(g_injector);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (f == NULL || fputs(text, f) < 0 || fclose(f) != 0) {
        perror(path);
        exit(2);
    }
}

static void test_lifecycle(const char *spec)
{
    unsigned n = 0;
    CHECK_RC(p_nvmlDeviceGetCount_v2(&n), NVML_ERROR_UNINITIALIZED);
    CHECK_RC(p_nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
    CHECK(strcmp(p_nvmlErrorString(NVML_ERROR_GPU_IS_LOST), "GPU is lost") == 0);

    unsetenv("GPUSIM_SPEC");
    CHECK_RC(p_nvmlInit_v2(), NVML_ERROR_DRIVER_NOT_LOADED);
    char bad[300];
    snprintf(bad, sizeof(bad), "%s/bad.json", g_dir);
    write_file(bad, "{\"driver_version\": \"1\", \"cuda_driver_version\": 12000, \"gpus\": [{\"uuid\": 7}]}");
    setenv("GPUSIM_SPEC", bad, 1);
    fprintf(stderr, "(an error message about gpus[0].uuid is expected next)\n");
    CHECK_RC(p_nvmlInit_v2(), NVML_ERROR_UNKNOWN);
    unlink(bad);

    setenv("GPUSIM_SPEC", spec, 1);
    CHECK_RC(p_nvmlInit_v2(), NVML_SUCCESS);
    CHECK_RC(p_nvmlInitWithFlags(0), NVML_SUCCESS);
    CHECK_RC(p_nvmlShutdown(), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetCount_v2(&n), NVML_SUCCESS); /* still one reference */
    CHECK(n == 8);
    CHECK_RC(p_nvmlShutdown(), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetCount_v2(&n), NVML_ERROR_UNINITIALIZED);
}

static void test_queries(void)
{
    nvmlDevice_t d0, d5, by_uuid;
    char buf[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(0, &d0), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(5, &d5), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(8, &d5), NVML_ERROR_INVALID_ARGUMENT);
    CHECK_RC(p_nvmlDeviceGetName(d0, buf, sizeof(buf)), NVML_SUCCESS);
    CHECK(strcmp(buf, "NVIDIA H100 80GB HBM3") == 0);
    CHECK_RC(p_nvmlDeviceGetName(d0, buf, 4), NVML_ERROR_INSUFFICIENT_SIZE);
    CHECK_RC(p_nvmlDeviceGetUUID(d5, buf, sizeof(buf)), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetHandleByUUID(buf, &by_uuid), NVML_SUCCESS);
    CHECK(by_uuid == d5);
    CHECK_RC(p_nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000", &by_uuid),
             NVML_ERROR_NOT_FOUND);
    CHECK_RC(p_nvmlDeviceGetName((nvmlDevice_t)(void *)buf, buf, sizeof(buf)), NVML_ERROR_INVALID_ARGUMENT);
    nvmlGpuTopologyLevel_t level;
    CHECK_RC(p_nvmlDeviceGetTopologyCommonAncestor(d0, d5, &level), NVML_SUCCESS);
    CHECK(level == NVML_TOPOLOGY_SYSTEM);
    nvmlMemory_t mem;
    CHECK_RC(p_nvmlDeviceGetMemoryInfo(d0, &mem), NVML_SUCCESS);
    CHECK(mem.total == 81559ull << 20 && mem.used == 0 && mem.free == mem.total);
    nvmlPciInfo_t pci;
    CHECK_RC(p_nvmlDeviceGetPciInfo_v3(d5, &pci), NVML_SUCCESS);
    CHECK(strcmp(pci.busId, "00000000:AB:00.0") == 0 && pci.bus == 0xAB);
    unsigned speed;
    CHECK_RC(p_nvmlDeviceGetFanSpeed(d0, &speed), NVML_ERROR_NOT_SUPPORTED);
    unsigned count;
    CHECK_RC(p_blacklist_count(&count), NVML_ERROR_NOT_SUPPORTED);
}

static void test_events(void)
{
    nvmlDevice_t d3, d5;
    nvmlEventSet_t a, b;
    nvmlEventData_t ev;
    char name[96];
    CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(3, &d3), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(5, &d5), NVML_SUCCESS);
    inject_xid(3, 13); /* before the sets exist: never seen */
    CHECK_RC(p_nvmlEventSetCreate(&a), NVML_SUCCESS);
    CHECK_RC(p_nvmlEventSetCreate(&b), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceRegisterEvents(d3, nvmlEventTypeXidCriticalError, a), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceRegisterEvents(d3, nvmlEventTypeXidCriticalError, b), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceRegisterEvents(d3, 1ull << 40, a), NVML_ERROR_NOT_SUPPORTED);
    CHECK_RC(p_nvmlEventSetWait_v2(a, &ev, 0), NVML_ERROR_TIMEOUT);

    inject_xid(5, 48); /* GPU 5 not registered */
    inject_xid(3, 79);
    for (int k = 0; k < 2; k++) {
        nvmlEventSet_t s = k == 0 ? a : b;
        memset(&ev, 0, sizeof(ev));
        CHECK_RC(p_nvmlEventSetWait_v2(s, &ev, 1000), NVML_SUCCESS);
        CHECK(ev.device == d3 && ev.eventType == nvmlEventTypeXidCriticalError && ev.eventData == 79);
        CHECK(ev.gpuInstanceId == 0xFFFFFFFFu && ev.computeInstanceId == 0xFFFFFFFFu);
        CHECK_RC(p_nvmlEventSetWait_v2(s, &ev, 20), NVML_ERROR_TIMEOUT);
    }

    set_lost(3, 1);
    CHECK_RC(p_nvmlEventSetWait_v2(a, &ev, 50), NVML_ERROR_GPU_IS_LOST);
    CHECK_RC(p_nvmlDeviceGetName(d3, name, sizeof(name)), NVML_ERROR_GPU_IS_LOST);
    CHECK_RC(p_nvmlDeviceGetName(d5, name, sizeof(name)), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(3, &d3), NVML_ERROR_GPU_IS_LOST);
    set_lost(3, 0);
    CHECK_RC(p_nvmlDeviceGetName(d3, name, sizeof(name)), NVML_SUCCESS);
    CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(3, &d3), NVML_SUCCESS);
    CHECK_RC(p_nvmlEventSetWait_v2(a, &ev, 10), NVML_ERROR_TIMEOUT);

    CHECK_RC(p_nvmlEventSetFree(a), NVML_SUCCESS);
    CHECK_RC(p_nvmlEventSetFree(b), NVML_SUCCESS);
}

/* ---- concurrency -------------------------------------------------------- */

#define QUERY_THREADS 6
#define QUERY_ROUNDS 300
#define EVENTS 40

static void *query_worker(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    for (int r = 0; r < QUERY_ROUNDS; r++) {
        unsigned n = 0, i = (seed + (unsigned)r) % 8;
        nvmlDevice_t d, other;
        char buf[96];
        nvmlMemory_t mem;
        nvmlGpuTopologyLevel_t level;
        CHECK_RC(p_nvmlDeviceGetCount_v2(&n), NVML_SUCCESS);
        CHECK(n == 8);
        CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(i, &d), NVML_SUCCESS);
        CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2((i + 1) % 8, &other), NVML_SUCCESS);
        CHECK_RC(p_nvmlDeviceGetUUID(d, buf, sizeof(buf)), NVML_SUCCESS);
        CHECK_RC(p_nvmlDeviceGetMemoryInfo(d, &mem), NVML_SUCCESS);
        CHECK_RC(p_nvmlDeviceGetTopologyCommonAncestor(d, other, &level), NVML_SUCCESS);
        /* Extra references come and go while others query. */
        CHECK_RC(p_nvmlInit_v2(), NVML_SUCCESS);
        CHECK_RC(p_nvmlShutdown(), NVML_SUCCESS);
    }
    return NULL;
}

struct waiter {
    unsigned received;
    unsigned last_xid;
    int in_order;
};

static void *event_waiter(void *arg)
{
    struct waiter *w = arg;
    nvmlEventSet_t set;
    nvmlDevice_t d;
    w->in_order = 1;
    CHECK_RC(p_nvmlEventSetCreate(&set), NVML_SUCCESS);
    for (unsigned i = 0; i < 8; i++) {
        CHECK_RC(p_nvmlDeviceGetHandleByIndex_v2(i, &d), NVML_SUCCESS);
        CHECK_RC(p_nvmlDeviceRegisterEvents(d, nvmlEventTypeXidCriticalError, set), NVML_SUCCESS);
    }
    __atomic_store_n(&w->received, 0, __ATOMIC_RELEASE); /* registered: injector may start */
    while (w->received < EVENTS) {
        nvmlEventData_t ev;
        nvmlReturn_t rc = p_nvmlEventSetWait_v2(set, &ev, 5000);
        if (rc != NVML_SUCCESS) {
            CHECK_RC(rc, NVML_SUCCESS);
            break;
        }
        if (ev.eventData != 1000 + w->received)
            w->in_order = 0;
        __atomic_add_fetch(&w->received, 1, __ATOMIC_RELEASE);
    }
    CHECK_RC(p_nvmlEventSetFree(set), NVML_SUCCESS);
    return NULL;
}

static void test_concurrency(void)
{
    pthread_t q[QUERY_THREADS], wt[2];
    struct waiter w[2] = {{.received = UINT32_MAX}, {.received = UINT32_MAX}};
    for (int k = 0; k < 2; k++)
        pthread_create(&wt[k], NULL, event_waiter, &w[k]);
    for (int k = 0; k < 2; k++) {
        while (__atomic_load_n(&w[k].received, __ATOMIC_ACQUIRE) == UINT32_MAX)
            usleep(1000);
    }
    for (uintptr_t t = 0; t < QUERY_THREADS; t++)
        pthread_create(&q[t], NULL, query_worker, (void *)t);
    for (unsigned e = 0; e < EVENTS; e++) {
        inject_xid(e % 8, 1000 + e);
        if (e % 8 == 0)
            usleep(2000);
    }
    for (int t = 0; t < QUERY_THREADS; t++)
        pthread_join(q[t], NULL);
    for (int k = 0; k < 2; k++) {
        pthread_join(wt[k], NULL);
        CHECK(w[k].received == EVENTS);
        CHECK(w[k].in_order);
    }
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s <libnvidia-ml.so.1> <deploy/sim directory>\n", argv[0]);
        return 2;
    }
    if (mkdtemp(g_dir) == NULL) {
        perror("mkdtemp");
        return 2;
    }
    char spec[1024], err[512];
    snprintf(spec, sizeof(spec), "%s/h100-nvlink-x8.json", argv[2]);
    snprintf(g_state_path, sizeof(g_state_path), "%s/state", g_dir);
    setenv("GPUSIM_STATE", g_state_path, 1);
    load(argv[1]);

    test_lifecycle(spec);
    CHECK_RC(p_nvmlInit_v2(), NVML_SUCCESS);
    g_injector = sim_state_open(g_state_path, err, sizeof(err));
    if (g_injector == NULL) {
        fprintf(stderr, "sim_state_open: %s\n", err);
        return 2;
    }
    test_queries();
    test_events();
    test_concurrency();
    CHECK_RC(p_nvmlShutdown(), NVML_SUCCESS);
    sim_state_close(g_injector);
    unlink(g_state_path);
    rmdir(g_dir);

    if (g_failures != 0) {
        fprintf(stderr, "test_nvml_sim: %d check(s) failed\n", g_failures);
        return 1;
    }
    printf("test_nvml_sim: all checks passed\n");
    return 0;
}
