/*
 * The container's memory budget, shared by all its processes: a small file
 * mapped MAP_SHARED, in $VCUDA_BUDGET_DIR (default /dev/shm/vcuda, because
 * /etc/vcuda is read-only in the container), named after the pod and
 * container of the config.  Layout (README.md "Budget file"):
 *
 *   header (4096 bytes): magic "VCUDABGT", version, header_size, file_size,
 *     limit, slot_count, high (slots in use are below it), a process-shared
 *     robust mutex
 *   slots[1024] (64 bytes): pid, start time, used bytes, context bytes
 *
 * Reserve-then-allocate: a reservation takes the mutex, sums the slots, and
 * adds to the caller's slot only if the total stays within the limit; the
 * caller then calls the driver and releases on failure.  Releases are atomic
 * subtractions.  A process that dies (even holding the mutex: it is robust)
 * leaves a slot whose pid is gone or reused (start time differs); the next
 * reservation that does not fit, and every usage query, reaps such slots, so
 * their bytes return to the container.
 */
#include "vc_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "vc_proc.h"

#define BUDGET_MAGIC "VCUDABGT"
#define BUDGET_VERSION 1u
#define BUDGET_HEADER 4096u
#ifndef VC_BUDGET_SLOTS
#define VC_BUDGET_SLOTS 1024u /* tests build with fewer, to reach a full table with a few processes */
#endif
#define BUDGET_SLOTS VC_BUDGET_SLOTS

struct budget_slot {
    _Atomic int32_t pid;     /* 0 = free; the PID as the process sees it (liveness is checked with it) */
    _Atomic int32_t host_pid; /* the PID NVML reports for it (its host PID), 0 = not known */
    uint64_t start;          /* the process's start time (/proc/<pid>/stat field 22) */
    _Atomic uint64_t used;   /* bytes reserved by the process, contexts included */
    _Atomic uint64_t context; /* of which contexts */
    _Atomic uint64_t unbacked; /* of `used`: charged before the GPU holds it (graph allocations not instantiated) */
    _Atomic uint64_t unbacked_libs; /* likewise: the variables of libraries never asked for, once per context */
    uint64_t reserved[2];
};

#define MAX_DEVICES 64

struct budget_header {
    char magic[8];
    uint32_t version;
    uint32_t header_size;
    uint64_t file_size;
    uint64_t limit;          /* as the first process saw it in the config (informational) */
    uint32_t slot_count;
    _Atomic uint32_t high;   /* every slot in use has an index below high */
    uint64_t reserved0[3];
    pthread_mutex_t mu;      /* offset 64: process-shared, robust */
    uint8_t pad[128 - 64 - sizeof(pthread_mutex_t)];
    _Atomic uint64_t untracked;     /* offset 128: what NVML showed beyond the slots' sum at the last reconciliation */
    _Atomic uint64_t reconciled_ns; /* CLOCK_MONOTONIC of the last reconciliation */
    uint32_t reserved2[2];
    uint64_t reserved1[5];
    _Atomic uint64_t context_size[MAX_DEVICES]; /* offset 192: last measured context size per CUDA device, 0 unknown */
    _Atomic uint64_t unseen_until_ns; /* offset 704: CLOCK_MONOTONIC ns until which a process without a slot may
                                         run unseen by the others (vc_budget_unseen) */
    uint64_t reserved3[39];
    struct {
        _Atomic uint64_t debt_until_ns; /* CLOCK_MONOTONIC ns until which the container pays off GPU time it overused */
        _Atomic uint64_t seen_us;       /* NVML sample time up to which that is measured */
    } core[MAX_DEVICES];                /* offset 1024: the SM limit's ledger per CUDA device (vc_core.c) */
    /*
     * offset 2048, per CUDA device: until when (CLOCK_MONOTONIC ns) the container pays off the GPU time its processes
     * were charged provisionally and NVML's samples do not cover yet (a sum: each process adds its charges and takes
     * back what it refunds; what a process leaves when it exits stays, paid off at the rate).
     */
    _Atomic uint64_t core_prov_until_ns[MAX_DEVICES];
    /*
     * offset 2560, per CUDA device: how NVML samples it, as the container's processes learnt it (vc_core.c): 0 not
     * known yet, 1 per process, else per GPU, one process named per period of this many us.  A new process starts
     * from it: one that lives a few periods may never see a PID named twice in an answer to learn it itself.
     */
    _Atomic uint64_t core_sampling[MAX_DEVICES];
};

