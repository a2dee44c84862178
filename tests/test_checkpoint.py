"""Sharded checkpoints in one process (issue 11): files a safetensors reader opens, atomic saves and the
`latest` pointer, asynchronous saves, what load_checkpoint restores besides the weights, and a one-line
error naming the file for each bad input. Multi-rank resume and resharding: test_checkpoint_multirank.py;
a rank killed mid-save: test_a_rank_killed_between_files_leaves_the_previous_checkpoint_loadable below."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import zerokit
import zerokit.checkpoint as checkpoint
from test_engine_state import train, train_loss  # the same few steps on the same batches
from zerokit.cli import main as cli_main
from zerokit.reliability.preemption import Preempted
from zerokit.testing.models import TinyGPT, TinyGPTConfig, param_groups
from zerokit.testing.spawn import spawn


def make_engine(stage: int = 1, accumulation: int = 1, lr: float = 1e-2, n_layer: int = 2, **config) -> zerokit.Engine:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=n_layer))
    ds = {"zero_optimization": {"stage": stage, "reduce_bucket_bytes": 8192, "stage3_min_unit_params": 1000},
          "gradient_clipping": 0.5, "gradient_accumulation_steps": accumulation, **config}
    if stage != 3:
        del ds["zero_optimization"]["stage3_min_unit_params"]
    return zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=lr), ds)


def one_line_error(call, *fragments: str) -> str:
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- the files ---------------------------------------------------------------------------------------

def test_rank_files_are_standard_safetensors_holding_masters_and_optimizer_state(one_process, tmp_path) -> None:
    engine = make_engine(stage=2)
    train(engine, range(2))
    engine.save_checkpoint(tmp_path, tag="t")
    manifest = checkpoint.read_manifest(tmp_path / "t")
    assert (tmp_path / "latest").read_text() == "t" and manifest.world_size == 1 and manifest.stage == 2
    master = dict(engine.module.named_parameters())["blocks.0.attn.qkv.weight"]
    with safe_open(tmp_path / "t" / "rank00000.safetensors", framework="pt") as file:
        assert torch.equal(file.get_tensor("param/blocks.0.attn.qkv.weight"), master.detach().reshape(-1))
        avg = file.get_tensor("state/exp_avg/blocks.0.attn.qkv.weight")
        assert avg.shape == (master.numel(),) and avg.abs().sum() > 0
        assert torch.equal(file.get_tensor("param/frozen.weight"),
                           engine.module.frozen.weight.detach().reshape(-1))  # frozen: not derivable
    record = manifest.params["blocks.0.attn.qkv.weight"]
    assert record.scalars["step"]["value"] == 2.0 and record.state == ("exp_avg", "exp_avg_sq")
    assert manifest.model["state_dict"][-1][:2] == ["lm_head.weight", "wte.weight"]  # tied: named by its first name


def test_save_dir_holds_only_committed_checkpoints_and_latest_moves_last(one_process, tmp_path) -> None:
    engine = make_engine()
    train(engine, range(1))
    engine.save_checkpoint(tmp_path)  # default tag: global_step<boundaries>
    train(engine, range(1, 2))
    engine.save_checkpoint(tmp_path)
    engine.save_checkpoint(tmp_path, tag="global_step2")  # the same tag again: swapped in whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "global_step2", "latest"]
    assert (tmp_path / "latest").read_text() == "global_step2"
    engine.save_checkpoint(tmp_path, tag="kept", save_latest=False)
    assert (tmp_path / "latest").read_text() == "global_step2"
    path, client_state = make_engine().load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step2") and client_state is None


def test_async_save_keeps_the_values_of_the_moment_it_was_called(one_process, tmp_path) -> None:
    """Training goes on while the files are written; the checkpoint holds the state at the call."""
    engine = make_engine(stage=3)
    train(engine, range(2))
    engine.save_checkpoint(tmp_path / "sync", client_state={"at": 2})
    engine.save_checkpoint(tmp_path / "async", client_state={"at": 2}, async_save=True)
    train(engine, range(2, 4))  # changes masters and optimizer state in place
    checkpoint.wait(engine)
    continuations = []
    for name in ("sync", "async"):
        resumed = make_engine(stage=3)
        assert resumed.load_checkpoint(tmp_path / name)[1] == {"at": 2}
        continuations.append((train(resumed, range(2, 4)), resumed.full_state_dict()))
    assert continuations[0][0] == continuations[1][0]
    assert all(torch.equal(v, continuations[1][1][k]) for k, v in continuations[0][1].items())
    host = checkpoint.save.session_of(engine).host
    buffers = dict(host.buffers)
    engine.save_checkpoint(tmp_path / "async", async_save=True)  # a second save reuses its host buffers
    assert all(host.buffers[k] is b for k, b in buffers.items())
    checkpoint.wait(engine)


def test_the_config_makes_saves_asynchronous_and_the_call_overrides_it(one_process, tmp_path) -> None:
    """zerokit's checkpoint.async_save saves as async_save=True does (into host buffers, written in the background);
    save_checkpoint(asynchronous=False) saves synchronously all the same, asynchronous=True without the config."""
    def saved_through_host_buffers(engine: zerokit.Engine, **how) -> bool:
        engine.save_checkpoint(tmp_path / str(len(list(tmp_path.iterdir()))), **how)
        checkpoint.wait(engine)
        return bool(checkpoint.save.session_of(engine).host.buffers)

    assert saved_through_host_buffers(make_engine(checkpoint={"async_save": True}))
    assert not saved_through_host_buffers(make_engine(checkpoint={"async_save": True}), asynchronous=False)
    assert saved_through_host_buffers(make_engine(), asynchronous=True)
    assert not saved_through_host_buffers(make_engine())


def test_optimizer_hyperparameters_scheduler_and_counters_come_back(one_process, tmp_path) -> None:
    engine = make_engine(accumulation=2)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        train(engine, range(2))
        scheduler.step()
    engine.save_checkpoint(tmp_path, client_state={"scheduler": scheduler.state_dict()})
    resumed = make_engine(accumulation=2)
    resumed_scheduler = torch.optim.lr_scheduler.StepLR(resumed.optimizer, step_size=1, gamma=0.5)
    _, client_state = resumed.load_checkpoint(tmp_path)
    resumed_scheduler.load_state_dict(client_state["scheduler"])
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in engine.optimizer.param_groups]
    assert resumed.optimizer.param_groups[0]["lr"] == 1e-2 / 4 and resumed.progress == engine.progress
    assert resumed.progress.micro_step == 4 and resumed.progress.optimizer_step == 2
    changed = make_engine(accumulation=4)  # a new accumulation keeps its windows aligned
    changed.load_checkpoint(tmp_path)
    assert changed.progress.micro_step == 8 and changed.at_boundary is False


SCHEDULE = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                              "warmup_num_steps": 4, "total_num_steps": 10}}}


def test_the_config_blocks_lr_schedule_resumes_where_it_stood(one_process, tmp_path) -> None:
    """The schedule the engine steps (its `scheduler` block's) is saved with the checkpoint: the learning rates
    after a resume are the uninterrupted run's (before it was saved, a resumed run restarted its warm-up at 0)."""
    engine = make_engine(**SCHEDULE)
    train(engine, range(3))
    engine.save_checkpoint(tmp_path)
    uninterrupted = []
    for step in range(3, 6):
        train(engine, [step])
        uninterrupted.append(engine.get_lr())
    resumed = make_engine(**SCHEDULE)
    resumed.load_checkpoint(tmp_path)
    got = []
    for step in range(3, 6):
        train(resumed, [step])
        got.append(resumed.get_lr())
    assert got == uninterrupted
    one_line_error(lambda: make_engine().load_checkpoint(tmp_path), "saved with 1 LR schedules, this engine steps 0")
    without = make_engine(**SCHEDULE)
    without.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    assert without.lr_scheduler.last_epoch == 0


def test_module_only_and_no_optimizer_state(one_process, tmp_path) -> None:
    engine = make_engine()
    train(engine, range(2))
    engine.save_checkpoint(tmp_path)
    weights = make_engine()
    weights.load_checkpoint(tmp_path, load_module_only=True)
    assert weights.progress.optimizer_step == 0 and not any(o for o in weights.optimizer.state.values())
    assert all(torch.equal(v, engine.full_state_dict()[k]) for k, v in weights.full_state_dict().items())
    no_state = make_engine()
    no_state.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert no_state.progress.optimizer_step == 2 and not any(o for o in no_state.optimizer.state.values())


# --- bad input -----------------------------------------------------------------------------------

@pytest.fixture
def saved(one_process, tmp_path) -> Path:
    engine = make_engine(stage=2)
    train(engine, range(1))
    engine.save_checkpoint(tmp_path, tag="t")
    dist.destroy_process_group()
    return tmp_path


def test_a_truncated_shard_is_named(saved) -> None:
    rank_file = saved / "t" / "rank00000.safetensors"
    os.truncate(rank_file, rank_file.stat().st_size - 100)
    one_line_error(lambda: make_engine(stage=2).load_checkpoint(saved), str(rank_file), "truncated")


def test_a_corrupted_shard_is_named(saved) -> None:
    rank_file = saved / "t" / "rank00000.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of some tensor
    rank_file.write_bytes(bytes(data))
    one_line_error(lambda: make_engine(stage=2).load_checkpoint(saved), str(rank_file), "corrupted",
                   "fail their checksum")


def test_a_missing_rank_file_is_named(saved) -> None:
    rank_file = saved / "t" / "rank00000.safetensors"
    rank_file.unlink()
    one_line_error(lambda: make_engine(stage=2).load_checkpoint(saved), str(rank_file), "missing")


def test_a_manifest_from_another_model_is_named(saved) -> None:
    manifest = str(saved / "t" / "manifest.json")
    one_line_error(lambda: make_engine(stage=2, n_layer=3).load_checkpoint(saved), manifest, "another model",
                   "blocks.2")
    torch.manual_seed(0)
    wider = TinyGPT(TinyGPTConfig(n_embd=32))
    engine = zerokit.initialize(wider, torch.optim.AdamW(wider.parameters()), {"zero_optimization": {"stage": 1}})
    one_line_error(lambda: engine.load_checkpoint(saved), manifest, "another model", "has shape")


def test_an_incompatible_version_is_named(saved) -> None:
    path = saved / "t" / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 99, "zerokit_version": "9.0"}))
    one_line_error(lambda: make_engine(stage=2).load_checkpoint(saved), str(path), "version 99", "reads version 1")


