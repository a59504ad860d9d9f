"""The engine: load a checkpoint, then prefill and decode sequences, alone or batched.

    engine = Engine.load(path, weights="q8", kv="q8")
    for event in engine.generate("Hello", max_tokens=16):
        print(event.text, end="")

The step API (start / step / release, and preempt / resume) is what the server's
scheduler drives: `step` runs, in one batched forward pass (one GEMM per weight
matrix for all of them), one token of every decoding sequence and the next prompt
chunk of every sequence still in prefill. `prefill` and `decode` are its two pure
cases. A sequence starts from the longest start of its tokens the prefix cache
holds (prefix_cache.py); the engine is not thread-safe: one thread drives it.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from appliance.kernels import cpu
from appliance.engine import stats as profiler
from appliance.models import images as image_io
from appliance.errors import ContextLengthError, KVCacheFullError, ModelLoadError
from appliance.engine.kv_cache import PagedKVCache, SequenceBlocks
from appliance.engine.prefix_cache import PrefixCache, PrefixCacheStats
from appliance.engine.sequence_cache import SequenceCache
from appliance.engine.speculative import Speculation, SpeculativeConfig, StepCosts
from appliance.engine.steps import StepAPI, _Work
from appliance.models import read_family
from appliance.kernels.dispatch import kernels
from appliance.engine.sampling import Sampler, SamplingParams, TextStream, log_softmax, top_indices
from appliance.options import DEFAULT_MAX_CONTEXT, KV_FORMATS, WEIGHT_FORMATS, SparseConfig
from appliance.engine.kv_setup import DEFAULT_DISK_BYTES, build_kv
from appliance.engine.tokenizer import Tokenizer
from appliance.weights import hugepages
from appliance.weights.loader import Checkpoint, load_tensors, quantizer_fingerprint
from appliance.weights.report import CacheReport

__all__ = ["Engine", "Sequence", "TokenEvent", "ContextLengthError", "KVCacheFullError"]

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model"


@dataclass
class TokenEvent:
    """One generated token of one sequence."""

    token_id: int
    text: str                                  # new text (held back while a stop string may form)
    finish_reason: str | None                  # None, "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, str, float]] | None = None
    step_s: float = 0.0                        # wall time of the step that produced the token (its
                                               # share, when one step produced several)
    prefill_s: float | None = None             # set on the first token: time spent on the prompt
    cached_tokens: int = 0                     # set on the first token: prompt tokens the prefix cache gave
    draft_tokens: int | None = None            # with speculation: tokens drafted for the sequence so far
    accepted_draft_tokens: int | None = None   # ... and of those, emitted as drafted


class Sequence:
    """A prompt and its continuation; owns KV blocks until released."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer):
        self.id = next(self._ids)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.blocks = SequenceBlocks()
        self.sampler = Sampler(params, self.prompt_ids, tokenizer)
        self.text = TextStream(tokenizer, tuple(params.stop), params.min_tokens)
        self.finish_reason: str | None = None
        self.prefilled = False
        self.vision = None        # a multimodal family's image state (None: text only)
        spec = SpeculativeConfig.coerce(params.speculative)
        self.speculation = Speculation(spec) if spec is not None else None

    @property
    def n_context(self) -> int:
        """Tokens in the KV cache."""
        return self.blocks.length

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    # Set while the prompt is computed over several steps (Engine.step).
    prefill_clock = None

    @property
    def prefill_remaining(self) -> int:
        """Positions prefill has yet to compute or read from disk (0: the sequence decodes)."""
        return 0 if self.prefilled else max(1, self.blocks.prefill_to - self.blocks.length)


