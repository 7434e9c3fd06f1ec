"""Shared by the memory-bound kernels: a 5-D activation seen as [N, S, C], and exact dtype conversions.

[N, S, C] is the view every NDHWC (channels-last) or NCDHW tensor allows without a copy when its D, H, W
are contiguous among themselves (S = D·H·W): kernels take its three strides and work on either layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import interpreting

# Whether kernels run in Triton's CPU interpreter, whose fp32 -> bf16 conversion truncates: only there is
# the rounding spelled out in integer ops (a compile-time constant of every kernel that converts).
_SPELLED_OUT_BF16: tl.constexpr = tl.constexpr(interpreting())


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


# --- dtype helpers that give torch's bits on the GPU and in the CPU interpreter alike -------------
# Triton's CPU interpreter (3.9) truncates when converting to bf16 and mishandles bf16 subnormals; these
# spell the conversions out where that matters, and give the same bits on the GPU.

@triton.jit
def to_f32(v):
    """v as fp32. A bf16 value is widened by a 16-bit shift: exact, and immune to the CPU interpreter's
    mishandling of bf16 subnormals (on the GPU this is what the conversion instruction does anyway)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def cast_rne(v, dst: tl.constexpr):
    """v converted to dtype `dst`, rounding to nearest even as torch does. Compiled, this is the hardware
    conversion (cvt.rn: round to nearest even, NaN stays NaN, overflow to Inf). Triton's CPU interpreter
    truncates instead, so there bf16 is spelled out in integer ops with the same rounding: both give
    torch's bits. (The integer form costs ~8 instructions per element; the conversion, half of one.)"""
    if v.dtype == dst:
        return v
    elif dst == tl.bfloat16 and _SPELLED_OUT_BF16:
        f = to_f32(v)
        bits = f.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        r = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(f != f, f.to(tl.bfloat16), r)  # NaN: keep it NaN (the sum could carry into Inf)
    else:
        return to_f32(v).to(dst)
