"""Decode attention's memory bandwidth against the weight GEMVs', cold, as one decode step meets them.

    .venv/bin/python bench/attention_bandwidth_bench.py [--context 4096] [--threads 2] [--repeats 5]
                                                        [--clock wall|cpu] [--kv q8|q4] [--scatter]
                                                        [--attention-variant NAME|all]
    .venv/bin/python bench/attention_bandwidth_bench.py --shape tiny --repeats 1      # checks the script

Qwen3-0.6B's decode step, kernel by kernel: per layer its four Q8_0 GEMVs (qkv, o, gate_up, down:
21 MB) then its attention over `context` tokens of q8 KV (8 kv heads, head_dim 128, group 2: 8.6 MB
at 4096), 28 layers, each array read once per step as in the engine, so neither finds its bytes in a
cache (842 MB in all at 4096). GB/s = bytes read / time, per kind, summed over the step; the median
step over the repeats is reported, and the ratio attention / GEMV, whose target is >= 0.80
(docs/performance.md). --clock cpu (with --threads 1) times the thread's CPU time, which leaves out
the time other processes held the core; memory stalls still count. The block table is the pool's
order for one sequence (consecutive blocks) unless --scatter.
The GEMVs run in the layout the engine holds its weights in on this CPU: strips where it packs them
(appliance/weights/linear.py, `strips_wanted`), which stream faster than rows, and side by side in
huge pages where the engine copies them there (appliance/weights/hugepages.py); `--layout rows`
times the row layout instead. Attention runs the instantiation the kernels chose for this CPU
(attention_variant); `--attention-variant all` times every one this CPU runs, taking turns step by
step, each with its own row and ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from appliance.kernels import _kernels as K
from appliance.kernels import quant
from appliance.weights import hugepages
from appliance.weights.linear import strips_wanted

TARGET = 0.80


@dataclass
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = {"0.6b": Shape(28, 1024, 3072, 16, 8, 128), "tiny": Shape(2, 256, 512, 4, 2, 64)}


def layer_weights(rng, s: Shape):
    """The four GEMVs of one layer as (wq int8[N, K], wd float16[N, K/32]); random bytes (the cost does
    not depend on the values)."""
    shapes = [((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), (s.hidden, s.heads * s.head_dim),
              (2 * s.intermediate, s.hidden), (s.hidden, s.intermediate)]
    return [(rng.integers(-127, 128, (n, k), dtype=np.int8),
             (rng.random((n, k // 32), dtype=np.float32) * 0.01).astype(np.float16)) for n, k in shapes]


@dataclass
class Gemv:
    """One weight matrix as the benchmark runs it: n outputs, the bytes a pass reads, and
    run(xq, xd, out) on the first K columns of the quantized activation row."""
    n: int
    nbytes: int
    run: object


def stored(weights: list[tuple[np.ndarray, np.ndarray]], strips: bool) -> list[tuple]:
    """Each (wq, wd) as the engine holds it: (ws,) in strips or (wq, wd) in rows, and, where the
    engine copies the matrices a step streams into huge pages, side by side in one arena there
    (appliance/weights/hugepages.py)."""
    held = [(K.pack_strips(wq, wd, False),) if strips else (wq, wd) for wq, wd in weights]
    if not hugepages.wanted():
        return held
    flat = iter(hugepages.copies([a for arrays in held for a in arrays]))
    return [tuple(next(flat) for _ in arrays) for arrays in held]


def make_gemv(n: int, kk: int, arrays: tuple, threads: int) -> Gemv:
    """The Q8_0 GEMV of an n x kk matrix held as stored() gives it: (ws,) in strips or (wq, wd)."""
    if len(arrays) == 1:
        ws, = arrays
        return Gemv(n, ws.nbytes, lambda xq, xd, out: K.gemm_strips(
            ws, n, kk, False, xq[:, :kk], xd[:, :kk // 32], out=out, threads=threads))
    wq, wd = arrays
    return Gemv(n, wq.nbytes + wd.nbytes, lambda xq, xd, out: K.gemm_q8(
        wq, wd, xq[:, :kk], xd[:, :kk // 32], out=out, threads=threads))


def layer_caches(rng, s: Shape, context: int, kv: str, bs: int = 32):
    """Every layer's (k, ks, v, vs), each field one array for all layers as the engine's pool holds
    it (engine/kv_cache.py): numpy asks for 2 MB pages for an array that large, and a layer's own
    4 MB array would sit partly on 4 KB pages (decode attention at 4096 then took 9.5 instead of
    8.2 ms a step, Zen 4)."""
    nblk = -(-context // bs)
    shape = (s.layers, nblk, s.kv_heads, bs, s.head_dim)
    if kv == "q8":
        k = rng.integers(-127, 128, shape, dtype=np.int8)
        v = rng.integers(-127, 128, shape, dtype=np.int8)
        ks = (rng.random(shape[:4], dtype=np.float32) * 0.05).astype(np.float32)
        vs = (rng.random(shape[:4], dtype=np.float32) * 0.05).astype(np.float32)
    else:
        k = rng.integers(0, 256, shape[:4] + (s.head_dim // 2,), dtype=np.uint8)
        v = rng.integers(0, 256, shape[:4] + (s.head_dim // 2,), dtype=np.uint8)
        ks = (rng.random(shape[:4] + (s.head_dim // 32,), dtype=np.float32) * 0.05).astype(np.float32)
        vs = (rng.random(shape[:4] + (s.head_dim // 32,), dtype=np.float32) * 0.05).astype(np.float32)
    return [(k[i], ks[i], v[i], vs[i]) for i in range(s.layers)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--kv", choices=["q8", "q4"], default="q8")
    ap.add_argument("--scatter", action="store_true", help="blocks at random places in the pool")
    ap.add_argument("--layout", choices=["engine", "rows", "strips"], default="engine",
                    help="the GEMVs' weight layout (engine: as the engine holds them on this CPU)")
    ap.add_argument("--attention-variant", default=None,
                    help=f"attention instantiation, or all (this CPU: {', '.join(K.attention_variants())})")
    args = ap.parse_args(argv)
    variants = (K.attention_variants() if args.attention_variant == "all"
                else [args.attention_variant or K.attention_variant()])
    for name in variants:
        if name not in K.attention_variants():
            ap.error(f"attention variant {name!r} is not one this build and CPU run: "
                     f"{', '.join(K.attention_variants())}")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times the calling thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    s = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    bs = 32
    strips = args.layout == "strips" or (args.layout == "engine" and strips_wanted())
    print(f"shape {args.shape}: {s.layers} layers, context {args.context}, {args.kv} KV, {args.threads} threads, "
          f"kernel path {K.kernel_path()} (attention {', '.join(variants)}), GEMV weights in {'strips' if strips else 'rows'}"
          f"{' in huge pages' if hugepages.wanted() else ''}, "
          f"load average {os.getloadavg()[0]:.2f}")
    weights = [layer_weights(rng, s) for _ in range(s.layers)]
    held = iter(stored([w for layer in weights for w in layer], strips))
    gemvs = [[make_gemv(*wq.shape, next(held), args.threads) for wq, _ in layer] for layer in weights]
    caches = layer_caches(rng, s, args.context, args.kv, bs)
    nblk = -(-args.context // bs)
    table = (rng.permutation(nblk) if args.scatter else np.arange(nblk)).astype(np.int32)
    blockpos = np.arange(nblk, dtype=np.int32)
    count = np.full(nblk, bs, np.int32)
    count[-1] = args.context - (nblk - 1) * bs
    qpos = np.array([args.context - 1], np.int32)
    q = rng.standard_normal((1, s.heads, s.head_dim)).astype(np.float32)
    xq, xd = quant.quantize_rows_q8(rng.standard_normal((1, max(s.hidden, s.intermediate, s.heads * s.head_dim)))
                                    .astype(np.float32))
    attend = K.attention_q8 if args.kv == "q8" else K.attention_q4
    scale = 1.0 / np.sqrt(s.head_dim)
    kv_bytes = sum(k.nbytes + ks.nbytes + v.nbytes + vs.nbytes for k, ks, v, vs in caches)
    w_bytes = sum(g.nbytes for layer in gemvs for g in layer)
    outs = [np.empty((1, g.n), np.float32) for g in gemvs[0]]
    attn_out = np.empty_like(q)

    def step():
        t_gemv = t_attn = 0.0
        for layer in range(s.layers):
            t0 = clock()
            for g, out in zip(gemvs[layer], outs):
                g.run(xq, xd, out)
            t1 = clock()
            k, ks, v, vs = caches[layer]
            attend(q, k, ks, v, vs, table, blockpos, count, qpos, scale, out=attn_out, threads=args.threads)
            t_attn += clock() - t1
            t_gemv += t1 - t0
        return t_gemv, t_attn

    default_variant = K.attention_variant()
    times = {name: [] for name in variants}
    try:
        for name in variants:
            K.set_attention_variant(name)
            step()                             # page faults, the pool's workers
        for _ in range(args.repeats):
            for name in variants:              # in turns, so drift in the machine meets every one
                K.set_attention_variant(name)
                times[name].append(step())
    finally:
        K.set_attention_variant(default_variant)
    gemv = statistics.median(t for name in variants for t, _ in times[name])
    gemv_bw = w_bytes / gemv / 1e9
    print()
    print(f"{'kind':<24} {'MB read':>9} {'ms/step':>9} {'GB/s':>7}   (median of {args.repeats} steps, {args.clock} clock)")
    print(f"{'GEMV':<24} {w_bytes / 1e6:>9.1f} {1e3 * gemv:>9.2f} {gemv_bw:>7.2f}")
    ratios = {}
    for name in variants:
        attn = statistics.median(t for _, t in times[name])
        ratios[name] = kv_bytes / attn / 1e9 / gemv_bw
        print(f"{'attention ' + name:<24} {kv_bytes / 1e6:>9.1f} {1e3 * attn:>9.2f} {kv_bytes / attn / 1e9:>7.2f}")
    print()
    for name, ratio in ratios.items():
        print(f"attention ({name}) bandwidth / GEMV bandwidth: {ratio:.2f} "
              f"(target >= {TARGET:.2f}: {'MET' if ratio >= TARGET else 'MISSED'})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
