"""`appliance eval`: retrieval (needle) and perplexity, exact vs block-sparse attention.

    appliance eval needle --context 512,1024,2048,4096 --sparse-k 1,2,4,8,16,32 [--json]
    appliance eval ppl --file TEXT --sparse-k 4,32 [--json]

Needle: facts ("The password for the north gate is falcon.") are planted at several
depths of filler text, the question goes through the model's chat template (a raw
completion prompt makes even exact attention refuse, docs/engine.md), and a greedy reply
counts when the first code word it names is the planted one. The filler is the Python reference
manual text that ships with every Python (pydoc_data.topics); scripts/train_demo_model.py
holds those topics out of the demo model's training, so the haystack is unseen text.

Perplexity: a prefix is prefilled, then every later token is scored by a teacher-forced
decode step (Engine.score), because decode steps are where sparse attention differs.
"""
from __future__ import annotations

import json
import math
import random
import re

from appliance.cli.args import ENGINE_KEYS, add_engine_arguments, engine_settings, int_list, positive_int

# ---- the task, shared with scripts/train_demo_model.py -----------------------------------
PLACES = ["north", "south", "east", "west", "red", "blue", "green", "silver", "golden", "old",
          "new", "upper", "lower", "inner", "outer", "hidden", "small", "main", "back", "front"]
THINGS = ["gate", "vault", "tower", "bridge", "garden", "library", "station", "harbor", "cellar",
          "workshop", "archive", "tunnel", "kitchen", "office", "garage", "locker", "cabin",
          "laboratory", "market", "museum"]
ATTRIBUTES = ["password", "code word", "call sign", "secret word", "passphrase", "watchword",
              "key word", "signal", "nickname", "token"]
# Values are code words, not numbers: a reply copies a planted word, which a small model learns
# with one induction step (find "<thing> is" in the haystack, copy what follows). A number is a
# string of digits, and a digit alone does not say where to continue copying from, so the 4M
# demo model never learned to copy numbers out of filler (scripts/train_demo_model.py).
# None of these words is a place, a thing or an attribute word, and they are rare in the filler.
VALUES = ["falcon", "otter", "walnut", "copper", "maple", "cobalt", "lemon", "tiger", "cedar", "orchid",
          "panda", "raven", "amber", "basil", "coral", "ember", "fern", "ginger", "hazel", "jade",
          "koala", "lotus", "mango", "nutmeg", "olive", "pepper", "quartz", "saffron", "tulip", "violet",
          "willow", "zebra", "badger", "camel", "dolphin", "eagle", "ferret", "gecko", "heron", "jaguar",
          "kiwi", "lynx", "moose", "parrot", "quail", "robin", "salmon", "toucan", "walrus", "apricot",
          "banana", "cherry", "grape", "melon", "peach", "plum", "onyx", "opal", "ruby", "pearl",
          "topaz", "granite", "marble", "thistle", "bamboo", "cactus", "daisy", "poppy", "clover",
          "acorn", "pebble", "comet", "meteor", "nebula", "glacier", "canyon", "meadow", "lagoon",
          "volcano", "tundra", "prairie", "beacon", "anchor", "compass", "lantern", "saddle",
          "trumpet", "violin", "banjo", "harp", "kettle", "teapot", "pumpkin", "turnip", "radish",
          "carrot", "noodle", "muffin", "waffle", "pretzel"]
DEPTHS = (0.1, 0.5, 0.9)
# Questions are asked with thinking off: a thinking model's thought would spend the few tokens a
# reply gets (templates without a thinking switch ignore the keyword).
TEMPLATE_KWARGS = {"enable_thinking": False}
N_HELD_OUT_TOPICS = 20       # first topics in sorted order: ~54K characters of filler


def make_facts(rng: random.Random, n: int) -> list[dict]:
    """n facts about distinct things (so "<thing> is" names one fact), each with its own value word."""
    if n > min(len(THINGS), len(VALUES)):
        raise ValueError(f"at most {min(len(THINGS), len(VALUES))} facts per haystack, not {n}")
    things, values = rng.sample(THINGS, n), rng.sample(VALUES, n)
    facts = []
    for thing, value in zip(things, values):
        attr, place = rng.choice(ATTRIBUTES), rng.choice(PLACES)
        # The reply restates the fact: the value then follows the same words as in the haystack,
        # which a small model learns to copy far sooner than a bare value (induction heads).
        sentence = f"The {attr} for the {place} {thing} is {value}."
        facts.append({"fact": sentence, "question": f"What is the {attr} for the {place} {thing}?",
                      "reply": sentence, "answer": value})
    return facts


def plant(filler: str, facts: list[dict], depths) -> str:
    """Insert each fact at a line or sentence boundary near its depth (a fraction of the filler)."""
    cuts = []
    for d in depths:
        pos = int(d * len(filler))
        ends = [filler.find(sep, pos) for sep in ("\n", ". ")]
        ends = [e + 1 for e in ends if e >= 0]
        cuts.append(min(ends) if ends else len(filler))
    out, last = [], 0
    for cut, fact in sorted(zip(cuts, facts), key=lambda cf: cf[0]):
        out += [filler[last:cut], " " + fact["fact"] + " "]
        last = cut
    out.append(filler[last:])
    return "".join(out)


