"""Lightning's Trainer runs zerokit (issue 23): tests/scripts/lightning_fit.py, a fit of a small token model with
accumulation (a short last window per epoch), clipping, a warm-up schedule and a validation pass, launched with
torchrun on 2 gloo ranks under `strategy="ddp"` (Lightning's own DeepSpeed strategy refuses CPUs, so DDP is the
reference), under ZerokitStrategy(config=...) and under the registered names, at stages 2 and 3. Per micro-batch
losses, and per optimizer step grad norms (before clipping) and learning rates, equal DDP's; the script reports
the strategy, the engine and its collectives, so that a silent fallback to DDP fails; a fit resumed through
ckpt_path from the first epoch's end reproduces the uninterrupted one exactly; trainer.save_checkpoint(...,
weights_only=True) loads into the plain model, equal to DDP's weights. A launch costs 10-15 s here, nearly all of it
imports: the five fits share one torchrun launch (zerokit.testing.jobs), made once per module. The DDP fit and the
stage-3 object's also run extra fits: configure_model() (stage 3 builds on the meta device), bf16 and fp16; those
and the stage-2 object's run an epoch ended inside an accumulation window, saved there and resumed (issue 31).

Tolerance: fp32; DDP all-reduces its gradient buckets, zerokit reduces flat buckets and steps AdamW on flat master
pieces, so sums are added in another order (measured: losses near 4 within 1.2e-7 relative, grad norms within
9.3e-8). 2e-6 relative leaves room and fails a real difference (a window ended one batch late, a missed clip, a
schedule step lost). Weights after 6 AdamW steps of lr 3e-3: within 6.7e-7 absolute (Adam divides each gradient by
its own root mean square, so an element whose gradient is near zero moves by the order-of-summation noise
magnified); 2e-6 is under a thousandth of one step's size, which is what a lost or different step moves a weight.

16-bit runs against DDP's fp32 (Lightning's own 16-bit is autocast, which keeps other ops in fp32, so it is no
closer a reference): zerokit computes with 16-bit copies of the fp32 masters, so each loss, grad norm and
validation loss carries the rounding of its 16-bit inputs, averaged over the many terms of each sum. Bound: one
rounding of the quantity itself, 2^-8 relative for bf16 (8 significant bits) and 2^-11 for fp16 (11); measured
over 6 steps: bf16 2.3e-4 on losses, 1.1e-3 on grad norms; fp16 7.3e-5 and 1.5e-4. The runs must also differ from
DDP by more than the fp32 tolerance, or they did not compute in 16 bits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_hf_trainer import environment
from zerokit.testing.jobs import Job, launch

pytest.importorskip("lightning")

from lightning.pytorch import Trainer  # noqa: E402

from zerokit.config.typed import ZeroConfig  # noqa: E402
from zerokit.integrations.lightning import (ZerokitPrecision, ZerokitStrategy, as_zerokit_precision,  # noqa: E402
                                            engine_config)

SCRIPTS = Path(__file__).parent / "scripts"
TOLERANCE, WEIGHTS_TOLERANCE = 2e-6, 2e-6
HALF_TOLERANCE = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # one rounding, relative: See the module docstring
HALF_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
EXTRAS = {"ddp": "configured,cut", "object2": "cut", "object3": "configured,bf16,fp16,cut"}  # fits added to these
QUANTITIES = ("losses", "grad_norms", "lrs", "val_losses")
ENGINE = "zerokit.integrations.lightning.LightningEngine"
ZEROKIT_RUNS = {"object2": ("object:2", 2), "object3": ("object:3", 3), "name2": ("zerokit_stage_2", 2),
                "name3": ("zerokit_stage_3", 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    """Lightning's DDP, then zerokit four ways (each with a resumed second fit): one torchrun launch for all five
    (See [Note: jobs forked inside one torchrun launch])."""
    root = tmp_path_factory.mktemp("lightning")
    jobs = []
    for name, (strategy, _) in {"ddp": ("ddp", None), **ZEROKIT_RUNS}.items():
        resume = [] if name == "ddp" else ["--resume"]
        extra = ["--extra", EXTRAS[name]] if name in EXTRAS else []
        jobs.append(Job(name, [str(SCRIPTS / "lightning_fit.py"), "--out", str(root / name), "--strategy", strategy,
                               *resume, *extra], preload=("lightning.pytorch", "zerokit.integrations.lightning")))
    outcomes = launch(jobs, root / "jobs", env=environment())
    out = {}
    for job in jobs:
        outcomes.check(job.name)
        out[job.name] = [json.loads((root / job.name / f"rank{rank}.json").read_text()) for rank in range(2)]
    return root, out


def relative(expected: list[float], got: list[float]) -> float:
    assert len(expected) == len(got) and expected
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(expected, got))


def assert_zerokit_trained(result: dict, stage: int) -> None:
    """Not a silent fallback to DDP: zerokit's engine at this stage, with sharded traffic (gloo reduces a
    reduce-scatter as an all-reduce; parameters come back by all-gather)."""
    assert result["strategy"] == "ZerokitStrategy" and result["precision_plugin"] == "ZerokitPrecision"
    assert result["engine"] == ENGINE and result["stage"] == stage
    calls = result["comm_calls"]
    assert calls["all_reduce"] + calls["reduce_scatter"] > 0 and calls["all_gather"] > 0, calls


@pytest.mark.parametrize("name", list(ZEROKIT_RUNS))
def test_a_fit_trains_as_lightnings_ddp(runs, name: str) -> None:
    _, results = runs
    for rank in range(2):
        ddp, zerokit = results["ddp"][rank]["run"], results[name][rank]["run"]
        assert ddp["strategy"] == "DDPStrategy" and "engine" not in ddp
        assert len(ddp["losses"]) == 24 and len(ddp["grad_norms"]) == 6  # 2 epochs: windows of 5, 5 and 2
        assert max(ddp["grad_norms"]) > 0.5 and ddp["lrs"][0] < ddp["lrs"][-1]  # clipping bites; warm-up
        assert_zerokit_trained(zerokit, ZEROKIT_RUNS[name][1])
        assert zerokit["gradient_clipping"] == 0.5  # Trainer(gradient_clip_val=0.5)
        worst = {key: relative(ddp[key], zerokit[key]) for key in QUANTITIES}
        assert max(worst.values()) <= TOLERANCE, worst


@pytest.mark.parametrize("name", list(ZEROKIT_RUNS))
def test_ckpt_path_resumes_exactly(runs, name: str) -> None:
    """The second fit starts from the sharded checkpoint of the first epoch's end: its epoch equals the
    uninterrupted run's second epoch to the bit (learning rates included: LinearLR reads them back)."""
    _, results = runs
    for result in results[name]:
        run, resumed = result["run"], result["resumed"]
        assert_zerokit_trained(resumed, ZEROKIT_RUNS[name][1])
        assert resumed["losses"] == run["losses"][12:] and resumed["grad_norms"] == run["grad_norms"][3:]
        assert resumed["lrs"] == run["lrs"][3:] and resumed["val_losses"] == run["val_losses"][2:]


