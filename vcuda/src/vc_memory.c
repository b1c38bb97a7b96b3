/*
 * The memory cap: every device allocation path reserves its bytes in the
 * container's budget before the driver is called, rolls back when the driver
 * fails, and remembers what it reserved so the matching free returns it.
 * Frees always reach the driver (unknown pointers included).  Memory queries
 * (cuMemGetInfo, cuDeviceTotalMem, nvmlDeviceGetMemoryInfo) report the
 * container's view.  cuGetProcAddress hands out these hooks.
 *
 * With the cap off (no config, enable = 0) every hook is one branch and a
 * tail call to the driver.
 */
#include "vc_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "vc_map.h"

/* ---- what each allocation reserved (process-local) ----------------------------- */

enum rec_kind {
    REC_DEV = 1, /* cuMemAlloc_v2, pitch, managed, stream-ordered: key = device address */
    REC_LEGACY,  /* CUDA 2.0 ABI cuMemAlloc / cuMemAllocPitch: key = 32-bit address */
    REC_ARRAY,   /* key = CUarray */
    REC_MIPMAP,  /* key = CUmipmappedArray */
    REC_VMM,     /* key = CUmemGenericAllocationHandle (device memory only) */
    REC_GNODE,   /* key = CUgraphNode of a memory allocation node, aux = its graph */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* guards g_recs */
static struct vc_map g_recs;

static void atfork_prepare(void)
{
    pthread_mutex_lock(&g_mu);
}

static void atfork_parent(void)
{
    pthread_mutex_unlock(&g_mu);
}

static void atfork_child(void)
{
    /* The child owns none of its parent's allocations, and reserves in a slot of its own. */
    vc_map_reset(&g_recs);
    pthread_mutex_init(&g_mu, NULL);
    vc_budget_atfork_child();
}

__attribute__((constructor)) static void vc_memory_init(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

static void remember(uint64_t key, enum rec_kind kind, uint64_t size, uint64_t aux)
{
    struct vc_map_entry e = {.key = key, .kind = kind, .size = size, .aux = aux};
    pthread_mutex_lock(&g_mu);
    int rc = vc_map_put(&g_recs, &e);
    pthread_mutex_unlock(&g_mu);
    if (rc != 0) /* the bytes stay reserved: the cap errs on the safe side */
        vc_log(VC_LOG_ERROR, "out of host memory: %llu bytes stay charged until this process exits",
               (unsigned long long)size);
}

/* Takes the record of key out (before the driver frees it, so the address cannot be reused meanwhile). */
static bool take(uint64_t key, enum rec_kind kind, struct vc_map_entry *out)
{
    if (key == 0)
        return false;
    pthread_mutex_lock(&g_mu);
    bool hit = vc_map_find(&g_recs, key, kind, out, true);
    pthread_mutex_unlock(&g_mu);
    return hit;
}

static void put_back(const struct vc_map_entry *e)
{
    remember(e->key, (enum rec_kind)e->kind, e->size, e->aux);
}

/* After the driver freed (rc == success) or refused: return the bytes, or keep the record. */
static CUresult settle(CUresult rc, bool had, const struct vc_map_entry *e)
{
    if (had) {
        if (rc == CUDA_SUCCESS)
            vc_budget_release(e->size);
        else
            put_back(e);
    }
    return rc;
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

/* Reserve-then-allocate around one driver call; remembers key -> bytes on success. */
#define RESERVED(bytes, call, key_expr, kind, aux)                                                                 \
    do {                                                                                                           \
        uint64_t bytes_ = (bytes);                                                                                 \
        if (!vc_budget_reserve(bytes_))                                                                            \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                                 \
            vc_budget_release(bytes_);                                                                             \
            return rc_;                                                                                            \
        }                                                                                                          \
        remember((uint64_t)(key_expr), (kind), bytes_, (aux));                                                     \
        return rc_;                                                                                                \
    } while (0)

/* ---- linear device memory -------------------------------------------------------- */

VC_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAlloc_v2)(dptr, bytesize);
    RESERVED(bytesize, REAL_CU(cuMemAlloc_v2)(dptr, bytesize), *dptr, REC_DEV, 0);
}

