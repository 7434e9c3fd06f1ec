"""The shipped library of fractal classes: its file format, where it is found, and the command that
makes it.

One file per sampler and acceptance rule (`data.sampler`, `data.class_rule`, see ifs.py):
data/fractal_classes.txt for the defaults (upstream's sampler and rule, judged at class scale 7),
data/fractal_classes_chains.txt and data/fractal_classes_rms.txt for the earlier chains sampler under
each rule (installed as package data `scaffold.library`). Each holds one class per line (24 numbers,
written with repr so they read back exactly) under a header saying how to regenerate it, e.g. `python -m
scaffold.data.library --search 64 --seed 0 --rule upstream --sampler upstream --class-scale 7 >
data/fractal_classes.txt`. Loading tries the source tree next to this module, then the installed package data, and
otherwise runs that same search (a few seconds); a combination without a file (the upstream sampler
under the rms rule, or another class scale) is always searched.
"""
from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys

import numpy as np

from ..config import ConfigError
from .ifs import CLASS_SCALE, LIBRARY_SEED, LIBRARY_THRESHOLD, PARAMS_PER_MAP, RULES, SAMPLERS, search_classes

# (class_rule, sampler) -> shipped file; the upstream sampler's file holds classes judged at CLASS_SCALE.
LIBRARY_FILES = {("upstream", "upstream"): "fractal_classes.txt",
                 ("upstream", "chains"): "fractal_classes_chains.txt",
                 ("rms", "chains"): "fractal_classes_rms.txt"}
LIBRARY_FILE = LIBRARY_FILES[("upstream", "upstream")]
LIBRARY_SIZE = 64
# The largest per-axis variance each rule allows: upstream's scaled axes span 2 (variance at most 1);
# the rms rule's three variances sum to 1 (no cloud passes 1/3 on all three).
MAX_THRESHOLD = {"upstream": 1.0, "rms": 1.0 / 3.0}
MIN_CLASS_SCALE, MAX_CLASS_SCALE = 4, 9  # 16 to 2,097,152 points per judged cloud


def _file_for(rule: str, sampler: str, class_scale: int) -> str | None:
    """The shipped file of a combination, or None when it has none."""
    if sampler == "upstream" and class_scale != CLASS_SCALE:
        return None
    return LIBRARY_FILES.get((rule, sampler))


def format_library(classes: np.ndarray, seed: int, threshold: float, candidates: int,
                   rule: str = "upstream", guard_rejected: int = 0, sampler: str = "upstream",
                   class_scale: int = CLASS_SCALE, stability_rejected: int = 0) -> str:
    """The library file's text: a header saying how to regenerate it, then one class per line."""
    n = len(classes)
    if sampler == "chains":
        target = LIBRARY_FILES[(rule, sampler)]
        command = (f"--search {n} --seed {seed} --threshold {threshold!r} --rule {rule} --sampler chains"
                   f" > data/{target}")
        judged = f"class_rule={rule}, variance_threshold={threshold!r}, seed={seed}"
    else:
        target = _file_for(rule, sampler, class_scale) or f"fractal_classes_{rule}_s{class_scale}.txt"
        command = (f"--search {n} --seed {seed} --threshold {threshold!r} --rule {rule} --sampler upstream "
                   f"--class-scale {class_scale} > data/{target}")
        judged = (f"class_rule={rule}, sampler=upstream, class_scale={class_scale}, "
                  f"variance_threshold={threshold!r}, seed={seed}")
    lines = [
        "# scaffold fractal class library: one IFS class per line, 24 numbers =",
        "# map 0 (3x3 matrix row-major, translation), then map 1 (same layout).",
        f"# {n} classes accepted of {candidates} candidates ({judged}"
        + (f"; the stability guard rejected {stability_rejected} the rule accepted" if sampler == "upstream"
           else "")
        + (f"; the contraction guard rejected {guard_rejected} the rule accepted)." if rule == "upstream"
           else ")."),
        f"# Regenerate: python -m scaffold.data.library {command}",
    ]
    for row in np.asarray(classes, dtype=np.float64).reshape(n, -1):
        lines.append(" ".join(repr(float(v)) for v in row))
    return "\n".join(lines) + "\n"


