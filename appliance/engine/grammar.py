"""Grammar-constrained decoding with llguidance: output that matches a JSON Schema, a regular
expression, a choice of strings, a Lark or GBNF grammar, or Qwen3's tool-call syntax.

A Grammar is compiled and checked once per request (`json_schema`, `regex`, ... raise
GrammarError with llguidance's own words: a schema that is not valid or uses a feature that
cannot be enforced never decodes unconstrained). Each sequence that carries one gets its own
llguidance matcher (GrammarConstraint, a hard processor of engine/logits.py): before each
token it computes the matcher's token mask into the sequence's own row of logits, after the
token it advances the matcher. Sequences without a grammar carry nothing.

The token bridge (llguidance's view of the vocabulary: every token's bytes, the special ones
apart) is built from the model's tokenizer.json once per loaded tokenizer and kept.

With a thinking model (`<think>` ... `</think>`), the grammar holds the answer, not the thought:
while the model may still open a thought, `<think>` is allowed beside what the grammar allows;
inside the thought nothing is masked (a thinking budget closes it); the grammar starts after
`</think>`.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

# JSON may have whitespace where JSON allows it, but only a space, or a line break and its
# indent, in one place: pretty-printed JSON still fits, and a model (a random one above all)
# cannot spend its max_tokens on blanks.
JSON_WHITESPACE = r"(\x20|\x0A(\x20{0,16}|\x09{0,4}))"
# A tool call is written as Qwen3 writes it: one space at most after a colon or a comma.
CALL_WHITESPACE = r"\x20"
MAX_PARALLEL_CALLS = 8        # calls in one reply, when parallel calls are allowed
_BRIDGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BRIDGE_LOCK = threading.Lock()


class GrammarError(ValueError):
    """The grammar or schema cannot be enforced; the message says why, in one line."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:                      # a runtime dependency (pyproject.toml)
        raise GrammarError(f"structured output needs the llguidance package ({e})") from None
    return llguidance


def bridge(tokenizer):
    """llguidance's LLTokenizer for this tokenizer, built once (about a second for a 150K vocabulary)."""
    with _BRIDGE_LOCK:
        held = _BRIDGES.get(tokenizer)
        if held is None:
            llg = _llguidance()
            held = llg.LLTokenizer(tokenizer.path.read_text(encoding="utf-8"), n_vocab=tokenizer.vocab_size,
                                   eos_token=sorted(tokenizer.eos_token_ids) or None)
            _BRIDGES[tokenizer] = held
        return held


@dataclass(frozen=True)
class Grammar:
    """A checked grammar for one request: what llguidance runs, and what it came from."""

    kind: str         # "json_object" | "json_schema" | "regex" | "choice" | "lark" | "tool_calls"
    source: str       # llguidance's grammar text (a JSON object of grammars)
    tokenizer: object = None

    def constraint(self, tokenizer, thought=None) -> "GrammarConstraint":
        llg = _llguidance()
        matcher = llg.LLMatcher(bridge(tokenizer), self.source, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarConstraint(matcher, thought, min(tokenizer.eos_token_ids, default=0))


def _checked(kind: str, source: str, tokenizer) -> Grammar:
    llg = _llguidance()
    ok, messages = llg.LLMatcher.validate_grammar_with_warnings(source, bridge(tokenizer))
    if ok:                                      # (is_error, [message]): the first is the error
        raise GrammarError(_one_line(messages[0] if messages else "the grammar is not valid"))
    return Grammar(kind, source, tokenizer)


def _one_line(message: str) -> str:
    """llguidance's message in one line: its first line and, for a multi-line report (the
    offending text and a caret), its last, which says what is wrong."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if len(lines) > 1 and lines[-1] != lines[0]:
        return f"{lines[0]} {lines[-1]}"
    return lines[0] if lines else "invalid"


def _schema_text(schema) -> str:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON Schema is an object or a boolean, not {type(schema).__name__}")
    return json.dumps(schema)


def json_schema(schema, tokenizer) -> Grammar:
    """Output that is JSON valid against `schema` (a dict, Draft 2020-12 as llguidance reads it)."""
    llg = _llguidance()
    try:
        source = llg.LLMatcher.grammar_from_json_schema(_schema_text(schema),
                                                        defaults={"whitespace_pattern": JSON_WHITESPACE})
    except ValueError as e:
        raise GrammarError(_one_line(e)) from None
    return _checked("json_schema", source, tokenizer)


def json_object(tokenizer) -> Grammar:
    """Any JSON object (OpenAI's json_object mode)."""
    return json_schema({"type": "object"}, tokenizer)


def regex(pattern: str, tokenizer) -> Grammar:
    return _checked("regex", _llguidance().LLMatcher.grammar_from_regex(pattern), tokenizer)


def choice(options: list[str], tokenizer) -> Grammar:
    """Exactly one of the strings."""
    if not options or not all(isinstance(o, str) and o for o in options):
        raise GrammarError("a choice is a non-empty list of non-empty strings")
    lark = "start: " + " | ".join(json.dumps(o) for o in options)
    return _checked("choice", _llguidance().LLMatcher.grammar_from_lark(lark), tokenizer)


def lark(text: str, tokenizer) -> Grammar:
    """A grammar in llguidance's Lark syntax, or in llama.cpp's GBNF (told apart by `::=`)."""
    llg = _llguidance()
    if "::=" in text:
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            text = any_to_lark(text)
        except Exception as e:                   # the converter raises plain exceptions
            raise GrammarError(f"not a GBNF grammar llguidance can read ({_one_line(e)})") from None
    return _checked("lark", llg.LLMatcher.grammar_from_lark(text), tokenizer)


def tool_calls(tools: list[tuple[str, dict]], mode: str, parallel: bool, tokenizer, answer: dict | None = None) \
        -> Grammar:
    """Qwen3's tool calls, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, each call's
    arguments valid against its function's parameters schema.

    tools: (name, parameters schema). mode "required": the reply is one call (or several, with
    `parallel`) and nothing else; "auto": free text, and a call the model starts is held to its
    schema from its opening tag on (or, with `answer`, a JSON Schema, the answer must match it).
    The tags are the tokenizer's own tokens when it has them, else text.
    """
    if mode not in ("auto", "required"):
        raise ValueError(f"mode must be auto or required, not {mode!r}")
    start, end = _tag(tokenizer, "<tool_call>"), _tag(tokenizer, "</tool_call>")
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for name, params in tools]}
    body = "%json " + json.dumps({"x-guidance": {"whitespace_pattern": CALL_WHITESPACE}, **calls})
    rules = [f'call: {start} "\\n" body "\\n" {end}', f"body: {body}"]
    many = f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "call"
    if mode == "required":
        rules.insert(0, f"start: {many}")
    elif answer is not None:
        rules.insert(0, f"start: answer | {many}")
        rules.append("answer: %json " + json.dumps({"x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
                                                    **json.loads(_schema_text(answer))}))
    else:
        rules.insert(0, f"start: TEXT | TEXT? {many} /\\s*/")
        rules.append("TEXT: /(.|\\n)+/")
    return _checked("tool_calls", _llguidance().LLMatcher.grammar_from_lark("\n".join(rules)), tokenizer)


