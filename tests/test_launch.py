"""The direct launch path (scaffold.kernels.lib.launch): its key is never coarser than Triton's own
specialization, it launches with exactly the arguments Triton's binder would pass, it steps aside
wherever it cannot be sure, and on a GPU a training step gives the same bits through either path."""
import inspect
import itertools

import pytest
import torch

from scaffold.kernels.lib import ahead, launch


def _specialize():
    """Triton's own per-argument specialization (its native binder's function)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return lambda a: native_specialize_impl(BaseBackend, a, False, True, True)


def _values():
    base = torch.zeros(4096, dtype=torch.bfloat16)
    f32 = torch.zeros(4096, dtype=torch.float32)
    tensors = [base, base[1:], base[8:], base[16:], f32, f32[1:], f32[4:], torch.zeros(8, dtype=torch.uint8)]
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31),
            -(2**31) - 1, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16]
    return tensors, ints, [0.5, 1.0, -3.25], [True, False], [None]


def test_key_is_never_coarser_than_tritons_specialization():
    spec = _specialize()
    tensors, ints, floats, bools, nones = _values()
    values = tensors + ints + floats + bools + nones
    keys = [launch.arg_key(v, constexpr=False) for v in values]
    assert all(k is not launch._FALLBACK for k in keys)
    for (a, ka), (b, kb) in itertools.combinations(zip(values, keys), 2):
        if ka == kb:
            assert spec(a) == spec(b), (a if not isinstance(a, torch.Tensor) else a.dtype, b, ka)
    # and it is not needlessly finer where it matters: aligned offsets share an entry
    assert launch.arg_key(tensors[2], False) == launch.arg_key(tensors[3], False)
    assert launch.arg_key(32, False) == launch.arg_key(48, False)
    assert launch.arg_key(17, False) == launch.arg_key(33, False)


def test_the_launch_key_is_the_arguments_keys():
    """Launched._key (which inlines arg_key for tensors, ints and constexprs) keys each argument
    exactly as arg_key does, so the property above holds for the key actually used."""
    tensors, ints, floats, bools, nones = _values()
    values = tensors + ints + floats + bools + nones + [torch.nn.Parameter(torch.zeros(4))]
    constexprs = [3, 16, 2.5, True, "ieee"]
    L = launch.Launched(None)
    L._constexpr = (False,) * len(values) + (True,) * len(constexprs)
    L._param_names, L._constexpr_names = frozenset(), frozenset()
    L._device = lambda: 0
    args = tuple(values + constexprs)
    expect = tuple(launch.arg_key(a, c) for a, c in zip(args, L._constexpr))
    assert L._key(args, {}) == (0, expect)
    assert L._key(args, {"num_warps": 4})[1] == expect


def test_key_covers_tensor_descriptors():
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    spec = _specialize()
    x = torch.zeros(64 * 256, dtype=torch.bfloat16)
    descs = [TensorDescriptor.from_tensor(x.view(64, 256), [16, 32]),
             TensorDescriptor.from_tensor(x.view(64, 256), [16, 64]),
             TensorDescriptor.from_tensor(x.view(128, 128), [16, 32]),
             TensorDescriptor.from_tensor(x.float()[:8192].view(64, 128), [16, 32])]
    keys = [launch.arg_key(d, False) for d in descs]
    assert launch._FALLBACK not in keys and len(set(keys)) == len(keys)
    for (a, ka), (b, kb) in itertools.combinations(zip(descs, keys), 2):
        if ka == kb:
            assert spec(a) == spec(b)
    try:  # Gluon's descriptor also carries a shared-memory layout: it is part of the key
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    except Exception:  # noqa: BLE001 - a Triton without Gluon
        return
    v = x.view(64, 256)
    l64 = gl.NVMMASharedLayout.get_default_for([16, 32], gl.bfloat16)
    l32 = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    gdescs = [GluonDescriptor(v, [64, 256], [256, 1], [16, 32], l64),
              GluonDescriptor(v, [64, 256], [256, 1], [16, 32], l32),
              GluonDescriptor(v, [64, 256], [256, 1], [16, 32],
                              gl.NVMMASharedLayout.get_default_for([16, 32], gl.bfloat16))]
    gkeys = [launch.arg_key(d, False) for d in gdescs]
    assert launch._FALLBACK not in gkeys
    assert gkeys[0] != gkeys[1] and gkeys[0] == gkeys[2]  # by the layout's value
    for (a, ka), (b, kb) in itertools.combinations(zip(descs + gdescs, keys + gkeys), 2):
        if ka == kb:
            assert spec(a) == spec(b)
        else:
            assert ka != kb


def test_constexpr_key_is_by_type_and_value():
    assert launch.arg_key(True, constexpr=True) != launch.arg_key(1, constexpr=True)
    assert launch.arg_key(64, constexpr=True) != launch.arg_key(128, constexpr=True)
    assert launch.arg_key(torch.zeros(1), constexpr=True) is launch._FALLBACK


# --- the direct path against a stand-in for Triton's JIT: what it passes, when it steps aside -------

def _kernel(x_ptr, y_ptr, n, scale, flag, BLOCK: "tl.constexpr", MODE: "tl.constexpr" = 3):
    pass


class _Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, object(), object()

    def run(self, *a):
        self.log.append(("direct", a))


@pytest.fixture
def stand_in(monkeypatch):
    from triton.runtime.jit import JITFunction

    fn = JITFunction(_kernel)
    log, compiled = [], {}

    def run(*args, grid, warmup, **kwargs):
        bound = inspect.signature(_kernel).bind(*args, **{k: v for k, v in kwargs.items()
                                                          if k in inspect.signature(_kernel).parameters})
        bound.apply_defaults()
        log.append(("triton", grid, tuple(bound.arguments.values())))
        return compiled.setdefault(0, _Compiled(log))

    monkeypatch.setattr(fn, "run", run, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    k = launch.Launched(fn)
    k._prepare()
    assert k._direct_ok
    monkeypatch.setattr(k, "_device", lambda: 0)
    monkeypatch.setattr(k, "_stream", lambda device: 1234)
    monkeypatch.setattr(launch, "enabled", True)
    return k, log


def test_direct_launch_passes_what_tritons_binder_binds(stand_in):
    k, log = stand_in
    x, y = torch.zeros(64), torch.zeros(64)
    k[(4, 2)](x, y, 32, 0.5, True, BLOCK=64, num_warps=4)
    k[(4, 2)](y, x, 48, 0.25, False, BLOCK=64, num_warps=4)
    assert [e[0] for e in log] == ["triton", "direct"]
    call = log[1][1]
    assert call[:4] == (4, 2, 1, 1234)  # grid completed with ones, the current stream
    assert call[6:9] == (None, None, None)  # no launch metadata, no hooks (none is active)
    expected = inspect.signature(_kernel).bind(y, x, 48, 0.25, False, BLOCK=64)
    expected.apply_defaults()  # MODE's default is passed as Triton's binder passes it
    want = tuple(expected.arguments.values())
    got = call[9:]
    assert len(got) == len(want) == 7
    assert got[0] is y and got[1] is x and got[2:] == want[2:]


@pytest.mark.parametrize("change", ["misaligned", "int class", "constexpr", "option", "dtype", "int to one"])
def test_a_new_signature_goes_through_triton(stand_in, change):
    k, log = stand_in
    x = torch.zeros(64)
    k[(1,)](x, x, 32, 0.5, True, BLOCK=64, num_warps=4)
    args, kw = [x, x, 32, 0.5, True], dict(BLOCK=64, num_warps=4)
    if change == "misaligned":
        args[0] = x[1:]
    elif change == "int class":
        args[2] = 33
    elif change == "int to one":
        args[2] = 1
    elif change == "constexpr":
        kw["BLOCK"] = 128
    elif change == "option":
        kw["num_warps"] = 8
    else:
        args[1] = x.double()
    k[(1,)](*args, **kw)
    assert [e[0] for e in log] == ["triton", "triton"]
    k[(1,)](*args, **kw)
    assert log[-1][0] == "direct"


@pytest.mark.parametrize("reason", ["disabled", "compile ahead", "hook", "callable grid",
                                    "runtime arg by keyword", "unknown arg type"])
def test_direct_path_steps_aside(stand_in, monkeypatch, reason):
    k, log = stand_in
    x = torch.zeros(64)
    call = lambda grid=(1,), **extra: k[grid](x, x, 32, 0.5, True, BLOCK=64, **extra)  # noqa: E731
    call()
    call()
    assert [e[0] for e in log] == ["triton", "direct"]
    if reason == "disabled":
        monkeypatch.setattr(launch, "enabled", False)
    elif reason == "compile ahead":
        monkeypatch.setattr(ahead, "_ACTIVE", object())
    elif reason == "hook":
        from triton import knobs

        hook = lambda metadata: None  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        monkeypatch.setattr(k, "_stream", lambda d: 0)
        try:
            call()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert log[-1][0] == "triton"
        return
    elif reason == "callable grid":
        call(grid=lambda meta: (1,))
        assert log[-1][0] == "triton"
        return
    elif reason == "runtime arg by keyword":
        k[(1,)](x, x, 32, 0.5, flag=True, BLOCK=64)
        k[(1,)](x, x, 32, 0.5, flag=True, BLOCK=64)
        assert [e[0] for e in log[-2:]] == ["triton", "triton"]
        return
    else:
        k[(1,)](x, x, 32, 0.5, object(), BLOCK=64)
        k[(1,)](x, x, 32, 0.5, object(), BLOCK=64)
        assert [e[0] for e in log[-2:]] == ["triton", "triton"]
        return
    call()
    assert log[-1][0] == "triton"


def test_interpreted_kernels_launch_through_triton():
    """Under the interpreter (CPU tests) every launch takes Triton's path and computes as before."""
    from scaffold.kernels.lib.device import interpreting
    from scaffold.kernels.lib.splits import sum_splits

    if not interpreting():
        pytest.skip("runs where Triton interprets")
    before = launch.counts()
    p = torch.arange(3 * 10, dtype=torch.float32).view(3, 10)
    for _ in range(2):
        out = sum_splits(p, torch.empty(10))
        assert torch.equal(out, p.sum(0))
    after = launch.counts()
    assert after["direct"] == before["direct"] and after["triton"] == before["triton"] + 2


