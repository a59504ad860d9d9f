/*
 * The kernels' thread pool (pool.h says what it promises and why it is not an OpenMP team).
 *
 * One job at a time. Its descriptor (task, ctx, nchunks, team) is written by the caller, under the
 * pool lock, before the job's generation is published; `claim` packs (generation << 32 | next
 * chunk), so a worker still holding the descriptor of an older job cannot take a chunk of a newer
 * one: its compare-and-swap names the old generation and fails. `done` counts finished chunks and
 * is what the caller waits on. Workers and callers spin a bounded time, then sleep on futexes.
 *
 * A pool_run_out job (pool.h) also has a number, `seq`, and a state per chunk, stamped with that
 * number (seq << 2 | CHUNK_*), so that a stale worker's compare-and-swap on a chunk's state can
 * never succeed for a later job. A worker publishes the number of the job it is inside (in_seq)
 * before it looks for a chunk; a caller frees the job's block only when no worker is inside, and
 * otherwise parks it (retired) until none is.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__linux__)
#  include <linux/futex.h>
#  include <sys/syscall.h>
#endif

#define POOL_DEFAULT_SPIN_US 200
/* Spin with the pause hint this long before yielding the core between checks: a job usually
 * follows within a few microseconds inside a step, and a yield is a system call. */
#define POOL_PURE_SPIN_US 20
/* A caller that finished its own chunks waits at most this long spinning for a worker's: longer
 * means that worker lost its core, and sleeping lets the scheduler give it ours. */
#define POOL_CALLER_SPIN_US 50
/* Blocks of finished pool_run_out jobs that a stalled worker may still read. */
#define POOL_RETIRED_MAX 64

enum { CHUNK_TAKEN_BACK = 1, CHUNK_COPYING = 2, CHUNK_DONE = 3 };

static struct {
    pthread_mutex_t lock;        /* held by the caller of the running job */
    int nworkers;                /* workers started (ids 1 .. nworkers) */
    uint32_t start_gen[POOL_MAX_THREADS];
    /* the job; written before `gen` is published, read with relaxed atomics */
    pool_task task;
    void *ctx;
    int64_t nchunks;
    int team;
    uint64_t claim;              /* generation << 32 | next chunk index */
    uint32_t gen;                /* futex: the latest job's generation */
    uint32_t done;               /* futex: chunks of the running job that finished */
    int caller_waiting;
    int sleepers;                /* workers asleep on gen */
    int hold;
    int spin_us;
    int stall_us;
    int late_us;                 /* test hook: kernel_pool_late_workers */
    int caller_cpu;              /* where the running job's caller runs (-1: unknown) */
    /* the running job when it is a pool_run_out one (seq 0: a pool_run job) */
    uint64_t seq;
    pool_out_task otask;
    pool_out_rect orect;
    float *oy;
    int64_t oM, oldy;
    uint64_t last_seq;           /* pool_run_out jobs numbered so far */
    uint64_t in_seq[POOL_MAX_THREADS];   /* the pool_run_out job each worker is inside, 0: none */
    struct { uint64_t seq; void *block; } retired[POOL_RETIRED_MAX];
    int nretired;
    int64_t stat[KERNEL_POOL_STATS];
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_us = POOL_DEFAULT_SPIN_US, .caller_cpu = -1};

static uint64_t chunk_state[POOL_OUT_MAX_CHUNKS];
static __thread uint64_t last_stale;   /* this caller's latest job left with a worker inside */
/* Progress inside long chunks (pool_beat): one counter a worker, each on its own cache line, written
 * only by its worker and read by the caller only when its wait runs out, so a beat is a plain store
 * to a line the worker owns (a shared counter beside the pool's hot words took an atomic add on the
 * line the caller spins on). The caller counts only the workers inside its job (in_seq). */
