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
#include <unistd.h>

#include "vc_image.h"
#include "vc_map.h"

/* ---- what each allocation reserved (process-local) ----------------------------- */

enum rec_kind {
    REC_DEV = 1, /* cuMemAlloc_v2, pitch, managed, stream-ordered: key = device address */
    REC_LEGACY,  /* CUDA 2.0 ABI cuMemAlloc / cuMemAllocPitch: key = 32-bit address */
    REC_ARRAY,   /* key = CUarray */
    REC_MIPMAP,  /* key = CUmipmappedArray */
    REC_VMM,     /* key = CUmemGenericAllocationHandle (device memory only), gpu = handle references, aux = mappings,
                    aux2 = 1 once exported (cuMemExportToShareableHandle) */
    REC_GNODE,   /* key = CUgraphNode of a memory allocation node, aux = its graph, aux2 = its address */
    REC_GALLOC,  /* key = address of a graph allocation, size, aux = its graph (0: gone), aux2 = the exec holding
                    it (0: none), gpu = GA_* flags, ctx = what of size the GPU does not hold until an exec backs it */
    REC_MAP,     /* key = start of a cuMemMap range of a REC_VMM allocation, size, aux = the handle */
    REC_MODULE,  /* key = CUmodule, size = its estimated footprint (freed with its context) */
    REC_LIBRARY, /* key = CUlibrary, size = what it is charged beyond its variables per context (0 unless NVML
                    could not tell at its load), aux = its variables (one copy; its code too once asked for, gpu = 1),
                    aux2 = its whole footprint, ctx = the context this process put it into (0: none known) */
    REC_CONTEXT, /* key = a live CUcontext: the libraries' variables are charged once more for it */
    REC_POOL,    /* key = CUmemoryPool, size = what the budget holds for it, aux = its live allocations' bytes,
                    gpu = 1 once destroyed (then it settles on aux) */
    REC_GEXEC,   /* key = CUgraphExec whose kernels' largest frame is above the default stack, aux = that frame */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* guards g_recs and g_gallocs */
static struct vc_map g_recs;
static unsigned g_gallocs; /* REC_GALLOC records: graph launches and frees look for them only when there are some */

enum { GA_OUTSTANDING = 1, GA_FREED_IN_GRAPH = 2 };

/*
 * What a pool reserves is read, and the pool changed, under its stripe lock: an allocation's "spare"
 * (reserved - used) and its settlement must not interleave with another thread's allocation from the same
 * pool (both would count on one spare chunk and the pool would grow past the cap), nor a settlement use a
 * value read before another thread grew the pool.
 */
#define POOL_STRIPES 16
static pthread_mutex_t g_pool_mu[POOL_STRIPES];

static pthread_mutex_t *pool_mu(CUmemoryPool pool)
{
    return &g_pool_mu[((uintptr_t)pool >> 4) % POOL_STRIPES];
}

static bool galloc_free(uint64_t dptr, CUstream capturing_stream, bool ptsz);
static uint64_t graph_pool_settle(void);
static bool galloc_reserve(uint64_t bytes, uint64_t *took);
static void galloc_unreserve(uint64_t bytes, uint64_t took);

/* The graph pools' charge beyond their live allocations (graph_pool_settle, below). */
static pthread_mutex_t g_graph_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_graph_kept;    /* under g_mu */
static uint64_t g_galloc_bytes;  /* under g_mu: bytes of the REC_GALLOC records */
static uint64_t g_graph_pending; /* under g_mu: bytes of graph allocations gone since the last settlement */
static _Atomic bool g_graph_seen; /* this process made a graph allocation: its pool may hold memory */

/* Libraries' variables, charged once per live context (cuLibraryLoadData, below). */
static pthread_mutex_t g_lib_mu = PTHREAD_MUTEX_INITIALIZER; /* held across library loads, unloads, context births */
static uint64_t g_lib_vars;  /* under g_lib_mu: the live libraries' variables, one copy of each */
static uint64_t g_lib_image; /* under g_lib_mu: their whole footprints (code pages too) */
static uint64_t g_lib_ctxs;  /* under g_lib_mu: live contexts (REC_CONTEXT records) */
static uint64_t g_lib_unloaded; /* under g_lib_mu: what each context is charged for the libraries in none (lib_unbacked) */

static void ordered_frees_atfork_child(void);
/* Held (read) from a stream-ordered allocation's or free's capture check (and look at the device's current pool)
 * to its call's end; captures and current pools change under it (written): see cuMemAllocAsync. */
static pthread_rwlock_t g_capture_rw = PTHREAD_RWLOCK_INITIALIZER;

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
    g_gallocs = 0;
    g_graph_kept = g_graph_pending = g_galloc_bytes = 0;
    atomic_store(&g_graph_seen, false);
    g_lib_vars = g_lib_image = g_lib_ctxs = g_lib_unloaded = 0;
    ordered_frees_atfork_child();
    pthread_mutex_init(&g_mu, NULL);
    pthread_mutex_init(&g_lib_mu, NULL);
    pthread_mutex_init(&g_graph_mu, NULL);
    pthread_rwlock_init(&g_capture_rw, NULL); /* perhaps held by a thread of the parent at the fork */
    for (int i = 0; i < POOL_STRIPES; i++)
        pthread_mutex_init(&g_pool_mu[i], NULL);
    vc_budget_atfork_child();
}

__attribute__((constructor)) static void vc_memory_init(void)
{
    for (int i = 0; i < POOL_STRIPES; i++)
        pthread_mutex_init(&g_pool_mu[i], NULL);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* The current context: what an allocation belongs to (cuCtxDestroy frees it); 0 if none. */
static uint64_t current_ctx(void)
{
    CUcontext ctx = NULL;
    return REAL_CU(cuCtxGetCurrent)(&ctx) == CUDA_SUCCESS ? (uint64_t)(uintptr_t)ctx : 0;
}

/* Records key -> size; in_context: the allocation is the current context's (freed when it is destroyed). */
static void remember(uint64_t key, enum rec_kind kind, uint64_t size, bool in_context)
{
    struct vc_map_entry e = {.key = key, .kind = kind, .size = size, .ctx = in_context ? current_ctx() : 0};
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
    pthread_mutex_lock(&g_mu);
    int rc = vc_map_put(&g_recs, e);
    pthread_mutex_unlock(&g_mu);
    if (rc != 0)
        vc_log(VC_LOG_ERROR, "out of host memory: %llu bytes stay charged until this process exits",
               (unsigned long long)e->size);
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
#define RESERVED(bytes, call, key_expr, kind, in_context)                                                                 \
    do {                                                                                                           \
        uint64_t bytes_ = (bytes);                                                                                 \
        if (!vc_budget_reserve(bytes_))                                                                            \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                                 \
            vc_budget_release(bytes_);                                                                             \
            return rc_;                                                                                            \
        }                                                                                                          \
        remember((uint64_t)(key_expr), (kind), bytes_, (in_context));                                              \
        return rc_;                                                                                                \
    } while (0)

/* ---- linear device memory -------------------------------------------------------- */

VC_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAlloc_v2)(dptr, bytesize);
    RESERVED(bytesize, REAL_CU(cuMemAlloc_v2)(dptr, bytesize), *dptr, REC_DEV, true);
}

VC_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAlloc)(dptr, bytesize);
    RESERVED(bytesize, REAL_CU(cuMemAlloc)(dptr, bytesize), *dptr, REC_LEGACY, true);
}

VC_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocManaged)(dptr, bytesize, flags);
    RESERVED(bytesize, REAL_CU(cuMemAllocManaged)(dptr, bytesize, flags), *dptr, REC_DEV, true);
}

static void freed(const struct vc_map_entry *e);

VC_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemFree_v2)(dptr);
    struct vc_map_entry e;
    bool had = take(dptr, REC_DEV, &e);
    CUresult rc = settle(REAL_CU(cuMemFree_v2)(dptr), had, &e);
    if (rc == CUDA_SUCCESS && had)
        freed(&e); /* a pool's allocation: its pool settles */
    else if (rc == CUDA_SUCCESS)
        galloc_free(dptr, NULL, false); /* an allocation a graph launch left live */
    return rc;
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
    uint64_t guess = mul_sat(WidthInBytes > UINT64_MAX - 511 ? UINT64_MAX : (WidthInBytes + 511) / 512 * 512, Height);
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
    remember(*dptr, REC_DEV, actual, true);
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
    remember(*dptr, REC_LEGACY, actual, true);
    return rc;
}

/* ---- stream-ordered allocation and pools ----------------------------------------------- */

/* The graph stream s captures into, or NULL. */
static CUgraph capture_graph(CUstream s, bool ptsz)
{
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    cuuint64_t id;
    CUgraph g = NULL;
    const CUgraphNode *deps;
    size_t n;
    CUresult rc = ptsz ? REAL_CU(cuStreamGetCaptureInfo_v2_ptsz)(s, &st, &id, &g, &deps, &n)
                       : REAL_CU(cuStreamGetCaptureInfo_v2)(s, &st, &id, &g, &deps, &n);
    return rc == CUDA_SUCCESS && st == CU_STREAM_CAPTURE_STATUS_ACTIVE ? g : NULL;
}

/* unbacked: what of bytes the graph pools' memory does not hold yet (galloc_reserve noted it so). */
static void remember_galloc(uint64_t dptr, uint64_t bytes, CUgraph graph, uint64_t unbacked)
{
    atomic_store_explicit(&g_graph_seen, true, memory_order_relaxed);
    struct vc_map_entry e = {
        .key = dptr, .kind = REC_GALLOC, .size = bytes, .aux = (uint64_t)(uintptr_t)graph, .ctx = unbacked};
    pthread_mutex_lock(&g_mu);
    int rc = vc_map_put(&g_recs, &e);
    if (rc == 0) {
        g_gallocs++;
        g_galloc_bytes += bytes;
    }
    pthread_mutex_unlock(&g_mu);
    if (rc != 0) /* charged, and counted as not held, until the process exits: on the safe side */
        vc_log(VC_LOG_ERROR, "out of host memory: %llu bytes stay charged until this process exits",
               (unsigned long long)bytes);
}

/*
 * Memory pools (stream-ordered allocation).  A pool holds device memory beyond its live allocations:
 * what they freed stays reserved until a synchronisation above its release threshold, or a trim.  So a
 * pool is charged what it reserves (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), settled after every
 * allocation and free from it, trim and attribute change, and before a reservation is refused or a
 * memory view answers; an allocation reserves beforehand only what the pool's free reserved memory
 * cannot give.  A pool allocation's record (REC_DEV) carries no bytes, its pool in aux2.
 */
static uint64_t pool_attr(CUmemoryPool pool, CUmemPool_attribute attr)
{
    cuuint64_t v = 0;
    return REAL_CU(cuMemPoolGetAttribute)(pool, attr, &v) == CUDA_SUCCESS ? (uint64_t)v : 0;
}

/* g_mu held: pool's record (made on first use; valid until the map changes); NULL when out of host memory. */
static struct vc_map_entry *pool_entry(CUmemoryPool pool)
{
    uint64_t key = (uint64_t)(uintptr_t)pool;
    struct vc_map_entry *e = vc_map_lookup(&g_recs, key, REC_POOL);
    if (e == NULL) {
        struct vc_map_entry fresh = {.key = key, .kind = REC_POOL};
        if (vc_map_put(&g_recs, &fresh) == 0)
            e = vc_map_lookup(&g_recs, key, REC_POOL);
    }
    return e;
}

/*
 * Settles pool's charge on what it reserves (reserved: read by the caller without g_mu); reserved_ahead =
 * what the caller reserved for it before the driver call.  Returns the bytes given back.
 */
static uint64_t pool_settle(CUmemoryPool pool, uint64_t reserved, uint64_t reserved_ahead, int64_t live_delta)
{
    uint64_t released = 0;
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *p = pool_entry(pool);
    if (p == NULL) { /* out of host memory: what was reserved stays charged */
        pthread_mutex_unlock(&g_mu);
        vc_log(VC_LOG_ERROR, "out of host memory: a memory pool's charge is no longer followed");
        return 0;
    }
    p->aux += (uint64_t)live_delta;
    /* A destroyed pool keeps what it reserved at its destruction until its last allocation is freed. */
    uint64_t target = p->gpu ? (p->aux > 0 ? p->size : 0) : reserved;
    uint64_t before = p->size + reserved_ahead;
    if (target > before)
        vc_budget_charge(target - before); /* the pool grew past what was reserved: it holds it already */
    else
        released = before - target;
    vc_budget_release(released);
    p->size = target;
    if (p->gpu && p->aux == 0)
        vc_map_find(&g_recs, p->key, REC_POOL, NULL, true);
    pthread_mutex_unlock(&g_mu);
    return released;
}

static uint64_t pool_reserved_now(CUmemoryPool pool)
{
    return pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
}

struct pool_list {
    CUmemoryPool *pools;
    size_t n, cap;
};

static void collect_pool(struct vc_map_entry *e, void *arg)
{
    struct pool_list *l = arg;
    if (e->gpu)
        return; /* destroyed: it can no longer be asked */
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        CUmemoryPool *p = realloc(l->pools, cap * sizeof(*p));
        if (p == NULL)
            return; /* out of host memory: the others are settled at their next change */
        l->pools = p, l->cap = cap;
    }
    l->pools[l->n++] = (CUmemoryPool)(uintptr_t)e->key;
}

