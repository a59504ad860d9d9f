"""Qwen3-MoE (Qwen3-30B-A3B and its kin): Qwen3's attention, a sparse mixture-of-experts MLP.

Per layer: the Qwen3 attention sublayer unchanged (qwen3.Qwen3Attention), then
RMSNorm -> router logits (float32[M, n_experts], an f32 matmul) -> softmax ->
the top-k experts of each token, their probabilities renormalized to sum 1 when
`norm_topk_prob` -> h += sum_k weight_k * SwiGLU_expert_k(x). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense SwiGLU MLP
of `intermediate_size` (exactly transformers' Qwen3MoeDecoderLayer rule).

Weights: every expert is its own pair of linears in the quantized cache
(`{layer}.experts.{e}.gate_up` float[2*moe_intermediate, hidden] and
`.down` float[hidden, moe_intermediate]), contiguous on disk, views into the
read-only mmap. Nothing ever copies or stacks them, so an expert that no token
routes to is never paged in: resident memory follows the experts used. The
router stays float32 (as llama.cpp keeps ffn_gate_inp): a routing decision
flipped by rounding changes a whole expert's contribution.

Compute: the normed rows are quantized to int8 once per layer; the rows routed
to each expert are gathered and run as one GEMM per expert (prefill), or one
GEMV per selected expert (decode). The expert outputs are summed in expert
order, as transformers does, then added to the residual stream.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from appliance.weights.linear import Linear
from appliance.kernels.dispatch import kernels
from appliance.engine.batch import Batch
from appliance.errors import ModelLoadError
from appliance.weights.spec import TensorSpec
from appliance.models.qwen3 import Qwen3Config, Qwen3Layer, Qwen3Model, attention_plan, head_plan, mlp_plan, swiglu_plan

DEFAULT_WEIGHTS = "q4"
# OpenBLAS runs a product of at most this many multiply-adds on the calling thread.
BLAS_SINGLE_THREAD_MACS = 1 << 18


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    # Defaults are transformers' Qwen3MoeConfig defaults (used when config.json omits a key).
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict, path) -> "Qwen3MoeConfig":
        """config.json of a qwen3_moe checkpoint; transformers 5 writes num_experts as num_local_experts."""
        base = Qwen3Config.from_dict(d, path)
        try:
            experts = d.get("num_experts", d.get("num_local_experts", cls.num_experts))
            cfg = cls(**asdict(base),
                      num_experts=int(experts),
                      num_experts_per_tok=int(d.get("num_experts_per_tok", cls.num_experts_per_tok)),
                      moe_intermediate_size=int(d.get("moe_intermediate_size", cls.moe_intermediate_size)),
                      norm_topk_prob=bool(d.get("norm_topk_prob", cls.norm_topk_prob)),
                      decoder_sparse_step=int(d.get("decoder_sparse_step", cls.decoder_sparse_step)),
                      mlp_only_layers=tuple(int(i) for i in (d.get("mlp_only_layers") or ())))
        except (TypeError, ValueError) as e:
            raise ModelLoadError(path, f"bad value ({e})") from None
        if cfg.num_experts < 0:
            raise ModelLoadError(path, f"num_experts {cfg.num_experts} is negative")
        if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ModelLoadError(path, f"num_experts_per_tok {cfg.num_experts_per_tok} is not in "
                                     f"1..num_experts ({cfg.num_experts})")
        if cfg.decoder_sparse_step < 1:
            raise ModelLoadError(path, f"decoder_sparse_step {cfg.decoder_sparse_step} must be >= 1")
        if cfg.moe_intermediate_size <= 0 or cfg.moe_intermediate_size % 32:
            raise ModelLoadError(path, f"moe_intermediate_size {cfg.moe_intermediate_size} is not a positive "
                                     f"multiple of 32 (the quantization block)")
        return cfg

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]


def moe_plan(cfg: Qwen3MoeConfig, i: int, prefix: str = "model.") -> list[TensorSpec]:
    """Layer i's MoE sublayer: its input norm, the router (float32[n_experts, hidden]), every expert."""
    h = cfg.hidden_size
    p = f"{prefix}layers.{i}."
    plan = [TensorSpec(f"{i}.mlp_norm", "vector", [p + "post_attention_layernorm.weight"], (h,)),
            TensorSpec(f"{i}.router", "vector", [p + "mlp.gate.weight"], (cfg.num_experts, h))]
    for e in range(cfg.num_experts):
        plan += swiglu_plan(f"{i}.experts.{e}", f"{p}mlp.experts.{e}.", h, cfg.moe_intermediate_size)
    return plan


def tensor_plan(cfg: Qwen3MoeConfig, prefix: str = "model.") -> list[TensorSpec]:
    plan = head_plan(cfg, prefix)
    for i in range(cfg.num_hidden_layers):
        plan += attention_plan(cfg, i, prefix)
        plan += moe_plan(cfg, i, prefix) if cfg.is_moe_layer(i) else mlp_plan(cfg, i, prefix)
    return plan


class ExpertUse:
    """Which experts ran: in the last forward pass, and ever since load (what the mmap has paged in)."""

    def __init__(self, cfg: Qwen3MoeConfig):
        self.n_moe_layers = len(cfg.moe_layers)
        self.ran = np.zeros((cfg.num_hidden_layers, max(cfg.num_experts, 1)), dtype=bool)  # since load
        self.last_rows = 0       # rows (tokens) of the last forward pass
        self.last_runs = 0       # (layer, expert) pairs run in it, each counted once however many rows

    def start(self, rows: int) -> None:
        self.last_rows, self.last_runs = rows, 0

    def record(self, layer: int, experts: np.ndarray) -> None:
        self.ran[layer, experts] = True
        self.last_runs += len(experts)

    @property
    def experts_per_token(self) -> float:
        """Expert runs of the last pass per row, over all MoE layers (top_k * MoE layers for one row)."""
        return self.last_runs / self.last_rows if self.last_rows else 0.0

    @property
    def share_ever_ran(self) -> float:
        """Fraction of all (layer, expert) pairs run at least once since load."""
        total = self.n_moe_layers * self.ran.shape[1]
        return float(self.ran.sum()) / total if total else 0.0