_Static_assert(sizeof(struct budget_slot) == 64, "slot layout");
_Static_assert(offsetof(struct budget_header, mu) == 64, "header layout");
_Static_assert(offsetof(struct budget_header, untracked) == 128, "header layout");
_Static_assert(offsetof(struct budget_header, context_size) == 192, "header layout");
_Static_assert(offsetof(struct budget_header, unseen_until_ns) == 704, "header layout");
_Static_assert(offsetof(struct budget_header, core) == 1024, "header layout");
_Static_assert(offsetof(struct budget_header, core_prov_until_ns) == 2048, "header layout");
_Static_assert(offsetof(struct budget_header, core_sampling) == 2560, "header layout");
_Static_assert(sizeof(struct budget_header) <= BUDGET_HEADER, "header fits");

#define BUDGET_FILE_SIZE ((size_t)BUDGET_HEADER + BUDGET_SLOTS * sizeof(struct budget_slot))

static pthread_once_t g_open_once = PTHREAD_ONCE_INIT;
static struct budget_header *g_hdr; /* written once inside g_open_once */
static struct budget_slot *g_slots; /* likewise */
static _Atomic int g_slot = -1;      /* this process's slot; reset in a forked child */
static _Atomic uint64_t g_slot_tried_ns; /* vc_budget_unseen: when a slot was last looked for (0: never) */
static bool g_private; /* written once inside g_open_once: no shared file, the budget is this process's memory */

static bool init_mutex(pthread_mutex_t *mu)
{
    pthread_mutexattr_t a;
    bool ok = pthread_mutexattr_init(&a) == 0 && pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED) == 0 &&
              pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST) == 0 && pthread_mutex_init(mu, &a) == 0;
    pthread_mutexattr_destroy(&a);
    return ok;
}

/*
 * The container's host PIDs, sorted, under the budget lock (rpids_room and below); defined here so that a forked
 * child can drop them.
 */
static int *g_rpids;
static size_t g_rpids_cap;

void vc_budget_atfork_child(void)
{
    /*
     * Another thread of the parent may have been growing the PID buffer at the fork (realloc done, the new address
     * not yet stored): dropped, never freed, as the SM limiter's buffers are.
     */
    g_rpids = NULL;
    g_rpids_cap = 0;
    atomic_store(&g_slot, -1);
    atomic_store(&g_slot_tried_ns, 0);
    if (g_private && g_hdr != NULL) {
        /*
         * A private budget was copied with the child: its lock perhaps held by a thread of the parent that does
         * not exist here (nobody would ever release it), its slots the parent's charges (nothing here frees
         * them).  The child's budget starts empty, as a process of its own (the SM ledger stays: GPU time used).
         */
        init_mutex(&g_hdr->mu);
        memset(g_slots, 0, BUDGET_SLOTS * sizeof(struct budget_slot));
        atomic_store(&g_hdr->high, 0);
        atomic_store(&g_hdr->untracked, 0);
        atomic_store(&g_hdr->reconciled_ns, 0);
    }
}

