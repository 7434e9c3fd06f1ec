"""Instances and volumes: which fractals go where, and how a volume's mask is drawn.

Instances: each class has 145 variants. Instance 0 is the class itself; instance 1 + 12*p + f scales
parameter position p (0..11, the same position in both maps) by FACTORS[f] (0.4 .. 1.6 in steps of
0.1, 1.0 excluded). Under the upstream sampler (the default, upstream ScaFFold's handling) an instance
keeps its class's map probabilities, and a variant whose chain runs away or leaves a non-finite point
is drawn again with its factor's deviation from 1 attenuated (times 0.5, 0.25, 0.1; the same random
stream each time), then as the class itself. Under the chains sampler (the earlier one) the
probabilities follow the scaled matrices, and a variant that diverges (not contracting on average, see
ifs.py, or points that are non-finite or blow up) moves halfway toward the unscaled class (factor -> 1 +
(factor - 1) / 2) until it converges, and is the unscaled class after MAX_HALVINGS.

Plan: per class, the first n_used instances of a seeded permutation of the 145 (n_used = n_instances
rounded down to a multiple of fractals_per_volume); all (class, instance) pairs are shuffled together
and cut into volumes of fractals_per_volume; the last n_val volumes are the validation split
(n_val = round-half-up(val_fraction * n_volumes), kept within [1, n_volumes - 1]).

Volumes: each instance's points are fitted to the grid (bounding box centred, largest side spanning
the edge) and voxelized; instances are drawn in order, so later ones overwrite earlier ones. Mask value
= class index + 1, background 0. Every draw comes from `seeds.rng`, so a volume is a pure function of
(plan, index) whatever process computes it.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..config import ConfigError
from .ifs import chain_picks, chaos_game, contracting, diverged, map_probabilities, single_chains
from .seeds import rng

FACTORS = tuple(round(0.4 + 0.1 * i, 1) for i in range(13) if i != 6)
N_POSITIONS = 12
INSTANCES_PER_CLASS = 1 + N_POSITIONS * len(FACTORS)
MAX_HALVINGS = 8
MIN_POINTS = 64
ATTENUATION = (0.5, 0.25, 0.1)
"""Upstream sampler: the shares of a variant's deviation from its class kept by the retries."""
POINTS_PER_BATCH = 2**24
"""Upstream sampler: at most this many points (chains x points per chain) are held in one batch."""