static uint64_t ordered_frees_done(void);

bool vc_memory_refresh_pools(void)
{
    uint64_t credited = ordered_frees_done(); /* plain allocations the GPU freed in stream order since */
    struct pool_list l = {NULL, 0, 0};
    pthread_mutex_lock(&g_mu);
    vc_map_each(&g_recs, REC_POOL, collect_pool, &l);
    pthread_mutex_unlock(&g_mu);
    CUmemoryPool *pools = l.pools;
    size_t n = l.n;
    uint64_t released = 0;
    for (size_t i = 0; i < n; i++) {
        /* A pool busy in another call (or in this thread's, which asked for the refresh) settles there. */
        if (pthread_mutex_trylock(pool_mu(pools[i])) != 0)
            continue;
        released += pool_settle(pools[i], pool_reserved_now(pools[i]), 0, 0);
        pthread_mutex_unlock(pool_mu(pools[i]));
    }
    free(pools);
    if (atomic_load_explicit(&g_graph_seen, memory_order_relaxed) && pthread_mutex_trylock(&g_graph_mu) == 0) {
        released += graph_pool_settle();
        pthread_mutex_unlock(&g_graph_mu);
    }
    return released > 0 || credited > 0;
}

/* The pool an allocation on stream s comes from when none is named: its device's current pool. */
static CUmemoryPool stream_pool(CUstream s)
{
    CUmemoryPool pool = NULL;
    return REAL_CU(cuDeviceGetMemPool)(&pool, vc_stream_device(s)) == CUDA_SUCCESS ? pool : NULL;
}

/*
 * Before an allocation of bytes from pool (its lock held): the whole size is reserved, however much free
 * memory the pool keeps, since that memory may lie in holes between live allocations too small for it (an
 * allocation is one contiguous range: the pool then grows by the whole size).  What the pool does not grow
 * by is returned right after the call (pool_settle).  When that does not fit, the pool first gives back
 * what it keeps free (*had: what it reserves then).
 */
static bool pool_reserve_ahead(CUmemoryPool pool, uint64_t bytes, uint64_t *had)
{
    if (vc_budget_reserve(bytes))
        return true;
    if (REAL_CU(cuMemPoolTrimTo)(pool, 0) != CUDA_SUCCESS)
        return false;
    *had = pool_reserved_now(pool);
    pool_settle(pool, *had, 0, 0);
    return vc_budget_reserve(bytes);
}

/*
 * After an allocation from pool (its lock held): the pool may have grown by more than was reserved ahead
 * (*ahead), since an allocation is one contiguous range and the pool's free memory may lie in holes between
 * live allocations (or the pool grows in whole chunks).  The excess is reserved too (*ahead grows by it);
 * false when it does not fit.
 */
static bool pool_grown_fits(CUmemoryPool pool, uint64_t had, uint64_t *ahead)
{
    uint64_t now = pool_reserved_now(pool);
    uint64_t grown = now > had ? now - had : 0;
    if (grown <= *ahead)
        return true;
    if (!vc_budget_reserve(grown - *ahead))
        return false;
    *ahead = grown;
    return true;
}

/*
 * Undoes an allocation whose growth of the pool does not fit: frees it, waits for the free on its stream,
 * trims the pool back to what it held before (so the GPU stops holding the growth), and settles the pool.
 */
static void pool_undo(CUmemoryPool pool, CUdeviceptr dptr, CUstream s, bool ptsz, uint64_t had, uint64_t ahead)
{
    if (ptsz) {
        REAL_CU(cuMemFreeAsync_ptsz)(dptr, s);
        REAL_CU(cuStreamSynchronize_ptsz)(s);
    } else {
        REAL_CU(cuMemFreeAsync)(dptr, s);
        REAL_CU(cuStreamSynchronize)(s);
    }
    REAL_CU(cuMemPoolTrimTo)(pool, had);
    pool_settle(pool, pool_reserved_now(pool), ahead, 0);
    vc_log(VC_LOG_INFO, "a pool allocation grew its pool beyond the container's limit: freed, refused");
}

#ifdef VC_TEST_HOOKS
/* Tests only (built with -DVC_TEST_HOOKS): VCUDA_TEST_CAPTURE_DELAY_US between a capture check and the driver call. */
static void test_capture_delay(void)
{
    const char *us = getenv("VCUDA_TEST_CAPTURE_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
#else
#define test_capture_delay() ((void)0)
#endif

/*
 * Stream-ordered allocation from pool (NULL: the stream's device's).  Into a capture it becomes a
 * memory node of the capturing graph: its memory is then the graph's and the exec's (below).
 */
#define ASYNC_ALLOC(call, stream, ptsz, named_pool)                                                                \
    do {                                                                                                           \
        CUgraph graph_ = capture_graph((stream), (ptsz));                                                          \
        if (graph_ != NULL) {                                                                                      \
            uint64_t took_;                                                                                        \
            pthread_mutex_lock(&g_graph_mu);                                                                       \
            if (!galloc_reserve(bytesize, &took_)) {                                                               \
                pthread_mutex_unlock(&g_graph_mu);                                                                 \
                return CUDA_ERROR_OUT_OF_MEMORY;                                                                   \
            }                                                                                                      \
            test_capture_delay();                                                                                  \
            CUresult rc_ = (call);                                                                                 \
            if (rc_ != CUDA_SUCCESS)                                                                               \
                galloc_unreserve(bytesize, took_);                                                                 \
            else                                                                                                   \
                remember_galloc(*dptr, bytesize, graph_, bytesize - took_);                                        \
            pthread_mutex_unlock(&g_graph_mu);                                                                     \
            return rc_;                                                                                            \
        }                                                                                                          \
        CUmemoryPool pool_ = (named_pool) != NULL ? (named_pool) : stream_pool(stream);                            \
        if (pool_ == NULL)                                                                                         \
            RESERVED(bytesize, (call), *dptr, REC_DEV, false);                                                     \
        pthread_mutex_lock(pool_mu(pool_));                                                                        \
        uint64_t have_ = pool_reserved_now(pool_), ahead_ = bytesize;                                              \
        if (!pool_reserve_ahead(pool_, bytesize, &have_)) {                                                        \
            pthread_mutex_unlock(pool_mu(pool_));                                                                  \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                                 \
            vc_budget_release(ahead_);                                                                             \
            pthread_mutex_unlock(pool_mu(pool_));                                                                  \
            return rc_;                                                                                            \
        }                                                                                                          \
        if (!pool_grown_fits(pool_, have_, &ahead_)) {                                                             \
            pool_undo(pool_, *dptr, (stream), (ptsz), have_, ahead_);                                              \
            pthread_mutex_unlock(pool_mu(pool_));                                                                  \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
        pool_settle(pool_, pool_reserved_now(pool_), ahead_, (int64_t)bytesize);                                  \
        pthread_mutex_unlock(pool_mu(pool_));                                                                      \
        struct vc_map_entry e_ = {.key = *dptr, .kind = REC_DEV, .size = 0, .aux = bytesize,                       \
                                  .aux2 = (uint64_t)(uintptr_t)pool_};                                             \
        put_back(&e_);                                                                                             \
        return rc_;                                                                                                \
    } while (0)

/*
 * Captures begin and end under g_capture_rw (written); a stream-ordered allocation or free holds it (read) from its
 * look at the stream's capture to the end of its driver call, so no capture of another thread begins or ends between
 * the two: an allocation charged as a capturing graph's memory node is one (and one charged as the stream's pool's
 * is real).  The device's current pool changes under it too (cuDeviceSetMemPool, and cuMemPoolDestroy, which makes
 * the default pool current again when it destroys the current one): cuMemAllocAsync charges the pool it looked up,
 * and the driver allocates from the one current at the call, so another thread switching the pool between the two
 * had the growth of a pool that was not charged go unseen (and the looked-up pool, which did not grow, give its
 * reservation back).  Only captures and pool changes, which programs make rarely, wait; with the memory limit off
 * nothing is taken.
 */
static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ASYNC_ALLOC(REAL_CU(cuMemAllocAsync)(dptr, bytesize, hStream), hStream, false, NULL);
}

static CUresult alloc_async_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ASYNC_ALLOC(REAL_CU(cuMemAllocAsync_ptsz)(dptr, bytesize, hStream), hStream, true, NULL);
}

static CUresult alloc_from_pool_async(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    ASYNC_ALLOC(REAL_CU(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, hStream), hStream, false, pool);
}

static CUresult alloc_from_pool_async_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    ASYNC_ALLOC(REAL_CU(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, hStream), hStream, true, pool);
}

#define CAPTURE_STABLE(call)                                                                                       \
    do {                                                                                                           \
        pthread_rwlock_rdlock(&g_capture_rw);                                                                      \
        CUresult rc_ = (call);                                                                                     \
        pthread_rwlock_unlock(&g_capture_rw);                                                                      \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocAsync)(dptr, bytesize, hStream);
    CAPTURE_STABLE(alloc_async(dptr, bytesize, hStream));
}

VC_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0)
        return REAL_CU(cuMemAllocAsync_ptsz)(dptr, bytesize, hStream);
    CAPTURE_STABLE(alloc_async_ptsz(dptr, bytesize, hStream));
}

VC_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0 || pool == NULL)
        return REAL_CU(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, hStream);
    CAPTURE_STABLE(alloc_from_pool_async(dptr, bytesize, pool, hStream));
}

VC_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()) || dptr == NULL || bytesize == 0 || pool == NULL)
        return REAL_CU(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, hStream);
    CAPTURE_STABLE(alloc_from_pool_async_ptsz(dptr, bytesize, pool, hStream));
}

/*
 * Beginning or ending a capture, or changing a device's current pool, waits for the stream-ordered allocations and
 * frees between their check and call.
 */
#define CAPTURE_CHANGE(call)                                                                                       \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited()))                                                                              \
            return (call);                                                                                         \
        pthread_rwlock_wrlock(&g_capture_rw);                                                                      \
        CUresult rc_ = (call);                                                                                     \
        pthread_rwlock_unlock(&g_capture_rw);                                                                      \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    CAPTURE_CHANGE(REAL_CU(cuDeviceSetMemPool)(dev, pool));
}

VC_EXPORT CUresult cuStreamBeginCapture(CUstream hStream)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamBeginCapture)(hStream));
}

VC_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamBeginCapture_ptsz)(hStream));
}

VC_EXPORT CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamBeginCapture_v2)(hStream, mode));
}

VC_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamBeginCapture_v2_ptsz)(hStream, mode));
}

VC_EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
                                               const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                               CUstreamCaptureMode mode)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamBeginCaptureToGraph)(hStream, hGraph, dependencies, dependencyData, numDependencies,
                                                        mode));
}

VC_EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
                                                    const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                                    CUstreamCaptureMode mode)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamBeginCaptureToGraph_ptsz)(hStream, hGraph, dependencies, dependencyData,
                                                             numDependencies, mode));
}

VC_EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamEndCapture)(hStream, phGraph));
}

VC_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    CAPTURE_CHANGE(REAL_CU(cuStreamEndCapture_ptsz)(hStream, phGraph));
}

/* After a free (of any kind) that succeeded: a pool allocation settles its pool. */
static void freed(const struct vc_map_entry *e)
{
    if (e->aux2 != 0) {
        CUmemoryPool pool = (CUmemoryPool)(uintptr_t)e->aux2;
        pthread_mutex_lock(pool_mu(pool));
        pool_settle(pool, pool_reserved_now(pool), 0, -(int64_t)e->aux);
        pthread_mutex_unlock(pool_mu(pool));
    }
}

/*
 * A plain allocation (cuMemAlloc, pitch, managed) freed with cuMemFreeAsync: the GPU frees it when the stream
 * reaches the free, after the work queued before it, not when the call returns.  So its bytes stay charged
 * until an event recorded right after the free completes: polled before a reservation is refused and before
 * a memory view answers (vc_memory_refresh_pools), and at each such free.  Where the stream cannot be
 * followed (no event: another context's stream, out of host memory), NVML tells whether the GPU still holds
 * the memory (the bytes are handed over to the reconciliation).
 */
#define ORDERED_FREES_MAX 4096

struct ordered_free {
    CUevent ev;
    uint64_t ctx; /* the context the event is in: destroyed with it (vc_memory_context_destroyed) */
    uint64_t bytes;
};

static pthread_mutex_t g_of_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ordered_free *g_of; /* under g_of_mu */
static size_t g_of_n, g_of_cap;
static _Atomic size_t g_of_count; /* g_of_n, read without the lock */
#define OF_DYING_MAX 16
static uint64_t g_of_dying[OF_DYING_MAX]; /* contexts being destroyed (vc_memory_context_dying), under g_of_mu */
static unsigned g_of_ndying;

static bool of_dying(uint64_t ctx)
{
    for (unsigned i = 0; i < g_of_ndying; i++)
        if (g_of_dying[i] == ctx)
            return true;
    return false;
}

static void ordered_frees_atfork_child(void)
{
    /* The parent's events and bytes: its slot's, not the child's. */
    g_of = NULL;
    g_of_n = g_of_cap = 0;
    g_of_ndying = 0; /* the parent's destroys */
    atomic_store(&g_of_count, 0);
    pthread_mutex_init(&g_of_mu, NULL);
}

