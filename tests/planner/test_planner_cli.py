"""`zerokit plan` and `zerokit translate`, in-process through zerokit.cli.main, and the README example."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

import zerokit.cli
from zerokit.planner import plan
from zerokit.planner.advice import OFFLOAD_TIERS
from zerokit.planner.spec import GB

ROOT = Path(__file__).resolve().parents[2]
README_EXAMPLE = ("zerokit plan --model llama2-13b --gpu a100-80gb --gpus-per-node 8 --nodes 1 --dtype bf16 "
                  "--optimizer adamw --seq-len 4096 --micro-batch 1 --memo memo.md")


@pytest.fixture(autouse=True)
def registered_subcommands(monkeypatch):
    """Register only subcommands whose modules exist (`demo` is written elsewhere, in parallel)."""
    present = [name for name in zerokit.cli.SUBCOMMANDS if importlib.util.find_spec(f"zerokit.cli.{name}")]
    assert {"plan", "translate"} <= set(present)
    monkeypatch.setattr(zerokit.cli, "SUBCOMMANDS", present)


def cli(*argv: str) -> int:
    return zerokit.cli.main(list(argv))


def test_readme_example_is_the_documented_command():
    assert README_EXAMPLE in (ROOT / "docs" / "planner.md").read_text()


def readme_planner_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Which stage\n", 1)[1].split("\n## ", 1)[0]


def test_readme_example_is_the_tested_command():
    """The README's command (with its line continuation) is the one these tests run."""
    section = readme_planner_section()
    command = section.split("    zerokit plan ", 1)[1].split("\n\n", 1)[0]
    assert " ".join(("zerokit plan " + command).replace("\\\n", " ").split()) == README_EXAMPLE


def test_readme_figures_are_what_the_example_plans():
    """The README quotes the pick and five numbers of its example; recompute them."""
    p = plan(model="llama2-13b", gpu="a100-80gb", gpus_per_node=8, nodes=1, precision="bf16", optimizer="adamw",
             seq_len=4096, micro_batch=1)
    stage2 = next(e for e in p.stages if e.stage == 2)
    quoted = (f"picks **ZeRO-3, no offload, no activation checkpointing**: {p.pick.memory.total / GB:.1f} of "
              f"{p.pick.usable / GB:.1f} usable GB per GPU (ZeRO-2 needs {stage2.memory.total / GB:.1f} GB), and "
              f"{p.pick.comm.seconds:.2f} s of NVLink traffic per step hides behind {p.pick.compute.seconds:.2f} s "
              "of compute")
    assert quoted in " ".join(readme_planner_section().split())  # whatever the line wrapping
    assert p.pick.stage == 3 and not p.pick.offload.any and p.pick.training.checkpointing == "none"


def test_readme_tree_lists_the_offload_tiers_in_the_order_tried():
    section = readme_planner_section()
    positions = [section.index(tier.name) for tier in OFFLOAD_TIERS]
    assert positions == sorted(positions)
    stages = [section.index(f"ZeRO-{stage} ─ fits") for stage in range(4)]
    assert stages == sorted(stages) and stages[-1] < positions[0]  # every stage on the GPU, then offload


def test_documented_output_is_what_the_command_prints(tmp_path, monkeypatch, capsys):
    """docs/planner.md shows the example's output verbatim; it must not drift from the code."""
    docs = (ROOT / "docs" / "planner.md").read_text()
    shown = docs.split("prints\n\n```\n", 1)[1].split("```\n", 1)[0]
    monkeypatch.chdir(tmp_path)
    assert cli(*shlex.split(README_EXAMPLE)[1:]) == 0
    assert capsys.readouterr().out == shown


