"""Fractal classes: the acceptance rule, the chaos game, and the shipped library."""
import math

import numpy as np
import pytest

from scaffold.config import ConfigError
from scaffold.data import ifs, library
from scaffold.data.seeds import rng


def two_maps(a0, b0, a1, b1):
    return np.concatenate([np.ravel(a0), b0, np.ravel(a1), b1]).reshape(2, 12)


def test_map_probabilities_follow_determinants():
    params = two_maps(np.diag([0.5, 0.5, 0.5]), [0, 0, 0], np.diag([0.5, 0.5, 0.25]), [1, 0, 0])
    assert np.allclose(ifs.map_probabilities(params), [2 / 3, 1 / 3])


def test_lyapunov_exponent_of_uniform_scaling_is_its_log():
    params = two_maps(0.5 * np.eye(3), [0, 0, 0], 0.5 * np.eye(3), [1, 1, 1])
    assert ifs.lyapunov_exponent(params, rng(0, "t")) == pytest.approx(math.log(0.5), abs=1e-12)


def test_plane_and_line_attractors_are_rejected():
    plane = two_maps(np.diag([0.5, 0.5, 0.0]), [0.5, 0, 0], np.diag([0.5, 0.5, 0.0]), [-0.5, 0.5, 0])
    line = two_maps(np.diag([0.5, 0.0, 0.0]), [0.5, 0, 0], np.diag([0.5, 0.0, 0.0]), [-0.5, 0, 0])
    for params in (plane, line):
        assert not ifs.accepts(params, 0.15)
        assert not ifs.is_spread(ifs.chaos_game(params, 2048, rng(0, "t")), 0.15)


def test_expanding_system_is_rejected_as_not_contracting():
    expanding = two_maps(1.5 * np.eye(3), [0.1, 0, 0], -1.5 * np.eye(3), [0, 0.1, 0])
    assert not ifs.contracting(expanding, rng(0, "t"))
    assert not ifs.accepts(expanding, 0.15)


def test_non_finite_points_are_rejected():
    points = rng(0, "t").uniform(-1, 1, size=(1000, 3))
    assert ifs.is_spread(points, 0.15)  # a uniform cube: share 1/3 per axis
    for bad in (np.nan, np.inf, 10 * ifs.DIVERGENCE_BOUND):
        broken = points.copy()
        broken[17, 1] = bad
        assert ifs.normalize(broken) is None
        assert not ifs.is_spread(broken, 0.15)


def test_accepted_class_passes_the_threshold_on_every_axis():
    params = library.load_library("rms", "chains")[0]
    assert ifs.accepts(params, 0.15, rule="rms")
    shares = ifs.normalize(ifs.chaos_game(params, 4096, rng(1, "t"))).var(axis=0)
    assert shares.sum() == pytest.approx(1.0)
    assert (shares > 0.15).all()
    # No cloud can give every axis more than 1/3 of the spread.
    assert not ifs.accepts(params, 0.34, rule="rms")


def _upstream_variances(points: np.ndarray) -> np.ndarray:
    """Upstream ScaFFold's rule, written out here on its own: per axis, centre on the mean and scale
    by 2 / (max - min); the per-axis variances."""
    lo, hi = points.min(axis=0), points.max(axis=0)
    return ((points - points.mean(axis=0)) * (2.0 / (hi - lo))).var(axis=0)


def test_every_shipped_chains_class_satisfies_upstreams_acceptance_rule_on_its_cloud():
    classes = library.load_library("upstream", "chains")  # upstream's rule on the earlier sampler
    assert len(classes) == 64
    # Each class's candidate number (its place in the seeded draw), hence the very cloud it was judged on.
    rows = {classes[k].tobytes(): k for k in range(len(classes))}
    judged = {}
    for index in range(100_000):
        k = rows.get(ifs.draw_candidate(0, index).tobytes())
        if k is not None:
            judged[k] = index
        if len(judged) == len(classes):
            break
    assert sorted(judged) == list(range(len(classes)))
    for k, index in judged.items():
        points = ifs.chaos_game(classes[k], ifs.SEARCH_POINTS, rng(0, "class-test", index))
        assert np.isfinite(points).all(), k
        assert (_upstream_variances(points) > 0.15).all(), (k, _upstream_variances(points))
    # The earlier rule's first five classes (the old default data) do not pass it.
    old = library.load_library("rms", "chains")[:5]
    passing = [bool((_upstream_variances(ifs.chaos_game(p, ifs.SEARCH_POINTS, rng(0, "c", k))) > 0.15).all())
               for k, p in enumerate(old)]
    assert not any(passing), passing  # as measured against upstream's code: none of the five passes


