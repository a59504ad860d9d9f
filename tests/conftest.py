"""Session fixtures shared by every test package: tiny random Qwen3 checkpoints.

Each is built once per session with transformers (seconds) under pytest's
session temp dir, so a test run never depends on files left by an earlier one.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_qwen3  # noqa: E402

# One OpenMP pool, small: the machines are shared and the tiny models gain nothing from more.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """build(name, **shape) -> directory of a saved random Qwen3 checkpoint (cached per session)."""
    built: dict[str, Path] = {}

    def build(name: str, **kwargs) -> Path:
        if name not in built:
            built[name] = build_qwen3(tmp_path_factory.mktemp(name), **kwargs)
        return built[name]

    return build


@pytest.fixture(scope="session")
def tiny_qwen3_dir(model_factory) -> Path:
    """The default tiny model: hidden 64, 2 layers, 4 q heads / 2 kv heads, head_dim 32."""
    return model_factory("tiny_qwen3")
