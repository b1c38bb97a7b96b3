/*
 * Contexts: each one costs the container the device memory the driver gives
 * it (README.md "Whole footprint"), and destroying one frees what was made in
 * it.
 *
 * Creation reserves an estimate first (the size last measured on that device
 * in this container, else VCUDA_CONTEXT_RESERVE), creates the context, then
 * measures what it really took: NVML's memory of this process on the device
 * after minus before.  The same two process lists reveal this process's host
 * PID when it runs in a PID namespace (the one PID that appeared).  The charge
 * is settled on the measured size (a context that does not fit after all is
 * destroyed again and refused) and returned when the context is destroyed.
 */
#include "vc_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#define MAX_DEVICES 64
#define MAX_CONTEXTS 256

struct charged_ctx {
    CUcontext ctx; /* NULL = free entry; a green context's: its CUcontext (cuCtxFromGreenCtx) */
    uint64_t bytes;
    int dev;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* guards g_ctx and the primary state */
static struct charged_ctx g_ctx[MAX_CONTEXTS];
static _Atomic(CUcontext) g_primary[MAX_DEVICES]; /* each device's primary context, once retained */
static uint64_t g_primary_bytes[MAX_DEVICES];     /* what its primary context is charged, while active */
static pthread_mutex_t g_primary_mu[MAX_DEVICES];
/*
 * The references to each device's primary context that this process holds as the driver counts them: a retain each
 * (less a release each), and one per green context made on the device (cuda.h: it retains the primary context, and
 * its destroy releases it).  A release that drops the last one destroys the context for sure (primary_goes).
 */
static atomic_int g_primary_refs[MAX_DEVICES];
static atomic_int g_greens[MAX_DEVICES];
static atomic_bool g_refs_unknown[MAX_DEVICES]; /* a release taken for the last left the context alive */

static void atfork_child(void)
{
    /* The child holds none of its parent's contexts (nor their charges, which are the parent's slot's). */
    memset(g_ctx, 0, sizeof(g_ctx));
    memset(g_primary_bytes, 0, sizeof(g_primary_bytes));
    for (int i = 0; i < MAX_DEVICES; i++) {
        atomic_store(&g_primary_refs[i], 0);
        atomic_store(&g_greens[i], 0);
        atomic_store(&g_refs_unknown[i], false);
    }
    pthread_mutex_init(&g_mu, NULL);
    for (int i = 0; i < MAX_DEVICES; i++)
        pthread_mutex_init(&g_primary_mu[i], NULL);
    vc_nvml_atfork_child();
}

__attribute__((constructor)) static void vc_context_init(void)
{
    for (int i = 0; i < MAX_DEVICES; i++)
        pthread_mutex_init(&g_primary_mu[i], NULL);
    pthread_atfork(NULL, NULL, atfork_child);
}

/* ---- measuring a context -------------------------------------------------------------------------- */

struct before {
    bool nvml;         /* NVML lists were read */
    int n;
    struct vc_proc_mem procs[VC_MAX_PROCS];
};

static _Thread_local struct before tl_before;

static void measure_before(int dev, struct before *b)
{
    nvmlDevice_t h;
    b->nvml = vc_nvml_device(dev, &h) && (b->n = vc_nvml_processes(h, b->procs, VC_MAX_PROCS)) >= 0;
}

static uint64_t used_of(const struct vc_proc_mem *p, int n, int pid, bool *found)
{
    for (int i = 0; i < n; i++)
        if (p[i].pid == pid) {
            *found = true;
            return p[i].used;
        }
    *found = false;
    return 0;
}

/*
 * What the new context took on dev: this process's NVML memory after minus before.  Finds this
 * process in the lists first: its own PID (host PID namespace), the host PID found earlier, or the
 * one PID that appeared.  Returns false when NVML cannot tell (then the estimate stays charged).
 */
static bool measure_after(int dev, const struct before *b, uint64_t *bytes, bool *alone)
{
    static _Thread_local struct vc_proc_mem after[VC_MAX_PROCS];
    nvmlDevice_t h;
    if (!b->nvml || !vc_nvml_device(dev, &h))
        return false;
    int n = vc_nvml_processes(h, after, VC_MAX_PROCS);
    if (n < 0)
        return false;
    int me = vc_host_pid();
    bool found = false;
    if (me <= 0) {
        used_of(after, n, (int)getpid(), &found);
        if (found) {
            me = (int)getpid();
        } else {
            int appeared = 0, count = 0;
            for (int i = 0; i < n; i++) {
                bool was;
                used_of(b->procs, b->n, after[i].pid, &was);
                if (!was) {
                    appeared = after[i].pid;
                    count++;
                }
            }
            if (count != 1) {
                vc_log(VC_LOG_WARN, "cannot tell this process in NVML's list of device %d (%d new processes): its "
                       "context is charged at the estimate", dev, count);
                return false;
            }
            me = appeared;
        }
        vc_set_host_pid(me);
    }
    bool was;
    uint64_t now = used_of(after, n, me, &found), then = used_of(b->procs, b->n, me, &was);
    if (!found)
        return false;
    *bytes = now > then ? now - then : 0;
    *alone = !was || then == 0;
    return true;
}

/*
 * Settles the reservation `est` on the measured size, less `eager` (libraries the driver loaded into it, charged
 * apart); false when the context does not fit after all.
 */
static bool settle_context(int dev, uint64_t est, uint64_t eager, uint64_t *charged)
{
    uint64_t real;
    bool alone;
    if (!measure_after(dev, &tl_before, &real, &alone)) {
        *charged = est;
        return true;
    }
    real = real > eager ? real - eager : 0;
    /*
     * A process that held nothing on dev before cannot make the new context look smaller than it is.  One that
     * did can: what another of its threads frees between the two lists (or a pool gives back at a
     * synchronisation) comes off the measurement.  Such a context is charged at least the size last measured
     * where nothing could interfere, and its own measurement teaches nothing.
     */
    if (alone) {
        vc_budget_learn_context(dev, real);
    } else {
        uint64_t learned = vc_budget_context_learned(dev);
        real = real < learned ? learned : real;
    }
    if (real > est && !vc_budget_reserve(real - est)) {
        vc_log(VC_LOG_INFO, "a context of device %d takes %llu bytes, more than the container has left", dev,
               (unsigned long long)real);
        vc_budget_release(est);
        return false;
    }
    if (real < est)
        vc_budget_release(est - real);
    *charged = real;
    return true;
}

static void remember_ctx(CUcontext ctx, uint64_t bytes, int dev)
{
    pthread_mutex_lock(&g_mu);
    int i = 0;
    while (i < MAX_CONTEXTS && g_ctx[i].ctx != NULL)
        i++;
    if (i < MAX_CONTEXTS)
        g_ctx[i] = (struct charged_ctx){ctx, bytes, dev};
    pthread_mutex_unlock(&g_mu);
    if (i == MAX_CONTEXTS)
        vc_log(VC_LOG_WARN, "more than %d contexts: this one's %llu bytes stay charged until the process exits",
               MAX_CONTEXTS, (unsigned long long)bytes);
    vc_budget_note_context((int64_t)bytes);
}

/* ---- creating contexts ---------------------------------------------------------------------------- */

/*
 * Reserve the estimate and the live libraries' variables (README.md "Accounting rules"), create with call, settle
 * on the measured size (destroy with undo if it does not fit).
 */
#define CREATED(dev, call, pctx, undo)                                                                             \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited()))                                                                              \
            return (call);                                                                                         \
        uint64_t libs_, eager_ = vc_memory_context_begin(&libs_);                                                  \
        uint64_t est_ = vc_budget_context_estimate(dev);                                                           \
        if (!vc_budget_reserve(est_ + libs_)) {                                                                    \
            vc_memory_context_end(NULL);                                                                           \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
        measure_before((dev), &tl_before);                                                                         \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                                 \
            vc_budget_release(est_ + libs_);                                                                       \
            vc_memory_context_end(NULL);                                                                           \
            return rc_;                                                                                            \
        }                                                                                                          \
        uint64_t bytes_;                                                                                           \
        if (!settle_context((dev), est_, eager_, &bytes_)) {                                                       \
            vc_budget_release(libs_);                                                                              \
            undo;                                                                                                  \
            vc_memory_context_end(NULL);                                                                           \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
        remember_ctx(*(pctx), bytes_, (dev));                                                                             \
        vc_memory_context_end(*(pctx));                                                                            \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CREATED(dev, REAL_CU(cuCtxCreate)(pctx, flags, dev), pctx, REAL_CU(cuCtxDestroy)(*pctx));
}

VC_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CREATED(dev, REAL_CU(cuCtxCreate_v2)(pctx, flags, dev), pctx, REAL_CU(cuCtxDestroy_v2)(*pctx));
}

