"""Benchmarks and offline tuners: `python -m scaffold.bench.<name>`. Each prints a table and writes JSON.

The sites they time are read off the model (sites.py) and every time comes from one function
(timing.py). The `tune_*` modules measure the package's launch tables on the GPU they are for:
`tune_conv` and `tune_routes` rewrite their generated blocks in place (`--write`, `rewrite_block`),
`tune_norm` and `tune_loss` print what a hand edit of theirs should take.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any


def _write_atomic(path: Path, text: str) -> None:
    """Temp file in the same folder, then rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON atomically: never a half-written result."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")


def rewrite_block(path: str | os.PathLike, name: str, table: dict, write: bool = True) -> str:
    """The generated block `NAME: dict[...] = {` ... `}` + `# END NAME` of a source file (a tuner's
    table in the package) with `table` as its rows, one per key, sorted; the file is rewritten
    atomically when `write`. Returns the new block."""
    path = Path(path)
    body = "".join(f'    "{k}": {tuple(v)},\n' for k, v in sorted(table.items()))
    src = path.read_text()
    match = re.search(rf"({name}: dict\[[^\n]*\] = \{{\n).*?(\}}\n# END {name})", src, flags=re.S)
    if match is None:
        raise ValueError(f"{path}: no generated {name} block to rewrite")
    block = match.group(1) + body + match.group(2)
    if write:
        _write_atomic(path, src[:match.start()] + block + src[match.end():])
    return block


def model_bench_setup(scale: int | None):
    """(device, scale) of a benchmark that builds the U-Net: CUDA when present (its default scale 7),
    else the CPU (scale 4); the determinism mode the trainer runs by default."""
    import torch

    from scaffold import determinism

    cuda = torch.cuda.is_available()
    determinism.configure("default")
    return torch.device("cuda" if cuda else "cpu"), scale or (7 if cuda else 4)
