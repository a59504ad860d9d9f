"""Weights in strips (kernels/gemm_strips.h): the packer against its numpy twin byte for byte, and
gemm_strips against the row route bit for bit on both paths, any thread count and ragged sizes."""
import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import quant, reference, strips

from kernel_cases import PATHS, gemm_abs_bound

GEMM_RTOL = 1e-5     # as tests/kernels/test_kernels_gemm.py: only the float order of the block sum differs

# N not a multiple of 16 (a ragged last strip), M past the 8-row tile and past a run of 128 rows
CASES = [(1, 32, 1), (15, 64, 3), (16, 32, 8), (33, 96, 9), (257, 1024, 17), (40, 3072, 2), (70, 64, 300)]


def _weights(rng, n, k, q4):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return quant.quantize_q4_0(w) if q4 else quant.quantize_q8_0(w)


def _check_gemm(y, wq, wd, xq, xd, q4):
    ref = (quant.gemm_q4_reference if q4 else quant.gemm_q8_reference)(wq, wd, xq, xd)
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= GEMM_RTOL * gemm_abs_bound(wq, wd, xq, xd, q4=q4) + 1e-30).all()


def _rows_gemm(q4):
    return K.gemm_q4 if q4 else K.gemm_q8


@pytest.mark.parametrize("q4", [False, True], ids=["q8", "q4"])
@pytest.mark.parametrize("n,k", [(1, 32), (15, 64), (16, 32), (37, 96), (100, 1024)])
def test_pack_is_the_numpy_layout_and_reads_back(q4, n, k):
    wq, wd = _weights(np.random.default_rng(n * k), n, k, q4)
    ws = K.pack_strips(wq, wd, q4)
    assert ws.dtype == np.uint8 and ws.ndim == 1 and ws.ctypes.data % 64 == 0
    assert ws.shape[0] == strips.total_bytes(q4, n, k)
    assert np.array_equal(ws, reference.pack_strips(wq, wd, q4))
    back_q, back_d = strips.unpack(ws, n, k, q4)
    assert np.array_equal(back_q, wq) and np.array_equal(back_d.view(np.uint16), wd.view(np.uint16))
    ids = [n - 1, 0, n // 2]
    some_q, some_d = strips.rows(ws, n, k, q4, ids)
    assert np.array_equal(some_q, wq[ids]) and np.array_equal(some_d, wd[ids])


@pytest.mark.parametrize("q4", [False, True], ids=["q8", "q4"])
@pytest.mark.parametrize("n,k,m", CASES)
def test_gemm_strips_gives_the_same_bits_on_every_path_and_thread_count(q4, n, k, m):
    """Both paths do the vector kernel's float operations (one fused multiply-add per block), so
    they agree bit for bit; with a micro-kernel (strips_fast) they are the SIMD row route's bits,
    which is what lets an engine swap layouts without changing a token."""
    rng = np.random.default_rng(n + 7 * k + m)
    wq, wd = _weights(rng, n, k, q4)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, k)).astype(np.float32))
    ws = K.pack_strips(wq, wd, q4)
    want = K.gemm_strips(ws, n, k, q4, xq, xd, path="portable", threads=1)
    _check_gemm(want, wq, wd, xq, xd, q4)
    if K.strips_fast():
        rows = _rows_gemm(q4)(wq, wd, xq, xd, path="simd")
        assert np.array_equal(want.view(np.uint32), rows.view(np.uint32))
    for path in PATHS:
        for threads in (1, 2):
            y = K.gemm_strips(ws, n, k, q4, xq, xd, path=path, threads=threads)
            assert y.shape == (m, n) and y.dtype == np.float32
            assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (path, threads)


