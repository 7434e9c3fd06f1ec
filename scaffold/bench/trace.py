"""Communication against computation in a profiled run: `python -m scaffold.bench.trace TRACE [--out FILE]`.

Reads a torch profiler trace (Chrome trace JSON; a `debug=profile` run writes rank 0's as
<run dir>/profile_trace.json) and splits the device's time over the profiled window into
communication, the NCCL kernels by collective (the halo exchange's sends and receives, the shard
group's all-gathers (its fixed-order sums), DDP's all-reduces, FSDP's reduce-scatters and
all-gathers, broadcasts), and computation, every other kernel, copy and fill. Each is the union of
its intervals over all streams, so work on two streams at once counts once. `overlapped` is the time
both run at once: communication hidden behind computation; `exposed` the communication that is not.
Per profiled step (the trace's ProfilerStep ranges) in ms, and as a share of the window. Prints a
table and writes JSON.

    torchrun --nproc-per-node=2 -m scaffold.train scale=9 parallel.spatial_shards=2 debug=profile
    python -m scaffold.bench.trace outputs/DATE/TIME/profile_trace.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scaffold.bench import write_json

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of device work
# NCCL kernel name fragments -> the collective (first match wins; SendRecv before Send and Recv).
COLLECTIVES = (
    ("send/recv (halo)", ("SendRecv", "Send", "Recv")),
    ("all-gather", ("AllGather",)),
    ("all-reduce", ("AllReduce",)),
    ("reduce-scatter", ("ReduceScatter",)),
    ("broadcast", ("Broadcast",)),
)
COMPUTE = "computation"

Interval = tuple[float, float]


def kind(name: str) -> str:
    """A device event's part: its collective for an NCCL kernel, else computation."""
    if "nccl" not in name.lower():
        return COMPUTE
    for label, parts in COLLECTIVES:
        if any(p in name for p in parts):
            return label
    return "other collective"


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both of two merged interval lists."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def load(path: Path) -> list[dict]:
    """The trace's events; ValueError (one line, without the path) where the file is not a Chrome trace."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    except ValueError:
        raise ValueError("not JSON (expected a torch profiler trace, e.g. a run's profile_trace.json)") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError("no traceEvents list (expected a torch profiler trace)")
    return events


def analyze(events: list[dict]) -> dict:
    """Device time by part over the window, per profiled step; ValueError where the trace holds no
    device work (a CPU run's)."""
    spans: dict[str, list[Interval]] = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in DEVICE_EVENTS and "dur" in e:
            start = float(e["ts"])
            spans.setdefault(kind(str(e.get("name", ""))), []).append((start, start + float(e["dur"])))
    if not spans:
        raise ValueError("no device kernels in the trace: it is a CPU run's (profile a run on a GPU)")
    steps = len({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}) or 1
    parts = {k: union(v) for k, v in spans.items()}
    compute = parts.get(COMPUTE, [])
    comm = union([iv for k, v in parts.items() if k != COMPUTE for iv in v])
    busy = union(compute + comm)
    window = busy[-1][1] - busy[0][0]
    overlapped = intersection(compute, comm)
    us = {COMPUTE: length(compute), "communication": length(comm),
          **{k: length(v) for k, v in parts.items() if k != COMPUTE},
          "overlapped": overlapped, "exposed": length(comm) - overlapped, "idle": window - length(busy)}
    return {"steps": steps, "window_ms": window / 1e3, "step_ms": window / 1e3 / steps,
            "ms_per_step": {k: v / 1e3 / steps for k, v in us.items()},
            "share_of_window": {k: v / window if window > 0 else 0.0 for k, v in us.items()},
            "communication_overlapped": overlapped / length(comm) if comm else None}


def table(result: dict, source: str) -> str:
    lines = [f"device time of {source}: {result['steps']} profiled step(s), window {result['window_ms']:.2f} ms "
             f"({result['step_ms']:.2f} ms a step)",
             f"{'part':<24} {'ms/step':>9} {'share':>7}"]
    for name, ms in result["ms_per_step"].items():
        indent = "  " if name not in (COMPUTE, "communication", "overlapped", "exposed", "idle") else ""
        lines.append(f"{indent + name:<24} {ms:>9.3f} {result['share_of_window'][name]:>7.1%}")
    hidden = result["communication_overlapped"]
    lines.append("communication hidden behind computation: "
                 + ("- (none in the trace)" if hidden is None else f"{hidden:.1%}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a torch profiler trace (a debug=profile run's profile_trace.json)")
    ap.add_argument("--out", default="", help="write the result as JSON here")
    args = ap.parse_args(argv)
    try:
        result = analyze(load(args.trace))
    except ValueError as e:
        print(f"error: {args.trace}: {e}", file=sys.stderr)
        return 2
    print(table(result, args.trace))
    if args.out:
        write_json(args.out, {"trace": str(args.trace), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
