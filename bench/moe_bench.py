#!/usr/bin/env python3
"""Qwen3-MoE: our engine vs llama.cpp on a Qwen3-30B-A3B-shaped random checkpoint with few layers.

    python bench/moe_bench.py [--layers 4] [--small-layers 2] [--threads 2] [--json out.json]

Steps (each cached in the work directory, default /tmp/appliance-bench, shared with
bench/compare_llamacpp.py for the llama.cpp converter and Qwen's tokenizer):
  1. a checkpoint with Qwen3-30B-A3B's config.json but `--layers` layers (hidden 2048, 32/4
     heads of 128, 128 experts of 768, top-8, norm_topk_prob, vocab 151936, untied head),
     random bf16 weights (normal, std 0.02; norms 1), written shard by shard (one layer,
     1.2 GB, in memory at a time; no torch model is built), with Qwen's tokenizer
     (bench/qwen_tokenizer.py). A `--small-layers` view of it shares its shard files, so
     that t(L) = fixed + L * per_layer can be solved and extrapolated to 48 layers;
  2. GGUF: bf16 by the convert_hf_to_gguf.py of the installed llama-cpp-python
     (bench/llamacpp_gguf.py), then llama.cpp's own quantizer to Q4_0 with the token
     embedding and output tensors at Q8_0 ("pure": no per-tensor bumps); the router
     (ffn_gate_inp) stays F32. These are exactly our q4 formats;
  3. llama.cpp (llama-cpp-python; f16 KV, mmap, weight repacking as by default) and our
     engine (q4 weights, q8 KV), one subprocess per measurement, never at the same time
     (our first load, which quantizes into the cache, is its own subprocess). The engines
     alternate `--rounds` times and each keeps its fastest round: on a shared machine a
     run is slowed by whatever else runs, and the fastest is the least disturbed.
Measured per engine and layer count: decode ms/token (median of `--gen` steps after a
`--context`-token prompt; and the process's CPU time per step, which with --threads 1
is the work of a token whatever else shares the cores), prefill tokens/s of that prompt (and of the first such prompt
after load, "cold": ours pages its experts in then), RSS after load, after a one-token
prompt and its first decoded token, and at the end (with its anonymous part: file-backed
pages of mapped weights can be dropped by the kernel under pressure, anonymous ones
cannot); for ours also the experts run per decoded token and the share of all experts
run since load.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Qwen/Qwen3-30B-A3B's config.json (num_hidden_layers is set per checkpoint).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
FULL_LAYERS = 48
SEED = 0
STD = 0.02
MARKER = ".moe-bench-checkpoint.json"
MB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _memory() -> dict:
    """Resident bytes: all, anonymous (heap, KV, repacked weights) and file-backed (mapped weights,
    which the kernel may drop under memory pressure and read back on the next touch); peak."""
    fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "VmHWM:": "peak"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split()[0] if line.strip() else ""
            if key in fields:
                out[fields[key]] = int(line.split()[1]) * 1024
    return out


def _tokens(n: int, seed: int, vocab: int = 151643) -> list[int]:
    import numpy as np
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=n)]


# ---- 1. the checkpoint ----------------------------------------------------------------------------
def _layer_tensors(cfg: dict, i: int, generator) -> dict:
    """Layer i's tensors, HF names, bf16: attention, norms, router, 128 experts."""
    import torch
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, f = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["moe_intermediate_size"]

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * STD).to(torch.bfloat16)

    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
           p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
           p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
           p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
           p + "mlp.gate.weight": rand(cfg["num_experts"], h)}
    for e in range(cfg["num_experts"]):
        x = f"{p}mlp.experts.{e}."
        out[x + "gate_proj.weight"] = rand(f, h)
        out[x + "up_proj.weight"] = rand(f, h)
        out[x + "down_proj.weight"] = rand(h, f)
    return out


