"""UNet3d: sizes and layer counts, layouts, bad input, and equivalence with a stock-torch U-Net."""
import pytest
import torch
import torch.nn as nn

from scaffold.config import Config, ConfigError
from scaffold.model import UNet3d


def _count(model, kind, exclude=()):
    return sum(isinstance(m, kind) and not isinstance(m, exclude) for m in model.modules())


def test_scale7_sizes_on_meta():
    with torch.device("meta"):
        model = UNet3d(7)
    assert sum(p.numel() for p in model.parameters()) == 90_302_342
    assert _count(model, nn.Conv3d, exclude=nn.ConvTranspose3d) == 19
    assert _count(model, nn.ConvTranspose3d) == 4
    assert _count(model, nn.GroupNorm) == 18


def test_output_shape_small_scale():
    torch.manual_seed(0)
    model = UNet3d(4, base_width=8, groups=4)
    y = model(torch.randn(2, 3, 16, 16, 16))
    assert y.shape == (2, 6, 16, 16, 16)
    assert model.levels == 1


def test_from_config():
    cfg = Config(scale=5)
    cfg.model.base_width, cfg.model.groups, cfg.ladder.conv = 4, 2, "vendor"
    model = UNet3d.from_config(cfg, n_classes=4)
    assert model.levels == 2 and model.outc.out_channels == 4 and model.inc.conv1.in_channels == 3
    assert model.inc.conv1.ladder_setting == "vendor" and model.inc.norm1.ladder_setting == "auto"


@pytest.mark.parametrize("kwargs, key", [
    (dict(scale=3), "scale="),
    (dict(scale=2, bottleneck=3), "scale="),
    (dict(scale=5, base_width=6, groups=4), "model.groups="),
    (dict(scale=5, base_width=0), "model.base_width="),
])
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key) as err:
        with torch.device("meta"):
            UNet3d(**kwargs)
    assert "\n" not in str(err.value)


def test_bad_input_shape():
    model = UNet3d(4, base_width=4, groups=2)
    with pytest.raises(ValueError, match="multiples of 2"):
        model(torch.randn(1, 3, 16, 16, 15))


def test_channels_last_forward_matches():
    torch.manual_seed(1)
    model = UNet3d(5, base_width=4, groups=2)
    x = torch.randn(1, 3, 32, 32, 32)
    y_ref = model(x)
    model.to(memory_format=torch.channels_last_3d)
    y_cl = model(x)  # (the CPU convolutions may return NCDHW; on CUDA the layout stays NDHWC)
    torch.testing.assert_close(y_cl, y_ref, rtol=1e-4, atol=1e-5)
    y_cl.sum().backward()  # the pool's backward in channels-last layout
    assert model.inc.conv1.weight.grad is not None


# --- a U-Net from stock torch modules, with the same module names ----------------------------------

class StockDoubleConv(nn.Module):
    def __init__(self, cin, cout, groups):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv3d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.norm2(self.conv2(self.relu(self.norm1(self.conv1(x))))))


class StockDown(nn.Module):
    def __init__(self, c, groups):
        super().__init__()
        self.pool = nn.MaxPool3d(2)
        self.conv = StockDoubleConv(c, 2 * c, groups)

    def forward(self, x):
        return self.conv(self.pool(x))


class StockUp(nn.Module):
    def __init__(self, c, groups):
        super().__init__()
        self.up = nn.ConvTranspose3d(c, c // 2, 2, stride=2)
        self.conv = StockDoubleConv(c, c // 2, groups)

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class StockUNet(nn.Module):
    def __init__(self, levels, width, groups, classes):
        super().__init__()
        widths = [width * 2**i for i in range(levels + 1)]
        self.inc = StockDoubleConv(3, width, groups)
        self.downs = nn.ModuleList(StockDown(w, groups) for w in widths[:-1])
        self.ups = nn.ModuleList(StockUp(w, groups) for w in reversed(widths[1:]))
        self.outc = nn.Conv3d(width, classes, 1)

    def forward(self, x):
        return self.outc(self._level(self.inc(x), 0))

    def _level(self, x, i):
        """The U below level i, written recursively (the model itself loops): down, the levels
        below, then up with level i's activation as the skip."""
        if i == len(self.downs):
            return x
        return self.ups[len(self.downs) - 1 - i](self._level(self.downs[i](x), i + 1), x)


def test_state_dicts_load_both_ways_and_outputs_are_equal():
    torch.manual_seed(2)
    ladder = UNet3d(5, base_width=4, groups=2, n_classes=5)
    stock = StockUNet(2, 4, 2, 5)
    assert list(ladder.state_dict()) == list(stock.state_dict())
    stock.load_state_dict(ladder.state_dict())
    x = torch.randn(2, 3, 32, 32, 32)
    y_ladder, y_stock = ladder(x), stock(x)
    assert torch.equal(y_ladder, y_stock)
    # and back: fresh stock weights into the ladder model
    torch.manual_seed(3)
    stock2 = StockUNet(2, 4, 2, 5)
    ladder.load_state_dict(stock2.state_dict())
    assert torch.equal(ladder(x), stock2(x))
    # gradients agree too (the pool's gradient goes where max_pool3d's goes)
    stock2.zero_grad()
    ladder(x).square().sum().backward()
    stock2(x).square().sum().backward()
    for (name, a), b in zip(ladder.named_parameters(), stock2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_cuda_model_runs_channels_last_end_to_end():
    torch.manual_seed(0)
    model = UNet3d(5, base_width=8, groups=4).to_device("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(torch.randn(1, 3, 32, 32, 32, device="cuda"))
    assert y.shape == (1, 6, 32, 32, 32)
    assert y.is_contiguous(memory_format=torch.channels_last_3d)
