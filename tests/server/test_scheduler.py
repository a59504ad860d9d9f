"""The scheduler in process, driving the real engine on the tiny model."""
from __future__ import annotations

import itertools
import time
import types

import pytest

from appliance.engine.stats import DecodeStats
from appliance.engine.sampling import SamplingParams
from appliance.server.scheduler import (Finished, QueueFullError, RequestStats, Scheduler, ShuttingDownError,
                                        StepBudget, StepTokens)


@pytest.fixture
def engine_factory(server_model_dir):
    from appliance import Engine

    def make(**kw):
        kw.setdefault("max_context", 1024)
        return Engine.load(server_model_dir, progress=False, **kw)

    return make


@pytest.fixture
def make_scheduler(engine_factory):
    made = []

    def make(engine=None, **kw):
        s = Scheduler(engine or engine_factory(), **kw).start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def drain(req, timeout=30.0):
    """All events of a request, up to its Finished (bounded)."""
    events, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = req.next_event(0.5)
        if ev is None:
            continue
        events.append(ev)
        if isinstance(ev, Finished):
            return events
    raise AssertionError("request did not finish")


def prompt(engine, text="Hello world! How are you today?"):
    return engine.tokenizer.encode(text)


def params(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def test_sequences_are_decoded_together(engine_factory, make_scheduler):
    engine = engine_factory()
    batches = []
    engine.add_stats_listener(lambda s: batches.append(s.batch) if isinstance(s, DecodeStats) else None)
    sched = make_scheduler(engine, max_batch=4, max_queue=4)
    # All four wait before the first step (the scheduler takes its lock to admit): otherwise the
    # first could have decoded its 30 tokens before a slow machine submitted the fourth.
    with sched.cv:
        reqs = [sched.submit(prompt(engine, f"Request {i}"), params(30)) for i in range(4)]
    outs = [drain(r) for r in reqs]
    for events in outs:
        assert events[-1].outcome == "length" and events[-1].completion_tokens == 30
        assert sum(1 for e in events if not isinstance(e, Finished)) == 30
    assert max(batches) == 4                       # one engine.decode() carried all four
    assert engine.kv_blocks_used == 0


def test_batched_output_equals_alone(engine_factory, make_scheduler):
    """Greedy output of a sequence does not depend on its batch mates."""
    engine = engine_factory()
    sched = make_scheduler(engine, max_batch=4)
    alone = drain(sched.submit(prompt(engine), params(12)))
    together = [sched.submit(prompt(engine, t), params(12)) for t in
                ("Hello world! How are you today?", "Python is a language", "The quick brown fox")]
    first = drain(together[0])
    for r in together[1:]:
        drain(r)
    ids = lambda evs: [e.token_id for e in evs if not isinstance(e, Finished)]  # noqa: E731
    assert ids(first) == ids(alone)


def test_cancel_frees_kv_within_a_step(engine_factory, make_scheduler):
    engine = engine_factory()
    sched = make_scheduler(engine, max_batch=2)
    req = sched.submit(prompt(engine), params(900))
    assert req.next_event(10) is not None          # running
    wait_for(lambda: sched.state.kv_blocks_used > 0)
    steps_before = sched.state.steps
    sched.cancel(req)
    events = drain(req)
    assert events[-1].outcome == "cancelled"
    wait_for(lambda: engine.kv_blocks_used == 0 and sched.state.running == 0)
    assert sched.state.steps - steps_before <= 3   # freed at the next step (+ publish lag)


def test_queue_bound(engine_factory, make_scheduler):
    engine = engine_factory()
    sched = make_scheduler(engine, max_batch=1, max_queue=1)
    a = sched.submit(prompt(engine), params(800))
    b = sched.submit(prompt(engine), params(800))
    with pytest.raises(QueueFullError) as e:
        sched.submit(prompt(engine), params(5))
    assert e.value.retry_after >= 1
    sched.cancel(a)
    sched.cancel(b)
    assert drain(a)[-1].outcome == "cancelled" and drain(b)[-1].outcome == "cancelled"
    c = sched.submit(prompt(engine), params(3))     # room again
    assert drain(c)[-1].outcome == "length"


def slowed(engine, step_s=0.005):
    """The engine with every step taking at least step_s: a 1000-token request then outlasts
    sub-second limits on any machine (the tiny model alone decodes 1000-4000 tokens/s). The
    scheduler runs its work through engine.step, so that is what waits."""
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(step_s)
        return step(*args, **kwargs)

    engine.step = slow_step
    return engine


def test_request_time_limit(engine_factory, make_scheduler):
    engine = slowed(engine_factory())
    sched = make_scheduler(engine, request_timeout=0.3)
    t0 = time.monotonic()
    fin = drain(sched.submit(prompt(engine), params(1000)))[-1]
    assert fin.outcome == "timeout" and "time limit" in fin.message
    assert time.monotonic() - t0 < 3
    wait_for(lambda: engine.kv_blocks_used == 0)


def test_drain_refuses_new_and_ends_after_grace(engine_factory, make_scheduler):
    engine = slowed(engine_factory())
    sched = make_scheduler(engine)
    long = sched.submit(prompt(engine), params(1000))
    assert long.next_event(10) is not None
    sched.begin_drain(grace=0.3)
    with pytest.raises(ShuttingDownError):
        sched.submit(prompt(engine), params(5))
    fin = drain(long)[-1]
    assert fin.outcome == "shutdown" and fin.completion_tokens < 1000
    wait_for(lambda: engine.kv_blocks_used == 0)


def test_drain_lets_accepted_requests_finish(engine_factory, make_scheduler):
    engine = engine_factory()
    sched = make_scheduler(engine, max_batch=1)
    running = sched.submit(prompt(engine), params(20))
    queued = sched.submit(prompt(engine), params(20))       # waits for the single slot
    sched.begin_drain(grace=30)
    assert drain(running)[-1].outcome == "length"
    assert drain(queued)[-1].outcome == "length"


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if not isinstance(e, Finished)]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_full_pool_pauses_the_youngest_and_every_answer_is_whole(engine_factory, make_scheduler, prefix_cache):
    """A pool of 4 blocks (128 tokens) cannot hold two 110-token sequences: the younger is
    preempted (paused, not cut short), resumes when the older finishes, and both answers are
    token for token what each gets alone."""
    engine = engine_factory(max_context=128, kv_cache_tokens=128, prefix_cache=prefix_cache)
    assert engine.kv_blocks_total == 4
    sched = make_scheduler(engine, max_batch=2)
    prompts = [prompt(engine), prompt(engine, "Python is a language")]
    alone = [tokens_of(drain(sched.submit(p, params(100)))) for p in prompts]
    old = sched.submit(prompts[0], params(100))
    first = old.next_event(10)
    assert first is not None
    young = sched.submit(prompts[1], params(100))
    got_old, got_young = [first] + drain(old), drain(young)
    for events, want in ((got_old, alone[0]), (got_young, alone[1])):
        assert events[-1].outcome == "length" and events[-1].completion_tokens == 100
        assert tokens_of(events) == want
    assert sched.preemptions >= 1
    wait_for(lambda: engine.kv_blocks_used == 0)


