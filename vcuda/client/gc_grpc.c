/*
 * A unary gRPC call over HTTP/2: see gc_grpc.h.
 */
#include "gc_grpc.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "gc_buf.h"
#include "gc_hpack.h"

/* Frame types and flags (RFC 9113, 6). */
enum {
    FRAME_DATA = 0x0,
    FRAME_HEADERS = 0x1,
    FRAME_PRIORITY = 0x2,
    FRAME_RST_STREAM = 0x3,
    FRAME_SETTINGS = 0x4,
    FRAME_PUSH_PROMISE = 0x5,
    FRAME_PING = 0x6,
    FRAME_GOAWAY = 0x7,
    FRAME_WINDOW_UPDATE = 0x8,
    FRAME_CONTINUATION = 0x9,
};
enum { FLAG_END_STREAM = 0x1, FLAG_ACK = 0x1, FLAG_END_HEADERS = 0x4, FLAG_PADDED = 0x8, FLAG_PRIORITY = 0x20 };
enum {
    SETTINGS_ENABLE_PUSH = 0x2,
    SETTINGS_INITIAL_WINDOW_SIZE = 0x4,
    SETTINGS_MAX_FRAME_SIZE = 0x5,
};

#define STREAM_ID 1u
#define MAX_FRAME 16384u             /* our SETTINGS_MAX_FRAME_SIZE (the default) */
#define MAX_HEADER_BLOCK (64u * 1024u) /* one header block, all its frames */
#define FRAME_HEADER 9
#define H2_REFUSED_STREAM 0x7u

