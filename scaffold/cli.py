"""Command-line plumbing shared by `scaffold.train` and `scaffold.data`: where the Hydra config lives,
the pre-flight check of overrides, and the config of a resumed run.

Hydra rejects unknown keys and wrong types too, but with a multi-line report; checking the overrides
against the schema first gives the one-line error a user needs, before any directory is created. A sweep
is checked value by value: every value of a choice or a range, and samples of an interval (what a sampler
such as Optuna's draws from), including the intervals of a preset's sweeper params.
"""
from __future__ import annotations

import errno
import importlib.resources
import importlib.util
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from scaffold.config import OBJECTIVES, RETIRED, Config, ConfigError

log = logging.getLogger("scaffold")

# Keys a resumed run may change: they do not alter what has been computed so far.
RESUME_MUTABLE = {"epochs", "target_dice", "target_metric", "checkpoint_interval", "progress", "profile", "device",
                  "data.workers", "data.cache_dir", "warmup_steps", "cuda_graph", "parallel.timeout_s",
                  "objective", "logger", "parallel.spatial_shards", "parallel.fsdp",
                  "model.recompute", "data_placement"}  # the last two: the same bits either way
# Of those, keys whose change alters the arithmetic from the resume on (said in one line).
RESUME_NOT_BITWISE = {"parallel.spatial_shards": "sums are split over another number of slabs",
                      "parallel.fsdp": "gradients summed by FSDP's reduce-scatter or DDP's all-reduce, "
                                       "in another order"}


def conf_dir() -> str:
    """The repository's conf/ in a source checkout; the copy shipped as package data otherwise."""
    here = Path(__file__).resolve().parent.parent / "conf"
    return str(here) if (here / "config.yaml").is_file() else "pkg://scaffold.conf"


def _conf_root() -> Any:
    d = conf_dir()
    return importlib.resources.files("scaffold.conf") if d.startswith("pkg://") else Path(d)


def config_groups() -> dict[str, list[str]]:
    """conf/'s own config groups (e.g. hparams_search) and their options; hydra/ is Hydra's."""
    return {g.name: sorted(f.name[:-len(".yaml")] for f in g.iterdir() if f.name.endswith(".yaml"))
            for g in _conf_root().iterdir()
            if g.is_dir() and g.name != "hydra" and not g.name.startswith(("_", "."))}


OPTUNA_MISSING = "needs Hydra's Optuna sweeper (pip install 'scaffold-unet[optuna]')"


