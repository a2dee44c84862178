"""Calibration: the fit that extrapolates measured bytes (pure), a real calibration of a small model
against a direct measurement at a larger shape, a plan on a measured device, and the device measurement."""

from __future__ import annotations

import json

import pytest

from zerokit.planner.calibration import Calibration, Fit
from zerokit.planner.device import DeviceProfile

SHAPES = [(b, s) for s in (64, 128) for b in (1, 2, 4, 8)]


def test_fit_is_exact_for_per_token_and_attention_terms():
    truth = lambda b, s: 1000 + 300 * b * s + 2 * b * s * s  # noqa: E731
    fit = Fit.of([(b, s, truth(b, s)) for b, s in SHAPES])
    assert fit(4, 1024) == pytest.approx(truth(4, 1024), rel=1e-9)


def test_fit_takes_the_larger_of_two_regimes():
    """A parameter-sized gradient sets the peak at small shapes, the logits' gradients at large ones."""
    truth = lambda b, s: max(77e6, 400_000 * b * s)  # noqa: E731
    fit = Fit.of([(b, s, truth(b, s)) for b, s in SHAPES])
    assert fit.floor == 77e6
    assert fit(1, 16) == 77e6 and fit(8, 1024) == pytest.approx(truth(8, 1024), rel=1e-9)


def test_calibration_extrapolates_to_a_larger_shape(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zerokit.profiling.calibrate import _measure, calibrate, hf_inputs
    from zerokit.profiling.inventory import blocks_of

    config = transformers.GPT2Config(vocab_size=500, n_positions=256, n_embd=64, n_layer=3, n_head=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    calibration = calibrate(model, precision="fp32", seqs=(16, 32))
    path = tmp_path / "calibration.json"
    calibration.save(path)
    assert Calibration.load(path) == calibration
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    direct = _measure(model.train(), list(blocks_of(model)), hf_inputs(500, torch.device("cpu")), lambda o: o.loss,
                      4, 192, torch.device("cpu"))
    assert calibration.activations(4, 192) == pytest.approx(direct["saved"], rel=0.01)
    predicted = calibration.phase_peaks(4, 192)
    assert max(predicted.values()) == pytest.approx(direct["peak"], rel=0.05)


def _profile(**changes) -> DeviceProfile:
    numbers = dict(name="a given CPU", peak_flops={"fp32": 1e11, "bf16": 2e11}, memory_bandwidth=2e10,
                   link_bandwidth=1e9, link_latency=1e-4, optimizer_seconds_per_element={"adamw": 2e-9},
                   resident_bytes=250 * 2**20, memory_bytes=16 * 2**30, source="given by hand")
    return DeviceProfile(**{**numbers, **changes})


def test_plan_on_a_given_cpu_with_a_calibration(tmp_path, capsys):
    import zerokit.cli

    device = tmp_path / "device.json"
    _profile().save(device)
    calibration = tmp_path / "calibration.json"
    samples = [{"batch": b, "seq": s} for b, s in SHAPES]
    fits = {"block": Fit((0.0, 1000.0, 0.0, 0.0)), "outside": Fit((0.0, 5000.0, 0.0, 0.0)),
            "forward": Fit((0.0, 100.0, 0.0, 0.0)), "head": Fit((0.0, 3000.0, 0.0, 0.0)),
            "blocks": Fit((0.0, 0.0, 0.0, 0.0)), "tail": Fit((1e6, 0.0, 0.0, 0.0))}
    Calibration(model="gpt2", precision="fp32", device="cpu", n_layers=2, samples=tuple(samples), **fits).save(calibration)
    assert zerokit.cli.main(["plan", "--model", "gpt2", "--gpu", "cpu", "--gpus-per-node", "2", "--device-file",
                             str(device), "--calibration", str(calibration), "--dtype", "fp32", "--seq-len", "256",
                             "--micro-batch", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    stage0 = plan["stages"][0]
    assert stage0["memory_bytes"]["activations"] == 12 * 1000 * 512 + 5000 * 512  # 12 blocks + outside, b*s = 512
    assert stage0["comm_stats_per_step"]["all_reduce"]["elements"] >= 124_439_808  # gloo: all-reduce
    assert plan["pick"]["seconds"]["gpu_optimizer"] == pytest.approx(124_439_808 * 2e-9, rel=1e-6)


def test_device_profile_rejects_nonsense(tmp_path):
    with pytest.raises(ValueError, match="link_bandwidth"):
        _profile(link_bandwidth=0)
    with pytest.raises(ValueError, match="does not exist"):
        DeviceProfile.load(tmp_path / "missing.json")
    assert _profile().with_overrides(peak_flops=5e10).peak_flops == {"fp32": 5e10, "bf16": 5e10}


def test_measure_device_on_this_machine(capsys, tmp_path):
    pytest.importorskip("torch")
    import zerokit.cli

    path = tmp_path / "device.json"
    assert zerokit.cli.main(["plan", "--measure-device", str(path)]) == 0
    device = DeviceProfile.load(path)
    assert device.peak_flops["fp32"] > 1e8 and device.memory_bandwidth > 1e8 and device.link_bandwidth > 1e6
    assert device.resident_bytes > 50 * 2**20
    assert all(device.optimizer_seconds_per_element[f"{kind}{fused}"] > 0
               for kind in ("adamw", "adam", "sgd", "sgd-momentum") for fused in ("", " fused"))
    assert "gloo link" in capsys.readouterr().out
