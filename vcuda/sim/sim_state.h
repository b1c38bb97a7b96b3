/*
 * The shared run-time state file (GPUSIM_STATE): open/create, validate, map,
 * lock.  The layout is in gpusim_state_layout.h.
 *
 * Every accessor that returns a pointer into the mapping may only be used
 * between sim_state_lock() and sim_state_unlock().  The lock is a mutex (for
 * threads of this process) plus flock(LOCK_EX) on the file (for other
 * processes, including simnode/gpusim_state.py).
 */
#ifndef GPUSIM_SIM_STATE_H
#define GPUSIM_SIM_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "gpusim_state_layout.h"

struct sim_state;

/*
 * Opens (creating and initialising it if missing or empty) and maps the
 * state file.  Returns NULL with err = "<path>: <problem>" on failure.
 */
struct sim_state *sim_state_open(const char *path, char *err, size_t errlen);

void sim_state_close(struct sim_state *st);

/*
 * A test knob: the positive value of environment variable `name`, read once into *cache (which
 * starts at -1); 0 when unset, not a number, or not positive.
 */
long sim_env_knob(const char *name, long *cache);

/* Returns 0, or -1 if the file lock could not be taken (I/O error). */
int sim_state_lock(struct sim_state *st);
void sim_state_unlock(struct sim_state *st);

/* Unlocked, atomic read of header.change_counter: a hint for pollers. */
uint64_t sim_state_change_hint(const struct sim_state *st);
/*
 * The word to wait on for changes (the low half of header.change_counter), and the wait: blocks
 * until that word differs from the low half of `seen` (a value sim_state_change_hint returned),
 * at most timeout_ns; may return early (signal, spurious wake-up).  Every mutation wakes the
 * waiters of every process (sim_state_touch here, GpuSimState in simnode/gpusim_state.py), so a
 * waiter costs nothing while nothing happens, as the driver's own event wait.  The wait needs no
 * lock: take the word under sim_enter(), wait after sim_leave() (a word unmapped meanwhile by
 * nvmlShutdown makes the wait return).
 */
const uint32_t *sim_state_change_word(const struct sim_state *st);
void sim_state_wait_change(const uint32_t *word, uint64_t seen, int64_t timeout_ns);

struct gpusim_header *sim_state_header(struct sim_state *st);
struct gpusim_gpu *sim_state_gpu(struct sim_state *st, unsigned index);
unsigned sim_state_proc_capacity(const struct sim_state *st);
struct gpusim_proc *sim_state_proc(struct sim_state *st, unsigned slot);
/*
 * Timeline entry of GPU index, or NULL when the file has no TIMELINE section.
 * Not covered by sim_state_lock: see sim_timeline.h.
 */
struct gpusim_tl_gpu *sim_state_timeline(struct sim_state *st, unsigned index);
/* Ring slot holding event seq (check slot->seq == seq before use). */
struct gpusim_event *sim_state_event_slot(struct sim_state *st, uint64_t seq);
unsigned sim_state_event_capacity(const struct sim_state *st);

/* Mutations (caller holds the lock). */
void sim_state_touch(struct sim_state *st);
uint64_t sim_state_push_event(struct sim_state *st, unsigned gpu, uint64_t type, uint64_t data);

/*
 * Clears the PROCS entries that the simulated libcuda wrote (GPUSIM_PROC_CUDA)
 * for processes that are gone (caller holds the lock).  Returns how many.
 */
unsigned sim_state_reap_dead(struct sim_state *st);

/* CLOCK_REALTIME in microseconds. */
uint64_t sim_now_us(void);

#endif
