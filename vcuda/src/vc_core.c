/*
 * The SM (core) limit: every kernel launch path is gated per device, so that
 * the container's share of the GPU's time (what NVML reports as process SM
 * utilisation) stays at its `utilization` (tencent.com/vcuda-core), or for a
 * soft limit between it and `limit` (tencent.com/vcuda-core-limit).
 *
 * Algorithm "budget" (default; README.md "Compute limit" has the constants):
 *   credit  (ns of GPU time) grows at rate x wall time and shrinks by the GPU
 *           time the container's processes actually used, measured with
 *           nvmlDeviceGetProcessUtilization (its samples integrated over time);
 *   cost    (ns per launch) learnt as measured GPU time / launches completed;
 *   in flight = launches issued - launches known complete (completion markers:
 *           an event recorded after a launch, at most MARKERS outstanding);
 *   a launch may go when credit >= in_flight x cost and fewer than MAX_UNSEEN
 *   are in flight, else it sleeps until the refill covers the difference or
 *   the oldest completes.  The long-run share equals rate whatever the cost
 *   estimate (it only bounds the queued work); nothing depends on SM count.
 *   The cost is learnt from what ran: cheap kernels teach a tiny one, and the
 *   kernels launched next may be long.  MAX_UNSEEN bounds what they queue
 *   before a measurement shows it (1025 of 50 ms after 1 us ones without it).
 *
 * Algorithm "upstream" (VCUDA_CORE_ALGORITHM=upstream): gpu-manager's token
 * bucket of reference/interceptors.md 1.7, kept as a baseline for the bench.
 *
 * With the limit off every launch hook is one branch and a tail call.
 */
#include "vc_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEVICES 64
#define MARKERS 64                  /* completion markers outstanding per device */
#define MARKER_WORK_NS 100000.0     /* a marker after at least this much estimated work (or when none is out) */
#define MAX_UNSEEN 16u              /* launches in flight at most, whatever their estimated cost (a marker each 8) */
#define TICK_NS 10000000ull         /* watcher period (budget) */
#define MEASURE_MIN_NS 2000000ull   /* a blocked launch re-measures at most every 2 ms */
#define WATCHER_LATE_NS 50000000ull /* a launch measures itself when the watcher has not for this long */
#define BURST_WALL_NS 100000000ull  /* credit beyond the work in flight: at most 100 ms of the rate */
#define PER_GPU_BURST_PERIODS 4u    /* ... or, where the driver names one process per period, 4 periods of it */
#define PER_GPU_ANSWER_MAX 256u     /* such a driver's answer: a sample per period of the window (1 s at 4 ms) */
#define SAMPLING_PROBE_NS 1000000000u /* while per-process sampling is assumed, a whole window is looked at each second */
#define EAGER_PROBE_NS 50000000u      /* ... every 50 ms where the budget file says per GPU (EAGER_LOOKS times) */
#define EAGER_LOOKS 20u               /* ... for a second, then once a second */
#define INITIAL_COST_NS 5000000.0   /* until measured: conservative (one launch in flight) */
#define COST_DECAY 0.97             /* per measurement, of the cost estimate's sums */
#define WAIT_IN_FLIGHT_NS 1000000ull /* a waiting launch looks for the completion of those outstanding this often */
#define WALL_BOUND_LAUNCHES 8.0     /* the wall bound of the cost is set over at least this many launches ... */
#define WALL_BOUND_NS 50000000.0    /* ... and this much wall time with launches outstanding */
#define WAIT_MIN_NS 50000ull
#define WAIT_MAX_NS 10000000ull
#define SOFT_MARGIN 0.05            /* soft limit: leave this much of the GPU to busy neighbours */
#define SOFT_RISE 0.02              /* soft limit: rate rises at most this much per tick */
#define OTHERS_IDLE 0.01            /* neighbours below 1 %: the GPU counts as ours */
#define PIDS_CHECK_NS 100000000ull  /* pids.config is re-read (when changed) at most every 100 ms */
#define FIRST_PIDS 4096            /* the container's PID list: first room, grown to what pids.config holds */
#define MAX_SAMPLES 256             /* utilisation samples: the first buffer, grown to what NVML asks for */
#define SAMPLES_LIMIT 65536u        /* ... up to this many */
#define SAMPLE_TRIES 4              /* queries per measurement while NVML answers INSUFFICIENT_SIZE */
#define PID_TABLE 4096u             /* per device: the newest sample time of each PID (a power of 2) */
#define PID_TABLE_FILL 3072u        /* ... emptied of stale PIDs, else wholly, beyond this many */
/*
 * Per device: the container's PIDs counted up to another sample time than the base.  NVML samples each process
 * at its own moment, so every busy process of the container but the newest-sampled needs an entry: the table
 * starts at VC_OWN_PIDS entries and doubles as needed, up to VC_OWN_PIDS_LIMIT (= SAMPLES_LIMIT: no answer holds
 * more).  Where it cannot grow, nothing is missed: the base stays at the oldest sample time of the PIDs without
 * an entry (their time after it is asked for again; others' may be counted twice).  Tests build with a small
 * VC_OWN_PIDS (and VC_OWN_PIDS_LIMIT) to reach the growth (and the fail-closed path) with a few processes: the
 * code is the same at 64, only 65+ busy processes of one container on one GPU reach it.
 */
#ifndef VC_OWN_PIDS
#define VC_OWN_PIDS 64
#endif
#ifndef VC_OWN_PIDS_LIMIT
#define VC_OWN_PIDS_LIMIT SAMPLES_LIMIT
#endif
#define MAX_QUERIES 4               /* per measurement: one per distinct start, the oldest merged beyond this */
#define SAMPLE_WINDOW_US 1000000ull /* a sample spans at most 1 s; the next query starts at most 1 s back */
#define PROVISIONAL 128u           /* per device: provisional charges kept until NVML's samples cover them */
#define PERIOD_FORGET 32u          /* the sampling period estimate loses 1/32 per new sample time (then the step) */
#define LEDGER_LOOKBACK_US 1000000ull /* a new process measures from the ledger's sample time, at most 1 s back */
#define DONE_HISTORY 256u          /* per device: (time, launches completed), to learn the cost at a sample's time */
#define DONE_STEP_US 10000ull      /* ... one entry per 10 ms at most (2.56 s of a busy process) */

/* upstream (interceptors.md 1.7) */
#define UP_TICK_NS 120000000ull
#define UP_WAIT_NS 10000000ull
#define UP_FACTOR 32
#define UP_CHANGE_LIMIT_INTERVAL 30
#define UP_USAGE_THRESHOLD 5

struct pid_seen {
    unsigned pid; /* 0: free */
    uint64_t us;  /* its newest sample time counted */
};

struct own_pid {
    unsigned pid;
    uint64_t us; /* its GPU time is counted up to this sample time */
    unsigned q;  /* the query of this measurement that asks for it (from us) */
    bool hit;    /* charged in this measurement */
};

struct dev {
    pthread_mutex_t mu;
    bool ready, usable; /* initialised; NVML handle found (else the limit is not enforced) */
    int index;
    nvmlDevice_t nvml;
    /* budget */
    double rate;          /* allowed fraction of the GPU now */
    double credit;        /* ns */
    double cost;          /* ns per launch */
    double acc_busy, acc_done;
    double others;        /* neighbours' share (soft limit), smoothed */
    uint64_t launched, completed, completed_seen;
    uint64_t last_refill, last_measure, last_seen_us;
    double measured;      /* own GPU time measured, total (debug log) */
    uint64_t next_log;
    /* NVML's samples (under mu): grown when NVML needs more room */
    nvmlProcessUtilizationSample_t *samples;
    nvmlProcessUtilizationInfo_v1_t *info;
    unsigned samples_cap;
    bool blind, blind_logged; /* NVML cannot tell the GPU time used: paced on the time launches are outstanding */
    struct pid_seen *seen;    /* PID_TABLE entries (open addressing), allocated at the first measurement */
    unsigned nseen;
    uint64_t newest_us;       /* the newest sample time of any process seen */
    bool newest_sampled;      /* newest_us is a sample's time (not a start) */
    bool self_sampled;        /* the last measurement had a new sample of this process's own */
    /* Provisional charges: completed launches x cost, charged until NVML's samples cover their time (a ring) */
    uint64_t prov_completed;  /* completions charged provisionally so far */
    uint64_t refused;         /* launches the driver refused (they complete with the others, but never ran) */
    uint64_t prov_refused;    /* ... of those, the ones left out of the completions charged provisionally */
    uint64_t prov_us[PROVISIONAL];
    double prov_ns[PROVISIONAL];
    unsigned prov_head, prov_n;
    uint64_t period_us;       /* NVML's sampling period: the longest step of newest_us, slowly forgotten (0: unknown) */
    bool per_gpu;             /* the driver samples the GPU, one process per period (answer_sampling) */
    uint64_t probed_ns;       /* when the sampling was last looked at over a whole window (probe_sampling; 0: never) */
    unsigned eager_looks;     /* looks left 50 ms apart: the budget file says the container's processes saw per GPU */
    _Atomic int sampling_note; /* a change of sampling to log once d->mu is let go (1 per GPU, 2 per process; 0 none) */
    uint64_t gpu_period_us;   /* ... its period: the shortest step between an answer's samples (0: not seen yet) */
    uint64_t base_us;         /* the container's PIDs without an entry in own are counted up to this sample time */
    struct own_pid *own;      /* the container's PIDs counted up to another time, sorted by PID (own_cap of room) */
    uint64_t *starts;         /* room for own_cap + 1 query starts (measure) */
    unsigned nown, own_cap;
    /* markers: each in the context of the launch it follows (its stream's) */
    CUcontext ev_ctx[MARKERS];
    CUevent ev[MARKERS];
    uint64_t ev_count[MARKERS];
    unsigned head, n; /* ring of outstanding markers */
    uint64_t marked;  /* launch number of the newest marker */
    uint64_t unmarked; /* the newest launch without a marker of its own (mark_unknown) ... */
    uint64_t unmarked_due; /* ... done, with those before it, once the ring is empty and this time (mono ns) passed */
    /* upstream */
    _Atomic int64_t up_cur;
    int64_t up_share, up_total, up_sm, up_thr;
    int up_limit, up_i, up_procs;
    int64_t up_avg_free;
    uint64_t up_next;
    /* budget, off the launch path (kept out of the hot fields' cache lines) */
    unsigned self;            /* this process's PID */
    double own_unlearnt;      /* the container's time measured since the cost last learnt (ns) */
    bool cost_learnt;         /* the cost per launch comes from a measurement (else INITIAL_COST_NS, a guess) */
    uint64_t prov_wall;       /* mono ns up to which provisional charges are made */
    double wall_busy;         /* wall ns with launches outstanding since the cost's wall bound was last set */
    uint64_t wall_from;       /* ok_done when it was last set */
    double wall_cost;         /* the wall time outstanding per launch completed (ns; 0: none): the cost's bound */
    double free_cost;         /* the cost without that bound: the guess, or as learnt from NVML */
    uint64_t ok_launched;     /* launches that reached the GPU with a completion marker to come (not failed, not
                                 counted done unseen: mark_unknown) */
    uint64_t ok_done;         /* of those, the ones a completed marker covers */
    uint64_t ev_ok[MARKERS];  /* ok_launched when each marker was recorded */
    uint64_t self_us;         /* the newest sample time of this process's own that was charged */
    /* Launches completed by each time (real us), a ring: the cost learns from those its own sample's time covers */
    uint64_t done_us[DONE_HISTORY], done_count[DONE_HISTORY];
    unsigned done_head, done_n;
    bool learn_known;         /* learn_done is the count at the time the cost last learnt up to */
    uint64_t learn_done;
    uint64_t lag_us;          /* how far behind now samples are counted: a new sample's age plus a period (likewise) */
    uint64_t prov_open_us;    /* when the newest provisional slot was opened */
    double prov_done[PROVISIONAL]; /* the launches each provisional charge is for (revalued when the cost is learnt) */
    double prov_shared;       /* wall ns of pay-off this process's provisional charges hold in the container's sum */
    uint64_t prov_inherited;  /* mono ns until which the debt this process began with holds others' provisional charges */
    bool busy_measured;       /* launches were outstanding at the last measurement ... */
    uint64_t launched_measured; /* ... or were made since it (launched was this then) */
};

static struct dev g_dev[MAX_DEVICES];
static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER;
static bool g_watcher;

/*
 * The container's host PIDs (pids.config, else this process), under g_pids_mu, sorted.  g_pids_all: the list
 * could not be had whole (no memory for it): every process on the GPU counts as the container's.
 */
static pthread_mutex_t g_pids_mu = PTHREAD_MUTEX_INITIALIZER;
static int *g_pids;
static unsigned g_npids, g_pids_cap;
static bool g_pids_all;
static bool g_unseen; /* a process of the container without a budget slot may run unseen (vc_budget_unseen) */
static unsigned g_slot_others; /* live processes of the container with a budget slot, this one left out */
static unsigned g_file_others; /* PIDs of pids.config other than this process */
static uint64_t g_pids_checked;
/*
 * Which pids.config was read last: the agent replaces it by rename (a new inode) as often as once a second,
 * and a coarse file system (or two rewrites in one tick, or an mtime set back) can give the new one the old
 * one's mtime.  Inode, size, mtime and ctime together tell a rewrite.
 */
