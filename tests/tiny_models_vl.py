"""Tiny random Qwen3-VL checkpoints (Qwen3VLForConditionalGeneration), saved as Hugging Face ships them.

The layout is the real one: config.json with text_config / vision_config,
model.language_model.* and model.visual.* tensors, preprocessor_config.json, and a
tokenizer whose chat template renders image parts as
<|vision_start|><|image_pad|><|vision_end|> (Qwen3-VL's own rendering of an image).
"""
from __future__ import annotations

import json
from pathlib import Path

from tiny_models import CORPUS

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]

# The Qwen3-VL template's handling of content lists, reduced to images and text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pixel budget of the tiny processor: images land on grids of a few 16-pixel patches.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "do_convert_rgb": True, "resample": 3,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 12},
}


def write_tokenizer_vl(out: Path, vocab_size: int = 512) -> dict[str, int]:
    """A byte-level BPE tokenizer with Qwen's vision tokens; returns the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 32768, "tokenizer_class": "Qwen2Tokenizer"}))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return {name: tok.token_to_id(name) for name in SPECIAL} | {"vocab": tok.get_vocab_size()}


def build_qwen3_vl(out: Path, *, hidden=64, intermediate=128, layers=3, heads=4, kv_heads=2, head_dim=32,
                   mrope_section=(6, 5, 5), vision_hidden=64, vision_heads=2, vision_depth=3,
                   vision_intermediate=128, deepstack=(0, 1), pos_embeddings=64, tied=True, seed=0,
                   dtype="float32") -> Path:
    """Save a random Qwen3VLForConditionalGeneration (and tokenizer, processor config) under `out`."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = write_tokenizer_vl(out)
    torch.manual_seed(seed)
    cfg = Qwen3VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         vocab_size=ids["vocab"], max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": list(mrope_section), "mrope_interleaved": True},
                         eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, num_heads=vision_heads,
                           intermediate_size=vision_intermediate, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=pos_embeddings,
                           deepstack_visual_indexes=list(deepstack), hidden_act="gelu_pytorch_tanh"),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tied)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a missing one would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"]],
                                                            "do_sample": False}))
    return out


def test_picture(width: int = 100, height: int = 72):
    """A deterministic RGB picture (gradients, a disc, stripes) as a PIL image."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    b = np.where((x - width / 2) ** 2 + (y - height / 2) ** 2 < (min(width, height) / 3) ** 2, 230.0, 40.0)
    b = b + 20 * ((x // 7) % 2)
    return Image.fromarray(np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8), "RGB")


def reference_vl(model_dir: Path, ids: list[int], pixel_values=None, grid_thw=None):
    """transformers' float32 logits float32[len(ids), vocab] (and, with an image, the vision tower's
    merged output and deepstack features)."""
    import numpy as np
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    kwargs = {}
    vision = None
    if pixel_values is not None:
        pv = torch.from_numpy(np.asarray(pixel_values, np.float32))
        thw = torch.tensor(np.asarray(grid_thw), dtype=torch.long)
        image_token = model.config.image_token_id
        kwargs = dict(pixel_values=pv, image_grid_thw=thw,
                      mm_token_type_ids=(input_ids == image_token).int())
        with torch.no_grad():
            out = model.model.visual(pv, grid_thw=thw, return_dict=True)
        vision = (out.pooler_output.numpy(), [f.numpy() for f in out.deepstack_features])
    with torch.no_grad():
        logits = model(input_ids=input_ids, **kwargs).logits[0].numpy()
    return logits, vision
