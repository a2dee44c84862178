"""Failures that multi-rank training adds, and mistakes that would train wrong in silence: each becomes a clear
error naming its cause, in bounded time, or the right result.

  fingerprint.py  agreement at start: every rank describes what it will train; a difference is named
  mistakes.py     wrapped models, nothing to train, requires_grad changed after start, backward twice
  buffers.py      broadcast_buffers: every rank's buffers equal to rank 0's, as DDP keeps them
  compiled.py     torch.compile beside zerokit's hooks
Deadlines and the flight recorder live with the collectives, in zerokit/comm/; stage 3's agreement on which
unit every rank gathers is part of how it gathers, in zerokit/stages/agreement.py.
"""

from zerokit.reliability.safeguards import Safeguards, check_at_start

__all__ = ["Safeguards", "check_at_start"]
