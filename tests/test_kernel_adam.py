"""Our Adam with the clip folded in (scaffold.kernels.adam): torch's Adam and clip_grad_norm_'s values,
fixed bits, torch's state dict. On the CPU under Triton's interpreter, on CUDA compiled."""
import copy

import pytest
import torch

pytest.importorskip("triton")

from scaffold.kernels import adam as A  # noqa: E402
from scaffold.kernels.lib.device import triton_usable  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_usable(torch.zeros(1, device=DEV)),
                                reason="needs CUDA or TRITON_INTERPRET=1")

# Sizes across chunk boundaries (A.BLOCK elements): shorter than one, exactly one, several with a tail;
# a channels-last 5D weight as the model's convolutions have.
SHAPES = [(37,), (A.BLOCK,), (2 * A.BLOCK + 5,), (4, 3, 3, 3, 3)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES:
        t = torch.randn(shape, generator=gen).to(DEV)
        if t.dim() == 5:
            t = t.contiguous(memory_format=torch.channels_last_3d)
        out.append(torch.nn.Parameter(t))
    return out


def _grads(params, step: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(DEV).contiguous(
        memory_format=torch.channels_last_3d if p.dim() == 5 else torch.contiguous_format) for p in params]


def _run(opt_factory, clip: float, steps: int = 3, scale: float = 1.0, seed: int = 0):
    params = _params(seed)
    opt = opt_factory(params)
    norms = []
    for i in range(steps):
        for p, g in zip(params, _grads(params, i, scale)):
            p.grad = g
        if isinstance(opt, A.Adam):
            opt.max_norm = clip
        elif clip > 0:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip))
        opt.step()
        if isinstance(opt, A.Adam) and clip > 0:
            norms.append(opt.last_norm.clone())
    return params, opt, norms


def _ours(wd=0.0):
    return lambda ps: A.Adam(ps, lr=torch.tensor(1e-2, device=DEV), weight_decay=wd)


def _torch(wd=0.0):
    return lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=wd)


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("clip,scale", [(0.0, 1.0), (1.0, 1.0), (1e3, 1e-3)], ids=["no-clip", "clipping", "under-clip"])
def test_matches_torch_adam_and_clip_grad_norm(wd, clip, scale):
    ours, opt, norms = _run(_ours(wd), clip, scale=scale)
    ref, ref_opt, ref_norms = _run(_torch(wd), clip, scale=scale)
    for p, r in zip(ours, ref):
        assert p.stride() == r.stride()
        torch.testing.assert_close(p, r, rtol=2e-5, atol=2e-6)
    for p, r in zip(ours, ref):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][k], ref_opt.state[r][k], rtol=2e-5, atol=1e-7)
        assert float(opt.state[p]["step"]) == 3.0
    for n, r in zip(norms, ref_norms):
        torch.testing.assert_close(n.cpu(), r.cpu(), rtol=1e-5, atol=0)


def test_same_inputs_same_bits():
    a, _, na = _run(_ours(0.1), 1.0)
    b, _, nb = _run(_ours(0.1), 1.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(na, nb))


def test_a_gradient_in_another_layout_gives_the_same_bits():
    """One index walks parameter, gradient and moments: a gradient in another layout is copied into
    the parameter's first, so the update is the same."""
    base, _, _ = _run(_ours(), 1.0)
    params = _params(0)
    opt = A.Adam(params, lr=torch.tensor(1e-2, device=DEV), max_norm=1.0)
    for i in range(3):
        for p, g in zip(params, _grads(params, i, 1.0)):
            p.grad = g.contiguous()  # the 5D one in NCDHW, its parameter channels-last
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(base, params))


