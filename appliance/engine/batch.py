"""The rows one forward pass computes, and whose they are: what the engine hands a model family."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from appliance.engine.kv_cache import SequenceBlocks


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
    prefill: bool = False          # prompt rows: block-sparse attention chooses their blocks as a
                                   # prefill does, even for a one-row chunk


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
