"""Attention supervision for the demo model's tool calls: the hops a call needs, taught directly.

A call to the right tool among several is three look-ups in a row, and the chat stage's runs
learnt none of them from the reply's loss alone in two hours (the first name token stayed near
chance with three tools offered; scripts/demo_chat_stage.py's docstring):
  1. name_of: every token of a tool's line (its description, its parameters) looks at the first
     token of that tool's name, so the line carries which tool it belongs to;
  2. match: a word of the question looks at the same word in the description of the tool it
     asks for (the words the question shares with that description and with no other offered
     tool's), picking up that tool's name on the way;
  3. choose: the position that writes the name's first token (in the call, or in the thought's
     "I will call ...") looks at those question words, and so reads the name.
Two more point a call's later parts at where they are copied from: `parameter` (the position
before the parameter name looks at it in the chosen tool's properties) and `value` (the
position before the value looks at the value's first token in the question). The value hop's
head also starts the copying answers (copy_pointers): a quoted passage, an edited function, the
keys and values of an extraction, each looked up where the question has it.

Each hop is one head of one layer (HOPS), trained to put its attention on the hop's targets:
the loss is -log of the attention mass on them, computed from the layer's own q and k (a hook
keeps the layer's input), so only the supervised query rows are scored, not whole attention
maps. Everything else the model learns as before; the hops only say where to look. This is the
classic supervised-attention aid for multi-hop retrieval; what the head then carries (its
values) is still learnt from the reply.

Annotations are made on the rendered text (character spans), then mapped to tokens with the
tokenizer's offsets: a pointer is (hop, query token, target tokens).
"""
from __future__ import annotations

import json
import re

# hop -> (layer, head) of the 7-layer model grown by grow_depth (fresh layers 1, 3, 5): each hop
# reads what the one before it wrote, so they sit in increasing layers. Two query heads share a
# kv head (4 q / 2 kv heads): value and parameter, which both carry the token they look at,
# share one; choose, which carries what the match hop left at its target, has the other to
# itself (sharing one with value, its output never read as the name: 0.00 in 3,500 steps).
# value_rest and value_end are the value head's own later steps (value_pointers), taught only
# with VALUE_STEPS: 75 minutes with them, resumed from the shipped model, served held-out calls
# 0.57 thinking off / 0.53 on against the shipped 0.73 / 0.63 (scripts/demo_chat_stage.py's
# docstring says why they miss), so the shipped recipe leaves them out.
VALUE_STEPS = False
HOPS = {"name_of": (1, 3), "match": (3, 3), "choose": (5, 0), "value": (5, 2), "parameter": (5, 3),
        "value_rest": (5, 2), "value_end": (5, 2)}
LAYERS = 7
POINTER_WEIGHT = 1.0
# The weight of what a hop's head carries against where it looks (PointerLoss): looking right
# came first in training (attention on the targets 0.8-0.99 after 40 minutes) while the held-out
# first name token stayed at 0.47: the heads looked at the right tokens without bringing back
# the name.
CARRY_WEIGHT = 1.0
# Words that tell nothing about which tool is meant.
STOP = {"the", "a", "an", "of", "for", "to", "in", "on", "at", "is", "it", "its", "what", "me", "my", "by",
        "and", "or", "one", "given", "do", "does", "you", "i", "please", "can", "could", "how", "which", "s"}
_WORD = re.compile(r"[A-Za-z]+")


def _words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)} - STOP


def _word_spans(text: str, start: int, end: int, words: set[str]) -> list[tuple[int, int]]:
    return [(start + m.start(), start + m.end()) for m in _WORD.finditer(text[start:end]) if m.group().lower() in words]


def listing_entries(text: str, start: int, schemas: list[dict]) -> list[dict]:
    """Where each offered tool sits in text (its JSON line, as the template or json.dumps writes
    it, searched from `start`): {name, line (a, b), name_at, description (a, b), parameters {p: at}}."""
    entries, at = [], start
    for schema in schemas:
        f = schema["function"]
        key = '"name": "' + f["name"] + '"'
        where = text.find(key, at)
        if where < 0:
            return []
        line_start = text.rfind("\n", 0, where) + 1
        line_end = text.find("\n", where)
        line_end = len(text) if line_end < 0 else line_end
        name_at = where + len('"name": "')
        entry = {"name": f["name"], "line": (line_start, line_end), "name_at": name_at, "description": None,
                 "parameters": {}}
        if f.get("description"):
            d = text.find('"description": "' + f["description"], where, line_end)
            if d >= 0:
                d += len('"description": "')
                entry["description"] = (d, d + len(f["description"]))
        props = text.find('"properties": {', where, line_end)
        for p in f.get("parameters", {}).get("properties", {}):
            q = text.find('"' + p + '": {', props, line_end) if props >= 0 else -1
            if q >= 0:
                entry["parameters"][p] = q + 1
        entries.append(entry)
        at = line_end
    return entries