VC_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                  unsigned int flags, CUdevice dev)
{
    CREATED(dev, REAL_CU(cuCtxCreate_v3)(pctx, paramsArray, numParams, flags, dev), pctx,
            REAL_CU(cuCtxDestroy_v2)(*pctx));
}

VC_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                  CUdevice dev)
{
    CREATED(dev, REAL_CU(cuCtxCreate_v4)(pctx, ctxCreateParams, flags, dev), pctx, REAL_CU(cuCtxDestroy_v2)(*pctx));
}

static bool primary_active(CUdevice dev)
{
    unsigned flags = 0;
    int active = 0;
    return REAL_CU(cuDevicePrimaryCtxGetState)(dev, &flags, &active) == CUDA_SUCCESS && active;
}

/*
 * Whether a release of dev's primary context (`release`; else the destroy of a green context made on it) drops the
 * last reference, so that the driver destroys the context for sure: its launches then count as complete from the
 * start (vc_core_context_dying), and other threads' launches waiting for credit do not wait for the driver's
 * destroy, which waits for the context's work.  Each count goes up before the driver's call that takes a reference
 * (and back down if it fails), so that a release meanwhile sees one more and waits, as a release always did.  A
 * reference taken where this process cannot see it (the driver's own) is not counted: a release taken for the last
 * then leaves the context alive, its launches still running counted complete (up to 16 more go, and NVML's samples
 * charge what they ran); the device's count is no longer trusted after that (primary_stayed), and its releases are
 * waited for again.  g_primary_mu[dev] held.
 */
