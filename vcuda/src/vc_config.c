/*
 * Configuration, read once when the library is loaded: LOGGER_LEVEL and the
 * container's vcuda.config.  See README.md "Configuration" for the lookup
 * order; no helper process, no cgroup parsing, no fork.
 */
#include "vc_internal.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

_Atomic int vc_log_level = 3;
_Atomic bool vc_limit_on;
_Atomic bool vc_core_on;
_Atomic bool vc_cuda_refused;

/* Written only by the constructor, before any other thread can call into the library. */
static uint64_t g_limit;
#define DEFAULT_CONTEXT_RESERVE (256ull << 20)
static uint64_t g_context_reserve = DEFAULT_CONTEXT_RESERVE;
static char g_budget_name[256];
static struct vc_core_config g_core;
static char g_pids_path[PATH_MAX];
static char g_budget_dir[PATH_MAX];

/*
 * The container's environment is its tenant's: it can set any variable before the library loads.  Where the
 * agent's read-only mount holds a config (g_locked), nothing that bears on the limits is taken from the
 * environment: the config must be one in the mount, the budget file is in its fixed directory, the SM algorithm
 * is the default and a context is reserved at least the default (README.md "Configuration").  A build with the
 * test-only hooks (-DVC_TEST_HOOKS) takes stand-ins for the mount and the budget directory from the test
 * harness; a shipped library has none.
 */
#define VC_CONFIG_ROOT "/etc/vcuda"
#define VC_BUDGET_DIR "/dev/shm/vcuda"
static bool g_locked;
#ifdef VC_TEST_HOOKS
static const char *test_or(const char *name, const char *fixed)
{
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0' ? v : fixed;
}
#define FIXED_ROOT() test_or("VCUDA_TEST_CONFIG_ROOT", VC_CONFIG_ROOT)
#define FIXED_BUDGET_DIR() test_or("VCUDA_TEST_BUDGET_DIR", VC_BUDGET_DIR)
#else
#define FIXED_ROOT() VC_CONFIG_ROOT
#define FIXED_BUDGET_DIR() VC_BUDGET_DIR
#endif

const struct vc_core_config *vc_core_config(void)
{
    return &g_core;
}

const char *vc_pids_path(void)
{
    return g_pids_path;
}

size_t vc_read_from_start(int fd, void *buf, size_t room)
{
    size_t got = 0;
    while (got < room) {
        ssize_t r = pread(fd, (char *)buf + got, room - got, (off_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    return got;
}

uint64_t vc_limit_bytes(void)
{
    return g_limit;
}

uint64_t vc_context_reserve(void)
{
    return g_context_reserve;
}

const char *vc_budget_name(void)
{
    return g_budget_name;
}

const char *vc_budget_dir(void)
{
    return g_budget_dir;
}

bool vc_env_locked(void)
{
    return g_locked;
}

void vc_log_write(int level, const char *fmt, ...)
{
    char buf[1024];
    static const char *const names[] = {"", "", "ERROR", "WARN", "INFO", "DEBUG"};
    const char *name = level >= 0 && level <= VC_LOG_DEBUG ? names[level] : "TRACE";
    int n = snprintf(buf, sizeof(buf), "vcuda[%d] %s: ", (int)getpid(), name);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof(buf))
        vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = strnlen(buf, sizeof(buf) - 2);
    buf[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, len); /* one write: lines of concurrent processes do not mix */
    (void)w;
}

/* "123", "64k", "256M", "2g" (powers of 1024); false if malformed. */
static bool parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || errno != 0)
        return false;
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    default: break;
    }
    if (*end != '\0' || (shift && v > (UINT64_MAX >> shift)))
        return false;
    *out = (uint64_t)v << shift;
    return true;
}

/* ---- vcuda.config ---------------------------------------------------------------- */

enum load_result { CFG_MISSING, CFG_BAD, CFG_OK };

/*
 * The first config file found that exists but cannot be used, and why ("<path>: <what is wrong>"); set by the
 * constructor.  When no usable config follows it in the lookup order, CUDA is refused (fail closed): a container
 * given a share must never run without its limits.
 */
static char g_bad[PATH_MAX + 256];

