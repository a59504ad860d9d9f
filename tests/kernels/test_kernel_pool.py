"""The kernels' thread pool (kernels/pool.h): no kernel waits for a thread that does not come.

A worker whose core another process holds simply takes no work; the calling thread does its share.
pool_hold_workers makes every worker such a worker, so these checks do not depend on the machine's
load: under an OpenMP team the same calls would wait at the region's barrier for ever.
"""
from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import quant, reference

from kernel_cases import make_case


def _gemm_case(rng, m=3):
    w = rng.standard_normal((3072, 1024)).astype(np.float32)
    wq, wd = quant.quantize_q8_0(w)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, 1024)).astype(np.float32))
    return wq, wd, xq, xd


def _every_family(rng):
    """One call of each parallel family, big enough to run on 2 threads; returns its outputs."""
    wq, wd, xq, xd = _gemm_case(rng)
    case = make_case(rng, 1, 8, 2, 128, 32, 3000)
    (kq, ks, vq, vs), _, _ = case.q8()
    keys = kq.astype(np.float32) * ks[..., None]
    bk, bks = quant.quantize_bound_rows(keys.max(axis=2), keys.min(axis=2))
    return [
        K.gemm_q8(wq, wd, xq, xd, threads=2),
        K.attention_q8(case.q, kq, ks, vq, vs, case.table, case.blockpos, case.count, case.qpos, case.scale,
                       threads=2),
        K.attention_probe("q8", case.q, kq, ks, case.table, case.count, 32, case.scale, threads=2),
        K.attention_probe_bound("q8", case.q, kq, ks, bk, bks, case.table, case.count, 8, case.scale, threads=2),
    ]


def test_held_workers_leave_every_chunk_to_the_caller_and_change_no_bit():
    free = _every_family(np.random.default_rng(1))
    before = K.pool_stats()
    K.pool_hold_workers(True)
    try:
        held = _every_family(np.random.default_rng(1))
        during = K.pool_stats()
    finally:
        K.pool_hold_workers(False)
    assert K.last_threads() == {"gemm": 2, "attention": 2, "probe": 2, "probe_bound": 2}
    for a, b in zip(free, held):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert during["jobs"] - before["jobs"] == 4
    assert during["worker_chunks"] == before["worker_chunks"]
    assert during["caller_chunks"] - before["caller_chunks"] >= 4 * 2


def test_two_python_threads_run_kernels_at_once():
    """The pool runs one job at a time; a call that finds it busy runs on its own thread."""
    rng = np.random.default_rng(2)
    wq, wd, xq, xd = _gemm_case(rng, m=2)
    want = K.gemm_q8(wq, wd, xq, xd, threads=1)
    results, errors = [], []

    def work():
        try:
            for _ in range(20):
                results.append(K.gemm_q8(wq, wd, xq, xd, threads=2))
        except Exception as e:  # surfaced below: a thread's exception would be lost otherwise
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 60
    assert all(np.array_equal(r, want) for r in results)


def _gemm_in_child(conn):
    rng = np.random.default_rng(3)
    wq, wd, xq, xd = _gemm_case(rng)
    conn.send((K.gemm_q8(wq, wd, xq, xd, threads=2), K.last_threads()["gemm"]))
    conn.close()


def test_a_forked_child_runs_the_parallel_kernels():
    """The workers do not survive fork(); the child's first job starts its own."""
    _every_family(np.random.default_rng(4))          # the parent's workers exist
    rng = np.random.default_rng(3)
    wq, wd, xq, xd = _gemm_case(rng)
    want = K.gemm_q8(wq, wd, xq, xd, threads=1)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_gemm_in_child, args=(child,))
    p.start()
    assert parent.poll(120), "the forked child did not answer"
    got, team = parent.recv()
    p.join(30)
    assert p.exitcode == 0 and team == 2
    assert np.array_equal(got, want)


def test_spin_setting():
    for module in (K, reference):
        with pytest.raises(ValueError, match="spin must be >= 0"):
            module.pool_set_spin_us(-1)
    rng = np.random.default_rng(5)
    wq, wd, xq, xd = _gemm_case(rng)
    want = K.gemm_q8(wq, wd, xq, xd, threads=1)
    try:
        K.pool_set_spin_us(0)                        # idle workers sleep at once
        assert all(np.array_equal(K.gemm_q8(wq, wd, xq, xd, threads=2), want) for _ in range(5))
    finally:
        K.pool_set_spin_us(200)
    stats = reference.pool_stats()
    assert set(stats) == set(K.pool_stats()) and not any(stats.values())
    reference.pool_hold_workers(True)


def _decode_case(rng, m, q4=False, n=8192):
    w = rng.standard_normal((n, 1024)).astype(np.float32)
    wq, wd = quant.quantize_q4_0(w) if q4 else quant.quantize_q8_0(w)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, 1024)).astype(np.float32))
    return wq, wd, xq, xd


