"""Training on the GPU: bitwise reproducibility at 128³, default == strict, and a step that never syncs."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import params, same_params, stable_rows, tiny_cfg
from scaffold import worker
from scaffold.bench.determinism import probe
from scaffold.config import LadderConfig
from scaffold.trainer import Trainer

pytestmark = pytest.mark.gpu

# 128³ volumes with the default width: the real model; a small dataset (4 volumes: 3 train, 1 val).
SCALE7 = ["scale=7", "model.bottleneck=3", "model.base_width=64", "model.groups=8", "device=cuda",
          "epochs=2", "warmup_steps=1"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("first")
    worker.run(tiny_cfg(cache, *SCALE7), run_dir)
    return run_dir


def test_two_scale7_runs_are_bitwise_identical(first_run, cache, tmp_path):
    worker.run(tiny_cfg(cache, *SCALE7), tmp_path)
    assert stable_rows(tmp_path / "train_stats.csv") == stable_rows(first_run / "train_stats.csv")
    assert same_params(params(tmp_path), params(first_run))


def test_the_result_sets_the_measured_peak_beside_the_memory_models(first_run):
    """result.json's memory: the model's prediction for the run (also in the plan, as run.json has it)
    and the measured peak of max_memory_allocated, within a factor of 1.5: a record read off the wrong
    shape or device is off by more. (The model is within 5% of the step's measured peak at scales 7-8,
    docs/performance.md; a whole run adds the evaluation and the warm-up copy, which it models too, and
    this test prints the ratio for the record.)"""
    result = json.loads((first_run / "result.json").read_text())
    memory = result["memory"]
    assert memory["predicted_gib"] == result["plan"]["predicted_gib"] > 0
    [peak] = memory["peak_gib"]  # one rank
    assert 0 < peak and abs(memory["peak_over_predicted"] - peak / memory["predicted_gib"]) < 1e-3
    print(f"\nmemory: peak {peak:.2f} GiB, predicted {memory['predicted_gib']:.2f} GiB, "
          f"{memory['peak_over_predicted']:.3f}x")
    assert 1 / 1.5 <= memory["peak_over_predicted"] <= 1.5


def test_strict_equals_default_at_scale7(first_run, cache, tmp_path):
    try:
        worker.run(tiny_cfg(cache, *SCALE7, "determinism=strict"), tmp_path)
    finally:
        torch.use_deterministic_algorithms(False)
    assert stable_rows(tmp_path / "train_stats.csv") == stable_rows(first_run / "train_stats.csv")
    assert same_params(params(tmp_path), params(first_run))


def _guard_epochs(monkeypatch):
    """Run every training epoch and evaluation under set_sync_debug_mode('error')."""
    for name in ("train_epoch", "evaluate"):
        real = getattr(Trainer, name)

        def guarded(self, *args, _real=real, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _real(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        monkeypatch.setattr(Trainer, name, guarded)


def test_training_epoch_never_syncs_the_host(cache, tmp_path, monkeypatch):
    _guard_epochs(monkeypatch)
    worker.run(tiny_cfg(cache, *SCALE7, "epochs=1"), tmp_path)
    assert (tmp_path / "train_stats.csv").read_text().count("\n") == 2


def test_the_sync_guard_catches_an_item_in_the_step(cache, tmp_path, monkeypatch):
    real = Trainer.step

    def step_with_item(self, *args, **kwargs):
        loss, dice = real(self, *args, **kwargs)
        loss.item()  # a host read inside the step: what the guard exists to catch
        return loss, dice

    monkeypatch.setattr(Trainer, "step", step_with_item)
    _guard_epochs(monkeypatch)
    with pytest.raises(RuntimeError, match="synchroniz"):
        worker.run(tiny_cfg(cache, "scale=5", "device=cuda", "epochs=1", "warmup_steps=0"), tmp_path)


def test_probe_finds_no_variation_on_our_path_and_some_in_its_control():
    res = probe(scale=7, repeats=3, train_steps=2, ladder=LadderConfig(), device=torch.device("cuda"))
    assert res["varying"] == 0, res["varying_detail"]
    assert res["control"]["distinct"] > 1


# A small model (32³, width 16) with every conv site forced onto the Triton conv rungs.
TRITON_CONVS = ["scale=5", "model.bottleneck=3", "model.base_width=16", "model.groups=8", "device=cuda",
                "epochs=2", "warmup_steps=1", "ladder.conv=triton", "ladder.conv_transpose=triton"]


def _train_twice_same_bits(cache, tmp_path, cfg) -> dict:
    """Two runs of `cfg`: same CSV (but wall clock) and same parameters; returns the first's census."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for run_dir in runs:
        run_dir.mkdir()
        worker.run(tiny_cfg(cache, *cfg), run_dir)
    assert stable_rows(runs[0] / "train_stats.csv") == stable_rows(runs[1] / "train_stats.csv")
    assert same_params(params(runs[0]), params(runs[1]))
    return json.loads((runs[0] / "census.json").read_text())


