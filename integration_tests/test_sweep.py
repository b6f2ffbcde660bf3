"""`asyncrl sweep` end to end on Ray with the shipped tiny sweep (2 cells x 1 seed x 3 steps): every
cell runs on one shared Ray instance, and a second invocation reruns nothing."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from conftest import CACHE, REPO

import asyncrl
from asyncrl import pipeline
from asyncrl.cli import main
from asyncrl.telemetry import names

TINY_SWEEP = REPO / "examples" / "sweeps" / "tiny.yaml"
KEYS = ("pipeline.max_lag=0__seed=0", "pipeline.max_lag=2__seed=0")


def _argv(out: Path, *more: str) -> list[str]:
    return [
        "sweep",
        str(TINY_SWEEP),
        f"workload.cache_dir={CACHE}",
        "--output-dir",
        str(out),
        "--quiet",
        *more,
    ]


def _check_results(out: Path) -> dict[str, float]:
    cells = pd.read_csv(out / "cells.csv")
    assert cells["cell"].tolist() == list(KEYS) and set(cells["status"]) == {"done"}
    assert cells["steps"].tolist() == [3, 3]
    sync = cells[cells["pipeline.max_lag"] == 0].iloc[0]
    assert sync["lag_max"] == 0 and sync["samples_dropped"] == 0  # max_lag 0 is lock-step
    assert cells["lag_max"].max() <= 2
    assert cells["final:loss"].notna().all() and cells["eval_accuracy_final"].notna().all()
    assert len(pd.read_parquet(out / "seeds.parquet")) == 2
    assert {p.name for p in (out / "plots").iterdir()} >= {
        "curve_loss.png",
        "eval_accuracy_final_vs_pipeline.max_lag.png",
    }
    assert "asyncrl sweep: tiny" in (out / names.REPORT_FILE).read_text()
    return {k: (out / "runs" / k / names.SUMMARY_FILE).stat().st_mtime_ns for k in KEYS}


@pytest.mark.ray
def test_tiny_sweep_runs_once_on_one_ray_then_reruns_nothing(
    tiny_pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    started: list[bool] = []
    init_ray = pipeline.init_ray

    def counting_init_ray(cfg):
        started.append(init_ray(cfg))
        return started[-1]

    monkeypatch.setattr(pipeline, "init_ray", counting_init_ray)
    out = tmp_path / "sweep"
    assert main(_argv(out)) == 0
    assert "cells: 2 done (2 run now)" in capsys.readouterr().out
    assert started == [True, False, False]  # the sweep started Ray once; both runs joined it
    assert not ray.is_initialized()  # and shut it down
    summaries = _check_results(out)

    def must_not_run(cfg):
        raise AssertionError(f"a finished cell was rerun: {cfg.run_dir}")

    monkeypatch.setattr(asyncrl, "run", must_not_run)
    assert main(_argv(out)) == 0
    assert "cells: 2 done (0 run now)" in capsys.readouterr().out
    assert started == [True, False, False]  # no Ray either
    assert _check_results(out) == summaries  # untouched


@pytest.mark.ray
@pytest.mark.slow
def test_tiny_sweep_in_parallel_on_ray_tasks(
    tiny_pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--parallel 2: both cells' pipelines driven by their own Ray task at once (1.5 CPUs each on the
    4 logical CPUs asyncrl starts Ray with on this box)."""
    out = tmp_path / "sweep"
    assert main(_argv(out, "--parallel", "2")) == 0
    assert "cells: 2 done (2 run now)" in capsys.readouterr().out
    _check_results(out)
