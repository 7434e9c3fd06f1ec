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


# A one-plane D slab reads a halo of 2 planes for the one it computes (3x its input, and 2x its size
# in halo traffic per convolution): from there down a level is split into the most compact D x H
# blocks instead (one move between splits, at that level's Down, where D-then-H moved at every level).
THIN = 2


def _overhead(edge: int, grid: Grid) -> float:
    """A block's voxels with its halo (a plane each side along D, a row each side along H where split)
    over its voxels without."""
    bd, bh = edge // grid.pd, edge // grid.ph
    return (1 + 2 / bd if grid.pd > 1 else 1.0) * (1 + 2 / bh if grid.ph > 1 else 1.0)


def level_grid(edge: int, count: int, first: bool = True, previous: Optional[Grid] = None) -> Optional[Grid]:
    """The split of a level whose volumes are `edge` voxels on a side over `count` ranks. The first level
    (full resolution, the data's D slabs) and every level whose D slabs keep at least THIN planes: D
    alone. A deeper level with thinner slabs: the D x H blocks (powers of two, every block at least one
    plane and one row) whose halo adds the least, ties kept at the level above's split (no move between
    splits), else the one with more D blocks. None where no block keeps a plane and a row (the level
    runs whole on every rank)."""
    if edge >= count and (first or edge // count >= THIN):
        return Grid(count, 1)
    options = [Grid(pd, count // pd) for pd in (2 ** k for k in range(count.bit_length()))
               if pd <= edge and count // pd <= edge and pd * (count // pd) == count]
    if not options:
        return None
    best = min(_overhead(edge, g) for g in options)
    ties = [g for g in options if _overhead(edge, g) <= best * (1 + 1e-9)]
    return previous if previous in ties else max(ties, key=lambda g: g.pd)


def level_grids(scale: int, levels: int, count: int) -> list[Optional[Grid]]:
    """Per U-Net level (0 = full resolution), how its tensors are split (`level_grid`), None where the
    level runs whole on every rank of the group."""
    grids: list[Optional[Grid]] = []
    for level in range(levels + 1):
        grids.append(level_grid(2 ** (scale - level), count, level == 0, grids[-1] if grids else None))
    return grids
