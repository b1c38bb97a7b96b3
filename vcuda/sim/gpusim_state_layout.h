/*
 * On-disk layout of the simulated node's run-time state file (GPUSIM_STATE).
 *
 * One fixed-size binary file, shared by every process that loads the simulated
 * driver and by simnode/gpusim_state.py.  All integers are native
 * little-endian; every struct below has explicit padding so that C and Python
 * (struct module) agree byte for byte.  The file is mapped MAP_SHARED.
 *
 * Locking: every read or write of the file content happens while holding
 * flock(fd, LOCK_EX) on the state file (plus, inside one process, a mutex,
 * because flock does not exclude threads that share one open file).  The one
 * exception is header.change_counter, which pollers may read without the lock
 * as a hint that something changed; they must take the lock before trusting
 * anything else.
 *
 * Extending: the header carries a small section directory.  A reader finds a
 * section by id and indexes entries with the directory's entry_size, so
 * entries may grow (append fields, bump nothing) and new sections may be
 * added without breaking older readers.  Incompatible changes bump
 * GPUSIM_LAYOUT_VERSION.  See vcuda/sim/README.md for the full description.
 */
#ifndef GPUSIM_STATE_LAYOUT_H
#define GPUSIM_STATE_LAYOUT_H

#include <stdint.h>

#define GPUSIM_STATE_MAGIC "GPUSIMST" /* 8 bytes, no terminator in the file */
#define GPUSIM_LAYOUT_VERSION 1u
#define GPUSIM_HEADER_SIZE 4096u
#define GPUSIM_MAX_SECTIONS 16u

#define GPUSIM_MAX_GPUS 64u
#define GPUSIM_EVENT_RING 1024u
#define GPUSIM_MAX_PROCS 1024u
#define GPUSIM_UTIL_SAMPLES 120u

/* Section ids. */
#define GPUSIM_SECTION_GPUS 1u
#define GPUSIM_SECTION_EVENTS 2u
#define GPUSIM_SECTION_PROCS 3u
#define GPUSIM_SECTION_TIMELINE 4u

/* gpusim_gpu.flags */
#define GPUSIM_GPU_LOST 0x1u
/* Calls that take the GPU (its handle, or its handle by index) block while set: a GPU stuck in reset. */
#define GPUSIM_GPU_HUNG 0x2u
/* MIG mode enabled (current and pending); answered only by MIG-capable models (compute capability 8.0, 9.0, 10.0). */
#define GPUSIM_GPU_MIG 0x4u
/* Bits 8-9: the compute mode (nvmlComputeMode_t: 0 DEFAULT, 1 EXCLUSIVE_THREAD, 2 PROHIBITED, 3 EXCLUSIVE_PROCESS). */
#define GPUSIM_GPU_COMPUTE_MODE_SHIFT 8u
#define GPUSIM_GPU_COMPUTE_MODE_MASK 0x300u
/* gpusim_proc.flags */
#define GPUSIM_PROC_IN_USE 0x1u
/*
 * Entry written by the simulated libcuda for one of its processes: it is
 * reaped (cleared) by whoever notices that process gone (owner_start tells a
 * reused PID apart).  Entries without this bit (gpusim set-process) are never
 * reaped.
 */
#define GPUSIM_PROC_CUDA 0x2u
/*
 * A graphics context: nvmlDeviceGetGraphicsRunningProcesses* list the entry, the compute queries do not (its
 * memory counts in the GPU's use all the same).
 */
#define GPUSIM_PROC_GRAPHICS 0x4u

struct gpusim_section {
    uint32_t id;          /* GPUSIM_SECTION_*; 0 = unused slot */
    uint32_t entry_size;  /* bytes per entry */
    uint32_t entry_count; /* number of entries */
    uint32_t flags;       /* reserved, 0 */
    uint64_t offset;      /* from the start of the file, 4096-aligned */
    uint64_t reserved;
};

struct gpusim_header {
    char magic[8];            /* GPUSIM_STATE_MAGIC */
    uint32_t layout_version;  /* GPUSIM_LAYOUT_VERSION */
    uint32_t header_size;     /* GPUSIM_HEADER_SIZE */
    uint64_t file_size;       /* total size of the file in bytes */
    uint64_t change_counter;  /* incremented by every mutation */
    uint64_t event_next_seq;  /* sequence number the next event gets (first is 1) */
    uint64_t created_us;      /* CLOCK_REALTIME in microseconds */
    uint32_t section_count;   /* used entries of sections[] */
    uint32_t reserved0;
    uint8_t reserved[200];
    struct gpusim_section sections[GPUSIM_MAX_SECTIONS];
};

