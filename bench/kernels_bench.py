"""Kernel timings: simd vs portable, medians of repeats, as a table.

    .venv/bin/python bench/kernels_bench.py [--threads 2] [--repeats 7] [--no-portable]
                                            [--only gemm|attn|elem] [--clock wall|cpu]
                                            [--gemm-variant rows|avx2|avx512-vnni|...]

GEMV rows report weight bandwidth (GB/s of weights + scales read), GEMM rows GOPS
(2 * M * N * K / s), attention rows KV bandwidth (GB/s of K, V and their scales read),
all computed from the median; a "strips" row times the same product from weights packed in
strips (where the CPU has that micro-kernel, as engines then use). The best repeat is printed
too, and the load average: on a shared machine a parallel region waits for a busy core, and
the median shows it.
--clock cpu (with --threads 1) times the calling thread's CPU time instead of the wall
clock: on a machine shared with other jobs it leaves out the time the kernel was not
running (it still pays for the caches the neighbours evicted).
Shapes are Qwen3-0.6B's (hidden 1024, intermediate 3072, vocab 151936, 8 kv heads,
head_dim 128). Portable is skipped where it would take long (prefill GEMMs of big M).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from appliance.kernels import _kernels as K
from appliance.kernels import quant


CLOCK = time.perf_counter


def median_time(fn, repeats: int, min_time: float = 0.05) -> tuple[float, float]:
    """(median, best) seconds per call over `repeats` timed batches."""
    fn()                                            # warm caches, the pool's workers, page faults
    inner = 1
    t0 = CLOCK()
    fn()
    once = CLOCK() - t0
    if once < min_time / 10:
        inner = max(1, int(min_time / 10 / max(once, 1e-7)))
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        for _ in range(inner):
            fn()
        times.append((CLOCK() - t0) / inner)
    return statistics.median(times), min(times)


def weights(rng, n, k, fmt):
    # Random int8/nibbles directly: quantizing 150M floats would dominate the bench's run time.
    if fmt == "q8":
        wq = rng.integers(-127, 128, (n, k), dtype=np.int8)
    else:
        wq = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    wd = (rng.random((n, k // 32), dtype=np.float32) * 0.01).astype(np.float16)
    return wq, wd


def bench_gemm(rows, rng, threads, repeats, do_portable):
    shapes = [
        # (label, M, N, K)
        ("gemv qkv-ish", 1, 3072, 1024),
        ("gemv down", 1, 1024, 3072),
        ("gemv lm_head", 1, 151936, 1024),
        ("gemm prefill", 512, 3072, 1024),
        ("gemm prefill down", 512, 1024, 3072),
        ("gemm M=4", 4, 3072, 1024),             # decode steps of a batch: the row route
        ("gemm M=8", 8, 3072, 1024),
        ("gemm M=16", 16, 3072, 1024),
    ]
    for fmt in ("q8", "q4"):
        fn = K.gemm_q8 if fmt == "q8" else K.gemm_q4
        for label, m, n, k in shapes:
            wq, wd = weights(rng, n, k, fmt)
            xq, xd = quant.quantize_rows_q8(rng.standard_normal((m, k)).astype(np.float32))
            out = np.empty((m, n), np.float32)
            wbytes = wq.nbytes + wd.nbytes
            for path in ("simd", "portable"):
                if path == "portable" and (not do_portable or m * n * k > 2e8):
                    continue
                t, best = median_time(lambda: fn(wq, wd, xq, xd, out=out, path=path, threads=threads),
                                repeats if m * n * k < 1e9 else max(3, repeats // 2))
                if m == 1:
                    rate = f"{wbytes / t / 1e9:7.1f} GB/s"
                else:
                    rate = f"{2 * m * n * k / t / 1e9:7.1f} GOPS"
                rows.append((f"{fmt} {label}", f"M={m} N={n} K={k}", path, t, best, rate))
            if K.strips_fast():     # the same product from weights in strips (what engines use here)
                ws = K.pack_strips(wq, wd, fmt == "q4")
                t, best = median_time(lambda: K.gemm_strips(ws, n, k, fmt == "q4", xq, xd, out=out, threads=threads),
                                      repeats if m * n * k < 1e9 else max(3, repeats // 2))
                rate = f"{ws.nbytes / t / 1e9:7.1f} GB/s" if m == 1 else f"{2 * m * n * k / t / 1e9:7.1f} GOPS"
                rows.append((f"{fmt} {label}", f"M={m} N={n} K={k}", "strips", t, best, rate))


def bench_attention(rows, rng, threads, repeats, do_portable):
    n_kv, group, hd, bs = 8, 2, 128, 32
    for kind in ("q8", "q4"):
        for ctx, T in ((512, 1), (4096, 1), (512, 512)):
            nblk = -(-ctx // bs)
            if kind == "q8":
                k = rng.integers(-127, 128, (nblk, n_kv, bs, hd), dtype=np.int8)
                ks = rng.random((nblk, n_kv, bs), dtype=np.float32) * 0.05
            else:
                k = rng.integers(0, 256, (nblk, n_kv, bs, hd // 2), dtype=np.uint8)
                ks = rng.random((nblk, n_kv, bs, hd // 32), dtype=np.float32) * 0.05
            v, vs = k.copy(), ks.copy()
            table = rng.permutation(nblk).astype(np.int32)
            blockpos = np.arange(nblk, dtype=np.int32)
            count = np.full(nblk, bs, np.int32)
            count[-1] = ctx - (nblk - 1) * bs
            qpos = np.arange(ctx - T, ctx, dtype=np.int32)
            q = rng.standard_normal((T, n_kv * group, hd)).astype(np.float32)
            out = np.empty_like(q)
            fn = K.attention_q8 if kind == "q8" else K.attention_q4
            kv_bytes = k.nbytes + v.nbytes + ks.nbytes + vs.nbytes
            for path in ("simd", "portable"):
                if path == "portable" and (not do_portable or T > 1):
                    continue
                t, best = median_time(lambda: fn(q, k, ks, v, vs, table, blockpos, count, qpos,
                                           1 / np.sqrt(hd), out=out, path=path, threads=threads),
                                repeats if T == 1 else 3)
                if T == 1:
                    rate = f"{kv_bytes / t / 1e9:7.1f} GB/s"
                else:   # causal prefill: T*(T+1)/2 rows per (query head), 2 dots of hd each
                    ops = 2 * 2 * hd * n_kv * group * T * (T + 1) / 2
                    rate = f"{ops / t / 1e9:7.1f} GOPS"
                rows.append((f"attn {kind} x1 layer", f"T={T} ctx={ctx} kv=8x128 g=2", path, t, best, rate))


def bench_elementwise(rows, rng, repeats):
    x = rng.standard_normal((512, 3072)).astype(np.float32)
    u = rng.standard_normal((512, 3072)).astype(np.float32)
    out = np.empty_like(x)
    for path in ("simd", "portable"):
        t, best = median_time(lambda: K.silu_mul(x, u, out=out, path=path), repeats)
        rows.append(("silu_mul", "512x3072", path, t, best, f"{x.size / t / 1e9:7.2f} Gelem/s"))
    h = rng.standard_normal((512, 1024)).astype(np.float32)
    w = rng.standard_normal(1024).astype(np.float32)
    ho = np.empty_like(h)
    for path in ("simd", "portable"):
        t, best = median_time(lambda: K.rmsnorm(h, w, 1e-6, out=ho, path=path), repeats)
        rows.append(("rmsnorm", "512x1024", path, t, best, f"{h.size / t / 1e9:7.2f} Gelem/s"))
    qr = rng.standard_normal((512, 16, 128)).astype(np.float32)
    pos = np.arange(512, dtype=np.int32)
    inv = (1.0 / (1e6 ** (np.arange(0, 128, 2, dtype=np.float32) / 128))).astype(np.float32)
    for path in ("simd", "portable"):
        t, best = median_time(lambda: K.rope(qr, pos, inv, path=path), repeats)
        rows.append(("rope", "512x16x128", path, t, best, f"{qr.size / t / 1e9:7.2f} Gelem/s"))
    xa = rng.standard_normal((1, 1024)).astype(np.float32)
    for path in ("simd", "portable"):
        t, best = median_time(lambda: K.quantize_rows_q8(xa, path=path), repeats)
        rows.append(("quantize_rows_q8", "1x1024 (call cost)", path, t, best, ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-portable", action="store_true", help="simd rows only")
    ap.add_argument("--only", choices=("gemm", "attn", "elem"), help="one section")
    ap.add_argument("--gemm-variant", help="the GEMM micro-kernel to time (one of kernels' gemm_variants(); "
                                           "default: the one this CPU chose)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (only meaningful with --threads 1)")
    args = ap.parse_args(argv)
    global CLOCK
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu measures the calling thread only: use --threads 1")
        CLOCK = time.thread_time
    if args.gemm_variant:
        try:
            K.set_gemm_variant(args.gemm_variant)
        except ValueError as e:
            ap.error(str(e))
    rng = np.random.default_rng(0)
    rows: list[tuple] = []
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"kernel_path={K.kernel_path()} gemm_variant={K.gemm_variant()} cpu_features='{K.cpu_features()}' "
          f"threads={args.threads} "
          f"clock={args.clock} cpus={os.cpu_count()} loadavg={load}")
    if args.only in (None, "gemm"):
        bench_gemm(rows, rng, args.threads, args.repeats, not args.no_portable)
    if args.only in (None, "attn"):
        bench_attention(rows, rng, args.threads, args.repeats, not args.no_portable)
    if args.only in (None, "elem"):
        bench_elementwise(rows, rng, args.repeats)
    print(f"| {'kernel':24s} | {'shape':28s} | {'path':8s} | {'median ms':>10s} | {'best ms':>10s} "
          f"| {'rate (median)':>16s} |")
    print(f"|{'-' * 26}|{'-' * 30}|{'-' * 10}|{'-' * 12}|{'-' * 12}|{'-' * 18}|")
    for name, shape, path, t, best, rate in rows:
        print(f"| {name:24s} | {shape:28s} | {path:8s} | {t * 1e3:10.3f} | {best * 1e3:10.3f} | {rate:>16s} |")


if __name__ == "__main__":
    main()
