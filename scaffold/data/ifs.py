"""Fractal classes: iterated function systems (IFS) of two affine maps in 3D, and their library.

A class is 24 numbers: for each of the two maps, a 3x3 matrix (row-major) then a translation. Map i is
chosen with probability |det A_i| / sum |det A|. Its points come from the chaos game, vectorized: many
independent chains advance together in numpy and the first `burn_in` steps of each are dropped, which
replaces one long serial chain by a few dozen array operations.

Two acceptance rules (`data.class_rule`):

`upstream` (the default: upstream ScaFFold's definition of the benchmark's classes): the cloud is finite,
and after each axis is mean-centred and min-max scaled to a range of 2 (so [-1, 1] for a symmetric
cloud), its variance on every axis exceeds the threshold. Our contraction test (below) stays on as a
guard: a system with a positive Lyapunov exponent only draws a transient that grows forever, however
spread its first points look; the search reports how many candidates the guard rejected that the rule
alone would have accepted.

`rms` (this project's earlier rule; old datasets stay reproducible with it): a candidate is accepted
when it is contracting on average and its point cloud is spread in 3D:
- contracting: the top Lyapunov exponent of the random matrix products (estimated by pushing unit
  vectors through random map sequences) is negative. That is the condition for the chaos game to
  converge to an attractor; a system with a positive exponent only draws a transient that grows
  forever, however spread it looks after the burn-in.
- spread: the points are finite and bounded, and after normalization (centred on the mean, divided
  by the RMS distance to it, so the three per-axis variances sum to 1 and each is that axis's share
  of the spread; at most 1/3 for all three at once) every axis's variance exceeds the threshold.
With the default 0.15, flat or line-like attractors are rejected and about 40% of random candidates
are accepted (see data/README.md). volumes.py fits each cloud's bounding box to the grid for drawing.

`search_classes` draws candidates in a fixed order and keeps the first n accepted, so any prefix of a
search is itself the result of a smaller search (library.py relies on that).
"""
from __future__ import annotations

import math

import numpy as np

from .seeds import rng

PARAMS_PER_MAP = 12
RULES = ("upstream", "rms")
LIBRARY_SEED = 0
LIBRARY_THRESHOLD = 0.15
SEARCH_POINTS = 4096
"""Points used to judge a candidate class (enough for a stable variance estimate)."""
DECIMALS = 6
"""Parameters are rounded to this many decimals so the library file is short and exact."""
MAX_CANDIDATES_PER_CLASS = 2_000
DIVERGENCE_BOUND = 1e6
"""Coordinates beyond this mean the chains are running away (class parameters are O(1))."""


