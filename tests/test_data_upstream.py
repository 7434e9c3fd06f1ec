"""The upstream sampler (data.sampler=upstream, the default): upstream ScaFFold's chaos game and class
verdict, checked against a re-implementation written here on its own (not the library's code).

Upstream's chaos game, as its code defines it: one chain per cloud, the first point the origin, no
burn-in, (2^scale)³/256 points; at each step a uniform draw below map 0's probability |det A0| / Σ|det A|
picks map 0, else map 1; a coordinate beyond 1e10 in magnitude marks the chain as run away. Its class
verdict: no runaway, finite, and per axis, centred on the mean and scaled by 2 / (max - min), a variance
above the threshold on every axis.
"""
from __future__ import annotations

import numpy as np
import pytest

from scaffold.config import DataConfig
from scaffold.data import ifs, library, store, volumes
from scaffold.data.seeds import rng

THRESHOLD = 0.15
CLOUDS = 16


def reference_clouds(params: np.ndarray, n_points: int, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Upstream's chaos game for a batch of classes (B, 2, 12), one chain each, written with einsum:
    points (n, B, 3) and the runaway flag of each chain."""
    params = np.asarray(params, dtype=np.float64).reshape(-1, 2, 12)
    b = len(params)
    mats = params[:, :, :9].reshape(b, 2, 3, 3)
    shifts = params[:, :, 9:]
    dets = np.abs(np.linalg.det(mats))
    p0 = dets[:, 0] / dets.sum(axis=1)
    which = (gen.random((n_points - 1, b)) >= p0).astype(np.intp)
    rows = np.arange(b)
    points = np.zeros((n_points, b, 3))
    with np.errstate(all="ignore"):
        for k in range(1, n_points):
            t = which[k - 1]
            points[k] = np.einsum("bij,bj->bi", mats[rows, t], points[k - 1]) + shifts[rows, t]
        runaway = (np.abs(points) > 1e10).any(axis=(0, 2))
    return points, runaway


def reference_verdict(cloud: np.ndarray, runaway: bool, threshold: float = THRESHOLD) -> bool:
    with np.errstate(all="ignore"):
        if runaway or not np.isfinite(cloud).all():
            return False
        lo, hi = cloud.min(axis=0), cloud.max(axis=0)
        if not (hi - lo > 0).all():
            return False
        scaled = (cloud - cloud.mean(axis=0)) * (2.0 / (hi - lo))
        return bool((scaled.var(axis=0) > threshold).all())


def test_every_shipped_class_passes_upstreams_test_on_most_of_upstreams_clouds():
    classes = library.load_library()  # the default: upstream sampler and rule, judged at class scale 7
    assert len(classes) == 64
    n_points = int((2**ifs.CLASS_SCALE) ** 3 / 256)
    assert n_points == 8192
    gen = np.random.default_rng(20261205)
    passes = np.zeros(len(classes), dtype=int)
    per_batch = 8  # classes per batch: 8 x 16 chains side by side
    for start in range(0, len(classes), per_batch):
        batch = np.repeat(classes[start:start + per_batch], CLOUDS, axis=0)
        clouds, runaway = reference_clouds(batch, n_points, gen)
        verdicts = [reference_verdict(clouds[:, i], runaway[i]) for i in range(len(batch))]
        passes[start:start + per_batch] = np.array(verdicts).reshape(-1, CLOUDS).sum(axis=1)
    assert (passes >= CLOUDS // 2).all(), {k: int(v) for k, v in enumerate(passes) if v < CLOUDS // 2}


def test_the_sampler_is_upstreams_chain_bit_for_bit():
    """One chain per cloud from the origin, map 0 when the draw is below its probability: the library's
    batched sampler gives exactly the points of a plain serial loop over the same draws."""
    classes = library.load_library()[:4]
    n = 1500
    p0 = np.array([ifs.map_probabilities(c)[0] for c in classes])
    draws = np.random.default_rng(3).random((n - 1, len(classes)))
    points, runaway = ifs.single_chains(classes, p0, draws >= p0)
    assert points.shape == (len(classes), n, 3) and not runaway.any()
    for b, params in enumerate(classes):
        maps = params.reshape(2, 12)
        x = y = z = 0.0
        expected = [(x, y, z)]
        for k in range(1, n):
            m = maps[0] if draws[k - 1, b] < p0[b] else maps[1]
            x, y, z = (x * m[0] + y * m[1] + z * m[2] + m[9], x * m[3] + y * m[4] + z * m[5] + m[10],
                       x * m[6] + y * m[7] + z * m[8] + m[11])
            expected.append((x, y, z))
        assert np.array_equal(points[b], np.array(expected)), b


def test_runaway_bound_is_upstreams():
    grow = np.zeros((1, 2, 12))
    grow[0, :, [0, 4, 8]] = 1.5  # expanding: 1.5^k passes 1e10 after about 57 steps, stays finite
    grow[0, :, 9:] = 1.0
    points, runaway = ifs.single_chains(grow, np.array([0.5]), np.zeros((99, 1), dtype=bool))
    assert runaway[0] and np.isfinite(points).all() and np.abs(points).max() > 1e10
    assert not ifs.passes_upstream(points[0], bool(runaway[0]), THRESHOLD)
    points, runaway = ifs.single_chains(grow, np.array([0.5]), np.zeros((40, 1), dtype=bool))
    assert not runaway[0] and np.abs(points).max() > 1e6  # past our old bound, below upstream's: kept


def test_class_search_is_batch_independent_and_a_prefix():
    a = ifs.search_classes(3, seed=0, sampler="upstream")
    b = ifs.search_classes(5, seed=0, sampler="upstream")
    assert np.array_equal(a, b[:3]) and np.array_equal(b, library.load_library()[:5])
    index = next(i for i in range(5000) if np.array_equal(ifs.draw_candidate(0, i), b[1]))
    assert ifs.accepts(b[1], THRESHOLD, 0, index)  # judged alone, as in the batched search


def _diverging_class() -> np.ndarray:
    """Two maps with the same a00 = 0.75: instance 12 scales a00 by 1.6 (1.2: the chain runs away), its
    first retry by 1.3 (0.975: it stays bounded). Map 0's off-diagonal entries make its determinant
    not proportional to a00, so the variant's own determinants give other map probabilities."""
    params = np.zeros((2, 12))
    params[0, [0, 1, 3, 4, 8]] = [0.75, 0.1, 0.1, 0.5, 0.3]
    params[1, [0, 4, 8]] = [0.75, 0.6, 0.9]
    params[:, 9:] = [[0.2, 0.1, 0.0], [-0.3, 0.4, 0.5]]
    return params


def test_instances_keep_the_class_probabilities_and_attenuate_on_divergence():
    classes = _diverging_class()[None]
    position, factor = volumes.instance_variant(12)
    assert (position, factor) == (0, 1.6)
    n = 4096
    [cloud] = volumes.upstream_instance_clouds(classes, [(0, 12)], n, seed=7)
    p_class = ifs.map_probabilities(classes[0])[0]
    picks = ifs.chain_picks(np.array([p_class]), n, [rng(7, "instance-chain", 12)])
    first, runaway = ifs.single_chains(volumes.scaled_params(classes[0], 0, 1.6)[None], np.array([p_class]), picks)
    assert runaway[0]  # the requested variant runs away...
    retry = volumes.scaled_params(classes[0], 0, 1.0 + (1.6 - 1.0) * 0.5)
    expected, runaway = ifs.single_chains(retry[None], np.array([p_class]), picks)
    assert not runaway[0] and np.array_equal(cloud, expected[0])  # ...its first attenuation is kept
    p_variant = ifs.map_probabilities(retry)[0]
    assert p_variant != p_class  # recomputed probabilities would have drawn another cloud
    other, _ = ifs.single_chains(retry[None], np.array([p_variant]),
                                 ifs.chain_picks(np.array([p_variant]), n, [rng(7, "instance-chain", 12)]))
    assert not np.array_equal(cloud, other[0])


def test_instance_clouds_do_not_depend_on_their_batch():
    classes = library.load_library()[:3]
    pairs = [(0, 0), (1, 37), (2, 144), (0, 12)]
    together = volumes.upstream_instance_clouds(classes, pairs, 512, seed=1)
    for pair, cloud in zip(pairs, together):
        assert cloud.shape == (512, 3)
        assert np.array_equal(cloud, volumes.upstream_instance_clouds(classes, [pair], 512, seed=1)[0])


def test_point_counts_are_upstreams():
    assert [ifs.upstream_point_count(s) for s in (5, 7, 8)] == [128, 8192, 65536]
    cfg = DataConfig(n_categories=2, n_instances=3)
    plan = volumes.plan_dataset(cfg, 7, 0, library.classes_for(2, THRESHOLD))
    assert plan.sampler == "upstream" and plan.n_points == 8192


@pytest.mark.parametrize("changes, key", [
    ({"sampler": "chain"}, "data.sampler"),
    ({"class_scale": 3}, "data.class_scale"),
])
def test_bad_sampler_keys_are_one_line(tmp_path, changes, key):
    cfg = DataConfig(cache_dir=str(tmp_path), n_categories=2, n_instances=3, **changes)
    with pytest.raises(Exception) as err:
        store.prepare(cfg, 3, 0, progress=False)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)
