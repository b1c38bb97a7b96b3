/* See vc_proc.h. */
#include "vc_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Reads the start of /proc/<pid>/<name> into buf (NUL-terminated); false when unreadable or empty. */
static bool read_proc(int pid, const char *name, char *buf, size_t size)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/%s", pid, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = '\0';
    return true;
}

/* Reads /proc/<pid>/stat; returns the state letter and the start time, or 0 when unreadable. */
static char read_stat(int pid, uint64_t *start)
{
    char buf[1024];
    if (!read_proc(pid, "stat", buf, sizeof(buf)))
        return 0;
    /* "pid (comm) S ppid ...": comm may hold spaces and parentheses, so start after the last ')'. */
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] != ' ')
        return 0;
    char state = p[2];
    p += 2;
    /* Field 3 is the state; the start time is field 22, i.e. 19 fields further. */
    for (int field = 3; field < 22 && p != NULL; field++) {
        p = strchr(p, ' ');
        if (p != NULL)
            p++;
    }
    if (p == NULL)
        return 0;
    *start = strtoull(p, NULL, 10);
    return state;
}

uint64_t vc_proc_start_time(int pid)
{
    uint64_t start = 0;
    return read_stat(pid, &start) ? start : 0;
}

/*
 * The number of threads of a process (/proc/<pid>/status "Threads:"), 0 when unreadable.  A process whose
 * main thread called pthread_exit while others go on shows its leader as a zombie in /proc/<pid>/stat, but
 * lives on (with its GPU memory) as long as any thread does: then it has more than one thread.
 */
static long thread_count(int pid)
{
    char buf[4096];
    if (!read_proc(pid, "status", buf, sizeof(buf)))
        return 0;
    const char *p = strstr(buf, "\nThreads:");
    return p != NULL ? strtol(p + 9, NULL, 10) : 0;
}

bool vc_proc_alive(int pid, uint64_t start)
{
    if (pid <= 0)
        return false;
    uint64_t now_start = 0;
    char state = read_stat(pid, &now_start);
    if (state == 0) /* no /proc entry: gone, or /proc not mounted; ask the kernel */
        return kill(pid, 0) == 0 || errno == EPERM;
    if (state == 'X' || state == 'x' || (state == 'Z' && thread_count(pid) <= 1))
        return false; /* a zombie whose every thread is gone (a zombie leader of live threads still runs) */
    return start == 0 || now_start == start;
}
