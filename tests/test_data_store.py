"""The HDF5 store: generation, determinism across worker counts, reuse, corruption, bad input, CLI."""
import hashlib
import json
import logging
import os
import pathlib
import subprocess
import sys

import h5py
import numpy as np
import pytest

from scaffold.config import ConfigError, DataConfig
from scaffold.data import generate, store

REPO = pathlib.Path(__file__).resolve().parents[1]
SMALL = dict(n_categories=3, n_instances=12)  # 36 instances -> 12 volumes: 8 train, 4 val
SCALE, SEED = 3, 5

# Regression guard: sha256 of train masks + val masks + palette + class_counts of the SMALL dataset.
# It changes only when the generator's output changes. If that is deliberate, bump
# store.FORMAT_VERSION (old caches must not be reused) and record the new value printed by the failure.
SMALL_SHA256 = "fe5b3ca78bca99a0cdbc782ddfc9086f8e5337ceeae8a51cc2cd9beeb45c62fe"


def small_cfg(tmp_path, **changes):
    return DataConfig(**{"cache_dir": str(tmp_path / "cache"), "workers": 1, **SMALL, **changes})


def contents(path):
    with h5py.File(path, "r") as f:
        return {name: f[name][...] for name in ("train/masks", "val/masks", "palette", "class_counts")}


def digest(arrays):
    h = hashlib.sha256()
    for name in ("train/masks", "val/masks", "palette", "class_counts"):
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


@pytest.fixture
def small(tmp_path):
    cfg = small_cfg(tmp_path)
    return cfg, store.prepare(cfg, SCALE, SEED, progress=False)


def test_small_dataset_layout_and_info(small):
    cfg, path = small
    assert path.parent == pathlib.Path(cfg.cache_dir) and path.name.startswith("fractals-s3-")
    info = store.read_info(path)
    assert (info.edge, info.n_classes, info.n_train, info.n_val) == (8, 4, 8, 4)
    assert info.palette.dtype == np.float32 and info.palette.shape == (4, 3)
    train = store.load_masks(path, "train")
    assert train.dtype == np.uint8 and train.shape == (8, 8, 8, 8)
    assert np.array_equal(info.class_counts, np.bincount(train.ravel(), minlength=4))
    assert info.provenance["config"]["seed"] == SEED and info.provenance["created"].endswith("+00:00")
    with h5py.File(path, "r") as f:
        assert f["train/masks"].chunks == (1, 8, 8, 8) and f["train/masks"].compression == "gzip"
    with pytest.raises(ValueError, match="split='test'"):
        store.load_masks(path, "test")


def test_recorded_checksum(small):
    assert digest(contents(small[1])) == SMALL_SHA256


def test_one_and_two_workers_give_the_same_bytes(tmp_path):
    one = store.prepare(small_cfg(tmp_path / "a", workers=1), SCALE, SEED, progress=False)
    two = store.prepare(small_cfg(tmp_path / "b", workers=2), SCALE, SEED, progress=False)
    a, b = contents(one), contents(two)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_path_depends_on_what_defines_the_data(tmp_path):
    cfg = small_cfg(tmp_path)
    base = store.dataset_path(cfg, SCALE, SEED)
    assert store.dataset_path(small_cfg(tmp_path, workers=2), SCALE, SEED) == base
    assert store.dataset_path(cfg, SCALE, SEED + 1) != base
    assert store.dataset_path(cfg, SCALE + 1, SEED).name.startswith("fractals-s4-")
    assert store.dataset_path(small_cfg(tmp_path, variance_threshold=0.2), SCALE, SEED) != base


def test_second_prepare_reuses_the_file(small, monkeypatch):
    cfg, path = small
    before = path.stat().st_mtime_ns
    monkeypatch.setattr(store, "_write", lambda *a, **k: pytest.fail("regenerated a valid dataset"))
    assert store.prepare(cfg, SCALE, SEED, progress=False) == path
    assert path.stat().st_mtime_ns == before


