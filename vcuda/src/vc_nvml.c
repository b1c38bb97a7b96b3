/*
 * What the interceptor asks the real NVML: the handle of a CUDA device, and the
 * device memory NVML accounts to processes (nvmlDeviceGetComputeRunningProcesses:
 * contexts, modules, library workspaces, pools: everything the GPU holds for
 * them).  Used to measure a context's size when it is made, to find this
 * process's host PID (in a PID namespace getpid() is not the PID NVML reports),
 * and to reconcile the container's budget (vc_budget.c).
 */
#include "vc_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_DEVICES 64

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static bool g_ready; /* written once inside g_init_once */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static nvmlDevice_t g_dev[MAX_DEVICES]; /* by CUDA ordinal; NULL until looked up (under g_mu) */
static _Atomic int g_host_pid;          /* this process's PID as NVML reports it; 0 = not known yet */

static void init_nvml(void)
{
    nvmlReturn_t rc = REAL_NVML(nvmlInit_v2)();
    g_ready = rc == NVML_SUCCESS;
    if (!g_ready)
        vc_log(VC_LOG_WARN, "NVML is unavailable (%d): context sizes are estimated and memory the hooks do not see "
               "is not reconciled", (int)rc);
}

bool vc_nvml_ready(void)
{
    pthread_once(&g_init_once, init_nvml);
    return g_ready;
}

#ifdef VC_TEST_HOOKS
/* Tests only (built with -DVC_TEST_HOOKS): VCUDA_TEST_NVML_DELAY_US with g_mu held. */
static void test_nvml_delay(void)
{
    const char *us = getenv("VCUDA_TEST_NVML_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
#else
#define test_nvml_delay() ((void)0)
#endif

bool vc_nvml_device(int cuda_dev, nvmlDevice_t *out)
{
    if (cuda_dev < 0 || cuda_dev >= MAX_DEVICES || !vc_nvml_ready())
        return false;
    pthread_mutex_lock(&g_mu);
    nvmlDevice_t h = g_dev[cuda_dev];
    test_nvml_delay();
    pthread_mutex_unlock(&g_mu);
    if (h == NULL) {
        CUuuid uuid;
        char name[48];
        if (REAL_CU(cuDeviceGetUuid_v2)(&uuid, cuda_dev) != CUDA_SUCCESS)
            return false;
        const unsigned char *b = (const unsigned char *)uuid.bytes;
        snprintf(name, sizeof(name), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        if (REAL_NVML(nvmlDeviceGetHandleByUUID)(name, &h) != NVML_SUCCESS)
            return false;
        pthread_mutex_lock(&g_mu);
        g_dev[cuda_dev] = h;
        pthread_mutex_unlock(&g_mu);
    }
    *out = h;
    return true;
}

int vc_nvml_processes(nvmlDevice_t dev, struct vc_proc_mem *out, int max)
{
    static _Thread_local nvmlProcessInfo_t info[VC_MAX_PROCS];
    unsigned n = VC_MAX_PROCS;
    nvmlReturn_t rc = REAL_NVML(nvmlDeviceGetComputeRunningProcesses_v3)(dev, &n, info);
    if (rc != NVML_SUCCESS)
        return -1;
    int k = 0;
    for (unsigned i = 0; i < n && k < max; i++) {
        uint64_t used = info[i].usedGpuMemory;
        out[k++] = (struct vc_proc_mem){(int)info[i].pid, used == (uint64_t)NVML_VALUE_NOT_AVAILABLE ? 0 : used};
    }
    return k;
}

static int cmp_pid(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

uint64_t vc_nvml_used_by(const int *pids, unsigned npids, bool *ok)
{
    *ok = false;
    unsigned count = 0;
    if (!vc_nvml_ready() || REAL_NVML(nvmlDeviceGetCount_v2)(&count) != NVML_SUCCESS)
        return 0;
    static _Thread_local struct vc_proc_mem procs[VC_MAX_PROCS];
    uint64_t sum = 0;
    for (unsigned d = 0; d < count; d++) {
        /* A device NVML cannot tell about makes the sum unknown (not smaller): the caller keeps what it had. */
        nvmlDevice_t dev;
        if (REAL_NVML(nvmlDeviceGetHandleByIndex_v2)(d, &dev) != NVML_SUCCESS)
            return 0;
        int n = vc_nvml_processes(dev, procs, VC_MAX_PROCS);
        if (n < 0)
            return 0;
        for (int i = 0; i < n; i++)
            if (npids > 0 && bsearch(&procs[i].pid, pids, npids, sizeof(int), cmp_pid) != NULL)
                sum += procs[i].used;
    }
    *ok = true;
    return sum;
}

int vc_host_pid(void)
{
    return atomic_load_explicit(&g_host_pid, memory_order_relaxed);
}

void vc_set_host_pid(int pid)
{
    if (pid > 0 && atomic_exchange(&g_host_pid, pid) != pid) {
        if (pid != (int)getpid())
            vc_log(VC_LOG_INFO, "this process is %d in NVML's process lists", pid);
        vc_budget_set_host_pid(pid);
    }
}

void vc_nvml_atfork_child(void)
{
    atomic_store(&g_host_pid, 0); /* the child is another process */
    /*
     * Another thread of the parent may have held g_mu at the fork: the child, which does not have that thread,
     * must not wait for it.  g_mu guards only single handle loads and stores (a leaf: nothing is taken or called
     * with it held), so the handles copied are whole, and those of the same devices in the child.
     */
    pthread_mutex_init(&g_mu, NULL);
}
