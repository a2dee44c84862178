"""`deepspeed.moe` for zerokit: DeepSpeed's MoE layer (layer.py) over zerokit's expert room
(zerokit/parallel/experts), and the parameter-group helpers its scripts call (utils.py). Imported by submodule, as
DeepSpeed's scripts do (`from deepspeed.moe.layer import MoE`), or reached as attributes after `import deepspeed`
(`deepspeed.moe.layer.MoE`, as DeepSpeedExamples' cifar10 script does): each submodule is imported on first use."""

import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    if name in ("layer", "utils"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