static bool primary_goes(CUdevice dev, bool release)
{
    if (atomic_load(&g_refs_unknown[dev]))
        return false;
    int refs = atomic_load(&g_primary_refs[dev]), greens = atomic_load(&g_greens[dev]);
    return release ? refs == 1 && greens == 0 : refs == 0 && greens == 1;
}

/* A release or destroy taken for the primary context's last left it alive: a reference went uncounted. */
static void primary_stayed(CUdevice dev)
{
    if (!atomic_exchange(&g_refs_unknown[dev], true))
        vc_log(VC_LOG_WARN,
               "the primary context of device %d stayed alive after a release of the last reference this process "
               "counted (the driver holds one the interceptor did not see): its releases are waited for from now on",
               (int)dev);
}

static void primary_unref(atomic_int *count)
{
    int n = atomic_load(count);
    while (n > 0 && !atomic_compare_exchange_weak(count, &n, n - 1))
        ;
}

/* The primary context costs memory when it comes alive (its first retain), not at every retain. */
VC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    if (dev < 0 || dev >= MAX_DEVICES || pctx == NULL)
        return REAL_CU(cuDevicePrimaryCtxRetain)(pctx, dev);
    if (VC_LIKELY(!vc_limited())) {
        /* No lock: a release holds it across the driver's destroy, which a host function may hold up. */
        atomic_fetch_add(&g_primary_refs[dev], 1);
        CUresult rc = REAL_CU(cuDevicePrimaryCtxRetain)(pctx, dev);
        if (rc == CUDA_SUCCESS)
            atomic_store(&g_primary[dev], *pctx);
        else
            primary_unref(&g_primary_refs[dev]);
        return rc;
    }
    pthread_mutex_lock(&g_primary_mu[dev]);
    CUresult rc;
    if (primary_active(dev)) {
        rc = REAL_CU(cuDevicePrimaryCtxRetain)(pctx, dev);
    } else {
        uint64_t libs, eager = vc_memory_context_begin(&libs);
        uint64_t est = vc_budget_context_estimate(dev), bytes = 0;
        rc = vc_budget_reserve(est + libs) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
        CUcontext born = NULL;
        if (rc == CUDA_SUCCESS) {
            measure_before(dev, &tl_before);
            rc = REAL_CU(cuDevicePrimaryCtxRetain)(pctx, dev);
            if (rc != CUDA_SUCCESS) {
                vc_budget_release(est + libs);
            } else if (!settle_context(dev, est, eager, &bytes)) {
                vc_budget_release(libs);
                REAL_CU(cuDevicePrimaryCtxRelease_v2)(dev);
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            } else {
                g_primary_bytes[dev] = bytes;
                vc_budget_note_context((int64_t)bytes);
                born = *pctx;
            }
        }
        vc_memory_context_end(born);
    }
    if (rc == CUDA_SUCCESS) {
        atomic_store(&g_primary[dev], *pctx); /* the same handle for the device's whole life (cuda.h) */
        atomic_fetch_add(&g_primary_refs[dev], 1); /* under the lock every release holds */
    }
    pthread_mutex_unlock(&g_primary_mu[dev]);
    return rc;
}