def _has_plugin(module: str) -> bool:
    """Whether a Hydra plugin package (hydra_plugins.NAME) is installed. find_spec imports the parent
    namespace first, which is absent altogether when no plugin is installed."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _has_optuna() -> bool:
    return _has_plugin("hydra_plugins.hydra_optuna_sweeper")


# hydra/launcher choices served by hydra-submitit-launcher: conf/hydra/launcher/slurm.yaml and the
# plugin's own two. Without the plugin Hydra fails on them with a multi-line composition error.
SUBMITIT_LAUNCHERS = ("slurm", "submitit_slurm", "submitit_local")


def check_launcher(parsed: list) -> None:
    """A one-line error, before Hydra starts, for a launcher that cannot run here: a submitit one
    without its plugin, or a Slurm one where Slurm's srun is missing (submitit would fail on it only
    once the sweep is submitted, with a traceback)."""
    import shutil

    for o in parsed:
        if o.key_or_group != "hydra/launcher" or o.is_delete() or o.is_sweep_override():
            continue
        name = str(o.value())
        if name not in SUBMITIT_LAUNCHERS:
            continue
        if not _has_plugin("hydra_plugins.hydra_submitit_launcher"):
            raise ConfigError(f"hydra/launcher={name} needs hydra-submitit-launcher: "
                              "pip install 'scaffold-unet[slurm]'")
        if name != "submitit_local" and shutil.which("srun") is None:
            raise ConfigError(f"hydra/launcher={name}: Slurm's srun is not on PATH here (submit from a "
                              "Slurm login node; hydra/launcher=submitit_local runs the sweep on this "
                              "machine)")


def _preset_params(parsed: list) -> dict[str, Any]:
    """The sweeper params of the presets chosen on the command line (hparams_search=NAME); a one-line
    error for an unknown preset, or for one whose sweeper is not installed."""
    groups, params = config_groups(), {}
    for o in parsed:
        key = o.key_or_group
        if key == "hydra/sweeper" and o.value() == "optuna" and not _has_optuna():
            raise ConfigError(f"{o.input_line}: {OPTUNA_MISSING}")
        if key not in groups or o.is_delete():
            continue
        for name in (_sweep_values(o) or []) if o.is_sweep_override() else [o.value()]:
            if name is None:  # the default: no preset
                continue
            if name not in groups[key]:
                raise ConfigError(f"{key}={name}: no such preset (choose from: {' | '.join(groups[key])})")
            preset = OmegaConf.create((_conf_root() / key / f"{name}.yaml").read_text())
            defaults = OmegaConf.to_container(preset).get("defaults", [])
            if {"override /hydra/sweeper": "optuna"} in defaults and not _has_optuna():
                raise ConfigError(f"{key}={name}: {OPTUNA_MISSING}")
            params.update(OmegaConf.select(preset, "hydra.sweeper.params", default=None) or {})
    return params


def _sweep_values(o: Any) -> Optional[list]:
    """The values to check a sweep with: all of a choice or a range; of an interval, its start, middle
    (geometric for tag(log, ...)) and the last float before its end: Hydra's intervals are [start, end)
    of floats, and so are the Optuna sweeper's samples of them (no cast to the key's type: an interval
    over an integer key fails in every trial, so it fails here). None for a sweep that cannot be listed
    here (a glob): the job then checks the value it gets."""
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.errors import HydraException

    sweep = o.value()
    if isinstance(sweep, IntervalSweep):
        lo, hi, log = sweep.start, sweep.end, "log" in sweep.tags
        if lo > hi:
            raise ConfigError(f"{o.input_line}: the interval's start is above its end")
        if log and lo <= 0:
            raise ConfigError(f"{o.input_line}: a log interval needs a start > 0")
        return sorted({lo, math.sqrt(lo * hi) if log else (lo + hi) / 2, math.nextafter(hi, lo)})
    try:
        return list(o.sweep_iterator())
    except HydraException:
        return None


def _bad_override(args: list[str], error: Exception) -> str:
    """Hydra's grammar error, naming the override it is about (Hydra's own message does not)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    for a in args:
        try:
            OverridesParser.create().parse_override(a)
        except HydraException as e:
            return f"{a}: {_one_line(e)} (Hydra's override grammar: KEY=VALUE, a sweep as KEY=A,B)"
    return _one_line(error)


def _one_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _in_sweep(msg: str, sweep: Any) -> str:
    """A check's message, naming the sweep its value came from (the user wrote no such value); a fixed
    key that fails with every swept value is not the sweep's fault."""
    if sweep is None or not msg.startswith(f"{sweep.key_or_group}="):
        return msg
    return f"{msg} (a value of {sweep.input_line})"


