"""Live progress owned by the driver: rich on a TTY, a line per eval in logs, nothing when
quiet; rows that follow a run's metrics.jsonl; each step shown once."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

from asyncrl.telemetry import names
from asyncrl.telemetry.progress import (
    SUPERVISED_FIELDS,
    Display,
    GridProgress,
    MetricsFollower,
    Progress,
    choose_mode,
    format_duration,
    format_stats,
    sweep_eta,
)

STEP_METRICS = {
    names.SAMPLES_PER_S: 35.25,
    names.LAG_MEAN: 1.2,
    names.LAG_MAX: 2.0,
    names.ESS_RHO: 0.975,
    names.LOSS: 0.4123,
}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mode_follows_quiet_and_tty() -> None:
    assert choose_mode(stream=_Tty()) == "rich"
    assert choose_mode(stream=io.StringIO()) == "plain"
    assert choose_mode(quiet=True, stream=_Tty()) == "off"
    assert choose_mode("plain", stream=_Tty()) == "plain"


def test_format_stats_shows_every_figure_and_dashes_for_missing() -> None:
    line = format_stats(STEP_METRICS, accuracy=0.5, eval_step=20)
    assert line == "samples/s 35.2  lag 1.20/2  ESS 0.975  loss 0.4123  eval 0.500@20"
    assert format_stats({}) == "samples/s -  lag -/-  ESS -  loss -  eval -"
    assert format_stats({names.LOSS: 0.5}, fields=SUPERVISED_FIELDS) == "loss 0.5  eval -"


def test_quiet_prints_nothing() -> None:
    out = _Tty()
    with Progress(3, enabled=False, stream=out) as p:
        for step in (1, 2, 3):
            p.update(step, STEP_METRICS)
    assert out.getvalue() == ""


def test_plain_prints_a_line_per_eval_and_the_last_step() -> None:
    out = io.StringIO()
    with Progress(10, stream=out, log_every_s=3600) as p:
        p.update(0, {names.EVAL_ACCURACY: 0.25})  # the initial eval
        for step in range(1, 11):
            m = dict(STEP_METRICS)
            if step == 5:
                m[names.EVAL_ACCURACY] = 0.75
            p.update(step, m)
        p.update(10, STEP_METRICS)  # the same step again is not printed twice
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["0/10", "5/10", "10/10"]
    assert "eval 0.750@5" in lines[-1] and "eta" in lines[1] and "eta" not in lines[-1]


def test_plain_heartbeat_between_evals() -> None:
    out = io.StringIO()
    with Progress(100, stream=out, log_every_s=0.0) as p:
        for step in (1, 2):
            p.update(step, STEP_METRICS)
    assert len(out.getvalue().splitlines()) == 2


def test_rich_bar_on_a_tty_shows_the_figures(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich cuts a line to the terminal's width
    out = _Tty()
    with Progress(4, stream=out, start=1, title="opd") as p:
        assert p.mode == "rich"
        for step in (2, 3, 4):
            p.update(step, {**STEP_METRICS, names.EVAL_ACCURACY: 0.5})
    text = out.getvalue()
    assert "opd" in text and "4/4" in text and "ESS 0.975" in text and "eval 0.500@4" in text
    assert "eta" in text


def _append(path: Path, step: int, **metrics: float) -> None:
    with path.open("a") as f:
        f.write(json.dumps({names.STEP: step, **metrics}) + "\n")


def test_display_follows_a_run_while_it_writes() -> None:
    """A writer thread appends steps while the display follows; an earlier run's records (there
    before the follow starts, then deleted by the new run) are never shown; each step once."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        path = run / names.METRICS_FILE
        for step in range(1, 30):  # an earlier run in the same directory
            _append(path, step, **{names.LOSS: 9.0})
        out = io.StringIO()

        def train() -> None:
            time.sleep(0.05)
            path.unlink()  # the new run's RunWriter discards the earlier records
            _append(path, 0, **{names.EVAL_ACCURACY: 0.2})
            for step in range(1, 7):
                time.sleep(0.01)
                metrics = {**STEP_METRICS, names.EVAL_ACCURACY: 0.6} if step % 3 == 0 else STEP_METRICS
                _append(path, step, **metrics)

        with Display(stream=out, log_every_s=3600) as display:
            with display.follow(run, title="async", total=6, poll_s=0.01) as row:
                worker = threading.Thread(target=train)
                worker.start()
                worker.join()
            assert row.step == 6 and row.accuracy == 0.6
        lines = out.getvalue().splitlines()
        assert [line.split()[2] for line in lines] == ["0/6", "3/6", "6/6"]
        assert all(line.startswith("[async] step") for line in lines)
        assert "9.0" not in out.getvalue()


