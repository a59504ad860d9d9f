"""32 concurrent streaming chat users (locust, bench/load_test.py) on the demo model through the
real server: every stream either completes or is refused with 503 + Retry-After; none fails."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_32_streaming_users_see_no_failure():
    import importlib.util
    # Never imported here: locust's gevent patches the whole process it is imported in.
    assert importlib.util.find_spec("locust"), "locust is in requirements-test.txt"
    from bench.load_test import run, table

    result = run(None, users=32, seconds=20, max_tokens=16, server_args=["--max-batch", "8", "--max-queue", "16"])
    print(table(result))
    assert result["failures"] == 0 and result["completed"] > 0
