/* Simulated GPU time; see sim_timeline.h and vcuda/sim/README.md "Simulated GPU time". */
#include "sim_timeline.h"

#include "vc_proc.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LIVENESS_NS 200000000ull    /* a slot's process is checked at most every 200 ms */
#define UTIL_WINDOW_NS 1000000000ull /* per-process utilisation looks back at most 1 s */
#define MAX_DELAY_US 1000000ull      /* per-process samples are delivered at most 1 s late (checkpoints: 1.28 s) */
#define MAX_SLEEP_NS 20000000ull     /* waiters re-check at least every 20 ms */
#define MIN_SLEEP_NS 20000ull

uint64_t sim_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t timeslice_ns(void)
{
    static _Atomic uint64_t cached;
    uint64_t v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v == 0) {
        const char *s = getenv("GPUSIM_TIMESLICE_US");
        long long us = s != NULL ? atoll(s) : 0;
        v = us > 0 ? (uint64_t)us * 1000u : 1000000u;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}

/* ---- this process --------------------------------------------------------------- */

struct self {
    uint32_t pid;
    uint64_t start;
};

static _Atomic uint64_t g_self; /* (start << 22) | pid */

static struct self self_id(void)
{
    uint32_t me = (uint32_t)getpid();
    uint64_t v = atomic_load_explicit(&g_self, memory_order_relaxed);
    if (v == 0 || (v & 0x3FFFFFu) != me) {
        v = (vc_proc_start_time((int)me) << 22) | me;
        atomic_store_explicit(&g_self, v, memory_order_relaxed);
    }
    return (struct self){me, v >> 22};
}

/* Slot index + 1 this process holds on each GPU, tagged with the pid that took it (fork). */
static _Atomic uint64_t g_my_slot[GPUSIM_MAX_GPUS]; /* (pid << 32) | (index + 1) */

/* ---- locking ------------------------------------------------------------------------ */

static struct gpusim_tl_gpu *entry(struct sim_state *st, unsigned gpu)
{
    struct gpusim_tl_gpu *g = sim_state_timeline(st, gpu);
    if (g == NULL)
        return NULL;
    if (__atomic_load_n(&g->init, __ATOMIC_ACQUIRE) != GPUSIM_TL_READY) {
        /* The file lock serialises initialisers (and is released if one dies meanwhile). */
        if (sim_state_lock(st) != 0)
            return NULL;
        if (g->init != GPUSIM_TL_READY) {
            pthread_mutexattr_t a;
            pthread_mutexattr_init(&a);
            pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
            pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
            _Static_assert(sizeof(pthread_mutex_t) <= sizeof(g->mutex), "mutex fits");
            pthread_mutex_init((pthread_mutex_t *)(void *)g->mutex, &a);
            pthread_mutexattr_destroy(&a);
            g->cur = GPUSIM_TL_NONE;
            __atomic_store_n(&g->init, GPUSIM_TL_READY, __ATOMIC_RELEASE);
        }
        sim_state_unlock(st);
    }
    return g;
}