def test_a_save_in_the_middle_of_an_accumulation_window_is_refused(one_process, tmp_path) -> None:
    engine = make_engine(accumulation=2)
    train(engine, range(1))  # one micro-step of two
    one_line_error(lambda: engine.save_checkpoint(tmp_path), str(tmp_path), "middle of an accumulation window",
                   "micro-step 1, 2 per optimizer step")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_within_window_saves_without_the_windows_gradients(one_process, tmp_path, stage: int) -> None:
    """As DDP saves (issue 31): the checkpoint holds the last step's states and no gradient of the open window. A
    resumed engine holds none either and ends its window where the uninterrupted one does, on the micro-batches it
    saw itself: to the bit the run whose micro-step before the save added nothing (a zero loss)."""
    engine = make_engine(stage=stage, accumulation=2)
    train(engine, range(3))  # one window, then one micro-step of the next
    engine.save_checkpoint(tmp_path, tag="t", within_window=True)
    resumed = make_engine(stage=stage, accumulation=2)
    resumed.load_checkpoint(tmp_path, tag="t")
    assert not resumed.progress.inside_window and resumed.progress.micro_step == 3
    train(resumed, range(3, 4))
    assert resumed.progress.optimizer_step == 2 and not resumed.progress.inside_window
    reference = make_engine(stage=stage, accumulation=2)
    train(reference, range(2))
    reference.backward(train_loss(reference, 2) * 0.0)
    reference.step()
    train(reference, range(3, 4))
    expected, got = reference.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_an_interrupted_or_absent_checkpoint_is_named(one_process, tmp_path) -> None:
    one_line_error(lambda: make_engine().load_checkpoint(tmp_path), str(tmp_path / "latest"), "missing")
    (tmp_path / ".t.partial-123").mkdir()
    one_line_error(lambda: make_engine().load_checkpoint(tmp_path, tag="t"), "manifest.json", "interrupted save",
                   ".t.partial-123")