def test_configure_model_at_stage_3_builds_on_meta_and_trains_as_the_plain_build(runs) -> None:
    """configure_model() under stage 3 registers its parameters on the meta device (no rank holds the model
    whole); the engine initialises them unit by unit with the strategy's param_init, and the first loss is the
    plain (DDP) build's to the bit, the whole fit DDP's within the fp32 tolerance."""
    _, results = runs
    for rank in range(2):
        plain, sharded = results["ddp"][rank]["configured"], results["object3"][rank]["configured"]
        assert plain["built_on_meta"] is False and sharded["built_on_meta"] is True
        assert_zerokit_trained(sharded, 3)
        assert sharded["losses"][0] == plain["losses"][0]
        assert plain["losses"][0] != results["ddp"][rank]["run"]["losses"][0]  # its own init, not build_model's
        worst = {key: relative(plain[key], sharded[key]) for key in QUANTITIES}
        assert max(worst.values()) <= TOLERANCE, worst


@pytest.mark.parametrize("extra", ["bf16", "fp16"])
def test_16_bit_fits_follow_ddps_fp32_within_one_rounding(runs, extra: str) -> None:
    """bf16 from Trainer(precision="bf16-mixed"); fp16 from plugins=[ZerokitPrecision("16-mixed")], since on a
    CPU Lightning turns precision="16-mixed" into "bf16-mixed" before the strategy sees it. Both keep fp32
    masters (DeepSpeed's meaning); fp16 scales its loss dynamically and skipped no step here."""
    _, results = runs
    for rank in range(2):
        ddp, half = results["ddp"][rank]["run"], results["object3"][rank][extra]
        assert_zerokit_trained(half, 3)
        assert half["param_dtype"] == HALF_DTYPES[extra] and len(half["grad_norms"]) == len(ddp["grad_norms"]) == 6
        assert half["lrs"] == ddp["lrs"]
        worst = {key: relative(ddp[key], half[key]) for key in QUANTITIES if key != "lrs"}
        assert TOLERANCE < max(worst.values()) <= HALF_TOLERANCE[extra], worst