static void *map_file(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0) {
        vc_log(VC_LOG_ERROR, "%s: cannot open the budget file: %s", path, strerror(errno));
        return NULL;
    }
    (void)fchmod(fd, 0666); /* every user of the container shares it, whatever the umask */
    void *map = NULL;
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        vc_log(VC_LOG_ERROR, "%s: cannot stat the budget file: %s", path, strerror(errno));
        goto out;
    }
    bool fresh = sb.st_size == 0;
    /*
     * Its blocks are allocated now, not at the first store: a sparse file (ftruncate) on a full tmpfs maps
     * fine, then the first store into the mapping raises SIGBUS.  On failure the file goes back to empty
     * (valid for the next process to try again).
     */
    int err = fresh ? posix_fallocate(fd, 0, (off_t)BUDGET_FILE_SIZE) : 0;
    if (err != 0) {
        vc_log(VC_LOG_ERROR, "%s: cannot size the budget file: %s", path, strerror(err));
        if (ftruncate(fd, 0) != 0)
            vc_log(VC_LOG_ERROR, "%s: cannot empty the budget file again: %s", path, strerror(errno));
        goto out;
    }
    if (!fresh && sb.st_size != (off_t)BUDGET_FILE_SIZE) {
        vc_log(VC_LOG_ERROR, "%s: %lld bytes, expected %zu: not a budget file of this version", path,
               (long long)sb.st_size, BUDGET_FILE_SIZE);
        goto out;
    }
    map = mmap(NULL, BUDGET_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        vc_log(VC_LOG_ERROR, "%s: cannot map the budget file: %s", path, strerror(errno));
        map = NULL;
        goto out;
    }
    struct budget_header *h = map;
    if (fresh || memcmp(h->magic, "\0\0\0\0\0\0\0\0", 8) == 0) {
        memset(map, 0, BUDGET_FILE_SIZE);
        h->version = BUDGET_VERSION;
        h->header_size = BUDGET_HEADER;
        h->file_size = BUDGET_FILE_SIZE;
        h->limit = vc_limit_bytes();
        h->slot_count = BUDGET_SLOTS;
        if (!init_mutex(&h->mu)) {
            vc_log(VC_LOG_ERROR, "%s: cannot initialise the budget lock", path);
            munmap(map, BUDGET_FILE_SIZE);
            map = NULL;
            goto out;
        }
        memcpy(h->magic, BUDGET_MAGIC, 8); /* last: the file is valid from here on */
    } else if (memcmp(h->magic, BUDGET_MAGIC, 8) != 0 || h->version != BUDGET_VERSION ||
               h->slot_count != BUDGET_SLOTS) {
        vc_log(VC_LOG_ERROR, "%s: not a budget file of this version (magic/version/slots)", path);
        munmap(map, BUDGET_FILE_SIZE);
        map = NULL;
    }
out:
    flock(fd, LOCK_UN);
    close(fd);
    return map;
}

static void open_budget(void)
{
    const char *dir = vc_budget_dir();
    if (mkdir(dir, 01777) == 0)
        (void)chmod(dir, 01777); /* shared by every user, like /tmp */
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/%s", dir, vc_budget_name());
    void *map = map_file(path);
    if (map == NULL) {
        /* Still enforce the limits, for this process alone. */
        if (vc_limited())
            vc_log(VC_LOG_ERROR, "the memory limit is enforced per process only (no shared budget file)");
        if (vc_core_limited())
            vc_log(VC_LOG_ERROR, "the SM limit is enforced per process only: a new process does not inherit the "
                   "container's debt of GPU time (no shared budget file)");
        map = mmap(NULL, BUDGET_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED)
            return; /* every reservation fails */
        struct budget_header *h = map;
        h->slot_count = BUDGET_SLOTS;
        init_mutex(&h->mu);
        g_private = true;
    }
    g_hdr = map;
    g_slots = (struct budget_slot *)((char *)map + BUDGET_HEADER);
}

static bool budget_lock(void)
{
    int rc = pthread_mutex_lock(&g_hdr->mu);
    if (rc == EOWNERDEAD) {
        /* Its holder died inside a critical section; every update there is a single store. */
        pthread_mutex_consistent(&g_hdr->mu);
        vc_log(VC_LOG_WARN, "a process died holding the budget lock; recovered");
        return true;
    }
    if (rc != 0)
        vc_log(VC_LOG_ERROR, "cannot take the budget lock: %s", strerror(rc));
    return rc == 0;
}

static void budget_unlock(void)
{
    pthread_mutex_unlock(&g_hdr->mu);
}

