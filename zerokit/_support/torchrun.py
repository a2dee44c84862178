"""What torchrun tells its workers through the environment, read without importing torch (`import zerokit` reads it:
See [Note: a key space per attempt] in zerokit/comm/rendezvous.py)."""

from __future__ import annotations

import os
import warnings

SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def under_agent_store() -> bool:
    """Launched by torchrun with its agent's store, which outlives a restart."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def warn_if_restarted_under_shared_store() -> None:
    """Once a process, in a restarted attempt under the agent's shared store: a group the script starts itself
    reads the last attempt's keys there; say which setting avoids it before the script can start one."""
    if under_agent_store() and restart_count() > 0 and os.environ.get(SHARED_STORE_FIX) != "1" and \
            os.environ.get("RANK", "0") == "0":
        warnings.warn(f"zerokit: restart {restart_count()} of a torchrun job in its agent's shared store: a process "
                      f"group the script starts itself (init_process_group) can read the last attempt's addresses "
                      f"there and fail or hang (pytorch issue 135712); launch with {SHARED_STORE_FIX}=1, or leave "
                      "the group to zerokit.initialize or deepspeed.init_distributed, which start it in keys of "
                      "each attempt's own", stacklevel=2)


__all__ = ["SHARED_STORE_FIX", "restart_count", "under_agent_store", "warn_if_restarted_under_shared_store"]
