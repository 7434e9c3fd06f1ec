"""scaffold.bench.trace: communication against computation in a profiler trace, from intervals."""
from __future__ import annotations

import json

import pytest
import torch

from scaffold.bench import trace


def kernel(name, start, end, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "pid": 0, "tid": stream}


def test_parts_are_unions_over_streams_and_overlap_is_their_intersection(tmp_path, capsys):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 15},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 15},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 15, "dur": 15},
        kernel("conv_fwd_kernel", 0, 10),
        kernel("_gn_fwd_partials_kernel", 8, 10, stream=9),  # inside the conv's time on another stream
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 12, "dur": 8, "pid": 0, "tid": 7},
        kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 5, 14, stream=20),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 25, 27, stream=21),
        {"ph": "X", "cat": "cpu_op", "name": "aten::conv3d", "ts": 0, "dur": 30},  # host: not counted
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},  # no duration: not counted
    ]
    path = tmp_path / "profile_trace.json"
    path.write_text(json.dumps({"traceEvents": events, "deviceProperties": []}))
    got = trace.analyze(trace.load(path))
    assert got["steps"] == 2 and got["window_ms"] == 27 / 1e3  # first device start to last end, in µs
    per = {k: v * 2 * 1e3 for k, v in got["ms_per_step"].items()}  # back to µs over the window
    assert per["computation"] == 18  # [0, 10] and [12, 20]
    assert per["send/recv (halo)"] == 9 and per["all-reduce"] == 2 and per["communication"] == 11
    assert per["overlapped"] == 7  # [5, 10] and [12, 14]
    assert per["exposed"] == 4 and per["idle"] == 5  # nothing runs in [20, 25]
    assert got["communication_overlapped"] == 7 / 11
    assert abs(sum(got["share_of_window"][k] for k in ("computation", "exposed", "idle")) - 1) < 1e-12

    out = tmp_path / "trace.json"
    assert trace.main([str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "send/recv (halo)" in printed and "63.6%" in printed  # 7 of 11 hidden
    assert json.loads(out.read_text())["communication_overlapped"] == 7 / 11


@pytest.mark.parametrize("name, part", [
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", "send/recv (halo)"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", "reduce-scatter"),
    ("ncclDevKernel_Broadcast_RING_LL(x)", "broadcast"),
    ("ncclDevKernel_Generic(x)", "other collective"),
    ("sm90_xmma_fprop_implicit_gemm_bf16", "computation"),
])
def test_nccl_kernels_are_named_by_collective(name, part):
    assert trace.kind(name) == part


def test_a_cpu_runs_trace_and_a_bad_file_are_one_line_errors(tmp_path, capsys):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    cpu = tmp_path / "cpu_trace.json"
    prof.export_chrome_trace(str(cpu))  # a real trace, without device work
    assert trace.main([str(cpu)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {cpu}: no device kernels in the trace: it is a CPU run's (profile a run on a GPU)"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert trace.main([str(bad)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {bad}: not JSON (expected a torch profiler trace, e.g. a run's profile_trace.json)"]
    assert trace.main([str(tmp_path / "missing.json")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.gpu
def test_a_real_gpu_trace_has_computation_and_no_communication(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(2048, 2048, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            a = a @ a / 2048
        torch.cuda.synchronize()
    path = tmp_path / "gpu_trace.json"
    prof.export_chrome_trace(str(path))
    got = trace.analyze(trace.load(path))
    assert got["ms_per_step"]["computation"] > 0 and got["ms_per_step"]["communication"] == 0
    assert got["communication_overlapped"] is None
