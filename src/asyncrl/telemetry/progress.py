"""Live progress of a run (step/total, samples/s, lag, ESS, loss, accuracy) and of a sweep (cells
done/total, the running cells' steps, ETA).

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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

from asyncrl.telemetry import names

__all__ = [
    "GridProgress",
    "MetricsFollower",
    "Progress",
    "choose_mode",
    "format_duration",
    "format_stats",
    "sweep_eta",
]

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


# --- sweeps ---------------------------------------------------------------------------------------
def format_duration(seconds: float | None) -> str:
    """``45s``, ``4m10s``, ``2h05m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def sweep_eta(
    finished_s: Sequence[float], running: Sequence[tuple[float, float]], waiting: int, concurrency: int = 1
) -> float | None:
    """Seconds until a sweep is done, or None before anything can be estimated.

    A cell is estimated to take ``c`` = the mean wall time of the cells finished so far, else the mean
    over running cells of ``elapsed / fraction done``. A running cell needs the rest of its own
    extrapolation (``c`` if it has no steps yet); every waiting cell needs ``c``; the work is spread
    over ``concurrency`` slots. Start-up has no steps, so early extrapolations are optimistic.

    Args:
        finished_s: wall seconds of the cells run to the end (done or failed) by this invocation.
        running: (elapsed seconds, fraction of steps done) per running cell.
        waiting: cells not started yet.
    """
    extrapolated = [elapsed / frac for elapsed, frac in running if frac > 0]
    if finished_s:
        per_cell = sum(finished_s) / len(finished_s)
    elif extrapolated:
        per_cell = sum(extrapolated) / len(extrapolated)
    else:
        return None
    rest = sum(max(0.0, (elapsed / frac if frac > 0 else per_cell) - elapsed) for elapsed, frac in running)
    return (rest + waiting * per_cell) / max(1, concurrency)


class GridProgress:
    """Show a sweep's progress: ``start(cell, steps)``, ``step(cell, step)``, ``finish(cell, ok=...)``.

    Modes as ``Progress``: a rich bar over the cells (fractional while a cell trains) with the
    running cells, their steps and the ETA; plain lines at every cell start and end and every
    ``log_every_s`` seconds; nothing when ``enabled`` is False. Thread-safe: the sweep reports steps
    from a thread that follows the running cells' ``metrics.jsonl``.

    Args:
        total: cells in the sweep; ``done`` of them finished before this invocation (not rerun).
        concurrency: cells run at the same time (for the ETA).
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(
        self,
        total: int,
        *,
        done: int = 0,
        concurrency: int = 1,
        enabled: bool = True,
        mode: Mode = "auto",
        stream: IO[str] | None = None,
        log_every_s: float = 30.0,
        title: str = "sweep",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.done, self.failed = int(total), int(done), 0
        self.concurrency = concurrency
        self.stream = stream if stream is not None else sys.stdout
        self.mode = choose_mode(mode, quiet=not enabled, stream=self.stream)
        self.log_every_s = log_every_s
        self.title = title
        self.clock = clock
        self.finished_s: list[float] = []
        self.running: dict[str, tuple[float, int, int]] = {}  # cell -> (started at, step, steps)
        self._lock = threading.RLock()
        self._last_print: float | None = None
        self._bar: Any = None
        self._task: Any = None
        if self.mode == "rich":
            self._start_rich()

    @property
    def waiting(self) -> int:
        return self.total - self.done - self.failed - len(self.running)

    def eta_s(self) -> float | None:
        now = self.clock()
        running = [(now - t0, step / steps if steps else 0.0) for t0, step, steps in self.running.values()]
        return sweep_eta(self.finished_s, running, self.waiting, self.concurrency)

    def status(self) -> str:
        """``cells 3/10 (1 failed)  ETA 4m10s  running: a 12/60, b 3/60``."""
        failed = f" ({self.failed} failed)" if self.failed else ""
        parts = [
            f"cells {self.done + self.failed}/{self.total}{failed}",
            f"ETA {format_duration(self.eta_s())}",
        ]
        if self.running:
            parts.append(
                "running: " + ", ".join(f"{c} {step}/{steps}" for c, (_, step, steps) in self.running.items())
            )
        return "  ".join(parts)

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=Console(file=self.stream),
        )
        self._bar.start()
        self._task = self._bar.add_task(
            self.title, total=self.total, completed=self.done, status=self.status()
        )

    def _show(self, event: str | None = None) -> None:
        """Refresh the bar, or print ``event`` (a cell started/ended) or a periodic status line."""
        if self.mode == "rich":
            fraction = sum(step / steps for _, step, steps in self.running.values() if steps)
            self._bar.update(self._task, completed=self.done + self.failed + fraction, status=self.status())
            if event is not None:
                self._bar.console.print(f"[{self.title}] {event}", markup=False, highlight=False)
            return
        if self.mode != "plain":
            return
        now = self.clock()
        if event is None and self._last_print is not None and now - self._last_print < self.log_every_s:
            return
        self._last_print = now
        text = f"{event}  ({self.status()})" if event is not None else self.status()
        print(f"[{self.title}] {text}", file=self.stream, flush=True)

    def start(self, cell: str, steps: int) -> None:
        with self._lock:
            self.running[cell] = (self.clock(), 0, int(steps))
            self._show(f"start {cell}")

    def step(self, cell: str, step: int) -> None:
        with self._lock:
            if cell in self.running:
                t0, _, steps = self.running[cell]
                self.running[cell] = (t0, int(step), steps)
                self._show()

    def finish(self, cell: str, *, ok: bool, note: str = "") -> None:
        with self._lock:
            t0, _, _ = self.running.pop(cell, (self.clock(), 0, 0))
            wall = self.clock() - t0
            self.finished_s.append(wall)
            if ok:
                self.done += 1
            else:
                self.failed += 1
            what = "done" if ok else "FAILED"
            self._show(f"{what} {cell} in {format_duration(wall)}" + (f": {note}" if note else ""))

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None

    def __enter__(self) -> GridProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
