/*
 * Internals shared by the simulated libnvidia-ml.so.1 sources.
 *
 * Every exported entry point is marked SIM_EXPORT (default visibility; the
 * library is built with -fvisibility=hidden and a generated version script).
 * gen_nvml_stubs.py scans the sources for SIM_EXPORT definitions and emits a
 * NOT_SUPPORTED stub for every other function declared in nvml.h.
 *
 * Call pattern of an entry point:
 *     rc = sim_enter_device(device, &ctx, &idx);   // or sim_enter(&ctx)
 *     if (rc != NVML_SUCCESS) return rc;
 *     ... read ctx->spec, lock ctx->state for run-time state ...
 *     sim_leave();
 */
#ifndef GPUSIM_NVML_SIM_H
#define GPUSIM_NVML_SIM_H

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* we define nvmlInit and nvmlInit_v2 side by side */
#endif
#include <nvml.h>

#include <stdbool.h>

#include "sim_spec.h"
#include "sim_state.h"

#define SIM_EXPORT __attribute__((visibility("default")))

/* Event types a simulated GPU reports as supported; only XID events are ever raised. */
#define SIM_SUPPORTED_EVENTS                                                                                     \
    (nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError |        \
     nvmlEventTypePState | nvmlEventTypeClock)

struct sim_ctx {
    struct sim_spec *spec;   /* read-only while initialised */
    struct sim_state *state; /* lock before touching the mapping */
};

/*
 * Holds the library's life-cycle read lock: between sim_enter() returning
 * NVML_SUCCESS and sim_leave(), nvmlShutdown cannot tear *ctx down.
 * Returns NVML_ERROR_UNINITIALIZED (lock not held) before nvmlInit.
 */
nvmlReturn_t sim_enter(const struct sim_ctx **ctx);
void sim_leave(void);

/*
 * sim_enter() plus: device must be a valid handle (else INVALID_ARGUMENT) and
 * the GPU must not be lost (else GPU_IS_LOST).  Blocks while the GPU is hung.  On failure nothing is held.
 */
nvmlReturn_t sim_enter_device(nvmlDevice_t device, const struct sim_ctx **ctx, unsigned *index);

/* Handle of NVML index i (i < GPUSIM_MAX_GPUS). */
nvmlDevice_t sim_handle(unsigned index);

/* Index of a handle, or -1 if it is not one of ours or beyond the spec's GPU count. */
int sim_handle_index(const struct sim_ctx *ctx, nvmlDevice_t device);

/* Blocks while GPU index is marked hung in the state file (a GPU stuck in reset), polling every 5 ms. */
void sim_gpu_wait_unhung(const struct sim_ctx *ctx, unsigned index);

/* Whether GPU index is marked lost in the state file (takes the state lock). */
bool sim_gpu_lost(const struct sim_ctx *ctx, unsigned index);

/* Copies a NUL-terminated string into a caller buffer of length bytes. */
nvmlReturn_t sim_copy_string(char *dst, unsigned length, const char *src);

/* Fills an nvmlPciInfo_t; legacy_only leaves busId[] (absent from the v1 struct) untouched. */
void sim_fill_pci_info(const struct sim_gpu_spec *gpu, nvmlPciInfo_t *pci, bool legacy_only);

#endif
