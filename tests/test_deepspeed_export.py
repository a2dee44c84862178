"""The way back (issue 25): `zerokit convert SRC OUT --to deepspeed-universal` writes a zerokit checkpoint in
DeepSpeed's universal layout, and real DeepSpeed loads it with `"checkpoint": {"load_universal": true}` at stages
1, 2 and 3, at the saving world size and another, and takes the steps zerokit's own continuation takes. The
files are laid out as DeepSpeed's own ds_to_universal.py lays them out, and bad input is named in one line.

One zerokit launch (2 ranks, stage 3: train, save, continue), two DeepSpeed launches (2 ranks: stages 1-3; 1 rank:
zerokit's and DeepSpeed's continuations at another world size) and one ds_to_universal run, shared by the tests.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerokit.checkpoint import consolidate
from zerokit.checkpoint.deepspeed_export import convert_to_universal
from zerokit.cli import main
from conftest import deepspeed_script
from zerokit.testing.spawn import spawn

SCRIPTS = Path(__file__).parent / "scripts"
TAG = "global_step3"
TRAINABLE = ["embed.weight", "body.weight", "body.bias", "out.weight", "out.bias", "norm.weight", "norm.bias"]


# fp32: the tolerance. bf16: zerokit and DeepSpeed each run the forward and backward in bf16 and reduce
# in their own order, so they agree to bf16's rounding (tests/test_deepspeed_import.py's tolerance).
TOLERANCES = {"fp32": (1e-5, 2e-5), "bf16": (2e-3, 4e-3)}


def _close(ours: dict, reference: dict, what: str, precision: str = "fp32") -> None:
    """Losses within rtol, final fp32 weights within atol, of TOLERANCES[precision]."""
    rtol, atol = TOLERANCES[precision]
    for rank, (losses, expected) in enumerate(zip(ours["losses"], reference["losses"])):
        assert losses == pytest.approx(expected, rel=rtol), (what, rank)
    assert ours["weights"].keys() == reference["weights"].keys(), what
    for key, tensor in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], tensor.float(), atol=atol, rtol=0, msg=f"{what}: {key}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    ds_universal = deepspeed_script("ds_universal", "deepspeed.checkpoint.ds_to_universal",
                                    "these tests load the converted checkpoint in real DeepSpeed")
    root = tmp_path_factory.mktemp("universal")
    zerokit_runs = spawn(ds_universal.zerokit_train, 2, str(root), [(3, "fp32"), (2, "bf16")], timeout=300)
    for precision in ("fp32", "bf16"):
        assert main(["convert", str(root / f"zk-{precision}"), str(root / f"universal-{precision}"), "--to",
                     "deepspeed-universal"]) == 0  # `zerokit convert ...`
    cases = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (3, "bf16")]
    two = spawn(ds_universal.deepspeed_resume, 2, str(root), cases, True, (2, "fp32"), timeout=600)
    one = spawn(ds_universal.zerokit_then_deepspeed, 1, str(root), 2, [(1, "fp32"), (3, "fp32")], timeout=600)[0]
    converter = Path(importlib.util.find_spec("deepspeed.checkpoint.ds_to_universal").origin)
    subprocess.run([sys.executable, str(converter), "--input_folder", str(root / "ds" / "global_step5"),
                    "--output_folder", str(root / "ds" / "global_step5_universal"), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True, capture_output=True)

    def joined(results: list[dict], key) -> dict:
        return {"losses": [r[key]["losses"] for r in results], "weights": results[0][key]["weights"],
                "loaded": results[0][key].get("loaded")}

    return {"root": root, "zerokit": {p: joined(zerokit_runs, p) for p in ("fp32", "bf16")},
            "two": {case: joined(two, case) for case in cases},
            "one_zerokit": {"losses": [one["zerokit"]["losses"]], "weights": one["zerokit"]["weights"]},
            "one": {case: joined([one["deepspeed"]], case) for case in [(1, "fp32"), (3, "fp32")]}}


def test_deepspeed_continues_exactly_at_stages_1_2_3(runs: dict) -> None:
    """fp32 saved by zerokit at stage 3, bf16 at stage 2, both on 2 ranks; DeepSpeed resumes on 2 ranks."""
    for (stage, precision), run in runs["two"].items():
        _close(run, runs["zerokit"][precision], f"stage {stage}, {precision}, 2 ranks", precision)
        loaded = run["loaded"]
        assert (loaded["global_steps"], loaded["global_samples"], loaded["skipped_steps"]) == (3, 18, 0), stage
        assert loaded["scheduler"] == {"last_batch_iteration": 2} and loaded["lr"] == [0.005, 0.005], stage
        assert loaded["client_state"] == {"epoch": 4, "note": "from zerokit"}, stage
        assert loaded["weight_decay"] == [0.1, 0.0], stage  # See [Note: one param group's hyperparameters at ZeRO-3]
        assert loaded["steps"] == [3.0, 3.0], stage
        # DeepSpeed's ZeRO-3 universal load hands both groups one step tensor (the script un-shares it)
        assert loaded["shared_step"] == (stage == 3), stage


def test_deepspeed_continues_exactly_at_another_world_size(runs: dict) -> None:
    for (stage, _), run in runs["one"].items():
        _close(run, runs["one_zerokit"], f"stage {stage}, 1 rank")
        assert run["loaded"]["weight_decay"] == [0.1, 0.0] and run["loaded"]["global_steps"] == 3, stage


def _layout(folder: Path) -> dict[str, object]:
    """Each file under a universal tag folder: for zero/<name>/*.pt its dict keys and tensor shape."""
    layout: dict[str, object] = {}
    for path in sorted(folder.rglob("*.pt")):
        value = torch.load(path, weights_only=False)
        key = str(path.relative_to(folder))
        if isinstance(value, dict) and "param" in value:
            layout[key] = (sorted(value), tuple(value["param"].shape), value["param"].dtype)
        elif isinstance(value, torch.Tensor):
            layout[key] = ("tensor", tuple(value.shape), value.dtype)
        else:
            layout[key] = sorted(value)
    return layout


def test_layout_is_what_ds_to_universal_writes(runs: dict, tmp_path: Path) -> None:
    """DeepSpeed's own converter, run on a DeepSpeed stage-2 checkpoint of the same model, writes the same files
    with the same keys, shapes and dtypes (its model-states file beside our two; its optimizer record's keys
    within ours)."""
    ours = _layout(runs["root"] / "universal-fp32" / TAG)
    theirs = _layout(runs["root"] / "ds" / "global_step5_universal")
    assert (runs["root"] / "universal-fp32" / "latest_universal").read_text() == TAG
    assert (runs["root"] / "ds" / "latest_universal").read_text() == "global_step5_universal"
    optimizer = "zero/optimizer_state.pt"
    params = {key: value for key, value in theirs.items() if key.startswith("zero/") and key != optimizer}
    assert {key: ours[key] for key in params} == params
    # left out: DeepSpeed's LossScaler object (a fresh one is what an fp32 or bf16 run has) and its flat
    # groups' paddings (the layout has no flat groups); no universal load reads them
    left_out = {"loss_scaler", "group_paddings", "param_alignment_paddings"}
    assert set(theirs[optimizer]) - set(ours[optimizer]) <= left_out, theirs[optimizer]
    model = "mp_rank_00_model_states.pt"
    assert set(theirs[model]) <= set(ours[model]) | {"universal_checkpoint_info"}, set(theirs[model]) - set(ours[model])
    assert set(ours) - set(theirs) == {"zero_pp_rank_0_mp_rank_00_model_states.pt"}
    model_states = torch.load(runs["root"] / "universal-fp32" / TAG / model, weights_only=False)
    assert model_states["shared_params"] == {"head.weight": "embed.weight"}
    assert [list(group) for group in model_states["param_shapes"]] == [
        ["embed.weight", "body.weight", "out.weight"], ["body.bias", "out.bias", "norm.weight", "norm.bias"]]
    assert list(model_states["frozen_param_shapes"]) == ["frozen.weight", "frozen.bias"]
    # the values: each master is the zerokit checkpoint's, whole (as `zerokit consolidate` reads it)
    consolidate(runs["root"] / "zk-fp32", tmp_path / "masters.safetensors")
    masters = load_file(tmp_path / "masters.safetensors")
    for name in TRAINABLE + ["frozen.weight", "frozen.bias", "scale", "head.weight"]:
        fp32 = torch.load(runs["root"] / "universal-fp32" / TAG / "zero" / name / "fp32.pt")["param"]
        assert torch.equal(fp32, masters[name]), name
        if name in TRAINABLE:
            assert torch.equal(torch.load(runs["root"] / "universal-fp32" / TAG / "zero" / name / "step.pt"),
                               torch.tensor(3.0)), name


def _refused(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("zerokit convert: error: ") and match in error and "\n" not in error, error


def test_bad_input_is_named_in_one_line(runs: dict, tmp_path: Path, capsys) -> None:
    zk, universal = runs["root"] / "zk-fp32", runs["root"] / "universal-fp32"
    _refused(capsys, ["convert", str(zk), str(tmp_path / "a"), "--to", "megatron"],
             "--to 'megatron' is not a layout this command writes; use deepspeed-universal")
    _refused(capsys, ["convert", str(universal), str(tmp_path / "a"), "--to", "deepspeed-universal"],
             "not a zerokit checkpoint (no manifest.json, and no `latest` naming one)")
    _refused(capsys, ["convert", str(runs["root"] / "ds"), str(tmp_path / "a"), "--to", "deepspeed-universal"],
             "a DeepSpeed checkpoint, not a zerokit one")
    _refused(capsys, ["convert", str(tmp_path / "nowhere"), str(tmp_path / "a"), "--to", "deepspeed-universal"],
             "no such directory")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    _refused(capsys, ["convert", str(zk), str(occupied), "--to", "deepspeed-universal"],
             "exists and is not an empty directory; a conversion never overwrites a checkpoint")
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".*partial*")) and not (tmp_path / "a").exists()
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is written into
    assert convert_to_universal(zk, empty).params == len(TRAINABLE)
    assert (empty / "latest_universal").read_text() == TAG


def _edited(runs: dict, tmp_path: Path, edit) -> Path:
    copy = tmp_path / f"zk{len(list(tmp_path.iterdir()))}"
    shutil.copytree(runs["root"] / "zk-fp32", copy)
    path = copy / TAG / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return copy


def test_checkpoints_the_layout_cannot_hold_are_refused(runs: dict, tmp_path: Path) -> None:
    def sgd(manifest: dict) -> None:
        manifest["params"]["body.bias"]["state"] = ["momentum_buffer"]

    def fp16(manifest: dict) -> None:
        manifest["param_dtype"] = "float16"

    def two_optimizers(manifest: dict) -> None:
        manifest["optimizers"].append(manifest["optimizers"][0])

    def uneven_steps(manifest: dict) -> None:
        manifest["params"]["body.bias"]["scalars"]["step"]["value"] = 2.0

    for edit, match in ((sgd, r"'body.bias' has optimizer state momentum_buffer; DeepSpeed's universal layout holds "
                              r"Adam's exp_avg and exp_avg_sq"),
                        (fp16, r"an fp16 run; its loss scaler is a DeepSpeed object"),
                        (two_optimizers, r"saved with 2 optimizers; DeepSpeed's universal layout holds one"),
                        (uneven_steps, r"parameters were stepped 2, 3 times")):
        with pytest.raises(ValueError, match=match) as error:
            convert_to_universal(_edited(runs, tmp_path, edit), tmp_path / f"out-{edit.__name__}")
        assert "\n" not in str(error.value)
        assert not (tmp_path / f"out-{edit.__name__}").exists()


def test_schedule_position_without_the_schedules_record(runs: dict, tmp_path: Path) -> None:
    """A checkpoint without the schedules' state (as zerokit wrote them before it kept it for every engine): the
    position DeepSpeed resumes its schedule at comes from the optimizer steps when the run had a `scheduler` block,
    else none."""
    def model_states(edit) -> dict:
        def without_schedules(manifest: dict) -> None:
            manifest["lr_schedules"] = None
            edit(manifest)
        source = _edited(runs, tmp_path, without_schedules)
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        convert_to_universal(source, out)
        return torch.load(out / TAG / "mp_rank_00_model_states.pt", weights_only=False)

    def keep(manifest: dict) -> None:
        pass

    def no_scheduler(manifest: dict) -> None:
        manifest["config"]["scheduler"] = None

    with_block = model_states(keep)
    assert with_block["lr_scheduler"] == {"last_batch_iteration": 2} and with_block["epoch"] == 4
    assert "zerokit.lr_schedules" not in with_block
    assert model_states(no_scheduler)["lr_scheduler"] is None
