/*
 * The container's budget file where it cannot be shared, and forks of a process allocating on many threads.
 *
 * Usage: review3_budget alloc SIZE_MIB
 *   cuInit, a context, cuMemAlloc_v2(SIZE_MIB).  Prints {"alloc": <rc>}.
 * Usage: review3_budget fork PARENT_MIB CHILD_MIB THREADS FORKS
 *   cuInit, a context, cuMemAlloc_v2(PARENT_MIB); THREADS threads then allocate and free 1 MiB in a loop
 *   while the main thread forks FORKS children, one at a time.  Each child creates a context of its own and
 *   allocates CHILD_MIB, then _exits with 0 (success), 10 + rc (refused) or is killed by SIGALRM after 30 s
 *   (stuck).  Prints {"forks": N, "ok": N, "refused": N, "stuck": N, "last_rc": rc}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include <cuda.h>

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB (1ull << 20)

static void *g_lib;

static void *sym(const char *name)
{
    void *p = dlsym(g_lib, name);
    if (p == NULL) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return p;
}

#define FN(name) ((__typeof__(&name))sym(#name))

static void check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "%s failed: %d\n", what, (int)rc);
        exit(3);
    }
}

static CUcontext setup(void)
{
    CUdevice dev;
    CUcontext ctx;
    check(FN(cuInit)(0), "cuInit");
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    check(FN(cuCtxCreate_v2)(&ctx, 0, dev), "cuCtxCreate");
    return ctx;
}

static _Atomic bool g_stop;
static CUcontext g_ctx;

static void *churn(void *arg)
{
    (void)arg;
    if (FN(cuCtxSetCurrent)(g_ctx) != CUDA_SUCCESS)
        return NULL;
    CUresult (*alloc)(CUdeviceptr *, size_t) = FN(cuMemAlloc_v2);
    CUresult (*release)(CUdeviceptr) = FN(cuMemFree_v2);
    while (!atomic_load(&g_stop)) {
        CUdeviceptr p;
        if (alloc(&p, MIB) == CUDA_SUCCESS)
            release(p);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (g_lib == NULL) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    if (strcmp(argv[1], "alloc") == 0) {
        setup();
        CUdeviceptr p = 0;
        CUresult rc = FN(cuMemAlloc_v2)(&p, (size_t)strtoull(argv[2], NULL, 10) * MIB);
        printf("{\"alloc\": %d}\n", (int)rc);
        return 0;
    }
    if (strcmp(argv[1], "fork") != 0 || argc != 6)
        return 2;
    size_t parent = (size_t)strtoull(argv[2], NULL, 10) * MIB, child = (size_t)strtoull(argv[3], NULL, 10) * MIB;
    int threads = atoi(argv[4]), forks = atoi(argv[5]);
    g_ctx = setup();
    CUdeviceptr held = 0;
    check(FN(cuMemAlloc_v2)(&held, parent), "the parent's allocation");
    pthread_t tid[64];
    if (threads > 64)
        threads = 64;
    for (int i = 0; i < threads; i++)
        if (pthread_create(&tid[i], NULL, churn, NULL) != 0)
            return 4;
    usleep(20000);
    int ok = 0, refused = 0, stuck = 0, last_rc = 0, n = 0;
    for (; n < forks; n++) {
        pid_t pid = fork();
        if (pid < 0)
            return 5;
        if (pid == 0) {
            alarm(30); /* a child waiting on a lock nobody in it will release: killed, counted as stuck */
            CUdevice dev;
            CUcontext ctx;
            CUdeviceptr p;
            if (FN(cuDeviceGet)(&dev, 0) != CUDA_SUCCESS || FN(cuCtxCreate_v2)(&ctx, 0, dev) != CUDA_SUCCESS)
                _exit(9);
            CUresult rc = FN(cuMemAlloc_v2)(&p, child);
            _exit(rc == CUDA_SUCCESS ? 0 : 10 + (int)rc);
        }
        int st = 0;
        if (waitpid(pid, &st, 0) != pid)
            return 6;
        if (WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM) {
            stuck++;
            break; /* one is enough */
        }
        if (!WIFEXITED(st))
            return 7;
        int code = WEXITSTATUS(st);
        if (code == 0)
            ok++;
        else if (code >= 10)
            refused++, last_rc = code - 10;
        else
            return 8;
    }
    atomic_store(&g_stop, true);
    for (int i = 0; i < threads; i++)
        pthread_join(tid[i], NULL);
    printf("{\"forks\": %d, \"ok\": %d, \"refused\": %d, \"stuck\": %d, \"last_rc\": %d}\n", n, ok, refused, stuck,
           last_rc);
    return 0;
}