static void seq_bump(struct gpusim_tl_gpu *g)
{
    __atomic_store_n(&g->seq, g->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static struct gpusim_tl_gpu *lock_gpu(struct sim_state *st, unsigned gpu)
{
    struct gpusim_tl_gpu *g = entry(st, gpu);
    if (g == NULL)
        return NULL;
    int rc = pthread_mutex_lock((pthread_mutex_t *)(void *)g->mutex);
    if (rc == EOWNERDEAD) {
        /* Its holder died: every update inside is a handful of counter stores; carry on. */
        pthread_mutex_consistent((pthread_mutex_t *)(void *)g->mutex);
        if (g->seq & 1)
            seq_bump(g);
    } else if (rc != 0) {
        return NULL;
    }
    seq_bump(g); /* odd: lockless readers retry */
    return g;
}

static void unlock_gpu(struct gpusim_tl_gpu *g)
{
    seq_bump(g);
    pthread_mutex_unlock((pthread_mutex_t *)(void *)g->mutex);
}

/* ---- the simulation ----------------------------------------------------------------- */

static bool has_work(const struct gpusim_tl_slot *s)
{
    return (s->flags & GPUSIM_TL_IN_USE) && s->head_seq < s->tail_seq;
}

/*
 * The slot's process is gone: its queue is dropped and the slot is free, but its PID and busy checkpoints stay until
 * another process takes it.  A driver that samples the whole GPU keeps the samples naming a process after it exits
 * (each was taken while it ran); without them an answer over the last second, after short processes, was empty.
 */
static void clear_slot(struct gpusim_tl_slot *s, uint64_t now)
{
    s->flags = GPUSIM_TL_GONE;
    s->since_ns = now; /* a gone slot's since_ns: when its process was found gone */
    s->owner_start = 0;
    s->head_seq = s->tail_seq;
    s->head_left_ns = 0;
}

/* At a slice boundary: a slot whose process is gone loses its queue (checked at most every 200 ms). */
static bool alive(struct gpusim_tl_slot *s, uint64_t wall)
{
    if (wall - s->checked_ns < LIVENESS_NS)
        return true;
    s->checked_ns = wall;
    if (vc_proc_alive((int)s->pid, s->owner_start))
        return true;
    clear_slot(s, wall);
    return false;
}

/* Next slot with work after g->cur (round robin), or GPUSIM_TL_NONE. */
static uint32_t pick(struct gpusim_tl_gpu *g, uint64_t wall)
{
    uint32_t start = g->cur == GPUSIM_TL_NONE ? 0 : (g->cur + 1) % GPUSIM_TL_SLOTS;
    for (uint32_t k = 0; k < GPUSIM_TL_SLOTS; k++) {
        uint32_t i = (start + k) % GPUSIM_TL_SLOTS;
        struct gpusim_tl_slot *s = &g->slots[i];
        if (has_work(s) && alive(s, wall))
            return i;
    }
    return GPUSIM_TL_NONE;
}

static void checkpoint(struct gpusim_tl_gpu *g, uint64_t t)
{
    uint64_t n = g->ck_count % GPUSIM_TL_CKPTS;
    g->ck_t[n] = t;
    g->ck_busy[n] = g->busy_ns;
    for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++)
        g->slots[i].ck_busy[n] = g->slots[i].busy_ns;
    g->ck_count++;
}

/* Runs the GPU from g->now_ns up to now (caller holds the lock). */
static void advance(struct gpusim_tl_gpu *g, uint64_t now)
{
    if (g->now_ns == 0) {
        g->now_ns = now;
        g->ck_next_ns = now;
        g->cur = GPUSIM_TL_NONE;
        g->real_offset_us = sim_now_us() - now / 1000u;
    }
    uint64_t t = g->now_ns;
    const uint64_t quantum = timeslice_ns();
    while (t < now) {
        if (t >= g->ck_next_ns) {
            checkpoint(g, g->ck_next_ns);
            g->ck_next_ns += GPUSIM_TL_CKPT_NS;
            continue;
        }
        struct gpusim_tl_slot *s = g->cur != GPUSIM_TL_NONE ? &g->slots[g->cur] : NULL;
        if (s == NULL || !has_work(s) || g->slice_left_ns == 0) {
            uint32_t next = pick(g, now);
            if (next == GPUSIM_TL_NONE) {
                /* Idle until now: only the last GPUSIM_TL_CKPTS checkpoints matter. */
                g->cur = GPUSIM_TL_NONE;
                uint64_t behind = now > g->ck_next_ns ? (now - g->ck_next_ns) / GPUSIM_TL_CKPT_NS : 0;
                if (behind > GPUSIM_TL_CKPTS) {
                    uint64_t skip = behind - GPUSIM_TL_CKPTS;
                    g->ck_next_ns += skip * GPUSIM_TL_CKPT_NS;
                    g->ck_count += skip;
                }
                t = now < g->ck_next_ns ? now : g->ck_next_ns;
                continue;
            }
            g->cur = next;
            g->slice_left_ns = quantum;
            s = &g->slots[next];
        }
        uint64_t step = now - t;
        if (g->slice_left_ns < step)
            step = g->slice_left_ns;
        if (s->head_left_ns < step)
            step = s->head_left_ns;
        if (g->ck_next_ns - t < step)
            step = g->ck_next_ns - t;
        s->head_left_ns -= step;
        g->slice_left_ns -= step;
        s->busy_ns += step;
        g->busy_ns += step;
        t += step;
        while (s->head_left_ns == 0 && s->head_seq < s->tail_seq) {
            s->end_ns[s->head_seq % GPUSIM_TL_ENDS] = t;
            s->head_seq++;
            g->kernels_done++;
            if (s->head_seq < s->tail_seq)
                s->head_left_ns = s->queue[s->head_seq % GPUSIM_TL_DEPTH];
        }
    }
    g->now_ns = now;
}

/* This process's slot on g (taking one if needed); NULL when all are taken by live processes. */
static struct gpusim_tl_slot *my_slot(struct gpusim_tl_gpu *g, unsigned gpu, bool create, uint64_t now)
{
    struct self me = self_id();
    uint64_t cached = atomic_load_explicit(&g_my_slot[gpu], memory_order_relaxed);
    if ((uint32_t)(cached >> 32) == me.pid && (uint32_t)cached != 0) {
        struct gpusim_tl_slot *s = &g->slots[(uint32_t)cached - 1];
        if ((s->flags & GPUSIM_TL_IN_USE) && s->pid == me.pid && s->owner_start == me.start)
            return s;
    }
    struct gpusim_tl_slot *free_slot = NULL;
    for (unsigned pass = 0; pass < 2; pass++) {
        for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++) {
            struct gpusim_tl_slot *s = &g->slots[i];
            if ((s->flags & GPUSIM_TL_IN_USE) && s->pid == me.pid && s->owner_start == me.start) {
                atomic_store_explicit(&g_my_slot[gpu], ((uint64_t)me.pid << 32) | (i + 1), memory_order_relaxed);
                return s;
            }
            /* A never used slot first, else the one whose process has been gone longest: its history is the least wanted. */
            if (!(s->flags & GPUSIM_TL_IN_USE) &&
                (free_slot == NULL || (free_slot->flags != 0 && (s->flags == 0 || s->since_ns < free_slot->since_ns))))
                free_slot = s;
        }
        if (free_slot != NULL || !create)
            break;
        /* Full: reap the slots of processes that are gone, then look again. */
        for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++) {
            struct gpusim_tl_slot *s = &g->slots[i];
            if ((s->flags & GPUSIM_TL_IN_USE) && !vc_proc_alive((int)s->pid, s->owner_start))
                clear_slot(s, now);
        }
    }
    if (free_slot == NULL || !create)
        return NULL;
    free_slot->pid = me.pid;
    free_slot->owner_start = me.start;
    free_slot->flags = GPUSIM_TL_IN_USE;
    free_slot->busy_ns = 0;
    free_slot->head_seq = free_slot->tail_seq = 0;
    free_slot->head_left_ns = 0;
    free_slot->checked_ns = now;
    free_slot->since_ns = now;
    memset(free_slot->ck_busy, 0, sizeof(free_slot->ck_busy));
    atomic_store_explicit(&g_my_slot[gpu], ((uint64_t)me.pid << 32) | (uint64_t)(free_slot - g->slots + 1),
                          memory_order_relaxed);
    return free_slot;
}

