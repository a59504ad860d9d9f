"""An exponential moving average of a model's weights, for the demo model's chat stage.

Late in the chat stage the held-out call share swings between checkpoints ten minutes apart
(0.80 then 0.63 thinking off, at a learning rate of 7e-5): each checkpoint is one point of a
noisy walk, and picking the best of them picks noise as much as skill. The average of the
recent weights sits near the middle of that walk, so it is measured and shipped instead of the
last step's weights when `--ema-decay` is set.
"""
from __future__ import annotations

from contextlib import contextmanager


class WeightAverage:
    """avg <- decay * avg + (1 - decay) * weights, over the model's floating-point parameters.

    The average lives beside the model it was made for (one more copy of the weights);
    `swapped_in` puts it into that model for a measurement and restores the trained weights
    after, so training goes on from where it was.
    """

    def __init__(self, model, decay: float, state: dict | None = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = {name: p for name, p in model.named_parameters() if p.is_floating_point()}
        if state is not None and set(state) == set(self.params):
            self.avg = {name: t.detach().clone().to(self.params[name].dtype) for name, t in state.items()}
        else:       # no average yet (or one of another shape of model): it starts at the weights
            self.avg = {name: p.detach().clone() for name, p in self.params.items()}

    def update(self) -> None:
        import torch
        with torch.no_grad():
            for name, p in self.params.items():
                self.avg[name].lerp_(p.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict:
        return {name: t.clone() for name, t in self.avg.items()}

    def copy_in(self) -> None:
        """Leave the averaged weights in the model (for export)."""
        self._load(self.avg)

    @contextmanager
    def swapped_in(self):
        """The model holds the averaged weights inside the block, its own weights after it."""
        trained = {name: p.detach().clone() for name, p in self.params.items()}
        self.copy_in()
        try:
            yield
        finally:
            self._load(trained)

    def _load(self, weights: dict) -> None:
        import torch
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(weights[name])