struct pids_stamp {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtim, ctim;
};
static struct pids_stamp g_pids_stamp;
static pid_t g_pids_owner;

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t real_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---- the container's processes ------------------------------------------------------ */

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/*
 * The container's processes: pids.config (the agent's list, re-read when it changes), this process (its
 * PID and host PID, whether or not the agent listed it yet), and every process of the container with a
 * slot in its budget whose host PID is known (vc_budget.c): a process the agent has not listed yet (it
 * refreshes about once a second, never while it is down) counts from its first context on.
 */
static int *g_file_pids;
static unsigned g_nfile_pids, g_file_cap;
static bool g_file_short; /* the last pids.config read did not fit (no memory): g_pids_all */

/* Room for want ints in *buf (capacity *cap); false when there cannot be. */
static bool pids_room(int **buf, unsigned *cap, size_t want)
{
    if (want <= *cap)
        return true;
    if (want > UINT_MAX / 2)
        return false;
    size_t n = want < FIRST_PIDS ? FIRST_PIDS : want + want / 4;
    int *b = realloc(*buf, n * sizeof(int));
    if (b == NULL)
        return false;
    *buf = b;
    *cap = (unsigned)n;
    return true;
}

/* The whole of pids.config (fd, st_size bytes when stat'ed) into g_file_pids; false when it does not fit. */
static bool read_file_pids(int fd, off_t size)
{
    size_t want = size > 0 ? (size_t)size / sizeof(int) + 1 : 1;
    for (;;) {
        if (!pids_room(&g_file_pids, &g_file_cap, want))
            return false;
        size_t room = (size_t)g_file_cap * sizeof(int), got = vc_read_from_start(fd, g_file_pids, room);
        if (got < room) {
            g_nfile_pids = (unsigned)(got / sizeof(int));
            return true;
        }
        want = (size_t)g_file_cap * 2; /* it grew since the stat */
    }
}

static bool same_time(struct timespec a, struct timespec b)
{
    return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

static bool same_stamp(const struct stat *sb, const struct pids_stamp *p)
{
    return sb->st_dev == p->dev && sb->st_ino == p->ino && sb->st_size == p->size && same_time(sb->st_mtim, p->mtim) &&
           same_time(sb->st_ctim, p->ctim);
}

static void refresh_pids(uint64_t now)
{
    g_unseen = vc_budget_unseen(now);
    if (g_pids_owner == getpid() && now - g_pids_checked < PIDS_CHECK_NS)
        return;
    g_pids_checked = now;
    struct stat sb;
    const char *path = vc_pids_path();
    if (path[0] == '\0' || stat(path, &sb) != 0) {
        g_nfile_pids = 0;
        g_pids_stamp = (struct pids_stamp){0};
    } else if (g_pids_owner != getpid() || !same_stamp(&sb, &g_pids_stamp)) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        struct stat fb;
        if (fd >= 0 && fstat(fd, &fb) == 0) {
            g_file_short = !read_file_pids(fd, fb.st_size);
            g_pids_stamp = (struct pids_stamp){fb.st_dev, fb.st_ino, fb.st_size, fb.st_mtim, fb.st_ctim};
            vc_log(VC_LOG_DEBUG, "%s: %u PIDs of the container%s", path, g_nfile_pids,
                   g_file_short ? " (not all: no memory)" : "");
        }
        if (fd >= 0)
            close(fd);
    }
    /*
     * Every PID of the list, however many (a PID left out would count as a neighbour's: its GPU time free for
     * the container).  Where the list cannot be had whole, every process on the GPU counts as the container's.
     */
    bool all = g_file_short;
    unsigned n = 0;
    size_t want = (size_t)g_nfile_pids + 2 + VC_MAX_PROCS;
    for (;;) {
        if (!pids_room(&g_pids, &g_pids_cap, want)) {
            all = true;
            n = 0;
            break;
        }
        n = 0;
        g_pids[n++] = (int)getpid(); /* right in the host PID namespace (and the simulated node) */
        if (vc_host_pid() > 0 && vc_host_pid() != (int)getpid())
            g_pids[n++] = vc_host_pid();
        g_file_others = 0;
        if (!all)
            for (unsigned i = 0; i < g_nfile_pids; i++) {
                g_pids[n++] = g_file_pids[i];
                if (g_file_pids[i] != (int)getpid() && g_file_pids[i] != vc_host_pid())
                    g_file_others++;
            }
        unsigned room = g_pids_cap - n, got = vc_budget_host_pids(g_pids + n, room);
        g_slot_others = 0;
        for (unsigned i = n; i < n + got; i++)
            if (g_pids[i] != (int)getpid() && g_pids[i] != vc_host_pid())
                g_slot_others++;
        n += got;
        if (got < room)
            break;
        want = (size_t)g_pids_cap * 2; /* perhaps more slots than room */
    }
    if (all && !g_pids_all)
        vc_log(VC_LOG_ERROR, "no memory for the container's %u PIDs: every process on the GPU counts as the "
               "container's for its SM limit", g_nfile_pids);
    g_pids_all = all;
    g_npids = n;
    if (n > 0)
        qsort(g_pids, g_npids, sizeof(int), cmp_int); /* the agent sorts; we do not rely on it */
    g_pids_owner = getpid();
}

/*
 * Whether every process on the GPU counts as the container's now (g_pids_all, g_unseen: fail closed). Taken
 * with d->mu held, as measure() takes g_pids_mu.
 */
static bool counted_all_as_own(void)
{
    pthread_mutex_lock(&g_pids_mu);
    bool all = g_pids_all || g_unseen;
    pthread_mutex_unlock(&g_pids_mu);
    return all;
}

/*
 * Whether this process is the container's only one: pids.config (the agent's list) names no other, nor does the
 * budget file (the container's processes that use the interceptor; the tenant can write it, so it alone is not taken
 * at its word), and this process read both itself (not a fork's copy of its parent's reading).
 */
static bool alone_in_container(void)
{
    pthread_mutex_lock(&g_pids_mu);
    bool alone = g_pids_owner == getpid() && !g_pids_all && !g_unseen && g_slot_others == 0 && g_file_others == 0;
    pthread_mutex_unlock(&g_pids_mu);
    return alone;
}

static bool in_container(unsigned pid)
{
    int key = (int)pid;
    return g_pids_all || g_unseen || (g_npids > 0 && bsearch(&key, g_pids, g_npids, sizeof(int), cmp_int) != NULL);
}

/* ---- measurement: NVML per-process utilisation ------------------------------------------ */

#ifdef VC_TEST_HOOKS
/*
 * Tests only (built with -DVC_TEST_HOOKS): with VCUDA_TEST_GROW_DELAY_US set, every measurement grows the sample
 * buffers (up to 4096 entries) and sleeps that long between a buffer's realloc and its new address being stored:
 * a fork from another thread then finds the old (freed) address in the device's state.
 */
static unsigned test_grow_delay_us(void)
{
    const char *us = getenv("VCUDA_TEST_GROW_DELAY_US");
    return us != NULL ? (unsigned)atoi(us) : 0;
}
#define test_grow_want(d, want) ((test_grow_delay_us() > 0 && (d)->samples_cap > 0 && (d)->samples_cap < 4096) \
                                     ? (d)->samples_cap + 1 : (want))
#define test_grow_delay() (test_grow_delay_us() > 0 ? (void)usleep(test_grow_delay_us()) : (void)0)
#else
#define test_grow_want(d, want) (want)
#define test_grow_delay() ((void)0)
#endif

/* Room for want samples in d's buffers (d->mu held); false when there cannot be. */
static bool grow_samples(struct dev *d, unsigned want)
{
    if (want <= d->samples_cap)
        return true;
    if (want > SAMPLES_LIMIT)
        return false;
    unsigned cap = want + want / 4 + 16;
    if (cap > SAMPLES_LIMIT)
        cap = SAMPLES_LIMIT;
    nvmlProcessUtilizationSample_t *b = realloc(d->samples, cap * sizeof(*b));
    if (b == NULL)
        return false;
    test_grow_delay();
    d->samples = b;
    nvmlProcessUtilizationInfo_v1_t *info = realloc(d->info, cap * sizeof(*info));
    if (info == NULL)
        return false;
    d->info = info;
    d->samples_cap = cap;
    return true;
}

/*
 * NVML's per-process utilisation samples newer than since, into d->samples (*count of them).  A buffer
 * too small for every process on the GPU (NVML_ERROR_INSUFFICIENT_SIZE) is grown to the count NVML
 * reports (doubled if it reports none) and the query repeated.
 */
static nvmlReturn_t query_samples(struct dev *d, uint64_t since, unsigned *count)
{
    nvmlReturn_t rc = NVML_ERROR_INSUFFICIENT_SIZE;
    unsigned want = test_grow_want(d, d->samples_cap > 0 ? d->samples_cap : MAX_SAMPLES);
    *count = 0;
    for (int tries = 0; tries < SAMPLE_TRIES && rc == NVML_ERROR_INSUFFICIENT_SIZE; tries++) {
        if (!grow_samples(d, want))
            return NVML_ERROR_INSUFFICIENT_SIZE;
        unsigned n = d->samples_cap;
        rc = REAL_NVML(nvmlDeviceGetProcessUtilization)(d->nvml, d->samples, &n, since);
        if (rc == NVML_ERROR_NOT_SUPPORTED) {
            /* Newer drivers (580 / Blackwell) only answer the v1 "info" call. */
            nvmlProcessesUtilizationInfo_t q = {
                .version = nvmlProcessesUtilizationInfo_v1, .processSamplesCount = d->samples_cap,
                .lastSeenTimeStamp = since, .procUtilArray = d->info};
            rc = REAL_NVML(nvmlDeviceGetProcessesUtilizationInfo)(d->nvml, &q);
            n = q.processSamplesCount;
            for (unsigned i = 0; rc == NVML_SUCCESS && i < n && i < d->samples_cap; i++)
                d->samples[i] = (nvmlProcessUtilizationSample_t){
                    .pid = d->info[i].pid, .timeStamp = d->info[i].timeStamp, .smUtil = d->info[i].smUtil};
        }
        if (rc == NVML_ERROR_INSUFFICIENT_SIZE)
            want = n > d->samples_cap ? n : (d->samples_cap > SAMPLES_LIMIT / 2 ? SAMPLES_LIMIT + 1 : 2 * d->samples_cap);
        else if (rc == NVML_SUCCESS)
            *count = n < d->samples_cap ? n : d->samples_cap;
    }
    return rc;
}

/*
 * The newest sample time counted of pid on d (d->mu held): an entry of the table, inserted at 0;
 * NULL when the table cannot have one.  Beyond PID_TABLE_FILL entries the table drops the PIDs
 * without a sample after stale_us, and if that is not enough, all of them.
 */
static uint64_t *pid_seen(struct dev *d, unsigned pid, uint64_t stale_us)
{
    if (pid == 0)
        return NULL;
    if (d->seen == NULL && (d->seen = calloc(PID_TABLE, sizeof(*d->seen))) == NULL)
        return NULL;
    unsigned h = (pid * 2654435761u) & (PID_TABLE - 1);
    for (unsigned k = 0; k < PID_TABLE; k++, h = (h + 1) & (PID_TABLE - 1)) {
        if (d->seen[h].pid == pid)
            return &d->seen[h].us;
        if (d->seen[h].pid == 0)
            break;
    }
    if (d->nseen >= PID_TABLE_FILL) {
        static struct pid_seen keep[PID_TABLE_FILL]; /* under d->mu: one device at a time is enough */
        static pthread_mutex_t keep_mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_mutex_lock(&keep_mu);
        unsigned n = 0;
        for (unsigned i = 0; i < PID_TABLE; i++)
            if (d->seen[i].pid != 0 && d->seen[i].us > stale_us && n < PID_TABLE_FILL / 2)
                keep[n++] = d->seen[i];
        memset(d->seen, 0, PID_TABLE * sizeof(*d->seen));
        d->nseen = 0;
        for (unsigned i = 0; i < n; i++)
            *pid_seen(d, keep[i].pid, 0) = keep[i].us;
        pthread_mutex_unlock(&keep_mu);
        h = (pid * 2654435761u) & (PID_TABLE - 1);
        while (d->seen[h].pid != 0)
            h = (h + 1) & (PID_TABLE - 1);
    }
    d->seen[h] = (struct pid_seen){pid, 0};
    d->nseen++;
    return &d->seen[h].us;
}