/* Number of slots with work (for the waiting-time estimate). */
static unsigned busy_slots(const struct gpusim_tl_gpu *g)
{
    unsigned n = 0;
    for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++)
        n += has_work(&g->slots[i]);
    return n > 0 ? n : 1;
}

/* Own queued work before upto (bounded scan), times the number of slots sharing the GPU. */
static uint64_t eta_ns(const struct gpusim_tl_gpu *g, const struct gpusim_tl_slot *s, uint64_t upto)
{
    if (s->head_seq >= upto)
        return 0;
    uint64_t w = s->head_left_ns;
    uint64_t last = upto < s->tail_seq ? upto : s->tail_seq;
    unsigned n = 0;
    for (uint64_t q = s->head_seq + 1; q < last && n < 64; q++, n++)
        w += s->queue[q % GPUSIM_TL_DEPTH];
    return w * busy_slots(g);
}

static void sleep_ns(uint64_t ns)
{
    if (ns < MIN_SLEEP_NS)
        ns = MIN_SLEEP_NS;
    if (ns > MAX_SLEEP_NS)
        ns = MAX_SLEEP_NS;
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static _Atomic(struct sim_state *) g_owner_state; /* for the exit-time release */

bool sim_tl_submit(struct sim_state *st, unsigned gpu, uint64_t dur_ns, uint64_t *upto)
{
    if (dur_ns == 0)
        dur_ns = 1;
    for (;;) {
        struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
        if (g == NULL)
            return false;
        uint64_t now = sim_mono_ns();
        advance(g, now);
        struct gpusim_tl_slot *s = my_slot(g, gpu, true, now);
        if (s == NULL) {
            unlock_gpu(g);
            return false;
        }
        if (s->tail_seq - s->head_seq < GPUSIM_TL_DEPTH) {
            s->queue[s->tail_seq % GPUSIM_TL_DEPTH] = dur_ns;
            if (s->head_seq == s->tail_seq)
                s->head_left_ns = dur_ns;
            s->tail_seq++;
            *upto = s->tail_seq;
            g->active = 1;
            unlock_gpu(g);
            atomic_store_explicit(&g_owner_state, st, memory_order_relaxed);
            return true;
        }
        /* Full, as a real push buffer gets: wait until an eighth of the queue drained. */
        uint64_t wait = eta_ns(g, s, s->head_seq + GPUSIM_TL_DEPTH / 8);
        unlock_gpu(g);
        sleep_ns(wait);
    }
}

uint64_t sim_tl_tail(struct sim_state *st, unsigned gpu)
{
    struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
    if (g == NULL)
        return 0;
    struct gpusim_tl_slot *s = my_slot(g, gpu, false, 0);
    uint64_t tail = s != NULL ? s->tail_seq : 0;
    unlock_gpu(g);
    return tail;
}

bool sim_tl_done(struct sim_state *st, unsigned gpu, uint64_t upto, uint64_t *end_ns)
{
    uint64_t now = sim_mono_ns();
    if (end_ns != NULL)
        *end_ns = now;
    if (upto == 0)
        return true;
    struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
    if (g == NULL)
        return true;
    now = sim_mono_ns();
    advance(g, now);
    struct gpusim_tl_slot *s = my_slot(g, gpu, false, now);
    bool done = s == NULL || s->head_seq >= upto;
    if (done && s != NULL && end_ns != NULL) {
        *end_ns = now;
        if (s->head_seq - (upto - 1) <= GPUSIM_TL_ENDS)
            *end_ns = s->end_ns[(upto - 1) % GPUSIM_TL_ENDS];
    }
    unlock_gpu(g);
    return done;
}

void sim_tl_wait(struct sim_state *st, unsigned gpu, uint64_t upto)
{
    if (upto == 0)
        return;
    for (;;) {
        struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
        if (g == NULL)
            return;
        uint64_t now = sim_mono_ns();
        advance(g, now);
        struct gpusim_tl_slot *s = my_slot(g, gpu, false, now);
        uint64_t wait = s == NULL ? 0 : eta_ns(g, s, upto);
        unlock_gpu(g);
        if (wait == 0)
            return;
        sleep_ns(wait);
    }
}

void sim_tl_release_self(struct sim_state *st)
{
    uint32_t me = (uint32_t)getpid();
    for (unsigned gpu = 0; gpu < GPUSIM_MAX_GPUS; gpu++) {
        uint64_t cached = atomic_load_explicit(&g_my_slot[gpu], memory_order_relaxed);
        if ((uint32_t)(cached >> 32) != me || (uint32_t)cached == 0)
            continue;
        struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
        if (g == NULL)
            continue;
        advance(g, sim_mono_ns());
        struct gpusim_tl_slot *s = my_slot(g, gpu, false, 0);
        if (s != NULL)
            clear_slot(s, g->now_ns);
        unlock_gpu(g);
        atomic_store_explicit(&g_my_slot[gpu], 0, memory_order_relaxed);
    }
}

__attribute__((destructor)) static void release_at_exit(void)
{
    struct sim_state *st = atomic_load_explicit(&g_owner_state, memory_order_relaxed);
    if (st != NULL)
        sim_tl_release_self(st);
}

/* ---- utilisation (NVML) --------------------------------------------------------------- */

bool sim_tl_active(struct sim_state *st, unsigned gpu)
{
    struct gpusim_tl_gpu *g = sim_state_timeline(st, gpu);
    return g != NULL && __atomic_load_n(&g->active, __ATOMIC_ACQUIRE) != 0;
}

/* Cumulative busy at time t (interpolated between checkpoints); busy[] is the GPU's or a slot's. */
static uint64_t busy_at(const struct gpusim_tl_gpu *g, const uint64_t *ck_busy, uint64_t busy_now, uint64_t t)
{
    if (t >= g->now_ns)
        return busy_now;
    uint64_t n = g->ck_count;
    uint64_t oldest = n > GPUSIM_TL_CKPTS ? n - GPUSIM_TL_CKPTS : 0;
    /* Newer point (t1, b1), starting from "now". */
    uint64_t t1 = g->now_ns, b1 = busy_now;
    for (uint64_t k = n; k > oldest; k--) {
        uint64_t i = (k - 1) % GPUSIM_TL_CKPTS;
        uint64_t t0 = g->ck_t[i], b0 = ck_busy[i];
        if (t0 <= t) {
            if (t1 == t0 || b1 < b0)
                return b0;
            return b0 + (uint64_t)((double)(b1 - b0) * (double)(t - t0) / (double)(t1 - t0));
        }
        t1 = t0;
        b1 = b0;
    }
    return b1; /* older than every checkpoint kept */
}

static unsigned percent(uint64_t busy, uint64_t window)
{
    if (window == 0)
        return 0;
    uint64_t p = (busy * 100u + window / 2) / window;
    return p > 100 ? 100u : (unsigned)p;
}

unsigned sim_tl_gpu_percent(struct sim_state *st, unsigned gpu, uint64_t window_ns)
{
    struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
    if (g == NULL)
        return 0;
    uint64_t now = sim_mono_ns();
    advance(g, now);
    uint64_t from = now > window_ns ? now - window_ns : 0;
    unsigned p = percent(g->busy_ns - busy_at(g, g->ck_busy, g->busy_ns, from), now - from);
    unlock_gpu(g);
    return p;
}

/* Timestamps of the timeline in CLOCK_REALTIME us, with the entry's fixed offset (stable across calls). */
static uint64_t real_us_of(const struct gpusim_tl_gpu *g, uint64_t mono)
{
    return g->real_offset_us + mono / 1000u;
}

static uint64_t mono_of(const struct gpusim_tl_gpu *g, uint64_t real_us)
{
    return real_us > g->real_offset_us ? (real_us - g->real_offset_us) * 1000u : 0;
}

unsigned sim_tl_samples(struct sim_state *st, unsigned gpu, uint64_t since_us, uint64_t *ts_us, unsigned *pct,
                        unsigned max)
{
    struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
    if (g == NULL)
        return 0;
    uint64_t now = sim_mono_ns();
    advance(g, now);
    uint64_t n = g->ck_count;
    uint64_t first = n > GPUSIM_TL_CKPTS ? n - GPUSIM_TL_CKPTS + 1 : 1; /* each sample needs its predecessor */
    unsigned count = 0;
    for (uint64_t k = first; k < n; k++) {
        uint64_t i = k % GPUSIM_TL_CKPTS, p = (k - 1) % GPUSIM_TL_CKPTS;
        uint64_t ts = real_us_of(g, g->ck_t[i]);
        if (ts <= since_us)
            continue;
        unsigned v = percent(g->ck_busy[i] - g->ck_busy[p], g->ck_t[i] - g->ck_t[p]);
        if (count < max) {
            ts_us[count] = ts;
            pct[count] = v;
        } else { /* keep the newest: shift */
            memmove(ts_us, ts_us + 1, (max - 1) * sizeof(*ts_us));
            memmove(pct, pct + 1, (max - 1) * sizeof(*pct));
            ts_us[max - 1] = ts;
            pct[max - 1] = v;
        }
        count += count < max;
    }
    unlock_gpu(g);
    return count;
}

/* A PID's sampling moment in period k: this many ns before the period's end (a hash of both, < spread, < period). */
static uint64_t sample_offset_ns(uint32_t pid, uint64_t k, uint64_t spread_ns, uint64_t period_ns)
{
    uint64_t cap = spread_ns < period_ns ? spread_ns : period_ns;
    if (cap < 1000u)
        return 0;
    uint64_t h = ((uint64_t)pid * 0x9E3779B97F4A7C15ull) ^ ((k + 1) * 0xC2B2AE3D27D4EB4Full);
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return (h % (cap / 1000u)) * 1000u;
}

/* The newest sampling moment of pid at or before last (mono ns): period ends are multiples of period_ns. */
static uint64_t sample_moment(uint32_t pid, uint64_t last, uint64_t spread_ns, uint64_t period_ns)
{
    uint64_t k = last / period_ns, end = k * period_ns, off = sample_offset_ns(pid, k, spread_ns, period_ns);
    if (end >= off && end - off <= last)
        return end - off;
    if (k == 0)
        return 0;
    end -= period_ns;
    off = sample_offset_ns(pid, k - 1, spread_ns, period_ns);
    return end >= off ? end - off : 0;
}

/*
 * The window per-process samples are read over (mono ns): *last is cut to the newest delivered moment (now less the
 * delay, at most 1 s); returns where it starts: since_us, at most the second before that, and within the checkpoints
 * kept.
 */
static uint64_t sample_window(const struct gpusim_tl_gpu *g, uint64_t now, uint64_t since_us, uint64_t delay_us,
                              uint64_t *last)
{
    uint64_t n = g->ck_count, oldest = n > GPUSIM_TL_CKPTS ? n - GPUSIM_TL_CKPTS : 0;
    uint64_t delay_ns = (delay_us > MAX_DELAY_US ? MAX_DELAY_US : delay_us) * 1000u;
    uint64_t visible = now > delay_ns ? now - delay_ns : 0;
    if (*last > visible)
        *last = visible;
    uint64_t from = mono_of(g, since_us);
    uint64_t horizon = visible > UTIL_WINDOW_NS ? visible - UTIL_WINDOW_NS : 0;
    if (from < horizon)
        from = horizon;
    if (from < g->ck_t[oldest % GPUSIM_TL_CKPTS])
        from = g->ck_t[oldest % GPUSIM_TL_CKPTS];
    return from;
}

unsigned sim_tl_process_util(struct sim_state *st, unsigned gpu, uint64_t since_us, uint64_t spread_us,
                             uint64_t period_us, uint64_t delay_us, struct sim_tl_proc_util *out, unsigned max,
                             uint64_t *now_us)
{
    struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
    if (g == NULL)
        return 0;
    uint64_t now = sim_mono_ns();
    advance(g, now);
    uint64_t n = g->ck_count;
    if (n < 2) {
        unlock_gpu(g);
        return 0;
    }
    /*
     * Each process's newest sample moment is in the last checkpoint period (the checkpoint minus its offset),
     * and its sample averages its GPU time since since_us (at most the last second, at most the checkpoints
     * kept): a caller that passes a sample's timestamp back gets the time after it, none twice.  Its busy time
     * at a moment between checkpoints is interpolated (the same answer every time it is asked).
     */
    uint64_t last = g->ck_t[(n - 1) % GPUSIM_TL_CKPTS];
    uint64_t period_ns = period_us > 0 ? period_us * 1000u : GPUSIM_TL_CKPT_NS;
    /*
     * A sample is delivered delay_us after its moment (the references say a real driver shows it 0.7 s or more late;
     * an H200 with driver 580.159 showed each within 0.1 s): only moments up
     * to now - delay are visible, and the second a sample looks back over ends there.  A caller that passed a
     * sample's timestamp back gets the samples delivered since, each once.
     */
    uint64_t from = sample_window(g, now, since_us, delay_us, &last);
    unsigned count = 0;
    *now_us = 0;
    for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++) {
        const struct gpusim_tl_slot *s = &g->slots[i];
        if (!(s->flags & GPUSIM_TL_IN_USE))
            continue;
        uint64_t at = sample_moment(s->pid, last, spread_us * 1000u, period_ns);
        if (at == 0)
            continue;
        uint64_t ts = real_us_of(g, at);
        if (ts <= since_us || at <= from)
            continue;
        uint64_t b0 = busy_at(g, s->ck_busy, s->busy_ns, from), b1 = busy_at(g, s->ck_busy, s->busy_ns, at);
        if (b1 <= b0)
            continue;
        if (count < max) {
            out[count] = (struct sim_tl_proc_util){
                .pid = s->pid, .sm_percent = percent(b1 - b0, at - from), .busy_ns = b1 - b0, .ts_us = ts};
            if (ts > *now_us)
                *now_us = ts;
        }
        count++;
    }
    unlock_gpu(g);
    return count;
}

