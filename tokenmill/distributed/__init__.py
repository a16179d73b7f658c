"""Splitting one model over several ranks on `torch.distributed`: the process groups and their
collectives (`group.py`), and which part of each weight a rank holds (`sharding.py`)."""

from tokenmill.distributed.group import ParallelGroup, Rendezvous, init_parallel
from tokenmill.distributed.sharding import ShardPlan

__all__ = ["ParallelGroup", "Rendezvous", "ShardPlan", "init_parallel"]
