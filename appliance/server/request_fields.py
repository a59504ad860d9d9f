"""The fields each endpoint reads, defined once: validation reads scalars through them and
GET /openapi.json publishes their schemas, so the two cannot drift.

A scalar field (Integer, Number, Boolean) carries its range and reads itself from a body with
the 400 naming it. A field with a shape of its own (messages, tools, response_format...) is
checked by its module (chat.py, structured.py, speculative_params.py); its entry here gives
the JSON Schema of what that check accepts. Bounds that depend on the model (the vocabulary,
the served names, the embedding size) are named and filled in from the loaded engine
(ServedFacts); a field left out or null takes its default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from appliance.server.chat import MAX_TOOLS, ROLES, TOOL_CHOICES, bad, kind

MAX_STOP = 4
MAX_LOGIT_BIAS = 1024            # entries; OpenAI allows 300, llama.cpp and vLLM any
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5
MAX_INPUTS = 2048                # per /v1/embeddings request, as OpenAI's API
MAX_DOCUMENTS = 1000             # per /v1/rerank request, as Cohere's
ENCODING_FORMATS = ("float", "base64")
_MISSING = object()


@dataclass(frozen=True)
class ServedFacts:
    """What the loaded model adds to the fields' bounds (None: not known yet, no bound)."""
    model_names: tuple[str, ...] = ()
    vocab: int | None = None
    max_context: int | None = None
    embedding_size: int | None = None

    @classmethod
    def of(cls, engine, model_names=()) -> "ServedFacts":
        vocab = int(engine.info().get("vocab") or 0) or None
        try:
            size = engine.embedding_size
        except Exception:           # a checkpoint without embeddings: no bound to publish
            size = None
        return cls(tuple(model_names), vocab, engine.max_context, size)

    def get(self, name: str | int | None):
        return getattr(self, name) if isinstance(name, str) else name


def nullable(schema: dict) -> dict:
    """Null means "the default" for every optional field."""
    return {"anyOf": [schema, {"type": "null"}]}


@dataclass(frozen=True)
class Field:
    name: str
    help: str
    shape: dict | Callable[[ServedFacts], dict] = field(default_factory=dict)
    required: bool = False

    def schema(self, facts: ServedFacts) -> dict:
        shape = self.shape(facts) if callable(self.shape) else dict(self.shape)
        return {"description": self.help, **(shape if self.required else nullable(shape))}


@dataclass(frozen=True)
class Integer(Field):
    lo: int | str | None = None          # a number, or the ServedFacts attribute that bounds it
    hi: int | str | None = None

    def read(self, body: dict, default: Any = None, facts: ServedFacts | None = None) -> Any:
        facts = facts or ServedFacts()
        return get_int(body, self.name, facts.get(self.lo), facts.get(self.hi), default)

    def schema(self, facts: ServedFacts) -> dict:
        s: dict = {"type": "integer"}
        lo, hi = facts.get(self.lo), facts.get(self.hi)
        if lo is not None:
            s["minimum"] = lo
        if hi is not None:
            s["maximum"] = hi
        return Field(self.name, self.help, s, self.required).schema(facts)


@dataclass(frozen=True)
class Number(Field):
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False

    def read(self, body: dict, default: Any = None) -> Any:
        return get_float(body, self.name, self.lo, self.hi, default, self.lo_open)

    def schema(self, facts: ServedFacts) -> dict:
        s: dict = {"type": "number"}
        if math.isfinite(self.lo):
            s["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if math.isfinite(self.hi):
            s["maximum"] = self.hi
        return Field(self.name, self.help, s, self.required).schema(facts)


@dataclass(frozen=True)
class Boolean(Field):
    def read(self, body: dict, default: bool) -> bool:
        return get_bool(body, self.name, default)

    def schema(self, facts: ServedFacts) -> dict:
        return Field(self.name, self.help, {"type": "boolean"}, self.required).schema(facts)


# ---- the readers ------------------------------------------------------------------------------

def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"expected a boolean, got {kind(v)}", "invalid_type")
    return v


def get_int(body: dict, name: str, lo: int | None, hi: int | None, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(name, f"expected an integer, got {kind(v)}", "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"{v} is out of range [{'' if lo is None else lo}, {'' if hi is None else hi}]")
    return v


def get_float(body: dict, name: str, lo: float, hi: float, default: Any = None,
              lo_open: bool = False) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"expected a number, got {kind(v)}", "invalid_type")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise bad(name, f"{v:g} is out of range {left}{lo:g}, {hi:g}]")
    return v


# ---- shapes of the fields checked by their own modules ----------------------------------------

def _token_ids(facts: ServedFacts, **extra) -> dict:
    item: dict = {"type": "integer", "minimum": 0}
    if facts.vocab:
        item["maximum"] = facts.vocab - 1
    return {"type": "array", "items": item, **extra}


def _model(facts: ServedFacts) -> dict:
    return {"type": "string", "enum": list(facts.model_names)} if facts.model_names else {"type": "string"}


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_IMAGE_PART = {"type": "object", "required": ["type", "image_url"],
               "properties": {"type": {"const": "image_url"},
                              "image_url": {"anyOf": [{"type": "string", "minLength": 1},
                                                      {"type": "object", "required": ["url"],
                                                       "properties": {"url": {"type": "string", "minLength": 1}}}]}}}
_TOOL_CALL = {"type": "object", "required": ["function"],
              "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                             "function": {"type": "object", "required": ["name"],
                                          "properties": {"name": {"type": "string", "minLength": 1},
                                                         "arguments": {"type": ["string", "object"]}}}}}