#define MAX_TL_AVERAGED 64 /* processes in one averaged answer */

/* A well-spread hash of k (which process a period's sample names). */
static uint64_t mix64(uint64_t k)
{
    uint64_t h = (k + 1) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBull;
    return h ^ (h >> 31);
}

/*
 * The process a period's sample names: a draw weighted by each process's GPU time in the period (most_time false), or
 * the one with the most GPU time in it (a draw between equal ones).  An H200 with driver 580.159 names the latter: a
 * container held to 4-7 % beside one at 65-90 % was never named in 45-50 periods running, one at 25 % in 12 of 50; a
 * draw weighted by GPU time names the first about 3 times in 50.
 */
static unsigned name_period(const uint64_t *busy, uint64_t sum, uint64_t period_index, bool most_time)
{
    uint64_t pick = mix64(period_index);
    if (!most_time) {
        uint64_t at = pick % sum, acc = 0;
        for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++) {
            acc += busy[i];
            if (busy[i] > 0 && at < acc)
                return i;
        }
        return 0;
    }
    uint64_t most = 0;
    unsigned tied = 0;
    for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++) {
        if (busy[i] > most) {
            most = busy[i];
            tied = 0;
        }
        if (busy[i] == most)
            tied++;
    }
    uint64_t nth = pick % (tied > 0 ? tied : 1);
    for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++)
        if (busy[i] == most && nth-- == 0)
            return i;
    return 0;
}