static enum load_result bad_config(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static enum load_result bad_config(const char *path, const char *fmt, ...)
{
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    vc_log(VC_LOG_ERROR, "%s: %s; ignoring it", path, why);
    if (g_bad[0] == '\0')
        snprintf(g_bad, sizeof(g_bad), "%s: %s", path, why);
    return CFG_BAD;
}

/* The fields a limit is made of, in their ranges (gpu-manager writes nothing else); false: cfg cannot be used. */
static enum load_result check_fields(const char *path, const struct vc_resource_data *cfg)
{
    if (cfg->enable != 0 && cfg->enable != 1)
        return bad_config(path, "enable = %d (expected 0 or 1)", cfg->enable);
    if (cfg->enable == 0)
        return CFG_OK; /* pass-through: the other fields are not used */
    if (cfg->utilization < 0 || cfg->utilization > 100)
        return bad_config(path, "utilization = %d (expected 0 to 100, the vcuda-core percent)", cfg->utilization);
    if (cfg->hard_limit != 0 && cfg->hard_limit != 1)
        return bad_config(path, "hard_limit = %d (expected 0 or 1)", cfg->hard_limit);
    if (cfg->gpu_memory > (uint64_t)INT64_MAX)
        return bad_config(path, "gpu_memory = %llu (a negative size as written; expected bytes)",
                          (unsigned long long)cfg->gpu_memory);
    return CFG_OK;
}

static enum load_result load_config(const char *path, struct vc_resource_data *cfg)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return CFG_MISSING;
        return bad_config(path, "cannot open the vcuda config: %s", strerror(errno));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return bad_config(path, "not a regular file");
    }
    if (sb.st_size != (off_t)sizeof(*cfg)) {
        close(fd);
        return bad_config(path,
                          "%lld bytes, expected %zu (gpu-manager's resource_data_t: an agent of another version, or a "
                          "partly written file?)",
                          (long long)sb.st_size, sizeof(*cfg));
    }
    ssize_t n = read(fd, cfg, sizeof(*cfg));
    close(fd);
    if (n != (ssize_t)sizeof(*cfg))
        return bad_config(path, "short read (%zd of %zu bytes)", n, sizeof(*cfg));
    cfg->pod_uid[sizeof(cfg->pod_uid) - 1] = '\0';
    cfg->container_name[sizeof(cfg->container_name) - 1] = '\0';
    return check_fields(path, cfg);
}

/*
 * cuInit: refused when the container's config exists but cannot be used (fail closed, README.md
 * "Configuration"); every other driver call then answers CUDA_ERROR_NOT_INITIALIZED, as before any cuInit.
 */
VC_EXPORT CUresult cuInit(unsigned int Flags)
{
    if (VC_UNLIKELY(vc_refused())) {
        vc_log(VC_LOG_ERROR, "%s: this container's GPU limits cannot be applied: CUDA is refused (cuInit fails with "
               "CUDA_ERROR_NOT_PERMITTED); the agent must rewrite the file", g_bad);
        return CUDA_ERROR_NOT_PERMITTED;
    }
    return REAL_CU(cuInit)(Flags);
}

/* Is the directory name d part of this process's cgroup paths (the container id of upstream's layout)? */
static bool in_own_cgroup(const char *d)
{
    char buf[8192];
    int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0 || strlen(d) < 12) /* container ids are long; short names would match by accident */
        return false;
    buf[n] = '\0';
    return strstr(buf, d) != NULL;
}

/*
 * Upstream's per-container layout, <root>/<container id>/vcuda.config, without
 * the upstream helper: the subdirectory whose name is in /proc/self/cgroup, or
 * else the only subdirectory holding a config.
 */
static enum load_result load_from_subdirs(const char *root, struct vc_resource_data *cfg, char *used, size_t usedlen)
{
    DIR *d = opendir(root);
    if (d == NULL)
        return CFG_MISSING;
    char only[PATH_MAX] = "", matched[PATH_MAX] = "";
    int count = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char path[PATH_MAX];
        struct stat sb;
        if ((size_t)snprintf(path, sizeof(path), "%s/%s/vcuda.config", root, e->d_name) >= sizeof(path) ||
            stat(path, &sb) != 0)
            continue;
        count++;
        snprintf(only, sizeof(only), "%s", path);
        if (matched[0] == '\0' && in_own_cgroup(e->d_name))
            snprintf(matched, sizeof(matched), "%s", path);
    }
    closedir(d);
    const char *pick = matched[0] ? matched : (count == 1 ? only : NULL);
    if (pick == NULL) {
        if (count > 1)
            vc_log(VC_LOG_WARN, "%s holds %d container configs and none matches this container; set VCUDA_CONFIG_PATH",
                   root, count);
        return CFG_MISSING;
    }
    snprintf(used, usedlen, "%s", pick);
    return load_config(pick, cfg);
}

