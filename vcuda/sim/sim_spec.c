/* Loading and validating the node spec (GPUSIM_SPEC); see sim_spec.h and README.md. */
#include "sim_spec.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "sim_json.h"

#define SPEC_MAX_BYTES (16u << 20)

/*
 * Known GPU models: PCI device id, CUDA compute capability, and the device memory one CUDA context
 * takes (MiB; what nvidia-smi shows for a process that only created a context, CUDA 12, lazy loading:
 * the order of magnitude of real drivers, not a measurement of each model).
 */
struct sim_model {
    const char *name;
    unsigned device_id;
    int cc_major, cc_minor;
    unsigned context_mib;
};

static const struct sim_model k_models[] = {
    {"Tesla T4", 0x1EB8, 7, 5, 250},
    {"Tesla V100-PCIE-16GB", 0x1DB4, 7, 0, 300},
    {"Tesla V100-PCIE-32GB", 0x1DB6, 7, 0, 300},
    {"Tesla V100-SXM2-16GB", 0x1DB1, 7, 0, 300},
    {"Tesla V100-SXM2-32GB", 0x1DB5, 7, 0, 300},
    {"NVIDIA A10", 0x2236, 8, 6, 250},
    {"NVIDIA A100-SXM4-40GB", 0x20B0, 8, 0, 400},
    {"NVIDIA A100-SXM4-80GB", 0x20B2, 8, 0, 400},
    {"NVIDIA A100-PCIE-40GB", 0x20F1, 8, 0, 400},
    {"NVIDIA A100 80GB PCIe", 0x20B5, 8, 0, 400},
    {"NVIDIA L4", 0x27B8, 8, 9, 250},
    {"NVIDIA H100 PCIe", 0x2331, 9, 0, 500},
    {"NVIDIA H100 80GB HBM3", 0x2330, 9, 0, 500},
    {"NVIDIA H200", 0x2335, 9, 0, 500},
};

struct checker {
    const char *path;
    char *err;
    size_t errlen;
    bool failed;
};

__attribute__((format(printf, 3, 4))) static void bad(struct checker *c, const char *field, const char *fmt, ...)
{
    if (c->failed)
        return;
    c->failed = true;
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    snprintf(c->err, c->errlen, "%s: %s: %s", c->path, field, what);
}

