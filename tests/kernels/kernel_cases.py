"""Case builders and error measures for the kernel tests.

What the kernels compute is defined once, in the package: appliance.kernels.quant (formats) and
appliance.kernels.reference (the numpy twin of every kernel, fed float64 here where the test
wants the definition in float64). What is here builds paged caches with scattered tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from appliance.kernels import quant

PATHS = ("portable", "simd")


def gemm_abs_bound(wq, wd, xq, xd, q4: bool = False) -> np.ndarray:
    """float64[M, N]: sum_b |dot_b * scale_b|, the scale of the float rounding in a GEMM."""
    w = quant.unpack_q4(wq) if q4 else wq
    n, k = w.shape
    m = xq.shape[0]
    dots = np.einsum("mbi,nbi->mnb", xq.reshape(m, -1, quant.QK).astype(np.int64),
                     w.reshape(n, -1, quant.QK).astype(np.int64))
    scale = xd.astype(np.float64)[:, None, :] * wd.astype(np.float64)[None, :, :]
    return np.abs(dots * scale).sum(axis=-1)


def quantize_q_rows(q: np.ndarray) -> np.ndarray:
    """q float[T, Hq, hd] -> float64[T, Hq, hd]: q as the kernels quantize it (int8 per 32-block)."""
    return quant.requantize_rows_q8(q, np.float64)


@dataclass
class PagedCase:
    """One layer's paged cache plus a query batch, in every KV format.

    k_f32/v_f32: float32[nblk, n_kv, bs, hd] (the unquantized rows; unused slots are garbage)
    table/blockpos/count: int32[nsel] (shared) or int32[n_kv, nsel] (per head)
    """
    q: np.ndarray
    k_f32: np.ndarray
    v_f32: np.ndarray
    table: np.ndarray
    blockpos: np.ndarray
    count: np.ndarray
    qpos: np.ndarray
    scale: float

    @property
    def n_kv(self) -> int:
        return self.k_f32.shape[1]

    def q8(self):
        kq, ks = quant.quantize_kv_q8(self.k_f32)
        vq, vs = quant.quantize_kv_q8(self.v_f32)
        k_deq = kq.astype(np.float64) * ks.astype(np.float64)[..., None]
        v_deq = vq.astype(np.float64) * vs.astype(np.float64)[..., None]
        return (kq, ks, vq, vs), k_deq, v_deq

    def q4(self):
        kq, ks = quant.quantize_kv_q4(self.k_f32)
        vq, vs = quant.quantize_kv_q4(self.v_f32)
        shape = self.k_f32.shape

        def deq(qs, d):
            x = quant.unpack_q4(qs).astype(np.float64).reshape(*shape[:-1], -1, quant.QK)
            return (x * d.astype(np.float64)[..., None]).reshape(shape)

        return (kq, ks, vq, vs), deq(kq, ks), deq(vq, vs)


def make_case(rng, T, n_kv, group, hd, bs, context, per_head=False, nsel=None, scatter=True,
              qpos=None, spare_blocks=3, scale=None, kscale=1.0) -> PagedCase:
    """A cache holding `context` tokens in ceil(context/bs) logical blocks, placed at scattered
    physical blocks (plus spare unused ones). Queries default to the last T positions (causal
    prefill chunk / decode). per_head selects `nsel` logical blocks per kv head (sparse lists)."""
    nlog = -(-context // bs)
    nblk = nlog + spare_blocks
    phys = rng.permutation(nblk)[:nlog] if scatter else np.arange(nlog)
    k = (rng.standard_normal((nblk, n_kv, bs, hd)) * kscale).astype(np.float32)
    v = rng.standard_normal((nblk, n_kv, bs, hd)).astype(np.float32)
    counts = np.full(nlog, bs, dtype=np.int32)
    counts[-1] = context - (nlog - 1) * bs
    if per_head:
        nsel = nlog if nsel is None else min(nsel, nlog)
        rows = [np.sort(rng.choice(nlog, size=nsel, replace=False)) for _ in range(n_kv)]
        logical = np.stack(rows).astype(np.int32)                 # int32[n_kv, nsel]
    else:
        logical = np.arange(nlog, dtype=np.int32)                 # int32[nlog]
    table = phys[logical].astype(np.int32)
    count = counts[logical].astype(np.int32)
    if qpos is None:
        qpos = np.arange(context - T, context, dtype=np.int32)
    q = rng.standard_normal((T, n_kv * group, hd)).astype(np.float32)
    if scale is None:
        scale = 1.0 / np.sqrt(hd)
    return PagedCase(q, k, v, table, logical.astype(np.int32), count, np.asarray(qpos, np.int32),
                     float(scale))


def nmse(x, ref) -> float:
    """Normalized mean squared error, as llama.cpp's test-backend-ops measures it."""
    ref = np.asarray(ref, dtype=np.float64)
    den = float(np.sum(ref * ref))
    return float(np.sum((np.asarray(x, np.float64) - ref) ** 2) / den) if den > 0 else 0.0
