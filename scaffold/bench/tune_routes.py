"""Offline tuner for the conv routes (scaffold/model/routes.py): run on the GPU the table is for.

    python -m scaffold.bench.tune_routes --scale 7,8 [--reps 3] [--margin 0.02] [--timer wall|device]
                                         [--out routes.json] [--write | --print]

For every distinct conv site of the model (scaffold.bench.sites) and each direction (forward,
backward-data, backward-weight; the bias gradient runs on ours whatever the route) it times our
Triton launchers, our Gluon kernels where they take the site and direction (sm_90: 3×3×3 sites
with channels multiples of 64; scaffold.bench.conv.gluon_calls), and cuDNN restricted to
deterministic algorithms without search (what the vendor rung runs in training) on the same bf16
NDHWC operands, `--reps` rounds interleaved, and takes the median per side. `--timer wall` (the
default) times calls as launched from Python, the host's launch cost included; `--timer device`
times CUDA-graph replays, the device time alone: the measure for a training step whose host runs
ahead of its device (bench.minibatch --breakdown says which one a step is). A direction goes to the
faster of our kernels (Triton or Gluon) when its median is below (1 - margin) × cuDNN's, else to
vendor; a kernel whose call failed is not a candidate. At a site with an operand of 2^31 elements
or more cuDNN is not timed: it leaves its tiled kernels there for 64-bit-index direct ones, measured
10–1000× slower at scale 9 (routes.py), so the faster of ours takes each direction. --write rewrites
the ROUTES block of routes.py (found through the imported module; temp file + rename) after every
site, keeping the keys this run did not measure; --print only prints that block at the end. The
run-time path never times.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from scaffold.bench import rewrite_block, write_json
from scaffold.bench.conv import (DIRECTIONS, bench_site, conv_sites, geometry, parse_scales, site_key,
                                 transposed)
from scaffold.model import routes

SIDES = ("triton", "cudnn_det")


def choose(t_ms, v_ms, margin: float, g_ms=None) -> str:
    """The faster of ours (Triton `t_ms`, Gluon `g_ms`; None: did not run) when it beats cuDNN
    (`v_ms`) by the margin (or cuDNN failed), else vendor."""
    ours = [(ms, rung) for ms, rung in ((t_ms, routes.TRITON), (g_ms, routes.GLUON)) if ms is not None]
    if not ours:
        return routes.VENDOR
    ms, rung = min(ours)
    if v_ms is None:
        return rung
    return rung if ms < (1.0 - margin) * v_ms else routes.VENDOR


def past_int32(site) -> bool:
    """Whether the site has an operand of 2^31 elements or more at batch 1 (routes.beyond_int32)."""
    return routes.beyond_int32((1, *site.inputs[0][1:]), site.weight, *geometry(site), transposed(site))


def tune(scale: int, reps: int, margin: float, names=None, baseline: bool = False,
         log=print, on_site=None, timer: str = "wall") -> tuple[dict, dict]:
    """Returns (routes {key: (fwd, bwd_data, bwd_weight)}, report with the medians and totals).
    `baseline` also times cuDNN with algorithm search (`cudnn`), for the report only. `on_site(table,
    report)` is called after each site with the results so far (so a run cut short keeps them)."""
    sides = SIDES + (("cudnn",) if baseline else ())
    torch.backends.cudnn.benchmark = True  # the `cudnn` side; `cudnn_det` runs under its own flags
    table, rows = {}, []
    totals = {s: 0.0 for s in sides + ("routed",)}
    for site in conv_sites(scale):
        if not site.matches(names):
            continue
        past = past_int32(site)  # cuDNN is not timed there: see the module's docstring
        runs = [bench_site(site, rungs=("triton",) if past else sides, timer=timer) for _ in range(reps)]
        med = {}
        for side in sides + (routes.GLUON,):
            for d in DIRECTIONS:
                vals = [r[f"{side}_{d}_ms"] for r in runs if r.get(f"{side}_{d}_ms") is not None]
                med[f"{side}_{d}"] = statistics.median(vals) if vals else None
        route = tuple(choose(med[f"triton_{d}"], med[f"cudnn_det_{d}"], margin, med[f"gluon_{d}"])
                      for d in DIRECTIONS)
        if past:  # a direction where ours failed (memory, say) keeps `lookup`'s Triton, never vendor
            route = tuple(routes.TRITON if r == routes.VENDOR else r for r in route)
        key = site_key(site)
        table[key] = route
        for side in sides:
            totals[side] += site.count * sum(med[f"{side}_{d}"] or 0.0 for d in DIRECTIONS)
        chosen = [med[f"{r if r in (routes.TRITON, routes.GLUON) else 'cudnn_det'}_{d}"] for r, d in
                  zip(route, DIRECTIONS)]
        totals["routed"] += site.count * sum(c or 0.0 for c in chosen)
        rows.append({"site": site.name, "count": site.count, "key": key, "route": route,
                     "median_ms": med})
        log(f"{site.name[:24]:24s} x{site.count} " + " | ".join(
            f"{d[:6]} {_ms(med[f'triton_{d}'])}/{_ms(med[f'gluon_{d}'])}/{_ms(med[f'cudnn_det_{d}'])} -> {r}"
            for d, r in zip(DIRECTIONS, route)))
        torch.cuda.empty_cache()
        if on_site is not None:
            on_site(table, {"scale": scale, "timer": timer, "rows": rows, "totals_ms": totals,
                            "partial": True})
    log(f"scale {scale}, count-weighted ms ({timer} time): "
        + ", ".join(f"{k} {v:.2f}" for k, v in totals.items())
        + " (routed: the chosen side's median, from the same timings that chose it)")
    return table, {"scale": scale, "timer": timer, "reps": reps, "margin": margin, "rows": rows,
                   "totals_ms": totals}


def _ms(v) -> str:
    return "  n/a " if v is None else f"{v:6.3f}"


def write_routes(table: dict, path: str, write: bool = True) -> str:
    """The ROUTES block of routes.py (at `path`) holding `table`, rewritten atomically when `write`."""
    return rewrite_block(path, "ROUTES", table, write)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="7", help="comma-separated scales, e.g. 7,8")
    p.add_argument("--sites", default="", help="comma-separated substrings of the sites' module names")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds; the median is kept")
    p.add_argument("--margin", type=float, default=0.02,
                   help="our kernel must be this fraction faster than cuDNN to take a direction")
    p.add_argument("--timer", default="wall", choices=("wall", "device"),
                   help="wall: as launched from Python; device: CUDA-graph replays (device time)")
    p.add_argument("--out", default="", help="write the routes and timings as JSON here")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the ROUTES block of routes.py")
    mode.add_argument("--print", action="store_true", help="print that block, rewrite nothing")
    p.add_argument("--baseline", action="store_true",
                   help="also time cuDNN with algorithm search, for the report")
    args = p.parse_args(argv)
    scales = parse_scales(p, args.scale)
    if args.reps < 1 or not 0.0 <= args.margin < 1.0:
        p.error("--reps must be >= 1 and --margin in [0, 1)")
    if not torch.cuda.is_available():
        print("scaffold.bench.tune_routes: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [n for n in args.sites.split(",") if n] or None
    table, reports = {}, []

    def save(new: dict, partial=None) -> None:
        """Write what is measured so far (after every site: a run cut short keeps its results)."""
        if args.out:
            write_json(args.out, {"device": torch.cuda.get_device_name(), "routes": {**table, **new},
                                  "reports": reports + ([partial] if partial else [])})
        if args.write:  # keys not measured in this run keep their routes
            write_routes({**routes.ROUTES, **table, **new}, routes.__file__)

    for scale in scales:
        t, report = tune(scale, args.reps, args.margin, names, args.baseline, on_site=save,
                         timer=args.timer)
        table.update(t)
        reports.append(report)
    save({})
    if args.print:
        print(write_routes({**routes.ROUTES, **table}, routes.__file__, write=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
