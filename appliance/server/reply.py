"""The OpenAI response objects of one request, built from its TokenEvents.

A chat reply's text goes through its parsers on the way out: the reasoning parser
(reasoning.py) splits the thought into `reasoning_content`, the tool-call parser
(tool_calls.py) turns `<tool_call>` blocks of the answer into `tool_calls`. Streaming sends
OpenAI's delta shapes: `delta.reasoning_content`, `delta.content`, and per call first
{index, id, type, function.name} then its `function.arguments`.
"""
from __future__ import annotations

import time
import uuid

from appliance.server.reasoning import ReasoningParser
from appliance.server.tool_calls import ToolCallParser


class OutputParser:
    """Reasoning, then tool calls in the answer, for one chat reply; items are
    ("reasoning" | "content", str) and ("tool_call", ToolCall)."""

    def __init__(self, reasoning: str | None, tools: bool, parallel: bool):
        self.reasoning = ReasoningParser(reasoning) if reasoning else None
        self.tools = ToolCallParser(parallel) if tools else None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def feed(self, text: str) -> list[tuple[str, object]]:
        pieces = self.reasoning.feed(text) if self.reasoning else [("content", text)]
        return self._answer(pieces)

    def finish(self, cut_off: bool = False) -> list[tuple[str, object]]:
        out = self._answer(self.reasoning.finish()) if self.reasoning else []
        if self.tools:
            out += self.tools.finish(cut_off)
        return out

    def _answer(self, pieces) -> list[tuple[str, object]]:
        if self.tools is None:
            return [p for p in pieces if p[1]]
        out = []
        for kind, text in pieces:
            out += self.tools.feed(text) if kind == "content" else [(kind, text)]
        return [p for p in out if p[1]]


