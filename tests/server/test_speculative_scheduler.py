"""Speculating requests in the scheduler beside plain ones: the answers of solo runs, several
tokens delivered per step, and the drafts reported on Finished."""
from __future__ import annotations


from appliance.engine.sampling import SamplingParams
from appliance.engine.stats import DecodeStats
from appliance.server.scheduler import Finished, Scheduler
from test_scheduler import drain

SPEC = {"num_tokens": 4, "ngram_min": 1, "adaptive": False}


def test_speculating_and_plain_requests_share_steps(server_model_dir):
    from appliance import Engine
    engine = Engine.load(server_model_dir, progress=False, max_context=1024, threads=1)
    prompts = [engine.tokenizer.encode(f"Hello world! How are you today? {i} " * 4) for i in range(4)]

    def params(spec):
        return SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, speculative=spec)

    solo = [engine.generate(p, stream=False, max_tokens=48, temperature=0.0, ignore_eos=True)["token_ids"]
            for p in prompts]
    several = []
    engine.add_stats_listener(lambda s: several.append(max(s.tokens)) if isinstance(s, DecodeStats) and s.tokens
                              else None)
    sched = Scheduler(engine, max_batch=4, max_queue=4).start()
    try:
        reqs = [sched.submit(p, params(SPEC if i % 2 == 0 else None)) for i, p in enumerate(prompts)]
        outs = [drain(r, timeout=60.0) for r in reqs]
    finally:
        sched.stop()
    for i, events in enumerate(outs):
        tokens = [e.token_id for e in events if not isinstance(e, Finished)]
        fin = events[-1]
        assert tokens == solo[i] and fin.outcome == "length" and fin.completion_tokens == 48
        if i % 2 == 0:
            assert fin.draft_tokens > 0 and 0 < fin.accepted_draft_tokens <= fin.draft_tokens
        else:
            assert fin.draft_tokens is None
    assert several and max(several) > 1                 # some step delivered several tokens to one request
    assert engine.kv_blocks_used == 0
