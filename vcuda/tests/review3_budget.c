/*
 * The container's budget file where it cannot be shared, and forks of a process allocating on many threads.
 *
 * Usage: review3_budget alloc SIZE_MIB
 *   cuInit, a context, cuMemAlloc_v2(SIZE_MIB).  Prints {"alloc": <rc>}.
 * Usage: review3_budget fork PARENT_MIB THREADS FORKS
 *   cuInit, a context, cuMemAlloc_v2(PARENT_MIB); THREADS threads then allocate and free 1 MiB in a loop
 *   while the main thread forks FORKS children, one at a time.  Each child asks NVML (libnvidia-ml.so.1) for
 *   GPU 0's memory, writes the used MiB it was told into a pipe and _exits with 0, 10 + its NVML error, or
 *   is killed by SIGALRM after 30 s (stuck).  Prints {"forks": N, "ok": N, "failed": N, "stuck": N,
 *   "child_used_mib": the most a child was told}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

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

static struct churn g_churn; /* no pause between an allocation and its free */

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    open_driver();
    if (strcmp(argv[1], "alloc") == 0) {
        created_context();
        CUdeviceptr p = 0;
        CUresult rc = FN(cuMemAlloc_v2)(&p, (size_t)strtoull(argv[2], NULL, 10) * MIB);
        printf("{\"alloc\": %d}\n", (int)rc);
        return 0;
    }
    if (strcmp(argv[1], "fork") != 0 || argc != 5)
        return 2;
    size_t parent = (size_t)strtoull(argv[2], NULL, 10) * MIB;
    int threads = atoi(argv[3]), forks = atoi(argv[4]);
    void *nvml = open_lib("libnvidia-ml.so.1");
    struct mem { unsigned long long total, free, used; };
    int (*nvml_init)(void) = (int (*)(void))sym_in(nvml, "nvmlInit_v2");
    int (*nvml_handle)(unsigned, void **) = (int (*)(unsigned, void **))sym_in(nvml, "nvmlDeviceGetHandleByIndex_v2");
    int (*nvml_mem)(void *, struct mem *) = (int (*)(void *, struct mem *))sym_in(nvml, "nvmlDeviceGetMemoryInfo");
    g_churn.ctx = created_context();
    CUdeviceptr held = 0;
    check(FN(cuMemAlloc_v2)(&held, parent), "the parent's allocation");
    pthread_t tid[64];
    if (threads > 64)
        threads = 64;
    for (int i = 0; i < threads; i++)
        if (pthread_create(&tid[i], NULL, churn, &g_churn) != 0)
            return 4;
    usleep(20000);
    int ok = 0, failed = 0, stuck = 0, n = 0;
    long long child_used = 0;
    for (; n < forks; n++) {
        int fds[2];
        if (pipe(fds) != 0)
            return 5;
        pid_t pid = fork();
        if (pid < 0)
            return 5;
        if (pid == 0) {
            alarm(30); /* a child waiting on a lock nobody in it will release: killed, counted as stuck */
            void *dev = NULL;
            struct mem m = {0, 0, 0};
            int rc = nvml_init();
            if (rc == 0)
                rc = nvml_handle(0, &dev);
            if (rc == 0)
                rc = nvml_mem(dev, &m);
            long long used = (long long)(m.used >> 20);
            if (write(fds[1], &used, sizeof(used)) != (ssize_t)sizeof(used))
                _exit(9);
            _exit(rc == 0 ? 0 : 10 + (rc > 200 ? 200 : rc));
        }
        close(fds[1]);
        int st = 0;
        if (waitpid(pid, &st, 0) != pid)
            return 6;
        long long used = 0;
        if (read(fds[0], &used, sizeof(used)) == (ssize_t)sizeof(used) && used > child_used)
            child_used = used;
        close(fds[0]);
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
            failed++;
        else
            return 8;
    }
    atomic_store(&g_churn.stop, true);
    for (int i = 0; i < threads; i++)
        pthread_join(tid[i], NULL);
    printf("{\"forks\": %d, \"ok\": %d, \"failed\": %d, \"stuck\": %d, \"child_used_mib\": %lld}\n", n, ok,
           failed, stuck, child_used);
    return 0;
}
