"""The numpy twin (appliance.kernels.reference) against both C paths, kernel by kernel.

The twin is what the engine runs under APPLIANCE_KERNELS=numpy and what `make test-arm` computes
the aarch64 reference with, so it must compute what the kernels compute: integer results and the
cache writes bit for bit, float results within the tolerances the per-kernel tests name.
"""
import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import quant
from appliance.kernels import reference

from kernel_cases import PATHS, gemm_abs_bound, make_case
from test_kernels_attention import attn_tol
from test_kernels_elementwise import GELU_ATOL, GELU_RTOL, LAYER_NORM_RTOL, RMSNORM_RTOL, ROPE_ATOL, SILU_RTOL
from test_kernels_gemm import GEMM_RTOL


@pytest.mark.parametrize("path", PATHS)
def test_quantize_rows_q8(path):
    x = (np.random.default_rng(1).standard_normal((7, 256)) * 5).astype(np.float32)
    x[0, :32] = 0.0
    q, d = K.quantize_rows_q8(x, path=path)
    q_twin, d_twin = reference.quantize_rows_q8(x)
    assert np.array_equal(q, q_twin) and np.array_equal(d.view(np.uint32), d_twin.view(np.uint32))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("m", [1, 5])
def test_gemm(path, fmt, m):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((67, 256)).astype(np.float32) * 0.05
    wq, wd = quant.quantize_q8_0(w) if fmt == "q8" else quant.quantize_q4_0(w)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, 256)).astype(np.float32))
    if fmt == "q8":
        got, want = K.gemm_q8(wq, wd, xq, xd, path=path), reference.gemm_q8(wq, wd, xq, xd)
    else:
        got, want = K.gemm_q4(wq, wd, xq, xd, path=path), reference.gemm_q4(wq, wd, xq, xd)
    bound = gemm_abs_bound(wq, wd, xq, xd, q4=fmt == "q4")
    assert (np.abs(got.astype(np.float64) - want) <= GEMM_RTOL * bound + 1e-30).all()


@pytest.mark.parametrize("path", PATHS)
def test_elementwise(path):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 384)) * 3).astype(np.float32)
    w = rng.standard_normal(384).astype(np.float32)
    want = reference.rmsnorm(x, w, 1e-6)
    np.testing.assert_allclose(K.rmsnorm(x, w, 1e-6, path=path), want, rtol=RMSNORM_RTOL,
                               atol=RMSNORM_RTOL * np.abs(want).max())

    heads = rng.standard_normal((3, 4, 128)).astype(np.float32)
    pos = np.array([0, 17, 30000], np.int32)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, 128, 2, dtype=np.float32) / 128))).astype(np.float32)
    got, want = heads.copy(), heads.copy()
    K.rope(got, pos, inv_freq, path=path)
    reference.rope(want, pos, inv_freq)
    np.testing.assert_allclose(got, want, rtol=0, atol=ROPE_ATOL * np.abs(heads).max())

    g, u = (rng.standard_normal((3, 300)) * 4).astype(np.float32), rng.standard_normal((3, 300)).astype(np.float32)
    np.testing.assert_allclose(K.silu_mul(g, u, path=path), reference.silu_mul(g, u), rtol=SILU_RTOL, atol=1e-30)

    b = rng.standard_normal(384).astype(np.float32)
    want = reference.layer_norm(x, w, b, 1e-6)
    np.testing.assert_allclose(K.layer_norm(x, w, b, 1e-6, path=path), want, rtol=LAYER_NORM_RTOL,
                               atol=LAYER_NORM_RTOL * np.abs(want).max())
    np.testing.assert_allclose(K.gelu_tanh(g, path=path), reference.gelu_tanh(g), rtol=GELU_RTOL, atol=GELU_ATOL)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