static struct { uint64_t n; } __attribute__((aligned(64))) beats[POOL_MAX_THREADS];
static __thread uint64_t *my_beats;   /* this worker's counter while it runs a pool_run_out job's chunks */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static inline void stat_add(int which, int64_t n)
{
    __atomic_fetch_add(&P.stat[which], n, __ATOMIC_RELAXED);
}

/* Sleep while *addr == expected (spurious returns are fine: callers re-check). */
static void wait_on(uint32_t *addr, uint32_t expected)
{
#if defined(__linux__)
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
#else
    (void)addr;
    (void)expected;
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
#endif
}

static void wake(uint32_t *addr, int n)
{
#if defined(__linux__)
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
#else
    (void)addr;
    (void)n;
#endif
}

static inline int current_cpu(void)
{
#if defined(__linux__)
    return sched_getcpu();
#else
    return -1;
#endif
}

/* True where this thread shares its core with the running job's caller, or cannot tell. Only then
 * does a spinning worker yield: yielding to another process's thread gives that thread the core
 * until the scheduler's next tick (milliseconds, the "busy loop" measurements in
 * docs/performance.md), while our caller is the one thread whose progress we wait for. */
static inline int on_callers_cpu(void)
{
    const int cpu = __atomic_load_n(&P.caller_cpu, __ATOMIC_RELAXED);
    return cpu < 0 || current_cpu() == cpu;
}

/* Spin until *addr != value or the spin budget is spent; returns the last value seen. */
static uint32_t spin_while_equal(const uint32_t *addr, uint32_t value, int budget_us)
{
    uint32_t v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    if (v != value || budget_us <= 0)
        return v;
    const int64_t t0 = now_us();
    for (;;) {
        for (int i = 0; i < 64; i++) {
            cpu_relax();
            if ((v = __atomic_load_n(addr, __ATOMIC_ACQUIRE)) != value)
                return v;
        }
        const int64_t spent = now_us() - t0;
        if (spent >= budget_us)
            return v;
        if (spent >= POOL_PURE_SPIN_US && on_callers_cpu())
            sched_yield();   /* the job's caller, if it shares this core, gets it */
    }
}

