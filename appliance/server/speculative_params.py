"""The `speculative` request field (chat and completions) and the server's default for it.

    "speculative": {"method": "prompt_lookup", "num_tokens": 4, "ngram_min": 2, "ngram_max": 4}

Drafts the next tokens from the prompt and the answer so far and verifies them in the same
forward pass (engine/speculative.py); the output is the same as without. Fields left out take
the server's `--spec-prompt-lookup K` (num_tokens) and the engine's defaults; `false` turns it
off for one request when the server has it on. Every problem is a 400 naming the field.
"""
from __future__ import annotations

from typing import Any

from appliance.engine.speculative import MAX_DRAFT_TOKENS, MAX_NGRAM, SpeculativeConfig
from appliance.server.chat import bad, kind

SERVED_METHODS = ("prompt_lookup",)
FIELDS = ("method", "num_tokens", "ngram_min", "ngram_max")


def server_default(settings) -> SpeculativeConfig | None:
    """What every request gets unless it says otherwise: --spec-prompt-lookup K (0: off)."""
    k = getattr(settings, "spec_prompt_lookup", 0) or 0
    return SpeculativeConfig(num_tokens=k) if k else None


def parse(body: dict, serving=None) -> SpeculativeConfig | None:
    """The request's speculative decoding (serving: the ServingDefaults with the server's default)."""
    default = getattr(serving, "speculative", None)
    value = body.get("speculative")
    if value is None:
        return default
    if value is False:
        return None
    if not isinstance(value, dict):
        raise bad("speculative", f"expected an object or false, got {kind(value)}", "invalid_type")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise bad(f"speculative.{unknown[0]}", f"unknown field (known: {', '.join(FIELDS)})")
    method = value.get("method", "prompt_lookup")
    if method not in SERVED_METHODS:
        raise bad("speculative.method", f"expected one of {', '.join(SERVED_METHODS)}, got {method!r}")
    base = default or SpeculativeConfig()
    fields = {"num_tokens": _int(value, "num_tokens", 1, MAX_DRAFT_TOKENS, base.num_tokens),
              "ngram_min": _int(value, "ngram_min", 1, MAX_NGRAM, base.ngram_min),
              "ngram_max": _int(value, "ngram_max", 1, MAX_NGRAM, base.ngram_max)}
    if fields["ngram_min"] > fields["ngram_max"]:
        which = "ngram_min" if "ngram_min" in value else "ngram_max"
        raise bad(f"speculative.{which}", f"ngram_min ({fields['ngram_min']}) is more than ngram_max "
                                          f"({fields['ngram_max']})")
    return SpeculativeConfig(method=method, **fields)


def _int(value: dict, name: str, lo: int, hi: int, default: int) -> int:
    v: Any = value.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"speculative.{name}", f"expected an integer, got {kind(v)}", "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"speculative.{name}", f"{v} is out of range [{lo}, {hi}]")
    return v
