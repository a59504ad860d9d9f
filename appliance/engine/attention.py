"""Attention over the paged KV cache: writes this step's K/V, then runs the kernel per segment.

Exact attention reads every visible block once per GQA group (kernels.attention_*).
Block-sparse attention (sparse.py) only changes which blocks each head reads.
"""
from __future__ import annotations

import math

import numpy as np

from appliance.engine.kv_cache import PagedKVCache
from appliance.engine.batch import Batch, Segment
from appliance.kernels.dispatch import kernels


class ExactAttention:
    def __init__(self, cache: PagedKVCache, head_dim: int):
        self.cache = cache
        self.scale = 1.0 / math.sqrt(head_dim)

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: Batch) -> np.ndarray:
        """q float32[M, Hq, hd], k/v float32[M, n_kv, hd] -> float32[M, Hq*hd]."""
        out = np.empty(q.shape, np.float32)
        for seg in batch.segments:
            rows = slice(seg.row_start, seg.row_end)
            self.cache.write(layer, seg.blocks, seg.pos_start, k[rows], v[rows])
            self.attend(layer, q[rows], seg, out[rows], seg.table, seg.blockpos, seg.count)
        return out.reshape(q.shape[0], -1)

    def attend(self, layer: int, q: np.ndarray, seg: Segment, out: np.ndarray,
               table: np.ndarray, blockpos: np.ndarray, count: np.ndarray,
               importance: np.ndarray | None = None) -> None:
        """importance float32[n_positions], if given, also gets the softmax mass each row received."""
        c = self.cache
        q = np.ascontiguousarray(q)
        if c.kind == "q8":
            kernels.attention_q8(q, c.k[layer], c.k_scale[layer], c.v[layer], c.v_scale[layer],
                                 table, blockpos, count, seg.qpos, self.scale, out=out, importance=importance)
        elif c.kind == "q4":
            kernels.attention_q4(q, c.k[layer], c.k_scale[layer], c.v[layer], c.v_scale[layer],
                                 table, blockpos, count, seg.qpos, self.scale, out=out, importance=importance)
        else:
            kernels.attention_f32(q, c.k[layer], c.v[layer], table, blockpos, count, seg.qpos,
                                  self.scale, out=out, importance=importance)
