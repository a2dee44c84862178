from zerokit.comm.collectives import Collective, CommStats, Communicator, Pending, wait

__all__ = ["Collective", "CommStats", "Communicator", "Pending", "wait"]
