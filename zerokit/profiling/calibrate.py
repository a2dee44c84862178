"""Calibration: run the user's real model once per small shape and measure what the formulas can only
guess (See [Note: extrapolating a calibration] in zerokit/planner/calibration.py).

The model comes from a Hugging Face config.json, a planner preset (built with transformers from the
preset's shapes) or a module; a model with many blocks is calibrated on a copy with `layers` blocks,
since the fit is per block. Everything runs on the local device in the compute dtype, in train mode
(dropout on, as in training), with gradients allocated up front as the engine keeps them.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from zerokit.config.typed import DTYPES_BY_NAME
from zerokit._support.extras import require
from zerokit.planner.calibration import RELATIVE_PHASES, Calibration, Fit
from zerokit.planner.models import ModelSpec, resolve_model
from zerokit.profiling.inventory import blocks_of
from zerokit.profiling.measure import PHASES, AllocationTimeline, SavedTensorCounter, backward_phases

DTYPES = {name: DTYPES_BY_NAME[name] for name in ("fp32", "bf16", "fp16")}  # the planner's precision names
Inputs = Callable[[int, int], tuple[tuple, dict]]
LossOf = Callable[[Any], torch.Tensor]
BATCHES = (1, 2, 4, 8)  # with two lengths: enough shapes for the logits' gradients to show above the floor


def hf_config(model: str | ModelSpec, layers: int | None = None):
    """A transformers config for a config.json path or a planner preset, with `layers` blocks if given."""
    transformers = require("transformers", "calibrating a model's activations (zerokit plan --calibrate)")

    if isinstance(model, str) and (model.endswith(".json") or Path(model).is_file()):
        raw = json.loads(Path(model).read_text())
        config = transformers.AutoConfig.for_model(**raw)
    else:
        config = _preset_config(resolve_model(model), transformers)
    if layers is not None:
        key = "n_layer" if config.model_type == "gpt2" else "num_hidden_layers"
        setattr(config, key, min(layers, getattr(config, key)))
    return config


def _preset_config(spec: ModelSpec, transformers: Any):
    arch = spec.architecture
    if arch is None:
        raise ValueError(f"{spec.name} is a bare parameter count; calibration needs a preset, --arch or a config.json")
    if not arch.gated_mlp:
        return transformers.GPT2Config(n_layer=arch.n_layers, n_embd=arch.hidden, n_head=arch.n_heads,
                                       n_inner=arch.ffn, vocab_size=arch.vocab, n_positions=arch.max_positions or 1024)
    return transformers.LlamaConfig(num_hidden_layers=arch.n_layers, hidden_size=arch.hidden,
                                    num_attention_heads=arch.n_heads, num_key_value_heads=arch.n_kv_heads,
                                    intermediate_size=arch.ffn, vocab_size=arch.vocab,
                                    head_dim=arch.head_dim or arch.hidden // arch.n_heads,
                                    tie_word_embeddings=arch.tied_embeddings)


def build_hf_model(model: str | ModelSpec, layers: int | None = None, seed: int = 0) -> nn.Module:
    transformers = require("transformers", "building a Hugging Face model to measure")

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config(model, layers))


def hf_inputs(vocab: int, device: torch.device) -> Inputs:
    """Token ids as input and as labels: the model computes its own loss, upcast and all, as a user's would."""
    def make(batch: int, seq: int) -> tuple[tuple, dict]:
        tokens = torch.randint(0, vocab, (batch, seq), device=device, generator=None)
        return (), {"input_ids": tokens, "labels": tokens}
    return make


def _measure(model: nn.Module, blocks: list[nn.Module], inputs: Inputs, loss_of: LossOf, batch: int, seq: int,
             device: torch.device) -> dict:
    args, kwargs = inputs(batch, seq)
    counter = SavedTensorCounter(model, blocks)
    with AllocationTimeline(device) as allocated, backward_phases(blocks, allocated):
        with counter:
            loss = loss_of(model(*args, **kwargs))
        allocated.mark("head")
        loss.backward()
        del loss
    per_block = counter.per_block()
    phases = {phase: allocated.phase_peaks.get(phase, 0) for phase in PHASES}
    return {"batch": batch, "seq": seq, "saved": counter.total, "outside": counter.outside,
            "block": sum(per_block) / max(1, len(per_block)), "peak": allocated.peak, **phases}


