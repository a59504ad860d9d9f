"""What every model family file shares: tensor specs, the batch a forward pass sees."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelLoadError
from ..kv_cache import SequenceBlocks


@dataclass
class TensorSpec:
    """One tensor of ours and where it comes from in the checkpoint.

    kind: "linear" (quantized per the weights format; several sources are stacked
    along the output rows), "embedding" (token table, Q8_0 unless f32), "vector"
    (norm weights and biases, float32; several sources are concatenated).
    """

    name: str
    kind: str
    sources: list[str]
    shape: tuple[int, ...]
    # Output heads stay Q8_0 when the layers are Q4_0 (as llama.cpp keeps its output
    # tensor at higher precision): their error reaches every logit directly.
    at_least_q8: bool = False


@dataclass
class Segment:
    """Rows [row_start, row_end) of a batch: consecutive positions of one sequence."""

    blocks: SequenceBlocks
    row_start: int
    row_end: int
    pos_start: int
    table: np.ndarray = None       # int32[n_blocks] physical blocks of the sequence
    blockpos: np.ndarray = None    # int32[n_blocks] logical block index
    count: np.ndarray = None       # int32[n_blocks] valid tokens per block
    qpos: np.ndarray = None        # int32[rows] position of each query row
    selection: object = None       # per-layer sparse block choice, set by sparse attention
    vision: object = None          # the sequence's image inputs (a multimodal family's), or None


@dataclass
class Batch:
    """token_ids intp[M] and positions int32[M] of all rows; segments say whose rows they are."""

    token_ids: np.ndarray
    positions: np.ndarray
    segments: list[Segment] = field(default_factory=list)
    inv_freq: np.ndarray = None
    record_importance: bool = False
    # int32[3, M] (temporal, height, width) RoPE positions, set by an M-RoPE family for rows
    # where they differ (image tokens); None: every row rotates by `positions`.
    mrope_positions: np.ndarray = None


def config_error(path, problem: str) -> ModelLoadError:
    return ModelLoadError(path, problem)