def schema_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a structured config (sections and their keys)."""
    keys = []
    for name in node.keys():
        keys.append(prefix + str(name))
        child = OmegaConf.select(node, str(name), throw_on_missing=False)
        if OmegaConf.is_dict(child):
            keys += schema_keys(child, f"{prefix}{name}.")
    return keys


def did_you_mean(key: str, node: Any) -> str:
    """' (did you mean `epochs`?)' for a close key of the schema `node`, else ''."""
    import difflib

    keys = schema_keys(node)
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if not close:  # a key typed without its section (`workers`) or under the wrong one
        tail = key.rsplit(".", 1)[-1]
        close = [k for k in keys if k != key and k.rsplit(".", 1)[-1] == tail][:1]
    return f" (did you mean `{close[0]}`?)" if close else ""


def _apply(node: Any, key: str, value: Any, sweep: Any = None) -> None:
    try:
        was = OmegaConf.select(node, key, default=None)
        OmegaConf.update(node, key, value, merge=True)
        if isinstance(was, bool) and not isinstance(value, bool):  # OmegaConf takes 2 or "yes" as True
            raise ConfigError(_in_sweep(f"{key}={value!r}: expected true or false", sweep))
    except OmegaConfBaseException as e:
        msg = _one_line(e)
        if "not in struct" in msg or "Missing key" in msg or "Key '" in msg and "not" in msg:
            raise ConfigError(f"{key}: unknown key{did_you_mean(key, OmegaConf.structured(Config))} "
                              "(see scaffold/config.py for the schema)") from None
        raise ConfigError(_in_sweep(f"{key}={value!r}: {msg}", sweep)) from None


def resolve_auto_resume(argv: list[str]) -> list[str]:
    """`resume=auto` with `hydra.run.dir=DIR`: `resume=DIR` when DIR holds a run (a requeued job
    continues it), else a new run in DIR (the job's first start)."""
    if "resume=auto" not in argv:
        return argv
    if any(a in ("-m", "--multirun") for a in argv):
        # A sweep: each job continues the run its directory holds, else starts one (scaffold.train).
        sweeps = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.sweep.dir=")]
        if not sweeps or "${" in sweeps[-1]:
            raise ConfigError("resume=auto in a sweep (-m): needs one fixed hydra.sweep.dir=<the sweep's "
                              "directory>, whose jobs continue the runs they hold")
        return argv
    dirs = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    if not dirs or "${" in dirs[-1]:
        raise ConfigError("resume=auto: needs one fixed hydra.run.dir=<the job's run directory> (e.g. "
                          "hydra.run.dir=outputs/slurm-$SLURM_JOB_ID), continued when it holds a run")
    rest = [a for a in argv if a != "resume=auto"]
    if (Path(dirs[-1]) / "run.json").exists():
        log.info("resume=auto: %s holds a run: continuing it", dirs[-1])
        return [a for a in rest if not a.startswith("hydra.run.dir=")] + [f"resume={dirs[-1]}"]
    return rest


@dataclass
class Parsed:
    """The command line's overrides, read against the schema: the config they set, the swept keys
    with their values, and the run a `resume=` names."""

    overrides: list
    cfg: Any
    sweeps: list
    resume: Any


def preflight(argv: list[str], check_resume: bool = True, claim: bool = False,
              check: Any = None, hydra_checks: bool = False) -> list[str]:
    """Check overrides against the schema and `check` (the whole-config check, scaffold.plan.validate,
    by default); returns argv, with Hydra's run dir pointed at a resumed run (or, with `claim`, at a new
    run's directory created here: see claim_run_dir). Three steps: parse, check, claim; with
    `hydra_checks`, Hydra's flags and its composition of the config are checked too (before the claim)."""
    if hydra_checks:
        check_hydra_flags(argv)
    argv = resolve_auto_resume(argv)
    parsed = parse(argv)
    check_parsed(parsed, check)
    if hydra_checks:
        check_composition(argv)
    return claim_dirs(argv, parsed, check_resume, claim)


HYDRA_COMMANDS = (("run", "--run"), ("multirun", "--multirun (-m)"), ("cfg", "--cfg"), ("info", "--info"),
                  ("shell_completion", "--shell-completion"))


def check_hydra_flags(argv: list[str]) -> None:
    """Hydra's own flags, read by Hydra's own parser: an unknown flag, an override after `-m` and one
    before it (which Hydra's parser does not take), or two commands at once (`-m` with `--cfg`) are one
    line here, not a usage page or a traceback from Hydra."""
    try:
        from hydra._internal.utils import get_args_parser
    except ImportError:  # pragma: no cover - another Hydra layout: Hydra reports it itself
        return
    if "--version" in argv:  # Hydra's parser prints the version and exits
        return
    parser = get_args_parser()

    def error(message: str) -> None:
        if message.startswith("unrecognized arguments") and "=" in message:
            message += (" (Hydra reads the overrides after its flags: python -m scaffold.train -m "
                        "KEY=VALUE ...)")
        raise ConfigError(message)

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    if args.config_dir is not None and not Path(args.config_dir).is_dir():
        raise ConfigError(f"--config-dir {args.config_dir}: no such folder")
    given = [flag for name, flag in HYDRA_COMMANDS if getattr(args, name) not in (None, False)]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)}: only one of --run, --multirun (-m), --cfg, --info and "
                          "--shell-completion can be given")


