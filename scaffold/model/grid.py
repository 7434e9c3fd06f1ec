"""The U-Net's geometry from its shape keys: the channel width of every level, and how each level's
tensors are split over a group of spatial shards. Pure arithmetic, shared by the model, the memory model
and the sharded modules (scaffold.spatial), so none of them imports another for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from scaffold.config import expect as _need


def check_model(scale: int, bottleneck: int, base_width: int, groups: int) -> list[int]:
    """The U-Net's channel widths from the stem down to the bottleneck; ConfigError naming the key
    when the shape keys cannot build one (used by the run's validation and by UNet3d itself)."""
    _need(isinstance(bottleneck, int) and bottleneck >= 0, "model.bottleneck", "an integer >= 0",
          bottleneck)
    _need(isinstance(scale, int) and scale > bottleneck, "scale",
          f"greater than model.bottleneck ({bottleneck})", scale)
    _need(isinstance(base_width, int) and base_width > 0, "model.base_width", "a positive integer",
          base_width)
    _need(isinstance(groups, int) and groups > 0, "model.groups", "a positive integer", groups)
    widths = [base_width * 2**i for i in range(scale - bottleneck + 1)]
    _need(all(w % groups == 0 for w in widths), "model.groups", f"a divisor of every width {widths}",
          groups)
    return widths


@dataclass(frozen=True)
class Grid:
    """How a level's tensors are split over a shard group of pd·ph ranks: D into pd blocks, then H into
    ph (rank i holds D block i // ph and H block i % ph); W is never split."""

    pd: int
    ph: int = 1

    def box(self, index: int, edge: int) -> tuple[int, int, int, int]:
        """(d0, d1, h0, h1) of rank `index`'s block of a volume `edge` voxels on a side."""
        bd, bh = edge // self.pd, edge // self.ph
        i, j = divmod(index, self.ph)
        return i * bd, (i + 1) * bd, j * bh, (j + 1) * bh


def level_grid(edge: int, count: int) -> Optional[Grid]:
    """The split of a level whose volumes are `edge` voxels on a side: D alone while every rank keeps at
    least one plane; then D into `edge` one-plane blocks and H into the rest (D then H), while every
    rank keeps at least one row; None past that (the level runs whole on every rank)."""
    if edge >= count:
        return Grid(count, 1)
    if edge * edge >= count:
        return Grid(edge, count // edge)
    return None


def level_grids(scale: int, levels: int, count: int) -> list[Optional[Grid]]:
    """Per U-Net level (0 = full resolution), how its tensors are split (`level_grid`), None where the
    level runs whole on every rank of the group."""
    return [level_grid(2 ** (scale - level), count) for level in range(levels + 1)]
