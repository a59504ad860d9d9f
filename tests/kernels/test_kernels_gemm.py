"""quantize_rows_q8 (bit-exact) and the Q8_0 / Q4_0 GEMM/GEMV against appliance.kernels.quant."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from appliance.kernels import _kernels as K
from appliance.kernels import quant

from kernel_cases import PATHS, gemm_abs_bound

# |y - reference| <= GEMM_RTOL * sum_b |dot_b * scale_b|: the int32 block dots are exact, only
# the float order of the per-block sum differs between numpy, portable C and SIMD lanes.
GEMM_RTOL = 1e-5

# K x M sweep; N cycles through small odd/even and larger sizes (full products would be slow).
KS = (32, 64, 1024, 3072)
MS = (1, 2, 3, 5, 16, 64)
NS = (1, 3, 33, 64, 257, 8)
GEMM_CASES = [(K_, M, NS[(i + j) % len(NS)]) for i, K_ in enumerate(KS) for j, M in enumerate(MS)]


def _weights(rng, n, k, fmt):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return quant.quantize_q8_0(w) if fmt == "q8" else quant.quantize_q4_0(w)


def _check_gemm(y, wq, wd, xq, xd, fmt):
    ref_fn = quant.gemm_q8_reference if fmt == "q8" else quant.gemm_q4_reference
    ref = ref_fn(wq, wd, xq, xd)
    bound = gemm_abs_bound(wq, wd, xq, xd, q4=fmt == "q4")
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= GEMM_RTOL * bound + 1e-30).all(), float((err / np.maximum(bound, 1e-30)).max())


def _gemm(fmt):
    return K.gemm_q8 if fmt == "q8" else K.gemm_q4


# ---- quantize_rows_q8 ---------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,k", [(1, 32), (3, 64), (5, 1024), (16, 3072)])
def test_quantize_rows_q8_bit_exact(path, m, k):
    rng = np.random.default_rng(m * k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))).astype(np.float32)
    x[0, :32] = 0.0                                                   # all-zero block: d = 0, q = 0
    if k >= 64:
        x[0, 32:64] = np.arange(-15.5, 16.5, dtype=np.float32)       # ties: rint to even
        x[0, 63] = 127.0
    q, d = K.quantize_rows_q8(x, path=path)
    q_ref, d_ref = quant.quantize_rows_q8(x)
    assert q.dtype == np.int8 and d.dtype == np.float32
    assert np.array_equal(q, q_ref)
    assert np.array_equal(d.view(np.uint32), d_ref.view(np.uint32))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 4), nb=st.integers(1, 5), seed=st.integers(0, 2**31),
       logscale=st.floats(-20, 20))
def test_quantize_rows_q8_paths_agree(m, nb, seed, logscale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, nb * 32)) * np.exp(logscale)).astype(np.float32)
    q_ref, d_ref = quant.quantize_rows_q8(x)
    for path in PATHS:
        q, d = K.quantize_rows_q8(x, path=path)
        assert np.array_equal(q, q_ref) and np.array_equal(d, d_ref)


# ---- GEMM ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ("q8", "q4"))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k,m,n", GEMM_CASES)
def test_gemm_sweep(fmt, path, k, m, n):
    rng = np.random.default_rng(k * 1000 + m * 10 + n)
    wq, wd = _weights(rng, n, k, fmt)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, k)).astype(np.float32))
    y = _gemm(fmt)(wq, wd, xq, xd, path=path)
    _check_gemm(y, wq, wd, xq, xd, fmt)


@pytest.mark.parametrize("fmt", ("q8", "q4"))
@pytest.mark.parametrize("n,k", [(3072, 1024), (1024, 3072), (4099, 64)])
def test_gemv_large_simd_matches_portable(fmt, n, k):
    """Decode shapes: both paths, 1 and 2 threads, against the reference."""
    rng = np.random.default_rng(n + k)
    wq, wd = _weights(rng, n, k, fmt)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((1, k)).astype(np.float32))
    ys = {}
    for path in PATHS:
        for threads in (1, 2):
            ys[path, threads] = _gemm(fmt)(wq, wd, xq, xd, path=path, threads=threads)
            _check_gemm(ys[path, threads], wq, wd, xq, xd, fmt)
    # Static row partition: the thread count never changes a row's arithmetic.
    assert np.array_equal(ys["simd", 1], ys["simd", 2])
    assert np.array_equal(ys["portable", 1], ys["portable", 2])


@pytest.mark.parametrize("fmt", ("q8", "q4"))
def test_gemm_prefill_shape_with_out(fmt):
    rng = np.random.default_rng(7)
    m, n, k = 67, 130, 1024          # M and N not multiples of any tile
    wq, wd = _weights(rng, n, k, fmt)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, k)).astype(np.float32))
    out = np.full((m, n), np.nan, np.float32)
    y = _gemm(fmt)(wq, wd, xq, xd, out=out, path="simd", threads=2)
    assert y is out
    _check_gemm(out, wq, wd, xq, xd, fmt)


def test_gemm_extreme_values_stay_finite_and_exact():
    """All-127 blocks hit the int16 pair sums' extreme (2*127*127) in maddubs: no saturation."""
    k, n, m = 128, 5, 3
    wq = np.full((n, k), 127, np.int8)
    wq[1] = -127
    wq[2, ::2] = -127
    xq = np.full((m, k), 127, np.int8)
    xq[1] = -127
    wd = np.full((n, k // 32), 1.0, np.float16)
    xd = np.full((m, k // 32), 1.0, np.float32)
    ref = quant.gemm_q8_reference(wq, wd, xq, xd)
    for path in PATHS:
        assert np.array_equal(K.gemm_q8(wq, wd, xq, xd, path=path), ref)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 19), nb=st.integers(1, 6), seed=st.integers(0, 2**31),
       fmt=st.sampled_from(("q8", "q4")))
def test_gemm_hypothesis(m, n, nb, seed, fmt):
    rng = np.random.default_rng(seed)
    k = nb * 32
    wq, wd = _weights(rng, n, k, fmt)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, k)).astype(np.float32))
    for path in PATHS:
        _check_gemm(_gemm(fmt)(wq, wd, xq, xd, path=path), wq, wd, xq, xd, fmt)


def test_gemm_accepts_uint16_scale_bits_and_readonly_weights():
    rng = np.random.default_rng(3)
    wq, wd = _weights(rng, 9, 64, "q8")
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((2, 64)).astype(np.float32))
    wq.setflags(write=False)
    a = K.gemm_q8(wq, wd, xq, xd)
    b = K.gemm_q8(wq, wd.view(np.uint16), xq, xd)
    assert np.array_equal(a, b)
