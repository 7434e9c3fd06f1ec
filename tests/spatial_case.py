"""A small U-Net, loss and batch that tests/spatial_worker.py (each rank) and tests/test_spatial.py
(one process) build identically."""
from __future__ import annotations

import torch


def case(scale: int, batch: int = 2, n_classes: int = 4, bottleneck: int = 2, device=None, norm: str = "auto"):
    """(model, loss, input, labels), built on the CPU from fixed seeds, then moved to `device` (CUDA:
    channels-last, as the trainer runs it); `norm` is the GroupNorms' ladder setting (`triton` runs
    them on the Triton kernels on a CPU too, in the interpreter)."""
    from scaffold.loss import SegmentationLoss
    from scaffold.model.unet import UNet3d

    torch.manual_seed(0)
    model = UNet3d(scale, bottleneck=bottleneck, base_width=8, groups=4, in_channels=3, n_classes=n_classes)
    g = torch.Generator().manual_seed(1)
    edge = 2 ** scale
    labels = torch.randint(0, n_classes, (batch, edge, edge, edge), generator=g, dtype=torch.uint8)
    labels[0, :, :, : edge // 2] = 0  # some structure: a half-empty volume
    x = torch.randn(batch, 3, edge, edge, edge, generator=g)
    loss = SegmentationLoss(torch.tensor([0.5] + [2.0] * (n_classes - 1)))
    if norm != "auto":
        from scaffold.config import LadderConfig
        from scaffold.model.ladder import set_ladder

        set_ladder(model, LadderConfig(group_norm=norm))
    if device is not None and torch.device(device).type == "cuda":
        model = model.to(device, memory_format=torch.channels_last_3d)
        loss, x, labels = loss.to(device), x.to(device).contiguous(memory_format=torch.channels_last_3d), labels.to(device)
    return model, loss, x, labels