/* Credits the frees whose stream got there; the bytes credited. */
static uint64_t ordered_frees_done(void)
{
    if (atomic_load_explicit(&g_of_count, memory_order_relaxed) == 0)
        return 0;
    uint64_t credited = 0;
    pthread_mutex_lock(&g_of_mu);
    for (size_t i = 0; i < g_of_n;) {
        /* NOT_READY: still queued; anything else (done, or its context is gone and took the memory): freed.  Its
         * context being destroyed: the event may be freed (vc_memory_context_destroyed settles it). */
        if ((g_of_ndying > 0 && of_dying(g_of[i].ctx)) || REAL_CU(cuEventQuery)(g_of[i].ev) == CUDA_ERROR_NOT_READY) {
            i++;
            continue;
        }
        REAL_CU(cuEventDestroy_v2)(g_of[i].ev);
        credited += g_of[i].bytes;
        g_of[i] = g_of[--g_of_n];
    }
    atomic_store(&g_of_count, g_of_n);
    pthread_mutex_unlock(&g_of_mu);
    vc_budget_release(credited);
    return credited;
}

/*
 * A context is being destroyed (vc_context.c): the driver frees the events of the frees queued in it, at a moment
 * nobody can tell.  From before the destroy until they are forgotten, they are not asked for (ordered_frees_done
 * passes them by); forgotten only after the destroy returned, another thread's look at the queued frees could ask
 * for one in between.  No lock is held across the destroy (it waits for the context's work).  Whether their memory
 * is free by now, the GPU tells: the bytes are handed over to the reconciliation, once the context's own charge is
 * gone (else it would stand in for them).
 */
void vc_memory_context_dying(CUcontext ctx)
{
    if (ctx == NULL)
        return;
    for (;;) {
        pthread_mutex_lock(&g_of_mu);
        bool room = g_of_ndying < OF_DYING_MAX;
        if (room)
            g_of_dying[g_of_ndying++] = (uint64_t)(uintptr_t)ctx;
        pthread_mutex_unlock(&g_of_mu);
        if (room)
            return;
        usleep(50); /* OF_DYING_MAX destroys at once: one of them ends soon */
    }
}

/* The bytes of the frees queued in ctx when it is gone (0 when it is not). */
uint64_t vc_memory_context_destroyed(CUcontext ctx, bool gone)
{
    if (ctx == NULL)
        return 0;
    uint64_t bytes = 0, key = (uint64_t)(uintptr_t)ctx;
    pthread_mutex_lock(&g_of_mu);
    for (unsigned i = 0; i < g_of_ndying; i++) {
        if (g_of_dying[i] == key) {
            g_of_dying[i] = g_of_dying[--g_of_ndying];
            break;
        }
    }
    for (size_t i = 0; gone && i < g_of_n;) {
        if (g_of[i].ctx != key) {
            i++;
            continue;
        }
        bytes += g_of[i].bytes;
        g_of[i] = g_of[--g_of_n];
    }
    atomic_store(&g_of_count, g_of_n);
    pthread_mutex_unlock(&g_of_mu);
    return bytes;
}

void vc_memory_ordered_frees_handover(uint64_t bytes)
{
    if (bytes > 0) {
        bool kept;
        vc_budget_settle_untracked(bytes, &kept);
    }
}

static bool ordered_free_push(CUevent ev, uint64_t ctx, uint64_t bytes)
{
    bool ok = true;
    pthread_mutex_lock(&g_of_mu);
    if (g_of_n == g_of_cap) {
        size_t cap = g_of_cap ? g_of_cap * 2 : 16;
        struct ordered_free *n = cap <= ORDERED_FREES_MAX ? realloc(g_of, cap * sizeof(*n)) : NULL;
        if (n == NULL)
            ok = false;
        else
            g_of = n, g_of_cap = cap;
    }
    if (ok) {
        g_of[g_of_n++] = (struct ordered_free){ev, ctx, bytes};
        atomic_store(&g_of_count, g_of_n);
    }
    pthread_mutex_unlock(&g_of_mu);
    return ok;
}

static void ordered_free(CUstream s, bool ptsz, uint64_t bytes)
{
    ordered_frees_done(); /* the list holds only frees still queued */
    CUevent ev = NULL;
    if (REAL_CU(cuEventCreate)(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
        CUresult rc = ptsz ? REAL_CU(cuEventRecord_ptsz)(ev, s) : REAL_CU(cuEventRecord)(ev, s);
        if (rc == CUDA_SUCCESS && ordered_free_push(ev, current_ctx(), bytes))
            return;
        REAL_CU(cuEventDestroy_v2)(ev);
    }
    bool kept;
    vc_budget_settle_untracked(bytes, &kept);
}

static CUresult free_async(CUdeviceptr dptr, CUstream s, bool ptsz)
{
    struct vc_map_entry e;
    bool had = take(dptr, REC_DEV, &e);
    CUresult rc = ptsz ? REAL_CU(cuMemFreeAsync_ptsz)(dptr, s) : REAL_CU(cuMemFreeAsync)(dptr, s);
    if (rc != CUDA_SUCCESS) {
        if (had)
            put_back(&e);
        return rc;
    }
    if (!had) {
        galloc_free(dptr, s, ptsz); /* a graph allocation: in a capture, or launched */
    } else if (e.aux2 != 0) {
        vc_budget_release(e.size); /* a pool's allocation (no bytes of its own): its pool settles */
        freed(&e);
    } else if (capture_graph(s, ptsz) != NULL) {
        vc_budget_release(e.size); /* captured (no event may be recorded into the caller's graph) */
    } else {
        ordered_free(s, ptsz, e.size);
    }
    return rc;
}

VC_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemFreeAsync)(dptr, hStream);
    CAPTURE_STABLE(free_async(dptr, hStream, false));
}

VC_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemFreeAsync_ptsz)(dptr, hStream);
    CAPTURE_STABLE(free_async(dptr, hStream, true));
}

/* Trimming, a new release threshold, destruction: what the pool holds changes. */
VC_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemPoolTrimTo)(pool, minBytesToKeep);
    pthread_mutex_lock(pool_mu(pool));
    CUresult rc = REAL_CU(cuMemPoolTrimTo)(pool, minBytesToKeep);
    if (rc == CUDA_SUCCESS)
        pool_settle(pool, pool_reserved_now(pool), 0, 0);
    pthread_mutex_unlock(pool_mu(pool));
    return rc;
}

VC_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemPoolSetAttribute)(pool, attr, value);
    pthread_mutex_lock(pool_mu(pool));
    CUresult rc = REAL_CU(cuMemPoolSetAttribute)(pool, attr, value);
    if (rc == CUDA_SUCCESS)
        pool_settle(pool, pool_reserved_now(pool), 0, 0);
    pthread_mutex_unlock(pool_mu(pool));
    return rc;
}

/*
 * cuda.h: with allocations outstanding, a destroyed pool's resources go once they are all freed.  Until then it
 * holds whole segments, the free memory between its live allocations too (a hole before a live allocation
 * cannot be given back), so it stays charged what it reserves once trimmed, not only its live bytes.
 */
VC_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemPoolDestroy)(pool);
    pthread_rwlock_wrlock(&g_capture_rw); /* a device's current pool may change (cuMemAllocAsync) */
    pthread_mutex_lock(pool_mu(pool));
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *p = vc_map_lookup(&g_recs, (uint64_t)(uintptr_t)pool, REC_POOL);
    bool outstanding = p != NULL && !p->gpu && p->aux > 0;
    pthread_mutex_unlock(&g_mu);
    uint64_t keeps = 0;
    if (outstanding) { /* what the destruction cannot give back */
        REAL_CU(cuMemPoolTrimTo)(pool, 0);
        keeps = pool_reserved_now(pool);
    }
    CUresult rc = REAL_CU(cuMemPoolDestroy)(pool);
    if (rc == CUDA_SUCCESS) {
        pool_settle(pool, keeps, 0, 0);
        pthread_mutex_lock(&g_mu);
        p = vc_map_lookup(&g_recs, (uint64_t)(uintptr_t)pool, REC_POOL);
        if (p != NULL) {
            p->gpu = 1; /* destroyed: it can no longer be asked */
            if (p->aux == 0) {
                vc_budget_release(p->size);
                vc_map_find(&g_recs, p->key, REC_POOL, NULL, true);
            }
        }
        pthread_mutex_unlock(&g_mu);
    } else if (outstanding) {
        pool_settle(pool, pool_reserved_now(pool), 0, 0); /* not destroyed: trimmed all the same */
    }
    pthread_mutex_unlock(pool_mu(pool));
    pthread_rwlock_unlock(&g_capture_rw);
    return rc;
}

/* ---- virtual memory management ------------------------------------------------------------ */

/*
 * cuda.h: cuMemRelease gives up the handle; the memory is freed when its last mapping is unmapped.
 * So a cuMemCreate'd allocation stays charged while it has a handle reference (cuMemCreate, and one
 * per cuMemRetainAllocationHandle) or a mapping.  Imported allocations (cuMemImportFromShareableHandle)
 * are the exporter's: never recorded, never charged, never credited.  An allocation that was exported may
 * outlive the exporter's last handle and mapping: a handle imported from it (in this process or another)
 * keeps the memory alive, and no hook can tell which allocation an import refers to.  So when the last
 * reference this process knows of goes, its bytes are handed over to the reconciliation with NVML
 * (vc_budget_settle_untracked, after the driver call): still held by the GPU for the container's
 * processes, they stay charged (as memory no hook sees) until the GPU frees them.
 */
VC_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    /* Only device memory counts: NCCL creates host memory here too. */
    if (VC_LIKELY(!vc_limited()) || handle == NULL || size == 0 || prop == NULL ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL_CU(cuMemCreate)(handle, size, prop, flags);
    if (!vc_budget_reserve(size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = REAL_CU(cuMemCreate)(handle, size, prop, flags);
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(size);
        return rc;
    }
    struct vc_map_entry e = {.key = *handle, .kind = REC_VMM, .size = size, .gpu = 1, .aux = 0};
    pthread_mutex_lock(&g_mu);
    int put = vc_map_put(&g_recs, &e);
    pthread_mutex_unlock(&g_mu);
    if (put != 0)
        vc_log(VC_LOG_ERROR, "out of host memory: %llu bytes stay charged until this process exits",
               (unsigned long long)size);
    return rc;
}

/*
 * Returns the allocation's bytes when nothing refers to it any more (g_mu held; the entry is in the map).
 * An exported allocation's bytes are not returned here: the caller hands the returned size over to the
 * reconciliation once g_mu is released and the driver has dropped the reference (handover_exported).
 */
static uint64_t vmm_settle(struct vc_map_entry *e)
{
    if (e->gpu == 0 && e->aux == 0) {
        uint64_t size = e->size;
        bool exported = e->aux2 != 0;
        vc_map_find(&g_recs, e->key, REC_VMM, NULL, true);
        if (!exported) {
            vc_budget_release(size);
            return 0;
        }
        return size;
    }
    return 0;
}

/* An exported allocation lost its last reference here: the GPU may still hold it for an imported handle. */
static void handover_exported(uint64_t bytes)
{
    if (bytes == 0)
        return;
    bool kept;
    vc_budget_settle_untracked(bytes, &kept);
    vc_log(VC_LOG_DEBUG, "an exported allocation of %llu bytes lost its last reference here: %s",
           (unsigned long long)bytes, kept ? "NVML cannot tell, it stays charged" : "reconciled with NVML");
}

static struct vc_map_entry *vmm_entry(uint64_t handle)
{
    return vc_map_lookup(&g_recs, handle, REC_VMM);
}

VC_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemRelease)(handle);
    /* The reference goes first (a concurrent cuMemCreate may get the same handle once the driver freed it). */
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vmm_entry(handle);
    bool had = e != NULL && e->gpu > 0;
    struct vc_map_entry saved;
    uint64_t handover = 0;
    if (had) {
        saved = *e;
        e->gpu--;
        handover = vmm_settle(e);
    }
    pthread_mutex_unlock(&g_mu);
    CUresult rc = REAL_CU(cuMemRelease)(handle);
    if (rc == CUDA_SUCCESS)
        handover_exported(handover);
    if (rc != CUDA_SUCCESS && had) {
        pthread_mutex_lock(&g_mu);
        e = vmm_entry(handle);
        if (e != NULL) {
            e->gpu++;
        } else { /* it was the last reference: charge it again (an exported one's charge was kept) */
            if (handover == 0)
                vc_budget_charge(saved.size); /* the driver still holds it: charged whatever the limit */
            if (vc_map_put(&g_recs, &saved) != 0)
                vc_log(VC_LOG_ERROR, "out of host memory: %llu bytes stay charged until this process exits",
                       (unsigned long long)saved.size);
        }
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

VC_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    CUresult rc = REAL_CU(cuMemRetainAllocationHandle)(handle, addr);
    if (VC_LIKELY(!vc_limited()) || rc != CUDA_SUCCESS || handle == NULL)
        return rc;
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vmm_entry(*handle);
    if (e != NULL)
        e->gpu++;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/*
 * The mapping is counted before the driver is called: a cuMemRelease of the handle in another thread
 * while the driver maps it must not return the bytes the mapping is about to keep alive.
 */
VC_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemMap)(ptr, size, offset, handle, flags);
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vmm_entry(handle);
    bool ours = e != NULL;
    if (ours)
        e->aux++;
    pthread_mutex_unlock(&g_mu);
    CUresult rc = REAL_CU(cuMemMap)(ptr, size, offset, handle, flags);
    if (!ours)
        return rc;
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry m = {.key = ptr, .kind = REC_MAP, .size = size, .aux = handle};
    uint64_t handover = 0;
    if (rc != CUDA_SUCCESS || vc_map_put(&g_recs, &m) != 0) {
        e = vmm_entry(handle); /* looked up again: the map may have changed meanwhile */
        if (rc == CUDA_SUCCESS)
            vc_log(VC_LOG_ERROR, "out of host memory: a mapping's allocation stays charged until this process exits");
        else if (e != NULL && e->aux > 0) {
            e->aux--;
            handover = vmm_settle(e);
        }
    }
    pthread_mutex_unlock(&g_mu);
    handover_exported(handover);
    return rc;
}

