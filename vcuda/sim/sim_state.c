/* The shared run-time state file; see sim_state.h and gpusim_state_layout.h. */
#include "sim_state.h"

#include "vc_proc.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct sim_section_view {
    uint64_t offset;
    uint32_t stride;
    uint32_t count;
};

struct sim_state {
    pthread_mutex_t mu; /* guards fd and pid, and serialises this process's threads */
    int fd;
    pid_t pid;          /* process that opened fd: a forked child reopens the file */
    unsigned char *map;
    size_t size;
    struct sim_section_view gpus, events, procs, timeline; /* timeline.count == 0: absent (older file) */
    char path[];
};

uint64_t sim_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int lock_fd(int fd)
{
    while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR)
            return -1;
    }
    return 0;
}

static int write_fresh_file(int fd)
{
    struct gpusim_header h;
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, GPUSIM_STATE_MAGIC, sizeof(h.magic));
    h.layout_version = GPUSIM_LAYOUT_VERSION;
    h.header_size = GPUSIM_HEADER_SIZE;
    h.file_size = GPUSIM_FILE_SIZE;
    h.change_counter = 1;
    h.event_next_seq = 1;
    h.created_us = sim_now_us();
    h.section_count = 4;
    h.sections[0] = (struct gpusim_section){.id = GPUSIM_SECTION_GPUS,
                                            .entry_size = sizeof(struct gpusim_gpu),
                                            .entry_count = GPUSIM_MAX_GPUS,
                                            .offset = GPUSIM_GPUS_OFFSET};
    h.sections[1] = (struct gpusim_section){.id = GPUSIM_SECTION_EVENTS,
                                            .entry_size = sizeof(struct gpusim_event),
                                            .entry_count = GPUSIM_EVENT_RING,
                                            .offset = GPUSIM_EVENTS_OFFSET};
    h.sections[2] = (struct gpusim_section){.id = GPUSIM_SECTION_PROCS,
                                            .entry_size = sizeof(struct gpusim_proc),
                                            .entry_count = GPUSIM_MAX_PROCS,
                                            .offset = GPUSIM_PROCS_OFFSET};
    h.sections[3] = (struct gpusim_section){.id = GPUSIM_SECTION_TIMELINE,
                                            .entry_size = sizeof(struct gpusim_tl_gpu),
                                            .entry_count = GPUSIM_MAX_GPUS,
                                            .offset = GPUSIM_TIMELINE_OFFSET};
    /* Zero everything (the file may hold a half-written earlier attempt), then write the header. */
    if (ftruncate(fd, 0) != 0 || ftruncate(fd, (off_t)GPUSIM_FILE_SIZE) != 0)
        return -1;
    if (pwrite(fd, &h, sizeof(h), 0) != (ssize_t)sizeof(h))
        return -1;
    return 0;
}

static bool find_section(const struct gpusim_header *h, uint64_t file_size, uint32_t id, size_t min_entry,
                         uint32_t min_count, struct sim_section_view *out)
{
    for (uint32_t i = 0; i < h->section_count && i < GPUSIM_MAX_SECTIONS; i++) {
        const struct gpusim_section *s = &h->sections[i];
        if (s->id != id)
            continue;
        uint64_t span = (uint64_t)s->entry_size * s->entry_count;
        if (s->entry_size < min_entry || s->entry_count < min_count || s->entry_size % 8 != 0 ||
            s->offset % 8 != 0 || s->offset < GPUSIM_HEADER_SIZE || s->offset > file_size ||
            span > file_size - s->offset)
            return false;
        *out = (struct sim_section_view){.offset = s->offset, .stride = s->entry_size, .count = s->entry_count};
        return true;
    }
    return false;
}

