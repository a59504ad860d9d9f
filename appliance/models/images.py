"""Images in, patches out: what Qwen2-VL/Qwen3-VL's image processor does, without torch.

    cfg = ImageProcessorConfig.from_model_dir(model_dir)     # preprocessor_config.json
    image = prepare_image(data_bytes, cfg)                    # ImageInput: patches + grid

Steps, in the processor's exact order: decode (Pillow) -> RGB (transparency composited
onto white) -> resize with bicubic to `smart_resize`'s size (both sides multiples of
patch_size * merge_size, the pixel count inside [min_pixels, max_pixels], aspect ratio
kept) -> rescale to [0, 1] -> normalize by mean/std -> patchify: one row per patch, the
patches ordered merge-block by merge-block (so the merger's 2x2 groups are consecutive
rows), each row laid out (channel, frame, y, x) with the image repeated over the
temporal_patch_size frames.

Where image bytes come from (data: URLs, allow-listed hosts) is the server's business:
appliance/server/image_fetch.py.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance.errors import ApplianceError

MAX_IMAGE_BYTES = 10 * 1024 * 1024       # an encoded image (a camera JPEG is 1-5 MB)
MAX_DECODED_PIXELS = 50_000_000          # a decoded image: refuses decompression bombs before they load


class ImageError(ApplianceError, ValueError):
    """An image the request cannot use: undecodable, too large, a refused URL."""


@dataclass
class ImageProcessorConfig:
    """The checkpoint's preprocessor_config.json (Qwen2VLImageProcessor settings; Qwen3-VL's defaults)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, d: dict) -> "ImageProcessorConfig":
        size = d.get("size") or {}
        return cls(patch_size=int(d.get("patch_size", cls.patch_size)),
                   temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
                   merge_size=int(d.get("merge_size", cls.merge_size)),
                   min_pixels=int(d.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
                   max_pixels=int(d.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
                   image_mean=tuple(float(v) for v in d.get("image_mean", cls.image_mean)),
                   image_std=tuple(float(v) for v in d.get("image_std", cls.image_std)),
                   rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)))

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> "ImageProcessorConfig":
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.exists():
            return cls()
        from appliance.errors import ModelLoadError
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise ModelLoadError(path, f"unreadable preprocessor config ({e})") from None

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merged token per factor x factor)."""
        return self.patch_size * self.merge_size


@dataclass
class ImageInput:
    """One preprocessed image.

    pixel_values: float32[n_patches, 3 * temporal_patch_size * patch_size**2], merge-block order
    grid_thw: (1, grid_h, grid_w) in patches
    """

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    merge_size: int = 2
    size: tuple[int, int] = (0, 0)          # (width, height) after resizing
    source_size: tuple[int, int] = (0, 0)   # (width, height) as decoded

    @property
    def n_tokens(self) -> int:
        """Image tokens in the prompt: one per merge_size x merge_size patches."""
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size ** 2)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of factor, pixel count in [min_pixels, max_pixels], aspect ratio kept."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f}:1 is "
                         f"over 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, max_pixels: int = MAX_DECODED_PIXELS):
    """Encoded bytes (JPEG, PNG, WebP, ...) -> an RGB PIL image; transparency goes onto white."""
    from PIL import Image

    if not data:
        raise ImageError("the image is empty")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"the image is {width}x{height} pixels, over the limit of {max_pixels} pixels")
        image.load()
    except ImageError:
        raise
    except Exception as e:  # Pillow raises many types (UnidentifiedImageError, OSError, SyntaxError...)
        raise ImageError(f"the image could not be decoded ({type(e).__name__}: {e})") from None
    return to_rgb(image)


def to_rgb(image):
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def preprocess(image, cfg: ImageProcessorConfig) -> ImageInput:
    """An RGB PIL image -> patches in the processor's order (float32, normalized)."""
    from PIL import Image

    image = to_rgb(image)
    width, height = image.size
    new_h, new_w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))  # uint8[h, w, 3]
    pixels = (resized.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, np.float32)
    std = np.asarray(cfg.image_std, np.float32)
    pixels = ((pixels - mean) / std).transpose(2, 0, 1)                                       # [3, h, w]
    return ImageInput(patchify(pixels, cfg), (1, new_h // cfg.patch_size, new_w // cfg.patch_size),
                      cfg.merge_size, size=(new_w, new_h), source_size=(width, height))


def patchify(pixels: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """float32[C, H, W] -> float32[gh * gw, C * T * P * P], rows in merge-block order."""
    c, h, w = pixels.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // p, w // p
    x = pixels.reshape(c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)                 # [gh/m, gw/m, m, m, C, P, P]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), dtype=np.float32)


def prepare_image(data: bytes, cfg: ImageProcessorConfig, max_bytes: int = MAX_IMAGE_BYTES) -> ImageInput:
    """Encoded image bytes -> ImageInput, with the size limits checked first."""
    if len(data) > max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of {max_bytes} bytes")
    return preprocess(decode_image(data), cfg)