class Reply:
    """Builds the OpenAI response objects for one request from its TokenEvents."""

    def __init__(self, gen, tokenizer, info: dict):
        self.gen = gen
        self.chat = gen.kind == "chat"
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = gen.model
        self.fingerprint = f"fp_appliance_{info.get('weights')}_{info.get('kv')}"
        self.parser = OutputParser(gen.reasoning, bool(gen.tools), gen.parallel_tool_calls) if self.chat else None
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list = []
        self.chat_logprobs: list[dict] = []
        self.legacy = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.offset = 0

    @property
    def tool_stats(self):
        """The tool-call parser's counts (None when the request offered no tools)."""
        return self.parser.tools.stats if self.parser is not None and self.parser.tools is not None else None

    # -- logprobs
    def _token_text(self, ev) -> str:
        for tid, text, _ in ev.top_logprobs or ():
            if tid == ev.token_id:
                return text
        return self.tokenizer.decode([ev.token_id])

    def _chat_entry(self, ev) -> dict:
        text = self._token_text(ev)
        return {"token": text, "logprob": ev.logprob, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                 for _, t, lp in (ev.top_logprobs or ())[: self.gen.top_logprobs]]}

    def _legacy_entry(self, ev) -> dict:
        text = self._token_text(ev)
        entry = {"tokens": [text], "token_logprobs": [ev.logprob],
                 "top_logprobs": [{t: lp for _, t, lp in (ev.top_logprobs or ())[: self.gen.top_logprobs]}],
                 "text_offset": [self.offset]}
        self.offset += len(ev.text)
        return entry

    def _logprobs(self, ev):
        if not self.gen.logprobs or ev.logprob is None:
            return None
        return {"content": [self._chat_entry(ev)]} if self.chat else self._legacy_entry(ev)

    def _parsed(self, text: str) -> list[tuple[str, object]]:
        if self.parser is None or not self.parser.active:
            return [("content", text)] if text else []
        return self.parser.feed(text)

    def _finish_items(self, fin) -> list[tuple[str, object]]:
        if self.parser is None or not self.parser.active:
            return []
        return self.parser.finish(cut_off=fin.finish_reason == "length")

    def _finish_reason(self, fin) -> str:
        return "tool_calls" if self.tool_calls and fin.finish_reason == "stop" else fin.finish_reason

    # -- non-streaming
    def add(self, ev) -> None:
        self.text.append(ev.text)
        self._collect(self._parsed(ev.text))
        lp = self._logprobs(ev)
        if lp is not None:
            if self.chat:
                self.chat_logprobs.extend(lp["content"])
            else:
                for k in self.legacy:
                    self.legacy[k].extend(lp[k])

    def _collect(self, items) -> None:
        for kind, value in items:
            {"reasoning": self.reasoning, "content": self.content, "tool_call": self.tool_calls}[kind].append(value)

    def _usage(self, fin) -> dict:
        usage = {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
                 "total_tokens": fin.prompt_tokens + fin.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": getattr(fin, "cached_tokens", 0)}}
        drafted = getattr(fin, "draft_tokens", None)
        if drafted is not None:
            # Speculative decoding's guesses, in the fields OpenAI's predicted outputs report them in.
            accepted = fin.accepted_draft_tokens or 0
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                  "rejected_prediction_tokens": drafted - accepted}
        return usage

    def message(self, fin) -> dict:
        self._collect(self._finish_items(fin))
        content = "".join(self.content)
        msg = {"role": "assistant", "content": content if content or not self.tool_calls else None}
        if self.gen.reasoning is not None:
            thought = self.parser.reasoning.reasoning_seen
            msg["reasoning_content"] = "".join(self.reasoning) if thought else None
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    def body(self, fin) -> dict:
        if self.chat:
            choice = {"index": 0, "message": self.message(fin),
                      "logprobs": {"content": self.chat_logprobs} if self.gen.logprobs else None,
                      "finish_reason": self._finish_reason(fin)}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(self.text), "logprobs": self.legacy if self.gen.logprobs else None,
                      "finish_reason": fin.finish_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [choice], "usage": self._usage(fin)}

    # -- streaming
    def _chunk(self, choice: dict | None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
               "choices": [] if choice is None else [choice]}
        if self.gen.include_usage:
            out["usage"] = None
        return out

    def _delta(self, delta: dict, logprobs=None, finish_reason=None) -> dict:
        return self._chunk({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    def first_chunk(self) -> dict | None:
        if not self.chat:
            return None
        return self._delta({"role": "assistant", "content": ""})

    def _item_deltas(self, items) -> list[dict]:
        deltas = []
        for kind, value in items:
            if kind == "tool_call":
                index = len(self.tool_calls)
                self.tool_calls.append(value)
                deltas.append({"tool_calls": [{"index": index, "id": value.id, "type": "function",
                                               "function": {"name": value.name, "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": value.arguments}}]})
            else:
                deltas.append({"reasoning_content" if kind == "reasoning" else "content": value})
        return deltas

    def token_chunks(self, ev) -> list[dict]:
        """The chunks one TokenEvent makes: none while text is held back (a stop string or a
        tag may be forming), one per piece of parsed output otherwise."""
        lp = self._logprobs(ev)
        if not self.chat:
            if not ev.text and lp is None:
                return []
            return [self._chunk({"index": 0, "text": ev.text, "logprobs": lp, "finish_reason": None})]
        deltas = self._item_deltas(self._parsed(ev.text))
        if not deltas and lp is not None:
            deltas = [{}]
        return [self._delta(d, lp if i == 0 else None) for i, d in enumerate(deltas)]

    def finish_chunks(self, fin) -> list[dict]:
        if not self.chat:
            return [self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": fin.finish_reason})]
        out = [self._delta(d) for d in self._item_deltas(self._finish_items(fin))]
        return out + [self._delta({}, finish_reason=self._finish_reason(fin))]

    def usage_chunk(self, fin) -> dict:
        out = self._chunk(None)
        out["usage"] = self._usage(fin)
        return out