VC_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAlloc)(dptr, bytesize);
    RESERVED(bytesize, REAL_CU(cuMemAlloc)(dptr, bytesize), *dptr, REC_LEGACY, 0);
}

VC_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocManaged)(dptr, bytesize, flags);
    RESERVED(bytesize, REAL_CU(cuMemAllocManaged)(dptr, bytesize, flags), *dptr, REC_DEV, 0);
}

VC_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemFree_v2)(dptr);
    struct vc_map_entry e;
    bool had = take(dptr, REC_DEV, &e);
    return settle(REAL_CU(cuMemFree_v2)(dptr), had, &e);
}

VC_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemFree)(dptr);
    struct vc_map_entry e;
    bool had = take(dptr, REC_LEGACY, &e);
    return settle(REAL_CU(cuMemFree)(dptr), had, &e);
}

/* Pitch: reserve the likely size, then settle on pitch x height once the driver chose the pitch. */
static CUresult true_up(uint64_t reserved, uint64_t actual)
{
    if (actual > reserved)
        return vc_budget_reserve(actual - reserved) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    vc_budget_release(reserved - actual);
    return CUDA_SUCCESS;
}

VC_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                      unsigned int ElementSizeBytes)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || pPitch == NULL || WidthInBytes == 0 || Height == 0)
        return REAL_CU(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t guess = mul_sat((WidthInBytes + 511) / 512 * 512, Height);
    if (!vc_budget_reserve(guess))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = REAL_CU(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(guess);
        return rc;
    }
    uint64_t actual = mul_sat(*pPitch, Height);
    if (true_up(guess, actual) != CUDA_SUCCESS) {
        REAL_CU(cuMemFree_v2)(*dptr);
        vc_budget_release(guess);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    remember(*dptr, REC_DEV, actual, 0);
    return rc;
}

VC_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                   unsigned int Height, unsigned int ElementSizeBytes)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || pPitch == NULL || WidthInBytes == 0 || Height == 0)
        return REAL_CU(cuMemAllocPitch)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t guess = mul_sat(((uint64_t)WidthInBytes + 511) / 512 * 512, Height);
    if (!vc_budget_reserve(guess))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = REAL_CU(cuMemAllocPitch)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(guess);
        return rc;
    }
    uint64_t actual = mul_sat(*pPitch, Height);
    if (true_up(guess, actual) != CUDA_SUCCESS) {
        REAL_CU(cuMemFree)(*dptr);
        vc_budget_release(guess);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    remember(*dptr, REC_LEGACY, actual, 0);
    return rc;
}

/* ---- stream-ordered allocation and pools ----------------------------------------------- */

VC_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocAsync)(dptr, bytesize, hStream);
    RESERVED(bytesize, REAL_CU(cuMemAllocAsync)(dptr, bytesize, hStream), *dptr, REC_DEV, 0);
}

VC_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocAsync_ptsz)(dptr, bytesize, hStream);
    RESERVED(bytesize, REAL_CU(cuMemAllocAsync_ptsz)(dptr, bytesize, hStream), *dptr, REC_DEV, 0);
}

VC_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, hStream);
    RESERVED(bytesize, REAL_CU(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, hStream), *dptr, REC_DEV, 0);
}

VC_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, hStream);
    RESERVED(bytesize, REAL_CU(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, hStream), *dptr, REC_DEV, 0);
}

VC_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemFreeAsync)(dptr, hStream);
    struct vc_map_entry e;
    bool had = take(dptr, REC_DEV, &e);
    return settle(REAL_CU(cuMemFreeAsync)(dptr, hStream), had, &e);
}

