"""zerokit's optional dependencies: the extra of pyproject.toml that brings each, and the one-line error
that names it when a feature needs a package that is not installed. Torch-free, like the planner.

Training needs only the core dependencies (torch, numpy, psutil, safetensors, tqdm); every other package is
imported inside the function that needs it, through `require`, so that a missing one fails there, in one
line, and nowhere else. tests/test_dependencies.py keeps this table, pyproject.toml and the imports of the
whole tree equal.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

EXTRA_OF = {
    "transformers": "hf",        # planner calibration of Hugging Face models, HF parity tests
    "matplotlib": "plot",        # zerokit plan --plot
    "tensorboard": "tensorboard",  # the tensorboard monitor
    "wandb": "wandb",            # the wandb monitor
    "deepspeed": "bench",        # benchmarks/ and comparisons against real DeepSpeed
    "accelerate": "bench",       # benchmarks/bench_planner.py: accelerate's memory estimator beside ours
    "lightning": "lightning",    # zerokit.integrations.lightning: ZerokitStrategy
}


class MissingExtra(ImportError):
    """An optional package a feature needs is not installed; the message names the extra to install."""


def install_hint(package: str) -> str:
    extra = EXTRA_OF.get(package)
    return f"pip install 'zerokit[{extra}]'" if extra else f"pip install {package}"


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def missing_message(package: str, needed_by: str) -> str:
    return f"{needed_by} needs the {package} package, which is not installed; {install_hint(package)}"


def require(package: str, needed_by: str) -> ModuleType:
    """Import `package`, or raise MissingExtra in one line saying what needs it and which extra brings it."""
    if not installed(package):
        raise MissingExtra(missing_message(package, needed_by))
    return importlib.import_module(package)


def monitor_missing(package: str, key: str) -> str:
    """The config-time error for a monitor block enabled without its package."""
    return f"{missing_message(package, f'{key}.enabled=true')} or set {key}.enabled to false"
