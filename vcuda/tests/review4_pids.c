/*
 * A process under an SM limit launching kernels until told to stop, so that its limiter keeps measuring (and
 * re-reads the container's pids.config as it changes).
 *
 * Usage: review4_pids
 *   cuInit, the primary context, spin_1ms launched and synchronised over and over until a line (or EOF) on
 *   stdin.  Prints {"launches": N}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <dlfcn.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(void)
{
    open_driver();
    primary_context();
    CUfunction fn = load_kernel("fatbin", "spin_1ms");
    CUdeviceptr buf;
    check(FN(cuMemAlloc_v2)(&buf, 1 << 20), "cuMemAlloc_v2");
    void *args[] = {&buf};
    long launches = 0;
    for (;;) {
        struct pollfd p = {.fd = STDIN_FILENO, .events = POLLIN};
        if (poll(&p, 1, 0) != 0)
            break; /* a line, EOF or an error: stop */
        for (int i = 0; i < 4; i++, launches++)
            check(FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL), "cuLaunchKernel");
        check(FN(cuCtxSynchronize)(), "cuCtxSynchronize");
    }
    printf("{\"launches\": %ld}\n", launches);
    return 0;
}
