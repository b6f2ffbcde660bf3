"""Live progress, owned by the driver: of a run (step/total, samples/s, lag, ESS, loss, last eval,
ETA) and of a sweep (cells done/total, the running cells' steps, ETA).

The learner runs inside Ray Train workers whose output is not the user's terminal, so the
learner only writes ``RUN/metrics.jsonl`` and the driver shows it: ``Display.follow`` tails
that file from a background thread (``MetricsFollower``) into a row of the display. Nothing
else prints progress, so nothing is printed twice.

``Display`` is what ``run``, ``demo`` and ``pretrain`` show: rows added with ``row(title,
total)`` or ``follow(run_dir, ...)``. ``asyncrl.run(cfg, display=d)`` adds the run's row to a
caller's display (``with Display() as d: for cfg in configs: asyncrl.run(cfg, display=d)``);
rich allows one live display at a time, so a caller with a display passes it rather than
nesting. A sweep shows its grid with ``GridProgress`` (below) and runs its cells with
``telemetry.progress: false``.
Three modes, because a live bar is only useful to a person watching a terminal:

- ``rich``: one live bar per row with the latest figures and an ETA (stdout is a TTY);
- ``plain``: one line per row at every eval, at the last step, and at most every
  ``log_every_s`` seconds in between (CI, ``nohup``, a log file);
- ``off``: nothing (``--quiet``, ``telemetry.progress: false``).

``Progress`` is a display of one row (the learner-free loops: pretraining, users' own loops).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal

from asyncrl.telemetry import names

__all__ = [
    "Display",
    "GridProgress",
    "MetricsFollower",
    "Progress",
    "Row",
    "choose_mode",
    "format_duration",
    "format_stats",
    "sweep_eta",
]

Mode = Literal["auto", "rich", "plain", "off"]

#: the figures of a training row, in display order
RUN_FIELDS = ("samples/s", "lag", "ESS", "loss", "eval")
#: a supervised loop's figures (pretraining)
SUPERVISED_FIELDS = ("loss", "eval")


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


def format_stats(
    metrics: Mapping[str, Any],
    accuracy: float | None = None,
    *,
    eval_step: int | None = None,
    fields: Sequence[str] = RUN_FIELDS,
    eval_label: str = "eval",
) -> str:
    """One line of the figures a person watches, e.g.
    ``samples/s 35.2  lag 1.20/2  ESS 0.975  loss 0.4123  eval 0.550@20``.

    ``accuracy`` is the last eval figure seen (evals are sparse) and ``eval_step`` its step;
    ``eval_label`` names it (``eval``: exact match; ``rKL``: the agreement eval's per-token
    KL(student ‖ teacher) on held-out prompts). Missing values print ``-``, so a live line keeps
    its layout.
    """
    figures = {
        "samples/s": f"samples/s {_fmt(metrics.get(names.SAMPLES_PER_S), '.1f')}",
        "lag": f"lag {_fmt(metrics.get(names.LAG_MEAN), '.2f')}/{_fmt(metrics.get(names.LAG_MAX), '.0f')}",
        "ESS": f"ESS {_fmt(metrics.get(names.ESS_RHO), '.3f')}",
        "loss": f"loss {_fmt(metrics.get(names.LOSS), '.4g')}",
        "eval": f"{eval_label} {_fmt(accuracy, '.3f')}",
    }
    if accuracy is not None and eval_step is not None:
        figures["eval"] += f"@{eval_step}"
    return "  ".join(figures[f] for f in fields)


class Row:
    """One run (or loop) in a ``Display``: ``update(step, metrics)`` per step, ``done()`` at the end."""

    def __init__(self, display: Display, title: str, total: int, start: int, fields: Sequence[str]) -> None:
        self.display = display
        self.title = title
        self.total = int(total)
        self.start = int(start)
        self.fields = tuple(fields)
        self.step = int(start)
        self.accuracy: float | None = None
        self.eval_step: int | None = None
        self.eval_label = "eval"
        self._t0 = time.monotonic()
        self._last_print: float = self._t0
        self._printed_step: int | None = None
        self._task: Any = None
        if display.mode == "rich":
            self._task = display._bar.add_task(
                title, total=self.total, completed=self.start, stats=self.stats({})
            )

    def stats(self, metrics: Mapping[str, Any]) -> str:
        return format_stats(
            metrics, self.accuracy, eval_step=self.eval_step, fields=self.fields, eval_label=self.eval_label
        )

    def eta_s(self) -> float | None:
        """Seconds left at the rate since the row started (None before the first step)."""
        done = self.step - self.start
        if done <= 0:
            return None
        return (self.total - self.step) * (time.monotonic() - self._t0) / done

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """``step`` steps are done; ``metrics`` are that step's (an eval accuracy among them or not)."""
        self.step = int(step)
        acc = metrics.get(names.EVAL_ACCURACY)
        if acc is not None:
            self.accuracy, self.eval_step = float(acc), int(step)
        kl = metrics.get(names.EVAL_KL_REVERSE)
        if kl is not None:  # the agreement eval, measured at eval/step
            self.accuracy, self.eval_label = float(kl), "rKL"
            self.eval_step = int(metrics.get(names.EVAL_STEP, step))
        mode = self.display.mode
        if mode == "off":
            return
        stats = self.stats(metrics)
        if mode == "rich":
            self.display._bar.update(self._task, completed=self.step, stats=stats)
            return
        now = time.monotonic()
        due = now - self._last_print >= self.display.log_every_s
        shown = due or acc is not None or kl is not None or self.step >= self.total
        if shown and self._printed_step != self.step:
            self._last_print, self._printed_step = now, self.step
            eta = self.eta_s()
            tail = f"  eta {format_duration(eta)}" if eta is not None and self.step < self.total else ""
            self.display.print(f"[{self.title}] step {self.step}/{self.total}  {stats}{tail}")

    def done(self) -> None:
        """The row is finished: a rich bar stops its clock (it stays on screen)."""
        if self._task is not None and self.display._bar is not None:
            self.display._bar.stop_task(self._task)


