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
    params = library.load_library()[0]
    assert ifs.accepts(params, 0.15)
    shares = ifs.normalize(ifs.chaos_game(params, 4096, rng(1, "t"))).var(axis=0)
    assert shares.sum() == pytest.approx(1.0)
    assert (shares > 0.15).all()
    # No cloud can give every axis more than 1/3 of the spread.
    assert not ifs.accepts(params, 0.34)


def test_chaos_game_is_deterministic_and_sized():
    params = library.load_library()[1]
    a = ifs.chaos_game(params, 3000, rng(5, "t"))
    b = ifs.chaos_game(params, 3000, rng(5, "t"))
    assert a.shape == (3000, 3) and np.array_equal(a, b)
    assert not np.array_equal(a, ifs.chaos_game(params, 3000, rng(6, "t")))


def test_shipped_library_regenerates_identically(capsys):
    text = library.repository_library_path().read_text(encoding="utf-8")
    header = [line for line in text.splitlines() if line.startswith("# Regenerate:")]
    assert header and "--search 64 --seed 0" in header[0]
    assert library.main(["--search", "64", "--seed", "0"]) == 0
    assert capsys.readouterr().out == text
    assert len(library.parse_library(text)) >= 50


def test_library_round_trips_exactly():
    shipped = library.load_library()
    again = library.parse_library(library.format_library(shipped, 0, 0.15, 99))
    assert again.tobytes() == shipped.tobytes()


def test_missing_library_is_regenerated_deterministically(monkeypatch):
    shipped = library.load_library()
    monkeypatch.setattr(library, "_library_text", lambda: None)
    assert np.array_equal(library.load_library(), shipped)


def test_classes_for_rejects_impossible_thresholds():
    with pytest.raises(ConfigError, match=r"^data.variance_threshold=0.34: expected a number in \(0, 1/3\)"):
        library.classes_for(3, 0.34)


def test_classes_for_other_thresholds_is_a_prefix_of_the_same_search():
    assert np.array_equal(library.classes_for(5, 0.15), library.load_library()[:5])
    stricter = library.classes_for(4, 0.25)
    assert np.array_equal(stricter, ifs.search_classes(4, 0, 0.25))
    assert np.array_equal(ifs.search_classes(2, 0, 0.25), stricter[:2])


def test_bad_library_line_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"fractal_classes.txt:2: expected 24 numbers, found 3"):
        library.parse_library("# header\n1 2 3\n")