/* Take and run chunks of job `gen` until none is left; returns how many this thread ran. */
static int64_t run_chunks(uint32_t gen, int participant)
{
    const pool_task task = __atomic_load_n(&P.task, __ATOMIC_RELAXED);
    void *const ctx = __atomic_load_n(&P.ctx, __ATOMIC_RELAXED);
    const int64_t nchunks = __atomic_load_n(&P.nchunks, __ATOMIC_ACQUIRE);   /* after take_pool's close */
    int64_t ran = 0;
    uint64_t c = __atomic_load_n(&P.claim, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen || (int64_t)(uint32_t)c >= nchunks)
            return ran;
        if (!__atomic_compare_exchange_n(&P.claim, &c, c + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;   /* c now holds the current word */
        task(ctx, (int64_t)(uint32_t)c, participant);
        ran++;
        const uint32_t d = __atomic_add_fetch(&P.done, 1, __ATOMIC_SEQ_CST);
        if ((int64_t)d == nchunks && __atomic_load_n(&P.caller_waiting, __ATOMIC_SEQ_CST))
            wake(&P.done, 1);
        c = __atomic_load_n(&P.claim, __ATOMIC_ACQUIRE);
    }
}

/* A worker's private copy of a pool_run_out job's y (grown as jobs need, never shrunk). */
struct scratch {
    float *y;
    size_t floats;
    unsigned stalls;   /* test stalls taken (kernel_pool_stall_workers) */
};

static float *scratch_for(struct scratch *sc, int64_t floats)
{
    if ((size_t)floats > sc->floats) {
        float *p = realloc(sc->y, (size_t)floats * sizeof(float));
        if (p == NULL)
            return NULL;
        sc->y = p;
        sc->floats = (size_t)floats;
    }
    return sc->y;
}

/* Take and run chunks of pool_run_out job `gen`, each into the scratch copy of y, and copy a chunk's
 * rectangle into y only if its state still is what it was when taken (the caller did not take it
 * back). Returns how many chunks this worker copied in. */
static int64_t run_out_chunks(uint32_t gen, int id, struct scratch *sc)
{
    const uint64_t seq = __atomic_load_n(&P.seq, __ATOMIC_RELAXED);
    if (seq == 0)
        return 0;
    __atomic_store_n(&P.in_seq[id], seq, __ATOMIC_SEQ_CST);
    my_beats = &beats[id].n;
    /* Inside from here on: a caller that finishes the job after this store sees it and keeps the
     * block. One that finished before has taken every chunk, which the next load shows. */
    int64_t ran = 0;
    uint64_t c = __atomic_load_n(&P.claim, __ATOMIC_SEQ_CST);
    const int64_t nchunks = __atomic_load_n(&P.nchunks, __ATOMIC_ACQUIRE);   /* after take_pool's close */
    const pool_out_task task = __atomic_load_n(&P.otask, __ATOMIC_RELAXED);
    const pool_out_rect rect = __atomic_load_n(&P.orect, __ATOMIC_RELAXED);
    const void *const ctx = __atomic_load_n(&P.ctx, __ATOMIC_RELAXED);
    float *const y = __atomic_load_n(&P.oy, __ATOMIC_RELAXED);
    const int64_t M = __atomic_load_n(&P.oM, __ATOMIC_RELAXED), ldy = __atomic_load_n(&P.oldy, __ATOMIC_RELAXED);
    /* The descriptor just read is this job's whenever a chunk of it can still be claimed below. */
    for (;;) {
        if ((uint32_t)(c >> 32) != gen || (int64_t)(uint32_t)c >= nchunks)
            break;
        if (!__atomic_compare_exchange_n(&P.claim, &c, c + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        const int64_t k = (uint32_t)c;
        /* The test stall, alternately before the chunk's state is read (the worker then finds the
         * chunk taken back) and after (it computes the chunk late, from its call's operands, and
         * fails to copy it in). */
        const int stall = __atomic_load_n(&P.stall_us, __ATOMIC_RELAXED);
        const int inside = stall > 0 && (++sc->stalls & 1);
        if (stall > 0 && !inside)
            usleep((useconds_t)stall);
        uint64_t st = __atomic_load_n(&chunk_state[k], __ATOMIC_ACQUIRE);
        if (inside)
            usleep((useconds_t)stall);
        float *copy;
        /* A stamp older than this job: nobody has touched the chunk in it yet (a stalled worker may
         * read the state after the caller took the chunk back, or after later jobs stamped it).
         * Out of memory for the copy: leave the chunk; the caller takes it back. */
        if ((st >> 2) < seq && (copy = scratch_for(sc, M * ldy)) != NULL) {
            task(ctx, k, copy);
            if (__atomic_compare_exchange_n(&chunk_state[k], &st, seq << 2 | CHUNK_COPYING, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                int64_t m0, m1, n0, n1;
                rect(ctx, k, &m0, &m1, &n0, &n1);
                for (int64_t m = m0; m < m1; m++)
                    memcpy(y + m * ldy + n0, copy + m * ldy + n0, (size_t)(n1 - n0) * sizeof(float));
                __atomic_store_n(&chunk_state[k], seq << 2 | CHUNK_DONE, __ATOMIC_RELEASE);
                ran++;
                const uint32_t d = __atomic_add_fetch(&P.done, 1, __ATOMIC_SEQ_CST);
                if ((int64_t)d == nchunks && __atomic_load_n(&P.caller_waiting, __ATOMIC_SEQ_CST))
                    wake(&P.done, 1);
            }
        }
        c = __atomic_load_n(&P.claim, __ATOMIC_ACQUIRE);
    }
    my_beats = NULL;
    __atomic_store_n(&P.in_seq[id], 0, __ATOMIC_RELEASE);
    return ran;
}

static void *worker_main(void *arg)
{
    const int id = (int)(intptr_t)arg;
    uint32_t seen = __atomic_load_n(&P.start_gen[id], __ATOMIC_ACQUIRE);
    struct scratch sc = {NULL, 0, 0};
    for (;;) {
        uint32_t g = spin_while_equal(&P.gen, seen, __atomic_load_n(&P.spin_us, __ATOMIC_RELAXED));
        if (g == seen) {
            __atomic_add_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
            while ((g = __atomic_load_n(&P.gen, __ATOMIC_SEQ_CST)) == seen)
                wait_on(&P.gen, seen);
            __atomic_sub_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
            stat_add(KERNEL_POOL_WORKER_WAKEUPS, 1);
        }
        seen = g;
        const int late = __atomic_load_n(&P.late_us, __ATOMIC_RELAXED);
        if (late > 0)
            usleep((useconds_t)late);
        if (id >= __atomic_load_n(&P.team, __ATOMIC_RELAXED) || __atomic_load_n(&P.hold, __ATOMIC_ACQUIRE))
            continue;   /* not in this job's team (or held by a test) */
        const int64_t ran = __atomic_load_n(&P.seq, __ATOMIC_RELAXED) != 0 ? run_out_chunks(g, id, &sc)
                                                                            : run_chunks(g, id);
        if (ran)
            stat_add(KERNEL_POOL_WORKER_CHUNKS, ran);
    }
    return NULL;
}

static void after_fork_in_child(void)
{
    /* The workers did not survive the fork; the child starts new ones on its first job. */
    pthread_mutex_init(&P.lock, NULL);
    P.nworkers = 0;
    P.sleepers = 0;
    P.caller_waiting = 0;
    memset(P.in_seq, 0, sizeof P.in_seq);
    P.nretired = 0;   /* the parent's parked blocks stay allocated in the child: a few kilobytes */
}

static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;

static void install_fork_handler(void)
{
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

/* Workers 1 .. want, started as needed (the caller holds the lock); returns how many exist. */
static int ensure_workers(int want)
{
    if (want <= P.nworkers)
        return P.nworkers;
    pthread_once(&fork_handler_once, install_fork_handler);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);   /* signals stay with the Python threads */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (P.nworkers < want) {
        const int id = P.nworkers + 1;
        pthread_t t;
        __atomic_store_n(&P.start_gen[id], __atomic_load_n(&P.gen, __ATOMIC_RELAXED), __ATOMIC_RELEASE);
        if (pthread_create(&t, &attr, worker_main, (void *)(intptr_t)id) != 0)
            break;   /* out of threads: run with the ones there are */
        P.nworkers = id;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return P.nworkers;
}

static void run_inline(int family, int64_t nchunks, pool_task task, void *ctx)
{
    kernels_note_team(family, 1);
    for (int64_t c = 0; c < nchunks; c++)
        task(ctx, c, 0);
}

/* Take the pool for a job: the team, with the lock held and the workers started; 0 when the job
 * runs on the caller alone (one thread wanted, one chunk, or another Python thread's job running). */
static int take_pool(int family, int team, int64_t nchunks)
{
    if (team > POOL_MAX_THREADS)
        team = POOL_MAX_THREADS;
    if (team <= 1 || nchunks <= 1 || pthread_mutex_trylock(&P.lock) != 0)
        return 0;
    /* Close the last job's claim word before this job's descriptor is written. A worker that saw
     * the last job's generation may read this job's chunk count (published with release, read with
     * acquire, so it then sees the close): against the old word, exhausted at the old count, a
     * larger new count would let it take chunks under the old number and run them as this job's,
     * counted twice (a caller returning early, or never: a hang seen beside a busy loop). */
    __atomic_store_n(&P.claim, ((uint64_t)P.gen << 32) | UINT32_MAX, __ATOMIC_RELAXED);
    const int workers = ensure_workers(team - 1);
    if (team > workers + 1)
        team = workers + 1;
    if (team <= 1) {
        pthread_mutex_unlock(&P.lock);
        return 0;
    }
    kernels_note_team(family, team);
    return team;
}

/* Publish a job (a pool_run_out job's own fields written before) and wake sleeping workers. */
static uint32_t publish(pool_task task, void *ctx, int64_t nchunks, int team)
{
    const uint32_t gen = P.gen + 1;   /* only callers write it, under the lock */
    __atomic_store_n(&P.task, task, __ATOMIC_RELAXED);
    __atomic_store_n(&P.ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&P.nchunks, nchunks, __ATOMIC_RELEASE);
    __atomic_store_n(&P.team, team, __ATOMIC_RELAXED);
    __atomic_store_n(&P.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&P.caller_cpu, current_cpu(), __ATOMIC_RELAXED);
    const int late = __atomic_load_n(&P.late_us, __ATOMIC_RELAXED);
    if (late > 0)
        usleep((useconds_t)(2 * late));   /* test hook: the window a late worker meets this job in */
    __atomic_store_n(&P.claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&P.gen, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&P.sleepers, __ATOMIC_SEQ_CST) > 0)
        wake(&P.gen, INT_MAX);
    stat_add(KERNEL_POOL_JOBS, 1);
    return gen;
}

/* Sleep until a chunk finishes, unless all `nchunks` already have. */
static void sleep_on_done(int64_t nchunks)
{
    __atomic_store_n(&P.caller_waiting, 1, __ATOMIC_SEQ_CST);
    const uint32_t d = __atomic_load_n(&P.done, __ATOMIC_SEQ_CST);
    if ((int64_t)d != nchunks) {
        stat_add(KERNEL_POOL_CALLER_SLEEPS, 1);
        wait_on(&P.done, d);
    }
    __atomic_store_n(&P.caller_waiting, 0, __ATOMIC_SEQ_CST);
}

static int caller_budget_us(void)
{
    return P.spin_us < POOL_CALLER_SPIN_US ? P.spin_us : POOL_CALLER_SPIN_US;
}

void pool_run(int family, int team, int64_t nchunks, pool_task task, void *ctx)
{
    if (nchunks > INT32_MAX)
        nchunks = 0;   /* never asked of a kernel here; refuse rather than wrap the counter */
    team = take_pool(family, team, nchunks);
    if (team == 0) {
        run_inline(family, nchunks, task, ctx);
        return;
    }
    __atomic_store_n(&P.seq, 0, __ATOMIC_RELAXED);
    const uint32_t gen = publish(task, ctx, nchunks, team);
    stat_add(KERNEL_POOL_CALLER_CHUNKS, run_chunks(gen, 0));

    /* The chunks other threads took: spin while they make progress, sleep when none is made
     * within the budget (the worker holding one lost its core). */
    uint32_t d;
    while ((int64_t)(d = __atomic_load_n(&P.done, __ATOMIC_ACQUIRE)) != nchunks)
        if (spin_while_equal(&P.done, d, caller_budget_us()) == d)
            sleep_on_done(nchunks);
    pthread_mutex_unlock(&P.lock);
}

/* ---- pool_run_out ------------------------------------------------------------------------ */

/* True when no worker is inside job `seq` or an earlier one. */
static int released(uint64_t seq)
{
    for (int w = 1; w < POOL_MAX_THREADS; w++) {
        const uint64_t v = __atomic_load_n(&P.in_seq[w], __ATOMIC_SEQ_CST);
        if (v != 0 && v <= seq)
            return 0;
    }
    return 1;
}

/* Free the parked blocks no worker can read any more (the caller holds the lock). */
static void reclaim_retired(void)
{
    int kept = 0;
    for (int i = 0; i < P.nretired; i++) {
        if (released(P.retired[i].seq))
            free(P.retired[i].block);
        else
            P.retired[kept++] = P.retired[i];
    }
    P.nretired = kept;
}

static void retire(uint64_t seq, void *block)
{
    reclaim_retired();
    while (P.nretired == POOL_RETIRED_MAX) {   /* 64 jobs each with a stalled worker: wait for one */
        usleep(100);
        reclaim_retired();
    }
    P.retired[P.nretired].seq = seq;
    P.retired[P.nretired].block = block;
    P.nretired++;
}

/* The beats of the workers inside job `seq`: one finishing a chunk taken back from it in an earlier
 * job must not keep the caller from taking back this job's stalled chunks. */
static uint64_t beats_inside(uint64_t seq)
{
    uint64_t sum = 0;
    for (int w = 1; w < POOL_MAX_THREADS; w++)
        if (__atomic_load_n(&P.in_seq[w], __ATOMIC_ACQUIRE) == seq)
            sum += __atomic_load_n(&beats[w].n, __ATOMIC_RELAXED);
    return sum;
}

/* Compute every chunk of job `seq` a worker took but has not started copying in; returns how many. */
static int64_t take_back(uint64_t seq, int64_t nchunks, pool_out_task task, const void *ctx, float *y)
{
    int64_t taken = 0;
    for (int64_t k = 0; k < nchunks; k++) {
        uint64_t st = __atomic_load_n(&chunk_state[k], __ATOMIC_ACQUIRE);
        if ((st >> 2) == seq)
            continue;   /* done, or being copied in */
        if (!__atomic_compare_exchange_n(&chunk_state[k], &st, seq << 2 | CHUNK_TAKEN_BACK, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;   /* its worker got there first: it is copying it in */
        task(ctx, k, y);
        __atomic_store_n(&chunk_state[k], seq << 2 | CHUNK_DONE, __ATOMIC_RELEASE);
        __atomic_add_fetch(&P.done, 1, __ATOMIC_SEQ_CST);
        taken++;
    }
    return taken;
}

/* Tests (kernel_pool_stall_workers): let a worker take the job's first chunk, and stall on it,
 * before the caller starts, however busy the machine (at most a second). */
static void await_first_claim(uint32_t gen)
{
    const int64_t t0 = now_us();
    while (__atomic_load_n(&P.claim, __ATOMIC_ACQUIRE) == (uint64_t)gen << 32 && now_us() - t0 < 1000000)
        usleep(50);
}

struct out_adapter {
    pool_out_task task;
    const void *ctx;
    float *y;
};

static void out_adapter_chunk(void *ctx, int64_t chunk, int participant)
{
    (void)participant;
    const struct out_adapter *a = ctx;
    a->task(a->ctx, chunk, a->y);
}

void pool_run_out(int family, int team, int64_t nchunks, pool_out_task task, pool_out_rect rect, void *ctx,
                  float *y, int64_t M, int64_t ldy)
{
    if (nchunks > POOL_OUT_MAX_CHUNKS || M * ldy > POOL_OUT_MAX_FLOATS) {
        struct out_adapter a = {task, ctx, y};
        pool_run(family, team, nchunks, out_adapter_chunk, &a);
        free(ctx);
        return;
    }
    team = take_pool(family, team, nchunks);
    if (team == 0) {
        struct out_adapter a = {task, ctx, y};
        run_inline(family, nchunks, out_adapter_chunk, &a);
        free(ctx);
        return;
    }
    reclaim_retired();
    const uint64_t seq = ++P.last_seq;
    __atomic_store_n(&P.seq, seq, __ATOMIC_RELAXED);
    __atomic_store_n(&P.otask, task, __ATOMIC_RELAXED);
    __atomic_store_n(&P.orect, rect, __ATOMIC_RELAXED);
    __atomic_store_n(&P.oy, y, __ATOMIC_RELAXED);
    __atomic_store_n(&P.oM, M, __ATOMIC_RELAXED);
    __atomic_store_n(&P.oldy, ldy, __ATOMIC_RELAXED);
    const uint32_t gen = publish(NULL, ctx, nchunks, team);
    if (__atomic_load_n(&P.stall_us, __ATOMIC_RELAXED) > 0)
        await_first_claim(gen);

    /* The caller's own chunks, straight into y. */
    int64_t mine = 0;
    uint64_t c = __atomic_load_n(&P.claim, __ATOMIC_ACQUIRE);
    while ((uint32_t)(c >> 32) == gen && (int64_t)(uint32_t)c < nchunks) {
        if (!__atomic_compare_exchange_n(&P.claim, &c, c + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        const int64_t k = (uint32_t)c;
        task(ctx, k, y);
        __atomic_store_n(&chunk_state[k], seq << 2 | CHUNK_DONE, __ATOMIC_RELEASE);
        __atomic_add_fetch(&P.done, 1, __ATOMIC_SEQ_CST);
        mine++;
        c = __atomic_load_n(&P.claim, __ATOMIC_ACQUIRE);
    }
    stat_add(KERNEL_POOL_CALLER_CHUNKS, mine);

    /* The workers' chunks: while none finishes, nor beats, within the budget, take them back. */
    uint32_t d;
    uint64_t beat = beats_inside(seq);
    while ((int64_t)(d = __atomic_load_n(&P.done, __ATOMIC_ACQUIRE)) != nchunks) {
        if (spin_while_equal(&P.done, d, caller_budget_us()) != d)
            continue;
        const uint64_t b = beats_inside(seq);
        if (b != beat) {   /* a worker is running inside a long chunk */
            beat = b;
            cpu_relax();
            continue;
        }
        const int64_t taken = take_back(seq, nchunks, task, ctx, y);
        stat_add(KERNEL_POOL_TAKEN_BACK, taken);
        if (taken == 0)
            sleep_on_done(nchunks);   /* only chunks being copied in are left */
    }

    /* A worker still inside computes a result nobody copies, from the block: keep it till it leaves. */
    int inside = 0;
    for (int w = 1; w < POOL_MAX_THREADS; w++)
        inside |= __atomic_load_n(&P.in_seq[w], __ATOMIC_SEQ_CST) == seq;
    if (inside) {
        retire(seq, ctx);
        last_stale = seq;
    } else {
        free(ctx);
    }
    pthread_mutex_unlock(&P.lock);
}

void pool_beat(void)
{
    uint64_t *const b = my_beats;
    if (b != NULL)
        __atomic_store_n(b, *b + 1, __ATOMIC_RELAXED);
}

/* ---- the public face (kernels.h) ---------------------------------------------------------- */

int kernel_default_threads(void)
{
    const char *env = getenv("OMP_NUM_THREADS");
    if (env != NULL) {
        char *end;
        const long n = strtol(env, &end, 10);
        if (end != env && n >= 1)
            return n > POOL_MAX_THREADS ? POOL_MAX_THREADS : (int)n;
    }
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        const int n = CPU_COUNT(&set);
        if (n >= 1)
            return n > POOL_MAX_THREADS ? POOL_MAX_THREADS : n;
    }
#endif
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > POOL_MAX_THREADS ? POOL_MAX_THREADS : (int)n;
}

void kernel_pool_stats(int64_t *out)
{
    for (int i = 0; i < KERNEL_POOL_STATS; i++)
        out[i] = __atomic_load_n(&P.stat[i], __ATOMIC_RELAXED);
}

void kernel_pool_hold_workers(int hold)
{
    __atomic_store_n(&P.hold, hold != 0, __ATOMIC_RELEASE);
}

void kernel_pool_set_spin_us(int us)
{
    __atomic_store_n(&P.spin_us, us < 0 ? 0 : us, __ATOMIC_RELAXED);
}

void kernel_pool_stall_workers(int us)
{
    __atomic_store_n(&P.stall_us, us < 0 ? 0 : us, __ATOMIC_RELAXED);
}

void kernel_pool_late_workers(int us)
{
    __atomic_store_n(&P.late_us, us < 0 ? 0 : us, __ATOMIC_RELAXED);
}

uint64_t kernel_pool_last_stale(void)
{
    const uint64_t s = last_stale;
    last_stale = 0;
    return s;
}

int kernel_pool_released(uint64_t job)
{
    return released(job);
}