/* Called with the file lock held; leaves *st mapped or reports. */
static int validate_and_map(struct sim_state *st, char *err, size_t errlen)
{
    struct stat sb;
    if (fstat(st->fd, &sb) != 0) {
        snprintf(err, errlen, "%s: cannot stat the state file: %s", st->path, strerror(errno));
        return -1;
    }
    struct gpusim_header h;
    memset(&h, 0, sizeof(h));
    if (sb.st_size > 0 && pread(st->fd, &h, sizeof(h), 0) < 0) {
        snprintf(err, errlen, "%s: cannot read the state file: %s", st->path, strerror(errno));
        return -1;
    }
    static const char zero_magic[8];
    if (sb.st_size == 0 || memcmp(h.magic, zero_magic, sizeof(zero_magic)) == 0) {
        if (write_fresh_file(st->fd) != 0 || fstat(st->fd, &sb) != 0 || pread(st->fd, &h, sizeof(h), 0) < 0) {
            snprintf(err, errlen, "%s: cannot initialise the state file: %s", st->path, strerror(errno));
            return -1;
        }
    }
    if (memcmp(h.magic, GPUSIM_STATE_MAGIC, sizeof(h.magic)) != 0) {
        snprintf(err, errlen, "%s: not a gpusim state file (bad magic); delete it to start afresh", st->path);
        return -1;
    }
    if (h.layout_version != GPUSIM_LAYOUT_VERSION) {
        snprintf(err, errlen, "%s: state layout version %u, this library reads version %u; delete the file",
                 st->path, h.layout_version, GPUSIM_LAYOUT_VERSION);
        return -1;
    }
    if (h.header_size != GPUSIM_HEADER_SIZE || h.file_size != (uint64_t)sb.st_size) {
        snprintf(err, errlen, "%s: corrupt state file (header says %llu bytes, file has %lld); delete it",
                 st->path, (unsigned long long)h.file_size, (long long)sb.st_size);
        return -1;
    }
    if (!find_section(&h, h.file_size, GPUSIM_SECTION_GPUS, sizeof(struct gpusim_gpu), GPUSIM_MAX_GPUS, &st->gpus) ||
        !find_section(&h, h.file_size, GPUSIM_SECTION_EVENTS, sizeof(struct gpusim_event), 1, &st->events) ||
        !find_section(&h, h.file_size, GPUSIM_SECTION_PROCS, sizeof(struct gpusim_proc), 1, &st->procs)) {
        snprintf(err, errlen, "%s: corrupt state file (section directory); delete it", st->path);
        return -1;
    }
    /* TIMELINE is optional: a file of an older writer lacks it (kernels then take no simulated time). */
    if (!find_section(&h, h.file_size, GPUSIM_SECTION_TIMELINE, sizeof(struct gpusim_tl_gpu), GPUSIM_MAX_GPUS,
                      &st->timeline)) {
        st->timeline.count = 0;
        fprintf(stderr, "gpusim: %s: no TIMELINE section (a file of an older writer): kernels take no simulated "
                        "time; delete the file to recreate it\n", st->path);
    }
    void *map = mmap(NULL, (size_t)h.file_size, PROT_READ | PROT_WRITE, MAP_SHARED, st->fd, 0);
    if (map == MAP_FAILED) {
        snprintf(err, errlen, "%s: cannot map the state file: %s", st->path, strerror(errno));
        return -1;
    }
    st->map = map;
    st->size = (size_t)h.file_size;
    return 0;
}

/*
 * The states open in this process: a child forked while another thread was inside sim_state_lock has a copy
 * of st->mu held by a thread it does not have; its atfork handler makes every open state's mutex fresh (the
 * real driver's internal locks do not deadlock a forked child that only asks NVML).
 */
#define SIM_OPEN_STATES 64
static struct sim_state *_Atomic g_open_states[SIM_OPEN_STATES];
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static void states_atfork_child(void)
{
    for (unsigned i = 0; i < SIM_OPEN_STATES; i++) {
        struct sim_state *st = atomic_load(&g_open_states[i]);
        if (st != NULL)
            pthread_mutex_init(&st->mu, NULL);
    }
}

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, states_atfork_child);
}

static void states_track(struct sim_state *st, struct sim_state *was)
{
    for (unsigned i = 0; i < SIM_OPEN_STATES; i++) {
        struct sim_state *cur = was;
        if (atomic_compare_exchange_strong(&g_open_states[i], &cur, st))
            return;
    }
}

struct sim_state *sim_state_open(const char *path, char *err, size_t errlen)
{
    pthread_once(&g_atfork_once, register_atfork);
    size_t plen = strlen(path);
    struct sim_state *st = calloc(1, sizeof(*st) + plen + 1);
    if (st == NULL) {
        snprintf(err, errlen, "%s: out of memory", path);
        return NULL;
    }
    memcpy(st->path, path, plen + 1);
    st->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (st->fd < 0) {
        snprintf(err, errlen, "%s: cannot open the state file: %s", path, strerror(errno));
        free(st);
        return NULL;
    }
    if (lock_fd(st->fd) != 0) {
        snprintf(err, errlen, "%s: cannot lock the state file: %s", path, strerror(errno));
        close(st->fd);
        free(st);
        return NULL;
    }
    int rc = validate_and_map(st, err, errlen);
    flock(st->fd, LOCK_UN);
    if (rc != 0) {
        close(st->fd);
        free(st);
        return NULL;
    }
    st->pid = getpid();
    pthread_mutex_init(&st->mu, NULL);
    states_track(st, NULL);
    return st;
}

