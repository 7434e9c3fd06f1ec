"""Sweep summaries: a resume keeps the job's original overrides and records itself; `python -m
scaffold.report` rebuilds summary.csv / summary.md for a sweep or a tree of runs and sorts the table."""
from __future__ import annotations

import csv
import json

from helpers import TINY, cli
from scaffold import report


def summary_rows(folder):
    with open(folder / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_report_rebuilds_a_sweep_summary_after_a_resume(cache, tmp_path):
    sweep = tmp_path / "sweep"
    res = cli("-m", "seed=0,1", "epochs=1", *TINY, f"data.cache_dir={cache}", f"hydra.sweep.dir={sweep}",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    job = sweep / "0"
    res = cli(f"resume={job}", "epochs=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]

    result = json.loads((job / "result.json").read_text())
    assert "seed=0" in result["overrides"] and "epochs=1" in result["overrides"]  # as the sweep started it
    assert result["epochs"] == 2
    [resumed] = result["resumes"]
    assert resumed["at_epoch"] == 1 and resumed["overrides"] == ["epochs=2"]
    assert resumed["checkpoint"] == "last.pt" and resumed["time"].endswith("+00:00")
    run = json.loads((job / "run.json").read_text())
    assert run["overrides"] == result["overrides"] and run["resumes"] == result["resumes"]
    # The resume refreshed the sweep's summary itself.
    assert summary_rows(sweep)[0]["epochs"] == "2"

    for name in report.SUMMARY_FILES:
        (sweep / name).unlink()
    res = cli(str(sweep), cwd=tmp_path, module="scaffold.report")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = summary_rows(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    assert "seed=0" in rows[0]["overrides"].split() and rows[0]["epochs"] == "2"
    assert rows[0]["resumes"] == "@1 epochs=2" and rows[1]["resumes"] == ""
    assert "seed=1" in rows[1]["overrides"].split() and rows[1]["epochs"] == "1"
    assert [r["seed"] for r in rows] == ["0", "1"]  # the sweep's axis, a column of its own
    markdown = (sweep / "summary.md").read_text()
    line = next(x for x in markdown.splitlines() if x.startswith("| 0 "))
    assert "seed=0" in line and "@1 epochs=2" in line
    assert markdown in res.stdout  # the command prints the table it wrote

    # A second resume appends to the history.
    res = cli(f"resume={job}", "epochs=3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((job / "result.json").read_text())
    assert [r["at_epoch"] for r in result["resumes"]] == [1, 2] and "seed=0" in result["overrides"]
    assert summary_rows(sweep)[0]["resumes"] == "@1 epochs=2; @2 epochs=3"


def fake_run(folder, overrides, result=None, resumes=()):
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"config": {}, "overrides": overrides}))
    if result is not None:
        (folder / "result.json").write_text(json.dumps({**result, "overrides": overrides,
                                                        "resumes": list(resumes)}))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "result.json").write_text("{}")  # inside a run: not a run of its own


def test_report_of_an_outputs_tree_sorts_and_compares(tmp_path, capsys):
    outputs = tmp_path / "outputs"
    fake_run(outputs / "2026-01-02" / "09-00-00", ["lr=0.01", "seed=0"],
             {"epochs": 5, "best_val_loss": 0.30, "time_to_target_s": None})
    fake_run(outputs / "2026-01-01" / "10-00-00", ["lr=0.001", "seed=0"],
             {"epochs": 5, "best_val_loss": 0.10, "time_to_target_s": 12.5},
             resumes=[{"at_epoch": 3, "overrides": ["epochs=5"]}])
    fake_run(outputs / "2026-01-01" / "11-00-00", ["lr=0.1", "seed=0"])  # no result: failed
    fake_run(outputs / "2026-01-01" / "12-00-00" / "10", ["lr=0.003", "seed=0"],
             {"epochs": 5, "best_val_loss": 0.20})
    fake_run(outputs / "2026-01-01" / "12-00-00" / "2", ["lr=0.002", "seed=0"],
             {"epochs": 5, "best_val_loss": 0.25})

    assert report.main([str(outputs), "--sort", "best_val_loss"]) == 0
    printed = capsys.readouterr().out
    rows = summary_rows(outputs)  # the file keeps job order: by date, time, then job number
    assert [r["job"] for r in rows] == ["2026-01-01/10-00-00", "2026-01-01/11-00-00", "2026-01-01/12-00-00/2",
                                        "2026-01-01/12-00-00/10", "2026-01-02/09-00-00"]
    assert [r["status"] for r in rows] == ["reached target", "failed", "epoch cap", "epoch cap", "epoch cap"]
    assert rows[0]["resumes"] == "@3 epochs=5"
    assert "lr" in rows[0] and "seed" not in rows[0]  # only the overrides that differ get a column
    table = [x for x in printed.splitlines() if x.startswith("| 2026")]
    order = [x.split("|")[1].strip() for x in table]
    assert order == ["2026-01-01/10-00-00", "2026-01-01/12-00-00/10", "2026-01-01/12-00-00/2",
                     "2026-01-02/09-00-00", "2026-01-01/11-00-00"]  # a blank value sorts last
    assert len({len(x) for x in printed.splitlines() if x.startswith("|")}) == 1  # columns line up

    assert report.main([str(outputs), "--sort", "lr", "--reverse"]) == 0
    order = [x.split("|")[1].strip() for x in capsys.readouterr().out.splitlines() if x.startswith("| 2026")]
    assert order[0] == "2026-01-01/11-00-00" and order[-1] == "2026-01-01/10-00-00"


def test_report_errors_are_one_line(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such directory"]
    assert report.main([str(tmp_path)]) == 2
    assert "no runs here" in capsys.readouterr().err
    fake_run(tmp_path / "0", ["seed=0"], {"epochs": 1})
    assert report.main([str(tmp_path), "--sort", "speed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --sort speed: no such column")


def test_unfinished_runs_interrupted_running_failed(tmp_path):
    from scaffold import rundir
    from scaffold.stats import COLUMNS, StatsFile

    sweep = tmp_path / "sweep"
    for job in ("0", "1", "2"):
        fake_run(sweep / job, [f"seed={job}"])
    for job in ("0", "1"):  # two epochs trained, then stopped (no result.json)
        stats = StatsFile(sweep / job / "train_stats.csv")
        for epoch, best in ((1, True), (2, False)):
            stats.append({**{c: 0.0 for c in COLUMNS}, "epoch": epoch, "total_optimizer_steps": 3 * epoch,
                          "val_dice": 0.5 + epoch / 10, "val_loss_avg": 1.0 / epoch, "is_best": best})
        (sweep / job / "checkpoints" / "last.pt").write_bytes(b"x")
    lock = rundir.RunLock(sweep / "1")  # job 1 is still training
    try:
        rows = summary_rows(sweep) if report.summarize_sweep(sweep) else []
    finally:
        lock.release()
    assert [r["status"] for r in rows] == [f"interrupted (resume={sweep / '0'})", "running", "failed"]
    assert rows[0]["epochs"] == "2" and rows[0]["optimizer_steps"] == "6" and rows[0]["best_epoch"] == "1"
    assert float(rows[0]["final_val_dice"]) == 0.7


def test_a_seed_sweep_is_summarized_over_seeds(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    results = {  # (lr, seed): (epochs, time to target or None: the epoch cap)
        ("0.001", 1): (18, 91.0), ("0.001", 2): (22, 120.0), ("0.001", 3): (16, 80.0),
        ("0.01", 1): (30, None), ("0.01", 2): (20, 100.0)}
    for job, ((lr, seed), (epochs, ttt)) in enumerate(results.items()):
        fake_run(sweep / str(job), [f"lr={lr}", f"seed={seed}"],
                 {"epochs": epochs, "time_to_target_s": ttt, "best_val_loss": epochs / 100})
    fake_run(sweep / "5", ["lr=0.01", "seed=3"])  # failed: counted, not in the statistics
    rows = report.summarize_sweep(sweep)
    columns, table = report.over_seeds(rows)
    assert columns[:3] == ["lr", "runs finished", "reached target"]
    fast, slow = table
    assert (fast["lr"], fast["runs finished"], fast["reached target"]) == ("0.001", "3 of 3", 3)
    assert fast["time_to_target_s"] == "91 [80 – 120]" and fast["epochs"] == "18 [16 – 22]"
    # A run that missed the target is inf, so the median of two is inf too: no figure hides the miss.
    assert (slow["runs finished"], slow["reached target"]) == ("2 of 3", 1)
    assert slow["time_to_target_s"] == "inf [100 – inf]" and slow["epochs"] == "25 [20 – 30]"

    markdown = (sweep / "summary.md").read_text()
    assert "Over seeds" in markdown and "| 0.001 | 3 of 3" in markdown.replace("  ", " ")
    assert report.main([str(sweep)]) == 0
    assert markdown in capsys.readouterr().out

    plain = tmp_path / "plain"  # no seed axis: no section
    fake_run(plain / "0", ["lr=0.1", "seed=1"], {"epochs": 1})
    fake_run(plain / "1", ["lr=0.2", "seed=1"], {"epochs": 1})
    assert report.over_seeds(report.summarize_sweep(plain)) == ([], [])
    assert "Over seeds" not in (plain / "summary.md").read_text()
