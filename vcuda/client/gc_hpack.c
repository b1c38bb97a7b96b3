/*
 * HPACK (RFC 7541) for gpu-client: see gc_hpack.h.
 */
#include "gc_hpack.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- byte buffer ---------------------------------------------------------------- */

void gc_buf_init(struct gc_buf *b, size_t limit)
{
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
    b->limit = limit;
}

void gc_buf_free(struct gc_buf *b)
{
    free(b->data);
    gc_buf_init(b, b->limit);
}

int gc_buf_put(struct gc_buf *b, const void *p, size_t n)
{
    if (n > b->limit - b->len)
        return -1;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n)
            cap *= 2;
        if (cap > b->limit)
            cap = b->limit;
        uint8_t *grown = realloc(b->data, cap);
        if (grown == NULL)
            return -1;
        b->data = grown;
        b->cap = cap;
    }
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

int gc_buf_put_byte(struct gc_buf *b, uint8_t c)
{
    return gc_buf_put(b, &c, 1);
}

/* ---- static table (RFC 7541, Appendix A) ------------------------------------------ */

static const struct {
    const char *name;
    const char *value;
} static_table[GC_HPACK_STATIC_ENTRIES] = {
    {":authority", ""},
    {":method", "GET"},
    {":method", "POST"},
    {":path", "/"},
    {":path", "/index.html"},
    {":scheme", "http"},
    {":scheme", "https"},
    {":status", "200"},
    {":status", "204"},
    {":status", "206"},
    {":status", "304"},
    {":status", "400"},
    {":status", "404"},
    {":status", "500"},
    {"accept-charset", ""},
    {"accept-encoding", "gzip, deflate"},
    {"accept-language", ""},
    {"accept-ranges", ""},
    {"accept", ""},
    {"access-control-allow-origin", ""},
    {"age", ""},
    {"allow", ""},
    {"authorization", ""},
    {"cache-control", ""},
    {"content-disposition", ""},
    {"content-encoding", ""},
    {"content-language", ""},
    {"content-length", ""},
    {"content-location", ""},
    {"content-range", ""},
    {"content-type", ""},
    {"cookie", ""},
    {"date", ""},
    {"etag", ""},
    {"expect", ""},
    {"expires", ""},
    {"from", ""},
    {"host", ""},
    {"if-match", ""},
    {"if-modified-since", ""},
    {"if-none-match", ""},
    {"if-range", ""},
    {"if-unmodified-since", ""},
    {"last-modified", ""},
    {"link", ""},
    {"location", ""},
    {"max-forwards", ""},
    {"proxy-authenticate", ""},
    {"proxy-authorization", ""},
    {"range", ""},
    {"referer", ""},
    {"refresh", ""},
    {"retry-after", ""},
    {"server", ""},
    {"set-cookie", ""},
    {"strict-transport-security", ""},
    {"transfer-encoding", ""},
    {"user-agent", ""},
    {"vary", ""},
    {"via", ""},
    {"www-authenticate", ""},
};

/* ---- Huffman decoding ------------------------------------------------------------- */

#define HUFFMAN_MAX_BITS 30

long gc_huffman_decode(const uint8_t *in, size_t len, char *out, size_t outcap)
{
    /* Canonical code: per length, the first code and where its symbols start in code order. */
    unsigned count[HUFFMAN_MAX_BITS + 1] = {0};
    uint32_t first[HUFFMAN_MAX_BITS + 1];
    unsigned start[HUFFMAN_MAX_BITS + 1];
    uint16_t symbols[GC_HUFFMAN_SYMBOLS];
    for (unsigned s = 0; s < GC_HUFFMAN_SYMBOLS; s++)
        count[gc_huffman_codes[s].bits]++;
    uint32_t next = 0;
    unsigned at = 0;
    for (unsigned bits = 1; bits <= HUFFMAN_MAX_BITS; bits++) {
        first[bits] = next;
        start[bits] = at;
        next = (next + count[bits]) << 1;
        at += count[bits];
    }
    unsigned filled[HUFFMAN_MAX_BITS + 1] = {0};
    for (unsigned s = 0; s < GC_HUFFMAN_SYMBOLS; s++) {
        unsigned bits = gc_huffman_codes[s].bits;
        symbols[start[bits] + filled[bits]++] = (uint16_t)s;
    }

    size_t n = 0;
    uint32_t code = 0;
    unsigned bits = 0;
    for (size_t i = 0; i < len; i++) {
        for (int bit = 7; bit >= 0; bit--) {
            code = (code << 1) | ((in[i] >> bit) & 1u);
            bits++;
            if (bits > HUFFMAN_MAX_BITS)
                return -1;
            if (count[bits] && code >= first[bits] && code - first[bits] < count[bits]) {
                unsigned sym = symbols[start[bits] + (code - first[bits])];
                if (sym == 256 || n >= outcap)
                    return -1; /* EOS inside a string is an error (RFC 7541, 5.2) */
                out[n++] = (char)sym;
                code = 0;
                bits = 0;
            }
        }
    }
    /* Padding: fewer than 8 bits, all ones (the most significant bits of EOS). */
    if (bits > 7 || code != (1u << bits) - 1u)
        return -1;
    return (long)n;
}