/*
 * The samples of the periods ending in (from, last] and after since_us, newest first, into out (at most max);
 * returns how many were written.  Each names one process (name_period) with the whole GPU's busy percent over the
 * period.  *periods: how many periods end in the window, idle ones too.
 */
static unsigned period_samples(struct gpusim_tl_gpu *g, uint64_t since_us, uint64_t from, uint64_t last,
                               uint64_t period_ns, bool most_time, struct sim_tl_proc_util *out, unsigned max,
                               uint64_t *now_us, unsigned *periods)
{
    uint64_t n = g->ck_count, oldest = n > GPUSIM_TL_CKPTS ? n - GPUSIM_TL_CKPTS : 0;
    uint64_t kept = g->ck_t[oldest % GPUSIM_TL_CKPTS];
    unsigned count = 0;
    *periods = 0;
    /* Period ends in (from, last], newest first; a period older than the checkpoints kept is read over what is. */
    for (uint64_t end = last / period_ns * period_ns; end > from && end >= period_ns; end -= period_ns) {
        uint64_t start = end - period_ns < kept ? kept : end - period_ns;
        uint64_t total = busy_at(g, g->ck_busy, g->busy_ns, end) - busy_at(g, g->ck_busy, g->busy_ns, start);
        uint64_t ts = real_us_of(g, end);
        if (ts <= since_us)
            continue;
        (*periods)++;
        if (total == 0)
            continue;
        uint64_t sum = 0, busy[GPUSIM_TL_SLOTS];
        for (unsigned i = 0; i < GPUSIM_TL_SLOTS; i++) {
            const struct gpusim_tl_slot *s = &g->slots[i];
            busy[i] = 0;
            if (s->flags & (GPUSIM_TL_IN_USE | GPUSIM_TL_GONE)) { /* a gone process is named for its periods */
                uint64_t b0 = busy_at(g, s->ck_busy, s->busy_ns, start), b1 = busy_at(g, s->ck_busy, s->busy_ns, end);
                busy[i] = b1 > b0 ? b1 - b0 : 0;
                sum += busy[i];
            }
        }
        if (sum == 0)
            continue;
        unsigned chosen = name_period(busy, sum, end / period_ns, most_time);
        out[count] = (struct sim_tl_proc_util){
            .pid = g->slots[chosen].pid, .sm_percent = percent(total, end - start), .busy_ns = total, .ts_us = ts};
        if (ts > *now_us)
            *now_us = ts;
        if (++count >= max)
            break; /* the newest max periods */
    }
    return count;
}

