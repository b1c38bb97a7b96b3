/*
 * The simulated node's static description (the GPUSIM_SPEC JSON file), loaded
 * and validated once per nvmlInit and read-only afterwards.  The format is
 * documented in vcuda/sim/README.md.
 */
#ifndef GPUSIM_SIM_SPEC_H
#define GPUSIM_SIM_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpusim_state_layout.h"

#define SIM_NVLINK_MAX_LINKS 18 /* NVML_NVLINK_MAX_LINKS */
#define SIM_CPUS_PER_NUMA_NODE 32 /* synthetic CPU numbering for the affinity calls */
#define SIM_MAX_NUMA_NODE 1023
#define SIM_NVLINK_PEER_SWITCH (-1)
#define SIM_NVLINK_PEER_NONE (-2)

struct sim_gpu_spec {
    char uuid[48];             /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    char name[96];
    char serial[32];           /* invented from the index */
    char pci_bus_id[32];       /* normalised "%08X:%02X:%02X.%X" */
    char pci_bus_id_legacy[16];/* "%04X:%02X:%02X.%X" */
    unsigned minor;
    uint64_t memory_mib;
    unsigned pci_domain, pci_bus, pci_device, pci_function;
    unsigned numa_node;
    unsigned sm_count;
    unsigned sm_threads_per_us; /* optional "sm_threads_per_us" (default 1024): the kernel cost model's rate */
    unsigned context_mib;      /* optional "context_mib": device memory of one CUDA context (default: the model's) */
    bool context_mib_set;
    bool multi_gpu_board;
    /* From the model table (by name); 0 when the model is unknown. */
    unsigned pci_device_id;    /* (device << 16) | 0x10DE */
    int cc_major, cc_minor;
    /* NVLink, derived from the spec's "nvlink" list (see README). */
    int link_peer[SIM_NVLINK_MAX_LINKS]; /* GPU index, SIM_NVLINK_PEER_SWITCH or SIM_NVLINK_PEER_NONE */
    bool has_nvlink;
    unsigned switch_domain;    /* NVSwitch domain number when a link goes to a switch */
};

/* Context memory of a model the table does not know (MiB). */
#define SIM_DEFAULT_CONTEXT_MIB 300u

struct sim_nvlink {
    unsigned a, b, links;
};

struct sim_spec {
    char path[4096];
    char driver_version[80];
    char proc_version_path[4096]; /* optional "proc_version_path": where /proc/driver/nvidia/version is served */
    int cuda_driver_version;
    unsigned gpu_count;
    struct sim_gpu_spec gpus[GPUSIM_MAX_GPUS];
    unsigned topology[GPUSIM_MAX_GPUS][GPUSIM_MAX_GPUS]; /* nvmlGpuTopologyLevel_t values */
    unsigned nvlink_count;
    struct sim_nvlink nvlink[GPUSIM_MAX_GPUS * (GPUSIM_MAX_GPUS - 1) / 2];
};

/*
 * Reads and validates the spec at path.  Returns a heap-allocated spec (free
 * with sim_spec_free) or NULL with err = "<path>: <field>: <problem>".
 */
struct sim_spec *sim_spec_load(const char *path, char *err, size_t errlen);

void sim_spec_free(struct sim_spec *spec);

/* Writes /proc/driver/nvidia/version's text where GPUSIM_PROC_VERSION (or the spec) says, if anywhere. */
void sim_serve_proc_version(const struct sim_spec *spec);

/* Number of NVLink links between GPUs a and b in the spec (0 if none). */
unsigned sim_spec_nvlink_links(const struct sim_spec *spec, unsigned a, unsigned b);

#endif
