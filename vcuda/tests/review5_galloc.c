/*
 * A stream capture ended by another thread while a stream-ordered allocation on the stream is on its way to the
 * driver.
 *
 * Usage: review5_galloc ROUNDS MIB END_MS
 *   cuInit, a context, a stream.  Each round: the stream begins a capture (relaxed mode), another thread ends it
 *   END_MS later, and meanwhile the main thread calls cuMemAllocAsync(MIB) on the stream (the interceptor's
 *   test-only VCUDA_TEST_CAPTURE_DELAY_US holds the call after its capture check); the captured graph, if any, is
 *   destroyed without being instantiated.  Prints {"rounds": N, "ok": allocations that succeeded} and then waits for a line on stdin (the test reads the GPU's
 *   memory meanwhile) before it exits.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: review5_galloc ROUNDS MIB END_MS\n");
        return 2;
    }
    open_driver();
    int rounds = atoi(argv[1]);
    size_t bytes = (size_t)atoi(argv[2]) * MIB;
    struct timed_capture cap = {.after_ms = (unsigned)atoi(argv[3]), .ctx = created_context()};
    check(FN(cuStreamCreate)(&cap.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    int ok = 0;
    for (int i = 0; i < rounds; i++) {
        begin_timed_capture(&cap);
        CUdeviceptr p = 0;
        CUresult rc = FN(cuMemAllocAsync)(&p, bytes, cap.stream);
        finish_timed_capture(&cap);
        ok += rc == CUDA_SUCCESS;
    }
    check(FN(cuStreamSynchronize)(cap.stream), "cuStreamSynchronize");
    printf("{\"rounds\": %d, \"ok\": %d}\n", rounds, ok);
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof(line), stdin) == NULL)
        return 0;
    return 0;
}