@pytest.mark.parametrize("q4", [False, True], ids=["q8", "q4"])
def test_the_numpy_twin_agrees_with_the_definition(q4):
    rng = np.random.default_rng(5)
    wq, wd = _weights(rng, 33, 64, q4)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((4, 64)).astype(np.float32))
    ws = reference.pack_strips(wq, wd, q4)
    want = (quant.gemm_q4_reference if q4 else quant.gemm_q8_reference)(wq, wd, xq, xd)
    out = np.empty((4, 33), np.float32)
    got = reference.gemm_strips(ws, 33, 64, q4, xq, xd, out=out)
    assert got is out
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(K.gemm_strips(ws, 33, 64, q4, xq, xd), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q4", [False, True], ids=["q8", "q4"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])          # the whole-strip tiles and the half-strip ones
def test_the_largest_products_are_exact(q4, m):
    """Weights at the int8 extremes, -128 included (q4: nibbles 0 and 15), against +-127 activations
    with unit scales: every output is a sum of int32 block dots, exact in float32, so the packed
    GEMM on every path must give the int64 sum itself (AVX2 takes |w| as maddubs' unsigned operand:
    2 * 128 * 127 must not saturate its int16 pair sums)."""
    rng = np.random.default_rng(11 + m)
    n, k = 41, 512                                   # two whole strips and a ragged one
    xq = rng.choice(np.array([-127, 127], np.int8), size=(m, k))
    if q4:
        wq = rng.choice(np.array([0x00, 0xff, 0x0f, 0xf0], np.uint8), size=(n, k // 2))
        w = quant.unpack_q4(wq)
    else:
        wq = rng.choice(np.array([-128, -127, 127], np.int8), size=(n, k))
        w = wq
    wd = np.ones((n, k // 32), np.float16)
    xd = np.ones((m, k // 32), np.float32)
    want = (xq.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32)
    ws = K.pack_strips(wq, wd, q4)
    for path in PATHS:
        assert np.array_equal(K.gemm_strips(ws, n, k, q4, xq, xd, path=path), want), path


def test_out_is_written_in_place_and_empty_batches_pass():
    rng = np.random.default_rng(2)
    wq, wd = _weights(rng, 20, 64, False)
    ws = K.pack_strips(wq, wd, False)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((3, 64)).astype(np.float32))
    out = np.full((3, 20), np.nan, np.float32)
    assert K.gemm_strips(ws, 20, 64, False, xq, xd, out=out) is out
    assert np.array_equal(out, K.gemm_q8(wq, wd, xq, xd))
    assert K.gemm_strips(ws, 20, 64, False, xq[:0], xd[:0]).shape == (0, 20)


def test_bad_strips_are_refused_with_a_message():
    rng = np.random.default_rng(3)
    wq, wd = _weights(rng, 20, 64, False)
    ws = K.pack_strips(wq, wd, False)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((2, 64)).astype(np.float32))
    with pytest.raises(ValueError, match="ws"):
        K.gemm_strips(ws[:-64], 20, 64, False, xq, xd)                # too short for 20 x 64
    with pytest.raises(ValueError, match="ws"):
        K.gemm_strips(ws, 40, 64, False, xq, xd)                      # strips of another shape
    shifted = np.empty(ws.nbytes + 64, np.uint8)
    start = (-shifted.ctypes.data) % 64 + 1                           # one byte past a line
    shifted = shifted[start:start + ws.nbytes]
    shifted[:] = ws
    with pytest.raises(ValueError, match="aligned"):
        K.gemm_strips(shifted, 20, 64, False, xq, xd)
    with pytest.raises(ValueError, match="xq"):
        K.gemm_strips(ws, 20, 64, False, xq[:, :32], xd)
    with pytest.raises(ValueError, match="K"):
        K.gemm_strips(ws, 20, 48, False, xq, xd)
    with pytest.raises(ValueError, match="wq"):
        K.pack_strips(wq.astype(np.float32), wd, False)
    with pytest.raises(ValueError, match="ws"):
        strips.unpack(ws[:-64], 20, 64, False)
    with pytest.raises(IndexError):
        strips.rows(ws, 20, 64, False, [20])


def test_strips_fast_names_the_cpu_s_micro_kernel():
    # vector micro-kernels exist for AVX512-VNNI and plain AVX2; elsewhere (NEON, the AVX-VNNI
    # variant, the row-route reference) packing would not pay
    assert K.strips_fast() == (K.gemm_variant() in ("avx512-vnni", "avx2"))
    assert reference.strips_fast() is False
