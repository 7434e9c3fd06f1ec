"""Fractal classes: iterated function systems (IFS) of two affine maps in 3D, and their library.

A class is 24 numbers: for each of the two maps, a 3x3 matrix (row-major) then a translation. Map i is
chosen with probability |det A_i| / sum |det A|. Its points come from the chaos game, drawn by one of two
samplers (`data.sampler`):

`upstream` (the default: upstream ScaFFold's chaos game): one chain per cloud, its first point the
origin, no burn-in, every point kept; the chain ran away if any coordinate's magnitude passes
RUNAWAY_BOUND (1e10). A cloud of a dataset at scale s has edge³/256 points; a class is judged on the
cloud of its class scale (`data.class_scale`, 8,192 points at the default 7). A chain is serial, so
`single_chains` advances many independent chains side by side (one per candidate or per instance), each
with its own random stream: a chain's points do not depend on which others ran beside it.

`chains` (this project's earlier sampler; its datasets stay reproducible byte for byte): `chaos_game`
runs 1,024 chains from uniform starts, drops the first `burn_in` steps of each and keeps the rest (4,096
points judge a class), which replaces one long serial chain by a few dozen array operations.

Two acceptance rules (`data.class_rule`):

`upstream` (the default: upstream ScaFFold's definition of the benchmark's classes): the cloud is finite
(and, under the upstream sampler, did not run away), and after each axis is mean-centred and min-max
scaled to a range of 2 (so [-1, 1] for a symmetric cloud), its variance on every axis exceeds the
threshold. Our contraction test (below) stays on as a guard: a system with a positive Lyapunov exponent
only draws a transient that grows forever, however spread its first points look. Under the upstream
sampler a stability guard also holds (see STABILITY_CLOUDS). The search reports how many candidates
each guard rejected that the rule alone would have accepted.

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
SAMPLERS = ("upstream", "chains")
RUNAWAY_BOUND = 1e10
"""The upstream sampler's runaway bound: a chain with any coordinate beyond it ran away."""
CLASS_SCALE = 7
"""The scale whose point count judges a class under the upstream sampler (upstream's default problem)."""
SEARCH_BATCH = 256
"""Candidates judged side by side by the upstream sampler's class search."""
STABILITY_CLOUDS, STABILITY_PASSES = 16, 12
"""Upstream sampler: a class the rule accepts on its cloud must also pass on at least 12 of 16 more
independent clouds (the stability guard). Min-max scaling is an extreme-value statistic: a class near
the threshold can pass on one cloud and fail on most others; the guard keeps only classes that pass
upstream's test on most of upstream's clouds."""


def upstream_point_count(scale: int) -> int:
    """Points of one upstream cloud at a scale: (2^scale)³ / 256 (8,192 at scale 7)."""
    return int((2**scale) ** 3 / 256)


