/* Run-time device state from the state file: running processes and utilisation. */
#include "nvml_sim.h"

#include <string.h>

/* ---- compute running processes ------------------------------------------ */

/* One entry point for all versions: v1 fills nvmlProcessInfo_v1_t, v2/v3 fill nvmlProcessInfo_v2_t. */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned *count, void *infos, bool v1)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (count == NULL) {
        sim_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (sim_state_lock(ctx->state) != 0) {
        sim_leave();
        return NVML_ERROR_UNKNOWN;
    }
    sim_state_reap_dead(ctx->state);
    unsigned cap = sim_state_proc_capacity(ctx->state), n = 0;
    for (unsigned s = 0; s < cap; s++) {
        const struct gpusim_proc *p = sim_state_proc(ctx->state, s);
        n += (p->flags & GPUSIM_PROC_IN_USE) && p->gpu == i;
    }
    if (*count < n) {
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else if (n > 0 && infos == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        unsigned k = 0;
        for (unsigned s = 0; s < cap && k < n; s++) {
            const struct gpusim_proc *p = sim_state_proc(ctx->state, s);
            if (!(p->flags & GPUSIM_PROC_IN_USE) || p->gpu != i)
                continue;
            if (v1) {
                nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + k;
                out->pid = p->pid;
                out->usedGpuMemory = p->used_bytes;
            } else {
                nvmlProcessInfo_v2_t *out = (nvmlProcessInfo_v2_t *)infos + k;
                out->pid = p->pid;
                out->usedGpuMemory = p->used_bytes;
                out->gpuInstanceId = 0xFFFFFFFFu;
                out->computeInstanceId = 0xFFFFFFFFu;
            }
            k++;
        }
    }
    *count = n;
    sim_state_unlock(ctx->state);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v1_t *infos)
{
    return running_processes(device, infoCount, infos, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_v2_t *infos)
{
    return running_processes(device, infoCount, infos, false);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_t *infos)
{
    return running_processes(device, infoCount, infos, false);
}

/* ---- utilisation -------------------------------------------------------- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (utilization == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (sim_state_lock(ctx->state) != 0) {
        rc = NVML_ERROR_UNKNOWN;
    } else {
        const struct gpusim_gpu *g = sim_state_gpu(ctx->state, i);
        utilization->gpu = g->util_gpu;
        utilization->memory = g->util_memory;
        sim_state_unlock(ctx->state);
    }
    sim_leave();
    return rc;
}

/*
 * Samples newer than lastSeenTimeStamp, oldest first.  With samples == NULL
 * only the count is reported; a short buffer receives the newest ones.
 */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, nvmlSamplingType_t type,
                                             unsigned long long lastSeenTimeStamp, nvmlValueType_t *sampleValType,
                                             unsigned int *sampleCount, nvmlSample_t *samples)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (sampleValType == NULL || sampleCount == NULL || (samples != NULL && *sampleCount == 0)) {
        sim_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (type != NVML_GPU_UTILIZATION_SAMPLES && type != NVML_MEMORY_UTILIZATION_SAMPLES) {
        sim_leave();
        return NVML_ERROR_NOT_SUPPORTED;
    }
    if (sim_state_lock(ctx->state) != 0) {
        sim_leave();
        return NVML_ERROR_UNKNOWN;
    }
    const struct gpusim_gpu *g = sim_state_gpu(ctx->state, i);
    uint64_t total = g->sample_count;
    uint64_t first = total > GPUSIM_UTIL_SAMPLES ? total - GPUSIM_UTIL_SAMPLES : 0;
    uint64_t newer = first;
    while (newer < total && g->samples[newer % GPUSIM_UTIL_SAMPLES].timestamp_us <= lastSeenTimeStamp)
        newer++;
    unsigned n = (unsigned)(total - newer);
    *sampleValType = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (n == 0) {
        rc = NVML_ERROR_NOT_FOUND;
    } else if (samples == NULL) {
        *sampleCount = n;
    } else {
        unsigned take = n < *sampleCount ? n : *sampleCount;
        for (unsigned k = 0; k < take; k++) {
            const struct gpusim_util_sample *s = &g->samples[(total - take + k) % GPUSIM_UTIL_SAMPLES];
            memset(&samples[k], 0, sizeof(samples[k]));
            samples[k].timeStamp = s->timestamp_us;
            samples[k].sampleValue.uiVal = type == NVML_GPU_UTILIZATION_SAMPLES ? s->gpu_percent : s->memory_percent;
        }
        *sampleCount = take;
    }
    sim_state_unlock(ctx->state);
    sim_leave();
    return rc;
}

/* One sample per process of this GPU with non-zero utilisation updated after lastSeenTimeStamp. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                        unsigned int *processSamplesCount,
                                                        unsigned long long lastSeenTimeStamp)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (processSamplesCount == NULL) {
        sim_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (sim_state_lock(ctx->state) != 0) {
        sim_leave();
        return NVML_ERROR_UNKNOWN;
    }
    unsigned cap = sim_state_proc_capacity(ctx->state), n = 0;
#define SAMPLE_OF(p)                                                                                             \
    (((p)->flags & GPUSIM_PROC_IN_USE) && (p)->gpu == i && ((p)->sm_util > 0 || (p)->mem_util > 0) &&           \
     (p)->updated_us > lastSeenTimeStamp)
    for (unsigned s = 0; s < cap; s++)
        n += SAMPLE_OF(sim_state_proc(ctx->state, s));
    if (n == 0) {
        rc = NVML_ERROR_NOT_FOUND;
    } else if (utilization == NULL || *processSamplesCount < n) {
        *processSamplesCount = n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        unsigned k = 0;
        for (unsigned s = 0; s < cap && k < n; s++) {
            const struct gpusim_proc *p = sim_state_proc(ctx->state, s);
            if (!SAMPLE_OF(p))
                continue;
            utilization[k] = (nvmlProcessUtilizationSample_t){
                .pid = p->pid, .timeStamp = p->updated_us, .smUtil = p->sm_util, .memUtil = p->mem_util};
            k++;
        }
        *processSamplesCount = n;
    }
#undef SAMPLE_OF
    sim_state_unlock(ctx->state);
    sim_leave();
    return rc;
}
