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

        A sparse step reads K and V of its k blocks, K of the probe's k candidates and every block's
        bound rows, and probes and selects before it attends; exact attention streams every block
        in memory order. Sparse only pays once the context holds more than 3k blocks. Zen 4, k = 32,
        both paths alternated step by step over one cache (ms of attention a step): 2100 tokens
        (66 blocks) 7.56 sparse against 5.86 exact, 3072 7.89 against 7.34, 4096 8.32 against 9.31,
        8192 9.62 against 17.55. Below the gate the output is exact attention's.
        """
        return self.active(seq_len) and n_blocks > 3 * self.k
