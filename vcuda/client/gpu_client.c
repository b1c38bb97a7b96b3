/*
 * gpu-client: registers a container with gpu-manager over the pod's vcuda.sock.
 *
 * The in-container vcuda-controller library (libcuda-control.so of tkestack)
 * runs, at its first CUDA call,
 *
 *   /usr/local/nvidia/bin/gpu-client --addr /etc/vcuda/vcuda.sock --bus-id "" \
 *       --pod-uid <uid> --cont-id <container id>      (or --cont-name <name>)
 *
 * and ends the process when this exits non-zero. We send
 * vcuda.VCUDAService/RegisterVDevice as a gRPC call over HTTP/2 on the unix
 * socket and exit 0 when the agent answers OK; otherwise one line on stderr
 * says what failed and the exit status is 1 (2 for a bad command line). A call
 * the agent did not complete (it restarted meanwhile) is sent again until the
 * deadline.
 *
 * A static executable with no dependency on the container's libc. Flags are
 * read as Go's flag package reads them: -name or --name, value as the next
 * argument or after '='.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "gc_buf.h"
#include "gc_grpc.h"

#define GPU_CLIENT_VERSION "1.0"
#define METHOD "/vcuda.VCUDAService/RegisterVDevice"
#define DEFAULT_TIMEOUT_S 30.0
#define MAX_FIELD 4096 /* longest flag value sent (a pod UID is 36 bytes, a container ID 64) */
#define GRPC_UNAVAILABLE 14

enum { EXIT_OK = 0, EXIT_FAILED = 1, EXIT_USAGE = 2 };

struct options {
    const char *addr;
    const char *bus_id;
    const char *pod_uid;
    const char *cont_name;
    const char *cont_id;
    double timeout_s;
};

static void usage(FILE *out)
{
    fprintf(out,
            "usage: gpu-client --addr SOCKET --pod-uid UID (--cont-id ID | --cont-name NAME) [--bus-id ID]\n"
            "                  [--timeout SECONDS]\n"
            "Registers a container with gpu-manager: vcuda.VCUDAService/RegisterVDevice on the unix socket\n"
            "SOCKET (in a container: /etc/vcuda/vcuda.sock). Exits 0 when the agent accepts it, 1 when it\n"
            "refuses or cannot be reached within --timeout (default %g s; the socket is retried meanwhile),\n"
            "2 for a bad command line.\n",
            DEFAULT_TIMEOUT_S);
}

static int fail_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int fail_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("gpu-client: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    usage(stderr);
    return EXIT_USAGE;
}

/* Parse argv into opts; returns -1 to continue, or the exit status to end with. */
static int parse_args(int argc, char **argv, struct options *opts)
{
    static const char *const names[] = {"addr", "bus-id", "pod-uid", "cont-name", "cont-id", "timeout"};
    const char **slots[] = {&opts->addr, &opts->bus_id, &opts->pod_uid, &opts->cont_name, &opts->cont_id, NULL};
    const char *timeout = NULL;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (arg[0] != '-' || arg[1] == '\0')
            return fail_usage("unexpected argument %s", arg);
        const char *name = arg + (arg[1] == '-' ? 2 : 1);
        if (strcmp(name, "h") == 0 || strcmp(name, "help") == 0) {
            usage(stdout);
            return EXIT_OK;
        }
        const char *eq = strchr(name, '=');
        size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
        size_t which = sizeof(names) / sizeof(names[0]);
        for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
            if (strlen(names[k]) == name_len && strncmp(names[k], name, name_len) == 0)
                which = k;
        if (which == sizeof(names) / sizeof(names[0]))
            return fail_usage("unknown flag %.*s", (int)(name_len + (size_t)(name - arg)), arg);
        const char *value;
        if (eq) {
            value = eq + 1;
        } else if (i + 1 < argc) {
            value = argv[++i];
        } else {
            return fail_usage("flag --%s needs a value", names[which]);
        }
        if (strlen(value) > MAX_FIELD)
            return fail_usage("--%s is longer than %d bytes", names[which], MAX_FIELD);
        if (slots[which])
            *slots[which] = value;
        else
            timeout = value;
    }
    opts->timeout_s = DEFAULT_TIMEOUT_S;
    if (timeout) {
        char *end;
        errno = 0;
        opts->timeout_s = strtod(timeout, &end);
        if (errno || end == timeout || *end || !(opts->timeout_s > 0) || opts->timeout_s > 86400)
            return fail_usage("--timeout=%s is not a number of seconds between 0 and 86400", timeout);
    }
    if (!opts->addr || !opts->addr[0])
        return fail_usage("--addr is required");
    if (!opts->pod_uid || !opts->pod_uid[0])
        return fail_usage("--pod-uid is required");
    if ((!opts->cont_id || !opts->cont_id[0]) && (!opts->cont_name || !opts->cont_name[0]))
        return fail_usage("one of --cont-id and --cont-name is required");
    if (opts->cont_id && opts->cont_id[0])
        opts->cont_name = NULL; /* as upstream: the container ID wins */
    return -1;
}

