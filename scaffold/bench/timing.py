"""GPU timing shared by the benchmarks: what a call costs the device, apart from what it costs the host.

Three numbers answer different questions. `wall_ms` times a call as launched from Python (CUDA events
around it): when the device finishes faster than the host can launch, that is host time. `graph_ms`
captures the call in a CUDA graph once and times replays: the device time alone, which is what a training
step pays when its host runs ahead of the device (the trainer never waits on the device, so it does
whenever its host work per step is below the device's). Both flush the L2 cache before each repetition,
so a kernel never reads its inputs from a warm cache that the real step would not leave it.
`host_ms` is the third: the host's own time to launch a call (Python, dispatch, launchers), measured
while the device is held busy so that no launch waits on it; a call is host-bound where it exceeds
`graph_ms`.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

_FLUSH: dict[str, torch.Tensor] = {}


def flush_l2() -> None:
    """Overwrite 256 MiB (more than any GPU's L2) on the current stream."""
    _FLUSH.setdefault("buf", torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")).zero_()


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def timed_ms(launch: Callable[[], object], reps: int) -> float:
    """Median ms of `reps` launches, each between CUDA events, the L2 flushed before each."""
    times = []
    for _ in range(reps):
        flush_l2()
        a, b = _events()
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median ms of fn() launched from Python (host launch cost included where it dominates)."""
    fn()
    torch.cuda.synchronize()
    return timed_ms(fn, reps)


def graph_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 2) -> float:
    """Median ms of fn() replayed from a CUDA graph (device time only). fn may run autograd, as long as
    its forward runs inside fn too (backward kernels go to the stream their forward ran on)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream: compiles, autotunes, allocates
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
        return timed_ms(graph.replay, reps)
    finally:
        del graph


def host_ms(fn: Callable[[], object], calls: int = 40, rounds: int = 5) -> float:
    """Median over `rounds` of the host's ms per call of fn(), `calls` calls a round, each round
    enqueued behind a device-side sleep that outlasts it (checked: a round whose sleep had ended
    before its last launch is retried with a longer sleep), so no launch waits for the device."""
    fn()
    torch.cuda.synchronize()
    cycles, times = 50_000_000, []
    while len(times) < rounds:
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
                raise RuntimeError("host_ms: could not keep the device busy through one round")
        else:
            times.append(t)
        torch.cuda.synchronize()
    return statistics.median(times)


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
