"""The determinism probe: zero variation on our CPU path, and it does notice a nondeterministic module."""
import torch

from scaffold.bench.determinism import probe
from scaffold.config import LadderConfig
from scaffold.model.ladder import FastGroupNorm


def test_probe_reports_no_variation_on_the_cpu_path():
    res = probe(scale=4, repeats=2, train_steps=1, ladder=LadderConfig(), device=torch.device("cpu"),
                base_width=8)
    assert res["tensors"] > 50 and res["varying"] == 0, res["varying_detail"]


def test_probe_finds_a_module_that_varies(monkeypatch):
    real = FastGroupNorm.forward
    noise = torch.Generator().manual_seed(0)  # advances between calls: a different value every time

    def noisy(self, x, room=0):
        y = real(self, x, room)
        if self.ladder_name == "ups.0.conv.norm1":
            y = y + 1e-3 * torch.rand((), generator=noise)
        return y

    monkeypatch.setattr(FastGroupNorm, "forward", noisy)
    res = probe(scale=4, repeats=2, train_steps=1, ladder=LadderConfig(), device=torch.device("cpu"),
                base_width=8)
    assert res["varying"] > 0
    assert "ups.0.conv.norm1" in res["varying_per_module"]
    assert "activation/ups.0.conv.norm1" in res["varying_detail"]
