/*
 * Simulated libcuda: modules, functions, launches on every path (each kernel
 * occupies the simulated GPU for a duration from the cost model, see
 * kernel_ns(); sim_timeline.c runs the shared per-GPU timeline), and graphs
 * with kernel and memory nodes.
 */
#include "cuda_sim.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "sim_timeline.h"
#include "vc_image.h"
#include "vc_map.h"

/*
 * The device's graph memory pool, per GPU (under the records lock): `used` = the graph allocations live
 * now; `reserved` = the physical memory the pool holds for them, charged to the process.  As with the
 * real driver, memory a graph allocation gave back stays reserved (cached for the next graphs) until
 * cuDeviceGraphMemTrim; the high-water marks stay until reset with cuDeviceSetGraphMemAttribute.
 */
struct graph_pool {
    uint64_t used, reserved, used_high, reserved_high;
};
static struct graph_pool g_graph_pool[GPUSIM_MAX_GPUS];

void sim_exec_atfork_child(void)
{
    memset(g_graph_pool, 0, sizeof(g_graph_pool));
}

/* ---- modules and launches ----------------------------------------------------------------- */

/* A module in one context: its code page and its module-scope variables (from the image's PTX). */
struct sim_var {
    char name[128];
    uint64_t addr, size;
};
struct sim_module {
    int device;
    uint64_t bytes;    /* device memory it takes: code page + variables' pages (vc_image_footprint) */
    unsigned nvars;
    struct sim_var vars[];
};

struct sim_function {
    CUmodule module;    /* NULL for a CUkernel */
    uint64_t named_ns;  /* duration from the name ("..._<N>ns|us|ms"), 0 = the cost model */
    /* The legacy launch API's state: cuFuncSetBlockShape, cuFuncSetSharedSize, cuParamSetSize. */
    unsigned bx, by, bz, shared, param_size;
    uint64_t local;     /* bytes of local memory (its stack frame) per thread: CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES */
    char name[64];
};

/* A context-less kernel of a library (CUkernel): launchable like a function, in the stream's context. */
struct sim_kernel {
    struct sim_function fn; /* first: a CUkernel is also a sim_function */
    CUlibrary library;
};

/* f names a function or (cast to CUfunction, as cuda.h allows) a kernel. */
static bool callable(CUfunction f)
{
    return sim_find((uint64_t)(uintptr_t)f, REC_FUNCTION, NULL, false) ||
           sim_find((uint64_t)(uintptr_t)f, REC_KERNEL, NULL, false);
}

/* "spin_50us" -> 50000; 0 unless the name ends in _<digits>ns, _<digits>us or _<digits>ms. */
static uint64_t duration_in_name(const char *name)
{
    size_t len = strlen(name);
    if (len < 4)
        return 0;
    const char *unit = name + len - 2;
    uint64_t scale = strcmp(unit, "ns") == 0 ? 1u : strcmp(unit, "us") == 0 ? 1000u : strcmp(unit, "ms") == 0 ? 1000000u : 0;
    if (scale == 0)
        return 0;
    const char *p = unit;
    while (p > name && p[-1] >= '0' && p[-1] <= '9')
        p--;
    if (p == unit || p == name || p[-1] != '_' || unit - p > 12)
        return 0;
    return strtoull(p, NULL, 10) * scale;
}

/* GPUSIM_KERNEL_NS: every kernel of this process (without a duration in its name) takes that long. */
static uint64_t env_kernel_ns(void)
{
    static _Atomic int64_t cached = -1;
    int64_t v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        const char *s = getenv("GPUSIM_KERNEL_NS");
        v = s != NULL ? atoll(s) : 0;
        if (v < 0)
            v = 0;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return (uint64_t)v;
}

/*
 * The cost model (vcuda/sim/README.md "Simulated GPU time"): a named duration,
 * else GPUSIM_KERNEL_NS, else threads / (sm_count x sm_threads_per_us), at
 * least 1 us.
 */
static uint64_t kernel_ns(const struct sim_function *f, unsigned gpu, uint64_t blocks, uint64_t threads_per_block)
{
    if (f != NULL && f->named_ns != 0)
        return f->named_ns;
    uint64_t env = env_kernel_ns();
    if (env != 0)
        return env;
    const struct sim_gpu_spec *g = &sim_cu_node()->spec->gpus[gpu];
    double rate = (double)g->sm_count * (double)g->sm_threads_per_us; /* threads per us */
    double ns = (double)blocks * (double)threads_per_block * 1000.0 / rate;
    return ns < 1000.0 ? 1000u : ns > 1e12 ? (uint64_t)1e12 : (uint64_t)ns;
}

static bool var_of(const struct vc_map_entry *e, void *module)
{
    return e->aux == (uint64_t)(uintptr_t)module;
}

/* The variables of an image, as parsed (names and sizes; addresses are given per loaded module). */
struct var_list {
    unsigned n, cap;
    struct sim_var *v;
    bool failed;
};

static void collect_var(const char *name, size_t len, uint64_t bytes, void *arg)
{
    struct var_list *l = arg;
    if (l->n == l->cap) {
        unsigned cap = l->cap ? l->cap * 2 : 8;
        struct sim_var *v = realloc(l->v, cap * sizeof(*v));
        if (v == NULL) {
            l->failed = true;
            return;
        }
        l->v = v, l->cap = cap;
    }
    struct sim_var *e = &l->v[l->n++];
    size_t n = len < sizeof(e->name) - 1 ? len : sizeof(e->name) - 1;
    memcpy(e->name, name, n);
    e->name[n] = '\0';
    e->size = bytes;
    e->addr = 0;
}

/*
 * The local memory (stack frame) each thread of a kernel takes: the .local variables its PTX body declares.  A real
 * driver grows the context's stack (that much per resident thread) at the launch of a kernel whose frame is bigger
 * (an H200 with driver 580: a 64 KiB frame took 16632 MiB more at its first launch).  Kept per entry name for the
 * process (the largest seen under a name), read when a function or kernel of that name is made.
 */
#define LOCAL_ENTRIES 4096u
static struct {
    char name[256];
    uint64_t bytes;
} g_local[LOCAL_ENTRIES];
static unsigned g_nlocal;
static pthread_mutex_t g_local_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t ptx_type_bytes(const char *t)
{
    if (strncmp(t, ".b8", 3) == 0 || strncmp(t, ".u8", 3) == 0 || strncmp(t, ".s8", 3) == 0)
        return 1;
    if (strncmp(t, ".b16", 4) == 0 || strncmp(t, ".u16", 4) == 0 || strncmp(t, ".s16", 4) == 0 ||
        strncmp(t, ".f16", 4) == 0)
        return 2;
    if (strncmp(t, ".b32", 4) == 0 || strncmp(t, ".u32", 4) == 0 || strncmp(t, ".s32", 4) == 0 ||
        strncmp(t, ".f32", 4) == 0)
        return 4;
    return 8;
}

/* The bytes of one ".local [.align N] .type name[d1][d2]...;" declaration at p (just after ".local"). */
static uint64_t local_decl_bytes(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    if (end - p > 6 && strncmp(p, ".align", 6) == 0) {
        p += 6;
        while (p < end && (*p == ' ' || *p == '\t' || (*p >= '0' && *p <= '9')))
            p++;
    }
    if (p >= end || *p != '.')
        return 0;
    uint64_t bytes = ptx_type_bytes(p);
    while (p < end && *p != ';' && *p != '[')
        p++;
    while (p < end && *p == '[') {
        uint64_t n = strtoull(p + 1, NULL, 10);
        bytes = n > 0 && bytes <= UINT64_MAX / n ? bytes * n : bytes;
        while (p < end && *p != ']')
            p++;
        if (p < end)
            p++;
    }
    return bytes;
}

static void note_local(const char *name, size_t len, uint64_t bytes)
{
    if (len == 0 || len >= sizeof(g_local[0].name) || bytes == 0)
        return; /* only frames: a name without one reads 0 */
    pthread_mutex_lock(&g_local_mu);
    unsigned i = 0;
    while (i < g_nlocal && !(strncmp(g_local[i].name, name, len) == 0 && g_local[i].name[len] == '\0'))
        i++;
    if (i == g_nlocal && g_nlocal < LOCAL_ENTRIES) {
        memcpy(g_local[i].name, name, len);
        g_local[i].name[len] = '\0';
        g_local[i].bytes = 0;
        g_nlocal++;
    }
    if (i < g_nlocal && bytes > g_local[i].bytes)
        g_local[i].bytes = bytes;
    pthread_mutex_unlock(&g_local_mu);
}