def test_attention(path, kind):
    """Per-head block lists and a partial block, on the same quantized cache for both."""
    case = make_case(np.random.default_rng(4), 5, 2, 2, 64, 32, 150, per_head=True, nsel=4)
    lists = (case.table, case.blockpos, case.count, case.qpos, case.scale)
    if kind == "f32":
        got = K.attention_f32(case.q, case.k_f32, case.v_f32, *lists, path=path)
        want = reference.attention_f32(case.q, case.k_f32, case.v_f32, *lists)
    elif kind == "q8":
        cache = case.q8()[0]
        got, want = K.attention_q8(case.q, *cache, *lists, path=path), reference.attention_q8(case.q, *cache, *lists)
    else:
        cache = case.q4()[0]
        got, want = K.attention_q4(case.q, *cache, *lists, path=path), reference.attention_q4(case.q, *cache, *lists)
    assert np.abs(got - want).max() <= attn_tol(kind, path) * np.abs(case.v_f32).max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
def test_kv_store_reads_strided_tokens(kind, path):
    """The v heads of a fused projection's rows, read in place, and tokens not contiguous in
    themselves (copied): the cache's bits of the same tokens stored from a contiguous copy."""
    rng = np.random.default_rng(6)
    qkv = rng.standard_normal((5, 3 * 2 * 64)).astype(np.float32)
    slots = np.array([3, 40, 17, 90, 64], np.int32)
    row = 32 if kind == "q4" else 64
    dtype = {"q8": np.int8, "q4": np.uint8, "f32": np.float32}[kind]
    scale_shape = (6, 2, 16) + ((2,) if kind == "q4" else ())
    for x in (qkv[:, 256:].reshape(5, 2, 64), np.repeat(qkv[:, 256:], 2, axis=1)[:, ::2].reshape(5, 2, 64)):
        got, want = np.zeros((6, 2, 16, row), dtype), np.zeros((6, 2, 16, row), dtype)
        gs, ws = (None, None) if kind == "f32" else (np.zeros(scale_shape, np.float32), np.zeros(scale_shape, np.float32))
        K.kv_store(kind, x, slots, got, gs, path=path)
        K.kv_store(kind, np.ascontiguousarray(x), slots, want, ws, path=path)
        assert got.any() and np.array_equal(got, want)
        if kind != "f32":
            assert np.array_equal(gs.view(np.uint32), ws.view(np.uint32))


def test_kv_store_refuses_slots_out_of_range():
    dst, scale = np.zeros((2, 1, 4, 32), np.int8), np.zeros((2, 1, 4), np.float32)
    x = np.ones((2, 1, 32), np.float32)
    for slots in ([0, 8], [-1, 0]):
        with pytest.raises(ValueError, match="in-range slot"):
            K.kv_store("q8", x, np.array(slots, np.int32), dst, scale)
    assert not dst.any() and not scale.any()      # nothing written before the check failed


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
@pytest.mark.parametrize("hd", [64, 128])
def test_kv_store(kind, path, hd):
    """Two writes at scattered slots, one with an all-zero row (scale 0), one with values that land
    exactly halfway between two steps (rounded to even) and a -0.0: the arrays bit for bit."""
    rng = np.random.default_rng(5)
    writes = [(rng.standard_normal((9, 2, hd)).astype(np.float32), rng.permutation(6 * 16)[:9].astype(np.int32))
              for _ in range(2)]
    writes[0][0][3] = 0.0
    halves = writes[1][0][4, 1]
    halves[:] = (np.arange(hd) % 20 - 10 + 0.5).astype(np.float32)   # amax 127: x * 127/amax = x, ties
    halves[0], halves[1] = 127.0, -0.0
    row = hd // 2 if kind == "q4" else hd
    dtype = {"q8": np.int8, "q4": np.uint8, "f32": np.float32}[kind]
    scale_shape = (6, 2, 16) + ((hd // 32,) if kind == "q4" else ())
    dst, dst_twin = np.zeros((6, 2, 16, row), dtype), np.zeros((6, 2, 16, row), dtype)
    scale, scale_twin = (None, None) if kind == "f32" else (np.zeros(scale_shape, np.float32),
                                                            np.zeros(scale_shape, np.float32))
    for x, slots in writes:
        K.kv_store(kind, x, slots, dst, scale, path=path)
        reference.kv_store(kind, x, slots, dst_twin, scale_twin)
    assert dst.any() and np.array_equal(dst, dst_twin)
    if kind != "f32":
        assert np.array_equal(scale.view(np.uint32), scale_twin.view(np.uint32))
