"""The probe, importance, block choice and KV write kernels of block-sparse attention against numpy."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.kernels import _kernels
from appliance.kernels import quant
from appliance.kernels import reference
from appliance.kernels.dispatch import kernels

PROBE_RTOL = 1e-5       # same int8 dots, float sums in another order
IMPORTANCE_ATOL = 1e-5


def make_cache(kind, rng, n_blocks=6, n_kv=2, bs=32, hd=64):
    kf = rng.standard_normal((n_blocks, n_kv, bs, hd)).astype(np.float32)
    if kind == "q8":
        kq, ks = quant.quantize_kv_q8(kf)
        deq = kq.astype(np.float32) * ks[..., None]
    elif kind == "q4":
        kq, ks = quant.quantize_kv_q4(kf)
        vals = quant.unpack_q4(kq).astype(np.float32).reshape(n_blocks, n_kv, bs, hd // 32, 32)
        deq = (vals * ks[..., None]).reshape(kf.shape)
    else:
        kq, ks, deq = kf, None, kf
    return kq, ks, deq


def quantized_q(q, kind):
    return q if kind == "f32" else quant.requantize_rows_q8(q)


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
@pytest.mark.parametrize("probe", [1, 8, 32])
@pytest.mark.parametrize("path", ["simd", "portable"])
def test_probe_matches_numpy(kind, probe, path):
    rng = np.random.default_rng(0)
    kq, ks, deq = make_cache(kind, rng)
    group, n_kv, hd = 2, 2, 64
    q = rng.standard_normal((2, n_kv * group, hd)).astype(np.float32)
    table = np.array([3, 0, 5, 1], np.int32)
    count = np.array([32, 32, 32, 13], np.int32)
    got = _kernels.attention_probe(kind, q, kq, ks, table, count, probe, 0.125, path=path)
    qd = quantized_q(q, kind)
    want = np.empty((n_kv, len(table)), np.float32)
    for h in range(n_kv):
        for i, (b, c) in enumerate(zip(table, count)):
            step = max(1, c // probe)
            rows = deq[b, h, 0:c:step]                                 # sampled rows
            s = qd[:, h * group:(h + 1) * group] @ rows.T              # [R, group, samples]
            want[h, i] = s.max() * 0.125
    np.testing.assert_allclose(got, want, rtol=PROBE_RTOL, atol=1e-5)


def _attention_with_importance(kind, q, kq, ks, table, blockpos, count, qpos, n_positions, path="simd",
                               threads=0):
    """Attention with V = K (the importance does not depend on V) through kernels.attention_*."""
    acc = np.zeros(n_positions, np.float32)
    if kind == "f32":
        out = kernels.attention_f32(q, kq, kq, table, blockpos, count, qpos, 0.125, path=path,
                                    threads=threads, importance=acc)
    else:
        fn = kernels.attention_q8 if kind == "q8" else kernels.attention_q4
        out = fn(q, kq, ks, kq, ks, table, blockpos, count, qpos, 0.125, path=path, threads=threads,
                 importance=acc)
    return out, acc


def _numpy_importance(kind, q, deq, table, blockpos, count, qpos, n_positions):
    """The numpy twin's importance (float64 sums) for the query as the kernels quantize it."""
    want = np.zeros(n_positions, np.float64)
    reference.attention_f32(quantized_q(q, kind), deq, deq, table, blockpos, count, qpos, 0.125,
                            importance=want)
    return want


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
@pytest.mark.parametrize("path", ["simd", "portable"])
def test_attention_importance_matches_numpy(kind, path):
    """Prefill importance comes out of the attention pass itself (kernels.h attention_importance_*):
    per-head block lists, a partial last block, queries that see only part of a block, a tile of
    queries that is not full (T = 6 with tiles of 4), and positions past n_positions dropped."""
    rng = np.random.default_rng(1)
    kq, ks, deq = make_cache(kind, rng)
    group, n_kv, hd, bs = 2, 2, 64, 32
    q = rng.standard_normal((6, n_kv * group, hd)).astype(np.float32)
    table = np.array([[2, 4, 1], [0, 4, 3]], np.int32)          # per-head lists
    blockpos = np.array([[0, 1, 3], [0, 2, 3]], np.int32)
    count = np.array([[bs, bs, 20], [bs, bs, 20]], np.int32)
    qpos = np.array([100, 105, 110, 111, 115, 127], np.int32)
    out, got = _attention_with_importance(kind, q, kq, ks, table, blockpos, count, qpos, 112, path)
    want = _numpy_importance(kind, q, deq, table, blockpos, count, qpos, 112)
    np.testing.assert_allclose(got, want, atol=IMPORTANCE_ATOL)
    # The output is that of plain attention: importance rides along, it changes nothing.
    plain = _attention_with_importance(kind, q, kq, ks, table, blockpos, count, qpos, 112, path)[0]
    fn = {"q8": kernels.attention_q8, "q4": kernels.attention_q4}.get(kind)
    ref = (kernels.attention_f32(q, kq, kq, table, blockpos, count, qpos, 0.125, path=path) if fn is None
           else fn(q, kq, ks, kq, ks, table, blockpos, count, qpos, 0.125, path=path))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(plain, ref)


