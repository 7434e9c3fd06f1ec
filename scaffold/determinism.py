"""Seeding and the determinism modes (docs/design.md, "The determinism contract").

default  same config + same hardware and software => the same bits. Every seed derives from `seed`;
         cuDNN runs without benchmark search and with deterministic algorithms; our rungs never autotune at
         run time; cuBLAS gets a fixed workspace (CUBLAS_WORKSPACE_CONFIG, set before CUDA starts).
strict   all of the above, plus torch.use_deterministic_algorithms(True): an op without a deterministic
         implementation raises instead of running. It must give the same bits as default.
off      cuDNN may autotune (benchmark search): faster on some shapes, bits may differ between runs.
"""
from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch


def derive_seed(seed: int, purpose: str, index: int = 0) -> int:
    """A 63-bit seed from (seed, purpose, index): independent streams that do not depend on order."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def configure(mode: str) -> None:
    """Apply a determinism mode to this process. Call before the first CUDA operation."""
    if mode not in ("default", "strict", "off"):
        raise ValueError(f"determinism={mode!r}: expected default | strict | off")
    # cuBLAS picks reduction splits by workspace size; a fixed workspace makes them reproducible. It is
    # read when the cuBLAS handle is created, so it must be set before any CUDA matrix work.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic = mode != "off"
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    # float32 matmuls/convs on CUDA in full precision unless autocast says otherwise: TF32 would be
    # deterministic too, but full fp32 keeps the CPU and GPU paths comparable.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(mode == "strict")  # raising, never warn_only


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) from one run seed."""
    random.seed(derive_seed(seed, "python"))
    np.random.seed(derive_seed(seed, "numpy") % (2**32))
    torch.manual_seed(derive_seed(seed, "torch"))  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """Every RNG state a resumed run needs to continue bit for bit."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
