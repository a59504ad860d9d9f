/*
 * The kernels' thread pool: how every parallel kernel spreads its work over threads.
 *
 * A kernel cuts its work into chunks (weight panels, attention units, kv heads) whose results do
 * not depend on which thread computes them, and calls pool_run. The calling thread and up to
 * team - 1 pool workers then take chunks one at a time from a shared counter until none is left.
 *
 * Why not an OpenMP team: a parallel region ends when every thread of the team has arrived at its
 * barrier, so when another process holds one core, each of the ~150 regions of a decode step waits
 * for the thread on that core to be scheduled again (a 2-thread decode took 3.2x its time with a
 * busy loop on one core, more than one thread alone). Here nobody waits for a thread to arrive:
 * a worker that is not running takes no chunks and the others do its share; the caller waits only
 * for chunks already taken. Idle workers spin a bounded time (200 microseconds by default, the gaps
 * between the kernels of one step; kernel_pool_set_spin_us), yielding the core to anything else
 * runnable after the first 20, then sleep on a futex until the next job.
 */
#ifndef APPLIANCE_POOL_H
#define APPLIANCE_POOL_H
#include <stdint.h>

#define POOL_MAX_THREADS 64   /* participants of one job, the caller included */

/* One chunk of a job: `participant` is 0 for the calling thread and 1 .. team-1 for the workers,
 * and is the same for every chunk one thread runs in a job (an index for per-thread scratch). */
typedef void (*pool_task)(void *ctx, int64_t chunk, int participant);

/* Run task(ctx, c, p) for every chunk c in [0, nchunks) on at most `team` threads (capped at
 * POOL_MAX_THREADS); returns when all have run. team <= 1 or nchunks <= 1 runs them in order on the
 * calling thread. A second job started while one is running (another Python thread) runs on its
 * calling thread alone. Records `family`'s team size (kernel_last_threads). */
void pool_run(int family, int team, int64_t nchunks, pool_task task, void *ctx);

/* The pool's public face (default team size, counters, the test hold) is in kernels.h. */

#endif
