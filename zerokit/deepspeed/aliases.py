"""`zerokit.deepspeed.install()`: from then on `import deepspeed` (and every `deepspeed.*` module) is zerokit's
drop-in, and `importlib.metadata` answers for a `deepspeed` distribution, so that frameworks that look for
DeepSpeed (Hugging Face transformers and accelerate, Lightning) find zerokit.

    import zerokit.deepspeed; zerokit.deepspeed.install()   # before transformers / accelerate are imported
    python -m zerokit.deepspeed.install train.py --deepspeed ds_config.json   # the same, with no edit

[Note: deepspeed resolves to zerokit]
Frameworks find DeepSpeed twice: `importlib.util.find_spec("deepspeed")` and `importlib.metadata.metadata(
"deepspeed")` say whether it is installed (and `compare_versions("deepspeed", ...)` reads its version), then
`import deepspeed`, `from deepspeed.utils import logger`, ... fetch what they call. install() puts one object at
the front of sys.meta_path that answers both: as a module finder it maps `deepspeed.X` to the already imported
`zerokit.deepspeed.X` (the very module object, so `deepspeed.comm is zerokit.deepspeed.comm` and isinstance checks
hold across both names); as a distribution finder it describes a `deepspeed` distribution whose version is the
DeepSpeed release whose behaviour zerokit follows with zerokit's version as its local part (0.19.8+zerokit.0.1.0:
version checks such as ">= 0.9.3" pass, and the version says whose it is). Being first, both answers win over a
real DeepSpeed installed beside zerokit. A `deepspeed.X` zerokit does not offer is refused in one line when it
is imported (zerokit.deepspeed.launcher, moe, pipe), or is not found (ModuleNotFoundError naming it).
The real deepspeed already imported into the process cannot be replaced (objects made from it stay), so
install() refuses then.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any, Iterable

from zerokit.integrations.accelerate_cp import hook_accelerate_cp

ALIAS = "deepspeed"
TARGET = "zerokit.deepspeed"
DEEPSPEED_VERSION = "0.19.8"  # the DeepSpeed release whose API and behaviour zerokit.deepspeed follows


def distribution_version() -> str:
    """The version the `deepspeed` distribution reports: DeepSpeed's, with zerokit's as its local part."""
    return f"{DEEPSPEED_VERSION}+zerokit.{importlib.metadata.version('zerokit')}"


class AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed.X` as the module object `zerokit.deepspeed.X` (See [Note: deepspeed resolves to
    zerokit])."""

    def __init__(self, target: types.ModuleType) -> None:
        self.target = target
        self.target_spec = target.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.target

    def exec_module(self, module: types.ModuleType) -> None:
        # importlib set module.__spec__ to the alias's spec; the module stays zerokit's (reload, pickling).
        module.__spec__ = self.target_spec


class ZerokitDeepSpeed(importlib.metadata.Distribution):
    """The `deepspeed` distribution as importlib.metadata reports it once install() ran."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {distribution_version()}\n"
                    "Summary: zerokit's DeepSpeed drop-in (zerokit.deepspeed), "
                    "installed by zerokit.deepspeed.install()\n"
                    "Author: zerokit\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    """Module and distribution finder for `deepspeed`, first on sys.meta_path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        name = TARGET + fullname[len(ALIAS):]
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as missing:
            if missing.name != name:
                raise
            raise ModuleNotFoundError(f"{fullname} is not offered by zerokit's DeepSpeed drop-in "
                                      f"(zerokit.deepspeed has no {name[len(TARGET) + 1:]!r})", name=fullname) from None
        package = getattr(module, "__path__", None)
        spec = importlib.machinery.ModuleSpec(fullname, AliasLoader(module), origin=getattr(module, "__file__", None),
                                              is_package=package is not None)
        if package is not None:
            spec.submodule_search_locations = list(package)
        return spec

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()
                           ) -> Iterable[importlib.metadata.Distribution]:
        if context.name is None or context.name.replace("_", "-").lower() == ALIAS:
            return [ZerokitDeepSpeed()]
        return []


def installed() -> bool:
    return any(isinstance(finder, DeepSpeedAlias) for finder in sys.meta_path)


def install() -> None:
    """Make `import deepspeed` and every `deepspeed.*` import resolve to zerokit.deepspeed, and importlib.metadata
    describe a `deepspeed` distribution that says it is zerokit's (See [Note: deepspeed resolves to zerokit]).
    Call it before transformers, accelerate or lightning are imported; calling it again does nothing."""
    if installed():
        return
    loaded = sys.modules.get(ALIAS)
    if loaded is not None and not (loaded.__name__ or "").startswith(TARGET):
        raise RuntimeError("zerokit.deepspeed.install() must run before the real deepspeed is imported (it is "
                           f"already, from {getattr(loaded, '__file__', '?')}): call it first, before transformers, "
                           "accelerate or lightning are imported, or run `python -m zerokit.deepspeed.install "
                           "script.py ...`")
    sys.meta_path.insert(0, DeepSpeedAlias())
    hook_accelerate_cp()  # See [Note: accelerate's cp_size runs as Ulysses on zerokit]
    importlib.invalidate_caches()


__all__ = ["install", "installed", "distribution_version", "DeepSpeedAlias", "DEEPSPEED_VERSION"]
