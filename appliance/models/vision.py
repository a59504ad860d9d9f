"""The Qwen3-VL vision tower (`model.visual.*`): patches of one image -> its image-token embeddings.

    patches float32[N, 3*T*P*P]   (appliance.images, merge-block order)
      -> patch embedding: the Conv3d with kernel = stride = (T, P, P) is a matmul on a
         flattened patch; the T frames of an image are identical, so the kernel's frames
         are summed once at load and the product runs over 3*P*P inputs
      -> + learned position embedding, bilinearly resampled (align_corners) from its
         square grid to the image's patch grid
      -> ViT blocks: h += proj(attention(rope2d(qkv(LayerNorm(h)))));
                     h += fc2(gelu_tanh(fc1(LayerNorm(h))))
         attention is bidirectional within the image; the 2-D rotary embedding gives the
         first half of each head's frequencies the patch row, the second half its column
      -> after the blocks listed in deepstack_visual_indexes: a DeepStack merger's output
         (added by the decoder into its first layers' hidden states at the image tokens)
      -> merger: LayerNorm per patch, each 2x2 group of patches concatenated,
         fc2(gelu(fc1(.))) -> float32[N/4, text hidden]

The linear layers run on the int8 kernels like the decoder's (Q8_0/Q4_0 per the weights
format); a linear whose input width is not a multiple of the 32-block stays float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from appliance.kernels.dispatch import kernels
from appliance.models.qwen3 import rope_inv_freq
from appliance.weights.linear import Linear
from appliance.errors import ModelLoadError
from appliance.weights.spec import TensorSpec
from appliance.kernels.quant import QK


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict, path) -> "VisionConfig":
        try:
            cfg = cls(depth=int(d["depth"]), hidden_size=int(d["hidden_size"]),
                      intermediate_size=int(d["intermediate_size"]), num_heads=int(d["num_heads"]),
                      out_hidden_size=int(d["out_hidden_size"]),
                      num_position_embeddings=int(d["num_position_embeddings"]),
                      patch_size=int(d.get("patch_size", 16)),
                      temporal_patch_size=int(d.get("temporal_patch_size", 2)),
                      spatial_merge_size=int(d.get("spatial_merge_size", 2)),
                      in_channels=int(d.get("in_channels", 3)),
                      hidden_act=str(d.get("hidden_act", "gelu_pytorch_tanh")),
                      rope_theta=float((d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                      deepstack_visual_indexes=tuple(int(i) for i in d.get("deepstack_visual_indexes") or ()))
        except KeyError as e:
            raise ModelLoadError(path, f"vision_config: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(path, f"vision_config: bad value ({e})") from None
        if cfg.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(path, f"vision_config: hidden_act {cfg.hidden_act!r} is not supported "
                                     f"({', '.join(ACTIVATIONS)})")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ModelLoadError(path, f"vision_config: hidden_size {cfg.hidden_size} does not split into "
                                     f"{cfg.num_heads} heads of a multiple of 4")
        side = int(math.isqrt(cfg.num_position_embeddings))
        if side * side != cfg.num_position_embeddings:
            raise ModelLoadError(path, f"vision_config: num_position_embeddings {cfg.num_position_embeddings} "
                                     f"is not a square grid")
        bad = [i for i in cfg.deepstack_visual_indexes if not 0 <= i < cfg.depth]
        if bad:
            raise ModelLoadError(path, f"vision_config: deepstack layer {bad[0]} is outside 0..{cfg.depth - 1}")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width of a merged (2x2) group of patches: the mergers' input."""
        return self.hidden_size * self.spatial_merge_size ** 2


def _linear_spec(name: str, source: str, shape: tuple[int, int]) -> list[TensorSpec]:
    """A weight and its bias; quantizable when the input width is a multiple of the block."""
    kind = "linear" if shape[1] % QK == 0 else "vector"
    return [TensorSpec(name, kind, [source + ".weight"], shape),
            TensorSpec(name + ".bias", "vector", [source + ".bias"], (shape[0],))]


