"""pytest plugin for the emulated aarch64 run (`-p emulation`, loaded by scripts/arm/test_arm.sh).

The arm64 root has numpy, tokenizers, jinja2, pytest and hypothesis, but not torch or
transformers (the references that need them are computed on the host before the run). So:
  * a test module that imports torch/transformers at module level is not collected;
  * a test that needs a checkpoint built by transformers (the model_factory / tiny_qwen3_dir
    fixtures of tests/conftest.py) is skipped, with the reason said.
On a machine that has torch this plugin changes nothing.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
TORCH_IMPORT = re.compile(r"^(import|from)\s+(torch|transformers)\b", re.M)
TORCH_FIXTURES = {"model_factory", "tiny_qwen3_dir"}


def pytest_ignore_collect(collection_path: Path, config):
    if HAVE_TORCH or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        source = collection_path.read_text()
    except OSError:
        return None
    return True if TORCH_IMPORT.search(source) else None


def pytest_runtest_setup(item):
    if not HAVE_TORCH and TORCH_FIXTURES & set(getattr(item, "fixturenames", ())):
        pytest.skip("needs torch/transformers to build its checkpoint (not in the emulated arm64 root)")


def pytest_report_header(config):
    return f"emulation plugin: torch {'available' if HAVE_TORCH else 'absent: torch-dependent tests skipped'}"