def test_a_repeated_prompt_reports_its_cached_tokens(engine_factory, make_scheduler):
    engine = engine_factory(prefix_cache=True)
    sched = make_scheduler(engine)
    ids = prompt(engine, "The quick brown fox jumps over the lazy dog. " * 6)
    first, second = drain(sched.submit(ids, params(5))), drain(sched.submit(ids, params(5)))
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == (len(ids) - 1) // 32 * 32 > 0
    assert tokens_of(first) == tokens_of(second)
    wait_for(lambda: sched.state.prefix is not None and sched.state.prefix.hit_tokens == second[-1].cached_tokens)


# ---- chunked prefill beside decoding, with a fake engine whose steps take time per row ----------

class FakeSeq:
    _ids = itertools.count()

    def __init__(self, prompt_ids, params):
        self.id = next(self._ids)
        self.prompt_ids, self.params = list(prompt_ids), params
        self.output_ids: list[int] = []
        self.done_prompt = 0
        self.finish_reason = None
        self.blocks = types.SimpleNamespace(cached_tokens=0)

    @property
    def prefilled(self):
        return self.done_prompt >= len(self.prompt_ids)

    @property
    def prefill_remaining(self):
        return len(self.prompt_ids) - self.done_prompt

    @property
    def n_context(self):
        return self.done_prompt + max(0, len(self.output_ids) - 1)

    @property
    def done(self):
        return self.finish_reason is not None