def truncate(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def garbage(path):
    path.write_bytes(b"this is not an HDF5 file\n" * 10)


def drop_complete_flag(path):
    with h5py.File(path, "a") as f:
        del f.attrs["complete"]


@pytest.mark.parametrize("damage", [truncate, garbage, drop_complete_flag])
def test_damaged_file_warns_once_and_is_regenerated(small, damage, caplog):
    cfg, path = small
    original = contents(path)
    damage(path)
    with caplog.at_level(logging.WARNING, logger="scaffold.data.store"):
        assert store.prepare(cfg, SCALE, SEED, progress=False) == path
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    assert digest(contents(path)) == digest(original)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left


def test_crash_during_generation_leaves_nothing(tmp_path, monkeypatch):
    def exploding(plan, workers, progress):
        yield from []
        raise RuntimeError("worker died")

    monkeypatch.setattr(store, "iter_volumes", exploding)
    cfg = small_cfg(tmp_path)
    with pytest.raises(RuntimeError, match="worker died"):
        store.prepare(cfg, SCALE, SEED, progress=False)
    assert list(pathlib.Path(cfg.cache_dir).iterdir()) == []


@pytest.mark.parametrize("changes, scale, key", [
    ({"n_categories": 0}, SCALE, "data.n_categories"),
    ({}, 0, "scale"),
    ({"variance_threshold": 0.0}, SCALE, "data.variance_threshold"),
    ({"variance_threshold": 0.4}, SCALE, "data.variance_threshold"),
    ({"n_categories": 1, "n_instances": 3}, SCALE, "data.n_instances"),
])
def test_bad_config_fails_before_any_work(tmp_path, monkeypatch, changes, scale, key):
    monkeypatch.setattr(store, "_write", lambda *a, **k: pytest.fail("started generating"))
    with pytest.raises(ConfigError) as err:
        store.prepare(small_cfg(tmp_path, **changes), scale, SEED, progress=False)
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message


def test_unwritable_cache_dir_is_a_one_line_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(store, "_write", lambda *a, **k: pytest.fail("started generating"))
    cfg = DataConfig(cache_dir=str(blocker / "cache"), **SMALL)
    with pytest.raises(ConfigError, match=r"^data.cache_dir=.*a-file/cache.*cannot write") as err:
        store.prepare(cfg, SCALE, SEED, progress=False)
    assert "\n" not in str(err.value)


def run_cli(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "scaffold.data", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_command_line_generates_and_describes(tmp_path):
    done = run_cli(tmp_path, f"scale={SCALE}", f"seed={SEED}", "data.cache_dir=cache",
                   "data.n_categories=3", "data.n_instances=12", "data.workers=1")
    assert done.returncode == 0, done.stderr
    path = store.dataset_path(small_cfg(tmp_path), SCALE, SEED)
    assert f"cache/{path.name}" in done.stdout and "8 train / 4 val" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no outputs/, logs or .hydra/


def test_command_line_config_error_is_one_line(tmp_path):
    done = run_cli(tmp_path, "data.n_categories=0", "data.cache_dir=cache")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: data.n_categories=0: expected a positive integer"]


def test_workers_zero_means_one_per_core():
    assert generate.resolve_workers(0, 1000) == (os.cpu_count() or 1)
    assert generate.resolve_workers(8, 3) == 3


def test_file_of_another_format_version_is_regenerated(small, caplog):
    cfg, path = small
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = store.FORMAT_VERSION + 1
    with caplog.at_level(logging.WARNING, logger="scaffold.data.store"):
        store.prepare(cfg, SCALE, SEED, progress=False)
    assert "format version" in caplog.text
    assert store.read_info(path).provenance["format_version"] == store.FORMAT_VERSION


def test_datagen_benchmark_writes_json(tmp_path, capsys):
    from scaffold.bench import datagen

    out = tmp_path / "bench" / "datagen.json"
    assert datagen.main(["--scale", "3", "--reps", "1", "--workers", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["volumes"] == 240 and result["edge"] == 8 and len(result["seconds"]) == 1
    assert "median s" in capsys.readouterr().out
