"""The Gluon conv kernels compiled ahead of time for sm_90, on any machine (no GPU needed).

    python -m scaffold.bench.gluon_aot [TILE ...] [--cin 128] [--cout 128] [--size 64] [--dump DIR]

TILE as scaffold.bench.gluon_conv takes it (e.g. 4x8x8x128:4:w1d:8), or w and a backward-weight tile
(e.g. w4x4x8:4 or w4x4x8:3:c: scaffold.kernels.conv.gluon_wgrad); default: the default tiles of 64→64 and
128→128, and the backward-weight kernel's. For each tile it binds the kernel's arguments as a launch
would (the JIT's own binder against the CUDA backend of an sm_90 target, tensors as stand-ins: the
kernel modules' `kernel_arguments`), compiles through ptxas, and reports what answers most questions
before any device time is spent: registers, spills, shared memory, the Hopper instructions present (HGMMA: the warpgroup
MMA; UTMALDG: the copy engine's loads) and ptxas's notes on the MMAs, e.g. C7517 (a wgmma.wait_group
injected because registers an in-flight MMA writes are read: the MMAs no longer overlap each other)
and C7515 (wgmma serialized). Uses Triton internals that move between releases: where they are
missing it says so and exits 2.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

SM90_SMEM_LIMIT = 232448  # bytes of shared memory one block may opt in to on sm_90 (227 KiB)


def unavailable_reason() -> str | None:
    """None when this Triton can compile the kernel for sm_90 here, else why not."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler.compiler import make_backend  # noqa: F401
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: F401

        from scaffold.kernels.conv import gluon as G
    except Exception as e:  # noqa: BLE001 - any missing piece means: cannot, and why
        return f"{type(e).__name__}: {e}"
    if G._GLUON_ERROR is not None:  # Gluon's Hopper modules did not import
        return G._GLUON_ERROR
    if _tool("cuobjdump") is None:
        return "cuobjdump is not in this Triton's package"
    return None


def _target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)


def _tool(name: str) -> str | None:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def _stand_ins(tile, n: int, cin: int, cout: int, size: tuple):
    """NDHWC input view, weight matrix, channels-last output and bias as shape-only tensors."""
    import torch
    from triton.runtime.jit import MockTensor

    from scaffold.bench.gluon_conv import is_wgrad

    class Strided(MockTensor):  # MockTensor's own strides are not the contiguous ones
        def __init__(self, dtype, shape, strides=None):
            super().__init__(dtype, shape)
            if strides is None:
                strides = [1] * len(shape)
                for i in range(len(shape) - 2, -1, -1):
                    strides[i] = strides[i + 1] * shape[i + 1]
            self._strides = tuple(strides)

        def stride(self):
            return self._strides

    d, h, w = size
    xv = Strided(torch.bfloat16, [n, d, h, w, cin])
    if is_wgrad(tile):  # backward-weight: x, dy and the partials
        from scaffold.kernels.conv import gluon_wgrad as GW
        return (xv, Strided(torch.bfloat16, [n, d, h, w, cout]),
                Strided(torch.float32, list(GW.partials_shape((n, d, h, w, cin), cout, tile, 132))))
    wm = Strided(torch.bfloat16, [27 * cin, cout])
    out = Strided(torch.bfloat16, [n, cout, d, h, w], (d * h * w * cout, 1, h * w * cout, w * cout, cout))
    return xv, wm, out, Strided(torch.bfloat16, [cout])


def compile_tile(tile, cin: int = 128, cout: int = 128, size: tuple = (64, 64, 64), n: int = 1,
                 bias: bool = True):
    """The compiled kernel (triton's CompiledKernel) of one tile for sm_90 (a WgradTile: the
    backward-weight kernel's)."""
    import triton
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from scaffold.bench.gluon_conv import is_wgrad
    from scaffold.kernels.conv import gluon as G
    from scaffold.kernels.conv import gluon_wgrad as GW
    from scaffold.kernels.lib.launch import unwrap

    if is_wgrad(tile):
        fn = unwrap(GW._conv3x3x3_wgrad_kernel)
        _, args, kwargs = GW.kernel_arguments(*_stand_ins(tile, n, cin, cout, size), tile)
    else:
        fn = unwrap(G._conv3x3x3_halo_ws_kernel if tile.halo_ws else G._conv3x3x3_kernel)
        xv, wm, out, b = _stand_ins(tile, n, cin, cout, size)
        _, args, kwargs = G.kernel_arguments(xv, wm, out, tile, b if bias else None)
    backend = make_backend(_target())
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**kwargs, "debug": False}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=_target(),
                          options=options.__dict__)