def _norm_spec(name: str, source: str, width: int) -> list[TensorSpec]:
    return [TensorSpec(name + ".w", "vector", [source + ".weight"], (width,)),
            TensorSpec(name + ".b", "vector", [source + ".bias"], (width,))]


def _merger_plan(name: str, source: str, cfg: VisionConfig, norm_width: int) -> list[TensorSpec]:
    m = cfg.merged_size
    return (_norm_spec(f"{name}.norm", source + "norm", norm_width)
            + _linear_spec(f"{name}.fc1", source + "linear_fc1", (m, m))
            + _linear_spec(f"{name}.fc2", source + "linear_fc2", (cfg.out_hidden_size, m)))


def vision_plan(cfg: VisionConfig, prefix: str = "model.visual.") -> list[TensorSpec]:
    """Our vision tensors (named v.*) and the checkpoint tensors they come from."""
    e, p, t = cfg.hidden_size, cfg.patch_size, cfg.temporal_patch_size
    plan = [TensorSpec("v.patch", "vector", [prefix + "patch_embed.proj.weight"], (e, cfg.in_channels, t, p, p)),
            TensorSpec("v.patch.bias", "vector", [prefix + "patch_embed.proj.bias"], (e,)),
            TensorSpec("v.pos", "vector", [prefix + "pos_embed.weight"], (cfg.num_position_embeddings, e))]
    for i in range(cfg.depth):
        b, s = f"v.{i}", f"{prefix}blocks.{i}."
        plan += (_norm_spec(f"{b}.norm1", s + "norm1", e) + _norm_spec(f"{b}.norm2", s + "norm2", e)
                 + _linear_spec(f"{b}.qkv", s + "attn.qkv", (3 * e, e))
                 + _linear_spec(f"{b}.proj", s + "attn.proj", (e, e))
                 + _linear_spec(f"{b}.fc1", s + "mlp.linear_fc1", (cfg.intermediate_size, e))
                 + _linear_spec(f"{b}.fc2", s + "mlp.linear_fc2", (e, cfg.intermediate_size)))
    plan += _merger_plan("v.merger", prefix + "merger.", cfg, e)
    for j in range(len(cfg.deepstack_visual_indexes)):
        plan += _merger_plan(f"v.deepstack.{j}", f"{prefix}deepstack_merger_list.{j}.", cfg, cfg.merged_size)
    return plan


# ---- numerics that only the vision tower needs ------------------------------------------