struct va_range {
    uint64_t lo, hi;
    uint64_t handover; /* exported allocations whose last mapping here went (map_gone) */
};

static bool map_in_range(const struct vc_map_entry *e, void *arg)
{
    const struct va_range *r = arg;
    return e->key >= r->lo && e->key < r->hi;
}

static void map_gone(const struct vc_map_entry *m, void *arg)
{
    struct va_range *r = arg;
    struct vc_map_entry *e = vmm_entry(m->aux);
    if (e != NULL && e->aux > 0) {
        e->aux--;
        r->handover += vmm_settle(e);
    }
}

VC_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult rc = REAL_CU(cuMemUnmap)(ptr, size);
    if (VC_LIKELY(!vc_limited()) || rc != CUDA_SUCCESS)
        return rc;
    struct va_range r = {ptr, ptr + size, 0};
    pthread_mutex_lock(&g_mu);
    vc_map_remove_if(&g_recs, REC_MAP, map_in_range, map_gone, &r);
    pthread_mutex_unlock(&g_mu);
    handover_exported(r.handover);
    return rc;
}

/* An exported allocation may be held by imported handles once this process lets it go (above). */
VC_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                CUmemAllocationHandleType handleType, unsigned long long flags)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuMemExportToShareableHandle)(shareableHandle, handle, handleType, flags);
    /* Marked before the driver call: a release racing the export in another thread must not credit it. */
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vmm_entry(handle);
    if (e != NULL)
        e->aux2 = 1;
    pthread_mutex_unlock(&g_mu);
    return REAL_CU(cuMemExportToShareableHandle)(shareableHandle, handle, handleType, flags);
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

/*
 * An upper bound of an array's footprint from its description, reserved before the driver is
 * called (the driver's own cuArrayGetMemoryRequirements settles it afterwards).  Arrays are laid out
 * in tiles: rows padded (pitch alignment 512 bytes covers the 64-byte GOB rows and the simulated
 * driver), heights padded to the largest block height (16 GOBs of 8 rows), depths to the largest
 * block depth (32) unless the array is layered (then every layer is padded on its own), and the
 * whole rounded up to the 2 MiB page the driver maps it with.
 */
#define ARRAY_ROW_ALIGN 512ull
#define ARRAY_BLOCK_ROWS 128ull
#define ARRAY_BLOCK_DEPTH 32ull
#define ARRAY_PAGE (2ull << 20)

static uint64_t round_up(uint64_t v, uint64_t to)
{
    return v > UINT64_MAX - to ? UINT64_MAX : (v + to - 1) / to * to;
}

static uint64_t pow2_ceil(uint64_t v)
{
    uint64_t p = 1;
    while (p < v && p < (1ull << 62))
        p <<= 1;
    return p;
}

/* A block is at most 16 GOBs of 8 rows high and 32 deep, and no larger than the array needs. */
static uint64_t level_bound(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned channels, bool layered)
{
    uint64_t row = round_up(mul_sat(w ? w : 1, (uint64_t)format_bytes(f) * (channels ? channels : 1)), ARRAY_ROW_ALIGN);
    uint64_t rows = 1;
    if (h) {
        uint64_t gobs = (h + 7) / 8, block = pow2_ceil(gobs);
        rows = round_up(gobs, block < ARRAY_BLOCK_ROWS / 8 ? block : ARRAY_BLOCK_ROWS / 8) * 8;
    }
    uint64_t depth = 1;
    if (d) {
        uint64_t block = pow2_ceil(d);
        depth = layered ? d : round_up(d, block < ARRAY_BLOCK_DEPTH ? block : ARRAY_BLOCK_DEPTH);
    }
    return mul_sat(mul_sat(row, rows), depth);
}

/* Sparse and deferred-mapping arrays get their memory from cuMemCreate + cuMemMapArrayAsync (charged there). */
static bool array_unbacked(unsigned flags)
{
    return (flags & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING)) != 0;
}

static uint64_t array_bound(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels, unsigned flags)
{
    if (array_unbacked(flags))
        return 0;
    bool layered = (flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    return round_up(level_bound(w, h, d, f, channels, layered), ARRAY_PAGE);
}

static uint64_t mipmap_bound(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    if (array_unbacked(d->Flags))
        return 0;
    bool layered = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    uint64_t sum = 0;
    for (unsigned l = 0; l < levels && l < 64; l++) {
        uint64_t w = d->Width >> l, h = d->Height >> l, dd = layered ? d->Depth : d->Depth >> l;
        uint64_t b = level_bound(w ? w : 1, d->Height ? (h ? h : 1) : 0, d->Depth ? (dd ? dd : 1) : 0, d->Format,
                                 d->NumChannels, layered);
        sum = sum > UINT64_MAX - b ? UINT64_MAX : sum + b;
    }
    return round_up(sum, ARRAY_PAGE);
}

/* After the array exists: its real size (cuArrayGetMemoryRequirements), or the bound if the driver cannot tell. */
static uint64_t array_actual(void *array, bool mipmap, uint64_t bound)
{
    CUdevice dev;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    memset(&req, 0, sizeof(req));
    if (REAL_CU(cuCtxGetDevice)(&dev) != CUDA_SUCCESS)
        return bound;
    CUresult rc = mipmap ? REAL_CU(cuMipmappedArrayGetMemoryRequirements)(&req, (CUmipmappedArray)array, dev)
                         : REAL_CU(cuArrayGetMemoryRequirements)(&req, (CUarray)array, dev);
    return rc == CUDA_SUCCESS && req.size > 0 ? req.size : bound;
}

/*
 * Reserve the bound, create with call, settle on the real size (returning the difference).  A real
 * size above the bound (a layout the bound does not know) is charged too, or the array destroyed
 * and refused if that does not fit; it is logged, since the GPU then held it for a moment.
 */
#define ARRAY_CREATE(bound, call, handle, mipmap, destroy)                                                         \
    do {                                                                                                           \
        uint64_t bound_ = (bound);                                                                                 \
        if (!vc_budget_reserve(bound_))                                                                            \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                                 \
            vc_budget_release(bound_);                                                                             \
            return rc_;                                                                                            \
        }                                                                                                          \
        uint64_t actual_ = bound_ == 0 ? 0 : array_actual((void *)*(handle), (mipmap), bound_);                  \
        if (actual_ > bound_)                                                                                      \
            vc_log(VC_LOG_WARN, "an array took %llu bytes, more than the %llu reserved for it",                  \
                   (unsigned long long)actual_, (unsigned long long)bound_);                                      \
        if (true_up(bound_, actual_) != CUDA_SUCCESS) {                                                            \
            destroy(*(handle));                                                                                    \
            vc_budget_release(bound_);                                                                             \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
        remember((uint64_t)(uintptr_t) * (handle), (mipmap) ? REC_MIPMAP : REC_ARRAY, actual_, true);              \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArrayCreate_v2)(pHandle, d);
    ARRAY_CREATE(array_bound(d->Width, d->Height, 0, d->Format, d->NumChannels, 0),
                 REAL_CU(cuArrayCreate_v2)(pHandle, d), pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArrayCreate)(pHandle, d);
    ARRAY_CREATE(array_bound(d->Width, d->Height, 0, d->Format, d->NumChannels, 0), REAL_CU(cuArrayCreate)(pHandle, d),
                 pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArray3DCreate_v2)(pHandle, d);
    ARRAY_CREATE(array_bound(d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags),
                 REAL_CU(cuArray3DCreate_v2)(pHandle, d), pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuArray3DCreate)(pHandle, d);
    ARRAY_CREATE(array_bound(d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags),
                 REAL_CU(cuArray3DCreate)(pHandle, d), pHandle, false, REAL_CU(cuArrayDestroy));
}

