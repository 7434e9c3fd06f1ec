"""Compile ahead: every Triton kernel a piece of work would launch, compiled at once on a thread pool.

A cold start (an empty Triton cache) compiles each kernel the first time the step launches it, one
after another: about 30 s at scale 7 on the H200, most of the start-up. Inside `compile_ahead()`, a
launch does not run its kernel: it submits the kernel's compilation, for exactly the specialization the
launch asks for (Triton's own key: argument dtypes, alignments, divisibility, constexprs), to Triton's
asynchronous compile mode (`triton.runtime._async_compile.AsyncCompileMode`) and returns. Leaving the
block waits for every compilation and installs the kernels in their caches, so the work run again for
real finds them all compiled.

While a block is open, every Triton launch in the process is a compilation, on whichever thread it
runs: the backward's launches run on the autograd engine's device thread, which does not inherit the
block's context, so the block's compile mode is process-wide and a launch on another thread enters it
for its own call. The block is meant for start-up, where nothing else launches Triton kernels.

What runs inside the block is throwaway: its Triton outputs are never written (buffers keep whatever
memory they were given), so only shapes and dtypes may be trusted there. The vendor ops run as usual.
The trainer runs its first warm-up step this way, on the warm-up's copy of the model, then its usual
steps.

Each compilation on the pool also builds the kernel's host launcher. Triton up to 3.6 compiles one C
module per launch signature with the system C compiler when the kernel first runs (`gcc -O3`, a
fraction of a second each, on the launching thread, so one after another after the block); built on
the pool, the launcher lands in Triton's cache beside the kernel and the first launch only loads it.
Where Triton builds no launcher (later versions) this is a cheap no-op; if it fails, the first launch
builds the launcher as it would have.

Where Triton has no asynchronous compile mode (older than it), under the interpreter, or off CUDA, the
block runs its work as usual: one kernel at a time, same result, no gain.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional

_ACTIVE: Optional[Any] = None  # the open block's compile mode: seen by every thread's launches
_LOCK = threading.RLock()  # one block at a time in the process (a nested one raises, as Triton's mode does)
_PATCHED = False


def _async_mode():
    """Triton's AsyncCompileMode class, or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except Exception:  # noqa: BLE001 - older Triton, or no Triton
        return None
    return AsyncCompileMode


def available() -> bool:
    """Whether compile-ahead can run here: Triton with an async compile mode, compiling (not
    interpreting) for a CUDA device."""
    from scaffold.kernels.lib.device import interpreting, triton_importable

    if not triton_importable() or interpreting() or _async_mode() is None:
        return False
    import torch

    return torch.cuda.is_available()


def _mode_var():
    """Triton's context variable naming the compile mode a launch submits to (None if it has none)."""
    try:
        from triton.runtime._async_compile import active_mode
    except Exception:  # noqa: BLE001 - older Triton, or no Triton
        return None
    return active_mode


def _patch() -> None:
    """Wrap JITFunction.run once: while a compile-ahead block is open, a launch on any thread is a
    warm-up (Triton's own flag: compile for these arguments, launch nothing) submitted to the block's
    compile mode."""
    global _PATCHED
    if _PATCHED:
        return
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def run_or_compile(self, *args, grid, warmup, **kwargs):
        mode = _ACTIVE
        if mode is None:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        var = _mode_var()
        if var is None or var.get() is mode:
            return run(self, *args, grid=grid, warmup=True, **kwargs)
        token = var.set(mode)  # a thread the block did not open (the autograd engine's)
        try:
            return run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            var.reset(token)

    run_or_compile.__wrapped__ = run
    JITFunction.run = run_or_compile
    _PATCHED = True


def _build_launcher(kernel) -> None:
    """Build (or find in the cache) the host launcher of a compiled kernel; the object is dropped."""
    from triton.runtime import driver

    driver.active.launcher_cls(kernel.src, kernel.metadata)


def _with_launcher(compile_fn):
    """compile_fn's kernel, its host launcher built (see the module's docstring) where that works."""
    kernel = compile_fn()
    try:
        _build_launcher(kernel)
    except Exception:  # noqa: BLE001 - the first launch builds it as it would have
        pass
    return kernel


class _Pool:
    """The executor Triton's compile mode submits to: each compilation also builds its launcher."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool

    def submit(self, compile_fn):
        return self.pool.submit(_with_launcher, compile_fn)


def workers() -> int:
    """Compiler threads: the CPUs this process may use, shared with the other processes torchrun
    started on this node (LOCAL_WORLD_SIZE), at most 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(32, cpus // local))


@contextlib.contextmanager
def compile_ahead(threads: Optional[int] = None) -> Iterator[bool]:
    """Yields whether launches in the block only compile (see the module's docstring); on leaving,
    every compilation has finished. A kernel whose compilation fails is left out of the cache, so its
    first real launch fails as it would have without this block (and the ladder falls back from it)."""
    global _ACTIVE
    if not available():
        yield False
        return
    _patch()
    mode_cls = _async_mode()
    with _LOCK, ThreadPoolExecutor(max_workers=threads or workers(),
                                   thread_name_prefix="triton-compile") as pool:
        try:  # a kernel that fails to compile is left uncompiled: its launch fails as it would have
            mode = mode_cls(_Pool(pool), ignore_errors=True)
        except TypeError:  # a Triton whose mode has no such option: its error surfaces on leaving
            mode = mode_cls(_Pool(pool))
        with mode:  # its exit waits for every compilation and installs the kernels
            _ACTIVE = mode
            try:
                yield True
            finally:
                _ACTIVE = None
