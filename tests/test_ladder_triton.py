"""The real Triton rungs, forced on a tiny U-Net (the interpreter on CPU, the GPU when present):
every site runs on `triton`, nothing falls back, and results agree with vendor."""
import warnings

import pytest
import torch

from scaffold.config import LadderConfig
from scaffold.kernels.lib.device import triton_usable
from scaffold.model import UNet3d, census, set_ladder

for _module in ("scaffold.kernels.conv", "scaffold.kernels.groupnorm", "scaffold.kernels.concat",
                "scaffold.kernels.pool"):
    pytest.importorskip(_module)


@pytest.mark.slow
def test_forced_triton_unet_matches_vendor():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not triton_usable(torch.empty(0, device=device)):
        pytest.skip("Triton cannot run here (no GPU and no interpreter)")
    torch.manual_seed(0)
    model = UNet3d(2, bottleneck=1, base_width=4, groups=2).to(device)
    x = torch.randn(1, 3, 4, 4, 4, device=device)
    y_vendor = model(x)
    y_vendor.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    set_ladder(model, LadderConfig("triton", "triton", "triton", "triton", "triton"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unsupported site, no fallback
        y = model(x)
        y.square().sum().backward()
    c = census(model)
    assert c["fallbacks"] == []
    assert c["conv"] == {"triton": 7} and c["conv_transpose"] == {"triton": 1}
    assert c["group_norm"] == {"triton": 6} and c["concat"] == {"triton": 1} and c["pool"] == {"triton": 1}
    # fp32 on the GPU may multiply in TF32 (10-bit mantissa); the interpreter computes in fp32
    tol = dict(rtol=1e-2, atol=1e-2) if device == "cuda" else dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(y, y_vendor, **tol)
    for (name, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(p.grad, g, **tol, msg=name)