def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Over the last axis of float32[..., D] (the kernel: numpy's took 0.3 s of a 448x448 encode)."""
    shape = x.shape
    return kernels.layer_norm(np.ascontiguousarray(x).reshape(-1, shape[-1]), w, b, eps).reshape(shape)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh form, in place (the kernel: numpy's tanh took 0.95 s of a 448x448 encode)."""
    return kernels.gelu_tanh(x, out=x)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2); erfc by Numerical Recipes' Chebyshev
    fit (relative error < 1.2e-7), since numpy has no erf."""
    z = -x.astype(np.float64) / math.sqrt(2.0)
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = (-1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    erfc_a = t * np.exp(-a * a + poly)
    erfc = np.where(z >= 0, erfc_a, 2.0 - erfc_a)
    return (0.5 * x * erfc).astype(np.float32)


ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu": gelu_erf}


def _linear(kind: str, t: dict, name: str) -> Linear:
    if name + ".qs" in t or name + ".ws" in t:
        return Linear.from_tensors(kind, t, name, bias=t[name + ".bias"])
    return Linear.from_tensors("f32", t, name, bias=t[name + ".bias"])


class PatchMerger:
    """A 2x2 group of patches -> one token: LayerNorm (before or after grouping), fc1, GELU, fc2."""

    def __init__(self, cfg: VisionConfig, kind: str, t: dict, name: str, norm_after_grouping: bool):
        self.width = cfg.merged_size
        self.norm_w, self.norm_b = t[f"{name}.norm.w"], t[f"{name}.norm.b"]
        self.norm_after_grouping = norm_after_grouping
        self.fc1, self.fc2 = _linear(kind, t, f"{name}.fc1"), _linear(kind, t, f"{name}.fc2")

    def __call__(self, h: np.ndarray, timer) -> np.ndarray:
        """float32[N, hidden] -> float32[N / merge**2, out_hidden]."""
        if self.norm_after_grouping:
            x = layer_norm(h.reshape(-1, self.width), self.norm_w, self.norm_b)
        else:
            x = layer_norm(h, self.norm_w, self.norm_b).reshape(-1, self.width)
        with timer.gemm():
            x = self.fc1(x)
        x = gelu_erf(x)
        with timer.gemm():
            return self.fc2(x)


class VisionBlock:
    def __init__(self, cfg: VisionConfig, i: int, kind: str, t: dict):
        b = f"v.{i}"
        self.cfg = cfg
        self.norm1 = (t[f"{b}.norm1.w"], t[f"{b}.norm1.b"])
        self.norm2 = (t[f"{b}.norm2.w"], t[f"{b}.norm2.b"])
        self.qkv, self.proj = _linear(kind, t, f"{b}.qkv"), _linear(kind, t, f"{b}.proj")
        self.fc1, self.fc2 = _linear(kind, t, f"{b}.fc1"), _linear(kind, t, f"{b}.fc2")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, timer) -> None:
        """Update h float32[N, hidden] in place; cos/sin float32[N, head_dim] (one image's patches)."""
        n, heads, hd = h.shape[0], self.cfg.num_heads, self.cfg.head_dim
        x = layer_norm(h, *self.norm1)
        with timer.gemm():
            qkv = self.qkv(x).reshape(n, 3, heads, hd)
        q = _rotate(qkv[:, 0], cos, sin)                          # [N, heads, hd]
        k = _rotate(qkv[:, 1], cos, sin)
        with timer.attn():
            a = _attention(q, k, qkv[:, 2], np.float32(1.0 / math.sqrt(hd)))
        with timer.gemm():
            h += self.proj(a.reshape(n, heads * hd))
            x = self.fc1(layer_norm(h, *self.norm2))
        x = self.act(x)
        with timer.gemm():
            h += self.fc2(x)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: np.float32) -> np.ndarray:
    """Bidirectional attention of one image's patches: q, k, v float32[N, heads, hd] -> float32[N,
    heads, hd]. With head_dim a multiple of 32 (every Qwen3-VL tower: 64), on the attention kernel's
    float32 path: the patches are one cache block [1, heads, N, hd] that every query sees whole
    (all query positions last). No [heads, N, N] score matrix (39 MB a block at 448x448) and no
    BLAS threads spinning beside the GEMMs' pool: 70 -> 32 ms a block on 2 Zen 3 cores."""
    n, heads, hd = q.shape
    if hd % QK:
        kh, vh = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        s = np.matmul(q.transpose(1, 0, 2), kh.transpose(0, 2, 1)) * scale     # [heads, N, N]
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(-1, keepdims=True)
        return np.ascontiguousarray(np.matmul(s, vh).transpose(1, 0, 2))
    block = np.zeros(1, np.int32)          # table and block position: the one block, at 0
    return kernels.attention_f32(np.ascontiguousarray(q), np.ascontiguousarray(k.transpose(1, 0, 2))[None],
                                 np.ascontiguousarray(v.transpose(1, 0, 2))[None], block, block,
                                 np.full(1, n, np.int32), np.full(n, n - 1, np.int32), float(scale))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: x float32[N, heads, hd], cos/sin float32[N, hd]."""
    half = x.shape[-1] // 2
    out = x * cos[:, None, :]
    out[..., :half] -= x[..., half:] * sin[:, None, :half]
    out[..., half:] += x[..., :half] * sin[:, None, half:]
    return out


class VisionTower:
    """One image's patches -> (image-token embeddings, DeepStack features per decoder layer)."""

    def __init__(self, cfg: VisionConfig, kind: str, t: dict):
        self.cfg = cfg
        e = cfg.hidden_size
        # Frames of an image are identical: sum the kernel over them (float32[hidden, 3, P, P]).
        folded = np.ascontiguousarray(t["v.patch"].sum(axis=2).reshape(e, -1), dtype=np.float32)
        self.patch_embed = _quantized_linear(kind, folded, t["v.patch.bias"])
        self.pos = t["v.pos"]
        self.side = int(math.isqrt(cfg.num_position_embeddings))
        self.blocks = [VisionBlock(cfg, i, kind, t) for i in range(cfg.depth)]
        self.merger = PatchMerger(cfg, kind, t, "v.merger", norm_after_grouping=False)
        self.deepstack = [PatchMerger(cfg, kind, t, f"v.deepstack.{j}", norm_after_grouping=True)
                          for j in range(len(cfg.deepstack_visual_indexes))]
        hd = cfg.head_dim
        self.inv_freq = rope_inv_freq(cfg.rope_theta, hd // 2)                  # [hd/4]

    def __call__(self, pixel_values: np.ndarray, grid_thw, timer) -> tuple[np.ndarray, list[np.ndarray]]:
        """pixel_values float32[N, 3*T*P*P] of one image -> (float32[N/4, out_hidden],
        [float32[N/4, out_hidden] per DeepStack layer])."""
        cfg = self.cfg
        t, gh, gw = (int(v) for v in grid_thw)
        if t != 1:
            raise ValueError("only still images (one temporal patch) are supported")
        n = gh * gw
        x = pixel_values.reshape(n, cfg.in_channels, cfg.temporal_patch_size, -1)[:, :, 0].reshape(n, -1)
        with timer.gemm():
            h = self.patch_embed(np.ascontiguousarray(x))
        rows, cols = self._patch_rows_cols(gh, gw)
        h += self._position_embedding(rows, cols, gh, gw)
        cos, sin = self._rotary(rows, cols)
        features = []
        for i, block in enumerate(self.blocks):
            block(h, cos, sin, timer)
            if i in cfg.deepstack_visual_indexes:
                features.append(self.deepstack[cfg.deepstack_visual_indexes.index(i)](h, timer))
        return self.merger(h, timer), features

    def _patch_rows_cols(self, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray]:
        """Row and column of every patch, in the merge-block order of the patches."""
        m = self.cfg.spatial_merge_size
        r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        order = lambda a: a.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
        return order(r), order(c)

    def _position_embedding(self, rows, cols, gh: int, gw: int) -> np.ndarray:
        """The square learned table resampled to gh x gw (bilinear, align_corners): float32[N, hidden]."""
        side = self.side

        def taps(index, size):
            src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            floor = np.floor(src)
            lo = np.clip(floor.astype(np.int64), 0, side - 1)
            hi = np.clip(floor.astype(np.int64) + 1, 0, side - 1)
            frac = src - floor
            return lo, hi, np.clip(1 - frac, 0, None), np.clip(1 - np.abs(frac - 1), 0, None)

        h0, h1, wh0, wh1 = taps(rows, gh)
        w0, w1, ww0, ww1 = taps(cols, gw)
        pos = self.pos
        out = (pos[h0 * side + w0] * (wh0 * ww0)[:, None] + pos[h0 * side + w1] * (wh0 * ww1)[:, None]
               + pos[h1 * side + w0] * (wh1 * ww0)[:, None] + pos[h1 * side + w1] * (wh1 * ww1)[:, None])
        return out.astype(np.float32)

    def _rotary(self, rows, cols) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin float32[N, head_dim]: frequencies of the patch row, then of its column, twice."""
        half = np.concatenate([rows[:, None].astype(np.float32) * self.inv_freq,
                               cols[:, None].astype(np.float32) * self.inv_freq], axis=1)
        angles = np.concatenate([half, half], axis=1)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _quantized_linear(kind: str, w: np.ndarray, bias: np.ndarray) -> Linear:
    """A Linear from a float32 weight computed at load (the folded patch kernel)."""
    if kind == "f32" or w.shape[1] % QK:
        return Linear("f32", *w.shape, w=w, bias=bias)
    from appliance.kernels import quant
    if kind == "q4":
        qs, d = quant.quantize_q4_0(w)
    else:
        qs, d = quant.quantize_q8_0(w)
    return Linear(kind, w.shape[0], w.shape[1], qs=qs, d=d, bias=bias)
