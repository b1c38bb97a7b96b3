/*
 * Simulated libcuda: streams and events.  A stream remembers its device and
 * context and the last kernel queued on it; waiting for a stream or an event
 * waits on the simulated GPU timeline (sim_timeline.c).
 */
#include "cuda_sim.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_timeline.h"
#include "vc_map.h"

struct sim_stream {
    int device;
    CUcontext ctx;         /* the context it was created in */
    _Atomic uint64_t upto; /* sim_tl upto of its last kernel (0 = none) */
    /* Stream capture (under the records lock): the graph work goes to while capturing. */
    CUgraph capture;
    uint64_t capture_id;
    bool invalidated;      /* a call not allowed while capturing was made: cuStreamEndCapture fails */
};

static uint64_t g_capture_ids; /* under the records lock */

/*
 * The created stream behind s (records lock held), or NULL.  What a stream holds is read under that lock: another
 * thread may destroy (and free) it at any moment, and a call on it then answers CUDA_ERROR_INVALID_HANDLE.
 */
static struct sim_stream *stream_of(CUstream s)
{
    if (sim_special_stream(s) || vc_map_lookup(sim_recs(), (uint64_t)(uintptr_t)s, REC_STREAM) == NULL)
        return NULL;
    return (struct sim_stream *)(void *)s;
}

/* A created stream's context and last kernel (either NULL: not asked), read under the records lock. */
static CUresult stream_read(CUstream s, CUcontext *ctx, uint64_t *upto)
{
    sim_rec_lock();
    struct sim_stream *st = stream_of(s);
    if (st != NULL && ctx != NULL)
        *ctx = st->ctx;
    if (st != NULL && upto != NULL)
        *upto = atomic_load(&st->upto);
    sim_rec_unlock();
    return st != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/*
 * Device memory a created stream takes: SIM_STREAM_BYTES (an H200 with driver 580: 500 streams took 272 MiB), or
 * GPUSIM_STREAM_KIB when set (a knob for tests; 0 turns it off).
 */
static uint64_t stream_bytes(void)
{
    const char *s = getenv("GPUSIM_STREAM_KIB");
    if (s != NULL && s[0] != '\0')
        return strtoull(s, NULL, 10) << 10;
    return SIM_STREAM_BYTES;
}

CUresult sim_stream_create_in(CUstream *ph, CUcontext ctx)
{
    if (ph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_cu_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_stream *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->device = ctx->device;
    s->ctx = ctx;
    atomic_init(&s->upto, 0);
    /* Device memory of its own, which no allocation call shows (an H200, driver 580: 272 MiB for 500 streams). */
    uint64_t bytes = stream_bytes();
    CUresult rc = sim_mem_charge((unsigned)ctx->device, bytes);
    if (rc != CUDA_SUCCESS) {
        free(s);
        return rc;
    }
    struct vc_map_entry e = {.key = (uint64_t)(uintptr_t)s, .kind = REC_STREAM, .gpu = (unsigned)ctx->device,
                             .size = bytes, .ctx = (uint64_t)(uintptr_t)ctx}; /* freed with its context */
    sim_rec_lock();
    int put = vc_map_put(sim_recs(), &e);
    sim_rec_unlock();
    if (put != 0) {
        sim_mem_uncharge((unsigned)ctx->device, bytes);
        free(s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ph = (CUstream)s;
    return CUDA_SUCCESS;
}

static CUresult stream_create(CUstream *ph)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_stream_create_in(ph, sim_cu_current());
}

/* The context of stream s: its own, or the current one for the special streams. */
static CUresult stream_ctx(CUstream s, CUcontext *pctx)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (sim_special_stream(s)) {
        CUcontext c = sim_cu_current();
        if (!sim_cu_ctx_valid(c))
            return CUDA_ERROR_INVALID_CONTEXT;
        *pctx = c;
        return CUDA_SUCCESS;
    }
    return stream_read(s, pctx, NULL);
}

SIM_EXPORT CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    return stream_ctx(hStream, pctx);
}

SIM_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx)
{
    return stream_ctx(hStream, pctx);
}

SIM_EXPORT CUresult cuStreamGetCtx_v2(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    CUcontext c = NULL;
    CUresult rc = stream_ctx(hStream, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pGreenCtx != NULL)
        *pGreenCtx = c->green;
    if (pCtx != NULL)
        *pCtx = c;
    return CUDA_SUCCESS;
}

