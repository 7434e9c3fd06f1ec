"""The one training step: the trainer, its warm-up and the step benchmark all run scaffold.step.TrainStep."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_cfg
from scaffold.bench.minibatch import make_step
from scaffold.config import ConfigError
from scaffold.loss import SegmentationLoss
from scaffold.step import TrainStep, wants_graph
from scaffold.trainer import Trainer, Volumes


def _trainer(tmp_path) -> Trainer:
    from scaffold.model import UNet3d

    cfg = tiny_cfg(tmp_path)
    model = UNet3d.from_config(cfg, 3)
    g = torch.Generator().manual_seed(0)
    vol = Volumes(torch.randint(0, 3, (3, 8, 8, 8), generator=g, dtype=torch.uint8),
                  torch.randint(0, 3, (1, 8, 8, 8), generator=g, dtype=torch.uint8), torch.rand(3, 3))
    return Trainer(cfg, model, SegmentationLoss([1.0, 2.0, 2.0]), vol, torch.device("cpu"), tmp_path)


def test_the_step_benchmark_times_the_trainers_own_step(tmp_path):
    """bench.minibatch builds a TrainStep, the trainer's type, and feeds it uint8 labels as the trainer
    does (not an int64 copy)."""
    trainer = _trainer(tmp_path)
    _, bench_step, masks = make_step("ladder", 4, 8, torch.device("cpu"), n_classes=3)
    assert type(bench_step) is type(trainer.train_step) is TrainStep
    assert masks.dtype == trainer.vol.train.dtype == torch.uint8
    seen = []
    real = bench_step.loss_fn.terms
    bench_step.loss_fn.terms = lambda logits, labels: seen.append(labels.dtype) or real(logits, labels)
    loss, dice = bench_step(masks[0])
    assert seen == [torch.uint8] and loss.shape == () and dice.shape == (1,)


def test_a_step_moves_the_parameters_and_resets_the_gradients(tmp_path):
    trainer = _trainer(tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step(trainer.vol.train[:1])
    assert all(p.grad is None for p in trainer.model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_warmup_runs_on_a_copy_and_changes_nothing(tmp_path):
    trainer = _trainer(tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    rng = torch.get_rng_state()
    assert trainer.warmup(2) > 0
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert torch.equal(rng, torch.get_rng_state()) and not trainer.optimizer.state


def test_cuda_graph_on_where_it_cannot_run_is_one_line():
    assert wants_graph("auto", torch.device("cpu")) is False
    assert wants_graph("off", torch.device("cuda", 0)) is False
    assert wants_graph("auto", torch.device("cuda", 0)) is True  # one process, or under DDP
    assert wants_graph("auto", torch.device("cuda", 0), shards=2) is False  # halo exchanges run eagerly
    with pytest.raises(ConfigError, match=r"^cuda_graph='on': expected a CUDA device and volumes not split "
                                          r"over ranks, got device cpu"):
        wants_graph("on", torch.device("cpu"))
    with pytest.raises(ConfigError, match="got 2 spatial shards"):
        wants_graph("on", torch.device("cuda", 0), shards=2)


def test_the_clip_folded_into_fused_adam_is_the_clip():
    """On CUDA the clip factor reaches fused Adam as its gradient divisor instead of a pass over the
    gradients; checked here with torch's fused CPU Adam against clip_grad_norm_ + the same Adam."""
    import torch

    from scaffold.step import fold_clip

    results = []
    for fold in (True, False):
        net = torch.nn.Linear(64, 8)
        torch.nn.init.constant_(net.weight, 0.5)
        torch.nn.init.constant_(net.bias, 0.1)
        params = list(net.parameters())
        opt = torch.optim.Adam(params, lr=1e-2, eps=1.0, fused=True)  # eps: the update depends on the scale
        x = torch.linspace(-3, 3, 64 * 4).view(4, 64)
        for _ in range(3):
            net(x).pow(2).sum().backward()  # gradients far above the clip: the clip acts
            assert torch.nn.utils.get_total_norm([p.grad for p in params]) > 1.0
            if fold:
                fold_clip(opt, params, 0.1, torch.zeros(()))
            else:
                torch.nn.utils.clip_grad_norm_(params, 0.1, foreach=True)
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(results[0][0], torch.full_like(results[0][0], 0.5))  # they moved


def test_working_copies_are_asked_for_one_process_without_recompute(tmp_path):
    """The trainer asks for bf16 working copies (scaffold.kernels.adam, on CUDA with bf16 autocast) when
    the step calls the model itself and keeps its activations; not under recompute, where the copies
    would raise the step's peak (the memory model says the same)."""
    from scaffold.model import UNet3d
    from scaffold.plan import step_shape

    trainer = _trainer(tmp_path)
    assert trainer.working is True
    cfg = tiny_cfg(tmp_path, "model.recompute=blocks")
    model = UNet3d.from_config(cfg, 3)
    assert model.recompute == "blocks"
    vol = trainer.vol
    again = Trainer(cfg, model, SegmentationLoss([1.0, 2.0, 2.0]), vol, torch.device("cpu"), tmp_path)
    assert again.working is False
    assert step_shape(cfg, "cuda", "blocks").working is False
    assert step_shape(tiny_cfg(tmp_path), "cuda", "off").working is True
