/*
 * Event sets.  Events live in the state file's ring (GPUSIM_SECTION_EVENTS);
 * a set remembers the last sequence number it has consumed and, per GPU, the
 * sequence number current when the GPU was registered, so it sees only events
 * queued after registration.  Every process reads the ring independently, so
 * each set in each process sees every event.
 *
 * Only nvmlEventTypeXidCriticalError events are ever raised (by the gpusim
 * CLI); the other types of SIM_SUPPORTED_EVENTS are accepted and never fire.
 */
#include "nvml_sim.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#define EVENT_SET_MAGIC 0x45565453u /* "EVTS" */

struct nvmlEventSet_st {
    unsigned magic;
    pthread_mutex_t mu; /* guards the fields below */
    uint64_t last_seq;
    uint64_t mask[GPUSIM_MAX_GPUS];
    uint64_t registered_at[GPUSIM_MAX_GPUS];
};

static uint64_t current_seq(struct sim_state *st)
{
    uint64_t next = sim_state_header(st)->event_next_seq;
    return next == 0 ? 0 : next - 1;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    struct nvmlEventSet_st *s = NULL;
    if (set == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if ((s = calloc(1, sizeof(*s))) == NULL) {
        rc = NVML_ERROR_MEMORY;
    } else if (sim_state_lock(ctx->state) != 0) {
        free(s);
        rc = NVML_ERROR_UNKNOWN;
    } else {
        s->last_seq = current_seq(ctx->state);
        sim_state_unlock(ctx->state);
        pthread_mutex_init(&s->mu, NULL);
        s->magic = EVENT_SET_MAGIC;
        *set = s;
    }
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    if (set == NULL || set->magic != EVENT_SET_MAGIC) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        set->magic = 0;
        pthread_mutex_destroy(&set->mu);
        free(set);
    }
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (eventTypes == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *eventTypes = SIM_SUPPORTED_EVENTS;
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (set == NULL || set->magic != EVENT_SET_MAGIC) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if ((eventTypes & ~(unsigned long long)SIM_SUPPORTED_EVENTS) != 0) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else if (sim_state_lock(ctx->state) != 0) {
        rc = NVML_ERROR_UNKNOWN;
    } else {
        uint64_t now = current_seq(ctx->state);
        sim_state_unlock(ctx->state);
        pthread_mutex_lock(&set->mu);
        if (set->mask[i] == 0)
            set->registered_at[i] = now;
        set->mask[i] |= eventTypes;
        pthread_mutex_unlock(&set->mu);
    }
    sim_leave();
    return rc;
}

/*
 * One scan of the ring for set (set->mu and the state lock held).  Returns
 * NVML_SUCCESS with *data filled, GPU_IS_LOST when nothing is pending and a
 * registered GPU is lost, or TIMEOUT when there is nothing to report yet.
 */
static nvmlReturn_t scan(const struct sim_ctx *ctx, struct nvmlEventSet_st *set, nvmlEventData_t *data)
{
    struct sim_state *st = ctx->state;
    uint64_t newest = current_seq(st);
    uint64_t ring = sim_state_event_capacity(st);
    if (newest > ring && set->last_seq < newest - ring)
        set->last_seq = newest - ring; /* fell behind: the oldest events were overwritten */
    while (set->last_seq < newest) {
        uint64_t seq = ++set->last_seq;
        const struct gpusim_event *e = sim_state_event_slot(st, seq);
        if (e->seq != seq || e->gpu >= ctx->spec->gpu_count)
            continue;
        if ((set->mask[e->gpu] & e->event_type) == 0 || seq <= set->registered_at[e->gpu])
            continue;
        data->device = sim_handle(e->gpu);
        data->eventType = e->event_type;
        data->eventData = e->event_data;
        data->gpuInstanceId = 0xFFFFFFFFu;
        data->computeInstanceId = 0xFFFFFFFFu;
        return NVML_SUCCESS;
    }
    for (unsigned g = 0; g < ctx->spec->gpu_count; g++) {
        const struct gpusim_gpu *gpu = sim_state_gpu(st, g);
        if (set->mask[g] != 0 && (gpu->flags & GPUSIM_GPU_LOST))
            return NVML_ERROR_GPU_IS_LOST;
    }
    return NVML_ERROR_TIMEOUT;
}

static int64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (data == NULL || set == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const int64_t deadline = monotonic_ns() + (int64_t)timeoutms * 1000000;
    bool scanned = false;
    uint64_t seen_change = 0;
    for (;;) {
        const struct sim_ctx *ctx;
        nvmlReturn_t rc = sim_enter(&ctx);
        if (rc != NVML_SUCCESS)
            return rc;
        if (set->magic != EVENT_SET_MAGIC) {
            sim_leave();
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        /* Rescan only when the state file changed since the last scan. */
        uint64_t change = sim_state_change_hint(ctx->state);
        if (!scanned || change != seen_change) {
            pthread_mutex_lock(&set->mu);
            if (sim_state_lock(ctx->state) != 0) {
                rc = NVML_ERROR_UNKNOWN;
            } else {
                rc = scan(ctx, set, data);
                sim_state_unlock(ctx->state);
            }
            pthread_mutex_unlock(&set->mu);
            scanned = true;
            seen_change = change;
        } else {
            rc = NVML_ERROR_TIMEOUT;
        }
        const uint32_t *word = sim_state_change_word(ctx->state);
        sim_leave();
        if (rc != NVML_ERROR_TIMEOUT)
            return rc;
        int64_t left = deadline - monotonic_ns();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        /* Block until the state file changes (every writer wakes us), as the driver blocks. */
        sim_state_wait_change(word, seen_change, left);
    }
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
