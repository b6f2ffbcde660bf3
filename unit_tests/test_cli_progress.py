"""Live progress: rich on a TTY, plain periodic lines in logs, nothing when quiet."""

from __future__ import annotations

import io

from asyncrl.telemetry import names
from asyncrl.telemetry.progress import Progress, choose_mode, format_stats

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
