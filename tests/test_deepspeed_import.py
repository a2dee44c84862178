"""DeepSpeed ZeRO checkpoints come along (issue 25): zerokit reads what real DeepSpeed writes at stages 1-3, in
fp32 and bf16, saved at 2 and 3 ranks (a tiny model with a frozen parameter, a buffer, two param groups and a
tied weight), as DeepSpeed itself reads it, without DeepSpeed's classes and without running its pickles; and
`zerokit consolidate` writes what DeepSpeed's zero_to_fp32 returns. Bad input is named in one line."""

from __future__ import annotations

import importlib.util
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerokit.cli import main as cli_main
from zerokit.checkpoint.deepspeed_import import (DeepSpeedCheckpointError, check_model, is_deepspeed_checkpoint,
                                                 read_deepspeed_checkpoint)
from conftest import deepspeed_script
from zerokit.testing.spawn import spawn

SCRIPTS = Path(__file__).parent / "scripts"
TWO_RANKS = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]
THREE_RANKS = [(2, "fp32"), (3, "bf16")]
CASES = [f"stage{s}_{p}_w2" for s, p in TWO_RANKS] + [f"stage{s}_{p}_w3" for s, p in THREE_RANKS]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Every case written by real DeepSpeed, in two launches (2 and 3 ranks)."""
    ds_checkpoints = deepspeed_script("ds_checkpoints", "deepspeed.utils.zero_to_fp32",
                                      "these tests read checkpoints that real DeepSpeed writes")
    root = tmp_path_factory.mktemp("deepspeed")
    spawn(ds_checkpoints.write_all, 2, str(root), TWO_RANKS, timeout=600)
    spawn(ds_checkpoints.write_all, 3, str(root), THREE_RANKS, timeout=600)
    return root


def test_reads_every_layout_as_deepspeed_does(written: Path) -> None:
    for case in CASES:
        checkpoint = read_deepspeed_checkpoint(written / case / "ckpt")
        reference = torch.load(written / case / "reference.pt")
        ours = checkpoint.state_dict()
        for key, tensor in reference.items():
            assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), (case, key)
        assert ours["head.weight"] is ours["embed.weight"], case  # tied, as in zero_to_fp32's dict
        stage, world_size = checkpoint.stage, checkpoint.world_size
        assert (f"stage{stage}_{checkpoint.precision}_w{world_size}") == case
        # zero_to_fp32 leaves a stage-1 checkpoint's frozen parameters out; they are read from its `module`
        extra = set(ours) - set(reference)
        assert extra == ({"frozen.weight", "frozen.bias"} if stage == 1 else set()), case
        module = torch.load(written / case / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt",
                            weights_only=False)["module"] if stage == 1 else {}
        for key in extra:
            assert torch.equal(ours[key], module[key]), (case, key)
        assert (checkpoint.global_steps, checkpoint.global_samples, checkpoint.skipped_steps) == \
            (3, 3 * 3 * world_size, 0), case
        assert checkpoint.lr_scheduler == {"last_batch_iteration": 2}, case
        assert checkpoint.client_state == {"epoch": 4, "note": "from deepspeed"}, case
        assert [g["weight_decay"] for g in checkpoint.param_groups] == [0.1, 0.0], case
        assert checkpoint.param_groups[0]["betas"] == (0.9, 0.95), case
        assert {n: p.group for n, p in checkpoint.params.items()} == {
            "embed.weight": 0, "body.weight": 0, "out.weight": 0, "body.bias": 1, "out.bias": 1, "norm.weight": 1,
            "norm.bias": 1}, case
        assert all(float(p.step) == 3 for p in checkpoint.params.values()), case
        assert checkpoint.loss_scaler == {"cur_scale": 1.0, "dynamic": False}, case


def test_adam_moments_equal_deepspeeds_own_gather(written: Path) -> None:
    """Stage 3: each parameter's exp_avg/exp_avg_sq equal what safe_get_full_optimizer_state gathered from the
    live engine. Stages 1-2 (where that API fails on 0.19.8): equal to the stage-3 run's of the same data, which
    DeepSpeed computes exactly alike."""
    moments = {}
    for case in ("stage3_fp32_w2", "stage3_bf16_w2", "stage3_bf16_w3"):
        gathered = torch.load(written / case / "moments.pt")
        checkpoint = read_deepspeed_checkpoint(written / case / "ckpt")
        assert set(gathered) == set(checkpoint.params)
        for name, state in gathered.items():
            for key, tensor in state.items():
                assert torch.equal(getattr(checkpoint.params[name], key), tensor), (case, name, key)
        moments[case] = checkpoint
    for stage in (1, 2):
        for precision in ("fp32", "bf16"):
            checkpoint = read_deepspeed_checkpoint(written / f"stage{stage}_{precision}_w2" / "ckpt")
            for name, param in checkpoint.params.items():
                other = moments[f"stage3_{precision}_w2"].params[name]
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(getattr(param, key), getattr(other, key)), (stage, precision, name, key)


def test_consolidate_writes_what_zero_to_fp32_returns(written: Path, tmp_path: Path) -> None:
    for case in CASES:
        out = tmp_path / f"{case}.safetensors"
        assert cli_main(["consolidate", str(written / case / "ckpt"), str(out)]) == 0  # `zerokit consolidate ...`
        saved, reference = load_file(out), torch.load(written / case / "reference.pt")
        for key, tensor in reference.items():  # zero_to_fp32's script writes every floating tensor in fp32
            assert saved[key].dtype == torch.float32 and torch.equal(saved[key], tensor.float()), (case, key)
        assert set(saved) - set(reference) == ({"frozen.weight", "frozen.bias"} if "stage1" in case else set())
    trainable = tmp_path / "trainable.safetensors"
    assert cli_main(["consolidate", str(written / "stage3_bf16_w3" / "ckpt"), str(trainable), "--trainable-only",
                     "--dtype", "bf16"]) == 0
    assert sorted(load_file(trainable)) == sorted(["embed.weight", "head.weight", "body.weight", "body.bias",
                                                   "out.weight", "out.bias", "norm.weight", "norm.bias"])


class Boom:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_bad_input_is_named_in_one_line(written: Path, tmp_path: Path) -> None:
    def copy(case: str) -> Path:
        target = tmp_path / f"{case}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(written / case / "ckpt", target)
        return target

    def refused(directory: Path, match: str) -> None:
        with pytest.raises(DeepSpeedCheckpointError, match=match) as error:
            read_deepspeed_checkpoint(directory)
        assert "\n" not in str(error.value), str(error.value)

    step = "global_step3"
    missing = copy("stage2_fp32_w2")
    (missing / step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(missing, r"saved by 2 ranks but 1 optimizer files")
    gap = copy("stage3_bf16_w3")
    (gap / step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(gap, r"zero_pp_rank_1_mp_rank_00_optim_states.pt: missing")
    refused(tmp_path / "nowhere", r"latest: missing")
    truncated = copy("stage3_bf16_w2")
    path = truncated / step / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused(truncated, r"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt: truncated")
    parallel = copy("stage2_fp32_w2")
    shutil.copy(parallel / step / "mp_rank_00_model_states.pt", parallel / step / "mp_rank_01_model_states.pt")
    refused(parallel, r"mp_rank_01_model_states.pt: a pipeline-, tensor- or expert-parallel")
    unknown = copy("stage2_fp32_w2")
    state = torch.load(unknown / step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    del state["optimizer_state_dict"]["param_slice_mappings"]
    torch.save(state, unknown / step / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    refused(unknown, r"lacks param_slice_mappings: a DeepSpeed \(version 0.19.8\) layout not known here")
    hostile = copy("stage2_fp32_w2")
    marker = tmp_path / "ran"
    boom = Boom()
    boom.marker = str(marker)
    model = torch.load(hostile / step / "mp_rank_00_model_states.pt", weights_only=False)
    torch.save({**model, "client": boom}, hostile / step / "mp_rank_00_model_states.pt", pickle_protocol=2)
    refused(hostile, r"holds types this reader does not allow")
    assert not marker.exists(), "the checkpoint's pickle ran"
    checkpoint = read_deepspeed_checkpoint(written / "stage2_fp32_w2" / "ckpt")
    shapes = checkpoint.shapes()
    with pytest.raises(DeepSpeedCheckpointError, match=r"another model: body.weight is \[33, 11\] there and "):
        check_model(checkpoint, {**shapes, "body.weight": (34, 11)})
    with pytest.raises(DeepSpeedCheckpointError, match=r"the model has extra.weight that it lacks"):
        check_model(checkpoint, {**shapes, "extra.weight": (2,)})
    check_model(checkpoint, shapes)
    assert is_deepspeed_checkpoint(written / "stage2_fp32_w2" / "ckpt")
    assert not is_deepspeed_checkpoint(tmp_path / "nowhere")
    assert pickle  # the hostile file above is a pickle torch.load(weights_only=False) would run


# --- resuming in zerokit ---------------------------------------------------------------------------------
# Per zerokit world size, the (DeepSpeed case, zerokit stage) pairs resumed in one spawn: every case at 1 rank
# and stage 0; at 2 and 3 ranks each saved size at its own size and stage, and each saved stage at another size
# and another stage.
RESUMES = {1: [(case, 0) for case in CASES],
           2: [("stage1_fp32_w2", 1), ("stage2_bf16_w2", 2), ("stage3_fp32_w2", 3), ("stage2_fp32_w3", 3),
               ("stage3_bf16_w3", 1)],
           3: [("stage2_fp32_w3", 2), ("stage3_bf16_w3", 3), ("stage1_bf16_w2", 2), ("stage2_fp32_w2", 1),
               ("stage3_bf16_w2", 2)]}
# bf16: zerokit and DeepSpeed each run the forward and backward in bf16 (8 significant bits, a relative rounding
# of up to 2^-8 = 3.9e-3), with other casts and reduction orders, so they differ in the forward already: losses
# are compared to rtol 2e-3 (measured: 7e-4 at most), and masters to atol 4e-3, under one step's Adam update at
# the restored learning rate (5e-3), so that a master not restored or not stepped is still caught (measured:
# 9e-4 at most). The masters as loaded are compared exactly in both precisions.
TOLERANCES = {"fp32": (1e-5, 2e-5), "bf16": (2e-3, 4e-3)}


def _global_losses(results: list[dict]) -> list[float]:
    steps = range(len(results[0]["losses"]))
    return [sum(r["losses"][s][0] * r["losses"][s][1] for r in results) / sum(r["losses"][s][1] for r in results)
            for s in steps]


def test_resumes_at_any_size_and_stage_as_deepspeed_continues(written: Path) -> None:
    """zerokit loads each DeepSpeed checkpoint with the drop-in's HF-Trainer-shaped call, restores exactly the
    fp32 masters, counters, learning rates and client_state, and its next steps on the same global batches equal
    DeepSpeed's own continuation."""
    import ds_resume

    for world_size, cases in RESUMES.items():
        per_rank = spawn(ds_resume.resume_all, world_size, str(written), cases, timeout=600)
        for index, (case, stage) in enumerate(cases):
            results = [rank_results[index] for rank_results in per_rank]
            where = (case, world_size, stage)
            reference = torch.load(written / case / "reference.pt")
            for name, master in results[0]["loaded"].items():
                assert torch.equal(master, reference[name]), (where, name)
            for result in results:
                assert result["client_state"] == {"epoch": 4, "note": "from deepspeed"}, where
                assert result["path"].endswith(f"{case}/ckpt/global_step3"), where
                assert result["global_steps"] == 3 and result["lr"] == [0.005, 0.005], where  # WarmupLR at 3 of 4
                assert result["weight_decay"] == [0.1, 0.0], where
            saved_world_size = int(case.rsplit("_w", 1)[1])
            losses = [torch.load(written / case / f"continued_losses_rank{r}.pt") for r in range(saved_world_size)]
            theirs = [sum(rank[step] for rank in losses) / saved_world_size for step in range(len(losses[0]))]
            rtol, atol = TOLERANCES[case.split("_")[1]]
            assert _global_losses(results) == pytest.approx(theirs, rel=rtol), where
            continued = torch.load(written / case / "continued.pt")
            for name, master in results[0]["masters"].items():
                torch.testing.assert_close(master, continued[name], rtol=0, atol=atol, msg=lambda m: f"{where} {m}")


