/*
 * A module image rewritten by another thread while it is being loaded.
 *
 * Usage: review5_image MODE REWRITE_MS
 *   MODE: module (cuModuleLoadData), module_ex (cuModuleLoadDataEx), fatbinary (cuModuleLoadFatBinary) or
 *   library (cuLibraryLoadData).  cuInit, a context; the image (PTX declaring one 16-byte variable `small`) is
 *   loaded while another thread, REWRITE_MS after the call began, rewrites the buffer into PTX declaring a
 *   256 MiB variable `big` (the interceptor's test-only VCUDA_TEST_LOAD_DELAY_US holds the load meanwhile).
 *   Prints {"load": rc, "small": rc, "big": rc}: the results of the load and of looking each variable up in
 *   what was loaded.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char SMALL[] = ".version 7.0\n.target sm_75\n.address_size 64\n"
                            ".visible .global .align 8 .b8 small[16];\n";
static const char BIG[] = ".version 7.0\n.target sm_75\n.address_size 64\n"
                          ".visible .global .align 8 .b8 big[268435456];\n";
static char g_image[4096];
static unsigned g_rewrite_ms;

static void *rewriter(void *arg)
{
    (void)arg;
    usleep(g_rewrite_ms * 1000u);
    memcpy(g_image, BIG, sizeof(BIG)); /* the NUL too */
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: review5_image module|module_ex|fatbinary|library REWRITE_MS\n");
        return 2;
    }
    open_driver();
    g_rewrite_ms = (unsigned)atoi(argv[2]);
    created_context();
    memcpy(g_image, SMALL, sizeof(SMALL));
    pthread_t t;
    if (pthread_create(&t, NULL, rewriter, NULL) != 0)
        return 2;
    CUresult load, small = CUDA_ERROR_NOT_FOUND, big = CUDA_ERROR_NOT_FOUND;
    CUdeviceptr p;
    size_t size;
    if (strcmp(argv[1], "library") == 0) {
        CUlibrary lib;
        load = FN(cuLibraryLoadData)(&lib, g_image, NULL, NULL, 0, NULL, NULL, 0);
        if (load == CUDA_SUCCESS) {
            small = FN(cuLibraryGetGlobal)(&p, &size, lib, "small");
            big = FN(cuLibraryGetGlobal)(&p, &size, lib, "big");
        }
    } else {
        CUmodule mod;
        if (strcmp(argv[1], "module_ex") == 0)
            load = FN(cuModuleLoadDataEx)(&mod, g_image, 0, NULL, NULL);
        else if (strcmp(argv[1], "fatbinary") == 0)
            load = FN(cuModuleLoadFatBinary)(&mod, g_image);
        else
            load = FN(cuModuleLoadData)(&mod, g_image);
        if (load == CUDA_SUCCESS) {
            small = FN(cuModuleGetGlobal_v2)(&p, &size, mod, "small");
            big = FN(cuModuleGetGlobal_v2)(&p, &size, mod, "big");
        }
    }
    pthread_join(t, NULL);
    printf("{\"load\": %d, \"small\": %d, \"big\": %d}\n", (int)load, (int)small, (int)big);
    return 0;
}