class Display:
    """The driver's live view of one or more rows (see the module docstring).

    Args:
        enabled: False shows nothing (``--quiet``, ``telemetry.progress: false``).
        mode: ``auto`` (rich on a TTY, plain lines otherwise), ``rich``, ``plain`` or ``off``.
        stream: where to write (default stdout).
        log_every_s: longest gap between plain lines of a row (evals and the last step always print).
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        mode: Mode = "auto",
        stream: IO[str] | None = None,
        log_every_s: float = 60.0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.mode = choose_mode(mode, quiet=not enabled, stream=self.stream)
        self.log_every_s = log_every_s
        self._lock = threading.Lock()
        self._bar: Any = None
        if self.mode == "rich":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=Console(file=self.stream),
            )
            self._bar.start()

    def row(self, title: str, total: int, *, start: int = 0, fields: Sequence[str] = RUN_FIELDS) -> Row:
        """Add a row of ``total`` steps, ``start`` of them done (a resumed run)."""
        with self._lock:
            return Row(self, title, total, start, fields)

    def print(self, line: str) -> None:
        """A line above the live bars (or plain); used for plain progress lines and notes."""
        with self._lock:
            if self._bar is not None:
                self._bar.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=self.stream, flush=True)

    @contextmanager
    def follow(
        self,
        run_dir: str | Path,
        *,
        title: str,
        total: int,
        start: int = 0,
        poll_s: float = 0.25,
    ) -> Iterator[Row]:
        """Show the run writing ``run_dir`` for the duration of the ``with`` block: a thread tails
        ``RUN/metrics.jsonl`` (records already there when it starts belong to an earlier run and
        are skipped, as are steps ``<= start``) into a new row; the rest is read on exit."""
        row = self.row(title, total, start=start)
        follower = MetricsFollower(run_dir, skip_existing=True, after_step=start or None)
        stop = threading.Event()

        def pump() -> None:
            for record in follower.poll():
                row.update(int(record[names.STEP]), record)

        def loop() -> None:
            while not stop.wait(poll_s):
                pump()

        thread = threading.Thread(target=loop, name=f"asyncrl-follow-{title}", daemon=True)
        thread.start()
        try:
            yield row
        finally:
            stop.set()
            thread.join()
            pump()
            follower.close()
            row.done()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Display:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Progress:
    """A display of one row: ``update(step, metrics)`` per step, ``close()`` at the end.

    Args:
        total: steps of the loop; ``step`` in ``update`` counts completed steps.
        enabled, mode, stream, log_every_s: as in ``Display``.
        start: steps already done (a resumed run).
        title: the row's label.
        fields: the figures shown (``RUN_FIELDS`` by default; ``SUPERVISED_FIELDS`` for pretraining).
    """

    def __init__(
        self,
        total: int,
        *,
        enabled: bool = True,
        start: int = 0,
        mode: Mode = "auto",
        stream: IO[str] | None = None,
        log_every_s: float = 60.0,
        title: str = "train",
        fields: Sequence[str] = RUN_FIELDS,
    ) -> None:
        self.display = Display(enabled=enabled, mode=mode, stream=stream, log_every_s=log_every_s)
        self.mode = self.display.mode
        self._row = self.display.row(title, total, start=start, fields=fields)

    @property
    def accuracy(self) -> float | None:
        return self._row.accuracy

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._row.update(step, metrics)

    def close(self) -> None:
        self._row.done()
        self.display.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsFollower:
    """Incrementally read new, complete lines of ``RUN/metrics.jsonl`` (for a driver-side display).

    A partially written last line is left for the next ``poll``. A file truncated in place, or
    replaced (a fresh run deletes an earlier run's file; a resume rewrites it), is re-read from
    the start, skipping steps already returned. ``skip_existing``: what the file holds when the
    follower starts is not returned (an earlier run's records); ``after_step``: steps up to it
    are not returned (a resumed run's steps before its checkpoint).
    """

    def __init__(
        self, run_dir: str | Path, *, skip_existing: bool = False, after_step: int | None = None
    ) -> None:
        self.path = Path(run_dir) / names.METRICS_FILE
        self._file: IO[bytes] | None = None
        self._offset = 0
        self._last_step: int | None = after_step
        if skip_existing and self._open():
            self._offset = os.fstat(self._file.fileno()).st_size  # type: ignore[union-attr]

    def _open(self) -> bool:
        try:
            self._file = self.path.open("rb")
        except FileNotFoundError:
            self._file = None
        self._offset = 0
        return self._file is not None

    def _replaced(self) -> bool:
        """The path now names another file than the one held open (or none)."""
        try:
            now = self.path.stat()
        except FileNotFoundError:
            return True
        held = os.fstat(self._file.fileno())  # type: ignore[union-attr]
        return (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev)

    def poll(self) -> list[dict[str, Any]]:
        """Records appended since the last call (possibly none; the file may not exist yet)."""
        if self._file is None or self._replaced():
            if self._file is not None:
                self._file.close()
            if not self._open():
                return []
        f = self._file
        assert f is not None
        if os.fstat(f.fileno()).st_size < self._offset:  # truncated in place
            self._offset = 0
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

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
