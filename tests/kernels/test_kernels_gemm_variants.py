"""The GEMM's micro-kernels (kernels.h gemm_variant): prefill-sized products (M >= 32) run a packed
route whose micro-kernel depends on the CPU (avx-vnni, avx512-vnni, avx2, sdot), and on x86 with
VNNI decode-sized ones (M < 32) run that variant's row tiles (kernels/gemm_rows.h). Every one must
give the bits of the row route on AVX2's tile ("rows"): a prompt row and a decoded row, alone or in
a batch, are computed alike. "avx2-vnni-emulated" runs the vpdpbusd kernels' code and packing on any AVX2 CPU, so they are
held to this here too; on a CPU with VNNI the real ones are in gemm_variants() and are tested alike.
"""
import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import quant

from kernel_cases import gemm_abs_bound
from test_kernels_gemm import GEMM_RTOL

VARIANTS = K.gemm_variants()


@pytest.fixture
def variant():
    """Restores the default micro-kernel after a test that switched it."""
    default = K.gemm_variant()
    yield
    K.set_gemm_variant(default)


def _case(rng, fmt, m, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    wq, wd = quant.quantize_q8_0(w) if fmt == "q8" else quant.quantize_q4_0(w)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1, : k // 2] *= 40.0                       # blocks of very different scales
    xq, xd = quant.quantize_rows_q8(x)
    return wq, wd, xq, xd


def _gemm(fmt):
    return K.gemm_q8 if fmt == "q8" else K.gemm_q4


def test_the_default_is_one_this_cpu_runs_and_rows_is_always_there():
    assert VARIANTS[0] == "rows" and K.gemm_variant() in VARIANTS
    if K.kernel_path() == "avx2":
        assert {"avx2", "avx2-vnni-emulated"} <= set(VARIANTS)
        assert K.gemm_variant() != "avx2-vnni-emulated"     # a test aid, never chosen by itself
    if K.kernel_path() == "neon-dotprod":
        assert K.gemm_variant() == "sdot"


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("m,n,k", [(32, 67, 256), (70, 8, 1024), (133, 1029, 128),
                                   # decode-sized: row tiles of 1-4 rows, strips cut by chunks and by N
                                   (2, 1029, 128), (5, 67, 256), (8, 4100, 64), (31, 13, 1024)])
def test_every_variant_gives_the_row_routes_bits(variant, fmt, m, n, k):
    rng = np.random.default_rng(m * 7 + n + (fmt == "q4"))
    wq, wd, xq, xd = _case(rng, fmt, m, n, k)
    gemm = _gemm(fmt)
    K.set_gemm_variant("rows")
    rows = np.concatenate([gemm(wq, wd, xq[i:i + 1], xd[i:i + 1]) for i in range(m)])
    assert np.array_equal(gemm(wq, wd, xq, xd).view(np.uint32), rows.view(np.uint32))
    bound = gemm_abs_bound(wq, wd, xq, xd, q4=fmt == "q4")
    port = gemm(wq, wd, xq, xd, path="portable")
    assert (np.abs(rows.astype(np.float64) - port) <= GEMM_RTOL * bound + 1e-30).all()
    for name in VARIANTS[1:]:
        K.set_gemm_variant(name)
        for threads in (1, 2):
            got = gemm(wq, wd, xq, xd, threads=threads)
            assert np.array_equal(got.view(np.uint32), rows.view(np.uint32)), (name, threads)
            one = gemm(wq, wd, xq[-1:], xd[-1:], threads=threads)       # one row: gemm_tile again
            assert np.array_equal(one.view(np.uint32), rows[-1:].view(np.uint32)), (name, threads)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("m,n", [(40, 19), (8, 41)], ids=["packed", "row tiles"])   # 41: 16-, 16-, 8-row strips
def test_every_variant_is_exact_on_the_largest_products(variant, fmt, m, n):
    """+-127 everywhere (the q4 nibbles 0 and 15) with unit scales: each output is a sum of int32 block
    dots, exact in float32, so every kernel must give exactly the int64 numpy sum."""
    rng = np.random.default_rng(3)
    k = 512
    xq = rng.choice(np.array([-127, 127], np.int8), size=(m, k))
    if fmt == "q8":
        wq = rng.choice(np.array([-127, 127], np.int8), size=(n, k))
        w = wq
    else:
        wq = rng.choice(np.array([0x00, 0xff, 0x0f, 0xf0], np.uint8), size=(n, k // 2))
        w = quant.unpack_q4(wq)
    wd = np.ones((n, k // 32), np.float16)
    xd = np.ones((m, k // 32), np.float32)
    want = (xq.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32)
    for name in VARIANTS:
        K.set_gemm_variant(name)
        assert np.array_equal(_gemm(fmt)(wq, wd, xq, xd), want), name


def test_unknown_variant_is_refused(variant):
    with pytest.raises(ValueError, match="is not one this build and CPU run"):
        K.set_gemm_variant("avx1024")
    if "avx-vnni" not in VARIANTS:
        with pytest.raises(ValueError, match="avx-vnni"):
            K.set_gemm_variant("avx-vnni")