VC_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                          unsigned int numMipmapLevels)
{
    if (VC_LIKELY(!vc_limited()) || pHandle == NULL || d == NULL)
        return REAL_CU(cuMipmappedArrayCreate)(pHandle, d, numMipmapLevels);
    ARRAY_CREATE(mipmap_bound(d, numMipmapLevels), REAL_CU(cuMipmappedArrayCreate)(pHandle, d, numMipmapLevels),
                 pHandle, true, REAL_CU(cuMipmappedArrayDestroy));
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

/*
 * cuda.h: an allocation node's address is fixed when the node is made; its memory is the graph's
 * exec's (one instantiation at a time); a launch that does not free it in the graph leaves it live
 * after the graph ran, until cuMemFree/cuMemFreeAsync of its address; destroying the graph frees
 * nothing.  So it is charged from the node's creation (before the driver backs it) until none of
 * these holds it: its graph (or node), an exec, a launch.  REC_GALLOC keeps that per address.
 */

/*
 * The device's graph memory pool keeps what graph allocations gave back (cached for later graphs) until
 * cuDeviceGraphMemTrim: the GPU holds CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT for the process.  So an
 * allocation nothing holds any more is not credited at once: its bytes become `pending`, and
 * graph_pool_settle (called after every such change, under g_graph_mu with the driver call that made it)
 * charges the pools what they reserve beyond the graph allocations charged (`kept`), netting the two in
 * one step: the charge is max(graph allocations, pools' reservation), never below what the GPU holds
 * now or will hold once they are all backed (they take the pools' kept memory first, as a new allocation
 * node takes `kept` first).  Summed over the devices.
 */

/* Its exec (instantiation, or a launch) backs the allocation (g_mu held): the GPU holds all of its charge now. */
static void galloc_backed(struct vc_map_entry *e)
{
    if (e->ctx != 0) {
        vc_budget_note_unbacked(-(int64_t)e->ctx);
        e->ctx = 0;
    }
}

/* Returns the bytes when nothing holds the allocation any more (g_mu held; e is in the map). */
static void galloc_settle(struct vc_map_entry *e)
{
    if (e->aux == 0 && e->aux2 == 0 && !(e->gpu & GA_OUTSTANDING)) {
        galloc_backed(e); /* its charge goes (as pending) whether or not a launch backed it */
        g_graph_pending += e->size;
        g_galloc_bytes -= e->size;
        vc_map_find(&g_recs, e->key, REC_GALLOC, NULL, true);
        g_gallocs--;
    }
}

/* g_graph_mu held: settles the graph pools' charge on what they reserve now; returns the bytes given back. */
static uint64_t graph_pool_settle(void)
{
    if (!atomic_load_explicit(&g_graph_seen, memory_order_relaxed))
        return 0;
    int count = 0;
    uint64_t reserved = 0;
    if (REAL_CU(cuDeviceGetCount)(&count) == CUDA_SUCCESS) {
        for (int dev = 0; dev < count; dev++) {
            cuuint64_t v = 0;
            if (REAL_CU(cuDeviceGetGraphMemAttribute)(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &v) == CUDA_SUCCESS)
                reserved += v;
        }
    }
    pthread_mutex_lock(&g_mu);
    uint64_t target = reserved > g_galloc_bytes ? reserved - g_galloc_bytes : 0;
    uint64_t before = g_graph_kept + g_graph_pending, released = before > target ? before - target : 0;
    if (target > before)
        vc_budget_charge(target - before); /* the pool holds it already */
    else
        vc_budget_release(released);
    g_graph_kept = target;
    g_graph_pending = 0;
    pthread_mutex_unlock(&g_mu);
    return released;
}

/*
 * g_graph_mu held: reserves a new graph allocation; what the graph pools keep serves first (*took).  The rest is
 * charged before the GPU holds it (until its graph is instantiated), and noted so: a reconciliation must not
 * take this charge for memory the GPU holds, or it would stand in for memory no hook charged (a module, a bigger
 * heap), and the GPU would hold both once the graph runs.
 */
static bool galloc_reserve(uint64_t bytes, uint64_t *took)
{
    pthread_mutex_lock(&g_mu);
    *took = bytes < g_graph_kept ? bytes : g_graph_kept;
    g_graph_kept -= *took;
    pthread_mutex_unlock(&g_mu);
    if (vc_budget_reserve(bytes - *took)) {
        vc_budget_note_unbacked((int64_t)(bytes - *took));
        return true;
    }
    galloc_unreserve(*took, *took); /* nothing was reserved beyond what the pools keep */
    return false;
}

/* Undoes galloc_reserve(bytes, &took). */
static void galloc_unreserve(uint64_t bytes, uint64_t took)
{
    pthread_mutex_lock(&g_mu);
    g_graph_kept += took;
    pthread_mutex_unlock(&g_mu);
    vc_budget_note_unbacked(-(int64_t)(bytes - took));
    vc_budget_release(bytes - took);
}

/* cuMemFree(Async) of an address that is no plain allocation: a graph allocation freed in a capture or after a launch. */
static bool galloc_free(uint64_t dptr, CUstream capturing_stream, bool ptsz)
{
    if (__atomic_load_n(&g_gallocs, __ATOMIC_RELAXED) == 0)
        return false;
    CUgraph capture = capturing_stream != NULL ? capture_graph(capturing_stream, ptsz) : NULL;
    if (capture == NULL)
        pthread_mutex_lock(&g_graph_mu);
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vc_map_lookup(&g_recs, dptr, REC_GALLOC);
    bool hit = e != NULL;
    if (hit) {
        if (capture != NULL) {
            if (e->aux == (uint64_t)(uintptr_t)capture)
                e->gpu |= GA_FREED_IN_GRAPH; /* a free node of its own graph: each launch gives it back */
        } else {
            e->gpu &= ~(uint32_t)GA_OUTSTANDING;
            galloc_settle(e); /* back to its graph pool */
        }
    }
    pthread_mutex_unlock(&g_mu);
    if (capture == NULL) {
        if (hit)
            graph_pool_settle();
        pthread_mutex_unlock(&g_graph_mu);
    }
    return hit;
}

static void remember_gnode(CUgraphNode node, CUgraph graph, uint64_t dptr)
{
    struct vc_map_entry e = {.key = (uint64_t)(uintptr_t)node, .kind = REC_GNODE, .aux = (uint64_t)(uintptr_t)graph,
                             .aux2 = dptr};
    pthread_mutex_lock(&g_mu);
    if (vc_map_put(&g_recs, &e) != 0)
        vc_log(VC_LOG_ERROR, "out of host memory: a graph node's memory stays charged until this process exits");
    pthread_mutex_unlock(&g_mu);
}

/* Reserve-then-create an allocation node; *dptr is the address the driver fixed for it. */
#define ALLOC_NODE(bytes, call, dptr)                                                                              \
    do {                                                                                                           \
        uint64_t bytes_ = (bytes), took_;                                                                          \
        pthread_mutex_lock(&g_graph_mu);                                                                           \
        if (!galloc_reserve(bytes_, &took_)) {                                                                     \
            pthread_mutex_unlock(&g_graph_mu);                                                                     \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS)                                                                                   \
            galloc_unreserve(bytes_, took_);                                                                       \
        else                                                                                                       \
            remember_galloc((dptr), bytes_, hGraph, bytes_ - took_);                                               \
        pthread_mutex_unlock(&g_graph_mu);                                                                         \
        if (rc_ == CUDA_SUCCESS)                                                                                   \
            remember_gnode(*phGraphNode, hGraph, (dptr));                                                          \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                          size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    if (VC_LIKELY(!vc_limited()) || phGraphNode == NULL || nodeParams == NULL || nodeParams->bytesize == 0)
        return REAL_CU(cuGraphAddMemAllocNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    ALLOC_NODE(nodeParams->bytesize,
               REAL_CU(cuGraphAddMemAllocNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams),
               nodeParams->dptr);
}

/* A free node of the allocation's own graph: each launch gives the memory back. */
static void freed_in_graph(CUgraph graph, uint64_t dptr)
{
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vc_map_lookup(&g_recs, dptr, REC_GALLOC);
    if (e != NULL && e->aux == (uint64_t)(uintptr_t)graph)
        e->gpu |= GA_FREED_IN_GRAPH;
    pthread_mutex_unlock(&g_mu);
}

VC_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                         size_t numDependencies, CUdeviceptr dptr)
{
    CUresult rc = REAL_CU(cuGraphAddMemFreeNode)(phGraphNode, hGraph, dependencies, numDependencies, dptr);
    if (VC_UNLIKELY(vc_limited()) && rc == CUDA_SUCCESS)
        freed_in_graph(hGraph, dptr);
    return rc;
}

/* The generic node API (CUDA 12.2+) adds the same allocation and free nodes. */
VC_EXPORT CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                  size_t numDependencies, CUgraphNodeParams *nodeParams)
{
    if (VC_LIKELY(!vc_limited()) || phGraphNode == NULL || nodeParams == NULL)
        return REAL_CU(cuGraphAddNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    if (nodeParams->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && nodeParams->alloc.bytesize > 0)
        ALLOC_NODE(nodeParams->alloc.bytesize,
                   REAL_CU(cuGraphAddNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams),
                   nodeParams->alloc.dptr);
    CUresult rc = REAL_CU(cuGraphAddNode)(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    if (rc == CUDA_SUCCESS && nodeParams->type == CU_GRAPH_NODE_TYPE_MEM_FREE)
        freed_in_graph(hGraph, nodeParams->free.dptr);
    return rc;
}

VC_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                     const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                     CUgraphNodeParams *nodeParams)
{
    if (VC_LIKELY(!vc_limited()) || phGraphNode == NULL || nodeParams == NULL)
        return REAL_CU(cuGraphAddNode_v2)(phGraphNode, hGraph, dependencies, dependencyData, numDependencies,
                                          nodeParams);
    if (nodeParams->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && nodeParams->alloc.bytesize > 0)
        ALLOC_NODE(nodeParams->alloc.bytesize,
                   REAL_CU(cuGraphAddNode_v2)(phGraphNode, hGraph, dependencies, dependencyData, numDependencies,
                                              nodeParams),
                   nodeParams->alloc.dptr);
    CUresult rc =
        REAL_CU(cuGraphAddNode_v2)(phGraphNode, hGraph, dependencies, dependencyData, numDependencies, nodeParams);
    if (rc == CUDA_SUCCESS && nodeParams->type == CU_GRAPH_NODE_TYPE_MEM_FREE)
        freed_in_graph(hGraph, nodeParams->free.dptr);
    return rc;
}

struct graph_change {
    uint64_t match; /* the graph or exec */
    uint64_t set;   /* the new exec (instantiation) */
};

static void galloc_instantiated(struct vc_map_entry *e, void *arg)
{
    const struct graph_change *c = arg;
    if (e->aux == c->match) {
        e->aux2 = c->set;
        galloc_backed(e); /* the exec's memory from now on */
    }
}

static void galloc_exec_gone(struct vc_map_entry *e, void *arg)
{
    const struct graph_change *c = arg;
    if (e->aux2 == c->match) {
        e->aux2 = 0;
        galloc_settle(e); /* may erase e: vc_map_each allows it */
    }
}

static void galloc_graph_gone(struct vc_map_entry *e, void *arg)
{
    const struct graph_change *c = arg;
    if (e->aux == c->match) {
        e->aux = 0;
        galloc_settle(e);
    }
}

static void galloc_launched(struct vc_map_entry *e, void *arg)
{
    const struct graph_change *c = arg;
    if (e->aux2 != c->match)
        return;
    galloc_backed(e);
    if (!(e->gpu & GA_FREED_IN_GRAPH))
        e->gpu |= GA_OUTSTANDING;
}

static CUresult graph_changed(CUresult rc, void (*fn)(struct vc_map_entry *, void *), uint64_t match, uint64_t set)
{
    if (rc != CUDA_SUCCESS || __atomic_load_n(&g_gallocs, __ATOMIC_RELAXED) == 0)
        return rc;
    struct graph_change c = {match, set};
    pthread_mutex_lock(&g_mu);
    vc_map_each(&g_recs, REC_GALLOC, fn, &c);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

void vc_memory_graph_launched(CUgraphExec exec)
{
    graph_changed(CUDA_SUCCESS, galloc_launched, (uint64_t)(uintptr_t)exec, 0);
}

/* A driver call that changes what the graph pools hold, its bookkeeping and the settlement, under g_graph_mu. */
#define GRAPH_POOL_CHANGE(call, bookkeeping)                                                                       \
    do {                                                                                                           \
        pthread_mutex_lock(&g_graph_mu);                                                                           \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ == CUDA_SUCCESS) {                                                                                 \
            bookkeeping;                                                                                           \
            graph_pool_settle();                                                                                   \
        }                                                                                                          \
        pthread_mutex_unlock(&g_graph_mu);                                                                         \
        return rc_;                                                                                                \
    } while (0)

static CUresult grow_limit(CUlimit limit, size_t old, size_t value);
static bool function_frame(CUfunction f, int *local);
static CUresult stack_at_least(size_t want);

#define GRAPH_WALK_LIMIT 65536 /* graphs (a graph and each child graph in it) looked into for one graph, at most */

/* Pushes child graph c onto the walk's list (grown as needed); false when no memory is left for it. */
static bool walk_push(CUgraph **todo, size_t *top, size_t *room, CUgraph c)
{
    if (*top == *room) {
        size_t grown = *room * 2;
        CUgraph *more = realloc(*todo, grown * sizeof(**todo));
        if (more == NULL)
            return false;
        *todo = more;
        *room = grown;
    }
    (*todo)[(*top)++] = c;
    return true;
}

/*
 * The largest local frame of graph g's kernels, those of its child graphs at any depth too (0: none bigger than
 * nothing); -1 when they cannot all be looked at (a kernel node whose function's frame cannot be told, more than
 * GRAPH_WALK_LIMIT graphs, or no host memory for the walk): the caller refuses (stack_for).  The walk keeps its own list: a graph nested thousands deep costs no call stack.
 */
static int graph_frame(CUgraph g)
{
    size_t room = 16, top = 0, seen = 0;
    CUgraph *todo = malloc(room * sizeof(*todo));
    if (todo == NULL)
        return -1;
    todo[top++] = g;
    int most = 0;
    while (top > 0 && most >= 0) {
        CUgraph cur = todo[--top];
        size_t n = 0;
        if (++seen > GRAPH_WALK_LIMIT) {
            most = -1;
            break;
        }
        if (REAL_CU(cuGraphGetNodes)(cur, NULL, &n) != CUDA_SUCCESS || n == 0)
            continue;
        CUgraphNode *nodes = malloc(n * sizeof(*nodes));
        if (nodes == NULL) {
            most = -1;
            break;
        }
        if (REAL_CU(cuGraphGetNodes)(cur, nodes, &n) == CUDA_SUCCESS) {
            for (size_t i = 0; i < n && most >= 0; i++) {
                CUgraphNodeType t;
                int local = 0;
                CUDA_KERNEL_NODE_PARAMS_v2 p;
                CUgraph child;
                if (REAL_CU(cuGraphNodeGetType)(nodes[i], &t) != CUDA_SUCCESS)
                    continue;
                if (t == CU_GRAPH_NODE_TYPE_KERNEL) {
                    if (REAL_CU(cuGraphKernelNodeGetParams_v2)(nodes[i], &p) != CUDA_SUCCESS ||
                        !function_frame(p.func != NULL ? p.func : (CUfunction)p.kern, &local))
                        most = -1; /* a kernel whose frame cannot be told */
                } else if (t == CU_GRAPH_NODE_TYPE_GRAPH &&
                         REAL_CU(cuGraphChildGraphNodeGetGraph)(nodes[i], &child) == CUDA_SUCCESS &&
                         !walk_push(&todo, &top, &room, child))
                    most = -1;
                if (local > most && most >= 0)
                    most = local;
            }
        }
        free(nodes);
    }
    free(todo);
    return most;
}

/*
 * The current context's stack grown to want bytes per thread, when it is smaller.  One thread at a time: two that read
 * the same old value would each set theirs, the smaller last (a shrink the next launch regrows uncharged), and a
 * refusal restores the value read.  The call is made in relaxed capture mode for this thread: a stack set while
 * another thread captures in global mode must not end that capture.
 */
static pthread_mutex_t g_stack_mu = PTHREAD_MUTEX_INITIALIZER;

static CUresult stack_at_least(size_t want)
{
    CUresult rc = CUDA_SUCCESS;
    size_t old = 0;
    pthread_mutex_lock(&g_stack_mu);
    if (REAL_CU(cuCtxGetLimit)(&old, CU_LIMIT_STACK_SIZE) != CUDA_SUCCESS) {
        rc = CUDA_ERROR_INVALID_CONTEXT; /* no context to grow it in: nothing the kernels may run in is checked */
    } else if (want > old) {
        CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        bool exchanged = REAL_CU(cuThreadExchangeStreamCaptureMode)(&mode) == CUDA_SUCCESS;
        rc = grow_limit(CU_LIMIT_STACK_SIZE, old, want);
        if (exchanged)
            REAL_CU(cuThreadExchangeStreamCaptureMode)(&mode);
    }
    pthread_mutex_unlock(&g_stack_mu);
    return rc;
}

/* Notes an exec's kernels' largest frame (the larger of what is noted already and frame) for its launches. */
static void exec_frame_note(CUgraphExec exec, int frame)
{
    if (exec == NULL || frame <= (int)VC_DEFAULT_STACK)
        return;
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vc_map_lookup(&g_recs, (uint64_t)(uintptr_t)exec, REC_GEXEC);
    int rc = 0;
    if (e != NULL) {
        if ((uint64_t)frame > e->aux)
            e->aux = (uint64_t)frame;
    } else {
        struct vc_map_entry fresh = {.key = (uint64_t)(uintptr_t)exec, .kind = REC_GEXEC, .aux = (uint64_t)frame};
        rc = vc_map_put(&g_recs, &fresh);
    }
    pthread_mutex_unlock(&g_mu);
    if (rc != 0) /* its launches in another context go unchecked: said once per exec */
        vc_log(VC_LOG_ERROR, "out of host memory: a graph's kernels' frame is not kept for its launches");
}

/* The current context's stack grown to frame (a launch's kernels' largest) before the driver would grow it. */
static CUresult stack_for(int frame)
{
    if (frame < 0) {
        vc_log(VC_LOG_WARN, "a graph's kernels could not all be looked at for their stack (a kernel whose frame cannot "
                            "be told, more than %d graphs nested in it, or no host memory left): refused under the "
                            "memory limit",
               GRAPH_WALK_LIMIT);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return frame > (int)VC_DEFAULT_STACK ? stack_at_least((size_t)frame) : CUDA_SUCCESS;
}

/*
 * A graph's kernels grow the stack of the context it runs in as a launch of each would (an H200, driver 580: a graph of
 * one kernel with a 64 KiB frame took the GPU from 1028 to 17660 MiB at its launch, in a container at its 1024 MiB
 * cap).  So before a graph is instantiated (or an exec updated from one) the stack is grown to its kernels' largest
 * frame, refused with CUDA_ERROR_OUT_OF_MEMORY when it does not fit.
 */
#define INSTANTIATED(call, exec, graph)                                                                            \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited()) || (exec) == NULL)                                                            \
            return (call);                                                                                         \
        int frame_ = graph_frame(graph);                                                                           \
        CUresult st_ = stack_for(frame_);                                                                          \
        if (st_ != CUDA_SUCCESS)                                                                                   \
            return st_;                                                                                            \
        GRAPH_POOL_CHANGE(call, (graph_changed(rc_, galloc_instantiated, (uint64_t)(uintptr_t)(graph),             \
                                               (uint64_t)(uintptr_t) * (exec)),                                    \
                                 exec_frame_note(*(exec), frame_)));                                               \
    } while (0)

VC_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                      char *logBuffer, size_t bufferSize)
{
    INSTANTIATED(REAL_CU(cuGraphInstantiate)(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize), phGraphExec,
                 hGraph);
}

