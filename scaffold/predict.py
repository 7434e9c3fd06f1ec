"""`python -m scaffold.predict run=<run dir> [key=value ...]`: score a run's checkpoint and segment volumes.

    python -m scaffold.predict run=outputs/2026-12-02/10-00-00                 # best checkpoint, validation split
    python -m scaffold.predict run=outputs/... checkpoint=last split=train
    python -m scaffold.predict run=outputs/... input=volumes.h5 out=seg/       # any dataset file of our layout

The model is the run's own (its run.json config), loaded from a checkpoint verified as a resume verifies
it (the SHA-256 trailer, the model's shape), and evaluated by the trainer's own code: the same Trainer,
`Trainer.evaluate` (batches of the run's `batch_size`, bf16 autocast on CUDA, the ladder's rungs) and
`Trainer.reduce_epoch` (the same sums in the same order). So on the device type the run trained on, the
mean hard Dice of the validation split is bit for bit the `val_dice` of the checkpoint's epoch in
train_stats.csv, and metrics.json shows the two side by side.

Written to `out` (default `<run>/predict/<checkpoint>-<split>`, or `...-<input file stem>`):
  predictions.h5    `masks`, uint8 (n, E, E, E) predicted labels (argmax), one gzip chunk per volume, and
                    `hard_dice` per volume; attributes run, checkpoint, epoch, split, input, device
  per_volume.csv    per volume: hard Dice (the trainer's metric), soft Dice (the loss's), loss, and
                    both Dice per foreground class
  confusion.csv     voxel counts, truth label (rows) against predicted label (columns)
  metrics.json      the means, per-class Dice, the confusion matrix, the trainer's val_dice of that
                    epoch (run's own validation split), timings
  slices_vol<i>.png orthogonal slices through the centre (input, truth, prediction) of `figures`
                    volumes spread from the worst Dice to the best (needs matplotlib: the `plots` extra)
One process only: a run trained with `parallel.spatial_shards` is evaluated whole on one device.
"""
from __future__ import annotations

import csv
import datetime as _dt
import io
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("scaffold")

CHECKPOINTS = ("best", "last")


@dataclass
class PredictConfig:
    """What to score and where the results go."""

    run: Optional[str] = None
    """The run directory (required): its run.json gives the model and its dataset."""
    checkpoint: str = "best"
    """best | last (in <run>/checkpoints/) | a path to a checkpoint file."""
    split: str = "val"
    """The split to predict: val | train (of the run's dataset, or of `input`)."""
    input: Optional[str] = None
    """A dataset file in scaffold's HDF5 layout (scaffold/data/store.py) to predict instead of the run's
    own dataset; its volumes must have the run's edge and classes."""
    out: Optional[str] = None
    """Output folder (default <run>/predict/<checkpoint>-<split>[-<input file stem>])."""
    device: str = "auto"
    """auto (CUDA when present) | cpu | cuda | cuda:N. The trainer's bits hold on the device type the
    run trained on."""
    cache_dir: Optional[str] = None
    """The dataset cache to find (or regenerate) the run's dataset in (default: the run's data.cache_dir)."""
    figures: int = 3
    """Volumes drawn as orthogonal slices (0 = none)."""
    progress: bool = True
    """Show progress while a dataset is generated."""


class PredictError(ValueError):
    """Bad input to predict; the message is one line."""


