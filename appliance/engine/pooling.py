"""How an embedding model turns a sequence's hidden states into one vector, read from its checkpoint.

A checkpoint saved by sentence-transformers says it in its own files, which are followed as
sentence-transformers itself reads them:
  modules.json           [{"type": "sentence_transformers.models.Transformer", "path": ""},
                          {"type": "...Pooling", "path": "1_Pooling"}, {"type": "...Normalize"}]
  1_Pooling/config.json  the pooling mode: "pooling_mode": "lasttoken" (or a list, concatenated)
                         in sentence-transformers 5+, or the older booleans
                         "pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": ... (mean when
                         none is set), which is what Qwen3-Embedding ships
A Normalize module L2-normalises the pooled vector. Without these files the model is pooled as
the Qwen3-Embedding model card does: the last token's final hidden state, L2-normalised (the
tokenizer appends <|endoftext|>, so the last token is that one).

A module this engine does not run (a Dense projection, for one) refuses the checkpoint at
load: serving it without would return vectors of another space without a word.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance.errors import ModelLoadError

# sentence-transformers' modes, in the order it concatenates several of them.
MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                     "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_RUN_MODULES = ("Transformer", "Pooling", "Normalize")
NORM_EPS = 1e-12          # torch.nn.functional.normalize's floor on the norm, as sentence-transformers uses


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]        # concatenated in this order (MODES)
    normalize: bool               # L2 after pooling (and again after a Matryoshka truncation)
    source: str                   # where the choice came from, for info() and the logs

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> "Pooling":
        model_dir = Path(model_dir)
        modules_path = model_dir / "modules.json"
        if not modules_path.is_file():
            return cls(("lasttoken",), True, "last token, L2-normalised (no modules.json: the Qwen3-Embedding recipe)")
        modules = _read_json(modules_path)
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ModelLoadError(modules_path, "expected a list of module objects")
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        unknown = [k for k in kinds if k not in _RUN_MODULES]
        if unknown:
            raise ModelLoadError(modules_path, f"sentence-transformers module {unknown[0]!r} is not supported "
                                               f"(this engine runs {', '.join(_RUN_MODULES)})")
        pooling = [m for m, k in zip(modules, kinds) if k == "Pooling"]
        if not pooling:
            modes, where = ("lasttoken",), "no Pooling module: last token"
        else:
            config_path = model_dir / str(pooling[0].get("path") or "1_Pooling") / "config.json"
            modes, where = _modes(_read_json(config_path), config_path), f"{config_path.parent.name}/config.json"
        normalize = "Normalize" in kinds
        return cls(modes, normalize, f"{'+'.join(modes)}{', L2-normalised' if normalize else ''} ({where})")

    @property
    def needs_all_rows(self) -> bool:
        """False when only the last row matters: the other rows' hidden states need not be kept."""
        return self.modes != ("lasttoken",)

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        """hidden float32[T, H] of one sequence (every row is a real token) -> float32[len(modes) * H]."""
        n = hidden.shape[0]
        parts = []
        for mode in self.modes:
            if mode == "cls":
                parts.append(hidden[0])
            elif mode == "max":
                parts.append(hidden.max(axis=0))
            elif mode == "mean":
                parts.append(hidden.sum(axis=0, dtype=np.float64) / n)
            elif mode == "mean_sqrt_len_tokens":
                parts.append(hidden.sum(axis=0, dtype=np.float64) / np.sqrt(n))
            elif mode == "weightedmean":            # position weights 1..T
                w = np.arange(1, n + 1, dtype=np.float64)
                parts.append(w @ hidden / w.sum())
            else:
                parts.append(hidden[-1])
        out = np.concatenate(parts).astype(np.float32)
        return l2_normalize(out) if self.normalize else out

    def truncate(self, vector: np.ndarray, dimensions: int | None) -> np.ndarray:
        """Matryoshka: the first `dimensions` components, normalised again if the model normalises."""
        if dimensions is None or dimensions >= vector.shape[-1]:
            return vector
        cut = vector[..., :dimensions]
        return l2_normalize(cut) if self.normalize else np.ascontiguousarray(cut)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    norm = np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=-1, keepdims=True))
    return (x / np.maximum(norm, NORM_EPS)).astype(np.float32)


def _modes(config, path: Path) -> tuple[str, ...]:
    if not isinstance(config, dict):
        raise ModelLoadError(path, "expected a JSON object")
    mode = config.get("pooling_mode")
    if mode is not None:
        modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, list) else None
    else:   # the booleans of sentence-transformers before 5.0; none set means mean
        modes = tuple(m for key, m in _LEGACY_MODE_KEYS.items() if config.get(key) is True) or ("mean",)
    if not modes or any(m not in MODES for m in modes):
        raise ModelLoadError(path, f"pooling mode {mode!r} is not one of {', '.join(MODES)}")
    return tuple(sorted(modes, key=MODES.index))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(path, "missing (modules.json names it)") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"unreadable ({e})") from None


def checkpoint_task(model_dir: Path) -> str | None:
    """What a checkpoint says it is for: "embed" for a sentence-transformers export (modules.json
    with a Pooling module) or a bare base model (config.json architectures "...Model"); None when
    it cannot be told (a causal LM: chat, or a Qwen3-Reranker, which looks the same)."""
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    if modules_path.is_file():
        try:
            modules = json.loads(modules_path.read_text())
        except (OSError, ValueError):
            modules = []
        if isinstance(modules, list) and any(isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")
                                             for m in modules):
            return "embed"
    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if architectures and all(isinstance(a, str) and a.endswith("Model") for a in architectures):
        return "embed"
    return None
