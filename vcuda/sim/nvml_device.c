/* Device enumeration and static device facts: handles, identity, PCI, memory, NUMA, topology. */
#include "nvml_sim.h"

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MIB (1024ull * 1024ull)

/* ---- enumeration -------------------------------------------------------- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    if (deviceCount == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *deviceCount = ctx->spec->gpu_count;
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

/* A lost GPU has no handle, as on real NVML (nvidia-smi: "Unable to determine the device handle for
 * GPU ...: GPU is lost"); nvml.h lists GPU_IS_LOST among this call's returns. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    if (device == NULL || index >= ctx->spec->gpu_count)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (sim_gpu_wait_unhung(ctx, index), sim_gpu_lost(ctx, index))
        rc = NVML_ERROR_GPU_IS_LOST;
    else
        *device = sim_handle(index);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

enum lookup_key { BY_UUID, BY_SERIAL, BY_BUS_ID };

/* Accepts "[domain:]bus:device[.function]" in hex, any case, any field width. */
static bool parse_bus_id_loose(const char *s, unsigned v[4])
{
    unsigned parts[4] = {0, 0, 0, 0};
    int n = 0;
    const char *p = s;
    size_t len = strlen(s);
    const char *dot = strrchr(s, '.'), *colon = strrchr(s, ':');
    if (len == 0 || s[len - 1] == ':' || s[len - 1] == '.' || (dot != NULL && (colon == NULL || dot < colon)))
        return false;
    while (n < 4) {
        char *end;
        if (!isxdigit((unsigned char)*p))
            return false;
        unsigned long x = strtoul(p, &end, 16);
        if (x > 0xFFFFFFFFul)
            return false;
        parts[n++] = (unsigned)x;
        p = end;
        if (*p == ':' || *p == '.') {
            p++;
            continue;
        }
        break;
    }
    if (*p != '\0')
        return false;
    /* Count colons to tell "bus:dev.fn" from "domain:bus:dev.fn". */
    int colons = 0;
    bool has_fn = strchr(s, '.') != NULL;
    for (const char *q = s; *q; q++)
        colons += *q == ':';
    if (colons == 2) {
        v[0] = parts[0];
        v[1] = parts[1];
        v[2] = parts[2];
        v[3] = has_fn ? parts[3] : 0;
        return n == (has_fn ? 4 : 3);
    }
    if (colons == 1) {
        v[0] = 0;
        v[1] = parts[0];
        v[2] = parts[1];
        v[3] = has_fn ? parts[2] : 0;
        return n == (has_fn ? 3 : 2);
    }
    return false;
}

