"""The Gluon 3×3×3 conv (scaffold.kernels.conv.gluon) against deterministic cuDNN and our Triton kernel.

    python -m scaffold.bench.gluon_conv --scale 8 --sites inc.conv2 [--tiles 8x4x8x64:3:h:8,...]
                                        [--wtiles 4x4x8:4,...] [--directions fwd,bwd_data,bwd_weight]
                                        [--timer device] [--out g.json]
    python -m scaffold.bench.gluon_conv --check        # small odd shapes only: correctness

For each site of the U-Net (scaffold.bench.sites) that the Gluon kernel takes (3×3×3, padding 1,
channels multiples of 64) and each direction (forward; backward-data, the forward on the flipped
weight; backward-weight, scaffold.kernels.conv.gluon_wgrad), on the same bf16 NDHWC tensors, all in
one call: the Gluon kernels with each tile of `--tiles` (`--wtiles` for backward-weight; default: the
site's default tile), `cudnn_det` (cuDNN restricted to deterministic
algorithms without search: the vendor rung in training) and `triton` (the current box kernels).
Times are medians of scaffold.bench.timing (default `device`: CUDA-graph replays); TFLOP/s and the
share of 790 TFLOP/s (an H200's dense bf16 rate) are of the direction's 2·voxels·Cin·Cout·27 flops.
Correctness of each Gluon tile: relative error (Frobenius) against cuDNN in fp32 without tf32 on the
same bf16 operands, its output poisoned with NaN first (an element left unwritten shows), and the
current Triton kernel's error beside it. Needs a CUDA GPU; the Gluon columns need sm_90.
"""
from __future__ import annotations

import argparse
import sys

import torch

from scaffold.bench import write_json

PEAK_TFLOPS = 790.0
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def parse_tile(text: str):
    """'BDxBHxBWxBN:stages:mode:warps[:bk]' -> GluonTile. mode: h (d halo, one tile a program),
    q (one box per tap, one tile a program), pK (one box per tap, persistent, K programs per SM),
    wK (as pK, warp-specialized: a loader warp beside the MMA warps), x (d halo, warp-specialized:
    BD = 4, two MMA warpgroups, warps = 4, persistent); a trailing d (e.g. w1d) stores the output
    straight from the accumulators' registers."""
    from scaffold.kernels.conv.gluon import GluonTile

    try:
        box, stages, mode, warps, *bk = text.split(":")
        bd, bh, bw, bn = (int(v) for v in box.split("x"))
        direct = len(mode) > 1 and mode.endswith("d")
        mode = mode[:-1] if direct else mode
        if mode[:1] not in ("h", "p", "q", "w", "x") or len(bk) > 1:
            raise ValueError(f"mode {mode!r}")
        per_sm = int(mode[1:]) if mode[:1] in "pw" and len(mode) > 1 else 1
        return GluonTile(bd, bh, bw, bn, bk=int(bk[0]) if bk else 64, stages=int(stages),
                         halo=mode in ("h", "x"), warps=int(warps), persistent=mode[:1] in "pwx",
                         per_sm=per_sm, ws=mode[:1] in "wx", direct=direct)
    except ValueError as e:
        raise SystemExit(f"--tiles: {text!r}: expected BDxBHxBWxBN:stages:h|q|pK|wK|x[d]:warps[:bk], "
                         f"e.g. 4x8x8x128:4:w1d:8 ({e})") from None


def parse_wgrad_tile(text: str):
    """'BDxBHxBW:stages[:s|:c]' -> WgradTile (the backward-weight kernel's box and ring depth; a
    trailing :s splits every box's planes between the two MMA warpgroups instead of alternating
    boxes, :c gives each warpgroup 64 of a program's 128 output channels)."""
    from scaffold.kernels.conv.gluon_wgrad import WgradTile

    try:
        box, stages, *mode = text.split(":")
        if mode not in ([], ["s"], ["c"]):
            raise ValueError(f"mode {mode}")
        bd, bh, bw = (int(v) for v in box.split("x"))
        return WgradTile(bd, bh, bw, bco=128 if mode == ["c"] else 64, stages=int(stages),
                         split_planes=mode == ["s"])
    except ValueError as e:
        raise SystemExit(f"--wtiles: {text!r}: expected BDxBHxBW:stages[:s|:c], e.g. 4x4x8:4 ({e})") from None