/* Notes the local frame of every .entry of a PTX image (a binary image: none). */
static void note_entries_local(const void *image)
{
    const char *s = image, *e;
    while ((e = strstr(s, ".entry")) != NULL) {
        const char *n = e + 6;
        while (*n == ' ' || *n == '\t')
            n++;
        size_t len = strcspn(n, " \t\r\n(");
        const char *open = strchr(n + len, '{');
        if (open == NULL)
            return;
        int depth = 0;
        const char *c = open;
        for (; *c != '\0'; c++) {
            if (*c == '{')
                depth++;
            else if (*c == '}' && --depth == 0)
                break;
        }
        uint64_t local = 0;
        for (const char *l = open; (l = strstr(l, ".local")) != NULL && l < c; l += 6) {
            const char *semi = strchr(l, ';');
            if (semi == NULL || semi > c)
                break;
            if (l[6] == ' ' || l[6] == '\t')
                local += local_decl_bytes(l + 6, semi);
        }
        note_local(n, len, local);
        if (*c == '\0')
            return;
        s = c;
    }
}

/* The local frame noted for kernels named name (0: none). */
static uint64_t entry_local(const char *name)
{
    uint64_t bytes = 0;
    pthread_mutex_lock(&g_local_mu);
    for (unsigned i = 0; i < g_nlocal; i++)
        if (strcmp(g_local[i].name, name) == 0)
            bytes = g_local[i].bytes;
    pthread_mutex_unlock(&g_local_mu);
    return bytes;
}

/* Parses image: its footprint and variables (l->v malloc'ed, the caller frees it). */
static CUresult image_vars(const void *image, uint64_t *bytes, struct var_list *l)
{
    uint64_t data;
    *l = (struct var_list){0, 0, NULL, false};
    vc_image_parse(image, &data, collect_var, l);
    if (l->failed) {
        free(l->v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *bytes = vc_image_footprint(image);
    note_entries_local(image);
    return CUDA_SUCCESS;
}

/*
 * Loads a module into ctx (on dev): charges its footprint, gives each variable an address (a record
 * copies and sets accept) and records it as the context's (freed with it).  library: the CUlibrary
 * it belongs to (cuLibraryGetModule), or 0.
 */
static CUresult module_load(CUmodule *module, CUcontext ctx, int dev, uint64_t bytes, const struct sim_var *vars,
                            unsigned nvars, uint64_t library)
{
    struct sim_module *m = calloc(1, sizeof(*m) + nvars * sizeof(m->vars[0]));
    if (m == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->device = dev;
    m->bytes = bytes;
    m->nvars = nvars;
    /* Its code and data take device memory the allocation APIs never see (what NVML shows per process). */
    CUresult rc = sim_mem_charge((unsigned)dev, bytes);
    if (rc != CUDA_SUCCESS) {
        free(m);
        return rc;
    }
    for (unsigned i = 0; i < nvars; i++) {
        m->vars[i] = vars[i];
        m->vars[i].addr = vars[i].size > 0 ? sim_va_alloc((unsigned)dev, vars[i].size, 256) : 0;
    }
    struct vc_map_entry e = {.key = (uint64_t)(uintptr_t)m, .kind = REC_MODULE, .gpu = (unsigned)dev, .size = bytes,
                             .aux = library, .ctx = (uint64_t)(uintptr_t)ctx};
    sim_rec_lock();
    int put = vc_map_put(sim_recs(), &e);
    for (unsigned i = 0; i < nvars && put == 0; i++) {
        if (m->vars[i].addr == 0)
            continue;
        struct vc_map_entry v = {.key = m->vars[i].addr, .kind = REC_MODVAR, .gpu = (unsigned)dev,
                                 .size = m->vars[i].size, .aux = (uint64_t)(uintptr_t)m,
                                 .ctx = (uint64_t)(uintptr_t)ctx};
        put = vc_map_put(sim_recs(), &v);
    }
    if (put != 0) {
        vc_map_remove_if(sim_recs(), REC_MODVAR, var_of, NULL, m);
        vc_map_find(sim_recs(), (uint64_t)(uintptr_t)m, REC_MODULE, NULL, true);
    }
    sim_rec_unlock();
    if (put != 0) {
        sim_mem_uncharge((unsigned)dev, bytes);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *module = (CUmodule)m;
    return CUDA_SUCCESS;
}

static CUresult module_new(CUmodule *module, const void *image)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t bytes;
    struct var_list l;
    if ((rc = image_vars(image, &bytes, &l)) != CUDA_SUCCESS)
        return rc;
    rc = module_load(module, sim_cu_current(), dev, bytes, l.v, l.n, 0);
    free(l.v);
    return rc;
}

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    if (module == NULL || image == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return module_new(module, image);
}

SIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                       CUjit_option *options, void **optionValues)
{
    (void)numOptions, (void)options, (void)optionValues;
    return cuModuleLoadData(module, image);
}

SIM_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return cuModuleLoadData(module, fatCubin);
}

SIM_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    if (module == NULL || fname == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    char *image = vc_image_read_file(fname);
    if (image == NULL)
        return CUDA_ERROR_FILE_NOT_FOUND;
    CUresult rc = module_new(module, image);
    free(image);
    return rc;
}

static bool function_of(const struct vc_map_entry *e, void *module)
{
    return e->aux == (uint64_t)(uintptr_t)module;
}

static void free_record_object(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    free((void *)(uintptr_t)e->key);
}

SIM_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct vc_map_entry e;
    if (!sim_find((uint64_t)(uintptr_t)hmod, REC_MODULE, &e, true))
        return CUDA_ERROR_INVALID_HANDLE;
    sim_mem_uncharge(e.gpu, e.size);
    sim_rec_lock();
    vc_map_remove_if(sim_recs(), REC_FUNCTION, function_of, free_record_object, hmod);
    vc_map_remove_if(sim_recs(), REC_MODVAR, var_of, NULL, hmod);
    sim_rec_unlock();
    free(hmod);
    return CUDA_SUCCESS;
}

