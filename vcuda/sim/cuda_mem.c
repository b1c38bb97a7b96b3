/*
 * Simulated libcuda: device memory.  Every allocation path charges the
 * allocating process's (pid, gpu) entry of the state file's PROCS table, so
 * NVML (simulated) reports per-process and free memory consistently, and an
 * allocation that would exceed the GPU's memory (all processes together)
 * fails with CUDA_ERROR_OUT_OF_MEMORY.  Device addresses are fake (never
 * dereferenced): a bump allocator per GPU in this process.
 *
 * Also here: streams, events, modules and launches (simulated GPU time: each
 * kernel occupies the GPU for a duration from the cost model, see
 * kernel_ns(); sim_timeline.c runs the shared per-GPU timeline), memory pools,
 * VMM and graphs with memory and kernel nodes.
 */
#include "cuda_sim.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_timeline.h"
#include "vc_map.h"
#include "vc_proc.h"

/* ---- this process's identity in the state file --------------------------- */

/* (start_time << 22) | pid of this process, computed once per pid (a forked child recomputes). */
static _Atomic uint64_t g_self;

static void self_identity(uint32_t *pid, uint64_t *start)
{
    uint32_t me = (uint32_t)getpid();
    uint64_t v = atomic_load_explicit(&g_self, memory_order_relaxed);
    if (v == 0 || (v & 0x3FFFFFu) != me) {
        v = (vc_proc_start_time((int)me) << 22) | me;
        atomic_store_explicit(&g_self, v, memory_order_relaxed);
    }
    *pid = me;
    *start = v >> 22;
}

/* ---- accounting in the state file ----------------------------------------- */

static uint64_t gpu_total(const struct sim_node *n, unsigned gpu)
{
    return n->spec->gpus[gpu].memory_mib * SIM_MIB;
}

/* Sum over the GPU's entries and this process's entry (or NULL); caller holds the state lock. */
static uint64_t scan_gpu(struct sim_state *st, unsigned gpu, uint32_t pid, uint64_t start, struct gpusim_proc **mine,
                         struct gpusim_proc **free_slot)
{
    uint64_t used = 0;
    unsigned cap = sim_state_proc_capacity(st);
    *mine = NULL;
    if (free_slot != NULL)
        *free_slot = NULL;
    for (unsigned s = 0; s < cap; s++) {
        struct gpusim_proc *p = sim_state_proc(st, s);
        if (!(p->flags & GPUSIM_PROC_IN_USE)) {
            if (free_slot != NULL && *free_slot == NULL)
                *free_slot = p;
            continue;
        }
        if (p->gpu != gpu)
            continue;
        used += p->used_bytes;
        if (p->pid == pid && (p->flags & GPUSIM_PROC_CUDA) && (p->owner_start == start || start == 0))
            *mine = p;
    }
    return used;
}

