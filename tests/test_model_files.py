"""The fleet's model-file list (appliance/weights/manifest.py, `appliance model-files`): it names
every file the engine opens while it loads a checkpoint and serves from it, traced for real with
an audit hook in a fresh process, for a chat model, a sentence-transformers embedding export
(module configs in a subdirectory), a Qwen3-VL checkpoint and the embedded demo model.

The tokenizer's own read of tokenizer.json happens in Rust (no Python audit event): the list
names that file unconditionally, and a checkpoint without it is refused."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from appliance.errors import ModelLoadError
from appliance.weights.manifest import checkpoint_file_names
from tiny_models_chat import build_qwen3_chat
from tiny_models_retrieval import build_qwen3_embedding, build_st_saved_embedding
from tiny_models_vl import build_qwen3_vl

DEMO = Path(__file__).resolve().parents[1] / "appliance" / "demo_model"

# Loads the checkpoint as `serve` would, uses every part of it (chat template, sampling defaults,
# images or pooling), and prints the files opened under it.
TRACE = r"""
import json, os, sys
root = os.path.realpath(sys.argv[1])
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        p = os.path.realpath(os.fsdecode(args[0]))
        if p.startswith(root + os.sep) and ".appliance-cache" not in p:
            opened.add(os.path.relpath(p, root))
sys.addaudithook(hook)
from appliance import Engine
from appliance.engine.pooling import checkpoint_task
task = checkpoint_task(root)
engine = Engine.load(root, progress=False, max_context=256)
if task == "embed":
    engine.embed([engine.tokenizer.encode("hello board")])
else:
    tok = engine.tokenizer
    text = (tok.apply_chat_template([{"role": "user", "content": "hi"}]) if tok.chat_template_source
            else "hello")
    engine.generate(tok.encode(text), stream=False, max_tokens=2)
print(json.dumps(sorted(opened)))
"""


def traced_reads(model_dir: Path) -> set[str]:
    out = subprocess.run([sys.executable, "-c", TRACE, str(model_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("model_files")
    embed = build_qwen3_embedding(base / "embed-source")
    return {
        "chat": build_qwen3_chat(base / "chat"),
        "st-embedding": build_st_saved_embedding(embed, base / "st-embedding", "mean", True),
        "vl": build_qwen3_vl(base / "vl"),
        "demo": DEMO,
    }


@pytest.mark.parametrize("kind", ["chat", "st-embedding", "vl", "demo"])
def test_the_list_names_every_file_a_load_and_a_request_open(checkpoints, kind):
    model_dir = checkpoints[kind]
    listed = set(checkpoint_file_names(model_dir))
    read = traced_reads(model_dir)
    assert "config.json" in read and any(n.endswith(".safetensors") for n in read)   # the trace works
    assert read <= listed, f"opened but not shipped: {sorted(read - listed)}"
    assert "tokenizer.json" in listed
    if kind == "st-embedding":
        assert {"modules.json", "1_Pooling/config.json"} <= read
    if kind == "vl":
        assert "preprocessor_config.json" in listed
    if kind == "demo":
        assert "train_log.txt" not in listed            # shipped in the package, never read


def test_cli_prints_the_roles_variable_with_checksums(checkpoints, tmp_path):
    model_dir = checkpoints["chat"]
    out = subprocess.run([sys.executable, "-m", "appliance", "model-files", str(model_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    assert doc["appliance_model_name"] == model_dir.name
    files = doc["appliance_model_files"]
    assert [f["name"] for f in files] == checkpoint_file_names(model_dir)
    for f in files:
        data = (model_dir / f["name"]).read_bytes()
        assert f["sha256"] == hashlib.sha256(data).hexdigest() and f["size"] == len(data)
    as_json = subprocess.run([sys.executable, "-m", "appliance", "model-files", str(model_dir), "--json"],
                             capture_output=True, text=True, timeout=60)
    assert json.loads(as_json.stdout) == files


def test_a_broken_checkpoint_is_one_line_and_a_non_zero_exit(checkpoints, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        checkpoint_file_names(broken)
    for target in (broken, tmp_path / "absent"):
        out = subprocess.run([sys.executable, "-m", "appliance", "model-files", str(target)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stdout == ""
        assert len(out.stderr.strip().splitlines()) == 1 and "appliance model-files: error:" in out.stderr


def test_a_shard_the_index_names_must_be_there(checkpoints, tmp_path):
    import shutil
    copy = shutil.copytree(checkpoints["chat"], tmp_path / "sharded")
    (copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00001-of-00002"):
        checkpoint_file_names(copy)
