"""A launcher that cannot run here is a one-line error before Hydra starts: the submitit launchers without
their plugin (the `slurm` extra), and the Slurm ones without Slurm's srun."""
from __future__ import annotations

import pytest

from helpers import REPO, cli as run_cli
from scaffold import cli
from scaffold.config import ConfigError

MISSING = "hydra/launcher=slurm needs hydra-submitit-launcher: pip install 'scaffold-unet[slurm]'"

# Installed as sitecustomize in a subprocess: the plugin looks absent to the pre-flight check.
BLOCK_SUBMITIT = """
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("hydra_plugins.hydra_submitit_launcher"):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, _Block())
"""


def without_submitit(monkeypatch):
    real = cli._has_plugin
    monkeypatch.setattr(cli, "_has_plugin",
                        lambda module: False if "submitit" in module else real(module))


@pytest.mark.parametrize("launcher", ["slurm", "submitit_slurm", "submitit_local"])
def test_missing_submitit_plugin_is_one_line(monkeypatch, launcher):
    without_submitit(monkeypatch)
    with pytest.raises(ConfigError) as err:
        cli.preflight([f"hydra/launcher={launcher}", "seed=0,1"])
    assert str(err.value) == MISSING.replace("=slurm", f"={launcher}")


def test_slurm_launcher_without_srun_is_one_line(monkeypatch):
    monkeypatch.setattr(cli, "_has_plugin", lambda module: True)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^hydra/launcher=slurm: Slurm's srun is not on PATH") as err:
        cli.preflight(["hydra/launcher=slurm", "seed=0,1"])
    assert "\n" not in str(err.value)
    # The local submitit launcher needs no Slurm.
    assert cli.preflight(["hydra/launcher=submitit_local", "seed=0,1", "epochs=1"])


def test_plugin_check_survives_a_missing_namespace():
    assert cli._has_plugin("scaffold_no_such_namespace.plugin") is False


def test_command_line_without_the_slurm_extra(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_SUBMITIT)
    work = tmp_path / "work"
    work.mkdir()
    res = run_cli("-m", "hydra/launcher=slurm", "seed=0,1", "epochs=1", cwd=work,
                  env={"PYTHONPATH": f"{site}:{REPO}"})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: {MISSING}"]
    assert list(work.iterdir()) == []  # stopped before Hydra made a sweep directory