def test_training_on_triton_convs_gives_the_same_bits_twice(cache, tmp_path):
    census = _train_twice_same_bits(cache, tmp_path, TRITON_CONVS)
    # Every conv site really ran on Triton: no fallback to cuDNN.
    assert census["conv"] == {"triton": 11} and census["conv_transpose"] == {"triton": 2}, census
    assert census["fallbacks"] == []


def _mixed_route(x, weight, stride, padding, dilation, transposed=False):
    """A stand-in route table for the small model: every site gets some mix of Triton and cuDNN
    directions (never all vendor), fixed by its shape."""
    cin, cout = (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])
    idx = (cin // 8 + cout // 8 + x.shape[-1]) % 7 + 1
    return bool(idx & 1), bool(idx & 2), bool(idx & 4)


def test_training_on_routed_convs_gives_the_same_bits_twice(cache, tmp_path, monkeypatch):
    """`auto` on CUDA runs the convolutions `routed`: directions split between Triton and
    deterministic cuDNN per shape. Two runs give the same bits, and every site ran routed."""
    monkeypatch.setattr("scaffold.model.routes.lookup", _mixed_route)
    census = _train_twice_same_bits(cache, tmp_path, [a for a in TRITON_CONVS if not a.startswith("ladder.")])
    # (the 1x1x1 head runs fused with the last GroupNorm, a Triton kernel: scaffold.kernels.norm_head)
    assert census["conv"] == {"routed": 10, "triton": 1} and census["conv_transpose"] == {"routed": 2}, census
    assert census["modules"]["outc"] == "triton"
    assert census["fallbacks"] == []


# ---- the step as a CUDA graph (the default on one GPU) against eager steps

def test_graphed_steps_give_the_eager_bits_at_scale7(first_run, cache, tmp_path):
    """`first_run` ran with the default cuda_graph=auto (captured); the same run with eager steps
    gives the same CSV (but wall clock) and the same parameters."""
    assert json.loads((first_run / "result.json").read_text())["cuda_graph"] is True
    worker.run(tiny_cfg(cache, *SCALE7, "cuda_graph=off"), tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())["cuda_graph"] is False
    assert stable_rows(tmp_path / "train_stats.csv") == stable_rows(first_run / "train_stats.csv")
    assert same_params(params(tmp_path), params(first_run))


def test_graph_with_a_short_last_batch_gives_the_eager_bits(cache, tmp_path):
    """batch_size=2 over 3 training volumes: each epoch's last batch has another shape and runs
    eagerly into the graph's gradient tensors; the run still matches an all-eager run bit for bit."""
    cfg = ["scale=5", "model.base_width=16", "device=cuda", "epochs=2", "warmup_steps=1",
           "batch_size=2"]
    runs = {mode: tmp_path / mode for mode in ("on", "off")}
    for mode, run_dir in runs.items():
        run_dir.mkdir()
        worker.run(tiny_cfg(cache, *cfg, f"cuda_graph={mode}"), run_dir)
    assert json.loads((runs["on"] / "result.json").read_text())["cuda_graph"] is True
    assert stable_rows(runs["on"] / "train_stats.csv") == stable_rows(runs["off"] / "train_stats.csv")
    assert same_params(params(runs["on"]), params(runs["off"]))


def test_step_graph_replays_write_fresh_gradients():
    """The step's CUDA graph: after a replay the gradients are those of that batch alone (not accumulated over
    replays), bitwise equal to an eager backward of the same batch."""
    from scaffold.step import _StepGraph as StepGraph

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    batches = torch.randn(3, 8, 64, device="cuda")

    def fwd_bwd(x):
        loss = net(x).square().mean()
        loss.backward()
        return (loss,)

    def eager_step(x):  # returns copies only: no autograd graph outlives it (capture needs that)
        net.zero_grad(set_to_none=True)
        loss = fwd_bwd(x)[0]
        return loss.detach().clone(), [p.grad.clone() for p in net.parameters()]

    eager = [eager_step(x) for x in batches]
    net.zero_grad(set_to_none=True)
    graph = StepGraph(fwd_bwd, list(net.parameters()), batches[0])
    assert not graph.fits(batches[0, :4])
    for _ in range(2):  # replays of the same batch twice: no accumulation
        for x, (loss, grads) in zip(batches, eager):
            (g_loss,) = graph.run(x)
            assert torch.equal(g_loss, loss)
            assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))


