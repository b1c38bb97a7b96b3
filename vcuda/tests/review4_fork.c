/*
 * Forks of a process whose other threads create and destroy contexts, launch under the SM limit (its sampling)
 * and ask NVML for the GPU's memory.
 *
 * Usage: review4_fork THREADS FORKS
 *   cuInit, the primary context; THREADS threads of each kind (launching spin_10us and synchronising; creating
 *   and destroying a context; nvmlDeviceGetMemoryInfo) while the main thread forks FORKS children one at a time.
 *   Each child asks NVML for GPU 0's memory, creates a context, allocates 1 MiB and _exits with 0, 10 + the
 *   step that failed, or is killed by SIGALRM after 30 s (stuck) or a sanitizer (crashed).
 *   Prints {"forks": N, "ok": N, "failed": N, "stuck": N, "crashed": N}.
 * Loads libcuda.so.1 and libnvidia-ml.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

struct mem { unsigned long long total, free, used; };
static int (*nvml_init)(void);
static int (*nvml_handle)(unsigned, void **);
static int (*nvml_mem)(void *, struct mem *);

static _Atomic bool g_stop;
static CUcontext g_ctx;
static CUfunction g_fn;

static void *launcher(void *arg)
{
    (void)arg;
    CUdeviceptr buf = 0;
    if (FN(cuCtxSetCurrent)(g_ctx) != CUDA_SUCCESS || FN(cuMemAlloc_v2)(&buf, 4096) != CUDA_SUCCESS)
        return NULL;
    void *args[] = {&buf};
    while (!atomic_load(&g_stop)) {
        FN(cuLaunchKernel)(g_fn, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL);
        FN(cuCtxSynchronize)();
    }
    return NULL;
}

static void *creator(void *arg)
{
    (void)arg;
    CUdevice dev;
    if (FN(cuDeviceGet)(&dev, 0) != CUDA_SUCCESS)
        return NULL;
    while (!atomic_load(&g_stop)) {
        CUcontext c;
        if (FN(cuCtxCreate_v2)(&c, 0, dev) == CUDA_SUCCESS)
            FN(cuCtxDestroy_v2)(c);
    }
    return NULL;
}

static void *viewer(void *arg)
{
    (void)arg;
    void *dev = NULL;
    if (nvml_init() != 0 || nvml_handle(0, &dev) != 0)
        return NULL;
    while (!atomic_load(&g_stop)) {
        struct mem m;
        nvml_mem(dev, &m);
    }
    return NULL;
}

static int child(void)
{
    alarm(30); /* a child waiting on a lock nobody in it will release: killed, counted as stuck */
    void *dev = NULL;
    struct mem m;
    if (nvml_init() != 0 || nvml_handle(0, &dev) != 0 || nvml_mem(dev, &m) != 0)
        return 11;
    CUdevice d;
    CUcontext c;
    CUdeviceptr p;
    if (FN(cuInit)(0) != CUDA_SUCCESS || FN(cuDeviceGet)(&d, 0) != CUDA_SUCCESS)
        return 12;
    if (FN(cuCtxCreate_v2)(&c, 0, d) != CUDA_SUCCESS)
        return 13;
    if (FN(cuMemAlloc_v2)(&p, 1 << 20) != CUDA_SUCCESS)
        return 14;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    int threads = atoi(argv[1]), forks = atoi(argv[2]);
    open_driver();
    void *nvml = open_lib("libnvidia-ml.so.1");
    nvml_init = (int (*)(void))sym_in(nvml, "nvmlInit_v2");
    nvml_handle = (int (*)(unsigned, void **))sym_in(nvml, "nvmlDeviceGetHandleByIndex_v2");
    nvml_mem = (int (*)(void *, struct mem *))sym_in(nvml, "nvmlDeviceGetMemoryInfo");
    g_ctx = primary_context();
    g_fn = load_kernel("fatbin", "spin_10us");
    pthread_t tid[48];
    int n_tid = 0;
    if (threads > 16)
        threads = 16;
    for (int i = 0; i < threads; i++) {
        void *(*kinds[])(void *) = {launcher, creator, viewer};
        for (int k = 0; k < 3; k++)
            if (pthread_create(&tid[n_tid++], NULL, kinds[k], NULL) != 0)
                return 4;
    }
    usleep(20000);
    int ok = 0, failed = 0, stuck = 0, crashed = 0, n = 0;
    for (; n < forks; n++) {
        pid_t pid = fork();
        if (pid < 0)
            return 5;
        if (pid == 0)
            _exit(child());
        int st = 0;
        if (waitpid(pid, &st, 0) != pid)
            return 6;
        if (WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM)
            stuck++;
        else if (!WIFEXITED(st))
            crashed++;
        else if (WEXITSTATUS(st) == 0)
            ok++;
        else if (WEXITSTATUS(st) >= 10 && WEXITSTATUS(st) < 20)
            failed++;
        else
            crashed++; /* a sanitizer's exit status */
        if (stuck + crashed > 0)
            break; /* one is enough */
    }
    atomic_store(&g_stop, true);
    for (int i = 0; i < n_tid; i++)
        pthread_join(tid[i], NULL);
    printf("{\"forks\": %d, \"ok\": %d, \"failed\": %d, \"stuck\": %d, \"crashed\": %d}\n", n, ok, failed, stuck,
           crashed);
    return 0;
}