def test_attention_importance_is_the_same_whatever_the_threads():
    """Sparse block choice must be bit for bit reproducible, so the importance sums may not depend
    on which thread ran which unit."""
    rng = np.random.default_rng(3)
    kq, ks, _ = make_cache("q8", rng, n_blocks=12, n_kv=2)
    q = rng.standard_normal((32, 4, 64)).astype(np.float32)
    table = np.arange(12, dtype=np.int32)
    blockpos = np.arange(12, dtype=np.int32)
    count = np.full(12, 32, np.int32)
    qpos = np.arange(352, 384, dtype=np.int32)
    runs = [_attention_with_importance("q8", q, kq, ks, table, blockpos, count, qpos, 384, threads=t)[1]
            for t in (1, 2, 3, 2)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])
    # Each query head hands out a total weight of 1.
    np.testing.assert_allclose(runs[0].sum(), 32 * 4, rtol=1e-5)


def test_reference_attention_records_the_same_importance():
    rng = np.random.default_rng(4)
    kq, ks, _ = make_cache("q8", rng)
    q = rng.standard_normal((5, 4, 64)).astype(np.float32)
    table, blockpos = np.array([5, 2, 0], np.int32), np.array([0, 1, 2], np.int32)
    count, qpos = np.array([32, 32, 9], np.int32), np.array([40, 60, 70, 71, 72], np.int32)
    got = _attention_with_importance("q8", q, kq, ks, table, blockpos, count, qpos, 96)[1]
    want = np.zeros(96, np.float32)
    reference.attention_q8(q, kq, ks, kq, ks, table, blockpos, count, qpos, 0.125, importance=want)
    np.testing.assert_allclose(got, want, atol=IMPORTANCE_ATOL)


