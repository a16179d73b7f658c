"""What runs a step's SchedulerOutput for the engine: the one in-process `ModelRunner`, or, with
the model split over ranks, `MultiprocExecutor` (rank 0's runner plus worker processes).

Its names are imported on first use: `python -m tokenmill.executor` (a worker rank) runs this file
first, and must tie itself to its parent (lifeline.py) before torch is imported."""

__all__ = ["MultiprocExecutor", "holds_rank_zero", "run_node"]


def __getattr__(name: str):
    if name in __all__:
        from tokenmill.executor import multiproc

        return getattr(multiproc, name)
    raise AttributeError(f"module 'tokenmill.executor' has no attribute {name!r}")