CUresult sim_mem_charge(unsigned gpu, uint64_t bytes)
{
    const struct sim_node *n = sim_cu_node();
    if (n == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    uint32_t pid;
    uint64_t start;
    self_identity(&pid, &start);
    uint64_t total = gpu_total(n, gpu);
    if (sim_state_lock(n->state) != 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    struct gpusim_proc *mine, *slot;
    uint64_t used = scan_gpu(n->state, gpu, pid, start, &mine, &slot);
    if ((used > total || bytes > total - used || (mine == NULL && slot == NULL)) && sim_state_reap_dead(n->state) > 0)
        used = scan_gpu(n->state, gpu, pid, start, &mine, &slot);
    CUresult rc = CUDA_SUCCESS;
    if (used > total || bytes > total - used || (mine == NULL && slot == NULL)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        if (mine == NULL) {
            mine = slot;
            memset(mine, 0, sizeof(*mine));
            mine->pid = pid;
            mine->gpu = gpu;
            mine->owner_start = start;
            mine->flags = GPUSIM_PROC_IN_USE | GPUSIM_PROC_CUDA;
        }
        mine->used_bytes += bytes;
        mine->updated_us = sim_now_us();
        sim_state_touch(n->state);
    }
    sim_state_unlock(n->state);
    return rc;
}

void sim_mem_uncharge(unsigned gpu, uint64_t bytes)
{
    const struct sim_node *n = sim_cu_node();
    if (n == NULL || bytes == 0)
        return;
    uint32_t pid;
    uint64_t start;
    self_identity(&pid, &start);
    if (sim_state_lock(n->state) != 0)
        return;
    struct gpusim_proc *mine;
    scan_gpu(n->state, gpu, pid, start, &mine, NULL);
    if (mine != NULL) {
        mine->used_bytes -= bytes < mine->used_bytes ? bytes : mine->used_bytes;
        mine->updated_us = sim_now_us();
        if (mine->used_bytes == 0 && mine->sm_util == 0 && mine->mem_util == 0)
            memset(mine, 0, sizeof(*mine)); /* nothing left on this GPU */
        sim_state_touch(n->state);
    }
    sim_state_unlock(n->state);
}

void sim_mem_info(unsigned gpu, uint64_t *free_bytes, uint64_t *total_bytes)
{
    const struct sim_node *n = sim_cu_node();
    *total_bytes = gpu_total(n, gpu);
    uint64_t used = 0;
    if (sim_state_lock(n->state) == 0) {
        sim_state_reap_dead(n->state);
        struct gpusim_proc *mine;
        used = scan_gpu(n->state, gpu, 0, 0, &mine, NULL);
        sim_state_unlock(n->state);
    }
    *free_bytes = used >= *total_bytes ? 0 : *total_bytes - used;
}

/* ---- fake addresses ---------------------------------------------------------- */

#define VA_RANGES (GPUSIM_MAX_GPUS + 2)
#define VA_RESERVE_RANGE GPUSIM_MAX_GPUS  /* cuMemAddressReserve */
#define VA_LEGACY_RANGE (GPUSIM_MAX_GPUS + 1) /* 32-bit addresses of the CUDA 2.0 ABI */
static _Atomic uint64_t g_va_next[VA_RANGES];

uint64_t sim_va_alloc(unsigned range, uint64_t size, uint64_t align)
{
    uint64_t base = range == VA_LEGACY_RANGE ? 0x10000000ull : (uint64_t)(range + 1) << 44;
    uint64_t limit = range == VA_LEGACY_RANGE ? 0xF0000000ull - base : 1ull << 44;
    if (align < SIM_ALLOC_ALIGN)
        align = SIM_ALLOC_ALIGN;
    uint64_t step = (size + SIM_ALLOC_ALIGN - 1) / SIM_ALLOC_ALIGN * SIM_ALLOC_ALIGN;
    uint64_t cur = atomic_load(&g_va_next[range]), start;
    do {
        start = (cur + align - 1) / align * align;
        if (start > limit || step > limit - start)
            return 0;
    } while (!atomic_compare_exchange_weak(&g_va_next[range], &cur, start + step));
    return base + start;
}

/* ---- process-local records ---------------------------------------------------- */

enum rec_kind {
    REC_DEV = 1,   /* cuMemAlloc*, pitch, managed, async: key = address */
    REC_LEGACY,    /* CUDA 2.0 ABI cuMemAlloc: key = 32-bit address */
    REC_HOST,      /* page-locked host memory: key = pointer */
    REC_ARRAY,     /* key = CUarray */
    REC_MIPMAP,    /* key = CUmipmappedArray */
    REC_VMM,       /* key = CUmemGenericAllocationHandle; gpu = UINT32_MAX for host memory */
    REC_VA,        /* reserved address range: key = start */
    REC_POOL,      /* key = CUmemoryPool */
    REC_STREAM,    /* key = CUstream */
    REC_MODULE,    /* key = CUmodule */
    REC_FUNCTION,  /* key = CUfunction, aux = module */
    REC_GRAPH,     /* key = CUgraph */
    REC_GNODE,     /* key = CUgraphNode, aux = graph, size = bytes of a memory allocation node */
    REC_GEXEC,     /* key = CUgraphExec */
};

#define NO_GPU UINT32_MAX

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* guards g_recs and the pools below */
static struct vc_map g_recs;
static uint64_t g_graph_mem[GPUSIM_MAX_GPUS]; /* bytes of live graph allocation nodes, per GPU */

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
    /* The child owns none of the parent's device memory. */
    vc_map_reset(&g_recs);
    memset(g_graph_mem, 0, sizeof(g_graph_mem));
    pthread_mutex_init(&g_mu, NULL);
}

__attribute__((constructor)) static void mem_init(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

static int put(uint64_t key, enum rec_kind kind, unsigned gpu, uint64_t size, uint64_t aux)
{
    struct vc_map_entry e = {.key = key, .kind = kind, .gpu = gpu, .size = size, .aux = aux};
    pthread_mutex_lock(&g_mu);
    int rc = vc_map_put(&g_recs, &e);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static bool find(uint64_t key, enum rec_kind kind, struct vc_map_entry *out, bool take)
{
    if (key == 0)
        return false;
    pthread_mutex_lock(&g_mu);
    bool hit = vc_map_find(&g_recs, key, kind, out, take);
    pthread_mutex_unlock(&g_mu);
    return hit;
}

/* Charges gpu, takes an address in range, records it; on any failure nothing stays charged. */
static CUresult device_alloc(CUdeviceptr *dptr, uint64_t bytes, unsigned gpu, unsigned range, enum rec_kind kind)
{
    CUresult rc = sim_mem_charge(gpu, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t va = sim_va_alloc(range, bytes, SIM_ALLOC_ALIGN);
    if (va == 0 || put(va, kind, gpu, bytes, 0) != 0) {
        sim_mem_uncharge(gpu, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)va;
    return CUDA_SUCCESS;
}

static CUresult device_free(uint64_t va, enum rec_kind kind)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (va == 0)
        return CUDA_SUCCESS;
    if (!find(va, kind, &e, true))
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_uncharge(e.gpu, e.size);
    return CUDA_SUCCESS;
}

/* ---- cuMemAlloc family ---------------------------------------------------------- */

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return device_alloc(dptr, bytesize, (unsigned)dev, (unsigned)dev, REC_DEV);
}

SIM_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    int dev;
    CUdeviceptr p;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    rc = device_alloc(&p, bytesize, (unsigned)dev, VA_LEGACY_RANGE, REC_LEGACY);
    if (rc == CUDA_SUCCESS)
        *dptr = (CUdeviceptr_v1)p;
    return rc;
}

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    return device_free(dptr, REC_DEV);
}

SIM_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    return device_free(dptr, REC_LEGACY);
}