/* ---- destroying a context --------------------------------------------------------------------------- */

#ifdef VC_TEST_HOOKS
/* Tests only (built with -DVC_TEST_HOOKS): VCUDA_TEST_DESTROY_DELAY_US right after the driver destroyed a context. */
static void test_destroy_delay(void)
{
    const char *us = getenv("VCUDA_TEST_DESTROY_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
/* Tests only: VCUDA_TEST_RELEASE_DELAY_US right after a release of a primary context that left it alive. */
static void test_release_delay(void)
{
    const char *us = getenv("VCUDA_TEST_RELEASE_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
#else
#define test_destroy_delay() ((void)0)
#define test_release_delay() ((void)0)
#endif

static void forget_ctx(CUcontext ctx)
{
    uint64_t bytes = 0;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        if (g_ctx[i].ctx == ctx) {
            bytes = g_ctx[i].bytes;
            g_ctx[i] = (struct charged_ctx){NULL, 0, 0};
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    if (bytes > 0) {
        vc_budget_release(bytes);
        vc_budget_note_context(-(int64_t)bytes);
    }
}

/*
 * Around the driver's destroy of a context.  The driver frees the context's events in it, those the SM gate marks
 * launches with and those that follow a cuMemFreeAsync: they are marked as dying before the call, so that no other
 * thread asks for one the driver may have freed, and forgotten after it once the context is gone (its answer).  No
 * lock is held across the call, which waits for the context's work.  destroy_end returns the bytes of the frees
 * queued in the context, for the reconciliation once the context's own charge is released.
 */
static void destroy_begin(CUcontext ctx, bool sure)
{
    if (VC_UNLIKELY(vc_core_limited()))
        vc_core_context_dying(ctx, sure);
    if (VC_UNLIKELY(vc_limited()))
        vc_memory_context_dying(ctx);
}

static uint64_t destroy_end(CUcontext ctx, bool gone)
{
    if (gone)
        test_destroy_delay();
    if (VC_UNLIKELY(vc_core_limited()))
        vc_core_context_destroyed(ctx, gone);
    return VC_UNLIKELY(vc_limited()) ? vc_memory_context_destroyed(ctx, gone) : 0;
}

/* After ctx went away (its markers and queued frees forgotten): its own memory and what was allocated in it. */
static void context_gone(CUcontext ctx)
{
    if (VC_UNLIKELY(vc_limited()) && ctx != NULL) {
        vc_memory_context_gone(ctx);
        forget_ctx(ctx);
    }
}

#define DESTROYED(call, ctx)                                                                                       \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited() && !vc_core_limited()))                                                       \
            return (call);                                                                                         \
        destroy_begin((ctx), true);                                                                                \
        CUresult rc_ = (call);                                                                                     \
        uint64_t handover_ = destroy_end((ctx), rc_ == CUDA_SUCCESS);                                              \
        if (rc_ == CUDA_SUCCESS) {                                                                                 \
            context_gone(ctx);                                                                                     \
            vc_memory_ordered_frees_handover(handover_); /* the context's own charge is released */               \
        }                                                                                                          \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    DESTROYED(REAL_CU(cuCtxDestroy)(ctx), ctx);
}

VC_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    DESTROYED(REAL_CU(cuCtxDestroy_v2)(ctx), ctx);
}

static CUcontext primary_of(CUdevice dev)
{
    return dev >= 0 && dev < MAX_DEVICES ? atomic_load(&g_primary[dev]) : NULL;
}

/* The primary context of dev is gone (released for the last time, or reset; forgotten by destroy_forget). */
static void primary_gone(CUdevice dev, uint64_t handover)
{
    context_gone(primary_of(dev));
    if (VC_UNLIKELY(vc_limited())) {
        uint64_t bytes = g_primary_bytes[dev];
        g_primary_bytes[dev] = 0;
        if (bytes > 0) {
            vc_budget_release(bytes);
            vc_budget_note_context(-(int64_t)bytes);
        }
    }
    vc_memory_ordered_frees_handover(handover);
}

/*
 * A release destroys the primary context when it was the last reference: its events are marked as dying around every
 * release (destroy_begin), its launches counted complete from the start when the release drops the last reference
 * this process counted (primary_goes), and it went if the context is no longer active after it.  A reset destroys it
 * for sure and leaves the count as it was: a count above the driver's only makes a later last release wait, as before.
 */
#define RELEASED(call, dev, reset)                                                                                 \
    do {                                                                                                           \
        if (VC_LIKELY(!vc_limited() && !vc_core_limited()) || (dev) < 0 || (dev) >= MAX_DEVICES)                  \
            return (call);                                                                                         \
        pthread_mutex_lock(&g_primary_mu[dev]);                                                                    \
        CUcontext primary_ = primary_of(dev);                                                                      \
        bool last_ = !(reset) && primary_goes((dev), true);                                                        \
        destroy_begin(primary_, (reset) || last_);                                                                 \
        CUresult rc_ = (call);                                                                                     \
        if (rc_ == CUDA_SUCCESS && !(reset))                                                                       \
            primary_unref(&g_primary_refs[dev]);                                                                   \
        bool gone_ = rc_ == CUDA_SUCCESS && !primary_active(dev);                                                  \
        if (last_ && rc_ == CUDA_SUCCESS && !gone_)                                                                \
            primary_stayed(dev);                                                                                   \
        if (!gone_)                                                                                                \
            test_release_delay();                                                                                  \
        uint64_t handover_ = destroy_end(primary_, gone_);                                                         \
        if (gone_)                                                                                                 \
            primary_gone((dev), handover_);                                                                        \
        pthread_mutex_unlock(&g_primary_mu[dev]);                                                                  \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    RELEASED(REAL_CU(cuDevicePrimaryCtxRelease)(dev), dev, false);
}

VC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    RELEASED(REAL_CU(cuDevicePrimaryCtxRelease_v2)(dev), dev, false);
}

VC_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    RELEASED(REAL_CU(cuDevicePrimaryCtxReset)(dev), dev, true);
}

VC_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    RELEASED(REAL_CU(cuDevicePrimaryCtxReset_v2)(dev), dev, true);
}

