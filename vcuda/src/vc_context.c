/*
 * Contexts: what creating one costs the container's memory budget, and what
 * destroying one changes (README.md "Contexts").
 */
#include "vc_internal.h"

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

VC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CONTEXT_FIRST();
    return REAL_CU(cuDevicePrimaryCtxRetain)(pctx, dev);
}

/* ---- destroying a context --------------------------------------------------------------------------- */

/* After a context went away (rc: the driver's answer). */
static CUresult context_gone(CUresult rc)
{
    if (rc == CUDA_SUCCESS && VC_UNLIKELY(vc_core_limited()))
        vc_core_streams_changed(); /* its streams are gone with it */
    return rc;
}

VC_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    return context_gone(REAL_CU(cuCtxDestroy)(ctx));
}

VC_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    return context_gone(REAL_CU(cuCtxDestroy_v2)(ctx));
}

VC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return context_gone(REAL_CU(cuDevicePrimaryCtxRelease)(dev));
}

VC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return context_gone(REAL_CU(cuDevicePrimaryCtxRelease_v2)(dev));
}

VC_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return context_gone(REAL_CU(cuDevicePrimaryCtxReset)(dev));
}

VC_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return context_gone(REAL_CU(cuDevicePrimaryCtxReset_v2)(dev));
}