_MESSAGE = {"type": "object", "required": ["role"],
            "properties": {"role": {"enum": list(ROLES)},
                           "content": {"anyOf": [{"type": "string"},
                                                 {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                                                 {"type": "null"}]},
                           "name": {"type": "string"}, "tool_call_id": {"type": "string", "minLength": 1},
                           "tool_calls": {"type": "array", "items": _TOOL_CALL},
                           "reasoning_content": {"type": "string"}},
            "description": "content is required except on assistant turns; image parts only in user turns of a "
                           "model that takes images; tool turns need tool_call_id"}
_PARAMETERS = {"type": "object", "description": "a JSON Schema describing an object",
               "properties": {"type": {"const": "object"}, "properties": {"type": "object"},
                              "required": {"type": "array", "items": {"type": "string"}}}}
_TOOL = {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                                    "description": {"type": "string"}, "parameters": _PARAMETERS,
                                                    "strict": {"type": "boolean"}}}}}
_JSON_SCHEMA = {"description": "a JSON Schema the reply must validate against (or its JSON text)",
                "type": ["object", "boolean", "string"]}
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type"],
     "properties": {"type": {"const": "json_schema"},
                    "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                     "schema": _JSON_SCHEMA,
                                                                     "strict": {"type": "boolean"}}}}}]}
_STRUCTURED_OUTPUTS = {"type": "object", "minProperties": 1, "maxProperties": 1,
                       "description": "exactly one of json, json_object, regex, choice, grammar",
                       "properties": {"json": _JSON_SCHEMA, "json_object": {"const": True},
                                      "regex": {"type": "string", "minLength": 1},
                                      "choice": {"type": "array", "minItems": 1,
                                                 "items": {"type": "string", "minLength": 1}},
                                      "grammar": {"type": "string", "minLength": 1}}}
_GRAMMAR = {"type": "string", "minLength": 1, "description": "a Lark or GBNF grammar"}


def _speculative(facts: ServedFacts) -> dict:
    from appliance.engine.speculative import MAX_DRAFT_TOKENS, MAX_NGRAM
    from appliance.server.speculative_params import SERVED_METHODS

    counts = {"type": "integer", "minimum": 1}
    return {"anyOf": [{"const": False},
                      {"type": "object", "additionalProperties": False,
                       "properties": {"method": {"enum": list(SERVED_METHODS)},
                                      "num_tokens": counts | {"maximum": MAX_DRAFT_TOKENS},
                                      "ngram_min": counts | {"maximum": MAX_NGRAM},
                                      "ngram_max": counts | {"maximum": MAX_NGRAM}}}]}


# ---- the tables -------------------------------------------------------------------------------