# ------------------------------------------------------------------------------------------ setup
def _run_config(run_dir: Path, p: PredictConfig) -> Any:
    """The run's config (run.json) on this version's schema, with predict's device and cache."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from scaffold.cli import read_run_record
    from scaffold.config import Config

    if not run_dir.is_dir():
        raise PredictError(f"run={run_dir}: no such run directory")
    if not (run_dir / "run.json").is_file():
        raise PredictError(f"run={run_dir}: not a scaffold run directory (no run.json)")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), read_run_record(run_dir))
    except OmegaConfBaseException as e:
        raise PredictError(f"{run_dir / 'run.json'}: its config does not fit this version's schema "
                           f"({str(e).splitlines()[0]})") from None
    cfg.device, cfg.resume, cfg.logger, cfg.progress = p.device, None, "none", False
    cfg.parallel.spatial_shards = 1  # one process: the whole volume on one device
    if p.cache_dir is not None:
        cfg.data.cache_dir = p.cache_dir
    return cfg


def _checkpoint(run_dir: Path, name: str) -> tuple[dict, Path]:
    from scaffold import checkpoint

    if name in CHECKPOINTS:
        path = run_dir / "checkpoints" / f"{name}.pt"
        if not path.exists():
            other = [c for c in CHECKPOINTS if c != name and (run_dir / "checkpoints" / f"{c}.pt").exists()]
            hint = f" (checkpoint={other[0]} is there)" if other else " (the run wrote no checkpoint)"
            raise PredictError(f"checkpoint={name}: {path} does not exist{hint}")
    else:
        path = Path(name)
        if not path.is_file():
            raise PredictError(f"checkpoint={name}: no such file (expected best | last | a checkpoint file)")
    return checkpoint.load_one(path), path  # verified: CheckpointError names the file in one line


def _check_out(out: Path) -> None:
    """The output folder can be created: its nearest existing ancestor is a writable folder."""
    from scaffold.cli import _probe_writable

    ancestor = out.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    why = "not a folder" if not ancestor.is_dir() else _probe_writable(ancestor)
    if why:
        raise PredictError(f"out={out}: cannot create the folder ({ancestor}: {why})")


def _dataset(cfg: Any, p: PredictConfig) -> tuple[Path, Any, Any]:
    """(path, info, masks of the split as a numpy array)."""
    from scaffold.data import store

    if p.input is None:
        path = store.prepare(cfg.data, cfg.scale, cfg.seed, progress=p.progress)
    else:
        path = Path(p.input)
        if not path.is_file():
            raise PredictError(f"input={p.input}: no such file")
    try:
        info = store.read_info(path)
    except (ValueError, OSError) as e:
        raise PredictError(f"input={path}: {str(e).splitlines()[0]}") from None
    edge = 2 ** int(cfg.scale)
    if info.edge != edge:
        raise PredictError(f"input={path}: volumes of {info.edge}³, the run's model takes {edge}³ "
                           f"(scale {cfg.scale})")
    if info.n_classes != int(cfg.data.n_categories) + 1:
        raise PredictError(f"input={path}: {info.n_classes} labels, the run's model predicts "
                           f"{int(cfg.data.n_categories) + 1}")
    return path, info, store.load_masks(path, p.split)


def _loss_counts(cfg: Any, info: Any, path: Path):
    """The class counts the run's loss weights came from: its training split's (all of it, or the sampled
    fraction); an `input` file's own training split stands in for another file."""
    from scaffold.data import store
    from scaffold.loss import sampled_counts

    fraction = float(cfg.data.ce_weight_sample_fraction)
    if fraction >= 1:
        return info.class_counts
    return sampled_counts(store.load_masks(path, "train"), fraction, info.n_classes)


# ------------------------------------------------------------------------------------------ the pass
@dataclass
class Scores:
    """What the pass collects, per volume in dataset order (host tensors)."""

    masks: Any  # uint8 (n, E, E, E) predictions
    hard: Any  # float64 (n, C-1)
    soft: Any  # float32 (n, C-1)
    confusion: Any  # int64 (C, C): truth rows, predicted columns
    loss: Any  # float32 (n,)
    dice: Any  # float32 (n,): the trainer's per-volume hard Dice
    val_loss_avg: float
    val_dice: float  # the trainer's epoch mean, bit for bit
    seconds: float
    warmup_seconds: float