def is_wgrad(tile) -> bool:
    """Whether `tile` is the backward-weight kernel's (a WgradTile), not the forward's."""
    from scaffold.kernels.conv.gluon_wgrad import WgradTile

    return isinstance(tile, WgradTile)


def tile_name(t) -> str:
    if is_wgrad(t):
        return f"w{t.bd}x{t.bh}x{t.bw}:{t.stages}" + {"alternate": "", "planes": ":s", "cout": ":c"}[t.mode]
    mode = ("x" if t.ws else "h") if t.halo else (f"{'w' if t.ws else 'p'}{t.per_sm}" if t.persistent else "q")
    return f"{t.bd}x{t.bh}x{t.bw}x{t.bn}:{t.stages}:{mode}{'d' if t.direct else ''}:{t.warps}:{t.bk}"


def _operands(n, cin, cout, size, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cl = torch.channels_last_3d
    x = torch.randn(n, cin, *size, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(cout, cin, 3, 3, 3, generator=gen, device="cuda") * (27 * cin) ** -0.5)
    dy = torch.randn(n, cout, *size, generator=gen, device="cuda").to(torch.bfloat16)
    return (x.contiguous(memory_format=cl), w.to(torch.bfloat16).contiguous(memory_format=cl),
            dy.contiguous(memory_format=cl))


def _references(x, w, dy):
    """fp32 cuDNN (no tf32) of each direction on the bf16 operands."""
    import torch.nn.functional as F

    xf, wf, dyf = x.float(), w.float(), dy.float()
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        fwd = F.conv3d(xf, wf, None, 1, 1)
        bwd, wgrad, _ = torch.ops.aten.convolution_backward(dyf, xf, wf, None, (1, 1, 1), (1, 1, 1),
                                                            (1, 1, 1), False, (0, 0, 0), 1,
                                                            [True, True, False])
    return {"fwd": fwd, "bwd_data": bwd, "bwd_weight": wgrad}


def tiles_for(tiles, direction: str) -> list:
    """The tiles of one direction: `tiles(direction)` when callable, else those of the list that
    are of its kernel (WgradTile for backward-weight, GluonTile for the others)."""
    if callable(tiles):
        return list(tiles(direction))
    return [t for t in tiles if is_wgrad(t) == (direction == "bwd_weight")]


def _rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def gluon_call(direction, x, w, dy, tile, out=None):
    from scaffold.kernels.conv import gluon as G
    from scaffold.kernels.conv import gluon_wgrad as GW

    if direction == "fwd":
        return lambda: G.conv3d_forward(x, w, out, tile)
    if direction == "bwd_weight":
        return lambda: GW.conv3d_backward_weight(dy, x, out, tile)
    return lambda: G.conv3d_backward_data(dy, w, out, tile)


def triton_call(direction, x, w, dy):
    from scaffold.kernels import conv as K

    g = ((1, 1, 1), (1, 1, 1), (1, 1, 1))
    if direction == "fwd":
        return lambda: K.conv3d_forward(x, w, None, *g)
    if direction == "bwd_weight":
        return lambda: K.conv3d_backward_weight(dy, x, w.shape, w.dtype, *g)
    return lambda: K.conv3d_backward_data(dy, w, x.shape, *g)


def cudnn_det_call(direction, x, w, dy):
    import torch.nn.functional as F

    def fwd():
        return F.conv3d(x, w, None, 1, 1)

    def backward(i):
        mask = [i == 0, i == 1, False]
        return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, (1, 1, 1), (1, 1, 1),
                                                           (1, 1, 1), False, (0, 0, 0), 1, mask)[i]

    def det(fn):
        def run():
            with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True,
                                            allow_tf32=False):
                return fn()
        return run
    return det(fwd if direction == "fwd" else backward(0 if direction == "bwd_data" else 1))


