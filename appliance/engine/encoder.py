"""Many independent sequences through the model at once, for their hidden states (embeddings,
reranking): no sampling, no generation, nothing kept afterwards.

Every sequence is one segment of a batched forward pass (one GEMM per weight matrix for all of
them), from an empty KV cache: its blocks are reserved for the pass and released after it
whatever happens, and the prefix cache is neither read nor fed. Passes hold up to
MAX_PASS_ROWS rows; a longer sequence runs alone, chunk by chunk, keeping its blocks between
its chunks. Attention is always exact: block-sparse attention, if the engine uses it for long
chats, chooses blocks for decoding and would only approximate a one-pass encoding.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from appliance.engine import stats as profiler
from appliance.engine.attention import ExactAttention
from appliance.engine.batch import Batch, Segment
from appliance.engine.kv_cache import SequenceBlocks
from appliance.engine.pooling import Pooling
from appliance.engine.retrieval_stats import RetrievalStats
from appliance.errors import ApplianceError, KVCacheFullError

# 16 inputs of 128 tokens (one typical request) make one pass; a 0.6B model's activations for
# 2048 rows are about 60 MB (the MLP's 2 x 3072 floats a row dominate).
MAX_PASS_ROWS = 2048


class InputTooLongError(ApplianceError, ValueError):
    """An input longer than the model's context."""

    def __init__(self, index: int, n_tokens: int, max_context: int):
        self.index, self.n_tokens, self.max_context = index, n_tokens, max_context
        super().__init__(f"input {index} has {n_tokens} tokens but the model's context holds at most {max_context}")


class Abandoned(ApplianceError):
    """The caller's stop() asked, between two passes, to give the work up (client gone, timeout)."""


def encode_inputs(engine, inputs) -> list[list[int]]:
    """OpenAI's `input` forms -> token ids per input: a string, a list of strings (each tokenized with
    the tokenizer's own post-processor: Qwen3-Embedding's appends <|endoftext|>), a list of token
    ids, or a list of such lists (used as given). TypeError / ValueError / InputTooLongError."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and _is_token(inputs[0])):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("input must not be empty")
    vocab = engine.config.vocab_size
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"input {i} is an empty string")
            ids = engine.tokenizer.encode(item, add_special_tokens=True)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            ids = [int(t) for t in item]
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"input {i}: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        elif isinstance(item, list) and not item:
            raise ValueError(f"input {i} is an empty list of token ids")
        else:
            raise TypeError(f"input {i} must be a string or a list of token ids, not {type(item).__name__}")
        if len(ids) > engine.max_context:
            raise InputTooLongError(i, len(ids), engine.max_context)
        out.append(ids)
    return out


def _is_token(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def forward_sequences(engine, sequences: list[list[int]], keep_all: bool, timer: profiler.StepTimer,
                      stop: Callable[[], bool] | None = None) -> tuple[list[np.ndarray], int]:
    """Final-norm hidden states of each sequence: float32[T, H] (keep_all) or float32[H] of its last
    row; and the number of passes it took. stop() is asked before every pass (Abandoned)."""
    attention = ExactAttention(engine.cache, engine.config.head_dim)
    out: list[np.ndarray | None] = [None] * len(sequences)
    passes = 0
    start = 0
    while start < len(sequences):
        end = start + 1
        rows = len(sequences[start])
        while end < len(sequences) and rows + len(sequences[end]) <= MAX_PASS_ROWS:
            rows += len(sequences[end])
            end += 1
        passes += _run_wave(engine, attention, sequences, range(start, end), keep_all, out, timer, stop)
        start = end
    return out, passes


def _run_wave(engine, attention, sequences, wave: range, keep_all, out, timer, stop) -> int:
    """One wave of sequences: their blocks reserved together, released at the end. A wave the KV pool
    cannot hold is halved (other work may hold blocks); one sequence that does not fit raises."""
    held = [SequenceBlocks() for _ in wave]
    try:
        for blocks, i in zip(held, wave):
            engine.cache.reserve(blocks, len(sequences[i]))
    except KVCacheFullError:
        for blocks in held:
            engine.cache.release(blocks)
        if len(wave) == 1:
            raise
        held = None               # split outside the handler: a later error then reads as itself
    if held is None:
        mid = wave.start + len(wave) // 2
        return (_run_wave(engine, attention, sequences, range(wave.start, mid), keep_all, out, timer, stop)
                + _run_wave(engine, attention, sequences, range(mid, wave.stop), keep_all, out, timer, stop))
    try:
        passes = 0
        done = 0                  # positions computed so far (a lone long sequence goes chunk by chunk)
        longest = max(len(sequences[i]) for i in wave)
        while done < longest:
            if stop is not None and stop():
                raise Abandoned("stopped between passes")
            parts = [(blocks, i, sequences[i][done:done + MAX_PASS_ROWS]) for blocks, i in zip(held, wave)
                     if done < len(sequences[i])]
            hidden, segments = _forward(engine, attention, parts, done, timer)
            for (_, i, chunk), seg in zip(parts, segments):
                rows = hidden[seg.row_start:seg.row_end]
                if keep_all:
                    out[i] = rows.copy() if out[i] is None else np.concatenate([out[i], rows])
                elif done + len(chunk) == len(sequences[i]):
                    out[i] = rows[-1].copy()
            done += MAX_PASS_ROWS
            passes += 1
        return passes
    finally:
        for blocks in held:
            engine.cache.release(blocks)


def _forward(engine, attention, parts, pos_start: int, timer):
    """One batched pass: each (blocks, index, token ids) part is a segment at positions pos_start...;
    returns the hidden states of every row and the segments."""
    bs = engine.cache.block_size
    segments, tokens, positions, row = [], [], [], 0
    for blocks, _, chunk in parts:
        n = len(chunk)
        blocks.length = pos_start + n
        table, blockpos, count = blocks.views(bs)
        qpos = np.arange(pos_start, pos_start + n, dtype=np.int32)
        segments.append(Segment(blocks, row, row + n, pos_start, table, blockpos, count, qpos))
        tokens += chunk
        positions.append(qpos)
        row += n
    batch = Batch(np.asarray(tokens, dtype=np.intp), np.concatenate(positions), segments)
    return engine.model.forward(batch, attention, timer), segments


def embed_ids(engine, pooling: Pooling, sequences: list[list[int]], dimensions: int | None = None,
              stop: Callable[[], bool] | None = None) -> tuple[np.ndarray, RetrievalStats]:
    """float32[len(sequences), D]: one pooled (and, as the checkpoint says, normalised) vector per
    sequence, Matryoshka-truncated to `dimensions`; and the job's stats."""
    t0 = time.perf_counter()
    timer = profiler.StepTimer()
    hidden, passes = forward_sequences(engine, sequences, pooling.needs_all_rows, timer, stop)
    vectors = np.stack([pooling.truncate(pooling(h if h.ndim == 2 else h[None]), dimensions) for h in hidden])
    return vectors, RetrievalStats("embed", len(sequences), sum(map(len, sequences)), passes,
                                   time.perf_counter() - t0, timer.gemm_s, timer.attn_s)
