/*
 * On-disk layout of the simulated node's run-time state file (GPUSIM_STATE).
 *
 * One fixed-size binary file, shared by every process that loads the simulated
 * driver and by gpumanager/testing/gpusim_state.py.  All integers are native
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

/* gpusim_gpu.flags */
#define GPUSIM_GPU_LOST 0x1u
/* gpusim_proc.flags */
#define GPUSIM_PROC_IN_USE 0x1u
/*
 * Entry written by the simulated libcuda for one of its processes: it is
 * reaped (cleared) by whoever notices that process gone (owner_start tells a
 * reused PID apart).  Entries without this bit (gpusim set-process) are never
 * reaped.
 */
#define GPUSIM_PROC_CUDA 0x2u

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
    uint8_t reserved[88];
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

/* Section placement used by the creator of a fresh file. */
#define GPUSIM_GPUS_OFFSET ((uint64_t)GPUSIM_HEADER_SIZE)
#define GPUSIM_EVENTS_OFFSET (GPUSIM_GPUS_OFFSET + (uint64_t)GPUSIM_MAX_GPUS * sizeof(struct gpusim_gpu))
#define GPUSIM_PROCS_OFFSET (GPUSIM_EVENTS_OFFSET + (uint64_t)GPUSIM_EVENT_RING * sizeof(struct gpusim_event))
#define GPUSIM_FILE_SIZE (GPUSIM_PROCS_OFFSET + (uint64_t)GPUSIM_MAX_PROCS * sizeof(struct gpusim_proc))

_Static_assert(sizeof(struct gpusim_section) == 32, "section layout");
_Static_assert(sizeof(struct gpusim_header) == 256 + 32 * GPUSIM_MAX_SECTIONS, "header layout");
_Static_assert(sizeof(struct gpusim_header) <= GPUSIM_HEADER_SIZE, "header fits");
_Static_assert(sizeof(struct gpusim_util_sample) == 16, "sample layout");
_Static_assert(sizeof(struct gpusim_gpu) == 128 + 16 * GPUSIM_UTIL_SAMPLES, "gpu layout");
_Static_assert(sizeof(struct gpusim_event) == 48, "event layout");
_Static_assert(sizeof(struct gpusim_proc) == 48, "proc layout");
_Static_assert(GPUSIM_EVENTS_OFFSET % 4096 == 0, "events aligned");
_Static_assert(GPUSIM_PROCS_OFFSET % 4096 == 0, "procs aligned");

#endif
