"""Triton is optional where it only would run in its interpreter: a CPU install without it trains, and
asking for a Triton rung says how to get it, in one line."""
from __future__ import annotations

from helpers import REPO, TINY, cli

# Installed as sitecustomize in a subprocess: `import triton` fails as on a machine without it.
BLOCK_TRITON = """
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _Block())
"""


def test_cpu_training_without_triton(cache, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_TRITON)
    res = cli(*TINY, "epochs=1", "ladder.conv=triton", f"data.cache_dir={cache}", cwd=tmp_path,
              env={"PYTHONPATH": f"{site}:{REPO}"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Triton is not installed (pip install 'scaffold-unet[triton]')" in res.stderr
    assert "ModuleNotFoundError" not in res.stderr and "Traceback" not in res.stderr
    assert (next(tmp_path.glob("outputs/*/*")) / "train_stats.csv").exists()
