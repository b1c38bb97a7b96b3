/*
 * Simulated libcuda: copies and sets, pointer queries, host registration,
 * host functions on streams, peers, and function attributes.
 *
 * Device memory has no storage here (addresses are never dereferenced), so a
 * copy or a set moves no data: it checks its arguments as the driver does (a
 * device range must lie inside one live allocation of this process: cuMemAlloc
 * and pools, a VMM mapping, a graph allocation, an opened IPC handle) and
 * returns.  cuMemcpy and cuMemcpyAsync tell device from host addresses by the
 * same lookup (unified addressing).
 */
#include "cuda_sim.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "sim_timeline.h"
#include "vc_map.h"

/* ---- which allocation holds an address ------------------------------------------------------- */

struct lookup {
    uint64_t ptr;
    uint64_t bytes;
};

static bool holds(const struct vc_map_entry *e, void *arg)
{
    const struct lookup *l = arg;
    return l->ptr >= e->key && l->ptr - e->key < e->size && l->bytes <= e->size - (l->ptr - e->key);
}

/* The allocation that holds [ptr, ptr + bytes): true with its record in *out. */
static bool device_range(uint64_t ptr, uint64_t bytes, struct vc_map_entry *out)
{
    static const enum sim_rec_kind kinds[] = {REC_DEV, REC_LEGACY, REC_MAP, REC_GALLOC, REC_IPC, REC_MODVAR};
    struct lookup l = {ptr, bytes};
    bool hit = false;
    sim_rec_lock();
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]) && !hit; i++)
        hit = vc_map_find_if(sim_recs(), kinds[i], holds, &l, out);
    sim_rec_unlock();
    return hit;
}

static CUresult check_device(uint64_t ptr, uint64_t bytes)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (bytes == 0)
        return CUDA_SUCCESS;
    return device_range(ptr, bytes, &e) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult check_stream(CUstream s)
{
    unsigned gpu;
    return sim_stream_device(s, &gpu);
}

/* ---- copies and sets ------------------------------------------------------------------------------ */

static CUresult htod(uint64_t dst, const void *src, uint64_t n)
{
    CUresult rc = check_device(dst, n);
    return rc == CUDA_SUCCESS && n > 0 && src == NULL ? CUDA_ERROR_INVALID_VALUE : rc;
}

static CUresult dtoh(void *dst, uint64_t src, uint64_t n)
{
    CUresult rc = check_device(src, n);
    return rc == CUDA_SUCCESS && n > 0 && dst == NULL ? CUDA_ERROR_INVALID_VALUE : rc;
}

static CUresult dtod(uint64_t dst, uint64_t src, uint64_t n)
{
    CUresult rc = check_device(dst, n);
    return rc == CUDA_SUCCESS ? check_device(src, n) : rc;
}

/* Unified addressing: either side may be host memory (any address no allocation holds). */
static CUresult any(uint64_t dst, uint64_t src, uint64_t n)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    return n > 0 && (dst == 0 || src == 0) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

#define ASYNC(expr, stream)                                                                                        \
    do {                                                                                                           \
        CUresult rc_ = check_stream(stream);                                                                       \
        return rc_ == CUDA_SUCCESS ? (expr) : rc_;                                                                 \
    } while (0)

