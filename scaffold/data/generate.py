"""Parallel volume generation: worker processes render and compress masks, the caller receives them
in index order.

Workers are started with 'spawn' (safe next to threads and CUDA, same on every platform) and get the
plan once through the pool initializer. Each task renders a block of consecutive volumes (under the
upstream sampler their instances' chains advance side by side, see volumes.py) and deflates each into
the exact bytes of an HDF5 gzip chunk (a zlib stream), so compression runs in parallel and the parent
only writes; `imap` hands results back in submission order, and a volume's bytes do not depend on its
block, so the file is the same for any worker count.

The workers leave the stop signals to the caller: Ctrl-C reaches the whole process group, and each
worker used to print its own KeyboardInterrupt traceback (mid-import, mid-render) while the caller waited
for the rest of the work. They start with SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 blocked and then ignore
them, and when the caller stops early (its own signal handler, an error) they are terminated at once.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import zlib
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from .volumes import Plan, render_volume, render_volumes

COMPRESSION_LEVEL = 4
"""zlib level of the stored chunks (HDF5's gzip filter reads any level)."""

_plan: Plan | None = None


class RenderedVolume(NamedTuple):
    chunk: bytes
    """The mask (E, E, E) uint8, C order, as a zlib stream: one HDF5 gzip chunk."""
    counts: np.ndarray
    """Voxels per label, int64, index 0 = background."""


def volume_with_counts(plan: Plan, index: int) -> tuple[np.ndarray, np.ndarray]:
    """A volume's mask and its voxel count per label (int64, index 0 = background)."""
    mask = render_volume(plan, index)
    n_labels = len(plan.classes) + 1
    # Counting only the (few) foreground voxels is ~20x cheaper than bincount over the whole grid.
    foreground = mask[mask != 0]
    counts = np.bincount(foreground, minlength=n_labels).astype(np.int64)
    counts[0] = mask.size - foreground.size
    return mask, counts


def render_block(plan: Plan, indices: list[int]) -> list[RenderedVolume]:
    """Several volumes, compressed, with their label counts (see render_compressed)."""
    if plan.sampler != "upstream":
        return [render_compressed(plan, i) for i in indices]
    out = []
    n_labels = len(plan.classes) + 1
    for mask in render_volumes(plan, indices):
        foreground = mask[mask != 0]
        counts = np.bincount(foreground, minlength=n_labels).astype(np.int64)
        counts[0] = mask.size - foreground.size
        out.append(RenderedVolume(zlib.compress(mask.tobytes(), COMPRESSION_LEVEL), counts))
        del mask, foreground  # before the next is drawn: one mask's memory, reused
    return out


# Signals a worker leaves to its parent: those a terminal or a scheduler sends to every process of a job
# (SIGTERM stays: it is how the parent ends the workers, Pool.terminate).
WORKER_IGNORES = tuple(getattr(signal, n) for n in ("SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
                       if hasattr(signal, n))


def _init_worker(plan: Plan) -> None:
    global _plan
    for s in WORKER_IGNORES:
        signal.signal(s, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked since the spawn (see _pool); pending ones are dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORES)
    _plan = plan


@contextlib.contextmanager
def _pool(plan: Plan, workers: int) -> Iterator:
    """`workers` spawned processes that leave the stop signals to this one (see the module's docstring):
    spawned with those signals blocked (a child inherits the mask, so a Ctrl-C while it imports is held
    until it ignores them), closed when the work is done, terminated when the caller stops early."""
    pool = None
    try:
        mask = hasattr(signal, "pthread_sigmask")
        if mask:  # started first: starting it unblocks SIGINT in this thread (as it must for itself)
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORES) if mask else None
        try:
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(plan,))
        finally:
            if mask:  # a signal that came meanwhile is delivered here, to this process alone
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
        yield pool
    except BaseException:
        if pool is not None:
            pool.terminate()
            pool.join()
        raise
    pool.close()
    pool.join()


def render_compressed(plan: Plan, index: int) -> RenderedVolume:
    """One volume as a compressed chunk and its label counts."""
    mask, counts = volume_with_counts(plan, index)
    return RenderedVolume(zlib.compress(mask.tobytes(), COMPRESSION_LEVEL), counts)


def _render(index: int) -> RenderedVolume:
    assert _plan is not None, "worker started without a plan"
    return render_compressed(_plan, index)


def _render_block(indices: list[int]) -> list[RenderedVolume]:
    assert _plan is not None, "worker started without a plan"
    return render_block(_plan, indices)


def resolve_workers(requested: int, n_volumes: int) -> int:
    """Worker processes to use: 0 means one per CPU core; never more than there are volumes."""
    wanted = requested if requested > 0 else (os.cpu_count() or 1)
    return max(1, min(wanted, n_volumes))


def iter_volumes(plan: Plan, workers: int, progress: bool = True) -> Iterator[RenderedVolume]:
    """Every volume of the plan, compressed, in index order. With `progress`: a bar on a terminal, a line
    at each quarter otherwise (a job's log)."""
    n = len(plan.volumes)
    bar = tqdm(total=n, desc="fractal volumes", unit="vol", disable=None if progress else True,
               leave=False, dynamic_ncols=True)
    plain = progress and not sys.stderr.isatty()
    marks = {(n * q + 3) // 4 for q in (1, 2, 3)} - {0, n}
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        bar.update()
        if plain and done in marks:
            print(f"fractal volumes: {done}/{n}", file=sys.stderr, flush=True)

    try:
        if plan.sampler == "upstream":
            # Blocks of volumes: enough per block that the chains advance side by side, enough blocks
            # (four per worker) that the workers stay busy.
            size = max(1, -(-n // (max(workers, 1) * 4)))
            blocks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
            if workers <= 1:
                results = (render_block(plan, block) for block in blocks)
                for block in results:
                    for result in block:
                        yield result
                        advance()
                return
            with _pool(plan, workers) as pool:
                for block in pool.imap(_render_block, blocks):
                    for result in block:
                        yield result
                        advance()
            return
        if workers <= 1:
            for index in range(n):
                yield render_compressed(plan, index)
                advance()
            return
        chunk = max(1, n // (workers * 8))
        with _pool(plan, workers) as pool:
            for result in pool.imap(_render, range(n), chunksize=chunk):
                yield result
                advance()
    finally:
        bar.close()
