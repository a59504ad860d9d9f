"""Embeddings and reranking (engine/pooling.py, encoder.py, rerank.py) against transformers,
sentence-transformers and the Qwen3-Reranker model card's computation in torch."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from appliance import Engine
from appliance.engine import encoder
from appliance.errors import ModelLoadError
from tiny_models_retrieval import build_qwen3_embedding, build_st_saved_embedding
from tiny_models_retrieval import embedding_dir, reranker_dir  # noqa: F401 (fixtures)

# Relative to the vector's largest component; a normalised f32 embedding is within 2e-7 of
# transformers on these models, a missing norm or a wrong row is O(1).
F32_RTOL = 1e-4
# q8 weights and KV against the f32 reference: measured cosines 0.9998-0.9999 (embeddings) and
# 0.001 at most (rerank probabilities) on these models; a wrong scale or block order is O(1).
Q8_MIN_COSINE = 0.995
Q8_SCORE_ATOL = 0.02
TEXTS = ["Hello world! How are you today?", "The quick brown fox jumps over the lazy dog.",
         "Python is a programming language", "Edge boards run language models on their CPUs with int8 kernels."]


@pytest.fixture(scope="module")
def embedder(embedding_dir):
    return Engine.load(embedding_dir, weights="f32", kv="f32", progress=False)


@pytest.fixture(scope="module")
def reranker(reranker_dir):
    return Engine.load(reranker_dir, weights="f32", kv="f32", progress=False)


def last_token_reference(model_dir, texts):
    """transformers' last-token final hidden state (Qwen3-Embedding's pooling), L2-normalised."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for text in texts:
        with torch.no_grad():
            h = model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]
        out.append(torch.nn.functional.normalize(h, dim=-1).numpy())
    return np.stack(out)


def assert_close(got, ref, rtol=F32_RTOL):
    assert got.shape == ref.shape and np.isfinite(got).all()
    err = np.abs(got - ref) / np.abs(ref).max(axis=-1, keepdims=True)
    assert err.max() < rtol, f"max relative error {err.max():.2e} in row {np.unravel_index(err.argmax(), err.shape)[0]}"


def cosine(a, b):
    return np.sum(a * b, axis=-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


# ---- the checkpoint's layout ------------------------------------------------------------------

def test_qwen3_embedding_layout_is_read_as_shipped(embedder):
    """Bare Qwen3Model tensors under a Qwen3ForCausalLM config.json, tied, no lm_head.weight."""
    assert embedder.config.tensor_prefix == "" and embedder.config.has_lm_head
    assert embedder.default_task() == "embed"
    assert embedder.pooling.modes == ("lasttoken",) and embedder.pooling.normalize
    assert embedder.tokenizer.encode("Hello", add_special_tokens=True)[-1] == embedder.tokenizer.token_to_id("<|endoftext|>")


def test_untied_export_without_lm_head_embeds_but_cannot_generate(tmp_path):
    """Qwen3-Embedding-8B's layout: untied in config.json, and still no lm_head.weight."""
    engine = Engine.load(build_qwen3_embedding(tmp_path / "untied", tied=False), weights="f32", kv="f32",
                         progress=False)
    assert not engine.config.has_lm_head and engine.model.lm_head is None and engine.default_task() == "embed"
    assert_close(engine.embed(TEXTS[:2]), last_token_reference(tmp_path / "untied", TEXTS[:2]))
    with pytest.raises(ValueError, match="no output head"):
        engine.generate("Hello", stream=False, max_tokens=2)


def test_a_chat_checkpoint_keeps_its_layout_and_task(tiny_qwen3_dir, reranker):
    engine = Engine.load(tiny_qwen3_dir, weights="f32", kv="f32", progress=False)
    assert engine.config.tensor_prefix == "model." and engine.default_task() == "chat"
    assert reranker.default_task() == "chat"          # a Qwen3-Reranker is served as rerank when asked


def test_a_sentence_transformers_module_the_engine_cannot_run_refuses_the_load(embedding_dir, tmp_path):
    copy = shutil.copytree(embedding_dir, tmp_path / "dense")
    modules = json.loads((copy / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="'Dense' is not supported"):
        Engine.load(copy, weights="f32", kv="f32", progress=False)
    (copy / "modules.json").write_text(json.dumps(modules[:2]))
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(ModelLoadError, match="pooling mode 'median'"):
        Engine.load(copy, weights="f32", kv="f32", progress=False)


# ---- embeddings against their references ---------------------------------------------------------

def test_embeddings_match_transformers_last_token_normalised(embedder, embedding_dir):
    assert_close(embedder.embed(TEXTS), last_token_reference(embedding_dir, TEXTS))


def test_q8_embeddings_within_the_q8_tolerance(embedding_dir):
    engine = Engine.load(embedding_dir, weights="q8", kv="q8", progress=False)
    got = engine.embed(TEXTS)
    sims = cosine(got, last_token_reference(embedding_dir, TEXTS))
    print("q8 cosine to f32 transformers:", np.round(sims, 5))
    assert sims.min() > Q8_MIN_COSINE
    assert np.allclose(np.linalg.norm(got, axis=-1), 1, atol=1e-5)


def test_matches_sentence_transformers_on_the_shipped_files(embedder, embedding_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embedding_dir), device="cpu")
    assert_close(embedder.embed(TEXTS), st.encode(TEXTS))


@pytest.mark.parametrize("mode,normalize", [("mean", True), ("mean", False), ("lasttoken", True),
                                            (("cls", "weightedmean"), False)])
def test_matches_sentence_transformers_pooling(embedding_dir, tmp_path, mode, normalize):
    """Files written by sentence-transformers itself (its current keys); several modes concatenate."""
    from sentence_transformers import SentenceTransformer

    saved = build_st_saved_embedding(embedding_dir, tmp_path / "st", mode, normalize)
    engine = Engine.load(saved, weights="f32", kv="f32", progress=False)
    assert engine.default_task() == "embed" and engine.pooling.normalize == normalize
    ref = SentenceTransformer(str(saved), device="cpu").encode(TEXTS)
    assert engine.embedding_size == ref.shape[1]
    assert_close(engine.embed(TEXTS), ref)


def test_legacy_pooling_booleans_default_to_mean(embedding_dir, tmp_path):
    copy = shutil.copytree(embedding_dir, tmp_path / "none_set")
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64}))
    assert Engine.load(copy, weights="f32", kv="f32", progress=False).pooling.modes == ("mean",)


