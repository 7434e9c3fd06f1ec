"""The benchmarks' timing function on the CPU (the device and host timers need a GPU: see
tests/test_kernel_conv_gpu.py) and the tuners' block rewrite in print mode."""
import pytest

from scaffold.bench import rewrite_block
from scaffold.bench.timing import Timing, measure


def test_wall_timer_on_the_cpu_times_every_repetition():
    calls = []
    t = measure(lambda: calls.append(1), reps=5, warmup=2, calls=3, device="cpu")
    assert len(calls) == 2 + 5 * 3 and len(t.ms) == 5
    assert t.min <= t.median and all(v >= 0.0 for v in t.ms)
    assert Timing((3.0, 1.0, 2.0)).median == 2.0 and Timing((3.0, 1.0, 2.0)).min == 1.0


def test_bad_timer_arguments_are_refused():
    with pytest.raises(ValueError, match="timer='gpu'"):
        measure(lambda: None, timer="gpu", device="cpu")
    with pytest.raises(ValueError, match="reps=0"):
        measure(lambda: None, reps=0, device="cpu")
    with pytest.raises(RuntimeError, match="'device' timer needs a CUDA GPU"):
        measure(lambda: None, timer="device", device="cpu")


def test_print_mode_leaves_the_source_alone(tmp_path):
    path = tmp_path / "table.py"
    text = 'A = 1\nTABLE: dict[str, tuple] = {\n    "k": (1, 2),\n}\n# END TABLE\n'
    path.write_text(text)
    block = rewrite_block(path, "TABLE", {"k": [3, 4], "a": (5,)}, write=False)
    assert block == 'TABLE: dict[str, tuple] = {\n    "a": (5,),\n    "k": (3, 4),\n}\n# END TABLE'
    assert path.read_text() == text
    rewrite_block(path, "TABLE", {"k": [3, 4], "a": (5,)})
    assert path.read_text() == "A = 1\n" + block + "\n"
    with pytest.raises(ValueError, match="no generated ROUTES block"):
        rewrite_block(path, "ROUTES", {})
