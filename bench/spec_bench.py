"""Speculative decoding by prompt lookup: decode tokens/s with and without, per task and model.

Tasks (chat prompts): copying their context, quoting a passage, editing a function, extracting
fields to JSON and restating planted facts (all four trained into the demo model, which answers
them right), and one of free writing.
Models:
  * the demo model (appliance/demo_model), whose answers really copy: prompt lookup as served
    (adaptive drafting, `--num-tokens` K), its greedy output checked identical with and without;
  * the Qwen3-0.6B-shaped random checkpoint (bench/checkpoint.py), whose random answers copy
    nothing: the demo model's acceptance pattern is replayed on it. For each step of the demo
    model's run the number of drafted and accepted tokens is recorded; on the 0.6B checkpoint a
    drafter proposes, at the same output positions, that many tokens of its own plain greedy
    answer, wrong at the recorded first rejection. Steps carry the same rows and land the same
    tokens as on the demo model, at the 0.6B checkpoint's cost per row. `--save-patterns FILE`
    keeps the patterns; `--patterns FILE` replays patterns recorded elsewhere (a real checkpoint
    on a board, by this script's --save-patterns) instead of the demo model's.
Each configuration runs `--repeats` times, with and without speculation alternating; the table
gives medians of decode tokens/s (first token to last, prefill excluded), their ratio,
drafted / accepted tokens and tokens per step. Targets (the issue): >= 1.6x on the copy-heavy
tasks, >= 0.97x on free writing.

    python bench/spec_bench.py                               # both models, 128 tokens, 3 repeats
    python bench/spec_bench.py --num-tokens 6 --max-tokens 256 --threads 4
    python bench/spec_bench.py --models demo,replay --max-tokens 24 --repeats 1 --replay-shape tiny   # a check
    python bench/spec_bench.py --model ~/models/Qwen3-0.6B --models demo --save-patterns qwen3.json  # real weights

Not a test: it takes minutes and its numbers depend on the machine (quote the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.engine import speculative  # noqa: E402
from appliance.engine.speculative import SpeculativeStats  # noqa: E402
from appliance.engine.stats import DecodeStats  # noqa: E402

PASSAGE = ("Serialize obj to a JSON formatted str.\n\nIf skipkeys is true then dict keys that are not basic "
           "types (str, int, float, bool, None) will be skipped instead of raising a TypeError.\n\nIf "
           "ensure_ascii is false, then the return value can contain non-ASCII characters if they appear "
           "in strings contained in obj. Otherwise, all such characters are escaped in JSON strings.")
FUNCTION = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
            "    return total / len(values)\n")
RECORD = ("Ada Lovelace was born in London in 1815. She worked with Charles Babbage on the Analytical "
          "Engine and wrote the first published algorithm meant for a machine.")
TASKS = {
    "quote": ("copy", f"Here is a passage from the Python documentation:\n\n{PASSAGE}\n\nQuote the passage "
                      "exactly, word for word."),
    "edit": ("copy", f"Rename the variable total to acc in this function and show the whole function:\n\n"
                     f"{FUNCTION}"),
    "json": ("copy", f"Extract the name, city and year of birth from this text as a JSON object with the keys "
                     f"\"name\", \"city\" and \"year\":\n\n{RECORD}"),
    # what the demo model was trained to copy: planted facts restated (scripts/train_demo_model.py)
    "recall": ("copy", "The password for the north gate is falcon. The code word for the blue vault is maple. "
                       "The call sign for the old harbor is cedar. What is the code word for the blue vault?"),
    "free": ("free", "Write a short story about a little board that computed attention quickly."),
}
TARGETS = {"copy": 1.6, "free": 0.97}
TINY_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu",
                  attention_bias=False, bos_token_id=151643, eos_token_id=151645, initializer_range=0.02)


class Replay:
    """Drafts `truth` (the model's own plain answer) with the recorded pattern: at output length o,
    pattern[o] = (drafted, accepted): `accepted` right tokens, then a wrong one, `drafted` in all."""

    pattern: dict[int, tuple[int, int]] = {}
    truth: list[int] = []
    n_prompt = 0

    def propose(self, tokens, k):
        o = len(tokens) - self.n_prompt
        drafted, accepted = self.pattern.get(o, (0, 0))
        drafted = min(drafted, k)
        draft = [self.truth[o + i] if o + i < len(self.truth) else 0 for i in range(drafted)]
        if accepted < drafted:
            draft[accepted] = (draft[accepted] + 1) % 1000        # the recorded miss
        return draft, 0


speculative.register_drafter("replay", lambda config: Replay())


def timed_run(engine, prompt, max_tokens, spec, record=None) -> dict:
    """One greedy answer; decode tokens/s from its first token to its last."""
    steps: list[list[int]] = []           # per step: [output length at its start, drafted, accepted]
    produced = [1]

    def listen(stats):
        if isinstance(stats, DecodeStats):
            got = stats.tokens[0] if stats.tokens else 1
            steps.append([produced[0], 0, 0])
            produced[0] += got
        elif isinstance(stats, SpeculativeStats) and steps:
            steps[-1][1:] = [stats.draft_tokens, stats.accepted_tokens]

    engine.add_stats_listener(listen)
    try:
        times, ids = [], []
        t0 = time.perf_counter()
        for event in engine.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                     speculative=spec, logit_bias=served_bias(engine)):
            times.append(time.perf_counter())
            ids.append(event.token_id)
    finally:
        engine.remove_stats_listener(listen)
    last = event
    decode_s = times[-1] - times[0]
    return {"ids": ids, "tps": (len(ids) - 1) / decode_s if decode_s > 0 else float("nan"),
            "ttft": times[0] - t0, "steps": len(steps), "drafted": last.draft_tokens or 0,
            "accepted": last.accepted_draft_tokens or 0,
            "pattern": {o: (d, a) for o, d, a in steps if d}}


def served_bias(engine):
    """What the server adds to a chat request that offers no tools (the tag opening a tool call
    banned), so that the answers timed here are the ones a client gets."""
    from appliance.server.chat import without_calls
    return without_calls(engine.tokenizer, None, None)


def compare(engine, prompt, args, spec) -> dict:
    """Alternating plain and speculative runs; medians and what the speculative runs did."""
    plain, fast = [], []
    for _ in range(args.repeats):
        plain.append(timed_run(engine, prompt, args.max_tokens, None))
        fast.append(timed_run(engine, prompt, args.max_tokens, spec))
    identical = all(r["ids"] == plain[0]["ids"] for r in plain + fast)
    off, on = statistics.median(r["tps"] for r in plain), statistics.median(r["tps"] for r in fast)
    return {"off": off, "on": on, "ratio": on / off, "identical": identical, "drafted": fast[0]["drafted"],
            "accepted": fast[0]["accepted"], "tokens_per_step": (len(fast[0]["ids"]) - 1) / max(1, fast[0]["steps"]),
            "pattern": fast[0]["pattern"], "ids": plain[0]["ids"]}


def chat_ids(engine, text: str) -> list[int]:
    """The task as one user turn, thinking off: a thought is free writing (the free task measures
    that), and the copy-heavy tasks are about the answer that follows it."""
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], enable_thinking=False))


def replay_checkpoint(args) -> Path:
    from bench.checkpoint import QWEN3_0_6B, build_checkpoint
    shape = QWEN3_0_6B if args.replay_shape == "qwen3-0.6b" else TINY_SHAPE
    return build_checkpoint(Path(args.workdir) / f"{args.replay_shape}-random", shape=shape)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo,replay", help="demo, replay (the random checkpoint), or both")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"of {', '.join(TASKS)}")
    p.add_argument("--num-tokens", type=int, default=4, help="drafted tokens per step at most (K)")
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--replay-shape", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b",
                   help="the random checkpoint the pattern is replayed on (tiny: a quick check of the script)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "appliance-bench"))
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--model", help="the model whose answers are measured and whose pattern is recorded "
                                   "(default: the demo model)")
    p.add_argument("--save-patterns", help="write each task's acceptance pattern here (JSON)")
    p.add_argument("--patterns", help="replay the patterns of this file (from --save-patterns)")
    args = p.parse_args()
    from appliance import Engine

    models = args.models.split(",")
    tasks = [t for t in args.tasks.split(",") if t]
    spec = {"method": "prompt_lookup", "num_tokens": args.num_tokens, "ngram_min": args.ngram_min,
            "ngram_max": args.ngram_max}
    print(f"speculative decoding benchmark: K={args.num_tokens}, n-grams {args.ngram_min}..{args.ngram_max}, "
          f"{args.max_tokens} tokens, {args.repeats} repeats, {args.threads} threads; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    rows = []
    patterns = {}
    if args.patterns:
        patterns = {task: {int(o): tuple(v) for o, v in steps.items()}
                    for task, steps in json.loads(Path(args.patterns).read_text()).items()}
    if "demo" in models or not args.patterns:
        demo = Engine.load(args.model, threads=args.threads, max_context=4096, progress=False)
        for task in tasks:
            kind, text = TASKS[task]
            result = compare(demo, chat_ids(demo, text), args, spec)
            patterns.setdefault(task, result["pattern"])
            if "demo" in models:
                rows.append({"model": demo.model_name, "task": task, "kind": kind, **result})
                print_row(rows[-1])
        del demo
    if args.save_patterns:
        Path(args.save_patterns).write_text(json.dumps(patterns, indent=1))
    if "replay" in models:
        engine = Engine.load(replay_checkpoint(args), threads=args.threads, max_context=4096, progress=False)
        for task in tasks:
            kind, text = TASKS[task]
            ids = chat_ids(engine, text)
            Replay.truth = timed_run(engine, ids, args.max_tokens, None)["ids"]
            Replay.pattern, Replay.n_prompt = patterns[task], len(ids)
            result = compare(engine, ids, args, {"method": "replay", "num_tokens": args.num_tokens,
                                                 "adaptive": False})
            rows.append({"model": f"{args.replay_shape} (replay)", "task": task, "kind": kind, **result})
            print_row(rows[-1])
    print_table(rows)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k not in ("pattern", "ids")}
                                               for r in rows], indent=2))


def print_row(r: dict) -> None:
    print(f"  {r['model']:<22} {r['task']:<6} off {r['off']:8.1f} tok/s  on {r['on']:8.1f} tok/s  "
          f"x{r['ratio']:.2f}  accepted {r['accepted']}/{r['drafted']}", flush=True)


def print_table(rows: list[dict]) -> None:
    print()
    print("| model | task | tok/s off | tok/s on | ratio | target | drafted | accepted | tokens/step | same output |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        target = TARGETS[r["kind"]]
        verdict = "MET" if r["ratio"] >= target else "MISSED"
        print(f"| {r['model']} | {r['task']} | {r['off']:.1f} | {r['on']:.1f} | {r['ratio']:.2f} | "
              f">= {target} {verdict} | {r['drafted']} | {r['accepted']} | {r['tokens_per_step']:.2f} | "
              f"{'yes' if r['identical'] else 'NO'} |")


if __name__ == "__main__":
    main()
