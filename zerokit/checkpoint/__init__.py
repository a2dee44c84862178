"""Sharded checkpoints: save on N ranks at one stage, resume on M ranks at any stage, consolidate offline.

    engine.save_checkpoint("ckpt", client_state={"step": step})       # every rank; atomic
    engine.save_checkpoint("ckpt", async_save=True)                   # training waits for a host copy only
    path, client_state = engine.load_checkpoint("ckpt")                # any world size, any stage
    zerokit.checkpoint.newest_checkpoint("ckpt")                       # what the config's resume block loads
    zerokit.checkpoint.consolidate("ckpt", "model.safetensors")        # offline; or `zerokit consolidate`

A checkpoint is a directory per tag (one standard safetensors file per rank, `manifest.json`, and the
client state) and a `latest` pointer: See docs/checkpoints.md, and the [Note: ...] blocks of
manifest.py (what is saved, per parameter), save.py (atomicity), files.py (checksums, range reads),
load.py (all ranks fail together) and consolidate.py (streaming).
"""

from zerokit.checkpoint.consolidate import Consolidated, consolidate
from zerokit.checkpoint.files import CheckpointFileError
from zerokit.checkpoint.load import load_checkpoint
from zerokit.checkpoint.locate import checkpoint_directory
from zerokit.checkpoint.manifest import Manifest, read_manifest
from zerokit.checkpoint.newest import newest_checkpoint
from zerokit.checkpoint.save import save_checkpoint
from zerokit.checkpoint.session import wait

__all__ = ["CheckpointFileError", "Consolidated", "Manifest", "checkpoint_directory", "consolidate", "load_checkpoint",
           "newest_checkpoint", "read_manifest", "save_checkpoint", "wait"]
