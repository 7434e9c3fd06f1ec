"""Float64 references for the kernel tests: plain torch ops on upcast copies, on the CPU.

Add functions here; each returns float64 tensors computed without any Triton code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401


def f64(t: torch.Tensor) -> torch.Tensor:
    """A detached float64 CPU copy."""
    return t.detach().to(device="cpu", dtype=torch.float64)
