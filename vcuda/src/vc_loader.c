/*
 * Finding and opening the real libcuda and libnvidia-ml, resolving their
 * functions on first use, and the pointer-identity table that swaps the real
 * functions cuGetProcAddress hands out for our hooks.
 *
 * The real libraries are found next to this library's own file (dladdr), as
 * gpu-manager's driver mirror lays them out: we are libcuda.so.1 /
 * libnvidia-ml.so.1 (and the unversioned links), the driver's files keep
 * their full names, libcuda.so.<driver version> and
 * libnvidia-ml.so.<driver version>.  The newest such file that is not this
 * library itself is taken.  VCUDA_LIBCUDA / VCUDA_LIBNVML name them
 * explicitly (tests, unusual layouts).  /proc/driver/nvidia/version is never
 * read.
 */
#include "vc_internal.h"

#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

_Atomic(void *) vc_cu_table[VC_CU_COUNT];
_Atomic(void *) vc_nvml_table[VC_NVML_COUNT];

/* What a call of a function the real library lacks returns. */
static CUresult missing_cu(void)
{
    return CUDA_ERROR_NOT_FOUND;
}

static nvmlReturn_t missing_nvml(void)
{
    return NVML_ERROR_FUNCTION_NOT_FOUND;
}

static const char *missing_string(void)
{
    return "";
}

/* Is name "<prefix><digits>(.<digits>)+"?  Then *ver receives up to 4 numeric components. */
static bool versioned_name(const char *name, const char *prefix, unsigned long ver[4])
{
    size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0)
        return false;
    const char *p = name + n;
    int parts = 0;
    memset(ver, 0, 4 * sizeof(ver[0]));
    for (;;) {
        if (*p < '0' || *p > '9')
            return false;
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (parts < 4)
            ver[parts] = v;
        parts++;
        p = end;
        if (*p == '\0')
            return parts >= 2;
        if (*p != '.')
            return false;
        p++;
    }
}

/* The newest <our dir>/<prefix><version> that is not this library's own file; false if none. */
static bool find_next_to_self(const char *prefix, char *out, size_t outlen)
{
    Dl_info info;
    struct stat self;
    if (dladdr((void *)&find_next_to_self, &info) == 0 || info.dli_fname == NULL || stat(info.dli_fname, &self) != 0)
        return false;
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", info.dli_fname);
    char *slash = strrchr(dir, '/');
    if (slash == NULL)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    DIR *d = opendir(dir);
    if (d == NULL)
        return false;
    unsigned long best[4] = {0, 0, 0, 0};
    bool found = false;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        unsigned long ver[4];
        if (!versioned_name(e->d_name, prefix, ver))
            continue;
        char path[PATH_MAX + 256];
        struct stat sb;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode) || (sb.st_dev == self.st_dev && sb.st_ino == self.st_ino))
            continue;
        bool newer = !found;
        for (int i = 0; i < 4 && !newer; i++) {
            if (ver[i] != best[i]) {
                newer = ver[i] > best[i];
                break;
            }
        }
        if (!newer)
            continue;
        memcpy(best, ver, sizeof(best));
        snprintf(out, outlen, "%s", path);
        found = true;
    }
    closedir(d);
    return found;
}

/*
 * Loader identity.  The real library's soname (libcuda.so.1, libnvidia-ml.so.1) must never answer
 * a later dlopen of the process: the dynamic linker matches a requested name against the names and
 * sonames of the objects already loaded, in load order.  Our own soname is libcuda.so.1 and we are
 * always loaded before the real library, so "libcuda.so.1" finds us first.  For the other name we
 * make the loader attach it to us before the real library exists: a dlopen of the bare name, which
 * searches the path (LD_LIBRARY_PATH: the mirror), finds our own file under that name and adds the
 * name to our object.  If the search does not lead to us (the mirror is not on the search path),
 * the real library is opened in a link-map namespace of its own (dlmopen), where the process's
 * lookups never see it.  Returns whether `soname` now names this library.
 */
static bool claim_name(const char *soname, void *own_symbol)
{
    void *h = dlopen(soname, RTLD_LAZY | RTLD_LOCAL);
    if (h == NULL) {
        vc_log(VC_LOG_INFO, "%s is not found on the search path: the real library goes to a namespace of its own",
               soname);
        return false;
    }
    bool ours = dlsym(h, "cuGetErrorString") == own_symbol;
    if (!ours) {
        vc_log(VC_LOG_INFO, "%s resolves to another library: the real library goes to a namespace of its own", soname);
        dlclose(h);
    }
    return ours; /* our handle stays open: we are never unloaded (-z nodelete) anyway */
}

