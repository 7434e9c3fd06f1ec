"""Launching a compiled Triton kernel without Triton's per-call binding: `@launched` on a kernel.

`kernel[grid](*args, **kwargs)` through Triton's JIT binds the arguments, computes each one's
specialization (dtype, 16-byte alignment, divisibility by 16, integer width, constexpr values), joins
them into a cache key string, looks the compiled kernel up, checks the kernel's globals, builds launch
metadata and only then calls the kernel's launcher: about 20-35 µs of host time per launch on a fast
host, most of an eager step's host cost at ~170 Triton launches.

A kernel decorated `@launched` (above `@triton.jit`) launches the same way the first time a launch
signature is seen, and keeps the compiled kernel Triton returned. Later launches with the same
signature call that kernel's launcher directly. The signature is a key at least as fine as Triton's
own specialization, so it can never select a kernel Triton would not have selected:

- a tensor: its dtype and whether its address is a multiple of 16;
- an int: whether it is 1, whether it is a multiple of 16, and its width class (32-bit, 64-bit,
  unsigned 64-bit);
- a float, a bool (non-constexpr): the type only (Triton does not specialize them);
- a tensor descriptor (Triton's host one, Gluon's): its dtype, block shape, shape, strides, padding
  and layout (Triton keys on the dtype, the block shape and Gluon's layout);
- a constexpr (positional or keyword) and every keyword option (`num_warps`, ...): its value;
- the current CUDA device.

Anything else (a keyword that names a non-constexpr parameter, a launch hook set
by a profiler, an open compile-ahead block, the interpreter, a kernel with pre-run hooks) takes
Triton's path unchanged. `SCAFFOLD_FAST_LAUNCH=0` (or `launch.enabled = False`) sends every launch
through Triton's path; the kernels and so the bits are the same either way.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from scaffold.kernels.lib import ahead as _ahead

enabled = os.environ.get("SCAFFOLD_FAST_LAUNCH", "1") != "0"

_Tensor = torch.Tensor
_INT32_LO, _INT32_HI = -(2 ** 31), 2 ** 31
_INT64_LO, _INT64_HI = -(2 ** 63), 2 ** 63
_FALLBACK = object()
_Parameter = torch.nn.Parameter
# int_class of a 32-bit int, indexed by (v == 1) + 2 * (v % 16 == 0): the same tuples, built once
_SMALL_INT = ((False, False, 0), (True, False, 0), (False, True, 0), (True, True, 0))

try:  # Triton's host tensor descriptor
    from triton.tools.tensor_descriptor import TensorDescriptor as _HOST_DESCRIPTOR
except Exception:  # noqa: BLE001 - no Triton, or one without host descriptors
    _HOST_DESCRIPTOR = None
try:  # Gluon's (Hopper's): it carries the shared-memory layout, part of its specialization
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GLUON_DESCRIPTOR
except Exception:  # noqa: BLE001 - a Triton without Gluon
    _GLUON_DESCRIPTOR = None

_counts = {"direct": 0, "triton": 0}  # launches by path, for tests and benchmarks


def counts() -> dict:
    """Launches so far by path: `direct` (the cached launcher) and `triton` (Triton's JIT path)."""
    return dict(_counts)


def int_class(v: int) -> tuple:
    """The part of an integer argument Triton's specialization can depend on."""
    width = 0 if _INT32_LO <= v < _INT32_HI else (1 if _INT64_LO <= v < _INT64_HI else 2)
    return (v == 1, v % 16 == 0, width)


def arg_key(a: Any, constexpr: bool) -> Any:
    """One argument's part of the launch key (see the module's doc); `_FALLBACK` where the argument
    is of a kind the direct path does not take."""
    if constexpr:
        return ("c", type(a), a) if a.__hash__ is not None and not isinstance(a, _Tensor) else _FALLBACK
    t = type(a)
    if t is int:
        return int_class(a)
    if isinstance(a, _Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is float or t is bool:
        return t
    if a is None:
        return None
    if (t is _HOST_DESCRIPTOR or t is _GLUON_DESCRIPTOR) and isinstance(a.base, _Tensor):
        # Triton specializes a descriptor on its dtype and block shape, and Gluon's also on its
        # layout (3.6-3.9); the shape, strides and padding are in the key as well, so any later
        # specialization on them is covered.
        layout = getattr(a, "layout", None)
        if layout is not None and layout.__hash__ is None:
            return _FALLBACK
        return (t, a.base.dtype, tuple(a.block_shape), tuple(a.shape), tuple(a.strides),
                getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None), layout)
    return _FALLBACK


def _hook_active(hook: Any) -> bool:
    """A launch hook that would see launches: Triton's hook chains hold their functions in `calls`."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launched:
    """A Triton kernel whose launches skip Triton's binding once a launch signature has been seen.
    Indexing with a grid and calling launches, as with the kernel itself; other attributes are the
    kernel's."""

    def __init__(self, fn: Any):
        self.fn = fn
        self._cache: dict = {}
        self._prepared = False
        self._direct_ok = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def __repr__(self) -> str:
        return f"launched({self.fn!r})"

    def _prepare(self) -> None:
        """Parameter facts read once: which positions are constexpr, each parameter's default."""
        self._prepared = True
        try:
            from triton.runtime.jit import JITFunction
        except Exception:  # noqa: BLE001
            return
        fn = self.fn
        if not isinstance(fn, JITFunction) or getattr(fn, "pre_run_hooks", None):
            return  # the interpreter's function, or hooks that must see every launch
        params = fn.params
        self._names = tuple(p.name for p in params)
        self._constexpr = tuple(bool(p.is_constexpr) for p in params)
        self._constexpr_names = frozenset(p.name for p in params if p.is_constexpr)
        self._param_names = frozenset(self._names)
        self._defaults = tuple(p.default if p.has_default else _FALLBACK for p in params)
        try:
            from triton import knobs
            self._runtime = knobs.runtime
        except Exception:  # noqa: BLE001 - a Triton without knobs: launch hooks cannot be seen
            return
        stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # Triton's own stream query
        device = getattr(torch._C, "_cuda_getDevice", None)
        if stream is None or device is None:  # a build without CUDA
            return
        # torch.cuda.current_device without its Python lazy-init wrapper: a launch's tensors are on the
        # device already, so CUDA is initialized.
        self._device, self._stream = device, stream
        self._direct_ok = True

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args: tuple, kwargs: dict):
        # arg_key inlined for the common kinds (a tensor, an int, a constexpr): this runs on every
        # launch, and a Python call per argument costs as much as what it computes.
        parts = []
        append = parts.append
        for a, c in zip(args, self._constexpr):
            t = type(a)
            if c:
                if t is int or t is bool or t is float or t is str:
                    append(("c", t, a))
                    continue
            elif t is int:
                if _INT32_LO <= a < _INT32_HI:
                    append(_SMALL_INT[(a == 1) + 2 * (not a & 15)])
                else:
                    append(int_class(a))
                continue
            elif t is _Tensor or t is _Parameter:
                append((a.dtype, not a.data_ptr() & 15))
                continue
            k = arg_key(a, c)
            if k is _FALLBACK:
                return None
            append(k)
        if kwargs:
            for name, v in kwargs.items():
                if name in self._param_names and name not in self._constexpr_names:
                    return None  # a runtime argument by keyword: its position is not known here
                if isinstance(v, _Tensor) or v.__hash__ is None:
                    return None
            return (self._device(), tuple(parts), tuple(kwargs.items()), tuple(map(type, kwargs.values())))
        return (self._device(), tuple(parts))

    def _tail(self, nargs: int, kwargs: dict):
        """The parameters after the positional ones, as Triton's binder fills them (keyword, else
        default), or None where one has neither."""
        tail = []
        for name, default in zip(self._names[nargs:], self._defaults[nargs:]):
            v = kwargs.get(name, default)
            if v is _FALLBACK:
                return None
            tail.append(v)
        return tuple(tail)

    def launch(self, grid, args: tuple, kwargs: dict):
        if not self._prepared:
            self._prepare()
        direct = (enabled and self._direct_ok and _ahead._ACTIVE is None and type(grid) is tuple
                  and len(args) <= len(self._names) and not _hook_active(self._runtime.launch_enter_hook)
                  and not _hook_active(self._runtime.launch_exit_hook))
        key = self._key(args, kwargs) if direct else None
        if key is not None:
            entry = self._cache.get(key)
            if entry is not None:
                run, function, packed, tail = entry
                n = len(grid)
                run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                    self._stream(key[0]), function, packed, None, None, None, *args, *tail)
                _counts["direct"] += 1
                return None
        _counts["triton"] += 1
        kernel = self.fn[grid](*args, **kwargs)
        if key is not None and kernel is not None and not hasattr(kernel, "result"):
            tail = self._tail(len(args), kwargs)
            if tail is not None:
                self._cache[key] = (kernel.run, kernel.function, kernel.packed_metadata, tail)
        return kernel


def unwrap(kernel: Any) -> Any:
    """The Triton kernel itself (a JITFunction), decorated or not."""
    return kernel.fn if isinstance(kernel, Launched) else kernel


def launched(fn: Any) -> Launched:
    """Decorator (above `@triton.jit`): launches of this kernel skip Triton's binding once seen."""
    return Launched(fn)
