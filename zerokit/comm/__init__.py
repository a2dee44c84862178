from zerokit.comm.collectives import Communicator, Pending, wait
from zerokit.comm.counting import Collective, CommStats, Transfer
from zerokit.comm.deadline import CollectiveError
from zerokit.comm.groups import ProcessGroups
from zerokit.comm.reduction import Reduction

__all__ = ["Collective", "CollectiveError", "CommStats", "Communicator", "Pending", "ProcessGroups", "Reduction",
           "Transfer", "wait"]