def test_bad_arguments_raise():
    rng = np.random.default_rng(2)
    kq, ks, _ = make_cache("q8", rng)
    q = np.zeros((1, 4, 64), np.float32)
    for path in ("simd", "portable"):
        with pytest.raises(ValueError):
            _kernels.attention_probe("q8", q, kq, ks, np.array([99], np.int32), np.array([32], np.int32), 8, 1.0,
                                     path=path)
        with pytest.raises(ValueError):
            _kernels.attention_probe("q9", q, kq, ks, np.array([0], np.int32), np.array([32], np.int32), 8, 1.0,
                                     path=path)
        with pytest.raises(ValueError):
            _kernels.attention_probe("q8", q.astype(np.float64), kq, ks, np.array([0], np.int32),
                                     np.array([32], np.int32), 8, 1.0, path=path)


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
def test_kv_store_equals_numpy_reference(kind):
    """The C cache write equals the numpy twin's (appliance.kernels.quant's formats) bit for bit."""
    from appliance.engine.kv_cache import PagedKVCache, SequenceBlocks
    rng = np.random.default_rng(5)
    fast = PagedKVCache(2, 2, 64, kind=kind, block_size=32, capacity_tokens=256)
    ref = PagedKVCache(2, 2, 64, kind=kind, block_size=32, capacity_tokens=256)
    seq_a, seq_b = SequenceBlocks(), SequenceBlocks()
    for cache, seq in ((fast, seq_a), (ref, seq_b)):
        cache.reserve(seq, 100)
    k = rng.standard_normal((70, 2, 64)).astype(np.float32)
    v = rng.standard_normal((70, 2, 64)).astype(np.float32)
    k[3] = 0.0                                      # an all-zero row: scale 0, no division by zero
    fast.write(1, seq_a, 20, k, v)
    ref.write_reference(1, seq_b, 20, k, v)
    for name in ("k", "v", "k_scale", "v_scale"):
        if getattr(fast, name) is not None:
            np.testing.assert_array_equal(getattr(fast, name), getattr(ref, name))


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
@pytest.mark.parametrize("probe", [1, 3, 8, 32])
def test_compact_probe_rows_give_the_strided_scores_bit_for_bit(kind, probe):
    """The cache's compact copy of the probed rows (full blocks) against probing the cache itself,
    after writes of one token, a chunk, and a chunk crossing blocks (a partial block stays strided)."""
    from appliance.engine.kv_cache import PagedKVCache, SequenceBlocks
    rng = np.random.default_rng(probe)
    n_kv, group, hd = 2, 2, 64
    cache = PagedKVCache(1, n_kv, hd, kind=kind, capacity_tokens=32 * 8)
    cache.enable_probe_rows(probe)
    assert abs(cache.bytes_per_token_per_layer - cache.nbytes / (32 * 8)) <= 0.5   # counts the copy
    seq = SequenceBlocks()
    cache.reserve(seq, 32 * 5)
    seq.blocks = seq.blocks[::-1]                       # scattered physical blocks
    pos = 0
    for n in (1, 40, 7, 61, 13):                        # ends inside block 3 (122 tokens)
        x = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
        cache.write(0, seq, pos, x, x)
        pos += n
    seq.length = pos
    table, _, count = seq.views(32)
    assert count.tolist() == [32, 32, 32, 26]
    q = rng.standard_normal((1, n_kv * group, hd)).astype(np.float32)
    ks = cache.k_scale[0] if cache.k_scale is not None else None
    pks = cache.probe_k_scale[0] if cache.probe_k_scale is not None else None
    for path in ("simd", "portable"):
        strided = _kernels.attention_probe(kind, q, cache.k[0], ks, table, count, probe, 0.125, path=path)
        compact = _kernels.attention_probe(kind, q, cache.k[0], ks, table, count, probe, 0.125,
                                           pk=cache.probe_k[0], pks=pks, path=path)
        assert np.array_equal(strided, compact), path
        with pytest.raises(ValueError):
            _kernels.attention_probe(kind, q, cache.k[0], ks, table, count, probe * 2 if probe < 32 else 1, 0.125,
                                     pk=cache.probe_k[0], pks=pks, path=path)   # rows of another probe count


@pytest.mark.parametrize("seed", range(200))
def test_select_equals_the_numpy_definition(seed):
    rng = np.random.default_rng(seed)
    n_kv, nb = int(rng.integers(1, 5)), int(rng.integers(1, 70))
    k = int(rng.integers(-1, nb + 3))             # -1: prefill's k - 2 for k = 1
    # few distinct values: many ties, which must go to the lower index in both
    scores = rng.integers(-3, 3, (n_kv, nb)).astype(np.float32) if seed % 2 else \
        rng.standard_normal((n_kv, nb)).astype(np.float32)
    if seed % 7 == 0:
        scores[:, rng.random(nb) < 0.3] = -np.inf          # empty blocks score -inf
    importance = None if seed % 3 == 0 else rng.integers(0, 4, nb).astype(np.float32) * (seed % 5 != 1)
    got = _kernels.select(scores, importance, k)
    want = reference.select(scores, importance, k)
    assert got.dtype == bool and np.array_equal(got, want), (k, nb)


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
@pytest.mark.parametrize("probe", [1, 5, 8, 32])
@pytest.mark.parametrize("compact", [False, True])
def test_attention_probe_paths_match_the_portable_probe_and_numpy(kind, probe, compact):
    """kernels.attention_probe (SIMD and portable twins, on the attention score primitives) against
    the portable twin reading the cache itself and the numpy twin, with a partial block and scattered
    blocks."""
    from appliance.engine.kv_cache import PagedKVCache, SequenceBlocks
    rng = np.random.default_rng(10 + probe)
    n_kv, group, hd = 2, 3, 64
    cache = PagedKVCache(1, n_kv, hd, kind=kind, capacity_tokens=32 * 8)
    if compact:
        cache.enable_probe_rows(probe)
    seq = SequenceBlocks()
    cache.reserve(seq, 32 * 6)
    seq.blocks = [seq.blocks[i] for i in (4, 0, 5, 2, 1, 3)]
    x = rng.standard_normal((170, n_kv, hd)).astype(np.float32)
    cache.write(0, seq, 0, x, x)
    seq.length = 170
    table, _, count = seq.views(32)
    q = rng.standard_normal((2, n_kv * group, hd)).astype(np.float32)
    ks = cache.k_scale[0] if cache.k_scale is not None else None
    pk = cache.probe_k[0] if compact else None
    pks = cache.probe_k_scale[0] if compact and cache.probe_k_scale is not None else None
    plain = _kernels.attention_probe(kind, q, cache.k[0], ks, table, count, probe, 0.125, path="portable",
                                     threads=1)
    numpy_ = reference.attention_probe(kind, q, cache.k[0], ks, table, count, probe, 0.125)
    for path in ("simd", "portable"):
        got = _kernels.attention_probe(kind, q, cache.k[0], ks, table, count, probe, 0.125, pk=pk, pks=pks,
                                       path=path, threads=2)
        np.testing.assert_allclose(got, plain, rtol=PROBE_RTOL, atol=1e-5, err_msg=path)
        np.testing.assert_allclose(got, numpy_, rtol=PROBE_RTOL, atol=1e-5, err_msg=path)
        again = _kernels.attention_probe(kind, q, cache.k[0], ks, table, count, probe, 0.125, pk=pk, pks=pks,
                                         path=path, threads=1)
        assert np.array_equal(got, again)                 # deterministic whatever the thread count


