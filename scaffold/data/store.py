"""The HDF5 dataset: one file per data-defining config, generated once and reused.

Layout: `train/masks`, `val/masks` (uint8 (n, E, E, E), one volume per gzip-compressed chunk),
`palette` (float32 (n_classes, 3), background row 0), `class_counts` (int64 voxel count per label over
the training split, for the loss weights) and attributes `format_version`, `package_version`,
`created` (UTC ISO time), `config` (the data-defining config as JSON) and `complete`, written last.
Every dataset also says what it holds in its own attributes (`description`, `layout`, `units`; the masks
their `labels` and `class_names`, the palette its `input_rule`), so `h5ls -v` (names), `h5dump -A`
(values) or h5py explain the file without this code. They are descriptive only: readers never need them, and files written before them
are still valid (FORMAT_VERSION and the cache key are unchanged).

Only masks are stored: the network input is palette[mask], built on the device (see loader.py).

Where: `cache_dir(data_cfg.cache_dir)`. An explicit `data.cache_dir` wins; the default (`auto`) is one
cache per user, shared by every working directory: `$SCAFFOLD_CACHE` if set, else
`$XDG_CACHE_HOME/scaffold`, else `~/.cache/scaffold`.

Verified contents (format 2): each split has a `sha256` dataset beside its masks, one SHA-256 per volume
of its stored chunk (the zlib stream as it lies in the file; files written before kept them in the
masks' `sha256` attribute, which HDF5 caps at 64 KiB, about 1,000 volumes, and are still read), and the palette and class counts a `sha256` of their
bytes. Loading reads each volume's chunk as stored, checks its hash and inflates it itself, so the bytes
trained on are the bytes verified, and a flipped byte, a rewritten mask or a damaged gzip chunk is one
line and a regenerated file (`load`), never a traceback or silent training on altered data. (HDF5's own
Fletcher-32 filter would catch a flipped byte but not a mask rewritten through h5py, which recomputes
it.) Files of format 1 carry no hashes: they are regenerated, said in one line.

The file is written under a temporary name in the destination folder and renamed with os.replace, so a
crash never leaves a torn dataset under the real name. A file that exists but is not a complete
dataset of the expected config is reported in one warning line and regenerated. Concurrent runs that
miss the same dataset each generate it under their own temporary name; the renames are atomic and the
files identical (but for their `created` time), so every reader opens a complete dataset and a
reader that already has the file open keeps its copy.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import pathlib
import tempfile
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import h5py
import numpy as np

from .. import __version__
from ..files import atomic_path
from ..config import ConfigError, validate_data
from .generate import iter_volumes, resolve_workers
from .library import classes_digest, classes_for
from .volumes import Plan, make_palette, plan_dataset

FORMAT_VERSION = 2  # 2: per-volume SHA-256 of the stored chunks, and of the palette and class counts
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
    """The data-defining config: everything the bytes of a dataset depend on. The sampler and class
    scale enter only when the sampler is not `chains`, so the earlier sampler's datasets keep their
    keys (and cached files)."""
    key = {
        "scale": int(scale),
        "seed": int(seed),
        "n_categories": int(data_cfg.n_categories),
        "n_instances": int(data_cfg.n_instances),
        "fractals_per_volume": int(data_cfg.fractals_per_volume),
        "val_fraction": float(data_cfg.val_fraction),
        "variance_threshold": float(data_cfg.variance_threshold),
        "class_rule": str(getattr(data_cfg, "class_rule", "upstream")),
        "format_version": FORMAT_VERSION,
        "library_sha256": classes_digest(classes),
    }
    sampler = str(getattr(data_cfg, "sampler", "upstream"))
    if sampler != "chains":
        key["sampler"] = sampler
        key["class_scale"] = int(getattr(data_cfg, "class_scale", 7))
    return key


def _classes(data_cfg: Any) -> np.ndarray:
    return classes_for(int(data_cfg.n_categories), float(data_cfg.variance_threshold),
                       str(getattr(data_cfg, "class_rule", "upstream")),
                       str(getattr(data_cfg, "sampler", "upstream")), int(getattr(data_cfg, "class_scale", 7)))


def _file_name(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
    return f"fractals-s{key['scale']}-{digest[:12]}.h5"


AUTO_CACHE = "auto"  # data.cache_dir's default: the per-user cache below
CACHE_ENV = "SCAFFOLD_CACHE"


def cache_location(setting: Any) -> tuple[pathlib.Path, str]:
    """The dataset folder for a `data.cache_dir` value, and what chose it (for error messages).

    An explicit folder wins (relative to the working directory; `./auto` names a folder called auto).
    `auto` is one cache per user, so runs started from different directories share their datasets:
    $SCAFFOLD_CACHE, else $XDG_CACHE_HOME/scaffold, else ~/.cache/scaffold."""
    setting = str(setting)
    if setting != AUTO_CACHE:
        return pathlib.Path(setting).expanduser(), "data.cache_dir"
    env = os.environ.get(CACHE_ENV, "")
    if env:
        return pathlib.Path(env).expanduser(), CACHE_ENV
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = pathlib.Path(xdg) if xdg and os.path.isabs(xdg) else pathlib.Path.home() / ".cache"
    return base / "scaffold", "data.cache_dir"


def cache_dir(setting: Any) -> pathlib.Path:
    """The dataset folder for a `data.cache_dir` value (see cache_location)."""
    return cache_location(setting)[0]


def dataset_path(data_cfg: Any, scale: int, seed: int) -> pathlib.Path:
    """Where the dataset of this config lives (whether or not it exists yet)."""
    validate_data(data_cfg, scale)
    key = data_key(data_cfg, scale, seed, _classes(data_cfg))
    return cache_dir(data_cfg.cache_dir) / _file_name(key)


def _ensure_writable(folder: pathlib.Path, source: str = "data.cache_dir") -> None:
    """Create the folder and prove a file can be written there, or raise a one-line ConfigError."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as err:
        raise ConfigError(f"{source}={str(folder)!r}: cannot write there "
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
                if len(_volume_hashes(f, split)) != masks.shape[0]:
                    return f"dataset {split}/masks has no checksum per volume"
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
        hashes = {split: [""] * n for split, n in sizes.items()}
        for index, volume in enumerate(iter_volumes(plan, workers, progress)):
            split, row = ("train", index) if index < plan.n_train else ("val", index - plan.n_train)
            # The workers already deflated the chunk exactly as the gzip filter would store it.
            masks[split].id.write_direct_chunk((row, 0, 0, 0), volume.chunk)
            hashes[split][row] = _sha256(volume.chunk)
            if split == "train":
                counts += volume.counts
        for split in masks:  # a dataset, not an attribute: HDF5 caps an attribute at 64 KiB (~1,000 hashes)
            digests = f.create_dataset(f"{split}/sha256", data=np.array(hashes[split], dtype="S64"))
            digests.attrs["description"] = (f"SHA-256 (hex) of each {split} mask's stored chunk, the zlib "
                                            "stream as it lies in the file; checked on every read")
        palette = f.create_dataset("palette", data=make_palette(len(plan.classes), plan.seed))
        class_counts = f.create_dataset("class_counts", data=counts)
        for dataset in (palette, class_counts):
            dataset.attrs["sha256"] = _sha256(np.ascontiguousarray(dataset[...]).tobytes())
        _describe(f, masks, palette, class_counts, edge, int(key["scale"]))
        f.attrs["complete"] = True


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class DatasetCorrupt(ValueError):
    """Stored contents that fail their checksum; the message is one line naming the file and what."""


def class_names(n_categories: int) -> list[str]:
    """Label k's name: background for 0, then the classes in library order."""
    return ["background"] + [f"fractal class {k}" for k in range(1, n_categories + 1)]


def _describe(f: h5py.File, masks: dict, palette: h5py.Dataset, class_counts: h5py.Dataset, edge: int,
              scale: int) -> None:
    """Attributes that say what each dataset holds, for readers of the file without this package."""
    n_classes = palette.shape[0]
    names = class_names(n_classes - 1)
    f.attrs["description"] = ("scaffold fractal segmentation dataset: label masks per split, the RGB "
                              "palette that makes the network input (input = palette[mask]), and the "
                              "training split's voxel count per label")
    for split, dataset in masks.items():
        dataset.attrs["description"] = f"{split} split: one label mask per volume"
        dataset.attrs["labels"] = np.arange(n_classes, dtype=np.uint8)
        dataset.attrs["class_names"] = names
        dataset.attrs["label_meaning"] = (f"0 = background, k = 1..{n_classes - 1} = fractal class k "
                                          "(row k-1 of the class library; later fractals overwrite earlier)")
        dataset.attrs["dtype_meaning"] = "uint8 label per voxel (a class index, not an intensity)"
        dataset.attrs["layout"] = "N, D, H, W (volume, depth, height, width)"
        dataset.attrs["units"] = f"voxels; edge {edge} = 2^scale, scale {scale}"
    palette.attrs["description"] = "RGB colour per label, input = palette[mask]"
    palette.attrs["input_rule"] = ("input = palette[mask]: each voxel's label picks its RGB row, giving the "
                                   "network's 3-channel input; row 0 (background) is black")
    palette.attrs["layout"] = "label, channel (R, G, B)"
    palette.attrs["units"] = "colour intensity in [0, 1)"
    palette.attrs["class_names"] = names
    class_counts.attrs["description"] = ("voxels per label over the training split "
                                         "(the loss's class weights come from these)")
    class_counts.attrs["layout"] = "label"
    class_counts.attrs["units"] = "voxels"
    class_counts.attrs["class_names"] = names


def prepare(data_cfg: Any, scale: int, seed: int, progress: bool = True,
            regenerate: str | None = None) -> pathlib.Path:
    """The dataset file for this config: reused when present and valid, generated otherwise (or when
    `regenerate` says why the present one must go). A folder that holds a valid dataset is only read,
    so a read-only cache serves; it must be writable only when a file has to be generated."""
    validate_data(data_cfg, scale)
    classes = _classes(data_cfg)
    key = data_key(data_cfg, scale, seed, classes)
    plan = plan_dataset(data_cfg, scale, seed, classes)
    folder, source = cache_location(data_cfg.cache_dir)
    path = folder / _file_name(key)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{source}={str(folder)!r}: not a folder")
    if path.exists():
        problem = regenerate or _problem(path, key)
        if problem is None:
            return path
        log.warning("dataset %s: %s; regenerating it", path, problem)
    _ensure_writable(folder, source)
    workers = resolve_workers(int(data_cfg.workers), len(plan.volumes))
    log.info("generating %s: %d volumes of %d³ with %d worker(s)", path, len(plan.volumes), plan.edge,
             workers)
    _write(path, plan, key, workers, progress)
    return path


def read_info(path: os.PathLike | str) -> DatasetInfo:
    """A dataset file's shapes, palette, class counts and provenance (masks stay on disk); the palette
    and the counts are verified against their checksums (DatasetCorrupt)."""
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
                           palette=_verified(path, f, "palette", np.float32),
                           class_counts=_verified(path, f, "class_counts", np.int64),
                           provenance=provenance)


