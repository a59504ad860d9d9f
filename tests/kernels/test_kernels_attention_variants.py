"""The attention kernels' instantiations (kernels.h kernel_attention_variant): on x86 AVX2 and AVX-512
with VNNI, which must give the same bits on every kernel, every cache format and every shape the
wide code treats apart (a head pair and a lone head, 4-row groups, 128/64/32-column chunks).

The AVX-512 one runs only on a CPU that has it; elsewhere these tests skip and say so.
"""
import contextlib

import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import quant

from kernel_cases import make_case

VARIANTS = K.attention_variants()
needs_two = pytest.mark.skipif(len(VARIANTS) < 2, reason=f"this CPU runs one attention variant: {VARIANTS}")


@contextlib.contextmanager
def variant(name):
    before = K.attention_variant()
    K.set_attention_variant(name)
    try:
        yield
    finally:
        K.set_attention_variant(before)


def each_variant(run):
    """run() under every variant this CPU runs; the outputs as uint32 views, for bitwise comparison."""
    outs = []
    for name in VARIANTS:
        with variant(name):
            outs.append([np.asarray(o).view(np.uint32).copy() for o in run()])
    return outs


def assert_same_bits(outs):
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert np.array_equal(a, b), f"{int((a != b).sum())} of {a.size} values differ"


def caches(case, kind):
    if kind == "f32":
        return case.k_f32, None, case.v_f32, None
    return (case.q8() if kind == "q8" else case.q4())[0]


def attend(kind, case, threads=0, importance=None):
    k, ks, v, vs = caches(case, kind)
    lists = (case.table, case.blockpos, case.count, case.qpos, case.scale)
    if kind == "f32":
        return K.attention_f32(case.q, k, v, *lists, threads=threads, importance=importance)
    fn = K.attention_q8 if kind == "q8" else K.attention_q4
    return fn(case.q, k, ks, v, vs, *lists, threads=threads, importance=importance)


def test_the_variants_are_named_and_the_active_one_is_listed():
    assert K.attention_variant() in VARIANTS
    features = set(K.cpu_features().split())
    if K.kernel_path() == "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= features:
        assert VARIANTS[0] == "avx512-vnni" and K.attention_variant() == "avx512-vnni"
    with pytest.raises(ValueError, match="not one this build and CPU run"):
        K.set_attention_variant("avx1024")


@needs_two
@pytest.mark.parametrize("kind", ["q8", "q4", "f32"])
@pytest.mark.parametrize("T,n_kv,group,hd,context", [
    (1, 2, 2, 128, 300),    # decode: a head pair, 128-column rows
    (1, 2, 1, 128, 77),     # a lone head
    (1, 1, 3, 96, 50),      # a pair and a lone head; 64 + 32 columns
    (3, 2, 4, 128, 140),    # 4-row groups, 64-column chunks
    (6, 2, 2, 64, 150),     # a prefill tile, 64-column rows
    (1, 1, 5, 32, 40),      # 4 + 1 rows, 32-column rows
])
def test_attention_has_the_same_bits_under_every_variant(kind, T, n_kv, group, hd, context):
    case = make_case(np.random.default_rng(T * 100 + group), T, n_kv, group, hd, 32, context,
                     per_head=True, nsel=max(1, context // 64))
    assert_same_bits(each_variant(lambda: [attend(kind, case)]))


@needs_two
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_decode_on_the_pool_and_importance_have_the_same_bits(kind):
    long_case = make_case(np.random.default_rng(7), 1, 8, 2, 128, 32, 3000)
    prefill = make_case(np.random.default_rng(8), 5, 2, 2, 128, 32, 200)

    def run():
        importance = np.zeros(200, np.float32)
        return [attend(kind, long_case, threads=2), attend(kind, prefill, importance=importance), importance]

    assert_same_bits(each_variant(run))


@needs_two
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_batch_and_probes_have_the_same_bits(kind):
    case = make_case(np.random.default_rng(9), 3, 2, 2, 128, 32, 600)
    k, ks, v, vs = caches(case, kind)
    seq_rows = np.array([0, 1, 3], np.int64)
    nsel = case.table.shape[-1]
    seq_lists = np.array([[0, nsel, 0], [0, nsel, 0]], np.int64)
    keys = (k.astype(np.float32) * ks[..., None] if kind == "q8"
            else quant.unpack_q4(k).astype(np.float32).reshape(*k.shape[:-1], -1, 32) * ks[..., None])
    keys = keys.reshape(*k.shape[:3], -1)
    bk, bks = quant.quantize_bound_rows(keys.max(axis=2), keys.min(axis=2))

    def run():
        return [
            K.attention_batch(kind, case.q, k, ks, v, vs, seq_rows, seq_lists, case.table, case.blockpos,
                              case.count, case.qpos, case.scale),
            K.attention_probe(kind, case.q, k, ks, case.table, case.count, 8, case.scale),
            K.attention_probe_bound(kind, case.q, k, ks, bk, bks, case.table, case.count, 4, case.scale),
        ]

    assert_same_bits(each_variant(run))


@needs_two
def test_extreme_keys_and_queries_keep_exact_block_dots():
    """+-127 everywhere: the unsigned move of the keys (k + 128 up to 255) and the lanes' start
    (-128 * 4 * 127) at their ends still give AVX2's exact int32 dots."""
    case = make_case(np.random.default_rng(10), 2, 2, 2, 128, 32, 96)
    kq, ks, vq, vs = case.q8()[0]
    rng = np.random.default_rng(11)
    kq = rng.choice(np.array([-127, 127], np.int8), size=kq.shape)
    q = (rng.choice(np.array([-1.0, 1.0], np.float32), size=case.q.shape)).astype(np.float32)

    def run():
        return [K.attention_q8(q, kq, np.ones_like(ks), vq, vs, case.table, case.blockpos, case.count,
                               case.qpos, case.scale)]

    assert_same_bits(each_variant(run))
