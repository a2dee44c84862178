"""`deepspeed.checkpoint` for zerokit: the helpers frameworks import from it (checkpoint.utils). zerokit's own
checkpoints are engine.save_checkpoint / load_checkpoint (zerokit/checkpoint)."""

from zerokit.deepspeed.checkpoint import utils  # imported with the package, as DeepSpeed's is

__all__ = ["utils"]