def test_state_dict_is_torch_adams_both_ways():
    """A checkpoint of either loads into the other, and training continues the same."""
    params, opt, _ = _run(_ours(), 0.0, steps=2)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.Adam(twin, lr=1e-2)
    ref.load_state_dict(copy.deepcopy(sd))  # as from a file: no tensor shared with `opt`
    if DEV == "cpu":  # torch's capturable Adam is for accelerators; ours runs on the CPU interpreted
        ref.param_groups[0]["capturable"] = False
    back = A.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=torch.tensor(1e-2, device=DEV))
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    grads = _grads(params, 7, 1.0)
    for ps, o in ((params, opt), (twin, ref), (back.param_groups[0]["params"], back)):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        o.step()
    for p, r, b in zip(params, twin, back.param_groups[0]["params"]):
        torch.testing.assert_close(p, r, rtol=2e-5, atol=2e-6)
        assert torch.equal(p, b)  # ours from torch's state dict: the same bits as ours throughout


def test_tables_are_reused_while_the_addresses_stay():
    params = _params(0)
    opt = A.Adam(params, lr=torch.tensor(1e-2, device=DEV))
    grads = _grads(params, 0, 1.0)
    for _ in range(2):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    assert len(opt._tables) == 4  # parameters, gradients, two moments: made once (no working copies)
    for p, g in zip(params, _grads(params, 1, 1.0)):
        p.grad = g
    opt.step()
    assert len(opt._tables) == 5  # new gradients: one table more


def test_unsupported_parameters_are_refused():
    assert not A.supported([])
    assert not A.supported([torch.zeros(3, dtype=torch.float64, device=DEV)])
    assert not A.supported([torch.zeros(4, 4, device=DEV)[:, :2]])  # a view with gaps
    assert A.supported([torch.zeros(3, device=DEV), torch.zeros(2, 2, device=DEV)])


# --- bf16 working copies ------------------------------------------------------------------------------

def _bf16_grads(params, step: int) -> list[torch.Tensor]:
    return [g.to(torch.bfloat16) for g in _grads(params, step, 1.0)]


def _copies(params) -> dict:
    """A bf16 working copy per parameter but the first (so one launch holds both kinds)."""
    out = {}
    for p in params[1:]:
        w = torch.empty_like(p, dtype=torch.bfloat16).copy_(p.detach())
        out[p] = w.requires_grad_(True)
    return out


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_working_copies_give_the_bits_of_fp32_gradients_and_are_the_rounded_parameters(clip):
    """A bf16 gradient left in a working copy's `.grad` updates its parameter exactly as the same
    values given as an fp32 gradient do (norm included), and each step rewrites the copy as the new
    parameter rounded to bf16 (what `.to(torch.bfloat16)` gives)."""
    ref_params, work_params = _params(0), _params(0)
    ref = A.Adam(ref_params, lr=torch.tensor(1e-2, device=DEV), max_norm=clip)
    copies = _copies(work_params)
    opt = A.Adam(work_params, lr=torch.tensor(1e-2, device=DEV), max_norm=clip, working=copies)
    assert opt.grad_leaves() == [work_params[0]] + [copies[p] for p in work_params[1:]]
    for i in range(3):
        for p, r, g in zip(work_params, ref_params, _bf16_grads(work_params, i)):
            r.grad = g.float()
            if p in copies:
                copies[p].grad = g
            else:
                p.grad = g.float()
        ref.step()
        opt.step()
        if clip:
            assert torch.equal(opt.last_norm, ref.last_norm)
        for p, r in zip(work_params, ref_params):
            assert torch.equal(p, r)
            if p in copies:
                assert torch.equal(copies[p], p.detach().to(torch.bfloat16))
        opt.zero_grad()
        assert all(t.grad is None for t in opt.grad_leaves())


def test_refresh_working_copies_the_parameters():
    params = _params(1)
    copies = _copies(params)
    opt = A.Adam(params, lr=torch.tensor(1e-2, device=DEV), working=copies)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    opt.refresh_working()
    assert all(torch.equal(w, p.detach().to(torch.bfloat16)) for p, w in copies.items())


def test_a_working_copy_in_another_layout_is_refused():
    p = torch.nn.Parameter(torch.zeros(4, 3, 3, 3, 3, device=DEV).contiguous(memory_format=torch.channels_last_3d))
    with pytest.raises(ValueError, match="working copy"):
        A.Adam([p], lr=torch.tensor(1e-2, device=DEV), working={p: torch.zeros(4, 3, 3, 3, 3, dtype=torch.bfloat16,
                                                                             device=DEV)})
