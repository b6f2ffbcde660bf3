"""The HTML staleness report over fake run directories written with the run-directory schema."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from asyncrl.config import RunConfig, save_config
from asyncrl.configurable import from_dict
from asyncrl.lab.report import ReportError, default_report_path, load_run, render_report, write_report
from asyncrl.telemetry import names
from asyncrl.telemetry.sinks import RunWriter

BUCKETS = ("0", "1", "2", "3-4")


def write_fake_run(
    path: Path,
    *,
    max_lag: int,
    steps: int = 12,
    seed: int = 0,
    optional: bool = True,
    summary: bool = True,
    close: bool = True,
) -> Path:
    """A run directory as the pipeline writes it: config.yaml, metrics.jsonl, samples, summary.json.

    ``optional=False`` leaves out the optional metrics (GAC, teacher mass, LR, ESS, buckets).
    ``close=False`` leaves the samples as live parts (a run that is still going or died).
    """
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    save_config(
        from_dict(RunConfig, {"run_dir": str(path), "pipeline": {"max_lag": max_lag}}), path / "config.yaml"
    )
    writer = RunWriter(path, tensorboard=False)
    writer.log_step(0, {names.EVAL_ACCURACY: 0.3, names.TIME_S: 0.0})
    batch = 8
    for step in range(1, steps + 1):
        lags = rng.integers(0, max_lag + 2, size=batch) if max_lag else np.zeros(batch, int)
        kept = lags <= max_lag
        kl = 0.01 * lags + rng.random(batch) * 0.005
        m = {
            names.TIME_S: step * (1.0 if max_lag else 1.6),
            names.LOSS: 1.0 / step + 0.01 * rng.random(),
            names.LAG_MEAN: float(lags[kept].mean()),
            names.LAG_MAX: float(lags[kept].max()),
            names.DROPPED: float((~kept).sum()),
            names.KL_BEHAVIOR_CURRENT: float(kl[kept].mean()),
            names.GRAD_NORM: 1.0 + rng.random(),
            names.SAMPLES_PER_S: batch / (1.0 if max_lag else 1.6),
            names.LEARNER_IDLE_FRAC: 0.1 if max_lag else 0.5,
        }
        if optional:
            m |= {
                names.ESS_RHO: 1.0 - 0.02 * float(lags.mean()),
                names.LR_SCHEDULED: 1e-3,
                names.LR_APPLIED: 1e-3 * (0.9 if max_lag else 1.0),
                names.GAC_COS_PREV: float(rng.uniform(-0.2, 0.4)),
                names.GRAD_COS_PREV: float(rng.uniform(-0.2, 0.4)),
                names.TEACHER_MASS: 0.95,
            }
            if step % 2 == 0:  # the dense-reference probe runs every few steps
                m |= {
                    names.GRADREF_COS: 0.9,
                    names.GRADREF_BIAS_SQ_REL: 0.01,
                    names.GRADREF_NOISE_REL: 0.1,
                }
            for b in BUCKETS:
                m[names.bucket_key(b, "kl_behavior_current")] = 0.01 * BUCKETS.index(b)
        if step % 4 == 0:
            m[names.EVAL_ACCURACY] = 0.3 + 0.05 * step
        writer.log_step(step, m)
        writer.log_samples(
            {
                "sample_id": np.arange(batch) + step * batch,
                "prompt_id": np.arange(batch),
                "group_id": np.arange(batch) + step * batch,
                "version_first": step - 1 - lags,
                "version_last": step - 1 - lags,
                "learner_version": np.full(batch, step - 1),
                "lag": lags,
                "kept": kept,
                "reward": rng.random(batch),
                "kl_behavior_current": kl,
                "completion_len": rng.integers(2, 5, size=batch),
                "loss": rng.random(batch),
                "step": np.full(batch, step),
                "token_lag_counts": _token_lag_counts(lags, rng),
            }
        )
    if optional:  # the agreement eval (prompts without answers): RUN/evals.jsonl, by version
        with open(path / names.EVAL_FILE, "w") as f:
            for step in range(0, steps + 1, 4):
                agreement = {
                    "kl_reverse": 8.0 / (1 + step),
                    "kl_forward": 9.0 / (1 + step),
                    "top1_agree": 0.1 + 0.02 * step,
                    "teacher_nll": 5.0,
                    "rouge_l": 0.01 * step,
                }
                f.write(
                    json.dumps({"step": step, "metrics": agreement, "seconds": 1.0, "samples": []}) + "\n"
                )
    if summary:
        writer.write_summary(
            {
                "algo": "opd",
                "estimator": "reverse_kl_mc",
                "max_lag": max_lag,
                "steps": steps,
                "samples_trained": steps * batch,
                "samples_dropped": 3 if max_lag else 0,
                "wall_time_s": steps * (1.0 if max_lag else 1.6),
                "samples_per_s": batch / (1.0 if max_lag else 1.6),
                "lag_p50": 1.0 if max_lag else 0.0,
                "lag_max": max_lag,
                "eval_accuracy_initial": 0.3,
                "eval_accuracy_final": 0.9,
                "teacher_accuracy": None,
                "run_dir": str(path),
            }
        )
    if close:
        writer.close()
    return path


@pytest.fixture
def two_runs(tmp_path: Path) -> list[Path]:
    return [
        write_fake_run(tmp_path / "sync", max_lag=0),
        write_fake_run(tmp_path / "async", max_lag=2, seed=1),
    ]


def _token_lag_counts(lags: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per sample: its tokens per lag bucket (a few at its own lag, some newer: in-flight updates)."""
    out = np.empty(len(lags), dtype=object)
    for i, lag in enumerate(lags):
        counts = np.zeros(7, dtype=np.int64)
        counts[min(int(lag), 2)] += rng.integers(1, 4)
        counts[0] += rng.integers(0, 3)
        out[i] = counts
    return out


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_two_runs_render_every_panel_with_both_names(two_runs: list[Path]) -> None:
    page = render_report(two_runs)
    images = _images(page)
    assert len(images) == 12  # every panel recorded
    assert all(img.startswith(b"\x89PNG\r\n\x1a\n") and len(img) > 2000 for img in images)
    assert "not recorded" not in page
    assert page.count("<img") == len(images)  # self-contained: every image is a data URI
    assert "http://" not in page and "https://" not in page
    for name in ("sync", "async"):
        assert f"<th>{name}</th>" in page  # summary and settings tables have one column per run
    assert "<td>pipeline.max_lag</td><td>0</td><td>2</td>" in page
    assert "<td>samples_dropped</td><td>0</td><td>3</td>" in page
    assert "Agreement with the teacher (held-out prompts)" in page


