"""rmsnorm, rope, silu_mul, layer_norm, gelu_tanh against numpy float64."""
import numpy as np
import pytest

from appliance.kernels import _kernels as K

from kernel_cases import PATHS

RMSNORM_RTOL = 2e-6      # float32 sum of squares over D (SIMD lanes) against float64
ROPE_ATOL = 2e-6         # relative to max|x|: cos/sin of the same float32 angle, one rotation
SILU_RTOL = 2e-6         # vectorised exp is within a few ulp of expf


def _rmsnorm_ref(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,d", [(1, 1024), (3, 128), (5, 7), (64, 3072), (2, 1)])
def test_rmsnorm(path, m, d):
    rng = np.random.default_rng(m * d)
    x = (rng.standard_normal((m, d)) * 3).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    ref = _rmsnorm_ref(x, w, 1e-6)
    y = K.rmsnorm(x, w, 1e-6, path=path)
    np.testing.assert_allclose(y, ref, rtol=RMSNORM_RTOL, atol=RMSNORM_RTOL * np.abs(ref).max())
    # in place
    x2 = x.copy()
    assert K.rmsnorm(x2, w, 1e-6, out=x2, path=path) is x2
    np.testing.assert_array_equal(x2, y)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_rmsnorm_reads_heads_of_strided_rows(path, m):
    """The q (or k) heads of a fused projection's rows, read in place: the bits of the same heads
    copied out first, per head as q_norm and k_norm normalize them."""
    rng = np.random.default_rng(m)
    qkv = (rng.standard_normal((m, 4 * 128 + 2 * 64)) * 2).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    heads = qkv[:, 128:128 + 6 * 64].reshape(m, 6, 64)          # strided rows, contiguous heads
    y = K.rmsnorm(heads, w, 1e-6, path=path)
    assert y.shape == (m, 6, 64) and y.flags.c_contiguous
    want = K.rmsnorm(np.ascontiguousarray(heads).reshape(-1, 64), w, 1e-6, path=path).reshape(m, 6, 64)
    np.testing.assert_array_equal(y, want)
    rows = qkv[:, 64:64 + 256]                                     # 2-D strided rows too
    np.testing.assert_array_equal(K.rmsnorm(rows, np.ones(256, np.float32), 1e-6, path=path),
                                  K.rmsnorm(np.ascontiguousarray(rows), np.ones(256, np.float32), 1e-6, path=path))
    out = np.empty((m, 6, 64), np.float32)
    assert K.rmsnorm(heads, w, 1e-6, out=out, path=path) is out
    np.testing.assert_array_equal(out, want)


def test_rmsnorm_zero_row_is_finite():
    x = np.zeros((2, 64), np.float32)
    for path in PATHS:
        y = K.rmsnorm(x, np.ones(64, np.float32), 1e-6, path=path)
        assert np.isfinite(y).all() and not y.any()


def _rope_ref(x, pos, inv_freq):
    half = x.shape[-1] // 2
    ang = pos.astype(np.float32)[:, None] * inv_freq[None, :]          # float32, as the contract
    c = np.cos(ang.astype(np.float64))[:, None, :]
    s = np.sin(ang.astype(np.float64))[:, None, :]
    x0 = x[..., :half].astype(np.float64)
    x1 = x[..., half:].astype(np.float64)
    return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,h,hd", [(1, 16, 128), (3, 8, 64), (17, 2, 256), (2, 3, 6)])
def test_rope(path, m, h, hd):
    rng = np.random.default_rng(m * h * hd)
    x = rng.standard_normal((m, h, hd)).astype(np.float32)
    pos = rng.integers(0, 40960, m).astype(np.int32)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)
    ref = _rope_ref(x, pos, inv_freq)
    y = x.copy()
    assert K.rope(y, pos, inv_freq, path=path) is None
    np.testing.assert_allclose(y, ref, rtol=0, atol=ROPE_ATOL * np.abs(x).max())


def test_rope_paths_agree():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 4, 128)).astype(np.float32)
    pos = np.arange(100, 109, dtype=np.int32)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, 128, 2, dtype=np.float32) / 128))).astype(np.float32)
    a, b = x.copy(), x.copy()
    K.rope(a, pos, inv_freq, path="portable")
    K.rope(b, pos, inv_freq, path="simd")
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (16, 3072), (2, 3, 5)])
def test_silu_mul(path, shape):
    rng = np.random.default_rng(sum(shape))
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    y = K.silu_mul(g, u, path=path)
    assert y.shape == shape
    np.testing.assert_allclose(y, ref, rtol=SILU_RTOL, atol=1e-30)
    g2 = g.copy()
    assert K.silu_mul(g2, u, out=g2, path=path) is g2
    np.testing.assert_array_equal(g2, y)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 4, 9])
