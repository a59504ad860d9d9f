"""A wrong call raises ValueError in the wrapper; it never reaches C."""
import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import quant

from kernel_cases import make_case

RNG = np.random.default_rng(0)
WQ, WD = quant.quantize_q8_0(RNG.standard_normal((8, 64)).astype(np.float32))
W4, WD4 = quant.quantize_q4_0(RNG.standard_normal((8, 64)).astype(np.float32))
XQ, XD = quant.quantize_rows_q8(RNG.standard_normal((2, 64)).astype(np.float32))


def _bad_gemm_calls():
    yield "wq float32", lambda: K.gemm_q8(WQ.astype(np.float32), WD, XQ, XD)
    yield "wd float32", lambda: K.gemm_q8(WQ, WD.astype(np.float32), XQ, XD)
    yield "xd float64", lambda: K.gemm_q8(WQ, WD, XQ, XD.astype(np.float64))
    yield "K mismatch", lambda: K.gemm_q8(WQ[:, :32].copy(), WD[:, :1].copy(), XQ, XD)
    yield "K not multiple of 32", lambda: K.gemm_q8(WQ[:, :48].copy(), WD[:, :1].copy(),
                                                    XQ[:, :48].copy(), XD[:, :1].copy())
    yield "wd rows", lambda: K.gemm_q8(WQ, WD[:4].copy(), XQ, XD)
    yield "xd rows", lambda: K.gemm_q8(WQ, WD, XQ, XD[:1].copy())
    yield "non-contiguous wq", lambda: K.gemm_q8(np.asfortranarray(WQ), WD, XQ, XD)
    yield "strided xq", lambda: K.gemm_q8(WQ, WD, np.repeat(XQ, 2, axis=1)[:, ::2], XD)
    yield "1-D xq", lambda: K.gemm_q8(WQ, WD, XQ[0], XD[0])
    yield "out shape", lambda: K.gemm_q8(WQ, WD, XQ, XD, out=np.empty((2, 7), np.float32))
    yield "out dtype", lambda: K.gemm_q8(WQ, WD, XQ, XD, out=np.empty((2, 8), np.float64))
    yield "out read-only", lambda: K.gemm_q8(WQ, WD, XQ, XD, out=_readonly(np.empty((2, 8), np.float32)))
    yield "bad path", lambda: K.gemm_q8(WQ, WD, XQ, XD, path="avx512")
    yield "negative threads", lambda: K.gemm_q8(WQ, WD, XQ, XD, threads=-1)
    yield "q4 wq int8", lambda: K.gemm_q4(W4.view(np.int8), WD4, XQ, XD)
    yield "q4 wq width", lambda: K.gemm_q4(W4[:, :16].copy(), WD4, XQ, XD)
    yield "q4 given q8 weights", lambda: K.gemm_q4(WQ.view(np.uint8), WD, XQ, XD)
    yield "list input", lambda: K.gemm_q8(WQ.tolist(), WD, XQ, XD)
    yield "quantize K", lambda: K.quantize_rows_q8(np.zeros((2, 33), np.float32))
    yield "quantize dtype", lambda: K.quantize_rows_q8(np.zeros((2, 32), np.float64))
    yield "rmsnorm w", lambda: K.rmsnorm(np.zeros((2, 8), np.float32), np.ones(7, np.float32), 1e-6)
    yield "rmsnorm 1-D x", lambda: K.rmsnorm(np.zeros(8, np.float32), np.ones(8, np.float32), 1e-6)
    yield "rope pos dtype", lambda: K.rope(np.zeros((2, 1, 8), np.float32), np.zeros(2, np.int64),
                                           np.ones(4, np.float32))
    yield "rope freq len", lambda: K.rope(np.zeros((2, 1, 8), np.float32), np.zeros(2, np.int32),
                                          np.ones(3, np.float32))
    yield "rope odd hd", lambda: K.rope(np.zeros((2, 1, 7), np.float32), np.zeros(2, np.int32),
                                        np.ones(3, np.float32))
    yield "rope read-only", lambda: K.rope(_readonly(np.zeros((2, 1, 8), np.float32)),
                                           np.zeros(2, np.int32), np.ones(4, np.float32))
    yield "silu shapes", lambda: K.silu_mul(np.zeros(4, np.float32), np.zeros(5, np.float32))
    yield "silu dtype", lambda: K.silu_mul(np.zeros(4, np.float64), np.zeros(4, np.float64))
    yield "silu strided", lambda: K.silu_mul(np.zeros(8, np.float32)[::2], np.zeros(4, np.float32))
    # rows may be strided (columns of a wider matrix), the values within a row may not
    yield "rmsnorm strided within a row", lambda: K.rmsnorm(np.zeros((2, 16), np.float32)[:, ::2],
                                                            np.ones(8, np.float32), 1e-6)
    yield "rmsnorm 4-D x", lambda: K.rmsnorm(np.zeros((2, 2, 2, 8), np.float32), np.ones(8, np.float32), 1e-6)
    yield "rmsnorm out shape", lambda: K.rmsnorm(np.zeros((2, 3, 8), np.float32), np.ones(8, np.float32), 1e-6,
                                                 out=np.empty((6, 8), np.float32))
    yield "rmsnorm strided out", lambda: K.rmsnorm(np.zeros((2, 8), np.float32), np.ones(8, np.float32), 1e-6,
                                                   out=np.empty((2, 16), np.float32)[:, :8])
    yield "silu rows strided within", lambda: K.silu_mul(np.zeros((2, 16), np.float32)[:, ::2],
                                                         np.zeros((2, 16), np.float32)[:, 8:])
    yield "silu row shapes", lambda: K.silu_mul(np.zeros((2, 16), np.float32)[:, :8],
                                                np.zeros((2, 16), np.float32)[:, 9:])
    yield "silu strided into strided out", lambda: K.silu_mul(np.zeros((2, 16), np.float32)[:, :8],
                                                              np.zeros((2, 16), np.float32)[:, 8:],
                                                              out=np.zeros((2, 16), np.float32)[:, :8])


