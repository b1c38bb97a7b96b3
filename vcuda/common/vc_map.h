/*
 * A small open-addressing hash map from (key, kind) to a record, used by the
 * simulated libcuda and by the interceptor to remember what each allocation,
 * handle or graph node cost.  Not thread-safe: callers hold their own lock.
 * key 0 is reserved (no device pointer, handle or object is 0).
 */
#ifndef VCUDA_VC_MAP_H
#define VCUDA_VC_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct vc_map_entry {
    uint64_t key;   /* 0 = empty */
    uint32_t kind;  /* caller's namespace (allocation kind); VC_MAP_TOMB marks a deleted slot */
    uint32_t gpu;   /* caller data */
    uint64_t size;  /* caller data: bytes accounted */
    uint64_t aux;   /* caller data: e.g. owning graph, pid */
    uint64_t aux2;  /* caller data */
    uint64_t ctx;   /* caller data: the context an allocation belongs to */
};

#define VC_MAP_TOMB 0xFFFFFFFFu

struct vc_map {
    struct vc_map_entry *slots;
    size_t cap;   /* power of two, or 0 */
    size_t used;  /* live entries */
    size_t tombs; /* deleted slots */
};

/* Inserts or replaces.  Returns 0, or -1 when memory runs out (the map is unchanged). */
int vc_map_put(struct vc_map *m, const struct vc_map_entry *e);

/* The entry of (key, kind) in place (valid until the map changes), or NULL. */
struct vc_map_entry *vc_map_lookup(struct vc_map *m, uint64_t key, uint32_t kind);

/* Looks up (key, kind); copies the entry to *out (if not NULL) and removes it when take. */
bool vc_map_find(struct vc_map *m, uint64_t key, uint32_t kind, struct vc_map_entry *out, bool take);

/* Removes every entry of kind for which pred(entry, arg) is true, calling done(entry, arg) for each. */
void vc_map_remove_if(struct vc_map *m, uint32_t kind, bool (*pred)(const struct vc_map_entry *, void *),
                      void (*done)(const struct vc_map_entry *, void *), void *arg);

/* The first entry of kind for which pred(entry, arg) is true, copied to *out; false if none. */
bool vc_map_find_if(const struct vc_map *m, uint32_t kind, bool (*pred)(const struct vc_map_entry *, void *), void *arg,
                    struct vc_map_entry *out);

/* Calls fn(entry, arg) for every entry of kind; fn may change the entry's caller data (not key or kind). */
void vc_map_each(struct vc_map *m, uint32_t kind, void (*fn)(struct vc_map_entry *, void *), void *arg);

/* Forgets everything (keeps no memory). */
void vc_map_reset(struct vc_map *m);

#endif
