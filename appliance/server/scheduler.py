"""Admission, continuous batching with chunked prefill, preemption and cancellation in front
of the engine.

The engine is not thread-safe, so exactly one thread (the scheduler's) calls
engine.start / step / preempt / resume / release. HTTP threads talk to it only through
`submit()` (which admits into a bounded queue or refuses), `cancel()`, and each
request's own event queue, which carries the engine's TokenEvents and then one
`Finished`.

One loop iteration ("step"):
  1. retire requests that were cancelled (client gone) or ran out of time, freeing
     their KV blocks: a disconnect costs at most the step in progress;
  2. admit waiting requests while there are batch slots and KV blocks: engine.start
     takes the prefix cache's blocks for the start of the prompt and reserves the rest;
  3. if the pool cannot give every decoding sequence the block it may need, preempt the
     newest sequences: their blocks go back (full ones stay in the prefix cache) and they
     wait at the head of the queue, to resume where they stopped; never a false "length";
  4. run one engine.step: a token for every decoding sequence (several, when speculative
     decoding guessed them right) and, within the step's token budget, the next chunk of the
     prompts being prefilled (oldest first). A long prompt so delays running streams by about
     one budget's worth of compute per step.
Requests are answered in arrival order; a request whose KV does not fit waits at the
head of the queue until running ones finish and free blocks.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from appliance.errors import ContextLengthError, KVCacheFullError

log = logging.getLogger("appliance.scheduler")

OUTCOMES = ("stop", "length", "cancelled", "timeout", "shutdown", "error")
# Errors that are the request's fault, not the server's (the API answers them with a 4xx).
REFUSALS = ("prompt_too_long", "invalid_prompt")


class AdmissionError(Exception):
    """The request was not admitted; `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(AdmissionError):
    pass


class ShuttingDownError(AdmissionError):
    pass


@dataclass
class Finished:
    """The last item on a request's event queue."""
    outcome: str                 # one of OUTCOMES
    finish_reason: str | None    # "stop" | "length" for completed requests, else None
    message: str = ""            # why, for timeout/shutdown/error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cause: str = ""              # why an "error" outcome: one of REFUSALS, or "" (the engine failed)
    cached_tokens: int = 0       # prompt tokens the prefix cache gave (usage.prompt_tokens_details)
    draft_tokens: int | None = None           # speculative decoding (None: off): tokens drafted
    accepted_draft_tokens: int | None = None  # ... and of those, emitted as drafted


@dataclass
class RequestStats:
    """One finished request, for metrics (plain data: the scheduler knows nothing of Prometheus)."""
    outcome: str
    prompt_tokens: int
    completion_tokens: int
    queue_s: float               # arrival -> admitted to a decode slot (None-free: 0 if never)
    ttft_s: float | None         # arrival -> first token
    e2e_s: float                 # arrival -> finished
    cached_tokens: int = 0       # prompt tokens the prefix cache gave


@dataclass
class StepTokens:
    """Tokens one scheduler step prefilled and generated (for live token counters)."""
    prompt_tokens: int
    generated_tokens: int


@dataclass
class SchedulerState:
    """What the scheduler thread last saw; read by metrics, /health and the dashboard."""
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    contexts: tuple[int, ...] = ()
    steps: int = 0
    admitting: bool = True
    preemptions: int = 0         # running sequences paused (and resumed later): the KV pool was full
    kv_tokens_total: int = 0     # the pool's size in tokens
    kv_blocks_cached: int = 0    # idle blocks the prefix cache keeps (available to new sequences)
    prefix: Any = None           # the engine's PrefixCacheStats, or None without a prefix cache
    step_tokens: int = 0         # the step budget in force: rows per step while streams decode


_ids = itertools.count(1)


class Request:
    # Work that uses the engine but generates nothing (embeddings, reranking): job(engine, stop) runs
    # whole on the scheduler thread between two steps; its return value is the request's one event.
    job = None

    def __init__(self, prompt_ids: list[int], params: Any, timeout: float, images: list | None = None,
                 session: str | None = None):
        self.id = next(_ids)
        self.session = session       # the client's session key (logged: the fleet routes by it)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.images = images         # prepared images of a multimodal prompt (ids already expanded)
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False       # set by the HTTP thread; read by the scheduler thread
        self.seq = None              # engine Sequence once admitted
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished: Finished | None = None

    def next_event(self, timeout: float):
        """The next TokenEvent or Finished, or None if nothing came within `timeout` s."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


class StepBudget:
    """Rows per step while streams decode: `fixed`, or sized from measured step times.

    A step costs about one weight read W (what a decode step costs) plus c per prompt row.
    Auto sizing picks the chunk that makes a mixed step last about STEPS_PER_CHUNK decode
    steps: the streams wait no longer than that for a token, and the prompt pays W once per
    chunk, 1 / (STEPS_PER_CHUNK - 1) on top of its own compute (~1.15x its solo time).
    """

    STEPS_PER_CHUNK = 8
    INITIAL = 64                 # rows until both costs are measured
    LIMIT = 512                  # the engine's own prefill chunk: more gains nothing

    def __init__(self, fixed: int | None, block: int):
        self.fixed = fixed
        self.block = block
        self.weight_s: float | None = None      # EMA of decode-only step times
        self.row_s: float | None = None         # EMA of the cost of one prompt row

    @property
    def tokens(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.weight_s is None or not self.row_s:
            return self.INITIAL
        rows = (self.STEPS_PER_CHUNK - 1) * self.weight_s / self.row_s
        return int(min(self.LIMIT, max(self.block, rows)))

    def observe(self, step_s: float, decode_rows: int, prompt_rows: int) -> None:
        if prompt_rows == 0:
            if decode_rows:
                self.weight_s = _ema(self.weight_s, step_s)
        elif prompt_rows >= self.block:       # a few rows say more about W than about c
            row = max(0.0, step_s - (self.weight_s or 0.0)) / prompt_rows
            self.row_s = _ema(self.row_s, row)


def _ema(old: float | None, new: float, keep: float = 0.8) -> float:
    return new if old is None else keep * old + (1 - keep) * new


class Scheduler:
    PERSIST_BLOCKS = 16          # prefix-cache blocks queued for disk per idle wake-up

    def __init__(self, engine, max_queue: int = 16, max_batch: int = 8,
                 request_timeout: float = 600.0, max_step_tokens: int | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.request_timeout = request_timeout
        self.cv = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()   # guarded by cv
        self.running: list[Request] = []                                  # scheduler thread only
        self.in_flight = 0                                                # guarded by cv
        self.admitting = True
        self.drain_deadline: float | None = None
        self.state = SchedulerState(kv_blocks_total=engine.kv_blocks_total)
        self.listeners: list[Callable[[RequestStats | StepTokens], None]] = []
        self._step_prompt = 0        # tokens prefilled / generated in the current step
        self._step_generated = 0
        self._avg_e2e = 5.0
        self.block_size = int(engine.info().get("kv_block_size") or 32)
        self.budget = StepBudget(max_step_tokens, self.block_size)
        self.preemptions = 0         # running sequences paused because the KV pool was full
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- HTTP threads -------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: Any, timeout: float | None = None,
               images: list | None = None, session: str | None = None) -> Request:
        """Admit a request into the queue, or raise QueueFullError / ShuttingDownError.
        session: the client's session key, if it sent one (logged with the request)."""
        req = Request(prompt_ids, params, timeout or self.request_timeout, images, session)
        return self._enqueue(req)

    def submit_job(self, job: Callable[[Any, Callable[[], bool]], Any], prompt_ids: list[int],
                   timeout: float | None = None) -> Request:
        """Queue a job like a request (same queue, limits and drain): job(engine, stop) runs on the
        scheduler thread, stop() turning True once the client is gone or the time is up; the
        request's events are its return value, then Finished("stop"). prompt_ids: the tokens it
        computes, for usage and metrics. A job that raises ends as "error" (a ValueError as the
        request's fault, "invalid_prompt"), or as "cancelled" / "timeout" if stop() had turned True."""
        req = Request(prompt_ids, None, timeout or self.request_timeout)
        req.job = job
        return self._enqueue(req)

    def _enqueue(self, req: Request) -> Request:
        with self.cv:
            if not self.admitting or self._stop:
                raise ShuttingDownError("the server is shutting down", retry_after=self._retry_after())
            if self.in_flight >= self.max_batch + self.max_queue:
                raise QueueFullError(
                    f"the request queue is full ({self.max_queue} waiting, {self.max_batch} running)",
                    retry_after=self._retry_after())
            self.in_flight += 1
            self.waiting.append(req)
            self.state.waiting = len(self.waiting)
            self.cv.notify()
        return req

    def cancel(self, req: Request) -> None:
        """The client went away: free the request's slot at the next step (idempotent)."""
        if req.finished is None:
            req.cancelled = True
            with self.cv:
                self.cv.notify()

    def begin_drain(self, grace: float) -> None:
        """SIGTERM: refuse new requests; let accepted ones finish within `grace` seconds."""
        with self.cv:
            self.admitting = False
            self.state.admitting = False
            self.drain_deadline = time.monotonic() + max(0.0, grace)
            self.cv.notify()
        log.info("draining: %d running, %d waiting, grace %.0f s", len(self.running), len(self.waiting), grace)

    def idle(self) -> bool:
        with self.cv:
            return self.in_flight == 0

    def stop(self, timeout: float = 5.0) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def add_listener(self, fn: Callable[[RequestStats | StepTokens], None]) -> None:
        self.listeners.append(fn)

    def _retry_after(self) -> int:
        return int(min(60, max(1, math.ceil(self._avg_e2e))))

    # ---- the scheduler thread ----------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._stop and not self.waiting and not self.running:
                    # Idle: the prefix cache's new blocks go to disk a few at a time meanwhile.
                    self.cv.wait(0.05 if self._persist_some() else 0.5)
                if self._stop:
                    break
                admit = self._take_admissible()
            try:
                self._step(admit)
            except Exception as e:  # an engine failure must not kill the thread: fail what ran
                log.exception("scheduler step failed")
                for req in list(self.running):
                    self._finish(req, Finished("error", None, f"internal error: {e}"))
            self._publish_state()
            if self._step_prompt or self._step_generated:
                self._emit(StepTokens(self._step_prompt, self._step_generated))
                self._step_prompt = self._step_generated = 0
        for req in list(self.running):
            self._finish(req, Finished("shutdown", None, "the server stopped"))
        with self.cv:
            leftover = list(self.waiting)
            self.waiting.clear()
        for req in leftover:
            self._finish(req, Finished("shutdown", None, "the server stopped"))

    def _persist_some(self) -> bool:
        persist = getattr(self.engine, "persist", None)
        if persist is None:
            return False
        try:
            return persist(self.PERSIST_BLOCKS) > 0
        except Exception:
            log.exception("writing the prefix cache to disk failed")
            return False

    def _take_admissible(self) -> list[Request]:
        """Under the lock: pop waiting requests into free batch slots (admission only reserves
        blocks; their prompts are computed chunk by chunk within the steps' budget)."""
        admit = []
        while self.waiting and len(self.running) + len(admit) < self.max_batch:
            admit.append(self.waiting.popleft())
        return admit

    def _step(self, admit: list[Request]) -> None:
        now = time.monotonic()
        self._retire(now)
        # waiting requests can be cancelled or time out before they ever run
        for i, req in enumerate(admit):
            if req.cancelled:
                self._finish(req, Finished("cancelled", None))
            elif self._expired(req, now):
                self._finish(req, self._expired(req, now))
            elif not self._admit(req):
                self._requeue(admit[i:])
                break
        self._run()

    def _expired(self, req: Request, now: float) -> Finished | None:
        if self.drain_deadline is not None and now >= self.drain_deadline:
            return Finished("shutdown", None, "the server is shutting down and its grace period ended")
        if now >= req.deadline:
            return Finished("timeout", None, f"the request exceeded the time limit of {self.request_timeout:g} s")
        return None

    def _retire(self, now: float) -> None:
        for req in list(self.running):
            if req.cancelled:
                self._finish(req, Finished("cancelled", None))
            else:
                expired = self._expired(req, now)
                if expired:
                    self._finish(req, expired)
        with self.cv:      # waiting requests that are already dead free their queue place now
            dead = [r for r in self.waiting if r.cancelled or self._expired(r, now)]
            for r in dead:
                self.waiting.remove(r)
        for r in dead:
            self._finish(r, Finished("cancelled", None) if r.cancelled else self._expired(r, now))

    def _requeue(self, reqs: list[Request]) -> None:
        with self.cv:
            self.waiting.extendleft(reversed(reqs))

    def _run_job(self, req: Request) -> None:
        """A job (submit_job) runs whole, now: between two steps, never beside one."""
        req.admitted_at = time.monotonic()

        def stop() -> bool:
            return req.cancelled or self._expired(req, time.monotonic()) is not None

        try:
            result = req.job(self.engine, stop)
        except KVCacheFullError as e:
            self._finish(req, Finished("error", None, f"the input does not fit in the KV cache ({e})",
                                       cause="prompt_too_long"))
            return
        except Exception as e:
            now = time.monotonic()
            if req.cancelled:
                fin = Finished("cancelled", None)
            elif self._expired(req, now):
                fin = self._expired(req, now)
            elif isinstance(e, ValueError):
                fin = Finished("error", None, str(e), cause="invalid_prompt")
            else:
                log.exception("job of request %d failed", req.id)
                fin = Finished("error", None, f"internal error: {e}")
            self._finish(req, fin)
            return
        req.first_token_at = time.monotonic()
        self._step_prompt += len(req.prompt_ids)
        req.events.put(result)
        self._finish(req, Finished("stop", "stop"))

    def _admit(self, req: Request) -> bool:
        """Give a request (new, or preempted earlier) its blocks. False: not enough KV blocks
        now, try again later. Each running sequence keeps room to grow by a block."""
        if req.job is not None:
            self._run_job(req)
            return True
        keep = len(self.running)
        try:
            if req.seq is None:
                req.seq = self.engine.start(req.prompt_ids, req.params, images=req.images, keep_available=keep)
            else:
                self.engine.resume(req.seq, keep_available=keep)
        except KVCacheFullError:
            if not self.running:   # nothing will free blocks: this prompt can never fit
                self._finish(req, Finished("error", None,
                                           f"the prompt ({len(req.prompt_ids)} tokens) does not fit in the KV cache",
                                           cause="prompt_too_long"))
                return True
            return False
        except ContextLengthError as e:
            self._finish(req, Finished("error", None, str(e), cause="prompt_too_long"))
            return True
        except ValueError as e:    # e.g. a token id outside the vocabulary
            self._finish(req, Finished("error", None, str(e), cause="invalid_prompt"))
            return True
        if req.admitted_at is None:
            req.admitted_at = time.monotonic()
            req.cached_tokens = req.seq.blocks.cached_tokens
            log.info("request %d: %d prompt tokens, %d from the prefix cache%s", req.id, len(req.prompt_ids),
                     req.cached_tokens, f" (session {req.session})" if req.session else "")
        self.running.append(req)
        return True

    def _run(self) -> None:
        """One engine step over the running requests: decoders and a budget of prompt chunks."""
        live = [r for r in self.running if r.seq is not None and not r.seq.done]
        self._make_room(live)
        decoding = [r for r in live if r in self.running and r.seq.prefilled]
        prefilling = [r for r in live if r in self.running and not r.seq.prefilled]
        if not decoding and not prefilling:
            return
        budget = self.budget.tokens
        room = max(self.block_size, budget - len(decoding)) if decoding else max(budget, self.engine.prefill_chunk)
        chunks = []
        for req in prefilling:
            if room <= 0:
                break
            n = min(room, req.seq.prefill_remaining)
            chunks.append((req.seq, n))
            room -= n
        before = {id(seq): seq.n_context - seq.blocks.cached_tokens for seq, _ in chunks}
        t0 = time.perf_counter()
        results = self.engine.step([r.seq for r in decoding], chunks)
        # Rows computed, not read back from disk (those count as cached).
        prompt_rows = sum(seq.n_context - seq.blocks.cached_tokens - before[id(seq)] for seq, _ in chunks)
        self.budget.observe(time.perf_counter() - t0, len(decoding), prompt_rows)
        self._step_prompt += prompt_rows
        owner = {id(r.seq): r for r in live}
        for seq, ev in results:
            self._deliver(owner[id(seq)], ev)

    def _make_room(self, live: list[Request]) -> None:
        """Before a step: every decoding sequence whose context sits on a block boundary needs a
        new block. While the pool cannot give them all one, the most recently admitted sequence
        is preempted: it resumes later from where it stopped, recomputing what the prefix cache
        no longer holds; its client sees a pause, never a truncated answer."""
        live = list(live)
        while live:
            need = self.engine.blocks_to_grow([r.seq for r in live if r.seq.prefilled])
            if need <= self.engine.kv_blocks_available:
                return
            victim = max(live, key=lambda r: r.admitted_at or 0.0)
            live.remove(victim)
            if not live:           # alone and still no room: the pool is smaller than a context
                self._finish(victim, Finished("error", None, "the KV cache cannot hold this sequence"))
                return
            self._preempt(victim)

    def _preempt(self, req: Request) -> None:
        self.engine.preempt(req.seq)
        self.running.remove(req)
        self.preemptions += 1
        log.info("KV cache full: request %d paused after %d tokens; it resumes when blocks free up",
                 req.id, req.completion_tokens)
        with self.cv:
            self.waiting.appendleft(req)

    def _deliver(self, req: Request, ev) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            req.cached_tokens = getattr(ev, "cached_tokens", req.cached_tokens)
        req.completion_tokens = ev.completion_tokens
        self._step_generated += 1
        req.events.put(ev)
        if ev.finish_reason is not None:
            self._finish(req, Finished(ev.finish_reason, ev.finish_reason, "",
                                       ev.prompt_tokens, ev.completion_tokens,
                                       draft_tokens=getattr(ev, "draft_tokens", None),
                                       accepted_draft_tokens=getattr(ev, "accepted_draft_tokens", None)))

    def _finish(self, req: Request, fin: Finished) -> None:
        if req.finished is not None:
            return
        if req.seq is not None:
            self.engine.release(req.seq)
        if req in self.running:
            self.running.remove(req)
        if not fin.prompt_tokens:
            fin.prompt_tokens = len(req.prompt_ids)
            fin.completion_tokens = req.completion_tokens
        fin.cached_tokens = req.cached_tokens
        req.finished = fin
        req.events.put(fin)
        now = time.monotonic()
        with self.cv:
            self.in_flight -= 1
        e2e = now - req.arrival
        if fin.outcome in ("stop", "length"):
            self._avg_e2e = 0.8 * self._avg_e2e + 0.2 * e2e
        stats = RequestStats(fin.outcome, fin.prompt_tokens, fin.completion_tokens,
                             (req.admitted_at or now) - req.arrival,
                             None if req.first_token_at is None else req.first_token_at - req.arrival,
                             e2e, cached_tokens=fin.cached_tokens)
        self._emit(stats)

    def _emit(self, stats) -> None:
        for fn in self.listeners:
            try:
                fn(stats)
            except Exception:
                log.exception("scheduler listener failed")

    def _publish_state(self) -> None:
        with self.cv:
            waiting = len(self.waiting)
        engine = self.engine
        prefix = engine.prefix_cache_stats() if hasattr(engine, "prefix_cache_stats") else None
        self.state = SchedulerState(
            running=len(self.running), waiting=waiting,
            kv_blocks_used=engine.kv_blocks_used, kv_blocks_total=engine.kv_blocks_total,
            contexts=tuple(r.seq.n_context for r in self.running if r.seq is not None),
            steps=self.state.steps + 1, admitting=self.admitting, preemptions=self.preemptions,
            kv_tokens_total=engine.kv_blocks_total * self.block_size,
            kv_blocks_cached=0 if prefix is None else prefix.blocks_idle, prefix=prefix,
            step_tokens=self.budget.tokens)