def _verified(path: pathlib.Path, f: h5py.File, name: str, dtype) -> np.ndarray:
    try:
        data = np.ascontiguousarray(f[name][...], dtype=dtype)
    except OSError as err:
        raise DatasetCorrupt(f"{path}: {name} unreadable ({_first_line(err)})") from None
    if _sha256(data.tobytes()) != _text(f[name].attrs.get("sha256", "")):
        raise DatasetCorrupt(f"{path}: {name} fails its checksum")
    return data


def _volume_hashes(f: Any, split: str) -> list[str]:
    """A split's per-volume SHA-256s: the `{split}/sha256` dataset, or (files written before it) the
    masks' `sha256` attribute; empty when neither is there."""
    found = f.get(f"{split}/sha256")
    values = found[...] if isinstance(found, h5py.Dataset) else f[f"{split}/masks"].attrs.get("sha256", ())
    return [_text(h) for h in values]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def load_masks(path: os.PathLike | str, split: str, slab: Optional[tuple[int, int]] = None) -> np.ndarray:
    """A whole split's masks in memory: uint8 (n, E, E, E), every volume verified. Each volume's chunk is
    read as stored, checked against its SHA-256 and inflated here, so the masks returned are exactly
    the bytes that were checked; DatasetCorrupt (one line) names the first volume that fails.

    `slab` = (index, count): only planes [index·E/count, (index+1)·E/count) of every volume, (n, E/count,
    E, E) (a rank of a spatially sharded run). The chunk is still checked whole (it is the compressed
    stream, small next to the volume), then inflated as a stream that keeps only the slab's bytes and
    stops after them: no whole volume is ever held in memory."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    path = pathlib.Path(path)
    with h5py.File(path, "r") as f:
        ds = f[f"{split}/masks"]
        n, edge = ds.shape[0], ds.shape[1:]
        plane = int(np.prod(edge[1:]))
        first, depth = 0, edge[0]
        if slab is not None:
            index, count = slab
            if count < 1 or edge[0] % count or not 0 <= index < count:
                raise ValueError(f"slab {index} of {count}: expected a divisor of the depth {edge[0]}")
            depth = edge[0] // count
            first = index * depth
        hashes = _volume_hashes(f, split)
        out = np.empty((n, depth, *edge[1:]), dtype=np.uint8)
        for i in range(n):
            try:
                _, raw = ds.id.read_direct_chunk((i, 0, 0, 0))
            except (OSError, KeyError) as err:
                raise DatasetCorrupt(f"{path}: {split} mask {i} unreadable ({_first_line(err)})") from None
            if _sha256(raw) != hashes[i]:
                raise DatasetCorrupt(f"{path}: {split} mask {i} fails its checksum")
            try:
                data = zlib.decompress(raw) if slab is None else _inflate_range(raw, first * plane, depth * plane)
            except zlib.error as err:
                raise DatasetCorrupt(f"{path}: {split} mask {i} does not inflate ({err})") from None
            out[i] = np.frombuffer(data, dtype=np.uint8).reshape(out.shape[1:])
        return out


def _inflate_range(raw: bytes, start: int, length: int) -> bytes:
    """Bytes [start, start + length) of a zlib stream's inflated contents, inflating no further than
    their end and keeping nothing before their start."""
    d = zlib.decompressobj()
    skip, pieces, have, pending = start, [], 0, raw
    step = 1 << 22
    while have < length:
        chunk = d.decompress(pending, min(step, skip) if skip else min(step, length - have))
        pending = d.unconsumed_tail
        if not chunk:
            if d.eof or not pending:
                raise zlib.error(f"stream ends before byte {start + length}")
            continue
        if skip:
            skip -= len(chunk)
            continue
        pieces.append(chunk)
        have += len(chunk)
    return b"".join(pieces)


def load(data_cfg: Any, scale: int, seed: int, progress: bool = True, repair: bool = True,
         slab: Optional[tuple[int, int]] = None) -> tuple[pathlib.Path, DatasetInfo, np.ndarray, np.ndarray]:
    """The dataset of this config, read and verified: (path, info, train masks, validation masks).
    Damaged contents are said in one line and the file regenerated once (`repair`; only the process
    that generates datasets repairs them), else DatasetCorrupt. `slab`: see load_masks."""
    path = prepare(data_cfg, scale, seed, progress)
    try:
        return path, read_info(path), load_masks(path, "train", slab), load_masks(path, "val", slab)
    except DatasetCorrupt as err:
        if not repair:
            raise
        reason = str(err).split(": ", 1)[-1]
    path = prepare(data_cfg, scale, seed, progress, regenerate=reason)
    return path, read_info(path), load_masks(path, "train", slab), load_masks(path, "val", slab)
