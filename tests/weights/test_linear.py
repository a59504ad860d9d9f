"""Linear and Embedding over either weight layout (rows, or strips where this CPU has a micro-kernel
for them): the same numbers from every method, one copy of a tied table, and a switch to keep rows."""
import numpy as np
import pytest

from appliance import Engine
from appliance.kernels import quant, strips
from appliance.kernels.dispatch import kernels
from appliance.weights import linear
from appliance.weights.linear import Embedding, Linear


def _tensors(rng, kind, n, k, name="w"):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    qs, d = quant.quantize_q4_0(w) if kind == "q4" else quant.quantize_q8_0(w)
    return {name + ".qs": qs, name + ".d": d}


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_both_layouts_give_the_same_layer(kind):
    rng = np.random.default_rng(0)
    t = _tensors(rng, kind, 37, 96)
    bias = rng.standard_normal(37).astype(np.float32)
    rows = Linear.from_tensors(kind, t, "w", bias=bias, pack=False)
    packed = Linear.from_tensors(kind, t, "w", bias=bias, pack=True)
    assert rows.ws is None and packed.ws is not None and packed.qs is None and packed.d is None
    x = rng.standard_normal((5, 96)).astype(np.float32)
    y_rows, y_packed = rows(x), packed(x)
    if kernels.strips_fast():       # the micro-kernel gives the SIMD row route's very bits
        assert np.array_equal(y_rows, y_packed)
    else:                           # elsewhere the scalar twin: the same up to the float order
        np.testing.assert_allclose(y_packed, y_rows, rtol=1e-5, atol=1e-6)
    xq, xd = quant.quantize_rows_q8(x)
    np.testing.assert_array_equal(packed.matmul_quantized(xq, xd), y_packed)
    ids = [36, 0, 17]
    for a, b in zip(rows.quantized_rows(ids), packed.quantized_rows(ids)):
        assert np.array_equal(a, b)
    np.testing.assert_array_equal(rows.dequantize_rows(ids), packed.dequantize_rows(ids))
    picked = packed.select_rows([3, 30])
    assert picked.n_out == 2
    np.testing.assert_allclose(picked(x), y_packed[:, [3, 30]], rtol=1e-6, atol=1e-7)
    assert packed.nbytes == strips.total_bytes(kind == "q4", 37, 96)     # 48 rows in 3 strips
    assert rows.nbytes < packed.nbytes < rows.nbytes * 48 / 37 + 3 * 64  # padding: rows, lines


def test_dequantized_rows_are_the_stored_weights():
    rng = np.random.default_rng(1)
    t = _tensors(rng, "q8", 20, 64)
    want = quant.dequantize_q8_0(t["w.qs"], t["w.d"])[[4, 19]]
    for pack in (False, True):
        np.testing.assert_array_equal(Linear.from_tensors("q8", t, "w", pack=pack).dequantize_rows([4, 19]), want)


def test_a_tied_table_is_held_once_and_looks_up_the_same_rows():
    rng = np.random.default_rng(2)
    t = _tensors(rng, "q8", 50, 64, name="embed")
    tied, plain = Embedding("q8", t, "embed", head=True), Embedding("q8", t, "embed")
    ids = np.array([0, 49, 7, 7])
    np.testing.assert_array_equal(tied.lookup(ids), plain.lookup(ids))
    assert tied.as_linear() is tied.table                      # the head is the table, not a copy
    assert plain.table.ws is None                              # a table only looked up stays in rows
    assert (tied.table.ws is not None) == linear.strips_wanted()


def test_the_switch_keeps_rows(monkeypatch):
    t = _tensors(np.random.default_rng(3), "q8", 16, 32)
    monkeypatch.setenv("APPLIANCE_GEMM_STRIPS", "0")
    assert not linear.strips_wanted()
    assert Linear.from_tensors("q8", t, "w").ws is None
    monkeypatch.setenv("APPLIANCE_GEMM_STRIPS", "1")
    assert linear.strips_wanted() == kernels.strips_fast()
    assert (Linear.from_tensors("q8", t, "w").ws is not None) == kernels.strips_fast()


@pytest.mark.skipif(not kernels.strips_fast(), reason="this CPU's GEMM keeps the row layout")
def test_an_engine_gives_the_same_logits_in_either_layout(monkeypatch, tiny_qwen3_dir):
    ids = list(range(3, 40))
    monkeypatch.setenv("APPLIANCE_GEMM_STRIPS", "0")
    rows = Engine.load(tiny_qwen3_dir, weights="q4", progress=False)
    monkeypatch.setenv("APPLIANCE_GEMM_STRIPS", "1")
    packed = Engine.load(tiny_qwen3_dir, weights="q4", progress=False)
    assert packed.model.layers[0].mlp.mlp.down.ws is not None and rows.model.layers[0].mlp.mlp.down.ws is None
    assert np.array_equal(rows.logits(ids), packed.logits(ids))