/* ---- green contexts (CUDA 12.4) ---------------------------------------------------------------------------- */

/*
 * A green context (an SM partition) is a context of its own: it takes device memory like any other, so it is
 * reserved, measured and settled as cuCtxCreate's are (its CUcontext, from cuCtxFromGreenCtx, is the key; the
 * live libraries' variables are reserved with it).  cuda.h: it retains the device's primary context, which
 * therefore comes alive (and is charged) first, through cuDevicePrimaryCtxRetain above; the driver's reference
 * goes with cuGreenCtxDestroy, and the primary context with it when that was the last one.  It shares the
 * primary context's memory: what was allocated in it stays charged after it (freed with the primary context),
 * while its modules and its copies of the libraries go with it.
 */
static CUresult green_create(CUgreenCtx *ph, CUdevResourceDesc desc, CUdevice dev, unsigned flags)
{
    uint64_t libs, eager = vc_memory_context_begin(&libs);
    uint64_t est = vc_budget_context_estimate(dev);
    if (!vc_budget_reserve(est + libs)) {
        vc_memory_context_end(NULL);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    measure_before(dev, &tl_before);
    CUresult rc = REAL_CU(cuGreenCtxCreate)(ph, desc, dev, flags);
    if (rc != CUDA_SUCCESS) {
        vc_budget_release(est + libs);
        vc_memory_context_end(NULL);
        return rc;
    }
    uint64_t bytes;
    if (!settle_context(dev, est, eager, &bytes)) {
        vc_budget_release(libs);
        REAL_CU(cuGreenCtxDestroy)(*ph);
        vc_memory_context_end(NULL);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUcontext ctx = NULL;
    if (REAL_CU(cuCtxFromGreenCtx)(&ctx, *ph) != CUDA_SUCCESS || ctx == NULL)
        ctx = (CUcontext)(void *)*ph; /* charged under its own handle (cuGreenCtxDestroy finds it the same way) */
    remember_ctx(ctx, bytes, dev);
    vc_memory_context_end(ctx);
    return rc;
}

VC_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags)
{
    if (dev < 0 || dev >= MAX_DEVICES || phCtx == NULL)
        return REAL_CU(cuGreenCtxCreate)(phCtx, desc, dev, flags);
    atomic_fetch_add(&g_greens[dev], 1); /* a reference to the primary context (primary_goes), before the driver's */
    if (VC_LIKELY(!vc_limited())) {
        CUresult rc = REAL_CU(cuGreenCtxCreate)(phCtx, desc, dev, flags);
        if (rc != CUDA_SUCCESS)
            primary_unref(&g_greens[dev]);
        return rc;
    }
    CUcontext primary;
    CUresult rc = cuDevicePrimaryCtxRetain(&primary, dev); /* charged here if this brings it alive */
    if (rc != CUDA_SUCCESS) {
        primary_unref(&g_greens[dev]);
        return rc;
    }
    rc = green_create(phCtx, desc, dev, flags);
    if (rc != CUDA_SUCCESS)
        primary_unref(&g_greens[dev]);
    cuDevicePrimaryCtxRelease_v2(dev); /* ours; the green context holds the driver's (failed: the last one goes) */
    return rc;
}

/* The device a context (not current) belongs to; -1 if the driver cannot tell. */
int vc_ctx_device(CUcontext ctx)
{
    CUdevice dev = -1;
    if (REAL_CU(cuCtxPushCurrent_v2)(ctx) != CUDA_SUCCESS)
        return -1;
    if (REAL_CU(cuCtxGetDevice)(&dev) != CUDA_SUCCESS)
        dev = -1;
    CUcontext popped;
    REAL_CU(cuCtxPopCurrent_v2)(&popped);
    return dev;
}

static int charged_device(CUcontext ctx)
{
    int dev = -1;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_CONTEXTS && dev < 0; i++)
        if (g_ctx[i].ctx == ctx)
            dev = g_ctx[i].dev;
    pthread_mutex_unlock(&g_mu);
    return dev;
}

