"""Benchmark of dataset generation: `python -m scaffold.bench.datagen [--scale 7] [--reps 3]
[--sampler upstream|chains]`.

Generates the default dataset (5 classes, 145 instances, 240 volumes) into a fresh temporary cache
folder for each repetition and reports the median wall time and the CPU seconds of this process and
its workers (on a shared machine the CPU time is the steadier figure); writes the numbers as JSON
(--out).
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

from ..config import DataConfig
from ..data.generate import resolve_workers
from ..data.store import prepare, read_info
from scaffold.bench import write_json


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (the generation workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def time_generation(scale: int, seed: int, workers: int, sampler: str = "upstream") -> tuple[float, dict]:
    """Seconds to generate one dataset from scratch, and what was generated."""
    with tempfile.TemporaryDirectory(prefix="scaffold-datagen-") as folder:
        cfg = DataConfig(cache_dir=folder, workers=workers, sampler=sampler)
        start, cpu = time.perf_counter(), _cpu_seconds()
        path = prepare(cfg, scale, seed, progress=False)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        info = read_info(path)
        return seconds, {"volumes": info.n_train + info.n_val, "edge": info.edge,
                         "file_mib": path.stat().st_size / 2**20, "cpu_s": cpu}





def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scaffold.bench.datagen", description=__doc__)
    parser.add_argument("--scale", type=int, default=7)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--workers", type=int, default=0, help="0 = one per CPU core")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sampler", choices=("upstream", "chains"), default="upstream")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_results/datagen.json"))
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    times, cpus, shape = [], [], {}
    for _ in range(args.reps):
        seconds, shape = time_generation(args.scale, args.seed, args.workers, args.sampler)
        times.append(seconds)
        cpus.append(shape.pop("cpu_s"))
    result = {
        "benchmark": "datagen", "scale": args.scale, "seed": args.seed, "sampler": args.sampler,
        "workers": resolve_workers(args.workers, shape["volumes"]), "cpu_count": os.cpu_count(),
        **shape, "seconds": times, "median_s": statistics.median(times), "cpu_seconds": cpus,
        "median_cpu_s": statistics.median(cpus),
        "volumes_per_s": shape["volumes"] / statistics.median(times),
        "date": datetime.date.today().isoformat(), "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(f"{'scale':>5} {'sampler':>8} {'edge':>5} {'volumes':>7} {'workers':>7} {'median s':>9} {'min s':>7} "
          f"{'CPU s':>7} {'vol/s':>7} {'MiB':>6}")
    print(f"{args.scale:>5} {args.sampler:>8} {shape['edge']:>5} {shape['volumes']:>7} {result['workers']:>7} "
          f"{result['median_s']:>9.2f} {min(times):>7.2f} {result['median_cpu_s']:>7.1f} "
          f"{result['volumes_per_s']:>7.1f} {shape['file_mib']:>6.1f}")
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
