"""Qwen3-Reranker: a yes/no judgement of a (query, document) pair by the causal LM itself.

The prompt is the model card's (Qwen/Qwen3-Reranker-0.6B, "Usage"): a ChatML system turn that
asks for "yes" or "no", a user turn
    <Instruct>: {instruction}
    <Query>: {query}
    <Document>: {document}
and the assistant turn opened with an empty think block. The card tokenizes the three parts
apart (prefix, pair, suffix) and joins the ids, cutting the pair so the whole fits its
max_length; so does this module, with the model's context as that length. The relevance
score is the card's: softmax over the last position's logits of "no" and "yes", the
probability of "yes", which is sigmoid(logit_yes - logit_no).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from appliance.engine import stats as profiler
from appliance.engine.encoder import forward_sequences
from appliance.engine.retrieval_stats import RetrievalStats
from appliance.weights.linear import Linear

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class RerankPrompt:
    """Token ids of the pairs one reranker checkpoint judges, and the two answer tokens."""

    def __init__(self, tokenizer, max_tokens: int):
        self.tokenizer = tokenizer
        self.prefix = tokenizer.encode(PREFIX)
        self.suffix = tokenizer.encode(SUFFIX)
        self.yes, self.no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
        if self.yes is None or self.no is None:
            raise ValueError("this tokenizer has no \"yes\" / \"no\" tokens: not a Qwen3-Reranker checkpoint")
        self.room = max_tokens - len(self.prefix) - len(self.suffix)    # for the pair itself
        if self.room < 1:
            raise ValueError(f"a context of {max_tokens} tokens cannot hold the reranker's prompt")

    def pair_ids(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        body = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = self.tokenizer.encode(body, add_special_tokens=True)[:self.room]
        return self.prefix + ids + self.suffix


def answer_head(model, yes: int, no: int) -> Linear:
    """The output head's rows of "yes" and "no" only: a 2-row GEMM instead of the vocabulary's,
    with the very same (quantized) weights, so the two logits are those the full head gives."""
    head = model.lm_head
    if head is None:
        raise ValueError("this checkpoint has no output head (lm_head): it cannot judge yes / no")
    return head.select_rows([yes, no])


def relevance(engine, prompt: RerankPrompt, sequences: list[list[int]],
              stop: Callable[[], bool] | None = None) -> tuple[list[float], RetrievalStats]:
    """P("yes") for each prompt sequence (RerankPrompt.pair_ids), and the job's stats."""
    t0 = time.perf_counter()
    timer = profiler.StepTimer()
    last, passes = forward_sequences(engine, sequences, False, timer, stop)
    with timer.gemm():
        logits = answer_head(engine.model, prompt.yes, prompt.no)(np.ascontiguousarray(np.stack(last)))
    margin = logits[:, 0].astype(np.float64) - logits[:, 1]
    scores = (1.0 / (1.0 + np.exp(-margin))).tolist()
    return scores, RetrievalStats("rerank", len(sequences), sum(map(len, sequences)), passes,
                                  time.perf_counter() - t0, timer.gemm_s, timer.attn_s)