/* Clears the slots of processes that are gone (lock held); returns how many. */
static unsigned reap(void)
{
    unsigned n = 0, high = atomic_load(&g_hdr->high), new_high = 0;
    for (unsigned i = 0; i < high; i++) {
        struct budget_slot *s = &g_slots[i];
        int32_t pid = atomic_load(&s->pid);
        if (pid == 0)
            continue;
        if (vc_proc_alive(pid, s->start)) {
            new_high = i + 1;
            continue;
        }
        vc_log(VC_LOG_INFO, "process %d is gone: its %llu bytes return to the container", (int)pid,
               (unsigned long long)atomic_load(&s->used));
        atomic_store(&s->used, 0);
        atomic_store(&s->context, 0);
        atomic_store(&s->unbacked, 0);
        atomic_store(&s->unbacked_libs, 0);
        atomic_store(&s->host_pid, 0);
        atomic_store(&s->pid, 0);
        n++;
    }
    atomic_store(&g_hdr->high, new_high);
    return n;
}

static uint64_t sum_used(void)
{
    uint64_t sum = 0;
    unsigned high = atomic_load(&g_hdr->high);
    for (unsigned i = 0; i < high; i++)
        if (atomic_load_explicit(&g_slots[i].pid, memory_order_relaxed) != 0)
            sum += atomic_load_explicit(&g_slots[i].used, memory_order_relaxed);
    return sum;
}

/*
 * What the GPU holds of the slots' charges at most: their sum less what is charged before the GPU backs it.  Such
 * a charge (a graph's allocation node from its creation to its graph's instantiation, a library's variables in
 * every context until it is first asked for) must not stand in, at a
 * reconciliation, for memory the GPU holds that no hook charged: that memory would count nowhere, and the GPU
 * would hold both once the charge is backed.
 */
static uint64_t sum_held(void)
{
    uint64_t sum = 0;
    unsigned high = atomic_load(&g_hdr->high);
    for (unsigned i = 0; i < high; i++) {
        if (atomic_load_explicit(&g_slots[i].pid, memory_order_relaxed) == 0)
            continue;
        uint64_t used = atomic_load_explicit(&g_slots[i].used, memory_order_relaxed);
        uint64_t unbacked = atomic_load_explicit(&g_slots[i].unbacked, memory_order_relaxed) +
                            atomic_load_explicit(&g_slots[i].unbacked_libs, memory_order_relaxed);
        sum += used > unbacked ? used - unbacked : 0;
    }
    return sum;
}

/* This process's slot, claimed on first use; -1 when there is none. */
static int my_slot(void)
{
    int slot = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (VC_LIKELY(slot >= 0))
        return slot;
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || !budget_lock())
        return -1;
    slot = atomic_load(&g_slot);
    if (slot < 0) {
        int32_t pid = (int32_t)getpid();
        uint64_t start = vc_proc_start_time(pid);
        for (int pass = 0; pass < 2 && slot < 0; pass++) {
            for (unsigned i = 0; i < BUDGET_SLOTS; i++) {
                if (atomic_load(&g_slots[i].pid) == 0) {
                    slot = (int)i;
                    break;
                }
            }
            if (slot < 0)
                reap();
        }
        if (slot >= 0) {
            struct budget_slot *s = &g_slots[slot];
            s->start = start;
            atomic_store(&s->used, 0);
            atomic_store(&s->context, 0);
            atomic_store(&s->unbacked, 0);
            atomic_store(&s->unbacked_libs, 0);
            atomic_store(&s->host_pid, vc_host_pid());
            atomic_store(&s->pid, pid);
            if ((unsigned)slot >= atomic_load(&g_hdr->high))
                atomic_store(&g_hdr->high, (unsigned)slot + 1);
            atomic_store_explicit(&g_slot, slot, memory_order_release);
        } else {
            static _Atomic bool logged;
            if (!atomic_exchange(&logged, true))
                vc_log(VC_LOG_ERROR, "all %u budget slots are taken by live processes: allocations are refused, "
                       "and the container's SM limit counts every process on its GPUs as its own", BUDGET_SLOTS);
        }
    }
    budget_unlock();
    return slot;
}

/* ---- the whole footprint: reconciliation with NVML ------------------------------------------------ */

