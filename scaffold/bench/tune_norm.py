"""GroupNorm tile sweep: device time of candidate tiles at the model's GroupNorm sites, on the GPU the
table is for.

    python -m scaffold.bench.tune_norm [--scales 7 8] [--loops] [--out norm_tiles.json]

Candidates: the split (statistics) passes' (elements, warps, programs per SM) with the elementwise
passes at the heuristic's (4096, 8), then the elementwise passes' (elements, warps) with the split
passes at the heuristic's (4096, 8, 4). `--loops` times instead the tile the table gives each site with
each option of its split loops (num_stages, loop_unroll_factor of `tl.range`, the same for the forward
and the backward), and checks that the bits stay those of the first option. Sites run as the model runs
them: bf16 channels-last input, bf16 output, ReLU; device time from CUDA-graph replays, the L2 flushed
before each (scaffold.bench.timing). Prints the fastest tile per width class (count-weighted over its
sites); the table, scaffold.kernels.groupnorm.TILE_TABLE, is edited by hand with the measurements
beside it. The JSON is rewritten after every site, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import astuple, replace

import torch

from scaffold.bench import write_json
from scaffold.bench.sites import distinct, model_sites
from scaffold.bench.timing import measure

EPS = 1e-5
SPLIT = [(4096, 8, 4), (4096, 8, 8), (8192, 8, 4), (2048, 4, 8), (2048, 4, 16), (16384, 16, 2),
         (2048, 8, 8), (4096, 4, 8), (8192, 16, 4), (4096, 8, 2), (8192, 8, 2)]
ELEMENTWISE = [(4096, 8), (2048, 4), (8192, 8), (16384, 16), (4096, 4), (1024, 4)]
LOOPS = [(0, 0), (0, 2), (0, 4), (2, 0), (3, 0), (4, 0), (2, 2)]  # (num_stages, unroll); 0: compiler's


def candidates(gn) -> list:
    return ([gn.NormTile(*split, *ELEMENTWISE[0]) for split in SPLIT]
            + [gn.NormTile(*SPLIT[0], *ew) for ew in ELEMENTWISE[1:]])


def loop_options(base) -> list:
    return [replace(base, fwd_stages=stages, fwd_unroll=unroll, bwd_stages=stages, bwd_unroll=unroll)
            for stages, unroll in LOOPS]


def width_class(channels: int) -> str:
    return "narrow" if channels <= 128 else "mid" if channels <= 256 else "wide"


def sweep_site(C: int, edge: int, groups: int, tiles: list, check_bits: bool, log=print) -> list[dict]:
    """Device ms of the forward and of the backward launchers at one site, per tile; with `check_bits`,
    whether each tile gives the first one's bits (tiles of other split sizes sum in another order)."""
    from scaffold.kernels import groupnorm as gn

    g = torch.Generator(device="cuda").manual_seed(0)
    cl = torch.channels_last_3d
    x = torch.randn((1, C, edge, edge, edge), generator=g, device="cuda").to(torch.bfloat16)
    x = x.contiguous(memory_format=cl)
    w = 1 + 0.1 * torch.randn(C, generator=g, device="cuda")
    b = 0.1 * torch.randn(C, generator=g, device="cuda")
    dy = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16).contiguous(memory_format=cl)
    rows, ref = [], None
    for tile in tiles:
        row = dict(channels=C, edge=edge, tile=list(astuple(tile)))
        try:
            y, mean, rstd = gn.forward(x, groups, w, b, EPS, True, torch.bfloat16, tile=tile)
            dx = gn.backward(dy, x, w, b, mean, rstd, groups, True, tile=tile)[0]
            if check_bits:
                bits = (y.view(torch.int16).sum().item(), dx.view(torch.int16).sum().item(),
                        mean.sum().item(), rstd.sum().item())
                ref = ref or bits
                row["same_bits"] = bits == ref
            row.update(
                fwd_ms=measure(lambda: gn.forward(x, groups, w, b, EPS, True, torch.bfloat16, tile=tile),
                               timer="device").median,
                bwd_ms=measure(lambda: gn.backward(dy, x, w, b, mean, rstd, groups, True, tile=tile),
                               timer="device").median)
            # Bytes the kernels move: forward 2 reads + 1 write, backward 4 reads + 1 write (bf16).
            row["tb_per_s"] = x.numel() * 16 / ((row["fwd_ms"] + row["bwd_ms"]) * 1e-3) / 1e12
        except Exception as exc:  # a tile that does not fit (registers, shared memory) just loses
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        log(row)
    return rows


def best_per_class(rows: list[dict], counts: dict) -> dict:
    """Per width class, the tile with the least count-weighted fwd + bwd over the class's sites (tiles
    that failed or changed the bits at any of them left out)."""
    totals: dict = {}
    for r in rows:
        key = (width_class(r["channels"]), tuple(r["tile"]))
        ok = "fwd_ms" in r and r.get("same_bits", True)
        ms = counts[(r["channels"], r["edge"])] * (r["fwd_ms"] + r["bwd_ms"]) if ok else math.inf
        totals[key] = totals.get(key, 0.0) + ms
    best: dict = {}
    for (cls, tile), ms in sorted(totals.items(), key=lambda item: item[1]):
        if math.isfinite(ms):
            best.setdefault(cls, (list(tile), ms))
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=int, nargs="+", default=[7, 8])
    p.add_argument("--loops", action="store_true",
                   help="time the split-loop options of the table's tiles")
    p.add_argument("--out", default="bench_results/norm_tiles.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scaffold.bench.tune_norm: needs a CUDA GPU", file=sys.stderr)
        return 2
    from scaffold.kernels import groupnorm as gn

    counts: dict = {}
    for scale in args.scales:
        for s in distinct(model_sites(scale, ("group_norm",))):
            counts[(s.cin, s.edge, s.groups)] = counts.get((s.cin, s.edge, s.groups), 0) + s.count
    rows: list[dict] = []
    for C, edge, groups in counts:
        tiles = (loop_options(gn.norm_tile(torch.device("cuda"), torch.bfloat16, C)) if args.loops
                 else candidates(gn))
        rows += sweep_site(C, edge, groups, tiles, check_bits=args.loops)
        torch.cuda.empty_cache()
        write_json(args.out, {"device": torch.cuda.get_device_name(), "loops": args.loops, "rows": rows})
    best = best_per_class(rows, {(c, e): n for (c, e, _), n in counts.items()})
    for cls, (tile, ms) in best.items():
        print(f"best {cls}: NormTile{tuple(tile)}, {ms:.3f} ms fwd + bwd over its sites "
              "(count-weighted)")
    write_json(args.out, {"device": torch.cuda.get_device_name(), "loops": args.loops, "rows": rows,
                          "best": best})
    return 0


if __name__ == "__main__":
    sys.exit(main())