/* The green context of the stream (its context's, the current one for the special streams), NULL if none. */
SIM_EXPORT CUresult cuStreamGetGreenCtx(CUstream hStream, CUgreenCtx *phCtx)
{
    if (phCtx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext c = NULL;
    CUresult rc = stream_ctx(hStream, &c);
    if (rc == CUDA_SUCCESS)
        *phCtx = c->green;
    return rc;
}

SIM_EXPORT CUresult cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    return cuStreamGetCtx_v2(hStream, pCtx, pGreenCtx);
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
    struct vc_map_entry e;
    if (!sim_find((uint64_t)(uintptr_t)s, REC_STREAM, &e, true))
        return CUDA_ERROR_INVALID_HANDLE;
    sim_mem_uncharge(e.gpu, e.size);
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

bool sim_special_stream(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

/* The device work on stream s goes to: its own, or the current context's for the special streams. */
CUresult sim_stream_device(CUstream s, unsigned *gpu)
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
    if (!sim_find((uint64_t)(uintptr_t)s, REC_STREAM, &e, false))
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
    CUresult rc = sim_stream_device(s, gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (sim_special_stream(s)) {
        *upto = sim_tl_tail(sim_cu_node()->state, *gpu);
        return CUDA_SUCCESS;
    }
    return stream_read(s, NULL, upto);
}

/* Looked up again: another thread may have destroyed the stream since the launch looked it up. */
void sim_stream_mark(CUstream s, uint64_t upto)
{
    if (sim_special_stream(s))
        return;
    sim_rec_lock();
    struct sim_stream *st = stream_of(s);
    if (st != NULL)
        atomic_store(&st->upto, upto);
    sim_rec_unlock();
}

/* ---- stream capture ------------------------------------------------------------------------ */

CUgraph sim_stream_capture(CUstream s)
{
    if (sim_special_stream(s))
        return NULL;
    sim_rec_lock();
    struct sim_stream *st = stream_of(s);
    CUgraph g = st != NULL && !st->invalidated ? st->capture : NULL;
    sim_rec_unlock();
    return g;
}

/* A synchronising call on a capturing stream: not allowed, and the capture is invalidated. */
static bool capture_violated(CUstream s)
{
    if (sim_special_stream(s))
        return false;
    sim_rec_lock();
    struct sim_stream *st = stream_of(s);
    bool capturing = st != NULL && st->capture != NULL;
    if (capturing)
        st->invalidated = true;
    sim_rec_unlock();
    return capturing;
}

static CUresult begin_capture(CUstream s, CUstreamCaptureMode mode)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
        mode != CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_special_stream(s))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot be captured */
    CUgraph g;
    CUresult rc = cuGraphCreate(&g, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    sim_rec_lock();
    struct sim_stream *st = stream_of(s);
    rc = st == NULL ? CUDA_ERROR_INVALID_HANDLE : st->capture != NULL ? CUDA_ERROR_ILLEGAL_STATE : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        st->capture = g;
        st->capture_id = ++g_capture_ids;
        st->invalidated = false;
    }
    sim_rec_unlock();
    if (rc != CUDA_SUCCESS)
        cuGraphDestroy(g);
    return rc;
}

SIM_EXPORT CUresult cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

SIM_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

SIM_EXPORT CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, mode);
}

SIM_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, mode);
}

static CUresult end_capture(CUstream s, CUgraph *phGraph)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (phGraph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    struct sim_stream *st = stream_of(s);
    CUgraph g = st != NULL ? st->capture : NULL;
    bool bad = st != NULL && st->invalidated;
    if (st != NULL) {
        st->capture = NULL;
        st->invalidated = false;
    }
    sim_rec_unlock();
    *phGraph = NULL;
    if (g == NULL)
        return CUDA_ERROR_ILLEGAL_STATE;
    if (bad) {
        cuGraphDestroy(g);
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *phGraph = g;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph);
}

SIM_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph);
}

static CUresult capture_info(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id, CUgraph *graph,
                             const CUgraphNode **deps, size_t *ndeps)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (status == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    CUstreamCaptureStatus st_out = CU_STREAM_CAPTURE_STATUS_NONE;
    CUgraph g = NULL;
    uint64_t cid = 0;
    if (!sim_special_stream(s)) {
        sim_rec_lock();
        struct sim_stream *st = stream_of(s);
        if (st == NULL) {
            rc = CUDA_ERROR_INVALID_HANDLE;
        } else if (st->capture != NULL) {
            st_out = st->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE;
            g = st->capture;
            cid = st->capture_id;
        }
        sim_rec_unlock();
    }
    if (rc != CUDA_SUCCESS)
        return rc;
    *status = st_out;
    if (id != NULL)
        *id = cid;
    if (graph != NULL)
        *graph = g;
    if (deps != NULL)
        *deps = NULL;
    if (ndeps != NULL)
        *ndeps = 0;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return capture_info(hStream, captureStatus, NULL, NULL, NULL, NULL);
}

SIM_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return capture_info(hStream, captureStatus, NULL, NULL, NULL, NULL);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                           cuuint64_t *id_out)
{
    return capture_info(hStream, captureStatus_out, id_out, NULL, NULL, NULL);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                cuuint64_t *id_out)
{
    return capture_info(hStream, captureStatus_out, id_out, NULL, NULL, NULL);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                              cuuint64_t *id_out, CUgraph *graph_out,
                                              const CUgraphNode **dependencies_out, size_t *numDependencies_out)
{
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                   cuuint64_t *id_out, CUgraph *graph_out,
                                                   const CUgraphNode **dependencies_out, size_t *numDependencies_out)
{
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                              cuuint64_t *id_out, CUgraph *graph_out,
                                              const CUgraphNode **dependencies_out, const CUgraphEdgeData **edgeData_out,
                                              size_t *numDependencies_out)
{
    if (edgeData_out != NULL)
        *edgeData_out = NULL;
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                   cuuint64_t *id_out, CUgraph *graph_out,
                                                   const CUgraphNode **dependencies_out,
                                                   const CUgraphEdgeData **edgeData_out, size_t *numDependencies_out)
{
    return cuStreamGetCaptureInfo_v3(hStream, captureStatus_out, id_out, graph_out, dependencies_out, edgeData_out,
                                     numDependencies_out);
}