def predict(trainer: Any, n: int) -> Scores:
    """Runs `trainer.evaluate` over the volumes in `trainer.vol.val` with a hook that keeps the
    predicted masks and the extra metrics; the means come from `trainer.reduce_epoch`."""
    import torch

    from scaffold.metrics import hard_dice_classes

    device, C = trainer.device, trainer.n_classes
    edge = tuple(trainer.vol.val.shape[1:])
    masks_out = torch.empty((n, *edge), dtype=torch.uint8)
    hard = torch.zeros(n, C - 1, dtype=torch.float64)
    soft = torch.zeros(n, C - 1, dtype=torch.float32)
    confusion = torch.zeros(C, C, dtype=torch.int64, device=device)
    classes = torch.arange(C, device=device).view(-1, 1, 1, 1, 1)

    def keep(positions, masks, logits):
        pred = logits.argmax(1)
        rows = positions.cpu()
        masks_out[rows] = pred.to(torch.uint8).cpu()
        hard[rows] = hard_dice_classes(logits, masks, C).cpu()
        soft[rows] = trainer.loss_fn.soft_dice_classes(logits, masks).float().cpu()
        is_pred = pred.unsqueeze(0) == classes  # (C, N, D, H, W); one truth class at a time
        for t in range(C):
            confusion[t] += (is_pred & (masks == t).unsqueeze(0)).sum((1, 2, 3, 4))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # One untimed batch first (kernel compilation and allocation), as the trainer's warm-up does.
    t0 = time.perf_counter()
    trainer.model.eval()
    trainer.eval_batch(trainer.model, trainer.vol.first(trainer.vol.val, trainer.cfg.batch_size))
    trainer.model.train()
    sync()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    val = trainer.evaluate(keep)
    sync()
    seconds = time.perf_counter() - t0
    zeros = torch.zeros(2, device=device)
    _, _, _, vloss_sum, vdice_sum = trainer.reduce_epoch(zeros, torch.zeros(1, device=device), val)
    val = val.cpu()
    return Scores(masks_out, hard, soft, confusion.cpu(), val[0], val[1], vloss_sum / n, vdice_sum / n,
                  seconds, warm)


# ------------------------------------------------------------------------------------------ outputs
def _trainer_val_dice(run_dir: Path, epoch: int) -> Optional[float]:
    from scaffold.stats import read_rows

    try:
        rows = read_rows(run_dir / "train_stats.csv")
    except Exception:  # noqa: BLE001 - a missing or damaged CSV only loses the comparison
        return None
    for row in rows:
        if int(row["epoch"]) == epoch:
            return float(row["val_dice"])
    return None


def write_predictions(path: Path, s: Scores, attrs: dict) -> None:
    import h5py
    import numpy as np

    from scaffold.files import atomic_path

    n, edge = s.masks.shape[0], tuple(s.masks.shape[1:])
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = "" if v is None else v
        ds = f.create_dataset("masks", data=s.masks.numpy(), chunks=(1, *edge), compression="gzip",
                              compression_opts=4)
        ds.attrs["description"] = "predicted label per voxel (argmax of the logits), one volume per row"
        ds.attrs["layout"] = "N, D, H, W (volume, depth, height, width), in the input split's order"
        ds.attrs["labels"] = np.arange(s.confusion.shape[0], dtype=np.uint8)
        dice = f.create_dataset("hard_dice", data=s.dice.numpy().astype(np.float32))
        dice.attrs["description"] = "per volume: mean over the foreground classes of the hard Dice"
        assert n == dice.shape[0]


def write_tables(out: Path, s: Scores, summary: dict) -> None:
    from scaffold.files import write_json, write_text

    C = s.confusion.shape[0]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["volume", "hard_dice", "soft_dice", "loss"] + [f"hard_dice_{k}" for k in range(1, C)]
               + [f"soft_dice_{k}" for k in range(1, C)])
    for i in range(s.masks.shape[0]):
        w.writerow([i, repr(float(s.dice[i])), repr(float(s.soft[i].double().mean())), repr(float(s.loss[i]))]
                   + [repr(float(x)) for x in s.hard[i]] + [repr(float(x)) for x in s.soft[i]])
    write_text(out / "per_volume.csv", buf.getvalue())
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["truth \\ predicted"] + [str(k) for k in range(C)])
    for t in range(C):
        w.writerow([t] + [int(x) for x in s.confusion[t]])
    write_text(out / "confusion.csv", buf.getvalue())
    write_json(out / "metrics.json", summary)


def pick_volumes(dice: Any, count: int) -> list[int]:
    """`count` volumes spread over the Dice ranking, from the worst to the best."""
    import numpy as np

    n = len(dice)
    if count <= 0 or n == 0:
        return []
    order = np.argsort(np.asarray(dice, dtype=np.float64), kind="stable")
    picks = np.unique(np.linspace(0, n - 1, min(count, n)).round().astype(int))
    return [int(order[i]) for i in picks]


