/*
 * A stream capture ended by another thread while a launch on the stream is on its way to the driver.
 *
 * Usage: review5_capture ROUNDS END_MS
 *   cuInit, a context, a stream, a module with kernel spin_2ms.  Each round: the stream begins a capture (relaxed
 *   mode), another thread ends it END_MS later, and meanwhile the main thread launches spin_2ms on the stream (the
 *   interceptor's test-only VCUDA_TEST_CAPTURE_DELAY_US holds the launch after its capture check); then the stream
 *   is synchronised.  The launch reaches the driver after the capture ended (END_MS well below the delay): it runs.
 *   Prints {"rounds": N, "ok": launches that succeeded}.
 * Loads libcuda.so.1 by name (LD_LIBRARY_PATH: the container's driver mirror).
 */
#include "review_driver.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char PTX[] = ".version 7.0\n.target sm_75\n.address_size 64\n.visible .entry spin_2ms() { ret; }\n";
int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: review5_capture ROUNDS END_MS\n");
        return 2;
    }
    open_driver();
    int rounds = atoi(argv[1]);
    struct timed_capture cap = {.after_ms = (unsigned)atoi(argv[2]), .ctx = created_context()};
    CUfunction fn = load_kernel(PTX, "spin_2ms");
    check(FN(cuStreamCreate)(&cap.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    int ok = 0;
    for (int i = 0; i < rounds; i++) {
        begin_timed_capture(&cap);
        CUresult rc = FN(cuLaunchKernel)(fn, 1, 1, 1, 32, 1, 1, 0, cap.stream, NULL, NULL);
        finish_timed_capture(&cap);
        ok += rc == CUDA_SUCCESS;
        check(FN(cuStreamSynchronize)(cap.stream), "cuStreamSynchronize");
    }
    printf("{\"rounds\": %d, \"ok\": %d}\n", rounds, ok);
    return 0;
}
