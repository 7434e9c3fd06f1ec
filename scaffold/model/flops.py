"""The model's floating-point operations per training step, from its shapes, and devices' bf16 peaks.

Counted: every convolution's multiply-adds, as 2 FLOPs each — the 3×3×3 convolutions (padding 1,
output the size of the input), the 2×2×2 stride-2 transposed convolutions (each output voxel takes one
tap of every input channel) and the 1×1×1 head. A convolution's forward is 2 · output voxels · C_out ·
C_in · taps; its backward is the same again for the weight gradient and again for the input gradient,
except the stem's first convolution, whose input (the image) needs no gradient. Not counted: biases,
GroupNorm, ReLU, pooling, the skip concat, the loss and the optimizer (elementwise and memory-bound:
under 1% of the arithmetic at scale 7). The same convention as torch.utils.flop_counter (a test checks
it against FlopCounterMode).

At scale 7 with the defaults (batch 1, 6 labels) a step is 11.42 TFLOP: 3.81 forward, 7.60 backward.

Peaks: NVIDIA's dense (no sparsity) bf16 tensor-core figures, by device name. They are the usual
denominator of a model-FLOPs utilization; the 790 TFLOP/s docs/performance.md uses for an H200 is what
a large bf16 GEMM measures there (about 80% of the 989 spec), a practical ceiling rather than the peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ConvSite:
    name: str
    c_in: int
    c_out: int
    taps: int
    """Kernel taps each output voxel takes per input channel: 27, 1 (transposed, stride = kernel) or 1."""
    out_voxels: int
    input_grad: bool = True

    @property
    def forward(self) -> int:
        return 2 * self.out_voxels * self.c_out * self.c_in * self.taps

    @property
    def backward(self) -> int:
        return self.forward * (2 if self.input_grad else 1)


def conv_sites(scale: int, bottleneck: int = 3, base_width: int = 64, n_classes: int = 6,
               in_channels: int = 3, batch: int = 1) -> list[ConvSite]:
    """Every convolution of UNet3d (scaffold.model.unet) with its shapes, stem to head."""
    levels = scale - bottleneck
    widths = [base_width * 2**i for i in range(levels + 1)]
    voxels = [batch * (2 ** (scale - level)) ** 3 for level in range(levels + 1)]
    sites = [ConvSite("inc.conv1", in_channels, widths[0], 27, voxels[0], input_grad=False),
             ConvSite("inc.conv2", widths[0], widths[0], 27, voxels[0])]
    for level in range(1, levels + 1):
        sites += [ConvSite(f"downs.{level - 1}.conv1", widths[level - 1], widths[level], 27, voxels[level]),
                  ConvSite(f"downs.{level - 1}.conv2", widths[level], widths[level], 27, voxels[level])]
    for i, level in enumerate(reversed(range(1, levels + 1))):
        wide, narrow, out = widths[level], widths[level - 1], voxels[level - 1]
        sites += [ConvSite(f"ups.{i}.up", wide, narrow, 1, out),
                  ConvSite(f"ups.{i}.conv1", wide, narrow, 27, out),
                  ConvSite(f"ups.{i}.conv2", narrow, narrow, 27, out)]
    sites.append(ConvSite("outc", widths[0], n_classes, 1, voxels[0]))
    return sites


def step_flops(scale: int, bottleneck: int = 3, base_width: int = 64, n_classes: int = 6,
               in_channels: int = 3, batch: int = 1) -> dict[str, int]:
    """FLOPs of one training step: {"forward", "backward", "total"}."""
    sites = conv_sites(scale, bottleneck, base_width, n_classes, in_channels, batch)
    forward = sum(s.forward for s in sites)
    backward = sum(s.backward for s in sites)
    return {"forward": forward, "backward": backward, "total": forward + backward}


def config_step_flops(cfg, n_classes: int) -> int:
    """FLOPs of one step of a run's model on one whole batch (a scaffold.config.Config)."""
    m = cfg.model
    return step_flops(cfg.scale, m.bottleneck, m.base_width, n_classes, 3, cfg.batch_size)["total"]


# Dense bf16 tensor-core peaks, TFLOP/s, by a substring of torch.cuda.get_device_name (checked in order).
BF16_PEAK_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (HBM3)
    ("A100", 312.0),
)


def bf16_peak_tflops(device_name: Optional[str]) -> Optional[float]:
    """The device's dense bf16 peak in TFLOP/s, or None for a CPU or an unlisted device."""
    if not device_name:
        return None
    for key, peak in BF16_PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None
