"""Every file the engine reads from a checkpoint directory, with its size and SHA-256.

A board that gets only some of a checkpoint's files fails late and confusingly (no chat template:
raw prompts; no generation_config.json: other sampling defaults; a missing shard: a load error
after the release went live). The fleet ships exactly this list and checks every checksum on the
board (`appliance model-files DIR` prints it as the role's `appliance_model_files`).

Kept beside the readers it mirrors: tokenizer.py (tokenizer.json, tokenizer_config.json,
chat_template.jinja), engine.py (generation_config.json), models/ (config.json, the shards and
their index), models/images.py (preprocessor_config.json), engine/pooling.py (modules.json and
the module configs it names). tests/test_model_files.py traces a real load and fails when a reader
opens a file this list does not name.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import ModelLoadError

# Read when present; the engine has defaults (or a clear error) without them.
OPTIONAL = ("model.safetensors.index.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "preprocessor_config.json", "modules.json")
REQUIRED = ("config.json", "tokenizer.json")


@dataclass(frozen=True)
class ModelFile:
    name: str          # relative to the checkpoint directory, "/"-separated
    size: int
    sha256: str


def checkpoint_file_names(model_dir: Path) -> list[str]:
    """The relative names of the files the engine reads from `model_dir`, sorted."""
    model_dir = Path(model_dir)
    names = set()
    for name in REQUIRED:
        if not (model_dir / name).is_file():
            raise ModelLoadError(model_dir / name, "missing (every checkpoint needs it)")
        names.add(name)
    names.update(n for n in OPTIONAL if (model_dir / n).is_file())
    names.update(_shards(model_dir))
    names.update(_sentence_transformers_configs(model_dir))
    return sorted(names)


def checkpoint_files(model_dir: Path) -> list[ModelFile]:
    model_dir = Path(model_dir)
    return [ModelFile(name, (model_dir / name).stat().st_size, _sha256(model_dir / name))
            for name in checkpoint_file_names(model_dir)]


def _shards(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(index, f"unreadable shard index ({e})") from None
        for name in names:
            if not (model_dir / name).is_file():
                raise ModelLoadError(model_dir / name, "missing shard named in model.safetensors.index.json")
        return names
    names = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not names:
        raise ModelLoadError(model_dir, "no *.safetensors weights found")
    return names


def _sentence_transformers_configs(model_dir: Path) -> list[str]:
    """The config.json of each module modules.json names (pooling.py reads the Pooling one)."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"unreadable ({e})") from None
    out = []
    for m in modules if isinstance(modules, list) else []:
        if not isinstance(m, dict):
            continue
        pooling = str(m.get("type", "")).endswith("Pooling")
        sub = str(m.get("path") or ("1_Pooling" if pooling else ""))
        if sub and (model_dir / sub / "config.json").is_file():
            out.append(f"{sub}/config.json")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