VC_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemFreeAsync_ptsz)(dptr, hStream);
    struct vc_map_entry e;
    bool had = take(dptr, REC_DEV, &e);
    return settle(REAL_CU(cuMemFreeAsync_ptsz)(dptr, hStream), had, &e);
}

/* ---- virtual memory management ------------------------------------------------------------ */

VC_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    /* Only device memory counts: NCCL creates host memory here too. */
    if (VC_LIKELY(!vc_limited()) || handle == NULL || size == 0 || prop == NULL ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL_CU(cuMemCreate)(handle, size, prop, flags);
    RESERVED(size, REAL_CU(cuMemCreate)(handle, size, prop, flags), *handle, REC_VMM, 0);
}

VC_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemRelease)(handle);
    struct vc_map_entry e;
    bool had = take(handle, REC_VMM, &e);
    return settle(REAL_CU(cuMemRelease)(handle), had, &e);
}

/* ---- arrays ------------------------------------------------------------------------------- */

static unsigned format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    default: return 4;
    }
}

/* A lower estimate from the description; the driver's own requirements settle it afterwards. */
static uint64_t array_guess(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels)
{
    return mul_sat(mul_sat(mul_sat((uint64_t)w, (uint64_t)format_bytes(f) * channels), h ? h : 1), d ? d : 1);
}

/* After the array exists: its real size (cuArrayGetMemoryRequirements), or the estimate if unknown. */
static uint64_t array_actual(void *array, bool mipmap, uint64_t guess)
{
    CUdevice dev;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    memset(&req, 0, sizeof(req));
    if (REAL_CU(cuCtxGetDevice)(&dev) != CUDA_SUCCESS)
        return guess;
    CUresult rc = mipmap ? REAL_CU(cuMipmappedArrayGetMemoryRequirements)(&req, (CUmipmappedArray)array, dev)
                         : REAL_CU(cuArrayGetMemoryRequirements)(&req, (CUarray)array, dev);
    return rc == CUDA_SUCCESS && req.size > 0 ? req.size : guess;
}

/* Reserve guess, create with call, settle on the real size; destroy and fail if it does not fit. */
#define ARRAY_CREATE(guess, call, handle, mipmap, destroy)                                                         \
    do {                                                                                                           \
        uint64_t guess_ = (guess);                                                                                 \
        if (!vc_budget_reserve(guess_))                                                                            \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                                 \
            vc_budget_release(guess_);                                                                             \
            return rc_;                                                                                            \
        }                                                                                                          \
        uint64_t actual_ = array_actual((void *)*(handle), (mipmap), guess_);                                     \
        if (true_up(guess_, actual_) != CUDA_SUCCESS) {                                                            \
            destroy(*(handle));                                                                                    \
            vc_budget_release(guess_);                                                                             \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
        remember((uint64_t)(uintptr_t) * (handle), (mipmap) ? REC_MIPMAP : REC_ARRAY, actual_, 0);                 \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArrayCreate_v2)(pHandle, d);
    ARRAY_CREATE(array_guess(d->Width, d->Height, 0, d->Format, d->NumChannels), REAL_CU(cuArrayCreate_v2)(pHandle, d),
                 pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArrayCreate)(pHandle, d);
    ARRAY_CREATE(array_guess(d->Width, d->Height, 0, d->Format, d->NumChannels), REAL_CU(cuArrayCreate)(pHandle, d),
                 pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArray3DCreate_v2)(pHandle, d);
    ARRAY_CREATE(array_guess(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                 REAL_CU(cuArray3DCreate_v2)(pHandle, d), pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArray3DCreate)(pHandle, d);
    ARRAY_CREATE(array_guess(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                 REAL_CU(cuArray3DCreate)(pHandle, d), pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                          unsigned int numMipmapLevels)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuMipmappedArrayCreate)(pHandle, d, numMipmapLevels);
    uint64_t guess = 0;
    for (unsigned l = 0; l < numMipmapLevels && l < 64; l++) {
        size_t w = d->Width >> l, h = d->Height >> l, dd = d->Depth >> l;
        guess += array_guess(w ? w : 1, h, dd, d->Format, d->NumChannels);
    }
    ARRAY_CREATE(guess, REAL_CU(cuMipmappedArrayCreate)(pHandle, d, numMipmapLevels), pHandle, true,
                 REAL_CU(cuMipmappedArrayDestroy));
}

