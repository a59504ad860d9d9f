"""Load through the real server with locust: N concurrent streaming chat users on a model.

    .venv/bin/python bench/load_test.py [--model DIR] [--users 32] [--seconds 60] [--max-tokens 32]

Starts `appliance serve` (the demo model by default), runs bench/locustfile.py headless
against it, and prints one table: streams completed per second, end-to-end latency of a
whole stream (p50, p99), refusals (503 with Retry-After: the queue was full) and failures
(anything else), with the load average before and after.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.live_server import Server  # noqa: E402

HERE = Path(__file__).resolve().parent


def run(model: Path | None, users: int, seconds: int, max_tokens: int, server_args: list[str]) -> dict:
    from appliance.engine import DEMO_MODEL_DIR
    server = Server(model or DEMO_MODEL_DIR, *server_args)
    try:
        out = Path(tempfile.mkdtemp(prefix="apl-locust-")) / "run"
        load_before = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless",
                        "-u", str(users), "-r", str(max(1, users // 4)), "-t", f"{seconds}s",
                        "--host", server.base, "--csv", str(out), "--only-summary", "--loglevel", "WARNING"],
                       check=False, env={**os.environ, "LOAD_MAX_TOKENS": str(max_tokens)},
                       stdout=subprocess.DEVNULL)
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{out}_stats.csv"))}
    finally:
        server.stop()
    streams = rows.get(("STREAM", "whole stream"), {})
    posts = rows.get(("POST", "chat stream"), {})
    refused = rows.get(("REFUSED", "503 retry-after"), {})
    return {"users": users, "seconds": seconds, "max_tokens": max_tokens,
            "completed": int(streams.get("Request Count", 0) or 0),
            "completed_per_s": float(streams.get("Requests/s", 0) or 0),
            "p50_s": float(streams.get("50%", 0) or 0) / 1e3, "p99_s": float(streams.get("99%", 0) or 0) / 1e3,
            "refused": int(refused.get("Request Count", 0) or 0),
            "failures": int(posts.get("Failure Count", 0) or 0),
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def table(r: dict) -> str:
    return "\n".join([
        f"locust: {r['users']} users streaming chats of {r['max_tokens']} tokens for {r['seconds']} s "
        f"(load average {r['load_before']:.1f} -> {r['load_after']:.1f})",
        "| completed | per second | p50 stream | p99 stream | refused (503) | failures |",
        "|---|---|---|---|---|---|",
        f"| {r['completed']} | {r['completed_per_s']:.2f} | {r['p50_s']:.2f} s | {r['p99_s']:.2f} s | "
        f"{r['refused']} | {r['failures']} |"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model directory (default: the demo model)")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    args, server_args = ap.parse_known_args()
    print(table(run(args.model, args.users, args.seconds, args.max_tokens, server_args)))


if __name__ == "__main__":
    main()