def _timed(model: nn.Module, inputs: Inputs, loss_of: LossOf, batch: int, seq: int) -> dict:
    args, kwargs = inputs(batch, seq)
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = loss_of(model(*args, **kwargs))
    middle, middle_cpu = time.perf_counter(), time.process_time()
    loss.backward()
    return {"batch": batch, "seq": seq, "forward_s": middle - start, "backward_s": time.perf_counter() - middle,
            "forward_cpu_s": middle_cpu - start_cpu, "backward_cpu_s": time.process_time() - middle_cpu}


def calibrate_module(model: nn.Module, *, precision: str = "fp32", seqs: tuple[int, int] = (64, 128),
                     inputs: Inputs | None = None, loss_of: LossOf | None = None, name: str = "",
                     device: torch.device | None = None) -> Calibration:
    """Measure `model` (a copy, cast to `precision`, in train mode) at BATCHES x `seqs`. Without
    `inputs`/`loss_of` the model must be a Hugging Face causal LM (token ids in, `.loss` out)."""
    if precision not in DTYPES:
        raise ValueError(f"precision={precision!r} is not accepted; use one of {', '.join(DTYPES)}")
    if len(set(seqs)) != 2:
        raise ValueError(f"seqs={seqs!r} must be two different sequence lengths")
    device = device or torch.device("cpu")
    model = copy.deepcopy(model).to(device=device, dtype=DTYPES[precision]).train()
    if inputs is None:
        inputs = hf_inputs(model.config.vocab_size, device)
    loss_of = loss_of or (lambda output: output.loss)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for param in trainable:  # as the engine keeps them: accumulated in place, not allocated by backward
        param.grad = torch.zeros_like(param)
    blocks = list(blocks_of(model))
    torch.manual_seed(0)
    _timed(model, inputs, loss_of, 1, min(seqs))  # first calls allocate caches and pick kernels
    samples = [_measure(model, blocks, inputs, loss_of, b, s, device) for s in seqs for b in BATCHES]
    timing = _timed(model, inputs, loss_of, 2, max(seqs))
    for m in samples:  # phases that hold every saved activation are fitted as the excess over them
        m.update({f"{phase}_excess": m[phase] - m["saved"] for phase in RELATIVE_PHASES})
    fits = {key: Fit.of([(m["batch"], m["seq"], m[key]) for m in samples]) for key in ("block", "outside")}
    fits |= {phase: Fit.of([(m["batch"], m["seq"], m[f"{phase}_excess" if phase in RELATIVE_PHASES else phase])
                            for m in samples]) for phase in PHASES}
    return Calibration(model=name or type(model).__name__, precision=precision, device=device.type,
                       n_layers=len(blocks), samples=tuple(samples + [timing]), **fits)


def calibrate(model: str | ModelSpec | nn.Module, *, precision: str = "fp32", layers: int | None = 2,
              seqs: tuple[int, int] = (64, 128), **kwargs: Any) -> Calibration:
    """A config.json path, a preset name or spec (built with `layers` blocks), or a module (run as it is)."""
    if isinstance(model, nn.Module):
        return calibrate_module(model, precision=precision, seqs=seqs, **kwargs)
    name = model if isinstance(model, str) else model.name
    return calibrate_module(build_hf_model(model, layers), precision=precision, seqs=seqs, name=name, **kwargs)


def set_threads(threads: int) -> None:
    """Calibrate and measure with the threads one rank will have (each rank is its own process)."""
    if threads < 1:
        raise ValueError(f"threads={threads} must be a positive integer")
    torch.set_num_threads(threads)
