"""Loss-head plan sweep: device time of the fused kernel's launch plans, on the GPU the table is for.

    python -m scaffold.bench.tune_loss [--scale 7] [--plans rows,unrolled:64,128:2,4:8,16] [--out FILE]

Times forward + backward through the launchers (and the forward alone) at each plan, device time from
CUDA-graph replays with the L2 flushed before each (scaffold.bench.timing), on the logits the model
emits at `--scale` (bf16, channels-last, its classes) with uint8 labels as the trainer passes them.
`--plans FORMS:VOXELS:WARPS:PER_SM` sweeps the product of those comma-separated lists (default: a wide
grid of the tile and rows forms). Prints the fastest plan per form beside the table's; the table,
scaffold.kernels.seg_loss.TILE_TABLE, is edited by hand with the measurements beside it.
scaffold.bench.loss times the head as training runs it (and `--tile` one plan inside that).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import astuple

import torch

from scaffold.bench import write_json
from scaffold.bench.sites import model_sites
from scaffold.bench.timing import measure
from scaffold.loss import EPS


def plans(spec: str | None) -> list[tuple]:
    """(voxels, warps, per_sm, form) of every plan to time."""
    if spec:
        forms, *axes = spec.split(":")
        if len(axes) != 3:
            raise ValueError(spec)
        grid = [tuple(int(v) for v in a.split(",")) for a in axes]
        return [(*p, form) for form in forms.split(",") for p in itertools.product(*grid)]
    return ([(*p, "tile") for p in itertools.product((32, 64, 128), (2, 4, 8), (4, 16))]
            + [(*p, "rows") for p in itertools.product((128, 256, 512, 1024), (4, 8), (4, 16))])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=7)
    p.add_argument("--plans", default=None, metavar="FORMS:VOXELS:WARPS:PER_SM",
                   help="e.g. rows,unrolled:64,128:2,4:8,16 (default: a wide grid)")
    p.add_argument("--out", default="bench_results/loss_plans.json")
    args = p.parse_args(argv)
    try:
        grid = plans(args.plans)
    except ValueError:
        p.error(f"--plans {args.plans!r}: expected FORMS:VOXELS:WARPS:PER_SM, e.g. rows:64,128:2,4:16")
    if not torch.cuda.is_available():
        print("scaffold.bench.tune_loss: needs a CUDA GPU", file=sys.stderr)
        return 2
    from scaffold.kernels import seg_loss

    shape = model_sites(args.scale, ("conv",))[-1].output  # the head's output: the logits
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(shape, device="cuda", generator=g).bfloat16()
    z = z.contiguous(memory_format=torch.channels_last_3d)
    y = torch.randint(0, shape[1], (shape[0], *shape[2:]), device="cuda", generator=g).to(torch.uint8)
    w = torch.linspace(0.5, 2.0, shape[1], device="cuda")
    one = torch.ones((), device="cuda")

    def launchers(tile):
        sums = seg_loss.forward(z, y, w, EPS, tile=tile)[3]
        seg_loss.backward(z, y, w, sums, EPS, one, None, None, tile=tile)

    table = seg_loss.Plan(shape[0], z[0, 0].numel(), shape[1], z.device)
    rows = []
    for tile in [None] + [seg_loss.LossTile(*t) for t in grid]:
        row = dict(tile="table" if tile is None else list(astuple(tile)))
        try:
            row.update(device_ms=measure(lambda: launchers(tile), timer="device").median,
                       forward_ms=measure(lambda: seg_loss.forward(z, y, w, EPS, tile=tile),
                                          timer="device").median)
        except Exception as exc:  # a plan that does not compile or fit just loses
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(row, flush=True)
    print(f"table's plan ({table.block_v}, {table.num_warps}, {table.form}): "
          f"{rows[0].get('device_ms', float('nan')) * 1e3:.1f} us forward + backward")
    for form in seg_loss.FORMS:
        timed = [r for r in rows[1:] if "device_ms" in r and r["tile"][3] == form]
        if timed:
            best = min(timed, key=lambda r: r["device_ms"])
            print(f"best {form} {tuple(best['tile'])}: {best['device_ms'] * 1e3:.1f} us "
                  f"(forward {best['forward_ms'] * 1e3:.1f})")
    write_json(args.out, {"device": torch.cuda.get_device_name(), "logits": list(shape), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
