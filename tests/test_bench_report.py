"""bench/compare_report.py: the verdicts printed next to the llama.cpp comparison."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.compare_report import report  # noqa: E402

MB = 1 << 20
CONTEXTS = [128, 2048, 4096, 8192]
META = {"threads": 2, "gen": 4, "prefill": 512, "machine": "test cpu", "cpus": 2}


def _run(ms: dict, attn: dict | None = None, prefill=100.0, **extra) -> dict:
    attn = attn or {n: 0.0 for n in ms}
    return {"prefill": {"tokens_per_s": prefill},
            "decode": [{"context": n, "ms_per_token": ms[n], "attn_ms_per_token": attn[n],
                        "steps_s": [ms[n] / 1e3] * 4} for n in ms], **extra}


def _ours(ms, attn, **extra):
    return _run(ms, attn, weights="q8", kv="q8", kernel_path="avx2", weight_bytes=600 * MB,
                kv_capacity_bytes=240 * MB, kv_used_bytes_at_max_context=230 * MB, kv_bytes_per_token=59136,
                rss_before_load=30 * MB, rss_after_load=150 * MB, peak_rss_after_load=170 * MB,
                end_rss=900 * MB, end_peak_rss=950 * MB, max_context=8300, kv_context=8224, **extra)


LLAMA = {"f16": _run({128: 60.0, 2048: 90.0, 4096: 110.0, 8192: 200.0}, prefill=80.0, kv="f16",
                     flash_attn=False, amx="denied", llama_cpp_version="0.3", rss_after_load=1 << 30,
                     end_peak_rss=1 << 30, n_ctx=8300)}


def test_dense_targets_are_judged_against_the_reference_column():
    ours = _ours({128: 40.0, 2048: 60.0, 4096: 70.0, 8192: 60.0}, {128: 1.0, 2048: 8.0, 4096: 15.0, 8192: 30.0},
                 prefill=130.0)
    text, tables = report(ours, LLAMA, CONTEXTS, META)
    rows = {r["context"]: r for r in tables["rows"]}
    assert rows[128]["target_met"] is True and abs(rows[128]["ratio"] - 40 / 60) < 1e-9
    assert rows[4096]["target_met"] is False           # 70/110 = 0.64x > 0.40x
    assert rows[8192]["target_met"] is True            # 60/200 = 0.30x <= 0.33x
    assert rows[2048]["target_met"] is None            # no target there
    assert tables["prefill"]["target_met"] is True     # 130/80 = 1.63x >= 1.5x at 512 tokens
    assert "MISSED" in text and tables["sparse"] == {}
    _, tables = report(ours, LLAMA, CONTEXTS, dict(META, prefill=64))
    assert tables["prefill"]["target_ratio"] == 1.0    # other lengths: at least llama.cpp's


def test_sparse_column_judges_8192_and_the_attention_plateau():
    ours = _ours({128: 50.0, 2048: 60.0, 4096: 70.0, 8192: 110.0}, {128: 1.0, 2048: 8.0, 4096: 15.0, 8192: 30.0})
    sparse = _ours({128: 50.0, 2048: 58.0, 4096: 60.0, 8192: 80.0}, {128: 1.0, 2048: 6.0, 4096: 7.0, 8192: 10.0},
                   sparse_k=32)
    # the plateau runs from 4096 (the first of these contexts that decodes sparse at k = 32) to 8192
    text, tables = report(ours, LLAMA, CONTEXTS, META, sparse)
    rows = {r["context"]: r for r in tables["sparse"]["rows"]}
    assert rows[8192]["ratio_llamacpp"] == 80 / 200 and rows[8192]["target_met"] is True
    assert rows[4096]["target_met"] is None            # no sparse target there
    assert abs(tables["sparse"]["plateau_ratio"] - 10 / 7) < 1e-9
    assert "plateau" in text and "MISSED" in text.split("plateau")[1].splitlines()[0]   # 1.43x > 1.3x


def test_a_failed_run_is_reported_not_hidden():
    text, _ = report(None, {"f16": {"error": "llama-cpp-python is not installed"}}, CONTEXTS, META,
                     {"error": "worker ours failed with exit code 1"})
    assert "NOT MEASURED: llama-cpp-python is not installed" in text
    assert "ours sparse: NOT MEASURED" in text


def test_the_header_names_the_gemm_and_attention_variants_when_the_run_recorded_them():
    ms, attn = {128: 40.0, 2048: 60.0, 4096: 70.0, 8192: 60.0}, {n: 1.0 for n in CONTEXTS}
    text, _ = report(_ours(ms, attn, gemm_variant="avx512-vnni", attention_variant="avx2"), LLAMA, CONTEXTS, META)
    assert "ours: weights q8, KV q8, kernels avx2 (GEMM avx512-vnni, attention avx2)" in text.splitlines()
    text, _ = report(_ours(ms, attn), LLAMA, CONTEXTS, META)          # a result file from before
    assert "ours: weights q8, KV q8, kernels avx2" in text.splitlines()


def test_the_memory_line_says_where_the_weights_sit():
    ms, attn = {128: 40.0, 2048: 60.0, 4096: 70.0, 8192: 60.0}, {n: 1.0 for n in CONTEXTS}
    text, _ = report(_ours(ms, attn, weight_hugepage_bytes=600 * MB), LLAMA, CONTEXTS, META)
    assert "(600 MiB of the matrices every step reads copied into huge pages, the rest mapped" in text
    text, _ = report(_ours(ms, attn), LLAMA, CONTEXTS, META)          # huge pages off, or an older file
    assert "(weights mapped, paged in on use)" in text and "huge pages" not in text