def check_composition(argv: list[str]) -> None:
    """Compose the config as Hydra will, with the command line's overrides (a sweep's values were
    checked one by one above, so sweeps are left out): an option missing from a config group
    (`hydra/launcher=nope`) or a key missing from Hydra's own config (`hydra.launcher.nope=1`) is one
    line here, before any folder is made, instead of Hydra's report of many lines (after a sweep's
    folder was made). Left to Hydra where the command line picks another config file or folder."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, MissingConfigException

    if any(a.split("=")[0] in (*CONFIG_SELECTORS, "--config-dir", "-cd", "--experimental-rerun") for a in argv):
        return
    args = [a for a in argv if ("=" in a or a.startswith("~")) and not a.startswith("-")]
    fixed = [a for a in args if not OverridesParser.create().parse_override(a).is_sweep_override()]
    register()
    d = conf_dir()
    init = (initialize_config_module(d[len("pkg://"):], version_base=None) if d.startswith("pkg://")
            else initialize_config_dir(config_dir=d, version_base=None))
    try:
        with init:
            compose(config_name="config", overrides=fixed, return_hydra_config=True)
    except MissingConfigException as e:
        group, _, name = str(e.missing_cfg_file or "").rpartition("/")
        if group and e.options:
            raise ConfigError(f"{group}={name}: no such option (choose from: {' | '.join(e.options)})") from None
        raise ConfigError(_one_line(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        why = f": {_one_line(e.__cause__)}" if e.__cause__ is not None else ""
        raise ConfigError((" ".join(lines[:2]) or type(e).__name__) + why) from None


def parse(argv: list[str]) -> Parsed:
    """The overrides (and a chosen preset's sweeper params) applied to the schema, value by value:
    an unknown key, a wrong type or a retired key is one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = [a for a in argv if ("=" in a or a.startswith("~")) and not a.startswith("-")]
    for a in args:
        if a.startswith("="):
            raise ConfigError(f"{a}: an override needs a key (KEY=VALUE, e.g. scale{a})")
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException as e:
        raise ConfigError(_bad_override(args, e)) from None
    try:
        check_launcher(parsed)
        # A chosen preset's sweeper params are a search space too: checked like the command line's
        # sweeps, except where the command line replaces them (as the sweeper does).
        given = {o.key_or_group for o in parsed}
        params = {k: v for k, v in _preset_params(parsed).items() if k not in given}
        parsed += OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    except HydraException as e:
        raise ConfigError(_one_line(e)) from None
    cfg = OmegaConf.structured(Config)
    resume = None
    sweeps = []
    groups = config_groups()  # presets are chosen by name (checked above), not keys of the schema
    for o in parsed:
        key = o.key_or_group
        if key in RETIRED:
            raise ConfigError(RETIRED[key])
        if o.is_delete() and not key.startswith("hydra") and key not in groups:
            raise ConfigError(f"~{key}: a key of the schema cannot be deleted (set it instead: "
                              f"{key}=VALUE)")
        if key.startswith("hydra") or key in groups:
            continue
        if o.is_sweep_override():
            values = _sweep_values(o)
            if values is None:
                continue
            for v in values:
                _apply(OmegaConf.structured(Config), key, v, o)
            sweeps.append((o, values))
            continue
        value = o.value()
        if key == "resume" and value == "auto":  # a sweep's: each job decides (scaffold.train)
            continue
        _apply(cfg, key, value)
        if key == "resume":
            resume = value
    return Parsed(parsed, cfg, sweeps, resume)


def check_parsed(p: Parsed, check: Any = None) -> None:
    """The whole-config check on the combination, for each swept value in turn (a resumed run's
    config is its own, checked when it started)."""
    if check is None:
        from scaffold.plan import validate as check
    for o, values in p.sweeps or [(None, [None])]:
        for v in values:
            trial = OmegaConf.merge(p.cfg, {})
            if o is not None:
                _apply(trial, o.key_or_group, v)
            if trial.resume is None:
                try:
                    check(trial)
                except ConfigError as e:
                    raise ConfigError(_in_sweep(str(e), o)) from None


def claim_dirs(argv: list[str], p: Parsed, check_resume: bool = True, claim: bool = False) -> list[str]:
    """Where the run will write: the output folders can be created; under torchrun only rank 0 decides
    the run directory; a new run neither reuses a run's directory nor shares one (with `claim`, rank 0
    owns it before Hydra writes into it); a resume continues in its own, checked and locked."""
    parsed, resume = p.overrides, p.resume
    out_keys = ("hydra.run.dir", "hydra.sweep.dir")
    for o in parsed:
        if o.key_or_group in out_keys and not o.is_sweep_override():
            if not str(o.value() or "").strip():  # Hydra would write the run into the working directory
                raise ConfigError(f"{o.key_or_group}='': expected a folder path for the run's files")
            _check_output_dir(o.key_or_group, str(o.value()))
    if not any(o.key_or_group in out_keys for o in parsed):
        _check_output_dir("working directory", ".")  # outputs/ and multirun/ are created there
    if int(os.environ.get("RANK", "0")) > 0:
        # Under torchrun only rank 0 decides the run directory (the worker broadcasts it); the other
        # ranks must not create directories or logs of their own.
        argv = with_overrides(argv, ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                                     "hydra/hydra_logging=disabled"])
    main = int(os.environ.get("RANK", "0")) == 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(a in ("-m", "--multirun") for a in argv):
        # Every rank would run Hydra's sweep on its own, each job tearing the process group down and
        # building it again (the second job failed at three ranks, leaving stray directories).
        raise ConfigError("a sweep (-m) cannot run under torchrun: launch one torchrun job per "
                          "configuration, or sweep with hydra/launcher=slurm")
    if resume is None and main:
        for o in parsed:  # a new run in a directory that already holds one would overwrite its record
            if o.key_or_group == "hydra.run.dir" and not o.is_sweep_override():
                existing = Path(str(o.value()))
                if (existing / "run.json").exists():
                    raise ConfigError(f"hydra.run.dir={existing} already holds a run (resume={existing} "
                                      "continues it; a new run needs another directory)")
                if claim and "${" not in str(o.value()) and not any(a in ("-m", "--multirun") for a in argv):
                    own_run_dir(existing)  # before Hydra writes its record into it
        argv = claim_run_dir(argv, parsed) if claim else argv
    if resume is not None and check_resume:
        run_dir = Path(str(resume))
        # Rank 0 owns the run (the lock); the other ranks of a torchrun job neither lock nor probe it.
        check_resume_dir(run_dir, resume, lock=main, own=claim)
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            # Continue in the run's own directory; do not let Hydra overwrite its .hydra/ record.
            argv = with_overrides(argv, [f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"])
    return argv


def with_overrides(argv: list[str], extra: list[str]) -> list[str]:
    """argv with `extra` overrides beside its own (after the last of them): Hydra's parser takes the
    overrides as one run of words, so one added after a trailing flag (`--config-dir DIR`) would be
    refused."""
    at = max((i + 1 for i, a in enumerate(argv) if ("=" in a or a.startswith("~")) and not a.startswith("-")),
             default=len(argv))
    return argv[:at] + extra + argv[at:]


def ranks_from_slurm(env: Optional[dict] = None) -> Optional[str]:
    """Plain `srun python -m scaffold.train` (no torchrun): Slurm's task variables as the process group's,
    so that the srun step's N tasks form one job of N ranks instead of N separate runs. Returns a line
    saying so, or None where there is nothing to do (torchrun's RANK and WORLD_SIZE already set, or not
    a step of several tasks). Sets RANK, WORLD_SIZE and LOCAL_RANK from SLURM_PROCID,
    SLURM_STEP_NUM_TASKS and SLURM_LOCALID; MASTER_ADDR, unless set, from SLURM_LAUNCH_NODE_IPADDR (the
    host srun ran on: in a batch script, the allocation's first node, where task 0 runs), checked by
    rank 0, which hosts the rendezvous, to be one of its own addresses; MASTER_PORT, unless set, from the
    job and step ids.

    SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: srun sets it for the tasks of a step, while a batch script
    (or salloc's shell) that asked for --ntasks=N has SLURM_NTASKS=N in its own environment too, and a
    single `python -m scaffold.train` there must stay one process."""
    import socket

    global FROM_SLURM
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:  # torchrun's (or the user's): they win
        return None
    tasks, rank = env.get("SLURM_STEP_NUM_TASKS", ""), env.get("SLURM_PROCID", "")
    if not (tasks.isdigit() and rank.isdigit()) or int(tasks) <= 1:
        return None
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if not addr:
        raise ConfigError(f"srun started {tasks} tasks without torchrun and nothing says where rank 0 is "
                          "(no MASTER_ADDR, no SLURM_LAUNCH_NODE_IPADDR): set MASTER_ADDR to rank 0's host, "
                          "or launch `srun torchrun ... -m scaffold.train`")
    if "MASTER_ADDR" not in env and rank == "0":
        try:  # rank 0 hosts the rendezvous: srun run from another host (a login node) cannot be it
            with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as probe:
                probe.bind((addr, 0))
        except OSError:
            raise ConfigError(f"srun started {tasks} tasks without torchrun from another host than rank "
                              f"0's (SLURM_LAUNCH_NODE_IPADDR={addr} is not this node's): set MASTER_ADDR to "
                              "rank 0's host, or launch `srun torchrun ... -m scaffold.train`") from None
    port = env.get("MASTER_PORT") or str(slurm_port(env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")))
    env.update(RANK=rank, WORLD_SIZE=tasks, LOCAL_RANK=env.get("SLURM_LOCALID", "0"), MASTER_ADDR=addr,
               MASTER_PORT=port)
    FROM_SLURM = (f"srun without torchrun: rank {rank} of {tasks} (SLURM_PROCID of SLURM_STEP_NUM_TASKS), "
                  f"rendezvous at {addr}:{port}")
    return FROM_SLURM


FROM_SLURM: Optional[str] = None  # what ranks_from_slurm derived, for the run's log


def slurm_port(job: str, step: str) -> int:
    """The rendezvous port of a job step launched by plain srun: a function of the job and step ids (every
    task computes the same), in 10000-29999, below Linux's ephemeral ports."""
    job_id = int(job) if job.isdigit() else 0
    step_id = int(step) if step.isdigit() else 0
    return 10000 + (job_id * 8 + step_id) % 20000


# Errors of the storage rather than of the program: a full disk or quota, a read-only filesystem, a
# failing device. They end a run with one line (what was being written, and why), not a traceback.
STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
HYDRA_FLAGS_WITHOUT_RUN = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion",
                           "-sc", "--resolve", "-p", "--package")
CONFIG_SELECTORS = ("--config-name", "-cn", "--config-path", "-cp")


def _probe_writable(folder: Path) -> Optional[str]:
    """Why a file cannot be created and written in `folder` (None when one can). Doing it is the only
    honest test: os.access says yes to root on a read-only filesystem or in /proc, and a full
    filesystem still creates files (0 bytes) but fails the first byte written."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".write-probe-") as probe:
            probe.write(b"\0")
            probe.flush()
            os.fsync(probe.fileno())
            return None
    except OSError as e:
        return e.strerror or str(e)


def _check_output_dir(key: str, path: str) -> None:
    """The run directory can be created: a file can be created in its nearest existing ancestor."""
    if "${" in path:  # an interpolation Hydra resolves later: check the fixed part before it
        path = path.split("${", 1)[0] or "."
    ancestor = Path(path).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    why = "not a folder" if not ancestor.is_dir() else _probe_writable(ancestor)
    if why:
        raise ConfigError(f"{key}={path}: cannot create the run directory ({ancestor} is not a writable "
                          f"folder: {why})")


def _hydra_dirs() -> dict[str, str]:
    """conf/config.yaml's hydra.run.dir and hydra.sweep.dir patterns, unresolved."""
    conf = OmegaConf.load(_conf_root() / "config.yaml")
    dirs = OmegaConf.to_container(conf.hydra, resolve=False)
    return {"hydra.run.dir": dirs["run"]["dir"], "hydra.sweep.dir": dirs["sweep"]["dir"]}


CLAIMED: Optional[Path] = None  # the run (or sweep) directory preflight created for this process, if any
CLAIMED_RUN = False  # whether CLAIMED is a single run's directory (not a sweep's)
SWEEP_MADE: list[Path] = []  # the folders claim_run_dir created for a sweep, outermost first


def release_sweep_dir() -> None:
    """At the command's end: the sweep folder claim_run_dir created (and its date folder), removed when
    nothing was written into them (Hydra failed before the sweep began)."""
    from scaffold import rundir

    rundir.remove_if_empty(SWEEP_MADE)
    SWEEP_MADE.clear()


def claim_run_dir(argv: list[str], parsed: list) -> list[str]:
    """A new run's directory, created here with an exclusive mkdir, so two runs started in the same
    second (Hydra names the directory by the second) never share one: the second gets `TIME-2`. Left
    to Hydra when the command names the directory, picks another config file, or runs nothing."""
    global CLAIMED, CLAIMED_RUN
    if any(a in HYDRA_FLAGS_WITHOUT_RUN or a.split("=")[0] in CONFIG_SELECTORS for a in argv):
        return argv
    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in argv) else "hydra.run.dir"
    if any(o.key_or_group == key for o in parsed):
        return argv
    from scaffold import rundir

    pattern = _hydra_dirs()[key]
    if not rundir.is_fixed(pattern):
        return argv
    try:
        if key == "hydra.run.dir":  # owned (locked) from here on, so that Hydra writes into ours only
            CLAIMED, CLAIMED_RUN = rundir.own_new(pattern).path, True
        else:
            SWEEP_MADE[:] = rundir.claim_new_made(pattern)
            CLAIMED, CLAIMED_RUN = SWEEP_MADE[-1], False
    except OSError as e:
        raise ConfigError(f"{key}={pattern}: cannot create the run directory ({e.strerror or e})") from None
    return with_overrides(argv, [f"{key}={CLAIMED}"])


def own_run_dir(run_dir: Path, hydra_files_ours: bool = False) -> None:
    """Make this process the owner of a new run's directory (its lock; see rundir.own); a one-line
    ConfigError when another live process holds it. `hydra_files_ours`: Hydra's record and log in it
    were written by this process (a directory no run had locked yet)."""
    from scaffold import rundir

    try:
        if hydra_files_ours:  # and the directory Hydra made for them, when nothing else is in it
            rundir.own(run_dir, made=[run_dir], ours=rundir.HYDRA_FILES)
        else:
            rundir.own(run_dir)
    except rundir.RunDirBusy as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"run directory {run_dir}: cannot create it ({e.strerror or e})") from None


def remove_unused_run_dir(run_dir: Path) -> None:
    """Give up a run directory this process owns, removing what the process created in it when the run
    stopped before it began (no run.json): the lock, Hydra's record and log where they are ours, the
    directory and the parents it created when nothing else is in them. A directory this process does not
    own (another's, busy) is left exactly as it is."""
    from scaffold import rundir

    claim = rundir.owned(run_dir)
    if claim is not None:
        claim.release(remove_unused=True)


def check_resume_dir(run_dir: Path, resume: Any, lock: bool = True, own: bool = False) -> None:
    """A run directory a resume can use: a scaffold run with a readable run.json, writable, and not in
    use by a live process (with `lock`; `own` keeps the lock for this process, see rundir.own)."""
    from scaffold import rundir

    if run_dir.is_file():
        raise ConfigError(f"resume={resume}: a file, not a run directory (resume= takes the run's directory)")
    if not run_dir.is_dir():
        raise ConfigError(f"resume={resume}: no such run directory")
    if not (run_dir / "run.json").is_file():
        raise ConfigError(f"resume={resume}: not a scaffold run directory (no run.json)")
    read_run_record(run_dir)
    why = _probe_writable(run_dir)
    if why:
        raise ConfigError(f"resume={resume}: the run directory is not writable ({why})")
    if not lock:
        return
    try:
        rundir.own(run_dir) if own else rundir.check_free(run_dir)
    except rundir.RunDirBusy as e:
        raise ConfigError(str(e)) from None


def read_run_record(run_dir: Path) -> dict:
    """run.json's config as a dict, or a one-line ConfigError naming what is wrong with it."""
    path = Path(run_dir) / "run.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable run record ({type(e).__name__}: {_one_line(e)})") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ConfigError(f"{path}: not a run record (no 'config' section)")
    from scaffold import rundir

    recorded = record.get("config_sha256")  # absent in records written before it was kept
    if recorded is not None and recorded != rundir.config_hash(record["config"]):
        raise ConfigError(f"{path}: its config was edited after the run started (it no longer matches "
                          "config_sha256); a resume continues the run as it was started: restore it, "
                          "or start a new run with the changed config")
    return record["config"]


