"""Benchmarks: `python -m scaffold.bench.<name>`. Each prints a table and writes JSON (`--out`)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON atomically (temp file in the same folder, then rename): never a half-written result."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
