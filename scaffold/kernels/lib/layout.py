"""Shared by the memory-bound kernels: a 5-D activation seen as [N, S, C] without a copy.

[N, S, C] is the view every NDHWC (channels-last) or NCDHW tensor allows without a copy when its D, H, W
are contiguous among themselves (S = D·H·W): kernels take its three strides and work on either layout.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.lru_cache(maxsize=4096)
def _nsc(shape: tuple, stride: tuple) -> Optional[tuple[int, int, int]]:
    spatial = [(shape[i], stride[i]) for i in (2, 3, 4) if shape[i] != 1]
    for (_, outer), (size, inner) in zip(spatial, spatial[1:]):
        if outer != size * inner:
            return None
    return stride[0], (spatial[-1][1] if spatial else 1), stride[1]


def nsc_strides(t: torch.Tensor) -> Optional[tuple[int, int, int]]:
    """Strides of t seen as [N, S, C] (S = the flattened D, H, W), or None if D, H, W do not collapse.
    A pure function of the shape and strides, looked up once per pair (it runs at every launch)."""
    return _nsc(t.shape, t.stride())


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


# --- the concat into the room its first part left (scaffold.kernels.concat) --------------------------

def room_base(a: torch.Tensor, cb: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The buffer whose first channels `a` is, when it has exactly `cb` channels of room after them in
    `dtype` (channels-last, a's very storage); else None. Metadata only."""
    base = a._base
    if (base is None or base.dim() != 5 or a.dim() != 5 or base.dtype != dtype or a.dtype != dtype
            or base.shape[1] != a.shape[1] + cb or base.shape[0] != a.shape[0]
            or base.shape[2:] != a.shape[2:] or a.data_ptr() != base.data_ptr()
            or any(n > 1 and sa != sb for n, sa, sb in zip(a.shape, a.stride(), base.stride()))
            or not base.is_contiguous(memory_format=torch.channels_last_3d)):
        return None  # (a view may give a dim of size 1 any stride: those are not compared)
    return base


def in_room(b: torch.Tensor, base: torch.Tensor, c0: int) -> bool:
    """Whether b is channels [c0, c0 + b's channels) of `base`, in place (a producer wrote it there)."""
    room = base[:, c0:c0 + b.shape[1]]
    return (b.shape == room.shape and b.dtype == base.dtype and b.data_ptr() == room.data_ptr()
            and all(n == 1 or sb == sr for n, sb, sr in zip(b.shape, b.stride(), room.stride())))
