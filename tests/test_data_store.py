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
SMALL_SHA256 = "7f494d4e53ffe2de8172ad40f596c81c62f510120ffa0edf901ee70c85778c36"  # the upstream sampler
# The same dataset under the earlier chains sampler: the bytes (and the cache file name) it had before
# upstream's sampler became the default, recorded then (data.sampler=chains keeps old datasets
# reproducible and keeps finding their cached files).
SMALL_SHA256_CHAINS = "4ad63a4f6b7238698e959906113dfc34f988612e6f91d8faa00e165bf405af2d"
SMALL_NAME_CHAINS = "fractals-s3-095c790f0498.h5"
# And under the earlier class rule too: the bytes it had before upstream's rule became the default
# (data.class_rule=rms data.sampler=chains).
SMALL_SHA256_RMS = "fe5b3ca78bca99a0cdbc782ddfc9086f8e5337ceeae8a51cc2cd9beeb45c62fe"
SMALL_NAME_RMS = "fractals-s3-d08ff36fcb3b.h5"


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


def test_the_chains_sampler_reproduces_its_old_datasets_and_file_names(tmp_path):
    path = store.prepare(small_cfg(tmp_path, sampler="chains"), SCALE, SEED, progress=False)
    assert digest(contents(path)) == SMALL_SHA256_CHAINS and path.name == SMALL_NAME_CHAINS
    assert "sampler" not in json.loads(h5py.File(path, "r").attrs["config"])  # the old key, unchanged
    default = store.dataset_path(small_cfg(tmp_path), SCALE, SEED)
    assert default.name != SMALL_NAME_CHAINS  # the two samplers never share a file
    provenance = json.loads(h5py.File(store.prepare(small_cfg(tmp_path), SCALE, SEED, progress=False),
                                      "r").attrs["config"])
    assert (provenance["sampler"], provenance["class_scale"]) == ("upstream", 7)


def test_the_earlier_class_rule_reproduces_its_old_datasets(tmp_path):
    path = store.prepare(small_cfg(tmp_path, class_rule="rms", sampler="chains"), SCALE, SEED, progress=False)
    assert digest(contents(path)) == SMALL_SHA256_RMS and path.name == SMALL_NAME_RMS
    assert json.loads(h5py.File(path, "r").attrs["config"])["class_rule"] == "rms"  # its provenance


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
    assert store.dataset_path(small_cfg(tmp_path, class_scale=6), SCALE, SEED) != base
    assert store.dataset_path(small_cfg(tmp_path, sampler="chains"), SCALE, SEED) != base


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
    ({"n_categories": 256}, SCALE, "data.n_categories"),  # label 256 would wrap to background in uint8
    ({}, 0, "scale"),
    ({"variance_threshold": 0.0}, SCALE, "data.variance_threshold"),
    ({"variance_threshold": 1.0}, SCALE, "data.variance_threshold"),
    ({"variance_threshold": 0.4, "class_rule": "rms"}, SCALE, "data.variance_threshold"),
    ({"n_categories": 1, "n_instances": 3}, SCALE, "data.n_instances"),
    ({"sampler": "serial"}, SCALE, "data.sampler"),
    ({"class_scale": 10}, SCALE, "data.class_scale"),
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


def test_datasets_describe_themselves(small):
    _, path = small
    with h5py.File(path, "r") as f:
        assert "input = palette[mask]" in f.attrs["description"]
        for split in store.SPLITS:
            attrs = f[f"{split}/masks"].attrs
            assert list(attrs["labels"]) == [0, 1, 2, 3]
            assert list(attrs["class_names"]) == ["background", "fractal class 1", "fractal class 2",
                                                  "fractal class 3"]
            assert attrs["label_meaning"].startswith("0 = background, k = 1..3 = fractal class k")
            assert attrs["layout"].startswith("N, D, H, W") and attrs["units"].startswith("voxels; edge 8")
            assert "uint8" in attrs["dtype_meaning"] and split in attrs["description"]
        palette = f["palette"].attrs
        assert palette["description"] == "RGB colour per label, input = palette[mask]"
        assert palette["input_rule"].startswith("input = palette[mask]")
        assert "voxels per label" in f["class_counts"].attrs["description"]
        assert f["class_counts"].attrs["units"] == "voxels"


