"""Deterministic split reductions: how many splits a reduction gets, and their fixed-order sum.

A long reduction (over every voxel of a volume) is cut into S contiguous chunks; each program writes
its chunk's fp32 partial to its own slot, and a second kernel adds the S slots in index order
0, 1, …, S-1. No floating-point atomics anywhere, so the bits never depend on scheduling. S is a pure
function of the shape and the device's multiprocessor count.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import launched
from .device import sm_count
from .indexing import cdiv


def split_count(device: torch.device, tiles: int, steps: int, partial_elems: int,
                min_steps: int = 4, max_bytes: int = 1 << 30) -> int:
    """Splits for `tiles` output tiles whose reduction takes `steps` block steps: enough programs to
    fill the device about twice over, each still doing at least `min_steps` steps, and the fp32
    partials (S × partial_elems) within max_bytes."""
    want = cdiv(2 * sm_count(device), max(tiles, 1))
    s = min(want, max(steps // min_steps, 1), max(max_bytes // (4 * max(partial_elems, 1)), 1))
    return max(int(s), 1)


def split_plan(device: torch.device, tiles: int, steps: int, partial_elems: int,
               min_steps: int = 4) -> tuple[int, int]:
    """(splits, steps per split) for `split_count`'s choice, with no empty split at the end (rounding
    the per-split share up can leave the last one nothing to do: it is dropped)."""
    per = cdiv(steps, split_count(device, tiles, steps, partial_elems, min_steps))
    return cdiv(steps, per), per


# The split cost model's two rates (Hopper-class, achieved): tensor-core FLOP/s of one
# multiprocessor, and the device's memory bandwidth for the fp32 partials (written once, read once).
SM_FLOPS = 5.0e12
PARTIAL_BYTES_PER_S = 3.0e12


def wave_split_plan(device: torch.device, tiles: int, steps: int, partial_elems: int,
                    step_flops: float, per_sm: int, min_steps: int = 4,
                    max_bytes: int = 1 << 30) -> tuple[int, int]:
    """(splits, steps per split) that minimise a launch's modelled time, for programs that all do
    the same work and of which `per_sm` fit on a multiprocessor at once:
        waves(S) · steps/S · step_flops / SM_FLOPS  +  (S > 1) · S · partial_elems · 8 / bandwidth
    where waves(S) = ceil(tiles·S / (sm·per_sm)). The wave count is what `split_count`'s
    fill-the-device-twice rule misses: 270 programs of one per multiprocessor on 132 are three
    waves, the last nearly empty. Ties go to fewer splits; caps as in `split_count`. A pure function
    of its arguments and the device's multiprocessor count."""
    return _wave_split_plan(sm_count(device) * max(per_sm, 1), max(tiles, 1), steps, partial_elems,
                            step_flops, min_steps, max_bytes)


@functools.lru_cache(maxsize=4096)
def _wave_split_plan(slots: int, tiles: int, steps: int, partial_elems: int, step_flops: float,
                     min_steps: int, max_bytes: int) -> tuple[int, int]:
    s_max = min(max(steps // min_steps, 1), max(max_bytes // (4 * max(partial_elems, 1)), 1))
    # Within one wave count the largest S is best (shorter programs, same waves): the candidates
    # are S = 1, s_max, and the largest S of each wave count.
    cands = {1, s_max} | {w * slots // tiles for w in range(1, s_max * tiles // slots + 2)}
    best, best_cost = 1, None
    for s in sorted(c for c in cands if 1 <= c <= s_max):
        per = cdiv(steps, s)
        waves = cdiv(tiles * cdiv(steps, per), slots)
        cost = waves * per * step_flops / SM_FLOPS
        if s > 1:
            cost += s * partial_elems * 8 / PARTIAL_BYTES_PER_S
        if best_cost is None or cost < best_cost * (1 - 1e-9):
            best, best_cost = s, cost
    per = cdiv(steps, best)
    return cdiv(steps, per), per


@triton.jit
def chunk_range(split, chunk, total):
    """[start, end) of chunk number `split` when `total` items are cut into chunks of `chunk` (the
    last one shorter)."""
    start = split * chunk
    end = tl.minimum(start + chunk, total)
    return start, end


@launched
@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, S, L, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):  # fixed order: the reason this kernel exists
        acc += tl.load(p_ptr + s * L + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, out_flat: torch.Tensor) -> torch.Tensor:
    """out_flat[l] = sum over s, in order, of partials[s, l] (fp32), cast to out_flat's dtype."""
    s, length = partials.shape
    block = 256 if partials.is_cuda else 64
    _sum_splits_kernel[(cdiv(length, block),)](partials, out_flat, s, length, BLOCK=block)
    return out_flat