static nvmlReturn_t lookup(enum lookup_key key, const char *text, nvmlDevice_t *device)
{
    const struct sim_ctx *ctx;
    nvmlReturn_t rc = sim_enter(&ctx);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned want[4] = {0, 0, 0, 0};
    if (text == NULL || device == NULL || (key == BY_BUS_ID && !parse_bus_id_loose(text, want))) {
        sim_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    rc = NVML_ERROR_NOT_FOUND;
    for (unsigned i = 0; i < ctx->spec->gpu_count; i++) {
        const struct sim_gpu_spec *g = &ctx->spec->gpus[i];
        bool match = false;
        if (key == BY_UUID)
            match = strcasecmp(g->uuid, text) == 0;
        else if (key == BY_SERIAL)
            match = strcmp(g->serial, text) == 0;
        else
            match = want[0] == g->pci_domain && want[1] == g->pci_bus && want[2] == g->pci_device &&
                    want[3] == g->pci_function;
        if (!match)
            continue;
        if (sim_gpu_lost(ctx, i)) {
            rc = NVML_ERROR_GPU_IS_LOST;
        } else {
            *device = sim_handle(i);
            rc = NVML_SUCCESS;
        }
        break;
    }
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    return lookup(BY_UUID, uuid, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *device)
{
    return lookup(BY_SERIAL, serial, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    return lookup(BY_BUS_ID, pciBusId, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return lookup(BY_BUS_ID, pciBusId, device);
}

/* ---- identity ----------------------------------------------------------- */

enum string_fact { FACT_NAME, FACT_UUID, FACT_SERIAL };

static nvmlReturn_t get_string_fact(nvmlDevice_t device, enum string_fact fact, char *buf, unsigned length)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_gpu_spec *g = &ctx->spec->gpus[i];
    const char *value = fact == FACT_NAME ? g->name : fact == FACT_UUID ? g->uuid : g->serial;
    rc = sim_copy_string(buf, length, value);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    return get_string_fact(device, FACT_NAME, name, length);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    return get_string_fact(device, FACT_UUID, uuid, length);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    return get_string_fact(device, FACT_SERIAL, serial, length);
}

enum uint_fact { FACT_INDEX, FACT_MINOR, FACT_MULTI_GPU_BOARD, FACT_NUMA_NODE };

static nvmlReturn_t get_uint_fact(nvmlDevice_t device, enum uint_fact fact, unsigned *out)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_gpu_spec *g = &ctx->spec->gpus[i];
    if (out == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (fact == FACT_INDEX)
        *out = i;
    else if (fact == FACT_MINOR)
        *out = g->minor;
    else if (fact == FACT_MULTI_GPU_BOARD)
        *out = g->multi_gpu_board ? 1u : 0u;
    else
        *out = g->numa_node;
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    return get_uint_fact(device, FACT_INDEX, index);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    return get_uint_fact(device, FACT_MINOR, minorNumber);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMultiGpuBoard(nvmlDevice_t device, unsigned int *multiGpuBool)
{
    return get_uint_fact(device, FACT_MULTI_GPU_BOARD, multiGpuBool);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    return get_uint_fact(device, FACT_NUMA_NODE, node);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_gpu_spec *g = &ctx->spec->gpus[i];
    if (major == NULL || minor == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (g->cc_major == 0) {
        rc = NVML_ERROR_NOT_SUPPORTED; /* model not in the sim's table */
    } else {
        *major = g->cc_major;
        *minor = g->cc_minor;
    }
    sim_leave();
    return rc;
}

/* ---- modes ---------------------------------------------------------------- */

/* The GPU's flags in the state file (0 when they cannot be read). */
static uint32_t gpu_flags(const struct sim_ctx *ctx, unsigned index)
{
    if (sim_state_lock(ctx->state) != 0)
        return 0;
    const struct gpusim_gpu *g = sim_state_gpu(ctx->state, index);
    uint32_t flags = g != NULL ? g->flags : 0;
    sim_state_unlock(ctx->state);
    return flags;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (mode == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *mode = (nvmlComputeMode_t)((gpu_flags(ctx, i) & GPUSIM_GPU_COMPUTE_MODE_MASK) >> GPUSIM_GPU_COMPUTE_MODE_SHIFT);
    sim_leave();
    return rc;
}

/* MIG-capable models (A100, A30: 8.0; H100, H200: 9.0; B200: 10.0) answer; the others NOT_SUPPORTED, as on NVML. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_gpu_spec *g = &ctx->spec->gpus[i];
    if (currentMode == NULL || pendingMode == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (g->cc_major < 8 || g->cc_minor != 0) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else {
        unsigned on = (gpu_flags(ctx, i) & GPUSIM_GPU_MIG) != 0 ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
        *currentMode = on;
        *pendingMode = on;
    }
    sim_leave();
    return rc;
}

/* ---- PCI ---------------------------------------------------------------- */

void sim_fill_pci_info(const struct sim_gpu_spec *g, nvmlPciInfo_t *pci, bool legacy_only)
{
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%s", g->pci_bus_id_legacy);
    pci->domain = g->pci_domain;
    pci->bus = g->pci_bus;
    pci->device = g->pci_device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_device_id;
    if (!legacy_only)
        snprintf(pci->busId, sizeof(pci->busId), "%s", g->pci_bus_id);
}

static nvmlReturn_t get_pci(nvmlDevice_t device, nvmlPciInfo_t *pci, bool legacy_only)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (pci == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        sim_fill_pci_info(&ctx->spec->gpus[i], pci, legacy_only);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return get_pci(device, pci, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return get_pci(device, pci, false);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return get_pci(device, pci, false);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_t *pci)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_gpu_spec *g = &ctx->spec->gpus[i];
    if (pci == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (pci->version != nvmlPciInfoExt_v1) {
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    } else {
        pci->domain = g->pci_domain;
        pci->bus = g->pci_bus;
        pci->device = g->pci_device;
        pci->pciDeviceId = g->pci_device_id;
        pci->pciSubSystemId = g->pci_device_id;
        pci->baseClass = 0x03; /* display controller */
        pci->subClass = 0x02;  /* 3D controller */
        snprintf(pci->busId, sizeof(pci->busId), "%s", g->pci_bus_id);
    }
    sim_leave();
    return rc;
}

/* ---- memory ------------------------------------------------------------- */

/* Total and used bytes of GPU i: used is the sum over the state file's process table. */
static void memory_of(const struct sim_ctx *ctx, unsigned i, unsigned long long *total, unsigned long long *used)
{
    *total = ctx->spec->gpus[i].memory_mib * MIB;
    *used = 0;
    if (sim_state_lock(ctx->state) != 0)
        return;
    sim_state_reap_dead(ctx->state); /* a process that is gone uses no memory */
    unsigned cap = sim_state_proc_capacity(ctx->state);
    for (unsigned s = 0; s < cap; s++) {
        const struct gpusim_proc *p = sim_state_proc(ctx->state, s);
        if ((p->flags & GPUSIM_PROC_IN_USE) && p->gpu == i)
            *used += p->used_bytes;
    }
    sim_state_unlock(ctx->state);
    if (*used > *total)
        *used = *total;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (memory == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        memory_of(ctx, i, &memory->total, &memory->used);
        memory->free = memory->total - memory->used;
    }
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (memory == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (memory->version != nvmlMemory_v2) {
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    } else {
        memory_of(ctx, i, &memory->total, &memory->used);
        memory->reserved = 0;
        memory->free = memory->total - memory->used;
    }
    sim_leave();
    return rc;
}

/* ---- NUMA and affinity -------------------------------------------------- */

#define BITS_PER_WORD (8 * sizeof(unsigned long))

static nvmlReturn_t fill_affinity(nvmlDevice_t device, unsigned size, unsigned long *set, nvmlAffinityScope_t scope,
                                  bool cpus)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = sim_enter_device(device, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (set == NULL || size == 0 || (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET)) {
        sim_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    /* One socket per NUMA node; node n owns CPUs [n*32, n*32+32). */
    unsigned node = ctx->spec->gpus[i].numa_node;
    memset(set, 0, (size_t)size * sizeof(*set));
    unsigned first = cpus ? node * SIM_CPUS_PER_NUMA_NODE : node;
    unsigned count = cpus ? SIM_CPUS_PER_NUMA_NODE : 1;
    for (unsigned b = first; b < first + count; b++) {
        if (b / BITS_PER_WORD < size)
            set[b / BITS_PER_WORD] |= 1ul << (b % BITS_PER_WORD);
    }
    sim_leave();
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet)
{
    return fill_affinity(device, cpuSetSize, cpuSet, NVML_AFFINITY_SCOPE_NODE, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                            unsigned long *cpuSet, nvmlAffinityScope_t scope)
{
    return fill_affinity(device, cpuSetSize, cpuSet, scope, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                    unsigned long *nodeSet, nvmlAffinityScope_t scope)
{
    return fill_affinity(device, nodeSetSize, nodeSet, scope, false);
}

/* ---- topology ----------------------------------------------------------- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                            nvmlGpuTopologyLevel_t *pathInfo)
{
    const struct sim_ctx *ctx;
    unsigned a;
    nvmlReturn_t rc = sim_enter_device(device1, &ctx, &a);
    if (rc != NVML_SUCCESS)
        return rc;
    int b = sim_handle_index(ctx, device2);
    if (b < 0 || pathInfo == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (sim_gpu_lost(ctx, (unsigned)b))
        rc = NVML_ERROR_GPU_IS_LOST;
    else
        *pathInfo = (nvmlGpuTopologyLevel_t)ctx->spec->topology[a][b];
    sim_leave();
    return rc;
}
