"""Loss scaling policy, norm and clipping arithmetic (single process, no ranks)."""

from __future__ import annotations

import math

import torch

from zerokit.config.typed import LossScaling
from zerokit.precision import (DynamicLossScaler, clip_coefficient, device_square_sum, global_grad_norm, global_norm,
                               square_sum, unscale_, unscaled_square_sum)


def test_dynamic_scale_halves_after_hysteresis_and_doubles_after_window() -> None:
    scaler = DynamicLossScaler(LossScaling(initial_scale_power=4, window=3, hysteresis=2, min_scale=2))
    assert scaler.scale == 16
    scaler.update(overflow=True)  # first overflow uses up the hysteresis: step skipped, scale kept
    assert scaler.scale == 16
    scaler.update(overflow=True)
    assert scaler.scale == 8
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 8  # a window of clean steps: the next clean one doubles it, as in DeepSpeed
    scaler.update(overflow=False)
    assert scaler.scale == 16  # and restores the hysteresis
    for _ in range(10):
        scaler.update(overflow=True)
    assert scaler.scale == 2  # never below min_loss_scale


def test_dynamic_scale_moves_as_deepspeeds_does(monkeypatch) -> None:
    """The scale after each step of a long history of overflows and clean steps is DeepSpeed 0.19.8's own
    DynamicLossScaler's (zerokit once doubled one clean step earlier)."""
    import importlib.util
    from types import SimpleNamespace

    import pytest

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: this test runs DeepSpeed's own loss scaler")
    import deepspeed.runtime.fp16.loss_scaler as ds_scaler

    monkeypatch.setattr(ds_scaler, "dist", SimpleNamespace(get_rank=lambda: 1))  # its overflow log asks the rank
    theirs = ds_scaler.DynamicLossScaler(init_scale=2.0**10, scale_window=3, delayed_shift=2, min_scale=1.0,
                                         consecutive_hysteresis=False, raise_error_at_min_scale=False)
    ours = DynamicLossScaler(LossScaling(initial_scale_power=10, window=3, hysteresis=2, min_scale=1.0))
    history = torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.2
    for overflow in history.tolist():
        theirs.update_scale(overflow)
        ours.update(overflow)
        assert ours.scale == theirs.cur_scale


def test_static_scale_never_moves() -> None:
    scaler = DynamicLossScaler(LossScaling(static_scale=128.0))
    scaler.update(overflow=True)
    assert scaler.scale == 128.0 and not scaler.is_dynamic


def test_norm_and_clip_match_torch() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(7, 3), torch.randn(11)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    norm = global_grad_norm(grads, comm=None)
    assert math.isclose(norm, torch_norm.item(), rel_tol=1e-6)
    coefficient = clip_coefficient(norm, 0.5)
    for param, grad in zip(params, grads):
        torch.testing.assert_close(grad * coefficient, param.grad)
    assert clip_coefficient(0.1, 0.5) == 1.0 and clip_coefficient(9.0, 0.0) == 1.0


def test_non_finite_gradients_give_nan_norm() -> None:
    assert math.isnan(global_grad_norm([torch.tensor([1.0, float("inf")])], comm=None))
    assert math.isnan(global_grad_norm([torch.tensor([float("nan")])], comm=None))


def test_unscale() -> None:
    grads = [torch.tensor([4.0, 8.0])]
    unscale_(grads, 4.0)
    assert grads[0].tolist() == [1.0, 2.0]


def test_squares_taken_before_unscaling_count_as_the_unscaled_ones() -> None:
    """[Note: squares taken before the gradient leaves the device]: an offload tier's sum, taken of the scaled
    gradient, divided by the scale's square, is the sum of the unscaled gradient's squares; an inf among them is
    still a nan norm."""
    torch.manual_seed(0)
    scale = 2.0 ** 12
    scaled = [torch.randn(70_001) * scale, torch.randn(5) * scale]
    taken = [device_square_sum([scaled[0]]), None]  # the first offloaded, the second read at the step
    unscaled = [grad.clone() for grad in scaled]
    unscale_(unscaled, scale)
    assert unscaled_square_sum(unscaled, taken, scale) == square_sum(unscaled)
    assert unscaled_square_sum(unscaled, [device_square_sum([scaled[0]]), device_square_sum([scaled[1]])],
                               scale) == square_sum(unscaled)
    overflowed = [device_square_sum([torch.tensor([1.0, float("inf")])])]
    assert math.isnan(global_norm(unscaled_square_sum([torch.ones(2)], overflowed, scale), None))
