"""`python -m scaffold.data [key=value ...]`: generate (or reuse) the dataset of a training config and
say what it holds. Same config and overrides as `python -m scaffold.train`, e.g. `scale=5 seed=1`.
"""
from __future__ import annotations

import pathlib
import sys

import hydra

from ..config import ConfigError, register
from .store import prepare, read_info

_REPO_CONF = pathlib.Path(__file__).resolve().parents[2] / "conf"
CONFIG_PATH = str(_REPO_CONF) if _REPO_CONF.is_dir() else "pkg://scaffold.conf"
# Work in the current folder and write nothing of Hydra's own (no outputs/, no .hydra/, no log file).
QUIET_HYDRA = {"hydra.run.dir": ".", "hydra.output_subdir": "null", "hydra/job_logging": "none",
               "hydra/hydra_logging": "none"}


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


@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base=None)
def main(cfg) -> None:
    try:
        path = prepare(cfg.data, cfg.scale, cfg.seed, progress=cfg.progress)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(describe(path))


def _with_quiet_hydra(argv: list[str]) -> list[str]:
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in argv[1:]}
    return argv + [f"{key}={value}" for key, value in QUIET_HYDRA.items() if key not in given]


if __name__ == "__main__":
    register()
    sys.argv = _with_quiet_hydra(sys.argv)
    main()
