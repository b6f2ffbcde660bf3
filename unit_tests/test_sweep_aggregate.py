"""Sweep aggregation: the per-cell table, mean/std/n over seeds, mean curves, and the PNG plots and HTML
report written over fake run directories."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_report_html import write_fake_run
from test_sweep_run import FakeRunner
from test_sweep_spec import write_sweep

from asyncrl.lab.aggregate import (
    cell_table,
    figure_columns,
    mean_curve,
    metric_figures,
    seed_table,
    summary_figures,
    write_table,
)
from asyncrl.lab.sweep import aggregate_sweep, load_sweep, run_sweep
from asyncrl.lab.sweep_report import plot_curves, plot_y_vs_x
from asyncrl.telemetry import names

PNG = b"\x89PNG\r\n\x1a\n"


def test_seed_table_mean_std_n_per_setting() -> None:
    table = pd.DataFrame(
        {
            "lag": [0, 0, 0, 2, 2, 2],
            "seed": [0, 1, 2, 0, 1, 2],
            "acc": [0.5, 0.6, 0.7, 0.2, np.nan, 0.4],
            "wall": [10.0, 10.0, 10.0, 5.0, 5.0, 5.0],
        }
    )
    out = seed_table(table, ["lag"], ["acc", "wall"])
    assert list(out.columns) == ["lag", "acc:mean", "acc:std", "acc:n", "wall:mean", "wall:std", "wall:n"]
    row0, row2 = out.to_dict("records")
    assert row0["lag"] == 0 and row0["acc:mean"] == pytest.approx(0.6) and row0["acc:n"] == 3
    assert row0["acc:std"] == pytest.approx(0.1)  # sample std: sqrt((0.01 + 0 + 0.01) / 2)
    assert row2["acc:mean"] == pytest.approx(0.3) and row2["acc:n"] == 2  # the NaN seed is left out
    assert row2["acc:std"] == pytest.approx(math.sqrt(0.02))
    assert row0["wall:std"] == 0.0
    one = seed_table(table[table["seed"] == 0], ["lag"], ["acc"])
    assert one["acc:n"].tolist() == [1, 1] and one["acc:std"].isna().all()  # no spread from one seed


def test_seed_table_keeps_settings_order_and_groups_on_several_keys() -> None:
    table = pd.DataFrame(
        {
            "variant": ["b", "b", "a", "a"],
            "lag": [2, 0, 2, 0],
            "seed": [0, 0, 0, 0],
            "acc": [1.0, 2.0, 3.0, 4.0],
        }
    )
    out = seed_table(table, ["variant", "lag"], ["acc"])
    assert out[["variant", "lag"]].values.tolist() == [["b", 2], ["b", 0], ["a", 2], ["a", 0]]
    assert seed_table(table, [], ["acc"])["acc:mean"].tolist() == [2.5]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=5), min_size=1, max_size=4)
)
def test_seed_table_agrees_with_numpy(groups: list[list[float]]) -> None:
    rows = [{"g": i, "seed": j, "y": v} for i, values in enumerate(groups) for j, v in enumerate(values)]
    out = seed_table(pd.DataFrame(rows), ["g"], ["y"])
    for values, row in zip(groups, out.to_dict("records")):
        assert row["y:n"] == len(values)
        assert row["y:mean"] == pytest.approx(np.mean(values), rel=1e-9, abs=1e-6)
        if len(values) >= 2:
            assert row["y:std"] == pytest.approx(np.std(values, ddof=1), rel=1e-6, abs=1e-6)
        else:
            assert math.isnan(row["y:std"])


def test_mean_curve_aligns_seeds_on_steps() -> None:
    a = (np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0]))
    b = (np.array([1.0, 3.0]), np.array([3.0, 5.0]))  # seed b did not log step 2
    steps, mean, std, n = mean_curve([a, b])
    assert steps.tolist() == [1.0, 2.0, 3.0]
    assert mean.tolist() == [2.0, 2.0, 4.0] and n.tolist() == [2, 1, 2]
    assert std[0] == pytest.approx(math.sqrt(2.0)) and math.isnan(std[1])
    assert [len(x) for x in mean_curve([])] == [0, 0, 0, 0]


def test_metric_figures_final_and_mean_skip_missing_steps() -> None:
    rows = [
        {names.STEP: 0, names.EVAL_ACCURACY: 0.2},
        {names.STEP: 1, names.LOSS: 2.0},
        {names.STEP: 2, names.LOSS: None, names.EVAL_ACCURACY: 0.4},
        {names.STEP: 3, names.LOSS: 1.0},
    ]
    out = metric_figures(rows, [names.LOSS, names.EVAL_ACCURACY, names.ESS_RHO])
    assert out == {
        "final:loss": 1.0,
        "mean:loss": 1.5,
        "final:eval/accuracy": 0.4,
        "mean:eval/accuracy": pytest.approx(0.3),
        f"final:{names.ESS_RHO}": None,
        f"mean:{names.ESS_RHO}": None,
    }


def test_summary_figures_are_the_numbers_in_summary_order() -> None:
    summary = {
        "run_dir": "/x",
        "algo": "opd",
        "zeta": 1,
        "steps": 3,
        "lag_p50": None,
        "eval_accuracy_final": 0.5,
    }
    assert list(summary_figures(summary)) == ["steps", "lag_p50", "eval_accuracy_final", "zeta"]


def test_cell_table_and_files(tmp_path: Path) -> None:
    done = write_fake_run(tmp_path / "a", max_lag=2, steps=4)
    table = cell_table(
        [
            ({"cell": "a", "lag": 2, "status": "done"}, done),
            ({"cell": "b", "lag": 4, "status": "pending"}, None),
        ],
        [names.LOSS, "never/logged"],
    )
    assert table["cell"].tolist() == ["a", "b"]
    assert table.loc[0, "samples_dropped"] == 3 and math.isnan(table.loc[1, "samples_dropped"])
    assert math.isnan(table.loc[0, "final:never/logged"])
    figures = figure_columns(table, ["cell", "lag", "status"])
    assert "final:loss" in figures and "samples_per_s" in figures and "status" not in figures
    csv, parquet = write_table(table, tmp_path / "t" / "cells")
    back = pd.read_parquet(parquet)
    assert back["cell"].tolist() == ["a", "b"] and back["final:loss"].iloc[0] == table["final:loss"].iloc[0]
    assert pd.read_csv(csv).shape == table.shape


def test_mixed_type_columns_are_written_as_strings(tmp_path: Path) -> None:
    _, parquet = write_table(pd.DataFrame({"x": [1, "auto"], "y": [1.0, 2.0]}), tmp_path / "m")
    assert pd.read_parquet(parquet)["x"].tolist() == ["1", "auto"]


# --- plots and the report over a fake sweep -------------------------------------------------------------
class ScoredRunner(FakeRunner):
    """A fake run whose final accuracy falls with the lag and varies with the seed (known means/stds)."""

    def __call__(self, cfg):
        result = super().__call__(cfg)
        summary = json.loads((result.run_dir / names.SUMMARY_FILE).read_text())
        base = 0.8 if cfg.estimator.name == "forward_kl" else 0.6
        summary["eval_accuracy_final"] = base - 0.1 * cfg.pipeline.max_lag + 0.01 * cfg.seed
        (result.run_dir / names.SUMMARY_FILE).write_text(json.dumps(summary))
        return result


@pytest.fixture
def study(tmp_path: Path):
    path = write_sweep(
        tmp_path,
        {
            "grid": {"pipeline.max_lag": [0, 1, 2]},
            "variants": {
                "fkl": {"estimator.name": "forward_kl", "estimator.options": {}},
                "rkl": {"estimator.name": "reverse_kl_mc", "estimator.options": {}},
            },
            "seeds": [0, 1, 2],
            "overrides": {"train.steps": 4},
            "aggregate": {"y": ["eval_accuracy_final", "final:loss"], "curves": [names.LOSS, "never/logged"]},
        },
    )
    sweep = load_sweep(path)
    run_sweep(sweep, runner=ScoredRunner())
    return sweep


def test_aggregate_writes_tables_plots_and_report(study) -> None:
    out = aggregate_sweep(study)
    assert out.statuses == {"done": 18}
    cells = pd.read_csv(out.cells)
    assert len(cells) == 18 and {"variant", "pipeline.max_lag", "seed", "final:loss", "mean:loss"} <= set(
        cells
    )
    seeds = pd.read_parquet(out.seeds.with_suffix(".parquet"))
    assert len(seeds) == 6 and seeds["eval_accuracy_final:n"].tolist() == [3] * 6
    row = seeds[(seeds["variant"] == "rkl") & (seeds["pipeline.max_lag"] == 2)].iloc[0]
    # 0.6 - 0.1 * lag, and seeds 0, 1, 2 add 0.01 on average
    assert row["eval_accuracy_final:mean"] == pytest.approx(0.6 - 0.2 + 0.01)
    assert row["eval_accuracy_final:std"] == pytest.approx(0.01)
    stems = sorted(p.name for p in out.plots)
    assert stems == [
        "curve_loss.png",
        "eval_accuracy_final_vs_pipeline.max_lag.png",
        "final_loss_vs_pipeline.max_lag.png",
    ]
    for plot in out.plots:
        data = plot.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    page = out.report.read_text()
    images = [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]
    assert len(images) == 3 + 12  # the sweep's plots + the 12 run panels over the first seed of 6 settings
    assert all(img.startswith(PNG) for img in images)
    assert "not recorded: never/logged" in page  # a requested curve no run logged says so
    assert "0.41 ± 0.01 (n=3)" in page  # rkl at lag 2, in the table over seeds
    assert "<h1>asyncrl sweep: study</h1>" in page and "<b>variant=fkl, pipeline.max_lag=0</b>" in page


def test_report_of_a_partly_run_sweep(study) -> None:
    """Cells without results are listed with their status and left out of the figures."""
    for cell in study.cells[:15]:
        (cell.run_dir / names.SUMMARY_FILE).unlink()
    out = aggregate_sweep(study)
    assert out.statuses == {"partial": 15, "done": 3}
    seeds = pd.read_csv(out.seeds)
    assert len(seeds) == 1 and seeds["eval_accuracy_final:n"].tolist() == [3]
    page = out.report.read_text()
    assert page.count("<td>partial</td>") == 15


def test_y_vs_x_on_categorical_x_and_nothing_recorded() -> None:
    seeds = pd.DataFrame({"variant": ["a", "b"], "acc:mean": [0.5, 0.6], "acc:std": [0.1, np.nan]})
    cells = pd.DataFrame({"variant": ["a", "a", "b"], "acc": [0.4, 0.6, 0.6]})
    fig = plot_y_vs_x(seeds, cells, x="variant", y="acc", group_by=[])
    assert fig is not None
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "b"]
    empty = seeds.assign(**{"acc:mean": [np.nan, np.nan]})
    assert plot_y_vs_x(empty, cells, x="variant", y="acc", group_by=[]) is None
    assert plot_curves({"g": {"0": [(np.zeros(0), np.zeros(0))]}}, "loss", line_key="lag") is None


def test_every_image_of_the_sweep_report_loads_in_headless_chromium(study) -> None:
    from test_report_html import assert_images_load_in_chromium

    assert_images_load_in_chromium(aggregate_sweep(study).report)


def test_names_list_every_summary_figure(tmp_path: Path) -> None:
    """``aggregate.y`` is checked against ``names.SUMMARY_KEYS``: it holds every key the pipeline writes."""
    from asyncrl.telemetry.summary import summarize

    run = write_fake_run(tmp_path / "r", max_lag=2, steps=4)
    summary = summarize(
        run, algo="opd", estimator="forward_kl", max_lag=2, teacher_accuracy=0.9, wall_s=1.0, store_stats={}
    )
    assert set(summary) <= set(names.SUMMARY_KEYS), set(summary) - set(names.SUMMARY_KEYS)


def test_zero_and_aborted_results_count_and_a_failed_run_is_not_a_result(tmp_path: Path) -> None:
    """A seed whose final accuracy is exactly 0.0 and one the numerics guard aborted are in their setting's
    n; a cell whose run raised (summary.json status failed, from an earlier invocation) is not."""
    path = write_sweep(
        tmp_path, {"grid": {"pipeline.max_lag": [0, 2]}, "seeds": [0, 1, 2], "overrides": {"train.steps": 4}}
    )
    sweep = load_sweep(path)
    run_sweep(sweep, runner=FakeRunner(fail=("pipeline.max_lag=2__seed=2",)))
    by_key = {c.key: c for c in sweep.cells}
    zero = by_key["pipeline.max_lag=0__seed=1"].run_dir / names.SUMMARY_FILE
    aborted = by_key["pipeline.max_lag=2__seed=0"].run_dir / names.SUMMARY_FILE
    for path_, status, acc in ((zero, names.STATUS_COMPLETED, 0.0), (aborted, names.STATUS_ABORTED, 0.0)):
        doc = json.loads(path_.read_text())
        doc.update(status=status, eval_accuracy_final=acc)
        path_.write_text(json.dumps(doc))
    out = aggregate_sweep(sweep)  # a fresh invocation: only the files say which cell failed
    cells = pd.read_csv(out.cells).set_index("cell")
    assert cells.loc["pipeline.max_lag=2__seed=2", "status"] == "failed"
    assert cells.loc["pipeline.max_lag=0__seed=1", "eval_accuracy_final"] == 0.0
    seeds = pd.read_csv(out.seeds).set_index("pipeline.max_lag")
    assert seeds.loc[0, "eval_accuracy_final:n"] == 3  # the 0.0 seed counts
    assert seeds.loc[2, "eval_accuracy_final:n"] == 2  # the aborted seed counts, the failed one does not
    finals = cells.loc[
        ["pipeline.max_lag=0__seed=0", "pipeline.max_lag=0__seed=1", "pipeline.max_lag=0__seed=2"]
    ]
    assert seeds.loc[0, "eval_accuracy_final:mean"] == pytest.approx(finals["eval_accuracy_final"].mean())