/* ---- the request message (vcuda.VDeviceRequest, proto3) ------------------------------------ */

static int put_field(struct gc_buf *b, unsigned number, const char *value)
{
    if (value == NULL || value[0] == '\0')
        return 0; /* proto3: empty strings are not written */
    size_t n = strlen(value);
    int rc = gc_buf_put_byte(b, (uint8_t)(number << 3 | 2)); /* tag: length-delimited */
    size_t v = n;
    for (; v >= 0x80; v >>= 7)
        rc |= gc_buf_put_byte(b, (uint8_t)(0x80 | (v & 0x7f))); /* varint length */
    rc |= gc_buf_put_byte(b, (uint8_t)v);
    return rc | gc_buf_put(b, value, n);
}

static int encode_request(const struct options *o, struct gc_buf *b)
{
    return put_field(b, 1, o->bus_id) | put_field(b, 2, o->pod_uid) | put_field(b, 3, o->cont_name) |
           put_field(b, 4, o->cont_id);
}

/* ---- connecting -------------------------------------------------------------------------- */

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/*
 * Connect to the unix socket, retrying while it is missing, refuses or has a
 * full accept queue (the agent restarting or busy) until the deadline.
 * Returns a non-blocking fd or -1.
 */
static int connect_unix(const char *path, int64_t deadline, char *err, size_t errlen)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, errlen, "socket path is longer than %zu bytes", sizeof(sa.sun_path) - 1);
        return -1;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int64_t pause = 20;
    for (;;) {
        /*
         * Non-blocking from the start: a blocking connect() to a listener whose accept queue is
         * full (the agent not accepting) waits with no bound; non-blocking it fails with EAGAIN,
         * retried below until the deadline.
         */
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            snprintf(err, errlen, "socket: %s", strerror(errno));
            return -1;
        }
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            return fd;
        int e = errno;
        close(fd);
        struct stat st;
        if (e == ECONNREFUSED && stat(path, &st) == 0 && !S_ISSOCK(st.st_mode)) {
            /* connect() refuses a file that is no socket; the agent replaces only stale sockets */
            snprintf(err, errlen, "cannot connect: %.200s is not a socket", path);
            return -1;
        }
        if (e != ENOENT && e != ECONNREFUSED && e != EAGAIN && e != EINTR) {
            snprintf(err, errlen, "cannot connect: %s", strerror(e));
            return -1;
        }
        int64_t left = deadline - gc_now_ms();
        if (left <= 0) {
            snprintf(err, errlen, "cannot connect: %s (retried until the deadline)", strerror(e));
            return -1;
        }
        sleep_ms(pause < left ? pause : left);
        pause = pause * 2 > 500 ? 500 : pause * 2;
    }
}