/* Whether root holds a vcuda.config: at its top or in a directory of its own (the agent's and upstream's layouts). */
static bool holds_config(const char *root)
{
    char path[PATH_MAX];
    struct stat sb;
    if ((size_t)snprintf(path, sizeof(path), "%s/vcuda.config", root) < sizeof(path) && stat(path, &sb) == 0)
        return true;
    DIR *d = opendir(root);
    if (d == NULL)
        return false;
    bool found = false;
    struct dirent *e;
    while (!found && (e = readdir(d)) != NULL)
        found = e->d_name[0] != '.' &&
                (size_t)snprintf(path, sizeof(path), "%s/%s/vcuda.config", root, e->d_name) < sizeof(path) &&
                stat(path, &sb) == 0;
    closedir(d);
    return found;
}

/*
 * Whether path, resolved (no .., no symbolic link out), is root's vcuda.config or the vcuda.config of a directory
 * in root; what it resolves to in resolved ("" when it does not resolve).
 */
static bool in_root(const char *path, const char *root, char resolved[PATH_MAX])
{
    char rr[PATH_MAX];
    resolved[0] = '\0';
    if (realpath(path, resolved) == NULL) {
        resolved[0] = '\0';
        return false;
    }
    if (realpath(root, rr) == NULL)
        return false;
    size_t n = strcmp(rr, "/") == 0 ? 0 : strlen(rr);
    if (strncmp(resolved, rr, n) != 0 || resolved[n] != '/')
        return false;
    const char *rest = resolved + n + 1, *slash = strchr(rest, '/');
    if (slash == NULL)
        return strcmp(rest, "vcuda.config") == 0;
    return slash > rest && strcmp(slash + 1, "vcuda.config") == 0;
}

/*
 * Whether name can only be a container id: 32 hex digits or more (a Kubernetes container name that long and all
 * hex could still occur, but not as a part of its own cgroup path, which holds its id and its pod's dashed UID).
 */
static bool id_like(const char *name)
{
    size_t n = 0;
    for (; name[n] != '\0'; n++)
        if (!isxdigit((unsigned char)name[n]))
            return false;
    return n >= 32;
}

/*
 * Whether resolved (a config in root) lies in a directory of root other than the one of this container's id
 * (upstream's layout: the directory whose name, a container id, is in /proc/self/cgroup), when root has one.
 */
static bool another_containers(const char *resolved, const char *root)
{
    DIR *d = opendir(root);
    if (d == NULL)
        return false;
    char own[PATH_MAX] = "", path[PATH_MAX];
    struct dirent *e;
    while (own[0] == '\0' && (e = readdir(d)) != NULL) {
        struct stat sb;
        if (e->d_name[0] != '.' &&
            (size_t)snprintf(path, sizeof(path), "%s/%s/vcuda.config", root, e->d_name) < sizeof(path) &&
            stat(path, &sb) == 0 && id_like(e->d_name) && in_own_cgroup(e->d_name) && realpath(path, own) == NULL)
            own[0] = '\0';
    }
    closedir(d);
    return own[0] != '\0' && strcmp(own, resolved) != 0;
}