/*
 * Averaged: one sample per process named in the window (its newest period's time), its smUtil the sum of the busy
 * percents of the periods named for it over the count of the window's periods (idle ones too).  Sorted oldest first.
 */
static unsigned average_by_process(struct sim_tl_proc_util *out, unsigned count, unsigned periods)
{
    unsigned kept = 0;
    unsigned sums[MAX_TL_AVERAGED];
    for (unsigned k = 0; k < count; k++) { /* newest first: a process's first entry is its newest */
        unsigned j = 0;
        while (j < kept && out[j].pid != out[k].pid)
            j++;
        if (j == kept) {
            if (kept == MAX_TL_AVERAGED)
                continue;
            out[kept] = out[k];
            sums[kept++] = 0;
        } else {
            out[j].busy_ns += out[k].busy_ns;
        }
        sums[j] += out[k].sm_percent;
    }
    for (unsigned j = 0; j < kept; j++)
        out[j].sm_percent = periods > 0 ? (sums[j] + periods / 2) / periods : 0;
    for (unsigned a = 1; a < kept; a++) /* oldest first: insertion sort of a handful */
        for (unsigned b = a; b > 0 && out[b - 1].ts_us > out[b].ts_us; b--) {
            struct sim_tl_proc_util t = out[b];
            out[b] = out[b - 1];
            out[b - 1] = t;
        }
    return kept;
}

