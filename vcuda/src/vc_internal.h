/*
 * Internals of libcuda-control.so, the CUDA driver / NVML interceptor.
 *
 * Compiled with __CUDA_API_VERSION_INTERNAL (cuda.h declares every exported
 * name as itself: cuMemAlloc is the CUDA 2.0 ABI, cuMemAlloc_v2 the current
 * one) and NVML_NO_UNVERSIONED_FUNC_DEFS (nvmlInit and nvmlInit_v2 side by
 * side).  Every cuda.h / nvml.h function is exported: the ones defined in
 * src/ with VC_EXPORT are hooks; tools/gen_cuda_api.py generates a
 * forwarding entry point for all the others (build/vc_forward.c).
 */
#ifndef VCUDA_VC_INTERNAL_H
#define VCUDA_VC_INTERNAL_H

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#endif
#include <cuda.h>
#include <nvml.h>

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "vc_api_gen.h"

#define VC_EXPORT __attribute__((visibility("default")))
#define VC_LIKELY(x) __builtin_expect(!!(x), 1)
#define VC_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- real libraries (vc_loader.c) ----------------------------------------- */

/* Resolved real functions; NULL until first use.  Indexed by enum vc_cu_index / vc_nvml_index. */
extern _Atomic(void *) vc_cu_table[VC_CU_COUNT];
extern _Atomic(void *) vc_nvml_table[VC_NVML_COUNT];
extern const char *const vc_cu_names[VC_CU_COUNT];
extern const char *const vc_nvml_names[VC_NVML_COUNT];

enum { VC_RET_NVML, VC_RET_PTR };
extern const unsigned char vc_nvml_ret_kind[VC_NVML_COUNT];

/* Opens the real library on first use and resolves one function (never NULL: a stub if missing). */
void *vc_resolve_cu(unsigned index);
void *vc_resolve_nvml(unsigned index);

static inline void *vc_real_cu(unsigned index)
{
    void *p = atomic_load_explicit(&vc_cu_table[index], memory_order_acquire);
    return VC_LIKELY(p != NULL) ? p : vc_resolve_cu(index);
}

static inline void *vc_real_nvml(unsigned index)
{
    void *p = atomic_load_explicit(&vc_nvml_table[index], memory_order_acquire);
    return VC_LIKELY(p != NULL) ? p : vc_resolve_nvml(index);
}

/* The real function name, with its own prototype: REAL_CU(cuMemAlloc_v2)(dptr, size). */
#define REAL_CU(name) ((__typeof__(&name))vc_real_cu(VC_CU_##name))
#define REAL_NVML(name) ((__typeof__(&name))vc_real_nvml(VC_NVML_##name))

/* Hooked functions and their cuGetProcAddress keys (generated). */
struct vc_hook {
    unsigned index; /* VC_CU_* of the hooked name */
    void *wrapper;  /* our exported function */
};
struct vc_proc_key {
    const char *base;
    int version;
    int per_thread;
    unsigned index; /* VC_CU_* of the symbol that answers */
};
extern const struct vc_hook vc_cu_hooks[];
extern const unsigned vc_cu_hooks_len;
extern const struct vc_proc_key vc_cu_hook_keys[];
extern const unsigned vc_cu_hook_keys_len;

/* The wrapper that replaces real function pointer p, or p itself (cuGetProcAddress answers). */
void *vc_swap_proc(void *p);

/* ---- NVML's view (vc_nvml.c) ---------------------------------------------------- */

#define VC_MAX_PROCS 1024
struct vc_proc_mem {
    int pid;       /* as NVML reports it: the host PID */
    uint64_t used; /* device memory NVML accounts to the process on one GPU */
};
/* Initialises the real NVML once; false when it cannot be used. */
bool vc_nvml_ready(void);
/* The NVML handle of CUDA device cuda_dev (by UUID). */
bool vc_nvml_device(int cuda_dev, nvmlDevice_t *out);
/* The processes NVML lists on dev with their memory; -1 on error. */
int vc_nvml_processes(nvmlDevice_t dev, struct vc_proc_mem *out, int max);
/* Device memory NVML accounts to the given host PIDs (sorted), all GPUs together; *ok false when NVML cannot tell. */
uint64_t vc_nvml_used_by(const int *pids, unsigned npids, bool *ok);
/* This process's PID in NVML's lists (its host PID), 0 until a context creation revealed it. */
int vc_host_pid(void);
void vc_set_host_pid(int pid);
void vc_nvml_atfork_child(void);

