"""Qwen3-MoE against transformers: every logit of every position, routing included.

f32 weights + f32 KV must match transformers' Qwen3MoeForCausalLM to 1e-4 relative
(top-2 and top-8, with and without norm_topk_prob, dense mlp_only_layers and
decoder_sparse_step layers). Q8_0 / Q4_0 are held to an exact torch simulation of
the same quantization (weights of every linear and expert, int8 activation rows at
every linear input, router kept float32). Then: the experts' pages stay on disk
until a token routes to them.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from appliance import Engine
from appliance.kernels import quant
from appliance.cli.main import main as cli_main
from appliance.errors import ModelLoadError
from appliance.weights import hugepages
from appliance.models.qwen3_moe import Qwen3MoeConfig
from family_checks import (TEXT, assert_close_logits, check_batched_decode_equals_single,
                           check_decode_matches_full_pass, check_f32_logits)
from tiny_models import reference_logits
from tiny_models_moe import build_qwen3_moe

# Quantized engine vs the torch simulation of the same quantization. They differ by float
# rounding (~1e-6) until an activation lands within rounding noise of an int8 rounding
# boundary: one quantum flips, and through the KV cache the later positions drift apart
# (seen up to 1e-2). A wrong scale, nibble order or routing weight is off by far more.
SIMULATION_ROUNDING = 1e-4     # the median position stays at float rounding
SIMULATION_RTOL = 5e-2         # every position
AGREEMENT_SLACK = 0.03         # top-1 agreement with f32 transformers, below the simulation's own

SHAPES = {
    "top2_norm": dict(top_k=2, norm_topk_prob=True),
    "top2_no_norm": dict(top_k=2, norm_topk_prob=False, seed=1),
    "top8_of_16_norm": dict(experts=16, top_k=8, norm_topk_prob=True, seed=2),
    "top8_of_16_no_norm": dict(experts=16, top_k=8, norm_topk_prob=False, seed=3),
    # every expert selected; layers 0 and 2 dense by decoder_sparse_step; bf16 in 100 KB shards
    "top8_of_8_step2_bf16_sharded": dict(experts=8, top_k=8, layers=3, mlp_only_layers=(), decoder_sparse_step=2,
                                         dtype="bfloat16", max_shard_size="100KB", seed=4),
}


@pytest.fixture(scope="session")
def moe_factory(tmp_path_factory):
    built: dict[str, Path] = {}

    def build(name: str, **kwargs) -> Path:
        if name not in built:
            built[name] = build_qwen3_moe(tmp_path_factory.mktemp(name), **kwargs)
        return built[name]

    return build


@pytest.fixture(scope="session")
def tiny_moe_dir(moe_factory) -> Path:
    """8 experts, top-2, renormalized, layer 1 dense."""
    return moe_factory("top2_norm", **SHAPES["top2_norm"])


@pytest.mark.parametrize("name", SHAPES)
def test_f32_logits_match_transformers(moe_factory, name):
    check_f32_logits(moe_factory(name, **SHAPES[name]), TEXT * 2)


def test_f32_logits_across_prefill_chunks(tiny_moe_dir):
    """Chunks of 5 rows route and group their own tokens; same logits as one pass."""
    check_f32_logits(tiny_moe_dir, TEXT * 2, prefill_chunk=5)


def test_decode_steps_match_full_pass(tiny_moe_dir):
    """Greedy decode (one row, top-k experts as GEMVs) equals the argmax of transformers' full pass."""
    engine = check_decode_matches_full_pass(tiny_moe_dir)
    use = engine.model.expert_use
    assert use.last_rows == 1
    assert use.experts_per_token == 2 * 1      # top-2 in the one MoE layer (layer 1 is dense)


def test_batched_decode_equals_single(tiny_moe_dir):
    """Default weights are Q4_0; sequences decoded together (rows sharing experts) get their tokens alone."""
    engine = Engine.load(tiny_moe_dir, progress=False)
    assert engine.weights == "q4"
    check_batched_decode_equals_single(engine)
    use = engine.model.expert_use
    assert use.last_rows == 3 and 2 <= use.experts_per_token * 3 <= 6


