"""Running a sweep with an injected runner (no Ray): finished cells are skipped, interrupted and failed
ones rerun, a run directory of another config is refused; the `asyncrl sweep` command end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_report_html import write_fake_run
from test_sweep_spec import write_sweep

import asyncrl
from asyncrl import cli
from asyncrl.config import RunConfig, save_config
from asyncrl.lab.sweep import MANIFEST, SweepError, cell_state, load_sweep, run_sweep
from asyncrl.telemetry import names
from asyncrl.telemetry.sinks import read_summary, write_summary
from asyncrl.telemetry.summary import failed_summary


class FakeRunner:
    """Writes a run directory as the pipeline does (config.yaml of the cell's config, metrics, samples,
    summary.json last); fails for the cells named in ``fail``."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, cfg: RunConfig) -> SimpleNamespace:
        run_dir = Path(cfg.run_dir)
        self.calls.append(run_dir.name)
        if run_dir.name in self.fail:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / names.CONFIG_FILE)
            err = RuntimeError(f"boom in {run_dir.name}\nsecond line")
            write_summary(run_dir, failed_summary(run_dir, err, wall_s=1.0))  # as asyncrl.run does
            raise err
        write_fake_run(run_dir, max_lag=cfg.pipeline.max_lag, steps=cfg.train.steps, seed=cfg.seed)
        save_config(cfg, run_dir / names.CONFIG_FILE)
        return SimpleNamespace(run_dir=run_dir, summary=read_summary(run_dir), config=cfg)


@pytest.fixture
def sweep_file(tmp_path: Path) -> Path:
    return write_sweep(
        tmp_path, {"grid": {"pipeline.max_lag": [0, 2]}, "seeds": [0, 1], "overrides": {"train.steps": 4}}
    )


def test_second_invocation_runs_nothing(sweep_file: Path) -> None:
    sweep = load_sweep(sweep_file)
    runner = FakeRunner()
    results = run_sweep(sweep, runner=runner)
    assert runner.calls == [c.key for c in sweep.cells]
    assert {r.status for r in results.values()} == {"done"}
    runner2 = FakeRunner()
    results2 = run_sweep(load_sweep(sweep_file), runner=runner2)
    assert runner2.calls == []
    assert {r.status for r in results2.values()} == {"skipped"}
    manifest = json.loads((sweep.output_dir / MANIFEST).read_text())
    assert [c["status"] for c in manifest["cells"]] == ["done"] * 4


def test_interrupted_and_failed_cells_are_rerun(sweep_file: Path) -> None:
    sweep = load_sweep(sweep_file)
    keys = [c.key for c in sweep.cells]
    runner = FakeRunner(fail=(keys[1],))
    results = run_sweep(sweep, runner=runner)
    assert runner.calls == keys  # a failure does not stop the others
    assert results[keys[1]].status == "failed" and "RuntimeError: boom in" in results[keys[1]].error
    assert "\n" not in results[keys[1]].error
    # the failed cell's summary.json says status "failed" (what asyncrl.run writes when it raises): not done
    assert read_summary(sweep.cells[1].run_dir)["status"] == names.STATUS_FAILED
    # an interrupted cell: it started (config.yaml) but never wrote summary.json
    (sweep.cells[2].run_dir / names.SUMMARY_FILE).unlink()
    assert cell_state(sweep.cells[2]) == "partial" and cell_state(sweep.cells[1]) == "partial"
    assert cell_state(sweep.cells[0]) == "done"
    # a run the numerics guard stopped is an outcome of its config (a diverged learning rate): done
    aborted = read_summary(sweep.cells[3].run_dir) | {"status": names.STATUS_ABORTED}
    write_summary(sweep.cells[3].run_dir, aborted)
    assert cell_state(sweep.cells[3]) == "done"
    runner2 = FakeRunner()
    run_sweep(load_sweep(sweep_file), runner=runner2)
    assert runner2.calls == [keys[1], keys[2]]


def test_fail_fast_stops_at_the_first_failure(sweep_file: Path) -> None:
    sweep = load_sweep(sweep_file)
    runner = FakeRunner(fail=(sweep.cells[0].key,))
    results = run_sweep(sweep, runner=runner, fail_fast=True)
    assert runner.calls == [sweep.cells[0].key]
    assert [results.get(c.key) for c in sweep.cells[1:]] == [None] * 3


