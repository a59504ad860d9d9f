"""Speculative decoding: the same tokens as without it, rejected rows leaving the KV pool exactly as
if never written (every format, block boundaries, sparse attention, the prefix cache), stop
conditions and per-token processing exact when several tokens land in one step, and backing off."""
from __future__ import annotations

import numpy as np
import pytest

from appliance import Engine
from appliance.engine import speculative
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import PromptLookup, Speculation, SpeculativeConfig, SpeculativeStats, StepCosts

SPARSE_BOUND = {"k": 4, "block": 8, "probe": 8, "probe_mode": "bound"}      # active past 2 blocks of 8
SPARSE_STRIDED = {"k": 4, "block": 8, "probe": 2, "probe_mode": "strided"}  # compact probe rows


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, 400, size=n)]


class Scripted:
    """A drafter that knows the plain run's answer and gets it wrong where `wrong(o, i)` says:
    o = tokens generated so far, i = position in the draft. Lets a test choose where drafts are
    accepted and rejected (across block boundaries, at stop conditions)."""

    def __init__(self, n_prompt: int, answer: list[int], wrong=lambda o, i: False, vocab: int = 400):
        self.n_prompt, self.answer, self.wrong, self.vocab = n_prompt, answer, wrong, vocab

    def propose(self, tokens, k):
        o = len(tokens) - self.n_prompt
        draft = []
        for i in range(k):
            true = self.answer[o + i] if o + i < len(self.answer) else 7
            draft.append((true + 1) % self.vocab if self.wrong(o, i) else true)
        return draft, 0


@pytest.fixture
def scripted(monkeypatch):
    """Register the method "scripted" for one test: scripted(n_prompt, answer, wrong)."""

    def use(n_prompt, answer, wrong=lambda o, i: False):
        monkeypatch.setitem(speculative._DRAFTERS, "scripted",
                            lambda config: Scripted(n_prompt, answer, wrong))
        return {"method": "scripted", "num_tokens": 4, "adaptive": False}

    return use


def load(model_dir, **kw):
    kw.setdefault("max_context", 512)
    return Engine.load(model_dir, progress=False, threads=1, **kw)


def pool_state(engine) -> dict:
    """Every array of the KV pool, the free list and the reference counts, as copies."""
    state = {name: a.copy() for name, a in engine.cache._block_arrays().items()}
    state["free"] = list(engine.cache.pool.free)
    state["refs"] = list(engine.cache.pool.refs)
    state["names"] = dict(engine.cache.pool.hash_of)
    return state


def run(engine, ids, n, speculative_=None, **params):
    """Generate through the step API; (events, the pool before release, the sequence)."""
    p = engine.sampling_params(max_tokens=n, temperature=params.pop("temperature", 0.0), ignore_eos=True,
                               speculative=speculative_, **params)
    seq = engine.start(list(ids), p)
    events = [engine.prefill(seq)]
    while not seq.done:
        events += engine.decode([seq])
    assert seq.n_context == len(seq.prompt_ids) + len(seq.output_ids) - 1
    state = pool_state(engine)
    importance = None if seq.blocks.importance is None else seq.blocks.importance.tokens.copy()
    engine.release(seq)
    return events, state, seq, importance


def same_pool(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], np.ndarray):
            assert np.array_equal(a[name], b[name]), f"pool array {name} differs"
        else:
            assert a[name] == b[name], name


def event_view(e):
    return (e.token_id, e.text, e.finish_reason, e.completion_tokens, e.logprob, e.top_logprobs)


# ---- drafting and the policy -------------------------------------------------------------

