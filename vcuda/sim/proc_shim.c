/*
 * libgpusim-proc.so: makes a process of the simulated node see the simulated
 * driver's /proc/driver/nvidia/version.  Preloaded (LD_PRELOAD), it sends every
 * open of that path to the file GPUSIM_PROC_VERSION names, which the simulated
 * libraries write when they load the node spec (sim_spec.c).  Every other path
 * goes to the C library untouched.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define PROC_VERSION "/proc/driver/nvidia/version"
#define SHIM_EXPORT __attribute__((visibility("default")))

static const char *redirect(const char *path)
{
    if (path == NULL || strcmp(path, PROC_VERSION) != 0)
        return path;
    const char *to = getenv("GPUSIM_PROC_VERSION");
    return to != NULL && to[0] != '\0' ? to : path;
}

static mode_t mode_arg(int flags, va_list ap)
{
    return (flags & (O_CREAT | O_TMPFILE)) != 0 ? (mode_t)va_arg(ap, int) : 0;
}

#define NEXT(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))

SHIM_EXPORT int open(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    return NEXT(open)(redirect(path), flags, mode);
}

SHIM_EXPORT int open64(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    return NEXT(open64)(redirect(path), flags, mode);
}

SHIM_EXPORT int openat(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    return NEXT(openat)(dirfd, redirect(path), flags, mode);
}

SHIM_EXPORT int openat64(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    return NEXT(openat64)(dirfd, redirect(path), flags, mode);
}

SHIM_EXPORT FILE *fopen(const char *path, const char *mode)
{
    return NEXT(fopen)(redirect(path), mode);
}

SHIM_EXPORT FILE *fopen64(const char *path, const char *mode)
{
    return NEXT(fopen64)(redirect(path), mode);
}

SHIM_EXPORT int stat(const char *path, struct stat *sb)
{
    return NEXT(stat)(redirect(path), sb);
}

SHIM_EXPORT int access(const char *path, int amode)
{
    return NEXT(access)(redirect(path), amode);
}