def split_maps(params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(2, 12) parameters -> matrices (2, 3, 3) and translations (2, 3)."""
    params = np.asarray(params, dtype=np.float64).reshape(2, PARAMS_PER_MAP)
    return params[:, :9].reshape(2, 3, 3), params[:, 9:]


def map_probabilities(params: np.ndarray) -> np.ndarray:
    """Probability of each map, |det A_i| / sum |det A|; equal when both determinants vanish."""
    matrices, _ = split_maps(params)
    dets = np.abs(np.linalg.det(matrices))
    total = dets.sum()
    if not np.isfinite(total) or total <= 0:
        return np.full(2, 0.5)
    return dets / total


def chaos_game(params: np.ndarray, n_points: int, gen: np.random.Generator,
               chains: int = 1024, burn_in: int = 20) -> np.ndarray:
    """`n_points` points (float64, (n, 3)) of the attractor; may hold inf/nan if the system diverges."""
    matrices, shifts = split_maps(params)
    p_first = map_probabilities(params)[0]
    chains = max(1, min(chains, n_points))
    collect = math.ceil(n_points / chains)
    x = gen.uniform(-1.0, 1.0, size=(chains, 3))
    out = np.empty((collect, chains, 3))
    with np.errstate(over="ignore", invalid="ignore"):
        for step in range(burn_in + collect):
            which = (gen.random(chains) >= p_first).astype(np.intp)
            m, t = matrices[which], shifts[which]
            # Explicit products rather than matmul: elementwise numpy is bitwise the same everywhere,
            # whereas BLAS kernels may differ by CPU and thread count.
            x = m[:, :, 0] * x[:, 0:1] + m[:, :, 1] * x[:, 1:2] + m[:, :, 2] * x[:, 2:3] + t
            if step >= burn_in:
                out[step - burn_in] = x
    return out.reshape(-1, 3)[:n_points]


def lyapunov_exponent(params: np.ndarray, gen: np.random.Generator, chains: int = 512,
                      steps: int = 40) -> float:
    """Estimate of the top Lyapunov exponent (natural log per step) of the IFS's random products:
    the mean log growth of unit vectors pushed through the matrices of a random map sequence."""
    matrices, _ = split_maps(params)
    p_first = map_probabilities(params)[0]
    v = gen.normal(size=(chains, 3))
    v /= np.sqrt((v * v).sum(axis=1, keepdims=True))
    log_growth = np.zeros(chains)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for _ in range(steps):
            m = matrices[(gen.random(chains) >= p_first).astype(np.intp)]
            v = m[:, :, 0] * v[:, 0:1] + m[:, :, 1] * v[:, 1:2] + m[:, :, 2] * v[:, 2:3]
            norm = np.sqrt((v * v).sum(axis=1))
            log_growth += np.log(norm)  # -inf once a singular map kills the vector: contracting
            v /= np.where(norm > 0, norm, 1.0)[:, None]
    return float(log_growth.mean() / steps)


def diverged(points: np.ndarray) -> bool:
    """Whether a chaos game ran away: non-finite points or coordinates beyond DIVERGENCE_BOUND."""
    if points.size == 0 or not np.isfinite(points).all():
        return True
    return float(np.abs(points).max()) > DIVERGENCE_BOUND


def normalize(points: np.ndarray) -> np.ndarray | None:
    """Centre on the mean and divide by the RMS distance to it (per-axis variances then sum to 1);
    None if the cloud diverged or is a single point."""
    if diverged(points):
        return None
    centred = points - points.mean(axis=0)
    rms = float(np.sqrt((centred * centred).sum(axis=1).mean()))
    return centred / rms if rms > 0.0 else None


def is_spread(points: np.ndarray, threshold: float) -> bool:
    """The spread half of the acceptance rule: finite, bounded, and normalized variance above
    `threshold` on every axis."""
    unit = normalize(points)
    return unit is not None and bool((unit.var(axis=0) > threshold).all())


def is_spread_upstream(points: np.ndarray, threshold: float) -> bool:
    """The upstream rule: finite, bounded, and per axis, mean-centred and min-max scaled to a range of
    2, a variance above `threshold` on every axis (at most 1: all points at the two ends)."""
    if diverged(points):
        return False
    span = points.max(axis=0) - points.min(axis=0)
    if not (span > 0).all():
        return False
    scaled = (points - points.mean(axis=0)) * (2.0 / span)
    return bool((scaled.var(axis=0) > threshold).all())


def draw_candidate(seed: int, index: int) -> np.ndarray:
    """Candidate class number `index`: 24 entries uniform in [-1, 1], rounded to DECIMALS."""
    return np.round(rng(seed, "class-candidate", index).uniform(-1.0, 1.0, size=(2, PARAMS_PER_MAP)),
                    DECIMALS)


def contracting(params: np.ndarray, gen: np.random.Generator) -> bool:
    """Whether the chaos game converges: a negative Lyapunov exponent (finite parameters)."""
    return bool(np.isfinite(params).all()) and lyapunov_exponent(params, gen) < 0.0


def accepts(params: np.ndarray, threshold: float, seed: int = LIBRARY_SEED, index: int = 0,
            rule: str = "upstream", stats: dict | None = None) -> bool:
    """Whether a candidate class passes the acceptance rule (judged from seeded random streams)."""
    if rule == "rms":
        if not contracting(params, rng(seed, "class-lyapunov", index)):
            return False
        return is_spread(chaos_game(params, SEARCH_POINTS, rng(seed, "class-test", index)), threshold)
    if rule != "upstream":
        raise ValueError(f"class rule {rule!r}: expected one of {', '.join(RULES)}")
    if not is_spread_upstream(chaos_game(params, SEARCH_POINTS, rng(seed, "class-test", index)), threshold):
        return False
    if not contracting(params, rng(seed, "class-lyapunov", index)):
        if stats is not None:  # the rule alone would have taken it: the guard's doing
            stats["guard_rejected"] = stats.get("guard_rejected", 0) + 1
        return False
    return True


def search_classes(n: int, seed: int = LIBRARY_SEED, threshold: float = LIBRARY_THRESHOLD,
                   stats: dict | None = None, rule: str = "upstream") -> np.ndarray:
    """The first `n` accepted candidates, in draw order: float64 (n, 2, 12)."""
    found: list[np.ndarray] = []
    counts: dict = {"guard_rejected": 0}
    index = 0
    while len(found) < n:
        if index >= MAX_CANDIDATES_PER_CLASS * max(n, 1):
            raise RuntimeError(f"class search: only {len(found)} of {n} classes accepted after "
                               f"{index} candidates at variance_threshold={threshold} (rule {rule})")
        candidate = draw_candidate(seed, index)
        if accepts(candidate, threshold, seed, index, rule, counts):
            found.append(candidate)
        index += 1
    if stats is not None:
        stats.update(counts, candidates=index, accepted=len(found), rule=rule)
    return np.array(found, dtype=np.float64).reshape(n, 2, PARAMS_PER_MAP)