/* A variable of a loaded module: its address and size. */
static CUresult module_global(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)hmod, REC_MODULE, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    const struct sim_module *m = (const struct sim_module *)(void *)hmod;
    for (unsigned i = 0; i < m->nvars; i++) {
        if (strcmp(m->vars[i].name, name) == 0) {
            if (dptr != NULL)
                *dptr = (CUdeviceptr)m->vars[i].addr;
            if (bytes != NULL)
                *bytes = (size_t)m->vars[i].size;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

SIM_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name)
{
    return module_global(dptr, bytes, hmod, name);
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (hfunc == NULL || name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)hmod, REC_MODULE, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    struct sim_function *f = malloc(sizeof(*f));
    if (f == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *f = (struct sim_function){.module = hmod, .named_ns = duration_in_name(name), .local = entry_local(name)};
    snprintf(f->name, sizeof(f->name), "%s", name);
    if (sim_put((uint64_t)(uintptr_t)f, REC_FUNCTION, 0, 0, (uint64_t)(uintptr_t)hmod) != 0) {
        free(f);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *hfunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

/* ---- libraries and context-less kernels (CUDA 12.0) ----------------------------------- */

/*
 * A library is loaded into a context as a module of that context (freed with it).  When, follows the
 * module loading mode (CUDA_MODULE_LOADING, read once): EAGER loads it into every live context at
 * cuLibraryLoad* and into contexts created later; LAZY (the default since CUDA 12.2) into a context
 * when something there needs it: cuLibraryGetModule, cuLibraryGetGlobal / cuLibraryGetManaged,
 * cuKernelGetFunction, or a launch of one of its kernels.
 */
struct sim_library {
    uint64_t bytes; /* footprint of one load (vc_image_footprint) */
    unsigned nvars;
    struct sim_var vars[];
};

static bool eager_loading(void)
{
    static _Atomic int mode = -1;
    int m = atomic_load_explicit(&mode, memory_order_relaxed);
    if (m < 0) {
        const char *s = getenv("CUDA_MODULE_LOADING");
        m = s != NULL && strcmp(s, "EAGER") == 0;
        atomic_store_explicit(&mode, m, memory_order_relaxed);
    }
    return m == 1;
}

struct lib_in_ctx {
    uint64_t library, ctx;
};

static bool module_of_library_in(const struct vc_map_entry *e, void *arg)
{
    const struct lib_in_ctx *k = arg;
    return e->aux == k->library && e->ctx == k->ctx;
}

/* The library's module in ctx, loaded now if it is not yet (on ctx's device). */
static CUresult library_in(CUlibrary library, CUcontext ctx, CUmodule *out)
{
    if (!sim_cu_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct vc_map_entry e;
    if (!sim_find((uint64_t)(uintptr_t)library, REC_LIBRARY, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    struct lib_in_ctx k = {(uint64_t)(uintptr_t)library, (uint64_t)(uintptr_t)ctx};
    sim_rec_lock();
    bool hit = vc_map_find_if(sim_recs(), REC_MODULE, module_of_library_in, &k, &e);
    sim_rec_unlock();
    if (hit) {
        *out = (CUmodule)(uintptr_t)e.key;
        return CUDA_SUCCESS;
    }
    const struct sim_library *l = (const struct sim_library *)(void *)library;
    return module_load(out, ctx, ctx->device, l->bytes, l->vars, l->nvars, (uint64_t)(uintptr_t)library);
}

struct eager_load {
    CUlibrary library;
    CUresult rc;
};

static void load_into(CUcontext ctx, void *arg)
{
    struct eager_load *el = arg;
    CUmodule m;
    if (el->rc == CUDA_SUCCESS)
        el->rc = library_in(el->library, ctx, &m);
}

struct lib_keys {
    uint64_t keys[256];
    unsigned n;
};

static void collect_library(struct vc_map_entry *e, void *arg)
{
    struct lib_keys *l = arg;
    if (l->n < sizeof(l->keys) / sizeof(l->keys[0]))
        l->keys[l->n++] = e->key;
}

/* A context came alive (EAGER: every library goes into it); an error if one does not fit. */
CUresult sim_libraries_context_created(CUcontext ctx)
{
    if (!eager_loading())
        return CUDA_SUCCESS;
    struct lib_keys libs = {.n = 0};
    sim_rec_lock();
    vc_map_each(sim_recs(), REC_LIBRARY, collect_library, &libs);
    sim_rec_unlock();
    for (unsigned i = 0; i < libs.n; i++) {
        CUmodule m;
        CUresult rc = library_in((CUlibrary)(uintptr_t)libs.keys[i], ctx, &m);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

static CUresult library_load(CUlibrary *library, const void *code)
{
    uint64_t bytes;
    struct var_list vl;
    CUresult rc = image_vars(code, &bytes, &vl);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_library *lib = calloc(1, sizeof(*lib) + vl.n * sizeof(lib->vars[0]));
    if (lib == NULL) {
        free(vl.v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    lib->bytes = bytes;
    lib->nvars = vl.n;
    if (vl.n > 0)
        memcpy(lib->vars, vl.v, vl.n * sizeof(vl.v[0]));
    free(vl.v);
    if (sim_put((uint64_t)(uintptr_t)lib, REC_LIBRARY, NO_GPU, 0, 0) != 0) {
        free(lib);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (eager_loading()) {
        struct eager_load el = {(CUlibrary)lib, CUDA_SUCCESS};
        sim_ctx_each(load_into, &el);
        if (el.rc != CUDA_SUCCESS) {
            cuLibraryUnload((CUlibrary)lib);
            return el.rc;
        }
    }
    *library = (CUlibrary)lib;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                      void **jitOptionsValues, unsigned int numJitOptions,
                                      CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                      unsigned int numLibraryOptions)
{
    (void)jitOptionsValues, (void)libraryOptionValues;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (library == NULL || code == NULL || (numJitOptions > 0 && jitOptions == NULL) ||
        (numLibraryOptions > 0 && libraryOptions == NULL))
        return CUDA_ERROR_INVALID_VALUE;
    return library_load(library, code);
}

SIM_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                          void **jitOptionsValues, unsigned int numJitOptions,
                                          CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                          unsigned int numLibraryOptions)
{
    (void)jitOptionsValues, (void)libraryOptionValues;
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (library == NULL || fileName == NULL || (numJitOptions > 0 && jitOptions == NULL) ||
        (numLibraryOptions > 0 && libraryOptions == NULL))
        return CUDA_ERROR_INVALID_VALUE;
    char *image = vc_image_read_file(fileName);
    if (image == NULL)
        return CUDA_ERROR_FILE_NOT_FOUND;
    CUresult rc = library_load(library, image);
    free(image);
    return rc;
}

static bool kernel_of(const struct vc_map_entry *e, void *library)
{
    return e->aux == (uint64_t)(uintptr_t)library;
}

static void module_unloaded(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    sim_mem_uncharge(e->gpu, e->size);
    vc_map_remove_if(sim_recs(), REC_MODVAR, var_of, NULL, (void *)(uintptr_t)e->key);
    vc_map_remove_if(sim_recs(), REC_FUNCTION, function_of, free_record_object, (void *)(uintptr_t)e->key);
    free((void *)(uintptr_t)e->key);
}

SIM_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_find((uint64_t)(uintptr_t)library, REC_LIBRARY, NULL, true))
        return CUDA_ERROR_INVALID_HANDLE;
    sim_rec_lock();
    vc_map_remove_if(sim_recs(), REC_KERNEL, kernel_of, free_record_object, library);
    vc_map_remove_if(sim_recs(), REC_FUNCTION, function_of, free_record_object, library);
    vc_map_remove_if(sim_recs(), REC_MODULE, function_of, module_unloaded, library); /* its module in every context */
    sim_rec_unlock();
    free(library);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (pKernel == NULL || name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)library, REC_LIBRARY, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    struct sim_kernel *k = calloc(1, sizeof(*k));
    if (k == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    k->fn.named_ns = duration_in_name(name);
    k->fn.local = entry_local(name);
    snprintf(k->fn.name, sizeof(k->fn.name), "%s", name);
    k->library = library;
    if (sim_put((uint64_t)(uintptr_t)k, REC_KERNEL, NO_GPU, 0, (uint64_t)(uintptr_t)library) != 0) {
        free(k);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pKernel = (CUkernel)k;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library)
{
    if (pMod == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    return library_in(library, sim_cu_current(), pMod);
}

/* A variable of the library, in the current context (loading the library there if needed). */
static CUresult library_global(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)
{
    CUmodule m;
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc == CUDA_SUCCESS)
        rc = library_in(library, sim_cu_current(), &m);
    return rc == CUDA_SUCCESS ? module_global(dptr, bytes, m, name) : rc;
}

SIM_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)
{
    return library_global(dptr, bytes, library, name);
}

SIM_EXPORT CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)
{
    return library_global(dptr, bytes, library, name);
}

/* The kernel's function in the current context (a function record owned by the library). */
SIM_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    struct vc_map_entry e;
    if (pFunc == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_find((uint64_t)(uintptr_t)kernel, REC_KERNEL, &e, false))
        return CUDA_ERROR_INVALID_HANDLE;
    const struct sim_kernel *k = (const struct sim_kernel *)(void *)kernel;
    CUmodule m;
    if ((rc = library_in(k->library, sim_cu_current(), &m)) != CUDA_SUCCESS)
        return rc;
    struct sim_function *f = malloc(sizeof(*f));
    if (f == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *f = k->fn;
    f->module = NULL;
    if (sim_put((uint64_t)(uintptr_t)f, REC_FUNCTION, 0, 0, e.aux) != 0) {
        free(f);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pFunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel)
{
    struct vc_map_entry e;
    if (pLib == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)kernel, REC_KERNEL, &e, false))
        return CUDA_ERROR_INVALID_HANDLE;
    *pLib = (CUlibrary)(uintptr_t)e.aux;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetName(const char **name, CUkernel hfunc)
{
    if (name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)hfunc, REC_KERNEL, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    *name = ((const struct sim_kernel *)(void *)hfunc)->fn.name;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncGetName(const char **name, CUfunction hfunc)
{
    if (name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!callable(hfunc))
        return CUDA_ERROR_INVALID_HANDLE;
    *name = ((const struct sim_function *)(void *)hfunc)->name;
    return CUDA_SUCCESS;
}

/* Queues dur_ns of GPU time for this process on gpu; the stream remembers it. */
static void run_on_gpu(unsigned gpu, CUstream stream, uint64_t dur_ns)
{
    uint64_t upto;
    if (sim_tl_submit(sim_cu_node()->state, gpu, dur_ns, &upto))
        sim_stream_mark(stream, upto);
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       CUstream stream)
{
    unsigned gpu;
    CUresult rc = sim_stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!callable(f))
        return CUDA_ERROR_INVALID_HANDLE;
    struct vc_map_entry ke;
    if (sim_find((uint64_t)(uintptr_t)f, REC_KERNEL, &ke, false)) { /* a CUkernel: its library into this context */
        CUcontext ctx;
        CUmodule m;
        if ((rc = cuStreamGetCtx(stream, &ctx)) != CUDA_SUCCESS ||
            (rc = library_in((CUlibrary)(uintptr_t)ke.aux, ctx, &m)) != CUDA_SUCCESS)
            return rc;
    }
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t ns = kernel_ns((const struct sim_function *)(void *)f, gpu, (uint64_t)gx * gy * gz, (uint64_t)bx * by * bz);
    CUgraph capture = sim_stream_capture(stream);
    if (capture != NULL) /* captured: a kernel node of the capturing graph, nothing runs */
        return sim_graph_kernel_node(NULL, capture, ns, f, ((const struct sim_function *)(void *)f)->local);
    uint64_t local = ((const struct sim_function *)(void *)f)->local;
    if (local > SIM_DEFAULT_STACK) { /* the stack grows to the kernel's frame, for every resident thread */
        CUcontext ctx;
        if ((rc = cuStreamGetCtx(stream, &ctx)) != CUDA_SUCCESS ||
            (rc = sim_ctx_stack_at_least(ctx, (size_t)local)) != CUDA_SUCCESS)
            return rc;
    }
    run_on_gpu(gpu, stream, ns);
    return CUDA_SUCCESS;
}

static CUresult function_attribute(int *pi, CUfunction_attribute attrib, const struct sim_function *f)
{
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *pi = f->local > INT32_MAX ? INT32_MAX : (int)f->local; return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 75; return CUDA_SUCCESS;
    default:
        if ((unsigned)attrib >= (unsigned)CU_FUNC_ATTRIBUTE_MAX)
            return CUDA_ERROR_INVALID_VALUE;
        *pi = 0;
        return CUDA_SUCCESS;
    }
}

SIM_EXPORT CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    if (pi == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!callable(hfunc))
        return CUDA_ERROR_INVALID_HANDLE;
    return function_attribute(pi, attrib, (const struct sim_function *)(void *)hfunc);
}

SIM_EXPORT CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev)
{
    (void)dev;
    if (pi == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)kernel, REC_KERNEL, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    return function_attribute(pi, attrib, &((const struct sim_kernel *)(void *)kernel)->fn);
}

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                   unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams, void **extra)
{
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                              unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                              unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                              void **kernelParams)
{
    (void)sharedMemBytes, (void)kernelParams;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                   unsigned int gridDimZ, unsigned int blockDimX,
                                                   unsigned int blockDimY, unsigned int blockDimZ,
                                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    (void)sharedMemBytes, (void)kernelParams;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

static CUresult launch_ex(const CUlaunchConfig *c, CUfunction f)
{
    if (c == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->hStream);
}

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)kernelParams, (void)extra;
    return launch_ex(config, f);
}

SIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                          void **extra)
{
    (void)kernelParams, (void)extra;
    return launch_ex(config, f);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                         unsigned int flags)
{
    (void)flags;
    if (launchParamsList == NULL || numDevices == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < numDevices; i++) {
        const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
        CUresult rc = launch(p->function, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY,
                             p->blockDimZ, p->hStream);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

/* ---- the legacy launch API (deprecated since CUDA 4.0, still exported) ---------------------- */

/* A function of the current context's modules (the legacy API has no context-less kernels). */
static CUresult legacy_function(CUfunction f, struct sim_function **out)
{
    int dev;
    CUresult rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_find((uint64_t)(uintptr_t)f, REC_FUNCTION, NULL, false))
        return CUDA_ERROR_INVALID_HANDLE;
    *out = (struct sim_function *)(void *)f;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncSetBlockShape(CUfunction hfunc, int x, int y, int z)
{
    struct sim_function *f;
    CUresult rc = legacy_function(hfunc, &f);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (x <= 0 || y <= 0 || z <= 0 || (int64_t)x * y * z > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    f->bx = (unsigned)x, f->by = (unsigned)y, f->bz = (unsigned)z;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncSetSharedSize(CUfunction hfunc, unsigned int bytes)
{
    struct sim_function *f;
    CUresult rc = legacy_function(hfunc, &f);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (bytes > 49152)
        return CUDA_ERROR_INVALID_VALUE;
    f->shared = bytes;
    return CUDA_SUCCESS;
}

#define SIM_PARAM_MAX 4096 /* bytes of kernel parameters */

SIM_EXPORT CUresult cuParamSetSize(CUfunction hfunc, unsigned int numbytes)
{
    struct sim_function *f;
    CUresult rc = legacy_function(hfunc, &f);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (numbytes > SIM_PARAM_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    f->param_size = numbytes;
    return CUDA_SUCCESS;
}

static CUresult param_set(CUfunction hfunc, int offset, const void *ptr, unsigned numbytes)
{
    struct sim_function *f;
    CUresult rc = legacy_function(hfunc, &f);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (offset < 0 || ptr == NULL || (uint64_t)offset + numbytes > SIM_PARAM_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS; /* the values themselves are never read: kernels do not run code here */
}

SIM_EXPORT CUresult cuParamSeti(CUfunction hfunc, int offset, unsigned int value)
{
    return param_set(hfunc, offset, &value, sizeof(value));
}

SIM_EXPORT CUresult cuParamSetf(CUfunction hfunc, int offset, float value)
{
    return param_set(hfunc, offset, &value, sizeof(value));
}

SIM_EXPORT CUresult cuParamSetv(CUfunction hfunc, int offset, void *ptr, unsigned int numbytes)
{
    return param_set(hfunc, offset, ptr, numbytes);
}

static CUresult legacy_launch(CUfunction hfunc, int w, int h, CUstream stream)
{
    struct sim_function *f;
    CUresult rc = legacy_function(hfunc, &f);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (f->bx == 0 || w <= 0 || h <= 0)
        return CUDA_ERROR_INVALID_VALUE; /* no cuFuncSetBlockShape yet */
    return launch(hfunc, (unsigned)w, (unsigned)h, 1, f->bx, f->by, f->bz, stream);
}

SIM_EXPORT CUresult cuLaunch(CUfunction f)
{
    return legacy_launch(f, 1, 1, NULL);
}

SIM_EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    return legacy_launch(f, grid_width, grid_height, NULL);
}

SIM_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    return legacy_launch(f, grid_width, grid_height, hStream);
}

/* ---- graphs ------------------------------------------------------------------------------ */

/*
 * Graphs, nodes and executable graphs.  A graph and its exec sum their kernel nodes' durations (one
 * timeline entry per launch).  Memory allocation nodes follow cuda.h: the address is fixed when the
 * node is made; the memory is the exec's (charged when the graph is instantiated: the driver backs it
 * by then, and "only one instantiation of the graph may exist"); a launch without a free node for
 * it leaves the allocation live after the graph ran, until cuMemFree/cuMemFreeAsync of its address;
 * destroying the graph frees nothing.  REC_GALLOC (key = address, aux = its struct sim_galloc) keeps
 * one allocation's state; a node record (REC_GNODE) carries its type in ctx.
 */
enum { NODE_KERNEL = 0, NODE_ALLOC = 1, NODE_FREE = 2, NODE_CHILD = 3 };

struct sim_graph_obj {
    _Atomic uint64_t kernel_ns;
    _Atomic uint32_t kernels;
    _Atomic uint64_t local; /* the largest local frame of its kernels (a node: its kernel's) */
    CUgraph graph; /* an exec: the graph it was instantiated from (an identity only: may be gone); a graph: the graph
                      it is embedded in (a child node's clone), else NULL */
    _Atomic(void *) fn; /* an exec: a function of its kernels with the largest frame (NULL: no kernel) */
};

struct sim_galloc {
    uint64_t dptr, bytes;
    unsigned gpu;
    CUgraph graph;    /* NULL once the graph (or the node) is destroyed */
    CUgraphExec exec; /* the instantiation holding it, or NULL */
    bool charged, outstanding, freed_in_graph;
};

static CUresult new_object(void **out, enum sim_rec_kind kind, unsigned gpu, uint64_t size, uint64_t aux)
{
    struct sim_graph_obj *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (sim_put((uint64_t)(uintptr_t)o, kind, gpu, size, aux) != 0) {
        free(o);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = o;
    return CUDA_SUCCESS;
}

/* Node records with their type and the allocation they name (records lock not held). */
static CUresult new_node(CUgraphNode *out, CUgraph graph, unsigned type, uint64_t size, uint64_t dptr)
{
    struct sim_graph_obj *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct vc_map_entry e = {.key = (uint64_t)(uintptr_t)o, .kind = REC_GNODE, .gpu = NO_GPU, .size = size,
                             .aux = (uint64_t)(uintptr_t)graph, .aux2 = dptr, .ctx = type};
    sim_rec_lock();
    int rc = vc_map_put(sim_recs(), &e);
    sim_rec_unlock();
    if (rc != 0) {
        free(o);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = (CUgraphNode)(void *)o;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (phGraph == NULL || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return new_object((void **)phGraph, REC_GRAPH, NO_GPU, 0, 0);
}

static CUresult check_graph(CUgraph g, const CUgraphNode *deps, size_t n)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_find((uint64_t)(uintptr_t)g, REC_GRAPH, NULL, false) || (n > 0 && deps == NULL))
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++)
        if (!sim_find((uint64_t)(uintptr_t)deps[i], REC_GNODE, NULL, false))
            return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static struct sim_galloc *galloc_of(uint64_t dptr)
{
    struct vc_map_entry *e = vc_map_lookup(sim_recs(), dptr, REC_GALLOC);
    return e != NULL ? (struct sim_galloc *)(uintptr_t)e->aux : NULL;
}

static void galloc_uncharge(struct sim_galloc *a)
{
    if (a->charged) {
        a->charged = false;
        g_graph_pool[a->gpu].used -= a->bytes; /* its memory stays reserved in the pool */
    }
}

/* Forgets an allocation nothing holds any more (records lock held). */
static void galloc_settle(struct sim_galloc *a)
{
    if (a->exec == NULL && !a->outstanding)
        galloc_uncharge(a);
    if (a->graph == NULL && a->exec == NULL && !a->outstanding) {
        vc_map_find(sim_recs(), a->dptr, REC_GALLOC, NULL, true);
        free(a);
    }
}

/* A memory allocation node of graph (also what a captured cuMemAllocAsync becomes). */
CUresult sim_graph_alloc_node(CUgraphNode *node, CUgraph graph, unsigned gpu, uint64_t bytes, CUdeviceptr *dptr)
{
    if (((const struct sim_graph_obj *)(void *)graph)->graph != NULL)
        return CUDA_ERROR_INVALID_VALUE; /* a child node's embedded graph takes no memory nodes (cuda.h) */
    uint64_t va = sim_va_alloc(gpu, bytes, SIM_ALLOC_ALIGN);
    struct sim_galloc *a = calloc(1, sizeof(*a));
    if (va == 0 || a == NULL) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *a = (struct sim_galloc){.dptr = va, .bytes = bytes, .gpu = gpu, .graph = graph};
    CUgraphNode n = NULL;
    CUresult rc = new_node(&n, graph, NODE_ALLOC, bytes, va);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    struct vc_map_entry e = {.key = va, .kind = REC_GALLOC, .gpu = gpu, .size = bytes, .aux = (uint64_t)(uintptr_t)a};
    sim_rec_lock();
    int put = vc_map_put(sim_recs(), &e);
    sim_rec_unlock();
    if (put != 0) {
        cuGraphDestroyNode(n);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (node != NULL)
        *node = n;
    *dptr = (CUdeviceptr)va;
    return CUDA_SUCCESS;
}

/* A free node of graph for dptr (also what a captured cuMemFreeAsync becomes). */
CUresult sim_graph_free_node(CUgraphNode *node, CUgraph graph, CUdeviceptr dptr)
{
    if (((const struct sim_graph_obj *)(void *)graph)->graph != NULL)
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    struct sim_galloc *a = galloc_of(dptr);
    bool ok = a != NULL && !a->freed_in_graph;
    if (ok && a->graph == graph)
        a->freed_in_graph = true;
    sim_rec_unlock();
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    CUgraphNode n;
    CUresult rc = new_node(&n, graph, NODE_FREE, 0, dptr);
    if (rc == CUDA_SUCCESS && node != NULL)
        *node = n;
    return rc;
}

/* cuMemFree/cuMemFreeAsync of an allocation a graph launch left live; false if dptr is none. */
bool sim_graph_free(uint64_t dptr)
{
    sim_rec_lock();
    struct sim_galloc *a = galloc_of(dptr);
    bool ok = a != NULL && a->outstanding;
    if (ok) {
        a->outstanding = false;
        galloc_settle(a);
    }
    sim_rec_unlock();
    return ok;
}

SIM_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                           size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    CUresult rc = check_graph(hGraph, dependencies, numDependencies);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (phGraphNode == NULL || nodeParams == NULL || nodeParams->bytesize == 0 ||
        nodeParams->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_node *n;
    if (sim_cu_device(nodeParams->poolProps.location.id, &n) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_graph_alloc_node(phGraphNode, hGraph, (unsigned)nodeParams->poolProps.location.id,
                                nodeParams->bytesize, &nodeParams->dptr);
}

SIM_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                          size_t numDependencies, CUdeviceptr dptr)
{
    CUresult rc = check_graph(hGraph, dependencies, numDependencies);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (phGraphNode == NULL || dptr == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_graph_free_node(phGraphNode, hGraph, dptr);
}

/* Embedded graphs of child nodes that went, destroyed once the records lock is released (orphans_destroy). */
static CUgraph *g_orphans;
static size_t g_orphan_count, g_orphan_room;

/* A node goes (records lock held): its graph's kernel time, its allocation's graph, or its embedded graph. */
static void node_gone(const struct vc_map_entry *e, void *arg)
{
    (void)arg;
    if (e->ctx == NODE_KERNEL && e->size > 0) {
        struct sim_graph_obj *g = (struct sim_graph_obj *)(uintptr_t)e->aux;
        atomic_fetch_sub(&g->kernel_ns, e->size);
        atomic_fetch_sub(&g->kernels, 1);
    } else if (e->ctx == NODE_CHILD) {
        if (g_orphan_count == g_orphan_room) {
            size_t room = g_orphan_room != 0 ? 2 * g_orphan_room : 16;
            CUgraph *grown = realloc(g_orphans, room * sizeof(*grown));
            if (grown == NULL)
                abort(); /* a handful of pointers: the simulated driver's own memory is gone */
            g_orphans = grown;
            g_orphan_room = room;
        }
        g_orphans[g_orphan_count++] = (CUgraph)(uintptr_t)e->aux2;
    } else if (e->ctx == NODE_ALLOC) {
        struct sim_galloc *a = galloc_of(e->aux2);
        if (a != NULL) {
            a->graph = NULL; /* destroying the graph frees nothing an exec or a launch holds */
            galloc_settle(a);
        }
    }
    free((void *)(uintptr_t)e->key);
}

/* Adds a kernel node of ns to graph (records lock not held). */
CUresult sim_graph_kernel_node(CUgraphNode *node, CUgraph graph, uint64_t ns, CUfunction f, uint64_t local)
{
    CUgraphNode n;
    CUresult rc = new_node(&n, graph, NODE_KERNEL, ns, (uint64_t)(uintptr_t)f);
    if (rc == CUDA_SUCCESS) {
        struct sim_graph_obj *g = (struct sim_graph_obj *)(void *)graph;
        atomic_fetch_add(&g->kernel_ns, ns);
        atomic_fetch_add(&g->kernels, 1);
        atomic_store(&((struct sim_graph_obj *)(void *)n)->local, local);
        uint64_t had = atomic_load(&g->local);
        while (local > had && !atomic_compare_exchange_weak(&g->local, &had, local))
            ; /* the graph's largest frame: a removed node leaves it (a driver may keep what it sized) */
        if (node != NULL)
            *node = n;
    }
    return rc;
}

static CUresult add_kernel_node(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps, CUfunction f,
                                unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz)
{
    CUresult rc = check_graph(graph, deps, ndeps);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (node == NULL || !callable(f) || gx == 0 || gy == 0 || gz == 0 ||
        bx == 0 || by == 0 || bz == 0 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    rc = sim_cu_current_device(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t ns = kernel_ns((const struct sim_function *)(void *)f, (unsigned)dev, (uint64_t)gx * gy * gz,
                            (uint64_t)bx * by * bz);
    return sim_graph_kernel_node(node, graph, ns, f, ((const struct sim_function *)(void *)f)->local);
}

SIM_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                         size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
    if (p == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, p->func, p->gridDimX, p->gridDimY,
                           p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ);
}

SIM_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                            size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS *p)
{
    if (p == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUfunction f = p->func != NULL ? p->func : (CUfunction)(void *)p->kern; /* func NULL: the CUkernel */
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, f, p->gridDimX, p->gridDimY,
                           p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ);
}

static bool node_is(const struct vc_map_entry *e, void *node)
{
    return e->key == (uint64_t)(uintptr_t)node;
}

static bool node_of_graph(const struct vc_map_entry *e, void *graph)
{
    return e->aux == (uint64_t)(uintptr_t)graph;
}

static void graph_destroy(CUgraph hGraph);

/* The embedded graphs of the child nodes just removed go too (records lock not held; theirs in turn). */
static void orphans_destroy(void)
{
    for (;;) {
        sim_rec_lock();
        CUgraph g = g_orphan_count > 0 ? g_orphans[--g_orphan_count] : NULL;
        sim_rec_unlock();
        if (g == NULL)
            return;
        if (sim_find((uint64_t)(uintptr_t)g, REC_GRAPH, NULL, true))
            graph_destroy(g);
    }
}

SIM_EXPORT CUresult cuGraphDestroyNode(CUgraphNode hNode)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_find((uint64_t)(uintptr_t)hNode, REC_GNODE, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    vc_map_remove_if(sim_recs(), REC_GNODE, node_is, node_gone, hNode);
    sim_rec_unlock();
    orphans_destroy();
    return CUDA_SUCCESS;
}

/* A graph whose record is removed already: its nodes, and the embedded graphs of its child nodes. */
static void graph_destroy(CUgraph hGraph)
{
    sim_rec_lock();
    vc_map_remove_if(sim_recs(), REC_GNODE, node_of_graph, node_gone, hGraph);
    sim_rec_unlock();
    free(hGraph);
    orphans_destroy();
}

SIM_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    /* A child node's embedded graph is the node's (cuda.h: "the node retains ownership"): it goes with the node. */
    if (!sim_find((uint64_t)(uintptr_t)hGraph, REC_GRAPH, NULL, false) ||
        ((const struct sim_graph_obj *)(void *)hGraph)->graph != NULL ||
        !sim_find((uint64_t)(uintptr_t)hGraph, REC_GRAPH, NULL, true))
        return CUDA_ERROR_INVALID_VALUE;
    graph_destroy(hGraph);
    return CUDA_SUCCESS;
}

/*
 * Child graph nodes.  cuGraphAddChildGraphNode embeds a clone of the child graph (cuda.h: "the child graph is cloned
 * in this call"): its kernel nodes, and its own child nodes' clones in turn; a child graph with memory nodes is
 * refused (cuda.h: allocation and free nodes cannot be in a child graph), CUDA_ERROR_NOT_SUPPORTED.  The node's
 * kernels count in its graph (their time, their largest frame); cuGraphChildGraphNodeGetGraph answers the embedded
 * graph, which goes with the node.
 */
struct node_entries {
    CUgraph graph;
    struct vc_map_entry *entries;
    size_t n, room;
};

static void collect_entry(struct vc_map_entry *e, void *arg)
{
    struct node_entries *l = arg;
    if (e->aux != (uint64_t)(uintptr_t)l->graph)
        return;
    if (l->entries != NULL && l->n < l->room)
        l->entries[l->n] = *e;
    l->n++;
}

/* The node records of graph (malloc'd; NULL with *n 0 for none, or when memory ran out: *n then SIZE_MAX). */
static struct vc_map_entry *graph_entries(CUgraph graph, size_t *n)
{
    for (;;) {
        struct node_entries l = {graph, NULL, 0, 0};
        sim_rec_lock();
        vc_map_each(sim_recs(), REC_GNODE, collect_entry, &l);
        sim_rec_unlock();
        if (l.n == 0) {
            *n = 0;
            return NULL;
        }
        l.room = l.n;
        l.entries = malloc(l.room * sizeof(*l.entries));
        if (l.entries == NULL) {
            *n = SIZE_MAX;
            return NULL;
        }
        l.n = 0;
        sim_rec_lock();
        vc_map_each(sim_recs(), REC_GNODE, collect_entry, &l);
        sim_rec_unlock();
        if (l.n <= l.room) {
            *n = l.n;
            return l.entries;
        }
        free(l.entries); /* nodes were added meanwhile: again */
    }
}

/* Whether graph holds memory allocation or free nodes (1) or not (0); -1 when memory ran out to look. */
static int memory_nodes(CUgraph graph)
{
    size_t n;
    struct vc_map_entry *entries = graph_entries(graph, &n);
    if (n == SIZE_MAX)
        return -1;
    int found = 0;
    for (size_t i = 0; i < n; i++)
        found |= entries[i].ctx == NODE_ALLOC || entries[i].ctx == NODE_FREE;
    free(entries);
    return found;
}

static CUresult add_child_node(CUgraphNode *node, CUgraph parent, CUgraph child, unsigned depth);

/* A clone of graph: its kernel nodes, its child nodes (their embedded graphs cloned in turn). */
static CUresult clone_graph(CUgraph *out, CUgraph graph, unsigned depth)
{
    if (depth > 1024)
        return CUDA_ERROR_NOT_SUPPORTED; /* far beyond any graph a program builds: not simulated */
    int memory = memory_nodes(graph);
    if (memory != 0)
        return memory < 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
    size_t n;
    struct vc_map_entry *entries = graph_entries(graph, &n);
    if (n == SIZE_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUgraph clone = NULL;
    CUresult rc = new_object((void **)&clone, REC_GRAPH, NO_GPU, 0, 0);
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        const struct vc_map_entry *e = &entries[i];
        if (e->ctx == NODE_KERNEL)
            rc = sim_graph_kernel_node(NULL, clone, e->size, (CUfunction)(uintptr_t)e->aux2,
                                       atomic_load(&((const struct sim_graph_obj *)(uintptr_t)e->key)->local));
        else if (e->ctx == NODE_CHILD && sim_find(e->aux2, REC_GRAPH, NULL, false))
            rc = add_child_node(NULL, clone, (CUgraph)(uintptr_t)e->aux2, depth + 1);
    }
    free(entries);
    if (rc != CUDA_SUCCESS) {
        if (clone != NULL && sim_find((uint64_t)(uintptr_t)clone, REC_GRAPH, NULL, true))
            graph_destroy(clone);
        return rc;
    }
    *out = clone;
    return CUDA_SUCCESS;
}

static CUresult add_child_node(CUgraphNode *node, CUgraph parent, CUgraph child, unsigned depth)
{
    CUgraph clone;
    CUresult rc = clone_graph(&clone, child, depth);
    if (rc != CUDA_SUCCESS)
        return rc;
    ((struct sim_graph_obj *)(void *)clone)->graph = parent;
    CUgraphNode n;
    rc = new_node(&n, parent, NODE_CHILD, 0, (uint64_t)(uintptr_t)clone);
    if (rc != CUDA_SUCCESS) {
        if (sim_find((uint64_t)(uintptr_t)clone, REC_GRAPH, NULL, true))
            graph_destroy(clone);
        return rc;
    }
    if (node != NULL)
        *node = n;
    return CUDA_SUCCESS;
}

/* What graph runs, its child nodes' embedded graphs (as they are now) included: the kernels' time, their number, their
 * largest frame; false when memory ran out for the walk. */
struct graph_totals {
    uint64_t ns, local;
    uint32_t kernels;
    CUfunction fn;      /* a kernel of the largest frame of those it runs now */
    uint64_t fn_local;  /* that frame */
};

static bool graph_totals(CUgraph graph, struct graph_totals *t, unsigned depth)
{
    const struct sim_graph_obj *g = (const struct sim_graph_obj *)(void *)graph;
    t->ns += atomic_load(&g->kernel_ns);
    t->kernels += atomic_load(&g->kernels);
    uint64_t local = atomic_load(&g->local);
    if (local > t->local)
        t->local = local;
    if (depth > 1024)
        return false;
    size_t n;
    struct vc_map_entry *entries = graph_entries(graph, &n);
    if (n == SIZE_MAX)
        return false;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        const struct vc_map_entry *e = &entries[i];
        if (e->ctx == NODE_CHILD && sim_find(e->aux2, REC_GRAPH, NULL, false))
            ok = graph_totals((CUgraph)(uintptr_t)e->aux2, t, depth + 1);
        else if (e->ctx == NODE_KERNEL && e->aux2 != 0) {
            uint64_t frame = atomic_load(&((const struct sim_graph_obj *)(uintptr_t)e->key)->local);
            if (t->fn == NULL || frame > t->fn_local) {
                t->fn = (CUfunction)(uintptr_t)e->aux2;
                t->fn_local = frame;
            }
        }
    }
    free(entries);
    return ok;
}

SIM_EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                             size_t numDependencies, CUgraph childGraph)
{
    CUresult rc = check_graph(hGraph, dependencies, numDependencies);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (phGraphNode == NULL || childGraph == hGraph || !sim_find((uint64_t)(uintptr_t)childGraph, REC_GRAPH, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    return add_child_node(phGraphNode, hGraph, childGraph, 0);
}

SIM_EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode hNode, CUgraph *phGraph)
{
    struct vc_map_entry e;
    if (phGraph == NULL || !sim_find((uint64_t)(uintptr_t)hNode, REC_GNODE, &e, false) || e.ctx != NODE_CHILD)
        return CUDA_ERROR_INVALID_VALUE;
    *phGraph = (CUgraph)(uintptr_t)e.aux2;
    return CUDA_SUCCESS;
}

struct instantiation {
    CUgraph graph;
    CUgraphExec exec;
    CUresult rc;
};

/* The graph's allocations become the exec's: charged now (records lock held). */
static void galloc_instantiate(struct vc_map_entry *e, void *arg)
{
    struct instantiation *in = arg;
    struct sim_galloc *a = (struct sim_galloc *)(uintptr_t)e->aux;
    if (in->rc != CUDA_SUCCESS || a->graph != in->graph)
        return;
    if (a->exec != NULL) {
        in->rc = CUDA_ERROR_NOT_SUPPORTED; /* cuda.h: only one instantiation of such a graph at a time */
        return;
    }
    if (!a->charged) {
        struct graph_pool *p = &g_graph_pool[a->gpu];
        uint64_t used = p->used + a->bytes;
        if (used > p->reserved) { /* what the pool's reserved memory cannot give */
            CUresult rc = sim_mem_charge(a->gpu, used - p->reserved);
            if (rc != CUDA_SUCCESS) {
                in->rc = rc;
                return;
            }
            p->reserved = used;
        }
        p->used = used;
        p->used_high = used > p->used_high ? used : p->used_high;
        p->reserved_high = p->reserved > p->reserved_high ? p->reserved : p->reserved_high;
        a->charged = true;
    }
    a->exec = in->exec;
}

/* Undoes galloc_instantiate for a failed instantiation, or an exec destroyed (records lock held). */
static void galloc_release_exec(struct vc_map_entry *e, void *arg)
{
    struct sim_galloc *a = (struct sim_galloc *)(uintptr_t)e->aux;
    if (a->exec == (CUgraphExec)arg) {
        a->exec = NULL;
        galloc_settle(a); /* may remove e: vc_map_each tolerates that (the slot becomes a tombstone) */
    }
}

static CUresult instantiate(CUgraphExec *exec, CUgraph graph)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (exec == NULL || !sim_find((uint64_t)(uintptr_t)graph, REC_GRAPH, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = new_object((void **)exec, REC_GEXEC, NO_GPU, 0, (uint64_t)(uintptr_t)graph);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct graph_totals t = {0, 0, 0, NULL, 0};
    if (!graph_totals(graph, &t, 0)) {
        sim_find((uint64_t)(uintptr_t)*exec, REC_GEXEC, NULL, true);
        free(*exec);
        *exec = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct sim_graph_obj *x = (struct sim_graph_obj *)(void *)*exec;
    atomic_store(&x->kernel_ns, t.ns);
    atomic_store(&x->kernels, t.kernels);
    atomic_store(&x->local, t.local);
    atomic_store(&x->fn, (void *)t.fn);
    x->graph = graph;
    struct instantiation in = {graph, *exec, CUDA_SUCCESS};
    sim_rec_lock();
    vc_map_each(sim_recs(), REC_GALLOC, galloc_instantiate, &in);
    if (in.rc != CUDA_SUCCESS)
        vc_map_each(sim_recs(), REC_GALLOC, galloc_release_exec, *exec);
    sim_rec_unlock();
    if (in.rc != CUDA_SUCCESS) {
        sim_find((uint64_t)(uintptr_t)*exec, REC_GEXEC, NULL, true);
        free(*exec);
        *exec = NULL;
    }
    return in.rc;
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    (void)flags;
    return instantiate(phGraphExec, hGraph);
}

SIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                       char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode, (void)logBuffer, (void)bufferSize;
    return instantiate(phGraphExec, hGraph);
}

SIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                          char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode, (void)logBuffer, (void)bufferSize;
    return instantiate(phGraphExec, hGraph);
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    CUresult rc = instantiate(phGraphExec, hGraph);
    if (instantiateParams != NULL)
        instantiateParams->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    return rc;
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    return cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams);
}

/* After a launch of exec: its allocations without a free node in the graph stay live (records lock held). */
static void galloc_launched(struct vc_map_entry *e, void *arg)
{
    struct sim_galloc *a = (struct sim_galloc *)(uintptr_t)e->aux;
    if (a->exec == (CUgraphExec)arg && !a->freed_in_graph)
        a->outstanding = true;
}

/*
 * An exec launched into a capture becomes a child graph node of the capturing graph, as with a real driver.  Its
 * embedded graph holds the exec's kernels as one kernel node: their total time, and a function of the largest frame
 * (what the stack must grow to when the captured graph runs).
 */
static CUresult captured_exec(CUgraph capture, const struct sim_graph_obj *x)
{
    CUgraph emb = NULL;
    CUresult rc = new_object((void **)&emb, REC_GRAPH, NO_GPU, 0, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    ((struct sim_graph_obj *)(void *)emb)->graph = capture;
    CUfunction fn = (CUfunction)atomic_load(&x->fn);
    if (atomic_load(&x->kernels) > 0 && fn != NULL)
        rc = sim_graph_kernel_node(NULL, emb, atomic_load(&x->kernel_ns), fn, atomic_load(&x->local));
    CUgraphNode n;
    if (rc == CUDA_SUCCESS)
        rc = new_node(&n, capture, NODE_CHILD, 0, (uint64_t)(uintptr_t)emb);
    if (rc != CUDA_SUCCESS && sim_find((uint64_t)(uintptr_t)emb, REC_GRAPH, NULL, true))
        graph_destroy(emb);
    return rc;
}

static CUresult graph_launch(CUgraphExec exec, CUstream stream)
{
    unsigned gpu;
    CUresult rc = sim_stream_device(stream, &gpu);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_find((uint64_t)(uintptr_t)exec, REC_GEXEC, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_graph_obj *x = (const struct sim_graph_obj *)(void *)exec;
    CUgraph capture = sim_stream_capture(stream);
    if (capture != NULL) /* launched into a capture: a child graph node of the capturing graph */
        return captured_exec(capture, x);
    /* Its kernels' largest local frame: the stack grows to it at the launch, as a real driver's (an H200). */
    uint64_t local = atomic_load(&x->local);
    if (local > SIM_DEFAULT_STACK) {
        CUcontext ctx;
        if ((rc = cuStreamGetCtx(stream, &ctx)) != CUDA_SUCCESS ||
            (rc = sim_ctx_stack_at_least(ctx, (size_t)local)) != CUDA_SUCCESS)
            return rc;
    }
    /* Its kernel nodes run back to back: one entry of their total duration. */
    if (atomic_load(&x->kernels) > 0)
        run_on_gpu(gpu, stream, atomic_load(&x->kernel_ns));
    sim_rec_lock();
    vc_map_each(sim_recs(), REC_GALLOC, galloc_launched, exec);
    sim_rec_unlock();
    return CUDA_SUCCESS;
}

/* The graph's nodes (cuda.h: with nodes NULL, their number). */
SIM_EXPORT CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (numNodes == NULL || !sim_find((uint64_t)(uintptr_t)hGraph, REC_GRAPH, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    size_t n;
    struct vc_map_entry *entries = graph_entries(hGraph, &n);
    if (n == SIZE_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (nodes != NULL) {
        if (n > *numNodes)
            n = *numNodes;
        for (size_t i = 0; i < n; i++)
            nodes[i] = (CUgraphNode)(uintptr_t)entries[i].key;
    }
    free(entries);
    *numNodes = n;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type)
{
    struct vc_map_entry e;
    if (type == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)hNode, REC_GNODE, &e, false))
        return CUDA_ERROR_INVALID_VALUE;
    *type = e.ctx == NODE_KERNEL  ? CU_GRAPH_NODE_TYPE_KERNEL
            : e.ctx == NODE_ALLOC ? CU_GRAPH_NODE_TYPE_MEM_ALLOC
            : e.ctx == NODE_CHILD ? CU_GRAPH_NODE_TYPE_GRAPH
                                  : CU_GRAPH_NODE_TYPE_MEM_FREE;
    return CUDA_SUCCESS;
}

/* A kernel node's function (NULL for a graph launched into a capture: its kernels are one node here). */
SIM_EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS *nodeParams)
{
    struct vc_map_entry e;
    if (nodeParams == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_find((uint64_t)(uintptr_t)hNode, REC_GNODE, &e, false) || e.ctx != NODE_KERNEL)
        return CUDA_ERROR_INVALID_VALUE;
    memset(nodeParams, 0, sizeof(*nodeParams));
    nodeParams->func = (CUfunction)(uintptr_t)e.aux2;
    nodeParams->gridDimX = nodeParams->gridDimY = nodeParams->gridDimZ = 1;
    nodeParams->blockDimX = nodeParams->blockDimY = nodeParams->blockDimZ = 1;
    return CUDA_SUCCESS;
}

/* An exec's kernels' largest frame rises to local (its launches grow the stack to it). */
static void exec_frame_at_least(CUgraphExec exec, uint64_t local, CUfunction fn)
{
    struct sim_graph_obj *x = (struct sim_graph_obj *)(void *)exec;
    uint64_t had = atomic_load(&x->local);
    while (local > had && !atomic_compare_exchange_weak(&x->local, &had, local))
        ;
    if (fn != NULL && (local > had || atomic_load(&x->fn) == NULL))
        atomic_store(&x->fn, (void *)fn); /* the function a launch into a capture names */
}

/* A kernel node of an exec runs function (or CUkernel) f from now on (its frame counts at the exec's next launches). */
static CUresult exec_kernel_node_set(CUgraphExec hGraphExec, CUgraphNode hNode, CUfunction f)
{
    struct vc_map_entry e;
    if (!sim_find((uint64_t)(uintptr_t)hGraphExec, REC_GEXEC, NULL, false) ||
        !sim_find((uint64_t)(uintptr_t)hNode, REC_GNODE, &e, false) || e.ctx != NODE_KERNEL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!callable(f))
        return CUDA_ERROR_INVALID_HANDLE;
    exec_frame_at_least(hGraphExec, ((const struct sim_function *)(void *)f)->local, f);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                      const CUDA_KERNEL_NODE_PARAMS *nodeParams)
{
    if (nodeParams == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return exec_kernel_node_set(hGraphExec, hNode,
                                nodeParams->func != NULL ? nodeParams->func : (CUfunction)nodeParams->kern);
}

/* The CUDA 10-11 entry point: a function only (no CUkernel). */
SIM_EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                   const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    if (nodeParams == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return exec_kernel_node_set(hGraphExec, hNode, nodeParams->func);
}

/*
 * A node of an exec given new parameters of its own type (CUDA 12.2).  Kernel nodes take another function, as
 * above; the simulated graphs' other nodes (memory allocations and frees) cannot be changed in an exec, as in the
 * driver, and a type that is not the node's is refused, both with CUDA_ERROR_INVALID_VALUE.
 */
static CUresult exec_child_node_set(CUgraphExec hGraphExec, CUgraphNode hNode, CUgraph childGraph);

SIM_EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode, CUgraphNodeParams *nodeParams)
{
    struct vc_map_entry e;
    if (nodeParams == NULL || !sim_find((uint64_t)(uintptr_t)hNode, REC_GNODE, &e, false))
        return CUDA_ERROR_INVALID_VALUE;
    if (nodeParams->type == CU_GRAPH_NODE_TYPE_GRAPH && e.ctx == NODE_CHILD)
        return exec_child_node_set(hGraphExec, hNode, nodeParams->graph.graph);
    if (nodeParams->type != CU_GRAPH_NODE_TYPE_KERNEL || e.ctx != NODE_KERNEL)
        return CUDA_ERROR_INVALID_VALUE;
    const CUDA_KERNEL_NODE_PARAMS_v3 *k = &nodeParams->kernel;
    return exec_kernel_node_set(hGraphExec, hNode, k->func != NULL ? k->func : (CUfunction)k->kern);
}

/*
 * A child node of an exec runs another graph's kernels from now on (their largest frame counts at the exec's next
 * launches; their time is not taken over).  The graph must hold no memory nodes, as for cuGraphAddChildGraphNode.
 */
static CUresult exec_child_node_set(CUgraphExec hGraphExec, CUgraphNode hNode, CUgraph childGraph)
{
    struct vc_map_entry e;
    if (!sim_find((uint64_t)(uintptr_t)hGraphExec, REC_GEXEC, NULL, false) ||
        !sim_find((uint64_t)(uintptr_t)hNode, REC_GNODE, &e, false) || e.ctx != NODE_CHILD ||
        !sim_find((uint64_t)(uintptr_t)childGraph, REC_GRAPH, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    int memory = memory_nodes(childGraph);
    struct graph_totals t = {0, 0, 0, NULL, 0};
    if (memory < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (memory > 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!graph_totals(childGraph, &t, 0))
        return CUDA_ERROR_OUT_OF_MEMORY;
    exec_frame_at_least(hGraphExec, t.local, t.fn);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode, CUgraph childGraph)
{
    return exec_child_node_set(hGraphExec, hNode, childGraph);
}

/* An exec takes a graph's kernels (their time and largest frame); a graph with memory nodes cannot be taken. */
static CUresult exec_update(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResult *result)
{
    *result = CU_GRAPH_EXEC_UPDATE_ERROR;
    if (!sim_find((uint64_t)(uintptr_t)hGraphExec, REC_GEXEC, NULL, false) ||
        !sim_find((uint64_t)(uintptr_t)hGraph, REC_GRAPH, NULL, false))
        return CUDA_ERROR_INVALID_VALUE;
    int memory = memory_nodes(hGraph);
    struct sim_graph_obj *x = (struct sim_graph_obj *)(void *)hGraphExec;
    if (memory < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (memory > 0) {
        *result = CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED;
        return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    }
    struct graph_totals t = {0, 0, 0, NULL, 0};
    if (!graph_totals(hGraph, &t, 0))
        return CUDA_ERROR_OUT_OF_MEMORY;
    atomic_store(&x->kernel_ns, t.ns);
    atomic_store(&x->kernels, t.kernels);
    exec_frame_at_least(hGraphExec, t.local, t.fn);
    *result = CU_GRAPH_EXEC_UPDATE_SUCCESS;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResultInfo *resultInfo)
{
    CUgraphExecUpdateResult result;
    CUresult rc = exec_update(hGraphExec, hGraph, &result);
    if (resultInfo != NULL && rc != CUDA_ERROR_INVALID_VALUE) {
        memset(resultInfo, 0, sizeof(*resultInfo));
        resultInfo->result = result;
    }
    return rc;
}

/* The CUDA 10.2-11 entry point: the result and the node it failed at (none here) through two pointers. */
SIM_EXPORT CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
                                      CUgraphExecUpdateResult *updateResult_out)
{
    CUgraphExecUpdateResult result;
    CUresult rc = exec_update(hGraphExec, hGraph, &result);
    if (hErrorNode_out != NULL)
        *hErrorNode_out = NULL;
    if (updateResult_out != NULL)
        *updateResult_out = result;
    return rc;
}

SIM_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraph, CUstream hStream)
{
    return graph_launch(hGraph, hStream);
}

SIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream);
}

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    if (sim_cu_node() == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!sim_find((uint64_t)(uintptr_t)hGraphExec, REC_GEXEC, NULL, true))
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    vc_map_each(sim_recs(), REC_GALLOC, galloc_release_exec, hGraphExec);
    sim_rec_unlock();
    free(hGraphExec);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value)
{
    const struct sim_node *n;
    CUresult rc = sim_cu_device(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    const struct graph_pool *p = &g_graph_pool[device];
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = p->used; break;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = p->used_high; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = p->reserved; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = p->reserved_high; break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    sim_rec_unlock();
    return rc;
}

/* cuda.h: only the high-water marks can be set, and only to 0 (they restart from the current values). */
SIM_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value)
{
    const struct sim_node *n;
    CUresult rc = sim_cu_device(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (value == NULL || *(const cuuint64_t *)value != 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_rec_lock();
    struct graph_pool *p = &g_graph_pool[device];
    if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)
        p->used_high = p->used;
    else if (attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)
        p->reserved_high = p->reserved;
    else
        rc = CUDA_ERROR_INVALID_VALUE;
    sim_rec_unlock();
    return rc;
}

/* The pool's reserved memory no graph allocation uses goes back to the device. */
SIM_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    const struct sim_node *n;
    CUresult rc = sim_cu_device(device, &n);
    if (rc != CUDA_SUCCESS)
        return rc;
    sim_rec_lock();
    struct graph_pool *p = &g_graph_pool[device];
    uint64_t unused = p->reserved - p->used;
    p->reserved = p->used;
    sim_rec_unlock();
    if (unused > 0)
        sim_mem_uncharge((unsigned)device, unused);
    return CUDA_SUCCESS;
}