@pytest.mark.parametrize("name", ["object2", "object3"])
def test_an_epoch_ended_inside_a_window_saves_and_resumes_as_ddp(runs, name: str) -> None:
    """Issue 31: windows of 4 over epochs of 12 batches (a whole number of windows), the second epoch ended by
    on_train_batch_start after 6, inside a window no step ends. Its epoch-end checkpoint is saved without that
    window's gradients, and the next epoch starts without them, as DDP's zero_grad leaves it; the fit resumed from
    that checkpoint equals the uninterrupted one to the bit, and both equal DDP's within the fp32 tolerance."""
    _, results = runs
    for rank in range(2):
        ddp, cut, resumed = (results["ddp"][rank]["cut"], results[name][rank]["cut"],
                             results[name][rank]["cut_resumed"])
        assert len(ddp["losses"]) == 30 and len(ddp["grad_norms"]) == 7  # windows 4,4,4 | 4 (2 cut) | 4,4,4
        assert_zerokit_trained(cut, ZEROKIT_RUNS[name][1])
        worst = {key: relative(ddp[key], cut[key]) for key in QUANTITIES}
        assert max(worst.values()) <= TOLERANCE, worst
        assert_zerokit_trained(resumed, ZEROKIT_RUNS[name][1])
        assert resumed["losses"] == cut["losses"][18:] and resumed["grad_norms"] == cut["grad_norms"][4:]
        assert resumed["lrs"] == cut["lrs"][4:] and resumed["val_losses"] == cut["val_losses"][2:]


@pytest.mark.parametrize("name", ["object2", "name3"])
def test_weights_only_save_loads_into_the_plain_model_as_ddps(runs, name: str) -> None:
    root, _ = runs
    sys.path.insert(0, str(SCRIPTS))
    from common import build_model

    weights = {}
    for run in ("ddp", name):
        saved = torch.load(root / run / "weights.ckpt", weights_only=True)
        model = build_model()
        model.load_state_dict({key.removeprefix("net."): value for key, value in saved["state_dict"].items()})
        weights[run] = model.state_dict()
    worst = max((weights["ddp"][key] - weights[name][key]).abs().max().item() for key in weights["ddp"])
    assert 0 < worst <= WEIGHTS_TOLERANCE


# --- in one process: names, precision, and what the Trainer and the config must agree on -------------------

def test_the_names_are_registered_and_take_the_trainers_precision() -> None:
    for stage in (1, 2, 3):
        trainer = Trainer(accelerator="cpu", devices=1, strategy=f"zerokit_stage_{stage}", precision="bf16-mixed",
                          logger=False)
        assert isinstance(trainer.strategy, ZerokitStrategy)
        assert trainer.strategy.config["zero_optimization"]["stage"] == stage
        assert isinstance(trainer.precision_plugin, ZerokitPrecision) and trainer.precision_plugin.precision == \
            "bf16-mixed"


