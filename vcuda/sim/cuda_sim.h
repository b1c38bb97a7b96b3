/*
 * Internals shared by the simulated libcuda.so.1 sources.
 *
 * Compiled with __CUDA_API_VERSION_INTERNAL, so cuda.h declares every exported
 * name under its own name (cuMemAlloc is the CUDA 2.0 ABI, cuMemAlloc_v2 the
 * current one, cuMemcpyHtoD_v2_ptds the per-thread variant, ...).
 * tools/gen_cuda_api.py emits a CUDA_ERROR_NOT_SUPPORTED stub for every
 * cuda.h function that no source defines with SIM_EXPORT.
 *
 * Node: the spec (GPUSIM_SPEC) and the shared state file (GPUSIM_STATE), as
 * for the simulated NVML; device memory in use is recorded per process in the
 * state file's PROCS table (flag GPUSIM_PROC_CUDA), so NVML reports it.
 */
#ifndef GPUSIM_CUDA_SIM_H
#define GPUSIM_CUDA_SIM_H

#include <cuda.h>

#include <stdbool.h>
#include <stdint.h>

#include "sim_spec.h"
#include "sim_state.h"

#define SIM_EXPORT __attribute__((visibility("default")))

#define SIM_MIB (1024ull * 1024ull)
#define SIM_VMM_GRANULARITY (2ull * SIM_MIB)
#define SIM_ALLOC_ALIGN 512ull  /* cuMemAlloc alignment and pitch alignment */

#define SIM_LIMITS CU_LIMIT_MAX
#define SIM_DEFAULT_STACK 1024u         /* CU_LIMIT_STACK_SIZE: bytes per thread */
#define SIM_STREAM_BYTES (544u << 10)   /* device memory a created stream takes (an H200, driver 580: 500 took 272 MiB) */
#define SIM_DEFAULT_HEAP (8ull << 20)   /* CU_LIMIT_MALLOC_HEAP_SIZE */
#define SIM_DEFAULT_FIFO (1ull << 20)   /* CU_LIMIT_PRINTF_FIFO_SIZE */

struct CUctx_st {
    uint32_t magic;   /* SIM_CTX_MAGIC while alive */
    int device;
    bool primary;
    unsigned flags;
    size_t limits[SIM_LIMITS];  /* cuCtxSetLimit values (when limit_set) */
    bool limit_set[SIM_LIMITS];
    uint64_t extra_bytes;       /* device memory the limits take beyond the context's size */
    CUgreenCtx green;           /* the green context this is the CUcontext of (cuCtxFromGreenCtx), else NULL */
};
#define SIM_CTX_MAGIC 0x43545853u

struct sim_node {
    struct sim_spec *spec;
    struct sim_state *state;
};

/* The node once cuInit succeeded; NULL before (callers return CUDA_ERROR_NOT_INITIALIZED). */
const struct sim_node *sim_cu_node(void);

/* The CUDA version the driver reports (spec's cuda_driver_version, or CUDA_VERSION without a spec). */
int sim_cu_driver_version(void);

/* Checks cuInit and the device ordinal. */
CUresult sim_cu_device(CUdevice dev, const struct sim_node **node);

/* The calling thread's current context (NULL if none). */
CUcontext sim_cu_current(void);

/* Current context's device, or an error (NOT_INITIALIZED, INVALID_CONTEXT). */
CUresult sim_cu_current_device(int *device);

/* Valid context handle? */
bool sim_cu_ctx_valid(CUcontext ctx);

/*
 * Device memory accounting in the state file, for this process on GPU gpu.
 * sim_mem_charge returns CUDA_ERROR_OUT_OF_MEMORY when the GPU's total would
 * be exceeded (dead processes' entries are reaped first).
 */
CUresult sim_mem_charge(unsigned gpu, uint64_t bytes);
void sim_mem_uncharge(unsigned gpu, uint64_t bytes);
/* Total and free bytes of the GPU (free = total - every process's usage). */
void sim_mem_info(unsigned gpu, uint64_t *free_bytes, uint64_t *total_bytes);

/* A fresh fake device address range of size bytes on gpu (never reused in this process). */
uint64_t sim_va_alloc(unsigned gpu, uint64_t size, uint64_t align);

/* Calls fn for every live context of this process (created ones and active primary ones). */
void sim_ctx_each(void (*fn)(CUcontext ctx, void *arg), void *arg);
/* A context came alive: libraries loaded eagerly (CUDA_MODULE_LOADING=EAGER) go into it. */
CUresult sim_libraries_context_created(CUcontext ctx);
/* A launch's local frame: ctx's stack grows to bytes per resident thread (charged); an error if it cannot. */
CUresult sim_ctx_stack_at_least(CUcontext ctx, size_t bytes);

/* Context memory (the GPU's context size): charged for each context while it lives. */
CUresult sim_ctx_memory_acquire(int device);
void sim_ctx_memory_release(int device);