static CUresult alloc_pitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned elem,
                            unsigned range, enum rec_kind kind)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == NULL || pitch == NULL || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t p = (width + SIM_ALLOC_ALIGN - 1) / SIM_ALLOC_ALIGN * SIM_ALLOC_ALIGN;
    if (height > SIZE_MAX / p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    rc = device_alloc(dptr, (uint64_t)p * height, (unsigned)dev, range == NO_GPU ? (unsigned)dev : range, kind);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                       unsigned int ElementSizeBytes)
{
    return alloc_pitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, NO_GPU, REC_DEV);
}

SIM_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                    unsigned int Height, unsigned int ElementSizeBytes)
{
    CUdeviceptr p;
    size_t pitch;
    if (dptr == NULL || pPitch == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_pitch(&p, &pitch, WidthInBytes, Height, ElementSizeBytes, VA_LEGACY_RANGE, REC_LEGACY);
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pPitch = (unsigned)pitch;
    }
    return rc;
}

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == NULL || bytesize == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    return device_alloc(dptr, bytesize, (unsigned)dev, (unsigned)dev, REC_DEV);
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (free == NULL || total == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t f, t;
    sim_mem_info((unsigned)dev, &f, &t);
    *free = (size_t)f;
    *total = (size_t)t;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetInfo(unsigned int *free, unsigned int *total)
{
    size_t f, t;
    if (free == NULL || total == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        *free = f > UINT32_MAX ? UINT32_MAX : (unsigned)f;
        *total = t > UINT32_MAX ? UINT32_MAX : (unsigned)t;
    }
    return rc;
}

/* ---- host memory (not device memory: never charged) ------------------------------ */

static CUresult host_alloc(void **pp, size_t bytesize)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pp == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = calloc(1, bytesize);
    if (p == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (put((uint64_t)(uintptr_t)p, REC_HOST, NO_GPU, bytesize, 0) != 0) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return host_alloc(pp, bytesize);
}

SIM_EXPORT CUresult cuMemAllocHost(void **pp, unsigned int bytesize)
{
    return host_alloc(pp, bytesize);
}

SIM_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    if (Flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED))
        return CUDA_ERROR_INVALID_VALUE;
    return host_alloc(pp, bytesize);
}

SIM_EXPORT CUresult cuMemFreeHost(void *p)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)p, REC_HOST, NULL, true))
        return CUDA_ERROR_INVALID_VALUE;
    free(p);
    return CUDA_SUCCESS;
}

/* ---- arrays ------------------------------------------------------------------------ */

struct sim_array {
    uint64_t size;
    unsigned gpu;
};

static unsigned format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 4;
    }
}

/* Bytes of one array level: rows padded to the pitch alignment. 0 for an invalid description. */
static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels)
{
    if (w == 0 || (channels != 1 && channels != 2 && channels != 4))
        return 0;
    uint64_t row = (uint64_t)w * format_bytes(f) * channels;
    row = (row + SIM_ALLOC_ALIGN - 1) / SIM_ALLOC_ALIGN * SIM_ALLOC_ALIGN;
    return row * (h ? h : 1) * (d ? d : 1);
}

static CUresult array_create(void **handle, uint64_t bytes, enum rec_kind kind)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (handle == NULL || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_array *a = malloc(sizeof(*a));
    if (a == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *a = (struct sim_array){.size = bytes, .gpu = (unsigned)dev};
    rc = sim_mem_charge((unsigned)dev, bytes);
    if (rc == CUDA_SUCCESS && put((uint64_t)(uintptr_t)a, kind, (unsigned)dev, bytes, 0) != 0) {
        sim_mem_uncharge((unsigned)dev, bytes);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    *handle = a;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (d == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create((void **)pHandle, array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels), REC_ARRAY);
}

SIM_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (d == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create((void **)pHandle, array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels), REC_ARRAY);
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (d == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create((void **)pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                        REC_ARRAY);
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (d == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create((void **)pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                        REC_ARRAY);
}

SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                           unsigned int numMipmapLevels)
{
    if (d == NULL || numMipmapLevels == 0 || numMipmapLevels > 32)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = 0;
    for (unsigned l = 0; l < numMipmapLevels; l++) {
        size_t w = d->Width >> l, h = d->Height >> l, dd = d->Depth >> l;
        uint64_t b = array_bytes(w ? w : 1, d->Height ? (h ? h : 1) : 0, d->Depth ? (dd ? dd : 1) : 0, d->Format,
                                 d->NumChannels);
        if (b == 0)
            return CUDA_ERROR_INVALID_VALUE;
        bytes += b;
    }
    return array_create((void **)pHandle, bytes, REC_MIPMAP);
}

static CUresult array_destroy(void *handle, enum rec_kind kind)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)handle, kind, &e, true))
        return CUDA_ERROR_INVALID_HANDLE;
    sim_mem_uncharge(e.gpu, e.size);
    free(handle);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    return array_destroy(hArray, REC_ARRAY);
}

SIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    return array_destroy(hMipmappedArray, REC_MIPMAP);
}

static CUresult array_requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *req, void *handle, enum rec_kind kind,
                                   CUdevice device)
{
    struct vc_map_entry e;
    const struct sim_node *n;
    CUresult rc = sim_cu_device(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (req == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!find((uint64_t)(uintptr_t)handle, kind, &e, false))
        return CUDA_ERROR_INVALID_HANDLE;
    memset(req, 0, sizeof(*req));
    req->size = e.size;
    req->alignment = SIM_ALLOC_ALIGN;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements, CUarray array,
                                                 CUdevice device)
{
    return array_requirements(memoryRequirements, array, REC_ARRAY, device);
}

SIM_EXPORT CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements,
                                                          CUmipmappedArray mipmap, CUdevice device)
{
    return array_requirements(memoryRequirements, mipmap, REC_MIPMAP, device);
}

