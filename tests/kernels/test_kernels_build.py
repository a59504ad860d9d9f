"""What the build is: path, CPU support, thread setting, fp16 helpers."""
import os
import platform

import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import reference


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_kernel_path_is_the_best_for_this_cpu():
    path = K.kernel_path()
    assert path in ("avx2", "neon-dotprod", "neon", "portable")
    if os.environ.get("APPLIANCE_PORTABLE") == "1":
        assert path == "portable"
    elif platform.machine() in ("x86_64", "AMD64"):
        flags = _cpu_flags()
        want = "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable"
        # A machine without AVX2 cannot run an AVX2 build's tests at all; no march override either.
        if not os.environ.get("APPLIANCE_MARCH"):
            assert path == want
    elif platform.machine() == "aarch64" and not os.environ.get("APPLIANCE_MARCH"):
        assert path == "neon-dotprod"


def test_cpu_supported_and_features():
    assert K.cpu_supported() is True
    feats = K.cpu_features()
    assert isinstance(feats, str)
    if K.kernel_path() == "avx2":
        assert {"avx2", "fma", "f16c"} <= set(feats.split())
    if K.kernel_path() == "neon-dotprod":
        assert {"asimd", "asimddp"} <= set(feats.split())


def test_threads_roundtrip():
    old = K.get_threads()
    try:
        K.set_threads(1)
        assert K.get_threads() == 1
        K.set_threads(3)
        assert K.get_threads() == 3
        with pytest.raises(ValueError):
            K.set_threads(0)
    finally:
        K.set_threads(old)


def test_fp16_to_fp32_all_halves():
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(reference.fp16_to_fp32(bits).view(np.uint32), want.view(np.uint32))   # the twin
    got = K.fp16_to_fp32(bits)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_fp32_to_fp16_rounds_like_numpy():
    rng = np.random.default_rng(0)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves)]
    # exact halves, the midpoints between neighbours (ties to even), random values of all scales
    mids = ((halves[:-1].astype(np.float64) + halves[1:]) / 2).astype(np.float32)
    rand = (rng.standard_normal(20000) * np.exp2(rng.integers(-30, 20, 20000))).astype(np.float32)
    special = np.array([0.0, -0.0, 65504.0, 65520.0, 1e9, -1e9, np.inf, -np.inf, 6e-8, 3e-8],
                       np.float32)
    x = np.concatenate([halves, mids, rand, special]).astype(np.float32)
    got = K.fp32_to_fp16(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)
    assert np.array_equal(reference.fp32_to_fp16(x), want)                     # the twin
    assert np.isnan(K.fp32_to_fp16(np.array([np.nan], np.float32)).view(np.float16)[0])
