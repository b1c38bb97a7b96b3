/*
 * One unary gRPC call over an HTTP/2 connection (RFC 9113, prior knowledge, no
 * TLS): connection preface and SETTINGS, the request as HEADERS + one DATA
 * frame, then the response headers, message and trailers; SETTINGS, PING and
 * GOAWAY from the server are answered as the protocol asks. Every wait ends at
 * the caller's deadline.
 */
#ifndef GPU_CLIENT_GC_GRPC_H
#define GPU_CLIENT_GC_GRPC_H

#include <stddef.h>
#include <stdint.h>

/* The largest request or response message handled (the registration messages are tiny). */
#define GC_GRPC_MAX_MESSAGE 16384

struct gc_call {
    const char *path;       /* :path, "/package.Service/Method" */
    const char *authority;  /* :authority */
    const char *user_agent; /* user-agent */
    const uint8_t *message; /* the serialised request */
    size_t message_len;
    int64_t timeout_ms; /* sent as grpc-timeout */
};

struct gc_reply {
    int lost;               /* the connection ended, or the server refused the stream, before the answer:
                               the call did not complete and may be sent again (it is idempotent) */
    int http_status;        /* :status, -1 if none came */
    int grpc_status;        /* grpc-status, -1 if none came */
    char grpc_message[512]; /* grpc-message, percent-decoded (truncated) */
    size_t message_len;     /* length of the response message */
};

/* Milliseconds of CLOCK_MONOTONIC. */
int64_t gc_now_ms(void);

/*
 * Run the call on the connected, non-blocking stream socket fd. Returns 0 when
 * the call completed (reply->grpc_status says how; 0 only with exactly one
 * response message), or -1 on a transport or protocol failure or when the
 * deadline (gc_now_ms() clock) passes, err saying which.
 */
int gc_grpc_unary(int fd, const struct gc_call *call, int64_t deadline_ms, struct gc_reply *reply, char *err,
                  size_t errlen);

/* The name of a gRPC status code ("PERMISSION_DENIED"), or "UNKNOWN_CODE". */
const char *gc_grpc_code_name(int code);

#endif
