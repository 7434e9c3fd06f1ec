"""`python -m scaffold.data [key=value ...]`: generate (or reuse) the dataset of a training config and
say what it holds. Same config and overrides as `python -m scaffold.train`, e.g. `scale=5 seed=1`.
"""
from __future__ import annotations

import pathlib
import sys
from dataclasses import fields

import hydra

from ..cli import register
from ..config import Config, ConfigError, DataConfig
from .store import data_key, prepare, read_info

_REPO_CONF = pathlib.Path(__file__).resolve().parents[2] / "conf"
CONFIG_PATH = str(_REPO_CONF) if _REPO_CONF.is_dir() else "pkg://scaffold.conf"
# Work in the current folder and write nothing of Hydra's own (no outputs/, no .hydra/, no log file);
# --help prints this command's own page (register_help).
QUIET_HYDRA = {"hydra.run.dir": ".", "hydra.output_subdir": "null", "hydra/job_logging": "none",
               "hydra/hydra_logging": "none", "hydra/help": "scaffold_data"}
# Keys this command reads that do not change a dataset's bytes (listed apart in --help; `progress` is
# left out there, its docstring is about training epochs).
LOGISTICS = ("data.cache_dir", "data.workers")


def defining_keys() -> list[str]:
    """The schema's keys that define a dataset: those of its cache key (store.data_key), which is the
    one list of what the bytes depend on."""
    import numpy as np

    names = data_key(DataConfig(), 1, 0, np.zeros(0))
    top, data = {f.name for f in fields(Config)}, {f.name for f in fields(DataConfig)}
    # data_key's names are unprefixed; its entries that are no config key (the format version, the
    # class library's digest) are not for the user to set.
    return [n if n in top else f"data.{n}" for n in names if n in top or n in data]


def register_help() -> None:
    """Stores this command's --help page as hydra/help `scaffold_data` (selected in QUIET_HYDRA)."""
    from hydra.core.config_store import ConfigStore

    from .. import help as help_page

    header, body = help_page.data_page(defining_keys(), LOGISTICS)
    ConfigStore.instance().store(group="hydra/help", name="scaffold_data",
                                 node=help_page.hydra_help_node("scaffold.data", header, body))


def describe(path: pathlib.Path) -> str:
    """A short human summary of a dataset file."""
    info = read_info(path)
    counts = ", ".join(f"{label}:{int(n)}" for label, n in enumerate(info.class_counts))
    return "\n".join([
        f"dataset   {info.path}",
        f"size      {info.path.stat().st_size / 2**20:.1f} MiB",
        f"volumes   {info.n_train} train / {info.n_val} val, {info.edge}³ voxels each",
        f"classes   {info.n_classes} labels (background + {info.n_classes - 1} fractal classes)",
        f"voxels    per label over the training split: {counts}",
        f"created   {info.provenance['created']} (scaffold {info.provenance['package_version']})",
    ])


class Stopped(BaseException):
    """A stop signal (Ctrl-C, a closed terminal, a scheduler's SIGTERM) while the dataset is made."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_RAISED: list[Stopped] = []  # what _stop raised: the exception can surface as another (see _load)


def _stop(signum: int, frame=None) -> None:
    _RAISED.append(Stopped(signum))
    raise _RAISED[-1]


def _load(cfg):
    """The dataset, verified or made. A stop signal's Stopped, raised while a lock was being released
    (a worker pool's condition wait), leaves "release unlocked lock" in its place: once a signal was
    received, whatever escapes is that Stopped."""
    from .store import load

    try:
        return load(cfg.data, cfg.scale, cfg.seed, progress=cfg.progress)[0]  # verified, or repaired
    except BaseException:
        if _RAISED:
            raise _RAISED[0] from None
        raise


@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base=None)
def main(cfg) -> None:
    import signal

    from .store import DatasetCorrupt

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _stop)  # one line instead of a traceback (the workers leave them to us)
    try:
        path = _load(cfg)
    except (ConfigError, DatasetCorrupt) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Stopped as stop:
        print(f"interrupted by {signal.Signals(stop.signum).name}; no half-written dataset is left (a dataset "
              "is written under a temporary name and renamed once complete)", file=sys.stderr)
        sys.exit(128 + stop.signum)
    print(describe(path))


def _with_quiet_hydra(argv: list[str]) -> list[str]:
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in argv[1:]}
    return argv + [f"{key}={value}" for key, value in QUIET_HYDRA.items() if key not in given]


if __name__ == "__main__":
    from .. import cli

    from ..config import validate_data

    try:  # the training command's pre-flight (unknown keys, wrong types, retired keys), then the
        # semantic checks of what this command reads: the data keys
        cli.preflight(sys.argv[1:], check_resume=False, check=lambda c: validate_data(c.data, c.scale))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    register()
    register_help()
    sys.argv = _with_quiet_hydra(sys.argv)
    main()