/*
 * The GPU holds memory for the container's processes that no hook charged: module code, what memory
 * pools keep after frees, the driver's own allocations.  NVML accounts it per process.  A
 * reconciliation sums NVML's memory of the container's processes (the host PIDs of its live slots and
 * pids.config) and keeps what exceeds the slots' sum as `untracked`, which every reservation and
 * memory view adds.  It runs (lock held) when a reservation would bring the container within
 * RECONCILE_MARGIN of its limit, and otherwise at most every RECONCILE_PERIOD_NS.
 */
#define RECONCILE_PERIOD_NS 1000000000ull
#define RECONCILE_NEAR_NS 2000000ull /* near the cap: at most every 2 ms (NVML's process list costs tens of us) */

static uint64_t mono_ns(void)
{
    /* The coarse clock (a few ns, ms resolution): enough for the 2 ms and 1 s thresholds. */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t margin(uint64_t limit)
{
    return limit / 4;
}

/*
 * The container's host PIDs, sorted, under the budget lock: its live slots' and every one pids.config lists,
 * however many (a tenant forking thousands of idle processes must not push one that bypasses the hooks out of
 * the list, its memory then counted nowhere).
 */
static bool rpids_room(size_t want)
{
    if (want <= g_rpids_cap)
        return true;
    if (want > (size_t)INT_MAX)
        return false;
    size_t n = want < 4096 ? 4096 : want + want / 4;
    int *b = realloc(g_rpids, n * sizeof(int));
    if (b == NULL)
        return false;
    g_rpids = b;
    g_rpids_cap = n;
    return true;
}

static int cmp_pid(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* The whole of pids.config (fd) into g_rpids from index `from`; the number of PIDs read, or -1 (no memory). */
static long read_listed(int fd, size_t from)
{
    struct stat sb;
    size_t want = from + (fstat(fd, &sb) == 0 && sb.st_size > 0 ? (size_t)sb.st_size / sizeof(int) : 0) + 1;
    for (;;) {
        if (!rpids_room(want))
            return -1;
        size_t room = (g_rpids_cap - from) * sizeof(int), got = vc_read_from_start(fd, g_rpids + from, room);
        if (got < room)
            return (long)(got / sizeof(int));
        want = g_rpids_cap * 2; /* it grew since the stat */
    }
}

/* Lock held: the container's host PIDs into g_rpids, sorted; their number, or -1 when there is no memory. */
static long container_pids(void)
{
    unsigned high = atomic_load(&g_hdr->high);
    if (!rpids_room((size_t)high + 1))
        return -1;
    size_t n = 0;
    for (unsigned i = 0; i < high; i++) {
        int32_t pid = atomic_load(&g_slots[i].pid);
        if (pid == 0)
            continue;
        int32_t host = atomic_load(&g_slots[i].host_pid);
        g_rpids[n++] = host > 0 ? host : pid; /* unknown: right in the host PID namespace */
    }
    const char *path = vc_pids_path();
    if (path[0] != '\0') {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            long listed = read_listed(fd, n);
            close(fd);
            if (listed < 0)
                return -1;
            n += (size_t)listed;
        }
    }
    if (n > 1)
        qsort(g_rpids, n, sizeof(int), cmp_pid);
    return (long)n;
}

/* Lock held; returns whether NVML could tell. */
static bool reconcile(uint64_t now)
{
    long n = container_pids();
    if (n < 0) {
        vc_log(VC_LOG_ERROR, "no memory for the container's PID list: the memory no hook sees is not reconciled");
        return false;
    }
    bool ok;
    /*
     * Releases are not under the lock: a free the GPU made before NVML was read may return its bytes before
     * the slots are summed, which would show them as memory no hook sees.  The larger of the sums before and
     * after the NVML read counts every allocation the read may have seen.
     */
    uint64_t tracked_before = sum_held();
    uint64_t gpu = vc_nvml_used_by(g_rpids, (unsigned)n, &ok);
    atomic_store(&g_hdr->reconciled_ns, now);
    if (!ok)
        return false;
    uint64_t tracked_after = sum_held();
    uint64_t tracked = tracked_before > tracked_after ? tracked_before : tracked_after;
    uint64_t untracked = gpu > tracked ? gpu - tracked : 0;
    uint64_t before = atomic_exchange(&g_hdr->untracked, untracked);
    if (untracked != before)
        vc_log(VC_LOG_DEBUG, "reconciled: the GPU holds %llu bytes for the container, %llu of them unseen by the hooks",
               (unsigned long long)gpu, (unsigned long long)untracked);
    return true;
}

static uint64_t effective_used(void)
{
    return sum_used() + atomic_load(&g_hdr->untracked);
}

static bool try_reserve(int slot, uint64_t bytes, uint64_t *used_out)
{
    if (!budget_lock())
        return false;
    uint64_t limit = vc_limit_bytes(), now = mono_ns();
    uint64_t used = effective_used();
    if ((used > limit || bytes > limit - used) && reap() > 0)
        used = effective_used();
    bool near = used > limit - margin(limit) || bytes > limit - margin(limit) - used;
    uint64_t since = now - atomic_load(&g_hdr->reconciled_ns);
    if ((near && since > RECONCILE_NEAR_NS) || since > RECONCILE_PERIOD_NS) {
        reconcile(now);
        used = effective_used();
    }
    bool ok = used <= limit && bytes <= limit - used;
    if (ok)
        atomic_fetch_add_explicit(&g_slots[slot].used, bytes, memory_order_relaxed);
    budget_unlock();
    *used_out = used;
    return ok;
}

bool vc_budget_reserve(uint64_t bytes)
{
    int slot = my_slot();
    if (slot < 0)
        return false;
    uint64_t used = 0;
    bool ok = try_reserve(slot, bytes, &used);
    if (!ok && vc_memory_refresh_pools()) /* memory pools gave memory back since they were last asked */
        ok = try_reserve(slot, bytes, &used);
    if (!ok)
        vc_log(VC_LOG_INFO, "out of memory: %llu bytes asked, %llu of %llu in use by the container",
               (unsigned long long)bytes, (unsigned long long)used, (unsigned long long)vc_limit_bytes());
    return ok;
}

/*
 * Lock held: `handover` bytes this process reserved before a call are dropped while NVML is asked what
 * the GPU now holds for the container (they are part of it now); whether the container is within its
 * limit.  When NVML cannot tell, the bytes stay charged (*kept, on the safe side).
 */
#ifdef VC_TEST_HOOKS
/* Tests only (built with -DVC_TEST_HOOKS): VCUDA_TEST_SETTLE_DELAY_US between reading the slot and updating it. */
static void test_settle_delay(void)
{
    const char *us = getenv("VCUDA_TEST_SETTLE_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
#else
#define test_settle_delay() ((void)0)
#endif

static bool settle_untracked(int slot, uint64_t handover, bool *kept)
{
    _Atomic uint64_t *used_p = &g_slots[slot].used;
    /* Other threads charge and credit the slot without the lock: what they do meanwhile is kept. */
    uint64_t cur = atomic_load(used_p), drop = cur > handover ? handover : cur;
    test_settle_delay();
    while (!atomic_compare_exchange_weak(used_p, &cur, cur - drop))
        drop = cur > handover ? handover : cur;
    uint64_t now = mono_ns();
    *kept = !reconcile(now);
    if (*kept)
        atomic_fetch_add(used_p, drop);
    uint64_t used = effective_used();
    if (used > vc_limit_bytes() && reap() > 0) {
        reconcile(now);
        used = effective_used();
    }
    return used <= vc_limit_bytes();
}

bool vc_budget_settle_untracked(uint64_t handover, bool *kept)
{
    *kept = true;
    int slot = my_slot();
    if (slot < 0 || !budget_lock())
        return true; /* cannot tell (logged): the reservation stays, the next one decides */
    bool ok = settle_untracked(slot, handover, kept);
    budget_unlock();
    /* Pools may hold less than they are charged (they give memory back at synchronisations). */
    if (!ok && vc_memory_refresh_pools() && budget_lock()) {
        bool again;
        ok = settle_untracked(slot, 0, &again);
        budget_unlock();
    }
    return ok;
}

void vc_budget_reconcile_now(void)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr != NULL && budget_lock()) {
        reconcile(mono_ns());
        budget_unlock();
    }
}

void vc_budget_charge(uint64_t bytes)
{
    int slot = my_slot();
    if (slot >= 0)
        atomic_fetch_add_explicit(&g_slots[slot].used, bytes, memory_order_relaxed);
}

void vc_budget_release(uint64_t bytes)
{
    int slot = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (slot < 0 || bytes == 0)
        return;
    _Atomic uint64_t *used = &g_slots[slot].used;
    uint64_t cur = atomic_load_explicit(used, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(used, &cur, cur > bytes ? cur - bytes : 0, memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
}

uint64_t vc_budget_used(void)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || !budget_lock())
        return 0;
    reap();
    uint64_t now = mono_ns();
    if (now - atomic_load(&g_hdr->reconciled_ns) > RECONCILE_PERIOD_NS / 10)
        reconcile(now); /* views (cuMemGetInfo, NVML) at most every 100 ms */
    uint64_t used = effective_used();
    budget_unlock();
    return used;
}

void vc_budget_set_host_pid(int pid)
{
    int slot = my_slot();
    if (slot >= 0)
        atomic_store(&g_slots[slot].host_pid, pid);
}

unsigned vc_budget_host_pids(int *out, unsigned max)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL)
        return 0;
    unsigned n = 0, high = atomic_load(&g_hdr->high);
    for (unsigned i = 0; i < high && n < max; i++) {
        int32_t pid = atomic_load_explicit(&g_slots[i].pid, memory_order_relaxed);
        int32_t host = atomic_load_explicit(&g_slots[i].host_pid, memory_order_relaxed);
        /*
         * A process that is gone is no longer the container's here, even before its slot is reaped: what it was
         * charged provisionally and its samples did not cover yet (samples come late) it left in the container's
         * sum of such charges (vc_budget_core_provisional), and its late samples counted too would count that twice.
         */
        if (pid != 0 && vc_proc_alive(pid, g_slots[i].start))
            out[n++] = host > 0 ? host : pid; /* unknown: right in the host PID namespace (as container_pids) */
    }
    return n;
}

