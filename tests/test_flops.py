"""The FLOP model (scaffold/model/flops.py) against torch's own count, and the bf16 peak table."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scaffold.model import flops
from scaffold.model.unet import UNet3d


@pytest.mark.parametrize("scale, bottleneck, width, classes, batch", [(4, 2, 4, 3, 2), (3, 1, 2, 6, 1)])
def test_step_flops_match_torchs_flop_counter(scale, bottleneck, width, classes, batch):
    torch.manual_seed(0)
    model = UNet3d(scale, bottleneck=bottleneck, base_width=width, groups=2, n_classes=classes)
    x = torch.randn(batch, 3, *(2**scale,) * 3)
    with FlopCounterMode(display=False) as counter:
        model(x).float().square().mean().backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    ours = flops.step_flops(scale, bottleneck, width, classes, 3, batch)
    assert ours["forward"] == counts["aten.convolution"]
    assert ours["backward"] == counts["aten.convolution_backward"]
    assert ours["total"] == counter.get_total_flops()


def test_the_benchmark_models_step():
    sites = flops.conv_sites(7)
    assert len(sites) == 2 + 2 * 4 + 3 * 4 + 1  # stem, Downs, Ups (transposed conv + 2), head
    assert [s.name for s in sites if not s.input_grad] == ["inc.conv1"]
    total = flops.step_flops(7)
    assert total["total"] == total["forward"] + total["backward"]
    assert 11.4e12 < total["total"] < 11.5e12
    assert flops.step_flops(7, batch=2)["total"] == 2 * total["total"]


def test_bf16_peaks_by_device_name():
    assert flops.bf16_peak_tflops("NVIDIA H200") == 989.0
    assert flops.bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert flops.bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert flops.bf16_peak_tflops("AMD EPYC 9554 64-Core Processor") is None
    assert flops.bf16_peak_tflops(None) is None
