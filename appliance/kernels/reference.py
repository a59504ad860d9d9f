"""Numpy twin of the compiled kernels: the functions of appliance.kernels._kernels, same names and
signatures (tests/kernels/test_kernel_contract.py holds the two modules to that).

They define what the kernels compute (tests hold both C paths to them) and let the engine run
where the extension is not built (APPLIANCE_KERNELS=numpy, chosen in dispatch.py), slowly.
`path` and `threads` are accepted and ignored: there is one numpy path, on the calling thread.
Float arithmetic follows the inputs' dtype, so a test can pass float64 arrays and get the
definition in float64.
"""
from __future__ import annotations

import numpy as np

from appliance.kernels import quant, strips


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


def strips_fast():
    return False            # numpy gains nothing from the layout: engines keep the row layout here


def pack_strips(wq, wd, q4):
    return strips.pack(wq, wd, bool(q4))


def gemm_strips(ws, N, K, q4, xq, xd, out=None, path="simd", threads=0):
    qs, d = strips.unpack(ws, N, K, bool(q4))
    return (gemm_q4 if q4 else gemm_q8)(qs, d, xq, xd, out=out)


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


def layer_norm(x, w, b, eps, out=None, path="simd"):
    mean = x.mean(-1, keepdims=True, dtype=np.float64).astype(np.float32)
    d = x - mean
    y = d / np.sqrt((d * d).mean(-1, keepdims=True) + np.float32(eps)) * w + b
    if out is not None:
        out[...] = y
        return out
    return y.astype(np.float32)


def gelu_tanh(x, out=None, path="simd"):
    """As the kernels: x / (1 + exp(-2z)), x raised to -20 first (1 + tanh(z) cancels in float32)."""
    v = np.maximum(x, np.float32(-20.0))
    with np.errstate(over="ignore"):
        y = v / (np.float32(1.0) + np.exp(np.float32(-1.5957691216057308) * (v + np.float32(0.044715) * v * v * v)))
    if out is not None:
        out[...] = y
        return out
    return y.astype(np.float32)


_dequantize_kv = quant.dequantize_kv
_q8 = quant.requantize_rows_q8


def _attention(q, k, v, table, blockpos, count, qpos, scale, kind, out, importance=None):
    t_len, hq, hd = q.shape
    n_kv = k.shape[1]
    bs = k.shape[2]
    group = hq // n_kv
    if kind != "f32":
        q = _q8(q)
    table = np.asarray(table)
    if table.ndim == 1:
        table, blockpos, count = (np.broadcast_to(a, (n_kv, a.shape[0])) for a in (table, blockpos, count))
    # A query that sees no row gets zeros, as in the kernels.
    result = np.zeros((t_len, hq, hd), np.result_type(q.dtype, k.dtype, v.dtype, np.float32))
    for h in range(n_kv):
        rows_k, rows_v, positions = [], [], []
        for b, lb, c in zip(table[h], blockpos[h], count[h]):
            rows_k.append(k[b, h, :c])
            rows_v.append(v[b, h, :c])
            positions.append(lb * bs + np.arange(c))
        if not rows_k:
            continue
        kh, vh, ph = np.concatenate(rows_k), np.concatenate(rows_v), np.concatenate(positions)
        for t in range(t_len):
            visible = ph <= qpos[t]
            if not visible.any():
                continue
            for j in range(h * group, (h + 1) * group):
                s = (kh[visible] @ q[t, j]) * scale
                w = np.exp(s - s.max())
                result[t, j] = (w @ vh[visible]) / w.sum()
                if importance is not None:
                    pos = ph[visible]
                    keep = pos < len(importance)
                    np.add.at(importance, pos[keep], (w / w.sum())[keep].astype(importance.dtype))
    if out is not None:
        out[...] = result
        return out
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


def attention_batch(kind, q, k, ks, v, vs, seq_rows, seq_lists, table, blockpos, count, qpos, scale, out=None,
                    path="simd", threads=0):
    """Several sequences in one call (kernels.h attention_batch): each one's rows are attention_<kind>
    of its rows and its block list (list0, nsel, stride) alone."""
    if kind not in ("q8", "q4", "f32"):
        raise ValueError(f"kind must be q8, q4 or f32, not {kind!r}")
    n_kv = k.shape[1]
    result = np.zeros(q.shape, np.float32) if out is None else out
    for s, (list0, nsel, stride) in enumerate(np.asarray(seq_lists).tolist()):
        rows = slice(int(seq_rows[s]), int(seq_rows[s + 1]))
        if stride:
            idx = list0 + np.arange(n_kv)[:, None] * stride + np.arange(nsel)[None, :]
        else:
            idx = list0 + np.arange(nsel)
        lists = [np.asarray(a)[idx] for a in (table, blockpos, count)]
        if kind == "f32":
            got = attention_f32(q[rows], k, v, *lists, qpos[rows], scale)
        else:
            fn = attention_q8 if kind == "q8" else attention_q4
            got = fn(q[rows], k, ks, v, vs, *lists, qpos[rows], scale)
        result[rows] = got
    return result


def attention_probe(kind, q, k, ks, table, count, probe, scale, pk=None, pks=None, path="simd", threads=0):
    """Block-sparse probe scores float32[n_kv, nblocks] (kernels.h); pk/pks hold the same values
    as k's sampled rows, so the definition reads k alone."""
    r_len, hq, hd = q.shape
    n_kv = k.shape[1]
    group = hq // n_kv
    if kind != "f32":
        q = _q8(q)
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
    qs = q if kind == "f32" else _q8(q)
    q_pos, q_neg = _q8(np.maximum(q, 0)), _q8(np.minimum(q, 0))
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


