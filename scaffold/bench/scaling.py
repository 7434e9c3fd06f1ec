"""Scaling of the training run: `scaffold.train` in one process and under torchrun at each given rank
count, every size `--reps` times in alternating order, in one call. Weak scaling by default (data
parallel, the same per-rank batch); `--spatial` measures strong scaling instead: each size's ranks
split one volume (`parallel.spatial_shards` = its rank count), so a volume's step is shared.

Per size: the median over its runs of the last epoch's median step time (train_stats.csv's
`step_ms_median`), samples per second, the efficiency (each GPU's samples per second against one
process's: for weak scaling, one process's step time over this size's) and whether the size's runs
are bitwise identical (train_stats.csv's non-wall-clock columns and every tensor of
checkpoints/last.pt). From the runs' result.json: on CUDA the largest peak of device memory of any
rank beside the memory model's figure for a rank; where runs reach the target (`--epochs -1`), the
median time to target with each run's epochs and steps. Prints a table and writes JSON. Arguments
after `--` go to every run (a scale's overrides, `parallel.fsdp=on`, ...); the dataset is generated
once first. NVLink multicast stays off in the runs (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1) unless set otherwise.

    python -m scaffold.bench.scaling --ranks 2,4 --scale 7 --epochs 2 --reps 2
    python -m scaffold.bench.scaling --ranks 2 --scale 8 -- parallel.fsdp=on
    python -m scaffold.bench.scaling --ranks 2,4 --scale 9 --epochs 1 --spatial -- data.n_instances=6
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from scaffold.bench import write_json
from scaffold.bench.runs import compare
from scaffold.files import read_json
from scaffold.rundir import RESULT_FILE
from scaffold.stats import read_rows

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ONE = 0  # the rank count that stands for one process without torchrun


def _ranks(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--ranks={text}: expected rank counts >= 1, comma-separated")
    return out


def label(ranks: int) -> str:
    return "one process" if ranks == ONE else f"{ranks} rank{'s' if ranks > 1 else ''}"


def command(ranks: int, overrides: list[str]) -> list[str]:
    """One process (ranks == ONE) or torchrun with `ranks` local ranks, on scaffold.train."""
    if ranks == ONE:
        return [sys.executable, "-m", "scaffold.train", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "scaffold.train", *overrides]


def last_step_ms(run: Path) -> Optional[float]:
    rows = read_rows(run / "train_stats.csv")
    return float(rows[-1]["step_ms_median"]) if rows else None


RESULT_KEYS = ("time_to_target_s", "epochs", "optimizer_steps", "memory")  # kept from each run's result.json


def run_results(run: Path) -> dict:
    """RESULT_KEYS from the run's result.json (memory: the model's prediction for a rank and every
    rank's measured peak, on CUDA); what is missing stays out."""
    result = read_json(run / RESULT_FILE)
    if not isinstance(result, dict):
        return {}
    return {k: result[k] for k in RESULT_KEYS if result.get(k) is not None}