# ---- the batched passes -------------------------------------------------------------------------

def test_batched_equals_one_by_one_and_frees_every_block(embedder):
    together = embedder.embed(TEXTS)
    alone = np.concatenate([embedder.embed(t) for t in TEXTS])
    assert np.allclose(together, alone, atol=1e-6)
    assert embedder.kv_blocks_used == 0


def test_waves_and_chunks_give_the_same_vectors(embedder, monkeypatch):
    """Passes of at most 8 rows: several waves, and inputs longer than a pass computed in chunks."""
    full = embedder.embed(TEXTS)
    monkeypatch.setattr(encoder, "MAX_PASS_ROWS", 8)
    assert np.allclose(embedder.embed(TEXTS), full, atol=1e-5)
    assert embedder.kv_blocks_used == 0


def test_a_wave_the_kv_pool_cannot_hold_is_split(embedding_dir):
    engine = Engine.load(embedding_dir, weights="f32", kv="f32", progress=False, max_context=64,
                         kv_cache_tokens=64)
    texts = TEXTS * 4                                   # 16 inputs, more blocks than the pool has
    assert sum(-(-len(engine.tokenizer.encode(t, add_special_tokens=True)) // engine.cache.block_size)
               for t in texts) > engine.kv_blocks_total
    got = engine.embed(texts)
    assert np.allclose(got[:4], got[4:8], atol=1e-6) and engine.kv_blocks_used == 0


def test_stop_abandons_between_passes_and_releases(embedder, monkeypatch):
    monkeypatch.setattr(encoder, "MAX_PASS_ROWS", 8)
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(encoder.Abandoned):
        embedder.embed(TEXTS, stop=stop)
    assert embedder.kv_blocks_used == 0


def test_token_id_inputs_are_used_as_given(embedder):
    ids = embedder.tokenizer.encode(TEXTS[0], add_special_tokens=True)
    assert np.allclose(embedder.embed(ids), embedder.embed(TEXTS[0]), atol=1e-6)
    assert np.allclose(embedder.embed([ids, ids[:-1]])[0], embedder.embed(TEXTS[0])[0], atol=1e-6)


def test_dimensions_truncate_and_renormalise(embedder):
    full = embedder.embed(TEXTS)
    cut = embedder.embed(TEXTS, dimensions=32)
    assert cut.shape == (len(TEXTS), 32)
    assert np.allclose(np.linalg.norm(cut, axis=-1), 1, atol=1e-6)
    assert np.allclose(cut, full[:, :32] / np.linalg.norm(full[:, :32], axis=-1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("inputs,error,match", [
    ("", ValueError, "empty string"),
    ([], ValueError, "must not be empty"),
    ([[]], ValueError, "empty list"),
    ([["a"]], TypeError, "string or a list of token ids"),
    ([10_000], ValueError, "outside the vocabulary"),
    (["fine", 3.5], TypeError, "input 1"),
])
def test_malformed_inputs(embedder, inputs, error, match):
    with pytest.raises(error, match=match):
        embedder.embed(inputs)


def test_too_long_and_bad_dimensions(embedding_dir):
    engine = Engine.load(embedding_dir, weights="f32", kv="f32", progress=False, max_context=32)
    with pytest.raises(encoder.InputTooLongError, match="input 1 has 40 tokens") as e:
        engine.embed([[5] * 8, [5] * 40])
    assert e.value.index == 1
    for bad in (0, 65):
        with pytest.raises(ValueError, match="dimensions must be in 1..64"):
            engine.embed("Hello", dimensions=bad)


# ---- reranking ------------------------------------------------------------------------------

QUERY = "what runs on the board?"
DOCS = ["the board runs models.", "Hello world! How are you today?", "yes", "Python is a programming language"]


def model_card_scores(model_dir, query, docs, instruction=None, max_length=8192):
    """The Qwen3-Reranker model card's transformers recipe, in torch: left padding, the three parts
    tokenized apart, P(yes) from the last position's "no" / "yes" logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from appliance.engine.rerank import PREFIX, SUFFIX

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    instruction = instruction or "Given a web search query, retrieve relevant passages that answer the query"
    prefix, suffix = tok.encode(PREFIX, add_special_tokens=False), tok.encode(SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {d}" for d in docs]
    body = tok(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
               max_length=max_length - len(prefix) - len(suffix))["input_ids"]
    batch = tok.pad({"input_ids": [prefix + ids + suffix for ids in body]}, padding=True, return_tensors="pt")
    with torch.no_grad():
        last = model(**batch).logits[:, -1, :]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    pair = torch.nn.functional.log_softmax(torch.stack([last[:, no], last[:, yes]], dim=1), dim=1)
    return pair[:, 1].exp().numpy()


def test_rerank_matches_the_model_card_in_torch(reranker, reranker_dir):
    got = np.array(reranker.score(QUERY, DOCS))
    assert np.abs(got - model_card_scores(reranker_dir, QUERY, DOCS)).max() < 1e-5
    assert reranker.kv_blocks_used == 0


def test_rerank_instruction(reranker, reranker_dir):
    instruction = "Given a question, find the passage that names the device"
    got = np.array(reranker.score(QUERY, DOCS, instruction=instruction))
    assert np.abs(got - model_card_scores(reranker_dir, QUERY, DOCS, instruction)).max() < 1e-5


def test_q8_rerank_within_tolerance(reranker_dir):
    engine = Engine.load(reranker_dir, weights="q8", kv="q8", progress=False)
    err = np.abs(np.array(engine.score(QUERY, DOCS)) - model_card_scores(reranker_dir, QUERY, DOCS)).max()
    print(f"q8 rerank: max |P(yes) - torch f32| = {err:.4f}")
    assert err < Q8_SCORE_ATOL


def test_long_documents_are_cut_as_the_model_card_cuts_them(reranker_dir):
    engine = Engine.load(reranker_dir, weights="f32", kv="f32", progress=False, max_context=128)
    long_doc = " ".join(["the board runs models"] * 60)
    ids = engine.rerank_prompt().pair_ids(QUERY, long_doc)
    assert len(ids) == 128 and ids[-len(engine.rerank_prompt().suffix):] == engine.rerank_prompt().suffix
    got = np.array(engine.score(QUERY, [long_doc, DOCS[0]]))
    assert np.abs(got - model_card_scores(reranker_dir, QUERY, [long_doc, DOCS[0]], max_length=128)).max() < 1e-5


def test_score_keeps_its_teacher_forced_form(reranker):
    ids = reranker.tokenizer.encode("Hello world! How are you today?")
    assert reranker.score(ids, 3) == reranker.score(ids, prefix_len=3) == reranker._score_tokens(ids, 3)
    assert len(reranker.score(ids, 3)) == len(ids) - 3
    assert reranker.score(QUERY, []) == []
    with pytest.raises(TypeError, match="list of strings"):
        reranker.score(QUERY, "one document")


def test_rerank_needs_the_answer_tokens(tiny_qwen3_dir):
    engine = Engine.load(tiny_qwen3_dir, weights="f32", kv="f32", progress=False)
    assert engine.tokenizer.token_to_id("yes") is None
    with pytest.raises(ValueError, match="not a Qwen3-Reranker"):
        engine.score(QUERY, DOCS)