/* One utilisation sample (what nvmlDeviceGetSamples returns). */
struct gpusim_util_sample {
    uint64_t timestamp_us;
    uint32_t gpu_percent;
    uint32_t memory_percent;
};

/* Section GPUS: one entry per NVML index, GPUSIM_MAX_GPUS entries. */
struct gpusim_gpu {
    uint32_t flags;           /* GPUSIM_GPU_* */
    uint32_t util_gpu;        /* current GPU utilisation, percent */
    uint32_t util_memory;     /* current memory-controller utilisation, percent */
    uint32_t reserved0;
    uint64_t util_updated_us; /* when util_* was last set */
    uint64_t sample_count;    /* samples ever written; sample n (0-based) is in slot n % GPUSIM_UTIL_SAMPLES */
    uint64_t lost_since_us;   /* 0 unless GPUSIM_GPU_LOST */
    uint64_t used_peak;       /* highest memory in use on the GPU (all processes) so far; a simulator diagnostic */
    uint8_t reserved[80];
    struct gpusim_util_sample samples[GPUSIM_UTIL_SAMPLES];
};

/* Section EVENTS: ring of GPUSIM_EVENT_RING entries; event seq lives in slot seq % GPUSIM_EVENT_RING. */
struct gpusim_event {
    uint64_t seq;        /* 0 = never written */
    uint64_t event_type; /* nvmlEventType* bit, e.g. nvmlEventTypeXidCriticalError */
    uint64_t event_data; /* the XID for XID events */
    uint64_t time_us;
    uint32_t gpu;        /* NVML index */
    uint32_t reserved0;
    uint64_t reserved1;
};

/* Section PROCS: process table, GPUSIM_MAX_PROCS entries; (pid, gpu) is the key. */
struct gpusim_proc {
    uint32_t pid;
    uint32_t gpu;
    uint64_t used_bytes;  /* device memory used by this process on this GPU */
    uint32_t flags;       /* GPUSIM_PROC_* */
    uint32_t sm_util;     /* percent, reported by nvmlDeviceGetProcessUtilization */
    uint32_t mem_util;    /* percent */
    uint32_t reserved0;
    uint64_t updated_us;  /* last change of this entry */
    uint64_t owner_start; /* GPUSIM_PROC_CUDA: the process's start time (/proc/<pid>/stat field 22), 0 unknown */
};

/*
 * Section TIMELINE: simulated GPU time, one entry per NVML index
 * (GPUSIM_MAX_GPUS entries of sizeof(struct gpusim_tl_gpu)).  Kernels queue
 * per (process, GPU) "slot" and the GPU time-slices between slots (round
 * robin, GPUSIM_TIMESLICE_US).  The simulation advances lazily: whoever
 * touches an entry first runs it up to CLOCK_MONOTONIC "now" (sim_timeline.c).
 *
 * Locking: the entry's own process-shared robust mutex (not the file's
 * flock: launches are frequent), initialised by the first C user under the
 * file lock (init == 2 afterwards).  Every change of the counters is wrapped
 * in seqlock increments of `seq` (odd while writing), so readers that cannot
 * take the mutex (gpusim_state.py) read a consistent copy by retrying.
 */
#define GPUSIM_TL_SLOTS 16u      /* processes per GPU with kernels queued or run */
#define GPUSIM_TL_DEPTH 1024u    /* pending kernels per slot (a launch blocks while it is full) */
#define GPUSIM_TL_ENDS 256u      /* completion times kept per slot (event timestamps) */
#define GPUSIM_TL_CKPTS 128u     /* busy-time checkpoints kept */
#define GPUSIM_TL_CKPT_NS 10000000ull /* one checkpoint every 10 ms of simulated time */
#define GPUSIM_TL_NONE 0xFFFFFFFFu
#define GPUSIM_TL_READY 2u       /* gpusim_tl_gpu.init: the mutex is initialised */
#define GPUSIM_TL_IN_USE 0x1u    /* gpusim_tl_slot.flags */
#define GPUSIM_TL_GONE 0x2u      /* gpusim_tl_slot.flags: its process is gone; pid and busy checkpoints kept */

