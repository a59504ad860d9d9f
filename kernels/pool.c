/*
 * The kernels' thread pool (pool.h says what it promises and why it is not an OpenMP team).
 *
 * One job at a time. Its descriptor (task, ctx, nchunks, team) is written by the caller, under the
 * pool lock, before the job's generation is published; `claim` packs (generation << 32 | next
 * chunk), so a worker still holding the descriptor of an older job cannot take a chunk of a newer
 * one: its compare-and-swap names the old generation and fails. `done` counts finished chunks and
 * is what the caller waits on. Workers and callers spin a bounded time, then sleep on futexes.
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
    int64_t stat[KERNEL_POOL_STATS];
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_us = POOL_DEFAULT_SPIN_US};

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
        if (spent >= POOL_PURE_SPIN_US)
            sched_yield();   /* something else runnable on this core gets it */
    }
}

/* Take and run chunks of job `gen` until none is left; returns how many this thread ran. */
static int64_t run_chunks(uint32_t gen, int participant)
{
    const pool_task task = __atomic_load_n(&P.task, __ATOMIC_RELAXED);
    void *const ctx = __atomic_load_n(&P.ctx, __ATOMIC_RELAXED);
    const int64_t nchunks = __atomic_load_n(&P.nchunks, __ATOMIC_RELAXED);
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

static void *worker_main(void *arg)
{
    const int id = (int)(intptr_t)arg;
    uint32_t seen = __atomic_load_n(&P.start_gen[id], __ATOMIC_ACQUIRE);
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
        if (id >= __atomic_load_n(&P.team, __ATOMIC_RELAXED) || __atomic_load_n(&P.hold, __ATOMIC_ACQUIRE))
            continue;   /* not in this job's team (or held by a test) */
        const int64_t ran = run_chunks(g, id);
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

void pool_run(int family, int team, int64_t nchunks, pool_task task, void *ctx)
{
    if (team > POOL_MAX_THREADS)
        team = POOL_MAX_THREADS;
    if (nchunks > INT32_MAX)
        nchunks = 0;   /* never asked of a kernel here; refuse rather than wrap the counter */
    if (team <= 1 || nchunks <= 1 || pthread_mutex_trylock(&P.lock) != 0) {
        run_inline(family, nchunks, task, ctx);
        return;
    }
    const int workers = ensure_workers(team - 1);
    if (team > workers + 1)
        team = workers + 1;
    if (team <= 1) {
        pthread_mutex_unlock(&P.lock);
        run_inline(family, nchunks, task, ctx);
        return;
    }
    kernels_note_team(family, team);

    const uint32_t gen = P.gen + 1;   /* only callers write it, under the lock */
    __atomic_store_n(&P.task, task, __ATOMIC_RELAXED);
    __atomic_store_n(&P.ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&P.nchunks, nchunks, __ATOMIC_RELAXED);
    __atomic_store_n(&P.team, team, __ATOMIC_RELAXED);
    __atomic_store_n(&P.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&P.claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&P.gen, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&P.sleepers, __ATOMIC_SEQ_CST) > 0)
        wake(&P.gen, INT_MAX);

    stat_add(KERNEL_POOL_JOBS, 1);
    stat_add(KERNEL_POOL_CALLER_CHUNKS, run_chunks(gen, 0));

    /* The chunks other threads took: spin while they make progress, sleep when none is made
     * within the budget (the worker holding one lost its core). */
    const int budget = P.spin_us < POOL_CALLER_SPIN_US ? P.spin_us : POOL_CALLER_SPIN_US;
    uint32_t d;
    while ((int64_t)(d = __atomic_load_n(&P.done, __ATOMIC_ACQUIRE)) != nchunks) {
        if (spin_while_equal(&P.done, d, budget) != d)
            continue;
        __atomic_store_n(&P.caller_waiting, 1, __ATOMIC_SEQ_CST);
        if ((int64_t)(d = __atomic_load_n(&P.done, __ATOMIC_SEQ_CST)) != nchunks) {
            stat_add(KERNEL_POOL_CALLER_SLEEPS, 1);
            wait_on(&P.done, d);
        }
        __atomic_store_n(&P.caller_waiting, 0, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_unlock(&P.lock);
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
