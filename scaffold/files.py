"""Writing a file so that a crash never leaves it torn: write a temporary file beside it, flush it to
disk, rename it into place (os.replace is atomic on POSIX). On failure the temporary file is removed
and the old file, if any, is untouched. The temporary name is unique to the writer, so two processes
writing the same file never write into each other's temporary file."""
from __future__ import annotations

import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def atomic_path(path: os.PathLike | str) -> Iterator[Path]:
    """Yields a temporary path beside `path` for the caller to write (and close); renames it into place
    when the block succeeds (fsynced first), removes it when the block raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_open(path: os.PathLike | str, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """open(path, mode) whose content appears at `path` only once the block has succeeded."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def write_text(path: os.PathLike | str, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: os.PathLike | str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: os.PathLike | str) -> Any:
    """The JSON in `path`, or None where it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
