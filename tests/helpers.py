"""Shared helpers of the training tests: a tiny config that trains in seconds on two CPU cores."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import pytest
from omegaconf import OmegaConf

from scaffold.config import Config
from scaffold.stats import WALL_CLOCK, read_rows

REPO = Path(__file__).resolve().parent.parent

# 8³ volumes, one U-Net level, width 4: 4 volumes (3 train, 1 validation).
TINY = [
    "scale=3", "model.bottleneck=2", "model.base_width=4", "model.groups=2",
    "data.n_categories=2", "data.n_instances=6", "data.workers=1", "warmup_steps=1",
    "progress=false", "device=cpu",
]


def leave_rank() -> None:
    """End a launched test rank whose work is done and whose process group is destroyed: flush and
    exit 0 without the interpreter's finalization. There, after the last Python frame, torch's gloo
    teardown aborted one rank of four now and then on a loaded 2-core machine ("terminate called
    without an active exception", no Python frame on any thread); what the tests check was already
    written. A rank that fails earlier raises before it gets here and exits non-zero as before."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tiny_cfg(cache_dir: Path, *overrides: str):
    cfg = OmegaConf.structured(Config)
    for item in [*TINY, "epochs=3", f"data.cache_dir={cache_dir}", *overrides]:
        key, value = item.split("=", 1)
        OmegaConf.update(cfg, key, _parse(value), merge=True)
    return cfg


def _parse(value: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(f"k={value}").value()


def cli(*args: str, cwd: Path, env: dict | None = None, module: str = "scaffold.train"):
    """Run `python -m scaffold.train ARGS` in a subprocess; returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=300)


def stable_rows(csv_path: Path) -> list[dict[str, str]]:
    """The CSV rows without the wall-clock columns (those may differ between runs)."""
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in read_rows(csv_path)]


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", map_location="cpu",
                      weights_only=False)["model"]


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def saved_bytes(model: torch.nn.Module):
    """While open, records the distinct storages autograd saves; yields a dict whose "bytes" (set on
    leaving) is their total, the model's parameters excluded."""
    seen: dict[int, int] = {}
    result: dict[str, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    result["bytes"] = sum(n for ptr, n in seen.items() if ptr not in params)


LAUNCH_TIMEOUT = 120  # seconds: a hang fails the test instead of stalling the suite


def lines_until(stream, prefix: str, timeout: float) -> list[str]:
    """The lines read from a child's text `stream` up to and including the first that starts with
    `prefix` (all of them if the stream ends first), within `timeout` seconds: a child that stalls
    before printing it fails the test instead of blocking the read forever."""
    import queue
    import threading

    got: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            got.put(line)
            if line.startswith(prefix):
                break
        got.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen = []
    try:
        while (line := got.get(timeout=timeout)) is not None:
            seen.append(line)
            if line.startswith(prefix):
                break
    except queue.Empty:
        pytest.fail(f"no line starting {prefix!r} within {timeout} s; read so far:\n{''.join(seen)[-3000:]}")
    return seen


def torchrun(nproc: int, args: list[str], cwd: Path, entry: tuple[str, ...] = ("-m", "scaffold.train"),
             timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    exe = shutil.which("torchrun")
    if exe is None:
        pytest.fail("torchrun is not on PATH (it comes with torch)")
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    # --standalone: a rendezvous on a free local port, so concurrent launches never collide.
    try:
        return subprocess.run([exe, "--standalone", f"--nproc-per-node={nproc}", *entry, *args], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hang is a failure: show where each rank stood
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"torchrun with {nproc} ranks did not finish in {timeout} s:\n{err[-4000:]}")
