"""What the commands share: argument types, and the engine flags (derived from the settings'
definitions in appliance/config.py, so they are the same as `appliance serve`'s)."""
from __future__ import annotations

import argparse

from appliance.config import add_setting_flags, settings_from_flags

MODEL_HELP = "Hugging Face checkpoint directory (default: the embedded demo model)"
# The settings that say how an engine is loaded: the engine flags of generate, bench and eval.
ENGINE_KEYS = ("model", "weights", "kv", "threads", "max_context", "sparse_attn", "sparse_k", "sparse_block",
               "sparse_probe", "sparse_probe_mode")


def int_list(text: str) -> list[int]:
    """argparse type: "128,1024,4096" -> [128, 1024, 4096] (positive integers)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p, ENGINE_KEYS)


def engine_settings(args, keys=ENGINE_KEYS):
    """The engine flags as validated Settings: defaults beneath them, no settings file or
    environment (those configure the server)."""
    return settings_from_flags(args, keys, environ={})


def sparse_config(args, k: int | None = None):
    """The SparseConfig the flags ask for (None without --sparse-attn, unless k is forced)."""
    from appliance.options import SparseConfig
    s = engine_settings(args)
    if not s.sparse_attn and k is None:
        return None
    return SparseConfig(k=k or s.sparse_k, block=s.sparse_block, probe=s.sparse_probe,
                        probe_mode=s.sparse_probe_mode)


def load_engine(args, sparse="flags", **extra):
    from appliance.engine import Engine
    s = engine_settings(args)
    return Engine.load(s.model, weights=s.weights, kv=s.kv, threads=s.threads, max_context=s.max_context,
                       sparse=sparse_config(args) if sparse == "flags" else sparse, **extra)
