"""Which kernel path runs, and its integer parts bit for bit against the portable C path.

Under `make test-arm` this runs as aarch64 code on an emulated Cortex-A76 with
APPLIANCE_EXPECT_PATH=neon-dotprod, so the sdot kernels are the ones compared; on x86_64 the
same tests hold the AVX2 path to the same rule.

Integer parts: with every scale a power of two (1 included), each term int32(xq_b . wq_b) * xd * wd
of a GEMM and every partial sum of them is exactly representable in float32 (the test checks
that premise), so the float output is exact whatever the order of summation: any difference
from the portable path, or from the int64 numpy dot products, is a wrong integer.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import quant

QK = quant.QK
FLOAT24 = float(1 << 24)   # float32 holds every integer below this exactly
EXPECT = os.environ.get("APPLIANCE_EXPECT_PATH")
SHAPES = [(1, 32), (3, 64), (17, 96), (67, 256), (64, 1024), (5, 4096)]   # (N, K): tails and long rows


def test_active_path_is_the_expected_one():
    path = K.kernel_path()
    assert path in ("neon-dotprod", "neon", "avx2", "portable")
    if EXPECT:
        assert path == EXPECT, f"kernel_path() is {path!r}, the harness expects {EXPECT!r}"
    assert K.cpu_supported() is True
    feats = set(K.cpu_features().split())
    if path == "neon-dotprod":
        # From getauxval(AT_HWCAP), which qemu-user fills from -cpu (/proc/cpuinfo shows the host).
        assert {"asimd", "asimddp"} <= feats, feats
    if path == "neon":
        assert "asimd" in feats, feats


def test_engine_uses_the_compiled_kernels():
    if os.environ.get("APPLIANCE_KERNELS") == "numpy":
        pytest.skip("APPLIANCE_KERNELS=numpy selects the numpy twin")
    from appliance.kernels import dispatch as ops
    assert ops.kernels is K


def _int_case(rng, m, n, k, fmt, extreme=False):
    if extreme:   # the largest products, both signs: overflows of narrow accumulators show here
        xq = rng.choice(np.array([-127, 127], np.int8), size=(m, k))
        nib = rng.choice(np.array([0, 15], np.uint8), size=(n, k))
        w8 = rng.choice(np.array([-127, 127], np.int8), size=(n, k))
    else:
        xq = rng.integers(-127, 128, size=(m, k), dtype=np.int8)
        nib = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        w8 = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    if fmt == "q8":
        return xq, w8, w8
    # pack nibbles in Q4_0 order: inside each 32-block, byte j = element j (low) | element j+16 (high)
    b = nib.reshape(n, -1, QK)
    packed = (b[..., :QK // 2] | (b[..., QK // 2:] << 4)).astype(np.uint8).reshape(n, k // 2)
    w = quant.unpack_q4(packed)
    assert np.array_equal(w, nib.astype(np.int8) - 8)
    return xq, packed, w


def _exact_gemm(xq, w, xd, wd):
    """float64 result and the bound on every partial sum's magnitude (in units of the smallest scale)."""
    m, k = xq.shape
    n = w.shape[0]
    dots = np.einsum("mbi,nbi->mnb", xq.reshape(m, -1, QK).astype(np.int64),
                     w.reshape(n, -1, QK).astype(np.int64))
    scale = xd.astype(np.float64)[:, None, :] * wd.astype(np.float64)[None, :, :]
    terms = dots * scale
    return terms.sum(-1), np.abs(terms).sum(-1) / scale.min()


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_gemm_integer_part_bit_exact(fmt, n, k, m):
    rng = np.random.default_rng(1000 * n + 10 * m + (fmt == "q4"))
    gemm = K.gemm_q8 if fmt == "q8" else K.gemm_q4
    for extreme, pow2 in ((False, False), (True, False), (False, True)):
        xq, wq, w = _int_case(rng, m, n, k, fmt, extreme)
        if pow2:   # per-block power-of-two scales: which scale goes with which block is checked too
            xd = np.exp2(rng.integers(-2, 2, size=(m, k // QK))).astype(np.float32)
            wd = np.exp2(rng.integers(-2, 2, size=(n, k // QK))).astype(np.float16)
        else:
            xd = np.ones((m, k // QK), np.float32)
            wd = np.ones((n, k // QK), np.float16)
        want, bound = _exact_gemm(xq, w, xd, wd)
        if bound.max() >= FLOAT24:   # premise of the test, not of the kernel
            continue
        simd = gemm(wq, wd, xq, xd, path="simd")
        port = gemm(wq, wd, xq, xd, path="portable")
        assert np.array_equal(port, want.astype(np.float32)), "portable path vs int64 numpy"
        assert np.array_equal(simd.view(np.uint32), port.view(np.uint32)), (
            f"{K.kernel_path()} {fmt} gemm M={m} N={n} K={k} extreme={extreme} pow2={pow2}: "
            f"{int((simd != port).sum())} outputs differ, max |diff| {np.abs(simd - port).max()}")


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_gemv_threads_do_not_change_bits(fmt):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    w = rng.standard_normal((301, 1024)).astype(np.float32)
    xq, xd = K.quantize_rows_q8(x)
    wq, wd = quant.quantize_q8_0(w) if fmt == "q8" else quant.quantize_q4_0(w)
    gemm = K.gemm_q8 if fmt == "q8" else K.gemm_q4
    one = gemm(wq, wd, xq, xd, threads=1)
    two = gemm(wq, wd, xq, xd, threads=2)
    assert np.array_equal(one.view(np.uint32), two.view(np.uint32))


def test_quantize_rows_q8_bit_exact_with_ties_and_edges():
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(256) * s for s in (1e-3, 1.0, 1e4)]
    ties = np.zeros(256)
    ties[0::32] = 127.0                                    # d = 1 exactly: x/d lands on .5 ties
    ties[1::32], ties[2::32], ties[3::32], ties[4::32] = 0.5, -0.5, 2.5, -126.5
    rows += [ties, np.zeros(256), np.full(256, -3.0), rng.standard_normal(256) * 1e-30]
    x = np.stack(rows).astype(np.float32)
    q_simd, d_simd = K.quantize_rows_q8(x, path="simd")
    q_port, d_port = K.quantize_rows_q8(x, path="portable")
    assert np.array_equal(d_simd.view(np.uint32), d_port.view(np.uint32))
    assert np.array_equal(q_simd, q_port), np.argwhere(q_simd != q_port)[:8]
    assert np.abs(q_port.astype(np.int32)).max() <= 127