def test_a_failed_capture_falls_back_to_eager_under_auto_and_raises_under_on(cache, tmp_path,
                                                                            monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("capture refused (test)")

    monkeypatch.setattr("scaffold.step._StepGraph", refuse)
    cfg = ["scale=5", "model.base_width=16", "device=cuda", "epochs=1", "warmup_steps=0"]
    (tmp_path / "auto").mkdir()
    result = worker.run(tiny_cfg(cache, *cfg), tmp_path / "auto")
    assert result["cuda_graph"] is False
    assert (tmp_path / "auto" / "train_stats.csv").read_text().count("\n") == 2
    (tmp_path / "on").mkdir()
    with pytest.raises(RuntimeError, match="capture refused"):
        worker.run(tiny_cfg(cache, *cfg, "cuda_graph=on"), tmp_path / "on")


def test_masks_in_host_memory_give_the_device_bits_without_a_sync(first_run, cache, tmp_path, monkeypatch):
    """data_placement=host (what auto picks when the masks would crowd the device): every step copies
    its volume from pinned host memory; the run gives the bits of the masks-on-device run, and the
    epochs still never wait for the device."""
    _guard_epochs(monkeypatch)
    worker.run(tiny_cfg(cache, *SCALE7, "data_placement=host"), tmp_path)
    assert stable_rows(tmp_path / "train_stats.csv") == stable_rows(first_run / "train_stats.csv")
    assert same_params(params(tmp_path), params(first_run))


# ---- the step as a CUDA graph under DDP (torchrun, NCCL): the all-reduce captured with it

def test_a_graphed_ddp_step_gives_the_eager_ddp_bits(cache, tmp_path):
    """One rank under torchrun: the captured step (forward, loss, backward, DDP's bucket copies and
    all-reduce, clip, Adam) against eager DDP steps; batch_size=2 over 3 training volumes puts a
    short last batch (eager, into the graph's gradients) in every epoch."""
    from helpers import TINY, torchrun

    cfg = [*TINY, "scale=5", "model.base_width=16", "model.groups=4", "device=cuda", "epochs=2",
           "batch_size=2", f"data.cache_dir={cache}"]
    runs = {mode: tmp_path / mode for mode in ("on", "off")}
    for mode, run_dir in runs.items():
        res = torchrun(1, [*cfg, f"cuda_graph={mode}", f"hydra.run.dir={run_dir}"], tmp_path, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((runs["on"] / "result.json").read_text())["cuda_graph"] is True
    assert json.loads((runs["off"] / "result.json").read_text())["cuda_graph"] is False
    assert stable_rows(runs["on"] / "train_stats.csv") == stable_rows(runs["off"] / "train_stats.csv")
    assert same_params(params(runs["on"]), params(runs["off"]))