def test_prompt_lookup_drafts_from_the_latest_longest_match():
    d = PromptLookup(2, 4)
    # "5 6 7" occurs twice before the end: the latest occurrence (followed by 9) wins over the first.
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 3, 5, 6, 7]
    assert d.propose(tokens, 3) == ([9, 2, 3], 3)
    # a 4-gram beats a later 2-gram
    tokens = [1, 2, 3, 4, 50, 60, 9, 3, 4, 70, 1, 2, 3, 4]
    assert PromptLookup(2, 4).propose(tokens, 2) == ([50, 60], 4)
    # nothing as long as ngram_min: no draft
    assert PromptLookup(2, 4).propose([1, 2, 3, 4, 5], 3) == ([], 0)
    # a loop runs on past the end of what it copies
    assert PromptLookup(2, 2).propose([1, 8, 9, 8, 9], 5) == ([8, 9, 8, 9, 8], 2)


def test_prompt_lookup_indexes_as_the_sequence_grows():
    d = PromptLookup(1, 2)
    assert d.propose([4, 5, 6], 2) == ([], 0)
    assert d.propose([4, 5, 6, 4], 2) == ([5, 6], 1)
    assert d.propose([4, 5, 6, 4, 5], 2) == ([6, 4], 2)


def test_speculative_config_checks_its_fields():
    assert SpeculativeConfig.coerce(None) is None and SpeculativeConfig.coerce(0) is None
    assert SpeculativeConfig.coerce(3) == SpeculativeConfig(num_tokens=3)
    assert SpeculativeConfig.coerce({"ngram_max": 6}).ngram_max == 6
    for bad, word in [({"num_tokens": 0}, "num_tokens"), ({"num_tokens": 99}, "num_tokens"),
                      ({"method": "eagle"}, "method"), ({"ngram_min": 5, "ngram_max": 3}, "ngram_min"),
                      ({"ngram_min": 2.5}, "ngram_min"), ({"depth": 2}, "depth"), (True, "speculative")]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.coerce(bad)


def test_draft_length_follows_acceptance_and_row_cost():
    s = Speculation(SpeculativeConfig(num_tokens=8))
    s.acceptance[3] = 0.9
    assert s.draft_length(3, 0.1) == 8             # 0.9**8 = 0.43 > 0.1
    assert s.draft_length(3, 0.5) == 6             # 0.9**6 = 0.53 > 0.5 > 0.9**7
    s.acceptance[3] = 0.3
    assert s.draft_length(3, 0.1) == 1 and s.draft_length(3, 0.3) == 0
    assert Speculation(SpeculativeConfig(num_tokens=5, adaptive=False)).draft_length(3, 0.99) == 5


def test_rejections_back_off_to_rare_probes():
    """Drafts that keep failing stop being drafted; one token is probed every PROBE_EVERY steps."""
    s = Speculation(SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=1))
    tokens = [3, 4] * 8
    rows = []
    for step in range(200):
        draft = s.draft(tokens, [], 4, row_share=0.2)
        rows.append(len(draft))
        if draft:
            s.record(len(draft), 0)                  # every draft rejected at its first token
    assert rows[0] == 2                              # the prior: 0.5**2 > 0.2 > 0.5**3
    assert sum(rows[-160:]) == 160 // Speculation.PROBE_EVERY
    for step in range(200):                          # the answer starts copying: probes bring drafting back
        draft = s.draft(tokens, [], 4, row_share=0.2)
        if draft:
            s.record(len(draft), len(draft))
    assert s.draft_length(1, 0.2) == 4


def test_step_costs_fit_a_line_through_measured_steps():
    c = StepCosts()
    assert c.row_share(1) == StepCosts.PRIOR_ROW_SHARE
    for _ in range(5):
        for rows in (1, 3, 5):
            c.observe(rows, 0.040 + 0.005 * rows)
    w, per_row = c.fit()
    assert w == pytest.approx(0.040) and per_row == pytest.approx(0.005)
    assert c.row_share(1) == pytest.approx(0.005 / 0.045)
    assert c.row_share(4) == pytest.approx(0.020 / 0.060)


def test_stats_count_drafts_per_position():
    s = SpeculativeStats()
    s.add(3, 1)
    s.add(4, 4)
    s.add(1, 0)
    assert s.drafted == [3, 2, 2, 1] and s.accepted == [2, 1, 1, 1]
    assert (s.draft_tokens, s.accepted_tokens, s.sequences) == (8, 5, 3)