static const char PREFACE[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

static const char *const CODE_NAMES[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

static const char *const H2_ERRORS[] = {
    "NO_ERROR",         "PROTOCOL_ERROR",     "INTERNAL_ERROR",      "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
    "STREAM_CLOSED",    "FRAME_SIZE_ERROR",   "REFUSED_STREAM",      "CANCEL",             "COMPRESSION_ERROR",
    "CONNECT_ERROR",    "ENHANCE_YOUR_CALM",  "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED",
};

const char *gc_grpc_code_name(int code)
{
    if (code >= 0 && (size_t)code < sizeof(CODE_NAMES) / sizeof(CODE_NAMES[0]))
        return CODE_NAMES[code];
    return "UNKNOWN_CODE";
}

static const char *h2_error_name(uint32_t code)
{
    if (code < sizeof(H2_ERRORS) / sizeof(H2_ERRORS[0]))
        return H2_ERRORS[code];
    return "unknown error code";
}

int64_t gc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* ---- socket I/O bounded by the deadline --------------------------------------------- */

struct conn {
    int fd;
    int64_t deadline;
    char *err;
    size_t errlen;
    int lost;         /* the peer closed or reset the connection */
    int write_failed; /* an acknowledgement could not be sent: send no more */
};

/* Wait for events on the socket; 0 when ready, -1 (err set) on timeout or failure. */
static int wait_fd(struct conn *c, short events)
{
    for (;;) {
        int64_t left = c->deadline - gc_now_ms();
        if (left <= 0) {
            set_err(c->err, c->errlen, "no complete answer before the deadline");
            return -1;
        }
        struct pollfd pfd = {.fd = c->fd, .events = events};
        int rc = poll(&pfd, 1, left > 1000 ? 1000 : (int)left);
        if (rc > 0)
            return 0;
        if (rc < 0 && errno != EINTR) {
            set_err(c->err, c->errlen, "poll: %s", strerror(errno));
            return -1;
        }
    }
}

static int write_all(struct conn *c, const void *p, size_t n)
{
    const uint8_t *at = p;
    while (n) {
        /* send(), not write(): a peer that went away is an error to report, not a SIGPIPE. */
        ssize_t w = send(c->fd, at, n, MSG_NOSIGNAL);
        if (w > 0) {
            at += w;
            n -= (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (wait_fd(c, POLLOUT) != 0)
                return -1;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else {
            if (w < 0 && (errno == EPIPE || errno == ECONNRESET))
                c->lost = 1;
            set_err(c->err, c->errlen, "cannot send to the server: %s", w < 0 ? strerror(errno) : "short write");
            return -1;
        }
    }
    return 0;
}

static int read_all(struct conn *c, void *p, size_t n)
{
    uint8_t *at = p;
    while (n) {
        ssize_t r = read(c->fd, at, n);
        if (r > 0) {
            at += r;
            n -= (size_t)r;
        } else if (r == 0) {
            c->lost = 1;
            set_err(c->err, c->errlen, "the server closed the connection before the call finished");
            return -1;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (wait_fd(c, POLLIN) != 0)
                return -1;
        } else if (errno != EINTR) {
            if (errno == ECONNRESET)
                c->lost = 1;
            set_err(c->err, c->errlen, "cannot read from the server: %s", strerror(errno));
            return -1;
        }
    }
    return 0;
}

static int put_frame_header(struct gc_buf *b, size_t len, uint8_t type, uint8_t flags, uint32_t stream)
{
    uint8_t h[FRAME_HEADER] = {
        (uint8_t)(len >> 16), (uint8_t)(len >> 8),  (uint8_t)len,          type, flags,
        (uint8_t)(stream >> 24), (uint8_t)(stream >> 16), (uint8_t)(stream >> 8), (uint8_t)stream,
    };
    return gc_buf_put(b, h, sizeof(h));
}

static int send_frame(struct conn *c, uint8_t type, uint8_t flags, uint32_t stream, const void *payload,
                      size_t len)
{
    struct gc_buf b;
    gc_buf_init(&b, FRAME_HEADER + len);
    int rc = -1;
    if (put_frame_header(&b, len, type, flags, stream) == 0 && gc_buf_put(&b, payload, len) == 0)
        rc = write_all(c, b.data, b.len);
    else
        set_err(c->err, c->errlen, "out of memory");
    gc_buf_free(&b);
    return rc;
}

/*
 * An acknowledgement (SETTINGS, PING) is best effort: a server going away may have stopped reading
 * after writing its whole answer, which is still read; a connection really gone shows as EOF or
 * a reset on the next read, a silent one as the deadline.
 */
static void send_ack(struct conn *c, uint8_t type, const void *payload, size_t len)
{
    if (c->write_failed)
        return;
    char ignored[160];
    struct conn quiet = *c;
    quiet.err = ignored;
    quiet.errlen = sizeof(ignored);
    if (send_frame(&quiet, type, FLAG_ACK, 0, payload, len) != 0)
        c->write_failed = 1;
}

/* ---- the request ---------------------------------------------------------------------- */

static int build_request(const struct gc_call *call, struct gc_buf *out)
{
    struct gc_buf hdr;
    gc_buf_init(&hdr, MAX_FRAME);
    char timeout[32];
    snprintf(timeout, sizeof(timeout), "%lldm", (long long)(call->timeout_ms > 0 ? call->timeout_ms : 1));
    int rc = 0;
    rc |= gc_hpack_put_indexed(&hdr, 3);                                     /* :method POST */
    rc |= gc_hpack_put_indexed(&hdr, 6);                                     /* :scheme http */
    rc |= gc_hpack_put_literal(&hdr, 4, NULL, call->path);                   /* :path */
    rc |= gc_hpack_put_literal(&hdr, 1, NULL, call->authority);              /* :authority */
    rc |= gc_hpack_put_literal(&hdr, 31, NULL, "application/grpc");          /* content-type */
    rc |= gc_hpack_put_literal(&hdr, 0, "te", "trailers");                   /* required by gRPC */
    rc |= gc_hpack_put_literal(&hdr, 58, NULL, call->user_agent);            /* user-agent */
    rc |= gc_hpack_put_literal(&hdr, 0, "grpc-timeout", timeout);            /* the deadline */
    if (rc != 0 || call->message_len > GC_GRPC_MAX_MESSAGE) {
        gc_buf_free(&hdr);
        return -1;
    }
    /* Our SETTINGS: no server push. */
    static const uint8_t settings[] = {0, SETTINGS_ENABLE_PUSH, 0, 0, 0, 0};
    uint8_t prefix[5] = {0, (uint8_t)(call->message_len >> 24), (uint8_t)(call->message_len >> 16),
                         (uint8_t)(call->message_len >> 8), (uint8_t)call->message_len};
    rc |= gc_buf_put(out, PREFACE, sizeof(PREFACE) - 1);
    rc |= put_frame_header(out, sizeof(settings), FRAME_SETTINGS, 0, 0);
    rc |= gc_buf_put(out, settings, sizeof(settings));
    rc |= put_frame_header(out, hdr.len, FRAME_HEADERS, FLAG_END_HEADERS, STREAM_ID);
    rc |= gc_buf_put(out, hdr.data, hdr.len);
    /* The message fits the initial 65535-byte flow-control windows and one frame. */
    rc |= put_frame_header(out, sizeof(prefix) + call->message_len, FRAME_DATA, FLAG_END_STREAM, STREAM_ID);
    rc |= gc_buf_put(out, prefix, sizeof(prefix));
    rc |= gc_buf_put(out, call->message, call->message_len);
    gc_buf_free(&hdr);
    return rc ? -1 : 0;
}

/* ---- the response ---------------------------------------------------------------------- */

enum stage { AWAIT_HEADERS, AWAIT_TRAILERS, FINISHED };

struct call_state {
    struct conn *conn;
    struct gc_reply *reply;
    struct gc_hpack_decoder hpack;
    enum stage stage;
    int in_block;         /* inside a header block (HEADERS without END_HEADERS seen) */
    int block_end_stream; /* END_STREAM of the HEADERS frame that opened the block */
    int trailers;         /* the block being decoded is the trailers */
    int status_seen;
    int content_type_ok;
    struct gc_buf block;
    struct gc_buf message;
};

static int is_name(const char *name, size_t len, const char *want)
{
    return len == strlen(want) && memcmp(name, want, len) == 0;
}

static int parse_uint(const char *s, size_t len, int max, int *out)
{
    if (len == 0 || len > 9)
        return -1;
    int v = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    if (v > max)
        return -1;
    *out = v;
    return 0;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* grpc-message is percent-encoded; line breaks become spaces, other control bytes '?'. */
static void decode_message(const char *s, size_t len, char *out, size_t outcap)
{
    size_t n = 0;
    for (size_t i = 0; i < len && n + 1 < outcap; i++) {
        int c = (unsigned char)s[i];
        if (c == '%' && i + 2 < len && hex_value(s[i + 1]) >= 0 && hex_value(s[i + 2]) >= 0) {
            c = hex_value(s[i + 1]) * 16 + hex_value(s[i + 2]);
            i += 2;
        }
        if (c == '\n' || c == '\t' || c == '\r')
            c = ' '; /* the message ends up on one line */
        out[n++] = c >= 0x20 && c != 0x7f ? (char)c : '?';
    }
    out[n] = '\0';
}

static int on_field(void *ctx, const char *name, size_t name_len, const char *value, size_t value_len)
{
    struct call_state *st = ctx;
    struct conn *c = st->conn;
    if (name_len && name[0] == ':') {
        if (st->trailers || !is_name(name, name_len, ":status")) {
            set_err(c->err, c->errlen, "unexpected pseudo-header %.*s in the response", (int)name_len, name);
            return -1;
        }
        if (parse_uint(value, value_len, 999, &st->reply->http_status) != 0) {
            set_err(c->err, c->errlen, "invalid :status %.*s", (int)(value_len > 32 ? 32 : value_len), value);
            return -1;
        }
        st->status_seen = 1;
    } else if (is_name(name, name_len, "content-type")) {
        st->content_type_ok = value_len >= 16 && memcmp(value, "application/grpc", 16) == 0 &&
                              (value_len == 16 || value[16] == '+' || value[16] == ';');
    } else if (is_name(name, name_len, "grpc-status")) {
        if (parse_uint(value, value_len, 1000000, &st->reply->grpc_status) != 0) {
            set_err(c->err, c->errlen, "invalid grpc-status %.*s", (int)(value_len > 32 ? 32 : value_len), value);
            return -1;
        }
    } else if (is_name(name, name_len, "grpc-message")) {
        decode_message(value, value_len, st->reply->grpc_message, sizeof(st->reply->grpc_message));
    }
    return 0;
}

/* A complete header block: the response headers, or the trailers. */
static int finish_block(struct call_state *st)
{
    struct conn *c = st->conn;
    char why[200] = "";
    st->trailers = st->stage == AWAIT_TRAILERS;
    int rc = gc_hpack_decode(&st->hpack, st->block.data, st->block.len, on_field, st, why, sizeof(why));
    st->block.len = 0;
    st->in_block = 0;
    if (rc != 0) {
        if (why[0])
            set_err(c->err, c->errlen, "undecodable response headers: %s", why);
        return -1;
    }
    if (st->stage == AWAIT_HEADERS) {
        if (!st->status_seen) {
            set_err(c->err, c->errlen, "response headers without :status");
            return -1;
        }
        int http = st->reply->http_status;
        if (http >= 100 && http < 200 && !st->block_end_stream) {
            st->status_seen = 0; /* informational: the real headers follow */
            return 0;
        }
        if (http != 200) {
            set_err(c->err, c->errlen, "HTTP status %d instead of 200: not a gRPC server", http);
            return -1;
        }
        if (!st->content_type_ok) {
            set_err(c->err, c->errlen, "response content-type is not application/grpc: not a gRPC server");
            return -1;
        }
        st->stage = st->block_end_stream ? FINISHED : AWAIT_TRAILERS; /* END_STREAM: trailers-only */
        return 0;
    }
    if (!st->block_end_stream) {
        set_err(c->err, c->errlen, "trailers without END_STREAM");
        return -1;
    }
    st->stage = FINISHED;
    return 0;
}

/* Strip the padding (and priority fields) of a DATA or HEADERS payload. */
static int unpad(struct call_state *st, uint8_t flags, int priority, const uint8_t **p, size_t *len)
{
    size_t pad = 0;
    if (flags & FLAG_PADDED) {
        if (*len < 1)
            goto bad;
        pad = **p;
        (*p)++;
        (*len)--;
    }
    if (priority && (flags & FLAG_PRIORITY)) {
        if (*len < 5)
            goto bad;
        *p += 5;
        *len -= 5;
    }
    if (pad > *len)
        goto bad;
    *len -= pad;
    return 0;
bad:
    set_err(st->conn->err, st->conn->errlen, "frame padding longer than the frame");
    return -1;
}

static int on_frame(struct call_state *st, uint8_t type, uint8_t flags, uint32_t stream, const uint8_t *p,
                    size_t len)
{
    struct conn *c = st->conn;
    if (st->in_block && (type != FRAME_CONTINUATION || stream != STREAM_ID)) {
        set_err(c->err, c->errlen, "frame of type %u inside a header block", type);
        return -1;
    }
    switch (type) {
    case FRAME_SETTINGS:
        if (stream != 0 || ((flags & FLAG_ACK) ? len != 0 : len % 6 != 0)) {
            set_err(c->err, c->errlen, "malformed SETTINGS frame (%zu bytes, stream %u)", len, stream);
            return -1;
        }
        if (flags & FLAG_ACK)
            return 0;
        for (size_t i = 0; i < len; i += 6) {
            unsigned id = (unsigned)p[i] << 8 | p[i + 1];
            uint32_t v = be32(p + i + 2);
            if ((id == SETTINGS_ENABLE_PUSH && v > 1) || (id == SETTINGS_INITIAL_WINDOW_SIZE && v > 0x7fffffffu) ||
                (id == SETTINGS_MAX_FRAME_SIZE && (v < 16384u || v > 0xffffffu))) {
                set_err(c->err, c->errlen, "invalid SETTINGS value %u for setting %u", v, id);
                return -1;
            }
        }
        send_ack(c, FRAME_SETTINGS, NULL, 0);
        return 0;
    case FRAME_PING:
        if (stream != 0 || len != 8) {
            set_err(c->err, c->errlen, "malformed PING frame");
            return -1;
        }
        if (!(flags & FLAG_ACK))
            send_ack(c, FRAME_PING, p, len);
        return 0;
    case FRAME_GOAWAY: {
        if (stream != 0 || len < 8) {
            set_err(c->err, c->errlen, "malformed GOAWAY frame");
            return -1;
        }
        uint32_t last = be32(p) & 0x7fffffffu;
        uint32_t code = be32(p + 4);
        if (last >= STREAM_ID)
            return 0; /* our call was accepted: its answer still comes */
        c->lost = 1; /* the call's stream was not processed (RFC 9113, 6.8): it may be sent again */
        size_t dlen = len - 8 > 200 ? 200 : len - 8;
        char debug[201];
        decode_message((const char *)p + 8, dlen, debug, sizeof(debug));
        set_err(c->err, c->errlen, "the server refused the call (GOAWAY %s%s%s)", h2_error_name(code),
                debug[0] ? ": " : "", debug);
        return -1;
    }
    case FRAME_RST_STREAM:
        if (len != 4 || stream == 0) {
            set_err(c->err, c->errlen, "malformed RST_STREAM frame");
            return -1;
        }
        if (stream == STREAM_ID) {
            if (be32(p) == H2_REFUSED_STREAM)
                c->lost = 1; /* refused before any processing (RFC 9113, 8.7) */
            set_err(c->err, c->errlen, "the server reset the call (RST_STREAM %s)", h2_error_name(be32(p)));
            return -1;
        }
        return 0;
    case FRAME_WINDOW_UPDATE:
        if (len != 4) {
            set_err(c->err, c->errlen, "malformed WINDOW_UPDATE frame");
            return -1;
        }
        return 0;
    case FRAME_PRIORITY:
        if (len != 5 || stream == 0) {
            set_err(c->err, c->errlen, "malformed PRIORITY frame");
            return -1;
        }
        return 0;
    case FRAME_PUSH_PROMISE:
        set_err(c->err, c->errlen, "PUSH_PROMISE although push is disabled");
        return -1;
    case FRAME_HEADERS:
    case FRAME_CONTINUATION:
        if (stream != STREAM_ID) {
            set_err(c->err, c->errlen, "header frame on stream %u, not the call's stream", stream);
            return -1;
        }
        if (type == FRAME_CONTINUATION && !st->in_block) {
            set_err(c->err, c->errlen, "CONTINUATION frame outside a header block");
            return -1;
        }
        if (type == FRAME_HEADERS) {
            if (st->stage == FINISHED) {
                set_err(c->err, c->errlen, "headers after the end of the call");
                return -1;
            }
            if (unpad(st, flags, 1, &p, &len) != 0)
                return -1;
            st->in_block = 1;
            st->block_end_stream = (flags & FLAG_END_STREAM) != 0;
        }
        if (gc_buf_put(&st->block, p, len) != 0) {
            set_err(c->err, c->errlen, "response header block longer than %u bytes", MAX_HEADER_BLOCK);
            return -1;
        }
        return (flags & FLAG_END_HEADERS) ? finish_block(st) : 0;
    case FRAME_DATA:
        if (stream != STREAM_ID || st->stage != AWAIT_TRAILERS) {
            set_err(c->err, c->errlen, "DATA frame on stream %u before the response headers", stream);
            return -1;
        }
        if (unpad(st, flags, 0, &p, &len) != 0)
            return -1;
        if (gc_buf_put(&st->message, p, len) != 0) {
            set_err(c->err, c->errlen, "response message longer than %d bytes", GC_GRPC_MAX_MESSAGE);
            return -1;
        }
        if (flags & FLAG_END_STREAM) {
            set_err(c->err, c->errlen, "the response ended without trailers (no grpc-status)");
            return -1;
        }
        return 0;
    default:
        return 0; /* unknown frame types are ignored (RFC 9113, 4.1) */
    }
}

/* One gRPC message with no compression, exactly filling the DATA received. */
static int check_message(struct call_state *st)
{
    struct gc_buf *m = &st->message;
    if (m->len == 0) {
        set_err(st->conn->err, st->conn->errlen, "status OK but no response message");
        return -1;
    }
    if (m->len < 5 || m->data[0] > 1 || be32(m->data + 1) != m->len - 5) {
        set_err(st->conn->err, st->conn->errlen, "malformed response message framing (%zu bytes)", m->len);
        return -1;
    }
    if (m->data[0] == 1) {
        set_err(st->conn->err, st->conn->errlen, "compressed response although none was accepted");
        return -1;
    }
    st->reply->message_len = m->len - 5;
    return 0;
}

int gc_grpc_unary(int fd, const struct gc_call *call, int64_t deadline_ms, struct gc_reply *reply, char *err,
                  size_t errlen)
{
    struct conn c = {.fd = fd, .deadline = deadline_ms, .err = err, .errlen = errlen};
    struct call_state st = {.conn = &c, .reply = reply, .stage = AWAIT_HEADERS};
    reply->lost = 0;
    reply->http_status = -1;
    reply->grpc_status = -1;
    reply->grpc_message[0] = '\0';
    reply->message_len = 0;
    gc_hpack_decoder_init(&st.hpack);
    gc_buf_init(&st.block, MAX_HEADER_BLOCK);
    gc_buf_init(&st.message, GC_GRPC_MAX_MESSAGE + 5);
    uint8_t *payload = malloc(MAX_FRAME);
    struct gc_buf request;
    gc_buf_init(&request, 2 * MAX_FRAME + 64);
    int rc = -1;
    if (payload == NULL || build_request(call, &request) != 0) {
        set_err(err, errlen, "cannot build the request (too long?)");
        goto out;
    }
    if (write_all(&c, request.data, request.len) != 0)
        goto out;
    while (st.stage != FINISHED) {
        uint8_t h[FRAME_HEADER];
        if (read_all(&c, h, sizeof(h)) != 0)
            goto out;
        size_t len = (size_t)h[0] << 16 | (size_t)h[1] << 8 | h[2];
        uint32_t stream = be32(h + 5) & 0x7fffffffu;
        if (len > MAX_FRAME) {
            set_err(err, errlen, "frame of %zu bytes, larger than the %u announced", len, MAX_FRAME);
            goto out;
        }
        if (read_all(&c, payload, len) != 0 || on_frame(&st, h[3], h[4], stream, payload, len) != 0)
            goto out;
    }
    if (reply->grpc_status < 0) {
        set_err(err, errlen, "the response carries no grpc-status");
        goto out;
    }
    if (reply->grpc_status == 0 && check_message(&st) != 0)
        goto out;
    /* Done with the connection: say so (best effort), as clients do before closing. */
    static const uint8_t goaway[8] = {0};
    char ignored[8];
    struct conn quiet = {.fd = fd, .deadline = gc_now_ms() + 100, .err = ignored, .errlen = sizeof(ignored)};
    send_frame(&quiet, FRAME_GOAWAY, 0, 0, goaway, sizeof(goaway));
    rc = 0;
out:
    if (rc != 0)
        reply->lost = c.lost;
    free(payload);
    gc_buf_free(&request);
    gc_buf_free(&st.block);
    gc_buf_free(&st.message);
    gc_hpack_decoder_free(&st.hpack);
    return rc;
}
