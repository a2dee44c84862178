"""A forward that saves a view of a weight (`x @ weight.T`, as a LoRA base layer with fan_in_fan_out does) at
stage 3: between forward and backward the view's gathered bucket is freed, and the backward, which reads the view
once the unit is gathered again, trains exactly as one process does. See [Note: one buffer per bucket, freed in
place] in zerokit/flat/sharded.py. One rank, in this process."""

from __future__ import annotations


import torch
from torch import nn

import zerokit


class TransposedLinear(nn.Module):
    """A weight stored (out, in) and used through a transposed view, which autograd saves for the input's gradient."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.T)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[TransposedLinear(64) for _ in range(4)])


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 64, generator=generator) for _ in range(3)]


def test_a_saved_view_of_a_weight_frees_its_bucket_and_trains_exactly(one_process) -> None:
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for batch in _batches():
        loss = reference(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())

    model = _model()
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                {"zero_optimization": {"stage": 3, "stage3_min_unit_params": 1000,
                                                       "stage3_param_persistence_threshold": 0}})
    assert len(engine.stage.units) == 5  # the root and the four layers
    losses, held_between = [], []
    for batch in _batches():
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = engine(batch).square().mean()
        views = [t for t in saved if t._base is not None and t.shape == (64, 64)]  # the weights' transposed views
        held_between.append(sum(view.untyped_storage().nbytes() for view in views))
        assert len(views) == 3  # the first layer's input needs no gradient: its view is not saved
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert held_between == [0, 0, 0]  # freed after each layer's forward, though autograd still holds the views
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
    for name, value in engine.full_state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=1e-6)
    engine.close()