static char *read_file(struct checker *c, size_t *len)
{
    FILE *f = fopen(c->path, "rb");
    if (f == NULL) {
        snprintf(c->err, c->errlen, "%s: cannot read the spec file: %s", c->path, strerror(errno));
        c->failed = true;
        return NULL;
    }
    char *buf = malloc(SPEC_MAX_BYTES + 1);
    size_t n = buf == NULL ? 0 : fread(buf, 1, SPEC_MAX_BYTES + 1, f);
    bool read_error = buf == NULL || ferror(f);
    fclose(f);
    if (read_error || n > SPEC_MAX_BYTES) {
        snprintf(c->err, c->errlen, "%s: cannot read the spec file: %s", c->path,
                 read_error ? "read error" : "larger than 16 MiB");
        c->failed = true;
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* Integer field in [lo, hi]; returns false (and reports) otherwise. */
static bool get_int(struct checker *c, const struct sim_json *v, const char *field, int64_t lo, int64_t hi,
                    const char *expect, int64_t *out)
{
    if (v == NULL) {
        bad(c, field, "missing (expected %s)", expect);
        return false;
    }
    if (v->type != SIM_JSON_NUMBER || !v->is_integer || v->integer < lo || v->integer > hi) {
        bad(c, field, "expected %s", expect);
        return false;
    }
    *out = v->integer;
    return true;
}

static bool get_string(struct checker *c, const struct sim_json *v, const char *field, char *dst, size_t cap,
                       const char *expect)
{
    if (v == NULL) {
        bad(c, field, "missing (expected %s)", expect);
        return false;
    }
    if (v->type != SIM_JSON_STRING || v->string[0] == '\0' || strlen(v->string) >= cap) {
        bad(c, field, "expected %s", expect);
        return false;
    }
    memcpy(dst, v->string, strlen(v->string) + 1);
    return true;
}

static bool is_hex_run(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        bool hex = (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
        if (!hex)
            return false;
    }
    return true;
}

static bool valid_uuid(const char *s)
{
    /* GPU-8-4-4-4-12 */
    static const size_t groups[] = {8, 4, 4, 4, 12};
    if (strncmp(s, "GPU-", 4) != 0)
        return false;
    s += 4;
    for (size_t g = 0; g < 5; g++) {
        if (!is_hex_run(s, groups[g]))
            return false;
        s += groups[g];
        if (g < 4 && *s++ != '-')
            return false;
    }
    return *s == '\0';
}

/* "DDDDDDDD:BB:DD.F" or "DDDD:BB:DD.F", hex, any case. */
static bool parse_bus_id(const char *s, unsigned *domain, unsigned *bus, unsigned *dev, unsigned *fn)
{
    size_t dlen = strcspn(s, ":");
    if ((dlen != 4 && dlen != 8) || !is_hex_run(s, dlen) || s[dlen] != ':')
        return false;
    const char *r = s + dlen + 1;
    if (strlen(r) != 7 || !is_hex_run(r, 2) || r[2] != ':' || !is_hex_run(r + 3, 2) || r[5] != '.' ||
        !is_hex_run(r + 6, 1))
        return false;
    char tmp[9];
    memcpy(tmp, s, dlen);
    tmp[dlen] = '\0';
    *domain = (unsigned)strtoul(tmp, NULL, 16);
    *bus = (unsigned)strtoul((char[]){r[0], r[1], '\0'}, NULL, 16);
    *dev = (unsigned)strtoul((char[]){r[3], r[4], '\0'}, NULL, 16);
    *fn = (unsigned)strtoul((char[]){r[6], '\0'}, NULL, 16);
    return *dev <= 0x1F && *fn <= 7;
}

static void fill_model(struct sim_gpu_spec *g)
{
    g->pci_device_id = 0x10DE; /* vendor only: unknown model */
    if (!g->context_mib_set)
        g->context_mib = SIM_DEFAULT_CONTEXT_MIB;
    for (size_t i = 0; i < sizeof(k_models) / sizeof(k_models[0]); i++) {
        if (strcmp(k_models[i].name, g->name) == 0) {
            g->pci_device_id = (k_models[i].device_id << 16) | 0x10DE;
            g->cc_major = k_models[i].cc_major;
            g->cc_minor = k_models[i].cc_minor;
            if (!g->context_mib_set)
                g->context_mib = k_models[i].context_mib;
            return;
        }
    }
}

static void check_gpu(struct checker *c, struct sim_spec *spec, unsigned i, const struct sim_json *obj)
{
    char field[64];
    struct sim_gpu_spec *g = &spec->gpus[i];
    int64_t v;
#define FIELD(name) (snprintf(field, sizeof(field), "gpus[%u].%s", i, name), field)
    if (obj->type != SIM_JSON_OBJECT) {
        snprintf(field, sizeof(field), "gpus[%u]", i);
        bad(c, field, "expected an object");
        return;
    }
    if (!get_string(c, sim_json_get(obj, "uuid"), FIELD("uuid"), g->uuid, sizeof(g->uuid),
                    "a UUID string like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"))
        return;
    if (!valid_uuid(g->uuid)) {
        bad(c, field, "expected a UUID string like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got \"%s\"", g->uuid);
        return;
    }
    if (!get_string(c, sim_json_get(obj, "name"), FIELD("name"), g->name, sizeof(g->name),
                    "a non-empty string of at most 95 characters"))
        return;
    if (!get_int(c, sim_json_get(obj, "minor"), FIELD("minor"), 0, 254, "an integer from 0 to 254", &v))
        return;
    g->minor = (unsigned)v;
    if (!get_int(c, sim_json_get(obj, "memory_mib"), FIELD("memory_mib"), 1, INT64_C(1) << 30,
                 "a positive integer", &v))
        return;
    g->memory_mib = (uint64_t)v;
    char bus[64];
    if (!get_string(c, sim_json_get(obj, "pci_bus_id"), FIELD("pci_bus_id"), bus, sizeof(bus),
                    "a PCI bus id like 00000000:18:00.0"))
        return;
    if (!parse_bus_id(bus, &g->pci_domain, &g->pci_bus, &g->pci_device, &g->pci_function)) {
        bad(c, field, "expected a PCI bus id like 00000000:18:00.0, got \"%s\"", bus);
        return;
    }
    snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "%08X:%02X:%02X.%X", g->pci_domain, g->pci_bus, g->pci_device,
             g->pci_function);
    snprintf(g->pci_bus_id_legacy, sizeof(g->pci_bus_id_legacy), "%04X:%02X:%02X.%X", g->pci_domain & 0xFFFF,
             g->pci_bus, g->pci_device, g->pci_function);
    if (!get_int(c, sim_json_get(obj, "numa_node"), FIELD("numa_node"), 0, SIM_MAX_NUMA_NODE,
                 "an integer from 0 to 1023", &v))
        return;
    g->numa_node = (unsigned)v;
    if (!get_int(c, sim_json_get(obj, "sm_count"), FIELD("sm_count"), 1, 1000000, "a positive integer", &v))
        return;
    g->sm_count = (unsigned)v;
    g->sm_threads_per_us = 1024;
    if (sim_json_get(obj, "sm_threads_per_us") != NULL) {
        if (!get_int(c, sim_json_get(obj, "sm_threads_per_us"), FIELD("sm_threads_per_us"), 1, 1000000000,
                     "a positive integer", &v))
            return;
        g->sm_threads_per_us = (unsigned)v;
    }
    if (sim_json_get(obj, "context_mib") != NULL) {
        if (!get_int(c, sim_json_get(obj, "context_mib"), FIELD("context_mib"), 0, INT64_C(1) << 20,
                     "an integer from 0 to 1048576", &v))
            return;
        g->context_mib = (unsigned)v;
        g->context_mib_set = true;
    }
    const struct sim_json *board = sim_json_get(obj, "multi_gpu_board");
    if (board == NULL || board->type != SIM_JSON_BOOL) {
        bad(c, FIELD("multi_gpu_board"), board == NULL ? "missing (expected a boolean)" : "expected a boolean");
        return;
    }
    g->multi_gpu_board = board->boolean;
#undef FIELD
    for (unsigned j = 0; j < i; j++) {
        const struct sim_gpu_spec *o = &spec->gpus[j];
        if (strcasecmp(o->uuid, g->uuid) == 0) {
            snprintf(field, sizeof(field), "gpus[%u].uuid", i);
            bad(c, field, "duplicate of gpus[%u].uuid (%s)", j, g->uuid);
        } else if (o->minor == g->minor) {
            snprintf(field, sizeof(field), "gpus[%u].minor", i);
            bad(c, field, "duplicate of gpus[%u].minor (%u)", j, g->minor);
        } else if (strcmp(o->pci_bus_id, g->pci_bus_id) == 0) {
            snprintf(field, sizeof(field), "gpus[%u].pci_bus_id", i);
            bad(c, field, "duplicate of gpus[%u].pci_bus_id (%s)", j, g->pci_bus_id);
        }
        if (c->failed)
            return;
    }
    snprintf(g->serial, sizeof(g->serial), "%013llu", 1320224000000ULL + i);
    fill_model(g);
}

static void check_topology(struct checker *c, struct sim_spec *spec, const struct sim_json *topo)
{
    unsigned n = spec->gpu_count;
    char field[64];
    if (topo == NULL || topo->type != SIM_JSON_ARRAY) {
        bad(c, "topology", "%s (expected an array of %u rows of %u levels)", topo == NULL ? "missing" : "not an array",
            n, n);
        return;
    }
    if (topo->count != n) {
        bad(c, "topology", "expected %u rows (one per GPU), got %zu", n, topo->count);
        return;
    }
    for (unsigned i = 0; i < n; i++) {
        const struct sim_json *row = sim_json_at(topo, i);
        snprintf(field, sizeof(field), "topology[%u]", i);
        if (row->type != SIM_JSON_ARRAY || row->count != n) {
            bad(c, field, "expected an array of %u levels", n);
            return;
        }
        for (unsigned j = 0; j < n; j++) {
            const struct sim_json *cell = sim_json_at(row, j);
            snprintf(field, sizeof(field), "topology[%u][%u]", i, j);
            int64_t v;
            if (!get_int(c, cell, field, 0, 50, "one of 0, 10, 20, 30, 40, 50", &v))
                return;
            if (v % 10 != 0) {
                bad(c, field, "expected one of 0, 10, 20, 30, 40, 50");
                return;
            }
            if (i == j && v != 0) {
                bad(c, field, "expected 0 on the diagonal");
                return;
            }
            spec->topology[i][j] = (unsigned)v;
        }
    }
    for (unsigned i = 0; i < n; i++) {
        for (unsigned j = 0; j < i; j++) {
            if (spec->topology[i][j] != spec->topology[j][i]) {
                snprintf(field, sizeof(field), "topology[%u][%u]", i, j);
                bad(c, field, "expected %u, the value of topology[%u][%u] (the matrix must be symmetric)",
                    spec->topology[j][i], j, i);
                return;
            }
        }
    }
}

static void check_nvlink(struct checker *c, struct sim_spec *spec, const struct sim_json *list)
{
    char field[64];
    if (list == NULL)
        return;
    if (list->type != SIM_JSON_ARRAY) {
        bad(c, "nvlink", "expected an array of [gpu_a, gpu_b, active_links]");
        return;
    }
    unsigned k = 0;
    for (const struct sim_json *e = list->child; e != NULL; e = e->next, k++) {
        snprintf(field, sizeof(field), "nvlink[%u]", k);
        if (e->type != SIM_JSON_ARRAY || e->count != 3) {
            bad(c, field, "expected [gpu_a, gpu_b, active_links]");
            return;
        }
        int64_t a, b, links;
        char sub[80];
        snprintf(sub, sizeof(sub), "nvlink[%u][0]", k);
        if (spec->gpu_count == 0) {
            bad(c, sub, "GPU index out of range (the spec has no GPUs)");
            return;
        }
        char range[64];
        snprintf(range, sizeof(range), "a GPU index from 0 to %u", spec->gpu_count - 1);
        if (!get_int(c, sim_json_at(e, 0), sub, 0, spec->gpu_count - 1, range, &a))
            return;
        snprintf(sub, sizeof(sub), "nvlink[%u][1]", k);
        if (!get_int(c, sim_json_at(e, 1), sub, 0, spec->gpu_count - 1, range, &b))
            return;
        snprintf(sub, sizeof(sub), "nvlink[%u][2]", k);
        if (!get_int(c, sim_json_at(e, 2), sub, 1, SIM_NVLINK_MAX_LINKS,
                     "an integer from 1 to 18 (NVML_NVLINK_MAX_LINKS)", &links))
            return;
        if (a == b) {
            bad(c, field, "GPU %lld cannot link to itself", (long long)a);
            return;
        }
        for (unsigned j = 0; j < spec->nvlink_count; j++) {
            const struct sim_nvlink *o = &spec->nvlink[j];
            if ((o->a == a && o->b == b) || (o->a == b && o->b == a)) {
                bad(c, field, "duplicate of nvlink[%u] (GPUs %lld and %lld)", j, (long long)a, (long long)b);
                return;
            }
        }
        spec->nvlink[spec->nvlink_count++] = (struct sim_nvlink){(unsigned)a, (unsigned)b, (unsigned)links};
    }
}

static unsigned find_root(unsigned *parent, unsigned x)
{
    while (parent[x] != x)
        x = parent[x] = parent[parent[x]];
    return x;
}

/*
 * Link numbering.  Within an NVLink-connected group of GPUs where every GPU's
 * pairs need at most 18 links in total, links are point to point: GPU a gives
 * its links to its peers in the order of the "nvlink" list.  A group where
 * some GPU would need more than 18 (all-to-all fabrics such as HGX boards) is
 * switch-connected: every GPU of the group has links 0..max-1 active, each
 * going to the group's NVSwitch.
 */
static void derive_links(struct sim_spec *spec)
{
    unsigned parent[GPUSIM_MAX_GPUS], total[GPUSIM_MAX_GPUS] = {0}, widest[GPUSIM_MAX_GPUS] = {0};
    bool switched[GPUSIM_MAX_GPUS] = {false};
    for (unsigned i = 0; i < spec->gpu_count; i++) {
        parent[i] = i;
        for (unsigned k = 0; k < SIM_NVLINK_MAX_LINKS; k++)
            spec->gpus[i].link_peer[k] = SIM_NVLINK_PEER_NONE;
    }
    for (unsigned j = 0; j < spec->nvlink_count; j++) {
        const struct sim_nvlink *l = &spec->nvlink[j];
        parent[find_root(parent, l->a)] = find_root(parent, l->b);
        unsigned ends[2] = {l->a, l->b};
        for (int e = 0; e < 2; e++) {
            total[ends[e]] += l->links;
            if (l->links > widest[ends[e]])
                widest[ends[e]] = l->links;
            spec->gpus[ends[e]].has_nvlink = true;
        }
    }
    for (unsigned i = 0; i < spec->gpu_count; i++) {
        if (total[i] > SIM_NVLINK_MAX_LINKS)
            switched[find_root(parent, i)] = true;
    }
    /* Switch domains are numbered by their lowest GPU index. */
    unsigned domain_of_root[GPUSIM_MAX_GPUS], next_domain = 0;
    for (unsigned i = 0; i < spec->gpu_count; i++)
        domain_of_root[i] = UINT32_MAX;
    for (unsigned i = 0; i < spec->gpu_count; i++) {
        unsigned r = find_root(parent, i);
        struct sim_gpu_spec *g = &spec->gpus[i];
        if (!g->has_nvlink || !switched[r])
            continue;
        if (domain_of_root[r] == UINT32_MAX)
            domain_of_root[r] = next_domain++;
        g->switch_domain = domain_of_root[r];
        for (unsigned k = 0; k < widest[i]; k++)
            g->link_peer[k] = SIM_NVLINK_PEER_SWITCH;
    }
    unsigned used[GPUSIM_MAX_GPUS] = {0};
    for (unsigned j = 0; j < spec->nvlink_count; j++) {
        const struct sim_nvlink *l = &spec->nvlink[j];
        if (switched[find_root(parent, l->a)])
            continue;
        for (unsigned n = 0; n < l->links; n++) {
            spec->gpus[l->a].link_peer[used[l->a]++] = (int)l->b;
            spec->gpus[l->b].link_peer[used[l->b]++] = (int)l->a;
        }
    }
}

static void check_root(struct checker *c, struct sim_spec *spec, const struct sim_json *root)
{
    if (root->type != SIM_JSON_OBJECT) {
        bad(c, "(document)", "expected an object, got %s", sim_json_type_name(root));
        return;
    }
    if (!get_string(c, sim_json_get(root, "driver_version"), "driver_version", spec->driver_version,
                    sizeof(spec->driver_version), "a non-empty string of at most 79 characters"))
        return;
    if (sim_json_get(root, "proc_version_path") != NULL &&
        !get_string(c, sim_json_get(root, "proc_version_path"), "proc_version_path", spec->proc_version_path,
                    sizeof(spec->proc_version_path), "a file path"))
        return;
    int64_t v;
    if (!get_int(c, sim_json_get(root, "cuda_driver_version"), "cuda_driver_version", 1, INT32_MAX,
                 "a positive integer such as 12040", &v))
        return;
    spec->cuda_driver_version = (int)v;
    const struct sim_json *gpus = sim_json_get(root, "gpus");
    if (gpus == NULL || gpus->type != SIM_JSON_ARRAY || gpus->count > GPUSIM_MAX_GPUS) {
        bad(c, "gpus", "%s (expected an array of at most %u GPUs)", gpus == NULL ? "missing" : "invalid",
            GPUSIM_MAX_GPUS);
        return;
    }
    spec->gpu_count = (unsigned)gpus->count;
    unsigned i = 0;
    for (const struct sim_json *g = gpus->child; g != NULL && !c->failed; g = g->next, i++)
        check_gpu(c, spec, i, g);
    if (!c->failed)
        check_topology(c, spec, sim_json_get(root, "topology"));
    if (!c->failed)
        check_nvlink(c, spec, sim_json_get(root, "nvlink"));
    if (!c->failed)
        derive_links(spec);
}

struct sim_spec *sim_spec_load(const char *path, char *err, size_t errlen)
{
    struct checker c = {.path = path, .err = err, .errlen = errlen};
    size_t len = 0;
    char *text = read_file(&c, &len);
    if (text == NULL)
        return NULL;
    char jerr[200];
    struct sim_json *root = sim_json_parse(text, len, jerr, sizeof(jerr));
    free(text);
    if (root == NULL) {
        snprintf(err, errlen, "%s: invalid JSON: %s", path, jerr);
        return NULL;
    }
    struct sim_spec *spec = calloc(1, sizeof(*spec));
    if (spec == NULL) {
        snprintf(err, errlen, "%s: out of memory", path);
        sim_json_free(root);
        return NULL;
    }
    snprintf(spec->path, sizeof(spec->path), "%s", path);
    check_root(&c, spec, root);
    sim_json_free(root);
    if (c.failed) {
        free(spec);
        return NULL;
    }
    return spec;
}

void sim_spec_free(struct sim_spec *spec)
{
    free(spec);
}

unsigned sim_spec_nvlink_links(const struct sim_spec *spec, unsigned a, unsigned b)
{
    for (unsigned j = 0; j < spec->nvlink_count; j++) {
        const struct sim_nvlink *l = &spec->nvlink[j];
        if ((l->a == a && l->b == b) || (l->a == b && l->b == a))
            return l->links;
    }
    return 0;
}

/*
 * /proc/driver/nvidia/version, as the NVIDIA kernel module writes it, served at the path that
 * GPUSIM_PROC_VERSION (or else the spec's "proc_version_path") names; written when the content
 * differs (a temporary file renamed over it, so concurrent readers see one version or the other).
 * libgpusim-proc.so (LD_PRELOAD) makes a process read it at the real path.
 */
void sim_serve_proc_version(const struct sim_spec *spec)
{
    const char *path = getenv("GPUSIM_PROC_VERSION");
    if (path == NULL || path[0] == '\0')
        path = spec->proc_version_path;
    if (path[0] == '\0')
        return;
    char text[512], old[512];
    int n = snprintf(text, sizeof(text),
                     "NVRM version: NVIDIA UNIX x86_64 Kernel Module  %s  Tue Mar  5 22:23:56 UTC 2024\n"
                     "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n",
                     spec->driver_version);
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        size_t got = fread(old, 1, sizeof(old), f);
        fclose(f);
        if (got == (size_t)n && memcmp(old, text, got) == 0)
            return;
    }
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    f = fopen(tmp, "w");
    if (f == NULL || fwrite(text, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "gpusim: cannot write %s: %s\n", tmp, strerror(errno));
        if (f != NULL)
            fclose(f);
        return;
    }
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        fprintf(stderr, "gpusim: cannot write %s: %s\n", path, strerror(errno));
        unlink(tmp);
    }
}