VC_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                         char *logBuffer, size_t bufferSize)
{
    INSTANTIATED(REAL_CU(cuGraphInstantiate_v2)(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize), phGraphExec,
                 hGraph);
}

VC_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    INSTANTIATED(REAL_CU(cuGraphInstantiateWithFlags)(phGraphExec, hGraph, flags), phGraphExec, hGraph);
}

VC_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    INSTANTIATED(REAL_CU(cuGraphInstantiateWithParams)(phGraphExec, hGraph, instantiateParams), phGraphExec, hGraph);
}

VC_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                     CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    INSTANTIATED(REAL_CU(cuGraphInstantiateWithParams_ptsz)(phGraphExec, hGraph, instantiateParams), phGraphExec,
                 hGraph);
}

/* The frame of a kernel node's new function (or CUkernel); -1 when it cannot be told. */
static int params_frame(CUfunction func, CUkernel kern)
{
    int local = 0;
    return function_frame(func != NULL ? func : (CUfunction)kern, &local) ? local : -1;
}

/*
 * An exec whose kernels change (a node given another function or child graph, the exec updated from a graph): the
 * current context's stack grown first to the new kernels' frame, as for an instantiation, and the exec's frame noted
 * for its launches (vc_memory_graph_launch_frame).
 */
#define EXEC_CHANGED(exec, frame, call)                                                                            \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited()))                                                                              \
            return (call);                                                                                         \
        int f_ = (frame);                                                                                          \
        CUresult rc_ = stack_for(f_);                                                                              \
        if (rc_ != CUDA_SUCCESS)                                                                                   \
            return rc_;                                                                                            \
        rc_ = (call);                                                                                              \
        if (rc_ == CUDA_SUCCESS)                                                                                   \
            exec_frame_note((exec), f_);                                                                           \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                     const CUDA_KERNEL_NODE_PARAMS *nodeParams)
{
    EXEC_CHANGED(hGraphExec, nodeParams != NULL ? params_frame(nodeParams->func, nodeParams->kern) : 0,
                 REAL_CU(cuGraphExecKernelNodeSetParams_v2)(hGraphExec, hNode, nodeParams));
}

VC_EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                  const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    EXEC_CHANGED(hGraphExec, nodeParams != NULL ? params_frame(nodeParams->func, NULL) : 0,
                 REAL_CU(cuGraphExecKernelNodeSetParams)(hGraphExec, hNode, nodeParams));
}

static int node_params_frame(const CUgraphNodeParams *p)
{
    if (p == NULL)
        return 0;
    if (p->type == CU_GRAPH_NODE_TYPE_KERNEL)
        return params_frame(p->kernel.func, p->kernel.kern);
    return p->type == CU_GRAPH_NODE_TYPE_GRAPH ? graph_frame(p->graph.graph) : 0;
}

VC_EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode, CUgraphNodeParams *nodeParams)
{
    EXEC_CHANGED(hGraphExec, node_params_frame(nodeParams),
                 REAL_CU(cuGraphExecNodeSetParams)(hGraphExec, hNode, nodeParams));
}

VC_EXPORT CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode, CUgraph childGraph)
{
    EXEC_CHANGED(hGraphExec, childGraph != NULL ? graph_frame(childGraph) : 0,
                 REAL_CU(cuGraphExecChildGraphNodeSetParams)(hGraphExec, hNode, childGraph));
}

VC_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResultInfo *resultInfo)
{
    EXEC_CHANGED(hGraphExec, hGraph != NULL ? graph_frame(hGraph) : 0,
                 REAL_CU(cuGraphExecUpdate_v2)(hGraphExec, hGraph, resultInfo));
}

VC_EXPORT CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
                                     CUgraphExecUpdateResult *updateResult_out)
{
    EXEC_CHANGED(hGraphExec, hGraph != NULL ? graph_frame(hGraph) : 0,
                 REAL_CU(cuGraphExecUpdate)(hGraphExec, hGraph, hErrorNode_out, updateResult_out));
}

VC_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuGraphExecDestroy)(hGraphExec);
    take((uint64_t)(uintptr_t)hGraphExec, REC_GEXEC, NULL); /* a later exec at its address starts without a frame */
    GRAPH_POOL_CHANGE(REAL_CU(cuGraphExecDestroy)(hGraphExec),
                      graph_changed(rc_, galloc_exec_gone, (uint64_t)(uintptr_t)hGraphExec, 0));
}

/* The graph pools give back what no graph allocation uses. */
VC_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuDeviceGraphMemTrim)(device);
    GRAPH_POOL_CHANGE(REAL_CU(cuDeviceGraphMemTrim)(device), (void)0);
}

VC_EXPORT CUresult cuGraphDestroyNode(CUgraphNode hNode)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuGraphDestroyNode)(hNode);
    struct vc_map_entry n;
    pthread_mutex_lock(&g_graph_mu);
    bool had = take((uint64_t)(uintptr_t)hNode, REC_GNODE, &n);
    CUresult rc = REAL_CU(cuGraphDestroyNode)(hNode);
    if (had && rc != CUDA_SUCCESS) {
        put_back(&n);
    } else if (had) {
        pthread_mutex_lock(&g_mu);
        struct vc_map_entry *e = vc_map_lookup(&g_recs, n.aux2, REC_GALLOC);
        if (e != NULL && e->aux == n.aux) {
            e->aux = 0;
            galloc_settle(e);
        }
        pthread_mutex_unlock(&g_mu);
        graph_pool_settle();
    }
    pthread_mutex_unlock(&g_graph_mu);
    return rc;
}

static bool in_graph(const struct vc_map_entry *e, void *graph)
{
    return e->aux == (uint64_t)(uintptr_t)graph;
}

VC_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuGraphDestroy)(hGraph);
    GRAPH_POOL_CHANGE(REAL_CU(cuGraphDestroy)(hGraph), {
        pthread_mutex_lock(&g_mu);
        vc_map_remove_if(&g_recs, REC_GNODE, in_graph, NULL, hGraph);
        pthread_mutex_unlock(&g_mu);
        graph_changed(rc_, galloc_graph_gone, (uint64_t)(uintptr_t)hGraph, 0);
    });
}

/* ---- modules, libraries, context limits: memory the driver takes inside the call --------------------- */

/*
 * A module's code and module-scope variables, a library loaded into contexts, a bigger stack, heap or
 * printf FIFO: the driver takes device memory for them inside the call, in amounts a hook can only
 * estimate (vc_image_footprint: a code page and the variables PTX declares; the stack times every
 * resident thread).  So the estimate is reserved before the call (nothing is loaded when it does not
 * fit), and right after it the container's footprint is reconciled with NVML (what the GPU now holds for
 * its processes); when that is above the limit (the real size was larger than the estimate) the call is
 * undone and fails with CUDA_ERROR_OUT_OF_MEMORY, as the driver does on a full GPU.  A module stays
 * charged its estimate until it is unloaded or its context destroyed (what NVML shows beyond it is
 * counted by the reconciliation); a library its variables once per live context (below); a context limit
 * nothing beyond what NVML shows.
 */
static CUresult checked_load(uint64_t estimate, uint64_t stays, CUresult rc, uint64_t handle, enum rec_kind kind,
                             CUresult (*undo)(uint64_t))
{
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(estimate);
        return rc;
    }
    bool kept;
    bool fits = vc_budget_settle_untracked(estimate - stays, &kept);
    remember(handle, kind, kept ? estimate : stays, kind == REC_MODULE);
    if (fits)
        return rc;
    struct vc_map_entry e;
    bool had = take(handle, kind, &e);
    settle(undo(handle), had, &e);
    vc_log(VC_LOG_INFO, "a module took the container above its limit: unloaded, refused");
    vc_budget_reconcile_now();
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult unload_module(uint64_t m)
{
    return REAL_CU(cuModuleUnload)((CUmodule)(uintptr_t)m);
}

/* The footprint of a module file (read for its variables; a file that cannot be read: one code page). */
static uint64_t file_footprint(const char *path)
{
    char *image = path != NULL ? vc_image_read_file(path) : NULL;
    uint64_t bytes = vc_image_footprint(image);
    free(image);
    return bytes;
}

#ifdef VC_TEST_HOOKS
/* Tests only (built with -DVC_TEST_HOOKS): VCUDA_TEST_LOAD_DELAY_US between a module's estimate and its load. */
static void test_load_delay(void)
{
    const char *us = getenv("VCUDA_TEST_LOAD_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
#else
#define test_load_delay() ((void)0)
#endif

#define MODULE_LOAD(estimate, call)                                                                                \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited()) || module == NULL)                                                            \
            return (call);                                                                                         \
        uint64_t est_ = (estimate);                                                                                \
        if (!vc_budget_reserve(est_))                                                                              \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        test_load_delay();                                                                                         \
        CUresult rc_ = (call);                                                                                     \
        return checked_load(est_, est_, rc_, rc_ == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*module : 0, REC_MODULE,   \
                            unload_module);                                                                        \
    } while (0)

/*
 * cuModuleLoad, cuLibraryLoadFromFile: the file is read once, and what the estimate was made from is what the
 * driver loads (as data): a file replaced between two reads would be charged as one image and loaded as another.
 * A file that cannot be read so (missing, not a regular file) goes to the driver by name, at the code page.
 */
static CUresult load_data(CUmodule *module, const void *image)
{
    MODULE_LOAD(vc_image_footprint(image), REAL_CU(cuModuleLoadData)(module, image));
}

VC_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    char *image = VC_LIKELY(!vc_limited()) || module == NULL || fname == NULL ? NULL : vc_image_read_file(fname);
    if (image == NULL)
        MODULE_LOAD(file_footprint(NULL), REAL_CU(cuModuleLoad)(module, fname));
    CUresult rc = load_data(module, image);
    free(image);
    return rc;
}

/*
 * An image in the caller's memory (cuModuleLoadData(Ex), cuModuleLoadFatBinary, cuLibraryLoadData): PTX text is
 * copied once (vc_image_private) and the copy is both estimated and loaded, so a buffer rewritten by another thread
 * between the estimate and the driver's read cannot be charged as one image and loaded as another.  A binary image
 * is charged one page whatever it holds, and goes to the driver as it is.  Declares `image` anew in the caller.
 */
#define PRIVATE_IMAGE(image_in, limited)                                                                           \
    char *copy_ = NULL;                                                                                            \
    if ((limited) && !vc_image_private((image_in), &copy_)) {                                                      \
        vc_log(VC_LOG_WARN, "a PTX image changed while it was being read (or no memory for its copy): refused"); \
        return CUDA_ERROR_INVALID_IMAGE;                                                                           \
    }                                                                                                              \
    const void *image = copy_ != NULL ? copy_ : (image_in)

VC_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image_in)
{
    if (VC_LIKELY(!vc_limited()) || module == NULL)
        return REAL_CU(cuModuleLoadData)(module, image_in);
    PRIVATE_IMAGE(image_in, true);
    CUresult rc = load_data(module, image);
    free(copy_);
    return rc;
}

static CUresult load_data_ex(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                             void **optionValues)
{
    MODULE_LOAD(vc_image_footprint(image), REAL_CU(cuModuleLoadDataEx)(module, image, numOptions, options, optionValues));
}

VC_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image_in, unsigned int numOptions,
                                      CUjit_option *options, void **optionValues)
{
    if (VC_LIKELY(!vc_limited()) || module == NULL)
        return REAL_CU(cuModuleLoadDataEx)(module, image_in, numOptions, options, optionValues);
    PRIVATE_IMAGE(image_in, true);
    CUresult rc = load_data_ex(module, image, numOptions, options, optionValues);
    free(copy_);
    return rc;
}