/*
 * Whether a process of the container may be running unseen by the others: one that found every slot taken has no
 * host PID in the budget, so the others know it only once the agent lists it in pids.config (about a second
 * later; never while the agent is down).  Such a process (the caller without a slot) keeps a lease of
 * UNSEEN_LEASE_NS in the header, renewed at each call; while it runs, every process of the container counts every
 * process on its GPUs as the container's (the SM limit fails closed: neighbours' time is charged too).
 */
#define UNSEEN_LEASE_NS 2000000000ull

bool vc_budget_unseen(uint64_t now_ns)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL)
        return false;
    uint64_t tried = atomic_load_explicit(&g_slot_tried_ns, memory_order_relaxed);
    bool retry = tried == 0 || now_ns - tried >= 1000000000ull; /* a slot is looked for at most every second */
    if (retry && !atomic_compare_exchange_strong(&g_slot_tried_ns, &tried, now_ns))
        retry = false;
    if (atomic_load_explicit(&g_slot, memory_order_acquire) < 0 && (!retry || my_slot() < 0)) {
        uint64_t until = now_ns + UNSEEN_LEASE_NS, was = atomic_load(&g_hdr->unseen_until_ns);
        while (was < until && !atomic_compare_exchange_weak(&g_hdr->unseen_until_ns, &was, until)) {
        }
        return true;
    }
    return atomic_load_explicit(&g_hdr->unseen_until_ns, memory_order_relaxed) > now_ns;
}

