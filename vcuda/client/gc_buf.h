/*
 * A byte buffer that grows up to a fixed limit (every input the client takes
 * from the network is bounded).
 */
#ifndef GPU_CLIENT_GC_BUF_H
#define GPU_CLIENT_GC_BUF_H

#include <stddef.h>
#include <stdint.h>

struct gc_buf {
    uint8_t *data;
    size_t len;
    size_t cap;
    size_t limit; /* the most bytes it may ever hold */
};

/* An empty buffer that may hold up to limit bytes. */
void gc_buf_init(struct gc_buf *b, size_t limit);

void gc_buf_free(struct gc_buf *b);

/* Append n bytes; -1 when that would pass the limit or memory runs out. */
int gc_buf_put(struct gc_buf *b, const void *p, size_t n);

/* Append one byte; -1 as gc_buf_put. */
int gc_buf_put_byte(struct gc_buf *b, uint8_t c);

#endif