/* ---- logging (vc_config.c) ------------------------------------------------- */

enum { VC_LOG_ERROR = 2, VC_LOG_WARN = 3, VC_LOG_INFO = 4, VC_LOG_DEBUG = 5, VC_LOG_TRACE = 8 };
extern _Atomic int vc_log_level;
void vc_log_write(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define vc_log(level, ...)                                                                                         \
    do {                                                                                                           \
        if (VC_UNLIKELY((level) <= atomic_load_explicit(&vc_log_level, memory_order_relaxed)))                     \
            vc_log_write((level), __VA_ARGS__);                                                                    \
    } while (0)

/* ---- configuration (vc_config.c) ------------------------------------------- */

/* vcuda.config as gpu-manager writes it: struct resource_data_t, 8240 bytes (gpu-manager.md 4.2). */
struct vc_version {
    int major;
    int minor;
} __attribute__((packed, aligned(8)));

struct vc_resource_data {
    char pod_uid[48];
    int limit;
    char occupied[4044];
    char container_name[4096];
    char bus_id[16];
    uint64_t gpu_memory;
    int utilization;
    int hard_limit;
    struct vc_version driver_version;
    int enable;
} __attribute__((packed, aligned(8)));

_Static_assert(sizeof(struct vc_resource_data) == 8240, "resource_data_t is 8240 bytes");
_Static_assert(offsetof(struct vc_resource_data, limit) == 48, "limit");
_Static_assert(offsetof(struct vc_resource_data, occupied) == 52, "occupied");
_Static_assert(offsetof(struct vc_resource_data, container_name) == 4096, "container_name");
_Static_assert(offsetof(struct vc_resource_data, bus_id) == 8192, "bus_id");
_Static_assert(offsetof(struct vc_resource_data, gpu_memory) == 8208, "gpu_memory");
_Static_assert(offsetof(struct vc_resource_data, utilization) == 8216, "utilization");
_Static_assert(offsetof(struct vc_resource_data, hard_limit) == 8220, "hard_limit");
_Static_assert(offsetof(struct vc_resource_data, driver_version) == 8224, "driver_version");
_Static_assert(offsetof(struct vc_resource_data, enable) == 8232, "enable");

/*
 * Whether the memory cap is on: set once by the library constructor from the
 * config, read on every hooked call (the single pass-through branch).
 */
extern _Atomic bool vc_limit_on;
static inline bool vc_limited(void)
{
    return atomic_load_explicit(&vc_limit_on, memory_order_relaxed);
}

/*
 * Whether the SM (core) limit is on: set once by the constructor, read on
 * every hooked launch (the single pass-through branch).
 */
extern _Atomic bool vc_core_on;
static inline bool vc_core_limited(void)
{
    return atomic_load_explicit(&vc_core_on, memory_order_relaxed);
}

/*
 * Whether CUDA is refused: the container's vcuda.config exists but cannot be used (fail closed; cuInit fails).
 * Set once by the constructor.
 */
extern _Atomic bool vc_cuda_refused;
static inline bool vc_refused(void)
{
    return atomic_load_explicit(&vc_cuda_refused, memory_order_relaxed);
}

/* cuda.h: a destroyed context (or a reset primary one) frees what was allocated in it: its charges return. */
void vc_memory_context_gone(CUcontext ctx);
/*
 * Around the driver's destroy of a context (it frees the context's events): from vc_memory_context_dying to
 * vc_memory_context_destroyed the events of the frees queued in it are not asked for; once it is gone, the frees are
 * forgotten, and vc_memory_context_destroyed returns their bytes, which vc_memory_ordered_frees_handover gives to the
 * reconciliation once the context's own charge is released.
 */
void vc_memory_context_dying(CUcontext ctx);
uint64_t vc_memory_context_destroyed(CUcontext ctx, bool gone);
void vc_memory_ordered_frees_handover(uint64_t bytes);
/* A green context is gone: the memory allocated in it (it shares its primary context's) is primary's from now on. */
void vc_memory_context_moved(CUcontext from, CUcontext to);

/*
 * A context is being created (memory limit on): holds the libraries as they are until vc_memory_context_end.
 * *vars: the live libraries' variables, which the new context is charged too (a library may go into it lazily,
 * where no hook sees it).  Returns what the driver loads into it inside the call with CUDA_MODULE_LOADING=EAGER
 * (the libraries' whole footprints: part of its measured size, not of the context's own), else 0.
 */
uint64_t vc_memory_context_begin(uint64_t *vars);
/* ctx: the context now lives (its libraries' charge is given back when it goes); NULL: none was created. */
void vc_memory_context_end(CUcontext ctx);

/* After a launch of exec (memory limit on): its graph allocations without a free node stay live. */
void vc_memory_graph_launched(CUgraphExec exec);

/* The CUDA device work on stream s goes to (its context's; the current one for the special streams; 0 if unknown). */
int vc_stream_device(CUstream s);
/* The device a context that is not current belongs to (pushed and popped); -1 if the driver cannot tell. */
int vc_ctx_device(CUcontext ctx);

/* Settles every memory pool's charge on what it reserves now; true if that returned bytes. */
bool vc_memory_refresh_pools(void);

/* A stream or context was destroyed: the SM gate's stream-to-device lookups must be redone. */
void vc_core_streams_changed(void);

/*
 * Around the driver's destroy of a context (its streams and events go with it): from vc_core_context_dying to
 * vc_core_context_destroyed the SM gate neither asks for nor destroys its completion markers there; once it is gone
 * (the driver's answer), they are forgotten.  No lock is held in between.  NULL: a context whose handle is unknown.
 * sure: the call destroys it whatever happens (not a release that may leave it alive): its launches count as
 * complete from now.
 */
void vc_core_context_dying(CUcontext ctx, bool sure);
void vc_core_context_destroyed(CUcontext ctx, bool gone);

struct vc_core_config {
    int share;     /* percent of the GPU: vcuda.config `utilization` (tencent.com/vcuda-core) */
    int ceiling;   /* soft limit: `limit` (tencent.com/vcuda-core-limit); = share when hard */
    bool soft;     /* hard_limit == 0 */
    bool upstream; /* VCUDA_CORE_ALGORITHM=upstream: gpu-manager's token bucket (baseline) */
};
const struct vc_core_config *vc_core_config(void);
/* pids.config next to the vcuda.config in use (host PIDs of the container, int32, sorted). */
const char *vc_pids_path(void);
/* Reads fd from offset 0 into buf until its end or `room` bytes; the bytes read (pids.config readers). */
size_t vc_read_from_start(int fd, void *buf, size_t room);

/* The container's limit in bytes (valid when vc_limited()). */
uint64_t vc_limit_bytes(void);
/* What a context is reserved at before its size is measured (VCUDA_CONTEXT_RESERVE, default 256 MiB). */
uint64_t vc_context_reserve(void);
/* The budget file's name inside its directory (derived from the config). */
const char *vc_budget_name(void);
/*
 * The budget file's directory: /dev/shm/vcuda, or VCUDA_BUDGET_DIR where the container's mount holds no config
 * (README.md "Configuration": in a container given limits the environment is the tenant's).
 */
const char *vc_budget_dir(void);
/* Whether the container's mount holds a config: then no variable that bears on the limits is taken. */
bool vc_env_locked(void);

/* The stack every context has from its start (CU_LIMIT_STACK_SIZE, bytes per thread). */
#define VC_DEFAULT_STACK 1024u

/*
 * Before a launch of f on stream s (ptsz: of a _ptsz entry point; memory cap on): the context's stack grown to f's
 * local frame, as the driver
 * would grow it at the launch; CUDA_ERROR_OUT_OF_MEMORY when that does not fit the container (the launch must not go).
 */
CUresult vc_memory_launch_frame(CUfunction f, CUstream s, bool ptsz);
/* Before a launch of a graph exec (memory cap on): its kernels' frame fits its stream's context's stack. */
CUresult vc_memory_graph_launch_frame(CUgraphExec exec, CUstream s, bool ptsz);

/* ---- the container's shared budget (vc_budget.c) ---------------------------- */

/*
 * Reserves bytes for this process; false when the container's limit would be exceeded.  Counts what
 * the hooks charged plus what the GPU holds for the container beyond that (reconciled with NVML's
 * per-process memory when the reservation comes near the cap, README.md "Whole footprint").
 */
bool vc_budget_reserve(uint64_t bytes);
/*
 * Memory the driver takes inside a call in amounts no hook can know exactly (a module or library loaded
 * into a context, a context limit).  The caller reserves an estimate before the call (vc_budget_reserve),
 * then, after it, hands `handover` bytes of it over to the reconciliation: they are dropped while NVML is
 * asked what the GPU now holds for the container, under the budget lock (the rest stays charged with the
 * handle).  Returns false when the container is now above its limit: the caller undoes the call, fails it
 * with CUDA_ERROR_OUT_OF_MEMORY and calls vc_budget_reconcile_now.  *kept: NVML could not tell, so the
 * handed-over bytes stay charged (to the process's end).
 */
bool vc_budget_settle_untracked(uint64_t handover, bool *kept);
void vc_budget_reconcile_now(void);
/* Charges bytes the driver already holds, whatever the limit (an undo that cannot be refused). */
void vc_budget_charge(uint64_t bytes);
/* Returns bytes reserved earlier by this process. */
void vc_budget_release(uint64_t bytes);
/* Bytes in use by the whole container, as the GPU holds them (processes that are gone are reaped first). */
uint64_t vc_budget_used(void);
/* Records this process's host PID in its slot (the container's processes are found in NVML by it). */
void vc_budget_set_host_pid(int pid);
/* The host PIDs of the container's processes that hold a slot (where known); up to max into out. */
unsigned vc_budget_host_pids(int *out, unsigned max);
/*
 * SM limit: this process takes a slot in the container's budget (its processes find each other there,
 * README.md "Which processes are the container"), whether or not a memory limit is on.
 */
void vc_budget_join(void);
/* The context size last measured on CUDA device dev in this container, else vc_context_reserve(). */
uint64_t vc_budget_context_estimate(int dev);
uint64_t vc_budget_context_learned(int dev); /* the size last measured on dev in this container; 0: none yet */
void vc_budget_learn_context(int dev, uint64_t bytes);
/* Bytes this process charged for contexts (its slot's context field). */
void vc_budget_note_context(int64_t delta);
/*
 * Bytes of this process's charge the GPU does not hold yet (its slot's unbacked field): a reconciliation does not
 * count them as held, so they cannot stand in for memory no hook charged (README.md "Whole footprint").
 */
void vc_budget_note_unbacked(int64_t delta);
/* The same for the variables of libraries never asked for, charged in every live context (a total, not a change). */
void vc_budget_set_unbacked_libs(uint64_t bytes);
/*
 * The SM limit's ledger of the container, per CUDA device, shared by its processes: until when (CLOCK_MONOTONIC
 * ns) the container pays off GPU time it used beyond its share, as measured up to NVML sample time seen_us.
 * Each process publishes its view (both kept at their maximum); a new process starts from it, so GPU time
 * used by processes that are gone is not forgotten.
 */
void vc_budget_core_publish(int dev, uint64_t debt_until_ns, uint64_t seen_us);
void vc_budget_core_ledger(int dev, uint64_t *debt_until_ns, uint64_t *seen_us, uint64_t *prov_until_ns);
/*
 * The container's provisional charges on dev, a sum over its processes, as the time (CLOCK_MONOTONIC ns) until
 * which they are paid off at the rate: delta_ns (charged: > 0, refunded: < 0) moves it, from now_ns if it was
 * paid off, never below now_ns.  A process that exits before NVML's samples cover its charges leaves them there.
 */
void vc_budget_core_provisional(int dev, uint64_t now_ns, int64_t delta_ns);
/*
 * How NVML samples CUDA device dev, as the container's processes learnt it: 0 not known, VC_SAMPLING_PER_PROCESS, else
 * per GPU with one process named per period of that many us.  A new process starts from it.
 */
#define VC_SAMPLING_PER_PROCESS 1u
void vc_budget_core_set_sampling(int dev, uint64_t sampling);
uint64_t vc_budget_core_sampling(int dev);
/* Adds add_ns to the container's debt on dev (from now_ns if it was paid off); returns the time it is paid off at
 * (0: no shared budget). */
uint64_t vc_budget_core_charge(int dev, uint64_t now_ns, uint64_t add_ns);
/* In a forked child: it owns no slot and no reservation of its parent. */
void vc_budget_atfork_child(void);
/* Whether a process of the container may run unseen by the others (it found no budget slot); now_ns: CLOCK_MONOTONIC. */
bool vc_budget_unseen(uint64_t now_ns);

#endif