/* ---- virtual memory management -------------------------------------------------------- */

struct sim_vmm {
    CUmemAllocationProp prop;
    uint64_t size;
};

static CUresult check_prop(const CUmemAllocationProp *prop, unsigned *gpu)
{
    if (prop == NULL || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        const struct sim_node *n;
        CUresult rc = sim_cu_device(prop->location.id, &n);
        if (rc != CUDA_SUCCESS)
            return rc == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_VALUE : rc;
        *gpu = (unsigned)prop->location.id;
        return CUDA_SUCCESS;
    }
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    *gpu = NO_GPU; /* host memory (e.g. NCCL's host cuMemCreate) */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option)
{
    unsigned gpu;
    (void)option;
    if (granularity == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_prop(prop, &gpu);
    if (rc == CUDA_SUCCESS)
        *granularity = SIM_VMM_GRANULARITY;
    return rc;
}

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    unsigned gpu;
    if (handle == NULL || flags != 0 || size == 0 || size % SIM_VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_prop(prop, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_vmm *m = malloc(sizeof(*m));
    if (m == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *m = (struct sim_vmm){.prop = *prop, .size = size};
    if (gpu != NO_GPU)
        rc = sim_mem_charge(gpu, size);
    if (rc == CUDA_SUCCESS && put((uint64_t)(uintptr_t)m, REC_VMM, gpu, size, 0) != 0) {
        if (gpu != NO_GPU)
            sim_mem_uncharge(gpu, size);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc != CUDA_SUCCESS) {
        free(m);
        return rc;
    }
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)m;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find(handle, REC_VMM, &e, true))
        return CUDA_ERROR_INVALID_VALUE;
    if (e.gpu != NO_GPU)
        sim_mem_uncharge(e.gpu, e.size);
    free((void *)(uintptr_t)handle);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle)
{
    if (prop == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!find(handle, REC_VMM, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    *prop = ((const struct sim_vmm *)(uintptr_t)handle)->prop;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags)
{
    (void)addr; /* a hint */
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == NULL || flags != 0 || size == 0 || size % SIM_VMM_GRANULARITY != 0 ||
        (alignment & (alignment - 1)) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t va = sim_va_alloc(VA_RESERVE_RANGE, size, alignment > SIM_VMM_GRANULARITY ? alignment : SIM_VMM_GRANULARITY);
    if (va == 0 || put(va, REC_VA, NO_GPU, size, 0) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)va;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find(ptr, REC_VA, &e, false) || e.size != size)
        return CUDA_ERROR_INVALID_VALUE;
    find(ptr, REC_VA, NULL, true);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == 0 || size == 0 || flags != 0 || !find(handle, REC_VMM, &e, false) || offset > e.size ||
        size > e.size - offset)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    return ptr == 0 || size == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    return ptr == 0 || size == 0 || desc == NULL || count == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* ---- streams --------------------------------------------------------------------------- */

struct sim_stream {
    int device;
    _Atomic uint64_t upto; /* sim_tl upto of its last kernel (0 = none) */
};

static CUresult stream_create(CUstream *ph)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (ph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s = malloc(sizeof(*s));
    if (s == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->device = dev;
    atomic_init(&s->upto, 0);
    if (put((uint64_t)(uintptr_t)s, REC_STREAM, (unsigned)dev, 0, 0) != 0) {
        free(s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ph = (CUstream)s;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    if (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
        return CUDA_ERROR_INVALID_VALUE;
    return stream_create(phStream);
}

SIM_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    (void)priority;
    if (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
        return CUDA_ERROR_INVALID_VALUE;
    return stream_create(phStream);
}

static CUresult stream_destroy(CUstream s)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)s, REC_STREAM, NULL, true))
        return CUDA_ERROR_INVALID_HANDLE;
    free(s);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    return stream_destroy(hStream);
}

SIM_EXPORT CUresult cuStreamDestroy(CUstream hStream)
{
    return stream_destroy(hStream);
}

static bool special_stream(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

/* The device work on stream s goes to: its own, or the current context's for the special streams. */
static CUresult stream_device(CUstream s, unsigned *gpu)
{
    int dev;
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
        CUresult rc = sim_cu_current_device(&dev);
        if (rc != CUDA_SUCCESS)
            return rc;
        *gpu = (unsigned)dev;
        return CUDA_SUCCESS;
    }
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)s, REC_STREAM, &e, false))
        return CUDA_ERROR_INVALID_HANDLE;
    *gpu = e.gpu;
    return CUDA_SUCCESS;
}

/*
 * What waiting for stream s means: kernels before *upto of this process on
 * *gpu.  A process's kernels on one GPU run in submission order (one FIFO, see
 * sim_timeline.h), so a special stream (NULL, legacy, per-thread) waits for
 * everything the process queued on the GPU, a created stream for its own last
 * kernel.
 */
