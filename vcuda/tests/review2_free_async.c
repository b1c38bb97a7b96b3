/*
 * A tenant frees plain device memory with cuMemFreeAsync on a stream that still has work queued before
 * the free: the GPU frees it only when the stream gets there (stream order), yet an interceptor that
 * credits the bytes when the call returns lets the tenant allocate them again at once.
 *
 * Usage: review2_free_async ROUNDS SIZE_MIB AFTER_MIB KERNEL
 * Launches KERNEL (a simulated kernel name carrying its duration, e.g. spin_3000ms) on a created stream,
 * then runs up to ROUNDS rounds of cuMemAlloc_v2(SIZE_MIB) + cuMemFreeAsync on that stream (stopping at the
 * first refusal), synchronises the stream and allocates AFTER_MIB.  Prints one JSON line:
 * {"rounds": N, "refused": <rc of the refused allocation or 0>, "after": <rc of the last allocation>}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    int rounds = atoi(argv[1]);
    size_t size = (size_t)strtoull(argv[2], NULL, 10) * MIB;
    size_t after = (size_t)strtoull(argv[3], NULL, 10) * MIB;
    open_driver();
    primary_context();
    CUfunction fn = load_kernel("fatbin", argv[4]);
    CUstream s;
    check(FN(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    check(FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL), "cuLaunchKernel");

    int done = 0;
    CUresult refused = CUDA_SUCCESS;
    for (; done < rounds; done++) {
        CUdeviceptr p;
        refused = FN(cuMemAlloc_v2)(&p, size);
        if (refused != CUDA_SUCCESS)
            break;
        check(FN(cuMemFreeAsync)(p, s), "cuMemFreeAsync"); /* freed once the kernel before it is done */
    }
    check(FN(cuStreamSynchronize)(s), "cuStreamSynchronize");
    CUdeviceptr q = 0;
    CUresult last = FN(cuMemAlloc_v2)(&q, after);
    if (last == CUDA_SUCCESS)
        check(FN(cuMemFree_v2)(q), "cuMemFree_v2");
    check(FN(cuStreamDestroy_v2)(s), "cuStreamDestroy_v2");
    printf("{\"rounds\": %d, \"refused\": %d, \"after\": %d}\n", done, (int)refused, (int)last);
    return 0;
}