class Expert:
    """One expert's SwiGLU; its input rows come quantized once for all experts of the layer."""

    __slots__ = ("gate_up", "down", "intermediate")

    def __init__(self, kind: str, t: dict, name: str):
        self.gate_up = Linear.from_tensors(kind, t, f"{name}.gate_up")
        self.down = Linear.from_tensors(kind, t, f"{name}.down")
        self.intermediate = self.gate_up.n_out // 2

    def __call__(self, x: tuple) -> np.ndarray:
        """x: (xq int8[n, hidden], xd float32[n, hidden/32]), or (float32[n, hidden],) for f32 weights.
        Returns float32[n, hidden]."""
        gu = self.gate_up
        y = gu(x[0]) if len(x) == 1 else gu.matmul_quantized(x[0], x[1])   # [n, 2*intermediate]
        f = self.intermediate
        act = kernels.silu_mul(y[:, :f], y[:, f:])
        return self.down(act)


class SparseMoE:
    """The MoE MLP sublayer: h += sum over each row's top-k experts of weight * expert(rmsnorm(h))."""

    def __init__(self, cfg: Qwen3MoeConfig, i: int, kind: str, t: dict, use: ExpertUse):
        self.index, self.eps, self.use = i, cfg.rms_norm_eps, use
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.norm = t[f"{i}.mlp_norm"]
        self.router = t[f"{i}.router"]                                   # float32[E, hidden]
        # Router products stay small enough for OpenBLAS to run them on the calling thread:
        # threaded, its threads compete with the kernels' OpenMP threads for the same cores
        # (measured on 2 shared cores: 128 rows took 86 ms in one product, 1.8 ms row by row).
        # Qwen3-30B-A3B's one-row product is exactly at the limit: one block per row.
        cols = max(1, BLAS_SINGLE_THREAD_MACS // cfg.hidden_size)
        self.router_blocks = [self.router[e:e + cols].T for e in range(0, cfg.num_experts, cols)]
        self.experts = [Expert(kind, t, f"{i}.experts.{e}") for e in range(cfg.num_experts)]
        self.quantized = kind != "f32"

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k experts intp[M, k] of each row and their weights float32[M, k] (softmax, then
        renormalized over the k when the config says so), as transformers' Qwen3MoeTopKRouter."""
        logits = np.concatenate([np.concatenate([x[i:i + 1] @ block for block in self.router_blocks], axis=1)
                                 for i in range(len(x))])                # [M, E]
        n_experts, k = logits.shape[1], self.top_k
        top = np.argpartition(logits, n_experts - k, axis=1)[:, n_experts - k:]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        weights = np.take_along_axis(probs, top, axis=1)
        if self.renormalize:
            weights /= weights.sum(axis=1, keepdims=True)
        return top, weights

    def __call__(self, h: np.ndarray, timer) -> None:
        """Update the residual stream h float32[M, hidden] in place."""
        x = kernels.rmsnorm(h, self.norm, self.eps)
        m = len(x)
        with timer.gemm():
            top, weights = self.route(x)
            # Group the (row, expert) pairs by expert: one GEMM per expert over its rows.
            order = np.argsort(top, axis=None, kind="stable")
            ids = top.ravel()[order]
            rows = order // self.top_k
            w = weights.ravel()[order]
            starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
            ends = np.append(starts[1:], len(ids))
            xin = kernels.quantize_rows_q8(x) if self.quantized else (x,)
            out = np.zeros_like(h)
            for s, e in zip(starts.tolist(), ends.tolist()):
                expert = self.experts[ids[s]]
                if e - s == m:                                           # every row (always in decode of one)
                    y = expert(xin)
                    y *= w[s:e, None]
                    out += y
                else:
                    r = rows[s:e]                                        # distinct rows of this expert
                    y = expert(tuple(a[r] for a in xin))
                    y *= w[s:e, None]
                    out[r] += y
            h += out
        self.use.record(self.index, ids[starts])


class Qwen3MoeModel(Qwen3Model):
    """Qwen3Model whose MLP sublayers are sparse MoE (except mlp_only_layers); tracks expert use."""

    config_class = Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig, kind: str, tensors: dict):
        self.expert_use = ExpertUse(cfg)
        super().__init__(cfg, kind, tensors)

    def make_layer(self, cfg: Qwen3MoeConfig, i: int, kind: str, tensors: dict) -> Qwen3Layer:
        mlp = SparseMoE(cfg, i, kind, tensors, self.expert_use) if cfg.is_moe_layer(i) else None
        return Qwen3Layer(cfg, i, kind, tensors, mlp=mlp)

    def forward(self, batch: Batch, attention, timer) -> np.ndarray:
        self.expert_use.start(len(batch.token_ids))
        return super().forward(batch, attention, timer)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all expert weights (what stays on disk until routed to)."""
        return sum(lin.nbytes for layer in self.layers if isinstance(layer.mlp, SparseMoE)
                   for ex in layer.mlp.experts for lin in (ex.gate_up, ex.down))


# The family interface the loader uses (same names in every family file).
Config = Qwen3MoeConfig
Model = Qwen3MoeModel