def test_a_bad_tag_is_refused(one_process, tmp_path) -> None:
    one_line_error(lambda: make_engine().save_checkpoint(tmp_path, tag="../up"), "plain directory name")


# --- a rank killed mid-save ------------------------------------------------------------------------

def _killed_mid_save(rank: int, world_size: int, root: str) -> None:
    engine = make_engine(stage=3)
    train(engine, range(1))
    engine.save_checkpoint(root, tag="first")
    train(engine, range(1, 2))
    if rank == 1:  # dies after writing its file, before renaming it into place: between files
        os.replace = lambda *args: os._exit(3)
    engine.save_checkpoint(root, tag="second")


def test_a_rank_killed_between_files_leaves_the_previous_checkpoint_loadable(one_process, tmp_path) -> None:
    with pytest.raises(RuntimeError, match="a rank failed"):
        spawn(_killed_mid_save, 2, str(tmp_path))
    assert (tmp_path / "latest").read_text() == "first" and not (tmp_path / "second").exists()
    assert len(list(tmp_path.glob(".second.partial-*"))) == 1
    engine = make_engine(stage=1)  # one process loads what two ranks saved at stage 3
    path, _ = engine.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "first") and engine.progress.optimizer_step == 1
    one_line_error(lambda: make_engine(stage=1).load_checkpoint(tmp_path, tag="second"), "interrupted save")