def _readonly(a):
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("name,call", list(_bad_gemm_calls()), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_calls_raise_value_error(name, call):
    with pytest.raises(ValueError):
        call()


def _attn_args():
    case = make_case(np.random.default_rng(1), 2, 2, 2, 64, 16, 40)
    (kq, ks, vq, vs), _, _ = case.q8()
    return case, dict(q=case.q, k=kq, ks=ks, v=vq, vs=vs, table=case.table, blockpos=case.blockpos,
                      count=case.count, qpos=case.qpos, scale=case.scale)


def _bad_attention_args():
    case, a = _attn_args()
    nblk = a["k"].shape[0]
    yield "q heads not multiple of n_kv", dict(a, q=np.zeros((2, 3, 64), np.float32))
    yield "head_dim not multiple of 32", dict(a, q=np.zeros((2, 4, 48), np.float32))
    yield "k/v shapes", dict(a, v=a["v"][:, :, :8].copy())
    yield "ks shape", dict(a, ks=a["ks"][:1].copy())
    yield "k dtype", dict(a, k=a["k"].astype(np.float32))
    yield "table out of range", dict(a, table=np.full_like(case.table, nblk))
    yield "table negative", dict(a, table=-np.ones_like(case.table))
    yield "count above bs", dict(a, count=np.full_like(case.count, 17))
    yield "blockpos negative", dict(a, blockpos=-np.ones_like(case.blockpos))
    yield "table int64", dict(a, table=case.table.astype(np.int64))
    yield "count shape", dict(a, count=case.count[:-1].copy())
    yield "table rows != n_kv", dict(a, table=np.stack([case.table] * 3),
                                     blockpos=np.stack([case.blockpos] * 3), count=np.stack([case.count] * 3))
    yield "qpos length", dict(a, qpos=case.qpos[:1].copy())
    yield "out shape", dict(a, out=np.zeros((2, 4, 32), np.float32))
    yield "q non-contiguous", dict(a, q=np.zeros((2, 64, 4), np.float32).transpose(0, 2, 1))


@pytest.mark.parametrize("name,kwargs", list(_bad_attention_args()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_bad_attention_raises_value_error(name, kwargs):
    with pytest.raises(ValueError):
        K.attention_q8(**kwargs)


def test_bad_q4_and_f32_attention_shapes():
    case, a = _attn_args()
    (kq, ks, vq, vs), _, _ = case.q4()
    with pytest.raises(ValueError):   # q8-shaped scales for a q4 cache
        K.attention_q4(case.q, kq, a["ks"], vq, a["vs"], case.table, case.blockpos, case.count,
                       case.qpos, case.scale)
    with pytest.raises(ValueError):   # q8 cache passed as f32
        K.attention_f32(case.q, a["k"], a["v"], case.table, case.blockpos, case.count, case.qpos,
                        case.scale)
