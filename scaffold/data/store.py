"""The HDF5 dataset: one file per data-defining config, generated once and reused.

Layout: `train/masks`, `val/masks` (uint8 (n, E, E, E), one volume per gzip-compressed chunk),
`palette` (float32 (n_classes, 3), background row 0), `class_counts` (int64 voxel count per label over
the training split, for the loss weights) and attributes `format_version`, `package_version`,
`created` (UTC ISO time), `config` (the data-defining config as JSON) and `complete`, written last.

Only masks are stored: the network input is palette[mask], built on the device (see loader.py).

The file is written under a temporary name in the destination folder and renamed with os.replace, so a
crash never leaves a torn dataset under the real name. A file that exists but is not a complete
dataset of the expected config is reported in one warning line and regenerated.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from .. import __version__
from ..files import atomic_path
from ..config import ConfigError, validate_data
from .generate import iter_volumes, resolve_workers
from .library import classes_digest, classes_for
from .volumes import Plan, make_palette, plan_dataset

FORMAT_VERSION = 1
SPLITS = ("train", "val")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset file holds, read without loading the masks."""
    path: pathlib.Path
    edge: int
    n_classes: int
    """Labels including background (= n_categories + 1)."""
    n_train: int
    n_val: int
    palette: np.ndarray
    """float32 (n_classes, 3): the input colour of each label."""
    class_counts: np.ndarray
    """int64 (n_classes,): voxels per label over the training split."""
    provenance: dict


def data_key(data_cfg: Any, scale: int, seed: int, classes: np.ndarray) -> dict:
    """The data-defining config: everything the bytes of a dataset depend on."""
    return {
        "scale": int(scale),
        "seed": int(seed),
        "n_categories": int(data_cfg.n_categories),
        "n_instances": int(data_cfg.n_instances),
        "fractals_per_volume": int(data_cfg.fractals_per_volume),
        "val_fraction": float(data_cfg.val_fraction),
        "variance_threshold": float(data_cfg.variance_threshold),
        "format_version": FORMAT_VERSION,
        "library_sha256": classes_digest(classes),
    }


def _classes(data_cfg: Any) -> np.ndarray:
    return classes_for(int(data_cfg.n_categories), float(data_cfg.variance_threshold))