# ---- quantized formats against an exact simulation ---------------------------------------------
def simulated_logits(model_dir, ids, fmt: str) -> np.ndarray:
    """transformers' forward with the engine's quantization: Q8_0/Q4_0 weights of every linear and
    expert (embedding and lm_head Q8_0), every linear/expert input row to int8 per 32-block."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    packers = {"q8": (quant.quantize_q8_0, quant.dequantize_q8_0),
               "q4": (quant.quantize_q4_0, quant.dequantize_q4_0)}

    def fake(w: torch.Tensor, f: str) -> torch.Tensor:
        pack, unpack = packers[f]
        return torch.from_numpy(unpack(*pack(w.detach().numpy())))

    def fake_rows(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).numpy()
        q, d = quant.quantize_rows_q8(flat)
        return torch.from_numpy((q.reshape(len(flat), -1, quant.QK).astype(np.float32) * d[..., None])
                                .reshape(x.shape))

    def experts_forward(self, hidden, top_k_index, top_k_weights):
        x = fake_rows(hidden)
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if len(token) == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            act = fake_rows(F.silu(gate) * up)
            out.index_add_(0, token, F.linear(act, self.down_proj[e]) * top_k_weights[token, slot, None])
        return out

    with torch.no_grad():
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        emb.weight.copy_(fake(emb.weight, "q8"))
        head.weight.copy_(fake(head.weight, "q8"))
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                if module is not head:
                    module.weight.copy_(fake(module.weight, fmt))
                module.register_forward_pre_hook(lambda m, args: (fake_rows(args[0]),))
            elif isinstance(module, Qwen3MoeExperts):
                for e in range(module.num_experts):
                    module.gate_up_proj[e].copy_(fake(module.gate_up_proj[e], fmt))
                    module.down_proj[e].copy_(fake(module.down_proj[e], fmt))
                module.forward = experts_forward.__get__(module)
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantized_within_simulation(moe_factory, fmt):
    model_dir = moe_factory("agree", hidden=128, moe_intermediate=64, experts=8, top_k=2, norm_topk_prob=True,
                            seed=7, weight_std=0.05, router_std=0.2)
    engine = Engine.load(model_dir, weights=fmt, kv="f32", progress=False)
    ids = np.random.default_rng(0).integers(3, engine.tokenizer.vocab_size, size=120).tolist()
    got = engine.logits(ids)
    sim = simulated_logits(model_dir, ids, fmt)
    assert_close_logits(got, sim, SIMULATION_RTOL)
    per_position = (np.abs(got - sim) / np.abs(sim).max(axis=-1, keepdims=True)).max(axis=-1)
    assert np.median(per_position) < SIMULATION_ROUNDING
    ref = reference_logits(model_dir, ids).argmax(-1)
    sim_agree = float((sim.argmax(-1) == ref).mean())
    got_agree = float((got.argmax(-1) == ref).mean())
    print(f"{fmt}: simulation top-1 {sim_agree:.3f}, engine top-1 {got_agree:.3f}")
    assert got_agree >= sim_agree - AGREEMENT_SLACK


# ---- lazily mapped experts ---------------------------------------------------------------------
RSS_PROBE = textwrap.dedent("""
    import json, os, sys
    import psutil
    from appliance import Engine
    engine = Engine.load(sys.argv[1], progress=False)          # q4 by default for MoE, cache built
    proc = psutil.Process()
    cache = next(m.path for m in proc.memory_maps() if "/.appliance-cache/" in m.path)
    def resident():
        return sum(m.rss for m in proc.memory_maps() if m.path == cache)
    after_load, rss_load = resident(), proc.memory_info().rss
    ids = engine.tokenizer.encode("Hello world")
    engine.generate(ids, stream=False, max_tokens=3, temperature=0.0, ignore_eos=True)
    m = engine.model
    print(json.dumps({"after_load": after_load, "after_generate": resident(), "cache_size": os.path.getsize(cache),
                      "rss_load": rss_load, "rss_generate": proc.memory_info().rss,
                      "expert_bytes": m.expert_bytes, "experts_ran": int(m.expert_use.ran.sum()),
                      "experts_total": m.expert_use.n_moe_layers * m.cfg.num_experts,
                      "weight_bytes": engine.weight_bytes, "tokens": len(ids) + 3}))
