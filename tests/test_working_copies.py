"""bf16 working copies of the convolutions' weights (scaffold.model.ladder.attach_working_copies with
scaffold.kernels.adam.Adam): the step computes with the same values as autocast's casts, so the same
bits, with no cast of a weight or of its gradient in the step. On the CPU under Triton's interpreter
(bf16 autocast), compiled on CUDA."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from scaffold.kernels import adam as A  # noqa: E402
from scaffold.kernels.lib.device import triton_usable  # noqa: E402
from scaffold.loss import SegmentationLoss  # noqa: E402
from scaffold.model.ladder import FastConv3d, FastConvTranspose3d, attach_working_copies  # noqa: E402
from scaffold.model.unet import UNet3d  # noqa: E402
from scaffold.step import TrainStep  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_usable(torch.zeros(1, device=DEV)),
                                reason="needs CUDA or TRITON_INTERPRET=1")


def _model():
    torch.manual_seed(0)
    m = UNet3d(3, bottleneck=2, base_width=4, groups=2, n_classes=3).to(DEV)
    return m.to(memory_format=torch.channels_last_3d) if DEV == "cuda" else m


def _step(model, working: bool):
    copies = attach_working_copies(model) if working else None
    opt = A.Adam(list(model.parameters()), lr=torch.tensor(1e-2, device=DEV), working=copies)
    loss = SegmentationLoss([1.0, 2.0, 2.0]).to(DEV)
    palette = torch.rand(3, 3, generator=torch.Generator().manual_seed(1)).to(DEV)
    return TrainStep(model, loss, opt, palette, torch.bfloat16, grad_clip=1.0), copies


def _masks():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 3, (3, 1, 8, 8, 8), generator=g, dtype=torch.uint8).to(DEV)


def test_working_copies_change_no_bit_and_take_the_gradients():
    plain, working = _model(), _model()
    working.load_state_dict(plain.state_dict())
    ref, _ = _step(plain, working=False)
    step, copies = _step(working, working=True)
    sites = [m for m in working.modules() if isinstance(m, (FastConv3d, FastConvTranspose3d))]
    assert sites and set(copies) == {p for m in sites for p in (m.weight, m.bias) if p is not None}
    for masks in _masks():
        a, b = ref(masks), step(masks)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for p, q in zip(plain.parameters(), working.parameters()):
            assert torch.equal(p, q)
        for p, w in copies.items():  # each step wrote the copy as the parameter rounded to bf16
            assert w.dtype == torch.bfloat16 and torch.equal(w, p.detach().to(torch.bfloat16))
    # The backward left every conv gradient, bf16, in the copy; the fp32 parameter got none.
    step.forward_backward(_masks()[0])
    for p, w in copies.items():
        assert p.grad is None and w.grad is not None and w.grad.dtype == torch.bfloat16


def test_loading_a_state_dict_makes_the_copies_again():
    model = _model()
    _, copies = _step(model, working=True)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(3.0)
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(w, p.detach().to(torch.bfloat16)) for p, w in copies.items())


def test_outside_autocast_the_parameters_are_used():
    """Evaluation in fp32 (no autocast) reads the fp32 parameters, not the bf16 copies."""
    model = _model()
    attach_working_copies(model)
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, (FastConv3d, FastConvTranspose3d)):
            m.working = None
    x = torch.rand(1, 3, 8, 8, 8, generator=torch.Generator().manual_seed(3)).to(DEV)
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))


def _weight_casts(step, masks) -> int:
    """How many dtype casts of a conv weight or its gradient one forward + backward runs (counted at
    the dispatcher: `aten._to_copy` on a tensor shaped like a conv weight)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = {tuple(m.weight.shape) for m in step.net.modules()
              if isinstance(m, (FastConv3d, FastConvTranspose3d))}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in shapes:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step.forward_backward(masks)
    return Count.n


def test_with_working_copies_no_weight_is_cast_in_the_step():
    """The point of the copies: without them autocast casts every conv weight to bf16 in the forward
    and each bf16 weight gradient back to fp32 in the backward; with them neither cast runs."""
    masks = _masks()[0]
    plain, _ = _step(_model(), working=False)
    working, _ = _step(_model(), working=True)
    n_sites = sum(isinstance(m, (FastConv3d, FastConvTranspose3d)) for m in plain.net.modules())
    assert _weight_casts(plain, masks) >= 2 * n_sites  # the control: one cast each way per site
    assert _weight_casts(working, masks) == 0


def test_a_run_with_working_copies_resumed_gives_the_bits_of_a_run_without_them(tmp_path, monkeypatch):
    """The trainer's whole path with working copies (warm-up on a copy of the model, steps, evaluation,
    a checkpoint, a resume that loads it): the CSV and the parameters of the run without copies, bit for
    bit. On the CPU (bf16 autocast, our Adam interpreted); CUDA runs it through its `gpu` tests."""
    if DEV != "cpu":
        pytest.skip("the CPU form of this test; on CUDA the trainer builds our Adam itself")
    from helpers import params, same_params, stable_rows, tiny_cfg
    from scaffold import trainer as trainer_module
    from scaffold import worker

    asked = []

    def ours(copies: bool):
        def make(model, cfg, working=False, kind=None):
            asked.append(working)
            c = attach_working_copies(model) if (copies and working) else None
            return A.Adam(list(model.parameters()), lr=torch.tensor(float(cfg.lr)),
                          weight_decay=cfg.optim.weight_decay, working=c)
        return make

    small = ["precision=bf16", "optim.t0=1", "warmup_steps=1", "data.n_instances=4"]
    cache = tmp_path / "cache"
    monkeypatch.setattr(trainer_module, "make_optimizer", ours(copies=False))
    worker.run(tiny_cfg(cache, *small, "epochs=2"), tmp_path / "plain")
    monkeypatch.setattr(trainer_module, "make_optimizer", ours(copies=True))
    part = tmp_path / "part"
    worker.run(tiny_cfg(cache, *small, "epochs=1"), part)
    cfg = tiny_cfg(cache, *small, "epochs=2")
    cfg.resume = str(part)
    worker.run(cfg, part, resume=True)
    assert asked and all(asked)  # the trainer asked for copies for the model and the warm-up's copy
    rows = stable_rows(tmp_path / "plain" / "train_stats.csv")
    assert len(rows) == 2 and rows == stable_rows(part / "train_stats.csv")
    assert same_params(params(tmp_path / "plain"), params(part))
