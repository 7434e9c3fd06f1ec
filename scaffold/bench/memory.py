"""Memory-model benchmark: `python -m scaffold.bench.memory [--scales 6 7 8] [--out FILE]`.

For each scale and each step variant (eager `ladder`, `graphed`, each with and without recompute), the
memory model's prediction of the step benchmark's peak (scaffold.model.memory: `max_allocated`, from
the shapes alone) beside the peak torch.cuda.max_memory_allocated measures over a few real steps of
scaffold.bench.minibatch (the trainer's own TrainStep, counted from before the model is built, its 4
volumes of masks included), and their ratio. The model's stated accuracy is 15%. On the CPU only the
predictions are printed (no allocator to read).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[6, 7, 8])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--variants", default="ladder,graphed,ladder+recompute,graphed+recompute")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="bench_results/memory.json")
    args = ap.parse_args(argv)
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
