/* Open addressing with linear probing; see vc_map.h. */
#include "vc_map.h"

#include <stdlib.h>
#include <string.h>

static size_t slot_of(uint64_t key, uint32_t kind, size_t cap)
{
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    return (size_t)h & (cap - 1);
}

static int grow(struct vc_map *m, size_t want)
{
    size_t cap = m->cap ? m->cap : 64;
    while (cap < want * 2)
        cap *= 2;
    struct vc_map_entry *slots = calloc(cap, sizeof(*slots));
    if (slots == NULL)
        return -1;
    for (size_t i = 0; i < m->cap; i++) {
        const struct vc_map_entry *e = &m->slots[i];
        if (e->key == 0 || e->kind == VC_MAP_TOMB)
            continue;
        size_t j = slot_of(e->key, e->kind, cap);
        while (slots[j].key != 0)
            j = (j + 1) & (cap - 1);
        slots[j] = *e;
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    m->tombs = 0;
    return 0;
}

static struct vc_map_entry *lookup(struct vc_map *m, uint64_t key, uint32_t kind)
{
    if (m->cap == 0)
        return NULL;
    for (size_t j = slot_of(key, kind, m->cap), n = 0; n < m->cap; j = (j + 1) & (m->cap - 1), n++) {
        struct vc_map_entry *e = &m->slots[j];
        if (e->key == 0 && e->kind != VC_MAP_TOMB)
            return NULL;
        if (e->key == key && e->kind == kind)
            return e;
    }
    return NULL;
}

struct vc_map_entry *vc_map_lookup(struct vc_map *m, uint64_t key, uint32_t kind)
{
    return key == 0 ? NULL : lookup(m, key, kind);
}

int vc_map_put(struct vc_map *m, const struct vc_map_entry *e)
{
    struct vc_map_entry *old = lookup(m, e->key, e->kind);
    if (old != NULL) {
        *old = *e;
        return 0;
    }
    if ((m->used + m->tombs + 1) * 4 > m->cap * 3 && grow(m, m->used + 1) != 0)
        return -1;
    size_t j = slot_of(e->key, e->kind, m->cap);
    while (m->slots[j].key != 0)
        j = (j + 1) & (m->cap - 1);
    if (m->slots[j].kind == VC_MAP_TOMB)
        m->tombs--;
    m->slots[j] = *e;
    m->used++;
    return 0;
}

static void erase(struct vc_map *m, struct vc_map_entry *e)
{
    e->key = 0;
    e->kind = VC_MAP_TOMB;
    m->used--;
    m->tombs++;
}

bool vc_map_find(struct vc_map *m, uint64_t key, uint32_t kind, struct vc_map_entry *out, bool take)
{
    struct vc_map_entry *e = lookup(m, key, kind);
    if (e == NULL)
        return false;
    if (out != NULL)
        *out = *e;
    if (take)
        erase(m, e);
    return true;
}

void vc_map_remove_if(struct vc_map *m, uint32_t kind, bool (*pred)(const struct vc_map_entry *, void *),
                      void (*done)(const struct vc_map_entry *, void *), void *arg)
{
    for (size_t i = 0; i < m->cap; i++) {
        struct vc_map_entry *e = &m->slots[i];
        if (e->key == 0 || e->kind != kind || !pred(e, arg))
            continue;
        struct vc_map_entry copy = *e;
        erase(m, e);
        if (done != NULL)
            done(&copy, arg);
    }
}

bool vc_map_find_if(const struct vc_map *m, uint32_t kind, bool (*pred)(const struct vc_map_entry *, void *), void *arg,
                    struct vc_map_entry *out)
{
    for (size_t i = 0; i < m->cap; i++) {
        const struct vc_map_entry *e = &m->slots[i];
        if (e->key != 0 && e->kind == kind && pred(e, arg)) {
            if (out != NULL)
                *out = *e;
            return true;
        }
    }
    return false;
}

void vc_map_each(struct vc_map *m, uint32_t kind, void (*fn)(struct vc_map_entry *, void *), void *arg)
{
    for (size_t i = 0; i < m->cap; i++) {
        struct vc_map_entry *e = &m->slots[i];
        if (e->key != 0 && e->kind == kind)
            fn(e, arg);
    }
}

void vc_map_reset(struct vc_map *m)
{
    free(m->slots);
    memset(m, 0, sizeof(*m));
}
