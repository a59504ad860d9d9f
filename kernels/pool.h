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
 * for chunks already taken, and for decode-sized GEMMs not even for those (pool_run_out below).
 * Idle workers spin a bounded time (200 microseconds by default, the gaps between the kernels of one
 * step; kernel_pool_set_spin_us), then sleep on a futex until the next job. After the first 20 they
 * yield the core while spinning, but only where they share it with the job's caller: a yield to
 * another process's thread hands it the core until the scheduler's next tick.
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

/* A job whose chunks each write one rectangle of a float matrix y[M, ldy]: rows [m0, m1), columns
 * [n0, n1) (rect), all of it computed by task(ctx, chunk, y_or_copy), which must write exactly the
 * same bits into whichever matrix it is given. The caller computes its chunks straight into y; a
 * worker computes each of its chunks into its own copy of y and copies the rectangle in only if the
 * chunk is still its own. A caller with nothing left to do that sees no chunk finish for
 * POOL_CALLER_SPIN_US takes back every chunk a worker holds and computes it itself: the worker lost
 * its core (to another process: an OpenMP team, or pool_run, would wait for it to be scheduled
 * again, several milliseconds). Such a worker may still be inside the job after the call returns,
 * computing a result nobody will copy. Hence:
 *   - ctx is a block from malloc that the pool owns from the call on: it frees the block once no
 *     worker can read it (everything a chunk reads that the call's own operands do not hold, such
 *     as per-call sums, belongs in it);
 *   - the operands outside ctx (weights, activations) must stay alive until
 *     kernel_pool_released(job) for the job kernel_pool_last_stale() named (kernels.h), which the
 *     Python binding does by holding them.
 * Falls back to pool_run's waiting (through an adapter) for more than POOL_OUT_MAX_CHUNKS chunks or
 * a y larger than POOL_OUT_MAX_FLOATS. */
typedef void (*pool_out_task)(const void *ctx, int64_t chunk, float *y);
typedef void (*pool_out_rect)(const void *ctx, int64_t chunk, int64_t *m0, int64_t *m1, int64_t *n0, int64_t *n1);
/* The rectangle of a GEMM's chunk numbered panel-major: panel chunk / mchunks of `cols` output
 * columns (the last one cut at N), run of rows chunk % mchunks of `mrows` rows (the last cut at M). */
static inline void pool_panel_rect(int64_t chunk, int64_t mchunks, int64_t mrows, int64_t M, int64_t cols, int64_t N,
                                   int64_t *m0, int64_t *m1, int64_t *n0, int64_t *n1)
{
    const int64_t p = chunk / mchunks, mc = chunk % mchunks;
    *m0 = mc * mrows;
    *m1 = *m0 + mrows < M ? *m0 + mrows : M;
    *n0 = p * cols;
    *n1 = *n0 + cols < N ? *n0 + cols : N;
}
/* Called by a pool_run_out task inside a long chunk (an attention unit scans for milliseconds): a
 * sign of progress, so that the caller does not take back chunks from a worker that is running. A
 * caller takes chunks back only once neither a chunk has finished nor a beat come for the budget.
 * Counts only from a worker inside the running job (not from the caller, nor from a late worker). */
void pool_beat(void);
#define POOL_OUT_MAX_CHUNKS 4096
#define POOL_OUT_MAX_FLOATS (4 * 1024 * 1024)
void pool_run_out(int family, int team, int64_t nchunks, pool_out_task task, pool_out_rect rect, void *ctx,
                  float *y, int64_t M, int64_t ldy);

/* The pool's public face (default team size, counters, the test hold) is in kernels.h. */

#endif
