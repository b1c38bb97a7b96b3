/*
 * Simulated libcuda: initialisation, versions, errors, devices and attributes,
 * contexts, and cuGetProcAddress.
 */
#include "cuda_sim.h"

#include <ctype.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_procs.h"

/* ---- node (spec + state), loaded once ----------------------------------- */

static pthread_once_t g_load_once = PTHREAD_ONCE_INIT;
static struct sim_node g_node;          /* written once inside g_load_once */
static CUresult g_load_rc;              /* likewise */
static char g_load_err[1100];           /* likewise */
static struct sim_spec *g_version_spec; /* spec for the version only (no state), likewise */
static atomic_bool g_initialized;       /* cuInit succeeded */

static void load_node(void)
{
    const char *spec_path = getenv("GPUSIM_SPEC");
    const char *state_path = getenv("GPUSIM_STATE");
    char err[1024];
    if (spec_path == NULL || spec_path[0] == '\0') {
        snprintf(g_load_err, sizeof(g_load_err), "GPUSIM_SPEC is not set: it must name the node spec JSON file");
        g_load_rc = CUDA_ERROR_NO_DEVICE;
        return;
    }
    struct sim_spec *spec = sim_spec_load(spec_path, err, sizeof(err));
    if (spec == NULL) {
        snprintf(g_load_err, sizeof(g_load_err), "%s", err);
        g_load_rc = CUDA_ERROR_UNKNOWN;
        return;
    }
    g_version_spec = spec;
    sim_serve_proc_version(spec);
    if (state_path == NULL || state_path[0] == '\0') {
        snprintf(g_load_err, sizeof(g_load_err), "GPUSIM_STATE is not set: it must name the run-time state file");
        g_load_rc = CUDA_ERROR_UNKNOWN;
        return;
    }
    struct sim_state *state = sim_state_open(state_path, err, sizeof(err));
    if (state == NULL) {
        snprintf(g_load_err, sizeof(g_load_err), "%s", err);
        g_load_rc = CUDA_ERROR_UNKNOWN;
        return;
    }
    /* Processes that died since the last run no longer hold memory. */
    if (sim_state_lock(state) == 0) {
        sim_state_reap_dead(state);
        sim_state_unlock(state);
    }
    g_node.spec = spec;
    g_node.state = state;
    g_load_rc = CUDA_SUCCESS;
}

const struct sim_node *sim_cu_node(void)
{
    return atomic_load_explicit(&g_initialized, memory_order_acquire) ? &g_node : NULL;
}

int sim_cu_driver_version(void)
{
    pthread_once(&g_load_once, load_node);
    return g_version_spec != NULL ? g_version_spec->cuda_driver_version : CUDA_VERSION;
}