def test_readme_example_writes_the_13b_memo(tmp_path, monkeypatch, capsys):
    """The README's command: pick ZeRO-3 without offload or recomputation, 66.25 of 77.31 GB usable."""
    monkeypatch.chdir(tmp_path)
    assert cli(*shlex.split(README_EXAMPLE)[1:]) == 0
    memo = (tmp_path / "memo.md").read_text()
    assert "**ZeRO-3, no offload, no activation checkpointing, micro-batch 1** (largest that fits: 1)" in memo
    assert "66.3 GB of the 77.3 GB usable per GPU" in memo
    rows = {row.split(" | ")[0].strip("| "): row for row in memo.splitlines() if row.startswith("| ZeRO-")}
    # model states per stage for P = 13,015,864,320 parameters, N = 8, fp32 gradient shards:
    assert "| 26.03 | 32.54 | 19.52 |" in rows["ZeRO-1"]  # 2P + (2P + the fp32 reduced shards 4P/8) + 12P/8
    assert "| 26.03 | 6.51 | 19.52 |" in rows["ZeRO-2"]  # 2P + 4P/8 + 12P/8
    # (4 + 12)P/8, activations, buffers: the trainable shards are the fp32 masters (zerokit/flat/sharded.py)
    assert "| 0.00 | 6.51 | 19.52 | 32.18 | 7.04 |" in rows["ZeRO-3"]
    assert rows["ZeRO-3"].split(" | ")[1] == "yes" and rows["ZeRO-2"].split(" | ")[1] == "no"
    assert "`engine.comm_stats()` should grow by this much per optimizer step" in memo
    assert '"stage": 3' in memo  # the config that implements the pick
    out = capsys.readouterr().out
    assert "pick: ZeRO-3, no offload, no checkpointing, micro-batch 1" in out
    assert re.search(r"ZeRO-3\s+yes\s+0\.00\s+6\.51\s+19\.52\s+32\.18\s+7\.04\s+1\.00\s+66\.25", out)


@pytest.mark.parametrize("command", ["plan", "translate"])
def test_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(command, "--help")
    assert exit_info.value.code == 0 and f"usage: zerokit {command}" in capsys.readouterr().out


def test_json_output(capsys):
    assert cli("plan", "--model", "llama2-13b", "--seq-len", "4096", "--json") == 0
    document = json.loads(capsys.readouterr().out)
    assert document["pick"]["stage"] == 3
    assert document["pick"]["memory_bytes"]["optimizer_state"] == 12 * 13_015_864_320 // 8
    # the root unit (embedding, head, final norm, and the blocks' norms: 328,094,720) is gathered once
    assert document["pick"]["comm_stats_per_step"]["all_gather"]["elements"] == 2 * 13_015_864_320 - 328_094_720


def test_json_output_on_two_nodes_carries_the_rivals_and_their_cross_node_bytes(capsys):
    assert cli("plan", "--model", "llama2-13b", "--nodes", "2", "--nics-per-node", "4", "--json") == 0
    document = json.loads(capsys.readouterr().out)
    pick = document["pick"]
    assert pick["cross_node_bytes_per_step"] == sum(c["cross_node_bytes"] for c in pick["collectives"]
                                                    if c["phase"] != "init") > 0
    assert document["rivals"] and all(r["stage"] == pick["stage"] for r in document["rivals"])
    assert {r["label"] for r in document["rivals"]}.isdisjoint({pick["label"]})


@pytest.mark.parametrize("target, marker", [("zerokit", '"stage": 3'), ("deepspeed", "stage3_prefetch_bucket_size"),
                                            ("fsdp", "reshard_after_forward=True")])
def test_emit_prints_only_the_config_on_stdout(target, marker, capsys):
    assert cli("plan", "--model", "llama2-13b", "--seq-len", "4096", "--emit", target) == 0
    captured = capsys.readouterr()
    assert marker in captured.out and "pick: ZeRO-3" in captured.err
    if target != "fsdp":
        json.loads(captured.out)


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert cli("plan", "--model", "llama2-13b", "--seq-len", "4096", "--plot", str(path)) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_node_lora_and_offload_options(tmp_path, capsys):
    assert cli("plan", "--model", "llama2-70b", "--gpu", "h100-sxm", "--nodes", "4", "--seq-len", "4096",
               "--lora-rank", "16", "--memo", str(tmp_path / "m.md")) == 0
    memo = (tmp_path / "m.md").read_text()
    assert "## Hybrid layouts on paper" in memo and "replicas=4 (HSDP)" in memo
    assert cli("plan", "--model", "llama2-70b", "--seq-len", "4096", "--checkpointing", "full") == 0
    assert "host RAM" in capsys.readouterr().out


def test_arch_and_params_inputs(capsys):
    assert cli("plan", "--arch", "layers=40,hidden=5120,heads=40,kv_heads=40,ffn=13824,vocab=32000",
               "--seq-len", "4096") == 0
    assert "13B parameters" in capsys.readouterr().out
    assert cli("plan", "--params", "13e9", "--seq-len", "4096") == 0
    assert "activations and the stage-3 gather unit are not modelled" in capsys.readouterr().out


