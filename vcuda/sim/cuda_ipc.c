/*
 * Simulated libcuda: IPC memory handles (cuIpcGetMemHandle / cuIpcOpenMemHandle /
 * cuIpcCloseMemHandle) between processes of the node.  The handle carries the
 * exporting process (PID and start time), the allocation's address and size;
 * the importer gets an address of its own.  The memory stays the exporter's:
 * charged to it in the state file (NVML's per-process usage), never to the
 * importer, and closing a handle frees nothing.
 */
#include "cuda_sim.h"

#include <string.h>
#include <unistd.h>

#include "vc_map.h"
#include "vc_proc.h"

#define IPC_MAGIC 0x43504953u /* "SIPC" */

struct sim_ipc_handle {
    uint32_t magic;
    uint32_t pid;   /* the exporter */
    uint64_t start; /* its start time: a reused PID is not the exporter */
    uint64_t va;    /* the allocation in the exporter */
    uint64_t size;
    uint32_t gpu;
    uint32_t reserved;
};
_Static_assert(sizeof(struct sim_ipc_handle) <= CU_IPC_HANDLE_SIZE, "fits a CUipcMemHandle");

SIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    struct vc_map_entry e;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (pHandle == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    /* cuMemAlloc'd memory only (pool memory is shared with cuMemPoolExportPointer). */
    if (!sim_find(dptr, REC_DEV, &e, false) || e.aux != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ipc_handle h = {.magic = IPC_MAGIC, .pid = (uint32_t)getpid(),
                               .start = vc_proc_start_time((int)getpid()), .va = dptr, .size = e.size, .gpu = e.gpu};
    memset(pHandle, 0, sizeof(*pHandle));
    memcpy(pHandle->reserved, &h, sizeof(h));
    return CUDA_SUCCESS;
}

struct opened {
    uint32_t pid;
    uint64_t va;
};

static bool same_export(const struct vc_map_entry *e, void *arg)
{
    const struct opened *o = arg;
    return e->gpu == o->pid && e->aux2 == o->va;
}

/* REC_IPC: key = the importer's address, size, gpu = exporter PID, aux = open count, aux2 = exporter's address. */
static CUresult ipc_open(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pdptr == NULL || (Flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ipc_handle h;
    memcpy(&h, handle.reserved, sizeof(h));
    if (h.magic != IPC_MAGIC || h.size == 0 || h.gpu >= sim_cu_node()->spec->gpu_count)
        return CUDA_ERROR_INVALID_VALUE;
    if (h.pid == (uint32_t)getpid())
        return CUDA_ERROR_INVALID_CONTEXT; /* a process cannot open its own handle */
    if (!vc_proc_alive((int)h.pid, h.start))
        return CUDA_ERROR_INVALID_HANDLE; /* the exporter (and its memory) is gone */
    struct opened key = {h.pid, h.va};
    struct vc_map_entry e;
    sim_rec_lock();
    if (vc_map_find_if(sim_recs(), REC_IPC, same_export, &key, &e)) {
        /* Opened already: the same address, one more reference. */
        vc_map_lookup(sim_recs(), e.key, REC_IPC)->aux++;
        sim_rec_unlock();
        *pdptr = e.key;
        return CUDA_SUCCESS;
    }
    uint64_t va = sim_va_alloc((unsigned)dev, h.size, SIM_ALLOC_ALIGN);
    e = (struct vc_map_entry){.key = va, .kind = REC_IPC, .gpu = h.pid, .size = h.size, .aux = 1, .aux2 = h.va};
    rc = va == 0 || vc_map_put(sim_recs(), &e) != 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    sim_rec_unlock();
    if (rc == CUDA_SUCCESS)
        *pdptr = va;
    return rc;
}

SIM_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    return ipc_open(pdptr, handle, Flags);
}

SIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    return ipc_open(pdptr, handle, Flags);
}

SIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    sim_rec_lock();
    struct vc_map_entry *e = vc_map_lookup(sim_recs(), dptr, REC_IPC);
    if (e != NULL && --e->aux == 0)
        vc_map_find(sim_recs(), dptr, REC_IPC, NULL, true);
    sim_rec_unlock();
    return e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