VC_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx hCtx)
{
    if (VC_LIKELY(!vc_limited() && !vc_core_limited()) || hCtx == NULL)
        return REAL_CU(cuGreenCtxDestroy)(hCtx);
    CUcontext ctx = NULL;
    if (REAL_CU(cuCtxFromGreenCtx)(&ctx, hCtx) != CUDA_SUCCESS || ctx == NULL)
        ctx = NULL;
    CUcontext key = ctx != NULL ? ctx : (CUcontext)(void *)hCtx;
    int dev = charged_device(key);
    if (dev < 0 && ctx != NULL)
        dev = vc_ctx_device(ctx);
    bool known = dev >= 0 && dev < MAX_DEVICES;
    if (known)
        pthread_mutex_lock(&g_primary_mu[dev]);
    CUcontext primary = known ? primary_of(dev) : NULL; /* goes too when the green context held the last reference */
    bool last = known && primary_goes(dev, false);
    destroy_begin(ctx, true);
    destroy_begin(primary, last);
    CUresult rc = REAL_CU(cuGreenCtxDestroy)(hCtx);
    if (rc == CUDA_SUCCESS && known)
        primary_unref(&g_greens[dev]);
    bool primary_went = rc == CUDA_SUCCESS && known && !primary_active(dev);
    if (last && rc == CUDA_SUCCESS && !primary_went)
        primary_stayed(dev);
    uint64_t handover = destroy_end(ctx, rc == CUDA_SUCCESS); /* its streams are detached, its events gone */
    handover += destroy_end(primary, primary_went);
    if (rc == CUDA_SUCCESS) {
        if (VC_UNLIKELY(vc_limited())) {
            if (ctx != NULL) {
                vc_memory_context_moved(ctx, known ? primary_of(dev) : NULL); /* the primary context's memory */
                vc_memory_context_gone(ctx);                                  /* its modules, its libraries */
            }
            forget_ctx(key);
        }
        if (primary_went)
            primary_gone(dev, 0);
        vc_memory_ordered_frees_handover(handover);
    }
    if (known)
        pthread_mutex_unlock(&g_primary_mu[dev]);
    return rc;
}