def _tag(tokenizer, text: str) -> str:
    """A tag as the grammar names it: the token itself (llguidance's <token> syntax) if the
    vocabulary has it, else the text."""
    return text if tokenizer.token_to_id(text) is not None else json.dumps(text)


class GrammarConstraint:
    """One sequence's matcher, as a hard logit processor (engine/logits.py).

    The mask for the next token is computed on a worker thread as soon as the last token is
    accepted (llguidance lets go of the interpreter), so it overlaps the next forward pass;
    apply() only waits for it and writes it into the row. The matcher is never touched by two
    threads at once: the worker runs between accept() and apply(), the engine thread after.
    """

    hard = True

    def __init__(self, matcher, thought=None, eos_id: int = 0):
        self.matcher = matcher
        self.thought = thought
        self.eos_id = eos_id
        self.mask_s = 0.0                 # time computing masks, on the worker (the bench reads these)
        self.wait_s = 0.0                 # time the step waited for them
        self.masks = 0
        self._next = None                 # the pending mask (a Future), or None
        if not self._free():
            self._prefetch()

    def _free(self) -> bool:
        """Inside the model's thought the grammar waits."""
        return self.thought is not None and self.thought.inside

    def _compute(self) -> bytes:
        t0 = time.perf_counter()
        bits = self.matcher.compute_bitmask()
        self.mask_s += time.perf_counter() - t0
        return bits

    def _prefetch(self) -> None:
        self._next = _mask_pool().submit(self._compute)

    def apply(self, x: np.ndarray) -> int | None:
        if self._free():
            return None
        t0 = time.perf_counter()
        bits = self._next.result() if self._next is not None else self._compute()
        self._next = None
        allowed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:x.size].astype(bool)
        if self.thought is not None and self.thought.may_open:
            allowed[self.thought.start_id] = True
        if allowed.size < x.size:
            allowed = np.concatenate([allowed, np.zeros(x.size - allowed.size, bool)])
        x[~allowed] = -np.inf
        self.wait_s += time.perf_counter() - t0
        self.masks += 1
        if not allowed.any():             # nothing can follow (a matcher error): end the sequence
            return self.eos_id
        self._next = _done(bits)          # a second apply() for the same token (engine/sampling.py) reuses it
        return None

    def accept(self, token: int) -> None:
        self._next = None
        th = self.thought
        if th is not None and th.inside:
            if token == th.end_id:        # the thought ends: the grammar holds the next token
                self._prefetch()
            return
        if th is not None and th.may_open and token == th.start_id:
            return                        # a thought opens; the grammar waits for its end
        self.matcher.consume_token(int(token))
        self._prefetch()


class _done:
    """A finished Future's result() (the mask already in hand)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


_POOL = None
_POOL_LOCK = threading.Lock()


def _mask_pool():
    """Two worker threads for all sequences' masks (engine/logits.py runs one row at a time)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")
        return _POOL
