/*
 * A tenant keeps device memory past the memory cap through a shareable handle imported into its own
 * process: cuMemCreate, cuMemExportToShareableHandle, cuMemImportFromShareableHandle of that fd, then
 * cuMemRelease of the handle it created.  The imported handle still refers to the same physical memory
 * (the driver frees it with its last handle and mapping, in whatever process), so the memory lives on.
 *
 * Usage: review2_shareable ROUNDS SIZE_MIB AFTER_MIB
 * Runs up to ROUNDS rounds of SIZE_MIB each (stopping at the first refusal), maps every imported handle,
 * then unmaps and releases them all and allocates AFTER_MIB with cuMemAlloc_v2.  Prints one JSON line:
 * {"rounds": N, "refused": "<rc of the refused cuMemCreate or 0>", "after": <rc of the last allocation>}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_ROUNDS 64

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    int rounds = atoi(argv[1]);
    size_t size = (size_t)strtoull(argv[2], NULL, 10) * MIB;
    size_t after = (size_t)strtoull(argv[3], NULL, 10) * MIB;
    if (rounds < 1 || rounds > MAX_ROUNDS)
        return 2;
    open_driver();
    primary_context();

    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

    CUmemGenericAllocationHandle kept[MAX_ROUNDS];
    CUdeviceptr va[MAX_ROUNDS];
    int done = 0;
    CUresult refused = CUDA_SUCCESS;
    for (; done < rounds; done++) {
        CUmemGenericAllocationHandle h;
        refused = FN(cuMemCreate)(&h, size, &prop, 0);
        if (refused != CUDA_SUCCESS)
            break;
        int fd = -1;
        check(FN(cuMemExportToShareableHandle)(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export");
        check(FN(cuMemImportFromShareableHandle)(&kept[done], (void *)(intptr_t)fd,
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              "import");
        close(fd);
        check(FN(cuMemRelease)(h), "cuMemRelease of the created handle");
        check(FN(cuMemAddressReserve)(&va[done], size, 0, 0, 0), "cuMemAddressReserve");
        check(FN(cuMemMap)(va[done], size, 0, kept[done], 0), "cuMemMap of the imported handle");
    }
    /* Everything back: the memory goes with the imported handles and their mappings. */
    for (int i = 0; i < done; i++) {
        check(FN(cuMemUnmap)(va[i], size), "cuMemUnmap");
        check(FN(cuMemAddressFree)(va[i], size), "cuMemAddressFree");
        check(FN(cuMemRelease)(kept[i]), "cuMemRelease of the imported handle");
    }
    /* What the container holds is known again at the next reconciliation near the cap (at most every 2 ms). */
    usleep(20000);
    CUdeviceptr p = 0;
    CUresult last = FN(cuMemAlloc_v2)(&p, after);
    if (last == CUDA_SUCCESS)
        check(FN(cuMemFree_v2)(p), "cuMemFree_v2");
    printf("{\"rounds\": %d, \"refused\": %d, \"after\": %d}\n", done, (int)refused, (int)last);
    return 0;
}