def _stalled(fn, calls=12, stall_us=20000):
    """fn() called `calls` times while every worker sleeps after taking a chunk of a decode-sized
    GEMM (as when it loses its core; the caller lets one take the first chunk before it starts),
    with a pause after each call for the stalled worker to come back; returns the results and how
    many chunks the callers took back."""
    before = K.pool_stats()["taken_back"]
    K.pool_stall_workers(stall_us)
    results = []
    try:
        for _ in range(calls):
            results.append(fn())
            time.sleep(1.5 * stall_us / 1e6)
    finally:
        K.pool_stall_workers(0)
    return results, K.pool_stats()["taken_back"] - before


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("layout", ["rows", "strips"])
@pytest.mark.parametrize("q4", [False, True], ids=["q8", "q4"])
def test_a_stalled_workers_chunks_are_computed_again_with_the_same_bits(layout, m, q4):
    """Decode-sized GEMMs do not wait for a worker that holds a chunk without progress: the caller
    computes the chunk itself, and the result has the bits of one thread (q4 on the row route also
    reads the per-call block sums the job's block carries)."""
    if layout == "strips" and not K.strips_fast():
        pytest.skip("no strips micro-kernel on this CPU")
    n = 8192 - 3 * m      # the last chunk's rectangle ends inside a strip (1 row) or a tile (3 rows)
    wq, wd, xq, xd = _decode_case(np.random.default_rng(10 + m), m, q4, n)
    if layout == "strips":
        ws = K.pack_strips(wq, wd, q4)
        run = lambda threads: K.gemm_strips(ws, n, 1024, q4, xq, xd, threads=threads)  # noqa: E731
    else:
        gemm = K.gemm_q4 if q4 else K.gemm_q8
        run = lambda threads: gemm(wq, wd, xq, xd, threads=threads)  # noqa: E731
    want = run(1)
    results, taken = _stalled(lambda: run(2))
    assert taken > 0
    for got in results:
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("m", [1, 3])
def test_a_stalled_worker_never_writes_after_the_call_returned(m):
    """The stalled worker finishes its chunk after the caller moved on: into its own copy, which it
    must not copy into an output that by then holds another call's result; and it must still find
    the operands of its call, whose arrays the caller has dropped, alive. Three rows run, on a CPU
    with VNNI, the row route's tile run, whose per-row operands the job's block carries."""
    rng = np.random.default_rng(20)
    wq, wd, _, _ = _decode_case(rng, 1)
    inputs = [quant.quantize_rows_q8(rng.standard_normal((m, 1024)).astype(np.float32)) for _ in range(4)]
    wants = [K.gemm_q8(wq, wd, xq, xd, threads=1) for xq, xd in inputs]
    out = np.empty((m, 8192), np.float32)
    before = K.pool_stats()["taken_back"]
    for _ in range(3):
        K.pool_stall_workers(30000)
        try:
            for xq, xd in inputs[:-1]:   # each call returns with a worker stalled in it
                K.gemm_q8(wq, wd, xq.copy(), xd.copy(), out=out, threads=2)   # the copies die at once
        finally:
            K.pool_stall_workers(0)
        assert np.array_equal(out, wants[-2])
        # The last call's worker is still asleep: the next call runs without it, and the stalled
        # chunk's result, computed when it wakes, must not land in this call's output.
        K.gemm_q8(wq, wd, *inputs[-1], out=out, threads=2)
        assert np.array_equal(out, wants[-1])
        time.sleep(0.1)                                   # every stalled worker has finished by now
        assert np.array_equal(out, wants[-1])
    assert K.pool_stats()["taken_back"] - before >= 3 * 3
    K.gemm_q8(wq, wd, *inputs[0], threads=2)          # the next call lets the held operands go
    assert not K._stale_operands


def test_a_late_worker_takes_no_chunk_under_the_last_jobs_number():
    """A worker that saw a job's number but looks for chunks only while the next job, with more
    chunks, is being published must take none. Against the last job's claim word, spent at the old
    count, the new count would let it take chunks under the old number and run them as the new
    job's, counted twice: the caller then returned before its output was complete, or waited for
    ever (seen beside a busy loop). Decode-sized and prefill-sized GEMMs alternate, so both kinds of
    job meet a late worker, each after a job with fewer chunks."""
    rng = np.random.default_rng(60)
    calls = [_decode_case(rng, 1, n=1024), _decode_case(rng, 1, n=8192), _gemm_case(rng, m=40)]
    wants = [K.gemm_q8(*args, threads=1) for args in calls]
    wrong = []

    def alternate():
        for _ in range(10):
            for args, want in zip(calls, wants):
                wrong.append(not np.array_equal(K.gemm_q8(*args, threads=2), want))

    K.pool_late_workers(2000)
    try:
        caller = threading.Thread(target=alternate, daemon=True)   # a hung caller must not hang the run
        caller.start()
        caller.join(timeout=60)
    finally:
        K.pool_late_workers(0)
    assert not caller.is_alive(), "a caller waits for ever for chunks counted twice"
    assert len(wrong) == 30 and not any(wrong)