/* ---- process-local records of simulated objects (cuda_mem.c) ---------------------------- */

enum sim_rec_kind {
    REC_DEV = 1,   /* cuMemAlloc*, pitch, managed, async: key = address */
    REC_LEGACY,    /* CUDA 2.0 ABI cuMemAlloc: key = 32-bit address */
    REC_HOST,      /* page-locked host memory: key = pointer */
    REC_ARRAY,     /* key = CUarray */
    REC_MIPMAP,    /* key = CUmipmappedArray */
    REC_VMM,       /* key = CUmemGenericAllocationHandle; gpu = UINT32_MAX for host memory */
    REC_VA,        /* reserved address range: key = start */
    REC_POOL,      /* key = CUmemoryPool */
    REC_STREAM,    /* key = CUstream */
    REC_MODULE,    /* key = CUmodule */
    REC_FUNCTION,  /* key = CUfunction, aux = module */
    REC_GRAPH,     /* key = CUgraph */
    REC_GNODE,     /* key = CUgraphNode, aux = graph, size = bytes of a memory allocation node */
    REC_GEXEC,     /* key = CUgraphExec */
    REC_LIBRARY,   /* key = CUlibrary */
    REC_KERNEL,    /* key = CUkernel, aux = library */
    REC_MAP,       /* key = start of a cuMemMap range, size, aux = the allocation handle */
    REC_GALLOC,    /* key = address of a graph memory allocation, aux = its struct sim_galloc */
    REC_IPC,       /* key = address of an opened IPC memory handle, size, aux = open count */
    REC_HOSTREG,   /* key = host address registered with cuMemHostRegister, size */
    REC_MODVAR,    /* key = address of a loaded module's variable, size, aux = the module */
    REC_EVENT,     /* key = CUevent (destroyed with its context) */
};

#define NO_GPU UINT32_MAX

struct vc_map;
struct vc_map_entry;
/* Records: (key, kind) -> entry.  sim_put/sim_find take the lock themselves. */
int sim_put(uint64_t key, enum sim_rec_kind kind, unsigned gpu, uint64_t size, uint64_t aux);
bool sim_find(uint64_t key, enum sim_rec_kind kind, struct vc_map_entry *out, bool take);
/* For vc_map_remove_if over sim_recs(): hold the lock around it. */
void sim_rec_lock(void);
void sim_rec_unlock(void);
struct vc_map *sim_recs(void);
/* Graph state of cuda_exec.c, forgotten in a forked child (called with the records lock held). */
void sim_exec_atfork_child(void);

/* A context is destroyed (or a primary context reset): the memory allocated in it is freed. */
void sim_ctx_gone(CUcontext ctx);
/* A green context is destroyed: the memory allocated in it is its primary context's from now on. */
void sim_ctx_reparent(CUcontext from, CUcontext to);

/* Stream, event or context synchronisation: memory pools above their release threshold give memory back. */
void sim_pools_synchronized(void);
/* The stream-ordered frees whose preceding work is done happen now (an event found complete). */
void sim_deferred_frees_due(void);
/* A pool allocation's record was taken: its bytes go back to its pool. */
void sim_pool_free_record(const struct vc_map_entry *e);

/* ---- graphs (cuda_exec.c) ---------------------------------------------------------------- */

/* A memory allocation node of graph (node may be NULL): the address is fixed now, memory at instantiation. */
CUresult sim_graph_alloc_node(CUgraphNode *node, CUgraph graph, unsigned gpu, uint64_t bytes, CUdeviceptr *dptr);
/* A free node of graph for a graph allocation dptr (node may be NULL). */
CUresult sim_graph_free_node(CUgraphNode *node, CUgraph graph, CUdeviceptr dptr);
/* A kernel node of ns nanoseconds, of function f (NULL: a graph's kernels) whose local frame is local bytes
 * (node may be NULL). */
CUresult sim_graph_kernel_node(CUgraphNode *node, CUgraph graph, uint64_t ns, CUfunction f, uint64_t local);
/* cuMemFree(Async) of an allocation a graph launch left live; false if dptr is not one. */
bool sim_graph_free(uint64_t dptr);

/* ---- streams (cuda_stream.c) ------------------------------------------------------------- */

/* The graph stream s is capturing into, or NULL (also for the special streams). */
CUgraph sim_stream_capture(CUstream s);

/* NULL, CU_STREAM_LEGACY or CU_STREAM_PER_THREAD: work goes to the current context. */
bool sim_special_stream(CUstream s);
/* The device work on stream s goes to: its own, or the current context's for the special streams. */
CUresult sim_stream_device(CUstream s, unsigned *gpu);
/* A new stream of ctx (its device's work goes there). */
CUresult sim_stream_create_in(CUstream *ph, CUcontext ctx);
/* Remembers that the stream's last kernel is upto (created streams only). */
void sim_stream_mark(CUstream s, uint64_t upto);

#endif