static void *open_real(const char *what, const char *env, const char *prefix, const char *soname)
{
    char path[PATH_MAX + 256];
    const char *override = getenv(env);
    if (override != NULL && override[0] != '\0' && vc_env_locked()) {
        /* In a container given limits the environment is the tenant's: the driver is the one next to us. */
        vc_log(VC_LOG_ERROR, "%s=%s: ignored in a container given limits; using the %s next to this library", env,
               override, what);
        override = NULL;
    }
    if (override != NULL && override[0] != '\0') {
        snprintf(path, sizeof(path), "%s", override);
    } else if (!find_next_to_self(prefix, path, sizeof(path))) {
        vc_log(VC_LOG_ERROR,
               "cannot find the real %s: no %s<driver version> next to this library (set %s to its path); "
               "every %s call fails",
               what, prefix, env, what);
        return NULL;
    }
    void *h;
    if (claim_name(soname, (void *)&cuGetErrorString))
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    else
        h = dlmopen(LM_ID_NEWLM, path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (h == NULL)
        vc_log(VC_LOG_ERROR, "cannot open the real %s %s: %s", what, path, dlerror());
    else
        vc_log(VC_LOG_INFO, "real %s: %s", what, path);
    return h;
}

static pthread_once_t g_cu_once = PTHREAD_ONCE_INIT, g_nvml_once = PTHREAD_ONCE_INIT;
static void *g_cu_handle, *g_nvml_handle; /* written once inside their pthread_once */

static void open_cu(void)
{
    g_cu_handle = open_real("libcuda", "VCUDA_LIBCUDA", "libcuda.so.", "libcuda.so.1");
}

static void open_nvml(void)
{
    g_nvml_handle = open_real("libnvidia-ml", "VCUDA_LIBNVML", "libnvidia-ml.so.", "libnvidia-ml.so.1");
}

void *vc_resolve_cu(unsigned index)
{
    pthread_once(&g_cu_once, open_cu);
    void *p = g_cu_handle != NULL ? dlsym(g_cu_handle, vc_cu_names[index]) : NULL;
    if (p == NULL) {
        vc_log(VC_LOG_INFO, "the real libcuda has no %s", vc_cu_names[index]);
        p = (void *)&missing_cu;
    }
    atomic_store_explicit(&vc_cu_table[index], p, memory_order_release);
    return p;
}

void *vc_resolve_nvml(unsigned index)
{
    pthread_once(&g_nvml_once, open_nvml);
    void *p = g_nvml_handle != NULL ? dlsym(g_nvml_handle, vc_nvml_names[index]) : NULL;
    if (p == NULL) {
        vc_log(VC_LOG_INFO, "the real libnvidia-ml has no %s", vc_nvml_names[index]);
        p = vc_nvml_ret_kind[index] == VC_RET_PTR ? (void *)&missing_string : (void *)&missing_nvml;
    }
    atomic_store_explicit(&vc_nvml_table[index], p, memory_order_release);
    return p;
}

/* ---- pointer identity: real function -> our hook ------------------------------ */

#define SWAP_SLOTS 2048u /* power of two, well above 2 x the number of hook keys */

struct swap_entry {
    void *real;
    void *wrapper;
};

static struct swap_entry g_swap[SWAP_SLOTS]; /* filled once inside g_swap_once, read-only afterwards */
static pthread_once_t g_swap_once = PTHREAD_ONCE_INIT;

static size_t swap_slot(const void *p)
{
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 40) & (SWAP_SLOTS - 1);
}

static void swap_add(void *real, void *wrapper)
{
    if (real == NULL || real == (void *)&missing_cu)
        return;
    for (size_t i = swap_slot(real), n = 0; n < SWAP_SLOTS; i = (i + 1) & (SWAP_SLOTS - 1), n++) {
        if (g_swap[i].real == real)
            return; /* first mapping wins: the exported symbol's own */
        if (g_swap[i].real == NULL) {
            g_swap[i] = (struct swap_entry){real, wrapper};
            return;
        }
    }
}

static void *wrapper_of(unsigned index)
{
    for (unsigned i = 0; i < vc_cu_hooks_len; i++)
        if (vc_cu_hooks[i].index == index)
            return vc_cu_hooks[i].wrapper;
    return NULL;
}

static void build_swap(void)
{
    /* 1. The real library's exported hooked symbols. */
    for (unsigned i = 0; i < vc_cu_hooks_len; i++)
        swap_add(vc_real_cu(vc_cu_hooks[i].index), vc_cu_hooks[i].wrapper);
    /*
     * 2. What the real cuGetProcAddress answers for each key of a hooked symbol, in case a driver
     * hands out pointers it does not export.  Only versions the driver has: for those the answer
     * is exactly that ABI (a newer key would get an older ABI, which must not meet our newer hook).
     */
    int driver = 0;
    CUresult (*get_version)(int *) = (CUresult(*)(int *))vc_real_cu(VC_CU_cuDriverGetVersion);
    if (get_version(&driver) != CUDA_SUCCESS)
        return;
    CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        (__typeof__(gpa))vc_real_cu(VC_CU_cuGetProcAddress_v2);
    for (unsigned i = 0; i < vc_cu_hook_keys_len; i++) {
        const struct vc_proc_key *k = &vc_cu_hook_keys[i];
        if (k->version > driver)
            continue;
        void *p = NULL;
        CUdriverProcAddressQueryResult st;
        cuuint64_t flags = k->per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
        if (gpa(k->base, &p, k->version > 0 ? k->version : driver, flags, &st) == CUDA_SUCCESS && p != NULL)
            swap_add(p, wrapper_of(k->index));
    }
}

void *vc_swap_proc(void *p)
{
    pthread_once(&g_swap_once, build_swap);
    for (size_t i = swap_slot(p), n = 0; n < SWAP_SLOTS; i = (i + 1) & (SWAP_SLOTS - 1), n++) {
        if (g_swap[i].real == p)
            return g_swap[i].wrapper;
        if (g_swap[i].real == NULL)
            return p;
    }
    return p;
}
