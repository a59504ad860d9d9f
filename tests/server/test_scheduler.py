"""The scheduler in process, driving the real engine on the tiny model."""
from __future__ import annotations

import time

import pytest

from appliance.engine.stats import DecodeStats
from appliance.engine.sampling import SamplingParams
from appliance.server.scheduler import (Finished, QueueFullError, RequestStats, Scheduler, ShuttingDownError,
                                 StepTokens)


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
    """The engine with every decode step taking at least step_s: a 1000-token request then
    outlasts sub-second limits on any machine (the tiny model alone decodes ~1000 tokens/s)."""
    decode = engine.decode

    def slow_decode(seqs):
        time.sleep(step_s)
        return decode(seqs)

    engine.decode = slow_decode
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


def test_kv_pool_exhaustion_ends_the_youngest(engine_factory, make_scheduler):
    """A pool of 4 blocks (128 tokens) cannot hold two 110-token sequences: the younger ends
    early with "length", the older runs to its end, nothing raises, every block comes back."""
    engine = engine_factory(max_context=128)
    assert engine.kv_blocks_total == 4
    sched = make_scheduler(engine, max_batch=2)
    old = sched.submit(prompt(engine), params(100))
    assert old.next_event(10) is not None
    young = sched.submit(prompt(engine), params(100))
    fin_old, fin_young = drain(old)[-1], drain(young)[-1]
    assert fin_old.outcome == "length" and fin_old.completion_tokens == 100
    assert fin_young.finish_reason == "length" and fin_young.completion_tokens < 100
    assert sched.preemptions >= 1
    wait_for(lambda: engine.kv_blocks_used == 0)


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
