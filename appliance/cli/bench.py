"""`appliance bench`: prefill speed and decode time per token at several context lengths.

Each context gets a fresh sequence of deterministic pseudo-random tokens (the cost
of a token does not depend on which tokens they are), a timed prefill, then `gen`
greedy decode steps. Medians, from the engine's own step statistics; "rest" is the step
outside its GEMMs and attention (norms, RoPE, SiLU, sampling, Python), with its share.
For a mixture-of-experts model, also the experts run per decoded token (over all
MoE layers), the share of all experts run since load, and the process's resident
memory after the context's run: the experts that never ran stay on disk.
"""
from __future__ import annotations

import statistics

import numpy as np
import psutil

from appliance.engine.stats import DecodeStats, PrefillStats
from appliance.engine.sampling import SamplingParams

MIB = 1 << 20


def _prompt(engine, n: int, salt: int = 0) -> list[int]:
    rng = np.random.default_rng(1234 + n + salt)
    vocab = engine.config.vocab_size
    special = engine.tokenizer.eos_token_ids
    ids = rng.integers(0, min(vocab, engine.tokenizer.vocab_size), size=n)
    return [int(t) if int(t) not in special else 0 for t in ids]


def measure(engine, n: int, gen: int, salt: int = 0) -> tuple[PrefillStats, list[DecodeStats]]:
    """Prefill n tokens then decode gen tokens; the step stats of both."""
    seen: list = []
    engine.add_stats_listener(seen.append)
    try:
        seq = engine.start(_prompt(engine, n, salt), SamplingParams(max_tokens=gen, temperature=0.0,
                                                                   ignore_eos=True))
        try:
            engine.prefill(seq)
            while not seq.done:
                engine.decode([seq])
        finally:
            engine.release(seq)
    finally:
        engine.remove_stats_listener(seen.append)
    prefill = next(s for s in seen if isinstance(s, PrefillStats))
    return prefill, [s for s in seen if isinstance(s, DecodeStats)]


def run_bench(engine, contexts: list[int], gen: int, repeat: int = 1) -> list[dict]:
    rows = []
    use = getattr(engine.model, "expert_use", None)       # MoE families only
    experts_per_step: list[float] = []

    def count_experts(stats) -> None:
        if isinstance(stats, DecodeStats):
            experts_per_step.append(use.experts_per_token)

    if use is not None:
        engine.add_stats_listener(count_experts)
    for n in contexts:
        experts_per_step.clear()
        prefills, decodes = [], []
        for r in range(repeat):
            p, d = measure(engine, n, gen, salt=r)
            prefills.append(p)
            decodes += d
        prefill_s = statistics.median(p.total_s for p in prefills)
        total = statistics.median(d.total_s for d in decodes) if decodes else float("nan")
        attn = statistics.median(d.attn_s for d in decodes) if decodes else float("nan")
        rest = statistics.median(d.rest_s for d in decodes) if decodes else float("nan")
        rows.append({
            "context": n,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": n / prefill_s,
            "prefill_gemm_share": statistics.median(p.gemm_share for p in prefills),
            "prefill_attn_share": statistics.median(p.attn_share for p in prefills),
            "decode_ms_per_token": 1e3 * total,
            "attn_ms_per_token": 1e3 * attn,
            "attn_share": attn / total if total else 0.0,
            "rest_ms_per_token": 1e3 * rest,
            "rest_share": rest / total if total else 0.0,
            "decode_steps": len(decodes),
            "kv_bytes_per_token_per_layer": engine.cache.bytes_per_token_per_layer,
        })
        if use is not None:
            rows[-1].update(experts_per_token=statistics.median(experts_per_step) if experts_per_step else float("nan"),
                            experts_run_share=use.share_ever_ran, rss_bytes=psutil.Process().memory_info().rss)
    if use is not None:
        engine.remove_stats_listener(count_experts)
    return rows