def run_once(ranks: int, overrides: list[str], run_dir: Path, timeout: float, env: dict) -> dict:
    """One training run into `run_dir`: its last epoch's step time, or what went wrong (one line)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [*overrides, f"hydra.run.dir={run_dir}", "progress=false"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command(ranks, args), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    wall = time.perf_counter() - start
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()] or [f"exit {done.returncode}"]
        return {"error": lines[-1][:300], "wall_s": wall}
    return {"step_ms": last_step_ms(run_dir), "wall_s": wall, **run_results(run_dir)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=_ranks, default=[2, 4], help="rank counts under torchrun, e.g. 1,2,4")
    ap.add_argument("--scale", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="runs per size (2 or more also checks their bits)")
    ap.add_argument("--spatial", action="store_true",
                    help="strong scaling: each size's ranks share one volume (parallel.spatial_shards = ranks)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    ap.add_argument("--workdir", default="bench_results/scaling-runs", help="where the runs' directories go")
    ap.add_argument("--out", default="bench_results/scaling.json")
    args = ap.parse_args(own)
    import torch

    cuda = torch.cuda.is_available()
    if cuda and max(args.ranks) > torch.cuda.device_count():
        print(f"--ranks: {max(args.ranks)} ranks asked for and {torch.cuda.device_count()} CUDA device(s) "
              "here (one rank per device)", file=sys.stderr)
        return 2
    overrides = [f"scale={args.scale}", f"epochs={args.epochs}", *extra]
    env = {**os.environ, **{k: v for k, v in MULTICAST_OFF.items() if k not in os.environ}}
    data = subprocess.run([sys.executable, "-m", "scaffold.data", *overrides], env=env, capture_output=True,
                          text=True, timeout=args.timeout)
    if data.returncode != 0:
        print(f"dataset: {(data.stderr.strip().splitlines() or ['failed'])[-1]}", file=sys.stderr)
        return 1
    sizes = [ONE, *args.ranks]
    work = Path(args.workdir)
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for rep in range(args.reps):
        for n in (sizes if rep % 2 == 0 else sizes[::-1]):  # alternating order: drift hits every size alike
            run_dir = work / f"{'one' if n == ONE else f'ranks{n}'}-rep{rep}"
            r = run_once(n, overrides + _shards(n, args.spatial), run_dir, args.timeout, env)
            r["dir"] = str(run_dir)
            runs[n].append(r)
            print(f"  {label(n)}, run {rep + 1}: "
                  + (f"{r['step_ms']:.2f} ms/step" if "error" not in r else f"failed: {r['error']}"),
                  file=sys.stderr)
    batch = _batch(overrides)
    table = []
    base = _median(runs[ONE])
    for n in sizes:
        ms = _median(runs[n])
        world = 1 if n == ONE else n
        groups = 1 if args.spatial else world  # data-parallel groups: volumes in flight per step / batch
        ok = [r for r in runs[n] if "error" not in r]
        bitwise = None
        if len(ok) >= 2:
            bitwise = all(compare(Path(ok[0]["dir"]), Path(r["dir"])).identical for r in ok[1:])
        table.append({"size": label(n), "ranks": world, "spatial_shards": world // groups,
                      "step_ms_median": ms, "step_ms": [r.get("step_ms") for r in runs[n]],
                      "samples_per_s": None if ms is None else groups * batch * 1000.0 / ms,
                      # each GPU's throughput against one process's
                      "efficiency": None if ms is None or base is None else base * groups / (ms * world),
                      "speedup": None if ms is None or base is None else base / ms,
                      "bitwise": bitwise, "errors": [r["error"] for r in runs[n] if "error" in r],
                      **_memory(ok), **_target(ok)})
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    how = ("strong scaling (each size's ranks split one volume)" if args.spatial
           else f"weak scaling, batch {batch} per rank")
    print(f"{how}, scale {args.scale}, {args.epochs} epochs, {dev}; the last epoch's median step, median of "
          f"{args.reps} runs; efficiency: each GPU's samples/s against one process's")
    print(f"{'size':<12} {'ms/step':>9} {'samples/s':>10} {'efficiency':>11} {'bitwise':>8} {'peak GiB':>9} "
          f"{'model GiB':>10} {'to target s':>12}")
    for row in table:
        ms, sps, eff = row["step_ms_median"], row["samples_per_s"], row["efficiency"]
        bits = {None: "-", True: "yes", False: "NO"}[row["bitwise"]]
        print(f"{row['size']:<12} {_fmt(ms, '.2f'):>9} {_fmt(sps, '.1f'):>10} {_fmt(eff, '.1%'):>11} {bits:>8} "
              f"{_fmt(row.get('peak_gib'), '.2f'):>9} {_fmt(row.get('predicted_gib'), '.2f'):>10} "
              f"{_fmt(row.get('time_to_target_s'), '.1f'):>12}"
              + (f"  ({len(row['errors'])} failed: {row['errors'][0]})" if row["errors"] else ""))
    write_json(args.out, {"scale": args.scale, "epochs": args.epochs, "batch_per_rank": batch, "device": dev,
                          "spatial": args.spatial,
                          "overrides": overrides, "reps": args.reps, "rows": table,
                          "runs": {("one" if n == ONE else str(n)): runs[n] for n in sizes}})
    return 0 if all(not row["errors"] for row in table) else 1


def _shards(ranks: int, spatial: bool) -> list[str]:
    """The size's own override: with --spatial, its ranks split one volume."""
    return [f"parallel.spatial_shards={ranks}"] if spatial and ranks not in (ONE, 1) else []


def _batch(overrides: list[str]) -> int:
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "batch_size"]
    if given:
        return int(given[-1])
    from scaffold.config import Config

    return Config.batch_size


def _memory(runs: list[dict]) -> dict:
    """The largest peak of any rank in any of the size's runs, and the memory model's figure for a rank
    (the same for every run of a size); {} off CUDA."""
    records = [r["memory"] for r in runs if r.get("memory")]
    if not records:
        return {}
    return {"peak_gib": max(max(m["peak_gib"]) for m in records), "predicted_gib": records[0]["predicted_gib"]}


def _target(runs: list[dict]) -> dict:
    """The median time to target over the size's runs that reached it, with their epochs and steps
    (the trajectory differs between world sizes); {} where none did."""
    reached = [r for r in runs if r.get("time_to_target_s") is not None]
    if not reached:
        return {}
    return {"time_to_target_s": statistics.median(r["time_to_target_s"] for r in reached),
            "reached_target": f"{len(reached)} of {len(runs)}",
            "epochs_to_target": [r.get("epochs") for r in reached],
            "steps_to_target": [r.get("optimizer_steps") for r in reached]}


def _median(runs: list[dict]) -> Optional[float]:
    ms = [r["step_ms"] for r in runs if r.get("step_ms") is not None]
    return statistics.median(ms) if ms else None


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


if __name__ == "__main__":
    raise SystemExit(main())
