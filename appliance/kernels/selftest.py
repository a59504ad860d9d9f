"""`appliance selftest`: does this machine compute what the portable reference computes?

Runs every compiled kernel on random inputs through the build's SIMD path and
through the portable C path, compares them (integer outputs bit for bit, float
outputs within named tolerances), and reports the active path, the CPU features,
the big cores and the thread count the engine would use. Exit 0 only if all agree.
Ansible runs it on every board after building, before (re)starting the service.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from appliance.kernels import cpu

GEMM_RTOL = 1e-4        # float sums in a different order
FLOAT_RTOL = 1e-5       # rmsnorm, rope, silu
ATTENTION_ATOL = 2e-4   # online softmax in a different blocking


def _checks(k, rng):
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    x = rand(5, 1024)
    q_simd, d_simd = k.quantize_rows_q8(x, path="simd")
    q_port, d_port = k.quantize_rows_q8(x, path="portable")
    yield "quantize_rows_q8", np.array_equal(q_simd, q_port) and np.array_equal(d_simd, d_port), "bit-exact"

    # Integer parts bit for bit: with unit scales every output is a sum of int32 block dots, exact
    # in float32 whatever the summation order, so SIMD and portable must agree to the bit. The
    # extreme rows (+-127 everywhere) catch overflows of narrow accumulators.
    for name, gemm in (("gemm_q8", k.gemm_q8), ("gemm_q4", k.gemm_q4)):
        for extreme in (False, True):
            n, kk, m = 67, 1024, 5
            if extreme:
                xq = rng.choice(np.array([-127, 127], np.int8), size=(m, kk))
                wq = (rng.choice(np.array([-127, 127], np.int8), size=(n, kk)) if name == "gemm_q8"
                      else rng.choice(np.array([0x00, 0xff, 0x0f, 0xf0], np.uint8), size=(n, kk // 2)))
            else:
                xq = rng.integers(-127, 128, size=(m, kk), dtype=np.int8)
                wq = (rng.integers(-127, 128, size=(n, kk), dtype=np.int8) if name == "gemm_q8"
                      else rng.integers(0, 256, size=(n, kk // 2), dtype=np.uint8))
            wd = np.ones((n, kk // 32), np.float16)
            xd = np.ones((m, kk // 32), np.float32)
            a = gemm(wq, wd, xq, xd, path="simd")
            b = gemm(wq, wd, xq, xd, path="portable")
            same = np.array_equal(a.view(np.uint32), b.view(np.uint32))
            yield (f"{name} int32{' max' if extreme else ''}", same,
                   "bit-exact" if same else f"{int((a != b).sum())} of {a.size} sums differ")

    yield from _gemm_variant_checks(k, rng)

    from appliance.kernels.quant import quantize_q4_0, quantize_q8_0
    w = rand(67, 1024)
    for name, packer, gemm in (("gemm_q8", quantize_q8_0, k.gemm_q8), ("gemm_q4", quantize_q4_0, k.gemm_q4)):
        wq, wd = packer(w)
        for m in (1, 5):
            a = gemm(wq, wd, q_port[:m], d_port[:m], path="simd")
            b = gemm(wq, wd, q_port[:m], d_port[:m], path="portable")
            err = float(np.max(np.abs(a - b) / (np.abs(b).max() + 1e-12)))
            yield f"{name} M={m}", err <= GEMM_RTOL, f"max rel err {err:.1e}"

    norm_w = rand(128)
    h = rand(7, 128)
    a, b = k.rmsnorm(h, norm_w, 1e-6, path="simd"), k.rmsnorm(h, norm_w, 1e-6, path="portable")
    yield "rmsnorm", np.allclose(a, b, rtol=FLOAT_RTOL, atol=1e-6), ""
    heads = rand(3, 4, 128)
    pos = np.array([0, 17, 4000], np.int32)
    inv_freq = (1.0 / 1e6 ** (np.arange(0, 128, 2) / 128)).astype(np.float32)
    a, b = heads.copy(), heads.copy()
    k.rope(a, pos, inv_freq, path="simd")
    k.rope(b, pos, inv_freq, path="portable")
    yield "rope", np.allclose(a, b, rtol=FLOAT_RTOL, atol=1e-5), ""
    g, u = rand(3, 384), rand(3, 384)
    yield "silu_mul", np.allclose(k.silu_mul(g, u, path="simd"), k.silu_mul(g, u, path="portable"),
                                  rtol=FLOAT_RTOL, atol=1e-6), ""

    from appliance.kernels.quant import quantize_kv_q4, quantize_kv_q8
    n_blocks, n_kv, bs, hd, group, ctx = 6, 2, 32, 128, 2, 150
    kf, vf = rand(n_blocks, n_kv, bs, hd), rand(n_blocks, n_kv, bs, hd)
    table = np.array([4, 0, 5, 2, 1], np.int32)
    blockpos = np.arange(5, dtype=np.int32)
    count = np.array([32, 32, 32, 32, ctx - 128], np.int32)
    queries = rand(2, n_kv * group, hd)
    qpos = np.array([ctx - 2, ctx - 1], np.int32)
    scale = 1.0 / np.sqrt(hd)
    for kind in ("q8", "q4", "f32"):
        if kind == "f32":
            args = (kf, vf)
            fn = k.attention_f32
        else:
            pack = quantize_kv_q8 if kind == "q8" else quantize_kv_q4
            (kq, ks), (vq, vs) = pack(kf), pack(vf)
            args = (kq, ks, vq, vs)
            fn = k.attention_q8 if kind == "q8" else k.attention_q4
        a = fn(queries, *args, table, blockpos, count, qpos, scale, path="simd")
        b = fn(queries, *args, table, blockpos, count, qpos, scale, path="portable")
        err = float(np.max(np.abs(a - b)))
        yield f"attention_{kind}", err <= ATTENTION_ATOL and np.isfinite(a).all(), f"max abs err {err:.1e}"

    yield from _attention_variant_checks(k, queries, kf, vf, table, blockpos, count, qpos, scale)

    # Block-sparse attention: the prefill importance kept by the attention pass, and both probes.
    from appliance.kernels.quant import quantize_bound_rows
    (kq, ks), (vq, vs) = quantize_kv_q8(kf), quantize_kv_q8(vf)
    imp = [np.zeros(ctx, np.float32), np.zeros(ctx, np.float32)]
    for path, acc in zip(("simd", "portable"), imp):
        k.attention_q8(queries, kq, ks, vq, vs, table, blockpos, count, qpos, scale, path=path, importance=acc)
    err = float(np.max(np.abs(imp[0] - imp[1])))
    yield "attention importance", err <= ATTENTION_ATOL and np.isfinite(imp[0]).all(), f"max abs err {err:.1e}"
    a, b = (k.attention_probe("q8", queries, kq, ks, table, count, 8, scale, path=path)
            for path in ("simd", "portable"))
    err = float(np.max(np.abs(a - b)))
    yield "attention_probe", err <= ATTENTION_ATOL and np.isfinite(a).all(), f"max abs err {err:.1e}"
    keys = kq.astype(np.float32) * ks[..., None]
    bk, bks = quantize_bound_rows(keys.max(axis=2), keys.min(axis=2))
    a, b = (k.attention_probe_bound("q8", queries, kq, ks, bk, bks, table, count, 2, scale, path=path)
            for path in ("simd", "portable"))
    same = np.array_equal(np.isfinite(a), np.isfinite(b))
    err = float(np.max(np.abs(a[np.isfinite(a)] - b[np.isfinite(b)]))) if same else float("inf")
    yield "attention_probe_bound", same and err <= ATTENTION_ATOL, f"max abs err {err:.1e}"


def _gemm_variant_checks(k, rng):
    """Every GEMM micro-kernel this CPU runs (gemm_variants: the packed route of prefill-sized
    products) against the row route decode runs, bit for bit, on the largest products and on
    random rows and scales; the default kernel is restored afterwards."""
    from appliance.kernels.quant import quantize_q8_0, quantize_rows_q8
    m, n, kk = 40, 67, 1024
    default = k.gemm_variant()
    xq_max = rng.choice(np.array([-127, 127], np.int8), size=(m, kk))
    wq_max = rng.choice(np.array([-127, 127], np.int8), size=(n, kk))
    ones_w, ones_x = np.ones((n, kk // 32), np.float16), np.ones((m, kk // 32), np.float32)
    wq, wd = quantize_q8_0(rng.standard_normal((n, kk)).astype(np.float32))
    xq, xd = quantize_rows_q8(rng.standard_normal((m, kk)).astype(np.float32))
    features = set(k.cpu_features().split())
    for feature, name in (("avxvnni", "avx-vnni"), ("avx512vnni", "avx512-vnni")):
        if feature in features and name not in k.gemm_variants():
            # The kernel runs only once it agreed with the AVX2 one on a known case: it did not.
            yield f"gemm {name}", False, f"this CPU has {feature} but the {name} kernel disagreed with avx2"
    try:
        k.set_gemm_variant("rows")
        want_max = k.gemm_q8(wq_max, ones_w, xq_max, ones_x)
        want = k.gemm_q8(wq, wd, xq, xd)
        for name in k.gemm_variants()[1:]:
            k.set_gemm_variant(name)
            a = k.gemm_q8(wq_max, ones_w, xq_max, ones_x)
            b = k.gemm_q8(wq, wd, xq, xd)
            same = np.array_equal(a.view(np.uint32), want_max.view(np.uint32)) and \
                np.array_equal(b.view(np.uint32), want.view(np.uint32))
            yield f"gemm {name} M={m}", same, "bit-exact with the row route" if same else "differs from the row route"
    finally:
        k.set_gemm_variant(default)


def _attention_variant_checks(k, queries, kf, vf, table, blockpos, count, qpos, scale):
    """Every attention instantiation this CPU runs (attention_variants: AVX2 and AVX-512 on x86)
    against the active one, bit for bit, on both quantized caches; the active one is restored."""
    from appliance.kernels.quant import quantize_kv_q4, quantize_kv_q8
    default = k.attention_variant()
    cases = []
    for kind, pack, fn in (("q8", quantize_kv_q8, k.attention_q8), ("q4", quantize_kv_q4, k.attention_q4)):
        (kq, ks), (vq, vs) = pack(kf), pack(vf)
        cases.append((kind, lambda fn=fn, c=(kq, ks, vq, vs): fn(queries, *c, table, blockpos, count, qpos, scale)))
    want = {kind: run() for kind, run in cases}
    try:
        for name in k.attention_variants():
            if name == default:
                continue
            k.set_attention_variant(name)
            same = all(np.array_equal(run().view(np.uint32), want[kind].view(np.uint32)) for kind, run in cases)
            yield f"attention {name}", same, f"bit-exact with {default}" if same else f"differs from {default}"
    finally:
        k.set_attention_variant(default)


def selftest_report() -> dict:
    """Run every check; {"ok", "kernel_path", "checks", ...}. Raises ImportError without kernels.

    The server runs this too (Engine.kernel_selftest), once at start, and exports the verdict as
    appliance_selftest_ok (the fleet's BoardSelftestFailing alert): a board whose kernels went
    wrong after the rollout's selftest (a CPU swap, a changed library) is then still caught.
    """
    from appliance.kernels import _kernels as k
    report = {"kernel_path": k.kernel_path(), "gemm_variant": k.gemm_variant(),
              "attention_variant": k.attention_variant(), "cpu_features": k.cpu_features(),
              "cpu_supported": bool(k.cpu_supported()), "big_cores": cpu.big_cores(),
              "threads": cpu.default_threads(), "checks": []}
    if not report["cpu_supported"]:
        report["ok"] = False
        report["problem"] = f"this CPU cannot run the {report['kernel_path']} path the kernels were built for"
        return report
    rng = np.random.default_rng(20261129)
    for name, ok, detail in _checks(k, rng):
        report["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def run_selftest(as_json: bool = False, extra: dict | None = None) -> int:
    """extra: more verdicts to report beside the kernels' ({name: {"ok", "problem"?, ...}}), such as
    the weight cache of the model a board serves; the exit code is 0 only if all of them pass."""
    try:
        report = selftest_report()
    except ImportError as e:
        print(f"selftest: FAIL: the compiled kernels are not built ({e})", file=sys.stderr)
        return 2
    kernels_ok = report["ok"]
    for name, verdict in (extra or {}).items():
        report[name] = verdict
        report["ok"] = report["ok"] and verdict["ok"]
    _print(report, as_json, report.get("problem"), kernels_ok, extra or {})
    return 0 if report["ok"] else 1


def _print(report: dict, as_json: bool, problem: str | None, kernels_ok: bool, extra: dict) -> None:
    if as_json:
        print(json.dumps(report))
        return
    print(f"kernel path : {report['kernel_path']} (GEMM micro-kernel {report['gemm_variant']}, "
          f"attention {report['attention_variant']})")
    print(f"cpu features: {report['cpu_features'] or '(none found)'}")
    print(f"big cores   : {','.join(map(str, report['big_cores']))}  threads: {report['threads']}")
    for c in report["checks"]:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']:<20} {c['detail']}")
    for name, verdict in extra.items():
        print(f"  {'ok  ' if verdict['ok'] else 'FAIL'} {name:<20} {verdict.get('problem') or verdict.get('detail', '')}")
    if problem:
        print(f"selftest: FAIL: {problem}")
    elif not kernels_ok:
        print("selftest: FAIL: SIMD path disagrees with the portable reference")
    else:
        failed = [name for name, verdict in extra.items() if not verdict["ok"]]
        print("selftest: " + (f"FAIL: {', '.join(failed)}" if failed else "ok"))