SIM_EXPORT CUresult cuInit(unsigned int Flags)
{
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_load_once, load_node);
    if (g_load_rc != CUDA_SUCCESS) {
        fprintf(stderr, "gpusim: cuInit: %s\n", g_load_err);
        return g_load_rc;
    }
    atomic_store_explicit(&g_initialized, true, memory_order_release);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDriverGetVersion(int *driverVersion)
{
    if (driverVersion == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = sim_cu_driver_version();
    return CUDA_SUCCESS;
}

/* ---- errors ------------------------------------------------------------- */

struct sim_error {
    CUresult code;
    const char *name;
    const char *text;
};

#define E(code, text) {code, #code, text}
static const struct sim_error k_errors[] = {
    E(CUDA_SUCCESS, "no error"),
    E(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    E(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    E(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    E(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
    E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    E(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current"),
    E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    E(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    E(CUDA_ERROR_NOT_READY, "device not ready"),
    E(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    E(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
    E(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "primary context active"),
    E(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
    E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    E(CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed"),
    E(CUDA_ERROR_FILE_NOT_FOUND, "file not found"),
    E(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"),
    E(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef E

static const struct sim_error *find_error(CUresult code)
{
    for (size_t i = 0; i < sizeof(k_errors) / sizeof(k_errors[0]); i++)
        if (k_errors[i].code == code)
            return &k_errors[i];
    return NULL;
}

SIM_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (pStr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_error *e = find_error(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (pStr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_error *e = find_error(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- devices ------------------------------------------------------------ */

CUresult sim_cu_device(CUdevice dev, const struct sim_node **node)
{
    const struct sim_node *n = sim_cu_node();
    if (n == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || (unsigned)dev >= n->spec->gpu_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *node = n;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetCount(int *count)
{
    if (count == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_node *n = sim_cu_node();
    if (n == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    *count = (int)n->spec->gpu_count;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    const struct sim_node *n;
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(ordinal, &n);
    if (rc == CUDA_SUCCESS)
        *device = ordinal;
    return rc;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    const struct sim_node *n;
    if (name == NULL || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc == CUDA_SUCCESS)
        snprintf(name, (size_t)len, "%s", n->spec->gpus[dev].name);
    return rc;
}

static CUresult device_uuid(CUuuid *uuid, CUdevice dev)
{
    const struct sim_node *n;
    if (uuid == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (validated by the spec loader) -> 16 bytes. */
    const char *p = n->spec->gpus[dev].uuid + 4;
    for (int i = 0; i < 16; i++) {
        while (*p == '-')
            p++;
        char hex[3] = {p[0], p[1], '\0'};
        uuid->bytes[i] = (char)strtoul(hex, NULL, 16);
        p += 2;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return device_uuid(uuid, dev);
}

SIM_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    return device_uuid(uuid, dev);
}

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    const struct sim_node *n;
    if (bytes == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc == CUDA_SUCCESS)
        *bytes = (size_t)(n->spec->gpus[dev].memory_mib * SIM_MIB);
    return rc;
}

/* CUDA 2.0 ABI: 32-bit size (saturated). */
SIM_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t b;
    if (bytes == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (rc == CUDA_SUCCESS)
        *bytes = b > UINT32_MAX ? UINT32_MAX : (unsigned)b;
    return rc;
}

SIM_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    const struct sim_node *n;
    if (pciBusId == NULL || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc == CUDA_SUCCESS) {
        const struct sim_gpu_spec *g = &n->spec->gpus[dev];
        snprintf(pciBusId, (size_t)len, "%04X:%02X:%02X.%X", g->pci_domain, g->pci_bus, g->pci_device,
                 g->pci_function);
    }
    return rc;
}

SIM_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId)
{
    const struct sim_node *n = sim_cu_node();
    if (dev == NULL || pciBusId == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (n == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    unsigned v[4] = {0, 0, 0, 0};
    int got = sscanf(pciBusId, "%x:%x:%x.%x", &v[0], &v[1], &v[2], &v[3]);
    if (got < 3) {
        v[3] = 0;
        if (sscanf(pciBusId, "%x:%x.%x", &v[1], &v[2], &v[3]) < 2)
            return CUDA_ERROR_INVALID_VALUE;
        v[0] = 0;
    }
    for (unsigned i = 0; i < n->spec->gpu_count; i++) {
        const struct sim_gpu_spec *g = &n->spec->gpus[i];
        if (g->pci_domain == v[0] && g->pci_bus == v[1] && g->pci_device == v[2] && g->pci_function == v[3]) {
            *dev = (CUdevice)i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

static void compute_capability(const struct sim_gpu_spec *g, int *major, int *minor)
{
    /* Unknown model names get Ampere's 8.0. */
    *major = g->cc_major > 0 ? g->cc_major : 8;
    *minor = g->cc_major > 0 ? g->cc_minor : 0;
}

SIM_EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    const struct sim_node *n;
    if (major == NULL || minor == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc == CUDA_SUCCESS)
        compute_capability(&n->spec->gpus[dev], major, minor);
    return rc;
}

SIM_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    const struct sim_node *n;
    if (pi == NULL || attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    const struct sim_gpu_spec *g = &n->spec->gpus[dev];
    int major, minor;
    compute_capability(g, &major, &minor);
    int v = 0;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = (int)g->sm_count; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = minor; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = major == 7 && minor == 5 ? 1024 : 2048; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: v = (int)SIM_ALLOC_ALIGN; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1410000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 1215000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 50 * 1024 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = (int)g->pci_bus; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = (int)g->pci_device; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = (int)g->pci_domain; break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD: v = g->multi_gpu_board; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: v = CU_COMPUTEMODE_DEFAULT; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED:
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: v = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; break;
    default: v = 0; break; /* a valid attribute the simulation does not model */
    }
    *pi = v;
    return CUDA_SUCCESS;
}

/* ---- contexts ----------------------------------------------------------- */

#define SIM_CTX_STACK 16

static _Thread_local CUcontext tl_stack[SIM_CTX_STACK];
static _Thread_local int tl_depth;

/* Primary contexts, under g_ctx_mu. */
static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static struct CUctx_st g_primary[GPUSIM_MAX_GPUS];
static unsigned g_primary_refs[GPUSIM_MAX_GPUS];
static unsigned g_primary_flags[GPUSIM_MAX_GPUS];

/*
 * Device memory one context takes: the spec's context_mib for the GPU (default: its model's, see
 * sim_spec.c), or GPUSIM_CONTEXT_MIB when set (a knob for tests; 0 turns it off).  Every context
 * takes it, the primary one while it is retained, a created one until it is destroyed.
 */
static uint64_t context_bytes(int device)
{
    const char *s = getenv("GPUSIM_CONTEXT_MIB");
    if (s != NULL && s[0] != '\0')
        return strtoull(s, NULL, 10) * SIM_MIB;
    return (uint64_t)sim_cu_node()->spec->gpus[device].context_mib * SIM_MIB;
}

CUresult sim_ctx_memory_acquire(int device)
{
    uint64_t b = context_bytes(device);
    return b > 0 ? sim_mem_charge((unsigned)device, b) : CUDA_SUCCESS;
}

void sim_ctx_memory_release(int device)
{
    uint64_t b = context_bytes(device);
    if (b > 0)
        sim_mem_uncharge((unsigned)device, b);
}

bool sim_cu_ctx_valid(CUcontext ctx)
{
    return ctx != NULL && ctx->magic == SIM_CTX_MAGIC;
}

CUcontext sim_cu_current(void)
{
    return tl_depth > 0 ? tl_stack[tl_depth - 1] : NULL;
}

CUresult sim_cu_current_device(int *device)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = sim_cu_current();
    if (!sim_cu_ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->device;
    return CUDA_SUCCESS;
}

static CUresult ctx_destroy(CUcontext ctx);

/* Created contexts alive in this process, under g_ctx_mu (sim_ctx_each). */
#define SIM_MAX_CREATED 1024
static CUcontext g_created[SIM_MAX_CREATED];
static unsigned g_ncreated;

static void created_forget(CUcontext c)
{
    pthread_mutex_lock(&g_ctx_mu);
    for (unsigned i = 0; i < g_ncreated; i++) {
        if (g_created[i] == c) {
            g_created[i] = g_created[--g_ncreated];
            break;
        }
    }
    pthread_mutex_unlock(&g_ctx_mu);
}

static void created_atfork_child(void)
{
    g_ncreated = 0; /* a forked child has none of its parent's contexts */
}

__attribute__((constructor)) static void created_init(void)
{
    pthread_atfork(NULL, NULL, created_atfork_child);
}

void sim_ctx_each(void (*fn)(CUcontext ctx, void *arg), void *arg)
{
    static CUcontext all[SIM_MAX_CREATED + GPUSIM_MAX_GPUS];
    static pthread_mutex_t each_mu = PTHREAD_MUTEX_INITIALIZER; /* one walk at a time (all[] is static) */
    pthread_mutex_lock(&each_mu);
    unsigned n = 0;
    pthread_mutex_lock(&g_ctx_mu);
    for (unsigned i = 0; i < GPUSIM_MAX_GPUS; i++)
        if (g_primary_refs[i] > 0)
            all[n++] = &g_primary[i];
    for (unsigned i = 0; i < g_ncreated; i++)
        all[n++] = g_created[i];
    pthread_mutex_unlock(&g_ctx_mu);
    for (unsigned i = 0; i < n; i++)
        fn(all[i], arg);
    pthread_mutex_unlock(&each_mu);
}

static CUresult ctx_create(CUcontext *pctx, unsigned flags, CUdevice dev)
{
    const struct sim_node *n;
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (tl_depth >= SIM_CTX_STACK)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    rc = sim_ctx_memory_acquire(dev);
    if (rc != CUDA_SUCCESS) {
        free(c);
        return rc;
    }
    *c = (struct CUctx_st){.magic = SIM_CTX_MAGIC, .device = dev, .primary = false, .flags = flags};
    pthread_mutex_lock(&g_ctx_mu);
    bool room = g_ncreated < SIM_MAX_CREATED;
    if (room)
        g_created[g_ncreated++] = c;
    pthread_mutex_unlock(&g_ctx_mu);
    if (!room) {
        sim_ctx_memory_release(dev);
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tl_stack[tl_depth++] = c;
    rc = sim_libraries_context_created(c);
    if (rc != CUDA_SUCCESS) {
        ctx_destroy(c);
        return rc;
    }
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                   unsigned int flags, CUdevice dev)
{
    (void)paramsArray;
    if (numParams < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                   CUdevice dev)
{
    (void)ctxCreateParams;
    return ctx_create(pctx, flags, dev);
}

static CUresult ctx_destroy(CUcontext ctx)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_cu_ctx_valid(ctx) || ctx->primary || ctx->green != NULL)
        return CUDA_ERROR_INVALID_CONTEXT; /* a green context's goes with cuGreenCtxDestroy */
    /* Remove it from this thread's stack (other threads' stacks are their business, as in CUDA). */
    for (int i = tl_depth - 1; i >= 0; i--) {
        if (tl_stack[i] == ctx) {
            memmove(&tl_stack[i], &tl_stack[i + 1], (size_t)(tl_depth - i - 1) * sizeof(tl_stack[0]));
            tl_depth--;
        }
    }
    int dev = ctx->device;
    created_forget(ctx);
    sim_ctx_gone(ctx);
    if (ctx->extra_bytes > 0)
        sim_mem_uncharge((unsigned)dev, ctx->extra_bytes);
    ctx->magic = 0;
    free(ctx);
    sim_ctx_memory_release(dev);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    return ctx_destroy(ctx);
}

SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    return ctx_destroy(ctx);
}

static CUresult primary_release(CUdevice dev, bool reset);

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    const struct sim_node *n;
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_ctx_mu);
    if (g_primary_refs[dev] == 0) {
        rc = sim_ctx_memory_acquire(dev);
        if (rc == CUDA_SUCCESS)
            g_primary[dev] = (struct CUctx_st){
                .magic = SIM_CTX_MAGIC, .device = dev, .primary = true, .flags = g_primary_flags[dev]};
    }
    bool fresh = rc == CUDA_SUCCESS && g_primary_refs[dev] == 0;
    if (rc == CUDA_SUCCESS) {
        g_primary_refs[dev]++;
        *pctx = &g_primary[dev];
    }
    pthread_mutex_unlock(&g_ctx_mu);
    if (fresh && (rc = sim_libraries_context_created(&g_primary[dev])) != CUDA_SUCCESS)
        primary_release(dev, false);
    return rc;
}

static CUresult primary_release(CUdevice dev, bool reset)
{
    const struct sim_node *n;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    bool gone = false;
    pthread_mutex_lock(&g_ctx_mu);
    if (g_primary_refs[dev] == 0) {
        rc = reset ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    } else {
        g_primary_refs[dev] = reset ? 0 : g_primary_refs[dev] - 1;
        if (g_primary_refs[dev] == 0) {
            sim_ctx_memory_release(dev);
            if (g_primary[dev].extra_bytes > 0)
                sim_mem_uncharge((unsigned)dev, g_primary[dev].extra_bytes);
            g_primary[dev].extra_bytes = 0;
            memset(g_primary[dev].limit_set, 0, sizeof(g_primary[dev].limit_set));
            gone = true; /* the handle stays valid (as in CUDA); the memory allocated in it is freed */
        }
    }
    pthread_mutex_unlock(&g_ctx_mu);
    if (gone)
        sim_ctx_gone(&g_primary[dev]);
    return rc;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return primary_release(dev, false);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return primary_release(dev, false);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return primary_release(dev, true);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return primary_release(dev, true);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    const struct sim_node *n;
    if (flags == NULL || active == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_ctx_mu);
    *flags = g_primary_flags[dev];
    *active = g_primary_refs[dev] > 0;
    pthread_mutex_unlock(&g_ctx_mu);
    return CUDA_SUCCESS;
}

static CUresult primary_set_flags(CUdevice dev, unsigned int flags)
{
    const struct sim_node *n;
    CUresult rc = sim_cu_device(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_ctx_mu);
    g_primary_flags[dev] = flags;
    pthread_mutex_unlock(&g_ctx_mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    return primary_set_flags(dev, flags);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    return primary_set_flags(dev, flags);
}

/* ---- green contexts (CUDA 12.4): SM partitions, each with a context of its own ---------------------------- */

/*
 * A green context is created from a descriptor of SM resources (cuDeviceGetDevResource, cuDevSmResourceSplitByCount,
 * cuDevResourceGenerateDesc).  As cuda.h says, it retains the device's primary context (released when it is
 * destroyed), and, as any context, takes device memory of its own while it lives (context_bytes).  Its CUcontext
 * (cuCtxFromGreenCtx) is a context like the others: streams (cuGreenCtxStreamCreate), modules, allocations and
 * launches go there; it shares the primary context's memory, so what was allocated in it outlives it (freed with
 * the primary context), while its modules and streams go with it.  Supported from driver CUDA 12.4 on GPUs of
 * compute capability 6.0 and newer (cuda.h's partition rules); GPUSIM_GREEN_CONTEXTS=0 makes the GPUs refuse them
 * with CUDA_ERROR_NOT_SUPPORTED, as a driver does on a GPU without SM partitioning.
 */
#define SIM_GREEN_MAGIC 0x4e455247u /* "GREN" */
#define SIM_DESC_MAGIC 0x43534544u  /* "DESC" */
#define SIM_RES_MAGIC 0x53455253u   /* "SRES": in a CUdevResource's internal padding, with the device */

struct CUgreenCtx_st {
    uint32_t magic;
    int device;
    unsigned sm_count;
    struct CUctx_st ctx;
};

struct CUdevResourceDesc_st {
    uint32_t magic;
    int device;
    unsigned sm_count;
};

static CUresult green_supported(CUdevice dev, const struct sim_node **node)
{
    CUresult rc = sim_cu_device(dev, node);
    if (rc != CUDA_SUCCESS)
        return rc;
    int major, minor;
    compute_capability(&(*node)->spec->gpus[dev], &major, &minor);
    const char *knob = getenv("GPUSIM_GREEN_CONTEXTS");
    if (knob != NULL && strcmp(knob, "0") == 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    return sim_cu_driver_version() >= 12040 && major >= 6 ? CUDA_SUCCESS : CUDA_ERROR_NOT_SUPPORTED;
}

static void resource_sm(CUdevResource *r, int device, unsigned sms)
{
    memset(r, 0, sizeof(*r));
    r->type = CU_DEV_RESOURCE_TYPE_SM;
    r->sm.smCount = sms;
    uint32_t tag[2] = {SIM_RES_MAGIC, (uint32_t)device};
    memcpy(r->_internal_padding, tag, sizeof(tag));
}

static bool resource_device(const CUdevResource *r, int *device)
{
    uint32_t tag[2];
    memcpy(tag, r->_internal_padding, sizeof(tag));
    *device = (int)tag[1];
    return r->type == CU_DEV_RESOURCE_TYPE_SM && tag[0] == SIM_RES_MAGIC;
}

SIM_EXPORT CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource *resource, CUdevResourceType type)
{
    const struct sim_node *n;
    CUresult rc = green_supported(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (resource == NULL || type != CU_DEV_RESOURCE_TYPE_SM)
        return CUDA_ERROR_INVALID_VALUE;
    resource_sm(resource, device, n->spec->gpus[device].sm_count);
    return CUDA_SUCCESS;
}

/* cuda.h's minimum partition and granularity per architecture (without IGNORE_SM_COSCHEDULING). */
static unsigned sm_granularity(int device, unsigned *min)
{
    int major, minor;
    compute_capability(&sim_cu_node()->spec->gpus[device], &major, &minor);
    *min = major >= 9 ? 8 : major == 8 ? 4 : major == 7 ? 2 : 1;
    return major >= 9 ? 8 : major >= 7 ? 2 : 1;
}

SIM_EXPORT CUresult cuDevSmResourceSplitByCount(CUdevResource *result, unsigned int *nbGroups,
                                                const CUdevResource *input, CUdevResource *remaining,
                                                unsigned int useFlags, unsigned int minCount)
{
    int dev;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (nbGroups == NULL || input == NULL || !resource_device(input, &dev) ||
        (unsigned)dev >= sim_cu_node()->spec->gpu_count || minCount > input->sm.smCount)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned min, step = sm_granularity(dev, &min);
    if (useFlags & CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING)
        min = step = 1;
    unsigned per = minCount < min ? min : minCount;
    per = (per + step - 1) / step * step;
    unsigned groups = per > 0 ? input->sm.smCount / per : 0;
    if (result != NULL && *nbGroups < groups)
        groups = *nbGroups;
    if (result != NULL)
        for (unsigned i = 0; i < groups; i++)
            resource_sm(&result[i], dev, per);
    if (remaining != NULL)
        resource_sm(remaining, dev, input->sm.smCount - groups * per);
    *nbGroups = groups;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *phDesc, CUdevResource *resources,
                                              unsigned int nbResources)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (phDesc == NULL || resources == NULL || nbResources == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = -1;
    unsigned sms = 0;
    for (unsigned i = 0; i < nbResources; i++) {
        int d;
        if (!resource_device(&resources[i], &d) || (unsigned)d >= sim_cu_node()->spec->gpu_count)
            return CUDA_ERROR_INVALID_VALUE;
        if (dev >= 0 && d != dev)
            return CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION;
        dev = d;
        sms += resources[i].sm.smCount;
    }
    struct CUdevResourceDesc_st *desc = malloc(sizeof(*desc)); /* as the driver's: never freed */
    if (desc == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *desc = (struct CUdevResourceDesc_st){SIM_DESC_MAGIC, dev, sms};
    *phDesc = desc;
    return CUDA_SUCCESS;
}

static bool green_valid(CUgreenCtx g)
{
    return g != NULL && g->magic == SIM_GREEN_MAGIC;
}

SIM_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags)
{
    const struct sim_node *n;
    CUresult rc = green_supported(dev, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (phCtx == NULL || desc == NULL || desc->magic != SIM_DESC_MAGIC || !(flags & CU_GREEN_CTX_DEFAULT_STREAM) ||
        (flags & ~(unsigned)CU_GREEN_CTX_DEFAULT_STREAM) || desc->device != dev)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgreenCtx_st *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUcontext primary;
    if ((rc = cuDevicePrimaryCtxRetain(&primary, dev)) != CUDA_SUCCESS) {
        free(g);
        return rc;
    }
    if ((rc = sim_ctx_memory_acquire(dev)) != CUDA_SUCCESS) {
        primary_release(dev, false);
        free(g);
        return rc;
    }
    g->magic = SIM_GREEN_MAGIC;
    g->device = dev;
    g->sm_count = desc->sm_count;
    g->ctx = (struct CUctx_st){.magic = SIM_CTX_MAGIC, .device = dev, .primary = false, .flags = 0, .green = g};
    pthread_mutex_lock(&g_ctx_mu);
    bool room = g_ncreated < SIM_MAX_CREATED;
    if (room)
        g_created[g_ncreated++] = &g->ctx;
    pthread_mutex_unlock(&g_ctx_mu);
    if (room && (rc = sim_libraries_context_created(&g->ctx)) == CUDA_SUCCESS) {
        *phCtx = g;
        return CUDA_SUCCESS;
    }
    if (room) {
        created_forget(&g->ctx);
        sim_ctx_gone(&g->ctx);
    }
    sim_ctx_memory_release(dev);
    primary_release(dev, false);
    free(g);
    return room ? rc : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx hCtx)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!green_valid(hCtx))
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = &hCtx->ctx;
    for (int i = tl_depth - 1; i >= 0; i--) {
        if (tl_stack[i] == c) {
            memmove(&tl_stack[i], &tl_stack[i + 1], (size_t)(tl_depth - i - 1) * sizeof(tl_stack[0]));
            tl_depth--;
        }
    }
    int dev = hCtx->device;
    created_forget(c);
    sim_ctx_reparent(c, &g_primary[dev]); /* its allocations are the primary context's */
    sim_ctx_gone(c);                      /* its modules and streams go with it */
    if (c->extra_bytes > 0)
        sim_mem_uncharge((unsigned)dev, c->extra_bytes);
    c->magic = 0;
    hCtx->magic = 0;
    free(hCtx);
    sim_ctx_memory_release(dev);
    /* Its reference to the primary context; already gone when the primary was released from under it (one
     * cuDevicePrimaryCtxRelease too many, or a reset): the green context is destroyed all the same. */
    (void)primary_release(dev, false);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (pContext == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!green_valid(hCtx))
        return CUDA_ERROR_INVALID_CONTEXT;
    *pContext = &hCtx->ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGreenCtxGetDevResource(CUgreenCtx hCtx, CUdevResource *resource, CUdevResourceType type)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!green_valid(hCtx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (resource == NULL || type != CU_DEV_RESOURCE_TYPE_SM)
        return CUDA_ERROR_INVALID_VALUE;
    resource_sm(resource, hCtx->device, hCtx->sm_count);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevResource(CUcontext hCtx, CUdevResource *resource, CUdevResourceType type)
{
    const struct sim_node *n;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (hCtx == NULL)
        hCtx = sim_cu_current();
    if (!sim_cu_ctx_valid(hCtx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (hCtx->green != NULL)
        return cuGreenCtxGetDevResource(hCtx->green, resource, type);
    CUresult rc = green_supported(hCtx->device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (resource == NULL || type != CU_DEV_RESOURCE_TYPE_SM)
        return CUDA_ERROR_INVALID_VALUE;
    resource_sm(resource, hCtx->device, n->spec->gpus[hCtx->device].sm_count);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags, int priority)
{
    (void)priority;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!green_valid(greenCtx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!(flags & CU_STREAM_NON_BLOCKING) || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE; /* CU_STREAM_NON_BLOCKING must be specified */
    return sim_stream_create_in(phStream, &greenCtx->ctx);
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx == NULL) {
        if (tl_depth > 0)
            tl_depth--;
        return CUDA_SUCCESS;
    }
    if (!sim_cu_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tl_depth == 0)
        tl_depth = 1;
    tl_stack[tl_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    *pctx = sim_cu_current();
    return CUDA_SUCCESS;
}

static CUresult ctx_push(CUcontext ctx)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_cu_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tl_depth >= SIM_CTX_STACK)
        return CUDA_ERROR_OUT_OF_MEMORY;
    tl_stack[tl_depth++] = ctx;
    return CUDA_SUCCESS;
}

static CUresult ctx_pop(CUcontext *pctx)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (tl_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = tl_stack[--tl_depth];
    if (pctx != NULL)
        *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx)
{
    return ctx_push(ctx);
}

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    return ctx_push(ctx);
}

SIM_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx)
{
    return ctx_pop(pctx);
}

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    return ctx_pop(pctx);
}

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    int d;
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_current_device(&d);
    if (rc == CUDA_SUCCESS)
        *device = d;
    return rc;
}

SIM_EXPORT CUresult cuCtxGetFlags(unsigned int *flags)
{
    if (flags == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int d;
    CUresult rc = sim_cu_current_device(&d);
    if (rc == CUDA_SUCCESS)
        *flags = sim_cu_current()->flags;
    return rc;
}

SIM_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    if (version == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx == NULL)
        ctx = sim_cu_current();
    if (!sim_cu_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020;
    return CUDA_SUCCESS;
}


/* ---- limits: the stack, the malloc heap and the printf FIFO take device memory of the context ----------- */

/* Threads whose stacks a context reserves: every thread the GPU can hold at once. */
static uint64_t resident_threads(int device)
{
    const struct sim_gpu_spec *g = &sim_cu_node()->spec->gpus[device];
    int major, minor;
    compute_capability(g, &major, &minor);
    return (uint64_t)g->sm_count * (major == 7 && minor == 5 ? 1024u : 2048u);
}

/* Bytes a limit's value takes on the device beyond what the context's size already covers (its default). */
static uint64_t limit_bytes(CUlimit limit, size_t value, int device)
{
    switch (limit) {
    case CU_LIMIT_STACK_SIZE: return value > SIM_DEFAULT_STACK ? (value - SIM_DEFAULT_STACK) * resident_threads(device) : 0;
    case CU_LIMIT_MALLOC_HEAP_SIZE: return value > SIM_DEFAULT_HEAP ? value - SIM_DEFAULT_HEAP : 0;
    case CU_LIMIT_PRINTF_FIFO_SIZE: return value > SIM_DEFAULT_FIFO ? value - SIM_DEFAULT_FIFO : 0;
    default: return 0;
    }
}

static size_t limit_default(CUlimit limit)
{
    switch (limit) {
    case CU_LIMIT_STACK_SIZE: return SIM_DEFAULT_STACK;
    case CU_LIMIT_MALLOC_HEAP_SIZE: return SIM_DEFAULT_HEAP;
    case CU_LIMIT_PRINTF_FIFO_SIZE: return SIM_DEFAULT_FIFO;
    case CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT: return 2048;
    case CU_LIMIT_MAX_L2_FETCH_GRANULARITY: return 64;
    default: return 0;
    }
}

SIM_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    int dev;
    if (pvalue == NULL || (unsigned)limit >= SIM_LIMITS)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUcontext c = sim_cu_current();
    *pvalue = c->limit_set[limit] ? c->limits[limit] : limit_default(limit);
    return CUDA_SUCCESS;
}

/* Sets c's limit (on device dev), charging or giving back the device memory it takes (g_ctx_mu held). */
static CUresult set_limit_in(CUcontext c, int dev, CUlimit limit, size_t value)
{
    CUresult rc = CUDA_SUCCESS;
    size_t old = c->limit_set[limit] ? c->limits[limit] : limit_default(limit);
    uint64_t before = limit_bytes(limit, old, dev), after = limit_bytes(limit, value, dev);
    if (after > before)
        rc = sim_mem_charge((unsigned)dev, after - before);
    else if (before > after)
        sim_mem_uncharge((unsigned)dev, before - after);
    if (rc == CUDA_SUCCESS) {
        c->limits[limit] = value;
        c->limit_set[limit] = true;
        c->extra_bytes = c->extra_bytes - before + after;
    }
    return rc;
}

SIM_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    int dev;
    if ((unsigned)limit >= SIM_LIMITS)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_ctx_mu);
    rc = set_limit_in(sim_cu_current(), dev, limit, value);
    pthread_mutex_unlock(&g_ctx_mu);
    return rc;
}

/*
 * A launch of a kernel whose local frame is bigger than ctx's stack: the stack grows to it for every resident
 * thread, as a real driver does at such a launch (never back down); CUDA_ERROR_OUT_OF_MEMORY when the GPU cannot
 * hold it.
 */
CUresult sim_ctx_stack_at_least(CUcontext ctx, size_t bytes)
{
    if (!sim_cu_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_ctx_mu);
    size_t cur = ctx->limit_set[CU_LIMIT_STACK_SIZE] ? ctx->limits[CU_LIMIT_STACK_SIZE] : SIM_DEFAULT_STACK;
    CUresult rc = bytes > cur ? set_limit_in(ctx, ctx->device, CU_LIMIT_STACK_SIZE, bytes) : CUDA_SUCCESS;
    pthread_mutex_unlock(&g_ctx_mu);
    return rc;
}

/* ---- cuGetProcAddress --------------------------------------------------- */

static int compare_base(const void *key, const void *entry)
{
    return strcmp((const char *)key, ((const struct sim_proc_entry *)entry)->base);
}

/*
 * The driver's rule: among the ABIs of symbol, the newest one introduced at or
 * before min(cudaVersion, driver version); with the per-thread flag the
 * _ptds/_ptsz variant when there is one.
 */
static CUresult get_proc(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status)
{
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    if (symbol == NULL || pfn == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    *pfn = NULL;
    const struct sim_proc_entry *hit =
        bsearch(symbol, sim_proc_table, sim_proc_table_len, sizeof(sim_proc_table[0]), compare_base);
    if (hit == NULL)
        goto out;
    const struct sim_proc_entry *first = hit, *end = hit;
    while (first > sim_proc_table && strcmp(first[-1].base, symbol) == 0)
        first--;
    while (end < sim_proc_table + sim_proc_table_len && strcmp(end->base, symbol) == 0)
        end++;
    int driver = sim_cu_driver_version();
    int limit = cudaVersion < driver ? cudaVersion : driver;
    bool per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct sim_proc_entry *best = NULL, *best_pt = NULL;
    int oldest = -1;
    for (const struct sim_proc_entry *e = first; e < end; e++) {
        if (!e->per_thread && (oldest < 0 || e->version < oldest))
            oldest = e->version;
        if (e->version > limit)
            continue;
        if (e->per_thread) {
            if (best_pt == NULL || e->version > best_pt->version)
                best_pt = e;
        } else if (best == NULL || e->version > best->version) {
            best = e;
        }
    }
    if (per_thread && best_pt != NULL)
        best = best_pt;
    if (best == NULL) {
        /* Known symbol: too new for this driver, or the caller asked for a version before it existed. */
        st = oldest > driver ? CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        goto out;
    }
    *pfn = (void *)best->fn;
    st = CU_GET_PROC_ADDRESS_SUCCESS;
    rc = CUDA_SUCCESS;
out:
    if (status != NULL)
        *status = st;
    return rc;
}

SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return get_proc(symbol, pfn, cudaVersion, flags, NULL);
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus)
{
    return get_proc(symbol, pfn, cudaVersion, flags, symbolStatus);
}
