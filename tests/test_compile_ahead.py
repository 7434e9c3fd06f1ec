"""Compile-ahead (scaffold.kernels.lib.ahead): launches inside the block only compile, on a pool, and the
kernels are in Triton's caches when it ends; where that cannot run, the block runs its work as usual."""
import pytest
import torch

triton = pytest.importorskip("triton")

from scaffold.kernels.lib import ahead  # noqa: E402


@pytest.fixture
def cold_cuda_cache(tmp_path, monkeypatch):
    """The GPU tests' setting: a CUDA device, a Triton with the asynchronous compile mode, and an empty
    Triton cache of the test's own (so every kernel compiles)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not ahead.available():
        pytest.skip("this Triton has no asynchronous compile mode")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_inside_the_block_a_launch_is_a_warmup_and_outside_it_is_not(monkeypatch):
    """The wrapper hands Triton's own `warmup` flag through, forced on while a block is open, so a
    launch compiles without running; outside a block launches run (the flag as given). A launch on
    another thread (the autograd engine runs the backward's on its own) is a warm-up too, submitted
    to the block's compile mode, which that thread did not inherit."""
    import threading

    from triton.runtime.jit import JITFunction

    seen, modes = [], []
    var = ahead._mode_var()

    def fake_run(self, *args, grid, warmup, **kwargs):
        seen.append(warmup)
        modes.append(var.get() if var is not None else None)
        return "kernel"

    monkeypatch.setattr(JITFunction, "run", fake_run)
    monkeypatch.setattr(ahead, "_PATCHED", False)
    monkeypatch.setattr(ahead, "available", lambda: True)

    class Mode:  # stands in for Triton's AsyncCompileMode: records that it was entered and left
        events = []

        def __init__(self, executor, *, ignore_errors=False):
            self.executor = executor
            Mode.events.append(f"ignore_errors={ignore_errors}")

        def __enter__(self):
            Mode.events.append("enter")
            return self

        def __exit__(self, *exc):
            Mode.events.append("exit")

    monkeypatch.setattr(ahead, "_async_mode", lambda: Mode)
    fn = object.__new__(JITFunction)
    with ahead.compile_ahead(threads=2) as on:
        assert on
        JITFunction.run(fn, grid=(1,), warmup=False)
        other = threading.Thread(target=lambda: JITFunction.run(fn, grid=(1,), warmup=False))
        other.start()
        other.join(timeout=60)
        block_mode = ahead._ACTIVE
    JITFunction.run(fn, grid=(1,), warmup=False)
    JITFunction.run(fn, grid=(1,), warmup=True)
    assert seen == [True, True, False, True]
    assert isinstance(block_mode, Mode) and ahead._ACTIVE is None
    if var is not None:  # each launch in the block saw the block's mode as Triton's active one
        assert modes[:2] == [block_mode, block_mode] and modes[2:] == [None, None]
    # a kernel that fails to compile is left for its launch to fail (and the ladder to fall back)
    assert Mode.events == ["ignore_errors=True", "enter", "exit"]


def test_a_block_opened_inside_a_block_raises_instead_of_waiting(monkeypatch):
    """The process-wide lock must not turn a nested block into a hang: Triton's mode refuses it."""
    if ahead._async_mode() is None:
        pytest.skip("this Triton has no asynchronous compile mode")
    monkeypatch.setattr(ahead, "available", lambda: True)
    import threading

    monkeypatch.setattr(ahead, "_PATCHED", True)  # no launch here: leave JITFunction.run as it is
    raised = []

    def nested():  # on a thread of its own, so that a hang fails the test instead of stalling it
        with ahead.compile_ahead(threads=1):
            try:
                with ahead.compile_ahead(threads=1):
                    pass
            except RuntimeError as e:
                raised.append(str(e))

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the nested block hung"
    assert len(raised) == 1 and "already active" in raised[0]
    assert ahead._ACTIVE is None


def test_where_it_cannot_run_the_block_runs_its_work_as_usual(monkeypatch):
    monkeypatch.setattr(ahead, "available", lambda: False)
    ran = []
    with ahead.compile_ahead() as on:
        ran.append(on)
    assert ran == [False]
    assert ahead._ACTIVE is None


def test_not_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ahead.available()


@pytest.mark.gpu
def test_a_kernel_compiled_ahead_is_not_run_then_runs_without_compiling(cold_cuda_cache, monkeypatch):
    """On CUDA with a cold cache: a launch in the block leaves its output untouched; after the block the
    same launch runs and compiles nothing more."""
    import triton.language as tl
    from triton import knobs


    @triton.jit
    def fill(out_ptr, value, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, value, mask=offs < n)

    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *a, **k: compiled.append(1))
    out = torch.zeros(1000, device="cuda")
    with ahead.compile_ahead(threads=4) as on:
        assert on
        fill[(8,)](out, 3.0, 1000, BLOCK=128)
        fill[(8,)](out, 3.0, 1000, BLOCK=256)
    torch.cuda.synchronize()
    assert torch.count_nonzero(out).item() == 0  # nothing ran
    assert len(compiled) == 2  # both specializations compiled, installed on leaving
    fill[(8,)](out, 3.0, 1000, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.all(out == 3.0).item()
    assert len(compiled) == 2  # the launch found its kernel compiled


@pytest.mark.gpu
def test_a_backward_launch_in_the_block_compiles_on_the_pool_and_runs_nothing(cold_cuda_cache, monkeypatch):
    """The backward's kernels launch on the autograd engine's device thread: in the block they compile
    on the pool too (not one by one on that thread) and run nothing; after it they run compiled."""
    import threading

    import triton.language as tl
    from triton import knobs


    @triton.jit
    def scale_by(x_ptr, out_ptr, value, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * value, mask=offs < n)

    threads = []

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            threads.append(threading.current_thread() is threading.main_thread())
            g = g.contiguous()  # (sum's backward hands on an expanded tensor)
            out = torch.zeros_like(g)
            scale_by[(8,)](g, out, 2.0, g.numel(), BLOCK=128)
            return out

    from triton import compiler as triton_compiler

    compiled, compilers = [], []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *a, **k: compiled.append(1))
    real_compile = triton_compiler.compile

    def recording_compile(*args, **kwargs):  # the kernel is new: its first launch looks this up
        compilers.append(threading.current_thread().name)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(triton_compiler, "compile", recording_compile)
    x = torch.ones(1000, device="cuda", requires_grad=True)
    with ahead.compile_ahead(threads=4) as on:
        assert on
        Twice.apply(x).sum().backward()
    torch.cuda.synchronize()
    assert threads == [False]  # the autograd engine ran it on its own thread
    assert torch.count_nonzero(x.grad).item() == 0  # nothing ran
    assert len(compiled) == 1 and compilers == ["triton-compile_0"]  # on the pool
    x.grad = None
    Twice.apply(x).sum().backward()
    torch.cuda.synchronize()
    assert torch.all(x.grad == 2.0).item()
    assert len(compiled) == 1  # the launch found its kernel compiled