def check(n, cin, cout, size, tiles, directions=DIRECTIONS, with_triton=True, refs=None,
          operands=None) -> dict:
    """Relative errors of each tile (NaN-poisoned output) and of the Triton kernel, and whether
    two Gluon calls give the same bits."""
    x, w, dy = operands or _operands(n, cin, cout, size)
    refs = refs or _references(x, w, dy)
    row = {"shape": [n, cin, cout, *size]}
    for d in directions:
        shape = {"fwd": (n, cout, *size), "bwd_data": (n, cin, *size), "bwd_weight": tuple(w.shape)}[d]
        for t in tiles_for(tiles, d):
            key = f"gluon[{tile_name(t)}]_{d}"
            try:
                out = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
                out = out.contiguous(memory_format=torch.channels_last_3d)
                gluon_call(d, x, w, dy, t, out)()
                again = gluon_call(d, x, w, dy, t)()
                if tuple(again.shape) != tuple(shape):  # torch.equal would only say "differ"
                    raise ValueError(f"returned shape {tuple(again.shape)}, expected {tuple(shape)}")
                row[f"{key}_rel_err"] = _rel(out, refs[d])
                row[f"{key}_nan"] = bool(out.isnan().any().item())
                row[f"{key}_repeat_equal"] = bool(torch.equal(out, again))
            except Exception as e:  # one failing tile must not lose the rest
                row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        if with_triton:
            try:
                row[f"triton_{d}_rel_err"] = _rel(triton_call(d, x, w, dy)(), refs[d])
            except Exception as e:
                row[f"triton_{d}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


CHECK_SHAPES = [  # odd sizes: partial boxes and padding on every face
    (2, 64, 64, (5, 6, 7)),
    (1, 64, 128, (9, 12, 10)),
    (1, 128, 64, (16, 16, 16)),
    (1, 192, 128, (7, 8, 9)),
    (1, 64, 64, (33, 40, 48)),  # more tiles than programs: persistent programs take several
]


def bench_site(site, tiles, directions, timer, reps, do_check=True) -> dict:
    from scaffold.bench.timing import measure

    n, cin, cout = 1, site.cin, site.cout
    size = tuple(site.inputs[0][2:])
    x, w, dy = _operands(n, cin, cout, size)
    flop = 2.0 * n * size[0] * size[1] * size[2] * cin * cout * 27
    row = {"site": site.name, "modules": list(site.names), "count": site.count, "cin": cin,
           "cout": cout, "edge": site.edge, "gflop": flop / 1e9}
    if do_check:
        refs = _references(x, w, dy)
        row["check"] = check(n, cin, cout, size, tiles, directions, refs=refs, operands=(x, w, dy))
        del refs
        torch.cuda.empty_cache()
    for d in directions:
        calls = {f"gluon[{tile_name(t)}]": gluon_call(d, x, w, dy, t)
                 for t in tiles_for(tiles, d)}
        calls["cudnn_det"] = cudnn_det_call(d, x, w, dy)
        calls["triton"] = triton_call(d, x, w, dy)
        for name, fn in calls.items():
            try:
                row[f"{name}_{d}_ms"] = measure(fn, timer=timer, reps=reps).median
            except Exception as e:
                row[f"{name}_{d}_ms"] = None
                row[f"{name}_{d}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def format_site(row: dict, tiles, directions) -> str:
    lines = [f"{row['site']} {row['cin']}>{row['cout']}@{row['edge']} x{row['count']} "
             f"({row['gflop']:.1f} GFLOP a direction)"]
    for d in directions:
        names = [f"gluon[{tile_name(t)}]" for t in tiles_for(tiles, d)]
        for name in names + ["cudnn_det", "triton"]:
            ms = row.get(f"{name}_{d}_ms")
            err = row.get("check", {}).get(f"{name}_{d}_rel_err")
            if ms is None:
                lines.append(f"  {d:8s} {name:28s}   failed: {row.get(f'{name}_{d}_error', '')[:200]}")
                continue
            tf = row["gflop"] / ms
            e = "" if err is None else f"  rel_err {err:.2e}"
            lines.append(f"  {d:8s} {name:28s} {ms:8.3f} ms {tf:6.0f} TFLOP/s "
                         f"{100 * tf / PEAK_TFLOPS:5.1f}%{e}")
    return "\n".join(lines)


def default_tiles(G, cin, cout, wtiles=()):
    """Per direction, the default tile for its output width (backward-weight: `wtiles`, else its
    kernel's default tile)."""
    from scaffold.kernels.conv import gluon_wgrad as GW

    def tiles(d):
        if d == "bwd_weight":
            return list(wtiles) or [GW.tile_for(cout)]
        return [G.default_tile(cin, cout) if d == "fwd" else G.default_tile(cout, cin)]
    return tiles


def _tiles(user_tiles, wtiles, G, cin, cout):
    """Per direction: `--tiles` for forward and backward-data where given, `--wtiles` for
    backward-weight where given, else the defaults."""
    default = default_tiles(G, cin, cout, wtiles)
    return lambda d: default(d) if d == "bwd_weight" or not user_tiles else user_tiles


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="8", help="comma-separated scales")
    p.add_argument("--sites", default="", help="substrings of module names to keep (default: all "
                   "sites the kernel takes)")
    p.add_argument("--tiles", default="", help="comma-separated BDxBHxBWxBN:stages:h|q|pK|wK|x[d]:warps[:bk] "
                   "(default: each site's default tile)")
    p.add_argument("--wtiles", default="", help="backward-weight tiles, comma-separated BDxBHxBW:stages[:s|:c] "
                   "(default: its kernel's default tile)")
    p.add_argument("--directions", default="fwd,bwd_data,bwd_weight")
    p.add_argument("--timer", default="device", choices=("wall", "device"))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--check", action="store_true", help="only the small-shape correctness check")
    p.add_argument("--no-check", action="store_true", help="skip the per-site correctness check")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scaffold.bench.gluon_conv: needs a CUDA GPU", file=sys.stderr)
        return 2
    from scaffold.kernels.conv import gluon as G

    reason = G.unavailable_reason()
    if reason:
        print(f"scaffold.bench.gluon_conv: the Gluon kernel is unavailable here: {reason}",
              file=sys.stderr)
        return 2
    directions = [d for d in args.directions.split(",") if d]
    bad = [d for d in directions if d not in DIRECTIONS]
    if bad:
        p.error(f"--directions: {bad}: expected a subset of {','.join(DIRECTIONS)}")
    user_tiles = [parse_tile(t) for t in args.tiles.split(",") if t]
    wtiles = [parse_wgrad_tile(t) for t in args.wtiles.split(",") if t]
    result = {"device": torch.cuda.get_device_name(), "timer": args.timer, "checks": [], "sites": []}
    if args.check:
        for n, ci, co, size in CHECK_SHAPES:
            tiles = _tiles(user_tiles, wtiles, G, ci, co)
            row = check(n, ci, co, size, tiles, directions)
            print(row)
            result["checks"].append(row)
    else:
        from scaffold.bench.conv import conv_sites
        names = [s for s in args.sites.split(",") if s] or None
        for scale in (int(s) for s in args.scale.split(",") if s):
            for site in conv_sites(scale):
                if site.op != "conv" or not site.matches(names) or site.weight[2:] != (3, 3, 3):
                    continue
                if site.cin % 64 or site.cout % 64:
                    continue
                tiles = _tiles(user_tiles, wtiles, G, site.cin, site.cout)
                row = bench_site(site, tiles, directions, args.timer, args.reps, not args.no_check)
                row["scale"] = scale
                print(format_site(row, tiles, directions), flush=True)
                result["sites"].append(row)
                torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