def test_attention_probe_rejects_mismatched_arrays():
    rng = np.random.default_rng(0)
    kq, ks, _ = make_cache("q8", rng)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    table, count = np.array([0, 1], np.int32), np.array([32, 32], np.int32)
    with pytest.raises(ValueError, match="kind"):
        _kernels.attention_probe("q5", q, kq, ks, table, count, 8, 0.1)
    with pytest.raises(ValueError, match="out of range"):
        _kernels.attention_probe("q8", q, kq, ks, np.array([0, 99], np.int32), count, 8, 0.1)
    with pytest.raises(ValueError, match="pk"):
        _kernels.attention_probe("q8", q, kq, ks, table, count, 8, 0.1, pk=kq, pks=ks)
    with pytest.raises(ValueError):
        _kernels.attention_probe("q8", q[:, :3], kq, ks, table, count, 8, 0.1)


# ---- the bound probe --------------------------------------------------------------------------
def _filled_cache(kind, rng, n_tokens=200, n_kv=2, hd=64, step_from=150):
    """A one-layer cache written like an engine does: a prefill chunk, then one token at a time."""
    from appliance.engine.kv_cache import PagedKVCache, SequenceBlocks
    cache = PagedKVCache(1, n_kv, hd, kind, 32, 32 * 10)
    cache.enable_bound_rows()
    seq = SequenceBlocks()
    cache.reserve(seq, n_tokens)
    keys = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    cache.write(0, seq, 0, keys[:step_from], keys[:step_from])
    for t in range(step_from, n_tokens):
        cache.write(0, seq, t, keys[t:t + 1], keys[t:t + 1])
    seq.length = n_tokens
    return cache, seq


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
def test_bound_rows_bound_every_key_of_their_block(kind):
    """Written when a block's last position is (in a prefill chunk or a decode step), from the
    keys as stored; the max row rounds up and the min row down, so they bound every key."""
    cache, seq = _filled_cache(kind, np.random.default_rng(5))
    table, _, count = seq.views(32)
    full = table[count == 32]
    assert len(full) == 6                                     # 200 tokens: 6 full blocks + 8 rows
    keys = cache.dequantized_k(0, full)                      # [6, n_kv, 32, hd]
    rows = cache.bound_k[0][full].astype(np.float32) * cache.bound_k_scale[0][full][..., None]
    assert (rows[:, :, 0, None, :] >= keys).all() and (rows[:, :, 1, None, :] <= keys).all()
    # tight: within one quantization step of the true max/min
    step = cache.bound_k_scale[0][full][..., None]
    assert (rows[:, :, 0] - keys.max(axis=2) <= step[:, :, 0] * 1.001).all()
    assert (keys.min(axis=2) - rows[:, :, 1] <= step[:, :, 1] * 1.001).all()
    assert not cache.bound_k[0][table[-1]].any()            # the partial block has none yet