def needle_messages(haystack: str, question: str) -> list[dict]:
    return [{"role": "user", "content": haystack.rstrip() + "\n\n" + question}]


def held_out_topics() -> list[str]:
    from pydoc_data.topics import topics
    return sorted(topics)[:N_HELD_OUT_TOPICS]


def filler_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in held_out_topics())


REPLY_SLACK = 4          # tokens a reply may take past the expected one
RETOKENIZE_MARGIN = 8


def needle_cases(tokenizer, context: int, trials: int, seed: int = 0) -> list[dict]:
    """Prompts that fit, with their replies, in `context` tokens: per trial one haystack with a fact at every depth,
    asked about each fact in turn (the others are distractors).

    tokenizer: anything with encode, decode and apply_chat_template (appliance's Tokenizer).
    Returns [{"ids", "answer", "depth", "trial"}].
    """
    filler = tokenizer.encode(filler_text())
    cases = []
    for trial in range(trials):
        rng = random.Random(f"{seed}-{context}-{trial}")
        facts = make_facts(rng, len(DEPTHS))
        # Tokens of everything but the filler (template, facts, the longest question), the longest
        # reply, and a margin for the filler re-tokenizing differently once facts sit inside it: a
        # case's prompt and reply fit in `context` tokens, a model's whole trained context.
        reply_room = max(len(tokenizer.encode(f["reply"])) + REPLY_SLACK for f in facts)
        overhead = max(len(tokenizer.encode(tokenizer.apply_chat_template(
            needle_messages(plant("", facts, DEPTHS), f["question"]), **TEMPLATE_KWARGS))) for f in facts)
        overhead += reply_room + RETOKENIZE_MARGIN
        n = max(0, context - overhead)
        start = rng.randrange(len(filler))
        window = (filler[start:] + filler * (1 + n // len(filler)))[:n]
        haystack = plant(tokenizer.decode(window), facts, DEPTHS)
        for depth, f in zip(DEPTHS, facts):
            ids = tokenizer.encode(tokenizer.apply_chat_template(needle_messages(haystack, f["question"]),
                                                                 **TEMPLATE_KWARGS))
            cases.append({"ids": ids, "answer": f["answer"], "depth": depth, "trial": trial,
                          "max_tokens": len(tokenizer.encode(f["reply"])) + REPLY_SLACK})
    return cases


_VALUE_SET = frozenset(VALUES)


def is_recalled(text: str, answer: str) -> bool:
    """The first value word in the reply is the planted one (a reply naming no value, or
    another fact's value first, is a miss)."""
    first = next((w for w in re.findall(r"[a-z]+", text.lower()) if w in _VALUE_SET), None)
    return first == answer


# ---- engines ---------------------------------------------------------------------------------
def _engines(args, max_context: int):
    """(label, k, engine) for exact attention, then one block-sparse engine per k, loaded lazily."""
    from appliance.engine import Engine
    s = _settings(args)

    def load(k):
        sparse = None if k is None else {"k": k, "block": s.sparse_block, "probe": s.sparse_probe,
                                         "probe_mode": s.sparse_probe_mode}
        return Engine.load(s.model, weights=s.weights, kv=s.kv, threads=s.threads,
                           max_context=s.max_context or max_context, sparse=sparse, progress=False)

    for k in [None] + _ks(args, s):
        yield ("exact" if k is None else "sparse"), k, load(k)


def _settings(args):
    """The engine flags but --sparse-k, which is a list here."""
    return engine_settings(args, [k for k in ENGINE_KEYS if k != "sparse_k"])


def _ks(args, s) -> list[int]:
    if args.sparse_k:
        return args.sparse_k
    return [s.sparse_k] if s.sparse_attn else []


def _sparse_facts(args) -> dict:
    s = _settings(args)
    return {"block": s.sparse_block, "probe": s.sparse_probe, "probe_mode": s.sparse_probe_mode}


# ---- needle ----------------------------------------------------------------------------------
def run_needle(args) -> dict:
    rows = []
    for attention, k, engine in _engines(args, max(args.context)):
        for context in args.context:
            cases = needle_cases(engine.tokenizer, context, args.trials, args.seed)
            hits = {d: [] for d in DEPTHS}
            for case in cases:
                out = engine.generate(case["ids"], stream=False, temperature=0.0,
                                      max_tokens=case["max_tokens"])
                hits[case["depth"]].append(is_recalled(out["text"], case["answer"]))
            flat = [h for v in hits.values() for h in v]
            rows.append({"attention": attention, "k": k, "context": context,
                         "prompt_tokens": round(sum(len(c["ids"]) for c in cases) / len(cases)),
                         "recall": sum(flat) / len(flat),
                         "by_depth": {str(d): sum(v) / len(v) for d, v in hits.items()}})
    return {"task": "needle", "model": str(args.model or "demo_model"), "trials": args.trials,
            "depths": list(DEPTHS), **_sparse_facts(args), "rows": rows}


def format_needle(result: dict) -> str:
    n = result["trials"] * len(result["depths"])
    depths = ", ".join(f"{d:.0%}" for d in result["depths"])
    cols = _columns(result["rows"])
    lines = [f"needle recall: {n} questions per context ({result['trials']} haystacks x facts at {depths})",
             "context  " + "  ".join(f"{c:>6}" for c in cols)]
    for context in dict.fromkeys(r["context"] for r in result["rows"]):
        cells = {_label(r): r["recall"] for r in result["rows"] if r["context"] == context}
        lines.append(f"{context:>7}  " + "  ".join(f"{cells[c]:>6.2f}" for c in cols))
    return "\n".join(lines)


# ---- perplexity ------------------------------------------------------------------------------
def run_ppl(args) -> dict:
    from pathlib import Path
    text = Path(args.file).read_text(encoding="utf-8", errors="replace")
    rows, windows = [], None
    for attention, k, engine in _engines(args, args.context + 1):
        if windows is None:
            windows = _windows(engine.tokenizer.encode(text), args.context, args.windows)
            if not windows:
                raise ValueError(f"{args.file}: fewer than {args.prefix + 1} tokens, nothing to score")
        logprobs = [lp for w in windows for lp in engine.score(w, min(args.prefix, len(w) - 1))]
        nll = -sum(logprobs) / len(logprobs)
        rows.append({"attention": attention, "k": k, "tokens": len(logprobs), "nll": nll, "ppl": math.exp(nll)})
    return {"task": "ppl", "model": str(args.model or "demo_model"), "file": str(args.file),
            "windows": len(windows), "context": args.context, "prefix": args.prefix,
            **_sparse_facts(args), "rows": rows}


def _windows(ids: list[int], context: int, limit: int) -> list[list[int]]:
    """Up to `limit` consecutive windows of `context` tokens (a shorter text: one window of all of it)."""
    wins = [ids[s:s + context] for s in range(0, max(1, len(ids) - context + 1), context)][:limit]
    return [w for w in wins if len(w) > 1]


def format_ppl(result: dict) -> str:
    lines = [f"perplexity of {result['file']}: {result['rows'][0]['tokens']} tokens scored by decode steps "
             f"after a {result['prefix']}-token prefix, in {result['windows']} window(s) of {result['context']}",
             "attention     k      ppl"]
    for r in result["rows"]:
        lines.append(f"{r['attention']:<9}  {r['k'] if r['k'] else '-':>4}  {r['ppl']:>7.3f}")
    return "\n".join(lines)


def _label(row) -> str:
    return "exact" if row["k"] is None else f"k={row['k']}"


def _columns(rows) -> list[str]:
    return list(dict.fromkeys(_label(r) for r in rows))


# ---- command line ----------------------------------------------------------------------------
def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="needle retrieval and perplexity, exact vs sparse attention")
    kinds = e.add_subparsers(dest="eval_kind", metavar="KIND")
    kinds.required = True
    # conflict_handler="resolve": the engine flags' single --sparse-k becomes a list here.
    needle = kinds.add_parser("needle", help="recall of planted facts per context and sparse k",
                              conflict_handler="resolve")
    ppl = kinds.add_parser("ppl", help="perplexity of a text file, scored by decode steps",
                           conflict_handler="resolve")
    for p in (needle, ppl):
        add_engine_arguments(p)
        p.add_argument("--sparse-k", type=int_list, default=None,
                       help="block-sparse runs to compare with exact attention, e.g. 1,2,4,8,16,32 "
                            "(default: none; --sparse-attn alone runs 32)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
    needle.add_argument("--context", type=int_list, default=[512, 1024, 2048, 4096],
                        help="prompt lengths in tokens (default 512,1024,2048,4096)")
    needle.add_argument("--trials", type=positive_int, default=2,
                        help="haystacks per context, each asked about a fact at every depth (default 2)")
    needle.add_argument("--seed", type=int, default=0)
    needle.set_defaults(func=_cmd_needle)
    ppl.add_argument("--file", required=True, help="UTF-8 text to score")
    ppl.add_argument("--context", type=positive_int, default=1024, help="window length in tokens (default 1024)")
    ppl.add_argument("--prefix", type=positive_int, default=512,
                     help="tokens prefilled before scoring starts in each window (default 512)")
    ppl.add_argument("--windows", type=positive_int, default=4, help="windows scored at most (default 4)")
    ppl.set_defaults(func=_cmd_ppl)


def _cmd_needle(args) -> int:
    result = run_needle(args)
    print(json.dumps(result) if args.json else format_needle(result))
    return 0


def _cmd_ppl(args) -> int:
    if args.prefix >= args.context:
        raise ValueError(f"--prefix ({args.prefix}) must be shorter than --context ({args.context})")
    result = run_ppl(args)
    print(json.dumps(result) if args.json else format_ppl(result))
    return 0
