/*
 * What the review test programs share: the real entry points of the libcuda.so.1 they dlopen
 * (the interceptor, as a container's program loads it), looked up by name, and a check of each
 * call's result. Included once per program.
 */
#ifndef REVIEW_DRIVER_H
#define REVIEW_DRIVER_H

#include <cuda.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#define MIB (1ull << 20)

/* The library every FN() is looked up in: set by the program's dlopen before the first call. */
static void *g_lib;

/* The address of `name` in g_lib; exit status 2 when it has none. */
static inline void *sym(const char *name)
{
    void *p = dlsym(g_lib, name);
    if (p == NULL) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return p;
}

/* Call a driver function through g_lib: FN(cuInit)(0). */
#define FN(name) ((__typeof__(&name))sym(#name))

/* Exit status 3, naming the call, when rc is not CUDA_SUCCESS. */
static inline void check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "%s failed: %d\n", what, (int)rc);
        exit(3);
    }
}

#endif