VC_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuArrayDestroy)(hArray);
    struct vc_map_entry e;
    bool had = take((uint64_t)(uintptr_t)hArray, REC_ARRAY, &e);
    return settle(REAL_CU(cuArrayDestroy)(hArray), had, &e);
}

VC_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMipmappedArrayDestroy)(hMipmappedArray);
    struct vc_map_entry e;
    bool had = take((uint64_t)(uintptr_t)hMipmappedArray, REC_MIPMAP, &e);
    return settle(REAL_CU(cuMipmappedArrayDestroy)(hMipmappedArray), had, &e);
}

/* ---- graph memory nodes ------------------------------------------------------------------------ */

/* A memory allocation node holds its bytes (the driver backs it by the first launch) until it is destroyed. */
VC_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                          size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    if (VC_LIKELY(!vc_limited()) || phGraphNode == NULL || nodeParams == NULL || nodeParams->bytesize == 0)
        return REAL_CU(cuGraphAddMemAllocNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    RESERVED(nodeParams->bytesize,
             REAL_CU(cuGraphAddMemAllocNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams),
             (uintptr_t)*phGraphNode, REC_GNODE, (uint64_t)(uintptr_t)hGraph);
}

/* The generic node API (CUDA 12.2+) can add the same allocation nodes. */
VC_EXPORT CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                  size_t numDependencies, CUgraphNodeParams *nodeParams)
{
    if (VC_LIKELY(!vc_limited()) || phGraphNode == NULL || nodeParams == NULL ||
        nodeParams->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC || nodeParams->alloc.bytesize == 0)
        return REAL_CU(cuGraphAddNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    RESERVED(nodeParams->alloc.bytesize,
             REAL_CU(cuGraphAddNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams),
             (uintptr_t)*phGraphNode, REC_GNODE, (uint64_t)(uintptr_t)hGraph);
}

VC_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                     const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                     CUgraphNodeParams *nodeParams)
{
    if (VC_LIKELY(!vc_limited()) || phGraphNode == NULL || nodeParams == NULL ||
        nodeParams->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC || nodeParams->alloc.bytesize == 0)
        return REAL_CU(cuGraphAddNode_v2)(phGraphNode, hGraph, dependencies, dependencyData, numDependencies,
                                          nodeParams);
    RESERVED(nodeParams->alloc.bytesize,
             REAL_CU(cuGraphAddNode_v2)(phGraphNode, hGraph, dependencies, dependencyData, numDependencies,
                                        nodeParams),
             (uintptr_t)*phGraphNode, REC_GNODE, (uint64_t)(uintptr_t)hGraph);
}

VC_EXPORT CUresult cuGraphDestroyNode(CUgraphNode hNode)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuGraphDestroyNode)(hNode);
    struct vc_map_entry e;
    bool had = take((uint64_t)(uintptr_t)hNode, REC_GNODE, &e);
    return settle(REAL_CU(cuGraphDestroyNode)(hNode), had, &e);
}

static bool in_graph(const struct vc_map_entry *e, void *graph)
{
    return e->aux == (uint64_t)(uintptr_t)graph;
}

static void release_entry(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    vc_budget_release(e->size);
}

VC_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    CUresult rc = REAL_CU(cuGraphDestroy)(hGraph);
    if (VC_LIKELY(!vc_limited()) || rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_mu);
    vc_map_remove_if(&g_recs, REC_GNODE, in_graph, release_entry, hGraph);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* ---- what the container sees ----------------------------------------------------------------- */

