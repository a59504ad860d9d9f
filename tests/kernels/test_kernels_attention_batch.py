"""attention_batch: several sequences in one call, each bit for bit its own attention_<kind>; and long
block lists, which the driver scans in parts on several threads, agreeing with themselves whatever the
tile, the batch or the thread count."""
import numpy as np
import pytest

from appliance.kernels import _kernels as K
from appliance.kernels import reference

from kernel_cases import PATHS, PagedCase, make_case
from test_kernels_attention import _check_same_definition, _run, attn_tol

N_KV, GROUP, HD, BS = 2, 2, 64, 16


def _cache(rng, kind, nblk):
    """One layer holding nblk random blocks in `kind`, plus its float rows and dequantized rows."""
    k = rng.standard_normal((nblk, N_KV, BS, HD)).astype(np.float32)
    v = rng.standard_normal((nblk, N_KV, BS, HD)).astype(np.float32)
    case = PagedCase(np.zeros((1, N_KV * GROUP, HD), np.float32), k, v, None, None, None, None, 0.125)
    if kind == "f32":
        return (k, None, v, None), k, v
    (kq, ks, vq, vs), k_deq, v_deq = case.q8() if kind == "q8" else case.q4()
    return (kq, ks, vq, vs), k_deq, v_deq


# (T, context, per-head nsel or None) of a mixed step: decode rows, a prefill chunk, a long context
# (a list scanned in parts), per-head sparse lists, a sequence with no block yet, a short sparse one.
SEQUENCES = [(1, 37, None), (5, 80, None), (1, 16 * 70 + 3, None), (3, 16 * 40, 9), (1, 0, None), (2, 200, 3)]