static CUresult stream_upto(CUstream s, unsigned *gpu, uint64_t *upto)
{
    CUresult rc = stream_device(s, gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    const struct sim_node *n = sim_cu_node();
    *upto = special_stream(s) ? sim_tl_tail(n->state, *gpu)
                              : atomic_load(&((struct sim_stream *)(void *)s)->upto);
    return CUDA_SUCCESS;
}

static void stream_mark(CUstream s, uint64_t upto)
{
    if (!special_stream(s))
        atomic_store(&((struct sim_stream *)(void *)s)->upto, upto);
}

static CUresult stream_sync(CUstream s)
{
    unsigned gpu;
    uint64_t upto;
    CUresult rc = stream_upto(s, &gpu, &upto);
    if (rc == CUDA_SUCCESS)
        sim_tl_wait(sim_cu_node()->state, gpu, upto);
    return rc;
}

static CUresult stream_query(CUstream s)
{
    unsigned gpu;
    uint64_t upto;
    CUresult rc = stream_upto(s, &gpu, &upto);
    if (rc == CUDA_SUCCESS && !sim_tl_done(sim_cu_node()->state, gpu, upto, NULL))
        rc = CUDA_ERROR_NOT_READY;
    return rc;
}

SIM_EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    return stream_sync(hStream);
}

SIM_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    return stream_sync(hStream);
}

SIM_EXPORT CUresult cuStreamQuery(CUstream hStream)
{
    return stream_query(hStream);
}

SIM_EXPORT CUresult cuStreamQuery_ptsz(CUstream hStream)
{
    return stream_query(hStream);
}

/* Kernels of one process on one GPU run in order, so cross-stream waits are met by construction. */
static CUresult stream_wait_event(CUstream s, CUevent e)
{
    unsigned gpu;
    CUresult rc = stream_device(s, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    return e == NULL ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    (void)Flags;
    return stream_wait_event(hStream, hEvent);
}

SIM_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    (void)Flags;
    return stream_wait_event(hStream, hEvent);
}

/* The current context's device: every kernel this process queued there. */
SIM_EXPORT CUresult cuCtxSynchronize(void)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc == CUDA_SUCCESS)
        sim_tl_wait(sim_cu_node()->state, (unsigned)dev, sim_tl_tail(sim_cu_node()->state, (unsigned)dev));
    return rc;
}

/* ---- events ------------------------------------------------------------------------------ */

#define SIM_EVENT_MAGIC 0x45565453u

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    unsigned gpu;
    bool recorded;
    uint64_t upto;    /* kernels it waits for */
    uint64_t rec_ns;  /* when it was recorded (CLOCK_MONOTONIC) */
    uint64_t end_ns;  /* its completion time once seen complete, else 0 */
};

static bool event_valid(CUevent e)
{
    return e != NULL && e->magic == SIM_EVENT_MAGIC;
}

SIM_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (phEvent == NULL || (Flags & ~0xFu))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *e = (struct CUevent_st){.magic = SIM_EVENT_MAGIC, .flags = Flags, .gpu = (unsigned)dev};
    *phEvent = e;
    return CUDA_SUCCESS;
}

static CUresult event_destroy(CUevent e)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_valid(e))
        return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventDestroy(CUevent hEvent)
{
    return event_destroy(hEvent);
}

SIM_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent)
{
    return event_destroy(hEvent);
}

static CUresult event_record(CUevent e, CUstream s)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_valid(e))
        return CUDA_ERROR_INVALID_HANDLE;
    unsigned gpu;
    uint64_t upto;
    CUresult rc = stream_upto(s, &gpu, &upto);
    if (rc != CUDA_SUCCESS)
        return rc;
    e->gpu = gpu;
    e->upto = upto;
    e->rec_ns = sim_mono_ns();
    e->end_ns = upto == 0 ? e->rec_ns : 0; /* nothing before it: complete at once */
    e->recorded = true;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    return event_record(hEvent, hStream);
}

SIM_EXPORT CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    return event_record(hEvent, hStream);
}

SIM_EXPORT CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    (void)flags;
    return event_record(hEvent, hStream);
}

SIM_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    (void)flags;
    return event_record(hEvent, hStream);
}

/* Whether e completed (a never-recorded event counts as complete); notes its completion time. */
static bool event_done(CUevent e)
{
    if (!e->recorded || e->end_ns != 0)
        return true;
    uint64_t end;
    if (!sim_tl_done(sim_cu_node()->state, e->gpu, e->upto, &end))
        return false;
    e->end_ns = end > e->rec_ns ? end : e->rec_ns;
    return true;
}

SIM_EXPORT CUresult cuEventQuery(CUevent hEvent)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_valid(hEvent))
        return CUDA_ERROR_INVALID_HANDLE;
    return event_done(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_valid(hEvent))
        return CUDA_ERROR_INVALID_HANDLE;
    if (hEvent->recorded)
        sim_tl_wait(sim_cu_node()->state, hEvent->gpu, hEvent->upto);
    event_done(hEvent);
    return CUDA_SUCCESS;
}

static CUresult elapsed(float *ms, CUevent a, CUevent b)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ms == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!event_valid(a) || !event_valid(b) || (a->flags & CU_EVENT_DISABLE_TIMING) ||
        (b->flags & CU_EVENT_DISABLE_TIMING) || !a->recorded || !b->recorded)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!event_done(a) || !event_done(b))
        return CUDA_ERROR_NOT_READY;
    *ms = (float)(((double)b->end_ns - (double)a->end_ns) / 1e6);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return elapsed(pMilliseconds, hStart, hEnd);
}

SIM_EXPORT CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return elapsed(pMilliseconds, hStart, hEnd);
}

/* ---- memory pools and stream-ordered allocation ------------------------------------------ */

struct sim_pool {
    unsigned gpu;
};

