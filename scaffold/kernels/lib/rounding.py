"""Exact dtype conversions inside kernels: torch's bits on the GPU and in the CPU interpreter alike.

Triton's CPU interpreter truncates when converting to bf16 and mishandles bf16 subnormals; these spell
the conversions out where that matters, and compile to the plain conversion on the GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .device import interpreting

# Whether kernels run in Triton's CPU interpreter, whose fp32 -> bf16 conversion truncates: only there is
# the rounding spelled out in integer ops (a compile-time constant of every kernel that converts).
_SPELLED_OUT_BF16: tl.constexpr = tl.constexpr(interpreting())


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