def test_nothing_fits_exits_1(capsys):
    assert cli("plan", "--model", "llama2-70b", "--gpus-per-node", "1", "--offload", "none",
               "--checkpointing", "full", "--seq-len", "4096") == 1
    assert "pick: nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "llama9"], "unknown model preset 'llama9'"),
    (["plan", "--params=-13e9"], "parameter count -13000000000.0 must be a positive whole number"),
    (["plan", "--params", "0"], "parameter count 0.0 must be a positive whole number"),
    (["plan", "--model", "gpt2", "--seq-len", "2048"], "exceeds gpt2's 1024 learned positions"),
    (["plan", "--model", "llama2-13b", "--tp", "3"], "world size 8 does not fit the layout tp=3"),
    (["plan", "--model", "llama2-13b", "--micro-batch", "0"], "micro batch=0 must be a positive integer"),
    (["plan", "--arch", "layers=2,hidden=64"], "--arch is missing heads, ffn, vocab"),
    (["plan", "--arch", "layers=2,colour=red"], "--arch item 'colour=red' is not key=value"),
    (["plan", "--model", "llama2-70b", "--gpus-per-node", "1", "--offload", "none", "--checkpointing", "full",
      "--emit", "zerokit"], "nothing fits, so there is no config to emit"),
    # argparse's own errors: one line, not the 40-line usage first
    (["plan", "--model", "llama2-13b", "--gpu", "nope"],
     "argument --gpu: invalid choice: 'nope' (choose from 'a100-40gb'"),
    (["plan", "--model", "llama2-13b", "--dtype", "fp8"], "invalid choice: 'fp8' (choose from 'bf16', 'fp16', 'fp32')"),
    (["plan"], "give the model: --model, --params or --arch"),
    (["plan", "--params", "13B"], "argument --params: '13B' is not a number"),
    (["plan", "--params", "inf"], "argument --params: 'inf' is not a finite number"),
    (["plan", "--model", "llama2-13b", "--mfu", "nan"], "argument --mfu: 'nan' is not a finite number"),
    (["plan", "--model", "llama2-13b", "--nodes", "two"], "argument --nodes: invalid int value: 'two'"),
    (["plan", "--model", "llama2-13b", "--replicas", "3"],
     "world size 8 does not fit the layout tp=1 x pp=1 x replicas=3"),
    (["plan", "--model", "llama2-13b", "--emit", "deepspeed", "--gradient-clipping", "-1"],
     "gradient clipping=-1.0 must be >= 0"),
    (["translate", "--from", "megatron"], "argument --from: invalid choice: 'megatron'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    try:
        code = cli(*argv)
    except SystemExit as exit_info:  # argparse's errors exit from inside parse_args
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith(f"zerokit {argv[0]}: error: ")


def test_malformed_config_json_exit_2(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    assert cli("plan", "--model", str(bad)) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_translate_deepspeed_file(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "overlap_comm": True}}))
    assert cli("translate", str(config)) == 0
    out = capsys.readouterr().out
    assert "deepspeed -> fsdp" in out and "FULL_SHARD" in out and "deepspeed -> zerokit" in out


def test_translate_fsdp_terms_to_deepspeed(capsys):
    assert cli("translate", "--fsdp", "SHARD_GRAD_OP", "param_dtype=bf16", "--json") == 0
    results = json.loads(capsys.readouterr().out)
    assert results[0]["config"]["zero_optimization"] == {"stage": 2}


def test_translate_prints_the_table_then_fails_for_no_equivalent(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert cli("translate", str(config)) == 2
    captured = capsys.readouterr()
    assert "deepspeed -> fsdp" in captured.out
    assert "no equivalent for deepspeed -> fsdp: offload_optimizer.device=cpu" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["translate"], "give a DeepSpeed/zerokit JSON config file or --fsdp"),
    (["translate", "/nonexistent.json"], "does not exist"),
    (["translate", "--fsdp", "HALF_SHARD"], "FSDP term 'HALF_SHARD' is not understood"),
])
def test_translate_bad_input(argv, message, capsys):
    assert cli(*argv) == 2
    assert message in capsys.readouterr().err
