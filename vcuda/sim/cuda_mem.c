/*
 * Simulated libcuda: device memory.  Every allocation path charges the
 * allocating process's (pid, gpu) entry of the state file's PROCS table, so
 * NVML (simulated) reports per-process and free memory consistently, and an
 * allocation that would exceed the GPU's memory (all processes together)
 * fails with CUDA_ERROR_OUT_OF_MEMORY.  Device addresses are fake (never
 * dereferenced): a bump allocator per GPU in this process.
 *
 * Also here: the process-local records of every simulated object (shared by
 * the other cuda_*.c files), arrays, VMM, memory pools and stream-ordered
 * allocation.
 */
#include "cuda_sim.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
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
        struct gpusim_gpu *g = sim_state_gpu(n->state, gpu);
        if (g != NULL && used + bytes > g->used_peak)
            g->used_peak = used + bytes;
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

/*
 * Freed device addresses come back, as with the real driver, whose allocator hands a freed range to the
 * next allocation of that size at once (a program that allocates and frees in a loop sees one address):
 * the most recently freed ranges are kept per process, and an allocation of the same rounded size in the
 * same range takes the newest of them.  A freed pool allocation's range stays its pool's (the pool's next
 * allocations that fit take it); it comes back here with the segment the pool releases.
 */
#define VA_REUSE 4096
struct va_freed {
    uint64_t va, step;
    unsigned range;
};
static struct va_freed g_va_freed[VA_REUSE];
static unsigned g_va_nfreed;
static pthread_mutex_t g_va_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t va_step(uint64_t size)
{
    return (size + SIM_ALLOC_ALIGN - 1) / SIM_ALLOC_ALIGN * SIM_ALLOC_ALIGN;
}

/* A device allocation's range was freed: the next allocation of its size may take it. */
static void va_freed(unsigned range, uint64_t va, uint64_t size)
{
    pthread_mutex_lock(&g_va_mu);
    if (g_va_nfreed == VA_REUSE) { /* the oldest goes */
        memmove(g_va_freed, g_va_freed + 1, (VA_REUSE - 1) * sizeof(g_va_freed[0]));
        g_va_nfreed--;
    }
    g_va_freed[g_va_nfreed++] = (struct va_freed){va, va_step(size), range};
    pthread_mutex_unlock(&g_va_mu);
}

static uint64_t va_reused(unsigned range, uint64_t size, uint64_t align)
{
    uint64_t step = va_step(size), va = 0;
    pthread_mutex_lock(&g_va_mu);
    for (unsigned i = g_va_nfreed; i-- > 0;) {
        const struct va_freed *f = &g_va_freed[i];
        if (f->range == range && f->step == step && f->va % align == 0) {
            va = f->va;
            g_va_freed[i] = g_va_freed[--g_va_nfreed];
            break;
        }
    }
    pthread_mutex_unlock(&g_va_mu);
    return va;
}

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

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* guards g_recs and the pools below */
static struct vc_map g_recs;

static void atfork_prepare(void)
{
    pthread_mutex_lock(&g_mu);
}

static void atfork_parent(void)
{
    pthread_mutex_unlock(&g_mu);
}

static void pools_atfork_child(void);
static void deferred_atfork_child(void);

static void atfork_child(void)
{
    /* The child owns none of the parent's device memory. */
    vc_map_reset(&g_recs);
    sim_exec_atfork_child();
    pools_atfork_child();
    deferred_atfork_child();
    pthread_mutex_init(&g_mu, NULL);
    pthread_mutex_init(&g_va_mu, NULL);
    g_va_nfreed = 0; /* its addresses are fresh ones (it holds none of its parent's allocations) */
}

