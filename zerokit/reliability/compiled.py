"""torch.compile beside zerokit's hooks: what works (everything but one case), and the function `engine.compile()`
calls.

[Note: torch.compile and zerokit's hooks]
zerokit's forward hooks (stage 3's unit hooks, which gather and free units; broadcast_buffers' hooks) gather,
free and broadcast through collectives and a state machine: code that dynamo must not trace (tracing them
is what failed with "incorrect fake (aka meta) kernel for a custom op"). So they are wrapped in
torch.compiler.disable, as FSDP2 and DeepSpeed do with theirs: inside compiled code each becomes a graph break
and runs eagerly. Then, as tests/test_mistakes.py checks on 2 ranks against eager training: a model compiled
whole (torch.compile(model) or model.compile()) trains at every stage; so does a model whose units (or other
submodules) are compiled, in place or as torch.compile(...) wrappers. At stage 3 a whole-model graph is cut
at every unit's hooks (each unit's body is compiled on its own, as FSDP2 users compile each block).
The one thing that cannot work: `fullgraph=True` on a module that has a stage-3 unit strictly inside it,
since the unit's hooks must break the graph. That is refused in one line at initialize (and by compile_model)
naming what to compile instead: each unit, e.g. `model.blocks[i] = torch.compile(model.blocks[i],
fullgraph=True)`, so that the unit's hooks sit on the compiled wrapper, outside its graph.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from zerokit.config.settings import RunSettings

FULLGRAPH_AT_STAGE_3 = ("{what} with fullgraph=True around stage-3 unit {unit!r}, whose gather and free "
                        "must run between compiled graphs; compile each unit instead (e.g. model.blocks[i] = "
                        "torch.compile(model.blocks[i], fullgraph=True): its hooks then sit outside its graph), or "
                        "compile without fullgraph=True")


def refuse_fullgraph_around_units(model: nn.Module, stage: int, units: Any) -> None:
    """Stage 3: no module compiled with fullgraph=True may hold a unit strictly inside it (`units`: config/typed.py's
    Stage3Policy)."""
    if stage != 3:
        return
    from zerokit.stages.units import find_units

    unit_modules = {id(unit.module): unit.name for unit in find_units(model, units)[1:]}
    for name, module in model.named_modules():
        if _compiled_fullgraph(module):
            inside = next((unit_modules[id(m)] for m in module.modules() if m is not module and id(m) in unit_modules),
                          None)
            if inside is not None:
                raise ValueError(FULLGRAPH_AT_STAGE_3.format(
                    what=f"module {name!r} is compiled" if name else "the model is compiled", unit=inside))


class Compilable(Protocol):
    """What compile_model reads of an engine (zerokit/engine/engine.py's Engine, or the drop-in's). Named by its shape,
    not imported: the engine imports the reliability checks, and a type is named only downward."""

    parts: RunSettings  # the run's settings (config/settings.py): its stage
    stage: Any  # stages/base.py's ZeroStage; at stage 3 its `units`, the model's root unit first
    module: nn.Module


def compile_model(engine: Compilable, backend: Any = "inductor", **compile_kwargs: Any) -> None:
    """Compile the engine's model in place (nn.Module.compile), as DeepSpeed's engine.compile() does; zerokit's
    hooks stay eager (See [Note: torch.compile and zerokit's hooks]). `compile_kwargs` go to torch.compile."""
    if engine.parts.stage.stage == 3 and compile_kwargs.get("fullgraph") and len(engine.stage.units) > 1:
        raise ValueError(FULLGRAPH_AT_STAGE_3.format(what="engine.compile() would compile the model",
                                                     unit=engine.stage.units[1].name))
    engine.module.compile(backend=backend, **compile_kwargs)


def _compiled_fullgraph(module: nn.Module) -> bool:
    """A torch.compile(module, fullgraph=True) wrapper. (nn.Module.compile keeps its options in a closure: such
    a module with fullgraph=True around a unit fails at its first forward, with dynamo's own message.)"""
    context = getattr(module, "dynamo_ctx", None)
    return type(module).__name__ == "OptimizedModule" and bool(getattr(context, "fullgraph", False))