def _file_name(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
    return f"fractals-s{key['scale']}-{digest[:12]}.h5"


def dataset_path(data_cfg: Any, scale: int, seed: int) -> pathlib.Path:
    """Where the dataset of this config lives (whether or not it exists yet)."""
    validate_data(data_cfg, scale)
    key = data_key(data_cfg, scale, seed, _classes(data_cfg))
    return pathlib.Path(str(data_cfg.cache_dir)) / _file_name(key)


def _ensure_writable(folder: pathlib.Path) -> None:
    """Create the folder and prove a file can be written there, or raise a one-line ConfigError."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as err:
        raise ConfigError(f"data.cache_dir={str(folder)!r}: cannot write there "
                          f"({err.strerror or type(err).__name__})") from None


def _problem(path: pathlib.Path, key: dict | None) -> str | None:
    """Why `path` is not a usable dataset (for `key`, if given), or None when it is."""
    try:
        with h5py.File(path, "r") as f:
            complete = f.attrs.get("complete", False)
            if not (isinstance(complete, (bool, np.bool_)) and complete):
                return "incomplete (no complete flag)"
            version = int(f.attrs.get("format_version", -1))
            if version != FORMAT_VERSION:
                return f"format version {version}, expected {FORMAT_VERSION}"
            stored = json.loads(f.attrs["config"])
            if key is not None and stored != key:
                return "written for a different config"
            edge, n_classes = 2 ** stored["scale"], stored["n_categories"] + 1
            for split in SPLITS:
                masks = f.get(f"{split}/masks")
                if not isinstance(masks, h5py.Dataset) or masks.dtype != np.uint8 \
                        or masks.ndim != 4 or masks.shape[1:] != (edge,) * 3 or masks.shape[0] < 1:
                    return f"dataset {split}/masks missing or not uint8 (n, {edge}, {edge}, {edge})"
            for name, shape, dtype in (("palette", (n_classes, 3), np.float32),
                                       ("class_counts", (n_classes,), np.int64)):
                found = f.get(name)
                if not isinstance(found, h5py.Dataset) or found.shape != shape or found.dtype != dtype:
                    return f"dataset {name} missing or not {np.dtype(dtype).name} {shape}"
    except Exception as err:  # h5py raises OSError, KeyError, ValueError... for damaged files
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        return f"unreadable ({first_line})"
    return None


def _write(path: pathlib.Path, plan: Plan, key: dict, workers: int, progress: bool) -> None:
    """Generate the dataset into a temporary file next to `path`, then rename it into place."""
    edge, n_classes = plan.edge, len(plan.classes) + 1
    sizes = {"train": plan.n_train, "val": plan.n_val}
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["package_version"] = __version__
        f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        f.attrs["config"] = json.dumps(key, sort_keys=True)
        masks = {split: f.create_dataset(f"{split}/masks", shape=(n, edge, edge, edge),
                                         dtype=np.uint8, chunks=(1, edge, edge, edge),
                                         compression="gzip", compression_opts=4)
                 for split, n in sizes.items()}
        counts = np.zeros(n_classes, dtype=np.int64)
        for index, volume in enumerate(iter_volumes(plan, workers, progress)):
            split, row = ("train", index) if index < plan.n_train else ("val", index - plan.n_train)
            # The workers already deflated the chunk exactly as the gzip filter would store it.
            masks[split].id.write_direct_chunk((row, 0, 0, 0), volume.chunk)
            if split == "train":
                counts += volume.counts
        f.create_dataset("palette", data=make_palette(len(plan.classes), plan.seed))
        f.create_dataset("class_counts", data=counts)
        f.attrs["complete"] = True


def prepare(data_cfg: Any, scale: int, seed: int, progress: bool = True) -> pathlib.Path:
    """The dataset file for this config: reused when present and valid, generated otherwise."""
    validate_data(data_cfg, scale)
    classes = _classes(data_cfg)
    key = data_key(data_cfg, scale, seed, classes)
    plan = plan_dataset(data_cfg, scale, seed, classes)
    path = pathlib.Path(str(data_cfg.cache_dir)) / _file_name(key)
    _ensure_writable(path.parent)
    if path.exists():
        problem = _problem(path, key)
        if problem is None:
            return path
        log.warning("dataset %s is %s; regenerating it", path, problem)
    workers = resolve_workers(int(data_cfg.workers), len(plan.volumes))
    log.info("generating %s: %d volumes of %d³ with %d worker(s)", path, len(plan.volumes), plan.edge,
             workers)
    _write(path, plan, key, workers, progress)
    return path


def read_info(path: os.PathLike | str) -> DatasetInfo:
    """A dataset file's shapes, palette, class counts and provenance (masks stay on disk)."""
    path = pathlib.Path(path)
    problem = _problem(path, None)
    if problem is not None:
        raise ValueError(f"{path}: not a usable scaffold dataset: {problem}")
    with h5py.File(path, "r") as f:
        config = json.loads(f.attrs["config"])
        provenance = {"config": config, "format_version": int(f.attrs["format_version"]),
                      "package_version": str(f.attrs["package_version"]),
                      "created": str(f.attrs["created"])}
        return DatasetInfo(path=path, edge=int(f["train/masks"].shape[1]),
                           n_classes=int(f["palette"].shape[0]), n_train=int(f["train/masks"].shape[0]),
                           n_val=int(f["val/masks"].shape[0]),
                           palette=np.asarray(f["palette"][...], dtype=np.float32),
                           class_counts=np.asarray(f["class_counts"][...], dtype=np.int64),
                           provenance=provenance)


def load_masks(path: os.PathLike | str, split: str) -> np.ndarray:
    """A whole split's masks in memory: uint8 (n, E, E, E)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    with h5py.File(path, "r") as f:
        return f[f"{split}/masks"][...]