def _lists(rng, nblk, seqs):
    """Concatenated (table, blockpos, count, qpos) and seq_rows / seq_lists for attention_batch,
    plus each sequence's own arguments for attention_<kind>."""
    tables, poss, counts, qposs, rows, lists, own = [], [], [], [], [0], [], []
    entries = 0
    for T, context, nsel in seqs:
        nlog = -(-context // BS)
        phys = rng.choice(nblk, size=nlog, replace=False).astype(np.int32)
        cnt = np.full(nlog, BS, np.int32)
        if nlog:
            cnt[-1] = context - (nlog - 1) * BS
        if nsel is None:
            logical = np.arange(nlog, dtype=np.int32)
            stride = 0
        else:
            logical = np.stack([np.sort(rng.choice(nlog, size=nsel, replace=False)) for _ in range(N_KV)])
            logical = logical.astype(np.int32)
            stride = nsel
        table, count = phys[logical], cnt[logical]
        qpos = np.arange(max(0, context - T), max(0, context - T) + T, dtype=np.int32)
        own.append((table, logical, count, qpos))
        tables.append(table.ravel())
        poss.append(logical.ravel())
        counts.append(count.ravel())
        qposs.append(qpos)
        lists.append((entries, logical.shape[-1], stride))
        entries += logical.size
        rows.append(rows[-1] + T)
    cat = [np.ascontiguousarray(np.concatenate(a).astype(np.int32)) for a in (tables, poss, counts, qposs)]
    return cat, np.array(rows, np.int64), np.array(lists, np.int64).reshape(-1, 3), own


def _single(kind, q, cache, table, blockpos, count, qpos, path, threads=0):
    kq, ks, vq, vs = cache
    if kind == "f32":
        return K.attention_f32(q, kq, vq, table, blockpos, count, qpos, 0.125, path=path, threads=threads)
    fn = K.attention_q8 if kind == "q8" else K.attention_q4
    return fn(q, kq, ks, vq, vs, table, blockpos, count, qpos, 0.125, path=path, threads=threads)


@pytest.mark.parametrize("kind", ("q8", "q4", "f32"))
@pytest.mark.parametrize("path", PATHS)
def test_batch_is_each_sequence_alone_bit_for_bit(kind, path):
    rng = np.random.default_rng(1 + ("q8", "q4", "f32").index(kind))
    nblk = 90
    cache, k_deq, v_deq = _cache(rng, kind, nblk)
    (table, blockpos, count, qpos), seq_rows, seq_lists, own = _lists(rng, nblk, SEQUENCES)
    q = rng.standard_normal((int(seq_rows[-1]), N_KV * GROUP, HD)).astype(np.float32)
    kq, ks, vq, vs = cache
    outs = [K.attention_batch(kind, q, kq, ks, vq, vs, seq_rows, seq_lists, table, blockpos, count, qpos, 0.125,
                              path=path, threads=t) for t in (1, 2, 3)]
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    for s, args in enumerate(own):
        rows = slice(int(seq_rows[s]), int(seq_rows[s + 1]))
        alone = _single(kind, np.ascontiguousarray(q[rows]), cache, *args, path)
        assert np.array_equal(outs[0][rows], alone), s
    assert not outs[0][int(seq_rows[4]):int(seq_rows[5])].any()     # the sequence with no block
    twin = reference.attention_batch(kind, q, kq, ks, vq, vs, seq_rows, seq_lists, table, blockpos, count,
                                     qpos, 0.125)
    assert np.abs(outs[0] - twin).max() <= 10 * attn_tol(kind, path) * np.abs(v_deq).max()


@pytest.mark.parametrize("kind", ("q8", "q4", "f32"))
def test_long_list_parts_agree_with_the_definition_and_with_one_query_at_a_time(kind):
    """Past ATTN_SPLIT_BLOCKS listed blocks a head's list is scanned in parts, merged in order: a query
    gets the same bits alone (decode) as in a tile of 5 (prefill), on 1 or 2 threads, and the
    definition's numbers."""
    rng = np.random.default_rng(21)
    case = make_case(rng, 5, 2, 2, 128, 32, 32 * 100 + 7)
    for path in PATHS:
        tile, k_deq, v_deq = _run(kind, case, path, threads=2)
        _check_same_definition(kind, case, tile, k_deq, v_deq, path)
        assert np.array_equal(tile, _run(kind, case, path, threads=1)[0])
        for t in (0, 4):
            one = PagedCase(case.q[t:t + 1].copy(), case.k_f32, case.v_f32, case.table, case.blockpos,
                            case.count, case.qpos[t:t + 1].copy(), case.scale)
            assert np.array_equal(_run(kind, one, path, threads=2)[0][0], tile[t])


def test_batch_rejects_bad_sequence_lists():
    rng = np.random.default_rng(3)
    cache, _, _ = _cache(rng, "q8", 10)
    kq, ks, vq, vs = cache
    q = rng.standard_normal((3, N_KV * GROUP, HD)).astype(np.float32)
    table = np.arange(6, dtype=np.int32)
    blockpos = np.arange(6, dtype=np.int32)
    count = np.full(6, BS, np.int32)
    qpos = np.array([15, 31, 47], np.int32)
    good_rows, good_lists = np.array([0, 1, 3], np.int64), np.array([[0, 2, 0], [2, 2, 2]], np.int64)
    K.attention_batch("q8", q, kq, ks, vq, vs, good_rows, good_lists, table, blockpos, count, qpos, 0.1)
    bad = [
        (np.array([0, 1, 2], np.int64), good_lists, "seq_rows must run from 0 to T = 3"),
        (good_rows, np.array([[0, 2, 0], [2, 3, 2]], np.int64), "stride 0 or at least nsel"),
        (good_rows, np.array([[0, 2, 0], [3, 2, 2]], np.int64), "reaches list entry 6, the table has 6"),
        (good_rows, np.array([[-1, 2, 0], [2, 2, 2]], np.int64), "must be >= 0"),
        (good_rows, good_lists[:1], r"seq_rows.shape\[0\] \(nseq \+ 1\) is 3, expected 2"),
    ]
    for rows, lists, message in bad:
        with pytest.raises(ValueError, match=message):
            K.attention_batch("q8", q, kq, ks, vq, vs, rows, lists, table, blockpos, count, qpos, 0.1)
    with pytest.raises(ValueError, match="seq_rows must not decrease"):
        K.attention_batch("q8", q, kq, ks, vq, vs, np.array([0, 2, 1, 3], np.int64),
                          np.array([[0, 1, 0], [1, 1, 0], [2, 1, 0]], np.int64), table, blockpos, count, qpos, 0.1)
    with pytest.raises(ValueError, match="kind must be q8, q4 or f32"):
        K.attention_batch("q5", q, kq, ks, vq, vs, good_rows, good_lists, table, blockpos, count, qpos, 0.1)
    bad_table = table.copy()
    bad_table[3] = 99
    with pytest.raises(ValueError, match="block list entry 3"):
        K.attention_batch("q8", q, kq, ks, vq, vs, good_rows, good_lists, bad_table, blockpos, count, qpos, 0.1)
