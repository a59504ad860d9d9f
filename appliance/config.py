"""Server settings: one dataclass, from a YAML file, APPLIANCE_* variables and flags.

Precedence, lowest first: defaults < settings file (`--config FILE` or
APPLIANCE_CONFIG) < APPLIANCE_<KEY> environment variables < command-line flags.
Everything is validated once, at start; a bad value stops the server with one line
that names the key, where it came from, and what is allowed.

The settings file is flat YAML with the keys of `Settings` (Ansible templates it):

    model: /srv/models/Qwen3-0.6B
    port: 8080
    weights: q8          # leave out for the model family's default
    kv: q8
    max_batch: 8
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

WEIGHT_FORMATS = ("q8", "q4", "f32")
KV_FORMATS = ("q8", "q4", "f32")
ENV_PREFIX = "APPLIANCE_"


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message is one line."""


@dataclass
class Settings:
    model: str | None = None          # model directory; None serves the embedded demo model
    host: str = "127.0.0.1"
    port: int = 8080
    weights: str | None = None        # weight format: q8 | q4 | f32; None = the model family's default
    kv: str = "q8"                    # KV cache format: q8 | q4 | f32
    threads: int | None = None        # compute threads; None lets the engine choose
    max_context: int | None = None    # cap on context tokens; None = the model's own
    kv_cache_tokens: int | None = None  # KV pool size in tokens, shared by all sequences; None = engine's
    sparse_attn: bool = False         # block-sparse attention (see ENGINE.md)
    sparse_k: int = 32
    sparse_block: int = 32
    sparse_probe: int = 8
    sparse_probe_mode: str = "bound"  # bound | strided (appliance/sparse.py)
    api_key: str | None = None        # when set, /v1/* and /tokenize need `Authorization: Bearer`
    max_queue: int = 16               # requests waiting for a decode slot before 503
    max_batch: int = 8                # sequences decoded together in one step
    request_timeout: float = 600.0    # seconds from arrival to the last token
    # Larger request bodies get 413. Room for one camera photo: a 10 MB image (images.py
    # MAX_IMAGE_BYTES) is 13.4 MB as a base64 data URL.
    max_body_bytes: int = 16 << 20
    image_url_hosts: str | None = None  # comma-separated hosts ("camera.local,*.lan") an image_url may fetch from; None: inline data: URLs only
    sysfs_root: str = "/sys"          # tests point this at a fake tree
    thermal_interval: float = 1.0     # seconds between thermal samples
    grace_period: float = 30.0        # SIGTERM: seconds running requests get to finish
    log_level: str = "info"

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
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{key} ({source}): expected a string, got {value!r}")
    return str(value)


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
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    check(s.weights is None or s.weights in WEIGHT_FORMATS,
          f"weights: {s.weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    check(s.kv in KV_FORMATS, f"kv: {s.kv!r} is not one of {', '.join(KV_FORMATS)}")
    check(1 <= s.port <= 65535, f"port: {s.port} is outside 1..65535")
    check(bool(s.host.strip()), "host: must not be empty")
    check(s.threads is None or 1 <= s.threads <= 256, f"threads: {s.threads} is outside 1..256")
    check(s.max_context is None or s.max_context >= 16, f"max_context: {s.max_context} is below 16")
    check(s.kv_cache_tokens is None or s.kv_cache_tokens >= 64,
          f"kv_cache_tokens: {s.kv_cache_tokens} is below 64")
    for key in ("sparse_k", "sparse_block", "sparse_probe"):
        check(getattr(s, key) >= 1, f"{key}: {getattr(s, key)} must be at least 1")
    check(s.sparse_probe_mode in ("bound", "strided"),
          f"sparse_probe_mode: {s.sparse_probe_mode!r} is not one of bound, strided")
    check(0 <= s.max_queue <= 4096, f"max_queue: {s.max_queue} is outside 0..4096")
    check(1 <= s.max_batch <= 256, f"max_batch: {s.max_batch} is outside 1..256")
    check(s.request_timeout > 0, f"request_timeout: {s.request_timeout} must be positive (seconds)")
    check(s.max_body_bytes >= 1024, f"max_body_bytes: {s.max_body_bytes} is below 1024")
    check(s.thermal_interval > 0, f"thermal_interval: {s.thermal_interval} must be positive (seconds)")
    check(s.grace_period >= 0, f"grace_period: {s.grace_period} must not be negative (seconds)")
    check(s.api_key is None or len(s.api_key) >= 8, "api_key: use at least 8 characters")
    check(s.log_level in ("debug", "info", "warning", "error"),
          f"log_level: {s.log_level!r} is not one of debug, info, warning, error")
    if s.model is not None:
        check(os.path.isdir(s.model), f"model: {s.model!r} is not a directory")
    return s


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
