"""The engine's choices (formats, sparse attention, speculative draft length), each named once.

The CLI flags, the server's settings (appliance/config.py) and the Ansible role's argument
specs take their choices and defaults from here (tests/test_settings_schema.py compares them).
Light on purpose: no numpy, no kernels, so that settings load before the engine does.
"""
from __future__ import annotations

from dataclasses import dataclass

WEIGHT_FORMATS = ("q8", "q4", "f32")     # Q8_0, Q4_0 (docs/engine.md), or float32 for reference runs
KV_FORMATS = ("q8", "q4", "f32")         # per (token, kv head) int8, 32-element 4-bit blocks, float32
PROBE_MODES = ("bound", "strided")       # how block-sparse attention scores blocks (engine/sparse.py)
DEFAULT_MAX_CONTEXT = 32768              # context cap when neither the caller nor the model says less
KV_BLOCK = 32                            # positions per KV cache block without sparse attention
MAX_DRAFT_TOKENS = 16                    # speculative rows per sequence and step a request may ask to verify


@dataclass(frozen=True)
class SparseConfig:
    """Block-sparse attention (docs/engine.md, "Block-sparse attention")."""

    k: int = 32                # blocks kept per head
    block: int = 32            # positions per block (the KV cache's block size)
    probe: int = 8             # sampled rows per block (probe_mode "strided")
    probe_mode: str = "bound"  # "bound" | "strided" (engine/sparse.py says why bound is the default)

    def __post_init__(self):
        for name in ("k", "block", "probe"):
            if getattr(self, name) < 1:
                raise ValueError(f"sparse {name} must be >= 1, got {getattr(self, name)}")
        if self.block % 8:
            raise ValueError(f"sparse block must be a multiple of 8, got {self.block}")
        if self.probe_mode not in PROBE_MODES:
            raise ValueError(f"sparse probe_mode must be one of {', '.join(PROBE_MODES)}, not {self.probe_mode!r}")

    def active(self, seq_len: int) -> bool:
        """The gate: sparse only pays once the context is long enough."""
        return seq_len > 2 * self.block

    def decodes_sparse(self, seq_len: int, n_blocks: int) -> bool:
        """Whether a decode step over n_blocks visible blocks reads k of them, not all.

        A sparse step reads K and V of its k blocks, K of the probe's k candidates and the bound
        rows; it reads less than exact attention and does fewer dot products only once the context
        holds more than 2k blocks. Below that it was slower and no more exact: on a Zen 4 at 2048
        tokens (k = 32, 64 blocks) 10.4 ms of attention a step against exact's 8.3; at 3072 and
        4096 it was faster (9.3 against 11.9, 10.0 against 11.4).
        """
        return self.active(seq_len) and n_blocks > 2 * self.k