def test_interrupt_stops_the_sweep(sweep_file: Path) -> None:
    sweep = load_sweep(sweep_file)

    def interrupted(cfg: RunConfig) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, runner=interrupted)


def test_a_run_directory_of_another_config_is_refused(sweep_file: Path, tmp_path: Path) -> None:
    run_sweep(load_sweep(sweep_file), runner=FakeRunner())
    changed = load_sweep(sweep_file, ["train.lr=0.01"])
    runner = FakeRunner()
    with pytest.raises(
        SweepError,
        match=r"cell pipeline.max_lag=0__seed=0: .* holds a run of another config \(train.lr: 0.0003 -> 0.01",
    ):
        run_sweep(changed, runner=runner)
    assert runner.calls == []  # checked before anything runs
    # where or how a cell executes is not what it computes: no refusal
    same = load_sweep(sweep_file, ["workload.cache_dir=/elsewhere", "telemetry.tensorboard=true"])
    assert {cell_state(c) for c in same.cells} == {"done"}


def test_a_real_preset_cell_resumes_although_its_run_filled_in_the_prompt_splits(tmp_path: Path) -> None:
    """A real preset's run stores the prompt splits it took from its prepared cache
    (``plan.absolute_paths``); the sweep's cell leaves them unset. That is the same cell, not another
    config; a prompt file the user set is still compared."""
    from asyncrl.plan import absolute_paths
    from asyncrl.workloads import real

    cache = tmp_path / "cache"
    root = Path(real.paths("smollm2", cache)["root"])
    root.mkdir(parents=True)
    (root / real.PREPARED_FILE).write_text("{}")
    f = write_sweep(
        tmp_path,
        {
            "seeds": [0],
            "overrides": {
                "workload.preset": "smollm2",
                "workload.cache_dir": str(cache),
                "sampling.max_new_tokens": 8,
            },
        },
    )
    cell = load_sweep(f).cells[0]
    stored = absolute_paths(cell.config)  # what the run writes to its config.yaml
    assert stored.workload.prompts_path == real.paths("smollm2", cache)["train_prompts"]
    cell.run_dir.mkdir(parents=True)
    save_config(stored, cell.run_dir / names.CONFIG_FILE)
    assert cell_state(cell) == "partial"
    other = load_sweep(f, [f"workload.eval_prompts_path={tmp_path / 'mine.jsonl'}"]).cells[0]
    with pytest.raises(SweepError, match=r"workload\.eval_prompts_path"):
        cell_state(other)


def test_progress_sees_every_cell(sweep_file: Path) -> None:
    events: list[tuple] = []
    progress = SimpleNamespace(
        start=lambda cell, steps: events.append(("start", cell, steps)),
        step=lambda cell, step: None,
        finish=lambda cell, ok, note="": events.append(("finish", cell, ok)),
    )
    sweep = load_sweep(sweep_file)
    run_sweep(sweep, runner=FakeRunner(fail=(sweep.cells[3].key,)), progress=progress)
    assert [e[0] for e in events] == ["start", "finish"] * 4
    assert events[0] == ("start", sweep.cells[0].key, 4) and events[-1] == (
        "finish",
        sweep.cells[3].key,
        False,
    )


def test_parallel_needs_the_ray_runner(sweep_file: Path) -> None:
    with pytest.raises(SweepError, match="custom runner runs sequentially"):
        run_sweep(load_sweep(sweep_file), runner=FakeRunner(), parallel=2)
    with pytest.raises(SweepError, match="--parallel must be >= 1"):
        run_sweep(load_sweep(sweep_file), runner=FakeRunner(), parallel=0)


# --- the command -------------------------------------------------------------------------------------
@pytest.fixture
def fake_pipeline(monkeypatch: pytest.MonkeyPatch) -> FakeRunner:
    runner = FakeRunner()
    monkeypatch.setattr(asyncrl, "run", runner)
    monkeypatch.setattr(cli, "_check_checkpoints", lambda cfg: None)
    return runner


