"""Decode attention on the thread pool (kernels/attention_decode.h): a worker that holds a unit
without progress does not hold up the step. The caller scans the unit itself, the result keeps the
bits of one thread, and the late worker neither writes into a later call's output nor reads memory
its call's caller has let go.

pool_stall_workers makes every worker sleep after it takes a unit, as when it loses its core; the
caller lets one take the first unit before it starts, so these checks do not depend on the load.
"""
from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

from appliance.kernels import _kernels as K

from kernel_cases import make_case
from test_kernel_pool import _stalled
from test_kernels_attention_batch import BS, GROUP, HD, N_KV, _cache, _lists


def _one_sequence(kind, context, seed):
    """A decode call's arguments over `context` cached tokens (blocks of 32, 2 kv heads)."""
    case = make_case(np.random.default_rng(seed), 1, 2, 2, 128, 32, context)
    if kind == "f32":
        cache = (case.k_f32, None, case.v_f32, None)
    else:
        cache, _, _ = case.q8() if kind == "q8" else case.q4()
    return case, cache


def _decode(kind, case, cache, threads, out=None):
    kq, ks, vq, vs = cache
    args = (case.table, case.blockpos, case.count, case.qpos, case.scale)
    if kind == "f32":
        return K.attention_f32(case.q, kq, vq, *args, out=out, threads=threads)
    fn = K.attention_q8 if kind == "q8" else K.attention_q4
    return fn(case.q, kq, ks, vq, vs, *args, out=out, threads=threads)


@pytest.mark.parametrize("context", [1000, 3000], ids=["one-part", "parts"])
@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
def test_a_stalled_workers_units_are_scanned_again_with_the_same_bits(kind, context):
    """At 3000 tokens the list is scanned in three parts, merged by the caller afterwards."""
    case, cache = _one_sequence(kind, context, 30 + context)
    want = _decode(kind, case, cache, 1)
    results, taken = _stalled(lambda: _decode(kind, case, cache, 2), calls=6)
    assert taken > 0
    for got in results:
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# Decode-sized sequences of a batch: one row, a long list, per-head sparse lists, no block yet, a
# check of three drafted tokens.
DECODE_STEP = [(1, 37, None), (1, BS * 70 + 3, None), (2, BS * 40, 9), (1, 0, None), (4, 300, None)]


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_a_stalled_workers_units_of_a_batch_are_scanned_again_with_the_same_bits(kind):
    rng = np.random.default_rng(40)
    cache, _, _ = _cache(rng, kind, 90)
    (table, blockpos, count, qpos), seq_rows, seq_lists, _ = _lists(rng, 90, DECODE_STEP)
    q = rng.standard_normal((int(seq_rows[-1]), N_KV * GROUP, HD)).astype(np.float32)
    kq, ks, vq, vs = cache

    def run(threads):
        return K.attention_batch(kind, q, kq, ks, vq, vs, seq_rows, seq_lists, table, blockpos, count, qpos,
                                 0.125, threads=threads)

    want = run(1)
    results, taken = _stalled(lambda: run(2), calls=6)
    assert taken > 0
    for got in results:
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _unmapped_when_dropped(a):
    """A copy of `a` in its own anonymous mapping, unmapped as soon as the copy dies: a late read of
    it then faults instead of finding the old bytes in a heap block."""
    m = mmap.mmap(-1, max(a.nbytes, 1))
    copy = np.frombuffer(m, dtype=a.dtype, count=a.size).reshape(a.shape)
    copy[...] = a
    return copy


def test_a_stalled_unit_never_lands_after_the_call_returned_and_reads_only_live_memory():
    """Each call gets its queries, block lists and cache as copies that are unmapped when it
    returns: the late worker must read its own copies (queries, lists) and the cache the binding
    holds, and its result must not reach the output, which by then holds a later call's result."""
    case, cache = _one_sequence("q8", 3000, 50)
    rng = np.random.default_rng(51)
    queries = [rng.standard_normal(case.q.shape).astype(np.float32) for _ in range(4)]

    def call(q, out, copies):
        if not copies:
            return K.attention_q8(q, *cache, case.table, case.blockpos, case.count, case.qpos, case.scale,
                                  out=out, threads=2)
        args = [_unmapped_when_dropped(a) for a in (q, *cache, case.table, case.blockpos, case.count, case.qpos)]
        return K.attention_q8(*args, case.scale, out=out, threads=2)

    wants = [call(q, None, False) for q in queries]
    out = np.empty_like(case.q)
    before = K.pool_stats()["taken_back"]
    for _ in range(3):
        K.pool_stall_workers(30000)
        try:
            for q in queries[:-1]:    # each call returns with a worker asleep in it
                call(q, out, True)
        finally:
            K.pool_stall_workers(0)
        assert np.array_equal(out, wants[-2])
        call(queries[-1], out, False)   # runs without the sleeping worker
        assert np.array_equal(out, wants[-1])
        time.sleep(0.1)                 # every late worker has finished by now
        assert np.array_equal(out, wants[-1])
    assert K.pool_stats()["taken_back"] - before >= 3 * 3
    # A later call lets the held cache arrays go once no late worker is inside their job. Polled:
    # under emulation and a loaded machine a stalled worker can take longer than the sleep above.
    deadline = time.monotonic() + 10
    call(queries[0], None, False)
    while K._stale_operands and time.monotonic() < deadline:
        time.sleep(0.05)
        call(queries[0], None, False)
    assert not K._stale_operands
