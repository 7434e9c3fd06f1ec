"""Mistakes that Hydra itself would report (its flags, its config groups, its override grammar): one line
and exit code 2 before anything is written, and no empty `outputs/DATE/TIME` or `multirun/DATE/TIME`
folder left behind, even where Hydra reports the error itself."""
from __future__ import annotations

import pytest

from helpers import cli

LAUNCHERS = "basic | slurm | submitit_local | submitit_slurm"


@pytest.mark.parametrize("args, expected", [
    (["-m", "epochs=1", "--cfg", "hydra"],
     "--multirun (-m) and --cfg: only one of --run, --multirun (-m), --cfg, --info and --shell-completion"),
    (["-m", "epochs=1", "--info"], "--multirun (-m) and --info: only one of"),
    (["epochs=1", "-m", "seed=0,1"], "unrecognized arguments: seed=0,1 (Hydra reads the overrides after its flags"),
    (["--frob", "epochs=1"], "unrecognized arguments: --frob"),
    (["--cfg", "everything"], "argument --cfg/-c: invalid choice: 'everything'"),
    (["epochs=1", "hydra/launcher=nope"], f"hydra/launcher=nope: no such option (choose from: {LAUNCHERS})"),
    (["-m", "seed=0,1", "hydra/launcher=nope"], f"hydra/launcher=nope: no such option (choose from: {LAUNCHERS})"),
    (["-m", "seed=0,1", "hydra/sweeper=nope"], "hydra/sweeper=nope: no such option (choose from: basic"),
    (["-m", "seed=0,1", "hydra.launcher.nope=5"], "Could not override 'hydra.launcher.nope'"),
    (["epochs=1", "hydra.job.chdir=maybe"], "hydra.job.chdir=maybe: Value 'maybe' is not a valid bool"),
    (["scale=["], "scale=[: no viable alternative at input '['"),
    (["-m", "seed=0,1", "scale=["], "scale=[: no viable alternative at input '['"),
    (["-m", "seed=0,1", "--config-dir", "no-such-conf"], "--config-dir no-such-conf: no such folder"),
])
def test_hydra_level_mistakes_are_one_line_and_leave_no_folder(tmp_path, args, expected):
    res = cli(*args, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_that_hydra_refuses_leaves_no_empty_sweep_folder(tmp_path):
    """With a config folder of its own the command is composed by Hydra alone (not checked first): its
    error is Hydra's, but the sweep folder made for it is taken away again."""
    conf = tmp_path / "conf"
    conf.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    res = cli("-m", "seed=0,1", "hydra/launcher=nope", "--config-dir", str(conf), cwd=work)
    assert res.returncode != 0
    assert "hydra/launcher/nope" in res.stderr, res.stderr
    assert list(work.iterdir()) == []


def test_overrides_added_for_the_run_directory_stay_beside_the_users():
    """A command line that ends with a flag and its value still runs Hydra's parser cleanly after the
    sweep folder is added to it (Hydra takes the overrides as one run of words)."""
    from scaffold.cli import with_overrides

    assert with_overrides(["-m", "seed=0,1", "--config-dir", "c"], ["hydra.sweep.dir=s"]) == \
        ["-m", "seed=0,1", "hydra.sweep.dir=s", "--config-dir", "c"]
    assert with_overrides(["-m"], ["hydra.sweep.dir=s"]) == ["-m", "hydra.sweep.dir=s"]