/* Whether a and b name the same directory. */
static bool same_dir(const char *a, const char *b)
{
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/*
 * The lookup order of README.md; returns CFG_OK with the path in used, or CFG_MISSING.  Where the mount holds
 * a config (g_locked), VCUDA_CONFIG_PATH must name one in it and VCUDA_CONFIG_ROOT is not taken; when none of
 * its configs is this container's, CUDA is refused (g_bad) rather than run without limits.
 */
static enum load_result find_config(struct vc_resource_data *cfg, char *used, size_t usedlen)
{
    const char *fixed = FIXED_ROOT();
    g_locked = holds_config(fixed);
    const char *explicit_path = getenv("VCUDA_CONFIG_PATH");
    if (explicit_path != NULL && explicit_path[0] != '\0') {
        char resolved[PATH_MAX];
        if (g_locked && !in_root(explicit_path, fixed, resolved)) {
            if (resolved[0] == '\0')
                vc_log(VC_LOG_WARN, "VCUDA_CONFIG_PATH=%s does not exist; trying the upstream layouts in %s",
                       explicit_path, fixed);
            else
                vc_log(VC_LOG_ERROR, "VCUDA_CONFIG_PATH=%s: ignored: it resolves to %s, not to a vcuda.config in %s "
                       "(the container's read-only mount, which holds its config); trying the layouts there",
                       explicit_path, resolved, fixed);
        } else if (g_locked && another_containers(resolved, fixed)) {
            vc_log(VC_LOG_ERROR, "VCUDA_CONFIG_PATH=%s: ignored: another container's config, this container's "
                   "directory in %s is the one named in /proc/self/cgroup", explicit_path, fixed);
        } else {
            enum load_result r = load_config(explicit_path, cfg);
            if (r == CFG_OK) {
                snprintf(used, usedlen, "%s", explicit_path);
                return r;
            }
            if (r == CFG_MISSING)
                vc_log(VC_LOG_WARN, "VCUDA_CONFIG_PATH=%s does not exist; trying the upstream layouts",
                       explicit_path);
        }
    }
    const char *root = getenv("VCUDA_CONFIG_ROOT");
    if (root == NULL || root[0] == '\0') {
        root = fixed;
    } else if (g_locked && !same_dir(root, fixed)) {
        vc_log(VC_LOG_ERROR, "VCUDA_CONFIG_ROOT=%s: ignored: the configs of this container are in %s (its "
               "read-only mount)", root, fixed);
        root = fixed;
    }
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/vcuda.config", root);
    enum load_result r = load_config(path, cfg);
    if (r == CFG_OK) {
        snprintf(used, usedlen, "%s", path);
        return r;
    }
    if (load_from_subdirs(root, cfg, used, usedlen) == CFG_OK)
        return CFG_OK;
    if (g_locked && g_bad[0] == '\0')
        snprintf(g_bad, sizeof(g_bad), "%s: holds vcuda configs, none of them this container's (the one the "
                 "agent's VCUDA_CONFIG_PATH names)", root);
    return CFG_MISSING;
}

/* The budget file's directory: the fixed one where the mount holds a config, else VCUDA_BUDGET_DIR if set. */
static void budget_dir(void)
{
    const char *fixed = FIXED_BUDGET_DIR(), *dir = getenv("VCUDA_BUDGET_DIR");
    if (dir == NULL || dir[0] == '\0') {
        dir = fixed;
    } else if (g_locked && strcmp(dir, fixed) != 0) {
        vc_log(VC_LOG_ERROR, "VCUDA_BUDGET_DIR=%s: ignored: the budget of a container given limits is in %s, shared "
               "by all its processes", dir, fixed);
        dir = fixed;
    }
    snprintf(g_budget_dir, sizeof(g_budget_dir), "%s", dir);
}

static void sanitize(char *dst, size_t len, const char *src)
{
    size_t j = 0;
    for (size_t i = 0; src[i] != '\0' && j + 1 < len; i++) {
        unsigned char c = (unsigned char)src[i];
        dst[j++] = (char)(isalnum(c) || c == '-' || c == '.' ? c : '_');
    }
    dst[j] = '\0';
}

/*
 * The SM limit (README "Compute limit"): utilization = the container's share
 * in percent (tencent.com/vcuda-core); hard_limit = 0 makes it a soft limit
 * whose ceiling is `limit` (tencent.com/vcuda-core-limit).  pids.config is
 * looked up next to vcuda.config.
 */
static void core_config(const struct vc_resource_data *cfg, const char *used)
{
    const char *slash = strrchr(used, '/');
    if (slash != NULL)
        snprintf(g_pids_path, sizeof(g_pids_path), "%.*s/pids.config", (int)(slash - used), used);
    else
        snprintf(g_pids_path, sizeof(g_pids_path), "pids.config");
    const char *algo = getenv("VCUDA_CORE_ALGORITHM");
    if (g_locked && algo != NULL && algo[0] != '\0' && strcmp(algo, "budget") != 0) {
        vc_log(VC_LOG_ERROR, "VCUDA_CORE_ALGORITHM=%s: ignored in a container given limits; using budget", algo);
        algo = NULL;
    }
    g_core.upstream = algo != NULL && strcmp(algo, "upstream") == 0;
    if (algo != NULL && algo[0] != '\0' && !g_core.upstream && strcmp(algo, "budget") != 0)
        vc_log(VC_LOG_WARN, "VCUDA_CORE_ALGORITHM=%s: expected budget or upstream; using budget", algo);
    int share = cfg->utilization;
    if (share <= 0 || share >= 100) {
        vc_log(VC_LOG_INFO, "%s: utilization = %d: no SM limit", used, share);
        return;
    }
    g_core.share = share;
    g_core.soft = cfg->hard_limit == 0;
    g_core.ceiling = share;
    if (g_core.soft) {
        /*
         * Upstream never lets usage exceed the annotation (`limit`, what the agent writes for
         * tencent.com/vcuda-core-limit, at most 100); an annotation at or below the share (or 0) leaves the
         * share: the pod is never capped below what it was given.
         */
        int limit = cfg->limit > 100 ? 100 : cfg->limit;
        g_core.ceiling = limit > share ? limit : share;
        if (limit <= share)
            vc_log(VC_LOG_INFO, "%s: soft SM limit whose ceiling (limit = %d) is not above utilization = %d: "
                   "it holds at %d%%", used, cfg->limit, share, share);
    }
    vc_log(VC_LOG_INFO, "%s: SM limit %d%% (%s, ceiling %d%%), algorithm %s", used, share, g_core.soft ? "soft" : "hard",
           g_core.ceiling, g_core.upstream ? "upstream" : "budget");
    atomic_store(&vc_core_on, true);
}

__attribute__((constructor)) static void vc_config_init(void)
{
    const char *level = getenv("LOGGER_LEVEL");
    if (level != NULL && level[0] != '\0')
        atomic_store(&vc_log_level, atoi(level));

    static struct vc_resource_data cfg; /* 8 KiB: not on a possibly small loader stack */
    char used[PATH_MAX] = "";
    enum load_result found = find_config(&cfg, used, sizeof(used));
    budget_dir();

    const char *reserve = getenv("VCUDA_CONTEXT_RESERVE");
    if (reserve != NULL && reserve[0] != '\0' && !parse_size(reserve, &g_context_reserve)) {
        vc_log(VC_LOG_ERROR, "VCUDA_CONTEXT_RESERVE=%s: expected bytes like 300M; using 256M", reserve);
        g_context_reserve = DEFAULT_CONTEXT_RESERVE;
    } else if (g_locked && g_context_reserve < DEFAULT_CONTEXT_RESERVE) {
        /* Less would let contexts be created before their memory is reserved: more only costs the container. */
        vc_log(VC_LOG_ERROR, "VCUDA_CONTEXT_RESERVE=%s: below 256M in a container given limits; using 256M", reserve);
        g_context_reserve = DEFAULT_CONTEXT_RESERVE;
    }

    if (found != CFG_OK) {
        if (g_bad[0] != '\0') {
            vc_log(VC_LOG_ERROR, "%s: no usable vcuda config, so this container's GPU limits cannot be applied: CUDA "
                   "is refused (cuInit fails with CUDA_ERROR_NOT_PERMITTED)", g_bad);
            atomic_store(&vc_cuda_refused, true);
            return;
        }
        vc_log(VC_LOG_INFO, "no vcuda config: pass-through, no limits");
        return;
    }
    if (!cfg.enable) {
        vc_log(VC_LOG_INFO, "%s: enable = 0: pass-through, no limits", used);
        return;
    }
    /* The budget file holds the memory budget and the SM limit's ledger: named whenever either limit is on. */
    char pod[sizeof(cfg.pod_uid)], name[128];
    sanitize(pod, sizeof(pod), cfg.pod_uid);
    sanitize(name, sizeof(name), cfg.container_name);
    if (pod[0] == '\0' && name[0] == '\0')
        snprintf(g_budget_name, sizeof(g_budget_name), "container.budget");
    else
        snprintf(g_budget_name, sizeof(g_budget_name), "%s_%s.budget", pod, name);
    core_config(&cfg, used);
    if (cfg.gpu_memory == 0) {
        vc_log(VC_LOG_INFO, "%s: gpu_memory = 0: no memory limit", used);
        return;
    }
    g_limit = cfg.gpu_memory;
    vc_log(VC_LOG_INFO, "%s: memory limit %llu bytes (pod %s, container %s)", used, (unsigned long long)g_limit,
           cfg.pod_uid, cfg.container_name);
    atomic_store(&vc_limit_on, true);
}
