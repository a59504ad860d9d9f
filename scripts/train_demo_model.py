"""Train the embedded demo model (appliance/demo_model/) on CPU, from text every Python has.

A ~4M-parameter Qwen3 (hidden 256, 4 layers, 4 q / 2 kv heads, head_dim 64, tied
embeddings) with its own byte-level BPE (3072 tokens, digits one per token as Qwen's).
The training mix:
  * language: docstrings of standard-library modules and the Python reference manual
    (pydoc_data.topics, minus the topics `appliance eval` uses as held-out filler);
  * doc chat: "What does json.dumps do?" answered with its docstring, so `make run`
    talks in recognizable text;
  * retrieval: facts planted in filler ("The password for the north gate is falcon."), then
    questions through the ChatML template, answered by restating the fact with its value
    word (appliance.evaluate defines the task, so training and `appliance eval needle` ask the
    same way). The first run planted numbers: after 30 minutes the value digits were right
    ~20% of the time and recall was 0, because after the first digit a digit alone does not say
    where to go on copying; a word value is one induction step;
  * copy drills: random tokens repeated (alone for the first 250 steps) and facts without
    filler, which grow the copy (induction) heads retrieval is built on.
Curriculum: short sequences first (128, 256), then 512, 1024 and some 2048, so that retrieval
is learned cheaply and then stretched. Retrieval loss is reply-only and averaged apart
from the language loss, so a few reply tokens are not drowned by a thousand filler ones.

The machine is shared: one torch thread, run under `nice -n 19`, a wall-clock budget
(the run stops and saves when it is spent) and a checkpoint every few minutes in --work
(a rerun resumes from it; --fresh starts over). Fixed seed.

    nohup nice -n 19 .venv/bin/python scripts/train_demo_model.py --budget-min 40 > /tmp/train.out 2>&1 &

This first stage (its log, all runs, opens appliance/demo_model/train_log.txt): 30 minutes on a
niced third of a core with number values; resumed with word values (--budget-min 95, one thread)
to minute 55; resumed again with the 55% mix below (--budget-min 100 --threads 2) to minute 100:
9208 steps. Torch greedy needle recall at the end: 0.70 / 0.83 / 0.80 / 0.63 at 256 / 512 / 1024
/ 2048 tokens (10 held-out haystacks x 3 facts each).

The shipped model is that one grown to 7 layers and trained further in Qwen3's chat format
(`--stage chat --layers 7`, scripts/demo_chat_stage.py, where its runs are written up):

    .venv/bin/python scripts/train_demo_model.py --stage chat --layers 7 --threads 2 --budget-min 258 \
        --run-min 258 --lr 5e-4 --work /tmp/chat --out appliance/demo_model --resume-from appliance/demo_model
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]
from appliance.cli import evaluate as task  # noqa: E402
from tiny_models import CHATML, SPECIAL  # noqa: E402

MODULES = ["json", "collections", "functools", "itertools", "pathlib", "argparse", "logging", "threading",
           "subprocess", "socket", "email", "http", "unittest", "textwrap", "string", "os", "re", "typing",
           "asyncio", "dataclasses", "datetime", "inspect", "random", "statistics", "decimal", "fractions",
           "shutil", "tarfile", "zipfile", "csv", "sqlite3", "xml", "urllib", "html", "difflib", "heapq",
           "bisect", "contextlib", "abc", "enum", "io", "pickle", "copy", "pprint", "calendar",
           "configparser", "hashlib", "base64", "struct", "codecs", "glob", "fnmatch", "tempfile", "queue",
           "sched", "selectors", "operator", "math", "builtins", "types", "weakref", "gzip", "array",
           "ipaddress", "uuid", "secrets", "time", "sys", "traceback", "warnings", "importlib", "ast",
           "tokenize", "dis", "doctest", "concurrent", "multiprocessing", "mailbox", "smtplib", "ftplib"]
QUESTIONS = ["What does {} do?", "Explain {}.", "Tell me about {}.", "What is {}?"]
VOCAB = 3072
ARCH = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
            rope_theta=1_000_000.0, eos_token_id=2, bos_token_id=None, pad_token_id=0)
# (time fraction it starts at, sequence length, batch): 2K tokens a step throughout (on a shared
# CPU, more updates beat bigger batches); short sequences pack more answers into a step, which
# is what gets retrieval started.
CURRICULUM = [(0.0, 128, 16), (0.25, 256, 8), (0.45, 512, 4), (0.65, 1024, 2), (0.9, 2048, 1)]
# Early on, drills (facts without filler) and repeats (a span, then the same span again) are
# most of the mix: they make copying from context the only way down, which grows the induction
# heads that retrieval needs in a few hundred steps rather than never (a first run with only
# filler-heavy retrieval and text stayed at chance on the values for 220 steps; random-token
# repeats alone grow copy heads in ~150 steps at lr 1e-3, and not at 3e-3).
# Mixed in at a third they still had not appeared after 500 steps, so the run opens with
# repeats alone, for a number of steps (not a share of the time: on a busy machine 3 minutes
# were only 85 steps, too few).
REPEAT_ONLY_STEPS = 250
# From 55% on, more drills: at 52 minutes the model copied *a* value word from the haystack
# (value tokens 89% right teacher-forced, most haystacks having one or two facts) but the same
# one for every question of a three-fact haystack (needle recall 17-33%); drills with 3-8 facts
# and no filler are where picking the fact by its key is the only way down.
MIXES = [(0.0, {"drill": 0.3, "repeat": 0.25, "retrieval": 0.2, "lm": 0.15, "doc_chat": 0.1}),
         (0.4, {"drill": 0.15, "repeat": 0.05, "retrieval": 0.5, "lm": 0.2, "doc_chat": 0.1}),
         (0.55, {"drill": 0.35, "repeat": 0.03, "retrieval": 0.45, "lm": 0.12, "doc_chat": 0.05})]
# The value's tokens count this much again on top of the reply loss: restating the question's
# words is easy, the value is what retrieval is about.
VALUE_WEIGHT = 2.0
GENERATION_CONFIG = {"eos_token_id": [2, 0], "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40}


# ---- text ------------------------------------------------------------------------------------
# transformers' generic fast tokenizer: it reads tokenizer.json as it is. Named Qwen2Tokenizer,
# transformers 5 rebuilds the pre-tokenizer with Qwen2's own split pattern, so transformers
# users got other tokens (".\n\n" as ". ĊĊ", not ". Ċ Ċ") than the engine and training use.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

def stdlib_docs() -> list[tuple[str, str]]:
    """(qualified name, docstring) of modules, classes, functions and methods, deduplicated."""
    seen, out = set(), []

    def add(name, obj):
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and len(doc.strip()) > 40 and doc not in seen:
            seen.add(doc)
            out.append((name, doc.strip()))

    mods = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        mods.append((name, mod))
        for _, sub, _ in pkgutil.walk_packages(getattr(mod, "__path__", []), name + ".", onerror=lambda n: None):
            if sub.endswith("__main__") or ".test" in sub or "idle" in sub:
                continue  # importing these runs programs
            try:
                mods.append((sub, importlib.import_module(sub)))
            except Exception:
                pass
    for name, mod in mods:
        add(name, mod)
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", name) != name:
                continue  # re-exports are documented where they live
            add(f"{name}.{attr}", obj)
            if isinstance(obj, type):
                for meth, fn in sorted(vars(obj).items()):
                    if not meth.startswith("_"):
                        add(f"{name}.{attr}.{meth}", fn)
    return out


def manual_text() -> list[str]:
    from pydoc_data.topics import topics
    held_out = set(task.held_out_topics())
    return [topics[k] for k in sorted(topics) if k not in held_out]


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    # Digits one per token (as Qwen does): a copied number is a string of single-digit copies.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 8192, "tokenizer_class": TOKENIZER_CLASS}, indent=1))
    return tok


def split_encode(tok, text: str, cuts=()) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets of `text` tokenized piece by piece, cut at `cuts`. A served
    prompt is tokenized without its reply, so where the reply begins the prompt's last piece
    ends: "</think>\n\n" alone is `</think> ĊĊ`, followed by "The" it is `</think> Ċ Ċ The`.
    Training on the whole text taught the model `ĊĊ` only before `<tool_call>` (an added token,
    a cut of its own), and it opened every served reply with a call."""
    bounds = [0] + sorted(c for c in set(cuts) if 0 < c < len(text)) + [len(text)]
    ids, offsets = [], []
    for at, enc in zip(bounds, tok.encode_batch([text[a:b] for a, b in zip(bounds, bounds[1:])])):
        ids += enc.ids
        offsets += [(a + at, b + at) for a, b in enc.offsets]
    return ids, offsets