def listing_pointers(entries: list[dict]) -> list[dict]:
    """name_of: every token of a tool's line after its name looks at the name's first token."""
    out = []
    for e in entries:
        a = e["name_at"] + len(e["name"]) + 1
        out.append({"hop": "name_of", "query": (a, e["line"][1], "all"), "targets": [(e["name_at"], e["name_at"] + 1)],
                    "carry": e["name_at"]})
    return out


def call_pointers(text: str, entries: list[dict], question: tuple[int, int], reply: int, name: str,
                  parameter: str, value: str) -> list[dict]:
    """match, choose, parameter and value pointers of one question (text[question[0]:question[1]])
    answered in text[reply:] by a call to `name` (in a thought's "I will call NAME" too)."""
    chosen = next((e for e in entries if e["name"] == name), None)
    if chosen is None:
        return []
    out = []
    q0, q1 = question
    # what the question's words are matched against: the description, or the name when the
    # listing has no descriptions (its names then spell their topics: get_humidity, getHumidity)
    def said(e):
        return _words(text[slice(*e["description"])]) if e["description"] else _name_words(e["name"])
    others = set().union(*[said(e) for e in entries if e is not chosen])
    shared = (_words(text[q0:q1]) & said(chosen)) - others - _words(value)
    asked = _word_spans(text, q0, q1, shared)
    if asked:
        where = chosen["description"] or (chosen["name_at"], chosen["name_at"] + len(name))
        for a, b in asked:
            targets = _occurrences(text, *where, text[a:b].lower())
            if targets:
                out.append({"hop": "match", "query": (a, b, "all"), "targets": targets, "carry": chosen["name_at"]})
        for at in _all(text, name, reply):
            out.append({"hop": "choose", "query": (at, at + 1, "before"), "targets": asked, "carry": at})
    call = text.find('"arguments": {"' + parameter + '"', reply)
    if call >= 0 and parameter in chosen["parameters"]:
        p = call + len('"arguments": {"')
        at = chosen["parameters"][parameter]
        out.append({"hop": "parameter", "query": (p, p + 1, "before"), "targets": [(at, at + 1)], "carry": p})
        v = text.find('"' + value, p + len(parameter) + 2)
        source = text.find(value, q0, q1)
        if v >= 0 and source >= 0:
            out += value_pointers(v + 1, source, len(value), q1)
    return out


def value_pointers(written: int, source: int, length: int, question_end: int) -> list[dict]:
    """Where a value copied from the question (text[source:source+length], written at `written`)
    starts, goes on and stops: the position before its first character looks at that character
    in the question (value); the position before each later token looks at the question's
    character it copies (value_rest, kept by to_tokens only where a token starts at both); the
    position that closes the value looks at the question's character after it (value_end, attention only:
    nothing is carried, the head's finding the value over is what ends it). The misses these
    aim at: a neighbouring word taken ("echo ephemeral"), a value garbled or stopped inside
    ("Par" for Paris)."""
    out = [{"hop": "value", "query": (written, written + 1, "before"), "targets": [(source, source + 1)],
            "carry": written}]
    if not VALUE_STEPS:
        return out
    for j in range(1, length):
        out.append({"hop": "value_rest", "query": (written + j, written + j + 1, "before_start"),
                    "targets": [(source + j, source + j + 1)], "carry": written + j})
    end = source + length
    if end < question_end:
        out.append({"hop": "value_end", "query": (written + length, written + length + 1, "before_start"),
                    "targets": [(end, end + 1)], "carry": None})
    return out


def _name_words(name: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Z]?[a-z]+", name)} - STOP


