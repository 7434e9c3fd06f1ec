#!/usr/bin/env python3
"""Compare two run directories bit for bit: train_stats.csv without its wall-clock columns, and every
tensor of checkpoints/last.pt (model, optimizer state; the RNG states too). Prints one line per part
and exits 0 when both are identical, 1 otherwise.

    python scripts/compare_runs.py RUN_A RUN_B
"""
from __future__ import annotations

import sys
from pathlib import Path

from scaffold.bench.runs import compare


def main(argv: list[str]) -> int:
    c = compare(*(Path(p) for p in argv))
    print(f"train_stats.csv (non-wall-clock columns, {c.n_rows} rows): {'identical' if c.same_rows else 'DIFFER'}")
    print(f"checkpoints/last.pt: {c.n_tensors} tensors, {len(c.differ)} differ"
          + (f" (first: {list(c.differ[:5])})" if c.differ else ""))
    return 0 if c.identical else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
