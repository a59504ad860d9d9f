"""Server settings: one dataclass, from a YAML file, APPLIANCE_* variables and flags.

Precedence, lowest first: defaults < settings file (`--config FILE` or
APPLIANCE_CONFIG) < APPLIANCE_<KEY> environment variables < command-line flags.
Everything is validated once, at start; a bad value stops the server with one line
that names the key, where it came from, and what is allowed.

Each setting is defined once, below: its type, default, choices, range and help. The
settings file loader, the environment, `appliance serve`'s flags and the engine flags of
the other commands (add_setting_flags) all derive from that one definition, and the
Ansible role's argument specs are checked against it (tests/test_settings_schema.py).

The settings file is flat YAML with the keys of `Settings` (Ansible templates it):

    model: /srv/models/Qwen3-0.6B
    port: 8080
    weights: q8          # leave out for the model family's default
    kv: q8
    max_batch: 8
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from appliance.options import KV_FORMATS, MAX_DRAFT_TOKENS, PROBE_MODES, WEIGHT_FORMATS, SparseConfig

ENV_PREFIX = "APPLIANCE_"
LOG_LEVELS = ("debug", "info", "warning", "error")
# What a server does with its model: /v1/chat/completions and /v1/completions, /v1/embeddings, or
# /v1/rerank; one task per process (a board runs one instance per model).
TASKS = ("chat", "embed", "rerank")
REASONING_PARSERS = ("qwen3", "none")
JSON_OBJECT_KEYS = ("chat_template_kwargs",)     # a JSON object as text (a YAML mapping in the file)
JSON_LIST_KEYS = ("board_instances",)            # a JSON array as text (a YAML list in the file)
PATH_KEYS = ("model", "sysfs_root", "kv_cache_dir", "api_keys_file")   # "~/models/..." means the user's home, as in a shell
_SPARSE = SparseConfig()          # sparse attention's defaults


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message is one line."""


def setting(default, help: str, *, choices: tuple | None = None, low=None, high=None, positive: bool = False,
            unit: str = "", metavar: str | None = None, flag: bool = True):
    """One setting's definition: low/high bound a number (inclusive), positive asks for > 0, unit
    names what it counts in messages; flag=False keeps it off the command line (file and env only)."""
    return field(default=default, metadata={"help": help, "choices": choices, "low": low, "high": high,
                                            "positive": positive, "unit": unit, "metavar": metavar,
                                            "flag": flag})


