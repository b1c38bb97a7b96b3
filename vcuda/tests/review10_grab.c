/*
 * A tenant taking as much device memory as it can.
 *
 * Usage: review10_grab WANT_MIB [hold]
 *   cuInit, device 0's primary context, then cuMemAlloc_v2 of 64 MiB at a time until WANT_MIB are held or an
 *   allocation fails.  Prints {"init": <cuInit's result>, "got_mib": <MiB held>} (got_mib 0 when cuInit
 *   failed); with "hold", keeps the memory until a line arrives on stdin.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <string.h>

#define CHUNK_MIB 64ull

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    unsigned long long want = strtoull(argv[1], NULL, 10), got = 0;
    bool hold = argc > 2 && strcmp(argv[2], "hold") == 0;
    open_driver();
    CUresult init = FN(cuInit)(0);
    if (init == CUDA_SUCCESS) {
        CUdevice dev;
        CUcontext ctx;
        check(FN(cuDeviceGet)(&dev, 0), "cuDeviceGet");
        check(FN(cuDevicePrimaryCtxRetain)(&ctx, dev), "cuDevicePrimaryCtxRetain");
        check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
        while (got + CHUNK_MIB <= want) {
            CUdeviceptr p = 0;
            if (FN(cuMemAlloc_v2)(&p, CHUNK_MIB * MIB) != CUDA_SUCCESS)
                break;
            got += CHUNK_MIB;
        }
    }
    printf("{\"init\": %d, \"got_mib\": %llu}\n", (int)init, got);
    fflush(stdout);
    if (hold) {
        char line[16];
        if (fgets(line, sizeof(line), stdin) == NULL)
            return 0;
    }
    return 0;
}
