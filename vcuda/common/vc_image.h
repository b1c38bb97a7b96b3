/*
 * What a module image asks of device memory: the module-scope variables of
 * PTX text (.global and .const state spaces, as the PTX ISA declares them),
 * which the driver allocates when it loads the module into a context.  Shared
 * by the simulated driver (which allocates them) and the interceptor (which
 * reserves them before the driver is called).
 */
#ifndef VCUDA_VC_IMAGE_H
#define VCUDA_VC_IMAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A loaded module's code takes one 2 MiB page; its variables take whole 2 MiB pages beyond it. */
#define VC_IMAGE_PAGE (2ull << 20)

/* Called for each variable the image defines: its name (not NUL-terminated) and size in bytes. */
typedef void (*vc_image_var_fn)(const char *name, size_t name_len, uint64_t bytes, void *arg);

/*
 * Parses image: PTX text (NUL-terminated, as cuModuleLoadData takes it).  Returns whether it is PTX;
 * *data receives the bytes of its module-scope .global and .const variables (0 for other images:
 * cubins and fatbins are not parsed), and fn (may be NULL) is called for each variable.
 */
bool vc_image_parse(const void *image, uint64_t *data, vc_image_var_fn fn, void *arg);

/* Device memory a module of this image takes in a context: the code page plus its variables' pages. */
uint64_t vc_image_footprint(const void *image);

/*
 * A private copy of image when it is PTX text (NUL-terminated, malloc'ed; *copy), else *copy = NULL (a binary image:
 * charged one page whatever it holds).  What the copy holds is then both what is estimated and what the driver
 * loads, however another thread rewrites the caller's buffer meanwhile.  Returns false when no copy can be had
 * (no memory) or the copy is no PTX text (the buffer changed while it was copied): the load must be refused.
 */
bool vc_image_private(const void *image, char **copy);

/* Reads a module file (cuModuleLoad, cuLibraryLoadFromFile) into a NUL-terminated buffer; NULL if it cannot. */
char *vc_image_read_file(const char *path);

#endif
