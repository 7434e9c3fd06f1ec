"""One run on a GPU for the conv kernels: correctness at real shapes, optional tuning, timing vs cuDNN.

    PYTHONPATH=. python3 scripts/gpu_check_conv.py --out DIR [--check 7] [--tune 7] [--bench 7,8]
        [--budget 280]

--check S: every distinct conv site of the scale-S model, bf16: each direction's relative error
           against cuDNN fp32 (no tf32) on the same operands, repeat-call bitwise equality, hashes.
--tune S:  time tile candidates (scripts/tune_conv.py) and use the winners for the bench below.
--bench:   scaffold.bench.conv for the given scales.
Phases stop starting new work once --budget seconds have passed. Writes JSON files into DIR and
prints a compact table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scaffold.bench import conv as bench  # noqa: E402
from scaffold.bench import write_json  # noqa: E402
from scaffold.kernels import tiles  # noqa: E402

T0 = time.time()


def elapsed() -> float:
    return time.time() - T0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_results/gpu_conv")
    p.add_argument("--check", type=int, default=0)
    p.add_argument("--tune", type=int, default=0)
    p.add_argument("--tune-sites", default="")
    p.add_argument("--bench", default="")
    p.add_argument("--budget", type=float, default=280.0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), flush=True)
    summary = []

    if args.check:
        checks = []
        for site, _ in bench.distinct_sites(bench.model_sites(args.check)):
            if elapsed() > args.budget * 0.4:
                summary.append(f"check stopped early at {site.name} (time)")
                break
            try:
                r = bench.check_site(site)
            except Exception as e:
                r = {"site": site.name, "error": f"{type(e).__name__}: {e}"[:400]}
                traceback.print_exc()
            checks.append(r)
            print(json.dumps(r), flush=True)
        json.dump(checks, open(os.path.join(args.out, "check.json"), "w"), indent=1)
        for r in checks:
            if "error" in r:
                summary.append(f"CHECK {r['site']}: {r['error'][:150]}")
                continue
            errs = {k[:-8]: v for k, v in r.items() if k.endswith("_rel_err")}
            same = all(v for k, v in r.items() if k.endswith("_repeat_equal"))
            worst = max(errs.values())
            summary.append(f"CHECK {r['site']:26s} worst rel err {worst:.2e} repeat-equal {same} "
                           + ("OK" if worst < 1e-2 and same else "FAIL"))

    if args.tune and elapsed() < args.budget * 0.5:
        try:
            import tune_conv

            names = [n for n in args.tune_sites.split(",") if n] or None
            table = tune_conv.tune(args.tune, names, log=lambda s: print(s, flush=True))
            tiles.TABLE.update({k: tuple(v) for k, v in table.items()})
            json.dump(table, open(os.path.join(args.out, "tiles.json"), "w"), indent=1)
            summary.append("TUNED " + json.dumps(table))
        except Exception as e:
            traceback.print_exc()
            summary.append(f"TUNE failed: {type(e).__name__}: {e}"[:300])

    results = []
    for s in [int(v) for v in args.bench.split(",") if v]:
        if elapsed() > args.budget * 0.75:
            summary.append(f"bench scale {s} skipped (time)")
            continue
        try:
            r = bench.bench_model(s, log=lambda line: print(line, flush=True))
            results.append(r)
            summary.extend(bench.format_row(row) for row in r["rows"])
            summary.append(bench.format_totals(r))
        except Exception as e:
            traceback.print_exc()
            summary.append(f"BENCH {s} failed: {type(e).__name__}: {e}"[:300])
    if results:
        write_json(os.path.join(args.out, "bench.json"),
                   {"device": torch.cuda.get_device_name(), "results": results})
    print("\n==== summary (%.0f s) ====" % elapsed())
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