# ---- KV cache writes and block choice (plain C only in the compiled module) -----------------

_KV_QUANTIZERS = {"q8": quant.quantize_kv_q8, "q4": quant.quantize_kv_q4}


def kv_store(kind, x, slots, dst, scale, path="simd"):
    """Write x float32[T, n_kv, hd] into one layer's cache arrays at slots int32[T] (block*bs + offset)."""
    if kind not in ("q8", "q4", "f32"):
        raise ValueError(f"kind must be one of q8, q4, f32, not {kind!r}")
    x = np.asarray(x, dtype=np.float32)
    slots = np.asarray(slots, dtype=np.intp)
    bs = dst.shape[2]
    blocks, offsets = slots // bs, slots % bs
    # Fancy indexes (blocks, :, offsets) put the token axis first: [T, n_kv, ...].
    if kind == "f32":
        dst[blocks, :, offsets] = x
        return
    q, d = _KV_QUANTIZERS[kind](x)
    dst[blocks, :, offsets] = q
    scale[blocks, :, offsets] = d


def select(scores, importance, k):
    """Chosen blocks bool[n_kv, nb] from probe scores float[n_kv, nb] and block importance float[>= nb]
    (or None), k per head (docs/engine.md, "Block-sparse attention"):
      1. (k+1)//2 blocks reserved for every head by importance (if any is > 0), ties to the lower index;
      2. the rest of the budget to each head's best scores, ties to the lower index;
      3. the last block (the current position) replaces the lowest-scoring pick if it was not chosen;
         reserved blocks are never displaced.
    k >= nb chooses every block; k <= 0 none. Deterministic: stable sorts.
    """
    scores = np.asarray(scores)
    n_kv, nb = scores.shape
    if k >= nb:
        return np.ones((n_kv, nb), dtype=bool)
    if k <= 0:
        return np.zeros((n_kv, nb), dtype=bool)
    reserved = np.zeros(nb, dtype=bool)
    if importance is not None and np.any(importance[:nb] > 0):
        reserved[np.argsort(-importance[:nb], kind="stable")[: (k + 1) // 2]] = True
    remaining = k - int(reserved.sum())
    order = np.argsort(-scores, axis=1, kind="stable")            # best first, ties: lower index
    candidate = ~reserved[order]
    rank = np.cumsum(candidate, axis=1)
    take = candidate & (rank <= remaining)
    chosen = np.zeros((n_kv, nb), dtype=bool)
    np.put_along_axis(chosen, order, take, axis=1)
    chosen |= reserved
    missing = ~chosen[:, nb - 1]
    if remaining > 0 and missing.any():
        # The lowest-scoring probe pick is the last one taken in score order.
        last_taken = np.argmax(take & (rank == remaining), axis=1)
        heads = np.nonzero(missing)[0]
        chosen[heads, order[heads, last_taken[heads]]] = False
        chosen[heads, nb - 1] = True
    return chosen


# ---- fp16 helpers and what this "build" is ----------------------------------------------------

def fp16_to_fp32(h):
    """uint16[n] (IEEE half bits) -> float32[n]."""
    return np.asarray(h, dtype=np.uint16).view(np.float16).astype(np.float32)


def fp32_to_fp16(x):
    """float32[n] -> uint16[n] (IEEE half bits, round to nearest even)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


_threads = 1


def set_threads(n):
    global _threads
    _threads = int(n)


def get_threads():
    return _threads


def kernel_path():
    return "numpy"


def gemm_variant():
    return "rows"


def gemm_variants():
    return ["rows"]


def set_gemm_variant(name):
    if name != "rows":
        raise ValueError(f"GEMM variant {name!r} is not one this build and CPU run: rows")


def attention_variant():
    return "numpy"


def attention_variants():
    return ["numpy"]


def attention_q8_weight_bits(path="simd"):
    return 0   # float64 throughout


def attention_q8_tolerance(path="simd"):
    return 2e-5


def set_attention_variant(name):
    if name != "numpy":
        raise ValueError(f"attention variant {name!r} is not one this build and CPU run: numpy")


def cpu_supported():
    return True


def cpu_features():
    return ""


def last_threads():
    """No compiled parallel region runs here: every family reads 0, as before its first call."""
    return {"gemm": 0, "attention": 0, "probe": 0, "probe_bound": 0}


def pool_stats():
    """No thread pool runs here: every counter reads 0."""
    return {"jobs": 0, "caller_chunks": 0, "worker_chunks": 0, "caller_sleeps": 0, "worker_wakeups": 0,
            "taken_back": 0}


def pool_stall_workers(us):
    """No workers here to stall."""
    if us < 0:
        raise ValueError(f"stall must be >= 0 microseconds, got {us}")


def pool_late_workers(us):
    """No workers here to delay."""
    if us < 0:
        raise ValueError(f"delay must be >= 0 microseconds, got {us}")


def pool_hold_workers(hold):
    """Nothing to hold: the numpy twin runs on the calling thread."""


def pool_set_spin_us(us):
    if us < 0:
        raise ValueError(f"spin must be >= 0 microseconds, got {us}")
