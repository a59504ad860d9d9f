"""Numpy twins of the compiled kernels, with the same signatures as appliance._kernels.

They define what the kernels compute (tests hold both paths to them) and let the
engine run where the extension is not built (APPLIANCE_KERNELS=numpy), slowly.
"""
from __future__ import annotations

import numpy as np

from appliance.kernels import quant


def quantize_rows_q8(x, path="simd"):
    return quant.quantize_rows_q8(x)


def gemm_q8(wq, wd, xq, xd, out=None, path="simd", threads=0):
    y = quant.gemm_q8_reference(wq, wd, xq, xd)
    if out is not None:
        out[...] = y
        return out
    return y


def gemm_q4(wq, wd, xq, xd, out=None, path="simd", threads=0):
    return gemm_q8(quant.unpack_q4(wq), wd, xq, xd, out=out)


def rmsnorm(x, w, eps, out=None, path="simd"):
    x64 = x.astype(np.float32)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float32(eps)) * w
    if out is not None:
        out[...] = y
        return out
    return y.astype(np.float32)


def rope(x, pos, inv_freq, path="simd"):
    half = x.shape[-1] // 2
    angle = pos.astype(np.float32)[:, None] * inv_freq[None, :]       # [M, hd/2]
    c = np.cos(angle)[:, None, :]
    s = np.sin(angle)[:, None, :]
    x0 = x[..., :half].copy()
    x1 = x[..., half:].copy()
    x[..., :half] = x0 * c - x1 * s
    x[..., half:] = x1 * c + x0 * s


def silu_mul(gate, up, out=None, path="simd"):
    y = gate / (np.float32(1.0) + np.exp(-gate)) * up
    if out is not None:
        out[...] = y
        return out
    return y.astype(np.float32)


_dequantize_kv = quant.dequantize_kv


def _attention(q, k, v, table, blockpos, count, qpos, scale, kind, out, importance=None):
    t_len, hq, hd = q.shape
    n_kv = k.shape[1]
    bs = k.shape[2]
    group = hq // n_kv
    if kind != "f32":
        qq, qd = quant.quantize_rows_q8(q.reshape(-1, hd))
        q = (qq.reshape(-1, hd // quant.QK, quant.QK) * qd[..., None]).reshape(q.shape)
    table = np.asarray(table)
    if table.ndim == 1:
        table, blockpos, count = (np.broadcast_to(a, (n_kv, a.shape[0])) for a in (table, blockpos, count))
    result = np.zeros((t_len, hq, hd), np.float32) if out is None else out
    for h in range(n_kv):
        rows_k, rows_v, positions = [], [], []
        for b, lb, c in zip(table[h], blockpos[h], count[h]):
            rows_k.append(k[b, h, :c])
            rows_v.append(v[b, h, :c])
            positions.append(lb * bs + np.arange(c))
        kh, vh, ph = np.concatenate(rows_k), np.concatenate(rows_v), np.concatenate(positions)
        for t in range(t_len):
            visible = ph <= qpos[t]
            for j in range(h * group, (h + 1) * group):
                s = (kh[visible] @ q[t, j]) * scale
                w = np.exp(s - s.max())
                result[t, j] = (w @ vh[visible]) / w.sum()
                if importance is not None:
                    pos = ph[visible]
                    keep = pos < len(importance)
                    np.add.at(importance, pos[keep], (w / w.sum())[keep].astype(np.float32))
    return result


def attention_q8(q, k, ks, v, vs, table, blockpos, count, qpos, scale, out=None, path="simd", threads=0,
                 importance=None):
    return _attention(q, _dequantize_kv(k, ks, "q8"), _dequantize_kv(v, vs, "q8"),
                      table, blockpos, count, qpos, scale, "q8", out, importance)


def attention_q4(q, k, ks, v, vs, table, blockpos, count, qpos, scale, out=None, path="simd", threads=0,
                 importance=None):
    return _attention(q, _dequantize_kv(k, ks, "q4"), _dequantize_kv(v, vs, "q4"),
                      table, blockpos, count, qpos, scale, "q4", out, importance)


def attention_f32(q, k, v, table, blockpos, count, qpos, scale, out=None, path="simd", threads=0,
                  importance=None):
    return _attention(q, k, v, table, blockpos, count, qpos, scale, "f32", out, importance)


def attention_probe(kind, q, k, ks, table, count, probe, scale, pk=None, pks=None, path="simd", threads=0):
    """Block-sparse probe scores float32[n_kv, nblocks] (kernels.h); pk/pks hold the same values
    as k's sampled rows, so the definition reads k alone."""
    r_len, hq, hd = q.shape
    n_kv = k.shape[1]
    group = hq // n_kv
    if kind != "f32":
        qq, qd = quant.quantize_rows_q8(q.reshape(-1, hd))
        q = (qq.reshape(-1, hd // quant.QK, quant.QK) * qd[..., None]).reshape(q.shape)
    keys = _dequantize_kv(k, ks, kind)
    probe = max(1, probe)
    out = np.full((n_kv, len(table)), -np.inf, np.float32)
    for h in range(n_kv):
        qh = q[:, h * group:(h + 1) * group].reshape(-1, hd)
        for i, (b, c) in enumerate(zip(table, count)):
            rows = keys[b, h, 0:c:max(1, c // probe)]
            if len(rows):
                out[h, i] = np.float32((qh @ rows.T).max() * scale)
    return out


def attention_probe_bound(kind, q, k, ks, bk, bks, table, count, ncand, scale, path="simd", threads=0):
    """Bound-probe scores float32[n_kv, nblocks] (kernels.h attention_probe_bound): candidates by
    q+ . max + q- . min over the bound rows, then the exact max q . K over their rows."""
    r_len, hq, hd = q.shape
    n_kv, bs = k.shape[1], k.shape[2]
    group = hq // n_kv

    def q8(x):
        xq, xd = quant.quantize_rows_q8(x.reshape(-1, hd))
        return (xq.reshape(-1, hd // quant.QK, quant.QK) * xd[..., None]).reshape(x.shape)

    qs = q if kind == "f32" else q8(q)
    q_pos, q_neg = q8(np.maximum(q, 0)), q8(np.minimum(q, 0))
    keys = _dequantize_kv(k, ks, kind)
    rows = bk.astype(np.float32) * bks[..., None]                     # [nblk, n_kv, 2, hd]
    table, count = np.asarray(table), np.asarray(count)
    full = np.nonzero(count == bs)[0]
    out = np.full((n_kv, len(table)), -np.inf, np.float32)
    for h in range(n_kv):
        heads = slice(h * group, (h + 1) * group)
        qh, ph, nh = (a[:, heads].reshape(-1, hd) for a in (qs, q_pos, q_neg))
        bound = np.array([(ph @ rows[table[i], h, 0] + nh @ rows[table[i], h, 1]).max() for i in full])
        cand = set(full[np.argsort(-bound, kind="stable")[:min(ncand, len(full))]].tolist())
        for i, (b, c) in enumerate(zip(table, count)):
            if c > 0 and (i in cand or c < bs):
                out[h, i] = np.float32((qh @ keys[b, h, :c].T).max() * scale)
    return out


_threads = 1


def set_threads(n):
    global _threads
    _threads = int(n)


def get_threads():
    return _threads


def kernel_path():
    return "numpy"


def cpu_supported():
    return True


def cpu_features():
    return ""