def _bound_probe(kind, cache, q, table, count, ncand, path="simd"):
    ks = cache.k_scale[0] if cache.k_scale is not None else None
    return kernels.attention_probe_bound(kind, q, cache.k[0], ks, cache.bound_k[0], cache.bound_k_scale[0],
                                         table, count, ncand, 0.125, path=path)


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
@pytest.mark.parametrize("path", ["simd", "portable"])
@pytest.mark.parametrize("ncand", [0, 2, 5, 40])
def test_attention_probe_bound_matches_numpy(kind, path, ncand):
    rng = np.random.default_rng(6)
    cache, seq = _filled_cache(kind, rng)
    table, _, count = seq.views(32)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    got = _bound_probe(kind, cache, q, table, count, ncand, path)
    ks = cache.k_scale[0] if cache.k_scale is not None else None
    want = reference.attention_probe_bound(kind, q, cache.k[0], ks, cache.bound_k[0],
                                               cache.bound_k_scale[0], table, count, ncand, 0.125)
    assert (np.isfinite(got) == np.isfinite(want)).all()
    # per head: min(ncand, 6 full blocks) candidates plus the partial last block
    assert (np.isfinite(got).sum(axis=1) == min(ncand, 6) + 1).all()
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=PROBE_RTOL, atol=1e-5)


@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
def test_bound_probe_scores_candidates_with_the_exact_max(kind):
    """With every block a candidate, the bound probe is the strided probe sampling every row."""
    rng = np.random.default_rng(7)
    cache, seq = _filled_cache(kind, rng)
    table, _, count = seq.views(32)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    ks = cache.k_scale[0] if cache.k_scale is not None else None
    every_row = kernels.attention_probe(kind, q, cache.k[0], ks, table, count, 32, 0.125)
    np.testing.assert_array_equal(_bound_probe(kind, cache, q, table, count, 100), every_row)


def test_bound_probe_finds_the_needle_row_strided_sampling_misses():
    """One key in the middle of block 3 (row 10: not among rows 0, 4, 8, ...) matches the query.
    The strided probe cannot see it; the key bound ranks block 3 first and the exact max
    scores it highest. This is the demo model's retrieval failure in miniature."""
    rng = np.random.default_rng(8)
    from appliance.engine.kv_cache import PagedKVCache, SequenceBlocks
    cache = PagedKVCache(1, 1, 64, "q8", 32, 32 * 12)
    cache.enable_bound_rows()
    seq = SequenceBlocks()
    cache.reserve(seq, 320)
    keys = 0.3 * rng.standard_normal((320, 1, 64)).astype(np.float32)
    q = rng.standard_normal((1, 1, 64)).astype(np.float32)
    keys[3 * 32 + 10, 0] = 2.0 * q[0, 0] / np.linalg.norm(q[0, 0])
    cache.write(0, seq, 0, keys, keys)
    seq.length = 320
    table, _, count = seq.views(32)
    bound = _bound_probe("q8", cache, q, table, count, 3)
    strided = kernels.attention_probe("q8", q, cache.k[0], cache.k_scale[0], table, count, 8, 0.125)
    assert int(np.argmax(bound[0])) == 3
    assert int(np.argmax(strided[0])) != 3


def test_bound_probe_rejects_rows_that_do_not_fit_the_cache():
    rng = np.random.default_rng(9)
    cache, seq = _filled_cache("q8", rng)
    table, _, count = seq.views(32)
    q = np.zeros((1, 4, 64), np.float32)
    with pytest.raises(ValueError, match="bound rows"):
        kernels.attention_probe_bound("q8", q, cache.k[0], cache.k_scale[0],
                                      np.ascontiguousarray(cache.bound_k[0][:, :, :1]),
                                      cache.bound_k_scale[0], table, count, 4, 0.1)
    with pytest.raises(ValueError, match="bk"):
        kernels.attention_probe_bound("q8", q, cache.k[0], cache.k_scale[0], cache.bound_k[0][:, :, :1],
                                      cache.bound_k_scale[0], table, count, 4, 0.1)
    with pytest.raises(ValueError, match="ncand"):
        _bound_probe("q8", cache, q, table, count, -1)
