"""Host values to a device tensor in one copy (the sampler's and the verifier's small index lists)."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list, or a list of equally long lists) as a tensor on `device`, in one
    copy: on CUDA from pinned memory and without waiting for the stream (the pinned block's
    allocator holds it until the copy has run)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
