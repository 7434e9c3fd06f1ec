"""Two run directories compared bit for bit: train_stats.csv without its wall-clock columns, and every
tensor of checkpoints/last.pt (model, optimizer state, the RNG states). `scripts/compare_runs.py` and
`scaffold.bench.scaling` report with it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scaffold.stats import WALL_CLOCK, read_rows


def rows(run: Path) -> list[dict[str, str]]:
    """train_stats.csv's rows without the wall-clock columns."""
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in read_rows(run / "train_stats.csv")]


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a nested checkpoint structure, by path."""
    out: dict[str, torch.Tensor] = {}
    if torch.is_tensor(obj):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors(v, f"{prefix}/{i}"))
    return out


@dataclass(frozen=True)
class Comparison:
    n_rows: int
    same_rows: bool
    n_tensors: int
    differ: tuple[str, ...]  # paths of the tensors that differ (or are in one checkpoint only)

    @property
    def identical(self) -> bool:
        return self.same_rows and not self.differ


def compare(a: Path, b: Path) -> Comparison:
    ra, rb = rows(a), rows(b)
    ta = tensors(torch.load(a / "checkpoints" / "last.pt", map_location="cpu", weights_only=False))
    tb = tensors(torch.load(b / "checkpoints" / "last.pt", map_location="cpu", weights_only=False))
    differ = sorted(k for k in ta.keys() | tb.keys()
                    if k not in ta or k not in tb or ta[k].shape != tb[k].shape or ta[k].dtype != tb[k].dtype
                    or not torch.equal(ta[k], tb[k]))
    return Comparison(len(ra), ra == rb, len(ta), tuple(differ))
