"""The strips weight layout (kernels/gemm_strips.h) in numpy: packing, and reading rows back.

The compiled `pack_strips` writes the same bytes (a test holds the two to that); this file is the
numpy twin's packer and the way Python code reads stored rows (an embedding lookup, the two rows
a reranker's head keeps) out of a weight held in strips, so no second copy of a matrix is kept.

A strip is 16 weight rows: per 32-block b of K the block's weights, then the rows' fp16 scales
[nb][16]; strips are padded to whole 64-byte lines with zero bytes, and rows past N hold w = 0 with
scale 0.
  q8: [nb][8 groups][16 rows][4 bytes], each byte w ^ 0x80 (w + 128 as unsigned);
  q4: [nb][4 groups][16 rows][4 bytes], the stored Q4_0 bytes 4j .. 4j+3 of the block unchanged.
"""
from __future__ import annotations

import numpy as np

from appliance.kernels.quant import QK

STRIP_ROWS = 16


def _block_bytes(q4: bool) -> int:
    return 256 if q4 else 512


def _groups(q4: bool) -> int:
    return 4 if q4 else 8


def strip_bytes(q4: bool, K: int) -> int:
    nb = K // QK
    return (nb * (_block_bytes(q4) + 2 * STRIP_ROWS) + 63) // 64 * 64


def strips_count(N: int) -> int:
    return (N + STRIP_ROWS - 1) // STRIP_ROWS


def total_bytes(q4: bool, N: int, K: int) -> int:
    return strips_count(N) * strip_bytes(q4, K)


def aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    """uint8[nbytes] whose first byte sits on an `align`-byte boundary (vector loads need it)."""
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def _views(ws: np.ndarray, N: int, K: int, q4: bool) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8[S, nb, groups, 16, 4], scales float16[S, nb, 16]) over the strips' bytes."""
    S, nb, sb = strips_count(N), K // QK, strip_bytes(q4, K)
    if ws.dtype != np.uint8 or ws.shape != (S * sb,):
        raise ValueError(f"ws: expected uint8[{S * sb}] (strips of a {N} x {K} weight), got "
                         f"{ws.dtype}{list(ws.shape)}")
    per = ws.reshape(S, sb)
    body = nb * _block_bytes(q4)
    blocks = per[:, :body].reshape(S, nb, _groups(q4), STRIP_ROWS, 4)
    scales = per[:, body:body + 2 * nb * STRIP_ROWS].view(np.float16).reshape(S, nb, STRIP_ROWS)
    return blocks, scales


def pack(wq: np.ndarray, wd: np.ndarray, q4: bool) -> np.ndarray:
    """Q8_0 (int8[N, K]) or Q4_0 (uint8[N, K/2]) weights and fp16 scales [N, K/32] -> the strips."""
    N, nb = wd.shape
    K = nb * QK
    S = strips_count(N)
    ws = aligned_empty(total_bytes(q4, N, K))
    ws[:] = 0
    blocks, scales = _views(ws, N, K, q4)
    flip = np.uint8(0 if q4 else 0x80)
    rows = np.full((S * STRIP_ROWS, wq.shape[1]), flip, np.uint8)     # rows past N: w = 0
    rows[:N] = wq.view(np.uint8) ^ flip
    # row r of strip s, block b, group g, byte i  <-  stored byte b*bpb + 4g + i of row 16s + r
    blocks[...] = rows.reshape(S, STRIP_ROWS, nb, _groups(q4), 4).transpose(0, 2, 3, 1, 4)
    d = np.zeros((S * STRIP_ROWS, nb), np.float16)
    d[:N] = wd.view(np.float16)
    scales[...] = d.reshape(S, STRIP_ROWS, nb).transpose(0, 2, 1)
    return ws


def rows(ws: np.ndarray, N: int, K: int, q4: bool, ids) -> tuple[np.ndarray, np.ndarray]:
    """The stored weights of rows `ids` back in the row layout: (qs [n, K or K/2], d float16[n, K/32])."""
    blocks, scales = _views(ws, N, K, q4)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= N):
        raise IndexError(f"row ids must lie in [0, {N})")
    s, lane = ids // STRIP_ROWS, ids % STRIP_ROWS
    picked = blocks[s, :, :, lane, :].reshape(len(ids), -1)        # [n, nb * groups * 4]
    qs = picked if q4 else (picked ^ np.uint8(0x80)).view(np.int8)
    return np.ascontiguousarray(qs), np.ascontiguousarray(scales[s, :, lane])


def unpack(ws: np.ndarray, N: int, K: int, q4: bool) -> tuple[np.ndarray, np.ndarray]:
    return rows(ws, N, K, q4, np.arange(N))
