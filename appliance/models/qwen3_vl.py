"""Qwen3-VL (Qwen3-VL-2B/8B-Instruct): the Qwen3 decoder with M-RoPE and DeepStack, plus a vision tower.

Checkpoint: the decoder under `model.language_model.*` (Qwen3's layers exactly), the
vision tower under `model.visual.*` (appliance.vision), `lm_head.weight` unless tied.

Differences from Qwen3 in the decoder:
- Interleaved M-RoPE. Every row has three positions (temporal, height, width);
  frequency i of a head rotates by the height position when i % 3 == 1 and
  i < 3 * mrope_section[1], by the width position when i % 3 == 2 and
  i < 3 * mrope_section[2], else by the temporal one. Text rows have t = h = w, so
  they rotate exactly as 1-D RoPE and take the kernel path; only prefill rows of image
  tokens (where the three differ) take the numpy path.
- Image tokens. The prompt holds one <|image_pad|> per merged 2x2 patch group; their
  embeddings are replaced by the vision tower's output. An image of gh x gw merged
  tokens starting at position p gets (t, h, w) = (p, p + row, p + col), and the text
  after it continues at p + max(gh, gw): positions past an image run behind the row
  index by `rope_delta`, which decode steps keep adding.
- DeepStack: after decoder layer j (j < number of DeepStack features) the j-th
  feature of each image token is added to its hidden state.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from appliance.models import images as image_io
from appliance.kernels.dispatch import kernels
from appliance.models.vision import VisionConfig, VisionTower, vision_plan
from appliance.engine.batch import Batch
from appliance.errors import ModelLoadError
from appliance.models.qwen3 import Qwen3Attention, Qwen3Config, Qwen3Layer, Qwen3Model, attention_plan, head_plan, mlp_plan

PREFIX = "model.language_model."


@dataclass
class Qwen3VLConfig(Qwen3Config):
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    vision: VisionConfig | None = None
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @classmethod
    def from_dict(cls, d: dict, path) -> "Qwen3VLConfig":
        """config.json of a qwen3_vl checkpoint: text_config, vision_config, the image token ids."""
        text = dict(d.get("text_config") or {})
        if not text or not d.get("vision_config"):
            raise ModelLoadError(path, "a qwen3_vl config needs text_config and vision_config")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        section = rope.pop("mrope_section", None) or cls.mrope_section
        rope.pop("mrope_interleaved", None)
        text["rope_parameters"] = rope
        text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
        base = Qwen3Config.from_dict(text, path)
        try:
            cfg = cls(**asdict(base), mrope_section=tuple(int(s) for s in section),
                      vision=VisionConfig.from_dict(d["vision_config"], path),
                      image_token_id=int(d.get("image_token_id", cls.image_token_id)),
                      vision_start_token_id=int(d.get("vision_start_token_id", cls.vision_start_token_id)),
                      vision_end_token_id=int(d.get("vision_end_token_id", cls.vision_end_token_id)))
        except (TypeError, ValueError) as e:
            raise ModelLoadError(path, f"bad value ({e})") from None
        if len(cfg.mrope_section) != 3 or sum(cfg.mrope_section) != cfg.head_dim // 2:
            raise ModelLoadError(path, f"mrope_section {list(cfg.mrope_section)} must be 3 numbers summing to "
                                     f"head_dim / 2 = {cfg.head_dim // 2}")
        if cfg.vision.out_hidden_size != cfg.hidden_size:
            raise ModelLoadError(path, f"vision out_hidden_size {cfg.vision.out_hidden_size} is not the text "
                                     f"hidden_size {cfg.hidden_size}")
        if len(cfg.vision.deepstack_visual_indexes) > cfg.num_hidden_layers:
            raise ModelLoadError(path, "more DeepStack features than decoder layers")
        return cfg

    def mrope_axis(self) -> np.ndarray:
        """intp[head_dim / 2]: which position (0 t, 1 h, 2 w) rotates each frequency (interleaved)."""
        i = np.arange(self.head_dim // 2)
        axis = np.zeros_like(i)
        axis[(i % 3 == 1) & (i < 3 * self.mrope_section[1])] = 1
        axis[(i % 3 == 2) & (i < 3 * self.mrope_section[2])] = 2
        return axis


def tensor_plan(cfg: Qwen3VLConfig, prefix: str = PREFIX):
    plan = head_plan(cfg, prefix)
    for i in range(cfg.num_hidden_layers):
        plan += attention_plan(cfg, i, prefix) + mlp_plan(cfg, i, prefix)
    return plan + vision_plan(cfg.vision)


@dataclass
class VisionPrompt:
    """A prompt's images and where their tokens sit; the family's per-sequence state.

    images: the preprocessed images, in prompt order
    image_index: int32[n_prompt] index of each prompt row into `embeds`, -1 for text rows
    positions: int32[3, n_prompt] (t, h, w) RoPE positions of the prompt rows
    rope_delta: RoPE position minus row index for every row after the prompt
    embeds: float32[n_image_tokens, hidden] once encoded; deepstack: one such array per feature
    """

    images: list
    image_index: np.ndarray
    positions: np.ndarray
    rope_delta: int
    embeds: np.ndarray | None = None
    deepstack: list = field(default_factory=list)

    @property
    def n_image_tokens(self) -> int:
        return int((self.image_index >= 0).sum())

    def rope_positions(self, rows: np.ndarray) -> np.ndarray:
        """int32[3, len(rows)] for sequence rows (prompt rows from the table, later rows by the delta)."""
        n = self.positions.shape[1]
        out = np.repeat((rows + self.rope_delta)[None, :], 3, axis=0).astype(np.int32)
        inside = rows < n
        out[:, inside] = self.positions[:, rows[inside]]
        return out


class Qwen3VLAttention(Qwen3Attention):
    def __init__(self, cfg: Qwen3VLConfig, i: int, kind: str, t: dict):
        super().__init__(cfg, i, kind, t)
        self.axis = cfg.mrope_axis()

    def rope(self, x: np.ndarray, batch: Batch) -> None:
        if batch.mrope_positions is None:
            kernels.rope(x, batch.positions, batch.inv_freq)
            return
        # angle[m, i] = positions[axis[i], m] * inv_freq[i]; then rotate-half as kernels.rope.
        pos = batch.mrope_positions.astype(np.float32)[self.axis]            # [hd/2, M]
        angle = pos.T * batch.inv_freq[None, :]                              # [M, hd/2]
        c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        half = x.shape[-1] // 2
        x0, x1 = x[..., :half].copy(), x[..., half:].copy()
        x[..., :half] = x0 * c - x1 * s
        x[..., half:] = x1 * c + x0 * s


class Qwen3VLModel(Qwen3Model):
    config_class = Qwen3VLConfig

    def __init__(self, cfg: Qwen3VLConfig, kind: str, tensors: dict):
        super().__init__(cfg, kind, tensors)
        self.vision = VisionTower(cfg.vision, kind, tensors)
        self.image_config: image_io.ImageProcessorConfig | None = None   # set by the loader

    def make_layer(self, cfg: Qwen3VLConfig, i: int, kind: str, tensors: dict) -> Qwen3Layer:
        layer = Qwen3Layer(cfg, i, kind, tensors)
        layer.attention = Qwen3VLAttention(cfg, i, kind, tensors)
        return layer

    # ---- images ----------------------------------------------------------------------------
    def prepare_vision(self, prompt_ids: list[int], images: list) -> tuple[list[int], VisionPrompt]:
        """Expand each image's <|image_pad|> to its token count; M-RoPE positions of the prompt.

        prompt_ids may hold one <|image_pad|> per image (as the chat template renders them)
        or the already expanded run of each image.
        """
        cfg = self.cfg
        pad = cfg.image_token_id
        counts = [img.n_tokens for img in images]
        n_pad = sum(1 for t in prompt_ids if t == pad)
        if n_pad == len(images) and n_pad != sum(counts):
            ids: list[int] = []
            it = iter(counts)
            for t in prompt_ids:
                ids.extend([pad] * next(it) if t == pad else [t])
        elif n_pad == sum(counts):
            ids = list(prompt_ids)
        else:
            raise ValueError(f"the prompt has {n_pad} image tokens for {len(images)} image(s) "
                             f"({sum(counts)} image tokens)")
        merge = cfg.vision.spatial_merge_size
        n = len(ids)
        image_index = np.full(n, -1, np.int32)
        positions = np.zeros((3, n), np.int32)
        current, row, token = 0, 0, 0
        for img in images:
            start = ids.index(pad, row)
            text = np.arange(start - row, dtype=np.int32) + current
            positions[:, row:start] = text
            current += start - row
            _, gh, gw = img.grid_thw
            lh, lw = gh // merge, gw // merge
            hh, ww = np.meshgrid(np.arange(lh), np.arange(lw), indexing="ij")
            end = start + lh * lw
            positions[0, start:end] = current
            positions[1, start:end] = current + hh.reshape(-1)
            positions[2, start:end] = current + ww.reshape(-1)
            image_index[start:end] = np.arange(token, token + lh * lw)
            token += lh * lw
            current += max(lh, lw)
            row = end
        positions[:, row:] = np.arange(n - row, dtype=np.int32) + current
        delta = int(positions.max()) + 1 - n if n else 0
        return ids, VisionPrompt(list(images), image_index, positions, delta)

    def encode_images(self, vision: VisionPrompt, timer) -> None:
        """Run the vision tower over the prompt's images (fills vision.embeds and .deepstack)."""
        outs = [self.vision(img.pixel_values, img.grid_thw, timer) for img in vision.images]
        vision.embeds = np.concatenate([o[0] for o in outs]) if outs else np.zeros((0, self.cfg.hidden_size),
                                                                                   np.float32)
        vision.deepstack = [np.concatenate([o[1][j] for o in outs]) for j in range(len(self.vision.deepstack))]

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, batch: Batch, attention, timer) -> np.ndarray:
        batch.inv_freq = self.inv_freq
        h = self.embed.lookup(batch.token_ids)
        rows, tokens, deepstack = self._place_images(batch, h)
        for j, layer in enumerate(self.layers):
            layer.forward(h, batch, attention, timer)
            for seg_rows, seg_tokens, features in zip(rows, tokens, deepstack):
                if j < len(features):
                    h[seg_rows] += features[j][seg_tokens]
        return kernels.rmsnorm(h, self.norm, self.cfg.rms_norm_eps)

    def _place_images(self, batch: Batch, h: np.ndarray):
        """Image embeddings into h at image-token rows; M-RoPE positions when rows need them.

        Returns, per segment with image rows: the batch rows, their indices into the
        image tokens, and the segment's DeepStack features.
        """
        batch.mrope_positions = None
        rows, tokens, deepstack = [], [], []
        segments = [s for s in batch.segments if s.vision is not None]
        if not segments:
            return rows, tokens, deepstack
        mrope = np.repeat(batch.positions[None, :], 3, axis=0).astype(np.int32)
        for seg in segments:
            vision: VisionPrompt = seg.vision
            seq_rows = np.arange(seg.pos_start, seg.pos_start + seg.row_end - seg.row_start)
            mrope[:, seg.row_start:seg.row_end] = vision.rope_positions(seq_rows)
            in_prompt = seq_rows[seq_rows < len(vision.image_index)]
            index = vision.image_index[in_prompt]
            image_rows = np.nonzero(index >= 0)[0]
            if len(image_rows):
                if vision.embeds is None:
                    raise RuntimeError("the sequence's images were not encoded before its prefill")
                batch_rows = seg.row_start + image_rows
                h[batch_rows] = vision.embeds[index[image_rows]]
                rows.append(batch_rows)
                tokens.append(index[image_rows])
                deepstack.append(vision.deepstack)
        if not (mrope == mrope[0]).all():
            batch.mrope_positions = mrope
        else:                       # text rows, or rows after the prompt: plain 1-D RoPE at t
            batch.positions = np.ascontiguousarray(mrope[0])
        return rows, tokens, deepstack


Config = Qwen3VLConfig
Model = Qwen3VLModel
