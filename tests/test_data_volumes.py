"""Instances (affine variants), the dataset plan, voxelization and volume overlay."""
import numpy as np
import pytest

from scaffold.config import ConfigError, DataConfig
from scaffold.data import library, volumes
from scaffold.data.volumes import Plan


def test_145_instances_cover_12_positions_by_12_factors():
    assert volumes.INSTANCES_PER_CLASS == 145
    assert volumes.FACTORS == (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6)
    assert volumes.instance_variant(0) == (None, 1.0)
    variants = {volumes.instance_variant(k) for k in range(1, 145)}
    assert variants == {(p, f) for p in range(12) for f in volumes.FACTORS}
    with pytest.raises(ValueError, match="instance id 145"):
        volumes.instance_variant(145)


def test_scaling_touches_the_same_position_in_both_maps():
    params = library.load_library()[0]
    scaled = volumes.scaled_params(params, 4, 1.5)
    assert np.array_equal(scaled[:, 4], params[:, 4] * 1.5)
    others = [i for i in range(12) if i != 4]
    assert np.array_equal(scaled[:, others], params[:, others])


def test_divergent_variant_falls_back_toward_the_class():
    shrink = np.concatenate([np.ravel(0.9 * np.eye(3)), [0.5, 0, 0]])
    params = np.stack([shrink, np.concatenate([np.ravel(0.9 * np.eye(3)), [0, 0.5, 0.5]])])
    k_expand = 1 + 0 * 12 + volumes.FACTORS.index(1.6)  # A[0,0]: 0.9 * 1.6 = 1.44 expands
    points, factor = volumes.instance_points(params, k_expand, 512, seed=0, stream=0)
    # 1.6 -> 1.3 -> 1.15 -> 1.075: the first with 0.9 * factor < 1.
    assert factor == pytest.approx(1.075)
    assert np.isfinite(points).all() and np.abs(points).max() < 100
    k_shrink = 1 + volumes.FACTORS.index(0.4)
    assert volumes.instance_points(params, k_shrink, 512, seed=0, stream=0)[1] == 0.4


def test_default_plan_has_240_volumes_split_168_72():
    classes = library.classes_for(5, 0.15)
    plan = volumes.plan_dataset(DataConfig(), 7, 42, classes)
    assert plan.volumes.shape == (240, 3, 2)
    assert (plan.n_train, plan.n_val) == (168, 72)
    pairs = plan.volumes.reshape(-1, 2)
    assert len({tuple(p) for p in pairs}) == 720  # every (class, instance) used once
    assert np.array_equal(np.bincount(pairs[:, 0]), [144] * 5)
    again = volumes.plan_dataset(DataConfig(), 7, 42, classes)
    assert np.array_equal(plan.volumes, again.volumes)
    other = volumes.plan_dataset(DataConfig(), 7, 43, classes)
    assert not np.array_equal(plan.volumes, other.volumes)


def test_split_rounding_and_too_small_datasets():
    assert volumes.split_sizes(240, 0.3) == (168, 72)
    assert volumes.split_sizes(5, 0.3) == (3, 2)  # 1.5 rounds half up
    assert volumes.split_sizes(2, 0.01) == (1, 1)
    with pytest.raises(ConfigError, match="at least 2"):
        volumes.plan_dataset(DataConfig(n_categories=1, n_instances=3), 3, 0, library.classes_for(1, 0.15))


def test_voxelize_fits_the_bounding_box_to_the_grid():
    points = np.array([[0.0, 0.0, 0.0], [2.0, 1.0, 1.0], [1.0, 0.5, 0.5], [np.nan, 0, 0]])
    cells = np.stack(np.unravel_index(volumes.voxelize(points, 8), (8, 8, 8)), axis=1)
    # x spans the whole edge [0, 8) (its top point clipped into cell 7); y and z, half as long, span
    # the centred interval [2, 6] and their top points land in cell 6.
    assert cells.tolist() == [[0, 2, 2], [7, 6, 6], [4, 4, 4]]


@pytest.mark.parametrize("sampler", ["upstream", "chains"])
def test_later_fractals_overwrite_earlier_ones(monkeypatch, sampler):
    shared = np.random.default_rng(0).uniform(-1, 1, size=(200, 3))
    monkeypatch.setattr(volumes, "instance_points", lambda *args: (shared, 1.0))
    monkeypatch.setattr(volumes, "upstream_instance_clouds", lambda classes, pairs, *args: [shared] * len(pairs))
    classes = library.classes_for(2, 0.15)
    for order, winner in (([[0, 0], [1, 0]], 2), ([[1, 0], [0, 0]], 1)):
        plan = Plan(edge=8, seed=0, classes=classes, volumes=np.array([order]), n_val=0, sampler=sampler)
        mask = volumes.render_volume(plan, 0)
        assert set(np.unique(mask)) == {0, winner}


def test_volume_labels_belong_to_its_fractals():
    classes = library.classes_for(4, 0.15)
    plan = volumes.plan_dataset(DataConfig(n_categories=4, n_instances=6), 4, 7, classes)
    for index in range(len(plan.volumes)):
        mask = volumes.render_volume(plan, index)
        assert mask.dtype == np.uint8 and mask.shape == (16, 16, 16)
        allowed = {0} | {int(c) + 1 for c in plan.volumes[index, :, 0]}
        assert set(np.unique(mask)) <= allowed and mask.max() > 0
    assert np.array_equal(volumes.render_volume(plan, 3), volumes.render_volume(plan, 3))


def test_points_per_fractal_and_palette():
    assert volumes.points_per_fractal(128) == 8192
    assert volumes.points_per_fractal(8) == 64
    palette = volumes.make_palette(5, 42)
    assert palette.dtype == np.float32 and palette.shape == (6, 3)
    assert (palette[0] == 0).all() and (palette[1:] > 0).all() and (palette[1:] < 1).all()
    assert np.array_equal(palette, volumes.make_palette(5, 42))
    assert not np.array_equal(palette, volumes.make_palette(5, 43))