/* ---- decoder ----------------------------------------------------------------------- */

static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

void gc_hpack_decoder_init(struct gc_hpack_decoder *d)
{
    memset(d, 0, sizeof(*d));
    d->max_size = GC_HPACK_TABLE_SIZE;
    d->limit = GC_HPACK_TABLE_SIZE;
}

static void entry_free(struct gc_hpack_entry *e)
{
    free(e->name);
    free(e->value);
    memset(e, 0, sizeof(*e));
}

void gc_hpack_decoder_free(struct gc_hpack_decoder *d)
{
    for (size_t i = 0; i < d->count; i++)
        entry_free(&d->entries[i]);
    d->count = 0;
    d->size = 0;
}

static void evict_to(struct gc_hpack_decoder *d, size_t room)
{
    while (d->count && d->size > room) {
        struct gc_hpack_entry *last = &d->entries[d->count - 1];
        d->size -= last->name_len + last->value_len + 32;
        entry_free(last);
        d->count--;
    }
}

/* Add a field to the dynamic table (RFC 7541, 4.4); copies the strings. */
static int table_add(struct gc_hpack_decoder *d, const char *name, size_t name_len, const char *value,
                     size_t value_len)
{
    size_t need = name_len + value_len + 32;
    if (need > d->max_size) {
        evict_to(d, 0); /* an entry larger than the table empties it and is not added */
        return 0;
    }
    /* Copy first: name may be an entry that the eviction below frees (RFC 7541, 4.4). */
    char *n = malloc(name_len + 1);
    char *v = malloc(value_len + 1);
    if (n == NULL || v == NULL) {
        free(n);
        free(v);
        return -1;
    }
    memcpy(n, name, name_len);
    n[name_len] = '\0';
    memcpy(v, value, value_len);
    v[value_len] = '\0';
    evict_to(d, d->max_size - need);
    memmove(&d->entries[1], &d->entries[0], d->count * sizeof(d->entries[0]));
    d->entries[0] = (struct gc_hpack_entry){n, name_len, v, value_len};
    d->count++;
    d->size += need;
    return 0;
}

/* A prefixed integer (RFC 7541, 5.1), bounded to 2^28. */
static int get_int(const uint8_t **p, const uint8_t *end, unsigned prefix_bits, size_t *out)
{
    if (*p >= end)
        return -1;
    size_t max = (1u << prefix_bits) - 1u;
    size_t v = **p & max;
    (*p)++;
    if (v < max) {
        *out = v;
        return 0;
    }
    for (unsigned shift = 0;; shift += 7) {
        if (*p >= end || shift > 21)
            return -1;
        uint8_t b = **p;
        (*p)++;
        v += (size_t)(b & 0x7fu) << shift;
        if (!(b & 0x80u))
            break;
    }
    *out = v;
    return 0;
}

/* A string literal (RFC 7541, 5.2) into a new allocation (NUL-terminated); NULL on error. */
static char *get_string(const uint8_t **p, const uint8_t *end, size_t *len, char *err, size_t errlen)
{
    if (*p >= end) {
        set_err(err, errlen, "header block ends inside a string");
        return NULL;
    }
    int huffman = (**p & 0x80u) != 0;
    size_t n;
    if (get_int(p, end, 7, &n) != 0 || n > (size_t)(end - *p)) {
        set_err(err, errlen, "string length runs past the header block");
        return NULL;
    }
    size_t cap = huffman ? n * 8 / 5 : n; /* the shortest code has 5 bits */
    if (cap > GC_HPACK_MAX_STRING) {
        if (!huffman) {
            set_err(err, errlen, "header string of %zu bytes is longer than %d", n, GC_HPACK_MAX_STRING);
            return NULL;
        }
        cap = GC_HPACK_MAX_STRING; /* decoding fails if it would be longer */
    }
    char *s = malloc(cap + 1);
    if (s == NULL) {
        set_err(err, errlen, "out of memory");
        return NULL;
    }
    if (huffman) {
        long got = gc_huffman_decode(*p, n, s, cap);
        if (got < 0) {
            free(s);
            set_err(err, errlen, "invalid Huffman-coded string, or longer than %d bytes", GC_HPACK_MAX_STRING);
            return NULL;
        }
        *len = (size_t)got;
    } else {
        memcpy(s, *p, n);
        *len = n;
    }
    s[*len] = '\0';
    *p += n;
    return s;
}

