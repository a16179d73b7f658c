"""What runs a step's SchedulerOutput for the engine: the one in-process `ModelRunner`, or, with
the model split over ranks, `MultiprocExecutor` (rank 0's runner plus worker processes)."""

from tokenmill.executor.multiproc import MultiprocExecutor, holds_rank_zero, run_node

__all__ = ["MultiprocExecutor", "holds_rank_zero", "run_node"]