def test_sweep_command_runs_aggregates_and_resumes(
    sweep_file: Path, fake_pipeline: FakeRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sweep", str(sweep_file), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cells: 4 done (4 run now)" in out
    root = (sweep_file.parent / "out").resolve()
    for name in ("cells.csv", "cells.parquet", "seeds.csv", "seeds.parquet", "report.html", MANIFEST):
        assert (root / name).is_file(), name
    assert f"report: {root / 'report.html'}" in out
    assert len(fake_pipeline.calls) == 4
    assert cli.main(["sweep", str(sweep_file), "--quiet"]) == 0
    assert "cells: 4 done (0 run now)" in capsys.readouterr().out
    assert len(fake_pipeline.calls) == 4  # nothing rerun


def test_sweep_command_list_and_report_only(
    sweep_file: Path, fake_pipeline: FakeRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sweep", str(sweep_file), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pending  pipeline.max_lag=0__seed=0" and lines[-1].startswith("4 cells in ")
    assert cli.main(["sweep", str(sweep_file), "--report-only", "-q"]) == 0
    assert "cells: 4 pending (0 run now)" in capsys.readouterr().out
    assert fake_pipeline.calls == []
    # the manifest follows the file too (a part run from a trimmed copy is brought back to the whole)
    manifest = json.loads((sweep_file.parent / "out" / MANIFEST).resolve().read_text())
    assert [c["status"] for c in manifest["cells"]] == ["pending"] * 4


def test_sweep_command_config_errors_exit_2_and_failures_exit_1(
    sweep_file: Path, fake_pipeline: FakeRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sweep", str(sweep_file), "pipeline.max_lagg=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"sweep {sweep_file}, cell pipeline.max_lag=0__seed=0" in err
    assert cli.main(["sweep", str(sweep_file), "--parallel", "0"]) == 2
    fake_pipeline.fail = ("pipeline.max_lag=2__seed=1",)
    assert cli.main(["sweep", str(sweep_file), "-q"]) == 1
    captured = capsys.readouterr()
    assert "cells: 3 done, 1 failed (4 run now)" in captured.out
    assert "cell pipeline.max_lag=2__seed=1 failed: RuntimeError: boom" in captured.err
    assert fake_pipeline.calls == [c.key for c in load_sweep(sweep_file).cells]


def test_only_runs_the_selected_cells_and_the_manifest_keeps_every_cell(
    sweep_file: Path, fake_pipeline: FakeRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sweep", str(sweep_file), "-q", "--only", "pipeline.max_lag=2", "--only", "seed=1"]) == 0
    assert fake_pipeline.calls == ["pipeline.max_lag=2__seed=1"]
    assert "cells: 3 pending, 1 done (1 run now)" in capsys.readouterr().out
    manifest = json.loads((sweep_file.parent / "out" / MANIFEST).resolve().read_text())
    assert [c["status"] for c in manifest["cells"]] == ["pending", "pending", "pending", "done"]
    # several values of one key, comma-separated: any of them; the done cell is not rerun
    args = ["sweep", str(sweep_file), "-q", "--only", "pipeline.max_lag=0,2", "--only", "seed=1"]
    assert cli.main(args) == 0
    assert fake_pipeline.calls == ["pipeline.max_lag=2__seed=1", "pipeline.max_lag=0__seed=1"]
    assert cli.main(["sweep", str(sweep_file), "--list", "--only", "seed=0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("2 cells (--only: 2 of 4) in ") and all("seed=0" in x for x in lines[-3:-1])


@pytest.mark.parametrize(
    ("only", "message"),
    [
        ("pipeline.max_lag=3", "pipeline.max_lag has no value '3'; it has 0, 2"),
        ("train.lr=1", "'train.lr' is not swept; choose from pipeline.max_lag, seed"),
        ("seed", "'seed' is not KEY=VALUE"),
    ],
)
def test_only_names_the_key_or_value_it_does_not_know(
    sweep_file: Path, fake_pipeline: FakeRunner, capsys: pytest.CaptureFixture[str], only: str, message: str
) -> None:
    assert cli.main(["sweep", str(sweep_file), "--only", only]) == 2
    assert message in capsys.readouterr().err
    assert fake_pipeline.calls == []
