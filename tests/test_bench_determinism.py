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


def test_ladder_vendor_puts_every_kind_on_vendor(monkeypatch, tmp_path):
    """`--ladder vendor` sets every operator kind, the pool and the loss head included (on CUDA their
    `auto` is Triton), and the probe's census says what ran."""
    import scaffold.bench.determinism as bench
    from scaffold.model.policy import OPS

    seen = {}

    def fake(scale, repeats, train_steps, ladder, device, base_width):
        seen.update({op: getattr(ladder, op) for op in OPS})
        return {"tensors": 0, "varying": 0, "varying_per_module": {}, "control": None}

    monkeypatch.setattr(bench, "probe", fake)
    assert bench.main(["--ladder", "vendor", "--out", str(tmp_path / "d.json")]) == 0
    assert seen == {op: "vendor" for op in OPS}
    res = probe(scale=4, repeats=1, train_steps=1, ladder=LadderConfig(**{op: "vendor" for op in OPS}),
                device=torch.device("cpu"), base_width=8)
    assert {op: set(res["census"][op]) for op in OPS} == {op: {"vendor"} for op in OPS}