def _write_view(out: Path, shards: Path, layers: int, weight_map: dict, cache_dir: Path) -> None:
    """A model directory of `layers` layers whose shards are symlinks into `shards`."""
    from bench.qwen_tokenizer import write_qwen_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    keep = {"model-embed.safetensors"} | {f"model-layer-{i:03d}.safetensors" for i in range(layers)}
    for name in keep:
        link = out / name
        if not link.exists():
            link.symlink_to(shards / name)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: v for k, v in weight_map.items() if v in keep}}, indent=1))
    (out / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": layers}, indent=2))
    write_qwen_tokenizer(out, cache_dir=cache_dir, model_max_length=QWEN3_30B_A3B["max_position_embeddings"])


def build_checkpoints(work: Path, layer_counts: list[int]) -> dict[int, Path]:
    """{layers: model dir} for each count, all sharing the shards of the largest (built once)."""
    import torch
    from safetensors.torch import save_file

    top = max(layer_counts)
    shards = work / "qwen3-30b-a3b-shards"
    shards.mkdir(parents=True, exist_ok=True)
    marker = shards / MARKER
    recipe = {"config": QWEN3_30B_A3B, "seed": SEED, "std": STD, "layers": top, "v": 1}
    built = (json.loads(marker.read_text()) if marker.exists() else {}).get("recipe", {})
    if {**built, "layers": top} != recipe or built["layers"] < top:        # a view may use fewer layers
        t0 = time.perf_counter()
        generator = torch.Generator().manual_seed(SEED)
        cfg = QWEN3_30B_A3B
        h, vocab = cfg["hidden_size"], cfg["vocab_size"]
        weight_map = {}
        head = {"model.embed_tokens.weight": (torch.randn(vocab, h, generator=generator) * STD).to(torch.bfloat16),
                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                "lm_head.weight": (torch.randn(vocab, h, generator=generator) * STD).to(torch.bfloat16)}
        save_file(head, str(shards / "model-embed.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(head, "model-embed.safetensors"))
        del head
        for i in range(top):
            tensors = _layer_tensors(cfg, i, generator)
            name = f"model-layer-{i:03d}.safetensors"
            save_file(tensors, str(shards / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
            del tensors
            log(f"  layer {i} written ({time.perf_counter() - t0:.0f} s)")
        (shards / "weight_map.json").write_text(json.dumps(weight_map))
        marker.write_text(json.dumps({"recipe": recipe}))
        log(f"  {top}-layer random checkpoint in {shards} ({time.perf_counter() - t0:.0f} s)")
    weight_map = json.loads((shards / "weight_map.json").read_text())
    dirs = {}
    for n in layer_counts:
        d = work / f"qwen3-30b-a3b-{n}layers"
        _write_view(d, shards, n, weight_map, cache_dir=work)
        dirs[n] = d
    return dirs


# ---- 2. GGUF ----------------------------------------------------------------------------------------
def make_q4_gguf(model_dir: Path, work: Path, threads: int) -> Path:
    """bf16 GGUF by convert_hf_to_gguf.py, then Q4_0 with Q8_0 embedding/output by llama_model_quantize."""
    from bench.llamacpp_gguf import convert, converter_pythonpath, extract_converter, find_or_download_sdist
    gdir = work / "gguf"
    gdir.mkdir(parents=True, exist_ok=True)
    out = gdir / f"{model_dir.name}-Q4_0-q8head.gguf"
    if out.exists():
        return out
    llama_dir = extract_converter(find_or_download_sdist(work, log=log), work)
    bf16 = convert(model_dir, gdir / f"{model_dir.name}-BF16.gguf", "bf16", llama_dir,
                   converter_pythonpath(work, llama_dir, log), log)
    code = (
        "import sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0\n"
        "p.output_tensor_type = llama_cpp.GGML_TYPE_Q8_0\n"
        "p.token_embedding_type = llama_cpp.GGML_TYPE_Q8_0\n"
        "p.pure = True\n"
        f"p.nthread = {int(threads)}\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n")
    tmp = out.with_name(out.name + ".part")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, str(bf16), str(tmp)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"llama_model_quantize failed ({res.returncode}): {res.stderr[-2000:]}")
    tmp.rename(out)
    bf16.unlink()        # 6 GB the benchmark no longer needs
    log(f"  {out.name}: quantized in {time.perf_counter() - t0:.0f} s")
    return out


# ---- 3. workers (one measurement per process) ----------------------------------------------------
def worker_llama(args) -> dict:
    from bench.no_amx import deny_amx
    amx = deny_amx()
    import llama_cpp
    from llama_cpp import Llama
    n_ctx = args.context + args.gen + 64
    mem0 = _memory()
    t0 = time.perf_counter()
    llm = Llama(model_path=str(args.gguf), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=n_ctx,
                n_batch=512, n_ubatch=512, verbose=False)
    res = {"engine": "llama.cpp", "version": llama_cpp.__version__, "amx": amx, "load_s": time.perf_counter() - t0,
           "mem_before_load": mem0, "mem_after_load": _memory()}
    llm.eval(_tokens(1, 5))
    llm.eval(_tokens(1, 6))
    res["mem_first_token"] = _memory()
    llm.reset()
    t = time.perf_counter()
    llm.eval(_tokens(args.context, 9))
    res["prefill_cold_tokens_per_s"] = args.context / (time.perf_counter() - t)
    llm.reset()
    t = time.perf_counter()
    llm.eval(_tokens(args.context, 1))
    res["prefill_tokens_per_s"] = args.context / (time.perf_counter() - t)
    steps, cpu = [], []
    for tok in _tokens(args.gen, 2):
        t, c = time.perf_counter(), time.process_time()
        llm.eval([tok])
        steps.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    res.update(decode_ms_per_token=1e3 * _median(steps), decode_cpu_ms_per_token=1e3 * _median(cpu),
               steps_s=steps, mem_end=_memory())
    return res


def worker_ours(args) -> dict:
    from appliance import Engine
    from appliance.cli.bench import measure
    from appliance.kernels.dispatch import kernels
    from appliance.engine.stats import DecodeStats
    mem0 = _memory()
    t0 = time.perf_counter()
    engine = Engine.load(str(args.model), kv="q8", threads=args.threads,
                         max_context=args.context + args.gen + 64, progress=False)
    load_s = time.perf_counter() - t0
    if args.prepare:
        return {"load_s": load_s, "weights": engine.weights}
    model, use = engine.model, engine.model.expert_use
    res = {"engine": "ours", "weights": engine.weights, "kernel_path": kernels.kernel_path(), "load_s": load_s,
           "weight_bytes": engine.weight_bytes, "expert_bytes": model.expert_bytes,
           "mem_before_load": mem0, "mem_after_load": _memory()}
    measure(engine, 1, 2, salt=5)                 # a one-token prompt and its first decoded token
    res.update(mem_first_token=_memory(), experts_run_share_first_token=use.share_ever_ran)
    # The first long prompt pages in most experts (llama.cpp read them all while loading).
    cold, _ = measure(engine, args.context, 1, salt=9)
    res["prefill_cold_tokens_per_s"] = args.context / cold.total_s
    per_step, cpu_marks = [], []

    def on_step(stats) -> None:
        cpu_marks.append(time.process_time())        # CPU time of the process at the end of each step
        if isinstance(stats, DecodeStats):
            per_step.append(use.experts_per_token)

    engine.add_stats_listener(on_step)
    prefill, steps = measure(engine, args.context, args.gen)
    res.update(prefill_tokens_per_s=args.context / prefill.total_s,
               decode_ms_per_token=1e3 * _median([s.total_s for s in steps]),
               decode_cpu_ms_per_token=1e3 * _median([b - a for a, b in zip(cpu_marks, cpu_marks[1:])]),
               attn_ms_per_token=1e3 * _median([s.attn_s for s in steps]),
               steps_s=[s.total_s for s in steps], experts_per_token=_median(per_step),
               experts_run_share=use.share_ever_ran, mem_end=_memory())
    return res


WORKERS = {"llama": worker_llama, "ours": worker_ours}


def wait_for_quiet(max_load: float, timeout_s: float) -> None:
    """Wait (at most timeout_s) until the 1-minute load average drops below max_load."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < timeout_s:
        time.sleep(10)


def run_worker(kind: str, args, extra: list[str], out: Path) -> dict:
    if getattr(args, "quiet_load", 0):
        wait_for_quiet(args.quiet_load, args.quiet_timeout)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--out", str(out),
           "--threads", str(args.threads), "--context", str(args.context), "--gen", str(args.gen), *extra]
    load = os.getloadavg()[0]
    out.unlink(missing_ok=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"worker {kind} failed with exit code {proc.returncode}"}
    res = json.loads(out.read_text())
    res["loadavg"] = (load, os.getloadavg()[0])
    return res


# ---- 4. the report --------------------------------------------------------------------------------
def _value(res: dict, key: str) -> float:
    """res[key], or res["mem_end"]["anon"] for key "mem_end.anon"."""
    for part in key.split("."):
        res = res[part]
    return res


def extrapolate(small: dict | None, big: dict, n_small: int, n_big: int, key: str) -> tuple[float, float, float]:
    """(fixed, per_layer, value at 48 layers) of `key` from t(L) = fixed + L * per_layer."""
    if small is None or "error" in small:
        return float("nan"), float("nan"), float("nan")
    per_layer = (_value(big, key) - _value(small, key)) / (n_big - n_small)
    fixed = _value(big, key) - n_big * per_layer
    return fixed, per_layer, fixed + FULL_LAYERS * per_layer


def report(results: dict, layer_counts: list[int], meta: dict, rounds: dict | None = None) -> str:
    n_big = max(layer_counts)
    n_small = min(layer_counts) if len(layer_counts) > 1 else None
    lines = [f"Qwen3-30B-A3B-shaped random checkpoint (128 experts, top-8, 2048 hidden), {meta['threads']} threads, "
             f"{meta['machine']}",
             f"decode: median of {meta['gen']} steps after a {meta['context']}-token prompt; prefill: that prompt; "
             f"fastest of {meta['rounds']} alternating runs per engine",
             "ours: q4 weights (Q4_0 experts/attention, Q8_0 embedding/lm_head, f32 router), q8 KV, experts mmap'd",
             "llama.cpp: same formats (GGUF Q4_0 pure, Q8_0 token_embd/output, F32 ffn_gate_inp), f16 KV, "
             "mmap + weight repacking (defaults)", ""]
    head = (f"{'layers':>6} | {'engine':>9} | {'decode ms/tok':>13} | {'CPU ms/tok':>10} | {'prefill tok/s':>13} | "
            f"{'cold':>6} | "
            f"{'experts/tok':>11} | {'RSS MiB: load':>13} | {'1st tok':>7} | {'end':>5} | {'end anon':>8} | "
            f"{'experts run':>11} | load avg")
    lines += [head, "-" * len(head)]
    for n in layer_counts:
        for name in ("ours", "llama"):
            r = results.get((name, n))
            label = "ours" if name == "ours" else "llama.cpp"
            if r is None:
                continue
            if "error" in r:
                lines.append(f"{n:>6} | {label:>9} | {r['error']}")
                continue
            ept = f"{r['experts_per_token']:.0f}" if "experts_per_token" in r else "-"
            share = f"{100 * r['experts_run_share']:.0f}%" if "experts_run_share" in r else "-"
            mem = [r["mem_after_load"]["rss"], r["mem_first_token"]["rss"], r["mem_end"]["rss"], r["mem_end"]["anon"]]
            lines.append(f"{n:>6} | {label:>9} | {r['decode_ms_per_token']:>13.1f} | "
                         f"{r.get('decode_cpu_ms_per_token', float('nan')):>10.1f} | "
                         f"{r['prefill_tokens_per_s']:>13.1f} | {r['prefill_cold_tokens_per_s']:>6.1f} | {ept:>11} | "
                         f"{mem[0] / MB:>13.0f} | {mem[1] / MB:>7.0f} | {mem[2] / MB:>5.0f} | {mem[3] / MB:>8.0f} | "
                         f"{share:>11} | {r['loadavg'][0]:.1f}/{r['loadavg'][1]:.1f}")
    if rounds and meta.get("rounds", 1) > 1:
        lines.append("decode ms/token of every round: " + "; ".join(
            f"{'ours' if name == 'ours' else 'llama.cpp'} {n}L "
            + ", ".join(f"{r['decode_ms_per_token']:.1f}" if "error" not in r else "failed" for r in runs)
            for (name, n), runs in sorted(rounds.items(), key=lambda kv: (kv[0][1], kv[0][0]))))
    ours, llama = results.get(("ours", n_big)), results.get(("llama", n_big))
    if ours and llama and "error" not in ours and "error" not in llama:
        lines.append(f"\n{n_big} layers: ours / llama.cpp decode = "
                     f"{ours['decode_ms_per_token'] / llama['decode_ms_per_token']:.2f}x")
    if n_small is not None:
        lines += ["", f"extrapolated to {FULL_LAYERS} layers (t(L) = fixed + L * per layer, from {n_small} and "
                      f"{n_big} layers)"]
        for name, label in (("ours", "ours"), ("llama", "llama.cpp")):
            small, big = results.get((name, n_small)), results.get((name, n_big))
            if not big or "error" in big:
                continue
            fixed, per, full = extrapolate(small, big, n_small, n_big, "decode_ms_per_token")
            lines.append(f"  {label:>9} decode: {fixed:.1f} ms fixed (embedding, lm_head, sampling) + "
                         f"{per:.2f} ms/layer -> {full:.0f} ms/token at {FULL_LAYERS} layers ({1e3 / full:.1f} tok/s)")
            fixed, per, full = extrapolate(small, big, n_small, n_big, "decode_cpu_ms_per_token")
            lines.append(f"  {label:>9} decode CPU time: {fixed:.1f} ms fixed + {per:.2f} ms/layer -> "
                         f"{full:.0f} ms/token at {FULL_LAYERS} layers")
            for key, what in (("mem_first_token.rss", "RSS after one token"), ("mem_end.rss", "RSS at the end"),
                              ("mem_end.anon", "of which anonymous")):
                fixed, per, full = extrapolate(small, big, n_small, n_big, key)
                lines.append(f"  {label:>9} {what}: {fixed / MB:.0f} MiB + {per / MB:.0f} MiB/layer -> "
                             f"{full / 2**30:.1f} GiB at {FULL_LAYERS} layers")
            if name == "ours":
                fixed, per, full = extrapolate(small, big, n_small, n_big, "weight_bytes")
                lines.append(f"  {label:>9} weights (all experts): {full / 2**30:.1f} GiB at {FULL_LAYERS} layers "
                             f"({per / MB:.0f} MiB per layer, {fixed / MB:.0f} MiB embedding + lm_head)")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/appliance-bench"))
    ap.add_argument("--layers", type=int, default=4, help="layers of the benchmark checkpoint (default 4)")
    ap.add_argument("--small-layers", type=int, default=2,
                    help="layers of the second view for the per-layer slope (0: none; default 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before decoding (default 128)")
    ap.add_argument("--gen", type=int, default=32, help="decode steps timed (default 32)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating runs of each engine; the fastest is reported (default 3)")
    ap.add_argument("--quiet-load", type=float, default=0,
                    help="before each run, wait until the 1-minute load average is below this (default: no wait)")
    ap.add_argument("--quiet-timeout", type=float, default=600, help="longest wait for --quiet-load, s (default 600)")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        res = WORKERS[args.worker](args)
        args.out.write_text(json.dumps(res, indent=1))
        return 0
    work = args.workdir
    results_dir = work / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    layer_counts = sorted({args.layers} | ({args.small_layers} if 0 < args.small_layers < args.layers else set()))
    log(f"[1/3] checkpoints with {layer_counts} layers, and their GGUF")
    dirs = build_checkpoints(work, layer_counts)
    ggufs = {} if args.skip_llama else {n: make_q4_gguf(dirs[n], work, args.threads) for n in layer_counts}
    if not args.skip_ours:
        for n in layer_counts:
            log(f"[2/3] {n} layers: our first load quantizes into {dirs[n]}/.appliance-cache (if not there)")
            prep = run_worker("ours", args, ["--model", str(dirs[n]), "--prepare"], results_dir / f"moe-prep-{n}.json")
            if "error" in prep:
                raise SystemExit(f"our engine failed to load {dirs[n]}: {prep['error']}")
    # On a shared machine every run is slowed by whatever else runs: the engines alternate,
    # `--rounds` times, and each keeps its fastest round (all rounds are in the JSON).
    results, rounds = {}, {}
    for r in range(args.rounds):
        for n in layer_counts:
            runs = ([] if args.skip_llama else [("llama", ["--gguf", str(ggufs[n])])]) + \
                   ([] if args.skip_ours else [("ours", ["--model", str(dirs[n])])])
            for name, extra in runs:
                log(f"[3/3] round {r + 1}/{args.rounds}, {n} layers: {name}")
                res = run_worker(name, args, extra, results_dir / f"moe-{name}-{n}.json")
                rounds.setdefault((name, n), []).append(res)
                best = results.get((name, n))
                if best is None or "error" in best or (
                        "error" not in res and res["decode_ms_per_token"] < best["decode_ms_per_token"]):
                    results[(name, n)] = res
    meta = {"threads": args.threads, "gen": args.gen, "context": args.context, "rounds": args.rounds,
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        meta["machine"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                               if line.startswith("model name")) + f", {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        pass
    print(report(results, layer_counts, meta, rounds))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "best": {f"{k[0]}-{k[1]}": v for k, v in results.items()},
                                         "rounds": {f"{k[0]}-{k[1]}": v for k, v in rounds.items()}}, indent=1))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