static CUresult load_fat_binary(CUmodule *module, const void *fatCubin)
{
    MODULE_LOAD(vc_image_footprint(fatCubin), REAL_CU(cuModuleLoadFatBinary)(module, fatCubin));
}

VC_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    if (VC_LIKELY(!vc_limited()) || module == NULL)
        return REAL_CU(cuModuleLoadFatBinary)(module, fatCubin);
    PRIVATE_IMAGE(fatCubin, true);
    CUresult rc = load_fat_binary(module, image);
    free(copy_);
    return rc;
}

VC_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuModuleUnload)(hmod);
    struct vc_map_entry e;
    bool had = take((uint64_t)(uintptr_t)hmod, REC_MODULE, &e);
    return settle(REAL_CU(cuModuleUnload)(hmod), had, &e);
}

/*
 * A library goes into a context eagerly (CUDA_MODULE_LOADING=EAGER: every live context now, every new
 * one at its creation) or lazily, when something there first needs it: cuLibraryGetGlobal / GetManaged /
 * GetModule, cuKernelGetFunction, or the first launch of one of its kernels there, which no memory hook
 * sees.  So its variables are charged once per live context, whether or not it went there yet: at its load
 * times the live contexts (reserved before the call: one whole load per context, as an eager load takes),
 * and at every context creation the live libraries' once more (vc_memory_context_begin, refused there when
 * that does not fit); a destroyed context or the unload gives them back.  Their code pages are left to the
 * reconciliation (README.md "Residual error").  g_lib_mu is held across the driver call, so a load and a
 * context creation never miss each other.
 */
/* CUDA_MODULE_LOADING=EAGER: a library goes into every context when it is loaded (or the context made). */
static bool eager_loading(void)
{
    static _Atomic int eager = -1;
    int m = atomic_load_explicit(&eager, memory_order_relaxed);
    if (m < 0) {
        const char *mode = getenv("CUDA_MODULE_LOADING");
        m = mode != NULL && strcmp(mode, "EAGER") == 0;
        atomic_store_explicit(&eager, m, memory_order_relaxed);
    }
    return m != 0;
}

/*
 * g_lib_mu held.  A library goes into a context lazily (when something there first asks for it, a kernel's first
 * launch included), yet it is charged once per live context beforehand (its variables, and its code once asked
 * for): the GPU does not hold that charge in the contexts the library is not in yet, and it must not stand in, at a
 * reconciliation, for memory the GPU holds that no hook charged (that memory would count nowhere, and the GPU would
 * hold both once the library goes in).  Counted as held: one copy of each library this process put into a context
 * when it was asked for (library_asked).  extra: a library's charge about to be added to g_lib_unloaded.
 */
static void lib_unbacked(uint64_t extra)
{
    uint64_t none = g_lib_unloaded + extra, some = g_lib_vars > g_lib_unloaded ? g_lib_vars - g_lib_unloaded : 0;
    uint64_t copies = mul_sat(none, g_lib_ctxs);
    if (g_lib_ctxs > 1) {
        uint64_t more = mul_sat(some, g_lib_ctxs - 1);
        copies = copies > UINT64_MAX - more ? UINT64_MAX : copies + more;
    }
    vc_budget_set_unbacked_libs(eager_loading() ? 0 : copies);
}

static CUresult library_loaded(uint64_t est, uint64_t reserved, CUresult rc, CUlibrary lib)
{
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(reserved);
        return rc;
    }
    uint64_t vars = est > VC_IMAGE_PAGE ? est - VC_IMAGE_PAGE : 0, stays = mul_sat(vars, g_lib_ctxs);
    bool kept;
    lib_unbacked(vars);
    bool fits = vc_budget_settle_untracked(reserved - stays, &kept);
    struct vc_map_entry e = {.key = (uint64_t)(uintptr_t)lib, .kind = REC_LIBRARY, .size = kept ? reserved - stays : 0,
                             .aux = vars, .aux2 = est};
    if (!fits && REAL_CU(cuLibraryUnload)(lib) == CUDA_SUCCESS) {
        vc_budget_release(stays + e.size);
        lib_unbacked(0);
        vc_log(VC_LOG_INFO, "a library took the container above its limit: unloaded, refused");
        vc_budget_reconcile_now();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&g_mu);
    int put = vc_map_put(&g_recs, &e);
    pthread_mutex_unlock(&g_mu);
    if (put != 0) { /* charged on, but never again for a new context (and counted as not held: the safe side) */
        vc_log(VC_LOG_ERROR, "out of host memory: a library's %llu bytes stay charged until this process exits",
               (unsigned long long)(stays + e.size));
    } else {
        g_lib_vars += vars;
        g_lib_image += est;
        g_lib_unloaded += vars;
    }
    return fits ? rc : CUDA_ERROR_OUT_OF_MEMORY;
}

#define LIBRARY_LOAD(footprint, call)                                                                              \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited()) || library == NULL)                                                           \
            return (call);                                                                                         \
        uint64_t est_ = (footprint);                                                                               \
        pthread_mutex_lock(&g_lib_mu);                                                                             \
        uint64_t reserved_ = mul_sat(est_, g_lib_ctxs > 0 ? g_lib_ctxs : 1);                                       \
        CUresult rc_ = CUDA_ERROR_OUT_OF_MEMORY;                                                                   \
        if (vc_budget_reserve(reserved_)) {                                                                        \
            test_load_delay();                                                                                     \
            rc_ = (call);                                                                                          \
            rc_ = library_loaded(est_, reserved_, rc_, rc_ == CUDA_SUCCESS ? *library : NULL);                     \
        }                                                                                                          \
        pthread_mutex_unlock(&g_lib_mu);                                                                           \
        return rc_;                                                                                                \
    } while (0)

static CUresult library_load_data(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                  void **jitOptionsValues, unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                                  void **libraryOptionValues, unsigned int numLibraryOptions)
{
    LIBRARY_LOAD(vc_image_footprint(code),
                 REAL_CU(cuLibraryLoadData)(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                            libraryOptionValues, numLibraryOptions));
}

/*
 * A library from an image that is ours (a copy, a file read): the driver keeps a copy of its own, so
 * CU_LIBRARY_BINARY_IS_PRESERVED (the driver would go on reading the buffer, after it is freed) is dropped.
 */
static CUresult library_load_private(CUlibrary *library, const void *image, CUjit_option *jitOptions,
                                     void **jitOptionsValues, unsigned int numJitOptions,
                                     CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                     unsigned int numLibraryOptions)
{
    CUlibraryOption *opts = numLibraryOptions > 0 ? malloc(numLibraryOptions * sizeof(*opts)) : NULL;
    void **vals = numLibraryOptions > 0 ? malloc(numLibraryOptions * sizeof(*vals)) : NULL;
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (numLibraryOptions == 0 || (opts != NULL && vals != NULL)) {
        unsigned n = 0;
        for (unsigned i = 0; i < numLibraryOptions; i++) {
            if (libraryOptions[i] == CU_LIBRARY_BINARY_IS_PRESERVED)
                continue;
            opts[n] = libraryOptions[i];
            vals[n++] = libraryOptionValues[i];
        }
        rc = library_load_data(library, image, jitOptions, jitOptionsValues, numJitOptions, n > 0 ? opts : NULL,
                               n > 0 ? vals : NULL, n);
    }
    free(opts);
    free(vals);
    return rc;
}

static bool library_options_ok(CUlibraryOption *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions)
{
    return numLibraryOptions == 0 || (libraryOptions != NULL && libraryOptionValues != NULL);
}

VC_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                     void **jitOptionsValues, unsigned int numJitOptions,
                                     CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                     unsigned int numLibraryOptions)
{
    if (VC_LIKELY(!vc_limited()) || library == NULL)
        return REAL_CU(cuLibraryLoadData)(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                          libraryOptionValues, numLibraryOptions);
    PRIVATE_IMAGE(code, library_options_ok(libraryOptions, libraryOptionValues, numLibraryOptions));
    CUresult rc = copy_ != NULL ? library_load_private(library, image, jitOptions, jitOptionsValues, numJitOptions,
                                                       libraryOptions, libraryOptionValues, numLibraryOptions)
                                : library_load_data(library, image, jitOptions, jitOptionsValues, numJitOptions,
                                                    libraryOptions, libraryOptionValues, numLibraryOptions);
    free(copy_);
    return rc;
}

VC_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                         void **jitOptionsValues, unsigned int numJitOptions,
                                         CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                         unsigned int numLibraryOptions)
{
    char *image = VC_LIKELY(!vc_limited()) || library == NULL || fileName == NULL ||
                          !library_options_ok(libraryOptions, libraryOptionValues, numLibraryOptions)
                      ? NULL
                      : vc_image_read_file(fileName);
    if (image == NULL)
        LIBRARY_LOAD(file_footprint(NULL),
                     REAL_CU(cuLibraryLoadFromFile)(library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                                                    libraryOptions, libraryOptionValues, numLibraryOptions));
    CUresult rc = library_load_private(library, image, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                       libraryOptionValues, numLibraryOptions);
    free(image);
    return rc;
}

VC_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    if (VC_LIKELY(!vc_limited()))
        return REAL_CU(cuLibraryUnload)(library);
    struct vc_map_entry e;
    pthread_mutex_lock(&g_lib_mu);
    bool had = take((uint64_t)(uintptr_t)library, REC_LIBRARY, &e);
    CUresult rc = REAL_CU(cuLibraryUnload)(library);
    if (had && rc != CUDA_SUCCESS) {
        put_back(&e);
    } else if (had) {
        vc_budget_release(e.size + mul_sat(e.aux, g_lib_ctxs));
        g_lib_vars -= e.aux;
        g_lib_image -= e.aux2;
        if (e.ctx == 0)
            g_lib_unloaded -= e.aux;
        lib_unbacked(0);
    }
    pthread_mutex_unlock(&g_lib_mu);
    if (rc == CUDA_SUCCESS)
        vc_budget_reconcile_now(); /* its code and variables left every context */
    return rc;
}

/*
 * A library goes into a context (lazily) when something there first asks for it: its module, a kernel (whose
 * first launch loads it), a variable.  No memory hook sees that load, and many libraries asked for one after the
 * other would put their code on the GPU unseen.  So the first time anything is asked of a library, its code
 * (its footprint beyond the variables) is charged once per live context, and from then on with every new context,
 * as its variables are (REC_LIBRARY: gpu = 1 once asked; aux = what each context is charged).  A library never
 * asked for (a framework registers hundreds) costs only its variables.
 */
static CUresult library_asked(CUlibrary lib)
{
    if (VC_LIKELY(!vc_limited()) || lib == NULL)
        return CUDA_SUCCESS;
    uint64_t key = (uint64_t)(uintptr_t)lib;
    pthread_mutex_lock(&g_mu);
    struct vc_map_entry *e = vc_map_lookup(&g_recs, key, REC_LIBRARY);
    bool known = e != NULL, fresh = known && e->gpu == 0, in_ctx = known && e->ctx != 0;
    pthread_mutex_unlock(&g_mu);
    if (!known || eager_loading() || (!fresh && in_ctx)) /* unknown, in every context (EAGER), or asked and put */
        return CUDA_SUCCESS;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lib_mu); /* library unloads and context births wait */
    pthread_mutex_lock(&g_mu);
    e = vc_map_lookup(&g_recs, key, REC_LIBRARY);
    uint64_t code = e != NULL && e->gpu == 0 && e->aux2 > e->aux ? e->aux2 - e->aux : 0;
    pthread_mutex_unlock(&g_mu);
    uint64_t bytes = mul_sat(code, g_lib_ctxs);
    if (code > 0 && !vc_budget_reserve(bytes)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        pthread_mutex_lock(&g_mu);
        e = vc_map_lookup(&g_recs, key, REC_LIBRARY);
        if (e != NULL && e->gpu == 0) {
            e->gpu = 1;
            e->aux += code;
            g_lib_vars += code;
            if (e->ctx == 0)
                g_lib_unloaded += code;
        } else {
            vc_budget_release(code > 0 ? bytes : 0);
        }
        pthread_mutex_unlock(&g_mu);
        /*
         * Charged: put into the current context now rather than at its kernels' first launch there (which no hook
         * sees), so that the GPU holds what this context is charged for it.  Without a current context it stays in
         * none as far as the budget knows (charged, not counted as held).
         */
        CUcontext ctx = NULL;
        CUmodule mod;
        if (REAL_CU(cuCtxGetCurrent)(&ctx) == CUDA_SUCCESS && ctx != NULL &&
            REAL_CU(cuLibraryGetModule)(&mod, lib) == CUDA_SUCCESS) {
            pthread_mutex_lock(&g_mu);
            e = vc_map_lookup(&g_recs, key, REC_LIBRARY);
            if (e != NULL && e->ctx == 0) {
                e->ctx = (uint64_t)(uintptr_t)ctx;
                g_lib_unloaded -= e->aux;
            }
            pthread_mutex_unlock(&g_mu);
        }
        lib_unbacked(0);
    }
    pthread_mutex_unlock(&g_lib_mu);
    return rc;
}

VC_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library)
{
    CUresult rc = library_asked(library);
    return rc == CUDA_SUCCESS ? REAL_CU(cuLibraryGetModule)(pMod, library) : rc;
}

VC_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    CUresult rc = library_asked(library);
    return rc == CUDA_SUCCESS ? REAL_CU(cuLibraryGetKernel)(pKernel, library, name) : rc;
}