class SlowEngine:
    """The scheduler's view of an engine: each step sleeps ROW_S per row, as a CPU engine takes
    time per row; it records who was in every step."""

    ROW_S = 0.0002
    prefill_chunk = 512
    kv_blocks_total = 10_000
    kv_blocks_used = 0
    kv_blocks_available = 10_000

    def __init__(self):
        self.steps: list[tuple[set[int], dict[int, int]]] = []      # (decoding ids, {id: prompt rows})

    def info(self):
        return {"kv_block_size": 32}

    def start(self, prompt_ids, params, images=None, keep_available=0):
        return FakeSeq(prompt_ids, params)

    def blocks_to_grow(self, seqs):
        return 0

    def step(self, decode, prefill=()):
        rows = len(decode) + sum(n for _, n in prefill)
        time.sleep(self.ROW_S * rows)
        self.steps.append(({s.id for s in decode}, {s.id: n for s, n in prefill}))
        out = []
        for s in decode + [s for s, n in prefill if s.done_prompt + n >= len(s.prompt_ids)]:
            if s in decode:
                s.output_ids.append(1)
            else:
                s.done_prompt = len(s.prompt_ids)
                s.output_ids.append(1)
            done = len(s.output_ids) >= s.params.max_tokens
            s.finish_reason = "length" if done else None
            out.append((s, types.SimpleNamespace(token_id=1, text="", finish_reason=s.finish_reason,
                                                 prompt_tokens=len(s.prompt_ids),
                                                 completion_tokens=len(s.output_ids))))
        for s, n in prefill:
            if not s.prefilled:
                s.done_prompt += n
        return out

    def release(self, seq):
        pass


def test_running_streams_get_a_token_every_step_while_a_long_prompt_is_admitted(make_scheduler):
    engine = SlowEngine()
    sched = make_scheduler(engine, max_batch=4, max_step_tokens=64)
    streams = [sched.submit([7] * 20, params(400)) for _ in range(2)]
    for r in streams:
        assert r.next_event(10) is not None
    long = sched.submit([7] * 4096, params(3))
    fin = drain(long)[-1]
    assert fin.outcome == "length"
    for r in streams:
        sched.cancel(r)
        drain(r)
    ids = {s.seq.id for s in streams}
    during = [(dec, chunks) for dec, chunks in engine.steps if long.seq.id in chunks]
    assert sum(chunks[long.seq.id] for _, chunks in during) == 4096
    assert len(during) >= 4096 // 62
    for decoding, chunks in during:
        assert ids <= decoding                                # every stream's token in every such step
        assert len(decoding) + sum(chunks.values()) <= 64     # and the step within its budget


def test_alone_a_prompt_is_computed_in_large_chunks(make_scheduler):
    engine = SlowEngine()
    sched = make_scheduler(engine, max_step_tokens=64)
    drain(sched.submit([7] * 1600, params(2)))
    chunks = [c for _, step in engine.steps for c in step.values()]
    assert chunks[:3] == [512, 512, 512]


def test_the_auto_budget_makes_a_step_last_a_few_decode_steps():
    budget = StepBudget(None, 32)
    assert budget.tokens == StepBudget.INITIAL
    for _ in range(20):
        budget.observe(0.040, decode_rows=2, prompt_rows=0)           # a decode step: 40 ms
        budget.observe(0.040 + 62 * 0.0064, decode_rows=2, prompt_rows=62)   # 6.4 ms per prompt row
    assert budget.tokens == pytest.approx(7 * 0.040 / 0.0064, abs=1)
    assert StepBudget(96, 32).tokens == 96


def test_invalid_token_ids_fail_only_that_request(engine_factory, make_scheduler):
    engine = engine_factory()
    sched = make_scheduler(engine)
    ok = sched.submit(prompt(engine), params(20))
    bad = sched.submit([10 ** 7], params(5))
    assert drain(bad)[-1].cause == "invalid_prompt"
    assert drain(ok)[-1].outcome == "length"


def test_listeners_get_plain_stats(engine_factory, make_scheduler):
    engine = engine_factory()
    sched = make_scheduler(engine)
    got = []
    sched.add_listener(got.append)
    ids = prompt(engine)
    drain(sched.submit(ids, params(7)))
    wait_for(lambda: any(isinstance(s, RequestStats) for s in got))
    req = next(s for s in got if isinstance(s, RequestStats))
    assert (req.outcome, req.prompt_tokens, req.completion_tokens) == ("length", len(ids), 7)
    assert 0 < req.ttft_s <= req.e2e_s and req.queue_s >= 0
    wait_for(lambda: sum(s.generated_tokens for s in got if isinstance(s, StepTokens)) == 7)
    assert sum(s.prompt_tokens for s in got if isinstance(s, StepTokens)) == len(ids)
