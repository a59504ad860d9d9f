"""Attention over the paged cache (q8, q4, f32) against the numpy twin, fed float64."""
import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import reference

from kernel_cases import PATHS, PagedCase, make_case, nmse, quantize_q_rows

# Same definition (q quantized as the kernel does, dequantized cache), float64 reference:
# max error relative to max|V|. Float32 scores/exp/accumulation only.
ATTN_TOL = 2e-5
# Against exact float attention (nothing quantized): normalized mean squared error.
ATTN_Q8_VS_EXACT_NMSE = 2e-3
ATTN_Q4_VS_EXACT_NMSE = 5e-2
ATTN_F32_VS_EXACT_NMSE = 1e-10


def attn_tol(kind, path):
    """ATTN_TOL, or for q8 the kernel's own bound: the NEON path sums V with 14-bit weights."""
    return K.attention_q8_tolerance(path) if kind == "q8" else ATTN_TOL


# (T, n_kv, group, hd, bs, context, per_head, nsel)
CASES = [
    (1, 1, 1, 64, 32, 1, False, None),
    (1, 2, 2, 128, 32, 100, False, None),
    (1, 8, 2, 128, 32, 300, True, 4),
    (3, 2, 4, 64, 16, 77, False, None),
    (3, 1, 2, 128, 32, 33, True, 2),
    (17, 2, 1, 64, 32, 70, False, None),
    (17, 8, 2, 128, 32, 200, True, 5),
    (17, 1, 4, 128, 8, 45, False, None),
    (1, 2, 1, 64, 64, 10, False, None),
]


def _run(kind, case, path, threads=0):
    if kind == "f32":
        return K.attention_f32(case.q, case.k_f32, case.v_f32, case.table, case.blockpos, case.count,
                               case.qpos, case.scale, path=path, threads=threads), None, None
    (kq, ks, vq, vs), k_deq, v_deq = case.q8() if kind == "q8" else case.q4()
    fn = K.attention_q8 if kind == "q8" else K.attention_q4
    out = fn(case.q, kq, ks, vq, vs, case.table, case.blockpos, case.count, case.qpos, case.scale,
             path=path, threads=threads)
    return out, k_deq, v_deq


def _check_same_definition(kind, case, out, k_deq, v_deq, path):
    if kind == "f32":
        q_deq, k_deq, v_deq = case.q.astype(np.float64), case.k_f32, case.v_f32
    else:
        q_deq = quantize_q_rows(case.q)
    ref = reference.attention_f32(q_deq, k_deq, v_deq, case.table, case.blockpos, case.count,
                                  case.qpos, case.scale)
    assert out.shape == case.q.shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    err = np.abs(out - ref).max()
    assert err <= attn_tol(kind, path) * np.abs(v_deq).max(), err
    return ref


@pytest.mark.parametrize("kind", ("q8", "q4", "f32"))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case_args", CASES)
def test_attention_sweep(kind, path, case_args):
    T, n_kv, group, hd, bs, context, per_head, nsel = case_args
    rng = np.random.default_rng(hash(case_args) % 2**32)
    case = make_case(rng, T, n_kv, group, hd, bs, context, per_head=per_head, nsel=nsel)
    out, k_deq, v_deq = _run(kind, case, path)
    _check_same_definition(kind, case, out, k_deq, v_deq, path)


@pytest.mark.parametrize("kind,limit", [("q8", ATTN_Q8_VS_EXACT_NMSE), ("q4", ATTN_Q4_VS_EXACT_NMSE),
                                        ("f32", ATTN_F32_VS_EXACT_NMSE)])
def test_attention_close_to_exact_float(kind, limit):
    rng = np.random.default_rng(11)
    case = make_case(rng, 5, 2, 2, 128, 32, 150, kscale=0.5)
    exact = reference.attention_f32(case.q.astype(np.float64), case.k_f32.astype(np.float64),
                                    case.v_f32.astype(np.float64), case.table, case.blockpos, case.count,
                                    case.qpos, case.scale)
    for path in PATHS:
        out, _, _ = _run(kind, case, path)
        assert nmse(out, exact) < limit


@pytest.mark.parametrize("kind", ("q8", "q4"))
def test_attention_decode_long_context_threads(kind):
    """Decode shape of Qwen3-0.6B (8 kv heads, group 2) at a context that is not a block multiple;
    1 and 2 threads give identical results (each (t, head) is computed by one thread)."""
    rng = np.random.default_rng(5)
    case = make_case(rng, 1, 8, 2, 128, 32, 1000)
    outs = {}
    for path in PATHS:
        for threads in (1, 2):
            outs[path, threads], k_deq, v_deq = _run(kind, case, path, threads)
        _check_same_definition(kind, case, outs[path, 1], k_deq, v_deq, path)
        assert np.array_equal(outs[path, 1], outs[path, 2])


@pytest.mark.parametrize("per_head", (False, True))
def test_attention_head_ranges_give_the_same_bits(per_head):
    """A unit walks a range of kv heads block by block; how many heads a range holds follows the
    thread count (8 heads at 1 thread here, 1 at 8 threads), and must not change a bit, with the
    list shared by the heads or each head's own (sparse attention's)."""
    rng = np.random.default_rng(11)
    case = make_case(rng, 1, 8, 2, 128, 32, 1000, per_head=per_head, nsel=20 if per_head else None)
    for kind in ("q8", "q4"):
        for path in PATHS:
            outs = [_run(kind, case, path, threads)[0] for threads in (1, 2, 4, 8)]
            for out in outs[1:]:
                assert np.array_equal(outs[0], out)


