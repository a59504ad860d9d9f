"""The vision tower's own numerics (appliance/models/vision.py) against float64 numpy; the whole
tower against transformers is tests/models/test_qwen3_vl.py."""
import math

import numpy as np
import pytest

from appliance.models import vision


def _attention_ref(q, k, v, scale):
    """float64 softmax attention over every patch: q, k, v [N, heads, hd] -> [N, heads, hd]."""
    q, k, v = (a.astype(np.float64).transpose(1, 0, 2) for a in (q, k, v))
    s = q @ k.transpose(0, 2, 1) * scale
    w = np.exp(s - s.max(-1, keepdims=True))
    return ((w / w.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2)


@pytest.mark.parametrize("n,heads,hd", [(784, 4, 64), (37, 3, 32), (16, 2, 40), (5, 1, 128)])
def test_attention_sees_every_patch(n, heads, hd):
    """head_dim a multiple of 32 runs on the attention kernel (one block, every query last), other
    head dims on numpy; both are softmax attention over all patches, the same on strided views."""
    rng = np.random.default_rng(n + heads + hd)
    qkv = rng.standard_normal((n, 3, heads, hd)).astype(np.float32) * 2
    scale = np.float32(1.0 / math.sqrt(hd))
    got = vision._attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], scale)
    assert got.shape == (n, heads, hd) and got.dtype == np.float32 and got.flags.c_contiguous
    want = _attention_ref(qkv[:, 0], qkv[:, 1], qkv[:, 2], scale)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_layer_norm_and_gelu_keep_shapes():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 6, 64)) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    y = vision.layer_norm(x, w, b)
    x64 = x.astype(np.float64)
    d = x64 - x64.mean(-1, keepdims=True)
    want = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-6) * w + b
    assert y.shape == x.shape
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    g = vision.gelu_tanh(x.copy())
    want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    assert g.shape == x.shape
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