void vc_budget_join(void)
{
    if (atomic_load_explicit(&g_slot, memory_order_acquire) >= 0)
        return;
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || !budget_lock())
        return;
    reap(); /* without a memory limit nothing else frees the slots of processes that are gone */
    budget_unlock();
    my_slot();
}

uint64_t vc_budget_context_learned(int dev)
{
    pthread_once(&g_open_once, open_budget);
    return g_hdr != NULL && dev >= 0 && dev < MAX_DEVICES ? atomic_load(&g_hdr->context_size[dev]) : 0;
}

uint64_t vc_budget_context_estimate(int dev)
{
    uint64_t learned = vc_budget_context_learned(dev);
    return learned > 0 ? learned : vc_context_reserve();
}

void vc_budget_learn_context(int dev, uint64_t bytes)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr != NULL && dev >= 0 && dev < MAX_DEVICES && bytes > 0)
        atomic_store(&g_hdr->context_size[dev], bytes);
}

void vc_budget_note_context(int64_t delta)
{
    int slot = atomic_load(&g_slot);
    if (slot >= 0)
        atomic_fetch_add(&g_slots[slot].context, (uint64_t)delta);
}

void vc_budget_note_unbacked(int64_t delta)
{
    int slot = atomic_load(&g_slot);
    if (slot >= 0)
        atomic_fetch_add(&g_slots[slot].unbacked, (uint64_t)delta);
}

