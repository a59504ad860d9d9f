"""The quantized weight cache cannot serve wrong weights: checksums, versions, one writer,
atomic replacement, a full disk, and config.json against the tensors. Real files and real
processes throughout (no filesystem mocks)."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from appliance import Engine
from appliance.errors import ModelLoadError
from appliance.weights.safetensors_io import SafetensorsFile

REPO = Path(__file__).resolve().parents[1]
IDS = [5, 6, 7, 8, 9, 10]


@pytest.fixture
def model_copy(tiny_qwen3_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, dst, ignore=shutil.ignore_patterns(".appliance-cache"))
    return dst


@pytest.fixture
def reference(model_copy):
    """Logits from a freshly written cache, and that cache's path."""
    engine = Engine.load(model_copy, weights="q8", progress=False)
    assert engine.weight_cache.built and not engine.weight_cache.rejected
    return engine.logits(IDS), Path(engine.weight_cache.path)


def flip_byte_of(path: Path, tensor: str, offset: int = 0) -> None:
    f = SafetensorsFile(path)
    begin = f._data_start + f._entries[tensor]["data_offsets"][0] + offset
    del f
    with open(path, "r+b") as out:
        out.seek(begin)
        byte = out.read(1)
        out.seek(begin)
        out.write(bytes([byte[0] ^ 0x10]))


def stored_at(path: Path, tensor: str, offset: int) -> tuple[str, int]:
    """Where a q8 cache holds byte `offset` of `tensor` (named as in the row layout: X.qs, X.d):
    there, or in a cache in strips inside X.ws, among a strip's weights or its scales after them."""
    from appliance.weights import loader
    if loader.cache_order() == "rows":
        return tensor, offset
    base, part = tensor.rsplit(".", 1)
    strip_bytes = SafetensorsFile(path)._entries[base + ".ws"]["shape"][1]
    blocks = strip_bytes // (512 + 32)                # a q8 block: 512 weight bytes, 16 fp16 scales
    return base + ".ws", offset if part == "qs" else blocks * 512 + offset


@pytest.mark.parametrize("tensor", ["embed.d", "embed.qs", "0.qkv.d", "1.down.qs"])
def test_a_flipped_byte_is_detected_and_the_cache_rebuilt(model_copy, reference, tensor, caplog):
    expected, path = reference
    tensor, offset = stored_at(path, tensor, 3)
    flip_byte_of(path, tensor, offset=offset)
    engine = Engine.load(model_copy, weights="q8", progress=False)
    report = engine.weight_cache
    assert report.built and [kind for _, kind, _ in report.rejected] == ["corrupt"]
    assert tensor in report.rejected[0][2]
    assert any("not used (corrupt" in r.message for r in caplog.records)
    np.testing.assert_array_equal(engine.logits(IDS), expected)
    assert not SafetensorsFile(path).corrupt_tensors()


def test_truncated_foreign_and_other_build_caches_are_rebuilt(model_copy, reference, tmp_path):
    expected, path = reference
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])                       # a power cut without atomic rename
    e = Engine.load(model_copy, weights="q8", progress=False)
    assert [k for _, k, _ in e.weight_cache.rejected] == ["unreadable"]
    np.testing.assert_array_equal(e.logits(IDS), expected)

    # Another model's cache under this model's key: its identity says so.
    other = tmp_path / "other"
    shutil.copytree(model_copy, other, ignore=shutil.ignore_patterns(".appliance-cache"))
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg, indent=1))   # another identity
    foreign = Path(Engine.load(other, weights="q8", progress=False).weight_cache.path)
    shutil.copy(foreign, path)
    e = Engine.load(model_copy, weights="q8", progress=False)
    assert [k for _, k, why in e.weight_cache.rejected] == ["foreign"] and "identity" in e.weight_cache.rejected[0][2]
    np.testing.assert_array_equal(e.logits(IDS), expected)

    # A cache written by a different quantizer (another build of the appliance).
    from appliance.weights import loader
    real = loader.quantizer_fingerprint
    try:
        loader.quantizer_fingerprint = lambda: "0123456789abcdef"
        e = Engine.load(model_copy, weights="q8", progress=False)
        assert "quantizer" in e.weight_cache.rejected[0][2] and e.weight_cache.built
    finally:
        loader.quantizer_fingerprint = real
    e = Engine.load(model_copy, weights="q8", progress=False)
    assert e.weight_cache.built and "quantizer" in e.weight_cache.rejected[0][2]   # back to this build's


LOAD = """
import sys, json
from appliance import Engine
e = Engine.load(sys.argv[1], weights="q8", progress=False)
print(json.dumps({"logits": e.logits([5, 6, 7, 8, 9, 10]).tolist(), "built": e.weight_cache.built,
                  "path": e.weight_cache.path}))
"""


