"""Linear layers over packed weights: the model code never sees how weights are stored.

Q8_0 / Q4_0: the activation rows are quantized to int8 once, then one int8 GEMM
(GEMV when M == 1) runs over all output features. f32: a BLAS matmul (reference).

Where this CPU's GEMM has a micro-kernel for it (x86: AVX512-VNNI or plain AVX2), quantized weights are
held in strips (kernels/gemm_strips.h): 16 rows interleaved in the order the dot instruction
wants, which makes a decode step's GEMV and its batched GEMM 1.3-3x faster (docs/performance.md)
for the same bits. The weight cache stores them so (weights/loader.py) and they are mapped as
they are; matrices made at load are packed here. A matrix is held in one layout only.
APPLIANCE_GEMM_STRIPS=0 keeps the row layout.
"""
from __future__ import annotations

import os

import numpy as np

from appliance.kernels import quant
from appliance.kernels import strips as strips_layout
from appliance.kernels.dispatch import kernels
from appliance.kernels.quant import QK

QUANTIZED = ("q8", "q4")


def strips_wanted() -> bool:
    """True when quantized weights should be packed into strips on this machine."""
    return os.environ.get("APPLIANCE_GEMM_STRIPS", "1") != "0" and kernels.strips_fast()


class Linear:
    """y float32[M, N] = x float32[M, K] @ W.T, W packed as `kind`.

    Quantized weights are held either as rows (qs, d) or as strips (ws, uint8 1-D, 64-byte
    aligned). Given rows, `pack` chooses: None packs when strips_wanted(), False keeps rows,
    True packs."""

    __slots__ = ("kind", "qs", "d", "ws", "w", "n_out", "n_in", "bias")

    def __init__(self, kind: str, n_out: int, n_in: int, qs=None, d=None, w=None, bias=None,
                 pack: bool | None = None, ws=None):
        self.kind, self.n_out, self.n_in = kind, n_out, n_in
        self.qs, self.d, self.w, self.bias, self.ws = qs, d, w, bias, ws
        if ws is None and kind in QUANTIZED and (strips_wanted() if pack is None else pack):
            self.ws = kernels.pack_strips(qs, d, kind == "q4")
            self.qs = self.d = None

    @classmethod
    def from_tensors(cls, kind: str, tensors: dict, name: str, bias: np.ndarray | None = None,
                     pack: bool | None = None) -> "Linear":
        if kind == "f32":
            w = tensors[name]
            return cls("f32", w.shape[0], w.shape[1], w=w, bias=bias)
        if name + ".ws" in tensors:     # a cache in strips: the loader puts (N, K) beside them
            n_out, n_in = (int(v) for v in tensors[name + ".shape"])
            return cls(kind, n_out, n_in, ws=tensors[name + ".ws"].reshape(-1), bias=bias)
        qs, d = tensors[name + ".qs"], tensors[name + ".d"]
        n_in = d.shape[1] * QK
        return cls(kind, qs.shape[0], n_in, qs=qs, d=d, bias=bias, pack=pack)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.kind == "f32":
            y = np.matmul(x, self.w.T, out=out)
            if self.bias is not None:
                y += self.bias
            return y
        xq, xd = kernels.quantize_rows_q8(x)
        return self.matmul_quantized(xq, xd, out=out)

    def matmul_quantized(self, xq: np.ndarray, xd: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The layer on activation rows already quantized (int8[M, K], float32[M, K/32]): callers
        that feed one input to several layers (a MoE layer's experts) quantize it once."""
        q4 = self.kind == "q4"
        if self.ws is not None:
            y = kernels.gemm_strips(self.ws, self.n_out, self.n_in, q4, xq, xd, out=out)
        else:
            y = (kernels.gemm_q4 if q4 else kernels.gemm_q8)(self.qs, self.d, xq, xd, out=out)
        if self.bias is not None:
            y += self.bias
        return y

    def quantized_rows(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """The stored weights of output rows `ids` in the row layout (qs, d float16), copied."""
        if self.ws is not None:
            return strips_layout.rows(self.ws, self.n_out, self.n_in, self.kind == "q4", ids)
        return np.ascontiguousarray(self.qs[ids]), np.ascontiguousarray(self.d[ids])

    def dequantize_rows(self, ids) -> np.ndarray:
        """float32[len(ids), K]: output rows `ids` of W as the GEMM sees them."""
        if self.kind == "f32":
            return self.w[ids].astype(np.float32, copy=True)
        qs, d = self.quantized_rows(ids)
        q = quant.unpack_q4(qs) if self.kind == "q4" else qs
        n = len(q)
        return (q.astype(np.float32).reshape(n, -1, QK) * d.astype(np.float32)[..., None]).reshape(n, -1)

    def select_rows(self, ids) -> "Linear":
        """A Linear of output rows `ids` only, with the very same weights (a reranker's yes/no head)."""
        if self.kind == "f32":
            return Linear("f32", len(ids), self.n_in, w=np.ascontiguousarray(self.w[ids]),
                          bias=None if self.bias is None else self.bias[ids])
        qs, d = self.quantized_rows(ids)
        return Linear(self.kind, len(ids), self.n_in, qs=qs, d=d,
                      bias=None if self.bias is None else self.bias[ids])

    @property
    def nbytes(self) -> int:
        if self.kind == "f32":
            return self.w.nbytes
        if self.ws is not None:
            return self.ws.nbytes
        return self.qs.nbytes + self.d.nbytes


class Embedding:
    """Token rows of the embedding table, dequantized on lookup; can serve as a tied lm_head.

    `head`: the table is also the output head (tied embeddings), so given rows it is packed as the
    GEMM wants it (a cache in strips holds every table so); lookups read rows from that one copy."""

    def __init__(self, kind: str, tensors: dict, name: str, head: bool = False):
        self.kind = kind
        self.table = Linear.from_tensors(kind, tensors, name, pack=None if head else False)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self.table.dequantize_rows(ids)

    def as_linear(self) -> Linear:
        return self.table
