"""Admission, continuous batching and cancellation in front of the engine.

The engine is not thread-safe, so exactly one thread (the scheduler's) calls
engine.start / prefill / decode / release. HTTP threads talk to it only through
`submit()` (which admits into a bounded queue or refuses), `cancel()`, and each
request's own event queue, which carries the engine's TokenEvents and then one
`Finished`.

One loop iteration ("step"):
  1. retire requests that were cancelled (client gone) or ran out of time, freeing
     their KV blocks: a disconnect costs at most the step in progress;
  2. admit waiting requests while there are batch slots and KV blocks: start + prefill
     (while others decode, up to PREFILL_BUDGET prompt tokens per step);
  3. decode every running sequence together: one batched engine.decode() call.
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
PREFILL_BUDGET = 512     # prompt tokens prefilled per step while other sequences decode


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


@dataclass
class RequestStats:
    """One finished request, for metrics (plain data: the scheduler knows nothing of Prometheus)."""
    outcome: str
    prompt_tokens: int
    completion_tokens: int
    queue_s: float               # arrival -> admitted to a decode slot (None-free: 0 if never)
    ttft_s: float | None         # arrival -> first token
    e2e_s: float                 # arrival -> finished


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
    preemptions: int = 0         # sequences ended early because the KV pool was full


_ids = itertools.count(1)


class Request:
    def __init__(self, prompt_ids: list[int], params: Any, timeout: float, images: list | None = None):
        self.id = next(_ids)
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
        self.finished: Finished | None = None

    def next_event(self, timeout: float):
        """The next TokenEvent or Finished, or None if nothing came within `timeout` s."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


class Scheduler:
    def __init__(self, engine, max_queue: int = 16, max_batch: int = 8,
                 request_timeout: float = 600.0):
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
        self.preemptions = 0         # sequences ended early because the KV pool was full
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- HTTP threads -------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: Any, timeout: float | None = None,
               images: list | None = None) -> Request:
        """Admit a request into the queue, or raise QueueFullError / ShuttingDownError."""
        req = Request(prompt_ids, params, timeout or self.request_timeout, images)
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
                    self.cv.wait(0.5)
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

    def _take_admissible(self) -> list[Request]:
        """Under the lock: pop waiting requests into free batch slots. While sequences are
        decoding, prefills per step stop at PREFILL_BUDGET prompt tokens (at least one
        request), so a burst of long prompts cannot stall running streams for long."""
        admit, tokens = [], 0
        while self.waiting and len(self.running) + len(admit) < self.max_batch:
            if self.running and admit and tokens + len(self.waiting[0].prompt_ids) > PREFILL_BUDGET:
                break
            req = self.waiting.popleft()
            tokens += len(req.prompt_ids)
            admit.append(req)
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
        live = self._make_room_to_grow([r for r in self.running if r.seq is not None and not r.seq.done])
        if live:
            events = self.engine.decode([r.seq for r in live])
            for req, ev in zip(live, events):
                self._deliver(req, ev)

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

    def _admit(self, req: Request) -> bool:
        """Start and prefill one request. False: not enough KV blocks now, try again later."""
        if self.running and not self._kv_room_for(len(req.prompt_ids)):
            return False
        try:
            req.seq = self.engine.start(req.prompt_ids, req.params, images=req.images)
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
        req.admitted_at = time.monotonic()
        self.running.append(req)
        self._step_prompt += len(req.prompt_ids)
        try:
            ev = self.engine.prefill(req.seq)
        except Exception as e:      # this request's failure only; the batch goes on
            log.exception("prefill failed")
            self._finish(req, Finished("error", None, f"prefill failed: {e}"))
            return True
        self._deliver(req, ev)
        return True

    def _kv_room_for(self, prompt_tokens: int) -> bool:
        """Admit only if the prompt fits and every running sequence can still grow a block."""
        free = self.engine.kv_blocks_total - self.engine.kv_blocks_used
        need = -(-prompt_tokens // self.block_size)
        return free - need >= len(self.running) + 1

    def _make_room_to_grow(self, live: list[Request]) -> list[Request]:
        """Before a decode step: a sequence whose context sits on a block boundary needs one
        new block. If the pool cannot give every such sequence its block, the most recently
        admitted sequences end now (finish_reason "length": their context cannot grow)."""
        live = list(live)
        while live:
            free = self.engine.kv_blocks_total - self.engine.kv_blocks_used
            growing = sum(1 for r in live if r.seq.n_context % self.block_size == 0)
            if growing <= free:
                return live
            victim = max(live, key=lambda r: r.admitted_at or 0.0)
            live.remove(victim)
            self.preemptions += 1
            log.warning("KV cache full: ending request %d after %d tokens", victim.id, victim.completion_tokens)
            self._finish(victim, Finished("length", "length", "", len(victim.prompt_ids),
                                          victim.completion_tokens))
        return live

    def _deliver(self, req: Request, ev) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.completion_tokens = ev.completion_tokens
        self._step_generated += 1
        req.events.put(ev)
        if ev.finish_reason is not None:
            self._finish(req, Finished(ev.finish_reason, ev.finish_reason, "",
                                       ev.prompt_tokens, ev.completion_tokens))

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
                             e2e)
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
        self.state = SchedulerState(
            running=len(self.running), waiting=waiting,
            kv_blocks_used=self.engine.kv_blocks_used, kv_blocks_total=self.engine.kv_blocks_total,
            contexts=tuple(r.seq.n_context for r in self.running if r.seq is not None),
            steps=self.state.steps + 1, admitting=self.admitting, preemptions=self.preemptions)
