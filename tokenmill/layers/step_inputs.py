"""A step's integer inputs, staged on the host and uploaded in one copy per dtype.

A forward pass reads a handful of small integer tensors built on the host: token ids,
positions, cache slots, block tables, lengths. Built one by one with `torch.tensor(...).to(cuda)`
each is a copy from pageable memory that waits for the stream (every kernel queued before it).
`StepInputs` instead writes them into one persistent int64 and one persistent int32 host buffer
(pinned on CUDA) and uploads each with one non-blocking copy into a persistent device buffer,
of which the tensors handed out are views. The buffers grow when a step needs more, never per
step.

On a CPU there is nothing to upload: the host buffers are the tensors handed out (a numpy fill
and a view cost less than `torch.tensor` of a list).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MIN_CAPACITY = 1024  # elements of each dtype a new StepInputs holds
# Every tensor handed out starts at a multiple of this many bytes, as a fresh allocation would:
# Triton specializes a kernel on whether each pointer argument is 16-byte aligned, so offsets
# that moved with the batch would compile new variants of the kernels now and then.
ALIGN_BYTES = 16


class _Buffer:
    """One dtype's host buffer (with its numpy view) and device buffer (the same tensor when
    nothing is copied), and how much of them the step has taken."""

    def __init__(self, dtype: torch.dtype, capacity: int, device: torch.device, copy: bool, pin: bool):
        self.host = torch.zeros(capacity, dtype=dtype, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.device = torch.zeros(capacity, dtype=dtype, device=device) if copy else self.host
        self.used = 0


class StepInputs:
    """Hands out a step's integer tensors as views of one int64 and one int32 buffer, on the
    device once `upload` has run.

    Contract: a tensor handed out holds its values once `upload()` has been called (without a
    copy, at once); read it only after that. The first tensor handed out after an upload begins
    the next step, whose values take the same buffers: a step's tensors are valid until then (on
    CUDA the device buffers are rewritten by the next upload, a copy queued behind the earlier
    step's kernels, so those kernels read their own step's values). Two forward passes whose
    inputs must be valid at once (a target step and a draft model's catch-up) use two instances.

    copy: the tensors are views of separate device buffers, filled by `upload` (default: on
    CUDA; on a CPU it tests the copying path). pin: the host buffers are pinned, the copies
    non-blocking, and a CUDA event guards the host buffers (default: on CUDA)."""

    def __init__(self, device: torch.device | str, copy: bool | None = None, pin: bool | None = None,
                 capacity: int = MIN_CAPACITY):
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.copy = on_cuda if copy is None else copy
        self.pin = on_cuda if pin is None else pin
        assert self.copy or not on_cuda, "CUDA tensors are uploaded from the host buffers"
        assert self.copy or not self.pin, "pinned host buffers are for copies"
        self._buffers = {dt: _Buffer(dt, capacity, self.device, self.copy, self.pin)
                         for dt in (torch.long, torch.int32)}
        # The last upload's copies have read the host buffers once this event completes.
        self._uploaded = torch.cuda.Event() if self.pin else None
        self._in_step = False  # something was taken since the last upload
        self._retired: list[torch.Tensor] = []  # outgrown host buffers that a queued copy still reads

    def longs(self, values: Sequence[int]) -> torch.Tensor:
        """[len(values)] int64."""
        host, dev = self._take(torch.long, len(values))
        host[:] = values
        return dev

    def ints(self, values: Sequence[int]) -> torch.Tensor:
        """[len(values)] int32."""
        host, dev = self._take(torch.int32, len(values))
        host[:] = values
        return dev

    def table(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(rows), the longest row's length] int32, each row padded with 0."""
        width = max((len(r) for r in rows), default=0)
        host, dev = self._take(torch.int32, len(rows) * width)
        if width:
            host.reshape(len(rows), width)[:] = [list(r) + [0] * (width - len(r)) for r in rows]
        return dev.view(len(rows), width)

    def upload(self) -> None:
        """Copy what the step staged to the device (nothing to do without a copy) and end the
        step."""
        if not self._in_step:
            return
        self._in_step = False
        if not self.copy:
            return
        for buf in self._buffers.values():
            if buf.used:
                buf.device[: buf.used].copy_(buf.host[: buf.used], non_blocking=self.pin)
        if self._uploaded is not None:
            self._uploaded.record()

    def _take(self, dtype: torch.dtype, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """The next n elements of the dtype's buffers: (host numpy view, tensor handed out)."""
        if not self._in_step:  # a new step: its values go where the last step's were
            self._in_step = True
            if self._uploaded is not None:
                self._uploaded.synchronize()  # (the step's sampling has synced already: returns at once)
            self._retired.clear()
            for buf in self._buffers.values():
                buf.used = 0
        buf = self._buffers[dtype]
        align = ALIGN_BYTES // buf.host.element_size()
        start = -(-buf.used // align) * align
        if start + n > buf.host.numel():
            buf, start = self._grow(dtype, n), 0
        buf.used = start + n
        return buf.host_np[start : start + n], buf.device[start : start + n]

    def _grow(self, dtype: torch.dtype, n: int) -> _Buffer:
        """Larger buffers for the dtype, the step's next n elements at their start. Views handed
        out this step keep the old device buffer: what they hold is copied there now."""
        old = self._buffers[dtype]
        if self.copy and old.used:
            old.device[: old.used].copy_(old.host[: old.used], non_blocking=self.pin)
            self._retired.append(old.host)  # until the next step's wait on the event covering that copy
        new = _Buffer(dtype, max(n, 2 * old.host.numel()), self.device, self.copy, self.pin)
        self._buffers[dtype] = new
        return new