def single_chains(params: np.ndarray, p_first: np.ndarray, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The upstream chaos game for B clouds at once: chain b starts at the origin and its step k applies
    map 1 where `picks[k - 1, b]` is set, map 0 otherwise. `params` (B, 2, 12), `picks` (n - 1, B) bool.

    Returns the points (B, n, 3) float64 and whether each chain ran away (a coordinate beyond
    RUNAWAY_BOUND; a NaN never compares beyond it, as upstream). Each coordinate is computed as
    ((x·a + y·b) + z·c) + t with elementwise numpy, so a chain's bits do not depend on the batch."""
    params = np.asarray(params, dtype=np.float64).reshape(-1, 2, PARAMS_PER_MAP)
    n_chains, n_points = params.shape[0], picks.shape[0] + 1
    coef0 = np.ascontiguousarray(params[:, 0, :].T)  # (12, B)
    coef1 = np.ascontiguousarray(params[:, 1, :].T)
    xyz = np.empty((n_points, 3, n_chains))
    xyz[0] = 0.0
    product = np.empty((3, 3, n_chains))
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(1, n_points):
            c = np.where(picks[k - 1], coef1, coef0)
            # Row i of the matrix times the previous point, summed over j in order 0, 1, 2 (a reduction
            # over a short outer axis adds sequentially), then the translation: ((x·a + y·b) + z·c) + t.
            np.multiply(c[:9].reshape(3, 3, n_chains), xyz[k - 1][None], out=product)
            np.add(product.sum(axis=1), c[9:], out=xyz[k])
        runaway = (np.abs(xyz) > RUNAWAY_BOUND).any(axis=(0, 1))
    return xyz.transpose(2, 0, 1), runaway


def chain_picks(p_first: np.ndarray, n_points: int, gens: list[np.random.Generator]) -> np.ndarray:
    """(n_points - 1, B) bool: map 1 at a step where the chain's uniform draw is not below its map 0
    probability (upstream: map 0 when the draw is below it). One generator per chain."""
    picks = np.empty((max(n_points - 1, 0), len(gens)), dtype=bool)
    for b, gen in enumerate(gens):
        picks[:, b] = gen.random(n_points - 1) >= p_first[b]
    return picks


def passes_upstream(points: np.ndarray, runaway: bool, threshold: float) -> bool:
    """Upstream's verdict on one cloud: no runaway, every point finite, a positive finite range on every
    axis, and per axis, mean-centred and scaled by 2 / (max - min), a variance above `threshold`."""
    if runaway or not np.isfinite(points).all():
        return False
    with np.errstate(over="ignore", invalid="ignore"):
        span = points.max(axis=0) - points.min(axis=0)
        if not (np.isfinite(span).all() and (span > 0).all()):
            return False
        scaled = (points - points.mean(axis=0)) * (2.0 / span)
        if not np.isfinite(scaled).all():
            return False
        return bool((scaled.var(axis=0) > threshold).all())


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


def _check_choice(rule: str, sampler: str) -> None:
    if rule not in RULES:
        raise ValueError(f"class rule {rule!r}: expected one of {', '.join(RULES)}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}")


def _rule_verdicts(candidates: np.ndarray, indices: list[int], threshold: float, seed: int, rule: str,
                   class_scale: int) -> list[bool]:
    """The rule's verdict (before the contraction test) on each candidate's upstream cloud at
    `class_scale`, the candidates' chains advanced side by side."""
    candidates = np.asarray(candidates, dtype=np.float64).reshape(-1, 2, PARAMS_PER_MAP)
    n_points = upstream_point_count(class_scale)
    p_first = np.array([map_probabilities(c)[0] for c in candidates])
    picks = chain_picks(p_first, n_points, [rng(seed, "class-chain", i) for i in indices])
    points, runaway = single_chains(candidates, p_first, picks)
    if rule == "upstream":
        return [passes_upstream(points[b], bool(runaway[b]), threshold) for b in range(len(candidates))]
    return [not runaway[b] and is_spread(points[b], threshold) for b in range(len(candidates))]


def _stable(candidates: list[np.ndarray], indices: list[int], threshold: float, seed: int, rule: str,
            class_scale: int) -> list[bool]:
    """The stability guard (see STABILITY_CLOUDS) for candidates the rule accepted: each judged on
    STABILITY_CLOUDS more clouds from streams of its own, all chains side by side."""
    if not candidates:
        return []
    reps = np.repeat(np.asarray(candidates, dtype=np.float64).reshape(-1, 2, PARAMS_PER_MAP),
                     STABILITY_CLOUDS, axis=0)
    streams = [i * STABILITY_CLOUDS + j for i in indices for j in range(STABILITY_CLOUDS)]
    n_points = upstream_point_count(class_scale)
    p_first = np.array([map_probabilities(c)[0] for c in reps])
    picks = chain_picks(p_first, n_points, [rng(seed, "class-stability", s) for s in streams])
    passes = []
    for start in range(0, len(reps), SEARCH_BATCH):
        points, runaway = single_chains(reps[start:start + SEARCH_BATCH], p_first[start:start + SEARCH_BATCH],
                                        picks[:, start:start + SEARCH_BATCH])
        for b in range(len(points)):
            passes.append(passes_upstream(points[b], bool(runaway[b]), threshold) if rule == "upstream"
                          else not runaway[b] and is_spread(points[b], threshold))
    counts = np.array(passes).reshape(len(candidates), STABILITY_CLOUDS).sum(axis=1)
    return [bool(c >= STABILITY_PASSES) for c in counts]


def _judge(candidate: np.ndarray, verdict: bool, threshold: float, seed: int, index: int, rule: str,
           sampler: str, stats: dict | None, stable: bool = True) -> bool:
    """One candidate's acceptance from its cloud's verdict (computed or not yet, for `chains`), the
    stability guard's (upstream sampler) and the contraction test."""
    if sampler == "chains" and rule == "rms":
        if not contracting(candidate, rng(seed, "class-lyapunov", index)):
            return False
        return is_spread(chaos_game(candidate, SEARCH_POINTS, rng(seed, "class-test", index)), threshold)
    if sampler == "chains":
        verdict = is_spread_upstream(chaos_game(candidate, SEARCH_POINTS, rng(seed, "class-test", index)),
                                     threshold)
    if not verdict:
        return False
    if not stable:
        if stats is not None:
            stats["stability_rejected"] = stats.get("stability_rejected", 0) + 1
        return False
    if not contracting(candidate, rng(seed, "class-lyapunov", index)):
        if stats is not None and rule == "upstream":  # the rule alone would have taken it: the guard's doing
            stats["guard_rejected"] = stats.get("guard_rejected", 0) + 1
        return False
    return True


def accepts(params: np.ndarray, threshold: float, seed: int = LIBRARY_SEED, index: int = 0,
            rule: str = "upstream", stats: dict | None = None, sampler: str = "upstream",
            class_scale: int = CLASS_SCALE) -> bool:
    """Whether a candidate class passes the acceptance rule (judged from seeded random streams)."""
    _check_choice(rule, sampler)
    verdict = (sampler == "upstream"
               and _rule_verdicts(params, [index], threshold, seed, rule, class_scale)[0])
    stable = not verdict or _stable([params], [index], threshold, seed, rule, class_scale)[0]
    return _judge(params, verdict, threshold, seed, index, rule, sampler, stats, stable)


def search_classes(n: int, seed: int = LIBRARY_SEED, threshold: float = LIBRARY_THRESHOLD,
                   stats: dict | None = None, rule: str = "upstream", sampler: str = "upstream",
                   class_scale: int = CLASS_SCALE) -> np.ndarray:
    """The first `n` accepted candidates, in draw order: float64 (n, 2, 12). Under the upstream sampler
    candidates are judged in batches, each from its own streams, so the result is the same as one by
    one."""
    _check_choice(rule, sampler)
    found: list[np.ndarray] = []
    counts: dict = {"guard_rejected": 0}
    if sampler == "upstream":
        counts["stability_rejected"] = 0
    batch = 1 if sampler == "chains" else max(1, min(SEARCH_BATCH, 2**21 // upstream_point_count(class_scale)))
    index = 0
    while len(found) < n:
        if index >= MAX_CANDIDATES_PER_CLASS * max(n, 1):
            raise RuntimeError(f"class search: only {len(found)} of {n} classes accepted after "
                               f"{index} candidates at variance_threshold={threshold} (rule {rule})")
        indices = list(range(index, index + batch))
        candidates = [draw_candidate(seed, i) for i in indices]
        verdicts = (_rule_verdicts(np.array(candidates), indices, threshold, seed, rule, class_scale)
                    if sampler == "upstream" else [False] * batch)
        passed = [b for b, v in enumerate(verdicts) if v]
        stable = [True] * batch
        for b, ok in zip(passed, _stable([candidates[b] for b in passed], [indices[b] for b in passed],
                                         threshold, seed, rule, class_scale)):
            stable[b] = ok
        for i, candidate, verdict, steady in zip(indices, candidates, verdicts, stable):
            index = i + 1
            if _judge(candidate, verdict, threshold, seed, i, rule, sampler, counts, steady):
                found.append(candidate)
                if len(found) == n:
                    break
    if stats is not None:
        stats.update(counts, candidates=index, accepted=len(found), rule=rule, sampler=sampler)
        if sampler == "upstream":
            stats["class_scale"] = class_scale
    return np.array(found, dtype=np.float64).reshape(n, 2, PARAMS_PER_MAP)
