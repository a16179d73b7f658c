"""Injected faults, for testing what a client sees when the engine fails.

A `FaultPlan` is parsed from `EngineConfig.fault_injection` (the CLI fills it from the
`TOKENMILL_FAULT_INJECT` environment variable at start-up; there is no flag):

    raise@step=N               the N-th engine step (counted from 1) raises InjectedFault
                               where the model forward would run
    stall@step=N:seconds=S     the N-th step sleeps S seconds first (the GIL released, as a
                               hung device or kernel would leave it), then runs

Nothing else reads it; with no plan the engine step does not look at it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

FAULT_ENV = "TOKENMILL_FAULT_INJECT"
FAULT_KINDS = ("raise", "stall")
_SYNTAX = "raise@step=N or stall@step=N:seconds=S"
_PATTERN = re.compile(r"(?P<kind>[a-z]+)@step=(?P<step>\d+)(?::seconds=(?P<seconds>\d+(?:\.\d*)?))?")


class InjectedFault(RuntimeError):
    """The exception a `raise@step=N` plan throws from the engine step."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    kind: str
    step: int  # 1 = the first engine step
    seconds: float = 0.0  # stall only

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        """Parse `raise@step=N` / `stall@step=N:seconds=S`; ValueError naming the syntax otherwise."""
        m = _PATTERN.fullmatch(spec.strip())
        if m is None or m["kind"] not in FAULT_KINDS:
            raise ValueError(f"expected {_SYNTAX}, got {spec!r}")
        step = int(m["step"])
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step} in {spec!r}")
        if (m["kind"] == "stall") != (m["seconds"] is not None):
            raise ValueError(f"seconds is given for stall and only for stall ({_SYNTAX}), got {spec!r}")
        return cls(m["kind"], step, float(m["seconds"] or 0.0))

    def before_forward(self, step: int) -> None:
        """Called by the engine step `step` (from 1) before the model runs."""
        if step != self.step:
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected fault at engine step {step}")
        time.sleep(self.seconds)
