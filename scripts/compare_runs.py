#!/usr/bin/env python3
"""Compare two run directories bit for bit: train_stats.csv without its wall-clock columns, and every
tensor of checkpoints/last.pt (model, optimizer state; the RNG states too). Prints one line per part
and exits 0 when both are identical, 1 otherwise.

    python scripts/compare_runs.py RUN_A RUN_B
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from scaffold.stats import WALL_CLOCK


def rows(run: Path) -> list[dict[str, str]]:
    with open(run / "train_stats.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in csv.DictReader(f)]


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


def main(argv: list[str]) -> int:
    a, b = (Path(p) for p in argv)
    same_rows = rows(a) == rows(b)
    print(f"train_stats.csv (non-wall-clock columns, {len(rows(a))} rows): {'identical' if same_rows else 'DIFFER'}")
    ta = tensors(torch.load(a / "checkpoints" / "last.pt", map_location="cpu", weights_only=False))
    tb = tensors(torch.load(b / "checkpoints" / "last.pt", map_location="cpu", weights_only=False))
    differ = sorted(k for k in ta.keys() | tb.keys()
                    if k not in ta or k not in tb or ta[k].shape != tb[k].shape or ta[k].dtype != tb[k].dtype
                    or not torch.equal(ta[k], tb[k]))
    print(f"checkpoints/last.pt: {len(ta)} tensors, {len(differ)} differ" + (f" (first: {differ[:5]})" if differ else ""))
    return 0 if same_rows and not differ else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