@pytest.mark.parametrize("sampler", ["upstream", "chains"])
def test_the_rules_disagree_and_the_guard_is_counted(sampler):
    stats: dict = {}
    ifs.search_classes(8, 0, 0.15, stats, rule="upstream", sampler=sampler)
    assert stats["rule"] == "upstream" and stats["accepted"] == 8 and stats["candidates"] > 8
    assert stats["sampler"] == sampler and "guard_rejected" in stats
    assert ("stability_rejected" in stats) == (sampler == "upstream")


def test_chaos_game_is_deterministic_and_sized():
    params = library.load_library()[1]
    a = ifs.chaos_game(params, 3000, rng(5, "t"))
    b = ifs.chaos_game(params, 3000, rng(5, "t"))
    assert a.shape == (3000, 3) and np.array_equal(a, b)
    assert not np.array_equal(a, ifs.chaos_game(params, 3000, rng(6, "t")))


@pytest.mark.parametrize("rule, sampler", sorted(library.LIBRARY_FILES))
def test_shipped_library_regenerates_identically(capsys, rule, sampler):
    name = library.LIBRARY_FILES[(rule, sampler)]
    text = library.repository_library_path().with_name(name).read_text(encoding="utf-8")
    header = [line for line in text.splitlines() if line.startswith("# Regenerate:")]
    assert header and f"--search 64 --seed 0 --threshold 0.15 --rule {rule} --sampler {sampler}" in header[0]
    assert header[0].endswith(f"> data/{name}")
    assert library.main(["--search", "64", "--seed", "0", "--rule", rule, "--sampler", sampler]) == 0
    assert capsys.readouterr().out == text
    assert len(library.parse_library(text)) == 64


def test_library_round_trips_exactly():
    shipped = library.load_library()
    again = library.parse_library(library.format_library(shipped, 0, 0.15, 99))
    assert again.tobytes() == shipped.tobytes()


def test_missing_library_is_regenerated_deterministically(monkeypatch):
    shipped = library.load_library()
    monkeypatch.setattr(library, "_library_text", lambda *args: None)
    assert np.array_equal(library.load_library(), shipped)


def test_classes_for_rejects_impossible_thresholds():
    with pytest.raises(ConfigError, match=r"^data.variance_threshold=0.34: expected a number in \(0, 1/3\) under "
                                          r"class_rule=rms"):
        library.classes_for(3, 0.34, "rms")
    with pytest.raises(ConfigError, match=r"^data.variance_threshold=1.0: expected a number in \(0, 1\)"):
        library.classes_for(3, 1.0)
    with pytest.raises(ConfigError, match=r"^data.class_rule='mine': expected upstream \| rms"):
        library.classes_for(3, 0.15, "mine")


def test_classes_for_other_thresholds_is_a_prefix_of_the_same_search():
    assert np.array_equal(library.classes_for(5, 0.15), library.load_library()[:5])
    assert np.array_equal(library.classes_for(5, 0.15, "rms", "chains"), library.load_library("rms", "chains")[:5])
    stricter = library.classes_for(4, 0.25, "rms")
    assert np.array_equal(stricter, ifs.search_classes(4, 0, 0.25, rule="rms"))
    assert np.array_equal(ifs.search_classes(2, 0, 0.25, rule="rms"), stricter[:2])


def test_bad_library_line_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"fractal_classes.txt:2: expected 24 numbers, found 3"):
        library.parse_library("# header\n1 2 3\n")