unsigned sim_tl_gpu_samples(struct sim_state *st, unsigned gpu, uint64_t since_us, uint64_t period_us,
                            uint64_t delay_us, bool averaged, struct sim_tl_proc_util *out, unsigned max,
                            uint64_t *now_us)
{
    struct gpusim_tl_gpu *g = lock_gpu(st, gpu);
    if (g == NULL)
        return 0;
    uint64_t now = sim_mono_ns();
    advance(g, now);
    *now_us = 0;
    if (g->ck_count < 2 || max == 0) {
        unlock_gpu(g);
        return 0;
    }
    uint64_t period_ns = period_us > 0 ? period_us * 1000u : GPUSIM_TL_CKPT_NS;
    uint64_t last = g->ck_t[(g->ck_count - 1) % GPUSIM_TL_CKPTS];
    uint64_t from = sample_window(g, now, since_us, delay_us, &last);
    unsigned periods = 0;
    unsigned written = period_samples(g, since_us, from, last, period_ns, averaged, out, max, now_us, &periods);
    unlock_gpu(g);
    if (averaged && since_us != 0)
        return average_by_process(out, written, periods);
    /* Oldest first, as the driver's buffer is read. */
    for (unsigned a = 0, b = written; a + 1 < b; a++, b--) {
        struct sim_tl_proc_util t = out[a];
        out[a] = out[b - 1];
        out[b - 1] = t;
    }
    return written;
}