struct gpusim_tl_slot {
    uint32_t pid;            /* 0 = free */
    uint32_t flags;          /* GPUSIM_TL_IN_USE, or GPUSIM_TL_GONE (free, its history kept until taken) */
    uint64_t owner_start;    /* /proc/<pid>/stat field 22 (tells a reused pid apart) */
    uint64_t busy_ns;        /* GPU time this process's kernels have run, cumulative */
    uint64_t head_seq;       /* kernels with seq < head_seq are done; head_seq runs next */
    uint64_t tail_seq;       /* seq of the next kernel submitted */
    uint64_t head_left_ns;   /* time left of kernel head_seq (when head_seq < tail_seq) */
    uint64_t checked_ns;     /* last liveness check (CLOCK_MONOTONIC) */
    uint64_t since_ns;       /* when the slot was taken (GPUSIM_TL_GONE: when its process was found gone) */
    uint64_t reserved[8];
    uint64_t ck_busy[GPUSIM_TL_CKPTS];  /* busy_ns at checkpoint n, in [n % GPUSIM_TL_CKPTS] */
    uint64_t end_ns[GPUSIM_TL_ENDS];    /* completion time of kernel seq, in [seq % GPUSIM_TL_ENDS] */
    uint64_t queue[GPUSIM_TL_DEPTH];    /* duration (ns) of pending kernel seq, in [seq % GPUSIM_TL_DEPTH] */
};

struct gpusim_tl_gpu {
    uint8_t mutex[64];       /* pthread_mutex_t, PTHREAD_PROCESS_SHARED + PTHREAD_MUTEX_ROBUST */
    uint32_t init;           /* GPUSIM_TL_READY once the mutex is initialised */
    uint32_t active;         /* 1 once a kernel was submitted: NVML reports utilisation from here */
    uint64_t seq;            /* seqlock: odd while the counters change */
    uint64_t now_ns;         /* simulated up to this CLOCK_MONOTONIC time (0 = never) */
    uint64_t busy_ns;        /* time with a kernel running, cumulative */
    uint64_t kernels_done;
    uint32_t cur;            /* slot whose time slice runs, GPUSIM_TL_NONE */
    uint32_t reserved0;
    uint64_t slice_left_ns;
    uint64_t ck_count;       /* checkpoints written; checkpoint n at [n % GPUSIM_TL_CKPTS] */
    uint64_t ck_next_ns;     /* time of the next checkpoint */
    uint64_t real_offset_us; /* CLOCK_REALTIME us - CLOCK_MONOTONIC us, fixed when the entry starts */
    uint8_t reserved[112];
    uint64_t ck_t[GPUSIM_TL_CKPTS];     /* checkpoint times */
    uint64_t ck_busy[GPUSIM_TL_CKPTS];  /* busy_ns at those times */
    struct gpusim_tl_slot slots[GPUSIM_TL_SLOTS];
    uint8_t pad[3840];       /* rounds the entry to a multiple of 4096 */
};

/* Section placement used by the creator of a fresh file. */
#define GPUSIM_GPUS_OFFSET ((uint64_t)GPUSIM_HEADER_SIZE)
#define GPUSIM_EVENTS_OFFSET (GPUSIM_GPUS_OFFSET + (uint64_t)GPUSIM_MAX_GPUS * sizeof(struct gpusim_gpu))
#define GPUSIM_PROCS_OFFSET (GPUSIM_EVENTS_OFFSET + (uint64_t)GPUSIM_EVENT_RING * sizeof(struct gpusim_event))
#define GPUSIM_TIMELINE_OFFSET (GPUSIM_PROCS_OFFSET + (uint64_t)GPUSIM_MAX_PROCS * sizeof(struct gpusim_proc))
#define GPUSIM_FILE_SIZE (GPUSIM_TIMELINE_OFFSET + (uint64_t)GPUSIM_MAX_GPUS * sizeof(struct gpusim_tl_gpu))

_Static_assert(sizeof(struct gpusim_section) == 32, "section layout");
_Static_assert(sizeof(struct gpusim_header) == 256 + 32 * GPUSIM_MAX_SECTIONS, "header layout");
_Static_assert(sizeof(struct gpusim_header) <= GPUSIM_HEADER_SIZE, "header fits");
_Static_assert(sizeof(struct gpusim_util_sample) == 16, "sample layout");
_Static_assert(sizeof(struct gpusim_gpu) == 128 + 16 * GPUSIM_UTIL_SAMPLES, "gpu layout");
_Static_assert(sizeof(struct gpusim_event) == 48, "event layout");
_Static_assert(sizeof(struct gpusim_proc) == 48, "proc layout");
_Static_assert(GPUSIM_EVENTS_OFFSET % 4096 == 0, "events aligned");
_Static_assert(GPUSIM_PROCS_OFFSET % 4096 == 0, "procs aligned");
_Static_assert(GPUSIM_TIMELINE_OFFSET % 4096 == 0, "timeline aligned");
_Static_assert(sizeof(struct gpusim_tl_slot) == 128 + 8 * (GPUSIM_TL_CKPTS + GPUSIM_TL_ENDS + GPUSIM_TL_DEPTH),
               "timeline slot layout");
_Static_assert(sizeof(struct gpusim_tl_gpu) % 4096 == 0, "timeline entry aligned");

#endif