/* Name (and value) of table index i (1-based: static, then dynamic); -1 when out of range. */
static int lookup(const struct gc_hpack_decoder *d, size_t i, const char **name, size_t *name_len,
                  const char **value, size_t *value_len)
{
    if (i >= 1 && i <= GC_HPACK_STATIC_ENTRIES) {
        *name = static_table[i - 1].name;
        *name_len = strlen(*name);
        *value = static_table[i - 1].value;
        *value_len = strlen(*value);
        return 0;
    }
    if (i > GC_HPACK_STATIC_ENTRIES && i - GC_HPACK_STATIC_ENTRIES - 1 < d->count) {
        const struct gc_hpack_entry *e = &d->entries[i - GC_HPACK_STATIC_ENTRIES - 1];
        *name = e->name;
        *name_len = e->name_len;
        *value = e->value;
        *value_len = e->value_len;
        return 0;
    }
    return -1;
}

int gc_hpack_decode(struct gc_hpack_decoder *d, const uint8_t *block, size_t len, gc_hpack_field_fn fn,
                    void *ctx, char *err, size_t errlen)
{
    const uint8_t *p = block;
    const uint8_t *end = block + len;
    int fields = 0;
    while (p < end) {
        uint8_t b = *p;
        if (b & 0x80u) { /* indexed field */
            size_t i;
            const char *name, *value;
            size_t name_len, value_len;
            if (get_int(&p, end, 7, &i) != 0) {
                set_err(err, errlen, "truncated or oversized index");
                return -1;
            }
            if (lookup(d, i, &name, &name_len, &value, &value_len) != 0) {
                set_err(err, errlen, "indexed header field %zu is not in the table", i);
                return -1;
            }
            int rc = fn(ctx, name, name_len, value, value_len);
            if (rc != 0)
                return rc;
            fields++;
            continue;
        }
        if ((b & 0xe0u) == 0x20u) { /* dynamic table size update */
            size_t size;
            if (get_int(&p, end, 5, &size) != 0 || size > d->limit) {
                set_err(err, errlen, "table size update beyond the announced %zu bytes", d->limit);
                return -1;
            }
            if (fields) {
                set_err(err, errlen, "table size update after a header field");
                return -1;
            }
            d->max_size = size;
            evict_to(d, size);
            continue;
        }
        /* literal: with incremental indexing (01), without (0000) or never indexed (0001) */
        int indexing = (b & 0xc0u) == 0x40u;
        unsigned prefix = indexing ? 6 : 4;
        size_t i;
        if (get_int(&p, end, prefix, &i) != 0) {
            set_err(err, errlen, "truncated header field");
            return -1;
        }
        char *own_name = NULL;
        const char *name;
        size_t name_len;
        if (i == 0) {
            own_name = get_string(&p, end, &name_len, err, errlen);
            if (own_name == NULL)
                return -1;
            name = own_name;
        } else {
            const char *unused;
            size_t unused_len;
            if (lookup(d, i, &name, &name_len, &unused, &unused_len) != 0) {
                set_err(err, errlen, "header name index %zu is not in the table", i);
                return -1;
            }
        }
        size_t value_len;
        char *value = get_string(&p, end, &value_len, err, errlen);
        if (value == NULL) {
            free(own_name);
            return -1;
        }
        int rc = fn(ctx, name, name_len, value, value_len);
        /* name may point into the table: add only after the callback, from copies */
        if (rc == 0 && indexing && table_add(d, name, name_len, value, value_len) != 0) {
            set_err(err, errlen, "out of memory");
            rc = -1;
        }
        free(own_name);
        free(value);
        if (rc != 0)
            return rc;
        fields++;
    }
    return 0;
}

/* ---- encoder ------------------------------------------------------------------------ */

static int put_int(struct gc_buf *b, uint8_t first_bits, unsigned prefix_bits, size_t v)
{
    size_t max = (1u << prefix_bits) - 1u;
    if (v < max)
        return gc_buf_put_byte(b, (uint8_t)(first_bits | v));
    if (gc_buf_put_byte(b, (uint8_t)(first_bits | max)) != 0)
        return -1;
    v -= max;
    while (v >= 0x80u) {
        if (gc_buf_put_byte(b, (uint8_t)(0x80u | (v & 0x7fu))) != 0)
            return -1;
        v >>= 7;
    }
    return gc_buf_put_byte(b, (uint8_t)v);
}

static int put_string(struct gc_buf *b, const char *s)
{
    size_t n = strlen(s);
    if (put_int(b, 0x00, 7, n) != 0)
        return -1;
    return gc_buf_put(b, s, n);
}

int gc_hpack_put_indexed(struct gc_buf *b, unsigned index)
{
    return put_int(b, 0x80, 7, index);
}

int gc_hpack_put_literal(struct gc_buf *b, unsigned name_index, const char *name, const char *value)
{
    if (put_int(b, 0x00, 4, name_index) != 0)
        return -1;
    if (name_index == 0 && put_string(b, name) != 0)
        return -1;
    return put_string(b, value);
}
