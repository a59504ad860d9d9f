"""Fixtures of the aarch64 suite (tests/arm), run by `make test-arm` under qemu -cpu cortex-a76.

They run on any machine (the path and bit-exactness tests hold for AVX2 too); the tiny-model
test needs the reference that scripts/arm/make_reference.py computes on the host, found through
APPLIANCE_ARM_REFERENCE, and is skipped without it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from pathlib import Path

import numpy as np
import pytest

@pytest.fixture(scope="session")
def arm_reference():
    """(npz, model_dir) from the host, or skip."""
    path = os.environ.get("APPLIANCE_ARM_REFERENCE")
    if not path:
        pytest.skip("APPLIANCE_ARM_REFERENCE is not set (make test-arm computes it on the host)")
    npz = Path(path)
    if not npz.is_file():
        pytest.fail(f"APPLIANCE_ARM_REFERENCE={path} does not exist")
    return np.load(npz), npz.parent / "model"


class _PortableKernels:
    """appliance.kernels._kernels with every function that takes path="simd"|"portable" pinned to
    the portable C path (found by signature, so a new kernel cannot be missed)."""

    def __init__(self, real):
        self._real = real
        self._pinned = {}

    def __getattr__(self, name):
        if name not in self._pinned:
            fn = getattr(self._real, name)
            takes_path = callable(fn) and "path" in inspect.signature(fn).parameters
            self._pinned[name] = functools.partial(fn, path="portable") if takes_path else fn
        return self._pinned[name]


@pytest.fixture
def portable_engine_kernels():
    """Context manager: inside it the engine's forward runs on the portable C kernels."""
    from appliance.kernels import dispatch as ops

    real = ops.kernels

    @contextlib.contextmanager
    def swap():
        mods = [m for name, m in list(sys.modules.items())
                if name.startswith("appliance") and getattr(m, "kernels", None) is real]
        stand_in = _PortableKernels(real)
        for m in mods:
            m.kernels = stand_in
        try:
            yield
        finally:
            for m in mods:
                m.kernels = real

    return swap
