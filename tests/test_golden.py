"""Golden losses: the first training steps of a tiny run, bit for bit, against a committed file.

A change that moves these numbers changes the numerics of training. If that is intended, regenerate with
`scripts/run-tests tests/test_golden.py --update-golden` and say in the commit message why they moved.
The file records the machine class it was made on: CPU kernels (oneDNN, BLAS) may round differently on
another processor family, so the comparison is exact on the reference machine only.
"""
from __future__ import annotations

import json
import platform

import torch

from helpers import REPO, tiny_cfg
from scaffold import worker
from scaffold.trainer import Trainer

GOLDEN = REPO / "tests" / "golden" / "tiny_losses.json"


def test_first_losses_match_golden_file(tmp_path, monkeypatch, update_golden):
    losses: list[str] = []
    real = Trainer.step

    def recording_step(self, *args, **kwargs):
        loss, dice = real(self, *args, **kwargs)
        losses.append(float(loss).hex())  # reading the value is fine in a test
        return loss, dice

    monkeypatch.setattr(Trainer, "step", recording_step)
    worker.run(tiny_cfg(tmp_path / "cache", "epochs=2", "warmup_steps=0"), tmp_path / "run")
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)
    param_sum = float(sum(p.double().sum() for p in state["model"].values())).hex()
    record = {"machine": platform.machine(), "torch": torch.__version__.split("+")[0],
              "step_losses": losses, "param_sum": param_sum}
    if update_golden:
        GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert len(losses) == 6
    assert losses == golden["step_losses"]
    assert param_sum == golden["param_sum"]
