"""model.recompute=blocks: each DoubleConv keeps only its input and recomputes its activations in the
backward. The same kernels run on the same inputs, so loss and every gradient are bit for bit those of
the model that keeps its activations; and fewer tensors are saved for the backward."""
from __future__ import annotations

import pytest
import torch

from scaffold.loss import SegmentationLoss
from scaffold.model.unet import UNet3d


def _grads(recompute: bool, autocast: bool):
    torch.manual_seed(0)
    model = UNet3d(5, bottleneck=3, base_width=8, groups=4, n_classes=3).set_recompute(recompute)
    loss_fn = SegmentationLoss(torch.tensor([1.0, 2.0, 3.0]))
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 32, 32, 32, generator=g)
    labels = torch.randint(0, 3, (2, 32, 32, 32), generator=g, dtype=torch.uint8)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = loss_fn.terms(logits, labels)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_recompute_gives_the_same_bits(autocast):
    loss_a, grads_a, saved_a = _grads(False, autocast)
    loss_b, grads_b, saved_b = _grads(True, autocast)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    # What the forward keeps for the backward shrinks (the recomputed blocks keep their inputs only).
    assert saved_b < 0.6 * saved_a, (saved_b, saved_a)


def test_recompute_is_a_config_key(tmp_path):
    from helpers import tiny_cfg
    from scaffold.config import ConfigError
    from scaffold.plan import validate
    from scaffold.model.blocks import DoubleConv

    cfg = tiny_cfg(tmp_path, "model.recompute=blocks", "scale=5", "model.bottleneck=2")
    model = UNet3d.from_config(cfg, 3)
    # The layout: stem and Down blocks whole, Up levels below full resolution whole, the full-resolution
    # Up's DoubleConv one conv + norm at a time.
    assert model.inc.recompute == "block" and all(d.conv.recompute == "block" for d in model.downs)
    assert all(u.recompute and u.conv.recompute == "" for u in model.ups[:-1])
    assert not model.ups[-1].recompute and model.ups[-1].conv.recompute == "convs"
    off = UNet3d.from_config(tiny_cfg(tmp_path, "model.recompute=off"), 3)
    assert not any(m.recompute for m in off.modules() if isinstance(m, DoubleConv))
    cfg = tiny_cfg(tmp_path, "model.recompute=everything")
    with pytest.raises(ConfigError, match=r"^model.recompute='everything': expected auto \| off \| blocks$"):
        validate(cfg)


@pytest.mark.gpu
def test_graphed_training_with_recompute_gives_the_same_bits(cache, tmp_path):
    """On the GPU, through the trainer: the step captured as a CUDA graph with recompute on trains
    bit for bit as with it off (routed convs, Triton GroupNorm, bf16 autocast)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from helpers import params, same_params, stable_rows, tiny_cfg
    from scaffold import worker

    small = ["scale=5", "model.bottleneck=3", "model.base_width=16", "model.groups=8", "device=cuda",
             "epochs=2", "warmup_steps=1"]
    runs = {}
    for mode in ("off", "blocks"):
        runs[mode] = tmp_path / mode
        result = worker.run(tiny_cfg(cache, *small, f"model.recompute={mode}"), runs[mode])
        assert result["cuda_graph"]
    assert stable_rows(runs["off"] / "train_stats.csv") == stable_rows(runs["blocks"] / "train_stats.csv")
    assert same_params(params(runs["off"]), params(runs["blocks"]))
