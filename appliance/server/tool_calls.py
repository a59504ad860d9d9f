"""Tool calls in a Qwen3 (Hermes-style) answer: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

The parser sees the answer's text in whatever pieces it arrives and returns ("content", text)
and ("tool_call", ToolCall) items. Text outside calls streams through at once, except a tail
that could still be the start of `<tool_call>`. Inside a call it follows the JSON itself (strings,
escapes, nesting), so a `</tool_call>` inside an argument string does not end the call. A call
whose body is not an object with a string "name" and object "arguments" is malformed: its text
comes back as content, unchanged, and is counted. A call still open when the reply ends comes
back as content too.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str                     # a JSON object, as OpenAI sends it: a string
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallStats:
    """One reply's tool calls, for metrics: well-formed and malformed ones."""
    parsed: int
    malformed: int


def _json_object_end(text: str) -> int | None:
    """End offset of the JSON object `text` starts with (after whitespace); None: not complete yet.
    Raises ValueError when text cannot start an object."""
    i = len(text) - len(text.lstrip())
    if i == len(text):
        return None
    if text[i] != "{":
        raise ValueError("a tool call holds a JSON object")
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def parse_call(body: str) -> ToolCall:
    """The JSON between the tags -> a ToolCall; ValueError names what is wrong."""
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError("a tool call holds a JSON object")
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a string name")
    if isinstance(arguments, str):                 # some models write the arguments as a string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments are a JSON object")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.pending = ""
        self.in_call = False
        self.calls: list[ToolCall] = []
        self.malformed = 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.pending += text
        out: list[tuple[str, object]] = []
        while self._step(out):
            pass
        return out

    def finish(self, cut_off: bool = False) -> list[tuple[str, object]]:
        """The end of the reply: held text is content; an unfinished call is content as written
        (malformed, unless max_tokens cut it off)."""
        rest, self.pending = self.pending, ""
        if self.in_call:
            self.in_call = False
            self.malformed += not cut_off
            return [("content", START + rest)]
        return self._text(rest)

    @property
    def stats(self) -> ToolCallStats:
        return ToolCallStats(len(self.calls), self.malformed)

    def _text(self, text: str) -> list[tuple[str, object]]:
        if self.calls and not text.strip():
            return []                               # the newlines between and after calls
        return [("content", text)] if text else []

    def _step(self, out) -> bool:
        if not self.in_call:
            at = self.pending.find(START)
            if at < 0:
                keep = next((n for n in range(min(len(START) - 1, len(self.pending)), 0, -1)
                             if self.pending.endswith(START[:n])), 0)
                out += self._text(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return False
            out += self._text(self.pending[:at])
            self.pending = self.pending[at + len(START):]
            self.in_call = True
            return True
        try:
            end = _json_object_end(self.pending)
        except ValueError:
            return self._malformed_until_end(out)
        if end is None:
            return False
        tail = self.pending[end:].lstrip()
        if len(tail) < len(END) and END.startswith(tail):     # the rest of </tool_call> is still to come
            return False
        if not tail.startswith(END):
            return self._malformed_until_end(out)
        written = self.pending[:len(self.pending) - len(tail)]       # the object and the whitespace after it
        body, self.pending = self.pending[:end], tail[len(END):]
        self.in_call = False
        try:
            call = parse_call(body)
        except ValueError:
            self.malformed += 1
            out.append(("content", START + written + END))
            return True
        if self.parallel or not self.calls:
            self.calls.append(call)
            out.append(("tool_call", call))
        return True

    def _malformed_until_end(self, out) -> bool:
        """Not a JSON object: the call's text, up to its closing tag, goes back as content."""
        at = self.pending.find(END)
        if at < 0:
            return False
        self.malformed += 1
        out.append(("content", START + self.pending[:at + len(END)]))
        self.pending = self.pending[at + len(END):]
        self.in_call = False
        return True
