"""Qwen3-VL against transformers: preprocessing, the vision tower, every logit with and without an image.

f32 weights + f32 KV must match transformers to 1e-4 relative (to the row's largest
magnitude), as for Qwen3 dense. The pixel arrays must equal the processor's exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from appliance import Engine
from appliance.models.images import ImageProcessorConfig, preprocess
from family_checks import F32_RTOL, relative_error
from tiny_models_vl import build_qwen3_vl, reference_vl, test_picture as make_picture

TEXT = "Edge boards run language models on their CPUs with int8 kernels. Hello world!"
PICTURE_SIZES = [(100, 72), (33, 200), (640, 480)]


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    return build_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"))


@pytest.fixture(scope="module")
def engine_f32(tiny_vl_dir):
    return Engine.load(tiny_vl_dir, weights="f32", kv="f32", progress=False)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(relative_error(got, ref).max())


def chat_ids(engine, with_image: bool) -> list[int]:
    content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": "What is in the picture?"}]
    return engine.encode_prompt([{"role": "user", "content": content}])


@pytest.mark.parametrize("size", PICTURE_SIZES)
def test_preprocessing_matches_processor(tiny_vl_dir, size):
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_vl_dir)
    picture = make_picture(*size)
    ref = processor(images=[picture], return_tensors="np")
    got = preprocess(picture, ImageProcessorConfig.from_model_dir(tiny_vl_dir))
    assert got.grid_thw == tuple(ref["image_grid_thw"][0])
    np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"])
    # the processor's own count of image tokens for this size
    assert got.n_tokens == ref["image_grid_thw"][0].prod() // processor.merge_size ** 2


def test_image_tokens_match_processor(engine_f32, tiny_vl_dir):
    """The chat prompt's placeholder expands to as many <|image_pad|> as Qwen3VLProcessor makes.

    Qwen3VLProcessor itself cannot be built here (its video processor needs torchvision),
    so its documented rule is applied: each <|image_pad|> becomes grid_t * grid_h * grid_w
    / merge_size**2 copies (replace_image_token), with the image processor's grid, then
    transformers' tokenizer encodes the text.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    image_processor = AutoImageProcessor.from_pretrained(tiny_vl_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_dir)
    picture = make_picture(100, 72)
    text = engine_f32.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}])
    grid = image_processor(images=[picture], return_tensors="np")["image_grid_thw"][0]
    n = int(grid.prod()) // image_processor.merge_size ** 2
    ref = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * n))["input_ids"]
    seq = engine_f32.start(engine_f32.tokenizer.encode(text), engine_f32.sampling_params(max_tokens=1),
                           images=[picture])
    try:
        assert seq.prompt_ids == ref
        assert seq.prompt_ids.count(engine_f32.config.image_token_id) == n == seq.vision.n_image_tokens
    finally:
        engine_f32.release(seq)


def test_text_only_logits_match_transformers(engine_f32, tiny_vl_dir):
    ids = engine_f32.tokenizer.encode(TEXT)
    ref, _ = reference_vl(tiny_vl_dir, ids)
    assert rel_err(engine_f32.logits(ids), ref) < F32_RTOL


@pytest.mark.parametrize("size", [(100, 72), (33, 200)])
def test_image_logits_match_transformers(engine_f32, tiny_vl_dir, size):
    picture = make_picture(*size)
    image = engine_f32.prepare_image(picture)
    seq = engine_f32.start(chat_ids(engine_f32, True), engine_f32.sampling_params(max_tokens=1), images=[image])
    ids = seq.prompt_ids
    engine_f32.release(seq)
    ref, (ref_embeds, ref_deepstack) = reference_vl(tiny_vl_dir, ids, image.pixel_values, [image.grid_thw])

    embeds, deepstack = engine_f32.model.vision(image.pixel_values, image.grid_thw, _NoTimer())
    assert rel_err(embeds, ref_embeds) < F32_RTOL
    assert len(deepstack) == len(ref_deepstack) == 2
    for got, want in zip(deepstack, ref_deepstack):
        assert rel_err(got, want) < F32_RTOL
    assert rel_err(engine_f32.logits(ids, images=[image]), ref) < F32_RTOL


def test_image_logits_across_prefill_chunks(tiny_vl_dir):
    """Chunks of 5 rows cut through the image tokens: positions and DeepStack rows still line up."""
    engine = Engine.load(tiny_vl_dir, weights="f32", kv="f32", progress=False, prefill_chunk=5)
    image = engine.prepare_image(make_picture(100, 72))
    seq = engine.start(chat_ids(engine, True), engine.sampling_params(max_tokens=1), images=[image])
    ids = seq.prompt_ids
    engine.release(seq)
    ref, _ = reference_vl(tiny_vl_dir, ids, image.pixel_values, [image.grid_thw])
    assert rel_err(engine.logits(ids, images=[image]), ref) < F32_RTOL


def test_decode_after_image_follows_rope_delta(engine_f32, tiny_vl_dir):
    """Greedy decode after an image equals the argmax of transformers' full pass over the same ids."""
    image = engine_f32.prepare_image(make_picture(100, 72))     # 2x3 merged tokens: delta -3
    prompt = chat_ids(engine_f32, True)
    out = engine_f32.generate(prompt, images=[image], stream=False, max_tokens=6, temperature=0.0, ignore_eos=True)
    seq = engine_f32.start(prompt, engine_f32.sampling_params(max_tokens=1), images=[image])
    expanded = seq.prompt_ids
    assert seq.vision.rope_delta == -3
    engine_f32.release(seq)
    ids = expanded + out["token_ids"]
    ref, _ = reference_vl(tiny_vl_dir, ids, image.pixel_values, [image.grid_thw])
    assert out["token_ids"] == ref[len(expanded) - 1:-1].argmax(-1).tolist()


def test_q8_with_image_runs_and_stays_close(tiny_vl_dir):
    """The int8 path (vision linears included) gives finite logits near the f32 ones."""
    engine = Engine.load(tiny_vl_dir, weights="q8", kv="q8", progress=False)
    image = engine.prepare_image(make_picture(100, 72))
    logits = engine.logits(chat_ids(engine, True), images=[image])
    f32 = Engine.load(tiny_vl_dir, weights="f32", kv="f32", progress=False).logits(chat_ids(engine, True),
                                                                                   images=[image])
    assert np.isfinite(logits).all()
    assert rel_err(logits, f32) < 0.1
    assert engine.model.vision.blocks[0].qkv.kind == "q8"


class _NoTimer:
    from contextlib import nullcontext as _null

    def gemm(self):
        return self._null()

    def attn(self):
        return self._null()


def test_cli_generate_with_image(tiny_vl_dir, tmp_path):
    import json
    import subprocess
    import sys

    picture = tmp_path / "camera.jpg"
    make_picture(100, 72).save(picture, quality=90)
    run = lambda *a: subprocess.run([sys.executable, "-m", "appliance", "generate", "--model", str(tiny_vl_dir),  # noqa: E731
                                     *a], capture_output=True, text=True, timeout=300)
    r = run("--image", str(picture), "--chat", "What is this?", "--max-tokens", "3", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > len(out["prompt_token_ids"])      # the placeholder became 6 image tokens
    assert len(out["token_ids"]) <= 3
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    r = run("--image", str(bad), "--chat", "What is this?", "--max-tokens", "3")
    assert r.returncode == 1 and "could not be decoded" in r.stderr