def test_silu_mul_reads_the_halves_of_gate_up(path, m):
    """gate_up's two halves, read in place: the bits of the halves copied out first."""
    rng = np.random.default_rng(m)
    gu = (rng.standard_normal((m, 2 * 200)) * 4).astype(np.float32)
    y = K.silu_mul(gu[:, :200], gu[:, 200:], path=path)
    assert y.shape == (m, 200) and y.flags.c_contiguous
    np.testing.assert_array_equal(
        y, K.silu_mul(np.ascontiguousarray(gu[:, :200]), np.ascontiguousarray(gu[:, 200:]), path=path))
    out = np.empty((m, 200), np.float32)
    assert K.silu_mul(gu[:, :200], gu[:, 200:], out=out, path=path) is out
    np.testing.assert_array_equal(out, y)


@pytest.mark.parametrize("path", PATHS)
def test_silu_mul_extremes(path):
    g = np.array([-200, -100, -88.5, -87, -20, -1e-30, 0, 1e-30, 20, 88, 89, 100, 200, 3e38],
                 np.float32)
    u = np.ones_like(g)
    y = K.silu_mul(g, u, path=path)
    assert np.isfinite(y).all()
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g64 / (1 + np.exp(-g64))
    np.testing.assert_allclose(y, ref, rtol=SILU_RTOL, atol=1e-35)


LAYER_NORM_RTOL = 4e-6   # float32 sums over D (SIMD lanes) against float64, two passes
GELU_RTOL = 4e-6         # vectorised exp within a few ulp of expf, then one division
GELU_ATOL = 1e-12        # the far negative tail, ~0: its float32 exponent (|2z| up to ~700) carries
                         # relative error |2z| * 2^-24 into values of 1e-16 and less


def _layer_norm_ref(x, w, b, eps):
    x = x.astype(np.float64)
    d = x - x.mean(axis=-1, keepdims=True)
    return d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps) * w + b


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,d", [(1, 1024), (3, 128), (5, 7), (64, 4096), (2, 1)])
def test_layer_norm(path, m, d):
    rng = np.random.default_rng(m * d + 1)
    # rows far from zero mean: the two passes keep their digits where one would not
    x = (rng.standard_normal((m, d)) * 3 + 50).astype(np.float32)
    w, b = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    ref = _layer_norm_ref(x, w, b, 1e-6)
    y = K.layer_norm(x, w, b, 1e-6, path=path)
    np.testing.assert_allclose(y, ref, rtol=LAYER_NORM_RTOL, atol=LAYER_NORM_RTOL * np.abs(ref).max())
    x2 = x.copy()
    assert K.layer_norm(x2, w, b, 1e-6, out=x2, path=path) is x2
    np.testing.assert_array_equal(x2, y)


def test_layer_norm_constant_row_gives_the_bias():
    x = np.full((2, 64), 3.5, np.float32)
    b = np.arange(64, dtype=np.float32)
    for path in PATHS:
        np.testing.assert_array_equal(K.layer_norm(x, np.ones(64, np.float32), b, 1e-6, path=path),
                                      np.broadcast_to(b, (2, 64)))


def _gelu_tanh_ref(x):
    """In float64, as x / (1 + exp(-2z)): 1 + tanh(z) cancels to 0 for x below about -9."""
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (16, 4096), (2, 3, 5)])
def test_gelu_tanh(path, shape):
    x = (np.random.default_rng(sum(shape)).standard_normal(shape) * 4).astype(np.float32)
    y = K.gelu_tanh(x, path=path)
    assert y.shape == shape
    np.testing.assert_allclose(y, _gelu_tanh_ref(x), rtol=GELU_RTOL, atol=GELU_ATOL)
    x2 = x.copy()
    assert K.gelu_tanh(x2, out=x2, path=path) is x2
    np.testing.assert_array_equal(x2, y)


@pytest.mark.parametrize("path", PATHS)
def test_gelu_tanh_extremes(path):
    """Where exp(-2z) overflows the result is -0 (x / inf), where it vanishes x itself."""
    x = np.array([-3e38, -200, -30, -10, -1e-30, 0, 1e-30, 10, 30, 200, 3e38], np.float32)
    y = K.gelu_tanh(x, path=path)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, _gelu_tanh_ref(x), rtol=GELU_RTOL, atol=GELU_ATOL)
