"""The `appliance` command as a user meets it: output, JSON, and one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json_on_demo_model():
    r = run("generate", "--prompt", "Hello", "--max-tokens", "5", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) <= 5 and out["prompt_token_ids"]
    assert out["prefill_tokens_per_s"] > 0 and out["decode_ms_per_token"] >= 0
    assert isinstance(out["text"], str)


def test_generate_same_seed_same_text(tiny_qwen3_dir):
    args = ("generate", "--model", str(tiny_qwen3_dir), "--chat", "Hi", "--max-tokens", "8",
            "--temperature", "1.0", "--seed", "7", "--json")
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_bench_json(tiny_qwen3_dir):
    r = run("bench", "--model", str(tiny_qwen3_dir), "--context", "16,64", "--gen", "4", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["exact"]["rows"]
    assert [row["context"] for row in rows] == [16, 64]
    assert all(row["decode_ms_per_token"] > 0 and 0 <= row["attn_share"] <= 1 for row in rows)
    # the rest of a step (outside GEMMs and attention) is part of it, never more
    assert all(0 < row["rest_ms_per_token"] < row["decode_ms_per_token"] and 0 < row["rest_share"] < 1
               for row in rows)
    assert rows[0]["kv_bytes_per_token_per_layer"] == 2 * 2 * (32 + 4)


def test_bench_compare_exact_prints_both_tables(tiny_qwen3_dir):
    r = run("bench", "--model", str(tiny_qwen3_dir), "--context", "100", "--gen", "3", "--sparse-attn",
            "--sparse-k", "2", "--compare-exact")
    assert r.returncode == 0, r.stderr
    assert "decode, median per token" in r.stdout and "prefill (time to first token)" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("generate", "--model", "/nonexistent/model", "--prompt", "x"), "not a directory"),
    (("generate", "--prompt", "x", "--weights", "q3"), "invalid choice"),
    (("generate", "--prompt", "x", "--max-tokens", "0"), "positive"),
    (("bench", "--context", "12,abc"), "comma-separated"),
    (("generate", "--prompt", "x", "--temperature", "-2"), "temperature"),
])
def test_bad_input_gives_one_line_error(args, needle):
    r = run(*args)
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_selftest_passes_here():
    r = run("selftest", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["threads"] >= 1 and report["checks"]


def test_profile_log_lines(tiny_qwen3_dir):
    import os
    env = dict(os.environ, APPLIANCE_PROFILE="1")
    r = subprocess.run([sys.executable, "-m", "appliance", "generate", "--model", str(tiny_qwen3_dir),
                        "--prompt", "Hello", "--max-tokens", "3"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[prefill] n=" in r.stderr and "[decode] n=" in r.stderr and "attn_ms=" in r.stderr


def test_serve_names_the_port_in_use_and_the_flag():
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run("serve", "--port", str(port), timeout=60)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and f"127.0.0.1:{port} is already in use" in line and "--port" in line


def test_home_relative_model_paths_expand(tiny_qwen3_dir, tmp_path, monkeypatch):
    import shutil

    from appliance import Engine
    from appliance.config import load_settings

    home = tmp_path / "home"
    shutil.copytree(tiny_qwen3_dir, home / "models" / "tiny", ignore=shutil.ignore_patterns(".appliance-cache"))
    monkeypatch.setenv("HOME", str(home))
    assert Engine.load("~/models/tiny", progress=False).model_dir == home / "models" / "tiny"
    settings_file = tmp_path / "appliance.yml"
    settings_file.write_text("model: ~/models/tiny\n")
    assert load_settings(str(settings_file), environ={}).model == str(home / "models" / "tiny")


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "eval", "selftest", "quantize"])
def test_every_help_text_renders(command):
    args = (command, "needle", "--help") if command == "eval" else (command, "--help")
    r = run(*args)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