static struct sim_pool g_default_pool[GPUSIM_MAX_GPUS];
static CUmemoryPool g_current_pool[GPUSIM_MAX_GPUS]; /* under g_mu; NULL = default */

static bool pool_gpu(CUmemoryPool pool, unsigned *gpu)
{
    uintptr_t p = (uintptr_t)pool, base = (uintptr_t)&g_default_pool[0];
    if (p >= base && p < base + sizeof(g_default_pool) && (p - base) % sizeof(g_default_pool[0]) == 0) {
        *gpu = (unsigned)((p - base) / sizeof(g_default_pool[0]));
        return true;
    }
    struct vc_map_entry e;
    if (!find(p, REC_POOL, &e, false))
        return false;
    *gpu = e.gpu;
    return true;
}

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    const struct sim_node *n;
    if (pool_out == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc == CUDA_SUCCESS)
        *pool_out = (CUmemoryPool)&g_default_pool[dev];
    return rc;
}

SIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    const struct sim_node *n;
    if (pool == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_mu);
    *pool = g_current_pool[dev] ? g_current_pool[dev] : (CUmemoryPool)&g_default_pool[dev];
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    const struct sim_node *n;
    unsigned gpu;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pool_gpu(pool, &gpu) || gpu != (unsigned)dev)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    g_current_pool[dev] = pool;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    const struct sim_node *n;
    if (pool == NULL || poolProps == NULL || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(poolProps->location.id, &n);
    if (rc != CUDA_SUCCESS)
        return rc == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_VALUE : rc;
    struct sim_pool *p = malloc(sizeof(*p));
    if (p == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->gpu = (unsigned)poolProps->location.id;
    if (put((uint64_t)(uintptr_t)p, REC_POOL, p->gpu, 0, 0) != 0) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)pool, REC_POOL, NULL, true))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (unsigned i = 0; i < GPUSIM_MAX_GPUS; i++)
        if (g_current_pool[i] == pool)
            g_current_pool[i] = NULL;
    pthread_mutex_unlock(&g_mu);
    free(pool);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    unsigned gpu;
    (void)minBytesToKeep;
    return pool_gpu(pool, &gpu) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    unsigned gpu;
    (void)attr;
    return pool_gpu(pool, &gpu) && value != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    unsigned gpu;
    if (!pool_gpu(pool, &gpu) || value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (attr == CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES || attr == CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC ||
        attr == CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES)
        *(int *)value = 1;
    else
        *(cuuint64_t *)value = 0;
    return CUDA_SUCCESS;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    unsigned gpu, pgpu;
    CUresult rc = stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (pool != NULL) {
        if (!pool_gpu(pool, &pgpu))
            return CUDA_ERROR_INVALID_VALUE;
        gpu = pgpu;
    }
    return device_alloc(dptr, bytesize, gpu, gpu, REC_DEV);
}

SIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, NULL, hStream);
}

SIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, NULL, hStream);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    if (pool == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, bytesize, pool, hStream);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                 CUstream hStream)
{
    if (pool == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, bytesize, pool, hStream);
}

static CUresult free_async(CUdeviceptr dptr, CUstream stream)
{
    unsigned gpu;
    CUresult rc = stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return device_free(dptr, REC_DEV);
}

SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream);
}

SIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream);
}

/* ---- modules and launches (accepted; no GPU time yet) ------------------------------------ */

struct sim_module {
    int device;
};
struct sim_function {
    CUmodule module;
    uint64_t named_ns; /* duration from the name ("..._<N>ns|us|ms"), 0 = the cost model */
};

/* "spin_50us" -> 50000; 0 unless the name ends in _<digits>ns, _<digits>us or _<digits>ms. */
static uint64_t duration_in_name(const char *name)
{
    size_t len = strlen(name);
    if (len < 4)
        return 0;
    const char *unit = name + len - 2;
    uint64_t scale = strcmp(unit, "ns") == 0 ? 1u : strcmp(unit, "us") == 0 ? 1000u : strcmp(unit, "ms") == 0 ? 1000000u : 0;
    if (scale == 0)
        return 0;
    const char *p = unit;
    while (p > name && p[-1] >= '0' && p[-1] <= '9')
        p--;
    if (p == unit || p == name || p[-1] != '_' || unit - p > 12)
        return 0;
    return strtoull(p, NULL, 10) * scale;
}

/* GPUSIM_KERNEL_NS: every kernel of this process (without a duration in its name) takes that long. */
static uint64_t env_kernel_ns(void)
{
    static _Atomic int64_t cached = -1;
    int64_t v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        const char *s = getenv("GPUSIM_KERNEL_NS");
        v = s != NULL ? atoll(s) : 0;
        if (v < 0)
            v = 0;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return (uint64_t)v;
}

/*
 * The cost model (vcuda/sim/README.md "Simulated GPU time"): a named duration,
 * else GPUSIM_KERNEL_NS, else threads / (sm_count x sm_threads_per_us), at
 * least 1 us.
 */
static uint64_t kernel_ns(const struct sim_function *f, unsigned gpu, uint64_t blocks, uint64_t threads_per_block)
{
    if (f != NULL && f->named_ns != 0)
        return f->named_ns;
    uint64_t env = env_kernel_ns();
    if (env != 0)
        return env;
    const struct sim_gpu_spec *g = &sim_cu_node()->spec->gpus[gpu];
    double rate = (double)g->sm_count * (double)g->sm_threads_per_us; /* threads per us */
    double ns = (double)blocks * (double)threads_per_block * 1000.0 / rate;
    return ns < 1000.0 ? 1000u : ns > 1e12 ? (uint64_t)1e12 : (uint64_t)ns;
}

