"""Qwen3 dense: config, checkpoint-name mapping, forward pass.

Per layer: RMSNorm -> fused q/k/v projection -> per-head RMSNorm of q and k ->
RoPE (rotate-half) -> KV cache write -> attention -> o_proj -> residual;
RMSNorm -> fused gate/up -> SiLU(gate) * up -> down_proj -> residual.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance.weights.linear import Embedding, Linear
from appliance.kernels.dispatch import kernels
from appliance.engine.batch import Batch
from appliance.errors import ModelLoadError
from appliance.weights.safetensors_io import SafetensorsFile
from appliance.weights.spec import TensorSpec


@dataclass
class Qwen3Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # How the checkpoint names its tensors: "model." as Qwen3ForCausalLM saves them, or "" for a
    # bare Qwen3Model, which is how Qwen3-Embedding ships (its config.json still names
    # Qwen3ForCausalLM). A bare export may also lack lm_head.weight even when untied (the 8B
    # embedding model): it then has no output head, and embeds but cannot generate.
    tensor_prefix: str = "model."
    has_lm_head: bool = True

    @classmethod
    def from_dict(cls, d: dict, path) -> "Qwen3Config":
        """Read a Hugging Face config.json; rope_theta may sit at top level or in rope_parameters."""
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ModelLoadError(path, f"rope type {rope_type!r} is not supported (only default RoPE)")
        if d.get("use_sliding_window"):
            raise ModelLoadError(path, "sliding-window attention is not supported")
        try:
            heads = int(d["num_attention_heads"])
            cfg = cls(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
                vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
            )
        except KeyError as e:
            raise ModelLoadError(path, f"missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(path, f"bad value ({e})") from None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelLoadError(path, f"num_attention_heads {cfg.num_attention_heads} is not a multiple "
                                     f"of num_key_value_heads {cfg.num_key_value_heads}")
        for name in ("hidden_size", "intermediate_size", "head_dim"):
            if getattr(cfg, name) % 32:
                raise ModelLoadError(path, f"{name} {getattr(cfg, name)} is not a multiple of 32 "
                                         f"(the quantization block)")
        cfg.tensor_prefix, cfg.has_lm_head = stored_layout(Path(path).parent, cfg.tie_word_embeddings)
        return cfg

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


def stored_names(model_dir: Path) -> set[str] | None:
    """The tensor names a checkpoint directory holds (None: no readable weights; the loader says why)."""
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text())["weight_map"])
        files = sorted(model_dir.glob("*.safetensors"))
        return set().union(*(SafetensorsFile(f).keys() for f in files)) if files else None
    except (OSError, ValueError, KeyError, TypeError, ModelLoadError):
        return None


def stored_layout(model_dir: Path, tied: bool) -> tuple[str, bool]:
    """(tensor prefix, has an output head) of the checkpoint in model_dir.

    Only a bare Qwen3Model export ("embed_tokens.weight" without "model.") changes anything:
    a causal-LM checkpoint keeps "model." and its lm_head, whose absence the loader reports."""
    names = stored_names(model_dir)
    if not names or "model.embed_tokens.weight" in names or "embed_tokens.weight" not in names:
        return "model.", True
    return "", tied or "lm_head.weight" in names


def head_plan(cfg: Qwen3Config, prefix: str = "model.") -> list[TensorSpec]:
    """Token embedding, final norm and (untied) lm_head."""
    h = cfg.hidden_size
    plan = [TensorSpec("embed", "embedding", [prefix + "embed_tokens.weight"], (cfg.vocab_size, h)),
            TensorSpec("norm", "vector", [prefix + "norm.weight"], (h,))]
    if not cfg.tie_word_embeddings and cfg.has_lm_head:
        plan.append(TensorSpec("lm_head", "linear", ["lm_head.weight"], (cfg.vocab_size, h),
                               at_least_q8=True))
    return plan


def attention_plan(cfg: Qwen3Config, i: int, prefix: str = "model.") -> list[TensorSpec]:
    """Layer i's attention sublayer: its input norm, fused q/k/v, per-head q/k norms, o."""
    h = cfg.hidden_size
    p = f"{prefix}layers.{i}."
    a = p + "self_attn."
    plan = [
        TensorSpec(f"{i}.attn_norm", "vector", [p + "input_layernorm.weight"], (h,)),
        TensorSpec(f"{i}.q_norm", "vector", [a + "q_norm.weight"], (cfg.head_dim,)),
        TensorSpec(f"{i}.k_norm", "vector", [a + "k_norm.weight"], (cfg.head_dim,)),
        TensorSpec(f"{i}.qkv", "linear", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                   (cfg.q_dim + 2 * cfg.kv_dim, h)),
        TensorSpec(f"{i}.o", "linear", [a + "o_proj.weight"], (h, cfg.q_dim)),
    ]
    if cfg.attention_bias:
        plan.append(TensorSpec(f"{i}.qkv_bias", "vector",
                               [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
                               (cfg.q_dim + 2 * cfg.kv_dim,)))
    return plan


def swiglu_plan(name: str, source: str, hidden: int, intermediate: int) -> list[TensorSpec]:
    """A SwiGLU MLP's linears: gate and up fused into one (gate rows first), then down."""
    return [TensorSpec(f"{name}.gate_up", "linear", [source + "gate_proj.weight", source + "up_proj.weight"],
                       (2 * intermediate, hidden)),
            TensorSpec(f"{name}.down", "linear", [source + "down_proj.weight"], (hidden, intermediate))]


def mlp_plan(cfg: Qwen3Config, i: int, prefix: str = "model.") -> list[TensorSpec]:
    """Layer i's dense MLP sublayer: its input norm and the SwiGLU MLP."""
    p = f"{prefix}layers.{i}."
    return ([TensorSpec(f"{i}.mlp_norm", "vector", [p + "post_attention_layernorm.weight"], (cfg.hidden_size,))]
            + swiglu_plan(str(i), p + "mlp.", cfg.hidden_size, cfg.intermediate_size))


def tensor_plan(cfg: Qwen3Config, prefix: str | None = None) -> list[TensorSpec]:
    """Our tensors and the checkpoint tensors they come from (fused projections concatenate rows);
    prefix None: the checkpoint's own (cfg.tensor_prefix)."""
    prefix = cfg.tensor_prefix if prefix is None else prefix
    plan = head_plan(cfg, prefix)
    for i in range(cfg.num_hidden_layers):
        plan += attention_plan(cfg, i, prefix) + mlp_plan(cfg, i, prefix)
    return plan


def rope_inv_freq(theta: float, dim: int) -> np.ndarray:
    """float32[dim/2]: 1 / theta^(2i/dim), computed in double precision by libm's pow.

    numpy's float32 power is vectorised differently per CPU (AVX-512 builds use their own
    approximation, others libm): a one-ULP difference here flipped greedy answers of the demo
    model between two x86 machines. Double precision then rounding gives the same table
    everywhere glibc runs (x86 and the boards).
    """
    return np.array([1.0 / math.pow(theta, 2 * i / dim) for i in range(dim // 2)], dtype=np.float32)


class Qwen3Attention:
    """The attention sublayer: h += o(attention(rope(qk_norm(qkv(rmsnorm(h))))))."""

    def __init__(self, cfg: Qwen3Config, i: int, kind: str, t: dict):
        self.cfg, self.index = cfg, i
        self.norm = t[f"{i}.attn_norm"]
        self.q_norm, self.k_norm = t[f"{i}.q_norm"], t[f"{i}.k_norm"]
        self.qkv = Linear.from_tensors(kind, t, f"{i}.qkv", bias=t.get(f"{i}.qkv_bias"))
        self.o = Linear.from_tensors(kind, t, f"{i}.o")

    def __call__(self, h: np.ndarray, batch: Batch, attention, timer) -> None:
        """Update the residual stream h float32[M, hidden] in place."""
        cfg = self.cfg
        m, hd = h.shape[0], cfg.head_dim
        x = kernels.rmsnorm(h, self.norm, cfg.rms_norm_eps)
        with timer.gemm():
            qkv = self.qkv(x)                                    # [M, q_dim + 2*kv_dim]
        # The q, k and v columns are read in place (rmsnorm and the KV store take strided rows):
        # copying them out cost more than the norms at a batch's or a prompt's rows.
        q = kernels.rmsnorm(qkv[:, :cfg.q_dim].reshape(m, cfg.num_attention_heads, hd),
                            self.q_norm, cfg.rms_norm_eps)
        k = kernels.rmsnorm(qkv[:, cfg.q_dim:cfg.q_dim + cfg.kv_dim].reshape(m, cfg.num_key_value_heads, hd),
                            self.k_norm, cfg.rms_norm_eps)
        v = qkv[:, cfg.q_dim + cfg.kv_dim:].reshape(m, cfg.num_key_value_heads, hd)
        self.rope(q, batch)
        self.rope(k, batch)
        with timer.attn():
            a = attention(self.index, q, k, v, batch)             # [M, q_dim]
        with timer.gemm():
            h += self.o(a)

    def rope(self, x: np.ndarray, batch: Batch) -> None:
        """Rotate x float32[M, heads, hd] in place by the rows' positions (a family may override)."""
        kernels.rope(x, batch.positions, batch.inv_freq)


class SwiGLU:
    """down(silu(gate(x)) * up(x)) with gate and up in one fused linear."""

    def __init__(self, kind: str, t: dict, name: str):
        self.gate_up = Linear.from_tensors(kind, t, f"{name}.gate_up")
        self.down = Linear.from_tensors(kind, t, f"{name}.down")
        self.intermediate = self.gate_up.n_out // 2

    def __call__(self, x: np.ndarray, timer) -> np.ndarray:
        """float32[M, hidden] -> float32[M, hidden]."""
        with timer.gemm():
            gu = self.gate_up(x)                                 # [M, 2*intermediate]
        f = self.intermediate
        act = kernels.silu_mul(gu[:, :f], gu[:, f:])           # both halves read in place
        with timer.gemm():
            return self.down(act)


class Qwen3MLP:
    """The dense MLP sublayer: h += swiglu(rmsnorm(h))."""

    def __init__(self, cfg: Qwen3Config, i: int, kind: str, t: dict):
        self.eps = cfg.rms_norm_eps
        self.norm = t[f"{i}.mlp_norm"]
        self.mlp = SwiGLU(kind, t, str(i))

    def __call__(self, h: np.ndarray, timer) -> None:
        h += self.mlp(kernels.rmsnorm(h, self.norm, self.eps), timer)


class Qwen3Layer:
    """Attention sublayer then MLP sublayer (dense here; a MoE family passes its own)."""

    def __init__(self, cfg: Qwen3Config, i: int, kind: str, t: dict, mlp=None):
        self.index = i
        self.attention = Qwen3Attention(cfg, i, kind, t)
        self.mlp = mlp if mlp is not None else Qwen3MLP(cfg, i, kind, t)

    def forward(self, h: np.ndarray, batch: Batch, attention, timer) -> None:
        """Update the residual stream h float32[M, hidden] in place."""
        self.attention(h, batch, attention, timer)
        self.mlp(h, timer)


class Qwen3Model:
    """Embedding, decoder layers and head; attention is passed in (exact or sparse, any KV kind)."""

    config_class = Qwen3Config

    def __init__(self, cfg: Qwen3Config, kind: str, tensors: dict):
        self.cfg = cfg
        self.embed = Embedding("f32" if kind == "f32" else "q8", tensors, "embed", head=cfg.tie_word_embeddings)
        self.norm = tensors["norm"]
        self.layers = [self.make_layer(cfg, i, kind, tensors) for i in range(cfg.num_hidden_layers)]
        self.lm_head = (self.embed.as_linear() if cfg.tie_word_embeddings
                        else Linear.from_tensors("f32" if kind == "f32" else "q8", tensors, "lm_head")
                        if cfg.has_lm_head else None)
        self.inv_freq = rope_inv_freq(cfg.rope_theta, cfg.head_dim)

    def make_layer(self, cfg: Qwen3Config, i: int, kind: str, tensors: dict) -> Qwen3Layer:
        return Qwen3Layer(cfg, i, kind, tensors)

    def forward(self, batch: Batch, attention, timer) -> np.ndarray:
        """Hidden states float32[M, hidden] after the final norm, for every row of the batch."""
        batch.inv_freq = self.inv_freq
        h = self.embed.lookup(batch.token_ids)
        for layer in self.layers:
            layer.forward(h, batch, attention, timer)
        return kernels.rmsnorm(h, self.norm, self.cfg.rms_norm_eps)

    def streamed_linears(self) -> list[Linear]:
        """The matrices every decode step reads whole: each layer's attention projections and dense
        MLP, and the output head. Not a MoE layer's experts, read only as tokens route to them."""
        out = []
        for layer in self.layers:
            out += [layer.attention.qkv, layer.attention.o]
            if isinstance(layer.mlp, Qwen3MLP):
                out += [layer.mlp.mlp.gate_up, layer.mlp.mlp.down]
        return out + ([self.lm_head] if self.lm_head is not None else [])

    def logits(self, hidden: np.ndarray, timer) -> np.ndarray:
        if self.lm_head is None:
            raise ValueError("this checkpoint has no output head (lm_head): it computes embeddings, not tokens")
        with timer.gemm():
            return self.lm_head(np.ascontiguousarray(hidden))


# The family interface the loader uses (same names in every family file).
Config = Qwen3Config
Model = Qwen3Model
