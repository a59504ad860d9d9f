"""What a model family asks of a checkpoint: one TensorSpec per tensor it runs on."""
from __future__ import annotations

from dataclasses import dataclass


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