# --- on a GPU: the same bits either way, and the direct path taken -------------------------------

@pytest.mark.gpu
def test_training_steps_are_bitwise_equal_through_either_path(monkeypatch):
    from scaffold.bench.minibatch import make_step

    def run(direct: bool):
        monkeypatch.setattr(launch, "enabled", direct)
        torch.manual_seed(0)
        model, step, masks = make_step("ladder", 5, 16, torch.device("cuda"))
        before = launch.counts()
        for i in range(3):
            step(masks[i % len(masks)])
        torch.cuda.synchronize()
        after = launch.counts()
        return ({k: v.detach().clone() for k, v in model.state_dict().items()},
                after["direct"] - before["direct"], after["triton"] - before["triton"])

    ref, direct0, triton0 = run(False)
    got, direct1, triton1 = run(True)
    assert direct0 == 0 and triton0 > 0
    assert direct1 > triton1 > 0, (direct1, triton1)  # after the first step, launches go direct
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])]


@pytest.mark.gpu
def test_misaligned_inputs_take_their_own_kernel(monkeypatch):
    """A view that starts off a 16-byte boundary must not reuse the aligned launch's kernel: each call,
    alternating, gives the bits Triton's own path gives it (the two kernels may differ in the last bit
    from each other: vectorized and scalar loads can order the reductions differently)."""
    from scaffold.kernels import groupnorm as gn

    g = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randn(1 + 64 * 16**3, generator=g, device="cuda").to(torch.bfloat16)
    aligned = buf[:-1].view(1, 16**3, 64).permute(0, 2, 1).view(1, 64, 16, 16, 16)
    shifted = buf[1:].view(1, 16**3, 64).permute(0, 2, 1).view(1, 64, 16, 16, 16)
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    monkeypatch.setattr(launch, "enabled", False)
    expect = [gn.forward(t, 8, None, None, 1e-5, True, torch.float32)[0] for t in (aligned, shifted)]
    monkeypatch.setattr(launch, "enabled", True)
    before = launch.counts()
    for _ in range(3):
        for t, e in zip((aligned, shifted), expect):
            assert torch.equal(gn.forward(t, 8, None, None, 1e-5, True, torch.float32)[0], e)
    assert launch.counts()["direct"] - before["direct"] >= 6  # the later rounds went direct


@pytest.mark.gpu
def test_gluon_conv_launches_direct_with_the_same_bits(monkeypatch):
    from scaffold.kernels.conv import gluon as G

    if not G.available():
        pytest.skip(G.unavailable_reason())
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((1, 64, 16, 16, 16), generator=g, device="cuda").to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    w = (0.05 * torch.randn((64, 64, 3, 3, 3), generator=g, device="cuda")).to(torch.bfloat16)
    monkeypatch.setattr(launch, "enabled", False)
    ref = (G.conv3d_forward(x, w), G.conv3d_backward_data(x, w))
    monkeypatch.setattr(launch, "enabled", True)
    before = launch.counts()
    for _ in range(2):
        got = (G.conv3d_forward(x, w), G.conv3d_backward_data(x, w))
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    after = launch.counts()
    assert after["direct"] - before["direct"] >= 2
