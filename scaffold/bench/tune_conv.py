"""Offline tuner for the conv tile table (run on the GPU the table is for).

    python -m scaffold.bench.tune_conv --scale 7 [--sites inc.conv1,outc] [--ops box,boxw]
                                       [--out tiles.json] [--write | --print]

For every distinct conv site of the model (scaffold.bench.sites) and each direction it times each
candidate tile (scaffold.bench.conv.time_ms, wall time), sums the times per table key
(arch|dtype|op|shape class, each site weighted by its count in the model) and keeps the fastest
candidate per key. A candidate whose result differs bitwise between repeated calls is disqualified (a
compiler race would show so). --ops limits the run to some table ops. --write rewrites the TABLE block
of scaffold/kernels/conv/tiles.py (found through the imported module; temp file + rename), keeping
the keys this run did not tune; --print only prints that block. The run-time path never times.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from scaffold.bench import rewrite_block
from scaffold.bench.conv import conv_sites, site_tensors, time_ms, transposed, triton_calls
from scaffold.kernels.conv import tiles
from scaffold.kernels.conv.box import TRANSPOSED_BOX_MIN_VOXELS
from scaffold.kernels.conv.tiles import Tile, shape_class
from scaffold.kernels.lib.device import arch_key, dtype_key

CANDIDATES = {
    "flat": [Tile(128, 64, 32, 4, 3), Tile(128, 64, 16, 4, 4), Tile(64, 64, 32, 4, 3),
             Tile(256, 64, 32, 8, 3), Tile(128, 32, 32, 4, 3)],
    "narrow": [Tile(128, 16, 64, 4, 3), Tile(64, 16, 64, 4, 3), Tile(256, 16, 64, 8, 3),
             Tile(128, 16, 32, 4, 4)],
    "small": [Tile(128, 64, 64, 4, 4), Tile(128, 64, 64, 8, 3), Tile(128, 128, 64, 8, 3),
              Tile(64, 64, 64, 4, 4), Tile(256, 64, 64, 8, 3)],
    "wide": [Tile(128, 128, 64, 8, 3), Tile(128, 128, 64, 8, 4), Tile(128, 256, 64, 8, 3),
             Tile(128, 64, 64, 4, 4), Tile(64, 128, 64, 4, 4)],
}
WGRAD = {
    "flat": [Tile(64, 32, 64, 4, 3), Tile(64, 64, 64, 4, 3), Tile(64, 64, 32, 4, 4),
             Tile(64, 128, 64, 8, 3)],
    "default": [Tile(128, 128, 64, 8, 3), Tile(64, 128, 64, 4, 3), Tile(128, 64, 64, 4, 3),
                Tile(128, 128, 32, 8, 4), Tile(64, 64, 64, 4, 4)],
}

# Box kernels (tensor descriptors, stride 1). boxw tiles: (Cout block, Cin block, voxels per box,
# warps, stages, group_m, kw taps per program).
BOX = {
    "small": [Tile(128, 64, 64, 4, 4), Tile(128, 64, 64, 4, 3), Tile(256, 64, 64, 8, 3),
              Tile(64, 64, 64, 4, 4), Tile(256, 64, 64, 8, 4)],
    "wide": [Tile(256, 128, 64, 8, 3), Tile(256, 128, 64, 8, 4), Tile(128, 256, 64, 8, 3),
             Tile(128, 128, 64, 4, 4)],
    "tiny": [Tile(64, 128, 64, 4, 4), Tile(64, 64, 64, 4, 4), Tile(128, 64, 64, 4, 4),
             Tile(64, 128, 64, 4, 3), Tile(128, 128, 64, 4, 4)],
    # the stem: forward over its folded 32 channels, backward-data into 3 channels padded to 16
    "flat": [Tile(128, 64, 32, 4, 3), Tile(256, 64, 32, 8, 3), Tile(128, 64, 32, 4, 4),
             Tile(64, 64, 32, 4, 4), Tile(256, 64, 32, 8, 4)],
    "narrow": [Tile(128, 16, 64, 4, 3), Tile(256, 16, 64, 8, 3), Tile(128, 16, 64, 4, 4),
               Tile(64, 16, 64, 4, 4), Tile(256, 16, 32, 4, 4)],
}
# Left out of every list: a 128 x 128 tile on 8 warps with 64-voxel steps, whose results differed
# between calls at several shapes on an H200 (Triton 3.6); see tiles.py.
BOXW = {
    "small": [Tile(64, 64, 128, 4, 3), Tile(64, 64, 128, 4, 3, 8, 3), Tile(64, 64, 128, 8, 3, 8, 3),
              Tile(64, 128, 128, 8, 3), Tile(64, 64, 64, 4, 3, 8, 3), Tile(64, 64, 64, 4, 4, 8, 3),
              Tile(64, 128, 128, 8, 3, 8, 3), Tile(64, 128, 64, 8, 4, 8, 3)],
    "wide": [Tile(128, 128, 128, 8, 3), Tile(128, 64, 128, 4, 3), Tile(128, 64, 128, 8, 3, 8, 3),
             Tile(128, 64, 64, 8, 3, 8, 3), Tile(128, 64, 64, 8, 4, 8, 3), Tile(128, 64, 64, 4, 4)],
    "tiny": [Tile(128, 128, 128, 8, 3), Tile(64, 64, 128, 4, 3), Tile(128, 64, 64, 4, 3, 8, 3)],
    "narrow": [Tile(16, 64, 128, 4, 3), Tile(16, 64, 256, 4, 3), Tile(16, 64, 128, 4, 4),
               Tile(16, 64, 64, 4, 4)],
    "flat": [Tile(64, 32, 128, 4, 3), Tile(64, 32, 64, 4, 4), Tile(64, 32, 256, 8, 3),
             Tile(64, 32, 128, 4, 4)],
}


def uses_box(site) -> bool:
    """Whether the launchers take the box kernels for this site (bf16, channels-last operands)."""
    return not transposed(site) and site.cout % 8 == 0  # odd Cin (the stem): folded or padded


def site_ops(site) -> dict:
    """direction -> (table op, shape class) as the launchers look them up."""
    taps = math.prod(site.weight[2:])
    in_voxels, out_voxels = math.prod(site.inputs[0][2:]), math.prod(site.output[2:])
    if uses_box(site):
        v = out_voxels
        return {"fwd": ("box", shape_class(site.cin, site.cout, taps, v)),
                "bwd_data": ("box", shape_class(site.cout, site.cin, taps, v)),
                "bwd_weight": ("boxw", shape_class(site.cin, site.cout, taps, v))}
    if (transposed(site) and site.cin % 8 == 0 and site.cout % 16 == 0
            and in_voxels >= TRANSPOSED_BOX_MIN_VOXELS):  # backward on the box kernels
        v = in_voxels  # the backward passes' boxes
        return {"fwd": ("convT", shape_class(site.cin, site.cout, taps)),
                "bwd_data": ("box", shape_class(site.cout, site.cin, taps, v)),
                "bwd_weight": ("boxw", shape_class(site.cout, site.cin, taps, v))}
    if transposed(site):
        return {"fwd": ("convT", shape_class(site.cin, site.cout, taps)),
                "bwd_data": ("gather", shape_class(site.cout, site.cin, taps)),
                "bwd_weight": ("wgrad", shape_class(site.cout, site.cin, taps))}
    # Cout not a multiple of 8 (the head): backward-weight on the box kernel over a padded dy
    return {"fwd": ("gather", shape_class(site.cin, site.cout, taps)),
            "bwd_data": ("gather", shape_class(site.cout, site.cin, taps)),
            "bwd_weight": ("boxw", shape_class(site.cin, site.cout, taps, out_voxels))}


def candidates(op: str, cls: str) -> list:
    if op in ("box", "boxw"):
        table = BOX if op == "box" else BOXW
        return table.get(cls, table["wide"])
    if op == "wgrad":
        return WGRAD["flat" if cls == "flat" else "default"]
    return CANDIDATES[cls]


def repeatable(call, times: int = 4) -> bool:
    """Whether `times` calls give bitwise the same result."""
    once = call().clone()
    return all(torch.equal(once, call()) for _ in range(times - 1))


def tune(scale: int, names=None, ops=None, log=print) -> dict:
    arch, dt = arch_key(torch.device("cuda")), torch.bfloat16
    sums: dict[str, list[float]] = {}
    for site in conv_sites(scale):
        if not site.matches(names):
            continue
        x, w, b, dy = site_tensors(site)
        calls = triton_calls(site, x, w, b, dy)
        for d, (op, cls) in site_ops(site).items():
            if ops and op not in ops:
                continue
            key = f"{arch}|{dtype_key(dt)}|{op}|{cls}"
            cands = candidates(op, cls)
            acc = sums.setdefault(key, [0.0] * len(cands))
            for i, tile in enumerate(cands):
                tiles.FORCED[op] = tile
                try:
                    ms = time_ms(calls[d]) if repeatable(calls[d]) else math.inf
                    if ms == math.inf:
                        log(f"  {site.name} {d} {tile}: NOT REPEATABLE, disqualified")
                except Exception as e:  # a config that does not fit (shared memory) just loses
                    ms = math.inf
                    log(f"  {site.name} {d} {tile}: {type(e).__name__}")
                finally:
                    tiles.FORCED.clear()
                acc[i] += site.count * ms
                log(f"{site.name:28s} {d:10s} {key:28s} {tile}: {ms:.4f} ms")
        del x, w, b, dy
        torch.cuda.empty_cache()
    table = {}
    for key, acc in sums.items():
        cls, op = key.split("|")[3], key.split("|")[2]
        best = min(range(len(acc)), key=lambda i: acc[i])
        if math.isinf(acc[best]):
            log(f"no candidate for {key} ran (and repeated bitwise): key left out")
            continue
        t = candidates(op, cls)[best]
        table[key] = [t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, t.group_m]
        if t.taps != 1:
            table[key].append(t.taps)
        log(f"best {key}: {t} total {acc[best]:.3f} ms (candidates: "
            + ", ".join(f"{a:.3f}" for a in acc) + ")")
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=7)
    p.add_argument("--sites", default="", help="comma-separated substrings of the sites' module names")
    p.add_argument("--ops", default="", help="comma-separated table ops to tune (default: all)")
    p.add_argument("--out", default="", help="write the chosen table as JSON here")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the TABLE block of tiles.py")
    mode.add_argument("--print", action="store_true", help="print that block, rewrite nothing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scaffold.bench.tune_conv: needs a CUDA GPU", file=sys.stderr)
        return 2
    table = tune(args.scale, [n for n in args.sites.split(",") if n] or None,
                 [o for o in args.ops.split(",") if o] or None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
    print(json.dumps(table, indent=1))
    if args.write or args.print:  # keys not tuned in this run keep their rows
        block = rewrite_block(tiles.__file__, "TABLE", {**tiles.TABLE, **table}, write=args.write)
        if args.print:
            print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