void sim_state_close(struct sim_state *st)
{
    if (st == NULL)
        return;
    states_track(NULL, st);
    munmap(st->map, st->size);
    close(st->fd);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

int sim_state_lock(struct sim_state *st)
{
    pthread_mutex_lock(&st->mu);
    if (st->pid != getpid()) {
        /* After fork() the child shares the parent's open file, and with it the flock. */
        int fd = open(st->path, O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            pthread_mutex_unlock(&st->mu);
            return -1;
        }
        close(st->fd);
        st->fd = fd;
        st->pid = getpid();
    }
    if (lock_fd(st->fd) != 0) {
        pthread_mutex_unlock(&st->mu);
        return -1;
    }
    return 0;
}

void sim_state_unlock(struct sim_state *st)
{
    flock(st->fd, LOCK_UN);
    pthread_mutex_unlock(&st->mu);
}

uint64_t sim_state_change_hint(const struct sim_state *st)
{
    const struct gpusim_header *h = (const struct gpusim_header *)st->map;
    return __atomic_load_n(&h->change_counter, __ATOMIC_ACQUIRE);
}

/*
 * The futex word of the state file: the low half of header.change_counter (the file is
 * little-endian).  The mapping is MAP_SHARED, so a (non-private) futex on it is shared by every
 * process that maps the file.
 */
static uint32_t *change_word(const struct sim_state *st)
{
    return (uint32_t *)(void *)&((struct gpusim_header *)(void *)st->map)->change_counter;
}

const uint32_t *sim_state_change_word(const struct sim_state *st)
{
    return change_word(st);
}

void sim_state_wait_change(const uint32_t *word, uint64_t seen, int64_t timeout_ns)
{
    if (timeout_ns <= 0)
        return;
    struct timespec rel = {(time_t)(timeout_ns / 1000000000), (long)(timeout_ns % 1000000000)};
    /* Returns at once (EAGAIN) when the counter moved since `seen` was read, and with EFAULT when
     * the file was unmapped meanwhile (nvmlShutdown); EINTR and ETIMEDOUT simply return: the
     * caller looks at the state again in every case. */
    syscall(SYS_futex, word, FUTEX_WAIT, (uint32_t)seen, &rel, NULL, 0);
}

struct gpusim_header *sim_state_header(struct sim_state *st)
{
    return (struct gpusim_header *)st->map;
}

struct gpusim_gpu *sim_state_gpu(struct sim_state *st, unsigned index)
{
    if (index >= st->gpus.count)
        return NULL;
    return (struct gpusim_gpu *)(st->map + st->gpus.offset + (uint64_t)index * st->gpus.stride);
}

unsigned sim_state_proc_capacity(const struct sim_state *st)
{
    return st->procs.count;
}

struct gpusim_proc *sim_state_proc(struct sim_state *st, unsigned slot)
{
    if (slot >= st->procs.count)
        return NULL;
    return (struct gpusim_proc *)(st->map + st->procs.offset + (uint64_t)slot * st->procs.stride);
}

struct gpusim_tl_gpu *sim_state_timeline(struct sim_state *st, unsigned index)
{
    if (index >= st->timeline.count)
        return NULL;
    return (struct gpusim_tl_gpu *)(st->map + st->timeline.offset + (uint64_t)index * st->timeline.stride);
}

unsigned sim_state_event_capacity(const struct sim_state *st)
{
    return st->events.count;
}

struct gpusim_event *sim_state_event_slot(struct sim_state *st, uint64_t seq)
{
    uint64_t slot = seq % st->events.count;
    return (struct gpusim_event *)(st->map + st->events.offset + slot * st->events.stride);
}

void sim_state_touch(struct sim_state *st)
{
    struct gpusim_header *h = sim_state_header(st);
    __atomic_store_n(&h->change_counter, h->change_counter + 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, change_word(st), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

uint64_t sim_state_push_event(struct sim_state *st, unsigned gpu, uint64_t type, uint64_t data)
{
    struct gpusim_header *h = sim_state_header(st);
    uint64_t seq = h->event_next_seq == 0 ? 1 : h->event_next_seq;
    struct gpusim_event *e = sim_state_event_slot(st, seq);
    memset(e, 0, st->events.stride);
    e->event_type = type;
    e->event_data = data;
    e->time_us = sim_now_us();
    e->gpu = gpu;
    e->seq = seq;
    h->event_next_seq = seq + 1;
    sim_state_touch(st);
    return seq;
}

unsigned sim_state_reap_dead(struct sim_state *st)
{
    unsigned reaped = 0;
    for (unsigned s = 0; s < st->procs.count; s++) {
        struct gpusim_proc *p = sim_state_proc(st, s);
        if ((p->flags & (GPUSIM_PROC_IN_USE | GPUSIM_PROC_CUDA)) != (GPUSIM_PROC_IN_USE | GPUSIM_PROC_CUDA))
            continue;
        if (vc_proc_alive((int)p->pid, p->owner_start))
            continue;
        memset(p, 0, st->procs.stride);
        reaped++;
    }
    if (reaped > 0)
        sim_state_touch(st);
    return reaped;
}

long sim_env_knob(const char *name, long *cache)
{
    long value = __atomic_load_n(cache, __ATOMIC_RELAXED);
    if (value < 0) {
        const char *text = getenv(name);
        value = text != NULL ? strtol(text, NULL, 10) : 0;
        value = value > 0 ? value : 0;
        __atomic_store_n(cache, value, __ATOMIC_RELAXED);
    }
    return value;
}