SIM_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return htod(dstDevice, srcHost, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return htod(dstDevice, srcHost, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyHtoD(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount)
{
    return htod(dstDevice, srcHost, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return dtoh(dstHost, srcDevice, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return dtoh(dstHost, srcDevice, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount)
{
    return dtoh(dstHost, srcDevice, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return dtod(dstDevice, srcDevice, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return dtod(dstDevice, srcDevice, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyDtoD(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount)
{
    return dtod(dstDevice, srcDevice, ByteCount);
}

SIM_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return any(dst, src, ByteCount);
}

SIM_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return any(dst, src, ByteCount);
}

SIM_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    ASYNC(any(dst, src, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    ASYNC(any(dst, src, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                         CUstream hStream)
{
    ASYNC(htod(dstDevice, srcHost, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                              CUstream hStream)
{
    ASYNC(htod(dstDevice, srcHost, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
{
    ASYNC(dtoh(dstHost, srcDevice, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                              CUstream hStream)
{
    ASYNC(dtoh(dstHost, srcDevice, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                         CUstream hStream)
{
    ASYNC(dtod(dstDevice, srcDevice, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                              CUstream hStream)
{
    ASYNC(dtod(dstDevice, srcDevice, ByteCount), hStream);
}

SIM_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char value, size_t N)
{
    (void)value;
    return check_device(dstDevice, (uint64_t)N * 1);
}

SIM_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char value, size_t N)
{
    (void)value;
    return check_device(dstDevice, (uint64_t)N * 1);
}

SIM_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char value, size_t N, CUstream hStream)
{
    (void)value;
    ASYNC(check_device(dstDevice, (uint64_t)N * 1), hStream);
}

SIM_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char value, size_t N, CUstream hStream)
{
    (void)value;
    ASYNC(check_device(dstDevice, (uint64_t)N * 1), hStream);
}

SIM_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short value, size_t N)
{
    (void)value;
    return check_device(dstDevice, (uint64_t)N * 2);
}

SIM_EXPORT CUresult cuMemsetD16_v2_ptds(CUdeviceptr dstDevice, unsigned short value, size_t N)
{
    (void)value;
    return check_device(dstDevice, (uint64_t)N * 2);
}

SIM_EXPORT CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short value, size_t N, CUstream hStream)
{
    (void)value;
    ASYNC(check_device(dstDevice, (uint64_t)N * 2), hStream);
}

SIM_EXPORT CUresult cuMemsetD16Async_ptsz(CUdeviceptr dstDevice, unsigned short value, size_t N, CUstream hStream)
{
    (void)value;
    ASYNC(check_device(dstDevice, (uint64_t)N * 2), hStream);
}

SIM_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int value, size_t N)
{
    (void)value;
    return check_device(dstDevice, (uint64_t)N * 4);
}

SIM_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int value, size_t N)
{
    (void)value;
    return check_device(dstDevice, (uint64_t)N * 4);
}

SIM_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int value, size_t N, CUstream hStream)
{
    (void)value;
    ASYNC(check_device(dstDevice, (uint64_t)N * 4), hStream);
}

SIM_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int value, size_t N, CUstream hStream)
{
    (void)value;
    ASYNC(check_device(dstDevice, (uint64_t)N * 4), hStream);
}

/* ---- pointer queries -------------------------------------------------------------------------------- */

SIM_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device_range(dptr, 1, &e))
        return CUDA_ERROR_NOT_FOUND;
    if (pbase != NULL)
        *pbase = e.key;
    if (psize != NULL)
        *psize = e.size;
    return CUDA_SUCCESS;
}

static CUresult pointer_attribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr)
{
    struct vc_map_entry e;
    if (data == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device_range(ptr, 1, &e))
        return CUDA_ERROR_INVALID_VALUE; /* not memory the driver knows (pageable host memory) */
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = (CUcontext)(uintptr_t)e.ctx; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned *)data = CU_MEMORYTYPE_DEVICE; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: return CUDA_ERROR_INVALID_VALUE;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = 0; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = (int)e.gpu; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = e.key; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = e.size; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = e.key; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *(CUmemoryPool *)data = e.kind == REC_DEV ? (CUmemoryPool)(uintptr_t)e.aux : NULL;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = e.kind == REC_DEV && e.aux == 0; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

SIM_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    return pointer_attribute(data, attribute, ptr);
}

SIM_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                           CUdeviceptr ptr)
{
    if (attributes == NULL || data == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < numAttributes; i++) {
        CUresult rc = pointer_attribute(data[i], attributes[i], ptr);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

/* ---- host functions on a stream: called on a driver thread once the stream's work before them is done ---- */

struct host_call {
    CUhostFn fn;
    void *data;
    struct sim_state *state;
    unsigned gpu;
    uint64_t upto;
};

static void *host_call_thread(void *arg)
{
    struct host_call *c = arg;
    sim_tl_wait(c->state, c->gpu, c->upto);
    c->fn(c->data);
    free(c);
    return NULL;
}

SIM_EXPORT CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    unsigned gpu;
    if (fn == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_stream_device(hStream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct host_call *c = malloc(sizeof(*c));
    if (c == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *c = (struct host_call){fn, userData, sim_cu_node()->state, gpu, sim_tl_tail(sim_cu_node()->state, gpu)};
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    int err = pthread_create(&t, &a, host_call_thread, c);
    pthread_attr_destroy(&a);
    if (err != 0) {
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    return cuLaunchHostFunc(hStream, fn, userData);
}

/* ---- host registration, peers, function attributes ----------------------------------------------- */

SIM_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    (void)Flags;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (p == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_find((uint64_t)(uintptr_t)p, REC_HOSTREG, NULL, false))
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    return sim_put((uint64_t)(uintptr_t)p, REC_HOSTREG, NO_GPU, bytesize, 0) == 0 ? CUDA_SUCCESS
                                                                                   : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_EXPORT CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)
{
    return cuMemHostRegister_v2(p, bytesize, Flags);
}

SIM_EXPORT CUresult cuMemHostUnregister(void *p)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    return sim_find((uint64_t)(uintptr_t)p, REC_HOSTREG, NULL, true) ? CUDA_SUCCESS
                                                                      : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

SIM_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    if (pdptr == NULL || Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_find((uint64_t)(uintptr_t)p, REC_HOSTREG, NULL, false) && !sim_find((uint64_t)(uintptr_t)p, REC_HOST, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing: the same address */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    const struct sim_node *n;
    if (canAccessPeer == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc == CUDA_SUCCESS)
        rc = sim_cu_device(peerDev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* NVLink, or PCIe up to one host bridge (the same rule as the simulated NVML's P2P status). */
    *canAccessPeer = dev != peerDev && (sim_spec_nvlink_links(n->spec, (unsigned)dev, (unsigned)peerDev) > 0 ||
                                         n->spec->topology[dev][peerDev] <= 30);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (leastPriority != NULL)
        *leastPriority = 0;
    if (greatestPriority != NULL)
        *greatestPriority = -5;
    return CUDA_SUCCESS;
}
