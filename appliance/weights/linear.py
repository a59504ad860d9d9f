"""Linear layers over packed weights: the model code never sees how weights are stored.

Q8_0 / Q4_0: the activation rows are quantized to int8 once, then one int8 GEMM
(GEMV when M == 1) runs over all output features. f32: a BLAS matmul (reference).
"""
from __future__ import annotations

import numpy as np

from appliance.kernels.dispatch import kernels
from appliance.kernels.quant import QK


class Linear:
    """y float32[M, N] = x float32[M, K] @ W.T, W packed as `kind`."""

    __slots__ = ("kind", "qs", "d", "w", "n_out", "n_in", "bias")

    def __init__(self, kind: str, n_out: int, n_in: int, qs=None, d=None, w=None, bias=None):
        self.kind, self.n_out, self.n_in = kind, n_out, n_in
        self.qs, self.d, self.w, self.bias = qs, d, w, bias

    @classmethod
    def from_tensors(cls, kind: str, tensors: dict, name: str, bias: np.ndarray | None = None) -> "Linear":
        if kind == "f32":
            w = tensors[name]
            return cls("f32", w.shape[0], w.shape[1], w=w, bias=bias)
        qs, d = tensors[name + ".qs"], tensors[name + ".d"]
        n_in = d.shape[1] * QK
        return cls(kind, qs.shape[0], n_in, qs=qs, d=d, bias=bias)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.kind == "f32":
            y = np.matmul(x, self.w.T, out=out)
        else:
            xq, xd = kernels.quantize_rows_q8(x)
            gemm = kernels.gemm_q8 if self.kind == "q8" else kernels.gemm_q4
            y = gemm(self.qs, self.d, xq, xd, out=out)
        if self.bias is not None:
            y += self.bias
        return y

    @property
    def nbytes(self) -> int:
        if self.kind == "f32":
            return self.w.nbytes
        return self.qs.nbytes + self.d.nbytes


class Embedding:
    """Token rows of the embedding table, dequantized on lookup; can serve as a tied lm_head."""

    def __init__(self, kind: str, tensors: dict, name: str):
        self.kind = kind
        if kind == "f32":
            self.w = tensors[name]
        else:
            self.qs, self.d = tensors[name + ".qs"], tensors[name + ".d"]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        if self.kind == "f32":
            return self.w[ids].astype(np.float32, copy=True)
        qs = self.qs[ids].astype(np.float32)
        scales = self.d[ids].astype(np.float32)
        return (qs.reshape(len(ids), -1, QK) * scales[..., None]).reshape(len(ids), -1)

    def as_linear(self) -> Linear:
        if self.kind == "f32":
            return Linear("f32", *self.w.shape, w=self.w)
        return Linear("q8", self.qs.shape[0], self.d.shape[1] * QK, qs=self.qs, d=self.d)