def test_missing_optional_metrics_say_not_recorded(tmp_path: Path) -> None:
    run = write_fake_run(tmp_path / "bare", max_lag=1, optional=False)
    page = render_report([run])
    for missing in (names.ESS_RHO, names.TEACHER_MASS, names.LR_APPLIED, names.GRADREF_COS):
        assert re.search(rf"class='missing'>not recorded: [^<]*{re.escape(missing)}", page), missing
    # grad norm is recorded, GAC cosine is not: that panel still renders, with a note inside the plot
    assert len(_images(page)) == 12 - 5


def test_unfinished_run_with_live_parts_and_no_summary(tmp_path: Path) -> None:
    run = write_fake_run(tmp_path / "live", max_lag=2, summary=False, close=False)
    assert not (run / names.SAMPLES_FILE).exists() and (run / names.SAMPLES_PARTS_DIR).is_dir()
    records = load_run(run)
    assert records.samples is not None and len(records.samples) == 12 * 8
    page = render_report([records])
    assert "unfinished (no summary.json)" in page
    assert "Lag histogram" in page and len(_images(page)) == 12


@pytest.mark.parametrize("missing", [names.METRICS_FILE, names.CONFIG_FILE])
def test_incomplete_run_dir_names_the_missing_file(tmp_path: Path, missing: str) -> None:
    run = write_fake_run(tmp_path / "r", max_lag=0, steps=2)
    (run / missing).unlink()
    with pytest.raises(ReportError, match=rf"incomplete: missing {re.escape(missing)}"):
        render_report([run])


def test_nonexistent_and_empty_run_dirs(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="does not exist"):
        load_run(tmp_path / "nope")
    run = write_fake_run(tmp_path / "r", max_lag=0, steps=1)
    (run / names.METRICS_FILE).write_text("")
    with pytest.raises(ReportError, match="no steps"):
        load_run(run)


def test_default_output_paths(tmp_path: Path, two_runs: list[Path]) -> None:
    assert default_report_path([two_runs[0]]) == two_runs[0].resolve() / "report.html"
    assert default_report_path(two_runs) == tmp_path.resolve() / "report.html"
    out = write_report(two_runs, tmp_path / "out" / "r.html")
    assert out.read_text().startswith("<!doctype html>")


def test_same_dir_names_are_disambiguated(tmp_path: Path) -> None:
    a = write_fake_run(tmp_path / "a" / "run", max_lag=0, steps=2)
    b = write_fake_run(tmp_path / "b" / "run", max_lag=1, steps=2)
    page = render_report([a, b])
    assert "<th>a/run</th>" in page and "<th>b/run</th>" in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium_flags(browser: str, profile: str) -> list[str]:
    """Headless, offline, throwaway profile; dump the DOM after the load event handlers ran."""
    return [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=10000",
        "--dump-dom",
    ]


def assert_images_load_in_chromium(page: Path) -> None:
    """Open ``page`` in headless Chromium: every embedded image decoded (the page's own check says so).
    Skips without Chromium, except under CI where it is required."""
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required under CI (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    n_images = len(_images(page.read_text()))
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [*_chromium_flags(browser, profile), page.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = re.search(r"<body[^>]*>", proc.stdout)
    assert body is not None, proc.stdout[:500]
    assert f'data-images-loaded="{n_images}/{n_images}"' in body.group()
    assert 'data-images-ok="true"' in body.group()


def test_every_image_loads_in_headless_chromium(tmp_path: Path, two_runs: list[Path]) -> None:
    assert_images_load_in_chromium(write_report(two_runs, tmp_path / "report.html"))


def test_broken_image_is_detected_by_the_page_check(tmp_path: Path, two_runs: list[Path]) -> None:
    """The browser check can fail: a corrupt data URI is reported as not loaded."""
    browser = _chromium()
    if browser is None:
        pytest.skip("covered by the chromium requirement above")
    page = render_report(two_runs).replace("data:image/png;base64,iVBOR", "data:image/png;base64,AAAA", 1)
    out = tmp_path / "broken.html"
    out.write_text(page)
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [*_chromium_flags(browser, profile), out.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert 'data-images-ok="false"' in proc.stdout


def test_accuracy_plots_mark_the_teacher(two_runs: list[Path]) -> None:
    from asyncrl.lab.report import _PANELS, load_runs

    records = load_runs(two_runs)
    for r in records:
        r.summary = {**(r.summary or {}), "teacher_accuracy": 0.97}
    panel = next(p for p in _PANELS if p.title == "Loss and accuracy")
    fig = panel.render(records)
    acc_axes = [ax for ax in fig.axes if ax.get_ylabel() == "eval accuracy"]
    assert len(acc_axes) == 2
    for ax in acc_axes:
        assert any(list(line.get_ydata()) == [0.97, 0.97] for line in ax.lines)