/* total = min(limit, physical), free = max(0, min(total - used, physically free)). */
static void container_view(uint64_t *free_bytes, uint64_t *total_bytes)
{
    uint64_t limit = vc_limit_bytes(), used = vc_budget_used();
    uint64_t total = *total_bytes < limit ? *total_bytes : limit;
    uint64_t free_b = total > used ? total - used : 0;
    *free_bytes = free_b < *free_bytes ? free_b : *free_bytes;
    *total_bytes = total;
}

VC_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    CUresult rc = REAL_CU(cuMemGetInfo_v2)(free, total);
    if (VC_LIKELY(!vc_limited()) || rc != CUDA_SUCCESS)
        return rc;
    uint64_t f = *free, t = *total;
    container_view(&f, &t);
    *free = (size_t)f;
    *total = (size_t)t;
    return rc;
}

VC_EXPORT CUresult cuMemGetInfo(unsigned int *free, unsigned int *total)
{
    if (VC_LIKELY(!vc_limited()) || free == NULL || total == NULL)
        return REAL_CU(cuMemGetInfo)(free, total);
    size_t f, t;
    CUresult rc = REAL_CU(cuMemGetInfo_v2)(&f, &t);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t f64 = f, t64 = t;
    container_view(&f64, &t64);
    *free = f64 > UINT32_MAX ? UINT32_MAX : (unsigned)f64;
    *total = t64 > UINT32_MAX ? UINT32_MAX : (unsigned)t64;
    return rc;
}

VC_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = REAL_CU(cuDeviceTotalMem_v2)(bytes, dev);
    if (VC_LIKELY(!vc_limited()) || rc != CUDA_SUCCESS)
        return rc;
    if (*bytes > vc_limit_bytes())
        *bytes = (size_t)vc_limit_bytes();
    return rc;
}

VC_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    CUresult rc = REAL_CU(cuDeviceTotalMem)(bytes, dev);
    if (VC_LIKELY(!vc_limited()) || rc != CUDA_SUCCESS)
        return rc;
    if (*bytes > vc_limit_bytes())
        *bytes = (unsigned)vc_limit_bytes();
    return rc;
}

/* NVML: total = min(limit, physical), used = the container's, free = total - used (never negative). */
static void nvml_view(unsigned long long *total, unsigned long long *used, unsigned long long *free_bytes)
{
    uint64_t limit = vc_limit_bytes(), u = vc_budget_used();
    uint64_t t = *total < limit ? *total : limit;
    *total = t;
    *used = u < t ? u : t;
    *free_bytes = t - *used;
}

VC_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t rc = REAL_NVML(nvmlDeviceGetMemoryInfo)(device, memory);
    if (VC_LIKELY(!vc_limited()) || rc != NVML_SUCCESS)
        return rc;
    nvml_view(&memory->total, &memory->used, &memory->free);
    return rc;
}

VC_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlReturn_t rc = REAL_NVML(nvmlDeviceGetMemoryInfo_v2)(device, memory);
    if (VC_LIKELY(!vc_limited()) || rc != NVML_SUCCESS)
        return rc;
    memory->reserved = 0;
    nvml_view(&memory->total, &memory->used, &memory->free);
    return rc;
}

/* ---- cuGetProcAddress: the driver answers, we swap its answer for our hook ------------------------ */

VC_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    CUresult rc = REAL_CU(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (VC_LIKELY(!vc_limited() && !vc_core_limited()) || rc != CUDA_SUCCESS || pfn == NULL || *pfn == NULL)
        return rc;
    *pfn = vc_swap_proc(*pfn);
    return rc;
}

VC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    CUresult rc = REAL_CU(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (VC_LIKELY(!vc_limited() && !vc_core_limited()) || rc != CUDA_SUCCESS || pfn == NULL || *pfn == NULL)
        return rc;
    *pfn = vc_swap_proc(*pfn);
    return rc;
}