def table(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


MODEL = Field("model", "one of the names this server answers to (GET /v1/models); default: the first", _model)

GENERATION = table(
    MODEL,
    Boolean("stream", "answer as server-sent events ending in data: [DONE]"),
    Field("stream_options", "only with stream: include_usage adds a last chunk with the usage",
          {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
    Integer("max_tokens", "tokens to generate at most; clamped to the room left in the context", lo=1),
    Integer("max_completion_tokens", "the same as max_tokens (OpenAI's newer name); wins over it", lo=1),
    Integer("n", "choices per request: only 1", lo=1, hi=1),
    Integer("best_of", "only 1", lo=1, hi=1),
    Number("temperature", "0 is greedy; default: the model's generation_config.json, else 1", lo=0.0, hi=2.0),
    Number("top_p", "nucleus sampling", lo=0.0, hi=1.0, lo_open=True),
    Integer("top_k", "keep the k most likely tokens; 0 or -1: all", lo=-1),
    Number("min_p", "drop tokens below min_p times the top probability", lo=0.0, hi=1.0),
    Number("repetition_penalty", "divides the logits of tokens already seen (1: off)", lo=0.0, hi=10.0,
           lo_open=True),
    Number("presence_penalty", "OpenAI's", lo=-2.0, hi=2.0),
    Number("frequency_penalty", "OpenAI's", lo=-2.0, hi=2.0),
    Field("logit_bias", "token id (as a string) -> bias added to its logit",
          lambda f: {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                     "propertyNames": {"pattern": "^[0-9]+$"},
                     "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
    Integer("min_tokens", "tokens to generate before a stop or EOS may end the answer", lo=0),
    Field("stop_token_ids", "token ids that end the answer",
          lambda f: _token_ids(f, maxItems=MAX_STOP_TOKEN_IDS)),
    Integer("seed", "a seed for sampling; negative: random", lo=-(2 ** 63), hi=2 ** 64 - 1),
    Field("stop", "up to 4 strings that end the answer (not included)",
          {"anyOf": [{"type": "string", "minLength": 1},
                     {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}}]}),
    Boolean("ignore_eos", "keep generating past the end-of-sequence token"),
    Field("speculative", "prompt-lookup speculative decoding for this request; false: off", _speculative),
    Field("response_format", "OpenAI's structured output: json_object or json_schema", _RESPONSE_FORMAT),
    Field("structured_outputs", "vLLM's structured output", _STRUCTURED_OUTPUTS),
    Field("guided_json", "vLLM's older field: a JSON Schema", _JSON_SCHEMA),
    Field("guided_regex", "vLLM's older field: a regular expression", {"type": "string", "minLength": 1}),
    Field("guided_choice", "vLLM's older field: one of these strings",
          {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}),
    Field("guided_grammar", "vLLM's older field: a grammar", _GRAMMAR),
    Field("json_schema", "llama.cpp's field: a JSON Schema", _JSON_SCHEMA),
    Field("grammar", "llama.cpp's field: a GBNF (or Lark) grammar", _GRAMMAR),
)

CHAT = GENERATION | table(
    Field("messages", "the conversation, rendered by the model's chat template",
          {"type": "array", "minItems": 1, "items": _MESSAGE}, required=True),
    Boolean("logprobs", "return the log probability of each token"),
    Integer("top_logprobs", "alternatives per token (needs logprobs)", lo=0, hi=MAX_TOP_LOGPROBS_CHAT),
    Field("tools", "functions the model may call", {"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL}),
    Field("tool_choice", "needs tools: none, auto, required, or a named function",
          {"anyOf": [{"enum": list(TOOL_CHOICES)},
                     {"type": "object", "required": ["type", "function"],
                      "properties": {"type": {"const": "function"},
                                     "function": {"type": "object", "required": ["name"],
                                                  "properties": {"name": {"type": "string"}}}}}]}),
    Boolean("parallel_tool_calls", "allow several calls in one answer"),
    Field("chat_template_kwargs", "keyword arguments of the chat template, e.g. {\"enable_thinking\": false}",
          {"type": "object"}),
    Integer("max_thinking_tokens", "tokens the model may think before it must answer", lo=0),
)

COMPLETION = GENERATION | table(
    Field("prompt", "a string or an array of token ids (or a batch of one of either)",
          lambda f: {"anyOf": [{"type": "string", "minLength": 1}, _token_ids(f, minItems=1),
                               {"type": "array", "minItems": 1, "maxItems": 1,
                                "items": {"anyOf": [{"type": "string", "minLength": 1}, _token_ids(f, minItems=1)]}}]},
          required=True),
    Integer("logprobs", "alternatives per token, with the log probability of each", lo=0,
            hi=MAX_LOGPROBS_COMPLETION),
    Field("echo", "not supported: only false", {"const": False}),
    Field("suffix", "not supported: only null", {"type": "null"}),
)

EMBEDDINGS = table(
    MODEL,
    Field("input", "a string, an array of strings, an array of token ids or an array of arrays of token ids",
          lambda f: {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
                                                    "items": {"type": "string"}},
                               _token_ids(f, minItems=1),
                               {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
                                "items": _token_ids(f)}]}, required=True),
    Field("encoding_format", "float, or base64 (little-endian float32)", {"enum": list(ENCODING_FORMATS)}),
    Integer("dimensions", "keep the first dimensions of each vector (renormalized)", lo=1, hi="embedding_size"),
    Field("user", "ignored", {"type": "string"}),
)

RERANK = table(
    MODEL,
    Field("query", "what the documents are ranked for", {"type": "string", "minLength": 1}, required=True),
    Field("documents", "strings, or {\"text\": string} objects",
          {"type": "array", "minItems": 1, "maxItems": MAX_DOCUMENTS,
           "items": {"anyOf": [{"type": "string"},
                               {"type": "object", "required": ["text"], "additionalProperties": False,
                                "properties": {"text": {"type": "string"}}}]}}, required=True),
    Integer("top_n", "return the n best; 0: all", lo=0),
    Boolean("return_documents", "include each document's text (Jina's and Cohere's name)"),
    Boolean("return_text", "the same (llama.cpp's name)"),
    Field("instruction", "the task given to the reranker", {"type": "string"}),
)

TOKENIZE = table(
    MODEL,
    Field("prompt", "text to tokenize as it is (or give messages)", {"type": "string"}),
    Field("messages", "a chat to render with the template, then tokenize", CHAT["messages"].shape),
    Field("tools", "tools the template renders", CHAT["tools"].shape),
    CHAT["chat_template_kwargs"],
    Boolean("add_generation_prompt", "end with the assistant's turn opening (default true)"),
)

DETOKENIZE = table(
    MODEL,
    Field("tokens", "token ids to decode", _token_ids, required=True),
)