""")


def test_unused_experts_stay_on_disk(moe_factory):
    """Resident pages of the weight cache follow the experts that ran, not the experts there are."""
    model_dir = moe_factory("rss", hidden=512, heads=4, kv_heads=2, head_dim=128, moe_intermediate=512,
                            experts=64, top_k=2, layers=2, mlp_only_layers=(), dtype="bfloat16", weight_std=0.02)
    Engine.load(model_dir, progress=False)                     # quantize and write the cache
    res = subprocess.run([sys.executable, "-c", RSS_PROBE, str(model_dir)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    print(r)
    per_expert = r["expert_bytes"] / r["experts_total"]
    other = r["weight_bytes"] - r["expert_bytes"]              # attention, norms, routers, embedding, lm_head
    assert r["after_load"] < 0.02 * r["cache_size"]            # mapping touches nothing
    assert r["experts_ran"] <= 2 * 2 * r["tokens"] < r["experts_total"] / 2
    # Every weight byte of an expert that ran is read; fault-around may map up to 64 KiB more per run.
    assert r["after_generate"] >= 0.9 * r["experts_ran"] * per_expert
    assert r["after_generate"] <= other + r["experts_ran"] * (per_expert + 128 * 1024) + (1 << 20)
    assert r["after_generate"] < 0.5 * r["cache_size"]
    assert r["rss_generate"] - r["rss_load"] < 0.5 * r["expert_bytes"]


# ---- config and command line -------------------------------------------------------------------
def test_config_reads_both_expert_count_names():
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=100, moe_intermediate_size=64)
    shipped = Qwen3MoeConfig.from_dict({**base, "num_experts": 128, "num_experts_per_tok": 8,
                                        "norm_topk_prob": True, "mlp_only_layers": []}, "config.json")
    assert (shipped.num_experts, shipped.num_experts_per_tok, shipped.norm_topk_prob) == (128, 8, True)
    saved = Qwen3MoeConfig.from_dict({**base, "num_local_experts": 8, "mlp_only_layers": [1]}, "config.json")
    assert saved.num_experts == 8 and saved.moe_layers == [0]
    stepped = Qwen3MoeConfig.from_dict({**base, "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
                                        "decoder_sparse_step": 2}, "config.json")
    assert stepped.moe_layers == [1, 3]


@pytest.mark.parametrize("bad,message", [
    ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok 5"),
    ({"moe_intermediate_size": 48}, "moe_intermediate_size 48"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step 0"),
])
def test_config_errors(bad, message):
    d = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=100, **bad)
    with pytest.raises(ModelLoadError, match=message):
        Qwen3MoeConfig.from_dict(d, "config.json")


def test_cli_generate_and_bench(tiny_moe_dir, capsys):
    assert cli_main(["generate", "--model", str(tiny_moe_dir), "--prompt", "Hello", "--max-tokens", "4",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completion_tokens"] == 4
    assert cli_main(["bench", "--model", str(tiny_moe_dir), "--context", "16", "--gen", "3"]) == 0
    table = capsys.readouterr().out
    assert "weights q4" in table and "experts/tok" in table and "RSS MiB" in table
    row = table.strip().splitlines()[-1].split()
    assert row[0] == "16" and float(row[-3]) == 2.0            # top-2 in one MoE layer


def test_experts_stay_mapped_while_attention_moves_to_huge_pages(tiny_moe_dir):
    """Only the matrices every step reads whole leave the cache's mapping (weights/hugepages.py)."""
    engine = Engine.load(tiny_moe_dir, progress=False)
    streamed = {id(lin) for lin in engine.model.streamed_linears()}
    moe = [layer.mlp for layer in engine.model.layers if hasattr(layer.mlp, "experts")]
    assert moe
    for block in moe:
        for expert in block.experts:
            for lin in (expert.gate_up, expert.down):
                assert id(lin) not in streamed
                assert hugepages.is_mapped(lin.ws if lin.ws is not None else lin.qs)
    if hugepages.wanted():
        assert engine.weight_cache.hugepage_bytes > 0
        attention = engine.model.layers[0].attention.qkv
        assert id(attention) in streamed and hugepages.hold([attention]) == 0     # copied already
