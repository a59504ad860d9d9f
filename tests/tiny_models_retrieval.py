"""Tiny Qwen3-Embedding and Qwen3-Reranker checkpoints with random weights, saved as Qwen ships them.

Qwen3-Embedding (Qwen/Qwen3-Embedding-0.6B): a bare Qwen3Model's tensors (no "model." prefix, no
lm_head) under a config.json that still names Qwen3ForCausalLM; a tokenizer whose post-processor
appends <|endoftext|>; sentence-transformers' files of the sentence-transformers 3-4 era
(modules.json, 1_Pooling/config.json with the pooling_mode_* booleans and last-token pooling, a
Normalize module, the query prompt in config_sentence_transformers.json). A second variant is
written by sentence-transformers itself (its current config keys), with any pooling mode.

Qwen3-Reranker (Qwen/Qwen3-Reranker-0.6B): a plain Qwen3ForCausalLM with Qwen's ChatML special
tokens and <think> / </think>; its tokenizer appends nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_models import CHATML, CORPUS, SPECIAL

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
# So that the reranker's prompt words, "yes" and "no" are tokens of their own.
RERANK_CORPUS = [
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
    'Note that the answer can only be "yes" or "no".',
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query",
    "<Query>: what runs on the board?\n<Document>: the board runs models. yes no yes no",
    "yes", "no", "yes, no", "no, yes",
] * 20
THINK = ["<think>", "</think>"]


def write_tokenizer(out: Path, append_eos: bool, vocab_size: int = 640) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + THINK,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS + RERANK_CORPUS, trainer)
    eot = tok.token_to_id("<|endoftext|>")
    if append_eos:   # as Qwen3-Embedding's tokenizer.json: ByteLevel, then "$A <|endoftext|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="$A:0 <|endoftext|>:0",
                                          pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
                                          special_tokens=[("<|endoftext|>", eot)])])
    for word in ("yes", "no"):
        assert tok.token_to_id(word) is not None, f"the tiny tokenizer lacks a {word!r} token"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "padding_side": "left", "model_max_length": 32768, "tokenizer_class": "Qwen2Tokenizer"}))
    return tok.get_vocab_size()


def _config(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
            tied: bool):
    from transformers import Qwen3Config
    return Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=4096,
                       rope_theta=1_000_000.0, eos_token_id=2, bos_token_id=None)


def _perturb_norms(model, seed: int) -> None:
    """Norm weights off 1, so that a norm the engine forgot would show."""
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))


def build_qwen3_embedding(out: Path, *, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                          tied=True, seed=0) -> Path:
    """Qwen3-Embedding's layout. tied=False is the 8B's: untied in config.json, and still no lm_head."""
    import torch
    from transformers import Qwen3Model

    vocab = write_tokenizer(out, append_eos=True)
    torch.manual_seed(seed)
    model = Qwen3Model(_config(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}, indent=2))
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 4096, "do_lower_case": False}))
    return out


def build_st_saved_embedding(source: Path, out: Path, pooling_mode: str, normalize: bool) -> Path:
    """The same weights saved by sentence-transformers itself with another pooling (its own files,
    its current config keys; the transformer as a bare Qwen3Model)."""
    from sentence_transformers import SentenceTransformer, models

    # Plain text in, as the checkpoints this engine serves are fed: left to infer, sentence-transformers
    # would render text through the tokenizer's chat template.
    transformer = models.Transformer(str(source), modality_config={"text": {"method": "forward",
                                                                            "method_output_name": "last_hidden_state"}},
                                     module_output_name="token_embeddings")
    hidden = transformer.get_embedding_dimension()
    modules = [transformer, models.Pooling(hidden, pooling_mode=pooling_mode)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def build_qwen3_reranker(out: Path, *, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                         seed=0) -> Path:
    """Qwen3-Reranker's layout: a tied Qwen3ForCausalLM, a tokenizer that appends nothing."""
    import torch
    from transformers import Qwen3ForCausalLM

    vocab = write_tokenizer(out, append_eos=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_config(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, True)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    return out


# Fixtures for the test modules that import them (`from tiny_models_retrieval import embedding_dir`).
@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory):
    return build_qwen3_embedding(tmp_path_factory.mktemp("qwen3_embedding"))


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return build_qwen3_reranker(tmp_path_factory.mktemp("qwen3_reranker"))
