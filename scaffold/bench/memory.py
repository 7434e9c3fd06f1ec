"""Memory-model benchmark: `python -m scaffold.bench.memory [--scales 6 7 8] [--out FILE]`.

For each scale and each step variant (eager `ladder`, `graphed`, each with and without recompute), the
memory model's prediction of the step benchmark's peak (scaffold.model.memory: `max_allocated`, from
the shapes alone) beside the peak torch.cuda.max_memory_allocated measures over a few real steps of
scaffold.bench.minibatch (the trainer's own TrainStep, counted from before the model is built, its 4
volumes of masks included), and their ratio. The model's stated accuracy is 15%. On the CPU only the
predictions are printed (no allocator to read).

`python -m scaffold.bench.memory --fit 11 --bottleneck 3 --device-gib 140` instead asks the model where a
scale fits: per spatial shard count, a rank's need with the parameters, gradients and Adam state
replicated (DDP) and sharded over the ranks (FSDP, as many ranks as shards), bf16 and recompute as the
trainer would run it, and the fewest shards that fit (strictly, and within the scale check's tolerance).
"""
from __future__ import annotations

import argparse

import torch

from scaffold import determinism
from scaffold.bench import write_json
from scaffold.model.memory import GiB, StepShape, estimate


def predicted(variant: str, scale: int, width: int, device: str) -> float:
    mode = "blocks" if "+recompute" in variant else "off"
    graph = variant.split("+")[0] == "graphed"
    cuda = device == "cuda"
    shape = StepShape(scale, base_width=width, amp=cuda, device=device, fused=cuda, recompute=mode,
                      graph=graph, data_bytes=4 * 8**scale, ask_copies=cuda,
                      fuse_head="+separatehead" not in variant)
    return estimate(shape, evaluate=False).max_allocated / GiB


def fit_table(scale: int, bottleneck: int, capacity_gib: float, width: int = 64) -> list[dict]:
    """Per shard count (powers of two up to the volume's depth): a rank's predicted need (GiB) with the
    state replicated and with FSDP over as many ranks, the FSDP units whole at once, and the verdicts."""
    from dataclasses import replace

    from scaffold.model.memory import TOLERANCE, param_count

    capacity = capacity_gib * GiB
    base = StepShape(scale, bottleneck, width, recompute="blocks", data_parallel=True)
    rows = []
    n = 1
    while n <= 2**scale:
        repl = estimate(replace(base, depth_shards=n), warmup=True)
        fsdp = None if n == 1 else estimate(replace(base, depth_shards=n, fsdp_world=n, data_parallel=False),
                                            warmup=True)
        row = {"shards": n, "replicated_gib": repl.need / GiB}
        if fsdp is not None:
            row.update(fsdp_gib=fsdp.need / GiB, gathered_gib=fsdp.gathered / GiB,
                       fsdp_fits=fsdp.need <= capacity, fsdp_passes_check=fsdp.need * (1 - TOLERANCE) <= capacity)
        row.update(replicated_fits=repl.need <= capacity,
                   replicated_passes_check=repl.need * (1 - TOLERANCE) <= capacity)
        rows.append(row)
        n *= 2
    rows[0]["parameters"] = param_count(scale, bottleneck, width)
    return rows


def print_fit(rows: list[dict], scale: int, bottleneck: int, capacity_gib: float) -> None:
    first = lambda key: next((r["shards"] for r in rows if r.get(key)), None)  # noqa: E731
    print(f"scale {scale}, {scale - bottleneck} levels ({rows[0]['parameters'] / 1e9:.1f} G parameters), bf16, "
          f"recompute, batch 1, on {capacity_gib:g} GiB devices: a rank's need in GiB")
    print(f"{'shards':>6} {'replicated':>10} {'FSDP':>8} {'whole units at most':>20}")
    for r in rows:
        f = f"{r['fsdp_gib']:8.1f} {r['gathered_gib']:20.1f}" if "fsdp_gib" in r else f"{'-':>8} {'-':>20}"
        print(f"{r['shards']:>6} {r['replicated_gib']:>10.1f} {f}")
    for what, key in (("replicated (DDP)", "replicated"), ("FSDP over as many ranks", "fsdp")):
        fits, passes = first(f"{key}_fits"), first(f"{key}_passes_check")
        print(f"{what}: fits from {fits or 'no'} shards; passes the scale check (15% tolerance) from "
              f"{passes or 'no'} shards")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", type=int, metavar="SCALE", help="where SCALE fits (shapes only, no device)")
    ap.add_argument("--bottleneck", type=int, default=3)
    ap.add_argument("--device-gib", type=float, default=140.0)
    ap.add_argument("--scales", type=int, nargs="+", default=[6, 7, 8])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--variants", default="ladder,graphed,ladder+recompute,graphed+recompute")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="bench_results/memory.json")
    args = ap.parse_args(argv)
    if args.fit is not None:
        rows = fit_table(args.fit, args.bottleneck, args.device_gib, args.width)
        print_fit(rows, args.fit, args.bottleneck, args.device_gib)
        write_json(args.out, {"fit": args.fit, "bottleneck": args.bottleneck, "device_gib": args.device_gib,
                              "rows": rows})
        return 0
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    determinism.configure("default")
    if cuda:  # as the trainer does for tight runs: expandable segments change what is reserved, not
        # what is allocated (the measured peak), and keep fragmentation from failing scale 9
        from scaffold.plan import roomy_allocator

        roomy_allocator()
    variants = [v for v in args.variants.split(",") if cuda or not v.startswith("graphed")]
    rows = []
    for scale in args.scales:
        for v in variants:
            row = {"scale": scale, "variant": v, "predicted_gib": predicted(v, scale, args.width, device.type)}
            if cuda:
                from scaffold.bench.minibatch import time_variant

                try:
                    r = time_variant(v, scale, args.width, args.steps, 1, 1, device)
                    row.update(measured_gib=r["peak_mem_gib"], step_ms=r["step_ms_median"])
                    row["ratio"] = row["predicted_gib"] / row["measured_gib"]
                except Exception as e:  # an out-of-memory is a result too
                    row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                torch.cuda.empty_cache()
            rows.append(row)
    dev = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"memory model against the measured step peak, width {args.width}, batch 1, {dev}")
    print(f"{'scale':>5} {'variant':<18} {'predicted GiB':>13} {'measured GiB':>12} {'pred/meas':>9} {'step ms':>9}")
    for r in rows:
        meas = f"{r['measured_gib']:.2f}" if "measured_gib" in r else ("OOM/err" if "error" in r else "-")
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        ms = f"{r['step_ms']:.1f}" if "step_ms" in r else "-"
        print(f"{r['scale']:>5} {r['variant']:<18} {r['predicted_gib']:>13.2f} {meas:>12} {ratio:>9} {ms:>9}")
        if "error" in r:
            print(f"      {r['error']}")
    write_json(args.out, {"device": dev, "width": args.width, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