void vc_budget_set_unbacked_libs(uint64_t bytes)
{
    int slot = my_slot();
    if (slot >= 0)
        atomic_store(&g_slots[slot].unbacked_libs, bytes);
}

static void atomic_max(_Atomic uint64_t *p, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(p, memory_order_relaxed);
    while (cur < v && !atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_relaxed, memory_order_relaxed)) {
    }
}

void vc_budget_core_publish(int dev, uint64_t debt_until_ns, uint64_t seen_us)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || dev < 0 || dev >= MAX_DEVICES)
        return;
    atomic_max(&g_hdr->core[dev].debt_until_ns, debt_until_ns);
    atomic_max(&g_hdr->core[dev].seen_us, seen_us);
}

uint64_t vc_budget_core_charge(int dev, uint64_t now_ns, uint64_t add_ns)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || dev < 0 || dev >= MAX_DEVICES)
        return 0;
    _Atomic uint64_t *p = &g_hdr->core[dev].debt_until_ns;
    uint64_t cur = atomic_load_explicit(p, memory_order_relaxed), next;
    do {
        next = (cur > now_ns ? cur : now_ns) + add_ns;
    } while (!atomic_compare_exchange_weak_explicit(p, &cur, next, memory_order_relaxed, memory_order_relaxed));
    return next;
}

void vc_budget_core_ledger(int dev, uint64_t *debt_until_ns, uint64_t *seen_us, uint64_t *prov_until_ns)
{
    pthread_once(&g_open_once, open_budget);
    *debt_until_ns = *seen_us = *prov_until_ns = 0;
    if (g_hdr == NULL || dev < 0 || dev >= MAX_DEVICES)
        return;
    *debt_until_ns = atomic_load_explicit(&g_hdr->core[dev].debt_until_ns, memory_order_relaxed);
    *seen_us = atomic_load_explicit(&g_hdr->core[dev].seen_us, memory_order_relaxed);
    *prov_until_ns = atomic_load_explicit(&g_hdr->core_prov_until_ns[dev], memory_order_relaxed);
}

void vc_budget_core_set_sampling(int dev, uint64_t sampling)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || dev < 0 || dev >= MAX_DEVICES)
        return;
    atomic_store_explicit(&g_hdr->core_sampling[dev], sampling, memory_order_relaxed);
}

uint64_t vc_budget_core_sampling(int dev)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || dev < 0 || dev >= MAX_DEVICES)
        return 0;
    return atomic_load_explicit(&g_hdr->core_sampling[dev], memory_order_relaxed);
}

void vc_budget_core_provisional(int dev, uint64_t now_ns, int64_t delta_ns)
{
    pthread_once(&g_open_once, open_budget);
    if (g_hdr == NULL || dev < 0 || dev >= MAX_DEVICES || delta_ns == 0)
        return;
    _Atomic uint64_t *p = &g_hdr->core_prov_until_ns[dev];
    uint64_t cur = atomic_load_explicit(p, memory_order_relaxed), next;
    do {
        uint64_t from = cur > now_ns ? cur : now_ns;
        if (delta_ns > 0)
            next = from + (uint64_t)delta_ns;
        else
            next = from - now_ns > (uint64_t)-delta_ns ? from - (uint64_t)-delta_ns : now_ns;
    } while (!atomic_compare_exchange_weak_explicit(p, &cur, next, memory_order_relaxed, memory_order_relaxed));
}