def test_cache_dir_default_is_per_user_and_overridable(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SCAFFOLD_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert store.cache_dir("auto") == home / ".cache" / "scaffold"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: relative values are ignored
    assert store.cache_dir("auto") == home / ".cache" / "scaffold"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.cache_dir("auto") == tmp_path / "xdg" / "scaffold"
    monkeypatch.setenv("SCAFFOLD_CACHE", str(tmp_path / "mine"))
    assert store.cache_dir("auto") == tmp_path / "mine"
    assert store.cache_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"  # data.cache_dir wins
    assert store.cache_dir("~/data") == home / "data"
    assert DataConfig().cache_dir == "auto"


def test_unwritable_default_cache_names_its_source(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SCAFFOLD_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(store, "_write", lambda *a, **k: pytest.fail("started generating"))
    with pytest.raises(ConfigError, match=r"^SCAFFOLD_CACHE=.*a-file/cache.*cannot write"):
        store.prepare(DataConfig(**SMALL), SCALE, SEED, progress=False)


def test_two_working_directories_share_one_dataset_cache(tmp_path):
    """The default cache does not depend on the working directory: the second directory reuses the
    first one's file (generated once) and neither gets a cache of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SCAFFOLD_CACHE": str(tmp_path / "cache"),
           "HOME": str(tmp_path / "home")}
    args = [sys.executable, "-m", "scaffold.data", f"scale={SCALE}", f"seed={SEED}", "data.n_categories=3",
            "data.n_instances=12", "data.workers=1"]
    seen = []
    for name in ("first", "second"):
        cwd = tmp_path / name
        cwd.mkdir()
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert list(cwd.iterdir()) == []
        path = pathlib.Path(done.stdout.split()[1])  # "dataset   <path>"
        assert path.parent == tmp_path / "cache"
        seen.append((path, path.stat().st_ino, path.stat().st_mtime_ns))
    assert seen[0] == seen[1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [seen[0][0].name]
    assert not (tmp_path / "home").exists()


# Holds each process at the start of generation until the other is there too, so that both have
# missed the cache and both write and rename the file.
RACER = """
import os, pathlib, sys, time
from scaffold.config import DataConfig
from scaffold.data import store

cache, gate = sys.argv[1], pathlib.Path(sys.argv[2])
real = store.iter_volumes

def gated(*args, **kwargs):
    (gate / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(gate.iterdir())) < 2:
        if time.monotonic() > deadline:
            sys.exit("the other process never started generating")
        time.sleep(0.01)
    yield from real(*args, **kwargs)

store.iter_volumes = gated
print(store.prepare(DataConfig(cache_dir=cache, workers=1, n_categories=3, n_instances=12), 3, 5,
                    progress=False))
"""


def test_concurrent_generation_of_one_dataset_both_succeed(tmp_path):
    cache, gate = tmp_path / "cache", tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(cache), str(gate)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert len(list(gate.iterdir())) == 2  # both really generated
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    path = pathlib.Path(paths.pop())
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left behind
    assert store.read_info(path).n_train == 8
    assert digest(contents(path)) == SMALL_SHA256


def test_a_split_of_thousands_of_volumes_keeps_its_checksums(tmp_path, monkeypatch):
    """Per-volume checksums live in a dataset: as an attribute (HDF5 caps one at 64 KiB) a split of more
    than about 1,000 volumes could not be written. Trivial 2³ volumes stand in for rendered ones."""
    import zlib

    from scaffold.data.volumes import Plan

    edge, n = 2, 1500
    zeros = zlib.compress(bytes(edge ** 3), 4)
    monkeypatch.setattr(store, "iter_volumes", lambda plan, workers, progress: (
        generate.RenderedVolume(zeros, np.array([edge ** 3, 0])) for _ in range(n)))
    plan = Plan(edge=edge, seed=0, classes=np.zeros((1, 2, 12)), volumes=np.zeros((n, 1, 2), np.int64), n_val=100)
    path = tmp_path / "big.h5"
    store._write(path, plan, {"scale": 1, "n_categories": 1}, workers=1, progress=False)
    assert store._problem(path, None) is None
    assert store.load_masks(path, "train").shape == (n - 100, edge, edge, edge)
    with h5py.File(path, "r+") as f:  # a flipped checksum is still caught
        f["train/sha256"][7] = b"0" * 64
    with pytest.raises(store.DatasetCorrupt, match="train mask 7 fails its checksum"):
        store.load_masks(path, "train")


def test_files_with_checksums_in_an_attribute_still_read(small):
    """Files written before the checksums moved to a dataset kept them in the masks' attribute."""
    _, path = small
    before = contents(path)
    with h5py.File(path, "r+") as f:
        for split in ("train", "val"):
            hashes = f[f"{split}/sha256"][...]
            del f[f"{split}/sha256"]
            f[f"{split}/masks"].attrs["sha256"] = hashes
    assert store._problem(path, None) is None
    assert np.array_equal(store.load_masks(path, "train"), before["train/masks"])
