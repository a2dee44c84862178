"""`deepspeed.runtime.sequence_parallel` for zerokit: DeepSpeed's ALST (Ulysses) entry points over
zerokit/parallel/sequence. See ulysses_sp.py and docs/sequence_parallel.md."""

from zerokit.deepspeed.runtime.sequence_parallel import parallel_state_sp, ulysses_sp

__all__ = ["parallel_state_sp", "ulysses_sp"]