def test_follower_skips_existing_records_and_steps_before_a_resume(tmp_path: Path) -> None:
    path = tmp_path / names.METRICS_FILE
    for step in (1, 2, 3, 4):
        _append(path, step)
    follower = MetricsFollower(tmp_path, skip_existing=True, after_step=2)
    assert follower.poll() == []
    # the resumed run truncates to its checkpoint (step 2) by replacing the file, then appends
    tmp = path.with_name("m.tmp")
    tmp.write_text(json.dumps({names.STEP: 1}) + "\n" + json.dumps({names.STEP: 2}) + "\n")
    os.replace(tmp, path)
    _append(path, 3)
    assert [r[names.STEP] for r in follower.poll()] == [3]
    _append(path, 4)
    assert [r[names.STEP] for r in follower.poll()] == [4]
    follower.close()


# --- sweeps ------------------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_sweep_eta() -> None:
    assert sweep_eta([], [], waiting=3) is None  # nothing to go on yet
    assert sweep_eta([], [(10.0, 0.0)], waiting=3) is None  # a cell still starting up
    # a running cell half done after 10 s: it needs 10 s more, each waiting cell 20 s
    assert sweep_eta([], [(10.0, 0.5)], waiting=2) == 10.0 + 2 * 20.0
    # finished cells set the per-cell cost; a running cell without steps costs the rest of it
    assert sweep_eta([30.0, 50.0], [(15.0, 0.0)], waiting=1) == (40.0 - 15.0) + 40.0
    assert sweep_eta([40.0], [], waiting=4, concurrency=2) == 80.0
    assert sweep_eta([40.0], [(60.0, 0.5)], waiting=0) == 60.0  # its own extrapolation: 120 s
    assert [format_duration(s) for s in (None, 4.4, 250, 7500)] == ["-", "4s", "4m10s", "2h05m"]


def test_grid_plain_lines_count_cells_and_show_the_eta() -> None:
    out, clock = io.StringIO(), _Clock()
    with GridProgress(3, done=1, stream=out, clock=clock, log_every_s=3600, title="sweep t") as p:
        p.start("lag=0", 4)
        clock.t = 10.0
        p.step("lag=0", 2)  # within log_every_s: no line
        clock.t = 20.0
        p.step("lag=0", 4)
        p.finish("lag=0", ok=True)
        p.start("lag=2", 4)
        clock.t = 25.0
        p.finish("lag=2", ok=False, note="RuntimeError: boom")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[sweep t] start lag=0  (cells 1/3  ETA -  running: lag=0 0/4)"
    assert lines[1] == "[sweep t] done lag=0 in 20s  (cells 2/3  ETA 20s)"  # one cell left, 20 s each
    assert lines[2].startswith("[sweep t] start lag=2  (cells 2/3  ETA 20s")
    assert lines[3] == "[sweep t] FAILED lag=2 in 5s: RuntimeError: boom  (cells 3/3 (1 failed)  ETA 0s)"
    assert len(lines) == 4


def test_grid_quiet_and_rich() -> None:
    out = _Tty()
    with GridProgress(2, enabled=False, stream=out) as p:
        p.start("a", 2)
        p.finish("a", ok=True)
    assert out.getvalue() == ""
    out = _Tty()
    with GridProgress(2, stream=out, title="sweep r") as p:
        assert p.mode == "rich"
        p.start("lag=0", 4)
        p.step("lag=0", 2)
        p.finish("lag=0", ok=True)
    text = out.getvalue()
    assert "sweep r" in text and "cells 1/2" in text and "done lag=0" in text
