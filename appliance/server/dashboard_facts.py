"""What the dashboard's tables say: labels a person reads, values with their units, and only
the settings that mean something on this server (sparse attention's when it is on, the disk
tier's when there is one). Rows are (label, value, hint); the page sets them as text.

The raw facts stay in /health and /dashboard/stats for scripts; these rows are for reading.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Callable

from appliance.config import FIELDS, Settings, board_instances

FAMILIES = {"Qwen3Model": "Qwen3", "Qwen3MoeModel": "Qwen3-MoE", "Qwen3VLModel": "Qwen3-VL"}
FORMATS = {"q8": "Q8_0 (int8)", "q4": "Q4_0 (4-bit)", "f32": "float32"}


def mib(n: int | float) -> str:
    value = n / 2**20
    return f"{value:,.1f} MiB" if value < 10 else f"{value:,.0f} MiB"


def count(unit: str) -> Callable[[int], str]:
    return lambda n: f"{n:,} {unit}"


def on_off(v) -> str:
    return "on" if v else "off"


def seconds(v: float) -> str:
    return f"{v:g} s"


def sparse_text(s: Settings) -> str:
    return (f"{s.sparse_k} blocks of {s.sparse_block} positions per head, scored by "
            + ("a key bound" if s.sparse_probe_mode == "bound" else f"{s.sparse_probe} sampled rows"))


def sampling_text(defaults: dict) -> str:
    if not defaults:
        return "none shipped (temperature 1)"
    return ", ".join(f"{k.replace('_', ' ')} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}"
                     for k, v in defaults.items())


# key of Engine.info() / model_facts(), label, how the value reads
MODEL_ROWS: tuple[tuple[str, str, Callable], ...] = (
    ("model_type", "Family", lambda v: FAMILIES.get(v, v)),
    ("layers", "Layers", str),
    ("hidden", "Hidden size", str),
    ("heads", "Attention heads (KV heads)", None),
    ("vocab", "Vocabulary", count("tokens")),
    ("max_context", "Context limit", count("tokens")),
    ("weights", "Weights", lambda v: FORMATS.get(v, v)),
    ("weight_bytes", "Weights in memory", mib),
    ("kv", "KV cache format", lambda v: FORMATS.get(v, v)),
    ("kv_bytes_per_token_per_layer", "KV bytes per token per layer", count("B")),
    ("kv_tokens_total", "KV pool", count("tokens")),
    ("kv_pool_bytes", "KV pool memory", mib),
    ("kv_pool_sizing", "KV pool sized by", str),
    ("kv_block_size", "KV block", count("tokens")),
    ("prefix_cache", "Prefix cache", on_off),
    ("kv_cache_dir", "Prefix cache on disk", str),
    ("sparse", "Attention", lambda v: "block-sparse" if v else "exact"),
    ("threads", "Compute threads", str),
    ("kernel_path", "Kernels", str),
    ("generation_defaults", "Sampling defaults", sampling_text),
)


def model_rows(facts: dict) -> list[tuple[str, str, str]]:
    rows = []
    for key, label, show in MODEL_ROWS:
        if key == "heads" and "heads" in facts:
            rows.append((label, f"{facts['heads']} ({facts.get('kv_heads', '?')}), "
                                f"{facts.get('head_dim', '?')} dimensions each", ""))
        elif key in facts and (facts[key] is not None or key == "sparse"):
            rows.append((label, show(facts[key]), ""))
    return rows


# Settings the dashboard shows, with their labels; the rest (host, paths of the thermal watch,
# log level...) belong to the operator's file, not to the page. A setting appears when `when`
# holds for this server: the sparse knobs only with sparse attention, for instance.
SETTING_ROWS: tuple[tuple[str, str, Callable[[Settings], bool]], ...] = (
    ("max_batch", "Sequences per decode step", lambda s: True),
    ("max_queue", "Requests waiting at most", lambda s: True),
    ("request_timeout", "Request time limit", lambda s: True),
    ("max_step_tokens", "Rows per step", lambda s: s.max_step_tokens is not None),
    ("max_body_bytes", "Largest request body", lambda s: True),
    ("spec_prompt_lookup", "Speculative decoding", lambda s: True),
    ("sparse_attn", "Sparse attention", lambda s: s.sparse_attn),
    ("kv_cache_disk_bytes", "Prefix cache disk budget", lambda s: s.kv_cache_dir is not None),
    ("disable_prefix_cache", "Prefix cache", lambda s: s.disable_prefix_cache),
    ("chat_template_kwargs", "Chat template options", lambda s: s.chat_template_kwargs is not None),
    ("max_thinking_tokens", "Thinking budget", lambda s: s.max_thinking_tokens is not None),
    ("reasoning_parser", "Reasoning", lambda s: s.reasoning_parser != FIELDS["reasoning_parser"].default),
    ("served_model_name", "Also answers to", lambda s: s.served_model_name is not None and "," in s.served_model_name),
    ("image_url_hosts", "Image URLs from", lambda s: s.image_url_hosts is not None),
    ("board_instances", "Instances on this board", lambda s: s.board_instances is not None),
    ("api_key", "API key", lambda s: True),
)

SETTING_VALUES: dict[str, Callable[[Settings], str]] = {
    "request_timeout": lambda s: seconds(s.request_timeout),
    "max_body_bytes": lambda s: mib(s.max_body_bytes),
    "kv_cache_disk_bytes": lambda s: mib(s.kv_cache_disk_bytes),
    "spec_prompt_lookup": lambda s: (f"prompt lookup, up to {s.spec_prompt_lookup} drafted tokens per step"
                                     if s.spec_prompt_lookup else "off (requests may ask for it)"),
    "sparse_attn": sparse_text,
    "disable_prefix_cache": lambda s: "off (every prompt recomputed)",
    "max_thinking_tokens": lambda s: f"{s.max_thinking_tokens:,} tokens",
    "served_model_name": lambda s: ", ".join(n.strip() for n in s.served_model_name.split(",")[1:]),
    "board_instances": lambda s: instances_text(s),
    "api_key": lambda s: "required" if s.api_key or getattr(s, "api_keys_file", None) else "not required",
}


def instances_text(s: Settings) -> str:
    """Each instance of the board with its port, task and model; this server's marked."""
    def one(i: dict) -> str:
        model = f", {i['model']}" if i["model"] else ""
        this = " (this one)" if i["port"] == s.port else ""
        return f"{i['name']} on port {i['port']}: {i['task'] or 'task of its checkpoint'}{model}{this}"
    return "; ".join(one(i) for i in board_instances(s))


def setting_rows(settings: Settings) -> list[tuple[str, str, str]]:
    known = {f.name for f in fields(Settings)}
    rows = []
    for key, label, when in SETTING_ROWS:
        if key not in known or not when(settings):
            continue
        show = SETTING_VALUES.get(key, lambda s, key=key: f"{getattr(s, key):,}"
                                  if isinstance(getattr(s, key), int) else str(getattr(s, key)))
        rows.append((label, show(settings), FIELDS[key].metadata["help"]))
    return rows
