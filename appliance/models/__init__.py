"""Model families by config.json's model_type. Adding a family adds a file and a line here."""
from __future__ import annotations

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