def parse_library(text: str, origin: str = LIBRARY_FILE) -> np.ndarray:
    """Classes (n, 2, 12) from the library file's text; a bad line is a one-line error."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2 * PARAMS_PER_MAP:
            raise ValueError(f"{origin}:{number}: expected {2 * PARAMS_PER_MAP} numbers, "
                             f"found {len(fields)}")
        rows.append([float(v) for v in fields])
    return np.array(rows, dtype=np.float64).reshape(len(rows), 2, PARAMS_PER_MAP)


def repository_library_path() -> pathlib.Path:
    """Where the library lives in a source checkout (data/ at the top of the repository)."""
    return pathlib.Path(__file__).resolve().parents[2] / "data" / LIBRARY_FILE


def _library_text(rule: str = "upstream", sampler: str = "upstream",
                  class_scale: int = CLASS_SCALE) -> str | None:
    """The shipped library's text: package data first, then the source tree; None if neither (or if
    the combination ships no file)."""
    name = _file_for(rule, sampler, class_scale)
    if name is None:
        return None
    # The source tree next to this module first: an editable install's package data may point at
    # another checkout of the repository.
    path = repository_library_path().with_name(name)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    try:
        from importlib.resources import files

        return (files("scaffold.library") / name).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, OSError):
        return None


def load_library(rule: str = "upstream", sampler: str = "upstream",
                 class_scale: int = CLASS_SCALE) -> np.ndarray:
    """The shipped classes (n, 2, 12) of a rule and sampler; regenerated deterministically if the file
    is not installed."""
    text = _library_text(rule, sampler, class_scale)
    if text is None:
        return search_classes(LIBRARY_SIZE, LIBRARY_SEED, LIBRARY_THRESHOLD, rule=rule, sampler=sampler,
                              class_scale=class_scale)
    return parse_library(text, _file_for(rule, sampler, class_scale) or LIBRARY_FILE)


def classes_for(n_categories: int, threshold: float, rule: str = "upstream", sampler: str = "upstream",
                class_scale: int = CLASS_SCALE) -> np.ndarray:
    """The first `n_categories` classes for a rule, sampler and variance threshold: the shipped library
    at its own threshold, a fresh search (same seed, same draw order) otherwise or when more are
    needed."""
    if rule not in RULES:
        raise ConfigError(f"data.class_rule={rule!r}: expected {' | '.join(RULES)}")
    if sampler not in SAMPLERS:
        raise ConfigError(f"data.sampler={sampler!r}: expected {' | '.join(SAMPLERS)}")
    if not 0.0 < threshold < MAX_THRESHOLD[rule]:
        raise ConfigError(f"data.variance_threshold={threshold!r}: expected a number in "
                          f"(0, {'1' if rule == 'upstream' else '1/3'}) under class_rule={rule}")
    if threshold == LIBRARY_THRESHOLD and _file_for(rule, sampler, class_scale) is not None:
        library = load_library(rule, sampler, class_scale)
        if len(library) >= n_categories:
            return library[:n_categories]
    return search_classes(n_categories, LIBRARY_SEED, threshold, rule=rule, sampler=sampler,
                          class_scale=class_scale)


def classes_digest(classes: np.ndarray) -> str:
    """A content hash of class parameters (part of a dataset's cache key)."""
    return hashlib.sha256(np.ascontiguousarray(classes, dtype="<f8").tobytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaffold.data.library",
                                     description="Search fractal classes; print the library file.")
    parser.add_argument("--search", type=int, default=LIBRARY_SIZE, metavar="N",
                        help="number of classes to accept")
    parser.add_argument("--seed", type=int, default=LIBRARY_SEED)
    parser.add_argument("--threshold", type=float, default=LIBRARY_THRESHOLD)
    parser.add_argument("--rule", choices=RULES, default="upstream")
    parser.add_argument("--sampler", choices=SAMPLERS, default="upstream")
    parser.add_argument("--class-scale", type=int, default=CLASS_SCALE,
                        help="scale whose point count judges a class (upstream sampler)")
    args = parser.parse_args(argv)
    if args.search <= 0 or not 0 < args.threshold < MAX_THRESHOLD[args.rule]:
        parser.error("--search must be positive and --threshold in (0, the rule's maximum)")
    if not MIN_CLASS_SCALE <= args.class_scale <= MAX_CLASS_SCALE:
        parser.error(f"--class-scale must be in [{MIN_CLASS_SCALE}, {MAX_CLASS_SCALE}]")
    stats: dict = {}
    classes = search_classes(args.search, args.seed, args.threshold, stats, rule=args.rule,
                             sampler=args.sampler, class_scale=args.class_scale)
    sys.stdout.write(format_library(classes, args.seed, args.threshold, stats["candidates"], args.rule,
                                    stats.get("guard_rejected", 0), args.sampler, args.class_scale,
                                    stats.get("stability_rejected", 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