def resumed_config(run_dir: Path, cfg: Any, overrides: list[str]) -> Any:
    """The run's own config, with the overrides a resume may change; others must not differ."""
    saved = read_run_record(run_dir)
    try:
        base = OmegaConf.merge(OmegaConf.structured(Config), saved)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{Path(run_dir) / 'run.json'}: its config does not fit this version's schema "
                          f"({_one_line(e)})") from None
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra"):
            continue
        asked, had = OmegaConf.select(cfg, key), OmegaConf.select(base, key)
        if key in RESUME_MUTABLE:
            if key in RESUME_NOT_BITWISE and asked != had:
                log.warning("resume: %s %r -> %r: the run continues, not bitwise as it would have (%s)",
                            key, had, asked, RESUME_NOT_BITWISE[key])
            OmegaConf.update(base, key, asked, merge=True)
        elif asked != had:
            raise ConfigError(f"resume: {key} cannot change in an existing run (it has {had!r}, "
                              f"asked {asked!r}); start a new run instead")
    base.resume = str(run_dir)
    return base


def register() -> None:
    """Registers the schema with Hydra's ConfigStore (as `base_config`, used by conf/config.yaml), the
    `--help` page generated from it (as hydra/help `scaffold`, see scaffold/help.py), and the
    `scaffold.direction` resolver: `${scaffold.direction:${objective}}` is minimize or maximize."""
    from hydra.core.config_store import ConfigStore

    from scaffold import help as help_page

    ConfigStore.instance().store(name="base_config", node=Config)
    # `python -m scaffold.train --help` (conf/config.yaml selects hydra/help: scaffold).
    header, body = help_page.train_page(config_groups())
    ConfigStore.instance().store(group="hydra/help", name="scaffold",
                                 node=help_page.hydra_help_node("scaffold.train", header, body))
    # An unknown objective resolves to minimize; validation names it before any trial runs.
    OmegaConf.register_new_resolver("scaffold.direction", lambda name: OBJECTIVES.get(name, "minimize"),
                                    replace=True)