def _occurrences(text: str, start: int, end: int, word: str) -> list[tuple[int, int]]:
    """Spans of `word` (any case) in text[start:end], inside other words too (a name's parts)."""
    low, out = text[start:end].lower(), []
    at = low.find(word)
    while at >= 0:
        out.append((start + at, start + at + len(word)))
        at = low.find(word, at + 1)
    return out


def _all(text: str, needle: str, start: int) -> list[int]:
    """Where `needle` starts in text[start:] as a whole name (a quote or a space before it)."""
    out, at = [], text.find(needle, start)
    while at >= 0:
        if text[at - 1] in '" ':
            out.append(at)
        at = text.find(needle, at + 1)
    return out


def tool_sample_pointers(text: str, prompt_end: int, schemas: list[dict], messages: list[dict], reply_values) -> list[dict]:
    """Pointers of a rendered tool sample (ChatData.render's text; reply_values as tool_sample
    gives them: [name, '"parameter"', value] for a call)."""
    entries = listing_entries(text, 0, schemas)
    if not entries:
        return []
    out = listing_pointers(entries)
    if len(reply_values) == 3 and messages[-1]["role"] == "user":
        name, parameter, value = reply_values[0], reply_values[1].strip('"'), reply_values[2]
        question = messages[-1]["content"]
        q0 = text.rfind(question, 0, prompt_end)
        if q0 >= 0:
            out += call_pointers(text, entries, (q0, q0 + len(question)), prompt_end, name, parameter, value)
    return out


def shift(pointers: list[dict], by: int) -> list[dict]:
    return [{"hop": p["hop"], "query": (p["query"][0] + by, p["query"][1] + by, p["query"][2]),
             "targets": [(a + by, b + by) for a, b in p["targets"]],
             "carry": None if p["carry"] is None else p["carry"] + by} for p in pointers]


def to_tokens(pointers: list[dict], offsets: list[tuple[int, int]], length: int) -> list[tuple[str, int, list[int], int]]:
    """(hop, query token, target tokens, carried token) from character pointers and the tokens'
    offsets; a query "before" a span is the token before the one its first character is in (the
    position whose logits write that token), "before_start" the same but only where a token
    starts at that character and at the first target's (else the pointer is dropped: a value
    split apart in the question and in the call has no token to carry); the carried token is the
    one whose identity the hop moves (the name's first token for name_of, match and choose; the token
    written next for the others), -1 for none. Pointers cut by `length` are dropped."""
    import bisect
    starts = [a for a, _ in offsets]

    def token_at(c):
        return max(0, bisect.bisect_right(starts, c) - 1)

    def covering(a, b):
        return list(range(token_at(a), token_at(max(a, b - 1)) + 1))

    out = []
    for p in pointers:
        a, b, how = p["query"]
        def starts_a_token(c):
            return starts[token_at(c)] == c
        if how == "before_start" and not (starts_a_token(a) and starts_a_token(p["targets"][0][0])):
            continue
        queries = [token_at(a) - 1] if how.startswith("before") else covering(a, b)
        targets = sorted({t for c, d in p["targets"] for t in covering(c, d)})
        carry = -1 if p["carry"] is None else token_at(p["carry"])
        for q in queries:
            keep = [t for t in targets if t <= q]
            if 0 <= q < length and keep and carry < length:
                out.append((p["hop"], q, keep, carry))
    return out