def write_figures(out: Path, truth: Any, s: Scores, palette: Any, volumes: list[int], title: str) -> list[Path]:
    """One PNG per volume: rows input / truth / prediction, columns the three centre slices."""
    if not volumes:
        return []
    from scaffold.report import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return []
    import numpy as np
    from matplotlib.colors import ListedColormap

    C = palette.shape[0]
    labels = ListedColormap(["black", *plt.get_cmap("tab10").colors[:max(1, C - 1)]])  # background black
    written = []
    for i in volumes:
        t, p = truth[i], s.masks[i].numpy()
        c = [d // 2 for d in t.shape]
        cuts = [("D", lambda v: v[c[0]]), ("H", lambda v: v[:, c[1]]), ("W", lambda v: v[:, :, c[2]])]
        fig, axes = plt.subplots(3, 3, figsize=(7.5, 7.5), dpi=100)
        for col, (axis, cut) in enumerate(cuts):
            images = [np.clip(palette[cut(t)], 0, 1), cut(t), cut(p)]
            for row, (name, img) in enumerate(zip(("input", "truth", "prediction"), images)):
                ax = axes[row, col]
                if row == 0:
                    ax.imshow(img, interpolation="nearest")
                else:
                    ax.imshow(img, cmap=labels, vmin=-0.5, vmax=labels.N - 0.5, interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
                if col == 0:
                    ax.set_ylabel(name)
                if row == 0:
                    ax.set_title(f"{axis} = {c['DHW'.index(axis)]}", fontsize=9)
        fig.suptitle(f"{title}: volume {i}, Dice {float(s.dice[i]):.4f}", fontsize=9)
        written.append(save_figure(plt, fig, out / f"slices_vol{i}.png"))
    return written


# ------------------------------------------------------------------------------------------ main
def run(p: PredictConfig) -> dict:
    """Predict as `p` says; returns the summary (also metrics.json)."""
    import numpy as np
    import torch

    import scaffold
    from scaffold import determinism, distributed
    from scaffold.loss import SegmentationLoss, check_labels, class_weights
    from scaffold.model.unet import UNet3d
    from scaffold.plan import resolve, validate
    from scaffold.trainer import Trainer, Volumes
    from scaffold.worker import device_name, place_masks

    if p.run is None:
        raise PredictError("run: required (run=<run dir>)")
    if p.split not in ("val", "train"):
        raise PredictError(f"split={p.split!r}: expected val | train")
    if p.figures < 0:
        raise PredictError(f"figures={p.figures}: expected an integer >= 0")
    run_dir = Path(p.run)
    cfg = _run_config(run_dir, p)
    validate(cfg)
    state, ckpt = _checkpoint(run_dir, p.checkpoint)
    epoch = int(state["epoch"])
    stem = Path(ckpt).stem
    out = Path(p.out) if p.out else run_dir / "predict" / (
        f"{stem}-{p.split}" + ("" if p.input is None else f"-{Path(p.input).stem}"))
    _check_out(out)  # created once the predictions exist: a refused input leaves no folder behind

    determinism.configure(cfg.determinism)  # before anything touches CUDA
    # The run's decisions for one process on this device (the trainer's own plan where the run was one
    # process on the same kind of device).
    plan = resolve(cfg, distributed.Place())
    device = plan.device
    path, info, masks = _dataset(cfg, p)
    n = masks.shape[0]
    determinism.seed_all(cfg.seed)
    model = UNet3d.from_config(cfg, info.n_classes, plan).to_device(device)
    loss_fn = SegmentationLoss(class_weights(_loss_counts(cfg, info, path)),
                               rung=cfg.ladder.loss).to(device)
    split = torch.from_numpy(masks)
    check_labels(split, info.n_classes)
    train, val = place_masks(plan, split[:1], split)
    volumes = Volumes(train, val, torch.from_numpy(info.palette).to(device))
    trainer = Trainer(cfg, model, loss_fn, volumes, device, run_dir, distributed.Place(), plan=plan)
    trainer.load_state(state, source=str(ckpt))  # another model's checkpoint: one line
    del state
    log.info("predicting %d %s volumes of %s with %s (epoch %d) on %s", n, p.split, path, ckpt, epoch, device)
    s = predict(trainer, n)

    trainer_dice = _trainer_val_dice(run_dir, epoch) if p.input is None and p.split == "val" else None
    C = info.n_classes
    summary = {
        "run": str(run_dir), "checkpoint": str(ckpt), "epoch": epoch, "split": p.split, "input": str(path),
        "device": device_name(device), "volumes": n,
        "dice": s.val_dice,  # mean hard Dice: the trainer's val_dice on the run's validation split
        "trainer_val_dice": trainer_dice,  # train_stats.csv's val_dice of the checkpoint's epoch
        "loss": s.val_loss_avg,
        "soft_dice": float(s.soft.double().mean()),
        "per_class": {"hard_dice": [float(x) for x in s.hard.mean(0)],
                      "soft_dice": [float(x) for x in s.soft.double().mean(0)],
                      "labels": list(range(1, C))},
        "confusion": s.confusion.tolist(),  # truth rows, predicted columns, voxel counts
        "seconds": s.seconds,  # the timed pass: forward, metrics, copies of the predictions to the host
        "seconds_per_volume": s.seconds / n,
        "warmup_seconds": s.warmup_seconds,
        "scaffold": scaffold.__version__, "torch": torch.__version__,
    }
    attrs = {"run": str(run_dir), "checkpoint": str(ckpt), "epoch": epoch, "split": p.split, "input": str(path),
             "device": summary["device"], "scaffold": scaffold.__version__,
             "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PredictError(f"out={out}: cannot create the folder ({e.strerror or e})") from None
    write_predictions(out / "predictions.h5", s, attrs)
    write_tables(out, s, summary)
    figures = write_figures(out, masks, s, np.asarray(info.palette), pick_volumes(s.dice, p.figures),
                            f"{run_dir.name} {stem} {p.split}")
    beside = "" if trainer_dice is None else (
        f" (train_stats.csv, epoch {epoch}: {trainer_dice!r}{', identical' if trainer_dice == s.val_dice else ''})")
    log.info("dice %r%s | soft dice %.4f | %d volumes, %.4f s per volume | %d figure(s) | results in %s",
             s.val_dice, beside, summary["soft_dice"], n, summary["seconds_per_volume"], len(figures), out)
    return summary


# ------------------------------------------------------------------------------------------ CLI
QUIET_HYDRA = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
               "hydra/hydra_logging=none", "hydra/help=scaffold_predict"]


def _preflight(argv: list[str]) -> None:
    """Unknown keys and wrong types in one line, before Hydra starts."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from scaffold.cli import did_you_mean
    from scaffold.config import ConfigError

    args = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    node = OmegaConf.structured(PredictConfig)
    for o in parsed:
        key = o.key_or_group
        if key.startswith("hydra"):
            continue
        if o.is_sweep_override():
            raise ConfigError(f"{o.input_line}: predict takes one value per key")
        try:
            OmegaConf.update(node, key, o.value(), merge=True)
        except OmegaConfBaseException as e:
            msg = str(e).strip().splitlines()[0]
            if "not in struct" in msg or "Key '" in msg:
                raise ConfigError(f"{key}: unknown key{did_you_mean(key, OmegaConf.structured(PredictConfig))} "
                                  "(python -m scaffold.predict --help lists the keys)") from None
            raise ConfigError(f"{key}={o.value()!r}: {msg}") from None


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    from scaffold import help as help_page

    ConfigStore.instance().store(name="scaffold_predict", node=PredictConfig)
    header = "\n".join([
        "python -m scaffold.predict: score a run's checkpoint and segment volumes with the trainer's own",
        "evaluation (predicted masks, Dice per volume and class, confusion matrix, slice figures).",
        "",
        "Usage:",
        "  python -m scaffold.predict run=<run dir> [key=value ...]",
    ])
    body = "\n".join(help_page.render_sections(help_page.sections(PredictConfig)))
    ConfigStore.instance().store(group="hydra/help", name="scaffold_predict",
                                 node=help_page.hydra_help_node("scaffold.predict", header, body))


def _task(cfg: Any) -> None:
    from omegaconf import OmegaConf

    from scaffold.checkpoint import CheckpointError
    from scaffold.config import ConfigError
    from scaffold.data.store import DatasetCorrupt

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    p = PredictConfig(**OmegaConf.to_container(cfg))
    try:
        run(p)
    except (PredictError, ConfigError, CheckpointError, DatasetCorrupt) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    import hydra

    from scaffold.config import ConfigError

    try:
        _preflight(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _register()
    given = {a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:]}
    # Before the user's arguments: Hydra's flags (--cfg job) take no overrides after them.
    sys.argv = sys.argv[:1] + [q for q in QUIET_HYDRA if q.split("=", 1)[0] not in given] + sys.argv[1:]
    hydra.main(config_path=None, config_name="scaffold_predict", version_base=None)(_task)()


if __name__ == "__main__":
    main()