def test_attention_causal_inside_a_block_and_nothing_visible():
    """Queries at positions inside the last block see only up to themselves; a query before
    every listed position gets zeros."""
    rng = np.random.default_rng(2)
    case = make_case(rng, 4, 2, 2, 64, 32, 64, qpos=[-1, 0, 40, 63])
    for kind in ("q8", "q4", "f32"):
        for path in PATHS:
            out, k_deq, v_deq = _run(kind, case, path)
            _check_same_definition(kind, case, out, k_deq, v_deq, path)
            assert not out[0].any()


def test_attention_per_head_table_differs_from_shared():
    """A 2-D table gives each kv head its own blocks; stride 0 (1-D) shares them."""
    rng = np.random.default_rng(9)
    case = make_case(rng, 2, 2, 2, 64, 16, 90, per_head=True, nsel=3)
    out2d, _, _ = _run("q8", case, "simd")
    h0 = case.table[0]
    case.table, case.blockpos, case.count = h0, case.blockpos[0], case.count[0]
    out1d, k_deq, v_deq = _run("q8", case, "simd")
    _check_same_definition("q8", case, out1d, k_deq, v_deq, "simd")
    assert np.array_equal(out1d[:, :2], out2d[:, :2])        # kv head 0 had these blocks anyway
    assert not np.array_equal(out1d[:, 2:], out2d[:, 2:])


def test_attention_large_scores_stay_finite():
    """Peaked softmax (large |scores|) exercises the running-max rescale."""
    rng = np.random.default_rng(4)
    case = make_case(rng, 3, 2, 2, 128, 32, 200, kscale=30.0)
    for kind in ("q8", "q4", "f32"):
        for path in PATHS:
            out, k_deq, v_deq = _run(kind, case, path)
            _check_same_definition(kind, case, out, k_deq, v_deq, path)


def test_attention_out_argument():
    rng = np.random.default_rng(6)
    case = make_case(rng, 2, 2, 2, 64, 32, 50)
    (kq, ks, vq, vs), _, _ = case.q8()
    out = np.full(case.q.shape, np.nan, np.float32)
    res = K.attention_q8(case.q, kq, ks, vq, vs, case.table, case.blockpos, case.count, case.qpos,
                         case.scale, out=out)
    assert res is out and np.isfinite(out).all()


@pytest.mark.parametrize("kind", ("q8", "q4", "f32"))
def test_attention_batch_equals_one_query_at_a_time(kind):
    """Queries are computed in tiles; a query's result must not depend on its tile mates."""
    rng = np.random.default_rng(8)
    case = make_case(rng, 7, 2, 2, 64, 16, 60, qpos=[3, 20, 21, 40, 41, 58, 59])
    for path in PATHS:
        batch, _, _ = _run(kind, case, path)
        for t in range(7):
            one = PagedCase(case.q[t:t + 1].copy(), case.k_f32, case.v_f32, case.table,
                            case.blockpos, case.count, case.qpos[t:t + 1].copy(), case.scale)
            single, _, _ = _run(kind, one, path)
            assert np.array_equal(single[0], batch[t])


@pytest.mark.parametrize("path", PATHS)
def test_attention_q8_weights_integers_cannot_scale_and_long_blocks(path):
    """Where the q8 V pass sums with 14-bit weights (NEON), a block's weights are scaled to their
    largest: V scales so small (1e-36) that integers cannot scale them, negative V scales (a
    caller's own), V rows of zeros and blocks of 600 rows (more than one 256-row chunk of int32
    sums) must still give the definition's numbers; on float paths the same holds trivially."""
    rng = np.random.default_rng(31)
    case = make_case(rng, 3, 2, 4, 64, 600, 1300)
    (kq, ks, vq, vs), k_deq, _ = case.q8()
    vs, blocks = vs.copy(), case.table
    vs[blocks[0]] *= 1e-36              # every row of the first block: weights below 1e-30
    vs[blocks[1], 0, ::3] *= -1.0       # some rows of the second, head 0: negative weights
    vs[blocks[2], 1] = 0.0              # the last block (100 rows) adds nothing for head 1
    v_deq = vq.astype(np.float64) * vs.astype(np.float64)[..., None]
    out = K.attention_q8(case.q, kq, ks, vq, vs, case.table, case.blockpos, case.count, case.qpos, case.scale,
                         path=path)
    ref = reference.attention_f32(quantize_q_rows(case.q), k_deq, v_deq, case.table, case.blockpos, case.count,
                                  case.qpos, case.scale)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() <= K.attention_q8_tolerance(path) * np.abs(v_deq).max()
    assert reference.attention_q8_weight_bits(path) == 0 and reference.attention_q8_tolerance(path) == ATTN_TOL


def test_attention_q8_weight_bits_name_the_path():
    """14-bit integer weights on NEON's simd path, float elsewhere; the tolerance follows."""
    bits = K.attention_q8_weight_bits("simd")
    assert bits == (14 if K.kernel_path().startswith("neon") and K.cpu_supported() else 0)
    assert K.attention_q8_weight_bits("portable") == 0 and K.attention_q8_tolerance("portable") == ATTN_TOL
    assert K.attention_q8_tolerance("simd") == (ATTN_TOL if bits == 0 else ATTN_TOL + 8.0 * 2.0 ** -bits)
