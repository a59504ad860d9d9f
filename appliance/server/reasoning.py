"""Splitting a thinking model's output into its reasoning and its answer, as text streams in.

Qwen3 thinks inside `<think>` ... `</think>` before it answers; the chat template writes the
thought of an earlier turn back as `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`. The parser
sees the reply's text in whatever pieces it arrives (a tag may be split over two pieces, or
one piece may hold the end of the thought and the start of the answer) and returns
("reasoning" | "content", text) pieces, holding back only what could still be part of a tag
or of the newlines around it.

The start state comes from the prompt: "open" when the template itself opened the thought
(thinking models whose generation prompt ends in `<think>`), "allowed" when the model may open
one with its first token, "closed" when the template closed it (thinking switched off): all
is content. A reply cut off inside its thought has reasoning and no content.
"""
from __future__ import annotations

START, END = "<think>", "</think>"
STATES = ("allowed", "open", "closed")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, state: str = "allowed"):
        if state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, not {state!r}")
        self.mode = {"open": "reasoning", "allowed": "start", "closed": "content"}[state]
        self.pending = ""
        self.reasoning_seen = state == "open"

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while True:
            step = getattr(self, "_" + self.mode)(out)
            if not step:
                return [(kind, t) for kind, t in out if t]

    def finish(self) -> list[tuple[str, str]]:
        """The end of the reply: what was held back goes where it was heading."""
        rest, self.pending = self.pending, ""
        if not rest:
            return []
        if self.mode == "reasoning":
            return [("reasoning", rest.rstrip("\n"))] if rest.rstrip("\n") else []
        if self.mode == "after":
            return []
        return [("content", rest)]

    # Each state handler consumes from self.pending into out; True: call again (state changed).
    def _start(self, out) -> bool:
        head = self.pending.lstrip()
        if head.startswith(START):
            self.pending = head[len(START):]
            self.mode, self.reasoning_seen = "opened", True
            return True
        if START.startswith(head):             # (still) could become <think>
            return False
        self.mode = "content"
        return True

    def _opened(self, out) -> bool:
        """Right after <think>: the template's newline is not part of the reasoning."""
        if not self.pending:
            return False
        if self.pending.startswith("\n"):
            self.pending = self.pending[1:]
        self.mode = "reasoning"
        return True

    def _reasoning(self, out) -> bool:
        at = self.pending.find(END)
        if at >= 0:
            out.append(("reasoning", self.pending[:at].rstrip("\n")))
            self.pending = self.pending[at + len(END):]
            self.mode = "after"
            return True
        keep = _partial_suffix(self.pending, END)
        body = self.pending[:len(self.pending) - keep]
        newlines = len(body) - len(body.rstrip("\n"))   # held: they may be the ones before </think>
        cut = len(body) - newlines
        out.append(("reasoning", self.pending[:cut]))
        self.pending = self.pending[cut:]
        return False

    def _after(self, out) -> bool:
        """The blank line between </think> and the answer belongs to neither."""
        stripped = self.pending.lstrip("\n")
        if not stripped:
            self.pending = ""
            return False
        self.pending = stripped
        self.mode = "content"
        return True

    def _content(self, out) -> bool:
        out.append(("content", self.pending))
        self.pending = ""
        return False


def split_reasoning(text: str, state: str = "allowed") -> tuple[str | None, str]:
    """The whole reply at once: (reasoning or None when there was no thought, content)."""
    parser = ReasoningParser(state)
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if parser.reasoning_seen else None), content
