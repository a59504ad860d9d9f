"""The weight average of the demo model's chat stage (scripts/demo_weight_average.py): the
arithmetic against a hand-computed average, that a measurement inside `swapped_in` sees the
average and training resumes on its own weights, and a resumed average."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]
from demo_weight_average import WeightAverage  # noqa: E402

torch = pytest.importorskip("torch")


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


def step(model, value: float):
    """Stand-in for an optimizer step: every weight becomes `value`."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def test_average_follows_the_recurrence():
    model = small_model()
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = WeightAverage(model, 0.9)
    step(model, 1.0)
    average.update()
    step(model, 3.0)
    average.update()
    for name, start in first.items():
        expected = 0.9 * (0.9 * start + 0.1 * 1.0) + 0.1 * 3.0
        torch.testing.assert_close(average.avg[name], expected)


def test_swapped_in_measures_the_average_and_restores_the_weights():
    model = small_model()
    average = WeightAverage(model, 0.5)
    step(model, 2.0)
    average.update()
    step(model, 4.0)
    x = torch.ones(1, 4)
    with average.swapped_in():
        inside = model(x)
        assert all(torch.equal(p, average.avg[n]) for n, p in model.named_parameters())
    assert all(bool((p == 4.0).all()) for p in model.parameters())
    assert not torch.equal(inside, model(x))


def test_resumed_average_carries_on_and_a_foreign_one_starts_over():
    model = small_model()
    average = WeightAverage(model, 0.5)
    step(model, 2.0)
    average.update()
    saved = average.state_dict()
    resumed = WeightAverage(model, 0.5, saved)
    assert all(torch.equal(resumed.avg[n], saved[n]) for n in saved)
    foreign = WeightAverage(model, 0.5, {"other.weight": torch.zeros(2)})
    assert all(torch.equal(foreign.avg[n], p) for n, p in model.named_parameters())


def test_copy_in_leaves_the_average_for_export():
    model = small_model()
    average = WeightAverage(model, 0.5)
    step(model, 2.0)
    average.update()
    average.copy_in()
    assert all(torch.equal(p, average.avg[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_decay_out_of_range_is_refused(decay):
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(small_model(), decay)
