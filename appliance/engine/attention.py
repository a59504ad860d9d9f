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
        self._lists = None     # (batch, its _batch_step): the same in every layer of a step

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: Batch) -> np.ndarray:
        """q float32[M, Hq, hd], k/v float32[M, n_kv, hd] -> float32[M, Hq*hd]."""
        out = np.empty(q.shape, np.float32)
        lists = self.write_step(layer, k, v, batch)
        if lists is None:
            for seg in batch.segments:
                rows = slice(seg.row_start, seg.row_end)
                self.attend(layer, q[rows], seg, out[rows], seg.table, seg.blockpos, seg.count)
        else:
            # One call for the whole batch: every sequence's heads and block-list parts share the
            # threads, where a call per sequence ran short scans one after the other.
            c = self.cache
            ks = vs = None
            if c.k_scale is not None:
                ks, vs = c.k_scale[layer], c.v_scale[layer]
            kernels.attention_batch(c.kind, np.ascontiguousarray(q), c.k[layer], ks, c.v[layer], vs, *lists,
                                    self.scale, out=out)
        return out.reshape(q.shape[0], -1)

    def write_step(self, layer: int, k: np.ndarray, v: np.ndarray, batch: Batch, lists: bool = True) -> tuple | None:
        """Write the step's K/V rows of every segment; attention_batch's lists of the batch
        (_batch_step) when it makes them, else None."""
        step = self._batch_step(batch, k.shape[0], lists) if batch.segments else None
        if step is not None:
            parts, slots, batch_lists = step
            self.cache.write_batch(layer, parts, slots, k, v)
            return batch_lists
        for seg in batch.segments:
            rows = slice(seg.row_start, seg.row_end)
            self.cache.write(layer, seg.blocks, seg.pos_start, k[rows], v[rows])
        return None

    def _batch_step(self, batch: Batch, rows: int, lists: bool = True) -> tuple | None:
        """(parts, slots, lists) of a batch whose segments are its rows in order, made once per step
        (every layer writes to the same slots and reads the same blocks): the cache's write_batch
        arguments and, for several sequences and `lists`, attention_batch's (seq_rows, seq_lists,
        table, blockpos, count, qpos), else None; None for any other batch. A single sequence's slots
        made once a step, not once a layer: a decode step's 28 layers of writes take 0.38-0.41 ms
        instead of 0.59 (Zen 4)."""
        if self._lists is not None and self._lists[0] is batch:
            return self._lists[1]
        segs = batch.segments
        if segs[0].row_start != 0 or segs[-1].row_end != rows or \
                any(a.row_end != b.row_start for a, b in zip(segs, segs[1:])):
            return None
        parts = [(s.blocks, s.pos_start, s.row_end - s.row_start) for s in segs]
        step = (parts, self.cache.batch_slots(parts),
                self._batch_lists(segs) if lists and len(segs) > 1 else None)
        self._lists = (batch, step)
        return step

    @staticmethod
    def _batch_lists(segs: list[Segment]) -> tuple:
        """(seq_rows, seq_lists, table, blockpos, count, qpos) of attention_batch for segments that
        are a batch's rows in order."""
        sizes = np.array([len(s.table) for s in segs], np.int64)
        seq_lists = np.zeros((len(segs), 3), np.int64)
        seq_lists[1:, 0] = np.cumsum(sizes)[:-1]
        seq_lists[:, 1] = sizes
        seq_rows = np.array([s.row_start for s in segs] + [segs[-1].row_end], np.int64)
        return (seq_rows, seq_lists) + tuple(
            np.ascontiguousarray(np.concatenate([getattr(s, name) for s in segs]), dtype=np.int32)
            for name in ("table", "blockpos", "count", "qpos"))

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
