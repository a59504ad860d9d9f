"""Q8_0 / Q4_0 packing in numpy: the reference the kernels are held to.

Layouts (see kernels/kernels.h, the one contract shared with C):
  Q8_0 weights: qs int8[N, K],    d float16[N, K/32]   w ~= d * qs
  Q4_0 weights: qs uint8[N, K/2], d float16[N, K/32]   w ~= d * (nibble - 8);
                inside a 32-block byte j holds element j (low nibble) and j+16 (high).
  activations:  q int8[M, K],     d float32[M, K/32]   (max-abs per 32-block)

Rounding is round-half-to-even everywhere (np.rint), which is what AVX2
`_mm256_cvtps_epi32` and NEON `vcvtnq_s32_f32` do, so the integer parts of the
kernels can agree with this file bit for bit.
"""
from __future__ import annotations

import numpy as np

QK = 32


def _blocks(x: np.ndarray) -> np.ndarray:
    """View float[..., K] as float32[..., K/32, 32]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {QK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _maxabs_int8(xb: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """int8 values and float32 scales for blocks along `axis`: d = amax/127, q = rint(x*127/amax)."""
    amax = np.max(np.abs(xb), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv).astype(np.int8)
    d = (amax / np.float32(127.0)).astype(np.float32)
    return q, np.squeeze(d, axis=axis)


def quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activations float[M, K] -> (int8[M, K], float32[M, K/32])."""
    xb = _blocks(x)
    q, d = _maxabs_int8(xb)
    return q.reshape(x.shape), d


def requantize_rows_q8(x: np.ndarray, dtype=np.float32) -> np.ndarray:
    """float[..., K] -> dtype[..., K]: x as the int8 kernels see it (quantize_rows_q8 per row of K,
    then each int8 times its block's scale, in `dtype`: float64 makes the product exact)."""
    shape = np.shape(x)
    q, d = quantize_rows_q8(np.reshape(x, (-1, shape[-1])))
    return (q.reshape(-1, shape[-1] // QK, QK).astype(dtype) * d.astype(dtype)[..., None]).reshape(shape)


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights float[N, K] -> Q8_0 (int8[N, K], float16[N, K/32])."""
    q, d = quantize_rows_q8(w)
    return q, d.astype(np.float16)


def _q4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float[..., K] -> (uint8[..., K/2] packed, float32[..., K/32] scales), Q4_0 as llama.cpp:
    d = (signed value of largest magnitude) / -8, q = clip(floor(x/d + 8.5), 0, 15)."""
    wb = _blocks(w)
    idx = np.argmax(np.abs(wb), axis=-1)[..., None]
    vmax = np.take_along_axis(wb, idx, axis=-1)
    d = (vmax / np.float32(-8.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.floor(wb * inv + np.float32(8.5)), 0, 15).astype(np.uint8)
    packed = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return packed.reshape(*w.shape[:-1], -1), d[..., 0]


def quantize_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights float[N, K] -> Q4_0 (uint8[N, K/2], float16[N, K/32])."""
    packed, d = _q4_blocks(w)
    return packed, d.astype(np.float16)


def unpack_q4(qs: np.ndarray) -> np.ndarray:
    """uint8[..., K/2] (Q4_0 nibble order) -> int8[..., K] with the -8 offset applied."""
    b = qs.reshape(*qs.shape[:-1], -1, QK // 2)
    lo = (b & 0x0F).astype(np.int8) - 8
    hi = (b >> 4).astype(np.int8) - 8
    return np.concatenate([lo, hi], axis=-1).reshape(*qs.shape[:-1], -1)


def dequantize_q8_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    n, k = qs.shape
    return (qs.reshape(n, -1, QK).astype(np.float32) * d.astype(np.float32)[..., None]).reshape(n, k)


def dequantize_q4_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    q = unpack_q4(qs)
    n, k = q.shape
    return (q.reshape(n, -1, QK).astype(np.float32) * d.astype(np.float32)[..., None]).reshape(n, k)


def gemm_q8_reference(wq, wd, xq, xd) -> np.ndarray:
    """y[m, n] = sum_b int32(xq_b . wq_b) * xd[m,b] * wd[n,b], exactly as the kernels define it."""
    n, k = wq.shape
    m = xq.shape[0]
    w_blocks = wq.reshape(n, -1, QK).astype(np.int32)
    x_blocks = xq.reshape(m, -1, QK).astype(np.int32)
    dots = np.einsum("mbi,nbi->mnb", x_blocks, w_blocks)  # int32[M, N, K/32]
    scale = xd[:, None, :] * wd.astype(np.float32)[None, :, :]
    return np.sum(dots.astype(np.float32) * scale, axis=-1, dtype=np.float32)


def gemm_q4_reference(wq, wd, xq, xd) -> np.ndarray:
    return gemm_q8_reference(unpack_q4(wq), wd, xq, xd)


# ---- KV cache rows ---------------------------------------------------------

def quantize_kv_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float[..., hd] -> (int8[..., hd], float32[...]): one max-abs scale per (token, kv head)."""
    x = np.asarray(x, dtype=np.float32)
    return _maxabs_int8(x)


def quantize_kv_q4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float[..., hd] -> (uint8[..., hd/2], float32[..., hd/32]): Q4_0 blocks, scales kept in float32."""
    return _q4_blocks(np.asarray(x, dtype=np.float32))


def dequantize_kv(k: np.ndarray, ks: np.ndarray | None, kind: str) -> np.ndarray:
    """KV cache rows back to float32: the inverse of quantize_kv_{q8,q4}; f32 rows as they are."""
    if kind == "q8":
        return k.astype(np.float32) * ks[..., None]
    if kind == "q4":
        vals = unpack_q4(k).astype(np.float32)
        shape = vals.shape
        return (vals.reshape(*shape[:-1], -1, QK) * ks[..., None]).reshape(shape)
    return k


def quantize_bound_rows(hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Channel-wise key maxima and minima float[..., hd] -> (int8[..., 2, hd], float32[..., 2]).

    q8 rows with one max-abs scale each, the maxima rounded up and the minima down, so that
    q+ . max + q- . min stays an upper bound of q . k after quantization.
    """
    rows = np.stack([hi, lo], axis=-2).astype(np.float32)
    d = np.abs(rows).max(axis=-1) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
    scaled = rows * inv[..., None]
    q = np.concatenate([np.ceil(scaled[..., :1, :]), np.floor(scaled[..., 1:, :])], axis=-2)
    return np.clip(q, -127, 127).astype(np.int8), d.astype(np.float32)

