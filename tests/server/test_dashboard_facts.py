"""The dashboard's tables: labels a person reads, values with units, settings only where they
mean something on this server; the live history's speculative-decoding counts."""
from __future__ import annotations

from appliance.config import Settings
from appliance.engine.speculative import SpeculativeStats
from appliance.server.dashboard_facts import mib, model_rows, setting_rows
from appliance.server.live import LiveStats
from appliance.telemetry.cpu_wait import CpuTimes

# What Engine.info() and the runtime's model facts hold for a Qwen3-0.6B-shaped model.
FACTS = {"id": "Qwen3-0.6B", "model": "Qwen3-0.6B", "model_type": "Qwen3Model", "layers": 28, "hidden": 1024,
         "heads": 16, "kv_heads": 8, "head_dim": 128, "vocab": 151936, "weights": "q8", "kv": "q8",
         "kernel_path": "avx2", "threads": 4, "max_context": 32768, "weight_bytes": 633495552,
         "kv_bytes_per_token_per_layer": 2304, "kv_blocks_total": 1024, "kv_block_size": 32,
         "kv_tokens_total": 32768, "kv_pool_sizing": "50% of the memory free after the weights",
         "kv_pool_bytes": 2113929216, "prefix_cache": True, "kv_cache_dir": None, "sparse": None,
         "generation_defaults": {"temperature": 0.6, "top_p": 0.95, "top_k": 20}}


def labels(rows):
    return {label: value for label, value, _ in rows}


def test_model_rows_read_as_labels_with_units():
    rows = labels(model_rows(FACTS))
    assert rows["Weights in memory"] == "604 MiB" and rows["KV pool memory"] == "2,016 MiB"
    assert rows["KV bytes per token per layer"] == "2,304 B"
    assert rows["Context limit"] == "32,768 tokens" and rows["Vocabulary"] == "151,936 tokens"
    assert rows["Attention heads (KV heads)"] == "16 (8), 128 dimensions each"
    assert rows["Family"] == "Qwen3" and rows["Weights"] == "Q8_0 (int8)" and rows["Attention"] == "exact"
    assert rows["Sampling defaults"] == "temperature 0.6, top p 0.95, top k 20"
    assert "Prefix cache on disk" not in rows                      # no directory: no row
    assert all("_" not in label for label in rows)
    sparse = labels(model_rows({**FACTS, "sparse": {"k": 8, "block": 32, "probe": 8, "probe_mode": "bound"},
                                "kv_cache_dir": "/srv/kv"}))
    assert sparse["Attention"] == "block-sparse" and sparse["Prefix cache on disk"] == "/srv/kv"


def test_settings_appear_where_they_mean_something():
    plain = labels(setting_rows(Settings()))
    assert "Sparse attention" not in plain and "Prefix cache disk budget" not in plain
    assert "Thinking budget" not in plain and "Also answers to" not in plain and "Rows per step" not in plain
    assert plain["Speculative decoding"].startswith("off")
    assert plain["Largest request body"] == "16 MiB" and plain["Request time limit"] == "600 s"
    assert plain["API key"] == "not required"
    assert not [v for v in plain.values() if v in ("None", "", "—")]

    tuned = labels(setting_rows(Settings(sparse_attn=True, sparse_k=8, sparse_probe_mode="strided",
                                         kv_cache_dir="/srv/kv", spec_prompt_lookup=4, api_key="a-long-key",
                                         served_model_name="qwen3,gpt-4o-mini", max_thinking_tokens=256)))
    assert tuned["Sparse attention"] == "8 blocks of 32 positions per head, scored by 8 sampled rows"
    assert tuned["Prefix cache disk budget"] == "4,096 MiB"
    assert tuned["Speculative decoding"] == "prompt lookup, up to 4 drafted tokens per step"
    assert tuned["Also answers to"] == "gpt-4o-mini" and tuned["Thinking budget"] == "256 tokens"
    assert tuned["API key"] == "required" and "a-long-key" not in str(tuned)


def test_the_boards_instances_are_listed_with_this_one_marked():
    assert "Instances on this board" not in labels(setting_rows(Settings()))
    board = '[{"name": "chat", "port": 8080, "task": "chat", "model": "Qwen3-1.7B"}, ' \
            '{"name": "embed", "port": 8081, "task": "embed", "model": "qwen3-embedding"}, {"name": "x", "port": 8082}]'
    rows = labels(setting_rows(Settings(port=8081, board_instances=board)))
    assert rows["Instances on this board"] == ("chat on port 8080: chat, Qwen3-1.7B; embed on port 8081: embed, "
                                               "qwen3-embedding (this one); x on port 8082: task of its checkpoint")


def test_every_setting_row_carries_its_help():
    for _, _, hint in setting_rows(Settings(sparse_attn=True, kv_cache_dir="/x")):
        assert hint and len(hint) > 10


def test_mib():
    assert mib(16 << 20) == "16 MiB" and mib(1536 * 1024) == "1.5 MiB" and mib(10 << 30) == "10,240 MiB"


def test_live_history_counts_drafts_per_second_and_position():
    live = LiveStats()
    for drafted, accepted in ((4, 2), (3, 3), (2, 0)):
        step = SpeculativeStats()
        step.add(drafted, accepted)
        live.observe(step)
    spec = live.speculation()
    assert spec["draft_tokens"] == 9 and spec["accepted_tokens"] == 5
    assert [(p["drafted"], p["accepted"]) for p in spec["by_position"]] == [(3, 2), (3, 2), (2, 1), (1, 0)]
    live._current["t"] -= 1                                   # close the current second
    series = live.snapshot()["series"]
    assert sum(s["spec_drafted"] for s in series) == 9 and sum(s["spec_accepted"] for s in series) == 5


def test_live_history_carries_the_cores_run_and_waited_for_since_the_last_reading():
    totals = iter([CpuTimes(10.0, 1.0), CpuTimes(11.5, 1.5), CpuTimes(12.0, 1.5), CpuTimes(15.0, 3.0)])
    clock = iter([100.0, 101.0, 102.0, 105.0])
    live = LiveStats(cpu_times=lambda: next(totals), clock=lambda: next(clock))
    live.snapshot()                               # opens the first second: the baseline
    for back in (1, 1, 3):                        # close it as if `back` seconds had passed
        live._current["t"] -= back
        live.snapshot()
    got = [(s["cpu_run_cores"], s["cpu_wait_cores"]) for s in live.snapshot()["series"]]
    # the idle seconds of a gap get the rates of the span they belong to
    assert got == [(1.5, 0.5), (0.5, 0.0), (1.0, 0.5), (1.0, 0.5), (1.0, 0.5)]


def test_live_history_has_no_cpu_rates_where_the_kernel_counts_no_waits():
    for live in (LiveStats(), LiveStats(cpu_times=lambda: None)):
        live.snapshot()
        for _ in range(2):
            live._current["t"] -= 1
            live.snapshot()
        assert {(s["cpu_run_cores"], s["cpu_wait_cores"]) for s in live.snapshot()["series"]} == {(None, None)}