static CUresult module_new(CUmodule *module)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_module *m = malloc(sizeof(*m));
    if (m == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->device = dev;
    if (put((uint64_t)(uintptr_t)m, REC_MODULE, (unsigned)dev, 0, 0) != 0) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *module = (CUmodule)m;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    if (module == NULL || image == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return module_new(module);
}

SIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                       CUjit_option *options, void **optionValues)
{
    (void)numOptions, (void)options, (void)optionValues;
    return cuModuleLoadData(module, image);
}

SIM_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return cuModuleLoadData(module, fatCubin);
}

SIM_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    struct stat sb;
    if (module == NULL || fname == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (stat(fname, &sb) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return module_new(module);
}

static bool function_of(const struct vc_map_entry *e, void *module)
{
    return e->aux == (uint64_t)(uintptr_t)module;
}

static void free_record_object(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    free((void *)(uintptr_t)e->key);
}

SIM_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)hmod, REC_MODULE, NULL, true))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    vc_map_remove_if(&g_recs, REC_FUNCTION, function_of, free_record_object, hmod);
    pthread_mutex_unlock(&g_mu);
    free(hmod);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (hfunc == NULL || name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!find((uint64_t)(uintptr_t)hmod, REC_MODULE, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    struct sim_function *f = malloc(sizeof(*f));
    if (f == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    f->module = hmod;
    f->named_ns = duration_in_name(name);
    if (put((uint64_t)(uintptr_t)f, REC_FUNCTION, 0, 0, (uint64_t)(uintptr_t)hmod) != 0) {
        free(f);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *hfunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

/* Queues dur_ns of GPU time for this process on gpu; the stream remembers it. */
static void run_on_gpu(unsigned gpu, CUstream stream, uint64_t dur_ns)
{
    uint64_t upto;
    if (sim_tl_submit(sim_cu_node()->state, gpu, dur_ns, &upto))
        stream_mark(stream, upto);
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       CUstream stream)
{
    unsigned gpu;
    CUresult rc = stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!find((uint64_t)(uintptr_t)f, REC_FUNCTION, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    run_on_gpu(gpu, stream, kernel_ns((const struct sim_function *)(void *)f, gpu, (uint64_t)gx * gy * gz,
                                      (uint64_t)bx * by * bz));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                   unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams, void **extra)
{
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                              unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                              unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                              void **kernelParams)
{
    (void)sharedMemBytes, (void)kernelParams;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                   unsigned int gridDimZ, unsigned int blockDimX,
                                                   unsigned int blockDimY, unsigned int blockDimZ,
                                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    (void)sharedMemBytes, (void)kernelParams;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

static CUresult launch_ex(const CUlaunchConfig *c, CUfunction f)
{
    if (c == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->hStream);
}

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)kernelParams, (void)extra;
    return launch_ex(config, f);
}

SIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                          void **extra)
{
    (void)kernelParams, (void)extra;
    return launch_ex(config, f);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                         unsigned int flags)
{
    (void)flags;
    if (launchParamsList == NULL || numDevices == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < numDevices; i++) {
        const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
        CUresult rc = launch(p->function, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY,
                             p->blockDimZ, p->hStream);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

/* ---- graphs with memory nodes ------------------------------------------------------------ */

/* Graphs, nodes and executable graphs; graphs and execs sum their kernel nodes' durations. */
struct sim_graph_obj {
    _Atomic uint64_t kernel_ns;
    _Atomic uint32_t kernels;
};

static CUresult new_object(void **out, enum rec_kind kind, unsigned gpu, uint64_t size, uint64_t aux)
{
    struct sim_graph_obj *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (put((uint64_t)(uintptr_t)o, kind, gpu, size, aux) != 0) {
        free(o);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = o;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (phGraph == NULL || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return new_object((void **)phGraph, REC_GRAPH, NO_GPU, 0, 0);
}

static CUresult check_graph(CUgraph g, const CUgraphNode *deps, size_t n)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)g, REC_GRAPH, NULL, false) || (n > 0 && deps == NULL))
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++)
        if (!find((uint64_t)(uintptr_t)deps[i], REC_GNODE, NULL, false))
            return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                           size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    CUresult rc = check_graph(hGraph, dependencies, numDependencies);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (phGraphNode == NULL || nodeParams == NULL || nodeParams->bytesize == 0 ||
        nodeParams->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_node *n;
    if (sim_cu_device(nodeParams->poolProps.location.id, &n) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned gpu = (unsigned)nodeParams->poolProps.location.id;
    uint64_t bytes = nodeParams->bytesize;
    /* Charged when the node is made (the driver reserves it by the first launch) until the graph goes. */
    rc = sim_mem_charge(gpu, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t va = sim_va_alloc(gpu, bytes, SIM_ALLOC_ALIGN);
    void *node = NULL;
    rc = va == 0 ? CUDA_ERROR_OUT_OF_MEMORY
                 : new_object(&node, REC_GNODE, gpu, bytes, (uint64_t)(uintptr_t)hGraph);
    if (rc != CUDA_SUCCESS) {
        sim_mem_uncharge(gpu, bytes);
        return rc;
    }
    pthread_mutex_lock(&g_mu);
    g_graph_mem[gpu] += bytes;
    pthread_mutex_unlock(&g_mu);
    nodeParams->dptr = (CUdeviceptr)va;
    *phGraphNode = (CUgraphNode)node;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                          size_t numDependencies, CUdeviceptr dptr)
{
    CUresult rc = check_graph(hGraph, dependencies, numDependencies);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (phGraphNode == NULL || dptr == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return new_object((void **)phGraphNode, REC_GNODE, NO_GPU, 0, (uint64_t)(uintptr_t)hGraph);
}

static void node_gone(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    if (e->gpu != NO_GPU) {
        g_graph_mem[e->gpu] -= e->size; /* g_mu is held by the caller */
        sim_mem_uncharge(e->gpu, e->size);
    } else if (e->size > 0) { /* a kernel node: size = its duration */
        struct sim_graph_obj *g = (struct sim_graph_obj *)(uintptr_t)e->aux;
        atomic_fetch_sub(&g->kernel_ns, e->size);
        atomic_fetch_sub(&g->kernels, 1);
    }
    free((void *)(uintptr_t)e->key);
}

static CUresult add_kernel_node(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps, CUfunction f,
                                unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz)
{
    CUresult rc = check_graph(graph, deps, ndeps);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (node == NULL || !find((uint64_t)(uintptr_t)f, REC_FUNCTION, NULL, false) || gx == 0 || gy == 0 || gz == 0 ||
        bx == 0 || by == 0 || bz == 0 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t ns = kernel_ns((const struct sim_function *)(void *)f, (unsigned)dev, (uint64_t)gx * gy * gz,
                            (uint64_t)bx * by * bz);
    rc = new_object((void **)node, REC_GNODE, NO_GPU, ns, (uint64_t)(uintptr_t)graph);
    if (rc == CUDA_SUCCESS) {
        struct sim_graph_obj *g = (struct sim_graph_obj *)(void *)graph;
        atomic_fetch_add(&g->kernel_ns, ns);
        atomic_fetch_add(&g->kernels, 1);
    }
    return rc;
}

SIM_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                         size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
    if (p == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, p->func, p->gridDimX, p->gridDimY,
                           p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ);
}

SIM_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                            size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS *p)
{
    if (p == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, p->func, p->gridDimX, p->gridDimY,
                           p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ);
}

static bool node_is(const struct vc_map_entry *e, void *node)
{
    return e->key == (uint64_t)(uintptr_t)node;
}

static bool node_of_graph(const struct vc_map_entry *e, void *graph)
{
    return e->aux == (uint64_t)(uintptr_t)graph;
}

SIM_EXPORT CUresult cuGraphDestroyNode(CUgraphNode hNode)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)hNode, REC_GNODE, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    vc_map_remove_if(&g_recs, REC_GNODE, node_is, node_gone, hNode);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)hGraph, REC_GRAPH, NULL, true))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    vc_map_remove_if(&g_recs, REC_GNODE, node_of_graph, node_gone, hGraph);
    pthread_mutex_unlock(&g_mu);
    free(hGraph);
    return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *exec, CUgraph graph)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (exec == NULL || !find((uint64_t)(uintptr_t)graph, REC_GRAPH, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = new_object((void **)exec, REC_GEXEC, NO_GPU, 0, (uint64_t)(uintptr_t)graph);
    if (rc == CUDA_SUCCESS) {
        const struct sim_graph_obj *g = (const struct sim_graph_obj *)(void *)graph;
        struct sim_graph_obj *x = (struct sim_graph_obj *)(void *)*exec;
        atomic_store(&x->kernel_ns, atomic_load(&g->kernel_ns));
        atomic_store(&x->kernels, atomic_load(&g->kernels));
    }
    return rc;
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    (void)flags;
    return instantiate(phGraphExec, hGraph);
}

SIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                       char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode, (void)logBuffer, (void)bufferSize;
    return instantiate(phGraphExec, hGraph);
}

SIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                          char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode, (void)logBuffer, (void)bufferSize;
    return instantiate(phGraphExec, hGraph);
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    CUresult rc = instantiate(phGraphExec, hGraph);
    if (instantiateParams != NULL)
        instantiateParams->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    return rc;
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    return cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams);
}

static CUresult graph_launch(CUgraphExec exec, CUstream stream)
{
    unsigned gpu;
    CUresult rc = stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!find((uint64_t)(uintptr_t)exec, REC_GEXEC, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    /* Its kernel nodes run back to back: one entry of their total duration. */
    const struct sim_graph_obj *x = (const struct sim_graph_obj *)(void *)exec;
    if (atomic_load(&x->kernels) > 0)
        run_on_gpu(gpu, stream, atomic_load(&x->kernel_ns));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraph, CUstream hStream)
{
    return graph_launch(hGraph, hStream);
}

SIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream);
}

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!find((uint64_t)(uintptr_t)hGraphExec, REC_GEXEC, NULL, true))
        return CUDA_ERROR_INVALID_VALUE;
    free(hGraphExec);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value)
{
    const struct sim_node *n;
    CUresult rc = sim_cu_device(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT:
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH:
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT:
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH:
        pthread_mutex_lock(&g_mu);
        *(cuuint64_t *)value = g_graph_mem[device];
        pthread_mutex_unlock(&g_mu);
        return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

SIM_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value)
{
    const struct sim_node *n;
    (void)attr;
    CUresult rc = sim_cu_device(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    return value == NULL ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    const struct sim_node *n;
    return sim_cu_device(device, &n);
}