def test_bad_deepspeed_checkpoints_fail_on_every_rank_before_anything_changes(written: Path, tmp_path: Path) -> None:
    """A missing file, a truncated one, another model's checkpoint and a tensor-parallel one: every rank raises
    the same one-line error, and the engine's weights and masters are those it had (nothing restored)."""
    import ds_resume

    def copy(case: str, name: str) -> Path:
        shutil.copytree(written / case / "ckpt", tmp_path / name)
        return tmp_path / name / "global_step3"

    missing = copy("stage3_bf16_w2", "missing")
    (missing / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    truncated = copy("stage3_fp32_w2", "truncated")
    path = truncated / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    parallel = copy("stage2_fp32_w2", "parallel")
    shutil.copy(parallel / "mp_rank_00_model_states.pt", parallel / "mp_rank_01_model_states.pt")
    cases = [(missing.parent, False, r"optim_states.pt: saved by 2 ranks but 1 optimizer files are here"),
             (truncated.parent, False, r"zero_pp_rank_1_mp_rank_00_optim_states.pt: truncated"),
             (written / "stage2_fp32_w2" / "ckpt", True, r"another model: the model has extra.bias, extra.weight"),
             (parallel.parent, False, r"mp_rank_01_model_states.pt: a pipeline-, tensor- or expert-parallel"),
             # rank 1 alone finds its copy damaged: rank 0 must not have restored its own meanwhile
             ([written / "stage3_fp32_w2" / "ckpt", truncated.parent], False,
              r"^rank 1: .*zero_pp_rank_1_mp_rank_00_optim_states.pt: truncated")]
    directories = [[str(d) for d in c[0]] if isinstance(c[0], list) else str(c[0]) for c in cases]
    per_rank = spawn(ds_resume.failed_loads, 2, directories, [c[1] for c in cases], timeout=600)
    for index, (_, _, match) in enumerate(cases):
        results = [rank_results[index] for rank_results in per_rank]
        assert results[0]["error"] is not None and re.search(match, results[0]["error"]), (match, results[0])
        assert "\n" not in results[0]["error"], results[0]["error"]
        assert all(r["error"] == results[0]["error"] for r in results), results
        assert all(r["unchanged"] and r["steps"] == 0 for r in results), (match, results)


def test_fp16_loss_scaler_state_reads_as_zerokits(monkeypatch) -> None:
    """DeepSpeed cannot write an fp16 checkpoint on a CPU, so its DynamicLossScaler itself goes through a history of
    overflows and clean updates (hysteresis spent, the scale halved, clean updates since), and its state, read as
    a checkpoint holds it, equals the state zerokit's scaler reaches through the same history."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: this test runs DeepSpeed's own loss scaler")
    from types import SimpleNamespace

    import deepspeed.runtime.fp16.loss_scaler as ds_scaler

    from zerokit.checkpoint.deepspeed_resume import loss_scaler_state
    from zerokit.config.typed import LossScaling
    from zerokit.precision import DynamicLossScaler

    monkeypatch.setattr(ds_scaler, "dist", SimpleNamespace(get_rank=lambda: 1))  # its overflow log asks the rank
    theirs = ds_scaler.DynamicLossScaler(init_scale=2.0**12, scale_window=8, delayed_shift=2, min_scale=1.0,
                                         consecutive_hysteresis=False)
    ours = DynamicLossScaler(LossScaling(initial_scale_power=12, window=8, hysteresis=2))
    for overflow in (False, True, False, True, True, False, False, False):
        theirs.update_scale(overflow)
        ours.update(overflow)
    assert ours.state_dict() == {"scale": 2.0**10, "clean_steps": 3, "hysteresis_left": 1}  # halved twice
    fresh = DynamicLossScaler(LossScaling(initial_scale_power=16, window=8, hysteresis=2))
    assert loss_scaler_state(dict(vars(theirs)), fresh.state_dict()) == ours.state_dict()
    static = ds_scaler.LossScaler(scale=128.0)
    assert loss_scaler_state(dict(vars(static)), {"scale": 1.0})["scale"] == 128.0


def test_a_scheduler_passed_to_initialize_keeps_the_restored_learning_rates(written: Path, tmp_path: Path,
                                                                            one_process, monkeypatch) -> None:
    """Hugging Face's Trainer passes its own torch scheduler to initialize() (DeepSpeed then saves that
    scheduler's state_dict) and resumes with load_checkpoint(dir, load_module_strict=..., load_optimizer_states=True,
    load_lr_scheduler_states=True): the scheduler gets its state, and the learning rates the checkpoint's param
    groups hold are those the next step takes, in the optimizer that trains and in the user's, as in DeepSpeed
    (whose optimizer is the user's)."""
    import ds_checkpoints as ds

    import zerokit.deepspeed as deepspeed

    def lambda_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1 * (step + 1))

    saved = lambda_schedule(ds.make_optimizer(ds.build_model()))
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    shutil.copytree(written / "stage2_fp32_w2" / "ckpt", tmp_path / "ckpt")
    model_file = tmp_path / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(model_file, weights_only=False), "lr_scheduler": saved.state_dict()}, model_file)
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = ds.build_model(seed=99)
    optimizer = ds.make_optimizer(model)
    schedule = lambda_schedule(optimizer)  # 1e-3 and 3e-4 until stepped
    config = {key: value for key, value in ds.ds_config(0, "fp32").items() if key != "scheduler"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    _, client_state = engine.load_checkpoint(str(tmp_path / "ckpt"), load_module_strict=True,
                                             load_optimizer_states=True, load_lr_scheduler_states=True)
    assert client_state == {"epoch": 4, "note": "from deepspeed"}
    assert schedule.last_epoch == 3
    assert engine.get_lr() == [0.005, 0.005]  # the checkpoint's (WarmupLR's), not the user's optimizer's before
    assert [group["lr"] for group in optimizer.param_groups] == [0.005, 0.005]
    engine.destroy()
