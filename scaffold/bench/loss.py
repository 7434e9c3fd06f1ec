"""Benchmark of the loss head: forward + backward, ours against the naive form, in the same run.

Ours: `SegmentationLoss` (fp32 log-softmax once, reduction "none" + ordinary sums, soft Dice).
Naive: `F.cross_entropy(logits.float(), labels, weight=w)` (default "mean" reduction, atomics on CUDA)
plus the same Dice on a separately computed softmax. Inputs are what the trainer feeds the loss: bf16
logits as produced under autocast, batch 1, 6 classes, random labels, weights from the label counts.
Also counts distinct loss values over repeated identical calls (1 = bitwise repeatable). The first
columns are as launched from Python (scaffold.bench.timing's `wall` timer: CUDA events, host cost
included; the host clock on the CPU); on CUDA "device" is the same forward + backward replayed from a
CUDA graph (the `device` timer): the device time alone.

    python -m scaffold.bench.loss                     # CUDA: 128³ and 256³; CPU: 16³
    python -m scaffold.bench.loss --size 32 --out bench_results/loss.json
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from scaffold.bench import write_json
from scaffold.bench.timing import measure
from scaffold.loss import SegmentationLoss

CLASSES = 6


def naive_loss(head: SegmentationLoss, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    ce = F.cross_entropy(x, labels.long(), weight=head.weight)
    classes = torch.arange(1, CLASSES, device=labels.device).view(1, -1, 1, 1, 1)
    target = labels.unsqueeze(1) == classes
    return ce + (1 - head._dice(*head._dice_sums(x.softmax(1)[:, 1:], target)).mean())


def _distinct(fn, calls: int) -> int:
    return torch.stack([fn().detach() for _ in range(calls)]).unique().numel()


def parse_tile(text: str | None):
    """'128,8,4,rows' -> seg_loss.LossTile(128, 8, 4, 'rows'): a fused-kernel plan to time beside the
    default."""
    if not text:
        return None
    from scaffold.kernels.seg_loss import LossTile

    parts = text.split(",")
    try:
        if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[:3]):
            raise ValueError
        return LossTile(*(int(p) for p in parts[:3]), *parts[3:])
    except ValueError:
        raise SystemExit(f"--tile {text!r}: expected VOXELS,WARPS,PER_SM[,tile|rows|unrolled]"
                         ) from None


def bench_size(edge: int, device: torch.device, reps: int, repeats: int, compile_head: bool,
               tile=None) -> dict:
    g = torch.Generator(device=device).manual_seed(edge)
    # As the model's head emits them: bf16 under autocast, channels-last on CUDA.
    logits = torch.randn(1, CLASSES, edge, edge, edge, device=device, generator=g).bfloat16()
    if device.type == "cuda":
        logits = logits.contiguous(memory_format=torch.channels_last_3d)
    logits.requires_grad_()
    # uint8, as the trainer passes the stored masks (the naive form makes its int64 copy itself).
    labels = torch.randint(0, CLASSES, (1, edge, edge, edge), device=device, generator=g).to(torch.uint8)
    counts = np.bincount(labels.flatten().cpu().numpy(), minlength=CLASSES)
    head = SegmentationLoss.from_counts(counts).to(device)  # rung auto: the fused kernel on CUDA
    eager = SegmentationLoss(head.weight, rung="vendor").to(device)
    ours_fn = torch.compile(head) if compile_head else head
    forms = {"ours": lambda: ours_fn(logits, labels), "ours_eager": lambda: eager(logits, labels),
             "naive": lambda: naive_loss(head, logits, labels)}
    if tile is not None:
        from scaffold.kernels import seg_loss

        forms["ours_tile"] = lambda: seg_loss.seg_loss_terms(logits, labels, head.weight, head.eps,
                                                             tile=tile)[0]
    row: dict = {"edge": edge, "voxels": edge**3}
    for name, loss_fn in forms.items():
        def step(loss_fn=loss_fn):
            torch.autograd.grad(loss_fn(), logits)

        medians = [measure(step, reps=reps, device=device).median for _ in range(repeats)]
        row[name] = {"median_ms": statistics.median(medians), "min_ms": min(medians),
                     "max_ms": max(medians), "distinct_values_per_100": _distinct(loss_fn, 100)}
        if device.type == "cuda":
            # Device time alone (CUDA-graph replays): what the step pays when its host runs ahead.
            row[name]["device_ms"] = statistics.median(measure(step, timer="device").median
                                                       for _ in range(repeats))
    row["speedup"] = row["naive"]["median_ms"] / row["ours"]["median_ms"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs="+", help="volume edges (default: 128 256 on CUDA, "
                        "16 on the CPU)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--reps", type=int, default=100, help="timed calls per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per form; the median is kept")
    parser.add_argument("--compile", action="store_true", help="torch.compile our loss head")
    parser.add_argument("--tile", default=None, help="also time the fused kernel at this plan: "
                        "VOXELS,WARPS,PER_SM[,tile|rows|unrolled] (the row 'ours_tile' of the JSON)")
    parser.add_argument("--out", default="bench_results/loss.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    sizes = args.size or ([128, 256] if device.type == "cuda" else [16])
    if any(s <= 0 for s in sizes) or args.reps <= 0 or args.repeats <= 0:
        parser.error("--size, --reps and --repeats must be positive")
    tile = parse_tile(args.tile)
    rows = [bench_size(s, device, args.reps, args.repeats, args.compile, tile) for s in sizes]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"loss head forward+backward, bf16 logits, batch 1, {CLASSES} classes, on {name}")
    dev = device.type == "cuda"
    print(f"{'edge':>5} {'ours ms':>9} {'eager ms':>9} {'naive ms':>9} {'speedup':>8} "
          f"{'distinct ours/eager/naive':>26}" + (f" {'device ms ours/eager/naive':>28}" if dev else ""))
    for r in rows:
        print(f"{r['edge']:>5} {r['ours']['median_ms']:>9.4f} {r['ours_eager']['median_ms']:>9.4f} "
              f"{r['naive']['median_ms']:>9.4f} {r['speedup']:>7.2f}x "
              f"{r['ours']['distinct_values_per_100']:>14}/{r['ours_eager']['distinct_values_per_100']}/"
              f"{r['naive']['distinct_values_per_100']}" +
              (f"       {r['ours']['device_ms']:.4f}/{r['ours_eager']['device_ms']:.4f}/"
               f"{r['naive']['device_ms']:.4f}" if dev else ""))
    for r in rows:
        if "ours_tile" in r:
            t = r["ours_tile"]
            print(f"{r['edge']:>5} fused at --tile {args.tile}: {t['median_ms']:.4f} ms as launched" +
                  (f", {t['device_ms']:.4f} ms device" if dev else "") +
                  f", distinct {t['distinct_values_per_100']}")
    payload = {"benchmark": "loss", "device": name, "torch": torch.__version__,
               "compile": args.compile, "results": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
