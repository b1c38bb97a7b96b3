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
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (g_lib == NULL) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUdeviceptr buf;
    check(FN(cuInit)(0), "cuInit");
    check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    check(FN(cuDevicePrimaryCtxRetain)(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    check(FN(cuModuleLoadData)(&mod, "fatbin"), "cuModuleLoadData");
    check(FN(cuModuleGetFunction)(&fn, mod, "spin_1ms"), "cuModuleGetFunction");
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