def test_the_compiler_threads_are_shared_between_the_processes_of_a_node(monkeypatch):
    monkeypatch.setattr(ahead.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ahead.workers() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ahead.workers() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert ahead.workers() == 1


def test_a_failure_to_compile_ahead_leaves_the_kernels_to_their_first_launch(cache, tmp_path, monkeypatch,
                                                                             caplog):
    """Fault injected: the compile-ahead pass raises as it ends. The run goes on (one warning line),
    and its result is the same as a run without the pass."""
    import contextlib
    import logging

    from helpers import stable_rows, tiny_cfg
    from scaffold import trainer as trainer_module
    from scaffold import worker

    @contextlib.contextmanager
    def broken(threads=None):
        yield True
        raise RuntimeError("compiler crashed")

    plain = tmp_path / "plain"
    worker.run(tiny_cfg(cache, "epochs=1"), plain)
    monkeypatch.setattr(trainer_module, "compile_ahead", broken)
    with caplog.at_level(logging.WARNING, logger="scaffold"):
        worker.run(tiny_cfg(cache, "epochs=1"), tmp_path / "ahead")
    assert any("compiling the kernels ahead failed (RuntimeError: compiler crashed)" in r.getMessage()
               for r in caplog.records)
    assert stable_rows(tmp_path / "ahead" / "train_stats.csv") == stable_rows(plain / "train_stats.csv")


def test_the_pool_builds_each_compiled_kernels_launcher_and_a_failed_build_costs_nothing(monkeypatch):
    """What Triton's compile mode submits runs on the pool, then the kernel's launcher is built there
    too; a launcher that fails to build leaves the kernel as compiled (its first launch builds it); a
    compilation that fails still fails (the mode leaves that kernel out)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    built = []

    def build(kernel):
        built.append((kernel, threading.current_thread().name))
        if kernel == "broken launcher":
            raise RuntimeError("no C compiler")

    monkeypatch.setattr(ahead, "_build_launcher", build)

    def broken_compile():
        raise ValueError("does not compile")

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="triton-compile") as pool:
        p = ahead._Pool(pool)
        assert p.submit(lambda: "kernel").result(timeout=60) == "kernel"
        assert p.submit(lambda: "broken launcher").result(timeout=60) == "broken launcher"
        failed = p.submit(broken_compile)
        with pytest.raises(ValueError, match="does not compile"):
            failed.result(timeout=60)
    assert [k for k, _ in built] == ["kernel", "broken launcher"]
    assert all(name.startswith("triton-compile") for _, name in built)


@pytest.mark.gpu
def test_launchers_are_built_in_the_block_so_the_first_launch_builds_none(cold_cuda_cache, monkeypatch):
    """On CUDA with a cold cache: every host launcher a C compiler builds (Triton <= 3.6) is built on
    the pool inside the block; the launches after it build none."""
    import threading

    import triton.language as tl
    import triton.runtime.build as build

    builds, phase = [], ["block"]
    real = build._build

    def counted(name, *args, **kwargs):
        if name == "__triton_launcher":
            builds.append((phase[0], threading.current_thread().name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(build, "_build", counted)

    @triton.jit
    def scale(x_ptr, out_ptr, factor, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.zeros_like(x)
    with ahead.compile_ahead(threads=4):
        scale[(8,)](x, out, 2.0, 1000, BLOCK=128)
        scale[(4,)](x, out, 2.0, 1000, BLOCK=256)
    phase[0] = "after"
    scale[(8,)](x, out, 2.0, 1000, BLOCK=128)
    scale[(4,)](x, out, 2.0, 1000, BLOCK=256)
    torch.cuda.synchronize()
    assert torch.equal(out, 2.0 * x)
    assert [p for p, _ in builds if p == "after"] == []
    assert all(name.startswith("triton-compile") for _, name in builds)
