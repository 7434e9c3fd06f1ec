"""Determinism probe: `python -m scaffold.bench.determinism [--scale 7] [--repeats 5] [--out FILE]`.

Repeats the same forward + loss + backward from identical state several times and hashes every parameter
gradient, every module's first-batch activation, the loss and the Dice values; then repeats a short
training run (a few Adam steps) and hashes the parameters. It reports how many tensors vary, per module.

A control arm proves the probe can fail: `F.nll_loss(..., reduction="sum")` on CUDA accumulates with
atomics, so at 128³ its value changes between identical calls. Below about 96³ the atomics rarely
collide, so on the GPU probe at 128³ or more; on the CPU the control is reported as not applicable.
"""
from __future__ import annotations

import argparse
import hashlib
from collections import defaultdict

import torch
import torch.nn.functional as F

from scaffold import determinism
from scaffold.bench import model_bench_setup, write_json
from scaffold.config import Config, LadderConfig
from scaffold.model.policy import OPS


def _digest(t) -> str:
    if isinstance(t, tuple):  # a module with several outputs (the pool with its skip): each in turn
        return hashlib.sha256("".join(_digest(x) for x in t).encode()).hexdigest()[:16]
    t = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]


def _volume(scale: int, n_classes: int, seed: int, device: torch.device) -> torch.Tensor:
    """A realistic mask: random blobs of classes (smooth noise, argmax), not i.i.d. voxels."""
    g = torch.Generator().manual_seed(seed)
    edge = 2**scale
    coarse = torch.rand(1, n_classes, max(edge // 8, 2), max(edge // 8, 2), max(edge // 8, 2), generator=g)
    fine = F.interpolate(coarse, size=(edge,) * 3, mode="trilinear", align_corners=False)
    return fine.argmax(1).to(torch.uint8).to(device)


def probe(scale: int, repeats: int, train_steps: int, ladder: LadderConfig, device: torch.device,
          base_width: int = 64) -> dict:
    from scaffold.data.loader import make_input
    from scaffold.loss import SegmentationLoss
    from scaffold.metrics import hard_dice
    from scaffold.model.unet import UNet3d

    n_classes = 6
    cfg = Config(scale=scale)
    cfg.model.base_width = base_width
    determinism.seed_all(0)
    model = UNet3d.from_config(cfg, n_classes).to(device)
    from scaffold.model.ladder import set_ladder

    set_ladder(model, ladder)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last_3d)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    palette = torch.rand(n_classes, 3, generator=g).to(device)
    palette[0] = 0
    masks = _volume(scale, n_classes, 2, device)
    loss_fn = SegmentationLoss(torch.linspace(0.5, 2.0, n_classes), rung=ladder.loss).to(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    activations: dict[str, str] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, name=name: activations.__setitem__(
        name, _digest(out))) for name, m in model.named_modules() if not list(m.children())]

    seen: dict[str, set] = defaultdict(set)
    for _ in range(repeats):
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        activations.clear()
        with amp:
            logits = model(make_input(masks, palette))
        loss, ce, dice = loss_fn.terms(logits, masks.long())
        loss.backward()
        seen["value/loss"].add(_digest(loss))
        seen["value/ce"].add(_digest(ce))
        seen["value/soft_dice"].add(_digest(dice))
        seen["value/hard_dice"].add(_digest(hard_dice(logits.detach(), masks.long(), n_classes)))
        for name, h in activations.items():
            seen[f"activation/{name}"].add(h)
        for name, p in model.named_parameters():
            seen[f"grad/{name}"].add(_digest(p.grad))
    for h in hooks:
        h.remove()

    for _ in range(2):  # a short training run, twice from the same state
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(train_steps):
            with amp:
                logits = model(make_input(masks, palette))
            loss_fn(logits, masks.long()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            seen[f"trained/{name}"].add(_digest(p))

    varying = {k: len(v) for k, v in seen.items() if len(v) > 1}
    per_module: dict[str, int] = defaultdict(int)
    for k in varying:
        kind, name = k.split("/", 1)
        per_module[name.rsplit(".", 1)[0] if kind in ("grad", "trained") else name] += 1

    control = None
    if device.type == "cuda":
        edge = 2**scale
        lg = torch.randn(1, n_classes, edge, edge, edge, device=device, generator=None)
        lp = F.log_softmax(lg.float(), 1)
        lab = masks.long()
        w = torch.linspace(0.5, 2.0, n_classes, device=device)
        values = {F.nll_loss(lp, lab, weight=w, reduction="sum").item() for _ in range(100)}
        control = {"op": "F.nll_loss(reduction='sum')", "calls": 100, "distinct": len(values)}
    from scaffold.model.ladder import census

    return {"scale": scale, "repeats": repeats, "train_steps": train_steps, "device": str(device),
            "census": census(model, loss_fn),
            "tensors": len(seen), "varying": len(varying), "varying_per_module": dict(per_module),
            "varying_detail": varying, "control": control}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=None, help="default: 7 on CUDA, 4 on the CPU")
    ap.add_argument("--base-width", type=int, default=None, help="default: 64 on CUDA, 8 on the CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--ladder", default="auto", help="rung for every op kind: auto | triton | vendor")
    ap.add_argument("--out", default="bench_results/determinism.json")
    args = ap.parse_args(argv)
    device, scale = model_bench_setup(args.scale)
    width = args.base_width or (64 if device.type == "cuda" else 8)
    ladder = LadderConfig(**{op: args.ladder for op in OPS})  # every kind, the pool and the loss head too
    res = probe(scale, args.repeats, args.train_steps, ladder, device, width)
    print(f"determinism probe: scale {scale} ({2**scale}³), width {width}, {device}, {args.repeats} repeats, "
          f"{args.train_steps} training steps x2")
    print(f"  tensors hashed: {res['tensors']}   varying: {res['varying']}")
    for name, n in sorted(res["varying_per_module"].items()):
        print(f"    {name}: {n} varying")
    c = res["control"]
    if c is None:
        print("  control (nll_loss reduction='sum' on CUDA): not applicable on the CPU")
    else:
        print(f"  control {c['op']}: {c['distinct']} distinct values in {c['calls']} calls "
              f"({'the probe can fail' if c['distinct'] > 1 else 'no variation seen: increase --scale'})")
    write_json(args.out, res)
    return 0 if res["varying"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