def report(compiled) -> dict:
    """Registers, spills, shared memory, instruction counts and ptxas's notes of a compiled kernel."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    with tempfile.TemporaryDirectory() as tmp:
        cub, src = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cub, "wb") as f:
            f.write(cubin)
        with open(src, "w") as f:
            f.write(ptx)
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cub], capture_output=True,
                               text=True, timeout=120).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cub], capture_output=True, text=True,
                              timeout=120).stdout
        log = subprocess.run([get_ptxas(_target().arch).path, "-v", "--gpu-name=sm_90a", src, "-o",
                              os.path.join(tmp, "k.o")], capture_output=True, text=True, timeout=300).stderr
    res = {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL):(\d+)", usage)}
    return {
        "registers": res.get("REG", -1),
        "spill_bytes": res.get("LOCAL", 0) + sum(int(v) for v in re.findall(r"(\d+) bytes spill", log)),
        "shared": compiled.metadata.shared,
        "fits": compiled.metadata.shared <= SM90_SMEM_LIMIT,
        "warps": compiled.metadata.num_warps,
        "hgmma": len(re.findall(r"\bHGMMA\b", sass)),
        "utmaldg": len(re.findall(r"\bUTMALDG\b", sass)),
        "notes": sorted(set(re.findall(r"\((C\d+)\)", log))),
        "sass": sass,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tiles", nargs="*", help="BDxBHxBWxBN:stages:h|q|pK|wK|x[d]:warps[:bk], or "
                   "wBDxBHxBW:stages for the backward-weight kernel (default: the default tiles of "
                   "64→64 and 128→128, and the backward-weight kernel's)")
    p.add_argument("--cin", type=int, default=128)
    p.add_argument("--cout", type=int, default=128)
    p.add_argument("--size", type=int, default=64, help="D = H = W of the input")
    p.add_argument("--dump", default="", help="write each tile's SASS here")
    p.add_argument("--out", default="", help="write the reports (SASS left out) as JSON here")
    args = p.parse_args(argv)
    why = unavailable_reason()
    if why:
        print(f"scaffold.bench.gluon_aot: cannot compile for sm_90 here: {why}", file=sys.stderr)
        return 2
    from scaffold.bench.gluon_conv import parse_tile, parse_wgrad_tile, tile_name
    from scaffold.kernels.conv import gluon as G
    from scaffold.kernels.conv import gluon_wgrad as GW

    tiles = ([parse_wgrad_tile(t[1:]) if t.startswith("w") else parse_tile(t) for t in args.tiles]
             or [G.default_tile(64, 64), G.default_tile(128, 128), GW.DEFAULT_TILE])
    failed, reports = 0, {}
    print(f"{'tile':26s} {'regs':>5s} {'spill':>6s} {'shared':>7s} {'fits':>5s} {'HGMMA':>6s} "
          f"{'UTMALDG':>8s}  notes")
    for t in tiles:
        try:
            r = report(compile_tile(t, args.cin, args.cout, (args.size,) * 3))
        except Exception as e:  # noqa: BLE001 - one failing tile must not lose the rest
            failed += 1
            reports[tile_name(t)] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
            print(f"{tile_name(t):26s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        reports[tile_name(t)] = {k: v for k, v in r.items() if k != "sass"}
        print(f"{tile_name(t):26s} {r['registers']:5d} {r['spill_bytes']:6d} {r['shared']:7d} "
              f"{str(r['fits']):>5s} {r['hgmma']:6d} {r['utmaldg']:8d}  {','.join(r['notes']) or '-'}")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, tile_name(t).replace(":", "_") + ".sass"), "w") as f:
                f.write(r["sass"])
    if args.out:
        from scaffold.bench import write_json
        write_json(args.out, reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