/* ---- waiting ----------------------------------------------------------------------------------- */

static CUresult stream_sync(CUstream s)
{
    unsigned gpu;
    uint64_t upto;
    if (capture_violated(s))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    CUresult rc = stream_upto(s, &gpu, &upto);
    if (rc == CUDA_SUCCESS) {
        sim_tl_wait(sim_cu_node()->state, gpu, upto);
        sim_pools_synchronized();
    }
    return rc;
}

static CUresult stream_query(CUstream s)
{
    unsigned gpu;
    uint64_t upto;
    if (capture_violated(s))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
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
    CUresult rc = sim_stream_device(s, &gpu);
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
    if (rc == CUDA_SUCCESS) {
        sim_tl_wait(sim_cu_node()->state, (unsigned)dev, sim_tl_tail(sim_cu_node()->state, (unsigned)dev));
        sim_pools_synchronized();
    }
    return rc;
}

/* ---- events ------------------------------------------------------------------------------ */

/*
 * An event belongs to the context it was created in and is destroyed with it (cuda.h: destroying a context frees
 * its resources).  A handle the driver has freed is not a handle: what a real driver does with it is undefined (it
 * reads or frees freed memory), so the simulated one stops the process there, naming the call, rather than answer.
 */
struct CUevent_st {
    unsigned flags;
    unsigned gpu;
    bool recorded;
    uint64_t upto;    /* kernels it waits for */
    uint64_t rec_ns;  /* when it was recorded (CLOCK_MONOTONIC) */
    uint64_t end_ns;  /* its completion time once seen complete, else 0 */
};

/* Whether e is a live event (NULL: not; a freed one stops the process); *ctx: the context it belongs to. */
static bool event_valid_in(CUevent e, const char *call, CUcontext *ctx)
{
    if (e == NULL)
        return false;
    struct vc_map_entry r;
    if (!sim_find((uint64_t)(uintptr_t)e, REC_EVENT, &r, false)) {
        fprintf(stderr, "simulated libcuda: %s of event %p, which is destroyed (by cuEventDestroy, or with its "
                "context): a real driver's use of freed memory\n", call, (void *)e);
        abort();
    }
    if (ctx != NULL)
        *ctx = (CUcontext)(uintptr_t)r.ctx;
    return true;
}

static bool event_valid(CUevent e, const char *call)
{
    return event_valid_in(e, call, NULL);
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
    *e = (struct CUevent_st){.flags = Flags, .gpu = (unsigned)dev};
    if (sim_put((uint64_t)(uintptr_t)e, REC_EVENT, (unsigned)dev, 0, 0) != 0) { /* in the current context */
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *phEvent = e;
    return CUDA_SUCCESS;
}

static CUresult event_destroy(CUevent e)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_valid(e, "cuEventDestroy"))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!sim_find((uint64_t)(uintptr_t)e, REC_EVENT, NULL, true))
        return CUDA_ERROR_INVALID_HANDLE; /* another thread destroyed it meanwhile */
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

/* cuda.h: the event and the stream must be of the same context (else CUDA_ERROR_INVALID_HANDLE). */
static CUresult event_record(CUevent e, CUstream s)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext ectx, sctx;
    if (!event_valid_in(e, "cuEventRecord", &ectx))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = stream_ctx(s, &sctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (sctx != ectx)
        return CUDA_ERROR_INVALID_HANDLE;
    unsigned gpu;
    uint64_t upto;
    rc = stream_upto(s, &gpu, &upto);
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
    if (!event_valid(hEvent, "cuEventQuery"))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!event_done(hEvent))
        return CUDA_ERROR_NOT_READY;
    sim_deferred_frees_due(); /* a free queued before the event has happened by now */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!event_valid(hEvent, "cuEventSynchronize"))
        return CUDA_ERROR_INVALID_HANDLE;
    if (hEvent->recorded)
        sim_tl_wait(sim_cu_node()->state, hEvent->gpu, hEvent->upto);
    event_done(hEvent);
    sim_pools_synchronized();
    return CUDA_SUCCESS;
}

static CUresult elapsed(float *ms, CUevent a, CUevent b)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ms == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!event_valid(a, "cuEventElapsedTime") || !event_valid(b, "cuEventElapsedTime") ||
        (a->flags & CU_EVENT_DISABLE_TIMING) || (b->flags & CU_EVENT_DISABLE_TIMING) || !a->recorded || !b->recorded)
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
