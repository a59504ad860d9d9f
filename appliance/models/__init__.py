"""Model families by config.json's model_type. Adding a family adds a file and a line here."""
from __future__ import annotations

import json
from pathlib import Path

from appliance.errors import ModelLoadError
from appliance.models import qwen3
from appliance.models import qwen3_moe
from appliance.models import qwen3_vl

FAMILIES = {
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "qwen3_vl": qwen3_vl,
}


def family_for(model_type: str | None, config_path):
    try:
        return FAMILIES[model_type]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise ModelLoadError(config_path, f"unknown model_type {model_type!r} (supported: {known})") from None


def read_family(model_dir: Path):
    """(family module, its parsed config, the raw config.json dict) of a checkpoint directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(model_dir, "not a directory")
    config_path = model_dir / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(config_path, "missing config.json") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(config_path, f"unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(config_path, "not a JSON object")
    family = family_for(raw.get("model_type"), config_path)
    return family, family.Config.from_dict(raw, config_path), raw
