"""Named random streams: every draw in the data package comes from `rng(seed, purpose, index)`.

A generator seeded by a hash of (seed, what it is for, index) gives each fractal, instance and volume
its own stream, so the bytes of a dataset do not depend on how many worker processes made it or in
which order they ran.
"""
from __future__ import annotations

import zlib

import numpy as np


def rng(seed: int, purpose: str, index: int = 0) -> np.random.Generator:
    """A generator for one purpose and index; negative seeds wrap into the unsigned 64-bit range."""
    words = [int(seed) % 2**64, zlib.crc32(purpose.encode("utf-8")), int(index)]
    return np.random.default_rng(np.random.SeedSequence(words))