def points_per_fractal(edge: int) -> int:
    """edge³ / 256 points, at least MIN_POINTS so tiny volumes still show a shape."""
    return max(MIN_POINTS, edge**3 // 256)


def instance_variant(instance: int) -> tuple[int | None, float]:
    """(parameter position or None for the unscaled class, scale factor) of an instance id."""
    if not 0 <= instance < INSTANCES_PER_CLASS:
        raise ValueError(f"instance id {instance}: expected 0..{INSTANCES_PER_CLASS - 1}")
    if instance == 0:
        return None, 1.0
    position, which = divmod(instance - 1, len(FACTORS))
    return position, FACTORS[which]


def scaled_params(class_params: np.ndarray, position: int | None, factor: float) -> np.ndarray:
    """A copy of the class parameters (2, 12) with `position` scaled by `factor` in both maps."""
    params = np.array(class_params, dtype=np.float64).reshape(2, N_POSITIONS)
    if position is not None:
        params[:, position] *= factor
    return params


def instance_points(class_params: np.ndarray, instance: int, n_points: int, seed: int,
                    stream: int) -> tuple[np.ndarray, float]:
    """Points (n, 3) of one instance and the factor finally used (after any divergence fallback)."""
    position, factor = instance_variant(instance)
    for _ in range(MAX_HALVINGS + 1):
        params = scaled_params(class_params, position, factor)
        # The same streams for every attempt: the fallback is as deterministic as the first try.
        if contracting(params, rng(seed, "instance-lyapunov", stream)):
            points = chaos_game(params, n_points, rng(seed, "instance-points", stream))
            if not diverged(points):
                return points, factor
        factor = 1.0 + (factor - 1.0) / 2.0
    params = scaled_params(class_params, None, 1.0)
    return chaos_game(params, n_points, rng(seed, "instance-points", stream)), 1.0


def upstream_instance_clouds(classes: np.ndarray, pairs: list[tuple[int, int]], n_points: int,
                             seed: int) -> list[np.ndarray]:
    """Points (n, 3) of each (class index, instance id) pair under the upstream sampler, their chains
    advanced side by side. Each chain draws from its own stream (seed, "instance-chain", class * 145 +
    instance) and keeps its class's map probabilities; a chain that runs away or leaves a non-finite
    point is drawn again on the same stream with an attenuated variant, finally the class itself (whose
    points are kept even then; voxelize drops non-finite ones)."""
    if not pairs:
        return []
    p_first = np.array([map_probabilities(classes[c])[0] for c, _ in pairs])
    streams = [int(c) * INSTANCES_PER_CLASS + int(k) for c, k in pairs]
    picks = chain_picks(p_first, n_points, [rng(seed, "instance-chain", s) for s in streams])
    variants = [instance_variant(int(k)) for _, k in pairs]

    def variant(b: int, share: float) -> np.ndarray:
        position, factor = variants[b]
        if share == 0.0:
            return scaled_params(classes[pairs[b][0]], None, 1.0)
        return scaled_params(classes[pairs[b][0]], position,
                             factor if share == 1.0 else 1.0 + (factor - 1.0) * share)

    def usable(points: np.ndarray, runaway: bool) -> bool:
        return not runaway and bool(np.isfinite(points).all())

    everyone = list(range(len(pairs)))
    points, runaway = single_chains(np.array([variant(b, 1.0) for b in everyone]), p_first, picks)
    result: list[np.ndarray] = [np.ascontiguousarray(points[b]) for b in everyone]
    failed = [b for b in everyone if not usable(points[b], bool(runaway[b]))]
    if failed:
        # Every retry of every failed chain in one more pass (the retries are few); each keeps the
        # first usable one in upstream's order, else the class itself.
        shares = (*ATTENUATION, 0.0)
        tries = [(b, share) for b in failed for share in shares]
        cols = [b for b, _ in tries]
        again, again_runaway = single_chains(np.array([variant(b, share) for b, share in tries]),
                                             p_first[cols], picks[:, cols])
        for i, b in enumerate(failed):
            row = i * len(shares)
            for j in range(len(shares)):
                if j == len(shares) - 1 or usable(again[row + j], bool(again_runaway[row + j])):
                    result[b] = np.ascontiguousarray(again[row + j])
                    break
    return result  # type: ignore[return-value]


def voxelize(points: np.ndarray, edge: int) -> np.ndarray:
    """Flat indices into an edge³ grid of the voxels the points fall in, after fitting the cloud's
    bounding box to the grid (centred, isotropic, longest side = edge). Non-finite points are dropped."""
    points = points[np.isfinite(points).all(axis=1)]
    if len(points) == 0:
        return np.empty(0, dtype=np.int64)
    lo, hi = points.min(axis=0), points.max(axis=0)
    half = float((hi - lo).max()) / 2.0
    half = half if half > 0.0 else 1.0
    unit = (points - (lo + hi) / 2.0) / half
    cells = np.clip(np.floor((unit + 1.0) * (edge / 2.0)).astype(np.int64), 0, edge - 1)
    return (cells[:, 0] * edge + cells[:, 1]) * edge + cells[:, 2]


@dataclass(frozen=True)
class Plan:
    """Everything that defines a dataset's volumes; cheap to build and to send to workers."""
    edge: int
    seed: int
    classes: np.ndarray
    """(n_categories, 2, 12) class parameters; mask value = row index + 1."""
    volumes: np.ndarray
    """(n_volumes, fractals_per_volume, 2) int64: (class index, instance id), drawn in this order."""
    n_val: int
    sampler: str = "upstream"
    """The chaos game of the instances: upstream | chains (see ifs.py)."""

    @property
    def n_points(self) -> int:
        return points_per_fractal(self.edge)

    @property
    def n_train(self) -> int:
        return len(self.volumes) - self.n_val


def split_sizes(n_volumes: int, val_fraction: float) -> tuple[int, int]:
    """(n_train, n_val): n_val = round-half-up(val_fraction * n_volumes), at least 1 of each."""
    if n_volumes < 2:
        raise ConfigError(f"data.n_instances/data.n_categories: the dataset would hold {n_volumes} "
                          "volume(s); expected at least 2 (one train, one validation)")
    n_val = min(max(math.floor(val_fraction * n_volumes + 0.5), 1), n_volumes - 1)
    return n_volumes - n_val, n_val


def dataset_sizes(data) -> tuple[int, int]:
    """(n_train, n_val) that a data config will produce, without generating anything."""
    n_volumes = data.n_categories * (data.n_instances // data.fractals_per_volume)
    return split_sizes(n_volumes, float(data.val_fraction))


def plan_dataset(data_cfg, scale: int, seed: int, classes: np.ndarray) -> Plan:
    """Assign instances to volumes (see the module docstring); raises ConfigError if too few."""
    per_volume = int(data_cfg.fractals_per_volume)
    n_used = (int(data_cfg.n_instances) // per_volume) * per_volume
    pairs = []
    for c in range(len(classes)):
        chosen = np.sort(rng(seed, "instance-choice", c).permutation(INSTANCES_PER_CLASS)[:n_used])
        pairs.extend((c, int(k)) for k in chosen)
    pairs = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    order = rng(seed, "volume-order").permutation(len(pairs))
    volumes = pairs[order].reshape(-1, per_volume, 2)
    _, n_val = split_sizes(len(volumes), float(data_cfg.val_fraction))
    return Plan(edge=2**scale, seed=seed, classes=np.asarray(classes, dtype=np.float64),
                volumes=volumes, n_val=n_val, sampler=str(getattr(data_cfg, "sampler", "upstream")))


def render_volumes(plan: Plan, indices: list[int]) -> Iterator[np.ndarray]:
    """The masks of several volumes, one after another (a consumer that drops each before the next
    keeps one mask's memory); under the upstream sampler all their instances' chains run side by side
    (in batches of at most POINTS_PER_BATCH points), which gives the same bits as one by one."""
    if plan.sampler != "upstream":
        yield from (render_volume(plan, i) for i in indices)
        return
    per_batch = max(1, POINTS_PER_BATCH // (plan.n_points * plan.volumes.shape[1]))
    for start in range(0, len(indices), per_batch):
        block = indices[start:start + per_batch]
        pairs = [(int(c), int(k)) for i in block for c, k in plan.volumes[i]]
        clouds = iter(upstream_instance_clouds(plan.classes, pairs, plan.n_points, plan.seed))
        for i in block:
            mask = np.zeros(plan.edge**3, dtype=np.uint8)
            for class_index, _ in plan.volumes[i]:
                mask[voxelize(next(clouds), plan.edge)] = class_index + 1
            yield mask.reshape((plan.edge,) * 3)


def render_volume(plan: Plan, index: int) -> np.ndarray:
    """The uint8 mask (E, E, E) of volume `index`: instances overlaid in order, later on top."""
    if plan.sampler == "upstream":
        return next(render_volumes(plan, [index]))
    edge = plan.edge
    mask = np.zeros(edge**3, dtype=np.uint8)
    for class_index, instance in plan.volumes[index]:
        stream = int(class_index) * INSTANCES_PER_CLASS + int(instance)
        points, _ = instance_points(plan.classes[class_index], int(instance), plan.n_points,
                                    plan.seed, stream)
        mask[voxelize(points, edge)] = class_index + 1
    return mask.reshape(edge, edge, edge)


def make_palette(n_categories: int, seed: int) -> np.ndarray:
    """One RGB colour in [0, 1) per class, background row 0: float32 (n_categories + 1, 3)."""
    palette = np.zeros((n_categories + 1, 3), dtype=np.float32)
    palette[1:] = rng(seed, "palette").uniform(0.0, 1.0, size=(n_categories, 3))
    return palette