def test_a_save_that_cannot_start_is_one_line_and_training_goes_on(one_process, tmp_path) -> None:
    """Its staging directory cannot be made (every rank reports that too, rather than raising alone and leaving the
    others waiting: See [Note: a save that fails]); tests/test_restart.py fills a disk under two ranks."""
    engine = make_engine()
    train(engine, range(1))
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeError) as error:
        engine.save_checkpoint(tmp_path / "file" / "ckpt")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"checkpoint 'global_step1' was not saved in {tmp_path}/file/ckpt: "
                                                      "rank 0: NotADirectoryError") and "preparing" in message
    train(engine, range(1, 2))
    engine.save_checkpoint(tmp_path / "room")
    assert (tmp_path / "room" / "latest").read_text() == "global_step2"


# --- preemption (tests/test_restart.py sends the signals to torchrun jobs) -----------------------------------------

def test_a_signal_inside_a_window_saves_at_the_windows_end_and_exits_with_the_code(one_process, tmp_path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    engine = make_engine(accumulation=2, preemption={"enabled": True, "save_dir": str(tmp_path), "exit_code": 42})
    train(engine, range(2))  # one optimizer step
    engine.backward(train_loss(engine, 2))
    os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, inside the second window
    deadline = time.monotonic() + 5
    while not engine.preemption.requested and time.monotonic() < deadline:
        time.sleep(0.001)
    engine.step()  # not the window's end: no save, training goes on
    assert engine.preemption.requested and not (tmp_path / "latest").exists()
    engine.backward(train_loss(engine, 3))
    with pytest.raises(Preempted) as leaving:
        engine.step()
    assert leaving.value.code == 42 and (tmp_path / "latest").read_text() == "global_step2"
    assert checkpoint.read_manifest(tmp_path / "global_step2").progress["optimizer_step"] == 2
    engine.close()
    assert signal.getsignal(signal.SIGUSR1) == before  # the handler found at initialize is back


# --- the command line -------------------------------------------------------------------------------

def test_consolidate_command_writes_a_file_and_refuses_bad_sizes_in_one_line(saved, tmp_path, capsys) -> None:
    out = tmp_path / "model.safetensors"
    assert cli_main(["consolidate", str(saved), str(out), "--dtype", "bf16"]) == 0
    assert "wrote" in capsys.readouterr().out
    with safe_open(out, framework="pt") as file:
        assert file.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert cli_main(["consolidate", str(saved), str(tmp_path / "hf"), "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size 'lots' is not a size" in capsys.readouterr().err
    header = struct.unpack("<Q", out.read_bytes()[:8])[0]
    assert header % 8 == 0  # safetensors' alignment


# --- offloaded masters ------------------------------------------------------------------------------

@pytest.mark.parametrize("stage,offload", [(2, "nvme"), (3, "nvme"), (2, "cpu")])
def test_a_checkpoint_of_offloaded_masters_resumes_exactly(one_process, tmp_path, stage, offload) -> None:
    """Masters paged through NVMe live in their swap records, not in the pieces' tensors (placeholders between
    steps): a save reads the records and a load writes them back and publishes them, so the resumed steps equal
    the uninterrupted ones bit for bit, as they do for masters in memory."""
    block = {"device": offload, **({"nvme_path": str(tmp_path)} if offload == "nvme" else {})}

    def engine() -> zerokit.Engine:
        torch.manual_seed(0)
        model = TinyGPT(TinyGPTConfig(n_layer=2))
        zero = {"stage": stage, "reduce_bucket_bytes": 8192, "stage3_min_unit_params": 1000,
                "offload_optimizer": block, "sub_group_size": 3000}  # several NVMe records per master
        return zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                                  {"zero_optimization": zero, "gradient_clipping": 0.5})

    first = engine()
    train(first, range(3))
    first.save_checkpoint(tmp_path / "ckpt")
    expected = train(first, range(3, 6))
    resumed = engine()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train(resumed, range(3, 6)) == expected
    for (name, a), (_, b) in zip(first.full_state_dict().items(), resumed.full_state_dict().items()):
        assert torch.equal(a, b), name
