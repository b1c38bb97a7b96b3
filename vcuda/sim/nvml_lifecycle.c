/* nvmlInit, nvmlShutdown, error strings, system queries and the shared entry-point helpers. */
#include "nvml_sim.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Opaque device handles: the address of slot i is the handle of NVML index i. Never written. */
struct nvmlDevice_st {
    unsigned char unused;
};
static const struct nvmlDevice_st g_handles[GPUSIM_MAX_GPUS];

/* Life cycle: g_ctx and g_refcount change only under the write lock. */
static pthread_rwlock_t g_life = PTHREAD_RWLOCK_INITIALIZER;
static struct sim_ctx g_ctx;
static unsigned g_refcount;

/*
 * A child forked while another thread was inside a call (read lock held) has a copy of g_life held by a thread
 * it does not have: its nvmlInit would wait forever.  Readers change nothing, so the copy of g_ctx is whole;
 * the child's lock starts fresh.
 */
static void life_atfork_child(void)
{
    pthread_rwlock_init(&g_life, NULL);
}

__attribute__((constructor)) static void life_init(void)
{
    pthread_atfork(NULL, NULL, life_atfork_child);
}

nvmlDevice_t sim_handle(unsigned index)
{
    return (nvmlDevice_t)(uintptr_t)&g_handles[index];
}

int sim_handle_index(const struct sim_ctx *ctx, nvmlDevice_t device)
{
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)&g_handles[0];
    if (device == NULL || p < base || p >= base + sizeof(g_handles) || (p - base) % sizeof(g_handles[0]) != 0)
        return -1;
    size_t index = (p - base) / sizeof(g_handles[0]);
    return index < ctx->spec->gpu_count ? (int)index : -1;
}

nvmlReturn_t sim_enter(const struct sim_ctx **ctx)
{
    pthread_rwlock_rdlock(&g_life);
    if (g_refcount == 0) {
        pthread_rwlock_unlock(&g_life);
        return NVML_ERROR_UNINITIALIZED;
    }
    *ctx = &g_ctx;
    return NVML_SUCCESS;
}

void sim_leave(void)
{
    pthread_rwlock_unlock(&g_life);
}

bool sim_gpu_lost(const struct sim_ctx *ctx, unsigned index)
{
    if (sim_state_lock(ctx->state) != 0)
        return false;
    const struct gpusim_gpu *g = sim_state_gpu(ctx->state, index);
    bool lost = g != NULL && (g->flags & GPUSIM_GPU_LOST) != 0;
    sim_state_unlock(ctx->state);
    return lost;
}

void sim_gpu_wait_unhung(const struct sim_ctx *ctx, unsigned index)
{
    for (;;) {
        if (sim_state_lock(ctx->state) != 0)
            return;
        const struct gpusim_gpu *g = sim_state_gpu(ctx->state, index);
        bool hung = g != NULL && (g->flags & GPUSIM_GPU_HUNG) != 0;
        sim_state_unlock(ctx->state);
        if (!hung)
            return;
        struct timespec pause = {0, 5 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
}

nvmlReturn_t sim_enter_device(nvmlDevice_t device, const struct sim_ctx **ctx, unsigned *index)
{
    nvmlReturn_t rc = sim_enter(ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    int i = sim_handle_index(*ctx, device);
    if (i < 0) {
        sim_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    sim_gpu_wait_unhung(*ctx, (unsigned)i);
    if (sim_gpu_lost(*ctx, (unsigned)i)) {
        sim_leave();
        return NVML_ERROR_GPU_IS_LOST;
    }
    *index = (unsigned)i;
    return NVML_SUCCESS;
}

nvmlReturn_t sim_copy_string(char *dst, unsigned length, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (length < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ---- init / shutdown ---------------------------------------------------- */

static nvmlReturn_t load_node(struct sim_ctx *ctx)
{
    char err[1024];
    const char *spec_path = getenv("GPUSIM_SPEC");
    if (spec_path == NULL || spec_path[0] == '\0') {
        fprintf(stderr, "gpusim: GPUSIM_SPEC is not set: it must name the node spec JSON file\n");
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    struct sim_spec *spec = sim_spec_load(spec_path, err, sizeof(err));
    if (spec == NULL) {
        fprintf(stderr, "gpusim: %s\n", err);
        return NVML_ERROR_UNKNOWN;
    }
    sim_serve_proc_version(spec);
    const char *state_path = getenv("GPUSIM_STATE");
    if (state_path == NULL || state_path[0] == '\0') {
        fprintf(stderr, "gpusim: GPUSIM_STATE is not set: it must name the run-time state file\n");
        sim_spec_free(spec);
        return NVML_ERROR_UNKNOWN;
    }
    struct sim_state *state = sim_state_open(state_path, err, sizeof(err));
    if (state == NULL) {
        fprintf(stderr, "gpusim: %s\n", err);
        sim_spec_free(spec);
        return NVML_ERROR_UNKNOWN;
    }
    ctx->spec = spec;
    ctx->state = state;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS: a spec may have zero GPUs anyway; NO_ATTACH: nothing to attach */
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_rwlock_wrlock(&g_life);
    if (g_refcount == 0)
        rc = load_node(&g_ctx);
    if (rc == NVML_SUCCESS) {
        if (g_refcount == UINT32_MAX)
            rc = NVML_ERROR_UNKNOWN;
        else
            g_refcount++;
    }
    pthread_rwlock_unlock(&g_life);
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

SIM_EXPORT nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

SIM_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_rwlock_wrlock(&g_life);
    if (g_refcount == 0) {
        rc = NVML_ERROR_UNINITIALIZED;
    } else if (--g_refcount == 0) {
        sim_state_close(g_ctx.state);
        sim_spec_free(g_ctx.spec);
        g_ctx = (struct sim_ctx){0};
    }
    pthread_rwlock_unlock(&g_life);
    return rc;
}

SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "vGPU operation not available while ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    }
    return "Unknown Error";
}

/* ---- system queries ----------------------------------------------------- */

SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    rc = sim_copy_string(version, length, ctx->spec->driver_version);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    char buf[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE + 16];
    snprintf(buf, sizeof(buf), "%d.%s", NVML_API_VERSION, ctx->spec->driver_version);
    rc = sim_copy_string(version, length, buf);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    if (cudaDriverVersion == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *cudaDriverVersion = ctx->spec->cuda_driver_version;
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}
