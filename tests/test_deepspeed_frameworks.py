"""Hugging Face transformers, accelerate and Lightning reach zerokit where they reach for DeepSpeed (issue 23):
zerokit.deepspeed.install() and `python -m zerokit.deepspeed.install`, in fresh processes (the real deepspeed is
installed beside zerokit here); every deepspeed symbol those frameworks' sources name, read from the installed
sources by an AST scan, resolves on the drop-in or is refused in one line; the engine calls they make behave as
DeepSpeed's."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import zerokit.deepspeed as deepspeed
from test_deepspeed_api import one_process  # noqa: F401  (a fresh 1-rank group, LOCAL_RANK set)

FRAMEWORKS = ("transformers", "accelerate", "lightning")
# Named by the frameworks, and refused in one line by zerokit (what each asks for is out of scope).
REFUSED = {
    "deepspeed.launcher.runner": "launcher",
    "deepspeed.zero.register_external_parameter": "not offered",
}
# Named by the frameworks behind a try (transformers' esmfold), and absent from DeepSpeed 0.19.8 too.
ABSENT_IN_DEEPSPEED = {"deepspeed.utils.is_initialized"}
# What the Trainer and accelerate call on the engine (traced under real DeepSpeed: issue 23).
ENGINE_CALLS = ("backward", "set_gradient_accumulation_boundary", "step", "get_global_grad_norm", "train", "eval",
                "zero_grad", "save_checkpoint", "load_checkpoint", "zero_gather_16bit_weights_on_model_save",
                "_zero3_consolidated_16bit_state_dict", "module", "optimizer", "lr_scheduler", "config", "compile",
                "destroy", "state_dict", "is_gradient_accumulation_boundary", "gradient_accumulation_steps",
                "train_micro_batch_size_per_gpu", "zero_optimization_stage")


def run_python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


# --- install() -----------------------------------------------------------------------------------------------

def test_install_makes_deepspeed_zerokits_for_the_frameworks() -> None:
    result = run_python(textwrap.dedent("""
        import importlib.metadata, importlib.util, zerokit.deepspeed
        zerokit.deepspeed.install()
        import deepspeed, deepspeed.comm, deepspeed.runtime.engine, deepspeed.zero
        from transformers.integrations import is_deepspeed_available as hf
        from accelerate.utils import is_deepspeed_available as acc, compare_versions
        print(deepspeed is zerokit.deepspeed, deepspeed.comm is zerokit.deepspeed.comm,
              deepspeed.runtime.engine.DeepSpeedEngine is zerokit.deepspeed.DeepSpeedEngine,
              importlib.metadata.version("deepspeed"), importlib.metadata.metadata("deepspeed")["Summary"],
              hf(), acc(), compare_versions("deepspeed", ">=", "0.14.4"), zerokit.deepspeed.comm.__spec__.name)
    """))
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    assert words[:3] == ["True"] * 3
    assert words[3] == "0.19.8+zerokit." + importlib.metadata.version("zerokit")
    assert "zerokit's DeepSpeed drop-in" in result.stdout
    assert words[-4:] == ["True", "True", "True", "zerokit.deepspeed.comm"]


def test_install_after_the_real_deepspeed_is_refused_in_one_line() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the real deepspeed is not installed")
    result = run_python("import deepspeed, zerokit.deepspeed; zerokit.deepspeed.install()")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0
    assert last.startswith("RuntimeError: zerokit.deepspeed.install() must run before the real deepspeed is imported")


def test_a_module_zerokit_lacks_is_not_found_naming_it() -> None:
    result = run_python("import zerokit.deepspeed; zerokit.deepspeed.install(); import deepspeed.runtime.pipe.engine")
    assert result.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: deepspeed.runtime.pipe is not offered by zerokit's DeepSpeed drop-in (zerokit.deepspeed "
        "has no 'runtime.pipe')")


def test_the_command_runs_a_script_after_install(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys, deepspeed, helper\nprint(deepspeed.__name__, helper.NAME, sys.argv[1:], __name__)\n")
    (tmp_path / "helper.py").write_text("NAME = 'beside the script'\n")
    result = run_python("", "-m", "zerokit.deepspeed.install", str(script), "--deepspeed", "ds.json", cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "zerokit.deepspeed beside the script ['--deepspeed', 'ds.json'] __main__"
    assert callable(deepspeed.install)


# --- the symbol inventory ------------------------------------------------------------------------------------

def framework_files() -> list[Path]:
    files = []
    for name in FRAMEWORKS:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            files += [path for path in Path(root).rglob("*.py") if "test_utils" not in path.parts]
    return files


def _chain(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def deepspeed_symbols(path: Path) -> set[str]:
    """`deepspeed.a.b` attribute chains and `from deepspeed.a import b` names in one file (aliases followed)."""
    text = path.read_text(encoding="utf-8")
    if "deepspeed" not in text:  # most of transformers' thousands of files: no need to parse them
        return set()
    tree = ast.parse(text)
    aliases, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepspeed":
                    aliases[alias.asname or "deepspeed"] = alias.name if alias.asname else "deepspeed"
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "deepspeed":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                found.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        head = chain.split(".")[0] if chain else None
        if head in aliases:
            found.add(aliases[head] + chain[len(head):])
    return found


RESOLVE = textwrap.dedent("""
    import importlib, json, sys, zerokit.deepspeed
    zerokit.deepspeed.install()
    out = {}
    for symbol in json.loads(sys.argv[1]):
        parts = symbol.split(".")
        try:
            for cut in range(len(parts), 0, -1):
                try:
                    value = importlib.import_module(".".join(parts[:cut]))
                    break
                except ModuleNotFoundError as missing:
                    if missing.name != ".".join(parts[:cut]) or cut == 1:
                        raise
            for name in parts[cut:]:
                value = getattr(value, name)
            out[symbol] = "ok"
        except (ImportError, AttributeError, ValueError) as error:
            out[symbol] = "refused: " + str(error)
    print(json.dumps(out))
