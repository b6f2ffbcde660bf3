"""Live progress of a run: step/total, samples/s, lag, ESS, loss, accuracy.

Three modes, because a progress bar is only useful to a person watching a terminal:

- ``rich``: a live bar with the latest figures (stdout is a TTY and not quiet);
- ``plain``: one log line every ``log_every_s`` seconds and at the last step (stdout is
  not a TTY: CI, ``nohup``, a Ray job's driver log);
- ``off``: nothing (``--quiet``).

The learner runs inside Ray Train workers whose stdout is not the user's terminal, so the
driver can follow ``RUN/metrics.jsonl`` with ``MetricsFollower`` and feed a ``Progress``; in the
workers ``auto`` mode falls back to plain lines, which Ray forwards to the driver's log.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Literal

from asyncrl.telemetry import names

__all__ = ["MetricsFollower", "Progress", "choose_mode", "format_stats"]

Mode = Literal["auto", "rich", "plain", "off"]


def choose_mode(mode: Mode = "auto", *, quiet: bool = False, stream: IO[str] | None = None) -> str:
    """Resolve ``auto``: ``off`` when quiet, ``rich`` on a TTY, ``plain`` otherwise."""
    if quiet or mode == "off":
        return "off"
    if mode != "auto":
        return mode
    stream = stream if stream is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    return "rich" if callable(isatty) and isatty() else "plain"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_stats(metrics: Mapping[str, Any], accuracy: float | None = None) -> str:
    """One line of the figures a person watches: ``samples/s 35.2  lag 1.2/2  ESS 0.98  loss 0.41  acc 0.55``.

    ``accuracy`` is the last eval accuracy seen (eval steps are sparse); missing values print ``-``.
    """
    lag_max = metrics.get(names.LAG_MAX)
    parts = [
        f"samples/s {_fmt(metrics.get(names.SAMPLES_PER_S), '.1f')}",
        f"lag {_fmt(metrics.get(names.LAG_MEAN), '.2f')}/{_fmt(lag_max, '.0f')}",
        f"ESS {_fmt(metrics.get(names.ESS_RHO), '.3f')}",
        f"loss {_fmt(metrics.get(names.LOSS), '.4g')}",
        f"acc {_fmt(accuracy, '.3f')}",
    ]
    return "  ".join(parts)


class Progress:
    """Show a run's progress: call ``update(step, metrics)`` per learner step, ``close()`` at the end.

    Args:
        total: optimizer steps of the run; ``step`` in ``update`` counts completed steps.
        enabled: False shows nothing (``--quiet``, ``telemetry.progress: false``).
        start: steps already done (a resumed run).
        mode: ``auto`` (rich on a TTY, plain lines otherwise), ``rich``, ``plain`` or ``off``.
        stream: where to write (default stdout).
        log_every_s: seconds between plain lines (the last step and eval steps always print).
    """

    def __init__(
        self,
        total: int,
        *,
        enabled: bool = True,
        start: int = 0,
        mode: Mode = "auto",
        stream: IO[str] | None = None,
        log_every_s: float = 10.0,
        title: str = "train",
    ) -> None:
        self.total = int(total)
        self.stream = stream if stream is not None else sys.stdout
        self.mode = choose_mode(mode, quiet=not enabled, stream=self.stream)
        self.log_every_s = log_every_s
        self.title = title
        self.start = int(start)
        self.accuracy: float | None = None
        self._last_print: float | None = None
        self._bar: Any = None
        self._task: Any = None
        if self.mode == "rich":
            self._start_rich()

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = Console(file=self.stream)
        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            console=console,
        )
        self._bar.start()
        self._task = self._bar.add_task(
            self.title, total=self.total, completed=self.start, stats=format_stats({})
        )

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record that ``step`` steps are done, with that step's metrics."""
        acc = metrics.get(names.EVAL_ACCURACY)
        if acc is not None:
            self.accuracy = float(acc)
        if self.mode == "off":
            return
        stats = format_stats(metrics, self.accuracy)
        if self.mode == "rich":
            self._bar.update(self._task, completed=step, stats=stats)
            return
        now = time.monotonic()
        due = self._last_print is None or now - self._last_print >= self.log_every_s
        if due or step >= self.total or acc is not None:
            self._last_print = now
            print(f"[{self.title}] step {step}/{self.total}  {stats}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsFollower:
    """Incrementally read new, complete lines of ``RUN/metrics.jsonl`` (for a driver-side display).

    A partially written last line is left for the next ``poll``. A file truncated by a resume
    (smaller than what was read) is re-read from the start, skipping steps already returned.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / names.METRICS_FILE
        self._offset = 0
        self._last_step: int | None = None

    def poll(self) -> list[dict[str, Any]]:
        """Records appended since the last call (possibly none; the file may not exist yet)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset = 0
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        rows = []
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            step = row.get(names.STEP)
            if self._last_step is not None and step is not None and step <= self._last_step:
                continue
            self._last_step = step
            rows.append(row)
        return rows
