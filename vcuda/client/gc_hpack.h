/*
 * HPACK (RFC 7541): the encoder side the client needs (static-table references
 * and literals without indexing, no Huffman) and a complete decoder (static and
 * dynamic table, size updates, every literal form, Huffman strings).
 */
#ifndef GPU_CLIENT_GC_HPACK_H
#define GPU_CLIENT_GC_HPACK_H

#include <stddef.h>
#include <stdint.h>

#include "gc_buf.h"

#define GC_HUFFMAN_SYMBOLS 257
#define GC_HPACK_STATIC_ENTRIES 61
/* The dynamic table size the client announces (SETTINGS_HEADER_TABLE_SIZE's default). */
#define GC_HPACK_TABLE_SIZE 4096
/* The longest header name or value accepted, after Huffman decoding. */
#define GC_HPACK_MAX_STRING 8192

struct gc_huffman_code {
    uint32_t code;
    uint8_t bits;
};

extern const struct gc_huffman_code gc_huffman_codes[GC_HUFFMAN_SYMBOLS];

struct gc_hpack_entry {
    char *name;
    size_t name_len;
    char *value;
    size_t value_len;
};

struct gc_hpack_decoder {
    struct gc_hpack_entry entries[GC_HPACK_TABLE_SIZE / 32]; /* newest first; an entry costs >= 32 */
    size_t count;
    size_t size;     /* sum of (name + value + 32) of the entries */
    size_t max_size; /* current maximum, changed by size updates */
    size_t limit;    /* what the client announced: the most max_size may be */
};

/* Called for each decoded header field; non-zero stops decoding with that value. */
typedef int (*gc_hpack_field_fn)(void *ctx, const char *name, size_t name_len, const char *value,
                                 size_t value_len);

void gc_hpack_decoder_init(struct gc_hpack_decoder *d);
void gc_hpack_decoder_free(struct gc_hpack_decoder *d);

/*
 * Decode one complete header block. Returns 0; -1 on a malformed block (err
 * says why; the connection's table is then unusable); or the field callback's
 * non-zero value.
 */
int gc_hpack_decode(struct gc_hpack_decoder *d, const uint8_t *block, size_t len, gc_hpack_field_fn fn,
                    void *ctx, char *err, size_t errlen);

/*
 * Decode a Huffman-coded string into out (at most outcap bytes); returns its
 * length, or -1 on an invalid code, EOS, bad padding or overflow.
 */
long gc_huffman_decode(const uint8_t *in, size_t len, char *out, size_t outcap);

/* Encoder: an indexed field (static table index). */
int gc_hpack_put_indexed(struct gc_buf *b, unsigned index);

/*
 * Encoder: a literal field without indexing, its name a static-table index
 * (name_index > 0) or the literal name (name_index 0); strings raw (no Huffman).
 */
int gc_hpack_put_literal(struct gc_buf *b, unsigned name_index, const char *name, const char *value);

#endif
