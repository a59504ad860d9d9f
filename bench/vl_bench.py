#!/usr/bin/env python3
"""Qwen3-VL: vision encode time for one image and decode ms/token, our engine vs transformers.

    python bench/vl_bench.py [--workdir /tmp/appliance-vl-bench] [--threads 2] [--image 448]
                             [--layers N --vision-depth N]   # fewer layers: a quick, smaller run

The checkpoint is a random Qwen3-VL-2B-shaped Qwen3VLForConditionalGeneration (text: 28
layers, hidden 2048, 16/8 heads of 128; vision: 24 blocks, hidden 1024, DeepStack after
blocks 5, 11, 17), saved in bf16 once into the work directory with the tiny test
tokenizer (the bench measures compute, not text). llama.cpp's multimodal path (mtmd +
an mmproj GGUF) is not built here, so the reference is transformers on torch (f32, CPU,
same thread count).

Vision: one --image x --image picture (448: 28x28 patches of 16 -> 196 image tokens),
median of --repeat runs. Decode: a chat prompt with the image, then --gen greedy steps,
median ms per step. Engines run one after the other in separate processes.
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

SHAPE_2B = dict(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                mrope_section=(24, 20, 20), vision_hidden=1024, vision_heads=16, vision_depth=24,
                vision_intermediate=4096, deepstack=(5, 11, 17), pos_embeddings=2304, tied=True)


def build(workdir: Path, layers: int, vision_depth: int) -> Path:
    from tiny_models_vl import PREPROCESSOR, build_qwen3_vl

    shape = dict(SHAPE_2B, layers=layers, vision_depth=vision_depth,
                 deepstack=tuple(i for i in SHAPE_2B["deepstack"] if i < vision_depth)[:layers])
    out = workdir / f"qwen3-vl-2b-shaped-L{layers}-V{vision_depth}"
    if not (out / "config.json").exists():
        build_qwen3_vl(out, dtype="bfloat16", **shape)
        # the real checkpoint's pixel budget
        (out / "preprocessor_config.json").write_text(json.dumps(
            dict(PREPROCESSOR, size={"shortest_edge": 65536, "longest_edge": 16777216})))
    return out


def picture_bytes(side: int) -> bytes:
    import io

    from tiny_models_vl import test_picture
    buf = io.BytesIO()
    test_picture(side, side).save(buf, format="PNG")
    return buf.getvalue()


def run_ours(model_dir: Path, side: int, gen: int, repeat: int, threads: int, weights: str) -> dict:
    from appliance import Engine
    from appliance.engine.stats import StepTimer

    engine = Engine.load(model_dir, weights=weights, threads=threads, progress=False)
    image = engine.prepare_image(picture_bytes(side))
    encode = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        engine.model.vision(image.pixel_values, image.grid_thw, StepTimer())
        encode.append(time.perf_counter() - t0)
    prompt = engine.encode_prompt([{"role": "user", "content": [{"type": "image"},
                                                                {"type": "text", "text": "Describe it."}]}])
    seq = engine.start(prompt, engine.sampling_params(max_tokens=gen, temperature=0.0, ignore_eos=True),
                       images=[image])
    steps = []
    try:
        t0 = time.perf_counter()
        engine.prefill(seq)
        prefill = time.perf_counter() - t0
        while not seq.done:
            t0 = time.perf_counter()
            engine.decode([seq])
            steps.append(time.perf_counter() - t0)
    finally:
        engine.release(seq)
    return {"engine": f"appliance {weights}", "image_tokens": image.n_tokens, "prompt_tokens": len(seq.prompt_ids),
            "vision_encode_s": statistics.median(encode), "prefill_s": prefill,
            "decode_ms_per_token": 1e3 * statistics.median(steps)}


def run_transformers(model_dir: Path, side: int, gen: int, repeat: int, threads: int) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from appliance import Engine
    torch.set_num_threads(threads)
    engine = Engine.load(model_dir, weights="f32", threads=threads, progress=False, max_context=4096)  # prompt only
    image = engine.prepare_image(picture_bytes(side))
    prompt = engine.encode_prompt([{"role": "user", "content": [{"type": "image"},
                                                                {"type": "text", "text": "Describe it."}]}])
    ids = engine.expand_image_tokens(prompt, [image])
    del engine
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    pv = torch.from_numpy(image.pixel_values)
    thw = torch.tensor([image.grid_thw])
    encode = []
    with torch.no_grad():
        for _ in range(repeat):
            t0 = time.perf_counter()
            model.model.visual(pv, grid_thw=thw)
            encode.append(time.perf_counter() - t0)
        input_ids = torch.tensor([ids])
        t0 = time.perf_counter()
        out = model(input_ids=input_ids, pixel_values=pv, image_grid_thw=thw, use_cache=True,
                    mm_token_type_ids=(input_ids == model.config.image_token_id).int())
        prefill = time.perf_counter() - t0
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(gen - 1):
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            steps.append(time.perf_counter() - t0)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return {"engine": "transformers f32", "image_tokens": int(np.prod(image.grid_thw)) // 4,
            "prompt_tokens": len(ids), "vision_encode_s": statistics.median(encode), "prefill_s": prefill,
            "decode_ms_per_token": 1e3 * statistics.median(steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/appliance-vl-bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--image", type=int, default=448, help="side of the square test picture in pixels")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=SHAPE_2B["layers"])
    ap.add_argument("--vision-depth", type=int, default=SHAPE_2B["vision_depth"])
    ap.add_argument("--weights", default="q8", choices=["q8", "q4"])
    ap.add_argument("--one", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build(args.workdir, args.layers, args.vision_depth)
    if args.one == "ours":
        print(json.dumps(run_ours(model_dir, args.image, args.gen, args.repeat, args.threads, args.weights)))
        return 0
    if args.one == "transformers":
        print(json.dumps(run_transformers(model_dir, args.image, args.gen, args.repeat, args.threads)))
        return 0
    rows = []
    for which in ("ours", "transformers"):
        cmd = [sys.executable, __file__, "--one", which] + sys.argv[1:]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            return 1
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    print(f"Qwen3-VL-2B-shaped random checkpoint, {args.layers} text layers, {args.vision_depth} vision blocks, "
          f"{args.image}x{args.image} image, {args.threads} threads, load average {load:.1f}\n")
    print("| engine | image tokens | vision encode s | prefill s (incl. vision) | decode ms/token |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['engine']} | {row['image_tokens']} | {row['vision_encode_s']:.2f} | {row['prefill_s']:.2f} "
              f"| {row['decode_ms_per_token']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