static const char *socket_path(const char *addr)
{
    if (strncmp(addr, "unix://", 7) == 0)
        return addr + 7;
    if (strncmp(addr, "unix:", 5) == 0)
        return addr + 5;
    return addr;
}

/*
 * The failure line. When the deadline ended the call, it names the timeout, and the reason of the
 * last attempt that was retried (the one at the deadline often only ran out of time).
 */
static void report_failure(const char *who, const char *err, const char *earlier, int64_t deadline,
                           double timeout_s)
{
    if (gc_now_ms() < deadline) {
        fprintf(stderr, "gpu-client: %s failed: %s\n", who, err);
        return;
    }
    fprintf(stderr, "gpu-client: %s failed within the %g s timeout (--timeout): %s%s%s\n", who, timeout_s, err,
            earlier[0] ? "; an earlier attempt: " : "", earlier);
}

int main(int argc, char **argv)
{
    struct options opts = {0};
    int status = parse_args(argc, argv, &opts);
    if (status >= 0)
        return status;
    char who[360];
    snprintf(who, sizeof(who), "RegisterVDevice(pod %.40s, container %s %.80s) on %.150s", opts.pod_uid,
             opts.cont_id ? "id" : "name", opts.cont_id ? opts.cont_id : opts.cont_name, opts.addr);

    struct gc_buf message;
    gc_buf_init(&message, GC_GRPC_MAX_MESSAGE);
    if (encode_request(&opts, &message) != 0) {
        fprintf(stderr, "gpu-client: %s: the request is too long\n", who);
        return EXIT_FAILED;
    }
    int64_t timeout_ms = (int64_t)(opts.timeout_s * 1000.0);
    int64_t deadline = gc_now_ms() + (timeout_ms > 0 ? timeout_ms : 1);
    char err[512] = "";
    char earlier[512] = ""; /* why the last retried attempt failed */
    struct gc_reply reply;
    int rc = -1;
    /*
     * The registration is idempotent: a call the agent did not complete (it restarted under
     * the call, or refused the stream unprocessed, or answered UNAVAILABLE) is sent again on a
     * new connection until the deadline.
     */
    for (int64_t pause = 50;; pause = pause * 2 > 1000 ? 1000 : pause * 2) {
        int fd = connect_unix(socket_path(opts.addr), deadline, err, sizeof(err));
        if (fd < 0) {
            report_failure(who, err, earlier, deadline, opts.timeout_s);
            gc_buf_free(&message);
            return EXIT_FAILED;
        }
        struct gc_call call = {
            .path = METHOD,
            .authority = "localhost",
            .user_agent = "gpu-client/" GPU_CLIENT_VERSION,
            .message = message.data,
            .message_len = message.len,
            .timeout_ms = deadline - gc_now_ms(),
        };
        rc = gc_grpc_unary(fd, &call, deadline, &reply, err, sizeof(err));
        close(fd);
        int again = rc != 0 ? reply.lost : reply.grpc_status == GRPC_UNAVAILABLE;
        if (!again || gc_now_ms() + pause >= deadline)
            break;
        /* Why this attempt failed: the next one may only run into the deadline. */
        if (rc != 0)
            snprintf(earlier, sizeof(earlier), "%s", err);
        else
            snprintf(earlier, sizeof(earlier), "the agent answered UNAVAILABLE: %.400s",
                     reply.grpc_message[0] ? reply.grpc_message : "(no message)");
        sleep_ms(pause);
    }
    gc_buf_free(&message);
    if (rc != 0) {
        report_failure(who, err, earlier, deadline, opts.timeout_s);
        return EXIT_FAILED;
    }
    if (reply.grpc_status != 0) {
        fprintf(stderr, "gpu-client: %s refused: %s (%d): %s\n", who, gc_grpc_code_name(reply.grpc_status),
                reply.grpc_status, reply.grpc_message[0] ? reply.grpc_message : "(no message)");
        return EXIT_FAILED;
    }
    return EXIT_OK;
}