def test_the_trainers_precision_becomes_the_engines() -> None:
    bf16 = engine_config({"zero_optimization": {"stage": 2}}, "bf16-mixed", 1, None)
    assert bf16.precision.param_dtype == torch.bfloat16 and bf16.loss_scaling is None  # fp32 masters, no scaling
    fp16 = engine_config({"zero_optimization": {"stage": 2}}, "16-mixed", 1, None)
    assert fp16.precision.param_dtype == torch.float16 and fp16.loss_scaling.static_scale is None  # dynamic
    typed = engine_config(ZeroConfig(stage=3), "16-mixed", 4, 1.0)
    assert (typed.precision.param_dtype, typed.gradient_accumulation_steps, typed.gradient_clipping) == \
        (torch.float16, 4, 1.0) and typed.loss_scaling is not None
    assert as_zerokit_precision(ZerokitPrecision("16-mixed")).compute_dtype == torch.float16
    with pytest.raises(ValueError, match="'bf16-true' is not offered.*'-mixed'"):
        ZerokitPrecision("bf16-true")


@pytest.mark.parametrize("config,precision,accumulation,clip,message", [
    ({"gradient_accumulation_steps": 2}, "32-true", 4, None, "gradient_accumulation_steps=2 and Trainer"),
    ({"gradient_clipping": 1.0}, "32-true", 1, 0.5, r"gradient_clipping=1.0 and Trainer\(gradient_clip_val=0.5\)"),
    ({"bf16": {"enabled": True}}, "16-mixed", 1, None, "computes in torch.bfloat16 but Trainer"),
    ({"fp16": {"enabled": True}}, "32-true", 1, None, "computes in torch.float16 but Trainer"),
])
def test_a_config_that_disagrees_with_the_trainer_is_one_line(config, precision, accumulation, clip, message):
    with pytest.raises(ValueError, match=message) as error:
        engine_config({"zero_optimization": {"stage": 2}, **config}, precision, accumulation, clip)
    assert "\n" not in str(error.value)


def test_a_config_that_agrees_or_leaves_it_to_the_trainer_trains() -> None:
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto", "gradient_clipping": 0.5,
              "bf16": {"enabled": True}}
    typed = engine_config(config, "bf16-mixed", 3, None)
    assert (typed.gradient_accumulation_steps, typed.gradient_clipping, typed.precision.param_dtype) == \
        (3, 0.5, torch.bfloat16)


def test_the_strategys_config_is_checked_when_it_is_made(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a config .* or a stage"):
        ZerokitStrategy()
    with pytest.raises(ValueError, match=r"ZerokitStrategy\(stage=2\) but the config's zero_optimization.stage is 3"):
        ZerokitStrategy(config={"zero_optimization": {"stage": 3}}, stage=2)
    with pytest.raises(ValueError, match="zero_optimisation"):  # a misspelt key, named as zerokit names it
        ZerokitStrategy(config={"zero_optimisation": {"stage": 2}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}))
    assert ZerokitStrategy(config=str(path)).config["zero_optimization"] == {"stage": 3}
    assert ZerokitStrategy(config=ZeroConfig(stage=1), stage=1).config.stage == 1


def test_without_lightning_the_module_is_one_line_naming_its_extra() -> None:
    code = ("import importlib.util as util\nreal = util.find_spec\n"
            "util.find_spec = lambda name, *a: None if name == 'lightning' else real(name, *a)\n"
            "try:\n    import zerokit.integrations.lightning\nexcept ImportError as error:\n"
            "    print(type(error).__name__, '|', error)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ("MissingExtra | zerokit.integrations.lightning needs the lightning package, which "
                                   "is not installed; pip install 'zerokit[lightning]'")
