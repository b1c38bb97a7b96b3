/* Run-time device state from the state file: running processes and utilisation. */
#include "nvml_sim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sim_timeline.h"

/* nvmlDeviceGetUtilizationRates' sample period on the timeline (NVML: between 1/6 s and 1 s). */
#define DEVICE_UTIL_WINDOW_NS 166666667ull
/* Per-process utilisation samples one call returns at most. */
#define MAX_TL_PROCS 64u

/* ---- compute running processes ------------------------------------------ */

/*
 * GPUSIM_PROCS_RETURN_DELAY_US (tests): the process lists return only this many microseconds after they
 * were read, so that what happens meanwhile in another thread of the caller can be raced reproducibly.
 */
static void return_delay(void)
{
    static long delay_us = -1;
    long us = sim_env_knob("GPUSIM_PROCS_RETURN_DELAY_US", &delay_us);
    if (us > 0) {
        struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = us % 1000000 * 1000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}

/*
 * GPUSIM_OWN_PID_NAMESPACE=1: this process runs in a PID namespace of its own (a pod without hostPID) in which
 * no other process of the node is seen. A driver that translates the PIDs it reports into the caller's namespace
 * shows the processes it cannot translate with PID 0: every process but the caller itself, here.
 */
static uint32_t shown_pid(uint32_t pid)
{
    static long own_namespace = -1;
    if (sim_env_knob("GPUSIM_OWN_PID_NAMESPACE", &own_namespace) == 0)
        return pid;
    return pid == (uint32_t)getpid() ? pid : 0u;
}

/* Whether the process list asked for (graphics or compute) holds entry p of GPU i. */
static bool listed(const struct gpusim_proc *p, unsigned i, bool graphics)
{
    return (p->flags & GPUSIM_PROC_IN_USE) && p->gpu == i && ((p->flags & GPUSIM_PROC_GRAPHICS) != 0) == graphics;
}

/*
 * One entry point for all versions of both lists: v1 fills nvmlProcessInfo_v1_t, v2/v3 fill nvmlProcessInfo_v2_t;
 * graphics: the graphics processes, else the compute ones.
 */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned *count, void *infos, bool v1, bool graphics)
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
        n += listed(p, i, graphics);
    }
    if (*count < n) {
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else if (n > 0 && infos == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        unsigned k = 0;
        for (unsigned s = 0; s < cap && k < n; s++) {
            const struct gpusim_proc *p = sim_state_proc(ctx->state, s);
            if (!listed(p, i, graphics))
                continue;
            if (v1) {
                nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + k;
                out->pid = shown_pid(p->pid);
                out->usedGpuMemory = p->used_bytes;
            } else {
                nvmlProcessInfo_v2_t *out = (nvmlProcessInfo_v2_t *)infos + k;
                out->pid = shown_pid(p->pid);
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
    return_delay();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v1_t *infos)
{
    return running_processes(device, infoCount, infos, true, false);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_v2_t *infos)
{
    return running_processes(device, infoCount, infos, false, false);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_t *infos)
{
    return running_processes(device, infoCount, infos, false, false);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_v1_t *infos)
{
    return running_processes(device, infoCount, infos, true, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_v2_t *infos)
{
    return running_processes(device, infoCount, infos, false, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos)
{
    return running_processes(device, infoCount, infos, false, true);
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
    } else {
        /* A GPU that ran simulated kernels reports its timeline; otherwise what `gpusim util` set. */
        bool timeline = sim_tl_active(ctx->state, i);
        unsigned tl_gpu = timeline ? sim_tl_gpu_percent(ctx->state, i, DEVICE_UTIL_WINDOW_NS) : 0;
        if (sim_state_lock(ctx->state) != 0) {
            rc = NVML_ERROR_UNKNOWN;
        } else {
            const struct gpusim_gpu *g = sim_state_gpu(ctx->state, i);
            utilization->gpu = timeline ? tl_gpu : g->util_gpu;
            utilization->memory = g->util_memory;
            sim_state_unlock(ctx->state);
        }
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
    if (type == NVML_GPU_UTILIZATION_SAMPLES && sim_tl_active(ctx->state, i)) {
        /* One sample per 10 ms of the timeline. */
        uint64_t ts[GPUSIM_TL_CKPTS];
        unsigned pct[GPUSIM_TL_CKPTS];
        unsigned want = samples == NULL ? GPUSIM_TL_CKPTS : *sampleCount;
        if (want > GPUSIM_TL_CKPTS)
            want = GPUSIM_TL_CKPTS;
        unsigned n = sim_tl_samples(ctx->state, i, lastSeenTimeStamp, ts, pct, want);
        *sampleValType = NVML_VALUE_TYPE_UNSIGNED_INT;
        if (n == 0) {
            rc = NVML_ERROR_NOT_FOUND;
        } else if (samples != NULL) {
            for (unsigned k = 0; k < n; k++) {
                memset(&samples[k], 0, sizeof(samples[k]));
                samples[k].timeStamp = ts[k];
                samples[k].sampleValue.uiVal = pct[k];
            }
        }
        if (rc == NVML_SUCCESS)
            *sampleCount = n;
        sim_leave();
        return rc;
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

/*
 * Per-process utilisation of GPU i: the processes whose simulated kernels ran
 * in (max(lastSeen, now - 1 s), their newest sample moment] (smUtil = their
 * share of that window, timestamp = that moment: each its own), then the entries `gpusim proc` wrote with a non-zero
 * utilisation updated after lastSeen (a pid the timeline reported is not
 * repeated).  Returns how many samples exist; fills at most max.
 */
struct util_sample {
    uint32_t pid;
    uint64_t ts;
    unsigned sm, mem;
};

/*
 * GPUSIM_PROCESS_UTIL_ERROR (tests): a non-zero nvmlReturn_t that the per-process utilisation queries answer
 * every time, as a driver that cannot tell them does.
 */
static nvmlReturn_t process_util_error(void)
{
    static long error = -1;
    return (nvmlReturn_t)sim_env_knob("GPUSIM_PROCESS_UTIL_ERROR", &error);
}

/*
 * GPUSIM_PROCESS_SAMPLE_PERIOD_US: the driver's per-process sampling period (default DEFAULT_PERIOD_US; 0: the
 * timeline's 10 ms checkpoint period, kinder than any real driver: an H200 with driver 580.159 samples every
 * 200000 us, which several tests of containers sharing a GPU do not pass yet).  GPUSIM_PROCESS_SAMPLE_SPREAD_US: each process is sampled at its own
 * moment of each period, up to this many us before the period's end (a hash of its PID and the period, so its
 * sample times jitter by up to this much from one period to the next; default 8000, at most the period; 0:
 * every process at the period's end, one timestamp for all).  So processes of one answer carry different
 * timestamps, as with the real NVML.
 */
#define DEFAULT_SPREAD_US 8000L
#define DEFAULT_PERIOD_US 0L

static uint64_t env_us(const char *name, long *cache, long fallback)
{
    long v = __atomic_load_n(cache, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *text = getenv(name);
        char *end = NULL;
        long parsed = text != NULL && text[0] != '\0' ? strtol(text, &end, 10) : -1;
        v = parsed >= 0 && end != NULL && *end == '\0' ? parsed : fallback;
        __atomic_store_n(cache, v, __ATOMIC_RELAXED);
    }
    return (uint64_t)v;
}

static uint64_t sample_spread_us(void)
{
    static long spread = -1;
    return env_us("GPUSIM_PROCESS_SAMPLE_SPREAD_US", &spread, DEFAULT_SPREAD_US);
}

static uint64_t sample_period_us(void)
{
    static long period = -1;
    return env_us("GPUSIM_PROCESS_SAMPLE_PERIOD_US", &period, DEFAULT_PERIOD_US);
}

/*
 * GPUSIM_PROCESS_SAMPLE_DELAY_US: how long after its moment a per-process sample is delivered (default 0: at once;
 * at most 1 s).  A real driver shows a sample 0.7 s or more after the time it covers: a query sees only the samples
 * delivered by then, and one that passes a sample's timestamp back gets each later one once, when it is delivered.
 */
#define DEFAULT_DELAY_US 0L

static uint64_t sample_delay_us(void)
{
    static long delay = -1;
    return env_us("GPUSIM_PROCESS_SAMPLE_DELAY_US", &delay, DEFAULT_DELAY_US);
}

/*
 * GPUSIM_PROCESS_SAMPLE_MODE: how the driver samples (sim_tl_gpu_samples, sim_tl_process_util).  "window" (the
 * default, as unkind as the real driver): what an H200 with driver 580.159 answers: one sample per period naming the
 * process with the most GPU time in it, and an answer from a lastSeenTimeStamp other than 0 holds one sample per
 * process named since, averaged over the window's periods.  "gpu": one sample per period for the whole GPU, naming one
 * process drawn in proportion to its GPU time in the period, with the GPU's busy percent as its smUtil, every
 * period's sample in an answer (that driver's whole buffer, read from 0).
 * "process": each process's own share of the period, at its own moment.
 */
enum sample_mode { SAMPLE_PER_PROCESS, SAMPLE_PER_GPU, SAMPLE_WINDOW };

static enum sample_mode sample_mode(void)
{
    static int mode = -1;
    int v = __atomic_load_n(&mode, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *text = getenv("GPUSIM_PROCESS_SAMPLE_MODE");
        v = text != NULL && strcmp(text, "process") == 0  ? SAMPLE_PER_PROCESS
            : text != NULL && strcmp(text, "gpu") == 0    ? SAMPLE_PER_GPU
                                                           : SAMPLE_WINDOW;
        __atomic_store_n(&mode, v, __ATOMIC_RELAXED);
    }
    return (enum sample_mode)v;
}

static nvmlReturn_t process_samples(const struct sim_ctx *ctx, unsigned i, unsigned long long lastSeen,
                                    struct util_sample *out, unsigned max, unsigned *count)
{
    nvmlReturn_t fault = process_util_error();
    if (fault != NVML_SUCCESS)
        return fault;
    struct sim_tl_proc_util tl[MAX_TL_PROCS];
    uint64_t now_us = 0;
    enum sample_mode mode = sample_mode();
    unsigned ntl = mode != SAMPLE_PER_PROCESS
                       ? sim_tl_gpu_samples(ctx->state, i, lastSeen, sample_period_us(), sample_delay_us(),
                                            mode == SAMPLE_WINDOW, tl, MAX_TL_PROCS, &now_us)
                       : sim_tl_process_util(ctx->state, i, lastSeen, sample_spread_us(), sample_period_us(),
                                             sample_delay_us(), tl, MAX_TL_PROCS, &now_us);
    if (ntl > MAX_TL_PROCS)
        ntl = MAX_TL_PROCS;
    unsigned n = 0;
    for (unsigned k = 0; k < ntl; k++, n++)
        if (n < max)
            out[n] = (struct util_sample){.pid = tl[k].pid, .ts = tl[k].ts_us, .sm = tl[k].sm_percent, .mem = 0};
    if (sim_state_lock(ctx->state) != 0)
        return NVML_ERROR_UNKNOWN;
    unsigned cap = sim_state_proc_capacity(ctx->state);
    for (unsigned s = 0; s < cap; s++) {
        const struct gpusim_proc *p = sim_state_proc(ctx->state, s);
        if (!(p->flags & GPUSIM_PROC_IN_USE) || p->gpu != i || (p->sm_util == 0 && p->mem_util == 0) ||
            p->updated_us <= lastSeen)
            continue;
        bool seen = false;
        for (unsigned k = 0; k < ntl && !seen; k++)
            seen = tl[k].pid == p->pid;
        if (seen)
            continue;
        if (n < max)
            out[n] = (struct util_sample){.pid = p->pid, .ts = p->updated_us, .sm = p->sm_util, .mem = p->mem_util};
        n++;
    }
    sim_state_unlock(ctx->state);
    *count = n;
    return NVML_SUCCESS;
}

#define MAX_SAMPLES (MAX_TL_PROCS + GPUSIM_MAX_PROCS)

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
    static _Thread_local struct util_sample buf[MAX_SAMPLES];
    unsigned n = 0;
    rc = process_samples(ctx, i, lastSeenTimeStamp, buf, MAX_SAMPLES, &n);
    if (rc != NVML_SUCCESS) {
    } else if (n == 0) {
        rc = NVML_ERROR_NOT_FOUND;
    } else if (utilization == NULL || *processSamplesCount < n) {
        *processSamplesCount = n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned k = 0; k < n; k++)
            utilization[k] = (nvmlProcessUtilizationSample_t){
                .pid = shown_pid(buf[k].pid), .timeStamp = buf[k].ts, .smUtil = buf[k].sm, .memUtil = buf[k].mem};
        *processSamplesCount = n;
    }
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                              nvmlProcessesUtilizationInfo_t *info)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (info == NULL) {
        sim_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (info->version != nvmlProcessesUtilizationInfo_v1) {
        sim_leave();
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    static _Thread_local struct util_sample buf[MAX_SAMPLES];
    unsigned n = 0;
    rc = process_samples(ctx, i, info->lastSeenTimeStamp, buf, MAX_SAMPLES, &n);
    if (rc != NVML_SUCCESS) {
    } else if (n == 0) {
        rc = NVML_ERROR_NOT_FOUND;
    } else if (info->procUtilArray == NULL || info->processSamplesCount < n) {
        info->processSamplesCount = n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned k = 0; k < n; k++)
            info->procUtilArray[k] = (nvmlProcessUtilizationInfo_v1_t){
                .timeStamp = buf[k].ts, .pid = shown_pid(buf[k].pid), .smUtil = buf[k].sm, .memUtil = buf[k].mem};
        info->processSamplesCount = n;
    }
    sim_leave();
    return rc;
}
