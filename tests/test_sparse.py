"""Block-sparse attention: block selection on hand-made scores, and the engine end to end."""
from __future__ import annotations

import numpy as np
import pytest

from appliance import Engine
from appliance.engine.sparse import SparseAttention, SparseConfig, block_importance, select_blocks


def chosen(mask: np.ndarray) -> list[list[int]]:
    return [np.nonzero(row)[0].tolist() for row in mask]


def test_top_k_by_probe_score_with_recency():
    scores = np.array([[5.0, 1.0, 4.0, 3.0, 0.0]])
    # top-2 by score would be {0, 2}; the last block (4) displaces the lower of them (2).
    assert chosen(select_blocks(scores, None, 2)) == [[0, 4]]


def test_ties_go_to_the_lower_index():
    scores = np.array([[1.0, 2.0, 2.0, 2.0, 9.0]])
    assert chosen(select_blocks(scores, None, 3)) == [[1, 2, 4]]


def test_importance_reserves_half_and_is_never_displaced():
    scores = np.array([[9.0, 8.0, 7.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    importance = np.array([0.0, 0.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0])
    # k=4: budget (4+1)//2 = 2 -> blocks 5 then 4 reserved; probe fills 0, 1; recency: 7 replaces 1.
    assert chosen(select_blocks(scores, importance, 4)) == [[0, 4, 5, 7]]


def test_importance_ties_to_lower_index():
    scores = np.zeros((1, 6))
    importance = np.array([1.0, 2.0, 2.0, 2.0, 0.0, 0.0])
    # k=3: budget 2 -> blocks 1, 2 (ties, lower first); one probe slot -> recency puts 5 there.
    assert chosen(select_blocks(scores, importance, 3)) == [[1, 2, 5]]


def test_k_larger_than_blocks_keeps_everything():
    scores = np.random.default_rng(0).normal(size=(3, 4))
    assert select_blocks(scores, None, 32).all()


def test_heads_choose_independently_and_deterministically():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(4, 40)).astype(np.float32)
    a = select_blocks(scores, None, 8)
    b = select_blocks(scores.copy(), None, 8)
    assert (a == b).all() and (a.sum(axis=1) == 8).all() and a[:, -1].all()
    assert len({tuple(r) for r in chosen(a)}) > 1


def test_gate():
    cfg = SparseConfig(k=4, block=32, probe=8)
    assert not cfg.active(64) and cfg.active(65)
    # decode chooses k blocks only once there are more than 3k to choose from
    assert not cfg.decodes_sparse(384, 12) and cfg.decodes_sparse(385, 13)
    assert not cfg.decodes_sparse(64, 13)


@pytest.mark.parametrize("prompt_len, probes", [(330, False), (400, True)])
def test_decode_probes_only_past_three_times_k_blocks(tiny_qwen3_dir, monkeypatch, prompt_len, probes):
    """k = 4: a 330-token context (11 blocks) decodes with exact attention, no probe; at 400
    tokens (13 blocks) every layer probes."""
    engine = Engine.load(tiny_qwen3_dir, weights="q8", kv="q8", progress=False,
                         sparse={"k": 4, "block": 32, "probe": 8})
    seq = engine.start([int(t) for t in np.random.default_rng(6).integers(3, 400, size=prompt_len)],
                       engine.sampling_params(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.prefill(seq)
    calls = []
    probe = SparseAttention._probe
    monkeypatch.setattr(SparseAttention, "_probe", lambda self, *a: calls.append(1) or probe(self, *a))
    while not seq.done:
        engine.decode([seq])
    engine.release(seq)
    assert len(calls) == (2 * engine.config.num_hidden_layers if probes else 0)


def test_block_importance_sums_tokens():
    tokens = np.arange(70, dtype=np.float32)
    sums = block_importance(tokens, 3, 32)
    assert sums.tolist() == [tokens[:32].sum(), tokens[32:64].sum(), tokens[64:].sum()]


def test_probe_mode_is_checked():
    assert SparseConfig().probe_mode == "bound"
    with pytest.raises(ValueError, match="probe_mode"):
        SparseConfig(probe_mode="random")


@pytest.mark.parametrize("kv", ["q8", "q4", "f32"])
@pytest.mark.parametrize("mode", ["bound", "strided"])
def test_sparse_with_k_covering_all_blocks_equals_exact(tiny_qwen3_dir, kv, mode):
    ids = list(np.random.default_rng(2).integers(3, 400, size=300))
    exact = Engine.load(tiny_qwen3_dir, weights="q8", kv=kv, progress=False)
    sparse = Engine.load(tiny_qwen3_dir, weights="q8", kv=kv, progress=False,
                         sparse={"k": 64, "block": 32, "probe": 8, "probe_mode": mode})
    prompt = [int(t) for t in ids]
    a = exact.generate(prompt, stream=False, max_tokens=6, temperature=0.0, ignore_eos=True)
    b = sparse.generate(prompt, stream=False, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize("kv", ["q8", "q4", "f32"])
@pytest.mark.parametrize("mode", ["bound", "strided"])
def test_sparse_small_k_runs_and_is_deterministic(tiny_qwen3_dir, kv, mode):
    engine = Engine.load(tiny_qwen3_dir, weights="q8", kv=kv, progress=False,
                         sparse={"k": 2, "block": 32, "probe": 8, "probe_mode": mode})
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 400, size=400)]
    runs = [engine.generate(prompt, stream=False, max_tokens=8, temperature=0.0, ignore_eos=True)["token_ids"]
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("mode", ["bound", "strided"])
def test_sparse_batch_decodes_each_sequence_as_alone(tiny_qwen3_dir, mode):
    """Two sequences decoded in one batch (their K/V written in one store per layer, bound and
    probe rows included) choose their blocks and produce their tokens as each alone does."""
    engine = Engine.load(tiny_qwen3_dir, weights="q8", kv="q8", progress=False,
                         sparse={"k": 3, "block": 32, "probe": 8, "probe_mode": mode})
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 400, size=n)] for n in (250, 330)]

    def decode(group):
        seqs = [engine.start(p, engine.sampling_params(max_tokens=40, temperature=0.0, ignore_eos=True))
                for p in group]
        for s in seqs:
            engine.prefill(s)
        while not all(s.done for s in seqs):
            engine.decode([s for s in seqs if not s.done])
        tokens = [list(s.output_ids) for s in seqs]
        for s in seqs:
            engine.release(s)
        return tokens

    together = decode(prompts)
    assert together == [decode([p])[0] for p in prompts]
    assert all(len(t) == 40 for t in together)


def test_sparse_prefill_records_importance(tiny_qwen3_dir):
    engine = Engine.load(tiny_qwen3_dir, weights="q8", kv="q8", progress=False,
                         sparse={"k": 4, "block": 32, "probe": 8})
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 400, size=300)]
    seq = engine.start(prompt, engine.sampling_params(max_tokens=2, temperature=0.0))
    engine.prefill(seq)
    imp = seq.blocks.importance.tokens
    assert imp.shape == (engine.config.num_hidden_layers, 300)
    # every query head of every query spreads a mass of 1 over the tokens it reads
    heads = engine.config.num_attention_heads
    np.testing.assert_allclose(imp.sum(axis=1), 300 * heads, rtol=1e-3)
    engine.release(seq)


def test_decode_block_importance_is_the_block_sum_of_the_prompt_importance():
    from appliance.engine.kv_cache import PagedKVCache, PromptImportance, SequenceBlocks
    from appliance.engine.sparse import SparseAttention, SparseConfig, block_importance
    cache = PagedKVCache(3, 1, 32, kind="f32", capacity_tokens=32 * 40)
    attn = SparseAttention(cache, 32, 3, SparseConfig(k=4, block=32, probe=8))
    seq = SequenceBlocks(importance=PromptImportance(np.random.default_rng(0).random((3, 100)).astype(np.float32)))
    for nb in (4, 5, 9, 200, 5):                   # the sums grow and are sliced, never stale
        for layer in range(3):
            assert np.array_equal(attn._block_importance(layer, seq, nb),
                                  block_importance(seq.importance.tokens[layer], nb, 32))
    seq.importance = PromptImportance(np.ones((3, 40), np.float32))    # a new prompt: new sums
    assert attn._block_importance(0, seq, 3).tolist() == [32.0, 8.0, 0.0]
    assert attn._block_importance(0, SequenceBlocks(), 3) is None
