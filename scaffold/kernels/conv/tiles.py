"""Frozen tile configurations for the convolution kernels, keyed by (arch, dtype, op, shape class).

Tiles are chosen by table lookup, never by timing at run time, so the bits a run produces depend only
on (device, dtype, shape). `python -m scaffold.bench.tune_conv` times candidates offline on a GPU and
rewrites the TABLE block below; anything missing falls back to `heuristic_tile`.

Ops: 'gather' (forward and backward-data), 'wgrad' (backward-weight), 'convT' (transposed forward),
'box' (stride-1 forward and backward-data on tensor descriptors), 'boxw' (their backward-weight).
Shape classes (see `shape_class`): 'flat' (Cin < 16: the RGB stem), 'narrow' (Cout <= 16: the
head, the stem's backward-data), 'tiny' (box ops only: at most 16³ voxels per sample, where a launch
has few tiles), 'small' (output channels < 128), 'wide' (the rest).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..lib.device import dtype_key


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    taps: int = 1  # box wgrad only: neighbouring kw taps per program (1-3)


def shape_class(cin: int, cout: int, taps: int, voxels: int = 0) -> str:
    """The table's coarse shape key: which regime of the GEMM a conv site is in (`voxels`, one
    sample's output voxels, is given by the box ops only)."""
    if cin < 16:
        return "flat"
    if cout <= 16:
        return "narrow"
    if 0 < voxels <= 4096:
        return "tiny"
    if cout < 128:
        return "small"
    return "wide"




# BEGIN TABLE (written by python -m scaffold.bench.tune_conv; keys: arch|dtype|op|class)
TABLE: dict[str, tuple] = {
    "sm90|bf16|boxw|flat": (64, 32, 128, 4, 4, 8),
    "sm90|bf16|box|flat": (128, 64, 32, 4, 4, 8),
    "sm90|bf16|box|narrow": (256, 16, 64, 8, 3, 8),
    "sm90|bf16|box|small": (256, 64, 64, 8, 3, 8),
    "sm90|bf16|box|tiny": (64, 128, 64, 4, 4, 8),
    "sm90|bf16|box|wide": (256, 128, 64, 8, 3, 8),
    "sm90|bf16|boxw|small": (64, 64, 128, 4, 3, 8, 3),
    "sm90|bf16|boxw|tiny": (128, 64, 64, 4, 3, 8, 3),
    "sm90|bf16|boxw|wide": (128, 64, 128, 4, 3, 8),
    "sm90|bf16|convT|small": (128, 64, 64, 8, 3, 8),
    "sm90|bf16|convT|wide": (128, 256, 64, 8, 3, 8),
    "sm90|bf16|gather|flat": (128, 64, 16, 4, 4, 8),
    "sm90|bf16|gather|narrow": (128, 16, 32, 4, 4, 8),
    "sm90|bf16|gather|small": (64, 64, 64, 4, 4, 8),
    "sm90|bf16|gather|wide": (128, 128, 64, 8, 3, 8),
    "sm90|bf16|wgrad|flat": (64, 32, 64, 4, 3, 8),
    "sm90|bf16|wgrad|narrow": (64, 64, 64, 4, 4, 8),
    "sm90|bf16|wgrad|small": (64, 64, 64, 4, 4, 8),
    "sm90|bf16|wgrad|wide": (128, 128, 64, 8, 3, 8),
}
# END TABLE
# The box and boxw rows carry two hand edits over the tuner's picks. Neither they nor the heuristic
# use the 128 x 128 tile on 8 warps for the box ops: it gave results that differ between calls at
# several shapes (Triton 3.6). How each row was chosen: docs/kernels.md.


def heuristic_tile(arch: str, dtype: torch.dtype, op: str, cls: str) -> Tile:
    """Defaults from the Hopper guidance: 128×128(256)×64 tiles with 8 warps for the big GEMMs,
    narrow N for the stem and head; small tiles under the CPU interpreter (its cost is per block)."""
    if arch == "cpu":
        return Tile(32, 16, 16, num_warps=4, num_stages=1, group_m=4)
    wide = dtype != torch.float32
    bk = 64 if wide else 32
    if op == "boxw":  # block_m: Cout, block_n: Cin, block_k: voxels per box
        if cls == "flat":  # the folded stem: 32 channels of (kh, kw, ci) per voxel
            return Tile(64, 32, 128, num_warps=4, num_stages=3)
        if cls == "narrow":  # the head: its dy padded to 16 channels, a memory-bound reduction
            return Tile(16, 64, 128, num_warps=4, num_stages=3)
        return Tile(128, 64, 128, num_warps=4, num_stages=3)
    if op == "box":
        if cls == "flat":  # the folded stem's forward: K steps of its 32 channels
            return Tile(128, 64, 32, num_warps=4, num_stages=3)
        if cls == "narrow":  # few output channels (the stem's backward-data, padded to 16)
            return Tile(128, 16, bk, num_warps=4, num_stages=3)
        if cls == "small":
            return Tile(128, 64, bk, num_warps=4, num_stages=4)
        return Tile(256, 128, bk, num_warps=8, num_stages=3)
    if op == "wgrad":
        if cls == "flat":
            return Tile(64, 64, 32, num_warps=4, num_stages=3)  # block_m: Cout, block_n: taps*Cin
        return Tile(128, 128, bk, num_warps=8, num_stages=3)  # block_k: the voxel reduction
    if cls == "flat":
        return Tile(128, 64, 32, num_warps=4, num_stages=3)
    if cls == "narrow":
        return Tile(128, 16, bk, num_warps=4, num_stages=3)
    if cls == "small":
        return Tile(128, 64, bk, num_warps=4, num_stages=4)
    return Tile(128, 128, bk, num_warps=8, num_stages=3)


# Set only by the offline tuner (scaffold.bench.tune_conv) while it times candidates: op -> Tile.
FORCED: dict[str, Tile] = {}


def conv_tile(device: torch.device, dtype: torch.dtype, op: str, cin: int, cout: int,
              taps: int, voxels: int = 0) -> Tile:
    """The tile for one launch: the frozen table entry if any, else the heuristic."""
    from ..lib.device import arch_key

    if op in FORCED:
        return FORCED[op]
    return _table_tile(arch_key(device), dtype, op,
                       shape_class(cin, cout, taps, voxels if op in ("box", "boxw") else 0))


@functools.lru_cache(maxsize=None)
def _table_tile(arch: str, dtype: torch.dtype, op: str, cls: str) -> Tile:
    """TABLE's entry as a Tile, else the heuristic's; built once per key (TABLE is frozen)."""
    entry = TABLE.get(f"{arch}|{dtype_key(dtype)}|{op}|{cls}")
    if entry is not None:
        return Tile(*entry)
    return heuristic_tile(arch, dtype, op, cls)
