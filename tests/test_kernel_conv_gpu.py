"""The conv kernels at the real shapes of the scale-7 model (GPU only): every distinct site, bf16,
each direction within 1e-2 relative error of cuDNN in fp32 on the same operands, bitwise equal across
repeated calls and across two processes."""
import json
import os
import subprocess
import sys

import pytest
import torch

from scaffold.bench.conv import check_site, conv_sites

pytestmark = pytest.mark.gpu
SITES = conv_sites(7)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("site", SITES, ids=[s.name for s in SITES])
def test_site_matches_cudnn_and_repeats_bitwise(site):
    r = check_site(site)
    for key, v in r.items():
        if key.endswith("_rel_err"):
            assert v < 1e-2, f"{site.name} {key} = {v:.2e}"
        if key.endswith("_repeat_equal"):
            assert v, f"{site.name} {key}: two calls differ"


_HASHES = """
import json, sys
from scaffold.bench.conv import check_site, conv_sites
names = sys.argv[1].split(",")
sites = [s for s in conv_sites(7) if s.name in names]
print(json.dumps({s.name: {k: v for k, v in check_site(s).items() if k.endswith("_sha")} for s in sites}))
"""


@pytest.mark.slow
def test_bitwise_identical_across_processes():
    names = "inc.conv1,inc.conv2,downs.3.conv.conv2,ups.0.up,outc"
    env = dict(os.environ, PYTHONPATH=ROOT)
    runs = [subprocess.run([sys.executable, "-c", _HASHES, names], capture_output=True, text=True,
                           env=env, cwd=ROOT, check=True) for _ in range(2)]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert len(first) == 5 and first == second


def test_bench_device_timer_times_every_rung():
    """bench.conv --timer device: every rung and direction of a site gets a device time from CUDA-graph
    replays (Triton launchers and cuDNN both capture), and the totals say which timer made them."""
    from scaffold.bench.conv import DIRECTIONS, RUNGS, bench_model

    res = bench_model(4, names=["outc", "ups.0.up"], timer="device", log=lambda line: None)
    assert res["timer"] == "device" and len(res["rows"]) == 2
    for row in res["rows"]:
        for rung in RUNGS:
            for d in DIRECTIONS:
                assert row.get(f"{rung}_{d}_error") is None, row.get(f"{rung}_{d}_error")
                assert 0.0 < row[f"{rung}_{d}_ms"] < 100.0


def test_host_timer_excludes_device_time():
    """The host timer is the host's launch cost alone: for a kernel that keeps the device busy for
    milliseconds it must stay far below the device time that the device timer measures for the same
    call (host_ms is the host timer's median, as bench.minibatch reads it)."""
    from scaffold.bench.timing import host_ms, measure

    a = torch.randn(4096, 4096, device="cuda")
    call = lambda: a @ a  # noqa: E731
    device, host = measure(call, timer="device", reps=5).median, host_ms(call, calls=20, rounds=3)
    assert device > 0.5 and 0.0 < host < 0.2 * device, (host, device)


def test_bench_host_timer_times_every_rung():
    """bench.conv --timer host: every rung and direction of a site gets a host time."""
    from scaffold.bench.conv import DIRECTIONS, RUNGS, bench_model

    res = bench_model(4, names=["outc"], timer="host", log=lambda line: None)
    assert res["timer"] == "host" and len(res["rows"]) == 1
    for rung in RUNGS:
        for d in DIRECTIONS:
            assert 0.0 < res["rows"][0][f"{rung}_{d}_ms"] < 100.0