# ---- the same answer, the same pool ---------------------------------------------------------

# (kv, sparse, prefix cache): every KV format, both sparse probes, the prefix cache.
LAYOUTS = [("q8", None, False), ("q4", None, False), ("f32", None, False), ("q8", SPARSE_BOUND, False),
           ("q4", SPARSE_STRIDED, False), ("q8", SPARSE_BOUND, True), ("q8", None, True)]


@pytest.mark.parametrize("kv,sparse,prefix", LAYOUTS)
def test_rejected_rows_leave_the_pool_as_if_never_written(tiny_qwen3_dir, scripted, kv, sparse, prefix):
    """Greedy, with drafts accepted and rejected at every offset of a block, across block
    boundaries: the same events, and the same pool bit for bit (rows past the length included),
    free list, reference counts, cached block names and sparse importance as a plain run."""
    ids = prompt(37, seed=1)
    n = 70
    plain = load(tiny_qwen3_dir, kv=kv, sparse=sparse, prefix_cache=prefix)
    want, want_pool, _, want_imp = run(plain, ids, n, logprobs=2)
    answer = [e.token_id for e in want]
    spec = load(tiny_qwen3_dir, kv=kv, sparse=sparse, prefix_cache=prefix)
    # wrong at draft position (o % 5): all four accepted (o % 5 == 4), or cut after 0..3 of them
    got, got_pool, seq, got_imp = run(spec, ids, n, scripted(len(ids), answer, lambda o, i: i == o % 5), logprobs=2)
    assert [event_view(e) for e in got] == [event_view(e) for e in want]
    assert seq.speculation.accepted > 20 and seq.speculation.drafted - seq.speculation.accepted > 10
    same_pool(got_pool, want_pool)
    assert (got_imp is None) == (want_imp is None)
    if want_imp is not None:
        assert np.array_equal(got_imp, want_imp)


def test_every_draft_rejected_takes_nothing(tiny_qwen3_dir, scripted):
    ids = prompt(30, seed=2)
    plain = load(tiny_qwen3_dir)
    want, want_pool, _, _ = run(plain, ids, 40)
    spec = load(tiny_qwen3_dir)
    got, got_pool, seq, _ = run(spec, ids, 40, scripted(len(ids), [e.token_id for e in want], lambda o, i: i == 0))
    assert [e.token_id for e in got] == [e.token_id for e in want]
    assert seq.speculation.accepted == 0 and seq.speculation.drafted > 100
    same_pool(got_pool, want_pool)


def test_the_demo_model_copying_its_prompt_gives_the_plain_answer():
    """Real prompt lookup on a trained model: identical greedy text, most drafts accepted."""
    engine = load(None)
    text = [{"role": "user", "content": "The password for the north gate is falcon. The code for the blue "
                                        "door is maple. What is the password for the north gate?"}]
    want = engine.generate(text, stream=False, max_tokens=48, temperature=0.0, ignore_eos=True)
    events = list(engine.generate(text, max_tokens=48, temperature=0.0, ignore_eos=True,
                                  speculative={"num_tokens": 4, "adaptive": False}))
    assert [e.token_id for e in events] == want["token_ids"]
    assert "".join(e.text for e in events) == want["text"]
    last = events[-1]
    assert last.accepted_draft_tokens > 0.6 * last.draft_tokens > 10