""")


def test_every_deepspeed_symbol_the_frameworks_name_resolves_or_is_refused_in_one_line() -> None:
    files = framework_files()
    if not files:
        pytest.skip("none of transformers, accelerate, lightning is installed")
    symbols = set().union(*(deepspeed_symbols(path) for path in files))
    # what the frameworks do with a name (setLevel on the logger, register_with_transformers) is theirs
    symbols = {symbol for symbol in symbols if not symbol.endswith((".setLevel", ".register_with_transformers"))}
    assert {"deepspeed.initialize", "deepspeed.zero.Init", "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
            "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES"} <= symbols  # the scan reads what it should
    result = run_python(RESOLVE, json.dumps(sorted(symbols)))
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    unexpected = {}
    for symbol, answer in outcome.items():
        reason = next((why for prefix, why in REFUSED.items() if symbol.startswith(prefix)), None)
        if symbol in ABSENT_IN_DEEPSPEED:
            reason = "has no attribute"
        if reason is None and answer != "ok":
            unexpected[symbol] = answer
        if reason is not None and not (answer.startswith("refused: ") and reason in answer and "\n" not in answer):
            unexpected[symbol] = f"expected a one-line refusal naming {reason!r}, got {answer!r}"
    assert not unexpected, unexpected


def test_the_engine_answers_every_call_the_trainer_makes() -> None:
    missing = [name for name in ENGINE_CALLS if not hasattr(deepspeed.DeepSpeedEngine, name)
               and name not in ("module", "optimizer", "lr_scheduler", "config")]
    assert not missing


# --- the engine calls, with DeepSpeed's meaning (one process) ---------------------------------------------

def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


BATCHES = [torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)) for seed in range(5)]


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def hf_engine(stage: int, **extra):
    """An engine as accelerate builds it for the Trainer: the Trainer's AdamW passed in, gas 3, its own LambdaLR."""
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, **extra}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config_params=config)
    return engine, optimizer, config


@pytest.mark.parametrize("stage", [1, 2])
def test_a_short_window_and_the_trainers_schedule_train_as_torch_does(one_process, stage: int) -> None:
    """Windows of 2 (an epoch's short last one) then 3 micro-steps, boundaries set as accelerate sets them, the
    loss divided by the caller (scale_wrt_gas=False), the Trainer's LambdaLR stepped on its own optimizer."""
    engine, optimizer, _ = hf_engine(stage)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    reference = small_model()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    torch_schedule = torch.optim.lr_scheduler.LambdaLR(torch_optimizer, lambda step: 0.5 ** step)
    windows = [BATCHES[:2], BATCHES[2:5]]
    for window in windows:
        for index, batch in enumerate(window):
            boundary = index == len(window) - 1
            engine.set_gradient_accumulation_boundary(boundary)
            engine.backward(loss_of(engine, batch) / len(window), scale_wrt_gas=False)
            (loss_of(reference, batch) / len(window)).backward()
            if boundary:
                engine.step()
        torch_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        assert engine.get_global_grad_norm() == pytest.approx(torch_norm.item(), rel=1e-5)
        schedule.step()
        torch_schedule.step()
    assert engine.global_steps == 2  # the second step ran at 0.05, the schedule's: the parameters say so
    with engine.unsharded():
        for ours, theirs in zip(engine.module.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)


def test_backward_divides_by_the_window_unless_told_not_to(one_process) -> None:
    engine, *_ = hf_engine(1)
    loss = loss_of(engine, BATCHES[0])
    assert engine.backward(loss).item() == pytest.approx(loss.item() / 3)
    engine.step()
    loss = loss_of(engine, BATCHES[1])
    assert engine.backward(loss, scale_wrt_gas=False).item() == pytest.approx(loss.item())


def test_the_engine_reads_as_the_trainer_reads_it(one_process) -> None:
    engine, optimizer, config = hf_engine(2)
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and isinstance(engine.module, nn.Sequential)
    assert engine.config.get("zero_optimization", {}).get("stage") == 2 and engine.config["steps_per_print"] == config[
        "steps_per_print"] and engine.config.stage == 2 and engine.config.gradient_accumulation_steps == 3
    assert engine.zero_gather_16bit_weights_on_model_save()
    state = engine._zero3_consolidated_16bit_state_dict()
    assert list(state) == list(small_model().state_dict())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1)
    engine.lr_scheduler = schedule  # engine-stepped from now on, as assigning DeepSpeed's is
    assert engine.lr_scheduler is schedule
    for batch in BATCHES[:3]:
        engine.backward(loss_of(engine, batch))
        engine.step()
    assert engine.get_lr() == pytest.approx([0.01])
    engine.lr_scheduler = None
    assert engine.lr_scheduler is None and engine.lr_schedules == []


def test_save_checkpoint_takes_the_trainers_keywords(one_process, tmp_path: Path) -> None:
    engine, *_ = hf_engine(2)
    for batch in BATCHES[:3]:
        engine.backward(loss_of(engine, batch))
        engine.step()
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert sorted(path.name for path in tmp_path.glob("global_step*")) == ["global_step1"]
    path, _ = engine.load_checkpoint(tmp_path, load_module_strict=True, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    assert path == str(tmp_path / "global_step1")
    from zerokit.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    saved = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    for name, tensor in engine.full_state_dict().items():
        assert torch.equal(saved[name], tensor)