class PointerLoss:
    """Per hop, -log(attention mass on the targets) of its head and, with CARRY_WEIGHT, the cross
    entropy of what the head writes (its share of the attention output, read through the final
    norm and the tied embedding) against the token the hop carries: the head must not only look
    at the right place but bring back that token's identity, which the next hop (or the reply)
    reads. Computed from the hooked layers' inputs on the supervised query rows only."""

    def __init__(self, model):
        self.model, self.inputs = model, {}
        for layer in {layer for layer, _ in HOPS.values()}:
            attn = model.model.layers[layer].self_attn
            attn.register_forward_pre_hook(self._keep(layer), with_kwargs=True)

    def _keep(self, layer):
        def hook(module, args, kwargs):
            self.inputs[layer] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                                  kwargs["position_embeddings"])
        return hook

    def __call__(self, pointers: list[tuple]):
        """pointers: (batch row, hop, query token, target tokens, carried token id, -1 for none). Returns
        (loss or None, {hop: mean attention mass on the targets, hop + " carried": share of rows
        whose head output reads as the carried token})."""
        import torch
        from transformers.models.qwen3.modeling_qwen3 import rotate_half
        losses, stats = [], {}
        embed = self.model.get_input_embeddings().weight                 # (vocab, hidden), tied
        norm = self.model.model.norm
        for hop, (layer, head) in HOPS.items():
            mine = [p for p in pointers if p[1] == hop]
            if not mine or layer not in self.inputs:
                continue
            attn = self.model.model.layers[layer].self_attn
            hidden, (cos, sin) = self.inputs[layer]                       # (B, T, hidden), (B, T, hd)
            hd, (batch, length) = attn.head_dim, hidden.shape[:2]
            cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)   # one row when positions are shared
            kv_head = head // (attn.config.num_attention_heads // attn.config.num_key_value_heads)
            k = attn.k_norm(attn.k_proj(hidden).view(batch, length, -1, hd)[:, :, kv_head])
            k = k * cos + rotate_half(k) * sin                             # (B, T, hd), as the layer's keys
            v = attn.v_proj(hidden).view(batch, length, -1, hd)[:, :, kv_head]      # (B, T, hd)
            w_o = attn.o_proj.weight[:, head * hd:(head + 1) * hd]       # (hidden, hd): this head's share
            got, written, carried = [], [], []
            for row in sorted({p[0] for p in mine}):
                ours = [p for p in mine if p[0] == row]
                qpos = torch.tensor([p[2] for p in ours])
                q = attn.q_norm(attn.q_proj(hidden[row, qpos]).view(len(ours), -1, hd)[:, head])
                q = q * cos[row, qpos] + rotate_half(q) * sin[row, qpos]
                scores = (q @ k[row].T) * attn.scaling                     # (n, T)
                scores = scores.masked_fill(torch.arange(length)[None, :] > qpos[:, None], float("-inf"))
                logp = torch.log_softmax(scores, dim=-1)
                target = torch.zeros_like(scores, dtype=torch.bool)
                for i, p in enumerate(ours):
                    target[i, p[3]] = True
                got.append(torch.logsumexp(logp.masked_fill(~target, float("-inf")), dim=-1))
                written.append((logp.exp() @ v[row]) @ w_o.T)                # (n, hidden)
                carried += [p[4] for p in ours]
            got = torch.cat(got)
            stats[hop] = got.exp().mean().item()
            loss = -got.mean()
            carried = torch.tensor(carried)
            if (carried >= 0).any():                                      # value_end carries nothing
                logits = norm(torch.cat(written)[carried >= 0]) @ embed.T
                carried = carried[carried >= 0]
                loss = loss + CARRY_WEIGHT * torch.nn.functional.cross_entropy(logits, carried)
                stats[hop + " carried"] = (logits.argmax(-1) == carried).float().mean().item()
            losses.append(loss)
        self.inputs.clear()
        if not losses:
            return None, stats
        return torch.stack(losses).mean(), stats


def copy_pointers(text: str, source: tuple[int, int], answer_at: int, pieces) -> list[dict]:
    """Where a copying answer starts each copy (quote, code edit, extraction): the position before
    each piece (its start in the answer at `answer_at + offset`) looks, with the value hop's head,
    at where that piece is in the source text (text[source[0]:source[1]]), and carries the token
    it writes. pieces: (offset in the answer, the text copied). A piece not found is skipped."""
    out = []
    for offset, piece in pieces:
        at = answer_at + offset
        where = text.find(piece, *source)
        if piece and where >= 0:
            out.append({"hop": "value", "query": (at, at + 1, "before"), "targets": [(where, where + 1)], "carry": at})
    return out


def drill_pointers(text: str, listing_start: int, schemas: list[dict], asks) -> list[dict]:
    """Pointers of a tool drill row: the listing at listing_start, then for each (question span,
    reply start, name, parameter, value) a call."""
    entries = listing_entries(text, listing_start, schemas)
    if not entries:
        return []
    out = listing_pointers(entries)
    for question, reply, name, parameter, value in asks:
        out += call_pointers(text, entries, question, reply, name, parameter, value)
    return out


def describe(pointers, text: str) -> str:
    """The pointers in words (for a test or a look at the data)."""
    return "\n".join(f"{p['hop']}: {text[p['query'][0]:p['query'][1]]!r} ({p['query'][2]}) -> "
                     + json.dumps([text[a:b] for a, b in p["targets"]]) for p in pointers)
