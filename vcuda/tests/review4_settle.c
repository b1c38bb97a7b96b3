/*
 * A context limit raised (cuCtxSetLimit: its bytes handed over to the reconciliation with NVML) while other
 * threads allocate and free.
 *
 * Usage: review4_settle BUDGET_FILE THREADS ROUNDS
 *   cuInit, the primary context; THREADS threads allocate and free 1 MiB in a loop while the main thread raises
 *   the context's malloc heap by 8 MiB ROUNDS times; then the threads stop, having freed all they allocated.
 *   Prints {"before": B, "after": A, "rounds_ok": N}: this process's slot in the container's budget file
 *   (bytes it is charged) before the threads started and after they stopped.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SLOTS_AT 4096 /* the budget file's header; then 64-byte slots: int32 pid, int32 host pid, u64 start, u64 used */

static struct churn g_churn = {.hold_us = 100};

/* This process's slot's charge, read from the budget file. */
static uint64_t slot_used(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        perror(path);
        exit(4);
    }
    for (off_t at = SLOTS_AT;; at += 64) {
        int32_t pid;
        uint64_t used;
        if (pread(fd, &pid, sizeof(pid), at) != (ssize_t)sizeof(pid)) {
            fprintf(stderr, "no slot of this process in %s\n", path);
            exit(4);
        }
        if (pid == (int32_t)getpid() && pread(fd, &used, sizeof(used), at + 16) == (ssize_t)sizeof(used)) {
            close(fd);
            return used;
        }
    }
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    int threads = atoi(argv[2]), rounds = atoi(argv[3]);
    open_driver();
    g_churn.ctx = primary_context();
    uint64_t before = slot_used(argv[1]);
    pthread_t tid[32];
    if (threads > 32)
        threads = 32;
    for (int i = 0; i < threads; i++)
        if (pthread_create(&tid[i], NULL, churn, &g_churn) != 0)
            return 5;
    int ok = 0;
    for (int r = 0; r < rounds; r++) {
        size_t heap = 0;
        check(FN(cuCtxGetLimit)(&heap, CU_LIMIT_MALLOC_HEAP_SIZE), "cuCtxGetLimit");
        if (FN(cuCtxSetLimit)(CU_LIMIT_MALLOC_HEAP_SIZE, heap + 8 * MIB) == CUDA_SUCCESS)
            ok++;
    }
    atomic_store(&g_churn.stop, true);
    for (int i = 0; i < threads; i++)
        pthread_join(tid[i], NULL);
    uint64_t after = slot_used(argv[1]);
    printf("{\"before\": %llu, \"after\": %llu, \"rounds_ok\": %d}\n", (unsigned long long)before,
           (unsigned long long)after, ok);
    return 0;
}
