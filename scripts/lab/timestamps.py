#!/usr/bin/env python3
"""Prefixes every line of stdin with the seconds since start (for playbook logs)."""
import sys
import time

t0 = time.monotonic()
for line in sys.stdin:
    sys.stdout.write(f"[{time.monotonic() - t0:7.1f}s] {line}")
    sys.stdout.flush()
