"""The one timing function of the benchmarks: `measure(fn, timer=...)`, and the profiler's kernel table.

A call has three costs, and each timer answers for one of them:
  wall    fn as launched from Python: CUDA events around each repetition, every repetition enqueued
          before one wait at the end, as triton.testing.do_bench does (the host clock on the CPU).
          Where the device runs a call faster than the host launches it, the host's launch cost is
          what this times, as in a training step, which never waits on the device either.
  device  fn captured once in a CUDA graph, the graph replayed between events: the device time alone.
          This is what a training step pays when its host runs ahead of its device, as the trainer's
          does whenever its host work per step is below the device's (it never waits on the device).
  host    the host's own time per call (Python, dispatch, launchers), the calls enqueued behind a
          device-side sleep so that no launch waits on the device. A call is host-bound where this
          exceeds its device time.
`wall` and `device` overwrite the L2 cache before each repetition: no kernel reads its inputs from a
warm cache that the real step would not leave it.

    t = measure(fn, timer="device", reps=30)     # t.median, t.min, t.ms (every repetition)

A repetition times `calls` calls back to back and reports ms per call; `warmup` calls run first, untimed
(they compile, autotune and allocate). For the host timer use many calls per repetition (a round is
timed with the host clock, whose resolution a single call would not clear).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

TIMERS = ("wall", "device", "host")


@dataclass(frozen=True)
class Timing:
    """ms per call of every repetition, in the order they ran."""
    ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    @property
    def min(self) -> float:
        return min(self.ms)


def measure(fn: Callable[[], object], *, timer: str = "wall", reps: int = 20, warmup: int = 2,
            calls: int = 1, device: Optional[torch.device | str] = None) -> Timing:
    """Times fn() with `timer` (see the module doc). `device` is where fn runs (default: CUDA when
    there is a GPU); on the CPU only `wall` applies, read from the host clock."""
    if timer not in TIMERS:
        raise ValueError(f"timer={timer!r}: expected one of {', '.join(TIMERS)}")
    if reps < 1 or calls < 1 or warmup < 0:
        raise ValueError(f"reps={reps}, calls={calls}, warmup={warmup}: expected reps >= 1, "
                         "calls >= 1, warmup >= 0")
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if not cuda and timer != "wall":
        raise RuntimeError(f"the {timer!r} timer needs a CUDA GPU")
    run = {"wall": _wall_ms, "device": _graph_ms, "host": _host_ms}[timer] if cuda else _cpu_ms
    return Timing(tuple(run(fn, reps, warmup, calls)))


def host_ms(fn: Callable[[], object], calls: int = 40, rounds: int = 5) -> float:
    """Median over `rounds` of the host's ms per call of fn(), `calls` calls a round:
    measure(fn, timer="host", reps=rounds, calls=calls, warmup=1).median."""
    return measure(fn, timer="host", reps=rounds, calls=calls, warmup=1).median


def kernel_ms(prof, calls: int = 1) -> dict[str, float]:
    """Device time per kernel name from a finished torch.profiler run, in ms per call: kernel (and
    memcpy/memset) durations summed by name, divided by `calls`. `record_function` ranges mirrored on
    the GPU timeline are not kernels and are left out."""
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False) \
                or evt.name.startswith(("Optimizer.", "## ", "ProfilerStep")):
            continue
        out[evt.name] = out.get(evt.name, 0.0) + evt.time_range.elapsed_us() / 1e3 / calls
    return out


# --- the timers -----------------------------------------------------------------------------------

_FLUSH: dict[str, torch.Tensor] = {}


def _flush_l2() -> None:
    """Overwrite 256 MiB (more than any GPU's L2) on the current stream."""
    _FLUSH.setdefault("buf", torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")).zero_()


def _cpu_ms(fn, reps: int, warmup: int, calls: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return times


def _wall_ms(fn, reps: int, warmup: int, calls: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _events_ms(lambda: [fn() for _ in range(calls)], reps, calls)


def _events_ms(launch: Callable[[], object], reps: int, calls: int) -> list[float]:
    """ms per call of `reps` launches, each between CUDA events, the L2 flushed before each; all are
    enqueued before the one wait at the end."""
    events = []
    for _ in range(reps):
        _flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / calls for a, b in events]


def _graph_ms(fn, reps: int, warmup: int, calls: int) -> list[float]:
    """Replays of fn captured in a CUDA graph. fn may run autograd, as long as its forward runs inside
    fn too (backward kernels go to the stream their forward ran on)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as the capture will run
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for attempt in range(2):  # a first capture in a process can trip on lazy initialisation: retry once
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=side):  # the stream the warm-up ran on
                fn()
            break
        except RuntimeError:
            del graph
            torch.cuda.synchronize()
            if attempt:
                raise
    graph.replay()
    torch.cuda.synchronize()
    try:
        return _events_ms(lambda: [graph.replay() for _ in range(calls)], reps, calls)
    finally:
        del graph


def _host_ms(fn, reps: int, warmup: int, calls: int) -> list[float]:
    """Each round enqueued behind a device-side sleep that outlasts it (checked: a round whose sleep had
    ended before its last launch is retried with a longer sleep), so no launch waits for the device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    cycles, times = 50_000_000, []
    while len(times) < reps:
        torch.cuda._sleep(cycles)
        busy = torch.cuda.Event()
        busy.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = (time.perf_counter() - t0) * 1e3 / calls
        if busy.query():  # the sleep was over: launches may have waited on the device
            cycles *= 2
            if cycles > 2**36:
                raise RuntimeError("host timer: could not keep the device busy through one round")
        else:
            times.append(t)
        torch.cuda.synchronize()
    return times