static int cmp_sample_time(const void *a, const void *b)
{
    unsigned long long x = ((const nvmlProcessUtilizationSample_t *)a)->timeStamp;
    unsigned long long y = ((const nvmlProcessUtilizationSample_t *)b)->timeStamp;
    return (x > y) - (x < y);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Index of the first entry of d->own whose PID is not below pid (d->mu held). */
static unsigned own_lower(const struct dev *d, unsigned pid)
{
    unsigned lo = 0, hi = d->nown;
    while (lo < hi) {
        unsigned mid = lo + (hi - lo) / 2;
        if (d->own[mid].pid < pid)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The entry of the container's pid among d->own (d->mu held); NULL when it has none. */
static struct own_pid *own_find(struct dev *d, unsigned pid)
{
    unsigned i = own_lower(d, pid);
    return i < d->nown && d->own[i].pid == pid ? &d->own[i] : NULL;
}

/* Room for one more entry in d->own (and its start): doubled up to VC_OWN_PIDS_LIMIT; false when it cannot be. */
static bool own_room(struct dev *d)
{
    if (d->nown < d->own_cap)
        return true;
    unsigned cap = d->own_cap == 0 ? VC_OWN_PIDS : d->own_cap * 2;
    if (cap > VC_OWN_PIDS_LIMIT)
        cap = VC_OWN_PIDS_LIMIT;
    if (cap <= d->own_cap)
        return false;
    struct own_pid *own = realloc(d->own, cap * sizeof(*own));
    if (own == NULL)
        return false;
    d->own = own;
    uint64_t *starts = realloc(d->starts, ((size_t)cap + 1) * sizeof(*starts));
    if (starts == NULL)
        return false;
    d->starts = starts;
    d->own_cap = cap;
    return true;
}

/* A new entry for pid (d->mu held), kept in PID order; NULL when the table has no room. */
static struct own_pid *own_insert(struct dev *d, unsigned pid, uint64_t us, unsigned q)
{
    if (!own_room(d))
        return NULL;
    unsigned i = own_lower(d, pid);
    memmove(&d->own[i + 1], &d->own[i], (d->nown - i) * sizeof(*d->own));
    d->nown++;
    d->own[i] = (struct own_pid){.pid = pid, .us = us, .q = q};
    return &d->own[i];
}

/*
 * What an answer (sorted by time) shows of the driver's sampling: +1 per GPU, one process named per period with every
 * period kept since the query's start s, so a busy process appears at two times (seen on an H200 with driver 580: each
 * 200 ms sample names the process resident when it was taken, with the whole GPU's busy percent); -1 per process,
 * two processes sampled at one time or within half the per-GPU period learnt (one period holds several processes'
 * samples: moving the base to another's sample would skip the container's earlier one in that period); 0 neither.
 * A per-GPU answer holds a sample per period of the window: more than PER_GPU_ANSWER_MAX samples are a per-process
 * answer of many processes (and the pairwise look stays small).
 */
static int answer_sampling(const nvmlProcessUtilizationSample_t *buf, unsigned n, uint64_t s, uint64_t period_us)
{
    bool twice = false;
    for (unsigned i = 0; i + 1 < n; i++) {
        if (buf[i].timeStamp <= s)
            continue;
        uint64_t step = buf[i + 1].timeStamp - buf[i].timeStamp;
        if (buf[i + 1].pid != buf[i].pid && (step == 0 || (period_us > 0 && step < period_us / 2)))
            return -1;
    }
    if (n > PER_GPU_ANSWER_MAX)
        return 0;
    for (unsigned i = 0; i < n && !twice; i++) {
        if (buf[i].timeStamp <= s)
            continue;
        for (unsigned j = i + 1; j < n && !twice; j++)
            twice = buf[j].pid == buf[i].pid && buf[j].timeStamp != buf[i].timeStamp;
    }
    return twice ? 1 : 0;
}

/*
 * The driver's sampling period where it samples the whole GPU: the shortest step between an answer's sample times
 * (periods without a sample make longer steps), rising by 1/32 of the difference when an answer's shortest step is
 * longer.  Not the step of the newest sample time between measurements: that is the query's cadence (500 ms steps
 * at a 10 ms period charged each answer's first sample 50 periods: 30 % with 50 ms kernels gave 8 %).
 */
static void learn_gpu_period(struct dev *d, const nvmlProcessUtilizationSample_t *buf, unsigned n, uint64_t s)
{
    uint64_t step = 0, prev = 0;
    for (unsigned i = 0; i < n; i++) {
        uint64_t ts = buf[i].timeStamp;
        if (ts <= s)
            continue;
        if (prev > 0 && ts > prev && (step == 0 || ts - prev < step))
            step = ts - prev;
        prev = ts > prev ? ts : prev;
    }
    if (step == 0)
        return;
    if (d->gpu_period_us == 0 || step < d->gpu_period_us)
        d->gpu_period_us = step;
    else
        d->gpu_period_us += (step - d->gpu_period_us) / PERIOD_FORGET;
}

/* What this process learnt of the driver's sampling, for the container's processes that start after it. */
static void publish_sampling(const struct dev *d)
{
    uint64_t sampling = d->per_gpu && d->gpu_period_us > VC_SAMPLING_PER_PROCESS ? d->gpu_period_us
                        : d->per_gpu                                          ? 0
                                                                              : VC_SAMPLING_PER_PROCESS;
    if (vc_budget_core_sampling(d->index) != sampling)
        vc_budget_core_set_sampling(d->index, sampling);
}

/*
 * The driver's sampling as an answer showed it (d->mu held).  A change is logged by the watcher once it has let d->mu
 * go (log_sampling): a log line written under d->mu to a stderr that is a full pipe nobody reads held every launch of
 * the device for good.
 */
static void set_sampling(struct dev *d, bool per_gpu)
{
    if (d->per_gpu == per_gpu)
        return;
    d->per_gpu = per_gpu;
    atomic_store_explicit(&d->sampling_note, per_gpu ? 1 : 2, memory_order_relaxed);
}

/* The watcher, d->mu not held: a change of the sampling, once. */
static void log_sampling(struct dev *d)
{
    int note = atomic_exchange_explicit(&d->sampling_note, 0, memory_order_relaxed);
    if (note != 0)
        vc_log(VC_LOG_INFO, note == 1 ? "device %d: NVML names one process per sample (the driver samples the whole "
               "GPU): each sample is charged over one sampling period, and the periods named for others count as idle"
               : "device %d: NVML samples several processes in one period: each sample is charged since the "
               "process's previous one", d->index);
}

/*
 * While per-process sampling is assumed, once a second (d->mu held): the answer for the whole last window, for the
 * sampling only (nothing is charged from it).  A per-GPU driver's answer holds every period of the window, so a busy
 * process is in it at two times; a process that measures every period has one new sample in each of its own
 * answers and never saw that.  Charged since the PID's own previous sample, each sample then spanned the periods
 * named for the container's other processes too: two busy processes of a 30 % container alone on the GPU got 20 %
 * together, fresh processes of one 400 ms kernel each 19-21 %.  Not from the answers' steps across measurements: a
 * process sampled per process at jittering moments beside one sampled rarely looked the same, and charged over the
 * shortest step a 30 % container took 73 %.
 */
static void probe_sampling(struct dev *d, uint64_t now)
{
    uint64_t every = d->eager_looks > 0 ? EAGER_PROBE_NS : SAMPLING_PROBE_NS;
    if (d->per_gpu || (d->probed_ns != 0 && now - d->probed_ns < every))
        return;
    d->probed_ns = now;
    if (d->eager_looks > 0)
        d->eager_looks--;
    uint64_t s = real_us();
    s = s > SAMPLE_WINDOW_US ? s - SAMPLE_WINDOW_US : 0;
    unsigned n = 0;
    if (query_samples(d, s, &n) != NVML_SUCCESS || n < 2)
        return;
    qsort(d->samples, n, sizeof(*d->samples), cmp_sample_time);
    if (answer_sampling(d->samples, n, s, d->gpu_period_us) <= 0)
        return;
    set_sampling(d, true);
    learn_gpu_period(d, d->samples, n, s);
    publish_sampling(d);
}

/*
 * How long before its time a sample at ts describes (us): NVML's documented "last sample period".  Sampled per
 * process, a sample averages its process's use since the query's start (at most SAMPLE_WINDOW_US: a second).  Sampled
 * per GPU, it describes one period: the time since the answer's previous sample (prev, any process), else the period
 * learnt; charging it since the process's own previous sample put every period named for others on it (a 30 %
 * container named once a second paid a second at 99 %).
 */
static uint64_t span_limit_us(const struct dev *d, uint64_t ts, uint64_t prev)
{
    if (!d->per_gpu)
        return SAMPLE_WINDOW_US;
    uint64_t span = d->gpu_period_us > 0 ? d->gpu_period_us : SAMPLE_WINDOW_US;
    if (prev > 0 && prev < ts && ts - prev < span)
        span = ts - prev;
    return span;
}

/*
 * One query's samples (d->mu and g_pids_mu held): the container's PIDs of query q (start s) are charged
 * smUtil x (ts - s), each over the window its average was taken over; base: the query of the PIDs without
 * an entry (they start at the base), which also measures the neighbours.  Returns the newest sample time of
 * the container's PIDs in the answer (0: none); *unowned: the oldest sample time of a PID of the container that
 * could have no entry (the base must not pass it).
 */
static uint64_t charge_answer(struct dev *d, unsigned q, uint64_t s, bool base, unsigned n, double *own,
                              double *other, uint64_t *newest, uint64_t *unowned)
{
    nvmlProcessUtilizationSample_t *buf = d->samples;
    qsort(buf, n, sizeof(*buf), cmp_sample_time); /* a PID's samples in order: each spans from the one before */
    int sampling = answer_sampling(buf, n, s, d->gpu_period_us);
    if (sampling != 0)
        set_sampling(d, sampling > 0);
    if (d->per_gpu)
        learn_gpu_period(d, buf, n, s); /* not from a per-process answer: its steps are the spread of moments */
    if (sampling != 0)
        publish_sampling(d);
    uint64_t t = 0, stale = s > SAMPLE_WINDOW_US ? s - SAMPLE_WINDOW_US : 0, prev_any = 0;
    for (unsigned i = 0; i < n; i++) {
        uint64_t ts = buf[i].timeStamp, from;
        if (ts <= s)
            continue;
        if (ts > *newest)
            *newest = ts;
        uint64_t covers = span_limit_us(d, ts, prev_any);
        if (ts > prev_any)
            prev_any = ts; /* sorted: the answer's newest so far */
        double util = (double)(buf[i].smUtil > 100 ? 100 : buf[i].smUtil);
        if (!in_container(buf[i].pid)) {
            if (!base)
                continue; /* the neighbours: from the base query only */
            /*
             * From its previous sample: one newer than the base is not counted twice, and one older (NVML samples
             * each process at its own moment, so a neighbour's may be older than the container's newest) leaves
             * no stretch uncounted (its average over the query's window stands for it).
             */
            uint64_t *last = pid_seen(d, buf[i].pid, stale);
            from = last != NULL && *last > stale ? *last : s;
            if (ts <= from)
                continue;
            if (last != NULL)
                *last = ts;
            *other += util * (double)(ts - from > covers ? covers : ts - from) * 10.0;
            continue;
        }
        if (ts > t)
            t = ts;
        struct own_pid *e = own_find(d, buf[i].pid);
        if (e == NULL && !base)
            continue; /* the base query has its window */
        if (e == NULL && (e = own_insert(d, buf[i].pid, s, q)) == NULL && ts < *unowned)
            *unowned = ts; /* no room: counted up to ts, and the base stays there */
        if (e != NULL && e->q != q)
            continue; /* its window is another query's */
        /* The first sample spans the query's window (for a PID merged into an older start, more than it had left) */
        from = e != NULL && e->hit ? e->us : s;
        if (ts <= from)
            continue;
        *own += util * (double)(ts - from > covers ? covers : ts - from) * 10.0;
        if (buf[i].pid == d->self) {
            d->self_sampled = true;
            if (ts > d->self_us)
                d->self_us = ts;
        }
        if (e != NULL) {
            e->us = ts;
            e->hit = true;
        }
    }
    /*
     * The PIDs of this query without a sample were idle until one sampling period before the container's newest
     * sample in the answer: NVML samples each process at its own moment of the period, so a busy PID sampled
     * later in the period than another has its next sample a period after its last, and moving it to the other's
     * (newer) time would lose its GPU time in between.  A PID busy in (us, t - period] would have a sample in
     * (us, t].  No period known yet: none is moved (its entry goes after a window idle).
     */
    if (d->per_gpu && base && prev_any > t)
        t = prev_any; /* the periods named for others: the container's PIDs count as idle in them */
    uint64_t period = d->period_us;
    for (unsigned i = 0; t > 0 && period > 0 && i < d->nown; i++)
        if (d->own[i].q == q && !d->own[i].hit && d->own[i].us + period < t)
            d->own[i].us = t - period;
    return t;
}

/*
 * GPU time (ns) the container (*own) and everyone else (*other) used on d since the previous call.  NVML's
 * sample of a PID averages its use over the query's window, from lastSeenTimeStamp to the sample's time: so
 * each of the container's PIDs is asked for from where it is counted up to, and charged smUtil x (its
 * sample time - that start), never over a span its average was not taken over, and no time twice.  The
 * container's PIDs counted up to the base (d->base_us, the newest sample time of theirs) have no entry;
 * the others (sampled at another time, or idle through the base's samples) have one in d->own.  One query
 * per distinct start, at most MAX_QUERIES (the oldest starts merged into the oldest: counted twice at worst,
 * never missed).  false when NVML cannot tell.
 */
static bool measure(struct dev *d, uint64_t now, double *own, double *other, double *span_ns)
{
    *own = *other = *span_ns = 0;
    probe_sampling(d, now);
    uint64_t base = d->base_us, newest = d->newest_us;
    if (newest > SAMPLE_WINDOW_US && base < newest - SAMPLE_WINDOW_US)
        base = newest - SAMPLE_WINDOW_US; /* a window spans at most 1 s */
    /* The queries: the distinct starts of the PIDs with an entry (the newest ones), then the base. */
    uint64_t base_only[1];
    uint64_t *starts = d->starts != NULL ? d->starts : base_only; /* room for d->nown + 1 */
    unsigned ns = 0;
    for (unsigned i = 0; i < d->nown; i++) {
        d->own[i].hit = false;
        if (d->own[i].us != base)
            starts[ns++] = d->own[i].us;
    }
    qsort(starts, ns, sizeof(*starts), cmp_u64);
    unsigned distinct = 0;
    for (unsigned i = 0; i < ns; i++)
        if (distinct == 0 || starts[distinct - 1] != starts[i])
            starts[distinct++] = starts[i];
    ns = distinct;
    if (ns > MAX_QUERIES - 1) { /* the oldest start, then the newest ones */
        memmove(starts + 1, starts + ns - (MAX_QUERIES - 2), (MAX_QUERIES - 2) * sizeof(*starts));
        ns = MAX_QUERIES - 1;
    }
    starts[ns++] = base;
    uint64_t start[MAX_QUERIES]; /* d->starts moves when an entry is added */
    memcpy(start, starts, ns * sizeof(*start));
    for (unsigned i = 0; i < d->nown; i++) {
        struct own_pid *e = &d->own[i];
        e->q = e->us == base ? ns - 1 : 0;
        for (unsigned k = 0; k + 1 < ns; k++)
            if (start[k] == e->us)
                e->q = k;
    }
    uint64_t t_base = 0, unowned = UINT64_MAX;
    bool answered = false;
    d->self_sampled = false;
    d->self = (unsigned)getpid(); /* a measurement, not a launch: a fork's child has its own */
    for (unsigned q = 0; q < ns; q++) {
        unsigned n = 0;
        nvmlReturn_t rc = query_samples(d, start[q], &n);
        if (rc == NVML_ERROR_NOT_FOUND) {
            answered = true; /* nothing ran since this start */
            continue;
        }
        if (rc != NVML_SUCCESS) {
            if (!d->blind_logged) {
                d->blind_logged = true;
                vc_log(VC_LOG_ERROR, "device %d: NVML's per-process utilisation fails (%d%s): until it answers, "
                       "launches are charged all the time they are outstanding", d->index, (int)rc,
                       rc == NVML_ERROR_INSUFFICIENT_SIZE ? ", more processes than the sample buffer's limit" : "");
            }
            if (!answered)
                return false;
            /* The PIDs of the queries not answered keep their starts (the base too): asked for again next time. */
            for (unsigned i = 0; i < d->nown; i++)
                if (d->own[i].q >= q)
                    d->own[i].hit = true;
            t_base = 0;
            unowned = UINT64_MAX;
            ns = q;
            break;
        }
        answered = true;
        pthread_mutex_lock(&g_pids_mu);
        refresh_pids(now);
        uint64_t t = charge_answer(d, q, start[q], q == ns - 1, n, own, other, &newest, &unowned);
        pthread_mutex_unlock(&g_pids_mu);
        if (q == ns - 1)
            t_base = t;
    }
    if (newest > d->newest_us) {
        *span_ns = (double)(newest - (d->newest_us > base ? d->newest_us : base)) * 1000.0;
        if (d->newest_sampled) {
            uint64_t step = newest - d->newest_us, kept = d->period_us - d->period_us / PERIOD_FORGET;
            if (step > SAMPLE_WINDOW_US)
                step = SAMPLE_WINDOW_US;
            d->period_us = step > kept ? step : kept;
        }
        d->newest_sampled = true;
        d->newest_us = newest;
        /*
         * The provisional charges' lag: a sample is seen some time after its moment (at once on the simulator's
         * defaults, 0.7 s or more on real drivers) and the base it moves is up to a period older still.
         */
        uint64_t seen = real_us(), lag = (seen > newest ? seen - newest : 0) + d->period_us;
        uint64_t kept = d->lag_us - d->lag_us / PERIOD_FORGET;
        d->lag_us = lag > kept ? lag : kept;
    }
    /*
     * The base moves to the container's newest sample time in its answer (its PIDs without a sample were
     * idle until then).  An entry at the base is dropped (the base counts it), and so is one idle for a
     * window (1 s) before the base.
     */
    if (t_base > base)
        base = t_base;
    if (unowned < base)
        base = unowned; /* a PID without an entry is asked for from its sample time: counted twice at worst */
    d->base_us = base;
    uint64_t oldest = base;
    unsigned k = 0;
    for (unsigned i = 0; i < d->nown; i++) {
        struct own_pid e = d->own[i];
        if (e.us == base || (!e.hit && e.us + SAMPLE_WINDOW_US < base))
            continue;
        if (e.us < oldest)
            oldest = e.us;
        d->own[k++] = e;
    }
    d->nown = k;
    /* What the ledger says is measured up to: the oldest start (at most 1 s back). */
    if (newest > SAMPLE_WINDOW_US && oldest < newest - SAMPLE_WINDOW_US)
        oldest = newest - SAMPLE_WINDOW_US;
    d->last_seen_us = oldest;
    return true;
}

/*
 * Contexts being destroyed (vc_context.c): the driver frees their events in the destroy, those of the markers there
 * too, at a moment nobody can tell.  From before the destroy until the markers are forgotten, the slots of such a
 * context are neither asked for nor destroyed to record another's (record_marker records none: the launch goes
 * without a marker).  Forgotten only after the destroy returned, with nothing to stop a look in between, the
 * watcher, a launch waiting for credit or a marker recorded in the slot asked for or destroyed a freed event.  No
 * lock of the limiter is held across the driver's destroy, which waits for the context's work: a host function there
 * waiting for another thread's launch would wait for good.  For the same reason, a context that goes for sure
 * (cuCtxDestroy, cuGreenCtxDestroy, cuDevicePrimaryCtxReset) has its launches count as complete from the start of
 * the destroy (poll_markers passes its markers as complete): its work ends with the destroy, and other threads'
 * launches that wait for credit do not wait for it.  One that may stay (a primary context's release, the last only
 * if the driver says so after) is waited for: poll_markers stops at its first marker until the release returned.
 * The list is written with every device's lock held and read with one.
 */
#define DYING_MAX 16

static struct dying_ctx {
    CUcontext ctx;
    bool sure; /* destroyed for sure: its launches count as complete */
} g_dying[DYING_MAX];
static unsigned g_ndying;

static void lock_devices(void)
{
    for (int i = 0; i < MAX_DEVICES; i++)
        pthread_mutex_lock(&g_dev[i].mu);
}

static void unlock_devices(void)
{
    for (int i = MAX_DEVICES - 1; i >= 0; i--)
        pthread_mutex_unlock(&g_dev[i].mu);
}

/* Whether ctx is being destroyed (a device's lock held); *sure: for sure. */
static bool dying(CUcontext ctx, bool *sure)
{
    for (unsigned i = 0; i < g_ndying; i++) {
        if (g_dying[i].ctx == ctx) {
            *sure = g_dying[i].sure;
            return true;
        }
    }
    return false;
}

void vc_core_context_dying(CUcontext ctx, bool sure)
{
    if (ctx == NULL)
        return;
    for (;;) {
        lock_devices();
        bool room = g_ndying < DYING_MAX;
        if (room)
            g_dying[g_ndying++] = (struct dying_ctx){ctx, sure};
        unlock_devices();
        if (room)
            return;
        sleep_ns(WAIT_MIN_NS); /* DYING_MAX destroys at once: one of them ends soon */
    }
}

void vc_core_context_destroyed(CUcontext ctx, bool gone)
{
    if (gone)
        vc_core_streams_changed();
    if (ctx == NULL)
        return;
    lock_devices();
    for (unsigned i = 0; i < g_ndying; i++) {
        if (g_dying[i].ctx == ctx) {
            g_dying[i] = g_dying[--g_ndying];
            break;
        }
    }
    for (int i = 0; gone && i < MAX_DEVICES; i++) {
        struct dev *d = &g_dev[i];
        for (unsigned k = 0; k < MARKERS; k++) {
            if (d->ev_ctx[k] == ctx) {
                d->ev[k] = NULL; /* the driver's freed memory; those outstanding count as complete */
                d->ev_ctx[k] = NULL;
            }
        }
    }
    unlock_devices();
}

/* ---- completion markers ---------------------------------------------------------------------- */

static void poll_markers(struct dev *d)
{
    CUcontext pushed = NULL; /* the context made current to ask for a marker (its own), if any */
    while (d->n > 0) {
        unsigned h = d->head;
        /* NULL: its context is gone, and the launches with it (vc_core_context_destroyed) */
        if (d->ev[h] != NULL) {
            bool sure = false;
            if (VC_UNLIKELY(g_ndying > 0) && dying(d->ev_ctx[h], &sure)) {
                if (!sure)
                    break; /* a release that may destroy it: looked at again once it returned */
                goto complete; /* its work ends with the destroy (vc_core_context_dying) */
            }
            if (d->ev_ctx[h] != pushed) {
                CUcontext popped;
                if (pushed != NULL)
                    REAL_CU(cuCtxPopCurrent_v2)(&popped);
                pushed = REAL_CU(cuCtxPushCurrent_v2)(d->ev_ctx[h]) == CUDA_SUCCESS ? d->ev_ctx[h] : NULL;
            }
            if (REAL_CU(cuEventQuery)(d->ev[h]) == CUDA_ERROR_NOT_READY)
                break;
        }
    complete:
        /* Complete (or broken: never wait on it again). */
        if (d->ev_count[h] > d->completed)
            d->completed = d->ev_count[h];
        if (d->ev_ok[h] > d->ok_done)
            d->ok_done = d->ev_ok[h];
        d->head = (h + 1) % MARKERS;
        d->n--;
    }
    if (pushed != NULL) {
        CUcontext popped;
        REAL_CU(cuCtxPopCurrent_v2)(&popped);
    }
    if (d->n == 0 && d->unmarked > d->completed && mono_ns() >= d->unmarked_due)
        d->completed = d->unmarked; /* launches without a marker: after the markers out, and their estimated time */
}

/*
 * After a launch (d->mu held): a marker on its stream, in its context.  With all MARKERS out, the newest is recorded
 * again here, so the last launch is always covered (launches without a marker of their own would otherwise count as
 * in flight for ever).  A marker shows every launch before it complete (the ring is asked in order): one of another
 * context, or of another stream, may still run when it completes, at most the work between two markers
 * (MARKER_WORK_NS).  The markers of several contexts share the ring, each event created in its launch's context: a
 * launch in another context than the outstanding markers' once counted complete at once, and with it every launch
 * before it, so that launches round-robin over two contexts were never in flight and went ungated until the next
 * measurement (a whole offer of 50 ms kernels at once under a 30 % limit).
 */
static void mark_unknown(struct dev *d, uint64_t count)
{
    /*
     * No marker for this launch (its stream's context cannot be told or made current: the thread's context stack is
     * full; or the marker could not be recorded: another thread destroyed the stream right after the launch).  It
     * stays in flight until a later marker completes, or until the markers out now have completed and its
     * estimated time (the cost, behind the launches without a marker before it) has passed.  Counted done at once,
     * it made every launch before it done too, and launches made so were never in flight: the gate let 1025
     * kernels of 50 ms through in a second at a 30 % limit.
     */
    uint64_t now = mono_ns(), from = d->unmarked_due > now ? d->unmarked_due : now;
    d->unmarked_due = from + (uint64_t)d->cost;
    if (d->unmarked < count)
        d->unmarked = count;
}

/*
 * A launch the driver refused (d->mu held): it never ran, and counts done with the launches before it, at once when
 * no marker is out (nor a launch without one waiting for its time).  Counted done alone (the count of launches done
 * bumped by one) while markers were out, it stood for an earlier launch: a marker's completion then raised that count
 * no further, and that launch stayed in flight for ever.  Seen after a kernel waited for with cuStreamSynchronize and
 * a burst of refused launches before the watcher had looked: the wall time of that phantom was charged while the
 * cost was still a guess, the credit never came back, and the next launch waited for good.
 */
static void launch_failed(struct dev *d, uint64_t count)
{
    d->refused++; /* never charged provisionally (charge_provisional) */
    if (d->n == 0 && d->unmarked <= d->completed) {
        if (d->completed < count)
            d->completed = count;
    } else if (d->unmarked < count) {
        d->unmarked = count;
    }
}

static bool record_marker(struct dev *d, CUstream s, bool ptsz, uint64_t count);

static void add_marker(struct dev *d, CUstream s, bool ptsz, uint64_t count, CUcontext ctx)
{
    if (ctx == NULL) {
        mark_unknown(d, count);
        return;
    }
    CUcontext cur = NULL;
    bool pushed = false;
    if (REAL_CU(cuCtxGetCurrent)(&cur) != CUDA_SUCCESS || cur != ctx) {
        if (REAL_CU(cuCtxPushCurrent_v2)(ctx) != CUDA_SUCCESS) {
            mark_unknown(d, count);
            return;
        }
        pushed = true;
    }
    d->ok_launched++;
    if (!record_marker(d, s, ptsz, count)) {
        d->ok_launched--;
        mark_unknown(d, count);
    }
    if (pushed) {
        CUcontext popped;
        REAL_CU(cuCtxPopCurrent_v2)(&popped);
    }
}

/* Records a marker after launch `count` on s, in the current context (= ctx); false if it could not. */
static bool record_marker(struct dev *d, CUstream s, bool ptsz, uint64_t count)
{
    CUcontext ctx = NULL;
    if (REAL_CU(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || ctx == NULL)
        return false;
    if (d->n > 0 && (double)(count - d->marked) * d->cost < MARKER_WORK_NS && count - d->marked < MAX_UNSEEN / 2)
        return true; /* cheap launches: one marker per MARKER_WORK_NS of work (and per MAX_UNSEEN / 2) is enough */
    bool full = d->n >= MARKERS;
    unsigned slot = (d->head + d->n - (full ? 1 : 0)) % MARKERS;
    if (d->ev[slot] != NULL && d->ev_ctx[slot] != ctx) {
        bool sure;
        if (VC_UNLIKELY(g_ndying > 0) && dying(d->ev_ctx[slot], &sure))
            return false; /* the driver may be freeing it (vc_core_context_dying) */
        REAL_CU(cuEventDestroy_v2)(d->ev[slot]); /* another context's (alive: vc_core_context_destroyed) */
        d->ev[slot] = NULL;
    }
    if (d->ev[slot] == NULL) {
        if (REAL_CU(cuEventCreate)(&d->ev[slot], CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
            d->ev[slot] = NULL;
            return false;
        }
        d->ev_ctx[slot] = ctx;
    }
    CUresult rc = ptsz ? REAL_CU(cuEventRecord_ptsz)(d->ev[slot], s) : REAL_CU(cuEventRecord)(d->ev[slot], s);
    if (rc != CUDA_SUCCESS)
        return false;
    if (count > d->ev_count[slot] || !full)
        d->ev_count[slot] = count;
    d->ev_ok[slot] = d->ok_launched;
    d->marked = count;
    d->n += full ? 0 : 1;
    return true;
}

/* ---- budget ---------------------------------------------------------------------------------- */

static double in_flight(const struct dev *d)
{
    return d->launched > d->completed ? (double)(d->launched - d->completed) : 0.0;
}

/*
 * The credit kept beyond the work in flight (wall ns of the rate).  Where the driver names one process per sampling
 * period (per_gpu), a process is charged a whole period's time at once when named and nothing in the periods named
 * for others: the credit swings by a period's time between namings, and a cap of less than a few periods cut the
 * refunds of the periods it was not named in (a 30 % container beside a 70 % one ran at 7 %).
 */
static uint64_t burst_wall_ns(const struct dev *d)
{
    uint64_t lumps = d->per_gpu ? (uint64_t)PER_GPU_BURST_PERIODS * d->gpu_period_us * 1000u : 0;
    return lumps > BURST_WALL_NS ? lumps : BURST_WALL_NS;
}

static void refill(struct dev *d, uint64_t now)
{
    if (now > d->last_refill)
        d->credit += d->rate * (double)(now - d->last_refill);
    d->last_refill = now;
    double cap = in_flight(d) * d->cost + d->rate * (double)burst_wall_ns(d) + d->cost;
    if (d->credit > cap)
        d->credit = cap;
}

/* Soft limit: the guaranteed share under contention, up to the ceiling when the GPU has room. */
static void adapt_rate(struct dev *d, double other_ns, double span_ns)
{
    const struct vc_core_config *cfg = vc_core_config();
    double floor = cfg->share / 100.0, ceiling = cfg->ceiling / 100.0;
    if (span_ns > 0) {
        double o = other_ns / span_ns;
        double w = span_ns / 100e6; /* ~100 ms smoothing */
        if (w > 1)
            w = 1;
        d->others += w * ((o > 1 ? 1 : o) - d->others);
    }
    double target = d->others < OTHERS_IDLE ? ceiling : 1.0 - d->others - SOFT_MARGIN;
    target = target < floor ? floor : target > ceiling ? ceiling : target;
    if (target < d->rate)
        d->rate = target;
    else
        d->rate = d->rate + SOFT_RISE < target ? d->rate + SOFT_RISE : target;
}

/*
 * Notes (d->mu held) how many launches that reached the GPU a marker showed complete by real time us (ok_done, at most
 * every DONE_STEP_US): the cost learns from them.
 */
static void note_done(struct dev *d, uint64_t us)
{
    if (d->done_n > 0) {
        unsigned newest = (d->done_head + d->done_n - 1) % DONE_HISTORY;
        if (d->done_count[newest] == d->ok_done || us < d->done_us[newest] + DONE_STEP_US)
            return; /* nothing new, or too soon: counted at a later time (a sample's share of it one period late) */
    }
    if (d->done_n == DONE_HISTORY) {
        d->done_head = (d->done_head + 1) % DONE_HISTORY;
        d->done_n--;
    }
    unsigned slot = (d->done_head + d->done_n) % DONE_HISTORY;
    d->done_us[slot] = us;
    d->done_count[slot] = d->ok_done; /* not launches that failed (counted complete): 2000 of them made the cost tiny */
    d->done_n++;
}

/*
 * The launches known complete by real time us (d->mu held): the newest count noted at or before it.  false when the
 * history no longer reaches back that far.
 */
static bool done_at(const struct dev *d, uint64_t us, uint64_t *count)
{
    if (d->done_n == 0 || d->done_us[d->done_head] > us)
        return false;
    unsigned lo = 0, hi = d->done_n; /* the first entry newer than us, in [1, done_n] */
    while (lo < hi) {
        unsigned mid = lo + (hi - lo) / 2;
        if (d->done_us[(d->done_head + mid) % DONE_HISTORY] <= us)
            lo = mid + 1;
        else
            hi = mid;
    }
    *count = d->done_count[(d->done_head + lo - 1) % DONE_HISTORY];
    return true;
}

/*
 * The cost per launch is at most the wall time this process had launches outstanding per launch completed: no launch
 * uses more GPU time than it is outstanding.  NVML cannot always tell the cost: an H200 with driver 580 names, for
 * each 200 ms period, the process with the most GPU time in it, with the whole GPU's busy percent, so a 30 % container
 * beside a 70 % one learnt 8.1 ms for its 1 ms kernels from its first sample (the whole GPU's time over its first
 * launches), or kept the 5 ms guess when it was never named, and was never named again to learn better: it ran at 7 %.
 * The bound is an upper bound of the truth too (the wall time counts the time the GPU gave other contexts).  Only
 * launches that reached the GPU and whose completion a marker showed count (ok_done): a failed launch, or one counted
 * done unseen (mark_unknown), took no wall time here, and counted, a burst of them made the bound nanoseconds.  The
 * bound is set anew over every WALL_BOUND_LAUNCHES such launches and WALL_BOUND_NS of wall time with launches
 * outstanding, so it rises with longer kernels; and it is dropped as soon as the launches outstanding have taken more
 * than twice it would allow (long kernels queued under a bound set by short ones).  Only for a process alone in its
 * container: with several, the cost is the container's time per launch of this process (each charges the
 * container's time), more than this process's own wall time per launch, and bounded by it three processes of 10 us
 * kernels launched three times their share until the late samples came (73 % of a 50 % limit for half a second).
 * d->mu held.
 */
static void set_cost(struct dev *d)
{
    d->cost = d->wall_cost > 0 && d->wall_cost < d->free_cost ? d->wall_cost : d->free_cost;
}

static void revalue_provisional(struct dev *d);

static void bound_cost(struct dev *d, double busy)
{
    d->wall_busy += busy;
    double done = (double)(d->ok_done - d->wall_from);
    if (d->wall_cost > 0 && d->wall_busy > WALL_BOUND_NS &&
        d->wall_busy > 2.0 * d->wall_cost * (done + in_flight(d))) {
        d->wall_cost = 0; /* the launches take longer now than the bound allows: the estimate alone, until set anew */
        set_cost(d);
    }
    if (done < WALL_BOUND_LAUNCHES || d->wall_busy < WALL_BOUND_NS)
        return;
    double before = d->cost;
    d->wall_cost = alone_in_container() ? d->wall_busy / done : 0;
    d->wall_busy = 0;
    d->wall_from = d->ok_done;
    set_cost(d);
    if (d->cost_learnt && (d->cost < before * 0.5 || d->cost > before * 2.0))
        revalue_provisional(d);
}

/*
 * NVML's samples come a sampling period late (1/6 s to 1 s on real GPUs; the simulator's default is 10 ms,
 * GPUSIM_PROCESS_SAMPLE_PERIOD_US sets it), and a real driver shows each 0.7 s or more after its time
 * (GPUSIM_PROCESS_SAMPLE_DELAY_US): without a charge meanwhile, launches would go unpaced for a period and that
 * delay, then pause for the debt, and the share would swing.  So each completed launch is charged its estimated
 * cost at once, provisionally (d->mu held); when the samples reach the time it was charged at, the provisional
 * charge is refunded and the measured time stands instead.
 */
static void charge_provisional(struct dev *d, uint64_t now)
{
    /*
     * Until the first measured cost, the guess may be far too small (50 ms kernels against a 5 ms guess flooded
     * the GPU for a whole sampling period, then paid for it at 0 %): the wall time a launch was outstanding
     * bounds its GPU time, so at least that is charged.
     */
    double busy = 0;
    if (now > d->prov_wall && (in_flight(d) > 0 || d->completed > d->prov_completed))
        busy = (double)(now - d->prov_wall);
    double wall = d->cost_learnt ? 0 : busy;
    if (now > d->prov_wall)
        d->prov_wall = now;
    if (d->completed <= d->prov_completed && wall <= 0) {
        bound_cost(d, busy);
        d->prov_completed = d->completed;
        return;
    }
    /*
     * Launches the driver refused count complete with the others but never ran: they are left out (one for each
     * completion, as they come: in all, the completions charged are the launches that ran).  Charged at the cost,
     * 1264 refused launches of a process whose kernels had taught it 47 ms each were a debt of 59 s, which no sample
     * of its idle time ever refunded: the next launch waited for minutes (review12_sm failed-burst-learnt).
     */
    uint64_t completions = d->completed > d->prov_completed ? d->completed - d->prov_completed : 0;
    uint64_t left_out = d->refused - d->prov_refused < completions ? d->refused - d->prov_refused : completions;
    d->prov_refused += left_out;
    double count = (double)(completions - left_out);
    bound_cost(d, busy);
    double ns = count * d->cost;
    if (ns < wall)
        ns = wall;
    d->prov_completed = d->completed;
    d->credit -= ns;
    uint64_t us = real_us();
    note_done(d, us);
    /*
     * The ring spans twice the samples' lag: a charge within lag / (PROVISIONAL / 2) of the newest slot's opening
     * joins it (refunded that much later at most).  With a slot per charge (one each tick, one each blocked launch:
     * hundreds a second) a lag of a second overfilled it, and each charge merged its oldest into the next: the
     * oldest slot's time then moved as fast as the clock, stayed younger than the samples, and nothing was refunded
     * until the launches stopped: a debt, a pause, then a refund the credit cap cut (50 % gave 30 %).
     */
    uint64_t grain = d->lag_us / (PROVISIONAL / 2);
    if (d->prov_n > 0 && grain > 0 && us < d->prov_open_us + grain) {
        unsigned newest = (d->prov_head + d->prov_n - 1) % PROVISIONAL;
        d->prov_ns[newest] += ns;
        d->prov_done[newest] += count;
        if (us > d->prov_us[newest])
            d->prov_us[newest] = us;
        return;
    }
    d->prov_open_us = us;
    if (d->prov_n == PROVISIONAL) {
        /*
         * Full: the oldest charge joins the next one (refunded with it: a slot later, never early).  Merging into
         * the newest instead moved its time to now at every charge, so at a long sampling period (a charge every
         * tick, more than PROVISIONAL a period) most of a period's charges stayed unrefunded a period longer than
         * the samples that covered them: a debt of a period's use, then a refund the credit cap cut off.
         */
        unsigned next = (d->prov_head + 1) % PROVISIONAL;
        d->prov_ns[next] += d->prov_ns[d->prov_head];
        d->prov_done[next] += d->prov_done[d->prov_head];
        d->prov_head = next;
        d->prov_n--;
    }
    unsigned slot = (d->prov_head + d->prov_n) % PROVISIONAL;
    d->prov_us[slot] = us;
    d->prov_ns[slot] = ns;
    d->prov_done[slot] = count;
    d->prov_n++;
}

/*
 * The cost was first learnt, or changed by a factor of 2 or more (d->mu held): the provisional charges not yet covered
 * by samples are made again at it (10 us kernels halve from the first guess for a second: the charges at each older
 * cost came back a sample at a time too, and 3 processes ran 74-100 % under a 50 % limit for most of a second).
 * Charged at the first guess (5 ms for 1 ms kernels) or at the wall time launches were outstanding, they held the
 * container far below its share until the samples came; refunded a sample at a time (samples 1 s late: for a
 * second), each refund was spent as it came and the share went 30 points over the limit for that second.  Made again
 * at once, the over-charge comes back in one step, which the credit cap bounds.  Only then: at every change
 * (several processes' costs move by tens of percent from one sample to the next) the cap cut the rises and kept the
 * falls of a second's charges, and 50 % gave 45 %.
 */
static void revalue_provisional(struct dev *d)
{
    for (unsigned k = 0; k < d->prov_n; k++) {
        unsigned i = (d->prov_head + k) % PROVISIONAL;
        double ns = d->prov_done[i] * d->cost;
        d->credit += d->prov_ns[i] - ns;
        d->prov_ns[i] = ns;
    }
}

/* Refunds the provisional charges made at or before sample time upto_us (all of them: UINT64_MAX). */
static void refund_provisional(struct dev *d, uint64_t upto_us)
{
    while (d->prov_n > 0 && d->prov_us[d->prov_head] <= upto_us) {
        d->credit += d->prov_ns[d->prov_head];
        d->prov_head = (d->prov_head + 1) % PROVISIONAL;
        d->prov_n--;
    }
}

/* The provisional charges of this process not yet covered by samples (ns). */
static double provisional_ns(const struct dev *d)
{
    double sum = 0;
    for (unsigned k = 0; k < d->prov_n; k++)
        sum += d->prov_ns[(d->prov_head + k) % PROVISIONAL];
    return sum;
}

/*
 * The container's sum of provisional charges (the budget file) follows this process's (d->mu held).  A process that
 * exits before NVML's samples cover its charges (samples come 0.7 s or more late on real drivers; a process of one
 * 400 ms kernel is gone by then, and its late samples are no longer the container's once it is gone) leaves
 * them there, and the next process starts with them as debt; a process that lives refunds its part as the samples
 * come, so the measured time, published in the ledger, is not counted twice.
 */
static void share_provisional(struct dev *d, uint64_t now)
{
    if (d->rate <= 0 || vc_core_config()->upstream)
        return;
    double want = provisional_ns(d) / d->rate;
    double delta = want - d->prov_shared;
    if (delta > -1000.0 && delta < 1000.0 && !(want == 0 && d->prov_shared != 0))
        return;
    vc_budget_core_provisional(d->index, now, (int64_t)delta);
    d->prov_shared = want;
}

/* Refill, markers, and (at most every min_ns) the measured GPU time (d->mu held). */
static void update(struct dev *d, uint64_t now, uint64_t min_ns)
{
    refill(d, now);
    poll_markers(d);
    charge_provisional(d, now);
    share_provisional(d, now);
    /*
     * The clock read again, after the markers: a stop (SIGSTOP, a debugger) that lands after the caller read it (the
     * watcher reads it before taking d->mu) showed the launches the stop hid complete, while the gap measured from
     * the time read before it hid the stop itself: a 2.5 s kernel queued before a 3.5 s stop went unpaid.
     */
    const uint64_t fresh = mono_ns();
    if (fresh > now)
        now = fresh;
    if (now - d->last_measure < min_ns)
        return;
    /*
     * NVML answers for the last second only (SAMPLE_WINDOW_US).  When this process measured nothing for longer (it
     * was stopped: SIGSTOP, a debugger, a thread stuck under d->mu) while its launches were outstanding, the GPU ran
     * them meanwhile and the time beyond that second can no longer be measured: it is charged as used (all of it:
     * more than the GPU time they can have used).  Without this, a 2.5 s kernel queued before a 3.5 s stop cost
     * 1 s of the container's share, and a tenant could repeat it (a long kernel, a stop) for most of the GPU.
     */
    /* Read again above; a caller's now may still trail a measurement made meanwhile. */
    const uint64_t gap = now > d->last_measure ? now - d->last_measure : 0;
    const bool stalled = gap > SAMPLE_WINDOW_US * 1000u && (d->busy_measured || d->launched != d->launched_measured);
    d->launched_measured = d->launched;
    double own, other, span;
    if (!measure(d, now, &own, &other, &span)) {
        /*
         * Fail closed: every wall ns in which this process had a launch outstanding is charged (more than the
         * GPU time it can have used), so launches are paced at the rate without credit for unmeasured time.
         * The charge goes into the container's ledger, and each process's credit is at most minus its debt:
         * the container's processes pay for each other's time (and a process started later inherits it).
         */
        bool busy = in_flight(d) > 0 || d->completed != d->completed_seen;
        double charge = busy ? (double)gap : 0.0;
        refund_provisional(d, UINT64_MAX); /* the wall time charged covers them */
        share_provisional(d, now);
        d->credit -= charge;
        if (d->rate > 0 && !vc_core_config()->upstream) {
            uint64_t until = vc_budget_core_charge(d->index, now, (uint64_t)(charge / d->rate));
            double debt = until > now ? d->rate * (double)(until - now) : 0.0;
            if (d->credit > -debt)
                d->credit = -debt;
        }
        d->completed_seen = d->completed;
        d->last_measure = now;
        d->last_seen_us = d->newest_us = d->base_us = real_us(); /* when NVML answers again, it is not asked for this time twice */
        d->newest_sampled = false;
        d->nown = 0;
        d->blind = true;
        d->busy_measured = in_flight(d) > 0;
        return;
    }
    if (d->blind) {
        d->blind = false;
        vc_log(VC_LOG_INFO, "device %d: NVML's per-process utilisation answers again", d->index);
    }
    d->last_measure = now;
    d->credit -= own;
    d->measured += own;
    if (VC_UNLIKELY(stalled)) {
        double lost = (double)(gap - SAMPLE_WINDOW_US * 1000u);
        d->credit -= lost;
        vc_log(VC_LOG_INFO, "device %d: nothing measured for %.2f s while launches were outstanding: the %.2f s "
               "NVML no longer answers for are charged as used", d->index, (double)gap / 1e9, lost / 1e9);
    }
    d->busy_measured = in_flight(d) > 0;
    refund_provisional(d, d->base_us);
    /*
     * The container's ledger: processes started later begin with this debt (init_device), the measured part (the
     * provisional charges are in the container's sum of them, share_provisional).
     */
    double debt = -(d->credit + provisional_ns(d));
    if (d->prov_inherited > now)
        debt -= d->rate * (double)(d->prov_inherited - now); /* still in the container's sum: not counted twice */
    uint64_t until = debt > 0 && d->rate > 0 ? now + (uint64_t)(debt / d->rate) : now;
    vc_budget_core_publish(d->index, until, d->last_seen_us);
    if (now >= d->next_log) {
        d->next_log = now + 1000000000u;
        vc_log(VC_LOG_DEBUG, "device %d: rate %.3f credit %.0f us cost %.1f us%s in flight %.0f measured %.3f s; "
               "sampled %s, period %llu us (per GPU %llu us), self sampled %d, base %lld us ago",
               d->index, d->rate, d->credit / 1e3, d->cost / 1e3, d->cost_learnt ? "" : " (guess)", in_flight(d),
               d->measured / 1e9, d->per_gpu ? "per GPU" : "per process", (unsigned long long)d->period_us,
               (unsigned long long)d->gpu_period_us, (int)d->self_sampled, (long long)(real_us() - d->base_us));
    }
    /*
     * The cost: the container's time measured over this process's launches completed in the same stretch, learnt
     * when this process's own sample comes (a sampling period apart): between them launches complete while no time
     * is measured.  Learning at any sample of the container's (another process's, just started, covers a sliver)
     * divided a sliver of time by a period's launches: the cost fell to microseconds and launches flooded the GPU.
     * The launches are those complete by the sample's time, not by now: a real driver shows a sample 0.7 s or more
     * after its time, and the first sample (a period's time) over the launches of a period and that delay made the
     * cost a fifth of the truth at a 1/6 s period: launches flooded the GPU for seconds, then paid at 0 %.
     */
    d->own_unlearnt += own;
    uint64_t done_then = 0;
    bool known = d->self_sampled && done_at(d, d->self_us, &done_then);
    if (d->self_sampled)
        d->completed_seen = d->completed;
    if (d->self_sampled && (!known || !d->learn_known)) {
        /* The stretch's launches cannot be told (the history no longer reaches its start): learnt from the next. */
        d->own_unlearnt = 0;
        d->learn_known = known;
        d->learn_done = done_then;
    } else if (d->self_sampled) {
        bool revalue = !d->cost_learnt;
        double before = d->cost;
        double done = done_then > d->learn_done ? (double)(done_then - d->learn_done) : 0.0;
        d->learn_done = done_then;
        d->acc_busy = d->acc_busy * COST_DECAY + d->own_unlearnt;
        d->own_unlearnt = 0;
        d->acc_done = d->acc_done * COST_DECAY + done;
        if (d->acc_done >= 1.0 && d->acc_busy > 0) {
            d->free_cost = d->acc_busy / d->acc_done;
            set_cost(d); /* bounded by the wall time outstanding (the whole GPU's time named for this process) */
            d->cost_learnt = true;
        } else if (done > 0 && d->self_sampled) {
            /*
             * Launches complete but NVML sees no time in this process's own sample: tiny kernels (halving: a lagging
             * sample is harmless).  Only its own: another process of the container just started shows 0 % too, and
             * each of its samples halved the cost of a process not sampled yet, down to a flood of launches.
             */
            d->free_cost = d->cost * 0.5;
            set_cost(d);
            d->cost_learnt = true; /* measured: tiny, so the wall time outstanding is no bound worth charging */
            revalue = true;
        }
        revalue = revalue || d->cost < before * 0.5 || d->cost > before * 2.0;
        if (revalue && d->cost_learnt)
            revalue_provisional(d); /* never before: the charges at the wall time outstanding bound the guess */
    }
    share_provisional(d, now);
    if (vc_core_config()->soft) {
        if (counted_all_as_own()) {
            /* The neighbours' time is in `own` now: they cannot be told idle, so the soft limit holds at its share. */
            d->others = 1.0;
            adapt_rate(d, 0.0, 0.0);
        } else {
            adapt_rate(d, other, span);
        }
    }
}

/* Waits until the launch fits; returns its number (1, 2, ...). */
static uint64_t budget_gate(struct dev *d)
{
    pthread_mutex_lock(&d->mu);
    uint64_t now = mono_ns();
    refill(d, now); /* the fast path: markers are polled only when the launch would have to wait */
    /*
     * ... and NVML is asked only by the watcher, every 10 ms.  Where it has not measured for a while (the tenant ended
     * the thread: a signal handler that calls pthread_exit; it could not be started; it is starved), the launch
     * measures first: else launches spaced so that the refill covered each one's cost (a 2.5 s kernel every 300 ms
     * at 30 %) never looked at what the GPU ran for them.
     */
    if (VC_UNLIKELY(now > d->last_measure && now - d->last_measure > WATCHER_LATE_NS))
        update(d, now, 0);
    while (d->credit < in_flight(d) * d->cost || in_flight(d) >= MAX_UNSEEN) {
        update(d, now, MEASURE_MIN_NS);
        double missing = in_flight(d) * d->cost - d->credit;
        if (missing <= 0 && in_flight(d) < MAX_UNSEEN)
            break;
        /* Credit enough, MAX_UNSEEN in flight: looked at again when the oldest may have completed. */
        double wait = missing <= 0 ? d->cost : d->rate > 0 ? missing / d->rate : (double)WAIT_MAX_NS;
        uint64_t w = wait < (double)WAIT_MIN_NS ? WAIT_MIN_NS : wait > (double)WAIT_MAX_NS ? WAIT_MAX_NS : (uint64_t)wait;
        /*
         * With launches outstanding, a process alone in its container looks for their completion at least every
         * WAIT_IN_FLIGHT_NS: seen up to 10 ms late, it counted as wall time outstanding, and the cost's wall bound
         * (bound_cost) of a container paced at a few ms a launch rose with its own waits.  Only there: the bound
         * applies to no other, and three processes of 50 ms kernels under a 30 % limit with samples 0.7 s late
         * that all woke every 1 ms swung to 46-51 % of the GPU for half a second in 4 of 10 runs (in none of 16
         * without).
         */
        if (in_flight(d) > 0 && w > WAIT_IN_FLIGHT_NS && alone_in_container())
            w = WAIT_IN_FLIGHT_NS;
        pthread_mutex_unlock(&d->mu);
        sleep_ns(w);
        pthread_mutex_lock(&d->mu);
        now = mono_ns();
        refill(d, now);
    }
    uint64_t count = ++d->launched;
    pthread_mutex_unlock(&d->mu);
    return count;
}

/* ---- upstream (interceptors.md 1.7) ------------------------------------------------------------ */

static int64_t up_delta(const struct dev *d, int up_limit, int user_current, int64_t share)
{
    int64_t diff = up_limit > user_current ? up_limit - user_current : user_current - up_limit;
    if (diff < 5)
        diff = 5;
    int64_t inc = d->up_sm * d->up_sm * d->up_thr / 256 * diff / 10;
    if (diff > up_limit / 2)
        inc = inc * diff * 2 / (up_limit + 1);
    if (user_current <= up_limit)
        share = share + inc > d->up_total ? d->up_total : share + inc;
    else
        share = share - inc < 0 ? 0 : share - inc;
    return share;
}

static void up_tick(struct dev *d, uint64_t now)
{
    const struct vc_core_config *cfg = vc_core_config();
    unsigned count = 0;
    REAL_NVML(nvmlDeviceGetComputeRunningProcesses_v3)(d->nvml, &count, NULL);
    static _Thread_local nvmlProcessUtilizationSample_t buf[MAX_SAMPLES];
    unsigned n = MAX_SAMPLES;
    uint64_t check = real_us() - 1000000u;
    int user = 0, sys = 0;
    if (REAL_NVML(nvmlDeviceGetProcessUtilization)(d->nvml, buf, &n, check) == NVML_SUCCESS) {
        pthread_mutex_lock(&g_pids_mu);
        refresh_pids(now);
        for (unsigned i = 0; i < n && i < MAX_SAMPLES; i++) {
            if (buf[i].timeStamp < check)
                continue;
            int v = buf[i].smUtil <= 100 ? (int)buf[i].smUtil : 0;
            sys += v;
            if (in_container(buf[i].pid))
                user += v;
        }
        pthread_mutex_unlock(&g_pids_mu);
    }
    int sys_free = 100 - sys;
    int64_t cur;
    if (!cfg->soft) {
        if (count <= 1 && user < cfg->share / 10) {
            atomic_store(&d->up_cur, up_delta(d, cfg->share, user, d->up_share));
            return;
        }
        d->up_share = up_delta(d, cfg->share, user, d->up_share);
    } else {
        if ((int)count > d->up_procs) {
            d->up_share = d->up_thr;
            d->up_limit = cfg->share;
            d->up_i = 0;
            d->up_avg_free = 0;
        }
        d->up_procs = (int)count;
        if (count <= 1) {
            d->up_share = up_delta(d, cfg->ceiling, user, d->up_share);
        } else {
            d->up_i++;
            d->up_avg_free += sys_free;
            if (d->up_i % UP_CHANGE_LIMIT_INTERVAL == 0) {
                if (d->up_avg_free * 2 / UP_CHANGE_LIMIT_INTERVAL > UP_USAGE_THRESHOLD) {
                    d->up_limit += cfg->share / 10;
                    if (d->up_limit > cfg->ceiling)
                        d->up_limit = cfg->ceiling;
                }
                d->up_i = 0;
            }
            if (d->up_i % (UP_CHANGE_LIMIT_INTERVAL / 2) == 0)
                d->up_avg_free = 0;
            d->up_share = up_delta(d, d->up_limit, user, d->up_share);
        }
    }
    cur = atomic_load(&d->up_cur);
    int64_t next;
    do {
        next = cur + d->up_share > d->up_total ? d->up_total : cur + d->up_share;
    } while (!atomic_compare_exchange_weak(&d->up_cur, &cur, next));
}

static void up_gate(struct dev *d, uint64_t grids)
{
    int64_t cur = atomic_load(&d->up_cur);
    for (;;) {
        while (cur < 0) {
            sleep_ns(UP_WAIT_NS);
            cur = atomic_load(&d->up_cur);
        }
        if (atomic_compare_exchange_weak(&d->up_cur, &cur, cur - (int64_t)grids))
            return;
    }
}

/* ---- devices and the watcher ---------------------------------------------------------------- */

#ifdef VC_TEST_HOOKS
/*
 * Tests only (built with -DVC_TEST_HOOKS): VCUDA_TEST_WATCHER_DELAY_US between the watcher reading the clock and taking a
 * device's lock, where a stop (SIGSTOP) can land on a busy machine.
 */
static void test_watcher_delay(void)
{
    const char *us = getenv("VCUDA_TEST_WATCHER_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
#else
static void test_watcher_delay(void) {}
#endif

static void *watcher(void *arg)
{
    (void)arg;
    const bool upstream = vc_core_config()->upstream;
    for (;;) {
        sleep_ns(TICK_NS);
        uint64_t now = mono_ns();
        for (int i = 0; i < MAX_DEVICES; i++) {
            struct dev *d = &g_dev[i];
            if (!__atomic_load_n(&d->usable, __ATOMIC_ACQUIRE))
                continue;
            test_watcher_delay();
            pthread_mutex_lock(&d->mu);
            if (upstream) {
                if (now >= d->up_next) {
                    d->up_next = now + UP_TICK_NS;
                    up_tick(d, now);
                }
            } else {
                update(d, now, 0);
            }
            pthread_mutex_unlock(&d->mu);
            log_sampling(d);
        }
    }
    return NULL;
}

/*
 * A new process (or a forked child) starts where the container's ledger stands: with the debt of GPU time
 * its processes used beyond the share, and measuring from the NVML sample time that debt covers (at most
 * LEDGER_LOOKBACK_US back), so what a process that is gone used after its last measurement counts too.
 * Otherwise every new process would get its first launch free and the debt of those before it would be
 * forgotten: a tenant could start one process per long kernel and take the whole GPU.
 */
static void inherit_ledger(struct dev *d, int index)
{
    uint64_t until, seen, prov;
    vc_budget_core_ledger(index, &until, &seen, &prov);
    uint64_t now = d->last_refill;
    /* The measured debt and the provisional charges samples do not cover yet (of processes gone, too). */
    double owed = (until > now ? (double)(until - now) : 0.0) + (prov > now ? (double)(prov - now) : 0.0);
    if (owed > 0)
        d->credit = -d->rate * owed;
    d->prov_inherited = prov;
    /*
     * The sampling the container's processes learnt: a process that lives a few periods may never see a PID of its
     * own named twice in one answer, and charged each per-GPU sample over the time since the query's start (up to a
     * second at the GPU's busy percent) it held fresh processes of one 400 ms kernel to 20 % of a 30 % share.  Where
     * they saw per-GPU sampling, this process looks at a whole window's answer at its first measurement and every
     * 50 ms for a second (probe_sampling), and charges per GPU once an answer of its own shows it.  The file's word
     * is never charged by: the tenant can write it.  Taken as the sampling, a period of 2 us written there let fresh
     * processes of a 30 % container take 62 %; with a per-process driver, charging per GPU on that word alone (each
     * sample over the time since another process's) let them take 41 %.
     */
    if (vc_budget_core_sampling(index) > VC_SAMPLING_PER_PROCESS)
        d->eager_looks = EAGER_LOOKS;
    if (seen > 0 && seen < d->last_seen_us)
        d->last_seen_us = d->last_seen_us - seen > LEDGER_LOOKBACK_US ? d->last_seen_us - LEDGER_LOOKBACK_US : seen;
}

#ifdef VC_TEST_HOOKS
/* Tests only: VCUDA_TEST_INIT_DELAY_US in the middle of a device's set-up, between its first and its second store. */
static void test_init_delay(void)
{
    const char *us = getenv("VCUDA_TEST_INIT_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}
#else
#define test_init_delay() ((void)0)
#endif

static void init_device(struct dev *d, int index)
{
    pthread_mutex_lock(&g_init_mu);
    if (d->ready) {
        pthread_mutex_unlock(&g_init_mu);
        return;
    }
    const struct vc_core_config *cfg = vc_core_config();
    d->index = index;
    d->rate = cfg->soft ? cfg->ceiling / 100.0 : cfg->share / 100.0;
    d->cost = d->free_cost = INITIAL_COST_NS;
    d->last_refill = d->last_measure = d->prov_wall = mono_ns();
    d->last_seen_us = real_us();
    /* No launch complete yet: this process's first sample learns the cost from its launches complete by then. */
    d->done_us[0] = d->last_seen_us;
    d->done_count[0] = 0;
    d->done_head = 0;
    d->done_n = 1;
    d->learn_known = true;
    d->learn_done = 0;
    if (!cfg->upstream) {
        vc_budget_join();
        inherit_ledger(d, index);
    }
    d->newest_us = d->base_us = d->last_seen_us;
    bool found = vc_nvml_device(index, &d->nvml);
    int sm = 0, thr = 0;
    REAL_CU(cuDeviceGetAttribute)(&sm, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, index);
    REAL_CU(cuDeviceGetAttribute)(&thr, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, index);
    d->up_sm = sm > 0 ? sm : 1;
    d->up_thr = thr > 0 ? thr : 1024;
    d->up_total = d->up_sm * d->up_thr * UP_FACTOR;
    d->up_limit = cfg->share;
    /*
     * usable before ready: a launch that finds the device ready goes by usable alone (gate_charge).  The other order
     * let another thread's launches through ungated between the two stores (for as long as this thread was
     * preempted there).
     */
    if (found)
        __atomic_store_n(&d->usable, true, __ATOMIC_RELEASE);
    test_init_delay();
    __atomic_store_n(&d->ready, true, __ATOMIC_RELEASE);
    if (!found) {
        vc_log(VC_LOG_ERROR, "device %d: no NVML handle (NVML %s): the SM limit is NOT enforced on it", index,
               vc_nvml_ready() ? "has no such UUID" : "unavailable");
    } else {
        vc_log(VC_LOG_INFO, "device %d: SM limit %d%%%s, %s", index, cfg->share,
               cfg->soft ? " (soft)" : "", cfg->upstream ? "upstream algorithm" : "budget algorithm");
        if (!g_watcher) {
            pthread_t t;
            pthread_attr_t a;
            pthread_attr_init(&a);
            pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
            g_watcher = pthread_create(&t, &a, watcher, NULL) == 0;
            pthread_attr_destroy(&a);
        }
    }
    pthread_mutex_unlock(&g_init_mu);
}

static void atfork_child(void)
{
    /*
     * The child has no watcher and none of the parent's events; it starts afresh.  The buffers are dropped, never
     * freed: another thread of the parent may have been growing one at the fork (realloc done, its new address not
     * yet stored), and the address the child holds is then already free.  What they held stays allocated in the
     * child (a few KiB per device the parent measured).
     */
    for (int i = 0; i < MAX_DEVICES; i++) {
        memset(&g_dev[i], 0, sizeof(g_dev[i]));
        pthread_mutex_init(&g_dev[i].mu, NULL);
    }
    pthread_mutex_init(&g_init_mu, NULL);
    pthread_mutex_init(&g_pids_mu, NULL);
    g_watcher = false;
    g_pids_owner = 0;
    g_slot_others = g_file_others = 0; /* read again by the child itself (alone_in_container) */
    g_pids = NULL, g_npids = g_pids_cap = 0; /* the same for the PID lists (grown under g_pids_mu) */
    g_file_pids = NULL, g_nfile_pids = g_file_cap = 0;
    g_pids_stamp = (struct pids_stamp){0};
}

__attribute__((constructor)) static void vc_core_init(void)
{
    for (int i = 0; i < MAX_DEVICES; i++)
        pthread_mutex_init(&g_dev[i].mu, NULL);
    pthread_atfork(NULL, NULL, atfork_child);
}

/* ---- the gate around every launch ------------------------------------------------------------- */

struct gate {
    struct dev *d; /* NULL: not limited (bypass) */
    uint64_t count;
    CUcontext ctx;    /* the launch's context (NULL: unknown) */
    bool captured;    /* let through as recorded into the stream's capture ... */
    uint64_t capture; /* ... of this id (cuStreamGetCaptureInfo) */
    uint64_t grids;   /* upstream's cost */
    bool upstream_hooks;
};

/*
 * Which device a launch on stream s runs on.  cuda.h: a CUkernel (and a graph) runs in the context of
 * its stream, current or not; a special stream (NULL, legacy, per-thread) means the current context.
 * Created streams are looked up once per thread (a small cache, dropped whenever a stream or context
 * is destroyed anywhere in the process).  When the device cannot be told, the launch is gated on the
 * container's first GPU: a launch is never let through ungated.
 */
#define STREAM_CACHE 4
struct stream_hit {
    CUstream s;
    CUcontext ctx;
    int dev;
    uint64_t gen;
};
static _Thread_local struct stream_hit tl_streams[STREAM_CACHE];
static _Thread_local unsigned tl_next;
static _Atomic uint64_t g_stream_gen = 1;

static bool special_stream(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

static int ctx_device(CUcontext ctx, CUcontext current)
{
    CUdevice dev = -1;
    if (ctx == current)
        return REAL_CU(cuCtxGetDevice)(&dev) == CUDA_SUCCESS ? dev : -1;
    return vc_ctx_device(ctx);
}

static int launch_device(CUstream s, CUcontext *ctx_out)
{
    CUcontext current = NULL, ctx = NULL;
    int dev = -1;
    if (REAL_CU(cuCtxGetCurrent)(&current) != CUDA_SUCCESS)
        current = NULL;
    if (special_stream(s)) {
        ctx = current;
        if (ctx != NULL)
            dev = ctx_device(ctx, current);
    } else {
        uint64_t gen = atomic_load_explicit(&g_stream_gen, memory_order_acquire);
        for (unsigned i = 0; i < STREAM_CACHE; i++) {
            if (tl_streams[i].s == s && tl_streams[i].gen == gen) {
                *ctx_out = tl_streams[i].ctx;
                return tl_streams[i].dev;
            }
        }
        if (REAL_CU(cuStreamGetCtx)(s, &ctx) == CUDA_SUCCESS && ctx != NULL)
            dev = ctx_device(ctx, current);
        if (dev >= 0 && dev < MAX_DEVICES) {
            tl_streams[tl_next] = (struct stream_hit){s, ctx, dev, gen};
            tl_next = (tl_next + 1) % STREAM_CACHE;
        }
    }
    if (dev < 0 || dev >= MAX_DEVICES) {
        vc_log(VC_LOG_DEBUG, "launch on stream %p: its device is unknown; gated as device 0", (void *)s);
        dev = 0;
        ctx = NULL;
    }
    *ctx_out = ctx;
    return dev;
}

int vc_stream_device(CUstream s)
{
    CUcontext ctx;
    return launch_device(s, &ctx);
}

/* A stream or context went away: cached stream lookups of every thread are stale. */
void vc_core_streams_changed(void)
{
    atomic_fetch_add_explicit(&g_stream_gen, 1, memory_order_acq_rel);
}


#ifdef VC_TEST_HOOKS
/*
 * Tests only (built with -DVC_TEST_HOOKS): VCUDA_TEST_CAPTURE_DELAY_US between the capture check and the launch of a
 * launch let through as captured; VCUDA_TEST_REPORT_LAUNCHES: at exit, stderr tells how many launches device 0 counted.
 */
static void test_capture_delay(void)
{
    const char *us = getenv("VCUDA_TEST_CAPTURE_DELAY_US");
    if (us != NULL)
        usleep((useconds_t)atoi(us));
}

static void test_report_launches(void)
{
    fprintf(stderr, "vcuda test: device 0 counted %llu launches\n", (unsigned long long)g_dev[0].launched);
}

__attribute__((constructor)) static void test_hooks_init(void)
{
    if (getenv("VCUDA_TEST_REPORT_LAUNCHES") != NULL)
        atexit(test_report_launches);
}
#else
#define test_capture_delay() ((void)0)
#endif

/* The SM gate proper: waits until the launch may go and counts it (or after it went: charge_launch below). */
static void gate_charge(struct gate *g, CUstream s)
{
    int dev = launch_device(s, &g->ctx);
    struct dev *d = &g_dev[dev];
    if (VC_UNLIKELY(!__atomic_load_n(&d->ready, __ATOMIC_ACQUIRE)))
        init_device(d, dev);
    if (!__atomic_load_n(&d->usable, __ATOMIC_ACQUIRE))
        return;
    if (vc_core_config()->upstream) {
        up_gate(d, g->grids);
        return;
    }
    g->count = budget_gate(d);
    g->d = d;
}

static CUresult capture_info(CUstream s, bool ptsz, CUstreamCaptureStatus *cap, cuuint64_t *id)
{
    *cap = CU_STREAM_CAPTURE_STATUS_NONE;
    *id = 0;
    return ptsz ? REAL_CU(cuStreamGetCaptureInfo_ptsz)(s, cap, id) : REAL_CU(cuStreamGetCaptureInfo)(s, cap, id);
}

/* Before a launch on stream s; grids = upstream's cost. */
static struct gate gate_before(CUstream s, bool ptsz, uint64_t grids, bool upstream_hooks)
{
    struct gate g = {.grids = grids, .upstream_hooks = upstream_hooks};
    const bool upstream = vc_core_config()->upstream;
    if (upstream && !upstream_hooks)
        return g; /* upstream leaves this path unlimited: the baseline keeps that */
    CUstreamCaptureStatus cap;
    cuuint64_t id;
    CUresult rc = capture_info(s, ptsz, &cap, &id);
    /* Recorded into a graph, not run: the graph's launch is gated.  Only an active capture records: once it is
     * invalidated (a synchronising call while capturing) a launch is no longer the graph's and may run.  Another
     * thread may end the capture before the launch reaches the driver: gate_after checks it is still the same. */
    if (rc == CUDA_SUCCESS && cap == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        g.captured = true;
        g.capture = id;
        test_capture_delay();
        return g;
    }
    gate_charge(&g, s);
    return g;
}

static void add_completion(const struct gate *g, CUstream s, bool ptsz, CUresult rc)
{
    pthread_mutex_lock(&g->d->mu);
    if (rc == CUDA_SUCCESS)
        add_marker(g->d, s, ptsz, g->count, g->ctx);
    else
        launch_failed(g->d, g->count);
    pthread_mutex_unlock(&g->d->mu);
}

static void gate_after(const struct gate *g, CUstream s, bool ptsz, CUresult rc)
{
    if (VC_UNLIKELY(g->captured)) {
        /*
         * Let through as recorded into a capture: if that capture is still the stream's (active, same id) the
         * launch went into it.  Else it ended meanwhile (another thread's cuStreamEndCapture) and the launch may
         * have run: it is charged now, after the fact (the thread waits as a gated launch would have before it),
         * so ending a capture under a launch is never a way around the limit.
         */
        CUstreamCaptureStatus cap;
        cuuint64_t id;
        if (rc != CUDA_SUCCESS ||
            (capture_info(s, ptsz, &cap, &id) == CUDA_SUCCESS && cap == CU_STREAM_CAPTURE_STATUS_ACTIVE &&
             id == g->capture))
            return;
        struct gate late = {.grids = g->grids, .upstream_hooks = g->upstream_hooks};
        gate_charge(&late, s);
        if (late.d != NULL)
            add_completion(&late, s, ptsz, rc);
        return;
    }
    if (g->d == NULL)
        return;
    add_completion(g, s, ptsz, rc);
}

#define GRIDS(x, y, z) ((uint64_t)(x) * (uint64_t)(y) * (uint64_t)(z))

/* With the memory cap on, a launch whose kernel needs a bigger stack goes only when the stack fits (vc_memory.c). */
#define FRAME_FITS(f, stream, ptsz)                                                                                \
    do {                                                                                                           \
        if (VC_UNLIKELY(vc_limited())) {                                                                           \
            CUresult frc_ = vc_memory_launch_frame((f), (stream), (ptsz));                                         \
            if (frc_ != CUDA_SUCCESS)                                                                              \
                return frc_;                                                                                       \
        }                                                                                                          \
    } while (0)

/* Wraps one launch: gate, the real call, marker. */
#define GATED(stream, ptsz, grids, upstream_hooks, call)                                                            \
    do {                                                                                                           \
        struct gate g_ = gate_before((stream), (ptsz), (grids), (upstream_hooks));                                 \
        CUresult rc_ = (call);                                                                                     \
        gate_after(&g_, (stream), (ptsz), rc_);                                                                    \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                  unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                  unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    FRAME_FITS(f, hStream, false);
    if (VC_LIKELY(!vc_core_limited()))
        return REAL_CU(cuLaunchKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                       sharedMemBytes, hStream, kernelParams, extra);
    GATED(hStream, false, GRIDS(gridDimX, gridDimY, gridDimZ), true,
          REAL_CU(cuLaunchKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                                  hStream, kernelParams, extra));
}

VC_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                       unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                       unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                       void **kernelParams, void **extra)
{
    FRAME_FITS(f, hStream, true);
    if (VC_LIKELY(!vc_core_limited()))
        return REAL_CU(cuLaunchKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                            sharedMemBytes, hStream, kernelParams, extra);
    GATED(hStream, true, GRIDS(gridDimX, gridDimY, gridDimZ), true,
          REAL_CU(cuLaunchKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                       sharedMemBytes, hStream, kernelParams, extra));
}

/*
 * The launch description is the caller's memory: the gate and the driver get one private copy of it, so a stream
 * rewritten by another thread after the gate's look cannot take the kernel elsewhere (e.g. out of a capture).
 */
VC_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    if (config != NULL)
        FRAME_FITS(f, config->hStream, false);
    if (VC_LIKELY(!vc_core_limited()) || config == NULL)
        return REAL_CU(cuLaunchKernelEx)(config, f, kernelParams, extra);
    const CUlaunchConfig c = *config;
    GATED(c.hStream, false, GRIDS(c.gridDimX, c.gridDimY, c.gridDimZ), false,
          REAL_CU(cuLaunchKernelEx)(&c, f, kernelParams, extra));
}

VC_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    if (config != NULL)
        FRAME_FITS(f, config->hStream, true);
    if (VC_LIKELY(!vc_core_limited()) || config == NULL)
        return REAL_CU(cuLaunchKernelEx_ptsz)(config, f, kernelParams, extra);
    const CUlaunchConfig c = *config;
    GATED(c.hStream, true, GRIDS(c.gridDimX, c.gridDimY, c.gridDimZ), false,
          REAL_CU(cuLaunchKernelEx_ptsz)(&c, f, kernelParams, extra));
}

VC_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                             void **kernelParams)
{
    FRAME_FITS(f, hStream, false);
    if (VC_LIKELY(!vc_core_limited()))
        return REAL_CU(cuLaunchCooperativeKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                                  sharedMemBytes, hStream, kernelParams);
    GATED(hStream, false, GRIDS(gridDimX, gridDimY, gridDimZ), true,
          REAL_CU(cuLaunchCooperativeKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                             sharedMemBytes, hStream, kernelParams));
}

VC_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                  unsigned int gridDimZ, unsigned int blockDimX,
                                                  unsigned int blockDimY, unsigned int blockDimZ,
                                                  unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    FRAME_FITS(f, hStream, true);
    if (VC_LIKELY(!vc_core_limited()))
        return REAL_CU(cuLaunchCooperativeKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY,
                                                       blockDimZ, sharedMemBytes, hStream, kernelParams);
    GATED(hStream, true, GRIDS(gridDimX, gridDimY, gridDimZ), true,
          REAL_CU(cuLaunchCooperativeKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                                  sharedMemBytes, hStream, kernelParams));
}

/* One launch per device: each device's gate in turn (with its context made current for it). */
VC_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                        unsigned int flags)
{
    for (unsigned i = 0; launchParamsList != NULL && i < numDevices && i < MAX_DEVICES; i++)
        FRAME_FITS(launchParamsList[i].function, launchParamsList[i].hStream, false);
    if (VC_LIKELY(!vc_core_limited()) || launchParamsList == NULL || vc_core_config()->upstream)
        return REAL_CU(cuLaunchCooperativeKernelMultiDevice)(launchParamsList, numDevices, flags);
    if (numDevices > MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE; /* more launches than devices the gate knows: none may go ungated */
    /* One private copy of the list for the gates and the driver (see cuLaunchKernelEx). */
    CUDA_LAUNCH_PARAMS list[MAX_DEVICES];
    struct gate gates[MAX_DEVICES];
    unsigned n = numDevices;
    memcpy(list, launchParamsList, n * sizeof(list[0]));
    for (unsigned i = 0; i < n; i++)
        gates[i] = gate_before(list[i].hStream, false, GRIDS(list[i].gridDimX, list[i].gridDimY, list[i].gridDimZ),
                               false);
    CUresult rc = REAL_CU(cuLaunchCooperativeKernelMultiDevice)(list, numDevices, flags);
    for (unsigned i = 0; i < n; i++)
        gate_after(&gates[i], list[i].hStream, false, rc);
    return rc;
}

VC_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    if (VC_LIKELY(!vc_core_limited() && !vc_limited()))
        return REAL_CU(cuGraphLaunch)(hGraphExec, hStream);
    if (vc_limited()) {
        CUresult frc = vc_memory_graph_launch_frame(hGraphExec, hStream, false);
        if (frc != CUDA_SUCCESS)
            return frc;
    }
    CUresult rc;
    if (vc_core_limited()) {
        struct gate g = gate_before(hStream, false, 1, false);
        rc = REAL_CU(cuGraphLaunch)(hGraphExec, hStream);
        gate_after(&g, hStream, false, rc);
    } else {
        rc = REAL_CU(cuGraphLaunch)(hGraphExec, hStream);
    }
    if (rc == CUDA_SUCCESS && vc_limited())
        vc_memory_graph_launched(hGraphExec); /* its allocations without a free node stay live */
    return rc;
}

VC_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    if (VC_LIKELY(!vc_core_limited() && !vc_limited()))
        return REAL_CU(cuGraphLaunch_ptsz)(hGraphExec, hStream);
    if (vc_limited()) {
        CUresult frc = vc_memory_graph_launch_frame(hGraphExec, hStream, true);
        if (frc != CUDA_SUCCESS)
            return frc;
    }
    CUresult rc;
    if (vc_core_limited()) {
        struct gate g = gate_before(hStream, true, 1, false);
        rc = REAL_CU(cuGraphLaunch_ptsz)(hGraphExec, hStream);
        gate_after(&g, hStream, true, rc);
    } else {
        rc = REAL_CU(cuGraphLaunch_ptsz)(hGraphExec, hStream);
    }
    if (rc == CUDA_SUCCESS && vc_limited())
        vc_memory_graph_launched(hGraphExec); /* its allocations without a free node stay live */
    return rc;
}

/* The legacy launches (block shape from cuFuncSetBlockShape; upstream counts 1 resp. w x h grids). */
VC_EXPORT CUresult cuLaunch(CUfunction f)
{
    FRAME_FITS(f, NULL, false);
    if (VC_LIKELY(!vc_core_limited()))
        return REAL_CU(cuLaunch)(f);
    GATED(NULL, false, 1, true, REAL_CU(cuLaunch)(f));
}

VC_EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    FRAME_FITS(f, NULL, false);
    if (VC_LIKELY(!vc_core_limited()))
        return REAL_CU(cuLaunchGrid)(f, grid_width, grid_height);
    GATED(NULL, false, GRIDS(grid_width > 0 ? grid_width : 1, grid_height > 0 ? grid_height : 1, 1), true,
          REAL_CU(cuLaunchGrid)(f, grid_width, grid_height));
}

VC_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    FRAME_FITS(f, hStream, false);
    if (VC_LIKELY(!vc_core_limited()))
        return REAL_CU(cuLaunchGridAsync)(f, grid_width, grid_height, hStream);
    GATED(hStream, false, GRIDS(grid_width > 0 ? grid_width : 1, grid_height > 0 ? grid_height : 1, 1), true,
          REAL_CU(cuLaunchGridAsync)(f, grid_width, grid_height, hStream));
}

/* ---- destroyed streams and contexts: the stream-to-device cache forgets them -------------------- */

#define FORGETS_STREAMS(call)                                                                                      \
    do {                                                                                                           \
        CUresult rc_ = (call);                                                                                     \
        if (VC_UNLIKELY(vc_core_limited()))                                                                        \
            vc_core_streams_changed();                                                                                   \
        return rc_;                                                                                                \
    } while (0)

VC_EXPORT CUresult cuStreamDestroy(CUstream hStream)
{
    FORGETS_STREAMS(REAL_CU(cuStreamDestroy)(hStream));
}

VC_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    FORGETS_STREAMS(REAL_CU(cuStreamDestroy_v2)(hStream));
}