def test_a_batch_mixing_speculating_plain_and_prefilling_sequences(tiny_qwen3_dir, scripted):
    """One step carries a drafted row, a plain decode row and a prompt chunk; each gets its solo answer."""
    engine = load(tiny_qwen3_dir, sparse=SPARSE_BOUND)
    a_ids, b_ids, c_ids = prompt(20, 3), prompt(44, 4), prompt(90, 5)
    solo = {k: [e.token_id for e in run(engine, ids, 30)[0]] for k, ids in (("a", a_ids), ("b", b_ids), ("c", c_ids))}
    plan = scripted(len(a_ids), solo["a"], lambda o, i: i == o % 3)
    a = engine.start(a_ids, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=plan))
    b = engine.start(b_ids, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    c = engine.start(c_ids, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    got = {a.id: [engine.prefill(a).token_id], b.id: [engine.prefill(b).token_id], c.id: []}
    mixed = 0
    while not (a.done and b.done and c.done):
        decoding = [s for s in (a, b, c) if s.prefilled and not s.done]
        prefill = [(c, 24)] if not c.prefilled else []
        mixed += bool(prefill) and a in decoding
        for seq, ev in engine.step(decoding, prefill):
            got[seq.id].append(ev.token_id)
    assert mixed >= 2
    assert got[a.id] == solo["a"] and got[b.id] == solo["b"] and got[c.id] == solo["c"]
    for s in (a, b, c):
        engine.release(s)
    assert engine.kv_blocks_used == 0


def test_prefix_cache_names_only_emitted_blocks(tiny_qwen3_dir, scripted):
    """A chat's next turn hits the blocks speculation filled, and gives the answer it gives cold."""
    ids = prompt(50, seed=6)
    cold = load(tiny_qwen3_dir)
    answer = [e.token_id for e in run(cold, ids, 60)[0]]
    warm = load(tiny_qwen3_dir, prefix_cache=True)
    got = run(warm, ids, 60, scripted(len(ids), answer, lambda o, i: i == o % 4))[0]
    assert [e.token_id for e in got] == answer
    turn2 = ids + answer + prompt(9, seed=7)
    assert [e.token_id for e in run(warm, turn2, 10)[0]] == [e.token_id for e in run(cold, turn2, 10)[0]]
    assert warm.prefix_cache_stats().hit_tokens == (len(ids) + len(answer)) // 32 * 32


def test_drafts_never_evict_cached_blocks(tiny_qwen3_dir, scripted):
    """With every block idle in the prefix cache or held, a draft stays inside the blocks the
    sequence has: the cache keeps what a plain run keeps."""
    cold = load(tiny_qwen3_dir, max_context=256, kv_cache_tokens=256)
    ids = prompt(60, seed=8)
    answer = [e.token_id for e in run(cold, ids, 80)[0]]

    def fill_and_run(spec):
        engine = load(tiny_qwen3_dir, max_context=256, kv_cache_tokens=256, prefix_cache=True)
        run(engine, prompt(150, seed=9), 40)         # leaves its blocks idle in the cache
        out = run(engine, ids, 80, spec)
        return out, engine.prefix_cache_stats().evictions

    (want, want_pool, _, _), want_evictions = fill_and_run(None)
    (got, got_pool, _, _), got_evictions = fill_and_run(scripted(len(ids), answer))
    assert [e.token_id for e in got] == [e.token_id for e in want] == answer
    assert got_evictions == want_evictions
    same_pool(got_pool, want_pool)


# ---- stops, limits and processors when several tokens land in one step ---------------------

def test_stop_conditions_are_exact_mid_draft(tiny_qwen3_dir, scripted):
    """max_tokens, a stop string, a stop token id and EOS that fall inside an accepted draft end
    the answer where a plain run ends it, with the same text and finish reason."""
    engine = load(tiny_qwen3_dir)
    ids = prompt(25, seed=10)
    free = run(engine, ids, 40)[0]
    answer = [e.token_id for e in free]
    text = "".join(e.text for e in free)
    cases = [dict(n=23), dict(n=40, stop_token_ids=[answer[17]]), dict(n=40, stop=[text[len(text) // 2:][:3]]),
             dict(n=40, min_tokens=9, stop_token_ids=[answer[5], answer[14]])]
    reasons = []
    for case in cases:
        n = case.pop("n")
        want = run(engine, ids, n, **case)[0]
        got = run(engine, ids, n, scripted(len(ids), answer), **case)[0]
        assert [event_view(e) for e in got] == [event_view(e) for e in want], case
        reasons.append(want[-1].finish_reason)
    assert reasons[:3] == ["length", "stop", "stop"]


def test_eos_inside_a_draft_stops_the_answer(tiny_qwen3_dir, scripted):
    engine = load(tiny_qwen3_dir)
    ids = prompt(25, seed=11)
    answer = [e.token_id for e in run(engine, ids, 30)[0]]
    eos = answer[12]
    saved, engine.tokenizer.eos_token_ids = engine.tokenizer.eos_token_ids, {eos}
    try:
        p = dict(max_tokens=30, temperature=0.0)
        want = list(engine.generate(ids, **p))
        got = list(engine.generate(ids, speculative=scripted(len(ids), answer), **p))
    finally:
        engine.tokenizer.eos_token_ids = saved
    assert [event_view(e) for e in got] == [event_view(e) for e in want]
    assert got[-1].finish_reason == "stop" and len(got) == answer.index(eos) + 1


def test_penalties_and_bias_see_every_accepted_token(tiny_qwen3_dir, scripted):
    """Repetition, presence and frequency penalties and logit_bias change with each token: greedy
    output is still the plain one, with prompt lookup and with drafts that are mostly right."""
    engine = load(tiny_qwen3_dir)
    ids = prompt(12, seed=12) * 4
    params = dict(max_tokens=60, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                  presence_penalty=0.4, frequency_penalty=0.3, logit_bias={ids[3]: 3.0, ids[5]: -2.0})
    want = engine.generate(ids, stream=False, **params)
    lookup = list(engine.generate(ids, speculative={"num_tokens": 4, "ngram_min": 1, "adaptive": False},
                                  **params))
    assert [e.token_id for e in lookup] == want["token_ids"]
    assert lookup[-1].draft_tokens > 10
    plan = scripted(len(ids), want["token_ids"], lambda o, i: i == o % 6)
    mostly_right = list(engine.generate(ids, speculative=plan, **params))
    assert [e.token_id for e in mostly_right] == want["token_ids"]
    assert mostly_right[-1].accepted_draft_tokens > 25


class CycleGrammar:
    """A stand-in for a grammar matcher (a hard processor with state): after token t, only the
    next of `cycle` after t is allowed; a matcher that saw a rejected draft token would go wrong."""

    def __init__(self, cycle):
        self.cycle = cycle

    def constraint(self, tokenizer, thought):
        return _CycleMatcher(self.cycle)


class _CycleMatcher:
    hard = True

    def __init__(self, cycle):
        self.cycle, self.state, self.seen = cycle, 0, []

    def apply(self, x):
        keep = self.cycle[self.state % len(self.cycle)]
        allowed = np.full(x.shape, -np.inf, np.float32)
        allowed[keep] = x[keep]
        x[:] = allowed

    def accept(self, token):
        self.seen.append(token)
        self.state += 1 + (token == self.cycle[0])


def test_a_stateful_hard_processor_advances_token_by_token(tiny_qwen3_dir, scripted):
    engine = load(tiny_qwen3_dir)
    ids = prompt(20, seed=13)
    grammar = CycleGrammar([11, 12, 13, 14, 15])
    want = engine.generate(ids, stream=False, max_tokens=30, temperature=0.0, ignore_eos=True, grammar=grammar)
    # drafts right half the time: the matcher must only ever see emitted tokens
    got = list(engine.generate(ids, max_tokens=30, temperature=0.0, ignore_eos=True, grammar=grammar,
                               speculative=scripted(len(ids), want["token_ids"], lambda o, i: (o + i) % 2 == 1)))
    assert [e.token_id for e in got] == want["token_ids"]


def test_seeded_sampling_gives_the_same_tokens_with_speculation(tiny_qwen3_dir):
    """The verifier draws the random numbers the plain sampler draws: same seed, same answer."""
    engine = load(tiny_qwen3_dir)
    ids = prompt(10, seed=14) * 3
    for seed in range(4):
        p = dict(max_tokens=40, temperature=0.8, top_k=20, top_p=0.95, seed=seed, ignore_eos=True, logprobs=1)
        want = list(engine.generate(ids, **p))
        got = list(engine.generate(ids, speculative={"num_tokens": 3, "ngram_min": 1, "adaptive": False}, **p))
        assert [event_view(e) for e in got] == [event_view(e) for e in want]


def test_free_writing_backs_off(tiny_qwen3_dir, monkeypatch):
    """A random model's answer rarely copies: where a row costs 0.15 of a token (a board's
    decode), the adaptive policy soon stops drafting."""
    engine = load(tiny_qwen3_dir)
    monkeypatch.setattr(engine.step_costs, "row_share", lambda batch: 0.15)
    ids = prompt(200, seed=15)
    events = list(engine.generate(ids, max_tokens=150, temperature=1.0, seed=3, ignore_eos=True,
                                  speculative={"num_tokens": 4, "ngram_min": 1}))
    last = events[-1]
    assert last.accepted_draft_tokens < 0.3 * max(1, last.draft_tokens)
    assert last.draft_tokens < 0.5 * len(events)


def test_speculation_stats_reach_the_listeners(tiny_qwen3_dir, scripted):
    from appliance.engine.stats import DecodeStats
    engine = load(tiny_qwen3_dir)
    ids = prompt(20, seed=16)
    answer = [e.token_id for e in run(engine, ids, 20)[0]]
    seen = []
    engine.add_stats_listener(seen.append)
    run(engine, ids, 20, scripted(len(ids), answer, lambda o, i: i == 2))
    spec = [s for s in seen if isinstance(s, SpeculativeStats)]
    decode = [s for s in seen if isinstance(s, DecodeStats)]
    assert spec[0].drafted == [1, 1, 1, 1] and spec[0].accepted == [1, 1, 0, 0]
    assert sum(s.draft_tokens for s in spec) == seq_drafted(spec) and len(spec) >= 5
    assert sum(sum(s.tokens) if s.tokens else s.batch for s in decode) == 19   # each decoded token once


def seq_drafted(stats) -> int:
    return sum(sum(s.drafted) for s in stats)


def test_a_json_schema_grammar_with_speculation(tiny_qwen3_dir):
    """llguidance's matcher consumes each emitted token once, drafted or not: the same JSON, greedy
    and seeded at temperature 1."""
    from appliance.engine import grammar
    engine = load(tiny_qwen3_dir)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "tags": {"type": "array", "items": {"enum": ["quick", "brown", "fox"]}, "maxItems": 6}}}
    g = grammar.json_schema(schema, engine.tokenizer)
    ids = engine.tokenizer.encode('{"name": "fox", "tags": ["quick", "brown", "quick", "brown"]} '
                                  '{"name": "dog", "tags": ["quick", "brown", "quick"')
    for temperature, seed in ((0.0, None), (1.0, 5)):
        p = dict(max_tokens=60, temperature=temperature, seed=seed, grammar=g)
        want = engine.generate(ids, stream=False, **p)
        got = list(engine.generate(ids, speculative={"num_tokens": 4, "ngram_min": 1, "adaptive": False}, **p))
        assert [e.token_id for e in got] == want["token_ids"]
        assert got[-1].accepted_draft_tokens > 10


def test_moe_family(tmp_path_factory, scripted):
    """Verification rows go through a sparse MoE layer's expert routing as decode rows do."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models_moe import build_qwen3_moe
    model_dir = build_qwen3_moe(tmp_path_factory.mktemp("moe_spec"))
    engine = load(model_dir, weights="q8")
    ids = prompt(30, seed=17)
    want, want_pool, _, _ = run(engine, ids, 40)
    answer = [e.token_id for e in want]
    got, got_pool, _, _ = run(engine, ids, 40, scripted(len(ids), answer, lambda o, i: i == o % 5))
    assert [e.token_id for e in got] == answer
    same_pool(got_pool, want_pool)
