/*
 * Simulated GPU time: the TIMELINE section of the state file (layout in
 * gpusim_state_layout.h, description in vcuda/sim/README.md "Simulated GPU
 * time").  Linked into both simulated libraries: libcuda submits kernels and
 * waits for them, libnvidia-ml reports utilisation.
 *
 * Model: every process has one FIFO run queue per GPU (a "slot"); the GPU runs
 * one slot at a time and switches between slots that have work every
 * GPUSIM_TIMESLICE_US (round robin; default 1000 us), as a time-sliced GPU
 * does between contexts.  The simulation advances lazily, up to
 * CLOCK_MONOTONIC "now", whenever any process touches the GPU's entry.
 *
 * Every function takes the entry's own mutex; none needs sim_state_lock.
 * Functions return false / 0 when the state file has no TIMELINE section.
 */
#ifndef GPUSIM_SIM_TIMELINE_H
#define GPUSIM_SIM_TIMELINE_H

#include <stdbool.h>
#include <stdint.h>

#include "sim_state.h"

/* CLOCK_MONOTONIC in nanoseconds (the timeline's clock, shared by every process of the host). */
uint64_t sim_mono_ns(void);

/*
 * Queues a kernel of dur_ns for this process on gpu; blocks while this
 * process's queue on that GPU is full (GPUSIM_TL_DEPTH kernels).  On success
 * *upto = its sequence number + 1 (wait for upto to wait for it).  false: no
 * timeline or no free slot (the kernel then takes no simulated time).
 */
bool sim_tl_submit(struct sim_state *st, unsigned gpu, uint64_t dur_ns, uint64_t *upto);

/* The `upto` covering everything this process queued on gpu so far (0 if nothing). */
uint64_t sim_tl_tail(struct sim_state *st, unsigned gpu);

/*
 * Whether this process's kernels before upto on gpu are done.  *end_ns (may
 * be NULL) receives the completion time of kernel upto-1 when it is still
 * known, else the time of the check.
 */
bool sim_tl_done(struct sim_state *st, unsigned gpu, uint64_t upto, uint64_t *end_ns);

/* Sleeps until this process's kernels before upto on gpu are done. */
void sim_tl_wait(struct sim_state *st, unsigned gpu, uint64_t upto);

/* Drops this process's slots (its queued work is abandoned, as when a context is destroyed). */
void sim_tl_release_self(struct sim_state *st);

/*
 * NVML side.  sim_tl_active: whether gpu ever ran a simulated kernel (then
 * utilisation comes from the timeline rather than from `gpusim util`).
 */
bool sim_tl_active(struct sim_state *st, unsigned gpu);

/* Percent of [now - window_ns, now] with a kernel running (rounded). */
unsigned sim_tl_gpu_percent(struct sim_state *st, unsigned gpu, uint64_t window_ns);

/*
 * One sample per 10 ms checkpoint newer than since_us (CLOCK_REALTIME us),
 * oldest first, at most max (the newest ones); returns how many.
 */
unsigned sim_tl_samples(struct sim_state *st, unsigned gpu, uint64_t since_us, uint64_t *ts_us, unsigned *percent,
                        unsigned max);

struct sim_tl_proc_util {
    uint32_t pid;
    unsigned sm_percent; /* rounded percent of its window */
    uint64_t busy_ns;    /* GPU time in its window */
    uint64_t ts_us;      /* its sample time (CLOCK_REALTIME us) */
};

/*
 * Per-process utilisation samples, as NVML's driver takes them: each process
 * is sampled once per period_us (0: the 10 ms checkpoint period; period ends at
 * multiples of it), at its own moment in it (the period's end minus an offset in
 * [0, spread_us), a hash of its PID and the period: it jitters from one period
 * to the next; spread_us 0: every process at the period's end), and delivered
 * delay_us after that moment (at most 1 s).  A process's sample is its newest
 * delivered sample moment, if it is newer than since_us; it averages the process's
 * GPU time over (since_us, that moment] (within the second before now - delay_us,
 * and within the checkpoints kept).  Writes at
 * most max processes with GPU time in their window; *now_us = the newest
 * sample time written.  Returns how many processes had time (may exceed max:
 * only max are written).
 */
unsigned sim_tl_process_util(struct sim_state *st, unsigned gpu, uint64_t since_us, uint64_t spread_us,
                             uint64_t period_us, uint64_t delay_us, struct sim_tl_proc_util *out, unsigned max,
                             uint64_t *now_us);

/*
 * Per-process utilisation samples where the driver samples the whole GPU (an H200 with driver 580.159): ONE sample per
 * period, at the period's end, naming ONE process with the whole GPU's busy percent over the period as its smUtil.
 * averaged false: the named process is drawn, by a hash of the period, in proportion to each process's GPU time in
 * it, and every period's sample since since_us is given (within the checkpoints kept and the second before now -
 * delay_us), oldest first, at most max (the newest); returns how many were written.  averaged true, what the H200
 * answers: the named process is the one with the most GPU time in the period, and a query from a since_us other than
 * 0 gets one sample per process named in the window, at its newest period's time, its smUtil the sum of its periods'
 * busy percents over the count of the window's periods (since_us 0: every period's sample, as above).  A process named
 * by no sample ran nonetheless.
 */
unsigned sim_tl_gpu_samples(struct sim_state *st, unsigned gpu, uint64_t since_us, uint64_t period_us,
                            uint64_t delay_us, bool averaged, struct sim_tl_proc_util *out, unsigned max,
                            uint64_t *now_us);

#endif