def render(messages: list[dict]) -> tuple[str, list[tuple[int, int, str]]]:
    """ChatML text (exactly CHATML's rendering) and char spans: user content 'lm', answers 'ans'."""
    text, spans = "", []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        kind = "ans" if m["role"] == "assistant" else "lm"
        spans.append((len(text), len(text) + len(m["content"]) + len("<|im_end|>"), kind))
        text += m["content"] + "<|im_end|>\n"
    return text, spans


# ---- samples: (ids, kinds) per token: 0 no loss, 1 language, 2 reply, 3 the value in a reply -------
class Data:
    def __init__(self, tok, docs, manual, rng: random.Random):
        self.tok, self.rng = tok, rng
        texts = manual + [d for _, d in docs]
        rng_local = random.Random(0)
        rng_local.shuffle(texts)
        eot = "<|endoftext|>"
        self.stream = [i for enc in tok.encode_batch([t + eot for t in texts]) for i in enc.ids]
        self.chat_docs = [(n, d) for n, d in docs if len(d) > 80]

    def split(self, text, cuts=()):
        return split_encode(self.tok, text, cuts)

    def encode(self, text, spans, length, cuts=()):
        ids, offsets = self.split(text, cuts)
        code = {"none": 0, "lm": 1, "ans": 2, "value": 3, "start": 4}
        kinds = [next((code[k] for s, e, k in spans if s <= a < e), 0) for a, _ in offsets]
        return ids[:length], kinds[:length]

    def lm(self, length):
        start = self.rng.randrange(len(self.stream) - length)
        return self.stream[start:start + length], [1] * length

    def doc_chat(self, length):
        text, spans = "", []
        while len(text) < length * 5:
            name, doc = self.rng.choice(self.chat_docs)
            t, s = render([{"role": "user", "content": self.rng.choice(QUESTIONS).format(name)},
                           {"role": "assistant", "content": doc[:1200]}])
            spans += [(a + len(text), b + len(text), "lm" if k == "ans" else "none") for a, b, k in s]
            text += t
        return self.encode(text, spans, length)

    def retrieval(self, length):
        rng = self.rng
        # About 16 tokens a fact and 45 a question with its reply; short sequences get fewer.
        n_facts = rng.randint(2, max(2, min(6, 2 + length // 256)))   # distractors always
        facts = task.make_facts(rng, n_facts)
        asked = rng.sample(facts, rng.randint(1, min(4, n_facts, 1 + length // 256)))
        n_filler = max(16, length - 18 * n_facts - 45 * len(asked) - 16)
        n_filler = rng.randint(n_filler // 2, n_filler) if rng.random() < 0.3 else n_filler
        start = rng.randrange(len(self.stream) - n_filler)
        filler = self.tok.decode(self.stream[start:start + n_filler]).replace("<|endoftext|>", "\n\n")
        haystack = task.plant(filler, facts, [rng.random() for _ in facts])
        return self.conversation(haystack, asked, length)

    def drill(self, length):
        """Facts with no filler, then questions: the most retrieval signal per token."""
        n_facts = self.rng.randint(3, max(3, min(8, 2 + length // 64)))
        facts = task.make_facts(self.rng, n_facts)
        asked = self.rng.sample(facts, max(1, min(n_facts, (length - 18 * n_facts) // 45)))
        return self.conversation(" ".join(f["fact"] for f in facts), asked, length)

    def repeat(self, length):
        """Random tokens, then the same tokens again: the copy is only predictable by looking back.
        (Repeats of text or of numbers did not do it: text is predictable without looking back,
        and digits are too few symbols for one token to say where to copy from.)"""
        n = length // 2
        span = [self.rng.randrange(len(SPECIAL), self.tok.get_vocab_size()) for _ in range(n)]
        return span + span, [0] * n + [1] * n

    def conversation(self, haystack, asked, length):
        messages = task.needle_messages(haystack, asked[0]["question"])
        messages.append({"role": "assistant", "content": asked[0]["reply"]})
        for f in asked[1:]:
            messages += [{"role": "user", "content": f["question"]},
                         {"role": "assistant", "content": f["reply"]}]
        text, spans = render(messages)
        # Facts and filler are the language part; only the replies are the retrieval part, and in
        # them the value word's tokens (kind 3) are what retrieval is about.
        for f in asked:
            at = text.rindex(f["reply"])
            at += f["reply"].rindex(f["answer"])
            spans.insert(0, (at, at + len(f["answer"]), "value"))
        return self.encode(text, spans, length)

    def batch(self, batch, length, mix):
        import torch
        x = torch.zeros(batch, length, dtype=torch.long)
        y = torch.zeros(batch, length, dtype=torch.long)
        kinds = torch.zeros(batch, length, dtype=torch.long)
        names, weights = list(mix), list(mix.values())
        for b in range(batch):
            ids, kind = getattr(self, self.rng.choices(names, weights)[0])(length + 1)
            n = len(ids) - 1
            x[b, :n] = torch.tensor(ids[:-1])
            y[b, :n] = torch.tensor(ids[1:])
            kinds[b, :n] = torch.tensor(kind[1:])
        return x, y, kinds


# ---- evaluation (greedy, the eval task's prompts on held-out filler) ---------------------------------
def needle_recall(model, tokenizer, context, trials):
    import torch
    hits = 0
    cases = task.needle_cases(tokenizer, context, trials, seed=1)
    for case in cases:
        ids = torch.tensor([case["ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=case["max_tokens"], do_sample=False,
                                 eos_token_id=2, pad_token_id=0)
        hits += task.is_recalled(tokenizer.decode(out[0, ids.shape[1]:].tolist()), case["answer"])
    return hits / len(cases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "appliance" / "demo_model")
    ap.add_argument("--work", type=Path, default=Path("/tmp/demo_model_train"))
    ap.add_argument("--budget-min", type=float, default=40.0, help="wall-clock training budget")
    ap.add_argument("--checkpoint-min", type=float, default=5.0)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (base 1e-3, chat 4e-4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    ap.add_argument("--fresh", action="store_true", help="ignore a checkpoint in --work")
    ap.add_argument("--layers", type=int, default=None,
                    help="chat stage: grow the model to this many layers first (scripts/demo_chat_stage.py grow_depth)")
    ap.add_argument("--stage", choices=("base", "chat"), default="base",
                    help="base: language, doc chat and retrieval from scratch; chat: Qwen3's chat format "
                         "(thinking, tool calls) resumed from the model in --out (scripts/demo_chat_stage.py)")
    ap.add_argument("--run-min", type=float, default=30.0,
                    help="chat stage: stop, measure and export after this many minutes (rerun to go on)")
    ap.add_argument("--resume-from", type=Path, default=None,
                    help="chat stage: the model to start from (default: --out)")
    ap.add_argument("--ema-decay", type=float, default=0.0,
                    help="chat stage: measure, keep and export an average of the weights (0: the last step's)")
    ap.add_argument("--eval-trials", type=int, default=10, help="haystacks per context in the needle measure")
    ap.add_argument("--eval-contexts", type=lambda s: [int(c) for c in s.split(",")], default=[256, 512, 1024, 2048],
                    help="chat stage: contexts of the needle measure after each run")
    args = ap.parse_args()
    if args.stage == "chat":
        return _chat_stage(args)
    args.lr = args.lr or 1e-3

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from appliance.engine.tokenizer import Tokenizer as ApplianceTokenizer
    torch.set_num_threads(args.threads)
    log = work_log(args.work)

    docs, manual = stdlib_docs(), manual_text()
    tok_dir = args.work / "tokenizer"
    ckpt = args.work / "checkpoint.pt"
    if ckpt.exists() and not args.fresh and (tok_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))   # the vocabulary the checkpoint learned
    else:
        tok = train_tokenizer(manual + [d for _, d in docs] + [q.format(n) for n, _ in docs[:2000]
                                                               for q in QUESTIONS[:1]], tok_dir)
    eval_tok = ApplianceTokenizer(tok_dir, {2})
    log(f"text: {len(docs)} docstrings, {len(manual)} manual topics, "
        f"{sum(map(len, manual)) + sum(len(d) for _, d in docs)} chars; vocab {tok.get_vocab_size()}")

    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=tok.get_vocab_size(), attn_implementation="sdpa", **ARCH))
    # No weight decay on norm gains: the QK-norm gains bound how sharply a head can attend.
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    data = Data(tok, docs, manual, random.Random(args.seed))
    log(f"model: {sum(p.numel() for p in model.parameters())} parameters; stream {len(data.stream)} tokens")
    step, elapsed = 0, 0.0
    if ckpt.exists() and not args.fresh:
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        data.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed at step {step}, {elapsed / 60:.1f} min")

    def save_checkpoint():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "rng": data.rng.getstate(), "torch_rng": torch.get_rng_state()}, tmp)
        tmp.replace(ckpt)

    budget = args.budget_min * 60
    t_start, t_ckpt = time.time() - elapsed, time.time()
    sums = {"lm": 0.0, "ans": 0.0, "acc": 0.0, "n": 0}
    model.train()
    while elapsed < budget:
        frac = elapsed / budget
        _, length, batch = [c for c in CURRICULUM if c[0] <= frac][-1]
        if length > 1024 and step % 2:
            length, batch = 1024, 2          # the last stretch alternates 1024 and 2048
        warm = min(1.0, (step + 1) / 50)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        mix = [m for start, m in MIXES if start <= frac][-1] if step >= REPEAT_ONLY_STEPS else {"repeat": 1}
        x, y, kinds = data.batch(batch, length, mix)
        logits = model(input_ids=x).logits
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        lm_mask, ans_mask, value_mask = (kinds == 1).float(), (kinds >= 2).float(), (kinds == 3).float()
        lm_loss = (ce * lm_mask).sum() / lm_mask.sum().clamp(min=1)
        ans_loss = (ce * ans_mask).sum() / ans_mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        value_loss = (ce * value_mask).sum() / value_mask.sum().clamp(min=1)
        (lm_loss + ans_loss + VALUE_WEIGHT * value_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed = time.time() - t_start
        with torch.no_grad():
            acc = ((logits.argmax(-1) == y).float() * value_mask).sum() / value_mask.sum().clamp(min=1)
        sums["lm"] += lm_loss.item(); sums["ans"] += ans_loss.item(); sums["acc"] += acc.item(); sums["n"] += 1
        if step % 10 == 0:
            n = sums["n"]
            log(f"step {step:5d} {elapsed / 60:5.1f} min  T={length:4d}  lr {lr:.2e}  lm_loss {sums['lm'] / n:.3f}"
                f"  answer_loss {sums['ans'] / n:.3f}  value_acc {sums['acc'] / n:.2f}")
            sums = {"lm": 0.0, "ans": 0.0, "acc": 0.0, "n": 0}
        if time.time() - t_ckpt > args.checkpoint_min * 60:
            save_checkpoint()
            model.eval()
            log(f"checkpoint at step {step}; needle recall at {length}: "
                f"{needle_recall(model, eval_tok, min(length, 1024), 1):.2f}")
            model.train()
            t_ckpt = time.time()
    save_checkpoint()
    log(f"budget spent: {step} steps, {elapsed / 60:.1f} min")

    model.eval()
    for context in (256, 512, 1024, 2048):
        log(f"final needle recall (torch, greedy, held-out filler) at {context}: "
            f"{needle_recall(model, eval_tok, context, 10):.2f}")
    msgs = [{"role": "user", "content": "What does json.dumps do?"}]
    ids = torch.tensor([eval_tok.encode(eval_tok.apply_chat_template(msgs))])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=2, pad_token_id=0)
    log(f"sample: {eval_tok.decode(out[0, ids.shape[1]:].tolist())!r}")

    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        (out_dir / name).unlink(missing_ok=True)
    shutil.rmtree(out_dir / ".appliance-cache", ignore_errors=True)   # quantized weights of the old model
    model.to(torch.bfloat16).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out_dir / name)
    (out_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=1))
    shutil.copy(args.work / "train.log", out_dir / "train_log.txt")
    log(f"saved {out_dir}")


def work_log(work: Path):
    """log(msg): a timestamped line on stdout and in WORK/train.log."""
    work.mkdir(parents=True, exist_ok=True)
    log_file = open(work / "train.log", "a")

    def log(msg):
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()
    return log


def _chat_stage(args) -> None:
    from demo_chat_stage import run_chat_stage
    log = work_log(args.work)
    args.lr = args.lr or 4e-4              # resumed training: below the first stage's peak
    run_chat_stage(args, sys.modules[__name__], log)


if __name__ == "__main__":
    main()
