"""Shared by the memory-bound kernels: a 5-D activation seen as [N, S, C] without a copy.

[N, S, C] is the view every NDHWC (channels-last) or NCDHW tensor allows without a copy when its D, H, W
are contiguous among themselves (S = D·H·W): kernels take its three strides and work on either layout.
"""
from __future__ import annotations

from typing import Optional

import torch


def nsc_strides(t: torch.Tensor) -> Optional[tuple[int, int, int]]:
    """Strides of t seen as [N, S, C] (S = the flattened D, H, W), or None if D, H, W do not collapse."""
    spatial = [(t.shape[i], t.stride(i)) for i in (2, 3, 4) if t.shape[i] != 1]
    for (_, outer), (size, inner) in zip(spatial, spatial[1:]):
        if outer != size * inner:
            return None
    return t.stride(0), (spatial[-1][1] if spatial else 1), t.stride(1)


def flat_nsc(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """t with collapsible spatial dims (made channels-last when they are not) and its [N, S, C] strides."""
    strides = nsc_strides(t)
    if strides is None:
        t = t.contiguous(memory_format=torch.channels_last_3d)
        strides = nsc_strides(t)
    return t, strides


def empty_channels_last(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised 5-D tensor of `shape` in channels-last (NDHWC) memory order."""
    return torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last_3d)
