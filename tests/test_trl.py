"""Post-training through Hugging Face TRL (issue 36), on a tiny Llama and a word-level tokenizer made locally.

Trainers: tests/scripts/trl_jobs.py runs DPO (policy + reference model), GRPO (a reward function, a reference model
built from the model's path, generation inside training) and SFT with packing, one after the other in one torchrun
launch of 2 gloo ranks: under plain DDP, and through `python -m zerokit.deepspeed.install` with a DeepSpeed config at
ZeRO-2 and ZeRO-3 (GRPO once more at ZeRO-3 generating layer by layer, ds3_gather_for_generation=False). TRL prepares
each reference model with deepspeed.initialize(model=m, config=...) and no optimizer: a forward-only zerokit engine.
Each zerokit run checkpoints at step 2 and a second Trainer resumes from that checkpoint.

Tolerance: fp32 throughout (bf16=False: TRL's configs default to bf16=True, under which DDP runs the forward in CPU
bf16 autocast and a DeepSpeed config without a bf16 block runs fp32: See docs/integrations.md). Per-step losses and
grad norms agree with DDP's to the few ulps that another order of summation gives (measured: 6.1e-7 relative at most,
on a GRPO loss near 8e-4; 1e-7 elsewhere); rtol 2e-5 fails any real difference (a reference model that drifted, a
generation with other tokens, a wrong reduction). GRPO's first-step loss is zero up to rounding (the policy is the
reference, and advantages average to zero), hence an absolute floor of 1e-9.

Generation (the job `generate` of the ZeRO-3 launch): each rank samples from the model in one process, then from a
ZeRO-3 engine over it both ways TRL generates (every parameter gathered with GatheredParameters around TRL's
remove_hooks/add_hooks; or layer by layer through the engine's own gathers), with the same seed: the tokens are
equal, exactly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from zerokit.testing.jobs import Job, launch

pytest.importorskip("trl")

SCRIPTS = Path(__file__).parent / "scripts"
RTOL, ATOL = 2e-5, 1e-9
JOBS = ("dpo", "grpo", "sft")
RESUME_AT = 2
ZEROKIT_ENGINE = "zerokit.deepspeed.engine.DeepSpeedEngine"
# the tiny Llama's decoder layers (41k parameters each) become units, and only its norms stay whole (DeepSpeed's
# default persistence threshold, 1e5 elements, would keep every parameter of so small a model whole)
UNITS = {"stage3_min_unit_params": 1000, "stage3_param_persistence_threshold": 100}


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
            "HF_DATASETS_OFFLINE": "1"}


def stage_config(directory: Path, stage: int) -> str:
    path = directory / f"zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, **(UNITS if stage == 3 else {})},
                                "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}))
    return str(path)


class Runs:
    """The three launches' runs (DDP, ZeRO-2, ZeRO-3) in one torchrun launch, on first use (See [Note: jobs forked
    inside one torchrun launch])."""

    def __init__(self, root: Path) -> None:
        self.root, self.done, self.outcomes = root, {}, None
        self.pretrained = root / "pretrained"
        sys.path.insert(0, str(SCRIPTS))
        import trl_jobs

        trl_jobs.save_pretrained_model(str(self.pretrained))

    def arguments(self, name: str) -> tuple[list[str], bool, tuple[str, ...]]:
        common = ["--out", str(self.root / name), "--pretrained", str(self.pretrained)]
        if name == "ddp":
            return common + ["--jobs", ",".join(JOBS)], False, JOBS
        jobs = ("generate", *JOBS, "grpo_layer_by_layer") if name == "zero3" else JOBS
        return common + ["--jobs", ",".join(jobs), "--deepspeed", stage_config(self.root, int(name[-1])),
                         "--resume-at", str(RESUME_AT)], True, jobs

    def launch(self) -> None:
        runs = []
        for name in ("ddp", "zero2", "zero3"):
            args, zerokit, _ = self.arguments(name)
            runs.append(Job(name, [str(SCRIPTS / "trl_jobs.py"), *args], install=zerokit,
                            preload=("trl.trainer.dpo_trainer", "trl.trainer.grpo_trainer", "trl.trainer.sft_trainer")))
        self.outcomes = launch(runs, self.root / "launch", env=environment())

    def __call__(self, name: str, job: str) -> list[dict]:
        if self.outcomes is None:
            self.launch()
        if name not in self.done:
            _, _, jobs = self.arguments(name)
            self.outcomes.check(name)
            self.done[name] = {each: [json.loads((self.root / name / each / f"rank{rank}.json").read_text())
                                      for rank in range(2)] for each in jobs}
        return self.done[name][job]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("trl"))


def assert_steps_equal(expected: list[dict], got: list[dict]) -> None:
    assert [step["step"] for step in got] == [step["step"] for step in expected] == [1, 2, 3, 4]
    for want, have in zip(expected, got):
        for key in ("loss", "grad_norm"):
            assert abs(have[key] - want[key]) <= RTOL * abs(want[key]) + ATOL, (key, want, have)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("job", JOBS)
def test_the_trainer_trains_as_ddp_does(runs: Runs, job: str, stage: int) -> None:
    ddp, zerokit = runs("ddp", job), runs(f"zero{stage}", job)
    assert ddp[0]["run"]["policy"]["engine"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert any(abs(step["loss"]) > 1e-4 for step in ddp[0]["run"]["steps"])  # the loss moves: a real comparison
    for rank in range(2):
        policy = zerokit[rank]["run"]["policy"]
        assert policy["engine"] == ZEROKIT_ENGINE and policy["stage"] == stage and not policy["forward_only"]
        assert_steps_equal(ddp[rank]["run"]["steps"], zerokit[rank]["run"]["steps"])


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("job", ["dpo", "grpo"])
def test_the_reference_model_is_an_engine_without_an_optimizer(runs: Runs, job: str, stage: int) -> None:
    """TRL asks for stage 0 below ZeRO-3 (the reference held whole on every rank) and the training stage at ZeRO-3,
    where each rank holds half of it; its weights are the pretrained ones, loaded under zero.Init at ZeRO-3."""
    for rank in range(2):
        policy, reference = (runs(f"zero{stage}", job)[rank]["run"][key] for key in ("policy", "reference"))
        assert reference["engine"] == ZEROKIT_ENGINE and reference["forward_only"]
        assert reference["stage"] == (3 if stage == 3 else 0)
        assert reference["memory"]["gradients"] == reference["memory"]["optimizer_state"] == 0
        held, whole = reference["memory"]["parameters"], 4 * 78_016  # the tiny Llama: 78,016 parameters in fp32
        assert held == (policy["memory"]["parameters"] if stage == 3 else whole)
        assert (whole / 2 <= held <= whole / 2 + 64) if stage == 3 else held == whole
        assert reference["loaded_difference"] == 0.0


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("job", JOBS)
def test_resume_from_its_own_checkpoint_reproduces_the_run(runs: Runs, job: str, stage: int) -> None:
    for result in runs(f"zero{stage}", job):
        run, resumed = result["run"]["steps"], result["resumed"]["steps"]
        assert_steps_equal(run, resumed)  # steps 1-2 from the checkpoint's trainer state, 3-4 trained after it
        assert result["resumed"]["policy"]["engine"] == ZEROKIT_ENGINE


def test_grpo_generates_layer_by_layer_as_it_does_gathered(runs: Runs) -> None:
    ddp, gathered, layer_by_layer = runs("ddp", "grpo"), runs("zero3", "grpo"), runs("zero3", "grpo_layer_by_layer")
    for rank in range(2):
        assert_steps_equal(ddp[rank]["run"]["steps"], layer_by_layer[rank]["run"]["steps"])
        for key in ("reward", "completions/mean_length"):  # the same completions, so the same rewards
            assert [s[key] for s in layer_by_layer[rank]["run"]["steps"]] == [s[key] for s in ddp[rank]["run"]["steps"]]
        assert max(abs(a["kl"] - b["kl"]) for a, b in zip(ddp[rank]["run"]["steps"], layer_by_layer[rank]["run"]["steps"])) \
            <= RTOL * max(s["kl"] for s in ddp[rank]["run"]["steps"])
        # layer by layer, every generated token gathers every unit again
        calls = (layer_by_layer[rank]["run"]["policy"]["comm_calls"], gathered[rank]["run"]["policy"]["comm_calls"])
        assert calls[0]["all_gather"] > 2 * calls[1]["all_gather"], calls


# --- generation under ZeRO-3 against one process --------------------------------------------------------------------

def test_generation_under_zero3_gives_the_tokens_of_one_process(runs: Runs) -> None:
    for out in runs("zero3", "generate"):
        assert len(out["one_process"]) == 2 and len(out["one_process"][0]) == 13  # 5 prompt tokens, 8 sampled
        assert out["gathered"] == out["one_process"]
        assert out["layer_by_layer"] == out["one_process"]
        gathered, layer_by_layer = out["gathers"]
        assert gathered == 3 and layer_by_layer >= 8 * 3  # once per unit; per unit and token


def test_parameters_say_where_their_values_are(runs: Runs) -> None:
    """After a forward under no_grad every unit is released, the root too (no backward follows): each parameter's
    ds_status says so, as TRL's fused LM head reads it; close() gives the parameters back their class."""
    for out in runs("zero3", "generate"):
        assert set(out["status"].values()) == {"NOT_AVAILABLE"}
        assert out["class_back"]
