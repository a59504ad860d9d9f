"""Loading checkpoints: clear one-line errors, and the quantized cache's life cycle."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from appliance import Engine
from appliance.errors import ModelLoadError


@pytest.fixture
def model_copy(tiny_qwen3_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, dst, ignore=shutil.ignore_patterns(".appliance-cache"))
    return dst


def load_error(path, **kw) -> str:
    with pytest.raises(ModelLoadError) as info:
        Engine.load(path, progress=False, **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    assert "config.json: missing config.json" in load_error(model_copy)


def test_missing_tokenizer(model_copy):
    (model_copy / "tokenizer.json").unlink()
    assert "tokenizer.json" in load_error(model_copy)


def test_no_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    assert "no *.safetensors" in load_error(model_copy)


def test_truncated_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = load_error(model_copy)
    assert "model.safetensors" in message and "truncated" in message


def test_corrupt_header(model_copy):
    path = model_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json at!"
    path.write_bytes(bytes(data))
    assert "corrupt safetensors header" in load_error(model_copy)


def test_unknown_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "llama9"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert "unknown model_type 'llama9'" in load_error(model_copy)


def test_wrong_tensor_shape(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] = 160
    (model_copy / "config.json").write_text(json.dumps(cfg))
    message = load_error(model_copy)
    assert "model.safetensors" in message and "shape" in message


def test_missing_shard(model_factory, tmp_path):
    src = model_factory("sharded", max_shard_size="100KB", seed=5)
    dst = tmp_path / "m"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".appliance-cache"))
    shard = sorted(dst.glob("model-*.safetensors"))[0]
    shard.unlink()
    assert "missing shard" in load_error(dst)


def test_cache_written_reused_and_invalidated(model_copy):
    first = Engine.load(model_copy, weights="q8", progress=False)
    caches = list((model_copy / ".appliance-cache").glob("q8-*.safetensors"))
    assert len(caches) == 1
    mtime = caches[0].stat().st_mtime_ns
    ids = [5, 6, 7, 8]
    expected = first.logits(ids)

    second = Engine.load(model_copy, weights="q8", progress=False)
    assert caches[0].stat().st_mtime_ns == mtime          # mapped, not rewritten
    np.testing.assert_array_equal(second.logits(ids), expected)

    # A changed source file gives a new key: requantized, the stale file removed.
    st = (model_copy / "model.safetensors").stat()
    os.utime(model_copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    Engine.load(model_copy, weights="q8", progress=False)
    fresh = list((model_copy / ".appliance-cache").glob("q8-*.safetensors"))
    assert len(fresh) == 1 and fresh[0].name != caches[0].name


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_the_cache_holds_the_order_this_machine_reads_and_both_orders_agree(model_copy, monkeypatch, fmt):
    from appliance.weights import linear, loader
    from appliance.weights.safetensors_io import SafetensorsFile

    ids = [5, 6, 7, 8, 9]
    monkeypatch.setenv("APPLIANCE_GEMM_STRIPS", "0")
    rows = Engine.load(model_copy, weights=fmt, progress=False)
    monkeypatch.setenv("APPLIANCE_GEMM_STRIPS", "1")
    native = Engine.load(model_copy, weights=fmt, progress=False)
    caches = sorted(p.name for p in (model_copy / ".appliance-cache").glob(f"{fmt}-*.safetensors"))
    order = loader.cache_order()
    assert order == ("strips" if linear.strips_wanted() else "rows")
    assert len(caches) == (2 if order == "strips" else 1)         # one file per order, both kept
    names = SafetensorsFile(native.weight_cache.path).keys()
    assert any(n.endswith(".ws") for n in names) == (order == "strips")
    assert not any(n.endswith(".qs") for n in names) or order == "rows"
    down = native.model.layers[0].mlp.mlp.down
    assert (down.ws is not None) == (order == "strips") and down.n_in == rows.model.layers[0].mlp.mlp.down.n_in
    np.testing.assert_array_equal(native.logits(ids), rows.logits(ids))


def test_read_only_model_dir_caches_elsewhere(model_copy, tmp_path, monkeypatch):
    if os.geteuid() == 0:
        # root ignores permission bits; simulate a read-only dir by making the cache path a file
        (model_copy / ".appliance-cache").write_text("not a directory")
    else:
        model_copy.chmod(0o555)
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cachedir"))
    Engine.load(model_copy, weights="q4", progress=False)
    assert list((tmp_path / "cachedir").rglob("q4-*.safetensors"))