@dataclass
class Settings:
    model: str | None = setting(None, "model directory (Hugging Face layout); default: the embedded demo model",
                                metavar="DIR")
    task: str | None = setting(None, "what the model is served for: chat (chat and completions), embed "
                                     "(/v1/embeddings) or rerank (/v1/rerank, a Qwen3-Reranker); default: embed for "
                                     "an embedding checkpoint (sentence-transformers files, a bare base model), else "
                                     "chat", choices=TASKS)
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8080, "port of the API, dashboard and metrics", low=1, high=65535)
    weights: str | None = setting(None, "weight format; default: the model family's (q8; q4 for MoE)",
                                  choices=WEIGHT_FORMATS)
    kv: str = setting("q8", "KV cache format", choices=KV_FORMATS)
    threads: int | None = setting(None, "compute threads; default: one per big core", low=1, high=256,
                                  metavar="N")
    max_context: int | None = setting(None, "cap on context tokens; default: the model's own", low=16,
                                      metavar="N")
    kv_cache_tokens: int | None = setting(None, "KV pool size in tokens, shared by all sequences (at least one "
                                                "context); default: sized by memory", low=64, metavar="N")
    kv_cache_memory: str | None = setting(None, "KV pool size as memory (4G, 1536M) or a share of available "
                                                "memory (40%); default: half the memory left after the weights, "
                                                "1 to 16 contexts", metavar="SIZE")
    disable_prefix_cache: bool = setting(False, "recompute every prompt: no KV blocks reused between requests "
                                                "that start alike")
    kv_cache_dir: str | None = setting(None, "directory that keeps the prefix cache's blocks across restarts "
                                             "(bounded by --kv-cache-disk-bytes); default: memory only",
                                       metavar="DIR")
    kv_cache_disk_bytes: int = setting(4 << 30, "bytes --kv-cache-dir may hold; the least recently used blocks "
                                                "go first", low=1 << 20, unit="bytes", metavar="N")
    max_step_tokens: int | None = setting(None, "rows one step computes while streams decode (their tokens plus "
                                                "prompt chunks); default: sized from measured step times so a "
                                                "step lasts about 8 decode steps", low=8, high=8192, metavar="N")
    spec_prompt_lookup: int = setting(0, "speculative decoding by prompt lookup: up to K tokens guessed from "
                                         "the prompt and answer, verified in the same forward pass (same output; "
                                         "requests may set their own `speculative`); 0: off", low=0,
                                      high=MAX_DRAFT_TOKENS, metavar="K")
    sparse_attn: bool = setting(False, "block-sparse attention for long contexts (docs/engine.md)")
    sparse_k: int = setting(_SPARSE.k, "blocks kept per head by sparse attention", low=1, metavar="K")
    sparse_block: int = setting(_SPARSE.block, "positions per sparse block", low=1, metavar="N")
    sparse_probe: int = setting(_SPARSE.probe, "rows probed per block with --sparse-probe-mode strided",
                                low=1, metavar="N")
    sparse_probe_mode: str = setting(_SPARSE.probe_mode, "how sparse attention scores blocks: a key bound "
                                     "then the exact max of the best k, or the max over sampled rows",
                                     choices=PROBE_MODES)
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on /v1/* and /tokenize",
                                  metavar="KEY")
    api_keys_file: str | None = setting(None, "file of named API keys, 'NAME KEY' a line or JSON [{name, key}] "
                                              "(beside api_key); re-read when it changes, so keys rotate "
                                              "without a restart; the name shows in the access log and the "
                                              "appliance_client_requests metric", metavar="FILE")
    max_queue: int = setting(16, "requests waiting for a decode slot before 503", low=0, high=4096, metavar="N")
    max_batch: int = setting(8, "sequences decoded together in one step", low=1, high=256, metavar="N")
    request_timeout: float = setting(600.0, "seconds from a request's arrival to its last token",
                                     positive=True, unit="seconds", metavar="S")
    # Room for one camera photo: a 10 MB image (models/images.py MAX_IMAGE_BYTES) is 13.4 MB as
    # a base64 data URL. Larger bodies get 413.
    max_body_bytes: int = setting(16 << 20, "largest accepted request body in bytes", low=1024, metavar="N")
    image_url_hosts: str | None = setting(None, "comma-separated hosts an image_url may fetch from "
                                                "(\"camera.local,*.lan\"); default: inline data: URLs only",
                                          metavar="HOSTS")
    served_model_name: str | None = setting(None, "names the API answers to, comma-separated; the first is the one "
                                                  "reported (default: the model directory's name)",
                                            metavar="NAME[,ALIAS...]")
    chat_template_kwargs: str | None = setting(None, "JSON object passed to the chat template of every request, "
                                                     "under the request's own: '{\"enable_thinking\": false}' "
                                                     "turns Qwen3's thinking off", metavar="JSON")
    max_thinking_tokens: int | None = setting(None, "close a reply's thought after N tokens and let it answer "
                                                    "(requests may set their own)", low=0, metavar="N")
    reasoning_parser: str = setting("qwen3", "split <think> reasoning into reasoning_content (qwen3), or keep "
                                             "the raw text in content (none)", choices=REASONING_PARSERS)
    board_instances: str | None = setting(None, "every appliance instance of this board, for the dashboard to "
                                                "list: a JSON list of {name, port, task, model} (the Ansible "
                                                "role writes it on a board with several models)", metavar="JSON")
    sysfs_root: str = setting("/sys", "sysfs root the thermal watch reads (tests point it at a fake tree)",
                              flag=False)
    thermal_interval: float = setting(1.0, "seconds between thermal samples", positive=True, unit="seconds",
                                      flag=False)
    grace_period: float = setting(30.0, "SIGTERM: seconds running requests get to finish",
                                  low=0, unit="seconds", metavar="S")
    log_level: str = setting("info", "log level", choices=LOG_LEVELS)

    @property
    def http_threads(self) -> int:
        """gthread threads: every running or waiting stream holds one, plus probes and the dashboard."""
        return self.max_batch + self.max_queue + 8

    def sparse_config(self) -> dict | None:
        if not self.sparse_attn:
            return None
        return {"k": self.sparse_k, "block": self.sparse_block, "probe": self.sparse_probe,
                "probe_mode": self.sparse_probe_mode}

    def public(self) -> dict:
        """The settings as shown on the dashboard and /health: never the API key."""
        out = dataclasses.asdict(self)
        out["api_key"] = "set" if self.api_key else None
        return out


KEYS = tuple(f.name for f in fields(Settings))
FIELDS = {f.name: f for f in fields(Settings)}
_TYPES = {f.name: f.type for f in fields(Settings)}


def _as_int(key: str, value: Any, source: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key} ({source}): expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip(), 0)
        except ValueError:
            pass
    raise ConfigError(f"{key} ({source}): expected an integer, got {value!r}")


def _as_float(key: str, value: Any, source: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key} ({source}): expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{key} ({source}): expected a number, got {value!r}")


def _as_bool(key: str, value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off", ""):
            return False
    raise ConfigError(f"{key} ({source}): expected true or false, got {value!r}")


def _coerce(key: str, value: Any, source: str) -> Any:
    """Turn a raw value (YAML scalar, env string, flag) into the field's type."""
    kind = _TYPES[key]
    optional = "None" in kind
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{key} ({source}): a value is required")
    if kind.startswith("int"):
        return _as_int(key, value, source)
    if kind.startswith("float"):
        return _as_float(key, value, source)
    if kind.startswith("bool"):
        return _as_bool(key, value, source)
    if (key in JSON_OBJECT_KEYS and isinstance(value, dict)) or (key in JSON_LIST_KEYS and isinstance(value, list)):
        return json.dumps(value)
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{key} ({source}): expected a string, got {value!r}")
    return os.path.expanduser(str(value)) if key in PATH_KEYS else str(value)


def read_file(path: str) -> dict:
    """Read a flat YAML settings file into {key: raw value}."""
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is a runtime dependency
        raise ConfigError(f"config {path}: pyyaml is not installed ({e})") from e
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config {path}: cannot read ({e.strerror or e})") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config {path}: invalid YAML{where}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in KEYS)
    if unknown:
        raise ConfigError(f"config {path}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    return dict(data)


def read_env(environ: Mapping[str, str]) -> dict:
    """APPLIANCE_<KEY> variables for the known keys (others, like APPLIANCE_PROFILE, belong elsewhere)."""
    return {key: environ[ENV_PREFIX + key.upper()] for key in KEYS if ENV_PREFIX + key.upper() in environ}


def validate(s: Settings) -> Settings:
    """Every setting against its definition, then the checks one definition cannot say."""
    for key, f in FIELDS.items():
        value, meta = getattr(s, key), f.metadata
        if value is None:
            continue
        problem = _out_of_bounds(value, meta)
        if problem:
            raise ConfigError(f"{key}: {problem}")
    if not s.host.strip():
        raise ConfigError("host: must not be empty")
    if s.api_key is not None and len(s.api_key) < 8:
        raise ConfigError("api_key: use at least 8 characters")
    if s.api_keys_file is not None:
        from appliance.api_keys import KeyFileError, read_keys
        try:
            read_keys(s.api_keys_file)
        except KeyFileError as e:
            raise ConfigError(str(e)) from None
    _check_kv_pool(s)
    for key in JSON_OBJECT_KEYS:
        text = getattr(s, key)
        if text is not None:
            try:
                value = json.loads(text)
            except ValueError as e:
                raise ConfigError(f"{key}: not JSON ({e})") from None
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a JSON object, got {text!r}")
    board_instances(s)        # a malformed list is a start-up error, not a dashboard one
    # A missing model directory is not a settings error: the server still starts and its
    # /health says which directory is missing (a board must not crash-loop where nobody looks).
    return s


def board_instances(s: Settings) -> list[dict]:
    """The board's instances from the board_instances setting: [{name, port, task, model}],
    checked (ConfigError naming the entry)."""
    if s.board_instances is None:
        return []
    try:
        entries = json.loads(s.board_instances)
    except ValueError as e:
        raise ConfigError(f"board_instances: not JSON ({e})") from None
    if not isinstance(entries, list):
        raise ConfigError(f"board_instances: expected a JSON list, got {s.board_instances!r}")
    out = []
    for n, entry in enumerate(entries):
        where = f"board_instances[{n}]"
        if not isinstance(entry, dict) or set(entry) - {"name", "port", "task", "model"}:
            raise ConfigError(f"{where}: expected {{name, port, task, model}}, got {entry!r}")
        name, port, task, model = (entry.get(k) for k in ("name", "port", "task", "model"))
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: expected a non-empty string")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigError(f"{where}.port: expected a port number 1..65535, got {port!r}")
        if task is not None and task not in TASKS:
            raise ConfigError(f"{where}.task: {task!r} is not one of {', '.join(TASKS)}")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"{where}.model: expected a string")
        out.append({"name": name, "port": port, "task": task, "model": model})
    return out


def model_dir_problem(s: Settings) -> str | None:
    """Why the settings' model directory cannot be loaded (missing or unreadable), or None."""
    if s.model is None:
        return None
    if not os.path.isdir(s.model):
        return f"model: {s.model!r} is not a directory"
    if not os.access(s.model, os.R_OK | os.X_OK):
        return f"model: {s.model!r} is not readable by this user"
    return None


def _check_kv_pool(s: Settings) -> None:
    from appliance.engine.kv_sizing import parse_memory
    if s.kv_cache_tokens is not None and s.kv_cache_memory is not None:
        raise ConfigError("kv_cache_tokens, kv_cache_memory: set the KV pool by tokens or by memory, not both")
    if s.kv_cache_memory is not None:
        try:
            parse_memory(s.kv_cache_memory)
        except ValueError as e:
            raise ConfigError(f"kv_cache_memory: {e}") from None
    if s.kv_cache_tokens is not None and s.max_context is not None and s.kv_cache_tokens < s.max_context:
        raise ConfigError(f"kv_cache_tokens: {s.kv_cache_tokens} is below max_context {s.max_context}: a "
                          f"sequence could not reach its context (raise it or lower max_context)")


def _out_of_bounds(value, meta) -> str | None:
    choices, low, high = meta["choices"], meta["low"], meta["high"]
    unit = f" ({meta['unit']})" if meta["unit"] else ""
    if choices and value not in choices:
        return f"{value!r} is not one of {', '.join(choices)}"
    if meta["positive"] and not value > 0:
        return f"{value} must be positive{unit}"
    if low is not None and high is not None and not low <= value <= high:
        return f"{value} is outside {low}..{high}"
    if low is not None and value < low:
        return f"{value} must not be negative{unit}" if low == 0 and unit else f"{value} is below {low}"
    return None


def load_settings(config_file: str | None = None,
                  environ: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Merge file < env < overrides (flags; None values are "not given") and validate."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG") or None
    layers: list[tuple[str, dict]] = []
    if config_file:
        layers.append((f"config {config_file}", read_file(config_file)))
    layers.append(("environment", read_env(environ)))
    if overrides:
        unknown = [k for k in overrides if k not in KEYS]
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r} (known: {', '.join(KEYS)})")
        layers.append(("command line", {k: v for k, v in overrides.items() if v is not None}))

    values: dict[str, Any] = {}
    for source, layer in layers:
        for key, raw in layer.items():
            values[key] = _coerce(key, raw, source)
    return validate(Settings(**values))


# ---- command-line flags, derived from the definitions ---------------------------------------

def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_setting_flags(parser: argparse.ArgumentParser, keys=None) -> None:
    """One flag per setting (all command-line settings, or `keys`). Every flag defaults to None,
    "not given", so that the settings file, the environment and the defaults apply beneath it;
    values are checked by validate() like every other source."""
    for key in keys or [k for k in KEYS if FIELDS[k].metadata["flag"]]:
        f = FIELDS[key]
        meta, kind = f.metadata, _TYPES[key]
        shown = f.default
        if key.endswith("_bytes") and shown and shown % (1 << 20) == 0:
            shown = f"{shown >> 20} MiB"
        help_text = meta["help"] + (f" (default {shown})" if shown not in (None, False) else "")
        help_text = help_text.replace("%", "%%")       # argparse formats help with %
        if kind.startswith("bool"):
            parser.add_argument(flag_name(key), dest=key, action="store_true", default=None, help=help_text)
            continue
        convert = int if kind.startswith("int") else float if kind.startswith("float") else str
        parser.add_argument(flag_name(key), dest=key, type=convert, choices=meta["choices"], default=None,
                            metavar=meta["metavar"] if not meta["choices"] else None, help=help_text)


def settings_from_flags(args: argparse.Namespace, keys=None, config_file: str | None = None,
                        environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from flags made by add_setting_flags, over the file / environment / defaults."""
    keys = keys or KEYS
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    return load_settings(config_file, environ, overrides)
