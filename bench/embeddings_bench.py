#!/usr/bin/env python3
"""Embeddings/s: our engine vs llama.cpp's embedding mode, side by side, on the same checkpoint.

    python bench/embeddings_bench.py [--inputs 16] [--tokens 128] [--threads 2] [--repeat 5]
    python bench/embeddings_bench.py --shape tiny --inputs 2 --tokens 8 --repeat 1   # a quick check

One request's worth of inputs (--inputs texts of exactly --tokens tokens each, the same text for
both engines) is embedded in one call, --repeat times after a warm-up; the median call gives
embeddings/s. Both engines pool the last token and L2-normalise (Qwen3-Embedding's recipe), on
the same weights: our engine on the random Qwen3-0.6B-shaped checkpoint (bench/checkpoint.py,
q8 weights and KV), llama.cpp on its Q8_0 GGUF (bench/llamacpp_gguf.py) through llama_cpp.Llama
with embedding=True, pooling LAST and one batch for all inputs (n_batch = n_ubatch = their
tokens). The cosine between the two engines' vectors is printed as a check
that both computed the same thing. Each engine runs in its own subprocess, one after the other.

--shape tiny builds a 2-layer, 64-wide checkpoint with Qwen's real tokenizer instead (seconds),
to check the script, never to quote. llama-cpp-python is not a project requirement; install it
as bench/README.md says.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.checkpoint import SHAPES, shape_dir  # noqa: E402

INSTALL_LLAMA = ('CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python '
                 '--no-binary llama-cpp-python   # about 10 minutes on 2 cores')
# Words Qwen's tokenizer keeps whole with their leading space: a text of n of them is n tokens.
WORDS = ("board", "model", "token", "kernel", "memory", "cache", "layer", "vector", "query", "answer", "document",
         "search", "engine", "thread", "signal", "network", "power", "window", "river", "garden", "market", "letter")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_texts(tokenizer_dir: Path, n: int, tokens: int) -> list[str]:
    """n different texts of exactly `tokens` tokens each (checked with the checkpoint's tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(tokens)]
        text = "".join(" " + w for w in words)
        got = len(tok.encode(text, add_special_tokens=True).ids)
        if got != tokens:
            raise SystemExit(f"text {i} is {got} tokens, not {tokens}: the word list needs single-token words")
        texts.append(text)
    return texts


# ---- workers (one engine per process) -------------------------------------------------------------
def worker_ours(args, texts: list[str]) -> dict:
    from appliance import Engine
    from appliance.kernels.dispatch import kernels

    engine = Engine.load(str(args.model), weights="q8", kv="q8", threads=args.threads,
                         max_context=args.tokens + 64, progress=False)
    inputs = [engine.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    engine.embed(inputs[:1])                                  # warm-up: thread pool, first pages
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        vectors = engine.embed(inputs)
        times.append(time.perf_counter() - t0)
    return {"engine": "ours", "kernel_path": kernels.kernel_path(), "threads": engine.threads,
            "tokens": [len(i) for i in inputs], "times_s": times, "vectors": vectors.tolist()}


def worker_llama(args, texts: list[str]) -> dict:
    if not args.llama_amx:
        from bench.no_amx import deny_amx
        deny_amx()
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        return {"error": f"llama-cpp-python is not installed ({e}); install it with:\n  {INSTALL_LLAMA}"}
    rows = args.inputs * args.tokens
    # embedding=True makes llama-cpp-python set n_seq_max to min(n_batch, llama.cpp's maximum) and a
    # unified KV cache: with n_batch = all rows, Llama.embed decodes every input in one batch.
    llm = Llama(model_path=str(args.gguf), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST,
                n_ctx=rows, n_batch=rows, n_ubatch=rows, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False)
    n_seq_max = llm.context_params.n_seq_max
    tokens = [len(llm.tokenize(t.encode(), add_bos=True)) for t in texts]
    llm.embed(texts[:1], normalize=True)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        vectors = llm.embed(texts, normalize=True)
        times.append(time.perf_counter() - t0)
    return {"engine": "llama.cpp", "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
            "threads": args.threads, "tokens": tokens, "times_s": times, "vectors": vectors,
            "decodes_per_call": -(-args.inputs // n_seq_max)}


WORKERS = {"ours": worker_ours, "llama": worker_llama}


def run_worker(kind: str, args, extra: list[str], out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--out", str(out),
           "--inputs", str(args.inputs), "--tokens", str(args.tokens), "--threads", str(args.threads),
           "--repeat", str(args.repeat), "--texts", str(args.texts), *(["--llama-amx"] if args.llama_amx else []),
           *extra]
    load = os.getloadavg()
    out.unlink(missing_ok=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"worker {kind} failed with exit code {proc.returncode}"}
    res = json.loads(out.read_text())
    res["loadavg_before"], res["loadavg_after"] = load, os.getloadavg()
    return res


def report(ours: dict, llama: dict, args) -> str:
    import numpy as np

    lines = [f"embeddings: {args.inputs} inputs x {args.tokens} tokens in one call, {args.threads} threads, "
             f"median of {args.repeat} ({args.shape} checkpoint)", "",
             f"{'engine':<11} {'tokens/input':>12} {'median s':>9} {'embeddings/s':>13} {'tokens/s':>9} "
             f"{'vs llama.cpp':>12}  load avg before -> after"]
    llama_rate = None
    if "error" not in llama:
        llama_rate = args.inputs / statistics.median(llama["times_s"])
    for res in (ours, llama):
        name = res.get("engine", "?")
        if "error" in res:
            lines.append(f"{name:<11} {res['error']}")
            continue
        med = statistics.median(res["times_s"])
        rate = args.inputs / med
        ratio = f"{rate / llama_rate:.2f}x" if llama_rate else "-"
        load = f"{res['loadavg_before'][0]:.2f} -> {res['loadavg_after'][0]:.2f}"
        tok = sorted(set(res["tokens"]))
        lines.append(f"{name:<11} {'/'.join(map(str, tok)):>12} {med:9.3f} {rate:13.2f} {rate * args.tokens:9.0f} "
                     f"{ratio:>12}  {load}")
    if "error" not in ours and "error" not in llama:
        a, b = np.array(ours["vectors"]), np.array(llama["vectors"])
        cos = np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        lines += ["", f"agreement: cosine(ours, llama.cpp) min {cos.min():.4f}, median {np.median(cos):.4f} "
                      f"(same weights, both Q8_0; a pooling or position mismatch gives far less)"]
    lines.append(f"kernel path (ours): {ours.get('kernel_path', '?')}; llama.cpp {llama.get('llama_cpp_version', '?')}"
                 f", {llama.get('decodes_per_call', '?')} decode(s) per call")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/appliance-bench"),
                    help="cache for the checkpoint, GGUF files and results (default %(default)s)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b",
                    help="0.6b: Qwen3-0.6B's shape (default); tiny: 2 layers, to check the script")
    ap.add_argument("--inputs", type=int, default=16, help="inputs per call (default 16)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per input (default 128)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5, help="timed calls, median (default 5)")
    ap.add_argument("--llama-amx", action="store_true", help="let llama.cpp use Intel AMX (see bench/no_amx.py)")
    ap.add_argument("--llama-sdist", help="llama-cpp-python sdist to take the GGUF converter from")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--texts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        res = WORKERS[args.worker](args, json.loads(args.texts.read_text()))
        args.out.write_text(json.dumps(res))
        return 0 if "error" not in res else 3
    from bench.checkpoint import build_checkpoint, recipe_key
    from bench.llamacpp_gguf import make_ggufs

    shape = SHAPES[args.shape]
    work = args.workdir
    (work / "results").mkdir(parents=True, exist_ok=True)
    model_dir = shape_dir(work, args.shape)
    log(f"[1/4] checkpoint {model_dir}")
    build_checkpoint(model_dir, shape=shape, cache_dir=work, log=log)
    texts_path = work / "results" / f"embedding-texts-{args.inputs}x{args.tokens}.json"
    texts_path.write_text(json.dumps(make_texts(model_dir, args.inputs, args.tokens)))
    args.texts = texts_path
    llama = {"engine": "llama.cpp", "error": "skipped (--skip-llama)"}
    if not args.skip_llama:
        if subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True).returncode != 0:
            llama["error"] = f"llama-cpp-python is not installed; install it with\n  {INSTALL_LLAMA}"
        else:
            log("[2/4] GGUF Q8_0 with llama.cpp's convert_hf_to_gguf.py (cached)")
            gguf = make_ggufs(model_dir, work, sdist=args.llama_sdist, tag=recipe_key(shape), log=log)["q8_0"]
            log(f"[3/4] llama.cpp embedding mode, {args.threads} threads")
            llama = run_worker("llama", args, ["--gguf", str(gguf)], work / "results" / "embed-llama.json")
            llama.setdefault("engine", "llama.cpp")
    log(f"[4/4] our engine, {args.threads} threads (the first load quantizes into {model_dir}/.appliance-cache)")
    ours = run_worker("ours", args, ["--model", str(model_dir)], work / "results" / "embed-ours.json")
    ours.setdefault("engine", "ours")
    print(report(ours, llama, args))
    if args.json:
        args.json.write_text(json.dumps({"ours": ours, "llamacpp": llama, "args": {
            k: str(v) for k, v in vars(args).items()}}, indent=1))
    return 0 if "error" not in ours else 1


if __name__ == "__main__":
    sys.exit(main())
