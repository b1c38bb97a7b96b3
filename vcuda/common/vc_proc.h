/*
 * Process liveness for slots keyed by PID: a PID together with the process's
 * start time (field 22 of /proc/<pid>/stat, clock ticks since boot) names one
 * process even after the PID is reused.
 */
#ifndef VCUDA_VC_PROC_H
#define VCUDA_VC_PROC_H

#include <stdbool.h>
#include <stdint.h>

/* Start time of pid, or 0 when /proc does not tell (no such process, no /proc). */
uint64_t vc_proc_start_time(int pid);

/*
 * Whether the process (pid, start) still runs: false when the PID is gone, is
 * a zombie (not one whose main thread alone exited: its other threads still
 * run it), or now belongs to a process with another start time (start 0: not
 * checked).
 */
bool vc_proc_alive(int pid, uint64_t start);

#endif