def run_loads(model_dir: Path, n: int, home: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(home), OMP_NUM_THREADS="1")
    env.pop("APPLIANCE_CACHE_DIR", None)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD, str(model_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout.splitlines()[-1]))
    return out


def test_concurrent_first_loads_write_one_cache_and_agree(model_copy, tmp_path):
    results = run_loads(model_copy, 4, tmp_path / "home")
    assert sum(r["built"] for r in results) == 1                    # one writer; the others mapped its file
    assert len({r["path"] for r in results}) == 1
    first = np.array(results[0]["logits"])
    for r in results[1:]:
        np.testing.assert_array_equal(np.array(r["logits"]), first)
    cache = model_copy / ".appliance-cache"
    assert [p.name for p in cache.glob("*.safetensors*") if not p.name.endswith(".lock")] == [Path(results[0]["path"]).name]
    assert not (tmp_path / "home" / ".cache").exists()              # never a second copy elsewhere


def test_a_writer_killed_at_any_point_leaves_no_mix(model_copy, tmp_path):
    """Kill the quantizing process at random moments: a later load either finds no cache or a
    complete one, never maps a partial file, and always computes the right logits."""
    want = Engine.load(model_copy, weights="f32", progress=False)   # f32: no cache involved
    q8 = None
    rng = random.Random(7)
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path), OMP_NUM_THREADS="1")
    for _ in range(6):
        shutil.rmtree(model_copy / ".appliance-cache", ignore_errors=True)
        p = subprocess.Popen([sys.executable, "-c", LOAD, str(model_copy)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 2.0))
        p.send_signal(signal.SIGKILL)
        p.wait()
        files = [f for f in (model_copy / ".appliance-cache").glob("*.safetensors")]
        for f in files:                                            # what is there under the final name is whole
            assert not SafetensorsFile(f).corrupt_tensors()
        e = Engine.load(model_copy, weights="q8", progress=False)
        assert not e.weight_cache.rejected
        q8 = e.logits(IDS) if q8 is None else q8
        np.testing.assert_array_equal(e.logits(IDS), q8)
        assert not list((model_copy / ".appliance-cache").glob("*.partial.*"))   # leftovers cleaned
    scale = np.abs(want.logits(IDS)).max()
    assert np.abs(q8 - want.logits(IDS)).max() < 0.1 * scale


def test_a_full_disk_is_one_line_and_the_model_still_loads(model_copy, tmp_path, caplog):
    mount = tmp_path / "small"
    mount.mkdir()
    size = sum(f.stat().st_size for f in model_copy.iterdir()) + 64 * 1024
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        small = mount / "model"
        shutil.copytree(model_copy, small)
        engine = Engine.load(small, weights="q8", progress=False)
        assert engine.weight_cache.path is None                     # quantized into memory
        lines = [r.message for r in caplog.records if "no room for the weight cache" in r.message]
        assert len(lines) == 1 and str(small / ".appliance-cache") in lines[0] and "bytes needed" in lines[0]
        assert "\n" not in lines[0]
        fresh = Engine.load(model_copy, weights="q8", progress=False)
        np.testing.assert_array_equal(engine.logits(IDS), fresh.logits(IDS))
        assert not list((small / ".appliance-cache").glob("*.partial.*"))
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_config_with_fewer_layers_than_the_checkpoint_is_refused(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["num_hidden_layers"] = cfg["num_hidden_layers"] - 1
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as info:
        Engine.load(model_copy, progress=False)
    message = str(info.value)
    assert "\n" not in message and "config.json" in message
    assert f"declares {cfg['num_hidden_layers']} layers" in message and "model.layers.1." in message


def test_selftest_verifies_the_served_models_cache(model_copy, reference):
    _, path = reference
    cmd = [sys.executable, "-m", "appliance", "selftest", "--model", str(model_copy), "--weights", "q8", "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ok = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    report = json.loads(ok.stdout)
    assert report["weight_cache"]["ok"] and report["weight_cache"]["path"] == str(path)
    tensor, offset = stored_at(path, "0.o.qs", 1)
    flip_byte_of(path, tensor, offset=offset)
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert not report["weight_cache"]["ok"] and tensor in report["weight_cache"]["problem"]


def test_the_loader_reports_its_stages(model_copy):
    seen = []
    Engine.load(model_copy, weights="q8", progress=False, on_progress=lambda *a: seen.append(a))
    stages = [s for s, _, _ in seen]
    total = seen[0][2]
    assert stages[0] == "reading" and stages[1:] == ["quantizing"] * (total + 1)
    assert [d for s, d, _ in seen if s == "quantizing"] == list(range(total + 1))
    seen.clear()
    Engine.load(model_copy, weights="q8", progress=False, on_progress=lambda *a: seen.append(a))
    assert [s for s, _, _ in seen] == ["reading", "verifying"]          # the cache maps: no quantizing