__attribute__((constructor)) static void mem_init(void)
{
    pools_atfork_child(); /* the default pools' initial state */
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

void sim_rec_lock(void)
{
    pthread_mutex_lock(&g_mu);
}

void sim_rec_unlock(void)
{
    pthread_mutex_unlock(&g_mu);
}

struct vc_map *sim_recs(void)
{
    return &g_recs;
}

int sim_put(uint64_t key, enum sim_rec_kind kind, unsigned gpu, uint64_t size, uint64_t aux)
{
    struct vc_map_entry e = {.key = key, .kind = kind, .gpu = gpu, .size = size, .aux = aux,
                             .ctx = (uint64_t)(uintptr_t)sim_cu_current()}; /* the context it belongs to */
    pthread_mutex_lock(&g_mu);
    int rc = vc_map_put(&g_recs, &e);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

bool sim_find(uint64_t key, enum sim_rec_kind kind, struct vc_map_entry *out, bool take)
{
    if (key == 0)
        return false;
    pthread_mutex_lock(&g_mu);
    bool hit = vc_map_find(&g_recs, key, kind, out, take);
    pthread_mutex_unlock(&g_mu);
    return hit;
}

/* ---- what a context takes with it ------------------------------------------------------------- */

static bool of_context(const struct vc_map_entry *e, void *ctx)
{
    return e->ctx == (uint64_t)(uintptr_t)ctx && !(e->kind == REC_DEV && e->aux != 0); /* pool memory is the device's */
}

static void freed_with_context(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    if (e->kind == REC_DEV || e->kind == REC_LEGACY || e->kind == REC_ARRAY || e->kind == REC_MIPMAP ||
        e->kind == REC_MODULE || e->kind == REC_STREAM)
        sim_mem_uncharge(e->gpu, e->size);
    if (e->kind == REC_ARRAY || e->kind == REC_MIPMAP || e->kind == REC_STREAM || e->kind == REC_MODULE ||
        e->kind == REC_EVENT)
        free((void *)(uintptr_t)e->key);
}

/* cuda.h: destroying a context (or resetting a primary one) frees every allocation made in it. */
void sim_ctx_gone(CUcontext ctx)
{
    static const enum sim_rec_kind kinds[] = {REC_DEV, REC_LEGACY, REC_ARRAY, REC_MIPMAP, REC_STREAM, REC_MODULE,
                                              REC_MODVAR, REC_EVENT};
    sim_rec_lock();
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        vc_map_remove_if(&g_recs, kinds[i], of_context, freed_with_context, ctx);
    sim_rec_unlock();
}

static bool allocation_of(const struct vc_map_entry *e, void *ctx)
{
    return e->ctx == (uint64_t)(uintptr_t)ctx;
}

struct reparent {
    CUcontext from, to;
};

static void move_entry(struct vc_map_entry *e, void *arg)
{
    const struct reparent *r = arg;
    if (allocation_of(e, r->from))
        e->ctx = (uint64_t)(uintptr_t)r->to;
}

/*
 * A green context shares its primary context's memory: what was allocated while it was current outlives it and
 * is freed with the primary context (its modules and streams go with it: sim_ctx_gone).
 */
void sim_ctx_reparent(CUcontext from, CUcontext to)
{
    static const enum sim_rec_kind kinds[] = {REC_DEV, REC_LEGACY, REC_ARRAY, REC_MIPMAP};
    struct reparent r = {from, to};
    sim_rec_lock();
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        vc_map_each(&g_recs, kinds[i], move_entry, &r);
    sim_rec_unlock();
}

/* Charges gpu, takes an address in range, records it; on any failure nothing stays charged. */
static CUresult device_alloc(CUdeviceptr *dptr, uint64_t bytes, unsigned gpu, unsigned range, enum sim_rec_kind kind)
{
    CUresult rc = sim_mem_charge(gpu, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t va = va_reused(range, bytes, SIM_ALLOC_ALIGN);
    if (va == 0)
        va = sim_va_alloc(range, bytes, SIM_ALLOC_ALIGN);
    struct vc_map_entry e = {.key = va, .kind = kind, .gpu = gpu, .size = bytes,
                             .ctx = (uint64_t)(uintptr_t)sim_cu_current()}; /* the context it belongs to */
    sim_rec_lock();
    int put = va == 0 ? -1 : vc_map_put(&g_recs, &e);
    sim_rec_unlock();
    if (put != 0) {
        sim_mem_uncharge(gpu, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)va;
    return CUDA_SUCCESS;
}

static CUresult device_free(uint64_t va, enum sim_rec_kind kind)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (va == 0)
        return CUDA_SUCCESS;
    if (!sim_find(va, kind, &e, true))
        return kind == REC_DEV && sim_graph_free(va) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (e.aux != 0) {
        /* A pool's: back to the pool, whose segment keeps the range (it comes back with the segment). */
        sim_pool_free_record(&e);
        return CUDA_SUCCESS;
    }
    sim_mem_uncharge(e.gpu, e.size);
    va_freed(kind == REC_LEGACY ? VA_LEGACY_RANGE : e.gpu, va, e.size);
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
                            unsigned range, enum sim_rec_kind kind)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == NULL || pitch == NULL || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    if (width > SIZE_MAX - (SIM_ALLOC_ALIGN - 1)) /* no pitch holds it */
        return CUDA_ERROR_OUT_OF_MEMORY;
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
    if (sim_put((uint64_t)(uintptr_t)p, REC_HOST, NO_GPU, bytesize, 0) != 0) {
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
    if (!sim_find((uint64_t)(uintptr_t)p, REC_HOST, NULL, true))
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

static CUresult array_create(void **handle, uint64_t bytes, enum sim_rec_kind kind)
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
    if (rc == CUDA_SUCCESS && sim_put((uint64_t)(uintptr_t)a, kind, (unsigned)dev, bytes, 0) != 0) {
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

/*
 * Sparse and deferred-mapping arrays have no memory of their own (it is mapped into them from cuMemCreate
 * allocations with cuMemMapArrayAsync): not modelled, the simulated GPUs report no support for them
 * (CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED, _DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED are 0) and
 * refuse them, as a GPU without the feature does.
 */
static bool unsupported_flags(unsigned flags)
{
    return (flags & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING)) != 0;
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (d == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (unsupported_flags(d->Flags))
        return CUDA_ERROR_NOT_SUPPORTED;
    return array_create((void **)pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                        REC_ARRAY);
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (d == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (unsupported_flags(d->Flags))
        return CUDA_ERROR_NOT_SUPPORTED;
    return array_create((void **)pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                        REC_ARRAY);
}

SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                           unsigned int numMipmapLevels)
{
    if (d == NULL || numMipmapLevels == 0 || numMipmapLevels > 32)
        return CUDA_ERROR_INVALID_VALUE;
    if (unsupported_flags(d->Flags))
        return CUDA_ERROR_NOT_SUPPORTED;
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

static CUresult array_destroy(void *handle, enum sim_rec_kind kind)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_find((uint64_t)(uintptr_t)handle, kind, &e, true))
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

static CUresult array_requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *req, void *handle, enum sim_rec_kind kind,
                                   CUdevice device)
{
    struct vc_map_entry e;
    const struct sim_node *n;
    CUresult rc = sim_cu_device(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (req == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)handle, kind, &e, false))
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

/*
 * A physical allocation (CUmemGenericAllocationHandle).  cuda.h: cuMemRelease only gives up the
 * handle; "the memory is freed when all outstanding mappings to it are unmapped", so it stays
 * charged while refs (the handle from cuMemCreate or cuMemImportFromShareableHandle, plus one per
 * cuMemRetainAllocationHandle) or maps (cuMemMap ranges) are non-zero.  An imported allocation is
 * the exporter's memory: never charged here.  Imported into the process that exported it, the new
 * handle refers to the same physical memory: the exporter's allocation lives (and stays charged) as
 * long as that handle or one of its mappings does, whatever the exporter's own handle does.
 */
struct sim_vmm {
    CUmemAllocationProp prop;
    uint64_t size;
    unsigned gpu;     /* NO_GPU: host memory */
    unsigned refs;    /* handles not yet released (under the records lock) */
    unsigned maps;    /* mapped ranges (under the records lock) */
    unsigned links;   /* allocations imported from it in this process that are still alive (records lock) */
    bool imported;
    struct sim_vmm *origin; /* imported in the exporting process: the allocation it refers to, else NULL */
};

#define SHAREABLE_MAGIC 0x4853534d49535047ull /* "GPSIMSSH" */

/* What an exported POSIX file descriptor holds (a memfd): enough to import it in another process. */
struct sim_shareable {
    uint64_t magic;
    uint32_t pid;
    uint32_t gpu;
    uint64_t start;
    uint64_t size;
    uint64_t handle; /* the exporter's handle (an import in the exporting process refers to it) */
    CUmemAllocationProp prop;
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

static CUresult vmm_new(CUmemGenericAllocationHandle *handle, const CUmemAllocationProp *prop, uint64_t size,
                       unsigned gpu, bool imported)
{
    struct sim_vmm *m = malloc(sizeof(*m));
    if (m == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *m = (struct sim_vmm){.prop = *prop, .size = size, .gpu = gpu, .refs = 1, .maps = 0, .imported = imported};
    bool charge = gpu != NO_GPU && !imported;
    CUresult rc = charge ? sim_mem_charge(gpu, size) : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS && sim_put((uint64_t)(uintptr_t)m, REC_VMM, gpu, size, 0) != 0) {
        if (charge)
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

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    unsigned gpu;
    if (handle == NULL || flags != 0 || size == 0 || size % SIM_VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_prop(prop, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    return vmm_new(handle, prop, size, gpu, false);
}

/* The live allocation behind handle (records lock held), or NULL. */
static struct sim_vmm *vmm_of(uint64_t handle)
{
    struct vc_map_entry e;
    if (handle == 0 || !vc_map_find(sim_recs(), handle, REC_VMM, &e, false))
        return NULL;
    return (struct sim_vmm *)(uintptr_t)handle;
}

/* Frees m when nothing refers to it any more (records lock held). */
static void vmm_maybe_free(struct sim_vmm *m)
{
    if (m->refs > 0 || m->maps > 0 || m->links > 0)
        return;
    vc_map_find(sim_recs(), (uint64_t)(uintptr_t)m, REC_VMM, NULL, true);
    if (m->gpu != NO_GPU && !m->imported)
        sim_mem_uncharge(m->gpu, m->size);
    struct sim_vmm *origin = m->origin;
    free(m);
    if (origin != NULL && origin->links > 0) { /* the exporter's allocation may go now */
        origin->links--;
        vmm_maybe_free(origin);
    }
}

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    sim_rec_lock();
    struct sim_vmm *m = vmm_of(handle);
    CUresult rc = m == NULL || m->refs == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        m->refs--;
        vmm_maybe_free(m);
    }
    sim_rec_unlock();
    return rc;
}

SIM_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle)
{
    if (prop == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    struct sim_vmm *m = vmm_of(handle);
    if (m != NULL)
        *prop = m->prop;
    sim_rec_unlock();
    return m != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
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
    if (va == 0 || sim_put(va, REC_VA, NO_GPU, size, 0) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)va;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_find(ptr, REC_VA, &e, false) || e.size != size)
        return CUDA_ERROR_INVALID_VALUE;
    sim_find(ptr, REC_VA, NULL, true);
    return CUDA_SUCCESS;
}

/* A mapping: REC_MAP, key = start address, size, aux = the allocation (handle). */
/*
 * GPUSIM_MAP_RETURN_DELAY_US (tests): a cuMemMap that mapped returns only this many microseconds later, so
 * that what a caller does after the call can be raced from another thread reproducibly.
 */
static void map_return_delay(void)
{
    static long delay_us = -1;
    long us = sim_env_knob("GPUSIM_MAP_RETURN_DELAY_US", &delay_us);
    if (us > 0) {
        struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = us % 1000000 * 1000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == 0 || size == 0 || flags != 0 || size % SIM_VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    struct sim_vmm *m = vmm_of(handle);
    CUresult rc = CUDA_SUCCESS;
    struct vc_map_entry e = {.key = ptr, .kind = REC_MAP, .gpu = m != NULL ? m->gpu : NO_GPU, .size = size,
                             .aux = handle};
    if (m == NULL || m->refs == 0 || offset > m->size || size > m->size - offset ||
        vc_map_find(sim_recs(), ptr, REC_MAP, NULL, false))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (vc_map_put(sim_recs(), &e) != 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else
        m->maps++;
    sim_rec_unlock();
    if (rc == CUDA_SUCCESS)
        map_return_delay();
    return rc;
}

struct range {
    uint64_t lo, hi;
};

static bool map_in_range(const struct vc_map_entry *e, void *arg)
{
    const struct range *r = arg;
    return e->key >= r->lo && e->key < r->hi;
}

static void map_gone(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    struct sim_vmm *m = vmm_of(e->aux);
    if (m != NULL && m->maps > 0) {
        m->maps--;
        vmm_maybe_free(m);
    }
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct range r = {ptr, ptr + size};
    sim_rec_lock();
    vc_map_remove_if(sim_recs(), REC_MAP, map_in_range, map_gone, &r);
    sim_rec_unlock();
    return CUDA_SUCCESS;
}

static bool map_covers(const struct vc_map_entry *e, void *arg)
{
    uint64_t addr = *(const uint64_t *)arg;
    return addr >= e->key && addr - e->key < e->size;
}

/* The allocation mapped at addr, with one more reference (released with cuMemRelease). */
SIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (handle == NULL || addr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = (uint64_t)(uintptr_t)addr;
    sim_rec_lock();
    struct sim_vmm *m = NULL;
    if (vc_map_find_if(sim_recs(), REC_MAP, map_covers, &a, &e))
        m = vmm_of(e.aux);
    if (m != NULL) {
        m->refs++;
        *handle = e.aux;
    }
    sim_rec_unlock();
    return m != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- shareable handles: a POSIX file descriptor (a memfd) that another process imports ----------- */

SIM_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (shareableHandle == NULL || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    struct sim_shareable sh;
    memset(&sh, 0, sizeof(sh));
    sim_rec_lock();
    struct sim_vmm *m = vmm_of(handle);
    CUresult rc = CUDA_SUCCESS;
    if (m == NULL || m->refs == 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (!(m->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        rc = CUDA_ERROR_INVALID_VALUE; /* cuMemCreate did not ask for this handle type */
    else
        sh = (struct sim_shareable){.magic = SHAREABLE_MAGIC, .pid = (uint32_t)getpid(), .gpu = m->gpu,
                                    .start = vc_proc_start_time((int)getpid()), .size = m->size, .handle = handle,
                                    .prop = m->prop};
    sim_rec_unlock();
    if (rc != CUDA_SUCCESS)
        return rc;
    int fd = memfd_create("gpusim-allocation", MFD_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (pwrite(fd, &sh, sizeof(sh), 0) != (ssize_t)sizeof(sh)) {
        close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    *(int *)shareableHandle = fd;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                   CUmemAllocationHandleType shHandleType)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (handle == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    int fd = (int)(intptr_t)osHandle;
    struct sim_shareable sh;
    if (pread(fd, &sh, sizeof(sh), 0) != (ssize_t)sizeof(sh) || sh.magic != SHAREABLE_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    if (!vc_proc_alive((int)sh.pid, sh.start))
        return CUDA_ERROR_INVALID_VALUE; /* the exporter (and its memory) is gone */
    CUresult rc = vmm_new(handle, &sh.prop, sh.size, sh.gpu, true);
    if (rc != CUDA_SUCCESS || sh.pid != (uint32_t)getpid() || sh.start != vc_proc_start_time((int)getpid()))
        return rc;
    /* Imported where it was exported: the same physical memory, kept alive by this handle too. */
    sim_rec_lock();
    struct sim_vmm *orig = vmm_of(sh.handle), *m = (struct sim_vmm *)(uintptr_t)*handle;
    if (orig != NULL && orig != m && !orig->imported && orig->size == sh.size && orig->gpu == sh.gpu) {
        m->origin = orig;
        orig->links++;
    }
    sim_rec_unlock();
    return rc;
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    return ptr == 0 || size == 0 || desc == NULL || count == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* ---- memory pools and stream-ordered allocation ------------------------------------------ */

/*
 * A pool reserves physical memory in 2 MiB chunks and keeps what its allocations free: a free
 * (cuMemFreeAsync, or cuMemFree of a pool pointer) returns the bytes to the pool, not to the GPU.
 * The pool gives reserved memory back when a stream, event or context is synchronised and it holds
 * more than its CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (default 0), and on cuMemPoolTrimTo.  The GPU (and
 * NVML) sees the reserved bytes.  Pool allocations are REC_DEV records with aux = the pool.  A pool
 * created with a maxSize never reserves more than that: an allocation that would grow it beyond fails
 * with CUDA_ERROR_OUT_OF_MEMORY.
 *
 * As with the real allocator, an allocation is one contiguous range: the reserved memory is a set of
 * segments (each grown for an allocation that found no room, in whole chunks), and an allocation takes
 * the first gap large enough in one of them.  Memory freed in holes between live allocations serves
 * allocations that fit in a hole, never a larger one (the pool grows for that): a fragmented pool may
 * reserve far more than it has in use.  Released are free chunks at a segment's end (a free segment:
 * all of it).
 */
#define POOL_CHUNK SIM_VMM_GRANULARITY

struct pool_block {
    uint64_t off, size; /* within its segment, sorted by off */
};

struct pool_seg {
    uint64_t base, size; /* VA and reserved bytes */
    struct pool_block *blk;
    unsigned n, cap;
};

struct sim_pool {
    unsigned gpu;
    bool destroyed;            /* cuMemPoolDestroy with allocations outstanding */
    int reuse[3];              /* CU_MEMPOOL_ATTR_REUSE_* */
    uint64_t threshold;        /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
    uint64_t max_size;         /* CUmemPoolProps.maxSize: what it may reserve at most (0: no bound of its own) */
    uint64_t reserved, used, reserved_high, used_high;
    struct pool_seg *seg;
    unsigned nseg, capseg;
};

static struct sim_pool g_default_pool[GPUSIM_MAX_GPUS];
static CUmemoryPool g_current_pool[GPUSIM_MAX_GPUS]; /* under the records lock; NULL = default */
static struct sim_pool *g_pools[256];                 /* every pool, for releasing at synchronisation */
static unsigned g_npools;

static void pools_atfork_child(void)
{
    /* The child holds none of its parent's pool memory (the parent's segment lists are left as they are). */
    for (unsigned i = 0; i < GPUSIM_MAX_GPUS; i++)
        g_default_pool[i] = (struct sim_pool){.gpu = i, .reuse = {1, 1, 1}};
    g_npools = 0;
}

static bool is_default_pool(const struct sim_pool *p)
{
    uintptr_t a = (uintptr_t)p, base = (uintptr_t)&g_default_pool[0];
    return a >= base && a < base + sizeof(g_default_pool);
}

/* The pool behind a handle (records lock held), or NULL. */
static struct sim_pool *pool_of(CUmemoryPool pool)
{
    uintptr_t p = (uintptr_t)pool, base = (uintptr_t)&g_default_pool[0];
    if (p >= base && p < base + sizeof(g_default_pool) && (p - base) % sizeof(g_default_pool[0]) == 0)
        return (struct sim_pool *)pool;
    struct vc_map_entry *e = vc_map_lookup(sim_recs(), p, REC_POOL);
    return e != NULL ? (struct sim_pool *)pool : NULL;
}

static bool pool_gpu(CUmemoryPool pool, unsigned *gpu)
{
    sim_rec_lock();
    struct sim_pool *p = pool_of(pool);
    if (p != NULL)
        *gpu = p->gpu;
    sim_rec_unlock();
    return p != NULL && !p->destroyed;
}

/* The end of a segment's last live allocation (0: none). */
static uint64_t seg_end(const struct pool_seg *g)
{
    return g->n > 0 ? g->blk[g->n - 1].off + g->blk[g->n - 1].size : 0;
}

/*
 * Gives back free reserved memory, keeping at least `keep` reserved bytes (records lock held): whole free
 * chunks at the end of segments, a free segment with its address range.
 */
static void pool_release(struct sim_pool *p, uint64_t keep)
{
    for (unsigned i = p->nseg; i-- > 0 && p->reserved > keep;) {
        struct pool_seg *g = &p->seg[i];
        uint64_t end = (seg_end(g) + POOL_CHUNK - 1) / POOL_CHUNK * POOL_CHUNK;
        uint64_t give = g->size > end ? g->size - end : 0;
        if (give > p->reserved - keep)
            give = (p->reserved - keep) / POOL_CHUNK * POOL_CHUNK;
        if (g->n == 0 && (p->destroyed || give == g->size || p->reserved - keep >= g->size))
            give = g->size;
        if (give == 0)
            continue;
        p->reserved -= give;
        sim_mem_uncharge(p->gpu, give);
        g->size -= give;
        if (g->size == 0) {
            va_freed(p->gpu, g->base, g->size + give);
            free(g->blk);
            p->seg[i] = p->seg[--p->nseg];
        }
    }
}

static void pool_forget(struct sim_pool *p)
{
    for (unsigned i = 0; i < g_npools; i++) {
        if (g_pools[i] == p) {
            g_pools[i] = g_pools[--g_npools];
            break;
        }
    }
}

static void pool_destroy_now(struct sim_pool *p)
{
    pool_release(p, 0);
    for (unsigned i = 0; i < p->nseg; i++)
        free(p->seg[i].blk);
    free(p->seg);
    pool_forget(p);
    free(p);
}

/* An allocation (at va, of bytes) goes back to its pool (records lock held). */
static void pool_free(struct sim_pool *p, uint64_t va, uint64_t bytes)
{
    p->used -= bytes < p->used ? bytes : p->used;
    for (unsigned i = 0; i < p->nseg; i++) {
        struct pool_seg *g = &p->seg[i];
        if (va < g->base || va - g->base >= g->size)
            continue;
        for (unsigned j = 0; j < g->n; j++) {
            if (g->blk[j].off == va - g->base) {
                memmove(&g->blk[j], &g->blk[j + 1], (g->n - j - 1) * sizeof(g->blk[0]));
                g->n--;
                break;
            }
        }
        break;
    }
    if (p->destroyed) {
        pool_release(p, 0);
        if (p->used == 0)
            pool_destroy_now(p);
    }
}

/* Stream, event or context synchronisation: pools above their release threshold give memory back. */
void sim_pools_synchronized(void)
{
    sim_deferred_frees_due();
    sim_rec_lock();
    for (unsigned i = 0; i < GPUSIM_MAX_GPUS; i++)
        if (g_default_pool[i].reserved > g_default_pool[i].threshold)
            pool_release(&g_default_pool[i], g_default_pool[i].threshold);
    for (unsigned i = 0; i < g_npools; i++)
        if (g_pools[i]->reserved > g_pools[i]->threshold)
            pool_release(g_pools[i], g_pools[i]->threshold);
    sim_rec_unlock();
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
    sim_rec_lock();
    *pool = g_current_pool[dev] ? g_current_pool[dev] : (CUmemoryPool)&g_default_pool[dev];
    sim_rec_unlock();
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
    sim_rec_lock();
    g_current_pool[dev] = pool;
    sim_rec_unlock();
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
    *p = (struct sim_pool){.gpu = (unsigned)poolProps->location.id, .reuse = {1, 1, 1}, .max_size = poolProps->maxSize};
    sim_rec_lock();
    struct vc_map_entry e = {.key = (uint64_t)(uintptr_t)p, .kind = REC_POOL, .gpu = p->gpu};
    rc = g_npools >= sizeof(g_pools) / sizeof(g_pools[0]) || vc_map_put(sim_recs(), &e) != 0 ? CUDA_ERROR_OUT_OF_MEMORY
                                                                                                : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS)
        g_pools[g_npools++] = p;
    sim_rec_unlock();
    if (rc != CUDA_SUCCESS) {
        free(p);
        return rc;
    }
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

/* cuda.h: with allocations outstanding the pool's resources go once they are all freed. */
SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    sim_rec_lock();
    struct sim_pool *p = pool_of(pool);
    bool ok = p != NULL && !is_default_pool(p) && !p->destroyed;
    if (ok) {
        vc_map_find(sim_recs(), (uint64_t)(uintptr_t)pool, REC_POOL, NULL, true);
        for (unsigned i = 0; i < GPUSIM_MAX_GPUS; i++)
            if (g_current_pool[i] == pool)
                g_current_pool[i] = NULL;
        p->destroyed = true;
        pool_release(p, 0);
        if (p->used == 0)
            pool_destroy_now(p);
    }
    sim_rec_unlock();
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    sim_rec_lock();
    struct sim_pool *p = pool_of(pool);
    if (p != NULL)
        pool_release(p, minBytesToKeep);
    sim_rec_unlock();
    return p != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    if (value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    sim_rec_lock();
    struct sim_pool *p = pool_of(pool);
    if (p == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        switch (attr) {
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: p->reuse[0] = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: p->reuse[1] = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: p->reuse[2] = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: p->threshold = *(cuuint64_t *)value; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: /* only 0 is allowed: reset to the current value */
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
            if (*(cuuint64_t *)value != 0)
                rc = CUDA_ERROR_INVALID_VALUE;
            else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
                p->reserved_high = p->reserved;
            else
                p->used_high = p->used;
            break;
        default: rc = CUDA_ERROR_INVALID_VALUE; break; /* the current values are read-only */
        }
    }
    sim_rec_unlock();
    return rc;
}

SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    if (value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    sim_rec_lock();
    struct sim_pool *p = pool_of(pool);
    if (p == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        switch (attr) {
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: *(int *)value = p->reuse[0]; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: *(int *)value = p->reuse[1]; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *(int *)value = p->reuse[2]; break;
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = p->threshold; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = p->reserved; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = p->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = p->used; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = p->used_high; break;
        default: rc = CUDA_ERROR_INVALID_VALUE; break;
        }
    }
    sim_rec_unlock();
    return rc;
}

/* The first gap of `need` bytes in segment g (its offset), or UINT64_MAX; *at: the block index it goes before. */
static uint64_t seg_gap(const struct pool_seg *g, uint64_t need, unsigned *at)
{
    uint64_t prev = 0;
    for (unsigned j = 0; j < g->n; j++) {
        if (g->blk[j].off - prev >= need) {
            *at = j;
            return prev;
        }
        prev = g->blk[j].off + g->blk[j].size;
    }
    *at = g->n;
    return g->size - prev >= need ? prev : UINT64_MAX;
}

static bool seg_insert(struct pool_seg *g, unsigned at, uint64_t off, uint64_t size)
{
    if (g->n == g->cap) {
        unsigned cap = g->cap ? g->cap * 2 : 8;
        struct pool_block *b = realloc(g->blk, cap * sizeof(*b));
        if (b == NULL)
            return false;
        g->blk = b, g->cap = cap;
    }
    memmove(&g->blk[at + 1], &g->blk[at], (g->n - at) * sizeof(g->blk[0]));
    g->blk[at] = (struct pool_block){off, size};
    g->n++;
    return true;
}

/* An allocation of bytes from pool p on the GPU: the first gap that holds it, else a new segment. */
static CUresult pool_alloc(CUdeviceptr *dptr, uint64_t bytes, CUmemoryPool pool)
{
    sim_rec_lock();
    struct sim_pool *p = pool_of(pool);
    CUresult rc = p == NULL || p->destroyed ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    uint64_t need = va_step(bytes), grow = 0, va = 0;
    struct pool_seg *g = NULL;
    unsigned at = 0;
    uint64_t off = UINT64_MAX;
    for (unsigned i = 0; rc == CUDA_SUCCESS && i < p->nseg && off == UINT64_MAX; i++) {
        g = &p->seg[i];
        off = seg_gap(g, need, &at);
    }
    if (rc == CUDA_SUCCESS && off == UINT64_MAX) { /* no room: a new segment */
        grow = (need + POOL_CHUNK - 1) / POOL_CHUNK * POOL_CHUNK;
        if (p->max_size != 0 && (grow > p->max_size || p->reserved > p->max_size - grow))
            rc = CUDA_ERROR_OUT_OF_MEMORY; /* the pool may not reserve more than its maxSize */
        if (rc == CUDA_SUCCESS && p->nseg == p->capseg) {
            unsigned cap = p->capseg ? p->capseg * 2 : 4;
            struct pool_seg *n = realloc(p->seg, cap * sizeof(*n));
            if (n == NULL)
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            else
                p->seg = n, p->capseg = cap;
        }
        uint64_t base = 0;
        if (rc == CUDA_SUCCESS) {
            base = va_reused(p->gpu, grow, POOL_CHUNK);
            if (base == 0)
                base = sim_va_alloc(p->gpu, grow, POOL_CHUNK);
            rc = base == 0 ? CUDA_ERROR_OUT_OF_MEMORY : sim_mem_charge(p->gpu, grow);
        }
        if (rc == CUDA_SUCCESS) {
            g = &p->seg[p->nseg++];
            *g = (struct pool_seg){.base = base, .size = grow};
            off = 0, at = 0;
            p->reserved += grow;
        }
    }
    if (rc == CUDA_SUCCESS) {
        va = g->base + off;
        struct vc_map_entry e = {.key = va, .kind = REC_DEV, .gpu = p->gpu, .size = bytes,
                                 .aux = (uint64_t)(uintptr_t)p, .ctx = (uint64_t)(uintptr_t)sim_cu_current()};
        if (!seg_insert(g, at, off, need) || vc_map_put(sim_recs(), &e) != 0) {
            if (g->n > at && g->blk[at].off == off && g->blk[at].size == need) /* inserted: take it out */
                memmove(&g->blk[at], &g->blk[at + 1], (--g->n - at) * sizeof(g->blk[0]));
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            pool_release(p, p->reserved - grow); /* the segment grown for it, if any */
        }
    }
    if (rc == CUDA_SUCCESS) {
        p->used += bytes;
        if (p->reserved > p->reserved_high)
            p->reserved_high = p->reserved;
        if (p->used > p->used_high)
            p->used_high = p->used;
        *dptr = (CUdeviceptr)va;
    }
    sim_rec_unlock();
    return rc;
}

/* A pool allocation freed (cuMemFreeAsync, or cuMemFree of a pool pointer): back to its pool. */
void sim_pool_free_record(const struct vc_map_entry *e)
{
    sim_rec_lock();
    pool_free((struct sim_pool *)(uintptr_t)e->aux, e->key, e->size);
    sim_rec_unlock();
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    unsigned gpu;
    CUresult rc = sim_stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (pool == NULL) {
        sim_rec_lock();
        pool = g_current_pool[gpu] ? g_current_pool[gpu] : (CUmemoryPool)&g_default_pool[gpu];
        sim_rec_unlock();
    }
    unsigned pgpu;
    if (!pool_gpu(pool, &pgpu))
        return CUDA_ERROR_INVALID_VALUE;
    CUgraph capture = sim_stream_capture(stream);
    if (capture != NULL) /* captured: a memory allocation node of the capturing graph */
        return sim_graph_alloc_node(NULL, capture, pgpu, bytesize, dptr);
    return pool_alloc(dptr, bytesize, pool);
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

/*
 * cuMemFreeAsync of a plain allocation (cuMemAlloc, pitch, managed): stream-ordered, so the GPU frees it
 * once the work queued before the free is done (this process's work on the stream's GPU: the simulated
 * GPU runs a process's launches in order), not when the call returns.  The record goes at once (the
 * address is no longer the caller's); the memory stays charged, and the range unused, until then.  A
 * driver thread frees it when that work is done; a synchronisation that waited for it frees it itself.
 */
struct deferred_free {
    struct deferred_free *next;
    struct sim_state *state;
    unsigned gpu;  /* the stream's GPU: whose work comes first */
    uint64_t upto; /* that work: the process's timeline up to this sequence */
    uint64_t va, size;
    unsigned mem_gpu; /* the allocation's GPU */
};

static pthread_mutex_t g_df_mu = PTHREAD_MUTEX_INITIALIZER;
static struct deferred_free *g_df; /* pending, under g_df_mu */

/*
 * Takes f out of the pending list and frees it, under g_df_mu all through: a synchronisation that finds the
 * list without f knows its memory is back (false: someone else freed it already).
 */
static void deferred_do(struct deferred_free *f);

static bool deferred_claim_do(struct deferred_free *f)
{
    bool mine = false;
    pthread_mutex_lock(&g_df_mu);
    for (struct deferred_free **p = &g_df; *p != NULL; p = &(*p)->next)
        if (*p == f) {
            *p = f->next;
            mine = true;
            break;
        }
    if (mine)
        deferred_do(f);
    pthread_mutex_unlock(&g_df_mu);
    return mine;
}

static void deferred_atfork_child(void)
{
    g_df = NULL; /* the parent's frees (its memory) */
    pthread_mutex_init(&g_df_mu, NULL);
}

static void deferred_do(struct deferred_free *f)
{
    sim_mem_uncharge(f->mem_gpu, f->size);
    va_freed(f->mem_gpu, f->va, f->size);
    free(f);
}

static void *deferred_free_thread(void *arg)
{
    struct deferred_free *f = arg;
    sim_tl_wait(f->state, f->gpu, f->upto);
    (void)deferred_claim_do(f);
    return NULL;
}

/*
 * A synchronisation, or an event found complete: the frees whose preceding work is done happen now (not at
 * the driver thread's leisure), and one the driver thread is making is finished before this returns.
 */
void sim_deferred_frees_due(void)
{
    pthread_mutex_lock(&g_df_mu);
    for (struct deferred_free **p = &g_df; *p != NULL;) {
        struct deferred_free *f = *p;
        if (sim_tl_done(f->state, f->gpu, f->upto, NULL)) {
            *p = f->next;
            deferred_do(f);
        } else {
            p = &f->next;
        }
    }
    pthread_mutex_unlock(&g_df_mu);
}

static CUresult free_ordered(CUdeviceptr dptr, unsigned gpu)
{
    struct vc_map_entry e;
    struct sim_state *st = sim_cu_node()->state;
    uint64_t upto = sim_tl_tail(st, gpu);
    if (!sim_find(dptr, REC_DEV, &e, false) || e.aux != 0 || sim_tl_done(st, gpu, upto, NULL))
        return device_free(dptr, REC_DEV); /* a pool's or a graph's allocation, or nothing queued before it */
    struct deferred_free *f = malloc(sizeof(*f));
    if (f == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!sim_find(dptr, REC_DEV, &e, true)) { /* freed meanwhile by another thread */
        free(f);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *f = (struct deferred_free){.state = st, .gpu = gpu, .upto = upto, .va = dptr, .size = e.size, .mem_gpu = e.gpu};
    pthread_mutex_lock(&g_df_mu);
    f->next = g_df;
    g_df = f;
    pthread_mutex_unlock(&g_df_mu);
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    (void)pthread_create(&t, &a, deferred_free_thread, f); /* without a driver thread the next synchronisation frees it */
    pthread_attr_destroy(&a);
    return CUDA_SUCCESS;
}

static CUresult free_async(CUdeviceptr dptr, CUstream stream)
{
    unsigned gpu;
    CUresult rc = sim_stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUgraph capture = sim_stream_capture(stream);
    if (capture != NULL) /* captured: a free node (of a graph allocation) */
        return sim_graph_free_node(NULL, capture, dptr);
    return free_ordered(dptr, gpu);
}

SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream);
}

SIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream);
}
