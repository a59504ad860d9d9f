"""What an embedding or rerank job reports (plain data, like engine/stats.py: telemetry/metrics.py
turns it into series)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RetrievalStats:
    """One embedding or rerank job: what it computed and where the time went."""

    task: str                # "embed" | "rerank"
    n_inputs: int            # inputs embedded, or documents scored
    n_tokens: int            # rows computed
    n_passes: int            # batched forward passes
    total_s: float = 0.0
    gemm_s: float = 0.0
    attn_s: float = 0.0

    def log_line(self) -> str:
        return (f"[{self.task}] inputs={self.n_inputs} tokens={self.n_tokens} passes={self.n_passes} "
                f"total_s={self.total_s:.3f} gemm_s={self.gemm_s:.3f} attn_s={self.attn_s:.3f}")
