"""Live progress: rich on a TTY, plain periodic lines in logs, nothing when quiet."""

from __future__ import annotations

import io

from asyncrl.telemetry import names
from asyncrl.telemetry.progress import (
    GridProgress,
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
    line = format_stats(STEP_METRICS, accuracy=0.5)
    assert line == "samples/s 35.2  lag 1.20/2  ESS 0.975  loss 0.4123  acc 0.500"
    assert format_stats({}) == "samples/s -  lag -/-  ESS -  loss -  acc -"


def test_quiet_prints_nothing() -> None:
    out = _Tty()
    with Progress(3, enabled=False, stream=out) as p:
        for step in (1, 2, 3):
            p.update(step, STEP_METRICS)
    assert out.getvalue() == ""


def test_plain_lines_are_periodic_and_keep_the_last_accuracy() -> None:
    out = io.StringIO()
    with Progress(10, stream=out, log_every_s=3600) as p:
        for step in range(1, 11):
            m = dict(STEP_METRICS)
            if step == 5:
                m[names.EVAL_ACCURACY] = 0.75
            p.update(step, m)
    lines = out.getvalue().splitlines()
    # first step, the eval step and the last step; nothing in between within the hour
    assert [line.split()[2] for line in lines] == ["1/10", "5/10", "10/10"]
    assert lines[-1].endswith("acc 0.750")


def test_rich_bar_on_a_tty_shows_the_figures() -> None:
    out = _Tty()
    with Progress(4, stream=out, start=1, title="opd") as p:
        assert p.mode == "rich"
        for step in (2, 3, 4):
            p.update(step, {**STEP_METRICS, names.EVAL_ACCURACY: 0.5})
    text = out.getvalue()
    assert "opd" in text and "4/4" in text and "ESS 0.975" in text and "acc 0.500" in text


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
