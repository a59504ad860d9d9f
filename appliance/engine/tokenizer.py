"""tokenizer.json + the checkpoint's chat template, rendered in a sandboxed Jinja as transformers does."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from appliance.errors import ApplianceError, ModelLoadError


THINK_START, THINK_END = "<think>", "</think>"


class ChatTemplateError(ApplianceError, ValueError):
    """The chat template refused the messages (e.g. a role it does not know)."""


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter (Jinja's own escapes HTML characters), so tool schemas render alike
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    def __init__(self, model_dir: Path, eos_token_ids: set[int] | None = None):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(path, "missing tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise ModelLoadError(path, f"unreadable tokenizer ({str(e).splitlines()[0]})") from None
        config_path = model_dir / "tokenizer_config.json"
        self.config: dict = {}
        if config_path.exists():
            try:
                self.config = json.loads(config_path.read_text())
            except ValueError as e:
                raise ModelLoadError(config_path, f"invalid JSON ({e})") from None
        template = self.config.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template_source: str | None = template
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(template)
            except TemplateError as e:
                raise ModelLoadError(config_path, f"chat template does not compile ({e})") from None
        self.eos_token = self._token_text(self.config.get("eos_token"))
        self.bos_token = self._token_text(self.config.get("bos_token"))
        self.eos_token_ids: set[int] = set(eos_token_ids or ())
        if self.eos_token and self.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self.token_to_id(self.eos_token))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.path = path
        start, end = self.token_to_id(THINK_START), self.token_to_id(THINK_END)
        # (id of <think>, id of </think>) when the model thinks in tagged thoughts (Qwen3), else None
        self.think_token_ids: tuple[int, int] | None = None if start is None or end is None else (start, end)

    @staticmethod
    def _token_text(value):
        if isinstance(value, dict):  # AddedToken serialization
            return value.get("content")
        return value

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the interpreter while Rust
        # tokenizes (tokenizers 0.23), and a 10 MB body took 23 s, every running stream frozen.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                            **kwargs) -> str:
        """Render messages ([{"role", "content", ...}]) with the model's own template, as
        transformers' apply_chat_template does: `tools` (OpenAI-shaped function definitions) and
        every other keyword (enable_thinking, ...) are visible to the template."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        values = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **values)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            # templates index and concatenate what they are given: a shape they do not expect
            raise ChatTemplateError(f"the chat template cannot render these messages ({e})") from None