VC_EXPORT CUresult cuLibraryEnumerateKernels(CUkernel *kernels, unsigned int numKernels, CUlibrary lib)
{
    CUresult rc = library_asked(lib);
    return rc == CUDA_SUCCESS ? REAL_CU(cuLibraryEnumerateKernels)(kernels, numKernels, lib) : rc;
}

VC_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)
{
    CUresult rc = library_asked(library);
    return rc == CUDA_SUCCESS ? REAL_CU(cuLibraryGetGlobal)(dptr, bytes, library, name) : rc;
}

VC_EXPORT CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)
{
    CUresult rc = library_asked(library);
    return rc == CUDA_SUCCESS ? REAL_CU(cuLibraryGetManaged)(dptr, bytes, library, name) : rc;
}

/* A context is being created: the libraries stay as they are until vc_memory_context_end. */
uint64_t vc_memory_context_begin(uint64_t *vars)
{
    pthread_mutex_lock(&g_lib_mu);
    *vars = g_lib_vars;
    return eager_loading() ? g_lib_image : 0;
}

void vc_memory_context_end(CUcontext ctx)
{
    if (ctx != NULL) {
        struct vc_map_entry e = {.key = (uint64_t)(uintptr_t)ctx, .kind = REC_CONTEXT};
        pthread_mutex_lock(&g_mu);
        int put = vc_map_put(&g_recs, &e);
        pthread_mutex_unlock(&g_mu);
        if (put == 0) {
            g_lib_ctxs++;
            lib_unbacked(0);
        } else /* never given back: on the safe side */
            vc_log(VC_LOG_ERROR, "out of host memory: a context's %llu bytes of library variables stay charged",
                   (unsigned long long)g_lib_vars);
    }
    pthread_mutex_unlock(&g_lib_mu);
}

/* Bytes a limit's new value takes beyond its old one (the stack: per resident thread of the device). */
static uint64_t limit_growth(CUlimit limit, size_t old, size_t value)
{
    uint64_t grow = value - old;
    CUdevice dev;
    int sms = 0, threads = 0;
    switch (limit) {
    case CU_LIMIT_STACK_SIZE:
        if (REAL_CU(cuCtxGetDevice)(&dev) != CUDA_SUCCESS ||
            REAL_CU(cuDeviceGetAttribute)(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
            REAL_CU(cuDeviceGetAttribute)(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) !=
                CUDA_SUCCESS)
            return grow;
        return mul_sat(grow, (uint64_t)sms * (uint64_t)threads);
    case CU_LIMIT_MALLOC_HEAP_SIZE:
    case CU_LIMIT_PRINTF_FIFO_SIZE: return grow;
    default: return 0; /* what others take (if anything) the reconciliation right after the call sees */
    }
}

/* The current context's limit grown from old to value: reserved, made, reconciled (undone when over the cap). */
static CUresult grow_limit(CUlimit limit, size_t old, size_t value)
{
    uint64_t est = limit_growth(limit, old, value);
    if (!vc_budget_reserve(est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = REAL_CU(cuCtxSetLimit)(limit, value);
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(est);
        return rc;
    }
    bool kept;
    if (vc_budget_settle_untracked(est, &kept))
        return rc;
    if (kept)
        vc_budget_release(est);
    REAL_CU(cuCtxSetLimit)(limit, old);
    vc_log(VC_LOG_INFO, "a context limit took the container above its limit: restored, refused");
    vc_budget_reconcile_now();
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* A bigger stack, malloc heap or printf FIFO takes device memory of the context (freed with it). */
VC_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    size_t old = 0;
    if (VC_LIKELY(!vc_limited()) || REAL_CU(cuCtxGetLimit)(&old, limit) != CUDA_SUCCESS)
        return REAL_CU(cuCtxSetLimit)(limit, value);
    if (limit == CU_LIMIT_STACK_SIZE) /* never shrunk under a cap: a launch or graph checked against it regrows it */
        return value <= old ? CUDA_SUCCESS : stack_at_least(value);
    if (value <= old)
        return REAL_CU(cuCtxSetLimit)(limit, value); /* nothing grows: nothing to check */
    return grow_limit(limit, old, value);
}

/*
 * A stream takes device memory of its context that no allocation call shows (an H200 with driver 580: 500 streams
 * made in a container at its 1024 MiB cap took the GPU to 1292 MiB).  Its creation reserves STREAM_RESERVE first
 * (refused with CUDA_ERROR_OUT_OF_MEMORY when that does not fit) and hands it over to the reconciliation after the
 * call, as a context limit does: what the GPU then holds for the container counts, and a stream that took the
 * container above its limit is destroyed again and refused.  What it holds leaves the charge with it (NVML) at the
 * next reconciliation.
 */
#define STREAM_RESERVE (2ull << 20)

static CUresult stream_made(CUresult rc, CUstream *ph)
{
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(STREAM_RESERVE);
        return rc;
    }
    bool kept;
    bool fits = vc_budget_settle_untracked(STREAM_RESERVE, &kept);
    if (kept)
        vc_budget_release(STREAM_RESERVE); /* NVML cannot tell: not charged for the process's life per stream */
    if (fits)
        return rc;
    REAL_CU(cuStreamDestroy_v2)(*ph);
    *ph = NULL;
    vc_log(VC_LOG_INFO, "a stream took the container above its limit: destroyed, refused");
    vc_budget_reconcile_now();
    return CUDA_ERROR_OUT_OF_MEMORY;
}

#define STREAM_CREATE(ph, call)                                                                                    \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited()) || (ph) == NULL)                                                              \
            return (call);                                                                                         \
        if (!vc_budget_reserve(STREAM_RESERVE))                                                                    \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        return stream_made((call), (ph));                                                                          \
    } while (0)

VC_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    STREAM_CREATE(phStream, REAL_CU(cuStreamCreate)(phStream, Flags));
}

VC_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    STREAM_CREATE(phStream, REAL_CU(cuStreamCreateWithPriority)(phStream, flags, priority));
}

VC_EXPORT CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags, int priority)
{
    STREAM_CREATE(phStream, REAL_CU(cuGreenCtxStreamCreate)(phStream, greenCtx, flags, priority));
}

/* The local memory each thread of f takes: a function's, or a CUkernel's (cuda.h lets one go where a function does)
 * on the current context's device. */
static bool function_frame(CUfunction f, int *local)
{
    if (f == NULL)
        return false;
    if (REAL_CU(cuFuncGetAttribute)(local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f) == CUDA_SUCCESS)
        return true;
    CUdevice dev;
    return REAL_CU(cuCtxGetDevice)(&dev) == CUDA_SUCCESS &&
           REAL_CU(cuKernelGetAttribute)(local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, (CUkernel)f, dev) == CUDA_SUCCESS;
}

/*
 * Before a launch of f on stream s.  A kernel whose local frame is bigger than its context's stack makes the driver
 * grow the stack at its launch, for every thread the GPU can hold, and never give it back: on an H200 (driver 580)
 * one launch of a kernel with a 64 KiB frame, in a container at its 1024 MiB cap, took 16632 MiB more.  So the
 * stack is grown here first, as cuCtxSetLimit(CU_LIMIT_STACK_SIZE) does it (the growth reserved, the launch refused
 * with CUDA_ERROR_OUT_OF_MEMORY when it does not fit, as the driver refuses one it cannot give the stack).  The
 * launch's context is the stream's (a CUkernel runs in it).  An f whose frame cannot be told, or a stream whose
 * context cannot be made current, is left to the driver (which refuses such a launch itself).  A launch recorded
 * into a graph (the stream capturing) runs nothing: a graph's kernels are not looked at (vcuda/README.md, limits).
 */
static CUresult frame_in_stream(CUfunction f, bool known, int local, CUstream s, bool ptsz);

CUresult vc_memory_launch_frame(CUfunction f, CUstream s, bool ptsz)
{
    int local = 0;
    bool known = REAL_CU(cuFuncGetAttribute)(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f) == CUDA_SUCCESS;
    if (known && local <= (int)VC_DEFAULT_STACK)
        return CUDA_SUCCESS; /* within the stack every context has from its start */
    return frame_in_stream(f, known, local, s, ptsz);
}

/*
 * Before a launch of graph exec on stream s: its kernels' frame, noted when it was instantiated or changed, against the
 * stack of the stream's context, which need not be the context that was current then (another context's stream, or
 * none current at the instantiation): grown there first, or the launch refused, as a kernel's launch is.
 */
CUresult vc_memory_graph_launch_frame(CUgraphExec exec, CUstream s, bool ptsz)
{
    struct vc_map_entry e;
    pthread_mutex_lock(&g_mu);
    bool noted = vc_map_find(&g_recs, (uint64_t)(uintptr_t)exec, REC_GEXEC, &e, false);
    pthread_mutex_unlock(&g_mu);
    return noted ? frame_in_stream(NULL, true, (int)e.aux, s, ptsz) : CUDA_SUCCESS;
}

/* A launch of local bytes a thread (f's, when not known) on stream s: the stack of s's context grown to it first. */
static CUresult frame_in_stream(CUfunction f, bool known, int local, CUstream s, bool ptsz)
{
    CUstreamCaptureStatus capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    CUstream as = ptsz && s == NULL ? CU_STREAM_PER_THREAD : s; /* a _ptsz call's NULL is the per-thread stream */
    if (REAL_CU(cuStreamIsCapturing)(as, &capturing) == CUDA_SUCCESS && capturing != CU_STREAM_CAPTURE_STATUS_NONE)
        return CUDA_SUCCESS; /* recorded into a graph, not run (a limit set now would end the capture) */
    CUcontext ctx = NULL, cur = NULL;
    bool pushed = false;
    if (s != NULL && REAL_CU(cuStreamGetCtx)(s, &ctx) == CUDA_SUCCESS && ctx != NULL &&
        REAL_CU(cuCtxGetCurrent)(&cur) == CUDA_SUCCESS && ctx != cur) {
        if (REAL_CU(cuCtxPushCurrent_v2)(ctx) != CUDA_SUCCESS)
            return CUDA_SUCCESS;
        pushed = true;
    }
    CUresult rc = CUDA_SUCCESS;
    if ((known || function_frame(f, &local)) && local > (int)VC_DEFAULT_STACK)
        rc = stack_at_least((size_t)local);
    if (pushed) {
        CUcontext popped;
        REAL_CU(cuCtxPopCurrent_v2)(&popped);
    }
    return rc;
}

/* ---- what a destroyed context takes with it ----------------------------------------------------- */

static bool of_context(const struct vc_map_entry *e, void *ctx)
{
    return e->ctx != 0 && e->ctx == (uint64_t)(uintptr_t)ctx;
}

static void release_entry(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    vc_budget_release(e->size);
}

/* g_mu and g_lib_mu held: a library this process put into context arg (now gone) is in no context known. */
static void lib_left(struct vc_map_entry *e, void *arg)
{
    if (e->ctx != 0 && e->ctx == (uint64_t)(uintptr_t)arg) {
        e->ctx = 0;
        g_lib_unloaded += e->aux;
    }
}

void vc_memory_context_gone(CUcontext ctx)
{
    static const enum rec_kind kinds[] = {REC_DEV, REC_LEGACY, REC_ARRAY, REC_MIPMAP, REC_MODULE};
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        vc_map_remove_if(&g_recs, kinds[i], of_context, release_entry, ctx);
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_lock(&g_lib_mu); /* the libraries' variables it was charged */
    pthread_mutex_lock(&g_mu);
    vc_map_each(&g_recs, REC_LIBRARY, lib_left, ctx); /* the libraries put into it are in no context known now */
    pthread_mutex_unlock(&g_mu);
    bool charged = take((uint64_t)(uintptr_t)ctx, REC_CONTEXT, NULL);
    if (charged)
        g_lib_ctxs--;
    lib_unbacked(0);
    if (charged)
        vc_budget_release(g_lib_vars);
    pthread_mutex_unlock(&g_lib_mu);
}

struct moved {
    CUcontext from, to;
};

static void move_entry(struct vc_map_entry *e, void *arg)
{
    const struct moved *m = arg;
    if (of_context(e, m->from))
        e->ctx = (uint64_t)(uintptr_t)m->to;
}

void vc_memory_context_moved(CUcontext from, CUcontext to)
{
    static const enum rec_kind kinds[] = {REC_DEV, REC_LEGACY, REC_ARRAY, REC_MIPMAP};
    struct moved m = {from, to};
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        vc_map_each(&g_recs, kinds[i], move_entry, &m);
    pthread_mutex_unlock(&g_mu);
}

/* ---- what the container sees ----------------------------------------------------------------- */

/* total = min(limit, physical), free = max(0, min(total - used, physically free)). */
static void container_view(uint64_t *free_bytes, uint64_t *total_bytes)
{
    vc_memory_refresh_pools(); /* pools may have given memory back at a synchronisation */
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
    vc_memory_refresh_pools();
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
    if (VC_LIKELY(!vc_limited() && !vc_core_limited() && !vc_refused()) || rc != CUDA_SUCCESS || pfn == NULL ||
        *pfn == NULL)
        return rc;
    *pfn = vc_swap_proc(*pfn);
    return rc;
}

VC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    CUresult rc = REAL_CU(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (VC_LIKELY(!vc_limited() && !vc_core_limited() && !vc_refused()) || rc != CUDA_SUCCESS || pfn == NULL ||
        *pfn == NULL)
        return rc;
    *pfn = vc_swap_proc(*pfn);
    return rc;
}