def format_table(engine, rows: list[dict]) -> str:
    info = engine.info()
    head = (f"model {info['model']}  weights {info['weights']}  kv {info['kv']}  "
            f"threads {info['threads']}  kernels {info['kernel_path']}")
    moe = bool(rows) and "experts_per_token" in rows[0]
    if moe:
        c, m = engine.config, engine.model
        head += (f"\nMoE: top-{c.num_experts_per_tok} of {c.num_experts} experts in {m.expert_use.n_moe_layers} "
                 f"layers; expert weights {m.expert_bytes / MIB:.0f} MiB of {engine.weight_bytes / MIB:.0f} MiB, "
                 f"mapped, paged in when routed to (experts/tok: expert runs per decoded token over all "
                 f"MoE layers; experts run: share of all experts run since load; RSS after the context's run)")
    lines = [head,
             f"{'context':>8} {'prefill tok/s':>14} {'decode ms/tok':>14} {'attn ms/tok':>12} "
             f"{'attn share':>11} {'rest ms/tok':>12} {'KV B/tok/layer':>15}"
             + (f" {'experts/tok':>11} {'experts run':>12} {'RSS MiB':>8}" if moe else "")]
    for r in rows:
        lines.append(f"{r['context']:>8} {r['prefill_tokens_per_s']:>14.1f} {r['decode_ms_per_token']:>14.2f} "
                     f"{r['attn_ms_per_token']:>12.2f} {100 * r['attn_share']:>10.1f}% "
                     f"{r['rest_ms_per_token']:>6.2f} {100 * r['rest_share']:>4.1f}% "
                     f"{r['kv_bytes_per_token_per_layer']:>15}"
                     + (f" {r['experts_per_token']:>11.1f} {100 * r['experts_run_share']:>11.1f}% "
                        f"{r['rss_bytes'] / MIB:>8.0f}" if moe else ""))
    return "\n".join(lines)


def format_comparison(exact: tuple, sparse: tuple) -> str:
    """The two tables of docs/engine.md's board figures, exact and sparse side by side."""
    (engine, exact_rows), (_, sparse_rows) = exact, sparse
    info = engine.info()
    sp = sparse[0].sparse
    lines = [f"model {info['model']}  weights {info['weights']}  kv {info['kv']}  threads {info['threads']}  "
             f"kernels {info['kernel_path']}  sparse k={sp.k} block={sp.block} "
             + (f"probe={sp.probe}" if sp.probe_mode == "strided" else "probe=bound"),
             "",
             "decode, median per token",
             f"{'context':>8} {'exact attn ms':>14} {'exact total ms':>15} {'exact share':>12} "
             f"{'sparse attn ms':>15} {'sparse total ms':>16} {'sparse share':>13}"]
    for e, s in zip(exact_rows, sparse_rows):
        lines.append(f"{e['context']:>8} {e['attn_ms_per_token']:>14.2f} {e['decode_ms_per_token']:>15.2f} "
                     f"{100 * e['attn_share']:>11.1f}% {s['attn_ms_per_token']:>15.2f} "
                     f"{s['decode_ms_per_token']:>16.2f} {100 * s['attn_share']:>12.1f}%")
    lines += ["", "prefill (time to first token)",
              f"{'context':>8} {'exact s':>9} {'sparse s':>9} {'exact GEMM/ATTN':>17} {'sparse GEMM/ATTN':>18}"]
    for e, s in zip(exact_rows, sparse_rows):
        lines.append(f"{e['context']:>8} {e['prefill_s']:>9.2f} {s['prefill_s']:>9.2f} "
                     f"{100 * e['prefill_gemm_share']:>7.1f}% / {100 * e['prefill_attn_share']:>5.1f}% "
                     f"{100 * s['prefill_gemm_share']:>8.1f}% / {100 * s['prefill_attn_share']:>5.1f}%")
    return "\n".join(lines)