@dataclass
class Engine(StepAPI):
    model: object
    config: object
    tokenizer: Tokenizer
    cache: PagedKVCache
    weights: str
    kv: str
    threads: int
    max_context: int
    model_dir: Path
    generation_defaults: dict = field(default_factory=dict)
    prefill_chunk: int = 512
    weight_bytes: int = 0
    sparse: SparseConfig | None = None
    attention: object = None                   # ExactAttention or SparseAttention over `cache`
    prefix: PrefixCache | None = None          # the prefix cache over `cache`, if on
    sequences: SequenceCache = None            # puts sequences' blocks in `cache`
    pool_sizing: str = ""                      # how the KV pool's size was chosen
    # Under a mixed step, disk blocks read per sequence and step: about 1-2 MB each for a
    # 0.6B model, so 16 keep a step's reading near a decode step's time on eMMC.
    disk_blocks_per_step: int = 16
    weight_cache: CacheReport | None = None    # what the quantized weight cache did at load
    step_costs: StepCosts = field(default_factory=StepCosts, repr=False)   # what a verification row costs
    # Callables that receive every stats object the engine emits (engine/stats.py).
    listeners: list = field(default_factory=list, repr=False)

    # ---- loading -----------------------------------------------------------
    @classmethod
    def load(cls, path=None, weights: str | None = None, kv: str = "q8", threads: int | None = None,
             max_context: int | None = None, kv_cache_tokens: int | None = None,
             sparse=None, prefill_chunk: int = 512, progress: bool = True,
             kv_cache_memory: str | None = None, prefix_cache: bool = False,
             kv_cache_dir=None, kv_cache_disk_bytes: int = DEFAULT_DISK_BYTES, on_progress=None) -> "Engine":
        """Load a Hugging Face checkpoint directory (None: the embedded demo model).

        weights: "q8", "q4" or "f32"; None takes the family's default (q8; q4 for MoE).
        sparse: None (exact attention), a SparseConfig, or a dict of its fields
        ({"k": 32, "block": 32, "probe": 8, "probe_mode": "bound"}) for block-sparse attention.
        The KV pool holds kv_cache_tokens, or kv_cache_memory ("4G", "40%" of available memory),
        or by default a share of the memory left after the weights (kv_sizing.py); never less
        than one context (ValueError). prefix_cache: keep full KV blocks for later prompts that
        start the same way; kv_cache_dir (bounded by kv_cache_disk_bytes) keeps them across restarts.
        on_progress(stage, done, total) hears the weights' loading stages (weights/loader.py).
        """
        if isinstance(sparse, dict):
            sparse = SparseConfig(**sparse)
        if weights is not None and weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
        if kv not in KV_FORMATS:
            raise ValueError(f"kv must be one of {', '.join(KV_FORMATS)}, not {kv!r}")
        model_dir = Path(path).expanduser() if path is not None else DEMO_MODEL_DIR
        family, cfg, raw = read_family(model_dir)
        weights = weights or getattr(family, "DEFAULT_WEIGHTS", "q8")
        gen = _read_generation_config(model_dir)
        eos = gen.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        tokenizer = Tokenizer(model_dir, eos_ids)

        threads = _setup_threads(threads)
        cache_report = CacheReport()
        tensors = load_tensors(model_dir, family.tensor_plan(cfg), weights, progress=progress, report=cache_report,
                               on_progress=on_progress)
        model = family.Model(cfg, weights, tensors)
        if hugepages.wanted():
            cache_report.hugepage_bytes = hugepages.hold(model.streamed_linears())
        if hasattr(model, "prepare_vision"):
            model.image_config = image_io.ImageProcessorConfig.from_model_dir(model_dir)
        limit = min(cfg.max_position_embeddings, max_context or DEFAULT_MAX_CONTEXT)
        weight_bytes = sum(t.nbytes for t in tensors.values())
        identity = None
        if prefix_cache:
            identity = {"model": Checkpoint(model_dir).identity(), "weights": weights,
                        "quantizer": quantizer_fingerprint(), "kernels": kernels.kernel_path()}
        # The pool's default size takes the weights still to come in from the mapping off the memory
        # available now; the copies in huge pages are already out of it.
        kvs = build_kv(cfg, kv, sparse, limit, weight_bytes=weight_bytes - cache_report.hugepage_bytes,
                       kv_cache_tokens=kv_cache_tokens,
                       kv_cache_memory=kv_cache_memory, prefix_cache=prefix_cache, identity=identity,
                       kv_cache_dir=kv_cache_dir, kv_cache_disk_bytes=kv_cache_disk_bytes)
        engine = cls(model=model, config=cfg, tokenizer=tokenizer, cache=kvs.cache, weights=weights, kv=kv,
                     threads=threads, max_context=limit, model_dir=model_dir,
                     generation_defaults=_sampling_defaults(gen),
                     prefill_chunk=prefill_chunk, sparse=sparse, weight_bytes=weight_bytes,
                     attention=kvs.attention, weight_cache=cache_report, prefix=kvs.prefix,
                     sequences=kvs.sequences, pool_sizing=kvs.sizing)
        return engine

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    def info(self) -> dict:
        c = self.config
        return {
            "model": self.model_name, "model_type": type(self.model).__name__,
            "layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab": c.vocab_size,
            "weights": self.weights, "kv": self.kv, "kernel_path": kernels.kernel_path(),
            "threads": self.threads, "max_context": self.max_context,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token_per_layer": self.cache.bytes_per_token_per_layer,
            "kv_blocks_total": self.cache.blocks_total, "kv_block_size": self.cache.block_size,
            "kv_tokens_total": self.cache.capacity_tokens, "kv_pool_sizing": self.pool_sizing,
            "kv_pool_bytes": self.cache.nbytes, "prefix_cache": self.prefix is not None,
            "kv_cache_dir": None if self.prefix is None or self.prefix.store is None else str(self.prefix.store.dir),
            "sparse": None if self.sparse is None else {"k": self.sparse.k, "block": self.sparse.block,
                                                         "probe": self.sparse.probe,
                                                         "probe_mode": self.sparse.probe_mode},
        }

    @property
    def kv_blocks_total(self) -> int:
        return self.cache.blocks_total

    @property
    def kv_blocks_used(self) -> int:
        """Blocks running sequences hold (the prefix cache's idle blocks are not counted)."""
        return self.cache.blocks_used

    @property
    def kv_blocks_available(self) -> int:
        """Blocks a sequence can get now: free or idle in the prefix cache."""
        return self.cache.blocks_available

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return None if self.prefix is None else self.prefix.stats()

    def persist(self, limit: int | None = None) -> int:
        """Queue up to `limit` cached blocks the disk store lacks for writing (the server does it
        while idle, so that a restart or a power cut loses little); returns how many."""
        return 0 if self.prefix is None else self.prefix.persist(limit)

    def close(self, timeout: float = 30.0) -> bool:
        """Keep the prefix cache for the next start: every cached block not yet on disk is written,
        the most recent first, within `timeout` seconds. True if all was written (or no disk store)."""
        if self.prefix is None or self.prefix.store is None:
            return True
        self.prefix.persist()
        return self.prefix.store.flush(timeout)

    def add_stats_listener(self, fn) -> None:
        self.listeners.append(fn)

    def remove_stats_listener(self, fn) -> None:
        self.listeners.remove(fn)

    def _emit(self, stats) -> None:
        profiler.emit(stats)
        for fn in self.listeners:
            fn(stats)

    def kernel_pool_stats(self) -> dict:
        """The kernels' thread pool counters since the process started (kernels pool_stats): how
        often a calling thread waited for, or took back, a chunk a worker held without progress."""
        return kernels.pool_stats()

    def kernel_selftest(self) -> dict | None:
        """The compiled kernels against their portable twins on this CPU (~0.3 s): the report of
        `appliance selftest` ({"ok", "kernel_path", "checks", ...}); None when the numpy twin runs
        (APPLIANCE_KERNELS=numpy: nothing compiled to check)."""
        from appliance.kernels.dispatch import COMPILED
        if not COMPILED:
            return None
        from appliance.kernels.selftest import selftest_report
        return selftest_report()

    # ---- images ----------------------------------------------------------------
    @property
    def supports_images(self) -> bool:
        return hasattr(self.model, "prepare_vision")

    def prepare_image(self, image) -> image_io.ImageInput:
        """Encoded bytes, a file path, a PIL image or an ImageInput -> an ImageInput for this model."""
        if not self.supports_images:
            raise image_io.ImageError(f"model {self.model_name} does not take images")
        if isinstance(image, image_io.ImageInput):
            return image
        if isinstance(image, (str, Path)):
            image = Path(image).read_bytes()
        if isinstance(image, (bytes, bytearray)):
            return image_io.prepare_image(bytes(image), self.model.image_config)
        return image_io.preprocess(image, self.model.image_config)

    def expand_image_tokens(self, prompt_ids: list[int], images: list) -> list[int]:
        """The prompt as start() will run it: each image placeholder expanded to its image's tokens.
        images: prepared (ImageInput), one per placeholder."""
        return self.model.prepare_vision(list(prompt_ids), list(images))[0]

    # ---- sequences ------------------------------------------------------------
    def _new_sequence(self, prompt_ids, params: SamplingParams, images) -> Sequence:
        vision = None
        if images:
            prompt_ids, vision = self.model.prepare_vision(list(prompt_ids),
                                                           [self.prepare_image(i) for i in images])
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + 1 > self.max_context:
            raise ContextLengthError(len(prompt_ids), self.max_context)
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        seq = Sequence(prompt_ids, params, self.tokenizer)
        seq.vision = vision
        return seq

    # ---- whole generations -------------------------------------------------
    def generate(self, prompt, stream: bool = True, images: list | None = None, **sampling):
        """Generate from a prompt string, token ids, or chat messages ([{"role", "content"}]).

        images: for a multimodal model, one per image placeholder of the prompt, in order
        (chat content parts {"type": "image"} render as placeholders).

        stream=True: an iterator of TokenEvent. stream=False: a dict with the text,
        token ids, finish reason and timings.
        """
        events = self._generate(prompt, images, **sampling)
        if stream:
            return events
        out = list(events)
        first = out[0]
        decode_s = sum(e.step_s for e in out[1:])
        return {"text": "".join(e.text for e in out), "token_ids": [e.token_id for e in out],
                "finish_reason": out[-1].finish_reason, "prompt_tokens": first.prompt_tokens,
                "completion_tokens": out[-1].completion_tokens, "prefill_s": first.prefill_s,
                "decode_ms_per_token": 1e3 * decode_s / max(1, len(out) - 1)}

    def _generate(self, prompt, images=None, **sampling):
        ids = self.encode_prompt(prompt)
        params = self.sampling_params(**sampling)
        seq = self.start(ids, params, images=images)
        try:
            event = self.prefill(seq)
            yield event
            while not seq.done:
                yield from self.decode([seq])      # several tokens a step with speculative decoding
        finally:
            self.release(seq)

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt))
        return [int(t) for t in prompt]

    def sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams from the checkpoint's generation_config, then the caller's values."""
        values = dict(self.generation_defaults)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)

    def logits(self, token_ids, images: list | None = None) -> np.ndarray:
        """float32[len(token_ids), vocab]: every position's logits, one pass from an empty cache
        (with images: over the prompt with its image tokens expanded). The prefix cache is not used."""
        seq = self._new_sequence([int(t) for t in token_ids], SamplingParams(max_tokens=1), images)
        ids = seq.prompt_ids
        timer = profiler.StepTimer()
        try:
            self.cache.reserve(seq.blocks, len(ids))
            self._encode_images(seq)
            rows = [self._forward([_Work(seq, ids[s:s + self.prefill_chunk], s, prefill=True)], timer, rows="all")
                    for s in range(0, len(ids), self.prefill_chunk)]
        finally:
            self.release(seq)
        return np.concatenate(rows, axis=0)

    def score(self, token_ids, prefix_len: int) -> list[float]:
        """Log-probabilities of token_ids[prefix_len:], each given every token before it.

        The prefix is prefilled, then each later token is fed by a decode step (teacher
        forcing): with block-sparse attention this scores text the way generation sees it,
        where one pass over the whole sequence (logits) would use the prefill path.
        """
        ids = [int(t) for t in token_ids]
        if not 0 < prefix_len < len(ids):
            raise ValueError(f"prefix_len must be in 1..{len(ids) - 1}, got {prefix_len}")
        if len(ids) > self.max_context:
            raise ContextLengthError(len(ids), self.max_context)
        seq = self.start(ids[:prefix_len], SamplingParams(max_tokens=1))
        timer = profiler.StepTimer()
        out = []
        try:
            while seq.blocks.pending is not None:
                self.sequences.load(seq)
            for s in range(seq.n_context, prefix_len, self.prefill_chunk):
                e = min(prefix_len, s + self.prefill_chunk)
                logits = self._forward([_Work(seq, ids[s:e], s, logits=int(e == prefix_len), prefill=True)], timer)
            for pos in range(prefix_len, len(ids)):
                out.append(float(log_softmax(logits[0])[ids[pos]]))
                if pos + 1 < len(ids):
                    logits = self._forward([_Work(seq, [ids[pos]], pos)], timer)
        finally:
            self.release(seq)
        return out

    # ---- internals -----------------------------------------------------------
    def _accept(self, seq: Sequence, logits: np.ndarray, step_s: float, draft: int | None = None) -> TokenEvent:
        """Sample from one row of logits, update the sequence, say what the user sees. draft: the
        token speculative decoding guessed for this row (the sampler verifies it)."""
        token = seq.sampler(logits) if draft is None else seq.sampler.verify(logits, draft)[0]
        seq.output_ids.append(token)
        p = seq.params
        logprob = top = None
        if p.logprobs is not None:
            lp = log_softmax(logits)
            logprob = float(lp[token])
            if p.logprobs:
                best = top_indices(lp, p.logprobs)
                top = [(int(t), self.tokenizer.decode([int(t)], skip_special_tokens=False), float(lp[t]))
                       for t in best]
        is_eos = (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        text = "" if is_eos else seq.text.push(token)
        if is_eos or seq.text.stopped:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.n_context + 1 >= self.max_context:
            seq.finish_reason = "length"
        if seq.finish_reason and not seq.text.stopped:
            text += seq.text.flush()
        return TokenEvent(token_id=token, text=text, finish_reason=seq.finish_reason,
                          prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
                          logprob=logprob, top_logprobs=top, step_s=step_s)

    # ---- retrieval: embeddings and reranking (encoder.py, pooling.py, rerank.py) ------------
    def __post_init__(self) -> None:
        # An embedding checkpoint's pooling files are read at load: one this engine cannot follow
        # (a Dense module, say) refuses the load rather than its first request.
        from appliance.engine.pooling import Pooling
        self._pooling = Pooling.from_model_dir(self.model_dir) if self.default_task() == "embed" else None
        self._rerank_prompt = None

    def default_task(self) -> str:
        """What the checkpoint is for when nobody says: "embed" for an embedding export
        (sentence-transformers files, a bare base model, or no output head), else "chat". A
        Qwen3-Reranker is saved as a chat model is: it is served for "rerank" only when asked."""
        from appliance.engine.pooling import checkpoint_task
        if not getattr(self.config, "has_lm_head", True):
            return "embed"
        return checkpoint_task(self.model_dir) or "chat"

    @property
    def pooling(self):
        """How embed() pools: the checkpoint's sentence-transformers files, else last token + L2."""
        if self._pooling is None:
            from appliance.engine.pooling import Pooling
            self._pooling = Pooling.from_model_dir(self.model_dir)
        return self._pooling

    @property
    def embedding_size(self) -> int:
        """Components of an embedding before any truncation (several pooling modes concatenate)."""
        return len(self.pooling.modes) * self.config.hidden_size

    def embed(self, inputs, dimensions: int | None = None, stop=None) -> np.ndarray:
        """float32[n, D]: the embedding of each input (a string, a list of strings, token ids, or a list
        of token-id lists), pooled and normalised as the checkpoint says, in batched passes (one for
        up to encoder.MAX_PASS_ROWS tokens); `dimensions` keeps the first D components, normalised
        again (Matryoshka). stop() is asked between passes (encoder.Abandoned). The KV blocks used
        are released before it returns; the prefix cache is not used."""
        from appliance.engine.encoder import embed_ids, encode_inputs
        if dimensions is not None and not 1 <= dimensions <= self.embedding_size:
            raise ValueError(f"dimensions must be in 1..{self.embedding_size}, got {dimensions}")
        vectors, stats = embed_ids(self, self.pooling, encode_inputs(self, inputs), dimensions, stop)
        self._emit(stats)
        return vectors

    def rerank_prompt(self):
        """The Qwen3-Reranker prompt for this tokenizer and context (rerank.RerankPrompt)."""
        if self._rerank_prompt is None:
            from appliance.engine.rerank import RerankPrompt
            self._rerank_prompt = RerankPrompt(self.tokenizer, self.max_context)
        return self._rerank_prompt

    def rerank_ids(self, sequences: list[list[int]], stop=None) -> list[float]:
        """P("yes") of prompts made by rerank_prompt().pair_ids, in batched passes (see embed)."""
        from appliance.engine.rerank import relevance
        scores, stats = relevance(self, self.rerank_prompt(), sequences, stop)
        self._emit(stats)
        return scores

    # `score` took only token ids before it took queries; that form lives on under this name.
    _score_tokens = score

    def score(self, query, documents=None, *, instruction: str | None = None, prefix_len: int | None = None,
              stop=None):
        """Two forms, told apart by the first argument's type:

        score(query: str, documents: list[str], instruction=None) -> list[float]: how relevant each
            document is to the query, 0..1, as a Qwen3-Reranker judges it (rerank.py); instruction
            replaces the model card's default web-search one.
        score(token_ids, prefix_len) -> list[float]: the log-probabilities of token_ids[prefix_len:]
            given what precedes each (teacher forcing; `appliance eval ppl`).
        """
        if not isinstance(query, str):
            return self._score_tokens(query, documents if prefix_len is None else prefix_len)
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, str) for d in documents):
            raise TypeError("documents must be a list of strings")
        prompt = self.rerank_prompt()
        return self.rerank_ids([prompt.pair_ids(query, d, instruction) for d in documents], stop) if documents else []


def _read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(path, f"invalid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _sampling_defaults(gen: dict) -> dict:
    """The sampling settings a checkpoint ships in generation_config.json."""
    values = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
              if gen.get(k) is not None}
    if gen.get("do_sample") is False:
        values["temperature"] = 0.0
    return values


def _setup_threads(threads: int | None) -> int:
    """Default: one thread per big core, and the process pinned to those cores."""
    big = cpu.big_cores()
    n = threads or len(big)
    if n <= len(big):
        cpu.pin_to(big)
    kernels.set_threads(n)
    return n
