/*
 * Contexts: what creating one costs the container's memory budget, and what
 * destroying one changes (README.md "Contexts").
 */
#include "vc_internal.h"

#include <stdatomic.h>

#define CONTEXT_FIRST()                                                                                            \
    do {                                                                                                           \
        if (VC_UNLIKELY(vc_limited()) && !vc_budget_charge_context())                                              \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
    } while (0)

VC_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CONTEXT_FIRST();
    return REAL_CU(cuCtxCreate)(pctx, flags, dev);
}

VC_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CONTEXT_FIRST();
    return REAL_CU(cuCtxCreate_v2)(pctx, flags, dev);
}

VC_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                  unsigned int flags, CUdevice dev)
{
    CONTEXT_FIRST();
    return REAL_CU(cuCtxCreate_v3)(pctx, paramsArray, numParams, flags, dev);
}

VC_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                  CUdevice dev)
{
    CONTEXT_FIRST();
    return REAL_CU(cuCtxCreate_v4)(pctx, ctxCreateParams, flags, dev);
}

#define MAX_DEVICES 64
static _Atomic(CUcontext) g_primary[MAX_DEVICES]; /* each device's primary context, once retained */

VC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CONTEXT_FIRST();
    CUresult rc = REAL_CU(cuDevicePrimaryCtxRetain)(pctx, dev);
    if (rc == CUDA_SUCCESS && pctx != NULL && dev >= 0 && dev < MAX_DEVICES)
        atomic_store(&g_primary[dev], *pctx); /* the same handle for the device's whole life (cuda.h) */
    return rc;
}

/* ---- destroying a context --------------------------------------------------------------------------- */

/* After ctx went away (rc: the driver's answer): what was allocated in it is freed by the driver. */
static CUresult context_gone(CUresult rc, CUcontext ctx)
{
    if (rc != CUDA_SUCCESS)
        return rc;
    if (VC_UNLIKELY(vc_core_limited()))
        vc_core_streams_changed(); /* its streams are gone with it */
    if (VC_UNLIKELY(vc_limited()) && ctx != NULL)
        vc_memory_context_gone(ctx);
    return rc;
}

VC_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    return context_gone(REAL_CU(cuCtxDestroy)(ctx), ctx);
}

VC_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    return context_gone(REAL_CU(cuCtxDestroy_v2)(ctx), ctx);
}

static CUcontext primary_of(CUdevice dev)
{
    return dev >= 0 && dev < MAX_DEVICES ? atomic_load(&g_primary[dev]) : NULL;
}

/* A release destroys the primary context when it was the last reference. */
static CUresult primary_released(CUresult rc, CUdevice dev)
{
    if (rc != CUDA_SUCCESS || (!vc_limited() && !vc_core_limited()))
        return rc;
    unsigned flags = 0;
    int active = 1;
    if (REAL_CU(cuDevicePrimaryCtxGetState)(dev, &flags, &active) == CUDA_SUCCESS && !active)
        return context_gone(rc, primary_of(dev));
    return rc;
}

VC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return primary_released(REAL_CU(cuDevicePrimaryCtxRelease)(dev), dev);
}

VC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return primary_released(REAL_CU(cuDevicePrimaryCtxRelease_v2)(dev), dev);
}

VC_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return context_gone(REAL_CU(cuDevicePrimaryCtxReset)(dev), primary_of(dev));
}

VC_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return context_gone(REAL_CU(cuDevicePrimaryCtxReset_v2)(dev), primary_of(dev));
}
