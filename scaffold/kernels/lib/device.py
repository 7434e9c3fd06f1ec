"""The device as the launchers see it: may this tensor run on Triton here, its arch key for the tile
tables, its compute capability and multiprocessor count (looked up once per device)."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1, read at triton import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _import_triton() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


_TRITON = _import_triton()  # decided once at import: a plain constant, which torch.compile traces cleanly


def triton_importable() -> bool:
    return _TRITON


def triton_usable(t: torch.Tensor) -> bool:
    """A tensor can go through our Triton kernels: on CUDA, or on the CPU under the interpreter."""
    if not triton_importable():
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreting()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> str:
    major, minor = _capability(index)
    return f"sm{major}{minor}"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device (9 on Hopper), looked up once per device."""
    return _capability(_index(device))[0]


def dtype_key(dtype: torch.dtype) -> str:
    """Key of the frozen tables for a compute dtype."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def arch_key(device: torch.device) -> str:
    """Key of the frozen tile tables: 'sm90' on Hopper, 'cpu' under the interpreter."""
    if device.type == "cuda":
        return _cuda_arch(_index(device))
    return "cpu"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the device (a fixed 4 under the interpreter, so split counts stay pure
    functions of shape and device)."""
    if device.type == "cuda":
        return _sm_count(_index(device))
    return 4

